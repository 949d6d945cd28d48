//! The `cnn` model for MNIST (two conv + max-pool stages, then linear layers).
//!
//! Owns the builder [`cnn`]: `conv1 (in→16, 5×5, pad 2) → relu1 → pool1 (2×2) →
//! conv2 (16→32, 5×5, pad 2) → relu2 → pool2 (2×2) → flatten → fc1 (→128) → relu3 → head`.
//! The padded 5×5 convolutions keep the spatial size, so each pool halves it (floor):
//! MNIST 28×28 reaches the head as 32·7·7 features, the 8×8 digits as 32·2·2.

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use crate::layers::activation::Relu;
use crate::layers::conv::Conv2d;
use crate::layers::flatten::Flatten;
use crate::layers::linear::Linear;
use crate::layers::pool::MaxPool2d;
use crate::model::Model;

/// Channels after the first convolution.
const CONV1_CHANNELS: usize = 16;
/// Channels after the second convolution.
const CONV2_CHANNELS: usize = 32;
/// Kernel side of both convolutions.
const KERNEL: usize = 5;
/// Width of the hidden fully connected layer.
const HIDDEN: usize = 128;

/// Builds the `cnn` model for `[N, in_ch, height, width]` inputs and `classes` outputs.
/// Parameters are drawn from `ChaCha8Rng::seed_from_u64(seed)` layer by layer in forward
/// order, so the same seed gives identical weights.
///
/// # Panics
/// When `height` or `width` is below 4 (two 2×2 pools would leave nothing) or a size is zero.
pub fn cnn(in_ch: usize, height: usize, width: usize, classes: usize, seed: u64) -> Model {
    assert!(
        height >= 4 && width >= 4 && in_ch > 0 && classes > 0,
        "cnn needs inputs of at least 4×4 and nonzero channels/classes"
    );
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let pad = KERNEL / 2;
    let conv1 = Conv2d::new(in_ch, CONV1_CHANNELS, KERNEL, 1, pad, &mut rng)
        .with_input_size(height, width)
        // Its input is the data batch: nobody reads that gradient.
        .without_input_grad();
    let (h1, w1) = (height / 2, width / 2);
    let conv2 = Conv2d::new(CONV1_CHANNELS, CONV2_CHANNELS, KERNEL, 1, pad, &mut rng)
        .with_input_size(h1, w1);
    let features = CONV2_CHANNELS * (h1 / 2) * (w1 / 2);
    let fc1 = Linear::new(features, HIDDEN, &mut rng);
    let head = Linear::new(HIDDEN, classes, &mut rng);
    Model::new(
        "cnn",
        vec![
            ("conv1", Box::new(conv1)),
            ("relu1", Box::new(Relu::new())),
            ("pool1", Box::new(MaxPool2d::new(2, 2))),
            ("conv2", Box::new(conv2)),
            ("relu2", Box::new(Relu::new())),
            ("pool2", Box::new(MaxPool2d::new(2, 2))),
            ("flatten", Box::new(Flatten::new())),
            ("fc1", Box::new(fc1)),
            ("relu3", Box::new(Relu::new())),
            ("head", Box::new(head)),
        ],
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gradcheck::pseudo_random;
    use crate::tensor::Tensor;

    const NAMES: [&str; 10] = [
        "conv1", "relu1", "pool1", "conv2", "relu2", "pool2", "flatten", "fc1", "relu3", "head",
    ];

    fn shapes_through(model: &mut Model, input_shape: &[usize]) -> Tensor {
        let len = input_shape.iter().product();
        let input = Tensor::from_vec(input_shape, pseudo_random(len, 1));
        let out = model.forward(&input, true);
        let grad = Tensor::from_vec(&out.shape, pseudo_random(out.len(), 2));
        let mut ready = Vec::new();
        model.backward_with_hook(&grad, &mut |i, l| ready.push((i, l.name.clone())));
        let names: Vec<&str> = ready.iter().map(|(_, n)| n.as_str()).collect();
        assert_eq!(
            names,
            ["head", "fc1", "conv2", "conv1"],
            "hook order: head first"
        );
        for l in &model.layers {
            for p in l.layer.params() {
                assert!(
                    p.grad.iter().all(|g| g.is_finite()),
                    "{} {}",
                    l.name,
                    p.name
                );
                assert!(
                    p.grad.iter().any(|g| *g != 0.0),
                    "{} {} got no gradient",
                    l.name,
                    p.name
                );
            }
        }
        out
    }

    #[test]
    fn mnist_shapes_names_and_params() {
        let mut model = cnn(1, 28, 28, 10, 0);
        let names: Vec<&str> = model.layers.iter().map(|l| l.name.as_str()).collect();
        assert_eq!(names, NAMES);
        let out = shapes_through(&mut model, &[2, 1, 28, 28]);
        assert_eq!(out.shape, [2, 10]);
        let expected =
            (16 * 25 + 16) + (32 * 16 * 25 + 32) + (32 * 7 * 7 * 128 + 128) + (128 * 10 + 10);
        assert_eq!(model.param_count(), expected);
        let infos = model.layer_infos();
        let kinds: Vec<&str> = infos.iter().map(|i| i.kind).collect();
        assert_eq!(kinds, ["conv2d", "conv2d", "linear", "linear"]);
        assert_eq!(
            model.layers[0].layer.forward_macs_per_sample(),
            16 * 25 * 28 * 28
        );
        assert_eq!(
            model.layers[3].layer.forward_macs_per_sample(),
            32 * 16 * 25 * 14 * 14
        );
    }

    #[test]
    fn digits_shapes() {
        let mut model = cnn(1, 8, 8, 10, 0);
        let out = shapes_through(&mut model, &[3, 1, 8, 8]);
        assert_eq!(out.shape, [3, 10]);
        assert_eq!(model.layers[7].layer.params()[0].shape, [128, 32 * 2 * 2]);
    }

    #[test]
    fn same_seed_same_weights() {
        assert_eq!(
            cnn(1, 8, 8, 10, 5).flat_values(),
            cnn(1, 8, 8, 10, 5).flat_values()
        );
        assert_ne!(
            cnn(1, 8, 8, 10, 5).flat_values(),
            cnn(1, 8, 8, 10, 6).flat_values()
        );
    }
}
