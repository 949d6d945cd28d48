//! What an edge scenario means for real processes ([`EdgePlan`]): per node its modelled step
//! time, batch, access links and first deadline, and the aggregators' averaging rule, exactly
//! as the simulator's world was built from the scenario. `dreamddp cluster SCENARIO` launches
//! real processes from it, so a real run and a simulated one start from the same numbers
//! (nothing is derived twice).

use cpu_aggregator::AggregatorConfig;
use engine::lr::LrSchedule;
use engine::optim::OptimizerConfig;

use super::spec::ChurnSpec;
use super::world::SyncMode;
use crate::link::LinkSpec;

/// One trainer of the scenario.
#[derive(Clone, Debug, PartialEq)]
pub struct PlannedNode {
    /// `cloud-<i>` or `edge-<i>`.
    pub name: String,
    /// Link class: `cloud` or `edge`.
    pub class: &'static str,
    /// The access link leaving the node (as the simulator built it: the lossless constant link
    /// of `elastic-lossless`, the scenario's link otherwise).
    pub up: LinkSpec,
    /// The access link reaching the node.
    pub down: LinkSpec,
    /// Nominal seconds of one step on its device class (before slowdown and jitter).
    pub step_s: f64,
    /// The class's slowdown factor.
    pub slowdown: f64,
    /// Up to this fraction extra per step.
    pub jitter: f64,
    /// Samples per step.
    pub batch: usize,
    /// First per-attempt deadline, milliseconds (slack + nominal transfer time + round wait).
    pub deadline_ms: f64,
    /// Seconds after the start at which it joins (a late joiner), if it does not start at once.
    pub joins_at_s: Option<f64>,
}

/// One aggregator.
#[derive(Clone, Debug, PartialEq)]
pub struct PlannedAggregator {
    /// `agg-<i>`.
    pub name: String,
    /// Its access link, leaving it.
    pub up: LinkSpec,
    /// Its access link, reaching it.
    pub down: LinkSpec,
}

/// Everything a real run of one strategy of an edge scenario needs.
#[derive(Clone, Debug)]
pub struct EdgePlan {
    /// The strategy's sync mode.
    pub mode: SyncMode,
    /// `elastic-lossless`: the links are the lossless constant ones.
    pub lossless: bool,
    /// Trainers, cloud nodes first.
    pub nodes: Vec<PlannedNode>,
    /// Aggregators.
    pub aggregators: Vec<PlannedAggregator>,
    /// The averaging rule every aggregator runs for this strategy.
    pub aggregator: AggregatorConfig,
    /// Optimizer of every trainer.
    pub optimizer: OptimizerConfig,
    /// Learning-rate schedule of every trainer.
    pub schedule: LrSchedule,
    /// Leave / crash / join events.
    pub churn: Vec<ChurnSpec>,
}
