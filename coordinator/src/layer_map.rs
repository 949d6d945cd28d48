//! The layer → aggregator map, computed by rendezvous (highest-random-weight) hashing.
//!
//! Each layer goes to the aggregator with the highest score `h(layer_id, aggregator_id)`.
//! The map is a pure function of the aggregator set, so every coordinator computes the same
//! one, and a change moves only the layers that must move: when an aggregator joins, the
//! only layers that move are those it now wins; when one leaves, only its layers move.
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

/// The full map of `layers` over `aggregators` (empty when there is no aggregator).
pub fn assign_owners(layers: &[u32], aggregators: &[u64]) -> Owners {
    layers
        .iter()
        .filter_map(|&layer| owner_of(layer, aggregators.iter().copied()).map(|agg| (layer, agg)))
        .collect()
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

    #[test]
    fn no_aggregator_means_empty_map() {
        assert!(assign_owners(&[0, 1, 2], &[]).is_empty());
        assert_eq!(owner_of(3, []), None);
    }

    #[test]
    fn one_aggregator_owns_everything() {
        let owners = assign_owners(&[0, 1, 2, 7], &[42]);
        assert_eq!(owners.len(), 4);
        assert!(owners.values().all(|&agg| agg == 42));
    }

    #[test]
    fn the_map_is_pinned_across_builds() {
        // Fixed expectations: a change of the hash would silently reshuffle every
        // cluster's layers on upgrade, so it must show up here.
        assert_eq!(rendezvous_score(0, 0), mix64(mix64(0)));
        assert_eq!(mix64(0), 0xE220_A839_7B1D_CDAF);
        let owners = assign_owners(&(0..8).collect::<Vec<_>>(), &[1, 2, 3]);
        let again = assign_owners(&(0..8).collect::<Vec<_>>(), &[3, 1, 2]);
        assert_eq!(
            owners, again,
            "order of the aggregator list must not matter"
        );
    }

    #[test]
    fn load_spreads_over_aggregators() {
        let layers: Vec<u32> = (0..300).collect();
        let owners = assign_owners(&layers, &[10, 11, 12]);
        for agg in [10, 11, 12] {
            let n = owners.values().filter(|&&a| a == agg).count();
            assert!((60..=140).contains(&n), "aggregator {agg} owns {n} of 300");
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
        fn a_join_moves_only_layers_to_the_newcomer(
            aggs in proptest::collection::btree_set(0u64..1000, 1..6),
            newcomer in 1000u64..2000,
            n_layers in 1u32..64,
        ) {
            let layers: Vec<u32> = (0..n_layers).collect();
            let before: Vec<u64> = aggs.iter().copied().collect();
            let mut after = before.clone();
            after.push(newcomer);
            let old = assign_owners(&layers, &before);
            let new = assign_owners(&layers, &after);
            for m in moves(&layers, &old, &new) {
                prop_assert_eq!(m.to, Some(newcomer));
            }
        }

        #[test]
        fn a_leave_moves_only_the_leavers_layers(
            aggs in proptest::collection::btree_set(0u64..1000, 2..6),
            pick in any::<prop::sample::Index>(),
            n_layers in 1u32..64,
        ) {
            let layers: Vec<u32> = (0..n_layers).collect();
            let before: Vec<u64> = aggs.iter().copied().collect();
            let leaver = before[pick.index(before.len())];
            let after: Vec<u64> = before.iter().copied().filter(|&a| a != leaver).collect();
            let old = assign_owners(&layers, &before);
            let new = assign_owners(&layers, &after);
            let remaining: BTreeSet<u64> = after.iter().copied().collect();
            for m in moves(&layers, &old, &new) {
                prop_assert_eq!(m.from, Some(leaver));
                prop_assert!(m.to.is_some_and(|to| remaining.contains(&to)));
            }
            prop_assert!(new.values().all(|a| remaining.contains(a)));
            prop_assert_eq!(new.len(), layers.len());
        }
    }
}
