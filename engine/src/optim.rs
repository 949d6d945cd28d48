//! Per-layer optimizers: SGD with momentum and AdamW.
//!
//! DreamDDP updates each layer on its own (right after that layer's gradient or synchronization
//! is ready), so an optimizer here owns the state of *one layer's* parameters: a
//! [`LayerOptimizer`] is built from an [`OptimizerConfig`] and the layer's [`Param`]s and then
//! applies one update per [`LayerOptimizer::step`] from each parameter's `grad`.
//!
//! The update rules follow PyTorch (`torch.optim.SGD` with `dampening = 0`, `torch.optim.AdamW`):
//!
//! * **SGD**: `d = g + wd·θ`; with momentum `b ← μ·b + d` (the first step gives `b = d`), then
//!   `d = b`, or `d = d + μ·b` with Nesterov; `θ ← θ − lr·d`.
//! * **AdamW**: decoupled weight decay `θ ← θ·(1 − lr·wd)`, then `m ← β₁m + (1−β₁)g`,
//!   `v ← β₂v + (1−β₂)g²`, `θ ← θ − lr·m̂ / (√v̂ + ε)` with the bias corrections
//!   `m̂ = m / (1−β₁ᵗ)`, `v̂ = v / (1−β₂ᵗ)` (t counts this optimizer's steps from 1).
//!
//! **Weight decay applies only to parameters with two or more dimensions** (weight matrices and
//! convolution kernels). One-dimensional parameters — biases, LayerNorm/BatchNorm scales and
//! shifts — are never decayed, by either optimizer (the nanoGPT / common-practice grouping).
//!
//! `step` runs one tight loop per parameter and allocates nothing.

use serde::{Deserialize, Serialize};

use crate::layer::Param;

/// An optimizer configuration that is out of range.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("invalid optimizer configuration: {0}")]
pub struct OptimizerConfigError(pub String);

/// Which optimizer to use and its hyper-parameters (the learning rate comes from the schedule).
/// Serialized with a `kind` tag: `{"kind": "sgd", "momentum": 0.9, ...}` or `{"kind": "adamw", ...}`;
/// omitted fields take the defaults of [`OptimizerConfig::sgd`] / [`OptimizerConfig::adamw`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum OptimizerConfig {
    /// Stochastic gradient descent with (optionally Nesterov) momentum and L2 weight decay.
    Sgd {
        /// Momentum factor μ (0 disables the momentum buffer).
        #[serde(default = "default_momentum")]
        momentum: f32,
        /// L2 penalty added to the gradient of multi-dimensional parameters.
        #[serde(default)]
        weight_decay: f32,
        /// Nesterov momentum (needs `momentum > 0`).
        #[serde(default)]
        nesterov: bool,
    },
    /// Adam with decoupled weight decay.
    AdamW {
        /// Decay of the first-moment estimate.
        #[serde(default = "default_beta1")]
        beta1: f32,
        /// Decay of the second-moment estimate.
        #[serde(default = "default_beta2")]
        beta2: f32,
        /// Added to √v̂ for numerical stability.
        #[serde(default = "default_eps")]
        eps: f32,
        /// Decoupled weight decay of multi-dimensional parameters.
        #[serde(default = "default_adamw_weight_decay")]
        weight_decay: f32,
    },
}

fn default_momentum() -> f32 {
    0.9
}
fn default_beta1() -> f32 {
    0.9
}
fn default_beta2() -> f32 {
    0.999
}
fn default_eps() -> f32 {
    1e-8
}
fn default_adamw_weight_decay() -> f32 {
    0.01
}

impl Default for OptimizerConfig {
    /// SGD with momentum 0.9.
    fn default() -> Self {
        Self::sgd()
    }
}

impl OptimizerConfig {
    /// SGD, momentum 0.9, no weight decay, no Nesterov.
    pub fn sgd() -> Self {
        Self::Sgd {
            momentum: default_momentum(),
            weight_decay: 0.0,
            nesterov: false,
        }
    }

    /// AdamW with PyTorch's defaults: β = (0.9, 0.999), ε = 1e-8, weight decay 0.01.
    pub fn adamw() -> Self {
        Self::AdamW {
            beta1: default_beta1(),
            beta2: default_beta2(),
            eps: default_eps(),
            weight_decay: default_adamw_weight_decay(),
        }
    }

    /// Checks every hyper-parameter is in range (call when reading a configuration).
    pub fn validate(&self) -> Result<(), OptimizerConfigError> {
        let fail = |message: String| Err(OptimizerConfigError(message));
        let non_negative = |name: &str, value: f32| -> Result<(), OptimizerConfigError> {
            if value.is_finite() && value >= 0.0 {
                Ok(())
            } else {
                fail(format!("{name} = {value} must be finite and ≥ 0"))
            }
        };
        let unit = |name: &str, value: f32| -> Result<(), OptimizerConfigError> {
            if (0.0..1.0).contains(&value) {
                Ok(())
            } else {
                fail(format!("{name} = {value} must be in [0, 1)"))
            }
        };
        match *self {
            Self::Sgd {
                momentum,
                weight_decay,
                nesterov,
            } => {
                unit("momentum", momentum)?;
                non_negative("weight_decay", weight_decay)?;
                if nesterov && momentum == 0.0 {
                    return fail("nesterov needs momentum > 0".to_string());
                }
            }
            Self::AdamW {
                beta1,
                beta2,
                eps,
                weight_decay,
            } => {
                unit("beta1", beta1)?;
                unit("beta2", beta2)?;
                non_negative("weight_decay", weight_decay)?;
                if !(eps.is_finite() && eps > 0.0) {
                    return fail(format!("eps = {eps} must be finite and > 0"));
                }
            }
        }
        Ok(())
    }
}

/// Optimizer state of one parameter.
#[derive(Clone, Debug)]
struct ParamState {
    /// Whether weight decay applies (parameters with ≥ 2 dimensions).
    decays: bool,
    /// SGD momentum buffer or AdamW first moment (empty for plain SGD).
    first_moment: Vec<f32>,
    /// AdamW second moment (empty for SGD).
    second_moment: Vec<f32>,
}

/// The optimizer of one layer: its configuration plus per-parameter state.
#[derive(Clone, Debug)]
pub struct LayerOptimizer {
    config: OptimizerConfig,
    states: Vec<ParamState>,
    steps: u64,
}

impl LayerOptimizer {
    /// Zeroed state for `params` (the layer's parameters, in the order `step` will receive them).
    pub fn new(config: &OptimizerConfig, params: &[Param]) -> Self {
        let states = params
            .iter()
            .map(|param| {
                let (first, second) = match *config {
                    OptimizerConfig::Sgd { momentum, .. } => {
                        (if momentum != 0.0 { param.len() } else { 0 }, 0)
                    }
                    OptimizerConfig::AdamW { .. } => (param.len(), param.len()),
                };
                ParamState {
                    decays: param.shape.len() >= 2,
                    first_moment: vec![0.0; first],
                    second_moment: vec![0.0; second],
                }
            })
            .collect();
        Self {
            config: config.clone(),
            states,
            steps: 0,
        }
    }

    /// The configuration this optimizer was built with.
    pub fn config(&self) -> &OptimizerConfig {
        &self.config
    }

    /// Number of steps taken so far.
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// Applies one update with learning rate `lr` to every parameter from its `grad`.
    ///
    /// # Panics
    /// When `params` is not the list this optimizer was built for (count or sizes differ):
    /// an engine wiring error, never input-driven.
    pub fn step(&mut self, params: &mut [Param], lr: f32) {
        assert_eq!(
            params.len(),
            self.states.len(),
            "optimizer built for {} params, got {}",
            self.states.len(),
            params.len()
        );
        self.steps += 1;
        match self.config {
            OptimizerConfig::Sgd {
                momentum,
                weight_decay,
                nesterov,
            } => {
                for (param, state) in params.iter_mut().zip(&mut self.states) {
                    let decay = if state.decays { weight_decay } else { 0.0 };
                    sgd_update(
                        param,
                        &mut state.first_moment,
                        lr,
                        momentum,
                        decay,
                        nesterov,
                    );
                }
            }
            OptimizerConfig::AdamW {
                beta1,
                beta2,
                eps,
                weight_decay,
            } => {
                let t = i32::try_from(self.steps).unwrap_or(i32::MAX);
                let first_correction = 1.0 - f64::from(beta1).powi(t);
                let second_correction = 1.0 - f64::from(beta2).powi(t);
                let step_size = (f64::from(lr) / first_correction) as f32;
                let inv_sqrt_second_correction = (1.0 / second_correction.sqrt()) as f32;
                for (param, state) in params.iter_mut().zip(&mut self.states) {
                    let shrink = if state.decays {
                        1.0 - lr * weight_decay
                    } else {
                        1.0
                    };
                    assert_eq!(
                        param.value.len(),
                        state.first_moment.len(),
                        "param {} changed size",
                        param.name
                    );
                    let moments = state
                        .first_moment
                        .iter_mut()
                        .zip(state.second_moment.iter_mut());
                    for ((value, &grad), (m, v)) in
                        param.value.iter_mut().zip(&param.grad).zip(moments)
                    {
                        *m = beta1 * *m + (1.0 - beta1) * grad;
                        *v = beta2 * *v + (1.0 - beta2) * grad * grad;
                        let denominator = v.sqrt() * inv_sqrt_second_correction + eps;
                        *value = *value * shrink - step_size * *m / denominator;
                    }
                }
            }
        }
    }
}

fn sgd_update(
    param: &mut Param,
    buffer: &mut [f32],
    lr: f32,
    momentum: f32,
    decay: f32,
    nesterov: bool,
) {
    assert_eq!(
        param.value.len(),
        param.grad.len(),
        "param {} grad size",
        param.name
    );
    if buffer.is_empty() {
        for (value, &grad) in param.value.iter_mut().zip(&param.grad) {
            *value -= lr * (grad + decay * *value);
        }
        return;
    }
    assert_eq!(
        param.value.len(),
        buffer.len(),
        "param {} changed size",
        param.name
    );
    for ((value, &grad), velocity) in param.value.iter_mut().zip(&param.grad).zip(buffer) {
        let direction = grad + decay * *value;
        *velocity = momentum * *velocity + direction;
        let update = if nesterov {
            direction + momentum * *velocity
        } else {
            *velocity
        };
        *value -= lr * update;
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn param(shape: &[usize], value: Vec<f32>) -> Param {
        Param::new("p", shape, value)
    }

    fn run(
        config: &OptimizerConfig,
        params: &mut [Param],
        grads: &[&[f32]],
        lr: f32,
    ) -> Vec<Vec<f32>> {
        let mut optimizer = LayerOptimizer::new(config, params);
        grads
            .iter()
            .map(|grad| {
                params[0].grad.copy_from_slice(grad);
                optimizer.step(params, lr);
                params[0].value.clone()
            })
            .collect()
    }

    fn close(a: f32, b: f32, tol: f32) -> bool {
        (a - b).abs() <= tol
    }

    #[test]
    fn sgd_momentum_matches_hand_computed_sequence() {
        let config = OptimizerConfig::Sgd {
            momentum: 0.9,
            weight_decay: 0.0,
            nesterov: false,
        };
        let trace = run(
            &config,
            &mut [param(&[1], vec![1.0])],
            &[&[1.0], &[2.0], &[3.0]],
            0.1,
        );
        // b = 1, 2.9, 5.61; θ = 1 − 0.1·b cumulatively.
        for (got, want) in trace.iter().zip([0.9, 0.61, 0.049]) {
            assert!(close(got[0], want, 1e-6), "{got:?} vs {want}");
        }
        let nesterov = OptimizerConfig::Sgd {
            momentum: 0.9,
            weight_decay: 0.0,
            nesterov: true,
        };
        let trace = run(
            &nesterov,
            &mut [param(&[1], vec![1.0])],
            &[&[1.0], &[2.0]],
            0.1,
        );
        // d = 1 + 0.9·1 = 1.9, then 2 + 0.9·2.9 = 4.61.
        assert!(
            close(trace[0][0], 0.81, 1e-6) && close(trace[1][0], 0.349, 1e-6),
            "{trace:?}"
        );
    }

    #[test]
    fn weight_decay_skips_one_dimensional_params() {
        let config = OptimizerConfig::Sgd {
            momentum: 0.0,
            weight_decay: 0.5,
            nesterov: false,
        };
        let mut params = [param(&[1, 1], vec![2.0]), param(&[1], vec![2.0])];
        params[0].grad[0] = 1.0;
        params[1].grad[0] = 1.0;
        LayerOptimizer::new(&config, &params).step(&mut params, 0.1);
        assert!(
            close(params[0].value[0], 1.8, 1e-6),
            "matrix decays: 2 − 0.1·(1 + 0.5·2)"
        );
        assert!(close(params[1].value[0], 1.9, 1e-6), "bias does not decay");
    }

    #[test]
    fn adamw_matches_hand_computed_first_two_steps() {
        let config = OptimizerConfig::AdamW {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.1,
        };
        let trace = run(
            &config,
            &mut [param(&[1, 1], vec![1.0])],
            &[&[0.5], &[-1.0]],
            0.1,
        );
        // Step 1: θ = 0.99 (decay) − 0.1·(0.5 / 0.1)/(√(0.00025/0.001) + ε) = 0.89.
        // Step 2: θ = 0.8811 − 0.1·(−0.055/0.19)/(√(0.00124975/0.001999) + ε) = 0.917710354.
        assert!(close(trace[0][0], 0.89, 1e-6), "{trace:?}");
        assert!(close(trace[1][0], 0.917_710_4, 1e-6), "{trace:?}");

        let mut bias = [param(&[1], vec![1.0])];
        let trace = run(&config, &mut bias, &[&[0.5]], 0.1);
        assert!(
            close(trace[0][0], 0.9, 1e-6),
            "no decay on a bias: {trace:?}"
        );
    }

    fn minimizes_quadratic(config: &OptimizerConfig, lr: f32, steps: usize) -> f32 {
        // f(θ) = ½ Σ aᵢ (θᵢ − cᵢ)², ∇f = aᵢ (θᵢ − cᵢ).
        let curvature = [1.0f32, 4.0, 0.5, 2.0];
        let target = [3.0f32, -1.0, 0.5, -2.0];
        let mut params = [param(&[2, 2], vec![0.0; 4])];
        let mut optimizer = LayerOptimizer::new(config, &params);
        for step in 0..steps {
            let p = &mut params[0];
            for i in 0..4 {
                p.grad[i] = curvature[i] * (p.value[i] - target[i]);
            }
            let decayed_lr = lr * (1.0 - step as f32 / steps as f32);
            optimizer.step(&mut params, decayed_lr);
        }
        params[0]
            .value
            .iter()
            .zip(target)
            .map(|(v, t)| (v - t).abs())
            .fold(0.0, f32::max)
    }

    #[test]
    fn both_optimizers_minimize_a_quadratic() {
        let sgd = OptimizerConfig::Sgd {
            momentum: 0.9,
            weight_decay: 0.0,
            nesterov: true,
        };
        let error = minimizes_quadratic(&sgd, 0.05, 300);
        assert!(error < 1e-3, "sgd error {error}");
        let adamw = OptimizerConfig::AdamW {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
        };
        let error = minimizes_quadratic(&adamw, 0.1, 1000);
        assert!(error < 1e-2, "adamw error {error}");
    }

    #[test]
    fn validate_rejects_out_of_range_values() {
        assert!(OptimizerConfig::sgd().validate().is_ok());
        assert!(OptimizerConfig::adamw().validate().is_ok());
        assert!(OptimizerConfig::Sgd {
            momentum: 1.0,
            weight_decay: 0.0,
            nesterov: false
        }
        .validate()
        .is_err());
        assert!(OptimizerConfig::Sgd {
            momentum: 0.0,
            weight_decay: 0.0,
            nesterov: true
        }
        .validate()
        .is_err());
        assert!(OptimizerConfig::Sgd {
            momentum: 0.5,
            weight_decay: -1.0,
            nesterov: false
        }
        .validate()
        .is_err());
        assert!(OptimizerConfig::AdamW {
            beta1: 0.9,
            beta2: 0.999,
            eps: 0.0,
            weight_decay: 0.0
        }
        .validate()
        .is_err());
        assert!(OptimizerConfig::AdamW {
            beta1: 0.9,
            beta2: f32::NAN,
            eps: 1e-8,
            weight_decay: 0.0
        }
        .validate()
        .is_err());
    }

    proptest! {
        #[test]
        fn plain_sgd_is_theta_minus_lr_grad(values in prop::collection::vec(-10.0f32..10.0, 1..20), lr in 0.0f32..1.0, seed in 0u32..1000) {
            let len = values.len();
            let mut params = [param(&[len], values.clone())];
            for (i, g) in params[0].grad.iter_mut().enumerate() {
                *g = ((i as u32 * 7919 + seed) % 200) as f32 / 10.0 - 10.0;
            }
            let grads = params[0].grad.clone();
            let config = OptimizerConfig::Sgd { momentum: 0.0, weight_decay: 0.3, nesterov: false };
            LayerOptimizer::new(&config, &params).step(&mut params, lr);
            for i in 0..len {
                prop_assert!(close(params[0].value[i], values[i] - lr * grads[i], 1e-5));
            }
        }

        #[test]
        fn adamw_first_step_moves_each_coordinate_by_lr_against_the_gradient_sign(
            grads in prop::collection::vec(prop_oneof![-5.0f32..-0.01, 0.01f32..5.0], 1..20), lr in 0.001f32..0.5,
        ) {
            let len = grads.len();
            let mut params = [param(&[1, len], vec![0.0; len])];
            params[0].grad.copy_from_slice(&grads);
            LayerOptimizer::new(&OptimizerConfig::adamw(), &params).step(&mut params, lr);
            for i in 0..len {
                prop_assert!(close(params[0].value[i], -lr * grads[i].signum(), lr * 1e-4));
            }
        }
    }
}
