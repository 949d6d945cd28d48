//! Elementwise activations: ReLU and GELU (tanh approximation).
