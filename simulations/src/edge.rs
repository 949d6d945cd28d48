//! Edge simulation (`kind = "edge"`): cloud nodes, CPU aggregators and edge devices on lossy links.

use serde::Deserialize;

/// The `[edge]` table.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EdgeSpec {}

/// Placeholder until the edge simulation lands.
pub fn run_edge(
    _s: &crate::scenario::Scenario,
    _t: &gpu_worker::task::Task,
    strategy: &str,
    _p: &mut dyn FnMut(f64),
) -> Result<crate::report::StrategyResult, String> {
    Err(format!(
        "edge simulation not built yet (strategy {strategy})"
    ))
}
