//! Early cuts: a layer's delta is cut before its scheduled phase when it has gone too long
//! without one (a hard staleness bound `T_ℓ`) or when its local progress turns away from the
//! direction of its last delta (a cosine drift trigger) — whichever comes first.
//!
//! * **Staleness bound** ([`crate::LayerSpec::max_stale_steps`]): at the end of a step, a
//!   layer whose last cut was `T_ℓ` or more steps ago is cut now. Under the plain schedule a
//!   layer is cut every `period_steps`, so the bound matters when `T_ℓ < period_steps`, and
//!   whenever a scheduled cut was deferred (a delta still in flight) or skipped: the layer is
//!   then cut at the first step end after the bound at which it can be, not a whole period
//!   later.
//! * **Drift trigger** ([`crate::ClientConfig::drift_cosine`]): with `c` set, a layer at least
//!   [`MIN_STEPS_FOR_DRIFT`] steps past its last cut whose progress since then, `θ − anchor`,
//!   has cosine `< c` with the last delta it sent is cut now: its trajectory has turned, and
//!   the aggregators should see it before the next phase. Keeps one copy of the last delta per
//!   layer (only when enabled).
//!
//! Neither trigger fires while the layer's fresh delta is in flight or a re-sync is pending
//! (such a cut would only be deferred).

/// Steps a layer must be past its last cut before the drift trigger looks at it (one step's
/// update alone is too noisy a direction).
pub const MIN_STEPS_FOR_DRIFT: u64 = 2;

/// Why a layer is cut at a step end.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CutReason {
    /// Its phase of the period.
    Scheduled,
    /// The hard staleness bound.
    Staleness,
    /// The drift trigger.
    Drift,
}

/// Cosine of `θ − anchor` with `last`; `None` when either has zero length (no direction).
pub fn progress_cosine(theta: &[f32], anchor: &[f32], last: &[f32]) -> Option<f64> {
    let (mut dot, mut pp, mut ll) = (0.0f64, 0.0f64, 0.0f64);
    for ((&t, &a), &d) in theta.iter().zip(anchor).zip(last) {
        let p = f64::from(t - a);
        let d = f64::from(d);
        dot += p * d;
        pp += p * p;
        ll += d * d;
    }
    if pp == 0.0 || ll == 0.0 || !dot.is_finite() {
        return None;
    }
    Some(dot / (pp.sqrt() * ll.sqrt()))
}

#[cfg(test)]
#[path = "early_sync_tests.rs"]
mod client_tests;

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn cosine_of_parallel_opposite_and_empty_progress() {
        let anchor = [1.0, 1.0];
        assert!((progress_cosine(&[2.0, 2.0], &anchor, &[3.0, 3.0]).unwrap() - 1.0).abs() < 1e-12);
        assert!((progress_cosine(&[0.0, 0.0], &anchor, &[3.0, 3.0]).unwrap() + 1.0).abs() < 1e-12);
        assert_eq!(progress_cosine(&anchor, &anchor, &[1.0, 0.0]), None);
        assert_eq!(progress_cosine(&[2.0, 0.0], &anchor, &[0.0, 0.0]), None);
    }

    proptest! {
        #[test]
        fn cosine_is_bounded_and_scale_free(
            xs in proptest::collection::vec((-10.0f32..10.0, -10.0f32..10.0), 1..32),
            k in 0.1f32..10.0,
        ) {
            let theta: Vec<f32> = xs.iter().map(|x| x.0).collect();
            let last: Vec<f32> = xs.iter().map(|x| x.1).collect();
            let anchor = vec![0.0; theta.len()];
            let scaled: Vec<f32> = last.iter().map(|d| d * k).collect();
            if let (Some(a), Some(b)) = (
                progress_cosine(&theta, &anchor, &last),
                progress_cosine(&theta, &anchor, &scaled),
            ) {
                prop_assert!((-1.0 - 1e-9..=1.0 + 1e-9).contains(&a));
                prop_assert!((a - b).abs() < 1e-4);
            }
        }
    }
}
