//! Framing: how one [`Message`] travels as bytes on a stream.
//!
//! A frame is a 16-byte header followed by the body, the rkyv archive of the
//! message. All integers are little-endian:
//!
//! | offset | size | field                                   |
//! |--------|------|-----------------------------------------|
//! | 0      | 4    | magic [`MAGIC`] (`b"DDP1"`)             |
//! | 4      | 2    | protocol version [`PROTOCOL_VERSION`]   |
//! | 6      | 2    | flags (none defined; must be 0)         |
//! | 8      | 4    | body length in bytes                    |
//! | 12     | 4    | CRC32C of the body                      |
//! | 16     | len  | body                                    |
//!
//! Owns [`encode_frame`], the one-shot [`decode_frame`], and the streaming
//! [`FrameDecoder`]. Decoding checks, in order: magic (even on a partial
//! header), version, flags, body length against the maximum (before anything
//! is allocated), presence of the whole body, checksum, and finally rkyv's
//! validation of the archive (after copying it into an aligned buffer).

use rkyv::rancor;
use rkyv::util::AlignedVec;

use crate::error::FrameError;
use crate::message::Message;

/// First four bytes of every frame.
pub const MAGIC: [u8; 4] = *b"DDP1";
/// Protocol version this build writes and accepts.
pub const PROTOCOL_VERSION: u16 = 5;
/// Flag bits this build understands (none yet).
pub const KNOWN_FLAGS: u16 = 0;
/// Size of the frame header in bytes.
pub const HEADER_LEN: usize = 16;
/// Default maximum body length: 256 MiB.
pub const DEFAULT_MAX_BODY_LEN: u32 = 256 << 20;

/// A parsed and checked frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameHeader {
    /// Protocol version.
    pub version: u16,
    /// Flag bits.
    pub flags: u16,
    /// Body length in bytes.
    pub body_len: u32,
    /// CRC32C of the body.
    pub body_crc: u32,
}

impl FrameHeader {
    /// Total frame length (header plus body).
    pub fn frame_len(&self) -> usize {
        HEADER_LEN + self.body_len as usize
    }

    /// The 16 header bytes.
    pub fn to_bytes(&self) -> [u8; HEADER_LEN] {
        let mut out = [0u8; HEADER_LEN];
        out[0..4].copy_from_slice(&MAGIC);
        out[4..6].copy_from_slice(&self.version.to_le_bytes());
        out[6..8].copy_from_slice(&self.flags.to_le_bytes());
        out[8..12].copy_from_slice(&self.body_len.to_le_bytes());
        out[12..16].copy_from_slice(&self.body_crc.to_le_bytes());
        out
    }

    /// Parse and check a header from the start of `bytes`.
    ///
    /// Returns `Truncated` when fewer than [`HEADER_LEN`] bytes are present
    /// (but `BadMagic` as soon as the bytes present contradict the magic).
    pub fn parse(bytes: &[u8], max_body_len: u32) -> Result<FrameHeader, FrameError> {
        let magic_have = bytes.len().min(MAGIC.len());
        if bytes[..magic_have] != MAGIC[..magic_have] {
            return Err(FrameError::BadMagic {
                got: bytes[..magic_have].to_vec(),
                expected: MAGIC,
            });
        }
        let Some(header) = bytes.get(..HEADER_LEN) else {
            return Err(FrameError::Truncated {
                need: HEADER_LEN,
                have: bytes.len(),
            });
        };
        let u16_at = |i: usize| u16::from_le_bytes([header[i], header[i + 1]]);
        let u32_at =
            |i: usize| u32::from_le_bytes([header[i], header[i + 1], header[i + 2], header[i + 3]]);
        let parsed = FrameHeader {
            version: u16_at(4),
            flags: u16_at(6),
            body_len: u32_at(8),
            body_crc: u32_at(12),
        };
        if parsed.version != PROTOCOL_VERSION {
            return Err(FrameError::UnsupportedVersion {
                got: parsed.version,
                supported: PROTOCOL_VERSION,
            });
        }
        if parsed.flags & !KNOWN_FLAGS != 0 {
            return Err(FrameError::UnsupportedFlags {
                flags: parsed.flags,
                known: KNOWN_FLAGS,
            });
        }
        if parsed.body_len > max_body_len {
            return Err(FrameError::TooLarge {
                len: u64::from(parsed.body_len),
                max: max_body_len,
            });
        }
        Ok(parsed)
    }
}

/// Serialize `message` into one frame, refusing bodies above
/// [`DEFAULT_MAX_BODY_LEN`] (the receiver would reject them).
pub fn encode_frame(message: &Message) -> Result<Vec<u8>, FrameError> {
    encode_frame_with_limit(message, DEFAULT_MAX_BODY_LEN)
}

/// [`encode_frame`] with an explicit maximum body length.
pub fn encode_frame_with_limit(
    message: &Message,
    max_body_len: u32,
) -> Result<Vec<u8>, FrameError> {
    let body = rkyv::to_bytes::<rancor::Error>(message)
        .map_err(|e| FrameError::Serialize(e.to_string()))?;
    if body.len() as u64 > u64::from(max_body_len) {
        return Err(FrameError::TooLarge {
            len: body.len() as u64,
            max: max_body_len,
        });
    }
    let header = FrameHeader {
        version: PROTOCOL_VERSION,
        flags: 0,
        // Fits: checked against a u32 maximum above.
        body_len: body.len() as u32,
        body_crc: crc32c::crc32c(&body),
    };
    let mut frame = Vec::with_capacity(HEADER_LEN + body.len());
    frame.extend_from_slice(&header.to_bytes());
    frame.extend_from_slice(&body);
    Ok(frame)
}

/// Decode the frame at the start of `bytes` with the default maximum body
/// length. Returns the message and the number of bytes the frame used; extra
/// bytes after it are left alone.
pub fn decode_frame(bytes: &[u8]) -> Result<(Message, usize), FrameError> {
    decode_frame_with_limit(bytes, DEFAULT_MAX_BODY_LEN)
}

/// [`decode_frame`] with an explicit maximum body length.
pub fn decode_frame_with_limit(
    bytes: &[u8],
    max_body_len: u32,
) -> Result<(Message, usize), FrameError> {
    let header = FrameHeader::parse(bytes, max_body_len)?;
    let frame_len = header.frame_len();
    let Some(body) = bytes.get(HEADER_LEN..frame_len) else {
        return Err(FrameError::Truncated {
            need: frame_len,
            have: bytes.len(),
        });
    };
    let actual = crc32c::crc32c(body);
    if actual != header.body_crc {
        return Err(FrameError::ChecksumMismatch {
            expected: header.body_crc,
            actual,
        });
    }
    Ok((decode_body(body)?, frame_len))
}

/// Validate and deserialize a frame body (an rkyv archive of a [`Message`]).
/// The bytes are copied into an aligned buffer first; validation is always on.
pub fn decode_body(body: &[u8]) -> Result<Message, FrameError> {
    let mut aligned = AlignedVec::<16>::with_capacity(body.len());
    aligned.extend_from_slice(body);
    rkyv::from_bytes::<Message, rancor::Error>(&aligned)
        .map_err(|e| FrameError::Malformed(e.to_string()))
}

/// Streaming decoder: push bytes as they arrive, pop whole messages.
///
/// [`FrameDecoder::pop`] returns `Ok(None)` while a frame is incomplete. On any
/// other error the stream cannot be trusted to be in sync any more: the decoder
/// drops its buffer, keeps returning that error, and the caller should close
/// the connection (or [`FrameDecoder::reset`] it for a fresh stream).
#[derive(Debug)]
pub struct FrameDecoder {
    buffer: Vec<u8>,
    /// Bytes of `buffer` already consumed by popped frames.
    consumed: usize,
    max_body_len: u32,
    failure: Option<FrameError>,
}

impl Default for FrameDecoder {
    fn default() -> Self {
        Self::new()
    }
}

impl FrameDecoder {
    /// A decoder with [`DEFAULT_MAX_BODY_LEN`].
    pub fn new() -> Self {
        Self::with_max_body_len(DEFAULT_MAX_BODY_LEN)
    }

    /// A decoder with an explicit maximum body length.
    pub fn with_max_body_len(max_body_len: u32) -> Self {
        Self {
            buffer: Vec::new(),
            consumed: 0,
            max_body_len,
            failure: None,
        }
    }

    /// Append received bytes. Ignored once the decoder has failed.
    pub fn push(&mut self, bytes: &[u8]) {
        if self.failure.is_some() {
            return;
        }
        if self.consumed > 0 {
            self.buffer.drain(..self.consumed);
            self.consumed = 0;
        }
        self.buffer.extend_from_slice(bytes);
    }

    /// The next complete message, `Ok(None)` if more bytes are needed, or the
    /// error that broke the stream.
    pub fn pop(&mut self) -> Result<Option<Message>, FrameError> {
        if let Some(failure) = &self.failure {
            return Err(failure.clone());
        }
        match decode_frame_with_limit(&self.buffer[self.consumed..], self.max_body_len) {
            Ok((message, used)) => {
                self.consumed += used;
                if self.consumed == self.buffer.len() {
                    self.buffer.clear();
                    self.consumed = 0;
                }
                Ok(Some(message))
            }
            Err(FrameError::Truncated { .. }) => Ok(None),
            Err(error) => {
                self.buffer = Vec::new();
                self.consumed = 0;
                self.failure = Some(error.clone());
                Err(error)
            }
        }
    }

    /// Bytes received but not yet returned as messages.
    pub fn buffered_len(&self) -> usize {
        self.buffer.len() - self.consumed
    }

    /// The error that broke the stream, if any.
    pub fn failure(&self) -> Option<&FrameError> {
        self.failure.as_ref()
    }

    /// Forget all state (buffer and failure), e.g. for a new connection.
    pub fn reset(&mut self) {
        self.buffer.clear();
        self.consumed = 0;
        self.failure = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::{arb_message, sample_messages};
    use proptest::prelude::*;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    fn set_body_len(frame: &mut [u8], len: u32) {
        frame[8..12].copy_from_slice(&len.to_le_bytes());
    }

    /// Rewrite length and CRC so the frame passes framing checks and reaches rkyv.
    fn fix_header(frame: &mut [u8]) {
        let body_len = (frame.len() - HEADER_LEN) as u32;
        set_body_len(frame, body_len);
        let crc = crc32c::crc32c(&frame[HEADER_LEN..]);
        frame[12..16].copy_from_slice(&crc.to_le_bytes());
    }

    #[test]
    fn header_layout_is_as_documented() {
        let frame = encode_frame(&sample_messages()[2]).unwrap();
        assert_eq!(&frame[0..4], b"DDP1");
        assert_eq!(u16::from_le_bytes([frame[4], frame[5]]), PROTOCOL_VERSION);
        assert_eq!(u16::from_le_bytes([frame[6], frame[7]]), 0);
        let body_len = u32::from_le_bytes(frame[8..12].try_into().unwrap()) as usize;
        assert_eq!(body_len, frame.len() - HEADER_LEN);
        let crc = u32::from_le_bytes(frame[12..16].try_into().unwrap());
        assert_eq!(crc, crc32c::crc32c(&frame[HEADER_LEN..]));
    }

    #[test]
    fn every_sample_round_trips_and_reports_bytes_used() {
        for message in sample_messages() {
            let mut frame = encode_frame(&message).unwrap();
            let len = frame.len();
            frame.extend_from_slice(b"DDP1 trailing bytes of the next frame");
            let (decoded, used) = decode_frame(&frame).unwrap();
            assert_eq!(decoded, message);
            assert_eq!(used, len);
        }
    }

    #[test]
    fn typed_errors_for_header_problems() {
        let frame = encode_frame(&sample_messages()[3]).unwrap();

        let mut bad = frame.clone();
        bad[0] = b'X';
        assert!(matches!(
            decode_frame(&bad),
            Err(FrameError::BadMagic { .. })
        ));
        // A partial header that already contradicts the magic fails fast.
        assert_eq!(
            decode_frame(b"HT"),
            Err(FrameError::BadMagic {
                got: b"HT".to_vec(),
                expected: MAGIC
            })
        );
        assert_eq!(
            decode_frame(b"DD"),
            Err(FrameError::Truncated { need: 16, have: 2 })
        );

        let mut bad = frame.clone();
        bad[4..6].copy_from_slice(&7u16.to_le_bytes());
        assert_eq!(
            decode_frame(&bad),
            Err(FrameError::UnsupportedVersion {
                got: 7,
                supported: PROTOCOL_VERSION
            })
        );

        let mut bad = frame.clone();
        bad[6] = 1;
        assert!(matches!(
            decode_frame(&bad),
            Err(FrameError::UnsupportedFlags { flags: 1, .. })
        ));

        let mut bad = frame.clone();
        bad[HEADER_LEN] ^= 0x10;
        assert!(matches!(
            decode_frame(&bad),
            Err(FrameError::ChecksumMismatch { .. })
        ));

        assert_eq!(
            decode_frame(&frame[..frame.len() - 1]),
            Err(FrameError::Truncated {
                need: frame.len(),
                have: frame.len() - 1
            })
        );
    }

    #[test]
    fn oversize_body_is_rejected_from_the_header_alone() {
        let mut header = encode_frame(&sample_messages()[2]).unwrap();
        header.truncate(HEADER_LEN);
        set_body_len(&mut header, u32::MAX);
        assert_eq!(
            decode_frame(&header),
            Err(FrameError::TooLarge {
                len: u64::from(u32::MAX),
                max: DEFAULT_MAX_BODY_LEN
            })
        );
        let mut decoder = FrameDecoder::with_max_body_len(1024);
        set_body_len(&mut header, 1025);
        decoder.push(&header);
        assert!(matches!(
            decoder.pop(),
            Err(FrameError::TooLarge {
                len: 1025,
                max: 1024
            })
        ));
        // The decoder stays failed and holds nothing.
        decoder.push(&[0; 100]);
        assert_eq!(decoder.buffered_len(), 0);
        assert!(decoder.pop().is_err());
        assert!(decoder.failure().is_some());
        decoder.reset();
        assert_eq!(decoder.pop(), Ok(None));
    }

    #[test]
    fn encoder_refuses_bodies_over_the_limit() {
        let message = sample_messages()[6].clone();
        assert!(matches!(
            encode_frame_with_limit(&message, 16),
            Err(FrameError::TooLarge { max: 16, .. })
        ));
    }

    #[test]
    fn garbage_body_with_valid_checksum_is_malformed() {
        let mut frame = MAGIC.to_vec();
        frame.extend_from_slice(&[0; 12]);
        frame[4..6].copy_from_slice(&PROTOCOL_VERSION.to_le_bytes());
        frame.extend_from_slice(&[0xff; 64]);
        fix_header(&mut frame);
        assert!(matches!(
            decode_frame(&frame),
            Err(FrameError::Malformed(_))
        ));
        // An empty body too.
        frame.truncate(HEADER_LEN);
        fix_header(&mut frame);
        assert!(matches!(
            decode_frame(&frame),
            Err(FrameError::Malformed(_))
        ));
    }

    #[test]
    fn streaming_decoder_handles_byte_by_byte_and_batched_input() {
        let messages = sample_messages();
        let stream: Vec<u8> = messages
            .iter()
            .flat_map(|m| encode_frame(m).unwrap())
            .collect();

        let mut decoder = FrameDecoder::new();
        let mut got = Vec::new();
        for &b in &stream {
            decoder.push(&[b]);
            while let Some(m) = decoder.pop().unwrap() {
                got.push(m);
            }
        }
        assert_eq!(got, messages);
        assert_eq!(decoder.buffered_len(), 0);

        let mut decoder = FrameDecoder::new();
        decoder.push(&stream);
        let mut got = Vec::new();
        while let Some(m) = decoder.pop().unwrap() {
            got.push(m);
        }
        assert_eq!(got, messages);
    }

    proptest! {
        #[test]
        fn every_message_round_trips_through_frames(message in arb_message()) {
            let frame = encode_frame(&message).unwrap();
            let (decoded, used) = decode_frame(&frame).unwrap();
            prop_assert_eq!(used, frame.len());
            prop_assert_eq!(&decoded, &message);
        }

        #[test]
        fn message_streams_round_trip_through_any_chunking(
            messages in prop::collection::vec(arb_message(), 0..6),
            cuts in prop::collection::vec(any::<prop::sample::Index>(), 0..10),
        ) {
            let stream: Vec<u8> = messages.iter().flat_map(|m| encode_frame(m).unwrap()).collect();
            let mut cut_points: Vec<usize> = cuts.iter().map(|c| c.index(stream.len() + 1)).collect();
            cut_points.push(0);
            cut_points.push(stream.len());
            cut_points.sort_unstable();
            let mut decoder = FrameDecoder::new();
            let mut got = Vec::new();
            for w in cut_points.windows(2) {
                decoder.push(&stream[w[0]..w[1]]);
                while let Some(m) = decoder.pop().unwrap() {
                    got.push(m);
                }
            }
            prop_assert_eq!(got, messages);
            prop_assert_eq!(decoder.buffered_len(), 0);
        }
    }

    /// How a fuzz case was built; decides what outcome is acceptable.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    enum Mutation {
        BitFlips,
        Truncation,
        LengthEdit,
        RandomBytes,
        GarbageBody,
        BodyMutatedCrcFixed,
        ValidWithTrailer,
    }

    const MUTATIONS: [Mutation; 7] = [
        Mutation::BitFlips,
        Mutation::Truncation,
        Mutation::LengthEdit,
        Mutation::RandomBytes,
        Mutation::GarbageBody,
        Mutation::BodyMutatedCrcFixed,
        Mutation::ValidWithTrailer,
    ];

    fn mutate(rng: &mut ChaCha8Rng, frames: &[Vec<u8>], mutation: Mutation) -> (Vec<u8>, bool) {
        let base = &frames[rng.random_range(0..frames.len())];
        let mut bytes = base.clone();
        // Second value: whether only body bits were flipped (then CRC must catch it).
        let mut body_only_flips = false;
        match mutation {
            Mutation::BitFlips => {
                let flips = rng.random_range(1..=3);
                body_only_flips = true;
                let mut flipped = [usize::MAX; 3];
                for slot in 0..flips {
                    // Distinct bits: flipping one bit twice would undo the mutation.
                    let bit = loop {
                        let bit = rng.random_range(0..bytes.len() * 8);
                        if !flipped.contains(&bit) {
                            break bit;
                        }
                    };
                    flipped[slot] = bit;
                    bytes[bit / 8] ^= 1 << (bit % 8);
                    body_only_flips &= bit / 8 >= HEADER_LEN;
                }
            }
            Mutation::Truncation => {
                let cut = rng.random_range(0..bytes.len());
                bytes.truncate(cut);
            }
            Mutation::LengthEdit => {
                let body_len = (bytes.len() - HEADER_LEN) as i64;
                let new_len = match rng.random_range(0..4) {
                    0 => rng.random::<u32>(),
                    1 => (body_len + rng.random_range(-8i64..=8)).clamp(0, u32::MAX as i64) as u32,
                    2 => DEFAULT_MAX_BODY_LEN + rng.random_range(0..2),
                    _ => 0,
                };
                set_body_len(&mut bytes, new_len);
            }
            Mutation::RandomBytes => {
                let len = rng.random_range(0..96);
                bytes = vec![0; len];
                rng.fill(&mut bytes[..]);
                if len >= 4 && rng.random_bool(0.5) {
                    bytes[..4].copy_from_slice(&MAGIC);
                }
            }
            Mutation::GarbageBody => {
                let len = rng.random_range(0..400);
                bytes.truncate(HEADER_LEN);
                bytes.resize(HEADER_LEN + len, 0);
                rng.fill(&mut bytes[HEADER_LEN..]);
                fix_header(&mut bytes);
            }
            Mutation::BodyMutatedCrcFixed => {
                let edits = rng.random_range(1..=4);
                for _ in 0..edits {
                    let body_len = bytes.len() - HEADER_LEN;
                    let at = HEADER_LEN + rng.random_range(0..body_len.max(1)).min(body_len);
                    match rng.random_range(0..6) {
                        0 if at < bytes.len() => bytes[at] ^= 1 << rng.random_range(0..8),
                        1 if at < bytes.len() => bytes[at] = rng.random(),
                        2 if at + 4 <= bytes.len() => {
                            let word: u32 =
                                [0, 1, 0x7fff_ffff, 0x8000_0000, u32::MAX, rng.random()]
                                    [rng.random_range(0..6)];
                            bytes[at..at + 4].copy_from_slice(&word.to_le_bytes());
                        }
                        3 => bytes.insert(at, rng.random()),
                        4 if at < bytes.len() => {
                            bytes.remove(at);
                        }
                        _ => {
                            let keep = rng.random_range(HEADER_LEN..=bytes.len());
                            bytes.truncate(keep);
                        }
                    }
                }
                fix_header(&mut bytes);
            }
            Mutation::ValidWithTrailer => {
                let next = &frames[rng.random_range(0..frames.len())];
                let tail = rng.random_range(0..=next.len());
                bytes.extend_from_slice(&next[..tail]);
            }
        }
        (bytes, body_only_flips)
    }

    /// Feed `bytes` to a streaming decoder in random chunks; return the first
    /// message or error it produced (`Ok(None)`: it is still waiting for bytes).
    fn stream_first(rng: &mut ChaCha8Rng, bytes: &[u8]) -> Result<Option<Message>, FrameError> {
        let mut decoder = FrameDecoder::new();
        let mut at = 0;
        loop {
            if let Some(outcome) = decoder.pop().transpose() {
                return outcome.map(Some);
            }
            if at == bytes.len() {
                return Ok(None);
            }
            let end = (at + rng.random_range(1..=64)).min(bytes.len());
            decoder.push(&bytes[at..end]);
            at = end;
        }
    }

    #[test]
    fn fuzzed_frames_yield_messages_or_typed_errors_and_never_panic() {
        const CASES: usize = 100_000;
        let mut rng = ChaCha8Rng::seed_from_u64(0xdd_f022_5eed);
        let frames: Vec<Vec<u8>> = sample_messages()
            .iter()
            .map(|m| encode_frame(m).unwrap())
            .collect();
        let mut ok_counts = [0usize; MUTATIONS.len()];
        let mut malformed_reached = 0usize;
        for case in 0..CASES {
            let mutation_index = case % MUTATIONS.len();
            let mutation = MUTATIONS[mutation_index];
            let (bytes, body_only_flips) = mutate(&mut rng, &frames, mutation);
            let one_shot = decode_frame(&bytes);
            let streamed = stream_first(&mut rng, &bytes);
            let context = || format!("case {case} {mutation:?} bytes {bytes:02x?}");

            // The streaming decoder agrees with the one-shot decoder.
            match (&one_shot, &streamed) {
                (Ok((message, used)), Ok(Some(first))) => {
                    assert!(*used <= bytes.len(), "{}", context());
                    assert_eq!(message, first, "{}", context());
                    // What decodes re-encodes to an equal message.
                    let again = decode_frame(&encode_frame(message).unwrap()).unwrap().0;
                    assert_eq!(&again, message, "{}", context());
                    ok_counts[mutation_index] += 1;
                    // Tensors inside surviving messages decode or fail cleanly too.
                    let decoded_tensor = match message {
                        Message::LayerDelta(p) => Some((p.decode_values(), &p.shape)),
                        Message::LayerVersion(v) => Some((v.decode_values(), &v.shape)),
                        _ => None,
                    };
                    if let Some((Ok(values), shape)) = decoded_tensor {
                        let len = crate::message::shape_element_count(shape).unwrap();
                        assert_eq!(values.len() as u64, len, "{}", context());
                    }
                }
                (Err(FrameError::Truncated { .. }), Ok(None)) => {}
                (Err(e1), Err(e2)) => {
                    assert_eq!(
                        std::mem::discriminant(e1),
                        std::mem::discriminant(e2),
                        "{}",
                        context()
                    );
                    assert!(!e1.to_string().is_empty());
                    if matches!(e1, FrameError::Malformed(_)) {
                        malformed_reached += 1;
                    }
                }
                other => panic!("decoders disagree: {other:?} for {}", context()),
            }

            // Outcomes each mutation must produce.
            match mutation {
                Mutation::BitFlips if body_only_flips => assert!(
                    matches!(one_shot, Err(FrameError::ChecksumMismatch { .. })),
                    "{}",
                    context()
                ),
                Mutation::BitFlips => assert!(one_shot.is_err(), "{}", context()),
                Mutation::Truncation => {
                    let need = if bytes.len() < HEADER_LEN {
                        HEADER_LEN
                    } else {
                        HEADER_LEN + u32::from_le_bytes(bytes[8..12].try_into().unwrap()) as usize
                    };
                    assert_eq!(
                        one_shot,
                        Err(FrameError::Truncated {
                            need,
                            have: bytes.len()
                        }),
                        "{}",
                        context()
                    );
                }
                Mutation::LengthEdit => {
                    let declared = u32::from_le_bytes(bytes[8..12].try_into().unwrap());
                    if declared > DEFAULT_MAX_BODY_LEN {
                        assert!(matches!(one_shot, Err(FrameError::TooLarge { .. })));
                    } else if HEADER_LEN + declared as usize > bytes.len() {
                        assert!(matches!(one_shot, Err(FrameError::Truncated { .. })));
                    }
                }
                Mutation::GarbageBody | Mutation::BodyMutatedCrcFixed => assert!(
                    matches!(one_shot, Ok(_) | Err(FrameError::Malformed(_))),
                    "{}",
                    context()
                ),
                Mutation::ValidWithTrailer => {
                    assert!(one_shot.is_ok(), "{}", context())
                }
                Mutation::RandomBytes => {}
            }
        }
        // The mutators really exercise the deep paths.
        assert_eq!(ok_counts[6], CASES / MUTATIONS.len());
        assert!(
            malformed_reached > 5_000,
            "only {malformed_reached} reached rkyv"
        );
        assert!(ok_counts[5] > 0, "no mutated body survived validation");
    }
}
