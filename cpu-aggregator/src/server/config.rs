//! Configuration of an aggregator process (`dreamddp aggregator --config F`): TOML whose
//! unknown keys are errors naming the key, validated into an [`AggregatorConfig`].

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use engine::staleness::StalenessFn;
use node::cluster_model::{read_toml_with_overrides, ConfigFileError, ModelSection};
use protocol::Codec;
use serde::{Deserialize, Serialize};
use transport::config::{TransportSection, TransportSectionError};

use crate::config::{Aggregation, AggregatorConfig, OuterLrScaling};

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
    /// QUIC address this aggregator binds (e.g. `0.0.0.0:7001` on a multi-host cluster).
    pub listen: SocketAddr,
    /// The address nodes are told to dial, when it differs from `listen` (NAT, a load
    /// balancer). Absent: `listen`, with an unspecified IP (`0.0.0.0`, `::`) replaced by the
    /// local IP of the route to the coordinator.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub advertise: Option<SocketAddr>,
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
    /// `contributors` (default): `outer_lr` times a round's share of the nodes contributing
    /// now, so `outer_lr = 1` moves the model at the pace of their mean whatever their
    /// number (`cpu_aggregator::contributors`); `fixed`: `outer_lr` as is (asynchronous
    /// rounds then need `outer_lr` ≈ 1 / nodes).
    #[serde(default = "default_outer_lr_scaling")]
    pub outer_lr_scaling: OuterLrScaling,
    /// How a round is combined: `mean` (staleness- and sample-weighted mean) or `fedbuff`
    /// (the FedBuff server rule: the round's deltas weighted by s(τ), summed, divided by
    /// their count).
    #[serde(default = "default_rule")]
    pub rule: String,
    /// A round closed by its timeout with fewer distinct senders is not applied (its deltas
    /// are refused; FedAvg's minimum completion rate). 0: every round is applied.
    #[serde(default)]
    pub min_round_senders: usize,
    /// The shortest time between two versions of one layer sent to one subscriber,
    /// milliseconds. Versions applied meanwhile wait, the newest replacing the older (which
    /// is never sent), so what a subscriber receives per layer is bounded by this rate
    /// however many nodes feed the layer. 0 (default): the next version goes out as soon as
    /// the subscriber took the previous one.
    #[serde(default)]
    pub broadcast_interval_ms: u64,
    /// The most versions of one layer this aggregator sends per second over all its
    /// subscribers together: each subscriber's interval between two versions of a layer is
    /// at least subscribers / this (and at least `broadcast_interval_ms`), so the fan-out
    /// stays bounded as the fleet grows (1,000 by default: 4 ms with 3 subscribers, about
    /// 1 s with 1,000). 0: no bound but `broadcast_interval_ms`.
    #[serde(default = "default_fanout_per_layer_per_s")]
    pub fanout_per_layer_per_s: u64,
}

fn default_fanout_per_layer_per_s() -> u64 {
    1000
}

/// The shortest time between two versions of one layer sent to one subscriber: the
/// configured interval, or the fan-out budget shared by `subscribers`, whichever is longer.
pub fn version_interval(
    broadcast_interval_ms: u64,
    fanout_per_layer_per_s: u64,
    subscribers: usize,
) -> std::time::Duration {
    let configured = std::time::Duration::from_millis(broadcast_interval_ms);
    if fanout_per_layer_per_s == 0 {
        return configured;
    }
    let shared =
        std::time::Duration::from_secs_f64(subscribers as f64 / fanout_per_layer_per_s as f64);
    configured.max(shared)
}

fn default_rule() -> String {
    "mean".into()
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
fn default_outer_lr_scaling() -> OuterLrScaling {
    OuterLrScaling::Contributors
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
    /// QUIC transport tuning (flow-control windows sized for the link, congestion control).
    #[serde(default, skip_serializing_if = "is_default_transport")]
    pub transport: TransportSection,
}

fn is_default_transport(t: &TransportSection) -> bool {
    *t == TransportSection::default()
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
    /// A bad `[transport]` value (names the key).
    #[error(transparent)]
    Transport(#[from] TransportSectionError),
}

impl AggregatorRunConfig {
    /// Reads and validates a config file.
    pub fn load(path: &Path) -> Result<Self, AggregatorConfigError> {
        Self::load_with_overrides(path, &[])
    }

    /// [`Self::load`] with `--set KEY=VALUE` overrides (see
    /// [`node::cluster_model::read_toml_with_overrides`]).
    pub fn load_with_overrides(
        path: &Path,
        overrides: &[String],
    ) -> Result<Self, AggregatorConfigError> {
        let config: AggregatorRunConfig = read_toml_with_overrides(path, overrides)?;
        config.state_config()?;
        config.transport.to_config()?;
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
            outer_lr_scaling: a.outer_lr_scaling,
            round_size: a.round_size,
            round_timeout_ns: a.round_timeout_ms.saturating_mul(1_000_000),
            broadcast_codec: Codec::RawF32,
            send_version_on_resync: true,
            aggregation: match a.rule.as_str() {
                "mean" => Aggregation::WeightedMean,
                "fedbuff" => Aggregation::Buffered,
                other => {
                    return Err(AggregatorConfigError::Invalid(format!(
                        "aggregation.rule = {other:?}: use mean or fedbuff"
                    )))
                }
            },
            min_round_senders: a.min_round_senders,
        };
        config
            .validate()
            .map_err(|e| AggregatorConfigError::Invalid(e.to_string()))?;
        Ok(config)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use node::cluster_model::parse_toml;

    const GOOD: &str = r#"
[model]
model = "mlp"
dataset = "digits"

[node]
name = "agg-1"
id = 2
certs_dir = "certs"
data_dir = "run/agg-1"
listen = "127.0.0.1:7001"
coordinator = "127.0.0.1:7000"
credentials = "token"
"#;

    fn load(text: &str) -> Result<AggregatorRunConfig, AggregatorConfigError> {
        let dir = std::env::temp_dir().join(format!("ddp-aggcfg-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(format!("{:x}.toml", crc32c::crc32c(text.as_bytes())));
        std::fs::write(&path, text).unwrap();
        let result = AggregatorRunConfig::load(&path);
        let _ = std::fs::remove_file(&path);
        result
    }

    #[test]
    fn transport_section_is_optional_and_sizes_windows() {
        let c = load(GOOD).unwrap();
        assert_eq!(
            c.transport.to_config().unwrap(),
            transport::TransportConfig::default()
        );
        let c = load(&format!(
            "{GOOD}\n[transport]\nlink_mbps = 1000\nrtt_ms = 100\nreceive_window = 200000000\n"
        ))
        .unwrap();
        let t = c.transport.to_config().unwrap();
        assert_eq!(t.stream_receive_window, 25_000_000);
        assert_eq!(t.receive_window, 200_000_000);
        assert_eq!(t.send_window, 100_000_000);
    }

    #[test]
    fn bad_transport_values_name_the_key() {
        let e = load(&format!("{GOOD}\n[transport]\nlink_mbps = 0\nrtt_ms = 5\n")).unwrap_err();
        assert!(matches!(e, AggregatorConfigError::Transport(_)), "{e}");
        assert!(e.to_string().starts_with("transport.link_mbps"), "{e}");
        let e = load(&format!("{GOOD}\n[transport]\nrtt = 5\n")).unwrap_err();
        assert!(e.to_string().contains("rtt"), "{e}");
        let _ = parse_toml::<AggregatorRunConfig>(GOOD, Path::new("x")).unwrap();
    }

    #[test]
    fn the_version_interval_grows_with_the_subscribers_under_the_fanout_budget() {
        use std::time::Duration;
        let a = AggregationSection::default();
        assert_eq!(a.fanout_per_layer_per_s, 1000);
        assert_eq!(a.broadcast_interval_ms, 0);
        assert_eq!(version_interval(0, 1000, 4), Duration::from_millis(4));
        assert_eq!(version_interval(0, 1000, 1000), Duration::from_secs(1));
        // The configured interval wins when it is longer; 0 turns the budget off.
        assert_eq!(version_interval(500, 1000, 4), Duration::from_millis(500));
        assert_eq!(version_interval(0, 0, 1000), Duration::ZERO);
        assert_eq!(version_interval(0, 1000, 0), Duration::ZERO);
    }
}
