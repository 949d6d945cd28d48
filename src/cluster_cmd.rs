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
use cpu_aggregator::server::config::AggregatorNodeSection;
use cpu_aggregator::server::AggregatorRunConfig;
use edge_agent::runtime::config::{NodeSection, SyncSection, TrainingSection};
use edge_agent::runtime::pacing::PaceSection;
use edge_agent::runtime::NodeRunConfig;
use engine::data::sampler::DataPartition;
use node::cluster_model::read_toml;
use relay::{spawn_relay_with_zero, RelayConfig, RelayHandle};
use serde::Serialize;
use tokio::process::{Child, Command};
use transport::config::TransportSection;

use crate::cluster_file::{
    edge_transport, validate, ChaosEvent, ClusterFile, EdgeRelay, RevokeEvent,
};
use crate::cluster_health;
pub use crate::cluster_summary::{print_table, ClusterSummary, GlobalPoint, NodeSummary};
use crate::global_model::{read_global, ShardSource};

use crate::cluster_file::SwarmSpec;
use crate::cluster_summary::{LatencyReport, SwarmReport};
use crate::coordinator_cmd::{CoordinatorFile, CoordinatorNodeSection};
use crate::status_probe::StatusProbe;
use edge_agent::runtime::swarm::{SwarmClient, SwarmRunConfig, SwarmSection};
use node::latency::LatencyHistogram;

/// Clients of a swarm process that failed, from its `stats.json` (0 when it wrote none: a
/// process that died without one is reported as lost).
fn swarm_failed(data_dir: &Path) -> usize {
    std::fs::read_to_string(data_dir.join("stats.json"))
        .ok()
        .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
        .and_then(|v| v["failed"].as_u64())
        .map_or(0, |n| n as usize)
}

/// Flags of `cluster`.
#[derive(Args, Debug, Clone)]
pub struct ClusterArgs {
    /// The cluster file (see `examples/cluster-lossy.toml`), or an edge-kind scenario (a
    /// file with `kind = "edge"`, or a built-in name such as `default`) run as real processes.
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
    /// Scenario runs: the `simulate`-style overrides.
    #[command(flatten)]
    pub scenario: crate::scenario_cluster::ScenarioOverrides,
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
        // `DREAMDDP_CLUSTER_WRAP="ROLE:PROGRAM ARGS"` starts that role's processes under a
        // tool (e.g. `swarm:heaptrack -o /tmp/heap`, `aggregator:perf record -g`).
        let wrap = std::env::var("DREAMDDP_CLUSTER_WRAP").ok().and_then(|w| {
            let (role, cmd) = w.split_once(':')?;
            (role == self.role)
                .then(|| cmd.split_whitespace().map(String::from).collect::<Vec<_>>())
        });
        let mut command = match wrap.as_deref() {
            Some([program, args @ ..]) => {
                let mut c = Command::new(program);
                c.args(args).arg(exe);
                c
            }
            _ => Command::new(exe),
        };
        let child = command
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

/// `dreamddp cluster FILE` (a cluster file) or `dreamddp cluster SCENARIO` (an edge-kind
/// scenario: a file with `kind = "edge"`, or a built-in name; see [`crate::scenario_cluster`]).
pub fn run(args: ClusterArgs) -> Result<()> {
    if crate::scenario_cluster::is_scenario(&args.file)? {
        return crate::scenario_cluster::run(&args).map(|_| ());
    }
    let mut file: ClusterFile = read_toml(&args.file)?;
    if let Some(steps) = args.steps {
        file.training.steps = steps;
    }
    file.chaos.extend(random_kills(&args));
    let base_dir = args.file.parent().unwrap_or(Path::new(".")).to_path_buf();
    let summary = run_cluster_file(file, &args, &base_dir)?;
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

/// Runs one cluster file to its end on a runtime of its own (relative trace paths resolve
/// against `base_dir`) and returns its summary (also written to `summary.json`).
pub fn run_cluster_file(
    file: ClusterFile,
    args: &ClusterArgs,
    base_dir: &Path,
) -> Result<ClusterSummary> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    runtime.block_on(run_cluster(file, args, base_dir))
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

/// One trainer process to start.
struct TrainerSpec<'a> {
    name: String,
    role: &'static str,
    workers: usize,
    relay: Option<&'a EdgeRelay>,
    sync: SyncSection,
    transport: TransportSection,
    backend: Option<String>,
    device: Option<String>,
    batch_size: Option<usize>,
    pace: Option<PaceSection>,
    start_at_s: Option<f64>,
    link_class: String,
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
    if let Some(sw) = &file.swarm {
        all_names.extend((0..sw.clients).map(SwarmSpec::client_name));
    }
    transport::create_cluster_certs_valid_for(
        &certs_dir,
        &all_names,
        Duration::from_secs(u64::from(file.cluster.cert_lifetime_days) * 86_400),
    )?;

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
        divergence: file.divergence.clone(),
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
                advertise: None,
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

    // The `[node]` section of a trainer (or of a swarm process) on this machine.
    let node_section =
        |name: &str,
         id: u64,
         data_dir: PathBuf,
         address_overrides: HashMap<SocketAddr, SocketAddr>| NodeSection {
            name: name.to_string(),
            id,
            certs_dir: certs_dir.clone(),
            data_dir,
            coordinator: coordinator_addr,
            coordinator_name: "coordinator".into(),
            credentials: file.cluster.credentials.clone(),
            bind: SocketAddr::from(([127, 0, 0, 1], 0)),
            address_overrides,
            nice: file.cluster.trainer_nice,
            start_at_unix_ms: None,
        };

    // Trainers (and the relays in front of lossy edges).
    let world: usize = file.workers.iter().map(|w| w.workers).sum::<usize>() + file.edges.len();
    let mut trainers = Vec::new();
    let mut relays: Vec<(String, String, RelayHandle)> = Vec::new();
    let mut rank = 0usize;
    let mut next_id = 100u64;
    let mut specs: Vec<TrainerSpec> = Vec::new();
    for w in &file.workers {
        specs.push(TrainerSpec {
            name: w.name.clone(),
            role: "worker",
            workers: w.workers,
            relay: None,
            sync: file.sync.clone(),
            transport: TransportSection::default(),
            backend: w.backend.clone(),
            device: w.device.clone(),
            batch_size: None,
            pace: None,
            start_at_s: None,
            link_class: "worker".into(),
        });
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
        specs.push(TrainerSpec {
            name: e.name.clone(),
            role: "edge",
            workers: 1,
            relay: e.relay.as_ref(),
            sync,
            transport,
            backend: e.backend.clone(),
            device: e.device.clone(),
            batch_size: e.batch_size,
            pace: e.pace.clone(),
            start_at_s: e.start_at_s,
            link_class: e.link_class.clone().unwrap_or_else(|| "edge".into()),
        });
    }
    let mut late_starts: Vec<(f64, String)> = Vec::new();
    // One common start: every trainer loads its data and model, then waits for this moment
    // (`[node] start_at_unix_ms`) to join, and its relay's trace starts then too, as the
    // simulator starts its nodes and their links' traces together at 0. Left to start as they
    // came up, the processes joined 0.1–0.6 s after their spawn here (more with more of them),
    // each into a trace that had run on without it. A late starter is spawned the same margin
    // before its `start_at_s` and waits for that moment.
    let start_margin = Duration::from_secs_f64((1.0 + 0.1 * specs.len() as f64).min(10.0));
    let common_start = Instant::now() + start_margin;
    let common_start_unix_ms = (std::time::SystemTime::now() + start_margin)
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
    for spec in specs {
        let name = spec.name.clone();
        let dir = node_dir(&name)?;
        let mut overrides = HashMap::new();
        let relayed = spec.relay.is_some() && !args.clean_links;
        // This trainer's moment: the common start, or its late start after it.
        let start_after = Duration::from_secs_f64(spec.start_at_s.unwrap_or(0.0).max(0.0));
        if let (Some(r), false) = (spec.relay, args.clean_links) {
            for (j, &upstream) in agg_addrs.iter().enumerate() {
                let mut up = r.up.clone();
                let mut down = r.down.clone();
                up.resolve_paths(base_dir);
                down.resolve_paths(base_dir);
                let config = RelayConfig {
                    listen: SocketAddr::from(([127, 0, 0, 1], 0)),
                    upstream,
                    up,
                    down,
                    seed: r.seed.wrapping_add(j as u64),
                };
                let zero = tokio::time::Instant::from_std(common_start + start_after);
                let handle = spawn_relay_with_zero(config, zero)
                    .await
                    .with_context(|| format!("relay for {name}"))?;
                overrides.insert(upstream, handle.local_addr());
                relays.push((spec.link_class.clone(), name.clone(), handle));
            }
        }
        let mut cfg = NodeRunConfig {
            model: model.clone(),
            node: node_section(&name, next_id, dir.join("data"), overrides),
            training: TrainingSection {
                workers: spec.workers,
                first_rank: rank,
                world,
                steps: file.training.steps,
                data_partition: file
                    .training
                    .data_partition
                    .unwrap_or(if spec.role == "edge" {
                        DataPartition::Fixed
                    } else {
                        DataPartition::Reshuffled
                    }),
                batch_size: spec.batch_size.unwrap_or(file.training.batch_size),
                lr: file.training.lr,
                eval_every: file.training.eval_every,
                eval_limit: file.training.eval_limit,
                backend: spec.backend.unwrap_or_else(|| "builtin".into()),
                device: spec.device.unwrap_or_else(|| "cpu".into()),
                optimizer: file.training.optimizer.clone(),
                lr_schedule: file.training.lr_schedule,
                pace: spec.pace,
            },
            sync: spec.sync,
            transport: spec.transport,
        };
        cfg.node.start_at_unix_ms =
            Some(common_start_unix_ms + u64::try_from(start_after.as_millis()).unwrap_or(u64::MAX));
        cfg.validate().map_err(|e| anyhow::anyhow!("{name}: {e}"))?;
        write_toml(&dir.join("config.toml"), &cfg)?;
        next_id += 1;
        rank += spec.workers;
        let mut p = Proc {
            name: name.clone(),
            role: spec.role,
            config: dir.join("config.toml"),
            log: dir.join("log.txt"),
            child: None,
            kills: 0,
            relayed,
        };
        match spec.start_at_s {
            Some(at) if at > 0.0 => late_starts.push((at, name.clone())),
            _ => p.spawn()?,
        }
        trainers.push(p);
    }
    if let Some(sw) = &file.swarm {
        for (p, process) in (0..sw.processes).map(|p| (p, SwarmSpec::process_name(p))) {
            let dir = node_dir(&process)?;
            let clients: Vec<SwarmClient> = (0..sw.clients)
                .filter(|i| i % sw.processes == p)
                .map(|i| SwarmClient {
                    name: SwarmSpec::client_name(i),
                    id: next_id + i as u64,
                })
                .collect();
            let cfg = SwarmRunConfig {
                template: NodeRunConfig {
                    model: model.clone(),
                    node: node_section(&process, 0, dir.join("data"), HashMap::new()),
                    training: TrainingSection {
                        workers: 1,
                        first_rank: 0,
                        world: 1,
                        steps: file.training.steps,
                        data_partition: DataPartition::Reshuffled,
                        batch_size: file.training.batch_size,
                        lr: file.training.lr,
                        eval_every: 0,
                        eval_limit: file.training.eval_limit,
                        backend: "builtin".into(),
                        device: "cpu".into(),
                        optimizer: None,
                        lr_schedule: None,
                        pace: None,
                    },
                    sync: file.sync.clone(),
                    transport: sw
                        .transport
                        .clone()
                        .unwrap_or_else(SwarmSpec::default_transport),
                },
                swarm: SwarmSection {
                    step_ms: sw.step_ms,
                    steps: file.training.steps,
                    driver_threads: sw.driver_threads,
                    network_threads: sw.network_threads,
                    join_spread_ms: sw.join_spread_ms,
                    nice: sw.nice,
                },
                clients,
            };
            write_toml(&dir.join("config.toml"), &cfg)?;
            let mut proc = Proc {
                name: process,
                role: "swarm",
                config: dir.join("config.toml"),
                log: dir.join("log.txt"),
                child: None,
                kills: 0,
                relayed: false,
            };
            proc.spawn()?;
            trainers.push(proc);
        }
    }
    let status_probe = StatusProbe::start(status_addr);
    let trainers_started = common_start;
    let trainers_started_unix_s = common_start_unix_ms as f64 / 1e3;
    let layout = model.layout(&task.build_model(model.seed));
    let shard_sources = |aggregators: &[Proc]| -> Vec<ShardSource> {
        aggregators
            .iter()
            .map(|p| ShardSource {
                name: p.name.clone(),
                data_dir: out.join(&p.name).join("data"),
                lost: p.child.is_none(),
            })
            .collect()
    };
    let mut series: Vec<GlobalPoint> = Vec::new();
    let mut next_eval = file.cluster.eval_every_s;
    let mut stopped: Vec<String> = Vec::new();

    // Chaos and waiting for the trainers.
    let mut chaos: Vec<(ChaosEvent, bool)> =
        file.chaos.iter().map(|c| (c.clone(), false)).collect();
    chaos.sort_by(|a, b| a.0.at_s.total_cmp(&b.0.at_s));
    let mut revocations: Vec<(RevokeEvent, bool)> =
        file.revoke.iter().map(|r| (r.clone(), false)).collect();
    let mut revoked_at: BTreeMap<String, f64> = BTreeMap::new();
    let mut restarts: Vec<(Instant, String)> = Vec::new();
    let timeout = Duration::from_secs(file.cluster.timeout_s);
    let mut exits: BTreeMap<String, String> = BTreeMap::new();
    loop {
        let elapsed = trainers_started.elapsed().as_secs_f64();
        late_starts.retain(|(at, name)| {
            // Spawned the start margin early: it waits for its moment itself.
            if elapsed + start_margin.as_secs_f64() < *at {
                return true;
            }
            if let Some(p) = trainers.iter_mut().find(|p| &p.name == name) {
                tracing::info!("[JOIN] starting {} at {:.1} s", p.name, elapsed);
                if let Err(e) = p.spawn() {
                    tracing::error!("[ERROR] cannot start {}: {e:#}", p.name);
                    exits.insert(p.name.clone(), format!("failed to start: {e}"));
                }
            }
            false
        });
        if let Some(at) = next_eval.filter(|&at| elapsed >= at) {
            let every = file.cluster.eval_every_s.unwrap_or(f64::INFINITY);
            next_eval = Some(at + every);
            let sources = shard_sources(&aggregators);
            let (task2, layout2, seed, limit) = (
                task.clone(),
                layout.clone(),
                model.seed,
                file.training.eval_limit,
            );
            let relay_bytes: u64 = relays
                .iter()
                .map(|(_, _, r)| {
                    let s = r.stats();
                    s.up.bytes_in + s.down.bytes_in
                })
                .sum();
            let eval = tokio::task::spawn_blocking(move || -> Result<(Option<f64>, f64)> {
                let mut m = task2.build_model(seed);
                read_global(&mut m, &layout2, &sources)?;
                let e = task2.evaluate(&mut m, Some(limit));
                Ok((e.accuracy, e.loss))
            })
            .await?;
            match eval {
                Ok((accuracy, loss)) => series.push(GlobalPoint {
                    time_s: at,
                    accuracy,
                    loss,
                    relay_bytes,
                }),
                Err(e) => tracing::warn!("[WARN] global model evaluation at {at:.0} s: {e:#}"),
            }
        }
        if file.cluster.stop_after_s.is_some_and(|t| elapsed >= t) {
            // The run's end: every trainer still running is asked to stop (SIGTERM: it ends
            // its step, keeps its backlog in its durable cache and writes its stats).
            let mut asked = Vec::new();
            for p in trainers.iter_mut() {
                if exits.contains_key(&p.name) {
                    continue;
                }
                let running = p
                    .child
                    .as_mut()
                    .is_some_and(|c| c.try_wait().ok().flatten().is_none());
                if running {
                    p.terminate();
                    asked.push(p.name.clone());
                } else if late_starts.iter().any(|(_, n)| *n == p.name) {
                    exits.insert(p.name.clone(), cluster_health::NEVER_STARTED.into());
                }
                stopped.push(p.name.clone());
            }
            for p in trainers.iter_mut().filter(|p| asked.contains(&p.name)) {
                let status = p.wait(Duration::from_secs(20)).await;
                exits.insert(p.name.clone(), status);
            }
            late_starts.clear();
            restarts.clear();
            break;
        }
        for (event, done) in revocations.iter_mut() {
            if *done || elapsed < event.at_s {
                continue;
            }
            *done = true;
            tracing::warn!(
                "[CHAOS] revoking the certificate of {} at {:.1} s",
                event.node,
                elapsed
            );
            transport::revoke_nodes(&certs_dir, std::slice::from_ref(&event.node))?;
            revoked_at.insert(event.node.clone(), elapsed);
        }
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
            let pending_start = late_starts.iter().any(|(_, n)| *n == p.name);
            match p.child.as_mut().map(|c| c.try_wait()) {
                Some(Ok(Some(status))) if !pending_restart => {
                    exits.insert(p.name.clone(), status.to_string());
                }
                None if !pending_start && !pending_restart => {
                    exits.insert(p.name.clone(), "not running".into());
                }
                _ => running += 1,
            }
        }
        if running == 0 && restarts.is_empty() && late_starts.is_empty() {
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
    let trainers_seconds = trainers_started.elapsed().as_secs_f64();

    // Let the last deltas land, snapshot the status, stop the aggregators and coordinator.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let status_latency = status_probe.finish().await;
    let mut divergence_warnings = None;
    if let Ok(body) = http_get(status_addr, "/status").await {
        divergence_warnings = serde_json::from_str::<serde_json::Value>(&body)
            .ok()
            .and_then(|v| v["divergence_warnings"].as_u64());
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
    let mut relay_bytes_by_link_class: BTreeMap<String, u64> = BTreeMap::new();
    let mut relay_bytes_by_link: BTreeMap<String, u64> = BTreeMap::new();
    let mut relay_datagrams: BTreeMap<String, u64> = BTreeMap::new();
    for (class, node, r) in relays {
        let s = r.stats();
        relay_dropped += s.up.dropped.total() + s.down.dropped.total();
        *relay_bytes_by_link_class.entry(class).or_default() += s.up.bytes_in + s.down.bytes_in;
        *relay_bytes_by_link.entry(format!("{node}.up")).or_default() += s.up.bytes_in;
        *relay_bytes_by_link
            .entry(format!("{node}.down"))
            .or_default() += s.down.bytes_in;
        for d in [s.up, s.down] {
            for (k, v) in [
                ("datagrams_in", d.datagrams_in),
                ("random_loss", d.dropped.random_loss),
                ("burst_loss", d.dropped.burst_loss),
                ("outage", d.dropped.outage),
                ("queue_full", d.dropped.queue_full),
                ("trace_ended", d.dropped.trace_ended),
            ] {
                *relay_datagrams.entry(k.to_string()).or_default() += v;
            }
        }
        r.shutdown().await;
    }

    // The global model = the persisted layers of the aggregators that are part of the final
    // system (one lost for good left a branch of history that was handed over only up to the
    // coordinator's checkpoint, so its shard is not used); where two shards hold a layer, the
    // newer version wins.
    let mut eval_model = task.build_model(model.seed);
    let read = read_global(&mut eval_model, &layout, &shard_sources(&aggregators))?;
    let (mut ledger, lost_ledger) = (read.ledger, read.lost_ledger);
    let mut nodes = Vec::new();
    for p in &aggregators {
        let dir = out.join(&p.name).join("data");
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
            deltas_acked: 0,
            duplicates_rejected: stats["duplicates_rejected"].as_u64().unwrap_or(0),
            local_accuracy: None,
            undelivered: None,
            undelivered_from_disk: false,
            revoked_at_s: None,
            lost: cluster_health::lost_reason(&exit),
            kills: p.kills,
            exit,
            stopped_at_end: false,
            cached_at_end: None,
            pace_overruns: None,
            steps: None,
            ack_latency: None,
            ack_histogram: None,
            peak_rss_bytes: stats["memory"]["peak_rss_bytes"].as_u64(),
            cpu_seconds: stats["cpu_seconds"].as_f64(),
            fanout_sends: stats["fanout"]["sends"].as_u64(),
            fanout_bytes: stats["fanout"]["bytes"].as_u64(),
            fanout_superseded: stats["fanout"]["superseded"].as_u64(),
            fanout_failed: stats["fanout"]["failed"].as_u64(),
            staleness_histogram: stats["staleness_histogram"]
                .as_array()
                .map(|a| a.iter().filter_map(|v| v.as_u64()).collect())
                .unwrap_or_default(),
        });
    }
    let eval = task.evaluate(&mut eval_model, None);
    if file.cluster.eval_every_s.is_some() {
        // The series ends with the model as it was left, evaluated like every other point.
        let last = task.evaluate(&mut eval_model, Some(file.training.eval_limit));
        series.push(GlobalPoint {
            time_s: trainers_seconds,
            accuracy: last.accuracy,
            loss: last.loss,
            relay_bytes: relay_bytes_by_link_class.values().sum(),
        });
    }
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
        let ack: Option<LatencyHistogram> =
            serde_json::from_value(stats["counters"]["ack_latency"].clone()).ok();
        let stopped_at_end = stopped.contains(&p.name);
        // A trainer stopped at the run's end keeps its backlog: cached at the end, not lost.
        let (undelivered, cached_at_end) = if stopped_at_end {
            (Some(0), undelivered)
        } else {
            (undelivered, None)
        };
        nodes.push(NodeSummary {
            name: p.name.clone(),
            role: p.role.into(),
            relayed: p.relayed,
            bytes_sent: stats["counters"]["bytes_sent"].as_u64().unwrap_or(0),
            weak_sync_events: stats["counters"]["weak_sync_events"].as_u64().unwrap_or(0),
            deltas_applied: 0,
            duplicates_rejected: 0,
            deltas_acked: stats["counters"]["deltas_delivered"].as_u64().unwrap_or(0),
            local_accuracy: stats["final_accuracy"].as_f64(),
            undelivered,
            undelivered_from_disk,
            revoked_at_s: revoked_at.get(&p.name).copied(),
            lost: cluster_health::lost_reason(&exit),
            kills: p.kills,
            exit,
            stopped_at_end,
            cached_at_end,
            pace_overruns: stats["pace"]["overruns"].as_u64(),
            steps: stats["steps"].as_u64(),
            ack_latency: ack.as_ref().and_then(LatencyReport::of),
            ack_histogram: ack,
            peak_rss_bytes: stats["memory"]["peak_rss_bytes"].as_u64(),
            cpu_seconds: stats["cpu_seconds"].as_f64(),
            fanout_sends: None,
            fanout_bytes: None,
            fanout_superseded: None,
            fanout_failed: None,
            staleness_histogram: Vec::new(),
        });
    }
    let mut problems = cluster_health::problems(
        &nodes
            .iter()
            .filter(|n| n.revoked_at_s.is_none())
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
    let mut warnings: Vec<String> = nodes
        .iter()
        .filter_map(|n| {
            let at = n.revoked_at_s?;
            Some(format!(
                "{}'s certificate was revoked at {at:.1} s ([[revoke]]): {} deltas left in its cache, exit {}",
                n.name,
                n.undelivered.map_or("unknown".to_string(), |u| u.to_string()),
                n.exit
            ))
        })
        .collect();
    let ledger_entries = ledger.len() as u64 - ledger_duplicates;
    let deltas_acked: u64 = nodes.iter().map(|n| n.deltas_acked).sum();
    let restarted_any = nodes.iter().any(|n| n.kills > 0);
    if deltas_acked > ledger_entries && !restarted_any {
        // Without restarts every delta is acknowledged once, and only after it was applied
        // and persisted: more acknowledgements than ledger entries means acked deltas are
        // missing from the global model.
        problems.push(format!(
            "the trainers received {deltas_acked} acknowledgements but the aggregators' ledgers hold {ledger_entries} deltas: acknowledged deltas were lost"
        ));
    }
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
    let mut ack_latency = LatencyHistogram::new();
    for n in &nodes {
        if let Some(h) = &n.ack_histogram {
            ack_latency.merge(h);
        }
    }
    let swarm = file.swarm.as_ref().map(|sw| {
        let aggs = nodes.iter().filter(|n| n.role == "aggregator");
        let (bytes, applied) = aggs.fold((0, 0), |(b, a), n| {
            (b + n.fanout_bytes.unwrap_or(0), a + n.deltas_applied)
        });
        let per_delta = (applied > 0).then(|| bytes as f64 / applied as f64);
        SwarmReport {
            clients: sw.clients,
            processes: sw.processes,
            step_ms: sw.step_ms,
            clients_failed: nodes
                .iter()
                .filter(|n| n.role == "swarm")
                .map(|n| swarm_failed(&out.join(&n.name).join("data")))
                .sum(),
            aggregator_bytes_per_applied_delta: per_delta,
            aggregator_bytes_per_applied_delta_per_client: per_delta.map(|b| b / sw.clients as f64),
        }
    });
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
        ledger_entries,
        deltas_acked,
        reapplied_after_loss,
        relay_dropped_datagrams: relay_dropped,
        relay_datagrams,
        wall_seconds: started.elapsed().as_secs_f64(),
        problems,
        warnings,
        series,
        relay_bytes_by_link_class,
        relay_bytes_by_link,
        trainers_seconds,
        trainers_started_unix_s,
        divergence_warnings,
        ack_latency_ms: LatencyReport::of(&ack_latency),
        status_latency_ms: status_latency,
        swarm,
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
