//! The libtorch implementation (feature `tch`): [`TchReplica`], devices, the engine's
//! optimizers on tensors, and the staged-vs-plain backward measurement.

use std::any::Any;
use std::cell::RefCell;
use std::time::Instant;

use engine::layer::Layer;
use engine::layers::conv::Conv2d;
use engine::layers::linear::Linear;
use engine::layers::pool::MaxPool2d;
use engine::loss::LossError;
use engine::model::{LayerInfo, Model};
use engine::optim::OptimizerConfig;
use engine::replica::{ModelReplica, ReplicaError, UnitData, UnitMut};
use engine::tensor::Tensor as HostTensor;
use tch::{Cuda, Device, Kind, Reduction, TchError, Tensor};

use crate::{parse_device_spec, BackwardTiming, DeviceSpec, TchBackendError};

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

fn device_name(device: Device) -> String {
    match device {
        Device::Cpu => "cpu".to_string(),
        Device::Cuda(n) => format!("cuda:{n}"),
        other => format!("{other:?}").to_lowercase(),
    }
}

/// Parses `cpu`, `cuda` or `cuda:N` and checks that libtorch can use the device.
///
/// # Errors
/// [`TchBackendError::UnknownDevice`] for other strings; [`TchBackendError::CudaUnavailable`]
/// when libtorch sees no CUDA device (CPU-only libtorch, no driver, no GPU) or fewer than N+1.
pub fn parse_device(s: &str) -> Result<Device, TchBackendError> {
    match parse_device_spec(s)? {
        DeviceSpec::Cpu => Ok(Device::Cpu),
        DeviceSpec::Cuda(n) => {
            if let Err(why) = load_torch_cuda() {
                return Err(TchBackendError::CudaUnavailable {
                    device: s.to_string(),
                    reason: format!("libtorch's CUDA library could not be loaded ({why})"),
                });
            }
            if !Cuda::is_available() {
                return Err(TchBackendError::CudaUnavailable {
                    device: s.to_string(),
                    reason: "libtorch sees no CUDA device (no NVIDIA GPU or driver visible, or a \
                             CPU-only libtorch)"
                        .to_string(),
                });
            }
            let count = Cuda::device_count();
            if i64::try_from(n).map_or(true, |n| n >= count) {
                return Err(TchBackendError::CudaUnavailable {
                    device: s.to_string(),
                    reason: format!("libtorch sees {count} CUDA device(s), so no cuda:{n}"),
                });
            }
            Ok(Device::Cuda(n))
        }
    }
}

/// The linker drops `libtorch_cuda.so` (`--as-needed`: no symbol of it is referenced), and
/// without it libtorch has no CUDA backend. Loading it at run time (once, `RTLD_GLOBAL`)
/// registers the backend in every binary, whatever its link flags.
fn load_torch_cuda() -> Result<(), String> {
    use std::ffi::{c_char, c_int, c_void, CStr, CString};
    use std::sync::OnceLock;

    unsafe extern "C" {
        fn dlopen(filename: *const c_char, flag: c_int) -> *mut c_void;
        fn dlerror() -> *mut c_char;
    }
    const RTLD_NOW: c_int = 2;
    const RTLD_GLOBAL: c_int = 0x100;
    static LOADED: OnceLock<Result<(), String>> = OnceLock::new();
    LOADED
        .get_or_init(|| {
            let mut errors = Vec::new();
            let built_with =
                option_env!("DREAMDDP_LIBTORCH_LIB").map(|lib| format!("{lib}/libtorch_cuda.so"));
            for name in built_with
                .into_iter()
                .chain(["libtorch_cuda.so".to_string()])
            {
                let Ok(c_name) = CString::new(name.clone()) else {
                    continue;
                };
                // SAFETY: `c_name` is a valid NUL-terminated string; dlopen/dlerror are the C
                // library's, and the handle is deliberately never closed.
                let handle = unsafe { dlopen(c_name.as_ptr(), RTLD_NOW | RTLD_GLOBAL) };
                if !handle.is_null() {
                    return Ok(());
                }
                // SAFETY: dlerror returns NULL or a NUL-terminated string valid until the next
                // dl* call on this thread; it is copied at once.
                let why = unsafe {
                    let e = dlerror();
                    if e.is_null() {
                        "unknown error".to_string()
                    } else {
                        CStr::from_ptr(e).to_string_lossy().into_owned()
                    }
                };
                errors.push(format!("{name}: {why}"));
            }
            Err(errors.join("; "))
        })
        .clone()
}

/// Like [`parse_device`], for callers that only need to know the device is usable.
///
/// # Errors
/// See [`parse_device`].
pub fn check_device(s: &str) -> Result<(), TchBackendError> {
    parse_device(s).map(|_| ())
}

/// One step of a stage's forward.
#[derive(Clone, Copy, Debug)]
enum Op {
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
}

/// What a layer of the engine model becomes.
fn op_of(name: &str, layer: &dyn Layer) -> Result<Op, TchBackendError> {
    let kind = layer.kind();
    let unsupported = |detail: &str| TchBackendError::UnsupportedLayer {
        name: name.to_string(),
        kind: kind.to_string(),
        detail: detail.to_string(),
    };
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
            "supported kinds: flatten, linear, relu, conv2d, maxpool2d",
        )),
    }
}

fn apply(op: Op, x: &Tensor, params: &[TchParam]) -> Result<Tensor, TchError> {
    match op {
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

/// One parameter tensor with its optimizer state.
struct TchParam {
    /// A leaf that requires grad; its `.grad` always exists (zeros before the first backward).
    value: Tensor,
    shape: Vec<i64>,
    numel: usize,
    /// Weight decay applies (≥ 2 dimensions).
    decays: bool,
    /// SGD momentum buffer / AdamW first moment.
    first: Option<Tensor>,
    /// AdamW second moment.
    second: Option<Tensor>,
}

/// One sync unit: a parameterized layer's tensors and optimizer.
struct TchUnit {
    params: Vec<TchParam>,
    config: OptimizerConfig,
    steps: u64,
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

impl TchParam {
    fn new(
        param: &engine::layer::Param,
        config: &OptimizerConfig,
        device: Device,
    ) -> Result<Self, TchError> {
        let shape: Vec<i64> = param.shape.iter().map(|&d| d as i64).collect();
        let value = host_to_device(&param.value, &shape, device)?
            .f_detach()?
            .f_set_requires_grad(true)?;
        // Materialize `.grad` (zeros) so reads and writes of gradients work before any backward.
        value.f_mul_scalar(0.0)?.f_sum(Kind::Float)?.f_backward()?;
        let zeros = || value.f_detach()?.f_zeros_like();
        let (first, second) = match config {
            OptimizerConfig::Sgd { momentum, .. } if *momentum != 0.0 => (Some(zeros()?), None),
            OptimizerConfig::Sgd { .. } => (None, None),
            OptimizerConfig::AdamW { .. } => (Some(zeros()?), Some(zeros()?)),
        };
        Ok(Self {
            value,
            shape,
            numel: param.len(),
            decays: param.shape.len() >= 2,
            first,
            second,
        })
    }

    /// The gradient tensor (shares storage with the autograd `.grad`).
    fn grad(&self) -> Result<Tensor, TchError> {
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

impl TchUnit {
    fn len(&self) -> usize {
        self.params.iter().map(|p| p.numel).sum()
    }

    fn append(&self, what: UnitData, out: &mut Vec<f32>) -> Result<(), TchError> {
        for p in &self.params {
            let t = p.tensor(what)?.f_detach()?;
            let start = out.len();
            out.resize(start + p.numel, 0.0);
            if let Err(e) = t.f_copy_data(&mut out[start..], p.numel) {
                out.truncate(start);
                return Err(e);
            }
        }
        Ok(())
    }

    fn write(&mut self, what: UnitData, src: &[f32], device: Device) -> Result<(), TchError> {
        if src.len() != self.len() {
            return Err(TchError::Shape(format!(
                "unit has {} values, got {}",
                self.len(),
                src.len()
            )));
        }
        let _guard = tch::no_grad_guard();
        let mut off = 0;
        for p in &self.params {
            let host = host_to_device(&src[off..off + p.numel], &p.shape, device)?;
            let mut dst = p.tensor(what)?;
            dst.f_copy_(&host)?;
            off += p.numel;
        }
        Ok(())
    }

    fn zero_grads(&self) -> Result<(), TchError> {
        for p in &self.params {
            inplace(p.grad()?.f_zero_())?;
        }
        Ok(())
    }

    /// The engine's update rules ([`engine::optim`]) with the same order of f32 operations
    /// (separate multiply and add kernels, no fused `alpha` forms).
    fn step(&mut self, lr: f32) -> Result<(), TchError> {
        let _guard = tch::no_grad_guard();
        self.steps += 1;
        match self.config {
            OptimizerConfig::Sgd {
                momentum,
                weight_decay,
                nesterov,
            } => {
                for p in &mut self.params {
                    let decay = if p.decays { weight_decay } else { 0.0 };
                    let grad = p.grad()?;
                    // d = g + wd·θ
                    let mut direction = p.value.f_detach()?.f_mul_scalar(f64::from(decay))?;
                    inplace(direction.f_add_(&grad))?;
                    let update = match p.first.as_mut() {
                        None => direction,
                        Some(velocity) => {
                            // b = μ·b + d
                            inplace(velocity.f_mul_scalar_(f64::from(momentum)))?;
                            inplace(velocity.f_add_(&direction))?;
                            if nesterov {
                                // d + μ·b
                                let mut u = velocity.f_mul_scalar(f64::from(momentum))?;
                                inplace(u.f_add_(&direction))?;
                                u
                            } else {
                                velocity.shallow_clone()
                            }
                        }
                    };
                    // θ -= lr·update
                    let scaled = update.f_mul_scalar(f64::from(lr))?;
                    inplace(p.value.f_sub_(&scaled))?;
                }
            }
            OptimizerConfig::AdamW {
                beta1,
                beta2,
                eps,
                weight_decay,
            } => {
                let t = i32::try_from(self.steps).unwrap_or(i32::MAX);
                let first_correction = 1.0 - f64::from(beta1).powi(t);
                let second_correction = 1.0 - f64::from(beta2).powi(t);
                let step_size = (f64::from(lr) / first_correction) as f32;
                let inv_sqrt_second_correction = (1.0 / second_correction.sqrt()) as f32;
                for p in &mut self.params {
                    let grad = p.grad()?;
                    let (Some(m), Some(v)) = (p.first.as_mut(), p.second.as_mut()) else {
                        return Err(TchError::Torch("adamw state missing".into()));
                    };
                    // m = β₁m + (1−β₁)g
                    inplace(m.f_mul_scalar_(f64::from(beta1)))?;
                    inplace(m.f_add_(&grad.f_mul_scalar(f64::from(1.0 - beta1))?))?;
                    // v = β₂v + ((1−β₂)g)g
                    let mut g2 = grad.f_mul_scalar(f64::from(1.0 - beta2))?;
                    inplace(g2.f_mul_(&grad))?;
                    inplace(v.f_mul_scalar_(f64::from(beta2)))?;
                    inplace(v.f_add_(&g2))?;
                    // den = √v · c + ε
                    let mut den = v.f_sqrt()?;
                    inplace(den.f_mul_scalar_(f64::from(inv_sqrt_second_correction)))?;
                    inplace(den.f_add_scalar_(f64::from(eps)))?;
                    // θ = θ·shrink − (step·m)/den
                    if p.decays {
                        inplace(p.value.f_mul_scalar_(f64::from(1.0 - lr * weight_decay)))?;
                    }
                    let mut delta = m.f_mul_scalar(f64::from(step_size))?;
                    inplace(delta.f_div_(&den))?;
                    inplace(p.value.f_sub_(&delta))?;
                }
            }
        }
        Ok(())
    }
}

/// A unit lent to a caller; errors it cannot return are kept for the next forward/backward.
struct UnitHandle<'a> {
    unit: &'a mut TchUnit,
    device: Device,
    deferred: &'a RefCell<Option<String>>,
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
        if let Err(e) = self.unit.write(what, src, self.device) {
            self.defer("writing a unit", e);
        }
    }

    fn step(&mut self, lr: f32) {
        if let Err(e) = self.unit.step(lr) {
            self.defer("optimizer step", e);
        }
    }
}

/// A run of layers: the parameterized layer `unit` (a layer index) and the parameter-free
/// layers after it.
struct Stage {
    unit: usize,
    ops: Vec<Op>,
}

/// An engine model mirrored in libtorch, with the engine's optimizers (see the crate doc).
pub struct TchReplica {
    device: Device,
    /// Layer names, by layer index.
    names: Vec<String>,
    infos: Vec<LayerInfo>,
    /// Parameter-free layers before the first unit (run on the input, no gradient).
    prefix: Vec<Op>,
    stages: Vec<Stage>,
    /// Units by layer index (`None` for parameter-free layers).
    units: Vec<Option<TchUnit>>,
    /// An error a unit handle could not return (reported by the next `forward_backward`).
    deferred: RefCell<Option<String>>,
}

impl TchReplica {
    /// Mirrors `model` (names, shapes, order, current values) on `device` (`cpu`, `cuda`,
    /// `cuda:N`) with a fresh `optimizer` per unit.
    ///
    /// # Errors
    /// A bad or unusable device, a layer kind the backend does not support, or a libtorch error.
    pub fn from_model(
        model: &Model,
        optimizer: &OptimizerConfig,
        device: &str,
    ) -> Result<TchReplica, TchBackendError> {
        let device = parse_device(device)?;
        let mut prefix = Vec::new();
        let mut stages: Vec<Stage> = Vec::new();
        let mut units = Vec::with_capacity(model.layers.len());
        for (index, layer) in model.layers.iter().enumerate() {
            let op = op_of(&layer.name, layer.layer.as_ref())?;
            let params = layer.layer.params();
            if params.is_empty() {
                units.push(None);
                match stages.last_mut() {
                    Some(stage) => stage.ops.push(op),
                    None => prefix.push(op),
                }
            } else {
                let params = params
                    .iter()
                    .map(|p| TchParam::new(p, optimizer, device))
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(torch_error)?;
                units.push(Some(TchUnit {
                    params,
                    config: optimizer.clone(),
                    steps: 0,
                }));
                stages.push(Stage {
                    unit: index,
                    ops: vec![op],
                });
            }
        }
        Ok(TchReplica {
            device,
            names: model.layers.iter().map(|l| l.name.clone()).collect(),
            infos: model.layer_infos(),
            prefix,
            stages,
            units,
            deferred: RefCell::new(None),
        })
    }

    /// The libtorch device this replica runs on.
    pub fn device(&self) -> Device {
        self.device
    }

    /// Takes the error a unit handle could not return (also reported by `forward_backward`).
    pub fn take_deferred_error(&self) -> Option<String> {
        self.deferred.borrow_mut().take()
    }

    fn stage_params(&self, stage: &Stage) -> &[TchParam] {
        self.units[stage.unit]
            .as_ref()
            .map_or(&[][..], |u| u.params.as_slice())
    }

    fn input_tensor(&self, input: &HostTensor) -> Result<Tensor, TchError> {
        let shape: Vec<i64> = input.shape.iter().map(|&d| d as i64).collect();
        host_to_device(&input.data, &shape, self.device)
    }

    fn targets_tensor(
        &self,
        logits: &Tensor,
        targets: &[usize],
    ) -> Result<(Tensor, Tensor), ReplicaError> {
        let size = logits.size();
        let classes = size.last().copied().unwrap_or(1).max(0) as usize;
        let numel: usize = size.iter().map(|&d| d.max(0) as usize).product();
        let rows = numel.checked_div(classes).unwrap_or(0);
        if targets.len() != rows {
            return Err(ReplicaError::Batch(
                LossError::TargetCount {
                    rows,
                    targets: targets.len(),
                }
                .to_string(),
            ));
        }
        if let Some((row, &target)) = targets.iter().enumerate().find(|(_, t)| **t >= classes) {
            return Err(ReplicaError::Batch(
                LossError::TargetOutOfRange {
                    row,
                    target,
                    classes,
                }
                .to_string(),
            ));
        }
        let t: Vec<i64> = targets.iter().map(|&t| t as i64).collect();
        let t = Tensor::f_from_slice(&t)
            .and_then(|t| t.f_to_device(self.device))
            .map_err(backend_error)?;
        let logits = logits
            .f_reshape([rows as i64, classes as i64])
            .map_err(backend_error)?;
        Ok((logits, t))
    }

    /// Mean cross-entropy (log-softmax over the last dim, mean over rows; 0 for no rows).
    fn loss(&self, logits: &Tensor, targets: &[usize]) -> Result<Tensor, ReplicaError> {
        let (logits, t) = self.targets_tensor(logits, targets)?;
        let rows = targets.len().max(1) as f64;
        logits
            .f_log_softmax(-1, Kind::Float)
            .and_then(|l| l.f_nll_loss(&t, None::<Tensor>, Reduction::Sum, -100))
            .and_then(|l| l.f_div_scalar(rows))
            .map_err(backend_error)
    }

    fn zero_grads(&self) -> Result<(), TchError> {
        for unit in self.units.iter().flatten() {
            unit.zero_grads()?;
        }
        Ok(())
    }

    fn check_deferred(&self) -> Result<(), ReplicaError> {
        match self.take_deferred_error() {
            Some(message) => Err(backend_error(message)),
            None => Ok(()),
        }
    }

    fn hand_over(&mut self, stage: usize, on_unit_ready: &mut dyn FnMut(usize, &mut dyn UnitMut)) {
        let index = self.stages[stage].unit;
        if let Some(unit) = self.units[index].as_mut() {
            let mut handle = UnitHandle {
                unit,
                device: self.device,
                deferred: &self.deferred,
            };
            on_unit_ready(index, &mut handle);
        }
    }

    /// Forward with detached stage boundaries: per stage its input (a leaf that requires
    /// grad, except the first) and output. Empty when the model has no units.
    fn forward_staged(
        &self,
        input: &HostTensor,
    ) -> Result<(Tensor, Vec<(Tensor, Tensor)>), TchError> {
        let mut x = self.input_tensor(input)?;
        for &op in &self.prefix {
            x = apply(op, &x, &[])?;
        }
        let mut io: Vec<(Tensor, Tensor)> = Vec::with_capacity(self.stages.len());
        for stage in &self.stages {
            let xin = match io.last() {
                None => x.shallow_clone(),
                Some((_, prev)) => prev.f_detach()?.f_set_requires_grad(true)?,
            };
            let params = self.stage_params(stage);
            let mut y = apply(stage.ops[0], &xin, params)?;
            for &op in &stage.ops[1..] {
                y = apply(op, &y, params)?;
            }
            io.push((xin, y));
        }
        let logits = io
            .last()
            .map_or_else(|| x.shallow_clone(), |(_, y)| y.shallow_clone());
        Ok((logits, io))
    }

    /// Forward over one graph (no detached boundaries), for [`measure_backward`].
    fn forward_plain(&self, input: &HostTensor) -> Result<Tensor, TchError> {
        let mut x = self.input_tensor(input)?;
        for &op in &self.prefix {
            x = apply(op, &x, &[])?;
        }
        for stage in &self.stages {
            let params = self.stage_params(stage);
            for &op in &stage.ops {
                x = apply(op, &x, params)?;
            }
        }
        Ok(x)
    }

    fn synchronize(&self) {
        if let Device::Cuda(n) = self.device {
            Cuda::synchronize(n as i64);
        }
    }
}

impl ModelReplica for TchReplica {
    fn backend(&self) -> &'static str {
        BACKEND
    }

    fn unit_infos(&self) -> Vec<LayerInfo> {
        self.infos.clone()
    }

    fn layer_names(&self) -> Vec<String> {
        self.names.clone()
    }

    fn forward_backward(
        &mut self,
        input: &HostTensor,
        targets: &[usize],
        on_unit_ready: &mut dyn FnMut(usize, &mut dyn UnitMut),
    ) -> Result<f32, ReplicaError> {
        self.check_deferred()?;
        self.zero_grads().map_err(backend_error)?;
        let (logits, mut io) = self.forward_staged(input).map_err(backend_error)?;
        let loss = self.loss(&logits, targets)?;
        let read = |t: &Tensor| {
            t.f_double_value(&[])
                .map(|v| v as f32)
                .map_err(backend_error)
        };
        if io.is_empty() {
            return read(&loss);
        }
        drop(logits);
        loss.f_backward().map_err(backend_error)?;
        // Read the value after the backward (on CUDA the read waits for the device).
        let loss = loss.f_detach().map_err(backend_error)?;
        let last = io.len() - 1;
        self.hand_over(last, on_unit_ready);
        for s in (0..last).rev() {
            let (next_in, _) = io.pop().expect("stage s+1 exists");
            let grad = next_in.f_grad().map_err(backend_error)?;
            let (_, out) = &io[s];
            if grad.defined() {
                out.f_mul(&grad)
                    .and_then(|p| p.f_sum(Kind::Float))
                    .and_then(|p| p.f_backward())
                    .map_err(backend_error)?;
            }
            self.hand_over(s, on_unit_ready);
        }
        self.check_deferred()?;
        read(&loss)
    }

    fn with_unit(&mut self, index: usize, f: &mut dyn FnMut(&mut dyn UnitMut)) {
        let mut empty = TchUnit {
            params: Vec::new(),
            config: OptimizerConfig::sgd(),
            steps: 0,
        };
        let unit = match self.units.get_mut(index) {
            Some(Some(unit)) => unit,
            _ => &mut empty,
        };
        let mut handle = UnitHandle {
            unit,
            device: self.device,
            deferred: &self.deferred,
        };
        f(&mut handle);
    }

    fn flat_values(&self) -> Vec<f32> {
        let mut out = Vec::new();
        for unit in self.units.iter().flatten() {
            let start = out.len();
            if let Err(e) = unit.append(UnitData::Values, &mut out) {
                out.truncate(start);
                out.resize(start + unit.len(), 0.0);
                let mut slot = self.deferred.borrow_mut();
                slot.get_or_insert_with(|| format!("reading values: {e}"));
            }
        }
        out
    }

    fn set_flat_values(&mut self, flat: &[f32]) {
        let total: usize = self.units.iter().flatten().map(TchUnit::len).sum();
        if flat.len() != total {
            let mut slot = self.deferred.borrow_mut();
            slot.get_or_insert_with(|| {
                format!(
                    "set_flat_values: model has {total} values, got {}",
                    flat.len()
                )
            });
            return;
        }
        let device = self.device;
        let mut off = 0;
        for unit in self.units.iter_mut().flatten() {
            let n = unit.len();
            if let Err(e) = unit.write(UnitData::Values, &flat[off..off + n], device) {
                let mut slot = self.deferred.borrow_mut();
                slot.get_or_insert_with(|| format!("writing values: {e}"));
                return;
            }
            off += n;
        }
    }
}

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
        let logits = replica.forward_plain(input).map_err(torch_error)?;
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
