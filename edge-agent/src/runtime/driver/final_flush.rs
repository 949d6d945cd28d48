//! The driver's end of training: [`FinalCuts`] over the node's model, then the client's
//! outputs executed, in the drain loop.

use engine::replica::ModelReplica;
use node::layout::read_sync_unit;
use tracing::info;

use super::SyncDriver;
use crate::final_cuts::FinalCuts;

impl SyncDriver {
    /// Starts the final flush: every layer is owed one last cut ([`Self::flush_final`]).
    pub fn start_final_flush(&mut self) {
        self.final_cuts = FinalCuts::all(self.layers.iter().map(|l| l.layer_id));
    }

    /// Cuts each layer still owed its final cut whose previous delta is no longer in flight
    /// and that does not wait for a re-sync, then executes the client's outputs. Call it in
    /// the drain loop after [`Self::pump`].
    pub fn flush_final(&mut self, model: &mut dyn ModelReplica) -> Result<(), String> {
        if self.final_cuts.is_empty() {
            return Ok(());
        }
        let now = self.now();
        let (layers, by_id) = (&self.layers, &self.by_id);
        let cut = self
            .final_cuts
            .cut_free_layers(&mut self.client, now, self.counters.step, |id| {
                by_id
                    .get(&id)
                    .map(|&li| read_sync_unit(&mut *model, &layers[li]))
            })
            .map_err(|e| format!("final cut: {e}"))?;
        for (layer_id, seq) in cut {
            info!(
                "[FLUSH] layer={} seq={seq}: the progress since its last cut",
                self.layer_name(layer_id)
            );
        }
        let mut changed = Vec::new();
        self.drain_outputs(model, &mut changed)
    }

    /// Layers still owed their final cut.
    pub fn final_cuts_owed(&self) -> usize {
        self.final_cuts.owed()
    }

    /// Whether the node has nothing left to deliver: no final cut owed, no delta
    /// unacknowledged.
    pub fn drained(&self) -> bool {
        self.final_cuts.is_empty() && self.client.undelivered() == 0
    }
}
