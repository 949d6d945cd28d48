//! dreamddp's simulator core: a deterministic discrete-event engine in virtual time and
//! packet-level models of lossy, heterogeneous network links.
//!
//! # Pieces
//! * [`time`] — virtual time as integer nanoseconds ([`SimTime`], [`SimDuration`]).
//! * [`events`] — [`EventQueue`]: earliest event first, FIFO among equal times.
//! * [`rng`] — [`SimRng`]: seeded ChaCha8 streams; [`SimRng::fork`] derives independent per-link /
//!   per-node streams from labels, so adding a component does not perturb the others.
//! * [`trace`] — parsers and replay for mahimahi and `time_s Mbit/s` capacity traces.
//! * [`link`] — [`LinkSpec`] (scenario-file parameters) and [`Link`], one direction of a link that
//!   turns "N bytes submitted at t, deadline d" into a [`Transfer`] (delivery time or failure,
//!   bytes on the wire, losses, retransmissions); [`MuxLink`], the same link shared by the
//!   messages in flight round-robin up to a send window (as QUIC streams share a connection),
//!   with the standing queue of a BBR sender (edge scenarios use it).
//! * [`scenario_net`] — [`Topology`]: named nodes and per-direction links, from TOML.
//!
//! # Determinism
//! Nothing here reads the wall clock, spawns threads or does I/O other than reading trace and
//! scenario files. All randomness comes from [`SimRng`] streams forked from one seed, the event
//! queue breaks ties by insertion order, and iteration orders are fixed (`BTreeMap`, `Vec`). The
//! same scenario with the same seed therefore yields bit-identical results on a given platform
//! (floating point appears only in trace-rate integration and probability comparisons, which
//! are IEEE-754 deterministic).
//!
//! # What the link model computes exactly, and what it approximates
//! Exact (given the model): FIFO queueing of messages on a [`Link`], round-robin sharing on a
//! [`MuxLink`]; per-packet serialization at the
//! capacity in force at that moment (constant, or the trace's delivery opportunities/rates,
//! looped); propagation latency and per-packet jitter (never negative); the loss process (i.i.d.
//! and Gilbert–Elliott chains stepped per packet, outages by the time a packet leaves); QUIC-style
//! loss detection (three later acknowledgements, or a probe timeout from an RFC 9002 smoothed-RTT
//! estimator, with exponential backoff per consecutive loss of a packet) and retransmission of
//! lost packets before new data; deadlines (a late message is a failure and frees the link at the
//! deadline) and a connection idle timeout.
//!
//! Approximated or left out: congestion control only as BBR's standing queue on a [`MuxLink`]
//! (a rate-based sender that keeps the bottleneck full; random loss does not reduce the sending
//! rate; `link/queue.rs` says what of BBR is left out), no packet headers, acknowledgements travel
//! a lossless reverse path with the same base latency, RTT samples are taken when a packet is sent
//! rather than when its acknowledgement arrives, and on a FIFO [`Link`] the next queued message
//! cannot use the link while the current one waits for a probe timeout (one stream at a time).
//! A whole FIFO transfer is computed when it is submitted, which is exact because the link is
//! FIFO and its random processes are owned by the link; a [`MuxLink`] is advanced in time and
//! reports admissions and finishes as events.

pub mod clusters;
pub mod compute;
pub mod edge;
pub mod events;
pub mod link;
pub mod replica;
pub mod report;
pub mod scenario;
pub mod scenario_net;
pub use link_model::{rng, time, trace};

pub use events::{EventId, EventQueue, ScheduleInPast};
pub use link::{
    Bandwidth, BandwidthParseError, GilbertElliott, GilbertElliottSpec, Link, LinkError, LinkSpec,
    LinkSpecError, LinkStats, MuxEvent, MuxLink, OutageSpec, TraceSpec, Transfer, TransferFailure,
};
pub use rng::SimRng;
pub use scenario_net::{
    DirectedLinkSpec, DuplexLinkSpec, NodeId, Topology, TopologyError, TopologySpec,
};
pub use time::{SimDuration, SimTime};
pub use trace::{Trace, TraceError, TraceFormat, MAHIMAHI_OPPORTUNITY_BYTES};

#[cfg(test)]
mod tests {
    use super::*;
    use std::fmt::Write;
    use std::path::Path;

    const SCENARIO: &str = r#"
nodes = ["hub", "edge"]
[links.edge]
from = "edge"
to = "hub"
up = { bandwidth = "20mbit", latency_ms = 25, jitter_ms = 5, loss = 0.04 }
down = { bandwidth = "50mbit", latency_ms = 25, gilbert_elliott = { p_good_to_bad = 0.01, p_bad_to_good = 0.25, loss_bad = 0.7 } }
"#;

    /// A ping-pong of layer-sized messages with deadlines, driven by the event queue; returns a
    /// text log of everything that happened.
    fn run(seed: u64) -> String {
        let topology = Topology::from_toml_str(SCENARIO, Path::new(".")).unwrap();
        let mut links = topology.build_links(&SimRng::new(seed)).unwrap();
        let mut queue = EventQueue::new();
        // Event: (link index, message size, round).
        queue
            .schedule(SimTime::ZERO, (0usize, 400_000u64, 0u32))
            .unwrap();
        let mut log = String::new();
        while let Some((now, (link, bytes, round))) = queue.pop() {
            let deadline = now + SimDuration::from_millis(400);
            let transfer = links[link].send(now, bytes, Some(deadline));
            writeln!(
                log,
                "{now} {} {bytes} {transfer:?}",
                topology.links()[link].name
            )
            .unwrap();
            if round < 40 {
                // The reply leaves when the message arrives, or at the deadline if it missed.
                let next_at = transfer.delivered_at.unwrap_or(deadline);
                queue
                    .schedule(next_at, (1 - link, bytes + 10_000, round + 1))
                    .unwrap();
            }
        }
        log
    }

    #[test]
    fn whole_run_is_byte_identical_for_a_seed() {
        let a = run(11);
        assert_eq!(a, run(11));
        assert_ne!(a, run(12));
        assert_eq!(a.lines().count(), 41);
    }
}
