//! Causal multi-head self-attention.
//!
//! `qkv = x·W_qkvᵀ + b_qkv` (one `[3·dim, dim]` projection), per (batch, head):
//! `P = softmax(mask(Q·Kᵀ / √head_dim))`, `O = P·V`; heads are concatenated and projected
//! by `[dim, dim]`. Position `t` attends to positions `≤ t` only.
//!
//! The math lives in [`AttentionCore`], which works on a borrowed slice of four
//! parameters so that [`crate::layers::block::Block`] can embed it under its own
//! parameter names; [`CausalSelfAttention`] is the standalone layer around it.

use rand::Rng;

use crate::backend::matmul;
use crate::layer::{Layer, Param};
use crate::layers::block::{ops, INIT_STD};
use crate::layers::embedding::normal_values;
use crate::tensor::Tensor;

// Indices inside the four-parameter slice the core works on.
const QKV_W: usize = 0;
const QKV_B: usize = 1;
const PROJ_W: usize = 2;
const PROJ_B: usize = 3;

/// The attention computation with reusable buffers; parameters are passed in as
/// `[qkv.weight [3·dim, dim], qkv.bias [3·dim], proj.weight [dim, dim], proj.bias [dim]]`.
pub(crate) struct AttentionCore {
    dim: usize,
    heads: usize,
    /// `(B, T)` of the last forward.
    batch_seq: (usize, usize),
    /// Input of the last forward, `[B·T, dim]`.
    input: Vec<f32>,
    /// `[B·T, 3·dim]`, reused for the q/k/v gradient in backward.
    qkv: Vec<f32>,
    /// Per-head contiguous copies, each `[B, H, T, head_dim]`.
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    /// Attention probabilities `[B, H, T, T]` (zero above the diagonal).
    probs: Vec<f32>,
    /// Concatenated head outputs `[B·T, dim]` (input of the output projection).
    heads_out: Vec<f32>,
    /// Per-(batch, head) scratch: `[T, head_dim]` ×3 and `[T, T]`.
    head_a: Vec<f32>,
    head_b: Vec<f32>,
    head_c: Vec<f32>,
    scores: Vec<f32>,
}

impl AttentionCore {
    /// A core for `dim`-wide inputs split into `heads` heads.
    ///
    /// # Panics
    /// When `dim` is not a positive multiple of `heads` (a model-definition bug).
    pub(crate) fn new(dim: usize, heads: usize) -> Self {
        assert!(
            heads > 0 && dim > 0 && dim.is_multiple_of(heads),
            "dim {dim} not divisible by heads {heads}"
        );
        Self {
            dim,
            heads,
            batch_seq: (0, 0),
            input: Vec::new(),
            qkv: Vec::new(),
            q: Vec::new(),
            k: Vec::new(),
            v: Vec::new(),
            probs: Vec::new(),
            heads_out: Vec::new(),
            head_a: Vec::new(),
            head_b: Vec::new(),
            head_c: Vec::new(),
            scores: Vec::new(),
        }
    }

    /// Multiply-adds per token of the last forward: projections `4·dim²` plus, on
    /// average over the causal positions, `dim·(T+1)` for scores and weighted values.
    pub(crate) fn macs_per_token(&self) -> u64 {
        let d = self.dim as u64;
        4 * d * d + d * (self.batch_seq.1 as u64 + 1)
    }

    /// Forward of `x` `[batch·seq, dim]` into `out` (same size).
    pub(crate) fn forward(
        &mut self,
        params: &[Param],
        x: &[f32],
        batch: usize,
        seq: usize,
        out: &mut [f32],
    ) {
        let (d, h) = (self.dim, self.heads);
        let hd = d / h;
        let rows = batch * seq;
        assert_eq!(x.len(), rows * d, "attention input size");
        self.batch_seq = (batch, seq);
        self.input.clear();
        self.input.extend_from_slice(x);

        ops::reset(&mut self.qkv, rows * 3 * d);
        ops::linear_forward(
            &mut self.qkv,
            x,
            &params[QKV_W],
            &params[QKV_B],
            rows,
            d,
            3 * d,
        );

        let per_head = seq * hd;
        for buf in [&mut self.q, &mut self.k, &mut self.v] {
            ops::reset(buf, batch * h * per_head);
        }
        ops::reset(&mut self.probs, batch * h * seq * seq);
        ops::reset(&mut self.heads_out, rows * d);
        ops::reset(&mut self.head_a, per_head);
        let scale = 1.0 / (hd as f32).sqrt();

        for b in 0..batch {
            for head in 0..h {
                let bh = b * h + head;
                let span = bh * per_head..(bh + 1) * per_head;
                // Gather this head's q, k, v into contiguous [T, hd] blocks.
                for t in 0..seq {
                    let row = &self.qkv[(b * seq + t) * 3 * d..(b * seq + t + 1) * 3 * d];
                    let dst = span.start + t * hd;
                    let col = head * hd;
                    self.q[dst..dst + hd].copy_from_slice(&row[col..col + hd]);
                    self.k[dst..dst + hd].copy_from_slice(&row[d + col..d + col + hd]);
                    self.v[dst..dst + hd].copy_from_slice(&row[2 * d + col..2 * d + col + hd]);
                }
                let p = &mut self.probs[bh * seq * seq..(bh + 1) * seq * seq];
                matmul(
                    p,
                    &self.q[span.clone()],
                    &self.k[span.clone()],
                    seq,
                    hd,
                    seq,
                    false,
                    true,
                    false,
                );
                for (i, row) in p.chunks_exact_mut(seq).enumerate() {
                    causal_softmax_row(row, i, scale);
                }
                // O = P·V, scattered into the concatenated head output.
                matmul(
                    &mut self.head_a,
                    p,
                    &self.v[span],
                    seq,
                    seq,
                    hd,
                    false,
                    false,
                    false,
                );
                scatter_head(&mut self.heads_out, &self.head_a, b, seq, d, head * hd);
            }
        }
        ops::linear_forward(
            out,
            &self.heads_out,
            &params[PROJ_W],
            &params[PROJ_B],
            rows,
            d,
            d,
        );
    }

    /// Backward of the last forward: **overwrites** the four parameter gradients and
    /// writes the input gradient into `grad_in` (`[batch·seq, dim]`, overwritten).
    pub(crate) fn backward(&mut self, params: &mut [Param], grad_out: &[f32], grad_in: &mut [f32]) {
        let (d, h) = (self.dim, self.heads);
        let hd = d / h;
        let (batch, seq) = self.batch_seq;
        let rows = batch * seq;
        assert_eq!(
            grad_out.len(),
            rows * d,
            "attention backward before forward or shape change"
        );
        let per_head = seq * hd;
        let scale = 1.0 / (hd as f32).sqrt();

        // Output projection. `grad_in` is free until the final q/k/v projection, so it
        // holds d(heads_out) `[rows, dim]` in the meantime.
        {
            let (w, rest) = params[PROJ_W..].split_at_mut(1);
            ops::linear_backward(
                grad_in,
                &mut w[0],
                &mut rest[0],
                grad_out,
                &self.heads_out,
                rows,
                d,
                d,
                false,
            );
        }
        // The q/k/v gradient `[rows, 3·dim]` goes into `qkv` (its forward values are not needed).
        ops::reset(&mut self.qkv, rows * 3 * d);
        ops::reset(&mut self.head_a, per_head);
        ops::reset(&mut self.head_b, per_head);
        ops::reset(&mut self.head_c, per_head);
        ops::reset(&mut self.scores, seq * seq);
        for b in 0..batch {
            for head in 0..h {
                let bh = b * h + head;
                let span = bh * per_head..(bh + 1) * per_head;
                let p = &self.probs[bh * seq * seq..(bh + 1) * seq * seq];
                // head_a = dO [T, hd]
                for t in 0..seq {
                    let src = (b * seq + t) * d + head * hd;
                    self.head_a[t * hd..(t + 1) * hd].copy_from_slice(&grad_in[src..src + hd]);
                }
                // dV = Pᵀ·dO → head_b
                matmul(
                    &mut self.head_b,
                    p,
                    &self.head_a,
                    seq,
                    seq,
                    hd,
                    true,
                    false,
                    false,
                );
                scatter_head(
                    &mut self.qkv,
                    &self.head_b,
                    b,
                    seq,
                    3 * d,
                    2 * d + head * hd,
                );
                // dP = dO·Vᵀ → scores, then dS = P ⊙ (dP − rowsum(P ⊙ dP)) · scale.
                matmul(
                    &mut self.scores,
                    &self.head_a,
                    &self.v[span.clone()],
                    seq,
                    hd,
                    seq,
                    false,
                    true,
                    false,
                );
                for (dp, pr) in self.scores.chunks_exact_mut(seq).zip(p.chunks_exact(seq)) {
                    let dot: f32 = dp.iter().zip(pr).map(|(a, b)| a * b).sum();
                    for (g, &pv) in dp.iter_mut().zip(pr) {
                        *g = pv * (*g - dot) * scale;
                    }
                }
                // dQ = dS·K → head_b ; dK = dSᵀ·Q → head_c
                matmul(
                    &mut self.head_b,
                    &self.scores,
                    &self.k[span.clone()],
                    seq,
                    seq,
                    hd,
                    false,
                    false,
                    false,
                );
                matmul(
                    &mut self.head_c,
                    &self.scores,
                    &self.q[span],
                    seq,
                    seq,
                    hd,
                    true,
                    false,
                    false,
                );
                scatter_head(&mut self.qkv, &self.head_b, b, seq, 3 * d, head * hd);
                scatter_head(&mut self.qkv, &self.head_c, b, seq, 3 * d, d + head * hd);
            }
        }
        let (w, rest) = params[QKV_W..].split_at_mut(1);
        ops::linear_backward(
            grad_in,
            &mut w[0],
            &mut rest[0],
            &self.qkv,
            &self.input,
            rows,
            d,
            3 * d,
            false,
        );
    }
}

/// Copies a `[T, head_dim]` block into columns `col..col+head_dim` of the rows of
/// batch `b` of a `[B·T, width]` matrix.
fn scatter_head(dst: &mut [f32], src: &[f32], b: usize, seq: usize, width: usize, col: usize) {
    let hd = src.len() / seq;
    for t in 0..seq {
        let at = (b * seq + t) * width + col;
        dst[at..at + hd].copy_from_slice(&src[t * hd..(t + 1) * hd]);
    }
}

/// In place: `row ← softmax(scale · row[..=i])`, zero for the masked positions `> i`.
fn causal_softmax_row(row: &mut [f32], i: usize, scale: f32) {
    let (visible, masked) = row.split_at_mut(i + 1);
    let max = visible
        .iter()
        .fold(f32::NEG_INFINITY, |m, &v| m.max(v * scale));
    let mut sum = 0.0;
    for v in visible.iter_mut() {
        *v = (*v * scale - max).exp();
        sum += *v;
    }
    let inv = 1.0 / sum;
    for v in visible.iter_mut() {
        *v *= inv;
    }
    masked.fill(0.0);
}

/// Causal multi-head self-attention over `[B, T, dim]` (output has the same shape).
///
/// Parameters: `qkv.weight` `[3·dim, dim]`, `qkv.bias` `[3·dim]`, `proj.weight`
/// `[dim, dim]`, `proj.bias` `[dim]`; weights N(0, 0.02²), biases zero.
pub struct CausalSelfAttention {
    /// Model width.
    pub dim: usize,
    /// Number of heads (`dim % heads == 0`).
    pub heads: usize,
    params: Vec<Param>,
    core: AttentionCore,
}

impl CausalSelfAttention {
    /// A new attention layer.
    ///
    /// # Panics
    /// When `dim` is not a positive multiple of `heads` (a model-definition bug).
    pub fn new(dim: usize, heads: usize, rng: &mut impl Rng) -> Self {
        let params = vec![
            Param::new(
                "qkv.weight",
                &[3 * dim, dim],
                normal_values(3 * dim * dim, INIT_STD, rng),
            ),
            Param::new("qkv.bias", &[3 * dim], vec![0.0; 3 * dim]),
            Param::new(
                "proj.weight",
                &[dim, dim],
                normal_values(dim * dim, INIT_STD, rng),
            ),
            Param::new("proj.bias", &[dim], vec![0.0; dim]),
        ];
        Self {
            dim,
            heads,
            params,
            core: AttentionCore::new(dim, heads),
        }
    }
}

impl Layer for CausalSelfAttention {
    fn kind(&self) -> &'static str {
        "attention"
    }

    fn forward(&mut self, input: &Tensor, _train: bool) -> Tensor {
        assert!(
            input.shape.len() == 3 && input.shape[2] == self.dim,
            "attention expects [B, T, {}], got {:?}",
            self.dim,
            input.shape
        );
        let mut out = Tensor::zeros(&input.shape);
        self.core.forward(
            &self.params,
            &input.data,
            input.shape[0],
            input.shape[1],
            &mut out.data,
        );
        out
    }

    fn backward(&mut self, grad_output: &Tensor) -> Tensor {
        let mut grad_in = Tensor::zeros(&grad_output.shape);
        self.core
            .backward(&mut self.params, &grad_output.data, &mut grad_in.data);
        grad_in
    }

    fn params(&self) -> &[Param] {
        &self.params
    }

    fn params_mut(&mut self) -> &mut [Param] {
        &mut self.params
    }

    /// Per token, at the sequence length of the last forward.
    fn forward_macs_per_sample(&self) -> u64 {
        self.core.macs_per_token()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gradcheck::{check_layer, pseudo_random};
    use rand::SeedableRng;
    use rand_chacha::ChaCha8Rng;

    fn scrambled(dim: usize, heads: usize, seed: u64) -> CausalSelfAttention {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mut attn = CausalSelfAttention::new(dim, heads, &mut rng);
        for (i, p) in attn.params_mut().iter_mut().enumerate() {
            p.value = pseudo_random(p.len(), seed + 10 + i as u64)
                .iter()
                .map(|v| 0.6 * v)
                .collect();
        }
        attn
    }

    #[test]
    fn attention_gradients_match_finite_differences() {
        let mut attn = scrambled(8, 2, 1);
        let x = Tensor::from_vec(&[2, 4, 8], pseudo_random(64, 2));
        check_layer(&mut attn, &x, true, 1e-2, 2e-2);
    }

    #[test]
    fn attention_is_causal() {
        let mut attn = scrambled(8, 2, 3);
        let x = Tensor::from_vec(&[2, 5, 8], pseudo_random(80, 4));
        let base = attn.forward(&x, false);
        for changed in 0..5 {
            let mut x2 = x.clone();
            for i in 0..8 {
                x2.data[(5 + changed) * 8 + i] += 1.0; // batch 1, position `changed`
            }
            let y = attn.forward(&x2, false);
            for t in 0..5 {
                let (r0, r1) = ((5 + t) * 8, (6 + t) * 8);
                let same = y.data[r0..r1] == base.data[r0..r1];
                assert_eq!(same, t < changed, "position {t} after changing {changed}");
            }
            // Batch 0 is untouched.
            assert_eq!(y.data[..40], base.data[..40]);
        }
    }

    #[test]
    fn first_position_attends_only_to_itself() {
        // With one visible key, the output at t = 0 is proj(v_0) regardless of q and k.
        let mut attn = scrambled(4, 1, 5);
        let x = Tensor::from_vec(&[1, 3, 4], pseudo_random(12, 6));
        let y = attn.forward(&x, false);
        let p = attn.params();
        let (wq, bq, wp, bp) = (&p[0].value, &p[1].value, &p[2].value, &p[3].value);
        let v0: Vec<f32> = (0..4)
            .map(|o| bq[8 + o] + (0..4).map(|i| wq[(8 + o) * 4 + i] * x.data[i]).sum::<f32>())
            .collect();
        for o in 0..4 {
            let want = bp[o] + (0..4).map(|i| wp[o * 4 + i] * v0[i]).sum::<f32>();
            assert!((y.data[o] - want).abs() < 1e-5, "{} vs {want}", y.data[o]);
        }
    }

    #[test]
    fn causal_softmax_rows_sum_to_one_and_mask_the_future() {
        let mut row = [0.3, -1.0, 2.0, 5.0];
        causal_softmax_row(&mut row, 1, 0.5);
        assert!((row[0] + row[1] - 1.0).abs() < 1e-6);
        assert!(row[0] > row[1]);
        assert_eq!(&row[2..], &[0.0, 0.0]);
    }
}
