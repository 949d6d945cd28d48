//! The initial (version 0) values of the layers an aggregator may come to own, built lazily
//! from the cluster's `[model]` section — model kind, data set name and seed — **without
//! reading the data set** ([`ModelSection::initial_model`]).
//!
//! A fresh aggregator builds them before it listens (the coordinator's first layer map needs
//! them at once). A restarted aggregator that found its shard file does not build them at
//! all: its layers come from the file. Only if the coordinator later assigns it a layer the
//! file does not hold (a rebalance with no version to hand over) are they built then.

use std::collections::HashMap;

use node::cluster_model::ModelSection;
use node::layout::{unit_values, SyncLayerDef};

/// The cluster's sync layout and initial layer values, built on first use.
#[derive(Debug)]
pub struct InitialLayers {
    model: ModelSection,
    built: Option<Built>,
}

#[derive(Debug)]
struct Built {
    layout: Vec<SyncLayerDef>,
    values: HashMap<u32, Vec<f32>>,
}

impl InitialLayers {
    /// Checks that `model` names a buildable model (cheap: builds nothing, reads no data).
    pub fn new(model: ModelSection) -> Result<Self, String> {
        model.kind_and_shape()?;
        Ok(InitialLayers { model, built: None })
    }

    /// Whether the initial weights have been built.
    pub fn is_built(&self) -> bool {
        self.built.is_some()
    }

    /// Builds the initial weights now if not yet built.
    pub fn build(&mut self) -> Result<(), String> {
        if self.built.is_none() {
            let model = self.model.initial_model()?;
            let layout = self.model.layout(&model);
            let values = layout
                .iter()
                .map(|l| (l.layer_id, unit_values(&model, l)))
                .collect();
            self.built = Some(Built { layout, values });
        }
        Ok(())
    }

    /// The sync layout (builds the initial weights on first use).
    pub fn layout(&mut self) -> Result<&[SyncLayerDef], String> {
        self.build()?;
        Ok(self.built.as_ref().map_or(&[], |b| b.layout.as_slice()))
    }

    /// The initial values of `layer_id` (builds on first use); `None` for an unknown layer.
    pub fn values(&mut self, layer_id: u32) -> Result<Option<&[f32]>, String> {
        self.build()?;
        Ok(self
            .built
            .as_ref()
            .and_then(|b| b.values.get(&layer_id))
            .map(Vec::as_slice))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn digits_mlp() -> ModelSection {
        ModelSection {
            model: "mlp".into(),
            dataset: "digits".into(),
            data_dir: None,
            seed: 3,
            sync_unit_kb: None,
        }
    }

    #[test]
    fn builds_only_on_first_use_and_matches_the_model() {
        let mut initial = InitialLayers::new(digits_mlp()).unwrap();
        assert!(!initial.is_built());
        let layout = initial.layout().unwrap().to_vec();
        assert!(initial.is_built());
        assert_eq!(layout.len(), 4);
        let model = digits_mlp().initial_model().unwrap();
        for l in &layout {
            assert_eq!(
                initial.values(l.layer_id).unwrap().unwrap(),
                model.layer_values(l.model_index).as_slice()
            );
        }
        assert!(initial.values(99).unwrap().is_none());
    }

    #[test]
    fn a_model_that_cannot_be_built_is_refused_up_front() {
        let mut bad = digits_mlp();
        bad.model = "gpt-tiny".into();
        let e = InitialLayers::new(bad).unwrap_err();
        assert!(e.contains("gpt-tiny"), "{e}");
    }
}
