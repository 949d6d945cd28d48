//! The aggregator's durable shard: the state machine's snapshot in one checksummed file
//! (temp file, fsync, rename, fsync of the directory) and the ledger of every applied
//! `(node, layer, seq)` in an append-only log beside it. A group commit appends the round's
//! new ledger entries to the log (fsync), then rewrites the shard file, which records how
//! many log entries it covers; on open, log entries past that count (a crash between the
//! two writes) are cut off. So the model and the ledger never disagree after `kill -9`, and
//! a commit costs the snapshot plus its new entries, not the whole history. The ledger is
//! how tests and operators check that each delta was applied exactly once.
//!
//! ```text
//! shard.bin (v2):  magic "DDPSHRD2" · snapshot_len u64 · snapshot bytes · ledger_len u64 · crc32c u32
//! shard.bin (v1, read and migrated): magic "DDPSHRD1" · snapshot_len u64 · snapshot bytes ·
//!                  n_ledger u64 · n_ledger × (node u64 · layer u32 · seq u64) · crc32c u32
//! ledger.log:      records of node u64 · layer u32 · seq u64 · crc32c u32 (of the 20 bytes)
//! ```

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

const MAGIC_V1: &[u8; 8] = b"DDPSHRD1";
const MAGIC: &[u8; 8] = b"DDPSHRD2";
const ENTRY_LEN: usize = 8 + 4 + 8;
/// A ledger-log record: an entry and its checksum.
const RECORD_LEN: usize = ENTRY_LEN + 4;

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

/// What a shard file holds besides the snapshot: the whole ledger (v1) or how many entries
/// of the ledger log it covers (v2).
#[derive(Debug, PartialEq, Eq)]
pub enum LedgerPart {
    /// v1: the entries themselves.
    Inline(Vec<AppliedEntry>),
    /// v2: the number of ledger-log entries committed with this snapshot.
    Count(u64),
}

/// Encodes a (v2) shard file covering the first `ledger_len` entries of the ledger log.
pub fn encode(snapshot: &[u8], ledger_len: u64) -> Vec<u8> {
    let mut out = Vec::with_capacity(8 + 8 + snapshot.len() + 8 + 4);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&(snapshot.len() as u64).to_le_bytes());
    out.extend_from_slice(snapshot);
    out.extend_from_slice(&ledger_len.to_le_bytes());
    let crc = crc32c::crc32c(&out);
    out.extend_from_slice(&crc.to_le_bytes());
    out
}

/// Encodes a v1 shard file (the ledger inline), as earlier versions wrote them.
pub fn encode_v1(snapshot: &[u8], ledger: &[AppliedEntry]) -> Vec<u8> {
    let mut out = Vec::with_capacity(8 + 8 + snapshot.len() + 8 + ledger.len() * ENTRY_LEN + 4);
    out.extend_from_slice(MAGIC_V1);
    out.extend_from_slice(&(snapshot.len() as u64).to_le_bytes());
    out.extend_from_slice(snapshot);
    out.extend_from_slice(&(ledger.len() as u64).to_le_bytes());
    for e in ledger {
        out.extend_from_slice(&entry_bytes(e));
    }
    let crc = crc32c::crc32c(&out);
    out.extend_from_slice(&crc.to_le_bytes());
    out
}

fn entry_bytes(e: &AppliedEntry) -> [u8; ENTRY_LEN] {
    let mut b = [0u8; ENTRY_LEN];
    b[0..8].copy_from_slice(&e.node.to_le_bytes());
    b[8..12].copy_from_slice(&e.layer.to_le_bytes());
    b[12..20].copy_from_slice(&e.seq.to_le_bytes());
    b
}

fn entry_from(chunk: &[u8]) -> AppliedEntry {
    AppliedEntry {
        node: u64::from_le_bytes(chunk[0..8].try_into().unwrap_or([0; 8])),
        layer: u32::from_le_bytes(chunk[8..12].try_into().unwrap_or([0; 4])),
        seq: u64::from_le_bytes(chunk[12..20].try_into().unwrap_or([0; 8])),
    }
}

/// Decodes a shard file (v1 or v2) into (snapshot bytes, ledger part). Never panics on any
/// input.
pub fn decode(bytes: &[u8]) -> Result<(&[u8], LedgerPart), &'static str> {
    if bytes.len() < 8 + 8 + 8 + 4 {
        return Err("too short");
    }
    let v1 = match &bytes[..8] {
        m if m == MAGIC => false,
        m if m == MAGIC_V1 => true,
        _ => return Err("bad magic"),
    };
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
    let n = read_u64(snap_end).ok_or("truncated ledger count")?;
    let start = snap_end + 8;
    if !v1 {
        if start != body.len() {
            return Err("trailing bytes after the ledger count");
        }
        return Ok((snapshot, LedgerPart::Count(n)));
    }
    let expected = (n as usize)
        .checked_mul(ENTRY_LEN)
        .and_then(|l| l.checked_add(start));
    if expected != Some(body.len()) {
        return Err("ledger length mismatch");
    }
    let ledger = body[start..]
        .chunks_exact(ENTRY_LEN)
        .map(entry_from)
        .collect();
    Ok((snapshot, LedgerPart::Inline(ledger)))
}

/// Writes `bytes` to `path` durably and atomically
/// ([`node::cluster_model::write_file_atomic`]).
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), ShardFileError> {
    node::cluster_model::write_file_atomic(path, bytes).map_err(|source| ShardFileError::Io {
        path: path.to_path_buf(),
        source,
    })
}

/// The ledger log that belongs to the shard file at `shard`.
pub fn log_path(shard: &Path) -> PathBuf {
    shard.with_file_name("ledger.log")
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> ShardFileError + '_ {
    move |source| ShardFileError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// The first `n` entries of the ledger log at `path`; an error when it holds fewer valid
/// records (a log is fsynced before the shard file that counts it, so that is damage).
fn read_log(path: &Path, n: u64) -> Result<Vec<AppliedEntry>, ShardFileError> {
    let bytes = match std::fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound && n == 0 => Vec::new(),
        Err(e) => return Err(io_err(path)(e)),
    };
    let corrupt = |why| ShardFileError::Corrupt {
        path: path.to_path_buf(),
        why,
    };
    let wanted = usize::try_from(n)
        .ok()
        .and_then(|n| n.checked_mul(RECORD_LEN))
        .ok_or_else(|| corrupt("ledger count out of range"))?;
    if bytes.len() < wanted {
        return Err(corrupt("ledger log shorter than the shard file says"));
    }
    bytes[..wanted]
        .chunks_exact(RECORD_LEN)
        .map(|r| {
            let stored = u32::from_le_bytes([r[20], r[21], r[22], r[23]]);
            if crc32c::crc32c(&r[..ENTRY_LEN]) == stored {
                Ok(entry_from(r))
            } else {
                Err(corrupt("ledger log record checksum mismatch"))
            }
        })
        .collect()
}

fn read_shard_bytes(path: &Path) -> Result<Option<Vec<u8>>, ShardFileError> {
    match std::fs::read(path) {
        Ok(b) => Ok(Some(b)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(ShardFileError::Io {
            path: path.to_path_buf(),
            source,
        }),
    }
}

/// Reads a shard file and its ledger (from the log, for v2); `Ok(None)` if there is none.
/// Read-only: what the launcher and tests use on a stopped aggregator's folder.
pub fn read(path: &Path) -> Result<Option<(Vec<u8>, Vec<AppliedEntry>)>, ShardFileError> {
    let Some(bytes) = read_shard_bytes(path)? else {
        return Ok(None);
    };
    let (snapshot, part) = decode(&bytes).map_err(|why| ShardFileError::Corrupt {
        path: path.to_path_buf(),
        why,
    })?;
    let ledger = match part {
        LedgerPart::Inline(entries) => entries,
        LedgerPart::Count(n) => read_log(&log_path(path), n)?,
    };
    Ok(Some((snapshot.to_vec(), ledger)))
}

/// An open shard for writing (the aggregator's): the shard file and its ledger log.
#[derive(Debug)]
pub struct ShardStore {
    path: PathBuf,
    log_path: PathBuf,
    log: File,
    committed: u64,
}

impl ShardStore {
    /// Opens the shard at `path`, returning the snapshot it holds (`None` for a fresh one).
    /// Cuts off ledger-log entries a crash left past the last commit, and migrates a v1 file
    /// (its inline ledger moves into the log).
    pub fn open(path: &Path) -> Result<(ShardStore, Option<Vec<u8>>), ShardFileError> {
        let log_path = log_path(path);
        let existing = read_shard_bytes(path)?;
        let decoded = match &existing {
            Some(bytes) => Some(decode(bytes).map_err(|why| ShardFileError::Corrupt {
                path: path.to_path_buf(),
                why,
            })?),
            None => None,
        };
        let log = OpenOptions::new()
            .create(true)
            .read(true)
            .write(true)
            .truncate(false)
            .open(&log_path)
            .map_err(io_err(&log_path))?;
        let mut store = ShardStore {
            path: path.to_path_buf(),
            log_path: log_path.clone(),
            log,
            committed: 0,
        };
        let snapshot = match decoded {
            None => {
                // A log without a shard file holds nothing committed.
                store.cut_log(0)?;
                None
            }
            Some((snapshot, LedgerPart::Count(n))) => {
                read_log(&log_path, n)?;
                store.cut_log(n)?;
                store.committed = n;
                Some(snapshot.to_vec())
            }
            Some((snapshot, LedgerPart::Inline(entries))) => {
                store.cut_log(0)?;
                store.commit(snapshot, &entries)?;
                Some(snapshot.to_vec())
            }
        };
        Ok((store, snapshot))
    }

    fn cut_log(&mut self, n: u64) -> Result<(), ShardFileError> {
        let len = n * RECORD_LEN as u64;
        let on_disk = self.log.metadata().map_err(io_err(&self.log_path))?.len();
        if on_disk != len {
            self.log.set_len(len).map_err(io_err(&self.log_path))?;
            self.log.sync_all().map_err(io_err(&self.log_path))?;
        }
        Ok(())
    }

    /// The shard file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Ledger entries committed so far.
    pub fn committed(&self) -> u64 {
        self.committed
    }

    /// One group commit: appends `new_entries` to the ledger log (fsync), then writes the
    /// snapshot as the shard file covering them.
    pub fn commit(
        &mut self,
        snapshot: &[u8],
        new_entries: &[AppliedEntry],
    ) -> Result<(), ShardFileError> {
        if !new_entries.is_empty() {
            let mut buf = Vec::with_capacity(new_entries.len() * RECORD_LEN);
            for e in new_entries {
                let b = entry_bytes(e);
                buf.extend_from_slice(&b);
                buf.extend_from_slice(&crc32c::crc32c(&b).to_le_bytes());
            }
            use std::io::{Seek, SeekFrom};
            let at = self.committed * RECORD_LEN as u64;
            self.log
                .seek(SeekFrom::Start(at))
                .map_err(io_err(&self.log_path))?;
            self.log.write_all(&buf).map_err(io_err(&self.log_path))?;
            self.log.sync_data().map_err(io_err(&self.log_path))?;
        }
        let total = self.committed + new_entries.len() as u64;
        write_atomic(&self.path, &encode(snapshot, total))?;
        self.committed = total;
        Ok(())
    }
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
        let (mut store, snap) = ShardStore::open(&path).unwrap();
        assert!(snap.is_none());
        store.commit(b"snapshot", &ledger[..1]).unwrap();
        store.commit(b"snapshot", &ledger[1..]).unwrap();
        let (snap, got) = read(&path).unwrap().unwrap();
        assert_eq!(snap, b"snapshot");
        assert_eq!(got, ledger);
        assert!(read(&dir.join("absent")).unwrap().is_none());
        std::fs::write(&path, b"garbage garbage garbage garbage").unwrap();
        let e = read(&path).unwrap_err();
        assert!(e.to_string().contains("damaged"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    fn entries(n: u64) -> Vec<AppliedEntry> {
        (0..n)
            .map(|i| AppliedEntry {
                node: 100 + i % 3,
                layer: (i % 4) as u32,
                seq: i,
            })
            .collect()
    }

    #[test]
    fn a_crash_between_the_log_append_and_the_shard_write_is_cut_off() {
        let dir = std::env::temp_dir().join(format!("ddp-shard-crash-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("shard.bin");
        let all = entries(10);
        {
            let (mut store, _) = ShardStore::open(&path).unwrap();
            store.commit(b"s1", &all[..6]).unwrap();
            assert_eq!(store.committed(), 6);
        }
        // The next commit appended its entries and died before the shard file was written.
        {
            let mut log = OpenOptions::new()
                .append(true)
                .open(log_path(&path))
                .unwrap();
            for e in &all[6..] {
                let b = entry_bytes(e);
                log.write_all(&b).unwrap();
                log.write_all(&crc32c::crc32c(&b).to_le_bytes()).unwrap();
            }
        }
        let (snap, got) = read(&path).unwrap().unwrap();
        assert_eq!((snap.as_slice(), got.as_slice()), (&b"s1"[..], &all[..6]));
        let (mut store, snap) = ShardStore::open(&path).unwrap();
        assert_eq!(snap.as_deref(), Some(&b"s1"[..]));
        assert_eq!(store.committed(), 6);
        assert_eq!(
            std::fs::metadata(log_path(&path)).unwrap().len(),
            6 * RECORD_LEN as u64,
            "the uncommitted tail is cut"
        );
        store.commit(b"s2", &all[6..]).unwrap();
        assert_eq!(read(&path).unwrap().unwrap().1, all);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_v1_file_is_migrated_and_a_damaged_log_is_refused() {
        let dir = std::env::temp_dir().join(format!("ddp-shard-v1-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("shard.bin");
        let all = entries(5);
        write_atomic(&path, &encode_v1(b"old", &all)).unwrap();
        assert_eq!(read(&path).unwrap().unwrap().1, all);
        let (store, snap) = ShardStore::open(&path).unwrap();
        assert_eq!(snap.as_deref(), Some(&b"old"[..]));
        assert_eq!(store.committed(), 5);
        drop(store);
        assert_eq!(&std::fs::read(&path).unwrap()[..8], MAGIC);
        assert_eq!(read(&path).unwrap().unwrap().1, all);
        // A flipped byte inside a committed record, and a log cut short: both refused.
        let log = log_path(&path);
        let mut bytes = std::fs::read(&log).unwrap();
        bytes[RECORD_LEN + 3] ^= 0x10;
        std::fs::write(&log, &bytes).unwrap();
        let e = read(&path).unwrap_err();
        assert!(e.to_string().contains("checksum"), "{e}");
        std::fs::write(&log, &bytes[..2 * RECORD_LEN]).unwrap();
        let e = ShardStore::open(&path).unwrap_err();
        assert!(e.to_string().contains("shorter"), "{e}");
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
            let mut bytes = encode_v1(&snap, &ledger);
            prop_assert_eq!(decode(&bytes).unwrap(), (&snap[..], LedgerPart::Inline(ledger)));
            let v2 = encode(&snap, n as u64);
            prop_assert_eq!(decode(&v2).unwrap(), (&snap[..], LedgerPart::Count(n as u64)));
            let i = flip.index(bytes.len());
            bytes[i] ^= 0x5A;
            prop_assert!(decode(&bytes).is_err());
            let _ = decode(&garbage);
        }
    }
}
