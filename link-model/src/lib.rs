//! The one link model of dreamddp, shared by the simulator (`simulations`) and the lossy UDP
//! relay (`relay`), so that a link is written, validated and behaves the same in both:
//!
//! * [`time`] — virtual time in integer nanoseconds ([`SimTime`], [`SimDuration`]);
//! * [`rng`] — seeded, named RNG streams ([`SimRng`]);
//! * [`vocabulary`] — [`Bandwidth`], [`GilbertElliottSpec`] and its chain [`GilbertElliott`],
//!   [`OutageSpec`], [`PeriodicOutageSpec`], [`TraceSpec`];
//! * [`trace`] — mahimahi and `time_s Mbit/s` traces and their replay ([`Trace`]);
//! * [`spec`] — [`LinkSpec`]: one direction of a link, the one spec of scenarios, relays and
//!   cluster files, validated with errors naming the field ([`LinkSpec::checked`]);
//! * [`shaper`] — [`LinkShaper`]: the sans-IO per-datagram behaviour of such a link (drop with a
//!   [`DropReason`], or deliver at a time), deterministic for a seed.
//!
//! The simulator's message-level QUIC link (`simulations::Link`) is built from the same
//! [`LinkSpec`]; the relay is the tokio shell around [`LinkShaper`].

pub mod rng;
pub mod shaper;
pub mod spec;
pub mod time;
pub mod trace;
pub mod vocabulary;

pub use rng::SimRng;
pub use shaper::{DropReason, LinkShaper, Verdict};
pub use spec::{
    CapacitySource, CheckedLink, LinkSpec, LinkSpecError, RelayLinkSpec, RelaySpecError,
    DEFAULT_QUEUE_MS, SCENARIO_QUEUE_MS,
};
pub use time::{SimDuration, SimTime};
pub use trace::{Trace, TraceError, TraceFormat, MAHIMAHI_OPPORTUNITY_BYTES};
pub use vocabulary::{
    Bandwidth, BandwidthParseError, GilbertElliott, GilbertElliottSpec, OutageSpec,
    PeriodicOutageSpec, TraceSpec,
};
