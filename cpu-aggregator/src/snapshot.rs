//! Byte encoding of a whole aggregator shard, for persistence.
//!
//! Layout (all integers little-endian):
//!
//! ```text
//! magic     8 bytes  "DDPAGGS1"
//! format    u32      FORMAT_VERSION
//! agg id    u64
//! counters  8 × u64  (AggregatorCounters, in declaration order)
//! n_layers  u32, then per layer:
//!     layer_id u32 · name_len u32 · name (UTF-8) · rank u32 · dims u32×rank ·
//!     version u64 · n_values u64 · values f32×n_values
//! n_seqs    u64, then per entry: node u64 · layer u32 · highest applied seq u64
//! crc32c    u32      over every byte before it
//! ```
//!
//! [`decode`] checks the magic, the format version and the checksum before parsing, and
//! bounds every count by the bytes actually present (no allocation from a corrupt count).

use crate::config::OwnedLayer;
use crate::error::SnapshotError;
use crate::state::AggregatorCounters;

/// Snapshot magic.
pub const MAGIC: &[u8; 8] = b"DDPAGGS1";
/// Snapshot format version written by this build.
pub const FORMAT_VERSION: u32 = 1;

/// One layer in a snapshot.
#[derive(Clone, Debug, PartialEq)]
pub struct SnapshotLayer {
    /// Id, name, shape and values.
    pub layer: OwnedLayer,
    /// Global version.
    pub version: u64,
}

/// Everything a snapshot holds.
#[derive(Clone, Debug, PartialEq)]
pub struct SnapshotData {
    /// The aggregator's node id.
    pub aggregator_id: u64,
    /// Running totals.
    pub counters: AggregatorCounters,
    /// Owned layers.
    pub layers: Vec<SnapshotLayer>,
    /// `(node, layer, highest applied seq)`.
    pub seq_table: Vec<(u64, u32, u64)>,
}

fn counters_to_array(c: &AggregatorCounters) -> [u64; 8] {
    [
        c.deltas_received,
        c.deltas_applied,
        c.rounds_applied,
        c.duplicates_rejected,
        c.dropped_stale,
        c.bad_inputs,
        c.bytes_in,
        c.bytes_out,
    ]
}

fn counters_from_array(a: [u64; 8]) -> AggregatorCounters {
    AggregatorCounters {
        deltas_received: a[0],
        deltas_applied: a[1],
        rounds_applied: a[2],
        duplicates_rejected: a[3],
        dropped_stale: a[4],
        bad_inputs: a[5],
        bytes_in: a[6],
        bytes_out: a[7],
    }
}

/// Encodes `data` (see the module docs for the layout).
pub fn encode(data: &SnapshotData) -> Vec<u8> {
    let values_bytes: usize = data.layers.iter().map(|l| l.layer.values.len() * 4).sum();
    let mut out = Vec::with_capacity(128 + values_bytes + data.seq_table.len() * 20);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    out.extend_from_slice(&data.aggregator_id.to_le_bytes());
    for c in counters_to_array(&data.counters) {
        out.extend_from_slice(&c.to_le_bytes());
    }
    out.extend_from_slice(&(data.layers.len() as u32).to_le_bytes());
    for l in &data.layers {
        out.extend_from_slice(&l.layer.layer_id.to_le_bytes());
        out.extend_from_slice(&(l.layer.name.len() as u32).to_le_bytes());
        out.extend_from_slice(l.layer.name.as_bytes());
        out.extend_from_slice(&(l.layer.shape.len() as u32).to_le_bytes());
        for d in &l.layer.shape {
            out.extend_from_slice(&d.to_le_bytes());
        }
        out.extend_from_slice(&l.version.to_le_bytes());
        out.extend_from_slice(&(l.layer.values.len() as u64).to_le_bytes());
        for v in &l.layer.values {
            out.extend_from_slice(&v.to_le_bytes());
        }
    }
    out.extend_from_slice(&(data.seq_table.len() as u64).to_le_bytes());
    for &(node, layer, seq) in &data.seq_table {
        out.extend_from_slice(&node.to_le_bytes());
        out.extend_from_slice(&layer.to_le_bytes());
        out.extend_from_slice(&seq.to_le_bytes());
    }
    let crc = crc32c::crc32c(&out);
    out.extend_from_slice(&crc.to_le_bytes());
    out
}

/// A bounds-checked little-endian reader.
struct Reader<'a> {
    bytes: &'a [u8],
    offset: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, needed: usize) -> Result<&'a [u8], SnapshotError> {
        let available = self.bytes.len() - self.offset;
        if needed > available {
            return Err(SnapshotError::Truncated {
                offset: self.offset,
                needed,
                available,
            });
        }
        let s = &self.bytes[self.offset..self.offset + needed];
        self.offset += needed;
        Ok(s)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], SnapshotError> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }

    fn u32(&mut self) -> Result<u32, SnapshotError> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    fn u64(&mut self) -> Result<u64, SnapshotError> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    /// A count of items of `item_bytes` each, checked against the bytes left.
    fn count(&mut self, raw: u64, item_bytes: usize) -> Result<usize, SnapshotError> {
        let available = self.bytes.len() - self.offset;
        let needed = usize::try_from(raw)
            .ok()
            .and_then(|n| n.checked_mul(item_bytes))
            .filter(|&n| n <= available)
            .ok_or(SnapshotError::Truncated {
                offset: self.offset,
                needed: usize::MAX,
                available,
            })?;
        Ok(needed / item_bytes.max(1))
    }
}

/// Decodes and validates snapshot bytes.
pub fn decode(bytes: &[u8]) -> Result<SnapshotData, SnapshotError> {
    const MIN_LEN: usize = 8 + 4 + 4;
    if bytes.len() < MIN_LEN {
        return Err(SnapshotError::Truncated {
            offset: 0,
            needed: MIN_LEN,
            available: bytes.len(),
        });
    }
    if &bytes[..8] != MAGIC {
        return Err(SnapshotError::BadMagic);
    }
    let format = u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]);
    if format != FORMAT_VERSION {
        return Err(SnapshotError::UnsupportedVersion(format));
    }
    let (body, trailer) = bytes.split_at(bytes.len() - 4);
    let stored = u32::from_le_bytes([trailer[0], trailer[1], trailer[2], trailer[3]]);
    let computed = crc32c::crc32c(body);
    if stored != computed {
        return Err(SnapshotError::Checksum { stored, computed });
    }
    let mut r = Reader {
        bytes: body,
        offset: 12,
    };
    let aggregator_id = r.u64()?;
    let mut counters = [0u64; 8];
    for c in &mut counters {
        *c = r.u64()?;
    }
    let raw = u64::from(r.u32()?);
    let n_layers = r.count(raw, 4 + 4 + 4 + 8 + 8)?;
    let mut layers = Vec::with_capacity(n_layers);
    for _ in 0..n_layers {
        let layer_id = r.u32()?;
        let raw = u64::from(r.u32()?);
        let name_len = r.count(raw, 1)?;
        let name = std::str::from_utf8(r.take(name_len)?)
            .map_err(|e| SnapshotError::Malformed(format!("layer {layer_id} name: {e}")))?
            .to_string();
        let raw = u64::from(r.u32()?);
        let rank = r.count(raw, 4)?;
        let mut shape = Vec::with_capacity(rank);
        for _ in 0..rank {
            shape.push(r.u32()?);
        }
        let version = r.u64()?;
        let raw = r.u64()?;
        let n_values = r.count(raw, 4)?;
        let values = r
            .take(n_values * 4)?
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        layers.push(SnapshotLayer {
            layer: OwnedLayer {
                layer_id,
                name,
                shape,
                values,
            },
            version,
        });
    }
    let raw = r.u64()?;
    let n_seqs = r.count(raw, 8 + 4 + 8)?;
    let mut seq_table = Vec::with_capacity(n_seqs);
    for _ in 0..n_seqs {
        seq_table.push((r.u64()?, r.u32()?, r.u64()?));
    }
    if r.offset != body.len() {
        return Err(SnapshotError::Malformed(format!(
            "{} unexpected bytes after the seq table",
            body.len() - r.offset
        )));
    }
    Ok(SnapshotData {
        aggregator_id,
        counters: counters_from_array(counters),
        layers,
        seq_table,
    })
}
