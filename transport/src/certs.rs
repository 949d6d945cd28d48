//! The cluster's certificates: a CA that signs one certificate per node
//! ([`create_cluster_certs`]), where a node finds its files ([`TlsIdentity`]),
//! and loading them for rustls ([`TlsIdentity::check`] reports what is wrong
//! with them before a node starts).
//!
//! Layout of a certificate directory `D`:
//!
//! | file          | what                                                       |
//! |---------------|------------------------------------------------------------|
//! | `ca.pem`      | the cluster CA certificate (every node trusts only this)   |
//! | `ca.key`      | the CA private key (keep it on the operator's machine)     |
//! | `<name>.pem`  | node certificate: CN = name, DNS SANs = name, `localhost`  |
//! | `<name>.key`  | node private key (PKCS#8, mode 0600 on unix)               |
//!
//! The CA is created when absent and reused when present, so nodes can be
//! added to a running cluster later.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose,
};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use time::OffsetDateTime;

pub use crate::error::CertError;

/// File name of the CA certificate in a certificate directory.
pub const CA_CERT_FILE: &str = "ca.pem";
/// File name of the CA private key in a certificate directory.
pub const CA_KEY_FILE: &str = "ca.key";
/// Common name of the cluster CA, followed by a fingerprint of its key.
pub const CA_COMMON_NAME: &str = "dreamddp cluster CA";
/// How long a new node certificate is valid unless told otherwise (one year).
pub const DEFAULT_CERT_LIFETIME: Duration = Duration::from_secs(365 * 24 * 3600);
/// Longest node name accepted (a DNS label).
pub const MAX_NODE_NAME_LEN: usize = 63;

/// Check that `name` can be a file name, a certificate CN and a DNS name.
pub fn validate_node_name(name: &str) -> Result<(), CertError> {
    let invalid = |reason| {
        Err(CertError::InvalidName {
            name: name.to_string(),
            reason,
        })
    };
    if name.is_empty() {
        return invalid("it is empty");
    }
    if name.len() > MAX_NODE_NAME_LEN {
        return invalid("it is longer than 63 characters");
    }
    if !name
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
    {
        return invalid("it contains a character outside [A-Za-z0-9._-]");
    }
    if name.starts_with(['.', '-']) || name.ends_with(['.', '-']) {
        return invalid("it starts or ends with '.' or '-'");
    }
    if name.contains("..") {
        return invalid("it contains \"..\"");
    }
    if name.eq_ignore_ascii_case("ca") {
        return invalid("\"ca\" is the name of the CA's own files");
    }
    Ok(())
}

/// Create (or reuse) the cluster CA in `dir` and write a certificate and key
/// for each of `node_names`, signed by it. Existing node files are replaced.
///
/// Returns every path written (the CA's two files only when they were created).
pub fn create_cluster_certs(dir: &Path, node_names: &[String]) -> Result<Vec<PathBuf>, CertError> {
    create_cluster_certs_valid_for(dir, node_names, DEFAULT_CERT_LIFETIME)
}

/// [`create_cluster_certs`] with node certificates valid from an hour ago (clock skew) for
/// `lifetime` from now. An expired certificate is refused by every peer, and a node whose
/// own certificate has expired says so at start ([`CertError::Expired`]).
pub fn create_cluster_certs_valid_for(
    dir: &Path,
    node_names: &[String],
    lifetime: Duration,
) -> Result<Vec<PathBuf>, CertError> {
    if lifetime.is_zero() {
        return Err(CertError::ZeroLifetime);
    }
    for name in node_names {
        validate_node_name(name)?;
    }
    fs::create_dir_all(dir).map_err(|source| CertError::Io {
        action: "create directory",
        path: dir.to_path_buf(),
        source,
    })?;
    let mut written = Vec::new();
    let issuer = load_or_create_ca(dir, &mut written)?;
    for name in node_names {
        let key = KeyPair::generate()?;
        let cert = node_params(name, lifetime)?.signed_by(&key, &issuer)?;
        let cert_path = dir.join(format!("{name}.pem"));
        let key_path = dir.join(format!("{name}.key"));
        write_file(&key_path, key.serialize_pem().as_bytes(), true)?;
        write_file(&cert_path, cert.pem().as_bytes(), false)?;
        written.push(cert_path);
        written.push(key_path);
    }
    Ok(written)
}

/// Certificate parameters of the CA whose key is `key`. The CN carries a
/// fingerprint of the key so two clusters' CAs never share a name (a peer
/// from another cluster is then reported as an unknown issuer).
fn ca_params(key: &KeyPair) -> CertificateParams {
    let mut params = CertificateParams::default();
    let fingerprint: String = params
        .key_identifier(key)
        .iter()
        .take(4)
        .map(|b| format!("{b:02x}"))
        .collect();
    let mut dn = DistinguishedName::new();
    dn.push(
        DnType::CommonName,
        format!("{CA_COMMON_NAME} {fingerprint}"),
    );
    params.distinguished_name = dn;
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    params
}

/// Certificate parameters of a node: usable as TLS server and client.
fn node_params(name: &str, lifetime: Duration) -> Result<CertificateParams, CertError> {
    let mut params = CertificateParams::new(vec![name.to_string(), "localhost".to_string()])?;
    let now = OffsetDateTime::now_utc();
    params.not_before = now - time::Duration::hours(1);
    let lifetime = time::Duration::try_from(lifetime).unwrap_or(time::Duration::MAX);
    params.not_after = now.checked_add(lifetime).unwrap_or(params.not_after);
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, name);
    params.distinguished_name = dn;
    params.use_authority_key_identifier_extension = true;
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    params.extended_key_usages = vec![
        ExtendedKeyUsagePurpose::ServerAuth,
        ExtendedKeyUsagePurpose::ClientAuth,
    ];
    Ok(params)
}

/// Reuse `dir/ca.pem` + `dir/ca.key` when both exist; create them when both
/// are absent (recording them in `written`).
fn load_or_create_ca(
    dir: &Path,
    written: &mut Vec<PathBuf>,
) -> Result<Issuer<'static, KeyPair>, CertError> {
    let cert_path = dir.join(CA_CERT_FILE);
    let key_path = dir.join(CA_KEY_FILE);
    let hint = "move ca.pem and ca.key away to create a new CA (every node then needs new \
                certificates)";
    match (cert_path.exists(), key_path.exists()) {
        (true, true) => load_existing_ca(&cert_path, &key_path, hint),
        (false, false) => {
            let key = KeyPair::generate()?;
            let params = ca_params(&key);
            let cert = params.self_signed(&key)?;
            write_file(&key_path, key.serialize_pem().as_bytes(), true)?;
            write_file(&cert_path, cert.pem().as_bytes(), false)?;
            written.push(cert_path);
            written.push(key_path);
            Ok(Issuer::new(params, key))
        }
        (true, false) => Err(CertError::IncompleteCa {
            present: cert_path,
            absent: key_path,
        }),
        (false, true) => Err(CertError::IncompleteCa {
            present: key_path,
            absent: cert_path,
        }),
    }
}

/// The existing cluster CA in `dir` (for signing a revocation list): an error naming the
/// missing file when it is not there.
pub(crate) fn load_ca_issuer(dir: &Path) -> Result<Issuer<'static, KeyPair>, CertError> {
    let cert_path = dir.join(CA_CERT_FILE);
    let key_path = dir.join(CA_KEY_FILE);
    for (path, what) in [
        (&cert_path, "CA certificate"),
        (&key_path, "CA private key"),
    ] {
        if !path.exists() {
            return Err(CertError::Missing {
                what,
                path: path.clone(),
                hint: "revoking needs the cluster CA that signed the nodes' certificates \
                       (run on the operator's machine that holds ca.pem and ca.key)"
                    .to_string(),
            });
        }
    }
    load_existing_ca(
        &cert_path,
        &key_path,
        "restore the cluster CA's files from a backup",
    )
}

fn load_existing_ca(
    cert_path: &Path,
    key_path: &Path,
    hint: &str,
) -> Result<Issuer<'static, KeyPair>, CertError> {
    let key_pem = read_text(key_path, "CA private key")?;
    let key = KeyPair::from_pem(&key_pem).map_err(|e| CertError::Parse {
        what: "CA private key",
        path: key_path.to_path_buf(),
        reason: e.to_string(),
        hint: hint.to_string(),
    })?;
    let cert_pem = read_text(cert_path, "CA certificate")?;
    let parse_error = |reason: String| CertError::Parse {
        what: "CA certificate",
        path: cert_path.to_path_buf(),
        reason,
        hint: hint.to_string(),
    };
    let der = CertificateDer::from_pem_slice(cert_pem.as_bytes())
        .map_err(|e| parse_error(e.to_string()))?;
    if !spki_matches(&der, &key) {
        return Err(parse_error(
            "its public key does not belong to ca.key".to_string(),
        ));
    }
    Issuer::from_ca_cert_der(&der, key).map_err(|e| parse_error(e.to_string()))
}

/// Whether the certificate's subject public key is `key`'s public key.
fn spki_matches(cert: &CertificateDer<'_>, key: &KeyPair) -> bool {
    match x509_parser::parse_x509_certificate(cert) {
        Ok((_, parsed)) => {
            parsed.public_key().subject_public_key.data.as_ref() == key.public_key_raw()
        }
        Err(_) => false,
    }
}

fn read_text(path: &Path, what: &'static str) -> Result<String, CertError> {
    fs::read_to_string(path)
        .map_err(|source| CertError::Io {
            action: "read",
            path: path.to_path_buf(),
            source,
        })
        .map_err(|e| match e {
            CertError::Io { source, path, .. } if source.kind() == std::io::ErrorKind::NotFound => {
                CertError::Missing {
                    what,
                    path,
                    hint: "it was removed while the certificates were being created".to_string(),
                }
            }
            other => other,
        })
}

/// Write `bytes` to `path` through a temporary file and a rename, so a crash
/// never leaves half a key; `secret` files get mode 0600 on unix.
pub(crate) fn write_file(path: &Path, bytes: &[u8], secret: bool) -> Result<(), CertError> {
    let io_error = |action, source| CertError::Io {
        action,
        path: path.to_path_buf(),
        source,
    };
    let mut tmp_name = path.as_os_str().to_os_string();
    tmp_name.push(".tmp");
    let tmp = PathBuf::from(tmp_name);
    let mut options = fs::OpenOptions::new();
    options.write(true).create(true).truncate(true);
    #[cfg(unix)]
    if secret {
        use std::os::unix::fs::OpenOptionsExt;
        options.mode(0o600);
    }
    #[cfg(not(unix))]
    let _ = secret;
    let mut file = options.open(&tmp).map_err(|e| io_error("write", e))?;
    file.write_all(bytes)
        .and_then(|()| file.sync_all())
        .map_err(|e| io_error("write", e))?;
    drop(file);
    fs::rename(&tmp, path).map_err(|e| io_error("write", e))
}

/// Where one node finds its certificate, its key, and the cluster CA.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TlsIdentity {
    /// The cluster CA certificate (`D/ca.pem`).
    pub ca_cert: PathBuf,
    /// This node's certificate (`D/<name>.pem`).
    pub cert: PathBuf,
    /// This node's private key (`D/<name>.key`).
    pub key: PathBuf,
}

/// A [`TlsIdentity`] read from disk, ready for rustls.
#[derive(Debug)]
pub(crate) struct LoadedIdentity {
    /// Trust anchors: the cluster CA.
    pub(crate) ca_certs: Vec<CertificateDer<'static>>,
    /// This node's certificate chain.
    pub(crate) cert_chain: Vec<CertificateDer<'static>>,
    /// This node's private key.
    pub(crate) key: PrivateKeyDer<'static>,
}

impl TlsIdentity {
    /// The files of node `node_name` in certificate directory `dir`.
    pub fn in_dir(dir: &Path, node_name: &str) -> TlsIdentity {
        TlsIdentity {
            ca_cert: dir.join(CA_CERT_FILE),
            cert: dir.join(format!("{node_name}.pem")),
            key: dir.join(format!("{node_name}.key")),
        }
    }

    /// What to run to (re)create this identity's files.
    fn hint(&self) -> String {
        let dir = self
            .cert
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        let name = self
            .cert
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "NAME".to_string());
        format!(
            "run `dreamddp certs --dir {} --nodes {name}` to create it",
            dir.display()
        )
    }

    /// Read and parse the three files without starting anything, e.g. to
    /// report a missing or corrupt file at startup.
    pub fn check(&self) -> Result<(), CertError> {
        self.load().map(|_| ())
    }

    /// Read and parse the three files. Errors name the file and the command
    /// that creates it.
    pub(crate) fn load(&self) -> Result<LoadedIdentity, CertError> {
        let ca_certs = self.load_certs(&self.ca_cert, "CA certificate")?;
        let cert_chain = self.load_certs(&self.cert, "node certificate")?;
        self.check_validity(&cert_chain[0])?;
        let bytes = self.read(&self.key, "node private key")?;
        let key = PrivateKeyDer::from_pem_slice(&bytes).map_err(|e| CertError::Parse {
            what: "node private key",
            path: self.key.clone(),
            reason: e.to_string(),
            hint: self.hint(),
        })?;
        Ok(LoadedIdentity {
            ca_certs,
            cert_chain,
            key,
        })
    }

    fn read(&self, path: &Path, what: &'static str) -> Result<Vec<u8>, CertError> {
        fs::read(path).map_err(|source| {
            if source.kind() == std::io::ErrorKind::NotFound {
                CertError::Missing {
                    what,
                    path: path.to_path_buf(),
                    hint: self.hint(),
                }
            } else {
                CertError::Io {
                    action: "read",
                    path: path.to_path_buf(),
                    source,
                }
            }
        })
    }

    /// An expired (or not yet valid) own certificate is an error at start, not a stream of
    /// refusals from every peer.
    fn check_validity(&self, cert: &CertificateDer<'_>) -> Result<(), CertError> {
        let Ok((_, parsed)) = x509_parser::parse_x509_certificate(cert) else {
            return Ok(()); // rustls reports a malformed certificate when it is used
        };
        let validity = parsed.validity();
        let now = x509_parser::time::ASN1Time::now();
        let (state, when) = if now > validity.not_after {
            ("expired", validity.not_after)
        } else if now < validity.not_before {
            ("is not valid yet", validity.not_before)
        } else {
            return Ok(());
        };
        Err(CertError::Expired {
            path: self.cert.clone(),
            state,
            when: when.to_rfc2822().unwrap_or_else(|_| when.to_string()),
            hint: format!(
                "{} (with `--days N` for its lifetime); check this machine's clock",
                self.hint()
                    .replace(" to create it", " to give it a new one")
            ),
        })
    }

    fn load_certs(
        &self,
        path: &Path,
        what: &'static str,
    ) -> Result<Vec<CertificateDer<'static>>, CertError> {
        let bytes = self.read(path, what)?;
        let parse_error = |reason: String| CertError::Parse {
            what,
            path: path.to_path_buf(),
            reason,
            hint: self.hint(),
        };
        let certs = CertificateDer::pem_slice_iter(&bytes)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| parse_error(e.to_string()))?;
        if certs.is_empty() {
            return Err(parse_error("it holds no PEM certificate".to_string()));
        }
        Ok(certs)
    }
}

/// The common name (CN) of a DER certificate, if it has one.
pub(crate) fn common_name(cert: &CertificateDer<'_>) -> Option<String> {
    let (_, parsed) = x509_parser::parse_x509_certificate(cert).ok()?;
    let cn = parsed.subject().iter_common_name().next()?;
    cn.as_str().ok().map(str::to_string)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn certificates_carry_their_lifetime_and_an_expired_one_is_named_at_start() {
        let dir = tempfile::tempdir().unwrap();
        let lifetime = Duration::from_secs(30 * 24 * 3600);
        create_cluster_certs_valid_for(dir.path(), &names(&["n1"]), lifetime).unwrap();
        let loaded = TlsIdentity::in_dir(dir.path(), "n1").load().unwrap();
        let (_, parsed) = x509_parser::parse_x509_certificate(&loaded.cert_chain[0]).unwrap();
        let validity = parsed.validity();
        let span = validity.not_after.timestamp() - validity.not_before.timestamp();
        assert_eq!(
            span,
            30 * 24 * 3600 + 3600,
            "30 days from now, valid from an hour ago"
        );
        let err = create_cluster_certs_valid_for(dir.path(), &names(&["n1"]), Duration::ZERO)
            .unwrap_err();
        assert!(matches!(err, CertError::ZeroLifetime), "{err}");

        // A certificate that expired yesterday, signed by the cluster CA.
        let issuer = load_ca_issuer(dir.path()).unwrap();
        let key = KeyPair::generate().unwrap();
        let mut params = node_params("n1", lifetime).unwrap();
        params.not_before = OffsetDateTime::now_utc() - time::Duration::days(2);
        params.not_after = OffsetDateTime::now_utc() - time::Duration::days(1);
        let cert = params.signed_by(&key, &issuer).unwrap();
        fs::write(dir.path().join("n1.pem"), cert.pem()).unwrap();
        fs::write(dir.path().join("n1.key"), key.serialize_pem()).unwrap();
        let err = TlsIdentity::in_dir(dir.path(), "n1").check().unwrap_err();
        assert!(
            matches!(
                err,
                CertError::Expired {
                    state: "expired",
                    ..
                }
            ),
            "{err}"
        );
        assert!(err.to_string().contains("--nodes n1"), "{err}");
    }

    #[test]
    fn creates_ca_and_node_files_with_the_right_cn() {
        let dir = tempfile::tempdir().unwrap();
        let written = create_cluster_certs(dir.path(), &names(&["alpha", "beta-1"])).unwrap();
        assert_eq!(written.len(), 6);
        for path in &written {
            assert!(path.exists(), "{} missing", path.display());
        }
        let loaded = TlsIdentity::in_dir(dir.path(), "beta-1").load().unwrap();
        assert_eq!(
            common_name(&loaded.cert_chain[0]).as_deref(),
            Some("beta-1")
        );
        let ca_name = common_name(&loaded.ca_certs[0]).unwrap();
        assert!(ca_name.starts_with(CA_COMMON_NAME), "{ca_name}");
    }

    #[cfg(unix)]
    #[test]
    fn key_files_are_private() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        create_cluster_certs(dir.path(), &names(&["n1"])).unwrap();
        for file in ["ca.key", "n1.key"] {
            let mode = fs::metadata(dir.path().join(file))
                .unwrap()
                .permissions()
                .mode();
            assert_eq!(mode & 0o777, 0o600, "{file}");
        }
    }

    #[test]
    fn reuses_an_existing_ca() {
        let dir = tempfile::tempdir().unwrap();
        create_cluster_certs(dir.path(), &names(&["a"])).unwrap();
        let ca_before = fs::read(dir.path().join(CA_CERT_FILE)).unwrap();
        let written = create_cluster_certs(dir.path(), &names(&["b"])).unwrap();
        assert_eq!(
            written,
            vec![dir.path().join("b.pem"), dir.path().join("b.key")]
        );
        assert_eq!(fs::read(dir.path().join(CA_CERT_FILE)).unwrap(), ca_before);
        // The new node's certificate names the same CA as issuer.
        let b = TlsIdentity::in_dir(dir.path(), "b").load().unwrap();
        let (_, cert) = x509_parser::parse_x509_certificate(&b.cert_chain[0]).unwrap();
        let (_, ca) = x509_parser::parse_x509_certificate(&b.ca_certs[0]).unwrap();
        assert_eq!(cert.issuer(), ca.subject());
        assert!(cert.verify_signature(Some(ca.public_key())).is_ok());
    }

    #[test]
    fn an_incomplete_ca_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        create_cluster_certs(dir.path(), &names(&["a"])).unwrap();
        fs::remove_file(dir.path().join(CA_KEY_FILE)).unwrap();
        let err = create_cluster_certs(dir.path(), &names(&["b"])).unwrap_err();
        assert!(matches!(err, CertError::IncompleteCa { .. }), "{err}");
    }

    #[test]
    fn rejects_bad_node_names_before_writing_anything() {
        let dir = tempfile::tempdir().unwrap();
        for bad in [
            "",
            "a/b",
            "ca",
            ".hidden",
            "x..y",
            "trailing-",
            "sp ace",
            &"x".repeat(64),
        ] {
            let err = create_cluster_certs(dir.path(), &names(&["ok", bad])).unwrap_err();
            assert!(
                matches!(err, CertError::InvalidName { .. }),
                "{bad:?}: {err}"
            );
        }
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 0);
        for good in ["worker-0", "agg_1.site-a", "A9"] {
            validate_node_name(good).unwrap();
        }
    }

    #[test]
    fn a_missing_file_names_the_path_and_the_fix() {
        let dir = tempfile::tempdir().unwrap();
        create_cluster_certs(dir.path(), &names(&["present"])).unwrap();
        let err = TlsIdentity::in_dir(dir.path(), "absent")
            .load()
            .unwrap_err();
        let CertError::Missing { path, .. } = &err else {
            panic!("expected Missing, got {err}");
        };
        assert_eq!(path, &dir.path().join("absent.pem"));
        let text = err.to_string();
        assert!(text.contains("absent.pem"), "{text}");
        assert!(text.contains("dreamddp certs --dir"), "{text}");
        assert!(text.contains("--nodes absent"), "{text}");
    }

    #[test]
    fn a_garbage_key_file_is_a_parse_error() {
        let dir = tempfile::tempdir().unwrap();
        create_cluster_certs(dir.path(), &names(&["n"])).unwrap();
        fs::write(dir.path().join("n.key"), b"not a key").unwrap();
        let err = TlsIdentity::in_dir(dir.path(), "n").load().unwrap_err();
        assert!(
            matches!(&err, CertError::Parse { path, .. } if path.ends_with("n.key")),
            "{err}"
        );
    }
}
