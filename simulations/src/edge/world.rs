//! The edge simulation proper: the discrete-event loop that drives the real sans-IO state
//! machines — one [`SyncClient`] per node, one [`AggregatorState`] per aggregator — over
//! modelled links and a virtual clock, with real forward/backward passes on real data.
//!
//! Per node: a [`Replica`] trains at the node's compute speed (one `ComputeDone` event per
//! step); at the end of each step the client cuts the layers due and the deltas travel the
//! node's up link, then the owning aggregator's down link. Acks and layer versions travel back
//! the other way. Layer versions are fanned out per subscriber *latest-wins*: at most one
//! version is in transit to a node at a time, and a newer version of a layer replaces an older
//! one still waiting (a shell streams state, not a log of states). The client's cache outputs go
//! to an in-memory durable store (the simulator's stand-in for sled), confirmed at once.

mod divergence;
mod links;

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::rc::Rc;
use std::sync::Arc;

use coordinator::DivergenceMonitor;
use cpu_aggregator::{
    AggEvent, Aggregation, AggregatorConfig, AggregatorState, OuterLrScaling, OwnedLayer,
};
use edge_agent::runtime::config::{parse_delta_codec, DeltaCodec};
use edge_agent::runtime::topk::TopKSparsifier;
use edge_agent::{
    spread_phases, CacheEntry, ClientConfig, ClientEvent, FinalCuts, LayerInit, LayerSpec,
    Output as ClientOutput, SyncClient,
};
use engine::lr::LrSchedule;
use engine::model::Model;
use engine::optim::OptimizerConfig;
use engine::staleness::StalenessFn;
use node::task::Task;
use protocol::{encode_frame, payload_from_f32, LayerMeta, Message};

use super::ledger::{DeltaKey, Ledger, LedgerCheck};
use super::plan::{EdgePlan, PlannedAggregator, PlannedNode};
use super::spec::{AccessLink, ChurnAction, EdgeSpec, ResolvedEdge};
use crate::compute::{layer_costs, Device, Straggler};
use crate::events::EventQueue;
use crate::link::{Bandwidth, Link, LinkSpec, MuxLink};
use crate::replica::Replica;
use crate::report::{SeriesPoint, StrategyResult, SyncEvent};
use crate::rng::SimRng;
use crate::scenario::Scenario;
use crate::time::{SimDuration, SimTime};
use crate::trace::{Trace, TraceFormat};

/// Wire ids of aggregators start here (nodes are `1..`).
const AGG_WIRE_BASE: u64 = 1_000_000;
/// Most per-layer sync events kept for the timeline plot.
const TIMELINE_CAP: usize = 4000;
/// Most undelivered deltas listed in [`EdgeDiagnostics::undelivered`].
const UNDELIVERED_LISTED: usize = 20;
/// Wait before retrying a bootstrap download that failed.
const BOOTSTRAP_RETRY: SimDuration = SimDuration::from_secs(1);

/// How the nodes synchronize across sites.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SyncMode {
    /// Per-layer deadlines, weak-sync cache, staleness-weighted (asynchronous) averaging;
    /// training never waits.
    Elastic,
    /// Every `period` steps each node sends all layers and waits for the round of all nodes.
    Blocking,
    /// `blocking` rounds with Flower's deadline semantics: aggregated at the deadline with
    /// whoever arrived (if enough did), late updates dropped.
    FedAvgDeadline,
    /// FedBuff: whole-model updates every `period` steps, restart from the newest global
    /// model, buffered staleness-scaled aggregation.
    FedBuff,
}

impl SyncMode {
    /// Whether nodes wait for their round before training on (synchronous rounds).
    fn waits_for_round(self) -> bool {
        matches!(self, SyncMode::Blocking | SyncMode::FedAvgDeadline)
    }
}

/// Extra results of a run that tests and reports look at.
#[derive(Clone, Debug, PartialEq)]
pub struct EdgeDiagnostics {
    /// The ledger check at the end.
    pub ledger: LedgerCheck,
    /// Deltas the aggregators applied (their counters, summed).
    pub aggregator_applied: u64,
    /// Duplicates the aggregators rejected (at-most-once at work).
    pub duplicates_rejected: u64,
    /// Deltas the aggregators dropped for staleness.
    pub aggregator_dropped_stale: u64,
    /// Optimizer steps per node, in node order.
    pub steps: Vec<u64>,
    /// Cache entries handed back to restarted clients.
    pub restored_entries: u64,
    /// The first few undelivered deltas `(node index, layer, seq)`, for debugging (empty when
    /// the invariant holds).
    pub undelivered: Vec<DeltaKey>,
    /// Global model parameters finite at the end (no divergence).
    pub finite: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum LinkClass {
    Cloud,
    Edge,
}

impl LinkClass {
    fn label(self) -> &'static str {
        match self {
            LinkClass::Cloud => "cloud",
            LinkClass::Edge => "edge",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Status {
    /// Not joined yet (a late joiner).
    Absent,
    /// Downloading the global model to (re)join.
    Bootstrapping,
    /// Training.
    Training,
    /// Blocking: waiting for the round it just sent.
    Waiting,
    /// Done training (max steps reached, or left): drains its remaining progress.
    Finished,
    /// Crashed.
    Down,
}

/// One parameterized layer of the model as a sync unit.
struct SyncLayer {
    id: u32,
    model_index: usize,
    name: String,
    len: usize,
    owner: usize,
    /// Frame bytes of one fresh delta on the wire.
    delta_frame_bytes: u64,
    /// Frame bytes of one broadcast version.
    version_frame_bytes: u64,
    /// Rows of the layer as a matrix for a low-rank codec: its weight's output dimension plus
    /// one row per started row of the remaining (bias) values.
    matrix_rows: Option<u32>,
}

struct PendingVersion {
    version: u64,
    order: u64,
    bytes: u64,
    msg: Rc<Message>,
}

struct SimNode {
    name: String,
    wire: u64,
    class: LinkClass,
    up: MuxLink,
    down: MuxLink,
    /// Copies of `up` and `down` its connection handshakes cross ([`Link::handshake_path`]).
    handshake_up: Link,
    handshake_down: Link,
    outage_ends: Vec<SimTime>,
    /// Nominal virtual seconds of one training step (forward + backward).
    step_s: f64,
    straggler: Straggler,
    compute_rng: SimRng,
    samples_per_step: usize,
    deadline_ns: u64,
    replica: Option<Replica>,
    client: Option<SyncClient>,
    /// The durable weak-sync cache, keyed by (layer, seq).
    store: BTreeMap<(u32, u64), CacheEntry>,
    durable_next_seq: u64,
    steps: u64,
    status: Status,
    /// Left gracefully (training paused until it comes back).
    left: bool,
    /// Bumped when the node crashes: invalidates its timers and messages addressed to it.
    gen: u64,
    /// Bumped when a step in progress is abandoned (crash, leave).
    compute_gen: u64,
    timer_at: Option<u64>,
    subscribed: bool,
    pending_versions: BTreeMap<u32, PendingVersion>,
    /// Layers whose version slot is taken (a frame not yet admitted to the node's down link).
    version_busy: BTreeSet<u32>,
    sent_version: Vec<u64>,
    /// fedbuff: the newest global version of each layer received during the local round.
    held_versions: BTreeMap<u32, (u64, Vec<f32>)>,
    drain: FinalCuts,
    training_started_at: Option<SimTime>,
    last_step_at: SimTime,
}

struct SimAgg {
    state: AggregatorState,
    up: MuxLink,
    down: MuxLink,
    timer_at: Option<u64>,
}

/// A message on its way through two links.
enum Cargo {
    /// Node → aggregator.
    Delta {
        from: usize,
        agg: usize,
        key: DeltaKey,
        msg: Message,
    },
    /// Aggregator → node (ack, resync, version).
    ToNode {
        agg: usize,
        node: usize,
        gen: u64,
        msg: Message,
        /// `(layer, version)` for a version (latest-wins bookkeeping).
        version: Option<(u32, u64)>,
    },
    /// The global model a (re)joining node starts from.
    Bootstrap {
        node: usize,
        gen: u64,
        values: Vec<Vec<f32>>,
        versions: Vec<u64>,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum LinkRef {
    NodeUp(usize),
    NodeDown(usize),
    AggUp(usize),
    AggDown(usize),
}

enum Event {
    ComputeDone {
        node: usize,
        compute_gen: u64,
    },
    Hop {
        hop: u8,
        deadline: Option<SimTime>,
        bytes: u64,
        cargo: Box<Cargo>,
    },
    NodeTimer {
        node: usize,
        gen: u64,
        at: u64,
    },
    AggTimer {
        agg: usize,
        at: u64,
    },
    /// A link's wake-up ([`MuxLink::next_wake`]).
    LinkWake {
        link: LinkRef,
        at: SimTime,
    },
    LinkUp {
        node: usize,
    },
    /// A node's first connection is up: it subscribes and starts training.
    Connected {
        node: usize,
        gen: u64,
    },
    /// A node's connection, dead since its idle timeout, is up again.
    Reconnected {
        node: usize,
        gen: u64,
    },
    Rejoin {
        node: usize,
        gen: u64,
    },
    Churn {
        index: usize,
        back: bool,
    },
    Eval,
}

/// Nominal capacity of a link: its constant rate, or its trace's mean rate.
fn nominal_bits_per_sec(spec: &LinkSpec, trace: Option<&Trace>) -> f64 {
    match (spec.bandwidth, trace) {
        (Some(b), _) => b.bits_per_sec() as f64,
        (None, Some(t)) => t.mean_bits_per_sec(),
        (None, None) => 1.0,
    }
}

/// Builds links, loading each trace file once.
struct LinkFactory<'a> {
    base_dir: PathBuf,
    traces: BTreeMap<(PathBuf, TraceFormat, bool), Arc<Trace>>,
    root: &'a SimRng,
    lossless: bool,
}

impl LinkFactory<'_> {
    fn trace_for(&mut self, spec: &LinkSpec, label: &str) -> Result<Option<Arc<Trace>>, String> {
        let Some(t) = &spec.trace else {
            return Ok(None);
        };
        let path = self.base_dir.join(&t.path);
        let key = (path.clone(), t.format, t.looped);
        if let Some(found) = self.traces.get(&key) {
            return Ok(Some(found.clone()));
        }
        let loaded = Arc::new(
            Trace::load(&path, t.format, t.looped).map_err(|e| format!("link {label}: {e}"))?,
        );
        self.traces.insert(key, loaded.clone());
        Ok(Some(loaded))
    }

    /// The link of one direction; `label` names it (and its random stream).
    fn build(&mut self, spec: &LinkSpec, label: &str) -> Result<(Link, f64), String> {
        let trace = self.trace_for(spec, label)?;
        let nominal = nominal_bits_per_sec(spec, trace.as_deref());
        let rng = self.root.fork(&format!("link:{label}"));
        let link = if self.lossless {
            let mut constant = LinkSpec::constant(
                Bandwidth::from_bits_per_sec((nominal.round() as u64).max(1)),
                spec.latency_ms,
            );
            constant.mtu = spec.mtu;
            constant.idle_timeout_s = spec.idle_timeout_s;
            Link::new(&constant, None, &rng)
        } else {
            Link::new(spec, trace, &rng)
        }
        .map_err(|e| format!("link {label}: {e}"))?;
        Ok((link, nominal))
    }
}

/// Frame bytes of a message of `len` elements with `codec` (values do not change the size of
/// the plain codecs, so zeros stand in for them).
fn delta_frame_bytes(layer: &SyncLayer, codec: protocol::Codec) -> Result<u64, String> {
    let meta = LayerMeta {
        node_id: 1,
        layer_id: layer.id,
        layer_name: layer.name.clone(),
        ..Default::default()
    };
    let zeros = vec![0.0f32; layer.len];
    let payload =
        payload_from_f32(meta, &[layer.len as u32], &zeros, codec).map_err(|e| e.to_string())?;
    frame_len(&Message::LayerDelta(payload))
}

fn frame_len(msg: &Message) -> Result<u64, String> {
    encode_frame(msg)
        .map(|f| f.len() as u64)
        .map_err(|e| format!("cannot frame a message: {e}"))
}

/// The simulation of one strategy.
pub struct World<'a> {
    scenario: &'a Scenario,
    spec: &'a EdgeSpec,
    task: &'a Task,
    mode: SyncMode,
    /// Codec of fresh deltas (`[edge] delta_codec`).
    delta_codec: DeltaCodec,
    /// `topk:F`: the sparsifier applied to a layer's values before its cut.
    top_k: Option<TopKSparsifier>,
    strategy: String,
    queue: EventQueue<Event>,
    nodes: Vec<SimNode>,
    aggs: Vec<SimAgg>,
    layers: Vec<SyncLayer>,
    ledger: Ledger,
    in_transit: BTreeMap<DeltaKey, u32>,
    /// Messages on a link, by link and the link's message id.
    in_flight: BTreeMap<(LinkRef, u64), links::InFlight>,
    /// The pending wake-up of each link.
    link_wakes: BTreeMap<LinkRef, SimTime>,
    /// Bytes of each link already counted in `bytes_by_class`.
    bytes_counted: BTreeMap<LinkRef, u64>,
    bytes_by_class: BTreeMap<String, u64>,
    bytes_total: u64,
    staleness: BTreeMap<u64, u64>,
    weak_sync_events: u64,
    timeline: Vec<SyncEvent>,
    open_syncs: BTreeMap<DeltaKey, f64>,
    eval_model: Model,
    series: Vec<SeriesPoint>,
    time_to_target: Option<f64>,
    scratch: Vec<Vec<f32>>,
    version_order: u64,
    pending_churn: usize,
    restored_entries: u64,
    optimizer: OptimizerConfig,
    schedule: LrSchedule,
    /// The averaging rule of every aggregator (kept for [`World::plan`]).
    agg_config: AggregatorConfig,
    max_steps: u64,
    end: SimTime,
    fatal: Option<String>,
    /// The coordinator's divergence monitor, fed at each evaluation (`world/divergence.rs`).
    divergence: DivergenceMonitor,
    divergence_warnings: u64,
    /// Largest spread seen at any evaluation.
    divergence_peak: Option<f64>,
}

impl<'a> World<'a> {
    /// Builds the world for `mode`, on the scenario's links or (`lossless`) on lossless
    /// constant links of the same nominal rate and latency.
    pub fn new(
        scenario: &'a Scenario,
        spec: &'a EdgeSpec,
        resolved: &ResolvedEdge,
        task: &'a Task,
        mode: SyncMode,
        lossless: bool,
        strategy: &str,
    ) -> Result<Self, String> {
        // Links and compute timing: the network seed; the model and the data: `seed`.
        let root = SimRng::new(scenario.network_seed.unwrap_or(scenario.seed)).fork("edge");
        let mut factory = LinkFactory {
            base_dir: scenario.base_dir.clone(),
            traces: BTreeMap::new(),
            root: &root,
            lossless,
        };
        let defaults = task.defaults();
        let optimizer = match scenario.optimizer.as_deref() {
            None => defaults.optimizer.clone(),
            Some("sgd") => OptimizerConfig::Sgd {
                momentum: 0.9,
                weight_decay: 0.0,
                nesterov: true,
            },
            Some("adamw") => OptimizerConfig::adamw(),
            Some(other) => {
                return Err(format!(
                    "optimizer: unknown optimizer '{other}' (expected sgd or adamw)"
                ))
            }
        };
        let base_lr = scenario.lr.unwrap_or(defaults.lr);
        let max_steps = scenario.max_steps.max(1);
        let schedule = LrSchedule {
            base_lr,
            warmup_steps: defaults.warmup.min(max_steps / 4),
            total_steps: max_steps,
            min_lr: base_lr * 0.1,
        };
        schedule.validate().map_err(|e| e.to_string())?;

        // Sync layers and their owners.
        let delta_codec = parse_delta_codec(&spec.delta_codec)
            .map_err(|why| format!("edge.delta_codec = {:?}: {why}", spec.delta_codec))?;
        let eval_model = task.build_model(scenario.seed);
        let n_aggs = spec.aggregators.count;
        let mut layers = Vec::new();
        for (k, info) in eval_model.layer_infos().into_iter().enumerate() {
            // The first parameter is the weight: its trailing dimensions are one row.
            let matrix_rows = eval_model.layers[info.index]
                .layer
                .params()
                .first()
                .and_then(|p| node::layout::lowrank_matrix_rows(&p.shape, info.params));
            layers.push(SyncLayer {
                id: k as u32,
                model_index: info.index,
                name: info.name,
                len: info.params,
                owner: k % n_aggs,
                delta_frame_bytes: 0,
                version_frame_bytes: 0,
                matrix_rows,
            });
        }
        for l in &mut layers {
            l.delta_frame_bytes = delta_frame_bytes(l, delta_codec.wire_codec())?;
            l.version_frame_bytes = delta_frame_bytes(l, spec.broadcast_codec.codec())?;
        }

        // Aggregators.
        let names = spec.node_names();
        let initially_present = names
            .iter()
            .filter(|n| {
                !spec
                    .churn
                    .iter()
                    .any(|c| &c.node == *n && c.action == ChurnAction::Join)
            })
            .count();
        let nodes_present = initially_present.max(1);
        let agg_config = AggregatorConfig {
            staleness: StalenessFn::Polynomial {
                a: match mode {
                    // FedBuff's s(τ) = 1/√(1+τ).
                    SyncMode::FedBuff => 0.5,
                    _ => spec.staleness.a,
                },
            },
            tau_max: match mode {
                // FedAvg drops an update that arrives after its round was aggregated.
                SyncMode::FedAvgDeadline => 0,
                _ => spec.staleness.tau_max,
            },
            // A blocking round averages every node: plain local SGD (η = 1).
            outer_lr: match mode {
                SyncMode::Elastic => spec.aggregators.outer_lr,
                SyncMode::Blocking | SyncMode::FedAvgDeadline => 1.0,
                SyncMode::FedBuff => spec.fedbuff.server_lr,
            },
            outer_lr_scaling: match mode {
                SyncMode::Elastic => spec.aggregators.outer_lr_scaling,
                _ => OuterLrScaling::Fixed,
            },
            round_size: match mode {
                SyncMode::Elastic => spec.aggregators.round_size,
                SyncMode::Blocking | SyncMode::FedAvgDeadline => nodes_present,
                SyncMode::FedBuff => spec.fedbuff.buffer_size,
            },
            round_timeout_ns: match mode {
                SyncMode::Elastic => (spec.aggregators.round_timeout_ms * 1e6) as u64,
                SyncMode::Blocking => (spec.aggregators.blocking_round_timeout_s * 1e9) as u64,
                SyncMode::FedAvgDeadline => (spec.fedavg.round_deadline_s * 1e9) as u64,
                SyncMode::FedBuff => (spec.fedbuff.flush_after_s * 1e9) as u64,
            },
            broadcast_codec: spec.broadcast_codec.codec(),
            send_version_on_resync: true,
            aggregation: match mode {
                SyncMode::FedBuff => Aggregation::Buffered,
                _ => Aggregation::WeightedMean,
            },
            min_round_senders: match mode {
                SyncMode::FedAvgDeadline => {
                    (spec.fedavg.min_completion_rate * nodes_present as f64).ceil() as usize
                }
                _ => 0,
            },
        };
        let mut aggs = Vec::with_capacity(n_aggs);
        let mut agg_nominal = Vec::with_capacity(n_aggs);
        for a in 0..n_aggs {
            let owned = layers
                .iter()
                .filter(|l| l.owner == a)
                .map(|l| OwnedLayer {
                    layer_id: l.id,
                    name: l.name.clone(),
                    shape: vec![l.len as u32],
                    values: eval_model.layer_values(l.model_index),
                })
                .collect();
            let state = AggregatorState::new(AGG_WIRE_BASE + a as u64, owned, agg_config.clone())
                .map_err(|e| format!("aggregator agg-{a}: {e}"))?;
            let link = &resolved.aggregator_link;
            let (up, up_bps) = factory.build(&link.up, &format!("agg-{a}.up"))?;
            let (down, down_bps) = factory.build(&link.down, &format!("agg-{a}.down"))?;
            let (up, down) = MuxLink::pair(
                MuxLink::new(up, links::aggregator_send_window()),
                MuxLink::new(down, links::aggregator_send_window()),
            );
            agg_nominal.push((up_bps, down_bps, link.up.latency_ms, link.down.latency_ms));
            aggs.push(SimAgg {
                state,
                up,
                down,
                timer_at: None,
            });
        }

        // Nodes.
        let mut nodes = Vec::with_capacity(names.len());
        let total_delta_bytes: u64 = layers.iter().map(|l| l.delta_frame_bytes).sum();
        let max_version_bytes = layers
            .iter()
            .map(|l| l.version_frame_bytes)
            .max()
            .unwrap_or(0);
        let costs = layer_costs(&eval_model, task);
        for (i, name) in names.iter().enumerate() {
            let is_cloud = i < spec.cloud.count;
            let (device, access, class, batch, straggler): (
                &Device,
                &AccessLink,
                LinkClass,
                usize,
                Straggler,
            ) = if is_cloud {
                (
                    &resolved.cloud_device,
                    resolved
                        .cloud_link
                        .as_ref()
                        .ok_or("edge.cloud.link: cloud nodes need a link")?,
                    LinkClass::Cloud,
                    scenario.batch * spec.cloud.workers,
                    Straggler {
                        slowdown: 1.0,
                        jitter: 0.0,
                    },
                )
            } else {
                (
                    &resolved.edge_device,
                    &resolved.edge_links[i - spec.cloud.count],
                    LinkClass::Edge,
                    scenario.batch,
                    Straggler {
                        slowdown: spec.devices.slowdown,
                        jitter: spec.devices.jitter,
                    },
                )
            };
            let times = device
                .step_times(&costs, batch)
                .map_err(|e| e.to_string())?;
            let (up, up_bps) = factory.build(&access.up, &format!("{name}.up"))?;
            let (down, down_bps) = factory.build(&access.down, &format!("{name}.down"))?;
            let window = links::node_window(&access.up, &access.down, up_bps, down_bps);
            let (handshake_up, handshake_down) = (up.handshake_path(), down.handshake_path());
            let (up, down) = MuxLink::pair(MuxLink::new(up, window), MuxLink::new(down, window));
            // Deadline: slack + nominal time to upload one delta of every layer over the
            // slowest hop, download the largest version, and one round trip.
            let (agg_up_bps, agg_down_bps, agg_up_lat, agg_down_lat) = agg_nominal[0];
            let up_path = up_bps.min(agg_down_bps);
            let down_path = down_bps.min(agg_up_bps);
            let rtt_ms = access.up.latency_ms
                + access.down.latency_ms
                + agg_up_lat
                + agg_down_lat
                + access.up.jitter_ms
                + access.down.jitter_ms;
            let nominal_s = total_delta_bytes as f64 * 8.0 / up_path
                + max_version_bytes as f64 * 8.0 / down_path
                + rtt_ms / 1e3;
            // Blocking rounds acknowledge a delta only when the round of every node is
            // applied, so a blocking attempt may wait for the whole round.
            let round_wait_s = match mode {
                SyncMode::Elastic | SyncMode::FedBuff => 0.0,
                SyncMode::Blocking => spec.aggregators.blocking_round_timeout_s,
                SyncMode::FedAvgDeadline => spec.fedavg.round_deadline_s,
            };
            let deadline_ns = ((spec.deadline_ms / 1e3 + nominal_s + round_wait_s) * 1e9) as u64;
            let mut outage_ends: Vec<SimTime> = if lossless {
                Vec::new()
            } else {
                access
                    .up
                    .outages
                    .iter()
                    .chain(&access.down.outages)
                    .filter_map(|o| SimTime::try_from_secs_f64(o.start_s + o.duration_s))
                    .collect()
            };
            outage_ends.sort_unstable();
            outage_ends.dedup();
            let joins_late = spec
                .churn
                .iter()
                .any(|c| &c.node == name && c.action == ChurnAction::Join);
            nodes.push(SimNode {
                name: name.clone(),
                wire: i as u64 + 1,
                class,
                up,
                down,
                handshake_up,
                handshake_down,
                outage_ends,
                step_s: times.forward_total() + times.backward_total(),
                straggler,
                compute_rng: root.fork(&format!("compute:{name}")),
                samples_per_step: batch,
                deadline_ns,
                replica: None,
                client: None,
                store: BTreeMap::new(),
                durable_next_seq: 1,
                steps: 0,
                status: if joins_late {
                    Status::Absent
                } else {
                    Status::Training
                },
                left: false,
                gen: 0,
                compute_gen: 0,
                timer_at: None,
                subscribed: false,
                pending_versions: BTreeMap::new(),
                version_busy: BTreeSet::new(),
                sent_version: vec![0; layers.len()],
                held_versions: BTreeMap::new(),
                drain: FinalCuts::default(),
                training_started_at: None,
                last_step_at: SimTime::ZERO,
            });
        }
        let end = SimTime::try_from_secs_f64(scenario.max_virtual_s)
            .ok_or("max_virtual_s: out of range")?;
        let scratch = layers.iter().map(|l| Vec::with_capacity(l.len)).collect();
        Ok(World {
            scenario,
            spec,
            task,
            mode,
            top_k: delta_codec.top_k_fraction().map(TopKSparsifier::new),
            delta_codec,
            strategy: strategy.to_string(),
            queue: EventQueue::new(),
            nodes,
            aggs,
            layers,
            ledger: Ledger::default(),
            in_transit: BTreeMap::new(),
            in_flight: BTreeMap::new(),
            link_wakes: BTreeMap::new(),
            bytes_counted: BTreeMap::new(),
            bytes_by_class: [("aggregator", 0u64), ("cloud", 0), ("edge", 0)]
                .into_iter()
                .map(|(k, v)| (k.to_string(), v))
                .collect(),
            bytes_total: 0,
            staleness: BTreeMap::new(),
            weak_sync_events: 0,
            timeline: Vec::new(),
            open_syncs: BTreeMap::new(),
            eval_model,
            series: Vec::new(),
            time_to_target: None,
            scratch,
            version_order: 0,
            pending_churn: 0,
            restored_entries: 0,
            optimizer,
            schedule,
            agg_config,
            max_steps,
            end,
            fatal: None,
            divergence: DivergenceMonitor::new(spec.divergence.clone()),
            divergence_warnings: 0,
            divergence_peak: None,
        })
    }

    fn now(&self) -> SimTime {
        self.queue.now()
    }

    /// What this world was built from, for a real run of the same strategy.
    pub fn plan(&self) -> EdgePlan {
        let joins = |name: &str| {
            self.spec
                .churn
                .iter()
                .find(|c| c.node == name && c.action == ChurnAction::Join)
                .map(|c| c.at_s)
        };
        EdgePlan {
            mode: self.mode,
            lossless: self.strategy == "elastic-lossless",
            nodes: self
                .nodes
                .iter()
                .map(|n| PlannedNode {
                    name: n.name.clone(),
                    class: n.class.label(),
                    up: n.up.link().spec().clone(),
                    down: n.down.link().spec().clone(),
                    step_s: n.step_s,
                    slowdown: n.straggler.slowdown,
                    jitter: n.straggler.jitter,
                    batch: n.samples_per_step,
                    deadline_ms: n.deadline_ns as f64 / 1e6,
                    joins_at_s: joins(&n.name),
                })
                .collect(),
            aggregators: self
                .aggs
                .iter()
                .enumerate()
                .map(|(i, a)| PlannedAggregator {
                    name: format!("agg-{i}"),
                    up: a.up.link().spec().clone(),
                    down: a.down.link().spec().clone(),
                })
                .collect(),
            aggregator: self.agg_config.clone(),
            optimizer: self.optimizer.clone(),
            schedule: self.schedule,
            churn: self.spec.churn.clone(),
        }
    }

    fn schedule(&mut self, at: SimTime, event: Event) {
        let at = at.max(self.now());
        if at <= self.end {
            // `at >= now` by construction, so this cannot fail.
            let _ = self.queue.schedule(at, event);
        }
    }

    fn layer_specs(&self, node: usize) -> Vec<LayerSpec> {
        let mut specs: Vec<LayerSpec> = self
            .layers
            .iter()
            .map(|l| LayerSpec {
                layer_id: l.id,
                name: l.name.clone(),
                shape: vec![l.len as u32],
                period_steps: self.scenario.period,
                phase: 0,
                deadline_ns: self.nodes[node].deadline_ns,
                owner: AGG_WIRE_BASE + l.owner as u64,
                // The early triggers belong to the elastic schedule; the peers' rounds are
                // whole-model at fixed steps.
                max_stale_steps: self
                    .spec
                    .max_stale_steps
                    .filter(|_| self.mode == SyncMode::Elastic),
                matrix_rows: l.matrix_rows,
            })
            .collect();
        if self.mode == SyncMode::Elastic {
            spread_phases(&mut specs);
        }
        // Blocking, FedAvg and FedBuff send the whole model at the same step.
        specs
    }

    fn new_client(
        &self,
        node: usize,
        values: Vec<Vec<f32>>,
        versions: &[u64],
    ) -> Result<SyncClient, String> {
        let inits = self
            .layer_specs(node)
            .into_iter()
            .zip(values)
            .zip(versions)
            .map(|((spec, values), &version)| LayerInit {
                spec,
                values,
                version,
            })
            .collect();
        let config = ClientConfig {
            max_attempts: self.spec.max_attempts,
            delta_codec: self.delta_codec.wire_codec(),
            flush_interval_ns: (self.spec.flush_interval_ms * 1e6) as u64,
            first_seq: self.nodes[node].durable_next_seq,
            deadline_policy: self.spec.deadline_mode.policy(),
            drift_cosine: self
                .spec
                .drift_cosine
                .filter(|_| self.mode == SyncMode::Elastic),
            lr_damping: self
                .spec
                .lr_damping
                .filter(|_| self.mode == SyncMode::Elastic),
        };
        SyncClient::new(self.nodes[node].wire, inits, config)
            .map_err(|e| format!("{}: sync client: {e}", self.nodes[node].name))
    }

    fn new_replica(&self, node: usize) -> Result<Replica, String> {
        Replica::new(
            self.task,
            self.scenario.seed,
            node,
            self.nodes.len(),
            self.nodes[node].samples_per_step,
            &self.optimizer,
            self.schedule,
        )
    }

    /// Global values and versions of every layer, from the aggregators.
    fn global_snapshot(&self) -> (Vec<Vec<f32>>, Vec<u64>) {
        self.layers
            .iter()
            .map(|l| {
                let view = self.aggs[l.owner]
                    .state
                    .layer(l.id)
                    .expect("every layer is owned by its aggregator");
                (view.values.to_vec(), view.version)
            })
            .unzip()
    }

    // ----- aggregators -------------------------------------------------------------------

    fn node_of_wire(&self, wire: u64) -> Option<usize> {
        let i = usize::try_from(wire.checked_sub(1)?).ok()?;
        (i < self.nodes.len()).then_some(i)
    }

    fn pump_agg(&mut self, a: usize) {
        while let Some(out) = self.aggs[a].state.poll_output() {
            match out {
                cpu_aggregator::Output::Send { to, msg } => {
                    let Some(node) = self.node_of_wire(to) else {
                        continue;
                    };
                    match &msg {
                        Message::DeltaAck(ack) if ack.applied => {
                            self.ledger.applied((node, ack.layer_id, ack.seq));
                        }
                        Message::LayerVersion(v) => {
                            let (layer, version) = (v.layer_id, v.version);
                            let bytes = self.layers[layer as usize].version_frame_bytes;
                            self.enqueue_version(node, layer, version, bytes, Rc::new(msg), true);
                            continue;
                        }
                        _ => {}
                    }
                    let bytes = match frame_len(&msg) {
                        Ok(b) => b,
                        Err(e) => {
                            self.fatal = Some(e);
                            return;
                        }
                    };
                    let gen = self.nodes[node].gen;
                    self.transmit(
                        0,
                        None,
                        bytes,
                        Box::new(Cargo::ToNode {
                            agg: a,
                            node,
                            gen,
                            msg,
                            version: None,
                        }),
                    );
                }
                cpu_aggregator::Output::Broadcast { msg } => {
                    let Message::LayerVersion(v) = &msg else {
                        continue;
                    };
                    let (layer, version) = (v.layer_id, v.version);
                    let bytes = match frame_len(&msg) {
                        Ok(b) => b,
                        Err(e) => {
                            self.fatal = Some(e);
                            return;
                        }
                    };
                    let shared = Rc::new(msg);
                    for node in 0..self.nodes.len() {
                        self.enqueue_version(node, layer, version, bytes, shared.clone(), false);
                    }
                }
                cpu_aggregator::Output::Event(e) => match e {
                    AggEvent::Applied { staleness, .. } => {
                        for tau in staleness {
                            *self.staleness.entry(tau).or_default() += 1;
                        }
                    }
                    AggEvent::DroppedStale {
                        from,
                        layer_id,
                        seq,
                        ..
                    } => {
                        if let Some(node) = self.node_of_wire(from) {
                            self.ledger.dropped((node, layer_id, seq));
                        }
                    }
                    _ => {}
                },
            }
        }
        let want = self.aggs[a].state.poll_timeout();
        if let Some(want) = want {
            let at = want.max(self.now().as_nanos());
            if self.aggs[a].timer_at.is_none_or(|t| at < t) {
                self.aggs[a].timer_at = Some(at);
                self.schedule(SimTime::from_nanos(at), Event::AggTimer { agg: a, at });
            }
        }
    }

    // ----- nodes -------------------------------------------------------------------------

    /// Drains the node's client outputs, drains a finished node's progress, reschedules its
    /// timer and resumes a blocked node whose round completed.
    fn after_node_activity(&mut self, node: usize) {
        loop {
            self.pump_node(node);
            if !(self.nodes[node].status == Status::Finished && self.try_drain(node)) {
                break;
            }
        }
        let n = &mut self.nodes[node];
        let Some(client) = n.client.as_ref() else {
            return;
        };
        // Done for good and nothing left to deliver: the node leaves the cluster, as a real
        // edge agent does after its drain, and is sent no more layer versions.
        if n.status == Status::Finished
            && !n.left
            && n.subscribed
            && n.drain.is_empty()
            && client.undelivered() == 0
        {
            n.subscribed = false;
            n.pending_versions.clear();
        }
        n.durable_next_seq = client.next_seq();
        if let Some(want) = client.poll_timeout() {
            let at = want.max(self.queue.now().as_nanos());
            if n.timer_at.is_none_or(|t| at < t) {
                n.timer_at = Some(at);
                let gen = n.gen;
                self.schedule(SimTime::from_nanos(at), Event::NodeTimer { node, gen, at });
            }
        }
        if self.nodes[node].status == Status::Waiting && self.round_complete(node) {
            self.nodes[node].status = Status::Training;
            self.start_step(node);
        }
    }

    fn round_complete(&self, node: usize) -> bool {
        self.nodes[node]
            .client
            .as_ref()
            .is_some_and(SyncClient::round_complete)
    }

    fn pump_node(&mut self, node: usize) {
        let now = self.now();
        loop {
            let Some(out) = self.nodes[node]
                .client
                .as_mut()
                .and_then(|c| c.poll_output())
            else {
                return;
            };
            match out {
                ClientOutput::Send { to, msg } => self.send_delta(node, to, msg),
                ClientOutput::CachePut { entry } => {
                    let (layer, seq) = (entry.layer_id, entry.seq);
                    self.ledger.cut((node, layer, seq));
                    let n = &mut self.nodes[node];
                    n.store.insert((layer, seq), entry);
                    if let Some(c) = n.client.as_mut() {
                        c.cache_put_done(now.as_nanos(), layer, seq);
                    }
                }
                ClientOutput::CacheReplace {
                    layer_id,
                    remove,
                    put,
                } => {
                    let seq = put.seq;
                    self.ledger.cut((node, layer_id, seq));
                    let n = &mut self.nodes[node];
                    for old in remove {
                        n.store.remove(&(layer_id, old));
                        self.ledger.merged((node, layer_id, old), seq);
                    }
                    n.store.insert((layer_id, seq), put);
                    if let Some(c) = n.client.as_mut() {
                        c.cache_put_done(now.as_nanos(), layer_id, seq);
                    }
                }
                ClientOutput::CacheRemove { layer_id, seqs } => {
                    for seq in seqs {
                        self.nodes[node].store.remove(&(layer_id, seq));
                    }
                }
                ClientOutput::ApplyVersion {
                    layer_id,
                    version,
                    values,
                } if self.mode == SyncMode::FedBuff
                    && self.nodes[node].status == Status::Training =>
                {
                    // FedBuff trains a local round on the model it started from; the newest
                    // version waits for the round's end.
                    self.nodes[node]
                        .held_versions
                        .insert(layer_id, (version, values));
                }
                ClientOutput::ApplyVersion {
                    layer_id,
                    version,
                    values,
                } => self.apply_version(node, layer_id, version, &values),
                ClientOutput::Event(e) => self.on_client_event(node, e),
            }
        }
    }

    fn send_delta(&mut self, node: usize, to: u64, msg: Message) {
        let Message::LayerDelta(payload) = &msg else {
            return;
        };
        let Some(agg) = to
            .checked_sub(AGG_WIRE_BASE)
            .and_then(|a| usize::try_from(a).ok())
            .filter(|&a| a < self.aggs.len())
        else {
            self.fatal = Some(format!(
                "{}: delta addressed to unknown node {to}",
                self.nodes[node].name
            ));
            return;
        };
        let key = (node, payload.layer_id, payload.seq);
        self.ledger.cut(key);
        let deadline = self.nodes[node]
            .client
            .as_ref()
            .and_then(|c| c.in_flight(payload.layer_id))
            .map(|f| SimTime::from_nanos(f.deadline));
        if self.timeline.len() < TIMELINE_CAP {
            let now_s = self.now().as_secs_f64();
            self.open_syncs.entry(key).or_insert(now_s);
        }
        let bytes = match frame_len(&msg) {
            Ok(b) => b,
            Err(e) => {
                self.fatal = Some(e);
                return;
            }
        };
        *self.in_transit.entry(key).or_default() += 1;
        self.transmit(
            0,
            deadline,
            bytes,
            Box::new(Cargo::Delta {
                from: node,
                agg,
                key,
                msg,
            }),
        );
    }

    fn close_sync(&mut self, key: DeltaKey, weak: bool) {
        if let Some(start_s) = self.open_syncs.remove(&key) {
            if self.timeline.len() < TIMELINE_CAP {
                self.timeline.push(SyncEvent {
                    start_s,
                    end_s: self.now().as_secs_f64(),
                    node: self.nodes[key.0].name.clone(),
                    layer: self.layers[key.1 as usize].name.clone(),
                    weak,
                });
            }
        }
    }

    fn on_client_event(&mut self, node: usize, e: ClientEvent) {
        match e {
            ClientEvent::WeakSynced { layer_id, seq, .. } => {
                self.weak_sync_events += 1;
                self.ledger.weak_synced((node, layer_id, seq));
                self.close_sync((node, layer_id, seq), true);
            }
            ClientEvent::Delivered { layer_id, seq, .. } => {
                self.close_sync((node, layer_id, seq), false);
            }
            ClientEvent::Dropped { layer_id, seq, .. } => {
                self.close_sync((node, layer_id, seq), false);
            }
            _ => {}
        }
    }

    fn apply_version(&mut self, node: usize, layer_id: u32, version: u64, values: &[f32]) {
        let Some(layer) = self.layers.get(layer_id as usize) else {
            return;
        };
        let index = layer.model_index;
        let mut buf = std::mem::take(&mut self.scratch[layer_id as usize]);
        let n = &mut self.nodes[node];
        if let (Some(replica), Some(client)) = (n.replica.as_mut(), n.client.as_mut()) {
            replica.values_into(index, &mut buf);
            match client.apply_version(layer_id, &mut buf, values, version) {
                Ok(true) => replica.set_layer_values(index, &buf),
                Ok(false) => {}
                Err(e) => self.fatal = Some(format!("{}: apply_version: {e}", n.name)),
            }
        }
        self.scratch[layer_id as usize] = buf;
    }

    /// Cuts the remaining progress of a finished node, layer by layer as each becomes free
    /// ([`FinalCuts`], as the edge agent's final flush). Returns whether it produced output.
    fn try_drain(&mut self, node: usize) -> bool {
        let now = self.now().as_nanos();
        let layers = &self.layers;
        let n = &mut self.nodes[node];
        let (Some(replica), Some(client)) = (n.replica.as_mut(), n.client.as_mut()) else {
            return false;
        };
        let cut = n.drain.cut_free_layers(client, now, n.steps, |id| {
            let mut values = Vec::new();
            replica.values_into(layers.get(id as usize)?.model_index, &mut values);
            Some(values)
        });
        match cut {
            Ok(cut) => !cut.is_empty(),
            Err(e) => {
                self.fatal = Some(format!("{}: final cut: {e}", n.name));
                false
            }
        }
    }

    fn start_step(&mut self, node: usize) {
        let now = self.now();
        let n = &mut self.nodes[node];
        if n.status != Status::Training {
            return;
        }
        if n.left || n.steps >= self.max_steps {
            return self.finish(node);
        }
        n.training_started_at.get_or_insert(now);
        let factor = n.straggler.factor(&mut n.compute_rng);
        let dt = SimDuration::try_from_secs_f64(n.step_s * factor).unwrap_or(SimDuration::MAX);
        let compute_gen = n.compute_gen;
        self.schedule(now + dt, Event::ComputeDone { node, compute_gen });
    }

    fn finish(&mut self, node: usize) {
        let n = &mut self.nodes[node];
        n.status = Status::Finished;
        n.drain = FinalCuts::all(self.layers.iter().map(|l| l.id));
        self.after_node_activity(node);
    }

    fn compute_done(&mut self, node: usize) {
        let now = self.now();
        let n = &mut self.nodes[node];
        let Some(replica) = n.replica.as_mut() else {
            return;
        };
        if let Err(e) = replica.forward_backward() {
            self.fatal = Some(format!("{}: step {}: {e}", n.name, n.steps + 1));
            return;
        }
        match (self.spec.lr_damping, n.client.as_ref()) {
            (Some(_), Some(client)) if self.mode == SyncMode::Elastic => {
                let layers = &self.layers;
                replica.step_all_scaled(&|index| {
                    layers
                        .iter()
                        .find(|l| l.model_index == index)
                        .map_or(1.0, |l| client.lr_scale(l.id))
                });
            }
            _ => replica.step_all(),
        }
        n.steps = replica.steps;
        n.last_step_at = now;
        let step = n.steps;
        let samples = n.samples_per_step as u64;
        let Some(client) = n.client.as_mut() else {
            return;
        };
        let due: Vec<u32> = client.due_layers(step).collect();
        for id in client.layers_to_read(step) {
            let index = self.layers[id as usize].model_index;
            replica.values_into(index, &mut self.scratch[id as usize]);
            // topk:F hands the client `anchor + topk(θ − anchor)`, as the edge agent does.
            if let (Some(top_k), Some(anchor)) = (&self.top_k, client.anchor(id)) {
                match top_k.sparsify(&self.scratch[id as usize], anchor) {
                    Ok(sparse) => self.scratch[id as usize] = sparse,
                    Err(e) => {
                        self.fatal = Some(format!("{}: top-k of layer {id}: {e}", n.name));
                        return;
                    }
                }
            }
        }
        let scratch = &self.scratch;
        if let Err(e) = client.on_step_end(now.as_nanos(), step, samples, |id| {
            scratch[id as usize].as_slice()
        }) {
            self.fatal = Some(format!("{}: step {step}: {e}", n.name));
            return;
        }
        if self.mode.waits_for_round() && !due.is_empty() && step < self.max_steps {
            self.nodes[node].status = Status::Waiting;
            self.after_node_activity(node);
        } else if self.mode == SyncMode::FedBuff && !due.is_empty() {
            // The cut is out: start the next local round from the newest global model.
            self.after_node_activity(node);
            let held = std::mem::take(&mut self.nodes[node].held_versions);
            for (layer_id, (version, values)) in held {
                self.apply_version(node, layer_id, version, &values);
            }
            self.after_node_activity(node);
            self.start_step(node);
        } else {
            self.after_node_activity(node);
            self.start_step(node);
        }
    }

    // ----- churn -------------------------------------------------------------------------

    fn crash(&mut self, node: usize) {
        let n = &mut self.nodes[node];
        if matches!(n.status, Status::Absent | Status::Down) {
            return;
        }
        if let Some(c) = n.client.as_ref() {
            for l in &self.layers {
                if let Some(f) = c.in_flight(l.id).filter(|f| !f.from_cache) {
                    self.ledger.lost_in_crash((node, l.id, f.seq));
                }
            }
            n.durable_next_seq = c.next_seq();
        }
        n.gen += 1;
        n.compute_gen += 1;
        n.status = Status::Down;
        n.client = None;
        n.replica = None;
        n.subscribed = false;
        n.pending_versions.clear();
        n.version_busy.clear();
        n.timer_at = None;
        n.drain = FinalCuts::default();
        n.left = false;
    }

    /// Starts the download of the current global model for a (re)joining node.
    fn join(&mut self, node: usize) {
        let (values, versions) = self.global_snapshot();
        let bytes: u64 = self.layers.iter().map(|l| l.version_frame_bytes).sum();
        let n = &mut self.nodes[node];
        n.status = Status::Bootstrapping;
        let gen = n.gen;
        self.transmit(
            0,
            None,
            bytes,
            Box::new(Cargo::Bootstrap {
                node,
                gen,
                values,
                versions,
            }),
        );
    }

    fn finish_bootstrap(
        &mut self,
        node: usize,
        values: Vec<Vec<f32>>,
        versions: &[u64],
    ) -> Result<(), String> {
        let now = self.now().as_nanos();
        let mut replica = self.new_replica(node)?;
        for (l, v) in self.layers.iter().zip(&values) {
            replica.set_layer_values(l.model_index, v);
        }
        replica.steps = self.nodes[node].steps;
        let mut client = self.new_client(node, values, versions)?;
        let cached: Vec<CacheEntry> = self.nodes[node].store.values().cloned().collect();
        for e in &cached {
            self.ledger.restored((node, e.layer_id, e.seq));
        }
        self.restored_entries += cached.len() as u64;
        client
            .restore_from_cache(now, cached)
            .map_err(|e| format!("{}: restore_from_cache: {e}", self.nodes[node].name))?;
        let n = &mut self.nodes[node];
        n.replica = Some(replica);
        n.client = Some(client);
        n.subscribed = true;
        n.version_busy.clear();
        n.timer_at = None;
        n.sent_version = versions.to_vec();
        n.status = Status::Training;
        // Versions applied while the bootstrap was on its way.
        for l in 0..self.layers.len() {
            let owner = self.layers[l].owner;
            let current = self.aggs[owner]
                .state
                .layer(l as u32)
                .map_or(0, |v| v.version);
            if current > versions[l] {
                if let Some(Ok(msg)) = self.aggs[owner].state.current_version_message(l as u32) {
                    let bytes = self.layers[l].version_frame_bytes;
                    self.enqueue_version(node, l as u32, current, bytes, Rc::new(msg), false);
                }
            }
        }
        self.after_node_activity(node);
        self.start_step(node);
        Ok(())
    }

    fn churn(&mut self, index: usize, back: bool) {
        self.pending_churn -= 1;
        let c = &self.spec.churn[index];
        let Some(node) = self.nodes.iter().position(|n| n.name == c.node) else {
            return;
        };
        match (c.action, back) {
            (ChurnAction::Join, _) => {
                if self.nodes[node].status == Status::Absent {
                    self.dial(node);
                    self.join(node);
                }
            }
            (ChurnAction::Crash, false) => self.crash(node),
            (ChurnAction::Crash, true) => {
                if self.nodes[node].status == Status::Down {
                    self.dial(node);
                    self.join(node);
                }
            }
            (ChurnAction::Leave, false) => {
                let n = &mut self.nodes[node];
                if matches!(n.status, Status::Training | Status::Waiting) {
                    n.left = true;
                    n.compute_gen += 1; // cancels the step in progress
                    self.finish(node);
                }
            }
            (ChurnAction::Leave, true) => {
                let n = &mut self.nodes[node];
                if n.left && n.status == Status::Finished {
                    n.left = false;
                    n.status = Status::Training;
                    self.start_step(node);
                }
            }
        }
    }

    // ----- evaluation and the loop -------------------------------------------------------

    fn evaluate(&mut self) {
        for l in &self.layers {
            if let Some(view) = self.aggs[l.owner].state.layer(l.id) {
                self.eval_model.set_layer_values(l.model_index, view.values);
            }
        }
        let ev = self
            .task
            .evaluate(&mut self.eval_model, Some(self.scenario.eval_limit));
        let now_s = self.now().as_secs_f64();
        let divergence = self.observe_divergence(now_s);
        if let Some(d) = divergence {
            self.divergence_peak = Some(self.divergence_peak.map_or(d, |p| p.max(d)));
        }
        let mean_steps = if self.nodes.is_empty() {
            0.0
        } else {
            self.nodes.iter().map(|n| n.steps as f64).sum::<f64>() / self.nodes.len() as f64
        };
        self.series.push(SeriesPoint {
            time_s: now_s,
            accuracy: ev.accuracy,
            loss: ev.loss,
            bytes_sent: self.bytes_total,
            access_bytes: Some(crate::report::access_link_bytes(&self.bytes_by_class)),
            mean_steps,
            divergence,
        });
        let reached = match ev.accuracy {
            Some(acc) => acc >= self.scenario.target,
            None => ev.loss <= self.scenario.target,
        };
        if reached && self.time_to_target.is_none() {
            self.time_to_target = Some(now_s);
        }
    }

    /// Whether nothing more can happen: every node finished (or is gone for good) and every
    /// live node's deltas are resolved.
    fn quiescent(&self) -> bool {
        self.pending_churn == 0
            && self.nodes.iter().all(|n| match n.status {
                Status::Absent | Status::Down => true,
                Status::Finished => {
                    n.drain.is_empty() && n.client.as_ref().is_none_or(|c| c.undelivered() == 0)
                }
                _ => false,
            })
    }

    fn start(&mut self) -> Result<(), String> {
        let (values, versions) = self.global_snapshot();
        for node in 0..self.nodes.len() {
            if self.nodes[node].status == Status::Absent {
                continue;
            }
            let replica = self.new_replica(node)?;
            let client = self.new_client(node, values.clone(), &versions)?;
            let n = &mut self.nodes[node];
            n.replica = Some(replica);
            n.client = Some(client);
            n.subscribed = true;
        }
        for node in 0..self.nodes.len() {
            // A real node trains once its aggregator connection is up.
            if self.nodes[node].status == Status::Training {
                let up_at = self.dial(node);
                let gen = self.nodes[node].gen;
                self.schedule(up_at, Event::Connected { node, gen });
            }
            for at in self.nodes[node].outage_ends.clone() {
                self.schedule(at, Event::LinkUp { node });
            }
        }
        for (index, c) in self.spec.churn.iter().enumerate() {
            let mut times = vec![(c.at_s, false)];
            times.extend(c.back_at_s.map(|b| (b, true)));
            for (t, back) in times {
                if let Some(at) = SimTime::try_from_secs_f64(t).filter(|&at| at <= self.end) {
                    self.pending_churn += 1;
                    self.schedule(at, Event::Churn { index, back });
                }
            }
        }
        if let Some(every) = SimDuration::try_from_secs_f64(self.scenario.eval_every_s) {
            self.schedule(SimTime::ZERO + every, Event::Eval);
        }
        Ok(())
    }

    /// Runs to the end and reports; `progress` gets the fraction of `max_virtual_s` done.
    pub fn run(
        mut self,
        progress: &mut dyn FnMut(f64),
    ) -> Result<(StrategyResult, EdgeDiagnostics), String> {
        self.start()?;
        self.evaluate();
        let eval_every = SimDuration::try_from_secs_f64(self.scenario.eval_every_s)
            .ok_or("eval_every_s: out of range")?;
        let max_s = self.scenario.max_virtual_s;
        while let Some((now, event)) = self.queue.pop_until(self.end) {
            match event {
                Event::ComputeDone { node, compute_gen } => {
                    let n = &self.nodes[node];
                    if n.compute_gen == compute_gen && n.status == Status::Training {
                        self.compute_done(node);
                    }
                }
                Event::Hop {
                    hop,
                    deadline,
                    bytes,
                    cargo,
                } => self.arrive(hop, deadline, bytes, cargo),
                Event::NodeTimer { node, gen, at } => {
                    let n = &mut self.nodes[node];
                    if n.gen == gen && n.timer_at == Some(at) {
                        n.timer_at = None;
                        if let Some(c) = n.client.as_mut() {
                            c.handle_timeout(now.as_nanos());
                            self.after_node_activity(node);
                        }
                    }
                }
                Event::AggTimer { agg, at } => {
                    if self.aggs[agg].timer_at == Some(at) {
                        self.aggs[agg].timer_at = None;
                        self.aggs[agg].state.handle_timeout(now.as_nanos());
                        self.pump_agg(agg);
                    }
                }
                Event::LinkWake { link, at } => self.link_wake(link, at),
                Event::LinkUp { node } => {
                    if let Some(c) = self.nodes[node].client.as_mut() {
                        c.on_link_up(now.as_nanos());
                        self.after_node_activity(node);
                    }
                }
                Event::Connected { node, gen } => {
                    if self.nodes[node].gen == gen {
                        // It subscribes as after a reconnect: every aggregator answers with
                        // each of its layers past version 0 (`answer_subscribe`).
                        self.reconnected(node, gen);
                        self.start_step(node);
                    }
                }
                Event::Reconnected { node, gen } => self.reconnected(node, gen),
                Event::Rejoin { node, gen } => {
                    if self.nodes[node].gen == gen
                        && self.nodes[node].status == Status::Bootstrapping
                    {
                        self.join(node);
                    }
                }
                Event::Churn { index, back } => self.churn(index, back),
                Event::Eval => {
                    self.count_all_link_bytes();
                    self.evaluate();
                    progress((now.as_secs_f64() / max_s).min(1.0));
                    self.schedule(now + eval_every, Event::Eval);
                }
            }
            if let Some(e) = self.fatal.take() {
                return Err(e);
            }
            if self.quiescent() {
                break;
            }
        }
        let end_s = self.now().as_secs_f64();
        self.count_all_link_bytes();
        if self.series.last().is_none_or(|p| p.time_s < end_s) {
            self.evaluate();
        }
        progress(1.0);
        Ok(self.report(end_s))
    }

    fn report(self, end_s: f64) -> (StrategyResult, EdgeDiagnostics) {
        let still_held = |key: &DeltaKey| {
            let &(node, layer, seq) = key;
            let n = &self.nodes[node];
            n.store.contains_key(&(layer, seq))
                || self.in_transit.contains_key(key)
                || n.client
                    .as_ref()
                    .and_then(|c| c.in_flight(layer))
                    .is_some_and(|f| f.seq == seq)
        };
        let check = self.ledger.check(|key| still_held(&key));
        let undelivered: Vec<DeltaKey> = self
            .ledger
            .entries()
            .filter(|(_, e)| e.fate == super::ledger::Fate::Outstanding)
            .map(|(key, _)| key)
            .filter(|key| !still_held(key))
            .take(UNDELIVERED_LISTED)
            .collect();
        let mut counters = (0u64, 0u64, 0u64);
        for a in &self.aggs {
            let c = a.state.counters();
            counters.0 += c.deltas_applied;
            counters.1 += c.duplicates_rejected;
            counters.2 += c.dropped_stale;
        }
        let finite = self.layers.iter().all(|l| {
            self.aggs[l.owner]
                .state
                .layer(l.id)
                .is_some_and(|v| v.values.iter().all(|x| x.is_finite()))
        });
        let per_node: Vec<f64> = self
            .nodes
            .iter()
            .filter(|n| n.steps > 0)
            .filter_map(|n| {
                n.training_started_at
                    .map(|s| (n.last_step_at - s).as_secs_f64() / n.steps as f64)
            })
            .collect();
        let mean_step_s = if per_node.is_empty() {
            0.0
        } else {
            per_node.iter().sum::<f64>() / per_node.len() as f64
        };
        let last = self.series.last();
        let result = StrategyResult {
            strategy: self.strategy.clone(),
            time_to_target_s: self.time_to_target,
            final_accuracy: last.and_then(|p| p.accuracy),
            final_loss: last.map_or(f64::NAN, |p| p.loss),
            virtual_seconds: end_s,
            bytes_sent: self.bytes_total,
            bytes_by_link_class: self.bytes_by_class.clone(),
            bytes_by_link: self.bytes_by_link(),
            weak_sync_events: self.weak_sync_events,
            undelivered_deltas: check.undelivered,
            cached_at_end: check.cached_or_in_flight,
            staleness_histogram: self.staleness.clone(),
            mean_step_s,
            wall_seconds: 0.0,
            series: self.series.clone(),
            timeline: self.timeline.clone(),
            plan_candidates: Vec::new(),
            divergence_warnings: self.divergence_warnings,
            divergence_peak: self.divergence_peak,
        };
        let diagnostics = EdgeDiagnostics {
            ledger: check,
            aggregator_applied: counters.0,
            duplicates_rejected: counters.1,
            aggregator_dropped_stale: counters.2,
            steps: self.nodes.iter().map(|n| n.steps).collect(),
            restored_entries: self.restored_entries,
            undelivered,
            finite,
        };
        (result, diagnostics)
    }
}
