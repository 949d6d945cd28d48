//! Checkpoints PyTorch can read: a model's parameters as a `safetensors` file with PyTorch's
//! parameter names (`fc1.weight`, `conv2.bias`, `block0.attn.qkv.weight`, …) and layouts
//! (`nn.Linear` weights `[out, in]`, `nn.Conv2d` weights `[out, in, kh, kw]`), all `F32`.
//!
//! This module owns the mapping between a [`Model`] and such a file: [`to_safetensors`]
//! serializes every parameter of every layer in forward order (the name is
//! `<layer>.<param>`), [`load_safetensors`] writes a file's tensors into a model after
//! checking that the file holds exactly the model's parameters with the same shapes, and
//! [`CheckpointError`] says what did not fit and what to do. Files are read and written by
//! the caller (durable writes live with the node plumbing); this module works on bytes.
//! `safetensors.torch.load_file(path)` gives a state dict that `nn.Module.load_state_dict`
//! takes for the equivalent PyTorch module (see `examples/pytorch_load_checkpoint.py`).

use std::collections::{BTreeMap, HashMap};

use safetensors::tensor::{Dtype, SafeTensors, TensorView};
use thiserror::Error;

use crate::model::Model;

/// Metadata key naming the model kind that wrote a checkpoint (e.g. `mlp`).
pub const META_MODEL: &str = "dreamddp.model";
/// Metadata key `format` = `pt`, the value Hugging Face tools expect for PyTorch tensors.
pub const META_FORMAT: &str = "format";

/// What can go wrong turning a model into a checkpoint or a checkpoint into a model.
#[derive(Debug, Error)]
pub enum CheckpointError {
    /// The bytes are not a safetensors file.
    #[error("not a readable safetensors file: {0}")]
    Format(String),
    /// A parameter of the model is not in the file.
    #[error(
        "checkpoint has no tensor `{name}` that model `{model}` needs (it has: {present}); \
         was it written for another model or data set?"
    )]
    Missing {
        /// Parameter name.
        name: String,
        /// Model name.
        model: String,
        /// Up to a few names the file does hold.
        present: String,
    },
    /// The file holds tensors the model does not have.
    #[error(
        "checkpoint holds tensors model `{model}` does not have: {names}; \
         was it written for another model?"
    )]
    Unexpected {
        /// Model name.
        model: String,
        /// The first few unexpected names.
        names: String,
    },
    /// A tensor has another shape than the model's parameter.
    #[error(
        "tensor `{name}` has shape {found:?} in the checkpoint but {expected:?} in model \
         `{model}` (another data set or model size?)"
    )]
    Shape {
        /// Parameter name.
        name: String,
        /// Model name.
        model: String,
        /// Shape in the model.
        expected: Vec<usize>,
        /// Shape in the file.
        found: Vec<usize>,
    },
    /// A tensor is not `F32`.
    #[error("tensor `{name}` is {found} in the checkpoint; dreamddp reads F32 tensors only (convert with `tensor.float()` before saving)")]
    Dtype {
        /// Parameter name.
        name: String,
        /// Dtype found.
        found: String,
    },
    /// A value is NaN or infinite.
    #[error("tensor `{name}` holds a non-finite value at element {index}; refusing to load a diverged checkpoint")]
    NonFinite {
        /// Parameter name.
        name: String,
        /// Element index.
        index: usize,
    },
}

/// Every parameter of `model` in forward order as `(name, shape, values)`.
pub fn named_params(model: &Model) -> Vec<(String, Vec<usize>, &[f32])> {
    model
        .layers
        .iter()
        .flat_map(|l| {
            l.layer.params().iter().map(move |p| {
                (
                    format!("{}.{}", l.name, p.name),
                    p.shape.clone(),
                    &p.value[..],
                )
            })
        })
        .collect()
}

/// A named tensor of a model's state: `(name, shape, values)` (row-major `f32`).
pub type NamedTensor = (String, Vec<usize>, Vec<f32>);

/// Serializes every parameter of `model` into safetensors bytes, with `format = pt`, the
/// model's name and the given `extra` metadata.
pub fn to_safetensors(
    model: &Model,
    extra: &BTreeMap<String, String>,
) -> Result<Vec<u8>, CheckpointError> {
    let tensors: Vec<NamedTensor> = named_params(model)
        .into_iter()
        .map(|(n, s, v)| (n, s, v.to_vec()))
        .collect();
    serialize_named(&tensors, &model.name, extra)
}

/// Serializes named tensors (a replica's state: parameters and buffers) into safetensors
/// bytes with `format = pt`, `dreamddp.model = model_name` and `extra`.
pub fn serialize_named(
    tensors: &[NamedTensor],
    model_name: &str,
    extra: &BTreeMap<String, String>,
) -> Result<Vec<u8>, CheckpointError> {
    let views = tensors
        .iter()
        .map(|(name, shape, values)| {
            TensorView::new(Dtype::F32, shape.clone(), bytemuck::cast_slice(values))
                .map(|v| (name.clone(), v))
                .map_err(|e| CheckpointError::Format(format!("{name}: {e}")))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let mut meta: HashMap<String, String> = extra.clone().into_iter().collect();
    meta.insert(META_FORMAT.into(), "pt".into());
    meta.insert(META_MODEL.into(), model_name.to_string());
    safetensors::serialize(views, Some(meta)).map_err(|e| CheckpointError::Format(e.to_string()))
}

/// Writes the tensors of a safetensors file into `model`. The file must hold exactly the
/// model's parameters (same names and shapes, `F32`, finite); on any error `model` is left
/// unchanged. Returns the file's metadata.
pub fn load_safetensors(
    model: &mut Model,
    bytes: &[u8],
) -> Result<BTreeMap<String, String>, CheckpointError> {
    let wanted: Vec<(String, Vec<usize>)> = named_params(model)
        .into_iter()
        .map(|(n, s, _)| (n, s))
        .collect();
    let (decoded, meta) = deserialize_named(bytes, &wanted, &model.name)?;
    let mut it = decoded.into_iter();
    for l in &mut model.layers {
        for p in l.layer.params_mut() {
            if let Some((_, _, v)) = it.next() {
                p.value.copy_from_slice(&v);
            }
        }
    }
    Ok(meta)
}

/// Reads a safetensors file that must hold exactly the tensors `wanted` (names and shapes,
/// `F32`, finite) of model `model_name`; returns them in `wanted`'s order with the file's
/// metadata. Nothing is returned unless every tensor fits.
pub fn deserialize_named(
    bytes: &[u8],
    wanted: &[(String, Vec<usize>)],
    model_name: &str,
) -> Result<(Vec<NamedTensor>, BTreeMap<String, String>), CheckpointError> {
    let (_, header) =
        SafeTensors::read_metadata(bytes).map_err(|e| CheckpointError::Format(e.to_string()))?;
    let meta: BTreeMap<String, String> = header
        .metadata()
        .clone()
        .map(|m| m.into_iter().collect())
        .unwrap_or_default();
    let file =
        SafeTensors::deserialize(bytes).map_err(|e| CheckpointError::Format(e.to_string()))?;
    let present: Vec<String> = {
        let mut n: Vec<String> = file.names().into_iter().map(str::to_string).collect();
        n.sort();
        n
    };
    let unexpected: Vec<&str> = present
        .iter()
        .filter(|n| !wanted.iter().any(|(w, _)| w == *n))
        .map(String::as_str)
        .collect();
    if !unexpected.is_empty() {
        return Err(CheckpointError::Unexpected {
            model: model_name.to_string(),
            names: first_few(&unexpected),
        });
    }
    let mut decoded: Vec<NamedTensor> = Vec::with_capacity(wanted.len());
    for (name, shape) in wanted {
        let view = file.tensor(name).map_err(|_| CheckpointError::Missing {
            name: name.clone(),
            model: model_name.to_string(),
            present: first_few(&present.iter().map(String::as_str).collect::<Vec<_>>()),
        })?;
        if view.dtype() != Dtype::F32 {
            return Err(CheckpointError::Dtype {
                name: name.clone(),
                found: format!("{:?}", view.dtype()),
            });
        }
        if view.shape() != shape.as_slice() {
            return Err(CheckpointError::Shape {
                name: name.clone(),
                model: model_name.to_string(),
                expected: shape.clone(),
                found: view.shape().to_vec(),
            });
        }
        let values: Vec<f32> = view
            .data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        if let Some(index) = values.iter().position(|v| !v.is_finite()) {
            return Err(CheckpointError::NonFinite {
                name: name.clone(),
                index,
            });
        }
        decoded.push((name.clone(), shape.clone(), values));
    }
    Ok((decoded, meta))
}

fn first_few(names: &[&str]) -> String {
    const SHOWN: usize = 6;
    let mut s = names
        .iter()
        .take(SHOWN)
        .copied()
        .collect::<Vec<_>>()
        .join(", ");
    if names.len() > SHOWN {
        s.push_str(&format!(", … ({} in all)", names.len()));
    }
    if s.is_empty() {
        s.push_str("nothing");
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::cnn::cnn;
    use crate::models::mlp::{mlp, MLP_DIGITS_HIDDEN};
    use proptest::prelude::*;

    #[test]
    fn a_checkpoint_round_trips_every_parameter_with_pytorch_names() {
        let a = cnn(1, 8, 8, 10, 7);
        let bytes = to_safetensors(&a, &BTreeMap::new()).unwrap();
        let mut b = cnn(1, 8, 8, 10, 8);
        assert_ne!(a.flat_values(), b.flat_values());
        let meta = load_safetensors(&mut b, &bytes).unwrap();
        assert_eq!(a.flat_values(), b.flat_values());
        assert_eq!(meta.get(META_MODEL).map(String::as_str), Some("cnn"));
        assert_eq!(meta.get(META_FORMAT).map(String::as_str), Some("pt"));
        let file = SafeTensors::deserialize(&bytes).unwrap();
        let mut names: Vec<&str> = file.names().into_iter().collect();
        names.sort();
        assert_eq!(
            names,
            [
                "conv1.bias",
                "conv1.weight",
                "conv2.bias",
                "conv2.weight",
                "fc1.bias",
                "fc1.weight",
                "head.bias",
                "head.weight"
            ]
        );
        assert_eq!(file.tensor("conv1.weight").unwrap().shape(), [16, 1, 5, 5]);
        assert_eq!(file.tensor("fc1.weight").unwrap().shape(), [128, 128]);
    }

    #[test]
    fn a_checkpoint_of_another_model_is_refused_naming_the_tensor() {
        let a = mlp(64, MLP_DIGITS_HIDDEN, 10, 1);
        let bytes = to_safetensors(&a, &BTreeMap::new()).unwrap();
        let mut wider = mlp(64, &[100, 64, 32], 10, 1);
        let before = wider.flat_values();
        let err = load_safetensors(&mut wider, &bytes).unwrap_err();
        assert!(
            matches!(&err, CheckpointError::Shape { name, expected, found, .. }
                if name == "fc1.weight" && expected == &[100, 64] && found == &[128, 64]),
            "{err}"
        );
        assert_eq!(
            wider.flat_values(),
            before,
            "a refused load changed the model"
        );
        let mut other = cnn(1, 8, 8, 10, 1);
        let err = load_safetensors(&mut other, &bytes).unwrap_err();
        assert!(err.to_string().contains("fc3.weight"), "{err}");
    }

    #[test]
    fn a_non_finite_value_is_refused() {
        let mut a = mlp(64, MLP_DIGITS_HIDDEN, 10, 1);
        a.layers[1].layer.params_mut()[0].value[3] = f32::NAN;
        let bytes = to_safetensors(&a, &BTreeMap::new()).unwrap();
        let mut b = mlp(64, MLP_DIGITS_HIDDEN, 10, 1);
        let err = load_safetensors(&mut b, &bytes).unwrap_err();
        assert!(
            matches!(&err, CheckpointError::NonFinite { name, index: 3 } if name == "fc1.weight"),
            "{err}"
        );
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        /// Arbitrary bytes (and every truncation of a real checkpoint) give a typed error or a
        /// successful load, never a panic.
        #[test]
        fn garbage_and_truncated_files_never_panic(
            junk in proptest::collection::vec(any::<u8>(), 0..256),
            cut in 0usize..4000,
        ) {
            let mut m = mlp(64, &[8], 10, 1);
            let _ = load_safetensors(&mut m, &junk);
            let bytes = to_safetensors(&m, &BTreeMap::new()).unwrap();
            let cut = cut.min(bytes.len());
            let r = load_safetensors(&mut m, &bytes[..cut]);
            prop_assert!(r.is_ok() == (cut == bytes.len()));
        }
    }
}
