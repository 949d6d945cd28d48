//! Typed errors of the aggregator: construction ([`AggregatorError`]), rejected peer input
//! ([`InputError`], which maps to a protocol [`ErrorCode`]) and snapshot decoding
//! ([`SnapshotError`]).

use engine::staleness::StalenessError;
use protocol::{CodecError, ErrorCode};
use thiserror::Error;

/// Why an aggregator could not be built.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum AggregatorError {
    /// Two owned layers share an id.
    #[error("layer {layer_id} is listed twice; each owned layer needs a unique id")]
    DuplicateLayer {
        /// The repeated id.
        layer_id: u32,
    },
    /// An owned layer's values do not match its shape.
    #[error(
        "layer {layer_id}: shape {shape:?} holds {shape_len} elements but {len} values were given"
    )]
    ShapeMismatch {
        /// The layer.
        layer_id: u32,
        /// Its shape.
        shape: Vec<u32>,
        /// Product of the shape (saturating).
        shape_len: u64,
        /// Number of values given.
        len: usize,
    },
    /// An initial value is NaN or infinite.
    #[error("layer {layer_id}: initial value {index} is not finite")]
    NonFiniteValue {
        /// The layer.
        layer_id: u32,
        /// Element index.
        index: usize,
    },
    /// The staleness function's parameters are invalid.
    #[error("bad staleness function: {0}")]
    Staleness(#[from] StalenessError),
    /// `outer_lr` is not finite and positive.
    #[error("outer_lr = {0} must be finite and > 0")]
    BadOuterLr(f32),
    /// `round_size` is zero.
    #[error("round_size must be at least 1 (1 = fully asynchronous)")]
    ZeroRoundSize,
}

/// Why a message from a peer was rejected (answered with an [`protocol::ErrorReply`] and
/// reported as [`crate::AggEvent::BadInput`]). The aggregator keeps serving others.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum InputError {
    /// The delta's layer is not in this aggregator's shard.
    #[error("layer {layer_id} is not owned by this aggregator; consult the layer→aggregator map")]
    NotOwner {
        /// Requested layer.
        layer_id: u32,
    },
    /// The delta's shape differs from the layer's.
    #[error("layer {layer_id}: delta shape {got:?} does not match the layer's shape {expected:?}")]
    ShapeMismatch {
        /// The layer.
        layer_id: u32,
        /// The layer's shape.
        expected: Vec<u32>,
        /// The shape sent.
        got: Vec<u32>,
    },
    /// The payload bytes do not decode for the declared shape and codec.
    #[error("layer {layer_id}: delta payload does not decode: {source}")]
    Decode {
        /// The layer.
        layer_id: u32,
        /// The codec error.
        #[source]
        source: CodecError,
    },
    /// The delta holds a NaN or infinity, which would poison the layer.
    #[error("layer {layer_id}: delta element {index} is not finite")]
    NonFinite {
        /// The layer.
        layer_id: u32,
        /// First offending element.
        index: usize,
    },
    /// The payload's `node_id` is not the (authenticated) sender.
    #[error("payload claims node {claimed} but arrived from node {from}")]
    NodeMismatch {
        /// `node_id` in the payload.
        claimed: u64,
        /// Sender as identified by the transport.
        from: u64,
    },
    /// A delta with `sample_count = 0` carries no averaging weight.
    #[error("layer {layer_id}: sample_count is 0; a delta must carry the samples behind it")]
    ZeroSamples {
        /// The layer.
        layer_id: u32,
    },
    /// A message kind the aggregator does not serve.
    #[error("an aggregator does not handle {kind} messages")]
    Unexpected {
        /// Message kind.
        kind: &'static str,
    },
}

impl InputError {
    /// The protocol error class this rejection is reported with.
    pub fn code(&self) -> ErrorCode {
        match self {
            InputError::NotOwner { .. } => ErrorCode::NotOwner,
            _ => ErrorCode::BadRequest,
        }
    }
}

/// Why snapshot bytes could not be restored.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum SnapshotError {
    /// The bytes end before a field.
    #[error("snapshot truncated: needed {needed} bytes at offset {offset}, {available} available")]
    Truncated {
        /// Offset of the field.
        offset: usize,
        /// Bytes the field needs.
        needed: usize,
        /// Bytes left.
        available: usize,
    },
    /// The bytes do not start with the snapshot magic.
    #[error("not an aggregator snapshot (bad magic)")]
    BadMagic,
    /// A format version this build does not read.
    #[error("snapshot format version {0} is not supported")]
    UnsupportedVersion(u32),
    /// The CRC32C over the body does not match.
    #[error("snapshot checksum mismatch: stored {stored:#010x}, computed {computed:#010x}; the file is corrupt")]
    Checksum {
        /// Checksum in the trailer.
        stored: u32,
        /// Checksum of the bytes read.
        computed: u32,
    },
    /// The body is structurally invalid (bad UTF-8, shape/length mismatch, duplicate ids, ...).
    #[error("malformed snapshot: {0}")]
    Malformed(String),
}
