//! [`QuicNode`]: one quinn endpoint per process that both accepts and dials,
//! with mutual TLS rooted at the cluster CA.
//!
//! A connection is handed out only after both sides have verified each other:
//! the TLS handshake, then a one-round-trip check on a bidirectional stream
//! (the client sends [`CHECK_REQUEST`], the server answers [`CHECK_REPLY`]).
//! The check is needed because in TLS 1.3 a client finishes its handshake
//! before the server has judged the client's certificate; without it, a
//! client with an unknown certificate would see `connect` succeed and its
//! connection die a moment later.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use quinn::VarInt;
use tokio::sync::{mpsc, Mutex};
use tokio::task::{AbortHandle, JoinSet};

use crate::certs::TlsIdentity;
use crate::config::TransportConfig;
use crate::connection::{PeerConnection, CLOSE_CODE_NORMAL};
use crate::error::TransportError;
use crate::revocation::{Revocations, CHECK_EVERY, CLOSE_CODE_REVOKED};
use crate::tls::{peer_common_name, quinn_configs};
use rustls_pki_types::CertificateDer;

/// Bytes a client sends on the check stream right after the handshake.
pub const CHECK_REQUEST: &[u8] = b"dreamddp/3 hello";
/// Bytes the server answers once it has accepted the client's certificate.
pub const CHECK_REPLY: &[u8] = b"dreamddp/3 welcome";
/// Connection close code: the peer failed the post-handshake check.
pub const CLOSE_CODE_CHECK_FAILED: u32 = 2;
/// Accepted connections (or refusals) queued for [`QuicNode::accept`].
const ACCEPT_QUEUE: usize = 64;
/// Longest check message read.
const CHECK_MAX_BYTES: usize = 64;

/// A QUIC endpoint that accepts and dials authenticated connections.
pub struct QuicNode {
    endpoint: quinn::Endpoint,
    config: TransportConfig,
    accepted: Mutex<mpsc::Receiver<Result<PeerConnection, TransportError>>>,
    acceptor: AbortHandle,
    /// Re-reads the revocation list and closes revoked peers' connections.
    revocation_watcher: AbortHandle,
}

/// The connections this node accepted that are still open (the ones a revocation closes).
type LiveConnections = Arc<std::sync::Mutex<Vec<quinn::Connection>>>;

impl std::fmt::Debug for QuicNode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QuicNode")
            .field("local_addr", &self.endpoint.local_addr().ok())
            .field("config", &self.config)
            .finish()
    }
}

impl Drop for QuicNode {
    fn drop(&mut self) {
        self.acceptor.abort();
        self.revocation_watcher.abort();
    }
}

impl QuicNode {
    /// Load `identity`, bind a UDP socket on `addr` (port 0: any free port) and
    /// start accepting connections. Must be called inside a tokio runtime.
    pub fn bind(
        addr: SocketAddr,
        identity: &TlsIdentity,
        config: &TransportConfig,
    ) -> Result<QuicNode, TransportError> {
        config.validate()?;
        let configs = quinn_configs(identity.load()?, &identity.ca_cert, config)?;
        let io = |source| TransportError::Io {
            action: "bind",
            addr: Some(addr),
            source,
        };
        let socket = std::net::UdpSocket::bind(addr).map_err(io)?;
        let buffers = crate::udp_buffers::enlarge(socket2::SockRef::from(&socket));
        tracing::debug!(
            "UDP buffers at {addr}: receive {} KiB, send {} KiB",
            buffers.recv >> 10,
            buffers.send >> 10
        );
        let mut endpoint_config = quinn::EndpointConfig::default();
        endpoint_config
            .max_udp_payload_size(config.max_udp_payload)
            .map_err(|e| TransportError::InvalidConfig(format!("max_udp_payload: {e}")))?;
        let runtime = quinn::default_runtime().ok_or_else(|| {
            TransportError::InvalidConfig("no async runtime found (bind inside tokio)".into())
        })?;
        let mut endpoint =
            quinn::Endpoint::new(endpoint_config, Some(configs.server), socket, runtime)
                .map_err(io)?;
        endpoint.set_default_client_config(configs.client);
        let (sender, receiver) = mpsc::channel(ACCEPT_QUEUE);
        let live = LiveConnections::default();
        let acceptor = tokio::spawn(accept_connections(
            endpoint.clone(),
            config.clone(),
            sender,
            live.clone(),
        ));
        let revocation_watcher = tokio::spawn(watch_revocations(configs.revocations, live));
        Ok(QuicNode {
            endpoint,
            config: config.clone(),
            accepted: Mutex::new(receiver),
            acceptor: acceptor.abort_handle(),
            revocation_watcher: revocation_watcher.abort_handle(),
        })
    }

    /// The address the endpoint is bound to.
    pub fn local_addr(&self) -> Result<SocketAddr, TransportError> {
        self.endpoint
            .local_addr()
            .map_err(|source| TransportError::Io {
                action: "query the address of",
                addr: None,
                source,
            })
    }

    /// The settings every connection of this node uses.
    pub fn config(&self) -> &TransportConfig {
        &self.config
    }

    /// Dial the node named `server_name` at `addr`. Fails if the peer's
    /// certificate is not from the cluster CA or not for `server_name`, or if
    /// the peer refuses ours.
    pub async fn connect(
        &self,
        addr: SocketAddr,
        server_name: &str,
    ) -> Result<PeerConnection, TransportError> {
        let failed = |reason: String| TransportError::Connect {
            addr,
            server_name: server_name.to_string(),
            reason,
        };
        let connecting = self
            .endpoint
            .connect(addr, server_name)
            .map_err(|e| failed(e.to_string()))?;
        let connection = connecting
            .await
            .map_err(|e| failed(format!("handshake failed: {e}")))?;
        let checked = tokio::time::timeout(self.config.idle_timeout, client_check(&connection))
            .await
            .unwrap_or_else(|_| Err("the peer did not confirm the connection in time".into()));
        if let Err(reason) = checked {
            connection.close(VarInt::from_u32(CLOSE_CODE_CHECK_FAILED), b"check failed");
            return Err(failed(reason));
        }
        let Some(peer_name) = peer_common_name(&connection) else {
            connection.close(VarInt::from_u32(CLOSE_CODE_CHECK_FAILED), b"no CN");
            return Err(failed("the peer's certificate has no common name".into()));
        };
        tracing::debug!(peer = %peer_name, %addr, "connected");
        Ok(PeerConnection::start(connection, peer_name, &self.config))
    }

    /// The next authenticated incoming connection; `Err` for a refused
    /// handshake (no or unknown client certificate, another CA, wrong
    /// protocol), which is also logged; `None` once the node is closed.
    /// Cancel-safe.
    pub async fn accept(&self) -> Option<Result<PeerConnection, TransportError>> {
        self.accepted.lock().await.recv().await
    }

    /// Close the endpoint and every connection on it now.
    pub fn close(&self) {
        self.endpoint
            .close(VarInt::from_u32(CLOSE_CODE_NORMAL), b"node closed");
    }

    /// Wait until every connection is closed and its close is sent (use after
    /// [`QuicNode::close`] before exiting).
    pub async fn wait_idle(&self) {
        self.endpoint.wait_idle().await;
    }
}

/// Client side of the post-handshake check.
async fn client_check(connection: &quinn::Connection) -> Result<(), String> {
    // A refusal shows up as a lost stream; the connection's close reason says why.
    let refused = |e: &dyn std::fmt::Display| match connection.close_reason() {
        Some(reason) => format!("the peer refused the connection: {reason}"),
        None => format!("the connection check failed: {e}"),
    };
    let (mut send, mut recv) = connection.open_bi().await.map_err(|e| refused(&e))?;
    send.write_all(CHECK_REQUEST)
        .await
        .map_err(|e| refused(&e))?;
    send.finish().map_err(|e| refused(&e))?;
    let reply = recv
        .read_to_end(CHECK_MAX_BYTES)
        .await
        .map_err(|e| refused(&e))?;
    if reply != CHECK_REPLY {
        return Err("the peer answered the connection check with unexpected bytes".into());
    }
    Ok(())
}

/// Server side of the post-handshake check.
async fn server_check(connection: &quinn::Connection) -> Result<(), String> {
    let (mut send, mut recv) = connection
        .accept_bi()
        .await
        .map_err(|e| format!("no connection check: {e}"))?;
    let request = recv
        .read_to_end(CHECK_MAX_BYTES)
        .await
        .map_err(|e| format!("connection check unreadable: {e}"))?;
    if request != CHECK_REQUEST {
        return Err("the client does not speak dreamddp/3 (bad connection check)".into());
    }
    send.write_all(CHECK_REPLY)
        .await
        .map_err(|e| format!("cannot answer the connection check: {e}"))?;
    send.finish().map_err(|e| e.to_string())
}

/// Accept incoming connections until the endpoint closes, running each
/// handshake in its own task so a stalled peer never blocks the others.
async fn accept_connections(
    endpoint: quinn::Endpoint,
    config: TransportConfig,
    sender: mpsc::Sender<Result<PeerConnection, TransportError>>,
    live: LiveConnections,
) {
    let mut handshakes = JoinSet::new();
    while let Some(incoming) = endpoint.accept().await {
        while handshakes.try_join_next().is_some() {}
        let sender = sender.clone();
        let config = config.clone();
        let live = live.clone();
        handshakes.spawn(async move {
            let peer = incoming.remote_address();
            let result = handshake(incoming, &config, &live).await;
            if let Err(error) = &result {
                let reason = match error {
                    TransportError::Refused { reason, .. } => reason.clone(),
                    other => other.to_string(),
                };
                tracing::error!("peer={peer} refused: {reason}");
            }
            let _ = sender.send(result).await;
        });
    }
    while handshakes.join_next().await.is_some() {}
}

/// Complete one incoming handshake and its check.
async fn handshake(
    incoming: quinn::Incoming,
    config: &TransportConfig,
    live: &LiveConnections,
) -> Result<PeerConnection, TransportError> {
    let peer = incoming.remote_address();
    let refused = |reason: String| TransportError::Refused { peer, reason };
    let connection = incoming
        .await
        .map_err(|e| refused(format!("handshake failed: {e}")))?;
    let check_timeout: Duration = config.idle_timeout;
    let checked = tokio::time::timeout(check_timeout, server_check(&connection))
        .await
        .unwrap_or_else(|_| Err("the client sent no connection check in time".into()));
    if let Err(reason) = checked {
        connection.close(VarInt::from_u32(CLOSE_CODE_CHECK_FAILED), b"check failed");
        return Err(refused(reason));
    }
    let Some(peer_name) = peer_common_name(&connection) else {
        connection.close(VarInt::from_u32(CLOSE_CODE_CHECK_FAILED), b"no CN");
        return Err(refused("the client certificate has no common name".into()));
    };
    tracing::debug!(peer = %peer_name, addr = %peer, "accepted");
    if let Ok(mut live) = live.lock() {
        live.retain(|c| c.close_reason().is_none());
        live.push(connection.clone());
    }
    Ok(PeerConnection::start(connection, peer_name, config))
}

/// Re-read the revocation list every [`CHECK_EVERY`]; when a new one is in force, close the
/// accepted connections whose peer certificate it lists. A bad list is reported once per
/// distinct error and the previous one stays in force.
async fn watch_revocations(revocations: Arc<Revocations>, live: LiveConnections) {
    let mut last_error: Option<String> = None;
    loop {
        tokio::time::sleep(CHECK_EVERY).await;
        match revocations.reload() {
            Ok(false) => {}
            Ok(true) => {
                last_error = None;
                let open: Vec<quinn::Connection> = match live.lock() {
                    Ok(mut live) => {
                        live.retain(|c| c.close_reason().is_none());
                        live.clone()
                    }
                    Err(_) => Vec::new(),
                };
                for connection in open {
                    let revoked = connection
                        .peer_identity()
                        .and_then(|id| id.downcast::<Vec<CertificateDer<'static>>>().ok())
                        .and_then(|chain| chain.first().map(|c| revocations.is_revoked(c)))
                        .unwrap_or(false);
                    if revoked {
                        let name = peer_common_name(&connection).unwrap_or_default();
                        tracing::warn!(
                            "[WARN] peer={name} addr={} certificate revoked: connection closed, \
                             new connections refused",
                            connection.remote_address()
                        );
                        connection
                            .close(VarInt::from_u32(CLOSE_CODE_REVOKED), b"certificate revoked");
                    }
                }
            }
            Err(e) => {
                let text = e.to_string();
                if last_error.as_deref() != Some(text.as_str()) {
                    tracing::warn!("[WARN] revocation list not applied, the previous one stays in force: {text}");
                    last_error = Some(text);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::certs::CertError;
    use crate::test_support::{
        bind, bounded, cert_dir, connect_pair, delta_ack, layer_delta, localhost,
    };

    #[tokio::test]
    async fn two_nodes_exchange_deltas_and_acks_both_ways() {
        let dir = cert_dir(&["worker-0", "agg-0"]);
        let config = TransportConfig::default();
        let worker = bind(dir.path(), "worker-0", &config);
        let aggregator = bind(dir.path(), "agg-0", &config);
        let (to_agg, to_worker) = connect_pair(&worker, &aggregator, "agg-0").await;
        assert_eq!(to_agg.peer_name(), "agg-0");
        assert_eq!(to_worker.peer_name(), "worker-0");
        assert_eq!(to_agg.remote_addr(), aggregator.local_addr().unwrap());

        for (from, to) in [(&to_agg, &to_worker), (&to_worker, &to_agg)] {
            let delta = layer_delta(3, 11, 1000);
            let sent = bounded(from.send(&delta)).await.unwrap();
            assert!(sent > 4000, "frame of {sent} bytes");
            assert_eq!(bounded(to.recv()).await.unwrap(), delta);
            let ack = delta_ack(3, 11);
            bounded(from.send(&ack)).await.unwrap();
            assert_eq!(bounded(to.recv()).await.unwrap(), ack);
        }
        assert!(to_agg.bytes_sent() > 8000 && to_agg.bytes_received() > 8000);

        to_agg.close("done");
        let closed = bounded(to_worker.recv()).await.unwrap_err();
        assert!(matches!(closed, TransportError::Closed), "{closed}");
        worker.close();
        aggregator.close();
        bounded(worker.wait_idle()).await;
        assert!(bounded(aggregator.accept()).await.is_none());
    }

    #[tokio::test]
    async fn a_node_from_another_ca_is_refused_on_both_sides() {
        let cluster = cert_dir(&["agg-0"]);
        let other = cert_dir(&["intruder"]);
        let config = TransportConfig::default();
        let aggregator = bind(cluster.path(), "agg-0", &config);
        let intruder = bind(other.path(), "intruder", &config);
        let addr = aggregator.local_addr().unwrap();
        let (dialed, accepted) =
            bounded(async { tokio::join!(intruder.connect(addr, "agg-0"), aggregator.accept()) })
                .await;
        let err = dialed.unwrap_err();
        assert!(matches!(err, TransportError::Connect { .. }), "{err}");
        let err = accepted.unwrap().unwrap_err();
        assert!(matches!(err, TransportError::Refused { .. }), "{err}");
    }

    #[tokio::test]
    async fn a_client_trusting_our_ca_but_with_a_foreign_cert_is_refused() {
        // The intruder trusts the cluster CA (so it accepts the server) but
        // presents a certificate from its own CA: only the server can refuse.
        let cluster = cert_dir(&["agg-0"]);
        let other = cert_dir(&["intruder"]);
        let config = TransportConfig::default();
        let aggregator = bind(cluster.path(), "agg-0", &config);
        let mut identity = TlsIdentity::in_dir(other.path(), "intruder");
        identity.ca_cert = TlsIdentity::in_dir(cluster.path(), "agg-0").ca_cert;
        let intruder = QuicNode::bind(localhost(), &identity, &config).unwrap();
        let addr = aggregator.local_addr().unwrap();
        let (dialed, accepted) =
            bounded(async { tokio::join!(intruder.connect(addr, "agg-0"), aggregator.accept()) })
                .await;
        let err = dialed.unwrap_err();
        assert!(matches!(err, TransportError::Connect { .. }), "{err}");
        let err = accepted.unwrap().unwrap_err();
        assert!(matches!(err, TransportError::Refused { .. }), "{err}");
    }

    #[tokio::test]
    async fn dialing_the_wrong_node_name_fails() {
        let dir = cert_dir(&["a", "b"]);
        let config = TransportConfig::default();
        let a = bind(dir.path(), "a", &config);
        let b = bind(dir.path(), "b", &config);
        let err = bounded(a.connect(b.local_addr().unwrap(), "c"))
            .await
            .unwrap_err();
        assert!(matches!(err, TransportError::Connect { .. }), "{err}");
        assert!(err.to_string().contains("c at 127.0.0.1"), "{err}");
    }

    #[tokio::test]
    async fn a_missing_certificate_is_a_typed_error_naming_the_path() {
        let dir = cert_dir(&["a"]);
        let identity = TlsIdentity::in_dir(dir.path(), "b");
        let err = QuicNode::bind(localhost(), &identity, &TransportConfig::default()).unwrap_err();
        let TransportError::Cert(CertError::Missing { path, .. }) = &err else {
            panic!("expected a missing-file error, got {err}");
        };
        assert_eq!(path, &identity.cert);
        assert!(err.to_string().contains("dreamddp certs --dir"), "{err}");
    }

    #[tokio::test]
    async fn an_invalid_config_is_refused_before_binding() {
        let dir = cert_dir(&["a"]);
        let config = TransportConfig {
            keep_alive: Duration::from_secs(30),
            ..TransportConfig::default()
        };
        let err = QuicNode::bind(localhost(), &TlsIdentity::in_dir(dir.path(), "a"), &config)
            .unwrap_err();
        assert!(matches!(err, TransportError::InvalidConfig(_)), "{err}");
    }
}
