//! Typed errors of the transport: [`CertError`] for creating and loading the
//! cluster's certificates, [`TransportError`] for endpoints, connections and
//! messages.
//!
//! Every error a peer can cause (garbage bytes, an oversized stream, a refused
//! handshake) is a variant here; nothing in this crate panics on peer input.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use protocol::FrameError;

/// Why the cluster's certificates could not be created or loaded.
#[derive(Debug, thiserror::Error)]
pub enum CertError {
    /// A node name cannot be used as a file name, certificate CN and DNS name.
    #[error(
        "invalid node name {name:?}: {reason}; use 1–63 characters from [A-Za-z0-9._-], \
         not starting or ending with '.' or '-'"
    )]
    InvalidName {
        /// The rejected name.
        name: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// A certificate or key file does not exist.
    #[error("{what} file {path} does not exist: {hint}")]
    Missing {
        /// Which file ("CA certificate", "node certificate", "node private key", ...).
        what: &'static str,
        /// The missing path.
        path: PathBuf,
        /// What to do about it.
        hint: String,
    },
    /// A file could not be read or written.
    #[error("cannot {action} {path}: {source}")]
    Io {
        /// "read", "write", "create directory", ...
        action: &'static str,
        /// The file or directory.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// A file exists but does not hold what it should.
    #[error("{what} file {path} is unusable: {reason}; {hint}")]
    Parse {
        /// Which file.
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// What is wrong with its content.
        reason: String,
        /// What to do about it.
        hint: String,
    },
    /// Only one of `ca.pem` / `ca.key` exists, so the CA cannot be reused.
    #[error(
        "{present} exists but {absent} does not: the cluster CA is incomplete; restore the \
         missing file, or move both away to create a new CA (every node then needs new certificates)"
    )]
    IncompleteCa {
        /// The CA file that exists.
        present: PathBuf,
        /// The CA file that is missing.
        absent: PathBuf,
    },
    /// A certificate lifetime of zero was asked for.
    #[error(
        "a certificate lifetime of 0 days makes certificates that are never valid; give at least 1"
    )]
    ZeroLifetime,
    /// This node's own certificate is outside its validity period.
    #[error("node certificate {path} {state} ({when}); every peer refuses it: {hint}")]
    Expired {
        /// The certificate file.
        path: PathBuf,
        /// "expired" or "is not valid yet".
        state: &'static str,
        /// Its `notAfter` or `notBefore`, as RFC 2822.
        when: String,
        /// What to do about it.
        hint: String,
    },
    /// rcgen could not generate a key or sign a certificate.
    #[error("certificate generation failed: {0}")]
    Generate(#[from] rcgen::Error),
}

/// Why a transport operation failed.
#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    /// The [`crate::TransportConfig`] is inconsistent.
    #[error("invalid transport config: {0}")]
    InvalidConfig(String),
    /// The node's certificates could not be loaded.
    #[error(transparent)]
    Cert(#[from] CertError),
    /// The TLS configuration could not be built from the loaded certificates.
    #[error("TLS setup failed: {0}; regenerate the certificates with `dreamddp certs`")]
    Tls(String),
    /// The UDP socket could not be bound or queried.
    #[error("cannot {action} UDP endpoint {addr:?}: {source}")]
    Io {
        /// "bind", "query the address of", ...
        action: &'static str,
        /// The address involved, when known.
        addr: Option<SocketAddr>,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// Dialing a peer failed: bad name, unreachable, or the handshake was refused
    /// (unknown CA, missing/unknown client certificate, wrong protocol).
    #[error("connecting to {server_name} at {addr} failed: {reason}")]
    Connect {
        /// Address dialed.
        addr: SocketAddr,
        /// Name the peer's certificate was checked against.
        server_name: String,
        /// Why.
        reason: String,
    },
    /// An incoming connection was refused during the handshake.
    #[error("incoming connection from {peer} refused: {reason}")]
    Refused {
        /// Address of the refused peer.
        peer: SocketAddr,
        /// Why (e.g. no client certificate, certificate from another CA).
        reason: String,
    },
    /// The connection (or the endpoint) was closed, by us or by the peer.
    #[error("connection closed")]
    Closed,
    /// The connection failed (timeout, reset, protocol violation).
    #[error("connection lost: {0}")]
    Connection(#[from] quinn::ConnectionError),
    /// Writing a message failed.
    #[error("sending to {peer} failed: {source}")]
    Write {
        /// Peer name.
        peer: String,
        /// The underlying error.
        #[source]
        source: quinn::WriteError,
    },
    /// A message could not be encoded (e.g. its body exceeds the frame limit).
    #[error("cannot encode {kind} message: {source}")]
    Encode {
        /// Message kind.
        kind: &'static str,
        /// The underlying error.
        #[source]
        source: FrameError,
    },
    /// A send did not complete within its deadline; the stream was reset.
    #[error("send timed out; the stream was reset")]
    Timeout,
    /// The peer sent a stream longer than `max_message_bytes` (peer fault).
    #[error(
        "peer {peer} sent a message larger than {limit} bytes; the stream was stopped \
         (raise max_message_bytes on both sides if this is legitimate)"
    )]
    TooLarge {
        /// Peer name.
        peer: String,
        /// The configured `max_message_bytes`.
        limit: usize,
    },
    /// The peer sent a stream that is not one valid frame (peer fault).
    #[error("peer {peer} sent a bad frame: {source}")]
    BadFrame {
        /// Peer name.
        peer: String,
        /// What was wrong with it.
        #[source]
        source: FrameError,
    },
    /// The peer's stream held bytes after its one frame (peer fault).
    #[error(
        "peer {peer} sent {stream_len} bytes on a stream whose frame is {frame_len} bytes: \
         one message per stream, nothing after it"
    )]
    TrailingBytes {
        /// Peer name.
        peer: String,
        /// Length of the frame at the start of the stream.
        frame_len: usize,
        /// Length of the whole stream.
        stream_len: usize,
    },
}

impl TransportError {
    /// Whether the peer sent something invalid (a bad, oversized or padded
    /// frame). The connection itself still works; the caller decides whether
    /// to close it.
    pub fn is_peer_fault(&self) -> bool {
        matches!(
            self,
            TransportError::BadFrame { .. }
                | TransportError::TooLarge { .. }
                | TransportError::TrailingBytes { .. }
        )
    }

    /// [`TransportError::Timeout`], with a debug log of the peer and deadline.
    pub(crate) fn timeout_after(peer: &str, after: Duration) -> TransportError {
        tracing::debug!(peer, ?after, "send timed out; the stream was reset");
        TransportError::Timeout
    }
}

/// Map a connection-level error: application/local closes become
impl TransportError {
    /// Whether the peer refused this node because its certificate was revoked (TLS's
    /// `certificate_revoked` alert, code 44, during the handshake).
    pub fn is_certificate_revoked(&self) -> bool {
        match self {
            TransportError::Connect { reason, .. } | TransportError::Refused { reason, .. } => {
                reason.contains("certificate: Revoked") || reason.contains("error 44:")
            }
            _ => false,
        }
    }
}

/// [`TransportError::Closed`], everything else [`TransportError::Connection`].
pub(crate) fn from_connection_error(error: quinn::ConnectionError) -> TransportError {
    match error {
        quinn::ConnectionError::ApplicationClosed(_) | quinn::ConnectionError::LocallyClosed => {
            TransportError::Closed
        }
        other => TransportError::Connection(other),
    }
}
