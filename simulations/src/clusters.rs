//! Clusters simulation (`kind = "clusters"`): intra-cluster strategies across a slower link.

use serde::Deserialize;

/// The `[clusters]` table.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClustersSpec {}
