//! The node training loop: N worker threads, each with an identical model replica and its
//! own data shard, executing one sync strategy through the intra-node collective.
//!
//! Per step and worker: forward → loss → backward with a per-layer hook. What the hook and
//! the end of the step do is decided by the worker's sans-IO
//! [`WorkerSyncMachine`](crate::sync_machine::WorkerSyncMachine) (the clusters simulation
//! drives the same machine); this module executes its actions on the real model and
//! collective. Per strategy:
//!
//! | strategy | in the backward hook | after backward |
//! |---|---|---|
//! | `ssgd` | nothing | all-reduce all gradients (one bucket), wait, step every layer |
//! | `wfbp` | when a gradient bucket is complete, launch its all-reduce | wait each bucket, step |
//! | `localsgd` | step the layer locally | every H-th step: all-reduce all parameters, wait |
//! | `dreamddp`, `plsgd` | first land the bucket's average launched `delay` steps earlier (wait on its handle, write it), then step the layer; if due, launch its bucket's parameter all-reduce as soon as the bucket is complete | nothing: the handle is waited right before the layer's optimizer step `delay` steps later |
//! | `diloco` | step the layer locally | every H-th step: all-reduce all parameters, wait, outer Nesterov step |
//! | `streaming-diloco` | step the layer locally | land the fragments launched `delay` steps ago (outer step, mix); launch the fragments due now |
//!
//! DreamDDP's wait is deferred to the layer's next optimizer step (DESIGN.md: "waited
//! before that layer's optimizer step"), so a layer's communication overlaps the rest of
//! this backward, the next forward and the next backward down to that layer. Nothing touches
//! the layer in between, so writing the average is exactly the asynchrony rule
//! θ ← θ_global + (θ_now − θ_at_cut) with θ_now = θ_at_cut; the next forward reads the
//! replica's own (one step stale) values of that layer. With a delay of more than one step
//! the layer has moved on meanwhile, and the average is rebased onto that progress
//! ([`engine::outer::rebase`], with the copy of what this worker sent).
//!
//! Evaluation pauses every worker at a barrier; its time is excluded from step times.

use std::collections::BTreeMap;
use std::sync::{Arc, Barrier, Mutex};
use std::time::Instant;

use engine::checkpoint::NamedTensor;
use engine::lr::LrSchedule;
use engine::optim::OptimizerConfig;
use engine::outer::{self, Landing, OuterState};
use engine::plan::{Strategy, SyncPlan};
use engine::replica::{
    append_unit_range, write_unit_range, ModelReplica, ReplicaError, UnitData, UnitMut,
};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use serde::Serialize;
use thiserror::Error;

use crate::device_sync::{DeviceCollective, DeviceLanding, StagedPiece};
use crate::gpu_probe::CollectiveChoice;
use crate::sync_machine::{SyncAction, UnitSlice, WorkerSyncMachine};
use node::backend::{Backend, BackendError};
use node::collective::{AbortOnPanic, Collective, CollectiveError, ReduceHandle, ReduceKey};
use node::link::LinkModel;
use node::task::{Batch, Task, TaskData};
use node::thread_collective::ThreadCollective;

/// Everything that defines one training run on one node.
#[derive(Clone, Debug)]
pub struct TrainConfig {
    /// Worker threads (replicas).
    pub workers: usize,
    /// Sync strategy.
    pub strategy: Strategy,
    /// Optimizer steps per worker.
    pub steps: u64,
    /// Per-worker batch size.
    pub batch: usize,
    /// Peak learning rate.
    pub lr: f32,
    /// Linear warmup steps (then cosine decay to 10% of `lr`).
    pub warmup: u64,
    /// Optimizer.
    pub optimizer: OptimizerConfig,
    /// Interconnect model the collective is shaped with.
    pub link: LinkModel,
    /// Seed of the model init and the data order.
    pub seed: u64,
    /// Evaluate every this many steps (0 = only at the end).
    pub eval_every: u64,
    /// Cap on test examples (images) or validation batches (chars) per evaluation.
    pub eval_limit: Option<usize>,
    /// Compute backend of every replica.
    pub backend: Backend,
    /// Starting weights (a vector made by `Model::flat_values`, e.g. from `--load`) instead of
    /// the seed's initial weights.
    pub initial_values: Option<Arc<Vec<f32>>>,
    /// The intra-node collective (resolved from `--collective`).
    pub collective: CollectiveChoice,
}

/// Errors that stop a training run.
#[derive(Debug, Error)]
pub enum TrainError {
    /// The collective failed (a worker died, mismatched buckets).
    #[error("collective failed: {0}")]
    Collective(#[from] CollectiveError),
    /// The loss became NaN or infinite.
    #[error("training diverged at step {step} on worker {rank} (loss {loss}); lower --lr or raise --warmup")]
    Diverged {
        /// Step.
        step: u64,
        /// Worker.
        rank: usize,
        /// The loss value seen.
        loss: f32,
    },
    /// A worker thread panicked.
    #[error("worker {0} panicked: {1}")]
    WorkerPanicked(usize, String),
    /// Bad configuration.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// The model's output does not fit the data set's labels (e.g. a TorchScript model with
    /// too few classes).
    #[error("evaluation failed: {0}")]
    Evaluation(String),
    /// The backend could not build a replica (not compiled in, no device, unsupported model).
    #[error(transparent)]
    Backend(#[from] BackendError),
    /// A batch did not fit the model or the backend failed mid-step.
    #[error("worker {rank} at step {step}: {source}")]
    Replica {
        /// Worker.
        rank: usize,
        /// Step.
        step: u64,
        /// What went wrong.
        source: ReplicaError,
    },
}

/// One point of the learning curve (measured on worker 0's replica).
#[derive(Clone, Debug, Serialize)]
pub struct CurvePoint {
    /// Steps completed.
    pub step: u64,
    /// Training seconds so far (evaluation excluded).
    pub train_seconds: f64,
    /// Bytes sent by all workers so far.
    pub bytes_sent: u64,
    /// Mean training loss since the previous point.
    pub train_loss: f64,
    /// Test accuracy (classification), 0..1.
    pub test_accuracy: Option<f64>,
    /// Test / validation loss.
    pub test_loss: f64,
}

/// The summary of one run; serialized as the `--out` JSON.
#[derive(Clone, Debug, Serialize)]
pub struct RunReport {
    /// Strategy name.
    pub strategy: String,
    /// Compute backend and device (`builtin on cpu`, `tch on cuda:0`).
    pub backend: String,
    /// Model name.
    pub model: String,
    /// Data set name.
    pub dataset: String,
    /// Worker threads.
    pub workers: usize,
    /// Steps per worker.
    pub steps: u64,
    /// Per-worker batch.
    pub batch: usize,
    /// Period H (localsgd, dreamddp).
    pub period: u64,
    /// Link model as given.
    pub link: String,
    /// Final test accuracy of the averaged model (classification).
    pub test_accuracy: Option<f64>,
    /// Final validation loss in nats per character (gpt-tiny), or test loss.
    pub val_loss: f64,
    /// Bytes sent over the collective by all workers (ring all-reduce accounting).
    pub bytes_sent: u64,
    /// Wall-clock seconds of the whole run, evaluation included.
    pub wall_seconds: f64,
    /// Training seconds (evaluation excluded), mean over workers.
    pub train_seconds: f64,
    /// Mean (amortized) step time in milliseconds.
    pub mean_step_ms: f64,
    /// Number of parameter/gradient syncs of each layer.
    pub per_layer_syncs: BTreeMap<String, u64>,
    /// Learning curve.
    pub curve: Vec<CurvePoint>,
    /// The final model (the average of the replicas) as named tensors with PyTorch's names
    /// (`ModelReplica::state_tensors`): what `--save` writes. Not part of the JSON summary.
    #[serde(skip)]
    pub final_state: Vec<NamedTensor>,
}

struct Shared {
    task: Task,
    cfg: TrainConfig,
    plan: SyncPlan,
    collective: Arc<dyn Collective>,
    /// The same collective's device path, when it has one and the plan can use it.
    device: Option<Arc<dyn DeviceCollective>>,
    barrier: Barrier,
    curve: Mutex<Vec<CurvePoint>>,
    progress: Box<dyn Fn(u64, f32) + Send + Sync>,
}

struct WorkerResult {
    final_params: Vec<f32>,
    train_seconds: f64,
    syncs: BTreeMap<String, u64>,
}

/// Trains `task` with `cfg` and `plan` on `cfg.workers` threads. `progress(step, loss)` is
/// called by worker 0 after every step.
pub fn train(
    task: &Task,
    cfg: &TrainConfig,
    plan: SyncPlan,
    progress: Box<dyn Fn(u64, f32) + Send + Sync>,
) -> Result<RunReport, TrainError> {
    if cfg.workers == 0 {
        return Err(TrainError::Config("--workers must be at least 1".into()));
    }
    if cfg.batch == 0 || cfg.steps == 0 {
        return Err(TrainError::Config(
            "--batch and --steps must be at least 1".into(),
        ));
    }
    if let TaskData::Images(tt) = &task.data {
        if tt.train.len() < cfg.workers {
            return Err(TrainError::Config(format!(
                "{} training examples cannot be sharded over {} workers",
                tt.train.len(),
                cfg.workers
            )));
        }
    }
    let (collective, device): (Arc<dyn Collective>, _) = match cfg.collective {
        CollectiveChoice::Cpu => (
            Arc::new(ThreadCollective::new(cfg.workers, cfg.link)?),
            None,
        ),
        CollectiveChoice::Nccl => nccl_collective(cfg.workers)?,
    };
    let device = device.filter(|_| device_path_wanted(&plan));
    if cfg.collective == CollectiveChoice::Nccl {
        tracing::info!(
            "NCCL buckets staged {}",
            if device.is_some() {
                "in GPU memory for units on the rank's GPU (device path)"
            } else {
                "through the host (the plan's landing needs host arithmetic, or DREAMDDP_NCCL_STAGING=host)"
            }
        );
    }
    let shared = Arc::new(Shared {
        task: task.clone(),
        cfg: cfg.clone(),
        plan,
        collective: collective.clone(),
        device,
        barrier: Barrier::new(cfg.workers),
        curve: Mutex::new(Vec::new()),
        progress,
    });
    let started = Instant::now();
    let handles: Vec<_> = (0..cfg.workers)
        .map(|rank| {
            let shared = shared.clone();
            std::thread::Builder::new()
                .name(format!("worker-{rank}"))
                .spawn(move || {
                    let _guard = AbortOnPanic::new(shared.collective.as_ref(), rank);
                    let r = run_worker(rank, &shared);
                    if let Err(e) = &r {
                        shared
                            .collective
                            .shutdown(&format!("worker {rank} stopped: {e}"));
                    }
                    r
                })
                .map_err(|e| TrainError::Config(format!("cannot spawn worker thread: {e}")))
        })
        .collect::<Result<_, _>>()?;
    let mut results = Vec::with_capacity(cfg.workers);
    let mut first_err = None;
    for (rank, h) in handles.into_iter().enumerate() {
        match h.join() {
            Ok(Ok(r)) => results.push(r),
            Ok(Err(e)) => {
                // Keep the root cause, not the PeerGone errors it caused in the others.
                if first_err.is_none()
                    || !matches!(e, TrainError::Collective(CollectiveError::PeerGone { .. }))
                {
                    first_err.get_or_insert(e);
                }
            }
            Err(p) => {
                collective.shutdown(&format!("worker {rank} panicked"));
                let msg = p
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default();
                first_err = Some(TrainError::WorkerPanicked(rank, msg));
            }
        }
    }
    if let Some(e) = first_err {
        return Err(e);
    }

    // The model a user gets is the average of the replicas (identical for ssgd/wfbp). For
    // strategies whose replicas differ this is one more full all-reduce: count its bytes.
    let n = results[0].final_params.len();
    let mut avg = vec![0.0f32; n];
    for r in &results {
        for (a, v) in avg.iter_mut().zip(&r.final_params) {
            *a += v;
        }
    }
    let inv = 1.0 / results.len() as f32;
    avg.iter_mut().for_each(|a| *a *= inv);
    let mut bytes_sent: u64 = (0..cfg.workers).map(|r| collective.bytes_sent(r)).sum();
    let replicas_differ = cfg.strategy.syncs_parameters()
        && results
            .iter()
            .any(|r| r.final_params != results[0].final_params);
    if replicas_differ {
        bytes_sent += LinkModel::ring_allreduce_bytes_per_rank(n * 4, cfg.workers) as u64
            * cfg.workers as u64;
    }
    let mut final_replica = cfg.backend.build_replica(task, cfg.seed, &cfg.optimizer)?;
    final_replica.set_flat_values(&avg);
    let eval = task
        .evaluate_replica(final_replica.as_mut(), cfg.eval_limit)
        .map_err(TrainError::Evaluation)?;
    let final_state = final_replica.state_tensors();
    let train_seconds = results.iter().map(|r| r.train_seconds).sum::<f64>() / results.len() as f64;
    let curve = std::mem::take(&mut *shared.curve.lock().unwrap_or_else(|p| p.into_inner()));
    Ok(RunReport {
        strategy: cfg.strategy.to_string(),
        backend: cfg.backend.to_string(),
        model: task.model.name().to_string(),
        dataset: task.dataset.clone(),
        workers: cfg.workers,
        steps: cfg.steps,
        batch: cfg.batch,
        period: shared.plan.period(),
        link: cfg.link.to_string(),
        test_accuracy: eval.accuracy,
        val_loss: eval.loss,
        bytes_sent,
        wall_seconds: started.elapsed().as_secs_f64(),
        train_seconds,
        mean_step_ms: train_seconds * 1e3 / cfg.steps as f64,
        per_layer_syncs: results[0].syncs.clone(),
        curve,
        final_state,
    })
}

/// A launched all-reduce: which units it carries, in backward order, and its handle.
struct InFlight {
    units: Vec<UnitSlice>,
    handle: Pending,
    launched: Instant,
}

/// The handle of a launched all-reduce.
enum Pending {
    /// Through [`Collective::all_reduce_mean`]: the average comes back to the host.
    Host(ReduceHandle),
    /// Through [`DeviceCollective::launch_pieces`]: the average stays in GPU memory.
    Device(Box<dyn DeviceLanding>),
}

/// A waited all-reduce's average.
enum Average {
    Host(Vec<f32>),
    Device(Box<dyn DeviceLanding>),
}

impl Average {
    fn len(&self) -> usize {
        match self {
            Self::Host(v) => v.len(),
            Self::Device(d) => d.len(),
        }
    }

    /// Values `offset..offset + len` on the host.
    fn host_range(
        &self,
        offset: usize,
        len: usize,
    ) -> Result<std::borrow::Cow<'_, [f32]>, CollectiveError> {
        match self {
            Self::Host(v) => Ok(std::borrow::Cow::Borrowed(&v[offset..offset + len])),
            Self::Device(d) => d.read_to_host(offset, len).map(std::borrow::Cow::Owned),
        }
    }
}

/// A waited all-reduce whose slices are still being written into the model.
struct Landed {
    values: Average,
    slices_left: usize,
}

/// True when `plan` can take the device path ([`crate::device_sync`]): its averages land by
/// replacement, and `DREAMDDP_NCCL_STAGING` does not ask for the host path.
fn device_path_wanted(plan: &SyncPlan) -> bool {
    plan.landing() == Landing::Replace
        && std::env::var("DREAMDDP_NCCL_STAGING").map_or(true, |v| v != "host")
}

/// Executes the [`SyncAction`]s of one worker's [`WorkerSyncMachine`] on the real model and
/// collective: the trainer's I/O shell around the machine's decisions.
struct SyncExecutor<'a> {
    rank: usize,
    collective: &'a dyn Collective,
    /// The collective's device path ([`crate::device_sync`]), when taken.
    device: Option<&'a dyn DeviceCollective>,
    /// Buckets being staged for the device path.
    device_staging: BTreeMap<ReduceKey, Vec<StagedPiece>>,
    /// Unit names by unit id (logs, per-unit sync counts).
    unit_names: &'a [String],
    staging: BTreeMap<ReduceKey, Vec<f32>>,
    in_flight: BTreeMap<ReduceKey, InFlight>,
    landed: BTreeMap<ReduceKey, Landed>,
    /// What this worker sent, kept for a [`Landing::Rebase`].
    cuts: BTreeMap<ReduceKey, Vec<f32>>,
    /// Outer optimizer of diloco / streaming-diloco.
    outer: OuterState,
    /// Scratch for the current values of a unit.
    scratch: Vec<f32>,
    syncs: BTreeMap<String, u64>,
}

impl SyncExecutor<'_> {
    /// Runs `action`; `unit` is the sync unit it names ([`SyncAction::layer`]).
    fn execute(
        &mut self,
        action: SyncAction,
        unit: Option<&mut dyn UnitMut>,
        lr: f32,
    ) -> Result<(), CollectiveError> {
        match action {
            SyncAction::Stage {
                unit: slice,
                key,
                kind,
            } => {
                let unit = unit.expect("a staged layer");
                if let Some(device) = self.device {
                    let piece = match device_spans(unit, kind.unit_data(), device, self.rank) {
                        Some(spans) => StagedPiece::Device(spans.range(slice.at, slice.len)),
                        None => {
                            let mut values = Vec::with_capacity(slice.len);
                            read_slice(unit, kind.unit_data(), &slice, &mut values);
                            StagedPiece::Host(values)
                        }
                    };
                    self.device_staging.entry(key).or_default().push(piece);
                } else {
                    let buf = self.staging.entry(key).or_default();
                    read_slice(unit, kind.unit_data(), &slice, buf);
                }
            }
            SyncAction::Launch {
                key,
                units,
                landing,
                ..
            } => {
                let launched = Instant::now();
                let handle = if let Some(device) = self.device {
                    debug_assert!(
                        !landing.needs_cut(),
                        "device path plans land by replacement"
                    );
                    let pieces = self.device_staging.remove(&key).unwrap_or_default();
                    // SAFETY: the runs were taken from the units' tensors on this rank's GPU
                    // when they were staged, in this backward (or right after it); the sync
                    // machine steps no staged unit before its bucket launches and the tch
                    // optimizer updates tensors in place, so the runs are still those tensors.
                    Pending::Device(unsafe { device.launch_pieces(self.rank, key, &pieces)? })
                } else {
                    let buf = self.staging.remove(&key).unwrap_or_default();
                    if landing.needs_cut() {
                        self.cuts.insert(key, buf.clone());
                    }
                    Pending::Host(self.collective.all_reduce_mean(self.rank, key, buf)?)
                };
                self.in_flight.insert(
                    key,
                    InFlight {
                        units,
                        handle,
                        launched,
                    },
                );
            }
            SyncAction::Wait { key } => {
                let f = self
                    .in_flight
                    .remove(&key)
                    .expect("the machine waits only for launched collectives");
                let values = match f.handle {
                    Pending::Host(handle) => Average::Host(handle.wait()?),
                    Pending::Device(landing) => {
                        landing.order_compute()?;
                        Average::Device(landing)
                    }
                };
                if self.rank == 0 {
                    log_sync(&f.units, key.bucket, f.launched, values.len() * 4, |u| {
                        self.unit_names[u].clone()
                    });
                }
                self.landed.insert(
                    key,
                    Landed {
                        values,
                        slices_left: f.units.len(),
                    },
                );
            }
            SyncAction::Apply {
                key,
                unit: slice,
                offset,
                kind,
                landing,
            } => {
                let unit = unit.expect("an applied layer");
                let mut landed = self
                    .landed
                    .remove(&key)
                    .expect("the machine applies only waited collectives");
                let len = slice.len;
                let what = kind.unit_data();
                let device_runs = match (&landed.values, landing, self.device) {
                    (Average::Device(_), Landing::Replace, Some(device)) => {
                        device_spans(unit, what, device, self.rank)
                    }
                    _ => None,
                };
                match (device_runs, &landed.values) {
                    (Some(spans), Average::Device(avg)) => {
                        // SAFETY: the runs are the unit's tensors on the rank's GPU, now; the
                        // compute stream was ordered after the all-reduce when it was waited.
                        unsafe { avg.write_to_device(offset, &spans.range(slice.at, len))? };
                    }
                    _ => {
                        let average = landed.values.host_range(offset, len)?;
                        self.land_on_host(unit, &slice, what, key, offset, landing, &average);
                    }
                }
                landed.slices_left -= 1;
                if landed.slices_left == 0 {
                    self.cuts.remove(&key);
                } else {
                    self.landed.insert(key, landed);
                }
                if self.rank == 0 {
                    *self
                        .syncs
                        .entry(self.unit_names[slice.id].clone())
                        .or_default() += 1;
                }
            }
            SyncAction::StepLayer { .. } => {
                unit.expect("a stepped layer").step(lr);
            }
            SyncAction::SetAnchor { unit: slice } => {
                self.scratch.clear();
                read_slice(
                    unit.expect("an anchored layer"),
                    engine::replica::UnitData::Values,
                    &slice,
                    &mut self.scratch,
                );
                self.outer.set_anchor(slice.id, &self.scratch);
            }
        }
        Ok(())
    }

    /// Writes `average` (values `offset..` of collective `key`) into `slice` of `unit` as
    /// `landing` says, on the host.
    #[allow(clippy::too_many_arguments)]
    fn land_on_host(
        &mut self,
        unit: &mut dyn UnitMut,
        slice: &UnitSlice,
        what: UnitData,
        key: ReduceKey,
        offset: usize,
        landing: Landing,
        average: &[f32],
    ) {
        match landing {
            Landing::Replace => write_slice(unit, what, slice, average),
            Landing::Rebase => {
                let cut = &self.cuts.get(&key).expect("a rebase keeps its cut")
                    [offset..offset + average.len()];
                self.scratch.clear();
                read_slice(unit, what, slice, &mut self.scratch);
                outer::rebase(average, cut, &mut self.scratch);
                write_slice(unit, what, slice, &self.scratch);
            }
            Landing::Outer { mix } => {
                self.scratch.clear();
                read_slice(unit, what, slice, &mut self.scratch);
                self.outer.land(slice.id, average, &mut self.scratch, mix);
                write_slice(unit, what, slice, &self.scratch);
            }
        }
    }

    /// Runs every pending action of `machine` on `replica` (outside backward).
    fn drain(
        &mut self,
        machine: &mut WorkerSyncMachine,
        replica: &mut dyn ModelReplica,
        lr: f32,
    ) -> Result<(), CollectiveError> {
        while let Some(action) = machine.poll() {
            match action.layer() {
                Some(l) => {
                    let mut result = Ok(());
                    let mut action = Some(action);
                    replica.with_unit(l, &mut |unit| {
                        if let Some(a) = action.take() {
                            result = self.execute(a, Some(unit), lr);
                        }
                    });
                    result?;
                }
                None => self.execute(action, None, lr)?,
            }
        }
        Ok(())
    }
}

fn run_worker(rank: usize, sh: &Shared) -> Result<WorkerResult, TrainError> {
    let cfg = &sh.cfg;
    let task = &sh.task;
    let mut replica = worker_backend(cfg, rank).build_replica(task, cfg.seed, &cfg.optimizer)?;
    if let Some(values) = &cfg.initial_values {
        replica.set_flat_values(values);
    }
    // A model whose output does not fit the labels fails here, on every worker, before any
    // barrier, rather than in an evaluation between two barriers.
    task.evaluate_replica(replica.as_mut(), Some(2))
        .map_err(TrainError::Evaluation)?;
    let schedule = LrSchedule {
        base_lr: cfg.lr,
        warmup_steps: cfg.warmup,
        total_steps: cfg.steps,
        min_lr: cfg.lr * 0.1,
    };
    let mut sampler = task
        .sampler(rank, cfg.workers, cfg.seed)
        .map_err(|e| TrainError::Config(e.to_string()))?;
    let mut rng = ChaCha8Rng::seed_from_u64(
        cfg.seed ^ (0x9E37_79B9_7F4A_7C15u64.wrapping_mul(rank as u64 + 1)),
    );
    let mut batch = Batch::default();
    let unit_names: Vec<String> = sh.plan.units().iter().map(|u| u.name.clone()).collect();
    let mut machine = WorkerSyncMachine::new(&sh.plan);
    let mut exec = SyncExecutor {
        rank,
        collective: sh.collective.as_ref(),
        device: sh.device.as_deref(),
        device_staging: BTreeMap::new(),
        unit_names: &unit_names,
        staging: BTreeMap::new(),
        in_flight: BTreeMap::new(),
        landed: BTreeMap::new(),
        cuts: BTreeMap::new(),
        outer: OuterState::new(sh.plan.outer(), unit_names.len()),
        scratch: Vec::new(),
        syncs: unit_names.iter().map(|n| (n.clone(), 0)).collect(),
    };
    let mut train_seconds = 0.0f64;
    let mut loss_sum = 0.0f64;
    let mut loss_count = 0u64;

    for step in 0..cfg.steps {
        let lr = schedule.lr_at(step);
        if matches!(task.data, TaskData::Images(_)) {
            batch.indices = sampler.next_batch(cfg.batch);
        }
        task.fill_batch(&mut batch, &mut rng, cfg.batch);

        let t0 = Instant::now();
        machine.begin_step(step);
        // The machine's per-layer actions touch only the unit of the hook, so they run
        // inside it: a launch overlaps the rest of backward, a wait blocks it.
        let mut hook_error: Option<CollectiveError> = None;
        let loss = {
            let machine = &mut machine;
            let exec = &mut exec;
            let hook_error = &mut hook_error;
            let mut hook = |idx: usize, unit: &mut dyn UnitMut| {
                machine.layer_grads_ready(idx);
                while let Some(action) = machine.poll() {
                    if hook_error.is_some() {
                        continue;
                    }
                    debug_assert!(action.layer().is_none_or(|l| l == idx));
                    if let Err(e) = exec.execute(action, Some(&mut *unit), lr) {
                        *hook_error = Some(e);
                    }
                }
            };
            replica
                .forward_backward(&batch.input, &batch.targets, &mut hook)
                .map_err(|source| TrainError::Replica { rank, step, source })?
        };
        if let Some(e) = hook_error {
            return Err(e.into());
        }
        if !loss.is_finite() {
            return Err(TrainError::Diverged { step, rank, loss });
        }
        loss_sum += loss as f64;
        loss_count += 1;
        machine.backward_done();
        exec.drain(&mut machine, replica.as_mut(), lr)?;
        train_seconds += t0.elapsed().as_secs_f64();
        if rank == 0 {
            (sh.progress)(step + 1, loss);
        }

        let last = step + 1 == cfg.steps;
        if cfg.eval_every > 0 && ((step + 1) % cfg.eval_every == 0 || last) {
            sh.barrier.wait();
            if rank == 0 {
                let eval = task
                    .evaluate_replica(replica.as_mut(), cfg.eval_limit)
                    .map_err(TrainError::Evaluation)?;
                let bytes: u64 = (0..cfg.workers).map(|r| sh.collective.bytes_sent(r)).sum();
                let point = CurvePoint {
                    step: step + 1,
                    train_seconds,
                    bytes_sent: bytes,
                    train_loss: loss_sum / loss_count.max(1) as f64,
                    test_accuracy: eval.accuracy,
                    test_loss: eval.loss,
                };
                sh.curve
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .push(point);
                loss_sum = 0.0;
                loss_count = 0;
            }
            sh.barrier.wait();
        }
    }
    // DreamDDP: land the averages still in flight after the last step.
    let drain_started = Instant::now();
    machine.finish();
    exec.drain(&mut machine, replica.as_mut(), 0.0)?;
    train_seconds += drain_started.elapsed().as_secs_f64();
    Ok(WorkerResult {
        final_params: replica.flat_values(),
        train_seconds,
        syncs: exec.syncs,
    })
}

/// Appends `slice` of `unit`'s gradients or values to `out`.
fn read_slice(unit: &dyn UnitMut, what: UnitData, slice: &UnitSlice, out: &mut Vec<f32>) {
    append_unit_range(unit, what, slice.at, slice.len, slice.layer_len, out);
}

/// Overwrites `slice` of `unit`'s gradients or values from `src`.
fn write_slice(unit: &mut dyn UnitMut, what: UnitData, slice: &UnitSlice, src: &[f32]) {
    write_unit_range(unit, what, slice.at, slice.layer_len, src);
}

/// `unit`'s runs on `device`'s GPU for `rank`, when it lives there.
fn device_spans(
    unit: &dyn UnitMut,
    what: UnitData,
    device: &dyn DeviceCollective,
    rank: usize,
) -> Option<engine::replica::DeviceSpans> {
    unit.device_spans(what)
        .filter(|s| s.device == device.device_of(rank))
}

fn log_sync(
    units: &[UnitSlice],
    bucket: u32,
    launched: Instant,
    bytes: usize,
    name: impl Fn(usize) -> String,
) {
    tracing::debug!(
        "[SYNC] layer={} bucket={} bytes={} ms={:.3}",
        units
            .iter()
            .map(|u| name(u.id))
            .collect::<Vec<_>>()
            .join("+"),
        bucket,
        bytes,
        launched.elapsed().as_secs_f64() * 1e3
    );
}

/// A collective and its device path ([`crate::device_sync`]), when it has one.
type CollectivePair = (Arc<dyn Collective>, Option<Arc<dyn DeviceCollective>>);

/// The NCCL collective over GPUs `0..workers` (feature `nccl`), with its device path.
#[cfg(feature = "nccl")]
fn nccl_collective(workers: usize) -> Result<CollectivePair, TrainError> {
    let nccl = crate::nccl::NcclCollective::new(workers)
        .map(Arc::new)
        .map_err(|e| TrainError::Config(format!("--collective nccl: {e}")))?;
    Ok((nccl.clone(), Some(nccl)))
}

/// Without feature `nccl` there is no NCCL collective to run.
#[cfg(not(feature = "nccl"))]
fn nccl_collective(_workers: usize) -> Result<CollectivePair, TrainError> {
    Err(TrainError::Config(format!(
        "--collective nccl: {}",
        crate::gpu_probe::GpuProbeError::NotBuilt
    )))
}

/// The backend worker `rank` trains on: its entry of the device list
/// ([`Backend::for_worker`]); with the NCCL collective and one CUDA device for every worker,
/// the rank's own GPU (`cuda:<rank>`, where NCCL puts the rank), so its units take the device
/// path.
fn worker_backend(cfg: &TrainConfig, rank: usize) -> Backend {
    let own = cfg.backend.for_worker(rank);
    match own {
        Backend::Tch { device }
            if cfg.collective == CollectiveChoice::Nccl
                && !cfg.backend.is_mixed()
                && device.starts_with("cuda") =>
        {
            Backend::Tch {
                device: format!("cuda:{rank}"),
            }
        }
        other => other,
    }
}

#[cfg(test)]
#[path = "trainer_tests.rs"]
mod tests;
