//! # cpu-aggregator — the sans-IO state machine of a CPU aggregator
//!
//! An aggregator owns a shard of layers. Nodes (edge agents, node leaders) send it
//! per-layer deltas `Δ = θ − anchor`; it folds them in with staleness-weighted averaging
//! (`engine::staleness::aggregate`), versions every layer, acknowledges each delta and
//! broadcasts the new version.
//!
//! The logic is **sans-IO** (like `quinn-proto`): [`AggregatorState`] never reads a clock,
//! sleeps, opens a socket, spawns a thread or touches a file. Time is an explicit
//! `now: u64` in **nanoseconds** of whatever clock the driver uses (virtual time in the
//! simulator, a monotonic clock in the tokio/quinn shell); only differences of `now` values
//! matter. The driver:
//!
//! 1. feeds inputs: [`AggregatorState::handle_message`] and
//!    [`AggregatorState::handle_timeout`] (when [`AggregatorState::poll_timeout`]'s deadline
//!    passes);
//! 2. drains [`AggregatorState::poll_output`] until `None`, sending messages, fanning
//!    broadcasts out to subscribed nodes, logging events;
//! 3. persists [`AggregatorState::snapshot`] when it wants durability (see the durability
//!    note on [`Output`]).
//!
//! Modules: [`config`] (layers and tuning), [`contributors`] (the node count behind the
//! self-normalizing outer learning rate), [`state`] (the state machine), [`snapshot`]
//! (checksummed byte encoding of the shard), [`error`] (typed errors).

pub mod config;
pub mod contributors;
pub mod error;
pub mod server;
pub mod snapshot;
pub mod state;

pub use config::{Aggregation, AggregatorConfig, NodeId, OuterLrScaling, OwnedLayer};
pub use error::{AggregatorError, InputError, SnapshotError};
pub use state::{AggEvent, AggregatorCounters, AggregatorState, LayerView, Output};

#[cfg(test)]
mod tests;
