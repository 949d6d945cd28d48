//! `dreamddp coordinator --config F`: the coordinator process. Its TOML names the model (the
//! layer manifest the layer map is computed over is derived from it), the QUIC and status
//! addresses, the certificates, the join credentials and the divergence monitor's
//! `[divergence]` settings.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Result;
use coordinator::{CoordinatorConfig, CoordinatorRunConfig, DivergenceConfig, LayerInfo};
use node::cluster_model::{read_toml_with_overrides, ModelSection};
use serde::{Deserialize, Serialize};
use transport::TransportConfig;

use crate::node_cmds::{shutdown_on_signal, ProcessArgs};

/// The coordinator's config file.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct CoordinatorFile {
    /// The cluster's model.
    pub model: ModelSection,
    /// This process.
    pub node: CoordinatorNodeSection,
    /// When the divergence monitor warns (`warn_ratio`, `min_spread`, `window`,
    /// `warn_every_ms`; see `coordinator::divergence`).
    #[serde(default)]
    pub divergence: DivergenceConfig,
}

/// `[node]` of the coordinator's config.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct CoordinatorNodeSection {
    /// Node name (certificate `<certs_dir>/<name>.pem`).
    #[serde(default = "default_name")]
    pub name: String,
    /// QUIC address.
    pub listen: SocketAddr,
    /// HTTP status address (`/status` JSON, `/metrics` Prometheus, `/healthz`).
    #[serde(default)]
    pub status: Option<SocketAddr>,
    /// Certificates directory.
    pub certs_dir: PathBuf,
    /// Join credentials every node must present.
    pub credentials: String,
    /// Lease length, milliseconds.
    #[serde(default = "default_lease")]
    pub lease_ms: u64,
}

fn default_name() -> String {
    "coordinator".into()
}
fn default_lease() -> u64 {
    10_000
}

/// Runs the coordinator until SIGTERM / Ctrl-C.
pub fn run(args: ProcessArgs) -> Result<()> {
    let file: CoordinatorFile = read_toml_with_overrides(&args.config, &args.set)?;
    file.divergence
        .validate()
        .map_err(|e| anyhow::anyhow!("{}: {e}", args.config.display()))?;
    // The layer layout only needs the model's shapes, not the data set.
    let model = file.model.initial_model().map_err(anyhow::Error::msg)?;
    let layers = file
        .model
        .layout(&model)
        .into_iter()
        .map(|l| LayerInfo {
            layer_id: l.layer_id,
            name: l.name,
            shape: vec![l.len as u32],
        })
        .collect();
    let config = CoordinatorRunConfig {
        listen: file.node.listen,
        status_addr: file.node.status,
        certs_dir: file.node.certs_dir.clone(),
        node_name: file.node.name.clone(),
        transport: TransportConfig::default(),
        state: CoordinatorConfig {
            credentials: file.node.credentials.clone(),
            lease_ms: file.node.lease_ms,
            layers,
            divergence: file.divergence.clone(),
        },
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let summary = runtime.block_on(async {
        let shutdown = shutdown_on_signal();
        coordinator::run_coordinator(config, shutdown).await
    })?;
    println!("{}", serde_json::to_string_pretty(&summary)?);
    Ok(())
}
