//! How a parameter average lands in a replica: replaced, rebased onto the progress made while
//! it was in flight, or taken as the pseudo-gradient of an outer optimizer (DiLoCo).
//!
//! * [`Landing::Replace`]: the layer's values become the average (Local SGD, DreamDDP landing
//!   before the layer's next optimizer step, so no local progress is lost).
//! * [`Landing::Rebase`]: `values ← average + (values − cut)`, where `cut` is what this replica
//!   sent. The replica keeps the local steps it took while the average was in flight (DreamDDP
//!   with a delay of more than one step; the same rule as the cross-site path).
//! * [`Landing::Outer`]: DiLoCo (Douillard et al., 2023) and Streaming DiLoCo (Douillard et
//!   al., 2025), as torchft's `local_sgd.py` implements them. Every replica holds the same
//!   *anchor* (the global parameters of the last outer step) and outer momentum per layer. The
//!   pseudo-gradient is `g = anchor − average` (the mean of the replicas' `anchor − values`),
//!   the outer step is SGD with Nesterov momentum as PyTorch's `SGD(nesterov=True)` computes it
//!   (`m ← μ·m + g`, `anchor ← anchor − lr·(g + μ·m)`), and the replica's values become
//!   `mix·values + (1 − mix)·anchor` (`mix` is Streaming DiLoCo's α; 0 for DiLoCo, where the
//!   values are replaced by the new anchor).
//!
//! [`OuterState`] holds the anchors and momenta of one replica; every replica of a run starts
//! from the same values and sees the same averages, so their anchors stay identical.

use serde::{Deserialize, Serialize};

/// Hyperparameters of the outer optimizer and of the landing of a fragment.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OuterConfig {
    /// Outer learning rate (DiLoCo: 0.7).
    #[serde(default = "default_outer_lr")]
    pub lr: f32,
    /// Outer Nesterov momentum (DiLoCo: 0.9).
    #[serde(default = "default_outer_momentum")]
    pub momentum: f32,
    /// Streaming DiLoCo's α: the weight of the local values when a fragment lands (the paper
    /// uses 0.5; 0 replaces them by the new global values).
    #[serde(default = "default_mix")]
    pub mix: f32,
}

fn default_outer_lr() -> f32 {
    0.7
}
fn default_outer_momentum() -> f32 {
    0.9
}
fn default_mix() -> f32 {
    0.5
}

impl Default for OuterConfig {
    fn default() -> Self {
        Self {
            lr: default_outer_lr(),
            momentum: default_outer_momentum(),
            mix: default_mix(),
        }
    }
}

/// An [`OuterConfig`] value outside its range.
#[derive(Debug, thiserror::Error, Clone, PartialEq)]
#[error("{what} = {got} is out of range: {range}")]
pub struct OuterConfigError {
    /// The setting (`outer_lr`, `outer_momentum`, `mix`).
    pub what: &'static str,
    /// The value given.
    pub got: f32,
    /// What is allowed.
    pub range: &'static str,
}

impl OuterConfig {
    /// Checks every field: `lr > 0` and finite, `momentum` and `mix` in `[0, 1)` / `[0, 1]`.
    pub fn validate(&self) -> Result<(), OuterConfigError> {
        let bad = |what, got, range| Err(OuterConfigError { what, got, range });
        if !(self.lr.is_finite() && self.lr > 0.0) {
            return bad("outer_lr", self.lr, "a finite number > 0");
        }
        if !(0.0..1.0).contains(&self.momentum) {
            return bad("outer_momentum", self.momentum, "0 <= momentum < 1");
        }
        if !(0.0..=1.0).contains(&self.mix) {
            return bad("mix", self.mix, "0 <= mix <= 1");
        }
        Ok(())
    }
}

/// How an average is written into a layer (see the module doc).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Landing {
    /// `values ← average`.
    Replace,
    /// `values ← average + (values − cut)`.
    Rebase,
    /// Outer Nesterov step on the pseudo-gradient, then `values ← mix·values + (1 − mix)·anchor`.
    Outer {
        /// Weight of the local values.
        mix: f32,
    },
}

impl Landing {
    /// True when the driver must keep a copy of what it sent (the cut) until the landing.
    pub fn needs_cut(self) -> bool {
        self == Landing::Rebase
    }
}

/// `values ← average + (values − cut)`, element by element.
pub fn rebase(average: &[f32], cut: &[f32], values: &mut [f32]) {
    assert!(average.len() == values.len() && cut.len() == values.len());
    for ((v, &a), &c) in values.iter_mut().zip(average).zip(cut) {
        *v = a + (*v - c);
    }
}

/// The outer optimizer state of one replica: per model layer an anchor and a momentum.
#[derive(Clone, Debug)]
pub struct OuterState {
    lr: f32,
    momentum: f32,
    anchors: Vec<Option<Vec<f32>>>,
    moments: Vec<Vec<f32>>,
}

impl OuterState {
    /// An empty state for `layer_count` keys: the sync units of a plan, by unit id (a whole
    /// layer, or one chunk of a split layer, has its own anchor and momentum).
    pub fn new(config: &OuterConfig, layer_count: usize) -> Self {
        Self {
            lr: config.lr,
            momentum: config.momentum,
            anchors: vec![None; layer_count],
            moments: vec![Vec::new(); layer_count],
        }
    }

    /// Sets layer `layer`'s anchor to `values` (the replicas' common starting point).
    pub fn set_anchor(&mut self, layer: usize, values: &[f32]) {
        self.anchors[layer] = Some(values.to_vec());
        self.moments[layer] = vec![0.0; values.len()];
    }

    /// Layer `layer`'s anchor, if set.
    pub fn anchor(&self, layer: usize) -> Option<&[f32]> {
        self.anchors.get(layer)?.as_deref()
    }

    /// One outer step of layer `layer` from `average` (the mean of the replicas' values at the
    /// cut), then `values ← mix·values + (1 − mix)·anchor`.
    ///
    /// # Panics
    /// When the layer has no anchor or the lengths differ: a driver bug, not bad input.
    pub fn land(&mut self, layer: usize, average: &[f32], values: &mut [f32], mix: f32) {
        let anchor = self.anchors[layer]
            .as_mut()
            .expect("the outer anchor is set before the first landing");
        let m = &mut self.moments[layer];
        assert!(anchor.len() == average.len() && values.len() == average.len());
        let (lr, mu) = (self.lr, self.momentum);
        for i in 0..anchor.len() {
            let g = anchor[i] - average[i];
            m[i] = mu * m[i] + g;
            anchor[i] -= lr * (g + mu * m[i]);
            values[i] = mix * values[i] + (1.0 - mix) * anchor[i];
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn outer_lr_one_without_momentum_is_plain_averaging() {
        let cfg = OuterConfig {
            lr: 1.0,
            momentum: 0.0,
            mix: 0.0,
        };
        let mut s = OuterState::new(&cfg, 1);
        s.set_anchor(0, &[1.0, 2.0]);
        let mut values = [5.0, -3.0];
        s.land(0, &[0.5, 2.5], &mut values, 0.0);
        assert_eq!(values, [0.5, 2.5]);
        assert_eq!(s.anchor(0).unwrap(), &[0.5, 2.5]);
    }

    #[test]
    fn nesterov_matches_pytorch_sgd_over_two_steps() {
        // torch.optim.SGD([p], lr=0.7, momentum=0.9, nesterov=True) with p.grad = anchor - avg:
        // step 1: g=1, buf=1, p = 10 - 0.7*(1+0.9*1) = 8.67
        // step 2: avg=8.17 → g=0.5, buf=0.9+0.5=1.4, p = 8.67 - 0.7*(0.5+0.9*1.4) = 7.438
        let mut s = OuterState::new(&OuterConfig::default(), 1);
        s.set_anchor(0, &[10.0]);
        let mut v = [0.0];
        s.land(0, &[9.0], &mut v, 0.0);
        assert!((v[0] - 8.67).abs() < 1e-5, "{}", v[0]);
        s.land(0, &[8.17], &mut v, 0.0);
        assert!((v[0] - 7.438).abs() < 1e-4, "{}", v[0]);
    }

    #[test]
    fn mix_keeps_that_share_of_the_local_values() {
        let cfg = OuterConfig {
            lr: 1.0,
            momentum: 0.0,
            mix: 0.5,
        };
        let mut s = OuterState::new(&cfg, 1);
        s.set_anchor(0, &[0.0]);
        let mut v = [4.0];
        s.land(0, &[2.0], &mut v, cfg.mix);
        assert_eq!(v, [3.0]);
    }

    #[test]
    fn bad_settings_are_named() {
        let mut c = OuterConfig {
            momentum: 1.0,
            ..OuterConfig::default()
        };
        assert_eq!(c.validate().unwrap_err().what, "outer_momentum");
        c = OuterConfig {
            lr: f32::NAN,
            ..OuterConfig::default()
        };
        assert_eq!(c.validate().unwrap_err().what, "outer_lr");
        c = OuterConfig {
            mix: 1.5,
            ..OuterConfig::default()
        };
        assert_eq!(c.validate().unwrap_err().what, "mix");
        assert!(OuterConfig::default().validate().is_ok());
    }

    proptest! {
        #[test]
        fn rebase_keeps_the_local_progress(
            xs in proptest::collection::vec((-100.0f32..100.0, -100.0f32..100.0, -1.0f32..1.0), 1..64)
        ) {
            let average: Vec<f32> = xs.iter().map(|x| x.0).collect();
            let cut: Vec<f32> = xs.iter().map(|x| x.1).collect();
            let progress: Vec<f32> = xs.iter().map(|x| x.2).collect();
            let mut values: Vec<f32> = cut.iter().zip(&progress).map(|(c, p)| c + p).collect();
            rebase(&average, &cut, &mut values);
            for i in 0..values.len() {
                prop_assert!((values[i] - (average[i] + progress[i])).abs() < 1e-3);
            }
        }

        #[test]
        fn identical_replicas_keep_identical_anchors(
            start in proptest::collection::vec(-10.0f32..10.0, 1..16),
            steps in proptest::collection::vec(proptest::collection::vec(-1.0f32..1.0, 16), 1..6),
        ) {
            let cfg = OuterConfig::default();
            let mut a = OuterState::new(&cfg, 1);
            let mut b = OuterState::new(&cfg, 1);
            a.set_anchor(0, &start);
            b.set_anchor(0, &start);
            let n = start.len();
            let mut va = vec![0.0; n];
            let mut vb = vec![1.0; n];
            for d in &steps {
                let avg: Vec<f32> = a.anchor(0).unwrap().iter().zip(d).map(|(x, y)| x + y).collect();
                a.land(0, &avg, &mut va, 0.3);
                b.land(0, &avg, &mut vb, 0.3);
                prop_assert_eq!(a.anchor(0).unwrap(), b.anchor(0).unwrap());
            }
        }
    }
}
