//! The `[edge]` table of a scenario ([`EdgeSpec`]) and its validation against the rest of the
//! scenario: link names, device classes (resolved from the scenario's one device registry, so
//! built-in, custom and measured classes all work), churn entries. Every error names the dotted
//! key.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::compute::Device;
use crate::link::LinkSpec;
use crate::scenario::Scenario;

/// A value in the `[edge]` table that is out of range or refers to something unknown.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
#[error("{key}: {problem}")]
pub struct EdgeSpecError {
    /// Dotted key, e.g. `edge.devices.links[1]`.
    pub key: String,
    /// What is wrong and what is allowed.
    pub problem: String,
}

fn spec_error(key: impl Into<String>, problem: impl Into<String>) -> EdgeSpecError {
    EdgeSpecError {
        key: key.into(),
        problem: problem.into(),
    }
}

/// The `[edge]` table: cloud GPU nodes, CPU aggregators and edge devices, each on its own
/// access link, exchanging per-layer deltas with the aggregators that own the layers.
///
/// Links are named in the scenario's `[links]` table. A link reference `name` uses
/// `links."name.up"` for the direction leaving the node and `links."name.down"` for the
/// direction reaching it; when those are absent, `links.name` serves both directions. A message
/// from a node to an aggregator crosses the node's up link, then the aggregator's down link
/// (store-and-forward per message); the way back crosses the aggregator's up link, then the
/// node's down link.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EdgeSpec {
    /// Cloud GPU nodes (`[edge.cloud]`).
    #[serde(default)]
    pub cloud: CloudSpec,
    /// CPU aggregators (`[edge.aggregators]`).
    pub aggregators: AggregatorsSpec,
    /// Edge devices (`[edge.devices]`).
    pub devices: DevicesSpec,
    /// Deadline slack in ms. Each attempt of a delta must be acknowledged within
    /// `deadline_ms` plus the time the node's path to its aggregator nominally needs (at the
    /// links' constant rate or trace mean rate) to upload one delta of every layer (the worst
    /// queue in front of a delta on a one-stream link), download the largest layer version
    /// (which an ack may queue behind) and make one round trip. Default 500.
    #[serde(default = "default_deadline_ms")]
    pub deadline_ms: f64,
    /// `adaptive` (default): each layer's deadline follows its observed delta→ack times
    /// (median + 4·MAD, 50 ms … 30 s, Karn's backoff), starting from the deadline above;
    /// `fixed`: always the deadline above (what the real nodes do with
    /// `[sync] deadline_mode = "fixed"`).
    #[serde(default)]
    pub deadline_mode: DeadlineMode,
    /// Transmissions of a delta before it is weak-synced into the cache (default 3).
    #[serde(default = "default_max_attempts")]
    pub max_attempts: u32,
    /// While a node's weak-sync cache is not empty, a flush is tried this often (ms, default
    /// 1000), besides when a link comes back and on every ack.
    #[serde(default = "default_flush_interval_ms")]
    pub flush_interval_ms: f64,
    /// Staleness weighting at the aggregators (`[edge.staleness]`).
    #[serde(default)]
    pub staleness: StalenessSpec,
    /// Codec of fresh deltas, as the edge agent's `sync.codec`: `raw-f32` (default), `f16`,
    /// `bf16`, the `zstd-` variants, `topk:F` or `powersgd:R`. Cached deltas are always
    /// retransmitted losslessly.
    #[serde(default = "default_delta_codec")]
    pub delta_codec: String,
    /// Codec of the layer versions the aggregators broadcast (default `raw-f32`).
    #[serde(default)]
    pub broadcast_codec: WireCodec,
    /// Nodes that join late, leave, or crash and come back (`[[edge.churn]]`).
    #[serde(default)]
    pub churn: Vec<ChurnSpec>,
    /// `elastic`: hard staleness bound `T_ℓ` in steps for every layer (`edge_agent::early_sync`;
    /// absent: off).
    #[serde(default)]
    pub max_stale_steps: Option<u64>,
    /// `elastic`: drift trigger, the cosine below which a layer is cut early (absent: off).
    #[serde(default)]
    pub drift_cosine: Option<f32>,
    /// `elastic`: learning-rate damping by staleness, `lr · base^s` for a layer `s` periods
    /// without a new global version (absent: off).
    #[serde(default)]
    pub lr_damping: Option<f32>,
    /// `fedavg-deadline`: Flower's FedAvg with a round deadline.
    #[serde(default)]
    pub fedavg: FedAvgSpec,
    /// `fedbuff`: buffered asynchronous aggregation.
    #[serde(default)]
    pub fedbuff: FedBuffSpec,
    /// The divergence monitor (`[edge.divergence]`, as the coordinator's `[divergence]`):
    /// fed at each evaluation; `summary.json` counts its warnings.
    #[serde(default)]
    pub divergence: coordinator::DivergenceConfig,
}

/// `[edge] deadline_mode`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DeadlineMode {
    /// From observed delta→ack times ([`edge_agent::DeadlinePolicy::Adaptive`]).
    #[default]
    Adaptive,
    /// The configured deadline for every attempt.
    Fixed,
}

impl DeadlineMode {
    /// The sync client's policy.
    pub fn policy(self) -> edge_agent::DeadlinePolicy {
        match self {
            DeadlineMode::Adaptive => {
                edge_agent::DeadlinePolicy::Adaptive(edge_agent::AdaptiveDeadline::default())
            }
            DeadlineMode::Fixed => edge_agent::DeadlinePolicy::Fixed,
        }
    }
}

fn default_deadline_ms() -> f64 {
    500.0
}
fn default_max_attempts() -> u32 {
    3
}
fn default_flush_interval_ms() -> f64 {
    1000.0
}

/// `[edge.cloud]`: GPU nodes in a data center. A node with `workers` GPUs trains one replica
/// on `workers ×` the scenario batch per step (the intra-node collective is not modelled).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CloudSpec {
    /// Number of cloud nodes (may be 0). Named `cloud-0`, `cloud-1`, ...
    #[serde(default = "one_usize")]
    pub count: usize,
    /// Device class of each GPU: built-in or a scenario's `[devices.NAME]`; default `a100`.
    #[serde(default = "default_cloud_device")]
    pub device: String,
    /// GPUs per node: the per-step batch multiplier (default 1).
    #[serde(default = "one_usize")]
    pub workers: usize,
    /// Link reference of each cloud node's access link.
    #[serde(default)]
    pub link: String,
}

impl Default for CloudSpec {
    fn default() -> Self {
        CloudSpec {
            count: 0,
            device: default_cloud_device(),
            workers: 1,
            link: String::new(),
        }
    }
}

fn one_usize() -> usize {
    1
}
fn default_cloud_device() -> String {
    "a100".into()
}

/// `[edge.aggregators]`: CPU aggregators. Layer `i` (parameterized layers in forward order) is
/// owned by aggregator `i % count`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AggregatorsSpec {
    /// Number of aggregators (≥ 1). Named `agg-0`, `agg-1`, ...
    #[serde(default = "one_usize")]
    pub count: usize,
    /// Link reference of each aggregator's access link.
    pub link: String,
    /// `elastic`: distinct senders that close a round (1 = fully asynchronous, default).
    #[serde(default = "one_usize")]
    pub round_size: usize,
    /// `elastic`: a round with fewer senders is applied this long after its first delta
    /// (ms, default 1000).
    #[serde(default = "default_round_timeout_ms")]
    pub round_timeout_ms: f64,
    /// `elastic`: outer learning rate η in `θ ← θ + η Σwᵢ Δᵢ / Σwᵢ` (default 1), scaled by
    /// `outer_lr_scaling`. `blocking` rounds average every node with η = 1.
    #[serde(default = "default_outer_lr")]
    pub outer_lr: f32,
    /// `elastic`: `contributors` (default: η times a round's share of the nodes contributing
    /// now, so η = 1 moves the global model at the pace of their mean for any node count;
    /// `cpu_aggregator::contributors`) or `fixed` (η as is: with asynchronous rounds every
    /// delta is then added on arrival, and η must be about 1 / nodes).
    #[serde(default = "default_outer_lr_scaling")]
    pub outer_lr_scaling: cpu_aggregator::OuterLrScaling,
    /// `blocking`: a round waits for every node, but at most this long after its first delta
    /// (seconds, default 60), so a crashed or departed node cannot stall it forever.
    #[serde(default = "default_blocking_round_timeout_s")]
    pub blocking_round_timeout_s: f64,
}

fn default_round_timeout_ms() -> f64 {
    1000.0
}
fn default_outer_lr() -> f32 {
    1.0
}
fn default_outer_lr_scaling() -> cpu_aggregator::OuterLrScaling {
    cpu_aggregator::OuterLrScaling::Contributors
}
fn default_blocking_round_timeout_s() -> f64 {
    60.0
}

/// `[edge.fedavg]`: the `fedavg-deadline` strategy — synchronous FedAvg rounds as Flower's
/// `FaultTolerantFedAvg` runs them: every node trains `period` steps from the global model and
/// sends its update; the round is aggregated (sample-weighted mean) when every node's update
/// arrived or at the deadline with whoever arrived, provided at least `min_completion_rate`
/// of the nodes did (else the round is dropped and the global model stays); late updates are
/// dropped (`τ_max = 0`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FedAvgSpec {
    /// Seconds after a round's first update at which it is aggregated with whoever arrived
    /// (default 10).
    #[serde(default = "default_round_deadline_s")]
    pub round_deadline_s: f64,
    /// Fraction of the nodes whose updates a round needs (Flower's
    /// `min_completion_rate_fit`, default 0.5).
    #[serde(default = "default_min_completion_rate")]
    pub min_completion_rate: f64,
}

impl Default for FedAvgSpec {
    fn default() -> Self {
        Self {
            round_deadline_s: default_round_deadline_s(),
            min_completion_rate: default_min_completion_rate(),
        }
    }
}

fn default_delta_codec() -> String {
    "raw-f32".into()
}

fn default_round_deadline_s() -> f64 {
    10.0
}
fn default_min_completion_rate() -> f64 {
    0.5
}

/// `[edge.fedbuff]`: the `fedbuff` strategy (Nguyen et al., AISTATS 2022) — every node trains
/// `period` local steps from the newest global model it has, sends its whole update and starts
/// again from the newest global model (versions that arrive meanwhile wait until then); the
/// server keeps a buffer of `buffer_size` updates, each scaled by `1/√(1+τ)`, and applies
/// `θ ← θ + server_lr · (1/K) Σ s(τᵢ)Δᵢ` when it is full.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FedBuffSpec {
    /// Updates per buffer, K (default 3).
    #[serde(default = "default_buffer_size")]
    pub buffer_size: usize,
    /// Server learning rate η_g (default 1).
    #[serde(default = "default_server_lr")]
    pub server_lr: f32,
    /// A buffer not full this many seconds after its first update is applied anyway, so the
    /// last updates of a run are not stranded (default 30).
    #[serde(default = "default_flush_after_s")]
    pub flush_after_s: f64,
}

impl Default for FedBuffSpec {
    fn default() -> Self {
        Self {
            buffer_size: default_buffer_size(),
            server_lr: default_server_lr(),
            flush_after_s: default_flush_after_s(),
        }
    }
}

fn default_buffer_size() -> usize {
    3
}
fn default_server_lr() -> f32 {
    1.0
}
fn default_flush_after_s() -> f64 {
    30.0
}

/// `[edge.devices]`: edge devices (Jetson class) on cellular or Wi-Fi links.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DevicesSpec {
    /// Number of devices. Named `edge-0`, `edge-1`, ...
    pub count: usize,
    /// Device class: built-in or a scenario's `[devices.NAME]`; default `jetson-orin`.
    #[serde(default = "default_edge_device")]
    pub device: String,
    /// Link references, assigned to devices in turn (`edge-i` gets `links[i % len]`).
    pub links: Vec<String>,
    /// Multiplies every compute time of a device (power mode, thermal throttling, training as a
    /// background job next to the device's main workload). Default 1.
    #[serde(default = "one_f64")]
    pub slowdown: f64,
    /// Up to this fraction of extra time per step, drawn uniformly per step (default 0).
    #[serde(default)]
    pub jitter: f64,
}

fn default_edge_device() -> String {
    "jetson-orin".into()
}
fn one_f64() -> f64 {
    1.0
}

/// `[edge.staleness]`: polynomial staleness discount `s(τ) = (1+τ)^(−a)` and the bound `τ_max`
/// beyond which a delta is dropped and its sender told to re-sync.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StalenessSpec {
    /// Exponent `a` (default 0.5).
    #[serde(default = "default_staleness_a")]
    pub a: f64,
    /// Largest accepted staleness in versions (default 8).
    #[serde(default = "default_tau_max")]
    pub tau_max: u64,
}

impl Default for StalenessSpec {
    fn default() -> Self {
        StalenessSpec {
            a: default_staleness_a(),
            tau_max: default_tau_max(),
        }
    }
}

fn default_staleness_a() -> f64 {
    0.5
}
fn default_tau_max() -> u64 {
    8
}

/// A wire codec for tensors.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum WireCodec {
    /// 4 bytes per element.
    #[default]
    RawF32,
    /// IEEE half precision, 2 bytes per element.
    F16,
    /// bfloat16, 2 bytes per element.
    Bf16,
}

impl WireCodec {
    /// The protocol codec.
    pub fn codec(self) -> protocol::Codec {
        match self {
            WireCodec::RawF32 => protocol::Codec::RawF32,
            WireCodec::F16 => protocol::Codec::F16,
            WireCodec::Bf16 => protocol::Codec::Bf16,
        }
    }
}

/// What happens to a node at `at_s`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ChurnAction {
    /// Stops training gracefully: its remaining progress is sent and its cache drained. With
    /// `back_at_s` it resumes training then.
    Leave,
    /// Dies: loses its model, optimizer and sync state, keeps its durable weak-sync cache and
    /// sequence counter. With `back_at_s` it restarts: bootstraps from the current global model
    /// and hands its cache back to the sync client.
    Crash,
    /// Is absent from the start and joins at `at_s`, bootstrapping from the current global model.
    Join,
}

/// One `[[edge.churn]]` entry.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChurnSpec {
    /// Node name: `cloud-<i>` or `edge-<i>`.
    pub node: String,
    /// Virtual seconds at which the action happens.
    pub at_s: f64,
    /// `leave`, `crash` or `join`.
    pub action: ChurnAction,
    /// For `leave` and `crash`: when the node comes back (never if absent).
    #[serde(default)]
    pub back_at_s: Option<f64>,
}

/// The resolved up/down link specs of one access link.
#[derive(Clone, Debug, PartialEq)]
pub struct AccessLink {
    /// The reference as written.
    pub name: String,
    /// Direction leaving the node.
    pub up: LinkSpec,
    /// Direction reaching the node.
    pub down: LinkSpec,
}

/// Resolves a link reference (see [`EdgeSpec`]); `key` names the referring key in errors.
pub fn resolve_link(
    links: &BTreeMap<String, LinkSpec>,
    name: &str,
    key: &str,
) -> Result<AccessLink, EdgeSpecError> {
    let direction = |dir: &str| {
        links
            .get(&format!("{name}.{dir}"))
            .or_else(|| links.get(name))
            .cloned()
    };
    match (direction("up"), direction("down")) {
        (Some(up), Some(down)) => {
            for (dir, spec) in [("up", &up), ("down", &down)] {
                crate::link::validate_link(spec).map_err(|e| {
                    spec_error(
                        format!("{key} (link {name}, direction {dir})"),
                        e.to_string(),
                    )
                })?;
            }
            Ok(AccessLink {
                name: name.to_string(),
                up,
                down,
            })
        }
        _ => {
            let known: Vec<&str> = links.keys().map(String::as_str).collect();
            Err(spec_error(
                key,
                format!(
                    "unknown link '{name}': define links.\"{name}.up\" and links.\"{name}.down\", or links.{name} (defined: {})",
                    if known.is_empty() { "none".to_string() } else { known.join(", ") }
                ),
            ))
        }
    }
}

fn positive_finite(value: f64, key: &str) -> Result<(), EdgeSpecError> {
    if value.is_finite() && value > 0.0 {
        Ok(())
    } else {
        Err(spec_error(
            key,
            format!("must be a positive number, got {value}"),
        ))
    }
}

/// Everything [`EdgeSpec::resolve`] checked, in a form the simulation uses directly.
#[derive(Clone, Debug)]
pub struct ResolvedEdge {
    /// Cloud device class.
    pub cloud_device: Device,
    /// Edge device class.
    pub edge_device: Device,
    /// Access link of each cloud node.
    pub cloud_link: Option<AccessLink>,
    /// Access link of each aggregator.
    pub aggregator_link: AccessLink,
    /// Access link of each edge device (already cycled over the devices).
    pub edge_links: Vec<AccessLink>,
}

impl EdgeSpec {
    /// Node names in simulation order: cloud nodes, then edge devices.
    pub fn node_names(&self) -> Vec<String> {
        (0..self.cloud.count)
            .map(|i| format!("cloud-{i}"))
            .chain((0..self.devices.count).map(|i| format!("edge-{i}")))
            .collect()
    }

    /// Checks every value and resolves device classes and links against `scenario`.
    pub fn resolve(&self, scenario: &Scenario) -> Result<ResolvedEdge, EdgeSpecError> {
        let device = |name: &str, key: &str| {
            scenario
                .device(name, key)
                .map_err(|e| spec_error(e.key, e.problem))
        };
        let cloud_device = device(&self.cloud.device, "edge.cloud.device")?;
        let edge_device = device(&self.devices.device, "edge.devices.device")?;
        if self.cloud.count + self.devices.count == 0 {
            return Err(spec_error(
                "edge.devices.count",
                "the scenario needs at least one node (cloud or edge)",
            ));
        }
        if self.cloud.workers == 0 {
            return Err(spec_error("edge.cloud.workers", "must be at least 1"));
        }
        self.divergence.validate().map_err(|problem| {
            let (key, rest) = problem
                .split_once(" = ")
                .unwrap_or(("divergence", &problem));
            spec_error(format!("edge.{key}"), format!("= {rest}"))
        })?;
        let cloud_link = if self.cloud.count > 0 {
            Some(resolve_link(
                &scenario.links,
                &self.cloud.link,
                "edge.cloud.link",
            )?)
        } else {
            None
        };
        if self.aggregators.count == 0 {
            return Err(spec_error("edge.aggregators.count", "must be at least 1"));
        }
        if self.aggregators.round_size == 0 {
            return Err(spec_error(
                "edge.aggregators.round_size",
                "must be at least 1",
            ));
        }
        positive_finite(
            self.aggregators.round_timeout_ms,
            "edge.aggregators.round_timeout_ms",
        )?;
        positive_finite(
            self.aggregators.blocking_round_timeout_s,
            "edge.aggregators.blocking_round_timeout_s",
        )?;
        positive_finite(
            f64::from(self.aggregators.outer_lr),
            "edge.aggregators.outer_lr",
        )?;
        positive_finite(self.fedavg.round_deadline_s, "edge.fedavg.round_deadline_s")?;
        edge_agent::runtime::config::parse_delta_codec(&self.delta_codec)
            .map_err(|why| spec_error("edge.delta_codec", why))?;
        if self.max_stale_steps == Some(0) {
            return Err(spec_error(
                "edge.max_stale_steps",
                "must be at least 1 step (leave it out to turn the bound off)",
            ));
        }
        if let Some(b) = self.lr_damping {
            if !(b > 0.0 && b <= 1.0) {
                return Err(spec_error(
                    "edge.lr_damping",
                    format!("must be a factor in (0, 1], got {b}"),
                ));
            }
        }
        if let Some(c) = self.drift_cosine {
            if !(-1.0..=1.0).contains(&c) {
                return Err(spec_error(
                    "edge.drift_cosine",
                    format!("must be a cosine between -1 and 1, got {c}"),
                ));
            }
        }
        if !(0.0..=1.0).contains(&self.fedavg.min_completion_rate) {
            return Err(spec_error(
                "edge.fedavg.min_completion_rate",
                format!(
                    "must be a fraction in [0, 1], got {}",
                    self.fedavg.min_completion_rate
                ),
            ));
        }
        if self.fedbuff.buffer_size == 0 {
            return Err(spec_error("edge.fedbuff.buffer_size", "must be at least 1"));
        }
        positive_finite(f64::from(self.fedbuff.server_lr), "edge.fedbuff.server_lr")?;
        positive_finite(self.fedbuff.flush_after_s, "edge.fedbuff.flush_after_s")?;
        let aggregator_link = resolve_link(
            &scenario.links,
            &self.aggregators.link,
            "edge.aggregators.link",
        )?;
        if self.devices.count > 0 && self.devices.links.is_empty() {
            return Err(spec_error(
                "edge.devices.links",
                "list at least one link for the edge devices",
            ));
        }
        let mut distinct = Vec::new();
        for (i, name) in self.devices.links.iter().enumerate() {
            distinct.push(resolve_link(
                &scenario.links,
                name,
                &format!("edge.devices.links[{i}]"),
            )?);
        }
        let edge_links = (0..self.devices.count)
            .map(|i| distinct[i % distinct.len()].clone())
            .collect();
        positive_finite(self.devices.slowdown, "edge.devices.slowdown")?;
        if !(self.devices.jitter.is_finite() && self.devices.jitter >= 0.0) {
            return Err(spec_error(
                "edge.devices.jitter",
                format!("must be >= 0, got {}", self.devices.jitter),
            ));
        }
        positive_finite(self.deadline_ms, "edge.deadline_ms")?;
        positive_finite(self.flush_interval_ms, "edge.flush_interval_ms")?;
        if self.max_attempts == 0 {
            return Err(spec_error("edge.max_attempts", "must be at least 1"));
        }
        if !(self.staleness.a.is_finite() && self.staleness.a >= 0.0) {
            return Err(spec_error(
                "edge.staleness.a",
                format!("must be >= 0, got {}", self.staleness.a),
            ));
        }
        let names = self.node_names();
        for (i, c) in self.churn.iter().enumerate() {
            let key = |field: &str| format!("edge.churn[{i}].{field}");
            if !names.contains(&c.node) {
                return Err(spec_error(
                    key("node"),
                    format!("unknown node '{}' (nodes: {})", c.node, names.join(", ")),
                ));
            }
            if !(c.at_s.is_finite() && c.at_s >= 0.0) {
                return Err(spec_error(
                    key("at_s"),
                    format!("must be >= 0 seconds, got {}", c.at_s),
                ));
            }
            match (c.action, c.back_at_s) {
                (ChurnAction::Join, Some(_)) => {
                    return Err(spec_error(
                        key("back_at_s"),
                        "a join has no back_at_s (use leave or crash to take a node away)",
                    ))
                }
                (_, Some(back)) if !(back.is_finite() && back > c.at_s) => {
                    return Err(spec_error(
                        key("back_at_s"),
                        format!("must be later than at_s = {}, got {back}", c.at_s),
                    ))
                }
                _ => {}
            }
            if c.action == ChurnAction::Join {
                let earlier = self.churn.iter().enumerate().find(|(j, o)| {
                    *j != i
                        && o.node == c.node
                        && (o.at_s < c.at_s || o.action == ChurnAction::Join)
                });
                if let Some((j, _)) = earlier {
                    return Err(spec_error(
                        key("at_s"),
                        format!(
                            "{} joins at {} s, but edge.churn[{j}] acts on it before or joins it again",
                            c.node, c.at_s
                        ),
                    ));
                }
            }
        }
        Ok(ResolvedEdge {
            cloud_device,
            edge_device,
            cloud_link,
            aggregator_link,
            edge_links,
        })
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use node::task::{load_data, ModelKind, Task};

    use crate::compute::{layer_costs, DeviceClass};
    use crate::edge::run_edge;
    use crate::scenario::Scenario;

    /// One cloud node and two edge devices on `device`, with `devices` appended.
    fn scenario(device: &str, devices: &str) -> Scenario {
        let text = format!(
            r#"
name = "custom"
seed = 9
kind = "edge"
model = "mlp"
dataset = "digits"
batch = 16
max_steps = 30
max_virtual_s = 60
eval_every_s = 2
eval_limit = 200
target = 0.9
strategies = ["elastic"]
[edge.cloud]
count = 1
link = "dc"
[edge.aggregators]
link = "dc"
[edge.devices]
count = 2
device = "{device}"
links = ["dc"]
jitter = 0.1
[links.dc]
bandwidth = "100mbit"
latency_ms = 5
{devices}
"#
        );
        Scenario::parse(&text, "custom", Path::new(".")).expect("parses")
    }

    fn digits() -> Task {
        Task::new(
            ModelKind::Mlp,
            "digits",
            load_data("digits", None).expect("embedded digits"),
        )
        .expect("task")
    }

    #[test]
    fn custom_and_measured_classes_work_in_an_edge_scenario() {
        let task = digits();
        let run = |s: &Scenario| run_edge(s, &task, "elastic", &mut |_| {}).expect("runs");
        let builtin = run(&scenario("jetson-orin", ""));
        // A scenario class with the built-in's numbers: the very same run.
        let orin = DeviceClass::builtin("jetson-orin").expect("orin");
        let same = scenario(
            "my-orin",
            &format!(
                "[devices.my-orin]\nflops = {:e}\nlayer_overhead_s = {:e}\n",
                orin.flops, orin.layer_overhead_s
            ),
        );
        assert_eq!(run(&same), builtin);
        // A slower scenario class: the devices' steps take longer.
        let slow = run(&scenario("slow", "[devices.slow]\nflops = 1e9\n"));
        assert!(
            slow.mean_step_s > builtin.mean_step_s,
            "{} vs {}",
            slow.mean_step_s,
            builtin.mean_step_s
        );
        // Per-layer times given for every layer (as --measure-device writes them).
        let model = task.build_model(9);
        let layers: String = layer_costs(&model, &task)
            .iter()
            .map(|l| format!("{} = {{ forward_ms = 5.0, backward_ms = 10.0 }}\n", l.name))
            .collect();
        let timed = scenario("timed", &format!("[devices.timed.layers]\n{layers}"));
        let resolved = timed
            .edge
            .as_ref()
            .expect("edge")
            .resolve(&timed)
            .expect("resolves");
        assert_eq!(resolved.edge_device.name, "timed");
        let t = run(&timed);
        assert!(t.mean_step_s > slow.mean_step_s, "{}", t.mean_step_s);
        assert_eq!(t, run(&timed), "deterministic");
    }

    #[test]
    fn an_unknown_edge_device_lists_the_scenario_classes() {
        let s = scenario("tpu", "[devices.mine]\nflops = 1e9\n");
        let e = s
            .edge
            .as_ref()
            .expect("edge")
            .resolve(&s)
            .expect_err("unknown")
            .to_string();
        assert!(
            e.starts_with("edge.devices.device: unknown device class 'tpu'") && e.contains("mine"),
            "{e}"
        );
        let s = scenario(
            "bad",
            "[devices.bad.layers]\nfc9 = { forward_ms = 1, backward_ms = 1 }\n",
        );
        let e = run_edge(&s, &digits(), "elastic", &mut |_| {}).expect_err("fc9 is no layer");
        assert!(
            e.contains("devices.bad.layers.fc9") && e.contains("(its layers: flatten, fc1, relu1,"),
            "{e}"
        );
    }
}
