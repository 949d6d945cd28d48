//! The cluster file of `dreamddp cluster FILE.toml` ([`ClusterFile`]): the cluster, the model,
//! the trainers' defaults, the aggregators, worker nodes and edge agents (each edge optionally
//! behind a lossy relay, paced to a device class, or joining late), and the `[[chaos]]` plan;
//! plus its validation and the link figures an edge's transport is sized from.

use std::path::Path;

use anyhow::{bail, Context, Result};
use cpu_aggregator::server::config::AggregationSection;
use edge_agent::runtime::config::SyncSection;
use edge_agent::runtime::pacing::PaceSection;
use node::cluster_model::ModelSection;
use relay::RelayLinkSpec;
use serde::Deserialize;
use transport::config::TransportSection;

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
    /// Certificates to revoke while the cluster trains (`[[revoke]]`).
    #[serde(default)]
    pub revoke: Vec<RevokeEvent>,
    /// The coordinator's divergence monitor (`coordinator::DivergenceConfig`).
    #[serde(default)]
    pub divergence: coordinator::DivergenceConfig,
    /// A load-test swarm of synthetic edge clients (`dreamddp swarm` processes).
    #[serde(default)]
    pub swarm: Option<SwarmSpec>,
}

/// `[swarm]`: `clients` lightweight edge clients in `processes` processes, each the real sync
/// client with its own QUIC connections, certificate (`swarm-0001`, ...) and durable cache,
/// taking a synthetic step every `step_ms` for `[training] steps` steps (see
/// `edge_agent::runtime::swarm`).
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SwarmSpec {
    /// Clients in all.
    pub clients: usize,
    /// Processes they are spread over.
    #[serde(default = "default_swarm_processes")]
    pub processes: usize,
    /// Milliseconds between two synthetic steps of one client.
    pub step_ms: u64,
    /// Driver threads per process.
    #[serde(default = "default_swarm_threads")]
    pub driver_threads: usize,
    /// Network (tokio) threads per process.
    #[serde(default = "default_swarm_threads")]
    pub network_threads: usize,
    /// Joins of one process are spread over this many milliseconds.
    #[serde(default = "default_join_spread_ms")]
    pub join_spread_ms: u64,
    /// The swarm processes' CPU niceness (0–19; default 10): they stand in for devices on
    /// other machines, so on this one they yield the CPU to the coordinator and the
    /// aggregators under test. 0 runs them at the servers' priority.
    #[serde(default = "default_swarm_nice")]
    pub nice: i32,
    /// QUIC settings of every client (default: the windows of a constrained edge device,
    /// [`SwarmSpec::default_transport`]).
    #[serde(default)]
    pub transport: Option<TransportSection>,
}

fn default_swarm_processes() -> usize {
    2
}
fn default_swarm_threads() -> usize {
    2
}
fn default_swarm_nice() -> i32 {
    10
}
fn default_join_spread_ms() -> u64 {
    2_000
}

impl SwarmSpec {
    /// The name of swarm client `i` (0-based) of `clients`.
    pub fn client_name(i: usize) -> String {
        format!("swarm-{:04}", i + 1)
    }

    /// The clients' QUIC settings when `[swarm.transport]` is absent: 2 MiB per stream and
    /// 4 MiB per connection each way, what a constrained device would give a connection
    /// (the process default of 16/64 MiB lets each of a thousand connections buffer tens of
    /// megabytes of versions it has not read yet), and Ethernet-sized UDP payloads (each
    /// endpoint's receive buffer is sized from the largest payload: 2 MiB at quinn's default).
    pub fn default_transport() -> TransportSection {
        TransportSection {
            stream_receive_window: Some(transport::EDGE_STREAM_WINDOW),
            receive_window: Some(transport::EDGE_CONNECTION_WINDOW),
            send_window: Some(transport::EDGE_CONNECTION_WINDOW),
            max_udp_payload: Some(1472),
            ..TransportSection::default()
        }
    }

    /// The name of swarm process `p` (0-based).
    pub fn process_name(p: usize) -> String {
        format!("swarm-proc-{}", p + 1)
    }
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
    /// Stop the run this many seconds after the trainers started (a scenario's
    /// `max_virtual_s`): trainers still running are stopped on purpose, and what their caches
    /// hold is reported as cached at the end, not as lost. Absent: run until they finish.
    #[serde(default)]
    pub stop_after_s: Option<f64>,
    /// Evaluate the global model (the aggregators' persisted layers) every this many seconds
    /// into `summary.json`'s `series` (absent: only at the end).
    #[serde(default)]
    pub eval_every_s: Option<f64>,
    /// Lifetime of the node certificates the launcher creates, days.
    #[serde(default = "default_cert_lifetime_days")]
    pub cert_lifetime_days: u32,
    /// CPU niceness of the trainers (edge agents and worker nodes; 0–19, default 10). The
    /// launcher runs every process on this machine, where the trainers stand in for devices
    /// and nodes with CPUs of their own: at a lower priority they leave the coordinator and
    /// the aggregators the CPU they would have on their own machines. 0: every process at
    /// the same priority.
    #[serde(default = "default_trainer_nice")]
    pub trainer_nice: i32,
}

/// The trainers' niceness when `[cluster] trainer_nice` is not given.
fn default_trainer_nice() -> i32 {
    10
}

fn default_cert_lifetime_days() -> u32 {
    365
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
    /// Test examples per local evaluation (and per evaluation of the `series`).
    #[serde(default = "default_eval_limit")]
    pub eval_limit: usize,
    /// Optimizer of every trainer (default SGD with momentum 0.9).
    #[serde(default)]
    pub optimizer: Option<engine::optim::OptimizerConfig>,
    /// Learning-rate schedule of every trainer (replaces the constant `lr`).
    #[serde(default)]
    pub lr_schedule: Option<engine::lr::LrSchedule>,
    /// How training samples are dealt to the trainers: `fixed` (each rank keeps its own
    /// shard and its process holds only that) or `reshuffled` (a new permutation of the
    /// whole set every epoch; every process holds all of it). Unset: `fixed` for edges
    /// (a device owns its data), `reshuffled` for worker nodes.
    #[serde(default)]
    pub data_partition: Option<engine::data::sampler::DataPartition>,
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
    /// This edge's batch size (default: `[training] batch_size`).
    #[serde(default)]
    pub batch_size: Option<usize>,
    /// Pad every step to a device class's step time (`[edges.pace]`, see `[training.pace]`).
    #[serde(default)]
    pub pace: Option<PaceSection>,
    /// Start this edge this many seconds after the other trainers (a late joiner).
    #[serde(default)]
    pub start_at_s: Option<f64>,
    /// Class of its access link in the byte counts (`edge` by default; `cloud` for a cloud
    /// node run as a trainer of its own).
    #[serde(default)]
    pub link_class: Option<String>,
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
pub fn direction_mbps(spec: &RelayLinkSpec, base_dir: &Path) -> Result<Option<f64>> {
    if let Some(b) = spec.bandwidth {
        return Ok(Some(b.bits_per_sec() as f64 / 1e6));
    }
    let mut spec = spec.clone();
    spec.resolve_paths(base_dir);
    let Some(trace) = spec.load_trace().context("relay trace")? else {
        return Ok(None);
    };
    if trace.period().0 == 0 {
        return Ok(None);
    }
    Ok(Some(trace.mean_bits_per_sec() / 1e6))
}

/// An edge's `[transport]`: its explicit keys, with `link_mbps`/`rtt_ms` filled in from
/// the relay in front of it (if any, and links are not clean) when not given.
pub fn edge_transport(
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

/// `[[revoke]]`: revoke a trainer's certificate `at_s` seconds after the trainers started, as
/// `dreamddp certs --revoke NAME` would (the coordinator and every aggregator refuse it from
/// then on; what it still holds is reported, not counted as a problem).
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RevokeEvent {
    /// Worker or edge name.
    pub node: String,
    /// When, seconds after the trainers started.
    pub at_s: f64,
}

fn default_restart() -> bool {
    true
}

fn default_down() -> f64 {
    1.0
}

/// A CPU niceness a process may set for itself: 0 (unchanged) to 19 (the lowest); the
/// error names `key`.
pub fn check_niceness(key: &str, nice: i32) -> Result<()> {
    if !(0..=19).contains(&nice) {
        bail!(
            "{key} = {nice}: must be 0 (the servers' priority) to 19 (the lowest); raising a \
             process's priority needs privileges"
        );
    }
    Ok(())
}

/// Checks names, references and counts (the error says what to change).
pub fn validate(file: &ClusterFile) -> Result<()> {
    if file.aggregators.is_empty() {
        bail!("[[aggregators]]: a cluster needs at least one aggregator");
    }
    if file.workers.is_empty() && file.edges.is_empty() && file.swarm.is_none() {
        bail!("a cluster needs at least one [[workers]] or [[edges]] entry, or a [swarm]");
    }
    check_niceness("[cluster] trainer_nice", file.cluster.trainer_nice)?;
    if let Some(s) = &file.swarm {
        if s.clients == 0 || s.processes == 0 || s.processes > s.clients {
            bail!(
                "[swarm] clients = {}, processes = {}: need at least one client and one process, and no more processes than clients",
                s.clients,
                s.processes
            );
        }
        if s.step_ms == 0 || s.driver_threads == 0 || s.network_threads == 0 {
            bail!("[swarm] step_ms, driver_threads and network_threads must be at least 1");
        }
        check_niceness("[swarm] nice", s.nice)?;
    }
    file.divergence.validate().map_err(anyhow::Error::msg)?;
    let mut names: Vec<&str> = vec!["coordinator"];
    names.extend(file.aggregators.iter().map(|a| a.name.as_str()));
    names.extend(file.workers.iter().map(|w| w.name.as_str()));
    names.extend(file.edges.iter().map(|e| e.name.as_str()));
    let swarm_names: Vec<String> = file.swarm.as_ref().map_or(Vec::new(), |s| {
        (0..s.processes).map(SwarmSpec::process_name).collect()
    });
    names.extend(swarm_names.iter().map(String::as_str));
    if file.swarm.is_some() {
        if let Some(n) = names[1..]
            .iter()
            .find(|n| n.starts_with("swarm-") && !swarm_names.iter().any(|s| s == *n))
        {
            bail!(
                "node name {n:?}: names starting with \"swarm-\" are the [swarm]'s own; rename it"
            );
        }
    }
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
    for r in &file.revoke {
        let trainer = file.workers.iter().any(|w| w.name == r.node)
            || file.edges.iter().any(|e| e.name == r.node);
        if !trainer {
            bail!(
                "[[revoke]] node = {:?}: no worker or edge has that name",
                r.node
            );
        }
        if !(r.at_s.is_finite() && r.at_s >= 0.0) {
            bail!(
                "[[revoke]] {}: at_s = {}: must be seconds >= 0",
                r.node,
                r.at_s
            );
        }
    }
    if file.cluster.cert_lifetime_days == 0 {
        bail!("[cluster] cert_lifetime_days = 0: certificates must be valid for at least 1 day");
    }
    for e in &file.edges {
        if let Some(p) = &e.pace {
            p.validate().map_err(|(key, value, why)| {
                anyhow::anyhow!("[[edges]] {}: {key} = {value}: {why}", e.name)
            })?;
        }
        if let Some(t) = e.start_at_s {
            if !(t.is_finite() && t >= 0.0) {
                bail!(
                    "[[edges]] {}: start_at_s = {t}: must be a number of seconds >= 0",
                    e.name
                );
            }
        }
        if e.batch_size == Some(0) {
            bail!("[[edges]] {}: batch_size must be at least 1", e.name);
        }
    }
    if let Some(t) = file.cluster.stop_after_s {
        if !(t.is_finite() && t > 0.0) {
            bail!("[cluster] stop_after_s = {t}: must be a positive number of seconds");
        }
    }
    if let Some(t) = file.cluster.eval_every_s {
        if !(t.is_finite() && t > 0.0) {
            bail!("[cluster] eval_every_s = {t}: must be a positive number of seconds");
        }
    }
    for w in &file.workers {
        if w.workers == 0 {
            bail!("[[workers]] {}: workers must be at least 1", w.name);
        }
    }
    Ok(())
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

    #[test]
    fn a_swarm_niceness_outside_0_to_19_is_refused_by_name() {
        let text = |nice: i32| {
            format!(
                "[cluster]\nname = \"s\"\n[model]\nmodel = \"mlp\"\ndataset = \"digits\"\n\
                 [training]\nsteps = 4\n[[aggregators]]\nname = \"agg-1\"\n\
                 [swarm]\nclients = 2\nstep_ms = 100\nprocesses = 1\nnice = {nice}\n"
            )
        };
        let file: ClusterFile = toml::from_str(&text(10)).unwrap();
        validate(&file).unwrap();
        for bad in [-5, 20] {
            let file: ClusterFile = toml::from_str(&text(bad)).unwrap();
            let e = validate(&file).unwrap_err().to_string();
            assert!(e.contains("[swarm] nice"), "{e}");
        }
        let default: ClusterFile = toml::from_str(&text(0).replace("nice = 0\n", "")).unwrap();
        assert_eq!(default.swarm.unwrap().nice, 10);
    }

    #[test]
    fn trainer_niceness_defaults_to_10_and_outside_0_to_19_is_refused_by_name() {
        let text = |nice: &str| {
            format!(
                "[cluster]\nname = \"t\"\n{nice}[model]\nmodel = \"mlp\"\ndataset = \"digits\"\n\
                 [training]\nsteps = 4\n[[aggregators]]\nname = \"agg-1\"\n\
                 [[edges]]\nname = \"edge-1\"\n"
            )
        };
        let default: ClusterFile = toml::from_str(&text("")).unwrap();
        validate(&default).unwrap();
        assert_eq!(default.cluster.trainer_nice, 10);
        assert_eq!(default.training.data_partition, None);
        // The data partition is read by name, and a wrong name is refused naming the right ones.
        let with_partition = |name: &str| {
            toml::from_str::<ClusterFile>(&text("").replace(
                "[training]\n",
                &format!("[training]\ndata_partition = \"{name}\"\n"),
            ))
        };
        assert_eq!(
            with_partition("fixed").unwrap().training.data_partition,
            Some(engine::data::sampler::DataPartition::Fixed)
        );
        let wrong = with_partition("local").unwrap_err().to_string();
        assert!(wrong.contains("reshuffled"), "{wrong}");
        for bad in [-1, 20] {
            let file: ClusterFile =
                toml::from_str(&text(&format!("trainer_nice = {bad}\n"))).unwrap();
            let e = validate(&file).unwrap_err().to_string();
            assert!(e.contains("[cluster] trainer_nice"), "{e}");
        }
    }
}
