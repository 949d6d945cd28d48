//! The global model of a real cluster, read from what the aggregators persisted: each
//! aggregator's shard file (snapshot + applied ledger, written atomically on every group
//! commit) gives its layers' newest versions; where two shards hold a layer the newer version
//! wins. `cluster` uses it for the final evaluation and for the `series` it samples during a
//! run (the files are replaced by rename, so a reader never sees half of one).

use std::collections::HashMap;
use std::path::PathBuf;

use anyhow::Result;
use cpu_aggregator::server::shard_file::{self, AppliedEntry};
use cpu_aggregator::{AggregatorConfig, AggregatorState};
use engine::model::Model;
use node::layout::SyncLayerDef;

/// One aggregator's shard.
#[derive(Clone, Debug)]
pub struct ShardSource {
    /// Aggregator name (for errors).
    pub name: String,
    /// Its `data_dir` (holding `shard.bin`).
    pub data_dir: PathBuf,
    /// Killed for good (`[[chaos]] restart = false`): its branch of history is not part of the
    /// final system, so its layers are not used; its ledger is read separately.
    pub lost: bool,
}

/// The ledgers read along the way.
#[derive(Clone, Debug, Default)]
pub struct ShardLedgers {
    /// Applied entries of the aggregators that are part of the final system.
    pub ledger: Vec<AppliedEntry>,
    /// Applied entries of aggregators lost for good.
    pub lost_ledger: Vec<AppliedEntry>,
}

/// Writes the newest persisted version of every layer into `model` and returns the ledgers.
/// A shard not written yet is skipped (its layers keep `model`'s values).
pub fn read_global(
    model: &mut Model,
    layout: &[SyncLayerDef],
    shards: &[ShardSource],
) -> Result<ShardLedgers> {
    let mut out = ShardLedgers::default();
    let mut layer_versions: HashMap<u32, u64> = HashMap::new();
    for s in shards {
        let Some((snapshot, entries)) = shard_file::read(&s.data_dir.join("shard.bin"))? else {
            continue;
        };
        if s.lost {
            out.lost_ledger.extend(entries);
            continue;
        }
        let state = AggregatorState::restore(&snapshot, AggregatorConfig::default())
            .map_err(|e| anyhow::anyhow!("{}: {e}", s.name))?;
        for id in state.layer_ids() {
            if let (Some(view), Some(def)) =
                (state.layer(id), layout.iter().find(|d| d.layer_id == id))
            {
                let newest = layer_versions.get(&id).is_none_or(|&v| view.version > v);
                if newest {
                    layer_versions.insert(id, view.version);
                    node::layout::set_unit_values(model, def, view.values);
                }
            }
        }
        out.ledger.extend(entries);
    }
    Ok(out)
}
