//! `dreamddp fidelity SCENARIO`: runs an edge-kind scenario in the simulator and as real
//! processes on this machine (`cluster SCENARIO`), and measures how far apart they are per
//! strategy: time-to-target error, final-accuracy difference, bytes error on the nodes' access
//! links, weak-sync events both ways, and the total-variation distance between the staleness
//! histograms. Writes `fidelity.json`, `accuracy_overlay.svg` (simulated and real accuracy
//! against time on one chart), and both runs' own outputs under `sim/` and `real/`.
//!
//! Signs: every error is `(simulated − real) / real`, so a negative time error means the
//! simulator predicts reaching the target sooner than the real run did.
//!
//! Real runs on a shared machine over lossy links vary from run to run (FedBuff's final
//! accuracy on `fidelity-smoke` spread over 19 points in three runs), so `--real-runs N`
//! repeats the real side: each cell is then compared with the real runs' typical value (the
//! median time to target when most runs reached it, the mean of the rest), every run's own
//! comparison is kept in `fidelity.json` (`runs`), and the table prints each run's range.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Result};
use clap::Args;
use serde::Serialize;
use simulations::report::{SimSummary, StrategyResult};

use crate::fidelity_print::{print_report, secs};
use crate::fidelity_seeds::mean;
use crate::plots::{line_chart, Series};
use crate::scenario_cluster::{self, LoadedScenario};
use crate::train_cmd::write_json;

/// Staleness at or above this is one bucket (the real aggregators' histogram ends there).
const STALENESS_CAP: u64 = 16;

/// Flags of `fidelity`.
#[derive(Args, Debug, Clone)]
pub struct FidelityArgs {
    /// Built-in scenario name or an edge-kind scenario file.
    #[arg(default_value = "fidelity-smoke")]
    pub scenario: String,
    /// Output folder (default `fidelity-out/<scenario>/`).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// `--strategies` (default: the scenario's that a real cluster can run), `--seed`,
    /// `--max-virtual-s` (both engines), `--data-dir`.
    #[command(flatten)]
    pub overrides: crate::scenario_cluster::ScenarioOverrides,
    /// Fail unless |time-to-target error| ≤ this fraction for every strategy where both
    /// reached the target (and both or neither reached it).
    #[arg(long)]
    pub max_time_error: Option<f64>,
    /// Fail unless |final-accuracy difference| ≤ this many points for every strategy.
    #[arg(long)]
    pub max_accuracy_diff: Option<f64>,
    /// Fail unless |bytes error| ≤ this fraction for every strategy.
    #[arg(long)]
    pub max_bytes_error: Option<f64>,
    /// Real runs per strategy (each cell is compared with their typical value); 0: the
    /// simulated side alone (its typical run and spread over `--sim-seeds`, printed and written
    /// to `sim/`), e.g. to see what a change to the model moves before recording real runs.
    #[arg(long, default_value_t = 1)]
    pub real_runs: usize,
    /// Compare with the real run recorded in this earlier `fidelity --out` folder (its
    /// `real/`) instead of running the cluster again: a re-check after a change to the
    /// simulator. It must have been recorded with the same scenario text (same flags); the
    /// report names it (`real_from`).
    #[arg(long)]
    pub real_from: Option<PathBuf>,
    /// Simulated runs per strategy, with network seeds SEED, SEED+1, …: each cell compares
    /// their typical run (median time to target, mean accuracy and bytes) with the real one, and
    /// the report prints their spread. The relays draw their own losses, so one network seed is
    /// one draw of the network (links, compute jitter), as one real run is another; the model's
    /// initial values and the data's order stay SEED's in every run, as in the real ones.
    #[arg(long, default_value_t = 1)]
    pub sim_seeds: usize,
}

/// One strategy's comparison in `fidelity.json`.
#[derive(Clone, Debug, Serialize)]
pub struct StrategyFidelity {
    /// Strategy.
    pub strategy: String,
    /// Simulated time to target, seconds (`None`: never).
    pub sim_time_to_target_s: Option<f64>,
    /// Real time to target, wall seconds since the trainers started (`None`: never).
    pub real_time_to_target_s: Option<f64>,
    /// `(sim − real) / real`; `None` when either never reached the target.
    pub time_to_target_error: Option<f64>,
    /// Final accuracy, simulated (0..1).
    pub sim_final_accuracy: Option<f64>,
    /// Final accuracy, real.
    pub real_final_accuracy: Option<f64>,
    /// `(sim − real) · 100`, points.
    pub final_accuracy_diff: Option<f64>,
    /// Bytes on the nodes' access links (the simulator's `cloud` + `edge` classes), simulated.
    pub sim_bytes: u64,
    /// Bytes the real nodes put on their access links (what the relays received: QUIC headers,
    /// acknowledgements and the datagrams the link then lost included).
    pub real_bytes: u64,
    /// `(sim − real) / real`.
    pub bytes_error: Option<f64>,
    /// Weak-sync events, simulated.
    pub sim_weak_sync_events: u64,
    /// Weak-sync events, real.
    pub real_weak_sync_events: u64,
    /// Total-variation distance between the two staleness histograms (τ ≥ 16 in one bucket),
    /// 0 (identical) … 1 (disjoint); `None` when either applied nothing.
    pub staleness_distance: Option<f64>,
    /// Deltas left undelivered, real (must be 0).
    pub real_undelivered: u64,
    /// Paced steps whose real compute overran their device class's step time.
    pub real_pace_overruns: u64,
    /// What made the real run not clean, if anything.
    pub real_problems: Vec<String>,
    /// Real runs this row summarizes (1 unless `--real-runs`).
    pub real_runs: usize,
    /// With `--sim-seeds K > 1`: the simulated cells of each seed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sim_spread: Option<crate::fidelity_seeds::SimSpread>,
    /// Bytes per relayed access link (`NODE.up`, `NODE.down`) in both engines, for the links
    /// both recorded (empty when either did not: a report from before they were counted).
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub links: BTreeMap<String, LinkBytes>,
    /// The time every simulated seed and real run took to reach the lowest final accuracy any
    /// of them reached, compared ([`crate::fidelity_pace`]): the pace of a strategy whose runs
    /// end before the target. In the aggregated rows only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pace: Option<crate::fidelity_pace::Pace>,
    /// When the real runs typically reach the target and the simulated seeds do not by the
    /// scenario's end: the seeds' time to target run on past it
    /// ([`crate::fidelity_past_cutoff`]). In the aggregated rows only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub past_cutoff: Option<crate::fidelity_past_cutoff::PastCutoff>,
}

/// One access link's bytes in both engines.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct LinkBytes {
    /// Simulated (retransmissions included).
    pub sim: u64,
    /// Put on the link by the real senders (what the relays received: QUIC headers,
    /// acknowledgements and lost datagrams included).
    pub real: u64,
    /// `(sim − real) / real`.
    pub error: Option<f64>,
}

/// The links both results counted, with both counts.
fn link_bytes(sim: &StrategyResult, real: &StrategyResult) -> BTreeMap<String, LinkBytes> {
    sim.bytes_by_link
        .iter()
        .filter_map(|(name, &s)| {
            let &r = real.bytes_by_link.get(name)?;
            Some((
                name.clone(),
                LinkBytes {
                    sim: s,
                    real: r,
                    error: signed_error(s as f64, r as f64),
                },
            ))
        })
        .collect()
}

/// `fidelity.json`.
#[derive(Clone, Debug, Serialize)]
pub struct FidelityReport {
    /// Scenario.
    pub scenario: String,
    /// Seed.
    pub seed: u64,
    /// Target.
    pub target: String,
    /// Per strategy (against the real runs' typical values when there were several).
    pub strategies: Vec<StrategyFidelity>,
    /// With `--real-runs N > 1`: per real run, each strategy compared with that run alone.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub runs: Vec<Vec<StrategyFidelity>>,
    /// Wall seconds of the simulation and of the real runs.
    pub sim_wall_seconds: f64,
    /// Wall seconds of the real runs.
    pub real_wall_seconds: f64,
    /// The earlier output folder whose real run this report reuses (`--real-from`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub real_from: Option<String>,
}

/// Bytes on the nodes' access links of a result.
fn access_bytes(r: &StrategyResult) -> u64 {
    simulations::report::access_link_bytes(&r.bytes_by_link_class)
}

fn capped(h: &BTreeMap<u64, u64>) -> BTreeMap<u64, f64> {
    let total: u64 = h.values().sum();
    let mut out = BTreeMap::new();
    if total == 0 {
        return out;
    }
    for (&tau, &n) in h {
        *out.entry(tau.min(STALENESS_CAP)).or_insert(0.0) += n as f64 / total as f64;
    }
    out
}

/// Total-variation distance `½ Σ |p − q|` between two staleness histograms.
pub fn staleness_distance(a: &BTreeMap<u64, u64>, b: &BTreeMap<u64, u64>) -> Option<f64> {
    let (p, q) = (capped(a), capped(b));
    if p.is_empty() || q.is_empty() {
        return None;
    }
    let keys: std::collections::BTreeSet<u64> = p.keys().chain(q.keys()).copied().collect();
    Some(
        0.5 * keys
            .iter()
            .map(|k| (p.get(k).unwrap_or(&0.0) - q.get(k).unwrap_or(&0.0)).abs())
            .sum::<f64>(),
    )
}

/// `(sim − real) / real`, `None` without a real value.
pub(crate) fn signed_error(sim: f64, real: f64) -> Option<f64> {
    (real > 0.0).then(|| (sim - real) / real)
}

/// Compares one strategy's simulated and real results.
pub fn compare(sim: &StrategyResult, real: &scenario_cluster::RealRun) -> StrategyFidelity {
    compare_results(
        sim,
        &real.result,
        real.cluster
            .nodes
            .iter()
            .filter_map(|n| n.pace_overruns)
            .sum(),
        real.cluster.problems.clone(),
    )
}

/// Compares one strategy's simulated result with a real one (in the simulator's schema), given
/// the real run's pace overruns and problems.
pub fn compare_results(
    sim: &StrategyResult,
    r: &StrategyResult,
    real_pace_overruns: u64,
    real_problems: Vec<String>,
) -> StrategyFidelity {
    let time_to_target_error = match (sim.time_to_target_s, r.time_to_target_s) {
        (Some(s), Some(t)) => signed_error(s, t),
        _ => None,
    };
    let final_accuracy_diff = match (sim.final_accuracy, r.final_accuracy) {
        (Some(s), Some(t)) => Some((s - t) * 100.0),
        _ => None,
    };
    let (sim_bytes, real_bytes) = (access_bytes(sim), r.bytes_sent);
    StrategyFidelity {
        strategy: sim.strategy.clone(),
        sim_time_to_target_s: sim.time_to_target_s,
        real_time_to_target_s: r.time_to_target_s,
        time_to_target_error,
        sim_final_accuracy: sim.final_accuracy,
        real_final_accuracy: r.final_accuracy,
        final_accuracy_diff,
        sim_bytes,
        real_bytes,
        bytes_error: signed_error(sim_bytes as f64, real_bytes as f64),
        sim_weak_sync_events: sim.weak_sync_events,
        real_weak_sync_events: r.weak_sync_events,
        staleness_distance: staleness_distance(&sim.staleness_histogram, &r.staleness_histogram),
        real_undelivered: r.undelivered_deltas,
        real_pace_overruns,
        real_problems,
        real_runs: 1,
        sim_spread: None,
        links: link_bytes(sim, r),
        pace: None,
        past_cutoff: None,
    }
}

/// One strategy's comparison with several real runs (`runs`: each compared alone, the same
/// simulated values in each): the real time to target is the median of the runs that reached
/// it when more than half did (else never), the other real cells are means; the errors are
/// recomputed against these. Problems are kept per run.
pub fn aggregate(runs: &[StrategyFidelity]) -> StrategyFidelity {
    let first = &runs[0];
    if runs.len() == 1 {
        return first.clone();
    }
    let real_time_to_target_s = crate::fidelity_seeds::typical_time_to_target(
        &runs
            .iter()
            .map(|r| r.real_time_to_target_s)
            .collect::<Vec<_>>(),
    );
    let accuracies: Vec<f64> = runs.iter().filter_map(|r| r.real_final_accuracy).collect();
    let real_final_accuracy = mean(&accuracies);
    let bytes: Vec<f64> = runs.iter().map(|r| r.real_bytes as f64).collect();
    let real_bytes = mean(&bytes).unwrap_or(0.0).round() as u64;
    let weak: Vec<f64> = runs
        .iter()
        .map(|r| r.real_weak_sync_events as f64)
        .collect();
    let distances: Vec<f64> = runs.iter().filter_map(|r| r.staleness_distance).collect();
    StrategyFidelity {
        strategy: first.strategy.clone(),
        sim_time_to_target_s: first.sim_time_to_target_s,
        real_time_to_target_s,
        time_to_target_error: match (first.sim_time_to_target_s, real_time_to_target_s) {
            (Some(s), Some(t)) => signed_error(s, t),
            _ => None,
        },
        sim_final_accuracy: first.sim_final_accuracy,
        real_final_accuracy,
        final_accuracy_diff: match (first.sim_final_accuracy, real_final_accuracy) {
            (Some(s), Some(t)) => Some((s - t) * 100.0),
            _ => None,
        },
        sim_bytes: first.sim_bytes,
        real_bytes,
        bytes_error: signed_error(first.sim_bytes as f64, real_bytes as f64),
        sim_weak_sync_events: first.sim_weak_sync_events,
        real_weak_sync_events: mean(&weak).unwrap_or(0.0).round() as u64,
        staleness_distance: mean(&distances),
        real_undelivered: runs.iter().map(|r| r.real_undelivered).sum(),
        real_pace_overruns: runs.iter().map(|r| r.real_pace_overruns).sum(),
        real_problems: runs
            .iter()
            .enumerate()
            .flat_map(|(k, r)| {
                r.real_problems
                    .iter()
                    .map(move |p| format!("run {}: {p}", k + 1))
            })
            .collect(),
        real_runs: runs.len(),
        sim_spread: first.sim_spread.clone(),
        links: first
            .links
            .iter()
            .filter_map(|(name, l)| {
                let real: Vec<f64> = runs
                    .iter()
                    .filter_map(|r| r.links.get(name).map(|x| x.real as f64))
                    .collect();
                (real.len() == runs.len()).then(|| {
                    let real = mean(&real).unwrap_or(0.0).round() as u64;
                    let error = signed_error(l.sim as f64, real as f64);
                    let (sim, name) = (l.sim, name.clone());
                    (name, LinkBytes { sim, real, error })
                })
            })
            .collect(),
        pace: None,
        past_cutoff: None,
    }
}

/// Strategy `i` of every summary.
fn nth(summaries: &[SimSummary], i: usize) -> Vec<&StrategyResult> {
    summaries.iter().map(|x| &x.strategies[i]).collect()
}

/// Checks the optional bounds; the error lists every cell outside them.
fn check_bounds(args: &FidelityArgs, r: &FidelityReport) -> Result<()> {
    let mut out = Vec::new();
    for s in &r.strategies {
        if !s.real_problems.is_empty() {
            out.push(format!("{}: the real run was not clean", s.strategy));
        }
        if let Some(max) = args.max_time_error {
            match (
                s.sim_time_to_target_s,
                s.real_time_to_target_s,
                s.time_to_target_error,
            ) {
                (_, _, Some(e)) if e.abs() > max => out.push(format!(
                    "{}: time-to-target error {:+.1}% exceeds ±{:.0}%",
                    s.strategy,
                    e * 100.0,
                    max * 100.0
                )),
                (Some(_), None, _) | (None, Some(_), _) => out.push(format!(
                    "{}: only one of the two runs reached the target (sim {}, real {})",
                    s.strategy,
                    secs(s.sim_time_to_target_s),
                    secs(s.real_time_to_target_s)
                )),
                _ => {}
            }
        }
        if let (Some(max), Some(d)) = (args.max_accuracy_diff, s.final_accuracy_diff) {
            if d.abs() > max {
                out.push(format!(
                    "{}: final accuracy differs by {d:+.2} points (bound ±{max})",
                    s.strategy
                ));
            }
        }
        if let (Some(max), Some(e)) = (args.max_bytes_error, s.bytes_error) {
            if e.abs() > max {
                out.push(format!(
                    "{}: bytes error {:+.1}% exceeds ±{:.0}%",
                    s.strategy,
                    e * 100.0,
                    max * 100.0
                ));
            }
        }
    }
    if out.is_empty() {
        Ok(())
    } else {
        bail!(
            "fidelity outside the bounds asked for:\n  {}",
            out.join("\n  ")
        )
    }
}

/// Runs `strategy`'s simulated seeds again for [`crate::fidelity_past_cutoff::PAST_CUTOFF_FACTOR`]
/// times the scenario's length and compares their typical time to target with `real_time`.
fn run_on_past_cutoff(
    loaded: &LoadedScenario,
    strategy: &str,
    seeds: &[u64],
    real_time: f64,
) -> Result<crate::fidelity_past_cutoff::PastCutoff> {
    let virtual_s = loaded.scenario.max_virtual_s * crate::fidelity_past_cutoff::PAST_CUTOFF_FACTOR;
    println!(
        "{strategy}: the real runs reach the target, the simulated seeds do not by {:.0} s: running them on to {virtual_s:.0} s",
        loaded.scenario.max_virtual_s
    );
    let times = seeds
        .iter()
        .map(|&seed| {
            let mut scenario = loaded.scenario.clone();
            scenario.network_seed = Some(seed);
            scenario.max_virtual_s = virtual_s;
            crate::simulate_cmd::simulate_strategy(&scenario, &loaded.task, strategy, &mut |_| {})
                .map(|r| r.time_to_target_s)
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(crate::fidelity_past_cutoff::compare(
        times, virtual_s, real_time,
    ))
}

/// Runs `fidelity`.
pub fn run(args: FidelityArgs) -> Result<()> {
    if args.real_runs == 0 && args.real_from.is_some() {
        bail!("--real-runs 0 runs the simulated side alone: leave out --real-from");
    }
    if args.sim_seeds == 0 {
        bail!("--sim-seeds must be at least 1 (got 0)");
    }
    if args.real_from.is_some() && args.real_runs != 1 {
        bail!("--real-from reuses the real runs recorded in its folder: leave out --real-runs");
    }
    let mut loaded: LoadedScenario = scenario_cluster::load(&args.scenario, &args.overrides)?;
    if args.overrides.strategies.is_none() {
        loaded
            .scenario
            .strategies
            .retain(|s| scenario_cluster::REAL_STRATEGIES.contains(&s.as_str()));
    }
    let s = &loaded.scenario;
    let out = args
        .out
        .clone()
        .unwrap_or_else(|| PathBuf::from("fidelity-out").join(&s.name));
    std::fs::create_dir_all(&out)?;

    // The simulation: `sim/`, and `sim/network-seed-N/` for each further network seed (the
    // real trainers all start from SEED's model and data order: only the network varies).
    let started = Instant::now();
    let seeds: Vec<u64> = (0..args.sim_seeds as u64).map(|k| s.seed + k).collect();
    let mut per_seed: Vec<SimSummary> = Vec::with_capacity(seeds.len());
    for &seed in &seeds {
        let mut scenario = s.clone();
        scenario.network_seed = Some(seed);
        per_seed.push(SimSummary {
            scenario: s.name.clone(),
            seed: s.seed,
            scenario_toml: loaded.text.clone(),
            target: crate::simulate_cmd::target_text(&loaded.task, s.target),
            strategies: s
                .strategies
                .iter()
                .map(|strategy| {
                    crate::simulate_cmd::simulate_strategy(
                        &scenario,
                        &loaded.task,
                        strategy,
                        &mut |_| {},
                    )
                })
                .collect::<Result<_>>()?,
        });
    }
    let sim_wall_seconds = started.elapsed().as_secs_f64();
    for (extra, seed) in per_seed[1..].iter().zip(&seeds[1..]) {
        let dir = out.join("sim").join(format!("network-seed-{seed}"));
        crate::simulate_cmd::write_outputs(&dir, extra)?;
    }
    let (combined, spreads): (Vec<StrategyResult>, Vec<_>) = (0..s.strategies.len())
        .map(|i| {
            let runs: Vec<&StrategyResult> = per_seed
                .iter()
                .map(|summary| &summary.strategies[i])
                .collect();
            crate::fidelity_seeds::combine(&runs, &seeds, access_bytes)
        })
        .unzip();
    let sim = &per_seed[0];
    if args.real_runs == 0 {
        crate::simulate_cmd::write_outputs(&out.join("sim"), sim)?;
        crate::fidelity_print::print_simulated_only(&s.name, &combined, &spreads, access_bytes);
        return Ok(());
    }
    // The real runs: `real/`, or `real/run-K/` for each of several.
    let started = Instant::now();
    let mut reals = Vec::with_capacity(args.real_runs);
    let mut per_run: Vec<Vec<StrategyFidelity>> = Vec::with_capacity(args.real_runs);
    if let Some(from) = &args.real_from {
        for (real, rows) in crate::fidelity_reuse::recorded_runs(from, &loaded, &combined)? {
            per_run.push(rows);
            reals.push(real);
        }
    }
    for k in 0..args.real_runs * usize::from(args.real_from.is_none()) {
        let dir = if args.real_runs == 1 {
            out.join("real")
        } else {
            println!("real run {} of {}", k + 1, args.real_runs);
            out.join("real").join(format!("run-{}", k + 1))
        };
        let (real, runs) = scenario_cluster::run_all(&loaded, &dir)?;
        crate::simulate_cmd::write_outputs(&dir, &real)?;
        per_run.push(
            combined
                .iter()
                .zip(&runs)
                .map(|(a, b)| compare(a, b))
                .collect(),
        );
        reals.push(real);
    }
    let real_wall_seconds = started.elapsed().as_secs_f64();
    crate::simulate_cmd::write_outputs(&out.join("sim"), sim)?;

    if seeds.len() > 1 {
        for run in &mut per_run {
            for (row, spread) in run.iter_mut().zip(&spreads) {
                row.sim_spread = Some(spread.clone());
            }
        }
    }
    let mut strategies: Vec<StrategyFidelity> = (0..sim.strategies.len())
        .map(|i| {
            let mut row = aggregate(&per_run.iter().map(|run| run[i].clone()).collect::<Vec<_>>());
            row.pace = crate::fidelity_pace::pace(&nth(&per_seed, i), &nth(&reals, i));
            row
        })
        .collect();
    for row in &mut strategies {
        if let Some(real_time) = row.real_time_to_target_s.filter(|_| {
            crate::fidelity_past_cutoff::needed(row.real_time_to_target_s, row.sim_time_to_target_s)
        }) {
            row.past_cutoff = Some(run_on_past_cutoff(
                &loaded,
                &row.strategy,
                &seeds,
                real_time,
            )?);
        }
    }
    let report = FidelityReport {
        scenario: s.name.clone(),
        seed: s.seed,
        target: reals[0].target.clone(),
        strategies,
        runs: if per_run.len() > 1 {
            per_run
        } else {
            Vec::new()
        },
        sim_wall_seconds,
        real_wall_seconds,
        real_from: args.real_from.as_ref().map(|p| p.display().to_string()),
    };
    write_json(&out.join("fidelity.json"), &report)?;
    let lm = sim.strategies.iter().all(|r| r.final_accuracy.is_none());
    let metric = |p: &simulations::report::SeriesPoint| {
        if lm {
            p.loss
        } else {
            p.accuracy.unwrap_or(0.0) * 100.0
        }
    };
    let overlay: Vec<Series> = sim
        .strategies
        .iter()
        .map(|r| (r, "sim".to_string()))
        .chain(reals.iter().enumerate().flat_map(|(k, real)| {
            let engine = if reals.len() == 1 {
                "real".to_string()
            } else {
                format!("real {}", k + 1)
            };
            real.strategies.iter().map(move |r| (r, engine.clone()))
        }))
        .map(|(r, engine)| Series {
            label: format!("{} ({engine})", r.strategy),
            points: r.series.iter().map(|p| (p.time_s, metric(p))).collect(),
        })
        .collect();
    line_chart(
        &out.join("accuracy_overlay.svg"),
        "time (s): virtual (sim), wall since the trainers started (real)",
        if lm {
            "validation loss"
        } else {
            "test accuracy (%)"
        },
        &overlay,
    )?;
    print_report(&report);
    match &args.real_from {
        Some(from) => println!(
            "wrote {}/fidelity.json, accuracy_overlay.svg and sim/ (the real run is {}'s)",
            out.display(),
            from.display()
        ),
        None => println!(
            "wrote {}/fidelity.json, accuracy_overlay.svg, sim/ and real/",
            out.display()
        ),
    }
    check_bounds(&args, &report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn several_simulated_seeds_are_compared_as_one_typical_run_and_each_is_kept() {
        #[derive(clap::Parser)]
        struct Flags {
            #[command(flatten)]
            args: FidelityArgs,
        }
        let dir = tempfile::tempdir().unwrap();
        let (recorded, out) = (dir.path().join("recorded"), dir.path().join("out"));
        let flags = [
            "fidelity",
            "fidelity-smoke",
            "--strategies",
            "elastic",
            "--max-virtual-s",
            "3",
            "--sim-seeds",
            "2",
        ];
        let mut args = <Flags as clap::Parser>::parse_from(flags).args;
        args.real_from = Some(recorded.clone());
        args.out = Some(out.clone());
        let loaded = scenario_cluster::load(&args.scenario, &args.overrides).unwrap();
        let seed = loaded.scenario.seed;
        crate::fidelity_reuse::tests::write_recorded(
            &recorded.join("real"),
            &loaded.text,
            seed,
            &["elastic"],
        );
        // A clean real run (the helper's records a lost node).
        std::fs::write(
            recorded.join("real").join("elastic").join("summary.json"),
            r#"{"nodes": [], "problems": []}"#,
        )
        .unwrap();
        run(args).unwrap();
        let report: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(out.join("fidelity.json")).unwrap())
                .unwrap();
        let row = &report["strategies"][0];
        assert_eq!(
            row["sim_spread"]["seeds"],
            serde_json::json!([seed, seed + 1])
        );
        let bytes: Vec<u64> = row["sim_spread"]["bytes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|b| b.as_u64().unwrap())
            .collect();
        assert_eq!(bytes.len(), 2);
        // The row compares the seeds' mean bytes.
        let mean = (bytes[0] + bytes[1]) as f64 / 2.0;
        assert!((row["sim_bytes"].as_f64().unwrap() - mean).abs() <= 1.0);
        // The recorded real run reached the target (12 s), the seeds do not by 3 s: they were
        // run on to 4.5 s, where they still do not.
        assert_eq!(row["past_cutoff"]["virtual_s"], serde_json::json!(4.5));
        assert_eq!(
            row["past_cutoff"]["sim_times_s"],
            serde_json::json!([null, null])
        );
        assert!(row["past_cutoff"]["time_to_target_error"].is_null());
        // The first seed's outputs are `sim/`, the second's `sim/network-seed-N/`.
        assert!(out.join("sim").join("summary.json").exists());
        assert!(out
            .join("sim")
            .join(format!("network-seed-{}", seed + 1))
            .join("summary.json")
            .exists());
    }

    #[test]
    fn a_seed_run_on_past_the_cutoff_is_the_same_run_up_to_the_cutoff() {
        let overrides = scenario_cluster::ScenarioOverrides {
            strategies: Some("elastic".into()),
            max_virtual_s: Some(3.0),
            ..scenario_cluster::ScenarioOverrides::default()
        };
        let loaded = scenario_cluster::load("fidelity-smoke", &overrides).unwrap();
        let short = crate::simulate_cmd::simulate_strategy(
            &loaded.scenario,
            &loaded.task,
            "elastic",
            &mut |_| {},
        )
        .unwrap();
        let mut longer = loaded.scenario.clone();
        longer.max_virtual_s = 4.5;
        let long =
            crate::simulate_cmd::simulate_strategy(&longer, &loaded.task, "elastic", &mut |_| {})
                .unwrap();
        // Every evaluation before the short run's end (its last point is its final one).
        let before: Vec<_> = short.series[..short.series.len() - 1].to_vec();
        assert!(!before.is_empty());
        assert_eq!(before, long.series[..before.len()].to_vec());
        assert!(long.series.last().unwrap().time_s > 3.0);
    }

    #[test]
    fn staleness_distance_is_total_variation_with_a_capped_tail() {
        let a = BTreeMap::from([(0, 5), (1, 5)]);
        assert_eq!(staleness_distance(&a, &a), Some(0.0));
        let b = BTreeMap::from([(2, 10)]);
        assert_eq!(staleness_distance(&a, &b), Some(1.0));
        // τ 16 and 40 are one bucket.
        let c = BTreeMap::from([(16, 3)]);
        let d = BTreeMap::from([(40, 1)]);
        assert_eq!(staleness_distance(&c, &d), Some(0.0));
        let half = BTreeMap::from([(0, 5), (2, 5)]);
        assert!((staleness_distance(&a, &half).unwrap() - 0.5).abs() < 1e-12);
        assert_eq!(staleness_distance(&a, &BTreeMap::new()), None);
    }

    fn row(tt: Option<f64>, acc: f64, bytes: u64, problems: &[&str]) -> StrategyFidelity {
        StrategyFidelity {
            strategy: "fedbuff".into(),
            sim_time_to_target_s: Some(44.8),
            real_time_to_target_s: tt,
            time_to_target_error: None,
            sim_final_accuracy: Some(0.854),
            real_final_accuracy: Some(acc),
            final_accuracy_diff: None,
            sim_bytes: 120,
            real_bytes: bytes,
            bytes_error: None,
            sim_weak_sync_events: 0,
            real_weak_sync_events: 2,
            staleness_distance: Some(0.1),
            real_undelivered: 0,
            real_pace_overruns: 1,
            real_problems: problems.iter().map(|p| p.to_string()).collect(),
            real_runs: 1,
            sim_spread: None,
            links: BTreeMap::from([(
                "edge-0.up".to_string(),
                LinkBytes {
                    sim: 120,
                    real: bytes,
                    error: None,
                },
            )]),
            pace: None,
            past_cutoff: None,
        }
    }

    #[test]
    fn several_real_runs_are_compared_through_their_typical_values() {
        let runs = [
            row(Some(20.0), 0.908, 100, &[]),
            row(None, 0.716, 90, &["edge-1 lost"]),
            row(Some(45.4), 0.888, 110, &[]),
        ];
        let a = aggregate(&runs);
        assert_eq!(a.real_runs, 3);
        // Two of three reached the target: the median of their times.
        assert!((a.real_time_to_target_s.unwrap() - 32.7).abs() < 1e-9);
        assert!((a.time_to_target_error.unwrap() - (44.8 - 32.7) / 32.7).abs() < 1e-9);
        assert!((a.real_final_accuracy.unwrap() - (0.908 + 0.716 + 0.888) / 3.0).abs() < 1e-9);
        assert_eq!(a.real_bytes, 100);
        assert!((a.bytes_error.unwrap() - 0.2).abs() < 1e-9);
        // Each link's real bytes are the runs' mean too.
        let link = &a.links["edge-0.up"];
        assert_eq!((link.sim, link.real), (120, 100));
        assert!((link.error.unwrap() - 0.2).abs() < 1e-9);
        assert_eq!(a.real_pace_overruns, 3);
        assert_eq!(a.real_problems, vec!["run 2: edge-1 lost".to_string()]);
        // One of three reached it: never.
        let b = aggregate(&[runs[1].clone(), runs[1].clone(), runs[0].clone()]);
        assert_eq!(
            (b.real_time_to_target_s, b.time_to_target_error),
            (None, None)
        );
        // One run is itself.
        let one = aggregate(&runs[..1]);
        assert_eq!(one.real_time_to_target_s, Some(20.0));
        assert_eq!(one.real_runs, 1);
    }

    #[test]
    fn errors_are_signed_fractions_of_the_real_value() {
        assert!((signed_error(12.0, 10.0).unwrap() - 0.2).abs() < 1e-12);
        assert!((signed_error(8.0, 10.0).unwrap() + 0.2).abs() < 1e-12);
        assert_eq!(signed_error(1.0, 0.0), None);
    }
}
