//! End-to-end tests of `dreamddp simulate`: a small edge scenario on the embedded digits data
//! set with real gradients over a lossy link, determinism (byte-identical summary.json),
//! `--replay`, and scenario errors that name the bad key.

mod common;

use common::{dreamddp, scratch, text};

const SMALL: &str = r#"
name = "small"
seed = 3
kind = "edge"
model = "mlp"
dataset = "digits"
batch = 16
max_steps = 150
max_virtual_s = 300
eval_every_s = 5
eval_limit = 360
target = 0.85
period = 4
strategies = ["elastic", "blocking"]

[edge]
deadline_ms = 500

[edge.cloud]
count = 1
device = "a100"
workers = 2
link = "dc"

[edge.aggregators]
count = 1
link = "dc"

[edge.devices]
count = 3
device = "jetson-orin"
links = ["lossy"]
slowdown = 100.0

[links.dc]
bandwidth = "1gbit"
latency_ms = 2

[links.lossy]
bandwidth = "20mbit"
latency_ms = 50
loss = 0.05
outages = [{ start_s = 3.0, duration_s = 4.0 }]
"#;

#[test]
fn simulate_is_deterministic_and_replays() {
    let dir = scratch("det");
    let scenario = dir.join("small.toml");
    std::fs::write(&scenario, SMALL).expect("write scenario");
    let sc = scenario.to_str().expect("utf-8");
    let (a, b) = (dir.join("a"), dir.join("b"));
    for out in [&a, &b] {
        let o = dreamddp(&[
            "simulate",
            "--quiet",
            sc,
            "--out",
            out.to_str().expect("utf-8"),
        ]);
        assert!(o.status.success(), "{}", text(&o));
        assert!(
            text(&o).contains("elastic") && text(&o).contains("blocking"),
            "{}",
            text(&o)
        );
    }
    let sa = std::fs::read(a.join("summary.json")).expect("summary a");
    let sb = std::fs::read(b.join("summary.json")).expect("summary b");
    assert_eq!(
        sa, sb,
        "same scenario + seed must give byte-identical summary.json"
    );
    for f in [
        "timeseries.csv",
        "timing.json",
        "accuracy_vs_time.svg",
        "bytes_vs_time.svg",
    ] {
        assert!(a.join(f).is_file(), "{f} missing");
    }
    let v: serde_json::Value = serde_json::from_slice(&sa).expect("json");
    assert_eq!(v["scenario"], "small");
    assert_eq!(v["seed"], 3);
    for r in v["strategies"].as_array().expect("strategies") {
        for key in [
            "strategy",
            "time_to_target_s",
            "final_accuracy",
            "bytes_sent",
            "weak_sync_events",
            "undelivered_deltas",
        ] {
            assert!(r.get(key).is_some(), "{key} missing in {r}");
        }
        assert_eq!(r["undelivered_deltas"], 0, "invariant: nothing lost: {r}");
        assert!(r["final_accuracy"].as_f64().unwrap_or(0.0) > 0.5, "{r}");
    }
    let replay = dreamddp(&[
        "simulate",
        "--quiet",
        "--replay",
        a.join("summary.json").to_str().expect("utf-8"),
        "--out",
        dir.join("r").to_str().expect("utf-8"),
    ]);
    assert!(replay.status.success(), "{}", text(&replay));
    assert!(text(&replay).contains("reproduced"), "{}", text(&replay));

    // A different seed changes the result.
    let o = dreamddp(&[
        "simulate",
        "--quiet",
        sc,
        "--seed",
        "4",
        "--out",
        dir.join("c").to_str().expect("utf-8"),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    assert_ne!(
        std::fs::read(dir.join("c/summary.json")).expect("summary c"),
        sa
    );
}

#[test]
fn scenario_errors_name_the_key() {
    let dir = scratch("err");
    let cases = [
        (SMALL.replace("max_steps", "max_stepz"), "max_stepz"),
        (SMALL.replace("loss = 0.05", "loss = 1.5"), "loss"),
        (
            SMALL.replace("links = [\"lossy\"]", "links = [\"wifi\"]"),
            "wifi",
        ),
        (SMALL.replace("kind = \"edge\"", "kind = \"mesh\""), "mesh"),
        (
            SMALL.replace("\"jetson-orin\"", "\"timed\"")
                + "[devices.timed.layers]\nfc9 = { forward_ms = 1, backward_ms = 2 }\n",
            "devices.timed.layers.fc9: the model has no layer 'fc9' (its layers: flatten, fc1",
        ),
        (
            SMALL.replace("\"jetson-orin\"", "\"timed\"")
                + "[devices.timed.layers]\nfc1 = { forward_ms = 1 }\n",
            "backward_ms",
        ),
    ];
    for (i, (toml, needle)) in cases.iter().enumerate() {
        let p = dir.join(format!("bad{i}.toml"));
        std::fs::write(&p, toml).expect("write");
        let o = dreamddp(&[
            "simulate",
            "--quiet",
            p.to_str().expect("utf-8"),
            "--out",
            dir.to_str().expect("utf-8"),
        ]);
        assert!(!o.status.success(), "case {i} should fail");
        let t = text(&o);
        assert!(t.contains(needle), "case {i}: expected '{needle}' in: {t}");
        assert!(!t.contains("panicked"), "case {i} panicked: {t}");
    }
    let o = dreamddp(&["simulate", "no-such-scenario"]);
    assert!(!o.status.success());
    assert!(
        text(&o).contains("built-in scenarios: default"),
        "{}",
        text(&o)
    );
}

const SMALL_CLUSTERS: &str = r#"
name = "small-clusters"
seed = 5
kind = "clusters"
model = "mlp"
dataset = "digits"
batch = 16
max_steps = 120
max_virtual_s = 600
eval_every_s = 0.5
eval_limit = 360
target = 0.85
period = 4
strategies = ["ssgd", "dreamddp"]

[links.wan]
bandwidth = "100mbit"
latency_ms = 10

[clusters]
inter_link = "wan"
groups = [{ name = "dc", count = 2, workers = 2, device = "this-machine" }]
"#;

#[test]
fn a_device_class_measured_here_drives_a_clusters_scenario() {
    let dir = scratch("measure");
    let base = dir.join("base.toml");
    std::fs::write(
        &base,
        SMALL_CLUSTERS.replace("\"this-machine\"", "\"a100\""),
    )
    .expect("write");
    let o = dreamddp(&[
        "simulate",
        base.to_str().expect("utf-8"),
        "--measure-device",
        "this-machine",
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let snippet = String::from_utf8_lossy(&o.stdout).to_string();
    assert!(
        snippet.contains("[devices.this-machine]")
            && snippet.contains("flops = ")
            && snippet.contains("[devices.this-machine.layers]")
            && snippet.contains("fc1 = { forward_ms = "),
        "{snippet}"
    );
    let measured = dir.join("measured.toml");
    std::fs::write(&measured, format!("{SMALL_CLUSTERS}\n{snippet}")).expect("write");
    let o = dreamddp(&[
        "simulate",
        "--quiet",
        measured.to_str().expect("utf-8"),
        "--out",
        dir.join("out").to_str().expect("utf-8"),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let v: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("out/summary.json")).expect("summary"))
            .expect("json");
    let runs = v["strategies"].as_array().expect("strategies");
    assert_eq!(runs.len(), 2);
    for r in runs {
        assert!(r["final_accuracy"].as_f64().unwrap_or(0.0) > 0.8, "{r}");
    }
}

#[test]
fn per_layer_times_measured_here_drive_an_edge_scenario_and_replay() {
    let dir = scratch("measure-edge");
    let base = dir.join("base.toml");
    std::fs::write(&base, SMALL).expect("write");
    let o = dreamddp(&[
        "simulate",
        base.to_str().expect("utf-8"),
        "--measure-device",
        "here",
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let snippet = String::from_utf8_lossy(&o.stdout).to_string();
    assert!(snippet.contains("[devices.here.layers]"), "{snippet}");
    // Only the per-layer table: the devices must run on the measured times alone.
    let layers_only: String = snippet
        .lines()
        .filter(|l| !l.starts_with("flops") && !l.starts_with("layer_overhead_s"))
        .map(|l| format!("{l}\n"))
        .collect();
    let measured = dir.join("measured.toml");
    std::fs::write(
        &measured,
        format!(
            "{}\n{layers_only}",
            SMALL.replace("\"jetson-orin\"", "\"here\"")
        ),
    )
    .expect("write");
    let out = dir.join("out");
    let o = dreamddp(&[
        "simulate",
        "--quiet",
        measured.to_str().expect("utf-8"),
        "--strategies",
        "elastic",
        "--out",
        out.to_str().expect("utf-8"),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let summary = out.join("summary.json");
    let v: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&summary).expect("summary")).expect("json");
    assert!(
        v["scenario_toml"]
            .as_str()
            .expect("scenario text")
            .contains("[devices.here.layers]"),
        "the measured numbers travel in the summary"
    );
    let replay = dreamddp(&[
        "simulate",
        "--quiet",
        "--replay",
        summary.to_str().expect("utf-8"),
        "--out",
        dir.join("r").to_str().expect("utf-8"),
    ]);
    assert!(replay.status.success(), "{}", text(&replay));
    assert!(text(&replay).contains("reproduced"), "{}", text(&replay));
}

#[test]
fn gpt_tiny_runs_in_a_clusters_scenario_with_a_loss_target() {
    if engine::data::locate::shared_tinyshakespeare_path().is_none() {
        eprintln!("skipped: tinyshakespeare not found (set DREAMDDP_DATA_DIR)");
        return;
    }
    let dir = scratch("gpt");
    let scenario = dir.join("gpt.toml");
    let toml = SMALL_CLUSTERS
        .replace("model = \"mlp\"", "model = \"gpt-tiny\"")
        .replace("dataset = \"digits\"", "dataset = \"tinyshakespeare\"")
        .replace("batch = 16", "batch = 4")
        .replace("max_steps = 120", "max_steps = 6")
        .replace("eval_limit = 360", "eval_limit = 1")
        .replace("eval_every_s = 0.5", "eval_every_s = 0.01")
        .replace("target = 0.85", "target = 4.0")
        .replace(
            "workers = 2, device = \"this-machine\"",
            "workers = 1, device = \"a100\"",
        );
    std::fs::write(&scenario, toml).expect("write");
    let out = dir.join("out");
    let o = dreamddp(&[
        "simulate",
        "--quiet",
        scenario.to_str().expect("utf-8"),
        "--out",
        out.to_str().expect("utf-8"),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("target val loss <= 4"), "{}", text(&o));
    let v: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("summary.json")).expect("summary"))
            .expect("json");
    for r in v["strategies"].as_array().expect("strategies") {
        assert!(
            r["final_accuracy"].is_null(),
            "a language model has no accuracy: {r}"
        );
        let loss = r["final_loss"].as_f64().expect("final_loss");
        // A character model starts near ln(vocab) ≈ 4.2 nats and must move below it.
        assert!(loss.is_finite() && loss < 4.0, "{r}");
        assert!(r["time_to_target_s"].as_f64().is_some(), "{r}");
    }
}

/// A fresh clone without `../shared`: `DREAMDDP_DATA_DIR=none` hides the shared folder, so the
/// built-in scenario runs on the embedded digits and the traces shipped in
/// `simulations/traces/`.
#[test]
fn the_default_scenario_runs_without_the_shared_folder() {
    let dir = scratch("no-shared");
    let out = dir.join("out");
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_dreamddp"))
        .args([
            "simulate",
            "default",
            "--quiet",
            "--strategies",
            "elastic",
            "--out",
            out.to_str().expect("utf-8"),
        ])
        .env("RUST_LOG", "warn")
        .env(
            engine::data::locate::DATA_DIR_ENV,
            engine::data::locate::NO_SHARED,
        )
        .output()
        .expect("the dreamddp binary starts");
    assert!(o.status.success(), "{}", text(&o));
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("summary.json")).unwrap()).unwrap();
    let text = summary.to_string();
    assert!(
        text.contains("digits") && !text.contains("mnist"),
        "{}",
        &text[..text.len().min(2000)]
    );
    let elastic = &summary["strategies"][0];
    assert_eq!(elastic["strategy"], "elastic");
    assert!(
        elastic["final_accuracy"].as_f64().unwrap() > 0.5,
        "{}",
        &text[..text.len().min(2000)]
    );
    let _ = std::fs::remove_dir_all(&dir);
}
