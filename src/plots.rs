//! SVG plots of learning curves (test accuracy or validation loss against step and against
//! training time) with `plotters`.

use std::path::Path;

use anyhow::{anyhow, Result};
use gpu_worker::trainer::RunReport;
use plotters::prelude::*;

const COLORS: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
];

/// Writes `metric_vs_step.svg` and `metric_vs_time.svg` into `dir`.
pub fn accuracy_plots(dir: &Path, reports: &[RunReport]) -> Result<()> {
    let accuracy = reports.iter().any(|r| r.test_accuracy.is_some());
    let metric = |p: &gpu_worker::trainer::CurvePoint| -> f64 {
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
    line_plot(
        &dir.join("metric_vs_step.svg"),
        reports,
        "step",
        ylabel,
        |p| p.step as f64,
        metric,
    )?;
    line_plot(
        &dir.join("metric_vs_time.svg"),
        reports,
        "training time (s)",
        ylabel,
        |p| p.train_seconds,
        metric,
    )
}

fn line_plot(
    path: &Path,
    reports: &[RunReport],
    xlabel: &str,
    ylabel: &str,
    x: impl Fn(&gpu_worker::trainer::CurvePoint) -> f64,
    y: impl Fn(&gpu_worker::trainer::CurvePoint) -> f64,
) -> Result<()> {
    let pts: Vec<(f64, f64)> = reports
        .iter()
        .flat_map(|r| r.curve.iter().map(|p| (x(p), y(p))))
        .collect();
    if pts.is_empty() {
        return Ok(());
    }
    let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
    for (a, b) in &pts {
        x0 = x0.min(*a);
        x1 = x1.max(*a);
        y0 = y0.min(*b);
        y1 = y1.max(*b);
    }
    let pad = ((y1 - y0) * 0.05).max(1e-3);
    let root = SVGBackend::new(path, (900, 560)).into_drawing_area();
    root.fill(&WHITE)
        .map_err(|e| anyhow!("plot {}: {e}", path.display()))?;
    let title = format!("{} vs {}", ylabel, xlabel);
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(60)
        .build_cartesian_2d(x0.min(0.0)..x1 * 1.02, (y0 - pad)..(y1 + pad))
        .map_err(|e| anyhow!("plot {}: {e}", path.display()))?;
    chart
        .configure_mesh()
        .x_desc(xlabel)
        .y_desc(ylabel)
        .draw()
        .map_err(|e| anyhow!("plot {}: {e}", path.display()))?;
    for (i, r) in reports.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let series: Vec<(f64, f64)> = r.curve.iter().map(|p| (x(p), y(p))).collect();
        chart
            .draw_series(LineSeries::new(series.clone(), color.stroke_width(2)))
            .map_err(|e| anyhow!("plot {}: {e}", path.display()))?
            .label(r.strategy.clone())
            .legend(move |(px, py)| {
                PathElement::new(vec![(px, py), (px + 20, py)], color.stroke_width(2))
            });
        chart
            .draw_series(
                series
                    .into_iter()
                    .map(|p| Circle::new(p, 3, color.filled())),
            )
            .map_err(|e| anyhow!("plot {}: {e}", path.display()))?;
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(|e| anyhow!("plot {}: {e}", path.display()))?;
    root.present()
        .map_err(|e| anyhow!("plot {}: {e}", path.display()))?;
    Ok(())
}
