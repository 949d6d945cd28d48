//! The worker's per-step synchronization decisions as a sans-IO state machine.
//!
//! [`WorkerSyncMachine`] owns *what* a worker synchronizes *when* under a [`SyncPlan`]: which
//! layer data to stage into which collective, when a collective is launched, when the worker
//! must wait for one, where an average is written back, and when each layer's optimizer
//! step runs. It does no I/O and reads no clock: the driver feeds it the points of a training
//! step and executes the [`SyncAction`]s it returns, **in order** (a [`SyncAction::Wait`]
//! must have completed before the next action runs). The node trainer
//! ([`crate::trainer`]) drives it with real threads and collectives; the clusters simulation
//! drives the same machine in virtual time.
//!
//! Inputs, per step: [`WorkerSyncMachine::begin_step`], then
//! [`WorkerSyncMachine::layer_grads_ready`] for each parameterized layer in backward order
//! (from the backward hook, output head first; every action it returns touches only that
//! layer or collectives), then [`WorkerSyncMachine::backward_done`]. After the last step,
//! [`WorkerSyncMachine::finish`] lands what is still in flight. Outputs: [`WorkerSyncMachine::poll`].
//!
//! | strategy | on `layer_grads_ready(l)` | on `backward_done` |
//! |---|---|---|
//! | `ssgd` | nothing | stage every gradient, launch one collective, wait, apply, step every layer |
//! | `wfbp` | stage `l`'s gradient; launch its bucket once the bucket is complete | wait every bucket in launch order, apply, step every layer |
//! | `localsgd` | step `l` | every H-th step (`(step + 1) % H == 0`): stage every parameter, launch, wait, apply |
//! | `dreamddp`, `plsgd` | if `l`'s bucket has an average launched `delay` steps ago (or it is due again), wait for it (at the bucket's first layer); apply `l`'s slice; step `l`; if `l` is due, stage its parameters and launch its bucket once the bucket's due layers are staged | nothing: the launch is waited right before the layer's optimizer step `delay` steps later |
//! | `diloco` | step `l` (at the first step, first set `l`'s outer anchor) | every H-th step: stage every parameter, launch, wait, land through the outer optimizer |
//! | `streaming-diloco` | step `l` (at the first step, first set `l`'s outer anchor) | land the fragments launched `delay` steps ago (wait, outer step, mix); stage and launch the fragments due at this step (with `delay = 0`, waited and landed at once) |
//!
//! Every `Launch` and `Apply` carries the plan's [`Landing`]: how the average is written
//! ([`engine::outer`]); with [`Landing::Rebase`] the driver keeps a copy of what it sent.
//! What is staged, launched and applied are the plan's sync units ([`UnitSlice`]): whole
//! layers, or chunks of a layer the plan split. A layer's units are handled together at its
//! hook (its waits and applies, then its one optimizer step, then its stages). Units of a
//! collective are in backward order; a collective's buffer is the concatenation of its units'
//! parameters (or gradients) in that order, each unit its slice of its layer's tensors in
//! order.

use std::collections::VecDeque;

use engine::outer::Landing;
use engine::plan::{Strategy, SyncPlan};
use engine::replica::UnitData;

use node::collective::ReduceKey;

/// What a collective carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SyncKind {
    /// Gradients, averaged before the optimizer step (`ssgd`, `wfbp`).
    Gradients,
    /// Parameter values, averaged after local steps (`localsgd`, `dreamddp`).
    Parameters,
}

impl SyncKind {
    /// The half of a replica unit's state this kind reads and writes.
    pub fn unit_data(self) -> UnitData {
        match self {
            SyncKind::Gradients => UnitData::Grads,
            SyncKind::Parameters => UnitData::Values,
        }
    }
}

/// One sync unit as the driver reads and writes it: a whole layer, or one chunk of a layer
/// the plan split ([`engine::plan::PlanConfig::sync_unit_params`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UnitSlice {
    /// Unit id in the plan ([`engine::plan::UnitPlan::id`]).
    pub id: usize,
    /// Model layer index.
    pub layer: usize,
    /// Where the unit starts in its layer's flat values (its tensors in order).
    pub at: usize,
    /// f32 values of the unit.
    pub len: usize,
    /// f32 values of the whole layer (`len` unless a chunk).
    pub layer_len: usize,
}

impl UnitSlice {
    /// True when the unit is its whole layer.
    pub fn is_whole_layer(&self) -> bool {
        self.at == 0 && self.len == self.layer_len
    }
}

/// One instruction to the driver. Execute them in the order [`WorkerSyncMachine::poll`]
/// returns them.
#[derive(Clone, Debug, PartialEq)]
pub enum SyncAction {
    /// Append unit `unit`'s gradients or parameters to the buffer of collective `key`.
    Stage {
        /// The unit.
        unit: UnitSlice,
        /// The collective the data goes to.
        key: ReduceKey,
        /// What to copy.
        kind: SyncKind,
    },
    /// Start the all-reduce (mean over workers) of collective `key`'s staged buffer.
    Launch {
        /// The collective.
        key: ReduceKey,
        /// Its units in buffer order (backward order).
        units: Vec<UnitSlice>,
        /// What it carries.
        kind: SyncKind,
        /// How its result will land (keep the sent buffer for [`Landing::Rebase`]).
        landing: Landing,
    },
    /// Block until collective `key` has completed and keep its result.
    Wait {
        /// The collective.
        key: ReduceKey,
    },
    /// Write `unit.len` values of collective `key`'s result, from `offset`, into unit `unit`'s
    /// gradients or parameters.
    Apply {
        /// The collective (already waited).
        key: ReduceKey,
        /// The unit.
        unit: UnitSlice,
        /// Offset of the unit in the result.
        offset: usize,
        /// Gradients or parameters.
        kind: SyncKind,
        /// How the values are written (always [`Landing::Replace`] for gradients).
        landing: Landing,
    },
    /// Run the optimizer on layer `layer` with its current gradients.
    StepLayer {
        /// Model layer index.
        layer: usize,
    },
    /// Set unit `unit`'s outer-optimizer anchor to its current values (`diloco`,
    /// `streaming-diloco`, once, before its layer's first optimizer step).
    SetAnchor {
        /// The unit.
        unit: UnitSlice,
    },
}

impl SyncAction {
    /// The model layer the action reads or writes, if any.
    pub fn layer(&self) -> Option<usize> {
        match self {
            SyncAction::Stage { unit, .. }
            | SyncAction::Apply { unit, .. }
            | SyncAction::SetAnchor { unit } => Some(unit.layer),
            SyncAction::StepLayer { layer } => Some(*layer),
            SyncAction::Launch { .. } | SyncAction::Wait { .. } => None,
        }
    }
}

/// A collective launched and not yet waited.
#[derive(Clone, Debug)]
struct Launched {
    key: ReduceKey,
    /// Unit ids, backward order.
    units: Vec<usize>,
    kind: SyncKind,
    landing: Landing,
    /// The step at which it lands (the launch step plus the plan's delay).
    lands_at: u64,
}

/// The sync decisions of one worker (see the module doc).
#[derive(Clone, Debug)]
pub struct WorkerSyncMachine {
    plan: SyncPlan,
    strategy: Strategy,
    /// Per unit id: its slice of its layer.
    slices: Vec<UnitSlice>,
    /// Per unit id: its plan bucket.
    bucket_of: Vec<usize>,
    /// Unit ids in backward order.
    all_units: Vec<usize>,
    /// Model layers with parameters in backward order.
    all_layers: Vec<usize>,
    /// The step in progress (between `begin_step` and `backward_done`).
    step: Option<u64>,
    /// Per bucket: due units not yet staged this step.
    due_left: Vec<usize>,
    /// Per bucket: units staged this step, backward order.
    staged: Vec<Vec<usize>>,
    /// Collectives launched this step, waited after backward.
    awaiting: Vec<Launched>,
    /// dreamddp, plsgd, streaming-diloco: per bucket, the average launched at an earlier step.
    deferred: Vec<Option<Launched>>,
    /// dreamddp, plsgd: per unit, the waited collective and offset still to be written.
    landing: Vec<Option<(ReduceKey, usize)>>,
    /// diloco, streaming-diloco: per unit, whether its outer anchor is set.
    anchored: Vec<bool>,
    actions: VecDeque<SyncAction>,
}

impl WorkerSyncMachine {
    /// A machine executing `plan` (its strategy, buckets and per-unit schedule).
    pub fn new(plan: &SyncPlan) -> Self {
        let units = plan.units();
        let slices: Vec<UnitSlice> = units
            .iter()
            .map(|u| UnitSlice {
                id: u.id,
                layer: u.index,
                at: u.offset,
                len: u.params,
                layer_len: plan.units_of_layer(u.index).iter().map(|c| c.params).sum(),
            })
            .collect();
        let mut all_layers: Vec<usize> = units.iter().rev().map(|u| u.index).collect();
        all_layers.dedup();
        let buckets = plan.buckets().len();
        Self {
            plan: plan.clone(),
            strategy: plan.strategy(),
            slices,
            bucket_of: units.iter().map(|u| u.bucket).collect(),
            all_units: units.iter().rev().map(|u| u.id).collect(),
            all_layers,
            step: None,
            due_left: vec![0; buckets],
            staged: vec![Vec::new(); buckets],
            awaiting: Vec::new(),
            deferred: vec![None; buckets],
            landing: vec![None; units.len()],
            anchored: vec![false; units.len()],
            actions: VecDeque::new(),
        }
    }

    /// The plan this machine executes.
    pub fn plan(&self) -> &SyncPlan {
        &self.plan
    }

    /// The slice of unit `id` (its layer and where it lies in it).
    pub fn unit_slice(&self, id: usize) -> UnitSlice {
        self.slices[id]
    }

    /// The next action to execute, if any.
    pub fn poll(&mut self) -> Option<SyncAction> {
        self.actions.pop_front()
    }

    /// Starts step `step` (before forward). The previous step must have ended with
    /// [`Self::backward_done`].
    pub fn begin_step(&mut self, step: u64) {
        assert!(self.step.is_none(), "begin_step before backward_done");
        self.step = Some(step);
        for (b, bucket) in self.plan.buckets().iter().enumerate() {
            self.staged[b].clear();
            self.due_left[b] = match self.strategy {
                Strategy::Wfbp => bucket.units.len(),
                Strategy::DreamDdp | Strategy::Plsgd => bucket
                    .units
                    .iter()
                    .filter(|&&u| self.plan.unit_is_due(step, u))
                    .count(),
                Strategy::Ssgd
                | Strategy::LocalSgd
                | Strategy::Diloco
                | Strategy::StreamingDiloco => 0,
            };
        }
    }

    /// Layer `layer`'s gradient has just been computed (backward hook). Layers without
    /// parameters are ignored.
    pub fn layer_grads_ready(&mut self, layer: usize) {
        let step = self.step.expect("layer_grads_ready inside a step");
        let units: Vec<usize> = self
            .plan
            .units_of_layer(layer)
            .iter()
            .rev()
            .map(|u| u.id)
            .collect();
        if units.is_empty() {
            return;
        }
        let in_backward = matches!(self.strategy, Strategy::DreamDdp | Strategy::Plsgd);
        if in_backward {
            for &u in &units {
                let b = self.bucket_of[u];
                let lands_now = self.deferred[b]
                    .as_ref()
                    .is_some_and(|f| f.lands_at <= step || self.plan.unit_is_due(step, u));
                if lands_now {
                    let f = self.deferred[b].take().expect("checked above");
                    self.actions.push_back(SyncAction::Wait { key: f.key });
                    let mut offset = 0;
                    for &v in &f.units {
                        self.landing[v] = Some((f.key, offset));
                        offset += self.slices[v].len;
                    }
                }
                if let Some((key, offset)) = self.landing[u].take() {
                    self.actions.push_back(SyncAction::Apply {
                        key,
                        unit: self.slices[u],
                        offset,
                        kind: SyncKind::Parameters,
                        landing: self.plan.landing(),
                    });
                }
            }
        }
        if self.strategy.uses_outer_optimizer() {
            for &u in &units {
                if !self.anchored[u] {
                    self.anchored[u] = true;
                    self.actions.push_back(SyncAction::SetAnchor {
                        unit: self.slices[u],
                    });
                }
            }
        }
        match self.strategy {
            Strategy::Ssgd => return,
            Strategy::Wfbp => {}
            Strategy::LocalSgd | Strategy::Diloco | Strategy::StreamingDiloco => {
                self.actions.push_back(SyncAction::StepLayer { layer });
                return;
            }
            Strategy::DreamDdp | Strategy::Plsgd => {
                self.actions.push_back(SyncAction::StepLayer { layer });
            }
        }
        let (kind, landing) = if self.strategy == Strategy::Wfbp {
            (SyncKind::Gradients, Landing::Replace)
        } else {
            (SyncKind::Parameters, self.plan.landing())
        };
        for u in units {
            let due = self.strategy == Strategy::Wfbp || self.plan.unit_is_due(step, u);
            if due {
                self.stage_in_backward(step, u, kind, landing, in_backward);
            }
        }
    }

    /// Stages unit `u` into its bucket's collective of `step` and launches the bucket once
    /// its due units are all staged.
    fn stage_in_backward(
        &mut self,
        step: u64,
        u: usize,
        kind: SyncKind,
        landing: Landing,
        deferred: bool,
    ) {
        let b = self.bucket_of[u];
        let key = ReduceKey::new(step, b as u32);
        self.actions.push_back(SyncAction::Stage {
            unit: self.slices[u],
            key,
            kind,
        });
        self.staged[b].push(u);
        assert!(self.due_left[b] > 0, "unit {u} staged twice in a step");
        self.due_left[b] -= 1;
        if self.due_left[b] == 0 {
            let units = std::mem::take(&mut self.staged[b]);
            self.actions.push_back(SyncAction::Launch {
                key,
                units: units.iter().map(|&v| self.slices[v]).collect(),
                kind,
                landing,
            });
            let launched = Launched {
                key,
                units,
                kind,
                landing,
                lands_at: step + self.plan.delay(),
            };
            if deferred {
                self.deferred[b] = Some(launched);
            } else {
                self.awaiting.push(launched);
            }
        }
    }

    /// Backward has ended: the blocking collectives of the step, the waits and the optimizer
    /// steps that follow backward. Ends the step.
    pub fn backward_done(&mut self) {
        let step = self.step.take().expect("backward_done inside a step");
        match self.strategy {
            Strategy::Ssgd => {
                let units = self.all_units.clone();
                self.launch_blocking(step, 0, units, SyncKind::Gradients, Landing::Replace);
            }
            Strategy::LocalSgd | Strategy::Diloco => {
                let due = self.plan.due_units(step);
                if !due.is_empty() {
                    let landing = self.plan.landing();
                    self.launch_blocking(step, 0, due, SyncKind::Parameters, landing);
                }
            }
            Strategy::StreamingDiloco => self.stream_fragments(step),
            Strategy::Wfbp | Strategy::DreamDdp | Strategy::Plsgd => {}
        }
        for f in std::mem::take(&mut self.awaiting) {
            self.wait_and_apply(f);
        }
        if matches!(self.strategy, Strategy::Ssgd | Strategy::Wfbp) {
            for i in 0..self.all_layers.len() {
                let layer = self.all_layers[i];
                self.actions.push_back(SyncAction::StepLayer { layer });
            }
        }
    }

    /// Stages `units` (backward order) into collective `(step, bucket)`, launches it and
    /// queues it to be waited at the end of this step.
    fn launch_blocking(
        &mut self,
        step: u64,
        bucket: u32,
        units: Vec<usize>,
        kind: SyncKind,
        landing: Landing,
    ) {
        let key = ReduceKey::new(step, bucket);
        for &u in &units {
            self.actions.push_back(SyncAction::Stage {
                unit: self.slices[u],
                key,
                kind,
            });
        }
        self.actions.push_back(SyncAction::Launch {
            key,
            units: units.iter().map(|&u| self.slices[u]).collect(),
            kind,
            landing,
        });
        self.awaiting.push(Launched {
            key,
            units,
            kind,
            landing,
            lands_at: step,
        });
    }

    /// streaming-diloco after backward of `step`: land the fragments whose delay has passed
    /// (or that are due again), then launch the fragments due at `step`.
    fn stream_fragments(&mut self, step: u64) {
        let landing = self.plan.landing();
        for b in 0..self.deferred.len() {
            let due = self.plan.buckets()[b]
                .units
                .iter()
                .any(|&u| self.plan.unit_is_due(step, u));
            if self.deferred[b]
                .as_ref()
                .is_some_and(|f| f.lands_at <= step || due)
            {
                let f = self.deferred[b].take().expect("checked above");
                self.wait_and_apply(f);
            }
        }
        for b in 0..self.deferred.len() {
            let units: Vec<usize> = self.plan.buckets()[b]
                .units
                .iter()
                .copied()
                .filter(|&u| self.plan.unit_is_due(step, u))
                .collect();
            if units.is_empty() {
                continue;
            }
            let key = ReduceKey::new(step, b as u32);
            for &u in &units {
                self.actions.push_back(SyncAction::Stage {
                    unit: self.slices[u],
                    key,
                    kind: SyncKind::Parameters,
                });
            }
            self.actions.push_back(SyncAction::Launch {
                key,
                units: units.iter().map(|&u| self.slices[u]).collect(),
                kind: SyncKind::Parameters,
                landing,
            });
            let launched = Launched {
                key,
                units,
                kind: SyncKind::Parameters,
                landing,
                lands_at: step + self.plan.delay(),
            };
            if self.plan.delay() == 0 {
                self.wait_and_apply(launched);
            } else {
                self.deferred[b] = Some(launched);
            }
        }
    }

    /// Training has ended: wait for the averages still in flight (dreamddp, plsgd,
    /// streaming-diloco) and write them.
    pub fn finish(&mut self) {
        assert!(self.step.is_none(), "finish inside a step");
        for b in 0..self.deferred.len() {
            if let Some(f) = self.deferred[b].take() {
                self.wait_and_apply(f);
            }
        }
    }

    /// Keys of the collectives launched and not yet waited, in launch order of their buckets.
    pub fn in_flight(&self) -> Vec<ReduceKey> {
        self.awaiting
            .iter()
            .chain(self.deferred.iter().flatten())
            .map(|f| f.key)
            .collect()
    }

    fn wait_and_apply(&mut self, f: Launched) {
        self.actions.push_back(SyncAction::Wait { key: f.key });
        let mut offset = 0;
        for &u in &f.units {
            let unit = self.slices[u];
            self.actions.push_back(SyncAction::Apply {
                key: f.key,
                unit,
                offset,
                kind: f.kind,
                landing: f.landing,
            });
            offset += unit.len;
        }
    }
}

#[cfg(test)]
#[path = "sync_machine_tests.rs"]
mod tests;
