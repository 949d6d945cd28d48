//! The clusters simulation loop. Every cluster is one replica driven by its own
//! [`WorkerSyncMachine`] — the sans-IO machine `gpu-worker`'s trainer drives — executing the
//! strategy's [`SyncPlan`]; the machine's collectives are the inter-cluster collectives. This
//! module decides nothing about synchronization: it supplies virtual time (per-layer compute
//! from the compute model, the intra-cluster gradient all-reduce of a hierarchical DDP, the
//! fabric under the inter-cluster collectives) and executes the machine's actions on the
//! replicas.
//!
//! # One step
//!
//! Each cluster runs the real forward and backward on its replica, then feeds its machine
//! `begin_step`, the backward hook of every parameterized layer in backward order (at the
//! virtual time that layer's gradient is computed) and `backward_done`, executing the actions
//! after each input. A hook's actions touch only its own layer, which backward does not read
//! again, so executing them after the real backward computes the numbers the trainer computes
//! by executing them inside it. A `Wait` on a collective that not every cluster has joined
//! stops that cluster; the collectives every cluster has joined are then resolved on the fabric
//! in launch order ([`Rendezvous`]) and the stopped clusters go on.
//!
//! # Virtual time of the actions
//!
//! A cluster's compute stream is at `t`. Inside the cluster a layer's gradient is all-reduced
//! over the interconnect (FIFO) once its gradient bucket is computed: per DDP bucket for
//! `wfbp`, the whole model after backward for `ssgd`, per layer for `localsgd` and
//! `dreamddp`; the layer's *cluster gradient* exists when that reduce ends.
//!
//! | action | time |
//! |---|---|
//! | `Stage` | none (the data is copied) |
//! | `Launch` | the cluster joins at `max(t, data ready)`: gradients when their cluster gradient exists, parameters when their optimizer step ran |
//! | `Wait` | `t = max(t, end of the collective)`: it blocks the compute stream, as the trainer's wait blocks its thread |
//! | `Apply` | none |
//! | `StepLayer` | runs at `max(t, the layer's cluster gradient)` without blocking the compute stream |
//!
//! A cluster's step ends at `max(t, end of its intra-cluster reduces)`, and its next step
//! starts there. Evaluations that fall inside a step's time span (up to the latest cluster's
//! end) see the state before that step: the replicas' weighted mean snapshotted at its start.

use std::collections::BTreeMap;

use engine::bucket::Bucket;
use engine::config_search;
use engine::lr::LrSchedule;
use engine::model::Model;
use engine::optim::OptimizerConfig;
use engine::outer::{self, Landing, OuterState};
use engine::plan::{PlanConfig, ScheduleKind, Strategy, SyncPlan};
use engine::schedule::{LayerProfile, ModelProfile};
use gpu_worker::sync_machine::{SyncAction, SyncKind, WorkerSyncMachine};
use node::collective::ReduceKey;
use node::task::Task;

use crate::compute::{layer_costs, StepTimes};
use crate::replica::Replica;
use crate::report::{SeriesPoint, StrategyResult, SyncEvent};
use crate::rng::SimRng;
use crate::scenario::Scenario;
use crate::time::{SimDuration, SimTime};

use super::fabric::{CollectiveSpan, Fabric, IntraNet};
use super::rendezvous::{Rendezvous, Resolved};
use super::{ClusterSetup, ClustersError, ClustersSpec, SimStrategy, TIMELINE_CAP};

/// Node name of inter-cluster sync events in the timeline.
const INTER_NODE: &str = "inter-cluster";

/// One cluster: its replica and sync machine, compute model, clocks and per-step scratch.
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
    machine: WorkerSyncMachine,
    /// When the cluster can start its next step.
    clock: SimTime,
    /// Its compute stream during a step.
    now: SimTime,
    /// When the intra-cluster interconnect is free.
    intra_free: SimTime,
    /// Per model layer: when its cluster gradient (intra-cluster reduce) exists this step.
    grad_avail: Vec<SimTime>,
    /// Per model layer: when its optimizer step last ran.
    stepped_at: Vec<SimTime>,
    /// Buffers staged for collectives not yet launched.
    staging: BTreeMap<ReduceKey, Vec<f32>>,
    /// What the cluster sent, kept for a [`Landing::Rebase`].
    cuts: BTreeMap<ReduceKey, Vec<f32>>,
    /// Outer optimizer of diloco / streaming-diloco.
    outer: OuterState,
    /// Scratch for a layer's current values.
    scratch: Vec<f32>,
    /// The `Wait` the cluster is stopped at.
    blocked: Option<SyncAction>,
}

/// What a cluster's time is computed from: its setup, interconnect and nominal layer times.
struct ClusterModel {
    setup: ClusterSetup,
    intra: IntraNet,
    nominal: StepTimes,
}

/// A prepared simulation of one strategy.
pub(super) struct Simulation<'a> {
    scenario: &'a Scenario,
    task: &'a Task,
    label: &'static str,
    stop_at_target: bool,
    clusters: Vec<ClusterState>,
    /// Averaging weight of each cluster (its share of the workers).
    weights: Vec<f32>,
    /// Gradient buckets reduced inside a cluster, backward order.
    intra_buckets: Vec<Bucket>,
    /// Per model layer: the intra bucket it closes (its last layer in backward order).
    intra_closes: Vec<Option<usize>>,
    /// Parameterized layer indices, forward order.
    units: Vec<usize>,
    layer_len: Vec<usize>,
    fabric: Fabric,
    rendezvous: Rendezvous,
    intra_bytes: u64,
    timeline: Vec<SyncEvent>,
    staleness: BTreeMap<u64, u64>,
    /// The replicas' weighted mean at the start of the current step (what evaluations see).
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
    /// Builds replicas, compute models, links, the sync plan and a machine per cluster.
    pub(super) fn new(
        scenario: &'a Scenario,
        spec: &ClustersSpec,
        setups: Vec<ClusterSetup>,
        task: &'a Task,
        choice: SimStrategy,
    ) -> Result<Self, ClustersError> {
        let strategy = choice.strategy;
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
        let costs = layer_costs(&global, task);
        let layer_count = global.layers.len();
        let layer_len: Vec<usize> = global
            .layers
            .iter()
            .map(|l| l.layer.params().iter().map(|p| p.len()).sum())
            .collect();
        let layer_names: Vec<String> = global.layers.iter().map(|l| l.name.clone()).collect();
        let infos = global.layer_infos();
        let units: Vec<usize> = infos.iter().map(|i| i.index).collect();

        let mut clusters = Vec::with_capacity(world);
        let mut replicas = Vec::with_capacity(world);
        for (rank, setup) in setups.into_iter().enumerate() {
            replicas.push(
                Replica::new(
                    task,
                    scenario.seed,
                    rank,
                    world,
                    setup.workers * scenario.batch,
                    &optimizer,
                    schedule,
                )
                .map_err(ClustersError::Replica)?,
            );
            let intra = IntraNet {
                workers: setup.workers,
                bits_per_sec: spec.intra_bandwidth.bits_per_sec(),
                step_latency: SimDuration::try_from_secs_f64(spec.intra_latency_us * 1e-6)
                    .unwrap_or(SimDuration::ZERO),
            };
            let nominal = setup
                .device
                .step_times(&costs, scenario.batch)
                .map_err(|e| ClustersError::Invalid {
                    key: e.key,
                    problem: e.problem,
                })?;
            clusters.push(ClusterModel {
                setup,
                intra,
                nominal,
            });
        }

        let link_spec = &scenario.links[&spec.inter_link];
        let fabric = Fabric::new(link_spec, &scenario.base_dir, world, &root.fork("fabric"))?;

        let mut config = PlanConfig::new(strategy, scenario.period);
        config.schedule = spec.schedule;
        config.bubble_filling = spec.bubble_filling;
        config.delay = match strategy {
            Strategy::StreamingDiloco => spec.fragment_delay,
            _ => spec.delay,
        };
        config.outer = spec.outer;
        config.sync_unit_params = PlanConfig::sync_unit_params_for(strategy, spec.sync_unit_kb);
        if choice.paper {
            config.schedule = ScheduleKind::Profiled;
            config.delay = Some(1);
            config.sync_unit_params = Some(0);
        }
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
        let plan = match &profile {
            // One exchange of a bucket: the inter-cluster all-reduce probed on a copy of the
            // links plus the slowest cluster's intra-cluster reduce, as `profile_of` charges a
            // layer.
            Some(p) => {
                let comm = |params: usize| {
                    let bytes = params as u64 * 4;
                    let intra = clusters
                        .iter()
                        .map(|c| c.intra.all_reduce_time(bytes))
                        .max()
                        .unwrap_or(SimDuration::ZERO);
                    fabric.probe_seconds(bytes).unwrap_or(f64::INFINITY) + intra.as_secs_f64()
                };
                config_search::search(&global.name, &infos, &config, p, &comm)?
            }
            None => SyncPlan::new(&global.name, &infos, &config, None)?,
        };

        // Inside a cluster: wfbp reduces the DDP buckets of its plan; ssgd the whole model
        // after backward; the parameter-averaging strategies each layer's gradient from the
        // backward hook (so a layer can be stepped, and for dreamddp its sync launched, as
        // soon as possible).
        let intra_buckets: Vec<Bucket> = match strategy {
            // wfbp's units are whole layers (only dreamddp's are chunked): its buckets by
            // model layer index.
            Strategy::Wfbp => plan
                .buckets()
                .iter()
                .map(|b| Bucket {
                    units: b.units.iter().map(|&id| plan.units()[id].index).collect(),
                    ..b.clone()
                })
                .collect(),
            Strategy::Ssgd => vec![Bucket {
                id: 0,
                units: infos.iter().rev().map(|i| i.index).collect(),
                params: infos.iter().map(|i| i.params).sum(),
            }],
            Strategy::LocalSgd
            | Strategy::DreamDdp
            | Strategy::Plsgd
            | Strategy::Diloco
            | Strategy::StreamingDiloco => infos
                .iter()
                .rev()
                .enumerate()
                .map(|(id, info)| Bucket {
                    id,
                    units: vec![info.index],
                    params: info.params,
                })
                .collect(),
        };
        let mut intra_closes = vec![None; layer_count];
        for (b, bucket) in intra_buckets.iter().enumerate() {
            let last = *bucket.units.last().expect("buckets are not empty");
            intra_closes[last] = Some(b);
        }

        let clusters = clusters
            .into_iter()
            .zip(replicas)
            .map(
                |(
                    ClusterModel {
                        setup,
                        intra,
                        nominal,
                    },
                    replica,
                )| ClusterState {
                    rng: root.fork(&format!("compute:{}", setup.name)),
                    setup,
                    intra,
                    nominal,
                    forward_ns: vec![0; layer_count],
                    backward_ns: vec![0; layer_count],
                    replica,
                    machine: WorkerSyncMachine::new(&plan),
                    clock: SimTime::ZERO,
                    now: SimTime::ZERO,
                    intra_free: SimTime::ZERO,
                    grad_avail: vec![SimTime::ZERO; layer_count],
                    stepped_at: vec![SimTime::ZERO; layer_count],
                    staging: BTreeMap::new(),
                    cuts: BTreeMap::new(),
                    outer: OuterState::new(plan.outer(), plan.units().len()),
                    scratch: Vec::new(),
                    blocked: None,
                },
            )
            .collect();
        Ok(Self {
            scenario,
            task,
            label: choice.name(),
            stop_at_target: spec.stop_at_target,
            rendezvous: Rendezvous::new(weights.clone()),
            weights,
            intra_buckets,
            intra_closes,
            units,
            layer_len,
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
        let mut stopped = false;
        for step in 0..scenario.max_steps {
            if now >= max_t {
                break;
            }
            let bytes_before = self.bytes_sent();
            self.snapshot();
            let end = self.step(step)?;
            while next_eval < end && next_eval <= max_t {
                let point = self.evaluate(next_eval, bytes_before, steps_done);
                if time_to_target.is_none() && self.meets_target(&point) {
                    time_to_target = Some(point.time_s);
                }
                series.push(point);
                next_eval += every;
            }
            if self.stop_at_target && time_to_target.is_some() {
                // The run ends with the state the target was reached with.
                stopped = true;
                break;
            }
            steps_done += 1;
            now = end;
            let fraction = (steps_done as f64 / scenario.max_steps as f64)
                .max(now.as_secs_f64() / scenario.max_virtual_s);
            progress(fraction.min(1.0));
        }
        let final_time = if stopped {
            now
        } else {
            // dreamddp: land the averages still in flight.
            let drained = self.finish()?;
            self.snapshot();
            now.max(drained)
        };
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
            strategy: self.label.to_string(),
            time_to_target_s: time_to_target,
            final_accuracy,
            final_loss,
            virtual_seconds,
            bytes_sent: bytes,
            bytes_by_link_class,
            bytes_by_link: BTreeMap::new(),
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
            plan_candidates: self.clusters[0]
                .machine
                .plan()
                .search_candidates()
                .map(<[_]>::to_vec)
                .unwrap_or_default(),
            divergence_warnings: 0,
            divergence_peak: None,
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

    /// Writes the weighted mean of the replicas into the global model.
    fn snapshot(&mut self) {
        for i in 0..self.units.len() {
            let layer = self.units[i];
            average_layer(
                &mut self.clusters,
                &self.weights,
                layer,
                self.layer_len[layer],
                &mut self.scratch,
            );
            self.global.set_layer_values(layer, &self.scratch);
        }
    }

    /// Evaluates the last [`Self::snapshot`], recorded at virtual time `at`.
    fn evaluate(&mut self, at: SimTime, bytes_sent: u64, steps: u64) -> SeriesPoint {
        let eval = self
            .task
            .evaluate(&mut self.global, Some(self.scenario.eval_limit));
        SeriesPoint {
            time_s: at.as_secs_f64(),
            accuracy: eval.accuracy,
            loss: eval.loss,
            bytes_sent,
            access_bytes: None,
            mean_steps: steps as f64,
            divergence: None,
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

    /// Step `step` on every cluster; returns when the latest cluster finished it.
    fn step(&mut self, step: u64) -> Result<SimTime, ClustersError> {
        self.draw_compute_times();
        for ci in 0..self.clusters.len() {
            self.forward_backward(ci, step)?;
        }
        self.settle()?;
        let mut end = SimTime::ZERO;
        for c in &mut self.clusters {
            c.clock = c.now.max(c.intra_free);
            c.replica.steps += 1;
            end = end.max(c.clock);
        }
        Ok(end)
    }

    /// Cluster `ci`'s forward and backward: the real math, then the machine's inputs at
    /// their virtual times with their actions executed (up to a blocking wait).
    fn forward_backward(&mut self, ci: usize, step: u64) -> Result<(), ClustersError> {
        let c = &mut self.clusters[ci];
        c.machine.begin_step(step);
        let loss = c
            .replica
            .forward_backward()
            .map_err(|e| ClustersError::Step {
                step,
                cluster: c.setup.name.clone(),
                message: e.to_string(),
            })?;
        if !loss.is_finite() {
            return Err(ClustersError::Diverged {
                step,
                cluster: c.setup.name.clone(),
                loss,
            });
        }
        let mut t = c.clock;
        for &ns in &c.forward_ns {
            t += SimDuration(ns);
        }
        let mut above = c.backward_ns.len();
        for &layer in self.units.iter().rev() {
            for &ns in &c.backward_ns[layer..above] {
                t += SimDuration(ns);
            }
            above = layer;
            if let Some(b) = self.intra_closes[layer] {
                let bucket = &self.intra_buckets[b];
                let bytes = bucket.bytes() as u64;
                let start = t.max(c.intra_free);
                c.intra_free = start + c.intra.all_reduce_time(bytes);
                self.intra_bytes += c.intra.all_reduce_bytes(bytes);
                for &l in &bucket.units {
                    c.grad_avail[l] = c.intra_free;
                }
            }
            c.now = t;
            c.machine.layer_grads_ready(layer);
            let done = run_actions(c, ci, &mut self.rendezvous);
            assert!(
                done,
                "a backward hook waits only for earlier steps' collectives"
            );
            t = c.now;
        }
        for &ns in &c.backward_ns[..above] {
            t += SimDuration(ns);
        }
        c.now = t;
        c.machine.backward_done();
        run_actions(c, ci, &mut self.rendezvous);
        Ok(())
    }

    /// Resolves collectives and resumes stopped clusters until every cluster has executed
    /// all its actions.
    fn settle(&mut self) -> Result<(), ClustersError> {
        loop {
            let resolved = self.rendezvous.resolve(&mut self.fabric)?;
            let progressed = !resolved.is_empty();
            for r in resolved {
                self.record_sync(&r);
            }
            let mut all_done = true;
            for (ci, c) in self.clusters.iter_mut().enumerate() {
                all_done &= run_actions(c, ci, &mut self.rendezvous);
            }
            if all_done {
                return Ok(());
            }
            assert!(
                progressed,
                "clusters wait on collectives not every cluster launched"
            );
        }
    }

    /// After the last step: every machine lands what is still in flight. Returns when the
    /// last cluster is done.
    fn finish(&mut self) -> Result<SimTime, ClustersError> {
        for (ci, c) in self.clusters.iter_mut().enumerate() {
            c.now = c.clock;
            c.machine.finish();
            run_actions(c, ci, &mut self.rendezvous);
        }
        self.settle()?;
        Ok(self
            .clusters
            .iter()
            .map(|c| c.now)
            .max()
            .unwrap_or(SimTime::ZERO))
    }

    fn record_sync(&mut self, r: &Resolved) {
        // A parameter average lands `delay` optimizer steps after its cut (dreamddp, plsgd,
        // streaming-diloco); every other collective is waited within its step.
        let staleness = self.clusters[0].machine.plan().delay();
        *self.staleness.entry(staleness).or_default() += r.units.len() as u64;
        let span: CollectiveSpan = r.span;
        let units = self.clusters[0].machine.plan().units();
        for &u in &r.units {
            if self.timeline.len() >= TIMELINE_CAP {
                break;
            }
            self.timeline.push(SyncEvent {
                start_s: span.start.as_secs_f64(),
                end_s: span.end.as_secs_f64(),
                node: INTER_NODE.to_string(),
                layer: units[u].name.clone(),
                weak: false,
            });
        }
    }
}

/// Executes cluster `c`'s (index `ci`) pending machine actions at its compute stream's
/// virtual time (see the module doc). Returns false when it stopped at a wait on a
/// collective not yet resolved.
fn run_actions(c: &mut ClusterState, ci: usize, rendezvous: &mut Rendezvous) -> bool {
    while let Some(action) = c.blocked.take().or_else(|| c.machine.poll()) {
        match action {
            SyncAction::Stage { unit, key, kind } => {
                let buf = c.staging.entry(key).or_default();
                let range = (unit.at, unit.len, unit.layer_len);
                c.replica
                    .append_unit_range(unit.layer, kind.unit_data(), range, buf);
            }
            SyncAction::Launch {
                key,
                units,
                kind,
                landing,
            } => {
                let ready = units
                    .iter()
                    .map(|u| match kind {
                        SyncKind::Gradients => c.grad_avail[u.layer],
                        SyncKind::Parameters => c.stepped_at[u.layer],
                    })
                    .fold(c.now, SimTime::max);
                let buffer = c.staging.remove(&key).unwrap_or_default();
                if landing.needs_cut() {
                    c.cuts.insert(key, buffer.clone());
                }
                let ids = units.iter().map(|u| u.id).collect();
                rendezvous.join(key, ids, ci, ready, buffer);
            }
            SyncAction::Wait { key } => match rendezvous.end_of(key) {
                Some(end) => c.now = c.now.max(end),
                None => {
                    c.blocked = Some(SyncAction::Wait { key });
                    return false;
                }
            },
            SyncAction::Apply {
                key,
                unit,
                offset,
                kind,
                landing,
            } => {
                let (replica, scratch, outer_state) =
                    (&mut c.replica, &mut c.scratch, &mut c.outer);
                let cut = c.cuts.get(&key);
                let len = unit.len;
                let (what, layer) = (kind.unit_data(), unit.layer);
                let read = |replica: &mut Replica, scratch: &mut Vec<f32>| {
                    scratch.clear();
                    let range = (unit.at, unit.len, unit.layer_len);
                    replica.append_unit_range(layer, what, range, scratch);
                };
                let at = (unit.at, unit.layer_len);
                rendezvous.apply(key, offset, len, |average| match (kind, landing) {
                    (SyncKind::Gradients, _) | (SyncKind::Parameters, Landing::Replace) => {
                        replica.write_unit_range(layer, what, at, average)
                    }
                    (SyncKind::Parameters, Landing::Rebase) => {
                        let cut = &cut.expect("a rebase keeps its cut")[offset..offset + len];
                        read(replica, scratch);
                        outer::rebase(average, cut, scratch);
                        replica.write_unit_range(layer, what, at, scratch);
                    }
                    (SyncKind::Parameters, Landing::Outer { mix }) => {
                        read(replica, scratch);
                        outer_state.land(unit.id, average, scratch, mix);
                        replica.write_unit_range(layer, what, at, scratch);
                    }
                });
                if landing.needs_cut() && offset + len == c.cuts.get(&key).map_or(0, Vec::len) {
                    c.cuts.remove(&key);
                }
            }
            SyncAction::StepLayer { layer } => {
                c.replica.step_layer(layer);
                c.stepped_at[layer] = c.now.max(c.grad_avail[layer]);
            }
            SyncAction::SetAnchor { unit } => {
                c.scratch.clear();
                let range = (unit.at, unit.len, unit.layer_len);
                c.replica.append_unit_range(
                    unit.layer,
                    engine::replica::UnitData::Values,
                    range,
                    &mut c.scratch,
                );
                c.outer.set_anchor(unit.id, &c.scratch);
            }
        }
    }
    true
}

/// Writes the weighted mean over clusters of layer `layer`'s values into `out`.
fn average_layer(
    clusters: &mut [ClusterState],
    weights: &[f32],
    layer: usize,
    len: usize,
    out: &mut Vec<f32>,
) {
    out.clear();
    out.resize(len, 0.0);
    let mut values = Vec::with_capacity(len);
    for (c, &w) in clusters.iter_mut().zip(weights) {
        c.replica.values_into(layer, &mut values);
        for (o, v) in out.iter_mut().zip(&values) {
            *o += w * v;
        }
    }
}

/// The DreamDDP timing profile as this simulation will charge it: per-unit backward seconds
/// of the slowest cluster (its nominal slowdown and mean jitter; non-parameterized layers
/// count toward the unit below them in backward order) and per-unit communication seconds
/// (intra-cluster all-reduce plus the inter-cluster all-reduce probed on a copy of the links).
fn profile_of(
    clusters: &[ClusterModel],
    units: &[usize],
    names: &[String],
    layer_len: &[usize],
    fabric: &Fabric,
) -> Result<ModelProfile, ClustersError> {
    let nominal_factor =
        |c: &ClusterModel| c.setup.straggler.slowdown * (1.0 + 0.5 * c.setup.straggler.jitter);
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
