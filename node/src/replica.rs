//! A simulated node's model replica: real forward/backward on real data, per-layer optimizers,
//! its own data shard. Only the *time* these computations take comes from the compute model.

use crate::task::{Batch, Task, TaskData};
use engine::data::sampler::ShardedSampler;
use engine::loss::softmax_cross_entropy;
use engine::lr::LrSchedule;
use engine::model::{Model, NamedLayer};
use engine::optim::{LayerOptimizer, OptimizerConfig};
use engine::tensor::Tensor;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

/// One replica of the model with its optimizer state and data shard.
pub struct Replica {
    /// The model.
    pub model: Model,
    /// Optimizer steps taken.
    pub steps: u64,
    opts: Vec<Option<LayerOptimizer>>,
    sampler: ShardedSampler,
    rng: ChaCha8Rng,
    batch: Batch,
    batch_size: usize,
    task: Task,
    schedule: LrSchedule,
}

impl Replica {
    /// A replica for shard `rank` of `world`; every replica built with the same `seed` starts
    /// from identical weights.
    pub fn new(
        task: &Task,
        seed: u64,
        rank: usize,
        world: usize,
        batch_size: usize,
        optimizer: &OptimizerConfig,
        schedule: LrSchedule,
    ) -> Result<Self, String> {
        let model = task.build_model(seed);
        let opts = model
            .layers
            .iter()
            .map(|l| {
                (!l.layer.params().is_empty())
                    .then(|| LayerOptimizer::new(optimizer, l.layer.params()))
            })
            .collect();
        let sampler = ShardedSampler::new(task.train_len(), rank, world, seed, true)
            .map_err(|e| e.to_string())?;
        let rng = ChaCha8Rng::seed_from_u64(
            seed ^ (0x9E37_79B9_7F4A_7C15u64.wrapping_mul(rank as u64 + 1)),
        );
        Ok(Self {
            model,
            steps: 0,
            opts,
            sampler,
            rng,
            batch: Batch::default(),
            batch_size,
            task: task.clone(),
            schedule,
        })
    }

    /// Learning rate of the next step.
    pub fn lr(&self) -> f32 {
        self.schedule.lr_at(self.steps)
    }

    /// Draws the next batch, runs forward and backward (gradients land in the params) and
    /// calls `on_layer_ready(index, layer)` for each parameterized layer, output head first.
    /// Returns the training loss.
    pub fn forward_backward(
        &mut self,
        on_layer_ready: &mut dyn FnMut(usize, &mut NamedLayer),
    ) -> f32 {
        if matches!(self.task.data, TaskData::Images(_)) {
            self.batch.indices = self.sampler.next_batch(self.batch_size);
        }
        self.task
            .fill_batch(&mut self.batch, &mut self.rng, self.batch_size);
        let logits: Tensor = self.model.forward(&self.batch.input, true);
        let (loss, grad) = softmax_cross_entropy(&logits, &self.batch.targets);
        self.model.backward_with_hook(&grad, on_layer_ready);
        loss
    }

    /// Applies the optimizer to layer `index` with the current gradients.
    pub fn step_layer(&mut self, index: usize) {
        let lr = self.lr();
        if let Some(opt) = self.opts[index].as_mut() {
            opt.step(self.model.layers[index].layer.params_mut(), lr);
        }
    }

    /// Applies the optimizer to every layer and counts the step.
    pub fn step_all(&mut self) {
        for i in 0..self.model.layers.len() {
            self.step_layer(i);
        }
        self.steps += 1;
    }

    /// Flat gradients of layer `index` (params in order).
    pub fn layer_grads(&self, index: usize) -> Vec<f32> {
        self.model.layers[index]
            .layer
            .params()
            .iter()
            .flat_map(|p| p.grad.iter().copied())
            .collect()
    }

    /// Overwrites the gradients of layer `index` from a flat vector.
    pub fn set_layer_grads(&mut self, index: usize, flat: &[f32]) {
        let mut off = 0;
        for p in self.model.layers[index].layer.params_mut() {
            let n = p.grad.len();
            p.grad.copy_from_slice(&flat[off..off + n]);
            off += n;
        }
    }
}
