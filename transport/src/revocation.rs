//! Revoking node certificates while the cluster runs: the CA-signed revocation list
//! `D/revoked.crl` ([`revoke_nodes`] writes it), and the verifier every accepting node
//! builds from it, which re-reads the file when it changes ([`Revocations`]).
//!
//! A node that accepts connections (coordinator, aggregators, relays' peers) checks the
//! file about once a second ([`CHECK_EVERY`]). When it changes, new handshakes are verified
//! against the new list (a revoked client is refused with TLS's `certificate_revoked`
//! alert) and the node closes the live connections whose peer certificate is on it (close
//! code [`CLOSE_CODE_REVOKED`]). A list that cannot be read, is not signed by the cluster
//! CA, or does not parse is reported with a `[WARN]` and the previous list stays in force:
//! a bad file never locks every node out, and never panics the serving process.
//!
//! Revocation is by certificate serial (rcgen derives it from the node's public key), so a
//! node given a new certificate with `dreamddp certs --nodes NAME` after its revocation is
//! accepted again.

use std::collections::HashSet;
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::{Duration, SystemTime};

use rcgen::{
    CertificateRevocationListParams, KeyIdMethod, RevocationReason, RevokedCertParams, SerialNumber,
};
use rustls::client::danger::HandshakeSignatureValid;
use rustls::crypto::CryptoProvider;
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::server::WebPkiClientVerifier;
use rustls::{DigitallySignedStruct, DistinguishedName, RootCertStore, SignatureScheme};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, CertificateRevocationListDer, UnixTime};
use time::OffsetDateTime;

use crate::certs::{load_ca_issuer, CA_CERT_FILE};
use crate::error::CertError;

/// File name of the revocation list in a certificate directory.
pub const REVOKED_FILE: &str = "revoked.crl";
/// Connection close code: the peer's certificate was revoked.
pub const CLOSE_CODE_REVOKED: u32 = 3;
/// How often an accepting node looks for a changed revocation list.
pub const CHECK_EVERY: Duration = Duration::from_secs(1);

/// Add the certificates of `names` (their current `D/<name>.pem`) to `D/revoked.crl`,
/// signed by the cluster CA in `dir`; earlier revocations are kept. Returns the list's
/// path. Running nodes pick it up within about [`CHECK_EVERY`].
pub fn revoke_nodes(dir: &Path, names: &[String]) -> Result<PathBuf, CertError> {
    let issuer = load_ca_issuer(dir)?;
    let path = dir.join(REVOKED_FILE);
    let now = OffsetDateTime::now_utc();
    let (mut revoked, number) = match fs::read(&path) {
        Ok(bytes) => {
            let crl = parse_pem_crl(&path, &bytes)?;
            (crl.serials, crl.number + 1)
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => (Vec::new(), 1),
        Err(source) => {
            return Err(CertError::Io {
                action: "read",
                path,
                source,
            })
        }
    };
    for name in names {
        crate::certs::validate_node_name(name)?;
        let cert_path = dir.join(format!("{name}.pem"));
        let bytes = fs::read(&cert_path).map_err(|source| match source.kind() {
            std::io::ErrorKind::NotFound => CertError::Missing {
                what: "node certificate",
                path: cert_path.clone(),
                hint: format!(
                    "there is no certificate of {name:?} to revoke in {}",
                    dir.display()
                ),
            },
            _ => CertError::Io {
                action: "read",
                path: cert_path.clone(),
                source,
            },
        })?;
        let serial = cert_serial_from_pem(&cert_path, &bytes)?;
        if !revoked.contains(&serial) {
            revoked.push(serial);
        }
    }
    let params = CertificateRevocationListParams {
        this_update: now,
        // Nodes do not enforce the next update (the list is re-read when it changes); rcgen
        // needs one after this update.
        next_update: now + time::Duration::days(3650),
        crl_number: SerialNumber::from(number),
        issuing_distribution_point: None,
        revoked_certs: revoked
            .iter()
            .map(|serial| RevokedCertParams {
                serial_number: SerialNumber::from_slice(serial),
                revocation_time: now,
                reason_code: Some(RevocationReason::CessationOfOperation),
                invalidity_date: None,
            })
            .collect(),
        key_identifier_method: KeyIdMethod::Sha256,
    };
    let crl = params.signed_by(&issuer)?;
    let pem = crl.pem()?;
    crate::certs::write_file(&path, pem.as_bytes(), false)?;
    Ok(path)
}

/// Serial of the first certificate in a PEM file.
fn cert_serial_from_pem(path: &Path, bytes: &[u8]) -> Result<Vec<u8>, CertError> {
    let parse_error = |reason: String| CertError::Parse {
        what: "node certificate",
        path: path.to_path_buf(),
        reason,
        hint: "recreate it with `dreamddp certs --nodes NAME`".to_string(),
    };
    let der = CertificateDer::from_pem_slice(bytes).map_err(|e| parse_error(e.to_string()))?;
    cert_serial(&der).ok_or_else(|| parse_error("it is not an X.509 certificate".to_string()))
}

/// Serial number of a DER certificate (big-endian bytes as encoded).
pub(crate) fn cert_serial(der: &CertificateDer<'_>) -> Option<Vec<u8>> {
    let (_, parsed) = x509_parser::parse_x509_certificate(der).ok()?;
    Some(parsed.raw_serial().to_vec())
}

/// A parsed revocation list.
struct ParsedCrl {
    der: CertificateRevocationListDer<'static>,
    serials: Vec<Vec<u8>>,
    number: u64,
}

fn parse_pem_crl(path: &Path, bytes: &[u8]) -> Result<ParsedCrl, CertError> {
    let parse_error = |reason: String| CertError::Parse {
        what: "revocation list",
        path: path.to_path_buf(),
        reason,
        hint: "move it away and revoke the nodes again with `dreamddp certs --revoke NAMES`"
            .to_string(),
    };
    let der = CertificateRevocationListDer::from_pem_slice(bytes)
        .map_err(|e| parse_error(e.to_string()))?;
    let (serials, number) = {
        let (_, crl) =
            x509_parser::parse_x509_crl(der.as_ref()).map_err(|e| parse_error(e.to_string()))?;
        let serials = crl
            .iter_revoked_certificates()
            .map(|r| r.raw_serial().to_vec())
            .collect();
        let number = crl
            .crl_number()
            .and_then(|n| u64::try_from(n.clone()).ok())
            .unwrap_or(0);
        (serials, number)
    };
    Ok(ParsedCrl {
        der,
        serials,
        number,
    })
}

/// Check that `crl` is signed by the CA certificate `ca`.
fn check_signed_by(crl: &ParsedCrl, ca: &CertificateDer<'_>) -> Result<(), String> {
    let (_, ca) = x509_parser::parse_x509_certificate(ca).map_err(|e| e.to_string())?;
    let (_, parsed) = x509_parser::parse_x509_crl(crl.der.as_ref()).map_err(|e| e.to_string())?;
    parsed
        .verify_signature(ca.public_key())
        .map_err(|_| "it is not signed by this cluster's CA (ca.pem)".to_string())
}

/// What the revocation file held when it was last read.
#[derive(Default)]
struct Current {
    /// Modification time and length of the file read (`None`: no file).
    stamp: Option<(SystemTime, u64)>,
    serials: HashSet<Vec<u8>>,
    verifier: Option<Arc<dyn ClientCertVerifier>>,
}

/// The revocation list an accepting node enforces, re-read when its file changes.
pub(crate) struct Revocations {
    path: PathBuf,
    roots: Arc<RootCertStore>,
    ca_certs: Vec<CertificateDer<'static>>,
    provider: Arc<CryptoProvider>,
    current: RwLock<Current>,
}

impl std::fmt::Debug for Revocations {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Revocations")
            .field("path", &self.path)
            .finish()
    }
}

impl Revocations {
    /// The list at `ca_cert`'s directory / [`REVOKED_FILE`], loaded now: a file that is
    /// present but unusable is an error at start (a node should not start with a
    /// revocation it cannot enforce).
    pub(crate) fn load(
        ca_cert: &Path,
        ca_certs: Vec<CertificateDer<'static>>,
        roots: Arc<RootCertStore>,
        provider: Arc<CryptoProvider>,
    ) -> Result<Arc<Revocations>, CertError> {
        let dir = ca_cert.parent().unwrap_or(Path::new("."));
        let revocations = Arc::new(Revocations {
            path: dir.join(REVOKED_FILE),
            roots,
            ca_certs,
            provider,
            current: RwLock::new(Current::default()),
        });
        revocations.reload()?;
        Ok(revocations)
    }

    /// Re-read the file if it changed since the last read. `Ok(true)` when a new list is in
    /// force; on error the previous list stays in force.
    pub(crate) fn reload(&self) -> Result<bool, CertError> {
        let stamp = match fs::metadata(&self.path) {
            Ok(m) => Some((m.modified().unwrap_or(SystemTime::UNIX_EPOCH), m.len())),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(source) => {
                return Err(CertError::Io {
                    action: "read",
                    path: self.path.clone(),
                    source,
                })
            }
        };
        if self
            .current
            .read()
            .map(|c| c.stamp == stamp)
            .unwrap_or(false)
        {
            return Ok(false);
        }
        let next = match stamp {
            None => Current::default(),
            Some(_) => self.read_list(stamp)?,
        };
        let changed = match self.current.write() {
            Ok(mut current) => {
                let changed = current.serials != next.serials;
                *current = next;
                changed
            }
            Err(_) => false,
        };
        Ok(changed)
    }

    fn read_list(&self, stamp: Option<(SystemTime, u64)>) -> Result<Current, CertError> {
        let bytes = fs::read(&self.path).map_err(|source| CertError::Io {
            action: "read",
            path: self.path.clone(),
            source,
        })?;
        let crl = parse_pem_crl(&self.path, &bytes)?;
        let invalid = |reason: String| CertError::Parse {
            what: "revocation list",
            path: self.path.clone(),
            reason,
            hint: format!(
                "revoke with `dreamddp certs --dir {} --revoke NAMES`, which signs it with the \
                 cluster CA",
                self.path.parent().unwrap_or(Path::new(".")).display()
            ),
        };
        let ca = self
            .ca_certs
            .first()
            .ok_or_else(|| invalid(format!("there is no {CA_CERT_FILE} to check it against")))?;
        check_signed_by(&crl, ca).map_err(invalid)?;
        let verifier =
            WebPkiClientVerifier::builder_with_provider(self.roots.clone(), self.provider.clone())
                .with_crls([crl.der.clone()])
                .only_check_end_entity_revocation()
                .allow_unknown_revocation_status()
                .build()
                .map_err(|e| invalid(e.to_string()))?;
        Ok(Current {
            stamp,
            serials: crl.serials.into_iter().collect(),
            verifier: Some(verifier),
        })
    }

    /// Whether the certificate `der` is on the list in force.
    pub(crate) fn is_revoked(&self, der: &CertificateDer<'_>) -> bool {
        let Some(serial) = cert_serial(der) else {
            return false;
        };
        self.current
            .read()
            .map(|c| c.serials.contains(&serial))
            .unwrap_or(false)
    }

    fn verifier(&self) -> Option<Arc<dyn ClientCertVerifier>> {
        self.current.read().ok().and_then(|c| c.verifier.clone())
    }
}

/// The server's client-certificate verifier: the cluster CA's, with the revocation list in
/// force at the time of each handshake.
#[derive(Debug)]
pub(crate) struct RevocationAwareVerifier {
    base: Arc<dyn ClientCertVerifier>,
    hints: Vec<DistinguishedName>,
    revocations: Arc<Revocations>,
}

impl RevocationAwareVerifier {
    pub(crate) fn new(
        base: Arc<dyn ClientCertVerifier>,
        revocations: Arc<Revocations>,
    ) -> RevocationAwareVerifier {
        RevocationAwareVerifier {
            hints: base.root_hint_subjects().to_vec(),
            base,
            revocations,
        }
    }

    fn current(&self) -> Arc<dyn ClientCertVerifier> {
        self.revocations
            .verifier()
            .unwrap_or_else(|| self.base.clone())
    }
}

impl ClientCertVerifier for RevocationAwareVerifier {
    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        &self.hints
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        self.current()
            .verify_client_cert(end_entity, intermediates, now)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.base.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.base.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.base.supported_verify_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::TransportError;
    use crate::test_support::{bind, bounded, cert_dir, connect_pair, delta_ack};
    use crate::{create_cluster_certs, TransportConfig};

    fn names(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn revoking_lists_each_serial_once_and_keeps_earlier_revocations() {
        let dir = cert_dir(&["a", "b", "c"]);
        let path = revoke_nodes(dir.path(), &names(&["a"])).unwrap();
        revoke_nodes(dir.path(), &names(&["b", "a"])).unwrap();
        let crl = parse_pem_crl(&path, &fs::read(&path).unwrap()).unwrap();
        assert_eq!(crl.number, 2);
        let serial = |n: &str| {
            cert_serial_from_pem(
                Path::new(n),
                &fs::read(dir.path().join(format!("{n}.pem"))).unwrap(),
            )
            .unwrap()
        };
        assert_eq!(crl.serials, vec![serial("a"), serial("b")]);
        let ca = crate::TlsIdentity::in_dir(dir.path(), "c")
            .load()
            .unwrap()
            .ca_certs;
        check_signed_by(&crl, &ca[0]).unwrap();
        // Nothing to revoke, or no CA: typed errors naming the file.
        let err = revoke_nodes(dir.path(), &names(&["nobody"])).unwrap_err();
        assert!(matches!(err, CertError::Missing { .. }), "{err}");
        let empty = tempfile::tempdir().unwrap();
        let err = revoke_nodes(empty.path(), &names(&["a"])).unwrap_err();
        assert!(err.to_string().contains("ca.pem"), "{err}");
    }

    #[test]
    fn a_list_from_another_ca_or_garbage_is_refused_and_the_previous_one_stays() {
        let dir = cert_dir(&["agg-0", "edge-1"]);
        let loaded = crate::TlsIdentity::in_dir(dir.path(), "agg-0")
            .load()
            .unwrap();
        let mut roots = RootCertStore::empty();
        roots.add(loaded.ca_certs[0].clone()).unwrap();
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let revocations = Revocations::load(
            &dir.path().join(CA_CERT_FILE),
            loaded.ca_certs.clone(),
            Arc::new(roots),
            provider,
        )
        .unwrap();
        let edge = crate::TlsIdentity::in_dir(dir.path(), "edge-1")
            .load()
            .unwrap();
        assert!(!revocations.is_revoked(&edge.cert_chain[0]));
        revoke_nodes(dir.path(), &names(&["edge-1"])).unwrap();
        assert!(revocations.reload().unwrap());
        assert!(revocations.is_revoked(&edge.cert_chain[0]));
        assert!(
            !revocations.reload().unwrap(),
            "unchanged file, nothing new"
        );

        // Garbage in place of the list.
        fs::write(
            dir.path().join(REVOKED_FILE),
            b"-----BEGIN X509 CRL-----\nzz\n",
        )
        .unwrap();
        let err = revocations.reload().unwrap_err();
        assert!(matches!(err, CertError::Parse { .. }), "{err}");
        assert!(
            revocations.is_revoked(&edge.cert_chain[0]),
            "the previous list stays"
        );

        // A list signed by another CA that would un-revoke edge-1.
        let other = cert_dir(&["x"]);
        fs::copy(
            dir.path().join("edge-1.pem"),
            other.path().join("edge-1.pem"),
        )
        .unwrap();
        revoke_nodes(other.path(), &names(&["x"])).unwrap();
        fs::copy(
            other.path().join(REVOKED_FILE),
            dir.path().join(REVOKED_FILE),
        )
        .unwrap();
        let err = revocations.reload().unwrap_err();
        assert!(
            err.to_string().contains("not signed by this cluster's CA"),
            "{err}"
        );
        assert!(revocations.is_revoked(&edge.cert_chain[0]));
    }

    #[tokio::test]
    async fn a_revoked_peer_is_disconnected_and_refused_while_others_keep_talking() {
        let dir = cert_dir(&["agg-0", "edge-1", "edge-2"]);
        let config = TransportConfig::default();
        let aggregator = bind(dir.path(), "agg-0", &config);
        let edge1 = bind(dir.path(), "edge-1", &config);
        let edge2 = bind(dir.path(), "edge-2", &config);
        let (e1_side, agg_e1) = connect_pair(&edge1, &aggregator, "agg-0").await;
        let (e2_side, agg_e2) = connect_pair(&edge2, &aggregator, "agg-0").await;

        revoke_nodes(dir.path(), &names(&["edge-1"])).unwrap();
        // The live connection of edge-1 is closed by the aggregator within a check or two.
        let closed = bounded(e1_side.recv()).await.unwrap_err();
        assert!(
            matches!(
                closed,
                TransportError::Closed | TransportError::Connection(_)
            ),
            "{closed}"
        );
        assert!(bounded(agg_e1.recv()).await.is_err());
        // edge-2 keeps talking.
        bounded(e2_side.send(&delta_ack(1, 1))).await.unwrap();
        assert_eq!(bounded(agg_e2.recv()).await.unwrap(), delta_ack(1, 1));
        // edge-1 cannot come back ...
        let addr = aggregator.local_addr().unwrap();
        let (dialed, accepted) =
            bounded(async { tokio::join!(edge1.connect(addr, "agg-0"), aggregator.accept()) })
                .await;
        let err = dialed.unwrap_err();
        assert!(err.is_certificate_revoked(), "{err}");
        let err = accepted.unwrap().unwrap_err();
        assert!(err.is_certificate_revoked(), "{err}");
        eprintln!("refused: {err}");
        // ... until it gets a new certificate (a new key, so a new serial).
        create_cluster_certs(dir.path(), &names(&["edge-1"])).unwrap();
        let edge1 = bind(dir.path(), "edge-1", &config);
        let (back, _) = connect_pair(&edge1, &aggregator, "agg-0").await;
        assert_eq!(back.peer_name(), "agg-0");
    }
}
