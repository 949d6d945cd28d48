//! [`RelayConfig`]: what one relay listens on, where it forwards, and the link model of each
//! direction, read from TOML ([`load_relay_config`]).
//!
//! ```toml
//! listen = "127.0.0.1:7000"     # clients send here
//! upstream = "127.0.0.1:7001"   # the real server
//! seed = 42
//! [up]                          # client → upstream
//! latency_ms = 100
//! loss = 0.2
//! [down]                        # upstream → client
//! trace = { path = "traces/ATT-LTE-driving-2016.down", format = "mahimahi" }
//! ```

use crate::error::RelayError;
use crate::spec::RelayLinkSpec;
use serde::{Deserialize, Serialize};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

/// One relay: `client ──▶ listen ──▶ upstream` and the replies back.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RelayConfig {
    /// Address clients send to (port 0 picks one; see [`crate::RelayHandle::local_addr`]).
    pub listen: SocketAddr,
    /// Address of the server the relay forwards to.
    pub upstream: SocketAddr,
    /// Client → upstream link model (default: transparent).
    #[serde(default)]
    pub up: RelayLinkSpec,
    /// Upstream → client link model (default: transparent).
    #[serde(default)]
    pub down: RelayLinkSpec,
    /// Seed of every random draw of both directions (default 0).
    #[serde(default)]
    pub seed: u64,
}

impl RelayConfig {
    /// A transparent relay from `listen` to `upstream`.
    pub fn transparent(listen: SocketAddr, upstream: SocketAddr) -> RelayConfig {
        RelayConfig {
            listen,
            upstream,
            up: RelayLinkSpec::default(),
            down: RelayLinkSpec::default(),
            seed: 0,
        }
    }

    /// Parses and validates config text; relative trace paths are resolved against `base_dir`.
    pub fn from_toml_str(text: &str, base_dir: &Path) -> Result<RelayConfig, RelayError> {
        RelayConfig::parse(text, base_dir, Path::new("<string>"))
    }

    fn parse(text: &str, base_dir: &Path, source: &Path) -> Result<RelayConfig, RelayError> {
        let mut config: RelayConfig =
            toml::from_str(text).map_err(|e| RelayError::ParseConfig {
                path: source.to_path_buf(),
                message: e.to_string(),
            })?;
        config.validate_named(source)?;
        config.resolve_paths(base_dir);
        Ok(config)
    }

    /// Makes relative trace paths of both directions relative to `base_dir` (for configs embedded
    /// in another file and deserialized by its owner).
    pub fn resolve_paths(&mut self, base_dir: &Path) {
        self.up.resolve_paths(base_dir);
        self.down.resolve_paths(base_dir);
    }

    /// Checks both directions; the error names the direction and field (`down.jitter_ms ...`).
    pub fn validate(&self) -> Result<(), RelayError> {
        self.validate_named(Path::new("<config>"))
    }

    fn validate_named(&self, source: &Path) -> Result<(), RelayError> {
        for (direction, spec) in [("up", &self.up), ("down", &self.down)] {
            spec.validate().map_err(|e| RelayError::InvalidLink {
                path: source.to_path_buf(),
                direction,
                source: e,
            })?;
        }
        Ok(())
    }
}

/// Reads a relay config file; trace paths in it are resolved relative to the file's directory.
/// Errors name the file, and the key or field that is wrong.
pub fn load_relay_config(path: impl AsRef<Path>) -> Result<RelayConfig, RelayError> {
    let path = path.as_ref();
    let text = std::fs::read_to_string(path).map_err(|source| RelayError::ReadConfig {
        path: path.to_path_buf(),
        source,
    })?;
    let base_dir = path
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."));
    RelayConfig::parse(&text, &base_dir, path)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("relay-config-{}-{name}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn loads_a_file_and_resolves_traces_next_to_it() {
        let dir = temp_dir("ok");
        let path = dir.join("relay.toml");
        std::fs::write(
            &path,
            r#"
listen = "127.0.0.1:7000"
upstream = "127.0.0.1:7001"
seed = 9
[up]
latency_ms = 200
loss = 0.2
[down]
trace = { path = "traces/x.down", format = "mahimahi" }
"#,
        )
        .unwrap();
        let config = load_relay_config(&path).unwrap();
        assert_eq!(
            config.listen,
            "127.0.0.1:7000".parse::<SocketAddr>().unwrap()
        );
        assert_eq!((config.up.latency_ms, config.up.loss), (200.0, 0.2));
        assert_eq!(config.seed, 9);
        assert_eq!(config.down.trace.unwrap().path, dir.join("traces/x.down"));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn errors_name_the_file_and_the_key() {
        let dir = temp_dir("bad");
        let cases = [
            ("typo.toml", "listen = \"127.0.0.1:1\"\nupstream = \"127.0.0.1:2\"\n[up]\nlatncy_ms = 3\n", "unknown field `latncy_ms`"),
            ("top.toml", "listen = \"127.0.0.1:1\"\nupstream = \"127.0.0.1:2\"\nsede = 3\n", "unknown field `sede`"),
            ("missing.toml", "listen = \"127.0.0.1:1\"\n", "missing field `upstream`"),
            ("addr.toml", "listen = \"localhost\"\nupstream = \"127.0.0.1:2\"\n", "listen"),
            ("value.toml", "listen = \"127.0.0.1:1\"\nupstream = \"127.0.0.1:2\"\n[down]\nloss = 1.5\n", "down.loss must be in [0,1], got 1.5"),
            ("bw.toml", "listen = \"127.0.0.1:1\"\nupstream = \"127.0.0.1:2\"\n[up]\nbandwidth = \"20 furlongs\"\n", "unknown unit `furlongs`"),
        ];
        for (file, text, expected) in cases {
            let path = dir.join(file);
            std::fs::write(&path, text).unwrap();
            let err = load_relay_config(&path).unwrap_err().to_string();
            assert!(err.contains(expected), "{file}: {err}");
            assert!(err.contains(file), "{file}: {err}");
        }
        let err = load_relay_config(dir.join("absent.toml"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("absent.toml"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// The shape of `examples/cluster-lossy.toml`: relays embedded as `[[relay]]` tables.
    const CLUSTER_EXAMPLE: &str = r#"
[[relay]]                      # edge-1: 20% loss, 200 ms one way in each direction
listen = "127.0.0.1:7101"
upstream = "127.0.0.1:7001"
seed = 1
[relay.up]
latency_ms = 200
loss = 0.2
[relay.down]
latency_ms = 200
loss = 0.2

[[relay]]                      # edge-2: AT&T LTE while driving (mahimahi traces)
listen = "127.0.0.1:7102"
upstream = "127.0.0.1:7001"
seed = 2
[relay.up]
latency_ms = 20
trace = { path = "../simulations/traces/ATT-LTE-driving-2016.up", format = "mahimahi" }
[relay.down]
latency_ms = 20
trace = { path = "../simulations/traces/ATT-LTE-driving-2016.down", format = "mahimahi" }
"#;

    #[test]
    fn cluster_example_parses_and_its_traces_load() {
        #[derive(Deserialize)]
        #[serde(deny_unknown_fields)]
        struct Cluster {
            relay: Vec<RelayConfig>,
        }
        let mut cluster: Cluster = toml::from_str(CLUSTER_EXAMPLE).unwrap();
        // `relay/` sits at the same depth as `examples/`, so `../simulations/traces` resolves
        // the same way from both (the traces are tracked in the repository).
        let sibling_of_examples = Path::new(env!("CARGO_MANIFEST_DIR"));
        for relay in &mut cluster.relay {
            relay.validate().unwrap();
            relay.resolve_paths(sibling_of_examples);
        }
        let [lossy, traced] = &cluster.relay[..] else {
            panic!("two relays expected");
        };
        assert_eq!((lossy.up.loss, lossy.down.latency_ms), (0.2, 200.0));
        for spec in [&traced.up, &traced.down] {
            let trace = spec.load_trace().unwrap().expect("a trace is named");
            assert!(trace.bytes_per_period() > 1_000_000);
        }
    }

    #[test]
    fn round_trips_through_toml() {
        let text = "listen = \"127.0.0.1:1\"\nupstream = \"[::1]:2\"\n[up]\nbandwidth = \"20mbit\"\njitter_ms = 3\n";
        let config = RelayConfig::from_toml_str(text, Path::new("/")).unwrap();
        let again =
            RelayConfig::from_toml_str(&toml::to_string(&config).unwrap(), Path::new("/")).unwrap();
        assert_eq!(config, again);
        assert!(config.validate().is_ok());
    }
}
