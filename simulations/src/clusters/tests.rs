//! Tests of the clusters simulation: determinism, hand-computed lockstep time accounting,
//! dreamddp hiding communication and following its plan, learning, error messages.

use std::collections::BTreeMap;
use std::path::Path;

use node::task::{load_data, ModelKind, Task};

use super::*;
use crate::compute::DeviceClass;

fn digits_task(model: ModelKind) -> Task {
    let data = load_data("digits", None).expect("embedded digits");
    Task::new(model, "digits", data).expect("task")
}

fn scenario(extra_clusters: &str, link: &str, head: &str) -> Scenario {
    let text = format!(
        r#"
name = "test"
kind = "clusters"
model = "mlp"
dataset = "digits"
batch = 16
max_steps = 40
eval_every_s = 0.05
eval_limit = 300
target = 0.8
strategies = ["ssgd", "wfbp", "localsgd", "dreamddp"]
period = 2
seed = 5
{head}
[links.wan]
{link}
[clusters]
inter_link = "wan"
{extra_clusters}
"#
    );
    Scenario::parse(&text, "test", Path::new(".")).expect("test scenario parses")
}

fn default_scenario() -> Scenario {
    scenario(
        r#"groups = [{ name = "dc", count = 2, workers = 2, device = "a100", jitter = 0.2 }]"#,
        "bandwidth = \"20mbit\"\nlatency_ms = 5",
        "",
    )
}

fn run(s: &Scenario, task: &Task, strategy: &str) -> StrategyResult {
    let mut calls = 0;
    let r = simulate(s, task, strategy, &mut |f| {
        assert!((0.0..=1.0).contains(&f), "progress {f}");
        calls += 1;
    })
    .unwrap_or_else(|e| panic!("{strategy}: {e}"));
    assert!(calls > 0);
    r
}

#[test]
fn same_seed_gives_identical_results_and_another_seed_differs() {
    let task = digits_task(ModelKind::Mlp);
    let s = default_scenario();
    for strategy in ["wfbp", "dreamddp"] {
        let a = run(&s, &task, strategy);
        let b = run(&s, &task, strategy);
        assert_eq!(a, b, "{strategy}");
        let mut other = s.clone();
        other.seed = 6;
        let c = run(&other, &task, strategy);
        assert_ne!(a.virtual_seconds, c.virtual_seconds, "{strategy}: jitter");
        assert_ne!(a.series, c.series, "{strategy}");
    }
}

#[test]
fn ssgd_step_is_forward_plus_backward_plus_exchange() {
    // A device whose per-layer times are whole nanoseconds; one worker per cluster (no intra
    // reduce); 8 Mbit/s = one byte per microsecond, 10 ms one way, MTU 1500.
    let s = scenario(
        r#"groups = [{ name = "dc", count = 2, workers = 1, device = "slow" }]
[clusters.devices.slow]
flops = 1e9
layer_overhead_s = 1e-6"#,
        "bandwidth = \"8mbit\"\nlatency_ms = 10",
        "",
    );
    let task = digits_task(ModelKind::Mlp);
    let model = task.build_model(5);
    let device = DeviceClass {
        flops: 1e9,
        layer_overhead_s: 1e-6,
    };
    let mut compute_ns = 0u64;
    for l in &model.layers {
        let macs = l.layer.forward_macs_per_sample();
        compute_ns += (device.forward_s(macs, 16) * 1e9).round() as u64;
        compute_ns += (device.backward_s(macs, 16) * 1e9).round() as u64;
    }
    let bytes = model.param_count() as u64 * 4;
    // Every 1500-byte packet takes 1.5 ms; the last one is through `bytes` µs after the start.
    let exchange_ns = 10_000_000 + bytes * 1000;
    let step_ns = compute_ns + exchange_ns;
    let r = run(&s, &task, "ssgd");
    let expected = 40.0 * step_ns as f64 * 1e-9;
    assert!(
        (r.virtual_seconds - expected).abs() < 1e-9,
        "{} vs {expected}",
        r.virtual_seconds
    );
    assert!((r.mean_step_s - step_ns as f64 * 1e-9).abs() < 1e-12);
    assert_eq!(r.bytes_by_link_class["inter-cluster"], 40 * 2 * bytes);
    assert_eq!(r.bytes_by_link_class["intra-cluster"], 0);
    assert_eq!(r.bytes_sent, 40 * 2 * bytes);
    // One sync event per layer per step, all from the same collective.
    let units = model.layer_infos().len() as u64;
    assert_eq!(r.timeline.len() as u64, 40 * units);
    assert_eq!(r.staleness_histogram.get(&0), Some(&(40 * units)));
    let first = &r.timeline[0];
    assert!((first.start_s - compute_ns as f64 * 1e-9).abs() < 1e-12);
    assert!((first.end_s - step_ns as f64 * 1e-9).abs() < 1e-12);
}

#[test]
fn given_layer_times_replace_the_flop_derived_ones() {
    // `fc1` has measured times (at the scenario's batch, so unscaled); every other layer is
    // FLOP-derived. A simulator that ignored the given times would charge fc1 ~0.3 ms, not 10.
    let s = scenario(
        r#"groups = [{ name = "dc", count = 2, workers = 1, device = "timed" }]"#,
        "bandwidth = \"8mbit\"\nlatency_ms = 10",
        "[devices.timed]\nflops = 1e9\nlayer_overhead_s = 1e-6\n[devices.timed.layers]\nfc1 = { forward_ms = 3, backward_ms = 7 }\n",
    );
    let task = digits_task(ModelKind::Mlp);
    let model = task.build_model(5);
    assert!(model.layers.iter().any(|l| l.name == "fc1"), "mlp has fc1");
    let device = DeviceClass {
        flops: 1e9,
        layer_overhead_s: 1e-6,
    };
    let mut compute_ns = 0u64;
    for l in &model.layers {
        let (f, b) = if l.name == "fc1" {
            (3e-3, 7e-3)
        } else {
            let macs = l.layer.forward_macs_per_sample();
            (device.forward_s(macs, 16), device.backward_s(macs, 16))
        };
        compute_ns += (f * 1e9).round() as u64 + (b * 1e9).round() as u64;
    }
    let bytes = model.param_count() as u64 * 4;
    let step_ns = compute_ns + 10_000_000 + bytes * 1000;
    let r = run(&s, &task, "ssgd");
    assert!(
        (r.mean_step_s - step_ns as f64 * 1e-9).abs() < 1e-12,
        "{} vs {}",
        r.mean_step_s,
        step_ns as f64 * 1e-9
    );
}

#[test]
fn given_times_for_a_layer_the_model_lacks_name_the_key() {
    let s = scenario(
        r#"groups = [{ name = "dc", count = 2, workers = 1, device = "timed" }]"#,
        "bandwidth = \"8mbit\"",
        "[devices.timed]\nflops = 1e9\n[devices.timed.layers]\nfc9 = { forward_ms = 3, backward_ms = 7 }\n",
    );
    let task = digits_task(ModelKind::Mlp);
    let e = simulate(&s, &task, "ssgd", &mut |_| {})
        .unwrap_err()
        .to_string();
    assert!(
        e.starts_with("devices.timed.layers.fc9: the model has no layer 'fc9'")
            && e.contains("fc1"),
        "{e}"
    );
}

#[test]
fn intra_cluster_reduce_is_charged_and_counted() {
    let one = scenario(
        r#"groups = [{ name = "dc", count = 2, workers = 1, device = "a100" }]"#,
        "bandwidth = \"20mbit\"\nlatency_ms = 5",
        "",
    );
    let mut four = one.clone();
    four.clusters.as_mut().unwrap().groups[0].workers = 4;
    four.clusters.as_mut().unwrap().intra_bandwidth = Bandwidth::from_mbit(100);
    let task = digits_task(ModelKind::Mlp);
    let a = run(&one, &task, "ssgd");
    let b = run(&four, &task, "ssgd");
    let bytes = task.build_model(5).param_count() as u64 * 4;
    assert_eq!(b.bytes_by_link_class["intra-cluster"], 40 * 2 * 6 * bytes);
    assert!(b.virtual_seconds > a.virtual_seconds);
}

#[test]
fn dreamddp_hides_communication_that_ssgd_and_localsgd_expose() {
    // Compute comparable to communication: a slow device and a slow link.
    let s = scenario(
        r#"groups = [{ name = "dc", count = 2, workers = 1, device = "slow" }]
[clusters.devices.slow]
flops = 2e8
layer_overhead_s = 2e-3"#,
        "bandwidth = \"50mbit\"\nlatency_ms = 2",
        "",
    );
    let task = digits_task(ModelKind::Mlp);
    let ssgd = run(&s, &task, "ssgd");
    let local = run(&s, &task, "localsgd");
    let dream = run(&s, &task, "dreamddp");
    assert!(
        dream.mean_step_s < local.mean_step_s && local.mean_step_s < ssgd.mean_step_s,
        "dreamddp {} localsgd {} ssgd {}",
        dream.mean_step_s,
        local.mean_step_s,
        ssgd.mean_step_s
    );
    // dreamddp moves each layer once per period, like localsgd.
    assert_eq!(
        dream.bytes_by_link_class["inter-cluster"],
        local.bytes_by_link_class["inter-cluster"]
    );
    assert_eq!(
        dream
            .staleness_histogram
            .keys()
            .copied()
            .collect::<Vec<_>>(),
        vec![1]
    );
}

#[test]
fn dreamddp_syncs_each_layer_once_per_period_one_collective_per_bucket() {
    // The clusters' sync machines follow the plan: with H = 2 every layer is averaged 20
    // times in 40 steps, and the layers a step syncs travel together, in backward order.
    let s = default_scenario();
    let task = digits_task(ModelKind::Mlp);
    let r = run(&s, &task, "dreamddp");
    let model = task.build_model(5);
    let index_of = |name: &str| {
        model
            .layers
            .iter()
            .position(|l| l.name == name)
            .expect("a model layer")
    };
    let mut per_layer: BTreeMap<&str, u64> = BTreeMap::new();
    let mut collectives: BTreeMap<(u64, u64), Vec<usize>> = BTreeMap::new();
    for e in &r.timeline {
        *per_layer.entry(&e.layer).or_default() += 1;
        collectives
            .entry((e.start_s.to_bits(), e.end_s.to_bits()))
            .or_default()
            .push(index_of(&e.layer));
    }
    assert_eq!(per_layer.len(), model.layer_infos().len());
    assert!(per_layer.values().all(|&n| n == 20), "{per_layer:?}");
    assert!(
        collectives.len() < r.timeline.len(),
        "some step syncs several layers in one collective"
    );
    for layers in collectives.values() {
        assert!(layers.windows(2).all(|w| w[0] > w[1]), "{layers:?}");
    }
}

#[test]
fn chunked_dreamddp_syncs_each_chunk_once_per_period_and_learns() {
    // `sync_unit_kb = 8`: the mlp's first layer (33 KiB) becomes 5 units; with the equal
    // split into H = 2 phases its chunks are averaged at different steps, each once per period
    // (60 times in 120 steps), and the model still learns.
    let mut s = scenario(
        "groups = [{ name = \"dc\", count = 2, workers = 2, device = \"a100\", jitter = 0.2 }]\n\
         sync_unit_kb = 8\nschedule = \"equal\"\ndelay = 1",
        "bandwidth = \"20mbit\"\nlatency_ms = 5",
        "",
    );
    s.max_steps = 120;
    let task = digits_task(ModelKind::Mlp);
    let r = run(&s, &task, "dreamddp");
    let mut per_unit: BTreeMap<&str, u64> = BTreeMap::new();
    let mut starts: BTreeMap<&str, f64> = BTreeMap::new();
    for e in &r.timeline {
        *per_unit.entry(&e.layer).or_default() += 1;
        starts.entry(&e.layer).or_insert(e.start_s);
    }
    let chunks: Vec<&str> = per_unit
        .keys()
        .copied()
        .filter(|n| n.contains('['))
        .collect();
    assert!(chunks.len() >= 2, "{per_unit:?}");
    assert!(per_unit.values().all(|&n| n == 60), "{per_unit:?}");
    // The first and the last chunk of the layer are averaged at different steps.
    let (first, last) = (chunks[0], chunks[chunks.len() - 1]);
    assert_ne!(starts[first], starts[last], "{first} {last}");
    assert!(r.time_to_target_s.is_some(), "{:?}", r.final_accuracy);
}

#[test]
fn ssgd_and_wfbp_train_the_same_model() {
    let s = default_scenario();
    let task = digits_task(ModelKind::Mlp);
    let a = run(&s, &task, "ssgd");
    let b = run(&s, &task, "wfbp");
    assert!(
        (a.final_loss - b.final_loss).abs() < 1e-5,
        "{} vs {}",
        a.final_loss,
        b.final_loss
    );
    assert!(
        b.virtual_seconds <= a.virtual_seconds,
        "wfbp overlaps backward"
    );
}

#[test]
fn every_strategy_learns_digits() {
    let mut s = default_scenario();
    s.max_steps = 80;
    let task = digits_task(ModelKind::Mlp);
    for strategy in STRATEGIES {
        let r = run(&s, &task, strategy);
        let first = r.series[0].accuracy.expect("classification");
        let last = r.final_accuracy.expect("classification");
        assert!(
            last > 0.8 && last > first + 0.4,
            "{strategy}: {first} -> {last}"
        );
        let t = r.time_to_target_s.expect("target 0.8 reached");
        assert!(t <= r.virtual_seconds, "{strategy}");
        assert!(r.series.windows(2).all(|w| w[0].time_s < w[1].time_s));
        assert_eq!(r.wall_seconds, 0.0);
        assert_eq!(r.strategy, *strategy);
    }
}

#[test]
fn stop_at_target_ends_the_run_early() {
    let mut s = default_scenario();
    s.max_steps = 80;
    s.clusters.as_mut().unwrap().stop_at_target = true;
    let task = digits_task(ModelKind::Mlp);
    let r = run(&s, &task, "localsgd");
    let t = r.time_to_target_s.expect("reached");
    assert!(
        r.virtual_seconds <= t + s.eval_every_s,
        "{} {t}",
        r.virtual_seconds
    );
    assert!(r.mean_step_s > 0.0);
}

#[test]
fn bad_input_errors_name_the_key() {
    let task = digits_task(ModelKind::Mlp);
    let err = |s: &Scenario, strategy: &str| {
        simulate(s, &task, strategy, &mut |_| {})
            .unwrap_err()
            .to_string()
    };

    let e = err(&default_scenario(), "allreduce");
    assert!(
        e.contains("allreduce")
            && e.contains(
                "ssgd, wfbp, localsgd, dreamddp, dreamddp-paper, plsgd, diloco, streaming-diloco"
            ),
        "{e}"
    );

    let mut s = default_scenario();
    s.clusters.as_mut().unwrap().groups[0].device = "tpu".into();
    let e = err(&s, "ssgd");
    assert!(
        e.contains("clusters.groups[0].device") && e.contains("a100"),
        "{e}"
    );

    let mut s = default_scenario();
    s.clusters.as_mut().unwrap().inter_link = "nope".into();
    let e = err(&s, "ssgd");
    assert!(
        e.contains("clusters.inter_link") && e.contains("wan"),
        "{e}"
    );

    let mut s = default_scenario();
    s.clusters.as_mut().unwrap().groups[0].workers = 0;
    assert!(err(&s, "ssgd").contains("clusters.groups[0].workers"));

    let mut s = default_scenario();
    s.clusters.as_mut().unwrap().groups[0].jitter = -1.0;
    assert!(err(&s, "ssgd").contains("clusters.groups[0].jitter"));

    let mut s = default_scenario();
    s.clusters.as_mut().unwrap().groups[0].count = 1;
    assert!(err(&s, "ssgd").contains("at least 2 clusters"));

    let mut s = default_scenario();
    s.optimizer = Some("lamb".into());
    assert!(err(&s, "ssgd").contains("optimizer"));

    // More steps in a period than units: an error with whole layers (`dreamddp-paper`, or
    // `sync_unit_kb = 0`); the search splits layers into chunks instead.
    let mut s = default_scenario();
    s.period = 9;
    assert!(err(&s, "dreamddp-paper").contains("period 9"));
    s.clusters.as_mut().unwrap().sync_unit_kb = Some(0);
    assert!(err(&s, "dreamddp").contains("period 9"));

    // Unknown keys are refused by the parser with the key's name.
    let text = r#"
name = "x"
kind = "clusters"
target = 0.5
strategies = ["ssgd"]
[links.wan]
bandwidth = "1gbit"
[clusters]
inter_link = "wan"
groups = [{ name = "dc", count = 2, workers = 1, device = "a100", gpus = 3 }]
"#;
    let e = Scenario::parse(text, "x", Path::new("."))
        .unwrap_err()
        .to_string();
    assert!(e.contains("gpus"), "{e}");
}

#[test]
fn shipped_cluster_scenarios_parse_and_validate() {
    for name in ["two-datacenters", "mixed-cpu-gpu"] {
        let (s, _) = Scenario::load(name).unwrap_or_else(|e| panic!("{name}: {e}"));
        let spec = s.clusters.as_ref().expect("clusters table");
        let clusters = spec.clusters(&s).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(clusters.len() >= 2);
        for strategy in &s.strategies {
            parse_strategy(strategy).unwrap();
        }
    }
}

#[test]
fn dreamddp_records_its_configuration_search_and_the_paper_variant_runs_fixed() {
    let mut s = default_scenario();
    s.max_steps = 12;
    let task = digits_task(ModelKind::Mlp);
    let searched = run(&s, &task, "dreamddp");
    let chosen: Vec<_> = searched
        .plan_candidates
        .iter()
        .filter(|c| c.chosen)
        .collect();
    assert_eq!(chosen.len(), 1, "{:?}", searched.plan_candidates);
    let best = searched
        .plan_candidates
        .iter()
        .map(|c| c.step_s)
        .fold(f64::INFINITY, f64::min);
    assert!(chosen[0].step_s <= best * (1.0 + engine::config_search::TIE_TOLERANCE));
    // The staleness of every landing is the chosen delay.
    let taus: Vec<u64> = searched.staleness_histogram.keys().copied().collect();
    assert_eq!(taus, vec![chosen[0].delay]);

    let paper = run(&s, &task, "dreamddp-paper");
    assert_eq!(paper.strategy, "dreamddp-paper");
    assert!(paper.plan_candidates.is_empty());
    assert_eq!(
        paper
            .staleness_histogram
            .keys()
            .copied()
            .collect::<Vec<_>>(),
        vec![1]
    );
}
