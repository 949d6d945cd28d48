//! Pre-LayerNorm transformer block (attention + MLP, both residual) as one layer.
//!
//! `y = x1 + mlp(ln2(x1))` with `x1 = x + attn(ln1(x))` and
//! `mlp = fc (dim → 4·dim) → GELU (tanh approximation) → proj (4·dim → dim)`.
//! The whole block is **one** layer, so it is one synchronization unit of a sync plan.
//!
//! This file also owns the small row-wise kernels the transformer layers share
//! ([`ops`]: linear, LayerNorm, GELU forward/backward on flat slices), so the
//! attention, block and model head do not depend on the standalone layer files.

use rand::Rng;

use crate::layer::{Layer, Param};
use crate::layers::attention::AttentionCore;
use crate::layers::embedding::normal_values;
use crate::tensor::Tensor;

/// Standard deviation of the normal initialization of every weight matrix (GPT-2).
pub const INIT_STD: f32 = 0.02;

/// Row-wise kernels on flat row-major slices, shared by the transformer layers.
///
/// Every kernel treats its input as `[rows, dim]`; buffers are caller-owned so a
/// layer can reuse them between steps.
pub(crate) mod ops {
    use crate::backend::matmul;
    use crate::layer::Param;

    /// LayerNorm epsilon (PyTorch default).
    pub const LN_EPS: f32 = 1e-5;
    /// √(2/π), the constant of the tanh GELU approximation.
    const GELU_C: f32 = 0.797_884_6;
    /// Cubic coefficient of the tanh GELU approximation.
    const GELU_A: f32 = 0.044_715;

    /// Clears `buf` and makes it `len` zeros without giving back its capacity.
    pub fn reset(buf: &mut Vec<f32>, len: usize) {
        buf.clear();
        buf.resize(len, 0.0);
    }

    /// `y[rows×out] = x[rows×in] · weightᵀ + bias` with `weight` `[out, in]`.
    pub fn linear_forward(
        y: &mut [f32],
        x: &[f32],
        weight: &Param,
        bias: &Param,
        rows: usize,
        in_dim: usize,
        out_dim: usize,
    ) {
        matmul(
            y,
            x,
            &weight.value,
            rows,
            in_dim,
            out_dim,
            false,
            true,
            false,
        );
        for row in y[..rows * out_dim].chunks_exact_mut(out_dim) {
            for (v, b) in row.iter_mut().zip(&bias.value) {
                *v += b;
            }
        }
    }

    /// Backward of [`linear_forward`]: **overwrites** `weight.grad` and `bias.grad`, and
    /// writes `dx = dy · weight` into `dx` (added to it when `accumulate_dx`).
    pub fn linear_backward(
        dx: &mut [f32],
        weight: &mut Param,
        bias: &mut Param,
        dy: &[f32],
        x: &[f32],
        rows: usize,
        in_dim: usize,
        out_dim: usize,
        accumulate_dx: bool,
    ) {
        // dW[out×in] = dyᵀ[out×rows] · x[rows×in]
        matmul(
            &mut weight.grad,
            dy,
            x,
            out_dim,
            rows,
            in_dim,
            true,
            false,
            false,
        );
        bias.grad.fill(0.0);
        for row in dy[..rows * out_dim].chunks_exact(out_dim) {
            for (g, d) in bias.grad.iter_mut().zip(row) {
                *g += d;
            }
        }
        matmul(
            dx,
            dy,
            &weight.value,
            rows,
            out_dim,
            in_dim,
            false,
            false,
            accumulate_dx,
        );
    }

    /// `y = x̂ ⊙ gamma + beta` per row, with `x̂ = (x − mean) / √(var + ε)`.
    /// Caches `x̂` (`[rows, dim]`) and the reciprocal std per row for the backward.
    pub fn layer_norm_forward(
        y: &mut [f32],
        x: &[f32],
        gamma: &Param,
        beta: &Param,
        dim: usize,
        xhat: &mut Vec<f32>,
        rstd: &mut Vec<f32>,
    ) {
        let rows = x.len() / dim;
        reset(xhat, rows * dim);
        reset(rstd, rows);
        for r in 0..rows {
            let xr = &x[r * dim..(r + 1) * dim];
            let mean = xr.iter().sum::<f32>() / dim as f32;
            let var = xr.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / dim as f32;
            let rs = 1.0 / (var + LN_EPS).sqrt();
            rstd[r] = rs;
            let hr = &mut xhat[r * dim..(r + 1) * dim];
            let yr = &mut y[r * dim..(r + 1) * dim];
            for i in 0..dim {
                hr[i] = (xr[i] - mean) * rs;
                yr[i] = hr[i] * gamma.value[i] + beta.value[i];
            }
        }
    }

    /// Backward of [`layer_norm_forward`]: **overwrites** `gamma.grad`, `beta.grad`; adds
    /// the input gradient to `dx` when `accumulate_dx`, otherwise overwrites it.
    pub fn layer_norm_backward(
        dx: &mut [f32],
        gamma: &mut Param,
        beta: &mut Param,
        dy: &[f32],
        xhat: &[f32],
        rstd: &[f32],
        dim: usize,
        accumulate_dx: bool,
    ) {
        gamma.grad.fill(0.0);
        beta.grad.fill(0.0);
        for (r, &rs) in rstd.iter().enumerate() {
            let span = r * dim..(r + 1) * dim;
            let (dyr, hr) = (&dy[span.clone()], &xhat[span.clone()]);
            let mut mean_dxhat = 0.0;
            let mut mean_dxhat_xhat = 0.0;
            for i in 0..dim {
                gamma.grad[i] += dyr[i] * hr[i];
                beta.grad[i] += dyr[i];
                let dxhat = dyr[i] * gamma.value[i];
                mean_dxhat += dxhat;
                mean_dxhat_xhat += dxhat * hr[i];
            }
            mean_dxhat /= dim as f32;
            mean_dxhat_xhat /= dim as f32;
            let dxr = &mut dx[span];
            for i in 0..dim {
                let dxhat = dyr[i] * gamma.value[i];
                let g = rs * (dxhat - mean_dxhat - hr[i] * mean_dxhat_xhat);
                if accumulate_dx {
                    dxr[i] += g;
                } else {
                    dxr[i] = g;
                }
            }
        }
    }

    /// GELU, tanh approximation: `0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))`, element-wise.
    pub fn gelu_forward(y: &mut [f32], x: &[f32]) {
        for (o, &v) in y.iter_mut().zip(x) {
            let t = (GELU_C * (v + GELU_A * v * v * v)).tanh();
            *o = 0.5 * v * (1.0 + t);
        }
    }

    /// Derivative of the tanh GELU at `x`.
    fn gelu_derivative(x: f32) -> f32 {
        let t = (GELU_C * (x + GELU_A * x * x * x)).tanh();
        let dinner = GELU_C * (1.0 + 3.0 * GELU_A * x * x);
        0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * dinner
    }

    /// `grad ← grad ⊙ gelu'(x)`, element-wise.
    pub fn gelu_backward_in_place(grad: &mut [f32], x: &[f32]) {
        for (g, &v) in grad.iter_mut().zip(x) {
            *g *= gelu_derivative(v);
        }
    }
}

// Indices of the block's parameters in `Block::params` (the public names are in `new`).
const LN1_W: usize = 0;
const LN1_B: usize = 1;
/// First of the four attention parameters (qkv.weight, qkv.bias, proj.weight, proj.bias).
const ATTN: usize = 2;
const LN2_W: usize = 6;
const LN2_B: usize = 7;
const FC_W: usize = 8;
const FC_B: usize = 9;
const PROJ_W: usize = 10;
const PROJ_B: usize = 11;

/// Two distinct parameters of `params` borrowed mutably at once (`i < j`).
fn two_mut(params: &mut [Param], i: usize, j: usize) -> (&mut Param, &mut Param) {
    debug_assert!(i < j);
    let (lo, hi) = params.split_at_mut(j);
    (&mut lo[i], &mut hi[0])
}

/// A pre-LayerNorm GPT block over `[B, T, dim]` inputs; output has the same shape.
///
/// Parameters, in order: `ln1.weight`, `ln1.bias`, `attn.qkv.weight` `[3·dim, dim]`,
/// `attn.qkv.bias`, `attn.proj.weight` `[dim, dim]`, `attn.proj.bias`, `ln2.weight`,
/// `ln2.bias`, `mlp.fc.weight` `[4·dim, dim]`, `mlp.fc.bias`, `mlp.proj.weight`
/// `[dim, 4·dim]`, `mlp.proj.bias`.
pub struct Block {
    /// Model width.
    pub dim: usize,
    /// Number of attention heads (`dim % heads == 0`).
    pub heads: usize,
    params: Vec<Param>,
    attn: AttentionCore,
    /// `[B, T]` of the last forward.
    batch_seq: (usize, usize),
    // Forward caches, `[rows, ·]` with rows = B·T.
    ln1_xhat: Vec<f32>,
    ln1_rstd: Vec<f32>,
    ln1_out: Vec<f32>,
    attn_out: Vec<f32>,
    ln2_xhat: Vec<f32>,
    ln2_rstd: Vec<f32>,
    ln2_out: Vec<f32>,
    fc_pre: Vec<f32>,
    fc_act: Vec<f32>,
    // Backward scratch.
    grad_act: Vec<f32>,
    grad_ln2_out: Vec<f32>,
    grad_ln1_out: Vec<f32>,
}

impl Block {
    /// A block with N(0, 0.02) weights, zero biases, LayerNorm gains 1 and shifts 0.
    ///
    /// # Panics
    /// When `dim` is not a positive multiple of `heads` (a model-definition bug).
    pub fn new(dim: usize, heads: usize, rng: &mut impl Rng) -> Self {
        let hidden = 4 * dim;
        let weight = |name: &str, shape: &[usize], rng: &mut dyn rand::RngCore| {
            Param::new(
                name,
                shape,
                normal_values(shape[0] * shape[1], INIT_STD, rng),
            )
        };
        let zeros = |name: &str, len: usize| Param::new(name, &[len], vec![0.0; len]);
        let ones = |name: &str, len: usize| Param::new(name, &[len], vec![1.0; len]);
        let params = vec![
            ones("ln1.weight", dim),
            zeros("ln1.bias", dim),
            weight("attn.qkv.weight", &[3 * dim, dim], rng),
            zeros("attn.qkv.bias", 3 * dim),
            weight("attn.proj.weight", &[dim, dim], rng),
            zeros("attn.proj.bias", dim),
            ones("ln2.weight", dim),
            zeros("ln2.bias", dim),
            weight("mlp.fc.weight", &[hidden, dim], rng),
            zeros("mlp.fc.bias", hidden),
            weight("mlp.proj.weight", &[dim, hidden], rng),
            zeros("mlp.proj.bias", dim),
        ];
        Self {
            dim,
            heads,
            params,
            attn: AttentionCore::new(dim, heads),
            batch_seq: (0, 0),
            ln1_xhat: Vec::new(),
            ln1_rstd: Vec::new(),
            ln1_out: Vec::new(),
            attn_out: Vec::new(),
            ln2_xhat: Vec::new(),
            ln2_rstd: Vec::new(),
            ln2_out: Vec::new(),
            fc_pre: Vec::new(),
            fc_act: Vec::new(),
            grad_act: Vec::new(),
            grad_ln2_out: Vec::new(),
            grad_ln1_out: Vec::new(),
        }
    }
}

impl Layer for Block {
    fn kind(&self) -> &'static str {
        "block"
    }

    fn forward(&mut self, input: &Tensor, _train: bool) -> Tensor {
        let d = self.dim;
        assert!(
            input.shape.len() == 3 && input.shape[2] == d,
            "block expects [B, T, {d}], got {:?}",
            input.shape
        );
        let (batch, seq) = (input.shape[0], input.shape[1]);
        self.batch_seq = (batch, seq);
        let rows = batch * seq;
        let hidden = 4 * d;
        let p = &self.params;

        // x1 = x + attn(ln1(x)), kept in `out`.
        ops::reset(&mut self.ln1_out, rows * d);
        ops::layer_norm_forward(
            &mut self.ln1_out,
            &input.data,
            &p[LN1_W],
            &p[LN1_B],
            d,
            &mut self.ln1_xhat,
            &mut self.ln1_rstd,
        );
        ops::reset(&mut self.attn_out, rows * d);
        self.attn.forward(
            &p[ATTN..ATTN + 4],
            &self.ln1_out,
            batch,
            seq,
            &mut self.attn_out,
        );
        let mut out = input.data.clone();
        for (o, a) in out.iter_mut().zip(&self.attn_out) {
            *o += a;
        }

        // y = x1 + proj(gelu(fc(ln2(x1)))).
        ops::reset(&mut self.ln2_out, rows * d);
        ops::layer_norm_forward(
            &mut self.ln2_out,
            &out,
            &p[LN2_W],
            &p[LN2_B],
            d,
            &mut self.ln2_xhat,
            &mut self.ln2_rstd,
        );
        ops::reset(&mut self.fc_pre, rows * hidden);
        ops::linear_forward(
            &mut self.fc_pre,
            &self.ln2_out,
            &p[FC_W],
            &p[FC_B],
            rows,
            d,
            hidden,
        );
        ops::reset(&mut self.fc_act, rows * hidden);
        ops::gelu_forward(&mut self.fc_act, &self.fc_pre);
        // Reuse `attn_out` for the MLP output: the attention output is not needed in backward.
        ops::linear_forward(
            &mut self.attn_out,
            &self.fc_act,
            &p[PROJ_W],
            &p[PROJ_B],
            rows,
            hidden,
            d,
        );
        for (o, m) in out.iter_mut().zip(&self.attn_out) {
            *o += m;
        }
        Tensor::from_vec(&input.shape, out)
    }

    fn backward(&mut self, grad_output: &Tensor) -> Tensor {
        let d = self.dim;
        let hidden = 4 * d;
        let (batch, seq) = self.batch_seq;
        let rows = batch * seq;
        assert_eq!(
            grad_output.len(),
            rows * d,
            "block backward before forward or shape change"
        );
        let dy = &grad_output.data;

        // MLP branch: dy flows into proj, GELU, fc, ln2; the residual passes dy through.
        ops::reset(&mut self.grad_act, rows * hidden);
        let (w, b) = two_mut(&mut self.params, PROJ_W, PROJ_B);
        ops::linear_backward(
            &mut self.grad_act,
            w,
            b,
            dy,
            &self.fc_act,
            rows,
            hidden,
            d,
            false,
        );
        // GELU backward in place: grad_act ← grad_act ⊙ gelu'(fc_pre).
        ops::gelu_backward_in_place(&mut self.grad_act, &self.fc_pre);
        ops::reset(&mut self.grad_ln2_out, rows * d);
        let (w, b) = two_mut(&mut self.params, FC_W, FC_B);
        ops::linear_backward(
            &mut self.grad_ln2_out,
            w,
            b,
            &self.grad_act,
            &self.ln2_out,
            rows,
            d,
            hidden,
            false,
        );
        // dx1 = dy + ln2ᵀ(grad_ln2_out); this is also the gradient of the attention output.
        let mut grad_x1 = dy.clone();
        let (g, bt) = two_mut(&mut self.params, LN2_W, LN2_B);
        ops::layer_norm_backward(
            &mut grad_x1,
            g,
            bt,
            &self.grad_ln2_out,
            &self.ln2_xhat,
            &self.ln2_rstd,
            d,
            true,
        );

        // Attention branch: dx = dx1 + ln1ᵀ(attnᵀ(dx1)).
        ops::reset(&mut self.grad_ln1_out, rows * d);
        self.attn.backward(
            &mut self.params[ATTN..ATTN + 4],
            &grad_x1,
            &mut self.grad_ln1_out,
        );
        let (g, bt) = two_mut(&mut self.params, LN1_W, LN1_B);
        ops::layer_norm_backward(
            &mut grad_x1,
            g,
            bt,
            &self.grad_ln1_out,
            &self.ln1_xhat,
            &self.ln1_rstd,
            d,
            true,
        );
        Tensor::from_vec(&grad_output.shape, grad_x1)
    }

    fn params(&self) -> &[Param] {
        &self.params
    }

    fn params_mut(&mut self) -> &mut [Param] {
        &mut self.params
    }

    /// Per token: the linear MACs (12·dim²) plus the causal attention products of the
    /// last forward's sequence length (see [`AttentionCore::macs_per_token`]).
    fn forward_macs_per_sample(&self) -> u64 {
        let d = self.dim as u64;
        8 * d * d + self.attn.macs_per_token()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gradcheck::{check_layer, pseudo_random};
    use proptest::prelude::*;
    use rand::SeedableRng;
    use rand_chacha::ChaCha8Rng;

    /// Replaces every parameter with O(0.5) pseudo-random values so that a gradient
    /// check exercises non-trivial gains, shifts and biases.
    pub(crate) fn scramble(layer: &mut dyn Layer, seed: u64) {
        for (i, p) in layer.params_mut().iter_mut().enumerate() {
            let r = pseudo_random(p.len(), seed + i as u64);
            let is_gain = p.name.ends_with("ln1.weight")
                || p.name.ends_with("ln2.weight")
                || p.name.starts_with("ln.");
            for (v, x) in p.value.iter_mut().zip(r) {
                *v = if is_gain && p.name.ends_with("weight") {
                    1.0 + 0.3 * x
                } else {
                    0.5 * x
                };
            }
        }
    }

    #[test]
    fn block_gradients_match_finite_differences() {
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        let mut block = Block::new(8, 2, &mut rng);
        scramble(&mut block, 10);
        let x = Tensor::from_vec(&[2, 4, 8], pseudo_random(64, 3));
        check_layer(&mut block, &x, true, 1e-2, 2e-2);
    }

    #[test]
    fn block_param_names_and_shapes() {
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        let block = Block::new(8, 2, &mut rng);
        let names: Vec<&str> = block.params().iter().map(|p| p.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "ln1.weight",
                "ln1.bias",
                "attn.qkv.weight",
                "attn.qkv.bias",
                "attn.proj.weight",
                "attn.proj.bias",
                "ln2.weight",
                "ln2.bias",
                "mlp.fc.weight",
                "mlp.fc.bias",
                "mlp.proj.weight",
                "mlp.proj.bias"
            ]
        );
        assert_eq!(block.params()[FC_W].shape, [32, 8]);
        assert_eq!(block.params()[PROJ_W].shape, [8, 32]);
        assert_eq!(crate::layer::param_len(&block), 12 * 64 + 13 * 8);
    }

    #[test]
    fn block_output_is_input_plus_something_and_finite() {
        let mut rng = ChaCha8Rng::seed_from_u64(2);
        let mut block = Block::new(8, 2, &mut rng);
        let x = Tensor::from_vec(&[1, 3, 8], pseudo_random(24, 4));
        let y = block.forward(&x, false);
        assert_eq!(y.shape, x.shape);
        assert!(y.data.iter().all(|v| v.is_finite()));
        // With small init the residual dominates but the branches are not zero.
        let diff: f32 = y.data.iter().zip(&x.data).map(|(a, b)| (a - b).abs()).sum();
        assert!(diff > 0.0 && diff < 0.5 * x.data.iter().map(|v| v.abs()).sum::<f32>());
    }

    #[test]
    fn gelu_matches_reference_values() {
        // Reference: PyTorch gelu(approximate="tanh").
        let x = [-3.0, -1.0, 0.0, 0.5, 2.0];
        let want = [-0.003_637_392, -0.158_808, 0.0, 0.345_714, 1.954_598];
        let mut y = [0.0; 5];
        ops::gelu_forward(&mut y, &x);
        for (a, b) in y.iter().zip(want) {
            assert!((a - b).abs() < 1e-5, "{a} vs {b}");
        }
    }

    proptest! {
        #[test]
        fn layer_norm_rows_have_zero_mean_unit_variance(
            values in proptest::collection::vec(-100.0f32..100.0, 16),
            shift in -50.0f32..50.0,
        ) {
            prop_assume!(values.iter().any(|v| (v - values[0]).abs() > 1e-2));
            let dim = 8;
            let gamma = Param::new("g", &[dim], vec![1.0; dim]);
            let beta = Param::new("b", &[dim], vec![0.0; dim]);
            let x: Vec<f32> = values.iter().map(|v| v + shift).collect();
            let (mut xhat, mut rstd, mut y) = (Vec::new(), Vec::new(), vec![0.0; 16]);
            ops::layer_norm_forward(&mut y, &x, &gamma, &beta, dim, &mut xhat, &mut rstd);
            for row in y.chunks(dim) {
                let var_in: f32 = {
                    let m = row.iter().sum::<f32>() / dim as f32;
                    prop_assert!(m.abs() < 1e-3, "mean {m}");
                    row.iter().map(|v| (v - m) * (v - m)).sum::<f32>() / dim as f32
                };
                // Rows that are (almost) constant normalize to ~0 because of ε.
                prop_assert!(var_in < 1.0 + 1e-3, "variance {var_in}");
            }
        }

        #[test]
        fn gelu_backward_matches_finite_difference(x in -6.0f32..6.0) {
            let eps = 1e-2;
            let (mut yp, mut ym, mut dx) = ([0.0], [0.0], [1.0]);
            ops::gelu_forward(&mut yp, &[x + eps]);
            ops::gelu_forward(&mut ym, &[x - eps]);
            ops::gelu_backward_in_place(&mut dx, &[x]);
            let numeric = (yp[0] - ym[0]) / (2.0 * eps);
            prop_assert!((dx[0] - numeric).abs() < 2e-3, "{} vs {}", dx[0], numeric);
        }
    }
}
