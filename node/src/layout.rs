//! The cluster's sync layout: which model layers are synchronized as which wire layer ids.
//! Every process of a cluster (coordinator, aggregators, workers, edge agents) derives the
//! same layout from the same model, so a `layer_id` means the same tensor everywhere: the
//! `i`-th layer that has parameters gets `layer_id = i`, its parameters flattened in order.

use engine::model::Model;

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
}

/// The layout of `model`.
pub fn sync_layout(model: &Model) -> Vec<SyncLayerDef> {
    model
        .layers
        .iter()
        .enumerate()
        .filter_map(|(model_index, l)| {
            let len: usize = l.layer.params().iter().map(|p| p.value.len()).sum();
            (len > 0).then(|| (model_index, l.name.clone(), len))
        })
        .enumerate()
        .map(|(i, (model_index, name, len))| SyncLayerDef {
            layer_id: i as u32,
            model_index,
            name,
            len,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::task::{load_data, ModelKind, Task};

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
