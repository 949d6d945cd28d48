//! Configuration of a training node process (`dreamddp edge` / `dreamddp worker`): a TOML
//! file whose unknown keys are errors that name the key, plus validation with messages that
//! say what to change.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use protocol::Codec;
use serde::{Deserialize, Serialize};

pub use gpu_worker::cluster_model::ModelSection;
use gpu_worker::cluster_model::{parse_toml, read_toml, ConfigFileError};

/// Identity and addresses of one process.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct NodeSection {
    /// Node name: its certificate is `<certs_dir>/<name>.pem`.
    pub name: String,
    /// Node id on the wire (unique in the cluster).
    pub id: u64,
    /// Directory of the cluster CA and node certificates (`dreamddp certs`).
    pub certs_dir: PathBuf,
    /// Where this process keeps its durable state (weak-sync cache, seq incarnation, stats).
    pub data_dir: PathBuf,
    /// Coordinator address.
    pub coordinator: SocketAddr,
    /// The coordinator's node name (certificate CN).
    #[serde(default = "default_coordinator_name")]
    pub coordinator_name: String,
    /// Join credentials (the cluster's shared token).
    pub credentials: String,
    /// Local address to bind the QUIC endpoint to.
    #[serde(default = "default_bind")]
    pub bind: SocketAddr,
    /// Dial these addresses instead of the aggregators' own (e.g. through a lossy relay).
    #[serde(default)]
    pub address_overrides: HashMap<SocketAddr, SocketAddr>,
}

fn default_coordinator_name() -> String {
    "coordinator".into()
}
fn default_bind() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 0))
}

/// Local training.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct TrainingSection {
    /// Local workers (threads) of this node; an edge agent has 1.
    #[serde(default = "one")]
    pub workers: usize,
    /// This node's first data shard.
    pub first_rank: usize,
    /// Shards across the cluster (all workers of all nodes).
    pub world: usize,
    /// Optimizer steps.
    pub steps: u64,
    /// Per-worker batch size.
    #[serde(default = "default_batch")]
    pub batch_size: usize,
    /// SGD learning rate (momentum 0.9).
    #[serde(default = "default_lr")]
    pub lr: f32,
    /// Evaluate the local model every this many steps (0: only at the end).
    #[serde(default = "default_eval_every")]
    pub eval_every: u64,
    /// Test examples per evaluation.
    #[serde(default = "default_eval_limit")]
    pub eval_limit: usize,
}

fn one() -> usize {
    1
}
fn default_batch() -> usize {
    32
}
fn default_lr() -> f32 {
    0.05
}
fn default_eval_every() -> u64 {
    100
}
fn default_eval_limit() -> usize {
    2000
}

/// Cross-site synchronization.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct SyncSection {
    /// Every layer is exchanged once per this many steps (phases spread over the layers).
    #[serde(default = "default_period")]
    pub period_steps: u64,
    /// Deadline of one attempt of a layer exchange, milliseconds.
    #[serde(default = "default_deadline")]
    pub deadline_ms: u64,
    /// Per-layer deadline overrides by layer name, milliseconds.
    #[serde(default)]
    pub deadline_ms_by_layer: HashMap<String, u64>,
    /// Attempts before a delta is weak-synced into the cache.
    #[serde(default = "default_attempts")]
    pub max_attempts: u32,
    /// Codec of fresh deltas: `raw-f32`, `f16`, `bf16`, `zstd-f16`, ...
    #[serde(default = "default_codec")]
    pub codec: String,
    /// How often the cache is retried while links are down, milliseconds.
    #[serde(default = "default_flush")]
    pub flush_interval_ms: u64,
    /// After the last step, wait up to this long for the backlog to drain, seconds.
    #[serde(default = "default_drain")]
    pub drain_timeout_s: u64,
    /// Give up joining after this long, seconds.
    #[serde(default = "default_join_timeout")]
    pub join_timeout_s: u64,
    /// Stats report interval, milliseconds.
    #[serde(default = "default_stats")]
    pub stats_every_ms: u64,
}

fn default_period() -> u64 {
    4
}
fn default_deadline() -> u64 {
    500
}
fn default_attempts() -> u32 {
    3
}
fn default_codec() -> String {
    "raw-f32".into()
}
fn default_flush() -> u64 {
    500
}
fn default_drain() -> u64 {
    30
}
fn default_join_timeout() -> u64 {
    60
}
fn default_stats() -> u64 {
    1000
}

impl Default for SyncSection {
    fn default() -> Self {
        toml::from_str("").expect("every sync key has a default")
    }
}

/// A training node process's configuration file.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct NodeRunConfig {
    /// The cluster's model.
    pub model: ModelSection,
    /// This process.
    pub node: NodeSection,
    /// Local training.
    pub training: TrainingSection,
    /// Cross-site sync.
    #[serde(default)]
    pub sync: SyncSection,
}

/// A configuration that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum NodeConfigError {
    /// The file could not be read or parsed (names the file, key and line).
    #[error(transparent)]
    File(#[from] ConfigFileError),
    /// A value out of range.
    #[error("{key} = {value}: {why}")]
    Invalid {
        /// Dotted key.
        key: &'static str,
        /// The value given.
        value: String,
        /// What is expected.
        why: String,
    },
}

/// Parses a codec name as used in configs.
pub fn parse_codec(name: &str) -> Option<Codec> {
    Some(match name {
        "raw-f32" | "f32" => Codec::RawF32,
        "f16" => Codec::F16,
        "bf16" => Codec::Bf16,
        "zstd-f32" => Codec::ZstdRawF32,
        "zstd-f16" => Codec::ZstdF16,
        "zstd-bf16" => Codec::ZstdBf16,
        _ => return None,
    })
}

impl NodeRunConfig {
    /// Reads and validates a config file.
    pub fn load(path: &Path) -> Result<Self, NodeConfigError> {
        let config: NodeRunConfig = read_toml(path)?;
        config.validate()?;
        Ok(config)
    }

    /// Parses and validates config text (`path` is only used in messages).
    pub fn parse(text: &str, path: &Path) -> Result<Self, NodeConfigError> {
        let config: NodeRunConfig = parse_toml(text, path)?;
        config.validate()?;
        Ok(config)
    }

    /// Checks every value is usable.
    pub fn validate(&self) -> Result<(), NodeConfigError> {
        let t = &self.training;
        let s = &self.sync;
        let invalid = |key, value: String, why: &str| NodeConfigError::Invalid {
            key,
            value,
            why: why.into(),
        };
        if t.workers == 0 {
            return Err(invalid(
                "training.workers",
                "0".into(),
                "need at least 1 worker",
            ));
        }
        if t.first_rank + t.workers > t.world {
            return Err(invalid(
                "training.world",
                t.world.to_string(),
                &format!(
                    "must be at least first_rank + workers = {}",
                    t.first_rank + t.workers
                ),
            ));
        }
        if t.batch_size == 0 {
            return Err(invalid(
                "training.batch_size",
                "0".into(),
                "must be positive",
            ));
        }
        if !(t.lr.is_finite() && t.lr > 0.0) {
            return Err(invalid(
                "training.lr",
                t.lr.to_string(),
                "must be a positive number",
            ));
        }
        if s.period_steps == 0 {
            return Err(invalid(
                "sync.period_steps",
                "0".into(),
                "must be at least 1",
            ));
        }
        if s.deadline_ms == 0 {
            return Err(invalid("sync.deadline_ms", "0".into(), "must be positive"));
        }
        if s.max_attempts == 0 {
            return Err(invalid(
                "sync.max_attempts",
                "0".into(),
                "must be at least 1",
            ));
        }
        if parse_codec(&s.codec).is_none() {
            return Err(invalid(
                "sync.codec",
                s.codec.clone(),
                "use raw-f32, f16, bf16, zstd-f32, zstd-f16 or zstd-bf16",
            ));
        }
        if self.node.name.is_empty() {
            return Err(invalid("node.name", String::new(), "must not be empty"));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"
[model]
model = "mlp"
dataset = "digits"

[node]
name = "edge-1"
id = 11
certs_dir = "certs"
data_dir = "run/edge-1"
coordinator = "127.0.0.1:7000"
credentials = "token"

[training]
first_rank = 0
world = 1
steps = 10
"#;

    #[test]
    fn a_minimal_config_gets_defaults() {
        let c = NodeRunConfig::parse(GOOD, Path::new("x.toml")).unwrap();
        assert_eq!(c.sync.deadline_ms, 500);
        assert_eq!(c.sync.max_attempts, 3);
        assert_eq!(c.training.workers, 1);
        assert_eq!(c.node.coordinator_name, "coordinator");
    }

    #[test]
    fn unknown_keys_and_bad_values_are_named() {
        let text = GOOD.replace("steps = 10", "steps = 10\nstpes = 3");
        let e = NodeRunConfig::parse(&text, Path::new("x.toml")).unwrap_err();
        assert!(e.to_string().contains("stpes"), "{e}");
        let text = format!("{GOOD}\n[sync]\ncodec = \"mp3\"\n");
        let e = NodeRunConfig::parse(&text, Path::new("x.toml")).unwrap_err();
        assert!(e.to_string().contains("sync.codec = mp3"), "{e}");
        let text = GOOD.replace("world = 1", "world = 0");
        let e = NodeRunConfig::parse(&text, Path::new("x.toml")).unwrap_err();
        assert!(e.to_string().contains("training.world"), "{e}");
    }
}
