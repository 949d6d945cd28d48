//! Relay counters: lock-free per-direction counters the tasks update, and the plain
//! [`RelayStats`] snapshot handed to callers.

use crate::shaper::DropReason;
use serde::Serialize;
use std::sync::atomic::{AtomicU64, Ordering};

/// Datagrams dropped, by reason.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct DropCounts {
    /// I.i.d. loss.
    pub random_loss: u64,
    /// Gilbert–Elliott loss.
    pub burst_loss: u64,
    /// Outage windows.
    pub outage: u64,
    /// Bandwidth queue overflow.
    pub queue_full: u64,
    /// A non-looped trace had ended.
    pub trace_ended: u64,
}

impl DropCounts {
    /// All drops.
    pub fn total(&self) -> u64 {
        self.random_loss + self.burst_loss + self.outage + self.queue_full + self.trace_ended
    }
}

/// Counters of one direction.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct DirectionStats {
    /// Datagrams received by the relay.
    pub datagrams_in: u64,
    /// Their payload bytes.
    pub bytes_in: u64,
    /// Datagrams sent on after shaping.
    pub datagrams_out: u64,
    /// Their payload bytes.
    pub bytes_out: u64,
    /// Datagrams dropped by the link model.
    pub dropped: DropCounts,
    /// Datagrams the relay failed to send (socket errors).
    pub send_errors: u64,
    /// Datagrams delivered through the bandwidth queue (all delivered ones on a limited link).
    pub queued_datagrams: u64,
    /// Their summed wait in the queue before serialization, ns.
    pub queue_wait_ns_total: u64,
    /// The longest such wait, ns.
    pub queue_wait_ns_max: u64,
}

impl DirectionStats {
    /// Mean wait of a delivered datagram in the bandwidth queue, ms (0 with none).
    pub fn mean_queue_wait_ms(&self) -> f64 {
        if self.queued_datagrams == 0 {
            0.0
        } else {
            self.queue_wait_ns_total as f64 / self.queued_datagrams as f64 / 1e6
        }
    }
}

/// A snapshot of a relay's counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct RelayStats {
    /// Client → upstream.
    pub up: DirectionStats,
    /// Upstream → client.
    pub down: DirectionStats,
    /// Client source addresses seen (one upstream socket each).
    pub sessions: u64,
}

/// Live counters of one direction.
#[derive(Debug, Default)]
pub(crate) struct DirectionCounters {
    datagrams_in: AtomicU64,
    bytes_in: AtomicU64,
    datagrams_out: AtomicU64,
    bytes_out: AtomicU64,
    random_loss: AtomicU64,
    burst_loss: AtomicU64,
    outage: AtomicU64,
    queue_full: AtomicU64,
    trace_ended: AtomicU64,
    send_errors: AtomicU64,
    queued_datagrams: AtomicU64,
    queue_wait_ns_total: AtomicU64,
    queue_wait_ns_max: AtomicU64,
}

fn bump(counter: &AtomicU64, by: u64) {
    counter.fetch_add(by, Ordering::Relaxed);
}

impl DirectionCounters {
    pub(crate) fn received(&self, len: usize) {
        bump(&self.datagrams_in, 1);
        bump(&self.bytes_in, len as u64);
    }

    pub(crate) fn sent(&self, len: usize) {
        bump(&self.datagrams_out, 1);
        bump(&self.bytes_out, len as u64);
    }

    /// A datagram accepted for delivery after waiting `wait_ns` in the bandwidth queue.
    pub(crate) fn queued(&self, wait_ns: u64) {
        bump(&self.queued_datagrams, 1);
        bump(&self.queue_wait_ns_total, wait_ns);
        self.queue_wait_ns_max.fetch_max(wait_ns, Ordering::Relaxed);
    }

    pub(crate) fn send_failed(&self) {
        bump(&self.send_errors, 1);
    }

    pub(crate) fn dropped(&self, reason: DropReason) {
        let counter = match reason {
            DropReason::RandomLoss => &self.random_loss,
            DropReason::BurstLoss => &self.burst_loss,
            DropReason::Outage => &self.outage,
            DropReason::QueueFull => &self.queue_full,
            DropReason::TraceEnded => &self.trace_ended,
        };
        bump(counter, 1);
    }

    pub(crate) fn snapshot(&self) -> DirectionStats {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        DirectionStats {
            datagrams_in: get(&self.datagrams_in),
            bytes_in: get(&self.bytes_in),
            datagrams_out: get(&self.datagrams_out),
            bytes_out: get(&self.bytes_out),
            dropped: DropCounts {
                random_loss: get(&self.random_loss),
                burst_loss: get(&self.burst_loss),
                outage: get(&self.outage),
                queue_full: get(&self.queue_full),
                trace_ended: get(&self.trace_ended),
            },
            send_errors: get(&self.send_errors),
            queued_datagrams: get(&self.queued_datagrams),
            queue_wait_ns_total: get(&self.queue_wait_ns_total),
            queue_wait_ns_max: get(&self.queue_wait_ns_max),
        }
    }
}
