//! Who is contributing to a layer now: the count behind the self-normalizing outer learning
//! rate ([`crate::OuterLrScaling::Contributors`]).
//!
//! ## Why the count
//!
//! Synchronous model averaging over `N` nodes moves the global model once per period by the
//! *mean* of their deltas: `θ ← θ + (1/N) Σ Δᵢ`. An asynchronous aggregator that adds every
//! delta on arrival with a fixed `η` moves it, over the same period, by `η Σ Δᵢ`: the *sum*
//! when `η = 1`, so `η` had to be set by hand to about `1/N`, and was wrong as soon as nodes
//! joined, left or lost their links. With `Contributors` a round of `k` distinct senders is
//! applied with `η · k / N_active`, where `N_active` is the number of nodes contributing to
//! this layer now. When each of the `N_active` nodes sends one delta per period, the
//! period's updates add up to `η` times the (staleness- and sample-weighted) mean of their
//! deltas, as synchronous averaging would — however many nodes there are, and with
//! `round_size = N` (everyone in one round) it is exactly the synchronous rule. A node in an
//! outage stops counting, so the others' deltas move the model at the pace of the nodes that
//! are actually training (FedAvg's "proceed with whoever arrived"); its cached deltas count
//! it again when they arrive.
//!
//! ## When a node counts
//!
//! A sender counts while its last applied-or-pending delta of the layer arrived no longer
//! ago than [`GAP_FACTOR`] × the median of its last [`GAPS_KEPT`] gaps between deltas
//! (at least [`MIN_WINDOW_NS`]); before it has a gap, for [`FIRST_WINDOW_NS`]. The median
//! keeps one long outage from stretching its window afterwards. Senders silent for
//! [`FORGET_AFTER_NS`] are forgotten (bounded memory under churn). Every rule reads only the
//! `now` the driver passes, so the simulator replays it exactly.

use std::collections::HashMap;

use crate::config::NodeId;

/// A sender counts while its silence is at most this many of its typical gaps.
pub const GAP_FACTOR: u64 = 3;
/// Gaps kept per sender (their median is its typical gap).
pub const GAPS_KEPT: usize = 8;
/// The shortest window a sender counts for after its last delta (fast nodes' gaps are
/// milliseconds; one late delta must not drop them).
pub const MIN_WINDOW_NS: u64 = 1_000_000_000;
/// How long a sender with a single delta so far counts for.
pub const FIRST_WINDOW_NS: u64 = 30_000_000_000;
/// Senders silent this long are forgotten.
pub const FORGET_AFTER_NS: u64 = 600_000_000_000;

#[derive(Clone, Debug, Default)]
struct Sender {
    last_ns: u64,
    /// The last gaps between this sender's deltas, oldest first.
    gaps: Vec<u64>,
}

impl Sender {
    fn window(&self) -> u64 {
        if self.gaps.is_empty() {
            return FIRST_WINDOW_NS;
        }
        let mut sorted = self.gaps.clone();
        sorted.sort_unstable();
        let median = sorted[sorted.len() / 2];
        median.saturating_mul(GAP_FACTOR).max(MIN_WINDOW_NS)
    }
}

/// The senders of one layer and when they last contributed.
#[derive(Clone, Debug, Default)]
pub struct Contributors {
    senders: HashMap<NodeId, Sender>,
}

impl Contributors {
    /// A delta of `from` arrived at `now` (ns) and joined the layer's round.
    pub fn record(&mut self, from: NodeId, now: u64) {
        let s = self.senders.entry(from).or_default();
        if s.last_ns > 0 || !s.gaps.is_empty() {
            let gap = now.saturating_sub(s.last_ns);
            if s.gaps.len() == GAPS_KEPT {
                s.gaps.remove(0);
            }
            s.gaps.push(gap);
        }
        // `last_ns = 0` marks "no delta yet"; a delta at time 0 is recorded as at 1 ns.
        s.last_ns = now.max(1);
        self.senders
            .retain(|_, s| now.saturating_sub(s.last_ns) < FORGET_AFTER_NS);
    }

    /// The senders contributing at `now`, never fewer than `at_least` (the distinct senders
    /// of the round being applied, who are contributing by definition).
    pub fn active(&self, now: u64, at_least: usize) -> usize {
        self.senders
            .values()
            .filter(|s| now.saturating_sub(s.last_ns) <= s.window())
            .count()
            .max(at_least)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const S: u64 = 1_000_000_000;

    #[test]
    fn steady_senders_all_count_and_a_silent_one_drops_out() {
        let mut c = Contributors::default();
        for step in 1..=10u64 {
            for node in 0..4 {
                c.record(node, step * 2 * S + node * 100_000);
            }
        }
        assert_eq!(c.active(20 * S + S, 1), 4);
        // Node 3 goes quiet; the others keep their 2 s rhythm. After 3 gaps it no longer
        // counts.
        for step in 11..=14u64 {
            for node in 0..3 {
                c.record(node, step * 2 * S + node * 100_000);
            }
        }
        assert_eq!(c.active(28 * S + S, 1), 3);
        // It comes back: counted again at once.
        c.record(3, 29 * S);
        assert_eq!(c.active(29 * S, 1), 4);
    }

    #[test]
    fn one_long_outage_does_not_stretch_the_window() {
        let mut c = Contributors::default();
        for step in 1..=8u64 {
            c.record(7, step * S);
        }
        c.record(7, 200 * S); // back after a long outage
        c.record(7, 201 * S);
        // Median gap still 1 s: silent for 4 s, no longer counted.
        assert_eq!(c.active(205 * S, 0), 0);
        assert_eq!(c.active(203 * S, 0), 1);
    }

    #[test]
    fn first_deltas_count_for_the_first_window_and_idle_senders_are_forgotten() {
        let mut c = Contributors::default();
        c.record(1, 0);
        assert_eq!(c.active(FIRST_WINDOW_NS, 0), 1);
        assert_eq!(c.active(FIRST_WINDOW_NS + 2, 0), 0);
        c.record(2, FORGET_AFTER_NS + 10);
        assert_eq!(c.senders.len(), 1);
    }

    proptest! {
        #[test]
        fn the_count_is_bounded_by_the_senders_and_the_round(
            arrivals in proptest::collection::vec((0u64..20, 0u64..1_000_000_000_000), 0..200),
            at in 0u64..2_000_000_000_000,
            at_least in 0usize..5,
        ) {
            let mut c = Contributors::default();
            let mut sorted = arrivals.clone();
            sorted.sort_by_key(|&(_, t)| t);
            for (node, t) in sorted {
                c.record(node, t);
            }
            let n = c.active(at, at_least);
            prop_assert!(n >= at_least);
            prop_assert!(n <= c.senders.len().max(at_least));
        }
    }
}
