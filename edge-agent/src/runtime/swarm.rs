//! `dreamddp swarm`: many lightweight edge clients in one process, to load the aggregators
//! and the coordinator far past what this machine can train. Each client is the real
//! [`SyncClient`] behind the real [`SyncDriver`], with its own QUIC endpoint and connections,
//! its own mTLS identity (`<certs_dir>/<name>.pem`) and its own durable sled cache
//! (`<data_dir>/clients/<name>/cache`). Only training is replaced: a client takes a paced
//! synthetic step every `step_ms` that nudges a sparse set of its weights, so every layer
//! still leaves as a real-size delta of the cluster's model when its period comes.
//!
//! The clients share one tokio runtime for their network sides and a few driver threads
//! that pump them in turn. The process writes `stats.json` in the schema of a trainer's
//! (summed over its clients: `undelivered`, `counters`, `steps`) plus per-client lines.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use engine::checkpoint::NamedTensor;
use engine::model::{LayerInfo, Model};
use engine::replica::{ModelReplica, ReplicaError, UnitData, UnitMut};
use engine::tensor::Tensor;
use node::layout::SyncLayerDef;
use protocol::Role;
use serde::{Deserialize, Serialize};
use tracing::{info, warn};
use transport::QuicNode;

use super::config::NodeRunConfig;
use super::driver::{DriverCounters, SyncDriver};
use super::net::{start_node_net, NodeNet};
use super::run::{
    bind_node_quic, build_driver, net_config, next_incarnation, open_node_cache, NodeRunError,
    NodeState,
};

/// The config of one swarm process (written by `dreamddp cluster` for a `[swarm]` section).
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct SwarmRunConfig {
    /// What every client shares: the model, the coordinator, the certificates, `[sync]` and
    /// `[transport]`. Its `node.name`/`node.id` name the process; `node.data_dir` is the
    /// process's directory (each client keeps its state under `clients/<name>`).
    pub template: NodeRunConfig,
    /// Pacing of the synthetic steps.
    pub swarm: SwarmSection,
    /// The clients this process runs.
    pub clients: Vec<SwarmClient>,
}

/// `[swarm]` of a swarm process.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct SwarmSection {
    /// Milliseconds between two synthetic steps of one client.
    pub step_ms: u64,
    /// Steps each client takes before it drains and leaves.
    pub steps: u64,
    /// Threads that pump the clients' sync drivers.
    #[serde(default = "default_driver_threads")]
    pub driver_threads: usize,
    /// Threads of the shared tokio runtime (the clients' network sides).
    #[serde(default = "default_network_threads")]
    pub network_threads: usize,
    /// Joins are spread over this many milliseconds (a thundering herd of handshakes is a
    /// test of its own).
    #[serde(default = "default_join_spread_ms")]
    pub join_spread_ms: u64,
    /// The process's CPU niceness (`nice`, 0–19): the swarm stands in for devices on other
    /// machines, so on a shared host it yields the CPU to the servers under test. 0: the
    /// servers' priority. The process sets it itself at start (`dreamddp swarm`).
    #[serde(default)]
    pub nice: i32,
}

fn default_driver_threads() -> usize {
    2
}
fn default_network_threads() -> usize {
    2
}
fn default_join_spread_ms() -> u64 {
    2_000
}

/// One client of a swarm process.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct SwarmClient {
    /// Node name (its certificate's CN).
    pub name: String,
    /// Node id on the wire.
    pub id: u64,
}

/// What one client did.
#[derive(Clone, Debug, Serialize)]
pub struct SwarmClientSummary {
    /// Node name.
    pub name: String,
    /// Steps taken.
    pub steps: u64,
    /// Deltas not acknowledged when it left (kept in its durable cache).
    pub undelivered: usize,
    /// Deltas acknowledged.
    pub delivered: u64,
    /// Why it failed, if it did (could not join, a cache write failed, ...).
    pub error: Option<String>,
}

/// What a swarm process did (`<data_dir>/stats.json`; the fields a trainer's stats have
/// are summed over the clients).
#[derive(Clone, Debug, Serialize)]
pub struct SwarmSummary {
    /// Process name.
    pub name: String,
    /// `swarm`.
    pub role: String,
    /// Clients run.
    pub clients: usize,
    /// Steps, all clients.
    pub steps: u64,
    /// Deltas undelivered, all clients.
    pub undelivered: usize,
    /// Counters summed over the clients (`ack_latency` merged).
    pub counters: DriverCounters,
    /// Clients that failed.
    pub failed: usize,
    /// Stopped from outside before the clients finished.
    pub stopped: bool,
    /// Wall seconds.
    pub wall_seconds: f64,
    /// Resident memory at exit and its peak.
    pub memory: node::memory::ProcessMemory,
    /// CPU seconds used.
    pub cpu_seconds: f64,
    /// Per client.
    pub per_client: Vec<SwarmClientSummary>,
}

/// The model of a swarm client: each unit's values and nothing else (no gradients, no
/// optimizer state), so a thousand clients fit in memory. It cannot train; the swarm's
/// synthetic steps write its values directly.
struct SyntheticReplica {
    /// By model layer index: the unit's values (`None` for a layer without parameters).
    units: Vec<Option<Vec<f32>>>,
    infos: Vec<LayerInfo>,
    names: Vec<String>,
}

impl SyntheticReplica {
    fn new(model: &Model) -> Self {
        let units = (0..model.layers.len())
            .map(|i| {
                let v = model.layer_values(i);
                (!v.is_empty()).then_some(v)
            })
            .collect();
        SyntheticReplica {
            units,
            infos: model.layer_infos(),
            names: model.layers.iter().map(|l| l.name.clone()).collect(),
        }
    }

    /// One synthetic step: nudges every 64th value of every unit (a different subset each
    /// step) by ±1e-4, so deltas are non-zero and stay small.
    fn step(&mut self, step: u64) {
        const STRIDE: usize = 64;
        let sign = if step.is_multiple_of(2) { 1e-4 } else { -1e-4 };
        for values in self.units.iter_mut().flatten() {
            let start = (step as usize).wrapping_mul(7919) % STRIDE.min(values.len());
            for v in values.iter_mut().skip(start).step_by(STRIDE) {
                *v += sign;
            }
        }
    }
}

struct SyntheticUnit<'a>(&'a mut Vec<f32>);

impl UnitMut for SyntheticUnit<'_> {
    fn append_to(&self, what: UnitData, out: &mut Vec<f32>) {
        if what == UnitData::Values {
            out.extend_from_slice(self.0);
        }
    }
    fn write_from(&mut self, what: UnitData, src: &[f32]) {
        if what == UnitData::Values {
            self.0.copy_from_slice(src);
        }
    }
    fn step(&mut self, _lr: f32) {}
}

fn synthetic_error() -> ReplicaError {
    ReplicaError::Backend {
        backend: "synthetic",
        message: "a swarm client's synthetic replica does not train".into(),
    }
}

impl ModelReplica for SyntheticReplica {
    fn backend(&self) -> &'static str {
        "synthetic"
    }
    fn unit_infos(&self) -> Vec<LayerInfo> {
        self.infos.clone()
    }
    fn layer_names(&self) -> Vec<String> {
        self.names.clone()
    }
    fn forward_backward(
        &mut self,
        _input: &Tensor,
        _targets: &[usize],
        _on_unit_ready: &mut dyn FnMut(usize, &mut dyn UnitMut),
    ) -> Result<f32, ReplicaError> {
        Err(synthetic_error())
    }
    fn logits(&mut self, _input: &Tensor) -> Result<Tensor, ReplicaError> {
        Err(synthetic_error())
    }
    fn with_unit(&mut self, index: usize, f: &mut dyn FnMut(&mut dyn UnitMut)) {
        if let Some(Some(values)) = self.units.get_mut(index) {
            f(&mut SyntheticUnit(values));
        }
    }
    fn flat_values(&self) -> Vec<f32> {
        self.units.iter().flatten().flatten().copied().collect()
    }
    fn set_flat_values(&mut self, flat: &[f32]) {
        let mut off = 0;
        for values in self.units.iter_mut().flatten() {
            let n = values.len();
            values.copy_from_slice(&flat[off..off + n]);
            off += n;
        }
    }
    fn state_tensors(&self) -> Vec<NamedTensor> {
        Vec::new()
    }
    fn load_state_tensors(&mut self, _tensors: &[NamedTensor]) -> Result<(), ReplicaError> {
        Err(synthetic_error())
    }
}

/// One client while it runs.
struct Member {
    name: String,
    driver: SyncDriver,
    replica: SyntheticReplica,
    step: u64,
    next_step_at: Instant,
    drain_until: Option<Instant>,
    done: bool,
    error: Option<String>,
}

impl Member {
    /// Pumps the driver and takes a step when one is due; marks the client done once its
    /// steps are taken and its backlog drained (or the drain timed out), or it failed, or
    /// the process is stopping.
    fn poll(&mut self, swarm: &SwarmSection, drain: Duration, stop: bool, now: Instant) {
        if self.done {
            return;
        }
        if let Err(e) = self.driver.pump(&mut self.replica) {
            self.fail(e);
            return;
        }
        if stop {
            self.done = true;
            return;
        }
        if self.step < swarm.steps {
            if now >= self.next_step_at {
                self.step += 1;
                self.replica.step(self.step);
                use node::training::LeaderHook;
                if let Err(e) = self.driver.after_step(self.step, 32, &mut self.replica) {
                    self.fail(e);
                    return;
                }
                self.next_step_at += Duration::from_millis(swarm.step_ms);
                // A client that fell far behind does not try to catch up in a burst.
                if self.next_step_at + Duration::from_millis(swarm.step_ms) < now {
                    self.next_step_at = now;
                }
            }
            return;
        }
        if self.drain_until.is_none() {
            // Every layer's progress since its last cut goes out too (`final_flush`).
            self.driver.start_final_flush();
        }
        let until = *self.drain_until.get_or_insert(now + drain);
        if let Err(e) = self.driver.flush_final(&mut self.replica) {
            self.fail(e);
            return;
        }
        if self.driver.drained() || now >= until {
            self.done = true;
        }
    }

    fn fail(&mut self, why: String) {
        warn!("[WARN] swarm client {} failed: {why}", self.name);
        self.error = Some(why);
        self.done = true;
    }
}

/// A client that could not start.
struct Failed {
    name: String,
    why: String,
}

/// Opens a client's cache and incarnation, binds its endpoint and joins the cluster.
fn start_member(
    config: &SwarmRunConfig,
    client: &SwarmClient,
    layout: &[SyncLayerDef],
    model: &Model,
    runtime: &tokio::runtime::Runtime,
    join_delay: Duration,
    first_step_at: Instant,
) -> Result<(Member, NodeNet, Arc<QuicNode>), NodeRunError> {
    let mut c = config.template.clone();
    c.node.name = client.name.clone();
    c.node.id = client.id;
    c.node.data_dir = client_dir(&config.template.node.data_dir, &client.name);
    std::fs::create_dir_all(&c.node.data_dir).map_err(|source| NodeRunError::Io {
        path: c.node.data_dir.clone(),
        source,
    })?;
    let (cache, cached) =
        open_node_cache(&c.node.data_dir.join("cache"), c.sync.cache_capacity_mb)?;
    let incarnation = next_incarnation(&c.node.data_dir)?;
    let quic = bind_node_quic(&c, Role::Edge, runtime)?;
    let (events_tx, events_rx) = std::sync::mpsc::channel();
    let (net_cfg, capabilities) = net_config(&c, Role::Edge);
    let net = runtime.block_on(async {
        tokio::time::sleep(join_delay).await;
        start_node_net(
            Arc::clone(&quic),
            net_cfg,
            capabilities,
            Duration::from_secs(c.sync.join_timeout_s),
            events_tx,
        )
        .await
    })?;
    let node_state = NodeState {
        role: Role::Edge,
        incarnation,
        cache,
        cached,
    };
    let driver = build_driver(&c, layout, model, node_state, &net, events_rx)?;
    let member = Member {
        name: client.name.clone(),
        driver,
        replica: SyntheticReplica::new(model),
        step: 0,
        next_step_at: first_step_at,
        drain_until: None,
        done: false,
        error: None,
    };
    Ok((member, net, quic))
}

/// Where a client of the swarm process with data directory `process_dir` keeps its state.
pub fn client_dir(process_dir: &std::path::Path, name: &str) -> PathBuf {
    process_dir.join("clients").join(name)
}

/// Runs every client of `config` to its end (or until `stop` is set) and writes
/// `<data_dir>/stats.json`.
pub fn run_swarm(
    config: &SwarmRunConfig,
    stop: Arc<AtomicBool>,
) -> Result<SwarmSummary, NodeRunError> {
    let started = Instant::now();
    let dir = &config.template.node.data_dir;
    std::fs::create_dir_all(dir).map_err(|source| NodeRunError::Io {
        path: dir.clone(),
        source,
    })?;
    if config.swarm.step_ms == 0 || config.swarm.driver_threads == 0 {
        return Err(NodeRunError::Config(
            "swarm.step_ms and swarm.driver_threads must be at least 1".into(),
        ));
    }
    let model = config
        .template
        .model
        .initial_model()
        .map_err(NodeRunError::Data)?;
    let layout = config.template.model.layout(&model);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(config.swarm.network_threads.max(1))
        .enable_all()
        .build()
        .map_err(|source| NodeRunError::Io {
            path: PathBuf::from("tokio runtime"),
            source,
        })?;
    let n = config.clients.len().max(1) as u64;
    info!(
        "[START] swarm={} clients={} step_ms={} steps={} model={} ({} layers, {:.2} MB)",
        config.template.node.name,
        config.clients.len(),
        config.swarm.step_ms,
        config.swarm.steps,
        config.template.model.model,
        layout.len(),
        layout.iter().map(|l| l.len * 4).sum::<usize>() as f64 / 1e6
    );

    // Start the clients, their joins spread over `join_spread_ms` (each join runs on the
    // shared runtime; this thread waits for one at a time, so the spread is a lower bound).
    let mut members = Vec::new();
    let mut nets = Vec::new();
    let mut quics = Vec::new();
    let mut failed = Vec::new();
    let spread = Duration::from_millis(config.swarm.join_spread_ms);
    let begin = Instant::now();
    for (i, client) in config.clients.iter().enumerate() {
        let at = begin + spread.mul_f64(i as f64 / n as f64);
        let delay = at.saturating_duration_since(Instant::now());
        // Steps are staggered across one step time so the clients do not cut in lockstep.
        let offset = Duration::from_millis(config.swarm.step_ms).mul_f64(i as f64 / n as f64);
        match start_member(
            config,
            client,
            &layout,
            &model,
            &runtime,
            delay,
            Instant::now() + delay + offset,
        ) {
            Ok((m, net, quic)) => {
                members.push(m);
                nets.push(net);
                quics.push(quic);
            }
            Err(e) => {
                warn!("[WARN] swarm client {} could not start: {e}", client.name);
                failed.push(Failed {
                    name: client.name.clone(),
                    why: e.to_string(),
                });
            }
        }
        if stop.load(Ordering::Relaxed) {
            break;
        }
    }
    info!(
        "[SWARM] {} of {} clients joined in {:.1} s",
        members.len(),
        config.clients.len(),
        begin.elapsed().as_secs_f64()
    );

    // Drive them: each thread pumps its share in turn.
    let threads = config.swarm.driver_threads.min(members.len().max(1));
    let mut groups: Vec<Vec<Member>> = (0..threads).map(|_| Vec::new()).collect();
    for (i, m) in members.into_iter().enumerate() {
        groups[i % threads].push(m);
    }
    let drain = Duration::from_secs(config.template.sync.drain_timeout_s);
    let swarm = config.swarm.clone();
    let handles: Vec<_> = groups
        .into_iter()
        .map(|mut group| {
            let stop = Arc::clone(&stop);
            let swarm = swarm.clone();
            std::thread::spawn(move || loop {
                let stopping = stop.load(Ordering::Relaxed);
                let now = Instant::now();
                for m in group.iter_mut() {
                    m.poll(&swarm, drain, stopping, now);
                }
                if group.iter().all(|m| m.done) {
                    return group;
                }
                std::thread::sleep(Duration::from_millis(2));
            })
        })
        .collect();
    let mut members: Vec<Member> = Vec::new();
    for h in handles {
        match h.join() {
            Ok(group) => members.extend(group),
            Err(_) => {
                return Err(NodeRunError::Training(
                    "a swarm driver thread panicked".into(),
                ))
            }
        }
    }

    // Leave: last stats, then every client says goodbye (concurrently, bounded).
    for m in members.iter_mut() {
        m.driver.report_now();
    }
    std::thread::sleep(Duration::from_millis(100));
    runtime.block_on(async {
        let mut leaving = tokio::task::JoinSet::new();
        for net in nets {
            leaving.spawn(net.leave("swarm finished"));
        }
        let all = async { while leaving.join_next().await.is_some() {} };
        let _ = tokio::time::timeout(Duration::from_secs(15), all).await;
    });
    for q in &quics {
        q.close();
    }

    let mut counters = DriverCounters::default();
    let mut per_client = Vec::new();
    for m in &members {
        counters.add(m.driver.counters());
        per_client.push(SwarmClientSummary {
            name: m.name.clone(),
            steps: m.step,
            undelivered: m.driver.undelivered(),
            delivered: m.driver.counters().deltas_delivered,
            error: m.error.clone(),
        });
    }
    per_client.extend(failed.into_iter().map(|f| SwarmClientSummary {
        name: f.name,
        steps: 0,
        undelivered: 0,
        delivered: 0,
        error: Some(f.why),
    }));
    let summary = SwarmSummary {
        name: config.template.node.name.clone(),
        role: "swarm".into(),
        clients: config.clients.len(),
        steps: per_client.iter().map(|c| c.steps).sum(),
        undelivered: per_client.iter().map(|c| c.undelivered).sum(),
        counters,
        failed: per_client.iter().filter(|c| c.error.is_some()).count(),
        stopped: stop.load(Ordering::Relaxed),
        wall_seconds: started.elapsed().as_secs_f64(),
        memory: node::memory::process_memory(),
        cpu_seconds: node::memory::process_cpu_seconds(),
        per_client,
    };
    let path = dir.join("stats.json");
    let json = serde_json::to_string_pretty(&summary).unwrap_or_default();
    std::fs::write(&path, json).map_err(|source| NodeRunError::Io { path, source })?;
    info!(
        "[DONE] swarm={} clients={} failed={} steps={} delivered={} undelivered={} ack p50={} p99={}",
        summary.name,
        summary.clients,
        summary.failed,
        summary.steps,
        summary.counters.deltas_delivered,
        summary.undelivered,
        fmt_ms(summary.counters.ack_latency.quantile_ms(0.5)),
        fmt_ms(summary.counters.ack_latency.quantile_ms(0.99)),
    );
    drop(runtime);
    Ok(summary)
}

fn fmt_ms(ms: Option<f64>) -> String {
    ms.map_or("-".into(), |ms| format!("{ms:.1}ms"))
}
