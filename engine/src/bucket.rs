//! Buckets: adjacent small layers with the same schedule packed together, large layers alone.
//!
//! Like PyTorch DDP, sync units are walked in **backward** order (the order their gradients
//! become ready) and adjacent units are packed into one bucket, so one collective carries
//! several small layers. A bucket is closed when the next unit
//!
//! * has a different schedule key (e.g. another DreamDDP phase set or another period), or
//! * would push the bucket over its cap: [`BucketCaps::first_cap_bytes`] (~1 MiB) for the very
//!   first bucket, so communication starts early in backward, then [`BucketCaps::cap_bytes`]
//!   (~25 MiB), or
//! * is larger than [`BucketCaps::alone_over_bytes`] (~10 MiB): such a unit gets a bucket of
//!   its own.
//!
//! A single unit larger than the cap (but not over `alone_over_bytes`) still forms a bucket by
//! itself. Sizes count 4 bytes per f32 parameter.

use crate::model::LayerInfo;

/// One MiB.
pub const MIB: usize = 1 << 20;

/// Bytes per parameter on the wire (f32).
pub const BYTES_PER_PARAM: usize = 4;

/// Size limits of buckets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BucketCaps {
    /// Cap of the first bucket (PyTorch DDP: 1 MiB).
    pub first_cap_bytes: usize,
    /// Cap of every later bucket (PyTorch DDP: 25 MiB).
    pub cap_bytes: usize,
    /// Units larger than this always get a bucket of their own.
    pub alone_over_bytes: usize,
}

impl Default for BucketCaps {
    fn default() -> Self {
        Self {
            first_cap_bytes: MIB,
            cap_bytes: 25 * MIB,
            alone_over_bytes: 10 * MIB,
        }
    }
}

/// A group of sync units communicated together.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Bucket {
    /// Position of the bucket in backward order (0 = the first to be sent).
    pub id: usize,
    /// Its units in backward order, by the `index` of the [`LayerInfo`]s it was packed from
    /// (a [`crate::plan::SyncPlan`]'s buckets: unit ids, [`crate::plan::UnitPlan::id`]).
    pub units: Vec<usize>,
    /// Total f32 parameters of the bucket.
    pub params: usize,
}

impl Bucket {
    /// Size on the wire in bytes.
    pub fn bytes(&self) -> usize {
        self.params * BYTES_PER_PARAM
    }
}

/// Packs `units_backward` (sync units in backward order) into buckets. `schedule_key(index)`
/// gives the schedule of the unit with model layer index `index` (a phase, a set of phases, a
/// `(period, phases)` pair …); only units with equal keys share a bucket.
pub fn make_buckets<K: PartialEq>(
    units_backward: &[LayerInfo],
    schedule_key: impl Fn(usize) -> K,
    caps: &BucketCaps,
) -> Vec<Bucket> {
    let mut buckets: Vec<Bucket> = Vec::new();
    let mut open: Option<(Bucket, K)> = None;
    for unit in units_backward {
        let bytes = unit.params * BYTES_PER_PARAM;
        let key = schedule_key(unit.index);
        if bytes > caps.alone_over_bytes {
            close(&mut open, &mut buckets);
            open = Some((
                Bucket {
                    id: 0,
                    units: vec![unit.index],
                    params: unit.params,
                },
                key,
            ));
            close(&mut open, &mut buckets);
            continue;
        }
        if let Some((bucket, open_key)) = &open {
            let cap = if buckets.is_empty() {
                caps.first_cap_bytes
            } else {
                caps.cap_bytes
            };
            if *open_key != key || bucket.bytes() + bytes > cap {
                close(&mut open, &mut buckets);
            }
        }
        match &mut open {
            Some((bucket, _)) => {
                bucket.units.push(unit.index);
                bucket.params += unit.params;
            }
            None => {
                open = Some((
                    Bucket {
                        id: 0,
                        units: vec![unit.index],
                        params: unit.params,
                    },
                    key,
                ));
            }
        }
    }
    close(&mut open, &mut buckets);
    buckets
}

/// Moves the open bucket (if any) to the finished list, numbering it.
fn close<K>(open: &mut Option<(Bucket, K)>, buckets: &mut Vec<Bucket>) {
    if let Some((mut bucket, _)) = open.take() {
        bucket.id = buckets.len();
        buckets.push(bucket);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Units in backward order with the given parameter counts; model index = position reversed.
    fn units(params: &[usize]) -> Vec<LayerInfo> {
        let n = params.len();
        params
            .iter()
            .enumerate()
            .map(|(j, &p)| LayerInfo {
                index: 2 * (n - 1 - j), // non-contiguous indices, like activations in between
                name: format!("l{j}"),
                kind: "linear",
                params: p,
            })
            .collect()
    }

    const K: usize = 1024 / BYTES_PER_PARAM; // params per KiB

    #[test]
    fn small_layers_with_one_phase_share_buckets_and_the_first_is_small() {
        // 300 KiB each: first bucket holds 3 (900 KiB ≤ 1 MiB), later ones up to 25 MiB.
        let u = units(&[300 * K; 10]);
        let b = make_buckets(&u, |_| 0u64, &BucketCaps::default());
        assert_eq!(b.len(), 2);
        assert_eq!(b[0].units, vec![18, 16, 14]);
        assert_eq!(b[1].units, vec![12, 10, 8, 6, 4, 2, 0]);
        assert_eq!(b[1].params, 7 * 300 * K);
        assert_eq!((b[0].id, b[1].id), (0, 1));
    }

    #[test]
    fn different_phases_never_share_a_bucket() {
        let u = units(&[10, 10, 10, 10]);
        // index → phase: 6,4 → phase 0; 2 → phase 1; 0 → phase 0.
        let b = make_buckets(&u, |i| u64::from(i == 2), &BucketCaps::default());
        let layers: Vec<_> = b.iter().map(|b| b.units.clone()).collect();
        assert_eq!(layers, vec![vec![6, 4], vec![2], vec![0]]);
    }

    #[test]
    fn big_layers_go_alone() {
        let big = 11 * MIB / BYTES_PER_PARAM;
        let u = units(&[10, big, 10, 10]);
        let b = make_buckets(&u, |_| 0u64, &BucketCaps::default());
        let layers: Vec<_> = b.iter().map(|b| b.units.clone()).collect();
        assert_eq!(layers, vec![vec![6], vec![4], vec![2, 0]]);
        assert_eq!(b[1].bytes(), 11 * MIB);
    }

    #[test]
    fn a_layer_over_the_cap_but_under_alone_forms_its_own_bucket() {
        let caps = BucketCaps {
            first_cap_bytes: 100,
            cap_bytes: 200,
            alone_over_bytes: 1000,
        };
        // bytes: 40, 240, 80, 80, 80 → [40] (240 would overflow 100), [240], [80, 80], [80].
        let u = units(&[10, 60, 20, 20, 20]);
        let b = make_buckets(&u, |_| (), &caps);
        let sizes: Vec<_> = b.iter().map(Bucket::bytes).collect();
        assert_eq!(sizes, vec![40, 240, 160, 80]);
    }

    #[test]
    fn no_units_no_buckets() {
        assert!(make_buckets(&[], |_| 0u64, &BucketCaps::default()).is_empty());
    }

    proptest! {
        #[test]
        fn buckets_partition_units_in_order(
            params in prop::collection::vec(1usize..4_000_000, 0..30),
            phases in prop::collection::vec(0u64..3, 30),
        ) {
            let u = units(&params);
            let key = |i: usize| phases[i / 2];
            let caps = BucketCaps::default();
            let b = make_buckets(&u, key, &caps);
            let flat: Vec<usize> = b.iter().flat_map(|b| b.units.iter().copied()).collect();
            let expected: Vec<usize> = u.iter().map(|l| l.index).collect();
            prop_assert_eq!(flat, expected);
            for (id, bucket) in b.iter().enumerate() {
                prop_assert_eq!(bucket.id, id);
                prop_assert!(!bucket.units.is_empty());
                let k0 = key(bucket.units[0]);
                prop_assert!(bucket.units.iter().all(|&i| key(i) == k0));
                let cap = if id == 0 { caps.first_cap_bytes } else { caps.cap_bytes };
                prop_assert!(bucket.units.len() == 1 || bucket.bytes() <= cap);
                let sum: usize = u.iter().filter(|l| bucket.units.contains(&l.index))
                    .map(|l| l.params).sum();
                prop_assert_eq!(sum, bucket.params);
            }
        }
    }
}
