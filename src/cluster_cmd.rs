//! `dreamddp cluster FILE.toml`: starts a whole local cluster of real processes on 127.0.0.1
//! (coordinator, aggregators, worker nodes, edge agents — each `dreamddp <role>` child
//! processes talking QUIC with mutual TLS), puts lossy user-space relays in front of the
//! edges that ask for one, optionally `kill -9`s and restarts processes (`[[chaos]]`), waits
//! for training to end, evaluates the global model held by the aggregators, checks the
//! aggregators' applied ledgers for duplicates, and writes `summary.json`.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args;
use cpu_aggregator::server::config::{AggregationSection, AggregatorNodeSection};
use cpu_aggregator::server::shard_file;
use cpu_aggregator::server::AggregatorRunConfig;
use cpu_aggregator::{AggregatorConfig, AggregatorState};
use edge_agent::runtime::config::{NodeSection, SyncSection, TrainingSection};
use edge_agent::runtime::NodeRunConfig;
use node::cluster_model::{read_toml, ModelSection};
use node::layout::sync_layout;
use relay::{spawn_relay, RelayConfig, RelayHandle, RelayLinkSpec};
use serde::{Deserialize, Serialize};
use tokio::process::{Child, Command};
use transport::config::TransportSection;

use crate::cluster_health;

use crate::coordinator_cmd::{CoordinatorFile, CoordinatorNodeSection};

/// Flags of `cluster`.
#[derive(Args, Debug, Clone)]
pub struct ClusterArgs {
    /// The cluster file (see `examples/cluster-lossy.toml`).
    pub file: PathBuf,
    /// Output directory (default `cluster-out/<name>`); emptied first.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Run the same cluster with every relay removed (clean links), for comparison.
    #[arg(long)]
    pub clean_links: bool,
    /// Override the training steps of every trainer.
    #[arg(long)]
    pub steps: Option<u64>,
    /// Soak test: `kill -9` (and restart after 1 s) each process named here at
    /// `--random-kills` random instants (repeatable, e.g. `--kill edge-2 --kill agg-1`).
    #[arg(long = "kill")]
    pub kill: Vec<String>,
    /// Random instants per `--kill` process, uniform in `[1 s, --kill-window-s]` after the
    /// trainers start.
    #[arg(long, default_value_t = 20)]
    pub random_kills: usize,
    /// The window the random kills fall in, seconds.
    #[arg(long, default_value_t = 60.0)]
    pub kill_window_s: f64,
    /// Seed of the random kill instants.
    #[arg(long, default_value_t = 1)]
    pub kill_seed: u64,
}

/// The cluster file.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterFile {
    /// Cluster-wide settings.
    pub cluster: ClusterSection,
    /// The model every process trains.
    pub model: ModelSection,
    /// Defaults of every trainer.
    pub training: TrainingDefaults,
    /// Cross-site sync of every trainer.
    #[serde(default)]
    pub sync: SyncSection,
    /// Averaging on every aggregator.
    #[serde(default)]
    pub aggregation: AggregationSection,
    /// Aggregator processes.
    pub aggregators: Vec<NamedProcess>,
    /// Worker node processes.
    #[serde(default)]
    pub workers: Vec<WorkerProcess>,
    /// Edge agent processes.
    #[serde(default)]
    pub edges: Vec<EdgeProcess>,
    /// Processes to `kill -9` and restart.
    #[serde(default)]
    pub chaos: Vec<ChaosEvent>,
}

/// `[cluster]`.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterSection {
    /// Name (default output directory `cluster-out/<name>`).
    pub name: String,
    /// Shared join token.
    #[serde(default = "default_credentials")]
    pub credentials: String,
    /// Lease length, milliseconds.
    #[serde(default = "default_lease")]
    pub lease_ms: u64,
    /// Give up after this many seconds.
    #[serde(default = "default_timeout")]
    pub timeout_s: u64,
}

fn default_credentials() -> String {
    "dreamddp-local-cluster".into()
}
fn default_lease() -> u64 {
    10_000
}
fn default_timeout() -> u64 {
    900
}

/// `[training]`: defaults of every trainer.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainingDefaults {
    /// Steps.
    pub steps: u64,
    /// Per-worker batch.
    #[serde(default = "default_batch")]
    pub batch_size: usize,
    /// Learning rate.
    #[serde(default = "default_lr")]
    pub lr: f32,
    /// Local evaluation interval.
    #[serde(default = "default_eval_every")]
    pub eval_every: u64,
    /// Test examples per local evaluation.
    #[serde(default = "default_eval_limit")]
    pub eval_limit: usize,
}

fn default_batch() -> usize {
    32
}
fn default_lr() -> f32 {
    0.05
}
fn default_eval_every() -> u64 {
    200
}
fn default_eval_limit() -> usize {
    1000
}

/// `[[aggregators]]`.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NamedProcess {
    /// Node name.
    pub name: String,
}

/// `[[workers]]`.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkerProcess {
    /// Node name.
    pub name: String,
    /// Local workers.
    #[serde(default = "two")]
    pub workers: usize,
    /// Compute backend: `builtin` (default) or `tch` (needs a `--features tch` build).
    #[serde(default)]
    pub backend: Option<String>,
    /// Device of the tch backend: `cpu` (default) or `cuda:N`.
    #[serde(default)]
    pub device: Option<String>,
}

fn two() -> usize {
    2
}

/// `[[edges]]`.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EdgeProcess {
    /// Node name.
    pub name: String,
    /// A lossy relay between this edge and every aggregator.
    #[serde(default)]
    pub relay: Option<EdgeRelay>,
    /// This edge's per-attempt deadline (default: `[sync] deadline_ms`).
    #[serde(default)]
    pub deadline_ms: Option<u64>,
    /// This edge's delta codec (default: `[sync] codec`).
    #[serde(default)]
    pub codec: Option<String>,
    /// This edge's `[transport]` keys. Without `link_mbps`/`rtt_ms` here, an edge behind a
    /// relay gets them from the relay's link spec ([`relay_link_figures`]).
    #[serde(default)]
    pub transport: Option<TransportSection>,
    /// Compute backend: `builtin` (default) or `tch`.
    #[serde(default)]
    pub backend: Option<String>,
    /// Device of the tch backend: `cpu` (default) or `cuda:N`.
    #[serde(default)]
    pub device: Option<String>,
}

/// The link figures of an edge behind `relay`, for sizing its flow-control windows:
/// `rtt_ms` = both directions' latency plus jitter; `link_mbps` = the faster direction's
/// capacity (a constant `bandwidth`, or a trace's mean rate). `None` when the relay limits
/// neither bandwidth in some direction (that direction runs at loopback speed: the default
/// windows fit better than any product) or adds no delay.
pub fn relay_link_figures(relay: &EdgeRelay, base_dir: &Path) -> Result<Option<(f64, f64)>> {
    let rtt_ms =
        relay.up.latency_ms + relay.down.latency_ms + relay.up.jitter_ms + relay.down.jitter_ms;
    let (Some(up), Some(down)) = (
        direction_mbps(&relay.up, base_dir)?,
        direction_mbps(&relay.down, base_dir)?,
    ) else {
        return Ok(None);
    };
    Ok((rtt_ms > 0.0).then_some((up.max(down), rtt_ms)))
}

/// Capacity of one relay direction in Mbit/s (`None`: unlimited).
fn direction_mbps(spec: &RelayLinkSpec, base_dir: &Path) -> Result<Option<f64>> {
    if let Some(b) = spec.bandwidth {
        return Ok(Some(b.bits_per_sec() as f64 / 1e6));
    }
    let mut spec = spec.clone();
    spec.resolve_paths(base_dir);
    let Some(trace) = spec.load_trace().context("relay trace")? else {
        return Ok(None);
    };
    let period_s = trace.period().0 as f64 / 1e9;
    if period_s <= 0.0 {
        return Ok(None);
    }
    Ok(Some(trace.bytes_per_period() as f64 * 8.0 / period_s / 1e6))
}

/// An edge's `[transport]`: its explicit keys, with `link_mbps`/`rtt_ms` filled in from
/// the relay in front of it (if any, and links are not clean) when not given.
fn edge_transport(
    edge: &EdgeProcess,
    relay_in_use: bool,
    base_dir: &Path,
) -> Result<TransportSection> {
    let mut section = edge.transport.clone().unwrap_or_default();
    if let (Some(r), true) = (&edge.relay, relay_in_use) {
        if section.link_mbps.is_none() && section.rtt_ms.is_none() {
            if let Some((mbps, rtt)) = relay_link_figures(r, base_dir)? {
                section.link_mbps = Some(mbps);
                section.rtt_ms = Some(rtt);
            }
        }
    }
    Ok(section)
}

/// `[edges.relay]`: the link model of each direction (see `dreamddp relay`).
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EdgeRelay {
    /// Edge → aggregator.
    #[serde(default)]
    pub up: RelayLinkSpec,
    /// Aggregator → edge.
    #[serde(default)]
    pub down: RelayLinkSpec,
    /// Seed of the relay's random draws.
    #[serde(default)]
    pub seed: u64,
}

/// `[[chaos]]`: `kill -9` a process at `at_s` seconds after the trainers started, restart it
/// `down_s` seconds later (or never, with `restart = false`: an aggregator that is gone for
/// good, whose layers the coordinator moves once its lease expires).
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChaosEvent {
    /// Node name.
    pub kill: String,
    /// When, seconds after the trainers started.
    pub at_s: f64,
    /// Restart after this many seconds.
    #[serde(default = "default_down")]
    pub down_s: f64,
    /// Restart it at all.
    #[serde(default = "default_restart")]
    pub restart: bool,
}

fn default_restart() -> bool {
    true
}

fn default_down() -> f64 {
    1.0
}

/// One node in `summary.json`.
#[derive(Clone, Debug, Serialize)]
pub struct NodeSummary {
    /// Name.
    pub name: String,
    /// `coordinator`, `aggregator`, `worker`, `edge`.
    pub role: String,
    /// Behind a lossy relay.
    pub relayed: bool,
    /// Payload bytes sent (deltas for trainers, versions for aggregators).
    pub bytes_sent: u64,
    /// Deltas weak-synced (trainers).
    pub weak_sync_events: u64,
    /// Deltas applied (aggregators).
    pub deltas_applied: u64,
    /// Duplicates rejected (aggregators).
    pub duplicates_rejected: u64,
    /// Local accuracy at the end (trainers).
    pub local_accuracy: Option<f64>,
    /// Deltas still undelivered at exit (trainers): from its `stats.json`, or, for a
    /// trainer that never exited cleanly, counted in its durable cache on disk afterwards.
    pub undelivered: Option<u64>,
    /// Whether `undelivered` was read from the durable cache after the process died.
    pub undelivered_from_disk: bool,
    /// Why the node counts as lost (it died or failed outside the chaos plan), if it does.
    pub lost: Option<String>,
    /// Times it was killed with SIGKILL and restarted.
    pub kills: u32,
    /// Exit status of its last run.
    pub exit: String,
}

/// `summary.json`.
#[derive(Clone, Debug, Serialize)]
pub struct ClusterSummary {
    /// Cluster name.
    pub cluster: String,
    /// Whether relays were removed.
    pub clean_links: bool,
    /// Data set used.
    pub dataset: String,
    /// Accuracy of the global model (the aggregators' layers) on the full test set.
    pub final_accuracy: Option<f64>,
    /// Its loss.
    pub final_loss: f64,
    /// Per node.
    pub nodes: Vec<NodeSummary>,
    /// Deltas applied, all aggregators.
    pub deltas_applied: u64,
    /// Duplicates rejected, all aggregators.
    pub duplicates_rejected: u64,
    /// Weak-sync events, all trainers.
    pub weak_sync_events: u64,
    /// `(node, layer, seq)` applied more than once according to the ledgers of the
    /// aggregators that are part of the final system (must be 0).
    pub ledger_duplicates: u64,
    /// Deltas that an aggregator lost for good (`[[chaos]] restart = false`) had applied in
    /// versions the coordinator never received, and that their senders (never acknowledged)
    /// retransmitted to the layer's new owner, which applied them: applied once in the
    /// surviving history, so not duplicates.
    pub reapplied_after_loss: u64,
    /// Datagrams the relays dropped.
    pub relay_dropped_datagrams: u64,
    /// Wall seconds.
    pub wall_seconds: f64,
    /// Everything that makes this run not clean (lost nodes, undelivered deltas, deltas
    /// applied twice), one sentence each; `cluster` exits non-zero when there is any.
    pub problems: Vec<String>,
    /// What may be wrong but cannot be told from the ledgers (printed as `[WARN]`).
    pub warnings: Vec<String>,
}

struct Proc {
    name: String,
    role: &'static str,
    config: PathBuf,
    log: PathBuf,
    child: Option<Child>,
    kills: u32,
    relayed: bool,
}

impl Proc {
    fn spawn(&mut self) -> Result<()> {
        let exe = std::env::current_exe().context("locating the dreamddp binary")?;
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .with_context(|| format!("opening {}", self.log.display()))?;
        let err = log.try_clone()?;
        let level = std::env::var("DREAMDDP_CLUSTER_LOG").unwrap_or_else(|_| "info".into());
        let child = Command::new(exe)
            .env("RUST_LOG", level)
            .arg(self.role)
            .arg("--config")
            .arg(&self.config)
            .stdout(Stdio::from(log))
            .stderr(Stdio::from(err))
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("starting {} ({})", self.name, self.role))?;
        self.child = Some(child);
        Ok(())
    }

    fn terminate(&self) {
        if let Some(pid) = self.child.as_ref().and_then(|c| c.id()) {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid as i32),
                nix::sys::signal::Signal::SIGTERM,
            );
        }
    }

    async fn wait(&mut self, timeout: Duration) -> String {
        let Some(child) = self.child.as_mut() else {
            return "not running".into();
        };
        match tokio::time::timeout(timeout, child.wait()).await {
            Ok(Ok(status)) => status.to_string(),
            Ok(Err(e)) => format!("wait failed: {e}"),
            Err(_) => {
                let _ = child.kill().await;
                "killed after timeout".into()
            }
        }
    }
}

fn free_udp_port() -> Result<SocketAddr> {
    let s = std::net::UdpSocket::bind("127.0.0.1:0")?;
    Ok(s.local_addr()?)
}

fn free_tcp_port() -> Result<SocketAddr> {
    let s = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(s.local_addr()?)
}

fn write_toml<T: Serialize>(path: &Path, value: &T) -> Result<()> {
    let text = toml::to_string_pretty(value).context("serializing a process config")?;
    std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))
}

/// Plain HTTP GET on 127.0.0.1 (the coordinator's status endpoint).
pub async fn http_get(addr: SocketAddr, path: &str) -> Result<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::time::timeout(Duration::from_secs(2), tokio::net::TcpStream::connect(addr))
        .await
        .context("status endpoint timeout")??;
    s.write_all(
        format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").as_bytes(),
    )
    .await?;
    let mut buf = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut buf))
        .await
        .context("status endpoint read timeout")??;
    let text = String::from_utf8_lossy(&buf).to_string();
    let body = text.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    Ok(body.to_string())
}

async fn aggregators_joined(status: SocketAddr) -> usize {
    let Ok(body) = http_get(status, "/status").await else {
        return 0;
    };
    let Ok(v) = serde_json::from_str::<serde_json::Value>(&body) else {
        return 0;
    };
    v["members"].as_array().map_or(0, |m| {
        m.iter().filter(|x| x["role"] == "aggregator").count()
    })
}

/// `dreamddp cluster FILE`.
pub fn run(args: ClusterArgs) -> Result<()> {
    let mut file: ClusterFile = read_toml(&args.file)?;
    if let Some(steps) = args.steps {
        file.training.steps = steps;
    }
    file.chaos.extend(random_kills(&args));
    let base_dir = args.file.parent().unwrap_or(Path::new(".")).to_path_buf();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let summary = runtime.block_on(run_cluster(file, &args, &base_dir))?;
    print_table(&summary);
    if !summary.problems.is_empty() {
        anyhow::bail!(
            "cluster {} finished with {} problem(s) (listed above, and in summary.json)",
            summary.cluster,
            summary.problems.len()
        );
    }
    Ok(())
}

/// `--kill NAME` × `--random-kills N`: seeded instants, at least 1.5 s apart per process so
/// each restart (1 s down) completes before the next kill.
fn random_kills(args: &ClusterArgs) -> Vec<ChaosEvent> {
    use rand::{Rng, SeedableRng};
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(args.kill_seed);
    let mut events = Vec::new();
    for name in &args.kill {
        let mut at: Vec<f64> = Vec::new();
        let mut tries = 0;
        while at.len() < args.random_kills && tries < 100_000 {
            tries += 1;
            let t = rng.random_range(1.0..args.kill_window_s.max(1.5));
            if at.iter().all(|&o| (o - t).abs() >= 1.5) {
                at.push(t);
            }
        }
        at.sort_by(f64::total_cmp);
        events.extend(at.into_iter().map(|at_s| ChaosEvent {
            kill: name.clone(),
            at_s,
            down_s: 1.0,
            restart: true,
        }));
    }
    events
}

fn validate(file: &ClusterFile) -> Result<()> {
    if file.aggregators.is_empty() {
        bail!("[[aggregators]]: a cluster needs at least one aggregator");
    }
    if file.workers.is_empty() && file.edges.is_empty() {
        bail!("a cluster needs at least one [[workers]] or [[edges]] entry");
    }
    let mut names: Vec<&str> = vec!["coordinator"];
    names.extend(file.aggregators.iter().map(|a| a.name.as_str()));
    names.extend(file.workers.iter().map(|w| w.name.as_str()));
    names.extend(file.edges.iter().map(|e| e.name.as_str()));
    for (i, n) in names.iter().enumerate() {
        transport::validate_node_name(n).with_context(|| format!("node name {n:?}"))?;
        if names[..i].contains(n) {
            bail!(
                "node name {n:?} is used twice (names must be unique; \"coordinator\" is reserved)"
            );
        }
    }
    for c in &file.chaos {
        if !names[1..].contains(&c.kill.as_str()) {
            bail!(
                "[[chaos]] kill = {:?}: no aggregator, worker or edge has that name",
                c.kill
            );
        }
    }
    for w in &file.workers {
        if w.workers == 0 {
            bail!("[[workers]] {}: workers must be at least 1", w.name);
        }
    }
    Ok(())
}

async fn run_cluster(
    file: ClusterFile,
    args: &ClusterArgs,
    base_dir: &Path,
) -> Result<ClusterSummary> {
    validate(&file)?;
    let started = Instant::now();
    let out = args
        .out
        .clone()
        .unwrap_or_else(|| PathBuf::from("cluster-out").join(&file.cluster.name));
    if out.exists() {
        std::fs::remove_dir_all(&out).with_context(|| format!("emptying {}", out.display()))?;
    }
    std::fs::create_dir_all(&out)?;
    let certs_dir = out.join("certs");
    let mut all_names = vec!["coordinator".to_string()];
    all_names.extend(file.aggregators.iter().map(|a| a.name.clone()));
    all_names.extend(file.workers.iter().map(|w| w.name.clone()));
    all_names.extend(file.edges.iter().map(|e| e.name.clone()));
    transport::create_cluster_certs(&certs_dir, &all_names)?;

    let model = file.model.resolved().map_err(anyhow::Error::msg)?;
    let task = model.load_task().map_err(anyhow::Error::msg)?;
    let dataset = task.dataset.clone();
    let coordinator_addr = free_udp_port()?;
    let status_addr = free_tcp_port()?;
    let node_dir = |name: &str| -> Result<PathBuf> {
        let d = out.join(name);
        std::fs::create_dir_all(&d)?;
        Ok(d)
    };

    // Coordinator.
    let coord_dir = node_dir("coordinator")?;
    let coord_cfg = CoordinatorFile {
        model: model.clone(),
        node: CoordinatorNodeSection {
            name: "coordinator".into(),
            listen: coordinator_addr,
            status: Some(status_addr),
            certs_dir: certs_dir.clone(),
            credentials: file.cluster.credentials.clone(),
            lease_ms: file.cluster.lease_ms,
        },
    };
    write_toml(&coord_dir.join("config.toml"), &coord_cfg)?;
    let mut coordinator = Proc {
        name: "coordinator".into(),
        role: "coordinator",
        config: coord_dir.join("config.toml"),
        log: coord_dir.join("log.txt"),
        child: None,
        kills: 0,
        relayed: false,
    };
    coordinator.spawn()?;
    let deadline = Instant::now() + Duration::from_secs(20);
    while http_get(status_addr, "/healthz").await.is_err() {
        if Instant::now() > deadline {
            bail!(
                "the coordinator did not come up in 20 s; see {}",
                coordinator.log.display()
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // Aggregators.
    let mut aggregators = Vec::new();
    let mut agg_addrs = Vec::new();
    for (i, a) in file.aggregators.iter().enumerate() {
        let dir = node_dir(&a.name)?;
        let listen = free_udp_port()?;
        agg_addrs.push(listen);
        let cfg = AggregatorRunConfig {
            model: model.clone(),
            node: AggregatorNodeSection {
                name: a.name.clone(),
                id: 1 + i as u64,
                certs_dir: certs_dir.clone(),
                data_dir: dir.join("data"),
                listen,
                coordinator: coordinator_addr,
                coordinator_name: "coordinator".into(),
                credentials: file.cluster.credentials.clone(),
            },
            aggregation: file.aggregation.clone(),
            transport: TransportSection::default(),
        };
        write_toml(&dir.join("config.toml"), &cfg)?;
        let mut p = Proc {
            name: a.name.clone(),
            role: "aggregator",
            config: dir.join("config.toml"),
            log: dir.join("log.txt"),
            child: None,
            kills: 0,
            relayed: false,
        };
        p.spawn()?;
        aggregators.push(p);
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    while aggregators_joined(status_addr).await < aggregators.len() {
        if Instant::now() > deadline {
            bail!(
                "the aggregators did not join in 30 s; see the logs in {}",
                out.display()
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // Trainers (and the relays in front of lossy edges).
    let world: usize = file.workers.iter().map(|w| w.workers).sum::<usize>() + file.edges.len();
    let mut trainers = Vec::new();
    let mut relays: Vec<RelayHandle> = Vec::new();
    let mut rank = 0usize;
    let mut next_id = 100u64;
    type TrainerSpec<'a> = (
        String,
        &'static str,
        usize,
        Option<&'a EdgeRelay>,
        SyncSection,
        TransportSection,
        (Option<String>, Option<String>),
    );
    let mut specs: Vec<TrainerSpec> = Vec::new();
    for w in &file.workers {
        specs.push((
            w.name.clone(),
            "worker",
            w.workers,
            None,
            file.sync.clone(),
            TransportSection::default(),
            (w.backend.clone(), w.device.clone()),
        ));
    }
    for e in &file.edges {
        let mut sync = file.sync.clone();
        if let Some(d) = e.deadline_ms {
            sync.deadline_ms = d;
        }
        if let Some(c) = &e.codec {
            sync.codec = c.clone();
        }
        let transport = edge_transport(e, !args.clean_links, base_dir)
            .with_context(|| format!("edge {}: link figures of its relay", e.name))?;
        specs.push((
            e.name.clone(),
            "edge",
            1,
            e.relay.as_ref(),
            sync,
            transport,
            (e.backend.clone(), e.device.clone()),
        ));
    }
    for (name, role, workers, relay, sync, transport, (backend, device)) in specs {
        let dir = node_dir(&name)?;
        let mut overrides = HashMap::new();
        let relayed = relay.is_some() && !args.clean_links;
        if let (Some(r), false) = (relay, args.clean_links) {
            for (j, &upstream) in agg_addrs.iter().enumerate() {
                let mut up = r.up.clone();
                let mut down = r.down.clone();
                up.resolve_paths(base_dir);
                down.resolve_paths(base_dir);
                let handle = spawn_relay(RelayConfig {
                    listen: SocketAddr::from(([127, 0, 0, 1], 0)),
                    upstream,
                    up,
                    down,
                    seed: r.seed.wrapping_add(j as u64),
                })
                .await
                .with_context(|| format!("relay for {name}"))?;
                overrides.insert(upstream, handle.local_addr());
                relays.push(handle);
            }
        }
        let cfg = NodeRunConfig {
            model: model.clone(),
            node: NodeSection {
                name: name.clone(),
                id: next_id,
                certs_dir: certs_dir.clone(),
                data_dir: dir.join("data"),
                coordinator: coordinator_addr,
                coordinator_name: "coordinator".into(),
                credentials: file.cluster.credentials.clone(),
                bind: SocketAddr::from(([127, 0, 0, 1], 0)),
                address_overrides: overrides,
            },
            training: TrainingSection {
                workers,
                first_rank: rank,
                world,
                steps: file.training.steps,
                batch_size: file.training.batch_size,
                lr: file.training.lr,
                eval_every: file.training.eval_every,
                eval_limit: file.training.eval_limit,
                backend: backend.unwrap_or_else(|| "builtin".into()),
                device: device.unwrap_or_else(|| "cpu".into()),
            },
            sync,
            transport,
        };
        cfg.validate().map_err(|e| anyhow::anyhow!("{name}: {e}"))?;
        write_toml(&dir.join("config.toml"), &cfg)?;
        next_id += 1;
        rank += workers;
        let mut p = Proc {
            name: name.clone(),
            role,
            config: dir.join("config.toml"),
            log: dir.join("log.txt"),
            child: None,
            kills: 0,
            relayed,
        };
        p.spawn()?;
        trainers.push(p);
    }
    let trainers_started = Instant::now();

    // Chaos and waiting for the trainers.
    let mut chaos: Vec<(ChaosEvent, bool)> =
        file.chaos.iter().map(|c| (c.clone(), false)).collect();
    chaos.sort_by(|a, b| a.0.at_s.total_cmp(&b.0.at_s));
    let mut restarts: Vec<(Instant, String)> = Vec::new();
    let timeout = Duration::from_secs(file.cluster.timeout_s);
    let mut exits: BTreeMap<String, String> = BTreeMap::new();
    loop {
        let elapsed = trainers_started.elapsed().as_secs_f64();
        for (event, done) in chaos.iter_mut() {
            if *done || elapsed < event.at_s {
                continue;
            }
            *done = true;
            let target = trainers
                .iter_mut()
                .chain(aggregators.iter_mut())
                .find(|p| p.name == event.kill);
            if let Some(p) = target {
                if let Some(child) = p.child.as_mut() {
                    if child.try_wait().ok().flatten().is_none() {
                        tracing::warn!("[CHAOS] kill -9 {} at {:.1} s", p.name, elapsed);
                        let _ = child.kill().await; // SIGKILL
                        let _ = child.wait().await;
                        p.kills += 1;
                        if event.restart {
                            restarts.push((
                                Instant::now() + Duration::from_secs_f64(event.down_s),
                                p.name.clone(),
                            ));
                        } else {
                            p.child = None;
                            exits.insert(p.name.clone(), cluster_health::PLANNED_KILL.into());
                        }
                    }
                }
            }
        }
        let now = Instant::now();
        let due: Vec<String> = restarts
            .iter()
            .filter(|(at, _)| *at <= now)
            .map(|(_, n)| n.clone())
            .collect();
        restarts.retain(|(at, _)| *at > now);
        for name in due {
            if let Some(p) = trainers
                .iter_mut()
                .chain(aggregators.iter_mut())
                .find(|p| p.name == name)
            {
                tracing::warn!("[CHAOS] restarting {}", p.name);
                p.spawn()?;
            }
        }
        let mut running = 0;
        for p in trainers.iter_mut() {
            if exits.contains_key(&p.name) {
                continue;
            }
            let pending_restart = restarts.iter().any(|(_, n)| *n == p.name);
            match p.child.as_mut().map(|c| c.try_wait()) {
                Some(Ok(Some(status))) if !pending_restart => {
                    exits.insert(p.name.clone(), status.to_string());
                }
                _ => running += 1,
            }
        }
        if running == 0 && restarts.is_empty() {
            break;
        }
        if started.elapsed() > timeout {
            tracing::error!(
                "[ERROR] cluster timeout after {} s; stopping",
                file.cluster.timeout_s
            );
            for p in trainers.iter_mut() {
                if !exits.contains_key(&p.name) {
                    let status = p.wait(Duration::from_millis(10)).await;
                    exits.insert(p.name.clone(), status);
                }
            }
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // Let the last deltas land, snapshot the status, stop the aggregators and coordinator.
    tokio::time::sleep(Duration::from_millis(500)).await;
    if let Ok(body) = http_get(status_addr, "/status").await {
        let _ = std::fs::write(out.join("status.json"), body);
    }
    if let Ok(body) = http_get(status_addr, "/metrics").await {
        let _ = std::fs::write(out.join("metrics.txt"), body);
    }
    for p in &aggregators {
        p.terminate();
    }
    for p in aggregators.iter_mut() {
        if p.child.is_none() {
            continue; // killed for good by [[chaos]]; its exit is recorded
        }
        let status = p.wait(Duration::from_secs(20)).await;
        exits.insert(p.name.clone(), status);
    }
    coordinator.terminate();
    let status = coordinator.wait(Duration::from_secs(10)).await;
    exits.insert("coordinator".into(), status);
    let mut relay_dropped = 0;
    for r in relays {
        let s = r.stats();
        relay_dropped += s.up.dropped.total() + s.down.dropped.total();
        r.shutdown().await;
    }

    // The global model = the persisted layers of the aggregators that are part of the final
    // system (one lost for good left a branch of history that was handed over only up to the
    // coordinator's checkpoint, so its shard is not used); where two shards hold a layer, the
    // newer version wins.
    let mut eval_model = task.build_model(model.seed);
    let layout = sync_layout(&eval_model);
    let mut ledger = Vec::new();
    let mut lost_ledger = Vec::new();
    let mut nodes = Vec::new();
    let mut layer_versions: HashMap<u32, u64> = HashMap::new();
    for p in &aggregators {
        let dir = out.join(&p.name).join("data");
        // `[[chaos]] restart = false` drops the child handle of a process it killed for good.
        let lost = p.child.is_none();
        if lost {
            if let Some((_, entries)) = shard_file::read(&dir.join("shard.bin"))? {
                lost_ledger.extend(entries);
            }
        } else if let Some((snapshot, entries)) = shard_file::read(&dir.join("shard.bin"))? {
            let state = AggregatorState::restore(&snapshot, AggregatorConfig::default())
                .map_err(|e| anyhow::anyhow!("{}: {e}", p.name))?;
            for id in state.layer_ids() {
                if let (Some(view), Some(def)) =
                    (state.layer(id), layout.iter().find(|d| d.layer_id == id))
                {
                    let newest = layer_versions.get(&id).is_none_or(|&v| view.version > v);
                    if newest {
                        layer_versions.insert(id, view.version);
                        eval_model.set_layer_values(def.model_index, view.values);
                    }
                }
            }
            ledger.extend(entries);
        }
        let stats: serde_json::Value = std::fs::read_to_string(dir.join("stats.json"))
            .ok()
            .and_then(|t| serde_json::from_str(&t).ok())
            .unwrap_or_default();
        let exit = exits.get(&p.name).cloned().unwrap_or_default();
        nodes.push(NodeSummary {
            name: p.name.clone(),
            role: "aggregator".into(),
            relayed: false,
            bytes_sent: stats["bytes_out"].as_u64().unwrap_or(0),
            weak_sync_events: 0,
            deltas_applied: stats["deltas_applied"].as_u64().unwrap_or(0),
            duplicates_rejected: stats["duplicates_rejected"].as_u64().unwrap_or(0),
            local_accuracy: None,
            undelivered: None,
            undelivered_from_disk: false,
            lost: cluster_health::lost_reason(&exit),
            kills: p.kills,
            exit,
        });
    }
    let eval = task.evaluate(&mut eval_model, None);
    // The global model, readable by PyTorch (`safetensors.torch.load_file`).
    let global_path = out.join("global.safetensors");
    let meta = BTreeMap::from([("dreamddp.dataset".to_string(), task.dataset.clone())]);
    let bytes = engine::checkpoint::to_safetensors(&eval_model, &meta)?;
    node::cluster_model::write_file_atomic(&global_path, &bytes)
        .with_context(|| format!("cannot write {}", global_path.display()))?;
    ledger.sort();
    let ledger_duplicates = ledger.windows(2).filter(|w| w[0] == w[1]).count() as u64;
    let reapplied_after_loss = lost_ledger
        .iter()
        .filter(|e| ledger.binary_search(e).is_ok())
        .count() as u64;
    for p in &trainers {
        let data_dir = out.join(&p.name).join("data");
        let stats: serde_json::Value = std::fs::read_to_string(data_dir.join("stats.json"))
            .ok()
            .and_then(|t| serde_json::from_str(&t).ok())
            .unwrap_or_default();
        // No stats: the last run never exited cleanly; what its cache still holds was never
        // delivered.
        let (undelivered, undelivered_from_disk) = match stats["undelivered"].as_u64() {
            Some(n) => (Some(n), false),
            None => match cluster_health::undelivered_on_disk(&data_dir) {
                Ok(n) => (Some(n), true),
                Err(e) => {
                    tracing::error!("[ERROR] cannot read {}'s durable cache: {e}", p.name);
                    (None, true)
                }
            },
        };
        let exit = exits.get(&p.name).cloned().unwrap_or_default();
        nodes.push(NodeSummary {
            name: p.name.clone(),
            role: p.role.into(),
            relayed: p.relayed,
            bytes_sent: stats["counters"]["bytes_sent"].as_u64().unwrap_or(0),
            weak_sync_events: stats["counters"]["weak_sync_events"].as_u64().unwrap_or(0),
            deltas_applied: 0,
            duplicates_rejected: 0,
            local_accuracy: stats["final_accuracy"].as_f64(),
            undelivered,
            undelivered_from_disk,
            lost: cluster_health::lost_reason(&exit),
            kills: p.kills,
            exit,
        });
    }
    let mut problems = cluster_health::problems(
        &nodes
            .iter()
            .map(|n| cluster_health::NodeOutcome {
                name: &n.name,
                role: &n.role,
                lost: n.lost.as_deref(),
                undelivered: n.undelivered.map(|u| (u, n.undelivered_from_disk)),
            })
            .collect::<Vec<_>>(),
    );
    if let Some(why) = exits
        .get("coordinator")
        .and_then(|e| cluster_health::lost_reason(e))
    {
        problems.push(format!("the coordinator was lost: {why}"));
    }
    // The ledgers carry no version tags: after an aggregator was killed and restarted, a delta
    // applied in its rolled-back branch and re-applied by the layer's next owner is counted
    // although the surviving history holds it once. Only without such a restart is a ledger
    // duplicate certainly a delta applied twice.
    let mut warnings = Vec::new();
    if ledger_duplicates > 0 {
        let restarted = nodes.iter().any(|n| n.role == "aggregator" && n.kills > 0);
        let line = format!(
            "{ledger_duplicates} (node, layer, seq) appear twice in the aggregators' ledgers"
        );
        if restarted {
            warnings.push(format!(
                "{line}; an aggregator was killed and restarted, so this may be a rolled-back branch counted twice"
            ));
        } else {
            problems.push(format!("{line}: deltas were applied more than once"));
        }
    }
    let summary = ClusterSummary {
        cluster: file.cluster.name.clone(),
        clean_links: args.clean_links,
        dataset,
        final_accuracy: eval.accuracy,
        final_loss: eval.loss,
        deltas_applied: nodes.iter().map(|n| n.deltas_applied).sum(),
        duplicates_rejected: nodes.iter().map(|n| n.duplicates_rejected).sum(),
        weak_sync_events: nodes.iter().map(|n| n.weak_sync_events).sum(),
        nodes,
        ledger_duplicates,
        reapplied_after_loss,
        relay_dropped_datagrams: relay_dropped,
        wall_seconds: started.elapsed().as_secs_f64(),
        problems,
        warnings,
    };
    std::fs::write(
        out.join("summary.json"),
        serde_json::to_string_pretty(&summary)?,
    )?;
    println!(
        "wrote {} and the global model {}",
        out.join("summary.json").display(),
        global_path.display()
    );
    Ok(summary)
}

fn print_table(s: &ClusterSummary) {
    println!(
        "cluster {} ({}, {}): global model accuracy {} (loss {:.4}), {:.0} s wall",
        s.cluster,
        s.dataset,
        if s.clean_links {
            "clean links"
        } else {
            "as configured"
        },
        s.final_accuracy
            .map_or("-".into(), |a| format!("{:.2}%", a * 100.0)),
        s.final_loss,
        s.wall_seconds
    );
    println!(
        "{:<14} {:<10} {:>7} {:>12} {:>9} {:>8} {:>6} {:>9} {:>6}  exit",
        "node",
        "role",
        "relayed",
        "bytes_sent",
        "weak_sync",
        "applied",
        "dups",
        "local_acc",
        "kills"
    );
    for n in &s.nodes {
        println!(
            "{:<14} {:<10} {:>7} {:>12} {:>9} {:>8} {:>6} {:>9} {:>6}  {}",
            n.name,
            n.role,
            if n.relayed { "yes" } else { "" },
            n.bytes_sent,
            n.weak_sync_events,
            n.deltas_applied,
            n.duplicates_rejected,
            n.local_accuracy
                .map_or("-".into(), |a| format!("{:.2}%", a * 100.0)),
            n.kills,
            n.exit
        );
    }
    println!(
        "deltas applied {} · duplicates rejected {} · weak-sync events {} · ledger duplicates {} · relay drops {}",
        s.deltas_applied, s.duplicates_rejected, s.weak_sync_events, s.ledger_duplicates, s.relay_dropped_datagrams
    );
    let undelivered: u64 = s.nodes.iter().filter_map(|n| n.undelivered).sum();
    let lost = s.nodes.iter().filter(|n| n.lost.is_some()).count();
    for w in &s.warnings {
        println!("[WARN] {w}");
    }
    if s.problems.is_empty() {
        println!("clean: no node lost, nothing left undelivered");
    } else {
        println!("NOT CLEAN: {lost} node(s) lost · {undelivered} deltas left undelivered");
        for p in &s.problems {
            println!("[WARN] {p}");
        }
    }
    if s.reapplied_after_loss > 0 {
        println!(
            "{} deltas applied by an aggregator lost for good, in versions the coordinator never got, were retransmitted and applied by the new owner",
            s.reapplied_after_loss
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn edge(text: &str) -> EdgeProcess {
        toml::from_str(text).unwrap()
    }

    #[test]
    fn a_relayed_edge_gets_its_links_figures_and_explicit_keys_win() {
        let dir = Path::new(".");
        let limited = edge(
            r#"
name = "e"
[relay]
up = { latency_ms = 50, jitter_ms = 10, bandwidth = "10mbit" }
down = { latency_ms = 50, bandwidth = "40mbit" }
"#,
        );
        let t = edge_transport(&limited, true, dir).unwrap();
        assert_eq!(t.link_mbps, Some(40.0));
        assert_eq!(t.rtt_ms, Some(110.0));
        // Clean links: no relay, no sizing.
        assert_eq!(
            edge_transport(&limited, false, dir).unwrap(),
            TransportSection::default()
        );
        // An unlimited direction: defaults.
        let unlimited = edge(
            r#"
name = "e"
[relay]
up = { latency_ms = 100, loss = 0.2 }
down = { latency_ms = 100, loss = 0.2 }
"#,
        );
        assert_eq!(
            edge_transport(&unlimited, true, dir).unwrap(),
            TransportSection::default()
        );
        // Explicit figures are kept as written.
        let explicit = edge(
            r#"
name = "e"
transport = { link_mbps = 5, rtt_ms = 30, congestion = "cubic" }
[relay]
up = { latency_ms = 50, bandwidth = "10mbit" }
down = { latency_ms = 50, bandwidth = "10mbit" }
"#,
        );
        let t = edge_transport(&explicit, true, dir).unwrap();
        assert_eq!((t.link_mbps, t.rtt_ms), (Some(5.0), Some(30.0)));
        assert_eq!(t.congestion.as_deref(), Some("cubic"));
    }

    #[test]
    fn a_traced_relay_uses_the_traces_mean_rate() {
        let dir = std::env::temp_dir().join(format!("ddp-cluster-trace-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        // mahimahi: one 1500-byte opportunity per line; 4 per 4 ms period = 12 Mbit/s.
        std::fs::write(dir.join("t.up"), "1\n2\n3\n4\n").unwrap();
        let traced = edge(
            r#"
name = "e"
[relay]
up = { latency_ms = 20, trace = { path = "t.up", format = "mahimahi" } }
down = { latency_ms = 20, bandwidth = "2mbit" }
"#,
        );
        let (mbps, rtt) = relay_link_figures(traced.relay.as_ref().unwrap(), &dir)
            .unwrap()
            .unwrap();
        assert!((mbps - 12.0).abs() < 1e-9, "{mbps}");
        assert_eq!(rtt, 40.0);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
