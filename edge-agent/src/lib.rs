//! # edge-agent — the sans-IO sync client of edge agents and node leaders
//!
//! [`SyncClient`] is the node side of the cross-site exchange with the CPU aggregators: per
//! layer it cuts deltas `Δ = θ − anchor` on the layer's period, sends them to the layer's
//! owner with a deadline, retries, **weak-syncs** (moves to a durable cache) deltas whose
//! deadline passed, coalesces cached deltas into one retransmission when the link is back,
//! and rebases the local parameters when a new global version arrives
//! (`θ ← θ_global + (θ_now − θ_at_cut)`).
//!
//! The logic is **sans-IO** (like `quinn-proto`): no clocks, sleeps, sockets, threads or
//! files inside. Time is an explicit `now: u64` in **nanoseconds** of the driver's clock
//! (virtual in the simulator, monotonic in the tokio/quinn shell); only differences
//! matter. The state machine does not own the parameters either: the driver passes `θ`
//! in ([`SyncClient::on_step_end`], [`SyncClient::apply_version`]) and performs the cache
//! writes it asks for ([`Output::CachePut`], [`Output::CacheReplace`],
//! [`Output::CacheRemove`]), confirming durability with [`SyncClient::cache_put_done`].
//!
//! Modules: [`config`] (layer specs, tuning), [`state`] (the state machine), [`cache`]
//! (cache entries and their checksummed encoding), [`durable_cache`] (the sled-backed store
//! of those entries, with checksum recovery), [`error`] (typed errors).

pub mod cache;
pub mod config;
pub mod deadline;
pub mod durable_cache;
pub mod early_sync;
pub mod error;
pub mod final_cuts;
pub mod runtime;
pub mod state;

#[cfg(test)]
mod e2e_tests;

pub use cache::CacheEntry;
pub use config::{spread_phases, ClientConfig, LayerInit, LayerSpec, NodeId};
pub use deadline::{AdaptiveDeadline, DeadlinePolicy};
pub use durable_cache::{CacheError, DurableCache, OpenReport};
pub use error::{CacheDecodeError, ClientError};
pub use final_cuts::FinalCuts;
pub use state::{ClientCounters, ClientEvent, CutOutcome, InFlightView, Output, SyncClient};
