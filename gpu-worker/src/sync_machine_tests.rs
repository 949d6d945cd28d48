//! Tests of [`WorkerSyncMachine`]: exact action sequences per strategy on a small plan, and a
//! property test of its contract (every launch waited once, applies after their wait at the
//! right offsets, every layer stepped once per step, syncs per layer as the plan says).

use std::collections::{BTreeMap, BTreeSet};

use engine::bucket::BucketCaps;
use engine::model::LayerInfo;
use engine::outer::Landing;
use engine::plan::{PlanConfig, ScheduleKind, Strategy};
use proptest::prelude::*;

use super::*;

/// Units at model indices 0, 1, 3, 4 (layer 2 has no parameters).
fn infos(params: &[usize]) -> Vec<LayerInfo> {
    [0usize, 1, 3, 4]
        .iter()
        .zip(params)
        .map(|(&index, &params)| LayerInfo {
            index,
            name: format!("l{index}"),
            kind: "linear",
            params,
        })
        .collect()
}

fn plan(strategy: Strategy, period: u64, params: &[usize], one_per_bucket: bool) -> SyncPlan {
    plan_with_delay(strategy, period, params, one_per_bucket, 1)
}

/// The whole-layer unit of model layer `layer` in the plans of `&[2, 3, 4, 5]` (layer 2 has
/// no parameters, so unit ids 0, 1, 2, 3 are layers 0, 1, 3, 4).
fn unit(layer: usize) -> UnitSlice {
    let (id, len) = match layer {
        0 => (0, 2),
        1 => (1, 3),
        3 => (2, 4),
        4 => (3, 5),
        _ => panic!("layer {layer} is not a unit"),
    };
    UnitSlice {
        id,
        layer,
        at: 0,
        len,
        layer_len: len,
    }
}

fn units(layers: &[usize]) -> Vec<UnitSlice> {
    layers.iter().map(|&l| unit(l)).collect()
}

fn plan_with_delay(
    strategy: Strategy,
    period: u64,
    params: &[usize],
    one_per_bucket: bool,
    delay: u64,
) -> SyncPlan {
    plan_chunked(strategy, period, params, one_per_bucket, delay, None)
}

fn plan_chunked(
    strategy: Strategy,
    period: u64,
    params: &[usize],
    one_per_bucket: bool,
    delay: u64,
    sync_unit_params: Option<usize>,
) -> SyncPlan {
    let mut config = PlanConfig::new(strategy, period);
    config.sync_unit_params = sync_unit_params;
    config.delay = Some(delay);
    config.schedule = ScheduleKind::Equal;
    if one_per_bucket {
        config.bucket_caps = BucketCaps {
            first_cap_bytes: 1,
            cap_bytes: 1,
            alone_over_bytes: usize::MAX,
        };
    }
    SyncPlan::new("test", &infos(params), &config, None).expect("plan")
}

/// Runs one step (hooks in backward order) and returns the actions per input.
fn step(m: &mut WorkerSyncMachine, s: u64) -> Vec<Vec<SyncAction>> {
    let drain = |m: &mut WorkerSyncMachine| std::iter::from_fn(|| m.poll()).collect::<Vec<_>>();
    let mut out = Vec::new();
    m.begin_step(s);
    out.push(drain(m));
    for layer in [4, 3, 2, 1, 0] {
        m.layer_grads_ready(layer);
        out.push(drain(m));
    }
    m.backward_done();
    out.push(drain(m));
    out
}

fn key(step: u64, bucket: u32) -> ReduceKey {
    ReduceKey::new(step, bucket)
}

use SyncAction::{Apply, Launch, Stage, StepLayer, Wait};
use SyncKind::{Gradients, Parameters};

#[test]
fn ssgd_reduces_every_gradient_after_backward_then_steps() {
    let mut m = WorkerSyncMachine::new(&plan(Strategy::Ssgd, 1, &[2, 3, 4, 5], false));
    let acts = step(&mut m, 7);
    assert!(acts[..6].iter().all(Vec::is_empty), "{acts:?}");
    let k = key(7, 0);
    let all = vec![4, 3, 1, 0];
    let mut want: Vec<SyncAction> = all
        .iter()
        .map(|&layer| Stage {
            unit: unit(layer),
            key: k,
            kind: Gradients,
        })
        .collect();
    want.push(Launch {
        key: k,
        units: units(&all),
        kind: Gradients,
        landing: Landing::Replace,
    });
    want.push(Wait { key: k });
    let mut offset = 0;
    for (&layer, len) in all.iter().zip([5, 4, 3, 2]) {
        want.push(Apply {
            key: k,
            unit: unit(layer),
            offset,
            kind: Gradients,
            landing: Landing::Replace,
        });
        offset += len;
    }
    want.extend(all.iter().map(|&layer| StepLayer { layer }));
    assert_eq!(acts[6], want);
}

#[test]
fn wfbp_launches_each_bucket_in_backward_and_waits_before_stepping() {
    let mut m = WorkerSyncMachine::new(&plan(Strategy::Wfbp, 1, &[2, 3, 4, 5], true));
    let acts = step(&mut m, 0);
    // Hook of layer 4 (bucket 0): stage and launch at once.
    assert_eq!(
        acts[1],
        vec![
            Stage {
                unit: unit(4),
                key: key(0, 0),
                kind: Gradients
            },
            Launch {
                key: key(0, 0),
                units: units(&[4]),
                kind: Gradients,
                landing: Landing::Replace,
            }
        ]
    );
    assert!(acts[3].is_empty(), "layer 2 has no parameters");
    let after = &acts[6];
    let waits: Vec<_> = after
        .iter()
        .filter_map(|a| match a {
            Wait { key } => Some(key.bucket),
            _ => None,
        })
        .collect();
    assert_eq!(waits, vec![0, 1, 2, 3]);
    assert_eq!(
        after.last(),
        Some(&StepLayer { layer: 0 }),
        "steps come after every wait"
    );
}

#[test]
fn localsgd_steps_in_backward_and_averages_every_period() {
    let mut m = WorkerSyncMachine::new(&plan(Strategy::LocalSgd, 2, &[2, 3, 4, 5], false));
    let first = step(&mut m, 0);
    assert_eq!(first[1], vec![StepLayer { layer: 4 }]);
    assert!(first[6].is_empty());
    let second = step(&mut m, 1);
    assert_eq!(
        second[6][4],
        Launch {
            key: key(1, 0),
            units: units(&[4, 3, 1, 0]),
            kind: Parameters,
            landing: Landing::Replace,
        }
    );
    assert_eq!(second[6][5], Wait { key: key(1, 0) });
    assert_eq!(second[6].len(), 4 + 1 + 1 + 4);
}

#[test]
fn dreamddp_waits_at_the_layers_next_step_and_writes_before_stepping() {
    // Equal split, H = 2, backward order [4, 3, 1, 0]: {4, 3} at phase 0, {1, 0} at phase 1.
    let p = plan(Strategy::DreamDdp, 2, &[2, 3, 4, 5], false);
    assert_eq!(p.buckets().len(), 2);
    let mut m = WorkerSyncMachine::new(&p);
    let s0 = step(&mut m, 0);
    assert_eq!(
        s0[2],
        vec![
            StepLayer { layer: 3 },
            Stage {
                unit: unit(3),
                key: key(0, 0),
                kind: Parameters
            },
            Launch {
                key: key(0, 0),
                units: units(&[4, 3]),
                kind: Parameters,
                landing: Landing::Replace,
            }
        ]
    );
    assert!(s0[6].is_empty(), "nothing waited after backward");
    assert_eq!(m.in_flight(), vec![key(0, 0)]);
    let s1 = step(&mut m, 1);
    // Bucket 0 is not due at step 1, but its average lands before layer 4's step.
    assert_eq!(
        s1[1],
        vec![
            Wait { key: key(0, 0) },
            Apply {
                key: key(0, 0),
                unit: unit(4),
                offset: 0,
                kind: Parameters,
                landing: Landing::Replace,
            },
            StepLayer { layer: 4 }
        ]
    );
    assert_eq!(
        s1[2][0],
        Apply {
            key: key(0, 0),
            unit: unit(3),
            offset: 5,
            kind: Parameters,
            landing: Landing::Replace,
        }
    );
    assert_eq!(m.in_flight(), vec![key(1, 1)]);
    m.finish();
    let rest: Vec<_> = std::iter::from_fn(|| m.poll()).collect();
    assert_eq!(rest.len(), 3, "{rest:?}");
    assert_eq!(rest[0], Wait { key: key(1, 1) });
}

/// A driver that checks the machine's contract while executing its actions.
#[derive(Default)]
struct Checker {
    launched: BTreeMap<ReduceKey, (Vec<usize>, SyncKind)>,
    waited: BTreeMap<ReduceKey, BTreeSet<usize>>,
    staged: BTreeMap<ReduceKey, Vec<usize>>,
    stepped: Vec<usize>,
    applied: BTreeMap<usize, u64>,
    anchored: BTreeSet<usize>,
}

impl Checker {
    /// Runs the pending actions; `plan` gives each unit's layer and slice.
    fn run(&mut self, m: &mut WorkerSyncMachine, hook_layer: Option<usize>, plan: &SyncPlan) {
        let check = |u: &UnitSlice| {
            let p = &plan.units()[u.id];
            let layer_len: usize = plan.units_of_layer(p.index).iter().map(|c| c.params).sum();
            assert_eq!(
                (u.layer, u.at, u.len, u.layer_len),
                (p.index, p.offset, p.params, layer_len)
            );
        };
        while let Some(a) = m.poll() {
            if let (Some(h), Some(l)) = (hook_layer, a.layer()) {
                assert_eq!(h, l, "a hook action touches another layer: {a:?}");
            }
            match a {
                Stage { unit, key, .. } => {
                    check(&unit);
                    self.staged.entry(key).or_default().push(unit.id)
                }
                Launch {
                    key, units, kind, ..
                } => {
                    let ids: Vec<usize> = units.iter().map(|u| u.id).collect();
                    assert_eq!(self.staged.remove(&key), Some(ids.clone()));
                    assert!(self.launched.insert(key, (ids, kind)).is_none());
                }
                Wait { key } => {
                    let (ids, _) = &self.launched[&key];
                    let fresh = self.waited.insert(key, ids.iter().copied().collect());
                    assert!(fresh.is_none(), "{key} waited twice");
                }
                Apply {
                    key, unit, offset, ..
                } => {
                    check(&unit);
                    let (ids, _) = &self.launched[&key];
                    let pos = ids.iter().position(|&u| u == unit.id).expect("in key");
                    let want: usize = ids[..pos].iter().map(|&u| plan.units()[u].params).sum();
                    assert_eq!(offset, want);
                    assert!(self.waited.get_mut(&key).expect("waited").remove(&unit.id));
                    *self.applied.entry(unit.id).or_default() += 1;
                }
                StepLayer { layer } => self.stepped.push(layer),
                SyncAction::SetAnchor { unit } => {
                    check(&unit);
                    assert!(
                        self.anchored.insert(unit.id),
                        "unit {unit:?} anchored twice"
                    );
                    assert!(
                        !self.stepped.contains(&unit.layer),
                        "anchored after its step"
                    );
                }
            }
        }
    }
}

proptest! {
    #[test]
    fn every_strategy_keeps_the_contract(
        strategy in prop::sample::select(Strategy::ALL.to_vec()),
        params in prop::collection::vec(1usize..40, 4),
        period in 1u64..=4,
        steps in 1u64..12,
        one_per_bucket in any::<bool>(),
        delay_pick in 0u64..4,
        chunk in prop::option::of(3usize..30),
    ) {
        // A delay the strategy accepts: dreamddp 1..=max(1, H - 1), streaming-diloco 0..H.
        let delay = match strategy {
            Strategy::DreamDdp => 1 + delay_pick % period.saturating_sub(1).max(1),
            Strategy::StreamingDiloco => delay_pick % period,
            _ => 1,
        };
        let p = plan_chunked(strategy, period, &params, one_per_bucket, delay, chunk);
        let mut m = WorkerSyncMachine::new(&p);
        let mut c = Checker::default();
        for s in 0..steps {
            m.begin_step(s);
            c.run(&mut m, None, &p);
            c.stepped.clear();
            for layer in [4, 3, 2, 1, 0] {
                m.layer_grads_ready(layer);
                c.run(&mut m, Some(layer), &p);
            }
            m.backward_done();
            c.run(&mut m, None, &p);
            prop_assert_eq!(&c.stepped, &vec![4, 3, 1, 0], "step {}", s);
            if !matches!(
                strategy,
                Strategy::DreamDdp | Strategy::Plsgd | Strategy::StreamingDiloco
            ) {
                prop_assert!(m.in_flight().is_empty());
            }
        }
        m.finish();
        c.run(&mut m, None, &p);
        prop_assert!(c.staged.is_empty());
        prop_assert!(c.waited.values().all(BTreeSet::is_empty), "every slice applied");
        prop_assert_eq!(c.waited.len(), c.launched.len(), "every launch waited");
        for u in p.units() {
            let expected = match strategy {
                Strategy::Ssgd | Strategy::Wfbp => steps,
                Strategy::LocalSgd | Strategy::Diloco => steps / period,
                Strategy::DreamDdp | Strategy::Plsgd | Strategy::StreamingDiloco => {
                    (0..steps).filter(|&s| p.unit_is_due(s, u.id)).count() as u64
                }
            };
            prop_assert_eq!(c.applied.get(&u.id).copied().unwrap_or(0), expected);
            prop_assert_eq!(
                c.anchored.contains(&u.id),
                strategy.uses_outer_optimizer(),
                "anchors exactly for the outer strategies"
            );
        }
    }
}

#[test]
fn a_chunked_layer_lands_each_chunk_in_its_slice_before_the_layers_one_step() {
    // Layer 4 (10 values) in chunks of at most 4: [4, 3, 3]; H = 2 with the equal split over
    // 6 units in backward order: 4[2/3], 4[1/3], 4[0/3] | 3, 1, 0.
    let p = plan_chunked(Strategy::DreamDdp, 2, &[2, 3, 4, 10], false, 1, Some(4));
    let chunks: Vec<(usize, usize, usize)> = p
        .units_of_layer(4)
        .iter()
        .map(|u| (u.id, u.offset, u.params))
        .collect();
    assert_eq!(chunks, vec![(3, 0, 4), (4, 4, 3), (5, 7, 3)]);
    let mut m = WorkerSyncMachine::new(&p);
    let s0 = step(&mut m, 0);
    // At layer 4's hook: one optimizer step, then its due chunks staged (backward order).
    let staged: Vec<usize> = s0[1]
        .iter()
        .filter_map(|a| match a {
            Stage { unit, .. } => Some(unit.id),
            _ => None,
        })
        .collect();
    assert_eq!(s0[1][0], StepLayer { layer: 4 });
    assert!(!staged.is_empty());
    assert!(staged.windows(2).all(|w| w[0] > w[1]), "{staged:?}");
    let s1 = step(&mut m, 1);
    // Step 1: the chunks launched at step 0 land at layer 4's hook, each in its own slice,
    // all before the layer's single step.
    let hook = &s1[1];
    let step_at = hook
        .iter()
        .position(|a| *a == StepLayer { layer: 4 })
        .unwrap();
    let applied: Vec<(usize, usize)> = hook[..step_at]
        .iter()
        .filter_map(|a| match a {
            Apply { unit, .. } => Some((unit.at, unit.len)),
            _ => None,
        })
        .collect();
    assert_eq!(applied.len(), staged.len());
    assert!(applied.iter().all(|&(at, len)| at + len <= 10));
    assert_eq!(
        hook.iter()
            .filter(|a| matches!(a, StepLayer { .. }))
            .count(),
        1
    );
}

/// The actions of `actions` that are not optimizer steps or stages, for compact asserts.
fn syncs(actions: &[SyncAction]) -> Vec<SyncAction> {
    actions
        .iter()
        .filter(|a| matches!(a, Launch { .. } | Wait { .. } | Apply { .. }))
        .cloned()
        .collect()
}

#[test]
fn diloco_anchors_first_then_lands_every_period_through_the_outer_step() {
    let p = plan(Strategy::Diloco, 2, &[2, 3, 4, 5], false);
    let mut m = WorkerSyncMachine::new(&p);
    let s0 = step(&mut m, 0);
    assert_eq!(
        s0[1],
        vec![
            SyncAction::SetAnchor { unit: unit(4) },
            StepLayer { layer: 4 }
        ]
    );
    assert!(s0[6].is_empty(), "nothing synced before the period ends");
    let s1 = step(&mut m, 1);
    assert!(s1[1..6]
        .iter()
        .flatten()
        .all(|a| matches!(a, StepLayer { .. })));
    let after = syncs(&s1[6]);
    let outer = Landing::Outer { mix: 0.0 };
    assert_eq!(
        after[0],
        Launch {
            key: key(1, 0),
            units: units(&[4, 3, 1, 0]),
            kind: Parameters,
            landing: outer,
        }
    );
    assert_eq!(after[1], Wait { key: key(1, 0) });
    assert_eq!(after.len(), 2 + 4);
    assert!(after[2..]
        .iter()
        .all(|a| matches!(a, Apply { landing, .. } if *landing == outer)));
}

#[test]
fn streaming_diloco_launches_a_fragment_after_its_step_and_lands_it_tau_steps_later() {
    // Equal split, H = 2: fragment {4, 3} at phase 0, {1, 0} at phase 1; τ = 1.
    let p = plan_with_delay(Strategy::StreamingDiloco, 2, &[2, 3, 4, 5], false, 1);
    let mix = Landing::Outer { mix: 0.5 };
    let mut m = WorkerSyncMachine::new(&p);
    let s0 = step(&mut m, 0);
    assert!(syncs(&s0[1..6].concat()).is_empty(), "nothing in backward");
    assert_eq!(
        syncs(&s0[6]),
        vec![Launch {
            key: key(0, 0),
            units: units(&[4, 3]),
            kind: Parameters,
            landing: mix,
        }]
    );
    let s1 = step(&mut m, 1);
    let after = syncs(&s1[6]);
    assert_eq!(after[0], Wait { key: key(0, 0) });
    assert!(
        matches!(after[1], Apply { unit: UnitSlice { layer: 4, .. }, landing, .. } if landing == mix)
    );
    assert!(matches!(
        after[2],
        Apply {
            unit: UnitSlice { layer: 3, .. },
            ..
        }
    ));
    assert!(
        matches!(&after[3], Launch { key: k, units: u, .. } if *k == key(1, 1) && u == &units(&[1, 0]))
    );
    assert_eq!(m.in_flight(), vec![key(1, 1)]);

    // τ = 0: each fragment is waited and landed in the step it is due.
    let p0 = plan_with_delay(Strategy::StreamingDiloco, 2, &[2, 3, 4, 5], false, 0);
    let mut m0 = WorkerSyncMachine::new(&p0);
    let s = step(&mut m0, 0);
    assert_eq!(syncs(&s[6]).len(), 1 + 1 + 2);
    assert!(m0.in_flight().is_empty());
}

#[test]
fn dreamddp_with_a_delay_lands_later_and_rebases() {
    // H = 4, delay 2: bucket {4} (phase 0) launched at step 0 lands in step 2's backward.
    let p = plan_with_delay(Strategy::DreamDdp, 4, &[2, 3, 4, 5], true, 2);
    assert_eq!(p.landing(), Landing::Rebase);
    let mut m = WorkerSyncMachine::new(&p);
    let s0 = step(&mut m, 0);
    assert!(matches!(
        syncs(&s0[1])[..],
        [Launch {
            landing: Landing::Rebase,
            ..
        }]
    ));
    let s1 = step(&mut m, 1);
    assert!(
        !s1.concat()
            .iter()
            .any(|a| matches!(a, Wait { key: k } if *k == key(0, 0))),
        "not landed one step later"
    );
    let s2 = step(&mut m, 2);
    assert_eq!(
        syncs(&s2[1]),
        vec![
            Wait { key: key(0, 0) },
            Apply {
                key: key(0, 0),
                unit: unit(4),
                offset: 0,
                kind: Parameters,
                landing: Landing::Rebase,
            }
        ]
    );
    // The landing precedes the layer's step.
    assert_eq!(s2[1].last(), Some(&StepLayer { layer: 4 }));
}

#[test]
fn plsgd_is_the_equal_split_without_delay_whatever_the_config_says() {
    let mut config = PlanConfig::new(Strategy::Plsgd, 2);
    config.schedule = ScheduleKind::Profiled; // needs no profile: plsgd ignores it
    config.delay = Some(3);
    let p = SyncPlan::new("test", &infos(&[2, 3, 4, 5]), &config, None).expect("plan");
    let equal = plan(Strategy::DreamDdp, 2, &[2, 3, 4, 5], false);
    for (a, b) in p.units().iter().zip(equal.units()) {
        assert_eq!(a.phases, b.phases);
    }
    assert_eq!((p.delay(), p.landing()), (1, Landing::Replace));
}
