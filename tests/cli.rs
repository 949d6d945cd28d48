//! End-to-end tests of the `dreamddp` binary: real processes, real training on the digits
//! data set embedded in the binary (no ../shared needed), and the errors users see.

mod common;

use common::{dreamddp, scratch, text};

#[test]
fn train_writes_a_summary_with_the_documented_fields() {
    let dir = scratch("train");
    let out = dir.join("run.json");
    let o = dreamddp(&[
        "train",
        "--quiet",
        "--dataset",
        "digits",
        "--workers",
        "2",
        "--steps",
        "300",
        "--out",
        out.to_str().expect("utf-8 path"),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("test accuracy"), "{}", text(&o));
    let v: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&out).expect("summary")).expect("json");
    for key in [
        "strategy",
        "model",
        "dataset",
        "workers",
        "steps",
        "test_accuracy",
        "bytes_sent",
        "wall_seconds",
    ] {
        assert!(v.get(key).is_some(), "summary lacks {key}: {v}");
    }
    assert_eq!(v["strategy"], "dreamddp");
    assert_eq!(v["dataset"], "digits");
    let acc = v["test_accuracy"].as_f64().expect("accuracy");
    assert!(acc > 0.9, "digits accuracy {acc}");
    let syncs = v["per_layer_syncs"].as_object().expect("per-layer syncs");
    assert_eq!(syncs.len(), 4, "{syncs:?}");
    assert!(
        syncs.values().all(|c| c.as_u64() == Some(75)),
        "each layer once per 4 steps: {syncs:?}"
    );
}

#[test]
fn compare_writes_table_json_csv_and_plots() {
    let dir = scratch("compare");
    let o = dreamddp(&[
        "train",
        "--compare",
        "--quiet",
        "--dataset",
        "digits",
        "--workers",
        "2",
        "--steps",
        "120",
        "--eval-every",
        "40",
        "--strategies",
        "ssgd,dreamddp",
        "--out",
        dir.to_str().expect("utf-8 path"),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let t = text(&o);
    assert!(t.contains("speedup/ssgd") && t.contains("dreamddp"), "{t}");
    for f in [
        "compare.json",
        "curves.csv",
        "metric_vs_step.svg",
        "metric_vs_time.svg",
    ] {
        let p = dir.join(f);
        assert!(
            p.is_file() && std::fs::metadata(&p).map(|m| m.len()).unwrap_or(0) > 100,
            "{f} missing"
        );
    }
    let reports: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("compare.json")).expect("json"))
            .expect("json");
    let arr = reports.as_array().expect("array of runs");
    assert_eq!(arr.len(), 2);
    let bytes = |i: usize| arr[i]["bytes_sent"].as_f64().expect("bytes");
    assert!(
        bytes(1) < bytes(0) / 3.0,
        "dreamddp sends < 1/3 of ssgd's bytes"
    );
    let csv = std::fs::read_to_string(dir.join("curves.csv")).expect("csv");
    assert_eq!(csv.lines().count(), 1 + 2 * 3, "{csv}");
}

#[test]
fn config_file_supplies_flags_and_unknown_keys_are_named() {
    let dir = scratch("config");
    let good = dir.join("run.toml");
    std::fs::write(
        &good,
        "dataset = \"digits\"\nstrategy = \"localsgd\"\nworkers = 2\nsteps = 40\n",
    )
    .expect("write");
    let o = dreamddp(&[
        "train",
        "--quiet",
        "--config",
        good.to_str().expect("utf-8"),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("localsgd mlp on digits"), "{}", text(&o));

    let bad = dir.join("bad.toml");
    std::fs::write(&bad, "dataset = \"digits\"\nstrategyy = \"ssgd\"\n").expect("write");
    let o = dreamddp(&["train", "--quiet", "--config", bad.to_str().expect("utf-8")]);
    assert!(!o.status.success());
    assert!(
        text(&o).contains("strategyy"),
        "error must name the key: {}",
        text(&o)
    );
}

#[test]
fn bad_flags_get_clear_errors() {
    let cases: &[(&[&str], &str)] = &[
        (
            &["train", "--dataset", "digits", "--strategy", "fedprox"],
            "valid: ssgd, wfbp, localsgd, dreamddp, plsgd, diloco, streaming-diloco",
        ),
        (
            &[
                "train",
                "--dataset",
                "digits",
                "--period",
                "9",
                "--sync-unit-kb",
                "0",
            ],
            "--sync-unit-kb",
        ),
        (&["train", "--dataset", "digits", "--link", "1gbt"], "1gbt"),
        (
            &[
                "fidelity",
                "--real-runs",
                "0",
                "--real-from",
                "/nonexistent",
            ],
            "--real-runs 0",
        ),
        (&["fidelity", "--sim-seeds", "0"], "--sim-seeds"),
        (
            &["train", "--dataset", "digits", "--model", "resnet"],
            "expected one of: mlp, cnn, gpt-tiny",
        ),
        (
            &["train", "--dataset", "digits", "--model", "gpt-tiny"],
            "cannot train on data set 'digits'",
        ),
        (
            &["train", "--dataset", "digits", "--layer-period", "nosuch=2"],
            "nosuch",
        ),
        (
            &[
                "train",
                "--dataset",
                "mnist",
                "--data-dir",
                "/nonexistent-dreamddp",
            ],
            "--data-dir",
        ),
    ];
    for (args, needle) in cases {
        let o = dreamddp(args);
        assert!(!o.status.success(), "{args:?} should fail");
        let t = text(&o);
        assert!(t.contains(needle), "{args:?}: expected '{needle}' in: {t}");
        assert!(!t.contains("panicked"), "{args:?} panicked: {t}");
    }
}

#[test]
fn plan_prints_the_schedule() {
    let o = dreamddp(&[
        "plan",
        "--dataset",
        "digits",
        "--strategy",
        "dreamddp",
        "--period",
        "4",
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let t = text(&o);
    for layer in ["fc1", "fc2", "fc3", "head"] {
        assert!(t.contains(layer), "{t}");
    }
}

#[test]
fn process_configs_take_set_overrides_and_a_bad_value_names_its_key() {
    let dir = scratch("cli-set");
    let config = dir.join("edge.toml");
    std::fs::write(
        &config,
        "[node]\nname = \"edge-1\"\nid = 11\ncoordinator = \"127.0.0.1:9\"\ncerts_dir = \"certs\"\ndata_dir = \"data\"\ncredentials = \"x\"\n\n[model]\nmodel = \"mlp\"\ndataset = \"digits\"\n\n[training]\nfirst_rank = 0\nworld = 1\nsteps = 10\n",
    )
    .unwrap();
    let path = config.to_str().expect("utf-8");
    // An override with an unknown key is refused, naming the key.
    let o = dreamddp(&["edge", "--config", path, "--set", "sync.deadline_msec=900"]);
    assert!(!o.status.success());
    assert!(text(&o).contains("deadline_msec"), "{}", text(&o));
    // A value of the wrong type names the key too.
    let o = dreamddp(&["edge", "--config", path, "--set", "sync.deadline_ms=soon"]);
    assert!(!o.status.success());
    assert!(text(&o).contains("deadline_ms"), "{}", text(&o));
    // A malformed setting says what is expected.
    let o = dreamddp(&["edge", "--config", path, "--set", "sync.deadline_ms"]);
    assert!(!o.status.success());
    assert!(text(&o).contains("KEY=VALUE"), "{}", text(&o));
    // A bad codec given by override is refused by the same validation as the file.
    let o = dreamddp(&["edge", "--config", path, "--set", "sync.codec=topk:2"]);
    assert!(!o.status.success());
    assert!(text(&o).contains("sync.codec"), "{}", text(&o));
}

#[test]
fn a_gpu_or_backend_that_is_not_here_is_a_clear_error_not_a_panic() {
    // Built without libtorch: the tch backend says how to get it; built with it on a machine
    // without CUDA: it says CUDA is missing.
    let o = dreamddp(&[
        "train",
        "--quiet",
        "--dataset",
        "digits",
        "--steps",
        "2",
        "--backend",
        "tch",
        "--device",
        "cuda:0",
    ]);
    assert!(!o.status.success());
    let t = text(&o);
    assert!(!t.contains("panicked"), "{t}");
    assert!(
        t.contains("--features tch") || t.contains("CUDA"),
        "the error names neither the missing feature nor CUDA: {t}"
    );
    let o = dreamddp(&[
        "train",
        "--quiet",
        "--dataset",
        "digits",
        "--steps",
        "2",
        "--device",
        "cuda:0",
    ]);
    assert!(!o.status.success());
    assert!(text(&o).contains("--backend tch"), "{}", text(&o));
    let o = dreamddp(&["train", "--quiet", "--steps", "2", "--backend", "torch"]);
    assert!(!o.status.success());
    assert!(text(&o).contains("unknown backend `torch`"), "{}", text(&o));
    // Models only libtorch builds say so on the built-in backend.
    let o = dreamddp(&[
        "train",
        "--quiet",
        "--model",
        "resnet20",
        "--dataset",
        "digits",
        "--steps",
        "2",
    ]);
    assert!(!o.status.success());
    assert!(text(&o).contains("needs the tch backend"), "{}", text(&o));
    let o = dreamddp(&[
        "train",
        "--quiet",
        "--model",
        "/nonexistent/model.pt",
        "--steps",
        "2",
    ]);
    assert!(!o.status.success());
    assert!(
        text(&o).contains("model file /nonexistent/model.pt not found"),
        "{}",
        text(&o)
    );
}

#[test]
fn collective_flag_cpu_nccl_auto_and_clear_errors() {
    let run = |extra: &[&str]| {
        let mut args = vec![
            "train",
            "--quiet",
            "--dataset",
            "digits",
            "--steps",
            "2",
            "--eval-every",
            "0",
        ];
        args.extend_from_slice(extra);
        dreamddp(&args)
    };
    // No GPU/NCCL on the machines this runs on: `nccl` stops with a message naming what is
    // missing (the feature, the CUDA driver or NCCL), never a panic, never the CPU collective.
    let o = run(&["--collective", "nccl"]);
    let t = text(&o);
    assert!(!o.status.success(), "{t}");
    assert!(t.contains("NCCL") || t.contains("CUDA"), "{t}");
    assert!(!t.contains("panicked"), "{t}");
    assert!(
        !t.contains("test accuracy"),
        "nccl must not fall back to the CPU: {t}"
    );
    // `auto` on the CPU device trains with the CPU collective and says so.
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_dreamddp"))
        .args([
            "train",
            "--quiet",
            "--dataset",
            "digits",
            "--steps",
            "2",
            "--eval-every",
            "0",
            "--collective",
            "auto",
        ])
        .env("RUST_LOG", "info")
        .output()
        .expect("the dreamddp binary starts");
    let t = text(&o);
    assert!(o.status.success(), "{t}");
    assert!(t.contains("2 steps") && t.contains("digits"), "{t}");
    assert!(t.contains("collective: cpu"), "{t}");
    // `auto` with a CUDA device that is not here fails on the device, not on NCCL.
    let o = run(&[
        "--collective",
        "auto",
        "--backend",
        "tch",
        "--device",
        "cuda:0",
    ]);
    let t = text(&o);
    assert!(!o.status.success(), "{t}");
    assert!(!t.contains("panicked"), "{t}");
    assert!(!t.contains("NCCL"), "{t}");
    assert!(t.contains("--features tch") || t.contains("CUDA"), "{t}");
    // The GPU check says what it needs: the features, or a CUDA driver and NCCL.
    let o = dreamddp(&["nccl-check", "--out", "/nonexistent-dir/nccl.json"]);
    let t = text(&o);
    assert!(!o.status.success(), "{t}");
    assert!(!t.contains("panicked"), "{t}");
    assert!(
        t.contains("--features tch,nccl") || t.contains("CUDA") || t.contains("NCCL"),
        "{t}"
    );
    // A bad value lists the accepted ones.
    let o = run(&["--collective", "bogus"]);
    let t = text(&o);
    assert!(!o.status.success(), "{t}");
    assert!(
        t.contains("cpu") && t.contains("nccl") && t.contains("auto"),
        "{t}"
    );
}

#[test]
fn link_check_measures_a_scenario_link_in_both_directions_and_names_bad_nodes() {
    let dir = scratch("link-check");
    let out = dir.join("link-check.json");
    let o = dreamddp(&[
        "link-check",
        "fidelity-smoke",
        "--nodes",
        "edge-1",
        "--seconds",
        "1",
        "--both-ways",
        "--out",
        out.to_str().unwrap(),
    ]);
    let t = text(&o);
    assert!(o.status.success(), "{t}");
    let rows: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    let row = &rows[0];
    assert_eq!(row["node"], "edge-1", "{rows}");
    // Both engines moved bytes over the 10 Mbit/s link in both directions at once, neither
    // more than its capacity allows (1.25 MB in 1 s; the relay is read a moment after the
    // window closes).
    for (figures, key) in [
        (row, "simulated_wire_mb"),
        (row, "real_wire_mb"),
        (&row["down"], "simulated_wire_mb"),
        (&row["down"], "real_wire_mb"),
    ] {
        let mb = figures[key].as_f64().unwrap_or(f64::NAN);
        assert!(mb > 0.0 && mb <= 1.5, "{key} = {mb}: {rows}");
    }
    assert!(
        row["down"]["real_cwnd_mean_kb"].as_f64().unwrap() > 0.0,
        "{rows}"
    );
    assert!(row["capacity_mb"].as_f64().unwrap() > 1.2, "{rows}");
    let o = dreamddp(&["link-check", "fidelity-smoke", "--nodes", "edge-9"]);
    let t = text(&o);
    assert!(!o.status.success(), "{t}");
    assert!(t.contains("edge-9") && t.contains("edge-0, edge-1"), "{t}");
    let o = dreamddp(&["link-check", "fidelity-smoke", "--seconds", "0"]);
    assert!(text(&o).contains("--seconds 0"), "{}", text(&o));
}
