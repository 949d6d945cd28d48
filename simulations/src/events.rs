//! The deterministic event queue at the heart of the discrete-event engine.
//!
//! [`EventQueue`] holds events of any payload type `E`, ordered by `(time, insertion sequence)`:
//! the earliest event pops first, and events scheduled for the same instant pop in the order they
//! were scheduled (FIFO). The order therefore never depends on the payload, on hashing or on memory
//! addresses, which is what makes a replay byte-identical. Popping an event advances the queue's
//! clock ([`EventQueue::now`]); scheduling into the past is refused with a typed error.
//!
//! Cancellation is left to the caller: the usual pattern is to carry a generation counter in the
//! payload and ignore stale timers when they pop.

use crate::time::{SimDuration, SimTime};
use std::cmp::Ordering;
use std::collections::BinaryHeap;
use thiserror::Error;

/// Identifies one scheduled event: its insertion sequence number (unique within a queue).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct EventId(pub u64);

/// Refusal to schedule an event before the queue's current time.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("cannot schedule an event at {at}: the simulation clock is already at {now}")]
pub struct ScheduleInPast {
    /// The requested instant.
    pub at: SimTime,
    /// The queue's clock when the request was made.
    pub now: SimTime,
}

/// One heap entry; ordered so that the `BinaryHeap` (a max-heap) yields the smallest
/// `(time, seq)` first. The payload takes no part in the ordering.
struct Scheduled<E> {
    time: SimTime,
    seq: u64,
    event: E,
}

impl<E> PartialEq for Scheduled<E> {
    fn eq(&self, other: &Self) -> bool {
        self.time == other.time && self.seq == other.seq
    }
}

impl<E> Eq for Scheduled<E> {}

impl<E> PartialOrd for Scheduled<E> {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl<E> Ord for Scheduled<E> {
    fn cmp(&self, other: &Self) -> Ordering {
        // Reversed: the earliest time (then the lowest sequence) is the "greatest" entry.
        (other.time, other.seq).cmp(&(self.time, self.seq))
    }
}

/// A priority queue of timed events with a virtual clock; ties pop in insertion order.
pub struct EventQueue<E> {
    heap: BinaryHeap<Scheduled<E>>,
    next_seq: u64,
    now: SimTime,
}

impl<E> std::fmt::Debug for EventQueue<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EventQueue")
            .field("now", &self.now)
            .field("pending", &self.heap.len())
            .field("next_seq", &self.next_seq)
            .finish()
    }
}

impl<E> Default for EventQueue<E> {
    fn default() -> Self {
        Self::new()
    }
}

impl<E> EventQueue<E> {
    /// An empty queue with its clock at [`SimTime::ZERO`].
    pub fn new() -> Self {
        EventQueue {
            heap: BinaryHeap::new(),
            next_seq: 0,
            now: SimTime::ZERO,
        }
    }

    /// The current virtual time: the time of the last popped event (zero before the first).
    pub fn now(&self) -> SimTime {
        self.now
    }

    /// Schedules `event` at the absolute instant `at` (which may equal [`now`](Self::now)).
    pub fn schedule(&mut self, at: SimTime, event: E) -> Result<EventId, ScheduleInPast> {
        if at < self.now {
            return Err(ScheduleInPast { at, now: self.now });
        }
        let seq = self.next_seq;
        self.next_seq += 1;
        self.heap.push(Scheduled {
            time: at,
            seq,
            event,
        });
        Ok(EventId(seq))
    }

    /// Schedules `event` `delay` after [`now`](Self::now); never fails (saturates at "never").
    pub fn schedule_after(&mut self, delay: SimDuration, event: E) -> EventId {
        let at = self.now + delay;
        match self.schedule(at, event) {
            Ok(id) => id,
            Err(_) => unreachable!("now + delay is never before now"),
        }
    }

    /// Removes the earliest event (FIFO among equal times), advances the clock to its time and
    /// returns it; `None` when the queue is empty.
    pub fn pop(&mut self) -> Option<(SimTime, E)> {
        let entry = self.heap.pop()?;
        debug_assert!(entry.time >= self.now, "event queue went back in time");
        self.now = entry.time;
        Some((entry.time, entry.event))
    }

    /// Pops the earliest event only if it is due at or before `limit`; otherwise leaves the queue
    /// untouched and returns `None` (the clock does not move).
    pub fn pop_until(&mut self, limit: SimTime) -> Option<(SimTime, E)> {
        match self.peek_time() {
            Some(t) if t <= limit => self.pop(),
            _ => None,
        }
    }

    /// The time of the earliest pending event.
    pub fn peek_time(&self) -> Option<SimTime> {
        self.heap.peek().map(|e| e.time)
    }

    /// Number of pending events.
    pub fn len(&self) -> usize {
        self.heap.len()
    }

    /// Whether no event is pending.
    pub fn is_empty(&self) -> bool {
        self.heap.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pops_in_time_order() {
        let mut q = EventQueue::new();
        q.schedule(SimTime::from_millis(30), "c").unwrap();
        q.schedule(SimTime::from_millis(10), "a").unwrap();
        q.schedule(SimTime::from_millis(20), "b").unwrap();
        let order: Vec<_> = std::iter::from_fn(|| q.pop()).collect();
        assert_eq!(
            order,
            vec![
                (SimTime::from_millis(10), "a"),
                (SimTime::from_millis(20), "b"),
                (SimTime::from_millis(30), "c")
            ]
        );
        assert_eq!(q.now(), SimTime::from_millis(30));
        assert!(q.is_empty());
    }

    #[test]
    fn ties_are_fifo() {
        let mut q = EventQueue::new();
        let t = SimTime::from_millis(5);
        for i in 0..100u32 {
            // Interleave another time so the heap has to reorder.
            q.schedule(t, i).unwrap();
            q.schedule(SimTime::from_millis(7), 1000 + i).unwrap();
        }
        let popped: Vec<u32> = std::iter::from_fn(|| q.pop().map(|(_, e)| e)).collect();
        let expected: Vec<u32> = (0..100).chain(1000..1100).collect();
        assert_eq!(popped, expected);
    }

    #[test]
    fn events_scheduled_while_running_keep_order() {
        let mut q = EventQueue::new();
        q.schedule(SimTime::from_millis(1), 1u32).unwrap();
        let (t, _) = q.pop().unwrap();
        assert_eq!(t, SimTime::from_millis(1));
        // Same instant as now is allowed and comes after anything already due at now.
        q.schedule_after(SimDuration::ZERO, 2);
        q.schedule_after(SimDuration::from_millis(1), 4);
        q.schedule(SimTime::from_millis(1), 3).unwrap();
        let popped: Vec<u32> = std::iter::from_fn(|| q.pop().map(|(_, e)| e)).collect();
        assert_eq!(popped, vec![2, 3, 4]);
    }

    #[test]
    fn scheduling_in_the_past_is_refused() {
        let mut q = EventQueue::new();
        q.schedule(SimTime::from_millis(10), ()).unwrap();
        q.pop();
        let err = q.schedule(SimTime::from_millis(9), ()).unwrap_err();
        assert_eq!(err.now, SimTime::from_millis(10));
        assert!(err.to_string().contains("already at"));
    }

    #[test]
    fn pop_until_respects_the_limit() {
        let mut q = EventQueue::new();
        q.schedule(SimTime::from_millis(10), 'x').unwrap();
        assert_eq!(q.pop_until(SimTime::from_millis(9)), None);
        assert_eq!(q.now(), SimTime::ZERO);
        assert_eq!(
            q.pop_until(SimTime::from_millis(10)),
            Some((SimTime::from_millis(10), 'x'))
        );
        assert_eq!(q.len(), 0);
    }
}
