//! Compute model: how long a node's forward and backward take in virtual time, per layer.
//!
//! # Device classes
//! A device class gives each layer of the model a forward and a backward time for one step.
//! Two sources, mixable per layer:
//! * **FLOP-derived** ([`DeviceClass`]): a sustained throughput (FLOP/s actually achieved on
//!   this kind of model, not the datasheet peak) and a fixed per-layer launch overhead. A
//!   layer's forward time is `2 · MACs · batch / flops + overhead`, its backward twice the
//!   forward work (input and weight gradients).
//! * **Given per layer** ([`LayerTimes`]): milliseconds for one step at the class's `batch`
//!   (default: the scenario's batch), written in the scenario or measured on this machine by
//!   `dreamddp simulate SCENARIO --measure-device NAME`. A node stepping a different number of
//!   samples scales them linearly. Given times override the FLOP-derived ones layer by layer.
//!
//! [`DeviceRegistry`] is the one place a device name is looked up: the built-in classes
//! ([`DeviceClass::BUILTIN`]) plus the scenario's `[devices.NAME]` tables ([`DeviceSpec`]),
//! shared by every kind of scenario. [`Device::step_times`] turns a resolved class into
//! [`StepTimes`] for a model and checks the per-layer names against it.
//!
//! Stragglers ([`Straggler`]) multiply every time by `slowdown` and add uniform jitter of up to
//! `jitter` (a fraction) per step. Nothing here reads a clock: measured numbers enter only
//! through the scenario text, so a run replays exactly.

use std::collections::BTreeMap;

use engine::model::Model;
use node::task::{ModelKind, Task};
use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::rng::SimRng;

/// A FLOP-rate device class: the built-in ones (`a100`, `h100`, `jetson-orin`, `cpu-16c`, …) and
/// the rate part of a scenario's [`DeviceSpec`].
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

/// Given (or measured) times of one layer for one step at its class's reference batch.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LayerTimes {
    /// Forward milliseconds (the last layer's includes the loss when measured).
    pub forward_ms: f64,
    /// Backward milliseconds (input and weight gradients).
    pub backward_ms: f64,
}

/// A device class as a scenario defines it in `[devices.NAME]`: a FLOP rate, per-layer times,
/// or both (per-layer times win for the layers they name; the rate covers the others).
///
/// ```toml
/// [devices.my-gpu]
/// flops = 20e12                 # optional when every layer has times
/// layer_overhead_s = 1e-4       # added per layer to FLOP-derived times (default 0)
/// batch = 32                    # samples per step the layer times hold for (default: scenario batch)
/// [devices.my-gpu.layers]       # optional; names are the model's layer names
/// fc1 = { forward_ms = 0.21, backward_ms = 0.40 }
/// head = { forward_ms = 0.02, backward_ms = 0.03 }
/// ```
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeviceSpec {
    /// Sustained FLOP/s for layers without given times.
    #[serde(default)]
    pub flops: Option<f64>,
    /// Fixed seconds per layer per pass added to FLOP-derived times.
    #[serde(default)]
    pub layer_overhead_s: f64,
    /// Samples per step that `layers` holds times for (default: the scenario's batch).
    #[serde(default)]
    pub batch: Option<usize>,
    /// Per-layer times by layer name.
    #[serde(default)]
    pub layers: BTreeMap<String, LayerTimes>,
}

impl From<DeviceClass> for DeviceSpec {
    fn from(class: DeviceClass) -> Self {
        DeviceSpec {
            flops: Some(class.flops),
            layer_overhead_s: class.layer_overhead_s,
            batch: None,
            layers: BTreeMap::new(),
        }
    }
}

impl DeviceSpec {
    /// The FLOP-rate part, when a rate is given.
    pub fn rate(&self) -> Option<DeviceClass> {
        self.flops.map(|flops| DeviceClass {
            flops,
            layer_overhead_s: self.layer_overhead_s,
        })
    }

    /// Checks every value; errors name the dotted key under `key` (e.g. `devices.my-gpu`).
    pub fn validate(&self, key: &str) -> Result<(), ComputeError> {
        if let Some(flops) = self.flops {
            if !(flops.is_finite() && flops > 0.0) {
                return Err(compute_error(
                    format!("{key}.flops"),
                    format!("must be a positive number, got {flops}"),
                ));
            }
        }
        if !(self.layer_overhead_s.is_finite() && self.layer_overhead_s >= 0.0) {
            return Err(compute_error(
                format!("{key}.layer_overhead_s"),
                format!(
                    "must be a non-negative number, got {}",
                    self.layer_overhead_s
                ),
            ));
        }
        if self.batch == Some(0) {
            return Err(compute_error(format!("{key}.batch"), "must be at least 1"));
        }
        if self.flops.is_none() && self.layers.is_empty() {
            return Err(compute_error(
                key,
                "give flops, per-layer times ([…layers]), or both",
            ));
        }
        for (name, t) in &self.layers {
            for (field, v) in [("forward_ms", t.forward_ms), ("backward_ms", t.backward_ms)] {
                if !(v.is_finite() && v >= 0.0) {
                    return Err(compute_error(
                        format!("{key}.layers.{name}.{field}"),
                        format!("must be a non-negative number of milliseconds, got {v}"),
                    ));
                }
            }
        }
        Ok(())
    }
}

/// A device class that is unknown, out of range, or does not fit the model.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
#[error("{key}: {problem}")]
pub struct ComputeError {
    /// Dotted key, e.g. `devices.my-gpu.layers.fc9`.
    pub key: String,
    /// What is wrong and what is allowed.
    pub problem: String,
}

fn compute_error(key: impl Into<String>, problem: impl Into<String>) -> ComputeError {
    ComputeError {
        key: key.into(),
        problem: problem.into(),
    }
}

/// Every device class a scenario may name: the built-in ones and the scenario's own
/// (`[devices.NAME]`, plus the older `[clusters.devices.NAME]`), which shadow built-ins of the
/// same name. Deserializes from the `[devices]` table.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(from = "BTreeMap<String, DeviceSpec>")]
pub struct DeviceRegistry {
    /// Scenario classes by name, with the table key they came from.
    custom: BTreeMap<String, (String, DeviceSpec)>,
}

impl From<BTreeMap<String, DeviceSpec>> for DeviceRegistry {
    fn from(table: BTreeMap<String, DeviceSpec>) -> Self {
        DeviceRegistry {
            custom: table
                .into_iter()
                .map(|(name, spec)| (name.clone(), (format!("devices.{name}"), spec)))
                .collect(),
        }
    }
}

impl DeviceRegistry {
    /// Adds a class defined under `table` (e.g. `clusters.devices`); a name defined twice is
    /// an error naming both places.
    pub fn add(&mut self, table: &str, name: &str, spec: DeviceSpec) -> Result<(), ComputeError> {
        let key = format!("{table}.{name}");
        if let Some((first, _)) = self.custom.get(name) {
            return Err(compute_error(
                key,
                format!("device class '{name}' is already defined as {first}"),
            ));
        }
        self.custom.insert(name.to_string(), (key, spec));
        Ok(())
    }

    /// Checks every scenario class (see [`DeviceSpec::validate`]).
    pub fn validate(&self) -> Result<(), ComputeError> {
        self.custom
            .values()
            .try_for_each(|(key, spec)| spec.validate(key))
    }

    /// The scenario's own classes by name.
    pub fn custom(&self) -> impl Iterator<Item = (&str, &DeviceSpec)> {
        self.custom.iter().map(|(n, (_, s))| (n.as_str(), s))
    }

    /// Every name that resolves: built-in classes, then the scenario's.
    pub fn names(&self) -> Vec<&str> {
        let mut names: Vec<&str> = DeviceClass::BUILTIN.to_vec();
        names.extend(
            self.custom
                .keys()
                .map(String::as_str)
                .filter(|n| !DeviceClass::BUILTIN.contains(n)),
        );
        names
    }

    /// Resolves `name` (a scenario class first, then a built-in one). `scenario_batch` is the
    /// reference batch of per-layer times that do not set their own. Errors are keyed by `key`,
    /// the referring key (e.g. `edge.devices.device`), and list the known names.
    pub fn resolve(
        &self,
        name: &str,
        scenario_batch: usize,
        key: &str,
    ) -> Result<Device, ComputeError> {
        if let Some((spec_key, spec)) = self.custom.get(name) {
            return Ok(Device {
                name: name.to_string(),
                key: spec_key.clone(),
                rate: spec.rate(),
                reference_batch: spec.batch.unwrap_or(scenario_batch).max(1),
                layers: spec.layers.clone(),
            });
        }
        DeviceClass::builtin(name)
            .map(|rate| Device::from_rate(name, rate))
            .ok_or_else(|| {
                compute_error(
                    key,
                    format!(
                        "unknown device class '{name}' (known: {})",
                        self.names().join(", ")
                    ),
                )
            })
    }
}

/// A resolved device class: FLOP-derived times for layers without given ones.
#[derive(Clone, Debug, PartialEq)]
pub struct Device {
    /// Class name.
    pub name: String,
    /// Table key the class came from (`devices.NAME`), for errors; `NAME` for built-ins.
    pub key: String,
    /// FLOP rate, when given.
    pub rate: Option<DeviceClass>,
    /// Samples per step that `layers` holds times for.
    pub reference_batch: usize,
    /// Given per-layer times by layer name.
    pub layers: BTreeMap<String, LayerTimes>,
}

/// One layer as the compute model sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayerCost {
    /// Layer name (unique in the model).
    pub name: String,
    /// Forward multiply-accumulates per sample (per sequence for language models).
    pub macs_per_sample: u64,
}

/// Per-layer costs of `model` in forward order. For gpt-tiny a sample is a sequence of
/// `context` tokens (its layers count MACs per token).
pub fn layer_costs(model: &Model, task: &Task) -> Vec<LayerCost> {
    let tokens = match (&task.model, &task.gpt) {
        (ModelKind::GptTiny, Some(g)) => g.context as u64,
        _ => 1,
    };
    model
        .layers
        .iter()
        .map(|l| LayerCost {
            name: l.name.clone(),
            macs_per_sample: l.layer.forward_macs_per_sample() * tokens,
        })
        .collect()
}

impl Device {
    /// A class that is only a FLOP rate.
    pub fn from_rate(name: &str, rate: DeviceClass) -> Device {
        Device {
            name: name.to_string(),
            key: name.to_string(),
            rate: Some(rate),
            reference_batch: 1,
            layers: BTreeMap::new(),
        }
    }

    /// Times of one step of `batch` samples over `layers` (forward order): the given time of a
    /// layer (scaled by `batch / reference_batch`) where there is one, else FLOP-derived.
    /// A given layer the model does not have, or a layer with neither a given time nor a
    /// rate, is an error naming the key and listing the model's layer names.
    pub fn step_times(
        &self,
        layers: &[LayerCost],
        batch: usize,
    ) -> Result<StepTimes, ComputeError> {
        let model_names = || {
            layers
                .iter()
                .map(|l| l.name.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        };
        if let Some(unknown) = self
            .layers
            .keys()
            .find(|n| !layers.iter().any(|l| &l.name == *n))
        {
            return Err(compute_error(
                format!("{}.layers.{unknown}", self.key),
                format!(
                    "the model has no layer '{unknown}' (its layers: {})",
                    model_names()
                ),
            ));
        }
        let scale = batch as f64 / self.reference_batch as f64;
        let mut times = StepTimes {
            forward_s: Vec::with_capacity(layers.len()),
            backward_s: Vec::with_capacity(layers.len()),
        };
        let mut missing = Vec::new();
        for l in layers {
            let (f, b) = match (self.layers.get(&l.name), &self.rate) {
                (Some(t), _) => (t.forward_ms * 1e-3 * scale, t.backward_ms * 1e-3 * scale),
                (None, Some(rate)) => (
                    rate.forward_s(l.macs_per_sample, batch),
                    rate.backward_s(l.macs_per_sample, batch),
                ),
                (None, None) => {
                    missing.push(l.name.as_str());
                    (0.0, 0.0)
                }
            };
            times.forward_s.push(f);
            times.backward_s.push(b);
        }
        if !missing.is_empty() {
            return Err(compute_error(
                format!("{}.layers", self.key),
                format!(
                    "no flops given, so every layer needs times; missing: {} (the model's layers: {})",
                    missing.join(", "),
                    model_names()
                ),
            ));
        }
        Ok(times)
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

    fn costs(names_macs: &[(&str, u64)]) -> Vec<LayerCost> {
        names_macs
            .iter()
            .map(|(n, m)| LayerCost {
                name: n.to_string(),
                macs_per_sample: *m,
            })
            .collect()
    }

    fn registry(toml_text: &str) -> DeviceRegistry {
        let table: BTreeMap<String, DeviceSpec> = toml::from_str(toml_text).expect("parses");
        let r = DeviceRegistry::from(table);
        r.validate().expect("valid");
        r
    }

    #[test]
    fn given_layer_times_override_flop_derived_ones() {
        let r = registry(
            r#"
[mixed]
flops = 1e9
layer_overhead_s = 1e-6
batch = 8
[mixed.layers]
fc1 = { forward_ms = 2.0, backward_ms = 5.0 }
"#,
        );
        let d = r.resolve("mixed", 32, "k").expect("resolves");
        assert_eq!(
            d.reference_batch, 8,
            "the class's batch wins over the scenario's"
        );
        let layers = costs(&[("fc1", 1000), ("relu", 0), ("head", 500)]);
        let t = d.step_times(&layers, 16).expect("fits the model");
        // fc1: given at batch 8, stepped at 16 → doubled.
        assert!((t.forward_s[0] - 4e-3).abs() < 1e-15, "{:?}", t);
        assert!((t.backward_s[0] - 10e-3).abs() < 1e-15, "{:?}", t);
        // The others: from the rate, exactly as the FLOP-only class computes them.
        let rate = DeviceClass {
            flops: 1e9,
            layer_overhead_s: 1e-6,
        };
        let flop_only = StepTimes::from_macs(&rate, &[1000, 0, 500], 16);
        assert_eq!(t.forward_s[1..], flop_only.forward_s[1..]);
        assert_eq!(t.backward_s[1..], flop_only.backward_s[1..]);
        assert_ne!(t.forward_s[0], flop_only.forward_s[0]);
    }

    #[test]
    fn layer_times_default_to_the_scenario_batch_and_need_no_rate_when_complete() {
        let r = registry("[timed.layers]\na = { forward_ms = 1.0, backward_ms = 2.0 }\nb = { forward_ms = 0.5, backward_ms = 0.0 }\n");
        let d = r.resolve("timed", 4, "k").expect("resolves");
        let t = d
            .step_times(&costs(&[("a", 7), ("b", 9)]), 4)
            .expect("complete");
        assert_eq!(t.forward_s, vec![1e-3, 0.5e-3]);
        assert_eq!(t.backward_s, vec![2e-3, 0.0]);
    }

    #[test]
    fn layer_names_are_checked_against_the_model() {
        let r = registry("[timed.layers]\nfc9 = { forward_ms = 1.0, backward_ms = 2.0 }\n");
        let d = r.resolve("timed", 4, "k").expect("resolves");
        let e = d
            .step_times(&costs(&[("fc1", 1), ("head", 1)]), 4)
            .expect_err("fc9 is not a layer");
        assert_eq!(e.key, "devices.timed.layers.fc9");
        assert!(e.problem.contains("its layers: fc1, head"), "{e}");

        let r = registry("[timed.layers]\nfc1 = { forward_ms = 1.0, backward_ms = 2.0 }\n");
        let d = r.resolve("timed", 4, "k").expect("resolves");
        let e = d
            .step_times(&costs(&[("fc1", 1), ("head", 1)]), 4)
            .expect_err("head has no time and there is no rate");
        assert_eq!(e.key, "devices.timed.layers");
        assert!(e.problem.contains("missing: head"), "{e}");
    }

    #[test]
    fn registry_resolves_custom_before_builtin_and_lists_names() {
        let mut r = registry("[my-gpu]\nflops = 2e9\n[a100]\nflops = 1.0\n");
        assert_eq!(
            r.resolve("a100", 1, "k").expect("shadowed").rate,
            Some(DeviceClass {
                flops: 1.0,
                layer_overhead_s: 0.0
            })
        );
        assert_eq!(
            r.resolve("h100", 1, "k").expect("built-in").rate,
            DeviceClass::builtin("h100")
        );
        let e = r
            .resolve("tpu", 1, "edge.cloud.device")
            .expect_err("unknown");
        assert_eq!(e.key, "edge.cloud.device");
        assert!(
            e.problem.starts_with("unknown device class 'tpu'")
                && e.problem.contains("jetson-orin")
                && e.problem.ends_with(", my-gpu)"),
            "{e}"
        );
        let e = r
            .add("clusters.devices", "my-gpu", DeviceSpec::default())
            .expect_err("defined twice");
        assert_eq!(e.key, "clusters.devices.my-gpu");
        assert!(
            e.problem.contains("already defined as devices.my-gpu"),
            "{e}"
        );
    }

    #[test]
    fn bad_values_name_their_key() {
        let bad = |text: &str| {
            let table: BTreeMap<String, DeviceSpec> = toml::from_str(text).expect("parses");
            DeviceRegistry::from(table)
                .validate()
                .expect_err("invalid")
                .to_string()
        };
        assert!(bad("[x]\nflops = -1.0\n").starts_with("devices.x.flops: must be a positive"));
        assert!(bad("[x]\nflops = 1.0\nlayer_overhead_s = -1.0\n")
            .starts_with("devices.x.layer_overhead_s:"));
        assert!(bad("[x]\nflops = 1.0\nbatch = 0\n").starts_with("devices.x.batch:"));
        assert!(bad("[x]\n").starts_with("devices.x: give flops"));
        assert!(
            bad("[x.layers]\nfc1 = { forward_ms = nan, backward_ms = 1.0 }\n")
                .starts_with("devices.x.layers.fc1.forward_ms:")
        );
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
