//! Configuration of the coordinator state machine: the cluster secret, the lease length,
//! the model's layer manifest the layer map is computed over, and the divergence monitor.

use serde::{Deserialize, Serialize};

use crate::divergence::DivergenceConfig;

/// Identifies one connection; chosen by the shell (unique for the process lifetime).
pub type ConnId = u64;

/// One layer of the model, as the coordinator knows it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayerInfo {
    /// Layer index in the model's layer manifest.
    pub layer_id: u32,
    /// Layer name (for logs, status and metrics labels).
    pub name: String,
    /// Tensor shape, row-major; a [`protocol::LayerVersion`] with another shape is refused.
    pub shape: Vec<u32>,
}

impl LayerInfo {
    /// Bytes of the layer's f32 values (what the layer map balances).
    pub fn bytes(&self) -> u64 {
        self.shape.iter().map(|&d| u64::from(d)).product::<u64>() * 4
    }
}

/// What the coordinator state machine needs to run.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CoordinatorConfig {
    /// Shared secret every [`protocol::Join`] must present.
    pub credentials: String,
    /// Lease length in milliseconds: a member that does not heartbeat within it is removed.
    pub lease_ms: u64,
    /// The model's layers (ids must be unique; the first of a repeated id wins).
    pub layers: Vec<LayerInfo>,
    /// When the divergence monitor warns.
    #[serde(default)]
    pub divergence: DivergenceConfig,
}
