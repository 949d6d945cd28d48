//! SVG plots with `plotters`: learning curves of `train --compare` and the simulator's
//! accuracy/bytes over virtual time and per-layer sync timeline.

use std::path::Path;

use anyhow::{anyhow, Result};
use gpu_worker::trainer::{CurvePoint, RunReport};
use plotters::prelude::*;

const COLORS: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
];

/// One named line of a chart.
pub struct Series {
    /// Legend label.
    pub label: String,
    /// Points (x, y).
    pub points: Vec<(f64, f64)>,
}

/// Writes `metric_vs_step.svg` and `metric_vs_time.svg` for `train --compare` into `dir`.
pub fn accuracy_plots(dir: &Path, reports: &[RunReport]) -> Result<()> {
    let accuracy = reports.iter().any(|r| r.test_accuracy.is_some());
    let metric = |p: &CurvePoint| -> f64 {
        if accuracy {
            p.test_accuracy.unwrap_or(0.0) * 100.0
        } else {
            p.test_loss
        }
    };
    let ylabel = if accuracy {
        "test accuracy (%)"
    } else {
        "validation loss (nats/char)"
    };
    let series = |x: &dyn Fn(&CurvePoint) -> f64| -> Vec<Series> {
        reports
            .iter()
            .map(|r| Series {
                label: r.strategy.clone(),
                points: r.curve.iter().map(|p| (x(p), metric(p))).collect(),
            })
            .collect()
    };
    line_chart(
        &dir.join("metric_vs_step.svg"),
        "step",
        ylabel,
        &series(&|p| p.step as f64),
    )?;
    line_chart(
        &dir.join("metric_vs_time.svg"),
        "training time (s)",
        ylabel,
        &series(&|p| p.train_seconds),
    )
}

/// A line chart of several series, with markers and a legend.
pub fn line_chart(path: &Path, xlabel: &str, ylabel: &str, series: &[Series]) -> Result<()> {
    let pts: Vec<(f64, f64)> = series
        .iter()
        .flat_map(|s| s.points.iter().copied())
        .collect();
    if pts.is_empty() {
        return Ok(());
    }
    let err = |e: &dyn std::fmt::Display| anyhow!("plot {}: {e}", path.display());
    let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
    for (a, b) in &pts {
        x0 = x0.min(*a);
        x1 = x1.max(*a);
        y0 = y0.min(*b);
        y1 = y1.max(*b);
    }
    let pad = ((y1 - y0) * 0.05).max(1e-3);
    let root = SVGBackend::new(path, (900, 560)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(format!("{ylabel} vs {xlabel}"), ("sans-serif", 22))
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(70)
        .build_cartesian_2d(
            x0.min(0.0)..(x1 * 1.02).max(x0 + 1e-9),
            (y0 - pad)..(y1 + pad),
        )
        .map_err(|e| err(&e))?;
    chart
        .configure_mesh()
        .x_desc(xlabel)
        .y_desc(ylabel)
        .draw()
        .map_err(|e| err(&e))?;
    for (i, s) in series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        chart
            .draw_series(LineSeries::new(s.points.clone(), color.stroke_width(2)))
            .map_err(|e| err(&e))?
            .label(s.label.clone())
            .legend(move |(px, py)| {
                PathElement::new(vec![(px, py), (px + 20, py)], color.stroke_width(2))
            });
        chart
            .draw_series(s.points.iter().map(|p| Circle::new(*p, 3, color.filled())))
            .map_err(|e| err(&e))?;
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(|e| err(&e))?;
    root.present().map_err(|e| err(&e))?;
    Ok(())
}

/// One bar of a timeline: a row label, start and end, and whether it is highlighted (weak sync).
pub struct Bar {
    /// Row (e.g. `edge-3/fc1`).
    pub row: String,
    /// Start (x units).
    pub start: f64,
    /// End (x units).
    pub end: f64,
    /// Drawn in red when true.
    pub highlight: bool,
}

/// A Gantt-style timeline: one row per distinct label, a bar per event.
pub fn timeline_chart(path: &Path, title: &str, xlabel: &str, bars: &[Bar]) -> Result<()> {
    if bars.is_empty() {
        return Ok(());
    }
    let err = |e: &dyn std::fmt::Display| anyhow!("plot {}: {e}", path.display());
    let mut rows: Vec<&str> = Vec::new();
    for b in bars {
        if !rows.contains(&b.row.as_str()) {
            rows.push(&b.row);
        }
    }
    let x1 = bars.iter().map(|b| b.end).fold(0.0f64, f64::max).max(1e-9);
    let height = (120 + rows.len() * 18).min(2400) as u32;
    let root = SVGBackend::new(path, (1000, height)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(10)
        .x_label_area_size(40)
        .y_label_area_size(140)
        .build_cartesian_2d(0.0..x1 * 1.01, 0.0..rows.len() as f64)
        .map_err(|e| err(&e))?;
    let labels: Vec<String> = rows.iter().map(|r| r.to_string()).collect();
    chart
        .configure_mesh()
        .x_desc(xlabel)
        .y_labels(rows.len().min(60))
        .y_label_formatter(&|y| labels.get(*y as usize).cloned().unwrap_or_default())
        .disable_y_mesh()
        .draw()
        .map_err(|e| err(&e))?;
    chart
        .draw_series(bars.iter().map(|b| {
            let r = rows.iter().position(|x| *x == b.row).unwrap_or(0) as f64;
            let color = if b.highlight {
                RGBColor(214, 39, 40)
            } else {
                RGBColor(31, 119, 180)
            };
            let end = if b.end > b.start {
                b.end
            } else {
                b.start + x1 * 0.002
            };
            Rectangle::new([(b.start, r + 0.15), (end, r + 0.85)], color.filled())
        }))
        .map_err(|e| err(&e))?;
    root.present().map_err(|e| err(&e))?;
    Ok(())
}
