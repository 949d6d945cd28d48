//! Sync plans: strategies, per-layer periods, which layers are due at a step.
//!
//! A [`SyncPlan`] is built once from a model's sync units (its parameterized layers,
//! [`LayerInfo`] in forward order) and a [`PlanConfig`], and then answers, during backward,
//! whether a layer must be synchronized at a global step ([`SyncPlan::is_due`]).
//!
//! Every unit gets a period `p` and a set of phases in `0..p`; it is due at step `s` when
//! `s % p` is one of its phases:
//!
//! | strategy   | moves       | period of a unit          | phases                                  |
//! |------------|-------------|---------------------------|-----------------------------------------|
//! | `ssgd`     | gradients   | 1                         | `{0}` (every step)                       |
//! | `wfbp`     | gradients   | 1                         | `{0}` (every step, bucketed in backward) |
//! | `localsgd` | parameters  | H, or its override K      | `{p − 1}`: due when `(s + 1) % p == 0`   |
//! | `dreamddp` | parameters  | H, or its override K      | the schedule's phases (see below)        |
//! | `plsgd`    | parameters  | H, or its override K      | the equal split of the layers into H groups |
//! | `diloco`   | parameters  | H, or its override K      | `{p − 1}`, like `localsgd`               |
//! | `streaming-diloco` | parameters | H, or its override K | the equal split: H staggered fragments |
//!
//! `plsgd` is DreamDDP's partial local SGD with the naive equal partition the paper compares its
//! schedule against (PLSGD): whole layers, contiguous groups in backward order, launched in
//! backward, no delay. `diloco` and `streaming-diloco` land their averages through the outer
//! optimizer of [`crate::outer`]; `streaming-diloco` launches a fragment after the step it is
//! due at and lands it `delay` (τ) steps later. `dreamddp` lands an average `delay` steps after
//! its launch (1: just before the layer's next optimizer step, the paper's algorithm; more:
//! rebased onto the progress made meanwhile, see [`crate::outer::Landing::Rebase`]).
//!
//! DreamDDP: the [`crate::schedule`] assigns every unit one phase of `0..H` (the profiled DFS
//! or the equal split), possibly plus extra phases from bubble filling. A unit whose period is
//! overridden to `K ≠ H` keeps only its primary phase, taken modulo `K` (so `K = 1` means every
//! step). The schedule is computed over all units, overridden or not. `H = 1` degenerates to
//! parameter averaging of every layer at every step.
//!
//! Buckets ([`crate::bucket`]) pack adjacent units (backward order) with the same period and
//! phases.

use std::collections::HashSet;
use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::bucket::{make_buckets, Bucket, BucketCaps};
use crate::config_search::Candidate;
use crate::model::LayerInfo;
use crate::outer::{Landing, OuterConfig, OuterConfigError};
use crate::schedule::{self, DreamSchedule, LayerProfile, ModelProfile, ScheduleError};

/// An unknown name given for a [`Strategy`] or a [`ScheduleKind`].
#[derive(Debug, Error, Clone, PartialEq, Eq)]
#[error("unknown {what} `{got}`; valid: {valid}")]
pub struct UnknownNameError {
    /// What was being parsed (`strategy`, `schedule`).
    pub what: &'static str,
    /// The text given.
    pub got: String,
    /// The valid names, comma separated.
    pub valid: String,
}

fn parse_name<T: Copy>(
    what: &'static str,
    s: &str,
    all: &[T],
    name: impl Fn(T) -> &'static str,
) -> Result<T, UnknownNameError> {
    all.iter()
        .copied()
        .find(|&v| name(v).eq_ignore_ascii_case(s.trim()))
        .ok_or_else(|| UnknownNameError {
            what,
            got: s.to_string(),
            valid: all.iter().map(|&v| name(v)).collect::<Vec<_>>().join(", "),
        })
}

/// How replicas are kept in agreement.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Strategy {
    /// Synchronous SGD: all gradients all-reduced after backward, every step.
    Ssgd,
    /// Wait-free backpropagation (PyTorch DDP): gradients all-reduced bucket by bucket during
    /// backward, every step.
    Wfbp,
    /// Local SGD: all parameters averaged every H steps, after backward.
    LocalSgd,
    /// DreamDDP: each layer's parameters averaged once per H steps at its scheduled step,
    /// launched in backward the moment its gradient is ready.
    DreamDdp,
    /// Partial local SGD with the equal partition (the DreamDDP paper's PLSGD baseline).
    Plsgd,
    /// DiLoCo: H local steps, then an outer Nesterov step on the averaged pseudo-gradient.
    Diloco,
    /// Streaming DiLoCo: H staggered fragments, each an outer step once per H steps, its
    /// exchange overlapped with `delay` local steps.
    #[serde(rename = "streaming-diloco")]
    StreamingDiloco,
}

impl Strategy {
    /// Every strategy, in the order they are listed to users.
    pub const ALL: [Strategy; 7] = [
        Strategy::Ssgd,
        Strategy::Wfbp,
        Strategy::LocalSgd,
        Strategy::DreamDdp,
        Strategy::Plsgd,
        Strategy::Diloco,
        Strategy::StreamingDiloco,
    ];

    /// The name used on the command line and in files.
    pub fn name(self) -> &'static str {
        match self {
            Strategy::Ssgd => "ssgd",
            Strategy::Wfbp => "wfbp",
            Strategy::LocalSgd => "localsgd",
            Strategy::DreamDdp => "dreamddp",
            Strategy::Plsgd => "plsgd",
            Strategy::Diloco => "diloco",
            Strategy::StreamingDiloco => "streaming-diloco",
        }
    }

    /// True when parameters are averaged (local SGD family); false when gradients are
    /// all-reduced every step.
    pub fn syncs_parameters(self) -> bool {
        !matches!(self, Strategy::Ssgd | Strategy::Wfbp)
    }

    /// True when synchronization is launched during backward rather than after it.
    pub fn overlaps_backward(self) -> bool {
        matches!(self, Strategy::Wfbp | Strategy::DreamDdp | Strategy::Plsgd)
    }

    /// True when layers are averaged at different steps of the period (a schedule of phases):
    /// `dreamddp`, `plsgd`, `streaming-diloco`.
    pub fn is_partial(self) -> bool {
        matches!(
            self,
            Strategy::DreamDdp | Strategy::Plsgd | Strategy::StreamingDiloco
        )
    }

    /// True when averages land through the outer optimizer (`diloco`, `streaming-diloco`).
    pub fn uses_outer_optimizer(self) -> bool {
        matches!(self, Strategy::Diloco | Strategy::StreamingDiloco)
    }
}

impl fmt::Display for Strategy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Strategy {
    type Err = UnknownNameError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        parse_name("strategy", s, &Strategy::ALL, Strategy::name)
    }
}

/// Which DreamDDP schedule to build.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ScheduleKind {
    /// The best of the profiled DFS and the equal splits into 1..=H phase groups, with the best
    /// delay, under the multi-step cost model of [`crate::config_search`] (when the caller
    /// runs that search; a plan built directly takes `profiled` when it has a profile and
    /// `equal` otherwise).
    #[default]
    Auto,
    /// The DFS over measured per-layer timings, with bubble filling (the paper's schedule).
    Profiled,
    /// Contiguous equal split in backward order (baseline), into [`PlanConfig::groups`]
    /// phase groups (H by default).
    Equal,
}

impl ScheduleKind {
    /// Every schedule kind.
    pub const ALL: [ScheduleKind; 3] = [
        ScheduleKind::Auto,
        ScheduleKind::Profiled,
        ScheduleKind::Equal,
    ];

    /// The name used on the command line and in files.
    pub fn name(self) -> &'static str {
        match self {
            ScheduleKind::Auto => "auto",
            ScheduleKind::Profiled => "profiled",
            ScheduleKind::Equal => "equal",
        }
    }
}

impl fmt::Display for ScheduleKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for ScheduleKind {
    type Err = UnknownNameError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        parse_name("schedule", s, &ScheduleKind::ALL, ScheduleKind::name)
    }
}

/// Why a plan could not be built.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum PlanError {
    /// H = 0.
    #[error("period must be at least 1 (got 0)")]
    ZeroPeriod,
    /// The model has no parameterized layer.
    #[error("model {model} has no layer with parameters: nothing to synchronize")]
    NoUnits {
        /// Model name.
        model: String,
    },
    /// A DreamDDP period longer than the number of sync units.
    #[error(
        "period {period} needs at least {period} sync units; model {model} has {units} \
         — lower --period, split large layers into chunks (--sync-unit-kb), or use localsgd"
    )]
    PeriodExceedsUnits {
        /// The period asked for.
        period: u64,
        /// Model name.
        model: String,
        /// Its number of sync units.
        units: usize,
    },
    /// A period override naming a layer the model does not have (or one without parameters).
    #[error("period override names unknown layer `{name}`; layers with parameters: {valid}")]
    UnknownLayer {
        /// The name given.
        name: String,
        /// The valid names, comma separated.
        valid: String,
    },
    /// The same layer overridden twice.
    #[error("period of layer `{name}` is overridden twice")]
    DuplicateOverride {
        /// Layer name.
        name: String,
    },
    /// A per-layer period of 0.
    #[error("period override for layer `{name}` must be at least 1 (got 0)")]
    ZeroLayerPeriod {
        /// Layer name.
        name: String,
    },
    /// Per-layer periods asked of a strategy that syncs gradients every step.
    #[error(
        "per-layer periods apply to parameter averaging (localsgd, dreamddp), not {strategy}, \
         which syncs every gradient every step"
    )]
    OverridesNeedParameterSync {
        /// The strategy.
        strategy: Strategy,
    },
    /// `a=b,c=d` override text that does not parse.
    #[error("bad period override `{text}`: expected NAME=PERIOD[,NAME=PERIOD…]")]
    BadOverrideSyntax {
        /// The offending piece.
        text: String,
    },
    /// A profiled schedule without timings.
    #[error(
        "schedule `profiled` needs per-layer timings; profile the model first \
         (or use schedule::estimate_profiles) or use --schedule equal"
    )]
    MissingProfile,
    /// Timings that do not belong to this model's units.
    #[error(
        "profile entry {position} (backward order) is for layer `{got}`, expected `{expected}`"
    )]
    ProfileMismatch {
        /// Position in backward order.
        position: usize,
        /// Unit expected there.
        expected: String,
        /// What the profile has there (`<missing>` when too short).
        got: String,
    },
    /// The schedule could not be built.
    #[error(transparent)]
    Schedule(#[from] ScheduleError),
    /// A delay the strategy cannot run.
    #[error("delay {delay} is not valid for {strategy} with period {period}: {why}")]
    BadDelay {
        /// The strategy.
        strategy: Strategy,
        /// The delay asked for.
        delay: u64,
        /// The period H.
        period: u64,
        /// What is allowed.
        why: &'static str,
    },
    /// A bad outer-optimizer setting.
    #[error(transparent)]
    Outer(#[from] OuterConfigError),
}

/// Parses `"embed=32,head=1"` into period overrides.
pub fn parse_period_overrides(text: &str) -> Result<Vec<(String, u64)>, PlanError> {
    text.split(',')
        .map(str::trim)
        .filter(|piece| !piece.is_empty())
        .map(|piece| {
            let bad = || PlanError::BadOverrideSyntax {
                text: piece.to_string(),
            };
            let (name, period) = piece.split_once('=').ok_or_else(bad)?;
            let period = period.trim().parse::<u64>().map_err(|_| bad())?;
            let name = name.trim();
            if name.is_empty() {
                return Err(bad());
            }
            Ok((name.to_string(), period))
        })
        .collect()
}

/// What a plan is built from (besides the model's units and timings).
#[derive(Clone, Debug, PartialEq)]
pub struct PlanConfig {
    /// The strategy.
    pub strategy: Strategy,
    /// The period H (ignored by `ssgd`/`wfbp`, but must be ≥ 1).
    pub period: u64,
    /// DreamDDP schedule kind (ignored by other strategies).
    pub schedule: ScheduleKind,
    /// Per-layer periods by layer name, e.g. `[("embed", 32), ("head", 1)]`.
    pub period_overrides: Vec<(String, u64)>,
    /// Bucket size limits.
    pub bucket_caps: BucketCaps,
    /// DreamDDP bubble filling: extra syncs where the modelled link would idle. Off by
    /// default: extra syncs cost bytes, and on a fast link they would sync every layer
    /// every step (the bytes of `ssgd`).
    pub bubble_filling: bool,
    /// Steps between an average's launch and its landing: `dreamddp` (1 = the paper's
    /// algorithm, at most H − 1 when H > 1) and `streaming-diloco` (τ, 0 ≤ τ < H). `None`
    /// is 1 here; [`crate::config_search::search`] tries every delay for `None`. Other
    /// strategies ignore it.
    pub delay: Option<u64>,
    /// Outer optimizer of `diloco` / `streaming-diloco`.
    pub outer: OuterConfig,
    /// Phase groups of the `equal` schedule (1..=H; `None`: H, one group per phase).
    pub groups: Option<u64>,
    /// The largest sync unit, in f32 values: a layer over it is split into chunks
    /// ([`crate::sync_units`]), each scheduled and bucketed as a unit of its own. `Some(0)`:
    /// whole layers. `None`: whole layers here; [`crate::config_search::search`] also tries
    /// chunk sizes for `dreamddp`.
    pub sync_unit_params: Option<usize>,
}

impl PlanConfig {
    /// [`Self::sync_unit_params`] for `strategy` from a cap in KiB (`--sync-unit-kb`,
    /// `sync_unit_kb`): only `dreamddp` splits layers (`None`: its search chooses); every
    /// other strategy keeps whole layers.
    pub fn sync_unit_params_for(strategy: Strategy, kib: Option<u64>) -> Option<usize> {
        match strategy {
            Strategy::DreamDdp => kib.map(crate::sync_units::values_in_kib),
            _ => Some(0),
        }
    }

    /// A config with the given strategy and period, the profiled schedule, no overrides and
    /// PyTorch-DDP bucket caps.
    pub fn new(strategy: Strategy, period: u64) -> Self {
        Self {
            strategy,
            period,
            schedule: ScheduleKind::Profiled,
            period_overrides: Vec::new(),
            bucket_caps: BucketCaps::default(),
            bubble_filling: false,
            delay: None,
            outer: OuterConfig::default(),
            groups: None,
            sync_unit_params: None,
        }
    }
}

/// The plan of one sync unit: a whole layer, or one chunk of a layer split by
/// [`PlanConfig::sync_unit_params`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnitPlan {
    /// Unit id: the position in [`SyncPlan::units`] (forward order). Buckets and the sync
    /// machine name units by it.
    pub id: usize,
    /// Model layer index.
    pub index: usize,
    /// Unit name: the layer's, with `[i/n]` for chunk `i` of `n`.
    pub name: String,
    /// Where the unit starts in its layer's flat parameters (0 unless a chunk).
    pub offset: usize,
    /// f32 parameters of the unit.
    pub params: usize,
    /// Period of this unit (1 for gradient strategies).
    pub period: u64,
    /// Sorted phases in `0..period` at which the unit is due.
    pub phases: Vec<u64>,
    /// Id of the bucket holding it.
    pub bucket: usize,
}

impl UnitPlan {
    /// Whether the unit is synchronized at global step `step`.
    pub fn is_due(&self, step: u64) -> bool {
        self.phases.binary_search(&(step % self.period)).is_ok()
    }
}

/// Which layers synchronize at which step (see the module doc).
#[derive(Clone, Debug)]
pub struct SyncPlan {
    model: String,
    strategy: Strategy,
    period: u64,
    schedule_kind: ScheduleKind,
    /// Units in forward order.
    units: Vec<UnitPlan>,
    /// Model layer index → the ids of its units (`start..end`; empty for a layer without
    /// parameters).
    units_of_layer: Vec<std::ops::Range<usize>>,
    buckets: Vec<Bucket>,
    schedule: Option<DreamSchedule>,
    delay: u64,
    /// The candidates of the configuration search, when this plan was chosen by one.
    search: Option<Vec<Candidate>>,
    outer: OuterConfig,
}

impl SyncPlan {
    /// Builds the plan of model `model` whose sync units are `units_forward` (forward order,
    /// as [`crate::model::Model::layer_infos`] returns them). `profile` (backward order) is
    /// needed by the profiled DreamDDP schedule only.
    pub fn new(
        model: &str,
        units_forward: &[LayerInfo],
        config: &PlanConfig,
        profile: Option<&ModelProfile>,
    ) -> Result<Self, PlanError> {
        let h = config.period;
        if h == 0 {
            return Err(PlanError::ZeroPeriod);
        }
        if units_forward.is_empty() {
            return Err(PlanError::NoUnits {
                model: model.to_string(),
            });
        }
        let layer_overrides = resolve_overrides(units_forward, config)?;
        let layers_backward: Vec<LayerInfo> = units_forward.iter().rev().cloned().collect();
        let chunks = split_layers(units_forward, config.sync_unit_params.unwrap_or(0));
        let overrides: Vec<Option<u64>> = chunks
            .iter()
            .map(|c| layer_overrides[c.layer_position])
            .collect();
        // The schedule and the buckets see the units by id (`index` = position).
        let units_forward: Vec<LayerInfo> = chunks
            .iter()
            .enumerate()
            .map(|(id, c)| LayerInfo {
                index: id,
                name: c.name.clone(),
                kind: units_forward[c.layer_position].kind,
                params: c.params,
            })
            .collect();
        let units_backward: Vec<LayerInfo> = units_forward.iter().rev().cloned().collect();

        if config.strategy.uses_outer_optimizer() {
            config.outer.validate()?;
        }
        let schedule_kind = match (config.strategy, config.schedule) {
            (Strategy::DreamDdp, ScheduleKind::Auto) if profile.is_some() => ScheduleKind::Profiled,
            (Strategy::DreamDdp, ScheduleKind::Auto) => ScheduleKind::Equal,
            (Strategy::DreamDdp, kind) => kind,
            _ => ScheduleKind::Equal,
        };
        let schedule = if config.strategy.is_partial() {
            if h > units_forward.len() as u64 {
                return Err(PlanError::PeriodExceedsUnits {
                    period: h,
                    model: model.to_string(),
                    units: units_forward.len(),
                });
            }
            Some(match schedule_kind {
                ScheduleKind::Equal => match config.groups {
                    Some(g) if config.strategy == Strategy::DreamDdp => {
                        schedule::grouped_split(units_backward.len(), h, g)?
                    }
                    _ => schedule::equal_split(units_backward.len(), h)?,
                },
                ScheduleKind::Auto => unreachable!("resolved above"),
                ScheduleKind::Profiled => {
                    let profile = profile.ok_or(PlanError::MissingProfile)?;
                    check_profile(&layers_backward, profile)?;
                    schedule::profiled_with(
                        &unit_profiles(profile, &chunks),
                        h,
                        profile.forward_s,
                        &schedule::SearchOptions {
                            bubble_filling: config.bubble_filling,
                            ..schedule::SearchOptions::default()
                        },
                    )?
                }
            })
        } else {
            None
        };

        let delay = checked_delay(config)?;

        let mut units: Vec<UnitPlan> = units_forward
            .iter()
            .enumerate()
            .map(|(position, info)| {
                let period = overrides[position].unwrap_or(h);
                let phases = match config.strategy {
                    Strategy::Ssgd | Strategy::Wfbp => vec![0],
                    Strategy::LocalSgd | Strategy::Diloco => vec![period - 1],
                    Strategy::DreamDdp | Strategy::Plsgd | Strategy::StreamingDiloco => {
                        let s = schedule
                            .as_ref()
                            .expect("a partial strategy has a schedule");
                        let backward_position = units_forward.len() - 1 - position;
                        if period == h {
                            s.phases_of_unit[backward_position].clone()
                        } else {
                            vec![s.primary_phase(backward_position) % period]
                        }
                    }
                };
                let period = if config.strategy.syncs_parameters() {
                    period
                } else {
                    1
                };
                let chunk = &chunks[position];
                UnitPlan {
                    id: position,
                    index: chunk.layer,
                    name: info.name.clone(),
                    offset: chunk.offset,
                    params: info.params,
                    period,
                    phases,
                    bucket: 0,
                }
            })
            .collect();

        let max_index = units.iter().map(|u| u.index).max().unwrap_or(0);
        let mut units_of_layer = vec![0..0; max_index + 1];
        for u in &units {
            let range = &mut units_of_layer[u.index];
            if range.start == range.end {
                *range = u.id..u.id + 1;
            } else {
                range.end = u.id + 1;
            }
        }

        let buckets = {
            let key = |id: usize| (units[id].period, units[id].phases.as_slice());
            make_buckets(&units_backward, key, &config.bucket_caps)
        };
        for b in &buckets {
            for &id in &b.units {
                units[id].bucket = b.id;
            }
        }

        Ok(Self {
            model: model.to_string(),
            strategy: config.strategy,
            period: if config.strategy.syncs_parameters() {
                h
            } else {
                1
            },
            schedule_kind,
            units,
            units_of_layer,
            buckets,
            schedule,
            delay,
            search: None,
            outer: config.outer,
        })
    }

    /// Steps between an average's launch and its landing (see [`PlanConfig::delay`]): the
    /// configured delay for `dreamddp` and `streaming-diloco`, 1 for `plsgd`, 0 otherwise
    /// (the blocking strategies land within the step).
    pub fn delay(&self) -> u64 {
        self.delay
    }

    /// When this plan was chosen by [`crate::config_search::search`]: every candidate
    /// configuration with its modelled step time.
    pub fn search_candidates(&self) -> Option<&[Candidate]> {
        self.search.as_deref()
    }

    pub(crate) fn set_search(&mut self, candidates: Vec<Candidate>) {
        self.search = Some(candidates);
    }

    /// The outer optimizer's settings (used by `diloco` and `streaming-diloco`).
    pub fn outer(&self) -> &OuterConfig {
        &self.outer
    }

    /// How this plan's parameter averages land in a replica.
    pub fn landing(&self) -> Landing {
        match self.strategy {
            Strategy::Diloco => Landing::Outer { mix: 0.0 },
            Strategy::StreamingDiloco => Landing::Outer {
                mix: self.outer.mix,
            },
            Strategy::DreamDdp if self.delay > 1 => Landing::Rebase,
            _ => Landing::Replace,
        }
    }

    /// Whether layer `layer_index` (model index), or one of its chunks, is synchronized at
    /// global step `step` (gradients for `ssgd`/`wfbp`, parameters otherwise). False for
    /// layers without parameters or outside the model.
    pub fn is_due(&self, step: u64, layer_index: usize) -> bool {
        self.units_of_layer(layer_index)
            .iter()
            .any(|u| u.is_due(step))
    }

    /// Whether unit `id` ([`UnitPlan::id`]) is synchronized at global step `step`.
    pub fn unit_is_due(&self, step: u64, id: usize) -> bool {
        self.units.get(id).is_some_and(|u| u.is_due(step))
    }

    /// Model indices of the layers with a unit due at `step`, in **backward** order (the
    /// order their gradients become ready).
    pub fn due_layers(&self, step: u64) -> Vec<usize> {
        let mut layers: Vec<usize> = self
            .units
            .iter()
            .rev()
            .filter(|u| u.is_due(step))
            .map(|u| u.index)
            .collect();
        layers.dedup();
        layers
    }

    /// Ids of the units due at `step`, in backward order.
    pub fn due_units(&self, step: u64) -> Vec<usize> {
        self.units
            .iter()
            .rev()
            .filter(|u| u.is_due(step))
            .map(|u| u.id)
            .collect()
    }

    /// The strategy.
    pub fn strategy(&self) -> Strategy {
        self.strategy
    }

    /// The period H (1 for `ssgd`/`wfbp`). Units may have their own ([`UnitPlan::period`]).
    pub fn period(&self) -> u64 {
        self.period
    }

    /// The model name.
    pub fn model(&self) -> &str {
        &self.model
    }

    /// Buckets in backward order.
    pub fn buckets(&self) -> &[Bucket] {
        &self.buckets
    }

    /// Units in forward order.
    pub fn units(&self) -> &[UnitPlan] {
        &self.units
    }

    /// The plan of layer `layer_index`'s first unit (the whole layer unless it is chunked),
    /// if the layer has parameters.
    pub fn unit(&self, layer_index: usize) -> Option<&UnitPlan> {
        self.units_of_layer(layer_index).first()
    }

    /// The units of layer `layer_index` in forward order (one unless it is chunked; none for
    /// a layer without parameters).
    pub fn units_of_layer(&self, layer_index: usize) -> &[UnitPlan] {
        match self.units_of_layer.get(layer_index) {
            Some(range) => &self.units[range.clone()],
            None => &[],
        }
    }

    /// The DreamDDP schedule (units in backward order), for `dreamddp` only.
    pub fn schedule(&self) -> Option<&DreamSchedule> {
        self.schedule.as_ref()
    }

    /// A human-readable table: one row per unit (forward order) with its parameters, period,
    /// the phases (`step % period`) at which it is due, and its bucket.
    pub fn describe(&self) -> String {
        use std::fmt::Write as _;
        let mut out = String::new();
        let schedule = match self.strategy {
            Strategy::DreamDdp | Strategy::StreamingDiloco => {
                let groups = self.schedule.as_ref().map_or(0, |s| {
                    let mut phases: Vec<u64> = s.phases_of_unit.iter().flatten().copied().collect();
                    phases.sort_unstable();
                    phases.dedup();
                    phases.len()
                });
                format!(
                    ", schedule {} ({groups} phase groups), delay {}",
                    self.schedule_kind, self.delay
                )
            }
            Strategy::Plsgd => format!(", schedule {}", self.schedule_kind),
            _ => String::new(),
        };
        let _ = writeln!(
            out,
            "sync plan: model {}, strategy {}, period {}{}, {} sync units, {} buckets",
            self.model,
            self.strategy,
            self.period,
            schedule,
            self.units.len(),
            self.buckets.len()
        );
        let name_width = self
            .units
            .iter()
            .map(|u| u.name.len())
            .max()
            .unwrap_or(0)
            .max(5);
        let _ = writeln!(
            out,
            "{:<name_width$} {:>5} {:>10} {:>6}  {:<16} {:>6}",
            "layer", "index", "params", "period", "due (step%period)", "bucket"
        );
        for u in &self.units {
            let due = if u.period == 1 {
                "every step".to_string()
            } else {
                u.phases
                    .iter()
                    .map(u64::to_string)
                    .collect::<Vec<_>>()
                    .join(",")
            };
            let _ = writeln!(
                out,
                "{:<name_width$} {:>5} {:>10} {:>6}  {:<17} {:>6}",
                u.name, u.index, u.params, u.period, due, u.bucket
            );
        }
        if let Some(candidates) = &self.search {
            let _ = writeln!(
                out,
                "configuration search (modelled mean step time per schedule, phase groups, delay, exchanges per group, sync units):"
            );
            for c in candidates {
                let _ = writeln!(
                    out,
                    "  {:<8} {} groups  delay {}  {:<11}  {:<18} {:>9.3} ms{}",
                    c.schedule.name(),
                    c.groups,
                    c.delay,
                    if c.whole_groups {
                        "1 exchange"
                    } else {
                        "bucket caps"
                    },
                    c.units_label(),
                    c.step_s * 1e3,
                    if c.chosen { "  <- chosen" } else { "" }
                );
            }
        }
        out
    }
}

/// The delay of `config`'s strategy (see [`PlanConfig::delay`]), validated.
fn checked_delay(config: &PlanConfig) -> Result<u64, PlanError> {
    let h = config.period;
    let d = config.delay.unwrap_or(1);
    let bad = |why| {
        Err(PlanError::BadDelay {
            strategy: config.strategy,
            delay: d,
            period: h,
            why,
        })
    };
    match config.strategy {
        Strategy::DreamDdp if d == 0 => bad("at least 1 (1 lands before the layer's next step)"),
        Strategy::DreamDdp if d > 1 && d >= h => {
            bad("at most period - 1, so an average lands before the layer is due again")
        }
        Strategy::DreamDdp => Ok(d),
        Strategy::StreamingDiloco if d >= h => {
            bad("below the period, so a fragment lands before it is due again")
        }
        Strategy::StreamingDiloco => Ok(d),
        Strategy::Plsgd => Ok(1),
        _ => Ok(0),
    }
}

/// One sync unit before scheduling: a whole layer or one of its chunks.
struct Chunk {
    /// Position of its layer in the plan's `units_forward`.
    layer_position: usize,
    /// Model layer index.
    layer: usize,
    name: String,
    offset: usize,
    params: usize,
}

/// The sync units of `layers_forward` under a cap of `max` values per unit (0: whole layers),
/// in forward order ([`crate::sync_units`]).
fn split_layers(layers_forward: &[LayerInfo], max: usize) -> Vec<Chunk> {
    let mut out = Vec::with_capacity(layers_forward.len());
    for (layer_position, info) in layers_forward.iter().enumerate() {
        let lengths = crate::sync_units::chunk_lengths(info.params, 1, max);
        let count = lengths.len();
        let mut offset = 0;
        for (i, params) in lengths.into_iter().enumerate() {
            out.push(Chunk {
                layer_position,
                layer: info.index,
                name: crate::sync_units::chunk_name(&info.name, i, count),
                offset,
                params,
            });
            offset += params;
        }
    }
    out
}

/// The per-layer `profile` (backward order) as per-unit profiles of `chunks` (backward
/// order): a layer's chunks all become ready when its backward ends, so the first of them in
/// backward order carries the layer's backward time and the others none; communication is
/// shared in proportion to size.
fn unit_profiles(profile: &ModelProfile, chunks: &[Chunk]) -> Vec<LayerProfile> {
    let mut out = Vec::with_capacity(chunks.len());
    let mut previous_layer = None;
    for (id, chunk) in chunks.iter().enumerate().rev() {
        let layer = &profile.layers[profile.layers.len() - 1 - chunk.layer_position];
        let share = chunk.params as f64 / layer.params.max(1) as f64;
        out.push(LayerProfile {
            name: chunk.name.clone(),
            index: id,
            params: chunk.params,
            backward_s: if previous_layer == Some(chunk.layer_position) {
                0.0
            } else {
                layer.backward_s
            },
            comm_s: layer.comm_s * share,
        });
        previous_layer = Some(chunk.layer_position);
    }
    out
}

/// Per-unit override (forward order), validated.
fn resolve_overrides(
    units_forward: &[LayerInfo],
    config: &PlanConfig,
) -> Result<Vec<Option<u64>>, PlanError> {
    let mut resolved = vec![None; units_forward.len()];
    if config.period_overrides.is_empty() {
        return Ok(resolved);
    }
    if !config.strategy.syncs_parameters() {
        return Err(PlanError::OverridesNeedParameterSync {
            strategy: config.strategy,
        });
    }
    let mut seen = HashSet::new();
    for (name, period) in &config.period_overrides {
        let position = units_forward
            .iter()
            .position(|u| &u.name == name)
            .ok_or_else(|| PlanError::UnknownLayer {
                name: name.clone(),
                valid: units_forward
                    .iter()
                    .map(|u| u.name.as_str())
                    .collect::<Vec<_>>()
                    .join(", "),
            })?;
        if !seen.insert(name.as_str()) {
            return Err(PlanError::DuplicateOverride { name: name.clone() });
        }
        if *period == 0 {
            return Err(PlanError::ZeroLayerPeriod { name: name.clone() });
        }
        resolved[position] = Some(*period);
    }
    Ok(resolved)
}

fn check_profile(units_backward: &[LayerInfo], profile: &ModelProfile) -> Result<(), PlanError> {
    for (position, unit) in units_backward.iter().enumerate() {
        match profile.layers.get(position) {
            Some(p) if p.index == unit.index && p.name == unit.name => {}
            other => {
                return Err(PlanError::ProfileMismatch {
                    position,
                    expected: unit.name.clone(),
                    got: other.map_or_else(|| "<missing>".to_string(), |p| p.name.clone()),
                })
            }
        }
    }
    if let Some(extra) = profile.layers.get(units_backward.len()) {
        return Err(PlanError::ProfileMismatch {
            position: units_backward.len(),
            expected: "<none>".to_string(),
            got: extra.name.clone(),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::Strategy;
    use super::*;
    use crate::schedule::LayerProfile;
    use proptest::prelude::*;
    use serde::de::value::{Error as DeError, StrDeserializer};
    use serde::de::IntoDeserializer;

    /// An mlp-like model: fc1 (0), relu (1), fc2 (2), relu (3), fc3 (4), head (5).
    fn mlp() -> Vec<LayerInfo> {
        [
            ("fc1", 0, 1000),
            ("fc2", 2, 500),
            ("fc3", 4, 200),
            ("head", 5, 50),
        ]
        .into_iter()
        .map(|(name, index, params)| LayerInfo {
            index,
            name: name.to_string(),
            kind: "linear",
            params,
        })
        .collect()
    }

    fn config(strategy: Strategy, period: u64) -> PlanConfig {
        PlanConfig {
            schedule: ScheduleKind::Equal,
            ..PlanConfig::new(strategy, period)
        }
    }

    fn profile(units: &[LayerInfo], comm: f64) -> ModelProfile {
        ModelProfile {
            forward_s: 0.1,
            layers: units
                .iter()
                .rev()
                .map(|u| LayerProfile {
                    name: u.name.clone(),
                    index: u.index,
                    params: u.params,
                    backward_s: 1.0,
                    comm_s: comm,
                })
                .collect(),
        }
    }

    #[test]
    fn names_round_trip_and_unknown_names_list_the_valid_ones() {
        for s in Strategy::ALL {
            assert_eq!(s.to_string().parse::<Strategy>().unwrap(), s);
            let de: StrDeserializer<'_, DeError> = s.name().into_deserializer();
            assert_eq!(Strategy::deserialize(de).unwrap(), s);
        }
        for k in ScheduleKind::ALL {
            assert_eq!(k.to_string().parse::<ScheduleKind>().unwrap(), k);
            let de: StrDeserializer<'_, DeError> = k.name().into_deserializer();
            assert_eq!(ScheduleKind::deserialize(de).unwrap(), k);
        }
        assert_eq!("DreamDDP".parse::<Strategy>().unwrap(), Strategy::DreamDdp);
        let err = "fedprox".parse::<Strategy>().unwrap_err();
        assert_eq!(
            err.to_string(),
            "unknown strategy `fedprox`; valid: ssgd, wfbp, localsgd, dreamddp, plsgd, diloco, \
             streaming-diloco"
        );
        assert_eq!(
            "streaming-diloco".parse::<Strategy>().unwrap(),
            Strategy::StreamingDiloco
        );
        let err = "random".parse::<ScheduleKind>().unwrap_err();
        assert_eq!(
            err.to_string(),
            "unknown schedule `random`; valid: auto, profiled, equal"
        );
    }

    #[test]
    fn gradient_strategies_sync_every_layer_every_step() {
        for s in [Strategy::Ssgd, Strategy::Wfbp] {
            let plan = SyncPlan::new("mlp", &mlp(), &config(s, 4), None).unwrap();
            assert_eq!(plan.period(), 1);
            for step in 0..5 {
                assert_eq!(plan.due_layers(step), vec![5, 4, 2, 0]);
            }
            assert!(!plan.is_due(0, 1), "relu has no parameters");
            assert!(!plan.is_due(0, 99));
        }
    }

    #[test]
    fn localsgd_syncs_everything_at_the_end_of_each_period() {
        let plan = SyncPlan::new("mlp", &mlp(), &config(Strategy::LocalSgd, 3), None).unwrap();
        let due: Vec<usize> = (0..9)
            .filter(|&s| plan.is_due(s, 0))
            .map(|s| s as usize)
            .collect();
        assert_eq!(due, vec![2, 5, 8]);
        assert!(plan.due_layers(1).is_empty());
        assert_eq!(plan.due_layers(2), vec![5, 4, 2, 0]);
        // A period longer than the number of units is fine for local SGD.
        assert!(SyncPlan::new("mlp", &mlp(), &config(Strategy::LocalSgd, 50), None).is_ok());
    }

    #[test]
    fn dreamddp_equal_split_syncs_each_layer_once_per_period() {
        let plan = SyncPlan::new("mlp", &mlp(), &config(Strategy::DreamDdp, 2), None).unwrap();
        // Backward order head, fc3 | fc2, fc1.
        assert_eq!(plan.due_layers(0), vec![5, 4]);
        assert_eq!(plan.due_layers(1), vec![2, 0]);
        assert_eq!(plan.due_layers(2), vec![5, 4]);
        // Buckets follow the phases (all layers are tiny).
        let layers: Vec<Vec<usize>> = plan
            .buckets()
            .iter()
            .map(|b| b.units.iter().map(|&id| plan.units()[id].index).collect())
            .collect();
        assert_eq!(layers, vec![vec![5, 4], vec![2, 0]]);
        assert_eq!(plan.unit(0).unwrap().bucket, 1);
        let text = plan.describe();
        assert!(
            text.contains("strategy dreamddp, period 2, schedule equal"),
            "{text}"
        );
        assert!(
            text.lines()
                .any(|l| l.starts_with("head") && l.contains(" 0 ")),
            "{text}"
        );
    }

    #[test]
    fn dreamddp_period_one_is_every_step_averaging() {
        let plan = SyncPlan::new("mlp", &mlp(), &config(Strategy::DreamDdp, 1), None).unwrap();
        for step in 0..3 {
            assert_eq!(plan.due_layers(step), vec![5, 4, 2, 0]);
        }
    }

    #[test]
    fn dreamddp_profiled_uses_the_profile_and_checks_it() {
        let units = mlp();
        let cfg = PlanConfig::new(Strategy::DreamDdp, 2);
        assert_eq!(
            SyncPlan::new("mlp", &units, &cfg, None).unwrap_err(),
            PlanError::MissingProfile
        );
        let p = profile(&units, 0.3);
        let plan = SyncPlan::new("mlp", &units, &cfg, Some(&p)).unwrap();
        let s = plan.schedule().unwrap();
        for step in 0..2 {
            assert!(!plan.due_layers(step).is_empty());
        }
        for u in plan.units() {
            assert!(!u.phases.is_empty());
        }
        assert_eq!(s.phases_of_unit.len(), 4);
        let mut wrong = p.clone();
        wrong.layers.swap(0, 1);
        assert!(matches!(
            SyncPlan::new("mlp", &units, &cfg, Some(&wrong)),
            Err(PlanError::ProfileMismatch { position: 0, .. })
        ));
        let mut short = p.clone();
        short.layers.pop();
        assert!(matches!(
            SyncPlan::new("mlp", &units, &cfg, Some(&short)),
            Err(PlanError::ProfileMismatch { position: 3, .. })
        ));
    }

    #[test]
    fn a_capped_unit_size_splits_large_layers_into_scheduled_chunks() {
        let mut cfg = config(Strategy::DreamDdp, 4);
        cfg.sync_unit_params = Some(400);
        let plan = SyncPlan::new("mlp", &mlp(), &cfg, None).unwrap();
        let units: Vec<(&str, usize, usize, usize)> = plan
            .units()
            .iter()
            .map(|u| (u.name.as_str(), u.index, u.offset, u.params))
            .collect();
        assert_eq!(
            units,
            vec![
                ("fc1[0/3]", 0, 0, 334),
                ("fc1[1/3]", 0, 334, 333),
                ("fc1[2/3]", 0, 667, 333),
                ("fc2[0/2]", 2, 0, 250),
                ("fc2[1/2]", 2, 250, 250),
                ("fc3", 4, 0, 200),
                ("head", 5, 0, 50),
            ]
        );
        for (id, u) in plan.units().iter().enumerate() {
            assert_eq!(u.id, id);
        }
        assert_eq!(plan.units_of_layer(0).len(), 3);
        assert!(plan.units_of_layer(1).is_empty(), "relu has no parameters");
        // Every unit once per period; the chunks of fc1 at different steps, so the period's
        // bytes are spread over its steps.
        let phase_of = |id: usize| (0..4).find(|&s| plan.unit_is_due(s, id)).unwrap();
        for id in 0..plan.units().len() {
            assert_eq!((0..4).filter(|&s| plan.unit_is_due(s, id)).count(), 1);
        }
        assert_ne!(phase_of(0), phase_of(2));
        // A bucket holds unit ids; a layer is due when one of its chunks is.
        for b in plan.buckets() {
            for &id in &b.units {
                assert_eq!(plan.units()[id].bucket, b.id);
            }
        }
        for step in 0..4 {
            let due_layers: Vec<usize> = plan
                .due_units(step)
                .iter()
                .map(|&id| plan.units()[id].index)
                .collect();
            for layer in [0, 2, 4, 5] {
                assert_eq!(plan.is_due(step, layer), due_layers.contains(&layer));
            }
        }
        // With 7 units, a period of 6 is possible (4 whole layers would refuse it).
        cfg.period = 6;
        assert!(SyncPlan::new("mlp", &mlp(), &cfg, None).is_ok());
        cfg.sync_unit_params = Some(0);
        assert!(matches!(
            SyncPlan::new("mlp", &mlp(), &cfg, None),
            Err(PlanError::PeriodExceedsUnits { units: 4, .. })
        ));
        // The profiled schedule reads the per-layer profile through the chunks.
        let mut profiled = PlanConfig::new(Strategy::DreamDdp, 4);
        profiled.sync_unit_params = Some(400);
        let plan = SyncPlan::new("mlp", &mlp(), &profiled, Some(&profile(&mlp(), 0.3))).unwrap();
        assert_eq!(plan.schedule().unwrap().phases_of_unit.len(), 7);
    }

    #[test]
    fn overrides_set_their_own_periods() {
        let mut cfg = config(Strategy::DreamDdp, 2);
        cfg.period_overrides = parse_period_overrides("fc1=8, head=1").unwrap();
        let plan = SyncPlan::new("mlp", &mlp(), &cfg, None).unwrap();
        // head: every step. fc1: primary phase 1 of 8 → steps 1, 9, 17.
        assert!((0..10).all(|s| plan.is_due(s, 5)));
        let fc1: Vec<u64> = (0..20).filter(|&s| plan.is_due(s, 0)).collect();
        assert_eq!(fc1, vec![1, 9, 17]);
        assert_eq!(plan.unit(0).unwrap().period, 8);

        let mut local = config(Strategy::LocalSgd, 4);
        local.period_overrides = vec![("fc1".into(), 2)];
        let plan = SyncPlan::new("mlp", &mlp(), &local, None).unwrap();
        let fc1: Vec<u64> = (0..8).filter(|&s| plan.is_due(s, 0)).collect();
        assert_eq!(fc1, vec![1, 3, 5, 7]);
        // Different periods never share a bucket.
        assert_ne!(plan.unit(0).unwrap().bucket, plan.unit(2).unwrap().bucket);
    }

    #[test]
    fn bad_configs_are_typed_errors_that_explain() {
        let units = mlp();
        let err = SyncPlan::new("mlp", &units, &config(Strategy::DreamDdp, 8), None).unwrap_err();
        assert_eq!(
            err.to_string(),
            "period 8 needs at least 8 sync units; model mlp has 4 — lower --period, split large \
             layers into chunks (--sync-unit-kb), or use localsgd"
        );
        assert_eq!(
            SyncPlan::new("mlp", &units, &config(Strategy::LocalSgd, 0), None).unwrap_err(),
            PlanError::ZeroPeriod
        );
        assert!(matches!(
            SyncPlan::new("empty", &[], &config(Strategy::Ssgd, 1), None),
            Err(PlanError::NoUnits { .. })
        ));

        let mut cfg = config(Strategy::DreamDdp, 2);
        cfg.period_overrides = vec![("embed".into(), 4)];
        let err = SyncPlan::new("mlp", &units, &cfg, None).unwrap_err();
        assert_eq!(
            err.to_string(),
            "period override names unknown layer `embed`; layers with parameters: fc1, fc2, fc3, head"
        );
        cfg.period_overrides = vec![("head".into(), 0)];
        assert!(matches!(
            SyncPlan::new("mlp", &units, &cfg, None),
            Err(PlanError::ZeroLayerPeriod { .. })
        ));
        cfg.period_overrides = vec![("head".into(), 1), ("head".into(), 2)];
        assert!(matches!(
            SyncPlan::new("mlp", &units, &cfg, None),
            Err(PlanError::DuplicateOverride { .. })
        ));
        let mut ssgd = config(Strategy::Ssgd, 1);
        ssgd.period_overrides = vec![("head".into(), 1)];
        assert!(matches!(
            SyncPlan::new("mlp", &units, &ssgd, None),
            Err(PlanError::OverridesNeedParameterSync {
                strategy: Strategy::Ssgd
            })
        ));
        assert!(matches!(
            parse_period_overrides("head"),
            Err(PlanError::BadOverrideSyntax { .. })
        ));
        assert!(parse_period_overrides("head=x").is_err());
        assert!(parse_period_overrides("=3").is_err());
        assert_eq!(parse_period_overrides("").unwrap(), vec![]);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        /// DreamDDP: every unit is due at least once in every window of its period, and each
        /// phase of the global period syncs something.
        #[test]
        fn dreamddp_covers_every_unit_each_period(
            n in 1usize..12,
            h_frac in 0.0f64..1.0,
            comm in 0.0f64..3.0,
            start in 0u64..100,
            profiled in any::<bool>(),
        ) {
            let units: Vec<LayerInfo> = (0..n)
                .map(|i| LayerInfo { index: i, name: format!("l{i}"), kind: "linear", params: 10 })
                .collect();
            let h = 1 + ((n - 1) as f64 * h_frac) as u64;
            let mut cfg = PlanConfig::new(Strategy::DreamDdp, h);
            if !profiled {
                cfg.schedule = ScheduleKind::Equal;
            }
            let p = profile(&units, comm);
            let plan = SyncPlan::new("m", &units, &cfg, Some(&p)).unwrap();
            for u in &units {
                prop_assert!((start..start + h).any(|s| plan.is_due(s, u.index)));
            }
            for s in start..start + h {
                prop_assert!(!plan.due_layers(s).is_empty());
                let due = plan.due_layers(s);
                prop_assert!(due.windows(2).all(|w| w[0] > w[1]), "backward order");
            }
            if !profiled {
                // Equal split: exactly once per period.
                for u in &units {
                    prop_assert_eq!((start..start + h).filter(|&s| plan.is_due(s, u.index)).count(), 1);
                }
            }
        }
    }
}
