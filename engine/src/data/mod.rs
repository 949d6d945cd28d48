//! Data sets: MNIST IDX, the digits CSV, a character corpus, and the sharded sampler.
//!
//! This module owns the in-memory [`Dataset`] (normalized features plus integer labels), the
//! [`TrainTest`] pair every loader returns, and the typed [`DataError`] every loader reports.
//! Loaders live in the submodules: [`mnist`] (IDX files, gzip or raw), [`digits`] (the 8×8
//! scikit-learn digits CSV, embedded in the binary), [`corpus`] (character-level text for the GPT
//! model), [`sampler`] (per-rank shards like PyTorch's `DistributedSampler`) and [`locate`]
//! (finding `../shared/data/datasets`), [`tensor_file`] (a generic `safetensors` data set).

pub mod corpus;
pub mod digits;
pub mod features;
pub mod locate;
pub mod mnist;
pub mod sampler;
pub mod tensor_file;

use std::path::PathBuf;

pub use features::Features;

use std::borrow::Cow;

use crate::tensor::Tensor;

/// Everything that can go wrong while loading or slicing a data set. Each variant names the file
/// (or source) it is about and says what is wrong with it.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    /// A required file does not exist; `hint` says how to fix it.
    #[error("data file {path} not found: {hint}")]
    MissingFile {
        /// The path that was looked for (for gzip-or-raw files: the raw name).
        path: PathBuf,
        /// What to do about it.
        hint: String,
    },
    /// The file exists but reading it failed.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file being read.
        path: PathBuf,
        /// The underlying I/O error.
        source: std::io::Error,
    },
    /// An IDX file starts with the wrong magic number (e.g. a label file passed as images).
    #[error("{path}: bad IDX magic number {found} (expected {expected})")]
    BadMagic {
        /// The file.
        path: PathBuf,
        /// The magic number this kind of file must have (2051 images, 2049 labels).
        expected: u32,
        /// The magic number found.
        found: u32,
    },
    /// The file ended before the data its header announced.
    #[error("{path}: truncated: expected {expected} bytes here, the file ends after {found}")]
    Truncated {
        /// The file.
        path: PathBuf,
        /// Bytes the header (or payload) needs at this point of the file.
        expected: u64,
        /// Bytes actually available.
        found: u64,
    },
    /// A header field is unusable (e.g. zero-sized images).
    #[error("{path}: bad header: {detail}")]
    BadHeader {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        detail: String,
    },
    /// The image file and the label file disagree on the number of samples.
    #[error("{images} holds {image_count} images but {labels} holds {label_count} labels")]
    CountMismatch {
        /// The image file.
        images: PathBuf,
        /// Number of images its header announces.
        image_count: u64,
        /// The label file.
        labels: PathBuf,
        /// Number of labels its header announces.
        label_count: u64,
    },
    /// A label is not a valid class index.
    #[error("{path}: sample {index} has label {label}, but there are only {classes} classes")]
    LabelOutOfRange {
        /// The file.
        path: PathBuf,
        /// Zero-based sample index.
        index: usize,
        /// The label found.
        label: u32,
        /// Number of classes of the data set.
        classes: usize,
    },
    /// A CSV line is malformed (wrong column count, non-integer cell, value out of range).
    #[error("{path}:{line}: {detail}")]
    Csv {
        /// The file (or `<embedded digits.csv>`).
        path: PathBuf,
        /// One-based line number (the header is line 1).
        line: usize,
        /// What is wrong with the line.
        detail: String,
    },
    /// A text corpus is unusable (not UTF-8, too short to split, unknown character).
    #[error("corpus {path}: {detail}")]
    Corpus {
        /// The file (or `<text>` for in-memory text).
        path: PathBuf,
        /// What is wrong.
        detail: String,
    },
    /// Sampler arguments that cannot produce batches (rank ≥ world, empty shard, ...).
    #[error("invalid sampler configuration: {0}")]
    InvalidSampler(String),
}

/// An in-memory classification data set: normalized features and integer labels.
#[derive(Clone, Debug, PartialEq)]
pub struct Dataset {
    /// Human-readable name, e.g. `mnist-train`.
    pub name: String,
    /// Shape of one sample, e.g. `[1, 28, 28]` (channels, height, width).
    pub sample_shape: Vec<usize>,
    /// `len() × prod(sample_shape)` normalized values, sample after sample, at their stored
    /// precision ([`Features`]).
    pub features: Features,
    /// One class index per sample, each `< classes`.
    pub labels: Vec<u32>,
    /// Number of classes.
    pub classes: usize,
}

impl Dataset {
    /// Number of samples.
    pub fn len(&self) -> usize {
        self.labels.len()
    }

    /// True when the data set holds no samples.
    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }

    /// Number of scalars in one sample (`prod(sample_shape)`).
    pub fn sample_len(&self) -> usize {
        self.sample_shape.iter().product()
    }

    /// The features of sample `index`.
    ///
    /// # Panics
    /// When `index >= len()`.
    pub fn sample(&self, index: usize) -> Cow<'_, [f32]> {
        let width = self.sample_len();
        self.features.values(index * width..(index + 1) * width)
    }

    /// Bytes the features and labels take in memory.
    pub fn stored_bytes(&self) -> usize {
        self.features.stored_bytes() + self.labels.len() * std::mem::size_of::<u32>()
    }

    /// Number of samples per class (length `classes`).
    pub fn class_counts(&self) -> Vec<usize> {
        let mut counts = vec![0; self.classes];
        for &label in &self.labels {
            counts[label as usize] += 1;
        }
        counts
    }

    /// Fills `out` with the samples at `indices` as a `[B, ...sample_shape]` tensor and `targets`
    /// with their labels, reusing both buffers (no allocation once they are large enough).
    ///
    /// # Panics
    /// When an index is out of range (indices come from a sampler built for this data set).
    pub fn batch(&self, indices: &[usize], out: &mut Tensor, targets: &mut Vec<usize>) {
        out.shape.clear();
        out.shape.push(indices.len());
        out.shape.extend_from_slice(&self.sample_shape);
        self.gather(indices, out, targets);
    }

    /// Like [`Dataset::batch`] but shapes `out` as `[B, prod(sample_shape)]` (MLP input).
    pub fn batch_flat(&self, indices: &[usize], out: &mut Tensor, targets: &mut Vec<usize>) {
        out.shape.clear();
        out.shape.push(indices.len());
        out.shape.push(self.sample_len());
        self.gather(indices, out, targets);
    }

    fn gather(&self, indices: &[usize], out: &mut Tensor, targets: &mut Vec<usize>) {
        let width = self.sample_len();
        out.data.resize(indices.len() * width, 0.0);
        targets.clear();
        for (row, &index) in out.data.chunks_exact_mut(width.max(1)).zip(indices) {
            assert!(
                index < self.len(),
                "sample index {index} out of range for {} ({} samples)",
                self.name,
                self.len()
            );
            self.features
                .copy_into(index * width..(index + 1) * width, row);
        }
        targets.extend(indices.iter().map(|&index| self.labels[index] as usize));
    }

    /// A new data set holding the samples at `indices`, in that order (a node that trains
    /// fixed shards keeps only its own samples).
    ///
    /// # Panics
    /// When an index is out of range.
    pub fn subset(&self, indices: &[usize]) -> Dataset {
        Dataset {
            name: self.name.clone(),
            sample_shape: self.sample_shape.clone(),
            features: self.features.samples(self.sample_len(), indices),
            labels: indices.iter().map(|&i| self.labels[i]).collect(),
            classes: self.classes,
        }
    }

    /// A new data set holding the first `count` samples (all of them when `count >= len()`).
    pub fn truncated(&self, count: usize) -> Dataset {
        let count = count.min(self.len());
        Dataset {
            name: self.name.clone(),
            sample_shape: self.sample_shape.clone(),
            features: self.features.prefix(count * self.sample_len()),
            labels: self.labels[..count].to_vec(),
            classes: self.classes,
        }
    }
}

/// A training split and a held-out test split of the same data set.
#[derive(Clone, Debug, PartialEq)]
pub struct TrainTest {
    /// Samples to train on.
    pub train: Dataset,
    /// Held-out samples to evaluate on.
    pub test: Dataset,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn toy() -> Dataset {
        Dataset {
            name: "toy".into(),
            sample_shape: vec![1, 2, 2],
            features: (0..12).map(|v| v as f32).collect::<Vec<_>>().into(),
            labels: vec![2, 0, 1],
            classes: 3,
        }
    }

    #[test]
    fn batch_gathers_samples_in_index_order_and_reuses_buffers() {
        let data = toy();
        let mut out = Tensor::default();
        let mut targets = Vec::new();
        data.batch(&[2, 0], &mut out, &mut targets);
        assert_eq!(out.shape, vec![2, 1, 2, 2]);
        assert_eq!(out.data, vec![8.0, 9.0, 10.0, 11.0, 0.0, 1.0, 2.0, 3.0]);
        assert_eq!(targets, vec![1, 2]);
        let capacity = out.data.capacity();
        data.batch_flat(&[1], &mut out, &mut targets);
        assert_eq!(out.shape, vec![1, 4]);
        assert_eq!(out.data, vec![4.0, 5.0, 6.0, 7.0]);
        assert_eq!(targets, vec![0]);
        assert_eq!(out.data.capacity(), capacity, "buffer reused");
    }

    #[test]
    fn class_counts_and_truncation() {
        let data = toy();
        assert_eq!(data.class_counts(), vec![1, 1, 1]);
        let first_two = data.truncated(2);
        assert_eq!(first_two.len(), 2);
        assert_eq!(
            first_two.features.to_vec(),
            (0..8).map(|v| v as f32).collect::<Vec<_>>()
        );
        assert_eq!(data.truncated(10).len(), 3);
    }

    #[test]
    #[should_panic(expected = "out of range")]
    fn batch_rejects_out_of_range_index() {
        let data = toy();
        data.batch(&[3], &mut Tensor::default(), &mut Vec::new());
    }
}
