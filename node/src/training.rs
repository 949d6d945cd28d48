//! One cluster node's local training: `N` worker threads, each with its own replica and data
//! shard, averaging gradients every step through the intra-node [`Collective`] (synchronous
//! SGD inside the node, so all replicas stay identical), and a leader hook that runs on rank 0
//! between steps. The hook is where the node talks to the rest of the cluster (cross-site
//! deltas, new global versions): layers it rewrites are copied to every worker before the
//! next step. Compute runs on plain OS threads, never on an async runtime. Replicas run on
//! the node's [`Backend`] behind the replica seam, so a node training with libtorch and one
//! with the built-in engine exchange the same units.

use std::sync::{Arc, Barrier, Mutex};

use engine::lr::LrSchedule;
use engine::optim::OptimizerConfig;
use engine::replica::{read_unit, ModelReplica, ReplicaError, UnitData};

use crate::backend::{Backend, BackendError};
use crate::collective::{AbortOnPanic, Collective, CollectiveError, ReduceKey};
use crate::replica::Replica;
use crate::task::Task;
use crate::thread_collective::ThreadCollective;

/// What the leader does between steps.
pub trait LeaderHook: Send {
    /// Called on rank 0 after optimizer step `step` (1-based count of steps done), with the
    /// leader's model (identical on every worker at this point) and the samples the whole
    /// node trained on in this step. Returns the indices of the model layers it rewrote;
    /// those are copied to every other worker. Returning `Err` stops the node.
    fn after_step(
        &mut self,
        step: u64,
        samples: u64,
        model: &mut dyn ModelReplica,
    ) -> Result<Vec<usize>, String>;

    /// Polled after each step: `true` ends training early (e.g. a shutdown was requested).
    fn should_stop(&self) -> bool {
        false
    }

    /// Per-layer learning-rate factors for the next step, `(model layer index, factor)`
    /// (e.g. damping by staleness); layers not listed keep factor 1. Every worker uses them.
    fn lr_scales(&self) -> Vec<(usize, f32)> {
        Vec::new()
    }
}

/// The factor of layer `index` in `scales` (1 when absent).
fn scale_of(scales: &[(usize, f32)], index: usize) -> f32 {
    scales
        .iter()
        .find(|(i, _)| *i == index)
        .map_or(1.0, |(_, f)| *f)
}

/// How a node trains.
#[derive(Clone, Debug)]
pub struct NodeTrainConfig {
    /// Local workers (threads), ≥ 1.
    pub workers: usize,
    /// Optimizer steps to run, counted from step 0.
    pub steps: u64,
    /// Steps an earlier run of this node already trained: training resumes at this step (its
    /// learning rate and step numbers), so a restarted node does not train its steps twice.
    pub first_step: u64,
    /// Per-worker batch size.
    pub batch_size: usize,
    /// Model init and data-order seed (the same on every node of a cluster).
    pub seed: u64,
    /// This node's first global data-shard rank; worker `w` reads shard `first_rank + w`.
    pub first_rank: usize,
    /// Total shards across the cluster (all workers of all nodes).
    pub world: usize,
    /// Optimizer.
    pub optimizer: OptimizerConfig,
    /// Learning-rate schedule.
    pub schedule: LrSchedule,
    /// Compute backend of the node's replicas.
    pub backend: Backend,
}

/// Errors of a node's training run.
#[derive(Debug, thiserror::Error)]
pub enum NodeTrainError {
    /// Bad configuration (names the field).
    #[error("node config: {0}")]
    Config(String),
    /// The intra-node collective failed.
    #[error("intra-node collective: {0}")]
    Collective(#[from] CollectiveError),
    /// The leader hook asked to stop with an error.
    #[error("leader: {0}")]
    Leader(String),
    /// A worker thread panicked.
    #[error("worker thread {0} panicked")]
    Panicked(usize),
    /// The backend could not build a replica.
    #[error(transparent)]
    Backend(#[from] BackendError),
    /// A forward/backward failed (a batch that does not fit, a backend error).
    #[error("step {step}: {source}")]
    Step {
        /// Step.
        step: u64,
        /// What failed.
        source: ReplicaError,
    },
}

/// What a node's training run did.
#[derive(Clone, Debug, Default)]
pub struct NodeTrainReport {
    /// Steps completed.
    pub steps: u64,
    /// Mean training loss of the leader over the last 50 steps.
    pub recent_loss: f32,
    /// Intra-node collective bytes sent by the leader.
    pub intra_node_bytes: u64,
    /// Largest absolute difference between the leader's parameters and any other worker's at
    /// the end (0 when the replicas stayed identical, as synchronous SGD plus the leader's
    /// broadcasts guarantee).
    pub replica_divergence: f32,
}

/// Layers the leader rewrote, published to the other workers between two barriers.
type Broadcast = Mutex<Vec<(usize, Vec<f32>)>>;

/// Trains `task` on this node. `initial` (model layer index → values) overrides the seeded
/// initial weights (the global model a node bootstraps from). Blocks until done; returns the
/// report and the leader's final replica.
pub fn run_node_training(
    task: &Task,
    config: &NodeTrainConfig,
    initial: &[(usize, Vec<f32>)],
    hook: &mut dyn LeaderHook,
) -> Result<(NodeTrainReport, Box<dyn ModelReplica>), NodeTrainError> {
    if config.workers == 0 {
        return Err(NodeTrainError::Config("workers must be at least 1".into()));
    }
    if config.first_rank + config.workers > config.world {
        return Err(NodeTrainError::Config(format!(
            "shards {}..{} exceed world {}",
            config.first_rank,
            config.first_rank + config.workers,
            config.world
        )));
    }
    let mut replicas = Vec::with_capacity(config.workers);
    for w in 0..config.workers {
        let mut r = Replica::with_backend(
            task,
            &config.backend,
            config.seed,
            config.first_rank + w,
            config.world,
            config.batch_size,
            &config.optimizer,
            config.schedule,
        )?;
        let infos = r.net.unit_infos();
        for (index, values) in initial {
            if !infos
                .iter()
                .any(|i| i.index == *index && i.params == values.len())
            {
                return Err(NodeTrainError::Config(format!(
                    "initial values for layer index {index} do not fit the model"
                )));
            }
            r.set_layer_values(*index, values);
        }
        replicas.push(r);
    }
    let collective: Arc<dyn Collective> = Arc::new(ThreadCollective::new(
        config.workers,
        crate::link::LinkModel::unshaped(),
    )?);
    let barrier = Arc::new(Barrier::new(config.workers));
    let broadcast: Arc<Broadcast> = Arc::new(Mutex::new(Vec::new()));
    let scales: Arc<Mutex<Vec<(usize, f32)>>> = Arc::new(Mutex::new(Vec::new()));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let samples_per_step = (config.batch_size * config.workers) as u64;

    let mut leader = replicas.remove(0);
    let report = std::thread::scope(|scope| {
        let mut handles = Vec::new();
        for (i, mut replica) in replicas.into_iter().enumerate() {
            let rank = i + 1;
            let collective = Arc::clone(&collective);
            let barrier = Arc::clone(&barrier);
            let broadcast = Arc::clone(&broadcast);
            let scales = Arc::clone(&scales);
            let stop = Arc::clone(&stop);
            let (first_step, steps) = (config.first_step, config.steps);
            handles.push(scope.spawn(move || -> Result<Vec<f32>, NodeTrainError> {
                let _guard = AbortOnPanic::new(collective.as_ref(), rank);
                let mut my_scales = Vec::new();
                for step in first_step..steps {
                    train_step(&mut replica, collective.as_ref(), rank, step, &my_scales)?;
                    barrier.wait();
                    barrier.wait();
                    {
                        let published = broadcast.lock().unwrap_or_else(|p| p.into_inner());
                        for (index, values) in published.iter() {
                            replica.set_layer_values(*index, values);
                        }
                        my_scales.clone_from(&scales.lock().unwrap_or_else(|p| p.into_inner()));
                    }
                    barrier.wait();
                    if stop.load(std::sync::atomic::Ordering::SeqCst) {
                        break;
                    }
                }
                Ok(replica.net.flat_values())
            }));
        }

        let _guard = AbortOnPanic::new(collective.as_ref(), 0);
        let mut losses = std::collections::VecDeque::with_capacity(50);
        let mut result: Result<(), NodeTrainError> = Ok(());
        let mut done = config.first_step.min(config.steps);
        let mut leader_scales: Vec<(usize, f32)> = Vec::new();
        for step in config.first_step..config.steps {
            let loss = match train_step(&mut leader, collective.as_ref(), 0, step, &leader_scales) {
                Ok(l) => l,
                Err(e) => {
                    result = Err(e);
                    break;
                }
            };
            if losses.len() == 50 {
                losses.pop_front();
            }
            losses.push_back(loss);
            done = step + 1;
            if config.workers > 1 {
                barrier.wait();
            }
            let changed = hook.after_step(done, samples_per_step, leader.net.as_mut());
            let stop_now = changed.is_err() || hook.should_stop();
            leader_scales = hook.lr_scales();
            if config.workers > 1 {
                scales
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .clone_from(&leader_scales);
            }
            if config.workers > 1 {
                let mut published = broadcast.lock().unwrap_or_else(|p| p.into_inner());
                published.clear();
                if let Ok(changed) = &changed {
                    for &index in changed {
                        published.push((
                            index,
                            read_unit(leader.net.as_mut(), index, UnitData::Values),
                        ));
                    }
                }
                drop(published);
                stop.store(stop_now, std::sync::atomic::Ordering::SeqCst);
                barrier.wait();
                barrier.wait();
            }
            if let Err(e) = changed {
                result = Err(NodeTrainError::Leader(e));
                break;
            }
            if stop_now {
                break;
            }
        }
        if result.is_err() {
            collective.shutdown("the node leader stopped");
        }
        let leader_values = leader.net.flat_values();
        let mut divergence = 0.0f32;
        for (i, h) in handles.into_iter().enumerate() {
            match h.join() {
                Ok(Ok(values)) => {
                    for (a, b) in leader_values.iter().zip(&values) {
                        divergence = divergence.max((a - b).abs());
                    }
                }
                Ok(Err(e)) => {
                    if result.is_ok() {
                        result = Err(e);
                    }
                }
                Err(_) => result = Err(NodeTrainError::Panicked(i + 1)),
            }
        }
        result.map(|()| NodeTrainReport {
            steps: done,
            recent_loss: losses.iter().sum::<f32>() / losses.len().max(1) as f32,
            intra_node_bytes: collective.bytes_sent(0),
            replica_divergence: divergence,
        })
    });
    report.map(|r| (r, leader.net))
}

/// One synchronous-SGD step of one worker: forward/backward, gradient mean across the node's
/// workers (one flat all-reduce), optimizer step. Returns the training loss.
fn train_step(
    w: &mut Replica,
    collective: &dyn Collective,
    rank: usize,
    step: u64,
    scales: &[(usize, f32)],
) -> Result<f32, NodeTrainError> {
    let loss = w
        .forward_backward()
        .map_err(|source| NodeTrainError::Step { step, source })?;
    if collective.world() > 1 {
        let units = w.units().to_vec();
        let mut flat = Vec::new();
        let mut lens = Vec::with_capacity(units.len());
        for &i in &units {
            let before = flat.len();
            w.append_unit(i, UnitData::Grads, &mut flat);
            lens.push(flat.len() - before);
        }
        let mean = collective
            .all_reduce_mean(rank, ReduceKey::new(step, 0), flat)?
            .wait()?;
        let mut off = 0;
        for (&i, len) in units.iter().zip(lens) {
            w.set_layer_grads(i, &mean[off..off + len]);
            off += len;
        }
    }
    if scales.is_empty() {
        w.step_all();
    } else {
        w.step_all_scaled(&|i| scale_of(scales, i));
    }
    Ok(loss)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::task::{load_data, ModelKind};
    use engine::replica::write_unit;

    struct CountingHook {
        calls: Vec<(u64, u64)>,
        rewrite_at: u64,
        stop_at: u64,
    }

    impl LeaderHook for CountingHook {
        fn after_step(
            &mut self,
            step: u64,
            samples: u64,
            model: &mut dyn ModelReplica,
        ) -> Result<Vec<usize>, String> {
            self.calls.push((step, samples));
            if step == self.rewrite_at {
                let first = model.unit_infos()[0].clone();
                write_unit(
                    model,
                    first.index,
                    UnitData::Values,
                    &vec![0.5; first.params],
                );
                return Ok(vec![first.index]);
            }
            Ok(Vec::new())
        }
        fn should_stop(&self) -> bool {
            self.calls.last().is_some_and(|c| c.0 >= self.stop_at)
        }
    }

    fn digits_task() -> Task {
        let data = load_data("digits", None).unwrap();
        Task::new(ModelKind::Mlp, "digits", data).unwrap()
    }

    fn config(workers: usize, steps: u64) -> NodeTrainConfig {
        NodeTrainConfig {
            first_step: 0,
            workers,
            steps,
            batch_size: 16,
            seed: 3,
            first_rank: 0,
            world: workers,
            optimizer: OptimizerConfig::sgd(),
            schedule: LrSchedule::constant(0.05),
            backend: Backend::Builtin,
        }
    }

    #[test]
    fn two_workers_train_and_the_hook_sees_every_step_with_node_samples() {
        let task = digits_task();
        let mut hook = CountingHook {
            calls: Vec::new(),
            rewrite_at: 0,
            stop_at: u64::MAX,
        };
        let (report, _) = run_node_training(&task, &config(2, 30), &[], &mut hook).unwrap();
        assert_eq!(report.steps, 30);
        assert_eq!(hook.calls.len(), 30);
        assert!(hook.calls.iter().all(|&(_, s)| s == 32));
        assert!(report.intra_node_bytes > 0);
        assert!(report.recent_loss.is_finite());
        assert_eq!(report.replica_divergence, 0.0);
    }

    #[test]
    fn hook_rewrites_reach_every_worker_and_stop_ends_early() {
        // A rewrite that did not reach every worker would leave the replicas different.
        let task = digits_task();
        let mut hook = CountingHook {
            calls: Vec::new(),
            rewrite_at: 3,
            stop_at: 5,
        };
        let (report, _) = run_node_training(&task, &config(2, 50), &[], &mut hook).unwrap();
        assert_eq!(report.steps, 5);
        assert_eq!(hook.calls.len(), 5);
        assert_eq!(report.replica_divergence, 0.0);
    }

    #[test]
    fn initial_values_that_do_not_fit_are_refused() {
        let task = digits_task();
        let mut hook = CountingHook {
            calls: Vec::new(),
            rewrite_at: 0,
            stop_at: u64::MAX,
        };
        let Err(err) = run_node_training(&task, &config(1, 1), &[(1, vec![1.0; 3])], &mut hook)
        else {
            panic!("values of the wrong length were accepted");
        };
        assert!(err.to_string().contains("layer index 1"), "{err}");
        let mut bad = config(2, 1);
        bad.world = 1;
        assert!(run_node_training(&task, &bad, &[], &mut hook).is_err());
    }
    /// Freezes every layer but the first after step 2 (learning-rate factor 0).
    struct FreezingHook {
        frozen: Vec<(usize, f32)>,
        step: u64,
    }

    impl LeaderHook for FreezingHook {
        fn after_step(
            &mut self,
            step: u64,
            _samples: u64,
            _model: &mut dyn ModelReplica,
        ) -> Result<Vec<usize>, String> {
            self.step = step;
            Ok(Vec::new())
        }
        fn lr_scales(&self) -> Vec<(usize, f32)> {
            if self.step >= 2 {
                self.frozen.clone()
            } else {
                Vec::new()
            }
        }
    }

    #[test]
    fn the_hooks_learning_rate_factors_reach_every_worker() {
        let task = digits_task();
        let model = task.build_model(3);
        let infos = model.layer_infos();
        let frozen: Vec<(usize, f32)> = infos[1..].iter().map(|i| (i.index, 0.0)).collect();
        let mut hook = FreezingHook {
            frozen: frozen.clone(),
            step: 0,
        };
        let (two_steps, _) = run_node_training(&task, &config(2, 2), &[], &mut hook).unwrap();
        assert_eq!(two_steps.steps, 2);
        let mut hook = FreezingHook { frozen, step: 0 };
        let (report, model_after) =
            run_node_training(&task, &config(2, 12), &[], &mut hook).unwrap();
        // Every worker used the factors: the replicas stayed identical.
        assert_eq!(report.replica_divergence, 0.0);
        // The frozen layers moved only in the first two steps: their values after 12 steps
        // equal those of a 2-step run.
        let mut hook = FreezingHook {
            frozen: Vec::new(),
            step: 0,
        };
        let (_, model_2) = run_node_training(&task, &config(2, 2), &[], &mut hook).unwrap();
        let mut model_after = model_after;
        let mut model_2 = model_2;
        for info in &infos[1..] {
            let a = read_unit(model_after.as_mut(), info.index, UnitData::Values);
            let b = read_unit(model_2.as_mut(), info.index, UnitData::Values);
            assert_eq!(a, b, "layer {} moved while frozen", info.name);
        }
        let first = infos[0].index;
        assert_ne!(
            read_unit(model_after.as_mut(), first, UnitData::Values),
            read_unit(model_2.as_mut(), first, UnitData::Values),
            "the unfrozen layer trained on"
        );
    }
}
