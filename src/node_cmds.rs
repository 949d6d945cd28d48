//! The process subcommands of a real cluster: `aggregator`, `worker`, `edge`, `swarm` and `certs`
//! (`coordinator`, `relay` and `cluster` have their own modules). Each reads a TOML config
//! (errors name the bad key) and runs the role's library entry point.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Args;
use protocol::Role;
use tokio_util::sync::CancellationToken;

/// Flags of `aggregator`, `worker` and `edge`.
#[derive(Args, Debug, Clone)]
pub struct ProcessArgs {
    /// The process's TOML config (see `examples/` and docs/cluster.md).
    #[arg(long)]
    pub config: PathBuf,
    /// Override one config key, e.g. `--set node.listen=0.0.0.0:7100 --set sync.deadline_ms=800`
    /// (dotted key; the value is read as TOML, or as a string if it is not valid TOML).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
}

/// Flags of `certs`.
#[derive(Args, Debug, Clone)]
pub struct CertsArgs {
    /// Directory for the CA and node certificates (the CA is reused if present).
    #[arg(long, default_value = "certs")]
    pub dir: PathBuf,
    /// Node names (comma-separated); each gets `<name>.pem` and `<name>.key`.
    #[arg(long, value_delimiter = ',', required_unless_present = "revoke")]
    pub nodes: Vec<String>,
    /// Lifetime of the new node certificates, days.
    #[arg(long, default_value_t = 365, value_parser = clap::value_parser!(u32).range(1..))]
    pub days: u32,
    /// Revoke these nodes' certificates (comma-separated): they are added to the CA-signed
    /// `revoked.crl`, which running coordinators and aggregators re-read within a second;
    /// copy it next to `ca.pem` on every machine that accepts connections.
    #[arg(long, value_delimiter = ',')]
    pub revoke: Vec<String>,
}

/// A cancellation token cancelled by SIGTERM or Ctrl-C.
pub fn shutdown_on_signal() -> CancellationToken {
    let token = CancellationToken::new();
    let t = token.clone();
    tokio::spawn(async move {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(s) => s,
                Err(_) => {
                    let _ = tokio::signal::ctrl_c().await;
                    t.cancel();
                    return;
                }
            };
        tokio::select! {
            _ = term.recv() => {}
            _ = tokio::signal::ctrl_c() => {}
        }
        t.cancel();
    });
    token
}

/// `dreamddp aggregator --config F`.
pub fn aggregator(args: ProcessArgs) -> Result<()> {
    let config =
        cpu_aggregator::server::AggregatorRunConfig::load_with_overrides(&args.config, &args.set)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let summary = runtime.block_on(async {
        let shutdown = shutdown_on_signal();
        cpu_aggregator::server::run_aggregator(config, shutdown).await
    })?;
    println!("{}", serde_json::to_string_pretty(&summary)?);
    Ok(())
}

/// `dreamddp worker --config F` (N local workers) and `dreamddp edge --config F` (1).
pub fn trainer(args: ProcessArgs, role: Role) -> Result<()> {
    let config = edge_agent::runtime::NodeRunConfig::load_with_overrides(&args.config, &args.set)?;
    if role == Role::Edge && config.training.workers != 1 {
        anyhow::bail!(
            "{}: training.workers = {} but an edge agent trains with 1 worker (use `dreamddp worker` for a multi-worker node)",
            args.config.display(),
            config.training.workers
        );
    }
    lower_cpu_priority("node.nice", config.node.nice)?;
    let stop = stop_on_sigterm()?;
    let summary = edge_agent::runtime::run_node_until(&config, role, stop)
        .with_context(|| format!("node {}", config.node.name))?;
    println!("{}", serde_json::to_string_pretty(&summary)?);
    Ok(())
}

/// `dreamddp swarm --config F`: the clients of one swarm process (see
/// `edge_agent::runtime::swarm`). Exits non-zero when a client failed.
pub fn swarm(args: ProcessArgs) -> Result<()> {
    let text = std::fs::read_to_string(&args.config)
        .with_context(|| format!("reading {}", args.config.display()))?;
    let text = node::cluster_model::apply_overrides(&text, &args.config, &args.set)?;
    let config: edge_agent::runtime::swarm::SwarmRunConfig =
        node::cluster_model::parse_toml(&text, &args.config)?;
    lower_cpu_priority("swarm.nice", config.swarm.nice)?;
    let stop = stop_on_sigterm()?;
    let summary = edge_agent::runtime::swarm::run_swarm(&config, stop)
        .with_context(|| format!("swarm {}", config.template.node.name))?;
    if summary.failed > 0 {
        anyhow::bail!(
            "swarm {}: {} of {} clients failed (their errors are in stats.json's per_client)",
            summary.name,
            summary.failed,
            summary.clients
        );
    }
    Ok(())
}

/// Sets this thread's niceness to `nice` (0–19) before any other thread starts, so every
/// thread of the process inherits it (Linux keeps a niceness per thread).
fn lower_cpu_priority(key: &str, nice: i32) -> Result<()> {
    crate::cluster_file::check_niceness(key, nice)?;
    if nice == 0 {
        return Ok(());
    }
    // SAFETY: setpriority only reads its integer arguments; `who` 0 is the calling thread.
    let rc = unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, nice) };
    if rc != 0 {
        let e = std::io::Error::last_os_error();
        tracing::warn!(
            "[WARN] {key} = {nice} not applied ({e}); the process runs at the servers' priority"
        );
    }
    Ok(())
}

/// A flag that SIGTERM (or Ctrl-C) sets, watched by a thread of its own: a trainer stops after
/// its current step, keeps its backlog in the durable cache and writes its stats.
fn stop_on_sigterm() -> Result<std::sync::Arc<std::sync::atomic::AtomicBool>> {
    let flag = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    // Registered before the thread starts, so a SIGTERM right after start is not lost.
    let mut term = {
        let _guard = runtime.enter();
        tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .context("installing the SIGTERM handler")?
    };
    let f = std::sync::Arc::clone(&flag);
    std::thread::Builder::new()
        .name("sigterm".into())
        .spawn(move || {
            runtime.block_on(async {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = tokio::signal::ctrl_c() => {}
                }
            });
            tracing::info!("[STOP] signal received: stopping after this step");
            f.store(true, std::sync::atomic::Ordering::Relaxed);
        })
        .context("starting the signal thread")?;
    Ok(flag)
}

/// `dreamddp certs --dir D --nodes a,b,c`.
/// `dreamddp certs --dir D --revoke a,b` adds them to `D/revoked.crl`.
pub fn certs(args: CertsArgs) -> Result<()> {
    if !args.nodes.is_empty() {
        let lifetime = Duration::from_secs(u64::from(args.days) * 86_400);
        let written = transport::create_cluster_certs_valid_for(&args.dir, &args.nodes, lifetime)?;
        for p in written {
            println!("{}", p.display());
        }
    }
    if !args.revoke.is_empty() {
        let path = transport::revoke_nodes(&args.dir, &args.revoke)?;
        println!(
            "{} (revoked: {}; running nodes that read {} pick it up within a second)",
            path.display(),
            args.revoke.join(", "),
            args.dir.display()
        );
    }
    Ok(())
}

/// `dreamddp relay --config F`: a lossy UDP relay until SIGTERM / Ctrl-C; prints its
/// per-direction counters at exit.
pub fn relay(args: ProcessArgs) -> Result<()> {
    let config = if args.set.is_empty() {
        relay::load_relay_config(&args.config)?
    } else {
        let text = std::fs::read_to_string(&args.config)
            .with_context(|| format!("reading {}", args.config.display()))?;
        let text = node::cluster_model::apply_overrides(&text, &args.config, &args.set)?;
        let base_dir = args
            .config
            .parent()
            .map(std::path::Path::to_path_buf)
            .unwrap_or_else(|| PathBuf::from("."));
        relay::RelayConfig::from_toml_str(&text, &base_dir)?
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    let stats = runtime.block_on(async {
        let shutdown = shutdown_on_signal();
        let handle = relay::spawn_relay(config).await?;
        tracing::info!("[RELAY] listening on {}", handle.local_addr());
        shutdown.cancelled().await;
        let stats = handle.stats();
        handle.shutdown().await;
        anyhow::Ok(stats)
    })?;
    println!("{}", serde_json::to_string_pretty(&stats)?);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_niceness_is_applied_to_the_calling_thread_and_refused_outside_0_to_19() {
        let applied = std::thread::spawn(|| {
            lower_cpu_priority("node.nice", 7).unwrap();
            // SAFETY: getpriority only reads its integer arguments.
            unsafe { libc::getpriority(libc::PRIO_PROCESS, 0) }
        })
        .join()
        .unwrap();
        assert_eq!(applied, 7);
        for bad in [-1, 20] {
            let e = lower_cpu_priority("node.nice", bad)
                .unwrap_err()
                .to_string();
            assert!(e.contains("node.nice"), "{e}");
        }
    }
}
