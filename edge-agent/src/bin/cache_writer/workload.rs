//! The deterministic write workload of the `kill -9` test, shared by the `cache_writer`
//! helper binary (which performs it) and `tests/kill9.rs` (which predicts the cache
//! contents from it): operation `index` of round `round` is always the same.
//!
//! Three layers take turns; each layer repeats the cycle put, put, put, replace (the three
//! puts coalesced into one bundle with the next seq), like the weak-sync cache of a layer
//! whose link is down. Deltas range from a few floats to 80 KB, so both small sled values
//! and large (blob) values are exercised.

use edge_agent::CacheEntry;

/// Layers the workload writes to.
pub const LAYERS: u64 = 3;
/// Seqs of one round lie in `[round * SEQS_PER_ROUND, (round + 1) * SEQS_PER_ROUND)`.
pub const SEQS_PER_ROUND: u64 = 1_000_000;

/// One cache operation.
#[derive(Clone, Debug, PartialEq)]
pub enum CacheOp {
    /// `put_durable(entry)`.
    Put(CacheEntry),
    /// `replace(layer_id, remove, put)`.
    Replace {
        /// Layer.
        layer_id: u32,
        /// Seqs coalesced.
        remove: Vec<u64>,
        /// The bundle.
        put: CacheEntry,
    },
}

/// Operation `index` of round `round`.
pub fn op(round: u64, index: u64) -> CacheOp {
    let layer_id = (index % LAYERS) as u32;
    let k = index / LAYERS;
    let cycle_base = round * SEQS_PER_ROUND + (k / 4) * 4;
    match k % 4 {
        pos @ 0..=2 => CacheOp::Put(entry(layer_id, cycle_base + pos)),
        _ => CacheOp::Replace {
            layer_id,
            remove: vec![cycle_base, cycle_base + 1, cycle_base + 2],
            put: entry(layer_id, cycle_base + 3),
        },
    }
}

/// The entry the workload writes for `(layer_id, seq)`.
pub fn entry(layer_id: u32, seq: u64) -> CacheEntry {
    let h = mix(seq ^ (u64::from(layer_id) << 40));
    let len = if h & 7 == 0 {
        20_000
    } else {
        1 + (h >> 8) as usize % 3_000
    };
    let scale = (h >> 32) as f32 / u32::MAX as f32 + 0.5;
    CacheEntry {
        layer_id,
        seq,
        base_version: seq / 4,
        sample_count: 64 + h % 64,
        step: seq * 2,
        delta: (0..len).map(|i| (i as f32 - 100.0) * scale).collect(),
    }
}

/// splitmix64 finalizer.
fn mix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}
