//! Learning-rate schedules: linear warmup then cosine decay.
//!
//! For step `s` (counting from 0), with `W = warmup_steps` and `T = total_steps`:
//!
//! * `s < W`: linear warmup, `base_lr · (s + 1) / W` — the line from 0 (at step −1) that reaches
//!   `base_lr` at step `W − 1`, so the very first step already learns;
//! * `W ≤ s < T`: cosine decay, `min_lr + ½(base_lr − min_lr)(1 + cos(π (s − W) / (T − W)))`,
//!   which is `base_lr` at `s = W` and approaches `min_lr` as `s → T`;
//! * `s ≥ T`: constant `min_lr`.
//!
//! [`LrSchedule::constant`] is the degenerate case `base_lr = min_lr`, no warmup.

use serde::{Deserialize, Serialize};

/// A schedule that is out of range.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("invalid learning-rate schedule: {0}")]
pub struct LrScheduleError(pub String);

/// Linear warmup followed by cosine decay to a floor.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct LrSchedule {
    /// Peak learning rate, reached at the end of warmup.
    pub base_lr: f32,
    /// Steps of linear warmup (0 for none).
    pub warmup_steps: u64,
    /// Step at which the cosine reaches `min_lr`; the rate stays there afterwards.
    pub total_steps: u64,
    /// Final learning rate.
    pub min_lr: f32,
}

impl LrSchedule {
    /// The same rate at every step.
    pub fn constant(lr: f32) -> Self {
        Self {
            base_lr: lr,
            warmup_steps: 0,
            total_steps: 0,
            min_lr: lr,
        }
    }

    /// Checks `0 ≤ min_lr ≤ base_lr` (both finite) and `warmup_steps ≤ total_steps`, unless the
    /// schedule is constant.
    pub fn validate(&self) -> Result<(), LrScheduleError> {
        if !(self.base_lr.is_finite()
            && self.min_lr.is_finite()
            && 0.0 <= self.min_lr
            && self.min_lr <= self.base_lr)
        {
            return Err(LrScheduleError(format!(
                "need 0 ≤ min_lr ({}) ≤ base_lr ({}), both finite",
                self.min_lr, self.base_lr
            )));
        }
        if self.warmup_steps > self.total_steps && self.min_lr != self.base_lr {
            return Err(LrScheduleError(format!(
                "warmup_steps ({}) exceed total_steps ({})",
                self.warmup_steps, self.total_steps
            )));
        }
        Ok(())
    }

    /// The learning rate for step `step` (0-based).
    pub fn lr_at(&self, step: u64) -> f32 {
        if step < self.warmup_steps {
            return (f64::from(self.base_lr) * (step + 1) as f64 / self.warmup_steps as f64) as f32;
        }
        if step >= self.total_steps {
            return self.min_lr;
        }
        let progress =
            (step - self.warmup_steps) as f64 / (self.total_steps - self.warmup_steps) as f64;
        let (base, floor) = (f64::from(self.base_lr), f64::from(self.min_lr));
        let lr = floor + 0.5 * (base - floor) * (1.0 + (std::f64::consts::PI * progress).cos());
        // Rounding to f32 must not step outside [min_lr, base_lr].
        (lr as f32).clamp(self.min_lr, self.base_lr)
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn hand_checked_points() {
        let schedule = LrSchedule {
            base_lr: 1.0,
            warmup_steps: 4,
            total_steps: 104,
            min_lr: 0.1,
        };
        assert!(schedule.validate().is_ok());
        assert_eq!(schedule.lr_at(0), 0.25);
        assert_eq!(schedule.lr_at(3), 1.0);
        assert_eq!(schedule.lr_at(4), 1.0);
        assert!(
            (schedule.lr_at(54) - 0.55).abs() < 1e-6,
            "half way: the mid point"
        );
        assert!(
            (schedule.lr_at(79) - (0.1 + 0.45 * (1.0 + (0.75 * std::f32::consts::PI).cos()))).abs()
                < 1e-6
        );
        assert_eq!(schedule.lr_at(104), 0.1);
        assert_eq!(schedule.lr_at(10_000), 0.1);
        let constant = LrSchedule::constant(0.03);
        assert!(constant.validate().is_ok());
        assert!([0, 1, 1000]
            .iter()
            .all(|&step| constant.lr_at(step) == 0.03));
    }

    #[test]
    fn validate_rejects_inverted_or_negative_rates() {
        assert!(LrSchedule {
            base_lr: 0.1,
            warmup_steps: 0,
            total_steps: 10,
            min_lr: 0.2
        }
        .validate()
        .is_err());
        assert!(LrSchedule {
            base_lr: 0.1,
            warmup_steps: 0,
            total_steps: 10,
            min_lr: -0.1
        }
        .validate()
        .is_err());
        assert!(LrSchedule {
            base_lr: 0.1,
            warmup_steps: 20,
            total_steps: 10,
            min_lr: 0.0
        }
        .validate()
        .is_err());
    }

    proptest! {
        #[test]
        fn warmup_rises_then_never_increases_and_stays_in_range(
            base_lr in 1e-5f32..10.0, floor_fraction in 0.0f32..1.0, warmup_steps in 0u64..50, decay_steps in 1u64..500,
        ) {
            let schedule = LrSchedule { base_lr, warmup_steps, total_steps: warmup_steps + decay_steps, min_lr: base_lr * floor_fraction };
            prop_assert!(schedule.validate().is_ok());
            let end = schedule.total_steps + 10;
            let rates: Vec<f32> = (0..end).map(|step| schedule.lr_at(step)).collect();
            for step in 1..end as usize {
                let (previous, current) = (rates[step - 1], rates[step]);
                if (step as u64) < warmup_steps {
                    prop_assert!(current > previous, "warmup must rise at step {}", step);
                } else {
                    prop_assert!(current <= previous, "must not increase at step {}: {} > {}", step, current, previous);
                }
            }
            for (step, &rate) in rates.iter().enumerate() {
                prop_assert!(rate >= 0.0 && rate <= base_lr);
                if (step as u64) < warmup_steps {
                    prop_assert!(rate > 0.0);
                }
                if step as u64 >= warmup_steps {
                    prop_assert!(rate >= schedule.min_lr && rate <= base_lr);
                }
            }
            if warmup_steps > 0 {
                prop_assert_eq!(rates[warmup_steps as usize - 1], base_lr);
            }
            prop_assert_eq!(rates[schedule.total_steps as usize], schedule.min_lr);
        }
    }
}
