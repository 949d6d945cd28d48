//! The DreamDDP schedule: which of the H iterations of a period synchronizes each sync unit.
//!
//! Two schedules are built here:
//!
//! * [`equal_split`]: the naive baseline — the units, in backward order, cut into H contiguous
//!   groups of (almost) equal count; group k is synced at phase k.
//! * [`profiled`]: the DreamDDP depth-first search over per-layer timing profiles (rules below),
//!   followed by bubble filling.
//!
//! A schedule is a [`DreamSchedule`]: for each unit (indexed by its position in **backward**
//! order, output head first) the sorted set of phases `0..H` at which it is synced. Step `s` of
//! training is phase `s % H`.
//!
//! # Cost model of one period ([`DreamSchedule::simulate_period`])
//!
//! Times are seconds from the start of an iteration; `L` units in backward order `j = 0..L`.
//!
//! * Forward takes `forward_s`. Backward then computes the units one after the other, unit `j`
//!   taking `backward_s[j]`. Unit `j`'s gradient is ready at
//!   `r_j = forward_s + Σ_{i ≤ j} backward_s[i]`; backward ends at `B = r_{L−1}`.
//! * In iteration (phase) `k` the due units `D_k = { j : k ∈ phases_of_unit[j] }` use one FIFO
//!   link in ready order: `start_j = max(r_j, end of the previous due unit)`,
//!   `end_j = start_j + comm_s[j]`.
//! * The iteration ends when backward has ended and all its communication is done:
//!   `T_k = max(B, end of the last due unit)`. Its *exposed* communication is `T_k − B`.
//!   Nothing carries over into the next iteration (the optimizer step waits for the sync).
//! * [`PeriodCost::per_iteration_time`] is `[T_0, …, T_{H−1}]` and
//!   [`PeriodCost::exposed_comm`] is `Σ_k (T_k − B)`.
//!
//! Consequence used below: the last unit in backward order (the input layer) is ready at `B`,
//! so whichever iteration syncs it exposes at least its whole communication time.
//!
//! # The search ([`profiled`])
//!
//! Units are walked in backward order and assigned to iterations `0..H` whose index never
//! decreases (so every iteration gets a contiguous run of units, and the last iteration takes
//! the rest). State: current iteration `k`, the time its link becomes free, how many units it
//! has, and the exposed time of the iterations already closed. For unit `j`:
//!
//! * **at-least-one**: iteration `k` must get `j` if it is still empty; `j` must move to
//!   `k + 1` if keeping it in `k` would leave fewer remaining units than iterations after `k`;
//!   the last iteration takes every remaining unit.
//! * **optimal hiding**: if `j`'s communication, queued behind what iteration `k` already sends,
//!   ends by `B`, assign it to `k` (no branching).
//! * **delayed assignment**: otherwise branch on syncing now (`k`) or deferring to `k + 1`,
//!   trying first the one whose added exposed time is smaller (deferring opens a fresh link
//!   at `r_j`).
//!
//! Branches are pruned with a best-so-far bound on the total exposed time over the H
//! iterations; a valid lower bound of any completion is the exposed time so far plus the
//! input layer's communication time. The incumbent starts as the equal split, so the result
//! is never worse than [`equal_split`] under the cost model; a node budget
//! ([`SearchOptions::node_budget`]) bounds the search on very deep models (the best
//! assignment found so far is kept).
//!
//! With an unlimited budget the search is exact over contiguous assignments. The hiding rule
//! loses nothing because splitting an iteration's due set into several iterations never
//! increases the total exposed time: with FIFO in ready order an iteration ends at
//! `max(B, max_{j∈D} (r_j + Σ_{i∈D, i≥j} comm_s[i]))`, and the parts' maxima sum to at most
//! the whole set's. (The same fact makes any schedule at least as good as syncing every unit
//! at one step of the period, as local SGD does.)
//!
//! **Bubble filling**: then, for each iteration `k` and each unit not yet synced at `k` (in
//! backward order), an extra sync of that unit at `k` is added when it does not make `T_k`
//! longer than it was before filling — the link would otherwise idle there. Units may thus be
//! synced more than once per period.

use thiserror::Error;

use crate::model::LayerInfo;

/// Timing profile of one sync unit (one parameterized layer).
#[derive(Clone, Debug, PartialEq)]
pub struct LayerProfile {
    /// Layer name.
    pub name: String,
    /// Layer index in the model.
    pub index: usize,
    /// Number of f32 parameters.
    pub params: usize,
    /// Seconds the backward of this layer takes.
    pub backward_s: f64,
    /// Seconds one synchronization of this layer's parameters takes on the link.
    pub comm_s: f64,
}

/// A model's timing profile: forward time and the per-unit profiles in **backward** order
/// (output head first).
#[derive(Clone, Debug, PartialEq)]
pub struct ModelProfile {
    /// Seconds the forward pass takes.
    pub forward_s: f64,
    /// Per sync unit, in backward order.
    pub layers: Vec<LayerProfile>,
}

/// A linear estimate of unit profiles when nothing was measured: backward time proportional to
/// parameters, communication = latency + bytes / bandwidth. `units_backward` in backward order.
pub fn estimate_profiles(
    units_backward: &[LayerInfo],
    backward_s_per_param: f64,
    link_latency_s: f64,
    link_bytes_per_s: f64,
) -> Vec<LayerProfile> {
    units_backward
        .iter()
        .map(|u| LayerProfile {
            name: u.name.clone(),
            index: u.index,
            params: u.params,
            backward_s: u.params as f64 * backward_s_per_param,
            comm_s: link_latency_s + (u.params as f64 * 4.0) / link_bytes_per_s,
        })
        .collect()
}

/// Why a schedule could not be built or evaluated.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum ScheduleError {
    /// H = 0.
    #[error("period must be at least 1")]
    ZeroPeriod,
    /// No sync units at all.
    #[error("a schedule needs at least one sync unit")]
    NoUnits,
    /// H larger than the number of units: some iteration would sync nothing.
    #[error("period {period} needs at least {period} sync units; there are {units}")]
    PeriodExceedsUnits {
        /// The period asked for.
        period: u64,
        /// The number of sync units.
        units: usize,
    },
    /// A number of phase groups outside `1..=period`.
    #[error("{groups} phase groups do not fit period {period}: use 1 to {period}")]
    BadGroups {
        /// The groups asked for.
        groups: u64,
        /// The period.
        period: u64,
    },
    /// A profile time that is negative, NaN or infinite.
    #[error("profile of layer `{layer}`: {what} = {value} is not a finite, non-negative time")]
    BadTime {
        /// Layer name (or `forward`).
        layer: String,
        /// Which field.
        what: &'static str,
        /// The value given.
        value: f64,
    },
    /// Profiles and schedule disagree on the number of units.
    #[error("schedule has {schedule_units} units but {profile_units} profiles were given")]
    UnitCountMismatch {
        /// Units in the schedule.
        schedule_units: usize,
        /// Profiles given.
        profile_units: usize,
    },
}

/// Knobs of the profiled search.
#[derive(Clone, Debug, PartialEq)]
pub struct SearchOptions {
    /// Maximum number of search nodes visited before the best assignment so far is kept.
    pub node_budget: u64,
    /// Add extra syncs where the link would idle.
    pub bubble_filling: bool,
}

impl Default for SearchOptions {
    fn default() -> Self {
        Self {
            node_budget: 1 << 20,
            bubble_filling: true,
        }
    }
}

/// Cost of one period under the cost model in the module doc.
#[derive(Clone, Debug, PartialEq)]
pub struct PeriodCost {
    /// `T_k` for each iteration `k` of the period, seconds.
    pub per_iteration_time: Vec<f64>,
    /// Sum over the iterations of the communication time not hidden behind backward, seconds.
    pub exposed_comm: f64,
}

impl PeriodCost {
    /// Wall time of the whole period, seconds.
    pub fn total_time(&self) -> f64 {
        self.per_iteration_time.iter().sum()
    }
}

/// A DreamDDP schedule: the phases (iterations of the period) at which each unit syncs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DreamSchedule {
    /// The period H.
    pub period: u64,
    /// For each unit in **backward** order, the sorted, distinct phases in `0..period` at
    /// which it is synced.
    pub phases_of_unit: Vec<Vec<u64>>,
}

impl DreamSchedule {
    /// A schedule syncing every unit at the same phase `phase` (e.g. local SGD: every unit at
    /// phase H−1). Used as a baseline for the cost model; phases other than `phase` stay empty.
    ///
    /// # Panics
    /// When `phase >= period` (a caller bug).
    pub fn all_at_phase(unit_count: usize, period: u64, phase: u64) -> Self {
        assert!(phase < period, "phase {phase} outside period {period}");
        Self {
            period,
            phases_of_unit: vec![vec![phase]; unit_count],
        }
    }

    /// Whether unit `unit` (backward position) is synced at phase `phase`.
    pub fn syncs_at(&self, unit: usize, phase: u64) -> bool {
        self.phases_of_unit[unit].binary_search(&phase).is_ok()
    }

    /// The first phase at which unit `unit` is synced (its scheduled phase before bubble
    /// filling added extras, when it has any).
    pub fn primary_phase(&self, unit: usize) -> u64 {
        self.phases_of_unit[unit][0]
    }

    /// Cost of one period of this schedule under the cost model in the module doc.
    /// `profiles` in backward order, one per unit.
    pub fn simulate_period(
        &self,
        profiles: &[LayerProfile],
        forward_s: f64,
    ) -> Result<PeriodCost, ScheduleError> {
        if profiles.len() != self.phases_of_unit.len() {
            return Err(ScheduleError::UnitCountMismatch {
                schedule_units: self.phases_of_unit.len(),
                profile_units: profiles.len(),
            });
        }
        validate_profiles(profiles, forward_s)?;
        let timeline = Timeline::new(profiles, forward_s);
        let mut per_iteration_time = Vec::with_capacity(self.period as usize);
        let mut exposed_comm = 0.0;
        for phase in 0..self.period {
            let end = timeline.iteration_end(|j| self.syncs_at(j, phase));
            exposed_comm += end - timeline.backward_end;
            per_iteration_time.push(end);
        }
        Ok(PeriodCost {
            per_iteration_time,
            exposed_comm,
        })
    }
}

/// Ready times and communication times of the units, in backward order.
struct Timeline {
    ready: Vec<f64>,
    comm: Vec<f64>,
    backward_end: f64,
}

impl Timeline {
    fn new(profiles: &[LayerProfile], forward_s: f64) -> Self {
        let mut t = forward_s;
        let ready = profiles
            .iter()
            .map(|p| {
                t += p.backward_s;
                t
            })
            .collect();
        Self {
            ready,
            comm: profiles.iter().map(|p| p.comm_s).collect(),
            backward_end: t,
        }
    }

    /// `T_k` of an iteration whose due units are those for which `due(j)` holds.
    fn iteration_end(&self, due: impl Fn(usize) -> bool) -> f64 {
        let mut link_free = 0.0f64;
        for j in 0..self.ready.len() {
            if due(j) {
                link_free = link_free.max(self.ready[j]) + self.comm[j];
            }
        }
        link_free.max(self.backward_end)
    }
}

fn check_time(layer: &str, what: &'static str, value: f64) -> Result<(), ScheduleError> {
    if value.is_finite() && value >= 0.0 {
        Ok(())
    } else {
        Err(ScheduleError::BadTime {
            layer: layer.to_string(),
            what,
            value,
        })
    }
}

fn validate_profiles(profiles: &[LayerProfile], forward_s: f64) -> Result<(), ScheduleError> {
    check_time("forward", "forward_s", forward_s)?;
    for p in profiles {
        check_time(&p.name, "backward_s", p.backward_s)?;
        check_time(&p.name, "comm_s", p.comm_s)?;
    }
    Ok(())
}

fn check_period(unit_count: usize, period: u64) -> Result<(), ScheduleError> {
    if period == 0 {
        return Err(ScheduleError::ZeroPeriod);
    }
    if unit_count == 0 {
        return Err(ScheduleError::NoUnits);
    }
    if period > unit_count as u64 {
        return Err(ScheduleError::PeriodExceedsUnits {
            period,
            units: unit_count,
        });
    }
    Ok(())
}

/// The naive baseline: units in backward order cut into `period` contiguous groups whose sizes
/// differ by at most one; unit at backward position `j` syncs at phase `⌊j·H / L⌋`.
/// Every phase gets at least one unit.
pub fn equal_split(unit_count: usize, period: u64) -> Result<DreamSchedule, ScheduleError> {
    check_period(unit_count, period)?;
    let phases_of_unit = (0..unit_count as u64)
        .map(|j| vec![j * period / unit_count as u64])
        .collect();
    Ok(DreamSchedule {
        period,
        phases_of_unit,
    })
}

/// The units, in backward order, cut into `groups` contiguous groups of (almost) equal count,
/// group `g` synced at phase `⌊g·H / groups⌋` (`groups = H` is [`equal_split`]; `groups = 1`
/// syncs every unit at phase 0, as local SGD does, but launched in backward).
pub fn grouped_split(
    unit_count: usize,
    period: u64,
    groups: u64,
) -> Result<DreamSchedule, ScheduleError> {
    if groups == 0 || groups > period {
        return Err(ScheduleError::BadGroups { groups, period });
    }
    check_period(unit_count, groups)?;
    let phases_of_unit = (0..unit_count as u64)
        .map(|j| {
            let g = j * groups / unit_count as u64;
            vec![g * period / groups]
        })
        .collect();
    Ok(DreamSchedule {
        period,
        phases_of_unit,
    })
}

/// The DreamDDP schedule from per-unit profiles (backward order) with default
/// [`SearchOptions`]: the depth-first search and bubble filling described in the module doc.
pub fn profiled(
    profiles: &[LayerProfile],
    period: u64,
    forward_s: f64,
) -> Result<DreamSchedule, ScheduleError> {
    profiled_with(profiles, period, forward_s, &SearchOptions::default())
}

/// [`profiled`] with explicit search options.
pub fn profiled_with(
    profiles: &[LayerProfile],
    period: u64,
    forward_s: f64,
    options: &SearchOptions,
) -> Result<DreamSchedule, ScheduleError> {
    check_period(profiles.len(), period)?;
    validate_profiles(profiles, forward_s)?;
    let timeline = Timeline::new(profiles, forward_s);

    let incumbent = equal_split(profiles.len(), period)?;
    let incumbent_cost = incumbent.simulate_period(profiles, forward_s)?.exposed_comm;
    let mut search = Search {
        timeline: &timeline,
        period,
        best_cost: incumbent_cost,
        best_phase: incumbent.phases_of_unit.iter().map(|p| p[0]).collect(),
        phase: vec![0; profiles.len()],
        nodes: 0,
        node_budget: options.node_budget,
    };
    search.visit(0, 0, 0.0, 0, 0.0);

    let mut schedule = DreamSchedule {
        period,
        phases_of_unit: search.best_phase.iter().map(|&k| vec![k]).collect(),
    };
    // Guard against drift between the search's incremental bookkeeping and the cost model.
    if schedule.simulate_period(profiles, forward_s)?.exposed_comm > incumbent_cost {
        schedule = incumbent;
    }
    if options.bubble_filling {
        fill_bubbles(&mut schedule, &timeline);
    }
    Ok(schedule)
}

/// Absolute slack on time comparisons, so rounding never flips a decision.
fn time_eps(timeline: &Timeline) -> f64 {
    1e-12 * timeline.backward_end.max(1.0)
}

/// Depth-first search state (see the module doc).
struct Search<'a> {
    timeline: &'a Timeline,
    period: u64,
    best_cost: f64,
    best_phase: Vec<u64>,
    /// Phase of each unit on the current path (valid for units `< j`).
    phase: Vec<u64>,
    nodes: u64,
    node_budget: u64,
}

impl Search<'_> {
    /// Assign unit `j` given: current iteration `k`, when its link is free, how many units it
    /// has, and the exposed time of iterations `< k`.
    fn visit(&mut self, j: usize, k: u64, link_free: f64, count_k: usize, closed_exposed: f64) {
        let tl = self.timeline;
        let units = tl.ready.len();
        let b = tl.backward_end;
        let eps = time_eps(tl);
        let exposed_k = (link_free - b).max(0.0);
        if j == units {
            debug_assert!(k == self.period - 1 && count_k >= 1);
            let total = closed_exposed + exposed_k;
            if total < self.best_cost - eps {
                self.best_cost = total;
                self.best_phase.copy_from_slice(&self.phase);
            }
            return;
        }
        self.nodes += 1;
        if self.nodes > self.node_budget {
            return;
        }
        // Whatever iteration gets the input layer (ready at B) exposes all of its comm.
        let lower_bound = closed_exposed + exposed_k + tl.comm[units - 1];
        if lower_bound >= self.best_cost - eps {
            return;
        }
        let remaining = units - j;
        let iterations_after = (self.period - 1 - k) as usize;
        let stay_ok = count_k == 0 || remaining > iterations_after;
        let defer_ok = count_k >= 1 && k + 1 < self.period;
        let ready = tl.ready[j];
        let comm = tl.comm[j];
        let stay_end = link_free.max(ready) + comm;

        let stay = |s: &mut Self| {
            s.phase[j] = k;
            s.visit(j + 1, k, stay_end, count_k + 1, closed_exposed);
        };
        let defer = |s: &mut Self| {
            s.phase[j] = k + 1;
            s.visit(j + 1, k + 1, ready + comm, 1, closed_exposed + exposed_k);
        };

        if !defer_ok {
            debug_assert!(stay_ok);
            stay(self);
        } else if !stay_ok {
            defer(self);
        } else if stay_end <= b + eps {
            // Optimal hiding.
            stay(self);
        } else {
            // Delayed assignment: cheaper added exposure first.
            let added_now = (stay_end - b).max(0.0) - exposed_k;
            let added_deferred = (ready + comm - b).max(0.0);
            if added_deferred < added_now {
                defer(self);
                stay(self);
            } else {
                stay(self);
                defer(self);
            }
        }
    }
}

/// Adds extra syncs where they do not lengthen an iteration (see the module doc).
fn fill_bubbles(schedule: &mut DreamSchedule, timeline: &Timeline) {
    let eps = time_eps(timeline);
    let units = schedule.phases_of_unit.len();
    let mut due = vec![false; units];
    for phase in 0..schedule.period {
        for (j, d) in due.iter_mut().enumerate() {
            *d = schedule.syncs_at(j, phase);
        }
        let base_end = timeline.iteration_end(|j| due[j]);
        for candidate in 0..units {
            if due[candidate] {
                continue;
            }
            due[candidate] = true;
            if timeline.iteration_end(|j| due[j]) <= base_end + eps {
                let phases = &mut schedule.phases_of_unit[candidate];
                let at = phases.binary_search(&phase).unwrap_err();
                phases.insert(at, phase);
            } else {
                due[candidate] = false;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn profiles(backward: &[f64], comm: &[f64]) -> Vec<LayerProfile> {
        backward
            .iter()
            .zip(comm)
            .enumerate()
            .map(|(j, (&b, &c))| LayerProfile {
                name: format!("l{j}"),
                index: backward.len() - 1 - j,
                params: 100,
                backward_s: b,
                comm_s: c,
            })
            .collect()
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-9
    }

    #[test]
    fn equal_split_is_contiguous_and_covers_every_phase() {
        let s = equal_split(7, 3).unwrap();
        let flat: Vec<u64> = s.phases_of_unit.iter().map(|p| p[0]).collect();
        assert_eq!(flat, vec![0, 0, 0, 1, 1, 2, 2]);
        assert_eq!(
            equal_split(3, 3).unwrap().phases_of_unit,
            vec![vec![0], vec![1], vec![2]]
        );
        assert_eq!(
            equal_split(2, 1).unwrap().phases_of_unit,
            vec![vec![0], vec![0]]
        );
    }

    #[test]
    fn bad_periods_and_times_are_errors() {
        assert_eq!(equal_split(3, 0), Err(ScheduleError::ZeroPeriod));
        assert_eq!(equal_split(0, 1), Err(ScheduleError::NoUnits));
        assert_eq!(
            equal_split(3, 4),
            Err(ScheduleError::PeriodExceedsUnits {
                period: 4,
                units: 3
            })
        );
        let p = profiles(&[1.0, f64::NAN], &[1.0, 1.0]);
        assert!(matches!(
            profiled(&p, 1, 0.0),
            Err(ScheduleError::BadTime {
                what: "backward_s",
                ..
            })
        ));
        let p = profiles(&[1.0, 1.0], &[1.0, -1.0]);
        assert!(matches!(
            profiled(&p, 1, 0.0),
            Err(ScheduleError::BadTime { what: "comm_s", .. })
        ));
        let p = profiles(&[1.0], &[1.0]);
        assert!(matches!(
            profiled(&p, 1, f64::INFINITY),
            Err(ScheduleError::BadTime { .. })
        ));
        assert!(matches!(
            equal_split(2, 1).unwrap().simulate_period(&p, 0.0),
            Err(ScheduleError::UnitCountMismatch {
                schedule_units: 2,
                profile_units: 1
            })
        ));
    }

    #[test]
    fn simulate_period_by_hand() {
        // Ready times 1.5, 2.5, 3.5 (forward 0.5); B = 3.5.
        let p = profiles(&[1.0, 1.0, 1.0], &[1.5, 0.8, 1.0]);
        let s = DreamSchedule {
            period: 2,
            phases_of_unit: vec![vec![0], vec![0, 1], vec![1]],
        };
        let cost = s.simulate_period(&p, 0.5).unwrap();
        // Phase 0: unit 0 1.5..3.0, unit 1 3.0..3.8 → T = 3.8.
        // Phase 1: unit 1 2.5..3.3, unit 2 3.5..4.5 → T = 4.5.
        assert!(close(cost.per_iteration_time[0], 3.8), "{cost:?}");
        assert!(close(cost.per_iteration_time[1], 4.5), "{cost:?}");
        assert!(close(cost.exposed_comm, 0.3 + 1.0), "{cost:?}");
        assert!(close(cost.total_time(), 8.3));
    }

    #[test]
    fn dfs_finds_the_hand_checked_optimum() {
        // Ready 1, 2, 3; B = 3; comm 1.5, 0.8, 1.0; H = 2. Contiguous choices:
        //   {0}|{1,2}: phase 0 ends 2.5 (0 exposed); phase 1: 1 ends 2.8, 2 ends 4 → 1.0.
        //   {0,1}|{2}: phase 0: 1 ends 3.3 → 0.3; phase 1 → 1.0. Total 1.3 (= equal split).
        // The DFS defers unit 1 (delayed assignment) and beats the equal split.
        let p = profiles(&[1.0, 1.0, 1.0], &[1.5, 0.8, 1.0]);
        let s = profiled(&p, 2, 0.0).unwrap();
        assert_eq!(s.phases_of_unit, vec![vec![0], vec![1], vec![1]]);
        let dfs = s.simulate_period(&p, 0.0).unwrap().exposed_comm;
        let equal = equal_split(3, 2)
            .unwrap()
            .simulate_period(&p, 0.0)
            .unwrap()
            .exposed_comm;
        assert!(
            close(dfs, 1.0) && close(equal, 1.3),
            "dfs {dfs} equal {equal}"
        );
    }

    #[test]
    fn optimal_hiding_then_bubble_filling_by_hand() {
        // Cheap comm: units 0 and 1 hide in phase 0; at-least-one forces unit 2 to phase 1.
        // Bubble filling: phase 0 cannot take unit 2 (it would end at 3.2 > 3); phase 1's
        // link idles before unit 2 is ready, so units 0 and 1 sync there again.
        let p = profiles(&[1.0, 1.0, 1.0], &[0.2, 0.2, 0.2]);
        let base = profiled_with(
            &p,
            2,
            0.0,
            &SearchOptions {
                bubble_filling: false,
                ..SearchOptions::default()
            },
        )
        .unwrap();
        assert_eq!(base.phases_of_unit, vec![vec![0], vec![0], vec![1]]);
        let filled = profiled(&p, 2, 0.0).unwrap();
        assert_eq!(filled.phases_of_unit, vec![vec![0, 1], vec![0, 1], vec![1]]);
        let a = base.simulate_period(&p, 0.0).unwrap();
        let b = filled.simulate_period(&p, 0.0).unwrap();
        assert_eq!(a, b);
        assert!(close(b.exposed_comm, 0.2));
    }

    #[test]
    fn period_one_syncs_everything_every_step() {
        let p = profiles(&[1.0, 2.0, 0.5], &[3.0, 0.1, 0.2]);
        let s = profiled(&p, 1, 0.1).unwrap();
        assert_eq!(s.phases_of_unit, vec![vec![0]; 3]);
    }

    #[test]
    fn node_budget_still_returns_a_valid_schedule() {
        let p = profiles(&[0.1; 12], &[5.0; 12]);
        let opts = SearchOptions {
            node_budget: 3,
            bubble_filling: true,
        };
        let s = profiled_with(&p, 4, 0.0, &opts).unwrap();
        for phase in 0..4 {
            assert!((0..12).any(|j| s.syncs_at(j, phase)));
        }
    }

    #[test]
    fn estimate_profiles_is_linear() {
        let units = vec![LayerInfo {
            index: 3,
            name: "head".into(),
            kind: "linear",
            params: 250,
        }];
        let p = estimate_profiles(&units, 1e-6, 1e-3, 1e6);
        assert!(close(p[0].backward_s, 250e-6));
        assert!(close(p[0].comm_s, 1e-3 + 1000.0 / 1e6));
        assert_eq!((p[0].index, p[0].name.as_str()), (3, "head"));
    }

    /// The least exposed time over every contiguous split of the units into `h` non-empty
    /// groups, by enumeration of the cut positions.
    fn best_contiguous(p: &[LayerProfile], h: u64, fwd: f64) -> f64 {
        let n = p.len();
        let mut best = f64::INFINITY;
        for cuts in 0u32..(1 << (n - 1)) {
            if u64::from(cuts.count_ones()) != h - 1 {
                continue;
            }
            let mut phase = 0;
            let mut phases_of_unit = Vec::with_capacity(n);
            for j in 0..n {
                phases_of_unit.push(vec![phase]);
                if cuts & (1 << j) != 0 {
                    phase += 1;
                }
            }
            let s = DreamSchedule {
                period: h,
                phases_of_unit,
            };
            best = best.min(s.simulate_period(p, fwd).unwrap().exposed_comm);
        }
        best
    }

    fn arb_case() -> impl Strategy<Value = (Vec<LayerProfile>, u64, f64)> {
        (1usize..10)
            .prop_flat_map(|n| {
                (
                    prop::collection::vec(0.0f64..1.0, n),
                    prop::collection::vec(0.0f64..2.0, n),
                    1..=n as u64,
                    0.0f64..1.0,
                )
            })
            .prop_map(|(b, c, h, f)| (profiles(&b, &c), h, f))
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(300))]

        #[test]
        fn dfs_is_never_worse_than_the_baselines((p, h, fwd) in arb_case()) {
            let s = profiled(&p, h, fwd).unwrap();
            let dfs = s.simulate_period(&p, fwd).unwrap();
            let equal = equal_split(p.len(), h).unwrap().simulate_period(&p, fwd).unwrap();
            let local = DreamSchedule::all_at_phase(p.len(), h, h - 1)
                .simulate_period(&p, fwd)
                .unwrap();
            prop_assert!(dfs.exposed_comm <= equal.exposed_comm + 1e-9,
                "dfs {} equal {}", dfs.exposed_comm, equal.exposed_comm);
            prop_assert!(dfs.exposed_comm <= local.exposed_comm + 1e-9,
                "dfs {} localsgd {}", dfs.exposed_comm, local.exposed_comm);
            // Local SGD blocks: its real cost is the whole communication, never less.
            let blocking: f64 = p.iter().map(|l| l.comm_s).sum();
            prop_assert!(dfs.exposed_comm <= blocking + 1e-9);
        }

        /// With no node budget the search is exact over contiguous assignments (see the
        /// module doc for why the hiding rule loses nothing).
        #[test]
        fn unbounded_dfs_finds_the_best_contiguous_split((p, h, fwd) in arb_case()) {
            let opts = SearchOptions { node_budget: u64::MAX, bubble_filling: false };
            let s = profiled_with(&p, h, fwd, &opts).unwrap();
            let dfs = s.simulate_period(&p, fwd).unwrap().exposed_comm;
            let best = best_contiguous(&p, h, fwd);
            prop_assert!(dfs <= best + 1e-9, "dfs {} best {}", dfs, best);
        }

        #[test]
        fn every_unit_and_every_phase_is_covered((p, h, fwd) in arb_case()) {
            let s = profiled(&p, h, fwd).unwrap();
            prop_assert_eq!(s.period, h);
            prop_assert_eq!(s.phases_of_unit.len(), p.len());
            for phases in &s.phases_of_unit {
                prop_assert!(!phases.is_empty());
                prop_assert!(phases.windows(2).all(|w| w[0] < w[1]));
                prop_assert!(phases.iter().all(|&k| k < h));
            }
            for phase in 0..h {
                prop_assert!((0..p.len()).any(|j| s.syncs_at(j, phase)), "phase {} empty", phase);
            }
        }

        #[test]
        fn bubble_filling_never_lengthens_an_iteration((p, h, fwd) in arb_case()) {
            let opts = SearchOptions { bubble_filling: false, ..SearchOptions::default() };
            let base = profiled_with(&p, h, fwd, &opts).unwrap();
            let filled = profiled(&p, h, fwd).unwrap();
            let a = base.simulate_period(&p, fwd).unwrap();
            let b = filled.simulate_period(&p, fwd).unwrap();
            for (x, y) in a.per_iteration_time.iter().zip(&b.per_iteration_time) {
                prop_assert!(y <= &(x + 1e-9));
            }
            // The base search gives each unit exactly one phase, never fewer syncs than that.
            prop_assert!(base.phases_of_unit.iter().all(|p| p.len() == 1));
            for (x, y) in base.phases_of_unit.iter().zip(&filled.phases_of_unit) {
                prop_assert!(y.contains(&x[0]));
            }
        }
    }
}
