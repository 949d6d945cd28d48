//! A training node process from start to exit: load the data, open the durable weak-sync
//! cache (moving a damaged one aside), raise the seq incarnation, join the cluster over QUIC,
//! bootstrap from the global model, train with the [`SyncDriver`] as the leader hook, drain
//! the backlog, leave, and write `stats.json`. Used by `dreamddp edge` (1 worker) and
//! `dreamddp worker` (N workers with the intra-node collective).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use engine::lr::LrSchedule;
use engine::optim::OptimizerConfig;
use engine::replica::{read_unit, BuiltinReplica, ModelReplica, UnitData};
use node::backend::Backend;
use node::layout::{check_units_match, SyncLayerDef};
use node::task::Task;
use node::training::{run_node_training, LeaderHook, NodeTrainConfig};
use protocol::{Capabilities, Role};
use serde::Serialize;
use tracing::{info, warn};
use transport::{QuicNode, TlsIdentity};

use super::config::{parse_delta_codec, NodeRunConfig};
use super::driver::{DriverCounters, SyncDriver};
use super::net::{start_node_net, NetConfig};
use super::pacing::{next_step_start, StepPacer};
use super::topk::TopKSparsifier;
use crate::config::{spread_phases, ClientConfig, LayerInit, LayerSpec};
use crate::durable_cache::DurableCache;
use crate::state::SyncClient;

/// Why a node process stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum NodeRunError {
    /// The model or data could not be loaded.
    #[error("data: {0}")]
    Data(String),
    /// A config value that cannot be used (names the key).
    #[error("config: {0}")]
    Config(String),
    /// The weak-sync cache could not be opened.
    #[error("weak-sync cache: {0}")]
    Cache(#[from] crate::durable_cache::CacheError),
    /// The QUIC endpoint could not start (certificates, address).
    #[error("transport: {0}")]
    Transport(#[from] transport::TransportError),
    /// Joining the cluster failed.
    #[error("join: {0}")]
    Join(#[from] super::net::JoinError),
    /// Training stopped with an error.
    #[error("training: {0}")]
    Training(String),
    /// Local file I/O (state files).
    #[error("{path}: {source}")]
    Io {
        /// File.
        path: PathBuf,
        /// Cause.
        source: std::io::Error,
    },
}

/// What a node did (also written to `<data_dir>/stats.json`).
#[derive(Clone, Debug, Serialize)]
pub struct NodeRunSummary {
    /// Node name.
    pub name: String,
    /// Node id.
    pub node_id: u64,
    /// Role.
    pub role: String,
    /// Seq incarnation of this run (1 for a first start).
    pub incarnation: u64,
    /// The step training reached (a restart after a crash or a stop resumes at the step its
    /// earlier run recorded in `<data_dir>/progress`, so this counts those steps too).
    pub steps: u64,
    /// Final local test accuracy (classification tasks).
    pub final_accuracy: Option<f64>,
    /// Final local eval loss.
    pub final_loss: f64,
    /// Deltas still undelivered when the process left (0 after a complete drain).
    pub undelivered: usize,
    /// Runtime counters.
    pub counters: DriverCounters,
    /// Wall seconds.
    pub wall_seconds: f64,
    /// Resident memory at exit and its peak over the run.
    pub memory: node::memory::ProcessMemory,
    /// Bytes the training and test sets take in memory (at their stored precision).
    pub data_bytes: u64,
    /// Compute pacing (`[training.pace]`), when on.
    pub pace: Option<PaceStats>,
    /// Stopped from outside (SIGTERM) before its last step or before its backlog drained;
    /// `undelivered` is then what its durable cache keeps for the next start.
    pub stopped: bool,
}

/// How compute pacing went.
#[derive(Clone, Debug, Serialize)]
pub struct PaceStats {
    /// Steps paced.
    pub steps: u64,
    /// Steps whose real compute took longer than their paced time.
    pub overruns: u64,
}

/// Reads, increments and durably stores the seq incarnation in `dir/incarnation`. Seqs of
/// run `k` start at `k << 32`, so they keep increasing across restarts (the aggregator
/// rejects a seq at or below the highest it applied as a duplicate).
pub fn next_incarnation(dir: &Path) -> Result<u64, NodeRunError> {
    let path = dir.join("incarnation");
    let io = |source| NodeRunError::Io {
        path: path.clone(),
        source,
    };
    let previous = match std::fs::read_to_string(&path) {
        Ok(text) => text.trim().parse::<u64>().unwrap_or_else(|_| {
            warn!(
                "[WARN] {} is unreadable; starting a new seq range above any old one",
                path.display()
            );
            u64::from(u32::MAX >> 1)
        }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => 0,
        Err(e) => return Err(io(e)),
    };
    let next = previous + 1;
    node::cluster_model::write_file_atomic(&path, next.to_string().as_bytes()).map_err(io)?;
    Ok(next)
}

/// The leader hook of a node process: the sync driver, compute pacing, the wait of a
/// synchronous round, and periodic local evaluation.
struct NodeLeader<'a> {
    driver: SyncDriver,
    task: &'a Task,
    eval_every: u64,
    eval_limit: usize,
    pacer: Option<StepPacer>,
    /// When the previous step (and whatever waiting followed it) ended.
    last_step_end: Instant,
    /// Set from outside (SIGTERM): stop after the current step, skip the drain.
    stop: Arc<AtomicBool>,
    /// `<data_dir>/progress`: the steps trained so far, so a restart resumes there.
    progress_path: PathBuf,
    last_progress_write: Instant,
    /// `[sync] wait_for_round`: the period whose cuts end a round, and the last step.
    round: Option<(u64, u64)>,
}

/// How often the steps trained so far are written to `<data_dir>/progress`.
const PROGRESS_EVERY: Duration = Duration::from_secs(1);

/// Steps an earlier run trained (`<data_dir>/progress`; 0 when absent or unreadable).
pub fn read_progress(path: &Path) -> u64 {
    std::fs::read_to_string(path)
        .ok()
        .and_then(|t| t.trim().parse().ok())
        .unwrap_or(0)
}

fn write_progress(path: &Path, step: u64) {
    if let Err(e) = node::cluster_model::write_file_atomic(path, step.to_string().as_bytes()) {
        warn!("[WARN] cannot record progress in {}: {e}", path.display());
    }
}

/// How long the leader sleeps between pumps while it pads a step or waits for a round.
const WAIT_SLICE: Duration = Duration::from_millis(2);

impl NodeLeader<'_> {
    /// Pumps the driver until `done` holds (or `until` passes), collecting the layers it
    /// rewrote into `changed`.
    fn pump_while(
        &mut self,
        model: &mut dyn ModelReplica,
        changed: &mut Vec<usize>,
        until: Option<Instant>,
        done: &dyn Fn(&SyncDriver) -> bool,
    ) -> Result<(), String> {
        loop {
            for index in self.driver.pump(model)? {
                if !changed.contains(&index) {
                    changed.push(index);
                }
            }
            let now = Instant::now();
            if done(&self.driver) || until.is_some_and(|u| now >= u) || self.should_stop() {
                return Ok(());
            }
            let slice = until.map_or(WAIT_SLICE, |u| (u - now).min(WAIT_SLICE));
            std::thread::sleep(slice);
        }
    }
}

impl LeaderHook for NodeLeader<'_> {
    fn after_step(
        &mut self,
        step: u64,
        samples: u64,
        model: &mut dyn ModelReplica,
    ) -> Result<Vec<usize>, String> {
        let mut changed = Vec::new();
        // Pad the step to the paced device's step time (messages are handled meanwhile), then
        // cut: the deltas leave when the modelled device would have finished the step.
        let mut paced_end = None;
        if let Some(pacer) = self.pacer.as_mut() {
            let target = pacer.next_target();
            let actual = self.last_step_end.elapsed();
            if pacer.record(actual, target) {
                warn!(
                    "[WARN] pace: step {step} took {:.1} ms of real compute and sync work, more than the paced {:.1} ms; \
                     this machine is slower than the device class it stands in for (the run is flagged)",
                    actual.as_secs_f64() * 1e3,
                    target.as_secs_f64() * 1e3
                );
            }
            let until = self.last_step_end + target;
            self.pump_while(model, &mut changed, Some(until), &|_| false)?;
            paced_end = Some((until, target));
        }
        for index in self.driver.after_step(step, samples, model)? {
            if !changed.contains(&index) {
                changed.push(index);
            }
        }
        if let Some((period, last)) = self.round {
            if step.is_multiple_of(period) && step < last {
                self.pump_while(model, &mut changed, None, &SyncDriver::round_complete)?;
                paced_end = None;
            }
        }
        let now = Instant::now();
        // The cut's work counts toward the next paced step (`pacing::next_step_start`); after
        // a round's wait the next step starts now.
        self.last_step_end = match paced_end {
            Some((until, target)) => next_step_start(until, target, now),
            None => now,
        };
        if self.last_progress_write.elapsed() >= PROGRESS_EVERY {
            self.last_progress_write = now;
            write_progress(&self.progress_path, step);
        }
        if self.eval_every > 0 && step.is_multiple_of(self.eval_every) {
            let e = self.task.evaluate_replica(model, Some(self.eval_limit))?;
            self.driver.set_accuracy(e.accuracy.map(|a| a as f32));
            info!(
                "[EVAL] step={step} accuracy={} loss={:.4}",
                e.accuracy
                    .map_or("-".into(), |a| format!("{:.2}%", a * 100.0)),
                e.loss
            );
        }
        Ok(changed)
    }

    fn should_stop(&self) -> bool {
        self.driver.should_stop() || self.stop.load(Ordering::Relaxed)
    }

    fn lr_scales(&self) -> Vec<(usize, f32)> {
        self.driver.lr_scales()
    }
}

/// Waits until `at_unix_ms` (`[node] start_at_unix_ms`) or a stop. A first incarnation that
/// got there more than 100 ms late says so: its launcher's margin was too short for this
/// machine, and the node starts behind the others.
fn wait_for_common_start(at_unix_ms: u64, incarnation: u64, stop: &AtomicBool) {
    let now_ms = || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
    };
    let now = now_ms();
    if now > at_unix_ms + 100 && incarnation == 1 {
        warn!(
            "[WARN] ready {} ms after the cluster's common start ([node] start_at_unix_ms): \
             this node starts behind the others",
            now - at_unix_ms
        );
    }
    while !stop.load(Ordering::Relaxed) {
        let left = at_unix_ms.saturating_sub(now_ms());
        if left == 0 {
            break;
        }
        std::thread::sleep(Duration::from_millis(left.min(50)));
    }
}

/// Opens a node's durable weak-sync cache in `dir` with a page cache of `capacity_mb` MiB
/// (moving a damaged one aside and saying so) and returns it with the entries it holds.
pub(crate) fn open_node_cache(
    dir: &Path,
    capacity_mb: u64,
) -> Result<(DurableCache, Vec<crate::cache::CacheEntry>), NodeRunError> {
    let (cache, report) = DurableCache::open_with_capacity(dir, capacity_mb.max(1) << 20)?;
    if let Some(m) = &report.moved_aside {
        warn!(
            "[WARN] weak-sync cache was damaged ({}); moved aside to {} and rebuilt with {} valid entries",
            m.reason,
            m.path.display(),
            report.recovered
        );
    }
    let entries = cache.entries()?;
    Ok((cache, entries))
}

/// What a node's network side needs of its config: the join parameters and the
/// capabilities it announces.
pub(crate) fn net_config(config: &NodeRunConfig, role: Role) -> (NetConfig, Capabilities) {
    let net_config = NetConfig {
        node_id: config.node.id,
        role,
        coordinator: config.node.coordinator,
        coordinator_name: config.node.coordinator_name.clone(),
        credentials: config.node.credentials.clone(),
        address_overrides: config.node.address_overrides.clone(),
        heartbeat_every: Duration::from_millis(500),
        send_timeout: Duration::from_secs(10),
    };
    let capabilities = Capabilities {
        gpus: 0,
        cpu_cores: std::thread::available_parallelism().map_or(1, |n| n.get() as u32),
        memory_bytes: 0,
        link_bytes_per_sec: 0,
        codecs: vec![protocol::Codec::RawF32, protocol::Codec::ZstdRawF32],
    };
    (net_config, capabilities)
}

/// A node's sync client: one layer spec per layer of `layout` (period, deadline, staleness
/// bound from `[sync]`, owner from the join answer, phases spread unless rounds are
/// synchronous), starting from `model`'s values, with seqs of this `incarnation`. Also
/// returns the delta codec `[sync] codec` names.
pub(crate) fn build_sync_client(
    config: &NodeRunConfig,
    layout: &[SyncLayerDef],
    model: &engine::model::Model,
    owners: &std::collections::HashMap<u32, u64>,
    incarnation: u64,
) -> Result<(SyncClient, super::config::DeltaCodec), NodeRunError> {
    let delta_codec = parse_delta_codec(&config.sync.codec).map_err(|why| {
        NodeRunError::Config(format!("sync.codec = {}: {why}", config.sync.codec))
    })?;
    let mut specs: Vec<LayerSpec> = layout
        .iter()
        .map(|l| LayerSpec {
            layer_id: l.layer_id,
            name: l.name.clone(),
            shape: vec![l.len as u32],
            period_steps: config.sync.period_steps,
            phase: 0,
            deadline_ns: config
                .sync
                .deadline_ms_by_layer
                .get(&l.name)
                .or_else(|| config.sync.deadline_ms_by_layer.get(&l.layer_name))
                .copied()
                .unwrap_or(config.sync.deadline_ms)
                * 1_000_000,
            owner: owners.get(&l.layer_id).copied().unwrap_or(0),
            max_stale_steps: config
                .sync
                .max_stale_steps_by_layer
                .get(&l.name)
                .or_else(|| config.sync.max_stale_steps_by_layer.get(&l.layer_name))
                .copied()
                .or(config.sync.max_stale_steps),
            matrix_rows: l.matrix_rows,
        })
        .collect();
    // Synchronous rounds and FedBuff's rounds send the whole model at the same step.
    if !config.sync.wait_for_round && !config.sync.restart_from_global {
        spread_phases(&mut specs);
    }
    let inits = specs
        .into_iter()
        .zip(layout)
        .map(|(spec, l)| LayerInit {
            spec,
            values: node::layout::unit_values(model, l),
            version: 0,
        })
        .collect();
    let client_config = ClientConfig {
        max_attempts: config.sync.max_attempts,
        delta_codec: delta_codec.wire_codec(),
        flush_interval_ns: config.sync.flush_interval_ms * 1_000_000,
        first_seq: incarnation << 32,
        deadline_policy: config
            .sync
            .deadline_policy()
            .map_err(|e| NodeRunError::Config(e.to_string()))?,
        drift_cosine: config.sync.drift_cosine,
        lr_damping: config.sync.lr_damping,
    };
    let client = SyncClient::new(config.node.id, inits, client_config)
        .map_err(|e| NodeRunError::Training(e.to_string()))?;
    Ok((client, delta_codec))
}

/// What a node brings to its sync driver besides its config: its role, its seq incarnation,
/// and its opened durable cache with the entries it held.
pub(crate) struct NodeState {
    pub(crate) role: Role,
    pub(crate) incarnation: u64,
    pub(crate) cache: DurableCache,
    pub(crate) cached: Vec<crate::cache::CacheEntry>,
}

/// The sync driver of a node that joined with `net`: its sync client
/// ([`build_sync_client`]) restored from the cached entries, sending through the network
/// side's outbox and hearing from it on `events`.
pub(crate) fn build_driver(
    config: &NodeRunConfig,
    layout: &[SyncLayerDef],
    model: &engine::model::Model,
    node: NodeState,
    net: &super::net::NodeNet,
    events: std::sync::mpsc::Receiver<super::driver::NetEvent>,
) -> Result<SyncDriver, NodeRunError> {
    let owners: std::collections::HashMap<u32, u64> =
        net.join_ack.layer_owners.iter().copied().collect();
    let (mut client, codec) = build_sync_client(config, layout, model, &owners, node.incarnation)?;
    let restored = client
        .restore_from_cache(0, node.cached)
        .map_err(|e| NodeRunError::Training(format!("restoring the weak-sync cache: {e}")))?;
    let driver = SyncDriver::new(
        client,
        node.cache,
        layout.to_vec(),
        Box::new(net.outbox.clone()),
        events,
        node.role,
        Duration::from_millis(config.sync.stats_every_ms),
        net.join_ack.map_epoch,
    );
    let mut driver = driver.with_top_k(codec.top_k_fraction().map(TopKSparsifier::new));
    driver.note_restored(restored);
    Ok(driver)
}

/// Binds a node's QUIC endpoint with its certificate and `[transport]` settings, on
/// `runtime`. An edge agent's unset windows are a constrained device's
/// ([`transport::TransportConfig::edge_device`]), a worker node's the server defaults.
pub(crate) fn bind_node_quic(
    config: &NodeRunConfig,
    role: Role,
    runtime: &tokio::runtime::Runtime,
) -> Result<Arc<QuicNode>, NodeRunError> {
    let identity = TlsIdentity::in_dir(&config.node.certs_dir, &config.node.name);
    let base = match role {
        Role::Edge => transport::TransportConfig::edge_device(),
        _ => transport::TransportConfig::default(),
    };
    let transport = config
        .transport
        .to_config_over(base)
        .map_err(|e| NodeRunError::Config(e.to_string()))?;
    let _guard = runtime.enter();
    Ok(Arc::new(QuicNode::bind(
        config.node.bind,
        &identity,
        &transport,
    )?))
}

/// Runs a training node until it has trained `training.steps` steps and drained its backlog.
pub fn run_node(config: &NodeRunConfig, role: Role) -> Result<NodeRunSummary, NodeRunError> {
    run_node_until(config, role, Arc::new(AtomicBool::new(false)))
}

/// [`run_node`] that also stops when `stop` is set (the process's SIGTERM handler sets it):
/// after the current step, without draining the backlog (it stays in the durable cache for
/// the next start), leaving the cluster and writing `stats.json` as usual.
pub fn run_node_until(
    config: &NodeRunConfig,
    role: Role,
    stop: Arc<AtomicBool>,
) -> Result<NodeRunSummary, NodeRunError> {
    let started = Instant::now();
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| NodeRunError::Io { path, source }
    };
    std::fs::create_dir_all(&config.node.data_dir).map_err(io(&config.node.data_dir))?;
    let backend = Backend::parse(&config.training.backend, &config.training.device)
        .and_then(|b| b.probe().map(|()| b))
        .map_err(|e| NodeRunError::Training(format!("[training] backend/device: {e}")))?;
    let ranks = config.training.first_rank..config.training.first_rank + config.training.workers;
    let task = config
        .model
        .load_task_for(config.training.data_partition, ranks, config.training.world)
        .map_err(NodeRunError::Data)?;
    let model = task.build_model(config.model.seed);
    let layout: Vec<SyncLayerDef> = config.model.layout(&model);
    // A backend that would exchange other tensors than the cluster's layout never starts.
    let probe = backend
        .build_replica(&task, config.model.seed, &OptimizerConfig::sgd())
        .map_err(|e| NodeRunError::Training(format!("[training] backend: {e}")))?;
    check_units_match(&layout, &probe.unit_infos()).map_err(|e| {
        NodeRunError::Training(format!(
            "the {backend} model does not match the cluster's layer layout: {e}"
        ))
    })?;
    drop(probe);

    let (cache, cached) = open_node_cache(
        &config.node.data_dir.join("cache"),
        config.sync.cache_capacity_mb,
    )?;
    let incarnation = next_incarnation(&config.node.data_dir)?;
    info!(
        "[START] node={} id={} backend={} device={} incarnation={incarnation} cached_deltas={}",
        config.node.name,
        config.node.id,
        backend.name(),
        backend.device(),
        cached.len()
    );

    if let Some(at) = config.node.start_at_unix_ms {
        wait_for_common_start(at, incarnation, &stop);
    }

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .map_err(io(Path::new("tokio runtime")))?;
    let quic = bind_node_quic(config, role, &runtime)?;
    let (events_tx, events_rx) = std::sync::mpsc::channel();
    let (net_config, capabilities) = net_config(config, role);
    let net = runtime.block_on(start_node_net(
        Arc::clone(&quic),
        net_config,
        capabilities,
        Duration::from_secs(config.sync.join_timeout_s),
        events_tx,
    ))?;
    let owners: std::collections::HashMap<u32, u64> =
        net.join_ack.layer_owners.iter().copied().collect();

    let node_state = NodeState {
        role,
        incarnation,
        cache,
        cached,
    };
    let mut driver = build_driver(config, &layout, &model, node_state, &net, events_rx)?;

    // Bootstrap: the aggregators answer our Subscribe with the current global versions.
    let mut boot_model = BuiltinReplica::new(model, &OptimizerConfig::sgd());
    let wanted: std::collections::HashMap<u32, u64> =
        net.join_ack.layer_versions.iter().copied().collect();
    let boot_deadline = Instant::now() + Duration::from_secs(10);
    let mut initial: Vec<(usize, Vec<f32>)> = Vec::new();
    loop {
        for index in driver
            .pump(&mut boot_model)
            .map_err(NodeRunError::Training)?
        {
            initial.retain(|(i, _)| *i != index);
            initial.push((index, read_unit(&mut boot_model, index, UnitData::Values)));
        }
        let stats = driver.stats();
        let have: std::collections::HashMap<u32, u64> = stats.layer_versions.into_iter().collect();
        let complete = layout.iter().all(|l| {
            have.get(&l.layer_id).copied().unwrap_or(0)
                >= wanted.get(&l.layer_id).copied().unwrap_or(0)
        });
        let all_linked = owners.values().all(|&a| net.aggregator_connected(a));
        if (complete && all_linked) || Instant::now() > boot_deadline {
            if !complete {
                warn!("[WARN] bootstrap incomplete after 10 s; training from what arrived");
            }
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    // Layers whose global version is newer than the seeded init start from it.
    for l in &layout {
        if !initial.iter().any(|(i, _)| *i == l.model_index) {
            initial.push((
                l.model_index,
                read_unit(&mut boot_model, l.model_index, UnitData::Values),
            ));
        }
    }

    // FedBuff's client rule starts with the first local round (the bootstrap applied what
    // it downloaded).
    driver.set_restart_from_global(config.sync.restart_from_global);

    // A restarted node resumes at the step its last run recorded.
    let progress_path = config.node.data_dir.join("progress");
    let first_step = read_progress(&progress_path).min(config.training.steps);
    if first_step > 0 {
        info!(
            "[RESUME] {first_step} of {} steps trained by an earlier run",
            config.training.steps
        );
    }
    let train_config = NodeTrainConfig {
        workers: config.training.workers,
        steps: config.training.steps,
        first_step,
        batch_size: config.training.batch_size,
        seed: config.model.seed,
        first_rank: config.training.first_rank,
        world: config.training.world,
        optimizer: config
            .training
            .optimizer
            .clone()
            .unwrap_or_else(OptimizerConfig::sgd),
        schedule: config
            .training
            .lr_schedule
            .unwrap_or_else(|| LrSchedule::constant(config.training.lr)),
        backend: backend.clone(),
    };
    let mut leader = NodeLeader {
        driver,
        task: &task,
        eval_every: config.training.eval_every,
        eval_limit: config.training.eval_limit,
        pacer: config.training.pace.as_ref().map(StepPacer::new),
        last_step_end: Instant::now(),
        stop: Arc::clone(&stop),
        progress_path: progress_path.clone(),
        last_progress_write: Instant::now(),
        round: config
            .sync
            .wait_for_round
            .then_some((config.sync.period_steps, config.training.steps)),
    };
    let (train_report, mut final_model) =
        run_node_training(&task, &train_config, &initial, &mut leader)
            .map_err(|e| NodeRunError::Training(e.to_string()))?;
    let pace = leader.pacer.as_ref().map(|p| PaceStats {
        steps: p.steps,
        overruns: p.overruns,
    });
    let mut driver = leader.driver;
    // Draining: nothing is trained any more, so versions are written in as they arrive.
    driver.set_restart_from_global(false);

    // Drain (unless asked to stop): keep exchanging until every delta is acknowledged, the
    // timeout passes, or a stop arrives.
    let drain_s = if stop.load(Ordering::Relaxed) {
        info!("[STOP] asked to stop: leaving without draining the backlog");
        0
    } else {
        config.sync.drain_timeout_s
    };
    let drain_until = Instant::now() + Duration::from_secs(drain_s);
    if drain_s > 0 {
        // Every layer's progress since its last cut goes out too (`final_flush`).
        driver.start_final_flush();
    }
    while !driver.drained() && Instant::now() < drain_until && !stop.load(Ordering::Relaxed) {
        driver
            .pump(final_model.as_mut())
            .map_err(NodeRunError::Training)?;
        driver
            .flush_final(final_model.as_mut())
            .map_err(NodeRunError::Training)?;
        std::thread::sleep(Duration::from_millis(10));
    }
    let stopped = stop.load(Ordering::Relaxed);
    if stopped {
        // Stopped early: the next start resumes at this step (and delivers the backlog).
        write_progress(&progress_path, train_report.steps);
    } else {
        // Done: a later start with this data_dir trains from the beginning again.
        let _ = std::fs::remove_file(&progress_path);
    }
    let owed = driver.final_cuts_owed();
    if owed > 0 && !stopped && drain_s > 0 {
        warn!(
            "[WARN] the drain timeout ({drain_s} s) passed before the last progress of {owed} layers \
             could be cut (a previous delta was still in flight): it stays on this node; raise \
             [sync] drain_timeout_s to deliver it"
        );
    }
    let undelivered = driver.undelivered();
    if undelivered > 0 && !stopped {
        warn!("[WARN] leaving with {undelivered} undelivered deltas (kept in the weak-sync cache for the next start)");
    }
    let eval = task
        .evaluate_replica(final_model.as_mut(), None)
        .map_err(NodeRunError::Training)?;
    driver.set_accuracy(eval.accuracy.map(|a| a as f32));
    driver.report_now();
    std::thread::sleep(Duration::from_millis(100));
    runtime.block_on(net.leave("training finished"));

    let summary = NodeRunSummary {
        name: config.node.name.clone(),
        node_id: config.node.id,
        role: format!("{role:?}").to_lowercase(),
        incarnation,
        steps: train_report.steps,
        final_accuracy: eval.accuracy,
        final_loss: eval.loss,
        undelivered,
        counters: driver.counters().clone(),
        wall_seconds: started.elapsed().as_secs_f64(),
        memory: node::memory::process_memory(),
        data_bytes: task.data_bytes() as u64,
        pace,
        stopped,
    };
    let stats_path = config.node.data_dir.join("stats.json");
    let json = serde_json::to_string_pretty(&summary).unwrap_or_default();
    std::fs::write(&stats_path, json).map_err(io(&stats_path))?;
    info!(
        "[DONE] node={} steps={} accuracy={} undelivered={undelivered}",
        summary.name,
        summary.steps,
        summary
            .final_accuracy
            .map_or("-".into(), |a| format!("{:.2}%", a * 100.0))
    );
    quic.close();
    drop(runtime);
    Ok(summary)
}
