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

    /// Send `msg` on its own stream. Returns the frame's length in bytes.
    /// Completes when the frame is handed to QUIC (buffered), not when the
    /// peer has read it.
    pub async fn send(&self, msg: &Message) -> Result<usize, TransportError> {
        let frame = self.encode(msg)?;
        self.send_frame(&frame).await?;
        Ok(frame.len())
    }

    /// [`PeerConnection::send`] with a deadline. When it passes, the stream is
    /// reset (the peer drops the partial message) and
    /// [`TransportError::Timeout`] is returned.
    pub async fn send_with_timeout(
        &self,
        msg: &Message,
        timeout: Duration,
    ) -> Result<usize, TransportError> {
        let deadline = Instant::now() + timeout;
        let frame = self.encode(msg)?;
        let opened = tokio::time::timeout_at(deadline, self.inner.connection.open_uni()).await;
        let mut stream = match opened {
            Err(_elapsed) => return Err(TransportError::timeout_after(self.peer_name(), timeout)),
            Ok(opened) => opened.map_err(from_connection_error)?,
        };
        match tokio::time::timeout_at(deadline, stream.write_all(&frame)).await {
            Err(_elapsed) => {
                // Already closed or reset streams need no reset.
                let _ = stream.reset(VarInt::from_u32(STREAM_CODE_SEND_TIMEOUT));
                Err(TransportError::timeout_after(self.peer_name(), timeout))
            }
            Ok(written) => {
                written.map_err(|e| self.write_error(e))?;
                stream.finish().map_err(|_| TransportError::Closed)?;
                Ok(frame.len())
            }
        }
    }

    /// Send raw bytes as one stream, unframed (for tests and benchmarks that
    /// need to send what [`PeerConnection::send`] would never produce).
    pub async fn send_frame(&self, frame: &[u8]) -> Result<(), TransportError> {
        let mut stream = self
            .inner
            .connection
            .open_uni()
            .await
            .map_err(from_connection_error)?;
        stream
            .write_all(frame)
            .await
            .map_err(|e| self.write_error(e))?;
        stream.finish().map_err(|_| TransportError::Closed)
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

    fn encode(&self, msg: &Message) -> Result<Vec<u8>, TransportError> {
        protocol::encode_frame_with_limit(msg, self.inner.max_body_len).map_err(|source| {
            TransportError::Encode {
                kind: msg.kind(),
                source,
            }
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
