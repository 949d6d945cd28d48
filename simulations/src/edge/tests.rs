//! Tests of the edge simulation: determinism, the weak-sync invariant under heavy loss and
//! outages, elastic versus blocking, crash and restart, spec errors. All on the embedded
//! `digits` data set with tiny scenarios (fast in the dev profile); the measurement of the
//! built-in scenarios is an ignored test.

use std::path::Path;

use gpu_worker::task::{load_data, ModelKind, Task};

use super::*;

fn digits_task() -> Task {
    let data = load_data("digits", None).expect("digits are embedded");
    Task::new(ModelKind::Mlp, "digits", data).expect("mlp on digits")
}

/// The task a built-in scenario would run: MNIST when the shared data is there, else digits.
fn scenario_task(s: &Scenario) -> Task {
    let dir = engine::data::locate::shared_datasets_dir();
    let dataset = match (s.dataset.as_str(), dir.as_deref()) {
        ("auto", Some(d)) if d.join("mnist").is_dir() => "mnist",
        ("auto", _) => "digits",
        (other, _) => other,
    };
    let data = load_data(dataset, dir.as_deref()).expect("data set");
    Task::new(ModelKind::Mlp, dataset, data).expect("task")
}

#[test]
#[ignore = "measurement: cargo test --release -p simulations measure_builtin -- --ignored --nocapture"]
fn measure_builtin_scenarios() {
    let names = std::env::var("EDGE_SCENARIOS").unwrap_or_else(|_| "default,edge-outage".into());
    for name in names.split(',') {
        let (scenario, _) = Scenario::load(name).expect("built-in scenario");
        let task = scenario_task(&scenario);
        println!("== {name} ({} on {})", task.model.name(), task.dataset);
        let total = std::time::Instant::now();
        let only = std::env::var("EDGE_STRATEGIES").ok();
        for strategy in &scenario.strategies {
            if only.as_ref().is_some_and(|o| !o.split(',').any(|x| x == strategy)) {
                continue;
            }
            let started = std::time::Instant::now();
            let (r, d) = run_edge_detailed(&scenario, &task, strategy, &mut |_| {}).expect("run");
            println!(
                "{strategy:>17}: to-target {:?} s, final acc {:?}, virtual {:.1} s, wall {:.1} s, steps {:?}, weak {}, undelivered {}, cached {}, bytes {:?}, step {:.4} s",
                r.time_to_target_s,
                r.final_accuracy,
                r.virtual_seconds,
                started.elapsed().as_secs_f64(),
                d.steps,
                r.weak_sync_events,
                r.undelivered_deltas,
                r.cached_at_end,
                r.bytes_by_link_class,
                r.mean_step_s,
            );
            println!("    ledger {:?}", d.ledger);
            println!("    staleness {:?}", r.staleness_histogram);
            let pts: Vec<String> = r
                .series
                .iter()
                .map(|p| format!("{:.0}:{:.3}", p.time_s, p.accuracy.unwrap_or(0.0)))
                .collect();
            let step = (pts.len() / 40).max(1);
            let pts: Vec<String> = pts.into_iter().step_by(step).collect();
            println!("    series {}", pts.join(" "));
        }
        println!("   total wall {:.1} s", total.elapsed().as_secs_f64());
    }
    let _ = Path::new(".");
}
