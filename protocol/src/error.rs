//! Typed errors of the wire format: [`FrameError`] for framing and message
//! (de)serialization, [`CodecError`] for tensor codecs.
//!
//! Every error that can be caused by bytes from a peer is a variant here; the
//! decoders in this crate never panic on such input. Each message says what was
//! wrong and what the receiver should do about it.

use crate::message::Codec;

/// Why a frame could not be encoded or decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    /// The first four bytes are not the dreamddp magic.
    #[error(
        "bad frame magic {got:02x?} (expected {expected:02x?}): the peer does not speak the \
         dreamddp wire protocol or the byte stream lost sync; close the connection"
    )]
    BadMagic {
        /// The bytes found where the magic should be (fewer than 4 if the input is shorter).
        got: Vec<u8>,
        /// The magic this build expects.
        expected: [u8; 4],
    },
    /// The frame uses a protocol version this build does not implement.
    #[error(
        "unsupported protocol version {got} (this build supports version {supported}): \
         upgrade the older side so both run the same dreamddp release"
    )]
    UnsupportedVersion {
        /// Version found in the header.
        got: u16,
        /// Version this build speaks.
        supported: u16,
    },
    /// The header sets flag bits this build does not know.
    #[error(
        "frame header has unknown flag bits {flags:#06x} (known: {known:#06x}): the peer is \
         newer than this build or the stream is corrupt; close the connection"
    )]
    UnsupportedFlags {
        /// Flags found in the header.
        flags: u16,
        /// Flag bits this build understands.
        known: u16,
    },
    /// The body is longer than the configured maximum; nothing was allocated.
    #[error(
        "frame body of {len} bytes exceeds the maximum of {max} bytes: split the tensor into \
         smaller layers/buckets, use a compressing codec, or raise the max body length on both sides"
    )]
    TooLarge {
        /// Body length (declared in a header, or produced by the encoder).
        len: u64,
        /// Configured maximum body length.
        max: u32,
    },
    /// Fewer bytes are available than the frame needs.
    #[error(
        "truncated frame: need {need} bytes, have {have}; wait for more bytes \
         (a streaming decoder does this for you) or treat the connection as broken"
    )]
    Truncated {
        /// Total bytes the frame needs (header, or header plus body).
        need: usize,
        /// Bytes available.
        have: usize,
    },
    /// The body's CRC32C does not match the header.
    #[error(
        "frame checksum mismatch: header says crc32c {expected:#010x}, body hashes to \
         {actual:#010x}; the bytes were corrupted in transit, drop the frame and ask for a resend"
    )]
    ChecksumMismatch {
        /// Checksum stored in the header.
        expected: u32,
        /// Checksum computed over the received body.
        actual: u32,
    },
    /// The body passed the checksum but is not a valid archived [`crate::Message`].
    #[error(
        "malformed message body: {0}; the peer sent a message this build cannot validate \
         (version skew or a bug on the sender), close the connection"
    )]
    Malformed(String),
    /// The message could not be serialized (e.g. a field beyond rkyv's 32-bit offsets).
    #[error("could not serialize message: {0}; make the message smaller")]
    Serialize(String),
}

/// Why a tensor could not be encoded or decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CodecError {
    /// The byte length does not match what the codec needs for the element count.
    #[error(
        "{codec:?} payload has {actual} bytes but {expected} bytes are needed for the declared \
         element count; the payload and its shape disagree, drop it and ask for a resync"
    )]
    LengthMismatch {
        /// Codec being decoded.
        codec: Codec,
        /// Bytes the codec needs.
        expected: u64,
        /// Bytes present.
        actual: u64,
    },
    /// Low-rank factors whose rows or rank do not fit the element count.
    #[error(
        "low-rank payload with {rows} rows and rank {rank} for {len} elements: {why}; drop it \
         and ask for a resync"
    )]
    BadLowRank {
        /// Rows declared.
        rows: u32,
        /// Rank declared.
        rank: u32,
        /// Element count of the shape.
        len: u64,
        /// What is wrong.
        why: &'static str,
    },
    /// The declared element count is above the decode limit; nothing was allocated.
    #[error(
        "tensor of {len} elements exceeds the decode limit of {max} elements: split the layer \
         or raise the limit on the receiver"
    )]
    TooManyElements {
        /// Declared element count.
        len: u64,
        /// Limit.
        max: u64,
    },
    /// The shape's element count overflows `u64`.
    #[error("shape {shape:?} has more elements than fit in u64; the shape is corrupt")]
    ShapeOverflow {
        /// The offending shape.
        shape: Vec<u32>,
    },
    /// The shape's element count does not match the number of values.
    #[error(
        "shape {shape:?} holds {shape_len} elements but {values_len} values were given; \
         pass the layer's real shape"
    )]
    ShapeMismatch {
        /// Shape given.
        shape: Vec<u32>,
        /// Product of the shape.
        shape_len: u64,
        /// Number of values given.
        values_len: u64,
    },
    /// A top-k index points outside the tensor.
    #[error(
        "top-k index {index} at position {position} is out of range for a tensor of {len} \
         elements; drop the payload"
    )]
    IndexOutOfRange {
        /// Position of the index in the index list.
        position: usize,
        /// The index.
        index: u32,
        /// Tensor length.
        len: u64,
    },
    /// Top-k indices must be strictly increasing (which also rules out duplicates).
    #[error(
        "top-k index {index} at position {position} does not follow {previous}: indices must be \
         strictly increasing; drop the payload"
    )]
    IndicesNotIncreasing {
        /// Position of the index in the index list.
        position: usize,
        /// The previous index.
        previous: u32,
        /// The index.
        index: u32,
    },
    /// Top-k `k` does not fit the tensor (k > len) or exceeds what a u32 index can address.
    #[error("top-k with k = {k} is invalid for a tensor of {len} elements")]
    InvalidK {
        /// Requested k.
        k: u64,
        /// Tensor length.
        len: u64,
    },
    /// The zstd stream inflates beyond the size the codec declares (a decompression bomb).
    #[error(
        "zstd payload inflates beyond the declared {limit} bytes; it is corrupt or malicious, \
         drop it"
    )]
    DecompressedTooLarge {
        /// Declared decompressed size.
        limit: u64,
    },
    /// zstd failed (corrupt stream on decode, or an internal error on encode).
    #[error("zstd failed: {0}; drop the payload and ask for a resend")]
    Zstd(String),
    /// A top-k compressor's residual was built for a tensor of another length.
    #[error(
        "top-k compressor holds a residual for {residual_len} elements but got {values_len} \
         values: use one compressor per tensor, or reset it when the layer changes"
    )]
    ResidualLengthMismatch {
        /// Length of the stored residual.
        residual_len: usize,
        /// Length of the values passed in.
        values_len: usize,
    },
}
