//! Element-wise activations: [`Relu`] and [`Gelu`] (tanh approximation, as PyTorch's
//! `nn.GELU(approximate='tanh')`). Each caches what its backward needs in a reused buffer.

use crate::layer::Layer;
use crate::tensor::Tensor;

/// Rectified linear unit, `y = max(x, 0)`. The gradient at exactly 0 is taken as 0 (as PyTorch).
#[derive(Default)]
pub struct Relu {
    /// Where the last training-mode input was positive (1) — exactly where the gradient
    /// passes. One byte per value: a quarter of the memory traffic of caching the output.
    passes: Vec<u8>,
}

/// Values per block of the forward pass: the block's input stays in L1 between writing
/// the output and the mask.
const RELU_BLOCK: usize = 4096;

impl Relu {
    /// A ReLU layer.
    pub fn new() -> Self {
        Self::default()
    }
}

impl Layer for Relu {
    fn kind(&self) -> &'static str {
        "relu"
    }

    fn forward(&mut self, input: &Tensor, train: bool) -> Tensor {
        let mut positive_part = Vec::with_capacity(input.len());
        if train {
            self.passes.clear();
        }
        for block in input.data.chunks(RELU_BLOCK) {
            // `x > 0 ? x : 0` (not `f32::max`, which must handle NaN) keeps the loop a plain select.
            positive_part.extend(block.iter().map(|&x| if x > 0.0 { x } else { 0.0 }));
            if train {
                self.passes.extend(block.iter().map(|&x| u8::from(x > 0.0)));
            }
        }
        Tensor::from_vec(&input.shape, positive_part)
    }

    fn backward(&mut self, grad_output: &Tensor) -> Tensor {
        assert_eq!(
            grad_output.len(),
            self.passes.len(),
            "relu: backward without matching forward"
        );
        let grad_input = grad_output
            .data
            .iter()
            .zip(&self.passes)
            .map(|(&g, &passes)| if passes != 0 { g } else { 0.0 })
            .collect();
        Tensor::from_vec(&grad_output.shape, grad_input)
    }

    fn forward_macs_per_sample(&self) -> u64 {
        0
    }
}

/// √(2/π), the GELU tanh-approximation constant.
const SQRT_2_OVER_PI: f32 = 0.797_884_6;
/// Cubic coefficient of the GELU tanh approximation.
const GELU_CUBIC: f32 = 0.044_715;

/// GELU with the tanh approximation:
/// `y = ½·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))`.
#[derive(Default)]
pub struct Gelu {
    /// The last training-mode input.
    cached_input: Vec<f32>,
}

impl Gelu {
    /// A GELU layer.
    pub fn new() -> Self {
        Self::default()
    }
}

/// GELU (tanh approximation) of one value.
#[inline]
pub fn gelu(x: f32) -> f32 {
    let t = (SQRT_2_OVER_PI * (x + GELU_CUBIC * x * x * x)).tanh();
    0.5 * x * (1.0 + t)
}

/// Derivative of [`gelu`] at `x`.
#[inline]
pub fn gelu_derivative(x: f32) -> f32 {
    let x2 = x * x;
    let t = (SQRT_2_OVER_PI * (x + GELU_CUBIC * x2 * x)).tanh();
    let dinner = SQRT_2_OVER_PI * (1.0 + 3.0 * GELU_CUBIC * x2);
    0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * dinner
}

impl Layer for Gelu {
    fn kind(&self) -> &'static str {
        "gelu"
    }

    fn forward(&mut self, input: &Tensor, train: bool) -> Tensor {
        let out = Tensor::from_vec(&input.shape, input.data.iter().map(|&x| gelu(x)).collect());
        if train {
            self.cached_input.clear();
            self.cached_input.extend_from_slice(&input.data);
        }
        out
    }

    fn backward(&mut self, grad_output: &Tensor) -> Tensor {
        assert_eq!(
            grad_output.len(),
            self.cached_input.len(),
            "gelu: backward without matching forward"
        );
        let grad_input = grad_output
            .data
            .iter()
            .zip(&self.cached_input)
            .map(|(&g, &x)| g * gelu_derivative(x))
            .collect();
        Tensor::from_vec(&grad_output.shape, grad_input)
    }

    fn forward_macs_per_sample(&self) -> u64 {
        0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gradcheck::{check_layer, pseudo_random};
    use proptest::prelude::*;

    /// Values in ±[0.1, 1.1): away from ReLU's kink at 0.
    fn away_from_zero(len: usize, seed: u64) -> Vec<f32> {
        pseudo_random(len, seed)
            .into_iter()
            .map(|v| v + 0.1f32.copysign(v))
            .collect()
    }

    #[test]
    fn relu_gradients_match_finite_differences() {
        let input = Tensor::from_vec(&[3, 2, 4], away_from_zero(24, 1));
        check_layer(&mut Relu::new(), &input, true, 1e-3, 1e-3);
    }

    #[test]
    fn relu_clamps_negatives_and_blocks_their_gradient() {
        let mut relu = Relu::new();
        let out = relu.forward(&Tensor::from_vec(&[4], vec![-2.0, 0.0, 0.5, 3.0]), true);
        assert_eq!(out.data, vec![0.0, 0.0, 0.5, 3.0]);
        let dx = relu.backward(&Tensor::from_vec(&[4], vec![1.0, 1.0, 1.0, 2.0]));
        assert_eq!(dx.data, vec![0.0, 0.0, 1.0, 2.0]);
    }

    #[test]
    fn gelu_gradients_match_finite_differences() {
        let input = Tensor::from_vec(
            &[2, 10],
            pseudo_random(20, 2).into_iter().map(|v| v * 3.0).collect(),
        );
        check_layer(&mut Gelu::new(), &input, true, 1e-3, 2e-3);
    }

    #[test]
    fn gelu_matches_pytorch_tanh_reference_values() {
        // torch.nn.functional.gelu(x, approximate='tanh') for x = -3, -1, 0, 0.5, 2.
        let want = [-0.003_637_392, -0.158_808, 0.0, 0.345_714, 1.954_598];
        for (x, w) in [-3.0f32, -1.0, 0.0, 0.5, 2.0].into_iter().zip(want) {
            assert!((gelu(x) - w).abs() < 1e-5, "gelu({x}) = {} vs {w}", gelu(x));
        }
    }

    proptest! {
        #[test]
        fn gelu_derivative_matches_central_difference(x in -6.0f32..6.0) {
            let h = 1e-2f64;
            let f = |v: f64| {
                let t = ((2.0 / std::f64::consts::PI).sqrt() * (v + 0.044715 * v * v * v)).tanh();
                0.5 * v * (1.0 + t)
            };
            let numeric = (f(x as f64 + h) - f(x as f64 - h)) / (2.0 * h);
            prop_assert!((gelu_derivative(x) as f64 - numeric).abs() < 1e-3);
        }
    }
}
