//! `dreamddp cluster SCENARIO`: an edge-kind scenario run as real processes on this machine.
//!
//! The simulator's world is built (not run) for each strategy and read back as an
//! [`EdgePlan`]; the plan becomes a [`ClusterFile`]: a coordinator, the scenario's aggregators
//! (averaging rule of the strategy), and one edge-agent process per cloud node and device, each
//! behind a relay that replays its access link (`[links.*]`: bandwidth or trace, latency,
//! jitter, loss, Gilbert–Elliott bursts, outages), paced to its device class's step time
//! (`slowdown`, `jitter`), with the simulator's first deadline, optimizer and learning-rate
//! schedule. Churn becomes `kill -9` + restart (`crash`) or a late start (`join`). The run stops
//! at the scenario's `max_virtual_s` (or when every trainer is done), and its results are
//! written in the simulator's schema (`summary.json`, `timeseries.csv`, plots), so
//! `dreamddp fidelity` can compare the two.
//!
//! What a real run cannot reproduce, and is said at start: a cloud node is one trainer with its
//! `workers × batch` (as the simulator models it); the aggregators' own access links are not
//! relayed (loopback); with several aggregators each path gets its own relay.

use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context, Result};
use cpu_aggregator::server::config::AggregationSection;
use cpu_aggregator::{Aggregation, AggregatorConfig};
use edge_agent::runtime::config::SyncSection;
use edge_agent::runtime::pacing::PaceSection;
use engine::data::sampler::DataPartition;
use engine::staleness::StalenessFn;
use node::cluster_model::ModelSection;
use node::task::{ModelKind, Task};
use simulations::edge::spec::DeadlineMode;
use simulations::edge::{plan_edge, ChurnAction, EdgePlan, SyncMode};
use simulations::report::{SeriesPoint, SimSummary, StrategyResult};
use simulations::scenario::{Scenario, ScenarioKind, BUILTIN};
use simulations::LinkSpec;

use crate::cluster_cmd::{print_table, run_cluster_file, ClusterArgs, ClusterSummary};
use crate::cluster_file::{
    ChaosEvent, ClusterFile, ClusterSection, EdgeProcess, EdgeRelay, NamedProcess, TrainingDefaults,
};

/// Extra seconds the cluster may run past the scenario's `max_virtual_s` (start-up, the stop).
const TIMEOUT_MARGIN_S: f64 = 120.0;

/// Whether `path` names a scenario rather than a cluster file: a built-in scenario name that
/// is not a file, or a TOML file with a top-level `kind`.
pub fn is_scenario(path: &Path) -> Result<bool> {
    if !path.exists() {
        let name = path.to_string_lossy();
        return Ok(BUILTIN.iter().any(|(n, _)| *n == name));
    }
    let text =
        std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    Ok(toml::from_str::<toml::Table>(&text).is_ok_and(|t| t.contains_key("kind")))
}

/// Strategies a real cluster can run (the others need client rules the edge agent lacks).
pub const REAL_STRATEGIES: &[&str] = &[
    "elastic",
    "blocking",
    "elastic-lossless",
    "fedavg-deadline",
    "fedbuff",
];

/// One strategy's real run: the result in the simulator's schema, and the cluster's summary.
#[derive(Clone, Debug)]
pub struct RealRun {
    /// In the simulator's schema.
    pub result: StrategyResult,
    /// What `cluster` measured.
    pub cluster: ClusterSummary,
}

/// A loaded scenario with its task and the data folder the trainers read.
pub struct LoadedScenario {
    /// The scenario (seed and strategies already overridden).
    pub scenario: Scenario,
    /// Its text (recorded in `summary.json`).
    pub text: String,
    /// Its task (model + data).
    pub task: Task,
    /// The data folder, if any (the embedded digits need none).
    pub data_dir: Option<PathBuf>,
}

/// The flags a scenario run takes besides the scenario (`cluster SCENARIO`, `fidelity`).
#[derive(clap::Args, Debug, Clone, Default)]
pub struct ScenarioOverrides {
    /// Scenario runs: only these strategies (comma-separated; default: the scenario's).
    #[arg(long)]
    pub strategies: Option<String>,
    /// Scenario runs: override the scenario's seed.
    #[arg(long)]
    pub seed: Option<u64>,
    /// Scenario runs: stop each strategy after this many seconds instead of the scenario's
    /// `max_virtual_s` (written into the recorded scenario text).
    #[arg(long)]
    pub max_virtual_s: Option<f64>,
    /// Scenario runs: evaluate the global model every this many seconds instead of the
    /// scenario's `eval_every_s` (both engines; the time to target is read on this grid).
    #[arg(long)]
    pub eval_every_s: Option<f64>,
    /// Scenario runs: folder holding the data sets (default: $DREAMDDP_DATA_DIR, then
    /// ../shared/data/datasets).
    #[arg(long)]
    pub data_dir: Option<PathBuf>,
}

/// Checks a seconds override from `flag` and writes it into the scenario `text` under `key`.
fn override_seconds(text: &mut String, key: &str, flag: &str, seconds: f64) -> Result<f64> {
    if !(seconds.is_finite() && seconds > 0.0) {
        bail!("{flag} {seconds}: must be a positive number of seconds");
    }
    let mut table: toml::Table = toml::from_str(text)?;
    table.insert(key.into(), toml::Value::Float(seconds));
    *text = toml::to_string(&table)?;
    Ok(seconds)
}

/// The relay in front of a scenario node: the same specs, with the relay's queue as deep as
/// the simulator's (see `SCENARIO_QUEUE_MS`) unless the scenario bounds it.
pub fn scenario_relay(up: &LinkSpec, down: &LinkSpec, seed: u64) -> EdgeRelay {
    let (mut up, mut down) = (up.clone(), down.clone());
    for d in [&mut up, &mut down] {
        d.queue_ms = d.queue_ms.or(Some(relay::SCENARIO_QUEUE_MS));
    }
    EdgeRelay { up, down, seed }
}

/// Loads an edge-kind scenario (a file or a built-in name) with the overrides.
pub fn load(name_or_path: &str, overrides: &ScenarioOverrides) -> Result<LoadedScenario> {
    let ScenarioOverrides {
        strategies,
        seed,
        max_virtual_s,
        eval_every_s,
        data_dir,
    } = overrides;
    let (seed, max_virtual_s, data_dir) = (*seed, *max_virtual_s, data_dir.as_deref());
    let (mut scenario, mut text) = Scenario::load(name_or_path)?;
    if scenario.kind != ScenarioKind::Edge {
        bail!(
            "scenario {}: only kind = \"edge\" scenarios run as real clusters (this one is {:?}); \
             use `dreamddp train --compare` for clusters-kind strategies on real threads",
            scenario.name,
            scenario.kind
        );
    }
    if let Some(seed) = seed {
        scenario.seed = seed;
    }
    if let Some(list) = strategies.as_deref() {
        scenario.strategies = list.split(',').map(|s| s.trim().to_string()).collect();
    }
    // Seconds overrides go into the scenario and into its text (summary.json records what ran).
    if let Some(t) = max_virtual_s {
        scenario.max_virtual_s =
            override_seconds(&mut text, "max_virtual_s", "--max-virtual-s", t)?;
    }
    if let Some(e) = *eval_every_s {
        scenario.eval_every_s = override_seconds(&mut text, "eval_every_s", "--eval-every-s", e)?;
    }
    let task = crate::simulate_cmd::build_task(&scenario, data_dir)?;
    let data_dir = data_dir
        .map(Path::to_path_buf)
        .or_else(engine::data::locate::shared_datasets_dir);
    Ok(LoadedScenario {
        scenario,
        text,
        task,
        data_dir,
    })
}

/// `dreamddp cluster SCENARIO`: every strategy of the scenario, one after the other, as real
/// processes; writes the simulator's outputs under `--out` (default `cluster-out/<name>`).
pub fn run(args: &ClusterArgs) -> Result<SimSummary> {
    let loaded = load(&args.file.to_string_lossy(), &args.scenario)?;
    let out = args
        .out
        .clone()
        .unwrap_or_else(|| PathBuf::from("cluster-out").join(&loaded.scenario.name));
    let (summary, runs) = run_all(&loaded, &out)?;
    crate::simulate_cmd::print_table(&summary);
    crate::simulate_cmd::write_outputs(&out, &summary)?;
    let problems: Vec<String> = runs
        .iter()
        .flat_map(|r| {
            r.cluster
                .problems
                .iter()
                .map(move |p| format!("{}: {p}", r.result.strategy))
        })
        .collect();
    println!(
        "wrote the real run's summary.json, timeseries.csv and plots to {}",
        out.display()
    );
    if !problems.is_empty() {
        bail!(
            "the real run of {} finished with {} problem(s):\n  {}",
            summary.scenario,
            problems.len(),
            problems.join("\n  ")
        );
    }
    Ok(summary)
}

/// Runs every strategy of `loaded` for real; each strategy's processes live under
/// `out/<strategy>/`.
pub fn run_all(loaded: &LoadedScenario, out: &Path) -> Result<(SimSummary, Vec<RealRun>)> {
    let s = &loaded.scenario;
    let mut runs = Vec::new();
    for strategy in &s.strategies {
        println!("real run: scenario {} strategy {strategy}", s.name);
        let run = run_strategy(loaded, strategy, &out.join(strategy))?;
        print_table(&run.cluster);
        runs.push(run);
    }
    let summary = SimSummary {
        scenario: s.name.clone(),
        seed: s.seed,
        scenario_toml: loaded.text.clone(),
        target: crate::simulate_cmd::target_text(&loaded.task, s.target),
        strategies: runs.iter().map(|r| r.result.clone()).collect(),
    };
    Ok((summary, runs))
}

/// One strategy as real processes.
pub fn run_strategy(loaded: &LoadedScenario, strategy: &str, out: &Path) -> Result<RealRun> {
    let s = &loaded.scenario;
    if !REAL_STRATEGIES.contains(&strategy) {
        bail!(
            "strategy {strategy}: a real cluster runs {} (the others have no real client rule)",
            REAL_STRATEGIES.join(", ")
        );
    }
    let plan = plan_edge(s, &loaded.task, strategy).map_err(|e| anyhow!("{}: {e}", s.name))?;
    if plan.aggregators.len() > 1 {
        tracing::warn!(
            "[WARN] {} aggregators: each node gets one relay per aggregator path, so a node's \
             access link is modelled once per aggregator (more capacity than the scenario's)",
            plan.aggregators.len()
        );
    }
    let file = cluster_file(loaded, &plan, strategy)?;
    let args = ClusterArgs {
        file: PathBuf::from(&s.name),
        out: Some(out.to_path_buf()),
        clean_links: false,
        steps: None,
        kill: Vec::new(),
        random_kills: 0,
        kill_window_s: 60.0,
        kill_seed: 1,
        scenario: ScenarioOverrides::default(),
    };
    let deadlines: Vec<(String, f64)> = plan
        .nodes
        .iter()
        .map(|n| (n.name.clone(), n.deadline_ms / 1e3))
        .collect();
    let cluster = run_cluster_file(file, &args, &s.base_dir)?;
    let mut result = strategy_result(s, &loaded.task, strategy, &cluster);
    result.timeline =
        crate::real_timeline::timeline(out, &deadlines, cluster.trainers_started_unix_s);
    let overruns: u64 = cluster.nodes.iter().filter_map(|n| n.pace_overruns).sum();
    if overruns > 0 {
        println!(
            "[WARN] {strategy}: {overruns} paced steps took longer than their device class's step \
             time on this machine (see the nodes' pace_overruns in {}/summary.json); the real run is \
             slower than the scenario it stands for",
            out.display()
        );
    }
    Ok(RealRun { result, cluster })
}

/// The cluster file of one strategy's real run.
pub fn cluster_file(
    loaded: &LoadedScenario,
    plan: &EdgePlan,
    strategy: &str,
) -> Result<ClusterFile> {
    let s = &loaded.scenario;
    let edge = s
        .edge
        .as_ref()
        .ok_or_else(|| anyhow!("{}: kind = \"edge\" needs an [edge] table", s.name))?;
    let names: Vec<&str> = plan.nodes.iter().map(|n| n.name.as_str()).collect();
    let mut chaos = Vec::new();
    for c in &plan.churn {
        if !names.contains(&c.node.as_str()) {
            bail!("edge.churn: no node named {:?}", c.node);
        }
        match c.action {
            ChurnAction::Crash => chaos.push(ChaosEvent {
                kill: c.node.clone(),
                at_s: c.at_s,
                down_s: c.back_at_s.map_or(0.0, |b| (b - c.at_s).max(0.0)),
                restart: c.back_at_s.is_some(),
            }),
            ChurnAction::Join => {}
            ChurnAction::Leave => bail!(
                "edge.churn: node {:?} leaves at {} s: a graceful leave is not reproduced by real \
                 runs yet (use action = \"crash\", which they reproduce as kill -9 and restart)",
                c.node,
                c.at_s
            ),
        }
    }
    let mut sync = SyncSection {
        period_steps: s.period,
        max_attempts: edge.max_attempts,
        codec: edge.delta_codec.clone(),
        flush_interval_ms: edge.flush_interval_ms.round().max(1.0) as u64,
        deadline_mode: match edge.deadline_mode {
            DeadlineMode::Adaptive => "adaptive".into(),
            DeadlineMode::Fixed => "fixed".into(),
        },
        wait_for_round: matches!(plan.mode, SyncMode::Blocking | SyncMode::FedAvgDeadline),
        restart_from_global: plan.mode == SyncMode::FedBuff,
        drain_timeout_s: s.max_virtual_s.ceil() as u64,
        ..SyncSection::default()
    };
    if plan.mode == SyncMode::Elastic {
        sync.max_stale_steps = edge.max_stale_steps;
        sync.drift_cosine = edge.drift_cosine;
        sync.lr_damping = edge.lr_damping;
    }
    let edges = plan
        .nodes
        .iter()
        .enumerate()
        .map(|(i, n)| EdgeProcess {
            name: n.name.clone(),
            relay: Some(scenario_relay(
                &n.up,
                &n.down,
                s.seed.wrapping_mul(1000).wrapping_add(i as u64),
            )),
            deadline_ms: Some(n.deadline_ms.round().max(1.0) as u64),
            codec: None,
            transport: None,
            backend: None,
            device: None,
            batch_size: Some(n.batch),
            pace: Some(PaceSection {
                step_ms: n.step_s * n.slowdown.max(f64::MIN_POSITIVE) * 1e3,
                jitter: n.jitter,
                seed: s.seed.wrapping_add(i as u64),
            }),
            start_at_s: n.joins_at_s,
            link_class: Some(n.class.to_string()),
        })
        .collect();
    Ok(ClusterFile {
        cluster: ClusterSection {
            name: format!("{}-{strategy}", s.name),
            credentials: "dreamddp-local-cluster".into(),
            lease_ms: 10_000,
            timeout_s: (s.max_virtual_s + TIMEOUT_MARGIN_S).ceil() as u64,
            stop_after_s: Some(s.max_virtual_s),
            eval_every_s: Some(s.eval_every_s),
            cert_lifetime_days: 365,
            // Paced trainers need their CPU to keep their device class's step time; at a lower
            // priority than the launcher's relays and evaluations they fell further behind
            // (`default`, 240 s: blocking 41.7 % real against 64.5 % at one priority).
            trainer_nice: 0,
        },
        model: ModelSection {
            model: s.model.clone(),
            dataset: loaded.task.dataset.clone(),
            data_dir: loaded.data_dir.clone(),
            seed: s.seed,
            sync_unit_kb: None,
        },
        training: TrainingDefaults {
            steps: s.max_steps,
            batch_size: s.batch,
            lr: plan.schedule.base_lr,
            eval_every: 0,
            eval_limit: s.eval_limit,
            optimizer: Some(plan.optimizer.clone()),
            lr_schedule: Some(plan.schedule),
            // The simulator deals samples as the other trainers do: a new permutation of the
            // whole set every epoch.
            data_partition: Some(DataPartition::Reshuffled),
        },
        sync,
        aggregation: aggregation_section(&plan.aggregator),
        aggregators: plan
            .aggregators
            .iter()
            .map(|a| NamedProcess {
                name: a.name.clone(),
            })
            .collect(),
        workers: Vec::new(),
        edges,
        chaos,
        revoke: Vec::new(),
        divergence: edge.divergence.clone(),
        swarm: None,
    })
}

/// The `[aggregation]` section that makes a real aggregator run `config`.
fn aggregation_section(config: &AggregatorConfig) -> AggregationSection {
    let (staleness, a, b) = match config.staleness {
        StalenessFn::Polynomial { a } => ("poly", a, 0.0),
        StalenessFn::Hinge { a, b } => ("hinge", a, b),
        StalenessFn::Constant => ("constant", 0.0, 0.0),
    };
    AggregationSection {
        staleness: staleness.into(),
        a,
        b,
        tau_max: config.tau_max,
        round_size: config.round_size,
        round_timeout_ms: config.round_timeout_ns.div_ceil(1_000_000),
        outer_lr: config.outer_lr,
        outer_lr_scaling: config.outer_lr_scaling,
        rule: match config.aggregation {
            Aggregation::Buffered => "fedbuff".into(),
            Aggregation::WeightedMean => "mean".into(),
        },
        min_round_senders: config.min_round_senders,
        broadcast_interval_ms: 0,
        // The simulator's aggregator sends every version at once: so does this one.
        fanout_per_layer_per_s: 0,
    }
}

/// A real run's result in the simulator's schema. Times are wall seconds since the trainers
/// were started; `bytes_sent` counts what the senders put on the relayed links (the
/// relays' `bytes_in`: QUIC headers, acknowledgements and datagrams the link lost included) on the nodes' access links, which is what the simulator's
/// `cloud` + `edge` classes count (its `aggregator` class has no relay here). `mean_step_s`
/// is the run's wall time over each trainer's steps, waiting and draining included (the
/// simulator's counts compute only; `fidelity` does not compare it).
pub fn strategy_result(
    s: &Scenario,
    task: &Task,
    strategy: &str,
    c: &ClusterSummary,
) -> StrategyResult {
    let lm = matches!(task.model, ModelKind::GptTiny);
    let series: Vec<SeriesPoint> = c
        .series
        .iter()
        .map(|p| SeriesPoint {
            time_s: p.time_s,
            accuracy: if lm { None } else { p.accuracy },
            loss: p.loss,
            bytes_sent: p.relay_bytes,
            access_bytes: Some(p.relay_bytes),
            mean_steps: 0.0,
            divergence: None,
        })
        .collect();
    let reached = |p: &SeriesPoint| match p.accuracy {
        Some(a) if !lm => a >= s.target,
        _ => lm && p.loss <= s.target,
    };
    let time_to_target_s = series.iter().find(|p| reached(p)).map(|p| p.time_s);
    let last = series.last();
    let trainers: Vec<_> = c.nodes.iter().filter(|n| n.role == "edge").collect();
    let steps: Vec<u64> = trainers.iter().filter_map(|n| n.steps).collect();
    let mean_step_s = if steps.is_empty() {
        0.0
    } else {
        steps
            .iter()
            .filter(|&&n| n > 0)
            .map(|&n| c.trainers_seconds / n as f64)
            .sum::<f64>()
            / steps.len() as f64
    };
    let mut staleness = std::collections::BTreeMap::new();
    for n in &c.nodes {
        for (tau, &count) in n.staleness_histogram.iter().enumerate() {
            if count > 0 {
                *staleness.entry(tau as u64).or_insert(0) += count;
            }
        }
    }
    StrategyResult {
        strategy: strategy.to_string(),
        time_to_target_s,
        final_accuracy: last.and_then(|p| p.accuracy),
        final_loss: last.map_or(c.final_loss, |p| p.loss),
        virtual_seconds: c.trainers_seconds,
        bytes_sent: c.relay_bytes_by_link_class.values().sum(),
        bytes_by_link_class: c.relay_bytes_by_link_class.clone(),
        bytes_by_link: c.relay_bytes_by_link.clone(),
        weak_sync_events: c.weak_sync_events,
        undelivered_deltas: trainers.iter().filter_map(|n| n.undelivered).sum(),
        cached_at_end: trainers.iter().filter_map(|n| n.cached_at_end).sum(),
        staleness_histogram: staleness,
        mean_step_s,
        wall_seconds: c.wall_seconds,
        series,
        // Filled from the trainers' logs by `run_strategy` (`crate::real_timeline`).
        timeline: Vec::new(),
        plan_candidates: Vec::new(),
        divergence_warnings: c.divergence_warnings.unwrap_or(0),
        divergence_peak: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn smoke(strategy: &str) -> (LoadedScenario, EdgePlan, ClusterFile) {
        let loaded = load(
            "fidelity-smoke",
            &ScenarioOverrides {
                strategies: Some(strategy.into()),
                max_virtual_s: Some(30.0),
                ..ScenarioOverrides::default()
            },
        )
        .unwrap();
        let plan = plan_edge(&loaded.scenario, &loaded.task, strategy).unwrap();
        let file = cluster_file(&loaded, &plan, strategy).unwrap();
        (loaded, plan, file)
    }

    #[test]
    fn the_evaluation_grid_can_be_overridden_for_both_engines() {
        let loaded = load(
            "fidelity-smoke",
            &ScenarioOverrides {
                eval_every_s: Some(0.5),
                ..ScenarioOverrides::default()
            },
        )
        .unwrap();
        assert_eq!(loaded.scenario.eval_every_s, 0.5);
        assert!(
            loaded.text.contains("eval_every_s = 0.5"),
            "{}",
            loaded.text
        );
        let bad = load(
            "fidelity-smoke",
            &ScenarioOverrides {
                eval_every_s: Some(0.0),
                ..ScenarioOverrides::default()
            },
        )
        .err()
        .expect("zero is refused");
        assert!(bad.to_string().contains("--eval-every-s"), "{bad}");
    }

    #[test]
    fn scenarios_and_cluster_files_are_told_apart() {
        assert!(is_scenario(Path::new("fidelity-smoke")).unwrap());
        assert!(!is_scenario(Path::new("no-such-scenario")).unwrap());
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        assert!(is_scenario(&root.join("simulations/scenarios/default.toml")).unwrap());
        assert!(!is_scenario(&root.join("examples/cluster-lossy.toml")).unwrap());
    }

    #[test]
    fn the_cluster_file_carries_the_simulators_numbers() {
        let (loaded, plan, file) = smoke("elastic");
        let s = &loaded.scenario;
        assert_eq!(file.edges.len(), 3);
        assert_eq!(file.cluster.stop_after_s, Some(30.0), "--max-virtual-s");
        assert!(loaded.text.contains("max_virtual_s = 30"), "recorded");
        for (e, n) in file.edges.iter().zip(&plan.nodes) {
            let pace = e.pace.as_ref().unwrap();
            // Jetson Orin × slowdown 100: about 0.1 s per step.
            assert!((pace.step_ms - n.step_s * 100.0 * 1e3).abs() < 1e-9);
            assert!((50.0..200.0).contains(&pace.step_ms), "{}", pace.step_ms);
            assert_eq!(pace.jitter, 0.2);
            assert_eq!(e.deadline_ms, Some(n.deadline_ms.round() as u64));
            assert!(e.deadline_ms.unwrap() > 500, "slack + transfer time");
            assert_eq!(e.batch_size, Some(s.batch));
            let relay = e.relay.as_ref().unwrap();
            assert_eq!(relay.up.latency_ms, n.up.latency_ms);
            assert_eq!(relay.up.loss, n.up.loss);
        }
        // edge-0 and edge-2 on the LTE traces, edge-1 on the constant link.
        assert!(file.edges[0].relay.as_ref().unwrap().up.trace.is_some());
        assert!(file.edges[1].relay.as_ref().unwrap().up.bandwidth.is_some());
        assert!(!file.sync.wait_for_round);
        assert_eq!(file.aggregation.round_size, 1);
        assert_eq!(file.aggregation.outer_lr, 1.0);
        assert_eq!(
            file.aggregation.outer_lr_scaling,
            cpu_aggregator::OuterLrScaling::Contributors
        );
        assert_eq!(file.training.lr_schedule, Some(plan.schedule));
    }

    #[test]
    fn blocking_waits_for_rounds_of_every_node() {
        let (_, _, file) = smoke("blocking");
        assert!(file.sync.wait_for_round);
        assert_eq!(file.aggregation.round_size, 3);
        assert_eq!(file.aggregation.outer_lr, 1.0);
        assert_eq!(
            file.aggregation.outer_lr_scaling,
            cpu_aggregator::OuterLrScaling::Fixed
        );
        assert_eq!(file.aggregation.rule, "mean");
    }

    #[test]
    fn fedbuff_restarts_rounds_from_the_global_model_on_a_buffered_aggregator() {
        let (_, _, file) = smoke("fedbuff");
        assert!(file.sync.restart_from_global && !file.sync.wait_for_round);
        assert_eq!(file.aggregation.rule, "fedbuff");
        let (_, _, elastic) = smoke("elastic");
        assert!(!elastic.sync.restart_from_global);
    }

    #[test]
    fn strategies_without_a_real_client_rule_are_refused_clearly() {
        let loaded = load("fidelity-smoke", &ScenarioOverrides::default()).unwrap();
        let err = run_strategy(&loaded, "gossip", Path::new("/nonexistent"))
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("gossip") && err.contains("fedbuff"), "{err}");
        let err = load("two-datacenters", &ScenarioOverrides::default())
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("kind = \"edge\""), "{err}");
    }
}
