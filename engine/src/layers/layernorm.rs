//! Layer normalization over the last dimension ([`LayerNorm`]), as PyTorch's `nn.LayerNorm(dim)`:
//! biased variance, `eps = 1e-5`, learnable `weight` (ones) and `bias` (zeros).

use crate::layer::{Layer, Param};
use crate::tensor::Tensor;

/// Index of `weight` in [`LayerNorm::params`].
const WEIGHT: usize = 0;
/// Index of `bias` in [`LayerNorm::params`].
const BIAS: usize = 1;

/// `y = (x − mean) / √(var + eps) · weight + bias`, statistics per row of the last dimension.
pub struct LayerNorm {
    /// Size of the normalized (last) dimension.
    pub dim: usize,
    /// Added to the variance before the square root.
    pub eps: f32,
    /// `[weight [dim], bias [dim]]`.
    params: Vec<Param>,
    /// Normalized input x̂ of the last training-mode forward, `[rows * dim]`.
    cached_normalized: Vec<f32>,
    /// 1/√(var + eps) per row of the last training-mode forward.
    cached_inv_std: Vec<f32>,
}

impl LayerNorm {
    /// A layer norm over a last dimension of size `dim` with `eps = 1e-5`.
    ///
    /// # Panics
    /// When `dim` is zero (an engine bug: model shapes are fixed in code).
    pub fn new(dim: usize) -> Self {
        assert!(dim > 0, "layernorm over an empty dimension");
        Self {
            dim,
            eps: 1e-5,
            params: vec![
                Param::new("weight", &[dim], vec![1.0; dim]),
                Param::new("bias", &[dim], vec![0.0; dim]),
            ],
            cached_normalized: Vec::new(),
            cached_inv_std: Vec::new(),
        }
    }
}

impl Layer for LayerNorm {
    fn kind(&self) -> &'static str {
        "layernorm"
    }

    fn forward(&mut self, input: &Tensor, train: bool) -> Tensor {
        let dim = self.dim;
        assert_eq!(
            input.last_dim(),
            dim,
            "layernorm: input {:?} vs dim {dim}",
            input.shape
        );
        let rows = input.rows();
        let mut out = Tensor::zeros(&input.shape);
        if train {
            self.cached_normalized.resize(rows * dim, 0.0);
            self.cached_inv_std.resize(rows, 0.0);
        }
        let (weight, bias) = (&self.params[WEIGHT].value, &self.params[BIAS].value);
        for (r, (x, y)) in input
            .data
            .chunks_exact(dim)
            .zip(out.data.chunks_exact_mut(dim))
            .enumerate()
        {
            let mean = x.iter().sum::<f32>() / dim as f32;
            let var = x.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / dim as f32;
            let inv_std = 1.0 / (var + self.eps).sqrt();
            for (((yv, xv), w), b) in y.iter_mut().zip(x).zip(weight).zip(bias) {
                *yv = (xv - mean) * inv_std * w + b;
            }
            if train {
                let xhat = &mut self.cached_normalized[r * dim..(r + 1) * dim];
                for (h, xv) in xhat.iter_mut().zip(x) {
                    *h = (xv - mean) * inv_std;
                }
                self.cached_inv_std[r] = inv_std;
            }
        }
        out
    }

    fn backward(&mut self, grad_output: &Tensor) -> Tensor {
        let dim = self.dim;
        assert_eq!(
            grad_output.len(),
            self.cached_normalized.len(),
            "layernorm: backward without matching forward"
        );
        let (weight, bias) = self.params.split_at_mut(BIAS);
        let (weight, bias) = (&mut weight[WEIGHT], &mut bias[0]);
        weight.grad.fill(0.0);
        bias.grad.fill(0.0);
        let mut grad_input = Tensor::zeros(&grad_output.shape);
        let rows = self.cached_normalized.chunks_exact(dim);
        let grads = grad_output
            .data
            .chunks_exact(dim)
            .zip(grad_input.data.chunks_exact_mut(dim));
        for ((xhat, inv_std), (g, dx)) in rows.zip(&self.cached_inv_std).zip(grads) {
            // dx = inv_std · (ĝ − mean(ĝ) − x̂·mean(ĝ⊙x̂)) with ĝ = g ⊙ weight.
            let mut sum_g = 0.0f32;
            let mut sum_g_xhat = 0.0f32;
            for (((gv, h), w), (dw, db)) in g
                .iter()
                .zip(xhat)
                .zip(&weight.value)
                .zip(weight.grad.iter_mut().zip(bias.grad.iter_mut()))
            {
                let ghat = gv * w;
                sum_g += ghat;
                sum_g_xhat += ghat * h;
                *dw += gv * h;
                *db += gv;
            }
            let mean_g = sum_g / dim as f32;
            let mean_g_xhat = sum_g_xhat / dim as f32;
            for (((d, gv), h), w) in dx.iter_mut().zip(g).zip(xhat).zip(&weight.value) {
                *d = inv_std * (gv * w - mean_g - h * mean_g_xhat);
            }
        }
        grad_input
    }

    fn params(&self) -> &[Param] {
        &self.params
    }

    fn params_mut(&mut self) -> &mut [Param] {
        &mut self.params
    }

    fn forward_macs_per_sample(&self) -> u64 {
        // About five multiply-adds per element (statistics, normalize, scale-shift).
        5 * self.dim as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gradcheck::{check_layer, pseudo_random};

    #[test]
    fn gradients_match_finite_differences() {
        let mut ln = LayerNorm::new(6);
        // Non-trivial affine parameters so weight enters the input gradient.
        ln.params_mut()[WEIGHT].value = pseudo_random(6, 3)
            .into_iter()
            .map(|v| 1.0 + 0.5 * v)
            .collect();
        ln.params_mut()[BIAS].value = pseudo_random(6, 4);
        let input = Tensor::from_vec(
            &[2, 3, 6],
            pseudo_random(36, 5).into_iter().map(|v| 2.0 * v).collect(),
        );
        check_layer(&mut ln, &input, true, 1e-2, 1e-2);
    }

    #[test]
    fn output_rows_have_zero_mean_and_unit_variance() {
        let mut ln = LayerNorm::new(8);
        let input = Tensor::from_vec(
            &[4, 8],
            pseudo_random(32, 6)
                .into_iter()
                .map(|v| 3.0 * v + 5.0)
                .collect(),
        );
        let out = ln.forward(&input, false);
        for row in out.data.chunks_exact(8) {
            let mean = row.iter().sum::<f32>() / 8.0;
            let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / 8.0;
            assert!(mean.abs() < 1e-5, "mean {mean}");
            assert!((var - 1.0).abs() < 1e-3, "var {var}");
        }
    }
}
