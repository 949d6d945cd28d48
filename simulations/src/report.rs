//! Simulation results: one [`StrategyResult`] per strategy run, gathered in a [`SimSummary`]
//! (written as `summary.json`), plus the time series behind the CSV and the plots.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// Bytes on the nodes' access links among bytes counted by link class: the `cloud` and `edge`
/// classes (what a real run's relays count; the aggregators' own links are not relayed).
pub fn access_link_bytes(by_class: &BTreeMap<String, u64>) -> u64 {
    ["cloud", "edge"]
        .iter()
        .filter_map(|c| by_class.get(*c))
        .sum()
}

/// One evaluation of the global model during a run.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SeriesPoint {
    /// Virtual seconds.
    pub time_s: f64,
    /// Test accuracy (0..1) of the global model, or `None` for language models.
    pub accuracy: Option<f64>,
    /// Test / validation loss.
    pub loss: f64,
    /// Bytes sent on all links so far.
    pub bytes_sent: u64,
    /// Edge kind: bytes on the nodes' access links so far (the `cloud` and `edge` classes, what
    /// a real run's relays count; its `bytes_sent` is that already). `None` in other runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub access_bytes: Option<u64>,
    /// Mean optimizer steps completed per node so far.
    pub mean_steps: f64,
    /// Edge kind: the divergence monitor's largest spread over the layers (the farthest
    /// training device's distance to the global model, relative to its norm).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub divergence: Option<f64>,
}

/// A per-layer sync event for the timeline plot.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SyncEvent {
    /// Virtual seconds when the sync started.
    pub start_s: f64,
    /// Virtual seconds when it completed (or the deadline it missed).
    pub end_s: f64,
    /// Node name.
    pub node: String,
    /// Layer name.
    pub layer: String,
    /// Whether it was weak-synced (missed its deadline).
    pub weak: bool,
}

/// Result of one strategy on one scenario.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StrategyResult {
    /// Strategy name (`ssgd`, `wfbp`, `localsgd`, `dreamddp`, `elastic`, `blocking`, …).
    pub strategy: String,
    /// Virtual seconds until the global model first reached the scenario's target
    /// (accuracy ≥ target, or loss ≤ target); `None` if never.
    pub time_to_target_s: Option<f64>,
    /// Final test accuracy (classification) of the global model.
    pub final_accuracy: Option<f64>,
    /// Final test / validation loss.
    pub final_loss: f64,
    /// Virtual seconds simulated.
    pub virtual_seconds: f64,
    /// Bytes sent over all links (retransmissions included).
    pub bytes_sent: u64,
    /// Bytes per link class (e.g. `cloud`, `edge`, `inter-dc`).
    pub bytes_by_link_class: BTreeMap<String, u64>,
    /// Edge kind: bytes per access link, by `NODE.up` (node to aggregators) and `NODE.down`
    /// (aggregators to node), so two runs can be compared link by link (`fidelity`).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub bytes_by_link: BTreeMap<String, u64>,
    /// Layer exchanges that missed their deadline and went to the weak-sync cache.
    pub weak_sync_events: u64,
    /// Deltas neither applied nor still cached at the end (must be 0: the invariant).
    pub undelivered_deltas: u64,
    /// Deltas still in a weak-sync cache or in flight at the end (delivered later in a longer run).
    pub cached_at_end: u64,
    /// Histogram of staleness τ of applied deltas: τ → count.
    pub staleness_histogram: BTreeMap<u64, u64>,
    /// Mean virtual seconds per optimizer step per node.
    pub mean_step_s: f64,
    /// Wall-clock seconds the simulation of this strategy took. Not serialized: `summary.json`
    /// must be byte-identical across runs with the same seed (wall times go to `timing.json`).
    #[serde(skip)]
    pub wall_seconds: f64,
    /// Evaluations over virtual time.
    pub series: Vec<SeriesPoint>,
    /// Per-layer sync events (capped) for the timeline plot.
    pub timeline: Vec<SyncEvent>,
    /// `dreamddp` in a clusters scenario: every configuration the search modelled (schedule,
    /// phase groups, delay, modelled step time) and which one ran.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub plan_candidates: Vec<engine::config_search::Candidate>,
    /// Edge kind: how often the divergence monitor warned (a layer's spread grew past
    /// `warn_ratio` × its recent median; `[edge.divergence]`).
    #[serde(default)]
    pub divergence_warnings: u64,
    /// Edge kind: the largest spread at any evaluation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub divergence_peak: Option<f64>,
}

/// The `summary.json` of a simulation.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SimSummary {
    /// Scenario name.
    pub scenario: String,
    /// Seed.
    pub seed: u64,
    /// The scenario text as run (so `--replay` can re-run it exactly).
    pub scenario_toml: String,
    /// Target the time-to-target column refers to, e.g. `accuracy >= 0.9`.
    pub target: String,
    /// One result per strategy, in the order run.
    pub strategies: Vec<StrategyResult>,
}
