//! The standing queue a QUIC sender keeps at a link's bottleneck, as a delay on each packet.
//!
//! dreamddp's QUIC connections run BBR (quinn's port of BBRv1). BBR paces at its estimate of
//! the bottleneck bandwidth but lets up to `cwnd = 2 · max_bw · min_rtt` bytes be in flight,
//! `max_bw` being the largest delivery rate measured over the last ~10 round trips. What the
//! path itself cannot hold (`rate · min_rtt`) waits in the bottleneck's queue: on a constant
//! link one extra `min_rtt`; on a bursty trace far more, since `max_bw` follows the bursts
//! while the mean rate is lower. `dreamddp link-check` measures this queue in the relay: mean
//! waits of 0.1–0.4 s on a 10 Mbit/s, 30 ms link and 1.8–2.8 s on the ATT LTE uplink trace,
//! with quinn's window at 170 KB and 530 KB on average.
//!
//! The simulated sender stays work-conserving (the link's throughput is unchanged); each
//! packet's arrival is delayed by the queue it would have waited behind:
//! `queue_bytes = 2 · max_bytes_per_min_rtt − bytes_deliverable(next min_rtt)`, served by the
//! link's capacity after the packet. The queue builds only while the link is busy: a packet
//! never waits longer than the link has been busy without a pause (a lone small message on an
//! idle link sees none). `min_rtt` is the link's base round trip (`2 · latency`).
//!
//! Approximations: no startup overshoot, no ProbeRTT drain, no loss-triggered recovery window,
//! no ack-aggregation allowance (quinn adds the largest recent ack burst to its window, which
//! is why its measured windows exceed `2 · BDP`); the queue is recomputed per `min_rtt` slot.

use super::Capacity;
use crate::time::{SimDuration, SimTime};
use crate::trace::TraceCursor;

/// Round trips over which the bandwidth estimate keeps its maximum (BBR's filter length).
const BANDWIDTH_FILTER_ROUNDS: u64 = 10;

/// State of one link's standing queue.
#[derive(Clone, Debug)]
pub(super) struct StandingQueue {
    min_rtt: SimDuration,
    /// Start of the current busy period (packets back to back since then).
    busy_since: SimTime,
    /// End of the last packet's serialization.
    last_end: SimTime,
    /// The slot (`time / min_rtt`) the cached wait belongs to, and the wait.
    cached: Option<(u64, SimDuration)>,
    /// Summed delay added to packets, and the packets.
    total_wait: SimDuration,
    packets: u64,
}

impl StandingQueue {
    pub(super) fn new(latency: SimDuration) -> StandingQueue {
        StandingQueue {
            min_rtt: latency * 2,
            busy_since: SimTime::ZERO,
            last_end: SimTime::ZERO,
            cached: None,
            total_wait: SimDuration::ZERO,
            packets: 0,
        }
    }

    /// Mean delay added per packet so far.
    pub(super) fn mean_wait(&self) -> SimDuration {
        SimDuration(self.total_wait.as_nanos() / self.packets.max(1))
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
        if start > self.last_end {
            self.busy_since = start;
        }
        self.last_end = end;
        let m = self.min_rtt.as_nanos();
        if m == 0 {
            return SimDuration::ZERO;
        }
        let slot = end.as_nanos() / m;
        let full = match self.cached {
            Some((s, wait)) if s == slot => wait,
            _ => {
                let wait = self.slot_wait(capacity, cursor, slot, end);
                self.cached = Some((slot, wait));
                wait
            }
        };
        let wait = full.min(end.saturating_since(self.busy_since));
        self.total_wait = self.total_wait + wait;
        self.packets += 1;
        wait
    }

    fn slot_wait(
        &self,
        capacity: &Capacity,
        cursor: &TraceCursor,
        slot: u64,
        end: SimTime,
    ) -> SimDuration {
        let m = self.min_rtt.as_nanos();
        match capacity {
            // max_bw is the rate: one min_rtt of queue.
            Capacity::Constant { .. } => self.min_rtt,
            Capacity::Trace(trace) => {
                let slot_bytes = |k: u64| {
                    let from = SimTime::from_nanos(k.saturating_mul(m));
                    trace.bytes_deliverable(from, from + self.min_rtt)
                };
                let first = slot.saturating_sub(BANDWIDTH_FILTER_ROUNDS - 1);
                let max_bytes = (first..=slot).map(slot_bytes).max().unwrap_or(0);
                let pipe = trace.bytes_deliverable(end, end + self.min_rtt);
                let queue = (2 * max_bytes).saturating_sub(pipe);
                if queue == 0 {
                    return SimDuration::ZERO;
                }
                let mut ahead = *cursor;
                trace
                    .transmit(&mut ahead, end, queue)
                    .map_or(SimDuration::ZERO, |served| served.saturating_since(end))
            }
        }
    }
}
