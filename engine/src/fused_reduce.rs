//! Streaming staleness-weighted averaging: the single-pass kernels an aggregator folds
//! deltas with as they arrive, instead of keeping every delta until a round closes and then
//! reading each one twice (once to validate, once to apply).
//!
//! `θ ← θ + η · Σ wᵢΔᵢ / Σ wᵢ` is computed as
//!
//! 1. on each arriving delta (but the last of a round): `acc ← acc + wᵢΔᵢ`
//!    ([`accumulate_checked`]; the round's first delta writes `acc ← w₀Δ₀`), checking in the
//!    same pass that `Δᵢ` is finite;
//! 2. when the round closes: `θ' ← θ + c · (acc + w_lastΔ_last)` with `c = η / Σ wᵢ`
//!    ([`apply_checked`]), written to a *second* buffer (and optionally, in the same pass, to
//!    a copy such as the broadcast payload), checking that the last delta and every result
//!    are finite. The caller swaps `θ` and `θ'` only when the pass succeeded, so a bad delta
//!    or an overflowing result never touches the model.
//!
//! Each delta is read exactly once. A delta found non-finite by [`accumulate_checked`] has
//! already been partly added; the caller rebuilds `acc` from the round's earlier deltas (a
//! rare path, bit-identical to never having added it since the additions are replayed in the
//! same order).
//!
//! The result equals [`crate::staleness::aggregate`]'s up to float rounding (the weights are
//! normalized once at the end instead of per delta); see the property test.

/// Values processed per inner iteration; a multiple of every x86/ARM vector width, so the
/// lane loops below compile to straight vector code.
const LANES: usize = 16;

/// A NaN or infinity found by a fused pass, with its index.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum FusedReduceError {
    /// The delta being folded in holds a NaN or infinity at `index`.
    #[error("delta value {index} is NaN or infinite")]
    NonFiniteDelta {
        /// First bad index.
        index: usize,
    },
    /// The averaged result overflowed (or the model already held a non-finite value) at
    /// `index`.
    #[error("averaged value {index} is NaN or infinite (overflow)")]
    NonFiniteResult {
        /// First bad index.
        index: usize,
    },
    /// Two slices that must have the same length do not.
    #[error("length mismatch: {what} has {got} values, expected {expected}")]
    LengthMismatch {
        /// Which argument.
        what: &'static str,
        /// Expected length.
        expected: usize,
        /// Actual length.
        got: usize,
    },
}

fn check_len(what: &'static str, expected: usize, got: usize) -> Result<(), FusedReduceError> {
    if expected == got {
        Ok(())
    } else {
        Err(FusedReduceError::LengthMismatch {
            what,
            expected,
            got,
        })
    }
}

fn first_bad(values: &[f32]) -> usize {
    values
        .iter()
        .position(|v| !v.is_finite())
        .unwrap_or(values.len())
}

/// `acc ← w·Δ` (when `first`) or `acc ← acc + w·Δ`, and checks `Δ` is finite in the same
/// pass. On `Err`, `acc` holds a partial sum: rebuild it from the earlier deltas.
pub fn accumulate_checked(
    acc: &mut [f32],
    delta: &[f32],
    weight: f32,
    first: bool,
) -> Result<(), FusedReduceError> {
    check_len("delta", acc.len(), delta.len())?;
    // `x · 0` is 0 for a finite `x` and NaN for NaN or ±∞: summing it per lane is a
    // branch-free finiteness check that stays in vector registers.
    let mut probe = [0.0f32; LANES];
    let mut a_chunks = acc.chunks_exact_mut(LANES);
    let mut d_chunks = delta.chunks_exact(LANES);
    if first {
        for (a, d) in (&mut a_chunks).zip(&mut d_chunks) {
            for i in 0..LANES {
                probe[i] += d[i] * 0.0;
                a[i] = weight * d[i];
            }
        }
    } else {
        for (a, d) in (&mut a_chunks).zip(&mut d_chunks) {
            for i in 0..LANES {
                probe[i] += d[i] * 0.0;
                a[i] += weight * d[i];
            }
        }
    }
    for (a, &d) in a_chunks
        .into_remainder()
        .iter_mut()
        .zip(d_chunks.remainder())
    {
        probe[0] += d * 0.0;
        *a = if first { weight * d } else { *a + weight * d };
    }
    if probe.iter().any(|p| p.is_nan()) {
        return Err(FusedReduceError::NonFiniteDelta {
            index: first_bad(delta),
        });
    }
    Ok(())
}

/// The pending sum a round closes with: an accumulator of the earlier deltas and/or the
/// last delta with its weight.
#[derive(Clone, Copy, Debug)]
pub struct RoundSum<'a> {
    /// `Σ wᵢΔᵢ` of the round's earlier deltas, if there were any.
    pub acc: Option<&'a [f32]>,
    /// The delta that closes the round and its weight (checked finite by the pass), if the
    /// round closes on an arrival rather than a timeout.
    pub last: Option<(&'a [f32], f32)>,
}

/// `θ' ← θ + scale · (acc + w·Δ_last)` into `theta_out`, checking that `Δ_last` and every
/// result value are finite; with `le_bytes_out`, the result's little-endian bytes are also
/// appended to it (a message payload made in the same pass, no zero-fill). `θ` is only read.
/// With neither `acc` nor `last`, `θ'` is a copy of `θ`.
pub fn apply_checked(
    theta: &[f32],
    sum: RoundSum<'_>,
    scale: f32,
    theta_out: &mut [f32],
    le_bytes_out: Option<&mut Vec<u8>>,
) -> Result<(), FusedReduceError> {
    let n = theta.len();
    check_len("output", n, theta_out.len())?;
    if let Some(acc) = sum.acc {
        check_len("accumulator", n, acc.len())?;
    }
    if let Some((d, _)) = sum.last {
        check_len("delta", n, d.len())?;
    }
    // Absent inputs are stood in for by `theta` and compiled out by the const parameters.
    let acc = sum.acc.unwrap_or(theta);
    let (delta, weight) = sum.last.unwrap_or((theta, 0.0));
    let mut probe = Probes::default();
    let mut sink = le_bytes_out;
    if let Some(bytes) = sink.as_deref_mut() {
        bytes.reserve(n * 4);
    }
    for start in (0..n).step_by(BLOCK) {
        let r = start..(start + BLOCK).min(n);
        let (t, a, d, o) = (
            &theta[r.clone()],
            &acc[r.clone()],
            &delta[r.clone()],
            &mut theta_out[r],
        );
        match (sum.acc.is_some(), sum.last.is_some()) {
            (true, true) => apply_block::<true, true>(t, a, d, weight, scale, o, &mut probe),
            (true, false) => apply_block::<true, false>(t, a, d, weight, scale, o, &mut probe),
            (false, true) => apply_block::<false, true>(t, a, d, weight, scale, o, &mut probe),
            (false, false) => apply_block::<false, false>(t, a, d, weight, scale, o, &mut probe),
        }
        if let Some(bytes) = sink.as_deref_mut() {
            // The block was just written: this read hits L1.
            append_le_bytes(bytes, o);
        }
    }
    if probe.delta.is_nan() {
        let d = sum.last.map_or(&[][..], |(d, _)| d);
        return Err(FusedReduceError::NonFiniteDelta {
            index: first_bad(d),
        });
    }
    if probe.result.is_nan() {
        return Err(FusedReduceError::NonFiniteResult {
            index: first_bad(theta_out),
        });
    }
    Ok(())
}

/// Values per block of [`apply_checked`]: 4 KiB, so a block written to `theta_out` is still in
/// L1 when it is appended to the byte output.
const BLOCK: usize = 1024;

/// Finiteness probes of a pass: sums of `x · 0`, NaN once any `x` was NaN or infinite.
#[derive(Default)]
struct Probes {
    delta: f32,
    result: f32,
}

/// One block of [`apply_checked`] for one combination of inputs (`acc`/`delta` are dummies
/// when their const flag is off). All slices have the block's length.
fn apply_block<const ACC: bool, const LAST: bool>(
    theta: &[f32],
    acc: &[f32],
    delta: &[f32],
    weight: f32,
    scale: f32,
    out: &mut [f32],
    probes: &mut Probes,
) {
    let value = |t: f32, a: f32, d: f32| {
        let mut s = 0.0;
        if ACC {
            s = a;
        }
        if LAST {
            s += weight * d;
        }
        t + scale * s
    };
    let (mut delta_probe, mut result_probe) = ([0.0f32; LANES], [0.0f32; LANES]);
    let whole = theta.len() / LANES * LANES;
    for (((t, a), d), o) in theta[..whole]
        .chunks_exact(LANES)
        .zip(acc[..whole].chunks_exact(LANES))
        .zip(delta[..whole].chunks_exact(LANES))
        .zip(out[..whole].chunks_exact_mut(LANES))
    {
        for i in 0..LANES {
            if LAST {
                delta_probe[i] += d[i] * 0.0;
            }
            let v = value(t[i], a[i], d[i]);
            result_probe[i] += v * 0.0;
            o[i] = v;
        }
    }
    for i in whole..theta.len() {
        if LAST {
            delta_probe[0] += delta[i] * 0.0;
        }
        let v = value(theta[i], acc[i], delta[i]);
        result_probe[0] += v * 0.0;
        out[i] = v;
    }
    probes.delta += delta_probe.iter().sum::<f32>();
    probes.result += result_probe.iter().sum::<f32>();
}

/// Appends `values` as little-endian f32 bytes.
fn append_le_bytes(bytes: &mut Vec<u8>, values: &[f32]) {
    if cfg!(target_endian = "little") {
        bytes.extend_from_slice(bytemuck::cast_slice(values));
    } else {
        for v in values {
            bytes.extend_from_slice(&v.to_le_bytes());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::staleness::{aggregate, DeltaContribution, StalenessFn};
    use proptest::prelude::*;

    /// The streaming kernels over a whole round, as an aggregator drives them.
    fn streamed(theta: &[f32], deltas: &[(Vec<f32>, f32)], eta: f32) -> Vec<f32> {
        let total: f64 = deltas.iter().map(|(_, w)| f64::from(*w)).sum();
        let scale = (f64::from(eta) / total) as f32;
        let mut acc = vec![0.0; theta.len()];
        let (last, earlier) = deltas.split_last().expect("a delta");
        for (i, (d, w)) in earlier.iter().enumerate() {
            accumulate_checked(&mut acc, d, *w, i == 0).expect("finite");
        }
        let mut out = vec![0.0; theta.len()];
        let mut bytes = Vec::new();
        let sum = RoundSum {
            acc: (!earlier.is_empty()).then_some(&acc[..]),
            last: Some((&last.0, last.1)),
        };
        apply_checked(theta, sum, scale, &mut out, Some(&mut bytes)).expect("finite");
        let copy: Vec<f32> = bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        assert_eq!(out, copy);
        out
    }

    #[test]
    fn a_round_by_hand() {
        // θ = 1, Δ = (2, 4) with weights (1, 3), η = 1: θ + (2 + 12)/4 = 4.5.
        let theta = vec![1.0; 37];
        let out = streamed(&theta, &[(vec![2.0; 37], 1.0), (vec![4.0; 37], 3.0)], 1.0);
        assert_eq!(out, vec![4.5; 37]);
    }

    #[test]
    fn a_bad_delta_is_found_with_its_index_and_theta_is_untouched() {
        let theta = vec![1.0; 40];
        let mut acc = vec![0.0; 40];
        let mut d = vec![0.5; 40];
        d[33] = f32::NAN;
        assert_eq!(
            accumulate_checked(&mut acc, &d, 1.0, true),
            Err(FusedReduceError::NonFiniteDelta { index: 33 })
        );
        d[33] = 0.5;
        d[38] = f32::INFINITY; // in the remainder after the 16-lane chunks
        let mut out = vec![0.0; 40];
        let sum = RoundSum {
            acc: None,
            last: Some((&d, 1.0)),
        };
        assert_eq!(
            apply_checked(&theta, sum, 1.0, &mut out, None),
            Err(FusedReduceError::NonFiniteDelta { index: 38 })
        );
        assert_eq!(theta, vec![1.0; 40]);
    }

    #[test]
    fn an_overflowing_result_is_refused() {
        let theta = vec![f32::MAX; 20];
        let d = vec![f32::MAX; 20];
        let mut out = vec![0.0; 20];
        let sum = RoundSum {
            acc: None,
            last: Some((&d, 1.0)),
        };
        assert_eq!(
            apply_checked(&theta, sum, 1.0, &mut out, None),
            Err(FusedReduceError::NonFiniteResult { index: 0 })
        );
    }

    #[test]
    fn lengths_are_checked_before_anything_is_written() {
        let mut acc = vec![7.0; 3];
        assert!(matches!(
            accumulate_checked(&mut acc, &[1.0; 4], 1.0, true),
            Err(FusedReduceError::LengthMismatch { .. })
        ));
        assert_eq!(acc, [7.0; 3]);
    }

    proptest! {
        #[test]
        fn streaming_equals_aggregate_up_to_rounding(
            len in 1usize..70,
            seed in any::<u64>(),
            n in 1usize..6,
            eta in 0.1f32..2.0,
        ) {
            let mut rng = seed;
            let mut next = move || {
                rng = rng.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((rng >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            };
            let theta: Vec<f32> = (0..len).map(|_| next()).collect();
            let f = StalenessFn::default();
            let raw: Vec<(Vec<f32>, u64, u64)> = (0..n)
                .map(|i| ((0..len).map(|_| next()).collect(), 1 + (i as u64 * 7) % 40, i as u64 % 4))
                .collect();
            let weighted: Vec<(Vec<f32>, f32)> = raw
                .iter()
                .map(|(d, s, tau)| (d.clone(), f.weight(*s, *tau) as f32))
                .collect();
            let got = streamed(&theta, &weighted, eta);
            let mut want = theta.clone();
            let contributions: Vec<DeltaContribution<'_>> = raw
                .iter()
                .map(|(d, s, tau)| DeltaContribution { delta: d.as_slice(), samples: *s, tau: *tau })
                .collect();
            aggregate(&mut want, &contributions, f, eta, 8).expect("aggregate");
            for (g, w) in got.iter().zip(&want) {
                prop_assert!((g - w).abs() <= 1e-5 * (1.0 + w.abs()), "{g} vs {w}");
            }
        }
    }
}
