//! The `[model]` section every cluster process's config carries (coordinator, aggregators,
//! workers, edge agents): which model and data set the cluster trains and the seed of its
//! initial weights. Every process builds the same initial model from it, so the aggregators'
//! version 0 equals every node's starting point without shipping weights.

use std::path::{Path, PathBuf};

use serde::de::DeserializeOwned;
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

/// A process config file that could not be read or parsed.
#[derive(Debug, thiserror::Error)]
pub enum ConfigFileError {
    /// The file could not be read.
    #[error("cannot read {path}: {source}")]
    Read {
        /// File.
        path: PathBuf,
        /// Cause.
        source: std::io::Error,
    },
    /// TOML syntax or an unknown/missing key (the message names it and its line).
    #[error("{path}: {message}")]
    Parse {
        /// File.
        path: PathBuf,
        /// What toml said.
        message: String,
    },
}

/// Parses TOML config text (`path` only names the source in errors).
pub fn parse_toml<T: DeserializeOwned>(text: &str, path: &Path) -> Result<T, ConfigFileError> {
    toml::from_str(text).map_err(|e| ConfigFileError::Parse {
        path: path.to_path_buf(),
        message: e.to_string(),
    })
}

/// Reads and parses a TOML config file; every process config goes through here.
pub fn read_toml<T: DeserializeOwned>(path: &Path) -> Result<T, ConfigFileError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigFileError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    parse_toml(&text, path)
}

/// Writes `bytes` to `path` durably and atomically: a temp file beside it, fsync, rename,
/// fsync of the directory. After a crash the file holds either the old or the new bytes.
/// Used for every small durable state file of the cluster processes.
pub fn write_file_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    let tmp = path.with_extension("tmp");
    let mut f = std::fs::File::create(&tmp)?;
    f.write_all(bytes)?;
    f.sync_all()?;
    drop(f);
    std::fs::rename(&tmp, path)?;
    if let Some(dir) = path.parent() {
        if let Ok(d) = std::fs::File::open(dir) {
            let _ = d.sync_all();
        }
    }
    Ok(())
}
