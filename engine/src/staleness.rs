//! Staleness-weighted averaging of layer deltas (polynomial and hinge), and the node-side
//! asynchrony rules (rebase on a new global version, coalescing of cached deltas).
//!
//! At an aggregator, per layer: each delta `Δᵢ = θᵢ − anchorᵢ` comes with `nᵢ` (samples behind
//! it) and `τᵢ` (versions between its base and the current version). With
//! `wᵢ = nᵢ · s(τᵢ)`:
//!
//! ```text
//! θ ← θ + η_outer · Σ wᵢ Δᵢ / Σ wᵢ        (deltas with τᵢ > τ_max are dropped)
//! ```
//!
//! `s` is [`StalenessFn`]: polynomial `(1 + τ)^(−a)` (default `a = ½`), hinge, or constant.
//! With `τ = 0` everywhere this is plain sample-weighted averaging of the deltas.

use thiserror::Error;

/// Errors of the staleness math: bad shapes or bad parameters, never a panic.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum StalenessError {
    /// A vector whose length differs from the layer's.
    #[error("{what}: length {got}, expected {expected}")]
    LengthMismatch {
        /// Which vector (e.g. `delta 3`, `theta_at_cut`).
        what: String,
        /// The layer length.
        expected: usize,
        /// The length given.
        got: usize,
    },
    /// A staleness-function parameter that is negative, NaN or infinite.
    #[error("staleness function parameter {name} = {value} must be finite and non-negative")]
    BadParameter {
        /// `a` or `b`.
        name: &'static str,
        /// The value given.
        value: f64,
    },
    /// [`coalesce`] was given no deltas.
    #[error("nothing to coalesce: no cached deltas")]
    NothingToCoalesce,
}

/// The staleness discount `s(τ)`, with `s(0) = 1` and non-increasing in `τ`.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase", tag = "kind")]
pub enum StalenessFn {
    /// `s(τ) = (1 + τ)^(−a)`.
    Polynomial {
        /// Decay exponent.
        a: f64,
    },
    /// `s(τ) = 1` if `τ ≤ b`, else `1 / (a·(τ − b) + 1)`.
    Hinge {
        /// Decay slope past the hinge.
        a: f64,
        /// Staleness tolerated without discount.
        b: f64,
    },
    /// `s(τ) = 1`: staleness ignored.
    Constant,
}

impl Default for StalenessFn {
    fn default() -> Self {
        StalenessFn::Polynomial { a: 0.5 }
    }
}

fn check_param(name: &'static str, value: f64) -> Result<(), StalenessError> {
    if value.is_finite() && value >= 0.0 {
        Ok(())
    } else {
        Err(StalenessError::BadParameter { name, value })
    }
}

impl StalenessFn {
    /// Checks the parameters are finite and non-negative (so `s` is in `(0, 1]`).
    pub fn validate(&self) -> Result<(), StalenessError> {
        match *self {
            StalenessFn::Polynomial { a } => check_param("a", a),
            StalenessFn::Hinge { a, b } => check_param("a", a).and(check_param("b", b)),
            StalenessFn::Constant => Ok(()),
        }
    }

    /// The discount `s(τ)`.
    pub fn discount(&self, tau: u64) -> f64 {
        let t = tau as f64;
        match *self {
            StalenessFn::Polynomial { a } => (1.0 + t).powf(-a),
            StalenessFn::Hinge { a, b } => {
                if t <= b {
                    1.0
                } else {
                    1.0 / (a * (t - b) + 1.0)
                }
            }
            StalenessFn::Constant => 1.0,
        }
    }

    /// The weight of a delta: `samples · s(τ)`.
    pub fn weight(&self, samples: u64, tau: u64) -> f64 {
        samples as f64 * self.discount(tau)
    }
}

/// Per-layer learning-rate damping by staleness: `base^stale` (e.g. `0.9^stale`).
pub fn lr_damping(base: f32, stale: u64) -> f32 {
    base.powi(stale.min(i32::MAX as u64) as i32)
}

/// One node's delta of a layer, as seen by the aggregator.
#[derive(Clone, Copy, Debug)]
pub struct DeltaContribution<'a> {
    /// `θ − anchor` of the layer at the node.
    pub delta: &'a [f32],
    /// Training samples behind the delta.
    pub samples: u64,
    /// Versions between the delta's base and the current version.
    pub tau: u64,
}

/// What [`aggregate`] did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AggregateOutcome {
    /// Number of deltas averaged in (those with `τ ≤ τ_max`).
    pub applied: usize,
    /// Indices (into the `deltas` argument) of deltas dropped for `τ > τ_max`; their senders
    /// must re-sync.
    pub dropped_stale: Vec<usize>,
}

/// Applies `θ ← θ + η · Σ wᵢΔᵢ / Σ wᵢ` over the deltas with `τᵢ ≤ tau_max`, `wᵢ = nᵢ·s(τᵢ)`.
///
/// Nothing is changed when no delta is accepted or the accepted weights sum to zero (all
/// `samples = 0`). Lengths and `f` are checked before `current` is touched.
pub fn aggregate(
    current: &mut [f32],
    deltas: &[DeltaContribution<'_>],
    f: StalenessFn,
    outer_lr: f32,
    tau_max: u64,
) -> Result<AggregateOutcome, StalenessError> {
    f.validate()?;
    for (i, d) in deltas.iter().enumerate() {
        if d.delta.len() != current.len() {
            return Err(StalenessError::LengthMismatch {
                what: format!("delta {i}"),
                expected: current.len(),
                got: d.delta.len(),
            });
        }
    }
    let mut dropped_stale = Vec::new();
    let mut total_weight = 0.0f64;
    for (i, d) in deltas.iter().enumerate() {
        if d.tau > tau_max {
            dropped_stale.push(i);
        } else {
            total_weight += f.weight(d.samples, d.tau);
        }
    }
    let applied = deltas.len() - dropped_stale.len();
    if total_weight > 0.0 {
        for d in deltas.iter().filter(|d| d.tau <= tau_max) {
            let scale = (f64::from(outer_lr) * f.weight(d.samples, d.tau) / total_weight) as f32;
            if scale == 0.0 {
                continue;
            }
            for (c, &x) in current.iter_mut().zip(d.delta) {
                *c += scale * x;
            }
        }
    }
    Ok(AggregateOutcome {
        applied,
        dropped_stale,
    })
}

fn check_len(what: &str, expected: usize, got: usize) -> Result<(), StalenessError> {
    if expected == got {
        Ok(())
    } else {
        Err(StalenessError::LengthMismatch {
            what: what.to_string(),
            expected,
            got,
        })
    }
}

/// The asynchrony rule when a new global version of a layer arrives while the node kept
/// training after cutting its delta: `θ ← θ_global + (θ_now − θ_at_cut)` (local progress since
/// the cut is kept) and `anchor ← θ_global`. Lengths are checked before anything is written.
pub fn rebase(
    theta_now: &mut [f32],
    theta_at_cut: &[f32],
    theta_global: &[f32],
    anchor: &mut [f32],
) -> Result<(), StalenessError> {
    let n = theta_now.len();
    check_len("theta_at_cut", n, theta_at_cut.len())?;
    check_len("theta_global", n, theta_global.len())?;
    check_len("anchor", n, anchor.len())?;
    for ((t, &cut), &g) in theta_now.iter_mut().zip(theta_at_cut).zip(theta_global) {
        *t = g + (*t - cut);
    }
    anchor.copy_from_slice(theta_global);
    Ok(())
}

/// Coalesces cached (weak-synced) deltas of one layer, given as `(delta, base_version)`: their
/// sum, carrying the **oldest** base version so the staleness is never understated.
pub fn coalesce(deltas: &[(Vec<f32>, u64)]) -> Result<(Vec<f32>, u64), StalenessError> {
    let (first, rest) = deltas
        .split_first()
        .ok_or(StalenessError::NothingToCoalesce)?;
    let n = first.0.len();
    for (i, (d, _)) in rest.iter().enumerate() {
        check_len(&format!("cached delta {}", i + 1), n, d.len())?;
    }
    let mut sum = first.0.clone();
    let mut oldest = first.1;
    for (d, base) in rest {
        for (s, &x) in sum.iter_mut().zip(d) {
            *s += x;
        }
        oldest = oldest.min(*base);
    }
    Ok((sum, oldest))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn close(a: f32, b: f32) -> bool {
        (a - b).abs() <= 1e-4 * (1.0 + a.abs().max(b.abs()))
    }

    #[test]
    fn discounts_by_hand() {
        let poly = StalenessFn::default();
        assert_eq!(poly.discount(0), 1.0);
        assert!((poly.discount(3) - 0.5).abs() < 1e-12); // (1+3)^-0.5
        let hinge = StalenessFn::Hinge { a: 2.0, b: 2.0 };
        assert_eq!(hinge.discount(2), 1.0);
        assert!((hinge.discount(4) - 0.2).abs() < 1e-12); // 1/(2·2+1)
        assert_eq!(StalenessFn::Constant.discount(100), 1.0);
        assert!((poly.weight(8, 3) - 4.0).abs() < 1e-12);
        assert!((lr_damping(0.9, 2) - 0.81).abs() < 1e-6);
    }

    #[test]
    fn aggregate_by_hand_with_a_stale_drop() {
        let mut theta = vec![1.0f32, 1.0];
        let a = [2.0f32, 0.0];
        let b = [0.0f32, 4.0];
        let c = [100.0f32, 100.0];
        let deltas = [
            DeltaContribution {
                delta: &a,
                samples: 10,
                tau: 0,
            }, // w = 10
            DeltaContribution {
                delta: &b,
                samples: 20,
                tau: 3,
            }, // w = 20·0.5 = 10
            DeltaContribution {
                delta: &c,
                samples: 10,
                tau: 9,
            }, // dropped
        ];
        let out = aggregate(&mut theta, &deltas, StalenessFn::default(), 0.5, 5).unwrap();
        assert_eq!(
            out,
            AggregateOutcome {
                applied: 2,
                dropped_stale: vec![2]
            }
        );
        // mean delta = (1, 2); θ += 0.5·(1, 2)
        assert!(close(theta[0], 1.5) && close(theta[1], 2.0), "{theta:?}");
    }

    #[test]
    fn aggregate_rejects_bad_input_without_touching_theta() {
        let mut theta = vec![1.0f32; 3];
        let short = [1.0f32; 2];
        let ok = [1.0f32; 3];
        let deltas = [
            DeltaContribution {
                delta: &ok[..],
                samples: 1,
                tau: 0,
            },
            DeltaContribution {
                delta: &short[..],
                samples: 1,
                tau: 0,
            },
        ];
        let err = aggregate(&mut theta, &deltas, StalenessFn::default(), 1.0, 4).unwrap_err();
        assert_eq!(
            err,
            StalenessError::LengthMismatch {
                what: "delta 1".into(),
                expected: 3,
                got: 2
            }
        );
        assert!(err.to_string().contains("delta 1"));
        let bad = StalenessFn::Polynomial { a: f64::NAN };
        assert!(matches!(
            aggregate(&mut theta, &deltas[..1], bad, 1.0, 4),
            Err(StalenessError::BadParameter { name: "a", .. })
        ));
        assert_eq!(theta, vec![1.0; 3]);
    }

    #[test]
    fn zero_samples_or_all_stale_change_nothing() {
        let mut theta = vec![1.0f32; 2];
        let d = [5.0f32; 2];
        let zero = [DeltaContribution {
            delta: &d,
            samples: 0,
            tau: 0,
        }];
        let out = aggregate(&mut theta, &zero, StalenessFn::default(), 1.0, 4).unwrap();
        assert_eq!(out.applied, 1);
        let stale = [DeltaContribution {
            delta: &d,
            samples: 5,
            tau: 5,
        }];
        let out = aggregate(&mut theta, &stale, StalenessFn::default(), 1.0, 4).unwrap();
        assert_eq!(
            out,
            AggregateOutcome {
                applied: 0,
                dropped_stale: vec![0]
            }
        );
        assert_eq!(theta, vec![1.0; 2]);
    }

    #[test]
    fn rebase_and_coalesce_by_hand() {
        let mut theta = vec![5.0f32, 7.0];
        let mut anchor = vec![0.0f32; 2];
        rebase(&mut theta, &[4.0, 4.0], &[10.0, 20.0], &mut anchor).unwrap();
        assert_eq!(theta, vec![11.0, 23.0]);
        assert_eq!(anchor, vec![10.0, 20.0]);
        assert!(matches!(
            rebase(&mut theta, &[0.0], &[0.0, 0.0], &mut anchor),
            Err(StalenessError::LengthMismatch { .. })
        ));
        assert_eq!(theta, vec![11.0, 23.0]);

        let (sum, base) = coalesce(&[(vec![1.0, 2.0], 7), (vec![3.0, 4.0], 5)]).unwrap();
        assert_eq!((sum, base), (vec![4.0, 6.0], 5));
        assert_eq!(coalesce(&[]), Err(StalenessError::NothingToCoalesce));
        assert!(matches!(
            coalesce(&[(vec![1.0], 1), (vec![1.0, 2.0], 2)]),
            Err(StalenessError::LengthMismatch { .. })
        ));
    }

    fn arb_fn() -> impl Strategy<Value = StalenessFn> {
        prop_oneof![
            (0.0f64..4.0).prop_map(|a| StalenessFn::Polynomial { a }),
            (0.0f64..4.0, 0.0f64..10.0).prop_map(|(a, b)| StalenessFn::Hinge { a, b }),
            Just(StalenessFn::Constant),
        ]
    }

    fn arb_deltas() -> impl Strategy<Value = (Vec<f32>, Vec<(Vec<f32>, u64)>)> {
        (1usize..8, 1usize..6).prop_flat_map(|(len, count)| {
            (
                prop::collection::vec(-10.0f32..10.0, len),
                prop::collection::vec(
                    (prop::collection::vec(-10.0f32..10.0, len), 1u64..1000),
                    count,
                ),
            )
        })
    }

    proptest! {
        #[test]
        fn fresh_deltas_give_sample_weighted_average(
            (theta0, deltas) in arb_deltas(),
            f in arb_fn(),
            lr in 0.1f32..2.0,
        ) {
            let contribs: Vec<_> = deltas
                .iter()
                .map(|(d, n)| DeltaContribution { delta: d, samples: *n, tau: 0 })
                .collect();
            let mut theta = theta0.clone();
            let out = aggregate(&mut theta, &contribs, f, lr, 0).unwrap();
            prop_assert_eq!(out.applied, deltas.len());
            let total: f64 = deltas.iter().map(|(_, n)| *n as f64).sum();
            for (k, &t) in theta.iter().enumerate() {
                let avg: f64 =
                    deltas.iter().map(|(d, n)| d[k] as f64 * *n as f64).sum::<f64>() / total;
                let expected = theta0[k] + lr * avg as f32;
                prop_assert!(close(t, expected), "{} vs {}", t, expected);
            }
        }

        #[test]
        fn fresh_equal_samples_give_the_plain_mean(
            (theta0, deltas) in arb_deltas(),
            f in arb_fn(),
            samples in 1u64..100,
        ) {
            let contribs: Vec<_> = deltas
                .iter()
                .map(|(d, _)| DeltaContribution { delta: d, samples, tau: 0 })
                .collect();
            let mut theta = theta0.clone();
            aggregate(&mut theta, &contribs, f, 1.0, 10).unwrap();
            for (k, &t) in theta.iter().enumerate() {
                let mean: f32 =
                    deltas.iter().map(|(d, _)| d[k]).sum::<f32>() / deltas.len() as f32;
                prop_assert!(close(t, theta0[k] + mean), "{} vs {}", t, theta0[k] + mean);
            }
        }

        #[test]
        fn weights_never_increase_with_staleness(
            f in arb_fn(),
            samples in 0u64..1000,
            tau in 0u64..1000,
            extra in 0u64..1000,
        ) {
            let w0 = f.weight(samples, tau);
            let w1 = f.weight(samples, tau + extra);
            prop_assert!(w1 <= w0, "w({}) = {} > w({}) = {}", tau + extra, w1, tau, w0);
            prop_assert!(f.discount(tau) > 0.0 && f.discount(tau) <= 1.0);
        }

        #[test]
        fn rebase_preserves_local_progress(
            (global, rows) in arb_deltas(),
        ) {
            let cut = &rows[0].0;
            let progress: Vec<f32> = rows.last().unwrap().0.clone();
            let now: Vec<f32> = cut.iter().zip(&progress).map(|(c, p)| c + p).collect();
            let mut theta = now.clone();
            let mut anchor = vec![0.0f32; global.len()];
            rebase(&mut theta, cut, &global, &mut anchor).unwrap();
            prop_assert_eq!(&anchor, &global);
            for k in 0..theta.len() {
                // The progress since the cut survives on top of the new global version.
                prop_assert!(close(theta[k] - anchor[k], now[k] - cut[k]));
                prop_assert!(close(theta[k], global[k] + progress[k]));
            }
        }

        #[test]
        fn coalesce_sums_and_keeps_the_oldest_base((_, cached) in arb_deltas()) {
            let (sum, base) = coalesce(&cached).unwrap();
            prop_assert_eq!(base, cached.iter().map(|(_, b)| *b).min().unwrap());
            for k in 0..sum.len() {
                let s: f32 = cached.iter().map(|(d, _)| d[k]).sum();
                prop_assert!(close(sum[k], s));
            }
        }
    }
}
