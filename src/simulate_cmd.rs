//! `dreamddp simulate`: runs a scenario (built-in name or TOML file) in the deterministic
//! simulator for each of its strategies, prints a table, and writes `summary.json`
//! (byte-identical for the same scenario and seed), `timeseries.csv`, `timing.json` and SVG
//! plots. `--replay summary.json` re-runs a recorded scenario + seed and checks it reproduces.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use clap::Args;
use engine::loss::softmax_cross_entropy;
use indicatif::{ProgressBar, ProgressStyle};
use node::task::{load_data, resolve_dataset, Batch, ModelKind, Task, TaskData};
use simulations::compute::layer_costs;
use simulations::report::SimSummary;
use simulations::scenario::{Scenario, ScenarioKind, BUILTIN};

use crate::plots::{line_chart, timeline_chart, Bar, Series};
use crate::train_cmd::{human_bytes, write_json};

/// Flags of `simulate`.
#[derive(Args, Debug, Clone)]
pub struct SimulateArgs {
    /// Built-in scenario name (see --list) or a TOML file.
    #[arg(default_value = "default")]
    pub scenario: String,
    /// Override the scenario's seed.
    #[arg(long)]
    pub seed: Option<u64>,
    /// Run only these strategies (comma-separated).
    #[arg(long)]
    pub strategies: Option<String>,
    /// Output folder (default `sim-out/<scenario>/`).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Re-run the scenario and seed recorded in this summary.json and check the result is identical.
    #[arg(long)]
    pub replay: Option<PathBuf>,
    /// Folder holding the data sets (default: $DREAMDDP_DATA_DIR, then ../shared/data/datasets).
    #[arg(long)]
    pub data_dir: Option<PathBuf>,
    /// List the built-in scenarios and exit.
    #[arg(long)]
    pub list: bool,
    /// Measure the scenario's model on this machine's built-in CPU backend (1 thread) and print
    /// a device class NAME (`[devices.NAME]`: a FLOP rate and a `[devices.NAME.layers]` table of
    /// per-layer forward/backward ms) to paste into a scenario of either kind, instead of
    /// simulating. Keeps runs replayable: the measured numbers live in the scenario text.
    #[arg(long, value_name = "NAME")]
    pub measure_device: Option<String>,
    /// No progress bar.
    #[arg(long)]
    pub quiet: bool,
}

/// Runs `simulate`.
pub fn run(args: SimulateArgs) -> Result<()> {
    if args.list {
        for (name, text) in BUILTIN {
            let desc = Scenario::parse(text, name, Path::new("."))
                .map(|s| s.description)
                .unwrap_or_else(|e| format!("(invalid: {e})"));
            println!("{name:<16} {desc}");
        }
        return Ok(());
    }
    let mut recorded_bytes = Vec::new();
    let (recorded, (mut scenario, text)) = match &args.replay {
        Some(path) => {
            let bytes =
                std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
            recorded_bytes.clone_from(&bytes);
            let rec: SimSummary = serde_json::from_slice(&bytes).with_context(|| {
                format!("{} is not a dreamddp simulate summary.json", path.display())
            })?;
            let base = simulations::scenario::traces_base_dir();
            let s = Scenario::parse(&rec.scenario_toml, &rec.scenario, &base)?;
            let text = rec.scenario_toml.clone();
            (Some(rec), (s, text))
        }
        None => (None, Scenario::load(&args.scenario)?),
    };
    if let Some(rec) = &recorded {
        scenario.seed = rec.seed;
        scenario.strategies = rec.strategies.iter().map(|s| s.strategy.clone()).collect();
    }
    if let Some(seed) = args.seed {
        scenario.seed = seed;
    }
    if let Some(list) = &args.strategies {
        scenario.strategies = list
            .split(',')
            .map(|s| s.trim().to_string())
            .filter(|s| !s.is_empty())
            .collect();
    }
    let task = build_task(&scenario, args.data_dir.as_deref())?;
    if let Some(name) = &args.measure_device {
        return measure_device(&scenario, &task, name);
    }
    let target = target_text(&task, scenario.target);
    println!(
        "scenario {} (seed {}): {} on {}, target {target}; strategies: {}",
        scenario.name,
        scenario.seed,
        task.model.name(),
        task.dataset,
        scenario.strategies.join(", ")
    );
    let mut results = Vec::new();
    for strategy in scenario.strategies.clone() {
        let bar = if args.quiet {
            ProgressBar::hidden()
        } else {
            ProgressBar::new(1000)
        };
        bar.set_style(
            ProgressStyle::with_template(
                "{prefix:>16} [{elapsed_precise}] {wide_bar} {percent}% of virtual time",
            )
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        bar.set_prefix(strategy.clone());
        bar.enable_steady_tick(Duration::from_millis(250));
        let b = bar.clone();
        let mut progress = move |f: f64| b.set_position((f.clamp(0.0, 1.0) * 1000.0) as u64);
        let result = simulate_strategy(&scenario, &task, &strategy, &mut progress);
        bar.finish_and_clear();
        results.push(result?);
    }
    let summary = SimSummary {
        scenario: scenario.name.clone(),
        seed: scenario.seed,
        scenario_toml: text,
        target,
        strategies: results,
    };
    print_table(&summary);
    let out = args
        .out
        .clone()
        .unwrap_or_else(|| PathBuf::from("sim-out").join(&scenario.name));
    write_outputs(&out, &summary)?;
    if let Some(rec) = recorded {
        // Compare what summary.json holds, byte for byte (wall times are not in it).
        let ours_bytes = serde_json::to_string_pretty(&summary)?.into_bytes();
        if ours_bytes == recorded_bytes {
            println!(
                "replay: reproduced the recorded summary exactly ({} strategies)",
                summary.strategies.len()
            );
        } else {
            let first = rec
                .strategies
                .iter()
                .zip(&summary.strategies)
                .find(|(a, b)| serde_json::to_string(a).ok() != serde_json::to_string(b).ok())
                .map(|(a, _)| a.strategy.clone())
                .unwrap_or_else(|| "scenario header".into());
            bail!("replay did NOT reproduce the recorded summary (first difference in: {first}); see {}", out.display());
        }
    }
    Ok(())
}

/// The `summary.json` `target` text of a scenario: `accuracy >= T`, or `val loss <= T` for a
/// language model.
pub fn target_text(task: &Task, target: f64) -> String {
    match task.model {
        ModelKind::GptTiny => format!("val loss <= {target}"),
        _ => format!("accuracy >= {target}"),
    }
}

/// Simulates one strategy of a scenario of either kind; `wall_seconds` is filled in.
pub fn simulate_strategy(
    scenario: &Scenario,
    task: &Task,
    strategy: &str,
    progress: &mut dyn FnMut(f64),
) -> Result<simulations::report::StrategyResult> {
    let started = Instant::now();
    let result = match scenario.kind {
        ScenarioKind::Clusters => {
            simulations::clusters::run_clusters(scenario, task, strategy, progress)
        }
        ScenarioKind::Edge => simulations::edge::run_edge(scenario, task, strategy, progress),
    };
    let mut result =
        result.map_err(|e| anyhow!("scenario {} strategy {strategy}: {e}", scenario.name))?;
    result.wall_seconds = started.elapsed().as_secs_f64();
    Ok(result)
}

/// Warm-up steps before [`measure_layers`] starts timing.
const MEASURE_WARMUP: usize = 2;
/// Timed steps of [`measure_layers`] (medians per layer).
const MEASURE_STEPS: usize = 10;

/// Median forward and backward seconds of every layer (forward order) of `task`'s model at
/// `batch` on this thread; the loss is counted in the last layer's forward.
fn measure_layers(task: &Task, batch_size: usize, seed: u64) -> Vec<(String, f64, f64)> {
    use rand_chacha::rand_core::SeedableRng;
    let mut model = task.build_model(seed);
    let mut batch = Batch::default();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let n = task.train_len();
    let layers = model.layers.len();
    let mut fwd = vec![Vec::with_capacity(MEASURE_STEPS); layers];
    let mut bwd = vec![Vec::with_capacity(MEASURE_STEPS); layers];
    for it in 0..MEASURE_WARMUP + MEASURE_STEPS {
        if matches!(task.data, TaskData::Images(_)) {
            batch.indices = (0..batch_size).map(|i| (it * batch_size + i) % n).collect();
        }
        task.fill_batch(&mut batch, &mut rng, batch_size);
        let mut f = vec![0.0; layers];
        let mut b = vec![0.0; layers];
        let mut x = batch.input.clone();
        for (i, l) in model.layers.iter_mut().enumerate() {
            let t = Instant::now();
            x = l.layer.forward(&x, true);
            f[i] = t.elapsed().as_secs_f64();
        }
        let t = Instant::now();
        let (_, mut g) = softmax_cross_entropy(&x, &batch.targets);
        f[layers - 1] += t.elapsed().as_secs_f64();
        for (i, l) in model.layers.iter_mut().enumerate().rev() {
            let t = Instant::now();
            g = l.layer.backward(&g);
            b[i] = t.elapsed().as_secs_f64();
        }
        if it >= MEASURE_WARMUP {
            for i in 0..layers {
                fwd[i].push(f[i]);
                bwd[i].push(b[i]);
            }
        }
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    model
        .layers
        .iter()
        .zip(fwd.iter_mut().zip(bwd.iter_mut()))
        .map(|(l, (f, b))| (l.name.clone(), median(f), median(b)))
        .collect()
}

/// Measures the scenario's model here and prints a `[devices.NAME]` class: the FLOP rate of a
/// whole step and every layer's forward/backward milliseconds at the scenario's batch.
fn measure_device(scenario: &Scenario, task: &Task, name: &str) -> Result<()> {
    if task.build_model(scenario.seed).layers.is_empty() {
        bail!("{} has no layers to time", task.model.name());
    }
    engine::backend::set_threads(1);
    let layers = measure_layers(task, scenario.batch, scenario.seed);
    let forward_s: f64 = layers.iter().map(|l| l.1).sum();
    let backward_s: f64 = layers.iter().map(|l| l.2).sum();
    let model = task.build_model(scenario.seed);
    let macs: u64 = layer_costs(&model, task)
        .iter()
        .map(|l| l.macs_per_sample)
        .sum();
    let step_s = forward_s + backward_s;
    if step_s <= 0.0 || macs == 0 {
        bail!(
            "could not time a step of {} on this machine",
            task.model.name()
        );
    }
    // The FLOP model charges 2·MACs (forward) + 4·MACs (backward) per sample; layers with
    // given times use those instead, so the rate only matters for other models' layers.
    let flops = 6.0 * macs as f64 * scenario.batch as f64 / step_s;
    println!(
        "# measured on this machine (built-in backend, 1 thread, median of {MEASURE_STEPS} steps): {} at batch {}, forward {:.3} ms, backward {:.3} ms",
        task.model.name(),
        scenario.batch,
        forward_s * 1e3,
        backward_s * 1e3
    );
    println!(
        "[devices.{name}]\nflops = {flops:.4e}\nlayer_overhead_s = 0.0\nbatch = {}\n[devices.{name}.layers]",
        scenario.batch
    );
    for (layer, f, b) in &layers {
        println!(
            "{layer} = {{ forward_ms = {:.6}, backward_ms = {:.6} }}",
            f * 1e3,
            b * 1e3
        );
    }
    Ok(())
}

pub fn build_task(s: &Scenario, data_dir: Option<&Path>) -> Result<Task> {
    let model: ModelKind = s
        .model
        .parse()
        .map_err(|e: String| anyhow!("scenario {}: {e}", s.name))?;
    let dir = data_dir
        .map(Path::to_path_buf)
        .or_else(engine::data::locate::shared_datasets_dir);
    let dataset = resolve_dataset(&model, &s.dataset, dir.as_deref());
    let data = load_data(&dataset, dir.as_deref()).map_err(|e| anyhow!(e))?;
    let task = Task::new(model, &dataset, data).map_err(|e| anyhow!(e))?;
    task.require_builtin("the simulator")
        .map_err(|e| anyhow!("scenario {}: {e}", s.name))?;
    Ok(task)
}

fn fmt_opt_s(v: Option<f64>) -> String {
    v.map(|t| format!("{t:.1}"))
        .unwrap_or_else(|| "never".into())
}

pub fn print_table(s: &SimSummary) {
    println!();
    println!(
        "{:<17} {:>12} {:>9} {:>11} {:>10} {:>9} {:>11} {:>8} {:>9} {:>7}",
        "strategy",
        "to target s",
        "final",
        "bytes",
        "weak-sync",
        "cached",
        "undelivered",
        "step ms",
        "virtual s",
        "wall s"
    );
    for r in &s.strategies {
        let metric = match r.final_accuracy {
            Some(a) => format!("{:.2}%", a * 100.0),
            None => format!("{:.3}", r.final_loss),
        };
        println!(
            "{:<17} {:>12} {:>9} {:>11} {:>10} {:>9} {:>11} {:>8.2} {:>9.1} {:>7.1}",
            r.strategy,
            fmt_opt_s(r.time_to_target_s),
            metric,
            human_bytes(r.bytes_sent),
            r.weak_sync_events,
            r.cached_at_end,
            r.undelivered_deltas,
            r.mean_step_s * 1e3,
            r.virtual_seconds,
            r.wall_seconds
        );
    }
    // Ratios of time to target against the first strategy that reached it fastest.
    if let Some(best) = s
        .strategies
        .iter()
        .filter(|r| r.time_to_target_s.is_some())
        .min_by(|a, b| {
            a.time_to_target_s
                .unwrap_or(f64::MAX)
                .total_cmp(&b.time_to_target_s.unwrap_or(f64::MAX))
        })
    {
        let t = best.time_to_target_s.unwrap_or(1.0).max(1e-9);
        let ratios: Vec<String> = s
            .strategies
            .iter()
            .filter(|r| r.strategy != best.strategy)
            .map(|r| match r.time_to_target_s {
                Some(x) => format!("{} {:.2}x", r.strategy, x / t),
                None => format!("{} never", r.strategy),
            })
            .collect();
        println!(
            "\nfastest to target: {} ({:.1} virtual s); others take: {}",
            best.strategy,
            t,
            ratios.join(", ")
        );
    }
    for r in &s.strategies {
        if !r.bytes_by_link_class.is_empty() {
            let parts: Vec<String> = r
                .bytes_by_link_class
                .iter()
                .map(|(k, v)| format!("{k} {}", human_bytes(*v)))
                .collect();
            println!(
                "  {:<16} bytes by link class: {}",
                r.strategy,
                parts.join(", ")
            );
        }
        if !r.staleness_histogram.is_empty() {
            let parts: Vec<String> = r
                .staleness_histogram
                .iter()
                .map(|(k, v)| format!("τ{k}:{v}"))
                .collect();
            println!(
                "  {:<16} staleness histogram: {}",
                r.strategy,
                parts.join(" ")
            );
        }
        if let Some(chosen) = r.plan_candidates.iter().find(|c| c.chosen) {
            let best_paper = r.plan_candidates.iter().find(|c| {
                c.schedule == engine::plan::ScheduleKind::Profiled
                    && c.delay == 1
                    && !c.whole_groups
                    && c.unit_params == 0
            });
            println!(
                "  {:<16} configuration search: {} schedule, {} phase groups, delay {}, {}, {} \
                 (modelled step {:.2} ms{}; {} candidates in summary.json)",
                r.strategy,
                chosen.schedule,
                chosen.groups,
                chosen.delay,
                if chosen.whole_groups {
                    "one exchange per group"
                } else {
                    "DDP bucket caps"
                },
                chosen.units_label(),
                chosen.step_s * 1e3,
                best_paper.map_or(String::new(), |p| format!(
                    ", the paper's profiled/delay 1: {:.2} ms",
                    p.step_s * 1e3
                )),
                r.plan_candidates.len()
            );
        }
        if r.undelivered_deltas > 0 {
            println!(
                "  [ERROR] {}: {} weak-synced deltas were lost (neither delivered nor cached)",
                r.strategy, r.undelivered_deltas
            );
        }
    }
    println!();
}

pub fn write_outputs(out: &Path, s: &SimSummary) -> Result<()> {
    std::fs::create_dir_all(out).with_context(|| format!("cannot create {}", out.display()))?;
    write_json(&out.join("summary.json"), s)?;
    let timing: Vec<serde_json::Value> = s
        .strategies
        .iter()
        .map(|r| serde_json::json!({"strategy": r.strategy, "wall_seconds": r.wall_seconds}))
        .collect();
    write_json(&out.join("timing.json"), &timing)?;
    let path = out.join("timeseries.csv");
    let mut w = csv::Writer::from_path(&path)
        .with_context(|| format!("cannot write {}", path.display()))?;
    w.write_record([
        "strategy",
        "time_s",
        "accuracy",
        "loss",
        "bytes_sent",
        "mean_steps",
    ])?;
    for r in &s.strategies {
        for p in &r.series {
            w.write_record([
                r.strategy.clone(),
                format!("{:.3}", p.time_s),
                p.accuracy.map(|a| format!("{a:.5}")).unwrap_or_default(),
                format!("{:.5}", p.loss),
                p.bytes_sent.to_string(),
                format!("{:.1}", p.mean_steps),
            ])?;
        }
    }
    w.flush()?;
    let classification = s.strategies.iter().any(|r| r.final_accuracy.is_some());
    let metric: Vec<Series> = s
        .strategies
        .iter()
        .map(|r| Series {
            label: r.strategy.clone(),
            points: r
                .series
                .iter()
                .map(|p| {
                    (
                        p.time_s,
                        if classification {
                            p.accuracy.unwrap_or(0.0) * 100.0
                        } else {
                            p.loss
                        },
                    )
                })
                .collect(),
        })
        .collect();
    let ylabel = if classification {
        "test accuracy (%)"
    } else {
        "validation loss"
    };
    line_chart(
        &out.join("accuracy_vs_time.svg"),
        "virtual time (s)",
        ylabel,
        &metric,
    )?;
    let bytes: Vec<Series> = s
        .strategies
        .iter()
        .map(|r| Series {
            label: r.strategy.clone(),
            points: r
                .series
                .iter()
                .map(|p| (p.time_s, p.bytes_sent as f64 / 1e6))
                .collect(),
        })
        .collect();
    line_chart(
        &out.join("bytes_vs_time.svg"),
        "virtual time (s)",
        "MB sent",
        &bytes,
    )?;
    for r in &s.strategies {
        let bars: Vec<Bar> = r
            .timeline
            .iter()
            .map(|e| Bar {
                row: format!("{}/{}", e.node, e.layer),
                start: e.start_s,
                end: e.end_s,
                highlight: e.weak,
            })
            .collect();
        let name = format!("timeline_{}.svg", r.strategy);
        timeline_chart(
            &out.join(name),
            &format!("per-layer syncs: {} (red: weak-synced)", r.strategy),
            "virtual time (s)",
            &bars,
        )?;
    }
    println!(
        "wrote {0}/summary.json, timeseries.csv, timing.json, accuracy_vs_time.svg, bytes_vs_time.svg, timeline_<strategy>.svg",
        out.display()
    );
    Ok(())
}
