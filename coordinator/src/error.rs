//! Typed reasons the coordinator refuses a join or rejects a message.

use protocol::ErrorCode;

/// Why a [`protocol::Join`] was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error, serde::Serialize)]
pub enum RefusalReason {
    /// The credentials do not match the cluster secret (the connection is closed).
    #[error("bad credentials")]
    BadCredentials,
    /// An aggregator's `listen_addr` is not a socket address.
    #[error("aggregator listen_addr {addr:?} is not a socket address (host:port)")]
    InvalidListenAddr {
        /// What it sent.
        addr: String,
    },
    /// The node id is held by a member presenting another certificate name.
    #[error("node id {node_id} is held by peer {holder:?}")]
    NodeIdTaken {
        /// The contested id.
        node_id: u64,
        /// Certificate name of the member holding it.
        holder: String,
    },
    /// The connection already joined under another node id.
    #[error("this connection already joined as node {node_id}")]
    ConnectionAlreadyJoined {
        /// The id it joined as.
        node_id: u64,
    },
}

impl RefusalReason {
    /// The error code sent back with the refusal.
    pub fn code(&self) -> ErrorCode {
        match self {
            RefusalReason::BadCredentials => ErrorCode::Unauthorized,
            _ => ErrorCode::BadRequest,
        }
    }
}

/// Why a message other than a join was rejected (answered with an error reply; the
/// connection stays open).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error, serde::Serialize)]
pub enum InputError {
    /// The message kind is not one the coordinator accepts.
    #[error("the coordinator does not accept {kind} messages")]
    UnexpectedKind {
        /// [`protocol::Message::kind`] of the message.
        kind: &'static str,
    },
    /// A member message arrived on a connection that has not joined.
    #[error("{kind} from a connection that has not joined (or whose lease expired): join first")]
    NotJoined {
        /// [`protocol::Message::kind`] of the message.
        kind: &'static str,
    },
    /// The message names another node than the one that joined on this connection.
    #[error("{kind} names node {claimed} but this connection joined as node {joined}")]
    WrongNode {
        /// [`protocol::Message::kind`] of the message.
        kind: &'static str,
        /// Node id in the message.
        claimed: u64,
        /// Node id of the connection.
        joined: u64,
    },
    /// A layer version from a node that is not a live aggregator.
    #[error(
        "LayerVersion from node {aggregator_id}, which is not a live aggregator on this connection"
    )]
    NotAnAggregator {
        /// The claimed aggregator id.
        aggregator_id: u64,
    },
    /// A layer version of a layer the coordinator does not know.
    #[error("LayerVersion of unknown layer {layer_id}")]
    UnknownLayer {
        /// The layer id.
        layer_id: u32,
    },
    /// A layer version whose shape differs from the manifest's.
    #[error("LayerVersion of layer {layer_id} has shape {got:?}, the manifest says {expected:?}")]
    ShapeMismatch {
        /// The layer id.
        layer_id: u32,
        /// Shape in the message.
        got: Vec<u32>,
        /// Shape in the manifest.
        expected: Vec<u32>,
    },
    /// A layer version holding a NaN or an infinity.
    #[error("LayerVersion of layer {layer_id} holds a non-finite value at index {index}")]
    NonFiniteValue {
        /// The layer id.
        layer_id: u32,
        /// Index of the first non-finite value.
        index: usize,
    },
    /// A layer version whose payload does not decode.
    #[error("LayerVersion of layer {layer_id} does not decode: {reason}")]
    UndecodablePayload {
        /// The layer id.
        layer_id: u32,
        /// The codec error.
        reason: String,
    },
}

impl InputError {
    /// The error code sent back.
    pub fn code(&self) -> ErrorCode {
        match self {
            InputError::NotJoined { .. } => ErrorCode::UnknownNode,
            _ => ErrorCode::BadRequest,
        }
    }
}
