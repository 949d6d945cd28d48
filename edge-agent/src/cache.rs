//! Weak-sync cache entries: a delta that missed its deadline (or was cut while the layer
//! had a backlog), kept durably by the driver until the aggregator acknowledges it.
//!
//! The state machine only says what to store ([`crate::Output::CachePut`], ...); the driver
//! stores it (sled in the real system, memory in the simulator). [`CacheEntry::to_bytes`]
//! and [`CacheEntry::from_bytes`] give a checksummed encoding, and [`CacheEntry::key`] a
//! key that sorts by `(layer, seq)`.
//!
//! Layout (little-endian): magic `DDC1` · layer_id u32 · seq u64 · base_version u64 ·
//! sample_count u64 · step u64 · n u64 · n × f32 · crc32c u32 over everything before it.

use crate::error::CacheDecodeError;

const MAGIC: &[u8; 4] = b"DDC1";
const HEADER_LEN: usize = 4 + 4 + 8 * 5;

/// One cached delta of one layer.
#[derive(Clone, Debug, PartialEq)]
pub struct CacheEntry {
    /// Layer.
    pub layer_id: u32,
    /// Seq of the message that carries (or will carry) this delta.
    pub seq: u64,
    /// Global version the delta is relative to (the oldest one, for a coalesced entry).
    pub base_version: u64,
    /// Training samples behind the delta.
    pub sample_count: u64,
    /// Local step at which it was cut (the latest one, for a coalesced entry).
    pub step: u64,
    /// The delta values, exactly as transmitted.
    pub delta: Vec<f32>,
}

impl CacheEntry {
    /// A store key sorting by layer, then seq (big-endian `layer_id ‖ seq`).
    pub fn key(&self) -> [u8; 12] {
        let mut k = [0u8; 12];
        k[..4].copy_from_slice(&self.layer_id.to_be_bytes());
        k[4..].copy_from_slice(&self.seq.to_be_bytes());
        k
    }

    /// Checksummed encoding (see the module docs).
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(HEADER_LEN + self.delta.len() * 4 + 4);
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&self.layer_id.to_le_bytes());
        for v in [
            self.seq,
            self.base_version,
            self.sample_count,
            self.step,
            self.delta.len() as u64,
        ] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        for v in &self.delta {
            out.extend_from_slice(&v.to_le_bytes());
        }
        let crc = crc32c::crc32c(&out);
        out.extend_from_slice(&crc.to_le_bytes());
        out
    }

    /// Decodes and validates [`Self::to_bytes`] output.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, CacheDecodeError> {
        if bytes.len() < HEADER_LEN + 4 {
            return Err(CacheDecodeError::Truncated {
                len: bytes.len(),
                needed: HEADER_LEN + 4,
            });
        }
        if &bytes[..4] != MAGIC {
            return Err(CacheDecodeError::BadMagic);
        }
        let u64_at = |o: usize| {
            let mut a = [0u8; 8];
            a.copy_from_slice(&bytes[o..o + 8]);
            u64::from_le_bytes(a)
        };
        let n = u64_at(40);
        let needed = usize::try_from(n)
            .ok()
            .and_then(|n| n.checked_mul(4))
            .and_then(|b| b.checked_add(HEADER_LEN + 4))
            .unwrap_or(usize::MAX);
        if bytes.len() < needed {
            return Err(CacheDecodeError::Truncated {
                len: bytes.len(),
                needed,
            });
        }
        if bytes.len() > needed {
            return Err(CacheDecodeError::TrailingBytes(bytes.len() - needed));
        }
        let (body, trailer) = bytes.split_at(needed - 4);
        let stored = u32::from_le_bytes([trailer[0], trailer[1], trailer[2], trailer[3]]);
        let computed = crc32c::crc32c(body);
        if stored != computed {
            return Err(CacheDecodeError::Checksum { stored, computed });
        }
        Ok(CacheEntry {
            layer_id: u32::from_le_bytes([bytes[4], bytes[5], bytes[6], bytes[7]]),
            seq: u64_at(8),
            base_version: u64_at(16),
            sample_count: u64_at(24),
            step: u64_at(32),
            delta: body[HEADER_LEN..]
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn round_trip_and_every_corruption_is_caught(
            layer_id in any::<u32>(),
            seq in any::<u64>(),
            base in any::<u64>(),
            delta in prop::collection::vec(-1e3f32..1e3, 0..20),
            flip in any::<prop::sample::Index>(),
            bit in 0u8..8,
        ) {
            let e = CacheEntry { layer_id, seq, base_version: base, sample_count: 3, step: 9, delta };
            let bytes = e.to_bytes();
            prop_assert_eq!(CacheEntry::from_bytes(&bytes).unwrap(), e.clone());
            let mut bad = bytes.clone();
            let i = flip.index(bad.len());
            bad[i] ^= 1 << bit;
            prop_assert!(CacheEntry::from_bytes(&bad).is_err());
            prop_assert!(CacheEntry::from_bytes(&bytes[..bytes.len() - 1]).is_err());
        }
    }

    #[test]
    fn keys_sort_by_layer_then_seq() {
        let e = |layer_id, seq| CacheEntry {
            layer_id,
            seq,
            base_version: 0,
            sample_count: 1,
            step: 0,
            delta: vec![],
        };
        assert!(e(1, 300).key() < e(2, 1).key());
        assert!(e(1, 2).key() < e(1, 256).key());
        assert_eq!(
            CacheEntry::from_bytes(b"nope"),
            Err(CacheDecodeError::Truncated { len: 4, needed: 52 })
        );
    }
}
