//! Profiling for the DreamDDP schedule: measured per-layer backward times of this task on
//! this machine, and per-layer communication times from the link model.

use std::time::Instant;

use engine::loss::softmax_cross_entropy;
use engine::model::NamedLayer;
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

/// Times `measured` training steps (after 2 warm-up steps) of one replica on this thread and
/// returns median per-layer backward times. `workers` sharing the machine's cores scale them.
pub fn profile_step(
    task: &Task,
    batch_size: usize,
    workers: usize,
    measured: usize,
    seed: u64,
) -> StepProfile {
    let mut model = task.build_model(seed);
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
        let logits = model.forward(&batch.input, true);
        let (_, grad) = softmax_cross_entropy(&logits, &batch.targets);
        let t1 = Instant::now();
        let mut last = t1;
        let mut times = Vec::new();
        let mut seen = Vec::new();
        model.backward_with_hook(&grad, &mut |idx: usize, l: &mut NamedLayer| {
            let now = Instant::now();
            times.push((now - last).as_secs_f64());
            last = now;
            let params = l.layer.params().iter().map(|p| p.len()).sum();
            seen.push((l.name.clone(), idx, params));
        });
        let t2 = Instant::now();
        if it >= 2 {
            fwd.push((t1 - t0).as_secs_f64());
            bwd.push((t2 - t1).as_secs_f64());
            if per_unit.is_empty() {
                per_unit = vec![Vec::new(); times.len()];
                names = seen;
            }
            for (u, t) in times.into_iter().enumerate() {
                per_unit[u].push(t);
            }
        }
    }
    let cores = std::thread::available_parallelism()
        .map(|c| c.get())
        .unwrap_or(1);
    let contention = (workers as f64 / cores as f64).max(1.0);
    StepProfile {
        forward_s: median(&mut fwd) * contention,
        backward_s: median(&mut bwd) * contention,
        units: names
            .into_iter()
            .zip(per_unit.iter_mut())
            .map(|((name, idx, params), ts)| (name, idx, params, median(ts)))
            .collect(),
        contention,
    }
}

fn median(v: &mut [f64]) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}
