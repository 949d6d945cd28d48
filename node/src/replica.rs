//! One worker's model replica with its data shard and learning-rate schedule: real
//! forward/backward on real data through the replica seam (any backend), per-unit optimizer
//! steps. A node's training loop runs one per worker thread; the simulator runs one per
//! simulated node (built-in engine), taking only the *time* of these computations from its
//! compute model.

use crate::backend::{Backend, BackendError};
use crate::task::{Batch, Task, TaskData};
use engine::data::sampler::ShardedSampler;
use engine::lr::LrSchedule;
use engine::optim::OptimizerConfig;
use engine::replica::{read_unit, write_unit, ModelReplica, ReplicaError, UnitData};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

/// One replica of the model with its optimizer state and data shard.
pub struct Replica {
    /// The model behind the seam.
    pub net: Box<dyn ModelReplica>,
    /// Optimizer steps taken.
    pub steps: u64,
    units: Vec<usize>,
    sampler: ShardedSampler,
    rng: ChaCha8Rng,
    batch: Batch,
    batch_size: usize,
    task: Task,
    schedule: LrSchedule,
}

impl Replica {
    /// A built-in-engine replica for shard `rank` of `world`; every replica built with the
    /// same `seed` starts from identical weights.
    pub fn new(
        task: &Task,
        seed: u64,
        rank: usize,
        world: usize,
        batch_size: usize,
        optimizer: &OptimizerConfig,
        schedule: LrSchedule,
    ) -> Result<Self, String> {
        Self::with_backend(
            task,
            &Backend::Builtin,
            seed,
            rank,
            world,
            batch_size,
            optimizer,
            schedule,
        )
        .map_err(|e| e.to_string())
    }

    /// [`Self::new`] on `backend`.
    pub fn with_backend(
        task: &Task,
        backend: &Backend,
        seed: u64,
        rank: usize,
        world: usize,
        batch_size: usize,
        optimizer: &OptimizerConfig,
        schedule: LrSchedule,
    ) -> Result<Self, BackendError> {
        let net = backend.build_replica(task, seed, optimizer)?;
        let units = net.unit_infos().iter().map(|i| i.index).collect();
        let sampler = task
            .sampler(rank, world, seed)
            .map_err(|e| BackendError::Shard(e.to_string()))?;
        let rng = ChaCha8Rng::seed_from_u64(
            seed ^ (0x9E37_79B9_7F4A_7C15u64.wrapping_mul(rank as u64 + 1)),
        );
        Ok(Self {
            net,
            steps: 0,
            units,
            sampler,
            rng,
            batch: Batch::default(),
            batch_size,
            task: task.clone(),
            schedule,
        })
    }

    /// The model layer indices of the sync units, in forward order.
    pub fn units(&self) -> &[usize] {
        &self.units
    }

    /// Learning rate of the next step.
    pub fn lr(&self) -> f32 {
        self.schedule.lr_at(self.steps)
    }

    /// Draws the next batch and runs forward and backward (gradients land in the units).
    /// Returns the training loss.
    pub fn forward_backward(&mut self) -> Result<f32, ReplicaError> {
        if matches!(self.task.data, TaskData::Images(_)) {
            self.batch.indices = self.sampler.next_batch(self.batch_size);
        }
        self.task
            .fill_batch(&mut self.batch, &mut self.rng, self.batch_size);
        self.net
            .forward_backward(&self.batch.input, &self.batch.targets, &mut |_, _| {})
    }

    /// Applies the optimizer to unit `index` with its current gradients.
    pub fn step_layer(&mut self, index: usize) {
        let lr = self.lr();
        self.net.with_unit(index, &mut |u| u.step(lr));
    }

    /// Applies the optimizer to every unit and counts the step.
    pub fn step_all(&mut self) {
        self.step_all_scaled(&|_| 1.0);
    }

    /// [`Self::step_all`] with unit `i`'s learning rate multiplied by `scale(i)` (per-layer
    /// damping by staleness).
    pub fn step_all_scaled(&mut self, scale: &dyn Fn(usize) -> f32) {
        let lr = self.lr();
        for &i in &self.units {
            let lr_i = lr * scale(i);
            self.net.with_unit(i, &mut |u| u.step(lr_i));
        }
        self.steps += 1;
    }

    /// Flat values of unit `index`, written into `out` (cleared first).
    pub fn values_into(&mut self, index: usize, out: &mut Vec<f32>) {
        out.clear();
        self.net
            .with_unit(index, &mut |u| u.append_to(UnitData::Values, out));
    }

    /// Appends unit `index`'s gradients or values to `out`.
    pub fn append_unit(&mut self, index: usize, what: UnitData, out: &mut Vec<f32>) {
        self.net.with_unit(index, &mut |u| u.append_to(what, out));
    }

    /// Appends values `at..at + len` of unit `index`'s gradients or values to `out` (a chunk
    /// of a layer of `layer_len` values).
    pub fn append_unit_range(
        &mut self,
        index: usize,
        what: UnitData,
        (at, len, layer_len): (usize, usize, usize),
        out: &mut Vec<f32>,
    ) {
        self.net.with_unit(index, &mut |u| {
            engine::replica::append_unit_range(u, what, at, len, layer_len, out)
        });
    }

    /// Overwrites values `at..at + src.len()` of unit `index`'s gradients or values (a chunk
    /// of a layer of `layer_len` values), the rest kept.
    pub fn write_unit_range(
        &mut self,
        index: usize,
        what: UnitData,
        (at, layer_len): (usize, usize),
        src: &[f32],
    ) {
        self.net.with_unit(index, &mut |u| {
            engine::replica::write_unit_range(u, what, at, layer_len, src)
        });
    }

    /// Overwrites the values of unit `index` from a flat vector.
    pub fn set_layer_values(&mut self, index: usize, flat: &[f32]) {
        write_unit(self.net.as_mut(), index, UnitData::Values, flat);
    }

    /// Flat gradients of unit `index` (params in order).
    pub fn layer_grads(&mut self, index: usize) -> Vec<f32> {
        read_unit(self.net.as_mut(), index, UnitData::Grads)
    }

    /// Overwrites the gradients of unit `index` from a flat vector.
    pub fn set_layer_grads(&mut self, index: usize, flat: &[f32]) {
        write_unit(self.net.as_mut(), index, UnitData::Grads, flat);
    }
}
