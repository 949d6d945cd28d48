//! The staged-vs-plain backward measurement ([`measure_backward_on`]).

use std::time::Instant;

use engine::model::Model;
use engine::optim::OptimizerConfig;
use engine::replica::ModelReplica;
use engine::tensor::Tensor as HostTensor;

use super::device::device_name;
use super::{torch_error, TchReplica};
use crate::{BackwardTiming, TchBackendError};

/// [`measure_backward_on`] on the CPU.
///
/// # Errors
/// See [`measure_backward_on`].
pub fn measure_backward(
    model: &Model,
    input: &HostTensor,
    targets: &[usize],
    reps: usize,
) -> Result<BackwardTiming, TchBackendError> {
    measure_backward_on(model, input, targets, reps, "cpu")
}

/// Mean ms of forward + staged backward (the replica's `forward_backward`, no-op hook)
/// against forward + one plain `loss.backward()` over the same model without detached
/// boundaries, interleaved rep by rep (alternating which goes first) after one warm-up of each.
///
/// # Errors
/// An unsupported model, a bad device, a batch that does not fit, a libtorch error.
pub fn measure_backward_on(
    model: &Model,
    input: &HostTensor,
    targets: &[usize],
    reps: usize,
    device: &str,
) -> Result<BackwardTiming, TchBackendError> {
    let mut replica = TchReplica::from_model(model, &OptimizerConfig::sgd(), device)?;
    let reps = reps.max(1);
    let mut staged = 0.0f64;
    let mut plain = 0.0f64;
    let time_staged = |replica: &mut TchReplica| -> Result<f64, TchBackendError> {
        let start = Instant::now();
        replica.forward_backward(input, targets, &mut |_, _| {})?;
        replica.synchronize();
        Ok(start.elapsed().as_secs_f64() * 1e3)
    };
    let time_plain = |replica: &mut TchReplica| -> Result<f64, TchBackendError> {
        let start = Instant::now();
        replica.zero_grads().map_err(torch_error)?;
        let logits = replica.forward_plain(input, true).map_err(torch_error)?;
        let loss = replica.loss(&logits, targets)?;
        loss.f_backward().map_err(torch_error)?;
        loss.f_double_value(&[]).map_err(torch_error)?;
        replica.synchronize();
        Ok(start.elapsed().as_secs_f64() * 1e3)
    };
    // One warm-up of each, then alternate which goes first so neither always runs on the
    // other's warm caches.
    time_staged(&mut replica)?;
    time_plain(&mut replica)?;
    for rep in 0..reps {
        if rep % 2 == 0 {
            staged += time_staged(&mut replica)?;
            plain += time_plain(&mut replica)?;
        } else {
            plain += time_plain(&mut replica)?;
            staged += time_staged(&mut replica)?;
        }
    }
    Ok(BackwardTiming {
        staged_ms: staged / reps as f64,
        plain_ms: plain / reps as f64,
        reps,
        device: device_name(replica.device),
    })
}
