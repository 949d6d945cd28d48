//! Compute pacing (`[training.pace]`): a trainer that stands in for a slower device class pads
//! every step to that class's modelled step time, so a Jetson-class device behaves like one on
//! any machine and a real run can reproduce a simulated one. [`StepPacer`] draws each step's
//! target the way the simulator does (`step_ms · (1 + jitter · U[0,1))`) and counts the steps
//! whose real compute was already longer than the target (the run cannot honour the class).

use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

/// `[training.pace]`.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct PaceSection {
    /// Target wall time of one step (forward, backward, optimizer and the sync work after it),
    /// milliseconds.
    pub step_ms: f64,
    /// Up to this fraction extra per step, uniformly drawn (0.2 = up to +20 %).
    #[serde(default)]
    pub jitter: f64,
    /// Seed of the jitter draws.
    #[serde(default)]
    pub seed: u64,
}

impl PaceSection {
    /// Checks the values (the error names the key).
    pub fn validate(&self) -> Result<(), (&'static str, String, &'static str)> {
        if !(self.step_ms.is_finite() && self.step_ms > 0.0 && self.step_ms < 3.6e6) {
            return Err((
                "training.pace.step_ms",
                self.step_ms.to_string(),
                "must be a positive number of milliseconds below one hour",
            ));
        }
        if !(self.jitter.is_finite() && (0.0..=10.0).contains(&self.jitter)) {
            return Err((
                "training.pace.jitter",
                self.jitter.to_string(),
                "must be a fraction between 0 and 10 (0.2 = up to +20 % per step)",
            ));
        }
        Ok(())
    }
}

/// Draws per-step targets and counts overruns.
#[derive(Clone, Debug)]
pub struct StepPacer {
    step_s: f64,
    jitter: f64,
    rng: u64,
    /// Steps whose real compute exceeded the target.
    pub overruns: u64,
    /// Steps paced.
    pub steps: u64,
}

impl StepPacer {
    /// A pacer for `section`.
    pub fn new(section: &PaceSection) -> StepPacer {
        StepPacer {
            step_s: section.step_ms / 1e3,
            jitter: section.jitter.max(0.0),
            rng: section.seed ^ 0x9E37_79B9_7F4A_7C15,
            overruns: 0,
            steps: 0,
        }
    }

    fn next_unit(&mut self) -> f64 {
        // splitmix64: a stream of uniform draws in [0, 1).
        self.rng = self.rng.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.rng;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        (z >> 11) as f64 / (1u64 << 53) as f64
    }

    /// The target duration of the next step.
    pub fn next_target(&mut self) -> Duration {
        let factor = 1.0 + self.jitter * self.next_unit();
        Duration::from_secs_f64(self.step_s * factor)
    }

    /// Records a step that took `actual` against `target`; true on the first overrun (the
    /// caller warns once).
    pub fn record(&mut self, actual: Duration, target: Duration) -> bool {
        self.steps += 1;
        if actual > target {
            self.overruns += 1;
            return self.overruns == 1;
        }
        false
    }
}

/// Where the next paced step's budget starts, for a step padded to `paced_end` whose sync work
/// after the pad (the cut) ended at `now`: at `paced_end`, so that work counts toward the next
/// step's target (as `PaceSection::step_ms` says) instead of lengthening every step; but never
/// more than one `target` before `now`, so a node whose cut took longer than a step does not
/// catch up with a burst of unpadded steps.
pub fn next_step_start(paced_end: Instant, target: Duration, now: Instant) -> Instant {
    now.checked_sub(target)
        .map_or(paced_end, |earliest| paced_end.max(earliest))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cut_after_a_step_counts_toward_the_next_one_up_to_a_whole_step() {
        let t0 = Instant::now();
        let target = Duration::from_millis(100);
        let paced_end = t0 + target;
        // A 10 ms cut: the next step's budget starts at the paced end, not after the cut.
        let after_cut = paced_end + Duration::from_millis(10);
        assert_eq!(next_step_start(paced_end, target, after_cut), paced_end);
        // A cut longer than a step: the budget starts one step before now (the next step
        // overruns by its compute, and no burst of unpadded steps follows).
        let long_cut = paced_end + Duration::from_millis(250);
        assert_eq!(
            next_step_start(paced_end, target, long_cut),
            long_cut - target
        );
    }

    #[test]
    fn targets_stay_within_the_jitter_band_and_average_its_middle() {
        let mut p = StepPacer::new(&PaceSection {
            step_ms: 100.0,
            jitter: 0.2,
            seed: 3,
        });
        let n = 10_000;
        let mut sum = 0.0;
        for _ in 0..n {
            let t = p.next_target().as_secs_f64();
            assert!((0.1..0.12).contains(&t), "{t}");
            sum += t;
        }
        let mean = sum / n as f64;
        assert!((mean - 0.11).abs() < 0.001, "{mean}");
    }

    #[test]
    fn overruns_are_counted_and_reported_once() {
        let mut p = StepPacer::new(&PaceSection {
            step_ms: 10.0,
            jitter: 0.0,
            seed: 0,
        });
        let t = p.next_target();
        assert_eq!(t, Duration::from_millis(10));
        assert!(!p.record(Duration::from_millis(5), t));
        assert!(p.record(Duration::from_millis(15), t));
        assert!(!p.record(Duration::from_millis(20), t));
        assert_eq!((p.steps, p.overruns), (3, 2));
    }

    #[test]
    fn bad_values_name_the_key() {
        let bad = PaceSection {
            step_ms: 0.0,
            jitter: 0.0,
            seed: 0,
        };
        assert_eq!(bad.validate().unwrap_err().0, "training.pace.step_ms");
        let bad = PaceSection {
            step_ms: 5.0,
            jitter: f64::NAN,
            seed: 0,
        };
        assert_eq!(bad.validate().unwrap_err().0, "training.pace.jitter");
    }
}
