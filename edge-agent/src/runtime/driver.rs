//! The synchronous half of a training node's cluster runtime: drives the sans-IO
//! [`SyncClient`] with wall-clock `now`, executes its outputs (messages to the network task,
//! durable [`DurableCache`] writes before they count, new global versions written into the
//! model) and logs in operators' language. It runs on the node leader's training thread as
//! its [`LeaderHook`]; the network lives in [`super::net`] on tokio and talks to it through
//! channels only.

use std::collections::{BTreeMap, HashMap};
use std::sync::mpsc::{Receiver, TryRecvError};
use std::time::Instant;

use engine::replica::ModelReplica;
use node::layout::{read_sync_unit, write_sync_unit, SyncLayerDef};
use node::training::LeaderHook;
use protocol::{Message, NodeStats, Role};
use tracing::{debug, error, info, warn};

use crate::cache::CacheEntry;
use crate::config::NodeId;
use crate::durable_cache::DurableCache;
use crate::state::{ClientEvent, Output, SyncClient};

/// The weak-sync cache is compacted when its directory exceeds this many bytes and
/// [`CACHE_BLOAT_FACTOR`] times its live entries (see [`DurableCache::compact_if_bloated`]).
const CACHE_COMPACT_BYTES: u64 = 64 << 20;
/// See [`CACHE_COMPACT_BYTES`].
const CACHE_BLOAT_FACTOR: u64 = 4;
/// How many cache changes pass between two checks of a non-empty cache's disk use.
const CACHE_CHECK_EVERY: u32 = 16;

use super::mailbox::VersionMailbox;
use super::topk::TopKSparsifier;

/// Where the driver sends messages (the network task's command channel).
pub trait Outbox: Send {
    /// Queue `msg` for aggregator `to`. Never blocks; a message for an unreachable
    /// aggregator is dropped (the client's deadlines handle the rest).
    fn to_aggregator(&self, to: NodeId, msg: Message);
    /// Queue `msg` for the coordinator.
    fn to_coordinator(&self, msg: Message);
}

/// What the network task reports to the driver.
#[derive(Debug)]
pub enum NetEvent {
    /// A message from an aggregator or the coordinator.
    Message(Message),
    /// Global versions are waiting in this mailbox (sent when it goes from empty to not).
    Versions(std::sync::Arc<VersionMailbox>),
    /// The connection to this aggregator is (again) up: retransmit the backlog now.
    AggregatorUp(NodeId),
    /// The network task stopped for good (e.g. the coordinator refused us); why.
    Fatal(String),
}

/// Counters of a node's cluster runtime (reported in [`NodeStats`] and the stats file).
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct DriverCounters {
    /// Steps done.
    pub step: u64,
    /// Fresh and cached delta payload bytes handed to the network.
    pub bytes_sent: u64,
    /// Global-version payload bytes received.
    pub bytes_received: u64,
    /// Fresh deltas that missed their deadlines and went to the cache (the sync client's and
    /// the simulator's `weak_sync_events`).
    pub weak_sync_events: u64,
    /// Cuts that went straight into the cache because their layer had a backlog (a delta in
    /// the cache or in flight from it); not counted as weak-sync events.
    pub cut_cached: u64,
    /// Deltas acknowledged by their aggregator.
    pub deltas_delivered: u64,
    /// Global versions written into the model.
    pub versions_applied: u64,
    /// Global versions replaced by a newer one of the same layer before the training thread
    /// took them (never held in memory beside it).
    pub versions_superseded: u64,
    /// Cached entries restored from disk at start.
    pub restored_from_cache: u64,
    /// Latest local evaluation accuracy.
    pub accuracy: Option<f32>,
    /// Delta→ack times of the deltas acknowledged (from the first send of a fresh delta or
    /// of a cached one's retransmission to its ack), milliseconds.
    pub ack_latency: node::latency::LatencyHistogram,
}

impl DriverCounters {
    /// Adds `other`'s counts to these (a swarm's total over its clients); `step` and
    /// `accuracy` keep the larger and the latest value.
    pub fn add(&mut self, other: &DriverCounters) {
        self.step = self.step.max(other.step);
        self.bytes_sent += other.bytes_sent;
        self.bytes_received += other.bytes_received;
        self.weak_sync_events += other.weak_sync_events;
        self.cut_cached += other.cut_cached;
        self.deltas_delivered += other.deltas_delivered;
        self.versions_applied += other.versions_applied;
        self.versions_superseded += other.versions_superseded;
        self.restored_from_cache += other.restored_from_cache;
        self.accuracy = other.accuracy.or(self.accuracy);
        self.ack_latency.merge(&other.ack_latency);
    }
}

/// The node leader's sync driver (see the module docs).
pub struct SyncDriver {
    client: SyncClient,
    cache: DurableCache,
    layers: Vec<SyncLayerDef>,
    by_id: HashMap<u32, usize>,
    outbox: Box<dyn Outbox>,
    inbound: Receiver<NetEvent>,
    clock: Instant,
    role: Role,
    sent_at: HashMap<(u32, u64), Instant>,
    counters: DriverCounters,
    stats_every: std::time::Duration,
    last_stats: Option<Instant>,
    map_epoch: u64,
    fatal: Option<String>,
    scratch: Vec<f32>,
    top_k: Option<TopKSparsifier>,
    /// Cache changes since the cache's disk use was last checked.
    cache_changes: u32,
    /// Per layer (index into `layers`), the newest global values written into the model:
    /// what the layer's distance to the global model is measured against.
    globals: Vec<Option<Vec<f32>>>,
    /// Per layer, the distance measured at the last report (`NodeStats::layer_divergence`).
    divergence: Vec<(u32, f32)>,
    /// `[sync] restart_from_global` (FedBuff's client rule): global versions wait in `held`
    /// until the local round's cut, then the next round starts from them.
    restart_from_global: bool,
    /// Per layer index: the newest held `(version, values)`.
    held: BTreeMap<usize, (u64, Vec<f32>)>,
    /// Layers still owed their final cut after training ([`final_flush`]).
    final_cuts: crate::final_cuts::FinalCuts,
}

impl SyncDriver {
    /// A driver around `client` (already restored from `cache`).
    pub fn new(
        client: SyncClient,
        cache: DurableCache,
        layers: Vec<SyncLayerDef>,
        outbox: Box<dyn Outbox>,
        inbound: Receiver<NetEvent>,
        role: Role,
        stats_every: std::time::Duration,
        map_epoch: u64,
    ) -> Self {
        let by_id = layers
            .iter()
            .enumerate()
            .map(|(i, l)| (l.layer_id, i))
            .collect();
        // Before any version arrives the anchors are the global values the node started from.
        let globals = layers
            .iter()
            .map(|l| client.anchor(l.layer_id).map(<[f32]>::to_vec))
            .collect();
        SyncDriver {
            client,
            cache,
            layers,
            by_id,
            outbox,
            inbound,
            clock: Instant::now(),
            role,
            sent_at: HashMap::new(),
            counters: DriverCounters::default(),
            stats_every,
            last_stats: None,
            map_epoch,
            fatal: None,
            scratch: Vec::new(),
            top_k: None,
            cache_changes: 0,
            globals,
            divergence: Vec::new(),
            restart_from_global: false,
            held: BTreeMap::new(),
            final_cuts: Default::default(),
        }
    }

    /// FedBuff's client rule (`[sync] restart_from_global`): from now on each local round
    /// trains on the model it started from; global versions that arrive meanwhile are held
    /// and written into the model right after the round's cut, so the next round restarts
    /// from the newest global model (its own progress was just handed off in the cut).
    /// Turned on after the bootstrap, which must apply what it downloads.
    pub fn set_restart_from_global(&mut self, on: bool) {
        self.restart_from_global = on;
    }

    /// After a cache change: compacts the cache when its directory has grown far beyond
    /// its live entries — checked at once when the change emptied it, otherwise every
    /// [`CACHE_CHECK_EVERY`] changes (the check reads the live entries).
    fn after_cache_change(&mut self) {
        self.cache_changes += 1;
        if !self.cache.is_empty() && self.cache_changes < CACHE_CHECK_EVERY {
            return;
        }
        self.cache_changes = 0;
        match self
            .cache
            .compact_if_bloated(CACHE_COMPACT_BYTES, CACHE_BLOAT_FACTOR)
        {
            Ok(Some(freed)) => info!(
                "[CACHE] compacted ({} deltas pending), {:.1} MB freed",
                self.cache.len(),
                freed as f64 / 1e6
            ),
            Ok(None) => {}
            Err(e) => warn!("[WARN] weak-sync cache compaction failed: {e}"),
        }
    }

    /// Cuts top-k sparsified deltas (`sync.codec = "topk:F"`): each due layer is handed to
    /// the client as `anchor + topk(θ − anchor)`; the rest stays in `θ − anchor` as the
    /// error-feedback residual (see [`super::topk`]).
    pub fn with_top_k(mut self, top_k: Option<TopKSparsifier>) -> Self {
        self.top_k = top_k;
        self
    }

    fn now(&self) -> u64 {
        self.clock.elapsed().as_nanos() as u64
    }

    /// Counters so far.
    pub fn counters(&self) -> &DriverCounters {
        &self.counters
    }

    /// Deltas not yet acknowledged (in flight or cached).
    pub fn undelivered(&self) -> usize {
        self.client.undelivered()
    }

    /// Records restored cache entries (for the counters).
    pub fn note_restored(&mut self, n: usize) {
        self.counters.restored_from_cache = n as u64;
    }

    /// Records the latest local evaluation.
    pub fn set_accuracy(&mut self, accuracy: Option<f32>) {
        self.counters.accuracy = accuracy;
    }

    /// The next seq the client will use (persist it across restarts).
    pub fn next_seq(&self) -> u64 {
        self.client.next_seq()
    }

    /// Handles everything that arrived and every due timeout, executes the client's outputs,
    /// and returns the model layers it rewrote. Call often (after every step, and in a loop
    /// while draining at the end).
    pub fn pump(&mut self, model: &mut dyn ModelReplica) -> Result<Vec<usize>, String> {
        if let Some(f) = &self.fatal {
            return Err(f.clone());
        }
        let mut changed = Vec::new();
        loop {
            match self.inbound.try_recv() {
                Ok(event) => self.handle_event(event)?,
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => {
                    return Err("the network task stopped".into());
                }
            }
        }
        let now = self.now();
        if self.client.poll_timeout().is_some_and(|t| t <= now) {
            self.client.handle_timeout(now);
        }
        self.drain_outputs(model, &mut changed)?;
        self.maybe_report(model);
        Ok(changed)
    }

    fn handle_event(&mut self, event: NetEvent) -> Result<(), String> {
        let now = self.now();
        match event {
            NetEvent::Message(Message::LayerMap(map)) => {
                if map.epoch > self.map_epoch {
                    self.map_epoch = map.epoch;
                    for (layer_id, owner) in map.owners {
                        self.client.set_owner(layer_id, owner);
                    }
                    info!("[MAP] epoch={} applied", self.map_epoch);
                }
            }
            NetEvent::Message(Message::Heartbeat(_)) => {}
            NetEvent::Message(Message::LayerVersion(v)) => {
                self.counters.bytes_received += v.payload.len() as u64;
                self.client.handle_message(now, Message::LayerVersion(v));
            }
            NetEvent::Message(msg) => self.client.handle_message(now, msg),
            NetEvent::Versions(mailbox) => {
                let taken = mailbox.take();
                self.counters.bytes_received += taken.bytes_received;
                self.counters.versions_superseded += taken.superseded;
                for v in taken.versions {
                    self.client.handle_message(now, Message::LayerVersion(v));
                }
            }
            NetEvent::AggregatorUp(id) => {
                debug!(aggregator = id, "link up: flushing the weak-sync backlog");
                self.client.on_link_up(now);
            }
            NetEvent::Fatal(reason) => {
                self.fatal = Some(reason.clone());
                return Err(reason);
            }
        }
        Ok(())
    }

    fn drain_outputs(
        &mut self,
        model: &mut dyn ModelReplica,
        changed: &mut Vec<usize>,
    ) -> Result<(), String> {
        while let Some(out) = self.client.poll_output() {
            let now = self.now();
            match out {
                Output::Send { to, msg } => {
                    if let Message::LayerDelta(p) = &msg {
                        self.counters.bytes_sent += p.payload.len() as u64;
                        self.sent_at
                            .entry((p.layer_id, p.seq))
                            .or_insert_with(Instant::now);
                    }
                    self.outbox.to_aggregator(to, msg);
                }
                Output::CachePut { entry } => {
                    self.cache
                        .put_durable(&entry)
                        .map_err(|e| format!("weak-sync cache write failed: {e}"))?;
                    self.client.cache_put_done(now, entry.layer_id, entry.seq);
                    self.after_cache_change();
                }
                Output::CacheReplace {
                    layer_id,
                    remove,
                    put,
                } => {
                    self.cache
                        .replace(layer_id, &remove, &put)
                        .map_err(|e| format!("weak-sync cache write failed: {e}"))?;
                    self.client.cache_put_done(now, put.layer_id, put.seq);
                    self.after_cache_change();
                }
                Output::CacheRemove { layer_id, seqs } => {
                    if let Err(e) = self.cache.remove(layer_id, &seqs) {
                        // Not fatal: a delivered entry left behind is retransmitted after a
                        // restart and rejected as a duplicate.
                        warn!("[WARN] weak-sync cache remove failed: {e}");
                    }
                    self.after_cache_change();
                }
                Output::ApplyVersion {
                    layer_id,
                    version,
                    values,
                } => {
                    let Some(&li) = self.by_id.get(&layer_id) else {
                        continue;
                    };
                    if self.restart_from_global {
                        let newer = self.held.get(&li).is_none_or(|(v, _)| version > *v);
                        if newer {
                            self.held.insert(li, (version, values));
                        }
                        continue;
                    }
                    self.apply_global(model, li, version, values, changed)?;
                }
                Output::Event(e) => self.log_event(e),
            }
        }
        Ok(())
    }

    /// Writes global `version` of layer `li` into the model by the asynchrony rule
    /// ([`SyncClient::apply_version`]); does nothing when the layer already has a newer one.
    fn apply_global(
        &mut self,
        model: &mut dyn ModelReplica,
        li: usize,
        version: u64,
        values: Vec<f32>,
        changed: &mut Vec<usize>,
    ) -> Result<(), String> {
        let (layer_id, index) = (self.layers[li].layer_id, self.layers[li].model_index);
        self.scratch = read_sync_unit(model, &self.layers[li]);
        match self
            .client
            .apply_version(layer_id, &mut self.scratch, &values, version)
        {
            Ok(true) => {
                write_sync_unit(model, &self.layers[li], &self.scratch);
                self.globals[li] = Some(values);
                self.counters.versions_applied += 1;
                if !changed.contains(&index) {
                    changed.push(index);
                }
                debug!("[VERSION] layer={} version={version}", self.layers[li].name);
                Ok(())
            }
            Ok(false) => Ok(()),
            Err(e) => Err(format!("applying a global version: {e}")),
        }
    }

    fn layer_name(&self, layer_id: u32) -> &str {
        self.by_id
            .get(&layer_id)
            .map_or("?", |&i| self.layers[i].name.as_str())
    }

    fn log_event(&mut self, e: ClientEvent) {
        match e {
            ClientEvent::WeakSynced {
                layer_id, pending, ..
            } => {
                self.counters.weak_sync_events += 1;
                warn!(
                    "[WARN] layer={} deadline missed, cached ({pending} pending)",
                    self.layer_name(layer_id)
                );
            }
            ClientEvent::CutCached {
                layer_id, pending, ..
            } => {
                self.counters.cut_cached += 1;
                warn!(
                    "[WARN] layer={} backlog, cached ({pending} pending)",
                    self.layer_name(layer_id)
                );
            }
            ClientEvent::Delivered {
                layer_id,
                seq,
                applied,
                new_version,
            } => {
                self.counters.deltas_delivered += 1;
                let sent = self.sent_at.remove(&(layer_id, seq));
                let ms = sent.map_or(0.0, |t| t.elapsed().as_secs_f64() * 1e3);
                if sent.is_some() {
                    self.counters.ack_latency.record_ms(ms);
                }
                let bytes = self
                    .by_id
                    .get(&layer_id)
                    .map_or(0, |&i| self.layers[i].len * 4);
                info!(
                    "[SYNC] layer={} version={new_version} bytes={bytes} ms={ms:.1} seq={seq}{}",
                    self.layer_name(layer_id),
                    if applied { "" } else { " (already applied)" }
                );
            }
            ClientEvent::Dropped {
                layer_id,
                seq,
                reason,
            } => {
                // The exchange ends here (the fidelity report's real timeline reads `ms`).
                let ms = self
                    .sent_at
                    .remove(&(layer_id, seq))
                    .map_or(0.0, |t| t.elapsed().as_secs_f64() * 1e3);
                warn!(
                    "[WARN] layer={} seq={seq} ms={ms:.1} delta refused by its aggregator: {reason:?}; re-syncing",
                    self.layer_name(layer_id)
                )
            }
            // `NotOwner` is the normal answer while a layer is being handed over between
            // aggregators (the delta is retried or cached); anything else is an error.
            ClientEvent::PeerError { error } if error.code == protocol::ErrorCode::NotOwner => {
                warn!(
                    "[WARN] aggregator replied NotOwner: {}; will retry",
                    error.text
                )
            }
            ClientEvent::PeerError { error } => {
                error!(
                    "[ERROR] aggregator replied {:?}: {}",
                    error.code, error.text
                )
            }
            ClientEvent::Ignored { reason } => debug!("ignored: {reason}"),
            other => debug!("{other:?}"),
        }
    }

    /// Each layer's distance to the newest global version written into it, relative to
    /// that version's norm.
    fn measure_divergence(&mut self, model: &mut dyn ModelReplica) {
        self.divergence.clear();
        for (l, global) in self.layers.iter().zip(&self.globals) {
            let Some(global) = global else { continue };
            let theta = read_sync_unit(model, l);
            if let Some(d) = engine::divergence::relative_distance(&theta, global) {
                self.divergence.push((l.layer_id, d));
            }
        }
    }

    fn maybe_report(&mut self, model: &mut dyn ModelReplica) {
        let due = self
            .last_stats
            .is_none_or(|t| t.elapsed() >= self.stats_every);
        if due {
            self.measure_divergence(model);
            self.last_stats = Some(Instant::now());
            self.outbox.to_coordinator(Message::Stats(self.stats()));
        }
    }

    /// This node's counters as a [`NodeStats`] message.
    pub fn stats(&self) -> NodeStats {
        let memory = node::memory::process_memory();
        NodeStats {
            node_id: self.client.node_id(),
            role: self.role,
            step: self.counters.step,
            bytes_sent: self.counters.bytes_sent,
            bytes_received: self.counters.bytes_received,
            weak_sync_events: self.counters.weak_sync_events,
            cached_pending: self
                .layers
                .iter()
                .map(|l| self.client.pending(l.layer_id) as u64)
                .sum(),
            deltas_applied: 0,
            duplicates_rejected: 0,
            dropped_stale: 0,
            layer_versions: self
                .layers
                .iter()
                .map(|l| (l.layer_id, self.client.version(l.layer_id).unwrap_or(0)))
                .collect(),
            staleness_histogram: Vec::new(),
            accuracy: self.counters.accuracy,
            rss_bytes: memory.rss_bytes,
            peak_rss_bytes: memory.peak_rss_bytes,
            layer_divergence: self.divergence.clone(),
        }
    }

    /// Sends a final stats report now.
    pub fn report_now(&mut self) {
        self.outbox.to_coordinator(Message::Stats(self.stats()));
        self.last_stats = Some(Instant::now());
    }

    /// Whether this node's synchronous round is over ([`SyncClient::round_complete`]).
    pub fn round_complete(&self) -> bool {
        self.client.round_complete()
    }

    /// Cached entries on disk (for tests and the stats file).
    pub fn cache_entries(&self) -> Vec<CacheEntry> {
        self.cache.entries().unwrap_or_default()
    }

    fn cut(&mut self, step: u64, samples: u64, model: &mut dyn ModelReplica) -> Result<(), String> {
        let now = self.now();
        let layers = &self.layers;
        let by_id = &self.by_id;
        let mut values: HashMap<u32, Vec<f32>> = HashMap::new();
        for id in self.client.layers_to_read(step) {
            if let Some(&i) = by_id.get(&id) {
                let theta = read_sync_unit(model, &layers[i]);
                let theta = match (&self.top_k, self.client.anchor(id)) {
                    (Some(top_k), Some(anchor)) if anchor.len() == theta.len() => top_k
                        .sparsify(&theta, anchor)
                        .map_err(|e| format!("top-k of layer {id} at step {step}: {e}"))?,
                    _ => theta,
                };
                values.insert(id, theta);
            }
        }
        let empty: Vec<f32> = Vec::new();
        self.client
            .on_step_end(now, step, samples, |id| {
                values.get(&id).map_or(empty.as_slice(), |v| v.as_slice())
            })
            .map_err(|e| format!("cutting deltas at step {step}: {e}"))
    }
}

impl LeaderHook for SyncDriver {
    fn after_step(
        &mut self,
        step: u64,
        samples: u64,
        model: &mut dyn ModelReplica,
    ) -> Result<Vec<usize>, String> {
        self.counters.step = step;
        // Versions that arrived during the step are applied before the cut, so the delta is
        // taken against the freshest anchor.
        let mut changed = self.pump(model)?;
        let round_end = self.restart_from_global && self.client.due_layers(step).next().is_some();
        self.cut(step, samples, model)?;
        let mut after = self.pump(model)?;
        if round_end {
            // The round's progress is handed off: restart from the newest global model.
            for (li, (version, values)) in std::mem::take(&mut self.held) {
                self.apply_global(model, li, version, values, &mut after)?;
            }
        }
        for index in after {
            if !changed.contains(&index) {
                changed.push(index);
            }
        }
        Ok(changed)
    }

    fn should_stop(&self) -> bool {
        self.fatal.is_some()
    }

    /// Per model layer: the smallest scale of its units (a split layer is damped as much
    /// as its stalest chunk).
    fn lr_scales(&self) -> Vec<(usize, f32)> {
        let mut scales: Vec<(usize, f32)> = Vec::new();
        for l in &self.layers {
            let f = self.client.lr_scale(l.layer_id);
            match scales.iter_mut().find(|(i, _)| *i == l.model_index) {
                Some((_, s)) => *s = s.min(f),
                None => scales.push((l.model_index, f)),
            }
        }
        scales.retain(|&(_, f)| f != 1.0);
        scales
    }
}

mod final_flush;

#[cfg(test)]
#[path = "driver_tests.rs"]
mod tests;
