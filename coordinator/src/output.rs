//! What the coordinator state machine asks its shell to do ([`Output`]) and what it reports
//! for logs ([`CoordEvent`]).

use protocol::{ErrorReply, Message, Role};

use crate::config::ConnId;
use crate::error::{InputError, RefusalReason};
use crate::layer_map::LayerMove;

/// Something the shell must do, drained with
/// [`CoordinatorState::poll_output`](crate::CoordinatorState::poll_output) in order.
#[derive(Clone, Debug, PartialEq)]
pub enum Output {
    /// Send `msg` on connection `conn`.
    Send {
        /// The connection.
        conn: ConnId,
        /// The message.
        msg: Message,
    },
    /// Close connection `conn` (after sending what was queued before for it).
    Close {
        /// The connection.
        conn: ConnId,
        /// Why, for the peer and the logs.
        reason: String,
    },
    /// Dial aggregator `aggregator_id` at `addr` and send it
    /// [`protocol::Subscribe`]: the coordinator then receives every
    /// [`protocol::LayerVersion`] it broadcasts (the global checkpoint). A new `Subscribe`
    /// for an aggregator replaces the previous subscription.
    Subscribe {
        /// The aggregator.
        aggregator_id: u64,
        /// Its `host:port`.
        addr: String,
        /// Its certificate name (the TLS server name to dial it by).
        name: String,
    },
    /// Drop the subscription to `aggregator_id` (it left or lost its lease).
    Unsubscribe {
        /// The aggregator.
        aggregator_id: u64,
    },
    /// Something worth logging.
    Event(CoordEvent),
}

/// What happened inside the coordinator.
#[derive(Clone, Debug, PartialEq)]
pub enum CoordEvent {
    /// A node joined (or rejoined: `rejoin` is true when its id was already a member).
    Joined {
        /// Node id.
        node_id: u64,
        /// Certificate name of the peer.
        name: String,
        /// Its role.
        role: Role,
        /// Its listen address (empty for nodes that only dial out).
        addr: String,
        /// Whether it replaced an existing membership.
        rejoin: bool,
    },
    /// A node left on purpose.
    Left {
        /// Node id.
        node_id: u64,
        /// Certificate name.
        name: String,
        /// The reason it gave.
        reason: String,
    },
    /// A node did not heartbeat within its lease and was removed.
    LeaseExpired {
        /// Node id.
        node_id: u64,
        /// Certificate name.
        name: String,
        /// Its role.
        role: Role,
    },
    /// The layer map changed.
    Rebalanced {
        /// The new map epoch.
        epoch: u64,
        /// The new map, `(layer_id, aggregator_id)`.
        owners: Vec<(u32, u64)>,
        /// Layers whose owner changed.
        moved: Vec<LayerMove>,
        /// Cached layer versions sent to new owners, `(layer_id, version, aggregator_id)`.
        handed_over: Vec<(u32, u64, u64)>,
    },
    /// No aggregator is live: every layer is unowned until one joins.
    NoAggregators {
        /// The map epoch (of the now empty map).
        epoch: u64,
    },
    /// A join was refused.
    Refused {
        /// The connection.
        conn: ConnId,
        /// Certificate name of the peer.
        peer: String,
        /// Why.
        reason: RefusalReason,
    },
    /// A message was rejected with an error reply (the connection stays open).
    BadInput {
        /// The connection.
        conn: ConnId,
        /// Certificate name of the peer.
        peer: String,
        /// Why.
        reason: InputError,
    },
    /// The global checkpoint of a layer advanced.
    CheckpointAdvanced {
        /// The layer.
        layer_id: u32,
        /// Its new version.
        version: u64,
        /// Aggregator that produced it.
        aggregator_id: u64,
    },
    /// The checkpoint of a layer was sent to its new owner (after the old owner's final
    /// version arrived, or at once when the old owner is gone).
    HandedOver {
        /// The layer.
        layer_id: u32,
        /// The version handed over.
        version: u64,
        /// The new owner.
        to: u64,
    },
    /// The old owner of a moving layer did not send its final version in time; the
    /// checkpoint was handed over instead.
    ReleaseTimedOut {
        /// The layer.
        layer_id: u32,
        /// The old owner.
        from: u64,
    },
    /// A layer's spread of the trainers' distances to the global model grew past its
    /// recent low ([`crate::divergence`]).
    Divergence {
        /// The layer.
        layer_id: u32,
        /// Its name.
        layer: String,
        /// The largest relative distance over the live trainers.
        spread: f32,
        /// The layer's lowest spread of the monitor's window.
        baseline: f32,
        /// The trainer farthest from the global model.
        farthest_node: u64,
        /// Its certificate name.
        farthest: String,
    },
    /// A peer sent an error reply (logged, never answered: no error ping-pong).
    PeerError {
        /// The connection.
        conn: ConnId,
        /// Certificate name of the peer.
        peer: String,
        /// Its error.
        error: ErrorReply,
    },
}
