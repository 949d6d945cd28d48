//! Command-line definitions (clap) and the TOML config file that can stand in for flags.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};
use serde::Deserialize;

/// Layer-wise partial synchronization (DreamDDP) for heterogeneous, lossy training clusters.
#[derive(Parser, Debug)]
#[command(name = "dreamddp", version, about)]
pub struct Cli {
    /// Log every per-layer sync (`[SYNC] layer=… bucket=… bytes=… ms=…`); RUST_LOG overrides.
    #[arg(short, long, global = true)]
    pub verbose: bool,
    #[command(subcommand)]
    pub command: Command,
}

/// Subcommands.
#[derive(Subcommand, Debug)]
pub enum Command {
    /// Train a model with N worker threads and a sync strategy (or --compare all strategies).
    Train(Box<TrainArgs>),
    /// Print the sync plan (buckets, per-layer phase and period) a strategy would use, without training.
    Plan(Box<TrainArgs>),
    /// Run a scenario in the deterministic simulator (virtual time, real gradients, modelled links).
    Simulate(Box<crate::simulate_cmd::SimulateArgs>),
    /// Time one training step of mlp and cnn against PyTorch on the CPU (same threads, same run).
    Bench(BenchArgs),
    /// Run the coordinator (membership, leases, layer map, status endpoint).
    Coordinator(crate::node_cmds::ProcessArgs),
    /// Start a whole local cluster of real processes from a cluster file, or run an edge-kind
    /// scenario as real processes, and write summary.json.
    Cluster(crate::cluster_cmd::ClusterArgs),
    /// Run an edge-kind scenario simulated and as real processes; report how far apart they are.
    Fidelity(crate::fidelity_cmd::FidelityArgs),
    /// Run a CPU aggregator process (owns the layers the coordinator maps to it).
    Aggregator(crate::node_cmds::ProcessArgs),
    /// Run a worker node process (N local workers, intra-node collective, talks to aggregators).
    Worker(crate::node_cmds::ProcessArgs),
    /// Run an edge agent process (trains locally, per-layer deadlines, durable weak-sync cache).
    Edge(crate::node_cmds::ProcessArgs),
    /// Run many lightweight edge clients in one process (each the real sync client with its
    /// own QUIC connections, certificate and durable cache; synthetic paced steps instead of
    /// training), to load the aggregators and coordinator; `cluster` starts these for `[swarm]`.
    Swarm(crate::node_cmds::ProcessArgs),
    /// Create a cluster CA and per-node certificates for mutual TLS.
    Certs(crate::node_cmds::CertsArgs),
    /// Run a user-space lossy UDP relay (loss, bursts, latency, jitter, bandwidth, outages, traces).
    Relay(crate::node_cmds::ProcessArgs),
    /// Check the NCCL all-reduce on this machine's GPUs against a CPU reference and measure how
    /// much of it hides behind backward (needs --features tch,nccl and a GPU).
    NcclCheck(crate::nccl_check::NcclCheckArgs),
    /// Measure a scenario's access links alone: the simulator's link model against QUIC through
    /// a relay replaying the same link (payload delivered in the same window, side by side).
    LinkCheck(crate::link_check::LinkCheckArgs),
}

/// Flags of `bench`.
#[derive(Args, Debug, Clone)]
pub struct BenchArgs {
    /// Threads for one step, in both the built-in backend and PyTorch.
    #[arg(long, default_value_t = 1)]
    pub threads: usize,
    /// Timed steps per measurement (the median is reported).
    #[arg(long, default_value_t = 50)]
    pub steps: usize,
    /// Untimed steps before each measurement.
    #[arg(long, default_value_t = 5)]
    pub warmup: usize,
    /// Models to time (comma-separated): mlp, cnn.
    #[arg(long, default_value = "mlp,cnn")]
    pub models: String,
    /// Where to write the JSON report.
    #[arg(long, default_value = "bench.json")]
    pub out: PathBuf,
    /// Skip the PyTorch baseline (no install, no ratio).
    #[arg(long)]
    pub no_torch: bool,
}

/// Flags of `train` and `plan`. Every flag can also come from `--config FILE.toml`
/// (same names with `_` for `-`); flags given on the command line win.
#[derive(Args, Debug, Default, Clone)]
pub struct TrainArgs {
    /// TOML file with any of the flags below as keys (e.g. `strategy = "dreamddp"`).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Model: mlp, cnn, gpt-tiny.
    #[arg(long)]
    pub model: Option<String>,
    /// Data set: mnist, digits (embedded in the binary), tinyshakespeare, or auto
    /// (mnist when ../shared/data is present, else digits; tinyshakespeare for gpt-tiny).
    #[arg(long)]
    pub dataset: Option<String>,
    /// Folder with the data sets (MNIST IDX files, digits.csv, tinyshakespeare/input.txt).
    /// Default: $DREAMDDP_DATA_DIR, then ../shared/data/datasets.
    #[arg(long)]
    pub data_dir: Option<PathBuf>,
    /// Worker threads (model replicas) on this node.
    #[arg(long)]
    pub workers: Option<usize>,
    /// Strategy: ssgd, wfbp, localsgd, dreamddp, plsgd, diloco, streaming-diloco.
    #[arg(long)]
    pub strategy: Option<String>,
    /// Period H of the parameter-averaging strategies (each layer synced once per H steps).
    #[arg(long)]
    pub period: Option<u64>,
    /// DreamDDP: steps from an average's launch to its landing (1: the paper's algorithm;
    /// more: rebased onto the progress made meanwhile; at most period - 1).
    #[arg(long)]
    pub delay: Option<u64>,
    /// Streaming DiLoCo: inner steps a fragment's exchange overlaps (τ, below the period).
    #[arg(long)]
    pub fragment_delay: Option<u64>,
    /// DreamDDP: the largest sync unit in KiB; a larger layer is split into chunks scheduled
    /// as units of their own (0: whole layers; default: chosen by the configuration search
    /// with `--schedule auto`, whole layers otherwise).
    #[arg(long)]
    pub sync_unit_kb: Option<u64>,
    /// DiLoCo / Streaming DiLoCo outer learning rate (default 0.7).
    #[arg(long)]
    pub outer_lr: Option<f32>,
    /// DiLoCo / Streaming DiLoCo outer Nesterov momentum (default 0.9).
    #[arg(long)]
    pub outer_momentum: Option<f32>,
    /// Streaming DiLoCo: weight α of the local values when a fragment lands (default 0.5).
    #[arg(long)]
    pub mix: Option<f32>,
    /// DreamDDP schedule: auto (default: the best of the profiled DFS and equal splits into
    /// 1..=H phase groups, with the best delay, under a multi-step cost model), profiled (the
    /// paper's DFS over measured backward and communication times) or equal.
    #[arg(long)]
    pub schedule: Option<String>,
    /// DreamDDP bubble filling: extra syncs where the modelled link would otherwise idle
    /// (costs bytes; off by default).
    #[arg(long)]
    pub bubble_fill: bool,
    /// Per-layer period overrides, e.g. `head=1,fc1=8`.
    #[arg(long)]
    pub layer_period: Option<String>,
    /// Optimizer steps per worker (default depends on the model and data set).
    #[arg(long)]
    pub steps: Option<u64>,
    /// Per-worker batch size.
    #[arg(long)]
    pub batch: Option<usize>,
    /// Peak learning rate.
    #[arg(long)]
    pub lr: Option<f32>,
    /// Linear warmup steps before the cosine decay.
    #[arg(long)]
    pub warmup: Option<u64>,
    /// Optimizer: sgd (momentum 0.9, Nesterov) or adamw.
    #[arg(long)]
    pub optimizer: Option<String>,
    /// Interconnect between the workers: `none`, `auto` (a full-model all-reduce takes as long
    /// as one backward pass), or `BANDWIDTH[,LATENCY]` such as `1gbit,200us`.
    #[arg(long)]
    pub link: Option<String>,
    /// Seed for the model init and the data order.
    #[arg(long)]
    pub seed: Option<u64>,
    /// Evaluate every N steps (0: only at the end).
    #[arg(long)]
    pub eval_every: Option<u64>,
    /// Cap on test examples per evaluation (full test set by default).
    #[arg(long)]
    pub eval_limit: Option<usize>,
    /// Run every strategy (or --strategies) on the same seed and data and compare them.
    #[arg(long)]
    pub compare: bool,
    /// Strategies for --compare (comma-separated).
    #[arg(long)]
    pub strategies: Option<String>,
    /// Where to write the JSON summary (train) or the folder for compare outputs.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// No progress bar.
    #[arg(long)]
    pub quiet: bool,
    /// Compute backend of the replicas: `builtin` (CPU engine) or `tch` (libtorch; needs a
    /// build with `--features tch`).
    #[arg(long)]
    pub backend: Option<String>,
    /// Device of the tch backend: `cpu` or `cuda:N`, or a list for a mixed node
    /// (`cuda:0,cpu`: worker r trains on entry r mod n).
    #[arg(long)]
    pub device: Option<String>,
    /// Intra-node all-reduce: `cpu` (threads over host memory), `nccl` (GPUs; stops when
    /// NCCL is unusable) or `auto` (NCCL for `--device cuda:N` when it works, else cpu; cpu
    /// for a mixed device list).
    #[arg(long, value_parser = ["cpu", "nccl", "auto"])]
    pub collective: Option<String>,
    /// Start from this checkpoint (safetensors with PyTorch names, e.g. from `--save`).
    #[arg(long)]
    pub load: Option<PathBuf>,
    /// Write the final model here as safetensors with PyTorch names (`fc1.weight`, …).
    #[arg(long)]
    pub save: Option<PathBuf>,
}

/// The TOML form of [`TrainArgs`]; unknown keys are errors that name the key.
#[derive(Deserialize, Debug, Default)]
#[serde(deny_unknown_fields)]
pub struct TrainFile {
    model: Option<String>,
    dataset: Option<String>,
    data_dir: Option<PathBuf>,
    workers: Option<usize>,
    strategy: Option<String>,
    period: Option<u64>,
    delay: Option<u64>,
    fragment_delay: Option<u64>,
    sync_unit_kb: Option<u64>,
    outer_lr: Option<f32>,
    outer_momentum: Option<f32>,
    mix: Option<f32>,
    schedule: Option<String>,
    bubble_fill: Option<bool>,
    layer_period: Option<String>,
    steps: Option<u64>,
    batch: Option<usize>,
    lr: Option<f32>,
    warmup: Option<u64>,
    optimizer: Option<String>,
    link: Option<String>,
    seed: Option<u64>,
    eval_every: Option<u64>,
    eval_limit: Option<usize>,
    compare: Option<bool>,
    strategies: Option<String>,
    out: Option<PathBuf>,
    backend: Option<String>,
    device: Option<String>,
    collective: Option<String>,
    load: Option<PathBuf>,
    save: Option<PathBuf>,
}

impl TrainArgs {
    /// Fills every flag not given on the command line from the config file, if any.
    pub fn merge_config(mut self) -> anyhow::Result<Self> {
        let Some(path) = self.config.clone() else {
            return Ok(self);
        };
        let text = std::fs::read_to_string(&path)
            .map_err(|e| anyhow::anyhow!("cannot read config {}: {e}", path.display()))?;
        let f: TrainFile = toml::from_str(&text)
            .map_err(|e| anyhow::anyhow!("bad config {}: {e}", path.display()))?;
        macro_rules! fill {
            ($($field:ident),*) => { $( if self.$field.is_none() { self.$field = f.$field; } )* };
        }
        fill!(
            model,
            dataset,
            data_dir,
            workers,
            strategy,
            period,
            delay,
            fragment_delay,
            sync_unit_kb,
            outer_lr,
            outer_momentum,
            mix,
            schedule,
            layer_period,
            steps,
            batch,
            lr,
            warmup,
            optimizer,
            link,
            seed,
            eval_every,
            eval_limit,
            strategies,
            out,
            backend,
            device,
            collective,
            load,
            save
        );
        self.compare |= f.compare.unwrap_or(false);
        self.bubble_fill |= f.bubble_fill.unwrap_or(false);
        Ok(self)
    }
}
