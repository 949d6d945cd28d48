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
//! A sender counts while its last delta of the layer arrived no longer ago than
//! [`GAP_FACTOR`] × the median of its last [`GAPS_KEPT`] gaps between deltas, and at least
//! [`MIN_WINDOW_NS`] (one minute). The floor is what keeps a fleet coming back from an
//! outage from being averaged as if each returning node were alone (measured: with a
//! one-second floor, three devices returning from a 20 s outage with their merged backlogs
//! took a small scenario from 82 % to 50 %); the gap term keeps slow nodes (a delta every
//! few minutes) counted between their deltas; the median keeps one long outage from
//! stretching the window afterwards. The price: a node that leaves for good still counts
//! for a minute, damping the others' progress for that long. Senders silent for
//! [`FORGET_AFTER_NS`] are forgotten (bounded memory under churn). Every rule reads only the
//! `now` the driver passes, so the simulator replays it exactly.

use std::collections::HashMap;

use crate::config::NodeId;

/// A sender counts while its silence is at most this many of its typical gaps ...
pub const GAP_FACTOR: u64 = 3;
/// Gaps kept per sender (their median is its typical gap).
pub const GAPS_KEPT: usize = 8;
/// ... and at least this long after its last delta (also the window of a sender with a
/// single delta so far). Long enough that nodes behind an outage of up to a minute still
/// count: when they return, their cached deltas are averaged with the others' instead of
/// each being applied as if its sender were alone.
pub const MIN_WINDOW_NS: u64 = 60_000_000_000;
/// Senders silent this long are forgotten.
pub const FORGET_AFTER_NS: u64 = 600_000_000_000;

#[derive(Clone, Debug, Default)]
struct Sender {
    /// When its last delta arrived; `None` for a sender known from a restored or handed-over
    /// ledger that has not been seen since (its first window starts when it is first looked
    /// at).
    last_ns: Option<u64>,
    /// The last gaps between this sender's deltas, oldest first.
    gaps: Vec<u64>,
    /// How long after its last delta it counts (from `gaps`, updated with them).
    window_ns: u64,
}

impl Sender {
    fn update_window(&mut self) {
        let mut sorted = self.gaps.clone();
        sorted.sort_unstable();
        let median = sorted.get(sorted.len() / 2).copied().unwrap_or(0);
        self.window_ns = median.saturating_mul(GAP_FACTOR).max(MIN_WINDOW_NS);
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
        let s = self.sender(from);
        if let Some(last) = s.last_ns {
            if s.gaps.len() == GAPS_KEPT {
                s.gaps.remove(0);
            }
            s.gaps.push(now.saturating_sub(last));
            s.update_window();
        }
        s.last_ns = Some(now);
    }

    /// `from` is known to contribute to the layer (its ledger entry survived a restart or came
    /// with a hand-over), so the first rounds after a restart are not applied as if their
    /// senders were alone; it counts for a first window from when the count is next taken.
    pub fn seed(&mut self, from: NodeId) {
        self.sender(from);
    }

    fn sender(&mut self, from: NodeId) -> &mut Sender {
        self.senders.entry(from).or_insert_with(|| Sender {
            window_ns: MIN_WINDOW_NS,
            ..Sender::default()
        })
    }

    /// The senders contributing at `now`, never fewer than `at_least` (the distinct senders
    /// of the round being applied, who are contributing by definition). Forgets senders
    /// silent for [`FORGET_AFTER_NS`] (and longer than their window).
    pub fn active(&mut self, now: u64, at_least: usize) -> usize {
        let mut active = 0;
        self.senders.retain(|_, s| {
            let silence = now.saturating_sub(*s.last_ns.get_or_insert(now));
            active += usize::from(silence <= s.window_ns);
            silence < FORGET_AFTER_NS.max(s.window_ns)
        });
        active.max(at_least)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const S: u64 = 1_000_000_000;

    #[test]
    fn steady_senders_all_count_and_a_silent_one_drops_out_after_three_gaps() {
        // Slow nodes: a delta every 30 s, so the gap term (90 s) is above the floor.
        let mut c = Contributors::default();
        for step in 1..=10u64 {
            for node in 0..4 {
                c.record(node, step * 30 * S + node * 100_000);
            }
        }
        assert_eq!(c.active(300 * S + S, 1), 4);
        // Node 3 goes quiet; the others keep their rhythm. After 3 gaps it no longer counts.
        for step in 11..=14u64 {
            for node in 0..3 {
                c.record(node, step * 30 * S + node * 100_000);
            }
        }
        assert_eq!(c.active(389 * S, 1), 4);
        assert_eq!(c.active(391 * S, 1), 3);
        // It comes back: counted again at once.
        c.record(3, 421 * S);
        assert_eq!(c.active(421 * S, 1), 4);
    }

    #[test]
    fn fast_senders_count_for_the_one_minute_floor() {
        let mut c = Contributors::default();
        for step in 1..=8u64 {
            c.record(5, step * S);
        }
        assert_eq!(c.active(8 * S + MIN_WINDOW_NS, 0), 1);
        assert_eq!(c.active(8 * S + MIN_WINDOW_NS + 1, 0), 0);
    }

    #[test]
    fn one_long_outage_does_not_stretch_the_window() {
        let mut c = Contributors::default();
        for step in 1..=8u64 {
            c.record(7, step * 30 * S);
        }
        c.record(7, 2000 * S); // back after a long outage
        c.record(7, 2030 * S);
        // Median gap still 30 s: silent for 100 s, no longer counted.
        assert_eq!(c.active(2130 * S, 0), 0);
        assert_eq!(c.active(2110 * S, 0), 1);
    }

    #[test]
    fn first_deltas_count_for_the_floor_and_idle_senders_are_forgotten() {
        let mut c = Contributors::default();
        c.record(1, 0);
        assert_eq!(c.active(MIN_WINDOW_NS, 0), 1);
        assert_eq!(c.active(MIN_WINDOW_NS + 1, 0), 0);
        c.record(2, FORGET_AFTER_NS + 10);
        assert_eq!(c.active(FORGET_AFTER_NS + 10, 0), 1);
        assert_eq!(c.senders.len(), 1);
        // Seeded from a ledger: counted from when the count is next taken, for one window.
        c.seed(3);
        assert_eq!(c.active(FORGET_AFTER_NS + 20, 0), 2);
        assert_eq!(c.active(FORGET_AFTER_NS + 21 + MIN_WINDOW_NS, 0), 0);
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
