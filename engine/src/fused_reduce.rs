//! Streaming staleness-weighted averaging: the single-pass kernels an aggregator folds
//! deltas with as they arrive, instead of keeping every delta until a round closes and then
//! reading each one twice (once to validate, once to apply).
//!
//! `θ ← θ + η · Σ wᵢΔᵢ / Σ wᵢ` is computed as
//!
//! 1. on each arriving delta: `acc ← acc + wᵢΔᵢ` ([`accumulate_checked`]; the round's first
//!    delta writes `acc ← w₀Δ₀`), checking in the same pass that `Δᵢ` is finite and
//!    measuring `max |acc|`;
//! 2. when the round closes: `θ ← θ + c · acc` with `c = η / Σ wᵢ`, writing, in the same
//!    pass, the new values' little-endian bytes (a message payload). When `max |θ| +
//!    |c| · max |acc|` is far below `f32::MAX` no value can overflow, and [`apply_in_place`]
//!    updates `θ` in place; otherwise [`apply_checked`] writes into a second buffer and
//!    checks every result, and the caller swaps the buffers only if all are finite. Either
//!    way a non-finite value never reaches the model.
//!
//! Each delta is read exactly once. A delta found non-finite by [`accumulate_checked`] has
//! already been partly added; the caller rebuilds `acc` from the round's earlier deltas (a
//! rare path, bit-identical to never having added it since the additions are replayed in the
//! same order).
//!
//! The result equals [`crate::staleness::aggregate`]'s up to float rounding (the weights are
//! normalized once at the end instead of per delta); see the property test.

use multiversion::multiversion;

/// Compiles each kernel for the widest vector unit this crate knows (AVX-512, AVX2 + FMA,
/// NEON) besides the baseline, and picks one at run time on the first call (then one atomic
/// load per call). The default x86-64 target has only SSE2, which left the aggregator's
/// reduce at 0.41–0.58x of memcpy on an AVX-512 Xeon. The arithmetic is the same in every
/// version (Rust never contracts `a + b·c` into an FMA), so results are bit-identical.
macro_rules! simd_kernels {
    ($($(#[$meta:meta])* $vis:vis fn $($rest:tt)*)?) => {
        $($(#[$meta])*
        #[multiversion(targets(
            "x86_64+avx512f+avx512bw+avx512vl+avx2+fma",
            "x86_64+avx2+fma",
            "aarch64+neon"
        ))]
        $vis fn $($rest)*)?
    };
}

/// Values processed per inner iteration, i.e. independent accumulator chains per pass: on
/// x86-64 four AVX-512 (eight AVX2) registers per accumulator, so the adds and maxima of a
/// pass never wait on each other's latency (with 8, the AVX2 and AVX-512 versions ran at a
/// quarter of the baseline's speed: `cargo bench -p cpu-aggregator`); on other architectures
/// (NEON: 32 registers of 4 lanes) 16 keep every accumulator in registers.
#[cfg(target_arch = "x86_64")]
const LANES: usize = 64;
#[cfg(not(target_arch = "x86_64"))]
const LANES: usize = 16;

/// Values per block of the apply passes: 4 KiB, so a block just written is still in L1 when
/// it is appended to the byte output.
const BLOCK: usize = 1024;

/// A NaN or infinity found by a fused pass, with its index.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum FusedReduceError {
    /// The delta being folded in holds a NaN or infinity at `index`.
    #[error("delta value {index} is NaN or infinite")]
    NonFiniteDelta {
        /// First bad index.
        index: usize,
    },
    /// The averaged result overflowed at `index`.
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

/// Per-lane accumulators of a pass: a finiteness probe (`Σ x·0` is 0 for finite `x` and NaN
/// once any `x` was NaN or ±∞; branch-free, stays in vector registers) and `max |x|`.
#[derive(Clone, Copy)]
struct Lanes {
    probe: [f32; LANES],
    max_abs: [f32; LANES],
}

impl Lanes {
    fn new() -> Self {
        Lanes {
            probe: [0.0; LANES],
            max_abs: [0.0; LANES],
        }
    }
    #[inline(always)]
    fn all_finite(&self) -> bool {
        !self.probe.iter().any(|p| p.is_nan())
    }
    #[inline(always)]
    fn max_abs(&self) -> f32 {
        self.max_abs.iter().fold(0.0f32, |m, &x| m.max(x))
    }
}

/// `max(m, |x|)` written as the compare-and-select that maps to one vector `max`
/// instruction (`f32::max`'s NaN rules do not).
#[inline(always)]
fn max_of(m: f32, x: f32) -> f32 {
    let a = x.abs();
    if a > m {
        a
    } else {
        m
    }
}

simd_kernels! {
/// `max |x|` over `values` (infinite if any value is NaN or infinite).
pub fn max_abs(values: &[f32]) -> f32 {
    let mut lanes = Lanes::new();
    let mut chunks = values.chunks_exact(LANES);
    for c in &mut chunks {
        for i in 0..LANES {
            lanes.probe[i] += c[i] * 0.0;
            lanes.max_abs[i] = max_of(lanes.max_abs[i], c[i]);
        }
    }
    for &x in chunks.remainder() {
        lanes.probe[0] += x * 0.0;
        lanes.max_abs[0] = max_of(lanes.max_abs[0], x);
    }
    if lanes.all_finite() {
        lanes.max_abs()
    } else {
        f32::INFINITY
    }
}
}

/// The vector unit the kernels run on here: `avx512`, `avx2`, `neon` or `baseline`
/// (benchmarks print it beside their figures).
pub fn simd_target() -> &'static str {
    ["baseline", "neon", "avx2", "avx512"][usize::from(simd_level_of_kernels())]
}

simd_kernels! {
/// 3 AVX-512, 2 AVX2, 1 NEON, 0 baseline: the version the dispatcher picked.
fn simd_level_of_kernels() -> u8 {
    // `supports_feature_str` panics on a feature another architecture names: ask only ours.
    let t = multiversion::target::selected_target!();
    if cfg!(target_arch = "x86_64") {
        if t.supports_feature_str("avx512f") {
            3
        } else if t.supports_feature_str("avx2") {
            2
        } else {
            0
        }
    } else if cfg!(target_arch = "aarch64") && t.supports_feature_str("neon") {
        1
    } else {
        0
    }
}
}

/// `acc ← w·Δ` (when `first`) or `acc ← acc + w·Δ`, checking `Δ` is finite in the same pass.
/// Returns `max |acc|` afterwards (infinite if the sum itself overflowed). On `Err`, `acc`
/// holds a partial sum: rebuild it from the earlier deltas.
pub fn accumulate_checked(
    acc: &mut [f32],
    delta: &[f32],
    weight: f32,
    first: bool,
) -> Result<f32, FusedReduceError> {
    check_len("delta", acc.len(), delta.len())?;
    let (delta_lanes, acc_lanes) = if first {
        accumulate_lanes::<true>(acc, delta, weight)
    } else {
        accumulate_lanes::<false>(acc, delta, weight)
    };
    if !delta_lanes.all_finite() {
        return Err(FusedReduceError::NonFiniteDelta {
            index: first_bad(delta),
        });
    }
    Ok(if acc_lanes.all_finite() {
        acc_lanes.max_abs()
    } else {
        f32::INFINITY
    })
}

simd_kernels! {
/// The body of [`accumulate_checked`]; `FIRST` overwrites instead of adding.
fn accumulate_lanes<const FIRST: bool>(
    acc: &mut [f32],
    delta: &[f32],
    weight: f32,
) -> (Lanes, Lanes) {
    let (mut delta_lanes, mut acc_lanes) = (Lanes::new(), Lanes::new());
    let step = |a: f32, d: f32| if FIRST { weight * d } else { a + weight * d };
    let mut a_chunks = acc.chunks_exact_mut(LANES);
    let mut d_chunks = delta.chunks_exact(LANES);
    for (a, d) in (&mut a_chunks).zip(&mut d_chunks) {
        for i in 0..LANES {
            delta_lanes.probe[i] += d[i] * 0.0;
            let v = step(a[i], d[i]);
            acc_lanes.probe[i] += v * 0.0;
            acc_lanes.max_abs[i] = max_of(acc_lanes.max_abs[i], v);
            a[i] = v;
        }
    }
    for (a, &d) in a_chunks
        .into_remainder()
        .iter_mut()
        .zip(d_chunks.remainder())
    {
        delta_lanes.probe[0] += d * 0.0;
        let v = step(*a, d);
        acc_lanes.probe[0] += v * 0.0;
        acc_lanes.max_abs[0] = max_of(acc_lanes.max_abs[0], v);
        *a = v;
    }
    (delta_lanes, acc_lanes)
}
}

/// Whether `θ + scale · acc` cannot overflow, given `max |θ|` and `max |acc|`: the bound is
/// kept under half of `f32::MAX`, far beyond any rounding of the two operations.
pub fn in_place_is_safe(theta_max_abs: f32, acc_max_abs: f32, scale: f32) -> bool {
    let bound = f64::from(theta_max_abs) + f64::from(scale.abs()) * f64::from(acc_max_abs);
    bound.is_finite() && bound <= f64::from(f32::MAX) / 2.0
}

/// `θ ← θ + scale · acc` in place, appending the new values' little-endian bytes to
/// `le_bytes_out` when given. Returns the new `max |θ|`. Call it only when
/// [`in_place_is_safe`] holds (no value can become non-finite); otherwise use
/// [`apply_checked`].
pub fn apply_in_place(
    theta: &mut [f32],
    acc: &[f32],
    scale: f32,
    le_bytes_out: Option<&mut Vec<u8>>,
) -> Result<f32, FusedReduceError> {
    check_len("accumulator", theta.len(), acc.len())?;
    let mut sink = le_bytes_out;
    if let Some(bytes) = sink.as_deref_mut() {
        bytes.reserve(theta.len() * 4);
    }
    let mut max = 0.0f32;
    for (t, a) in theta.chunks_mut(BLOCK).zip(acc.chunks(BLOCK)) {
        max = max.max(add_scaled_block(t, a, scale));
        if let Some(bytes) = sink.as_deref_mut() {
            // The block was just written: this read hits L1.
            append_le_bytes(bytes, t);
        }
    }
    Ok(max)
}

simd_kernels! {
/// `t ← t + scale · a` over one block; returns `max |t|` (per-lane maxima in locals, so they
/// live in registers).
fn add_scaled_block(t: &mut [f32], a: &[f32], scale: f32) -> f32 {
    let mut m = [0.0f32; LANES];
    let whole = t.len() / LANES * LANES;
    for (tc, ac) in t[..whole]
        .chunks_exact_mut(LANES)
        .zip(a[..whole].chunks_exact(LANES))
    {
        for i in 0..LANES {
            let v = tc[i] + scale * ac[i];
            m[i] = max_of(m[i], v);
            tc[i] = v;
        }
    }
    for i in whole..t.len() {
        let v = t[i] + scale * a[i];
        m[0] = max_of(m[0], v);
        t[i] = v;
    }
    m.iter().fold(0.0f32, |x, &y| x.max(y))
}
}

/// `θ' ← θ + scale · acc` into `theta_out` (`θ` is only read), appending the new values'
/// little-endian bytes to `le_bytes_out` when given, and checking every result is finite.
/// Returns `max |θ'|`. On `Err` the caller discards `theta_out` (and the bytes).
pub fn apply_checked(
    theta: &[f32],
    acc: &[f32],
    scale: f32,
    theta_out: &mut [f32],
    le_bytes_out: Option<&mut Vec<u8>>,
) -> Result<f32, FusedReduceError> {
    let n = theta.len();
    check_len("output", n, theta_out.len())?;
    check_len("accumulator", n, acc.len())?;
    let mut sink = le_bytes_out;
    if let Some(bytes) = sink.as_deref_mut() {
        bytes.reserve(n * 4);
    }
    let mut lanes = Lanes::new();
    for ((t, a), o) in theta
        .chunks(BLOCK)
        .zip(acc.chunks(BLOCK))
        .zip(theta_out.chunks_mut(BLOCK))
    {
        add_scaled_checked_block(t, a, scale, o, &mut lanes);
        if let Some(bytes) = sink.as_deref_mut() {
            append_le_bytes(bytes, o);
        }
    }
    if !lanes.all_finite() {
        return Err(FusedReduceError::NonFiniteResult {
            index: first_bad(theta_out),
        });
    }
    Ok(lanes.max_abs())
}

simd_kernels! {
/// `o ← t + scale · a` over one block, folding the results into `lanes`.
fn add_scaled_checked_block(t: &[f32], a: &[f32], scale: f32, o: &mut [f32], lanes: &mut Lanes) {
    for (i, ((&t, &a), o)) in t.iter().zip(a).zip(o.iter_mut()).enumerate() {
        let v = t + scale * a;
        lanes.probe[i % LANES] += v * 0.0;
        lanes.max_abs[i % LANES] = max_of(lanes.max_abs[i % LANES], v);
        *o = v;
    }
}
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

    #[test]
    fn the_dispatcher_names_the_vector_unit_it_picked_without_panicking() {
        let t = simd_target();
        assert!(["baseline", "neon", "avx2", "avx512"].contains(&t), "{t}");
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") {
            assert_ne!(t, "baseline", "an AVX2 machine runs a vector version");
        }
    }
    use crate::staleness::{aggregate, DeltaContribution, StalenessFn};
    use proptest::prelude::*;

    fn from_le(bytes: &[u8]) -> Vec<f32> {
        bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect()
    }

    /// The streaming kernels over a whole round, as an aggregator drives them; both apply
    /// paths must give the same bits.
    fn streamed(theta: &[f32], deltas: &[(Vec<f32>, f32)], eta: f32) -> Vec<f32> {
        let total: f64 = deltas.iter().map(|(_, w)| f64::from(*w)).sum();
        let scale = (f64::from(eta) / total) as f32;
        let mut acc = vec![0.0; theta.len()];
        let mut acc_max = 0.0;
        for (i, (d, w)) in deltas.iter().enumerate() {
            acc_max = accumulate_checked(&mut acc, d, *w, i == 0).expect("finite");
        }
        assert_eq!(acc_max, max_abs(&acc));
        assert!(in_place_is_safe(max_abs(theta), acc_max, scale));
        let mut out = vec![0.0; theta.len()];
        let mut bytes = Vec::new();
        let max_checked =
            apply_checked(theta, &acc, scale, &mut out, Some(&mut bytes)).expect("finite");
        assert_eq!(out, from_le(&bytes));
        let mut in_place = theta.to_vec();
        let mut bytes = Vec::new();
        let max_in_place =
            apply_in_place(&mut in_place, &acc, scale, Some(&mut bytes)).expect("lengths");
        assert_eq!(in_place, from_le(&bytes));
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&in_place), bits(&out));
        assert_eq!(max_checked, max_in_place);
        assert_eq!(max_checked, max_abs(&out));
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
    fn a_bad_delta_is_found_with_its_index() {
        let mut acc = vec![0.0; 40];
        let mut d = vec![0.5; 40];
        d[33] = f32::NAN;
        assert_eq!(
            accumulate_checked(&mut acc, &d, 1.0, true),
            Err(FusedReduceError::NonFiniteDelta { index: 33 })
        );
        d[33] = 0.5;
        d[38] = f32::INFINITY; // in the remainder after the 16-lane chunks
        assert_eq!(
            accumulate_checked(&mut acc, &d, 1.0, false),
            Err(FusedReduceError::NonFiniteDelta { index: 38 })
        );
    }

    #[test]
    fn an_overflow_is_refused_by_the_bound_and_by_the_checked_pass() {
        let theta = vec![f32::MAX; 20];
        let mut acc = vec![0.0; 20];
        let acc_max = accumulate_checked(&mut acc, &[f32::MAX; 20], 1.0, true).unwrap();
        assert_eq!(acc_max, f32::MAX);
        assert!(!in_place_is_safe(max_abs(&theta), acc_max, 1.0));
        let mut out = vec![0.0; 20];
        assert_eq!(
            apply_checked(&theta, &acc, 1.0, &mut out, None),
            Err(FusedReduceError::NonFiniteResult { index: 0 })
        );
        // A sum of finite deltas that overflows reports an infinite maximum.
        let again = accumulate_checked(&mut acc, &[f32::MAX; 20], 1.0, false).unwrap();
        assert_eq!(again, f32::INFINITY);
        assert!(!in_place_is_safe(0.0, again, 1e-30));
        assert_eq!(max_abs(&[1.0, -3.0, f32::NAN]), f32::INFINITY);
    }

    #[test]
    fn lengths_are_checked_before_anything_is_written() {
        let mut acc = vec![7.0; 3];
        assert!(matches!(
            accumulate_checked(&mut acc, &[1.0; 4], 1.0, true),
            Err(FusedReduceError::LengthMismatch { .. })
        ));
        assert_eq!(acc, [7.0; 3]);
        let mut theta = vec![1.0; 3];
        assert!(apply_in_place(&mut theta, &[1.0; 4], 1.0, None).is_err());
        assert_eq!(theta, [1.0; 3]);
    }

    proptest! {
        #[test]
        fn streaming_equals_aggregate_up_to_rounding(
            len in 1usize..2100,
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
