//! The best DreamDDP configuration for a model, a machine and a link: which phase groups
//! (schedule) and which delay, chosen with a cost model that carries communication across
//! steps.
//!
//! The schedule's own cost model ([`crate::schedule`]) ends every iteration's communication
//! inside the iteration and charges every unit its own exchange, as the paper does. Two things
//! it cannot see decide the regimes the paper does not cover: an exchange longer than a step
//! (it can land `d` steps later, [`crate::outer::Landing::Rebase`]), and a per-message latency
//! that dominates small layers (fewer, larger exchanges — fewer phase groups — pay it fewer
//! times). The model here follows the sync machine and the plan's buckets exactly, over
//! [`MODELLED_PERIODS`] periods:
//!
//! * step `n` starts when step `n − 1` ended; forward takes `forward_s`, then the units'
//!   backward in backward order;
//! * at the hook of a bucket's first unit the bucket's average launched `d` steps ago (or
//!   earlier, if the bucket is due again sooner) is waited for: the compute stream stalls
//!   until it has landed;
//! * at the hook of a due bucket's last unit its exchange is queued on one FIFO link
//!   (`start = max(hook time, link free)`, `end = start + comm(bucket)`; collectives on one
//!   communicator run one after the other), `comm` given by the caller for the bucket's
//!   parameters (latency included, once per exchange);
//! * the step ends after the last unit's hook.
//!
//! The mean step time is taken between the end of the first period and the end of the last,
//! each at the later of the compute stream and the link (its backlog counts).
//!
//! [`search`] evaluates the profiled DFS and the equal splits into `H, H − 1, …, 1` phase
//! groups, each with every delay `1..=max(1, H − 1)` (or the configured ones) and with the
//! configured bucket caps or one exchange per phase group, and keeps the
//! candidate with the shortest modelled step; among candidates within [`TIE_TOLERANCE`] of
//! it, the one with the smallest delay, then the most phase groups (the least stale and the
//! closest to the paper) wins.

use serde::{Deserialize, Serialize};

use crate::bucket::BucketCaps;
use crate::model::LayerInfo;
use crate::plan::{PlanConfig, PlanError, ScheduleKind, Strategy, SyncPlan};
use crate::schedule::ModelProfile;

/// Periods simulated per candidate (the first is a warm-up and not averaged).
pub const MODELLED_PERIODS: u64 = 6;
/// A candidate is as good as the best when its modelled step time is within this fraction.
pub const TIE_TOLERANCE: f64 = 0.02;

/// One configuration the search evaluated.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Candidate {
    /// `profiled`, or `equal` with its phase groups.
    pub schedule: ScheduleKind,
    /// Phase groups per period.
    pub groups: u64,
    /// Steps from an average's launch to its landing.
    pub delay: u64,
    /// Whether each phase group is one exchange (`true`) or split at PyTorch DDP's bucket
    /// caps (`false`, the configured caps).
    #[serde(default)]
    pub whole_groups: bool,
    /// The largest sync unit in f32 values (a larger layer is split into chunks); 0: whole
    /// layers.
    #[serde(default)]
    pub unit_params: usize,
    /// Modelled mean step seconds.
    pub step_s: f64,
    /// Whether the search chose it.
    pub chosen: bool,
}

impl Candidate {
    /// `whole layers`, or `sync units <= K KiB`.
    pub fn units_label(&self) -> String {
        if self.unit_params == 0 {
            "whole layers".to_string()
        } else {
            format!(
                "sync units <= {} KiB",
                crate::sync_units::kib_of_values(self.unit_params)
            )
        }
    }
}

/// Mean step time of `plan` (see the module doc). `profile` is in backward order; `comm`
/// gives the seconds one exchange of that many f32 parameters takes.
pub fn modelled_step_time(
    plan: &SyncPlan,
    profile: &ModelProfile,
    comm: &dyn Fn(usize) -> f64,
) -> f64 {
    let h = plan.period().max(1);
    let delay = plan.delay();
    let steps = h * MODELLED_PERIODS;
    let buckets = plan.buckets();
    // Per unit: the bucket it opens (first in backward order) and the one it closes.
    let mut opens = vec![None; plan.units().len()];
    let mut closes = vec![None; plan.units().len()];
    for (b, bucket) in buckets.iter().enumerate() {
        if let (Some(&first), Some(&last)) = (bucket.units.first(), bucket.units.last()) {
            opens[first] = Some(b);
            closes[last] = Some(b);
        }
    }
    let comm_s: Vec<f64> = buckets.iter().map(|b| comm(b.params)).collect();
    let mut pending: Vec<Option<(u64, f64)>> = vec![None; buckets.len()];
    let mut link_free = 0.0f64;
    let mut t = 0.0f64;
    let mut warm_end = 0.0f64;
    for n in 0..steps {
        if n == h {
            warm_end = t.max(link_free);
        }
        let mut c = t + profile.forward_s;
        for layer in &profile.layers {
            c += layer.backward_s;
            // A layer's units (its chunks) are all ready when its backward ends.
            for unit in plan.units_of_layer(layer.index).iter().rev() {
                let due = unit.is_due(n);
                if let Some(b) = opens[unit.id] {
                    if let Some((launched, end)) = pending[b] {
                        if n >= launched + delay || due {
                            c = c.max(end);
                            pending[b] = None;
                        }
                    }
                }
                if let Some(b) = closes[unit.id] {
                    if due {
                        let start = c.max(link_free);
                        link_free = start + comm_s[b];
                        pending[b] = Some((n, link_free));
                    }
                }
            }
        }
        t = c;
    }
    (t.max(link_free) - warm_end) / (steps - h) as f64
}

/// Builds every candidate plan of `config` (a `dreamddp` config whose schedule is `auto` and
/// whose delay may be `None`), models each, and returns the chosen plan with every candidate
/// recorded in it ([`SyncPlan::search_candidates`]). Other strategies and fixed
/// configurations are built as they are.
pub fn search(
    model: &str,
    units_forward: &[LayerInfo],
    config: &PlanConfig,
    profile: &ModelProfile,
    comm: &dyn Fn(usize) -> f64,
) -> Result<SyncPlan, PlanError> {
    let h = config.period;
    let searching = config.strategy == Strategy::DreamDdp
        && (config.schedule == ScheduleKind::Auto || config.delay.is_none());
    if !searching {
        return SyncPlan::new(model, units_forward, config, Some(profile));
    }
    let schedules = |unit_count: usize| -> Vec<(ScheduleKind, Option<u64>)> {
        match config.schedule {
            ScheduleKind::Auto => std::iter::once((ScheduleKind::Profiled, None))
                .chain(
                    (1..=h.min(unit_count as u64))
                        .rev()
                        .map(|g| (ScheduleKind::Equal, Some(g))),
                )
                .collect(),
            kind => vec![(kind, config.groups)],
        }
    };
    let unit_caps = match config.sync_unit_params {
        Some(cap) => vec![cap],
        None => chunk_caps(units_forward, h),
    };
    let delays: Vec<u64> = match config.delay {
        Some(d) => vec![d],
        None => (1..=h.saturating_sub(1).max(1)).collect(),
    };
    // One exchange per phase group pays the per-message latency once; the configured caps
    // let the first buckets of a group leave earlier in backward.
    let whole = BucketCaps {
        first_cap_bytes: usize::MAX,
        cap_bytes: usize::MAX,
        alone_over_bytes: usize::MAX,
    };
    // Every configuration, in preference order: smaller delay, whole layers, profiled, more
    // groups.
    let configurations = delays.iter().flat_map(|&delay| {
        unit_caps.iter().flat_map(move |&unit_params| {
            let unit_count = units_forward
                .iter()
                .map(|u| crate::sync_units::chunk_lengths(u.params, 1, unit_params).len())
                .sum();
            schedules(unit_count)
                .into_iter()
                .map(move |(schedule, groups)| (delay, unit_params, schedule, groups))
        })
    });
    let mut built: Vec<(SyncPlan, Candidate)> = Vec::new();
    let mut first_error = None;
    for (delay, unit_params, schedule, groups) in configurations {
        for whole_groups in [false, true] {
            let mut c = config.clone();
            c.schedule = schedule;
            c.groups = groups;
            c.delay = Some(delay);
            c.sync_unit_params = Some(unit_params);
            if whole_groups {
                c.bucket_caps = whole;
            }
            let plan = match SyncPlan::new(model, units_forward, &c, Some(profile)) {
                Ok(plan) => plan,
                Err(e) => {
                    first_error.get_or_insert(e);
                    continue;
                }
            };
            if whole_groups
                && plan.buckets().len() == built.last().map_or(0, |b| b.0.buckets().len())
            {
                // The caps split nothing: the same plan as the previous candidate.
                continue;
            }
            let step_s = modelled_step_time(&plan, profile, comm);
            let candidate = Candidate {
                schedule,
                groups: groups.unwrap_or(h),
                delay,
                whole_groups,
                unit_params,
                step_s,
                chosen: false,
            };
            built.push((plan, candidate));
        }
    }
    let best = built
        .iter()
        .map(|(_, c)| c.step_s)
        .fold(f64::INFINITY, f64::min);
    // `built` is in preference order (above).
    let Some(pick) = built
        .iter()
        .position(|(_, c)| c.step_s <= best * (1.0 + TIE_TOLERANCE))
    else {
        return Err(first_error.unwrap_or(PlanError::NoUnits {
            model: model.to_string(),
        }));
    };
    built[pick].1.chosen = true;
    let candidates: Vec<Candidate> = built.iter().map(|(_, c)| c.clone()).collect();
    let mut plan = built.swap_remove(pick).0;
    plan.set_search(candidates);
    Ok(plan)
}

/// The unit sizes the search tries: whole layers (0), then caps of the model's size over
/// `H`, `2H` and `4H` (so each step of the period can carry an equal share), each only if it
/// splits some layer.
fn chunk_caps(units_forward: &[LayerInfo], h: u64) -> Vec<usize> {
    let total: usize = units_forward.iter().map(|u| u.params).sum();
    let largest = units_forward.iter().map(|u| u.params).max().unwrap_or(0);
    let mut caps = vec![0];
    for k in [h, 2 * h, 4 * h] {
        let cap = total.div_ceil(k.max(1) as usize).max(1);
        if cap < largest && !caps.contains(&cap) {
            caps.push(cap);
        }
    }
    caps
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schedule::LayerProfile;

    fn units(params: &[usize]) -> Vec<LayerInfo> {
        params
            .iter()
            .enumerate()
            .map(|(i, &p)| LayerInfo {
                index: i,
                name: format!("l{i}"),
                kind: "linear",
                params: p,
            })
            .collect()
    }

    /// Backward order profile of `units` with the given per-unit backward seconds.
    fn profile(units: &[LayerInfo], backward_s: f64, forward_s: f64) -> ModelProfile {
        ModelProfile {
            forward_s,
            layers: units
                .iter()
                .rev()
                .map(|u| LayerProfile {
                    name: u.name.clone(),
                    index: u.index,
                    params: u.params,
                    backward_s,
                    comm_s: 0.0,
                })
                .collect(),
        }
    }

    /// One exchange per bucket; buckets of one layer each (no packing).
    fn config(period: u64) -> PlanConfig {
        let mut c = PlanConfig::new(Strategy::DreamDdp, period);
        c.schedule = ScheduleKind::Auto;
        c.bucket_caps = crate::bucket::BucketCaps {
            first_cap_bytes: 1,
            cap_bytes: 1,
            alone_over_bytes: usize::MAX,
        };
        c
    }

    #[test]
    fn cheap_communication_keeps_the_paper_configuration() {
        let u = units(&[100; 4]);
        let p = profile(&u, 1.0, 1.0);
        let plan = search("m", &u, &config(4), &p, &|_| 0.1).unwrap();
        let chosen: Vec<_> = plan
            .search_candidates()
            .unwrap()
            .iter()
            .filter(|c| c.chosen)
            .collect();
        assert_eq!(chosen.len(), 1);
        assert_eq!(
            (chosen[0].schedule, chosen[0].delay),
            (ScheduleKind::Profiled, 1)
        );
        // Compute only: forward 1 + backward 4.
        assert!((chosen[0].step_s - 5.0).abs() < 1e-9, "{chosen:?}");
        assert_eq!(plan.delay(), 1);
    }

    #[test]
    fn an_exchange_longer_than_a_step_is_hidden_by_a_delay() {
        // The input layer's exchange takes 8 s; a step computes for 5 s. Delay 1 stalls the
        // next step at that layer; delay 2 lands it in time.
        let u = units(&[1000, 100, 100, 100]);
        let p = profile(&u, 1.0, 1.0);
        let comm = |params: usize| if params >= 1000 { 8.0 } else { 0.1 };
        let mut fixed = config(4);
        fixed.schedule = ScheduleKind::Equal;
        fixed.delay = Some(1);
        let d1 = modelled_step_time(
            &SyncPlan::new("m", &u, &fixed, Some(&p)).unwrap(),
            &p,
            &comm,
        );
        fixed.delay = Some(2);
        let d2 = modelled_step_time(
            &SyncPlan::new("m", &u, &fixed, Some(&p)).unwrap(),
            &p,
            &comm,
        );
        assert!(d2 < d1, "delay 2 {d2} vs delay 1 {d1}");
        assert!((d2 - 5.0).abs() < 1e-9, "{d2}");
        // With whole layers (chunks would spread the 8 s exchange over the steps instead).
        let mut layers = config(4);
        layers.sync_unit_params = Some(0);
        let plan = search("m", &u, &layers, &p, &|n| comm(n)).unwrap();
        assert_eq!(plan.delay(), 2);
    }

    #[test]
    fn a_large_layer_is_chunked_so_each_step_carries_a_share() {
        // One layer holds 77 % of the parameters: its exchange (12 s) is longer than two steps
        // of compute (5 s each), so with whole layers only a delay of 3 hides it. Chunks
        // spread it over the period's steps, and every average lands one step later.
        let u = units(&[1000, 100, 100, 100]);
        let p = profile(&u, 1.0, 1.0);
        let comm = |params: usize| params as f64 * 0.012;
        let plan = search("m", &u, &config(4), &p, &comm).unwrap();
        let candidates = plan.search_candidates().unwrap();
        let chosen = candidates.iter().find(|c| c.chosen).unwrap();
        assert!(chosen.unit_params > 0, "{chosen:?}");
        assert_eq!(chosen.delay, 1, "{chosen:?}");
        assert!(chosen.step_s <= 5.0 * 1.02, "{chosen:?}");
        let whole_d1 = candidates
            .iter()
            .filter(|c| c.unit_params == 0 && c.delay == 1)
            .map(|c| c.step_s)
            .fold(f64::INFINITY, f64::min);
        assert!(whole_d1 > chosen.step_s * 1.05, "{whole_d1} vs {chosen:?}");
        assert!(plan.units().len() > 4);
        assert!(plan.describe().contains("units <= "), "{}", plan.describe());

        // A fixed unit size is kept: whole layers only.
        let mut layers = config(4);
        layers.sync_unit_params = Some(0);
        let plan = search("m", &u, &layers, &p, &comm).unwrap();
        assert!(plan
            .search_candidates()
            .unwrap()
            .iter()
            .all(|c| c.unit_params == 0));
        assert_eq!(plan.units().len(), 4);
    }

    #[test]
    fn a_latency_bound_link_gets_fewer_larger_exchanges() {
        // Every exchange costs 10 s of latency whatever its size; a step computes for 1 s.
        // Four groups pay the latency four times per period, one group once.
        let u = units(&[10; 4]);
        let p = profile(&u, 0.1, 0.6);
        let comm = |_: usize| 10.0;
        let mut c = config(4);
        c.bucket_caps = crate::bucket::BucketCaps::default();
        let plan = search("m", &u, &c, &p, &comm).unwrap();
        let chosen = plan
            .search_candidates()
            .unwrap()
            .iter()
            .find(|c| c.chosen)
            .unwrap()
            .clone();
        assert_eq!(chosen.groups, 1, "{:?}", plan.search_candidates());
        let four = plan
            .search_candidates()
            .unwrap()
            .iter()
            .find(|c| c.groups == 4 && c.delay == chosen.delay && c.schedule == ScheduleKind::Equal)
            .unwrap()
            .step_s;
        assert!(chosen.step_s * 3.0 < four, "{} vs {four}", chosen.step_s);
    }

    #[test]
    fn fixed_settings_are_not_searched() {
        let u = units(&[100; 4]);
        let p = profile(&u, 1.0, 1.0);
        let mut c = config(4);
        c.schedule = ScheduleKind::Profiled;
        c.delay = Some(1);
        let plan = search("m", &u, &c, &p, &|_| 0.1).unwrap();
        assert!(plan.search_candidates().is_none());
    }
}
