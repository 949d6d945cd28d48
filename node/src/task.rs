//! What a node trains: the model to build and the data it reads, with per-task defaults
//! (steps, batch, optimizer, learning rate) that reach the accuracy targets in the README.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use engine::data::corpus::{CharCorpus, Split};
use engine::data::sampler::ShardedSampler;
use engine::data::TrainTest;
use engine::loss::{argmax_accuracy, try_softmax_cross_entropy};
use engine::model::Model;
use engine::models::gpt::{gpt_tiny, GptConfig};
use engine::optim::OptimizerConfig;
use engine::replica::ModelReplica;
use engine::tensor::Tensor;
use rand_chacha::ChaCha8Rng;
use serde::Serialize;

use crate::data_shards::Sampling;

/// Which built-in model to train.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub enum ModelKind {
    /// Multi-layer perceptron (4+ linear layers).
    Mlp,
    /// Two conv + pool stages, then two linear layers.
    Cnn,
    /// Character-level causal transformer.
    GptTiny,
    /// ResNet-20 with BatchNorm (tch backend only).
    ResNet20,
    /// A TorchScript module exported from PyTorch (tch backend only), by its file path.
    TorchScript(PathBuf),
}

impl ModelKind {
    /// Name used on the command line and in reports.
    pub fn name(&self) -> &'static str {
        match self {
            ModelKind::Mlp => "mlp",
            ModelKind::Cnn => "cnn",
            ModelKind::GptTiny => "gpt-tiny",
            ModelKind::ResNet20 => "resnet20",
            ModelKind::TorchScript(_) => "torchscript",
        }
    }

    /// Whether the built-in engine can build this model (otherwise only the tch backend can).
    pub fn is_builtin(&self) -> bool {
        matches!(self, ModelKind::Mlp | ModelKind::Cnn | ModelKind::GptTiny)
    }
}

impl std::str::FromStr for ModelKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "mlp" => Ok(ModelKind::Mlp),
            "cnn" => Ok(ModelKind::Cnn),
            "gpt-tiny" | "gpt" => Ok(ModelKind::GptTiny),
            "resnet20" | "resnet-20" => Ok(ModelKind::ResNet20),
            path if path.contains('/') || path.ends_with(".pt") || path.ends_with(".pth") => {
                let p = PathBuf::from(path);
                if p.is_file() {
                    Ok(ModelKind::TorchScript(p))
                } else {
                    Err(format!(
                        "model file {path} not found: pass a TorchScript module saved with \
                         torch.jit.script(model).save(PATH) (see examples/export_model.py)"
                    ))
                }
            }
            other => Err(format!(
                "unknown model '{other}'; expected one of: mlp, cnn, gpt-tiny, resnet20 \
                 (tch backend), or the path of a TorchScript file (tch backend)"
            )),
        }
    }
}

/// The data a task reads, shared read-only by every worker thread.
#[derive(Clone)]
pub enum TaskData {
    /// An image classification data set (MNIST or digits).
    Images(Arc<TrainTest>),
    /// A character corpus (tinyshakespeare).
    Chars(Arc<CharCorpus>),
}

/// A model + data pairing with everything needed to build identical replicas.
#[derive(Clone)]
pub struct Task {
    /// Model kind.
    pub model: ModelKind,
    /// Data set name for reports (`mnist`, `digits`, `tinyshakespeare`).
    pub dataset: String,
    /// The data.
    pub data: TaskData,
    /// Transformer shape (gpt-tiny only).
    pub gpt: Option<GptConfig>,
    /// How the training samples are dealt to ranks and which of them this process holds.
    pub sampling: Sampling,
}

/// One training batch, reused across steps.
#[derive(Default)]
pub struct Batch {
    /// Model input.
    pub input: Tensor,
    /// Class (or next-character) targets, one per output row.
    pub targets: Vec<usize>,
    /// Sample indices scratch.
    pub indices: Vec<usize>,
}

/// Task-specific training defaults (what `dreamddp train` uses when a flag is absent).
#[derive(Clone, Debug)]
pub struct TaskDefaults {
    /// Optimizer steps.
    pub steps: u64,
    /// Per-worker batch size.
    pub batch: usize,
    /// Peak learning rate.
    pub lr: f32,
    /// Warmup steps.
    pub warmup: u64,
    /// Optimizer.
    pub optimizer: OptimizerConfig,
    /// Evaluate every this many steps.
    pub eval_every: u64,
}

impl Task {
    /// Bytes the data takes in memory (features at their stored precision, labels, tokens).
    pub fn data_bytes(&self) -> usize {
        match &self.data {
            TaskData::Images(tt) => tt.train.stored_bytes() + tt.test.stored_bytes(),
            TaskData::Chars(c) => (c.train.len() + c.val.len()) * std::mem::size_of::<u32>(),
        }
    }

    /// Builds the built-in engine's model; the same `seed` gives identical weights on every
    /// worker.
    ///
    /// # Panics
    /// For a model only the tch backend builds (`resnet20`, TorchScript): callers that take
    /// such models go through `node::backend::Backend::build_replica`; the others (cluster
    /// configs, scenarios) refuse them when they parse ([`Task::require_builtin`]).
    pub fn build_model(&self, seed: u64) -> Model {
        match (&self.model, &self.data) {
            (ModelKind::Mlp, TaskData::Images(tt)) => {
                let dim: usize = tt.train.sample_shape.iter().product();
                let hidden: &[usize] = if dim >= 784 {
                    engine::models::mlp::MLP_MNIST_HIDDEN
                } else {
                    engine::models::mlp::MLP_DIGITS_HIDDEN
                };
                engine::models::mlp::mlp(dim, hidden, tt.train.classes, seed)
            }
            (ModelKind::Cnn, TaskData::Images(tt)) => {
                let s = &tt.train.sample_shape;
                engine::models::cnn::cnn(s[0], s[1], s[2], tt.train.classes, seed)
            }
            (ModelKind::GptTiny, TaskData::Chars(c)) => {
                let cfg = self
                    .gpt
                    .clone()
                    .unwrap_or_else(|| GptConfig::tiny(c.vocab.len()));
                gpt_tiny(&cfg, seed)
            }
            // Task::new rejects the other pairings.
            _ => unreachable!("model/data pairing validated in Task::new"),
        }
    }

    /// An error unless the built-in engine can build this task's model (what the simulator and
    /// the cluster's processes need today).
    pub fn require_builtin(&self, what: &str) -> Result<(), String> {
        if self.model.is_builtin() {
            Ok(())
        } else {
            Err(format!(
                "{what} runs the built-in models only (mlp, cnn, gpt-tiny); model '{}' trains with `dreamddp train --backend tch`",
                self.model.name()
            ))
        }
    }

    /// Pairs a model with data; a mismatch (e.g. gpt-tiny on MNIST) is an error that says so.
    pub fn new(model: ModelKind, dataset: &str, data: TaskData) -> Result<Self, String> {
        let ok = matches!(
            (&model, &data),
            (
                ModelKind::Mlp | ModelKind::Cnn | ModelKind::ResNet20 | ModelKind::TorchScript(_),
                TaskData::Images(_)
            ) | (ModelKind::GptTiny, TaskData::Chars(_))
        );
        if !ok {
            return Err(format!(
                "model '{}' cannot train on data set '{dataset}': mlp, cnn, resnet20 and TorchScript models take image data sets (mnist, digits), gpt-tiny takes tinyshakespeare",
                model.name()
            ));
        }
        if let (ModelKind::Cnn | ModelKind::ResNet20, TaskData::Images(tt)) = (&model, &data) {
            let s = &tt.train.sample_shape;
            if s.len() != 3 || s[1] < 4 || s[2] < 4 {
                return Err(format!(
                    "model '{}' takes images of shape [channels, height, width] with height and \
                     width ≥ 4; data set '{dataset}' has samples of shape {s:?} (use --model mlp, \
                     or reshape train_x/test_x to [N, C, H, W])",
                    model.name()
                ));
            }
        }
        let gpt = match &data {
            TaskData::Chars(c) => Some(GptConfig::tiny(c.vocab.len())),
            TaskData::Images(_) => None,
        };
        Ok(Self {
            model,
            dataset: dataset.to_string(),
            data,
            gpt,
            sampling: Sampling::default(),
        })
    }

    /// The sampler of rank `rank` of `world` over the training samples this task holds
    /// ([`Sampling::sampler`]).
    pub fn sampler(
        &self,
        rank: usize,
        world: usize,
        seed: u64,
    ) -> Result<ShardedSampler, engine::data::DataError> {
        self.sampling.sampler(self.train_len(), rank, world, seed)
    }

    /// Defaults that reach the README's accuracy targets.
    pub fn defaults(&self) -> TaskDefaults {
        let sgd = OptimizerConfig::Sgd {
            momentum: 0.9,
            weight_decay: 0.0,
            nesterov: true,
        };
        let adamw = |wd: f32| OptimizerConfig::AdamW {
            beta1: 0.9,
            beta2: 0.99,
            eps: 1e-8,
            weight_decay: wd,
        };
        let small = matches!(&self.data, TaskData::Images(tt) if tt.train.len() < 10_000);
        match self.model {
            ModelKind::Mlp if small => TaskDefaults {
                steps: 600,
                batch: 16,
                lr: 0.05,
                warmup: 30,
                optimizer: sgd,
                eval_every: 50,
            },
            ModelKind::Mlp => TaskDefaults {
                steps: 2000,
                batch: 32,
                lr: 0.05,
                warmup: 100,
                optimizer: sgd,
                eval_every: 200,
            },
            ModelKind::Cnn if small => TaskDefaults {
                steps: 600,
                batch: 16,
                lr: 2e-3,
                warmup: 30,
                optimizer: adamw(0.0),
                eval_every: 50,
            },
            ModelKind::Cnn => TaskDefaults {
                steps: 1200,
                batch: 32,
                lr: 2e-3,
                warmup: 100,
                optimizer: adamw(0.0),
                eval_every: 200,
            },
            ModelKind::ResNet20 => TaskDefaults {
                steps: 1500,
                batch: 32,
                lr: 0.05,
                warmup: 100,
                optimizer: OptimizerConfig::Sgd {
                    momentum: 0.9,
                    weight_decay: 5e-4,
                    nesterov: true,
                },
                eval_every: 250,
            },
            ModelKind::TorchScript(_) => TaskDefaults {
                steps: if small { 600 } else { 1200 },
                batch: if small { 16 } else { 32 },
                lr: 1e-3,
                warmup: 50,
                optimizer: adamw(0.0),
                eval_every: if small { 50 } else { 200 },
            },
            ModelKind::GptTiny => TaskDefaults {
                steps: 1500,
                batch: 8,
                lr: 3e-3,
                warmup: 100,
                optimizer: adamw(0.01),
                eval_every: 250,
            },
        }
    }

    /// Number of training examples (images) or training characters this process holds.
    pub fn train_len(&self) -> usize {
        match &self.data {
            TaskData::Images(tt) => tt.train.len(),
            TaskData::Chars(c) => c.train.len(),
        }
    }

    /// Fills `batch` for one worker. Images: the given sample indices; chars: random windows.
    pub fn fill_batch(&self, batch: &mut Batch, rng: &mut ChaCha8Rng, batch_size: usize) {
        match &self.data {
            TaskData::Images(tt) => {
                if self.model == ModelKind::Mlp {
                    tt.train
                        .batch_flat(&batch.indices, &mut batch.input, &mut batch.targets);
                } else {
                    tt.train
                        .batch(&batch.indices, &mut batch.input, &mut batch.targets);
                }
            }
            TaskData::Chars(c) => {
                let ctx = self.gpt.as_ref().map(|g| g.context).unwrap_or(64);
                let (x, y) = c.sample_batch(rng, batch_size, ctx, Split::Train);
                batch.input = x;
                batch.targets = y;
            }
        }
    }

    /// Evaluates `model`: test accuracy (images) or validation loss in nats/char (chars).
    /// `limit` caps the number of test examples (images) or validation batches x 16.
    pub fn evaluate(&self, model: &mut Model, limit: Option<usize>) -> Evaluation {
        self.evaluate_with(&mut |x| Ok(model.forward(x, false)), limit)
            .unwrap_or_else(|e| panic!("the built-in model does not fit its own task: {e}"))
    }

    /// Evaluates a replica of any backend through the seam (its eval-mode logits).
    pub fn evaluate_replica(
        &self,
        replica: &mut dyn ModelReplica,
        limit: Option<usize>,
    ) -> Result<Evaluation, String> {
        self.evaluate_with(&mut |x| replica.logits(x).map_err(|e| e.to_string()), limit)
    }

    /// Evaluates the model behind `forward` (input batch → logits).
    pub fn evaluate_with(
        &self,
        forward: &mut dyn FnMut(&Tensor) -> Result<Tensor, String>,
        limit: Option<usize>,
    ) -> Result<Evaluation, String> {
        match &self.data {
            TaskData::Images(tt) => {
                let test = &tt.test;
                let n = limit.unwrap_or(test.len()).min(test.len());
                let mut correct = 0usize;
                let mut loss_sum = 0.0f64;
                let mut b = Batch::default();
                let chunk = 500;
                let mut start = 0;
                while start < n {
                    let end = (start + chunk).min(n);
                    b.indices.clear();
                    b.indices.extend(start..end);
                    if self.model == ModelKind::Mlp {
                        test.batch_flat(&b.indices, &mut b.input, &mut b.targets);
                    } else {
                        test.batch(&b.indices, &mut b.input, &mut b.targets);
                    }
                    let logits = forward(&b.input)?;
                    let (loss, _) = try_softmax_cross_entropy(&logits, &b.targets)
                        .map_err(|e| e.to_string())?;
                    loss_sum += loss as f64 * (end - start) as f64;
                    correct += argmax_accuracy(&logits, &b.targets);
                    start = end;
                }
                Ok(Evaluation {
                    accuracy: Some(correct as f64 / n.max(1) as f64),
                    loss: loss_sum / n.max(1) as f64,
                })
            }
            TaskData::Chars(c) => {
                let ctx = self.gpt.as_ref().map(|g| g.context).unwrap_or(64);
                let batches = limit.unwrap_or(40).max(1);
                // A fixed RNG: every evaluation sees the same validation windows.
                let mut rng = <ChaCha8Rng as rand::SeedableRng>::seed_from_u64(0xE7A1);
                let mut loss_sum = 0.0f64;
                for _ in 0..batches {
                    let (x, y) = c.sample_batch(&mut rng, 16, ctx, Split::Val);
                    let logits = forward(&x)?;
                    let (loss, _) =
                        try_softmax_cross_entropy(&logits, &y).map_err(|e| e.to_string())?;
                    loss_sum += loss as f64;
                }
                Ok(Evaluation {
                    accuracy: None,
                    loss: loss_sum / batches as f64,
                })
            }
        }
    }
}

/// Result of one evaluation.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct Evaluation {
    /// Test accuracy in 0..1 (classification tasks).
    pub accuracy: Option<f64>,
    /// Mean test/validation loss (nats per example or per character).
    pub loss: f64,
}

/// Loads a data set by name: `mnist` from `dir` (IDX files), `digits` from `dir/digits.csv`
/// or the copy embedded in the binary, `tinyshakespeare` from `dir/tinyshakespeare/input.txt`
/// or `dir/input.txt`.
pub fn load_data(dataset: &str, dir: Option<&Path>) -> Result<TaskData, String> {
    match dataset {
        "mnist" => {
            let dir = dir.ok_or_else(|| {
                "MNIST not found: pass --data-dir pointing at a folder with train-images-idx3-ubyte(.gz), \
                 or run from a checkout next to ../shared/data/datasets, or use --dataset digits (embedded)"
                    .to_string()
            })?;
            let tt =
                engine::data::mnist::load_mnist(&mnist_folder(dir)).map_err(|e| e.to_string())?;
            Ok(TaskData::Images(Arc::new(tt)))
        }
        "digits" => {
            let tt = match dir.map(|d| d.join("digits.csv")).filter(|p| p.is_file()) {
                Some(p) => engine::data::digits::load_digits_csv(&p).map_err(|e| e.to_string())?,
                None => engine::data::digits::load_digits_embedded(),
            };
            Ok(TaskData::Images(Arc::new(tt)))
        }
        "tinyshakespeare" | "shakespeare" => {
            let dir = dir.ok_or_else(|| {
                "tinyshakespeare not found: pass --data-dir pointing at a folder with tinyshakespeare/input.txt".to_string()
            })?;
            let candidates = [dir.join("tinyshakespeare/input.txt"), dir.join("input.txt")];
            let path = candidates.iter().find(|p| p.is_file()).ok_or_else(|| {
                format!(
                    "no tinyshakespeare/input.txt or input.txt under {}",
                    dir.display()
                )
            })?;
            let c = CharCorpus::load(path).map_err(|e| e.to_string())?;
            Ok(TaskData::Chars(Arc::new(c)))
        }
        path if path.ends_with(".safetensors") => {
            let tt = engine::data::tensor_file::load_tensor_file(Path::new(path))
                .map_err(|e| e.to_string())?;
            Ok(TaskData::Images(Arc::new(tt)))
        }
        other => Err(format!(
            "unknown data set '{other}'; expected one of: mnist, digits, tinyshakespeare, or a \
             FILE.safetensors holding train_x, train_y, test_x, test_y"
        )),
    }
}

/// The folder of the MNIST files under a data folder: `dir/mnist` when it exists, else `dir`.
pub fn mnist_folder(dir: &Path) -> PathBuf {
    if dir.join("mnist").is_dir() {
        dir.join("mnist")
    } else {
        dir.to_path_buf()
    }
}

/// Resolves `auto` to a concrete data set for `model`: tinyshakespeare for gpt-tiny, MNIST when
/// its files are under `dir`, else the embedded digits. Other names pass through.
pub fn resolve_dataset(model: &ModelKind, dataset: &str, dir: Option<&Path>) -> String {
    if dataset != "auto" {
        return dataset.to_string();
    }
    match (model, dir) {
        (ModelKind::GptTiny, _) => "tinyshakespeare".to_string(),
        (_, Some(d))
            if d.join("mnist").is_dir() || d.join("train-images-idx3-ubyte.gz").is_file() =>
        {
            "mnist".to_string()
        }
        _ => "digits".to_string(),
    }
}
