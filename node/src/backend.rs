//! Which compute backend a node's replicas run on, and building them behind the replica seam.
//!
//! This module owns [`Backend`] (`builtin`, or `tch` on a device: the CLI's `--backend` and
//! `--device`, a node config's `backend` / `device` keys), its parsing with errors that say
//! what is accepted, and [`Backend::build_replica`], which turns a [`Task`] into a boxed
//! [`ModelReplica`]. Everything above it (trainers, the node loop) sees only the seam. The tch
//! backend is compiled in only with the binary's `tch` feature; asking for it otherwise is a
//! typed error saying how to rebuild.

use std::fmt;

use engine::optim::OptimizerConfig;
use engine::replica::{BuiltinReplica, ModelReplica};
use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::task::Task;

/// A compute backend for a node's replicas.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "BackendSpec", into = "BackendSpec")]
pub enum Backend {
    /// The built-in CPU engine.
    #[default]
    Builtin,
    /// libtorch through tch on `device` (`cpu`, `cuda:N`).
    Tch {
        /// Device string as given.
        device: String,
    },
}

/// Why a backend could not be chosen or could not build a replica.
#[derive(Debug, Error)]
pub enum BackendError {
    /// An unknown backend name.
    #[error("unknown backend `{0}`: use `builtin` or `tch`")]
    Unknown(String),
    /// A device for the built-in backend other than the CPU.
    #[error("the builtin backend runs on the CPU only (got device `{0}`); use `--backend tch --device {0}` for a GPU")]
    BuiltinDevice(String),
    /// The tch backend failed (not compiled in, no CUDA, unsupported layer).
    #[error(transparent)]
    Tch(#[from] tch_backend::TchBackendError),
    /// The replica's data shard could not be set up (e.g. more shards than examples).
    #[error("data shard: {0}")]
    Shard(String),
    /// A model only the tch backend builds, asked of the built-in engine.
    #[error("model `{0}` needs the tch backend (the built-in engine has no BatchNorm or TorchScript): add `--backend tch`")]
    NeedsTch(String),
}

/// The serialized form: `backend = "tch"`, `device = "cuda:0"`.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct BackendSpec {
    backend: String,
    #[serde(default = "default_device")]
    device: String,
}

fn default_device() -> String {
    "cpu".into()
}

impl TryFrom<BackendSpec> for Backend {
    type Error = BackendError;
    fn try_from(s: BackendSpec) -> Result<Self, BackendError> {
        Backend::parse(&s.backend, &s.device)
    }
}

impl From<Backend> for BackendSpec {
    fn from(b: Backend) -> Self {
        match b {
            Backend::Builtin => BackendSpec {
                backend: "builtin".into(),
                device: "cpu".into(),
            },
            Backend::Tch { device } => BackendSpec {
                backend: "tch".into(),
                device,
            },
        }
    }
}

impl Backend {
    /// The backend named `name` on `device`.
    pub fn parse(name: &str, device: &str) -> Result<Self, BackendError> {
        match name {
            "builtin" => {
                if device == "cpu" {
                    Ok(Backend::Builtin)
                } else {
                    Err(BackendError::BuiltinDevice(device.into()))
                }
            }
            "tch" => Ok(Backend::Tch {
                device: device.into(),
            }),
            other => Err(BackendError::Unknown(other.into())),
        }
    }

    /// Backend name (`builtin`, `tch`).
    pub fn name(&self) -> &'static str {
        match self {
            Backend::Builtin => "builtin",
            Backend::Tch { .. } => "tch",
        }
    }

    /// Device string as given (`cpu` for the built-in backend); a comma-separated list for a
    /// mixed node ([`Self::for_worker`]).
    pub fn device(&self) -> &str {
        match self {
            Backend::Builtin => "cpu",
            Backend::Tch { device } => device,
        }
    }

    /// The entries of the device list (`cuda:0,cpu` → `cuda:0`, `cpu`); one for a plain device.
    pub fn devices(&self) -> Vec<&str> {
        self.device().split(',').map(str::trim).collect()
    }

    /// The backend worker `rank` of a node trains on: entry `rank mod n` of the device list, so
    /// `--device cuda:0,cpu` puts even workers on the GPU and odd ones on CPU threads (a mixed
    /// node; its workers exchange through a host-staged collective).
    pub fn for_worker(&self, rank: usize) -> Backend {
        match self {
            Backend::Tch { .. } => {
                let list = self.devices();
                Backend::Tch {
                    device: list[rank % list.len()].to_string(),
                }
            }
            Backend::Builtin => Backend::Builtin,
        }
    }

    /// True when the device list names more than one device kind or index.
    pub fn is_mixed(&self) -> bool {
        let list = self.devices();
        list.iter().any(|d| *d != list[0])
    }

    /// Checks the backend can run here (compiled in, every listed device present) without
    /// building a model.
    pub fn probe(&self) -> Result<(), BackendError> {
        match self {
            Backend::Builtin => Ok(()),
            Backend::Tch { .. } => {
                for d in self.devices() {
                    tch_backend::check_device(d)?;
                }
                Ok(())
            }
        }
    }

    /// A replica of `task`'s model built with `seed` (identical initial weights in every
    /// backend) and a fresh `optimizer` per unit.
    pub fn build_replica(
        &self,
        task: &Task,
        seed: u64,
        optimizer: &OptimizerConfig,
    ) -> Result<Box<dyn ModelReplica>, BackendError> {
        match self {
            Backend::Builtin if !task.model.is_builtin() => {
                Err(BackendError::NeedsTch(task.model.name().into()))
            }
            Backend::Builtin => Ok(Box::new(BuiltinReplica::new(
                task.build_model(seed),
                optimizer,
            ))),
            Backend::Tch { .. } => {
                let first = self.for_worker(0);
                tch_replica(task, seed, optimizer, first.device())
            }
        }
    }
}

#[cfg(feature = "tch")]
fn tch_replica(
    task: &Task,
    seed: u64,
    optimizer: &OptimizerConfig,
    device: &str,
) -> Result<Box<dyn ModelReplica>, BackendError> {
    use crate::task::{ModelKind, TaskData};
    use tch_backend::TchReplica;
    let replica = match (&task.model, &task.data) {
        (ModelKind::ResNet20, TaskData::Images(tt)) => {
            let s = &tt.train.sample_shape;
            if s.len() != 3 {
                return Err(BackendError::Tch(tch_backend::TchBackendError::Torch(format!(
                    "resnet20 takes [channels, height, width] images; data set {} has samples of shape {s:?}",
                    task.dataset
                ))));
            }
            TchReplica::resnet20(s[0], s[1], s[2], tt.train.classes, seed, optimizer, device)?
        }
        (ModelKind::TorchScript(path), _) => TchReplica::from_torchscript(path, optimizer, device)?,
        _ => TchReplica::from_model(&task.build_model(seed), optimizer, device)?,
    };
    Ok(Box::new(replica))
}

#[cfg(not(feature = "tch"))]
fn tch_replica(
    _task: &Task,
    _seed: u64,
    _optimizer: &OptimizerConfig,
    _device: &str,
) -> Result<Box<dyn ModelReplica>, BackendError> {
    Err(BackendError::Tch(tch_backend::TchBackendError::NotBuilt))
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} on {}", self.name(), self.device())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backends_parse_and_bad_names_say_what_is_accepted() {
        assert_eq!(Backend::parse("builtin", "cpu").unwrap(), Backend::Builtin);
        assert_eq!(
            Backend::parse("tch", "cuda:1").unwrap(),
            Backend::Tch {
                device: "cuda:1".into()
            }
        );
        let e = Backend::parse("torch", "cpu").unwrap_err().to_string();
        assert!(e.contains("builtin") && e.contains("tch"), "{e}");
        let e = Backend::parse("builtin", "cuda:0").unwrap_err().to_string();
        assert!(e.contains("--backend tch"), "{e}");
    }

    #[test]
    fn a_device_list_gives_each_worker_its_entry() {
        let mixed = Backend::parse("tch", "cuda:0, cpu").unwrap();
        assert_eq!(mixed.devices(), ["cuda:0", "cpu"]);
        assert!(mixed.is_mixed());
        let on = |r: usize| mixed.for_worker(r).device().to_string();
        assert_eq!(
            (on(0), on(1), on(2), on(3)),
            ("cuda:0".into(), "cpu".into(), "cuda:0".into(), "cpu".into())
        );
        let plain = Backend::parse("tch", "cuda:1").unwrap();
        assert!(!plain.is_mixed());
        assert_eq!(plain.for_worker(5), plain);
        assert_eq!(Backend::Builtin.for_worker(3), Backend::Builtin);
        // Every entry is probed: the GPU entry of a mixed list fails here like a plain one.
        if std::path::Path::new("/proc/driver/nvidia").exists() {
            return;
        }
        assert!(Backend::parse("tch", "cpu,cuda:0")
            .unwrap()
            .probe()
            .is_err());
    }

    #[test]
    fn a_backend_reads_from_a_node_config() {
        #[derive(Deserialize)]
        struct Cfg {
            #[serde(flatten)]
            backend: Backend,
        }
        let c: Cfg = toml::from_str("backend = \"tch\"\ndevice = \"cuda:0\"").unwrap();
        assert_eq!(c.backend.device(), "cuda:0");
        let e = toml::from_str::<Cfg>("backend = \"gpu\"")
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("unknown backend `gpu`"), "{e}");
    }
}
