//! The libtorch rows of `dreamddp bench`: the same training step as the built-in engine's
//! and PyTorch's (batch 128, softmax cross-entropy, plain SGD `p -= lr·grad`), run by
//! dreamddp's tch driver through the replica seam (staged per-unit backward, each unit
//! stepped the moment its gradient is ready), and the cost of that staged backward against
//! one plain `loss.backward()` over the same model, interleaved in the same run.
//!
//! Owns [`TchRow`] and its timing. The ratios are against numbers measured in the same run:
//! PyTorch's step (from `bench/torch_step.py`, timed between our two built-in runs) and the
//! built-in engine's. Without the `tch` feature there are no rows, and the table says why.

use std::time::Instant;

use engine::optim::OptimizerConfig;
use engine::replica::ModelReplica;
use engine::tensor::Tensor;
use serde::Serialize;
use tch_backend::{measure_backward, TchReplica};

use crate::bench_cmd::{BenchModel, StepTiming, BATCH};

/// One model's libtorch measurements.
#[derive(Debug, Serialize)]
pub struct TchRow {
    /// Model name.
    pub model: &'static str,
    /// Our tch driver's step (staged backward, per-unit SGD).
    pub tch: StepTiming,
    /// Forward + staged backward, ms (mean over the interleaved reps).
    pub staged_ms: f64,
    /// Forward + one plain backward, ms.
    pub plain_ms: f64,
    /// `staged_ms / plain_ms − 1` (target ≤ 0.10).
    pub staged_overhead: f64,
    /// `torch_ms / tch_ms`: PyTorch from Python against our tch driver (target ≥ 0.9).
    pub vs_pytorch: Option<f64>,
    /// `builtin_ms / tch_ms`: the built-in engine against the tch driver (> 1: tch is faster).
    pub builtin_over_tch: f64,
}

/// Times the tch driver on `model` and the staged-backward cost. `torch_ms` and `builtin_ms`
/// are the same run's PyTorch and built-in medians.
pub fn time_tch(
    model: BenchModel,
    input: &Tensor,
    labels: &[usize],
    steps: usize,
    warmup: usize,
    torch_ms: Option<f64>,
    builtin_ms: f64,
) -> Result<TchRow, String> {
    let net = model.build();
    let sgd = OptimizerConfig::Sgd {
        momentum: 0.0,
        weight_decay: 0.0,
        nesterov: false,
    };
    let mut replica = TchReplica::from_model(&net, &sgd, "cpu").map_err(|e| e.to_string())?;
    let step = |r: &mut TchReplica| -> Result<f64, String> {
        let start = Instant::now();
        r.forward_backward(input, labels, &mut |_, unit| {
            unit.step(crate::bench_cmd::LEARNING_RATE)
        })
        .map_err(|e| e.to_string())?;
        Ok(start.elapsed().as_secs_f64() * 1e3)
    };
    for _ in 0..warmup {
        step(&mut replica)?;
    }
    let mut samples = Vec::with_capacity(steps);
    for _ in 0..steps {
        samples.push(step(&mut replica)?);
    }
    let tch = StepTiming::from_samples(&mut samples).ok_or("no steps timed")?;
    let b = measure_backward(&net, input, labels, steps.max(5)).map_err(|e| e.to_string())?;
    Ok(TchRow {
        model: model.name(),
        tch,
        staged_ms: b.staged_ms,
        plain_ms: b.plain_ms,
        staged_overhead: b.staged_ms / b.plain_ms - 1.0,
        vs_pytorch: torch_ms.map(|t| t / tch.median_ms),
        builtin_over_tch: builtin_ms / tch.median_ms,
    })
}

/// The tch part of the table.
pub fn format_tch_rows(rows: &[TchRow], why_none: Option<&str>) -> String {
    if let Some(why) = why_none {
        return format!("tch backend: no rows ({why})\n");
    }
    let mut out = format!(
        "tch backend (batch {BATCH}): our libtorch driver, staged per-unit backward included\n\
         {:<5} | {:>8} | {:>19} | {:>15} | {:>15} | {}\n",
        "model",
        "tch ms",
        "vs PyTorch (≥0.9x)",
        "builtin / tch",
        "staged / plain",
        "staged overhead (≤10%)"
    );
    for r in rows {
        let vs = r
            .vs_pytorch
            .map_or("n/a".to_string(), |x| format!("{x:.2}x"));
        out += &format!(
            "{:<5} | {:>8.2} | {:>19} | {:>14.2}x | {:>6.2}/{:<8.2} | {:+.1}%\n",
            r.model,
            r.tch.median_ms,
            vs,
            r.builtin_over_tch,
            r.staged_ms,
            r.plain_ms,
            r.staged_overhead * 100.0
        );
    }
    out
}
