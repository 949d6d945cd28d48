//! `dreamddp bench`: times one training step of the MNIST `mlp` and `cnn` (batch 128:
//! forward, softmax cross-entropy, backward, plain SGD update) on the built-in CPU backend
//! against PyTorch on the CPU doing the same step with the same thread count, in the same
//! run, and prints the speed ratio `torch_ms / ours_ms` next to its target.
//!
//! Owns: the step timer for the built-in engine, the driver of the PyTorch baseline
//! (`bench/install_torch.sh` installs PyTorch into a private venv once, `bench/torch_step.py`
//! times it), the result table and the JSON report. For each model the order is
//! ours → PyTorch → ours again, so drift of a busy machine shows as a gap between our two
//! numbers. When PyTorch cannot be installed or run, the reason is printed and our numbers
//! still are; no PyTorch number is ever made up.

use std::fmt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use anyhow::{bail, Context};
use engine::model::Model;
use engine::tensor::Tensor;
use serde::{Deserialize, Serialize};

use crate::cli::BenchArgs;

/// Samples per training step (the MNIST batch of the issue).
pub const BATCH: usize = 128;
/// Learning rate of the plain SGD step (its value does not change the timing).
pub const LEARNING_RATE: f32 = 0.01;
/// MNIST image side.
const IMAGE_SIDE: usize = 28;
/// MNIST classes.
const CLASSES: usize = 10;
/// Seed of the weights, the random batch and the labels.
const SEED: u64 = 7;

/// A model the benchmark knows how to build in both frameworks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BenchModel {
    /// `mlp`: 784 → 512 → 256 → 128 → 10 with ReLU.
    Mlp,
    /// `cnn`: two 5×5 conv + ReLU + 2×2 max-pool stages, fc 1568 → 128, head 128 → 10.
    Cnn,
}

impl BenchModel {
    /// Parses a comma-separated list such as `mlp,cnn` (duplicates removed, order kept).
    pub fn parse_list(list: &str) -> anyhow::Result<Vec<Self>> {
        let mut models = Vec::new();
        for name in list.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let model = match name {
                "mlp" => Self::Mlp,
                "cnn" => Self::Cnn,
                other => bail!("unknown bench model `{other}` (expected mlp or cnn)"),
            };
            if !models.contains(&model) {
                models.push(model);
            }
        }
        if models.is_empty() {
            bail!("--models names no model (expected e.g. mlp,cnn)");
        }
        Ok(models)
    }

    /// The name both frameworks use.
    pub fn name(self) -> &'static str {
        match self {
            Self::Mlp => "mlp",
            Self::Cnn => "cnn",
        }
    }

    /// The speed ratio `torch_ms / ours_ms` the issue asks for.
    pub fn target_ratio(self) -> f64 {
        match self {
            Self::Mlp => 1.0,
            Self::Cnn => 0.7,
        }
    }

    /// Shape of one input batch.
    pub fn input_shape(self) -> Vec<usize> {
        match self {
            Self::Mlp => vec![BATCH, IMAGE_SIDE * IMAGE_SIDE],
            Self::Cnn => vec![BATCH, 1, IMAGE_SIDE, IMAGE_SIDE],
        }
    }

    /// The built-in model with deterministic weights.
    pub fn build(self) -> Model {
        match self {
            Self::Mlp => engine::models::mlp::mlp(
                IMAGE_SIDE * IMAGE_SIDE,
                engine::models::mlp::MLP_MNIST_HIDDEN,
                CLASSES,
                SEED,
            ),
            Self::Cnn => engine::models::cnn::cnn(1, IMAGE_SIDE, IMAGE_SIDE, CLASSES, SEED),
        }
    }
}

/// Summary of per-step wall times.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct StepTiming {
    /// Median milliseconds per step.
    pub median_ms: f64,
    /// 10th percentile.
    pub p10_ms: f64,
    /// 90th percentile.
    pub p90_ms: f64,
    /// Timed steps.
    pub steps: usize,
}

impl StepTiming {
    /// Summarizes per-step times (sorted in place). `None` for an empty slice.
    pub fn from_samples(samples_ms: &mut [f64]) -> Option<Self> {
        if samples_ms.is_empty() {
            return None;
        }
        samples_ms.sort_by(f64::total_cmp);
        let n = samples_ms.len();
        let median_ms = if n % 2 == 1 {
            samples_ms[n / 2]
        } else {
            (samples_ms[n / 2 - 1] + samples_ms[n / 2]) / 2.0
        };
        // Same nearest-rank rule as bench/torch_step.py.
        let quantile = |q: f64| samples_ms[((q * n as f64) as usize).min(n - 1)];
        Some(Self {
            median_ms,
            p10_ms: quantile(0.1),
            p90_ms: quantile(0.9),
            steps: n,
        })
    }
}

/// Deterministic pseudo-random values in [-1, 1) (splitmix64), for the input batch.
fn pseudo_random_batch(len: usize, seed: u64) -> Vec<f32> {
    let mut state = seed;
    (0..len)
        .map(|_| {
            state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            ((z >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// One training step of the built-in engine: forward, loss, backward with the SGD update
/// applied to each layer inside the backward hook. Returns the loss.
fn train_step(model: &mut Model, input: &Tensor, labels: &[usize]) -> f32 {
    let logits = model.forward(input, true);
    let (loss, grad_logits) = engine::loss::softmax_cross_entropy(&logits, labels);
    model.backward_with_hook(&grad_logits, &mut |_, layer| {
        for param in layer.layer.params_mut() {
            for (value, grad) in param.value.iter_mut().zip(&param.grad) {
                *value -= LEARNING_RATE * grad;
            }
        }
    });
    loss
}

/// Times `steps` training steps of the built-in `model` after `warmup` untimed ones.
/// Returns the timing and the loss of the last step.
fn time_ours(model: BenchModel, steps: usize, warmup: usize) -> (StepTiming, f32) {
    let mut net = model.build();
    let shape = model.input_shape();
    let input = Tensor::from_vec(&shape, pseudo_random_batch(shape.iter().product(), SEED));
    let labels: Vec<usize> = (0..BATCH).map(|i| (i * 7 + 3) % CLASSES).collect();
    for _ in 0..warmup {
        train_step(&mut net, &input, &labels);
    }
    let mut samples_ms = Vec::with_capacity(steps);
    let mut loss = f32::NAN;
    for _ in 0..steps {
        let start = Instant::now();
        loss = train_step(&mut net, &input, &labels);
        samples_ms.push(start.elapsed().as_secs_f64() * 1e3);
    }
    let timing = StepTiming::from_samples(&mut samples_ms).expect("steps >= 1 is checked in run");
    (timing, loss)
}

/// Why the PyTorch baseline has no number.
#[derive(Debug)]
pub enum TorchUnavailable {
    /// `--no-torch` was given.
    Disabled,
    /// Neither `$CARGO_MANIFEST_DIR/bench` nor `./bench` holds the scripts.
    ScriptsNotFound(Vec<PathBuf>),
    /// A helper process could not be started.
    Spawn {
        /// What was started.
        what: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// `install_torch.sh` failed.
    InstallFailed {
        /// Exit status as text.
        status: String,
    },
    /// `install_torch.sh` succeeded but did not print `python=<path>`.
    NoInterpreter,
    /// `torch_step.py` failed.
    RunFailed {
        /// Exit status as text.
        status: String,
        /// Last lines of its stderr.
        stderr_tail: String,
    },
    /// `torch_step.py` printed something that is not the expected JSON report.
    BadReport(String),
}

impl fmt::Display for TorchUnavailable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Disabled => write!(f, "disabled by --no-torch"),
            Self::ScriptsNotFound(tried) => {
                let tried: Vec<String> = tried.iter().map(|p| p.display().to_string()).collect();
                write!(
                    f,
                    "bench scripts (install_torch.sh, torch_step.py) not found in {}",
                    tried.join(", ")
                )
            }
            Self::Spawn { what, source } => write!(f, "cannot start {what}: {source}"),
            Self::InstallFailed { status } => {
                write!(
                    f,
                    "bench/install_torch.sh failed ({status}); its output is above"
                )
            }
            Self::NoInterpreter => {
                write!(
                    f,
                    "bench/install_torch.sh did not print the `python=<path>` line"
                )
            }
            Self::RunFailed {
                status,
                stderr_tail,
            } => {
                write!(f, "bench/torch_step.py failed ({status}): {stderr_tail}")
            }
            Self::BadReport(why) => write!(f, "bench/torch_step.py gave no usable report: {why}"),
        }
    }
}

impl std::error::Error for TorchUnavailable {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Spawn { source, .. } => Some(source),
            _ => None,
        }
    }
}

/// What `bench/torch_step.py` prints for one model.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
pub struct TorchReport {
    /// Model name.
    pub model: String,
    /// Intra-op threads PyTorch used.
    pub threads: usize,
    /// Median milliseconds per step.
    pub ms_per_step_median: f64,
    /// 10th percentile.
    pub ms_p10: f64,
    /// 90th percentile.
    pub ms_p90: f64,
    /// `torch.__version__`.
    pub torch_version: String,
}

/// Parses the report line of `torch_step.py` for `model` (the last JSON line of stdout).
pub fn parse_torch_report(stdout: &str, model: &str) -> Result<TorchReport, TorchUnavailable> {
    let line = stdout
        .lines()
        .rev()
        .map(str::trim)
        .find(|l| l.starts_with('{'))
        .ok_or_else(|| TorchUnavailable::BadReport("no JSON line on stdout".into()))?;
    let report: TorchReport = serde_json::from_str(line)
        .map_err(|e| TorchUnavailable::BadReport(format!("{e} in `{line}`")))?;
    if report.model != model {
        return Err(TorchUnavailable::BadReport(format!(
            "asked for {model}, got {}",
            report.model
        )));
    }
    if !(report.ms_per_step_median.is_finite() && report.ms_per_step_median > 0.0) {
        return Err(TorchUnavailable::BadReport(format!(
            "median {} ms is not a positive time",
            report.ms_per_step_median
        )));
    }
    Ok(report)
}

/// The interpreter path from the `python=<path>` line `install_torch.sh` ends with.
pub fn parse_interpreter_line(stdout: &str) -> Option<PathBuf> {
    stdout
        .lines()
        .rev()
        .find_map(|l| l.trim().strip_prefix("python="))
        .filter(|p| !p.is_empty())
        .map(PathBuf::from)
}

/// Folders that may hold the bench scripts, most specific first.
fn bench_dir_candidates() -> Vec<PathBuf> {
    let mut dirs = vec![Path::new(env!("CARGO_MANIFEST_DIR")).join("bench")];
    if let Ok(cwd) = std::env::current_dir() {
        dirs.push(cwd.join("bench"));
    }
    dirs
}

/// The PyTorch side, ready to time steps.
struct TorchBaseline {
    /// The venv interpreter that imports torch.
    python: PathBuf,
    /// `bench/torch_step.py`.
    script: PathBuf,
}

impl TorchBaseline {
    /// Finds the scripts and runs `install_torch.sh` (a no-op once installed).
    fn prepare() -> Result<Self, TorchUnavailable> {
        let candidates = bench_dir_candidates();
        let dir = candidates
            .iter()
            .find(|d| d.join("install_torch.sh").is_file() && d.join("torch_step.py").is_file())
            .ok_or_else(|| TorchUnavailable::ScriptsNotFound(candidates.clone()))?;
        let installer = dir.join("install_torch.sh");
        eprintln!(
            "PyTorch baseline: running {} (the first run downloads ~2.3 GB, ~4 min)",
            installer.display()
        );
        let output = Command::new("bash")
            .arg(&installer)
            .stdin(Stdio::null())
            .stderr(Stdio::inherit())
            .output()
            .map_err(|source| TorchUnavailable::Spawn {
                what: format!("bash {}", installer.display()),
                source,
            })?;
        if !output.status.success() {
            return Err(TorchUnavailable::InstallFailed {
                status: output.status.to_string(),
            });
        }
        let python = parse_interpreter_line(&String::from_utf8_lossy(&output.stdout))
            .ok_or(TorchUnavailable::NoInterpreter)?;
        Ok(Self {
            python,
            script: dir.join("torch_step.py"),
        })
    }

    /// Times `model` in PyTorch with `threads` intra-op threads.
    fn time(
        &self,
        model: BenchModel,
        threads: usize,
        steps: usize,
        warmup: usize,
    ) -> Result<TorchReport, TorchUnavailable> {
        let output = Command::new(&self.python)
            .arg(&self.script)
            .args(["--model", model.name()])
            .args(["--threads", &threads.to_string()])
            .args(["--steps", &steps.to_string()])
            .args(["--warmup", &warmup.to_string()])
            .args(["--batch", &BATCH.to_string()])
            .env("OMP_NUM_THREADS", threads.to_string())
            .env("MKL_NUM_THREADS", threads.to_string())
            .env("CUDA_VISIBLE_DEVICES", "")
            .stdin(Stdio::null())
            .output()
            .map_err(|source| TorchUnavailable::Spawn {
                what: format!("{} {}", self.python.display(), self.script.display()),
                source,
            })?;
        if !output.status.success() {
            let stderr = String::from_utf8_lossy(&output.stderr);
            let lines: Vec<&str> = stderr.lines().collect();
            let stderr_tail = lines[lines.len().saturating_sub(5)..].join(" | ");
            return Err(TorchUnavailable::RunFailed {
                status: output.status.to_string(),
                stderr_tail,
            });
        }
        parse_torch_report(&String::from_utf8_lossy(&output.stdout), model.name())
    }
}

/// One row of the report.
#[derive(Debug, Serialize)]
pub struct ModelResult {
    /// Model name.
    pub model: &'static str,
    /// Our timing before PyTorch ran.
    pub ours_first: StepTiming,
    /// Our timing after PyTorch ran.
    pub ours_second: StepTiming,
    /// Mean of our two medians: the number the ratio uses.
    pub ours_ms: f64,
    /// Loss of our last step (a sanity check that the step computes something).
    pub ours_final_loss: f32,
    /// PyTorch's report, when it ran.
    pub torch: Option<TorchReport>,
    /// Why PyTorch has no number, when it has none.
    pub torch_error: Option<String>,
    /// `torch_ms / ours_ms`, when PyTorch ran.
    pub speed_ratio: Option<f64>,
    /// The target ratio.
    pub target_ratio: f64,
    /// Whether the ratio meets the target, when PyTorch ran.
    pub met: Option<bool>,
}

impl ModelResult {
    /// Combines our two timings with PyTorch's outcome.
    pub fn new(
        model: BenchModel,
        ours_first: StepTiming,
        ours_second: StepTiming,
        ours_final_loss: f32,
        torch: Result<TorchReport, String>,
    ) -> Self {
        let ours_ms = (ours_first.median_ms + ours_second.median_ms) / 2.0;
        let target_ratio = model.target_ratio();
        let (torch, torch_error) = match torch {
            Ok(report) => (Some(report), None),
            Err(why) => (None, Some(why)),
        };
        let speed_ratio = torch.as_ref().map(|t| t.ms_per_step_median / ours_ms);
        let met = speed_ratio.map(|r| r >= target_ratio);
        Self {
            model: model.name(),
            ours_first,
            ours_second,
            ours_ms,
            ours_final_loss,
            torch,
            torch_error,
            speed_ratio,
            target_ratio,
            met,
        }
    }
}

/// The whole JSON report.
#[derive(Debug, Serialize)]
pub struct BenchReport {
    /// Threads both frameworks used.
    pub threads: usize,
    /// Timed steps per measurement.
    pub steps: usize,
    /// Untimed steps before each measurement.
    pub warmup: usize,
    /// Batch size.
    pub batch: usize,
    /// One entry per model.
    pub models: Vec<ModelResult>,
    /// The libtorch rows (builds with the `tch` feature).
    pub tch: Vec<crate::bench_tch::TchRow>,
}

/// The table printed on stdout.
pub fn format_table(report: &BenchReport) -> String {
    let mut out = format!(
        "one training step, batch {}, {} thread(s), median of {} steps\n",
        report.batch, report.threads, report.steps
    );
    out += &format!(
        "{:<5} | {:>22} | {:>9} | {:>11} | {:>6} | {}\n",
        "model", "ours ms (before/after)", "torch ms", "speed ratio", "target", "met?"
    );
    for r in &report.models {
        let ours = format!(
            "{:.2} ({:.2}/{:.2})",
            r.ours_ms, r.ours_first.median_ms, r.ours_second.median_ms
        );
        let torch = r.torch.as_ref().map_or("n/a".to_string(), |t| {
            format!("{:.2}", t.ms_per_step_median)
        });
        let ratio = r
            .speed_ratio
            .map_or("n/a".to_string(), |x| format!("{x:.2}x"));
        let met = match r.met {
            Some(true) => "yes",
            Some(false) => "NO",
            None => "n/a",
        };
        out += &format!(
            "{:<5} | {:>22} | {:>9} | {:>11} | {:>5.1}x | {}\n",
            r.model, ours, torch, ratio, r.target_ratio, met
        );
    }
    for r in &report.models {
        if let Some(why) = &r.torch_error {
            out += &format!("{}: no PyTorch number: {why}\n", r.model);
        }
    }
    out
}

/// Runs `dreamddp bench`.
pub fn run(args: BenchArgs) -> anyhow::Result<()> {
    if args.threads == 0 || args.steps == 0 {
        bail!("--threads and --steps must be at least 1");
    }
    let models = BenchModel::parse_list(&args.models)?;
    engine::backend::set_threads(args.threads);

    // Install before any timing, so the first model is measured like the others.
    let torch = if args.no_torch {
        Err(TorchUnavailable::Disabled)
    } else {
        TorchBaseline::prepare()
    };
    if let Err(why) = &torch {
        eprintln!("PyTorch baseline unavailable: {why}; timing the built-in engine only");
    }

    let mut results = Vec::with_capacity(models.len());
    let mut tch_rows = Vec::new();
    for model in models {
        eprintln!(
            "timing {} (ours, then PyTorch, then ours again)",
            model.name()
        );
        let (ours_first, _) = time_ours(model, args.steps, args.warmup);
        let torch_result = match &torch {
            Ok(baseline) => baseline
                .time(model, args.threads, args.steps, args.warmup)
                .map_err(|e| e.to_string()),
            Err(why) => Err(why.to_string()),
        };
        let (ours_second, loss) = time_ours(model, args.steps, args.warmup);
        let result = ModelResult::new(model, ours_first, ours_second, loss, torch_result);
        if tch_backend::AVAILABLE {
            eprintln!("timing {} on the tch backend", model.name());
            let shape = model.input_shape();
            let input = Tensor::from_vec(&shape, pseudo_random_batch(shape.iter().product(), SEED));
            let labels: Vec<usize> = (0..BATCH).map(|i| (i * 7 + 3) % CLASSES).collect();
            let torch_ms = result.torch.as_ref().map(|t| t.ms_per_step_median);
            match crate::bench_tch::time_tch(
                model,
                &input,
                &labels,
                args.steps,
                args.warmup,
                torch_ms,
                result.ours_ms,
            ) {
                Ok(row) => tch_rows.push(row),
                Err(e) => eprintln!("tch backend on {}: {e}", model.name()),
            }
        }
        results.push(result);
    }

    let report = BenchReport {
        threads: args.threads,
        steps: args.steps,
        warmup: args.warmup,
        batch: BATCH,
        models: results,
        tch: tch_rows,
    };
    print!("{}", format_table(&report));
    let why_none =
        (!tch_backend::AVAILABLE).then_some("this binary was built without `--features tch`");
    print!(
        "{}",
        crate::bench_tch::format_tch_rows(&report.tch, why_none)
    );
    let json = serde_json::to_string_pretty(&report).context("serializing the bench report")?;
    std::fs::write(&args.out, json + "\n")
        .with_context(|| format!("writing {}", args.out.display()))?;
    eprintln!("wrote {}", args.out.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn timing(median_ms: f64) -> StepTiming {
        StepTiming {
            median_ms,
            p10_ms: median_ms,
            p90_ms: median_ms,
            steps: 3,
        }
    }

    fn torch_report(model: &str, ms: f64) -> TorchReport {
        TorchReport {
            model: model.into(),
            threads: 1,
            ms_per_step_median: ms,
            ms_p10: ms,
            ms_p90: ms,
            torch_version: "2.13.0".into(),
        }
    }

    #[test]
    fn step_timing_median_and_quantiles() {
        let mut odd = vec![5.0, 1.0, 3.0, 2.0, 4.0];
        let t = StepTiming::from_samples(&mut odd).unwrap();
        assert_eq!(
            (t.median_ms, t.p10_ms, t.p90_ms, t.steps),
            (3.0, 1.0, 5.0, 5)
        );
        let mut even: Vec<f64> = (1..=10).rev().map(f64::from).collect();
        let t = StepTiming::from_samples(&mut even).unwrap();
        assert_eq!((t.median_ms, t.p10_ms, t.p90_ms), (5.5, 2.0, 10.0));
        assert!(StepTiming::from_samples(&mut []).is_none());
    }

    #[test]
    fn model_list_parsing() {
        assert_eq!(
            BenchModel::parse_list("mlp,cnn").unwrap(),
            [BenchModel::Mlp, BenchModel::Cnn]
        );
        assert_eq!(
            BenchModel::parse_list(" cnn , mlp,cnn").unwrap(),
            [BenchModel::Cnn, BenchModel::Mlp]
        );
        assert!(BenchModel::parse_list("gpt").is_err());
        assert!(BenchModel::parse_list(",").is_err());
    }

    #[test]
    fn torch_report_parsing_checks_model_and_time() {
        let line = r#"{"model": "cnn", "threads": 2, "batch": 128, "steps": 50, "ms_per_step_median": 12.5, "ms_p10": 11.0, "ms_p90": 14.0, "torch_version": "2.13.0+cu130", "final_loss": 2.3}"#;
        let stdout = format!("some warning\n{line}\n");
        let r = parse_torch_report(&stdout, "cnn").unwrap();
        assert_eq!((r.threads, r.ms_per_step_median), (2, 12.5));
        assert!(matches!(
            parse_torch_report(&stdout, "mlp"),
            Err(TorchUnavailable::BadReport(_))
        ));
        assert!(parse_torch_report("no json here", "cnn").is_err());
        let zero = line.replace("12.5", "0.0");
        assert!(parse_torch_report(&zero, "cnn").is_err());
    }

    #[test]
    fn interpreter_line_is_the_last_python_line() {
        let out = "python=/old\nnoise\npython=/venv/bin/python\n";
        assert_eq!(
            parse_interpreter_line(out),
            Some(PathBuf::from("/venv/bin/python"))
        );
        assert_eq!(parse_interpreter_line("python=\n"), None);
        assert_eq!(parse_interpreter_line("installed\n"), None);
    }

    #[test]
    fn ratio_uses_mean_of_our_two_runs_and_the_target() {
        let r = ModelResult::new(
            BenchModel::Cnn,
            timing(10.0),
            timing(14.0),
            2.3,
            Ok(torch_report("cnn", 9.0)),
        );
        assert_eq!(r.ours_ms, 12.0);
        assert_eq!(r.speed_ratio, Some(0.75));
        assert_eq!(r.met, Some(true));
        let r = ModelResult::new(
            BenchModel::Mlp,
            timing(10.0),
            timing(10.0),
            2.3,
            Ok(torch_report("mlp", 9.0)),
        );
        assert_eq!(r.met, Some(false));
        let r = ModelResult::new(
            BenchModel::Mlp,
            timing(10.0),
            timing(10.0),
            2.3,
            Err("no torch".into()),
        );
        assert_eq!((r.speed_ratio, r.met), (None, None));
        let table = format_table(&BenchReport {
            threads: 1,
            steps: 3,
            warmup: 0,
            batch: BATCH,
            models: vec![r],
            tch: Vec::new(),
        });
        assert!(
            table.contains("n/a") && table.contains("no PyTorch number: no torch"),
            "{table}"
        );
    }

    #[test]
    fn input_batch_is_deterministic_and_bounded() {
        let a = pseudo_random_batch(1000, 3);
        assert_eq!(a, pseudo_random_batch(1000, 3));
        assert_ne!(a, pseudo_random_batch(1000, 4));
        assert!(a.iter().all(|x| (-1.0..1.0).contains(x)));
        let mean = a.iter().sum::<f32>() / a.len() as f32;
        assert!(mean.abs() < 0.1, "mean {mean}");
    }
}
