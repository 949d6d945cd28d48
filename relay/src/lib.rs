//! A user-space lossy UDP relay to put in front of a QUIC endpoint, so bad networks can be tested
//! without root or netem:
//!
//! ```text
//! client ──UDP──▶ relay (listen) ──UDP──▶ upstream (server)
//!        ◀──────────────────────────────  replies
//! ```
//!
//! The relay only delays and drops datagrams, so QUIC runs through it unchanged. Each direction
//! has its own link model ([`RelayLinkSpec`], written in the simulator's vocabulary: bandwidth
//! such as `"20mbit"`, i.i.d. and Gilbert–Elliott loss, outage windows, latency and jitter,
//! mahimahi or `time_s Mbit/s` trace replay), applied by a sans-IO [`LinkShaper`] that is
//! deterministic for a seed.
//!
//! # Pieces
//! * [`spec`] and [`shaper`] — re-exported from the shared `link-model` crate (the simulator
//!   speaks the same vocabulary): [`RelayLinkSpec`], one direction's parameters validated with
//!   errors naming the field, and [`LinkShaper`], per datagram [`Verdict::Drop`] with a
//!   [`DropReason`] or [`Verdict::Deliver`] at a time. No clocks, no I/O.
//! * [`config`] — [`RelayConfig`] and [`load_relay_config`] (TOML).
//! * [`udp_relay`] — [`spawn_relay`] and [`RelayHandle`]: the tokio shell.
//! * [`stats`] — [`RelayStats`]: per-direction counters.

pub mod config;
pub mod error;
pub mod stats;
pub mod udp_relay;

/// The relayed link's spec and its sans-IO shaper live in the shared link model.
pub use link_model::{shaper, spec};

pub use config::{load_relay_config, RelayConfig};
pub use error::RelayError;
pub use link_model::PeriodicOutageSpec;
pub use shaper::{DropReason, LinkShaper, Verdict};
pub use spec::{LinkSpec, RelayLinkSpec, RelaySpecError, DEFAULT_QUEUE_MS, SCENARIO_QUEUE_MS};
pub use stats::{DirectionStats, DropCounts, RelayStats};
pub use udp_relay::{spawn_relay, spawn_relay_with_zero, RelayHandle};
