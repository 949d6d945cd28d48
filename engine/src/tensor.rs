//! Dense row-major f32 tensors: the one data type that flows between layers.

/// A dense, row-major f32 tensor. Token ids and labels travel as exact small integers in f32.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct Tensor {
    /// Extent of each dimension, outermost first.
    pub shape: Vec<usize>,
    /// `shape.iter().product()` values in row-major order.
    pub data: Vec<f32>,
}

impl Tensor {
    /// A tensor of zeros.
    pub fn zeros(shape: &[usize]) -> Self {
        Self {
            shape: shape.to_vec(),
            data: vec![0.0; shape.iter().product()],
        }
    }

    /// Wraps `data`; the caller guarantees `data.len()` equals the product of `shape`.
    ///
    /// # Panics
    /// When the sizes disagree: this is a programming error inside the engine, never input-driven.
    pub fn from_vec(shape: &[usize], data: Vec<f32>) -> Self {
        assert_eq!(
            shape.iter().product::<usize>(),
            data.len(),
            "tensor shape {shape:?} does not match {} values",
            data.len()
        );
        Self {
            shape: shape.to_vec(),
            data,
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.data.len()
    }

    /// True when the tensor holds no elements.
    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }

    /// Size of the last dimension (1 for a scalar).
    pub fn last_dim(&self) -> usize {
        self.shape.last().copied().unwrap_or(1)
    }

    /// Number of rows when the tensor is viewed as `[rows, last_dim]`.
    pub fn rows(&self) -> usize {
        self.len() / self.last_dim().max(1)
    }

    /// Same data, new shape with the same number of elements.
    pub fn reshaped(mut self, shape: &[usize]) -> Self {
        assert_eq!(
            shape.iter().product::<usize>(),
            self.data.len(),
            "reshape to {shape:?}"
        );
        self.shape = shape.to_vec();
        self
    }
}
