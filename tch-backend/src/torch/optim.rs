//! The engine's optimizers ([`engine::optim`]) as tensor ops on one unit, under `no_grad`
//! on the device, in the engine's order of floating-point operations.

use engine::optim::OptimizerConfig;
use tch::TchError;

use super::inplace;
use super::unit::TchUnit;

impl TchUnit {
    /// The engine's update rules ([`engine::optim`]) with the same order of f32 operations
    /// (separate multiply and add kernels, no fused `alpha` forms).
    pub(super) fn step(&mut self, lr: f32) -> Result<(), TchError> {
        let _guard = tch::no_grad_guard();
        self.steps += 1;
        match self.config {
            OptimizerConfig::Sgd {
                momentum,
                weight_decay,
                nesterov,
            } => {
                for p in &mut self.params {
                    let decay = if p.decays { weight_decay } else { 0.0 };
                    let grad = p.grad()?;
                    // d = g + wd·θ (with wd = 0 that is g itself, bit for bit, for every
                    // finite θ: two kernels and an allocation fewer per parameter)
                    let direction = if decay == 0.0 {
                        grad.shallow_clone()
                    } else {
                        let mut d = p.value.f_detach()?.f_mul_scalar(f64::from(decay))?;
                        inplace(d.f_add_(&grad))?;
                        d
                    };
                    let update = match p.first.as_mut() {
                        None => direction,
                        Some(velocity) => {
                            // b = μ·b + d
                            inplace(velocity.f_mul_scalar_(f64::from(momentum)))?;
                            inplace(velocity.f_add_(&direction))?;
                            if nesterov {
                                // d + μ·b
                                let mut u = velocity.f_mul_scalar(f64::from(momentum))?;
                                inplace(u.f_add_(&direction))?;
                                u
                            } else {
                                velocity.shallow_clone()
                            }
                        }
                    };
                    // θ -= lr·update
                    let scaled = update.f_mul_scalar(f64::from(lr))?;
                    inplace(p.value.f_sub_(&scaled))?;
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
                for p in &mut self.params {
                    let grad = p.grad()?;
                    let (Some(m), Some(v)) = (p.first.as_mut(), p.second.as_mut()) else {
                        return Err(TchError::Torch("adamw state missing".into()));
                    };
                    // m = β₁m + (1−β₁)g
                    inplace(m.f_mul_scalar_(f64::from(beta1)))?;
                    inplace(m.f_add_(&grad.f_mul_scalar(f64::from(1.0 - beta1))?))?;
                    // v = β₂v + ((1−β₂)g)g
                    let mut g2 = grad.f_mul_scalar(f64::from(1.0 - beta2))?;
                    inplace(g2.f_mul_(&grad))?;
                    inplace(v.f_mul_scalar_(f64::from(beta2)))?;
                    inplace(v.f_add_(&g2))?;
                    // den = √v · c + ε
                    let mut den = v.f_sqrt()?;
                    inplace(den.f_mul_scalar_(f64::from(inv_sqrt_second_correction)))?;
                    inplace(den.f_add_scalar_(f64::from(eps)))?;
                    // θ = θ·shrink − (step·m)/den
                    if p.decays {
                        inplace(p.value.f_mul_scalar_(f64::from(1.0 - lr * weight_decay)))?;
                    }
                    let mut delta = m.f_mul_scalar(f64::from(step_size))?;
                    inplace(delta.f_div_(&den))?;
                    inplace(p.value.f_sub_(&delta))?;
                }
            }
        }
        Ok(())
    }
}
