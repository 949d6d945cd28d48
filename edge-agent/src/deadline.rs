//! Attempt deadlines: fixed per layer, or adapted to what the link and the aggregator
//! actually take.
//!
//! A fixed deadline cannot fit a machine, a link or a load it was not tuned for: too short and
//! every delta is weak-synced and retransmitted from the cache (the 32-edge cluster counted
//! 8,324 weak-sync events with 500 ms), too long and a lost delta waits for nothing. The
//! adaptive policy keeps, per layer and for the layer's current owner, the last `window`
//! delta→ack times (from the first transmission of a message to its ack, late acks of
//! weak-synced deltas included, so a deadline that is too short still learns the true time)
//! and gives each attempt
//!
//! `clamp(median + max(k · 1.4826 · MAD, median / 2), min, max)`
//!
//! — a robust "mean + k σ" (the median absolute deviation scaled to σ for a normal
//! distribution; medians so that an outage's few huge samples do not move it), with at least
//! half a median of slack for links whose times barely vary. Until `min_samples` acks are
//! known, the layer's configured deadline is used.

use std::collections::VecDeque;

/// How attempt deadlines are chosen.
#[derive(Clone, Debug, PartialEq)]
pub enum DeadlinePolicy {
    /// Every attempt gets the layer's configured deadline.
    Fixed,
    /// From observed delta→ack times (see the module docs).
    Adaptive(AdaptiveDeadline),
}

/// Parameters of [`DeadlinePolicy::Adaptive`].
#[derive(Clone, Debug, PartialEq)]
pub struct AdaptiveDeadline {
    /// Spread multiplier `k` (MADs, scaled to σ, above the median).
    pub k: f64,
    /// Lower bound, nanoseconds.
    pub min_ns: u64,
    /// Upper bound, nanoseconds.
    pub max_ns: u64,
    /// Samples kept per layer.
    pub window: usize,
    /// Samples needed before the estimate replaces the configured deadline.
    pub min_samples: usize,
}

impl Default for AdaptiveDeadline {
    fn default() -> Self {
        AdaptiveDeadline {
            k: 4.0,
            min_ns: 50_000_000,
            max_ns: 30_000_000_000,
            window: 32,
            min_samples: 1,
        }
    }
}

/// Recent delta→ack times of one layer (to its current owner).
#[derive(Clone, Debug, Default)]
pub struct AckTimes {
    samples: VecDeque<u64>,
}

impl AckTimes {
    /// Records one delta→ack time, keeping the newest `window`.
    pub fn record(&mut self, ns: u64, window: usize) {
        self.samples.push_back(ns);
        while self.samples.len() > window.max(1) {
            self.samples.pop_front();
        }
    }

    /// Forgets every sample (the layer moved to another aggregator).
    pub fn clear(&mut self) {
        self.samples.clear();
    }

    /// Number of samples held.
    pub fn len(&self) -> usize {
        self.samples.len()
    }

    /// Whether no sample is held.
    pub fn is_empty(&self) -> bool {
        self.samples.is_empty()
    }

    /// The deadline of the next attempt under `policy`, `configured_ns` when fixed or not yet
    /// known.
    pub fn deadline_ns(&self, policy: &DeadlinePolicy, configured_ns: u64) -> u64 {
        let DeadlinePolicy::Adaptive(a) = policy else {
            return configured_ns;
        };
        if self.samples.len() < a.min_samples.max(1) {
            return configured_ns;
        }
        let mut v: Vec<u64> = self.samples.iter().copied().collect();
        let median = median_of(&mut v) as f64;
        let mut dev: Vec<u64> = self
            .samples
            .iter()
            .map(|&s| (s as f64 - median).abs() as u64)
            .collect();
        let mad = median_of(&mut dev) as f64;
        let slack = (a.k * 1.4826 * mad).max(median / 2.0);
        let d = (median + slack).min(u64::MAX as f64) as u64;
        d.clamp(a.min_ns, a.max_ns.max(a.min_ns))
    }
}

/// The median of `v` (the upper one of an even count); `v` is reordered.
fn median_of(v: &mut [u64]) -> u64 {
    if v.is_empty() {
        return 0;
    }
    let mid = v.len() / 2;
    *v.select_nth_unstable(mid).1
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const MS: u64 = 1_000_000;

    fn adaptive() -> DeadlinePolicy {
        DeadlinePolicy::Adaptive(AdaptiveDeadline::default())
    }

    /// A client whose link takes `rtt` from a delta to its ack, trained for `steps` steps
    /// (one cut per step, acked `rtt` after each transmission); returns its weak-sync count and
    /// the deadline its next attempt would get.
    fn run_client(policy: DeadlinePolicy, rtt: u64, steps: u64) -> (u64, u64) {
        use crate::{ClientConfig, LayerInit, LayerSpec, Output, SyncClient};
        use protocol::{DeltaAck, Message};
        let spec = LayerSpec {
            layer_id: 0,
            name: "fc".into(),
            shape: vec![4],
            period_steps: 1,
            phase: 0,
            deadline_ns: 10 * MS,
            owner: 9,
            max_stale_steps: None,
            matrix_rows: None,
        };
        let config = ClientConfig {
            max_attempts: 2,
            flush_interval_ns: 0,
            deadline_policy: policy,
            ..ClientConfig::default()
        };
        let init = LayerInit {
            spec,
            values: vec![0.0; 4],
            version: 0,
        };
        let mut c = SyncClient::new(1, vec![init], config).unwrap();
        let mut now = 0u64;
        let mut acks: Vec<(u64, u64)> = Vec::new(); // (due, seq)
        let theta = [1.0f32; 4];
        for step in 1..=steps {
            let t = theta.map(|x| x * step as f32);
            c.on_step_end(now, step, 1, |_| &t[..]).unwrap();
            // 200 ms of virtual time per step, in 1 ms ticks.
            for _ in 0..200 {
                while let Some(out) = c.poll_output() {
                    match out {
                        Output::Send {
                            msg: Message::LayerDelta(p),
                            ..
                        } => acks.push((now + rtt, p.seq)),
                        Output::CachePut { entry } => c.cache_put_done(now, 0, entry.seq),
                        Output::CacheReplace { put, .. } => c.cache_put_done(now, 0, put.seq),
                        _ => {}
                    }
                }
                let due: Vec<u64> = acks.iter().filter(|a| a.0 <= now).map(|a| a.1).collect();
                acks.retain(|a| a.0 > now);
                for seq in due {
                    c.handle_message(
                        now,
                        Message::DeltaAck(DeltaAck {
                            node_id: 1,
                            layer_id: 0,
                            seq,
                            applied: true,
                            new_version: seq,
                        }),
                    );
                }
                if c.poll_timeout().is_some_and(|t| t <= now) {
                    c.handle_timeout(now);
                }
                now += MS;
            }
        }
        let d = c.attempt_deadline_ns(0).unwrap();
        (c.counters().weak_sync_events, d)
    }

    #[test]
    fn a_too_short_deadline_learns_the_link_and_stops_weak_syncing() {
        // Acks take 30 ms; the configured deadline is 10 ms, two attempts.
        let (fixed_weak, fixed_d) = run_client(DeadlinePolicy::Fixed, 30 * MS, 40);
        assert_eq!(fixed_d, 10 * MS);
        assert!(
            fixed_weak >= 35,
            "fixed: every delta is weak-synced ({fixed_weak})"
        );
        let (adaptive_weak, adaptive_d) = run_client(adaptive(), 30 * MS, 40);
        assert!(
            adaptive_weak <= 2,
            "adaptive learned the 30 ms link ({adaptive_weak})"
        );
        assert!(
            (40 * MS..=60 * MS).contains(&adaptive_d),
            "{} ms",
            adaptive_d / MS
        );
        // A fast link keeps the deadline near what it takes (here the 50 ms floor).
        let (_, fast_d) = run_client(adaptive(), 2 * MS, 20);
        assert_eq!(fast_d, 50 * MS);
    }

    #[test]
    fn fixed_and_unknown_use_the_configured_deadline() {
        let mut t = AckTimes::default();
        assert_eq!(t.deadline_ns(&adaptive(), 500 * MS), 500 * MS);
        for _ in 0..10 {
            t.record(20 * MS, 32);
        }
        assert_eq!(t.deadline_ns(&DeadlinePolicy::Fixed, 500 * MS), 500 * MS);
        // Identical samples: median + median/2, never the bare median.
        assert_eq!(t.deadline_ns(&adaptive(), 500 * MS), 50 * MS);
    }

    #[test]
    fn a_slow_link_grows_the_deadline_and_an_outage_sample_does_not_dominate() {
        let mut t = AckTimes::default();
        for i in 0..31 {
            t.record((1_800 + (i % 5) * 100) * MS, 32);
        }
        t.record(60_000 * MS, 32); // a late ack after an outage
        let d = t.deadline_ns(&adaptive(), 500 * MS);
        assert!(d > 2_000 * MS && d < 4_000 * MS, "{} ms", d / MS);
        // The window forgets old samples: a fast link again.
        for _ in 0..32 {
            t.record(30 * MS, 32);
        }
        assert_eq!(t.deadline_ns(&adaptive(), 500 * MS), 50 * MS, "the floor");
        t.clear();
        assert!(t.is_empty());
    }

    proptest! {
        #[test]
        fn the_deadline_stays_within_its_bounds_and_covers_the_median(
            samples in prop::collection::vec(1u64..100_000 * MS, 4..64),
        ) {
            let a = AdaptiveDeadline::default();
            let mut t = AckTimes::default();
            for &s in &samples {
                t.record(s, a.window);
            }
            let d = t.deadline_ns(&DeadlinePolicy::Adaptive(a.clone()), 500 * MS);
            prop_assert!(d >= a.min_ns && d <= a.max_ns);
            let mut kept: Vec<u64> = samples[samples.len().saturating_sub(a.window)..].to_vec();
            let median = median_of(&mut kept);
            prop_assert!(d >= median.min(a.max_ns));
        }
    }
}
