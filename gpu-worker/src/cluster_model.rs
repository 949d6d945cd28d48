//! The `[model]` section every cluster process's config carries (coordinator, aggregators,
//! workers, edge agents): which model and data set the cluster trains and the seed of its
//! initial weights. Every process builds the same initial model from it, so the aggregators'
//! version 0 equals every node's starting point without shipping weights.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::task::{load_data, resolve_dataset, ModelKind, Task};

/// Which model and data the whole cluster trains (identical in every process's config).
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ModelSection {
    /// Model: `mlp`, `cnn` or `gpt-tiny`.
    pub model: String,
    /// Data set: `mnist`, `digits`, `tinyshakespeare` or `auto` (MNIST when the shared data
    /// is present, else the embedded digits).
    #[serde(default = "default_dataset")]
    pub dataset: String,
    /// Where the data sets live (default: the shared data folder if found, else the
    /// embedded digits).
    #[serde(default)]
    pub data_dir: Option<PathBuf>,
    /// Seed of the initial weights and data order (must be the same on every process).
    #[serde(default = "default_seed")]
    pub seed: u64,
}

fn default_dataset() -> String {
    "auto".into()
}
fn default_seed() -> u64 {
    1
}

impl ModelSection {
    /// Loads the task (model + data). Errors say which model or data set failed and why.
    pub fn load_task(&self) -> Result<Task, String> {
        let resolved = self.resolved()?;
        let kind: ModelKind = resolved.model.parse()?;
        let data = load_data(&resolved.dataset, resolved.data_dir.as_deref())?;
        Task::new(kind, &resolved.dataset, data)
    }

    /// The same section with `auto` and the default data folder resolved (what a cluster
    /// launcher writes into every process's config, so they all load the same data).
    pub fn resolved(&self) -> Result<ModelSection, String> {
        let kind: ModelKind = self.model.parse()?;
        let data_dir = self
            .data_dir
            .clone()
            .or_else(engine::data::locate::shared_datasets_dir);
        let dataset = resolve_dataset(&kind, &self.dataset, data_dir.as_deref());
        Ok(ModelSection {
            model: self.model.clone(),
            dataset,
            data_dir,
            seed: self.seed,
        })
    }
}
