//! Builds a node's [`SyncPlan`]: the model's sync units, the strategy's period and per-layer
//! overrides, and — for DreamDDP's `profiled` schedule — a profile measured on this machine
//! (backward time per layer) combined with the link model (communication time per layer).

use engine::config_search;
use engine::outer::OuterConfig;
use engine::plan::{PlanConfig, PlanError, ScheduleKind, Strategy, SyncPlan};
use engine::schedule::ModelProfile;

use crate::profile::{profile_step, StepProfile};
use engine::optim::OptimizerConfig;
use engine::replica::ReplicaError;
use node::backend::{Backend, BackendError};
use node::link::LinkModel;
use node::task::Task;

/// What [`build_plan`] needs.
pub struct PlanInputs<'a> {
    /// The task (model + data) to profile.
    pub task: &'a Task,
    /// Strategy.
    pub strategy: Strategy,
    /// Period H.
    pub period: u64,
    /// DreamDDP schedule kind.
    pub schedule: ScheduleKind,
    /// Per-layer period overrides by layer name.
    pub overrides: &'a [(String, u64)],
    /// DreamDDP bubble filling (extra syncs on an idle link).
    pub bubble_filling: bool,
    /// Steps an average may land after its launch ([`PlanConfig::delay`]; `None`: chosen).
    pub delay: Option<u64>,
    /// `dreamddp`'s largest sync unit in KiB (0: whole layers; `None`: chosen by the
    /// configuration search, whole layers without it). Other strategies keep whole layers.
    pub sync_unit_kb: Option<u64>,
    /// Outer optimizer of diloco / streaming-diloco.
    pub outer: OuterConfig,
    /// The link the collective is shaped with.
    pub link: &'a LinkModel,
    /// Worker threads.
    pub workers: usize,
    /// Per-worker batch (profiling uses the same batch as training).
    pub batch: usize,
    /// Seed.
    pub seed: u64,
    /// A profile already measured for this task and batch (e.g. by `--link auto`); when
    /// `None` and the schedule needs one, the model is profiled here.
    pub measured: Option<&'a StepProfile>,
    /// The backend that trains (and is profiled).
    pub backend: &'a Backend,
}

/// Why a plan could not be built.
#[derive(Debug, thiserror::Error)]
pub enum PlanBuildError {
    /// The plan itself is invalid (e.g. an override names no layer).
    #[error(transparent)]
    Plan(#[from] PlanError),
    /// The backend could not build the model to plan for.
    #[error(transparent)]
    Backend(#[from] BackendError),
    /// Profiling the model failed.
    #[error("profiling the model failed: {0}")]
    Profile(#[from] ReplicaError),
}

/// Builds the plan; profiles the model first when DreamDDP's `profiled` schedule or its
/// configuration search (`auto` schedule or no fixed delay) needs it.
pub fn build_plan(inp: &PlanInputs) -> Result<SyncPlan, PlanBuildError> {
    let mut replica = inp
        .backend
        .build_replica(inp.task, inp.seed, &OptimizerConfig::sgd())?;
    let units = replica.unit_infos();
    let mut cfg = PlanConfig::new(inp.strategy, inp.period);
    cfg.schedule = inp.schedule;
    cfg.period_overrides = inp.overrides.to_vec();
    cfg.bubble_filling = inp.bubble_filling;
    cfg.delay = inp.delay;
    cfg.outer = inp.outer;
    cfg.sync_unit_params = PlanConfig::sync_unit_params_for(inp.strategy, inp.sync_unit_kb);
    // The profiled schedule and the configuration search both need timings.
    let needs_profile = inp.strategy == Strategy::DreamDdp
        && (inp.schedule != ScheduleKind::Equal || inp.delay.is_none());
    let profile = if needs_profile {
        let p = match inp.measured {
            Some(p) => p.clone(),
            None => profile_step(
                inp.task,
                replica.as_mut(),
                inp.batch,
                inp.workers,
                5,
                inp.seed,
            )?,
        };
        Some(ModelProfile {
            forward_s: p.forward_s,
            layers: p.layer_profiles(inp.link, inp.workers),
        })
    } else {
        None
    };
    let name = inp.task.model.name();
    Ok(match &profile {
        Some(p) => {
            // One exchange of a bucket: the ring all-reduce of its bytes on the shaped link.
            let comm = |params: usize| inp.link.ring_allreduce_seconds(params * 4, inp.workers);
            config_search::search(name, &units, &cfg, p, &comm)?
        }
        None => SyncPlan::new(name, &units, &cfg, None)?,
    })
}
