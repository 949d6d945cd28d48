//! The `[model]` section every cluster process's config carries (coordinator, aggregators,
//! workers, edge agents): which model and data set the cluster trains and the seed of its
//! initial weights. Every process builds the same initial model from it, so the aggregators'
//! version 0 equals every node's starting point without shipping weights.
//!
//! An aggregator needs only the initial weights, never the data: [`ModelSection::initial_model`]
//! builds them from the model kind, the data set's *name* (which fixes the input and output
//! dimensions, [`ModelShape`]) and the seed, without reading a byte of the data set.

use std::path::{Path, PathBuf};

use engine::data::sampler::DataPartition;
use engine::model::Model;
use engine::models::gpt::{gpt_tiny, GptConfig};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::layout::{sync_layout_split, SyncLayerDef};
use crate::task::{load_data, resolve_dataset, ModelKind, Task};

/// Side of an MNIST image (28 × 28 pixels, one channel).
pub const MNIST_SIDE: usize = 28;
/// Characters in the tinyshakespeare vocabulary (nanoGPT's `shakespeare_char`: the sorted
/// distinct characters of `input.txt`).
pub const TINYSHAKESPEARE_VOCAB: usize = 65;

/// The input and output dimensions of a model, fixed by the data set's name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ModelShape {
    /// Images `[channels, height, width]` into `classes` logits.
    Images {
        /// `[channels, height, width]` of one sample.
        sample_shape: [usize; 3],
        /// Number of classes.
        classes: usize,
    },
    /// A character model over a vocabulary of `vocab` symbols.
    Chars {
        /// Vocabulary size.
        vocab: usize,
    },
}

impl ModelShape {
    /// The dimensions of the built-in data set `dataset` (`mnist`, `digits`,
    /// `tinyshakespeare`); the same numbers the data loaders produce.
    pub fn of_dataset(dataset: &str) -> Result<Self, String> {
        match dataset {
            "mnist" => Ok(ModelShape::Images {
                sample_shape: [1, MNIST_SIDE, MNIST_SIDE],
                classes: engine::data::mnist::CLASSES,
            }),
            "digits" => Ok(ModelShape::Images {
                sample_shape: [
                    1,
                    engine::data::digits::IMAGE_SIDE,
                    engine::data::digits::IMAGE_SIDE,
                ],
                classes: engine::data::digits::CLASSES,
            }),
            "tinyshakespeare" | "shakespeare" => Ok(ModelShape::Chars {
                vocab: TINYSHAKESPEARE_VOCAB,
            }),
            other => Err(format!(
                "unknown data set '{other}'; expected one of: mnist, digits, tinyshakespeare"
            )),
        }
    }

    /// Whether `kind` can be built with these dimensions; the error says why not.
    pub fn check(&self, kind: &ModelKind) -> Result<(), String> {
        match (kind, self) {
            (ModelKind::Mlp | ModelKind::Cnn, ModelShape::Images { .. })
            | (ModelKind::GptTiny, ModelShape::Chars { .. }) => Ok(()),
            (kind, _) if !kind.is_builtin() => Err(format!(
                "model '{}' is not supported in a cluster yet: cluster processes train the built-in \
                 models (mlp, cnn, gpt-tiny); train it with `dreamddp train --backend tch`",
                kind.name()
            )),
            (kind, shape) => Err(format!(
                "model '{}' does not fit data of shape {shape:?}: mlp and cnn take mnist or digits, gpt-tiny takes tinyshakespeare",
                kind.name()
            )),
        }
    }

    /// Builds `kind` with these dimensions and `seed`: the same weights as
    /// [`Task::build_model`] on the data set these dimensions came from.
    pub fn build(&self, kind: &ModelKind, seed: u64) -> Result<Model, String> {
        self.check(kind)?;
        match (kind, *self) {
            (
                ModelKind::Mlp,
                ModelShape::Images {
                    sample_shape,
                    classes,
                },
            ) => {
                let dim: usize = sample_shape.iter().product();
                let hidden: &[usize] = if dim >= 784 {
                    engine::models::mlp::MLP_MNIST_HIDDEN
                } else {
                    engine::models::mlp::MLP_DIGITS_HIDDEN
                };
                Ok(engine::models::mlp::mlp(dim, hidden, classes, seed))
            }
            (
                ModelKind::Cnn,
                ModelShape::Images {
                    sample_shape: [c, h, w],
                    classes,
                },
            ) => Ok(engine::models::cnn::cnn(c, h, w, classes, seed)),
            (ModelKind::GptTiny, ModelShape::Chars { vocab }) => {
                Ok(gpt_tiny(&GptConfig::tiny(vocab), seed))
            }
            (kind, shape) => Err(format!("model '{}' with {shape:?}", kind.name())),
        }
    }
}

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
    /// Largest sync unit, kB of f32 values: a larger layer is split into row-aligned chunks,
    /// each synchronized (and placed on an aggregator) on its own, so one large layer is
    /// spread over several aggregators. Unset: whole layers. The same on every process.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sync_unit_kb: Option<u64>,
}

fn default_dataset() -> String {
    "auto".into()
}
fn default_seed() -> u64 {
    1
}

impl ModelSection {
    /// Loads the task (model + data, the whole training set reshuffled every epoch). Errors
    /// say which model or data set failed and why.
    pub fn load_task(&self) -> Result<Task, String> {
        self.load_task_for(DataPartition::Reshuffled, 0..1, 1)
    }

    /// [`Self::load_task`] for ranks `ranks` of `world` dealt out as `partition` says: with
    /// [`DataPartition::Fixed`] only those ranks' training samples are read and held.
    pub fn load_task_for(
        &self,
        partition: DataPartition,
        ranks: std::ops::Range<usize>,
        world: usize,
    ) -> Result<Task, String> {
        let resolved = self.resolved()?;
        let kind: ModelKind = resolved.model.parse()?;
        let dir = resolved.data_dir.as_deref();
        let (data, sampling) = match partition {
            DataPartition::Reshuffled => (
                load_data(&resolved.dataset, dir)?,
                crate::data_shards::Sampling::whole(partition),
            ),
            DataPartition::Fixed => crate::data_shards::load_fixed_shards(
                &resolved.dataset,
                dir,
                ranks,
                world,
                resolved.seed,
            )?,
        };
        let mut task = Task::new(kind, &resolved.dataset, data)?;
        task.require_builtin("a cluster")?;
        task.sampling = sampling;
        Ok(task)
    }

    /// The cluster's initial model (the weights every process starts from), built from the
    /// model kind, the data set's name and the seed **without reading the data set** (only
    /// `auto` looks whether the MNIST folder exists). Aggregators use this; trainers, which
    /// need the data anyway, use [`Task::build_model`], which gives the same weights.
    pub fn initial_model(&self) -> Result<Model, String> {
        let (kind, shape) = self.kind_and_shape()?;
        shape.build(&kind, self.seed)
    }

    /// The model kind and its dimensions, checked to fit each other (cheap: builds nothing,
    /// reads no data).
    pub fn kind_and_shape(&self) -> Result<(ModelKind, ModelShape), String> {
        let resolved = self.resolved()?;
        let kind: ModelKind = resolved.model.parse()?;
        let shape = ModelShape::of_dataset(&resolved.dataset)?;
        shape.check(&kind)?;
        Ok((kind, shape))
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
            sync_unit_kb: self.sync_unit_kb,
        })
    }

    /// The cluster's sync layout of `model` (split by [`Self::sync_unit_kb`]).
    pub fn layout(&self, model: &Model) -> Vec<SyncLayerDef> {
        let max_values = self.sync_unit_kb.map(engine::sync_units::values_in_kib);
        sync_layout_split(model, max_values)
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
    /// A `--set KEY=VALUE` override that cannot be applied.
    #[error("--set {setting}: {message}")]
    Override {
        /// The override as given.
        setting: String,
        /// What is wrong with it.
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
    read_toml_with_overrides(path, &[])
}

/// [`read_toml`] with command-line overrides applied first: each `KEY=VALUE` sets the dotted
/// `KEY` (e.g. `node.listen`, `sync.deadline_ms`) to `VALUE`, read as a TOML value when it is
/// one (`500`, `true`, `"x"`, `[1, 2]`) and as a string otherwise (`127.0.0.1:7000`). The
/// result is checked like the file itself, so an unknown key is still an error naming it.
pub fn read_toml_with_overrides<T: DeserializeOwned>(
    path: &Path,
    overrides: &[String],
) -> Result<T, ConfigFileError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigFileError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    if overrides.is_empty() {
        return parse_toml(&text, path);
    }
    let text = apply_overrides(&text, path, overrides)?;
    parse_toml(&text, path)
}

/// Applies `KEY=VALUE` overrides to TOML text (see [`read_toml_with_overrides`]).
pub fn apply_overrides(
    text: &str,
    path: &Path,
    overrides: &[String],
) -> Result<String, ConfigFileError> {
    let mut table: toml::Table = parse_toml(text, path)?;
    for setting in overrides {
        let bad = |message: String| ConfigFileError::Override {
            setting: setting.clone(),
            message,
        };
        let (key, raw) = setting
            .split_once('=')
            .ok_or_else(|| bad("expected KEY=VALUE, e.g. node.listen=127.0.0.1:7000".into()))?;
        let parts: Vec<&str> = key.trim().split('.').collect();
        if parts.iter().any(|p| p.is_empty()) {
            return Err(bad(format!(
                "{key:?} is not a dotted key like sync.deadline_ms"
            )));
        }
        let value = match toml::from_str::<toml::Table>(&format!("v = {}", raw.trim())) {
            Ok(mut t) => t
                .remove("v")
                .unwrap_or(toml::Value::String(raw.trim().into())),
            Err(_) => toml::Value::String(raw.trim().into()),
        };
        let (last, tables) = parts.split_last().ok_or_else(|| bad("empty key".into()))?;
        let mut current = &mut table;
        for (i, part) in tables.iter().enumerate() {
            let entry = current
                .entry(part.to_string())
                .or_insert_with(|| toml::Value::Table(toml::Table::new()));
            current = entry
                .as_table_mut()
                .ok_or_else(|| bad(format!("{} is a value, not a table", parts[..=i].join("."))))?;
        }
        current.insert(last.to_string(), value);
    }
    toml::to_string(&table).map_err(|e| ConfigFileError::Parse {
        path: path.to_path_buf(),
        message: e.to_string(),
    })
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::sync_layout;

    #[test]
    fn overrides_set_nested_keys_with_typed_values_and_errors_name_the_setting() {
        let text = "[node]\nname = \"edge-1\"\n\n[sync]\ndeadline_ms = 500\n";
        let p = Path::new("edge.toml");
        let set = |o: &[&str]| {
            let o: Vec<String> = o.iter().map(|s| s.to_string()).collect();
            apply_overrides(text, p, &o).and_then(|t| parse_toml::<toml::Table>(&t, p))
        };
        let t = set(&[
            "sync.deadline_ms=900",
            "node.listen=127.0.0.1:7000",
            "sync.deadline_ms_by_layer.fc1 = 2000",
            "node.name=\"edge-9\"",
        ])
        .unwrap();
        assert_eq!(t["sync"]["deadline_ms"].as_integer(), Some(900));
        assert_eq!(t["node"]["listen"].as_str(), Some("127.0.0.1:7000"));
        assert_eq!(t["node"]["name"].as_str(), Some("edge-9"));
        assert_eq!(
            t["sync"]["deadline_ms_by_layer"]["fc1"].as_integer(),
            Some(2000)
        );
        for (bad, needle) in [
            ("no-equals-sign", "KEY=VALUE"),
            ("sync..x=1", "dotted key"),
            ("sync.deadline_ms.x=1", "sync.deadline_ms is a value"),
        ] {
            let e = set(&[bad]).unwrap_err().to_string();
            assert!(e.contains(bad) && e.contains(needle), "{e}");
        }
    }

    fn section(model: &str, dataset: &str, data_dir: Option<PathBuf>) -> ModelSection {
        ModelSection {
            model: model.into(),
            dataset: dataset.into(),
            data_dir,
            seed: 7,
            sync_unit_kb: None,
        }
    }

    /// The data-free build must give exactly the model a trainer builds from the data.
    fn assert_same_as_task(s: &ModelSection) {
        let from_data = s.load_task().unwrap().build_model(s.seed);
        let without = s.initial_model().unwrap();
        let (a, b) = (sync_layout(&from_data), sync_layout(&without));
        assert_eq!(a, b, "{} on {}", s.model, s.dataset);
        for l in &a {
            assert_eq!(
                from_data.layer_values(l.model_index),
                without.layer_values(l.model_index),
                "layer {} of {} on {}",
                l.name,
                s.model,
                s.dataset
            );
        }
    }

    #[test]
    fn initial_model_without_data_equals_the_trainers_model_on_digits() {
        assert_same_as_task(&section("mlp", "digits", None));
        assert_same_as_task(&section("cnn", "digits", None));
    }

    #[test]
    fn initial_model_without_data_equals_the_trainers_model_on_shared_data() {
        // Skips cleanly where the shared data sets are absent.
        let Some(dir) = engine::data::locate::shared_datasets_dir() else {
            return;
        };
        if dir.join("mnist").is_dir() {
            assert_same_as_task(&section("mlp", "mnist", Some(dir.clone())));
        }
        if dir.join("tinyshakespeare").is_dir() {
            assert_same_as_task(&section("gpt-tiny", "tinyshakespeare", Some(dir)));
        }
    }

    #[test]
    fn initial_model_reads_no_data() {
        // MNIST named explicitly in a folder that does not exist: the model still builds.
        let s = section(
            "mlp",
            "mnist",
            Some(PathBuf::from("/nonexistent/dreamddp-data")),
        );
        assert!(s.load_task().is_err());
        let model = s.initial_model().unwrap();
        let first = &sync_layout(&model)[0];
        assert_eq!(first.len, 784 * 512 + 512, "{first:?}");
    }

    #[test]
    fn mismatched_model_and_data_set_is_an_error() {
        let Err(e) = section("gpt-tiny", "mnist", None).initial_model() else {
            panic!("gpt-tiny on mnist must be refused");
        };
        assert!(e.contains("gpt-tiny"), "{e}");
        let Err(e) = section("mlp", "cifar", None).initial_model() else {
            panic!("an unknown data set must be refused");
        };
        assert!(e.contains("cifar"), "{e}");
    }
}
