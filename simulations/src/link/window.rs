//! The bytes a simulated QUIC sender has in flight, and when each packet leaves them.
//!
//! A delivered packet leaves the window when its acknowledgement is back. A lost one stays in
//! it until loss detection declares it lost, as in QUIC (RFC 9002 §6): when a later packet's
//! acknowledgement comes back (the packet or the time threshold). A probe timeout declares
//! nothing (§6.2): it lets two probes go past the window. So in a burst of loss or an outage
//! the window fills and the sender sends only probes, backing off, as the real one does
//! (docs/fidelity.md, "Probe timeouts declare nothing").

use crate::time::SimTime;
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

/// A lost packet: (message, packet, attempt).
pub(super) type LostPacket = (u64, u64, u32);

/// Bytes in flight and their departures (sans-IO: every time is given by the caller).
#[derive(Clone, Debug, Default)]
pub(super) struct SendWindow {
    bytes_in_flight: u64,
    /// (when it may leave, key): a lost packet can have two, the earlier one wins.
    departures: BinaryHeap<Reverse<(SimTime, u64)>>,
    /// Packets still in flight: key → (bytes, the lost packet it is, if lost).
    in_flight: HashMap<u64, (u64, Option<LostPacket>)>,
    /// Lost packets still in flight → their key.
    lost: HashMap<LostPacket, u64>,
    next_key: u64,
}

impl SendWindow {
    /// Bytes sent and not yet acknowledged or declared lost.
    pub(super) fn bytes_in_flight(&self) -> u64 {
        self.bytes_in_flight
    }

    /// The earliest time a packet may leave (a stale entry may make it early: harmless).
    pub(super) fn next_departure(&self) -> Option<SimTime> {
        self.departures.peek().map(|Reverse((t, _))| *t)
    }

    /// A delivered packet of `bytes` whose acknowledgement is not back yet: it stays until
    /// [`SendWindow::acknowledged`]; returns its key.
    pub(super) fn sent_unacknowledged(&mut self, bytes: u64) -> u64 {
        self.add(bytes, None)
    }

    /// A later acknowledgement, back at `at`, covers the packet `key`.
    pub(super) fn acknowledged(&mut self, key: u64, at: SimTime) {
        self.departures.push(Reverse((at, key)));
    }

    /// A lost packet of `bytes`: it stays until [`SendWindow::declared_lost`].
    pub(super) fn sent_lost(&mut self, bytes: u64, packet: LostPacket) {
        let key = self.add(bytes, Some(packet));
        self.lost.insert(packet, key);
    }

    /// Loss detection declared `packet` lost at `at`.
    pub(super) fn declared_lost(&mut self, packet: LostPacket, at: SimTime) {
        if let Some(&key) = self.lost.get(&packet) {
            self.departures.push(Reverse((at, key)));
        }
    }

    /// Takes every packet whose departure is due by `t` out of the window.
    pub(super) fn drain(&mut self, t: SimTime) {
        while let Some(&Reverse((at, key))) = self.departures.peek() {
            if at > t {
                break;
            }
            self.departures.pop();
            if let Some((bytes, lost)) = self.in_flight.remove(&key) {
                self.bytes_in_flight -= bytes;
                if let Some(packet) = lost {
                    self.lost.remove(&packet);
                }
            }
        }
    }

    fn add(&mut self, bytes: u64, lost: Option<LostPacket>) -> u64 {
        let key = self.next_key;
        self.next_key += 1;
        self.in_flight.insert(key, (bytes, lost));
        self.bytes_in_flight += bytes;
        key
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(ms: u64) -> SimTime {
        SimTime::from_nanos(ms * 1_000_000)
    }

    #[test]
    fn a_delivered_packet_leaves_at_its_acknowledgement() {
        let mut w = SendWindow::default();
        let key = w.sent_unacknowledged(1200);
        w.drain(at(10_000));
        assert_eq!(w.bytes_in_flight(), 1200);
        w.acknowledged(key, at(10_100));
        w.drain(at(10_099));
        assert_eq!(w.bytes_in_flight(), 1200);
        w.drain(at(10_100));
        assert_eq!(w.bytes_in_flight(), 0);
        assert_eq!(w.next_departure(), None);
    }

    #[test]
    fn a_lost_packet_stays_until_it_is_declared_lost() {
        let mut w = SendWindow::default();
        w.sent_lost(1200, (1, 0, 1));
        w.sent_lost(1000, (1, 1, 1));
        w.declared_lost((1, 1, 1), at(150));
        w.drain(at(10_000));
        // Undeclared, the first stays however long it takes.
        assert_eq!(w.bytes_in_flight(), 1200);
        assert_eq!(w.next_departure(), None);
        w.declared_lost((1, 0, 1), at(20_000));
        // A second declaration of the same packet releases nothing twice.
        w.declared_lost((1, 0, 1), at(20_001));
        w.drain(at(20_001));
        assert_eq!(w.bytes_in_flight(), 0);
        assert!(w.lost.is_empty() && w.in_flight.is_empty());
        // A declaration after the packet left changes nothing.
        w.declared_lost((1, 0, 1), at(30_000));
        w.drain(at(30_000));
        assert_eq!(w.bytes_in_flight(), 0);
    }
}
