//! The congestion window of a QUIC sender and the queue it keeps at a link's bottleneck.
//!
//! dreamddp's QUIC connections run its own BBR (`transport::bbr`): BBRv1's window over the
//! IETF draft's delivery-rate samples. It lets up to `cwnd = 2 · max_bw · min_rtt` bytes be in
//! flight, `max_bw` being the largest delivery rate measured over the last 10 round trips.
//! (Until 2026-12-05 they ran quinn's BBR, whose per-ACK-frame samples bunched acknowledgements
//! inflate; its windows were 3.4–11× this one and its queues seconds long: docs/fidelity.md.)
//! Two things follow, both measured with `dreamddp link-check` and in `fidelity` runs:
//!
//! * **A standing queue.** What the path cannot hold (`rate · round trip`) waits in the
//!   bottleneck's queue: on a constant link one extra `min_rtt`; on a bursty trace more, since
//!   `max_bw` follows the bursts. With quinn's BBR the relay measured mean waits of 0.1–0.4 s
//!   on a 10 Mbit/s, 30 ms link and 1.8–3.4 s on the ATT LTE uplink trace; with dreamddp's,
//!   loaded both ways, 9–38 ms and 0.2–0.6 s.
//! * **A window-bound sender when acknowledgements are late.** A connection's acknowledgements
//!   travel the other direction of the same access link, behind that direction's queue. With a
//!   round trip far above `min_rtt` the window, not the link, bounds the rate (`cwnd / rtt`): in
//!   `fidelity-smoke`, with quinn's BBR, a device whose uplink held a 2 s queue received 2.7 MB
//!   in 45 s over a downlink that could carry 25 MB.
//!
//! The simulated sender ([`super::MuxLink`]) sends while its bytes in flight (sent, not yet
//! acknowledged) fit [`Bbr::cwnd`], and delays each packet's arrival by the queue that window
//! leaves at the bottleneck: `cwnd − bytes the path holds over (min_rtt + reverse delay)`,
//! served at the link's capacity, never longer than the link has been busy without a pause.
//! `min_rtt` is the smallest round trip the real connection measures (`2 · latency`, the
//! jitter, two packets' serialization: [`Bbr::new`]) and the window carries BBR's
//! ack-aggregation allowance on top (the larger of `max_bw` times the jitter, since
//! acknowledgements that wait out the jitter ahead of them arrive bunched, and one receive
//! batch of 32 datagrams, which quinn acknowledges at once; at most 100 ms of `max_bw`, as
//! `transport::bbr` caps it); the reverse delay is the other
//! direction's current queue, which the owner of both directions sets
//! ([`super::MuxLink::set_reverse_delay`]); after it an acknowledgement still needs the other
//! direction's next delivery opportunity when that direction is a trace
//! ([`super::MuxLink::carry_acks_on`]; the ATT LTE uplink trace has a mean wait of 140 ms for
//! one and stalls of up to 4 s).
//!
//! A connection begins in STARTUP ([`Startup`]): quinn's 240 kB initial window, which
//! `transport::bbr` never shrinks until the estimate has stopped growing for three rounds, so
//! on a 1.3 Mbit/s uplink it stands as a 1.4 s queue for the first ~6 s (`link-check
//! fidelity-fcc --nodes edge-0` with `RUST_LOG=transport=debug`: STARTUP over after 7 rounds,
//! 6.1 s; the model's 4 rounds take 5.8 s), and every new connection (`MuxLink::pause_until`)
//! begins it again.
//!
//! Approximations: STARTUP's rounds are counted while the sender has something to send, each
//! a round trip through the queue its window keeps at the mean rate, and its window only
//! doubles (the real one grows by what each acknowledgement brings); the allowance is a
//! calibration from two sources of bunching (real windows measured 32–39 KB above twice the
//! BDP on two links, one receive batch, and at the 100 ms cap on a third), where the real one
//! measures how far acknowledgements ran ahead of `max_bw`; `max_bw` is the link's capacity
//! over `min_rtt` slots, where the real estimator measures delivery rates over intervals of
//! at least `min_rtt`, keeps them for 10 round trips (longer than 10 `min_rtt` when queues
//! build), and lets them fall when the sender is window-bound behind a long reverse queue; the
//! window is recomputed per `min_rtt` slot, a packet's queue wait at the end of its
//! serialization.

use super::Capacity;
use crate::time::{SimDuration, SimTime, NANOS_PER_SEC};
use crate::trace::TraceCursor;

/// Round trips over which the bandwidth estimate keeps its maximum (BBR's filter length).
const BANDWIDTH_FILTER_ROUNDS: u64 = 10;
/// BBR's window gain in steady state.
const CWND_GAIN: u64 = 2;
/// Bytes of an acknowledgement on the way back.
const ACK_BYTES: u64 = 64;
/// Smallest window, in packets (quinn's minimum window).
const MIN_CWND_PACKETS: u64 = 4;
/// The most ack aggregation the window allows for, as a time at `max_bw` (`transport::bbr`
/// caps the draft's `extra_acked` at 100 ms, as Linux does).
const EXTRA_ACKED_MAX: SimDuration = SimDuration(100_000_000);
/// Datagrams a receiving quinn endpoint takes from its socket per read (quinn-udp's
/// `BATCH_SIZE` on Linux, one `recvmmsg`); the connection acknowledges them with one ACK.
const RECEIVE_BATCH_DATAGRAMS: u64 = 32;
/// A connection's first window (`transport::bbr`: quinn's 200 packets of 1,200 bytes).
const INITIAL_WINDOW: u64 = 200 * 1200;
/// STARTUP's window gain, thousandths (2/ln 2).
const STARTUP_GAIN_MILLI: u64 = 2885;
/// STARTUP ends after this many rounds in which the estimate did not grow.
const STARTUP_PLATEAU_ROUNDS: u32 = 3;

/// A connection's STARTUP (`transport::bbr`): the window starts at [`INITIAL_WINDOW`], doubles
/// each round while it is below what the path holds, never shrinks, and STARTUP ends
/// [`STARTUP_PLATEAU_ROUNDS`] rounds after the window first held the path (the estimate
/// stops growing then). A round is a round trip through the queue that window keeps.
#[derive(Clone, Copy, Debug)]
struct Startup {
    /// The window, bytes.
    window: u64,
    /// Rounds since the window first held the path, after the first estimate.
    plateau: u32,
    /// Whether a round has ended (the estimate exists).
    first_estimate: bool,
    /// When the current round ends (`None`: none begun; a round begins when the sender next
    /// has something to send).
    round_ends: Option<SimTime>,
}

impl Startup {
    fn begin() -> Startup {
        Startup {
            window: INITIAL_WINDOW,
            plateau: 0,
            first_estimate: false,
            round_ends: None,
        }
    }
}

/// One direction's BBR window and standing queue.
#[derive(Clone, Debug)]
pub(super) struct Bbr {
    min_rtt: SimDuration,
    jitter: SimDuration,
    mtu: u64,
    /// Delay the acknowledgements see on the other direction (its queue), set by the owner.
    reverse_delay: SimDuration,
    /// The capacity of the direction that carries the acknowledgements back.
    reverse_capacity: Option<Capacity>,
    /// Start of the current busy period (packets back to back since then).
    busy_since: SimTime,
    /// End of the last packet's serialization.
    last_end: SimTime,
    /// The steady-state window for one `min_rtt` slot: (slot, window, the most the link
    /// delivered in one `min_rtt` over the filter's slots).
    cached_window: Option<(u64, u64, u64)>,
    /// The connection's STARTUP, until it ends.
    startup: Option<Startup>,
    /// The standing queue the last packet was delayed by (before the busy-period cap).
    last_full_wait: SimDuration,
    /// Summed delay added to packets, and the packets.
    total_wait: SimDuration,
    packets: u64,
}

impl Bbr {
    /// The window of a sender on a link of `latency`, `jitter` and `capacity`, whose smallest
    /// round trip is what the real connection measures: `2 · latency`, plus the jitter (the relay
    /// keeps deliveries in order, so a packet waits out the jitter of those ahead of it), plus two
    /// packets' serialization at the link's mean rate (the packet itself, and the one the
    /// receiver waits for before it acknowledges a pair). On the links `link-check` measured
    /// (10 Mbit/s 15 ms jitter 5, Norway 3G 60 ms jitter 20, FCC 20 ms jitter 5), quinn's
    /// `min_rtt` was 36.8–38.0, 143–150 and 58–63 ms; this gives 37, 146 and 54 ms.
    pub(super) fn new(
        latency: SimDuration,
        jitter: SimDuration,
        mtu: u64,
        capacity: &Capacity,
    ) -> Bbr {
        let serialization = capacity.mean_serialization(2 * mtu);
        let min_rtt = if latency.as_nanos() == 0 {
            SimDuration::ZERO
        } else {
            latency * 2 + jitter + serialization.min(latency * 2)
        };
        Bbr {
            min_rtt,
            jitter,
            mtu,
            reverse_delay: SimDuration::ZERO,
            reverse_capacity: None,
            busy_since: SimTime::ZERO,
            last_end: SimTime::ZERO,
            cached_window: None,
            startup: Some(Startup::begin()),
            last_full_wait: SimDuration::ZERO,
            total_wait: SimDuration::ZERO,
            packets: 0,
        }
    }

    /// Ends STARTUP now (tests of the steady state).
    #[cfg(test)]
    pub(super) fn end_startup(&mut self) {
        self.startup = None;
    }

    /// A new connection is up: its controller begins in STARTUP again.
    pub(super) fn restart(&mut self) {
        self.startup = Some(Startup::begin());
    }

    pub(super) fn set_reverse_delay(&mut self, delay: SimDuration) {
        self.reverse_delay = delay;
    }

    pub(super) fn reverse_delay(&self) -> SimDuration {
        self.reverse_delay
    }

    pub(super) fn set_reverse_capacity(&mut self, capacity: Capacity) {
        self.reverse_capacity = Some(capacity);
    }

    /// When an acknowledgement ready to go back at `at` leaves the reverse direction: on a
    /// trace, at its next delivery opportunity (any datagram needs one in the relay).
    pub(super) fn ack_departure(&self, at: SimTime) -> SimTime {
        match &self.reverse_capacity {
            Some(Capacity::Trace(trace)) => trace
                .transmit(&mut TraceCursor::default(), at, ACK_BYTES)
                .unwrap_or(at),
            _ => at,
        }
    }

    /// Mean delay added per packet so far.
    pub(super) fn mean_wait(&self) -> SimDuration {
        SimDuration(self.total_wait.as_nanos() / self.packets.max(1))
    }

    /// The queue a packet sent now would wait behind: the last estimate while the link is
    /// still busy at `now`, else none.
    pub(super) fn current_wait(&self, now: SimTime) -> SimDuration {
        if self.last_end >= now {
            self.wait_at_last_end()
        } else {
            SimDuration::ZERO
        }
    }

    /// The queue that stood behind the last packet sent.
    fn wait_at_last_end(&self) -> SimDuration {
        self.last_full_wait
            .min(self.last_end.saturating_since(self.busy_since))
    }

    /// The window at `t`, bytes (`u64::MAX` on a link without latency: no window bound).
    pub(super) fn cwnd(&mut self, capacity: &Capacity, t: SimTime) -> u64 {
        if self.min_rtt.as_nanos() == 0 {
            return u64::MAX;
        }
        self.window(capacity, t)
    }

    /// The queueing delay of a packet serialized from `start` to `end` on `capacity`, whose
    /// trace `cursor` stands just after it.
    pub(super) fn wait(
        &mut self,
        capacity: &Capacity,
        cursor: &TraceCursor,
        start: SimTime,
        end: SimTime,
    ) -> SimDuration {
        // A pause drains the queue that stood behind the last packet by its length, no more (a
        // window-bound sender pauses for each ACK frame, a few packets' time): the queue left
        // is as if the link had been busy for that long.
        if start > self.last_end {
            let stood = self.wait_at_last_end();
            let gap = start.saturating_since(self.last_end);
            let left = SimDuration(stood.as_nanos().saturating_sub(gap.as_nanos()));
            self.busy_since = SimTime::from_nanos(start.as_nanos() - left.as_nanos());
        }
        self.last_end = end;
        if self.min_rtt.as_nanos() == 0 {
            return SimDuration::ZERO;
        }
        let full = self.queue_wait(capacity, cursor, end);
        self.last_full_wait = full;
        let wait = full.min(end.saturating_since(self.busy_since));
        self.total_wait = self.total_wait + wait;
        self.packets += 1;
        wait
    }

    /// The window at `t`: STARTUP's while the connection is in it, else the steady one.
    fn window(&mut self, capacity: &Capacity, t: SimTime) -> u64 {
        let (steady, path_bytes) = self.steady_window(capacity, t);
        let Some(mut s) = self.startup else {
            return steady;
        };
        let round_trip = |window: u64| {
            self.min_rtt
                + self.reverse_delay
                + capacity.mean_serialization(window.saturating_sub(path_bytes))
        };
        match s.round_ends {
            // The first round begins: the first estimate comes at its end.
            None => s.round_ends = Some(t + round_trip(s.window)),
            Some(end) if t >= end => {
                // A round ended: the window doubles while the path holds more than it, up to
                // STARTUP's target (it never shrinks); once it holds the path the estimate
                // stops growing, and STARTUP ends after the plateau's rounds.
                if s.window >= path_bytes && s.first_estimate {
                    s.plateau += 1;
                } else if s.window < path_bytes {
                    let target = path_bytes.saturating_mul(STARTUP_GAIN_MILLI) / 1000;
                    s.window = s.window.max(s.window.saturating_mul(2).min(target));
                }
                s.first_estimate = true;
                if s.plateau >= STARTUP_PLATEAU_ROUNDS {
                    self.startup = None;
                    return steady;
                }
                s.round_ends = Some(t + round_trip(s.window));
            }
            Some(_) => {}
        }
        self.startup = Some(s);
        s.window
    }

    /// The steady window for the `min_rtt` slot holding `t`: `CWND_GAIN` times the most the
    /// link delivered in one `min_rtt` over the last `BANDWIDTH_FILTER_ROUNDS` slots (plus the
    /// jitter's allowance), and that most.
    fn steady_window(&mut self, capacity: &Capacity, t: SimTime) -> (u64, u64) {
        let m = self.min_rtt.as_nanos();
        let slot = t.as_nanos() / m;
        if let Some((s, cwnd, max_bytes)) = self.cached_window {
            if s == slot {
                return (cwnd, max_bytes);
            }
        }
        let max_bytes = match capacity {
            Capacity::Constant { bits_per_sec } => bytes_in(*bits_per_sec, self.min_rtt),
            Capacity::Trace(trace) => {
                let first = slot.saturating_sub(BANDWIDTH_FILTER_ROUNDS - 1);
                (first..=slot)
                    .map(|k| {
                        let from = SimTime::from_nanos(k.saturating_mul(m));
                        trace.bytes_deliverable(from, from + self.min_rtt)
                    })
                    .max()
                    .unwrap_or(0)
            }
        };
        // Ack aggregation (the draft's `extra_acked`, capped at `EXTRA_ACKED_MAX` of `max_bw`):
        // acknowledgements arrive bunched, and BBR lets that much more be in flight. Two
        // bunchings are modelled, the larger counts: the jitter (acknowledgements held back by
        // it arrive together behind the one that drew the most) and the receiver's reads
        // (quinn takes up to `RECEIVE_BATCH_DATAGRAMS` datagrams per read and acknowledges
        // them in one ACK). `link-check` measured real windows 32–39 KB above twice the
        // estimated BDP on the 10 Mbit/s link and the Norway 3G trace (one read's worth) and
        // 18–22 KB on the FCC trace (the cap there: 100 ms of 151–256 KB/s).
        let at_max_bw = |d: SimDuration| {
            u64::try_from(u128::from(max_bytes) * u128::from(d.as_nanos()) / u128::from(m))
                .unwrap_or(u64::MAX)
        };
        let extra = at_max_bw(self.jitter)
            .max(RECEIVE_BATCH_DATAGRAMS * self.mtu)
            .min(at_max_bw(EXTRA_ACKED_MAX));
        let cwnd = CWND_GAIN
            .saturating_mul(max_bytes)
            .saturating_add(extra)
            .max(MIN_CWND_PACKETS * self.mtu);
        self.cached_window = Some((slot, cwnd, max_bytes));
        (cwnd, max_bytes)
    }

    /// The queue a packet whose serialization ends at `t` waits behind: what the window
    /// holds beyond what the path carries over a round trip (`min_rtt` plus the reverse
    /// delay), served at the link's capacity from `t`.
    fn queue_wait(&mut self, capacity: &Capacity, cursor: &TraceCursor, t: SimTime) -> SimDuration {
        let cwnd = self.window(capacity, t);
        let round_trip = self.min_rtt + self.reverse_delay;
        match capacity {
            Capacity::Constant { bits_per_sec } => {
                let queue = cwnd.saturating_sub(bytes_in(*bits_per_sec, round_trip));
                let nanos =
                    u128::from(queue) * 8 * u128::from(NANOS_PER_SEC) / u128::from(*bits_per_sec);
                SimDuration(u64::try_from(nanos).unwrap_or(u64::MAX))
            }
            Capacity::Trace(trace) => {
                let queue = cwnd.saturating_sub(trace.bytes_deliverable(t, t + round_trip));
                if queue == 0 {
                    return SimDuration::ZERO;
                }
                let mut ahead = *cursor;
                trace
                    .transmit(&mut ahead, t, queue)
                    .map_or(SimDuration::ZERO, |served| served.saturating_since(t))
            }
        }
    }
}

/// Bytes a constant link of `bits_per_sec` carries in `d`.
fn bytes_in(bits_per_sec: u64, d: SimDuration) -> u64 {
    u64::try_from(
        u128::from(bits_per_sec) * u128::from(d.as_nanos()) / (8 * u128::from(NANOS_PER_SEC)),
    )
    .unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A constant link of `bits_per_sec` with `latency_ms` and `jitter_ms`, and its sender's
    /// window (1,200-byte packets).
    fn constant(bits_per_sec: u64, latency_ms: u64, jitter_ms: u64) -> (Capacity, Bbr) {
        let capacity = Capacity::Constant { bits_per_sec };
        let bbr = Bbr::new(
            SimDuration::from_millis(latency_ms),
            SimDuration::from_millis(jitter_ms),
            1200,
            &capacity,
        );
        (capacity, bbr)
    }

    /// Asks for the window every millisecond until STARTUP is over; returns when it ended.
    fn past_startup(bbr: &mut Bbr, capacity: &Capacity) -> SimTime {
        let mut t = SimTime::ZERO;
        while bbr.startup.is_some() {
            bbr.cwnd(capacity, t);
            t += SimDuration::from_millis(1);
            assert!(t < SimTime::from_secs(60), "STARTUP never ended");
        }
        t
    }

    #[test]
    fn a_connection_starts_with_quinns_window_and_keeps_it_through_startup() {
        // `fidelity-fcc`'s uplink rate, 1.3 Mbit/s, 20 ms: the path holds 9 kB, the initial
        // window is a 1.45 s queue, so each STARTUP round lasts about that long.
        let (capacity, mut bbr) = constant(1_320_000, 20, 5);
        assert_eq!(bbr.cwnd(&capacity, SimTime::ZERO), INITIAL_WINDOW);
        let ended = past_startup(&mut bbr, &capacity);
        // Three rounds on a plateau after the first: 4 × (1.4 s of queue + 0.06 s).
        assert!(
            (5.0..7.0).contains(&ended.as_secs_f64()),
            "STARTUP ended at {ended:?}"
        );
        // Twice the 9 kB the path holds plus 100 ms of the rate (the allowance's cap).
        let steady = bbr.cwnd(&capacity, ended);
        assert!(steady < 40_000, "{steady}");
        // A new connection starts over.
        bbr.restart();
        assert_eq!(
            bbr.cwnd(&capacity, ended + SimDuration::from_secs(1)),
            INITIAL_WINDOW
        );
    }

    #[test]
    fn startup_doubles_the_window_up_to_a_fast_paths_size() {
        // 1 Gbit/s, 5 ms: the path holds about 1.4 MB, six times the initial window.
        let (capacity, mut bbr) = constant(1_000_000_000, 5, 0);
        let first = bbr.cwnd(&capacity, SimTime::ZERO);
        let second = bbr.cwnd(&capacity, SimTime::from_millis(12));
        assert_eq!((first, second), (INITIAL_WINDOW, 2 * INITIAL_WINDOW));
        let ended = past_startup(&mut bbr, &capacity);
        assert!(ended < SimTime::from_millis(200), "{ended:?}");
    }

    /// The steady window on `capacity` once STARTUP is over.
    fn steady(capacity: &Capacity, bbr: &mut Bbr) -> u64 {
        let after = past_startup(bbr, capacity);
        bbr.cwnd(capacity, after + SimDuration::from_secs(1))
    }

    #[test]
    fn the_window_is_twice_the_measured_bdp_plus_one_receive_batch() {
        // 10 Mbit/s, 15 ms, jitter 5 ms: quinn measured min_rtt 36.8–38.0 ms on this link.
        let (capacity, mut bbr) = constant(10_000_000, 15, 5);
        // 30 + 5 + 2 · 1200 B at 10 Mbit/s (0.96 ms each).
        assert_eq!(bbr.min_rtt, SimDuration::from_micros(36_920));
        let bdp = bytes_in(10_000_000, bbr.min_rtt);
        // The allowance: one read of 32 datagrams (the jitter's 5 ms hold 6 KB).
        let cwnd = steady(&capacity, &mut bbr);
        assert_eq!(cwnd, 2 * bdp + 32 * 1200);
        // Measured: 123–142 KB with an estimate of 1.23–1.40 MB/s.
        assert!((123_000..142_000).contains(&cwnd), "{cwnd}");
        // The reverse queue does not change it.
        bbr.set_reverse_delay(SimDuration::from_millis(25));
        assert_eq!(bbr.cwnd(&capacity, SimTime::from_secs(30)), cwnd);
    }

    #[test]
    fn the_allowance_is_at_most_100_ms_of_the_estimate_and_at_least_the_jitters() {
        // `fidelity-fcc`'s uplink rate, 1.3 Mbit/s: 100 ms of it (16.5 KB) is less than a read.
        let (capacity, mut bbr) = constant(1_320_000, 20, 5);
        let bdp = bytes_in(1_320_000, bbr.min_rtt);
        let cap = bytes_in(1_320_000, SimDuration::from_millis(100));
        assert!(cap < 32 * 1200);
        let cwnd = steady(&capacity, &mut bbr);
        assert!(cwnd.abs_diff(2 * bdp + cap) <= 2, "{cwnd}");
        // 100 Mbit/s with 20 ms of jitter: the jitter's bunching (250 KB) is the larger.
        let (capacity, mut bbr) = constant(100_000_000, 10, 20);
        let bdp = bytes_in(100_000_000, bbr.min_rtt);
        let jitter = bytes_in(100_000_000, SimDuration::from_millis(20));
        let cwnd = steady(&capacity, &mut bbr);
        assert!(cwnd.abs_diff(2 * bdp + jitter) <= 1, "{cwnd}");
    }

    #[test]
    fn a_link_without_latency_has_no_window_bound() {
        let (capacity, mut bbr) = constant(1_000_000, 0, 5);
        assert_eq!(bbr.cwnd(&capacity, SimTime::from_secs(1)), u64::MAX);
    }
}
