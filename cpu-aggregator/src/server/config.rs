//! Configuration of an aggregator process (`dreamddp aggregator --config F`): TOML whose
//! unknown keys are errors naming the key, validated into an [`AggregatorConfig`].

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use engine::staleness::StalenessFn;
use gpu_worker::cluster_model::{read_toml, ConfigFileError, ModelSection};
use protocol::Codec;
use serde::{Deserialize, Serialize};

use crate::config::AggregatorConfig;

/// Identity and addresses of the aggregator process.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct AggregatorNodeSection {
    /// Node name: its certificate is `<certs_dir>/<name>.pem`.
    pub name: String,
    /// Node id on the wire.
    pub id: u64,
    /// Directory of the cluster CA and certificates.
    pub certs_dir: PathBuf,
    /// Where the shard file lives.
    pub data_dir: PathBuf,
    /// QUIC address nodes connect to.
    pub listen: SocketAddr,
    /// Coordinator address.
    pub coordinator: SocketAddr,
    /// The coordinator's node name.
    #[serde(default = "default_coordinator_name")]
    pub coordinator_name: String,
    /// Join credentials.
    pub credentials: String,
}

fn default_coordinator_name() -> String {
    "coordinator".into()
}

/// How deltas are averaged.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct AggregationSection {
    /// `poly` (s(τ) = (1+τ)^−a), `hinge` or `constant`.
    #[serde(default = "default_staleness")]
    pub staleness: String,
    /// Exponent/slope `a`.
    #[serde(default = "default_a")]
    pub a: f64,
    /// Hinge `b`.
    #[serde(default)]
    pub b: f64,
    /// Deltas more than this many versions behind are refused (sender re-syncs).
    #[serde(default = "default_tau_max")]
    pub tau_max: u64,
    /// Distinct senders that close a round (1 = apply each delta on arrival).
    #[serde(default = "default_round_size")]
    pub round_size: usize,
    /// A round is applied this long after its first delta, milliseconds.
    #[serde(default = "default_round_timeout")]
    pub round_timeout_ms: u64,
    /// Outer learning rate.
    #[serde(default = "default_outer_lr")]
    pub outer_lr: f32,
}

fn default_staleness() -> String {
    "poly".into()
}
fn default_a() -> f64 {
    0.5
}
fn default_tau_max() -> u64 {
    16
}
fn default_round_size() -> usize {
    1
}
fn default_round_timeout() -> u64 {
    1000
}
fn default_outer_lr() -> f32 {
    1.0
}

impl Default for AggregationSection {
    fn default() -> Self {
        toml::from_str("").expect("every aggregation key has a default")
    }
}

/// An aggregator process's configuration file.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct AggregatorRunConfig {
    /// The cluster's model (for the initial values of adopted layers).
    pub model: ModelSection,
    /// This process.
    pub node: AggregatorNodeSection,
    /// Averaging.
    #[serde(default)]
    pub aggregation: AggregationSection,
}

/// A configuration that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum AggregatorConfigError {
    /// The file could not be read or parsed (names the file, key and line).
    #[error(transparent)]
    File(#[from] ConfigFileError),
    /// A value out of range.
    #[error("aggregation: {0}")]
    Invalid(String),
}

impl AggregatorRunConfig {
    /// Reads and validates a config file.
    pub fn load(path: &Path) -> Result<Self, AggregatorConfigError> {
        let config: AggregatorRunConfig = read_toml(path)?;
        config.state_config()?;
        Ok(config)
    }

    /// The state machine's configuration.
    pub fn state_config(&self) -> Result<AggregatorConfig, AggregatorConfigError> {
        let a = &self.aggregation;
        let staleness = match a.staleness.as_str() {
            "poly" | "polynomial" => StalenessFn::Polynomial { a: a.a },
            "hinge" => StalenessFn::Hinge { a: a.a, b: a.b },
            "constant" => StalenessFn::Constant,
            other => {
                return Err(AggregatorConfigError::Invalid(format!(
                    "staleness = {other:?}: use poly, hinge or constant"
                )))
            }
        };
        let config = AggregatorConfig {
            staleness,
            tau_max: a.tau_max,
            outer_lr: a.outer_lr,
            round_size: a.round_size,
            round_timeout_ns: a.round_timeout_ms.saturating_mul(1_000_000),
            broadcast_codec: Codec::RawF32,
            send_version_on_resync: true,
        };
        config
            .validate()
            .map_err(|e| AggregatorConfigError::Invalid(e.to_string()))?;
        Ok(config)
    }
}
