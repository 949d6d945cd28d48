//! What a simulated QUIC sender knows about the packets it sent (RFC 9002): which are
//! acknowledged, which it has declared lost, when its probe timeout fires, and which
//! acknowledgements the other direction of the link lost on their way back.
//!
//! The link model decides each packet's fate when it is sent; the sender learns it only from
//! acknowledgements. The receiver does not acknowledge each packet on its own: it sends an ACK
//! frame once [`ACK_FRAME_MAX_PACKETS`] packets have arrived, or [`MAX_ACK_DELAY`] after the
//! first one it has not acknowledged yet (quinn owes an acknowledgement from the second
//! ack-eliciting packet on and sends it after the read that brought it). `link-check` counted
//! 2.9–3.5 delivered packets per ACK frame from a real receiver with nothing else to send.
//! Each frame survives or is lost as a whole, so in a burst of loss on the way back a window
//! of packets has a third as many chances to be acknowledged as with one acknowledgement per
//! packet, and the sender stalls more often, as the real one does (docs/fidelity.md, "ACK
//! frames").
//!
//! A delivered packet is acknowledged when an ACK frame sent at or after its arrival survives
//! the reverse direction (acknowledgements are cumulative: a later frame covers an earlier
//! lost one). A lost packet is declared lost when a later packet is acknowledged (the packet
//! threshold, or the time threshold: 9/8 of the RTT after it was sent). Neither happens while
//! nothing gets through: then only the probe timeout acts, two probes per timeout, each timeout
//! in a row twice the last ([`super::MuxLink`]).
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

/// How long a receiver holds an acknowledgement back (quinn's default `max_ack_delay`).
pub(super) const MAX_ACK_DELAY: SimDuration = SimDuration::from_millis(25);

/// Most delivered packets one ACK frame waits for: quinn owes an acknowledgement from the
/// second ack-eliciting packet on and sends it after the read that brought it, which often
/// brings another (`link-check`: 2.9–3.5 packets per ACK frame from a receiver with nothing
/// else to send, 4.2–6.4 from one that sends data too and bundles its ACKs with it).
pub(super) const ACK_FRAME_MAX_PACKETS: u64 = 3;

/// The ACK frame the receiver has not sent yet; the packets it covers are the sender's
/// `unacknowledged` ones.
#[derive(Clone, Copy, Debug)]
struct OpenFrame {
    /// When it is sent (into the reverse direction).
    sends_at: SimTime,
    /// Delivered packets it covers so far.
    packets: u64,
}

/// What an ACK frame that came back tells the sender: when it is back, and the lost packets it
/// declares lost, with when.
pub(super) type AckNews = (SimTime, Vec<(SimTime, LostPacket)>);

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
    /// The receiver's next ACK frame, while delivered packets wait for it.
    open_frame: Option<OpenFrame>,
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

    /// A packet of `bytes` delivered; the receiver would acknowledge it at `ack_sent`, but
    /// holds it for the frame it is filling (see the module docs). Returns the news of the
    /// frames that went out before or with it and survived the way back.
    pub(super) fn delivered(
        &mut self,
        window: &mut SendWindow,
        bytes: u64,
        ack_sent: SimTime,
        latency: SimDuration,
        smoothed_rtt: SimDuration,
    ) -> Option<AckNews> {
        let earlier = self.frame_due(window, ack_sent, latency, smoothed_rtt);
        let key = window.sent_unacknowledged(bytes);
        self.unacknowledged.push(key);
        let frame = self.open_frame.get_or_insert(OpenFrame {
            sends_at: ack_sent + MAX_ACK_DELAY,
            packets: 0,
        });
        frame.packets += 1;
        if frame.packets >= ACK_FRAME_MAX_PACKETS {
            frame.sends_at = ack_sent;
        }
        let now = self.frame_due(window, ack_sent, latency, smoothed_rtt);
        match (earlier, now) {
            (Some((back, mut declared)), Some((later, more))) => {
                declared.extend(more);
                Some((back.max(later), declared))
            }
            (a, b) => a.or(b),
        }
    }

    /// When the receiver's open ACK frame goes out, if one is open.
    pub(super) fn frame_sends_at(&self) -> Option<SimTime> {
        self.open_frame.map(|f| f.sends_at)
    }

    /// Sends the open ACK frame if it is due by `now`; its news if it survives the way back.
    pub(super) fn frame_due(
        &mut self,
        window: &mut SendWindow,
        now: SimTime,
        latency: SimDuration,
        smoothed_rtt: SimDuration,
    ) -> Option<AckNews> {
        let frame = self.open_frame.filter(|f| f.sends_at <= now)?;
        self.open_frame = None;
        let back = match self.ack_path.as_mut() {
            Some(path) => path.ack_arrival(frame.sends_at),
            None => Some(frame.sends_at + latency),
        }?;
        self.acknowledged += self.unacknowledged.len() as u64;
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
        self.open_frame = None;
        self.pto_count = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(v: u64) -> SimTime {
        SimTime::from_millis(v)
    }

    #[test]
    fn packets_arriving_within_the_ack_delay_share_one_frame() {
        let (mut r, mut w) = (Recovery::default(), SendWindow::default());
        let latency = SimDuration::from_millis(20);
        let rtt = SimDuration::from_millis(40);
        // Two packets acknowledged-to-be at 100 and 110 ms: one frame, due at 125 ms.
        for t in [100, 110] {
            assert!(r.delivered(&mut w, 1_000, ms(t), latency, rtt).is_none());
        }
        assert_eq!(r.frame_sends_at(), Some(ms(125)));
        // The third comes after the frame went out: that frame's news, and a frame of its own.
        let (back, declared) = r.delivered(&mut w, 1_000, ms(130), latency, rtt).unwrap();
        assert_eq!(back, ms(145));
        assert!(declared.is_empty());
        assert_eq!(r.frame_sends_at(), Some(ms(155)));
        w.drain(ms(145));
        assert_eq!(w.bytes_in_flight(), 1_000);
        // Nothing else arrives: the frame goes out when it is due.
        assert!(r.frame_due(&mut w, ms(154), latency, rtt).is_none());
        assert_eq!(
            r.frame_due(&mut w, ms(155), latency, rtt).unwrap().0,
            ms(175)
        );
        w.drain(ms(175));
        assert_eq!(w.bytes_in_flight(), 0);
    }

    #[test]
    fn a_full_frame_goes_out_at_once_and_declares_the_earlier_losses() {
        let (mut r, mut w) = (Recovery::default(), SendWindow::default());
        let latency = SimDuration::from_millis(20);
        let rtt = SimDuration::from_millis(40);
        r.lost(&mut w, 1_000, (1, 0, 1), ms(1));
        let mut news = None;
        for i in 0..ACK_FRAME_MAX_PACKETS {
            news = r.delivered(&mut w, 1_000, ms(100) + SimDuration(i), latency, rtt);
        }
        let (back, declared) = news.expect("the full frame went out with its last packet");
        assert_eq!(back, ms(120) + SimDuration(ACK_FRAME_MAX_PACKETS - 1));
        assert_eq!(declared, vec![(back, (1, 0, 1))]);
        assert_eq!(r.frame_sends_at(), None);
        assert!(!r.probe_armed());
    }
}
