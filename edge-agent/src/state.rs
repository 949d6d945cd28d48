//! The sync-client state machine: per-layer anchors and versions, delta cuts, deadlines and
//! retries, the weak-sync cache protocol, acks, resyncs and the rebase on new versions.
//!
//! ## Accounting: every bit of local progress is in exactly one place
//!
//! Per layer, `θ − θ₀ = (θ − anchor) + handed-off deltas`, where a handed-off delta is in
//! flight, in the cache, applied by the aggregator, or dropped by it (`Resync`). A cut moves
//! `θ − anchor` into a delta and advances the anchor by exactly what is transmitted
//! (`anchor += Δ_sent`), so consecutive deltas never overlap and the anchor always equals
//! `θ_at_cut` of the latest cut (both rebased into the frame of the latest global version).
//! When a new global version arrives the asynchrony rule
//! `θ ← θ_global + (θ_now − θ_at_cut)`, `anchor ← θ_global` keeps the local progress not yet
//! handed off ([`SyncClient::apply_version`], using `engine::staleness::rebase`).
//!
//! ## Exactly-once delivery
//!
//! The aggregator applies a `(node, layer)`'s seqs at most once by keeping the highest
//! applied seq. For that to never *lose* a delta the client sends a layer's messages in
//! increasing seq order and never sends a new message before the previous one is resolved:
//!
//! * at most one message per layer is in flight; a cut that comes due meanwhile is deferred
//!   (its progress stays in `θ − anchor` and goes out with the next cut);
//! * a fresh delta whose `max_attempts` deadlines all passed is **weak-synced**: put into the
//!   cache ([`Output::CachePut`]) as *possibly delivered*; while the layer has cached
//!   entries, new cuts go straight into the cache (*never sent*);
//! * a flush (on [`SyncClient::on_link_up`], the flush timer, or any ack of the layer) sends
//!   the oldest cached entry. A possibly-delivered entry is retransmitted as-is with its own
//!   seq (so the aggregator's dedup catches it if it was applied). Never-sent entries are
//!   **coalesced** (sum, oldest base version — `engine::staleness::coalesce`) into one entry
//!   with a new seq, swapped in atomically ([`Output::CacheReplace`]) and sent once durable
//!   ([`SyncClient::cache_put_done`]). Possibly-delivered entries are never merged: merging
//!   a delta the aggregator may already have applied would apply it twice;
//! * an ack (applied or duplicate) of a cached entry removes it ([`Output::CacheRemove`]);
//!   a late ack of an entry already moved to the cache removes it too.
//!
//! Entries handed back after a restart ([`SyncClient::restore_from_cache`]) are treated as
//! possibly delivered.

use std::collections::{HashMap, VecDeque};

use engine::staleness::{coalesce, rebase};
use protocol::{
    payload_from_f32, Codec, DeltaAck, ErrorReply, LayerMeta, LayerPayload, LayerVersion, Message,
    Resync, ResyncReason,
};

use crate::cache::CacheEntry;
use crate::config::{ClientConfig, LayerInit, LayerSpec, NodeId};
use crate::deadline::{AckTimes, DeadlinePolicy};
use crate::early_sync::{progress_cosine, CutReason, MIN_STEPS_FOR_DRIFT};
use crate::error::ClientError;

/// Codec of messages sent from the cache: lossless, so a retransmission carries exactly the
/// cached values.
const CACHE_CODEC: Codec = Codec::ZstdRawF32;

/// Something the driver must do, drained with [`SyncClient::poll_output`].
#[derive(Clone, Debug, PartialEq)]
pub enum Output {
    /// Send `msg` to node `to` (an aggregator).
    Send {
        /// Destination.
        to: NodeId,
        /// The message.
        msg: Message,
    },
    /// Store `entry` durably, then call [`SyncClient::cache_put_done`].
    CachePut {
        /// The entry.
        entry: CacheEntry,
    },
    /// Atomically (one batch/transaction) remove `remove` and store `put`, then call
    /// [`SyncClient::cache_put_done`] for `put`.
    CacheReplace {
        /// Layer of every entry involved.
        layer_id: u32,
        /// Seqs of the coalesced entries.
        remove: Vec<u64>,
        /// The coalesced entry.
        put: CacheEntry,
    },
    /// Remove these (delivered or dropped) entries.
    CacheRemove {
        /// Layer.
        layer_id: u32,
        /// Seqs to remove.
        seqs: Vec<u64>,
    },
    /// A newer global version of a layer arrived: call [`SyncClient::apply_version`] with
    /// the layer's current local values and these global values.
    ApplyVersion {
        /// Layer.
        layer_id: u32,
        /// Global version.
        version: u64,
        /// Global values (decoded).
        values: Vec<f32>,
    },
    /// Something worth logging or counting.
    Event(ClientEvent),
}

/// What happened inside the client.
#[derive(Clone, Debug, PartialEq)]
pub enum ClientEvent {
    /// A fresh delta missed all its deadlines and was moved to the cache. The shell logs
    /// `[WARN] layer=<name> deadline missed, cached (<pending> pending)`.
    WeakSynced {
        /// Layer.
        layer_id: u32,
        /// The delta's seq.
        seq: u64,
        /// Cache entries of this layer now.
        pending: usize,
    },
    /// A cut went straight into the cache because the layer has a backlog.
    CutCached {
        /// Layer.
        layer_id: u32,
        /// The delta's seq.
        seq: u64,
        /// Cache entries of this layer now.
        pending: usize,
    },
    /// A message sent from the cache missed all its deadlines; it stays cached.
    FlushTimedOut {
        /// Layer.
        layer_id: u32,
        /// Seq.
        seq: u64,
        /// Cache entries of this layer.
        pending: usize,
    },
    /// Never-sent cached deltas were coalesced into one entry.
    Coalesced {
        /// Layer.
        layer_id: u32,
        /// Seq of the coalesced entry.
        seq: u64,
        /// Seqs it replaces.
        from_seqs: Vec<u64>,
        /// Its (oldest) base version.
        base_version: u64,
    },
    /// The aggregator acknowledged a delta (`applied: false`: it had already applied it).
    Delivered {
        /// Layer.
        layer_id: u32,
        /// Seq.
        seq: u64,
        /// Whether this copy was the one applied.
        applied: bool,
        /// The layer's version after it.
        new_version: u64,
    },
    /// The aggregator dropped a delta (too stale, unknown base) and asked for a re-sync.
    Dropped {
        /// Layer.
        layer_id: u32,
        /// Seq of the dropped delta.
        seq: u64,
        /// Why.
        reason: ResyncReason,
    },
    /// The layer must re-sync: cuts are skipped until a version `≥ current_version`
    /// arrives and is applied (it is accepted even if older than the local version).
    ResyncNeeded {
        /// Layer.
        layer_id: u32,
        /// The aggregator's current version.
        current_version: u64,
        /// Why.
        reason: ResyncReason,
    },
    /// A due cut was deferred because the previous delta is still in flight.
    CutDeferred {
        /// Layer.
        layer_id: u32,
        /// Step.
        step: u64,
    },
    /// A message was ignored (unknown layer, wrong owner, undecodable version, ...).
    Ignored {
        /// Why.
        reason: String,
    },
    /// A peer sent an error reply.
    PeerError {
        /// The reply.
        error: ErrorReply,
    },
}

/// What [`SyncClient::cut_layer`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CutOutcome {
    /// A fresh delta was sent with this seq.
    Sent(u64),
    /// The delta went into the cache with this seq (the layer has a backlog).
    Cached(u64),
    /// The previous delta is in flight; the progress stays local.
    Deferred,
    /// The layer waits for a re-sync; the progress stays local.
    SkippedResync,
    /// No samples were trained since the last cut.
    SkippedNoSamples,
}

/// Running totals of a client.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ClientCounters {
    /// Tensor payload bytes sent (every transmission).
    pub bytes_sent: u64,
    /// Distinct delta messages sent (first transmissions: fresh cuts and cache entries).
    pub deltas_sent: u64,
    /// Delta messages acknowledged (applied or duplicate).
    pub deltas_acked: u64,
    /// Repeated transmissions of a message already sent.
    pub retransmissions: u64,
    /// Fresh deltas moved to the cache after missing their deadlines.
    pub weak_sync_events: u64,
    /// Coalesced cache entries created.
    pub coalesced: u64,
    /// Due cuts deferred because a delta was in flight.
    pub cuts_deferred: u64,
    /// Deltas the aggregator dropped (resync).
    pub dropped_by_aggregator: u64,
    /// Global versions applied.
    pub versions_applied: u64,
    /// Acks matching nothing outstanding.
    pub stale_acks: u64,
    /// Cuts made before their phase by the staleness bound `T_ℓ`.
    pub cuts_forced_stale: u64,
    /// Cuts made before their phase by the drift trigger.
    pub cuts_forced_drift: u64,
}

/// Read-only view of a layer's in-flight message.
#[derive(Clone, Copy, Debug)]
pub struct InFlightView<'a> {
    /// Seq.
    pub seq: u64,
    /// Transmissions so far.
    pub attempts: u32,
    /// Deadline of the current attempt (ns).
    pub deadline: u64,
    /// Whether it was sent from the cache (else it is a fresh delta not in the cache).
    pub from_cache: bool,
    /// The message payload.
    pub payload: &'a LayerPayload,
}

#[derive(Clone, Debug)]
struct InFlight {
    payload: LayerPayload,
    attempts: u32,
    deadline: u64,
    from_cache: bool,
    /// When the first attempt went out (the delta→ack time of a message acked after one
    /// transmission is a sample of the adaptive deadline).
    first_sent: u64,
}

#[derive(Clone, Debug)]
struct CacheSlot {
    entry: CacheEntry,
    durable: bool,
    /// Possibly delivered: sent at least once (or restored). Never merged.
    maybe_sent: bool,
}

#[derive(Clone, Debug)]
struct LayerSync {
    spec: LayerSpec,
    anchor: Vec<f32>,
    /// Scratch copy of the anchor (θ_at_cut) for the rebase.
    cut_scratch: Vec<f32>,
    version: u64,
    samples_since_cut: u64,
    /// Step ends since the last cut (early sync's staleness bound).
    steps_since_cut: u64,
    /// Step ends since a global version was last applied (learning-rate damping).
    steps_since_version: u64,
    /// The last delta cut, kept for the drift trigger only when it is on.
    last_delta: Option<Vec<f32>>,
    in_flight: Option<InFlight>,
    /// Sorted by seq.
    cache: Vec<CacheSlot>,
    resync_target: Option<u64>,
    /// The newest global version this node's deltas went into (acks' `new_version`) or that a
    /// resync asked for: a synchronous round is over once the layer's anchor reaches it.
    required_version: u64,
    /// Seq of a coalesced entry waiting to become durable before it is sent.
    bundle_awaiting_durability: Option<u64>,
    /// Recent delta→ack times to the current owner (adaptive deadlines).
    ack_times: AckTimes,
    /// Karn's backoff: attempts missed since the last clean sample double the deadline.
    backoff: u32,
}

/// At most 2³ = 8 times the estimate: enough to learn a link up to 8x slower than the deadline
/// started, while a link that is simply down still weak-syncs its deltas into the durable
/// cache within a few attempts (unbounded doubling would hold one delta in flight for the
/// whole outage and leave the progress behind it in memory only).
const MAX_BACKOFF: u32 = 3;

/// The deadline of the layer's next attempt: the configured one when fixed; the adaptive
/// estimate doubled per attempt missed since the last delta acked after a single
/// transmission (Karn's algorithm: a retransmitted message's ack is ambiguous and never a
/// sample, and backing off is what lets a too-short deadline learn the true time), at most
/// [`MAX_BACKOFF`] doublings and the policy's upper bound.
fn attempt_deadline_ns(policy: &DeadlinePolicy, l: &LayerSync) -> u64 {
    let base = l.ack_times.deadline_ns(policy, l.spec.deadline_ns);
    match policy {
        DeadlinePolicy::Fixed => base,
        DeadlinePolicy::Adaptive(a) => base
            .saturating_mul(1u64 << l.backoff.min(MAX_BACKOFF))
            .min(a.max_ns.max(base)),
    }
}

impl LayerSync {
    fn accepts_version(&self, version: u64) -> bool {
        match self.resync_target {
            Some(target) => version >= target,
            None => version > self.version,
        }
    }
}

/// The sync client of one node. See the [module docs](self).
#[derive(Clone, Debug)]
pub struct SyncClient {
    node_id: NodeId,
    config: ClientConfig,
    layers: Vec<LayerSync>,
    index: HashMap<u32, usize>,
    next_seq: u64,
    next_flush_at: Option<u64>,
    outputs: VecDeque<Output>,
    counters: ClientCounters,
}

impl SyncClient {
    /// A client for `node_id` synchronizing `layers`, each starting from its given values
    /// and version.
    pub fn new(
        node_id: NodeId,
        layers: Vec<LayerInit>,
        config: ClientConfig,
    ) -> Result<Self, ClientError> {
        if config.max_attempts == 0 {
            return Err(ClientError::ZeroAttempts);
        }
        let mut index = HashMap::with_capacity(layers.len());
        let mut states = Vec::with_capacity(layers.len());
        for init in layers {
            let id = init.spec.layer_id;
            if init.spec.period_steps == 0 {
                return Err(ClientError::ZeroPeriod(id));
            }
            if init.values.len() != init.spec.len() {
                return Err(ClientError::LengthMismatch {
                    layer_id: id,
                    what: "initial values",
                    expected: init.spec.len(),
                    got: init.values.len(),
                });
            }
            if index.insert(id, states.len()).is_some() {
                return Err(ClientError::DuplicateLayer(id));
            }
            states.push(LayerSync {
                cut_scratch: vec![0.0; init.values.len()],
                anchor: init.values,
                spec: init.spec,
                version: init.version,
                samples_since_cut: 0,
                steps_since_cut: 0,
                steps_since_version: 0,
                last_delta: None,
                in_flight: None,
                cache: Vec::new(),
                resync_target: None,
                required_version: init.version,
                bundle_awaiting_durability: None,
                ack_times: AckTimes::default(),
                backoff: 0,
            });
        }
        Ok(SyncClient {
            node_id,
            next_seq: config.first_seq,
            config,
            layers: states,
            index,
            next_flush_at: None,
            outputs: VecDeque::new(),
            counters: ClientCounters::default(),
        })
    }

    fn li(&self, layer_id: u32) -> Result<usize, ClientError> {
        self.index
            .get(&layer_id)
            .copied()
            .ok_or(ClientError::UnknownLayer(layer_id))
    }

    /// This node's id.
    pub fn node_id(&self) -> NodeId {
        self.node_id
    }

    /// Running totals.
    pub fn counters(&self) -> ClientCounters {
        self.counters
    }

    /// The next seq this client will use (persist it to keep seqs increasing across
    /// restarts, see [`ClientConfig::first_seq`]).
    pub fn next_seq(&self) -> u64 {
        self.next_seq
    }

    /// The spec of a layer.
    pub fn layer_spec(&self, layer_id: u32) -> Option<&LayerSpec> {
        Some(&self.layers[*self.index.get(&layer_id)?].spec)
    }

    /// Global version the layer's anchor corresponds to.
    pub fn version(&self, layer_id: u32) -> Option<u64> {
        Some(self.layers[*self.index.get(&layer_id)?].version)
    }

    /// The layer's anchor (= θ at the latest cut, in the latest global frame).
    pub fn anchor(&self, layer_id: u32) -> Option<&[f32]> {
        Some(&self.layers[*self.index.get(&layer_id)?].anchor)
    }

    /// The deadline the layer's next attempt would get, nanoseconds (the configured one, or
    /// the adaptive estimate with its backoff).
    pub fn attempt_deadline_ns(&self, layer_id: u32) -> Option<u64> {
        let l = &self.layers[*self.index.get(&layer_id)?];
        Some(attempt_deadline_ns(&self.config.deadline_policy, l))
    }

    /// Cache entries of the layer.
    pub fn pending(&self, layer_id: u32) -> usize {
        self.index
            .get(&layer_id)
            .map_or(0, |&li| self.layers[li].cache.len())
    }

    /// The cache entries of the layer as the client believes them stored (in seq order).
    pub fn cached_entries(&self, layer_id: u32) -> impl Iterator<Item = &CacheEntry> + '_ {
        self.index
            .get(&layer_id)
            .into_iter()
            .flat_map(move |&li| self.layers[li].cache.iter().map(|s| &s.entry))
    }

    /// The layer's in-flight message, if any.
    pub fn in_flight(&self, layer_id: u32) -> Option<InFlightView<'_>> {
        let f = self.layers[*self.index.get(&layer_id)?]
            .in_flight
            .as_ref()?;
        Some(InFlightView {
            seq: f.payload.seq,
            attempts: f.attempts,
            deadline: f.deadline,
            from_cache: f.from_cache,
            payload: &f.payload,
        })
    }

    /// Whether a synchronous round (`blocking`, `fedavg-deadline`) is over for this node:
    /// every layer has nothing in flight or cached, no re-sync pending, and an anchor at or
    /// past the newest global version its deltas were applied into. A node that waits for its
    /// round trains on once this holds.
    pub fn round_complete(&self) -> bool {
        self.layers.iter().all(|l| {
            l.in_flight.is_none()
                && l.cache.is_empty()
                && l.resync_target.is_none()
                && l.version >= l.required_version
        })
    }

    /// Whether the layer waits for a re-sync version.
    pub fn needs_resync(&self, layer_id: u32) -> bool {
        self.index
            .get(&layer_id)
            .is_some_and(|&li| self.layers[li].resync_target.is_some())
    }

    /// Deltas handed off but not yet acknowledged: cache entries plus fresh in-flight ones.
    pub fn undelivered(&self) -> usize {
        self.layers
            .iter()
            .map(|l| {
                l.cache.len() + usize::from(l.in_flight.as_ref().is_some_and(|f| !f.from_cache))
            })
            .sum()
    }

    /// Ids of the layers due after `step`.
    pub fn due_layers(&self, step: u64) -> impl Iterator<Item = u32> + '_ {
        self.layers
            .iter()
            .filter(move |l| l.spec.is_due(step))
            .map(|l| l.spec.layer_id)
    }

    /// The layers whose values [`Self::on_step_end`] may read at the end of step `step`: the
    /// layers due by their phase and those an early trigger may cut ([`crate::early_sync`];
    /// with the drift trigger on, every layer that could be cut). Drivers read exactly these.
    pub fn layers_to_read(&self, step: u64) -> Vec<u32> {
        self.layers
            .iter()
            .filter(|l| {
                let could_cut_early = l.resync_target.is_none()
                    && l.in_flight.as_ref().is_none_or(|f| f.from_cache)
                    && (l
                        .spec
                        .max_stale_steps
                        .is_some_and(|t| l.steps_since_cut + 1 >= t.max(1))
                        || (self.config.drift_cosine.is_some()
                            && l.last_delta.is_some()
                            && l.steps_since_cut + 1 >= MIN_STEPS_FOR_DRIFT));
                l.spec.is_due(step) || could_cut_early
            })
            .map(|l| l.spec.layer_id)
            .collect()
    }

    /// The learning-rate factor of layer `layer_id` for the next step: `base^s` with `s` the
    /// whole periods the layer has trained since it last applied a global version, when
    /// [`ClientConfig::lr_damping`] is `base`; 1 otherwise (and for unknown layers).
    pub fn lr_scale(&self, layer_id: u32) -> f32 {
        let (Some(base), Some(&li)) = (self.config.lr_damping, self.index.get(&layer_id)) else {
            return 1.0;
        };
        let l = &self.layers[li];
        let stale = l.steps_since_version / l.spec.period_steps.max(1);
        engine::staleness::lr_damping(base, stale)
    }

    /// Next queued output.
    pub fn poll_output(&mut self) -> Option<Output> {
        self.outputs.pop_front()
    }

    /// Earliest time (ns) at which [`Self::handle_timeout`] has work: an attempt deadline or
    /// the flush timer.
    pub fn poll_timeout(&self) -> Option<u64> {
        let deadlines = self
            .layers
            .iter()
            .filter_map(|l| l.in_flight.as_ref().map(|f| f.deadline));
        let flush = self
            .next_flush_at
            .filter(|_| self.layers.iter().any(|l| !l.cache.is_empty()));
        deadlines.chain(flush).min()
    }

    /// End of training step `step` (which trained on `samples` samples): counts the samples
    /// for every layer, then cuts every layer due at this step or cut early by a trigger
    /// ([`crate::early_sync`]), reading its current values from `theta(layer_id)` (called
    /// only for [`Self::layers_to_read`]). Stops at the first layer whose values have the wrong length
    /// (layers before it were cut).
    pub fn on_step_end<'v>(
        &mut self,
        now: u64,
        step: u64,
        samples: u64,
        mut theta: impl FnMut(u32) -> &'v [f32],
    ) -> Result<(), ClientError> {
        for l in &mut self.layers {
            l.samples_since_cut = l.samples_since_cut.saturating_add(samples);
            l.steps_since_cut = l.steps_since_cut.saturating_add(1);
            l.steps_since_version = l.steps_since_version.saturating_add(1);
        }
        for li in 0..self.layers.len() {
            let id = self.layers[li].spec.layer_id;
            let values = theta(id);
            let reason = if self.layers[li].spec.is_due(step) {
                Some(CutReason::Scheduled)
            } else {
                self.early_cut_reason(li, values)
            };
            let Some(reason) = reason else {
                continue;
            };
            let outcome = self.cut_layer(now, step, id, values)?;
            if reason != CutReason::Scheduled
                && matches!(outcome, CutOutcome::Sent(_) | CutOutcome::Cached(_))
            {
                match reason {
                    CutReason::Staleness => self.counters.cuts_forced_stale += 1,
                    CutReason::Drift => self.counters.cuts_forced_drift += 1,
                    CutReason::Scheduled => {}
                }
            }
        }
        Ok(())
    }

    /// Whether layer index `li`, not due by its phase, must be cut now ([`crate::early_sync`]).
    fn early_cut_reason(&self, li: usize, theta: &[f32]) -> Option<CutReason> {
        let l = &self.layers[li];
        if l.resync_target.is_some()
            || l.samples_since_cut == 0
            || l.in_flight.as_ref().is_some_and(|f| !f.from_cache)
        {
            return None;
        }
        if l.spec
            .max_stale_steps
            .is_some_and(|t| l.steps_since_cut >= t.max(1))
        {
            return Some(CutReason::Staleness);
        }
        let threshold = self.config.drift_cosine?;
        let last = l.last_delta.as_ref()?;
        if l.steps_since_cut < MIN_STEPS_FOR_DRIFT || theta.len() != l.anchor.len() {
            return None;
        }
        progress_cosine(theta, &l.anchor, last)
            .filter(|&c| c < f64::from(threshold))
            .map(|_| CutReason::Drift)
    }

    /// Cuts a delta of one layer now (also usable outside the period, e.g. by a drift
    /// trigger). Samples are those counted by [`Self::on_step_end`] since the last cut.
    pub fn cut_layer(
        &mut self,
        now: u64,
        step: u64,
        layer_id: u32,
        theta: &[f32],
    ) -> Result<CutOutcome, ClientError> {
        let li = self.li(layer_id)?;
        let l = &mut self.layers[li];
        if theta.len() != l.anchor.len() {
            return Err(ClientError::LengthMismatch {
                layer_id,
                what: "theta",
                expected: l.anchor.len(),
                got: theta.len(),
            });
        }
        if l.resync_target.is_some() {
            return Ok(CutOutcome::SkippedResync);
        }
        if l.samples_since_cut == 0 {
            return Ok(CutOutcome::SkippedNoSamples);
        }
        if l.in_flight.as_ref().is_some_and(|f| !f.from_cache) {
            self.counters.cuts_deferred += 1;
            self.outputs
                .push_back(Output::Event(ClientEvent::CutDeferred { layer_id, step }));
            return Ok(CutOutcome::Deferred);
        }
        let delta: Vec<f32> = theta.iter().zip(&l.anchor).map(|(t, a)| t - a).collect();
        let seq = self.next_seq;
        let sample_count = l.samples_since_cut;
        if !l.cache.is_empty() {
            // Backlog: keep seq order by queueing behind the cached entries.
            for (a, d) in l.anchor.iter_mut().zip(&delta) {
                *a += d;
            }
            self.next_seq += 1;
            l.samples_since_cut = 0;
            l.steps_since_cut = 0;
            if self.config.drift_cosine.is_some() {
                l.last_delta = Some(delta.clone());
            }
            let mut entry = CacheEntry {
                layer_id,
                seq,
                base_version: l.version,
                sample_count,
                step,
                delta,
            };
            // A never-sent durable tail absorbs the cut (what a flush would do later anyway),
            // so an outage's backlog holds at most the possibly-delivered entries plus one,
            // in memory and on disk, however long it lasts.
            let tail_mergeable = l.bundle_awaiting_durability.is_none()
                && l.cache.last().is_some_and(|t| t.durable && !t.maybe_sent);
            let merged_from = if tail_mergeable {
                l.cache.pop().map(|tail| {
                    // `engine::staleness::coalesce` of (tail, cut), in place: both have the
                    // layer's length, the sum keeps the tail's (older) base version.
                    let t = tail.entry;
                    let mut merged = t.delta;
                    for (m, d) in merged.iter_mut().zip(&entry.delta) {
                        *m += d;
                    }
                    entry.delta = merged;
                    entry.base_version = entry.base_version.min(t.base_version);
                    entry.sample_count += t.sample_count;
                    entry.step = entry.step.max(t.step);
                    t.seq
                })
            } else {
                None
            };
            l.cache.push(CacheSlot {
                entry: entry.clone(),
                durable: false,
                maybe_sent: false,
            });
            let pending = l.cache.len();
            match merged_from {
                Some(tail_seq) => {
                    l.bundle_awaiting_durability = Some(seq);
                    self.counters.coalesced += 1;
                    let base_version = entry.base_version;
                    self.outputs.push_back(Output::CacheReplace {
                        layer_id,
                        remove: vec![tail_seq],
                        put: entry,
                    });
                    self.outputs
                        .push_back(Output::Event(ClientEvent::Coalesced {
                            layer_id,
                            seq,
                            from_seqs: vec![tail_seq],
                            base_version,
                        }));
                }
                None => self.outputs.push_back(Output::CachePut { entry }),
            }
            self.outputs
                .push_back(Output::Event(ClientEvent::CutCached {
                    layer_id,
                    seq,
                    pending,
                }));
            self.schedule_flush(now);
            return Ok(CutOutcome::Cached(seq));
        }
        let meta = LayerMeta {
            node_id: self.node_id,
            layer_id,
            layer_name: l.spec.name.clone(),
            step,
            base_version: l.version,
            version: l.version,
            seq,
            sample_count,
        };
        let codec = match self.config.delta_codec {
            Codec::LowRank { rows: 0, rank } => Codec::LowRank {
                rows: l.spec.matrix_rows.unwrap_or(0),
                rank,
            },
            codec => codec,
        };
        let payload = payload_from_f32(meta, &l.spec.shape, &delta, codec)?;
        let sent = if payload.codec.base() == Codec::RawF32 {
            delta
        } else {
            payload.decode_values()?
        };
        for (a, d) in l.anchor.iter_mut().zip(&sent) {
            *a += d;
        }
        self.next_seq += 1;
        l.samples_since_cut = 0;
        l.steps_since_cut = 0;
        if self.config.drift_cosine.is_some() {
            l.last_delta = Some(sent.clone());
        }
        self.counters.deltas_sent += 1;
        self.counters.bytes_sent += payload.payload.len() as u64;
        let deadline = now.saturating_add(attempt_deadline_ns(&self.config.deadline_policy, l));
        l.in_flight = Some(InFlight {
            payload: payload.clone(),
            attempts: 1,
            deadline,
            from_cache: false,
            first_sent: now,
        });
        self.outputs.push_back(Output::Send {
            to: l.spec.owner,
            msg: Message::LayerDelta(payload),
        });
        Ok(CutOutcome::Sent(seq))
    }

    fn schedule_flush(&mut self, now: u64) {
        if self.next_flush_at.is_none() && self.config.flush_interval_ns > 0 {
            self.next_flush_at = Some(now.saturating_add(self.config.flush_interval_ns));
        }
    }

    /// The coordinator moved `layer_id` to aggregator `owner` (a rebalance). Later sends and
    /// retransmissions of the layer go to the new owner; a message in flight to the old one
    /// is retried there at its next deadline. Returns whether the layer is known.
    pub fn set_owner(&mut self, layer_id: u32, owner: NodeId) -> bool {
        match self.li(layer_id) {
            Ok(li) => {
                let l = &mut self.layers[li];
                if l.spec.owner != owner {
                    // Another aggregator, maybe behind another link: learn its times anew.
                    l.ack_times.clear();
                    l.backoff = 0;
                }
                l.spec.owner = owner;
                true
            }
            Err(_) => false,
        }
    }

    /// Handles a message from an aggregator.
    pub fn handle_message(&mut self, now: u64, msg: Message) {
        match msg {
            Message::DeltaAck(ack) => self.handle_ack(now, ack),
            Message::Resync(resync) => self.handle_resync(now, resync),
            Message::LayerVersion(version) => self.handle_version(version),
            Message::Error(error) => self
                .outputs
                .push_back(Output::Event(ClientEvent::PeerError { error })),
            other => self.ignore(format!("unexpected message {other:?}")),
        }
    }

    fn ignore(&mut self, reason: String) {
        self.outputs
            .push_back(Output::Event(ClientEvent::Ignored { reason }));
    }

    fn handle_ack(&mut self, now: u64, ack: DeltaAck) {
        if ack.node_id != self.node_id {
            return self.ignore(format!("ack addressed to node {}", ack.node_id));
        }
        let Some(&li) = self.index.get(&ack.layer_id) else {
            return self.ignore(format!("ack for unknown layer {}", ack.layer_id));
        };
        let l = &mut self.layers[li];
        let in_flight_match = l
            .in_flight
            .as_ref()
            .is_some_and(|f| f.payload.seq == ack.seq);
        if in_flight_match {
            if let Some(f) = l.in_flight.take() {
                if let (DeadlinePolicy::Adaptive(a), 1) = (&self.config.deadline_policy, f.attempts)
                {
                    l.ack_times
                        .record(now.saturating_sub(f.first_sent), a.window);
                    l.backoff = 0;
                }
            }
        }
        let cached = l.cache.iter().position(|s| s.entry.seq == ack.seq);
        if let Some(pos) = cached {
            l.cache.remove(pos);
            self.outputs.push_back(Output::CacheRemove {
                layer_id: ack.layer_id,
                seqs: vec![ack.seq],
            });
        }
        if !in_flight_match && cached.is_none() {
            self.counters.stale_acks += 1;
            return;
        }
        self.counters.deltas_acked += 1;
        l.required_version = l.required_version.max(ack.new_version);
        self.outputs
            .push_back(Output::Event(ClientEvent::Delivered {
                layer_id: ack.layer_id,
                seq: ack.seq,
                applied: ack.applied,
                new_version: ack.new_version,
            }));
        // The link to this layer's owner works: push the backlog.
        self.flush_layer(now, li);
    }

    /// A resync always marks the layer for a rebase on a version `≥ current_version`. It
    /// drops the in-flight delta only when it names that delta's seq: a resync refusing an
    /// older (retransmitted) copy, or one about no delta at all (`refused_seq: None`, e.g.
    /// an aggregator restart), leaves the in-flight delta waiting for its own answer —
    /// dropping it would lose progress the aggregator never saw.
    fn handle_resync(&mut self, now: u64, r: Resync) {
        let Some(&li) = self.index.get(&r.layer_id) else {
            return self.ignore(format!("resync for unknown layer {}", r.layer_id));
        };
        let l = &mut self.layers[li];
        let refuses_in_flight = r.refused_seq.is_some_and(|refused| {
            l.in_flight
                .as_ref()
                .is_some_and(|f| f.payload.seq == refused)
        });
        if refuses_in_flight {
            if let Some(f) = l.in_flight.take() {
                let seq = f.payload.seq;
                if f.from_cache {
                    l.cache.retain(|s| s.entry.seq != seq);
                    self.outputs.push_back(Output::CacheRemove {
                        layer_id: r.layer_id,
                        seqs: vec![seq],
                    });
                }
                self.counters.dropped_by_aggregator += 1;
                self.outputs.push_back(Output::Event(ClientEvent::Dropped {
                    layer_id: r.layer_id,
                    seq,
                    reason: r.reason,
                }));
            }
        }
        let l = &mut self.layers[li];
        l.resync_target = Some(r.current_version);
        l.required_version = l.required_version.max(r.current_version);
        self.outputs
            .push_back(Output::Event(ClientEvent::ResyncNeeded {
                layer_id: r.layer_id,
                current_version: r.current_version,
                reason: r.reason,
            }));
        if refuses_in_flight {
            self.flush_layer(now, li);
        }
    }

    fn handle_version(&mut self, v: LayerVersion) {
        let Some(&li) = self.index.get(&v.layer_id) else {
            return self.ignore(format!("version of unknown layer {}", v.layer_id));
        };
        let l = &self.layers[li];
        if v.aggregator_id != l.spec.owner {
            return self.ignore(format!(
                "layer {} version from node {}, owner is {}",
                v.layer_id, v.aggregator_id, l.spec.owner
            ));
        }
        if !l.accepts_version(v.version) {
            return;
        }
        if v.shape != l.spec.shape {
            return self.ignore(format!(
                "layer {} version has shape {:?}, expected {:?}",
                v.layer_id, v.shape, l.spec.shape
            ));
        }
        match v.decode_values() {
            Ok(values) => self.outputs.push_back(Output::ApplyVersion {
                layer_id: v.layer_id,
                version: v.version,
                values,
            }),
            Err(e) => self.ignore(format!("layer {} version does not decode: {e}", v.layer_id)),
        }
    }

    /// The asynchrony rule for a new global version: `θ ← θ_global + (θ_now − θ_at_cut)`,
    /// `anchor ← θ_global`, version ← `version`, any pending re-sync cleared. Returns
    /// `Ok(false)` (touching nothing) when `version` is no longer newer than the layer's
    /// (e.g. a later version was applied first).
    pub fn apply_version(
        &mut self,
        layer_id: u32,
        theta_now: &mut [f32],
        global: &[f32],
        version: u64,
    ) -> Result<bool, ClientError> {
        let li = self.li(layer_id)?;
        let l = &mut self.layers[li];
        if !l.accepts_version(version) {
            return Ok(false);
        }
        for (what, got) in [("theta_now", theta_now.len()), ("global", global.len())] {
            if got != l.anchor.len() {
                return Err(ClientError::LengthMismatch {
                    layer_id,
                    what,
                    expected: l.anchor.len(),
                    got,
                });
            }
        }
        l.cut_scratch.copy_from_slice(&l.anchor);
        rebase(theta_now, &l.cut_scratch, global, &mut l.anchor)?;
        l.version = version;
        l.resync_target = None;
        l.steps_since_version = 0;
        self.counters.versions_applied += 1;
        Ok(true)
    }

    /// Handles every deadline `≤ now`: an attempt past its deadline is retransmitted (up to
    /// `max_attempts` transmissions), then a fresh delta is weak-synced into the cache and a
    /// cached one waits for the next flush; the flush timer flushes every layer.
    pub fn handle_timeout(&mut self, now: u64) {
        for li in 0..self.layers.len() {
            let l = &mut self.layers[li];
            if l.in_flight.as_ref().is_none_or(|f| f.deadline > now) {
                continue;
            }
            let layer_id = l.spec.layer_id;
            if let DeadlinePolicy::Adaptive(_) = self.config.deadline_policy {
                l.backoff = (l.backoff + 1).min(MAX_BACKOFF);
            }
            let next_deadline =
                now.saturating_add(attempt_deadline_ns(&self.config.deadline_policy, l));
            let Some(f) = l.in_flight.as_mut() else {
                continue;
            };
            if f.attempts < self.config.max_attempts {
                f.attempts += 1;
                f.deadline = next_deadline;
                self.counters.retransmissions += 1;
                self.counters.bytes_sent += f.payload.payload.len() as u64;
                let msg = Message::LayerDelta(f.payload.clone());
                self.outputs.push_back(Output::Send {
                    to: l.spec.owner,
                    msg,
                });
                continue;
            }
            let Some(f) = l.in_flight.take() else {
                continue;
            };
            let seq = f.payload.seq;
            if f.from_cache {
                let pending = l.cache.len();
                self.outputs
                    .push_back(Output::Event(ClientEvent::FlushTimedOut {
                        layer_id,
                        seq,
                        pending,
                    }));
            } else {
                let delta = match f.payload.decode_values() {
                    Ok(d) => d,
                    Err(e) => {
                        // Our own encoding: cannot fail. Keep the message in flight
                        // rather than lose the delta.
                        let reason = format!("layer {layer_id} seq {seq}: {e}");
                        l.in_flight = Some(f);
                        self.ignore(reason);
                        continue;
                    }
                };
                let entry = CacheEntry {
                    layer_id,
                    seq,
                    base_version: f.payload.base_version,
                    sample_count: f.payload.sample_count,
                    step: f.payload.step,
                    delta,
                };
                let pos = l.cache.partition_point(|s| s.entry.seq < seq);
                l.cache.insert(
                    pos,
                    CacheSlot {
                        entry: entry.clone(),
                        durable: false,
                        maybe_sent: true,
                    },
                );
                let pending = l.cache.len();
                self.counters.weak_sync_events += 1;
                self.outputs.push_back(Output::CachePut { entry });
                self.outputs
                    .push_back(Output::Event(ClientEvent::WeakSynced {
                        layer_id,
                        seq,
                        pending,
                    }));
            }
            self.schedule_flush(now);
        }
        if self.next_flush_at.is_some_and(|t| t <= now) {
            self.next_flush_at = None;
            self.flush_all(now);
            if self.layers.iter().any(|l| !l.cache.is_empty()) {
                self.schedule_flush(now);
            }
        }
    }

    /// The link is (back) up: flush every layer's cache.
    pub fn on_link_up(&mut self, now: u64) {
        self.flush_all(now);
    }

    fn flush_all(&mut self, now: u64) {
        for li in 0..self.layers.len() {
            self.flush_layer(now, li);
        }
    }

    /// The driver stored `(layer_id, seq)` durably (after [`Output::CachePut`] or
    /// [`Output::CacheReplace`]).
    pub fn cache_put_done(&mut self, now: u64, layer_id: u32, seq: u64) {
        let Some(&li) = self.index.get(&layer_id) else {
            return;
        };
        let l = &mut self.layers[li];
        if let Some(slot) = l.cache.iter_mut().find(|s| s.entry.seq == seq) {
            slot.durable = true;
        }
        if l.bundle_awaiting_durability == Some(seq) {
            l.bundle_awaiting_durability = None;
            self.flush_layer(now, li);
        }
    }

    /// Hands back the durable cache after a restart (all entries of all layers, any order).
    /// Entries are treated as possibly delivered (retransmitted one by one, never merged)
    /// and the seq counter is raised above them. A flush is due at `now`. All-or-nothing:
    /// on error nothing is restored.
    pub fn restore_from_cache(
        &mut self,
        now: u64,
        mut entries: Vec<CacheEntry>,
    ) -> Result<usize, ClientError> {
        entries.sort_by_key(|e| (e.layer_id, e.seq));
        for (i, e) in entries.iter().enumerate() {
            let li = self.li(e.layer_id)?;
            let l = &self.layers[li];
            if e.delta.len() != l.anchor.len() {
                return Err(ClientError::LengthMismatch {
                    layer_id: e.layer_id,
                    what: "cached delta",
                    expected: l.anchor.len(),
                    got: e.delta.len(),
                });
            }
            let repeated =
                (i > 0 && entries[i - 1].layer_id == e.layer_id && entries[i - 1].seq == e.seq)
                    || l.cache.iter().any(|s| s.entry.seq == e.seq);
            if repeated {
                return Err(ClientError::DuplicateCacheEntry {
                    layer_id: e.layer_id,
                    seq: e.seq,
                });
            }
        }
        let n = entries.len();
        for e in entries {
            self.next_seq = self.next_seq.max(e.seq.saturating_add(1));
            let l = &mut self.layers[self.index[&e.layer_id]];
            let pos = l.cache.partition_point(|s| s.entry.seq < e.seq);
            l.cache.insert(
                pos,
                CacheSlot {
                    entry: e,
                    durable: true,
                    maybe_sent: true,
                },
            );
        }
        if n > 0 {
            self.next_flush_at = Some(now);
        }
        Ok(n)
    }

    /// Sends (or first coalesces) the oldest cache entry of layer `li` if nothing of the
    /// layer is in flight.
    fn flush_layer(&mut self, now: u64, li: usize) {
        let l = &mut self.layers[li];
        if l.in_flight.is_some() || l.cache.is_empty() || l.bundle_awaiting_durability.is_some() {
            return;
        }
        let layer_id = l.spec.layer_id;
        let all_never_sent = l.cache.iter().all(|s| !s.maybe_sent);
        if all_never_sent && l.cache.len() > 1 {
            let parts: Vec<(Vec<f32>, u64)> = l
                .cache
                .iter()
                .map(|s| (s.entry.delta.clone(), s.entry.base_version))
                .collect();
            let (delta, base_version) = match coalesce(&parts) {
                Ok(c) => c,
                Err(e) => return self.ignore(format!("layer {layer_id}: coalesce failed: {e}")),
            };
            let seq = self.next_seq;
            self.next_seq += 1;
            let entry = CacheEntry {
                layer_id,
                seq,
                base_version,
                sample_count: l.cache.iter().map(|s| s.entry.sample_count).sum(),
                step: l.cache.iter().map(|s| s.entry.step).max().unwrap_or(0),
                delta,
            };
            let from_seqs: Vec<u64> = l.cache.iter().map(|s| s.entry.seq).collect();
            l.cache.clear();
            l.cache.push(CacheSlot {
                entry: entry.clone(),
                durable: false,
                maybe_sent: false,
            });
            l.bundle_awaiting_durability = Some(seq);
            self.counters.coalesced += 1;
            self.outputs.push_back(Output::CacheReplace {
                layer_id,
                remove: from_seqs.clone(),
                put: entry,
            });
            self.outputs
                .push_back(Output::Event(ClientEvent::Coalesced {
                    layer_id,
                    seq,
                    from_seqs,
                    base_version,
                }));
            return;
        }
        let slot = &mut l.cache[0];
        if !slot.durable {
            return;
        }
        let e = &slot.entry;
        let meta = LayerMeta {
            node_id: self.node_id,
            layer_id,
            layer_name: l.spec.name.clone(),
            step: e.step,
            base_version: e.base_version,
            version: l.version,
            seq: e.seq,
            sample_count: e.sample_count,
        };
        let payload = match payload_from_f32(meta, &l.spec.shape, &e.delta, CACHE_CODEC) {
            Ok(p) => p,
            Err(err) => {
                return self.ignore(format!(
                    "layer {layer_id}: cannot encode cached delta: {err}"
                ))
            }
        };
        if slot.maybe_sent {
            self.counters.retransmissions += 1;
        } else {
            slot.maybe_sent = true;
            self.counters.deltas_sent += 1;
        }
        self.counters.bytes_sent += payload.payload.len() as u64;
        let deadline = now.saturating_add(attempt_deadline_ns(&self.config.deadline_policy, l));
        l.in_flight = Some(InFlight {
            payload: payload.clone(),
            attempts: 1,
            deadline,
            from_cache: true,
            first_sent: now,
        });
        self.outputs.push_back(Output::Send {
            to: l.spec.owner,
            msg: Message::LayerDelta(payload),
        });
    }
}
