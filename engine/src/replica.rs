//! The replica seam: what a trainer, a node and a sync machine's executor need of one model
//! replica, whatever compute backend runs it.
//!
//! This module owns the contract ([`ModelReplica`]: forward + backward of a batch that hands
//! over each sync unit the moment its gradient is ready, output head first; the unit's flat
//! `f32` parameters and gradients; an optimizer step per unit) and its built-in
//! implementation [`BuiltinReplica`] (the CPU engine's [`Model`] with per-layer
//! optimizers). The `tch` crate implements the same trait over libtorch. A unit is a
//! parameterized layer, identified by its index in the model's layer list (the `index` of
//! [`LayerInfo`]); its flat vector is its parameter tensors concatenated in order, row-major,
//! with PyTorch's layouts, so two backends exchange units without knowing of each other.

use thiserror::Error;

use crate::checkpoint::{named_params, NamedTensor};
use crate::loss::try_softmax_cross_entropy;
use crate::model::{LayerInfo, Model, NamedLayer};
use crate::optim::{LayerOptimizer, OptimizerConfig};
use crate::tensor::Tensor;

/// Which half of a unit's state a read or write touches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UnitData {
    /// The gradients of the last backward.
    Grads,
    /// The parameter values.
    Values,
}

/// Why a forward/backward could not run.
#[derive(Debug, Error)]
pub enum ReplicaError {
    /// The batch does not fit the model (shapes, targets out of range).
    #[error("batch does not fit the model: {0}")]
    Batch(String),
    /// The backend failed (e.g. a libtorch error).
    #[error("{backend} backend: {message}")]
    Backend {
        /// Backend name.
        backend: &'static str,
        /// What it said.
        message: String,
    },
}

/// One sync unit during backward or between steps: read or write its flat state, step it.
pub trait UnitMut {
    /// Appends the unit's gradients or values (its tensors in order) to `out`.
    fn append_to(&self, what: UnitData, out: &mut Vec<f32>);
    /// Overwrites the unit's gradients or values from `src` (exactly the unit's length).
    fn write_from(&mut self, what: UnitData, src: &[f32]);
    /// Runs the unit's optimizer with its current gradients at learning rate `lr`.
    fn step(&mut self, lr: f32);
    /// Where the unit's gradients or values live in a CUDA device's memory, in flat-vector
    /// order, when every tensor is a contiguous `f32` tensor on one device; `None` (the
    /// default: host backends) when not, and then callers go through [`Self::append_to`].
    fn device_spans(&self, what: UnitData) -> Option<DeviceSpans> {
        let _ = what;
        None
    }
}

/// A run of a unit's flat vector in device memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceSpan {
    /// Device address of the run's first `f32`; `None` for a slot with no memory behind it
    /// (the zero gradients of a BatchNorm statistic): it reads as zeros, writes skip it.
    pub ptr: Option<u64>,
    /// Number of `f32` values.
    pub len: usize,
}

/// A unit's flat vector as runs of one CUDA device's memory ([`UnitMut::device_spans`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceSpans {
    /// CUDA device index.
    pub device: usize,
    /// The runs, in flat order; their lengths add up to the unit's length.
    pub spans: Vec<DeviceSpan>,
}

impl DeviceSpans {
    /// Total length in `f32` values.
    pub fn len(&self) -> usize {
        self.spans.iter().map(|s| s.len).sum()
    }

    /// True when the unit has no values.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The runs covering values `at..at + len` of the flat vector (cut at both ends; empty
    /// runs dropped). Values past the end are not covered.
    pub fn range(&self, at: usize, len: usize) -> Vec<DeviceSpan> {
        let end = at.saturating_add(len);
        let mut out = Vec::new();
        let mut start = 0usize;
        for s in &self.spans {
            let (lo, hi) = (start.max(at), (start + s.len).min(end));
            if lo < hi {
                out.push(DeviceSpan {
                    ptr: s.ptr.map(|p| p + ((lo - start) * 4) as u64),
                    len: hi - lo,
                });
            }
            start += s.len;
            if start >= end {
                break;
            }
        }
        out
    }
}

/// One model replica with its optimizer state (see the module doc).
pub trait ModelReplica: Send {
    /// Backend name (`builtin`, `tch`).
    fn backend(&self) -> &'static str;
    /// The sync units (parameterized layers) in forward order.
    fn unit_infos(&self) -> Vec<LayerInfo>;
    /// Names of every layer, by layer index (units and parameter-free layers).
    fn layer_names(&self) -> Vec<String>;
    /// Forward and backward of one batch with softmax cross-entropy (mean over rows) against
    /// `targets`; `on_unit_ready(index, unit)` runs for each unit the moment its gradient is
    /// ready, output head first. Returns the loss.
    fn forward_backward(
        &mut self,
        input: &Tensor,
        targets: &[usize],
        on_unit_ready: &mut dyn FnMut(usize, &mut dyn UnitMut),
    ) -> Result<f32, ReplicaError>;
    /// The model's output for `input` in evaluation mode (no gradients, BatchNorm on its
    /// running statistics), as `[rows, classes]` logits on the host.
    fn logits(&mut self, input: &Tensor) -> Result<Tensor, ReplicaError>;
    /// Calls `f` with unit `index` (outside backward: landing averages, stepping late units).
    fn with_unit(&mut self, index: usize, f: &mut dyn FnMut(&mut dyn UnitMut));
    /// Every unit's values, in forward order, concatenated (the layout of [`Model::flat_values`]).
    fn flat_values(&self) -> Vec<f32>;
    /// Overwrites every unit's values from a vector made by [`Self::flat_values`].
    fn set_flat_values(&mut self, flat: &[f32]);
    /// The model's whole state as named tensors with PyTorch's `state_dict` names and layouts
    /// (parameters and buffers such as BatchNorm running statistics): what a checkpoint holds.
    fn state_tensors(&self) -> Vec<NamedTensor>;
    /// Overwrites the state from tensors named and shaped as [`Self::state_tensors`] gives
    /// them (checked by the caller, e.g. [`crate::checkpoint::deserialize_named`]).
    fn load_state_tensors(&mut self, tensors: &[NamedTensor]) -> Result<(), ReplicaError>;
}

/// A unit of the built-in engine: the layer and its optimizer.
struct BuiltinUnit<'a> {
    layer: &'a mut NamedLayer,
    opt: Option<&'a mut LayerOptimizer>,
}

impl UnitMut for BuiltinUnit<'_> {
    fn append_to(&self, what: UnitData, out: &mut Vec<f32>) {
        for p in self.layer.layer.params() {
            out.extend_from_slice(match what {
                UnitData::Grads => &p.grad,
                UnitData::Values => &p.value,
            });
        }
    }

    fn write_from(&mut self, what: UnitData, src: &[f32]) {
        let mut off = 0;
        for p in self.layer.layer.params_mut() {
            let dst = match what {
                UnitData::Grads => &mut p.grad,
                UnitData::Values => &mut p.value,
            };
            let n = dst.len();
            dst.copy_from_slice(&src[off..off + n]);
            off += n;
        }
        debug_assert_eq!(off, src.len(), "unit {} flat length", self.layer.name);
    }

    fn step(&mut self, lr: f32) {
        if let Some(opt) = self.opt.as_deref_mut() {
            opt.step(self.layer.layer.params_mut(), lr);
        }
    }
}

/// The built-in CPU engine behind the seam: a [`Model`] and one optimizer per unit.
pub struct BuiltinReplica {
    /// The model.
    pub model: Model,
    opts: Vec<Option<LayerOptimizer>>,
}

impl BuiltinReplica {
    /// A replica of `model` with a fresh `optimizer` per parameterized layer.
    pub fn new(model: Model, optimizer: &OptimizerConfig) -> Self {
        let opts = model
            .layers
            .iter()
            .map(|l| {
                (!l.layer.params().is_empty())
                    .then(|| LayerOptimizer::new(optimizer, l.layer.params()))
            })
            .collect();
        Self { model, opts }
    }
}

impl ModelReplica for BuiltinReplica {
    fn backend(&self) -> &'static str {
        "builtin"
    }

    fn unit_infos(&self) -> Vec<LayerInfo> {
        self.model.layer_infos()
    }

    fn layer_names(&self) -> Vec<String> {
        self.model.layers.iter().map(|l| l.name.clone()).collect()
    }

    fn forward_backward(
        &mut self,
        input: &Tensor,
        targets: &[usize],
        on_unit_ready: &mut dyn FnMut(usize, &mut dyn UnitMut),
    ) -> Result<f32, ReplicaError> {
        let logits = self.model.forward(input, true);
        let (loss, grad) = try_softmax_cross_entropy(&logits, targets)
            .map_err(|e| ReplicaError::Batch(e.to_string()))?;
        let opts = &mut self.opts;
        self.model.backward_with_hook(&grad, &mut |i, layer| {
            let mut unit = BuiltinUnit {
                layer,
                opt: opts[i].as_mut(),
            };
            on_unit_ready(i, &mut unit);
        });
        Ok(loss)
    }

    fn logits(&mut self, input: &Tensor) -> Result<Tensor, ReplicaError> {
        Ok(self.model.forward(input, false))
    }

    fn with_unit(&mut self, index: usize, f: &mut dyn FnMut(&mut dyn UnitMut)) {
        let mut unit = BuiltinUnit {
            layer: &mut self.model.layers[index],
            opt: self.opts[index].as_mut(),
        };
        f(&mut unit);
    }

    fn flat_values(&self) -> Vec<f32> {
        self.model.flat_values()
    }

    fn set_flat_values(&mut self, flat: &[f32]) {
        set_model_flat_values(&mut self.model, flat);
    }

    fn state_tensors(&self) -> Vec<NamedTensor> {
        named_params(&self.model)
            .into_iter()
            .map(|(n, s, v)| (n, s, v.to_vec()))
            .collect()
    }

    fn load_state_tensors(&mut self, tensors: &[NamedTensor]) -> Result<(), ReplicaError> {
        let wanted = named_params(&self.model);
        if wanted.len() != tensors.len()
            || wanted.iter().zip(tensors).any(|((n, s, _), (tn, ts, tv))| {
                n != tn || s != ts || tv.len() != s.iter().product::<usize>()
            })
        {
            return Err(ReplicaError::Batch(
                "state tensors do not match the model's parameters".into(),
            ));
        }
        let mut it = tensors.iter();
        for l in &mut self.model.layers {
            for p in l.layer.params_mut() {
                if let Some((_, _, v)) = it.next() {
                    p.value.copy_from_slice(v);
                }
            }
        }
        Ok(())
    }
}

/// Writes a vector made by [`Model::flat_values`] back into `model`.
///
/// # Panics
/// When `flat` is shorter than the model (a caller bug: vectors come from the same model).
pub fn set_model_flat_values(model: &mut Model, flat: &[f32]) {
    let mut off = 0;
    for i in 0..model.layers.len() {
        let n: usize = model.layers[i].layer.params().iter().map(|p| p.len()).sum();
        if n > 0 {
            model.set_layer_values(i, &flat[off..off + n]);
            off += n;
        }
    }
}

/// Unit `index`'s values or gradients as one flat vector (empty for a layer without
/// parameters).
pub fn read_unit(replica: &mut dyn ModelReplica, index: usize, what: UnitData) -> Vec<f32> {
    let mut out = Vec::new();
    replica.with_unit(index, &mut |u| u.append_to(what, &mut out));
    out
}

/// Overwrites unit `index`'s values or gradients from `src` (its flat length).
pub fn write_unit(replica: &mut dyn ModelReplica, index: usize, what: UnitData, src: &[f32]) {
    replica.with_unit(index, &mut |u| u.write_from(what, src));
}

/// Appends values `at..at + len` of `unit`'s gradients or values to `out` (a sync unit that
/// is a chunk of its layer, [`crate::sync_units`]); `layer_len` is the layer's whole length, so
/// a unit that is its whole layer is appended without a copy of the layer.
pub fn append_unit_range(
    unit: &dyn UnitMut,
    what: UnitData,
    at: usize,
    len: usize,
    layer_len: usize,
    out: &mut Vec<f32>,
) {
    if at == 0 && len == layer_len {
        unit.append_to(what, out);
    } else {
        let mut layer = Vec::with_capacity(layer_len);
        unit.append_to(what, &mut layer);
        out.extend_from_slice(&layer[at..at + len]);
    }
}

/// Overwrites values `at..at + src.len()` of `unit`'s gradients or values, the rest of its
/// layer (`layer_len` values) kept.
pub fn write_unit_range(
    unit: &mut dyn UnitMut,
    what: UnitData,
    at: usize,
    layer_len: usize,
    src: &[f32],
) {
    if at == 0 && src.len() == layer_len {
        unit.write_from(what, src);
    } else {
        let mut layer = Vec::with_capacity(layer_len);
        unit.append_to(what, &mut layer);
        layer[at..at + src.len()].copy_from_slice(src);
        unit.write_from(what, &layer);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::mlp::mlp;
    use proptest::prelude::*;

    proptest! {
        /// A range of device spans addresses exactly the bytes of that range of the flat
        /// vector: model the flat vector as consecutive addresses per span and compare.
        #[test]
        fn device_span_ranges_address_exactly_the_range(
            lens in proptest::collection::vec((0usize..7, any::<bool>()), 0..6),
            at in 0usize..40,
            len in 0usize..40,
        ) {
            // Span i lives at 1_000_000 * (i + 1); `false` marks a slot with no memory.
            let spans = DeviceSpans {
                device: 0,
                spans: lens
                    .iter()
                    .enumerate()
                    .map(|(i, &(n, backed))| DeviceSpan {
                        ptr: backed.then_some(1_000_000 * (i as u64 + 1)),
                        len: n,
                    })
                    .collect(),
            };
            let total = spans.len();
            // Where flat value k lives (None: no memory).
            let mut address = Vec::new();
            for s in &spans.spans {
                for j in 0..s.len {
                    address.push(s.ptr.map(|p| p + 4 * j as u64));
                }
            }
            let got: Vec<Option<u64>> = spans
                .range(at, len)
                .iter()
                .flat_map(|s| (0..s.len).map(move |j| s.ptr.map(|p| p + 4 * j as u64)))
                .collect();
            let want: Vec<Option<u64>> =
                address[at.min(total)..(at + len).min(total)].to_vec();
            prop_assert_eq!(got, want);
            prop_assert!(spans.range(at, len).iter().all(|s| s.len > 0));
        }
    }

    #[test]
    fn a_range_of_a_unit_reads_and_writes_only_its_values() {
        let mut r = BuiltinReplica::new(mlp(3, &[], 2, 1), &OptimizerConfig::sgd());
        let first = r.unit_infos()[0].index;
        let whole = read_unit(&mut r, first, UnitData::Values);
        let n = whole.len();
        let mut part = Vec::new();
        r.with_unit(first, &mut |u| {
            append_unit_range(u, UnitData::Values, 2, 3, n, &mut part)
        });
        assert_eq!(part, whole[2..5]);
        r.with_unit(first, &mut |u| {
            write_unit_range(u, UnitData::Values, 2, n, &[9.0, 9.0, 9.0]);
        });
        let after = read_unit(&mut r, first, UnitData::Values);
        assert_eq!(after[2..5], [9.0, 9.0, 9.0]);
        assert_eq!(after[..2], whole[..2]);
        assert_eq!(after[5..], whole[5..]);
        let mut all = Vec::new();
        r.with_unit(first, &mut |u| {
            append_unit_range(u, UnitData::Values, 0, n, n, &mut all)
        });
        assert_eq!(all, after);
    }

    #[test]
    fn a_builtin_replica_reads_writes_and_steps_its_units() {
        let model = mlp(8, &[4], 3, 1);
        let mut r = BuiltinReplica::new(model, &OptimizerConfig::sgd());
        let infos = r.unit_infos();
        assert_eq!(
            infos.iter().map(|i| i.name.as_str()).collect::<Vec<_>>(),
            ["fc1", "head"]
        );
        let x = Tensor::from_vec(&[2, 8], (0..16).map(|i| i as f32 * 0.1).collect());
        let mut order = Vec::new();
        let loss = r
            .forward_backward(&x, &[0, 2], &mut |i, _| order.push(i))
            .unwrap();
        assert!(loss.is_finite());
        assert_eq!(order, [infos[1].index, infos[0].index], "output head first");
        let g = read_unit(&mut r, infos[1].index, UnitData::Grads);
        assert_eq!(g.len(), infos[1].params);
        let before = read_unit(&mut r, infos[1].index, UnitData::Values);
        r.with_unit(infos[1].index, &mut |u| u.step(0.1));
        let after = read_unit(&mut r, infos[1].index, UnitData::Values);
        for ((b, a), g) in before.iter().zip(&after).zip(&g) {
            assert!((b - 0.1 * g - a).abs() < 1e-6, "plain SGD step");
        }
        write_unit(
            &mut r,
            infos[0].index,
            UnitData::Values,
            &vec![0.25; infos[0].params],
        );
        assert!(read_unit(&mut r, infos[0].index, UnitData::Values)
            .iter()
            .all(|&v| v == 0.25));
        let bad = r.forward_backward(&x, &[0, 9], &mut |_, _| {});
        assert!(
            matches!(bad, Err(ReplicaError::Batch(_))),
            "a target out of range is a typed error"
        );
        let state = r.state_tensors();
        let mut other = BuiltinReplica::new(mlp(8, &[4], 3, 2), &OptimizerConfig::sgd());
        other.load_state_tensors(&state).unwrap();
        assert_eq!(other.flat_values(), r.flat_values());
        assert!(other.load_state_tensors(&state[1..]).is_err());
    }
}
