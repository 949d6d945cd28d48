//! The layer abstraction: a unit of computation with named, shaped parameters
//! that caches what its backward pass needs.

use crate::tensor::Tensor;

/// One named parameter tensor of a layer with its gradient buffer.
#[derive(Clone, Debug, PartialEq)]
pub struct Param {
    /// Name inside its layer, e.g. `weight`, `bias`, `attn.qkv.weight`.
    pub name: String,
    /// Shape of the parameter.
    pub shape: Vec<usize>,
    /// Current values, row-major.
    pub value: Vec<f32>,
    /// Gradient of the loss w.r.t. `value`, written by the layer's `backward`.
    pub grad: Vec<f32>,
}

impl Param {
    /// A parameter with the given initial values and a zeroed gradient.
    pub fn new(name: &str, shape: &[usize], value: Vec<f32>) -> Self {
        assert_eq!(
            shape.iter().product::<usize>(),
            value.len(),
            "param {name} shape"
        );
        let grad = vec![0.0; value.len()];
        Self {
            name: name.to_string(),
            shape: shape.to_vec(),
            value,
            grad,
        }
    }

    /// Number of scalars.
    pub fn len(&self) -> usize {
        self.value.len()
    }

    /// True when the parameter holds no scalars.
    pub fn is_empty(&self) -> bool {
        self.value.is_empty()
    }
}

/// A layer of a model. `forward` with `train = true` caches what `backward` needs;
/// `backward` **overwrites** each parameter's `grad` with the gradient of this batch and
/// returns the gradient w.r.t. the layer's input.
///
/// `Any` is a supertrait so another backend (the `tch` crate) can read a layer's
/// configuration (`&dyn Layer` upcasts to `&dyn Any`, then `downcast_ref::<Conv2d>()`).
pub trait Layer: Send + std::any::Any {
    /// Short type name, e.g. `linear`, `conv2d`, `block`.
    fn kind(&self) -> &'static str;
    /// Computes the output for `input`.
    fn forward(&mut self, input: &Tensor, train: bool) -> Tensor;
    /// Back-propagates `grad_output` (same shape as the last forward output).
    fn backward(&mut self, grad_output: &Tensor) -> Tensor;
    /// Parameters (empty for activations).
    fn params(&self) -> &[Param] {
        &[]
    }
    /// Mutable parameters (empty for activations).
    fn params_mut(&mut self) -> &mut [Param] {
        &mut []
    }
    /// Approximate multiply-add count of one forward pass per sample (for compute models).
    fn forward_macs_per_sample(&self) -> u64 {
        self.params().iter().map(|p| p.len() as u64).sum()
    }
}

/// Total number of scalars in a layer's parameters.
pub fn param_len(layer: &dyn Layer) -> usize {
    layer.params().iter().map(Param::len).sum()
}
