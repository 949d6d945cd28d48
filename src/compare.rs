//! `dreamddp train --compare`: runs several strategies on the same seed, data and link,
//! prints a table with ratios against `ssgd`, and writes JSON, CSV and SVG plots.

use std::io::Write;
use std::path::PathBuf;

use anyhow::{Context, Result};
use engine::plan::Strategy;
use gpu_worker::trainer::RunReport;

use crate::cli::TrainArgs;
use crate::plots;
use crate::train_cmd::{human_bytes, resolve, train_one, write_json, Variant};

/// Runs the comparison.
pub fn run(args: &TrainArgs) -> Result<()> {
    let strategies: Vec<Variant> = match args.strategies.as_deref() {
        None => Strategy::ALL
            .iter()
            .map(|&s| Variant::from(s))
            .chain(std::iter::once(Variant {
                strategy: Strategy::DreamDdp,
                paper: true,
            }))
            .collect(),
        Some(list) => list
            .split(',')
            .map(|name| simulations::clusters::parse_strategy(name).map_err(anyhow::Error::from))
            .collect::<Result<_>>()?,
    };
    let r = resolve(args)?;
    let out_dir = args.out.clone().unwrap_or_else(|| {
        PathBuf::from(format!(
            "runs/compare-{}-{}",
            r.task.model.name(),
            r.task.dataset
        ))
    });
    println!(
        "comparing {} on {}: {} workers, {} steps, batch {}/worker, period {}, link {} (from '{}')",
        r.task.model.name(),
        r.task.dataset,
        r.cfg.workers,
        r.cfg.steps,
        r.cfg.batch,
        r.period,
        r.cfg.link,
        r.link_spec
    );
    let mut reports = Vec::new();
    for s in &strategies {
        let rep = train_one(&r, *s, args.quiet)?;
        println!("  {}", crate::train_cmd::summary_line(&rep));
        reports.push(rep);
    }
    print_table(&reports);
    std::fs::create_dir_all(&out_dir)
        .with_context(|| format!("cannot create {}", out_dir.display()))?;
    write_json(&out_dir.join("compare.json"), &reports)?;
    write_csv(&out_dir.join("curves.csv"), &reports)?;
    plots::accuracy_plots(&out_dir, &reports)?;
    println!(
        "wrote {0}/compare.json, {0}/curves.csv, {0}/metric_vs_step.svg, {0}/metric_vs_time.svg",
        out_dir.display()
    );
    Ok(())
}

fn print_table(reports: &[RunReport]) {
    let base = reports.iter().find(|r| r.strategy == "ssgd");
    let metric_name = if reports.iter().any(|r| r.test_accuracy.is_some()) {
        "test acc"
    } else {
        "val loss"
    };
    let w = reports
        .iter()
        .map(|r| r.strategy.len())
        .max()
        .unwrap_or(0)
        .max(10);
    println!();
    println!(
        "{:<w$} {:>9} {:>12} {:>10} {:>11} {:>14} {:>8}",
        "strategy", metric_name, "bytes", "vs ssgd", "ms/step", "speedup/ssgd", "wall s"
    );
    for r in reports {
        let metric = match r.test_accuracy {
            Some(a) => format!("{:.2}%", a * 100.0),
            None => format!("{:.3}", r.val_loss),
        };
        let (bytes_ratio, speedup) = match base {
            Some(b) if b.bytes_sent > 0 => (
                format!("{:.3}x", r.bytes_sent as f64 / b.bytes_sent as f64),
                format!("{:.2}x", b.mean_step_ms / r.mean_step_ms),
            ),
            _ => ("-".into(), "-".into()),
        };
        println!(
            "{:<w$} {:>9} {:>12} {:>10} {:>11.2} {:>14} {:>8.1}",
            r.strategy,
            metric,
            human_bytes(r.bytes_sent),
            bytes_ratio,
            r.mean_step_ms,
            speedup,
            r.wall_seconds
        );
    }
    println!();
}

fn write_csv(path: &std::path::Path, reports: &[RunReport]) -> Result<()> {
    let mut w =
        csv::Writer::from_path(path).with_context(|| format!("cannot write {}", path.display()))?;
    w.write_record([
        "strategy",
        "step",
        "train_seconds",
        "bytes_sent",
        "train_loss",
        "test_accuracy",
        "test_loss",
    ])?;
    for r in reports {
        for p in &r.curve {
            w.write_record([
                r.strategy.clone(),
                p.step.to_string(),
                format!("{:.4}", p.train_seconds),
                p.bytes_sent.to_string(),
                format!("{:.5}", p.train_loss),
                p.test_accuracy
                    .map(|a| format!("{a:.5}"))
                    .unwrap_or_default(),
                format!("{:.5}", p.test_loss),
            ])?;
        }
    }
    w.flush()?;
    std::io::stdout().flush().ok();
    Ok(())
}
