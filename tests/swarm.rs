//! End-to-end test of `[swarm]`: synthetic edge clients in two `dreamddp swarm` processes
//! (each client with its own QUIC endpoint, certificate and sled cache) against a real
//! coordinator and two real aggregators. Uses the embedded digits (no `../shared` needed).

mod common;

use common::{dreamddp, scratch, text};
use serde_json::Value;

/// A 24-client swarm cluster file; `aggregation` goes into `[aggregation]`.
fn swarm_file(aggregation: &str) -> String {
    format!(
        r#"
[cluster]
name = "swarm-e2e"
timeout_s = 300

[model]
model = "mlp"
dataset = "digits"

[training]
steps = 40

[sync]
period_steps = 4
drain_timeout_s = 60

[aggregation]
{aggregation}

[[aggregators]]
name = "agg-1"

[[aggregators]]
name = "agg-2"

[swarm]
clients = 24
processes = 2
step_ms = 200
join_spread_ms = 500
"#
    )
}

fn run(dir: &std::path::Path, text_of_file: &str) -> Value {
    let file = dir.join("swarm.toml");
    std::fs::write(&file, text_of_file).unwrap();
    let out = dir.join("out");
    let o = dreamddp(&[
        "cluster",
        file.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "cluster failed:\n{}", text(&o));
    serde_json::from_str(&std::fs::read_to_string(out.join("summary.json")).unwrap()).unwrap()
}

fn aggregators(s: &Value) -> Vec<&Value> {
    s["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|n| n["role"] == "aggregator")
        .collect()
}

#[test]
fn a_swarm_of_clients_loads_real_aggregators_and_loses_nothing() {
    let dir = scratch("swarm");
    let s = run(&dir, &swarm_file(""));
    let out = dir.join("out");
    let swarm = &s["swarm"];
    assert_eq!(swarm["clients"], 24, "{s}");
    assert_eq!(swarm["clients_failed"], 0, "{s}");
    assert!(s["problems"].as_array().unwrap().is_empty(), "{s}");
    // Every client took its steps; every delta they cut was acknowledged, and every
    // acknowledged delta is in an aggregator's ledger, once.
    let procs: Vec<&Value> = s["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|n| n["role"] == "swarm")
        .collect();
    assert_eq!(procs.len(), 2, "{s}");
    assert_eq!(
        procs
            .iter()
            .map(|n| n["steps"].as_u64().unwrap())
            .sum::<u64>(),
        24 * 40,
        "{s}"
    );
    for p in &procs {
        assert_eq!(p["undelivered"], 0, "{s}");
    }
    let acked = s["deltas_acked"].as_u64().unwrap();
    // 40 steps / period 4 = 10 cuts of each of the 4 layers per client, and the final flush
    // cuts the 3 layers whose phase did not end on step 40 once more.
    assert_eq!(acked, 24 * (10 * 4 + 3), "{s}");
    assert_eq!(s["ledger_entries"].as_u64().unwrap(), acked, "{s}");
    assert_eq!(s["ledger_duplicates"], 0, "{s}");
    // The load figures are measured and reported.
    let ack = &s["ack_latency_ms"];
    assert_eq!(ack["count"].as_u64().unwrap(), acked, "{s}");
    assert!(
        ack["p99_ms"].as_f64().unwrap() >= ack["p50_ms"].as_f64().unwrap(),
        "{s}"
    );
    assert!(
        s["status_latency_ms"]["answered"]["count"]
            .as_u64()
            .unwrap()
            >= 1,
        "{s}"
    );
    assert!(
        swarm["aggregator_bytes_per_applied_delta"]
            .as_f64()
            .unwrap()
            > 0.0,
        "{s}"
    );
    for n in aggregators(&s) {
        assert!(n["peak_rss_bytes"].as_u64().unwrap() > 0, "{s}");
        assert!(n["cpu_seconds"].as_f64().is_some(), "{s}");
    }
    // Each client kept its own identity and durable cache.
    for i in [1, 24] {
        let name = format!("swarm-{i:04}");
        assert!(out.join("certs").join(format!("{name}.pem")).exists());
        let proc_dir = if i % 2 == 1 {
            "swarm-proc-1"
        } else {
            "swarm-proc-2"
        };
        assert!(
            out.join(proc_dir)
                .join("data/clients")
                .join(&name)
                .join("cache")
                .exists(),
            "{name}'s cache"
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// With `broadcast_interval_ms`, a subscriber gets at most one version of a layer per
/// interval however many clients feed it; the newer versions replace the waiting one, and
/// the run still delivers everything.
#[test]
fn a_broadcast_interval_bounds_what_each_subscriber_receives() {
    assert_one_version_per_layer_and_second("swarm-interval", "broadcast_interval_ms = 1000");
}

/// The fan-out budget does the same without an interval: 24 versions of a layer per second
/// shared by 24 clients and the coordinator is one per subscriber and second at most.
#[test]
fn the_fanout_budget_bounds_what_each_subscriber_receives() {
    assert_one_version_per_layer_and_second(
        "swarm-fanout",
        "broadcast_interval_ms = 0\nfanout_per_layer_per_s = 24",
    );
}

fn assert_one_version_per_layer_and_second(name: &str, aggregation: &str) {
    let dir = scratch(name);
    let s = run(&dir, &swarm_file(aggregation));
    assert!(s["problems"].as_array().unwrap().is_empty(), "{s}");
    assert_eq!(s["ledger_entries"], s["deltas_acked"], "{s}");
    let wall = s["trainers_seconds"].as_f64().unwrap();
    let superseded: u64 = aggregators(&s)
        .iter()
        .map(|n| n["fanout_superseded"].as_u64().unwrap())
        .sum();
    // 24 subscribers × 4 layers, at most one send per layer and second (plus the first).
    let bound = 24.0 * 4.0 * (wall + 2.0);
    let sent: f64 = aggregators(&s)
        .iter()
        .map(|n| n["fanout_sends"].as_u64().unwrap() as f64)
        .sum();
    assert!(sent <= bound, "{sent} version sends > {bound}: {s}");
    assert!(superseded > 0, "{s}");
    std::fs::remove_dir_all(&dir).unwrap();
}
