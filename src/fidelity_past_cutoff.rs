//! The simulated time to target past the scenario's cutoff, for a strategy whose real runs
//! reach the target and whose simulated seeds, typically, do not by the end of the scenario.
//!
//! Both engines stop at the scenario's `max_virtual_s`. When the target falls close to it, the
//! real runs' typical run can reach it while the seeds' typical run does not (or the reverse),
//! and the time-to-target cell is not comparable, however close the two paces are. The real
//! runs cannot be run on, but the simulator can: `fidelity` runs the seeds of such a strategy
//! again for [`PAST_CUTOFF_FACTOR`] times the scenario's length (the simulator is
//! deterministic, so each run is the same as the first up to the cutoff) and compares their
//! typical time to target with the real one. The other cells stay those of the scenario's own
//! length.

use crate::fidelity_cmd::signed_error;
use crate::fidelity_seeds::typical_time_to_target;
use serde::Serialize;

/// How much longer than the scenario the seeds run on.
pub const PAST_CUTOFF_FACTOR: f64 = 1.5;

/// The seeds' time to target when run on past the cutoff.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PastCutoff {
    /// How long each seed ran, virtual seconds.
    pub virtual_s: f64,
    /// Each seed's time to target (`None`: not within `virtual_s`).
    pub sim_times_s: Vec<Option<f64>>,
    /// Their typical time to target (the median of those that reached it, when more than half
    /// did).
    pub sim_time_to_target_s: Option<f64>,
    /// `(sim − real) / real` against the real runs' typical time to target.
    pub time_to_target_error: Option<f64>,
}

/// Whether a strategy needs the seeds run on: its real runs typically reach the target, its
/// simulated seeds typically do not.
pub fn needed(real_time_to_target_s: Option<f64>, sim_time_to_target_s: Option<f64>) -> bool {
    real_time_to_target_s.is_some() && sim_time_to_target_s.is_none()
}

/// The comparison of the seeds' times, run for `virtual_s`, with the real typical time.
pub fn compare(sim_times_s: Vec<Option<f64>>, virtual_s: f64, real_time_s: f64) -> PastCutoff {
    let typical = typical_time_to_target(&sim_times_s);
    PastCutoff {
        virtual_s,
        time_to_target_error: typical.and_then(|s| signed_error(s, real_time_s)),
        sim_times_s,
        sim_time_to_target_s: typical,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_target_reached_by_the_real_runs_alone_needs_the_seeds_run_on() {
        assert!(needed(Some(870.0), None));
        assert!(!needed(None, None));
        assert!(!needed(Some(870.0), Some(880.0)));
        assert!(!needed(None, Some(880.0)));
    }

    #[test]
    fn the_seeds_typical_time_is_compared_with_the_real_one() {
        // default-2core's blocking: five seeds run to 1350 s, real median 870 s.
        let times = vec![
            Some(950.0),
            Some(915.0),
            Some(895.0),
            Some(930.0),
            Some(875.0),
        ];
        let p = compare(times.clone(), 1350.0, 870.0);
        assert_eq!(p.sim_time_to_target_s, Some(915.0));
        let err = p.time_to_target_error.expect("both reached");
        assert!((err - 45.0 / 870.0).abs() < 1e-12, "{err}");
        assert_eq!(p.sim_times_s, times);
        assert_eq!(p.virtual_s, 1350.0);
    }

    #[test]
    fn seeds_that_still_do_not_reach_it_give_no_error() {
        let p = compare(vec![None, Some(1200.0), None], 1350.0, 870.0);
        assert_eq!(p.sim_time_to_target_s, None);
        assert_eq!(p.time_to_target_error, None);
    }
}
