//! Construction inputs of an aggregator: the layers it owns ([`OwnedLayer`]) and its tuning
//! ([`AggregatorConfig`]: staleness function, `τ_max`, outer learning rate, round policy,
//! broadcast codec).

use engine::staleness::StalenessFn;
use protocol::Codec;
use serde::{Deserialize, Serialize};

use crate::error::AggregatorError;

/// A node's id on the wire (`node_id` fields of the protocol).
pub type NodeId = u64;

/// A layer the aggregator owns, with its initial global values (version 0).
#[derive(Clone, Debug, PartialEq)]
pub struct OwnedLayer {
    /// Layer index in the model's layer manifest.
    pub layer_id: u32,
    /// Layer name (logs, sanity checks, echoed in broadcasts).
    pub name: String,
    /// Tensor shape, row-major; every delta must carry exactly this shape.
    pub shape: Vec<u32>,
    /// Initial values; length = product of `shape`.
    pub values: Vec<f32>,
}

/// How an aggregator averages and when it closes a round.
///
/// **Round policy.** Accepted deltas of a layer are accumulated into a round; the round is
/// applied (one `aggregate` call, one version bump) as soon as deltas from `round_size`
/// *distinct* senders are in it, or `round_timeout_ns` after its first delta arrived
/// (whichever comes first, timeout via [`crate::AggregatorState::handle_timeout`]).
/// `round_size = 1` is fully asynchronous: every delta is applied on arrival,
/// `θ ← θ + η·Δ`.
#[derive(Clone, Debug, PartialEq)]
pub struct AggregatorConfig {
    /// Staleness discount `s(τ)` in the weights `wᵢ = nᵢ·s(τᵢ)`.
    pub staleness: StalenessFn,
    /// Deltas whose base is more than `tau_max` versions behind are dropped and the sender
    /// is told to re-sync. With [`OuterLrScaling::Contributors`] (weighted-mean rounds) the
    /// bound counts the fleet's periods instead: `tau_max · N_active / round_size` versions,
    /// never fewer than `tau_max`.
    pub tau_max: u64,
    /// Outer learning rate `η` in `θ ← θ + η · Σ wᵢΔᵢ / Σ wᵢ`.
    pub outer_lr: f32,
    /// Whether `η` is used as is or scaled by the round's share of the nodes contributing
    /// now ([`OuterLrScaling`]).
    pub outer_lr_scaling: OuterLrScaling,
    /// Distinct senders that close a round (≥ 1).
    pub round_size: usize,
    /// A round with at least one delta is applied this many nanoseconds after its first
    /// delta arrived, even if it has fewer than `round_size` senders.
    pub round_timeout_ns: u64,
    /// Codec of broadcast [`protocol::LayerVersion`] payloads. A `Zstd*` codec means "zstd
    /// when it shrinks". Lossy codecs make nodes see a quantized global version.
    pub broadcast_codec: Codec,
    /// When a delta is dropped with a [`protocol::Resync`], also send the sender the
    /// current [`protocol::LayerVersion`] so it can rebase without waiting for the next
    /// broadcast.
    pub send_version_on_resync: bool,
    /// How a round's deltas are combined.
    pub aggregation: Aggregation,
    /// A round closed by its timeout with fewer distinct senders than this is not applied:
    /// every delta in it is refused with [`protocol::ResyncReason::RoundIncomplete`] (FedAvg's
    /// minimum completion rate). 0 or 1: every round is applied.
    pub min_round_senders: usize,
}

/// How the outer learning rate of a [`Aggregation::WeightedMean`] round is set. The state
/// machine's default is `Fixed` (its `η` is applied exactly, as tests and embedders expect);
/// the aggregator's config file and the simulator's scenarios default to `Contributors`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OuterLrScaling {
    /// `η` as configured (an asynchronous aggregator with `N` nodes needs `η ≈ 1/N`).
    #[default]
    Fixed,
    /// `η · k / N_active` for a round of `k` distinct senders, `N_active` the nodes
    /// contributing to the layer now ([`crate::contributors`]): the update normalizes itself
    /// to the node count, so one `η` (1: move at the pace of the nodes' mean) serves 3 nodes
    /// or 1,000, and a node count that changes while the job runs.
    Contributors,
}

/// How the deltas of a round are combined.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Aggregation {
    /// `θ ← θ + η · Σ wᵢΔᵢ / Σ wᵢ`, `wᵢ = nᵢ·s(τᵢ)`: the staleness- and sample-weighted mean.
    #[default]
    WeightedMean,
    /// FedBuff (Nguyen et al., AISTATS 2022): `θ ← θ + η · (1/K) · Σ s(τᵢ)Δᵢ` over the `K`
    /// deltas of the round (the buffer), unweighted by samples.
    Buffered,
}

impl Default for AggregatorConfig {
    fn default() -> Self {
        AggregatorConfig {
            staleness: StalenessFn::default(),
            tau_max: 8,
            outer_lr: 1.0,
            outer_lr_scaling: OuterLrScaling::Fixed,
            round_size: 1,
            round_timeout_ns: 1_000_000_000,
            broadcast_codec: Codec::RawF32,
            send_version_on_resync: true,
            aggregation: Aggregation::WeightedMean,
            min_round_senders: 0,
        }
    }
}

impl AggregatorConfig {
    /// Checks the parameters: a valid staleness function, a finite positive `outer_lr`,
    /// `round_size ≥ 1`.
    pub fn validate(&self) -> Result<(), AggregatorError> {
        self.staleness.validate()?;
        if !(self.outer_lr.is_finite() && self.outer_lr > 0.0) {
            return Err(AggregatorError::BadOuterLr(self.outer_lr));
        }
        if self.round_size == 0 {
            return Err(AggregatorError::ZeroRoundSize);
        }
        Ok(())
    }
}
