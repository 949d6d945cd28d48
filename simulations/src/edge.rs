//! Edge simulation (`kind = "edge"`): cloud nodes, CPU aggregators and edge devices on lossy links.

use serde::Deserialize;

/// The `[edge]` table.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EdgeSpec {}
