//! The clusters simulation loop: per step, first the virtual-time accounting of every cluster
//! and of the fabric (which does not depend on the numbers being trained), then the real
//! math on the replicas (forward, backward, averaging, optimizer steps). Evaluations that fall
//! inside a step's time span see the state before that step's math.

use std::collections::BTreeMap;

use engine::bucket::Bucket;
use engine::lr::LrSchedule;
use engine::model::Model;
use engine::optim::OptimizerConfig;
use engine::plan::{PlanConfig, Strategy, SyncPlan};
use engine::schedule::{LayerProfile, ModelProfile};
use gpu_worker::task::{ModelKind, Task};

use crate::compute::StepTimes;
use crate::replica::Replica;
use crate::report::{SeriesPoint, StrategyResult, SyncEvent};
use crate::rng::SimRng;
use crate::scenario::Scenario;
use crate::time::{SimDuration, SimTime};

use super::fabric::{CollectiveSpan, Fabric, IntraNet};
use super::{ClusterSetup, ClustersError, ClustersSpec, TIMELINE_CAP};

/// Sentinel for "no bucket" in per-layer lookup tables.
const NO_BUCKET: usize = usize::MAX;

/// Node name of inter-cluster sync events in the timeline.
const INTER_NODE: &str = "inter-cluster";

/// One cluster: its replica, compute model, clocks and per-step scratch.
struct ClusterState {
    setup: ClusterSetup,
    intra: IntraNet,
    /// Nominal seconds per model layer (forward order) on this cluster's device.
    nominal: StepTimes,
    /// This step's nanoseconds per layer (straggler factor applied).
    forward_ns: Vec<u64>,
    backward_ns: Vec<u64>,
    rng: SimRng,
    replica: Replica,
    /// When the cluster can start its next step.
    clock: SimTime,
    /// When the intra-cluster interconnect is free.
    intra_free: SimTime,
    /// Per model layer: when its gradient was computed this step.
    grad_ready: Vec<SimTime>,
    /// Per model layer: when its optimizer step could run this step (dreamddp).
    stepped_at: Vec<SimTime>,
    /// Per intra bucket: when its intra-cluster all-reduce ended this step.
    intra_done: Vec<SimTime>,
    /// Per plan bucket: when this cluster joined its inter-cluster all-reduce this step.
    joined: Vec<SimTime>,
}

/// A prepared simulation of one strategy.
pub(super) struct Simulation<'a> {
    scenario: &'a Scenario,
    task: &'a Task,
    strategy: Strategy,
    stop_at_target: bool,
    clusters: Vec<ClusterState>,
    /// Averaging weight of each cluster (its share of the workers).
    weights: Vec<f32>,
    plan: SyncPlan,
    /// Gradient buckets reduced inside a cluster, backward order.
    intra_buckets: Vec<Bucket>,
    intra_bucket_of: Vec<usize>,
    /// Parameterized layer indices, forward order.
    units: Vec<usize>,
    layer_len: Vec<usize>,
    total_bytes: u64,
    layer_names: Vec<String>,
    fabric: Fabric,
    /// dreamddp: per plan bucket, when the average in flight lands.
    pending_end: Vec<Option<SimTime>>,
    /// dreamddp: per model layer, the average in flight (written before its next step).
    pending_avg: Vec<Option<Vec<f32>>>,
    intra_bytes: u64,
    timeline: Vec<SyncEvent>,
    staleness: BTreeMap<u64, u64>,
    global: Model,
    scratch: Vec<f32>,
}

fn scaled_ns(seconds: f64, factor: f64) -> u64 {
    let ns = (seconds * factor * 1e9).round();
    if ns.is_finite() && ns > 0.0 {
        ns.min(u64::MAX as f64) as u64
    } else {
        0
    }
}

fn optimizer_for(scenario: &Scenario, task: &Task) -> Result<OptimizerConfig, ClustersError> {
    let defaults = task.defaults().optimizer;
    match scenario.optimizer.as_deref() {
        None => Ok(defaults),
        Some("sgd") => Ok(match defaults {
            OptimizerConfig::Sgd { .. } => defaults,
            OptimizerConfig::AdamW { .. } => OptimizerConfig::Sgd {
                momentum: 0.9,
                weight_decay: 0.0,
                nesterov: true,
            },
        }),
        Some("adamw") => Ok(match defaults {
            OptimizerConfig::AdamW { .. } => defaults,
            OptimizerConfig::Sgd { .. } => OptimizerConfig::adamw(),
        }),
        Some(other) => Err(ClustersError::Invalid {
            key: "optimizer".into(),
            problem: format!("unknown optimizer '{other}'; valid: sgd, adamw"),
        }),
    }
}

impl<'a> Simulation<'a> {
    /// Builds replicas, compute models, links and the sync plan.
    pub(super) fn new(
        scenario: &'a Scenario,
        spec: &ClustersSpec,
        setups: Vec<ClusterSetup>,
        task: &'a Task,
        strategy: Strategy,
    ) -> Result<Self, ClustersError> {
        let defaults = task.defaults();
        let optimizer = optimizer_for(scenario, task)?;
        let lr = scenario.lr.unwrap_or(defaults.lr);
        if !(lr.is_finite() && lr > 0.0) {
            return Err(ClustersError::Invalid {
                key: "lr".into(),
                problem: format!("must be a positive number, got {lr}"),
            });
        }
        if scenario.max_steps == 0 {
            return Err(ClustersError::Invalid {
                key: "max_steps".into(),
                problem: "must be at least 1".into(),
            });
        }
        let schedule = LrSchedule {
            base_lr: lr,
            warmup_steps: defaults.warmup.min(scenario.max_steps),
            total_steps: scenario.max_steps,
            min_lr: lr * 0.1,
        };
        let root = SimRng::new(scenario.seed).fork("clusters");
        let world = setups.len();
        let total_workers: usize = setups.iter().map(|s| s.workers).sum();
        let weights: Vec<f32> = setups
            .iter()
            .map(|s| s.workers as f32 / total_workers as f32)
            .collect();
        let global = task.build_model(scenario.seed);
        let macs: Vec<u64> = global
            .layers
            .iter()
            .map(|l| l.layer.forward_macs_per_sample())
            .collect();
        let samples = match (&task.model, &task.gpt) {
            (ModelKind::GptTiny, Some(g)) => scenario.batch * g.context,
            _ => scenario.batch,
        };
        let layer_count = global.layers.len();
        let layer_len: Vec<usize> = global
            .layers
            .iter()
            .map(|l| l.layer.params().iter().map(|p| p.len()).sum())
            .collect();
        let layer_names: Vec<String> = global.layers.iter().map(|l| l.name.clone()).collect();
        let infos = global.layer_infos();
        let units: Vec<usize> = infos.iter().map(|i| i.index).collect();
        let total_bytes: u64 = infos.iter().map(|i| i.params as u64 * 4).sum();

        let intra_plan = SyncPlan::new(
            &global.name,
            &infos,
            &PlanConfig::new(Strategy::Wfbp, scenario.period),
            None,
        )?;
        // wfbp reduces DDP buckets inside a cluster too; the parameter-averaging strategies
        // reduce each layer's gradient from the backward hook (so a layer can be stepped, and
        // for dreamddp its sync launched, as soon as possible); ssgd reduces after backward.
        let intra_buckets = match strategy {
            Strategy::LocalSgd | Strategy::DreamDdp => infos
                .iter()
                .rev()
                .enumerate()
                .map(|(id, info)| Bucket {
                    id,
                    layers: vec![info.index],
                    params: info.params,
                })
                .collect(),
            Strategy::Ssgd | Strategy::Wfbp => intra_plan.buckets().to_vec(),
        };

        let mut clusters = Vec::with_capacity(world);
        for (rank, setup) in setups.into_iter().enumerate() {
            let replica = Replica::new(
                task,
                scenario.seed,
                rank,
                world,
                setup.workers * scenario.batch,
                &optimizer,
                schedule,
            )
            .map_err(ClustersError::Replica)?;
            let intra = IntraNet {
                workers: setup.workers,
                bits_per_sec: spec.intra_bandwidth.bits_per_sec(),
                step_latency: SimDuration::try_from_secs_f64(spec.intra_latency_us * 1e-6)
                    .unwrap_or(SimDuration::ZERO),
            };
            let nominal = StepTimes::from_macs(&setup.device, &macs, samples);
            clusters.push(ClusterState {
                rng: root.fork(&format!("compute:{}", setup.name)),
                setup,
                intra,
                nominal,
                forward_ns: vec![0; layer_count],
                backward_ns: vec![0; layer_count],
                replica,
                clock: SimTime::ZERO,
                intra_free: SimTime::ZERO,
                grad_ready: vec![SimTime::ZERO; layer_count],
                stepped_at: vec![SimTime::ZERO; layer_count],
                intra_done: vec![SimTime::ZERO; intra_buckets.len()],
                joined: Vec::new(),
            });
        }

        let link_spec = &scenario.links[&spec.inter_link];
        let fabric = Fabric::new(link_spec, &scenario.base_dir, world, &root.fork("fabric"))?;

        let mut config = PlanConfig::new(strategy, scenario.period);
        config.schedule = spec.schedule;
        config.bubble_filling = spec.bubble_filling;
        let profile = if strategy == Strategy::DreamDdp {
            Some(profile_of(
                &clusters,
                &units,
                &layer_names,
                &layer_len,
                &fabric,
            )?)
        } else {
            None
        };
        let plan = SyncPlan::new(&global.name, &infos, &config, profile.as_ref())?;
        let plan_buckets = plan.buckets().len();
        for c in &mut clusters {
            c.joined = vec![SimTime::ZERO; plan_buckets];
        }
        let bucket_index = |buckets: &[Bucket]| {
            let mut of = vec![NO_BUCKET; layer_count];
            for (b, bucket) in buckets.iter().enumerate() {
                for &l in &bucket.layers {
                    of[l] = b;
                }
            }
            of
        };
        Ok(Self {
            scenario,
            task,
            strategy,
            stop_at_target: spec.stop_at_target,
            weights,
            intra_bucket_of: bucket_index(&intra_buckets),
            pending_end: vec![None; plan_buckets],
            pending_avg: vec![None; layer_count],
            plan,
            intra_buckets,
            units,
            layer_len,
            total_bytes,
            layer_names,
            fabric,
            clusters,
            intra_bytes: 0,
            timeline: Vec::new(),
            staleness: BTreeMap::new(),
            global,
            scratch: Vec::new(),
        })
    }

    /// Runs the strategy to `max_steps` or `max_virtual_s` (or the target, when asked).
    pub(super) fn run(
        mut self,
        progress: &mut dyn FnMut(f64),
    ) -> Result<StrategyResult, ClustersError> {
        let scenario = self.scenario;
        let every = SimDuration::try_from_secs_f64(scenario.eval_every_s)
            .filter(|d| *d > SimDuration::ZERO)
            .ok_or_else(|| ClustersError::Invalid {
                key: "eval_every_s".into(),
                problem: format!("must be a positive number, got {}", scenario.eval_every_s),
            })?;
        let max_t = SimTime::try_from_secs_f64(scenario.max_virtual_s).unwrap_or(SimTime::MAX);
        let mut series = Vec::new();
        let mut time_to_target = None;
        let mut next_eval = SimTime::ZERO;
        let mut now = SimTime::ZERO;
        let mut steps_done = 0u64;
        for step in 0..scenario.max_steps {
            if now >= max_t {
                break;
            }
            let bytes_before = self.bytes_sent();
            let end = self.time_step(step)?;
            while next_eval < end && next_eval <= max_t {
                let point = self.evaluate(next_eval, bytes_before, steps_done);
                if time_to_target.is_none() && self.meets_target(&point) {
                    time_to_target = Some(point.time_s);
                }
                series.push(point);
                next_eval += every;
            }
            if self.stop_at_target && time_to_target.is_some() {
                break;
            }
            self.math_step(step)?;
            steps_done += 1;
            now = end;
            let fraction = (steps_done as f64 / scenario.max_steps as f64)
                .max(now.as_secs_f64() / scenario.max_virtual_s);
            progress(fraction.min(1.0));
        }
        // dreamddp: land the averages still in flight.
        let mut final_time = now;
        for end in self.pending_end.iter_mut().filter_map(Option::take) {
            final_time = final_time.max(end);
        }
        for layer in 0..self.pending_avg.len() {
            if let Some(avg) = self.pending_avg[layer].take() {
                for c in &mut self.clusters {
                    c.replica.model.set_layer_values(layer, &avg);
                }
            }
        }
        let bytes = self.bytes_sent();
        let last = self.evaluate(final_time, bytes, steps_done);
        if time_to_target.is_none() && self.meets_target(&last) {
            time_to_target = Some(last.time_s);
        }
        let (final_accuracy, final_loss) = (last.accuracy, last.loss);
        if series.last().is_none_or(|p| p.time_s < last.time_s) {
            series.push(last);
        }
        progress(1.0);
        let virtual_seconds = final_time.as_secs_f64();
        let mut bytes_by_link_class = BTreeMap::new();
        bytes_by_link_class.insert("inter-cluster".to_string(), self.fabric.bytes_on_wire());
        bytes_by_link_class.insert("intra-cluster".to_string(), self.intra_bytes);
        Ok(StrategyResult {
            strategy: self.strategy.name().to_string(),
            time_to_target_s: time_to_target,
            final_accuracy,
            final_loss,
            virtual_seconds,
            bytes_sent: bytes,
            bytes_by_link_class,
            weak_sync_events: 0,
            undelivered_deltas: 0,
            cached_at_end: 0,
            staleness_histogram: self.staleness,
            mean_step_s: if steps_done == 0 {
                0.0
            } else {
                virtual_seconds / steps_done as f64
            },
            wall_seconds: 0.0,
            series,
            timeline: self.timeline,
        })
    }

    fn bytes_sent(&self) -> u64 {
        self.fabric.bytes_on_wire() + self.intra_bytes
    }

    fn meets_target(&self, point: &SeriesPoint) -> bool {
        match point.accuracy {
            Some(a) => a >= self.scenario.target,
            None => point.loss <= self.scenario.target,
        }
    }

    /// Evaluates the weighted average of the replicas, recorded at virtual time `at`.
    fn evaluate(&mut self, at: SimTime, bytes_sent: u64, steps: u64) -> SeriesPoint {
        for i in 0..self.units.len() {
            let layer = self.units[i];
            average_layer(
                &self.clusters,
                &self.weights,
                layer,
                self.layer_len[layer],
                false,
                &mut self.scratch,
            );
            self.global.set_layer_values(layer, &self.scratch);
        }
        let eval = self
            .task
            .evaluate(&mut self.global, Some(self.scenario.eval_limit));
        SeriesPoint {
            time_s: at.as_secs_f64(),
            accuracy: eval.accuracy,
            loss: eval.loss,
            bytes_sent,
            mean_steps: steps as f64,
        }
    }

    /// Draws this step's straggler factors and scales every cluster's layer times.
    fn draw_compute_times(&mut self) {
        for c in &mut self.clusters {
            let factor = c.setup.straggler.factor(&mut c.rng);
            for l in 0..c.forward_ns.len() {
                c.forward_ns[l] = scaled_ns(c.nominal.forward_s[l], factor);
                c.backward_ns[l] = scaled_ns(c.nominal.backward_s[l], factor);
            }
        }
    }

    /// The virtual-time accounting of step `step`; returns when every cluster finished it.
    fn time_step(&mut self, step: u64) -> Result<SimTime, ClustersError> {
        self.draw_compute_times();
        match self.strategy {
            Strategy::Ssgd => self.time_ssgd(),
            Strategy::Wfbp => self.time_wfbp(),
            Strategy::LocalSgd => self.time_localsgd(step),
            Strategy::DreamDdp => self.time_dreamddp(step),
        }
    }

    fn lockstep_start(&self) -> SimTime {
        self.clusters
            .iter()
            .map(|c| c.clock)
            .max()
            .unwrap_or(SimTime::ZERO)
    }

    fn time_ssgd(&mut self) -> Result<SimTime, ClustersError> {
        let start = self.lockstep_start();
        let mut ready = start;
        for c in &mut self.clusters {
            let backward_end = walk(c, start, |_, t| t);
            let reduced = backward_end + c.intra.all_reduce_time(self.total_bytes);
            self.intra_bytes += c.intra.all_reduce_bytes(self.total_bytes);
            c.intra_free = reduced;
            ready = ready.max(reduced);
        }
        let span = self.fabric.all_reduce(ready, self.total_bytes)?;
        let units = self.units.clone();
        self.record_sync(span, &units, 0);
        for c in &mut self.clusters {
            c.clock = span.end;
        }
        Ok(span.end)
    }

    fn time_wfbp(&mut self) -> Result<SimTime, ClustersError> {
        let start = self.lockstep_start();
        let mut end = start;
        for c in &mut self.clusters {
            let backward_end = walk(c, start, |_, t| t);
            let intra_end = intra_reduce(c, &self.intra_buckets, &mut self.intra_bytes);
            end = end.max(backward_end).max(intra_end);
        }
        // The wfbp plan's buckets are the intra buckets.
        for b in 0..self.intra_buckets.len() {
            let ready = self
                .clusters
                .iter()
                .map(|c| c.intra_done[b])
                .max()
                .unwrap_or(start);
            let bytes = self.intra_buckets[b].bytes() as u64;
            let span = self.fabric.all_reduce(ready, bytes)?;
            let layers = self.intra_buckets[b].layers.clone();
            self.record_sync(span, &layers, 0);
            end = end.max(span.end);
        }
        for c in &mut self.clusters {
            c.clock = end;
        }
        Ok(end)
    }

    fn time_localsgd(&mut self, step: u64) -> Result<SimTime, ClustersError> {
        for c in &mut self.clusters {
            let backward_end = walk(c, c.clock, |_, t| t);
            let intra_end = intra_reduce(c, &self.intra_buckets, &mut self.intra_bytes);
            c.clock = backward_end.max(intra_end);
        }
        if (step + 1).is_multiple_of(self.plan.period()) {
            let ready = self.lockstep_start();
            let span = self.fabric.all_reduce(ready, self.total_bytes)?;
            let units = self.units.clone();
            self.record_sync(span, &units, 0);
            for c in &mut self.clusters {
                c.clock = span.end;
            }
        }
        Ok(self.lockstep_start())
    }

    fn time_dreamddp(&mut self, step: u64) -> Result<SimTime, ClustersError> {
        let buckets = self.plan.buckets();
        // The average launched for bucket b is waited at b's first layer in backward order.
        let mut wait_at: Vec<Option<SimTime>> = vec![None; self.layer_len.len()];
        for (b, bucket) in buckets.iter().enumerate() {
            if let Some(end) = self.pending_end[b].take() {
                wait_at[bucket.layers[0]] = Some(end);
            }
        }
        let due: Vec<bool> = buckets
            .iter()
            .map(|bucket| self.plan.is_due(step, bucket.layers[0]))
            .collect();
        for c in &mut self.clusters {
            let start = c.clock;
            let backward_end = walk(c, start, |layer, t| match wait_at[layer] {
                Some(end) => t.max(end),
                None => t,
            });
            let intra_end = intra_reduce(c, &self.intra_buckets, &mut self.intra_bytes);
            for &layer in &self.units {
                let b = self.intra_bucket_of[layer];
                c.stepped_at[layer] = c.stepped_at[layer].max(c.intra_done[b]);
            }
            for (b, bucket) in buckets.iter().enumerate() {
                if due[b] {
                    c.joined[b] = bucket
                        .layers
                        .iter()
                        .map(|&l| c.stepped_at[l])
                        .max()
                        .unwrap_or(start);
                }
            }
            c.clock = backward_end.max(intra_end);
        }
        for b in 0..buckets.len() {
            if !due[b] {
                continue;
            }
            let ready = self
                .clusters
                .iter()
                .map(|c| c.joined[b])
                .max()
                .unwrap_or(SimTime::ZERO);
            let bucket = &self.plan.buckets()[b];
            let span = self.fabric.all_reduce(ready, bucket.bytes() as u64)?;
            self.pending_end[b] = Some(span.end);
            let layers = bucket.layers.clone();
            self.record_sync(span, &layers, 1);
        }
        Ok(self.lockstep_start())
    }

    fn record_sync(&mut self, span: CollectiveSpan, layers: &[usize], staleness: u64) {
        *self.staleness.entry(staleness).or_default() += layers.len() as u64;
        for &l in layers {
            if self.timeline.len() >= TIMELINE_CAP {
                break;
            }
            self.timeline.push(SyncEvent {
                start_s: span.start.as_secs_f64(),
                end_s: span.end.as_secs_f64(),
                node: INTER_NODE.to_string(),
                layer: self.layer_names[l].clone(),
                weak: false,
            });
        }
    }

    /// The real math of step `step` on every replica.
    fn math_step(&mut self, step: u64) -> Result<(), ClustersError> {
        for c in &mut self.clusters {
            let loss = c.replica.forward_backward(&mut |_, _| {});
            if !loss.is_finite() {
                return Err(ClustersError::Diverged {
                    step,
                    cluster: c.setup.name.clone(),
                    loss,
                });
            }
        }
        match self.strategy {
            Strategy::Ssgd | Strategy::Wfbp => {
                for i in 0..self.units.len() {
                    let layer = self.units[i];
                    self.average_and_write(layer, true);
                }
                for c in &mut self.clusters {
                    c.replica.step_all();
                }
            }
            Strategy::LocalSgd => {
                for c in &mut self.clusters {
                    c.replica.step_all();
                }
                if (step + 1).is_multiple_of(self.plan.period()) {
                    for i in 0..self.units.len() {
                        let layer = self.units[i];
                        self.average_and_write(layer, false);
                    }
                }
            }
            Strategy::DreamDdp => {
                for i in 0..self.units.len() {
                    let layer = self.units[i];
                    let landed = self.pending_avg[layer].take();
                    for c in &mut self.clusters {
                        if let Some(avg) = &landed {
                            c.replica.model.set_layer_values(layer, avg);
                        }
                        c.replica.step_layer(layer);
                    }
                    if let Some(buffer) = landed {
                        // Reuse the allocation for this step's average, if any.
                        self.scratch = buffer;
                    }
                }
                for c in &mut self.clusters {
                    c.replica.steps += 1;
                }
                for i in 0..self.units.len() {
                    let layer = self.units[i];
                    if self.plan.is_due(step, layer) {
                        let mut avg = std::mem::take(&mut self.scratch);
                        average_layer(
                            &self.clusters,
                            &self.weights,
                            layer,
                            self.layer_len[layer],
                            false,
                            &mut avg,
                        );
                        self.pending_avg[layer] = Some(avg);
                    }
                }
            }
        }
        Ok(())
    }

    /// Replaces layer `layer`'s gradients (or values) on every replica by their weighted mean.
    fn average_and_write(&mut self, layer: usize, grads: bool) {
        average_layer(
            &self.clusters,
            &self.weights,
            layer,
            self.layer_len[layer],
            grads,
            &mut self.scratch,
        );
        for c in &mut self.clusters {
            if grads {
                c.replica.set_layer_grads(layer, &self.scratch);
            } else {
                c.replica.model.set_layer_values(layer, &self.scratch);
            }
        }
    }
}

/// Walks one step of cluster `c` from `start`: forward, then backward layer by layer (output
/// head first), recording each parameterized layer's gradient time. `after_layer(layer, t)`
/// may push the compute stream later (a blocking wait in the backward hook); the layer's
/// optimizer step happens at the returned time. Returns when backward ended.
fn walk(
    c: &mut ClusterState,
    start: SimTime,
    after_layer: impl Fn(usize, SimTime) -> SimTime,
) -> SimTime {
    let mut t = start;
    for &ns in &c.forward_ns {
        t += SimDuration(ns);
    }
    for layer in (0..c.backward_ns.len()).rev() {
        t += SimDuration(c.backward_ns[layer]);
        c.grad_ready[layer] = t;
        t = after_layer(layer, t);
        c.stepped_at[layer] = t;
    }
    t
}

/// Runs cluster `c`'s intra-cluster all-reduces of this step's gradient buckets in backward order
/// on its FIFO interconnect; each starts once its last gradient is ready. Returns when the
/// last one ended.
fn intra_reduce(c: &mut ClusterState, buckets: &[Bucket], intra_bytes: &mut u64) -> SimTime {
    for (b, bucket) in buckets.iter().enumerate() {
        let last = *bucket.layers.last().expect("buckets are not empty");
        let start = c.grad_ready[last].max(c.intra_free);
        let bytes = bucket.bytes() as u64;
        c.intra_free = start + c.intra.all_reduce_time(bytes);
        *intra_bytes += c.intra.all_reduce_bytes(bytes);
        c.intra_done[b] = c.intra_free;
    }
    c.intra_free
}

/// Writes the weighted mean over clusters of layer `layer`'s values (or gradients) into `out`.
fn average_layer(
    clusters: &[ClusterState],
    weights: &[f32],
    layer: usize,
    len: usize,
    grads: bool,
    out: &mut Vec<f32>,
) {
    out.clear();
    out.resize(len, 0.0);
    for (c, &w) in clusters.iter().zip(weights) {
        let mut off = 0;
        for p in c.replica.model.layers[layer].layer.params() {
            let src = if grads { &p.grad } else { &p.value };
            for (o, v) in out[off..off + src.len()].iter_mut().zip(src) {
                *o += w * v;
            }
            off += src.len();
        }
    }
}

/// The DreamDDP timing profile as this simulation will charge it: per-unit backward seconds
/// of the slowest cluster (its nominal slowdown and mean jitter; non-parameterized layers
/// count toward the unit below them in backward order) and per-unit communication seconds
/// (intra-cluster all-reduce plus the inter-cluster all-reduce probed on a copy of the links).
fn profile_of(
    clusters: &[ClusterState],
    units: &[usize],
    names: &[String],
    layer_len: &[usize],
    fabric: &Fabric,
) -> Result<ModelProfile, ClustersError> {
    let nominal_factor =
        |c: &ClusterState| c.setup.straggler.slowdown * (1.0 + 0.5 * c.setup.straggler.jitter);
    let slowest = clusters
        .iter()
        .max_by(|a, b| {
            let fa = nominal_factor(a) * (a.nominal.forward_total() + a.nominal.backward_total());
            let fb = nominal_factor(b) * (b.nominal.forward_total() + b.nominal.backward_total());
            fa.total_cmp(&fb)
        })
        .expect("at least two clusters");
    let factor = nominal_factor(slowest);
    let forward_s = slowest.nominal.forward_total() * factor;
    let mut layers = Vec::with_capacity(units.len());
    let mut above = slowest.nominal.backward_s.len();
    for &unit in units.iter().rev() {
        let backward_s: f64 = slowest.nominal.backward_s[unit..above].iter().sum::<f64>() * factor;
        above = unit;
        let bytes = layer_len[unit] as u64 * 4;
        let intra = clusters
            .iter()
            .map(|c| c.intra.all_reduce_time(bytes))
            .max()
            .unwrap_or(SimDuration::ZERO);
        layers.push(LayerProfile {
            name: names[unit].clone(),
            index: unit,
            params: layer_len[unit],
            backward_s,
            comm_s: fabric.probe_seconds(bytes)? + intra.as_secs_f64(),
        });
    }
    Ok(ModelProfile { forward_s, layers })
}
