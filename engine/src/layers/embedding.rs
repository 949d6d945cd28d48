//! Token + learned positional embeddings for character models, and the small normal
//! sampler (Box–Muller) the transformer layers use for their N(0, σ²) initialization.

use rand::{Rng, RngCore};

use crate::layer::{Layer, Param};
use crate::layers::block::INIT_STD;
use crate::tensor::Tensor;

/// `len` independent samples of N(0, `std`²) by the Box–Muller transform.
pub fn normal_values(len: usize, std: f32, rng: &mut dyn RngCore) -> Vec<f32> {
    let mut out = Vec::with_capacity(len + 1);
    while out.len() < len {
        // u1 ∈ (0, 1] keeps ln(u1) finite.
        let u1 = 1.0 - rng.random::<f64>();
        let u2 = rng.random::<f64>();
        let radius = (-2.0 * u1.ln()).sqrt();
        let angle = std::f64::consts::TAU * u2;
        out.push((radius * angle.cos()) as f32 * std);
        out.push((radius * angle.sin()) as f32 * std);
    }
    out.truncate(len);
    out
}

/// Token embedding plus learned absolute position embedding.
///
/// Input `[B, T]` of token ids carried as exact integers in f32, `T ≤ context`;
/// output `[B, T, dim]` with `out[b, t] = token[id[b, t]] + position[t]`.
/// Parameters: `token` `[vocab, dim]` and `position` `[context, dim]`, both N(0, 0.02²).
///
/// Token ids are validated by the data pipeline (the corpus maps every character to an
/// id below its vocabulary size), so an id outside `0..vocab` reaching this layer is an
/// engine bug: `forward` asserts on it rather than returning an error.
pub struct Embedding {
    /// Vocabulary size.
    pub vocab: usize,
    /// Embedding width.
    pub dim: usize,
    /// Longest sequence (number of learned positions).
    pub context: usize,
    params: Vec<Param>,
    /// Token ids of the last forward, `[B·T]`.
    ids: Vec<usize>,
    /// `[B, T]` of the last forward.
    batch_seq: (usize, usize),
}

impl Embedding {
    /// A new embedding with N(0, 0.02²) tables.
    pub fn new(vocab: usize, dim: usize, context: usize, rng: &mut impl Rng) -> Self {
        let params = vec![
            Param::new(
                "token",
                &[vocab, dim],
                normal_values(vocab * dim, INIT_STD, rng),
            ),
            Param::new(
                "position",
                &[context, dim],
                normal_values(context * dim, INIT_STD, rng),
            ),
        ];
        Self {
            vocab,
            dim,
            context,
            params,
            ids: Vec::new(),
            batch_seq: (0, 0),
        }
    }
}

impl Layer for Embedding {
    fn kind(&self) -> &'static str {
        "embedding"
    }

    /// # Panics
    /// When the input is not `[B, T]` with `T ≤ context`, or holds an id that is not an
    /// integer in `0..vocab` (the data pipeline guarantees both).
    fn forward(&mut self, input: &Tensor, _train: bool) -> Tensor {
        assert!(
            input.shape.len() == 2 && input.shape[1] <= self.context,
            "embedding expects [B, T ≤ {}], got {:?}",
            self.context,
            input.shape
        );
        let (batch, seq) = (input.shape[0], input.shape[1]);
        self.batch_seq = (batch, seq);
        let d = self.dim;
        self.ids.clear();
        for &v in &input.data {
            assert!(
                v >= 0.0 && v.fract() == 0.0 && (v as usize) < self.vocab,
                "token id {v} outside 0..{}",
                self.vocab
            );
            self.ids.push(v as usize);
        }
        let (token, position) = (&self.params[0].value, &self.params[1].value);
        let mut out = vec![0.0; batch * seq * d];
        for (row, (o, &id)) in out.chunks_exact_mut(d).zip(&self.ids).enumerate() {
            let t = row % seq;
            let (tok, pos) = (&token[id * d..(id + 1) * d], &position[t * d..(t + 1) * d]);
            for i in 0..d {
                o[i] = tok[i] + pos[i];
            }
        }
        Tensor::from_vec(&[batch, seq, d], out)
    }

    /// Scatters the output gradient into the rows of the tables that were used; returns
    /// a zero `[B, T]` gradient because token ids are not differentiable.
    fn backward(&mut self, grad_output: &Tensor) -> Tensor {
        let (batch, seq) = self.batch_seq;
        let d = self.dim;
        assert_eq!(
            grad_output.len(),
            batch * seq * d,
            "embedding backward shape"
        );
        let (token, position) = self.params.split_at_mut(1);
        let (token, position) = (&mut token[0].grad, &mut position[0].grad);
        token.fill(0.0);
        position.fill(0.0);
        for (row, (g, &id)) in grad_output.data.chunks_exact(d).zip(&self.ids).enumerate() {
            let t = row % seq;
            for i in 0..d {
                token[id * d + i] += g[i];
                position[t * d + i] += g[i];
            }
        }
        Tensor::zeros(&[batch, seq])
    }

    fn params(&self) -> &[Param] {
        &self.params
    }

    fn params_mut(&mut self) -> &mut [Param] {
        &mut self.params
    }

    /// A lookup and one addition per token: `dim` adds, no multiplies worth counting.
    fn forward_macs_per_sample(&self) -> u64 {
        self.dim as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gradcheck::check_layer;
    use rand::SeedableRng;
    use rand_chacha::ChaCha8Rng;

    #[test]
    fn embedding_gradients_match_finite_differences() {
        let mut rng = ChaCha8Rng::seed_from_u64(5);
        let mut emb = Embedding::new(6, 8, 4, &mut rng);
        // Repeated ids (3 twice) check that gradients accumulate.
        let ids = Tensor::from_vec(&[2, 4], vec![0.0, 3.0, 5.0, 3.0, 1.0, 1.0, 2.0, 4.0]);
        check_layer(&mut emb, &ids, false, 1e-2, 1e-3);
        let gin = emb.backward(&Tensor::from_vec(&[2, 4, 8], vec![1.0; 64]));
        assert_eq!(gin, Tensor::zeros(&[2, 4]));
    }

    #[test]
    fn embedding_output_is_token_row_plus_position_row() {
        let mut rng = ChaCha8Rng::seed_from_u64(6);
        let mut emb = Embedding::new(5, 3, 4, &mut rng);
        let out = emb.forward(&Tensor::from_vec(&[1, 3], vec![4.0, 0.0, 4.0]), false);
        assert_eq!(out.shape, [1, 3, 3]);
        let (tok, pos) = (&emb.params()[0].value, &emb.params()[1].value);
        for (t, id) in [4usize, 0, 4].into_iter().enumerate() {
            for i in 0..3 {
                assert_eq!(out.data[t * 3 + i], tok[id * 3 + i] + pos[t * 3 + i]);
            }
        }
        // Same token at different positions differs only by the position rows.
        assert_ne!(out.data[0..3], out.data[6..9]);
    }

    #[test]
    #[should_panic(expected = "outside")]
    fn out_of_range_id_is_caught() {
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        let mut emb = Embedding::new(5, 3, 4, &mut rng);
        emb.forward(&Tensor::from_vec(&[1, 2], vec![1.0, 5.0]), false);
    }

    #[test]
    fn normal_values_have_requested_moments() {
        let mut rng = ChaCha8Rng::seed_from_u64(8);
        let n = 20_001;
        let v = normal_values(n, 0.5, &mut rng);
        assert_eq!(v.len(), n);
        let mean = v.iter().map(|&x| x as f64).sum::<f64>() / n as f64;
        let var = v.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / n as f64;
        assert!(mean.abs() < 0.02, "mean {mean}");
        assert!((var.sqrt() - 0.5).abs() < 0.01, "std {}", var.sqrt());
        // Tails exist but are rare: about 4.6% beyond 2σ for a normal distribution.
        let beyond = v.iter().filter(|x| x.abs() > 1.0).count() as f64 / n as f64;
        assert!((0.035..0.06).contains(&beyond), "beyond 2σ: {beyond}");
    }
}
