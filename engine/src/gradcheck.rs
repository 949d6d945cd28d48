//! Finite-difference gradient checks shared by every layer's tests.
//!
//! The scalar under test is `L = Σ out ⊙ r` for a fixed pseudo-random `r`, so `dL/dout = r`.
//! Analytic gradients from `backward(r)` are compared with central differences of `L`
//! w.r.t. every input element (optional) and every parameter element.

use crate::layer::Layer;
use crate::tensor::Tensor;

/// Deterministic pseudo-random values in [-1, 1).
pub fn pseudo_random(len: usize, seed: u64) -> Vec<f32> {
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..len)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

fn weighted_sum(out: &Tensor, r: &[f32]) -> f64 {
    out.data
        .iter()
        .zip(r)
        .map(|(a, b)| *a as f64 * *b as f64)
        .sum()
}

/// Checks the gradients of `layer` at `input`. `check_input = false` skips the input
/// gradient (e.g. for token-id inputs). Panics with the first mismatch.
pub fn check_layer(layer: &mut dyn Layer, input: &Tensor, check_input: bool, eps: f32, tol: f32) {
    let out = layer.forward(input, true);
    let r = pseudo_random(out.len(), 99);
    let grad_out = Tensor::from_vec(&out.shape, r.clone());
    let grad_in = layer.backward(&grad_out);
    assert_eq!(grad_in.shape, input.shape, "input gradient shape");
    let param_grads: Vec<Vec<f32>> = layer.params().iter().map(|p| p.grad.clone()).collect();

    let close = |analytic: f32, numeric: f32, what: &str| {
        let scale = analytic.abs().max(numeric.abs()).max(1.0);
        assert!(
            (analytic - numeric).abs() <= tol * scale,
            "{}: {what}: analytic {analytic} vs numeric {numeric}",
            layer_kind_hint(analytic, numeric)
        );
    };

    if check_input {
        for i in 0..input.len() {
            let mut plus = input.clone();
            plus.data[i] += eps;
            let mut minus = input.clone();
            minus.data[i] -= eps;
            let lp = weighted_sum(&layer.forward(&plus, true), &r);
            let lm = weighted_sum(&layer.forward(&minus, true), &r);
            let numeric = ((lp - lm) / (2.0 * eps as f64)) as f32;
            close(grad_in.data[i], numeric, &format!("input[{i}]"));
        }
    }
    for (pi, grads) in param_grads.iter().enumerate() {
        for i in 0..grads.len() {
            let orig = layer.params()[pi].value[i];
            layer.params_mut()[pi].value[i] = orig + eps;
            let lp = weighted_sum(&layer.forward(input, true), &r);
            layer.params_mut()[pi].value[i] = orig - eps;
            let lm = weighted_sum(&layer.forward(input, true), &r);
            layer.params_mut()[pi].value[i] = orig;
            let numeric = ((lp - lm) / (2.0 * eps as f64)) as f32;
            let name = layer.params()[pi].name.clone();
            close(grads[i], numeric, &format!("param {name}[{i}]"));
        }
    }
}

fn layer_kind_hint(a: f32, n: f32) -> &'static str {
    if a.is_nan() || n.is_nan() {
        "NaN gradient"
    } else {
        "gradient mismatch"
    }
}
