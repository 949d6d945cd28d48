//! The build without libtorch: the public API of the backend, every constructor refusing
//! with [`TchBackendError::NotBuilt`].

use std::convert::Infallible;
use std::path::Path;

use engine::checkpoint::NamedTensor;
use engine::model::{LayerInfo, Model};
use engine::optim::OptimizerConfig;
use engine::replica::{ModelReplica, ReplicaError, UnitMut};
use engine::tensor::Tensor;

use crate::{BackwardTiming, TchBackendError};

/// The libtorch replica; in this build it cannot be constructed (no value exists).
pub struct TchReplica {
    never: Infallible,
}

impl TchReplica {
    /// Never called in this build (no replica exists).
    pub fn synchronize_device(&self) {
        match self.never {}
    }

    /// Always [`TchBackendError::NotBuilt`] in this build.
    ///
    /// # Errors
    /// Always.
    pub fn from_model(
        _model: &Model,
        _optimizer: &OptimizerConfig,
        _device: &str,
    ) -> Result<TchReplica, TchBackendError> {
        Err(TchBackendError::NotBuilt)
    }

    /// Always [`TchBackendError::NotBuilt`] in this build.
    ///
    /// # Errors
    /// Always.
    pub fn resnet20(
        _in_ch: usize,
        _height: usize,
        _width: usize,
        _classes: usize,
        _seed: u64,
        _optimizer: &OptimizerConfig,
        _device: &str,
    ) -> Result<TchReplica, TchBackendError> {
        Err(TchBackendError::NotBuilt)
    }

    /// Always [`TchBackendError::NotBuilt`] in this build.
    ///
    /// # Errors
    /// Always.
    pub fn from_torchscript(
        _path: &Path,
        _optimizer: &OptimizerConfig,
        _device: &str,
    ) -> Result<TchReplica, TchBackendError> {
        Err(TchBackendError::NotBuilt)
    }

    /// Every parameter and buffer with PyTorch `state_dict` names (never called: no value).
    pub fn named_tensors(&self) -> Vec<NamedTensor> {
        match self.never {}
    }

    /// Overwrites parameters and buffers from named tensors (never called: no value).
    ///
    /// # Errors
    /// Never (no value exists).
    pub fn load_named_tensors(&mut self, _tensors: &[NamedTensor]) -> Result<(), TchBackendError> {
        match self.never {}
    }
}

impl ModelReplica for TchReplica {
    fn backend(&self) -> &'static str {
        match self.never {}
    }

    fn unit_infos(&self) -> Vec<LayerInfo> {
        match self.never {}
    }

    fn layer_names(&self) -> Vec<String> {
        match self.never {}
    }

    fn forward_backward(
        &mut self,
        _input: &Tensor,
        _targets: &[usize],
        _on_unit_ready: &mut dyn FnMut(usize, &mut dyn UnitMut),
    ) -> Result<f32, ReplicaError> {
        match self.never {}
    }

    fn logits(&mut self, _input: &Tensor) -> Result<Tensor, ReplicaError> {
        match self.never {}
    }

    fn with_unit(&mut self, _index: usize, _f: &mut dyn FnMut(&mut dyn UnitMut)) {
        match self.never {}
    }

    fn flat_values(&self) -> Vec<f32> {
        match self.never {}
    }

    fn set_flat_values(&mut self, _flat: &[f32]) {
        match self.never {}
    }

    fn state_tensors(&self) -> Vec<NamedTensor> {
        match self.never {}
    }

    fn load_state_tensors(&mut self, _tensors: &[NamedTensor]) -> Result<(), ReplicaError> {
        match self.never {}
    }
}

/// Nothing to load in this build: an error saying so.
///
/// # Errors
/// Always.
pub fn load_torch_cuda() -> Result<(), String> {
    Err(TchBackendError::NotBuilt.to_string())
}

/// Always [`TchBackendError::NotBuilt`] in this build.
///
/// # Errors
/// Always.
pub fn check_device(_device: &str) -> Result<(), TchBackendError> {
    Err(TchBackendError::NotBuilt)
}

/// Always [`TchBackendError::NotBuilt`] in this build.
///
/// # Errors
/// Always.
pub fn measure_backward(
    _model: &Model,
    _input: &Tensor,
    _targets: &[usize],
    _reps: usize,
) -> Result<BackwardTiming, TchBackendError> {
    Err(TchBackendError::NotBuilt)
}

/// Always [`TchBackendError::NotBuilt`] in this build.
///
/// # Errors
/// Always.
pub fn measure_backward_on(
    _model: &Model,
    _input: &Tensor,
    _targets: &[usize],
    _reps: usize,
    _device: &str,
) -> Result<BackwardTiming, TchBackendError> {
    Err(TchBackendError::NotBuilt)
}
