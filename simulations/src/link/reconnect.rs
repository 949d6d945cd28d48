//! When a device's connection is back after its QUIC connection died (the idle timeout): the
//! edge agent's reconnect loop (`edge-agent/src/runtime/net.rs`, `aggregator_link`) replayed
//! against the link's outages.
//!
//! The agent waits 100 ms after the connection is lost, then dials; a dial that gets no answer
//! fails after the transport's idle timeout (10 s), and the agent waits twice as long as
//! before (up to 2 s) and dials again. A dial sends its first packet (QUIC's Initial) at once
//! and again after each handshake probe timeout: quinn's initial RTT estimate of 333 ms makes
//! that 1 s, doubling (so at 0, 1, 3 and 7 s). The first of those packets sent while both
//! directions of the link are out of an outage completes the handshake one round trip later.
//!
//! Approximations: a handshake packet is never lost to random or burst loss, only to outages;
//! the trace's capacity gaps do not delay it; the node's `Subscribe` costs nothing.

use crate::time::{SimDuration, SimTime};

/// First wait after a lost connection, and the cap of the doubling.
const FIRST_BACKOFF: SimDuration = SimDuration::from_millis(100);
const MAX_BACKOFF: SimDuration = SimDuration::from_secs(2);
/// When a dial sends its Initial packet again, after the first (quinn: PTO of the 333 ms
/// initial RTT estimate, ≈ 1 s, doubling).
const INITIAL_RESENDS_MS: [u64; 4] = [0, 1_000, 3_000, 7_000];
/// Give up after this long without a handshake (a dial that never gets through).
const GIVE_UP: SimDuration = SimDuration::from_secs(86_400);

/// When the connection that died at `died` is up again: `rtt` is the link's round trip,
/// `dial_timeout` the transport's idle timeout (how long a dial waits for an answer), and
/// `in_outage(t)` whether either direction of the link is in an outage at `t`.
pub fn reconnected_at(
    died: SimTime,
    rtt: SimDuration,
    dial_timeout: SimDuration,
    in_outage: impl Fn(SimTime) -> bool,
) -> SimTime {
    let mut backoff = FIRST_BACKOFF;
    let mut dial = died + backoff;
    while dial < died + GIVE_UP {
        for offset in INITIAL_RESENDS_MS {
            let offset = SimDuration::from_millis(offset);
            if offset >= dial_timeout {
                break;
            }
            let sent = dial + offset;
            if !in_outage(sent) && !in_outage(sent + rtt) {
                return sent + rtt;
            }
        }
        backoff = (backoff * 2).min(MAX_BACKOFF);
        dial = dial + dial_timeout + backoff;
    }
    dial
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(v: f64) -> SimTime {
        SimTime::from_nanos((v * 1e9) as u64)
    }

    const RTT: SimDuration = SimDuration::from_millis(100);
    const DIAL: SimDuration = SimDuration::from_secs(10);

    #[test]
    fn a_link_without_outage_reconnects_after_the_first_wait_and_a_round_trip() {
        assert_eq!(reconnected_at(s(5.0), RTT, DIAL, |_| false), s(5.2));
    }

    #[test]
    fn a_dial_in_an_outage_waits_for_its_next_initial_or_the_next_dial() {
        // Died at 20 s in an outage that ends at 70 s. Dials at 20.1, 30.3 (backoff 0.2),
        // 40.7 (0.4), 51.5 (0.8), 63.1 (1.6); that one resends at 64.1, 66.1 and 70.1: up at
        // 70.1 + the round trip.
        let outage = |t: SimTime| t >= s(10.0) && t < s(70.0);
        let back = reconnected_at(s(20.0), RTT, DIAL, outage);
        assert!((back.as_secs_f64() - 70.2).abs() < 1e-6, "{back:?}");
    }

    #[test]
    fn the_round_trip_must_end_outside_the_outage_too() {
        // The Initial at 5.1 s lands after the outage starts at 5.15 s; the resend at 6.1 s,
        // after it ended at 6 s, gets through.
        let outage = |t: SimTime| t >= s(5.15) && t < s(6.0);
        let back = reconnected_at(s(5.0), RTT, DIAL, outage);
        assert!((back.as_secs_f64() - 6.2).abs() < 1e-6, "{back:?}");
    }

    #[test]
    fn a_link_that_never_comes_back_gives_up_after_a_day() {
        let back = reconnected_at(s(1.0), RTT, DIAL, |_| true);
        assert!(back >= s(86_401.0) && back < s(86_420.0), "{back:?}");
    }
}
