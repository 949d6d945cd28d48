//! # transport — dreamddp's QUIC transport
//!
//! Every dreamddp process (coordinator, aggregator, worker, edge) talks to its
//! peers through one [`QuicNode`]: a quinn endpoint that both accepts and
//! dials, with mutual TLS rooted at the cluster CA (an unknown peer is
//! refused on both sides). Each [`protocol::Message`] travels as one frame on
//! its own unidirectional stream; the receiver reads streams concurrently so a
//! large layer never holds back a small ack.
//!
//! * [`certs`] — the cluster CA and node certificates ([`create_cluster_certs`],
//!   [`TlsIdentity`]).
//! * [`revocation`] — revoking node certificates while the cluster runs
//!   ([`revoke_nodes`], `revoked.crl`, re-read by every accepting node).
//! * [`config`] — [`TransportConfig`] (timeouts, flow-control windows, message limit).
//! * [`node`] — [`QuicNode`]: bind, connect, accept, close.
//! * [`connection`] — [`PeerConnection`]: send, recv, close, byte counters.
//! * [`tls`] — rustls/quinn configuration with an explicit ring provider
//!   (nothing is installed process-wide).
//! * [`error`] — [`TransportError`], [`CertError`].
//! * [`mod@bench`] — [`bench_transport_vs_raw`], throughput against raw quinn.
//!
//! [`QuicNode::bind`] must be called inside a tokio runtime.

pub mod bbr;
pub mod bench;
pub mod certs;
pub mod config;
pub mod connection;
pub mod error;
pub mod node;
pub mod revocation;
pub mod tls;
pub mod udp_buffers;

#[cfg(test)]
mod test_support;

pub use bench::{bench_transport_vs_raw, BenchParams, BenchResult};
pub use certs::{
    create_cluster_certs, create_cluster_certs_valid_for, validate_node_name, TlsIdentity,
    DEFAULT_CERT_LIFETIME,
};
pub use config::{Congestion, TransportConfig, EDGE_CONNECTION_WINDOW, EDGE_STREAM_WINDOW};
pub use connection::{PeerConnection, SentStream};
pub use error::{CertError, TransportError};
pub use node::QuicNode;
pub use revocation::{revoke_nodes, CLOSE_CODE_REVOKED, REVOKED_FILE};
pub use tls::ALPN;
