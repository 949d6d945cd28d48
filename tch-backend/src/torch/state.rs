//! Named tensors with PyTorch `state_dict` names and layouts: every parameter and buffer of
//! every unit (BatchNorm running statistics and `num_batches_tracked` included), for
//! checkpoints ([`TchReplica::named_tensors`], [`TchReplica::load_named_tensors`]).

use std::collections::HashMap;

use tch::Tensor;

use super::unit::{append_f32, write_f32};
use super::TchReplica;
use crate::TchBackendError;

impl TchReplica {
    /// Every tensor the replica's units hold in order (per unit: parameters, then buffers), as
    /// `(state_dict name, shape, f32 values)`: `fc1.weight` … for the mirrored engine models,
    /// `conv1.weight`, `bn1.running_mean`, `layer1.0.conv1.weight`, … `fc.bias` for ResNet-20,
    /// the module's parameter names for TorchScript (its buffers are not reachable from tch).
    /// Integer buffers (`num_batches_tracked`) are converted to `f32`.
    ///
    /// A tensor that cannot be read (a libtorch error) comes back as zeros and the error is
    /// kept for the next `forward_backward`.
    pub fn named_tensors(&self) -> Vec<(String, Vec<usize>, Vec<f32>)> {
        let mut out = Vec::new();
        for (name, tensor, shape, numel) in self.all_tensors() {
            let mut values = Vec::with_capacity(numel);
            if let Err(e) = append_f32(tensor, numel, &mut values) {
                values = vec![0.0; numel];
                let mut slot = self.deferred.borrow_mut();
                slot.get_or_insert_with(|| format!("reading {name}: {e}"));
            }
            let shape = shape.iter().map(|&d| d.max(0) as usize).collect();
            out.push((name.to_string(), shape, values));
        }
        out
    }

    /// Overwrites every parameter and buffer from `tensors` (any order), which must name
    /// exactly the tensors [`Self::named_tensors`] gives, with the same shapes. Optimizer state
    /// is kept.
    ///
    /// # Errors
    /// [`TchBackendError::StateMismatch`] naming the first tensor that is missing, unexpected,
    /// duplicated, of another shape or of a wrong value count; nothing is changed then.
    /// [`TchBackendError::Torch`] when libtorch fails while writing.
    pub fn load_named_tensors(
        &mut self,
        tensors: &[(String, Vec<usize>, Vec<f32>)],
    ) -> Result<(), TchBackendError> {
        let mismatch = |name: &str, reason: String| TchBackendError::StateMismatch {
            name: name.to_string(),
            reason,
        };
        let mut given: HashMap<&str, (&[usize], &[f32])> = HashMap::new();
        for (name, shape, values) in tensors {
            if given
                .insert(name.as_str(), (shape.as_slice(), values.as_slice()))
                .is_some()
            {
                return Err(mismatch(name, "given twice".into()));
            }
        }
        let ours = self.all_tensors();
        for (name, _, shape, numel) in &ours {
            let shape: Vec<usize> = shape.iter().map(|&d| d.max(0) as usize).collect();
            let Some((s, v)) = given.get(name) else {
                return Err(mismatch(
                    name,
                    format!("missing (expected shape {shape:?})"),
                ));
            };
            if *s != shape.as_slice() {
                return Err(mismatch(
                    name,
                    format!("shape {s:?}, the model has {shape:?}"),
                ));
            }
            if v.len() != *numel {
                return Err(mismatch(
                    name,
                    format!("{} values for shape {shape:?} ({numel})", v.len()),
                ));
            }
        }
        if ours.len() != given.len() {
            let known: std::collections::HashSet<&str> = ours.iter().map(|t| t.0).collect();
            if let Some((name, _, _)) = tensors.iter().find(|t| !known.contains(t.0.as_str())) {
                return Err(mismatch(name, "not a tensor of this model".into()));
            }
        }
        for (name, tensor, shape, _) in &ours {
            let (_, values) = given[name];
            write_f32(tensor, values, shape)
                .map_err(|e| TchBackendError::Torch(format!("writing {name}: {e}")))?;
        }
        Ok(())
    }

    /// `(name, tensor, shape, numel)` of every parameter and buffer, units in order.
    fn all_tensors(&self) -> Vec<(&str, &Tensor, &[i64], usize)> {
        let mut out = Vec::new();
        for unit in self.units.iter().flatten() {
            for p in &unit.params {
                out.push((p.name.as_str(), &p.value, p.shape.as_slice(), p.numel));
            }
            for b in &unit.buffers {
                out.push((b.name.as_str(), &b.value, b.shape.as_slice(), b.numel));
            }
        }
        out
    }
}
