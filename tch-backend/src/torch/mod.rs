//! The libtorch implementation (feature `tch`): [`TchReplica`] and what it is made of.
//!
//! * [`device`]: device strings, loading libtorch's CUDA library, probing devices.
//! * [`unit`]: one sync unit's tensors (parameters, BatchNorm buffers) and its flat vectors.
//! * [`optim`]: the engine's optimizers as tensor ops on a unit.
//! * [`ops`]: the forward ops a stage is made of (mirrored engine layers, ResNet blocks).
//! * [`gpt`]: the `gpt-tiny` layers (embedding, pre-LN block, LM head).
//! * [`replica`]: [`TchReplica`], its staged forward/backward and the replica seam.
//! * [`resnet`]: the ResNet-20 constructor (BatchNorm, basic blocks).
//! * [`script`]: TorchScript modules (bring your own model).
//! * [`state`]: named tensors with PyTorch `state_dict` names (checkpoints).
//! * [`measure`]: the staged-vs-plain backward measurement.

mod device;
mod gpt;
mod measure;
mod ops;
mod optim;
mod replica;
mod resnet;
mod script;
mod state;
mod unit;

use engine::replica::ReplicaError;
use tch::{Device, TchError, Tensor};

use crate::TchBackendError;

pub use device::{check_device, load_torch_cuda, parse_device};
pub use measure::{measure_backward, measure_backward_on};
pub use replica::TchReplica;

const BACKEND: &str = "tch";

fn backend_error(e: impl std::fmt::Display) -> ReplicaError {
    ReplicaError::Backend {
        backend: BACKEND,
        message: e.to_string(),
    }
}

fn torch_error(e: TchError) -> TchBackendError {
    TchBackendError::Torch(e.to_string())
}

/// Drops the tensor handle an in-place op returns.
fn inplace(r: Result<Tensor, TchError>) -> Result<(), TchError> {
    r.map(drop)
}

fn host_to_device(data: &[f32], shape: &[i64], device: Device) -> Result<Tensor, TchError> {
    Tensor::f_from_slice(data)?
        .f_reshape(shape)?
        .f_to_device(device)
}
