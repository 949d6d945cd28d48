//! [`TchReplica`]: a model in libtorch behind the replica seam. Staged models (the mirrored
//! engine models, ResNet-20) run a forward with detached stage boundaries and a staged
//! backward that hands each unit over the moment its gradients exist, output head first;
//! TorchScript models run one graph (see [`super::script`]).

use std::cell::RefCell;

use engine::loss::LossError;
use engine::model::{LayerInfo, Model};
use engine::optim::OptimizerConfig;
use engine::replica::{ModelReplica, ReplicaError, UnitData, UnitMut};
use engine::tensor::Tensor as HostTensor;
use tch::{Cuda, Device, Kind, Reduction, TchError, Tensor};

use super::device::{configure_threads, parse_device};
use super::ops::{apply, op_of, Op};
use super::script::Script;
use super::unit::{append_f32, TchParam, TchUnit, UnitHandle};
use super::{backend_error, host_to_device, torch_error, BACKEND};
use crate::TchBackendError;

/// A run of ops: the unit `unit` (a layer index) and the parameter-free layers after it.
#[derive(Clone)]
pub(super) struct Stage {
    pub unit: usize,
    pub ops: Vec<Op>,
}

/// How the forward runs.
pub(super) enum Net {
    /// Ops in stages, one stage per unit (detached boundaries in training).
    Staged {
        /// Parameter-free layers before the first unit (run on the input, no gradient).
        prefix: Vec<Op>,
        stages: Vec<Stage>,
    },
    /// A TorchScript module: one graph.
    Script(Script),
}

/// A model in libtorch with the engine's optimizers (see the crate doc): a mirrored engine
/// model ([`TchReplica::from_model`]), ResNet-20 ([`TchReplica::resnet20`]) or a TorchScript
/// module ([`TchReplica::from_torchscript`]).
pub struct TchReplica {
    pub(super) device: Device,
    /// Layer names, by layer index.
    pub(super) names: Vec<String>,
    pub(super) infos: Vec<LayerInfo>,
    pub(super) net: Net,
    /// Units by layer index (`None` for parameter-free layers).
    pub(super) units: Vec<Option<TchUnit>>,
    /// An error a unit handle could not return (reported by the next `forward_backward`).
    pub(super) deferred: RefCell<Option<String>>,
    /// The per-sample input shape the model expects (`[C, H, W]`), checked before a forward;
    /// `None`: shapes are left to libtorch.
    pub(super) input_shape: Option<Vec<usize>>,
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
        configure_threads(device);
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
                    .map(|p| {
                        TchParam::from_host(
                            format!("{}.{}", layer.name, p.name),
                            &p.value,
                            &p.shape,
                            optimizer,
                            device,
                        )
                    })
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(torch_error)?;
                units.push(Some(TchUnit::new(params, optimizer)));
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
            net: Net::Staged { prefix, stages },
            units,
            deferred: RefCell::new(None),
            input_shape: None,
        })
    }

    /// The libtorch device this replica runs on.
    pub fn device(&self) -> Device {
        self.device
    }

    /// Blocks until the device finished the work queued so far (no-op on the CPU).
    pub fn synchronize_device(&self) {
        self.synchronize();
    }

    /// Takes the error a unit handle could not return (also reported by `forward_backward`).
    pub fn take_deferred_error(&self) -> Option<String> {
        self.deferred.borrow_mut().take()
    }

    /// Checks `input` against [`Self::input_shape`].
    fn check_input(&self, input: &HostTensor) -> Result<(), ReplicaError> {
        match &self.input_shape {
            Some(want) if input.shape.len() != want.len() + 1 || input.shape[1..] != want[..] => {
                Err(ReplicaError::Batch(format!(
                    "input of shape {:?} does not fit the model: expected [rows, {}]",
                    input.shape,
                    want.iter()
                        .map(ToString::to_string)
                        .collect::<Vec<_>>()
                        .join(", ")
                )))
            }
            _ => Ok(()),
        }
    }

    pub(super) fn input_tensor(&self, input: &HostTensor) -> Result<Tensor, TchError> {
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
    pub(crate) fn loss(&self, logits: &Tensor, targets: &[usize]) -> Result<Tensor, ReplicaError> {
        let (logits, t) = self.targets_tensor(logits, targets)?;
        let rows = targets.len().max(1) as f64;
        logits
            .f_log_softmax(-1, Kind::Float)
            .and_then(|l| l.f_nll_loss(&t, None::<Tensor>, Reduction::Sum, -100))
            .and_then(|l| l.f_div_scalar(rows))
            .map_err(backend_error)
    }

    pub(crate) fn zero_grads(&self) -> Result<(), TchError> {
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

    /// Calls `on_unit_ready` with unit `index` (a layer index).
    fn hand_over(&mut self, index: usize, on_unit_ready: &mut dyn FnMut(usize, &mut dyn UnitMut)) {
        if let Some(unit) = self.units[index].as_mut() {
            let mut handle = UnitHandle {
                unit,
                deferred: &self.deferred,
            };
            on_unit_ready(index, &mut handle);
        }
    }

    /// Forward in training mode with detached stage boundaries: per stage its input (a leaf
    /// that requires grad, except the first) and output. Empty when the model has no units.
    fn forward_staged(
        &self,
        prefix: &[Op],
        stages: &[Stage],
        mut x: Tensor,
    ) -> Result<(Tensor, Vec<(Tensor, Tensor)>), TchError> {
        for &op in prefix {
            x = apply(op, &x, None, true)?;
        }
        let mut io: Vec<(Tensor, Tensor)> = Vec::with_capacity(stages.len());
        for stage in stages {
            let xin = match io.last() {
                None => x.shallow_clone(),
                Some((_, prev)) => prev.f_detach()?.f_set_requires_grad(true)?,
            };
            let unit = self.units[stage.unit].as_ref();
            let mut y = apply(stage.ops[0], &xin, unit, true)?;
            for &op in &stage.ops[1..] {
                y = apply(op, &y, unit, true)?;
            }
            io.push((xin, y));
        }
        let logits = io
            .last()
            .map_or_else(|| x.shallow_clone(), |(_, y)| y.shallow_clone());
        Ok((logits, io))
    }

    /// Forward over one graph (no detached boundaries): training mode for
    /// [`super::measure_backward`] and gradient checks, evaluation mode for `logits`.
    pub(crate) fn forward_plain(
        &self,
        input: &HostTensor,
        train: bool,
    ) -> Result<Tensor, TchError> {
        self.forward_plain_on(self.input_tensor(input)?, train)
    }

    fn forward_plain_on(&self, x: Tensor, train: bool) -> Result<Tensor, TchError> {
        match &self.net {
            Net::Staged { prefix, stages } => {
                let mut x = x;
                for &op in prefix {
                    x = apply(op, &x, None, train)?;
                }
                for stage in stages {
                    let unit = self.units[stage.unit].as_ref();
                    for &op in &stage.ops {
                        x = apply(op, &x, unit, train)?;
                    }
                }
                Ok(x)
            }
            Net::Script(script) => script.forward(&x),
        }
    }

    pub(super) fn synchronize(&self) {
        if let Device::Cuda(n) = self.device {
            Cuda::synchronize(n as i64);
        }
    }

    /// Staged backward after a staged forward: `loss.backward()` for the last stage, then
    /// `(out_k · x_{k+1}.grad).sum().backward()` per earlier stage.
    fn backward_staged(
        &mut self,
        loss: &Tensor,
        mut io: Vec<(Tensor, Tensor)>,
        units_of_stages: &[usize],
        on_unit_ready: &mut dyn FnMut(usize, &mut dyn UnitMut),
    ) -> Result<(), ReplicaError> {
        loss.f_backward().map_err(backend_error)?;
        let last = io.len() - 1;
        self.hand_over(units_of_stages[last], on_unit_ready);
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
            self.hand_over(units_of_stages[s], on_unit_ready);
        }
        Ok(())
    }
}

fn read_scalar(t: &Tensor) -> Result<f32, ReplicaError> {
    t.f_double_value(&[])
        .map(|v| v as f32)
        .map_err(backend_error)
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
        self.check_input(input)?;
        self.zero_grads().map_err(backend_error)?;
        let x = self.input_tensor(input).map_err(backend_error)?;
        let loss = match &mut self.net {
            Net::Staged { prefix, stages } => {
                // Small vectors of `Copy` ops: cloned so the backward can borrow `self`.
                let (prefix, stages) = (prefix.clone(), stages.clone());
                let (logits, io) = self
                    .forward_staged(&prefix, &stages, x)
                    .map_err(backend_error)?;
                let loss = self.loss(&logits, targets)?;
                if !io.is_empty() {
                    drop(logits);
                    let order: Vec<usize> = stages.iter().map(|s| s.unit).collect();
                    self.backward_staged(&loss, io, &order, on_unit_ready)?;
                }
                loss
            }
            Net::Script(script) => {
                script.set_train(true).map_err(backend_error)?;
                let logits = script.forward_checked(&x, input)?;
                let loss = self.loss(&logits, targets)?;
                drop(logits);
                loss.f_backward().map_err(backend_error)?;
                // One graph: every unit is ready after the one backward, handed over head first.
                for index in (0..self.units.len()).rev() {
                    self.hand_over(index, on_unit_ready);
                }
                loss
            }
        };
        self.check_deferred()?;
        // Read the value after the backward (on CUDA the read waits for the device).
        read_scalar(&loss)
    }

    fn logits(&mut self, input: &HostTensor) -> Result<HostTensor, ReplicaError> {
        self.check_deferred()?;
        self.check_input(input)?;
        let _guard = tch::no_grad_guard();
        let x = self.input_tensor(input).map_err(backend_error)?;
        let out = match &mut self.net {
            Net::Script(script) => {
                script.set_train(false).map_err(backend_error)?;
                let out = script.forward_checked(&x, input);
                script.set_train(true).map_err(backend_error)?;
                out?
            }
            Net::Staged { .. } => self.forward_plain_on(x, false).map_err(|e| {
                ReplicaError::Batch(format!(
                    "input {:?} does not fit the model: {}",
                    input.shape,
                    first_line(&e.to_string())
                ))
            })?,
        };
        let size = out.size();
        let numel: usize = size.iter().map(|&d| d.max(0) as usize).product();
        // A `[rows, classes]` output keeps its shape (gpt-tiny: rows = B·T); anything else is
        // one row per input sample.
        let rows = match size.as_slice() {
            &[rows, _] => rows.max(0) as usize,
            _ => input.shape.first().copied().unwrap_or(0),
        };
        let classes = numel.checked_div(rows).unwrap_or(0);
        let mut data = Vec::with_capacity(numel);
        append_f32(&out, numel, &mut data).map_err(backend_error)?;
        Ok(HostTensor::from_vec(&[rows, classes], data))
    }

    fn with_unit(&mut self, index: usize, f: &mut dyn FnMut(&mut dyn UnitMut)) {
        let mut empty = TchUnit::new(Vec::new(), &OptimizerConfig::sgd());
        let unit = match self.units.get_mut(index) {
            Some(Some(unit)) => unit,
            _ => &mut empty,
        };
        let mut handle = UnitHandle {
            unit,
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
        let mut off = 0;
        for unit in self.units.iter_mut().flatten() {
            let n = unit.len();
            if let Err(e) = unit.write(UnitData::Values, &flat[off..off + n]) {
                let mut slot = self.deferred.borrow_mut();
                slot.get_or_insert_with(|| format!("writing values: {e}"));
                return;
            }
            off += n;
        }
    }

    fn state_tensors(&self) -> Vec<engine::checkpoint::NamedTensor> {
        self.named_tensors()
    }

    fn load_state_tensors(
        &mut self,
        tensors: &[engine::checkpoint::NamedTensor],
    ) -> Result<(), ReplicaError> {
        self.load_named_tensors(tensors)
            .map_err(|e| ReplicaError::Batch(e.to_string()))
    }
}

/// The first line of a (multi-line libtorch) error message.
pub(super) fn first_line(s: &str) -> &str {
    s.lines().next().unwrap_or(s)
}
