//! A model: an ordered stack of named layers. Its backward walks from the output head
//! down to the input and calls a hook with each layer **the moment its gradients are
//! computed**, so a trainer can launch that layer's synchronization inside backward.

use crate::layer::{param_len, Layer};
use crate::tensor::Tensor;

/// A layer with the name users see in logs and reports (`fc1`, `conv2`, `block0`, `head`).
pub struct NamedLayer {
    /// Unique name within the model.
    pub name: String,
    /// The layer itself.
    pub layer: Box<dyn Layer>,
}

/// What a sync plan needs to know about one parameterized layer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayerInfo {
    /// Index in [`Model::layers`].
    pub index: usize,
    /// Layer name.
    pub name: String,
    /// Layer type name.
    pub kind: &'static str,
    /// Number of f32 parameters.
    pub params: usize,
}

/// An ordered stack of layers (input first, output head last).
pub struct Model {
    /// Model name, e.g. `mlp`.
    pub name: String,
    /// Layers in forward order.
    pub layers: Vec<NamedLayer>,
}

impl Model {
    /// A model from named layers in forward order.
    pub fn new(name: &str, layers: Vec<(&str, Box<dyn Layer>)>) -> Self {
        let layers = layers
            .into_iter()
            .map(|(n, layer)| NamedLayer {
                name: n.to_string(),
                layer,
            })
            .collect();
        Self {
            name: name.to_string(),
            layers,
        }
    }

    /// Forward through every layer.
    pub fn forward(&mut self, input: &Tensor, train: bool) -> Tensor {
        let mut layers = self.layers.iter_mut();
        let Some(first) = layers.next() else {
            return input.clone();
        };
        let mut x = first.layer.forward(input, train);
        for l in layers {
            x = l.layer.forward(&x, train);
        }
        x
    }

    /// Backward from `grad_output` (gradient w.r.t. the model output), output head first.
    /// `on_layer_ready(index, layer)` runs right after layer `index` computed its
    /// parameter gradients — for parameterized layers only.
    pub fn backward_with_hook(
        &mut self,
        grad_output: &Tensor,
        on_layer_ready: &mut dyn FnMut(usize, &mut NamedLayer),
    ) {
        // The input layer's input gradient is not needed, but computing it keeps
        // every layer's contract simple; its cost is small next to the weight gradient.
        let mut g: Option<Tensor> = None;
        for (i, l) in self.layers.iter_mut().enumerate().rev() {
            g = Some(l.layer.backward(g.as_ref().unwrap_or(grad_output)));
            if !l.layer.params().is_empty() {
                on_layer_ready(i, l);
            }
        }
    }

    /// Parameterized layers in **forward** order (the sync units of a plan).
    pub fn layer_infos(&self) -> Vec<LayerInfo> {
        self.layers
            .iter()
            .enumerate()
            .filter(|(_, l)| !l.layer.params().is_empty())
            .map(|(index, l)| LayerInfo {
                index,
                name: l.name.clone(),
                kind: l.layer.kind(),
                params: param_len(l.layer.as_ref()),
            })
            .collect()
    }

    /// Total number of f32 parameters.
    pub fn param_count(&self) -> usize {
        self.layers
            .iter()
            .map(|l| param_len(l.layer.as_ref()))
            .sum()
    }

    /// Copies the parameters of layer `index` into one flat vector (param order, row-major).
    pub fn layer_values(&self, index: usize) -> Vec<f32> {
        let mut out = Vec::new();
        for p in self.layers[index].layer.params() {
            out.extend_from_slice(&p.value);
        }
        out
    }

    /// Overwrites the parameters of layer `index` from a flat vector made by [`Self::layer_values`].
    ///
    /// # Panics
    /// When `flat` has the wrong length (an engine bug).
    pub fn set_layer_values(&mut self, index: usize, flat: &[f32]) {
        let mut off = 0;
        for p in self.layers[index].layer.params_mut() {
            let n = p.value.len();
            p.value.copy_from_slice(&flat[off..off + n]);
            off += n;
        }
        assert_eq!(off, flat.len(), "layer {index} flat length");
    }

    /// All parameters of the model as one flat vector, layer by layer in forward order.
    pub fn flat_values(&self) -> Vec<f32> {
        (0..self.layers.len())
            .flat_map(|i| self.layer_values(i))
            .collect()
    }
}
