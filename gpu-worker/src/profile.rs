//! Profiling for the DreamDDP schedule: measured per-unit backward times of this task on
//! this machine, on the backend that trains it, and per-layer communication times from the link model.

use std::time::Instant;

use engine::replica::{ModelReplica, ReplicaError};
use engine::schedule::LayerProfile;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use serde::Serialize;

use node::link::LinkModel;
use node::task::{Batch, Task, TaskData};

/// Measured compute profile of one training step.
#[derive(Clone, Debug, Serialize)]
pub struct StepProfile {
    /// Forward + loss seconds.
    pub forward_s: f64,
    /// Whole backward seconds.
    pub backward_s: f64,
    /// Per sync unit, in backward order (output head first): name, model index, params, seconds
    /// from the previous unit's gradient (or the start of backward) to this unit's gradient.
    pub units: Vec<(String, usize, usize, f64)>,
    /// Slowdown applied because more workers than cores share this machine.
    pub contention: f64,
}

impl StepProfile {
    /// The per-layer profiles the DreamDDP scheduler takes, with communication times from `link`.
    pub fn layer_profiles(&self, link: &LinkModel, workers: usize) -> Vec<LayerProfile> {
        self.units
            .iter()
            .map(|(name, index, params, secs)| LayerProfile {
                name: name.clone(),
                index: *index,
                params: *params,
                backward_s: secs * self.contention,
                comm_s: link.ring_allreduce_seconds(params * 4, workers),
            })
            .collect()
    }

    /// Seconds one all-reduce of the whole model takes on `link`.
    pub fn full_model_comm_s(&self, link: &LinkModel, workers: usize) -> f64 {
        let params: usize = self.units.iter().map(|u| u.2).sum();
        link.ring_allreduce_seconds(params * 4, workers)
    }
}

/// Times `measured` training steps (after 2 warm-up steps) of `replica` (any backend) on this
/// thread and returns median per-unit backward times. `workers` sharing the machine's cores
/// scale them. The forward time is that of an evaluation-mode forward of the same batch (the
/// seam runs forward and backward as one call); the first unit's backward time is what the
/// training call took until that unit was ready, less that forward.
pub fn profile_step(
    task: &Task,
    replica: &mut dyn ModelReplica,
    batch_size: usize,
    workers: usize,
    measured: usize,
    seed: u64,
) -> Result<StepProfile, ReplicaError> {
    let infos = replica.unit_infos();
    let mut batch = Batch::default();
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let n = task.train_len();
    let mut fwd = Vec::new();
    let mut bwd = Vec::new();
    let mut per_unit: Vec<Vec<f64>> = Vec::new();
    let mut names: Vec<(String, usize, usize)> = Vec::new();
    for it in 0..measured + 2 {
        if matches!(task.data, TaskData::Images(_)) {
            batch.indices = (0..batch_size).map(|i| (it * batch_size + i) % n).collect();
        }
        task.fill_batch(&mut batch, &mut rng, batch_size);
        let t0 = Instant::now();
        replica.logits(&batch.input)?;
        let forward = t0.elapsed().as_secs_f64();
        let mut times = Vec::new();
        let mut seen = Vec::new();
        let t1 = Instant::now();
        let mut last = t1;
        replica.forward_backward(&batch.input, &batch.targets, &mut |idx, _unit| {
            let now = Instant::now();
            times.push((now - last).as_secs_f64());
            last = now;
            let info = infos.iter().find(|i| i.index == idx);
            seen.push((
                info.map(|i| i.name.clone()).unwrap_or_default(),
                idx,
                info.map_or(0, |i| i.params),
            ));
        })?;
        let total = t1.elapsed().as_secs_f64();
        if let Some(first) = times.first_mut() {
            *first = (*first - forward).max(0.0);
        }
        if it >= 2 {
            fwd.push(forward);
            bwd.push((total - forward).max(0.0));
            if per_unit.is_empty() {
                per_unit = vec![Vec::new(); times.len()];
                names = seen;
            }
            for (u, t) in times.into_iter().enumerate() {
                if let Some(v) = per_unit.get_mut(u) {
                    v.push(t);
                }
            }
        }
    }
    let cores = std::thread::available_parallelism()
        .map(|c| c.get())
        .unwrap_or(1);
    let contention = (workers as f64 / cores as f64).max(1.0);
    Ok(StepProfile {
        forward_s: median(&mut fwd) * contention,
        backward_s: median(&mut bwd) * contention,
        units: names
            .into_iter()
            .zip(per_unit.iter_mut())
            .map(|((name, idx, params), ts)| (name, idx, params, median(ts)))
            .collect(),
        contention,
    })
}

fn median(v: &mut [f64]) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}
