//! The network part of a scenario file: named nodes and per-direction links between them.
//!
//! ```toml
//! nodes = ["hub", "edge-0", "edge-1"]
//!
//! [links.edge-0]            # a duplex link named "edge-0"
//! from = "edge-0"           # `up` goes from -> to, `down` goes to -> from
//! to = "hub"
//! up = { bandwidth = "20mbit", latency_ms = 15, loss = 0.01 }
//! down = { bandwidth = "100mbit", latency_ms = 15, outages = [{ start_s = 30, duration_s = 5 }] }
//!
//! [links.edge-1]
//! from = "edge-1"
//! to = "hub"
//! up = { trace = { path = "traces/ATT-LTE-driving-2016.up", format = "mahimahi" }, latency_ms = 40 }
//! ```
//!
//! Unknown keys are refused (`deny_unknown_fields`) and every error names the link direction it
//! is about, e.g. `link edge-3.up: loss must be in [0,1], got 1.5`. Directed links are kept in the
//! order of their names, and [`Topology::build_links`] forks one random stream per direction from
//! its name (`link:<name>.<up|down>`), so adding a link never changes the others' randomness.

use crate::link::{Link, LinkError, LinkSpec, LinkSpecError};
use crate::rng::SimRng;
use crate::trace::{Trace, TraceError, TraceFormat};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use thiserror::Error;

/// The `[links.<name>]` table of a scenario: a duplex link between two nodes.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DuplexLinkSpec {
    /// One end; `up` leaves it.
    pub from: String,
    /// The other end; `down` leaves it.
    pub to: String,
    /// The `from -> to` direction.
    pub up: LinkSpec,
    /// The `to -> from` direction; absent for a one-way link.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub down: Option<LinkSpec>,
}

/// The network section of a scenario file, as written.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TopologySpec {
    /// Node names, unique.
    pub nodes: Vec<String>,
    /// Duplex links by name.
    #[serde(default)]
    pub links: BTreeMap<String, DuplexLinkSpec>,
}

/// Index of a node in [`Topology::nodes`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct NodeId(pub usize);

/// One direction of a link, resolved to node ids.
#[derive(Clone, Debug, PartialEq)]
pub struct DirectedLinkSpec {
    /// `<link name>.up` or `<link name>.down`.
    pub name: String,
    /// Sending node.
    pub from: NodeId,
    /// Receiving node.
    pub to: NodeId,
    /// The direction's parameters (validated).
    pub spec: LinkSpec,
}

/// Why a topology could not be loaded or built.
#[derive(Debug, Error)]
pub enum TopologyError {
    /// The scenario file could not be read.
    #[error("cannot read scenario {}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// The TOML is malformed or has unknown / mistyped keys.
    #[error("{origin}: {source}")]
    Toml {
        /// The file (or `<string>` for in-memory text).
        origin: String,
        /// The parser's error, which names the key and position.
        #[source]
        source: toml::de::Error,
    },
    /// A node name appears twice (or is empty).
    #[error("node name `{0}` is duplicated or empty")]
    BadNodeName(String),
    /// A link names a node that is not in `nodes`.
    #[error("link {link}: unknown node `{node}` (known: {known})")]
    UnknownNode {
        /// The link.
        link: String,
        /// The missing node.
        node: String,
        /// The declared nodes, comma separated.
        known: String,
    },
    /// A link connects a node to itself.
    #[error("link {link}: `from` and `to` are the same node `{node}`")]
    SelfLoop {
        /// The link.
        link: String,
        /// The node.
        node: String,
    },
    /// Two links cover the same direction between the same nodes.
    #[error("link {link}: the direction {from} -> {to} is already covered by link {other}")]
    DuplicateDirection {
        /// The second link.
        link: String,
        /// The first link.
        other: String,
        /// Sender.
        from: String,
        /// Receiver.
        to: String,
    },
    /// A link direction has an invalid parameter.
    #[error("link {link}: {source}")]
    InvalidLink {
        /// `<name>.up` / `<name>.down`.
        link: String,
        /// What is wrong.
        #[source]
        source: LinkSpecError,
    },
    /// A link direction's trace could not be loaded.
    #[error("link {link}: {source}")]
    Trace {
        /// `<name>.up` / `<name>.down`.
        link: String,
        /// What went wrong.
        #[source]
        source: TraceError,
    },
}

/// A validated network: nodes and directed links.
#[derive(Clone, Debug)]
pub struct Topology {
    nodes: Vec<String>,
    links: Vec<DirectedLinkSpec>,
    base_dir: PathBuf,
}

impl Topology {
    /// Reads a scenario file; trace paths are relative to its directory.
    pub fn load(path: &Path) -> Result<Topology, TopologyError> {
        let text = std::fs::read_to_string(path).map_err(|source| TopologyError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let spec: TopologySpec = toml::from_str(&text).map_err(|source| TopologyError::Toml {
            origin: path.display().to_string(),
            source,
        })?;
        let base_dir = path.parent().unwrap_or(Path::new(".")).to_path_buf();
        Topology::from_spec(spec, &base_dir)
    }

    /// Parses TOML text; trace paths are relative to `base_dir`.
    pub fn from_toml_str(text: &str, base_dir: &Path) -> Result<Topology, TopologyError> {
        let spec: TopologySpec = toml::from_str(text).map_err(|source| TopologyError::Toml {
            origin: "<string>".into(),
            source,
        })?;
        Topology::from_spec(spec, base_dir)
    }

    /// Validates a parsed spec: unique node names, known endpoints, no self-loops, at most one
    /// link per direction, valid link parameters.
    pub fn from_spec(spec: TopologySpec, base_dir: &Path) -> Result<Topology, TopologyError> {
        let mut index: BTreeMap<&str, NodeId> = BTreeMap::new();
        for (i, name) in spec.nodes.iter().enumerate() {
            if name.trim().is_empty() || index.insert(name.as_str(), NodeId(i)).is_some() {
                return Err(TopologyError::BadNodeName(name.clone()));
            }
        }
        let resolve = |link: &str, node: &str| {
            index
                .get(node)
                .copied()
                .ok_or_else(|| TopologyError::UnknownNode {
                    link: link.to_string(),
                    node: node.to_string(),
                    known: spec.nodes.join(", "),
                })
        };
        let mut links = Vec::new();
        let mut covered: BTreeMap<(NodeId, NodeId), String> = BTreeMap::new();
        for (name, duplex) in &spec.links {
            let a = resolve(name, &duplex.from)?;
            let b = resolve(name, &duplex.to)?;
            if a == b {
                return Err(TopologyError::SelfLoop {
                    link: name.clone(),
                    node: duplex.from.clone(),
                });
            }
            let directions = [
                ("up", a, b, Some(&duplex.up)),
                ("down", b, a, duplex.down.as_ref()),
            ];
            for (direction, from, to, link_spec) in directions {
                let Some(link_spec) = link_spec else { continue };
                let full_name = format!("{name}.{direction}");
                crate::link::validate_link(link_spec).map_err(|source| {
                    TopologyError::InvalidLink {
                        link: full_name.clone(),
                        source,
                    }
                })?;
                if let Some(other) = covered.insert((from, to), full_name.clone()) {
                    return Err(TopologyError::DuplicateDirection {
                        link: full_name,
                        other,
                        from: spec.nodes[from.0].clone(),
                        to: spec.nodes[to.0].clone(),
                    });
                }
                links.push(DirectedLinkSpec {
                    name: full_name,
                    from,
                    to,
                    spec: link_spec.clone(),
                });
            }
        }
        Ok(Topology {
            nodes: spec.nodes,
            links,
            base_dir: base_dir.to_path_buf(),
        })
    }

    /// Node names; a [`NodeId`] indexes this slice.
    pub fn nodes(&self) -> &[String] {
        &self.nodes
    }

    /// The id of the node called `name`.
    pub fn node_id(&self, name: &str) -> Option<NodeId> {
        self.nodes.iter().position(|n| n == name).map(NodeId)
    }

    /// Directed links, ordered by link name then `up` before `down`.
    pub fn links(&self) -> &[DirectedLinkSpec] {
        &self.links
    }

    /// The position in [`links`](Self::links) of the direction `from -> to`.
    pub fn link_index(&self, from: NodeId, to: NodeId) -> Option<usize> {
        self.links.iter().position(|l| l.from == from && l.to == to)
    }

    /// The directed link `from -> to`, if any.
    pub fn link_between(&self, from: NodeId, to: NodeId) -> Option<&DirectedLinkSpec> {
        self.link_index(from, to).map(|i| &self.links[i])
    }

    /// Builds one [`Link`] per directed link, in [`links`](Self::links) order. Each gets the
    /// stream `rng.fork("link:<name>")`; a trace file used by several links is parsed once.
    pub fn build_links(&self, rng: &SimRng) -> Result<Vec<Link>, TopologyError> {
        let mut traces: BTreeMap<(PathBuf, TraceFormat, bool), Arc<Trace>> = BTreeMap::new();
        let mut built = Vec::with_capacity(self.links.len());
        for directed in &self.links {
            let trace = match &directed.spec.trace {
                None => None,
                Some(t) => {
                    let path = self.base_dir.join(&t.path);
                    let key = (path.clone(), t.format, t.looped);
                    let parsed = match traces.get(&key) {
                        Some(p) => p.clone(),
                        None => {
                            let p = Arc::new(Trace::load(&path, t.format, t.looped).map_err(
                                |source| TopologyError::Trace {
                                    link: directed.name.clone(),
                                    source,
                                },
                            )?);
                            traces.insert(key, p.clone());
                            p
                        }
                    };
                    Some(parsed)
                }
            };
            let link_rng = rng.fork(&format!("link:{}", directed.name));
            let link = Link::new(&directed.spec, trace, &link_rng).map_err(|e| match e {
                LinkError::Spec(source) => TopologyError::InvalidLink {
                    link: directed.name.clone(),
                    source,
                },
                LinkError::Trace(source) => TopologyError::Trace {
                    link: directed.name.clone(),
                    source,
                },
                LinkError::TraceNotSupplied { .. } => {
                    unreachable!("build_links always supplies the trace it loaded")
                }
            })?;
            built.push(link);
        }
        Ok(built)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::time::SimTime;

    const TWO_EDGES: &str = r#"
nodes = ["hub", "edge-0", "edge-1"]

[links.edge-0]
from = "edge-0"
to = "hub"
up = { bandwidth = "20mbit", latency_ms = 15, loss = 0.02 }
down = { bandwidth = 100e6, latency_ms = 15 }

[links.edge-1]
from = "edge-1"
to = "hub"
up = { bandwidth = "10 Mbit/s", latency_ms = 30, loss = 0.05, outages = [{ start_s = 1, duration_s = 0.5 }] }
"#;

    #[test]
    fn parses_nodes_and_directions() {
        let topo = Topology::from_toml_str(TWO_EDGES, Path::new(".")).unwrap();
        assert_eq!(topo.nodes(), &["hub", "edge-0", "edge-1"]);
        let names: Vec<&str> = topo.links().iter().map(|l| l.name.as_str()).collect();
        assert_eq!(names, vec!["edge-0.up", "edge-0.down", "edge-1.up"]);
        let hub = topo.node_id("hub").unwrap();
        let e0 = topo.node_id("edge-0").unwrap();
        let e1 = topo.node_id("edge-1").unwrap();
        let down = topo.link_between(hub, e0).unwrap();
        assert_eq!(down.name, "edge-0.down");
        assert_eq!(down.spec.bandwidth.unwrap().bits_per_sec(), 100_000_000);
        assert!(topo.link_between(hub, e1).is_none());
        assert_eq!(topo.build_links(&SimRng::new(1)).unwrap().len(), 3);
    }

    #[test]
    fn errors_name_the_link_and_key() {
        let bad_loss = TWO_EDGES.replace("loss = 0.05", "loss = 1.5");
        let err = Topology::from_toml_str(&bad_loss, Path::new(".")).unwrap_err();
        assert_eq!(
            err.to_string(),
            "link edge-1.up: loss must be in [0,1], got 1.5"
        );

        let unknown_key = TWO_EDGES.replace("loss = 0.02", "lossy = 0.02");
        let err = Topology::from_toml_str(&unknown_key, Path::new(".")).unwrap_err();
        assert!(matches!(err, TopologyError::Toml { .. }));
        assert!(err.to_string().contains("unknown field `lossy`"), "{err}");

        let bad_bw = TWO_EDGES.replace("\"20mbit\"", "\"20 furlongs\"");
        let err = Topology::from_toml_str(&bad_bw, Path::new(".")).unwrap_err();
        assert!(err.to_string().contains("unknown unit `furlongs`"), "{err}");

        let unknown_node = TWO_EDGES.replace("from = \"edge-1\"", "from = \"edge-9\"");
        let err = Topology::from_toml_str(&unknown_node, Path::new(".")).unwrap_err();
        assert_eq!(
            err.to_string(),
            "link edge-1: unknown node `edge-9` (known: hub, edge-0, edge-1)"
        );

        let duplicate = format!(
            "{TWO_EDGES}\n[links.zz-again]\nfrom = \"hub\"\nto = \"edge-0\"\nup = {{ bandwidth = 1000 }}\n"
        );
        let err = Topology::from_toml_str(&duplicate, Path::new(".")).unwrap_err();
        assert!(
            err.to_string()
                .contains("direction hub -> edge-0 is already covered by link edge-0.down"),
            "{err}"
        );

        let missing_trace = "nodes = [\"a\", \"b\"]\n[links.x]\nfrom = \"a\"\nto = \"b\"\nup = { trace = { path = \"nope.up\", format = \"mahimahi\" } }\n";
        let topo = Topology::from_toml_str(missing_trace, Path::new("/nonexistent")).unwrap();
        let err = topo.build_links(&SimRng::new(1)).unwrap_err();
        assert!(
            err.to_string()
                .starts_with("link x.up: cannot read trace /nonexistent/nope.up"),
            "{err}"
        );

        let err = Topology::from_toml_str("nodes = [\"a\", \"a\"]", Path::new(".")).unwrap_err();
        assert!(matches!(err, TopologyError::BadNodeName(_)));
    }

    #[test]
    fn adding_a_link_does_not_perturb_the_others() {
        let run = |text: &str| {
            let topo = Topology::from_toml_str(text, Path::new(".")).unwrap();
            let mut links = topo.build_links(&SimRng::new(99)).unwrap();
            let index = topo
                .links()
                .iter()
                .position(|l| l.name == "edge-1.up")
                .unwrap();
            (0..5)
                .map(|i| links[index].send(SimTime::from_secs(i), 300_000, None))
                .collect::<Vec<_>>()
        };
        let extended = format!(
            "{}\n[links.aaa]\nfrom = \"hub\"\nto = \"edge-1\"\nup = {{ bandwidth = \"1gbit\", loss = 0.1 }}\n",
            TWO_EDGES
        );
        let base = run(TWO_EDGES);
        assert!(
            base.iter().any(|t| t.packets_lost > 0),
            "the test needs losses"
        );
        assert_eq!(base, run(&extended));
    }
}
