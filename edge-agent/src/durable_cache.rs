//! The durable weak-sync cache of the edge agent: [`CacheEntry`]s stored in a sled 0.34.7
//! database, one sled value per layer delta, keyed big-endian `layer_id ‖ seq` (so
//! iteration is in `(layer, seq)` order).
//!
//! This is what the shell does with the state machine's [`crate::Output::CachePut`],
//! [`crate::Output::CacheReplace`] and [`crate::Output::CacheRemove`]:
//!
//! * [`DurableCache::put_durable`] (insert, then `flush`) — only after it returns `Ok` may
//!   the shell call [`crate::SyncClient::cache_put_done`];
//! * [`DurableCache::replace`] — removes the coalesced parts and stores the bundle in one
//!   sled batch (recovered atomically after a crash), then flushes;
//! * [`DurableCache::remove`] — one batch, not flushed: a removal lost in a crash only
//!   makes the agent retransmit an already applied delta, which the aggregator acks as a
//!   duplicate. Any later flush (every put and replace flushes) persists it.
//!
//! **Recovery.** sled has upstream reports of corruption after `kill -9`, so every value
//! carries the CRC32C of [`CacheEntry::to_bytes`] and [`DurableCache::open`] validates all
//! of them. If sled refuses to open the directory (or panics doing so), reading fails part
//! way, or any entry fails validation, the cache is rebuilt: the entries that validated
//! are written into a fresh database `<dir>.rebuild`, flushed, and swapped in while the
//! old directory is kept as `<dir>.corrupt-<n>` (`n` = 1, 2, ... the first free one). The
//! [`OpenReport`] says what happened so the shell can log
//! `[ERROR] cache <dir> moved aside to <dir>.corrupt-<n>: <reason>`. A crash during the
//! rebuild is recovered on the next open (a complete `<dir>.rebuild` left without `<dir>`
//! is moved into place; one left beside `<dir>` is incomplete and deleted). The only open
//! error that is not repaired this way is [`CacheError::Locked`]: another process has the
//! cache open, and moving a live cache aside would lose its writes.
//!
//! **Limit.** Checksums catch values sled returns damaged, not entries sled forgets: sled
//! 0.34.7 reads a data file overwritten wholesale with garbage as unwritten segments and
//! opens it as an empty (or shorter) database without an error. Torn writes at the log tail
//! after `kill -9` only ever lose unflushed, hence unacknowledged, writes (`tests/kill9.rs`).
//!
//! sled keeps roughly 3× the live data on disk ([`DurableCache::bytes_on_disk`]).

use std::ffi::OsString;
use std::fs;
use std::io;
use std::panic::{self, AssertUnwindSafe};
use std::path::{Path, PathBuf};

use thiserror::Error;

use crate::cache::CacheEntry;
use crate::error::CacheDecodeError;

/// Suffix of the directory a rebuilt cache is assembled in before it is swapped in.
const REBUILD_SUFFIX: &str = ".rebuild";
/// Suffix of the directory a compaction moves the bloated original to before deleting it.
const OLD_SUFFIX: &str = ".old";
/// Suffix (before the number) of a cache directory moved aside.
const CORRUPT_SUFFIX: &str = ".corrupt-";
/// Substring of the sled 0.34.7 error for a database another process holds open.
const SLED_LOCK_MESSAGE: &str = "could not acquire lock";

/// Why a [`DurableCache`] operation failed. Every variant names the cache directory.
#[derive(Debug, Error)]
pub enum CacheError {
    /// Another process (or another handle in this one) has the cache open.
    #[error("cache {path}: in use by another process: {source}")]
    Locked {
        /// Cache directory.
        path: PathBuf,
        /// sled's error.
        source: sled::Error,
    },
    /// A sled operation failed.
    #[error("cache {path}: {op} failed: {source}")]
    Sled {
        /// Cache directory.
        path: PathBuf,
        /// What was being done.
        op: &'static str,
        /// sled's error.
        source: sled::Error,
    },
    /// A file-system operation (moving aside, deleting a stale rebuild) failed.
    #[error("cache {path}: {op} failed: {source}")]
    Io {
        /// The path operated on.
        path: PathBuf,
        /// What was being done.
        op: &'static str,
        /// The OS error.
        source: io::Error,
    },
    /// sled panicked while opening a freshly created database.
    #[error("cache {path}: sled panicked opening a fresh database: {message}")]
    Panicked {
        /// Cache directory.
        path: PathBuf,
        /// The panic message.
        message: String,
    },
    /// The path has no final component to derive `<dir>.corrupt-<n>` from (`/`, `..`).
    #[error("cache {path}: not usable as a cache directory (no final path component)")]
    BadPath {
        /// The path given.
        path: PathBuf,
    },
    /// An entry read after opening failed validation (the store was corrupted while open).
    #[error("cache {path}: entry {key} is corrupt: {source}")]
    CorruptEntry {
        /// Cache directory.
        path: PathBuf,
        /// The key, hex.
        key: String,
        /// Why it was rejected.
        source: EntryError,
    },
    /// [`DurableCache::replace`] was given a bundle of another layer.
    #[error("cache {path}: replace in layer {layer_id} with an entry of layer {put_layer}")]
    LayerMismatch {
        /// Cache directory.
        path: PathBuf,
        /// Layer of the replaced entries.
        layer_id: u32,
        /// Layer of the bundle.
        put_layer: u32,
    },
}

/// Why one stored key/value pair is not a valid cache entry.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum EntryError {
    /// The value does not decode (bad magic, truncated, checksum mismatch, ...).
    #[error(transparent)]
    Decode(#[from] CacheDecodeError),
    /// The value is a valid entry, but of another key (or the key is not 12 bytes).
    #[error("stored under a key that is not its own (entry layer {layer_id} seq {seq})")]
    KeyMismatch {
        /// Layer of the decoded entry.
        layer_id: u32,
        /// Seq of the decoded entry.
        seq: u64,
    },
}

/// A cache directory that was moved aside by [`DurableCache::open`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MovedAside {
    /// Where the old directory is now (`<dir>.corrupt-<n>`).
    pub path: PathBuf,
    /// Why, for the log line.
    pub reason: String,
}

/// What [`DurableCache::open`] found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct OpenReport {
    /// Valid entries now in the cache.
    pub recovered: usize,
    /// Stored entries dropped because they failed validation.
    pub dropped_corrupt: usize,
    /// Set when the directory was moved aside and the cache rebuilt.
    pub moved_aside: Option<MovedAside>,
    /// Set when an interrupted rebuild was finished (its result moved into place).
    pub finished_rebuild: bool,
}

impl OpenReport {
    /// Whether the cache opened as it was left, with nothing dropped, moved or repaired.
    pub fn is_clean(&self) -> bool {
        self.dropped_corrupt == 0 && self.moved_aside.is_none() && !self.finished_rebuild
    }
}

/// The durable weak-sync cache (see the module docs).
pub struct DurableCache {
    db: sled::Db,
    dir: PathBuf,
    capacity_bytes: u64,
}

/// sled's page-cache bound used by [`DurableCache::open`]: sled's own default is 1 GiB,
/// which an edge agent with a long backlog grows into; the cache's working set is a few
/// layer deltas, and sled reads the rest from disk.
pub const DEFAULT_CAPACITY_BYTES: u64 = 8 << 20;

impl std::fmt::Debug for DurableCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DurableCache")
            .field("dir", &self.dir)
            .finish_non_exhaustive()
    }
}

/// What a first look at an existing database found.
enum Scan {
    /// Everything validated.
    Clean(sled::Db, usize),
    /// Something is wrong: these entries validated; the old directory must go.
    Damaged {
        valid: Vec<(Vec<u8>, Vec<u8>)>,
        dropped_corrupt: usize,
        reason: String,
    },
}

impl DurableCache {
    /// Opens (creating if needed) the cache in `dir`, validating every entry, and rebuilds
    /// it when it is damaged (see the module docs). Fails only when the cache is in use
    /// ([`CacheError::Locked`]), or when moving aside or creating a fresh database fails.
    pub fn open(dir: impl AsRef<Path>) -> Result<(DurableCache, OpenReport), CacheError> {
        DurableCache::open_with_capacity(dir, DEFAULT_CAPACITY_BYTES)
    }

    /// [`DurableCache::open`] with sled's in-memory page cache bounded to `capacity_bytes`.
    pub fn open_with_capacity(
        dir: impl AsRef<Path>,
        capacity_bytes: u64,
    ) -> Result<(DurableCache, OpenReport), CacheError> {
        let dir = dir.as_ref().to_path_buf();
        let cap = capacity_bytes;
        let rebuild_dir = sibling(&dir, REBUILD_SUFFIX)?;
        let mut report = OpenReport::default();

        // Left by a compaction interrupted after it moved the original aside: the copy (in
        // `<dir>.rebuild` or already `<dir>`) is complete, the original is garbage — unless
        // neither copy exists, which compaction never leaves, so keep the original then.
        let old_dir = sibling(&dir, OLD_SUFFIX)?;
        if old_dir.exists() {
            if dir.exists() || rebuild_dir.exists() {
                remove_path(&old_dir)?;
            } else {
                rename(&old_dir, &dir)?;
            }
        }

        if rebuild_dir.exists() {
            if dir.exists() {
                // Interrupted before the swap: the rebuild may be incomplete, the original
                // is still in place.
                remove_path(&rebuild_dir)?;
            } else {
                // Interrupted between the two renames: the rebuild was flushed and complete.
                rename(&rebuild_dir, &dir)?;
                sync_parent(&dir)?;
                report.finished_rebuild = true;
            }
        }

        let (valid, dropped_corrupt, reason) = match scan(&dir, cap)? {
            Scan::Clean(db, recovered) => {
                report.recovered = recovered;
                return Ok((
                    DurableCache {
                        db,
                        dir,
                        capacity_bytes,
                    },
                    report,
                ));
            }
            Scan::Damaged {
                valid,
                dropped_corrupt,
                reason,
            } => (valid, dropped_corrupt, reason),
        };

        // Assemble the rebuilt cache beside the damaged one, then swap.
        let fresh = open_sled(&rebuild_dir, cap).map_err(|e| e.into_error(&rebuild_dir))?;
        let mut batch = sled::Batch::default();
        for (k, v) in &valid {
            batch.insert(k.as_slice(), v.as_slice());
        }
        fresh
            .apply_batch(batch)
            .map_err(|source| CacheError::Sled {
                path: rebuild_dir.clone(),
                op: "writing recovered entries",
                source,
            })?;
        flush_db(&fresh, &rebuild_dir)?;
        drop(fresh);

        let aside = first_free_corrupt_path(&dir)?;
        rename(&dir, &aside)?;
        rename(&rebuild_dir, &dir)?;
        sync_parent(&dir)?;

        let db = open_sled(&dir, cap).map_err(|e| e.into_error(&dir))?;
        report.recovered = valid.len();
        report.dropped_corrupt = dropped_corrupt;
        report.moved_aside = Some(MovedAside {
            path: aside,
            reason,
        });
        Ok((
            DurableCache {
                db,
                dir,
                capacity_bytes,
            },
            report,
        ))
    }

    /// The cache directory.
    pub fn path(&self) -> &Path {
        &self.dir
    }

    /// Stores `entry` (replacing one with the same key), **not** yet durable: call
    /// [`Self::flush`] before acknowledging, or use [`Self::put_durable`].
    pub fn put(&self, entry: &CacheEntry) -> Result<(), CacheError> {
        self.db
            .insert(entry.key(), entry.to_bytes())
            .map(drop)
            .map_err(|source| self.sled_err("put", source))
    }

    /// Makes every earlier write durable (sled `flush`: write out and fsync).
    pub fn flush(&self) -> Result<(), CacheError> {
        flush_db(&self.db, &self.dir)
    }

    /// [`Self::put`] then [`Self::flush`]: once this returns `Ok` the entry survives a
    /// crash, and the shell may call [`crate::SyncClient::cache_put_done`].
    pub fn put_durable(&self, entry: &CacheEntry) -> Result<(), CacheError> {
        self.put(entry)?;
        self.flush()
    }

    /// Atomically removes `remove_seqs` of `layer_id` and stores `put`, then flushes: after
    /// a crash either all the old entries or the bundle are present, never both. `put`
    /// must be of `layer_id`; a seq in `remove_seqs` equal to `put.seq` is overwritten.
    pub fn replace(
        &self,
        layer_id: u32,
        remove_seqs: &[u64],
        put: &CacheEntry,
    ) -> Result<(), CacheError> {
        if put.layer_id != layer_id {
            return Err(CacheError::LayerMismatch {
                path: self.dir.clone(),
                layer_id,
                put_layer: put.layer_id,
            });
        }
        let mut batch = sled::Batch::default();
        for &seq in remove_seqs {
            batch.remove(&key_of(layer_id, seq)[..]);
        }
        batch.insert(&put.key()[..], put.to_bytes());
        self.db
            .apply_batch(batch)
            .map_err(|source| self.sled_err("replace", source))?;
        self.flush()
    }

    /// Removes `seqs` of `layer_id` in one batch (missing ones are ignored). Not flushed
    /// (see the module docs); call [`Self::flush`] to make it durable now.
    pub fn remove(&self, layer_id: u32, seqs: &[u64]) -> Result<(), CacheError> {
        let mut batch = sled::Batch::default();
        for &seq in seqs {
            batch.remove(&key_of(layer_id, seq)[..]);
        }
        self.db
            .apply_batch(batch)
            .map_err(|source| self.sled_err("remove", source))
    }

    /// All entries in `(layer, seq)` order, for [`crate::SyncClient::restore_from_cache`].
    /// An entry failing validation here (corrupted since [`Self::open`]) is an error; the
    /// next open drops it and moves the directory aside.
    pub fn entries(&self) -> Result<Vec<CacheEntry>, CacheError> {
        let mut out = Vec::new();
        for item in self.db.iter() {
            let (k, v) = item.map_err(|source| self.sled_err("reading entries", source))?;
            let entry = validate(&k, &v).map_err(|source| CacheError::CorruptEntry {
                path: self.dir.clone(),
                key: hex(&k),
                source,
            })?;
            out.push(entry);
        }
        Ok(out)
    }

    /// Number of stored entries (walks the tree).
    pub fn len(&self) -> usize {
        self.db.len()
    }

    /// Whether the cache holds no entries.
    pub fn is_empty(&self) -> bool {
        self.db.is_empty()
    }

    /// Reclaims the disk space of an empty cache. sled 0.34.7 stores each large value (a
    /// layer delta) as a blob file and deletes it only when its own segment GC gets to the
    /// entry that pointed to it, which in practice lets the directory grow with every delta
    /// ever cached (4.4 GB after a 70 s soak of an edge killed 17 times). When no entry is
    /// pending and the directory holds at least `min_bytes`, the database is dropped and
    /// recreated empty; a crash in between leaves an empty or half-deleted directory, which
    /// [`DurableCache::open`] turns into an empty cache, and nothing pending is lost since
    /// nothing was pending. Returns the bytes freed, `None` when nothing was done.
    pub fn compact_if_empty(&mut self, min_bytes: u64) -> Result<Option<u64>, CacheError> {
        if !self.db.is_empty() {
            return Ok(None);
        }
        self.compact_if_bloated(min_bytes, 1)
    }

    /// Reclaims the disk space of a cache that still holds entries, when its directory has
    /// grown past `min_bytes` and past `factor` times the bytes of its live entries (a long
    /// outage: every cached and coalesced delta leaves a blob file behind). The live entries
    /// are copied into a fresh database beside it, flushed, and swapped in with the same
    /// crash-safe protocol as a rebuild after corruption (see [`DurableCache::open`]): until
    /// the swap the original is untouched, after it the copy is complete. Returns the bytes
    /// freed, `None` when nothing was done.
    pub fn compact_if_bloated(
        &mut self,
        min_bytes: u64,
        factor: u64,
    ) -> Result<Option<u64>, CacheError> {
        let before = dir_bytes(&self.dir);
        if before < min_bytes {
            return Ok(None);
        }
        let mut live: Vec<(sled::IVec, sled::IVec)> = Vec::with_capacity(self.db.len());
        for kv in self.db.iter() {
            live.push(kv.map_err(|source| self.sled_err("reading entries to compact", source))?);
        }
        let live_bytes: u64 = live.iter().map(|(k, v)| (k.len() + v.len()) as u64).sum();
        if before < live_bytes.saturating_mul(factor) {
            return Ok(None);
        }
        let rebuild_dir = sibling(&self.dir, REBUILD_SUFFIX)?;
        if rebuild_dir.exists() {
            remove_path(&rebuild_dir)?;
        }
        let fresh =
            open_sled(&rebuild_dir, self.capacity_bytes).map_err(|e| e.into_error(&rebuild_dir))?;
        let mut batch = sled::Batch::default();
        for (k, v) in &live {
            batch.insert(k.clone(), v.clone());
        }
        fresh
            .apply_batch(batch)
            .map_err(|source| CacheError::Sled {
                path: rebuild_dir.clone(),
                op: "writing compacted entries",
                source,
            })?;
        flush_db(&fresh, &rebuild_dir)?;
        drop(fresh);
        // sled releases its files and lock when the last handle is dropped: an in-memory
        // database holds the field meanwhile.
        let in_memory = sled::Config::new()
            .temporary(true)
            .open()
            .map_err(|source| self.sled_err("opening an in-memory database", source))?;
        drop(std::mem::replace(&mut self.db, in_memory));
        // Crash before this rename: `open` finds both directories and keeps the original.
        let old_dir = sibling(&self.dir, OLD_SUFFIX)?;
        if old_dir.exists() {
            remove_path(&old_dir)?;
        }
        rename(&self.dir, &old_dir)?;
        // Crash here: `open` finds only the complete, flushed copy and moves it into place
        // (and deletes the old directory).
        rename(&rebuild_dir, &self.dir)?;
        sync_parent(&self.dir)?;
        remove_path(&old_dir)?;
        let (reopened, _) = DurableCache::open_with_capacity(&self.dir, self.capacity_bytes)?;
        self.db = reopened.db;
        Ok(Some(before.saturating_sub(dir_bytes(&self.dir))))
    }

    /// Bytes of every file in the cache directory (sled's own `size_on_disk` leaves out its
    /// blob files).
    pub fn dir_bytes(&self) -> u64 {
        dir_bytes(&self.dir)
    }

    /// Bytes sled uses on disk (about 3× the live data).
    pub fn bytes_on_disk(&self) -> Result<u64, CacheError> {
        self.db
            .size_on_disk()
            .map_err(|source| self.sled_err("size_on_disk", source))
    }

    fn sled_err(&self, op: &'static str, source: sled::Error) -> CacheError {
        CacheError::Sled {
            path: self.dir.clone(),
            op,
            source,
        }
    }
}

/// The store key of `(layer_id, seq)`; equal to [`CacheEntry::key`].
fn key_of(layer_id: u32, seq: u64) -> [u8; 12] {
    let mut k = [0u8; 12];
    k[..4].copy_from_slice(&layer_id.to_be_bytes());
    k[4..].copy_from_slice(&seq.to_be_bytes());
    k
}

/// Decodes a stored value and checks it is stored under its own key.
fn validate(key: &[u8], value: &[u8]) -> Result<CacheEntry, EntryError> {
    let entry = CacheEntry::from_bytes(value)?;
    if key != entry.key() {
        return Err(EntryError::KeyMismatch {
            layer_id: entry.layer_id,
            seq: entry.seq,
        });
    }
    Ok(entry)
}

/// Why sled could not open a directory.
enum OpenFailure {
    Locked(sled::Error),
    Failed(sled::Error),
    Panicked(String),
}

impl OpenFailure {
    fn into_error(self, path: &Path) -> CacheError {
        let path = path.to_path_buf();
        match self {
            OpenFailure::Locked(source) => CacheError::Locked { path, source },
            OpenFailure::Failed(source) => CacheError::Sled {
                path,
                op: "open",
                source,
            },
            OpenFailure::Panicked(message) => CacheError::Panicked { path, message },
        }
    }
}

/// How long [`open_sled`] waits for a lock held by a database that is still shutting down
/// (sled releases its file lock only when its background flusher exits, shortly after the
/// last handle is dropped).
const LOCK_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// Opens a sled database, turning a panic inside sled into an error. A lock that is still
/// held is retried for up to [`LOCK_WAIT`] before it is reported.
fn open_sled(dir: &Path, capacity_bytes: u64) -> Result<sled::Db, OpenFailure> {
    let started = std::time::Instant::now();
    loop {
        let config = sled::Config::new().path(dir).cache_capacity(capacity_bytes);
        match panic::catch_unwind(AssertUnwindSafe(|| config.open())) {
            Ok(Ok(db)) => return Ok(db),
            Ok(Err(e)) if is_lock_error(&e) => {
                if started.elapsed() >= LOCK_WAIT {
                    return Err(OpenFailure::Locked(e));
                }
                std::thread::sleep(std::time::Duration::from_millis(25));
            }
            Ok(Err(e)) => return Err(OpenFailure::Failed(e)),
            Err(payload) => return Err(OpenFailure::Panicked(panic_message(payload.as_ref()))),
        }
    }
}

fn is_lock_error(e: &sled::Error) -> bool {
    matches!(e, sled::Error::Io(io) if io.to_string().contains(SLED_LOCK_MESSAGE))
}

fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-string panic payload".to_owned()
    }
}

/// Opens `dir` and validates every entry.
fn scan(dir: &Path, capacity_bytes: u64) -> Result<Scan, CacheError> {
    let db = match open_sled(dir, capacity_bytes) {
        Ok(db) => db,
        Err(OpenFailure::Locked(source)) => {
            return Err(CacheError::Locked {
                path: dir.to_path_buf(),
                source,
            })
        }
        Err(OpenFailure::Failed(e)) => {
            return Ok(Scan::Damaged {
                valid: Vec::new(),
                dropped_corrupt: 0,
                reason: format!("sled could not open it: {e}"),
            })
        }
        Err(OpenFailure::Panicked(message)) => {
            return Ok(Scan::Damaged {
                valid: Vec::new(),
                dropped_corrupt: 0,
                reason: format!("sled panicked opening it: {message}"),
            })
        }
    };
    let mut valid = Vec::new();
    let mut dropped_corrupt = 0usize;
    let mut first_problem: Option<String> = None;
    // A panic inside sled while reading is treated like a read error.
    let walked = panic::catch_unwind(AssertUnwindSafe(|| {
        for item in db.iter() {
            let (k, v) = match item {
                Ok(kv) => kv,
                Err(e) => return Err(format!("reading entries failed: {e}")),
            };
            match validate(&k, &v) {
                Ok(_) => valid.push((k.to_vec(), v.to_vec())),
                Err(e) => {
                    dropped_corrupt += 1;
                    first_problem
                        .get_or_insert_with(|| format!("entry {} is corrupt: {e}", hex(&k)));
                }
            }
        }
        Ok(())
    }));
    let read_problem = match walked {
        Ok(Ok(())) => None,
        Ok(Err(reason)) => Some(reason),
        Err(payload) => Some(format!(
            "sled panicked reading entries: {}",
            panic_message(payload.as_ref())
        )),
    };
    if read_problem.is_none() && dropped_corrupt == 0 {
        let n = valid.len();
        return Ok(Scan::Clean(db, n));
    }
    drop(db);
    let mut reason = read_problem.unwrap_or_default();
    if let Some(p) = first_problem {
        if !reason.is_empty() {
            reason.push_str("; ");
        }
        reason.push_str(&format!(
            "{dropped_corrupt} corrupt entries dropped, first: {p}"
        ));
    }
    Ok(Scan::Damaged {
        valid,
        dropped_corrupt,
        reason,
    })
}

fn flush_db(db: &sled::Db, dir: &Path) -> Result<(), CacheError> {
    db.flush().map(drop).map_err(|source| CacheError::Sled {
        path: dir.to_path_buf(),
        op: "flush",
        source,
    })
}

/// `<parent>/<name><suffix>` for `dir` = `<parent>/<name>` (trailing slashes ignored).
fn sibling(dir: &Path, suffix: &str) -> Result<PathBuf, CacheError> {
    let name = dir.file_name().ok_or_else(|| CacheError::BadPath {
        path: dir.to_path_buf(),
    })?;
    let mut name: OsString = name.to_owned();
    name.push(suffix);
    Ok(dir.with_file_name(name))
}

fn first_free_corrupt_path(dir: &Path) -> Result<PathBuf, CacheError> {
    let mut n = 1u64;
    loop {
        let candidate = sibling(dir, &format!("{CORRUPT_SUFFIX}{n}"))?;
        // symlink_metadata: a dangling link still occupies the name.
        if fs::symlink_metadata(&candidate).is_err() {
            return Ok(candidate);
        }
        n += 1;
    }
}

fn rename(from: &Path, to: &Path) -> Result<(), CacheError> {
    fs::rename(from, to).map_err(|source| CacheError::Io {
        path: from.to_path_buf(),
        op: "rename",
        source,
    })
}

/// Total size of the files under `dir` (0 for what cannot be read).
fn dir_bytes(dir: &Path) -> u64 {
    let Ok(entries) = fs::read_dir(dir) else {
        return 0;
    };
    entries
        .flatten()
        .map(|e| match e.metadata() {
            Ok(m) if m.is_dir() => dir_bytes(&e.path()),
            Ok(m) => m.len(),
            Err(_) => 0,
        })
        .sum()
}

fn remove_path(path: &Path) -> Result<(), CacheError> {
    let result = if path.is_dir() {
        fs::remove_dir_all(path)
    } else {
        fs::remove_file(path)
    };
    result.map_err(|source| CacheError::Io {
        path: path.to_path_buf(),
        op: "removing a stale rebuild",
        source,
    })
}

/// Makes renames inside `path`'s parent durable (fsync of the directory; Unix only).
fn sync_parent(path: &Path) -> Result<(), CacheError> {
    #[cfg(unix)]
    {
        let parent = match path.parent() {
            Some(p) if !p.as_os_str().is_empty() => p,
            _ => Path::new("."),
        };
        fs::File::open(parent)
            .and_then(|f| f.sync_all())
            .map_err(|source| CacheError::Io {
                path: parent.to_path_buf(),
                op: "fsync of the parent directory",
                source,
            })?;
    }
    #[cfg(not(unix))]
    let _ = path;
    Ok(())
}

fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write;
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        let _ = write!(s, "{b:02x}");
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(layer_id: u32, seq: u64, len: usize) -> CacheEntry {
        CacheEntry {
            layer_id,
            seq,
            base_version: seq / 2,
            sample_count: seq.wrapping_add(32),
            step: seq.wrapping_mul(3),
            delta: (0..len)
                .map(|i| (i as f32 * 0.25 - seq as f32) * (layer_id as f32 + 1.0))
                .collect(),
        }
    }

    fn temp_dir(name: &str) -> PathBuf {
        let base = std::env::temp_dir().join(format!(
            "edge-agent-durable-cache-{}-{name}",
            std::process::id()
        ));
        let _ = fs::remove_dir_all(&base);
        fs::create_dir_all(&base).unwrap();
        base
    }

    fn seqs(entries: &[CacheEntry]) -> Vec<(u32, u64)> {
        entries.iter().map(|e| (e.layer_id, e.seq)).collect()
    }

    #[test]
    fn round_trip_in_key_order_across_reopen() {
        let base = temp_dir("round-trip");
        let dir = base.join("cache");
        let written = [
            entry(2, 1, 3),
            entry(1, 300, 0),
            entry(1, 2, 1000),
            entry(0, u64::MAX, 5),
            entry(1, 256, 7),
        ];
        {
            let (cache, report) = DurableCache::open(&dir).unwrap();
            assert!(report.is_clean());
            assert_eq!(report.recovered, 0);
            assert!(cache.is_empty());
            for e in &written {
                cache.put_durable(e).unwrap();
            }
            assert_eq!(cache.len(), written.len());
            assert!(cache.bytes_on_disk().unwrap() > 0);
        }
        let (cache, report) = DurableCache::open(&dir).unwrap();
        assert!(report.is_clean(), "{report:?}");
        assert_eq!(report.recovered, written.len());
        let got = cache.entries().unwrap();
        assert_eq!(
            seqs(&got),
            vec![(0, u64::MAX), (1, 2), (1, 256), (1, 300), (2, 1)]
        );
        for e in &written {
            assert!(got.contains(e), "{:?} lost", (e.layer_id, e.seq));
        }

        // Overwrite, remove (missing seqs ignored).
        let newer = entry(1, 2, 4);
        cache.put_durable(&newer).unwrap();
        cache.remove(1, &[256, 300, 999]).unwrap();
        cache.flush().unwrap();
        drop(cache);
        let (cache, _) = DurableCache::open(&dir).unwrap();
        let got = cache.entries().unwrap();
        assert_eq!(seqs(&got), vec![(0, u64::MAX), (1, 2), (2, 1)]);
        assert_eq!(got[1], newer);
        drop(cache);
        fs::remove_dir_all(&base).unwrap();
    }

    #[test]
    fn replace_is_atomic_and_checks_the_layer() {
        let base = temp_dir("replace");
        let dir = base.join("cache");
        let bundle = entry(3, 10, 6);
        {
            let (cache, _) = DurableCache::open(&dir).unwrap();
            for seq in [7, 8, 9] {
                cache.put_durable(&entry(3, seq, 6)).unwrap();
            }
            cache.put_durable(&entry(4, 8, 2)).unwrap();
            let err = cache.replace(3, &[7, 8], &entry(4, 11, 6)).unwrap_err();
            assert!(matches!(
                err,
                CacheError::LayerMismatch { put_layer: 4, .. }
            ));
            assert_eq!(cache.len(), 4, "a refused replace changes nothing");
            cache.replace(3, &[7, 8, 9], &bundle).unwrap();
            // Dropped without another flush: the replace must already be durable.
        }
        let (cache, report) = DurableCache::open(&dir).unwrap();
        assert!(report.is_clean());
        let got = cache.entries().unwrap();
        assert_eq!(seqs(&got), vec![(3, 10), (4, 8)], "parts gone, bundle in");
        assert_eq!(got[0], bundle);
        drop(cache);
        fs::remove_dir_all(&base).unwrap();
    }

    /// Writes through sled directly, as a crash mid-write or bit rot would leave things.
    fn raw_insert(dir: &Path, key: &[u8], value: &[u8]) {
        // The cache just dropped may still hold its lock for a moment (see `open_sled`).
        let db = match open_sled(dir, DEFAULT_CAPACITY_BYTES) {
            Ok(db) => db,
            Err(_) => panic!("cannot open {} for a raw write", dir.display()),
        };
        db.insert(key, value).unwrap();
        db.flush().unwrap();
    }

    #[test]
    fn corrupt_values_are_dropped_reported_and_the_rest_kept() {
        let base = temp_dir("corrupt-value");
        let dir = base.join("cache");
        let kept = [entry(1, 1, 8), entry(1, 4, 8), entry(2, 1, 8)];
        {
            let (cache, _) = DurableCache::open(&dir).unwrap();
            for e in &kept {
                cache.put_durable(e).unwrap();
            }
        }
        let mut flipped = entry(1, 2, 8).to_bytes();
        flipped[20] ^= 0x10;
        raw_insert(&dir, &key_of(1, 2), &flipped);
        raw_insert(
            &dir,
            &key_of(1, 3),
            b"garbage bytes, not an entry at all........ long enough",
        );
        // A valid entry under another entry's key.
        raw_insert(&dir, &key_of(9, 9), &entry(1, 4, 8).to_bytes());

        let (cache, report) = DurableCache::open(&dir).unwrap();
        assert_eq!(report.recovered, 3);
        assert_eq!(report.dropped_corrupt, 3);
        let aside = report.moved_aside.clone().expect("moved aside");
        assert_eq!(aside.path, base.join("cache.corrupt-1"));
        assert!(aside.reason.contains("corrupt"), "{}", aside.reason);
        assert!(
            aside.path.is_dir(),
            "the damaged copy is kept for inspection"
        );
        assert!(!base.join("cache.rebuild").exists());
        assert_eq!(cache.entries().unwrap(), kept.to_vec());
        drop(cache);

        // The rebuilt cache is clean; a second corruption goes to the next free name.
        let (cache, report) = DurableCache::open(&dir).unwrap();
        assert!(report.is_clean(), "{report:?}");
        drop(cache);
        raw_insert(&dir, &key_of(5, 5), b"x");
        let (cache, report) = DurableCache::open(&dir).unwrap();
        assert_eq!(
            report.moved_aside.map(|m| m.path),
            Some(base.join("cache.corrupt-2"))
        );
        assert_eq!(report.dropped_corrupt, 1);
        assert_eq!(cache.len(), 3);
        drop(cache);
        fs::remove_dir_all(&base).unwrap();
    }

    #[test]
    fn a_directory_that_is_not_a_sled_db_is_moved_aside_and_rebuilt() {
        let base = temp_dir("not-sled");
        // Garbage where sled expects its files.
        let dir = base.join("cache");
        fs::create_dir_all(&dir).unwrap();
        fs::write(
            dir.join("conf"),
            b"\xff\x00 this is not a sled config \x13\x37",
        )
        .unwrap();
        fs::write(dir.join("db"), vec![0xA5u8; 4096]).unwrap();
        let (cache, report) = DurableCache::open(&dir).unwrap();
        let aside = report.moved_aside.clone().expect("moved aside");
        assert_eq!(aside.path, base.join("cache.corrupt-1"));
        assert_eq!(report.recovered, 0);
        assert!(aside.path.join("conf").is_file(), "old files kept aside");
        cache.put_durable(&entry(1, 1, 2)).unwrap();
        drop(cache);
        let (cache, report) = DurableCache::open(&dir).unwrap();
        assert!(report.is_clean(), "{report:?}");
        assert_eq!(cache.entries().unwrap(), vec![entry(1, 1, 2)]);
        drop(cache);

        // A real sled database whose data file was overwritten with garbage.
        let trashed = base.join("trashed");
        {
            let (cache, _) = DurableCache::open(&trashed).unwrap();
            for seq in 0..20 {
                cache.put_durable(&entry(2, seq, 300)).unwrap();
            }
        }
        let db_file = trashed.join("db");
        let len = fs::metadata(&db_file).unwrap().len() as usize;
        fs::write(&db_file, vec![0x5Au8; len]).unwrap();
        // sled 0.34.7 reads such a file as unwritten segments (see the module docs): no
        // panic, no error, and whatever it returns is valid; the cache stays usable.
        let (cache, _report) = DurableCache::open(&trashed).unwrap();
        let survivors = cache.entries().unwrap();
        assert!(survivors.len() <= 20);
        cache.put_durable(&entry(2, 99, 1)).unwrap();
        drop(cache);
        let (cache, report) = DurableCache::open(&trashed).unwrap();
        assert!(report.is_clean(), "{report:?}");
        assert!(cache.entries().unwrap().contains(&entry(2, 99, 1)));
        drop(cache);

        // A plain file where the directory should be.
        let file_dir = base.join("file-cache");
        fs::write(&file_dir, b"not a directory").unwrap();
        let (cache, report) = DurableCache::open(&file_dir).unwrap();
        assert_eq!(
            report.moved_aside.map(|m| m.path),
            Some(base.join("file-cache.corrupt-1"))
        );
        assert!(base.join("file-cache.corrupt-1").is_file());
        assert!(cache.is_empty());
        drop(cache);
        fs::remove_dir_all(&base).unwrap();
    }

    #[test]
    fn an_empty_cache_that_grew_is_compacted_and_a_pending_one_is_not() {
        let base = temp_dir("compact");
        let dir = base.join("cache");
        let (mut cache, _) = DurableCache::open(&dir).unwrap();
        // 40 deltas of 100k values (400 KB each), as a long outage would cache them.
        for seq in 0..40 {
            cache.put_durable(&entry(1, seq, 100_000)).unwrap();
        }
        cache.remove(1, &(0..39).collect::<Vec<_>>()).unwrap();
        cache.flush().unwrap();
        let grown = cache.dir_bytes();
        assert!(grown > 4 << 20, "{grown}");
        // One delta still pending: nothing happens.
        assert_eq!(cache.compact_if_empty(1 << 20).unwrap(), None);
        assert_eq!(cache.len(), 1);
        cache.remove(1, &[39]).unwrap();
        cache.flush().unwrap();
        // Below the threshold: nothing happens either.
        assert_eq!(cache.compact_if_empty(u64::MAX).unwrap(), None);
        let freed = cache.compact_if_empty(1 << 20).unwrap().expect("compacted");
        assert!(freed > grown / 2, "freed {freed} of {grown}");
        assert!(cache.dir_bytes() < grown / 4, "{}", cache.dir_bytes());
        // The compacted cache works and is durable.
        cache.put_durable(&entry(2, 7, 10)).unwrap();
        drop(cache);
        let (cache, report) = DurableCache::open(&dir).unwrap();
        assert!(report.is_clean(), "{report:?}");
        assert_eq!(cache.entries().unwrap(), vec![entry(2, 7, 10)]);
        drop(cache);
        fs::remove_dir_all(&base).unwrap();
    }

    #[test]
    fn a_bloated_cache_with_pending_entries_is_compacted_without_losing_any() {
        let base = temp_dir("bloated");
        let dir = base.join("cache");
        let (mut cache, _) = DurableCache::open(&dir).unwrap();
        // A long outage: many deltas cached and coalesced away, three still pending.
        for seq in 0..40 {
            cache.put_durable(&entry(1, seq, 100_000)).unwrap();
        }
        cache.remove(1, &(0..37).collect::<Vec<_>>()).unwrap();
        cache.flush().unwrap();
        let pending = cache.entries().unwrap();
        assert_eq!(pending.len(), 3);
        let grown = cache.dir_bytes();
        // Not bloated enough for a factor of 1000: nothing happens.
        assert_eq!(cache.compact_if_bloated(1 << 20, 1000).unwrap(), None);
        let freed = cache
            .compact_if_bloated(1 << 20, 4)
            .unwrap()
            .expect("compacted");
        assert!(freed > grown / 2, "freed {freed} of {grown}");
        assert_eq!(cache.entries().unwrap(), pending);
        assert!(!base.join("cache.rebuild").exists() && !base.join("cache.old").exists());
        drop(cache);
        let (cache, report) = DurableCache::open(&dir).unwrap();
        assert!(report.is_clean(), "{report:?}");
        assert_eq!(cache.entries().unwrap(), pending, "durable after the swap");
        drop(cache);

        // A compaction interrupted after moving the original aside: the complete copy wins and
        // the original is deleted.
        fs::rename(&dir, base.join("cache.rebuild")).unwrap();
        fs::create_dir_all(base.join("cache.old")).unwrap();
        fs::write(base.join("cache.old/junk"), b"old").unwrap();
        let (cache, _) = DurableCache::open(&dir).unwrap();
        assert_eq!(cache.entries().unwrap(), pending);
        assert!(!base.join("cache.old").exists() && !base.join("cache.rebuild").exists());
        drop(cache);
        fs::remove_dir_all(&base).unwrap();
    }

    #[test]
    fn an_open_cache_is_locked_not_moved_aside() {
        let base = temp_dir("locked");
        let dir = base.join("cache");
        let (cache, _) = DurableCache::open(&dir).unwrap();
        cache.put_durable(&entry(1, 1, 2)).unwrap();
        let err = DurableCache::open(&dir).unwrap_err();
        assert!(matches!(err, CacheError::Locked { .. }), "{err}");
        assert!(err.to_string().contains("cache"));
        assert!(!base.join("cache.corrupt-1").exists());
        assert_eq!(cache.len(), 1);
        drop(cache);
        fs::remove_dir_all(&base).unwrap();
    }

    #[test]
    fn an_interrupted_rebuild_is_finished_or_discarded() {
        let base = temp_dir("interrupted");
        let dir = base.join("cache");
        let rebuild = base.join("cache.rebuild");
        // Crash between the renames: only the complete rebuild is left.
        {
            let (cache, _) = DurableCache::open(&rebuild).unwrap();
            cache.put_durable(&entry(1, 5, 3)).unwrap();
        }
        let (cache, report) = DurableCache::open(&dir).unwrap();
        assert!(report.finished_rebuild);
        assert_eq!(report.recovered, 1);
        assert!(!rebuild.exists());
        drop(cache);
        // Crash before the swap: the original is authoritative, the partial rebuild goes.
        fs::create_dir_all(&rebuild).unwrap();
        fs::write(rebuild.join("db"), b"partial").unwrap();
        let (cache, report) = DurableCache::open(&dir).unwrap();
        assert!(report.is_clean(), "{report:?}");
        assert!(!rebuild.exists());
        assert_eq!(cache.entries().unwrap(), vec![entry(1, 5, 3)]);
        drop(cache);
        fs::remove_dir_all(&base).unwrap();
    }

    #[test]
    fn bad_paths_are_typed_errors() {
        let err = DurableCache::open("/").unwrap_err();
        assert!(matches!(err, CacheError::BadPath { .. }), "{err}");
        assert_eq!(
            sibling(Path::new("a/b/"), ".rebuild").unwrap(),
            PathBuf::from("a/b.rebuild")
        );
    }
}
