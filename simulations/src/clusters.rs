//! Clusters simulation (`kind = "clusters"`): intra-cluster strategies across a slower link.

use serde::Deserialize;

/// The `[clusters]` table.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClustersSpec {}

/// Placeholder until the clusters simulation lands.
pub fn run_clusters(
    _s: &crate::scenario::Scenario,
    _t: &gpu_worker::task::Task,
    strategy: &str,
    _p: &mut dyn FnMut(f64),
) -> Result<crate::report::StrategyResult, String> {
    Err(format!(
        "clusters simulation not built yet (strategy {strategy})"
    ))
}
