//! [`Flatten`]: reshapes `[N, ...]` to `[N, prod(...)]`; backward reshapes the gradient back.

use crate::layer::Layer;
use crate::tensor::Tensor;

/// Flattens every dimension after the first (the batch) into one.
#[derive(Default)]
pub struct Flatten {
    /// Shape of the last training-mode input.
    cached_shape: Vec<usize>,
}

impl Flatten {
    /// A flatten layer.
    pub fn new() -> Self {
        Self::default()
    }
}

impl Layer for Flatten {
    fn kind(&self) -> &'static str {
        "flatten"
    }

    fn forward(&mut self, input: &Tensor, train: bool) -> Tensor {
        let batch = input.shape.first().copied().unwrap_or(1);
        let features = input.shape.get(1..).map_or(1, |rest| rest.iter().product());
        if train {
            self.cached_shape.clear();
            self.cached_shape.extend_from_slice(&input.shape);
        }
        Tensor::from_vec(&[batch, features], input.data.clone())
    }

    fn backward(&mut self, grad_output: &Tensor) -> Tensor {
        Tensor::from_vec(&self.cached_shape, grad_output.data.clone())
    }

    fn forward_macs_per_sample(&self) -> u64 {
        0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gradcheck::{check_layer, pseudo_random};

    #[test]
    fn flattens_trailing_dims_and_restores_them_in_backward() {
        let mut flatten = Flatten::new();
        let input = Tensor::from_vec(&[2, 3, 2, 2], pseudo_random(24, 1));
        let out = flatten.forward(&input, true);
        assert_eq!(out.shape, vec![2, 12]);
        assert_eq!(out.data, input.data);
        let back = flatten.backward(&out);
        assert_eq!(back, input);
    }

    #[test]
    fn gradients_match_finite_differences() {
        let input = Tensor::from_vec(&[3, 2, 2], pseudo_random(12, 2));
        check_layer(&mut Flatten::new(), &input, true, 1e-2, 1e-3);
    }
}
