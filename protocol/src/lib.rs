//! # protocol — dreamddp's wire format
//!
//! Pure encoding and decoding, no sockets, clocks or threads:
//!
//! * [`message`] — the rkyv [`Message`] enum every role exchanges (join,
//!   heartbeats, layer deltas, new layer versions, acks, resync, errors) and
//!   the [`LayerPayload`] ⇄ `&[f32]` helpers ([`payload_from_f32`],
//!   [`LayerPayload::decode_values`]).
//! * [`frame`] — a 16-byte header (magic, version, flags, length, CRC32C) in
//!   front of each message; [`encode_frame`], [`decode_frame`] and the
//!   streaming [`FrameDecoder`].
//! * [`codec`] — tensor codecs: raw f32, f16, bf16, top-k with error feedback
//!   ([`TopKCompressor`]), and a zstd wrap kept only when it shrinks
//!   ([`maybe_compress`]).
//! * [`lowrank`] — the PowerSGD-style rank-r layout of [`Codec::LowRank`].
//! * [`error`] — typed errors ([`FrameError`], [`CodecError`]).
//!
//! Everything that reads bytes from a peer returns a typed error on bad input
//! and never panics; the frame decoders are fuzzed in the tests.
//!
//! ```
//! use protocol::{decode_frame, encode_frame, payload_from_f32, Codec, LayerMeta, Message};
//!
//! let meta = LayerMeta { node_id: 1, layer_id: 0, layer_name: "fc1".into(), ..Default::default() };
//! let payload = payload_from_f32(meta, &[2, 2], &[0.5, -1.0, 0.0, 2.0], Codec::F16).unwrap();
//! let frame = encode_frame(&Message::LayerDelta(payload)).unwrap();
//! let (message, used) = decode_frame(&frame).unwrap();
//! assert_eq!(used, frame.len());
//! let Message::LayerDelta(received) = message else { unreachable!() };
//! assert_eq!(received.decode_values().unwrap(), [0.5, -1.0, 0.0, 2.0]);
//! ```

pub mod codec;
pub mod error;
pub mod frame;
pub mod lowrank;
pub mod message;

#[cfg(test)]
mod test_support;

pub use codec::{
    decode, decode_with_limit, encode, maybe_compress, Encoded, SparseTopK, TopKCompressor,
    DEFAULT_MAX_DECODED_ELEMENTS,
};
pub use error::{CodecError, FrameError};
pub use frame::{
    decode_frame, decode_frame_with_limit, encode_frame, encode_frame_with_limit, FrameDecoder,
    FrameHeader, DEFAULT_MAX_BODY_LEN, HEADER_LEN, MAGIC, PROTOCOL_VERSION,
};
pub use message::{
    payload_from_encoded, payload_from_f32, shape_element_count, AggregatorAddr, AppliedSeq,
    Capabilities, Codec, DeltaAck, ErrorCode, ErrorReply, Heartbeat, Join, JoinAck, LayerMap,
    LayerMeta, LayerPayload, LayerVersion, Leave, Message, NodeStats, Resync, ResyncReason, Role,
    Subscribe,
};
