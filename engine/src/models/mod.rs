//! The built-in models.

pub mod cnn;
pub mod gpt;
pub mod mlp;
