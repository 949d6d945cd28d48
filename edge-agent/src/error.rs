//! Typed errors of the sync client: misuse by the driver or bad construction input
//! ([`ClientError`]) and corrupt cache entries ([`CacheDecodeError`]).

use engine::staleness::StalenessError;
use protocol::CodecError;
use thiserror::Error;

/// Why a [`crate::SyncClient`] call was refused.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum ClientError {
    /// The layer id is not one this client synchronizes.
    #[error("layer {0} is not synchronized by this client")]
    UnknownLayer(u32),
    /// Two layer specs share an id.
    #[error("layer {0} is listed twice")]
    DuplicateLayer(u32),
    /// A layer's period is zero.
    #[error("layer {0}: period_steps must be at least 1")]
    ZeroPeriod(u32),
    /// `max_attempts` is zero.
    #[error("max_attempts must be at least 1")]
    ZeroAttempts,
    /// A vector of the wrong length for the layer.
    #[error("layer {layer_id}: {what} has {got} values, the layer has {expected}")]
    LengthMismatch {
        /// The layer.
        layer_id: u32,
        /// Which vector.
        what: &'static str,
        /// Layer length.
        expected: usize,
        /// Length given.
        got: usize,
    },
    /// A cache entry handed to [`crate::SyncClient::restore_from_cache`] repeats a seq.
    #[error("layer {layer_id}: cache entry seq {seq} is present twice")]
    DuplicateCacheEntry {
        /// The layer.
        layer_id: u32,
        /// The repeated seq.
        seq: u64,
    },
    /// Encoding a delta failed.
    #[error("encoding a delta failed: {0}")]
    Codec(#[from] CodecError),
    /// The rebase arithmetic refused its inputs.
    #[error("rebase failed: {0}")]
    Rebase(#[from] StalenessError),
}

/// Why cache-entry bytes could not be decoded.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum CacheDecodeError {
    /// Fewer bytes than the header and trailer need, or than the declared length.
    #[error("cache entry truncated: {len} bytes, {needed} needed")]
    Truncated {
        /// Bytes present.
        len: usize,
        /// Bytes needed.
        needed: usize,
    },
    /// Not a cache entry (bad magic).
    #[error("not a cache entry (bad magic)")]
    BadMagic,
    /// The CRC32C does not match.
    #[error("cache entry checksum mismatch: stored {stored:#010x}, computed {computed:#010x}")]
    Checksum {
        /// Stored checksum.
        stored: u32,
        /// Computed checksum.
        computed: u32,
    },
    /// More bytes than the declared length.
    #[error("cache entry has {0} trailing bytes")]
    TrailingBytes(usize),
}
