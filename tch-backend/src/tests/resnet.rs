//! ResNet-20 with BatchNorm: layout and names, staged vs plain gradients, running statistics
//! in the synced values, eval vs train mode, named tensors, a short training run, and (with
//! the PyTorch venv) the same logits from PyTorch's module loaded with our tensors.

use std::path::{Path, PathBuf};
use std::process::Command;

use engine::optim::OptimizerConfig;
use engine::replica::{ModelReplica, UnitData};
use engine::tensor::Tensor as HostTensor;

use super::{batch, max_rel_diff, pseudo_random};
use crate::{TchBackendError, TchReplica};

const VENV_PYTHON: &str = "/root/.cache/dreamddp/torch/venv-2.13.0/bin/python";

fn sgd_momentum() -> OptimizerConfig {
    OptimizerConfig::Sgd {
        momentum: 0.9,
        weight_decay: 0.0,
        nesterov: false,
    }
}

fn resnet(in_ch: usize, side: usize, seed: u64) -> TchReplica {
    TchReplica::resnet20(in_ch, side, side, 10, seed, &OptimizerConfig::sgd(), "cpu")
        .expect("resnet20")
}

fn unit_values(r: &mut TchReplica, index: usize) -> Vec<f32> {
    let mut v = Vec::new();
    r.with_unit(index, &mut |u| u.append_to(UnitData::Values, &mut v));
    v
}

#[test]
fn resnet20_layout_and_names() {
    let r = resnet(3, 32, 1);
    let infos = r.unit_infos();
    let layout: Vec<(String, usize)> = infos.iter().map(|i| (i.name.clone(), i.params)).collect();
    println!("resnet20 (3x32x32, 10 classes) units: {layout:?}");
    let names: Vec<&str> = layout.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        names,
        [
            "stem", "layer1.0", "layer1.1", "layer1.2", "layer2.0", "layer2.1", "layer2.2",
            "layer3.0", "layer3.1", "layer3.2", "fc"
        ]
    );
    let lens: Vec<usize> = layout.iter().map(|l| l.1).collect();
    assert_eq!(
        lens,
        [496, 4736, 4736, 4736, 14080, 18688, 18688, 55808, 74240, 74240, 650]
    );
    assert_eq!(r.layer_names(), names);
    assert_eq!(r.flat_values().len(), lens.iter().sum::<usize>());
    let tensors = r.named_tensors();
    let params: usize = tensors
        .iter()
        .filter(|t| !t.0.contains("running_") && !t.0.contains("num_batches"))
        .map(|t| t.2.len())
        .sum();
    println!("resnet20: {} tensors, {params} parameters", tensors.len());
    assert_eq!(params, 269_722, "0.27M parameters as in the paper");
    let find = |n: &str| tensors.iter().find(|t| t.0 == n).map(|t| t.1.clone());
    assert_eq!(find("conv1.weight"), Some(vec![16, 3, 3, 3]));
    assert_eq!(find("bn1.running_var"), Some(vec![16]));
    assert_eq!(find("bn1.num_batches_tracked"), Some(vec![]));
    assert_eq!(find("layer2.0.conv1.weight"), Some(vec![32, 16, 3, 3]));
    assert_eq!(find("layer3.2.bn2.running_mean"), Some(vec![64]));
    assert_eq!(find("fc.weight"), Some(vec![10, 64]));
    // Deterministic from the seed, different across seeds.
    assert_eq!(resnet(3, 32, 1).flat_values(), r.flat_values());
    assert_ne!(resnet(3, 32, 2).flat_values(), r.flat_values());
    // Kaiming-normal fan_out: std √(2/(16·9)) ≈ 0.118 for the stem conv.
    let w = &tensors[0].2;
    let std = (w.iter().map(|v| v * v).sum::<f32>() / w.len() as f32).sqrt();
    assert!((std - 0.118).abs() < 0.02, "stem conv std {std}");
    // MNIST-sized inputs: one channel.
    let m = resnet(1, 28, 1);
    assert_eq!(m.unit_infos()[0].params, 16 * 9 + 64);
}

#[test]
fn staged_gradients_match_plain_backward() {
    let mut r = resnet(1, 28, 3);
    let (input, targets) = batch(&[4, 1, 28, 28], 10, 7);
    let mut staged = Vec::new();
    let loss_staged = r
        .forward_backward(&input, &targets, &mut |i, u| {
            let mut g = Vec::new();
            u.append_to(UnitData::Grads, &mut g);
            staged.push((i, g));
        })
        .expect("staged");
    let order: Vec<usize> = staged.iter().map(|s| s.0).collect();
    assert_eq!(order, (0..11).rev().collect::<Vec<_>>(), "head first");
    // Plain: one graph, one backward.
    r.zero_grads().expect("zero");
    let logits = r.forward_plain(&input, true).expect("plain forward");
    let loss = r.loss(&logits, &targets).expect("loss");
    loss.backward();
    let loss_plain = loss.double_value(&[]) as f32;
    assert!((loss_staged - loss_plain).abs() <= 1e-6 * loss_plain.abs());
    let mut worst = 0.0f64;
    for (i, g) in &staged {
        let mut p = Vec::new();
        r.with_unit(*i, &mut |u| u.append_to(UnitData::Grads, &mut p));
        assert!(g.iter().any(|v| *v != 0.0), "unit {i}: zero gradient");
        let rel = max_rel_diff(&p, g);
        worst = worst.max(rel);
        assert!(rel <= 1e-5, "unit {i}: staged vs plain {rel:e}");
    }
    println!("resnet20 staged vs plain backward: loss {loss_staged}, worst rel diff {worst:.1e}");
}

#[test]
fn running_stats_are_synced_values() {
    let mut a = resnet(1, 8, 5);
    let mut b = resnet(1, 8, 5);
    let (xa, ta) = batch(&[8, 1, 8, 8], 10, 1);
    let (xb, tb) = batch(&[8, 1, 8, 8], 10, 2);
    let mut grads_len = Vec::new();
    a.forward_backward(&xa, &ta, &mut |_, u| {
        let mut g = Vec::new();
        u.append_to(UnitData::Grads, &mut g);
        grads_len.push(g.len());
    })
    .expect("a");
    b.forward_backward(&xb, &tb, &mut |_, _| {}).expect("b");
    let infos = a.unit_infos();
    let mut lens: Vec<usize> = infos.iter().map(|i| i.params).collect();
    lens.reverse();
    assert_eq!(grads_len, lens, "grads have the values' length");
    // Stem unit: conv1 (144) | bn1 weight, bias (32) | running_mean, running_var (32).
    let stem = unit_values(&mut a, 0);
    let named = a.named_tensors();
    let get = |n: &str| named.iter().find(|t| t.0 == n).expect(n).2.clone();
    assert_eq!(&stem[176..192], &get("bn1.running_mean")[..]);
    assert_eq!(&stem[192..208], &get("bn1.running_var")[..]);
    assert!(
        get("bn1.running_mean").iter().any(|v| *v != 0.0),
        "stats moved"
    );
    assert_eq!(get("bn1.num_batches_tracked"), vec![1.0]);
    // Grads: zeros in the buffer slots; writes there are ignored.
    let mut g = Vec::new();
    a.with_unit(0, &mut |u| u.append_to(UnitData::Grads, &mut g));
    assert!(g[176..].iter().all(|v| *v == 0.0));
    let ones = vec![1.0; g.len()];
    a.with_unit(0, &mut |u| u.write_from(UnitData::Grads, &ones));
    assert_eq!(
        unit_values(&mut a, 0),
        stem,
        "grad writes leave values alone"
    );
    // Averaging two replicas' values averages their running statistics.
    let (va, vb) = (a.flat_values(), b.flat_values());
    let avg: Vec<f32> = va.iter().zip(&vb).map(|(x, y)| (x + y) / 2.0).collect();
    let stats =
        |r: &TchReplica, n: &str| r.named_tensors().into_iter().find(|t| t.0 == n).expect(n).2;
    let (ma, mb) = (
        stats(&a, "layer2.1.bn2.running_var"),
        stats(&b, "layer2.1.bn2.running_var"),
    );
    assert_ne!(ma, mb);
    a.set_flat_values(&avg);
    assert!(a.take_deferred_error().is_none());
    let got = stats(&a, "layer2.1.bn2.running_var");
    for ((x, y), z) in ma.iter().zip(&mb).zip(&got) {
        assert!((((x + y) / 2.0) - z).abs() <= 1e-7, "{x} {y} -> {z}");
    }
    assert_eq!(
        stats(&a, "bn1.num_batches_tracked"),
        vec![1.0],
        "counters are per replica"
    );
}

#[test]
fn eval_and_train_mode_differ() {
    let mut r = resnet(1, 8, 9);
    let (x, t) = batch(&[16, 1, 8, 8], 10, 3);
    for _ in 0..3 {
        r.forward_backward(&x, &t, &mut |_, u| u.step(0.05))
            .expect("step");
    }
    let before = r.named_tensors();
    let eval = r.logits(&x).expect("logits");
    assert_eq!(eval.shape, vec![16, 10]);
    assert_eq!(r.named_tensors(), before, "eval changes no statistics");
    assert_eq!(
        r.logits(&x).expect("again").data,
        eval.data,
        "eval is deterministic"
    );
    let train = {
        let _g = tch::no_grad_guard();
        let y = r.forward_plain(&x, true).expect("train forward");
        let mut v = vec![0.0f32; 160];
        y.copy_data(&mut v, 160);
        v
    };
    let diff = max_rel_diff(&train, &eval.data);
    println!("resnet20 eval vs train-mode logits: rel diff {diff:.2e}");
    assert!(diff > 1e-3, "BatchNorm modes should differ ({diff:e})");
    // Wrong input shapes are typed errors.
    let bad = HostTensor::from_vec(&[2, 3, 8, 8], pseudo_random(384, 1));
    let err = r.logits(&bad).expect_err("3 channels");
    assert!(err.to_string().contains("[rows, 1, 8, 8]"), "{err}");
    let err = r
        .forward_backward(&bad, &[0, 1], &mut |_, _| {})
        .expect_err("3 channels");
    assert!(err.to_string().contains("does not fit"), "{err}");
}

#[test]
fn named_tensors_round_trip_and_mismatches() {
    let mut a = resnet(1, 8, 1);
    let b = resnet(1, 8, 2);
    let mut tensors = b.named_tensors();
    a.load_named_tensors(&tensors).expect("load");
    assert_eq!(a.named_tensors(), tensors);
    assert_eq!(a.flat_values(), b.flat_values());
    let before = a.named_tensors();
    let mut wrong_shape = tensors.clone();
    wrong_shape[3].1 = vec![17];
    let err = a.load_named_tensors(&wrong_shape).expect_err("shape");
    assert!(
        matches!(&err, TchBackendError::StateMismatch { name, .. } if name == &tensors[3].0),
        "{err}"
    );
    let missing: Vec<_> = tensors[1..].to_vec();
    let err = a.load_named_tensors(&missing).expect_err("missing");
    assert!(err.to_string().contains("conv1.weight") && err.to_string().contains("missing"));
    tensors.push(("extra.weight".into(), vec![1], vec![0.0]));
    let err = a.load_named_tensors(&tensors).expect_err("extra");
    assert!(err.to_string().contains("extra.weight"), "{err}");
    assert_eq!(a.named_tensors(), before, "nothing changed on error");
    let err = TchReplica::resnet20(1, 2, 2, 10, 0, &OptimizerConfig::sgd(), "cpu")
        .err()
        .expect("too small");
    assert!(matches!(err, TchBackendError::InvalidConfig(_)), "{err}");
}

#[test]
fn resnet20_learns_digits() {
    let data = engine::data::digits::load_digits_embedded();
    let train = &data.train;
    assert_eq!(train.sample_shape, vec![1, 8, 8]);
    let mut r = TchReplica::resnet20(1, 8, 8, 10, 42, &sgd_momentum(), "cpu").expect("resnet");
    let rows = 32;
    let mut input = HostTensor::zeros(&[rows, 1, 8, 8]);
    let mut targets = Vec::new();
    let mut losses = Vec::new();
    for step in 0..100 {
        let indices: Vec<usize> = (0..rows)
            .map(|i| (step * rows + i * 7919) % train.len())
            .collect();
        train.batch(&indices, &mut input, &mut targets);
        let loss = r
            .forward_backward(&input, &targets, &mut |_, u| u.step(0.05))
            .expect("step");
        losses.push(loss);
    }
    let first: f32 = losses[..10].iter().sum::<f32>() / 10.0;
    let last: f32 = losses[90..].iter().sum::<f32>() / 10.0;
    // Held-out accuracy in eval mode (running statistics).
    let test = &data.test;
    let n = test.len().min(256);
    let mut x = HostTensor::zeros(&[n, 1, 8, 8]);
    let mut y = Vec::new();
    test.batch(&(0..n).collect::<Vec<_>>(), &mut x, &mut y);
    let logits = r.logits(&x).expect("logits");
    let correct = (0..n)
        .filter(|&i| {
            let row = &logits.data[i * 10..(i + 1) * 10];
            let best = (0..10)
                .max_by(|&a, &b| row[a].total_cmp(&row[b]))
                .unwrap_or(0);
            best == y[i]
        })
        .count();
    println!(
        "resnet20 digits: loss {first:.3} (first 10 steps) -> {last:.3} (last 10), eval accuracy {}/{n}",
        correct
    );
    assert!(last < first * 0.5, "loss {first} -> {last}");
    assert!(correct * 10 > n * 7, "accuracy {correct}/{n}");
}

/// The PyTorch venv's python, or `None` (skipped) unless `DREAMDDP_REQUIRE_TORCH` is set.
pub(super) fn torch_python() -> Option<PathBuf> {
    let path = PathBuf::from(VENV_PYTHON);
    if path.exists() {
        return Some(path);
    }
    assert!(
        std::env::var_os("DREAMDDP_REQUIRE_TORCH").is_none(),
        "DREAMDDP_REQUIRE_TORCH is set but {VENV_PYTHON} is missing"
    );
    println!("skipped: {VENV_PYTHON} not found");
    None
}

pub(super) fn example(name: &str) -> PathBuf {
    // The examples live at the workspace root (`examples/`), beside the other user-facing ones.
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../examples")
        .join(name)
}

#[test]
fn resnet20_matches_pytorch() {
    let Some(python) = torch_python() else {
        return;
    };
    let mut r = TchReplica::resnet20(3, 32, 32, 10, 7, &sgd_momentum(), "cpu").expect("resnet");
    // Train a few steps so running statistics and weights are not at their initial values.
    let (x, t) = batch(&[8, 3, 32, 32], 10, 11);
    for _ in 0..3 {
        r.forward_backward(&x, &t, &mut |_, u| u.step(0.05))
            .expect("step");
    }
    let want = r.logits(&x).expect("logits");
    let dir = std::env::temp_dir().join(format!("dreamddp-resnet-check-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let mut data: Vec<f32> = Vec::new();
    let mut entries = Vec::new();
    for (name, shape, values) in r.named_tensors() {
        entries.push(format!("[\"{name}\", {shape:?}, {}]", data.len()));
        data.extend_from_slice(&values);
    }
    let input_at = data.len();
    data.extend_from_slice(&x.data);
    let manifest = format!(
        "{{\"tensors\": [{}], \"input\": [{:?}, {input_at}], \"classes\": 10, \"in_ch\": 3}}",
        entries.join(", "),
        x.shape
    );
    std::fs::write(dir.join("manifest.json"), manifest).expect("manifest");
    let bytes: Vec<u8> = data.iter().flat_map(|v| v.to_le_bytes()).collect();
    std::fs::write(dir.join("data.bin"), bytes).expect("data");
    let out = Command::new(&python)
        .arg(example("resnet20_check.py"))
        .arg(&dir)
        .output()
        .expect("run python");
    assert!(
        out.status.success(),
        "python failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let got: Vec<f32> = std::fs::read(dir.join("logits.bin"))
        .expect("logits.bin")
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(got.len(), want.data.len());
    let diff = want
        .data
        .iter()
        .zip(&got)
        .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
    println!("resnet20 vs PyTorch (load_state_dict strict, eval): max abs logit diff {diff:.1e}");
    assert!(diff <= 1e-4, "logits differ by {diff:e}");
}
