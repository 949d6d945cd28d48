//! Configuration of a training node process (`dreamddp edge` / `dreamddp worker`): a TOML
//! file whose unknown keys are errors that name the key, plus validation with messages that
//! say what to change.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use protocol::Codec;
use serde::{Deserialize, Serialize};
pub use transport::config::{TransportSection, TransportSectionError};

pub use node::cluster_model::ModelSection;
use node::cluster_model::{parse_toml, read_toml_with_overrides, ConfigFileError};

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
    /// CPU niceness the process runs at (0 = unchanged … 19 = lowest). `dreamddp cluster`
    /// sets its `[cluster] trainer_nice` here: on one machine the trainers stand in for
    /// devices with CPUs of their own, and the servers they talk to get the CPU first.
    #[serde(default)]
    pub nice: i32,
    /// Wall-clock time (Unix milliseconds) before which the node does not join: it loads its
    /// data and model, then waits for it. `dreamddp cluster` gives every trainer of a run one
    /// common start, when its relay's trace starts too. A node that gets there later (a
    /// restart) joins at once. Absent: at once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_at_unix_ms: Option<u64>,
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
    /// How the training samples are dealt to the cluster's ranks: `reshuffled` (default; a
    /// new permutation of the whole set every epoch, so the process holds all of it) or
    /// `fixed` (each rank keeps its own shard, as a device owns its data: the process reads
    /// and holds only its ranks' samples).
    #[serde(default)]
    pub data_partition: engine::data::sampler::DataPartition,
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
    /// Compute backend of this node's replicas: `builtin` or `tch` (a binary built with
    /// `--features tch`). Nodes of one cluster may differ: they exchange the same layers.
    #[serde(default = "default_backend")]
    pub backend: String,
    /// Device of the tch backend: `cpu` or `cuda:N`.
    #[serde(default = "default_device")]
    pub device: String,
    /// Optimizer (default: SGD with momentum 0.9), e.g. `{ kind = "sgd", momentum = 0.9,
    /// nesterov = true }` or `{ kind = "adamw" }`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub optimizer: Option<engine::optim::OptimizerConfig>,
    /// Learning-rate schedule (linear warmup, cosine decay to `min_lr` at `total_steps`);
    /// replaces the constant `lr` when given.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lr_schedule: Option<engine::lr::LrSchedule>,
    /// Pad every step to a device class's modelled step time (`[training.pace]`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pace: Option<super::pacing::PaceSection>,
}

fn default_backend() -> String {
    "builtin".into()
}
fn default_device() -> String {
    "cpu".into()
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
    /// Deadline of one attempt of a layer exchange, milliseconds: every attempt's with
    /// `deadline_mode = "fixed"`, the starting value with `"adaptive"`.
    #[serde(default = "default_deadline")]
    pub deadline_ms: u64,
    /// `adaptive` (default): per layer, median + k·MAD of the observed delta→ack times,
    /// between `deadline_min_ms` and `deadline_max_ms`, with Karn's backoff; `fixed`: always
    /// `deadline_ms` (or the per-layer override).
    #[serde(default = "default_deadline_mode")]
    pub deadline_mode: String,
    /// Lower bound of an adaptive deadline, milliseconds.
    #[serde(default = "default_deadline_min")]
    pub deadline_min_ms: u64,
    /// Upper bound of an adaptive deadline, milliseconds.
    #[serde(default = "default_deadline_max")]
    pub deadline_max_ms: u64,
    /// `k` of an adaptive deadline (robust standard deviations above the median).
    #[serde(default = "default_deadline_k")]
    pub deadline_k: f64,
    /// Per-layer deadline overrides by layer name, milliseconds.
    #[serde(default)]
    pub deadline_ms_by_layer: HashMap<String, u64>,
    /// Attempts before a delta is weak-synced into the cache.
    #[serde(default = "default_attempts")]
    pub max_attempts: u32,
    /// Codec of fresh deltas: `raw-f32`, `f16`, `bf16`, `zstd-f32`, `zstd-f16`, `zstd-bf16`,
    /// `powersgd:R` (rank-R factors of each delta read as a ⌈√len⌉-row matrix, with error
    /// feedback), or `topk:F` (each delta carries only the `ceil(F · len)` largest-magnitude elements of
    /// each layer, `0 < F ≤ 1`, with error feedback; see [`DeltaCodec::TopK`]).
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
    /// Memory sled may use for its page cache of the weak-sync cache, MiB (sled's own default
    /// is 1 GiB; the backlog itself lives on disk).
    #[serde(default = "default_cache_capacity_mb")]
    pub cache_capacity_mb: u64,
    /// Hard staleness bound `T_ℓ` in steps: a layer not cut for this many steps is cut at
    /// the next step end whatever its phase (`edge_agent::early_sync`). Absent: off.
    #[serde(default)]
    pub max_stale_steps: Option<u64>,
    /// Per-layer staleness bounds by layer name (steps), overriding `max_stale_steps`.
    #[serde(default)]
    pub max_stale_steps_by_layer: HashMap<String, u64>,
    /// Drift trigger: a layer whose progress since its last cut has cosine below this with
    /// its last delta is cut early (-1 … 1). Absent: off.
    #[serde(default)]
    pub drift_cosine: Option<f32>,
    /// Learning-rate damping by staleness: a layer `s` periods without a new global version
    /// trains at `lr · lr_damping^s` (e.g. 0.9). Absent: off.
    #[serde(default)]
    pub lr_damping: Option<f32>,
    /// Synchronous rounds (`blocking`, `fedavg-deadline`): every layer is cut at the same
    /// step (no phase spread) and training waits after each cut until the round is over
    /// ([`crate::SyncClient::round_complete`]). Pair it with an aggregator `round_size` equal
    /// to the number of trainers. Default false (elastic).
    #[serde(default)]
    pub wait_for_round: bool,
    /// FedBuff's client rule (`fedbuff`, Nguyen et al. 2022): every layer is cut at the same
    /// step (no phase spread), each local round of `period_steps` trains on the global model
    /// it started from, and global versions that arrive meanwhile wait for the round's cut;
    /// the next round starts from the newest. Pair it with `[aggregation] rule = "fedbuff"`.
    /// Default false.
    #[serde(default)]
    pub restart_from_global: bool,
}

fn default_deadline_mode() -> String {
    "adaptive".into()
}
fn default_deadline_min() -> u64 {
    50
}
fn default_deadline_max() -> u64 {
    30_000
}
fn default_deadline_k() -> f64 {
    4.0
}

impl SyncSection {
    /// The deadline policy these keys describe (names the bad key otherwise).
    pub fn deadline_policy(&self) -> Result<crate::deadline::DeadlinePolicy, NodeConfigError> {
        use crate::deadline::{AdaptiveDeadline, DeadlinePolicy};
        let invalid = |key, value: String, why: &str| NodeConfigError::Invalid {
            key,
            value,
            why: why.into(),
        };
        match self.deadline_mode.as_str() {
            "fixed" => Ok(DeadlinePolicy::Fixed),
            "adaptive" => {
                if self.deadline_min_ms == 0 || self.deadline_min_ms > self.deadline_max_ms {
                    return Err(invalid(
                        "sync.deadline_min_ms",
                        self.deadline_min_ms.to_string(),
                        &format!(
                            "must be at least 1 and at most sync.deadline_max_ms = {}",
                            self.deadline_max_ms
                        ),
                    ));
                }
                if !(self.deadline_k.is_finite() && self.deadline_k >= 0.0) {
                    return Err(invalid(
                        "sync.deadline_k",
                        self.deadline_k.to_string(),
                        "must be a number >= 0 (4 is a good start)",
                    ));
                }
                Ok(DeadlinePolicy::Adaptive(AdaptiveDeadline {
                    k: self.deadline_k,
                    min_ns: self.deadline_min_ms * 1_000_000,
                    max_ns: self.deadline_max_ms * 1_000_000,
                    ..AdaptiveDeadline::default()
                }))
            }
            other => Err(invalid(
                "sync.deadline_mode",
                format!("{other:?}"),
                "use \"adaptive\" or \"fixed\"",
            )),
        }
    }
}

fn default_cache_capacity_mb() -> u64 {
    crate::durable_cache::DEFAULT_CAPACITY_BYTES >> 20
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
    /// QUIC transport tuning (flow-control windows sized for the link, congestion control).
    #[serde(default, skip_serializing_if = "is_default_transport")]
    pub transport: TransportSection,
}

fn is_default_transport(t: &TransportSection) -> bool {
    *t == TransportSection::default()
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
    /// A bad `[transport]` value (names the key).
    #[error(transparent)]
    Transport(#[from] TransportSectionError),
}

/// How fresh deltas are encoded (`sync.codec`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum DeltaCodec {
    /// Every element, in this wire codec.
    Dense(Codec),
    /// Top-k sparsification with error feedback: each cut keeps only the
    /// `k = ceil(fraction · len)` largest-magnitude elements of the layer's delta
    /// `θ − anchor` and sends them as a zstd-wrapped f32 payload: the zero runs compress
    /// away, ~5.4–6.4 bytes per kept element on random values, below the 8 of the
    /// `Codec::TopK` index+value layout, and any aggregator decodes it. The rest is the error-feedback residual. It is **not** kept in a
    /// separate buffer: the sync client advances a layer's anchor by exactly what a delta
    /// carries, so the residual stays in `θ − anchor` and is part of the next cut. A cut delta
    /// is handed to the client whole — in flight, then (if its deadlines pass) in the durable
    /// weak-sync cache as the same dense vector, retransmitted losslessly until acked — so
    /// what the cache holds is delivered exactly once and the residual is never sent twice
    /// nor dropped (see `edge_agent::state` and [`super::topk`]).
    TopK {
        /// Fraction of each layer's elements sent per delta, in `(0, 1]`.
        fraction: f64,
    },
}

impl DeltaCodec {
    /// The codec the sync client encodes fresh deltas with.
    pub fn wire_codec(&self) -> Codec {
        match self {
            DeltaCodec::Dense(c) => *c,
            DeltaCodec::TopK { .. } => Codec::ZstdRawF32,
        }
    }

    /// The top-k fraction, if this is top-k.
    pub fn top_k_fraction(&self) -> Option<f64> {
        match self {
            DeltaCodec::TopK { fraction } => Some(*fraction),
            DeltaCodec::Dense(_) => None,
        }
    }
}

/// Parses `sync.codec`: a dense codec name ([`parse_codec`]), `topk:F` with `0 < F ≤ 1`, or
/// `powersgd:R`: rank-R factors of each delta ([`protocol::lowrank`]; error feedback through
/// the anchor, which advances by the decoded values).
pub fn parse_delta_codec(name: &str) -> Result<DeltaCodec, String> {
    if let Some(fraction) = name.strip_prefix("topk:") {
        let f: f64 = fraction.trim().parse().map_err(|_| {
            format!("topk:{fraction}: the fraction must be a number in (0, 1], e.g. topk:0.01")
        })?;
        if !(f.is_finite() && f > 0.0 && f <= 1.0) {
            return Err(format!(
                "topk:{fraction}: the fraction of elements sent must be in (0, 1], e.g. topk:0.01"
            ));
        }
        return Ok(DeltaCodec::TopK { fraction: f });
    }
    if let Some(rank) = name.strip_prefix("powersgd:") {
        let r: u32 = rank.trim().parse().map_err(|_| {
            format!(
                "powersgd:{rank}: the rank must be a whole number from 1 to 64, e.g. powersgd:4"
            )
        })?;
        if !(1..=64).contains(&r) {
            return Err(format!(
                "powersgd:{rank}: the rank must be from 1 to 64, e.g. powersgd:4"
            ));
        }
        return Ok(DeltaCodec::Dense(Codec::LowRank { rows: 0, rank: r }));
    }
    parse_codec(name).map(DeltaCodec::Dense).ok_or_else(|| {
        "use raw-f32, f16, bf16, zstd-f32, zstd-f16, zstd-bf16, topk:F (0 < F <= 1) or \
         powersgd:R (rank 1..=64)"
            .to_string()
    })
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
        Self::load_with_overrides(path, &[])
    }

    /// [`Self::load`] with `--set KEY=VALUE` overrides (see
    /// [`node::cluster_model::read_toml_with_overrides`]).
    pub fn load_with_overrides(path: &Path, overrides: &[String]) -> Result<Self, NodeConfigError> {
        let config: NodeRunConfig = read_toml_with_overrides(path, overrides)?;
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
        if let Some(p) = &t.pace {
            p.validate()
                .map_err(|(key, value, why)| invalid(key, value, why))?;
        }
        if let Some(schedule) = &t.lr_schedule {
            schedule.validate().map_err(|e| {
                invalid(
                    "training.lr_schedule",
                    format!("{schedule:?}"),
                    &e.to_string(),
                )
            })?;
        }
        s.deadline_policy()?;
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
        if let Err(why) = parse_delta_codec(&s.codec) {
            return Err(invalid("sync.codec", s.codec.clone(), &why));
        }
        if s.max_stale_steps == Some(0) || s.max_stale_steps_by_layer.values().any(|&t| t == 0) {
            return Err(invalid(
                "sync.max_stale_steps",
                "0".into(),
                "must be at least 1 step (leave it out to turn the bound off)",
            ));
        }
        if let Some(b) = s.lr_damping {
            if !(b > 0.0 && b <= 1.0) {
                return Err(invalid(
                    "sync.lr_damping",
                    b.to_string(),
                    "must be a factor in (0, 1], e.g. 0.9",
                ));
            }
        }
        if let Some(c) = s.drift_cosine {
            if !(-1.0..=1.0).contains(&c) {
                return Err(invalid(
                    "sync.drift_cosine",
                    c.to_string(),
                    "must be a cosine between -1 and 1",
                ));
            }
        }
        self.transport.to_config()?;
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

    #[test]
    fn top_k_codec_parses_and_bad_fractions_name_the_key() {
        let text = format!("{GOOD}\n[sync]\ncodec = \"topk:0.01\"\n");
        let c = NodeRunConfig::parse(&text, Path::new("x.toml")).unwrap();
        let codec = parse_delta_codec(&c.sync.codec).unwrap();
        assert_eq!(codec, DeltaCodec::TopK { fraction: 0.01 });
        assert_eq!(codec.wire_codec(), Codec::ZstdRawF32);
        assert_eq!(
            parse_delta_codec("f16").unwrap(),
            DeltaCodec::Dense(Codec::F16)
        );
        assert!(parse_delta_codec("topk:1").is_ok());
        for bad in [
            "topk:0",
            "topk:2",
            "topk:abc",
            "topk:-0.5",
            "topk:",
            "topk:NaN",
        ] {
            let text = format!("{GOOD}\n[sync]\ncodec = \"{bad}\"\n");
            let e = NodeRunConfig::parse(&text, Path::new("x.toml")).unwrap_err();
            assert!(
                matches!(
                    &e,
                    NodeConfigError::Invalid {
                        key: "sync.codec",
                        ..
                    }
                ),
                "{bad}: {e}"
            );
            assert!(
                e.to_string().starts_with(&format!("sync.codec = {bad}")),
                "{e}"
            );
        }
    }

    #[test]
    fn transport_keys_size_windows_and_bad_ones_name_the_key() {
        let text =
            format!("{GOOD}\n[transport]\nlink_mbps = 100\nrtt_ms = 200\ncongestion = \"cubic\"\n");
        let c = NodeRunConfig::parse(&text, Path::new("x.toml")).unwrap();
        let t = c.transport.to_config().unwrap();
        assert_eq!(t.stream_receive_window, 5_000_000);
        assert_eq!(t.congestion, transport::Congestion::Cubic);
        let text = format!("{GOOD}\n[transport]\nrtt_ms = 200\n");
        let e = NodeRunConfig::parse(&text, Path::new("x.toml")).unwrap_err();
        assert!(e.to_string().starts_with("transport.rtt_ms"), "{e}");
        let text = format!("{GOOD}\n[transport]\ncongestion = \"reno\"\n");
        let e = NodeRunConfig::parse(&text, Path::new("x.toml")).unwrap_err();
        assert!(e.to_string().starts_with("transport.congestion"), "{e}");
        let text = format!("{GOOD}\n[transport]\nwindow = 5\n");
        let e = NodeRunConfig::parse(&text, Path::new("x.toml")).unwrap_err();
        assert!(e.to_string().contains("window"), "{e}");
    }

    #[test]
    fn deadlines_are_adaptive_by_default_fixed_on_request_and_bad_keys_are_named() {
        use crate::deadline::DeadlinePolicy;
        let c = NodeRunConfig::parse(GOOD, Path::new("x.toml")).unwrap();
        let DeadlinePolicy::Adaptive(a) = c.sync.deadline_policy().unwrap() else {
            panic!("adaptive by default")
        };
        assert_eq!((a.min_ns, a.max_ns, a.k), (50_000_000, 30_000_000_000, 4.0));
        let sync = |extra: &str| {
            let text = if GOOD.contains("[sync]") {
                GOOD.replace("[sync]", &format!("[sync]\n{extra}"))
            } else {
                format!("{GOOD}\n[sync]\n{extra}\n")
            };
            NodeRunConfig::parse(&text, Path::new("x.toml"))
        };
        let c = sync("deadline_mode = \"fixed\"").unwrap();
        assert_eq!(c.sync.deadline_policy().unwrap(), DeadlinePolicy::Fixed);
        for (extra, key) in [
            ("deadline_mode = \"smart\"", "sync.deadline_mode"),
            ("deadline_min_ms = 0", "sync.deadline_min_ms"),
            (
                "deadline_min_ms = 900\ndeadline_max_ms = 800",
                "sync.deadline_min_ms",
            ),
            ("deadline_k = -1.0", "sync.deadline_k"),
        ] {
            let e = sync(extra).unwrap_err();
            assert!(e.to_string().starts_with(key), "{extra}: {e}");
        }
    }
}
