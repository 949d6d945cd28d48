//! `fidelity --real-from DIR`: the real side of an earlier `fidelity` run, read back from its
//! output folder (`DIR/real/summary.json` in the simulator's schema, and each strategy's
//! `DIR/real/<strategy>/summary.json` for its pace overruns and problems; `DIR/real/run-K/`
//! for each run of a `--real-runs` recording), so that a change
//! to the simulator can be re-checked against the same real runs without running the cluster
//! again.

use std::path::Path;

use anyhow::{bail, Context, Result};
use simulations::report::{SimSummary, StrategyResult};

use crate::fidelity_cmd::{compare_results, StrategyFidelity};
use crate::scenario_cluster::LoadedScenario;

/// The real runs recorded in `dir` (`real/`, or `real/run-1/`, `real/run-2/`, … of a
/// `--real-runs` recording), each with every simulated strategy compared with it.
pub fn recorded_runs(
    dir: &Path,
    loaded: &LoadedScenario,
    sims: &[StrategyResult],
) -> Result<Vec<(SimSummary, Vec<StrategyFidelity>)>> {
    let real = dir.join("real");
    if real.join("summary.json").exists() || !real.join("run-1").exists() {
        return Ok(vec![recorded(&real, loaded, sims)?]);
    }
    (1..)
        .map(|k| real.join(format!("run-{k}")))
        .take_while(|run| run.exists())
        .map(|run| recorded(&run, loaded, sims))
        .collect()
}

/// The real run recorded in `real_dir` and each simulated strategy compared with it.
fn recorded(
    real_dir: &Path,
    loaded: &LoadedScenario,
    sims: &[StrategyResult],
) -> Result<(SimSummary, Vec<StrategyFidelity>)> {
    let path = real_dir.join("summary.json");
    let text = std::fs::read_to_string(&path).with_context(|| {
        format!(
            "--real-from: cannot read {} (a `fidelity --out DIR` folder holds real/summary.json, \
             or real/run-K/summary.json after --real-runs)",
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

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::scenario_cluster::{load, ScenarioOverrides};
    use simulations::report::StrategyResult;

    pub(crate) fn result(strategy: &str) -> StrategyResult {
        serde_json::from_value(serde_json::json!({
            "strategy": strategy,
            "time_to_target_s": 12.0,
            "final_accuracy": 0.9,
            "final_loss": 0.3,
            "virtual_seconds": 45.0,
            "bytes_sent": 1000,
            "bytes_by_link_class": {"edge": 1000},
            "weak_sync_events": 0,
            "undelivered_deltas": 0,
            "cached_at_end": 0,
            "staleness_histogram": {},
            "mean_step_s": 0.1,
            "series": [],
            "timeline": []
        }))
        .expect("a StrategyResult")
    }

    /// Writes a recorded real run into `real` (a `real/` or `real/run-K/` folder).
    pub(crate) fn write_recorded(real: &Path, toml: &str, seed: u64, strategies: &[&str]) {
        std::fs::create_dir_all(real).unwrap();
        let summary = SimSummary {
            scenario: "fidelity-smoke".into(),
            seed,
            scenario_toml: toml.into(),
            target: "accuracy >= 0.85".into(),
            strategies: strategies.iter().map(|s| result(s)).collect(),
        };
        std::fs::write(
            real.join("summary.json"),
            serde_json::to_string(&summary).unwrap(),
        )
        .unwrap();
        for s in strategies {
            std::fs::create_dir_all(real.join(s)).unwrap();
            std::fs::write(
                real.join(s).join("summary.json"),
                r#"{"nodes": [{"pace_overruns": 2}, {"pace_overruns": null}], "problems": ["edge-1 lost"]}"#,
            )
            .unwrap();
        }
    }

    #[test]
    fn a_recorded_real_run_is_read_back_and_a_mismatch_is_named() {
        let loaded = load("fidelity-smoke", &ScenarioOverrides::default()).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let sims = [result("elastic")];
        // Nothing recorded: the error names the file it looked for.
        let err = recorded_runs(dir.path(), &loaded, &sims)
            .unwrap_err()
            .to_string();
        assert!(err.contains("real/summary.json"), "{err}");
        // Another scenario text: refused.
        write_recorded(
            &dir.path().join("real"),
            "other",
            loaded.scenario.seed,
            &["elastic"],
        );
        let err = recorded_runs(dir.path(), &loaded, &sims)
            .unwrap_err()
            .to_string();
        assert!(err.contains("another scenario text or seed"), "{err}");
        // The same text, but not the strategy asked for: the error lists what is there.
        write_recorded(
            &dir.path().join("real"),
            &loaded.text,
            loaded.scenario.seed,
            &["blocking"],
        );
        let err = recorded_runs(dir.path(), &loaded, &sims)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("no real run of elastic") && err.contains("blocking"),
            "{err}"
        );
        // A match: compared cell by cell, with the run's overruns and problems.
        write_recorded(
            &dir.path().join("real"),
            &loaded.text,
            loaded.scenario.seed,
            &["elastic"],
        );
        let runs = recorded_runs(dir.path(), &loaded, &sims).unwrap();
        assert_eq!(runs.len(), 1);
        let (real, rows) = &runs[0];
        assert_eq!(real.strategies.len(), 1);
        assert_eq!(rows[0].time_to_target_error, Some(0.0));
        assert_eq!(rows[0].real_pace_overruns, 2);
        assert_eq!(rows[0].real_problems, vec!["edge-1 lost".to_string()]);
    }

    #[test]
    fn the_runs_of_a_real_runs_recording_are_read_back_in_order() {
        let loaded = load("fidelity-smoke", &ScenarioOverrides::default()).unwrap();
        let dir = tempfile::tempdir().unwrap();
        for k in 1..=3 {
            let run = dir.path().join("real").join(format!("run-{k}"));
            write_recorded(&run, &loaded.text, loaded.scenario.seed, &["elastic"]);
        }
        // run-2 holds another seed: the error names that run's file.
        let run2 = dir.path().join("real").join("run-2");
        write_recorded(&run2, &loaded.text, loaded.scenario.seed + 1, &["elastic"]);
        let err = recorded_runs(dir.path(), &loaded, &[result("elastic")])
            .unwrap_err()
            .to_string();
        assert!(err.contains("run-2"), "{err}");
        write_recorded(&run2, &loaded.text, loaded.scenario.seed, &["elastic"]);
        let runs = recorded_runs(dir.path(), &loaded, &[result("elastic")]).unwrap();
        assert_eq!(runs.len(), 3);
        assert!(runs.iter().all(|(_, rows)| rows[0].real_pace_overruns == 2));
    }
}
