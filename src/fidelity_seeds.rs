//! `fidelity --sim-seeds K`: one strategy's simulated runs over several seeds, combined into the
//! typical run the cells compare with the real one, and their spread.
//!
//! The real relays draw their own losses, jitter and bursts, so a simulated run with one network
//! seed is one draw of the network, as a real run is another: on `default-2core` the simulated
//! `elastic` reaches 95 % at 10 or 15 s depending on it. The model's initial values and the
//! data's order are the scenario seed's in every run (`Scenario::network_seed`), as they are in
//! every real run. The combined run takes the median time to
//! target (of the seeds that reached it, when more than half did; else never), the mean final
//! accuracy, bytes (per link class and per link) and weak-sync events, and the summed staleness
//! histogram; everything else (series, timeline) is the first seed's.

use std::collections::BTreeMap;

use serde::Serialize;
use simulations::report::StrategyResult;

/// The spread of one strategy's simulated cells over the seeds.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SimSpread {
    /// The network seeds, in order (the first is the scenario's seed).
    pub seeds: Vec<u64>,
    /// Time to target per seed (`None`: never).
    pub time_to_target_s: Vec<Option<f64>>,
    /// Final accuracy per seed.
    pub final_accuracy: Vec<Option<f64>>,
    /// Bytes on the access links per seed.
    pub bytes: Vec<u64>,
}

/// The mean of `v` (`None` when empty).
pub fn mean(v: &[f64]) -> Option<f64> {
    (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64)
}

/// The median of `v` (`None` when empty).
pub fn median(mut v: Vec<f64>) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    Some(if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    })
}

/// The typical time to target of several runs: the median of those that reached it when more
/// than half did, else never.
pub fn typical_time_to_target(times: &[Option<f64>]) -> Option<f64> {
    let reached: Vec<f64> = times.iter().flatten().copied().collect();
    if reached.len() * 2 > times.len() {
        median(reached)
    } else {
        None
    }
}

fn mean_u64(values: impl Iterator<Item = u64>) -> u64 {
    let v: Vec<f64> = values.map(|x| x as f64).collect();
    mean(&v).unwrap_or(0.0).round() as u64
}

fn mean_map(
    runs: &[&StrategyResult],
    get: impl Fn(&StrategyResult) -> &BTreeMap<String, u64>,
) -> BTreeMap<String, u64> {
    let keys: std::collections::BTreeSet<&String> =
        runs.iter().flat_map(|r| get(r).keys()).collect();
    keys.into_iter()
        .map(|k| {
            let v = mean_u64(runs.iter().map(|r| get(r).get(k).copied().unwrap_or(0)));
            (k.clone(), v)
        })
        .collect()
}

/// Combines one strategy's runs (the same strategy, one per seed, the first seed first) into the
/// typical run; `access_bytes` counts a run's bytes on the access links.
pub fn combine(
    runs: &[&StrategyResult],
    seeds: &[u64],
    access_bytes: impl Fn(&StrategyResult) -> u64,
) -> (StrategyResult, SimSpread) {
    let mut out = runs[0].clone();
    let spread = SimSpread {
        seeds: seeds.to_vec(),
        time_to_target_s: runs.iter().map(|r| r.time_to_target_s).collect(),
        final_accuracy: runs.iter().map(|r| r.final_accuracy).collect(),
        bytes: runs.iter().map(|r| access_bytes(r)).collect(),
    };
    if runs.len() == 1 {
        return (out, spread);
    }
    out.time_to_target_s = typical_time_to_target(&spread.time_to_target_s);
    let accuracies: Vec<f64> = runs.iter().filter_map(|r| r.final_accuracy).collect();
    out.final_accuracy = (accuracies.len() == runs.len())
        .then(|| mean(&accuracies))
        .flatten();
    out.final_loss = mean(&runs.iter().map(|r| r.final_loss).collect::<Vec<_>>()).unwrap_or(0.0);
    out.bytes_sent = mean_u64(runs.iter().map(|r| r.bytes_sent));
    out.bytes_by_link_class = mean_map(runs, |r| &r.bytes_by_link_class);
    out.bytes_by_link = mean_map(runs, |r| &r.bytes_by_link);
    out.weak_sync_events = mean_u64(runs.iter().map(|r| r.weak_sync_events));
    let mut histogram = BTreeMap::new();
    for r in runs {
        for (&tau, &n) in &r.staleness_histogram {
            *histogram.entry(tau).or_insert(0) += n;
        }
    }
    out.staleness_histogram = histogram;
    (out, spread)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(tt: Option<f64>, acc: f64, bytes: u64) -> StrategyResult {
        serde_json::from_value(serde_json::json!({
            "strategy": "elastic",
            "time_to_target_s": tt,
            "final_accuracy": acc,
            "final_loss": 0.3,
            "virtual_seconds": 45.0,
            "bytes_sent": bytes,
            "bytes_by_link_class": {"edge": bytes},
            "bytes_by_link": {"edge-0.up": bytes / 2},
            "weak_sync_events": 0,
            "undelivered_deltas": 0,
            "cached_at_end": 0,
            "staleness_histogram": {"1": 2},
            "mean_step_s": 0.1,
            "series": [],
            "timeline": []
        }))
        .expect("a StrategyResult")
    }

    fn edge(r: &StrategyResult) -> u64 {
        r.bytes_by_link_class.get("edge").copied().unwrap_or(0)
    }

    #[test]
    fn the_typical_run_takes_the_median_time_and_the_mean_of_the_rest() {
        let runs = [
            run(Some(15.0), 0.95, 100),
            run(Some(10.0), 0.97, 200),
            run(Some(15.0), 0.96, 300),
        ];
        let (c, spread) = combine(&runs.iter().collect::<Vec<_>>(), &[1, 2, 3], edge);
        assert_eq!(c.time_to_target_s, Some(15.0));
        assert!((c.final_accuracy.unwrap() - 0.96).abs() < 1e-12);
        assert_eq!(edge(&c), 200);
        assert_eq!(c.bytes_by_link["edge-0.up"], 100);
        assert_eq!(c.staleness_histogram[&1], 6);
        assert_eq!(spread.seeds, vec![1, 2, 3]);
        assert_eq!(spread.bytes, vec![100, 200, 300]);
    }

    #[test]
    fn the_target_counts_as_reached_only_when_more_than_half_the_seeds_reach_it() {
        assert_eq!(typical_time_to_target(&[Some(5.0), None, None]), None);
        assert_eq!(
            typical_time_to_target(&[Some(5.0), Some(9.0), None]),
            Some(7.0)
        );
        assert_eq!(typical_time_to_target(&[]), None);
    }

    #[test]
    fn one_seed_is_its_own_typical_run() {
        let r = run(None, 0.5, 7);
        let (c, _) = combine(&[&r], &[4], edge);
        assert_eq!(c.time_to_target_s, None);
        assert_eq!(c.bytes_sent, 7);
    }
}
