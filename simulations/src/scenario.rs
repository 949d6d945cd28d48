//! Scenario files: the TOML schema shared by every kind of simulation, with errors that name
//! the bad key or value. `kind = "clusters"` scenarios carry a `[clusters]` table (see
//! [`crate::clusters`]); `kind = "edge"` scenarios an `[edge]` table (see [`crate::edge`]).
//! Both kinds name device classes from one registry ([`DeviceRegistry`]): the built-in classes
//! plus the scenario's `[devices.NAME]` tables (FLOP rate and/or per-layer times, see
//! [`crate::compute`]).

use std::path::{Path, PathBuf};

use serde::Deserialize;
use thiserror::Error;

use crate::compute::{ComputeError, Device, DeviceRegistry, DeviceSpec};

/// Errors reading or validating a scenario.
#[derive(Debug, Error)]
pub enum ScenarioError {
    /// The file could not be read.
    #[error("cannot read scenario {path}: {source}")]
    Io {
        /// File.
        path: PathBuf,
        /// Cause.
        source: std::io::Error,
    },
    /// TOML syntax or schema error (unknown key, wrong type); the message names the key.
    #[error("bad scenario {source_name}: {message}")]
    Parse {
        /// File or embedded scenario name.
        source_name: String,
        /// What toml said (names the key and line).
        message: String,
    },
    /// A value is out of range or inconsistent.
    #[error("bad scenario {source_name}: {key}: {problem}")]
    Invalid {
        /// File or embedded scenario name.
        source_name: String,
        /// Dotted key, e.g. `clusters.count`.
        key: String,
        /// What is wrong and what is allowed.
        problem: String,
    },
    /// No embedded scenario of that name.
    #[error("unknown scenario '{0}'; built-in scenarios: {1}")]
    Unknown(String, String),
}

/// Which simulation a scenario describes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ScenarioKind {
    /// Clusters of GPU (or CPU) nodes joined by a slower link; strategies ssgd/wfbp/localsgd/dreamddp.
    Clusters,
    /// Cloud nodes + CPU aggregators + edge devices on lossy links; strategies elastic/blocking.
    Edge,
}

/// A scenario file.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Scenario {
    /// Scenario name (used for the default output folder).
    pub name: String,
    /// Free text shown in reports.
    #[serde(default)]
    pub description: String,
    /// Master seed: every random stream derives from it.
    #[serde(default)]
    pub seed: u64,
    /// Which simulation.
    pub kind: ScenarioKind,
    /// Model: mlp, cnn, gpt-tiny.
    #[serde(default = "default_model")]
    pub model: String,
    /// Data set: mnist, digits, tinyshakespeare, or auto (mnist when present, else digits).
    #[serde(default = "default_dataset")]
    pub dataset: String,
    /// Per-replica batch.
    #[serde(default = "default_batch")]
    pub batch: usize,
    /// Peak learning rate (default: the model's default).
    pub lr: Option<f32>,
    /// Optimizer: sgd or adamw (default: the model's default).
    pub optimizer: Option<String>,
    /// Stop after this many optimizer steps per replica.
    #[serde(default = "default_max_steps")]
    pub max_steps: u64,
    /// Stop after this many virtual seconds.
    #[serde(default = "default_max_virtual_s")]
    pub max_virtual_s: f64,
    /// Evaluate the global model every this many virtual seconds.
    #[serde(default = "default_eval_every_s")]
    pub eval_every_s: f64,
    /// Test examples (or validation batches) per evaluation.
    #[serde(default = "default_eval_limit")]
    pub eval_limit: usize,
    /// Target: accuracy in 0..1 for classification, or a loss for gpt-tiny.
    pub target: f64,
    /// Strategies to compare, in order.
    pub strategies: Vec<String>,
    /// Period H (localsgd, dreamddp, and the cross-site exchange period of edge scenarios).
    #[serde(default = "default_period")]
    pub period: u64,
    /// The clusters table (kind = clusters).
    pub clusters: Option<crate::clusters::ClustersSpec>,
    /// The edge table (kind = edge).
    pub edge: Option<crate::edge::EdgeSpec>,
    /// Device classes besides the built-in ones (`[devices.NAME]`), usable by every kind.
    /// After loading it also holds the classes of `[clusters.devices]`; resolve through
    /// [`Scenario::device`].
    #[serde(default)]
    pub devices: DeviceRegistry,
    /// Named link specs that the tables above refer to.
    #[serde(default)]
    pub links: std::collections::BTreeMap<String, crate::link::LinkSpec>,
    /// Folder that relative trace paths are resolved against (set by the loader).
    #[serde(skip)]
    pub base_dir: PathBuf,
    /// Seed of the network and the devices' timing alone (an edge scenario's link losses,
    /// jitter and bursts, its compute jitter and stragglers), when it differs from `seed`: the
    /// model's initial values and the data's order stay `seed`'s. `fidelity --sim-seeds` sets it
    /// (a real run's relays draw a network of their own, its trainers start from `seed`'s
    /// model); `None` (every scenario file): `seed`.
    #[serde(skip)]
    pub network_seed: Option<u64>,
}

fn default_model() -> String {
    "mlp".into()
}
fn default_dataset() -> String {
    "auto".into()
}
fn default_batch() -> usize {
    32
}
fn default_max_steps() -> u64 {
    1000
}
fn default_max_virtual_s() -> f64 {
    3600.0
}
fn default_eval_every_s() -> f64 {
    10.0
}
fn default_eval_limit() -> usize {
    2000
}
fn default_period() -> u64 {
    4
}

/// The scenarios shipped in `simulations/scenarios/`, embedded in the binary.
pub const BUILTIN: &[(&str, &str)] = &[
    ("default", include_str!("../scenarios/default.toml")),
    (
        "default-2core",
        include_str!("../scenarios/default-2core.toml"),
    ),
    (
        "two-datacenters",
        include_str!("../scenarios/two-datacenters.toml"),
    ),
    (
        "mixed-cpu-gpu",
        include_str!("../scenarios/mixed-cpu-gpu.toml"),
    ),
    ("edge-outage", include_str!("../scenarios/edge-outage.toml")),
    (
        "edge-outage-2core",
        include_str!("../scenarios/edge-outage-2core.toml"),
    ),
    (
        "fidelity-smoke",
        include_str!("../scenarios/fidelity-smoke.toml"),
    ),
    (
        "fidelity-fcc",
        include_str!("../scenarios/fidelity-fcc.toml"),
    ),
    (
        "two-datacenters-gpt",
        include_str!("../scenarios/two-datacenters-gpt.toml"),
    ),
];

impl Scenario {
    /// Parses scenario text; `source_name` names it in errors, `base_dir` anchors trace paths.
    pub fn parse(text: &str, source_name: &str, base_dir: &Path) -> Result<Self, ScenarioError> {
        let mut s: Scenario = toml::from_str(text).map_err(|e| ScenarioError::Parse {
            source_name: source_name.to_string(),
            message: e.to_string(),
        })?;
        s.base_dir = base_dir.to_path_buf();
        s.merge_device_tables(source_name)?;
        s.validate(source_name)?;
        Ok(s)
    }

    /// Resolves a device class by name from the scenario's registry; `key` is the referring
    /// key, named in the error when the class is unknown.
    pub fn device(&self, name: &str, key: &str) -> Result<Device, ComputeError> {
        self.devices.resolve(name, self.batch, key)
    }

    /// Makes [`Scenario::devices`] the one registry: folds `[clusters.devices]` into it (a
    /// name defined in both tables is an error) and validates every class.
    fn merge_device_tables(&mut self, src: &str) -> Result<(), ScenarioError> {
        let invalid = |e: ComputeError| ScenarioError::Invalid {
            source_name: src.to_string(),
            key: e.key,
            problem: e.problem,
        };
        if let Some(clusters) = &self.clusters {
            for (name, class) in &clusters.devices {
                self.devices
                    .add("clusters.devices", name, DeviceSpec::from(class.clone()))
                    .map_err(invalid)?;
            }
        }
        self.devices.validate().map_err(invalid)
    }

    /// Loads a scenario by built-in name or file path.
    pub fn load(name_or_path: &str) -> Result<(Self, String), ScenarioError> {
        if let Some((_, text)) = BUILTIN.iter().find(|(n, _)| *n == name_or_path) {
            let base = traces_base_dir();
            return Ok((Self::parse(text, name_or_path, &base)?, text.to_string()));
        }
        let path = Path::new(name_or_path);
        if !path.exists() {
            let names: Vec<&str> = BUILTIN.iter().map(|(n, _)| *n).collect();
            return Err(ScenarioError::Unknown(
                name_or_path.to_string(),
                names.join(", "),
            ));
        }
        let text = std::fs::read_to_string(path).map_err(|source| ScenarioError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let base = path.parent().map(Path::to_path_buf).unwrap_or_default();
        Ok((
            Self::parse(&text, &path.display().to_string(), &base)?,
            text,
        ))
    }

    fn validate(&self, src: &str) -> Result<(), ScenarioError> {
        let bad = |key: &str, problem: String| ScenarioError::Invalid {
            source_name: src.to_string(),
            key: key.to_string(),
            problem,
        };
        if self.batch == 0 {
            return Err(bad("batch", "must be at least 1".into()));
        }
        if self.period == 0 {
            return Err(bad("period", "must be at least 1".into()));
        }
        if !(self.eval_every_s > 0.0 && self.eval_every_s.is_finite()) {
            return Err(bad(
                "eval_every_s",
                format!(
                    "must be a positive number of seconds, got {}",
                    self.eval_every_s
                ),
            ));
        }
        if !(self.max_virtual_s > 0.0 && self.max_virtual_s.is_finite()) {
            return Err(bad(
                "max_virtual_s",
                format!("must be positive, got {}", self.max_virtual_s),
            ));
        }
        if self.strategies.is_empty() {
            return Err(bad("strategies", "list at least one strategy".into()));
        }
        match self.kind {
            ScenarioKind::Clusters if self.clusters.is_none() => Err(bad(
                "clusters",
                "kind = \"clusters\" needs a [clusters] table".into(),
            )),
            ScenarioKind::Edge if self.edge.is_none() => {
                Err(bad("edge", "kind = \"edge\" needs an [edge] table".into()))
            }
            _ => Ok(()),
        }
    }
}

/// Folder the trace paths of built-in scenarios resolve against: `$DREAMDDP_TRACES_DIR`, else
/// `../shared/data/traces` when present, else the copies shipped in `simulations/traces/`
/// (ATT-LTE-driving-2016 up/down and norway_bus_1, so the scenarios run without `../shared`).
pub fn traces_base_dir() -> PathBuf {
    if let Ok(d) = std::env::var("DREAMDDP_TRACES_DIR") {
        return PathBuf::from(d);
    }
    engine::data::locate::shared_datasets_dir()
        .and_then(|d| d.parent().map(|p| p.join("traces")))
        .filter(|p| p.join("ATT-LTE-driving-2016.up").is_file())
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("traces"))
}

#[cfg(test)]
mod tests {
    use super::*;

    const HEAD: &str = r#"
name = "t"
kind = "clusters"
target = 0.9
strategies = ["ssgd"]
[links.wan]
bandwidth = "1gbit"
[clusters]
inter_link = "wan"
groups = [{ name = "dc", count = 2, workers = 1, device = "timed" }]
"#;

    fn parse(extra: &str) -> Result<Scenario, ScenarioError> {
        Scenario::parse(&format!("{HEAD}{extra}"), "t", Path::new("."))
    }

    fn err(extra: &str) -> String {
        parse(extra).expect_err("must be rejected").to_string()
    }

    #[test]
    fn top_level_classes_resolve_for_the_clusters_groups() {
        let s = parse("[devices.timed]\nflops = 3e9\n[devices.timed.layers]\nfc1 = { forward_ms = 1.5, backward_ms = 3 }\n[devices.layers-only.layers]\nfc1 = { forward_ms = 1, backward_ms = 2 }\n")
            .expect("parses");
        let clusters = s.clusters.as_ref().expect("clusters");
        let setups = clusters.clusters(&s).expect("groups resolve");
        assert_eq!(setups[0].device.name, "timed");
        assert_eq!(setups[0].device.rate.as_ref().map(|r| r.flops), Some(3e9));
        let layers_only = s.device("layers-only", "k").expect("resolves");
        assert!(
            layers_only.rate.is_none(),
            "a class without a rate has no FLOP form"
        );
        let d = s
            .device("timed", "clusters.groups[0].device")
            .expect("resolves");
        assert_eq!(d.reference_batch, s.batch);
        assert_eq!(d.layers["fc1"].backward_ms, 3.0);
    }

    #[test]
    fn the_older_clusters_devices_table_joins_the_registry() {
        let s = parse("[clusters.devices.timed]\nflops = 2e9\nlayer_overhead_s = 1e-5\n")
            .expect("parses");
        let d = s.device("timed", "k").expect("resolves");
        assert_eq!(d.rate.expect("rate").layer_overhead_s, 1e-5);
        let e = err("[clusters.devices.timed]\nflops = 2e9\n[devices.timed]\nflops = 1e9\n");
        assert!(
            e.contains(
                "clusters.devices.timed: device class 'timed' is already defined as devices.timed"
            ),
            "{e}"
        );
    }

    #[test]
    fn every_shipped_scenario_parses_and_its_devices_resolve() {
        for (name, _) in BUILTIN {
            let (s, _) = Scenario::load(name).unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(&s.name, name);
            let devices: Vec<String> = match (&s.clusters, &s.edge) {
                (Some(c), _) => c.groups.iter().map(|g| g.device.clone()).collect(),
                (None, Some(e)) => vec![e.cloud.device.clone(), e.devices.device.clone()],
                (None, None) => unreachable!("validate requires one table"),
            };
            for d in devices {
                s.device(&d, "device")
                    .unwrap_or_else(|e| panic!("{name}: {e}"));
            }
        }
    }

    #[test]
    fn bad_device_tables_name_the_key() {
        let e = err("[devices.timed.layers]\nfc1 = { forward_ms = 1 }\n");
        assert!(e.contains("backward_ms"), "{e}");
        let e = err("[devices.timed.layers]\nfc1 = { forward_ms = 1, backward_ms = 2, bwd = 3 }\n");
        assert!(e.contains("unknown field `bwd`"), "{e}");
        let e = err("[devices.timed]\nflop = 1e9\n");
        assert!(e.contains("unknown field `flop`"), "{e}");
        let e = err("[devices.timed.layers]\nfc1 = { forward_ms = -1, backward_ms = 2 }\n");
        assert!(
            e.contains("devices.timed.layers.fc1.forward_ms: must be a non-negative"),
            "{e}"
        );
        let e = err("[devices.timed]\nflops = 0\n");
        assert!(
            e.contains("devices.timed.flops: must be a positive number"),
            "{e}"
        );
    }
}
