//! # coordinator — membership, the layer map and the global checkpoint of a dreamddp cluster
//!
//! * [`state`] — the sans-IO [`CoordinatorState`]: joins with credentials, heartbeats and
//!   leases, elastic join/leave, the layer → aggregator map (rebalanced by rendezvous
//!   hashing when aggregators come and go), the global checkpoint (newest
//!   [`protocol::LayerVersion`] per layer) and the latest stats of every node.
//! * [`divergence`] — the divergence monitor: per layer, the spread of the trainers'
//!   distances to the global model, and a warning when it grows.
//! * [`layer_map`] — rendezvous hashing of layers over aggregators.
//! * [`status`] — the operator's view ([`StatusReport`], JSON via serde) and its Prometheus
//!   exposition ([`prometheus_text`]).
//! * [`output`] — what the state machine asks of its shell ([`Output`]) and reports
//!   ([`CoordEvent`]).
//! * [`server`] — the tokio shell: QUIC (mutual TLS, `transport` crate), per-connection
//!   reader/writer tasks, subscriptions to aggregators, the HTTP status endpoint
//!   (`/status`, `/metrics`, `/healthz`); [`run_coordinator`].
//! * [`log`] — operator log lines for events.
//! * [`config`], [`error`] — configuration and typed refusal/input errors.

pub mod config;
pub mod divergence;
pub mod error;
mod http;
pub mod layer_map;
pub mod log;
pub mod output;
pub mod server;
pub mod state;
pub mod status;

pub use config::{ConnId, CoordinatorConfig, LayerInfo};
pub use divergence::{DivergenceConfig, DivergenceMonitor, DivergenceWarning, LayerSpread};
pub use error::{InputError, RefusalReason};
pub use layer_map::{assign_owners, owner_of, LayerMove};
pub use log::EventCounts;
pub use output::{CoordEvent, Output};
pub use server::{
    run_coordinator, CoordinatorError, CoordinatorRunConfig, CoordinatorServer, CoordinatorSummary,
    COORDINATOR_NODE_ID,
};
pub use state::{CheckpointLayer, CoordinatorState, Member};
pub use status::{prometheus_text, LayerStatus, MemberStatus, StatsReport, StatusReport, Totals};

#[cfg(test)]
mod tests;
