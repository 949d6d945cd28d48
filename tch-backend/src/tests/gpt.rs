//! `gpt-tiny` mirrored in libtorch against the built-in engine: layout and names, per-parameter
//! gradients and loss of one forward/backward, eval logits, a 30-step AdamW run, staged vs
//! plain backward, and bad token batches as typed errors.

use engine::model::Model;
use engine::models::gpt::{gpt_tiny, GptConfig};
use engine::optim::OptimizerConfig;
use engine::replica::{BuiltinReplica, ModelReplica, ReplicaError, UnitData};
use engine::tensor::Tensor as HostTensor;

use super::{grads_of, max_rel_diff, param_layout, pseudo_random};
use crate::{measure_backward, TchReplica};

/// A small config: 3 blocks, 2 heads, context 8.
fn small() -> GptConfig {
    GptConfig {
        vocab: 11,
        context: 8,
        dim: 16,
        heads: 2,
        layers: 3,
    }
}

/// `[batch, seq]` token ids (f32) in `0..vocab` and one next-token target per position, as
/// `CharCorpus::sample_batch` makes them (row `b·T + t` predicts the token after `t`).
fn tokens(batch: usize, seq: usize, vocab: usize, seed: u64) -> (HostTensor, Vec<usize>) {
    let ids: Vec<usize> = pseudo_random(batch * (seq + 1), seed)
        .iter()
        .map(|v| (((v + 1.0) / 2.0 * vocab as f32) as usize).min(vocab - 1))
        .collect();
    let mut input = Vec::with_capacity(batch * seq);
    let mut targets = Vec::with_capacity(batch * seq);
    for window in ids.chunks_exact(seq + 1) {
        input.extend(window[..seq].iter().map(|&id| id as f32));
        targets.extend_from_slice(&window[1..]);
    }
    (HostTensor::from_vec(&[batch, seq], input), targets)
}

/// One forward/backward per batch shape in both backends from the same weights; returns the
/// worst loss and gradient relative differences.
fn gradient_parity(cfg: &GptConfig, seed: u64, shapes: &[(usize, usize)]) -> (f64, f64) {
    let model = gpt_tiny(cfg, seed);
    let mut tch = TchReplica::from_model(&model, &OptimizerConfig::adamw(), "cpu").expect("tch");
    let mut builtin = BuiltinReplica::new(gpt_tiny(cfg, seed), &OptimizerConfig::adamw());
    assert_eq!(tch.unit_infos(), builtin.unit_infos());
    assert_eq!(tch.layer_names(), builtin.layer_names());
    assert_eq!(tch.flat_values(), builtin.flat_values(), "initial values");
    let (mut worst_loss, mut worst_grad) = (0.0f64, 0.0f64);
    for (i, &(batch, seq)) in shapes.iter().enumerate() {
        let (input, targets) = tokens(batch, seq, cfg.vocab, 10 + i as u64);
        let (loss_b, ready_b) = grads_of(&mut builtin, &input, &targets);
        let (loss_t, ready_t) = grads_of(&mut tch, &input, &targets);
        let order_b: Vec<usize> = ready_b.iter().map(|r| r.0).collect();
        let order_t: Vec<usize> = ready_t.iter().map(|r| r.0).collect();
        let mut want: Vec<usize> = (0..model.layers.len()).collect();
        want.reverse();
        assert_eq!(order_b, want, "built-in: head first, one unit per layer");
        assert_eq!(order_t, want, "tch: head first, one stage per unit");
        let loss_rel = f64::from((loss_b - loss_t).abs()) / f64::from(loss_b.abs());
        assert!(loss_rel <= 1e-5, "loss {loss_b} vs {loss_t} ({loss_rel:e})");
        worst_loss = worst_loss.max(loss_rel);
        let mut worst_here = (0.0f64, String::new());
        for ((index, gb), (_, gt)) in ready_b.iter().zip(&ready_t) {
            let mut off = 0;
            for (name, n) in param_layout(&model, *index) {
                let (b, t) = (&gb[off..off + n], &gt[off..off + n]);
                assert!(b.iter().any(|v| *v != 0.0), "{name}: zero gradient");
                let rel = max_rel_diff(b, t);
                assert!(rel <= 1e-4, "{name}: gradient differs by {rel:e} of max|g|");
                if rel > worst_here.0 {
                    worst_here = (rel, name);
                }
                off += n;
            }
            assert_eq!(off, gb.len());
        }
        worst_grad = worst_grad.max(worst_here.0);
        println!(
            "gpt {cfg:?} batch [{batch}, {seq}]: loss {loss_b} vs {loss_t} (rel {loss_rel:.1e}), \
             worst gradient rel diff {:.1e} ({})",
            worst_here.0, worst_here.1
        );
    }
    (worst_loss, worst_grad)
}

#[test]
fn gpt_gradients_match_builtin_small() {
    gradient_parity(&small(), 3, &[(5, 8), (2, 3)]);
}

#[test]
fn gpt_tiny_gradients_match_builtin() {
    // Full context and a shorter sequence (positions past T get no gradient).
    gradient_parity(&GptConfig::tiny(32), 7, &[(4, 64), (3, 17)]);
}

#[test]
fn gpt_layout_and_named_tensors_are_engine_names() {
    let model = gpt_tiny(&small(), 1);
    let tch = TchReplica::from_model(&model, &OptimizerConfig::adamw(), "cpu").expect("tch");
    let engine: Vec<(String, Vec<usize>, Vec<f32>)> = engine::checkpoint::named_params(&model)
        .into_iter()
        .map(|(n, s, v)| (n, s, v.to_vec()))
        .collect();
    let ours = tch.named_tensors();
    assert_eq!(ours, engine);
    let names: Vec<&str> = ours.iter().map(|t| t.0.as_str()).collect();
    assert_eq!(
        names[..4],
        [
            "embed.token",
            "embed.position",
            "block0.ln1.weight",
            "block0.ln1.bias"
        ]
    );
    assert_eq!(
        names[names.len() - 4..],
        [
            "head.ln.weight",
            "head.ln.bias",
            "head.proj.weight",
            "head.proj.bias"
        ]
    );
    assert_eq!(
        tch.layer_names(),
        ["embed", "block0", "block1", "block2", "head"]
    );
}

fn logits_parity(model: Model, batch: usize, seq: usize, vocab: usize) -> f32 {
    let mut tch = TchReplica::from_model(&model, &OptimizerConfig::adamw(), "cpu").expect("tch");
    let mut model = model;
    let (input, _) = tokens(batch, seq, vocab, 5);
    let want = model.forward(&input, false);
    let got = tch.logits(&input).expect("logits");
    assert_eq!(want.shape, [batch * seq, vocab]);
    assert_eq!(got.shape, want.shape);
    let diff = want
        .data
        .iter()
        .zip(&got.data)
        .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
    println!("gpt logits [{batch}, {seq}] vocab {vocab}: max abs diff {diff:.1e}");
    assert!(diff <= 1e-4, "logits differ by {diff:e}");
    diff
}

#[test]
fn gpt_logits_match_builtin_eval_forward() {
    logits_parity(gpt_tiny(&GptConfig::tiny(32), 2), 3, 64, 32);
    logits_parity(gpt_tiny(&small(), 4), 4, 5, 11);
}

/// 30 AdamW steps on one fixed batch in both backends, each with its own gradients.
#[test]
fn gpt_adamw_training_agrees() {
    let cfg = GptConfig {
        vocab: 32,
        context: 32,
        dim: 32,
        heads: 4,
        layers: 2,
    };
    let adamw = OptimizerConfig::AdamW {
        beta1: 0.9,
        beta2: 0.99,
        eps: 1e-8,
        weight_decay: 0.01,
    };
    let lr = 3e-3;
    let mut builtin = BuiltinReplica::new(gpt_tiny(&cfg, 5), &adamw);
    let mut tch = TchReplica::from_model(&builtin.model, &adamw, "cpu").expect("tch");
    let (input, targets) = tokens(8, 32, cfg.vocab, 77);
    let mut losses = Vec::new();
    for _ in 0..30 {
        let lb = builtin
            .forward_backward(&input, &targets, &mut |_, u| u.step(lr))
            .expect("builtin step");
        let lt = tch
            .forward_backward(&input, &targets, &mut |_, u| u.step(lr))
            .expect("tch step");
        losses.push((lb, lt));
    }
    let (first, last) = (losses[0], losses[losses.len() - 1]);
    let loss_rel = f64::from((last.0 - last.1).abs()) / f64::from(last.0);
    let mut values_rel = 0.0f64;
    for info in builtin.unit_infos() {
        let (mut vb, mut vt) = (Vec::new(), Vec::new());
        builtin.with_unit(info.index, &mut |u| u.append_to(UnitData::Values, &mut vb));
        tch.with_unit(info.index, &mut |u| u.append_to(UnitData::Values, &mut vt));
        values_rel = values_rel.max(max_rel_diff(&vb, &vt));
    }
    println!(
        "gpt adamw 30 steps: loss {:.4}/{:.4} → {:.4}/{:.4} (builtin/tch), final loss rel diff \
         {loss_rel:.1e}, values rel diff {values_rel:.1e} of max|θ|",
        first.0, first.1, last.0, last.1
    );
    assert!(
        last.0 < 0.7 * first.0,
        "builtin loss did not fall: {losses:?}"
    );
    assert!(last.1 < 0.7 * first.1, "tch loss did not fall: {losses:?}");
    assert!(loss_rel <= 1e-3, "final losses differ: {loss_rel:e}");
    assert!(values_rel <= 1e-3, "final values differ: {values_rel:e}");
}

#[test]
fn gpt_staged_gradients_match_plain_backward() {
    let model = gpt_tiny(&small(), 6);
    let (input, targets) = tokens(3, 8, 11, 9);
    let mut tch = TchReplica::from_model(&model, &OptimizerConfig::adamw(), "cpu").expect("tch");
    let (loss, staged) = grads_of(&mut tch, &input, &targets);
    tch.zero_grads().expect("zero");
    let logits = tch.forward_plain(&input, true).expect("plain forward");
    let plain_loss = tch.loss(&logits, &targets).expect("loss");
    plain_loss.backward();
    assert!((plain_loss.double_value(&[]) as f32 - loss).abs() <= 1e-6);
    for (index, g) in staged {
        let mut plain = Vec::new();
        tch.with_unit(index, &mut |u| u.append_to(UnitData::Grads, &mut plain));
        let rel = max_rel_diff(&plain, &g);
        assert!(rel <= 1e-6, "unit {index}: staged vs plain {rel:e}");
    }
    let t = measure_backward(&model, &input, &targets, 2).expect("timing");
    assert!(t.staged_ms > 0.0 && t.plain_ms > 0.0, "{t:?}");
}

#[test]
fn bad_token_batches_are_typed_errors() {
    let cfg = small();
    let model = gpt_tiny(&cfg, 8);
    let mut tch = TchReplica::from_model(&model, &OptimizerConfig::adamw(), "cpu").expect("tch");
    let (good, targets) = tokens(2, 4, cfg.vocab, 3);
    let mut cases = Vec::new();
    for bad in [11.0, -1.0, 2.5] {
        let mut x = good.clone();
        x.data[3] = bad;
        cases.push((format!("id {bad}"), x, targets.clone()));
    }
    let (long, long_targets) = tokens(1, cfg.context + 1, cfg.vocab, 4);
    cases.push(("longer than context".into(), long, long_targets));
    let flat = HostTensor::from_vec(&[2, 4, 1], good.data.clone());
    cases.push(("3-d ids".into(), flat, targets.clone()));
    for (what, x, t) in &cases {
        let err = tch.forward_backward(x, t, &mut |_, _| {});
        assert!(
            matches!(err, Err(ReplicaError::Backend { backend: "tch", .. })),
            "{what}: {err:?}"
        );
        assert!(tch.logits(x).is_err(), "{what}: logits");
    }
    let err = tch.forward_backward(&good, &targets[1..], &mut |_, _| {});
    assert!(matches!(err, Err(ReplicaError::Batch(_))), "{err:?}");
    tch.forward_backward(&good, &targets, &mut |_, _| {})
        .expect("recovers");
}
