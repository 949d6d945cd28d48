//! [`PeerConnection`]: one authenticated QUIC connection to a named peer,
//! carrying one framed [`protocol::Message`] per unidirectional stream.
//!
//! Sending opens a stream, writes the frame and finishes it. Receiving is done
//! by a background task per connection that accepts the peer's streams and
//! reads each one in its own task, so a large slow layer never holds back a
//! small ack opened after it; decoded messages (or the peer's faults) queue in
//! a channel that [`PeerConnection::recv`] drains. At most
//! [`MAX_UNDELIVERED_MESSAGES`] messages are being read or waiting for `recv`
//! at once; beyond that the peer's streams wait in QUIC flow control.

use std::fmt;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use protocol::Message;
use quinn::{ReadError, ReadToEndError, RecvStream, VarInt, WriteError};
use tokio::sync::{mpsc, Mutex, OwnedSemaphorePermit, Semaphore};
use tokio::task::{AbortHandle, JoinSet};
use tokio::time::Instant;

use crate::config::TransportConfig;
use crate::error::{from_connection_error, TransportError};

/// Messages being read plus messages waiting for [`PeerConnection::recv`].
pub const MAX_UNDELIVERED_MESSAGES: usize = 256;

/// Application error code of a normal [`PeerConnection::close`].
pub const CLOSE_CODE_NORMAL: u32 = 0;
/// Stream error code: the receiver stopped a stream above `max_message_bytes`.
pub const STREAM_CODE_TOO_LARGE: u32 = 1;
/// Stream error code: the sender reset a stream whose send timed out.
pub const STREAM_CODE_SEND_TIMEOUT: u32 = 2;
/// Stream error code: the sender discarded a message a newer one superseded.
pub const STREAM_CODE_SUPERSEDED: u32 = 3;

/// One received message (or peer fault) and the credit it holds until `recv`
/// takes it.
struct Delivery {
    result: Result<Message, TransportError>,
    _permit: Option<OwnedSemaphorePermit>,
}

/// An authenticated connection to one peer. Cheap to clone; all clones share
/// the connection and its queue of received messages.
#[derive(Clone)]
pub struct PeerConnection {
    inner: Arc<Inner>,
}

struct Inner {
    connection: quinn::Connection,
    peer_name: String,
    max_body_len: u32,
    received: Mutex<mpsc::UnboundedReceiver<Delivery>>,
    reader: AbortHandle,
}

impl Drop for Inner {
    fn drop(&mut self) {
        // The reader holds a connection handle; without it quinn closes the
        // connection once the last clone is gone.
        self.reader.abort();
    }
}

impl fmt::Debug for PeerConnection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PeerConnection")
            .field("peer_name", &self.inner.peer_name)
            .field("remote_addr", &self.inner.connection.remote_address())
            .finish()
    }
}

impl PeerConnection {
    /// Wrap an established, verified connection and start reading its streams.
    /// Must be called inside a tokio runtime.
    pub(crate) fn start(
        connection: quinn::Connection,
        peer_name: String,
        config: &TransportConfig,
    ) -> PeerConnection {
        let (sender, receiver) = mpsc::unbounded_channel();
        let reader = tokio::spawn(read_streams(
            connection.clone(),
            peer_name.clone(),
            config.max_message_bytes,
            config.max_body_len(),
            sender,
        ));
        PeerConnection {
            inner: Arc::new(Inner {
                connection,
                peer_name,
                max_body_len: config.max_body_len(),
                received: Mutex::new(receiver),
                reader: reader.abort_handle(),
            }),
        }
    }

    /// The CN of the peer's verified certificate (its node name).
    pub fn peer_name(&self) -> &str {
        &self.inner.peer_name
    }

    /// The peer's UDP address.
    pub fn remote_addr(&self) -> SocketAddr {
        self.inner.connection.remote_address()
    }

    /// This side's IP address on the connection (the route's source address; `None` where the
    /// platform does not report it).
    pub fn local_ip(&self) -> Option<std::net::IpAddr> {
        self.inner.connection.local_ip()
    }

    /// Send `msg` on its own stream. Returns the frame's length in bytes.
    /// Completes when the frame is handed to QUIC (buffered), not when the
    /// peer has read it.
    pub async fn send(&self, msg: &Message) -> Result<usize, TransportError> {
        let frame = self.encode(msg)?;
        let len = frame.len();
        self.send_bytes(frame).await?;
        Ok(len)
    }

    /// [`PeerConnection::send`] with a deadline. When it passes, the stream is
    /// reset (the peer drops the partial message) and
    /// [`TransportError::Timeout`] is returned.
    pub async fn send_with_timeout(
        &self,
        msg: &Message,
        timeout: Duration,
    ) -> Result<usize, TransportError> {
        Ok(self.send_replaceable(msg, timeout).await?.len())
    }

    /// [`PeerConnection::send_with_timeout`] that keeps the finished stream: what QUIC still
    /// holds of it (unsent or unacknowledged bytes) can be discarded later with
    /// [`SentStream::discard`], e.g. when a newer attempt of the same message supersedes it.
    /// Without that, every retransmission of a slow message would add its whole payload to
    /// the connection's send buffer.
    pub async fn send_replaceable(
        &self,
        msg: &Message,
        timeout: Duration,
    ) -> Result<SentStream, TransportError> {
        let deadline = Instant::now() + timeout;
        let frame = self.encode(msg)?;
        let len = frame.len();
        let mut guard = self.open_stream_by(deadline, timeout).await?;
        match tokio::time::timeout_at(deadline, guard.stream().write_chunk(frame)).await {
            Err(_elapsed) => Err(TransportError::timeout_after(self.peer_name(), timeout)),
            Ok(written) => {
                written.map_err(|e| self.write_error(e))?;
                let mut stream = guard.0.take().ok_or(TransportError::Closed)?;
                stream.finish().map_err(|_| TransportError::Closed)?;
                Ok(SentStream { stream, len })
            }
        }
    }

    /// Writes `frame` on a new stream, finishes it, and waits until the peer has acknowledged
    /// every byte (QUIC's `stopped`), so a caller that waits for one frame before sending the
    /// next never has more than that frame in QUIC's buffers. When `timeout` passes first, the
    /// stream is reset (the peer drops the partial frame) and [`TransportError::Timeout`] is
    /// returned.
    pub async fn send_frame_acknowledged(
        &self,
        frame: Bytes,
        timeout: Duration,
    ) -> Result<(), TransportError> {
        let deadline = Instant::now() + timeout;
        let mut guard = self.open_stream_by(deadline, timeout).await?;
        let delivered = async {
            let stream = guard.stream();
            stream
                .write_chunk(frame)
                .await
                .map_err(|e| self.write_error(e))?;
            stream.finish().map_err(|_| TransportError::Closed)?;
            match stream.stopped().await {
                Ok(None) => Ok(()),
                Ok(Some(code)) => Err(self.write_error(WriteError::Stopped(code))),
                Err(quinn::StoppedError::ConnectionLost(e)) => Err(from_connection_error(e)),
                Err(_) => Err(TransportError::Closed),
            }
        };
        match tokio::time::timeout_at(deadline, delivered).await {
            Err(_elapsed) => Err(TransportError::timeout_after(self.peer_name(), timeout)),
            Ok(result) => {
                if result.is_ok() {
                    // Every byte is acknowledged: nothing to reset.
                    guard.0 = None;
                }
                result
            }
        }
    }

    /// Opens a stream by `deadline` (`timeout` is only for the error), reset if dropped before
    /// it is finished.
    async fn open_stream_by(
        &self,
        deadline: Instant,
        timeout: Duration,
    ) -> Result<ResetOnDrop, TransportError> {
        match tokio::time::timeout_at(deadline, self.inner.connection.open_uni()).await {
            Err(_elapsed) => Err(TransportError::timeout_after(self.peer_name(), timeout)),
            Ok(opened) => Ok(ResetOnDrop(Some(opened.map_err(from_connection_error)?))),
        }
    }

    /// Send raw bytes as one stream, unframed (for tests and benchmarks that
    /// need to send what [`PeerConnection::send`] would never produce).
    pub async fn send_frame(&self, frame: &[u8]) -> Result<(), TransportError> {
        self.send_bytes(Bytes::copy_from_slice(frame)).await
    }

    /// Write `frame` on a new stream and finish it (the buffer is handed to
    /// QUIC without a copy).
    async fn send_bytes(&self, frame: Bytes) -> Result<(), TransportError> {
        let stream = self
            .inner
            .connection
            .open_uni()
            .await
            .map_err(from_connection_error)?;
        let mut guard = ResetOnDrop(Some(stream));
        guard
            .stream()
            .write_chunk(frame)
            .await
            .map_err(|e| self.write_error(e))?;
        guard.finish()
    }

    /// [`PeerConnection::send_frame`] with a deadline: when it passes, the stream is reset
    /// and [`TransportError::Timeout`] is returned.
    pub async fn send_frame_with_timeout(
        &self,
        frame: Bytes,
        timeout: Duration,
    ) -> Result<(), TransportError> {
        match tokio::time::timeout(timeout, self.send_bytes(frame)).await {
            Ok(r) => r,
            Err(_elapsed) => Err(TransportError::timeout_after(self.peer_name(), timeout)),
        }
    }

    /// The next message from the peer, in the order streams complete.
    ///
    /// A peer fault (garbage, truncated, oversized or padded stream) is
    /// returned once as an error ([`TransportError::is_peer_fault`]); later
    /// calls go on with the next message, and the caller decides whether to
    /// close. Once the connection is closed this returns
    /// [`TransportError::Closed`] or [`TransportError::Connection`].
    /// Cancel-safe: usable in `tokio::select!`.
    pub async fn recv(&self) -> Result<Message, TransportError> {
        let mut received = self.inner.received.lock().await;
        match received.recv().await {
            Some(delivery) => delivery.result,
            None => Err(self
                .inner
                .connection
                .close_reason()
                .map_or(TransportError::Closed, from_connection_error)),
        }
    }

    /// Close the connection now (unsent and unread data is dropped); the peer
    /// sees `reason`.
    pub fn close(&self, reason: &str) {
        self.inner
            .connection
            .close(VarInt::from_u32(CLOSE_CODE_NORMAL), reason.as_bytes());
    }

    /// Wait until the connection is closed (by either side or a timeout) and
    /// say how it ended.
    pub async fn closed(&self) -> TransportError {
        from_connection_error(self.inner.connection.closed().await)
    }

    /// Whether the connection is already closed.
    pub fn is_closed(&self) -> bool {
        self.inner.connection.close_reason().is_some()
    }

    /// UDP bytes sent on this connection (frames plus QUIC/TLS overhead).
    pub fn bytes_sent(&self) -> u64 {
        self.inner.connection.stats().udp_tx.bytes
    }

    /// UDP bytes received on this connection.
    pub fn bytes_received(&self) -> u64 {
        self.inner.connection.stats().udp_rx.bytes
    }

    /// Round-trip time estimate of the connection.
    pub fn rtt(&self) -> Duration {
        self.inner.connection.rtt()
    }

    /// quinn's counters of the connection (packets sent and lost, frames, UDP bytes).
    pub fn stats(&self) -> quinn::ConnectionStats {
        self.inner.connection.stats()
    }

    /// The congestion controller's current window, bytes: what the sender may have in flight.
    pub fn congestion_window(&self) -> u64 {
        self.inner.connection.stats().path.cwnd
    }

    fn encode(&self, msg: &Message) -> Result<Bytes, TransportError> {
        protocol::encode_frame_with_limit(msg, self.inner.max_body_len)
            .map(Bytes::from)
            .map_err(|source| TransportError::Encode {
                kind: msg.kind(),
                source,
            })
    }

    fn write_error(&self, error: WriteError) -> TransportError {
        match error {
            WriteError::ConnectionLost(e) => from_connection_error(e),
            WriteError::ClosedStream => TransportError::Closed,
            other => TransportError::Write {
                peer: self.inner.peer_name.clone(),
                source: other,
            },
        }
    }
}

/// A message's stream after [`PeerConnection::send_replaceable`] handed all of it to QUIC.
/// Dropping it changes nothing (QUIC delivers the rest); [`SentStream::discard`] resets it.
#[derive(Debug)]
pub struct SentStream {
    stream: quinn::SendStream,
    len: usize,
}

impl SentStream {
    /// The frame's length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the frame was empty (never: a frame has a header).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Resets the stream: QUIC drops whatever of it is still unsent or unacknowledged and the
    /// peer, if it has not read all of it yet, drops the partial message. Nothing happens
    /// when the peer already has every byte.
    pub fn discard(mut self) {
        let _ = self.stream.reset(VarInt::from_u32(STREAM_CODE_SUPERSEDED));
    }
}

/// A send stream that is reset (not finished) if it is dropped before [`Self::finish`]:
/// quinn finishes a dropped `SendStream`, which would hand the peer a truncated frame when a
/// send is cancelled or times out. A reset stream is dropped by the peer's reader instead.
struct ResetOnDrop(Option<quinn::SendStream>);

impl ResetOnDrop {
    fn stream(&mut self) -> &mut quinn::SendStream {
        self.0.as_mut().expect("stream present until finish")
    }

    fn finish(&mut self) -> Result<(), TransportError> {
        match self.0.take() {
            Some(mut s) => s.finish().map_err(|_| TransportError::Closed),
            None => Ok(()),
        }
    }
}

impl Drop for ResetOnDrop {
    fn drop(&mut self) {
        if let Some(mut s) = self.0.take() {
            // Already closed or reset streams need no reset.
            let _ = s.reset(VarInt::from_u32(STREAM_CODE_SEND_TIMEOUT));
        }
    }
}

/// Accept the peer's streams until the connection ends, reading each in its
/// own task; finally report how the connection ended.
async fn read_streams(
    connection: quinn::Connection,
    peer: String,
    max_message_bytes: usize,
    max_body_len: u32,
    sender: mpsc::UnboundedSender<Delivery>,
) {
    let credits = Arc::new(Semaphore::new(MAX_UNDELIVERED_MESSAGES));
    let peer: Arc<str> = peer.into();
    let mut readers = JoinSet::new();
    let ended = loop {
        let permit = tokio::select! {
            permit = credits.clone().acquire_owned() => match permit {
                Ok(permit) => permit,
                Err(_closed) => return, // never closed
            },
            () = sender.closed() => return,
        };
        while readers.try_join_next().is_some() {}
        let accepted = tokio::select! {
            accepted = connection.accept_uni() => accepted,
            () = sender.closed() => return,
        };
        match accepted {
            Ok(stream) => {
                let sender = sender.clone();
                let peer = peer.clone();
                readers.spawn(async move {
                    let read = read_message(stream, &peer, max_message_bytes, max_body_len).await;
                    if let Some(result) = read {
                        let _ = sender.send(Delivery {
                            result,
                            _permit: Some(permit),
                        });
                    }
                });
            }
            Err(error) => break error,
        }
    };
    // Deliver what was already read before saying the connection ended.
    while readers.join_next().await.is_some() {}
    tracing::debug!(peer = %peer, error = %ended, "connection ended");
    let _ = sender.send(Delivery {
        result: Err(from_connection_error(ended)),
        _permit: None,
    });
}

/// Read one stream to its end and decode its frame. `None` when the stream
/// carried no message (reset by the sender, or lost with the connection).
async fn read_message(
    mut stream: RecvStream,
    peer: &str,
    max_message_bytes: usize,
    max_body_len: u32,
) -> Option<Result<Message, TransportError>> {
    match stream.read_to_end(max_message_bytes).await {
        Ok(bytes) => Some(decode_message(&bytes, peer, max_body_len)),
        Err(ReadToEndError::TooLong) => {
            let _ = stream.stop(VarInt::from_u32(STREAM_CODE_TOO_LARGE));
            Some(Err(TransportError::TooLarge {
                peer: peer.to_string(),
                limit: max_message_bytes,
            }))
        }
        Err(ReadToEndError::Read(ReadError::ConnectionLost(_))) => None,
        Err(ReadToEndError::Read(error)) => {
            tracing::debug!(peer, %error, "stream abandoned by the sender");
            None
        }
    }
}

/// Decode the one frame a stream must hold.
fn decode_message(bytes: &[u8], peer: &str, max_body_len: u32) -> Result<Message, TransportError> {
    let (message, frame_len) =
        protocol::decode_frame_with_limit(bytes, max_body_len).map_err(|source| {
            TransportError::BadFrame {
                peer: peer.to_string(),
                source,
            }
        })?;
    if frame_len != bytes.len() {
        return Err(TransportError::TrailingBytes {
            peer: peer.to_string(),
            frame_len,
            stream_len: bytes.len(),
        });
    }
    Ok(message)
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use protocol::FrameError;

    use super::*;
    use crate::test_support::{bind, bounded, cert_dir, connect_pair, delta_ack, layer_delta};
    use crate::QuicNode;

    /// 64 KiB messages at most, so oversized streams are cheap to produce.
    fn small_limit_config() -> TransportConfig {
        TransportConfig {
            max_message_bytes: 64 << 10,
            ..TransportConfig::default()
        }
    }

    #[tokio::test]
    async fn peer_faults_are_reported_once_and_the_connection_survives() {
        let dir = cert_dir(&["edge", "agg"]);
        let config = small_limit_config();
        let edge = bind(dir.path(), "edge", &config);
        let agg = bind(dir.path(), "agg", &config);
        let (bad_out, bad_in) = connect_pair(&edge, &agg, "agg").await;
        let (good_out, good_in) = connect_pair(&edge, &agg, "agg").await;

        bounded(bad_out.send_frame(b"definitely not a dreamddp frame"))
            .await
            .unwrap();
        let err = bounded(bad_in.recv()).await.unwrap_err();
        assert!(err.is_peer_fault(), "{err}");
        assert!(
            matches!(&err, TransportError::BadFrame { peer, source: FrameError::BadMagic { .. } } if peer == "edge"),
            "{err}"
        );

        let frame = protocol::encode_frame(&delta_ack(1, 2)).unwrap();
        bounded(bad_out.send_frame(&frame[..frame.len() - 3]))
            .await
            .unwrap();
        let err = bounded(bad_in.recv()).await.unwrap_err();
        assert!(
            matches!(
                &err,
                TransportError::BadFrame {
                    source: FrameError::Truncated { .. },
                    ..
                }
            ),
            "{err}"
        );

        // The receiver stops the stream at the limit; the write may or may not
        // notice before it completes.
        let _ = bounded(bad_out.send_frame(&vec![0u8; 100 << 10])).await;
        let err = bounded(bad_in.recv()).await.unwrap_err();
        assert!(
            matches!(&err, TransportError::TooLarge { peer, limit } if peer == "edge" && *limit == 64 << 10),
            "{err}"
        );
        assert!(err.is_peer_fault());

        let mut padded = frame.clone();
        padded.push(0);
        bounded(bad_out.send_frame(&padded)).await.unwrap();
        let err = bounded(bad_in.recv()).await.unwrap_err();
        assert!(
            matches!(err, TransportError::TrailingBytes { frame_len, stream_len, .. }
                if frame_len == frame.len() && stream_len == frame.len() + 1),
            "{err}"
        );

        // Faults were reported once each; a valid message still gets through.
        bounded(bad_out.send(&delta_ack(1, 3))).await.unwrap();
        assert_eq!(bounded(bad_in.recv()).await.unwrap(), delta_ack(1, 3));

        // The receiver gives up on the faulty peer; the other connection works on.
        bad_in.close("sent garbage");
        assert!(bad_in.is_closed());
        let err = bounded(bad_out.closed()).await;
        assert!(matches!(err, TransportError::Closed), "{err}");
        let err = bounded(bad_out.recv()).await.unwrap_err();
        assert!(matches!(err, TransportError::Closed), "{err}");
        assert!(!err.is_peer_fault());
        let err = bounded(bad_out.send(&delta_ack(1, 4))).await.unwrap_err();
        assert!(matches!(err, TransportError::Closed), "{err}");

        let delta = layer_delta(2, 9, 4000);
        bounded(good_out.send(&delta)).await.unwrap();
        assert_eq!(bounded(good_in.recv()).await.unwrap(), delta);
    }

    #[tokio::test]
    async fn a_message_above_the_limit_is_refused_when_encoding() {
        let dir = cert_dir(&["a", "b"]);
        let config = small_limit_config();
        let a = bind(dir.path(), "a", &config);
        let b = bind(dir.path(), "b", &config);
        let (to_b, _to_a) = connect_pair(&a, &b, "b").await;
        let err = bounded(to_b.send(&layer_delta(0, 0, 20_000)))
            .await
            .unwrap_err();
        assert!(
            matches!(
                err,
                TransportError::Encode {
                    kind: "LayerDelta",
                    source: FrameError::TooLarge { .. }
                }
            ),
            "{err}"
        );
    }

    #[tokio::test]
    async fn many_concurrent_sends_all_arrive() {
        let dir = cert_dir(&["worker", "agg"]);
        let config = TransportConfig::default();
        let worker = bind(dir.path(), "worker", &config);
        let agg = bind(dir.path(), "agg", &config);
        let (to_agg, from_worker) = connect_pair(&worker, &agg, "agg").await;

        let large: Vec<Message> = (0..2)
            .map(|i| layer_delta(100 + i, i.into(), 1 << 20))
            .collect();
        let mut senders = JoinSet::new();
        for message in large.clone() {
            let connection = to_agg.clone();
            senders.spawn(async move { connection.send(&message).await.map(|_| ()) });
        }
        for seq in 0..200 {
            let connection = to_agg.clone();
            senders.spawn(async move { connection.send(&delta_ack(1, seq)).await.map(|_| ()) });
        }
        let mut acks = BTreeSet::new();
        let mut larges = Vec::new();
        bounded(async {
            while acks.len() + larges.len() < 202 {
                match from_worker.recv().await.unwrap() {
                    Message::DeltaAck(ack) => assert!(acks.insert(ack.seq)),
                    other => larges.push(other),
                }
            }
        })
        .await;
        while let Some(sent) = bounded(senders.join_next()).await {
            sent.unwrap().unwrap();
        }
        assert_eq!(acks, (0..200).collect());
        larges.sort_by_key(|m| match m {
            Message::LayerDelta(p) => p.layer_id,
            _ => u32::MAX,
        });
        assert_eq!(larges, large);
    }

    #[tokio::test]
    async fn a_small_message_is_not_held_behind_an_unfinished_large_one() {
        let dir = cert_dir(&["worker", "agg"]);
        let config = TransportConfig::default();
        let worker = bind(dir.path(), "worker", &config);
        let agg = bind(dir.path(), "agg", &config);
        let (to_agg, from_worker) = connect_pair(&worker, &agg, "agg").await;

        let big = layer_delta(5, 1, 256 << 10);
        let frame = protocol::encode_frame(&big).unwrap();
        let mut slow = bounded(to_agg.inner.connection.open_uni()).await.unwrap();
        bounded(slow.write_all(&frame[..frame.len() / 2]))
            .await
            .unwrap();

        bounded(to_agg.send(&delta_ack(5, 1))).await.unwrap();
        assert_eq!(bounded(from_worker.recv()).await.unwrap(), delta_ack(5, 1));

        bounded(slow.write_all(&frame[frame.len() / 2..]))
            .await
            .unwrap();
        slow.finish().unwrap();
        assert_eq!(bounded(from_worker.recv()).await.unwrap(), big);
    }

    /// A worker→aggregator pair with small flow-control windows whose aggregator has not read
    /// anything yet: its message queue is full, so the next large send blocks on flow
    /// control. (The temp dir and the nodes must outlive the links.)
    async fn stalled_pair() -> (
        tempfile::TempDir,
        (QuicNode, QuicNode),
        PeerConnection,
        PeerConnection,
    ) {
        let dir = cert_dir(&["worker", "agg"]);
        let config = TransportConfig {
            stream_receive_window: 32 << 10,
            receive_window: 256 << 10,
            ..TransportConfig::default()
        };
        let worker = bind(dir.path(), "worker", &config);
        let agg = bind(dir.path(), "agg", &config);
        let (to_agg, from_worker) = connect_pair(&worker, &agg, "agg").await;
        for seq in 0..MAX_UNDELIVERED_MESSAGES as u64 {
            bounded(to_agg.send(&delta_ack(1, seq))).await.unwrap();
        }
        (dir, (worker, agg), to_agg, from_worker)
    }

    #[tokio::test]
    async fn send_with_timeout_resets_when_the_peer_stops_reading() {
        let (_dir, _nodes, to_agg, from_worker) = stalled_pair().await;
        let big = layer_delta(2, 0, 256 << 10);
        let err = bounded(to_agg.send_with_timeout(&big, Duration::from_millis(300)))
            .await
            .unwrap_err();
        assert!(matches!(err, TransportError::Timeout), "{err}");

        // Once the aggregator reads again, everything queued arrives, the
        // reset message is dropped, and the connection carries on.
        let mut drained = BTreeSet::new();
        for _ in 0..MAX_UNDELIVERED_MESSAGES {
            match bounded(from_worker.recv()).await.unwrap() {
                Message::DeltaAck(ack) if ack.layer_id == 1 => drained.insert(ack.seq),
                other => panic!("unexpected {other:?}"),
            };
        }
        assert_eq!(drained, (0..MAX_UNDELIVERED_MESSAGES as u64).collect());
        let sent = bounded(to_agg.send_with_timeout(&delta_ack(3, 0), Duration::from_secs(5)))
            .await
            .unwrap();
        assert!(sent > protocol::HEADER_LEN);
        assert_eq!(bounded(from_worker.recv()).await.unwrap(), delta_ack(3, 0));
    }

    #[tokio::test]
    async fn a_replaceable_send_delivers_and_discarding_it_afterwards_is_harmless() {
        let dir = cert_dir(&["worker", "agg"]);
        let config = TransportConfig::default();
        let worker = bind(dir.path(), "worker", &config);
        let agg = bind(dir.path(), "agg", &config);
        let (to_agg, from_worker) = connect_pair(&worker, &agg, "agg").await;
        let big = layer_delta(2, 0, 256 << 10);
        let sent = bounded(to_agg.send_replaceable(&big, Duration::from_secs(5)))
            .await
            .unwrap();
        assert!(sent.len() > 256 << 10 && !sent.is_empty());
        assert_eq!(bounded(from_worker.recv()).await.unwrap(), big);
        // The peer has every byte: resetting the stream now changes nothing for it, and the
        // connection carries on.
        sent.discard();
        bounded(to_agg.send(&delta_ack(3, 0))).await.unwrap();
        assert_eq!(bounded(from_worker.recv()).await.unwrap(), delta_ack(3, 0));
    }

    #[tokio::test]
    async fn an_acknowledged_send_returns_once_the_peer_has_the_frame_and_resets_on_a_stall() {
        let dir = cert_dir(&["agg", "edge"]);
        let config = TransportConfig::default();
        let agg = bind(dir.path(), "agg", &config);
        let edge = bind(dir.path(), "edge", &config);
        let (to_edge, from_agg) = connect_pair(&agg, &edge, "edge").await;
        let version = layer_delta(0, 3, 1 << 20);
        let frame = Bytes::from(protocol::encode_frame(&version).unwrap());
        bounded(to_edge.send_frame_acknowledged(frame, Duration::from_secs(10)))
            .await
            .unwrap();
        // Every byte was acknowledged, so the whole frame is already at the peer.
        let arrived = tokio::time::timeout(Duration::from_millis(500), from_agg.recv()).await;
        assert_eq!(arrived.expect("already received").unwrap(), version);

        // A peer that stops reading: the send times out, its stream is reset, the peer never
        // sees a partial frame and the connection carries on.
        let (_dir, _nodes, to_agg, from_worker) = stalled_pair().await;
        let big = Bytes::from(protocol::encode_frame(&layer_delta(2, 0, 256 << 10)).unwrap());
        let err = bounded(to_agg.send_frame_acknowledged(big, Duration::from_millis(300)))
            .await
            .unwrap_err();
        assert!(matches!(err, TransportError::Timeout), "{err}");
        only_the_queued_acks_then_the_next_message(&to_agg, &from_worker).await;
    }

    #[tokio::test]
    async fn a_cancelled_send_resets_its_stream_instead_of_truncating_it() {
        let (_dir, _nodes, to_agg, from_worker) = stalled_pair().await;
        // The caller gives up on a plain send (its future is dropped mid-write), as a
        // tokio::time::timeout or an aborted task does.
        let big = layer_delta(2, 0, 256 << 10);
        let cancelled = tokio::time::timeout(Duration::from_millis(300), to_agg.send(&big)).await;
        assert!(
            cancelled.is_err(),
            "the send should still be blocked on flow control"
        );
        // The peer never sees a truncated frame: only the queued acks, then the next message.
        only_the_queued_acks_then_the_next_message(&to_agg, &from_worker).await;
    }

    /// After a reset on a [`stalled_pair`]: the aggregator reads only the acks queued before
    /// it (never a partial frame), then the connection carries the next message.
    async fn only_the_queued_acks_then_the_next_message(
        to_agg: &PeerConnection,
        from_worker: &PeerConnection,
    ) {
        for _ in 0..MAX_UNDELIVERED_MESSAGES {
            let m = bounded(from_worker.recv()).await;
            assert!(matches!(m, Ok(Message::DeltaAck(_))), "{m:?}");
        }
        bounded(to_agg.send(&delta_ack(3, 0))).await.unwrap();
        assert_eq!(bounded(from_worker.recv()).await.unwrap(), delta_ack(3, 0));
    }
}
