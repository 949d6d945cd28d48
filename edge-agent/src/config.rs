//! Construction inputs of a [`crate::SyncClient`]: per-layer specs ([`LayerSpec`]: shape,
//! period and phase, deadline, owning aggregator), initial values ([`LayerInit`]) and
//! tuning ([`ClientConfig`]).

use protocol::Codec;

/// A node's id on the wire (`node_id` fields of the protocol).
pub type NodeId = u64;

/// How one layer is synchronized.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayerSpec {
    /// Layer index in the model's layer manifest.
    pub layer_id: u32,
    /// Layer name (logs, payloads).
    pub name: String,
    /// Tensor shape, row-major (must match the aggregator's).
    pub shape: Vec<u32>,
    /// A delta is cut every `period_steps` steps (≥ 1).
    pub period_steps: u64,
    /// ... at the steps with `step % period_steps == phase % period_steps`.
    pub phase: u64,
    /// Each transmission attempt of a delta must be acknowledged within this many
    /// nanoseconds, or it is retried / weak-synced.
    pub deadline_ns: u64,
    /// Aggregator that owns the layer.
    pub owner: NodeId,
    /// Hard staleness bound `T_ℓ`: cut the layer at the first step end at least this many
    /// steps after its last cut, whatever its phase ([`crate::early_sync`]). `None`: off.
    pub max_stale_steps: Option<u64>,
    /// Rows of the matrix view of the layer for a low-rank codec (`powersgd:R`): the weight's
    /// output dimension, so the flat `[weight, bias]` reads as the weight's own rows plus a
    /// bias row. `None`: `⌈√len⌉` rows.
    pub matrix_rows: Option<u32>,
}

impl LayerSpec {
    /// Number of elements (product of the shape, saturating).
    pub fn len(&self) -> usize {
        self.shape
            .iter()
            .try_fold(1usize, |acc, &d| acc.checked_mul(d as usize))
            .unwrap_or(usize::MAX)
    }

    /// Whether the layer has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether a delta is due after step `step`.
    pub fn is_due(&self, step: u64) -> bool {
        self.period_steps > 0 && step % self.period_steps == self.phase % self.period_steps
    }
}

/// Spreads the phases of layers sharing a period: the `i`-th layer gets phase
/// `i % period_steps`, so not every layer is cut at the same step.
pub fn spread_phases(specs: &mut [LayerSpec]) {
    for (i, s) in specs.iter_mut().enumerate() {
        s.phase = i as u64 % s.period_steps.max(1);
    }
}

/// A layer with the values and global version the node starts from (the bootstrap
/// checkpoint; its local θ must equal `values` at that point).
#[derive(Clone, Debug, PartialEq)]
pub struct LayerInit {
    /// How the layer is synchronized.
    pub spec: LayerSpec,
    /// Global values at `version` (the first anchor).
    pub values: Vec<f32>,
    /// Global version of `values`.
    pub version: u64,
}

/// Tuning of a [`crate::SyncClient`].
#[derive(Clone, Debug, PartialEq)]
pub struct ClientConfig {
    /// Transmissions of one message (first send included) before it is given up on:
    /// a fresh delta is then weak-synced into the cache; a cached one waits for the next
    /// flush.
    pub max_attempts: u32,
    /// Codec of fresh deltas. Lossy codecs are fine: the anchor advances by the decoded
    /// values, so the quantization error stays in `θ − anchor` and goes out with the next
    /// delta. Deltas sent from the cache always use lossless `ZstdRawF32`.
    pub delta_codec: Codec,
    /// While the cache is not empty, a flush (one probe per layer) is attempted this often,
    /// besides [`crate::SyncClient::on_link_up`] and every ack. 0 disables the timer.
    pub flush_interval_ns: u64,
    /// First sequence number. Seqs are per client, strictly increasing across all layers,
    /// and **must keep increasing across restarts** (the aggregator treats a seq at or
    /// below the highest it applied as a duplicate): persist
    /// [`crate::SyncClient::next_seq`] and pass it back here.
    pub first_seq: u64,
    /// How attempt deadlines are chosen: each layer's `deadline_ns`, or adapted to observed
    /// delta→ack times ([`crate::deadline`]).
    pub deadline_policy: crate::deadline::DeadlinePolicy,
    /// Drift trigger: cut a layer early when the cosine of its progress since the last cut
    /// with its last delta falls below this ([`crate::early_sync`]). `None`: off.
    pub drift_cosine: Option<f32>,
    /// Learning-rate damping by staleness: a layer that has gone `s` of its periods without
    /// a new global version trains at `lr · base^s` ([`crate::SyncClient::lr_scale`], e.g.
    /// 0.9). `None`: off.
    pub lr_damping: Option<f32>,
}

impl Default for ClientConfig {
    fn default() -> Self {
        ClientConfig {
            max_attempts: 3,
            delta_codec: Codec::RawF32,
            flush_interval_ns: 1_000_000_000,
            first_seq: 1,
            deadline_policy: crate::deadline::DeadlinePolicy::Fixed,
            drift_cosine: None,
            lr_damping: None,
        }
    }
}
