//! dreamddp's BBR congestion controller: BBRv1's window with the delivery-rate estimator of
//! the IETF BBR draft (draft-ietf-ccwg-bbr §4.1.1 "Delivery rate samples").
//!
//! quinn ships a BBR (`quinn::congestion::BbrConfig`, marked experimental) whose bandwidth
//! sample is one acknowledged packet's bytes over the time since the previous acknowledgement
//! was processed (quinn-proto 0.11 `bbr/bw_estimation.rs`). When acknowledgements arrive
//! bunched, as they do when they share the other direction of a device's access link with that
//! direction's data, that interval is microseconds and the sample many times the link's rate; the
//! estimate keeps the largest sample for ten round trips and the window (`2 · estimate ·
//! min_rtt`) grows with it. `dreamddp link-check --both-ways` measured the consequence
//! (docs/fidelity.md "Both directions at once"): one direction's window grew to 0.2–2.3 MB and
//! held a 1–2.4 s queue, the other direction's acknowledgements waited behind that queue, and
//! it carried 9–45 % of what the winner did. Which direction won changed from run to run.
//!
//! This controller measures bandwidth as the draft does: for each acknowledged packet, the bytes
//! delivered between its sending and its acknowledgement over the longer of the send and the
//! acknowledgement intervals, and never over an interval shorter than `min_rtt`, so bunched
//! acknowledgements cannot inflate it. The rest is BBRv1 as quinn's pacer uses it (quinn paces
//! at `window / smoothed_rtt`, so only the window matters): STARTUP grows the window by the
//! bytes acknowledged until the estimate stops growing by 25 % for three rounds; afterwards the
//! window moves towards `2 · max_bw · min_rtt + extra_acked`, `max_bw` being the largest sample
//! of the last ten rounds and `extra_acked` the draft's ack-aggregation allowance (how far
//! acknowledgements ran ahead of `max_bw`, the largest of ten rounds, capped at 100 ms of
//! `max_bw` as Linux caps it): on a cellular trace that delivers in bursts after stalls it
//! keeps enough in flight to use the burst. Loss does not shrink the window (random loss on an
//! edge link is not congestion). No ProbeRTT (`min_rtt` is the connection's smallest RTT; a
//! link's base delay does not change). `simulations`' link model assumes this window without
//! the allowance (`simulations/src/link/queue.rs`).
//!
//! [`Estimator`] is the sans-IO state machine (it takes `now`); [`DeliveryBbr`] adapts it to
//! quinn's `Controller`.

use std::any::Any;
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use quinn::congestion::{Controller, ControllerFactory};

/// Rounds over which the bandwidth estimate keeps its maximum.
const BANDWIDTH_FILTER_ROUNDS: usize = 10;
/// Window gain after STARTUP.
const CWND_GAIN: f64 = 2.0;
/// Window gain during STARTUP (2/ln 2).
const STARTUP_GAIN: f64 = 2.885;
/// STARTUP ends when the estimate grew by less than this factor ...
const STARTUP_GROWTH: f64 = 1.25;
/// ... for this many rounds in a row.
const STARTUP_ROUNDS_WITHOUT_GROWTH: u32 = 3;
/// Ack aggregation counts for at most this long at the estimated bandwidth ...
const EXTRA_ACKED_MAX: Duration = Duration::from_millis(100);
/// ... and is remembered for this many rounds (the draft's `BBRExtraAckedFilterLen`).
const EXTRA_ACKED_FILTER_ROUNDS: u64 = 10;
/// quinn's initial window: 200 packets of 1,200 bytes at most (`BbrConfig`'s default).
const INITIAL_WINDOW_PACKETS: u64 = 200;
/// quinn's base datagram size.
const BASE_DATAGRAM_SIZE: u64 = 1200;
/// Sent-packet records kept for delivery-rate samples, at most (a few round trips' worth on
/// the fastest link; older records belong to packets that were lost).
const MAX_SEND_RECORDS: usize = 1 << 16;

/// The largest value seen in each of the last `rounds` round trips.
#[derive(Clone, Debug, Default)]
struct RoundMax {
    /// (round, largest value in it), oldest first.
    per_round: VecDeque<(u64, u64)>,
}

impl RoundMax {
    fn get(&self) -> u64 {
        self.per_round.iter().map(|&(_, v)| v).max().unwrap_or(0)
    }

    fn update(&mut self, round: u64, value: u64, rounds: u64) {
        match self.per_round.back_mut() {
            Some((r, max)) if *r == round => *max = (*max).max(value),
            _ => self.per_round.push_back((round, value)),
        }
        while self
            .per_round
            .front()
            .is_some_and(|&(r, _)| r + rounds <= round)
        {
            self.per_round.pop_front();
        }
    }
}

/// What the connection knew when a packet (or a burst of packets sent at one instant) left.
#[derive(Clone, Copy, Debug)]
struct SendRecord {
    sent: Instant,
    /// Bytes delivered (acknowledged) by then.
    delivered: u64,
    /// When the last of those was acknowledged.
    delivered_time: Instant,
    /// When the packet acknowledged last by then had been sent.
    first_sent_time: Instant,
}

/// One delivery-rate sample.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Sample {
    /// Bytes per second.
    rate: u64,
    /// `delivered` when its packet was sent (which round it belongs to).
    prior_delivered: u64,
}

/// BBR's model of the path, fed with sends and acknowledgements (sans-IO).
#[derive(Clone, Debug)]
pub struct Estimator {
    mtu: u64,
    cwnd: u64,
    delivered: u64,
    delivered_time: Option<Instant>,
    first_sent_time: Option<Instant>,
    records: VecDeque<SendRecord>,
    /// The newest sample of the acknowledgements being processed.
    batch_sample: Option<Sample>,
    batch_acked: u64,
    /// Largest `delivered` at sending among the packets being acknowledged.
    batch_prior_delivered: Option<u64>,
    /// Largest delivery rate of each of the last rounds.
    max_bw: RoundMax,
    /// Largest ack aggregation (bytes acknowledged beyond `max_bw`'s pace) of the last rounds.
    max_extra_acked: RoundMax,
    /// Start of the current aggregation epoch, and the bytes acknowledged since.
    extra_acked_start: Option<Instant>,
    extra_acked_delivered: u64,
    round: u64,
    next_round_delivered: u64,
    min_rtt: Option<Duration>,
    filled_pipe: bool,
    full_bw: u64,
    full_bw_rounds: u32,
}

impl Estimator {
    /// A connection whose datagrams are `mtu` bytes, that has sent nothing yet.
    pub fn new(mtu: u64) -> Estimator {
        Estimator {
            mtu,
            cwnd: INITIAL_WINDOW_PACKETS * BASE_DATAGRAM_SIZE,
            delivered: 0,
            delivered_time: None,
            first_sent_time: None,
            records: VecDeque::new(),
            batch_sample: None,
            batch_acked: 0,
            batch_prior_delivered: None,
            max_bw: RoundMax::default(),
            max_extra_acked: RoundMax::default(),
            extra_acked_start: None,
            extra_acked_delivered: 0,
            round: 0,
            next_round_delivered: 0,
            min_rtt: None,
            filled_pipe: false,
            full_bw: 0,
            full_bw_rounds: 0,
        }
    }

    /// The window, bytes.
    pub fn window(&self) -> u64 {
        self.cwnd.max(self.min_window())
    }

    /// The bandwidth estimate, bytes per second (0 before the first sample).
    pub fn bandwidth(&self) -> u64 {
        self.max_bw.get()
    }

    /// Whether STARTUP is over.
    pub fn filled_pipe(&self) -> bool {
        self.filled_pipe
    }

    fn min_window(&self) -> u64 {
        4 * self.mtu
    }

    /// A packet left at `now`; `in_flight_before` bytes were unacknowledged just before it.
    pub fn on_sent(&mut self, now: Instant, in_flight_before: u64) {
        if in_flight_before == 0 || self.delivered_time.is_none() {
            // The start of a flight: intervals are measured from here.
            self.first_sent_time = Some(now);
            self.delivered_time = Some(now);
        }
        if self.records.back().is_some_and(|r| r.sent == now) {
            return;
        }
        if self.records.len() == MAX_SEND_RECORDS {
            self.records.pop_front();
        }
        self.records.push_back(SendRecord {
            sent: now,
            delivered: self.delivered,
            delivered_time: self.delivered_time.unwrap_or(now),
            first_sent_time: self.first_sent_time.unwrap_or(now),
        });
    }

    /// A packet of `bytes` sent at `sent` was acknowledged at `now`; `min_rtt` is the
    /// connection's smallest RTT so far.
    pub fn on_ack(&mut self, now: Instant, sent: Instant, bytes: u64, min_rtt: Duration) {
        self.min_rtt = Some(min_rtt);
        self.delivered += bytes;
        self.delivered_time = Some(now);
        self.batch_acked += bytes;
        // Records of packets sent before this one that are still here were lost (or are
        // acknowledged out of order, which only costs their sample).
        while self.records.len() > 1 && self.records[1].sent <= sent {
            self.records.pop_front();
        }
        let Some(record) = self.records.front().copied().filter(|r| r.sent <= sent) else {
            return;
        };
        self.first_sent_time = Some(sent);
        self.batch_prior_delivered = Some(
            self.batch_prior_delivered
                .map_or(record.delivered, |d| d.max(record.delivered)),
        );
        let send_elapsed = sent.saturating_duration_since(record.first_sent_time);
        let ack_elapsed = now.saturating_duration_since(record.delivered_time);
        let interval = send_elapsed.max(ack_elapsed);
        if interval < min_rtt || interval.is_zero() {
            return;
        }
        let bytes_delivered = self.delivered - record.delivered;
        let rate =
            u64::try_from(u128::from(bytes_delivered) * 1_000_000_000 / interval.as_nanos().max(1))
                .unwrap_or(u64::MAX);
        let sample = Sample {
            rate,
            prior_delivered: record.delivered,
        };
        if self
            .batch_sample
            .is_none_or(|b| sample.prior_delivered >= b.prior_delivered)
        {
            self.batch_sample = Some(sample);
        }
    }

    /// The acknowledgements of one ACK frame are processed; `app_limited`: the sender had
    /// nothing more to send before them (its samples only count where they raise the estimate).
    pub fn on_end_acks(&mut self, now: Instant, app_limited: bool) {
        let acked = std::mem::take(&mut self.batch_acked);
        let sample = self.batch_sample.take();
        let mut round_start = false;
        if let Some(prior) = self.batch_prior_delivered.take() {
            if prior >= self.next_round_delivered {
                self.next_round_delivered = self.delivered;
                self.round += 1;
                round_start = true;
            }
        }
        if let Some(s) = sample {
            if !app_limited || s.rate >= self.bandwidth() {
                self.record_rate(s.rate);
            }
        }
        if round_start && !self.filled_pipe && !app_limited {
            self.check_full_pipe();
        }
        if acked > 0 {
            self.update_ack_aggregation(now, acked);
        }
        self.update_window(acked);
    }

    fn record_rate(&mut self, rate: u64) {
        self.max_bw
            .update(self.round, rate, BANDWIDTH_FILTER_ROUNDS as u64);
    }

    /// The draft's `BBRUpdateACKAggregation`: how far acknowledgements ran ahead of the
    /// bandwidth estimate since the current epoch began, kept as a windowed maximum and capped
    /// at `EXTRA_ACKED_MAX` of the estimate (Linux's `bbr_extra_acked_max_us`) and at the window.
    fn update_ack_aggregation(&mut self, now: Instant, acked: u64) {
        let bw = self.bandwidth();
        let start = *self.extra_acked_start.get_or_insert(now);
        let expected = (bw as f64 * now.saturating_duration_since(start).as_secs_f64()) as u64;
        let (delivered, expected) = if self.extra_acked_delivered <= expected {
            self.extra_acked_start = Some(now);
            (acked, 0)
        } else {
            (self.extra_acked_delivered + acked, expected)
        };
        self.extra_acked_delivered = delivered;
        let cap = (bw as f64 * EXTRA_ACKED_MAX.as_secs_f64()) as u64;
        let extra = (delivered - expected).min(self.cwnd).min(cap);
        self.max_extra_acked
            .update(self.round, extra, EXTRA_ACKED_FILTER_ROUNDS);
    }

    fn check_full_pipe(&mut self) {
        let bw = self.bandwidth();
        if bw as f64 >= self.full_bw as f64 * STARTUP_GROWTH {
            self.full_bw = bw;
            self.full_bw_rounds = 0;
            return;
        }
        self.full_bw_rounds += 1;
        if self.full_bw_rounds >= STARTUP_ROUNDS_WITHOUT_GROWTH {
            self.filled_pipe = true;
            tracing::debug!(bandwidth = bw, round = self.round, "[BBR] startup over");
        }
    }

    /// `gain · max_bw · min_rtt`, or `None` before the first sample.
    fn target(&self, gain: f64) -> Option<u64> {
        let bw = self.bandwidth();
        let min_rtt = self.min_rtt?;
        if bw == 0 {
            return None;
        }
        Some((gain * bw as f64 * min_rtt.as_secs_f64()) as u64)
    }

    fn update_window(&mut self, acked: u64) {
        if self.filled_pipe {
            if let Some(target) = self.target(CWND_GAIN) {
                let target = target + self.max_extra_acked.get();
                self.cwnd = (self.cwnd + acked).min(target);
            }
        } else {
            // STARTUP never shrinks the window; it grows by what was acknowledged while
            // below its target (or before any estimate).
            match self.target(STARTUP_GAIN) {
                Some(target) if self.cwnd >= target => {}
                _ => self.cwnd += acked,
            }
        }
        self.cwnd = self.cwnd.max(self.min_window());
    }

    /// The path's datagram size changed.
    pub fn set_mtu(&mut self, mtu: u64) {
        self.mtu = mtu;
    }
}

/// [`Estimator`] as a quinn congestion controller.
#[derive(Clone, Debug)]
pub struct DeliveryBbr {
    estimator: Estimator,
    /// Bytes in flight as of the last acknowledgement batch, plus what was sent since.
    in_flight: u64,
    last_logged_round: u64,
}

impl Controller for DeliveryBbr {
    fn on_sent(&mut self, now: Instant, _bytes: u64, _last_packet_number: u64) {
        // quinn passes the length of the whole GSO buffer so far, not the packet's: only
        // "something was in flight" is used here.
        self.estimator.on_sent(now, self.in_flight);
        self.in_flight = self.in_flight.max(1);
    }

    fn on_ack(
        &mut self,
        now: Instant,
        sent: Instant,
        bytes: u64,
        _app_limited: bool,
        rtt: &quinn_proto::RttEstimator,
    ) {
        self.estimator.on_ack(now, sent, bytes, rtt.min());
    }

    fn on_end_acks(
        &mut self,
        now: Instant,
        in_flight: u64,
        app_limited: bool,
        _largest_packet_num_acked: Option<u64>,
    ) {
        self.in_flight = in_flight;
        self.estimator.on_end_acks(now, app_limited);
        let round = self.estimator.round;
        if round.is_multiple_of(64) && round != self.last_logged_round {
            self.last_logged_round = round;
            tracing::debug!(
                round,
                bandwidth = self.estimator.bandwidth(),
                window = self.estimator.window(),
                filled_pipe = self.estimator.filled_pipe,
                min_rtt_ms = self.estimator.min_rtt.unwrap_or_default().as_secs_f64() * 1e3,
                app_limited,
                "[BBR] state"
            );
        }
    }

    fn on_congestion_event(
        &mut self,
        _now: Instant,
        _sent: Instant,
        _is_persistent_congestion: bool,
        _lost_bytes: u64,
    ) {
    }

    fn on_mtu_update(&mut self, new_mtu: u16) {
        self.estimator.set_mtu(u64::from(new_mtu));
    }

    fn window(&self) -> u64 {
        self.estimator.window()
    }

    fn clone_box(&self) -> Box<dyn Controller> {
        Box::new(self.clone())
    }

    fn initial_window(&self) -> u64 {
        INITIAL_WINDOW_PACKETS * BASE_DATAGRAM_SIZE
    }

    fn into_any(self: Box<Self>) -> Box<dyn Any> {
        self
    }
}

/// Builds a [`DeliveryBbr`] per connection (`TransportConfig::congestion = "bbr"`).
#[derive(Clone, Copy, Debug, Default)]
pub struct DeliveryBbrConfig;

impl ControllerFactory for DeliveryBbrConfig {
    fn build(self: Arc<Self>, _now: Instant, current_mtu: u16) -> Box<dyn Controller> {
        Box::new(DeliveryBbr {
            estimator: Estimator::new(u64::from(current_mtu)),
            in_flight: 0,
            last_logged_round: 0,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MTU: u64 = 1200;

    /// A sender that keeps `window` bytes in flight over a path of `rate` bytes/s and
    /// `base_rtt`, whose acknowledgements come back `ack_delay(k)` late for packet `k`.
    /// Returns the estimator after `packets` packets.
    fn drive(
        packets: u64,
        rate: u64,
        base_rtt: Duration,
        ack_delay: impl Fn(u64) -> Duration,
    ) -> Estimator {
        let mut e = Estimator::new(MTU);
        let start = Instant::now();
        let per_packet = Duration::from_nanos(MTU * 1_000_000_000 / rate);
        // (ack time, sent time) of packets in flight.
        let mut flight: VecDeque<(Instant, Instant)> = VecDeque::new();
        let mut link_free = start;
        let mut now = start;
        for k in 0..packets {
            // Wait for room in the window, processing acknowledgements as they come.
            loop {
                while flight.front().is_some_and(|&(ack, _)| ack <= now) {
                    let (ack, sent) = flight.pop_front().expect("checked");
                    e.on_ack(ack, sent, MTU, base_rtt);
                    e.on_end_acks(ack, false);
                }
                if (flight.len() as u64 + 1) * MTU <= e.window() {
                    break;
                }
                now = flight.front().expect("a full window has packets").0;
            }
            e.on_sent(now, flight.len() as u64 * MTU);
            let served = link_free.max(now) + per_packet;
            link_free = served;
            let ack = served + base_rtt + ack_delay(k);
            let pos = flight.partition_point(|&(a, _)| a <= ack);
            flight.insert(pos, (ack, now));
        }
        e
    }

    #[test]
    fn estimates_the_bottleneck_rate_on_a_clean_path() {
        let rate = 1_250_000; // 10 Mbit/s
        let e = drive(5_000, rate, Duration::from_millis(60), |_| Duration::ZERO);
        assert!(e.filled_pipe());
        let bw = e.bandwidth() as f64;
        assert!((bw / rate as f64 - 1.0).abs() < 0.1, "bandwidth {bw}");
        // The window settles at twice the bandwidth-delay product.
        let bdp = rate as f64 * 0.06;
        let w = e.window() as f64;
        assert!(
            (w / (2.0 * bdp) - 1.0).abs() < 0.15,
            "window {w}, bdp {bdp}"
        );
    }

    #[test]
    fn bunched_acknowledgements_do_not_inflate_the_estimate() {
        // Acknowledgements held back and released in bursts of 50 (as by a reverse queue or a
        // cellular uplink's stall): every ack of a burst arrives at its last packet's time.
        let rate = 1_250_000;
        let per_packet = Duration::from_nanos(MTU * 1_000_000_000 / rate);
        let e = drive(5_000, rate, Duration::from_millis(60), |k| {
            per_packet * (49 - (k % 50) as u32)
        });
        let bw = e.bandwidth() as f64;
        assert!(
            bw < rate as f64 * 1.3,
            "bandwidth {bw} on a {rate} B/s path"
        );
        assert!(e.window() < 3 * 75_000, "window {}", e.window());
    }

    #[test]
    fn the_window_never_falls_below_four_packets() {
        let mut e = Estimator::new(MTU);
        let t = Instant::now();
        e.on_sent(t, 0);
        e.on_ack(t + Duration::from_secs(5), t, 10, Duration::from_millis(1));
        e.on_end_acks(t + Duration::from_secs(5), false);
        assert!(e.window() >= 4 * MTU);
    }
}
