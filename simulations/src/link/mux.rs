//! A [`Link`] shared by many messages at once, as a QUIC connection shares it between streams.
//!
//! [`Link::send`] is a FIFO: each message has the link to itself until it is through. A real
//! dreamddp connection is not: the sender hands every message to QUIC as soon as the send
//! window has room (`transport`'s `send_window`, sized per link by
//! `transport::config::LinkWindows::for_link`), one stream per message, and QUIC sends the
//! streams' data round-robin, a packet each (quinn's `send_fairness`). Measured with
//! `dreamddp link-check`, the FIFO link completed up to four times more whole messages in the
//! same window than QUIC through a relay replaying the same link, while the bytes on the wire
//! agreed within 1–11 %. [`MuxLink`] models the interleaving; [`super::queue`] the sender's
//! window and the queue it keeps, the rest of the difference.
//!
//! # Model
//! * A message is *submitted* with its size and an optional deadline. It is *admitted* (the
//!   caller may reuse its buffer slot, as the real sender's write returns) when the bytes of the
//!   admitted, unfinished messages plus its own fit the window, or when nothing else is
//!   admitted; messages are admitted in submission order.
//! * At each sending opportunity (the end of the previous packet's serialization, once BBR's
//!   window has room for another packet: [`super::queue`]) the link sends, in this order: the
//!   oldest declared-lost packet whose retransmission is due, else the next new packet of the
//!   admitted message at the front of the round-robin, which then moves to the back. A lost
//!   packet keeps its place in the sender's window until loss detection declares it lost,
//!   and a delivered one until an acknowledgement for it survives the way back
//!   ([`super::recovery`], [`super::window`]). A probe timeout declares nothing: with packets
//!   waiting for news and the window full (or nothing else to send), it lets two probes go
//!   past the window (the oldest loss again, else new data, else a PING), and each probe
//!   timeout in a row without an acknowledgement doubles the next (RFC 9002 §6.2). So in a
//!   burst of loss in either direction, or an outage, the sender sends almost nothing, as
//!   QUIC's does.
//!   Packets, loss, jitter, outages, trace capacity and the RTT estimator are [`Link`]'s;
//!   each packet's arrival is delayed by the sender's standing queue
//!   and its acknowledgement by the other direction's ([`MuxLink::set_reverse_delay`]) and,
//!   when that direction is a trace, by its next delivery opportunity
//!   ([`MuxLink::carry_acks_on`]: a cellular uplink's stalls hold back the downlink's
//!   acknowledgements, as in the relay).
//! * A message is *finished* when its last packet is delivered (its `delivered_at` is that
//!   packet's arrival, possibly later than the decision), when its deadline passes first, or
//!   when the connection dies: no acknowledgement for `idle_timeout_s` (10 s, the transport's)
//!   fails every admitted message, empties the window and stops the link until the caller
//!   says the next connection is up ([`MuxLink::take_connection_lost`],
//!   [`MuxLink::pause_until`], [`MuxLink::connection_lost`] for the other direction of the
//!   same connection); a non-looped trace that ends fails every message.
//! * A message that misses its deadline stops occupying the link there (as with the FIFO link,
//!   the capacity after the deadline is given back when its packet was the last on the wire).
//!
//! # Driving it (sans-IO)
//! [`MuxLink::submit`] at `now`, [`MuxLink::advance_through`] when the time of
//! [`MuxLink::next_wake`] comes, and [`MuxLink::take_events`] after either. `next_wake` is a
//! lower bound of the next event's time (exact for deadlines and the idle timeout; for a finish,
//! the earliest time the round-robin could let any message's last packet go), so a caller that
//! wakes then never sees an event late, and wakes a few times per message rather than once per
//! packet.
//!
//! Approximations: the window is released when a message finishes, not when its last
//! acknowledgement returns; the idle timer restarts when the first message after a quiet spell
//! is admitted; streams have equal priority (versions, deltas and acknowledgements share fairly).

use super::queue::Bbr;
use super::recovery::{AckNews, Recovery};
use super::window::{LostPacket, SendWindow};
use super::{Capacity, Link, PacketFate, Transfer, TransferFailure};
use crate::time::{SimDuration, SimTime, NANOS_PER_SEC};
use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap, VecDeque};

/// What a [`MuxLink`] reports.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MuxEvent {
    /// The message entered the send window at `at`.
    Admitted {
        /// The id [`MuxLink::submit`] returned.
        id: u64,
        /// When.
        at: SimTime,
    },
    /// The message is through (delivered or failed).
    Finished {
        /// The id [`MuxLink::submit`] returned.
        id: u64,
        /// When the link decided it (for a delivery: when its last packet was sent).
        at: SimTime,
        /// Its outcome; `delivered_at` may be after `at` (the last packet's arrival).
        transfer: Transfer,
    },
}

/// One message on the link.
#[derive(Clone, Debug)]
struct Stream {
    bytes: u64,
    packets: u64,
    next_new: u64,
    /// Packets not yet delivered (unsent or lost).
    undelivered: u64,
    /// Bytes of the packets not yet delivered.
    undelivered_bytes: u64,
    attempts: Vec<u32>,
    last_arrival: SimTime,
    deadline: Option<SimTime>,
    submitted_at: SimTime,
    started_at: SimTime,
    admitted: bool,
    bytes_on_wire: u64,
    packets_sent: u64,
    packets_lost: u64,
    retransmissions: u64,
}

impl Stream {
    fn packet_size(&self, index: u64, mtu: u64) -> u64 {
        (self.bytes - (index * mtu).min(self.bytes)).min(mtu)
    }

    /// Bytes of its next `count` new packets.
    fn new_bytes(&self, count: u64, mtu: u64) -> u64 {
        let end = (self.next_new + count).min(self.packets);
        ((end * mtu).min(self.bytes)).saturating_sub((self.next_new * mtu).min(self.bytes))
    }

    fn new_left(&self) -> u64 {
        self.packets - self.next_new
    }
}

/// A packet put on the wire ([`MuxLink::put_on_wire`]).
struct Wired {
    end: SimTime,
    arrival: Option<SimTime>,
    ack_sent: SimTime,
}

/// Whether `packet` (message, packet, attempt) is still the latest attempt of a live message.
fn is_current(streams: &BTreeMap<u64, Stream>, (id, packet, attempt): LostPacket) -> bool {
    streams
        .get(&id)
        .is_some_and(|s| s.attempts[packet as usize] == attempt)
}

/// Bytes of a PING probe on the wire (a short header, the frame, the AEAD tag).
const PING_BYTES: u64 = 40;

/// The next thing the link does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Decision {
    Expire(u64),
    IdleTimeout,
    /// The probe timeout fired: up to two packets go regardless of the window.
    Probe,
    Retransmit,
    SendNew,
    /// Packets leave the sender's window (acknowledged or declared lost).
    WindowOpens,
}

/// A [`Link`] whose messages share it round-robin, up to a send window (see the module docs).
#[derive(Clone, Debug)]
pub struct MuxLink {
    link: Link,
    window: u64,
    streams: BTreeMap<u64, Stream>,
    /// Submitted, not admitted yet (submission order).
    queue: VecDeque<u64>,
    admitted_bytes: u64,
    admitted: usize,
    /// Admitted messages with new packets left, in turn order.
    round_robin: VecDeque<u64>,
    deadlines: BTreeSet<(SimTime, u64)>,
    /// Retransmissions due: (ready, message, packet, attempt that was lost).
    retransmit: BinaryHeap<Reverse<(SimTime, u64, u64, u32)>>,
    /// What the sender knows of its packets' fates ([`super::recovery`]).
    recovery: Recovery,
    /// Nothing is sent before this: the connection died and is being re-made.
    paused_until: SimTime,
    /// When the idle timeout killed the connection, until the caller takes it.
    connection_lost: Option<SimTime>,
    /// End of the last serialization.
    free_at: SimTime,
    /// Time of the last decision (or call).
    clock: SimTime,
    last_ack: SimTime,
    /// The message whose packet was serialized last, and when that serialization ended.
    last_packet: Option<(u64, SimTime)>,
    dead: bool,
    next_id: u64,
    events: Vec<MuxEvent>,
    /// Bytes serialized so far, retransmissions and unfinished messages included.
    serialized: u64,
    bbr: Bbr,
    /// Bytes sent and not yet acknowledged or declared lost.
    in_flight: SendWindow,
}

impl MuxLink {
    /// Shares `link` between messages, admitting up to `window` bytes at once.
    pub fn new(link: Link, window: u64) -> MuxLink {
        let bbr = Bbr::new(
            link.params.latency,
            link.params.jitter,
            link.params.mtu,
            &link.capacity,
        );
        MuxLink {
            bbr,
            in_flight: SendWindow::default(),
            link,
            window,
            streams: BTreeMap::new(),
            queue: VecDeque::new(),
            admitted_bytes: 0,
            admitted: 0,
            round_robin: VecDeque::new(),
            deadlines: BTreeSet::new(),
            retransmit: BinaryHeap::new(),
            recovery: Recovery::default(),
            paused_until: SimTime::ZERO,
            connection_lost: None,
            free_at: SimTime::ZERO,
            clock: SimTime::ZERO,
            last_ack: SimTime::ZERO,
            last_packet: None,
            dead: false,
            next_id: 0,
            events: Vec::new(),
            serialized: 0,
        }
    }

    /// Sends this link's acknowledgements back over `reverse`'s capacity: on a trace, an
    /// acknowledgement leaves when the reverse direction has its next delivery opportunity
    /// (after that direction's queue, [`MuxLink::set_reverse_delay`]), as in the relay, where
    /// an uplink trace's gaps hold back the acknowledgements of the downlink. Without it,
    /// acknowledgements need only the latency and the reverse queue.
    pub fn carry_acks_on(&mut self, reverse: &MuxLink) {
        self.bbr.set_reverse_capacity(reverse.link.capacity.clone());
        self.recovery.set_ack_path(&reverse.link);
    }

    /// The two directions of one access link, each carrying the other's acknowledgements
    /// ([`MuxLink::carry_acks_on`]).
    pub fn pair(mut up: MuxLink, mut down: MuxLink) -> (MuxLink, MuxLink) {
        up.carry_acks_on(&down);
        down.carry_acks_on(&up);
        (up, down)
    }

    /// The underlying link (spec, stats).
    pub fn link(&self) -> &Link {
        &self.link
    }

    /// Bytes serialized so far (retransmissions and unfinished messages included).
    pub fn bytes_serialized(&self) -> u64 {
        self.serialized
    }

    /// Mean delay of a packet in the sender's standing queue so far ([`super::queue`]).
    pub fn mean_queue_wait(&self) -> SimDuration {
        self.bbr.mean_wait()
    }

    /// The queue a packet sent at `now` would wait behind (none once the link has drained).
    /// Runs the link to `now` first, so the queue is read as it stands then, not as it stood at
    /// the last wake-up; the events that produces wait for [`MuxLink::take_events`].
    pub fn current_queue_wait(&mut self, now: SimTime) -> SimDuration {
        self.advance_through(now);
        self.bbr.current_wait(now)
    }

    /// The delay acknowledgements see on the way back (the other direction's queue): it
    /// lengthens this sender's round trip, which its window then bounds.
    pub fn set_reverse_delay(&mut self, delay: SimDuration) {
        self.bbr.set_reverse_delay(delay);
    }

    /// Hands a message of `bytes` to the link at `now` (after everything before `now`
    /// happened); returns its id for the events.
    pub fn submit(&mut self, now: SimTime, bytes: u64, deadline: Option<SimTime>) -> u64 {
        self.run(now, false);
        self.clock = self.clock.max(now);
        let id = self.next_id;
        self.next_id += 1;
        let mtu = self.link.params.mtu;
        let packets = bytes.div_ceil(mtu).max(1);
        let slots = usize::try_from(packets).unwrap_or(usize::MAX);
        self.streams.insert(
            id,
            Stream {
                bytes,
                packets,
                next_new: 0,
                undelivered: packets,
                undelivered_bytes: bytes,
                attempts: vec![0; slots],
                last_arrival: now,
                deadline,
                submitted_at: now,
                started_at: now,
                admitted: false,
                bytes_on_wire: 0,
                packets_sent: 0,
                packets_lost: 0,
                retransmissions: 0,
            },
        );
        self.queue.push_back(id);
        if self.dead {
            self.finish(id, Some(TransferFailure::TraceExhausted));
        } else {
            self.admit();
        }
        id
    }

    /// Runs the link through every decision due at or before `now`.
    pub fn advance_through(&mut self, now: SimTime) {
        self.run(now, true);
        self.clock = self.clock.max(now);
    }

    /// What happened since the last call.
    pub fn take_events(&mut self) -> Vec<MuxEvent> {
        std::mem::take(&mut self.events)
    }

    /// When the idle timeout killed the connection since the last call (its admitted messages
    /// failed with [`TransferFailure::IdleTimeout`]); the caller then says when the next one
    /// is up ([`MuxLink::pause_until`]), else the link goes on at once.
    pub fn take_connection_lost(&mut self) -> Option<SimTime> {
        self.connection_lost.take()
    }

    /// The connection is past STARTUP (tests of the steady state).
    #[cfg(test)]
    pub(crate) fn end_startup(&mut self) {
        self.bbr.end_startup();
    }

    /// Sends nothing before `at` (the connection is being re-made); the idle timer starts
    /// again then, and the congestion controller's STARTUP.
    pub fn pause_until(&mut self, at: SimTime) {
        self.paused_until = self.paused_until.max(at);
        self.last_ack = self.last_ack.max(at);
        self.bbr.restart();
    }

    /// The connection this direction belongs to died at `now`, found by the other direction:
    /// every admitted message fails, nothing is in flight, and nothing goes before `back_at`.
    pub fn connection_lost(&mut self, now: SimTime, back_at: SimTime) {
        self.run(now, true);
        self.clock = self.clock.max(now);
        self.die(now);
        self.connection_lost = None;
        self.pause_until(back_at);
    }

    /// A time at or before the next event (`None`: nothing in flight); see the module docs.
    pub fn next_wake(&mut self) -> Option<SimTime> {
        let (base, _) = self.next_decision()?;
        let mut wake = SimTime(u64::MAX);
        if let Some(&(d, _)) = self.deadlines.first() {
            wake = wake.min(d);
        }
        wake = wake.min(self.idle_fires_at());
        // Before a message's last packet goes, every other message with new packets left gets
        // at least `turns` = (its own new packets − 1) turns of the round-robin: that many
        // packets of the other's, or all it has left. Sorted by packets left, these sums are a
        // prefix sum plus a rectangle, so the bound costs O(k log k) for k messages.
        let mtu = self.link.params.mtu;
        let mut left: Vec<(u64, u64)> = self
            .round_robin
            .iter()
            .map(|j| {
                let other = &self.streams[j];
                (other.new_left(), other.new_bytes(other.new_left(), mtu))
            })
            .collect();
        left.sort_unstable();
        let mut prefix_bytes = Vec::with_capacity(left.len() + 1);
        prefix_bytes.push(0u64);
        for &(_, bytes) in &left {
            prefix_bytes.push(prefix_bytes.last().copied().unwrap_or(0) + bytes);
        }
        let mut fewest_bytes_ahead = u64::MAX;
        for s in self.streams.values().filter(|s| s.admitted) {
            let own_new = s.new_left();
            let turns = own_new.saturating_sub(1);
            let others = if own_new == 0 {
                0
            } else {
                // Messages with at most `turns` packets left send all of them; the rest (this
                // one among them) send `turns` full packets each.
                let p = left.partition_point(|&(n, _)| n <= turns);
                let rest = (left.len() - p).saturating_sub(1) as u64;
                prefix_bytes[p] + rest * turns * mtu
            };
            let ahead = (s.undelivered_bytes + others).saturating_sub(mtu);
            fewest_bytes_ahead = fewest_bytes_ahead.min(ahead);
        }
        if fewest_bytes_ahead < u64::MAX {
            wake = wake.min(self.serialization_lower_bound(base, fewest_bytes_ahead));
        }
        Some(wake.max(base))
    }

    /// Earliest end of serializing `bytes` from `start` (a block, no per-packet rounding).
    fn serialization_lower_bound(&self, start: SimTime, bytes: u64) -> SimTime {
        if bytes == 0 {
            return start;
        }
        let end = match &self.link.capacity {
            Capacity::Constant { bits_per_sec } => {
                let nanos =
                    u128::from(bytes) * 8 * u128::from(NANOS_PER_SEC) / u128::from(*bits_per_sec);
                start + SimDuration(u64::try_from(nanos).unwrap_or(u64::MAX))
            }
            Capacity::Trace(trace) => {
                let mut cursor = self.link.cursor;
                trace.transmit(&mut cursor, start, bytes).unwrap_or(start)
            }
        };
        // A microsecond of slack for the trace's per-packet rounding.
        SimTime(end.as_nanos().saturating_sub(1_000)).max(start)
    }

    fn idle_fires_at(&self) -> SimTime {
        self.last_ack + self.link.params.idle_timeout + SimDuration(1)
    }

    /// When the probe timeout fires, if sent packets wait for news: the probe timeout after
    /// the last packet sent, doubled for every probe timeout since the last acknowledgement
    /// (RFC 9002 §6.2.1).
    fn probe_at(&self) -> Option<SimTime> {
        self.recovery.probe_armed().then(|| {
            self.free_at.max(self.paused_until) + self.link.rtt.pto() * self.recovery.backoff()
        })
    }

    /// Drops retransmission entries made stale by a later send or a finished message.
    fn prune_retransmit(&mut self) {
        while let Some(&Reverse((_, id, packet, attempt))) = self.retransmit.peek() {
            if is_current(&self.streams, (id, packet, attempt)) {
                break;
            }
            self.retransmit.pop();
        }
    }

    /// When the link next acts, and how.
    fn next_decision(&mut self) -> Option<(SimTime, Decision)> {
        if self.admitted == 0 {
            return None;
        }
        self.prune_retransmit();
        let base = self.free_at.max(self.clock).max(self.paused_until);
        let ready = self.retransmit.peek().map(|r| r.0 .0);
        let mut send = match ready {
            Some(r) if r <= base => Some((base, Decision::Retransmit)),
            _ if !self.round_robin.is_empty() => Some((base, Decision::SendNew)),
            Some(r) => Some((r, Decision::Retransmit)),
            None => None,
        };
        let probe = self.probe_at().map(|p| (p.max(base), Decision::Probe));
        match send {
            // A full window: nothing goes until packets leave it, or the probe timeout fires.
            Some((t, _)) => {
                let cwnd = self.bbr.cwnd(&self.link.capacity, t);
                let mtu = self.link.params.mtu;
                let in_flight = self.in_flight.bytes_in_flight();
                if in_flight > 0 && in_flight.saturating_add(mtu) > cwnd {
                    let opens = self
                        .in_flight
                        .next_departure()
                        .map(|leaves| (leaves.max(t), Decision::WindowOpens));
                    send = match (opens, probe) {
                        (Some(o), Some(p)) => Some(if p.0 < o.0 { p } else { o }),
                        (o, p) => o.or(p).or(send),
                    };
                }
            }
            // Nothing to send, lost packets nobody has declared: the tail waits for the probe.
            None => send = probe,
        }
        let mut next = send;
        // The receiver's ACK frame going out may open the window or restart the probe timer.
        if let Some(frame) = self.recovery.frame_sends_at() {
            let frame = frame.max(self.clock);
            if next.is_none_or(|(t, _)| frame < t) {
                next = Some((frame, Decision::WindowOpens));
            }
        }
        let idle = self.idle_fires_at().max(self.clock);
        if next.is_none_or(|(t, _)| idle <= t) {
            next = Some((idle, Decision::IdleTimeout));
        }
        if let Some(&(d, id)) = self.deadlines.first() {
            let d = d.max(self.clock);
            if next.is_none_or(|(t, _)| d <= t) {
                next = Some((d, Decision::Expire(id)));
            }
        }
        next
    }

    /// Makes every decision due before `limit` (or at it, when `inclusive`).
    fn run(&mut self, limit: SimTime, inclusive: bool) {
        while let Some((t, decision)) = self.next_decision() {
            if t > limit || (t == limit && !inclusive) {
                break;
            }
            self.clock = t;
            self.send_due_ack_frame(t);
            self.drain_window(t);
            match decision {
                Decision::WindowOpens => {}
                Decision::Expire(id) => self.finish(id, Some(TransferFailure::DeadlineMissed)),
                Decision::IdleTimeout => {
                    // The caller decides when the next connection is up before anything goes.
                    self.die(t);
                    break;
                }
                Decision::Probe => {
                    // Two probes (quinn's count): the oldest loss again, else new data, else a
                    // PING.
                    self.recovery.probe_fired();
                    for _ in 0..2 {
                        // The second probe goes when the first is serialized: what it
                        // finishes, it finishes then (`next_wake` counts on it).
                        let at = t.max(self.free_at);
                        self.clock = at;
                        let streams = &self.streams;
                        let oldest = self.recovery.oldest_loss(|&p| is_current(streams, p));
                        if let Some((id, packet, _)) = oldest {
                            self.send_packet(at, id, packet, true);
                        } else if !self.send_new(at) {
                            self.send_ping(at);
                        }
                    }
                }
                Decision::Retransmit => {
                    if let Some(Reverse((_, id, packet, _))) = self.retransmit.pop() {
                        self.send_packet(t, id, packet, true);
                    }
                }
                Decision::SendNew => {
                    self.send_new(t);
                }
            }
        }
    }

    /// Sends the next new packet of the message at the front of the round-robin; whether
    /// there was one.
    fn send_new(&mut self, t: SimTime) -> bool {
        let Some(id) = self.round_robin.pop_front() else {
            return false;
        };
        let s = self
            .streams
            .get_mut(&id)
            .expect("round-robin holds live ids");
        let packet = s.next_new;
        s.next_new += 1;
        if s.next_new < s.packets {
            self.round_robin.push_back(id);
        }
        self.send_packet(t, id, packet, false);
        true
    }

    /// The idle timeout: the connection is gone, with every admitted message. The caller
    /// learns it from [`MuxLink::take_connection_lost`] and says when the next connection is
    /// up ([`MuxLink::pause_until`]).
    fn die(&mut self, t: SimTime) {
        self.reset_connection();
        self.connection_lost = Some(t);
        let admitted: Vec<u64> = self
            .streams
            .iter()
            .filter(|(_, s)| s.admitted)
            .map(|(&id, _)| id)
            .collect();
        for id in admitted {
            self.finish(id, Some(TransferFailure::IdleTimeout));
        }
    }

    /// A new connection starts with nothing in flight.
    fn reset_connection(&mut self) {
        self.in_flight = SendWindow::default();
        self.recovery.reset();
        self.retransmit.clear();
    }

    /// Puts a packet of `size` on the wire at `t`: returns when its serialization ends, its
    /// arrival (after the standing queue) unless it is lost, and when the receiver sends its
    /// acknowledgement; `None` when a non-looped trace has ended.
    fn put_on_wire(&mut self, t: SimTime, size: u64) -> Option<Wired> {
        let PacketFate::Sent { end, arrival } = self.link.put_packet(t, size) else {
            return None;
        };
        let start = t.max(self.free_at);
        let waited = self
            .bbr
            .wait(&self.link.capacity, &self.link.cursor, start, end);
        let arrival = arrival.map(|a| a + waited);
        // Delivered, it leaves the window when an acknowledgement for it is back (sent behind
        // the other direction's queue, at that direction's next opportunity); lost, when loss
        // detection declares it ([`Recovery`]).
        let latency = self.link.params.latency;
        let ack_sent = self
            .bbr
            .ack_departure(arrival.unwrap_or(end + latency + waited) + self.bbr.reverse_delay());
        self.free_at = end;
        self.serialized += size;
        Some(Wired {
            end,
            arrival,
            ack_sent,
        })
    }

    fn send_packet(&mut self, t: SimTime, id: u64, packet: u64, is_retransmission: bool) {
        let mtu = self.link.params.mtu;
        let size = self.streams[&id].packet_size(packet, mtu);
        let Some(Wired {
            end,
            arrival,
            ack_sent,
        }) = self.put_on_wire(t, size)
        else {
            self.dead = true;
            let all: Vec<u64> = self.streams.keys().copied().collect();
            for id in all {
                self.finish(id, Some(TransferFailure::TraceExhausted));
            }
            return;
        };
        self.last_packet = Some((id, end));
        let s = self.streams.get_mut(&id).expect("sending a live message");
        s.attempts[packet as usize] += 1;
        let attempt = s.attempts[packet as usize];
        s.packets_sent += 1;
        s.bytes_on_wire += size;
        s.retransmissions += u64::from(is_retransmission);
        let Some(arrival) = arrival else {
            s.packets_lost += 1;
            self.recovery
                .lost(&mut self.in_flight, size, (id, packet, attempt), end);
            return;
        };
        self.link.rtt_sample(t, ack_sent);
        let s = self.streams.get_mut(&id).expect("sending a live message");
        s.undelivered -= 1;
        s.undelivered_bytes -= size;
        s.last_arrival = s.last_arrival.max(arrival);
        let done = s.undelivered == 0;
        self.on_delivered(size, ack_sent);
        if done {
            let s = &self.streams[&id];
            let late = s.deadline.is_some_and(|d| s.last_arrival > d);
            self.finish(id, late.then_some(TransferFailure::DeadlineMissed));
        }
    }

    /// A packet of `size` arrived; the receiver acknowledges it at `ack_sent`. If that
    /// acknowledgement survives the way back, the packets it acknowledges or declares lost
    /// leave the window, and the declared ones are sent again.
    fn on_delivered(&mut self, size: u64, ack_sent: SimTime) {
        let latency = self.link.params.latency;
        let smoothed = self.link.rtt.smoothed;
        let news = self
            .recovery
            .delivered(&mut self.in_flight, size, ack_sent, latency, smoothed);
        self.take_ack_news(news);
    }

    /// The receiver's ACK frame goes out if it is due by `t` (no later packet came to fill it).
    fn send_due_ack_frame(&mut self, t: SimTime) {
        let latency = self.link.params.latency;
        let smoothed = self.link.rtt.smoothed;
        let news = self
            .recovery
            .frame_due(&mut self.in_flight, t, latency, smoothed);
        self.take_ack_news(news);
    }

    /// An ACK frame is back: the packets it declares lost are sent again.
    fn take_ack_news(&mut self, news: Option<AckNews>) {
        let Some((back, declared)) = news else {
            return;
        };
        self.last_ack = self.last_ack.max(back);
        for (at, (id, packet, attempt)) in declared {
            if is_current(&self.streams, (id, packet, attempt)) {
                self.retransmit.push(Reverse((at, id, packet, attempt)));
            }
        }
    }

    /// A probe with nothing to carry: a PING, which only asks for an acknowledgement.
    fn send_ping(&mut self, t: SimTime) {
        if let Some(Wired {
            arrival: Some(_),
            ack_sent,
            ..
        }) = self.put_on_wire(t, PING_BYTES)
        {
            self.on_delivered(0, ack_sent);
        }
    }

    /// Takes the packets whose acknowledgement (or loss) is known by `t` out of the window.
    fn drain_window(&mut self, t: SimTime) {
        self.in_flight.drain(t);
    }

    /// Admits queued messages while the window has room.
    fn admit(&mut self) {
        while let Some(&id) = self.queue.front() {
            let bytes = self.streams[&id].bytes;
            if self.admitted > 0 && self.admitted_bytes + bytes > self.window {
                break;
            }
            self.queue.pop_front();
            let at = self.clock;
            if self.admitted == 0 {
                // A quiet connection: the idle timer starts now.
                self.last_ack = self.last_ack.max(at);
            }
            self.admitted += 1;
            self.admitted_bytes += bytes;
            let s = self.streams.get_mut(&id).expect("queued ids are live");
            s.admitted = true;
            s.started_at = at.max(self.free_at);
            if let Some(d) = s.deadline {
                self.deadlines.insert((d, id));
            }
            self.round_robin.push_back(id);
            self.events.push(MuxEvent::Admitted { id, at });
        }
    }

    /// Ends message `id` (delivered when `failure` is `None`) and admits what now fits.
    fn finish(&mut self, id: u64, failure: Option<TransferFailure>) {
        let Some(s) = self.streams.remove(&id) else {
            return;
        };
        if s.admitted {
            self.admitted -= 1;
            self.admitted_bytes -= s.bytes;
            self.round_robin.retain(|&j| j != id);
        } else {
            self.queue.retain(|&j| j != id);
        }
        if let Some(d) = s.deadline {
            self.deadlines.remove(&(d, id));
        }
        if failure == Some(TransferFailure::DeadlineMissed) {
            if let (Some(d), Some((last, end))) = (s.deadline, self.last_packet) {
                if last == id && end > d && d >= self.clock {
                    // It stops at its deadline: the rest of that serialization is free again.
                    if let Capacity::Trace(trace) = &self.link.capacity {
                        trace.rewind_cursor(&mut self.link.cursor, d);
                    }
                    self.free_at = d;
                    self.last_packet = None;
                }
            }
        }
        let delivered_at = failure.is_none().then_some(s.last_arrival);
        let stats = &mut self.link.stats;
        stats.transfers += 1;
        if delivered_at.is_some() {
            stats.delivered += 1;
            stats.bytes_delivered += s.bytes;
        }
        stats.bytes_on_wire += s.bytes_on_wire;
        stats.packets_sent += s.packets_sent;
        stats.packets_lost += s.packets_lost;
        self.events.push(MuxEvent::Finished {
            id,
            at: self.clock,
            transfer: Transfer {
                submitted_at: s.submitted_at,
                started_at: s.started_at,
                delivered_at,
                failure,
                link_free_at: self.free_at.max(s.started_at),
                bytes: s.bytes,
                bytes_on_wire: s.bytes_on_wire,
                packets: s.packets,
                packets_sent: s.packets_sent,
                packets_lost: s.packets_lost,
                retransmissions: s.retransmissions,
            },
        });
        if !self.dead {
            self.admit();
        }
    }
}

#[cfg(test)]
mod tests;
