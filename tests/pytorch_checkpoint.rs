//! Checkpoints PyTorch reads: `dreamddp train --save` writes safetensors that PyTorch loads
//! with `load_state_dict(strict=True)` into the equivalent `nn.Module`
//! (`examples/pytorch_load_checkpoint.py`), and that module gives the same logits as
//! dreamddp on the same batch (max abs diff ≤ 1e-5).
//!
//! Needs Python with `torch` and `safetensors`: the interpreter in `$DREAMDDP_TORCH_PYTHON`,
//! or the venv `bench/install_torch.sh` makes. Without one the test says so and passes,
//! unless `DREAMDDP_REQUIRE_TORCH=1` (CI's torch stage sets it), where a missing torch fails.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::{dreamddp, scratch, text};
use engine::checkpoint::load_safetensors;
use engine::data::digits::load_digits_embedded;
use engine::model::Model;
use engine::tensor::Tensor;
use safetensors::tensor::{Dtype, TensorView};

fn torch_python() -> Option<PathBuf> {
    let candidates = std::env::var_os("DREAMDDP_TORCH_PYTHON")
        .map(PathBuf::from)
        .into_iter()
        .chain(
            std::env::var_os("HOME")
                .map(|h| Path::new(&h).join(".cache/dreamddp/torch/venv-2.13.0/bin/python")),
        );
    for py in candidates {
        let ok = Command::new(&py)
            .args(["-c", "import torch, safetensors.torch"])
            .env("CUDA_VISIBLE_DEVICES", "")
            .output()
            .is_ok_and(|o| o.status.success());
        if ok {
            return Some(py);
        }
    }
    None
}

/// Trains `model` briefly with `--save`, computes its logits on 64 test digits with the
/// built-in engine, and has PyTorch check them.
fn check_model(py: &Path, kind: &str, build: fn() -> Model) {
    let dir = scratch(&format!("ckpt-{kind}"));
    let ckpt = dir.join(format!("{kind}.safetensors"));
    let o = dreamddp(&[
        "train",
        "--quiet",
        "--model",
        kind,
        "--dataset",
        "digits",
        "--workers",
        "2",
        "--steps",
        "40",
        "--eval-every",
        "0",
        "--save",
        ckpt.to_str().expect("utf-8 path"),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let mut model = build();
    let before = model.flat_values();
    load_safetensors(&mut model, &std::fs::read(&ckpt).expect("checkpoint")).expect("load");
    assert_ne!(
        model.flat_values(),
        before,
        "the trained checkpoint equals the seed's init"
    );

    let data = load_digits_embedded();
    let n = 64;
    let dim: usize = data.test.sample_shape.iter().product();
    let mut shape = vec![n];
    shape.extend(&data.test.sample_shape);
    let input = Tensor::from_vec(&shape, data.test.features.values(0..n * dim).into_owned());
    let logits = model.forward(&input, false);
    let batch = safetensors::serialize(
        [
            (
                "input",
                TensorView::new(
                    Dtype::F32,
                    input.shape.clone(),
                    bytemuck::cast_slice(&input.data),
                )
                .expect("view"),
            ),
            (
                "logits",
                TensorView::new(
                    Dtype::F32,
                    logits.shape.clone(),
                    bytemuck::cast_slice(&logits.data),
                )
                .expect("view"),
            ),
        ],
        None,
    )
    .expect("serialize");
    let batch_path = dir.join("batch.safetensors");
    std::fs::write(&batch_path, batch).expect("write batch");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/pytorch_load_checkpoint.py");
    let o = Command::new(py)
        .arg(&script)
        .arg(&ckpt)
        .arg("--check")
        .arg(&batch_path)
        .env("CUDA_VISIBLE_DEVICES", "")
        .output()
        .expect("run python");
    let out = text(&o);
    assert!(o.status.success(), "PyTorch check failed:\n{out}");
    assert!(out.contains("OK") && out.contains("max |logits"), "{out}");
    eprintln!(
        "{kind}: {}",
        out.lines().find(|l| l.contains("max |")).unwrap_or("")
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn pytorch_loads_our_checkpoints_and_gets_the_same_logits() {
    let Some(py) = torch_python() else {
        assert!(
            std::env::var_os("DREAMDDP_REQUIRE_TORCH").is_none(),
            "DREAMDDP_REQUIRE_TORCH is set but no Python with torch + safetensors was found \
             (run bench/install_torch.sh or set DREAMDDP_TORCH_PYTHON)"
        );
        eprintln!("skipped: no Python with torch + safetensors (run bench/install_torch.sh)");
        return;
    };
    check_model(&py, "mlp", || {
        engine::models::mlp::mlp(64, engine::models::mlp::MLP_DIGITS_HIDDEN, 10, 0)
    });
    check_model(&py, "cnn", || engine::models::cnn::cnn(1, 8, 8, 10, 0));
}

#[test]
fn a_checkpoint_of_another_model_is_refused_with_the_tensor_it_lacks() {
    let dir = scratch("ckpt-mismatch");
    let ckpt = dir.join("mlp.safetensors");
    let o = dreamddp(&[
        "train",
        "--quiet",
        "--dataset",
        "digits",
        "--workers",
        "1",
        "--steps",
        "2",
        "--eval-every",
        "0",
        "--save",
        ckpt.to_str().expect("utf-8 path"),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let o = dreamddp(&[
        "train",
        "--quiet",
        "--model",
        "cnn",
        "--dataset",
        "digits",
        "--steps",
        "2",
        "--load",
        ckpt.to_str().expect("utf-8 path"),
    ]);
    assert!(!o.status.success());
    let t = text(&o);
    assert!(
        t.contains("cannot load checkpoint")
            && t.contains("model `cnn`")
            && t.contains("fc2.weight"),
        "{t}"
    );
    let o = dreamddp(&[
        "train",
        "--quiet",
        "--steps",
        "2",
        "--load",
        "/nonexistent.safetensors",
    ]);
    assert!(!o.status.success());
    assert!(
        text(&o).contains("cannot read checkpoint /nonexistent.safetensors"),
        "{}",
        text(&o)
    );
    // Resuming from the checkpoint works.
    let o = dreamddp(&[
        "train",
        "--quiet",
        "--dataset",
        "digits",
        "--workers",
        "1",
        "--steps",
        "2",
        "--eval-every",
        "0",
        "--load",
        ckpt.to_str().expect("utf-8 path"),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let _ = std::fs::remove_dir_all(&dir);
}

/// The embedded digits written as a generic tensor data set (`train_x [N, …]` f32 or u8,
/// `train_y [N]` i64): it trains like the built-in loader's copy, and a model whose input it
/// does not fit is refused with the shapes named.
#[test]
fn a_safetensors_data_set_trains_and_a_shape_misfit_is_explained() {
    let dir = scratch("tensor-data");
    let tt = load_digits_embedded();
    let write = |path: &Path, flat: bool| {
        let shape = |n: usize| -> Vec<usize> {
            if flat {
                vec![n, 64]
            } else {
                vec![n, 1, 8, 8]
            }
        };
        let as_bytes = |f: &engine::data::Features| -> Vec<u8> {
            f.to_vec()
                .iter()
                .map(|&v| (v * 255.0).round() as u8)
                .collect()
        };
        let (tx, vx) = (as_bytes(&tt.train.features), as_bytes(&tt.test.features));
        let ty: Vec<u8> = tt
            .train
            .labels
            .iter()
            .flat_map(|&l| i64::from(l).to_le_bytes())
            .collect();
        let vy: Vec<u8> = tt
            .test
            .labels
            .iter()
            .flat_map(|&l| i64::from(l).to_le_bytes())
            .collect();
        let bytes = safetensors::serialize(
            [
                (
                    "train_x",
                    TensorView::new(Dtype::U8, shape(tt.train.len()), &tx).unwrap(),
                ),
                (
                    "train_y",
                    TensorView::new(Dtype::I64, vec![tt.train.len()], &ty).unwrap(),
                ),
                (
                    "test_x",
                    TensorView::new(Dtype::U8, shape(tt.test.len()), &vx).unwrap(),
                ),
                (
                    "test_y",
                    TensorView::new(Dtype::I64, vec![tt.test.len()], &vy).unwrap(),
                ),
            ],
            None,
        )
        .unwrap();
        std::fs::write(path, bytes).unwrap();
    };
    let images = dir.join("digits-images.safetensors");
    let flat = dir.join("digits-flat.safetensors");
    write(&images, false);
    write(&flat, true);
    let o = dreamddp(&[
        "train",
        "--quiet",
        "--model",
        "cnn",
        "--dataset",
        images.to_str().unwrap(),
        "--workers",
        "2",
        "--steps",
        "200",
        "--eval-every",
        "0",
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let t = text(&o);
    let acc: f64 = t
        .split("test accuracy ")
        .nth(1)
        .and_then(|r| r.split('%').next())
        .and_then(|a| a.parse().ok())
        .unwrap_or_else(|| panic!("no accuracy in {t}"));
    assert!(acc > 80.0, "cnn on the digits tensor file: {acc}%");
    let o = dreamddp(&[
        "train",
        "--quiet",
        "--model",
        "cnn",
        "--dataset",
        flat.to_str().unwrap(),
        "--steps",
        "2",
    ]);
    assert!(!o.status.success());
    assert!(text(&o).contains("samples of shape [64]"), "{}", text(&o));
    let _ = std::fs::remove_dir_all(&dir);
}
