//! The `gpt-tiny` layers mirrored in libtorch (engine `models::gpt`, `layers::{embedding,
//! block, attention}`): what each becomes (checked against its parameters) and its forward.
//!
//! Read off the engine's forward code:
//!
//! * `embed` ([`Embedding`]): `out[b, t] = token[id[b, t]] + position[t]`, ids `[B, T]` carried
//!   as f32, `T ≤ context`. Ids are checked on the device (integral, in `0..vocab`) before the
//!   lookup, so a bad batch is an error, not a CUDA device-side assert.
//! * `block{i}` ([`Block`]): **pre-LN** residual block, `x += attn(ln1(x))`, then
//!   `x += mlp(ln2(x))`; LayerNorm eps 1e-5 (biased variance); attention: one `qkv` linear
//!   (`[q | k | v]` along the features, head `h` at columns `h·hd..(h+1)·hd` of each), scores
//!   `q·kᵀ / √hd`, causal mask, softmax, `· v`, heads concatenated, `proj` linear; MLP:
//!   `fc` (4·dim) → **tanh-approximate GELU** → `proj`. No dropout.
//! * `head` ([`LmHead`]): final LayerNorm (eps 1e-5) → `proj` linear to the vocabulary (its
//!   own weight: **not** tied to the token embedding), output `[B·T, vocab]`.

use std::any::Any;

use engine::layer::Layer;
use engine::layers::block::Block;
use engine::layers::embedding::Embedding;
use engine::models::gpt::LmHead;
use tch::{Kind, TchError, Tensor};

use super::ops::Op;
use super::unit::TchUnit;
use crate::TchBackendError;

/// LayerNorm eps of the engine's blocks and head (`layers::block::ops::LN_EPS`).
const LN_EPS: f64 = 1e-5;

/// Parameter names of an engine [`Block`], in order.
const BLOCK_PARAMS: [&str; 12] = [
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
    "mlp.proj.bias",
];

/// The op of a gpt layer (`embedding`, `block`, `lm_head`); `None` for other kinds.
pub(super) fn op_of(name: &str, layer: &dyn Layer) -> Option<Result<Op, TchBackendError>> {
    let kind = layer.kind();
    let unsupported = |detail: String| TchBackendError::UnsupportedLayer {
        name: name.to_string(),
        kind: kind.to_string(),
        detail,
    };
    let any: &dyn Any = layer;
    let params = layer.params();
    let shapes: Vec<&[usize]> = params.iter().map(|p| p.shape.as_slice()).collect();
    let names: Vec<&str> = params.iter().map(|p| p.name.as_str()).collect();
    let check = |want_names: &[&str], want_shapes: &[&[usize]], op: Op| {
        if names == want_names && shapes == want_shapes {
            Ok(op)
        } else {
            Err(unsupported(format!(
                "expected params {want_names:?} {want_shapes:?}, found {names:?} {shapes:?}"
            )))
        }
    };
    Some(match kind {
        "embedding" => match any.downcast_ref::<Embedding>() {
            None => Err(unsupported(
                "kind `embedding` but not engine's Embedding".into(),
            )),
            Some(e) => check(
                &["token", "position"],
                &[&[e.vocab, e.dim], &[e.context, e.dim]],
                Op::Embedding {
                    vocab: e.vocab as i64,
                },
            ),
        },
        "block" => match any.downcast_ref::<Block>() {
            None => Err(unsupported("kind `block` but not engine's Block".into())),
            Some(b) if b.heads == 0 || b.dim % b.heads != 0 => Err(unsupported(format!(
                "dim {} not a multiple of heads {}",
                b.dim, b.heads
            ))),
            Some(b) => {
                let (d, h) = (b.dim, 4 * b.dim);
                check(
                    &BLOCK_PARAMS,
                    &[
                        &[d],
                        &[d],
                        &[3 * d, d],
                        &[3 * d],
                        &[d, d],
                        &[d],
                        &[d],
                        &[d],
                        &[h, d],
                        &[h],
                        &[d, h],
                        &[d],
                    ],
                    Op::GptBlock {
                        heads: b.heads as i64,
                    },
                )
            }
        },
        "lm_head" => match any.downcast_ref::<LmHead>() {
            None => Err(unsupported("kind `lm_head` but not engine's LmHead".into())),
            Some(l) => check(
                &["ln.weight", "ln.bias", "proj.weight", "proj.bias"],
                &[&[l.dim], &[l.dim], &[l.vocab, l.dim], &[l.vocab]],
                Op::LmHead,
            ),
        },
        _ => return None,
    })
}

/// Token + position embedding of `ids` (`[B, T]`, f32) with the unit's `[token, position]`.
pub(super) fn embedding(ids: &Tensor, unit: &TchUnit, vocab: i64) -> Result<Tensor, TchError> {
    let (token, position) = (&unit.params[0].value, &unit.params[1].value);
    let size = ids.size();
    let context = position.size()[0];
    let &[_, seq] = size.as_slice() else {
        return Err(TchError::Shape(format!(
            "embedding expects token ids [B, T], got {size:?}"
        )));
    };
    if seq > context {
        return Err(TchError::Shape(format!(
            "sequence of {seq} tokens is longer than the context {context}"
        )));
    }
    let ids = ids.f_to_kind(Kind::Float)?;
    let bad = ids
        .f_lt(0.0)?
        .f_logical_or(&ids.f_ge(vocab as f64)?)?
        .f_logical_or(&ids.f_frac()?.f_ne(0.0)?)?
        .f_any()?;
    if bad.f_int64_value(&[])? != 0 {
        return Err(TchError::Torch(format!(
            "token ids must be integers in 0..{vocab}"
        )));
    }
    let ids = ids.f_to_kind(Kind::Int64)?;
    let tok = Tensor::f_embedding(token, &ids, -1, false, false)?;
    tok.f_add(&position.f_narrow(0, 0, seq)?)
}

fn layer_norm(x: &Tensor, weight: &Tensor, bias: &Tensor) -> Result<Tensor, TchError> {
    let dim = weight.size()[0];
    x.f_layer_norm([dim], Some(weight), Some(bias), LN_EPS, true)
}

/// Causal multi-head self-attention of `x` (`[B, T, d]`, already normalized) with
/// `qkv.weight`, `qkv.bias`, `proj.weight`, `proj.bias` = `p[0..4]`.
fn attention(x: &Tensor, p: &[&Tensor], heads: i64) -> Result<Tensor, TchError> {
    let size = x.size();
    let (batch, seq, dim) = (size[0], size[1], size[2]);
    let hd = dim / heads;
    let qkv = x.f_linear(p[0], Some(p[1]))?;
    let split = |i: i64| -> Result<Tensor, TchError> {
        qkv.f_narrow(-1, i * dim, dim)?
            .f_reshape([batch, seq, heads, hd])?
            .f_transpose(1, 2)
    };
    let (q, k, v) = (split(0)?, split(1)?, split(2)?);
    let scale = 1.0 / (hd as f64).sqrt();
    let y = Tensor::f_scaled_dot_product_attention(
        &q,
        &k,
        &v,
        None::<Tensor>,
        0.0,
        true,
        scale,
        false,
    )?;
    let y = y.f_transpose(1, 2)?.f_reshape([batch, seq, dim])?;
    y.f_linear(p[2], Some(p[3]))
}

/// The engine's pre-LN transformer block on `x` (`[B, T, d]`).
pub(super) fn block(x: &Tensor, unit: &TchUnit, heads: i64) -> Result<Tensor, TchError> {
    let p: Vec<&Tensor> = unit.params.iter().map(|p| &p.value).collect();
    let size = x.size();
    if size.len() != 3 || size[2] != p[0].size()[0] {
        return Err(TchError::Shape(format!(
            "block expects [B, T, {}], got {size:?}",
            p[0].size()[0]
        )));
    }
    let x = x.f_add(&attention(&layer_norm(x, p[0], p[1])?, &p[2..6], heads)?)?;
    let h = layer_norm(&x, p[6], p[7])?
        .f_linear(p[8], Some(p[9]))?
        .f_gelu("tanh")?
        .f_linear(p[10], Some(p[11]))?;
    x.f_add(&h)
}

/// Final LayerNorm and projection: `[.., d]` → `[rows, vocab]`.
pub(super) fn lm_head(x: &Tensor, unit: &TchUnit) -> Result<Tensor, TchError> {
    let p: Vec<&Tensor> = unit.params.iter().map(|p| &p.value).collect();
    let vocab = p[2].size()[0];
    layer_norm(x, p[0], p[1])?
        .f_linear(p[2], Some(p[3]))?
        .f_reshape([-1, vocab])
}
