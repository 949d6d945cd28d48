//! dreamddp training engine: the library every trainer shares.
//!
//! * [`tensor`] / [`backend`]: dense f32 tensors and the CPU compute backend (GEMM via the `gemm` crate).
//! * [`layer`] / [`layers`]: the layer abstraction (named, shaped parameters) and the layer zoo.
//! * [`model`] / [`models`]: an ordered stack of layers whose backward calls a hook per layer
//!   the moment that layer's gradient is ready, and the built-in models (`mlp`, `cnn`, `gpt-tiny`).
//! * [`loss`], [`optim`], [`lr`], [`data`]: losses, per-layer optimizers, LR schedules, data sets.
//! * [`plan`], [`bucket`], [`schedule`], [`staleness`]: sync plans (strategies, buckets), the
//!   DreamDDP schedule, and staleness-weighted averaging ([`fused_reduce`]: its single-pass
//!   streaming kernels for aggregators).
//! * [`config_search`]: the best DreamDDP configuration (phase groups, delay) under a cost model
//!   that carries communication across steps.
//! * [`divergence`]: a trainer's relative distance to the global model (the divergence monitor's
//!   input).
//! * [`sync_units`]: the rule that splits a large layer into chunks (sync units of bounded size).
//! * [`outer`]: how a parameter average lands (replace, rebase, DiLoCo's outer Nesterov step).

pub mod backend;
pub mod bucket;
pub mod checkpoint;
pub mod config_search;
pub mod data;
pub mod divergence;
pub mod fused_reduce;
pub mod layer;
pub mod layers;
pub mod loss;
pub mod lr;
pub mod model;
pub mod models;
pub mod optim;
pub mod outer;
pub mod plan;
pub mod replica;
pub mod schedule;
pub mod staleness;
pub mod sync_units;
pub mod tensor;

#[cfg(test)]
pub mod gradcheck;
