//! Clusters simulation (`kind = "clusters"`): clusters of GPU (or CPU) workers joined by a slow
//! inter-cluster link, trained with `ssgd`, `wfbp`, `localsgd` or `dreamddp`; real gradients on
//! real data, virtual time from a compute model and the packet-level link model.
//!
//! # The `[clusters]` table ([`ClustersSpec`])
//!
//! ```toml
//! [links.wan]                      # any simnet LinkSpec: bandwidth or trace, latency, loss, …
//! bandwidth = "200mbit"
//! latency_ms = 10
//!
//! [clusters]
//! inter_link = "wan"               # name of the link in [links] joining the clusters
//! intra_bandwidth = "100gbit"      # per-worker interconnect inside a cluster (default 100gbit)
//! intra_latency_us = 5             # per ring step inside a cluster (default 5)
//! schedule = "auto"                # dreamddp: "auto" (default: search), "profiled" or "equal"
//! bubble_filling = false           # dreamddp: extra syncs where the link would idle
//! delay = 2                        # dreamddp: steps from launch to landing (default: chosen)
//! sync_unit_kb = 512               # dreamddp: largest sync unit, KiB (0: whole layers; default: chosen)
//! fragment_delay = 1               # streaming-diloco: inner steps an exchange overlaps (τ)
//! outer = { lr = 0.7, momentum = 0.9, mix = 0.5 }   # diloco / streaming-diloco
//! stop_at_target = false           # stop a strategy once the target is reached
//! groups = [
//!   { name = "dc", count = 2, workers = 4, device = "a100", slowdown = 1.0, jitter = 0.05 },
//! ]
//! [devices.my-gpu]                 # optional device classes besides the built-in ones
//! flops = 20e12                    # (the older `[clusters.devices.NAME]` is also read)
//! layer_overhead_s = 1e-4
//! [devices.my-gpu.layers]          # optional measured per-layer times, replacing FLOP-derived
//! fc1 = { forward_ms = 0.21, backward_ms = 0.40 }
//! ```
//!
//! A group is `count` identical clusters (named `name-0`, `name-1`, … or `name` when `count = 1`)
//! of `workers` workers each on `device`, a class of the scenario's device registry
//! ([`Scenario::device`]: built-in, `[devices.NAME]` or `[clusters.devices.NAME]`), with
//! a straggler `slowdown` and per-step `jitter` (see [`Straggler`]).
//!
//! # Model of a cluster
//!
//! Inside a cluster the workers all-reduce gradients every step over the fast interconnect
//! (PyTorch DDP); mathematically that is **one replica** training on the cluster's batch
//! (`workers × batch`), which is how it is simulated: one [`Replica`](crate::replica::Replica) per cluster, its batch the
//! union of its workers' batches. The time of a step is that of one worker on `batch` samples
//! (workers run in parallel) plus the intra-cluster ring all-reduce of the gradients on a FIFO
//! interconnect: after backward for `ssgd`; per DDP bucket as its gradients are ready for
//! `wfbp`; per layer from the backward hook for `localsgd` and `dreamddp`. Replicas
//! are combined with weights proportional to their workers, which makes every average equal to
//! the flat average over all workers. A hierarchical all-reduce's final intra-cluster broadcast
//! is folded into the one intra-cluster all-reduce.
//!
//! # Strategies across clusters: the trainer's own sync machine
//!
//! What is synchronized when is not modelled here: every cluster drives its own
//! [`WorkerSyncMachine`](gpu_worker::sync_machine::WorkerSyncMachine), the sans-IO state machine
//! `gpu-worker`'s trainer drives, with the strategy's plan, and executes its actions; its
//! collectives are the inter-cluster all-reduces (see `sim` for the virtual time of each
//! action). So the strategies behave as in the trainer:
//!
//! | strategy | math | virtual time |
//! |---|---|---|
//! | `ssgd` | average gradients, step | after backward: one inter all-reduce of every gradient, waited before the steps |
//! | `wfbp` | average gradients, step | each DDP bucket's inter all-reduce launched in backward when its gradients are reduced in every cluster; all waited before the steps |
//! | `localsgd` | local steps; every H steps average all parameters | clusters run free; every H-th step a blocking inter all-reduce of all parameters |
//! | `dreamddp` | local steps; each bucket's parameters averaged at its scheduled step, the average written just before the layer's optimizer step `delay` steps later (rebased when `delay > 1`) | a due bucket's all-reduce starts when every cluster has stepped its layers; a cluster waits for it at the bucket's first layer in the backward `delay` steps later (the wait blocks the rest of that backward, as the trainer's hook does) |
//! | `plsgd` | `dreamddp` with the equal split and a delay of 1 | as `dreamddp` |
//! | `diloco` | local steps; every H steps an outer Nesterov step on the averaged parameters | as `localsgd` |
//! | `streaming-diloco` | H staggered fragments; a fragment due at a step is averaged after it and lands `fragment_delay` steps later through the outer step, mixed with the local values | the all-reduce starts after the step; the cluster waits for it after the step it lands at |
//!
//! DreamDDP's plan is [`SyncPlan`](engine::plan::SyncPlan) with the profiled schedule built from this simulation's own
//! virtual per-layer backward times (slowest cluster) and inter-cluster communication times
//! probed on a copy of the links, so the schedule sees what the simulation will charge.
//!
//! # Outputs
//!
//! Every `eval_every_s` virtual seconds the global model (the weighted average of the replicas)
//! is evaluated as it stood at that instant: the state after the last step that every cluster
//! had finished by then. `time_to_target_s` is the first evaluation time meeting the target
//! (accuracy ≥ target, or loss ≤ target for language models); with `stop_at_target` the run
//! ends with the state that evaluation saw, at the end of the last step before it. Bytes are
//! counted per link class (`inter-cluster` on the wire with retransmissions, `intra-cluster`
//! by ring accounting).
//! The timeline holds the first [`TIMELINE_CAP`] per-layer inter-cluster syncs. Staleness is the
//! number of optimizer steps between a parameter average's cut and its landing (0 for the
//! blocking strategies, 1 for dreamddp). `wall_seconds` is left at 0: this module never reads
//! the wall clock; the caller may fill it in.
//!
//! Every random draw comes from [`SimRng`](crate::rng::SimRng) forks of the scenario seed, iteration orders are
//! fixed, so the same scenario and seed give identical results.

mod fabric;
mod rendezvous;
mod sim;

use std::collections::BTreeMap;

use engine::outer::OuterConfig;
use engine::plan::{ScheduleKind, Strategy};
use serde::Deserialize;
use thiserror::Error;

use crate::compute::{Device, DeviceClass, Straggler};
use crate::link::{Bandwidth, LinkError};
use crate::report::StrategyResult;
use crate::scenario::Scenario;
use crate::time::SimTime;

pub use fabric::{CollectiveSpan, Fabric, IntraNet, MAX_ATTEMPTS};

/// Most per-layer sync events kept in [`StrategyResult::timeline`].
pub const TIMELINE_CAP: usize = 2000;

/// The strategies this simulation runs.
pub const STRATEGIES: &[&str] = &[
    "ssgd",
    "wfbp",
    "localsgd",
    "dreamddp",
    "dreamddp-paper",
    "plsgd",
    "diloco",
    "streaming-diloco",
];

/// The `[clusters]` table (see the module doc).
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClustersSpec {
    /// Groups of identical clusters.
    pub groups: Vec<GroupSpec>,
    /// Name of the link in the scenario's `[links]` that joins the clusters.
    pub inter_link: String,
    /// Interconnect rate inside a cluster.
    #[serde(default = "default_intra_bandwidth")]
    pub intra_bandwidth: Bandwidth,
    /// Latency of one ring step inside a cluster, microseconds.
    #[serde(default = "default_intra_latency_us")]
    pub intra_latency_us: f64,
    /// DreamDDP schedule kind (`auto`: the configuration search).
    #[serde(default)]
    pub schedule: ScheduleKind,
    /// DreamDDP bubble filling (extra syncs where the link would idle).
    #[serde(default)]
    pub bubble_filling: bool,
    /// DreamDDP: steps between an average's launch and its landing (1: the paper's algorithm;
    /// absent: chosen by the cost model of `engine::delay`).
    #[serde(default)]
    pub delay: Option<u64>,
    /// Streaming DiLoCo: inner steps a fragment's exchange overlaps (τ; absent: 1).
    #[serde(default)]
    pub fragment_delay: Option<u64>,
    /// DreamDDP: the largest sync unit in KiB; a larger layer is split into chunks scheduled
    /// as units of their own (0: whole layers; absent: chosen by the configuration search).
    /// `dreamddp-paper` and the other strategies keep whole layers.
    #[serde(default)]
    pub sync_unit_kb: Option<u64>,
    /// DiLoCo / Streaming DiLoCo outer optimizer (`{ lr = 0.7, momentum = 0.9, mix = 0.5 }`).
    #[serde(default)]
    pub outer: OuterConfig,
    /// Stop each strategy as soon as the target is reached.
    #[serde(default)]
    pub stop_at_target: bool,
    /// Device classes by name (the older form of `[devices]`); [`Scenario::parse`] folds them
    /// into the scenario's registry, through which every group's device is resolved.
    #[serde(default)]
    pub devices: BTreeMap<String, DeviceClass>,
}

/// One group of identical clusters.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GroupSpec {
    /// Group name; clusters are named `name-i` (or `name` when `count = 1`).
    pub name: String,
    /// Clusters in the group.
    #[serde(default = "one_usize")]
    pub count: usize,
    /// Workers (GPUs, or CPU sockets) per cluster.
    pub workers: usize,
    /// Device class: a name in the scenario's device registry (built-in, `[devices]` or
    /// `[clusters.devices]`).
    pub device: String,
    /// Straggler slowdown (1.0 = nominal).
    #[serde(default = "one_f64")]
    pub slowdown: f64,
    /// Per-step uniform extra time, as a fraction (0.1 = up to +10%).
    #[serde(default)]
    pub jitter: f64,
}

fn default_intra_bandwidth() -> Bandwidth {
    Bandwidth::from_mbit(100_000)
}
fn default_intra_latency_us() -> f64 {
    5.0
}
fn one_usize() -> usize {
    1
}
fn one_f64() -> f64 {
    1.0
}

/// Why a clusters simulation could not run.
#[derive(Debug, Error)]
pub enum ClustersError {
    /// A value of the scenario is missing, out of range or inconsistent.
    #[error("{key}: {problem}")]
    Invalid {
        /// Dotted key, e.g. `clusters.groups[0].workers`.
        key: String,
        /// What is wrong and what is allowed.
        problem: String,
    },
    /// The inter-cluster link could not be built.
    #[error("clusters.inter_link: {source}")]
    Link {
        /// Cause.
        source: LinkError,
    },
    /// The sync plan could not be built.
    #[error("sync plan: {0}")]
    Plan(#[from] engine::plan::PlanError),
    /// A strategy this simulation does not know.
    #[error("unknown strategy '{got}' for a clusters scenario; valid: {valid}")]
    UnknownStrategy {
        /// The name given.
        got: String,
        /// Valid names.
        valid: String,
    },
    /// An inter-cluster message could not be delivered.
    #[error("inter-cluster link down: a message submitted at {since} failed {attempts} times")]
    InterLinkDown {
        /// Attempts made.
        attempts: u32,
        /// When the collective round started.
        since: SimTime,
    },
    /// A replica's forward/backward failed (a batch that does not fit the model).
    #[error("cluster {cluster} at step {step}: {message}")]
    Step {
        /// Step.
        step: u64,
        /// Cluster name.
        cluster: String,
        /// What failed.
        message: String,
    },
    /// The training loss became NaN or infinite.
    #[error("training diverged at step {step} on cluster {cluster} (loss {loss}); lower lr")]
    Diverged {
        /// Step.
        step: u64,
        /// Cluster name.
        cluster: String,
        /// Loss seen.
        loss: f32,
    },
    /// The replica could not be built (e.g. fewer examples than clusters).
    #[error("replica: {0}")]
    Replica(String),
}

/// One cluster after expanding the groups.
#[derive(Clone, Debug, PartialEq)]
pub struct ClusterSetup {
    /// Cluster name.
    pub name: String,
    /// Workers.
    pub workers: usize,
    /// Device class, resolved through the scenario's device registry.
    pub device: Device,
    /// Straggler model.
    pub straggler: Straggler,
}

impl ClustersSpec {
    /// Validates the table against its scenario and expands the groups into clusters, in
    /// group order. Errors name the offending key.
    pub fn clusters(&self, scenario: &Scenario) -> Result<Vec<ClusterSetup>, ClustersError> {
        let bad = |key: String, problem: String| ClustersError::Invalid { key, problem };
        if !scenario.links.contains_key(&self.inter_link) {
            let defined: Vec<&str> = scenario.links.keys().map(String::as_str).collect();
            return Err(bad(
                "clusters.inter_link".into(),
                format!(
                    "no link named '{}' in [links]; defined: {}",
                    self.inter_link,
                    if defined.is_empty() {
                        "none".to_string()
                    } else {
                        defined.join(", ")
                    }
                ),
            ));
        }
        if !(self.intra_latency_us.is_finite() && self.intra_latency_us >= 0.0) {
            return Err(bad(
                "clusters.intra_latency_us".into(),
                format!(
                    "must be a non-negative number, got {}",
                    self.intra_latency_us
                ),
            ));
        }
        if self.intra_bandwidth.bits_per_sec() == 0 {
            return Err(bad(
                "clusters.intra_bandwidth".into(),
                "must be positive".into(),
            ));
        }
        if self.groups.is_empty() {
            return Err(bad(
                "clusters.groups".into(),
                "list at least one group".into(),
            ));
        }
        let mut out = Vec::new();
        for (g, group) in self.groups.iter().enumerate() {
            let key = |field: &str| format!("clusters.groups[{g}].{field}");
            if group.name.trim().is_empty() {
                return Err(bad(key("name"), "must not be empty".into()));
            }
            if group.count == 0 {
                return Err(bad(key("count"), "must be at least 1".into()));
            }
            if group.workers == 0 {
                return Err(bad(key("workers"), "must be at least 1".into()));
            }
            if !(group.slowdown.is_finite() && group.slowdown > 0.0) {
                return Err(bad(
                    key("slowdown"),
                    format!("must be a positive number, got {}", group.slowdown),
                ));
            }
            if !(group.jitter.is_finite() && group.jitter >= 0.0) {
                return Err(bad(
                    key("jitter"),
                    format!("must be a non-negative fraction, got {}", group.jitter),
                ));
            }
            let device = scenario
                .device(&group.device, &key("device"))
                .map_err(|e| bad(e.key, e.problem))?;
            for i in 0..group.count {
                let name = if group.count == 1 {
                    group.name.clone()
                } else {
                    format!("{}-{i}", group.name)
                };
                if out.iter().any(|c: &ClusterSetup| c.name == name) {
                    return Err(bad(
                        key("name"),
                        format!("cluster name '{name}' is used twice"),
                    ));
                }
                out.push(ClusterSetup {
                    name,
                    workers: group.workers,
                    device: device.clone(),
                    straggler: Straggler {
                        slowdown: group.slowdown,
                        jitter: group.jitter,
                    },
                });
            }
        }
        if out.len() < 2 {
            return Err(bad(
                "clusters.groups".into(),
                format!(
                    "a clusters scenario needs at least 2 clusters in total, got {}",
                    out.len()
                ),
            ));
        }
        Ok(out)
    }
}

/// Name of the paper's DreamDDP configuration: the profiled DFS over all H phases, whole
/// layers, no delay (`dreamddp` runs the configuration search of `engine::config_search`).
pub const DREAMDDP_PAPER: &str = "dreamddp-paper";

/// A strategy of this simulation: the engine strategy, and whether it is the paper's fixed
/// DreamDDP configuration.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SimStrategy {
    /// The strategy the sync machine runs.
    pub strategy: Strategy,
    /// `dreamddp-paper`: schedule `profiled`, delay 1, whatever `[clusters]` says.
    pub paper: bool,
}

impl SimStrategy {
    /// The name in reports.
    pub fn name(self) -> &'static str {
        if self.paper {
            DREAMDDP_PAPER
        } else {
            self.strategy.name()
        }
    }
}

impl From<Strategy> for SimStrategy {
    fn from(strategy: Strategy) -> Self {
        Self {
            strategy,
            paper: false,
        }
    }
}

/// Parses a strategy name of this simulation.
pub fn parse_strategy(name: &str) -> Result<SimStrategy, ClustersError> {
    let unknown = || ClustersError::UnknownStrategy {
        got: name.to_string(),
        valid: STRATEGIES.join(", "),
    };
    if name.trim().eq_ignore_ascii_case(DREAMDDP_PAPER) {
        return Ok(SimStrategy {
            strategy: Strategy::DreamDdp,
            paper: true,
        });
    }
    let strategy = name.parse::<Strategy>().map_err(|_| unknown())?;
    Ok(SimStrategy {
        strategy,
        paper: false,
    })
}

/// Runs one strategy of a `kind = "clusters"` scenario on `task` and reports it.
/// `progress` is called with the fraction done (by steps or virtual time) after every step.
/// An unknown strategy or a bad `[clusters]` table is an error naming what was wrong.
pub fn run_clusters(
    scenario: &Scenario,
    task: &node::task::Task,
    strategy: &str,
    progress: &mut dyn FnMut(f64),
) -> Result<StrategyResult, String> {
    simulate(scenario, task, strategy, progress).map_err(|e| e.to_string())
}

/// [`run_clusters`] with a typed error.
pub fn simulate(
    scenario: &Scenario,
    task: &node::task::Task,
    strategy: &str,
    progress: &mut dyn FnMut(f64),
) -> Result<StrategyResult, ClustersError> {
    let strategy = parse_strategy(strategy)?;
    let spec = scenario
        .clusters
        .as_ref()
        .ok_or_else(|| ClustersError::Invalid {
            key: "clusters".into(),
            problem: "kind = \"clusters\" needs a [clusters] table".into(),
        })?;
    let clusters = spec.clusters(scenario)?;
    sim::Simulation::new(scenario, spec, clusters, task, strategy)?.run(progress)
}

#[cfg(test)]
mod tests;
