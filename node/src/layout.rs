//! The cluster's sync layout: which model layers are synchronized as which wire layer ids.
//! Every process of a cluster (coordinator, aggregators, workers, edge agents) derives the
//! same layout from the same model, so a `layer_id` means the same tensor everywhere: the
//! `i`-th layer that has parameters gets `layer_id = i`, its parameters flattened in order.

use engine::model::{LayerInfo, Model};

/// One synchronized layer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SyncLayerDef {
    /// Wire layer id.
    pub layer_id: u32,
    /// Index of the layer in [`Model::layers`].
    pub model_index: usize,
    /// Layer name (logs, payloads).
    pub name: String,
    /// Number of f32 values (all its parameters, flattened).
    pub len: usize,
    /// Rows of the layer read as a matrix by a low-rank codec (`powersgd:R`): see
    /// [`lowrank_matrix_rows`]. `None`: the codec's `⌈√len⌉` default.
    pub matrix_rows: Option<u32>,
}

/// Rows of a layer's flattened parameters read as a matrix by a low-rank codec: the first
/// parameter's (the weight's) output dimension, plus one row per started row of the values
/// after it (the bias), so each matrix row is one of the weight's own rows. `None` for a
/// layer whose first parameter is a vector. The simulator and the real agents use this one
/// rule, so a `powersgd:R` delta is the same matrix in both.
pub fn lowrank_matrix_rows(first_param_shape: &[usize], len: usize) -> Option<u32> {
    let row_len: usize = first_param_shape.iter().skip(1).product();
    if first_param_shape.len() < 2 || row_len <= 1 {
        return None;
    }
    u32::try_from(len.div_ceil(row_len)).ok()
}

/// Checks that a replica's sync units (`ModelReplica::unit_infos`, e.g. of the tch backend)
/// are exactly the cluster's layout: same layers, names, model indices and lengths, in order.
/// The error names the first layer that differs, so a node whose backend would exchange other
/// tensors than the cluster's never starts.
pub fn check_units_match(layout: &[SyncLayerDef], units: &[LayerInfo]) -> Result<(), String> {
    for (i, def) in layout.iter().enumerate() {
        let Some(u) = units.get(i) else {
            return Err(format!(
                "layer {} (`{}`, {} values) is missing from this node's model ({} units)",
                def.layer_id,
                def.name,
                def.len,
                units.len()
            ));
        };
        if u.name != def.name || u.params != def.len || u.index != def.model_index {
            return Err(format!(
                "layer {} differs: the cluster has `{}` ({} values, model layer {}), this node's \
                 model has `{}` ({} values, model layer {})",
                def.layer_id, def.name, def.len, def.model_index, u.name, u.params, u.index
            ));
        }
    }
    if let Some(extra) = units.get(layout.len()) {
        return Err(format!(
            "this node's model has a unit `{}` the cluster's layout does not ({} layers)",
            extra.name,
            layout.len()
        ));
    }
    Ok(())
}

/// The layout of `model`.
pub fn sync_layout(model: &Model) -> Vec<SyncLayerDef> {
    model
        .layers
        .iter()
        .enumerate()
        .filter_map(|(model_index, l)| {
            let params = l.layer.params();
            let len: usize = params.iter().map(|p| p.value.len()).sum();
            let rows = params
                .first()
                .and_then(|p| lowrank_matrix_rows(&p.shape, len));
            (len > 0).then(|| (model_index, l.name.clone(), len, rows))
        })
        .enumerate()
        .map(|(i, (model_index, name, len, matrix_rows))| SyncLayerDef {
            layer_id: i as u32,
            model_index,
            name,
            len,
            matrix_rows,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::task::{load_data, ModelKind, Task};

    #[test]
    fn a_low_rank_codec_reads_each_layer_as_its_weights_rows_plus_a_bias_row() {
        let model = engine::models::mlp::mlp(64, &[16, 8], 10, 0);
        let layout = sync_layout(&model);
        // fc1: 16 × 64 weights + 16 biases = 1,040 values read as 17 rows of 64.
        let fc1 = &layout[0];
        assert_eq!(fc1.len, 16 * 64 + 16);
        let rows = fc1.matrix_rows.expect("a weight matrix");
        let first = model.layers[fc1.model_index].layer.params()[0]
            .shape
            .clone();
        assert_eq!(
            rows as usize,
            fc1.len.div_ceil(first[1..].iter().product()),
            "{first:?}"
        );
        assert_eq!(
            rows as usize,
            first[0] + 1,
            "one row per output plus the bias row"
        );
        // A vector-only layer has no matrix view.
        assert_eq!(lowrank_matrix_rows(&[10], 10), None);
        assert_eq!(lowrank_matrix_rows(&[4, 3, 3, 3], 4 * 27 + 4), Some(5));
    }

    #[test]
    fn a_replica_with_another_layout_is_refused_naming_the_first_differing_layer() {
        let model = engine::models::mlp::mlp(64, &[16, 8], 10, 0);
        let layout = sync_layout(&model);
        let units = model.layer_infos();
        assert!(check_units_match(&layout, &units).is_ok());
        let wider = engine::models::mlp::mlp(64, &[16, 9], 10, 0).layer_infos();
        let e = check_units_match(&layout, &wider).unwrap_err();
        assert!(
            e.contains("layer 1 differs") && e.contains("`fc2` (136 values"),
            "{e}"
        );
        let e = check_units_match(&layout, &units[..2]).unwrap_err();
        assert!(e.contains("`head`") && e.contains("missing"), "{e}");
        let e = check_units_match(&layout[..2], &units).unwrap_err();
        assert!(e.contains("unit `head`"), "{e}");
    }

    #[test]
    fn mlp_layout_numbers_parameterized_layers_in_order() {
        let task = Task::new(ModelKind::Mlp, "digits", load_data("digits", None).unwrap()).unwrap();
        let model = task.build_model(1);
        let layout = sync_layout(&model);
        assert_eq!(layout.len(), 4, "{layout:?}");
        assert_eq!(
            layout.iter().map(|l| l.layer_id).collect::<Vec<_>>(),
            vec![0, 1, 2, 3]
        );
        assert!(layout
            .windows(2)
            .all(|w| w[0].model_index < w[1].model_index));
        let total: usize = layout.iter().map(|l| l.len).sum();
        assert_eq!(total, model.param_count());
        for l in &layout {
            assert_eq!(model.layer_values(l.model_index).len(), l.len);
        }
    }
}
