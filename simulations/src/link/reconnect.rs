//! When a device's connection is up: the edge agent's dial loop (`edge-agent/src/runtime/net.rs`,
//! `aggregator_link`) replayed with the handshake model ([`super::handshake`]).
//!
//! The agent dials at once when it starts, and 100 ms after a connection is lost. A dial whose
//! handshake does not complete fails after the transport's idle timeout (10 s); the agent then
//! waits (100 ms after its first dial's failure, 200 ms after a lost connection's first redial,
//! doubling up to 2 s) and dials again. A dial's own resends (its Initial at 0, 1, 3 and 7 s)
//! are the handshake model's.

use crate::time::{SimDuration, SimTime};

/// First wait after a lost connection, and the cap of the doubling.
const FIRST_BACKOFF: SimDuration = SimDuration::from_millis(100);
const MAX_BACKOFF: SimDuration = SimDuration::from_secs(2);
/// Give up after this long without a handshake (a dial that never gets through).
const GIVE_UP: SimDuration = SimDuration::from_secs(86_400);

/// When the connection that died at `died` is up again: `dial_timeout` is the transport's idle
/// timeout (how long a dial waits for an answer), `handshake(dial)` when a dial at `dial` is
/// up, `None` when it fails ([`super::handshake_done`]).
pub fn reconnected_at(
    died: SimTime,
    dial_timeout: SimDuration,
    handshake: impl FnMut(SimTime) -> Option<SimTime>,
) -> SimTime {
    dial_until_up(
        died + FIRST_BACKOFF,
        FIRST_BACKOFF * 2,
        dial_timeout,
        handshake,
    )
}

/// When a node that starts at `start` is first connected (see [`reconnected_at`]).
pub fn connected_at(
    start: SimTime,
    dial_timeout: SimDuration,
    handshake: impl FnMut(SimTime) -> Option<SimTime>,
) -> SimTime {
    dial_until_up(start, FIRST_BACKOFF, dial_timeout, handshake)
}

fn dial_until_up(
    first_dial: SimTime,
    mut backoff: SimDuration,
    dial_timeout: SimDuration,
    mut handshake: impl FnMut(SimTime) -> Option<SimTime>,
) -> SimTime {
    let mut dial = first_dial;
    while dial < first_dial + GIVE_UP {
        if let Some(up) = handshake(dial) {
            return up;
        }
        dial = dial + dial_timeout + backoff;
        backoff = (backoff * 2).min(MAX_BACKOFF);
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

    /// A handshake of one round trip that gets through from `from` on.
    fn through_from(from: f64) -> impl FnMut(SimTime) -> Option<SimTime> {
        move |dial| (dial >= s(from)).then(|| dial + RTT)
    }

    #[test]
    fn a_lost_connection_redials_after_the_first_wait() {
        assert_eq!(reconnected_at(s(5.0), DIAL, through_from(0.0)), s(5.2));
    }

    #[test]
    fn a_starting_node_dials_at_once() {
        assert_eq!(connected_at(s(0.0), DIAL, through_from(0.0)), s(0.1));
    }

    #[test]
    fn failed_dials_wait_the_idle_timeout_and_a_doubling_backoff() {
        // Dials at 20.1, 30.3 (backoff 0.2), 40.7 (0.4), 51.5 (0.8), 63.1 (1.6), 75.1 (2.0):
        // the first at or after 70 s gets through.
        let back = reconnected_at(s(20.0), DIAL, through_from(70.0));
        assert!((back.as_secs_f64() - 75.2).abs() < 1e-6, "{back:?}");
        // A starting node: 0, 10.1, 20.3, 30.7, 41.5, 53.1, 65.1, 77.1.
        let up = connected_at(s(0.0), DIAL, through_from(70.0));
        assert!((up.as_secs_f64() - 77.2).abs() < 1e-6, "{up:?}");
    }

    #[test]
    fn a_link_that_never_comes_back_gives_up_after_a_day() {
        let back = reconnected_at(s(1.0), DIAL, |_| None);
        assert!(back >= s(86_401.0) && back < s(86_420.0), "{back:?}");
    }
}
