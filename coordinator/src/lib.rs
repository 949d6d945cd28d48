//! # coordinator — membership, the layer map and the global checkpoint of a dreamddp cluster
//!
//! * [`state`] — the sans-IO [`CoordinatorState`]: joins with credentials, heartbeats and
//!   leases, elastic join/leave, the layer → aggregator map (rebalanced by rendezvous
//!   hashing when aggregators come and go), the global checkpoint (newest
//!   [`protocol::LayerVersion`] per layer) and the latest stats of every node.
//! * [`layer_map`] — rendezvous hashing of layers over aggregators.
//! * [`status`] — the operator's view ([`StatusReport`], JSON via serde) and its Prometheus
//!   exposition ([`prometheus_text`]).
//! * [`output`] — what the state machine asks of its shell ([`Output`]) and reports
//!   ([`CoordEvent`]).
//! * [`config`], [`error`] — configuration and typed refusal/input errors.

pub mod config;
pub mod error;
pub mod layer_map;
pub mod output;
pub mod state;
pub mod status;

pub use config::{ConnId, CoordinatorConfig, LayerInfo};
pub use error::{InputError, RefusalReason};
pub use layer_map::{assign_owners, owner_of, LayerMove};
pub use output::{CoordEvent, Output};
pub use state::{CheckpointLayer, CoordinatorState, Member};
pub use status::{prometheus_text, LayerStatus, MemberStatus, StatsReport, StatusReport, Totals};

#[cfg(test)]
mod tests;
