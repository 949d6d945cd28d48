//! The training node process (`dreamddp edge`, `dreamddp worker`): configuration, the
//! synchronous driver of the sans-IO [`crate::SyncClient`] on the leader's training thread,
//! and the tokio + QUIC network side; and `dreamddp swarm`, many synthetic clients in one
//! process for load tests.

pub mod config;
pub mod driver;
pub mod mailbox;
pub mod net;
pub mod pacing;
pub mod run;
pub mod swarm;
pub mod topk;

pub use config::{NodeConfigError, NodeRunConfig};
pub use run::{next_incarnation, run_node, run_node_until, NodeRunError, NodeRunSummary};
