//! The low-rank layout of [`Codec::LowRank`]: a PowerSGD-style compression of a tensor into two
//! thin factors `P` (rows × r) and `Q` (cols × r) with `M ≈ P·Qᵀ`.
//!
//! The flat values are read as a `rows × cols` matrix, row-major, zero-padded to
//! `rows · cols ≥ len` (`rows` chosen as `⌈√len⌉` unless the codec names it). The encoder runs
//! one step of subspace iteration from a pseudo-random `Q₀` (seeded by the values, so an
//! encoding is reproducible and successive deltas get different subspaces): `P = M·Q₀`, `P` orthonormalized column by column (modified
//! Gram–Schmidt), `Q = Mᵀ·P`; then `P·Qᵀ` is the projection of `M` onto the span of `P` — the
//! rank-r compression of PowerSGD (Vogels et al., NeurIPS 2019, Algorithm 1 with one power
//! iteration). PowerSGD's error feedback is the sender's: a sync client advances its anchor by
//! the *decoded* values, so what the factors miss stays in `θ − anchor` and goes out with the
//! next delta.
//!
//! Bytes: `r · (rows + cols)` little-endian f32, `P` row-major then `Q` row-major. Decoding
//! treats the input as hostile: the element count is checked against the caller's limit and
//! the byte length exactly before anything is allocated.

use crate::error::CodecError;

/// Rows and columns of the matrix view of `len` values with `rows` rows (`0`: `⌈√len⌉`).
pub fn matrix_dims(len: u64, rows: u32) -> (u64, u64) {
    let rows = if rows == 0 {
        (len as f64).sqrt().ceil().max(1.0) as u64
    } else {
        u64::from(rows)
    };
    (rows, len.div_ceil(rows.max(1)).max(1))
}

/// The rank actually used: at most `min(rows, cols)`, at least 1.
pub fn effective_rank(rank: u32, rows: u64, cols: u64) -> u64 {
    u64::from(rank).clamp(1, rows.min(cols).max(1))
}

/// Bytes of the factors of a `rows × cols` matrix at rank `rank`. `None` on overflow.
pub fn encoded_len(rows: u64, cols: u64, rank: u64) -> Option<u64> {
    rows.checked_add(cols)?.checked_mul(rank)?.checked_mul(4)
}

/// A deterministic value in `[-1, 1)` for position `i` (xorshift of a shape-derived seed).
fn pseudo_random(seed: u64, i: u64) -> f32 {
    let mut x = seed ^ i.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    x ^= x >> 33;
    x = x.wrapping_mul(0xFF51_AFD7_ED55_8CCD);
    x ^= x >> 33;
    x = x.wrapping_mul(0xC4CE_B9FE_1A85_EC53);
    x ^= x >> 33;
    ((x >> 40) as f32 / (1u64 << 23) as f32) - 1.0
}

/// Calls `f(i, j, m)` for every non-zero element `m = at(i, j)` of a `rows × cols` matrix, row
/// by row (both products of the encoder skip the zero padding and zero deltas this way).
fn for_each_nonzero(
    rows: usize,
    cols: usize,
    at: &dyn Fn(usize, usize) -> f32,
    mut f: impl FnMut(usize, usize, f32),
) {
    for i in 0..rows {
        for j in 0..cols {
            let m = at(i, j);
            if m != 0.0 {
                f(i, j, m);
            }
        }
    }
}

/// Factors `values` (see the module doc); returns `(rows, rank, bytes)`.
pub fn encode(values: &[f32], rows: u32, rank: u32) -> (u32, u32, Vec<u8>) {
    let len = values.len() as u64;
    let (rows, cols) = matrix_dims(len, rows);
    let r = effective_rank(rank, rows, cols) as usize;
    let (rows_n, cols_n) = (rows as usize, cols as usize);
    let at = |i: usize, j: usize| values.get(i * cols_n + j).copied().unwrap_or(0.0);
    // Q₀ is drawn afresh for every tensor (seeded by its bits): with the sender's error
    // feedback, successive deltas are projected on different random subspaces, so no
    // direction is missed forever (PowerSGD reuses the last Q instead, which needs state).
    let seed = values
        .iter()
        .fold(len.wrapping_mul(31).wrapping_add(rows), |h, v| {
            (h ^ u64::from(v.to_bits())).wrapping_mul(0x0100_0000_01B3)
        });
    // P = M · Q0.
    let q0: Vec<f32> = (0..cols_n * r)
        .map(|i| pseudo_random(seed, i as u64))
        .collect();
    let mut p = vec![0.0f32; rows_n * r];
    for_each_nonzero(rows_n, cols_n, &at, |i, j, m| {
        for k in 0..r {
            p[i * r + k] += m * q0[j * r + k];
        }
    });
    // Orthonormalize P's columns (modified Gram–Schmidt; a column that (nearly) vanishes
    // against the earlier ones adds no direction and is zeroed, keeping P·Pᵀ a projection).
    for k in 0..r {
        let before: f64 = (0..rows_n)
            .map(|i| f64::from(p[i * r + k]).powi(2))
            .sum::<f64>()
            .sqrt();
        for prev in 0..k {
            let dot: f64 = (0..rows_n)
                .map(|i| f64::from(p[i * r + k]) * f64::from(p[i * r + prev]))
                .sum();
            for i in 0..rows_n {
                p[i * r + k] -= (dot as f32) * p[i * r + prev];
            }
        }
        let norm: f64 = (0..rows_n)
            .map(|i| f64::from(p[i * r + k]).powi(2))
            .sum::<f64>()
            .sqrt();
        let scale = if norm > 1e-30 && norm > 1e-3 * before {
            (1.0 / norm) as f32
        } else {
            0.0
        };
        for i in 0..rows_n {
            p[i * r + k] *= scale;
        }
    }
    // Q = Mᵀ · P.
    let mut q = vec![0.0f32; cols_n * r];
    for_each_nonzero(rows_n, cols_n, &at, |i, j, m| {
        for k in 0..r {
            q[j * r + k] += m * p[i * r + k];
        }
    });
    let mut bytes = Vec::with_capacity((p.len() + q.len()) * 4);
    for v in p.iter().chain(&q) {
        bytes.extend_from_slice(&v.to_le_bytes());
    }
    (rows as u32, r as u32, bytes)
}

/// Decodes the factors of `len` values (`rows`, `rank` from the codec). The caller has checked
/// `len` against its limit.
pub fn decode(bytes: &[u8], rows: u32, rank: u32, len: u64) -> Result<Vec<f32>, CodecError> {
    if rows == 0 || rank == 0 {
        return Err(CodecError::BadLowRank {
            rows,
            rank,
            len,
            why: "rows and rank must be at least 1",
        });
    }
    let (rows, cols) = matrix_dims(len, rows);
    if u64::from(rank) > rows.min(cols) {
        return Err(CodecError::BadLowRank {
            rows: rows as u32,
            rank,
            len,
            why: "the rank exceeds the smaller side of the matrix",
        });
    }
    if rows > len.max(1) {
        return Err(CodecError::BadLowRank {
            rows: rows as u32,
            rank,
            len,
            why: "more rows than elements",
        });
    }
    let expected = encoded_len(rows, cols, u64::from(rank)).ok_or(CodecError::TooManyElements {
        len,
        max: u64::MAX / 4,
    })?;
    if expected != bytes.len() as u64 {
        return Err(CodecError::LengthMismatch {
            codec: crate::message::Codec::LowRank {
                rows: rows as u32,
                rank,
            },
            expected,
            actual: bytes.len() as u64,
        });
    }
    let floats: Vec<f32> = bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    let r = rank as usize;
    let (rows_n, cols_n) = (rows as usize, cols as usize);
    let (p, q) = floats.split_at(rows_n * r);
    let mut out = Vec::with_capacity(len as usize);
    'rows: for i in 0..rows_n {
        for j in 0..cols_n {
            if out.len() as u64 == len {
                break 'rows;
            }
            let mut v = 0.0f32;
            for k in 0..r {
                v += p[i * r + k] * q[j * r + k];
            }
            out.push(v);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn an_exact_low_rank_matrix_round_trips() {
        // 6 × 5, rank 2: u₁v₁ᵀ + u₂v₂ᵀ.
        let (u1, v1) = (
            [1.0f32, 2.0, -1.0, 0.5, 3.0, 1.0],
            [1.0f32, 0.0, 2.0, -1.0, 1.0],
        );
        let (u2, v2) = (
            [0.0f32, 1.0, 1.0, -2.0, 0.0, 1.0],
            [0.5f32, 1.0, 0.0, 1.0, -1.0],
        );
        let m: Vec<f32> = (0..6)
            .flat_map(|i| (0..5).map(move |j| u1[i] * v1[j] + u2[i] * v2[j]))
            .collect();
        let (rows, rank, bytes) = encode(&m, 6, 2);
        assert_eq!((rows, rank), (6, 2));
        assert_eq!(bytes.len(), 4 * 2 * (6 + 5));
        let back = decode(&bytes, rows, rank, m.len() as u64).unwrap();
        for (a, b) in m.iter().zip(&back) {
            assert!((a - b).abs() < 1e-4, "{a} vs {b}");
        }
    }

    #[test]
    fn hostile_factors_are_typed_errors() {
        assert!(matches!(
            decode(&[0; 8], 0, 1, 4),
            Err(CodecError::BadLowRank { .. })
        ));
        assert!(matches!(
            decode(&[0; 8], 2, 9, 4),
            Err(CodecError::BadLowRank { .. })
        ));
        assert!(matches!(
            decode(&[0; 8], 100, 1, 4),
            Err(CodecError::BadLowRank { .. })
        ));
        assert!(matches!(
            decode(&[0; 7], 2, 1, 4),
            Err(CodecError::LengthMismatch { .. })
        ));
    }

    proptest! {
        #[test]
        fn the_reconstruction_never_grows_the_tensor_and_projects_orthogonally(
            values in proptest::collection::vec(-10.0f32..10.0, 1..300),
            rank in 1u32..6,
        ) {
            // P·Qᵀ = P·Pᵀ·M is an orthogonal projection: ‖P·Qᵀ‖ ≤ ‖M‖ and the residual is
            // orthogonal to the reconstruction (up to rounding).
            let (rows, r, bytes) = encode(&values, 0, rank);
            let back = decode(&bytes, rows, r, values.len() as u64).unwrap();
            prop_assert_eq!(back.len(), values.len());
            let norm = |v: &[f32]| v.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>().sqrt();
            prop_assert!(norm(&back) <= norm(&values) * (1.0 + 1e-3) + 1e-3);
            // Orthogonality holds on the whole matrix; with zero padding the decoder drops the
            // padded cells, so it is checked when there are none.
            let (m_rows, m_cols) = matrix_dims(values.len() as u64, 0);
            if m_rows * m_cols == values.len() as u64 {
                let dot: f64 = back
                    .iter()
                    .zip(&values)
                    .map(|(b, v)| f64::from(*b) * f64::from(v - b))
                    .sum();
                prop_assert!(dot.abs() <= 1e-2 * (1.0 + norm(&values).powi(2)), "{}", dot);
            }
        }

        #[test]
        fn decoding_arbitrary_bytes_never_panics(
            bytes in proptest::collection::vec(any::<u8>(), 0..256),
            rows in 0u32..40,
            rank in 0u32..8,
            len in 0u64..500,
        ) {
            let _ = decode(&bytes, rows, rank, len);
        }
    }
}
