//! Fully connected layer (y = x·Wᵀ + b over the last dimension).
//!
//! Owns [`Linear`]: parameters `weight` `[out, in]` and `bias` `[out]`, PyTorch-style
//! initialization, and the three GEMMs of forward/backward through [`crate::backend::matmul`].

use rand::Rng;

use crate::backend::matmul;
use crate::layer::{Layer, Param};
use crate::tensor::Tensor;

/// Index of `weight` in [`Linear::params`].
const WEIGHT: usize = 0;
/// Index of `bias` in [`Linear::params`].
const BIAS: usize = 1;

/// Largest weight (in elements, 1 MiB of f32) that forward transposes into `[in, out]` before
/// its GEMM. The `gemm` crate runs `x·Wᵀ` with a transposed right operand up to 2–4× slower
/// than with `Wᵀ` stored contiguously for mid-sized weights (measured: 512→256 at batch 128,
/// 62 vs 112 GFLOP/s), while a cache-resident transpose costs a few percent of the product.
/// Larger weights (784→512) fall out of L2 during the transpose and lose more than they gain
/// (measured in a full MLP step), so they use the transposed-operand GEMM directly.
const TRANSPOSE_MAX_WEIGHT: usize = 1 << 18;
/// Fewest rows for which the forward transpose pays off (one batch row amortizes little).
const TRANSPOSE_MIN_ROWS: usize = 16;

/// A fully connected layer applied to the last dimension of any-rank input: an input of
/// shape `[.., in_features]` is treated as `[rows, in_features]` and produces
/// `[.., out_features]`.
pub struct Linear {
    /// Size of the input's last dimension.
    pub in_features: usize,
    /// Size of the output's last dimension.
    pub out_features: usize,
    /// `[weight [out, in], bias [out]]`.
    params: Vec<Param>,
    /// Copy of the last training-mode input, `[rows * in_features]` (buffer reused across steps).
    cached_input: Vec<f32>,
    /// Shape of the last training-mode input.
    cached_shape: Vec<usize>,
    /// Whether `backward` computes the input gradient (see [`Linear::set_input_grad`]).
    input_grad: bool,
    /// Forward scratch: the weight transposed to `[in, out]` (see [`TRANSPOSE_MAX_WEIGHT`]).
    weight_transposed: Vec<f32>,
}

impl Linear {
    /// A layer initialized like PyTorch's `nn.Linear`: weight and bias both drawn from
    /// U(−1/√in, 1/√in) (Kaiming-uniform with a = √5).
    pub fn new(in_features: usize, out_features: usize, rng: &mut impl Rng) -> Self {
        let bound = 1.0 / (in_features.max(1) as f32).sqrt();
        let weight = uniform(in_features * out_features, bound, rng);
        let bias = uniform(out_features, bound, rng);
        Self::from_values(in_features, out_features, weight, bias)
    }

    /// A layer with weight drawn from N(0, `std`²) and a zero bias (GPT-style init, std 0.02).
    pub fn with_init(
        in_features: usize,
        out_features: usize,
        std: f32,
        rng: &mut impl Rng,
    ) -> Self {
        let weight = crate::layers::embedding::normal_values(in_features * out_features, std, rng);
        Self::from_values(in_features, out_features, weight, vec![0.0; out_features])
    }

    /// A layer with the given weight (`[out, in]`, row-major) and bias (`[out]`).
    ///
    /// # Panics
    /// When a feature count is zero or the lengths do not match the shapes (an engine bug:
    /// model shapes are fixed in code).
    pub fn from_values(
        in_features: usize,
        out_features: usize,
        weight: Vec<f32>,
        bias: Vec<f32>,
    ) -> Self {
        assert!(
            in_features > 0 && out_features > 0,
            "linear {in_features}→{out_features}"
        );
        Self {
            in_features,
            out_features,
            params: vec![
                Param::new("weight", &[out_features, in_features], weight),
                Param::new("bias", &[out_features], bias),
            ],
            cached_input: Vec::new(),
            cached_shape: Vec::new(),
            input_grad: true,
            weight_transposed: Vec::new(),
        }
    }

    /// Chooses whether `backward` computes the gradient w.r.t. the input (default `true`).
    ///
    /// The first layer of a model has no consumer for its input gradient; turning it off
    /// skips the `g·W` product (a quarter of an MLP's backward FLOPs). `backward` then
    /// returns a zero tensor of the input's shape.
    pub fn set_input_grad(&mut self, enabled: bool) {
        self.input_grad = enabled;
    }

    /// The weight, `[out, in]` row-major.
    pub fn weight(&self) -> &[f32] {
        &self.params[WEIGHT].value
    }

    /// The bias, `[out]`.
    pub fn bias(&self) -> &[f32] {
        &self.params[BIAS].value
    }

    fn output_shape(&self, input_shape: &[usize]) -> Vec<usize> {
        let mut shape = input_shape.to_vec();
        match shape.last_mut() {
            Some(last) => *last = self.out_features,
            None => shape.push(self.out_features),
        }
        shape
    }
}

/// `len` values from U(−bound, bound).
fn uniform(len: usize, bound: f32, rng: &mut impl Rng) -> Vec<f32> {
    if bound <= 0.0 {
        return vec![0.0; len];
    }
    (0..len).map(|_| rng.random_range(-bound..bound)).collect()
}

/// Writes the transpose of the row-major `[rows, cols]` matrix `src` into `dst` (`[cols, rows]`).
///
/// # Panics
/// When a slice is shorter than `rows * cols` (an engine bug).
pub fn transpose(dst: &mut [f32], src: &[f32], rows: usize, cols: usize) {
    assert!(
        src.len() >= rows * cols && dst.len() >= rows * cols,
        "transpose operand sizes"
    );
    // Whole 4×4 tiles, visited in 16×16 blocks so both sides stay in L1.
    const TILE: usize = 4;
    const BLOCK: usize = 16;
    let (tiled_rows, tiled_cols) = (rows / TILE * TILE, cols / TILE * TILE);
    for r0 in (0..tiled_rows).step_by(BLOCK) {
        for c0 in (0..tiled_cols).step_by(BLOCK) {
            for r in (r0..(r0 + BLOCK).min(tiled_rows)).step_by(TILE) {
                for c in (c0..(c0 + BLOCK).min(tiled_cols)).step_by(TILE) {
                    transpose_tile(dst, src, rows, cols, r, c);
                }
            }
        }
    }
    // Ragged right columns and bottom rows.
    for r in 0..rows {
        for c in tiled_cols..cols {
            dst[c * rows + r] = src[r * cols + c];
        }
    }
    for r in tiled_rows..rows {
        for c in 0..tiled_cols {
            dst[c * rows + r] = src[r * cols + c];
        }
    }
}

/// Transposes the 4×4 tile whose top-left corner is `src[r][c]` into `dst[c][r]`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn transpose_tile(dst: &mut [f32], src: &[f32], rows: usize, cols: usize, r: usize, c: usize) {
    use std::arch::x86_64::{
        _mm_loadu_ps, _mm_movehl_ps, _mm_movelh_ps, _mm_storeu_ps, _mm_unpackhi_ps, _mm_unpacklo_ps,
    };
    debug_assert!(r + 4 <= rows && c + 4 <= cols);
    // Bounds for the raw accesses below: the last element read is src[(r+3)*cols + c+3] and
    // the last written is dst[(c+3)*rows + r+3], both < rows*cols <= the slice lengths.
    assert!((r + 3) * cols + c + 3 < src.len() && (c + 3) * rows + r + 3 < dst.len());
    // SAFETY: SSE is part of the x86_64 baseline; every pointer stays inside its slice
    // (checked above); unaligned loads/stores are used; `dst` and `src` are distinct borrows.
    unsafe {
        let p = src.as_ptr().add(r * cols + c);
        let a0 = _mm_loadu_ps(p);
        let a1 = _mm_loadu_ps(p.add(cols));
        let a2 = _mm_loadu_ps(p.add(2 * cols));
        let a3 = _mm_loadu_ps(p.add(3 * cols));
        let lo01 = _mm_unpacklo_ps(a0, a1);
        let lo23 = _mm_unpacklo_ps(a2, a3);
        let hi01 = _mm_unpackhi_ps(a0, a1);
        let hi23 = _mm_unpackhi_ps(a2, a3);
        let q = dst.as_mut_ptr().add(c * rows + r);
        _mm_storeu_ps(q, _mm_movelh_ps(lo01, lo23));
        _mm_storeu_ps(q.add(rows), _mm_movehl_ps(lo23, lo01));
        _mm_storeu_ps(q.add(2 * rows), _mm_movelh_ps(hi01, hi23));
        _mm_storeu_ps(q.add(3 * rows), _mm_movehl_ps(hi23, hi01));
    }
}

/// Transposes the 4×4 tile whose top-left corner is `src[r][c]` into `dst[c][r]`.
#[cfg(not(target_arch = "x86_64"))]
#[inline(always)]
fn transpose_tile(dst: &mut [f32], src: &[f32], rows: usize, cols: usize, r: usize, c: usize) {
    for i in 0..4 {
        for j in 0..4 {
            dst[(c + j) * rows + r + i] = src[(r + i) * cols + c + j];
        }
    }
}

impl Layer for Linear {
    fn kind(&self) -> &'static str {
        "linear"
    }

    fn forward(&mut self, input: &Tensor, train: bool) -> Tensor {
        let (k, n) = (self.in_features, self.out_features);
        assert_eq!(
            input.last_dim(),
            k,
            "linear: input last dim {:?} vs in_features {k}",
            input.shape
        );
        let rows = input.rows();
        let weight = &self.params[WEIGHT].value;
        let bias = &self.params[BIAS].value;
        // Start every output row at the bias, then accumulate x·Wᵀ on top of it.
        let mut out_data = bias.repeat(rows);
        if rows >= TRANSPOSE_MIN_ROWS && weight.len() <= TRANSPOSE_MAX_WEIGHT {
            self.weight_transposed.resize(weight.len(), 0.0);
            transpose(&mut self.weight_transposed, weight, n, k);
            matmul(
                &mut out_data,
                &input.data,
                &self.weight_transposed,
                rows,
                k,
                n,
                false,
                false,
                true,
            );
        } else {
            matmul(
                &mut out_data,
                &input.data,
                weight,
                rows,
                k,
                n,
                false,
                true,
                true,
            );
        }
        let out = Tensor::from_vec(&self.output_shape(&input.shape), out_data);
        if train {
            self.cached_input.clear();
            self.cached_input.extend_from_slice(&input.data);
            self.cached_shape.clear();
            self.cached_shape.extend_from_slice(&input.shape);
        }
        out
    }

    fn backward(&mut self, grad_output: &Tensor) -> Tensor {
        let (k, n) = (self.in_features, self.out_features);
        let rows = self.cached_input.len() / k.max(1);
        assert_eq!(
            grad_output.len(),
            rows * n,
            "linear: backward without matching forward"
        );
        let g = &grad_output.data;
        let (weight, bias) = self.params.split_at_mut(BIAS);
        let (weight, bias) = (&mut weight[WEIGHT], &mut bias[0]);
        // dW[out, in] = gᵀ · x.
        matmul(
            &mut weight.grad,
            g,
            &self.cached_input,
            n,
            rows,
            k,
            true,
            false,
            false,
        );
        // db = column sums of g.
        bias.grad.fill(0.0);
        for grad_row in g.chunks_exact(n) {
            for (acc, v) in bias.grad.iter_mut().zip(grad_row) {
                *acc += v;
            }
        }
        let mut grad_input = Tensor::zeros(&self.cached_shape);
        if self.input_grad {
            // dx[rows, in] = g · W.
            matmul(
                &mut grad_input.data,
                g,
                &weight.value,
                rows,
                n,
                k,
                false,
                false,
                false,
            );
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
        (self.in_features * self.out_features) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gradcheck::{check_layer, pseudo_random};
    use proptest::prelude::*;
    use rand::SeedableRng;
    use rand_chacha::ChaCha8Rng;

    #[test]
    fn gradients_match_finite_differences_for_2d_input() {
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        let mut layer = Linear::new(5, 4, &mut rng);
        let input = Tensor::from_vec(&[3, 5], pseudo_random(15, 7));
        check_layer(&mut layer, &input, true, 1e-2, 1e-2);
    }

    #[test]
    fn gradients_match_finite_differences_for_3d_input() {
        let mut rng = ChaCha8Rng::seed_from_u64(2);
        let mut layer = Linear::new(4, 3, &mut rng);
        // 16 rows: forward takes the transposed-weight path.
        let input = Tensor::from_vec(&[2, 8, 4], pseudo_random(64, 8));
        let out = layer.forward(&input, false);
        assert_eq!(out.shape, vec![2, 8, 3]);
        check_layer(&mut layer, &input, true, 1e-2, 1e-2);
    }

    #[test]
    fn forward_matches_hand_computed_values() {
        // W = [[1, 2], [3, 4], [5, 6]], b = [0.5, -1, 2], x = [1, -1].
        let mut layer = Linear::from_values(
            2,
            3,
            vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0],
            vec![0.5, -1.0, 2.0],
        );
        let out = layer.forward(&Tensor::from_vec(&[1, 2], vec![1.0, -1.0]), false);
        assert_eq!(out.data, vec![-0.5, -2.0, 1.0]);
    }

    #[test]
    fn disabled_input_grad_keeps_param_grads_and_returns_zeros() {
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        let mut full = Linear::new(6, 4, &mut rng);
        let mut skip = Linear::from_values(6, 4, full.weight().to_vec(), full.bias().to_vec());
        skip.set_input_grad(false);
        let input = Tensor::from_vec(&[5, 6], pseudo_random(30, 9));
        let grad_out = Tensor::from_vec(&[5, 4], pseudo_random(20, 10));
        full.forward(&input, true);
        skip.forward(&input, true);
        let dx_full = full.backward(&grad_out);
        let dx_skip = skip.backward(&grad_out);
        assert_eq!(full.params(), skip.params());
        assert_eq!(dx_skip.shape, input.shape);
        assert!(dx_skip.data.iter().all(|v| *v == 0.0));
        assert!(dx_full.data.iter().any(|v| *v != 0.0));
    }

    #[test]
    fn transposed_forward_matches_direct_forward() {
        // 32 rows of a 40→24 layer take the transpose path; one row takes the direct path.
        let mut rng = ChaCha8Rng::seed_from_u64(6);
        let mut layer = Linear::new(40, 24, &mut rng);
        let input = Tensor::from_vec(&[32, 40], pseudo_random(32 * 40, 11));
        let batched = layer.forward(&input, false);
        for (r, want_row) in batched.data.chunks_exact(24).enumerate() {
            let row = Tensor::from_vec(&[1, 40], input.data[r * 40..(r + 1) * 40].to_vec());
            let got = layer.forward(&row, false);
            for (g, w) in got.data.iter().zip(want_row) {
                assert!((g - w).abs() < 1e-5, "row {r}: {g} vs {w}");
            }
        }
    }

    proptest! {
        #[test]
        fn transpose_matches_naive(rows in 0usize..23, cols in 0usize..23, seed in 0u64..1000) {
            let src = pseudo_random(rows * cols, seed);
            let mut dst = vec![f32::NAN; rows * cols];
            transpose(&mut dst, &src, rows, cols);
            for r in 0..rows {
                for c in 0..cols {
                    prop_assert_eq!(dst[c * rows + r], src[r * cols + c]);
                }
            }
        }
    }

    #[test]
    fn init_matches_pytorch_bounds_and_is_seeded() {
        let layer = Linear::new(100, 50, &mut ChaCha8Rng::seed_from_u64(4));
        let bound = 0.1;
        assert!(layer
            .weight()
            .iter()
            .chain(layer.bias())
            .all(|v| v.abs() <= bound));
        let spread = layer.weight().iter().fold(0.0f32, |m, v| m.max(v.abs()));
        assert!(
            spread > 0.09,
            "weights should fill the range, max |w| = {spread}"
        );
        let again = Linear::new(100, 50, &mut ChaCha8Rng::seed_from_u64(4));
        assert_eq!(layer.params(), again.params());
        assert_eq!(layer.forward_macs_per_sample(), 5000);
    }

    #[test]
    fn normal_init_has_requested_std_and_zero_bias() {
        let layer = Linear::with_init(200, 100, 0.02, &mut ChaCha8Rng::seed_from_u64(5));
        let w = layer.weight();
        let mean = w.iter().sum::<f32>() / w.len() as f32;
        let var = w.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / w.len() as f32;
        assert!(mean.abs() < 1e-3, "mean {mean}");
        assert!((var.sqrt() - 0.02).abs() < 1e-3, "std {}", var.sqrt());
        assert!(layer.bias().iter().all(|v| *v == 0.0));
    }
}
