//! The delta ledger: the fate of every delta a node cut, so that the end of a run can check
//! the weak-sync invariant — every cut delta was applied by an aggregator exactly once, dropped
//! by one for staleness (its sender told to re-sync), merged into a coalesced cache entry, or is
//! still cached or in flight. Anything else is an *undelivered* delta, which must never happen.

use std::collections::BTreeMap;

/// Identifies one delta: (node index, layer id, seq).
pub type DeltaKey = (usize, u32, u64);

/// What became of a delta.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fate {
    /// Cut, not yet resolved.
    Outstanding,
    /// Folded into the global model by its aggregator.
    Applied,
    /// Dropped by the aggregator (too stale / unknown base); the sender was told to re-sync.
    Dropped,
    /// Coalesced into the cache entry with this seq (same node and layer).
    Merged(u64),
    /// Its node crashed while it was in flight and not yet in the durable cache (the same loss
    /// as the progress a crash takes with it); becomes `Applied` if a copy still arrives.
    LostInCrash,
}

/// One ledger entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Entry {
    /// Current fate.
    pub fate: Fate,
    /// Times an aggregator acknowledged it as applied (must stay ≤ 1).
    pub applied: u32,
    /// Whether it was weak-synced (missed its deadlines) at some point.
    pub weak: bool,
    /// Whether it was handed back to a restarted client from the durable cache.
    pub restored: bool,
}

/// Totals of the end-of-run check.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LedgerCheck {
    /// Deltas cut (coalesced entries included).
    pub cut: u64,
    /// Applied exactly once.
    pub applied: u64,
    /// Applied more than once (must be 0).
    pub applied_twice: u64,
    /// Dropped by an aggregator for staleness.
    pub dropped: u64,
    /// Lost with a crashed node before they became durable.
    pub lost_in_crash: u64,
    /// Still in a durable cache or in flight at the end.
    pub cached_or_in_flight: u64,
    /// Neither applied, dropped, cached nor in flight (must be 0).
    pub undelivered: u64,
    /// Weak-synced deltas (missed all their deadlines).
    pub weak: u64,
    /// Weak-synced deltas that were later applied.
    pub weak_applied: u64,
    /// Deltas handed back from a durable cache after a restart.
    pub restored: u64,
    /// Restored deltas applied exactly once.
    pub restored_applied: u64,
    /// Restored deltas the aggregator dropped for staleness.
    pub restored_dropped: u64,
}

/// The fate of every delta of a run.
#[derive(Clone, Debug, Default)]
pub struct Ledger {
    entries: BTreeMap<DeltaKey, Entry>,
}

impl Ledger {
    /// Records a delta the first time it is seen (a fresh send or a cache put of a new seq).
    pub fn cut(&mut self, key: DeltaKey) {
        self.entries.entry(key).or_insert(Entry {
            fate: Fate::Outstanding,
            applied: 0,
            weak: false,
            restored: false,
        });
    }

    fn get_mut(&mut self, key: DeltaKey) -> Option<&mut Entry> {
        self.entries.get_mut(&key)
    }

    /// An aggregator acknowledged the delta as applied.
    pub fn applied(&mut self, key: DeltaKey) {
        if let Some(e) = self.get_mut(key) {
            e.applied += 1;
            e.fate = Fate::Applied;
        }
    }

    /// An aggregator dropped the delta for staleness.
    pub fn dropped(&mut self, key: DeltaKey) {
        if let Some(e) = self.get_mut(key) {
            if e.fate != Fate::Applied {
                e.fate = Fate::Dropped;
            }
        }
    }

    /// The delta missed its deadlines and went to the cache.
    pub fn weak_synced(&mut self, key: DeltaKey) {
        if let Some(e) = self.get_mut(key) {
            e.weak = true;
        }
    }

    /// The delta was coalesced into `into`.
    pub fn merged(&mut self, key: DeltaKey, into: u64) {
        if let Some(e) = self.get_mut(key) {
            if e.fate == Fate::Outstanding {
                e.fate = Fate::Merged(into);
            }
        }
    }

    /// The delta's node crashed while it was in flight and not cached.
    pub fn lost_in_crash(&mut self, key: DeltaKey) {
        if let Some(e) = self.get_mut(key) {
            if e.fate == Fate::Outstanding {
                e.fate = Fate::LostInCrash;
            }
        }
    }

    /// The delta was handed back to a restarted client.
    pub fn restored(&mut self, key: DeltaKey) {
        if let Some(e) = self.get_mut(key) {
            e.restored = true;
        }
    }

    /// The entry of a delta.
    pub fn entry(&self, key: DeltaKey) -> Option<Entry> {
        self.entries.get(&key).copied()
    }

    /// Every entry, in key order.
    pub fn entries(&self) -> impl Iterator<Item = (DeltaKey, Entry)> + '_ {
        self.entries.iter().map(|(k, e)| (*k, *e))
    }

    /// Checks every entry; `still_held(key)` says whether a delta is still in a durable cache or
    /// in flight (in a client or in the network).
    pub fn check(&self, mut still_held: impl FnMut(DeltaKey) -> bool) -> LedgerCheck {
        let mut c = LedgerCheck::default();
        for (&key, e) in &self.entries {
            c.cut += 1;
            c.weak += u64::from(e.weak);
            c.restored += u64::from(e.restored);
            if e.applied > 1 {
                c.applied_twice += 1;
            }
            match e.fate {
                Fate::Applied => {
                    c.applied += u64::from(e.applied == 1);
                    c.weak_applied += u64::from(e.weak);
                    c.restored_applied += u64::from(e.restored && e.applied == 1);
                }
                Fate::Dropped => {
                    c.dropped += 1;
                    c.restored_dropped += u64::from(e.restored);
                }
                Fate::Merged(_) => {}
                Fate::LostInCrash => {
                    if still_held(key) {
                        c.cached_or_in_flight += 1;
                    } else {
                        c.lost_in_crash += 1;
                    }
                }
                Fate::Outstanding => {
                    if still_held(key) {
                        c.cached_or_in_flight += 1;
                    } else {
                        c.undelivered += 1;
                    }
                }
            }
        }
        c
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fates_are_counted_once_and_double_applies_flagged() {
        let mut l = Ledger::default();
        for seq in 1..=6 {
            l.cut((0, 0, seq));
        }
        l.applied((0, 0, 1));
        l.weak_synced((0, 0, 2));
        l.applied((0, 0, 2));
        l.dropped((0, 0, 3));
        l.merged((0, 0, 4), 6);
        l.applied((0, 0, 5));
        l.applied((0, 0, 5));
        // Seq 6 is held (cached); an unknown key is ignored.
        l.applied((9, 9, 9));
        let c = l.check(|k| k == (0, 0, 6));
        assert_eq!(c.cut, 6);
        assert_eq!(c.applied, 2);
        assert_eq!(c.applied_twice, 1);
        assert_eq!(c.dropped, 1);
        assert_eq!(c.cached_or_in_flight, 1);
        assert_eq!(c.undelivered, 0);
        assert_eq!((c.weak, c.weak_applied), (1, 1));
        // Nothing holds seq 6 any more: it is undelivered.
        assert_eq!(l.check(|_| false).undelivered, 1);
    }

    #[test]
    fn a_crash_loss_is_forgiven_only_if_nothing_arrives_later() {
        let mut l = Ledger::default();
        l.cut((1, 2, 7));
        l.lost_in_crash((1, 2, 7));
        assert_eq!(l.check(|_| false).lost_in_crash, 1);
        l.applied((1, 2, 7));
        let c = l.check(|_| false);
        assert_eq!((c.lost_in_crash, c.applied), (0, 1));
    }
}
