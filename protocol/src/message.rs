//! Message types of the dreamddp wire protocol (rkyv 0.8 archives).
//!
//! Owns the [`Message`] enum every role exchanges, the structs inside it, the
//! tensor [`Codec`] tag, and the conversions between a layer's `&[f32]` and a
//! [`LayerPayload`] ([`payload_from_f32`], [`LayerPayload::decode_values`]).
//! Serialization lives in [`crate::frame`]; the codecs themselves in
//! [`crate::codec`].

use rkyv::{Archive, Deserialize, Serialize};

use crate::codec::{self, Encoded};
use crate::error::CodecError;

/// How a tensor's values are laid out in a payload.
///
/// The `Zstd*` variants are the same layouts as their plain counterparts,
/// wrapped in one zstd frame (level 1). zstd is only worth it when it shrinks
/// the bytes (sparse or quantized data); [`codec::maybe_compress`] makes that
/// choice.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Codec {
    /// Little-endian IEEE f32, 4 bytes per element.
    RawF32,
    /// Little-endian IEEE half precision, 2 bytes per element.
    F16,
    /// Little-endian bfloat16, 2 bytes per element.
    Bf16,
    /// The `k` entries of largest magnitude: `k` little-endian u32 indices
    /// (strictly increasing), then `k` little-endian f32 values. All other
    /// elements decode as zero.
    TopK {
        /// Number of entries kept.
        k: u32,
    },
    /// [`Codec::RawF32`] inside a zstd frame.
    ZstdRawF32,
    /// [`Codec::F16`] inside a zstd frame.
    ZstdF16,
    /// [`Codec::Bf16`] inside a zstd frame.
    ZstdBf16,
    /// [`Codec::TopK`] inside a zstd frame.
    ZstdTopK {
        /// Number of entries kept.
        k: u32,
    },
    /// Rank-`rank` factors of the values read as a `rows`-row matrix (PowerSGD-style; see
    /// [`crate::lowrank`]). `rows = 0` when encoding: `⌈√len⌉`; the payload's codec carries
    /// the rows and rank actually used.
    LowRank {
        /// Rows of the matrix view.
        rows: u32,
        /// Rank of the factors.
        rank: u32,
    },
}

impl Codec {
    /// The layout under the zstd wrap (the codec itself when not wrapped).
    pub fn base(self) -> Codec {
        match self {
            Codec::ZstdRawF32 => Codec::RawF32,
            Codec::ZstdF16 => Codec::F16,
            Codec::ZstdBf16 => Codec::Bf16,
            Codec::ZstdTopK { k } => Codec::TopK { k },
            plain => plain,
        }
    }

    /// The zstd-wrapped variant of this codec's base layout.
    pub fn with_zstd(self) -> Codec {
        match self.base() {
            Codec::RawF32 => Codec::ZstdRawF32,
            Codec::F16 => Codec::ZstdF16,
            Codec::Bf16 => Codec::ZstdBf16,
            Codec::TopK { k } => Codec::ZstdTopK { k },
            wrapped => wrapped,
        }
    }

    /// Whether the payload is wrapped in zstd.
    pub fn is_zstd(self) -> bool {
        self != self.base()
    }
}

/// One layer's tensor (a delta or parameters) sent by a node to the aggregator
/// that owns the layer.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct LayerPayload {
    /// Sending node.
    pub node_id: u64,
    /// Layer index in the model's layer manifest.
    pub layer_id: u32,
    /// Layer name (for logs and sanity checks).
    pub layer_name: String,
    /// Local training step at which the tensor was cut.
    pub step: u64,
    /// Global version of the layer the delta is relative to.
    pub base_version: u64,
    /// Version the sender believes is current (equal to `base_version` for a fresh delta).
    pub version: u64,
    /// Per-sender sequence number, echoed in [`DeltaAck`].
    pub seq: u64,
    /// Training samples behind this delta (its averaging weight).
    pub sample_count: u64,
    /// Tensor shape, row-major.
    pub shape: Vec<u32>,
    /// Layout of `payload`.
    pub codec: Codec,
    /// Encoded values.
    pub payload: Vec<u8>,
}

/// Header fields of a [`LayerPayload`], everything except the tensor itself.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct LayerMeta {
    /// Sending node.
    pub node_id: u64,
    /// Layer index.
    pub layer_id: u32,
    /// Layer name.
    pub layer_name: String,
    /// Local training step.
    pub step: u64,
    /// Global version the delta is relative to.
    pub base_version: u64,
    /// Version the sender believes is current.
    pub version: u64,
    /// Per-sender sequence number.
    pub seq: u64,
    /// Training samples behind the delta.
    pub sample_count: u64,
}

/// Number of elements a shape holds, or an error if it overflows `u64`.
pub fn shape_element_count(shape: &[u32]) -> Result<u64, CodecError> {
    shape
        .iter()
        .try_fold(1u64, |acc, &dim| acc.checked_mul(u64::from(dim)))
        .ok_or_else(|| CodecError::ShapeOverflow {
            shape: shape.to_vec(),
        })
}

fn check_shape(shape: &[u32], values_len: usize) -> Result<(), CodecError> {
    let shape_len = shape_element_count(shape)?;
    if shape_len != values_len as u64 {
        return Err(CodecError::ShapeMismatch {
            shape: shape.to_vec(),
            shape_len,
            values_len: values_len as u64,
        });
    }
    Ok(())
}

/// Build a [`LayerPayload`] from a layer's values in one call.
///
/// `codec` picks the layout. A `Zstd*` codec means "zstd allowed": the zstd
/// wrap is kept only when it makes the payload smaller, and the payload's
/// `codec` field records what was chosen. A plain codec is used as is.
/// `TopK` here is stateless (no error feedback); for error feedback encode with
/// a [`codec::TopKCompressor`] and use [`payload_from_encoded`].
pub fn payload_from_f32(
    meta: LayerMeta,
    shape: &[u32],
    values: &[f32],
    codec: Codec,
) -> Result<LayerPayload, CodecError> {
    check_shape(shape, values.len())?;
    let plain = codec::encode(values, codec.base())?;
    let encoded = if codec.is_zstd() {
        codec::maybe_compress(plain)?
    } else {
        plain
    };
    Ok(assemble_payload(meta, shape, encoded))
}

/// Build a [`LayerPayload`] from values already encoded (e.g. by a
/// [`codec::TopKCompressor`]). Checks the byte length against the shape.
pub fn payload_from_encoded(
    meta: LayerMeta,
    shape: &[u32],
    encoded: Encoded,
) -> Result<LayerPayload, CodecError> {
    let len = shape_element_count(shape)?;
    codec::check_encoded_len(&encoded.bytes, encoded.codec, len)?;
    Ok(assemble_payload(meta, shape, encoded))
}

fn assemble_payload(meta: LayerMeta, shape: &[u32], encoded: Encoded) -> LayerPayload {
    LayerPayload {
        node_id: meta.node_id,
        layer_id: meta.layer_id,
        layer_name: meta.layer_name,
        step: meta.step,
        base_version: meta.base_version,
        version: meta.version,
        seq: meta.seq,
        sample_count: meta.sample_count,
        shape: shape.to_vec(),
        codec: encoded.codec,
        payload: encoded.bytes,
    }
}

impl LayerPayload {
    /// Decode the tensor into dense row-major f32 values (length = product of
    /// `shape`). Fails with a typed error on any inconsistency.
    pub fn decode_values(&self) -> Result<Vec<f32>, CodecError> {
        let len = shape_element_count(&self.shape)?;
        codec::decode(&self.payload, self.codec, len)
    }

    /// [`Self::decode_values`] into a reused buffer (see [`codec::decode_into`]).
    pub fn decode_values_into(&self, out: &mut Vec<f32>) -> Result<(), CodecError> {
        let len = shape_element_count(&self.shape)?;
        codec::decode_into(&self.payload, self.codec, len, out)
    }

    /// The header fields, without the tensor.
    pub fn meta(&self) -> LayerMeta {
        LayerMeta {
            node_id: self.node_id,
            layer_id: self.layer_id,
            layer_name: self.layer_name.clone(),
            step: self.step,
            base_version: self.base_version,
            version: self.version,
            seq: self.seq,
            sample_count: self.sample_count,
        }
    }
}

/// Role a node asks for when it joins.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Role {
    /// A data-center worker (GPU or CPU) training inside a node.
    #[default]
    Worker,
    /// An edge device training locally and syncing under deadlines.
    Edge,
    /// A CPU aggregator owning a shard of layers.
    Aggregator,
}

/// What a joining node can do; the coordinator uses it for scheduling.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Default)]
pub struct Capabilities {
    /// Accelerators available (0 for CPU-only).
    pub gpus: u32,
    /// CPU cores available.
    pub cpu_cores: u32,
    /// Memory in bytes.
    pub memory_bytes: u64,
    /// Measured or configured uplink bandwidth, bytes per second (0 = unknown).
    pub link_bytes_per_sec: u64,
    /// Codecs the node can decode.
    pub codecs: Vec<Codec>,
}

/// A node asks the coordinator to join the cluster.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct Join {
    /// Node id the sender wants (or already had, when rejoining).
    pub node_id: u64,
    /// Requested role.
    pub role: Role,
    /// Shared secret or token proving membership.
    pub credentials: String,
    /// What the node can do.
    pub capabilities: Capabilities,
    /// Address (`host:port`) other nodes reach this node's QUIC endpoint at; empty for a
    /// node that only dials out (workers, edge agents).
    pub listen_addr: String,
}

/// The coordinator admits a node.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct JoinAck {
    /// Node id assigned (may differ from the requested one).
    pub node_id: u64,
    /// Lease length: the node must heartbeat within this many milliseconds.
    pub lease_ms: u64,
    /// Layer → owning aggregator node id, as `(layer_id, aggregator_node_id)`.
    pub layer_owners: Vec<(u32, u64)>,
    /// Current global version of each layer, as `(layer_id, version)`.
    pub layer_versions: Vec<(u32, u64)>,
    /// Epoch of the layer map in `layer_owners` (bumped at every rebalance).
    pub map_epoch: u64,
    /// Where each live aggregator listens.
    pub aggregators: Vec<AggregatorAddr>,
    /// Which aggregator produced the version in `layer_versions`, as
    /// `(layer_id, aggregator_node_id)` (layers never updated are absent); see
    /// [`LayerMap::layer_producers`].
    pub layer_producers: Vec<(u32, u64)>,
    /// See [`LayerMap::releasing_layers`].
    pub releasing_layers: Vec<u32>,
}

/// Where an aggregator listens.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct AggregatorAddr {
    /// Aggregator node id.
    pub node_id: u64,
    /// `host:port` of its QUIC endpoint.
    pub addr: String,
}

/// The coordinator's layer → aggregator map, pushed to every member when it changes
/// (an aggregator joined, left or lost its lease).
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct LayerMap {
    /// Strictly increasing map epoch; a node ignores a map older than the one it has.
    pub epoch: u64,
    /// Layer → owning aggregator node id, as `(layer_id, aggregator_node_id)`.
    pub owners: Vec<(u32, u64)>,
    /// Where each live aggregator listens.
    pub aggregators: Vec<AggregatorAddr>,
    /// The newest global version the coordinator holds of each layer, as
    /// `(layer_id, version)`. An aggregator newly given a layer with a version above 0 must
    /// not serve it until it has that version (the coordinator hands it over as a
    /// [`LayerVersion`]); deltas applied to anything older would be overwritten by the
    /// hand-over.
    pub layer_versions: Vec<(u32, u64)>,
    /// Which aggregator produced each version in `layer_versions`, as
    /// `(layer_id, aggregator_node_id)` (layers never updated are absent). Versions are
    /// numbered per branch of history: an aggregator that restarts holding a layer another
    /// aggregator has since moved on serves it only after the hand-over, even if its own
    /// copy's number is as high.
    pub layer_producers: Vec<(u32, u64)>,
    /// Layers moving away from a live aggregator: their new owner waits for the hand-over of
    /// the old owner's final version (whatever its number, 0 included) before serving them.
    pub releasing_layers: Vec<u32>,
}

/// A node asks an aggregator for the layers it owns: the aggregator adds it to its
/// subscribers (it receives every new [`LayerVersion`]) and answers with the current
/// version of each owned layer (how a newcomer bootstraps from the global model).
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
pub struct Subscribe {
    /// Subscribing node.
    pub node_id: u64,
}

/// Counters a node reports to the coordinator (for the status endpoint and the cluster
/// summary). Totals since the process started, except where noted.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Default)]
pub struct NodeStats {
    /// Reporting node.
    pub node_id: u64,
    /// Its role.
    pub role: Role,
    /// Local training steps done (0 for aggregators).
    pub step: u64,
    /// Payload bytes sent (deltas for trainers, versions for aggregators).
    pub bytes_sent: u64,
    /// Payload bytes received.
    pub bytes_received: u64,
    /// Layer deltas that missed their deadline and went to the weak-sync cache.
    pub weak_sync_events: u64,
    /// Weak-synced deltas still in the cache (not yet acknowledged).
    pub cached_pending: u64,
    /// Deltas folded into the global model (aggregators).
    pub deltas_applied: u64,
    /// Retransmitted deltas rejected as already applied (aggregators).
    pub duplicates_rejected: u64,
    /// Deltas refused as too stale (aggregators).
    pub dropped_stale: u64,
    /// Current version of each layer the node owns or holds, as `(layer_id, version)`.
    pub layer_versions: Vec<(u32, u64)>,
    /// Staleness histogram of applied deltas: entry `i` counts deltas with `τ = i`
    /// (the last entry counts `τ ≥ len − 1`).
    pub staleness_histogram: Vec<u64>,
    /// Latest local evaluation accuracy in [0, 1], if the node evaluates.
    pub accuracy: Option<f32>,
    /// Resident memory of the node's process, bytes (0 when unknown).
    pub rss_bytes: u64,
    /// Peak resident memory of the node's process since it started, bytes.
    pub peak_rss_bytes: u64,
    /// Per layer, the trainer's distance to the newest global version it holds, relative
    /// to that version's norm (`‖θ − θ_global‖ / ‖θ_global‖`), as `(layer_id, distance)`;
    /// empty for aggregators. The coordinator's divergence monitor reads it.
    pub layer_divergence: Vec<(u32, f32)>,
}

/// Liveness: renews a node's lease (sent by nodes, echoed by the coordinator).
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
pub struct Heartbeat {
    /// Node whose lease is renewed.
    pub node_id: u64,
    /// Lease length requested or granted, milliseconds.
    pub lease_ms: u64,
    /// Sender's clock, milliseconds (informational; never trusted for ordering).
    pub now_ms: u64,
}

/// A node leaves the cluster on purpose (elastic leave).
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct Leave {
    /// Leaving node.
    pub node_id: u64,
    /// Human-readable reason, for logs.
    pub reason: String,
}

/// An aggregator broadcasts a new global version of a layer it owns.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct LayerVersion {
    /// Aggregator that owns the layer.
    pub aggregator_id: u64,
    /// Layer index.
    pub layer_id: u32,
    /// Layer name.
    pub layer_name: String,
    /// The new global version.
    pub version: u64,
    /// Tensor shape, row-major.
    pub shape: Vec<u32>,
    /// Layout of `payload`.
    pub codec: Codec,
    /// The layer's full parameters at `version`, encoded.
    pub payload: Vec<u8>,
    /// For every node whose deltas are in this version: the highest seq of this layer
    /// applied. An aggregator that adopts the version (a hand-over after a rebalance) seeds
    /// its at-most-once ledger from it, so a delta already in the version and retransmitted
    /// to the new owner (its ack was lost with the old owner) is not applied twice.
    pub applied_seqs: Vec<AppliedSeq>,
}

/// One `(node, highest applied seq)` entry of a [`LayerVersion`]'s ledger.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
pub struct AppliedSeq {
    /// The sending node.
    pub node_id: u64,
    /// Its highest seq of the layer applied in the version.
    pub seq: u64,
}

impl LayerVersion {
    /// Decode the parameters into dense row-major f32 values.
    pub fn decode_values(&self) -> Result<Vec<f32>, CodecError> {
        let len = shape_element_count(&self.shape)?;
        codec::decode(&self.payload, self.codec, len)
    }
}

/// An aggregator's answer to a [`LayerPayload`].
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeltaAck {
    /// Node that sent the delta.
    pub node_id: u64,
    /// Layer of the delta.
    pub layer_id: u32,
    /// The delta's `seq`.
    pub seq: u64,
    /// Whether the delta was folded into the layer (false: dropped, e.g. too stale).
    pub applied: bool,
    /// The layer's global version after handling the delta.
    pub new_version: u64,
}

/// Why an aggregator asks a node to re-sync a layer.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResyncReason {
    /// The delta's base is too many versions behind.
    TooStale {
        /// Versions between the delta's base and the current version.
        staleness: u64,
        /// Largest staleness the aggregator accepts.
        max_staleness: u64,
    },
    /// The aggregator does not know the delta's base version (e.g. it is in the future).
    UnknownBaseVersion,
    /// The delta's shape does not match the layer.
    ShapeMismatch,
    /// The aggregator restarted from a checkpoint; versions were rewound.
    AggregatorRestarted,
    /// A synchronous round closed at its deadline with fewer senders than its minimum
    /// completion (FedAvg with `min_completion_rate`): no delta of it was applied.
    RoundIncomplete {
        /// Distinct senders the round had.
        senders: u32,
        /// Distinct senders it needed.
        required: u32,
    },
}

/// An aggregator tells a node to fetch the current version of a layer and rebase.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq)]
pub struct Resync {
    /// Layer to re-sync.
    pub layer_id: u32,
    /// The layer's current global version.
    pub current_version: u64,
    /// Seq of the delta this resync refuses (the delta was dropped, not applied); `None` when
    /// the resync is not about a specific delta (e.g. [`ResyncReason::AggregatorRestarted`]).
    /// A node drops its in-flight delta only when this matches its seq: a late resync for an
    /// older retransmitted copy must not drop a newer delta the aggregator never saw.
    pub refused_seq: Option<u64>,
    /// Why.
    pub reason: ResyncReason,
}

/// Class of a protocol-level error reply.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorCode {
    /// Credentials rejected.
    Unauthorized,
    /// The sender's node id is unknown or its lease expired; it must join again.
    UnknownNode,
    /// The receiver does not own the layer; consult the layer→aggregator map.
    NotOwner,
    /// The message was well-formed but not valid here (bad shape, bad codec, ...).
    BadRequest,
    /// The receiver is overloaded; retry later.
    Busy,
    /// A bug or internal failure on the receiver.
    Internal,
}

/// An error reply.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct ErrorReply {
    /// Error class.
    pub code: ErrorCode,
    /// Human-readable detail.
    pub text: String,
}

/// Every message of the dreamddp protocol; the body of one frame.
#[derive(Archive, Serialize, Deserialize, Debug, Clone, PartialEq)]
pub enum Message {
    /// Node → coordinator: join the cluster.
    Join(Join),
    /// Coordinator → node: admitted.
    JoinAck(JoinAck),
    /// Lease renewal.
    Heartbeat(Heartbeat),
    /// Node → coordinator: leaving.
    Leave(Leave),
    /// Node → aggregator: a layer delta.
    LayerDelta(LayerPayload),
    /// Aggregator → nodes: a new global version of a layer.
    LayerVersion(LayerVersion),
    /// Aggregator → node: outcome of a delta.
    DeltaAck(DeltaAck),
    /// Aggregator → node: re-sync a layer.
    Resync(Resync),
    /// Any role: an error reply.
    Error(ErrorReply),
    /// Coordinator → members: the layer map changed.
    LayerMap(LayerMap),
    /// Node → aggregator: subscribe to layer versions (answered with the current ones).
    Subscribe(Subscribe),
    /// Node → coordinator: counters for status and summaries.
    Stats(NodeStats),
}

impl Message {
    /// The variant's name, for logs and error messages.
    pub fn kind(&self) -> &'static str {
        match self {
            Message::Join(_) => "Join",
            Message::JoinAck(_) => "JoinAck",
            Message::Heartbeat(_) => "Heartbeat",
            Message::Leave(_) => "Leave",
            Message::LayerDelta(_) => "LayerDelta",
            Message::LayerVersion(_) => "LayerVersion",
            Message::DeltaAck(_) => "DeltaAck",
            Message::Resync(_) => "Resync",
            Message::Error(_) => "Error",
            Message::LayerMap(_) => "LayerMap",
            Message::Subscribe(_) => "Subscribe",
            Message::Stats(_) => "Stats",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta() -> LayerMeta {
        LayerMeta {
            node_id: 7,
            layer_id: 3,
            layer_name: "fc1.weight".into(),
            step: 100,
            base_version: 4,
            version: 4,
            seq: 9,
            sample_count: 64,
        }
    }

    #[test]
    fn payload_round_trip_raw_is_exact() {
        let values: Vec<f32> = (0..12).map(|i| i as f32 * 0.25 - 1.0).collect();
        let payload = payload_from_f32(meta(), &[3, 4], &values, Codec::RawF32).unwrap();
        assert_eq!(payload.codec, Codec::RawF32);
        assert_eq!(payload.meta(), meta());
        assert_eq!(payload.decode_values().unwrap(), values);
    }

    #[test]
    fn payload_zstd_kept_only_when_smaller() {
        let sparse = vec![0.0f32; 4096];
        let p = payload_from_f32(meta(), &[4096], &sparse, Codec::ZstdF16).unwrap();
        assert_eq!(p.codec, Codec::ZstdF16);
        assert!(p.payload.len() < 4096 * 2);
        assert_eq!(p.decode_values().unwrap(), sparse);

        // A handful of incompressible bytes: zstd's frame overhead makes it larger.
        let noisy = [1.2345f32, -9.87, 3.5e-7];
        let p = payload_from_f32(meta(), &[3], &noisy, Codec::ZstdRawF32).unwrap();
        assert_eq!(p.codec, Codec::RawF32);
        assert_eq!(p.decode_values().unwrap(), noisy);
    }

    #[test]
    fn payload_rejects_shape_mismatch() {
        let err = payload_from_f32(meta(), &[2, 2], &[1.0; 5], Codec::RawF32).unwrap_err();
        assert!(matches!(
            err,
            CodecError::ShapeMismatch {
                shape_len: 4,
                values_len: 5,
                ..
            }
        ));
    }

    #[test]
    fn decode_values_rejects_overflowing_shape() {
        let mut p = payload_from_f32(meta(), &[2], &[1.0, 2.0], Codec::RawF32).unwrap();
        p.shape = vec![u32::MAX, u32::MAX, u32::MAX];
        assert!(matches!(
            p.decode_values(),
            Err(CodecError::ShapeOverflow { .. })
        ));
    }

    #[test]
    fn payload_from_error_feedback_top_k() {
        let mut compressor = codec::TopKCompressor::new();
        let values = [0.1f32, -5.0, 0.2, 4.0, 0.0, 0.3];
        let encoded = compressor.compress_encoded(&values, 2).unwrap();
        let p = payload_from_encoded(meta(), &[2, 3], encoded.clone()).unwrap();
        assert_eq!(p.codec, Codec::TopK { k: 2 });
        assert_eq!(p.decode_values().unwrap(), [0.0, -5.0, 0.0, 4.0, 0.0, 0.0]);
        assert_eq!(compressor.residual(), &[0.1, 0.0, 0.2, 0.0, 0.0, 0.3]);
        // The same bytes claimed for a one-element tensor are rejected.
        assert!(matches!(
            payload_from_encoded(meta(), &[1], encoded),
            Err(CodecError::InvalidK { k: 2, len: 1 })
        ));
        let raw = codec::encode(&values, Codec::RawF32).unwrap();
        assert!(matches!(
            payload_from_encoded(meta(), &[5], raw),
            Err(CodecError::LengthMismatch {
                expected: 20,
                actual: 24,
                ..
            })
        ));
    }

    #[test]
    fn codec_zstd_helpers() {
        for c in [Codec::RawF32, Codec::F16, Codec::Bf16, Codec::TopK { k: 5 }] {
            assert!(!c.is_zstd());
            assert!(c.with_zstd().is_zstd());
            assert_eq!(c.with_zstd().base(), c);
            assert_eq!(c.with_zstd().with_zstd(), c.with_zstd());
        }
    }
}
