//! TorchScript models: the LeNet-5 of `examples/export_model.py` exported by the PyTorch venv
//! (skipped without it unless `DREAMDDP_REQUIRE_TORCH` is set), trained through the replica
//! seam; typed errors for bad files, inputs and outputs.

use std::path::{Path, PathBuf};
use std::process::Command;

use engine::optim::OptimizerConfig;
use engine::replica::{ModelReplica, UnitData};
use engine::tensor::Tensor as HostTensor;

use super::resnet::{example, torch_python};
use crate::{TchBackendError, TchReplica};

fn temp_dir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("dreamddp-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir
}

fn run_python(python: &Path, args: &[&str]) {
    let out = Command::new(python).args(args).output().expect("python");
    assert!(
        out.status.success(),
        "python {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn sgd_momentum() -> OptimizerConfig {
    OptimizerConfig::Sgd {
        momentum: 0.9,
        weight_decay: 0.0,
        nesterov: false,
    }
}

/// The embedded 8×8 digits as 28×28: each pixel repeated 3×3 (24×24), zero border of 2.
fn digits_28(data: &engine::data::Dataset, indices: &[usize]) -> (HostTensor, Vec<usize>) {
    let mut out = vec![0.0f32; indices.len() * 28 * 28];
    let mut targets = Vec::with_capacity(indices.len());
    for (row, &i) in indices.iter().enumerate() {
        let sample = data.sample(i);
        for y in 0..24 {
            for x in 0..24 {
                out[row * 784 + (y + 2) * 28 + x + 2] = sample[(y / 3) * 8 + x / 3];
            }
        }
        targets.push(data.labels[i] as usize);
    }
    (
        HostTensor::from_vec(&[indices.len(), 1, 28, 28], out),
        targets,
    )
}

#[test]
fn torchscript_lenet_trains() {
    let Some(python) = torch_python() else {
        return;
    };
    let dir = temp_dir("script");
    let path = dir.join("lenet5.pt");
    let script = example("export_model.py");
    run_python(
        &python,
        &[
            script.to_str().expect("utf-8"),
            path.to_str().expect("utf-8"),
        ],
    );
    let mut r = TchReplica::from_torchscript(&path, &sgd_momentum(), "cpu").expect("load");
    let infos = r.unit_infos();
    let layout: Vec<(String, usize)> = infos.iter().map(|i| (i.name.clone(), i.params)).collect();
    println!("torchscript lenet5 units: {layout:?}");
    assert_eq!(
        layout,
        [
            ("conv1".to_string(), 156),
            ("conv2".to_string(), 2416),
            ("fc1".to_string(), 48120),
            ("fc2".to_string(), 10164),
            ("fc3".to_string(), 850),
        ]
    );
    assert_eq!(r.layer_names(), ["conv1", "conv2", "fc1", "fc2", "fc3"]);
    let names: Vec<String> = r.named_tensors().into_iter().map(|t| t.0).collect();
    assert_eq!(names[0], "conv1.weight");
    assert_eq!(names[9], "fc3.bias");
    let data = engine::data::digits::load_digits_embedded();
    let rows = 32;
    let mut losses = Vec::new();
    for step in 0..50 {
        let indices: Vec<usize> = (0..rows)
            .map(|i| (step * rows + i * 7919) % data.train.len())
            .collect();
        let (x, t) = digits_28(&data.train, &indices);
        let mut order = Vec::new();
        let loss = r
            .forward_backward(&x, &t, &mut |i, u| {
                let mut g = Vec::new();
                u.append_to(UnitData::Grads, &mut g);
                assert!(g.iter().any(|v| *v != 0.0), "unit {i}: zero gradient");
                order.push(i);
                u.step(0.05);
            })
            .expect("step");
        assert_eq!(order, [4, 3, 2, 1, 0], "head first");
        losses.push(loss);
    }
    let first: f32 = losses[..5].iter().sum::<f32>() / 5.0;
    let last: f32 = losses[45..].iter().sum::<f32>() / 5.0;
    let n = data.test.len().min(256);
    let (x, y) = digits_28(&data.test, &(0..n).collect::<Vec<_>>());
    let logits = r.logits(&x).expect("logits");
    assert_eq!(logits.shape, vec![n, 10]);
    let correct = (0..n)
        .filter(|&i| {
            let row = &logits.data[i * 10..(i + 1) * 10];
            (0..10).max_by(|&a, &b| row[a].total_cmp(&row[b])) == Some(y[i])
        })
        .count();
    println!(
        "torchscript lenet5 digits 28x28: loss {first:.3} (first 5 steps) -> {last:.3} (last 5), \
         eval accuracy {correct}/{n}"
    );
    // LeNet-5 with PyTorch's default init leaves the 2.30 plateau slowly: 50 steps at lr 0.05
    // reach ~1.5 and ~60% held-out accuracy.
    assert!(last < first * 0.8, "loss {first} -> {last}");
    assert!(correct * 10 > n * 3, "accuracy {correct}/{n}");
    // Values round-trip and reach the module: zeroing them gives constant logits.
    let flat = r.flat_values();
    r.set_flat_values(&vec![0.0; flat.len()]);
    let zero = r.logits(&x).expect("logits");
    assert!(zero.data.iter().all(|v| *v == 0.0));
    r.set_flat_values(&flat);
    assert_eq!(r.logits(&x).expect("logits").data, logits.data);
    // Typed errors for inputs and outputs.
    let bad = HostTensor::zeros(&[2, 3, 28, 28]);
    let err = r
        .forward_backward(&bad, &[0, 1], &mut |_, _| {})
        .expect_err("3 channels");
    assert!(
        err.to_string()
            .contains("does not fit the TorchScript module"),
        "{err}"
    );
    let conv_only = dir.join("conv_only.pt");
    run_python(
        &python,
        &[
            "-c",
            "import sys, torch; torch.jit.script(torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3))).save(sys.argv[1])",
            conv_only.to_str().expect("utf-8"),
        ],
    );
    let mut c = TchReplica::from_torchscript(&conv_only, &OptimizerConfig::sgd(), "cpu")
        .expect("conv module");
    assert_eq!(c.layer_names(), ["0"]);
    let err = c
        .logits(&HostTensor::zeros(&[2, 1, 8, 8]))
        .expect_err("4-D output");
    assert!(err.to_string().contains("expected 2-D"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn torchscript_file_errors_are_typed() {
    let dir = temp_dir("script-errors");
    let missing = dir.join("nope.pt");
    let err = TchReplica::from_torchscript(&missing, &OptimizerConfig::sgd(), "cpu")
        .err()
        .expect("missing");
    assert!(matches!(err, TchBackendError::ModelFile { .. }), "{err}");
    assert!(err.to_string().contains("nope.pt"), "{err}");
    let err = TchReplica::from_torchscript(&dir, &OptimizerConfig::sgd(), "cpu")
        .err()
        .expect("a folder");
    assert!(err.to_string().contains("not a regular file"), "{err}");
    let garbage = dir.join("garbage.pt");
    std::fs::write(&garbage, b"this is not a zip archive").expect("write");
    let err = TchReplica::from_torchscript(&garbage, &OptimizerConfig::sgd(), "cpu")
        .err()
        .expect("garbage");
    assert!(
        matches!(err, TchBackendError::NotTorchScript { .. }),
        "{err}"
    );
    println!("not TorchScript: {err}");
    let _ = std::fs::remove_dir_all(&dir);
}
