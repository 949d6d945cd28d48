//! The layer → aggregator map: rendezvous (highest-random-weight) hashing with bounded
//! loads, balanced by bytes.
//!
//! Each layer prefers the aggregators in the order of their score `h(layer_id,
//! aggregator_id)`. Layers are placed largest first, each on its most preferred aggregator
//! whose bytes stay within a cap of `(1 + ε)` times the fair share (consistent hashing with
//! bounded loads, Mirrokni, Thorup and Zadimoghaddam, SODA 2018), or, when none has room,
//! on the least loaded. With equal small layers far from the cap this is plain rendezvous
//! hashing (a join moves only the layers the newcomer wins, a leave only the leaver's);
//! with a few large layers it keeps one aggregator from holding most of the model's bytes,
//! at the price of a few more moves when the set changes. The map is a pure function of
//! the layers' sizes and the aggregator set, so every coordinator computes the same one.
//! The hash is SplitMix64 mixing written out here, so the map is identical on every
//! platform and Rust version (unlike `std`'s `DefaultHasher`).

use std::collections::BTreeMap;

/// `layer_id → owning aggregator id`.
pub type Owners = BTreeMap<u32, u64>;

/// A layer whose owner changed between two maps.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct LayerMove {
    /// The layer.
    pub layer_id: u32,
    /// Its previous owner (`None`: it had none, e.g. no aggregator was live).
    pub from: Option<u64>,
    /// Its new owner (`None`: no aggregator is live any more).
    pub to: Option<u64>,
}

/// SplitMix64's finalizer: a bijective, well-mixing `u64 → u64`.
fn mix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Rendezvous score of `aggregator_id` for `layer_id` (higher wins).
pub fn rendezvous_score(layer_id: u32, aggregator_id: u64) -> u64 {
    mix64(mix64(u64::from(layer_id)) ^ aggregator_id)
}

/// The aggregator that owns `layer_id` among `aggregators` (`None` when there is none).
/// Ties (practically impossible) go to the smaller aggregator id.
pub fn owner_of(layer_id: u32, aggregators: impl IntoIterator<Item = u64>) -> Option<u64> {
    aggregators
        .into_iter()
        .max_by_key(|&agg| (rendezvous_score(layer_id, agg), std::cmp::Reverse(agg)))
}

/// How far above the fair share (total bytes / aggregators) an aggregator may be filled
/// before a layer goes to its next preferred aggregator.
pub const LOAD_SLACK: f64 = 0.15;

/// The full map of `layers` (`(layer_id, bytes)`) over `aggregators`, balanced by bytes
/// (see the [module docs](self)); empty when there is no aggregator.
pub fn assign_owners(layers: &[(u32, u64)], aggregators: &[u64]) -> Owners {
    let mut aggs: Vec<u64> = aggregators.to_vec();
    aggs.sort_unstable();
    aggs.dedup();
    if aggs.is_empty() {
        return Owners::new();
    }
    let total: u64 = layers.iter().map(|&(_, b)| b).sum();
    let largest = layers.iter().map(|&(_, b)| b).max().unwrap_or(0);
    let share = total as f64 / aggs.len() as f64;
    let cap = ((1.0 + LOAD_SLACK) * share).ceil().max(largest as f64) as u64;
    let mut order: Vec<(u32, u64)> = layers.to_vec();
    order.sort_unstable_by_key(|&(id, bytes)| (std::cmp::Reverse(bytes), id));
    order.dedup_by_key(|&mut (id, _)| id);
    let mut load: BTreeMap<u64, u64> = aggs.iter().map(|&a| (a, 0)).collect();
    let mut owners = Owners::new();
    for (layer, bytes) in order {
        let mut preferred = aggs.clone();
        preferred.sort_unstable_by_key(|&a| (std::cmp::Reverse(rendezvous_score(layer, a)), a));
        let fits = preferred.iter().copied().find(|a| load[a] + bytes <= cap);
        let owner = fits.unwrap_or_else(|| {
            // Nobody has room: the least loaded (ties: the most preferred).
            preferred
                .iter()
                .copied()
                .enumerate()
                .min_by_key(|&(rank, a)| (load[&a], rank))
                .map_or(preferred[0], |(_, a)| a)
        });
        *load.entry(owner).or_insert(0) += bytes;
        owners.insert(layer, owner);
    }
    owners
}

/// Layers of `layers` whose owner differs between `old` and `new`, in layer order.
pub fn moves(layers: &[u32], old: &Owners, new: &Owners) -> Vec<LayerMove> {
    layers
        .iter()
        .filter_map(|&layer_id| {
            let from = old.get(&layer_id).copied();
            let to = new.get(&layer_id).copied();
            (from != to).then_some(LayerMove { layer_id, from, to })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeSet;

    fn equal(n: u32) -> Vec<(u32, u64)> {
        (0..n).map(|id| (id, 100)).collect()
    }

    /// Bytes each aggregator of `owners` holds (`sizes`: `layer_id → bytes`).
    fn loads(owners: &Owners, sizes: &BTreeMap<u32, u64>) -> BTreeMap<u64, u64> {
        let mut out = BTreeMap::new();
        for (layer, agg) in owners {
            *out.entry(*agg).or_insert(0) += sizes.get(layer).copied().unwrap_or(0);
        }
        out
    }

    fn sizes(layers: &[(u32, u64)]) -> BTreeMap<u32, u64> {
        layers.iter().copied().collect()
    }

    #[test]
    fn no_aggregator_means_empty_map() {
        assert!(assign_owners(&equal(3), &[]).is_empty());
        assert_eq!(owner_of(3, []), None);
    }

    #[test]
    fn one_aggregator_owns_everything() {
        let owners = assign_owners(&equal(4), &[42]);
        assert_eq!(owners.len(), 4);
        assert!(owners.values().all(|&agg| agg == 42));
    }

    #[test]
    fn the_map_is_pinned_across_builds() {
        // Fixed expectations: a change of the hash would silently reshuffle every
        // cluster's layers on upgrade, so it must show up here.
        assert_eq!(rendezvous_score(0, 0), mix64(mix64(0)));
        assert_eq!(mix64(0), 0xE220_A839_7B1D_CDAF);
        let owners = assign_owners(&equal(8), &[1, 2, 3]);
        let again = assign_owners(&equal(8), &[3, 1, 2]);
        assert_eq!(
            owners, again,
            "order of the aggregator list must not matter"
        );
    }

    #[test]
    fn load_spreads_over_aggregators() {
        let owners = assign_owners(&equal(300), &[10, 11, 12]);
        for agg in [10, 11, 12] {
            let n = owners.values().filter(|&&a| a == agg).count();
            assert!((60..=115).contains(&n), "aggregator {agg} owns {n} of 300");
        }
    }

    #[test]
    fn the_chunks_of_a_large_layer_are_balanced_by_bytes_over_two_aggregators() {
        // The MNIST mlp with `sync_unit_kb = 512`: fc1 (1.6 MB) as 4 chunks, fc2 (0.5 MB),
        // the head (20 kB). Plain rendezvous hashing can put 3 or 4 chunks on one side.
        let layers = [
            (0, 401_408),
            (1, 401_408),
            (2, 401_408),
            (3, 401_408),
            (4, 525_312),
            (5, 20_520),
        ];
        for aggs in [[1, 2], [7, 9], [100, 3]] {
            let owners = assign_owners(&layers, &aggs);
            let load = loads(&owners, &sizes(&layers));
            let total: u64 = layers.iter().map(|l| l.1).sum();
            for (agg, bytes) in &load {
                assert!(
                    *bytes as f64 <= (1.0 + LOAD_SLACK) * total as f64 / 2.0,
                    "aggregator {agg} holds {bytes} of {total}: {owners:?}"
                );
            }
        }
    }

    #[test]
    fn moves_lists_changed_layers_only() {
        let old: Owners = [(0, 1), (1, 1), (2, 2)].into();
        let new: Owners = [(0, 1), (1, 3)].into();
        assert_eq!(
            moves(&[0, 1, 2], &old, &new),
            vec![
                LayerMove {
                    layer_id: 1,
                    from: Some(1),
                    to: Some(3)
                },
                LayerMove {
                    layer_id: 2,
                    from: Some(2),
                    to: None
                },
            ]
        );
    }

    proptest! {
        #[test]
        fn every_layer_has_a_live_owner_and_no_aggregator_is_far_above_its_share(
            aggs in proptest::collection::btree_set(0u64..1000, 1..6),
            sizes_in in proptest::collection::vec(1u64..1_000_000, 1..40),
        ) {
            let layers: Vec<(u32, u64)> =
                sizes_in.iter().enumerate().map(|(i, &b)| (i as u32, b)).collect();
            let aggs: Vec<u64> = aggs.into_iter().collect();
            let owners = assign_owners(&layers, &aggs);
            prop_assert_eq!(owners.len(), layers.len());
            prop_assert!(owners.values().all(|a| aggs.contains(a)));
            let total: u64 = layers.iter().map(|l| l.1).sum();
            let largest = layers.iter().map(|l| l.1).max().unwrap_or(0);
            let share = total as f64 / aggs.len() as f64;
            let bound = ((1.0 + LOAD_SLACK) * share).max(share + largest as f64);
            for (agg, bytes) in loads(&owners, &sizes(&layers)) {
                prop_assert!(bytes as f64 <= bound + 1.0, "{} holds {} (bound {})", agg, bytes, bound);
            }
        }

        #[test]
        fn with_equal_small_layers_a_join_moves_only_layers_to_the_newcomer(
            aggs in proptest::collection::btree_set(0u64..1000, 1..6),
            newcomer in 1000u64..2000,
            n_layers in 1u32..64,
        ) {
            let layers = equal(n_layers);
            let ids: Vec<u32> = (0..n_layers).collect();
            let before: Vec<u64> = aggs.iter().copied().collect();
            let mut after = before.clone();
            after.push(newcomer);
            let old = assign_owners(&layers, &before);
            let new = assign_owners(&layers, &after);
            // Equal layers may still hit the cap; only an uncapped map is plain rendezvous.
            let cap = ((1.0 + LOAD_SLACK) * f64::from(n_layers) * 100.0 / after.len() as f64).ceil() as u64;
            let uncapped = |o: &Owners, aggs: &[u64]| {
                o.iter().all(|(&l, &a)| owner_of(l, aggs.iter().copied()) == Some(a))
            };
            if cap > 0 && uncapped(&old, &before) && uncapped(&new, &after) {
                for m in moves(&ids, &old, &new) {
                    prop_assert_eq!(m.to, Some(newcomer));
                }
            }
        }

        #[test]
        fn a_leave_gives_every_layer_a_remaining_owner(
            aggs in proptest::collection::btree_set(0u64..1000, 2..6),
            pick in any::<prop::sample::Index>(),
            n_layers in 1u32..64,
        ) {
            let layers = equal(n_layers);
            let before: Vec<u64> = aggs.iter().copied().collect();
            let leaver = before[pick.index(before.len())];
            let after: Vec<u64> = before.iter().copied().filter(|&a| a != leaver).collect();
            let new = assign_owners(&layers, &after);
            let remaining: BTreeSet<u64> = after.iter().copied().collect();
            prop_assert!(new.values().all(|a| remaining.contains(a)));
            prop_assert_eq!(new.len(), layers.len());
        }
    }
}
