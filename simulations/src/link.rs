//! One direction of a network link: its specification and a packet-level transfer model.
//!
//! [`LinkSpec`] is what a scenario file says about a link (TOML-friendly, validated with messages
//! that name the field). [`Link`] turns a message of N bytes submitted at a time into a
//! [`Transfer`]: when it was delivered (or why not), how many bytes went on the wire, how many
//! packets were lost and retransmitted. The link is a FIFO: a message submitted while an earlier
//! one is still being serialized waits for it. Everything is computed at submit time (sans-IO): the
//! link is FIFO and its loss, jitter and capacity processes are seeded, so nothing that happens
//! later can change a transfer's outcome.
//!
//! # Packet model (QUIC-like)
//! * The message is cut into `ceil(N / mtu)` packets (at least one). Packets carry `mtu` bytes of
//!   payload; header overhead is not modelled.
//! * A packet occupies the link for its serialization time at the current capacity: constant
//!   `bandwidth`, or the trace (mahimahi delivery opportunities / piecewise-constant Mbit/s).
//! * The sender keeps the link busy (a rate-based, BBR-like sender: random loss does not shrink a
//!   congestion window; congestion control is not modelled).
//! * A packet is lost if its serialization ends inside an outage, or by the random loss model
//!   (i.i.d. `loss` and/or a Gilbert–Elliott chain advanced once per packet sent, or once per
//!   `step_ms` of time). Loss and jitter
//!   draws are taken for every packet, outage or not, so that an outage does not shift the random
//!   streams of the packets after it.
//! * A delivered packet arrives after `latency + U[0, jitter]`, but never before the packet sent
//!   before it (the relay keeps deliveries in offer order, so under load the delay is close to
//!   `latency + jitter`); its acknowledgement returns after
//!   another `latency` (the reverse path is lossless and jitter-free) and feeds an RFC 9002
//!   smoothed-RTT estimator that persists across transfers on the link.
//! * A lost packet is declared lost either when three packets sent after it have been acknowledged
//!   (packet threshold), or when its probe timeout expires: `PTO = max(srtt + max(4·rttvar, 1 ms),
//!   2·latency + jitter) · 2^k` where `k` counts this packet's earlier losses (exponential
//!   backoff). Before the first RTT sample `srtt = 2·latency + jitter`, `rttvar = srtt/2`, i.e. the
//!   first PTO is about 3 RTT. Declared-lost packets are retransmitted before new data, oldest
//!   first.
//! * The message is delivered when its last packet arrives. With a deadline, a message whose last
//!   packet would arrive after it is a failure (`delivered_at = None`); the sender stops at the
//!   deadline, so the link is free from `min(deadline, end of the last serialization)` on.
//! * The connection dies when no acknowledgement arrives for `idle_timeout_s` (QUIC idle timeout);
//!   this also bounds the work on a link that loses every packet.
//!
//! Approximations: gaps while the sender waits for a probe timeout are not used by the next
//! message in the queue (one stream at a time); the RTT estimator sees each sample when the packet
//! is sent rather than when its acknowledgement arrives.

pub use link_model::vocabulary::{
    Bandwidth, BandwidthParseError, GilbertElliott, GilbertElliottSpec, OutageSpec, TraceSpec,
};
use link_model::CapacitySource;
pub use link_model::{LinkSpec, LinkSpecError};

use crate::rng::SimRng;
use crate::time::{SimDuration, SimTime, NANOS_PER_SEC};
use crate::trace::{Trace, TraceCursor, TraceError};
use serde::{Deserialize, Serialize};
use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use thiserror::Error;

mod handshake;
mod mux;
mod queue;
mod reconnect;
mod recovery;
mod window;
pub use handshake::handshake_done;
pub use mux::{MuxEvent, MuxLink};
pub use reconnect::{connected_at, reconnected_at};

/// Packets acknowledged after a lost one before it is declared lost (RFC 9002 kPacketThreshold).
pub const PACKET_THRESHOLD: u64 = 3;
/// Timer granularity of the RTT estimator (RFC 9002 kGranularity).
pub const TIMER_GRANULARITY: SimDuration = SimDuration::from_millis(1);

/// Checks `spec` as the simulator reads it: every field ([`LinkSpec::checked`]), plus a
/// capacity (`bandwidth` or `trace`), and no periodic outage (list its windows in `outages`).
pub fn validate_link(spec: &LinkSpec) -> Result<(), LinkSpecError> {
    sim_params(spec).map(|_| ())
}

fn sim_params(spec: &LinkSpec) -> Result<LinkParams, LinkSpecError> {
    let checked = spec.checked()?;
    if checked.capacity == CapacitySource::Unlimited {
        return Err(LinkSpecError {
            field: "bandwidth".into(),
            problem: "is missing: a simulated link needs `bandwidth` or `trace`".into(),
        });
    }
    if checked.periodic_outage.is_some() {
        return Err(LinkSpecError {
            field: "periodic_outage".into(),
            problem: "is a relay-only key: the simulator takes outage windows, list them in \
                      `outages`"
                .into(),
        });
    }
    Ok(LinkParams {
        latency: SimDuration::from_nanos(checked.latency_ns),
        jitter: SimDuration::from_nanos(checked.jitter_ns),
        loss: checked.loss,
        outages: checked
            .outages
            .iter()
            .map(|&(a, b)| (SimTime::from_nanos(a), SimTime::from_nanos(b)))
            .collect(),
        mtu: u64::from(checked.mtu),
        idle_timeout: SimDuration::from_nanos(checked.idle_timeout_ns),
    })
}

/// Why a [`Link`] could not be built.
#[derive(Debug, Error)]
pub enum LinkError {
    /// The specification is invalid.
    #[error(transparent)]
    Spec(#[from] LinkSpecError),
    /// The trace file could not be loaded.
    #[error(transparent)]
    Trace(#[from] TraceError),
    /// The spec names a trace but none was supplied to [`Link::new`].
    #[error("the link spec names trace {} but no parsed trace was supplied", path.display())]
    TraceNotSupplied {
        /// The trace the spec names.
        path: PathBuf,
    },
}

/// Validated, converted link parameters.
#[derive(Clone, Debug)]
struct LinkParams {
    latency: SimDuration,
    jitter: SimDuration,
    loss: f64,
    /// Sorted, merged, half-open `[start, end)` intervals.
    outages: Vec<(SimTime, SimTime)>,
    mtu: u64,
    idle_timeout: SimDuration,
}

/// Where a link's capacity comes from.
#[derive(Clone, Debug)]
enum Capacity {
    Constant { bits_per_sec: u64 },
    Trace(Arc<Trace>),
}

impl Capacity {
    /// How long `bytes` take to serialize at the mean rate (a trace's over one period).
    fn mean_serialization(&self, bytes: u64) -> SimDuration {
        let bits_per_sec = match self {
            Capacity::Constant { bits_per_sec } => *bits_per_sec,
            // Whole bits per second (saturating).
            Capacity::Trace(trace) => trace.mean_bits_per_sec() as u64,
        };
        let nanos =
            u128::from(bytes) * 8 * u128::from(NANOS_PER_SEC) / u128::from(bits_per_sec.max(1));
        SimDuration(u64::try_from(nanos).unwrap_or(u64::MAX))
    }
}

/// RFC 9002 smoothed RTT estimator.
#[derive(Clone, Copy, Debug)]
struct RttEstimator {
    smoothed: SimDuration,
    variation: SimDuration,
    /// Lower bound for the probe timeout: `2·latency + jitter`.
    pto_floor: SimDuration,
}

impl RttEstimator {
    fn new(latency: SimDuration, jitter: SimDuration) -> RttEstimator {
        let initial = (latency * 2 + jitter).max(TIMER_GRANULARITY);
        RttEstimator {
            smoothed: initial,
            variation: SimDuration(initial.as_nanos() / 2),
            pto_floor: latency * 2 + jitter,
        }
    }

    fn on_sample(&mut self, sample: SimDuration) {
        let deviation = self.smoothed.as_nanos().abs_diff(sample.as_nanos());
        self.variation = SimDuration((3 * self.variation.as_nanos() + deviation) / 4);
        self.smoothed = SimDuration((7 * self.smoothed.as_nanos() + sample.as_nanos()) / 8);
    }

    fn pto(&self) -> SimDuration {
        let rto = self.smoothed + (self.variation * 4).max(TIMER_GRANULARITY);
        rto.max(self.pto_floor)
    }
}

/// Why a transfer was not delivered.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum TransferFailure {
    /// The last packet could not arrive by the deadline; the sender gave up at the deadline.
    DeadlineMissed,
    /// No acknowledgement for `idle_timeout_s`: the connection died.
    IdleTimeout,
    /// A non-looped trace ended before the message was through.
    TraceExhausted,
}

/// The outcome of sending one message over a [`Link`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Transfer {
    /// When the message was handed to the link.
    pub submitted_at: SimTime,
    /// When its first packet could start (after the messages queued before it).
    pub started_at: SimTime,
    /// When its last packet arrived; `None` if it was not delivered (by the deadline).
    pub delivered_at: Option<SimTime>,
    /// Why it was not delivered; `None` when delivered.
    pub failure: Option<TransferFailure>,
    /// When the link became free for the next message.
    pub link_free_at: SimTime,
    /// Message size.
    pub bytes: u64,
    /// Payload bytes serialized, retransmissions included.
    pub bytes_on_wire: u64,
    /// Packets the message was cut into.
    pub packets: u64,
    /// Packets sent, retransmissions included.
    pub packets_sent: u64,
    /// Packets lost (each loss of a retransmitted packet counts again).
    pub packets_lost: u64,
    /// Retransmitted packets.
    pub retransmissions: u64,
}

impl Transfer {
    /// Whether the message arrived (by its deadline, if it had one).
    pub fn is_delivered(&self) -> bool {
        self.delivered_at.is_some()
    }

    /// Time from submission to delivery.
    pub fn completion_time(&self) -> Option<SimDuration> {
        self.delivered_at.map(|d| d - self.submitted_at)
    }
}

/// Totals over every transfer a link has carried.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LinkStats {
    /// Messages submitted.
    pub transfers: u64,
    /// Messages delivered.
    pub delivered: u64,
    /// Payload bytes of delivered messages.
    pub bytes_delivered: u64,
    /// Bytes serialized, retransmissions included.
    pub bytes_on_wire: u64,
    /// Packets sent, retransmissions included.
    pub packets_sent: u64,
    /// Packets lost.
    pub packets_lost: u64,
}

/// What happened to one packet put on the wire.
#[derive(Clone, Copy, Debug)]
enum PacketFate {
    /// Serialized until `end`; arrives at `arrival`, or is lost (`None`).
    Sent {
        end: SimTime,
        arrival: Option<SimTime>,
    },
    /// A non-looped trace ended first.
    TraceExhausted,
}

/// Reusable per-transfer buffers (kept in the link so a transfer does not allocate per packet).
#[derive(Clone, Debug, Default)]
struct TransferScratch {
    /// Times each packet of the current message has been sent.
    attempts: Vec<u32>,
    /// Per packet: the PTO backoff exponent of its latest loss.
    backoff_exponent: Vec<u32>,
    /// Per packet: the number of deliveries (of any packet) when it was last lost.
    deliveries_at_loss: Vec<u64>,
    /// Retransmissions scheduled: (ready time, packet, attempt that was lost).
    retransmit: BinaryHeap<Reverse<(SimTime, u64, u32)>>,
    /// Lost packets waiting for `PACKET_THRESHOLD` later deliveries:
    /// (deliveries needed, packet, attempt that was lost).
    awaiting_threshold: VecDeque<(u64, u64, u32)>,
}

/// One direction of a link: a FIFO sender over a capacity model with loss, delay and outages.
#[derive(Clone, Debug)]
pub struct Link {
    spec: LinkSpec,
    params: LinkParams,
    capacity: Capacity,
    gilbert_elliott: Option<GilbertElliott>,
    loss_rng: SimRng,
    jitter_rng: SimRng,
    rtt: RttEstimator,
    busy_until: SimTime,
    /// Arrival of the last delivered packet (deliveries keep their order).
    last_arrival: SimTime,
    cursor: TraceCursor,
    stats: LinkStats,
    scratch: TransferScratch,
}

impl Link {
    /// Builds a link from a validated spec. `trace` must be the parsed trace when the spec names
    /// one (so several links can share one parsed file); `rng` should be a fork dedicated to this
    /// link (e.g. `root.fork("link:edge-3.up")`).
    pub fn new(
        spec: &LinkSpec,
        trace: Option<Arc<Trace>>,
        rng: &SimRng,
    ) -> Result<Link, LinkError> {
        let params = sim_params(spec)?;
        let capacity = match (&spec.bandwidth, &spec.trace) {
            (Some(b), _) => Capacity::Constant {
                bits_per_sec: b.bits_per_sec(),
            },
            (None, Some(trace_spec)) => match trace {
                Some(t) => Capacity::Trace(t),
                None => {
                    return Err(LinkError::TraceNotSupplied {
                        path: trace_spec.path.clone(),
                    })
                }
            },
            (None, None) => unreachable!("params() requires a capacity"),
        };
        Ok(Link {
            rtt: RttEstimator::new(params.latency, params.jitter),
            gilbert_elliott: spec.gilbert_elliott.map(GilbertElliott::new),
            loss_rng: rng.fork("loss"),
            jitter_rng: rng.fork("jitter"),
            spec: spec.clone(),
            params,
            capacity,
            busy_until: SimTime::ZERO,
            last_arrival: SimTime::ZERO,
            cursor: TraceCursor::default(),
            stats: LinkStats::default(),
            scratch: TransferScratch::default(),
        })
    }

    /// Builds a link, loading its trace (if any) relative to `base_dir`.
    pub fn from_spec(spec: &LinkSpec, base_dir: &Path, rng: &SimRng) -> Result<Link, LinkError> {
        validate_link(spec)?;
        let trace = match &spec.trace {
            Some(t) => Some(Arc::new(Trace::load(
                &base_dir.join(&t.path),
                t.format,
                t.looped,
            )?)),
            None => None,
        };
        Link::new(spec, trace, rng)
    }

    /// The spec the link was built from.
    pub fn spec(&self) -> &LinkSpec {
        &self.spec
    }

    /// The trace driving the link's capacity, if any.
    pub fn trace(&self) -> Option<&Arc<Trace>> {
        match &self.capacity {
            Capacity::Trace(t) => Some(t),
            Capacity::Constant { .. } => None,
        }
    }

    /// When the link can start serializing the next message.
    pub fn available_at(&self) -> SimTime {
        self.busy_until
    }

    /// The current probe timeout (before backoff).
    pub fn pto(&self) -> SimDuration {
        self.rtt.pto()
    }

    /// Totals over all transfers so far.
    pub fn stats(&self) -> LinkStats {
        self.stats
    }

    /// A copy of this link that draws the fate of the acknowledgements crossing it on a random
    /// stream of its own (same loss, Gilbert–Elliott chain and outages); `None` when it loses
    /// nothing.
    pub(crate) fn ack_path(&self) -> Option<Link> {
        let lossy = self.params.loss > 0.0
            || self.gilbert_elliott.is_some()
            || !self.params.outages.is_empty();
        let jittery = self.params.jitter.as_nanos() > 0;
        (lossy || jittery)
            .then(|| self.copy_drawing_on("acknowledgements", "acknowledgement jitter"))
    }

    /// A copy of this link for a node's connection handshakes ([`handshake_done`]): the same
    /// capacity, delay, loss, Gilbert–Elliott chain and outages, drawn on random streams of its
    /// own, so that dialling does not shift the draws of the data that follows.
    pub fn handshake_path(&self) -> Link {
        self.copy_drawing_on("handshake", "handshake jitter")
    }

    /// A fresh copy of this link (nothing sent yet) whose loss and jitter draws come from
    /// streams forked under these labels.
    fn copy_drawing_on(&self, loss_stream: &str, jitter_stream: &str) -> Link {
        let mut path = self.clone();
        path.loss_rng = self.loss_rng.fork(loss_stream);
        path.jitter_rng = self.jitter_rng.fork(jitter_stream);
        path.last_arrival = SimTime::ZERO;
        path.gilbert_elliott = self.spec.gilbert_elliott.map(GilbertElliott::new);
        path.scratch = TransferScratch::default();
        path.cursor = TraceCursor::default();
        path
    }

    /// When an acknowledgement sent at `t` across this link ([`Link::ack_path`]) arrives: after
    /// the latency and a jitter draw, in order behind the acknowledgement before it; `None`
    /// when it is lost.
    pub(crate) fn ack_arrival(&mut self, t: SimTime) -> Option<SimTime> {
        let lost = self.random_loss(t) || self.in_outage(t);
        let jitter = self.jitter_sample();
        if lost {
            return None;
        }
        Some(self.in_order(t + self.params.latency + jitter))
    }

    /// A delivery due at `at`, but never before the last one: the relay delivers in offer order
    /// (its `jitter_reorders` is off), so a packet waits out the jitter of those ahead of it.
    fn in_order(&mut self, at: SimTime) -> SimTime {
        self.last_arrival = at.max(self.last_arrival);
        self.last_arrival
    }

    /// One-way propagation delay (without jitter).
    pub fn latency(&self) -> SimDuration {
        self.params.latency
    }

    /// Whether `t` falls inside an outage.
    pub fn in_outage(&self, t: SimTime) -> bool {
        let outages = &self.params.outages;
        let i = outages.partition_point(|&(_, end)| end <= t);
        i < outages.len() && outages[i].0 <= t
    }

    /// Serialization of one packet; `None` when a non-looped trace has ended.
    fn transmit(&mut self, start: SimTime, bytes: u64) -> Option<SimTime> {
        match &self.capacity {
            Capacity::Constant { bits_per_sec } => {
                let nanos = (u128::from(bytes) * 8 * u128::from(NANOS_PER_SEC))
                    .div_ceil(u128::from(*bits_per_sec));
                Some(start + SimDuration(u64::try_from(nanos).unwrap_or(u64::MAX)))
            }
            Capacity::Trace(trace) => trace.transmit(&mut self.cursor, start, bytes),
        }
    }

    /// Random loss decision for one packet sent at `t` (always draws, so outages do not shift
    /// the stream).
    fn random_loss(&mut self, t: SimTime) -> bool {
        let iid = self.loss_rng.bernoulli(self.params.loss);
        let bursty = match &mut self.gilbert_elliott {
            Some(ge) => ge.packet_lost_at(t.as_nanos(), &mut self.loss_rng),
            None => false,
        };
        iid || bursty
    }

    fn jitter_sample(&mut self) -> SimDuration {
        SimDuration(
            self.jitter_rng
                .below_inclusive(self.params.jitter.as_nanos()),
        )
    }

    /// Puts one packet of `size` bytes on the wire at `t`: its serialization, then its random
    /// loss and jitter draws (in this order, for every packet, so that an outage does not shift
    /// the random streams).
    fn put_packet(&mut self, t: SimTime, size: u64) -> PacketFate {
        let Some(end) = self.transmit(t, size) else {
            return PacketFate::TraceExhausted;
        };
        let randomly_lost = self.random_loss(t);
        let jitter = self.jitter_sample();
        let arrival = (!randomly_lost && !self.in_outage(end))
            .then(|| self.in_order(end + self.params.latency + jitter));
        PacketFate::Sent { end, arrival }
    }

    /// Feeds the RTT estimator with a packet sent at `t` whose acknowledgement left the
    /// receiver at `acknowledged` (and is back one latency later).
    fn rtt_sample(&mut self, t: SimTime, acknowledged: SimTime) {
        self.rtt.on_sample(acknowledged + self.params.latency - t);
    }

    /// Loss recovery bookkeeping of one packet sent at `t` whose serialization ended at `end`:
    /// a delivered packet (`arrival`) feeds the RTT estimator and returns `None`; a lost one
    /// updates its backoff (only while nothing at all gets through, as QUIC resets its PTO
    /// count on any acknowledgement) and returns when its probe timeout fires.
    fn on_packet_outcome(
        &mut self,
        t: SimTime,
        end: SimTime,
        arrival: Option<SimTime>,
        attempt: u32,
        deliveries: u64,
        backoff_exponent: &mut u32,
        deliveries_at_loss: &mut u64,
    ) -> Option<SimTime> {
        match arrival {
            Some(acknowledged) => {
                self.rtt_sample(t, acknowledged);
                None
            }
            None => {
                *backoff_exponent = if attempt == 1 || deliveries > *deliveries_at_loss {
                    0
                } else {
                    (*backoff_exponent + 1).min(30)
                };
                *deliveries_at_loss = deliveries;
                Some(end + self.rtt.pto() * (1u64 << *backoff_exponent))
            }
        }
    }

    /// Sends a message of `bytes` submitted at `now`, queued behind earlier messages, and returns
    /// its outcome. With a `deadline`, a message not delivered by it is a failure and stops
    /// occupying the link at the deadline.
    pub fn send(&mut self, now: SimTime, bytes: u64, deadline: Option<SimTime>) -> Transfer {
        let start = now.max(self.busy_until);
        let mtu = self.params.mtu;
        let packets = bytes.div_ceil(mtu).max(1);
        let packet_size = |index: u64| (bytes - index * mtu).min(mtu);

        let mut scratch = std::mem::take(&mut self.scratch);
        scratch.attempts.clear();
        let packet_slots = usize::try_from(packets).unwrap_or(usize::MAX);
        scratch.attempts.resize(packet_slots, 0);
        scratch.backoff_exponent.clear();
        scratch.backoff_exponent.resize(packet_slots, 0);
        scratch.deliveries_at_loss.clear();
        scratch.deliveries_at_loss.resize(packet_slots, 0);
        scratch.retransmit.clear();
        scratch.awaiting_threshold.clear();

        let mut t = start;
        let mut next_new = 0u64;
        let mut deliveries = 0u64;
        let mut last_arrival = start;
        let mut last_ack = start;
        let mut last_send_end: Option<SimTime> = None;
        let mut failure = None;
        let (mut bytes_on_wire, mut packets_sent, mut packets_lost, mut retransmissions) =
            (0u64, 0u64, 0u64, 0u64);

        loop {
            // Drop retransmission entries made stale by a later send of the same packet.
            while let Some(&Reverse((_, packet, attempt))) = scratch.retransmit.peek() {
                if scratch.attempts[packet as usize] == attempt {
                    break;
                }
                scratch.retransmit.pop();
            }
            let next_retransmit = scratch.retransmit.peek().map(|r| r.0);
            let (packet, is_retransmission) = match next_retransmit {
                Some((ready, packet, _)) if ready <= t => {
                    scratch.retransmit.pop();
                    (packet, true)
                }
                _ if next_new < packets => {
                    next_new += 1;
                    (next_new - 1, false)
                }
                Some((ready, _, _)) => {
                    // Nothing to send until the next timer.
                    t = ready;
                    if deadline.is_some_and(|d| t >= d) {
                        failure = Some(TransferFailure::DeadlineMissed);
                        break;
                    }
                    if t.saturating_since(last_ack) > self.params.idle_timeout {
                        failure = Some(TransferFailure::IdleTimeout);
                        break;
                    }
                    continue;
                }
                None => break, // every packet delivered
            };
            if deadline.is_some_and(|d| t >= d) {
                failure = Some(TransferFailure::DeadlineMissed);
                break;
            }
            if t.saturating_since(last_ack) > self.params.idle_timeout {
                failure = Some(TransferFailure::IdleTimeout);
                break;
            }

            let size = packet_size(packet);
            let fate = self.put_packet(t, size);
            let PacketFate::Sent { end, arrival } = fate else {
                failure = Some(TransferFailure::TraceExhausted);
                break;
            };
            scratch.attempts[packet as usize] += 1;
            let attempt = scratch.attempts[packet as usize];
            packets_sent += 1;
            bytes_on_wire += size;
            retransmissions += u64::from(is_retransmission);
            last_send_end = Some(end);

            let slot = packet as usize;
            if let Some(pto_at) = self.on_packet_outcome(
                t,
                end,
                arrival,
                attempt,
                deliveries,
                &mut scratch.backoff_exponent[slot],
                &mut scratch.deliveries_at_loss[slot],
            ) {
                packets_lost += 1;
                scratch.retransmit.push(Reverse((pto_at, packet, attempt)));
                scratch.awaiting_threshold.push_back((
                    deliveries + PACKET_THRESHOLD,
                    packet,
                    attempt,
                ));
            } else if let Some(arrival) = arrival {
                last_arrival = last_arrival.max(arrival);
                let ack = arrival + self.params.latency;
                last_ack = last_ack.max(ack);
                deliveries += 1;
                while let Some(&(needed, lost_packet, lost_attempt)) =
                    scratch.awaiting_threshold.front()
                {
                    if needed > deliveries {
                        break;
                    }
                    scratch.awaiting_threshold.pop_front();
                    if scratch.attempts[lost_packet as usize] == lost_attempt {
                        scratch
                            .retransmit
                            .push(Reverse((ack, lost_packet, lost_attempt)));
                    }
                }
            }
            t = end;
        }

        let delivered_at = match (failure, deadline) {
            (None, Some(d)) if last_arrival > d => {
                failure = Some(TransferFailure::DeadlineMissed);
                None
            }
            (None, _) => Some(last_arrival),
            (Some(_), _) => None,
        };
        if let Some(end) = last_send_end {
            self.busy_until = match (failure, deadline) {
                (Some(TransferFailure::DeadlineMissed), Some(d)) if end > d => {
                    if let Capacity::Trace(trace) = &self.capacity {
                        trace.rewind_cursor(&mut self.cursor, d);
                    }
                    d
                }
                _ => end,
            };
        }
        self.scratch = scratch;

        self.stats.transfers += 1;
        if delivered_at.is_some() {
            self.stats.delivered += 1;
            self.stats.bytes_delivered += bytes;
        }
        self.stats.bytes_on_wire += bytes_on_wire;
        self.stats.packets_sent += packets_sent;
        self.stats.packets_lost += packets_lost;
        Transfer {
            submitted_at: now,
            started_at: start,
            delivered_at,
            failure,
            link_free_at: self.busy_until.max(start),
            bytes,
            bytes_on_wire,
            packets,
            packets_sent,
            packets_lost,
            retransmissions,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::TraceFormat;
    use proptest::prelude::*;

    const MB: u64 = 1_000_000;

    fn link(spec: &LinkSpec, seed: u64) -> Link {
        Link::new(spec, None, &SimRng::new(seed).fork("link:test")).unwrap()
    }

    fn fast_link() -> LinkSpec {
        LinkSpec::constant(Bandwidth::from_mbit(100), 10.0)
    }

    #[test]
    fn the_default_idle_timeout_is_the_transports() {
        let transport = transport::config::TransportConfig::default().idle_timeout;
        assert_eq!(LinkSpec::default().idle_timeout_s, transport.as_secs_f64());
    }

    fn ms(v: u64) -> SimTime {
        SimTime::from_millis(v)
    }

    #[test]
    fn bandwidth_strings_and_numbers() {
        assert_eq!(
            "100mbit".parse::<Bandwidth>().unwrap().bits_per_sec(),
            100_000_000
        );
        assert_eq!(
            "1.5 Gbit/s".parse::<Bandwidth>().unwrap().bits_per_sec(),
            1_500_000_000
        );
        assert_eq!(
            "500kbps".parse::<Bandwidth>().unwrap().bits_per_sec(),
            500_000
        );
        assert_eq!("2_000".parse::<Bandwidth>().unwrap().bits_per_sec(), 2_000);
        assert!("fast".parse::<Bandwidth>().is_err());
        assert!("10 furlongs".parse::<Bandwidth>().is_err());
        assert!("0mbit".parse::<Bandwidth>().is_err());
        let spec: LinkSpec = toml::from_str("bandwidth = 12500000\nlatency_ms = 3").unwrap();
        assert_eq!(
            spec.bandwidth,
            Some(Bandwidth::from_bits_per_sec(12_500_000))
        );
        let spec: LinkSpec = toml::from_str("bandwidth = 2.5e6").unwrap();
        assert_eq!(
            spec.bandwidth,
            Some(Bandwidth::from_bits_per_sec(2_500_000))
        );
        assert!(toml::from_str::<LinkSpec>("bandwidth = -5").is_err());
        assert_eq!(Bandwidth::from_mbit(100).to_string(), "100mbit");
    }

    #[test]
    fn spec_round_trips_through_toml() {
        let mut spec = fast_link();
        spec.loss = 0.01;
        spec.gilbert_elliott = Some(GilbertElliottSpec {
            p_good_to_bad: 0.01,
            p_bad_to_good: 0.2,
            loss_good: 0.0,
            loss_bad: 0.5,
            step_ms: None,
        });
        spec.outages.push(OutageSpec {
            start_s: 1.0,
            duration_s: 0.5,
        });
        let text = toml::to_string(&spec).unwrap();
        assert_eq!(toml::from_str::<LinkSpec>(&text).unwrap(), spec);
    }

    #[test]
    fn spec_validation_names_field_and_value() {
        let check = |edit: &dyn Fn(&mut LinkSpec), expected: &str| {
            let mut spec = fast_link();
            edit(&mut spec);
            let err = validate_link(&spec).unwrap_err();
            assert_eq!(err.to_string(), expected);
        };
        check(&|s| s.loss = 1.5, "loss must be in [0,1], got 1.5");
        check(
            &|s| s.latency_ms = -1.0,
            "latency_ms must be finite and >= 0, got -1",
        );
        check(
            &|s| s.jitter_ms = f64::NAN,
            "jitter_ms must be finite and >= 0, got NaN",
        );
        check(&|s| s.mtu = 0, "mtu must be in 1..=65535 bytes, got 0");
        check(
            &|s| s.bandwidth = None,
            "bandwidth is missing: a simulated link needs `bandwidth` or `trace`",
        );
        check(
            &|s| {
                s.trace = Some(TraceSpec {
                    path: "x".into(),
                    format: TraceFormat::Mahimahi,
                    looped: true,
                })
            },
            "bandwidth and `trace` are exclusive: give one of them",
        );
        check(
            &|s| {
                s.outages.push(OutageSpec {
                    start_s: 1.0,
                    duration_s: 0.0,
                })
            },
            "outages[0].duration_s must be finite and > 0, got 0",
        );
        check(
            &|s| {
                s.gilbert_elliott = Some(GilbertElliottSpec {
                    p_good_to_bad: 2.0,
                    p_bad_to_good: 0.1,
                    loss_good: 0.0,
                    loss_bad: 1.0,
                    step_ms: None,
                })
            },
            "gilbert_elliott.p_good_to_bad must be in [0,1], got 2",
        );
        let err = toml::from_str::<LinkSpec>("bandwidth = 1000\nlatncy_ms = 3").unwrap_err();
        assert!(
            err.to_string().contains("unknown field `latncy_ms`"),
            "{err}"
        );
    }

    #[test]
    fn constant_link_one_megabyte() {
        let mut l = link(&fast_link(), 1);
        let t = l.send(SimTime::ZERO, MB, None);
        // 8e6 bits at 1e8 bit/s = 80 ms, plus 10 ms latency; no loss so no retransmission.
        assert_eq!(t.delivered_at, Some(ms(90)));
        assert_eq!(t.packets, 667);
        assert_eq!(t.bytes_on_wire, MB);
        assert_eq!((t.packets_lost, t.retransmissions), (0, 0));
        assert_eq!(l.available_at(), ms(80));
        // A message submitted while the link is busy waits (FIFO).
        let second = l.send(ms(10), MB, None);
        assert_eq!(second.started_at, ms(80));
        assert_eq!(second.delivered_at, Some(ms(170)));
        // After the link went idle, a message starts at once.
        let third = l.send(ms(500), 1500, None);
        assert_eq!(
            third.delivered_at,
            Some(ms(510) + SimDuration::from_micros(120))
        );
    }

    #[test]
    fn jitter_adds_bounded_non_negative_delay() {
        let mut spec = fast_link();
        spec.jitter_ms = 5.0;
        let mut l = link(&spec, 2);
        let mut saw_positive_jitter = false;
        for i in 0..50 {
            let now = SimTime::from_secs(i);
            let t = l.send(now, 1500, None);
            let d = t.delivered_at.unwrap() - now;
            let base = SimDuration::from_millis(10) + SimDuration::from_micros(120);
            assert!(d >= base && d <= base + SimDuration::from_millis(5), "{d}");
            saw_positive_jitter |= d > base;
        }
        assert!(saw_positive_jitter);
    }

    #[test]
    fn jittered_packets_arrive_in_the_order_they_were_sent() {
        // As the relay delivers them: a packet never overtakes the one before it, so back to
        // back packets each wait out the largest jitter of those ahead (close to `jitter`).
        let mut spec = fast_link();
        spec.jitter_ms = 20.0;
        let mut l = link(&spec, 3);
        let (mut last, mut delay_ms, mut t) = (SimTime::ZERO, 0.0, SimTime::ZERO);
        for _ in 0..1000 {
            let PacketFate::Sent { end, arrival } = l.put_packet(t, 1200) else {
                panic!("a constant link always sends");
            };
            let arrival = arrival.expect("a lossless link delivers");
            assert!(arrival >= last, "{arrival} before {last}");
            last = arrival;
            delay_ms += (arrival - end).as_secs_f64() * 1e3;
            t = end;
        }
        let mean = delay_ms / 1000.0;
        assert!(
            mean > 10.0 + 18.0 && mean <= 30.0,
            "mean one-way delay {mean} ms"
        );
    }

    #[test]
    fn acknowledgements_cross_the_reverse_jitter_in_order_and_lossy_ones_are_lost() {
        let mut spec = fast_link();
        spec.jitter_ms = 8.0;
        let mut path = link(&spec, 4)
            .ack_path()
            .expect("a jittery link carries acks");
        let mut last = SimTime::ZERO;
        for i in 0..200 {
            let t = ms(i);
            let at = path.ack_arrival(t).expect("nothing is lost");
            assert!(at >= last && at >= t + SimDuration::from_millis(10));
            assert!(at <= t.max(last) + SimDuration::from_millis(18), "{at}");
            last = at;
        }
        spec.jitter_ms = 0.0;
        assert!(
            link(&spec, 4).ack_path().is_none(),
            "a clean link needs no ack path"
        );
        spec.loss = 1.0;
        let mut path = link(&spec, 4)
            .ack_path()
            .expect("a lossy link carries acks");
        assert_eq!(path.ack_arrival(ms(5)), None);
    }

    fn lossy_mean_ms(loss: f64, seeds: u64) -> (f64, f64) {
        let mut spec = fast_link();
        spec.loss = loss;
        let mut total = 0.0;
        let mut worst: f64 = 0.0;
        for seed in 0..seeds {
            let mut l = link(&spec, seed);
            let t = l.send(SimTime::ZERO, MB, None);
            let done = t
                .delivered_at
                .expect("no deadline, so it must arrive")
                .as_millis_f64();
            assert!(t.bytes_on_wire > MB && t.retransmissions >= t.packets_lost.min(1));
            total += done;
            worst = worst.max(done);
        }
        (total / seeds as f64, worst)
    }

    #[test]
    fn five_percent_loss_costs_plausible_time() {
        let (mean, worst) = lossy_mean_ms(0.05, 200);
        // Lossless is exactly 90 ms. Retransmitting ~5% more data plus a tail-loss recovery of
        // about one RTT gives ~110-130 ms; a naive stop-and-wait would be far above 2x.
        assert!(mean > 95.0 && mean < 180.0, "mean {mean} ms");
        // Rare runs lose the same tail packet several times in a row (PTO backoff).
        assert!(worst < 1000.0, "worst {worst} ms");
    }

    #[test]
    fn same_seed_same_transfers_different_seed_differs() {
        let mut spec = fast_link();
        spec.loss = 0.03;
        spec.jitter_ms = 2.0;
        spec.gilbert_elliott = Some(GilbertElliottSpec {
            p_good_to_bad: 0.01,
            p_bad_to_good: 0.3,
            loss_good: 0.0,
            loss_bad: 0.6,
            step_ms: None,
        });
        let run = |seed: u64| {
            let mut l = link(&spec, seed);
            (0..20u64)
                .map(|i| l.send(ms(i * 40), 200_000 + i * 1000, Some(ms(i * 40 + 200))))
                .collect::<Vec<_>>()
        };
        assert_eq!(run(5), run(5));
        assert_ne!(run(5), run(6));
    }

    #[test]
    fn outage_delays_transfer_past_its_end() {
        let mut spec = fast_link();
        spec.outages.push(OutageSpec {
            start_s: 0.05,
            duration_s: 0.5,
        });
        let mut l = link(&spec, 3);
        let t = l.send(SimTime::ZERO, MB, None);
        let done = t.delivered_at.unwrap();
        assert!(done > ms(550), "{done}");
        // Backoff makes recovery lag the end of the outage, but not by seconds.
        assert!(done < ms(1500), "{done}");
        assert!(t.packets_lost > 0 && t.retransmissions >= t.packets_lost);
        // A message submitted inside the outage also completes after it.
        let inside = link(&spec, 3).send(ms(300), 100_000, None);
        assert!(inside.delivered_at.unwrap() > ms(550));
        // A message well before the outage is untouched.
        let before = link(&spec, 3).send(SimTime::ZERO, 100_000, None);
        assert_eq!(before.delivered_at, Some(ms(18)));
    }

    #[test]
    fn deadline_miss_returns_none_and_frees_link_at_deadline() {
        let mut l = link(&fast_link(), 4);
        let t = l.send(SimTime::ZERO, MB, Some(ms(50)));
        assert_eq!(t.delivered_at, None);
        assert_eq!(t.failure, Some(TransferFailure::DeadlineMissed));
        assert_eq!(l.available_at(), ms(50));
        assert_eq!(t.link_free_at, ms(50));
        // The next message starts at the deadline.
        let next = l.send(SimTime::ZERO, MB, Some(ms(200)));
        assert_eq!(next.started_at, ms(50));
        assert_eq!(next.delivered_at, Some(ms(140)));
        // Sent in time but arriving late (latency pushes it past the deadline): a miss, and the
        // link is free when the last packet left.
        let mut l = link(&fast_link(), 4);
        let late = l.send(SimTime::ZERO, MB, Some(ms(85)));
        assert_eq!(late.delivered_at, None);
        assert_eq!(l.available_at(), ms(80));
        // A deadline that has passed before the message could start: nothing is sent.
        let expired = l.send(SimTime::ZERO, MB, Some(ms(70)));
        assert_eq!((expired.packets_sent, expired.delivered_at), (0, None));
        assert_eq!(l.available_at(), ms(80));
    }

    #[test]
    fn total_loss_ends_with_idle_timeout() {
        let mut spec = fast_link();
        spec.loss = 1.0;
        spec.idle_timeout_s = 2.0;
        let mut l = link(&spec, 5);
        let t = l.send(SimTime::ZERO, 30_000, None);
        assert_eq!(t.failure, Some(TransferFailure::IdleTimeout));
        assert_eq!(t.delivered_at, None);
        assert!(t.retransmissions > 0);
    }

    #[test]
    fn gilbert_elliott_long_run_loss_matches_stationary() {
        let ge = GilbertElliottSpec {
            p_good_to_bad: 0.02,
            p_bad_to_good: 0.2,
            loss_good: 0.01,
            loss_bad: 0.5,
            step_ms: None,
        };
        let expected = ge.stationary_loss();
        assert!((expected - (10.0 / 11.0 * 0.01 + 1.0 / 11.0 * 0.5)).abs() < 1e-12);
        let mut spec = LinkSpec::constant(Bandwidth::from_mbit(10_000), 1.0);
        spec.gilbert_elliott = Some(ge);
        let mut l = link(&spec, 6);
        for i in 0..100 {
            l.send(SimTime::from_secs(i), 3 * MB, None);
        }
        let stats = l.stats();
        let rate = stats.packets_lost as f64 / stats.packets_sent as f64;
        assert!(stats.packets_sent > 200_000);
        assert!(
            (rate - expected).abs() < 0.008,
            "rate {rate}, expected {expected}"
        );

        // Losses are bursty: after a loss, the next packet is lost far more often.
        let mut chain = GilbertElliott::new(ge);
        let mut rng = SimRng::new(7);
        let (mut after_loss, mut lost_after_loss, mut lost_total) = (0u32, 0u32, 0u32);
        let mut previous = false;
        for _ in 0..200_000 {
            let lost = chain.next_packet_lost(&mut rng);
            if previous {
                after_loss += 1;
                lost_after_loss += u32::from(lost);
            }
            lost_total += u32::from(lost);
            previous = lost;
        }
        let conditional = f64::from(lost_after_loss) / f64::from(after_loss);
        let unconditional = f64::from(lost_total) / 200_000.0;
        assert!(
            conditional > 3.0 * unconditional,
            "{conditional} vs {unconditional}"
        );
    }

    /// Sends `chunk`-byte messages back to back from t = 0 and returns the bytes delivered by
    /// `horizon` (inclusive).
    fn bytes_delivered_by(l: &mut Link, horizon: SimTime, chunk: u64) -> u64 {
        let mut delivered = 0;
        let mut now = SimTime::ZERO;
        loop {
            let t = l.send(now, chunk, None);
            match t.delivered_at {
                Some(at) if at <= horizon => delivered += chunk,
                _ => return delivered,
            }
            now = l.available_at();
        }
    }

    fn trace_link(path: &Path, format: TraceFormat) -> Link {
        let spec = LinkSpec {
            bandwidth: None,
            trace: Some(TraceSpec {
                path: path.to_path_buf(),
                format,
                looped: true,
            }),
            ..LinkSpec::constant(Bandwidth::from_mbit(1), 0.0)
        };
        Link::from_spec(&spec, Path::new("/"), &SimRng::new(8)).unwrap()
    }

    fn assert_replay_delivers_trace_bytes(path: &Path, format: TraceFormat, chunk: u64) {
        let mut l = trace_link(path, format);
        let trace = l.trace().unwrap().clone();
        let horizon = SimTime::ZERO + trace.period();
        let expected = trace.bytes_per_period();
        let delivered = bytes_delivered_by(&mut l, horizon, chunk);
        let ratio = delivered as f64 / expected as f64;
        assert!(
            (0.99..=1.0).contains(&ratio),
            "{}: delivered {delivered} of {expected} bytes ({ratio})",
            path.display()
        );
    }

    fn write_temp(name: &str, text: &str) -> PathBuf {
        let path = std::env::temp_dir().join(format!("simnet-{}-{name}", std::process::id()));
        std::fs::write(&path, text).unwrap();
        path
    }

    #[test]
    fn synthetic_mahimahi_replay_delivers_trace_bytes() {
        // 2 s trace: bursts of 1..4 opportunities per ms with gaps (an uneven cellular link).
        let mut text = String::new();
        for ms in 0..=2000u32 {
            let opportunities = match ms % 10 {
                0..=2 => 0,
                3 | 4 => 1,
                5..=7 => 2,
                _ => 4,
            };
            for _ in 0..opportunities {
                text.push_str(&format!("{ms}\n"));
            }
        }
        let path = write_temp("synthetic.up", &text);
        assert_replay_delivers_trace_bytes(&path, TraceFormat::Mahimahi, 15_000);
        // Without the loop, the link dies at the end of the trace.
        let spec = LinkSpec {
            bandwidth: None,
            trace: Some(TraceSpec {
                path: path.clone(),
                format: TraceFormat::Mahimahi,
                looped: false,
            }),
            ..fast_link()
        };
        let mut l = Link::from_spec(&spec, Path::new("/"), &SimRng::new(1)).unwrap();
        let t = l.send(SimTime::from_secs(1), 100 * MB, None);
        assert_eq!(t.failure, Some(TransferFailure::TraceExhausted));
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    fn synthetic_mbps_replay_delivers_trace_bytes() {
        let text = "0.0\t4.0\n0.5\t0.0\n1.25\t12.5\n2.0\t1.0\n3.5  8.0\n4.0  2.0\n";
        let path = write_temp("synthetic.mbps", text);
        assert_replay_delivers_trace_bytes(&path, TraceFormat::Mbps, 15_000);
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    fn deadline_miss_on_trace_link_gives_back_capacity() {
        let text: String = (0..=100u32).map(|ms| format!("{ms}\n")).collect();
        let path = write_temp("deadline.up", &text);
        let mut l = trace_link(&path, TraceFormat::Mahimahi);
        // One opportunity per ms: 100 packets take 100 ms; the deadline cuts at 40 ms.
        let t = l.send(SimTime::ZERO, 150_000, Some(ms(40)));
        assert_eq!(t.failure, Some(TransferFailure::DeadlineMissed));
        assert_eq!(l.available_at(), ms(40));
        // The next single packet uses the opportunity after the deadline, not one after 100 ms.
        // (The opportunity at 40 ms itself carried the last packet sent before the deadline.)
        let next = l.send(SimTime::ZERO, 1500, None);
        assert_eq!(next.delivered_at, Some(ms(41)));
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    fn real_trace_replays_deliver_trace_bytes_when_present() {
        let dir = Path::new("/work/shared/data/traces");
        let local = Path::new(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../shared/data/traces"
        ));
        let dir = if local.is_dir() { local } else { dir };
        let cases = [
            ("ATT-LTE-driving-2016.up", TraceFormat::Mahimahi),
            ("ATT-LTE-driving-2016.down", TraceFormat::Mahimahi),
            ("Verizon-LTE-driving.up", TraceFormat::Mahimahi),
            ("Verizon-LTE-driving.down", TraceFormat::Mahimahi),
            ("norway_bus_1", TraceFormat::Mbps),
            ("trace_207336_http---www.amazon.com", TraceFormat::Mbps),
        ];
        for (file, format) in cases {
            let path = dir.join(file);
            if !path.is_file() {
                eprintln!("skipping {}: not present", path.display());
                continue;
            }
            assert_replay_delivers_trace_bytes(&path, format, 150_000);
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        #[test]
        fn transfers_respect_physical_bounds(
            seed in 0u64..1000,
            mbit in 1u64..1000,
            latency_ms in 0.0f64..50.0,
            jitter_ms in 0.0f64..10.0,
            loss in 0.0f64..0.3,
            mtu in 200u32..9000,
            sizes in proptest::collection::vec((0u64..300_000, 0u64..200), 1..6),
        ) {
            let spec = LinkSpec {
                jitter_ms,
                loss,
                mtu,
                ..LinkSpec::constant(Bandwidth::from_mbit(mbit), latency_ms)
            };
            let latency = SimDuration::try_from_millis_f64(latency_ms).unwrap();
            let mut l = link(&spec, seed);
            let mut now = SimTime::ZERO;
            for (bytes, gap_ms) in sizes {
                now += SimDuration::from_millis(gap_ms);
                let t = l.send(now, bytes, None);
                prop_assert!(t.bytes_on_wire >= bytes);
                prop_assert_eq!(t.packets_sent, t.packets + t.retransmissions);
                // Without a deadline a message fails only when its connection does: the same
                // packet lost so often in a row that the probe timeout's backoff outlasts the
                // idle timeout (rare, and QUIC's behaviour too).
                match t.delivered_at {
                    Some(at) => prop_assert!(at >= now + latency),
                    None => prop_assert_eq!(t.failure, Some(TransferFailure::IdleTimeout)),
                }
                prop_assert!(t.link_free_at >= t.started_at && t.started_at >= now);
            }
        }
    }

    #[test]
    fn one_spec_serves_both_engines_with_their_own_rules() {
        let link: LinkSpec =
            toml::from_str("bandwidth = \"5mbit\"\nlatency_ms = 40\nloss = 0.1").unwrap();
        assert!(validate_link(&link).is_ok() && link.validate().is_ok());
        // The relay may be unlimited; the simulator needs a capacity.
        let unlimited: LinkSpec = toml::from_str("latency_ms = 40").unwrap();
        assert!(unlimited.validate().is_ok());
        assert!(validate_link(&unlimited).is_err());
        // Periodic outages are the relay's.
        let periodic: LinkSpec = toml::from_str(
            "bandwidth = \"5mbit\"\nperiodic_outage = { period_s = 10, duration_s = 1 }",
        )
        .unwrap();
        assert!(periodic.validate().is_ok());
        let err = validate_link(&periodic).unwrap_err().to_string();
        assert!(
            err.starts_with("periodic_outage") && err.contains("outages"),
            "{err}"
        );
    }
}
