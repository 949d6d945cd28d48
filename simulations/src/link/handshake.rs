//! When a QUIC connection dialled over a node's access link is up: the handshake and the
//! transport's connection check, flight by flight, over copies of the link's two directions.
//!
//! A real edge agent trains only once its aggregator connection is up
//! (`edge-agent/src/runtime/run.rs`, the bootstrap loop), and a dial is up when quinn's
//! handshake has completed and the transport's post-handshake check has been answered
//! (`transport::node::client_check`). That is four flights, each waiting for the one before:
//!
//! 1. up: the client's Initial (one datagram, padded to 1200 bytes);
//! 2. down: the server's Initial and Handshake packets (server hello, certificate request, its
//!    certificate, verify, finished): two full datagrams;
//! 3. up: the client's Handshake packets (its certificate, verify, finished) with the check
//!    request in 1-RTT: two full datagrams;
//! 4. down: the check reply (one small datagram).
//!
//! Every datagram crosses the link as a data packet does (trace capacity, latency, jitter in
//! order, i.i.d. and Gilbert–Elliott loss, outages), drawn from a copy of the direction with
//! random streams of its own ([`Link::handshake_path`]). A lost datagram is sent again when its
//! sender's probe timeout fires: 999 ms before the sender has a round-trip sample (quinn's
//! initial RTT estimate of 333 ms: `333 + 4 · 333/2`), three times its first sample after
//! (`srtt + 4 · rttvar` with `rttvar = srtt/2`), doubling for every timeout in a row. A dial
//! not up within the dial timeout fails.
//!
//! Measured (the `[LINK] … up` log line after `[START]`, real runs of 2026-12-06 and -07):
//! 0.13–0.15 s on `fidelity-fcc`'s 20 ms FCC link and 0.30–0.32 s on its 60 ms one, 0.08–0.09 s
//! on `fidelity-smoke`'s 10 Mbit/s 15 ms link, 0.30–0.35 s on the Norway 3G trace (60 ms); the
//! model gives 0.13, 0.30, 0.08 and 0.30 s without loss (the test below). On the ATT LTE
//! traces (40 ms) the model's dials take 0.19 s; the real ones took 1.0–1.5 s while a trainer
//! dialled after its process had started, into a trace that had run on (the ATT uplink has no
//! delivery opportunity from 0.49 to 1.53 s), and 0.25 s since the trainers and their relays'
//! traces share one common start (`dreamddp cluster`, 2026-12-07; times from that start). A
//! lost datagram costs a probe timeout: 6.5–7.6 s in the earlier real runs when one of the
//! Initial's resends (1, 3, 7 s) was needed, about 1.7 s since.
//!
//! Approximations: a datagram is acknowledged by the next flight only (no loss detection by
//! later acknowledgements within a flight); the server's and client's processing (TLS
//! signatures, certificate checks) costs nothing; the sizes are those of dreamddp's small
//! certificates, not measured per run.

use super::{Link, PacketFate};
use crate::time::{SimDuration, SimTime};

/// A full datagram of the handshake (QUIC pads datagrams with Initial packets to 1200 bytes).
const FULL_DATAGRAM: u64 = 1200;
/// The check reply's datagram.
const SMALL_DATAGRAM: u64 = 200;
/// Probe timeout before the first round-trip sample: quinn's initial RTT (333 ms) plus four
/// times half of it.
const FIRST_PTO: SimDuration = SimDuration::from_millis(999);
/// Most probe timeouts in a row that double the next one.
const MAX_BACKOFF: u32 = 16;

/// Which way a flight goes.
#[derive(Clone, Copy)]
enum Way {
    Up,
    Down,
}

/// The flights of a dial, in order: which way and the datagrams' sizes.
const FLIGHTS: [(Way, &[u64]); 4] = [
    (Way::Up, &[FULL_DATAGRAM]),
    (Way::Down, &[FULL_DATAGRAM, FULL_DATAGRAM]),
    (Way::Up, &[FULL_DATAGRAM, FULL_DATAGRAM]),
    (Way::Down, &[SMALL_DATAGRAM]),
];

/// One endpoint's probe timeout: from its first round-trip sample, if it has one.
#[derive(Clone, Copy, Default)]
struct Endpoint {
    first_sample: Option<SimDuration>,
    /// When its last flight was last sent (awaiting the answer that gives a sample).
    flight_sent: Option<SimTime>,
}

impl Endpoint {
    fn pto(self) -> SimDuration {
        self.first_sample.map_or(FIRST_PTO, |s| s * 3)
    }
}

/// When a connection dialled at `dial` over `up` and `down` (copies made by
/// [`Link::handshake_path`], kept for the node's later dials) is up; `None` when it is not up by
/// `dial + dial_timeout` (the dial fails then) or a trace ended.
pub fn handshake_done(
    dial: SimTime,
    up: &mut Link,
    down: &mut Link,
    dial_timeout: SimDuration,
) -> Option<SimTime> {
    let give_up = dial + dial_timeout;
    let (mut client, mut server) = (Endpoint::default(), Endpoint::default());
    let mut t = dial;
    for (way, datagrams) in FLIGHTS {
        let (link, sender, answered) = match way {
            Way::Up => (&mut *up, &mut client, &mut server),
            Way::Down => (&mut *down, &mut server, &mut client),
        };
        let (arrived, last_sent) = send_flight(link, t, datagrams, sender.pto(), give_up)?;
        // This flight answers the other endpoint's last one: its first round-trip sample.
        if let Some(sent) = answered.flight_sent.take() {
            answered.first_sample.get_or_insert(arrived - sent);
        }
        sender.flight_sent = Some(last_sent);
        t = arrived;
    }
    Some(t)
}

/// Sends `datagrams` back to back from `start`, each again after the sender's probe timeout
/// (doubling) until it arrives; returns when the last one arrived and when the last (re)send
/// went, `None` past `give_up`.
fn send_flight(
    link: &mut Link,
    start: SimTime,
    datagrams: &[u64],
    pto: SimDuration,
    give_up: SimTime,
) -> Option<(SimTime, SimTime)> {
    let mut pending: Vec<u64> = datagrams.to_vec();
    let mut arrived = start;
    let mut send_at = start;
    let mut timeouts = 0u32;
    loop {
        let mut t = send_at;
        let mut lost = Vec::new();
        for &size in &pending {
            match link.put_packet(t, size) {
                PacketFate::Sent { end, arrival } => {
                    t = end;
                    match arrival {
                        Some(a) => arrived = arrived.max(a),
                        None => lost.push(size),
                    }
                }
                PacketFate::TraceExhausted => return None,
            }
        }
        if lost.is_empty() {
            return (arrived <= give_up).then_some((arrived, send_at));
        }
        send_at += pto * (1u64 << timeouts.min(MAX_BACKOFF));
        timeouts += 1;
        if send_at > give_up {
            return None;
        }
        pending = lost;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::link::LinkSpec;
    use crate::rng::SimRng;

    fn link(toml_spec: &str) -> Link {
        let spec: LinkSpec = toml::from_str(toml_spec).unwrap();
        Link::new(&spec, None, &SimRng::new(1)).unwrap()
    }

    const TIMEOUT: SimDuration = SimDuration::from_secs(10);

    #[test]
    fn a_clean_link_is_up_after_four_one_way_trips_and_the_serializations() {
        // 10 Mbit/s, 15 ms: 1200 B take 0.96 ms. Flights of 1, 2, 2 and 1 datagrams (the last
        // 200 B: 0.16 ms), each one latency.
        let mut up = link("bandwidth = \"10mbit\"\nlatency_ms = 15");
        let mut down = up.clone();
        let done = handshake_done(SimTime::ZERO, &mut up, &mut down, TIMEOUT).unwrap();
        let expected = 4 * 15_000_000 + 5 * 960_000 + 160_000;
        assert_eq!(done.as_nanos(), expected);
    }

    #[test]
    fn a_link_in_an_outage_is_up_after_the_initials_resends() {
        // Out until 2.5 s: the Initial at 0 and its resend at 1 s are lost, the one at 3 s
        // (1 + 2) gets through.
        let spec = "bandwidth = \"10mbit\"\nlatency_ms = 15\noutages = [{ start_s = 0, duration_s = 2.5 }]";
        let mut up = link(spec);
        let mut down = link("bandwidth = \"10mbit\"\nlatency_ms = 15");
        let done = handshake_done(SimTime::ZERO, &mut up, &mut down, TIMEOUT).unwrap();
        let s = done.as_secs_f64();
        assert!((2.997..3.1).contains(&s), "{s}");
    }

    #[test]
    fn a_dial_that_cannot_get_through_in_time_fails() {
        let spec =
            "bandwidth = \"10mbit\"\nlatency_ms = 15\noutages = [{ start_s = 0, duration_s = 60 }]";
        let mut up = link(spec);
        let mut down = up.clone();
        assert_eq!(
            handshake_done(SimTime::ZERO, &mut up, &mut down, TIMEOUT),
            None
        );
    }

    /// Handshake time of a link both ways, without loss, in seconds.
    fn up_after(spec: &str) -> f64 {
        let spec: LinkSpec = toml::from_str(spec).unwrap();
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("traces");
        let mut up = Link::from_spec(&spec, &dir, &SimRng::new(1)).unwrap();
        let mut down = up.clone();
        handshake_done(SimTime::ZERO, &mut up, &mut down, TIMEOUT)
            .unwrap()
            .as_secs_f64()
    }

    #[test]
    fn the_shipped_links_connect_in_the_times_real_runs_measured() {
        // (link, model range, what the real runs' `[LINK] … up` lines measured)
        let cases = [
            // fidelity-fcc's fcc-near: 0.13–0.15 s.
            ("trace = { path = \"trace_207336_http---www.amazon.com\", format = \"mbps\" }\nlatency_ms = 20\njitter_ms = 5", 0.10..0.18),
            // fidelity-fcc's fcc-far: 0.30–0.32 s.
            ("trace = { path = \"trace_207336_http---www.amazon.com\", format = \"mbps\" }\nlatency_ms = 60\njitter_ms = 10", 0.25..0.36),
            // fidelity-smoke's edge-1: 0.08–0.09 s.
            ("bandwidth = \"10mbit\"\nlatency_ms = 15\njitter_ms = 5", 0.06..0.11),
            // The Norway 3G trace at 60 ms: 0.30–0.35 s.
            ("trace = { path = \"norway_bus_1\", format = \"mbps\" }\nlatency_ms = 60\njitter_ms = 20", 0.25..0.40),
        ];
        for (spec, range) in cases {
            let s = up_after(spec);
            assert!(range.contains(&s), "{spec}: {s}");
        }
    }

    #[test]
    fn after_its_first_sample_a_sender_resends_after_three_round_trips() {
        let mut e = Endpoint::default();
        assert_eq!(e.pto(), SimDuration::from_millis(999));
        e.first_sample = Some(SimDuration::from_millis(100));
        assert_eq!(e.pto(), SimDuration::from_millis(300));
    }
}
