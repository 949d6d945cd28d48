//! [`LinkShaper`]: the sans-IO decision for one direction of the relay — drop a datagram, or
//! deliver it at a given time.
//!
//! Per datagram offered at `now` (ns since the relay started):
//! 1. Three random draws are taken, always and in this order, from separate seeded ChaCha8 streams
//!    (i.i.d. loss, the Gilbert–Elliott chain, jitter), so that an outage or a full queue does not
//!    shift the random outcomes of the datagrams after it, and enabling jitter does not change
//!    which datagrams are lost.
//! 2. **Outage**: dropped if `now`, or the time its serialization would start, is inside an
//!    outage window (fixed windows or the periodic outage). It uses no capacity.
//! 3. **Queue**: with a capacity (bandwidth or trace) the link is a FIFO serialization queue: a
//!    datagram starts when the previous one has left. Bytes accepted but not yet departed are the
//!    queue; a datagram that would push it over the bound is tail-dropped (`QueueFull`), like a
//!    router buffer. An empty queue always accepts.
//! 4. **Serialization**: at the constant rate, or consuming the trace's delivery opportunities
//!    (mahimahi: 1500 bytes per line, credit used byte-wise like `mm-link`; Mbit/s rows: fluid)
//!    through [`Trace::transmit`]. A non-looped trace that has ended drops (`TraceEnded`).
//! 5. **Loss on the wire**: a datagram that was serialized can still be lost by the
//!    Gilbert–Elliott chain (`BurstLoss`) or the i.i.d. draw (`RandomLoss`); it used capacity.
//! 6. **Delivery** at `departure + latency + U[0, jitter]`, but never before the previous
//!    delivery (offer order is kept); with `jitter_reorders` a datagram can overtake another by
//!    at most `jitter`.
//!
//! Payload bytes are what counts against capacity (IP/UDP headers are not added). Times passed
//! in are clamped to be non-decreasing. No clocks are read here.

use crate::rng::SimRng;
use crate::spec::{CapacitySource, CheckedLink, RelayLinkSpec, RelaySpecError};
use crate::time::{SimTime, NANOS_PER_SEC};
use crate::trace::{Trace, TraceCursor};
use crate::vocabulary::GilbertElliott;
use std::collections::VecDeque;
use std::sync::Arc;

/// Why a datagram was dropped.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DropReason {
    /// The i.i.d. loss draw.
    RandomLoss,
    /// The Gilbert–Elliott chain.
    BurstLoss,
    /// An outage window (fixed or periodic).
    Outage,
    /// The bandwidth queue was full.
    QueueFull,
    /// A non-looped trace has ended: the link has no capacity any more.
    TraceEnded,
}

/// What to do with one datagram.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Verdict {
    /// Drop it.
    Drop(DropReason),
    /// Deliver it at `at_ns` (ns since the relay started).
    Deliver {
        /// Delivery time, ns since the relay started.
        at_ns: u64,
    },
}

/// Where the shaper's capacity comes from, with its replay state.
#[derive(Clone, Debug)]
enum Capacity {
    Unlimited,
    Constant {
        bits_per_sec: u64,
    },
    Trace {
        trace: Arc<Trace>,
        cursor: TraceCursor,
    },
}

/// One direction of the relayed link as a state machine: see the module documentation.
#[derive(Clone, Debug)]
pub struct LinkShaper {
    params: CheckedLink,
    capacity: Capacity,
    /// Queue bound in bytes; `None` for an unlimited link.
    queue_limit_bytes: Option<u64>,
    gilbert_elliott: Option<GilbertElliott>,
    loss_rng: SimRng,
    burst_rng: SimRng,
    jitter_rng: SimRng,
    /// When the last accepted datagram finished serialization.
    busy_until_ns: u64,
    /// Departure time and size of accepted datagrams that may not have left yet.
    in_queue: VecDeque<(u64, u64)>,
    queued_bytes: u64,
    last_now_ns: u64,
    /// `jitter_reorders`: deliveries may overtake each other.
    jitter_reorders: bool,
    /// When the last delivered datagram arrives (deliveries keep offer order without
    /// `jitter_reorders`).
    last_delivery_ns: u64,
    /// How long the last accepted datagram waited in the queue before its serialization.
    last_queue_wait_ns: u64,
}

impl LinkShaper {
    /// A shaper for `spec`. `trace` must be the parsed trace when the spec names one (see
    /// [`RelayLinkSpec::load_trace`]); `seed` determines every random draw.
    pub fn new(
        spec: &RelayLinkSpec,
        trace: Option<Arc<Trace>>,
        seed: u64,
    ) -> Result<LinkShaper, RelaySpecError> {
        let params = spec.checked()?;
        let capacity = match (&params.capacity, trace) {
            (CapacitySource::Unlimited, _) => Capacity::Unlimited,
            (CapacitySource::Constant { bits_per_sec }, _) => Capacity::Constant {
                bits_per_sec: *bits_per_sec,
            },
            (CapacitySource::Trace, Some(trace)) => Capacity::Trace {
                trace,
                cursor: TraceCursor::default(),
            },
            (CapacitySource::Trace, None) => {
                return Err(RelaySpecError {
                    field: "trace".into(),
                    problem: "is named but no parsed trace was supplied".into(),
                })
            }
        };
        let bits_per_sec = match &capacity {
            Capacity::Unlimited => None,
            Capacity::Constant { bits_per_sec } => Some(*bits_per_sec as f64),
            Capacity::Trace { trace, .. } => Some(trace.mean_bits_per_sec()),
        };
        let queue_limit_bytes = bits_per_sec.map(|bps| {
            spec.queue_bytes
                .unwrap_or_else(|| (bps / 8.0 * spec.queue_ms_or_default() / 1e3).max(1.0) as u64)
        });
        let root = SimRng::new(seed);
        Ok(LinkShaper {
            params,
            capacity,
            queue_limit_bytes,
            gilbert_elliott: spec.gilbert_elliott.map(GilbertElliott::new),
            loss_rng: root.fork("loss"),
            burst_rng: root.fork("burst"),
            jitter_rng: root.fork("jitter"),
            busy_until_ns: 0,
            in_queue: VecDeque::new(),
            queued_bytes: 0,
            last_now_ns: 0,
            jitter_reorders: spec.jitter_reorders,
            last_delivery_ns: 0,
            last_queue_wait_ns: 0,
        })
    }

    /// The queue bound in bytes (`None` for an unlimited link, which has no queue).
    pub fn queue_limit_bytes(&self) -> Option<u64> {
        self.queue_limit_bytes
    }

    /// How long the datagram of the last [`LinkShaper::on_datagram`] call waited behind the
    /// queue before its serialization started (0 when it was dropped before the queue).
    pub fn last_queue_wait_ns(&self) -> u64 {
        self.last_queue_wait_ns
    }

    /// Bytes accepted and not yet serialized as of the last call.
    pub fn queued_bytes(&self) -> u64 {
        self.queued_bytes
    }

    /// Decides the fate of a datagram of `len` bytes offered at `now_ns` (ns since the relay
    /// started).
    pub fn on_datagram(&mut self, now_ns: u64, len: usize) -> Verdict {
        let now = now_ns.max(self.last_now_ns);
        self.last_now_ns = now;
        let len = len as u64;

        let random_lost = self.loss_rng.bernoulli(self.params.loss);
        let burst_lost = match &mut self.gilbert_elliott {
            Some(chain) => chain.packet_lost_at(now, &mut self.burst_rng),
            None => false,
        };
        let jitter = self.jitter_rng.below_inclusive(self.params.jitter_ns);

        while let Some(&(departure, bytes)) = self.in_queue.front() {
            if departure > now {
                break;
            }
            self.queued_bytes -= bytes;
            self.in_queue.pop_front();
        }

        let start = now.max(self.busy_until_ns);
        self.last_queue_wait_ns = 0;
        if self.in_outage(now) || self.in_outage(start) {
            return Verdict::Drop(DropReason::Outage);
        }
        if let Some(limit) = self.queue_limit_bytes {
            if self.queued_bytes > 0 && self.queued_bytes.saturating_add(len) > limit {
                return Verdict::Drop(DropReason::QueueFull);
            }
        }
        let departure = match &mut self.capacity {
            Capacity::Unlimited => now,
            Capacity::Constant { bits_per_sec } => {
                let ns = (u128::from(len) * 8 * u128::from(NANOS_PER_SEC))
                    .div_ceil(u128::from(*bits_per_sec));
                start.saturating_add(u64::try_from(ns).unwrap_or(u64::MAX))
            }
            Capacity::Trace { trace, cursor } => {
                match trace.transmit(cursor, SimTime::from_nanos(start), len) {
                    Some(end) => end.as_nanos(),
                    None => return Verdict::Drop(DropReason::TraceEnded),
                }
            }
        };
        if !matches!(self.capacity, Capacity::Unlimited) {
            self.last_queue_wait_ns = start - now;
            self.busy_until_ns = departure;
            if departure > now {
                self.in_queue.push_back((departure, len));
                self.queued_bytes += len;
            }
        }

        if burst_lost {
            return Verdict::Drop(DropReason::BurstLoss);
        }
        if random_lost {
            return Verdict::Drop(DropReason::RandomLoss);
        }
        let mut at_ns = departure
            .saturating_add(self.params.latency_ns)
            .saturating_add(jitter);
        if !self.jitter_reorders {
            at_ns = at_ns.max(self.last_delivery_ns);
            self.last_delivery_ns = at_ns;
        }
        Verdict::Deliver { at_ns }
    }

    /// Whether the link is down at `t_ns`.
    fn in_outage(&self, t_ns: u64) -> bool {
        // Windows are sorted and merged: the candidate is the last one starting at or before t.
        let index = self
            .params
            .outages
            .partition_point(|&(start, _)| start <= t_ns);
        if index > 0 && t_ns < self.params.outages[index - 1].1 {
            return true;
        }
        match self.params.periodic_outage {
            Some((offset, period, duration)) if t_ns >= offset => {
                (t_ns - offset) % period < duration
            }
            _ => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::time::SimDuration;
    use crate::trace::TraceFormat;
    use crate::vocabulary::{Bandwidth, GilbertElliottSpec, OutageSpec};
    use proptest::prelude::*;
    use std::path::Path;

    const MS: u64 = 1_000_000;

    fn shaper(spec: &RelayLinkSpec, seed: u64) -> LinkShaper {
        LinkShaper::new(spec, None, seed).unwrap()
    }

    /// Offers `count` datagrams of `len` bytes every `gap_ns` from t = 0.
    fn offer(s: &mut LinkShaper, count: u64, gap_ns: u64, len: usize) -> Vec<(u64, Verdict)> {
        (0..count)
            .map(|i| (i * gap_ns, s.on_datagram(i * gap_ns, len)))
            .collect()
    }

    fn count(verdicts: &[(u64, Verdict)], reason: DropReason) -> usize {
        verdicts
            .iter()
            .filter(|(_, v)| *v == Verdict::Drop(reason))
            .count()
    }

    #[test]
    fn iid_loss_rate_matches_within_one_and_a_half_points() {
        let spec = RelayLinkSpec {
            loss: 0.2,
            ..RelayLinkSpec::default()
        };
        for seed in [1, 2, 3] {
            let verdicts = offer(&mut shaper(&spec, seed), 20_000, 100_000, 1200);
            let rate = count(&verdicts, DropReason::RandomLoss) as f64 / 20_000.0;
            eprintln!("seed {seed}: iid loss rate {rate:.4} (configured 0.2)");
            assert!((rate - 0.2).abs() < 0.015, "seed {seed}: loss rate {rate}");
            assert_eq!(
                count(&verdicts, DropReason::RandomLoss)
                    + verdicts
                        .iter()
                        .filter(|(_, v)| matches!(v, Verdict::Deliver { .. }))
                        .count(),
                20_000
            );
        }
    }

    #[test]
    fn gilbert_elliott_long_run_loss_is_near_stationary_and_bursty() {
        let ge = GilbertElliottSpec {
            p_good_to_bad: 0.02,
            p_bad_to_good: 0.2,
            loss_good: 0.0,
            loss_bad: 0.8,
            step_ms: None,
        };
        let spec = RelayLinkSpec {
            gilbert_elliott: Some(ge),
            ..RelayLinkSpec::default()
        };
        let n = 100_000;
        let verdicts = offer(&mut shaper(&spec, 4), n, 10_000, 1200);
        let lost: Vec<bool> = verdicts
            .iter()
            .map(|(_, v)| *v == Verdict::Drop(DropReason::BurstLoss))
            .collect();
        let rate = lost.iter().filter(|&&l| l).count() as f64 / n as f64;
        let expected = ge.stationary_loss();
        eprintln!("Gilbert-Elliott loss rate {rate:.4}, stationary {expected:.4}");
        assert!((rate - expected).abs() < 0.01, "rate {rate} vs {expected}");
        let after_loss = lost.windows(2).filter(|w| w[0]).count() as f64;
        let lost_after_loss = lost.windows(2).filter(|w| w[0] && w[1]).count() as f64;
        assert!(
            lost_after_loss / after_loss > 3.0 * rate,
            "losses should cluster"
        );
    }

    #[test]
    fn jitter_keeps_the_order_of_deliveries_unless_asked_to_reorder() {
        let spec = |jitter_reorders| RelayLinkSpec {
            latency_ms: 20.0,
            jitter_ms: 10.0,
            jitter_reorders,
            ..RelayLinkSpec::default()
        };
        let overtakes = |reorders| {
            let v = offer(&mut shaper(&spec(reorders), 9), 2_000, 500_000, 1200);
            let at: Vec<u64> = v
                .iter()
                .map(|&(_, v)| match v {
                    Verdict::Deliver { at_ns } => at_ns,
                    Verdict::Drop(r) => panic!("lossless link dropped: {r:?}"),
                })
                .collect();
            at.windows(2).filter(|w| w[1] < w[0]).count()
        };
        assert_eq!(overtakes(false), 0);
        assert!(overtakes(true) > 100, "netem-like jitter reorders");
    }

    #[test]
    fn latency_and_jitter_stay_in_bounds_and_fifo_without_jitter() {
        let spec = RelayLinkSpec {
            latency_ms: 50.0,
            jitter_ms: 10.0,
            jitter_reorders: true,
            ..RelayLinkSpec::default()
        };
        let verdicts = offer(&mut shaper(&spec, 5), 5_000, 100_000, 1200);
        let delays: Vec<u64> = verdicts
            .iter()
            .map(|&(now, v)| match v {
                Verdict::Deliver { at_ns } => at_ns - now,
                Verdict::Drop(r) => panic!("lossless link dropped: {r:?}"),
            })
            .collect();
        assert!(delays.iter().all(|&d| (50 * MS..=60 * MS).contains(&d)));
        let mean = delays.iter().sum::<u64>() as f64 / delays.len() as f64 / MS as f64;
        assert!((mean - 55.0).abs() < 0.3, "mean delay {mean} ms");
        assert!(*delays.iter().min().unwrap() < 50 * MS + MS / 5);
        assert!(*delays.iter().max().unwrap() > 60 * MS - MS / 5);

        let fifo = RelayLinkSpec {
            latency_ms: 50.0,
            bandwidth: Some(Bandwidth::from_mbit(100)),
            ..RelayLinkSpec::default()
        };
        let verdicts = offer(&mut shaper(&fifo, 5), 2_000, 50_000, 1200);
        let times: Vec<u64> = verdicts
            .iter()
            .filter_map(|(_, v)| match v {
                Verdict::Deliver { at_ns } => Some(*at_ns),
                Verdict::Drop(_) => None,
            })
            .collect();
        assert_eq!(times.len(), 2_000);
        assert!(times.windows(2).all(|w| w[0] <= w[1]));
    }

    #[test]
    fn ten_megabit_link_delivers_ten_megabit() {
        let spec = RelayLinkSpec {
            bandwidth: Some("10mbit".parse().unwrap()),
            ..RelayLinkSpec::default()
        };
        let mut s = shaper(&spec, 6);
        // Offered at 12 Mbit/s for 2 s: 1200 bytes every 800 µs.
        let verdicts = offer(&mut s, 2_500, 800_000, 1200);
        let horizon = 2_000 * MS;
        let delivered: u64 = verdicts
            .iter()
            .filter(|(_, v)| matches!(v, Verdict::Deliver { at_ns } if *at_ns <= horizon))
            .count() as u64
            * 1200;
        let rate = delivered as f64 * 8.0 / 2.0;
        eprintln!("10 Mbit/s link delivered {rate} bit/s");
        assert!((rate / 10e6 - 1.0).abs() < 0.02, "rate {rate} bit/s");
        // The excess was tail-dropped, and the queue never held more than its bound (200 ms of
        // 10 Mbit/s = 250 kB).
        assert!(count(&verdicts, DropReason::QueueFull) > 0);
        assert_eq!(s.queue_limit_bytes(), Some(250_000));
        assert!(s.queued_bytes() <= 250_000);
    }

    #[test]
    fn queue_bound_tail_drops_a_burst() {
        let spec = RelayLinkSpec {
            bandwidth: Some(Bandwidth::from_mbit(1)),
            queue_ms: Some(100.0),
            ..RelayLinkSpec::default()
        };
        let mut s = shaper(&spec, 7);
        let verdicts: Vec<Verdict> = (0..100).map(|_| s.on_datagram(0, 1000)).collect();
        // 100 ms of 1 Mbit/s = 12 500 bytes: twelve 1000-byte datagrams fit.
        let delivered: Vec<u64> = verdicts
            .iter()
            .filter_map(|v| match v {
                Verdict::Deliver { at_ns } => Some(*at_ns),
                Verdict::Drop(_) => None,
            })
            .collect();
        assert_eq!(delivered.len(), 12);
        assert_eq!(
            verdicts
                .iter()
                .filter(|v| **v == Verdict::Drop(DropReason::QueueFull))
                .count(),
            88
        );
        // Each 1000-byte datagram takes 8 ms at 1 Mbit/s.
        assert_eq!(delivered, (1..=12).map(|i| i * 8 * MS).collect::<Vec<_>>());
        // Once the queue has drained, the link accepts again.
        assert_eq!(
            s.on_datagram(200 * MS, 1000),
            Verdict::Deliver { at_ns: 208 * MS }
        );
    }

    #[test]
    fn outages_drop_everything_inside_and_nothing_outside() {
        let spec = RelayLinkSpec {
            outages: vec![OutageSpec {
                start_s: 1.0,
                duration_s: 0.5,
            }],
            periodic_outage: Some(crate::PeriodicOutageSpec {
                period_s: 1.0,
                duration_s: 0.1,
                offset_s: 0.25,
            }),
            latency_ms: 5.0,
            ..RelayLinkSpec::default()
        };
        let verdicts = offer(&mut shaper(&spec, 8), 3_000, MS, 1200);
        for (now, verdict) in verdicts {
            let t = now as f64 / 1e9;
            let down = (1.0..1.5).contains(&t) || (t >= 0.25 && (t - 0.25) % 1.0 < 0.1 - 1e-12);
            if down {
                assert_eq!(verdict, Verdict::Drop(DropReason::Outage), "at {t} s");
            } else {
                assert_eq!(
                    verdict,
                    Verdict::Deliver {
                        at_ns: now + 5 * MS
                    },
                    "at {t} s"
                );
            }
        }
    }

    #[test]
    fn queued_datagrams_whose_turn_falls_in_an_outage_are_dropped() {
        let spec = RelayLinkSpec {
            bandwidth: Some(Bandwidth::from_mbit(1)),
            queue_ms: Some(1000.0),
            outages: vec![OutageSpec {
                start_s: 0.02,
                duration_s: 0.1,
            }],
            ..RelayLinkSpec::default()
        };
        let mut s = shaper(&spec, 9);
        // 8 ms each: starts at 0, 8, 16 ms are before the outage; 24 ms is inside it.
        let verdicts: Vec<Verdict> = (0..4).map(|_| s.on_datagram(0, 1000)).collect();
        assert_eq!(verdicts[2], Verdict::Deliver { at_ns: 24 * MS });
        assert_eq!(verdicts[3], Verdict::Drop(DropReason::Outage));
    }

    fn synthetic_mahimahi_trace() -> Arc<Trace> {
        // 2 s: bursts of 0..4 opportunities per ms (an uneven cellular link, 2.6 Mbit/s mean).
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
        Arc::new(Trace::parse_mahimahi(&text, Path::new("synthetic.up"), true).unwrap())
    }

    fn traced_spec(path: &str, format: TraceFormat) -> RelayLinkSpec {
        RelayLinkSpec {
            trace: Some(crate::vocabulary::TraceSpec {
                path: path.into(),
                format,
                looped: true,
            }),
            ..RelayLinkSpec::default()
        }
    }

    /// Saturates a trace-driven shaper for `horizon_ns` and returns (bytes delivered by the
    /// horizon, bytes the trace offers in `[0, horizon]`).
    fn saturate(
        trace: Arc<Trace>,
        format: TraceFormat,
        horizon_ns: u64,
        gap_ns: u64,
    ) -> (u64, u64) {
        let spec = traced_spec("unused", format);
        let mut s = LinkShaper::new(&spec, Some(trace.clone()), 10).unwrap();
        let mut delivered = 0;
        let mut now = 0;
        while now <= horizon_ns {
            if let Verdict::Deliver { at_ns } = s.on_datagram(now, 1200) {
                if at_ns <= horizon_ns {
                    delivered += 1200;
                }
            }
            now += gap_ns;
        }
        let offered = trace.bytes_deliverable(
            SimTime::ZERO,
            SimTime::from_nanos(horizon_ns) + SimDuration::from_nanos(1),
        );
        (delivered, offered)
    }

    #[test]
    fn mahimahi_replay_delivers_the_trace_bytes_over_a_period() {
        let trace = synthetic_mahimahi_trace();
        let period = trace.period().as_nanos();
        let (delivered, offered) = saturate(trace.clone(), TraceFormat::Mahimahi, period, 100_000);
        let ratio = delivered as f64 / offered as f64;
        eprintln!("mahimahi replay: {delivered} of {offered} bytes ({ratio:.4})");
        assert!(
            (ratio - 1.0).abs() < 0.01,
            "{delivered} of {offered} ({ratio})"
        );
        assert!(offered >= trace.bytes_per_period() - 1500);
    }

    #[test]
    fn mbps_replay_delivers_the_trace_bytes_over_a_period() {
        let text = "0.0\t4.0\n0.5\t0.0\n1.25\t12.5\n2.0\t1.0\n3.5  8.0\n4.0  2.0\n";
        let trace = Arc::new(Trace::parse_mbps(text, Path::new("synthetic.mbps"), true).unwrap());
        let period = trace.period().as_nanos();
        let (delivered, offered) = saturate(trace, TraceFormat::Mbps, period, 200_000);
        let ratio = delivered as f64 / offered as f64;
        eprintln!("mbps replay: {delivered} of {offered} bytes ({ratio:.4})");
        assert!(
            (ratio - 1.0).abs() < 0.01,
            "{delivered} of {offered} ({ratio})"
        );
    }

    #[test]
    fn real_att_uplink_replay_matches_the_trace() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../simulations/traces/ATT-LTE-driving-2016.up"
        );
        let Ok(trace) = Trace::load(Path::new(path), TraceFormat::Mahimahi, true) else {
            eprintln!("skipping: {path} not present");
            return;
        };
        let (delivered, offered) =
            saturate(Arc::new(trace), TraceFormat::Mahimahi, 20_000 * MS, 100_000);
        let ratio = delivered as f64 / offered as f64;
        eprintln!("ATT uplink 20 s replay: {delivered} of {offered} bytes ({ratio:.4})");
        assert!(
            (ratio - 1.0).abs() < 0.01,
            "{delivered} of {offered} ({ratio})"
        );
    }

    #[test]
    fn a_missing_trace_is_an_error() {
        let spec = traced_spec("a.up", TraceFormat::Mahimahi);
        let err = LinkShaper::new(&spec, None, 1).unwrap_err();
        assert_eq!(err.field, "trace");
    }

    #[test]
    fn same_seed_same_verdicts_other_seed_differs() {
        let spec = RelayLinkSpec {
            bandwidth: Some(Bandwidth::from_mbit(20)),
            latency_ms: 30.0,
            jitter_ms: 4.0,
            loss: 0.05,
            gilbert_elliott: Some(GilbertElliottSpec {
                p_good_to_bad: 0.01,
                p_bad_to_good: 0.3,
                loss_good: 0.0,
                loss_bad: 0.6,
                step_ms: None,
            }),
            queue_ms: Some(20.0),
            ..RelayLinkSpec::default()
        };
        let run = |seed| offer(&mut shaper(&spec, seed), 3_000, 300_000, 1300);
        assert_eq!(run(11), run(11));
        assert_ne!(run(11), run(12));
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        #[test]
        fn deliveries_respect_latency_jitter_and_order(
            seed in 0u64..1000,
            mbit in 1u64..200,
            latency_ms in 0.0f64..100.0,
            jitter_ms in 0.0f64..20.0,
            jitter_reorders in proptest::bool::ANY,
            loss in 0.0f64..0.5,
            arrivals in proptest::collection::vec((0u64..2_000_000, 1usize..1500), 1..200),
        ) {
            let spec = RelayLinkSpec {
                bandwidth: Some(Bandwidth::from_mbit(mbit)),
                latency_ms,
                jitter_ms,
                jitter_reorders,
                loss,
                ..RelayLinkSpec::default()
            };
            let latency = (latency_ms * 1e6).round() as u64;
            let jitter = (jitter_ms * 1e6).round() as u64;
            let mut s = shaper(&spec, seed);
            let mut now = 0;
            let mut previous: Option<(u64, u64)> = None;
            for (gap, len) in arrivals {
                now += gap;
                if let Verdict::Deliver { at_ns } = s.on_datagram(now, len) {
                    let serialization = (len as u64 * 8_000).div_ceil(mbit);
                    prop_assert!(at_ns >= now + serialization + latency);
                    if let Some((_, previous_at)) = previous {
                        if jitter_reorders {
                            // Overtaking is bounded by the jitter.
                            prop_assert!(at_ns + jitter >= previous_at);
                        } else {
                            prop_assert!(at_ns >= previous_at, "order kept");
                        }
                    }
                    previous = Some((now, at_ns));
                }
            }
        }
    }
}
