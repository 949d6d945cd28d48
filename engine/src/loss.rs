//! Softmax cross-entropy loss (mean over rows) and accuracy helpers.
//!
//! Logits of any rank are viewed as `[rows, classes]` (classes = last dimension), with one
//! target class per row — `[N, C]` for classifiers, `[B, T, V]` for language models.

use thiserror::Error;

use crate::tensor::Tensor;

/// Why a loss could not be computed from the given logits and targets.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum LossError {
    /// The number of targets differs from the number of logit rows.
    #[error("{targets} targets for {rows} rows of logits")]
    TargetCount {
        /// Rows of logits.
        rows: usize,
        /// Targets given.
        targets: usize,
    },
    /// A target class is outside `0..classes`.
    #[error("target {target} at row {row} is not below the class count {classes}")]
    TargetOutOfRange {
        /// Row of the offending target.
        row: usize,
        /// The target value.
        target: usize,
        /// Number of classes (last dimension of the logits).
        classes: usize,
    },
}

fn validate(logits: &Tensor, targets: &[usize]) -> Result<usize, LossError> {
    let classes = logits.last_dim();
    let rows = if classes == 0 { 0 } else { logits.rows() };
    if targets.len() != rows {
        return Err(LossError::TargetCount {
            rows,
            targets: targets.len(),
        });
    }
    if let Some((row, &target)) = targets.iter().enumerate().find(|(_, t)| **t >= classes) {
        return Err(LossError::TargetOutOfRange {
            row,
            target,
            classes,
        });
    }
    Ok(classes)
}

/// Mean softmax cross-entropy of `logits` against `targets` and its gradient w.r.t. the
/// logits, `(softmax − onehot) / rows`. Numerically stable (the row maximum is subtracted).
/// Zero rows give a loss of 0.
///
/// # Errors
/// When the target count differs from the row count or a target is not a valid class.
pub fn try_softmax_cross_entropy(
    logits: &Tensor,
    targets: &[usize],
) -> Result<(f32, Tensor), LossError> {
    let classes = validate(logits, targets)?;
    let mut grad = Tensor::zeros(&logits.shape);
    if targets.is_empty() {
        return Ok((0.0, grad));
    }
    let inv_rows = 1.0 / targets.len() as f32;
    let mut total = 0.0f64;
    for ((row, grad_row), &target) in logits
        .data
        .chunks_exact(classes)
        .zip(grad.data.chunks_exact_mut(classes))
        .zip(targets)
    {
        let max = row.iter().fold(f32::NEG_INFINITY, |m, v| m.max(*v));
        let mut sum = 0.0f32;
        for (gv, v) in grad_row.iter_mut().zip(row) {
            let e = (v - max).exp();
            *gv = e;
            sum += e;
        }
        // −log softmax[target] = log Σ exp(v − max) − (v_target − max).
        total += (sum.ln() - (row[target] - max)) as f64;
        let scale = inv_rows / sum;
        for gv in grad_row.iter_mut() {
            *gv *= scale;
        }
        grad_row[target] -= inv_rows;
    }
    Ok(((total * inv_rows as f64) as f32, grad))
}

/// [`try_softmax_cross_entropy`] for targets the caller has already validated (data loaders
/// check labels against the class count when they read a data set).
///
/// # Panics
/// When the targets do not fit the logits (an engine bug: labels are validated at load time).
pub fn softmax_cross_entropy(logits: &Tensor, targets: &[usize]) -> (f32, Tensor) {
    match try_softmax_cross_entropy(logits, targets) {
        Ok(result) => result,
        Err(e) => panic!("softmax_cross_entropy: {e}"),
    }
}

/// Number of rows whose largest logit is at the target class (first maximum wins ties).
/// Rows beyond `targets.len()` (or targets beyond the rows) are not counted.
pub fn argmax_accuracy(logits: &Tensor, targets: &[usize]) -> usize {
    let classes = logits.last_dim();
    if classes == 0 {
        return 0;
    }
    logits
        .data
        .chunks_exact(classes)
        .zip(targets)
        .filter(|(row, &target)| argmax(row) == target)
        .count()
}

/// Index of the first maximum of a non-empty slice.
fn argmax(row: &[f32]) -> usize {
    let mut best = 0;
    for (i, v) in row.iter().enumerate() {
        if *v > row[best] {
            best = i;
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gradcheck::pseudo_random;
    use proptest::prelude::*;

    #[test]
    fn uniform_logits_give_log_classes() {
        let logits = Tensor::zeros(&[3, 4]);
        let (loss, grad) = softmax_cross_entropy(&logits, &[0, 1, 3]);
        assert!((loss - 4f32.ln()).abs() < 1e-6);
        // Row 0: (0.25 − 1)/3 at the target, 0.25/3 elsewhere.
        assert!((grad.data[0] + 0.25).abs() < 1e-6);
        assert!((grad.data[1] - 0.25 / 3.0).abs() < 1e-6);
    }

    #[test]
    fn huge_logits_stay_finite() {
        let logits = Tensor::from_vec(&[2, 3], vec![1000.0, 0.0, -1000.0, 500.0, 500.0, 0.0]);
        let (loss, grad) = softmax_cross_entropy(&logits, &[0, 1]);
        assert!((loss - 2f32.ln() / 2.0).abs() < 1e-5, "loss {loss}");
        assert!(grad.data.iter().all(|v| v.is_finite()));
    }

    #[test]
    fn gradient_matches_finite_differences() {
        let shape = [2, 3, 5];
        let logits = Tensor::from_vec(
            &shape,
            pseudo_random(30, 11).into_iter().map(|v| 3.0 * v).collect(),
        );
        let targets = [4, 0, 2, 2, 1, 3];
        let (_, grad) = softmax_cross_entropy(&logits, &targets);
        let eps = 1e-2f32;
        for i in 0..logits.len() {
            let mut plus = logits.clone();
            plus.data[i] += eps;
            let mut minus = logits.clone();
            minus.data[i] -= eps;
            let numeric = (softmax_cross_entropy(&plus, &targets).0
                - softmax_cross_entropy(&minus, &targets).0)
                / (2.0 * eps);
            assert!(
                (grad.data[i] - numeric).abs() < 1e-3,
                "logit {i}: analytic {} vs numeric {numeric}",
                grad.data[i]
            );
        }
    }

    #[test]
    fn bad_targets_are_typed_errors() {
        let logits = Tensor::zeros(&[2, 3]);
        assert_eq!(
            try_softmax_cross_entropy(&logits, &[0]).unwrap_err(),
            LossError::TargetCount {
                rows: 2,
                targets: 1
            }
        );
        assert_eq!(
            try_softmax_cross_entropy(&logits, &[0, 3]).unwrap_err(),
            LossError::TargetOutOfRange {
                row: 1,
                target: 3,
                classes: 3
            }
        );
    }

    #[test]
    fn accuracy_counts_rows_whose_argmax_is_the_target() {
        let logits = Tensor::from_vec(&[3, 3], vec![0.1, 0.9, 0.0, 2.0, 1.0, 0.0, 0.0, 0.0, -1.0]);
        assert_eq!(argmax_accuracy(&logits, &[1, 1, 0]), 2);
        assert_eq!(argmax_accuracy(&logits, &[2, 0, 2]), 1);
    }

    proptest! {
        #[test]
        fn gradient_rows_sum_to_zero_and_loss_is_nonnegative(
            values in proptest::collection::vec(-20.0f32..20.0, 12),
            targets in proptest::collection::vec(0usize..4, 3),
        ) {
            let logits = Tensor::from_vec(&[3, 4], values);
            let (loss, grad) = softmax_cross_entropy(&logits, &targets);
            prop_assert!(loss >= 0.0 && loss.is_finite());
            for row in grad.data.chunks_exact(4) {
                prop_assert!(row.iter().sum::<f32>().abs() < 1e-5);
            }
        }
    }
}
