//! The aggregator state machine: per-layer values and versions, at-most-once dedup of
//! deltas, staleness checks, rounds of staleness-weighted averaging, acks and broadcasts.
//!
//! ## Semantics of a [`Message::LayerDelta`] from node `from`
//!
//! Checked in this order; the first failing check decides the answer:
//!
//! 1. the payload's `node_id` is `from`, the layer is owned ([`protocol::ErrorCode::NotOwner`]
//!    otherwise), the shape is the layer's and `sample_count > 0`
//!    ([`protocol::ErrorCode::BadRequest`] otherwise) — rejections are answered with an
//!    [`ErrorReply`] and reported as [`AggEvent::BadInput`];
//! 2. **at-most-once:** the aggregator keeps, per `(node, layer)`, the highest `seq` it has
//!    applied. A node sends its deltas of one layer in increasing `seq` order and never
//!    sends `seq + 1` before `seq` is resolved (acked or dropped), so `seq ≤ highest` means
//!    "already applied": it is answered `DeltaAck { applied: false }` and reported as
//!    [`AggEvent::DuplicateRejected`]. A `seq` already waiting in the open round is also a
//!    duplicate, but gets no ack yet — the ack follows when the round is applied;
//! 3. staleness `τ = version − base_version`: a base in the future gets
//!    `Resync { UnknownBaseVersion }`, `τ > τ_max` gets `Resync { TooStale }` (`τ_max` in
//!    versions; scaled by the nodes contributing now under
//!    [`OuterLrScaling::Contributors`], see `AggregatorState::max_staleness`) (plus, by
//!    default, the current [`LayerVersion`] so the node can rebase at once), both reported
//!    as [`AggEvent::DroppedStale`]. The resync names the refused delta's seq
//!    (`refused_seq`), so the node drops that delta and no other;
//! 4. the payload decodes and is finite (else `BadRequest`), and the delta joins the
//!    layer's open round. The round is applied by the [`AggregatorConfig`] round policy.
//!
//! Applying a round: `θ ← θ + η · Σ wᵢΔᵢ / Σ wᵢ` (`wᵢ = nᵢ·s(τᵢ)`; with
//! [`OuterLrScaling::Contributors`], `η` times the round's `k` senders over the nodes
//! contributing now), version + 1, then
//! outputs in this order: [`AggEvent::Applied`], one `DeltaAck { applied: true }` per
//! contributor, one [`Output::Broadcast`] of the new [`LayerVersion`].
//!
//! ## Streaming
//!
//! Each delta is read once ([`engine::fused_reduce`]): on arrival it is checked for
//! finiteness while being added into the layer's accumulator. Applying a round is one pass
//! over the layer that also writes the broadcast payload; it runs in place when no value can
//! overflow (tracked `max |θ|` and `max |acc|`), otherwise into a second buffer that replaces
//! the layer only if every value is finite. So a NaN delta or an overflowing average never
//! reaches the model. `cargo bench -p cpu-aggregator` compares a round against `memcpy` of
//! the same bytes.

use std::collections::{BTreeMap, HashMap, VecDeque};

use engine::fused_reduce::{
    accumulate_checked, apply_checked, apply_in_place, in_place_is_safe, max_abs, FusedReduceError,
};
use protocol::{
    codec, shape_element_count, AppliedSeq, Codec, CodecError, DeltaAck, Encoded, ErrorReply,
    LayerPayload, LayerVersion, Message, Resync, ResyncReason,
};

use crate::config::{Aggregation, AggregatorConfig, NodeId, OuterLrScaling, OwnedLayer};
use crate::contributors::Contributors;
use crate::error::{AggregatorError, InputError, SnapshotError};
use crate::snapshot::{self, SnapshotData, SnapshotLayer};

/// Something the driver must do, drained with [`AggregatorState::poll_output`].
///
/// **Durability.** An ack promises that the delta is in the global model. A shell that must
/// survive `kill -9` persists [`AggregatorState::snapshot`] when it sees
/// [`AggEvent::Applied`], before transmitting the acks queued after it.
#[derive(Clone, Debug, PartialEq)]
pub enum Output {
    /// Send `msg` to node `to`.
    Send {
        /// Destination node.
        to: NodeId,
        /// The message.
        msg: Message,
    },
    /// Send `msg` to every node subscribed to this aggregator's layers (the shell keeps the
    /// subscriber set, e.g. every node that joined).
    Broadcast {
        /// The message.
        msg: Message,
    },
    /// Something worth logging or counting.
    Event(AggEvent),
}

/// What happened inside the aggregator.
#[derive(Clone, Debug, PartialEq)]
pub enum AggEvent {
    /// A round was applied to a layer.
    Applied {
        /// The layer.
        layer_id: u32,
        /// Its new version.
        version: u64,
        /// Deltas averaged in.
        n_deltas: usize,
        /// Staleness `τ` of each applied delta, in arrival order.
        staleness: Vec<u64>,
    },
    /// A delta was dropped and its sender told to re-sync.
    DroppedStale {
        /// Sender.
        from: NodeId,
        /// Layer.
        layer_id: u32,
        /// The delta's seq.
        seq: u64,
        /// Why (too stale, or a base version from the future).
        reason: ResyncReason,
    },
    /// A delta already applied (or already waiting in the open round) arrived again.
    DuplicateRejected {
        /// Sender.
        from: NodeId,
        /// Layer.
        layer_id: u32,
        /// The repeated seq.
        seq: u64,
    },
    /// A message was rejected with an error reply.
    BadInput {
        /// Sender.
        from: NodeId,
        /// What was wrong.
        reason: InputError,
    },
    /// A peer sent us an error reply.
    PeerError {
        /// Sender.
        from: NodeId,
        /// Its error.
        error: ErrorReply,
    },
    /// A round could not be applied (an internal inconsistency); its deltas were dropped
    /// unacknowledged, so their senders retransmit them.
    InternalError {
        /// The layer.
        layer_id: u32,
        /// What went wrong.
        reason: String,
    },
}

/// Running totals of an aggregator (kept across [`AggregatorState::snapshot`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AggregatorCounters {
    /// `LayerDelta` messages received (valid or not).
    pub deltas_received: u64,
    /// Deltas folded into a layer.
    pub deltas_applied: u64,
    /// Rounds applied (= version bumps).
    pub rounds_applied: u64,
    /// Duplicates rejected (at-most-once).
    pub duplicates_rejected: u64,
    /// Deltas dropped for staleness or an unknown base version.
    pub dropped_stale: u64,
    /// Messages rejected as bad input.
    pub bad_inputs: u64,
    /// Tensor payload bytes received in deltas.
    pub bytes_in: u64,
    /// Tensor payload bytes sent in layer versions (a broadcast counts once).
    pub bytes_out: u64,
}

/// Read-only view of one owned layer.
#[derive(Clone, Copy, Debug)]
pub struct LayerView<'a> {
    /// Layer id.
    pub layer_id: u32,
    /// Layer name.
    pub name: &'a str,
    /// Shape.
    pub shape: &'a [u32],
    /// Current global values.
    pub values: &'a [f32],
    /// Current global version.
    pub version: u64,
    /// Deltas waiting in the open round.
    pub pending: usize,
}

/// A delta accepted into a layer's open round. Its values were already folded into the
/// layer's accumulator; they are kept only to rebuild the accumulator if a later delta of
/// the round turns out non-finite mid-pass (and are recycled when the round closes).
#[derive(Clone, Debug)]
struct PendingDelta {
    from: NodeId,
    seq: u64,
    tau: u64,
    /// `wᵢ = nᵢ · s(τᵢ)`.
    weight: f64,
    delta: PendingValues,
}

/// A pending delta's values: a raw-f32 payload is kept as the wire bytes and read in place
/// (no decoded copy); other codecs are decoded on arrival.
#[derive(Clone, Debug)]
enum PendingValues {
    RawLe(Vec<u8>),
    Decoded(Vec<f32>),
}

/// The weight a round's sums are taken relative to: its first delta's, or 1 if that is 0.
fn reference_weight(first: f64) -> f64 {
    if first > 0.0 {
        first
    } else {
        1.0
    }
}

/// `w / w_ref` as the accumulator's f32 factor.
fn relative_weight(weight: f64, first: f64) -> f32 {
    (weight / reference_weight(first)) as f32
}

/// Little-endian f32 wire bytes viewed as native f32s without a copy, when that view is
/// exact: a little-endian target and a 4-byte-aligned buffer (what the allocator gives).
fn le_f32_view(bytes: &[u8]) -> Option<&[f32]> {
    if cfg!(target_endian = "little") {
        bytemuck::try_cast_slice::<u8, f32>(bytes).ok()
    } else {
        None
    }
}

impl PendingValues {
    /// The values as f32s. A `RawLe` buffer is only ever built when this view exists
    /// (little-endian target, 4-byte-aligned buffer); otherwise the payload is decoded.
    fn values(&self) -> &[f32] {
        match self {
            PendingValues::RawLe(b) => le_f32_view(b).unwrap_or(&[]),
            PendingValues::Decoded(v) => v,
        }
    }
}

#[derive(Clone, Debug)]
struct LayerState {
    layer_id: u32,
    name: String,
    shape: Vec<u32>,
    values: Vec<f32>,
    version: u64,
    /// Deltas of the open round, in arrival order.
    pending: Vec<PendingDelta>,
    /// `Σ (wᵢ/w_ref)·Δᵢ` over `pending` (meaningful only while `pending` is non-empty).
    /// Weights are taken relative to the round's first delta so that a large sample count
    /// cannot overflow the sum of finite deltas.
    acc: Vec<f32>,
    /// `Σ wᵢ` over `pending`.
    acc_weight: f64,
    /// `max |acc|` (infinite if the sum overflowed).
    acc_max_abs: f32,
    /// `max |values|`, kept up to date by every apply pass (decides whether the next apply
    /// can run in place).
    values_max_abs: f32,
    /// The buffer the next version is written into before it replaces `values` (so a
    /// failed pass never leaves a half-updated model).
    next_values: Vec<f32>,
    round_started_at: Option<u64>,
    /// Who has contributed lately ([`OuterLrScaling::Contributors`]).
    contributors: Contributors,
}

impl LayerState {
    /// Forgets the open round (its deltas stay unacknowledged).
    /// Distinct senders in the open round.
    fn distinct_senders(&self) -> usize {
        self.pending
            .iter()
            .enumerate()
            .filter(|(i, d)| !self.pending[..*i].iter().any(|e| e.from == d.from))
            .count()
    }

    fn clear_round(&mut self) -> Vec<PendingDelta> {
        self.round_started_at = None;
        self.acc_weight = 0.0;
        std::mem::take(&mut self.pending)
    }

    /// Recomputes the accumulator from `pending`, in arrival order (bit-identical to the
    /// sums made on arrival).
    fn rebuild_accumulator(&mut self) {
        self.acc_weight = 0.0;
        for (i, d) in self.pending.iter().enumerate() {
            // Every pending delta passed this very check on arrival.
            let rel = relative_weight(d.weight, self.pending[0].weight);
            self.acc_max_abs = accumulate_checked(&mut self.acc, d.delta.values(), rel, i == 0)
                .unwrap_or(f32::INFINITY);
            self.acc_weight += d.weight;
        }
    }
}

/// The aggregator of one shard of layers. See the [module docs](self) for the semantics.
#[derive(Clone, Debug)]
pub struct AggregatorState {
    id: NodeId,
    config: AggregatorConfig,
    layers: Vec<LayerState>,
    index: HashMap<u32, usize>,
    /// The at-most-once ledger, per layer: each node's highest applied seq. Kept per layer
    /// so a version's ledger is read without scanning every other layer's entries.
    highest_applied_seq: HashMap<u32, BTreeMap<NodeId, u64>>,
    outputs: VecDeque<Output>,
    counters: AggregatorCounters,
    /// Delta buffers of applied rounds, reused for the next deltas (no fresh multi-MB
    /// allocation, and its page faults, per message).
    spare: Vec<Vec<f32>>,
    /// Raw payload buffers of applied rounds, reused for the next broadcast payload (memory
    /// the allocator would otherwise hand back to the OS and fault in again per round).
    spare_payloads: Vec<Vec<u8>>,
}

/// Spare delta buffers kept for reuse.
const MAX_SPARE_BUFFERS: usize = 32;
/// Spare payload buffers kept for reuse as broadcast payloads (about one per round).
const MAX_SPARE_PAYLOADS: usize = 4;

impl AggregatorState {
    /// An aggregator `id` owning `layers` (each at version 0 with the given values).
    pub fn new(
        id: NodeId,
        layers: Vec<OwnedLayer>,
        config: AggregatorConfig,
    ) -> Result<Self, AggregatorError> {
        config.validate()?;
        let mut state = AggregatorState {
            id,
            config,
            layers: Vec::with_capacity(layers.len()),
            index: HashMap::with_capacity(layers.len()),
            highest_applied_seq: HashMap::new(),
            outputs: VecDeque::new(),
            counters: AggregatorCounters::default(),
            spare: Vec::new(),
            spare_payloads: Vec::new(),
        };
        for layer in layers {
            state.add_layer(layer, 0)?;
        }
        Ok(state)
    }

    fn add_layer(&mut self, layer: OwnedLayer, version: u64) -> Result<(), AggregatorError> {
        let shape_len = layer
            .shape
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(u64::from(d)))
            .unwrap_or(u64::MAX);
        if shape_len != layer.values.len() as u64 {
            return Err(AggregatorError::ShapeMismatch {
                layer_id: layer.layer_id,
                shape: layer.shape,
                shape_len,
                len: layer.values.len(),
            });
        }
        if let Some(index) = layer.values.iter().position(|v| !v.is_finite()) {
            return Err(AggregatorError::NonFiniteValue {
                layer_id: layer.layer_id,
                index,
            });
        }
        if self.index.contains_key(&layer.layer_id) {
            return Err(AggregatorError::DuplicateLayer {
                layer_id: layer.layer_id,
            });
        }
        self.index.insert(layer.layer_id, self.layers.len());
        let values_max_abs = max_abs(&layer.values);
        self.layers.push(LayerState {
            layer_id: layer.layer_id,
            name: layer.name,
            shape: layer.shape,
            values: layer.values,
            version,
            pending: Vec::new(),
            acc: Vec::new(),
            acc_weight: 0.0,
            acc_max_abs: 0.0,
            values_max_abs,
            next_values: Vec::new(),
            round_started_at: None,
            contributors: Contributors::default(),
        });
        Ok(())
    }

    /// This aggregator's node id.
    pub fn id(&self) -> NodeId {
        self.id
    }

    /// The configuration.
    pub fn config(&self) -> &AggregatorConfig {
        &self.config
    }

    /// Running totals.
    pub fn counters(&self) -> AggregatorCounters {
        self.counters
    }

    /// Ids of the owned layers, in construction order.
    pub fn layer_ids(&self) -> impl Iterator<Item = u32> + '_ {
        self.layers.iter().map(|l| l.layer_id)
    }

    /// A view of an owned layer, `None` if not owned.
    pub fn layer(&self, layer_id: u32) -> Option<LayerView<'_>> {
        let l = &self.layers[*self.index.get(&layer_id)?];
        Some(LayerView {
            layer_id: l.layer_id,
            name: &l.name,
            shape: &l.shape,
            values: &l.values,
            version: l.version,
            pending: l.pending.len(),
        })
    }

    /// Highest applied seq of `(node, layer)`, if any delta of it was applied.
    pub fn highest_applied_seq(&self, node: NodeId, layer_id: u32) -> Option<u64> {
        self.highest_applied_seq
            .get(&layer_id)
            .and_then(|l| l.get(&node))
            .copied()
    }

    /// Records `seq` as applied for `(node, layer_id)` (the highest one is kept).
    fn note_applied(&mut self, node: NodeId, layer_id: u32, seq: u64) {
        let high = self
            .highest_applied_seq
            .entry(layer_id)
            .or_default()
            .entry(node)
            .or_insert(seq);
        *high = (*high).max(seq);
    }

    /// Next queued output, `None` when there is nothing to do.
    pub fn poll_output(&mut self) -> Option<Output> {
        self.outputs.pop_front()
    }

    /// The earliest time (nanoseconds) at which [`Self::handle_timeout`] has work: the
    /// deadline of the oldest open round. `None` when no round is open.
    pub fn poll_timeout(&self) -> Option<u64> {
        self.layers
            .iter()
            .filter_map(|l| l.round_started_at)
            .map(|t| t.saturating_add(self.config.round_timeout_ns))
            .min()
    }

    /// Applies every open round whose deadline is `≤ now`.
    pub fn handle_timeout(&mut self, now: u64) {
        for li in 0..self.layers.len() {
            let due = self.layers[li]
                .round_started_at
                .is_some_and(|t| t.saturating_add(self.config.round_timeout_ns) <= now);
            if due {
                let senders = self.layers[li].distinct_senders();
                if senders < self.config.min_round_senders {
                    self.fail_round(li, senders);
                } else {
                    self.close_round(li, now);
                }
            }
        }
    }

    /// Refuses every delta of layer index `li`'s open round: it had `senders` distinct
    /// senders, fewer than [`AggregatorConfig::min_round_senders`].
    fn fail_round(&mut self, li: usize, senders: usize) {
        let reason = ResyncReason::RoundIncomplete {
            senders: u32::try_from(senders).unwrap_or(u32::MAX),
            required: u32::try_from(self.config.min_round_senders).unwrap_or(u32::MAX),
        };
        let layer = &mut self.layers[li];
        let dropped = layer.clear_round();
        layer.acc_max_abs = 0.0;
        for d in dropped {
            self.drop_stale(li, d.from, d.seq, reason);
            self.recycle(d.delta);
        }
    }

    /// Handles one message from node `from` (as identified by the transport). Never panics
    /// on bad input; answers are queued for [`Self::poll_output`].
    pub fn handle_message(&mut self, now: u64, from: NodeId, msg: Message) {
        match msg {
            Message::LayerDelta(payload) => self.handle_delta(now, from, payload),
            Message::Error(error) => self
                .outputs
                .push_back(Output::Event(AggEvent::PeerError { from, error })),
            Message::Subscribe(_) => self.answer_subscribe(from),
            other => {
                let kind = other.kind();
                self.reject(from, InputError::Unexpected { kind });
            }
        }
    }

    fn reject(&mut self, from: NodeId, reason: InputError) {
        self.counters.bad_inputs += 1;
        self.outputs.push_back(Output::Send {
            to: from,
            msg: Message::Error(ErrorReply {
                code: reason.code(),
                text: reason.to_string(),
            }),
        });
        self.outputs
            .push_back(Output::Event(AggEvent::BadInput { from, reason }));
    }

    fn handle_delta(&mut self, now: u64, from: NodeId, p: LayerPayload) {
        self.counters.deltas_received += 1;
        self.counters.bytes_in += p.payload.len() as u64;
        let layer_id = p.layer_id;
        if p.node_id != from {
            return self.reject(
                from,
                InputError::NodeMismatch {
                    claimed: p.node_id,
                    from,
                },
            );
        }
        let Some(&li) = self.index.get(&layer_id) else {
            return self.reject(from, InputError::NotOwner { layer_id });
        };
        let layer = &self.layers[li];
        if p.shape != layer.shape {
            let reason = InputError::ShapeMismatch {
                layer_id,
                expected: layer.shape.clone(),
                got: p.shape,
            };
            return self.reject(from, reason);
        }
        if p.sample_count == 0 {
            return self.reject(from, InputError::ZeroSamples { layer_id });
        }

        let applied_high = self.highest_applied_seq(from, layer_id);
        let in_round = layer
            .pending
            .iter()
            .any(|d| d.from == from && d.seq >= p.seq);
        if applied_high.is_some_and(|h| p.seq <= h) || in_round {
            self.counters.duplicates_rejected += 1;
            if !in_round {
                self.outputs.push_back(Output::Send {
                    to: from,
                    msg: Message::DeltaAck(DeltaAck {
                        node_id: from,
                        layer_id,
                        seq: p.seq,
                        applied: false,
                        new_version: layer.version,
                    }),
                });
            }
            self.outputs
                .push_back(Output::Event(AggEvent::DuplicateRejected {
                    from,
                    layer_id,
                    seq: p.seq,
                }));
            return;
        }

        let version = layer.version;
        let max_staleness = self.max_staleness(li, now);
        let stale = if p.base_version > version {
            Some(ResyncReason::UnknownBaseVersion)
        } else if version - p.base_version > max_staleness {
            Some(ResyncReason::TooStale {
                staleness: version - p.base_version,
                max_staleness,
            })
        } else {
            None
        };
        if let Some(reason) = stale {
            return self.drop_stale(li, from, p.seq, reason);
        }

        let tau = version - p.base_version;
        let weight = match self.config.aggregation {
            Aggregation::WeightedMean => self.config.staleness.weight(p.sample_count, tau),
            Aggregation::Buffered => self.config.staleness.discount(tau),
        };
        let values = match self.pending_values(p.payload, p.codec, &p.shape) {
            Ok(values) => values,
            Err(source) => return self.reject(from, InputError::Decode { layer_id, source }),
        };
        let delta = PendingDelta {
            from,
            seq: p.seq,
            tau,
            weight,
            delta: values,
        };
        let layer = &mut self.layers[li];
        let first = layer.pending.is_empty();
        layer.acc.resize(layer.values.len(), 0.0);
        let reference = layer.pending.first().map_or(weight, |d| d.weight);
        let rel = relative_weight(weight, reference);
        match accumulate_checked(&mut layer.acc, delta.delta.values(), rel, first) {
            Ok(acc_max_abs) => {
                layer.acc_weight += weight;
                layer.acc_max_abs = acc_max_abs;
                layer.pending.push(delta);
                layer.round_started_at.get_or_insert(now);
                layer.contributors.record(from, now);
            }
            Err(e) => {
                if !first {
                    layer.rebuild_accumulator();
                }
                self.recycle(delta.delta);
                return self.reject_fused(from, layer_id, e);
            }
        }
        if layer.distinct_senders() >= self.config.round_size {
            self.close_round(li, now);
        }
    }

    /// A delta's payload as values the fused kernels read: raw f32 wire bytes in place when
    /// they can be viewed as f32s, otherwise decoded (into a recycled buffer).
    fn pending_values(
        &mut self,
        payload: Vec<u8>,
        codec: Codec,
        shape: &[u32],
    ) -> Result<PendingValues, CodecError> {
        let len = shape_element_count(shape)?;
        if codec == Codec::RawF32 {
            codec::check_encoded_len(&payload, codec, len)?;
            if le_f32_view(&payload).is_some() {
                return Ok(PendingValues::RawLe(payload));
            }
        }
        let mut values = self.spare.pop().unwrap_or_default();
        match codec::decode_into(&payload, codec, len, &mut values) {
            Ok(()) => Ok(PendingValues::Decoded(values)),
            Err(e) => {
                self.spare.push(values);
                Err(e)
            }
        }
    }

    /// Keeps a delta's buffer for reuse: decoded values for the next decoded delta, raw
    /// payload bytes for the next broadcast payload.
    fn recycle(&mut self, values: PendingValues) {
        match values {
            PendingValues::Decoded(v) if self.spare.len() < MAX_SPARE_BUFFERS => self.spare.push(v),
            PendingValues::RawLe(b)
                if b.capacity() > 0 && self.spare_payloads.len() < MAX_SPARE_PAYLOADS =>
            {
                self.spare_payloads.push(b)
            }
            _ => {}
        }
    }

    /// Answers a delta refused by a fused pass.
    fn reject_fused(&mut self, from: NodeId, layer_id: u32, e: FusedReduceError) {
        match e {
            FusedReduceError::NonFiniteDelta { index } => {
                self.reject(from, InputError::NonFinite { layer_id, index })
            }
            other => self.internal_error(layer_id, other.to_string()),
        }
    }

    fn drop_stale(&mut self, li: usize, from: NodeId, seq: u64, reason: ResyncReason) {
        self.counters.dropped_stale += 1;
        let layer = &self.layers[li];
        let layer_id = layer.layer_id;
        self.outputs.push_back(Output::Send {
            to: from,
            msg: Message::Resync(Resync {
                layer_id,
                current_version: layer.version,
                refused_seq: Some(seq),
                reason,
            }),
        });
        if self.config.send_version_on_resync {
            match self.layer_version_message(li) {
                Ok(msg) => self.outputs.push_back(Output::Send { to: from, msg }),
                Err(e) => self.internal_error(layer_id, e.to_string()),
            }
        }
        self.outputs
            .push_back(Output::Event(AggEvent::DroppedStale {
                from,
                layer_id,
                seq,
                reason,
            }));
    }

    fn internal_error(&mut self, layer_id: u32, reason: String) {
        self.outputs
            .push_back(Output::Event(AggEvent::InternalError { layer_id, reason }));
    }

    /// The current [`LayerVersion`] message of layer index `li`, encoded with the
    /// broadcast codec. Counts its bytes as sent.
    fn layer_version_message(&mut self, li: usize) -> Result<Message, CodecError> {
        self.layer_version_message_from(li, None)
    }

    /// [`Self::layer_version_message`] with the plain (uncompressed) encoding of the current
    /// values already made, when the caller has it.
    fn layer_version_message_from(
        &mut self,
        li: usize,
        plain: Option<Encoded>,
    ) -> Result<Message, CodecError> {
        let layer = &self.layers[li];
        let codec_choice = self.config.broadcast_codec;
        let plain = match plain {
            Some(plain) => plain,
            None => codec::encode(&layer.values, codec_choice.base())?,
        };
        let encoded = if codec_choice.is_zstd() {
            codec::maybe_compress(plain)?
        } else {
            plain
        };
        self.counters.bytes_out += encoded.bytes.len() as u64;
        Ok(Message::LayerVersion(LayerVersion {
            aggregator_id: self.id,
            layer_id: layer.layer_id,
            layer_name: layer.name.clone(),
            version: layer.version,
            shape: layer.shape.clone(),
            codec: encoded.codec,
            payload: encoded.bytes,
            applied_seqs: self.applied_seqs(layer.layer_id),
        }))
    }

    /// The at-most-once ledger of one layer, sorted by node (what a [`LayerVersion`] carries).
    fn applied_seqs(&self, layer_id: u32) -> Vec<AppliedSeq> {
        self.highest_applied_seq
            .get(&layer_id)
            .map(|l| {
                l.iter()
                    .map(|(&node_id, &seq)| AppliedSeq { node_id, seq })
                    .collect()
            })
            .unwrap_or_default()
    }

    /// The current version of an owned layer as a [`LayerVersion`] message (e.g. for a node
    /// that just joined). `None` if the layer is not owned.
    pub fn current_version_message(
        &mut self,
        layer_id: u32,
    ) -> Option<Result<Message, CodecError>> {
        let li = *self.index.get(&layer_id)?;
        Some(self.layer_version_message(li))
    }

    /// A node subscribed: queue the current version of every owned layer past version 0 for
    /// it (how a newcomer bootstraps from the global model). The shell adds `from` to its
    /// subscribers.
    fn answer_subscribe(&mut self, from: NodeId) {
        for li in 0..self.layers.len() {
            // Version 0 is the initial model every node starts from (a node keeps its own
            // initial values for a layer the coordinator reports at version 0): sending it
            // again would only hold up a slow device's downlink (2.3 MB of an MLP's layers).
            if self.layers[li].version == 0 {
                continue;
            }
            match self.layer_version_message(li) {
                Ok(msg) => self.outputs.push_back(Output::Send { to: from, msg }),
                Err(e) => {
                    let layer_id = self.layers[li].layer_id;
                    self.outputs
                        .push_back(Output::Event(AggEvent::InternalError {
                            layer_id,
                            reason: format!("encoding the current version failed: {e}"),
                        }));
                }
            }
        }
    }

    /// Takes ownership of `layer` at global `version` (after a rebalance: the coordinator
    /// hands over the latest version it saw). If the layer is already owned, the newer of
    /// the two versions wins, so a layer's version never goes backwards. Returns whether the
    /// given values were adopted.
    ///
    /// `applied` is the version's ledger ([`LayerVersion::applied_seqs`]): when the values are
    /// adopted, every `(node, seq)` in it counts as applied here too, so a delta that is
    /// already in the adopted version is rejected as a duplicate if its sender retransmits
    /// it. (It is not merged when the values are not adopted: the deltas of an older version
    /// on another branch of history are not in this aggregator's values.)
    pub fn adopt_layer(
        &mut self,
        layer: OwnedLayer,
        version: u64,
        applied: &[AppliedSeq],
    ) -> Result<bool, AggregatorError> {
        let layer_id = layer.layer_id;
        let adopted = self.adopt_values(layer, version)?;
        if adopted {
            let li = self.index.get(&layer_id).copied();
            for a in applied {
                self.note_applied(a.node_id, layer_id, a.seq);
                if let Some(li) = li {
                    self.layers[li].contributors.seed(a.node_id);
                }
            }
        }
        Ok(adopted)
    }

    fn adopt_values(&mut self, layer: OwnedLayer, version: u64) -> Result<bool, AggregatorError> {
        if let Some(&li) = self.index.get(&layer.layer_id) {
            let current = &mut self.layers[li];
            if version <= current.version {
                return Ok(false);
            }
            if current.shape != layer.shape || current.values.len() != layer.values.len() {
                return Err(AggregatorError::ShapeMismatch {
                    layer_id: layer.layer_id,
                    shape: layer.shape,
                    shape_len: current.values.len() as u64,
                    len: layer.values.len(),
                });
            }
            if let Some(index) = layer.values.iter().position(|v| !v.is_finite()) {
                return Err(AggregatorError::NonFiniteValue {
                    layer_id: layer.layer_id,
                    index,
                });
            }
            current.values_max_abs = max_abs(&layer.values);
            current.values = layer.values;
            current.version = version;
            current.clear_round();
            return Ok(true);
        }
        self.add_layer(layer, version)?;
        Ok(true)
    }

    /// Gives up ownership of a layer (the coordinator moved it elsewhere). Deltas waiting in
    /// its open round are dropped unacknowledged, so their senders retransmit them to the new
    /// owner. Returns whether the layer was owned.
    pub fn release_layer(&mut self, layer_id: u32) -> bool {
        let Some(li) = self.index.remove(&layer_id) else {
            return false;
        };
        self.layers.remove(li);
        for (i, layer) in self.layers.iter().enumerate() {
            self.index.insert(layer.layer_id, i);
        }
        true
    }

    /// The most versions a delta of layer index `li` may be behind at `now`.
    ///
    /// With [`OuterLrScaling::Contributors`] (and weighted-mean rounds) `tau_max` counts the
    /// fleet's periods, not versions: `N_active` nodes with rounds of `round_size` senders
    /// advance a layer by about `N_active / round_size` versions per period, so the bound
    /// in versions is `tau_max · N_active / round_size` (never below `tau_max`). A fixed
    /// bound in versions refuses ever more of the fleet's deltas as it grows: with 33
    /// trainers and `round_size = 1`, `tau_max = 16` versions is half a period, and a real
    /// 32-edge cluster refused more deltas (665) than it applied (506).
    fn max_staleness(&mut self, li: usize, now: u64) -> u64 {
        let tau_max = self.config.tau_max;
        if self.config.outer_lr_scaling != OuterLrScaling::Contributors
            || self.config.aggregation != Aggregation::WeightedMean
        {
            return tau_max;
        }
        let active = self.layers[li].contributors.active(now, 1) as u64;
        let round = self.config.round_size.max(1) as u64;
        tau_max.saturating_mul(active).div_ceil(round).max(tau_max)
    }

    /// Applies the open round of layer index `li` (a no-op when it is empty):
    /// `θ ← θ + η/Σw · acc`, in one pass that also writes the broadcast payload when the
    /// broadcast codec is raw f32. In place when no value can overflow
    /// ([`in_place_is_safe`]); otherwise into a second buffer that replaces `θ` only if every
    /// value is finite — an overflowing round is dropped unacknowledged.
    fn close_round(&mut self, li: usize, now: u64) {
        let broadcast_raw = self.config.broadcast_codec.base() == Codec::RawF32;
        let mut eta = f64::from(self.config.outer_lr);
        if self.config.outer_lr_scaling == OuterLrScaling::Contributors
            && self.config.aggregation == Aggregation::WeightedMean
        {
            // The round's share of the nodes contributing now (`crate::contributors`).
            let layer = &mut self.layers[li];
            let k = layer.distinct_senders();
            eta *= k as f64 / layer.contributors.active(now, k).max(1) as f64;
        }
        if self.layers[li].pending.is_empty() {
            self.layers[li].round_started_at = None;
            return;
        }
        // The broadcast payload is written into the buffer of the round's last raw delta: it
        // was just read, so it is still in cache (a recycled buffer would be fetched from
        // memory only to be overwritten).
        let last_raw = self.layers[li]
            .pending
            .iter_mut()
            .rev()
            .find_map(|d| match &mut d.delta {
                PendingValues::RawLe(b) => Some(std::mem::take(b)),
                PendingValues::Decoded(_) => None,
            });
        let mut payload = match (broadcast_raw, last_raw) {
            (true, Some(b)) => b,
            (true, None) => self.spare_payloads.pop().unwrap_or_default(),
            (false, Some(b)) => {
                self.recycle(PendingValues::RawLe(b));
                Vec::new()
            }
            (false, None) => Vec::new(),
        };
        payload.clear();
        let layer = &mut self.layers[li];
        let layer_id = layer.layer_id;
        let reference = layer
            .pending
            .first()
            .map_or(1.0, |d| reference_weight(d.weight));
        // θ' = θ + η·Σwᵢ Δᵢ / Σwᵢ = θ + (η·w_ref/Σwᵢ) · Σ (wᵢ/w_ref)·Δᵢ; FedBuff divides
        // by the buffer's K deltas instead of Σwᵢ.
        let norm = match self.config.aggregation {
            Aggregation::WeightedMean => layer.acc_weight,
            Aggregation::Buffered => layer.pending.len() as f64,
        };
        let scale = if layer.acc_weight > 0.0 && norm > 0.0 {
            (eta * reference / norm) as f32
        } else {
            0.0
        };
        let payload_out = broadcast_raw.then_some(&mut payload);
        let result = if in_place_is_safe(layer.values_max_abs, layer.acc_max_abs, scale) {
            apply_in_place(&mut layer.values, &layer.acc, scale, payload_out)
        } else {
            let n = layer.values.len();
            layer.next_values.resize(n, 0.0);
            apply_checked(
                &layer.values,
                &layer.acc,
                scale,
                &mut layer.next_values,
                payload_out,
            )
            .inspect(|_| std::mem::swap(&mut layer.values, &mut layer.next_values))
        };
        match result {
            Ok(values_max_abs) => layer.values_max_abs = values_max_abs,
            Err(e) => {
                let dropped = layer.clear_round();
                let reason = format!(
                    "round of {} deltas not applied: {e}; senders will retransmit",
                    dropped.len()
                );
                self.recycle(PendingValues::RawLe(payload));
                for d in dropped {
                    self.recycle(d.delta);
                }
                return self.internal_error(layer_id, reason);
            }
        }
        layer.version += 1;
        let version = layer.version;
        let applied: Vec<PendingDelta> = layer.clear_round();
        self.counters.rounds_applied += 1;
        self.counters.deltas_applied += applied.len() as u64;
        self.outputs.push_back(Output::Event(AggEvent::Applied {
            layer_id,
            version,
            n_deltas: applied.len(),
            staleness: applied.iter().map(|d| d.tau).collect(),
        }));
        for d in &applied {
            self.note_applied(d.from, layer_id, d.seq);
            self.outputs.push_back(Output::Send {
                to: d.from,
                msg: Message::DeltaAck(DeltaAck {
                    node_id: d.from,
                    layer_id,
                    seq: d.seq,
                    applied: true,
                    new_version: version,
                }),
            });
        }
        let plain = broadcast_raw.then_some(Encoded {
            codec: Codec::RawF32,
            bytes: payload,
        });
        match self.layer_version_message_from(li, plain) {
            Ok(msg) => self.outputs.push_back(Output::Broadcast { msg }),
            Err(e) => self.internal_error(layer_id, e.to_string()),
        }
        for d in applied {
            self.recycle(d.delta);
        }
    }

    /// The whole shard (ids, names, shapes, values, versions, the dedup seq table and the
    /// counters) as checksummed bytes; see [`crate::snapshot`]. Open rounds are not included:
    /// their deltas were never acknowledged, so their senders retransmit them.
    pub fn snapshot(&self) -> Vec<u8> {
        let mut seq_table: Vec<(u64, u32, u64)> = self
            .highest_applied_seq
            .iter()
            .flat_map(|(&layer, nodes)| nodes.iter().map(move |(&node, &seq)| (node, layer, seq)))
            .collect();
        seq_table.sort_unstable();
        let data = SnapshotData {
            aggregator_id: self.id,
            counters: self.counters,
            layers: self
                .layers
                .iter()
                .map(|l| SnapshotLayer {
                    layer: OwnedLayer {
                        layer_id: l.layer_id,
                        name: l.name.clone(),
                        shape: l.shape.clone(),
                        values: l.values.clone(),
                    },
                    version: l.version,
                })
                .collect(),
            seq_table,
        };
        snapshot::encode(&data)
    }

    /// Rebuilds an aggregator from [`Self::snapshot`] bytes (validated: magic, format
    /// version, checksum, structure). Because versions may have been rewound relative to
    /// what nodes saw, the restored aggregator queues, per layer, a broadcast
    /// `Resync { AggregatorRestarted }` (about no specific delta: `refused_seq: None`)
    /// followed by the layer's current [`LayerVersion`].
    pub fn restore(bytes: &[u8], config: AggregatorConfig) -> Result<Self, SnapshotError> {
        let data = snapshot::decode(bytes)?;
        let mut state = AggregatorState::new(data.aggregator_id, Vec::new(), config)
            .map_err(|e| SnapshotError::Malformed(format!("configuration: {e}")))?;
        for l in data.layers {
            state
                .add_layer(l.layer, l.version)
                .map_err(|e| SnapshotError::Malformed(e.to_string()))?;
        }
        for (node, layer, seq) in data.seq_table {
            state
                .highest_applied_seq
                .entry(layer)
                .or_default()
                .insert(node, seq);
            if let Some(&li) = state.index.get(&layer) {
                state.layers[li].contributors.seed(node);
            }
        }
        state.counters = data.counters;
        for li in 0..state.layers.len() {
            let layer = &state.layers[li];
            state.outputs.push_back(Output::Broadcast {
                msg: Message::Resync(Resync {
                    layer_id: layer.layer_id,
                    current_version: layer.version,
                    refused_seq: None,
                    reason: ResyncReason::AggregatorRestarted,
                }),
            });
            match state.layer_version_message(li) {
                Ok(msg) => state.outputs.push_back(Output::Broadcast { msg }),
                Err(e) => {
                    let id = state.layers[li].layer_id;
                    state.internal_error(id, e.to_string())
                }
            }
        }
        Ok(state)
    }
}
