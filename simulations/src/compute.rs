//! Compute model: how long a node's forward and backward take in virtual time, per layer.
//!
//! A device class has a sustained throughput (FLOP/s actually achieved on this kind of model,
//! not the datasheet peak) and a fixed per-layer launch overhead. A layer's forward time is
//! `2 · MACs · batch / flops + overhead`, its backward twice the forward (input and weight
//! gradients). Stragglers multiply every time by `slowdown` and add uniform jitter of up to
//! `jitter` (a fraction) per step. Scenarios define their own classes (`flops`,
//! `layer_overhead_s`); `dreamddp simulate SCENARIO --measure-device NAME` measures the
//! scenario's model on this machine's built-in backend and prints such a class, so runs stay
//! replayable (the numbers live in the scenario text). Not built yet: per-layer times given
//! explicitly in a scenario.

use serde::{Deserialize, Serialize};

use crate::rng::SimRng;

/// A device class (`a100`, `h100`, `jetson-orin`, `cpu-16c`, or one defined in a scenario).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeviceClass {
    /// Sustained FLOP/s on small dense models (well below the datasheet peak).
    pub flops: f64,
    /// Fixed seconds per layer per pass (kernel launches, framework overhead).
    #[serde(default)]
    pub layer_overhead_s: f64,
}

impl DeviceClass {
    /// The built-in classes. Sustained rates for small models are a fraction of peak:
    /// these are deliberately conservative, round numbers.
    pub fn builtin(name: &str) -> Option<DeviceClass> {
        let (flops, overhead) = match name {
            "h100" => (200e12, 20e-6),
            "a100" => (100e12, 20e-6),
            "v100" => (50e12, 25e-6),
            "rtx3090" => (40e12, 25e-6),
            "jetson-orin" => (5e12, 60e-6),
            "jetson-nano" => (0.25e12, 150e-6),
            "cpu-16c" => (1e12, 5e-6),
            "cpu-4c" => (0.25e12, 5e-6),
            _ => return None,
        };
        Some(DeviceClass {
            flops,
            layer_overhead_s: overhead,
        })
    }

    /// Names of the built-in classes, for error messages.
    pub const BUILTIN: &'static [&'static str] = &[
        "h100",
        "a100",
        "v100",
        "rtx3090",
        "jetson-orin",
        "jetson-nano",
        "cpu-16c",
        "cpu-4c",
    ];

    /// Forward seconds of a layer with `macs_per_sample` at `batch`.
    pub fn forward_s(&self, macs_per_sample: u64, batch: usize) -> f64 {
        2.0 * macs_per_sample as f64 * batch as f64 / self.flops + self.layer_overhead_s
    }

    /// Backward seconds (input + weight gradients: twice the forward work).
    pub fn backward_s(&self, macs_per_sample: u64, batch: usize) -> f64 {
        4.0 * macs_per_sample as f64 * batch as f64 / self.flops + self.layer_overhead_s
    }
}

/// Per-layer compute times of one training step on one device (layers in forward order).
#[derive(Clone, Debug, PartialEq)]
pub struct StepTimes {
    /// Forward seconds per layer.
    pub forward_s: Vec<f64>,
    /// Backward seconds per layer.
    pub backward_s: Vec<f64>,
}

impl StepTimes {
    /// Times from per-layer MACs per sample on `device` at `batch`.
    pub fn from_macs(device: &DeviceClass, macs_per_sample: &[u64], batch: usize) -> Self {
        Self {
            forward_s: macs_per_sample
                .iter()
                .map(|m| device.forward_s(*m, batch))
                .collect(),
            backward_s: macs_per_sample
                .iter()
                .map(|m| device.backward_s(*m, batch))
                .collect(),
        }
    }

    /// Total forward seconds.
    pub fn forward_total(&self) -> f64 {
        self.forward_s.iter().sum()
    }

    /// Total backward seconds.
    pub fn backward_total(&self) -> f64 {
        self.backward_s.iter().sum()
    }

    /// A copy scaled by `factor` (straggler slowdown × jitter).
    pub fn scaled(&self, factor: f64) -> Self {
        Self {
            forward_s: self.forward_s.iter().map(|t| t * factor).collect(),
            backward_s: self.backward_s.iter().map(|t| t * factor).collect(),
        }
    }
}

/// Straggler model of one node: a constant slowdown and per-step uniform jitter.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct Straggler {
    /// Multiplies every compute time (1.0 = nominal).
    #[serde(default = "one")]
    pub slowdown: f64,
    /// Up to this fraction extra per step, uniformly drawn (0.1 = up to +10%).
    #[serde(default)]
    pub jitter: f64,
}

fn one() -> f64 {
    1.0
}

impl Straggler {
    /// The factor for one step.
    pub fn factor(&self, rng: &mut SimRng) -> f64 {
        let s = if self.slowdown > 0.0 {
            self.slowdown
        } else {
            1.0
        };
        s * (1.0 + self.jitter.max(0.0) * rng.next_f64())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builtin_classes_order_by_speed() {
        let h = DeviceClass::builtin("h100").expect("h100");
        let j = DeviceClass::builtin("jetson-orin").expect("orin");
        assert!(h.forward_s(1_000_000, 32) < j.forward_s(1_000_000, 32));
        assert!(DeviceClass::builtin("tpu-v9").is_none());
        for n in DeviceClass::BUILTIN {
            assert!(DeviceClass::builtin(n).is_some(), "{n}");
        }
    }

    #[test]
    fn backward_is_twice_forward_work() {
        let d = DeviceClass {
            flops: 1e9,
            layer_overhead_s: 0.0,
        };
        let t = StepTimes::from_macs(&d, &[1000, 2000], 10);
        assert!((t.forward_s[0] - 2e-5).abs() < 1e-12);
        assert!((t.backward_total() - 2.0 * t.forward_total()).abs() < 1e-12);
        assert!((t.scaled(2.0).forward_total() - 2.0 * t.forward_total()).abs() < 1e-12);
    }

    #[test]
    fn straggler_jitter_stays_in_range() {
        let s = Straggler {
            slowdown: 2.0,
            jitter: 0.5,
        };
        let mut rng = SimRng::new(3);
        for _ in 0..1000 {
            let f = s.factor(&mut rng);
            assert!((2.0..=3.0).contains(&f), "{f}");
        }
    }
}
