//! The aggregator's durable shard file: the state machine's snapshot plus the ledger of every
//! applied `(node, layer, seq)`, written as one checksummed file (temp file, fsync, rename,
//! fsync of the directory) so the model and the ledger can never disagree after `kill -9`.
//! The ledger is how tests and operators check that each delta was applied exactly once.
//!
//! ```text
//! magic "DDPSHRD1" · snapshot_len u64 · snapshot bytes · n_ledger u64 ·
//! n_ledger × (node u64 · layer u32 · seq u64) · crc32c u32 over everything before it
//! ```

use std::path::{Path, PathBuf};

const MAGIC: &[u8; 8] = b"DDPSHRD1";
const ENTRY_LEN: usize = 8 + 4 + 8;

/// One applied delta.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
pub struct AppliedEntry {
    /// Sender.
    pub node: u64,
    /// Layer.
    pub layer: u32,
    /// The sender's seq.
    pub seq: u64,
}

/// A shard file that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ShardFileError {
    /// I/O on the file.
    #[error("{path}: {source}")]
    Io {
        /// File.
        path: PathBuf,
        /// Cause.
        source: std::io::Error,
    },
    /// The bytes are not a valid shard file.
    #[error("{path} is damaged ({why}); move it aside to start this aggregator empty")]
    Corrupt {
        /// File.
        path: PathBuf,
        /// What is wrong.
        why: &'static str,
    },
}

/// Encodes a shard file.
pub fn encode(snapshot: &[u8], ledger: &[AppliedEntry]) -> Vec<u8> {
    let mut out = Vec::with_capacity(8 + 8 + snapshot.len() + 8 + ledger.len() * ENTRY_LEN + 4);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&(snapshot.len() as u64).to_le_bytes());
    out.extend_from_slice(snapshot);
    out.extend_from_slice(&(ledger.len() as u64).to_le_bytes());
    for e in ledger {
        out.extend_from_slice(&e.node.to_le_bytes());
        out.extend_from_slice(&e.layer.to_le_bytes());
        out.extend_from_slice(&e.seq.to_le_bytes());
    }
    let crc = crc32c::crc32c(&out);
    out.extend_from_slice(&crc.to_le_bytes());
    out
}

/// Decodes a shard file into (snapshot bytes, ledger). Never panics on any input.
pub fn decode(bytes: &[u8]) -> Result<(&[u8], Vec<AppliedEntry>), &'static str> {
    if bytes.len() < 8 + 8 + 8 + 4 {
        return Err("too short");
    }
    if &bytes[..8] != MAGIC {
        return Err("bad magic");
    }
    let (body, crc) = bytes.split_at(bytes.len() - 4);
    let stored = u32::from_le_bytes([crc[0], crc[1], crc[2], crc[3]]);
    if crc32c::crc32c(body) != stored {
        return Err("checksum mismatch");
    }
    let read_u64 = |at: usize| -> Option<u64> {
        body.get(at..at + 8)
            .map(|b| u64::from_le_bytes(b.try_into().unwrap_or([0; 8])))
    };
    let snap_len = read_u64(8).ok_or("truncated header")? as usize;
    let snap_end = 16usize.checked_add(snap_len).ok_or("bad snapshot length")?;
    let snapshot = body.get(16..snap_end).ok_or("truncated snapshot")?;
    let n = read_u64(snap_end).ok_or("truncated ledger count")? as usize;
    let start = snap_end + 8;
    let expected = n.checked_mul(ENTRY_LEN).and_then(|l| l.checked_add(start));
    if expected != Some(body.len()) {
        return Err("ledger length mismatch");
    }
    let mut ledger = Vec::with_capacity(n);
    for chunk in body[start..].chunks_exact(ENTRY_LEN) {
        ledger.push(AppliedEntry {
            node: u64::from_le_bytes(chunk[0..8].try_into().unwrap_or([0; 8])),
            layer: u32::from_le_bytes(chunk[8..12].try_into().unwrap_or([0; 4])),
            seq: u64::from_le_bytes(chunk[12..20].try_into().unwrap_or([0; 8])),
        });
    }
    Ok((snapshot, ledger))
}

/// Writes `bytes` to `path` durably and atomically
/// ([`node::cluster_model::write_file_atomic`]).
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), ShardFileError> {
    node::cluster_model::write_file_atomic(path, bytes).map_err(|source| ShardFileError::Io {
        path: path.to_path_buf(),
        source,
    })
}

/// Reads a shard file; `Ok(None)` if there is none.
pub fn read(path: &Path) -> Result<Option<(Vec<u8>, Vec<AppliedEntry>)>, ShardFileError> {
    let bytes = match std::fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => {
            return Err(ShardFileError::Io {
                path: path.to_path_buf(),
                source,
            })
        }
    };
    let (snapshot, ledger) = decode(&bytes).map_err(|why| ShardFileError::Corrupt {
        path: path.to_path_buf(),
        why,
    })?;
    Ok(Some((snapshot.to_vec(), ledger)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn round_trip_and_atomic_write() {
        let dir = std::env::temp_dir().join(format!("ddp-shard-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("shard.bin");
        let ledger = vec![
            AppliedEntry {
                node: 1,
                layer: 2,
                seq: 3,
            },
            AppliedEntry {
                node: 4,
                layer: 0,
                seq: u64::MAX,
            },
        ];
        write_atomic(&path, &encode(b"snapshot", &ledger)).unwrap();
        let (snap, got) = read(&path).unwrap().unwrap();
        assert_eq!(snap, b"snapshot");
        assert_eq!(got, ledger);
        assert!(read(&dir.join("absent")).unwrap().is_none());
        std::fs::write(&path, b"garbage garbage garbage garbage").unwrap();
        let e = read(&path).unwrap_err();
        assert!(e.to_string().contains("damaged"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    proptest! {
        #[test]
        fn decode_never_panics_and_detects_any_flip(
            snap in prop::collection::vec(any::<u8>(), 0..64),
            n in 0usize..5,
            flip in any::<prop::sample::Index>(),
            garbage in prop::collection::vec(any::<u8>(), 0..128),
        ) {
            let ledger: Vec<AppliedEntry> =
                (0..n).map(|i| AppliedEntry { node: i as u64, layer: i as u32, seq: 7 }).collect();
            let mut bytes = encode(&snap, &ledger);
            prop_assert_eq!(decode(&bytes).unwrap(), (&snap[..], ledger));
            let i = flip.index(bytes.len());
            bytes[i] ^= 0x5A;
            prop_assert!(decode(&bytes).is_err());
            let _ = decode(&garbage);
        }
    }
}
