//! What a simulated QUIC sender knows about the packets it sent (RFC 9002): which are
//! acknowledged, which it has declared lost, when its probe timeout fires, and which
//! acknowledgements the other direction of the link lost on their way back.
//!
//! The link model decides each packet's fate when it is sent; the sender learns it only from
//! acknowledgements. A delivered packet is acknowledged when an acknowledgement sent at or
//! after its arrival survives the reverse direction (acknowledgements are cumulative: a later
//! one covers an earlier lost one). A lost packet is declared lost when a later packet is
//! acknowledged (the packet threshold, or the time threshold: 9/8 of the RTT after it was
//! sent). Neither happens while nothing gets through: then only the probe timeout acts, two
//! probes per timeout, each timeout in a row twice the last ([`super::MuxLink`]).
//!
//! The reverse direction's losses and jitter are drawn from a copy of that direction's link with
//! random streams of its own (its i.i.d. loss, Gilbert–Elliott chain, outages, latency and
//! jitter, acknowledgements kept in order): acknowledgements share the channel's parameters with
//! the reverse data, not its draws.

use super::window::{LostPacket, SendWindow};
use super::{Link, PACKET_THRESHOLD, TIMER_GRANULARITY};
use crate::time::{SimDuration, SimTime};
use std::collections::VecDeque;

/// Most probe timeouts in a row that double the next one (2^16 PTOs: hours).
const MAX_PTO_BACKOFF: u32 = 16;

/// A lost packet the sender does not know is lost yet.
#[derive(Clone, Copy, Debug)]
struct Undeclared {
    /// Acknowledged packets after which the packet threshold declares it.
    needed: u64,
    /// End of its serialization.
    sent: SimTime,
    packet: LostPacket,
}

/// A sender's loss-recovery state (see the module docs).
#[derive(Clone, Debug, Default)]
pub(super) struct Recovery {
    /// Lost packets not declared lost yet, in the order they were sent.
    undeclared: VecDeque<Undeclared>,
    /// Window keys of delivered packets whose acknowledgement has not come back.
    unacknowledged: Vec<u64>,
    /// Packets acknowledged so far.
    acknowledged: u64,
    /// Probe timeouts in a row without an acknowledgement (QUIC's `pto_count`).
    pto_count: u32,
    /// The reverse direction, to draw each acknowledgement's fate from; `None`: none is lost.
    ack_path: Option<Box<Link>>,
}

impl Recovery {
    /// Acknowledgements from now on cross `reverse` (a copy of it, drawing on its own stream).
    pub(super) fn set_ack_path(&mut self, reverse: &Link) {
        self.ack_path = reverse.ack_path().map(Box::new);
    }

    /// Whether the probe timeout is armed: sent packets wait for news.
    pub(super) fn probe_armed(&self) -> bool {
        !self.undeclared.is_empty() || !self.unacknowledged.is_empty()
    }

    /// What the probe timeout is multiplied by now.
    pub(super) fn backoff(&self) -> u64 {
        1u64 << self.pto_count.min(MAX_PTO_BACKOFF)
    }

    /// The probe timeout fired.
    pub(super) fn probe_fired(&mut self) {
        self.pto_count = (self.pto_count + 1).min(MAX_PTO_BACKOFF);
    }

    /// The oldest lost packet not declared lost for which `current` holds (not sent again).
    pub(super) fn oldest_loss(&self, current: impl Fn(&LostPacket) -> bool) -> Option<LostPacket> {
        self.undeclared
            .iter()
            .map(|u| u.packet)
            .find(|p| current(p))
    }

    /// A packet of `bytes` sent (serialized until `sent`) and lost.
    pub(super) fn lost(
        &mut self,
        window: &mut SendWindow,
        bytes: u64,
        packet: LostPacket,
        sent: SimTime,
    ) {
        window.sent_lost(bytes, packet);
        self.undeclared.push_back(Undeclared {
            needed: self.acknowledged + PACKET_THRESHOLD,
            sent,
            packet,
        });
    }

    /// A packet of `bytes` delivered; the receiver acknowledges it at `ack_sent`, which takes
    /// the reverse direction's latency and jitter to come back (`latency` without an ack
    /// path). When that acknowledgement survives, returns when it is back and the earlier lost
    /// packets it declares lost, with when; else the packet waits in the window for a later
    /// acknowledgement.
    pub(super) fn delivered(
        &mut self,
        window: &mut SendWindow,
        bytes: u64,
        ack_sent: SimTime,
        latency: SimDuration,
        smoothed_rtt: SimDuration,
    ) -> Option<(SimTime, Vec<(SimTime, LostPacket)>)> {
        let back = match self.ack_path.as_mut() {
            Some(path) => path.ack_arrival(ack_sent),
            None => Some(ack_sent + latency),
        };
        let Some(back) = back else {
            let key = window.sent_unacknowledged(bytes);
            self.unacknowledged.push(key);
            return None;
        };
        window.sent_delivered(bytes, back);
        self.acknowledged += 1 + self.unacknowledged.len() as u64;
        for key in self.unacknowledged.drain(..) {
            window.acknowledged(key, back);
        }
        self.pto_count = 0;
        let loss_delay = SimDuration(smoothed_rtt.as_nanos() * 9 / 8).max(TIMER_GRANULARITY);
        let declared = self
            .undeclared
            .drain(..)
            .map(|u| {
                let at = if self.acknowledged >= u.needed {
                    back
                } else {
                    back.max(u.sent + loss_delay)
                };
                window.declared_lost(u.packet, at);
                (at, u.packet)
            })
            .collect();
        Some((back, declared))
    }

    /// A new connection: nothing in flight, no backoff.
    pub(super) fn reset(&mut self) {
        self.undeclared.clear();
        self.unacknowledged.clear();
        self.pto_count = 0;
    }
}
