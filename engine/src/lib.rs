//! dreamddp training engine: the library every trainer shares.
//!
//! * [`tensor`] / [`backend`]: dense f32 tensors and the CPU compute backend (GEMM via the `gemm` crate).
//! * [`layer`] / [`layers`]: the layer abstraction (named, shaped parameters) and the layer zoo.
//! * [`model`] / [`models`]: an ordered stack of layers whose backward calls a hook per layer
//!   the moment that layer's gradient is ready, and the built-in models (`mlp`, `cnn`, `gpt-tiny`).
//! * [`loss`], [`optim`], [`data`]: losses, per-layer optimizers and LR schedules, data sets.
//! * [`plan`], [`schedule`], [`staleness`]: sync plans (buckets, strategies), the DreamDDP
//!   schedule, and staleness-weighted averaging.

pub mod backend;
pub mod layer;
pub mod model;
pub mod tensor;

#[cfg(test)]
pub mod gradcheck;
