//! `fidelity --real-from DIR`: the real side of an earlier `fidelity` run, read back from its
//! output folder (`DIR/real/summary.json` in the simulator's schema, and each strategy's
//! `DIR/real/<strategy>/summary.json` for its pace overruns and problems), so that a change
//! to the simulator can be re-checked against the same real runs without running the cluster
//! again.

use std::path::Path;

use anyhow::{bail, Context, Result};
use simulations::report::{SimSummary, StrategyResult};

use crate::fidelity_cmd::{compare_results, StrategyFidelity};
use crate::scenario_cluster::LoadedScenario;

/// The recorded real run in `dir` and each simulated strategy compared with it.
pub fn recorded(
    dir: &Path,
    loaded: &LoadedScenario,
    sims: &[StrategyResult],
) -> Result<(SimSummary, Vec<StrategyFidelity>)> {
    let real_dir = dir.join("real");
    let path = real_dir.join("summary.json");
    let text = std::fs::read_to_string(&path).with_context(|| {
        format!(
            "--real-from: cannot read {} (a `fidelity --out DIR` folder holds real/summary.json)",
            path.display()
        )
    })?;
    let real: SimSummary = serde_json::from_str(&text)
        .with_context(|| format!("--real-from: {} is not a summary.json", path.display()))?;
    if real.scenario_toml != loaded.text || real.seed != loaded.scenario.seed {
        bail!(
            "--real-from: {} was recorded from another scenario text or seed than this run's \
             (scenario {} seed {} there, {} seed {} here): give the same scenario and flags",
            path.display(),
            real.scenario,
            real.seed,
            loaded.scenario.name,
            loaded.scenario.seed
        );
    }
    let rows = sims
        .iter()
        .map(|sim| {
            let Some(r) = real.strategies.iter().find(|r| r.strategy == sim.strategy) else {
                bail!(
                    "--real-from: {} has no real run of {} (it has: {})",
                    path.display(),
                    sim.strategy,
                    real.strategies
                        .iter()
                        .map(|r| r.strategy.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                );
            };
            let cluster_path = real_dir.join(&sim.strategy).join("summary.json");
            let cluster: serde_json::Value = std::fs::read_to_string(&cluster_path)
                .ok()
                .and_then(|t| serde_json::from_str(&t).ok())
                .with_context(|| format!("--real-from: cannot read {}", cluster_path.display()))?;
            let overruns = cluster["nodes"].as_array().map_or(0, |nodes| {
                nodes
                    .iter()
                    .filter_map(|n| n["pace_overruns"].as_u64())
                    .sum()
            });
            let problems = cluster["problems"].as_array().map_or_else(Vec::new, |p| {
                p.iter()
                    .filter_map(|x| x.as_str().map(String::from))
                    .collect()
            });
            Ok(compare_results(sim, r, overruns, problems))
        })
        .collect::<Result<_>>()?;
    Ok((real, rows))
}
