//! `dreamddp train` and `dreamddp plan`: resolve flags into a task, a config and a sync
//! plan; train with a progress bar; print and write the summary.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use engine::checkpoint::{self, NamedTensor};
use engine::optim::OptimizerConfig;
use engine::outer::OuterConfig;
use engine::plan::{ScheduleKind, Strategy, SyncPlan};
use gpu_worker::gpu_probe::{
    self, probe_nccl, select_collective, CollectiveChoice, CollectiveRequest, GpuProbeError,
    NcclInfo,
};
use gpu_worker::planning::{build_plan, PlanInputs};
use gpu_worker::profile::profile_step;
use gpu_worker::trainer::{train, RunReport, TrainConfig};
use indicatif::{ProgressBar, ProgressStyle};
use node::backend::Backend;
use node::link::LinkModel;
use node::task::{load_data, resolve_dataset, ModelKind, Task};

use crate::cli::TrainArgs;

/// A fully resolved run: everything needed to train one strategy.
pub struct Resolved {
    pub task: Task,
    pub cfg: TrainConfig,
    pub period: u64,
    pub schedule: ScheduleKind,
    pub overrides: Vec<(String, u64)>,
    pub bubble_fill: bool,
    /// DreamDDP's delay (`--delay`; `None`: chosen from the profile).
    pub delay: Option<u64>,
    /// Streaming DiLoCo's τ (`--fragment-delay`; `None`: 1).
    pub fragment_delay: Option<u64>,
    /// DreamDDP's largest sync unit in KiB (`--sync-unit-kb`; `None`: chosen by the search).
    pub sync_unit_kb: Option<u64>,
    /// Outer optimizer of diloco / streaming-diloco.
    pub outer: OuterConfig,
    /// The step profile measured for `--link auto`, reused by the DreamDDP schedule.
    pub profile: Option<gpu_worker::profile::StepProfile>,
    pub link_spec: String,
}

fn data_dir(args: &TrainArgs) -> Option<PathBuf> {
    args.data_dir
        .clone()
        .or_else(engine::data::locate::shared_datasets_dir)
}

/// Turns flags (and the config file) into a task and a training configuration.
pub fn resolve(args: &TrainArgs) -> Result<Resolved> {
    let model: ModelKind = args
        .model
        .as_deref()
        .unwrap_or("mlp")
        .parse()
        .map_err(|e: String| anyhow!(e))?;
    let dir = data_dir(args);
    let dataset = resolve_dataset(
        &model,
        args.dataset.as_deref().unwrap_or("auto"),
        dir.as_deref(),
    );
    let data = load_data(&dataset, dir.as_deref()).map_err(|e| anyhow!(e))?;
    let task = Task::new(model, &dataset, data).map_err(|e| anyhow!(e))?;
    let d = task.defaults();
    let strategy: Strategy = args
        .strategy
        .as_deref()
        .unwrap_or("dreamddp")
        .parse()
        .map_err(|e| anyhow!("{e}"))?;
    let schedule: ScheduleKind = args
        .schedule
        .as_deref()
        .unwrap_or("auto")
        .parse()
        .map_err(|e| anyhow!("{e}"))?;
    let optimizer = match args.optimizer.as_deref() {
        None => d.optimizer.clone(),
        Some("sgd") => OptimizerConfig::Sgd {
            momentum: 0.9,
            weight_decay: 0.0,
            nesterov: true,
        },
        Some("adamw") | Some("adam") => OptimizerConfig::AdamW {
            beta1: 0.9,
            beta2: 0.99,
            eps: 1e-8,
            weight_decay: 0.0,
        },
        Some(o) => bail!("unknown --optimizer '{o}'; expected sgd or adamw"),
    };
    let backend = Backend::parse(
        args.backend.as_deref().unwrap_or("builtin"),
        args.device.as_deref().unwrap_or("cpu"),
    )?;
    backend.probe()?;
    let workers = args.workers.unwrap_or(4);
    let collective = resolve_collective(args.collective.as_deref(), &backend, workers)?;
    let initial_values = match &args.load {
        None => None,
        Some(path) => Some(Arc::new(load_checkpoint(
            &task,
            &backend,
            args.seed.unwrap_or(0),
            path,
        )?)),
    };
    let overrides = parse_overrides(args.layer_period.as_deref().unwrap_or(""))?;
    let batch = args.batch.unwrap_or(d.batch);
    let seed = args.seed.unwrap_or(0);
    let link_spec = args.link.clone().unwrap_or_else(|| "none".to_string());
    let mut profile = None;
    let link = if link_spec == "auto" {
        let mut replica = backend.build_replica(&task, seed, &optimizer)?;
        let prof = profile_step(&task, replica.as_mut(), batch, workers, 5, seed)?;
        let params: usize = prof.units.iter().map(|u| u.2).sum();
        let link = LinkModel::calibrated(params * 4, workers, prof.backward_s, 20e-6);
        tracing::info!(
            "--link auto: backward {:.2} ms per step with {workers} workers on this machine → link {link} \
             (a full-model all-reduce takes about one backward pass)",
            prof.backward_s * 1e3
        );
        profile = Some(prof);
        link
    } else {
        link_spec.parse().map_err(|e| anyhow!("{e}"))?
    };
    let cfg = TrainConfig {
        workers,
        strategy,
        steps: args.steps.unwrap_or(d.steps),
        batch,
        lr: args.lr.unwrap_or(d.lr),
        warmup: args.warmup.unwrap_or(d.warmup),
        optimizer,
        link,
        seed,
        eval_every: args.eval_every.unwrap_or(d.eval_every),
        eval_limit: args.eval_limit,
        backend,
        initial_values,
        collective,
    };
    let period = args.period.unwrap_or(4);
    let defaults = OuterConfig::default();
    let outer = OuterConfig {
        lr: args.outer_lr.unwrap_or(defaults.lr),
        momentum: args.outer_momentum.unwrap_or(defaults.momentum),
        mix: args.mix.unwrap_or(defaults.mix),
    };
    outer
        .validate()
        .map_err(|e| anyhow!("bad outer optimizer flag: {e}"))?;
    Ok(Resolved {
        task,
        cfg,
        period,
        schedule,
        overrides,
        bubble_fill: args.bubble_fill,
        delay: args.delay,
        fragment_delay: args.fragment_delay,
        sync_unit_kb: args.sync_unit_kb,
        outer,
        profile,
        link_spec,
    })
}

/// Resolves `--collective` (default `auto`) for `workers` workers on `backend`; says which
/// collective runs.
fn resolve_collective(
    flag: Option<&str>,
    backend: &Backend,
    workers: usize,
) -> Result<CollectiveChoice> {
    let request: CollectiveRequest = flag
        .unwrap_or("auto")
        .parse()
        .map_err(|e: String| anyhow!(e))?;
    // A mixed node (`--device cuda:0,cpu`) exchanges through host memory: auto keeps cpu.
    let cuda = backend.devices().iter().all(|d| d.starts_with("cuda"));
    let choice = select_collective(request, cuda, workers, probe_restarting)?;
    tracing::info!("collective: {choice}");
    Ok(choice)
}

/// [`probe_nccl`], restarting this process once with the NCCL folder on `LD_LIBRARY_PATH` when
/// NCCL was found only where the dynamic loader does not look (pip's `libnccl.so.2`).
pub(crate) fn probe_restarting() -> std::result::Result<NcclInfo, GpuProbeError> {
    // libtorch's CUDA library maps the NCCL it links; the probe must see it to pick the same
    // one (two NCCLs in one process break each other's communicators). Without a CUDA torch
    // there is nothing to load and the probe searches as usual.
    if let Err(e) = tch_backend::load_torch_cuda() {
        tracing::debug!("no libtorch CUDA library loaded before the NCCL probe: {e}");
    }
    match probe_nccl() {
        Err(GpuProbeError::NcclNotOnLoaderPath { library, dir })
            if std::env::var_os(gpu_probe::REEXEC_ENV).is_none() =>
        {
            tracing::info!(
                "restarting with {} on LD_LIBRARY_PATH so NCCL ({}) can load",
                dir.display(),
                library.display()
            );
            let e = gpu_probe::reexec_with_loader_path(&dir);
            tracing::warn!("[WARN] could not restart with NCCL on the loader path: {e}");
            Err(GpuProbeError::NcclNotOnLoaderPath { library, dir })
        }
        r => r,
    }
}

/// Reads a safetensors checkpoint for `task`'s model on `backend` and returns the starting
/// values (`ModelReplica::flat_values` layout); errors name the file and what did not fit.
pub fn load_checkpoint(task: &Task, backend: &Backend, seed: u64, path: &Path) -> Result<Vec<f32>> {
    let bytes = std::fs::read(path)
        .with_context(|| format!("cannot read checkpoint {}", path.display()))?;
    let mut replica = backend.build_replica(task, seed, &OptimizerConfig::sgd())?;
    let wanted: Vec<(String, Vec<usize>)> = replica
        .state_tensors()
        .into_iter()
        .map(|(n, s, _)| (n, s))
        .collect();
    let (tensors, _) = checkpoint::deserialize_named(&bytes, &wanted, task.model.name())
        .with_context(|| format!("cannot load checkpoint {}", path.display()))?;
    replica
        .load_state_tensors(&tensors)
        .with_context(|| format!("cannot load checkpoint {}", path.display()))?;
    tracing::info!("starting from checkpoint {}", path.display());
    Ok(replica.flat_values())
}

/// Writes a model's state (`ModelReplica::state_tensors`, e.g. a run's `final_state`) as a
/// safetensors checkpoint with PyTorch's names, atomically.
pub fn save_checkpoint(
    task: &Task,
    state: &[NamedTensor],
    path: &Path,
    meta: BTreeMap<String, String>,
) -> Result<()> {
    let mut meta = meta;
    meta.insert("dreamddp.dataset".into(), task.dataset.clone());
    let bytes = checkpoint::serialize_named(state, task.model.name(), &meta)?;
    if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent)
            .with_context(|| format!("cannot create {}", parent.display()))?;
    }
    node::cluster_model::write_file_atomic(path, &bytes)
        .with_context(|| format!("cannot write checkpoint {}", path.display()))
}

fn parse_overrides(s: &str) -> Result<Vec<(String, u64)>> {
    s.split(',')
        .filter(|p| !p.trim().is_empty())
        .map(|p| {
            let (name, k) = p.split_once('=').ok_or_else(|| {
                anyhow!("bad --layer-period entry '{p}': expected LAYER=PERIOD, e.g. head=1")
            })?;
            let k: u64 = k.trim().parse().map_err(|_| {
                anyhow!("bad --layer-period entry '{p}': '{k}' is not a whole number")
            })?;
            Ok((name.trim().to_string(), k))
        })
        .collect()
}

/// What `train --compare` runs: a strategy, or the paper's fixed DreamDDP configuration
/// (`dreamddp-paper`), named as the simulator names them.
pub use simulations::clusters::SimStrategy as Variant;

/// Builds the sync plan of `r` for `variant` (profiling the model when the schedule needs it).
pub fn plan_for(r: &Resolved, variant: impl Into<Variant>) -> Result<SyncPlan> {
    let variant = variant.into();
    let strategy = variant.strategy;
    let (schedule, delay, sync_unit_kb) = if variant.paper {
        // The paper's algorithm: whole layers, the profiled DFS, no delay.
        (ScheduleKind::Profiled, Some(1), Some(0))
    } else {
        (
            r.schedule,
            match strategy {
                Strategy::StreamingDiloco => r.fragment_delay,
                _ => r.delay,
            },
            r.sync_unit_kb,
        )
    };
    build_plan(&PlanInputs {
        task: &r.task,
        strategy,
        period: r.period,
        schedule,
        overrides: &r.overrides,
        bubble_filling: r.bubble_fill,
        delay,
        sync_unit_kb,
        outer: r.outer,
        link: &r.cfg.link,
        workers: r.cfg.workers,
        batch: r.cfg.batch,
        seed: r.cfg.seed,
        measured: r.profile.as_ref(),
        backend: &r.cfg.backend,
    })
    .map_err(|e| anyhow!("{e}"))
}

/// Trains one strategy (or the paper's DreamDDP) with a progress bar.
pub fn train_one(r: &Resolved, variant: impl Into<Variant>, quiet: bool) -> Result<RunReport> {
    let variant = variant.into();
    let strategy = variant.strategy;
    let plan = plan_for(r, variant)?;
    tracing::debug!("sync plan:\n{}", plan.describe());
    let mut cfg = r.cfg.clone();
    cfg.strategy = strategy;
    let bar = if quiet {
        ProgressBar::hidden()
    } else {
        ProgressBar::new(cfg.steps)
    };
    bar.set_style(
        ProgressStyle::with_template(
            "{prefix:>9} [{elapsed_precise}] {wide_bar} {pos}/{len} steps  loss {msg}",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar.set_prefix(variant.name());
    bar.enable_steady_tick(Duration::from_millis(250));
    let b = bar.clone();
    let report = train(
        &r.task,
        &cfg,
        plan,
        Box::new(move |step, loss| {
            b.set_position(step);
            if step % 10 == 0 {
                b.set_message(format!("{loss:.4}"));
            }
        }),
    )
    .with_context(|| format!("training with strategy {} failed", variant.name()))?;
    bar.finish_and_clear();
    let mut report = report;
    report.strategy = variant.name().to_string();
    Ok(report)
}

/// A one-line human summary of a report.
pub fn summary_line(r: &RunReport) -> String {
    let metric = match r.test_accuracy {
        Some(a) => format!("test accuracy {:.2}%", a * 100.0),
        None => format!("validation loss {:.3} nats/char", r.val_loss),
    };
    format!(
        "{} {} on {} ({} workers, {}, {} steps): {metric}; {} synchronized; {:.1} s wall, {:.2} ms/step",
        r.strategy,
        r.model,
        r.dataset,
        r.workers,
        r.backend,
        r.steps,
        human_bytes(r.bytes_sent),
        r.wall_seconds,
        r.mean_step_ms
    )
}

/// Bytes as B/KiB/MiB/GiB.
pub fn human_bytes(b: u64) -> String {
    let b = b as f64;
    if b >= 1024.0 * 1024.0 * 1024.0 {
        format!("{:.2} GiB", b / (1024.0 * 1024.0 * 1024.0))
    } else if b >= 1024.0 * 1024.0 {
        format!("{:.1} MiB", b / (1024.0 * 1024.0))
    } else if b >= 1024.0 {
        format!("{:.1} KiB", b / 1024.0)
    } else {
        format!("{b} B")
    }
}

/// Writes `value` as pretty JSON to `path`, creating parent folders.
pub fn write_json(path: &Path, value: &impl serde::Serialize) -> Result<()> {
    if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent)
            .with_context(|| format!("cannot create {}", parent.display()))?;
    }
    let text = serde_json::to_string_pretty(value)?;
    std::fs::write(path, text).with_context(|| format!("cannot write {}", path.display()))
}

/// `dreamddp train`.
pub fn run(args: TrainArgs) -> Result<()> {
    let args = args.merge_config()?;
    if args.compare {
        return crate::compare::run(&args);
    }
    let r = resolve(&args)?;
    tracing::info!(
        "training {} on {} with {} workers ({}), strategy {}, period {}, link {}",
        r.task.model.name(),
        r.task.dataset,
        r.cfg.workers,
        r.cfg.backend,
        r.cfg.strategy,
        r.period,
        r.cfg.link
    );
    let report = train_one(&r, r.cfg.strategy, args.quiet)?;
    println!("{}", summary_line(&report));
    if let Some(path) = &args.save {
        let meta = BTreeMap::from([("dreamddp.strategy".to_string(), report.strategy.clone())]);
        save_checkpoint(&r.task, &report.final_state, path, meta)?;
        println!("checkpoint written to {}", path.display());
    }
    if let Some(out) = &args.out {
        write_json(out, &report)?;
        println!("summary written to {}", out.display());
    }
    Ok(())
}

/// `dreamddp plan`: prints the plan without training.
pub fn plan(args: TrainArgs) -> Result<()> {
    let args = args.merge_config()?;
    let r = resolve(&args)?;
    let plan = plan_for(&r, r.cfg.strategy)?;
    println!("{}", plan.describe());
    Ok(())
}
