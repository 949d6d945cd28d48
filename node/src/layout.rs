//! The cluster's sync layout: which model layers are synchronized as which wire layer ids.
//! Every process of a cluster (coordinator, aggregators, workers, edge agents) derives the
//! same layout from the same model, so a `layer_id` means the same tensor everywhere: the
//! `i`-th layer that has parameters gets `layer_id = i`, its parameters flattened in order.
//!
//! A cluster may cap the size of a sync unit (`[model] sync_unit_kb`): a larger layer is then
//! split into row-aligned chunks, each its own wire layer id, so the layer map can spread
//! one large layer over several aggregators (as BytePS partitions large tensors). The ids
//! are renumbered in order, and every process derives the same split from the same setting.

use engine::model::{LayerInfo, Model};
use engine::replica::{read_unit, write_unit, ModelReplica, UnitData};

/// One synchronized layer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SyncLayerDef {
    /// Wire layer id.
    pub layer_id: u32,
    /// Index of the layer in [`Model::layers`].
    pub model_index: usize,
    /// Unit name (logs, payloads): the layer's name, with `[i/n]` for chunk `i` of `n`.
    pub name: String,
    /// The model layer's own name.
    pub layer_name: String,
    /// Where the unit starts in the layer's flattened parameters (0 unless a chunk).
    pub offset: usize,
    /// Number of f32 values of the unit.
    pub len: usize,
    /// Number of f32 values of the whole model layer (`len` unless a chunk).
    pub layer_len: usize,
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
/// are exactly the cluster's layout: same layers, names, model indices and lengths, in order
/// (the chunks of a split layer together cover it). The error names the first layer that
/// differs, so a node whose backend would exchange other tensors than the cluster's never
/// starts.
pub fn check_units_match(layout: &[SyncLayerDef], units: &[LayerInfo]) -> Result<(), String> {
    let layers: Vec<&SyncLayerDef> = layout.iter().filter(|d| d.offset == 0).collect();
    for (i, def) in layers.iter().enumerate() {
        let Some(u) = units.get(i) else {
            return Err(format!(
                "layer {} (`{}`, {} values) is missing from this node's model ({} units)",
                def.layer_id,
                def.layer_name,
                def.layer_len,
                units.len()
            ));
        };
        if u.name != def.layer_name || u.params != def.layer_len || u.index != def.model_index {
            return Err(format!(
                "layer {} differs: the cluster has `{}` ({} values, model layer {}), this node's \
                 model has `{}` ({} values, model layer {})",
                def.layer_id,
                def.layer_name,
                def.layer_len,
                def.model_index,
                u.name,
                u.params,
                u.index
            ));
        }
    }
    if let Some(extra) = units.get(layers.len()) {
        return Err(format!(
            "this node's model has a unit `{}` the cluster's layout does not ({} layers)",
            extra.name,
            layers.len()
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
            layer_name: name.clone(),
            name,
            offset: 0,
            len,
            layer_len: len,
            matrix_rows,
        })
        .collect()
}

/// The layout of `model` with every layer over `max_unit_values` values split into chunks
/// of at most that many, made of whole matrix rows (so a low-rank codec reads a chunk as
/// those rows; a row longer than the cap is one chunk by itself); `None`: [`sync_layout`].
/// The rows are spread evenly over the fewest chunks that fit; ids are renumbered in order.
pub fn sync_layout_split(model: &Model, max_unit_values: Option<usize>) -> Vec<SyncLayerDef> {
    let layout = sync_layout(model);
    let Some(max) = max_unit_values.filter(|&m| m > 0) else {
        return layout;
    };
    let mut out = Vec::with_capacity(layout.len());
    for def in layout {
        if def.len <= max {
            out.push(def);
            continue;
        }
        // Row length: the matrix view's (whole rows per chunk), else single values.
        let row_len = match def.matrix_rows {
            Some(_) => model.layers[def.model_index].layer.params()[0].shape[1..]
                .iter()
                .product::<usize>()
                .max(1),
            None => 1,
        };
        let lengths = engine::sync_units::chunk_lengths(def.len, row_len, max);
        let count = lengths.len();
        let mut offset = 0;
        for (i, len) in lengths.into_iter().enumerate() {
            out.push(SyncLayerDef {
                layer_id: 0,
                model_index: def.model_index,
                name: engine::sync_units::chunk_name(&def.layer_name, i, count),
                layer_name: def.layer_name.clone(),
                offset,
                len,
                layer_len: def.layer_len,
                matrix_rows: def
                    .matrix_rows
                    .and_then(|_| u32::try_from(len.div_ceil(row_len)).ok()),
            });
            offset += len;
        }
    }
    for (i, def) in out.iter_mut().enumerate() {
        def.layer_id = i as u32;
    }
    out
}

/// A unit's values in `model`.
pub fn unit_values(model: &Model, def: &SyncLayerDef) -> Vec<f32> {
    let values = model.layer_values(def.model_index);
    if def.offset == 0 && def.len == values.len() {
        return values;
    }
    values[def.offset..def.offset + def.len].to_vec()
}

/// Writes a unit's values into `model` (the rest of its layer unchanged).
pub fn set_unit_values(model: &mut Model, def: &SyncLayerDef, values: &[f32]) {
    if def.offset == 0 && def.len == def.layer_len {
        return model.set_layer_values(def.model_index, values);
    }
    let mut layer = model.layer_values(def.model_index);
    layer[def.offset..def.offset + def.len].copy_from_slice(values);
    model.set_layer_values(def.model_index, &layer);
}

/// A unit's values in a training replica.
pub fn read_sync_unit(model: &mut dyn ModelReplica, def: &SyncLayerDef) -> Vec<f32> {
    let values = read_unit(model, def.model_index, UnitData::Values);
    if def.offset == 0 && def.len == values.len() {
        return values;
    }
    values[def.offset..def.offset + def.len].to_vec()
}

/// Writes a unit's values into a training replica (the rest of its layer unchanged).
pub fn write_sync_unit(model: &mut dyn ModelReplica, def: &SyncLayerDef, values: &[f32]) {
    if def.offset == 0 && def.len == def.layer_len {
        return write_unit(model, def.model_index, UnitData::Values, values);
    }
    let mut layer = read_unit(model, def.model_index, UnitData::Values);
    layer[def.offset..def.offset + def.len].copy_from_slice(values);
    write_unit(model, def.model_index, UnitData::Values, &layer);
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
    fn a_split_layout_covers_each_layer_with_row_aligned_chunks_under_the_cap() {
        let model = engine::models::mlp::mlp(64, &[16, 8], 10, 0);
        let whole = sync_layout(&model);
        assert_eq!(sync_layout_split(&model, None), whole);
        assert_eq!(sync_layout_split(&model, Some(100_000)), whole);
        // fc1 is 17 rows of 64 (16 weight rows, the bias row); a cap of 300 values holds 4
        // rows, so 5 chunks of 4, 4, 3, 3, 3 rows.
        let split = sync_layout_split(&model, Some(300));
        let fc1: Vec<&SyncLayerDef> = split.iter().filter(|d| d.layer_name == "fc1").collect();
        assert_eq!(
            fc1.iter().map(|d| d.len).collect::<Vec<_>>(),
            vec![256, 256, 192, 192, 144]
        );
        assert_eq!(fc1[4].name, "fc1[4/5]");
        assert_eq!(
            fc1.iter().map(|d| d.matrix_rows).collect::<Vec<_>>(),
            [Some(4), Some(4), Some(3), Some(3), Some(3)]
        );
        assert_eq!(
            split.iter().map(|d| d.layer_id).collect::<Vec<_>>(),
            (0..split.len() as u32).collect::<Vec<_>>()
        );
        for def in &whole {
            let parts: Vec<&SyncLayerDef> = split
                .iter()
                .filter(|d| d.model_index == def.model_index)
                .collect();
            assert_eq!(parts.iter().map(|d| d.len).sum::<usize>(), def.len);
            let mut at = 0;
            for p in &parts {
                assert_eq!(p.offset, at, "{}", p.name);
                assert!(p.len <= 300 || parts.len() == 1, "{}", p.name);
                at += p.len;
            }
        }
        assert!(check_units_match(&split, &model.layer_infos()).is_ok());
        // The chunks read and write their part of the layer only.
        let mut model = model;
        let index = fc1[0].model_index;
        let before = model.layer_values(index);
        assert_eq!(unit_values(&model, fc1[1]), before[256..512].to_vec());
        set_unit_values(&mut model, fc1[1], &vec![7.0; 256]);
        let after = model.layer_values(index);
        assert_eq!(after[..256], before[..256]);
        assert!(after[256..512].iter().all(|&v| v == 7.0));
        assert_eq!(after[512..], before[512..]);
        let mut replica =
            engine::replica::BuiltinReplica::new(model, &engine::optim::OptimizerConfig::sgd());
        write_sync_unit(&mut replica, fc1[4], &vec![3.0; 144]);
        assert_eq!(read_sync_unit(&mut replica, fc1[4]), vec![3.0; 144]);
        assert_eq!(read_sync_unit(&mut replica, fc1[1]), vec![7.0; 256]);
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
