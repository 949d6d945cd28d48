//! The forward ops a stage is made of: the mirrored engine layers (what each engine layer
//! becomes, checked against its parameters; the `gpt-tiny` layers in [`super::gpt`]) and the
//! ResNet ops (implemented in [`super::resnet`]).

use std::any::Any;

use engine::layer::Layer;
use engine::layers::conv::Conv2d;
use engine::layers::linear::Linear;
use engine::layers::pool::MaxPool2d;
use tch::{TchError, Tensor};

use super::unit::{TchParam, TchUnit};
use super::{gpt, resnet};
use crate::TchBackendError;

/// One step of a stage's forward.
#[derive(Clone, Copy, Debug)]
pub(super) enum Op {
    /// `[N, ...] → [N, prod(...)]`.
    Flatten,
    Relu,
    MaxPool {
        kernel: i64,
        stride: i64,
    },
    /// Uses the stage unit's `[weight, bias]`.
    Linear,
    /// Uses the stage unit's `[weight, bias]`.
    Conv2d {
        stride: i64,
        padding: i64,
    },
    /// ResNet stem: conv 3x3 → BatchNorm → ReLU (see [`super::resnet`]).
    ResStem,
    /// ResNet basic block (see [`super::resnet`]); `stride` 2 with option-A shortcut.
    ResBlock {
        stride: i64,
        in_planes: i64,
        planes: i64,
    },
    /// ResNet head: global average pool → linear.
    ResHead,
    /// GPT token + position embedding (see [`super::gpt`]); ids `[B, T]` → `[B, T, dim]`.
    Embedding {
        vocab: i64,
    },
    /// GPT pre-LN transformer block (see [`super::gpt`]).
    GptBlock {
        heads: i64,
    },
    /// GPT final LayerNorm + projection to the vocabulary, `[B·T, vocab]`.
    LmHead,
}

/// What a layer of the engine model becomes.
pub(super) fn op_of(name: &str, layer: &dyn Layer) -> Result<Op, TchBackendError> {
    let kind = layer.kind();
    let unsupported = |detail: &str| TchBackendError::UnsupportedLayer {
        name: name.to_string(),
        kind: kind.to_string(),
        detail: detail.to_string(),
    };
    if let Some(op) = gpt::op_of(name, layer) {
        return op;
    }
    let any: &dyn Any = layer;
    let params = layer.params();
    let shapes: Vec<&[usize]> = params.iter().map(|p| p.shape.as_slice()).collect();
    let names: Vec<&str> = params.iter().map(|p| p.name.as_str()).collect();
    match kind {
        "flatten" if params.is_empty() => Ok(Op::Flatten),
        "relu" if params.is_empty() => Ok(Op::Relu),
        "maxpool2d" => {
            let pool = any
                .downcast_ref::<MaxPool2d>()
                .ok_or_else(|| unsupported("kind `maxpool2d` but not engine's MaxPool2d"))?;
            Ok(Op::MaxPool {
                kernel: pool.kernel() as i64,
                stride: pool.stride() as i64,
            })
        }
        "linear" => {
            let linear = any
                .downcast_ref::<Linear>()
                .ok_or_else(|| unsupported("kind `linear` but not engine's Linear"))?;
            let (i, o) = (linear.in_features, linear.out_features);
            if names != ["weight", "bias"] || shapes != [&[o, i][..], &[o][..]] {
                return Err(unsupported(&format!(
                    "expected params weight [{o}, {i}] and bias [{o}], found {names:?} {shapes:?}"
                )));
            }
            Ok(Op::Linear)
        }
        "conv2d" => {
            let conv = any
                .downcast_ref::<Conv2d>()
                .ok_or_else(|| unsupported("kind `conv2d` but not engine's Conv2d"))?;
            let (i, o, k) = (conv.in_ch(), conv.out_ch(), conv.kernel());
            if names != ["weight", "bias"] || shapes != [&[o, i, k, k][..], &[o][..]] {
                return Err(unsupported(&format!(
                    "expected params weight [{o}, {i}, {k}, {k}] and bias [{o}], found {names:?} {shapes:?}"
                )));
            }
            Ok(Op::Conv2d {
                stride: conv.stride() as i64,
                padding: conv.padding() as i64,
            })
        }
        _ => Err(unsupported(
            "supported kinds: flatten, linear, relu, conv2d, maxpool2d, embedding, block, lm_head",
        )),
    }
}

/// Runs `op` on `x` with the stage unit's tensors (`unit`: `None` for the parameter-free
/// prefix); `train` selects BatchNorm's batch statistics (and updates the running ones).
pub(super) fn apply(
    op: Op,
    x: &Tensor,
    unit: Option<&TchUnit>,
    train: bool,
) -> Result<Tensor, TchError> {
    let params: &[TchParam] = unit.map_or(&[][..], |u| u.params.as_slice());
    let need_unit = || unit.ok_or_else(|| TchError::Torch(format!("{op:?} needs a unit")));
    match op {
        Op::ResStem => resnet::stem(x, need_unit()?, train),
        Op::ResBlock {
            stride,
            in_planes,
            planes,
        } => resnet::block(x, need_unit()?, stride, in_planes, planes, train),
        Op::ResHead => resnet::head(x, need_unit()?),
        Op::Embedding { vocab } => gpt::embedding(x, need_unit()?, vocab),
        Op::GptBlock { heads } => gpt::block(x, need_unit()?, heads),
        Op::LmHead => gpt::lm_head(x, need_unit()?),
        Op::Flatten => {
            let batch = x.size().first().copied().unwrap_or(1);
            x.f_reshape([batch, -1])
        }
        Op::Relu => x.f_relu(),
        Op::MaxPool { kernel, stride } => {
            x.f_max_pool2d([kernel, kernel], [stride, stride], [0, 0], [1, 1], false)
        }
        Op::Linear => x.f_linear(&params[0].value, Some(&params[1].value)),
        Op::Conv2d { stride, padding } => x.f_conv2d(
            &params[0].value,
            Some(&params[1].value),
            [stride, stride],
            [padding, padding],
            [1, 1],
            1,
        ),
    }
}
