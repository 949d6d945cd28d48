//! The `mlp` model for MNIST / digits: `flatten, fc1, relu1, …, fcK, reluK, head`.
//!
//! Weights come from `ChaCha8Rng::seed_from_u64(seed)` in layer order, so every worker
//! that builds the model with the same seed starts from identical parameters.

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use crate::layer::Layer;
use crate::layers::activation::Relu;
use crate::layers::flatten::Flatten;
use crate::layers::linear::Linear;
use crate::model::Model;

/// Hidden widths of the MNIST MLP (784 → 512 → 256 → 128 → 10: four linear layers).
pub const MLP_MNIST_HIDDEN: &[usize] = &[512, 256, 128];
/// Hidden widths of the digits MLP (64 → 128 → 64 → 32 → 10).
pub const MLP_DIGITS_HIDDEN: &[usize] = &[128, 64, 32];

/// A multi-layer perceptron `input_dim → hidden… → classes` with ReLU between linear layers.
///
/// Layers: `flatten` (so `[N, 1, 28, 28]` images work as well as `[N, 784]`), then
/// `fc1, relu1, …, fcK, reluK` for the K hidden widths, then the output layer `head`.
/// `fc1` skips its (unused) input gradient in backward.
pub fn mlp(input_dim: usize, hidden: &[usize], classes: usize, seed: u64) -> Model {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut names: Vec<String> = vec!["flatten".to_string()];
    let mut layers: Vec<Box<dyn Layer>> = vec![Box::new(Flatten::new())];
    let mut width = input_dim;
    for (i, &h) in hidden.iter().enumerate() {
        let mut fc = Linear::new(width, h, &mut rng);
        if i == 0 {
            fc.set_input_grad(false);
        }
        names.push(format!("fc{}", i + 1));
        layers.push(Box::new(fc));
        names.push(format!("relu{}", i + 1));
        layers.push(Box::new(Relu::new()));
        width = h;
    }
    let mut head = Linear::new(width, classes, &mut rng);
    if hidden.is_empty() {
        head.set_input_grad(false);
    }
    names.push("head".to_string());
    layers.push(Box::new(head));
    Model::new(
        "mlp",
        names.iter().map(String::as_str).zip(layers).collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gradcheck::pseudo_random;
    use crate::loss::{argmax_accuracy, softmax_cross_entropy};
    use crate::tensor::Tensor;

    /// Features scaled to [0, 1] and labels of the digits CSV shipped with the crate
    /// (header row, 64 pixel columns with values 0..=16, label last).
    fn load_digits() -> (Vec<f32>, Vec<usize>) {
        let text = include_str!("../../data/digits.csv");
        let mut features = Vec::new();
        let mut labels = Vec::new();
        for line in text.lines().skip(1).filter(|l| !l.trim().is_empty()) {
            let fields: Vec<&str> = line.trim().split(',').collect();
            assert_eq!(fields.len(), 65, "digits row has {} fields", fields.len());
            features.extend(
                fields[..64]
                    .iter()
                    .map(|f| f.parse::<f32>().expect("pixel") / 16.0),
            );
            labels.push(fields[64].parse().expect("label"));
        }
        (features, labels)
    }

    fn sgd_step(model: &mut Model, lr: f32) {
        for l in &mut model.layers {
            for p in l.layer.params_mut() {
                for (v, g) in p.value.iter_mut().zip(&p.grad) {
                    *v -= lr * g;
                }
            }
        }
    }

    #[test]
    fn layers_are_named_and_seeded() {
        let model = mlp(64, MLP_DIGITS_HIDDEN, 10, 7);
        let infos = model.layer_infos();
        let names: Vec<&str> = infos.iter().map(|i| i.name.as_str()).collect();
        assert_eq!(names, ["fc1", "fc2", "fc3", "head"]);
        assert_eq!(
            model.param_count(),
            64 * 128 + 128 + 128 * 64 + 64 + 64 * 32 + 32 + 32 * 10 + 10
        );
        assert_eq!(
            model.flat_values(),
            mlp(64, MLP_DIGITS_HIDDEN, 10, 7).flat_values()
        );
        assert_ne!(
            model.flat_values(),
            mlp(64, MLP_DIGITS_HIDDEN, 10, 8).flat_values()
        );
    }

    #[test]
    fn accepts_image_shaped_input() {
        let mut model = mlp(16, &[8], 3, 1);
        let out = model.forward(
            &Tensor::from_vec(&[2, 1, 4, 4], pseudo_random(32, 1)),
            false,
        );
        assert_eq!(out.shape, vec![2, 3]);
    }

    #[test]
    fn sgd_on_digits_drives_loss_down_and_accuracy_up() {
        let (features, labels) = load_digits();
        let n = labels.len();
        assert!(n > 1000, "digits CSV has {n} rows");
        let mut model = mlp(64, MLP_DIGITS_HIDDEN, 10, 42);
        let batch = 64;
        let mut first_loss = None;
        for step in 0..400 {
            let start = (step * batch) % (n - batch);
            let x = Tensor::from_vec(
                &[batch, 64],
                features[start * 64..(start + batch) * 64].to_vec(),
            );
            let logits = model.forward(&x, true);
            let (loss, grad) = softmax_cross_entropy(&logits, &labels[start..start + batch]);
            first_loss.get_or_insert(loss);
            model.backward_with_hook(&grad, &mut |_, _| {});
            sgd_step(&mut model, 0.2);
        }
        let logits = model.forward(&Tensor::from_vec(&[n, 64], features), false);
        let (loss, _) = softmax_cross_entropy(&logits, &labels);
        let accuracy = argmax_accuracy(&logits, &labels) as f32 / n as f32;
        let first = first_loss.unwrap_or(f32::NAN);
        println!("digits mlp: loss {first} -> {loss}, accuracy {accuracy}");
        assert!(loss < 0.25 * first, "loss {first} -> {loss}");
        assert!(accuracy > 0.9, "accuracy {accuracy}");
    }
}
