//! The communication fabric of a clusters simulation: the inter-cluster all-reduce over
//! simulated WAN [`Link`]s, and the closed-form intra-cluster ring all-reduce.
//!
//! **Inter-cluster.** Collectives run one after the other in launch order, like NCCL
//! collectives on one communicator: a collective starts at `max(ready, end of the previous
//! collective)`. With two clusters it is a direct exchange: each cluster sends its whole
//! buffer to the other over its own direction of the link, and the collective ends when the
//! later of the two messages is delivered. With `C ≥ 3` clusters it is a ring all-reduce:
//! `2(C − 1)` rounds, in each of which every cluster sends `⌈bytes / C⌉` to its successor;
//! a round ends when its last message is delivered. Queueing, serialization, latency,
//! jitter, loss and retransmission come from the link model. A message that fails (idle
//! timeout during an outage, an exhausted trace) is sent again when the link frees up; after
//! [`MAX_ATTEMPTS`] failures the simulation stops with an error.
//!
//! **Intra-cluster.** A ring all-reduce of `b` bytes among `n` workers over the node's fast
//! interconnect takes `2(n − 1)` steps of `latency + (b / n) / bandwidth` and puts
//! `2(n − 1) · b` bytes on the wire in total (zero for a single worker).

use std::path::Path;

use crate::link::{Link, LinkSpec};
use crate::rng::SimRng;
use crate::time::{SimDuration, SimTime, NANOS_PER_SEC};

use super::ClustersError;

/// How many times a failed inter-cluster message is sent before the run is abandoned.
pub const MAX_ATTEMPTS: u32 = 16;

/// One inter-cluster collective: when it started moving data and when it completed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CollectiveSpan {
    /// When the first message left (after the previous collective finished).
    pub start: SimTime,
    /// When the last message of the last round was delivered.
    pub end: SimTime,
}

/// The inter-cluster links and the serial collective queue over them.
#[derive(Clone, Debug)]
pub struct Fabric {
    /// Direct exchange (2 clusters): link 0 is cluster 0 → 1, link 1 is 1 → 0.
    /// Ring (≥ 3 clusters): link `i` is cluster `i` → `(i + 1) % C`.
    links: Vec<Link>,
    clusters: usize,
    free_at: SimTime,
    bytes_on_wire: u64,
}

impl Fabric {
    /// Builds the links of `clusters` clusters from one spec; each direction gets its own
    /// random streams forked from `rng`.
    pub fn new(
        spec: &LinkSpec,
        base_dir: &Path,
        clusters: usize,
        rng: &SimRng,
    ) -> Result<Self, ClustersError> {
        let link_count = if clusters == 2 { 2 } else { clusters };
        let links = (0..link_count)
            .map(|i| {
                let to = (i + 1) % clusters;
                Link::from_spec(spec, base_dir, &rng.fork(&format!("inter:{i}->{to}")))
                    .map_err(|source| ClustersError::Link { source })
            })
            .collect::<Result<_, _>>()?;
        Ok(Self {
            links,
            clusters,
            free_at: SimTime::ZERO,
            bytes_on_wire: 0,
        })
    }

    /// Bytes put on the inter-cluster wire so far (retransmissions included).
    pub fn bytes_on_wire(&self) -> u64 {
        self.bytes_on_wire
    }

    /// Runs an all-reduce of `bytes` per cluster whose last participant joined at `ready`.
    pub fn all_reduce(
        &mut self,
        ready: SimTime,
        bytes: u64,
    ) -> Result<CollectiveSpan, ClustersError> {
        let start = ready.max(self.free_at);
        let (rounds, chunk) = if self.clusters == 2 {
            (1, bytes)
        } else {
            let c = self.clusters as u64;
            (2 * (c - 1), bytes.div_ceil(c))
        };
        let mut t = start;
        for _ in 0..rounds {
            let mut round_end = t;
            for link in &mut self.links {
                let mut at = t;
                let mut delivered = None;
                for _ in 0..MAX_ATTEMPTS {
                    let transfer = link.send(at, chunk, None);
                    self.bytes_on_wire += transfer.bytes_on_wire;
                    if let Some(d) = transfer.delivered_at {
                        delivered = Some(d);
                        break;
                    }
                    at = transfer.link_free_at.max(at);
                }
                let d = delivered.ok_or(ClustersError::InterLinkDown {
                    attempts: MAX_ATTEMPTS,
                    since: t,
                })?;
                round_end = round_end.max(d);
            }
            t = round_end;
        }
        self.free_at = t;
        Ok(CollectiveSpan { start, end: t })
    }

    /// Seconds an all-reduce of `bytes` takes on an idle fabric, measured on a copy of the
    /// links (the real links' random streams are not touched).
    pub fn probe_seconds(&self, bytes: u64) -> Result<f64, ClustersError> {
        let mut copy = self.clone();
        let base = copy.free_at;
        let span = copy.all_reduce(base, bytes)?;
        Ok((span.end - base).as_secs_f64())
    }
}

/// The intra-cluster interconnect (NVLink/PCIe/shared memory) of one cluster.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct IntraNet {
    /// Workers in the cluster.
    pub workers: usize,
    /// Link rate, bits per second.
    pub bits_per_sec: u64,
    /// Per-step latency of the ring.
    pub step_latency: SimDuration,
}

impl IntraNet {
    /// Duration of a ring all-reduce of `bytes` per worker (zero for one worker).
    pub fn all_reduce_time(&self, bytes: u64) -> SimDuration {
        if self.workers <= 1 {
            return SimDuration::ZERO;
        }
        let n = self.workers as u64;
        let steps = 2 * (n - 1);
        let chunk_bits = u128::from(bytes.div_ceil(n)) * 8;
        let per_step_ns =
            (chunk_bits * u128::from(NANOS_PER_SEC)).div_ceil(u128::from(self.bits_per_sec.max(1)));
        let per_step = SimDuration(u64::try_from(per_step_ns).unwrap_or(u64::MAX));
        (per_step + self.step_latency) * steps
    }

    /// Bytes all workers together put on the interconnect for one all-reduce of `bytes`.
    pub fn all_reduce_bytes(&self, bytes: u64) -> u64 {
        if self.workers <= 1 {
            return 0;
        }
        2 * (self.workers as u64 - 1) * bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::link::Bandwidth;

    fn fabric(clusters: usize, mbit: u64, latency_ms: f64) -> Fabric {
        let spec = LinkSpec::constant(Bandwidth::from_mbit(mbit), latency_ms);
        Fabric::new(&spec, Path::new("."), clusters, &SimRng::new(1)).unwrap()
    }

    #[test]
    fn two_cluster_exchange_is_one_way_latency_plus_serialization() {
        let mut f = fabric(2, 100, 10.0);
        // 1500 bytes = one packet: 120 µs at 100 Mbit/s, plus 10 ms.
        let span = f.all_reduce(SimTime::from_millis(5), 1500).unwrap();
        assert_eq!(span.start, SimTime::from_millis(5));
        assert_eq!(span.end - span.start, SimDuration::from_micros(10_120));
        // The next collective queues behind the first.
        let next = f.all_reduce(SimTime::from_millis(6), 1500).unwrap();
        assert_eq!(next.start, span.end);
        assert_eq!(f.bytes_on_wire(), 4 * 1500);
    }

    #[test]
    fn ring_has_two_c_minus_one_rounds() {
        let mut f = fabric(3, 100, 1.0);
        let span = f.all_reduce(SimTime::ZERO, 4500).unwrap();
        // 4 rounds of 1500 bytes: each 1 ms + 120 µs.
        assert_eq!(span.end, SimTime::from_nanos(4 * 1_120_000));
        assert_eq!(f.bytes_on_wire(), 4 * 3 * 1500);
        let probe = fabric(3, 100, 1.0).probe_seconds(4500).unwrap();
        assert!((probe - 4.48e-3).abs() < 1e-9, "{probe}");
    }

    #[test]
    fn intra_ring_time_and_bytes() {
        let net = IntraNet {
            workers: 4,
            bits_per_sec: 8_000_000_000,
            step_latency: SimDuration::from_micros(5),
        };
        // 4 MB / 4 = 1 MB per step at 1 GB/s = 1 ms, plus 5 µs, six steps.
        assert_eq!(
            net.all_reduce_time(4_000_000),
            SimDuration::from_micros(6 * 1005)
        );
        assert_eq!(net.all_reduce_bytes(100), 600);
        let single = IntraNet { workers: 1, ..net };
        assert_eq!(single.all_reduce_time(1 << 20), SimDuration::ZERO);
        assert_eq!(single.all_reduce_bytes(1 << 20), 0);
    }
}
