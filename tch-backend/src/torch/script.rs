//! TorchScript models (bring your own model): [`TchReplica::from_torchscript`] loads a module
//! saved with `torch.jit.script(model).save(path)` or `torch.jit.trace`, and trains its
//! parameters with the engine's optimizers.
//!
//! Sync units are the module's named parameters grouped by top-level child (the name before
//! the first `.`: `features.0.weight` → unit `features`, `0.weight` → unit `0` for an
//! `nn.Sequential`), in the order `named_parameters` gives them (forward order for the usual
//! module definitions).
//!
//! **Limitation: no staged backward.** tch has no gradient hooks (tch-rs #769) and exposes
//! neither a scripted module's children nor its attributes (`CModule` offers `forward`,
//! `method_is` on the module itself and `named_parameters` only), so the forward cannot be
//! cut at unit boundaries. `forward_backward` runs one plain `loss.backward()` and then hands
//! every unit over, output head first, all at once: the sync overlaps nothing with this
//! backward. Buffers (BatchNorm running statistics) are updated by the module itself but are
//! not reachable from tch: they are neither synced nor in [`TchReplica::named_tensors`].

use std::cell::RefCell;
use std::path::Path;

use engine::model::LayerInfo;
use engine::optim::OptimizerConfig;
use engine::replica::ReplicaError;
use engine::tensor::Tensor as HostTensor;
use tch::{CModule, TchError, Tensor};

use super::device::{configure_threads, parse_device};
use super::replica::{first_line, Net, TchReplica};
use super::unit::{TchParam, TchUnit};
use crate::TchBackendError;

/// A loaded TorchScript module and its mode.
pub(super) struct Script {
    module: CModule,
    train: bool,
}

impl Script {
    /// Switches training / evaluation mode (BatchNorm, dropout) when it changes.
    pub fn set_train(&mut self, train: bool) -> Result<(), TchError> {
        if self.train != train {
            if train {
                self.module.f_set_train()?;
            } else {
                self.module.f_set_eval()?;
            }
            self.train = train;
        }
        Ok(())
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor, TchError> {
        self.module.forward_ts(&[x])
    }

    /// The forward with typed errors: an input the module rejects, an output that is not
    /// `[rows, classes]`.
    pub fn forward_checked(&self, x: &Tensor, input: &HostTensor) -> Result<Tensor, ReplicaError> {
        let out = self.forward(x).map_err(|e| {
            ReplicaError::Batch(format!(
                "input of shape {:?} does not fit the TorchScript module: {}",
                input.shape,
                first_line(&e.to_string())
            ))
        })?;
        let size = out.size();
        let rows = input.shape.first().copied().unwrap_or(0) as i64;
        if size.len() != 2 || size[0] != rows {
            return Err(ReplicaError::Batch(format!(
                "the TorchScript module returned shape {size:?} for input {:?}; expected 2-D \
                 logits [{rows}, classes]",
                input.shape
            )));
        }
        Ok(out)
    }
}

impl TchReplica {
    /// Loads the TorchScript module at `path` onto `device` with a fresh `optimizer` per unit.
    ///
    /// Units are the module's parameters grouped by top-level child (the name before the first
    /// `.`), in `named_parameters` order. **No staged backward**: tch has no gradient hooks and
    /// cannot call a scripted module's children, so `forward_backward` runs one plain backward
    /// and then hands every unit over at once, head first. Buffers (BatchNorm statistics) are
    /// the module's own: neither synced nor in [`TchReplica::named_tensors`].
    ///
    /// # Errors
    /// [`TchBackendError::ModelFile`] when `path` is missing or not a file,
    /// [`TchBackendError::NotTorchScript`] when libtorch cannot load it,
    /// [`TchBackendError::InvalidConfig`] for a module without parameters, a bad or unusable
    /// device, a libtorch error.
    pub fn from_torchscript(
        path: &Path,
        optimizer: &OptimizerConfig,
        device: &str,
    ) -> Result<TchReplica, TchBackendError> {
        let file_error = |reason: &str| TchBackendError::ModelFile {
            path: path.display().to_string(),
            reason: reason.to_string(),
        };
        match std::fs::metadata(path) {
            Err(e) => return Err(file_error(&e.to_string())),
            Ok(m) if !m.is_file() => return Err(file_error("not a regular file")),
            Ok(_) => {}
        }
        let device = parse_device(device)?;
        configure_threads(device);
        let mut module =
            CModule::load_on_device(path, device).map_err(|e| TchBackendError::NotTorchScript {
                path: path.display().to_string(),
                message: first_line(&e.to_string()).to_string(),
            })?;
        module.f_set_train().map_err(super::torch_error)?;
        let named = module.named_parameters().map_err(super::torch_error)?;
        if named.is_empty() {
            return Err(TchBackendError::InvalidConfig(format!(
                "TorchScript module {} has no parameters to train",
                path.display()
            )));
        }
        // Group by top-level child, in order of first appearance.
        let mut groups: Vec<(String, Vec<TchParam>)> = Vec::new();
        for (name, tensor) in named {
            let child = name.split('.').next().unwrap_or(&name).to_string();
            let param =
                TchParam::from_tensor(name, tensor, optimizer).map_err(super::torch_error)?;
            match groups.iter_mut().find(|(g, _)| *g == child) {
                Some((_, params)) => params.push(param),
                None => groups.push((child, vec![param])),
            }
        }
        let mut names = Vec::new();
        let mut infos = Vec::new();
        let mut units = Vec::new();
        for (index, (name, params)) in groups.into_iter().enumerate() {
            let unit = TchUnit::new(params, optimizer);
            infos.push(LayerInfo {
                index,
                name: name.clone(),
                kind: "torchscript",
                params: unit.len(),
            });
            names.push(name);
            units.push(Some(unit));
        }
        Ok(TchReplica {
            device,
            names,
            infos,
            net: Net::Script(Script {
                module,
                train: true,
            }),
            units,
            deferred: RefCell::new(None),
            input_shape: None,
        })
    }
}
