//! [`RelayError`]: everything that can stop a relay from being configured or started.

use link_model::TraceError;
use std::net::SocketAddr;
use std::path::PathBuf;
use thiserror::Error;

use crate::spec::RelaySpecError;

/// Why a relay config could not be loaded or a relay could not start.
#[derive(Debug, Error)]
pub enum RelayError {
    /// The config file could not be read.
    #[error("cannot read relay config {}: {source}", path.display())]
    ReadConfig {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// The config text is not valid TOML for a [`crate::RelayConfig`] (unknown or missing key,
    /// wrong type); the message names the key and its line.
    #[error("relay config {}: {message}", path.display())]
    ParseConfig {
        /// The file (or `<string>` for text).
        path: PathBuf,
        /// The TOML error, naming the key.
        message: String,
    },
    /// A link field has a bad value; the message is `up.loss must be in [0,1], got 1.5`.
    #[error("relay config {}: {direction}.{source}", path.display())]
    InvalidLink {
        /// The file (or `<string>` for text, `<config>` for a config built in code).
        path: PathBuf,
        /// `up` or `down`.
        direction: &'static str,
        /// The field and what is wrong with it.
        #[source]
        source: RelaySpecError,
    },
    /// A trace file could not be read or parsed (the error names the file and line).
    #[error(transparent)]
    Trace(#[from] TraceError),
    /// A socket could not be bound.
    #[error("cannot bind UDP socket {addr}: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
}
