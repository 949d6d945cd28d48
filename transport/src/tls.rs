//! Mutual TLS for QUIC: builds the quinn server and client configurations from
//! a loaded [`crate::TlsIdentity`] with an explicit ring `CryptoProvider`
//! (nothing is installed process-wide), and reads the verified peer's name.
//!
//! Both sides trust only the cluster CA: the server requires a client
//! certificate signed by it (`WebPkiClientVerifier`), the client checks the
//! server's certificate against it and the node name it dialed. The server's verifier also
//! enforces the cluster's revocation list (`crate::revocation`).

use std::path::Path;
use std::sync::Arc;

use quinn::crypto::rustls::{QuicClientConfig, QuicServerConfig};
use rustls::crypto::CryptoProvider;
use rustls::server::WebPkiClientVerifier;
use rustls::RootCertStore;
use rustls_pki_types::CertificateDer;

use crate::certs::{common_name, LoadedIdentity};
use crate::config::TransportConfig;
use crate::error::TransportError;
use crate::revocation::{RevocationAwareVerifier, Revocations};

/// ALPN protocol id of dreamddp's wire protocol.
pub const ALPN: &[u8] = b"dreamddp/3";

/// The quinn configurations of one node.
pub(crate) struct QuinnConfigs {
    pub(crate) server: quinn::ServerConfig,
    pub(crate) client: quinn::ClientConfig,
    /// The revocation list the server's verifier enforces (re-read by [`crate::QuicNode`]).
    pub(crate) revocations: Arc<Revocations>,
}

fn tls_error(context: &str, error: impl std::fmt::Display) -> TransportError {
    TransportError::Tls(format!("{context}: {error}"))
}

/// Build server and client configs: TLS 1.3 only, ring, ALPN [`ALPN`],
/// client certificates required, the given transport settings on both.
pub(crate) fn quinn_configs(
    identity: LoadedIdentity,
    ca_cert: &Path,
    config: &TransportConfig,
) -> Result<QuinnConfigs, TransportError> {
    let provider: Arc<CryptoProvider> = Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = RootCertStore::empty();
    for ca in identity.ca_certs.clone() {
        roots
            .add(ca)
            .map_err(|e| tls_error("the CA certificate is not a valid trust anchor", e))?;
    }
    let roots = Arc::new(roots);
    let transport = config.to_quinn()?;

    let verifier = WebPkiClientVerifier::builder_with_provider(roots.clone(), provider.clone())
        .build()
        .map_err(|e| tls_error("cannot build the client certificate verifier", e))?;
    let revocations = Revocations::load(
        ca_cert,
        identity.ca_certs.clone(),
        roots.clone(),
        provider.clone(),
    )?;
    let verifier = Arc::new(RevocationAwareVerifier::new(verifier, revocations.clone()));
    let mut server_tls = rustls::ServerConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| tls_error("TLS 1.3 unavailable", e))?
        .with_client_cert_verifier(verifier)
        .with_single_cert(identity.cert_chain.clone(), identity.key.clone_key())
        .map_err(|e| tls_error("the node certificate does not match its key", e))?;
    server_tls.alpn_protocols = vec![ALPN.to_vec()];
    // No session resumption: a resumed TLS 1.3 session skips the client-certificate check,
    // so a node revoked after its first handshake could come back on its ticket.
    server_tls.session_storage = Arc::new(rustls::server::NoServerSessionStorage {});
    server_tls.send_tls13_tickets = 0;
    let server_crypto = QuicServerConfig::try_from(server_tls)
        .map_err(|e| tls_error("server config unusable for QUIC", e))?;
    let mut server = quinn::ServerConfig::with_crypto(Arc::new(server_crypto));
    server.transport_config(transport.clone());

    let mut client_tls = rustls::ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| tls_error("TLS 1.3 unavailable", e))?
        .with_root_certificates(roots)
        .with_client_auth_cert(identity.cert_chain, identity.key)
        .map_err(|e| tls_error("the node certificate does not match its key", e))?;
    client_tls.alpn_protocols = vec![ALPN.to_vec()];
    let client_crypto = QuicClientConfig::try_from(client_tls)
        .map_err(|e| tls_error("client config unusable for QUIC", e))?;
    let mut client = quinn::ClientConfig::new(Arc::new(client_crypto));
    client.transport_config(transport);

    Ok(QuinnConfigs {
        server,
        client,
        revocations,
    })
}

/// The CN of the certificate the peer presented (verified by the handshake).
pub(crate) fn peer_common_name(connection: &quinn::Connection) -> Option<String> {
    let identity = connection.peer_identity()?;
    let chain = identity.downcast::<Vec<CertificateDer<'static>>>().ok()?;
    common_name(chain.first()?)
}
