//! The feature storage of a [`super::Dataset`]: values kept at the precision they are stored
//! in on disk, decoded to `f32` only when a batch is gathered.
//!
//! MNIST pixels are bytes; held as `f32` the 70 000 images take 220 MB, held as the bytes
//! they are (with a 256-entry decode table that applies the normalization) 55 MB. The decode
//! is a table lookup per value while a batch is copied, which costs nothing next to a
//! training step, and gives bit-identical values to normalizing up front.

use std::borrow::Cow;
use std::ops::Range;

/// A data set's features, sample after sample.
#[derive(Clone, Debug, PartialEq)]
pub enum Features {
    /// Values held as `f32` (corpora, tensor files, anything not stored as bytes).
    F32(Vec<f32>),
    /// One byte per value; value `i` is `table[codes[i]]`.
    Bytes {
        /// The stored bytes.
        codes: Vec<u8>,
        /// What each byte decodes to (the normalization, applied once per distinct byte).
        table: Box<[f32; 256]>,
    },
}

impl Default for Features {
    fn default() -> Self {
        Features::F32(Vec::new())
    }
}

impl From<Vec<f32>> for Features {
    fn from(values: Vec<f32>) -> Self {
        Features::F32(values)
    }
}

impl Features {
    /// Byte features decoded through `decode` (called once per possible byte value).
    pub fn from_bytes(codes: Vec<u8>, decode: impl Fn(u8) -> f32) -> Self {
        let table = Box::new(std::array::from_fn(|byte| decode(byte as u8)));
        Features::Bytes { codes, table }
    }

    /// Number of values.
    pub fn len(&self) -> usize {
        match self {
            Features::F32(v) => v.len(),
            Features::Bytes { codes, .. } => codes.len(),
        }
    }

    /// True when there are no values.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes the values take in memory (what the budget of an edge agent counts).
    pub fn stored_bytes(&self) -> usize {
        match self {
            Features::F32(v) => v.len() * 4,
            Features::Bytes { codes, table } => codes.len() + table.len() * 4,
        }
    }

    /// The decoded values of `range`, borrowed when they are held as `f32`.
    ///
    /// # Panics
    /// When `range` is out of bounds.
    pub fn values(&self, range: Range<usize>) -> Cow<'_, [f32]> {
        match self {
            Features::F32(v) => Cow::Borrowed(&v[range]),
            Features::Bytes { codes, table } => {
                Cow::Owned(codes[range].iter().map(|&b| table[b as usize]).collect())
            }
        }
    }

    /// Decodes `range` into `out` (`out.len() == range.len()`).
    ///
    /// # Panics
    /// When `range` is out of bounds or `out` has another length.
    pub fn copy_into(&self, range: Range<usize>, out: &mut [f32]) {
        match self {
            Features::F32(v) => out.copy_from_slice(&v[range]),
            Features::Bytes { codes, table } => {
                let codes = &codes[range];
                assert_eq!(codes.len(), out.len(), "decode length");
                for (o, &b) in out.iter_mut().zip(codes) {
                    *o = table[b as usize];
                }
            }
        }
    }

    /// All values decoded (tests, exports).
    pub fn to_vec(&self) -> Vec<f32> {
        self.values(0..self.len()).into_owned()
    }

    /// The samples at `indices` (each `width` values long), in that order, in the same storage.
    ///
    /// # Panics
    /// When an index is out of range.
    pub fn samples(&self, width: usize, indices: &[usize]) -> Features {
        match self {
            Features::F32(v) => Features::F32(
                indices
                    .iter()
                    .flat_map(|&i| &v[i * width..(i + 1) * width])
                    .copied()
                    .collect(),
            ),
            Features::Bytes { codes, table } => Features::Bytes {
                codes: indices
                    .iter()
                    .flat_map(|&i| &codes[i * width..(i + 1) * width])
                    .copied()
                    .collect(),
                table: table.clone(),
            },
        }
    }

    /// The first `len` values, in the same storage.
    pub fn prefix(&self, len: usize) -> Features {
        match self {
            Features::F32(v) => Features::F32(v[..len].to_vec()),
            Features::Bytes { codes, table } => Features::Bytes {
                codes: codes[..len].to_vec(),
                table: table.clone(),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_features_decode_exactly_like_normalizing_up_front() {
        let codes: Vec<u8> = (0..=255u8).chain([0, 7, 255]).collect();
        let norm = |b: u8| (b as f32 / 255.0 - 0.1307) / 0.3081;
        let f = Features::from_bytes(codes.clone(), norm);
        let eager: Vec<f32> = codes.iter().map(|&b| norm(b)).collect();
        assert_eq!(f.to_vec(), eager);
        assert_eq!(f.len(), 259);
        assert_eq!(f.stored_bytes(), 259 + 1024);
        let mut out = vec![0.0; 3];
        f.copy_into(256..259, &mut out);
        assert_eq!(out, eager[256..]);
        assert_eq!(&*f.values(1..3), &eager[1..3]);
        assert_eq!(f.prefix(2).to_vec(), eager[..2]);
        assert_eq!(
            f.samples(2, &[3, 0]).to_vec(),
            [&eager[6..8], &eager[0..2]].concat()
        );
        let dense = Features::F32(eager.clone());
        assert_eq!(
            dense.samples(2, &[3, 0]).to_vec(),
            [&eager[6..8], &eager[0..2]].concat()
        );
    }

    #[test]
    fn f32_features_borrow() {
        let f = Features::from(vec![1.0, 2.0, 3.0]);
        assert!(matches!(f.values(0..2), Cow::Borrowed(_)));
        assert_eq!(f.stored_bytes(), 12);
        assert_eq!(f.prefix(1), Features::F32(vec![1.0]));
    }
}
