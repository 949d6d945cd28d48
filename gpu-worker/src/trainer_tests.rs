//! Tests of the node training loop on the embedded digits data set (no ../shared needed).

use std::sync::Arc;

use engine::data::digits::load_digits_embedded;
use engine::optim::OptimizerConfig;
use engine::outer::OuterConfig;
use engine::plan::{ScheduleKind, Strategy};

use super::*;
use crate::planning::{build_plan, PlanInputs};
use node::task::{ModelKind, Task, TaskData};

fn digits_task(model: ModelKind) -> Task {
    Task::new(
        model,
        "digits",
        TaskData::Images(Arc::new(load_digits_embedded())),
    )
    .expect("valid pairing")
}

fn config(strategy: Strategy, steps: u64) -> TrainConfig {
    TrainConfig {
        workers: 2,
        strategy,
        steps,
        batch: 16,
        lr: 0.05,
        warmup: 10,
        optimizer: OptimizerConfig::Sgd {
            momentum: 0.9,
            weight_decay: 0.0,
            nesterov: true,
        },
        link: LinkModel::unshaped(),
        seed: 7,
        eval_every: 0,
        eval_limit: None,
        backend: node::backend::Backend::Builtin,
        initial_values: None,
        collective: Default::default(),
    }
}

/// Plan inputs for `cfg` on `task`: its strategy with period `period`, the equal schedule,
/// delay 1, whole-layer units chosen by default, the default outer optimizer.
fn inputs<'a>(task: &'a Task, cfg: &'a TrainConfig, period: u64) -> PlanInputs<'a> {
    PlanInputs {
        task,
        strategy: cfg.strategy,
        period,
        schedule: ScheduleKind::Equal,
        overrides: &[],
        bubble_filling: false,
        delay: Some(1),
        sync_unit_kb: None,
        outer: OuterConfig::default(),
        link: &cfg.link,
        workers: cfg.workers,
        batch: cfg.batch,
        seed: cfg.seed,
        measured: None,
        backend: &node::backend::Backend::Builtin,
    }
}

fn run(task: &Task, cfg: &TrainConfig, period: u64, schedule: ScheduleKind) -> RunReport {
    run_with(task, cfg, period, schedule, 1, OuterConfig::default())
}

fn run_with(
    task: &Task,
    cfg: &TrainConfig,
    period: u64,
    schedule: ScheduleKind,
    delay: u64,
    outer: OuterConfig,
) -> RunReport {
    let plan = build_plan(&PlanInputs {
        schedule,
        delay: Some(delay),
        outer,
        ..inputs(task, cfg, period)
    })
    .expect("plan");
    train(task, cfg, plan, Box::new(|_, _| {})).expect("training succeeds")
}

#[test]
fn every_strategy_learns_digits() {
    let task = digits_task(ModelKind::Mlp);
    // DiLoCo's published outer momentum (0.9, tuned for H = 500 inner steps) diverges at H = 4
    // on this task; 0.5 is the setting docs/strategies.md measures it with.
    let outer = OuterConfig {
        momentum: 0.5,
        ..OuterConfig::default()
    };
    for strategy in Strategy::ALL {
        let report = run_with(
            &task,
            &config(strategy, 300),
            4,
            ScheduleKind::Equal,
            1,
            outer,
        );
        let acc = report.test_accuracy.expect("classification");
        assert!(acc > 0.9, "{strategy}: test accuracy {acc}");
        assert_eq!(report.strategy, strategy.to_string());
        assert!(report.bytes_sent > 0, "{strategy} synchronized nothing");
    }
}

#[test]
fn ssgd_and_wfbp_compute_the_same_model() {
    // Both average gradients every step; only the bucketing and overlap differ.
    let task = digits_task(ModelKind::Mlp);
    let a = run(&task, &config(Strategy::Ssgd, 60), 1, ScheduleKind::Equal);
    let b = run(&task, &config(Strategy::Wfbp, 60), 1, ScheduleKind::Equal);
    assert_eq!(a.bytes_sent, b.bytes_sent);
    assert!(
        (a.val_loss - b.val_loss).abs() < 1e-4,
        "{} vs {}",
        a.val_loss,
        b.val_loss
    );
}

#[test]
fn dreamddp_syncs_each_layer_once_per_period_and_quarter_of_the_bytes() {
    let task = digits_task(ModelKind::Mlp);
    let steps = 80;
    let ssgd = run(
        &task,
        &config(Strategy::Ssgd, steps),
        4,
        ScheduleKind::Equal,
    );
    let dream = run(
        &task,
        &config(Strategy::DreamDdp, steps),
        4,
        ScheduleKind::Profiled,
    );
    for (layer, count) in &dream.per_layer_syncs {
        assert_eq!(*count, steps / 4, "layer {layer}");
    }
    for count in ssgd.per_layer_syncs.values() {
        assert_eq!(*count, steps);
    }
    // Parameters instead of gradients, 1/4 of the layer syncs, plus one final average.
    let ratio = dream.bytes_sent as f64 / ssgd.bytes_sent as f64;
    assert!(ratio < 0.3, "dreamddp/ssgd bytes ratio {ratio}");
}

#[test]
fn chunked_dreamddp_syncs_each_chunk_once_per_period_and_learns() {
    let task = digits_task(ModelKind::Mlp);
    let steps = 200;
    let cfg = config(Strategy::DreamDdp, steps);
    let plan_with = |kb: u64| {
        build_plan(&PlanInputs {
            sync_unit_kb: Some(kb),
            ..inputs(&task, &cfg, 4)
        })
        .expect("plan")
    };
    let whole = plan_with(0);
    let chunked = plan_with(8);
    assert!(
        chunked.units().len() > whole.units().len(),
        "{}",
        chunked.describe()
    );
    let layers = train(&task, &cfg, whole, Box::new(|_, _| {})).expect("trains");
    let chunks = train(&task, &cfg, chunked, Box::new(|_, _| {})).expect("trains");
    assert!(chunks.per_layer_syncs.keys().any(|k| k.contains("[0/")));
    for (unit, count) in &chunks.per_layer_syncs {
        assert_eq!(*count, steps / 4, "unit {unit}");
    }
    // Every value is still averaged once per period: the same bytes as whole layers.
    assert_eq!(chunks.bytes_sent, layers.bytes_sent);
    let acc = chunks.test_accuracy.expect("classification");
    assert!(acc > 0.9, "chunked dreamddp: test accuracy {acc}");
}

#[test]
fn localsgd_syncs_every_period() {
    let task = digits_task(ModelKind::Mlp);
    let report = run(
        &task,
        &config(Strategy::LocalSgd, 40),
        4,
        ScheduleKind::Equal,
    );
    assert!(
        report.per_layer_syncs.values().all(|c| *c == 10),
        "{:?}",
        report.per_layer_syncs
    );
}

#[test]
fn shaped_link_slows_blocking_sync_more_than_dreamddp() {
    // Lower bounds only: a shaped link adds at least its modelled time to every blocking
    // ssgd step, and dreamddp hides most of it.
    let task = digits_task(ModelKind::Mlp);
    let mut cfg = config(Strategy::Ssgd, 30);
    cfg.link = "200mbit,100us".parse().expect("link spec");
    let params = task.build_model(0).param_count();
    let per_step = cfg.link.ring_allreduce_seconds(params * 4, cfg.workers);
    let ssgd = run(&task, &cfg, 4, ScheduleKind::Equal);
    assert!(
        ssgd.train_seconds >= per_step * 30.0 * 0.99,
        "{} < {}",
        ssgd.train_seconds,
        per_step * 30.0
    );
}

#[test]
fn cnn_and_evaluation_curve_on_digits() {
    let task = digits_task(ModelKind::Cnn);
    let mut cfg = config(Strategy::DreamDdp, 200);
    cfg.optimizer = OptimizerConfig::AdamW {
        beta1: 0.9,
        beta2: 0.99,
        eps: 1e-8,
        weight_decay: 0.0,
    };
    cfg.lr = 2e-3;
    cfg.eval_every = 100;
    let report = run(&task, &cfg, 4, ScheduleKind::Profiled);
    assert_eq!(report.curve.len(), 2);
    assert!(
        report.test_accuracy.expect("accuracy") > 0.85,
        "{:?}",
        report.test_accuracy
    );
}

#[test]
fn bad_configs_are_errors_not_panics() {
    let task = digits_task(ModelKind::Mlp);
    let mut cfg = config(Strategy::Ssgd, 10);
    cfg.workers = 0;
    let plan = build_plan(&PlanInputs {
        workers: 1,
        ..inputs(&task, &cfg, 1)
    })
    .expect("plan");
    let Err(err) = train(&task, &cfg, plan, Box::new(|_, _| {})) else {
        panic!("zero workers must be an error");
    };
    assert!(err.to_string().contains("--workers"), "{err}");

    // DreamDDP asked for more steps per period than the model has sync units.
    let Err(err) = build_plan(&PlanInputs {
        strategy: Strategy::DreamDdp,
        workers: 2,
        ..inputs(&task, &cfg, 8)
    }) else {
        panic!("period 8 with 4 sync units must be an error");
    };
    assert!(err.to_string().contains("period 8"), "{err}");
}

#[test]
fn the_nccl_choice_is_refused_not_run_on_the_cpu() {
    let task = digits_task(ModelKind::Mlp);
    let mut cfg = config(Strategy::Ssgd, 2);
    cfg.collective = crate::gpu_probe::CollectiveChoice::Nccl;
    let plan = build_plan(&inputs(&task, &cfg, 4)).expect("plan");
    // No GPU here: the trainer stops with what is missing (the feature, or the driver),
    // and never trains on the CPU collective instead.
    if std::path::Path::new("/proc/driver/nvidia").exists() {
        return;
    }
    let err = train(&task, &cfg, plan, Box::new(|_, _| {})).unwrap_err();
    let text = err.to_string();
    assert!(
        text.contains("--features nccl") || text.contains("CUDA driver"),
        "{text}"
    );
}

#[test]
fn diloco_with_outer_lr_one_and_no_momentum_is_local_sgd() {
    // The outer step `anchor − 1·(anchor − average)` is the average: if the outer landing
    // were skipped or wrong, the two runs would part.
    let task = digits_task(ModelKind::Mlp);
    let plain = OuterConfig {
        lr: 1.0,
        momentum: 0.0,
        mix: 0.0,
    };
    let local = run(
        &task,
        &config(Strategy::LocalSgd, 40),
        4,
        ScheduleKind::Equal,
    );
    let diloco = run_with(
        &task,
        &config(Strategy::Diloco, 40),
        4,
        ScheduleKind::Equal,
        1,
        plain,
    );
    assert!(
        (local.val_loss - diloco.val_loss).abs() < 1e-4,
        "{} vs {}",
        local.val_loss,
        diloco.val_loss
    );
    let nesterov = run(&task, &config(Strategy::Diloco, 40), 4, ScheduleKind::Equal);
    assert!(
        (nesterov.val_loss - local.val_loss).abs() > 1e-4,
        "the default outer optimizer changes the model"
    );
}

#[test]
fn dreamddp_with_a_delay_keeps_learning_and_differs_from_no_delay() {
    let task = digits_task(ModelKind::Mlp);
    let d1 = run(
        &task,
        &config(Strategy::DreamDdp, 200),
        4,
        ScheduleKind::Equal,
    );
    let d3 = run_with(
        &task,
        &config(Strategy::DreamDdp, 200),
        4,
        ScheduleKind::Equal,
        3,
        OuterConfig::default(),
    );
    let acc = d3.test_accuracy.expect("classification");
    assert!(acc > 0.9, "delay 3: accuracy {acc}");
    assert!((d1.val_loss - d3.val_loss).abs() > 1e-6);
    assert_eq!(d1.per_layer_syncs, d3.per_layer_syncs);
}
