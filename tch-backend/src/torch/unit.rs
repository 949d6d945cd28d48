//! One sync unit's tensors: its parameters (with optimizer state) and buffers (BatchNorm
//! running statistics, batch counters), the unit's flat *Values*/*Grads* vectors, and the
//! handle lent to callers through the replica seam.
//!
//! A unit's flat *Values* vector is its parameters in order, then its **synced** buffers
//! (BatchNorm `running_mean`/`running_var`), so averaging values averages the statistics too.
//! Its *Grads* vector has the same length: the parameters' gradients, then zeros in the buffer
//! slots (writes to those slots are ignored). Unsynced buffers (`num_batches_tracked`) stay
//! per replica and appear only in the named tensors of a checkpoint.

use std::cell::RefCell;

use engine::optim::OptimizerConfig;
use engine::replica::{DeviceSpan, DeviceSpans, UnitData, UnitMut};
use tch::{Device, Kind, TchError, Tensor};

use super::{host_to_device, inplace};

/// One parameter tensor with its optimizer state.
pub(super) struct TchParam {
    /// Full `state_dict` name (`fc1.weight`, `layer1.0.conv1.weight`).
    pub name: String,
    /// A leaf that requires grad; its `.grad` always exists (zeros before the first backward).
    pub value: Tensor,
    pub shape: Vec<i64>,
    pub numel: usize,
    /// Weight decay applies (≥ 2 dimensions).
    pub decays: bool,
    /// SGD momentum buffer / AdamW first moment.
    pub first: Option<Tensor>,
    /// AdamW second moment.
    pub second: Option<Tensor>,
}

/// A buffer: state that is not trained by gradients.
pub(super) struct TchBuffer {
    /// Full `state_dict` name (`bn1.running_mean`).
    pub name: String,
    /// No grad; `f32`, or `i64` for counters.
    pub value: Tensor,
    pub shape: Vec<i64>,
    pub numel: usize,
    /// Part of the unit's flat vectors (running statistics) or kept per replica (counters).
    pub synced: bool,
}

/// One sync unit: a parameterized layer's (or block's) tensors and optimizer.
pub(super) struct TchUnit {
    pub params: Vec<TchParam>,
    pub buffers: Vec<TchBuffer>,
    pub config: OptimizerConfig,
    pub steps: u64,
}

impl TchParam {
    /// A parameter from host values.
    pub fn from_host(
        name: String,
        values: &[f32],
        shape: &[usize],
        config: &OptimizerConfig,
        device: Device,
    ) -> Result<Self, TchError> {
        let shape: Vec<i64> = shape.iter().map(|&d| d as i64).collect();
        let value = host_to_device(values, &shape, device)?;
        Self::from_tensor(name, value.f_detach()?, config)
    }

    /// Takes `value` as the parameter (shares its storage: a TorchScript module's parameter
    /// stays the module's), makes it a leaf that requires grad and materializes `.grad`.
    pub fn from_tensor(
        name: String,
        value: Tensor,
        config: &OptimizerConfig,
    ) -> Result<Self, TchError> {
        let value = value.f_set_requires_grad(true)?;
        let shape = value.size();
        let numel = shape.iter().map(|&d| d.max(0) as usize).product();
        // Materialize `.grad` (zeros) so reads and writes of gradients work before any backward.
        value.f_mul_scalar(0.0)?.f_sum(Kind::Float)?.f_backward()?;
        let zeros = || value.f_detach()?.f_zeros_like();
        let (first, second) = match config {
            OptimizerConfig::Sgd { momentum, .. } if *momentum != 0.0 => (Some(zeros()?), None),
            OptimizerConfig::Sgd { .. } => (None, None),
            OptimizerConfig::AdamW { .. } => (Some(zeros()?), Some(zeros()?)),
        };
        Ok(Self {
            name,
            decays: shape.len() >= 2,
            value,
            shape,
            numel,
            first,
            second,
        })
    }

    /// The gradient tensor (shares storage with the autograd `.grad`).
    pub fn grad(&self) -> Result<Tensor, TchError> {
        let g = self.value.f_grad()?;
        if g.defined() {
            Ok(g)
        } else {
            Err(TchError::Torch("parameter has no gradient tensor".into()))
        }
    }

    fn tensor(&self, what: UnitData) -> Result<Tensor, TchError> {
        match what {
            UnitData::Grads => self.grad(),
            UnitData::Values => Ok(self.value.shallow_clone()),
        }
    }
}

impl TchBuffer {
    /// A buffer filled with `fill`, of kind `kind`.
    pub fn filled(
        name: String,
        shape: &[i64],
        fill: f64,
        kind: Kind,
        synced: bool,
        device: Device,
    ) -> Result<Self, TchError> {
        let mut value = Tensor::f_zeros(shape, (kind, device))?;
        if fill != 0.0 {
            inplace(value.f_fill_(fill))?;
        }
        Ok(Self {
            name,
            value,
            shape: shape.to_vec(),
            numel: shape.iter().map(|&d| d.max(0) as usize).product(),
            synced,
        })
    }
}

/// Copies a tensor's values into `out` as `f32` (any kind, any device).
pub(super) fn append_f32(t: &Tensor, numel: usize, out: &mut Vec<f32>) -> Result<(), TchError> {
    let t = t.f_detach()?.f_to_kind(Kind::Float)?.f_contiguous()?;
    let start = out.len();
    out.resize(start + numel, 0.0);
    if let Err(e) = t.f_copy_data(&mut out[start..], numel) {
        out.truncate(start);
        return Err(e);
    }
    Ok(())
}

/// Overwrites `dst` (any kind) from host `f32` values, under `no_grad`.
pub(super) fn write_f32(dst: &Tensor, src: &[f32], shape: &[i64]) -> Result<(), TchError> {
    let _guard = tch::no_grad_guard();
    let host = host_to_device(src, shape, dst.device())?.f_to_kind(dst.kind())?;
    let mut dst = dst.shallow_clone();
    dst.f_copy_(&host)
}

impl TchUnit {
    /// A unit of parameters only.
    pub fn new(params: Vec<TchParam>, config: &OptimizerConfig) -> Self {
        Self {
            params,
            buffers: Vec::new(),
            config: config.clone(),
            steps: 0,
        }
    }

    fn synced_buffers(&self) -> impl Iterator<Item = &TchBuffer> {
        self.buffers.iter().filter(|b| b.synced)
    }

    /// Length of the unit's flat vectors (parameters, then synced buffers).
    pub fn len(&self) -> usize {
        self.params.iter().map(|p| p.numel).sum::<usize>()
            + self.synced_buffers().map(|b| b.numel).sum::<usize>()
    }

    pub fn append(&self, what: UnitData, out: &mut Vec<f32>) -> Result<(), TchError> {
        let start = out.len();
        let result = (|| {
            for p in &self.params {
                append_f32(&p.tensor(what)?, p.numel, out)?;
            }
            for b in self.synced_buffers() {
                match what {
                    UnitData::Grads => out.resize(out.len() + b.numel, 0.0),
                    UnitData::Values => append_f32(&b.value, b.numel, out)?,
                }
            }
            Ok(())
        })();
        if result.is_err() {
            out.truncate(start);
        }
        result
    }

    pub fn write(&mut self, what: UnitData, src: &[f32]) -> Result<(), TchError> {
        if src.len() != self.len() {
            return Err(TchError::Shape(format!(
                "unit has {} values, got {}",
                self.len(),
                src.len()
            )));
        }
        let mut off = 0;
        for p in &self.params {
            write_f32(&p.tensor(what)?, &src[off..off + p.numel], &p.shape)?;
            off += p.numel;
        }
        if what == UnitData::Values {
            for b in self.synced_buffers() {
                write_f32(&b.value, &src[off..off + b.numel], &b.shape)?;
                off += b.numel;
            }
        }
        Ok(())
    }

    /// The unit's flat vector as runs of device memory, when every tensor it reads is a
    /// contiguous `f32` CUDA tensor on one device (a synced buffer's gradient slot has no
    /// memory: it reads as zeros, as [`Self::append`] writes it).
    pub fn device_spans(&self, what: UnitData) -> Option<DeviceSpans> {
        let Device::Cuda(device) = self.params.first()?.value.device() else {
            return None;
        };
        let on_device = |t: &Tensor| {
            (t.device() == Device::Cuda(device) && t.kind() == Kind::Float && t.is_contiguous())
                .then(|| t.data_ptr() as u64)
        };
        let mut spans = Vec::with_capacity(self.params.len() + self.buffers.len());
        for p in &self.params {
            let t = p.tensor(what).ok()?;
            spans.push(DeviceSpan {
                ptr: Some(on_device(&t)?),
                len: p.numel,
            });
        }
        for b in self.synced_buffers() {
            let ptr = match what {
                UnitData::Grads => None,
                UnitData::Values => Some(on_device(&b.value)?),
            };
            spans.push(DeviceSpan { ptr, len: b.numel });
        }
        Some(DeviceSpans { device, spans })
    }

    pub fn zero_grads(&self) -> Result<(), TchError> {
        for p in &self.params {
            inplace(p.grad()?.f_zero_())?;
        }
        Ok(())
    }
}

/// A unit lent to a caller; errors it cannot return are kept for the next forward/backward.
pub(super) struct UnitHandle<'a> {
    pub unit: &'a mut TchUnit,
    pub deferred: &'a RefCell<Option<String>>,
}

impl UnitHandle<'_> {
    fn defer(&self, context: &str, e: TchError) {
        let mut slot = self.deferred.borrow_mut();
        if slot.is_none() {
            *slot = Some(format!("{context}: {e}"));
        }
    }
}

impl UnitMut for UnitHandle<'_> {
    fn append_to(&self, what: UnitData, out: &mut Vec<f32>) {
        if let Err(e) = self.unit.append(what, out) {
            // Keep the length contract; the next forward_backward reports the failure.
            out.resize(out.len() + self.unit.len(), 0.0);
            self.defer("reading a unit", e);
        }
    }

    fn write_from(&mut self, what: UnitData, src: &[f32]) {
        if let Err(e) = self.unit.write(what, src) {
            self.defer("writing a unit", e);
        }
    }

    fn step(&mut self, lr: f32) {
        if let Err(e) = self.unit.step(lr) {
            self.defer("optimizer step", e);
        }
    }

    fn device_spans(&self, what: UnitData) -> Option<DeviceSpans> {
        self.unit.device_spans(what)
    }
}
