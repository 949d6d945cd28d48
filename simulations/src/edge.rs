//! Edge simulation (`kind = "edge"`): cloud GPU nodes, CPU aggregators and edge devices on
//! lossy links, co-training one model with cross-site layer exchanges.
//!
//! The simulator drives the *real* sans-IO state machines — [`edge_agent::SyncClient`] on every
//! node and [`cpu_aggregator::AggregatorState`] on every aggregator — over the packet-level link
//! models of [`crate::link`] (loss, Gilbert–Elliott bursts, outages, cellular traces) in virtual
//! time, with real gradients on real data ([`crate::replica::Replica`]). Message sizes are the
//! real frame sizes ([`protocol::encode_frame`]).
//!
//! # Strategies
//! * `elastic` — each node trains continuously at its own compute speed. Every `period` steps
//!   (phases spread over the layers) the client cuts a layer's delta `θ − anchor` and sends it
//!   to the aggregator owning the layer with a deadline; a delta that misses `max_attempts`
//!   deadlines is weak-synced into the durable cache and retransmitted (coalesced) later.
//!   Aggregators apply deltas with staleness-weighted averaging (`round_size = 1`: on arrival)
//!   and broadcast new layer versions, which nodes rebase into their model
//!   (`θ ← θ_global + (θ_now − θ_at_cut)`).
//! * `blocking` — every `period` steps each node sends all layers and waits until its
//!   aggregators have the round of every node (or the round timed out) and the new versions
//!   arrived: a synchronous round over the same lossy links, with the same retry / cache logic.
//! * `elastic-lossless` — `elastic` with every link replaced by a lossless, outage-free constant
//!   link of the same nominal rate (a trace's mean rate) and latency: the reference for the
//!   accuracy cost of the lossy links.
//! * `fedavg-deadline` — Flower's FedAvg with a round deadline (`FaultTolerantFedAvg`): the
//!   `blocking` rounds, aggregated at `[edge.fedavg] round_deadline_s` with whoever arrived
//!   if at least `min_completion_rate` of the nodes did (else dropped), late updates dropped
//!   (`τ_max = 0`). Rounds are per layer (every layer is sent at the same step, so they
//!   close together unless a node's layers straddle the deadline).
//! * `fedbuff` — FedBuff: every `period` steps a node sends its whole update (every layer at
//!   the same step) and restarts from the newest global model it has received (versions
//!   arriving during local training wait for the next cut); each aggregator buffers
//!   `[edge.fedbuff] buffer_size` updates per layer, scales each by `1/√(1+τ)` and applies
//!   `server_lr · (1/K) Σ s(τᵢ)Δᵢ`.
//!
//! # The invariant
//! A [`ledger::Ledger`] follows every delta a node cuts. At the end every delta must have been
//! applied exactly once, dropped for staleness (sender told to re-sync), merged into a
//! coalesced entry, lost with a crashed node before it became durable, or still be cached or in
//! flight; [`crate::report::StrategyResult::undelivered_deltas`] counts the rest and must be 0.
//!
//! Modules: [`spec`] (the `[edge]` table), [`world`] (the event loop), [`ledger`] (the invariant).

pub mod ledger;
pub mod plan;
pub mod spec;
pub mod world;

#[cfg(test)]
mod tests;

pub use plan::{EdgePlan, PlannedAggregator, PlannedNode};
pub use spec::{
    AggregatorsSpec, ChurnAction, ChurnSpec, CloudSpec, DevicesSpec, EdgeSpec, EdgeSpecError,
    FedAvgSpec, FedBuffSpec, StalenessSpec, WireCodec,
};
pub use world::{EdgeDiagnostics, SyncMode};

use crate::report::StrategyResult;
use crate::scenario::Scenario;
use node::task::Task;

/// Strategies of edge scenarios.
pub const STRATEGIES: &[&str] = &[
    "elastic",
    "blocking",
    "elastic-lossless",
    "fedavg-deadline",
    "fedbuff",
];

/// Runs one strategy of an edge scenario. Everything in the result is a deterministic function
/// of the scenario and its seed (`wall_seconds` is left at 0 for the caller to fill in).
/// `progress` receives the fraction of `max_virtual_s` simulated so far.
pub fn run_edge(
    scenario: &Scenario,
    task: &Task,
    strategy: &str,
    progress: &mut dyn FnMut(f64),
) -> Result<StrategyResult, String> {
    run_edge_detailed(scenario, task, strategy, progress).map(|(result, _)| result)
}

/// The plan of a real run of `strategy` on `scenario` ([`EdgePlan`]): the simulator's world is
/// built (not run) and read back, so both engines start from the same numbers.
pub fn plan_edge(scenario: &Scenario, task: &Task, strategy: &str) -> Result<EdgePlan, String> {
    Ok(build_world(scenario, task, strategy)?.plan())
}

/// The world of one strategy, built from the scenario's `[edge]` table.
fn build_world<'a>(
    scenario: &'a Scenario,
    task: &'a Task,
    strategy: &str,
) -> Result<world::World<'a>, String> {
    let spec = scenario
        .edge
        .as_ref()
        .ok_or("edge: kind = \"edge\" needs an [edge] table")?;
    let resolved = spec.resolve(scenario).map_err(|e| e.to_string())?;
    let (mode, lossless) = mode_of(strategy)?;
    world::World::new(scenario, spec, &resolved, task, mode, lossless, strategy)
}

fn mode_of(strategy: &str) -> Result<(SyncMode, bool), String> {
    Ok(match strategy {
        "elastic" => (SyncMode::Elastic, false),
        "blocking" => (SyncMode::Blocking, false),
        "elastic-lossless" => (SyncMode::Elastic, true),
        "fedavg-deadline" => (SyncMode::FedAvgDeadline, false),
        "fedbuff" => (SyncMode::FedBuff, false),
        other => {
            return Err(format!(
                "strategies: unknown edge strategy '{other}' (expected one of: {})",
                STRATEGIES.join(", ")
            ))
        }
    })
}

/// [`run_edge`] with the diagnostics behind the result (ledger totals, aggregator counters).
pub fn run_edge_detailed(
    scenario: &Scenario,
    task: &Task,
    strategy: &str,
    progress: &mut dyn FnMut(f64),
) -> Result<(StrategyResult, EdgeDiagnostics), String> {
    build_world(scenario, task, strategy)?.run(progress)
}
