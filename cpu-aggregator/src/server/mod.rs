//! The aggregator process (`dreamddp aggregator`): configuration, the durable shard file,
//! and the tokio + QUIC shell around [`crate::AggregatorState`].

mod advertise;
pub mod config;
pub mod initial;
pub mod run;
pub mod shard_file;

pub use config::{AggregatorConfigError, AggregatorRunConfig};
pub use run::{run_aggregator, AggregatorRunError, AggregatorSummary, VERSION_STALL_TIMEOUT};
