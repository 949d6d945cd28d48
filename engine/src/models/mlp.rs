//! The `mlp` model for MNIST / digits.
