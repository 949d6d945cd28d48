//! dreamddp's libtorch backend: models in libtorch behind the engine's replica seam
//! ([`engine::replica::ModelReplica`]): the built-in models (`mlp`, `cnn`, `gpt-tiny`) rebuilt
//! layer by layer, ResNet-20 with BatchNorm, and TorchScript modules.
//!
//! * [`TchReplica::resnet20`]: the CIFAR ResNet-20 (option-A shortcuts), one unit per block,
//!   BatchNorm running statistics synced with their unit's parameters (they follow the
//!   parameters in the unit's flat values; zeros in its gradients).
//! * [`TchReplica::from_torchscript`]: a module saved by `torch.jit.script`/`trace`, units per
//!   top-level child; one plain backward (tch cannot cut a scripted graph), then every unit is
//!   handed over at once, head first.
//! * [`TchReplica::named_tensors`] / [`TchReplica::load_named_tensors`]: every parameter and
//!   buffer with PyTorch `state_dict` names (checkpoints).
//! * [`TchReplica::from_model`] mirrors an engine [`Model`](engine::model::Model): same layer
//!   names, parameter names, shapes, order and initial values, so one checkpoint loads in both
//!   backends and one cluster can mix them. `gpt-tiny` becomes three kinds of units: `embed`
//!   (token + learned position embedding), `block{i}` (pre-LN transformer block: causal
//!   attention scaled by 1/√head_dim, tanh-approximate GELU MLP, LayerNorm eps 1e-5) and `head`
//!   (final LayerNorm + an untied projection), logits `[B·T, vocab]` for `[B, T]` token ids.
//! * `forward_backward` runs the forward in **stages** (one per parameterized layer, the
//!   parameter-free layers after it fused into its stage) with detached stage boundaries, then a
//!   staged backward: `loss.backward()` for the last stage, then
//!   `(out_k · x_{k+1}.grad).sum().backward()` per earlier stage, handing each unit over the
//!   moment its gradients exist (output head first). tch has no gradient hooks (tch-rs #769).
//! * The engine's optimizers ([`engine::optim`]: SGD with (Nesterov) momentum and L2 decay,
//!   AdamW with decoupled decay, decay only on parameters with ≥ 2 dimensions) run as tensor
//!   ops under `no_grad` on the device, in the engine's order of floating-point operations.
//!
//! Without feature `tch` the crate builds to a stub with the same public API: every
//! constructor returns [`TchBackendError::NotBuilt`], which says how to enable it.

use thiserror::Error;

/// Whether this build links libtorch (feature `tch`).
pub const AVAILABLE: bool = cfg!(feature = "tch");

/// Why the libtorch backend could not be set up or run.
#[derive(Debug, Error)]
pub enum TchBackendError {
    /// This build has no libtorch.
    #[error(
        "this dreamddp was built without libtorch; rebuild with `cargo build --release --features tch` \
         (LIBTORCH pointing at a libtorch 2.13 folder, see README)"
    )]
    NotBuilt,
    /// The device string is not `cpu`, `cuda` or `cuda:N`.
    #[error("unknown device `{0}`: expected `cpu`, `cuda` or `cuda:N`")]
    UnknownDevice(String),
    /// A CUDA device was asked for but libtorch cannot use it.
    #[error(
        "device `{device}`: {reason}; install the CUDA build of libtorch and an NVIDIA driver, \
         or use --device cpu"
    )]
    CudaUnavailable {
        /// The device asked for.
        device: String,
        /// What is missing.
        reason: String,
    },
    /// The model has a layer the tch backend cannot mirror.
    #[error("layer `{name}` of kind `{kind}` is not supported by the tch backend ({detail})")]
    UnsupportedLayer {
        /// Layer name.
        name: String,
        /// Layer kind (`Layer::kind`).
        kind: String,
        /// Why.
        detail: String,
    },
    /// A model constructor's arguments make no model.
    #[error("invalid model configuration: {0}")]
    InvalidConfig(String),
    /// A model file is missing or unreadable.
    #[error("model file `{path}`: {reason}")]
    ModelFile {
        /// The path given.
        path: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A file libtorch cannot load as a TorchScript module.
    #[error(
        "`{path}` is not a TorchScript module ({message}); save one with \
         `torch.jit.script(model).save(path)` (see examples/export_model.py)"
    )]
    NotTorchScript {
        /// The path given.
        path: String,
        /// libtorch's message (first line).
        message: String,
    },
    /// Named tensors (a checkpoint) do not match the model's.
    #[error("tensor `{name}`: {reason}")]
    StateMismatch {
        /// The first offending tensor.
        name: String,
        /// What is wrong.
        reason: String,
    },
    /// libtorch reported an error.
    #[error("libtorch: {0}")]
    Torch(String),
    /// A forward/backward failed (measurement helpers).
    #[error(transparent)]
    Replica(#[from] engine::replica::ReplicaError),
}

/// A device named on the command line, checked for syntax only (see [`parse_device_spec`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceSpec {
    /// The CPU.
    Cpu,
    /// CUDA device `N` (`cuda` is `cuda:0`).
    Cuda(usize),
}

/// Parses `cpu`, `cuda` or `cuda:N` (no libtorch needed; [`check_device`] also checks that
/// the device exists).
///
/// # Errors
/// [`TchBackendError::UnknownDevice`] for anything else.
pub fn parse_device_spec(s: &str) -> Result<DeviceSpec, TchBackendError> {
    let t = s.trim();
    match t {
        "cpu" => Ok(DeviceSpec::Cpu),
        "cuda" => Ok(DeviceSpec::Cuda(0)),
        _ => t
            .strip_prefix("cuda:")
            .and_then(|n| n.parse::<usize>().ok())
            .map(DeviceSpec::Cuda)
            .ok_or_else(|| TchBackendError::UnknownDevice(s.to_string())),
    }
}

/// Mean wall time of one forward + backward, staged (per-unit, detached boundaries) against
/// plain (one `loss.backward()` over the whole graph), measured interleaved in one run.
#[derive(Clone, Debug, PartialEq)]
pub struct BackwardTiming {
    /// Forward + staged backward, ms.
    pub staged_ms: f64,
    /// Forward + one plain backward, ms.
    pub plain_ms: f64,
    /// Measured repetitions of each (after one warm-up of each).
    pub reps: usize,
    /// Device it ran on (`cpu`, `cuda:0`).
    pub device: String,
}

#[cfg(feature = "tch")]
mod torch;
/// The tch crate this backend is built on (its tensors, for callers that hand device memory
/// to a collective).
#[cfg(feature = "tch")]
pub use tch;
#[cfg(feature = "tch")]
pub use torch::{
    check_device, load_torch_cuda, measure_backward, measure_backward_on, parse_device, TchReplica,
};

#[cfg(not(feature = "tch"))]
mod stub;
#[cfg(not(feature = "tch"))]
pub use stub::{check_device, load_torch_cuda, measure_backward, measure_backward_on, TchReplica};

#[cfg(all(test, feature = "tch"))]
mod tests;

#[cfg(test)]
mod api_tests {
    use super::*;

    #[test]
    fn device_specs_parse() {
        assert_eq!(parse_device_spec("cpu").ok(), Some(DeviceSpec::Cpu));
        assert_eq!(parse_device_spec("cuda").ok(), Some(DeviceSpec::Cuda(0)));
        assert_eq!(parse_device_spec("cuda:3").ok(), Some(DeviceSpec::Cuda(3)));
        for bad in ["tpu", "cuda:", "cuda:x", "cuda:-1", "", "gpu"] {
            let err = parse_device_spec(bad).expect_err(bad);
            assert!(
                matches!(err, TchBackendError::UnknownDevice(_)),
                "{bad}: {err}"
            );
        }
    }

    #[cfg(not(feature = "tch"))]
    #[test]
    fn stub_says_how_to_enable_libtorch() {
        const { assert!(!AVAILABLE) };
        let model = engine::models::mlp::mlp(4, &[3], 2, 0);
        let err = TchReplica::from_model(&model, &engine::optim::OptimizerConfig::sgd(), "cpu")
            .err()
            .expect("stub must refuse");
        assert!(matches!(err, TchBackendError::NotBuilt));
        let text = err.to_string();
        assert!(text.contains("--features tch"), "{text}");
        assert!(matches!(
            check_device("cpu"),
            Err(TchBackendError::NotBuilt)
        ));
        let input = engine::tensor::Tensor::zeros(&[1, 4]);
        assert!(matches!(
            measure_backward(&model, &input, &[0], 1),
            Err(TchBackendError::NotBuilt)
        ));
    }
}
