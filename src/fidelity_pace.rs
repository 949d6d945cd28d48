//! A strategy's pace in both engines, for runs that end before their target: how long each
//! took to reach the lowest final accuracy any of them reached.
//!
//! A `blocking` run on a lossy edge scenario does a handful of rounds before the run's end, and
//! both engines go through the same sequence of global models (the same seed, the same data):
//! its final accuracy is a step function of the rounds done, so one round more or less at the
//! cutoff is 5–15 points, however close the pace. The pace cell compares that pace instead.
//! The level is the lowest final accuracy of every simulated seed and real run, so each reached
//! it; each run's time is its first evaluation at or above it. The cell compares the medians
//! of those times (`(sim − real) / real`) and the mean bytes on the access links by then: what
//! the strategy spent for that progress, where a run's total counts its rounds to the cutoff.

use crate::fidelity_cmd::signed_error;
use crate::fidelity_seeds::{mean, median};
use serde::Serialize;
use simulations::report::{SeriesPoint, StrategyResult};

/// The pace cell of one strategy.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Pace {
    /// The accuracy level (0..1): the lowest final accuracy of the runs compared.
    pub level: f64,
    /// Median time the simulated seeds took to reach it, virtual seconds.
    pub sim_time_s: f64,
    /// Median time the real runs took, seconds since the trainers started.
    pub real_time_s: f64,
    /// `(sim − real) / real`.
    pub error: Option<f64>,
    /// Mean bytes on the nodes' access links by then, simulated.
    pub sim_bytes: u64,
    /// Mean bytes the real nodes had put on their access links by then.
    pub real_bytes: u64,
    /// `(sim − real) / real` of the bytes.
    pub bytes_error: Option<f64>,
}

/// `r`'s first evaluation at `level` or above (its last when none was: the final accuracy
/// counts as evaluated at the end).
fn reached(r: &StrategyResult, level: f64) -> Option<&SeriesPoint> {
    r.series
        .iter()
        .find(|p| p.accuracy.is_some_and(|a| a >= level))
        .or(r.series.last())
}

/// The pace cell of one strategy's simulated seeds and real runs; `None` without runs on
/// either side or without accuracies (a language model).
pub fn pace(sims: &[&StrategyResult], reals: &[&StrategyResult]) -> Option<Pace> {
    let finals: Vec<f64> = sims
        .iter()
        .chain(reals)
        .map(|r| r.final_accuracy)
        .collect::<Option<_>>()?;
    let level = finals.into_iter().reduce(f64::min)?;
    let at_level = |runs: &[&StrategyResult]| -> Option<(f64, u64)> {
        let points: Vec<&SeriesPoint> = runs
            .iter()
            .map(|r| reached(r, level))
            .collect::<Option<_>>()?;
        let bytes: Vec<f64> = points
            .iter()
            .map(|p| p.access_bytes.unwrap_or(p.bytes_sent) as f64)
            .collect();
        Some((
            median(points.iter().map(|p| p.time_s).collect())?,
            mean(&bytes)?.round() as u64,
        ))
    };
    let ((sim_time_s, sim_bytes), (real_time_s, real_bytes)) = (at_level(sims)?, at_level(reals)?);
    Some(Pace {
        level,
        sim_time_s,
        real_time_s,
        error: signed_error(sim_time_s, real_time_s),
        sim_bytes,
        real_bytes,
        bytes_error: signed_error(sim_bytes as f64, real_bytes as f64),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A run evaluated once a second with these accuracies (the last is its final one).
    fn run(accuracies: &[f64]) -> StrategyResult {
        let mut r = crate::fidelity_reuse::tests::result("blocking");
        r.series = accuracies
            .iter()
            .enumerate()
            .map(|(k, &a)| SeriesPoint {
                time_s: (k + 1) as f64,
                accuracy: Some(a),
                loss: 1.0,
                bytes_sent: 0,
                access_bytes: Some(1000 * (k as u64 + 1)),
                mean_steps: 0.0,
                divergence: None,
            })
            .collect();
        r.final_accuracy = accuracies.last().copied();
        r
    }

    #[test]
    fn the_level_is_the_lowest_final_and_the_medians_are_compared() {
        // The same rounds, one engine a second faster to each: finals 0.30 vs 0.40 would be
        // 10 points apart; the pace to 0.30 is 4 s against 5 s.
        let sims = [
            run(&[0.1, 0.2, 0.2, 0.3, 0.4]),
            run(&[0.1, 0.2, 0.3, 0.3, 0.3]),
        ];
        let reals = [
            run(&[0.1, 0.1, 0.2, 0.2, 0.3]),
            run(&[0.1, 0.2, 0.2, 0.3, 0.3]),
        ];
        let p = pace(
            &sims.iter().collect::<Vec<_>>(),
            &reals.iter().collect::<Vec<_>>(),
        )
        .unwrap();
        assert_eq!(p.level, 0.3);
        // Seeds at 4 and 3 s (median 3.5), runs at 5 and 4 s (median 4.5).
        assert_eq!((p.sim_time_s, p.real_time_s), (3.5, 4.5));
        assert!((p.error.unwrap() - (3.5 - 4.5) / 4.5).abs() < 1e-12);
        // Bytes by then (1,000 per second here): the means of 4,000 and 3,000, 5,000 and 4,000.
        assert_eq!((p.sim_bytes, p.real_bytes), (3500, 4500));
        assert!((p.bytes_error.unwrap() - (3500.0 - 4500.0) / 4500.0).abs() < 1e-12);
    }

    #[test]
    fn no_cell_without_accuracies_or_runs() {
        let mut lm = run(&[0.5]);
        lm.final_accuracy = None;
        let a = run(&[0.5]);
        assert_eq!(pace(&[&lm], &[&a]), None);
        assert_eq!(pace(&[], &[&a]), None);
        assert!(pace(&[&a], &[&a]).is_some());
    }
}
