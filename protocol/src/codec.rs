//! Tensor codecs: how a layer's `f32` values become payload bytes and back.
//!
//! Owns the byte layouts named by [`Codec`]: raw little-endian f32, f16 and
//! bf16 (via `half`), top-k sparse (indices then values) with an
//! error-feedback [`TopKCompressor`], and the optional zstd (level 1) wrap that
//! [`maybe_compress`] keeps only when it shrinks the bytes.
//!
//! Decoding treats its input as hostile: it checks the element count against a
//! limit before allocating, checks byte lengths exactly, rejects top-k indices
//! that are out of range or not strictly increasing, caps zstd output at the
//! size the codec declares, and never panics.

use std::io::Read;

use half::{bf16, f16};

use crate::error::CodecError;
use crate::message::Codec;

/// zstd level used for every wrap (fast; the gain comes from sparsity/quantization).
pub const ZSTD_LEVEL: i32 = 1;

/// Default cap on the element count a decoder will materialize (512 MiB of f32).
pub const DEFAULT_MAX_DECODED_ELEMENTS: u64 = 1 << 27;

/// Encoded tensor bytes together with the codec that produced them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Encoded {
    /// Layout actually used (e.g. after [`maybe_compress`] decided on zstd).
    pub codec: Codec,
    /// The bytes.
    pub bytes: Vec<u8>,
}

/// Bytes the plain (un-zstd'd) layout of `codec` needs for `len` elements.
///
/// For top-k this is `8 * k` (independent of `len`). `None` on overflow.
pub fn plain_encoded_len(codec: Codec, len: u64) -> Option<u64> {
    match codec.base() {
        Codec::RawF32 => len.checked_mul(4),
        Codec::F16 | Codec::Bf16 => len.checked_mul(2),
        Codec::TopK { k } => Some(u64::from(k) * 8),
        Codec::LowRank { rows, rank } => {
            let (rows, cols) = crate::lowrank::matrix_dims(len, rows);
            crate::lowrank::encoded_len(rows, cols, u64::from(rank))
        }
        // `base()` never returns a zstd variant.
        _ => None,
    }
}

/// Check that plain-layout `bytes` have exactly the length `codec` needs for
/// `len` elements (and that top-k's `k` fits). zstd-wrapped bytes are not
/// inspected (that would need decompressing); only `k` is checked.
pub fn check_encoded_len(bytes: &[u8], codec: Codec, len: u64) -> Result<(), CodecError> {
    if let Codec::TopK { k } = codec.base() {
        if u64::from(k) > len {
            return Err(CodecError::InvalidK {
                k: u64::from(k),
                len,
            });
        }
    }
    if codec.is_zstd() {
        return Ok(());
    }
    let expected = plain_encoded_len(codec, len).ok_or(CodecError::TooManyElements {
        len,
        max: u64::MAX / 4,
    })?;
    if expected != bytes.len() as u64 {
        return Err(CodecError::LengthMismatch {
            codec,
            expected,
            actual: bytes.len() as u64,
        });
    }
    Ok(())
}

/// Encode `values` with `codec`.
///
/// A `Zstd*` codec always wraps (use [`maybe_compress`] on a plain encoding to
/// wrap only when it helps). `TopK { k }` is stateless here (no error feedback;
/// see [`TopKCompressor`]); `k` is clamped to `values.len()` and the returned
/// codec carries the clamped `k`.
pub fn encode(values: &[f32], codec: Codec) -> Result<Encoded, CodecError> {
    let plain = match codec.base() {
        Codec::RawF32 => Encoded {
            codec: Codec::RawF32,
            // On a little-endian target the layout is the values' own bytes: one memcpy.
            bytes: if cfg!(target_endian = "little") {
                bytemuck::cast_slice::<f32, u8>(values).to_vec()
            } else {
                pack(values, 4, |v, out| out.extend_from_slice(&v.to_le_bytes()))
            },
        },
        Codec::F16 => Encoded {
            codec: Codec::F16,
            bytes: pack(values, 2, |v, out| {
                out.extend_from_slice(&f16::from_f32(v).to_le_bytes())
            }),
        },
        Codec::Bf16 => Encoded {
            codec: Codec::Bf16,
            bytes: pack(values, 2, |v, out| {
                out.extend_from_slice(&bf16::from_f32(v).to_le_bytes())
            }),
        },
        Codec::LowRank { rows, rank } => {
            let (rows, rank, bytes) = crate::lowrank::encode(values, rows, rank);
            Encoded {
                codec: Codec::LowRank { rows, rank },
                bytes,
            }
        }
        Codec::TopK { k } => {
            check_addressable(values.len(), k)?;
            let mut order = Vec::new();
            let indices = select_top_k(values, k as usize, &mut order);
            let kept = indices.iter().map(|&i| values[i as usize]).collect();
            SparseTopK {
                indices,
                values: kept,
            }
            .into_encoded()
        }
        // `base()` never returns a zstd variant.
        wrapped => {
            return Err(CodecError::Zstd(format!(
                "internal: codec {wrapped:?} has no plain layout"
            )))
        }
    };
    if codec.is_zstd() {
        compress_zstd(plain)
    } else {
        Ok(plain)
    }
}

/// Pack `values` into one exactly sized byte vector, `width` bytes each.
fn pack(values: &[f32], width: usize, mut put: impl FnMut(f32, &mut Vec<u8>)) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(values.len() * width);
    for &v in values {
        put(v, &mut bytes);
    }
    bytes
}

/// Wrap a plain encoding in zstd if (and only if) that makes it smaller.
/// Returns the encoding that was kept; already-wrapped input is returned as is.
pub fn maybe_compress(plain: Encoded) -> Result<Encoded, CodecError> {
    if plain.codec.is_zstd() {
        return Ok(plain);
    }
    let compressed = zstd::bulk::compress(&plain.bytes, ZSTD_LEVEL)
        .map_err(|e| CodecError::Zstd(e.to_string()))?;
    if compressed.len() < plain.bytes.len() {
        Ok(Encoded {
            codec: plain.codec.with_zstd(),
            bytes: compressed,
        })
    } else {
        Ok(plain)
    }
}

fn compress_zstd(plain: Encoded) -> Result<Encoded, CodecError> {
    let bytes = zstd::bulk::compress(&plain.bytes, ZSTD_LEVEL)
        .map_err(|e| CodecError::Zstd(e.to_string()))?;
    Ok(Encoded {
        codec: plain.codec.with_zstd(),
        bytes,
    })
}

/// Decode `bytes` laid out as `codec` into `len` dense f32 values, with the
/// default element limit [`DEFAULT_MAX_DECODED_ELEMENTS`].
pub fn decode(bytes: &[u8], codec: Codec, len: u64) -> Result<Vec<f32>, CodecError> {
    decode_with_limit(bytes, codec, len, DEFAULT_MAX_DECODED_ELEMENTS)
}

/// [`decode`] with an explicit cap on `len`; nothing is allocated for a `len`
/// above `max_elements`.
/// [`decode`] into a reused buffer (cleared first): the plain f32/f16/bf16 layouts are
/// written straight into `out`'s existing capacity, so a long-lived caller (an aggregator)
/// does not allocate a fresh tensor per message. Same checks and errors as [`decode`].
pub fn decode_into(
    bytes: &[u8],
    codec: Codec,
    len: u64,
    out: &mut Vec<f32>,
) -> Result<(), CodecError> {
    match codec {
        Codec::RawF32 | Codec::F16 | Codec::Bf16 if len <= DEFAULT_MAX_DECODED_ELEMENTS => {
            check_encoded_len(bytes, codec, len)?;
            out.clear();
            match codec {
                Codec::RawF32 => out.extend(
                    bytes
                        .chunks_exact(4)
                        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
                ),
                Codec::F16 => out.extend(
                    bytes
                        .chunks_exact(2)
                        .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32()),
                ),
                _ => out.extend(
                    bytes
                        .chunks_exact(2)
                        .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32()),
                ),
            }
            Ok(())
        }
        _ => {
            *out = decode(bytes, codec, len)?;
            Ok(())
        }
    }
}

pub fn decode_with_limit(
    bytes: &[u8],
    codec: Codec,
    len: u64,
    max_elements: u64,
) -> Result<Vec<f32>, CodecError> {
    if len > max_elements {
        return Err(CodecError::TooManyElements {
            len,
            max: max_elements,
        });
    }
    if let Codec::TopK { k } = codec.base() {
        if u64::from(k) > len {
            return Err(CodecError::InvalidK {
                k: u64::from(k),
                len,
            });
        }
    }
    if codec.is_zstd() {
        let base = codec.base();
        // len <= max_elements <= u64::MAX / 8 in any sane configuration; still checked.
        let limit = plain_encoded_len(base, len).ok_or(CodecError::TooManyElements {
            len,
            max: max_elements,
        })?;
        let plain = decompress_capped(bytes, limit)?;
        decode_plain(&plain, base, len)
    } else {
        decode_plain(bytes, codec, len)
    }
}

/// Decompress a zstd stream, refusing to produce more than `limit` bytes.
fn decompress_capped(bytes: &[u8], limit: u64) -> Result<Vec<u8>, CodecError> {
    let decoder = zstd::stream::read::Decoder::with_buffer(bytes)
        .map_err(|e| CodecError::Zstd(e.to_string()))?;
    let capacity =
        usize::try_from(limit).map_err(|_| CodecError::DecompressedTooLarge { limit })?;
    let mut out = Vec::with_capacity(capacity);
    decoder
        .take(limit.saturating_add(1))
        .read_to_end(&mut out)
        .map_err(|e| CodecError::Zstd(e.to_string()))?;
    if out.len() as u64 > limit {
        return Err(CodecError::DecompressedTooLarge { limit });
    }
    Ok(out)
}

fn decode_plain(bytes: &[u8], codec: Codec, len: u64) -> Result<Vec<f32>, CodecError> {
    check_encoded_len(bytes, codec, len)?;
    match codec {
        Codec::RawF32 => Ok(bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()),
        Codec::F16 => Ok(bytes
            .chunks_exact(2)
            .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect()),
        Codec::Bf16 => Ok(bytes
            .chunks_exact(2)
            .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect()),
        Codec::TopK { k } => decode_top_k(bytes, k as usize, len),
        Codec::LowRank { rows, rank } => crate::lowrank::decode(bytes, rows, rank, len),
        wrapped => Err(CodecError::Zstd(format!(
            "internal: codec {wrapped:?} reached the plain decoder"
        ))),
    }
}

fn decode_top_k(bytes: &[u8], k: usize, len: u64) -> Result<Vec<f32>, CodecError> {
    let (index_bytes, value_bytes) = bytes.split_at(k * 4);
    // Validate all indices before allocating the dense output.
    let mut previous: Option<u32> = None;
    for (position, c) in index_bytes.chunks_exact(4).enumerate() {
        let index = u32::from_le_bytes([c[0], c[1], c[2], c[3]]);
        if u64::from(index) >= len {
            return Err(CodecError::IndexOutOfRange {
                position,
                index,
                len,
            });
        }
        if let Some(previous) = previous {
            if index <= previous {
                return Err(CodecError::IndicesNotIncreasing {
                    position,
                    previous,
                    index,
                });
            }
        }
        previous = Some(index);
    }
    // `len` was checked against the element limit by the caller, and it is
    // bounded by usize because the limit is.
    let mut dense = vec![0.0f32; len as usize];
    for (ic, vc) in index_bytes.chunks_exact(4).zip(value_bytes.chunks_exact(4)) {
        let index = u32::from_le_bytes([ic[0], ic[1], ic[2], ic[3]]) as usize;
        dense[index] = f32::from_le_bytes([vc[0], vc[1], vc[2], vc[3]]);
    }
    Ok(dense)
}

fn check_addressable(len: usize, k: u32) -> Result<(), CodecError> {
    if len as u64 > u64::from(u32::MAX) {
        return Err(CodecError::InvalidK {
            k: u64::from(k),
            len: len as u64,
        });
    }
    Ok(())
}

/// Indices (ascending) of the `min(k, values.len())` entries of largest
/// magnitude. `order` is scratch space reused across calls.
fn select_top_k(values: &[f32], k: usize, order: &mut Vec<u32>) -> Vec<u32> {
    let n = values.len();
    let k = k.min(n);
    order.clear();
    order.extend(0..n as u32);
    if k < n {
        // Descending by |v|; total_cmp makes NaN sort deterministically (first).
        order.select_nth_unstable_by(k, |&a, &b| {
            values[b as usize]
                .abs()
                .total_cmp(&values[a as usize].abs())
        });
    }
    let mut chosen = order[..k].to_vec();
    chosen.sort_unstable();
    chosen
}

/// A top-k sparse tensor: strictly increasing indices and their values.
#[derive(Debug, Clone, PartialEq)]
pub struct SparseTopK {
    /// Element indices, strictly increasing.
    pub indices: Vec<u32>,
    /// Values at those indices.
    pub values: Vec<f32>,
}

impl SparseTopK {
    /// Number of kept entries.
    pub fn k(&self) -> usize {
        self.indices.len()
    }

    /// Lay out as [`Codec::TopK`] bytes (indices, then values, little-endian).
    pub fn into_encoded(self) -> Encoded {
        let mut bytes = Vec::with_capacity(self.indices.len() * 8);
        for i in &self.indices {
            bytes.extend_from_slice(&i.to_le_bytes());
        }
        for v in &self.values {
            bytes.extend_from_slice(&v.to_le_bytes());
        }
        Encoded {
            codec: Codec::TopK {
                k: self.indices.len() as u32,
            },
            bytes,
        }
    }

    /// Scatter into a dense vector of `len` elements.
    pub fn to_dense(&self, len: usize) -> Result<Vec<f32>, CodecError> {
        let mut dense = vec![0.0f32; len];
        for (position, (&index, &value)) in self.indices.iter().zip(&self.values).enumerate() {
            let slot = dense
                .get_mut(index as usize)
                .ok_or(CodecError::IndexOutOfRange {
                    position,
                    index,
                    len: len as u64,
                })?;
            *slot = value;
        }
        Ok(dense)
    }
}

/// Top-k compression with error feedback for one tensor.
///
/// Each call adds the stored residual to the new values, keeps the `k` entries
/// of largest magnitude, and stores everything else as the next residual, so
/// nothing is lost, only delayed: `decoded + new_residual == values +
/// old_residual` exactly, element by element. Use one compressor per tensor.
#[derive(Debug, Clone, Default)]
pub struct TopKCompressor {
    residual: Vec<f32>,
    initialized: bool,
    order: Vec<u32>,
}

impl TopKCompressor {
    /// A compressor whose residual is sized by the first call.
    pub fn new() -> Self {
        Self::default()
    }

    /// A compressor for a tensor of `len` elements (zero residual).
    pub fn with_len(len: usize) -> Self {
        Self {
            residual: vec![0.0; len],
            initialized: true,
            order: Vec::new(),
        }
    }

    /// The error-feedback residual (values not yet sent).
    pub fn residual(&self) -> &[f32] {
        &self.residual
    }

    /// Drop the residual (e.g. after a resync made it meaningless); the next
    /// call sizes it again.
    pub fn reset(&mut self) {
        self.residual.clear();
        self.initialized = false;
    }

    /// Add the residual to `values`, keep the `k` largest-magnitude entries and
    /// store the rest as the new residual. `k` is clamped to `values.len()`.
    pub fn compress(&mut self, values: &[f32], k: u32) -> Result<SparseTopK, CodecError> {
        check_addressable(values.len(), k)?;
        if !self.initialized {
            self.residual = vec![0.0; values.len()];
            self.initialized = true;
        }
        if self.residual.len() != values.len() {
            return Err(CodecError::ResidualLengthMismatch {
                residual_len: self.residual.len(),
                values_len: values.len(),
            });
        }
        for (r, &v) in self.residual.iter_mut().zip(values) {
            *r += v;
        }
        let indices = select_top_k(&self.residual, k as usize, &mut self.order);
        let mut kept = Vec::with_capacity(indices.len());
        for &i in &indices {
            let slot = &mut self.residual[i as usize];
            kept.push(*slot);
            *slot = 0.0;
        }
        Ok(SparseTopK {
            indices,
            values: kept,
        })
    }

    /// [`Self::compress`], laid out as [`Codec::TopK`] bytes.
    pub fn compress_encoded(&mut self, values: &[f32], k: u32) -> Result<Encoded, CodecError> {
        Ok(self.compress(values, k)?.into_encoded())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const PLAIN: [Codec; 3] = [Codec::RawF32, Codec::F16, Codec::Bf16];

    #[test]
    fn raw_layout_is_little_endian_f32() {
        let e = encode(&[1.0, -2.0], Codec::RawF32).unwrap();
        assert_eq!(e.bytes, [0, 0, 0x80, 0x3f, 0, 0, 0, 0xc0]);
    }

    #[test]
    fn top_k_layout_is_indices_then_values() {
        let e = encode(&[0.5, -3.0, 0.0, 2.0], Codec::TopK { k: 2 }).unwrap();
        assert_eq!(e.codec, Codec::TopK { k: 2 });
        let mut expected = Vec::new();
        for i in [1u32, 3] {
            expected.extend_from_slice(&i.to_le_bytes());
        }
        for v in [-3.0f32, 2.0] {
            expected.extend_from_slice(&v.to_le_bytes());
        }
        assert_eq!(e.bytes, expected);
        assert_eq!(decode(&e.bytes, e.codec, 4).unwrap(), [0.0, -3.0, 0.0, 2.0]);
    }

    #[test]
    fn top_k_clamps_k() {
        let e = encode(&[1.0, 2.0], Codec::TopK { k: 10 }).unwrap();
        assert_eq!(e.codec, Codec::TopK { k: 2 });
        assert_eq!(decode(&e.bytes, e.codec, 2).unwrap(), [1.0, 2.0]);
    }

    #[test]
    fn decode_rejects_wrong_lengths() {
        let e = encode(&[1.0, 2.0, 3.0], Codec::F16).unwrap();
        assert_eq!(
            decode(&e.bytes, Codec::F16, 4),
            Err(CodecError::LengthMismatch {
                codec: Codec::F16,
                expected: 8,
                actual: 6
            })
        );
        assert!(matches!(
            decode(&e.bytes[..5], Codec::F16, 3),
            Err(CodecError::LengthMismatch { .. })
        ));
        assert!(matches!(
            decode(&[0; 8], Codec::TopK { k: 2 }, 1),
            Err(CodecError::InvalidK { k: 2, len: 1 })
        ));
    }

    #[test]
    fn decode_rejects_bad_top_k_indices() {
        let bytes = |indices: &[u32]| {
            let mut b = Vec::new();
            for i in indices {
                b.extend_from_slice(&i.to_le_bytes());
            }
            b.resize(indices.len() * 8, 0);
            b
        };
        assert_eq!(
            decode(&bytes(&[0, 4]), Codec::TopK { k: 2 }, 4),
            Err(CodecError::IndexOutOfRange {
                position: 1,
                index: 4,
                len: 4
            })
        );
        assert_eq!(
            decode(&bytes(&[2, 2]), Codec::TopK { k: 2 }, 4),
            Err(CodecError::IndicesNotIncreasing {
                position: 1,
                previous: 2,
                index: 2
            })
        );
        assert_eq!(
            decode(&bytes(&[3, 1]), Codec::TopK { k: 2 }, 4),
            Err(CodecError::IndicesNotIncreasing {
                position: 1,
                previous: 3,
                index: 1
            })
        );
    }

    #[test]
    fn zstd_bomb_is_capped_at_declared_length() {
        let zeros = vec![0u8; 1 << 20];
        let bomb = zstd::bulk::compress(&zeros, 1).unwrap();
        assert!(bomb.len() < 1024);
        // Declares 16 f32 = 64 bytes, inflates to 1 MiB.
        assert_eq!(
            decode(&bomb, Codec::ZstdRawF32, 16),
            Err(CodecError::DecompressedTooLarge { limit: 64 })
        );
        // Declared length that matches decodes fine.
        assert_eq!(
            decode(&bomb, Codec::ZstdRawF32, 1 << 18).unwrap().len(),
            1 << 18
        );
    }

    #[test]
    fn decode_refuses_huge_declared_length_before_allocating() {
        assert_eq!(
            decode(&[], Codec::ZstdTopK { k: 0 }, u64::MAX),
            Err(CodecError::TooManyElements {
                len: u64::MAX,
                max: DEFAULT_MAX_DECODED_ELEMENTS
            })
        );
        assert!(matches!(
            decode_with_limit(&[0; 8], Codec::TopK { k: 1 }, 1000, 10),
            Err(CodecError::TooManyElements { len: 1000, max: 10 })
        ));
    }

    #[test]
    fn corrupt_zstd_is_an_error() {
        assert!(matches!(
            decode(&[1, 2, 3, 4, 5], Codec::ZstdF16, 4),
            Err(CodecError::Zstd(_))
        ));
    }

    #[test]
    fn compressor_rejects_length_change_and_reset_allows_it() {
        let mut c = TopKCompressor::new();
        c.compress(&[1.0, 2.0, 3.0], 1).unwrap();
        assert_eq!(c.residual(), &[1.0, 2.0, 0.0]);
        assert_eq!(
            c.compress(&[1.0], 1),
            Err(CodecError::ResidualLengthMismatch {
                residual_len: 3,
                values_len: 1
            })
        );
        c.reset();
        let sparse = c.compress(&[5.0], 1).unwrap();
        assert_eq!(sparse.indices, [0]);
        assert_eq!(c.residual(), &[0.0]);
    }

    #[test]
    fn error_feedback_eventually_sends_small_entries() {
        let mut c = TopKCompressor::with_len(4);
        let step = [1.0, 0.1, 0.1, 0.1];
        let mut sent = [0.0f32; 4];
        for _ in 0..40 {
            let s = c.compress(&step, 1).unwrap();
            for (d, v) in sent.iter_mut().zip(s.to_dense(4).unwrap()) {
                *d += v;
            }
        }
        // Every coordinate got through at some point.
        assert!(sent.iter().all(|&v| v > 0.0), "{sent:?}");
    }

    fn finite_values(max_abs: f32) -> impl Strategy<Value = Vec<f32>> {
        prop::collection::vec(-max_abs..max_abs, 0..300)
    }

    proptest! {
        #[test]
        fn raw_round_trip_is_bit_exact(values in prop::collection::vec(any::<f32>(), 0..300)) {
            for codec in [Codec::RawF32, Codec::ZstdRawF32] {
                let e = encode(&values, codec).unwrap();
                prop_assert_eq!(e.codec, codec);
                let d = decode(&e.bytes, e.codec, values.len() as u64).unwrap();
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                prop_assert_eq!(bits(&d), bits(&values));
            }
        }

        #[test]
        fn f16_round_trip_within_precision(values in finite_values(60000.0)) {
            for codec in [Codec::F16, Codec::ZstdF16] {
                let e = encode(&values, codec).unwrap();
                let d = decode(&e.bytes, e.codec, values.len() as u64).unwrap();
                prop_assert_eq!(d.len(), values.len());
                for (&x, &y) in values.iter().zip(&d) {
                    // Half an ulp: 2^-11 relative for normals, 2^-25 absolute for subnormals.
                    let tol = (x.abs() * 2f32.powi(-11)).max(2f32.powi(-25));
                    prop_assert!((x - y).abs() <= tol, "{} -> {}", x, y);
                }
            }
        }

        #[test]
        fn bf16_round_trip_within_precision(values in finite_values(1e37)) {
            for codec in [Codec::Bf16, Codec::ZstdBf16] {
                let e = encode(&values, codec).unwrap();
                let d = decode(&e.bytes, e.codec, values.len() as u64).unwrap();
                prop_assert_eq!(d.len(), values.len());
                for (&x, &y) in values.iter().zip(&d) {
                    let tol = (x.abs() * 2f32.powi(-8)).max(f32::MIN_POSITIVE);
                    prop_assert!((x - y).abs() <= tol, "{} -> {}", x, y);
                }
            }
        }

        #[test]
        fn maybe_compress_never_grows_and_round_trips(
            values in finite_values(4.0),
            zero_fraction in 0.0f64..1.0,
            codec_index in 0usize..3,
        ) {
            let cut = (values.len() as f64 * zero_fraction) as usize;
            let mut values = values;
            values[..cut].fill(0.0);
            let plain = encode(&values, PLAIN[codec_index]).unwrap();
            let chosen = maybe_compress(plain.clone()).unwrap();
            prop_assert!(chosen.bytes.len() <= plain.bytes.len());
            prop_assert_eq!(chosen.codec.base(), plain.codec);
            let a = decode(&plain.bytes, plain.codec, values.len() as u64).unwrap();
            let b = decode(&chosen.bytes, chosen.codec, values.len() as u64).unwrap();
            prop_assert_eq!(a, b);
        }

        #[test]
        fn top_k_error_feedback_is_exact(
            rounds in prop::collection::vec(finite_values(100.0), 1..5),
            len in 0usize..200,
            k in 0u32..50,
        ) {
            let mut c = TopKCompressor::with_len(len);
            for round in rounds {
                let values: Vec<f32> = (0..len).map(|i| round.get(i).copied().unwrap_or(0.5)).collect();
                let old_residual = c.residual().to_vec();
                let sparse = c.compress(&values, k).unwrap();
                let e = sparse.clone().into_encoded();
                let kept = (k as usize).min(len);
                prop_assert_eq!(e.codec, Codec::TopK { k: kept as u32 });
                let decoded = decode(&e.bytes, e.codec, len as u64).unwrap();
                for i in 0..len {
                    prop_assert_eq!(decoded[i] + c.residual()[i], values[i] + old_residual[i]);
                }
                // The kept entries dominate what is left in the residual.
                let min_kept = sparse.values.iter().map(|v| v.abs()).fold(f32::INFINITY, f32::min);
                let max_left = c.residual().iter().map(|r| r.abs()).fold(0.0f32, f32::max);
                if kept > 0 && kept < len {
                    prop_assert!(max_left <= min_kept, "left {} kept {}", max_left, min_kept);
                }
            }
        }

        #[test]
        fn decode_of_arbitrary_bytes_never_panics(
            bytes in prop::collection::vec(any::<u8>(), 0..200),
            codec_index in 0usize..8,
            k in 0u32..40,
            len in 0u64..100,
        ) {
            let codecs = [
                Codec::RawF32, Codec::F16, Codec::Bf16, Codec::TopK { k },
                Codec::ZstdRawF32, Codec::ZstdF16, Codec::ZstdBf16, Codec::ZstdTopK { k },
            ];
            if let Ok(values) = decode(&bytes, codecs[codec_index], len) {
                prop_assert_eq!(values.len() as u64, len);
            }
        }
    }
}
