//! The end of training: each layer's progress since its last cut is cut once more and
//! delivered before the node leaves, so the global model holds all of the node's training
//! (without it, up to a period of every layer's steps — and, for a large layer whose delta
//! was still in flight, everything since that delta's cut — stayed on the node). A layer
//! whose previous delta is in flight, or that waits for a re-sync, is cut when that clears;
//! the cut is dense (a top-k residual goes out whole). The simulator's finished nodes do the
//! same (`simulations` `World::try_drain`), so a real run and a simulated one end alike.

use engine::replica::ModelReplica;
use node::layout::read_sync_unit;
use tracing::info;

use super::SyncDriver;
use crate::state::CutOutcome;

impl SyncDriver {
    /// Starts the final flush: every layer is owed one last cut ([`Self::flush_final`]).
    pub fn start_final_flush(&mut self) {
        self.final_cuts = self.layers.iter().map(|l| l.layer_id).collect();
    }

    /// Cuts each layer still owed its final cut whose previous delta is no longer in flight
    /// and that does not wait for a re-sync, then executes the client's outputs. Call it in
    /// the drain loop after [`Self::pump`].
    pub fn flush_final(&mut self, model: &mut dyn ModelReplica) -> Result<(), String> {
        if self.final_cuts.is_empty() {
            return Ok(());
        }
        let now = self.now();
        let step = self.counters.step;
        let owed: Vec<u32> = self.final_cuts.iter().copied().collect();
        for layer_id in owed {
            let busy = self
                .client
                .in_flight(layer_id)
                .is_some_and(|f| !f.from_cache);
            if busy || self.client.needs_resync(layer_id) {
                continue;
            }
            let Some(&li) = self.by_id.get(&layer_id) else {
                self.final_cuts.remove(&layer_id);
                continue;
            };
            let theta = read_sync_unit(model, &self.layers[li]);
            match self.client.cut_layer(now, step, layer_id, &theta) {
                Ok(CutOutcome::Sent(seq) | CutOutcome::Cached(seq)) => {
                    info!(
                        "[FLUSH] layer={} seq={seq}: the progress since its last cut",
                        self.layers[li].name
                    );
                    self.final_cuts.remove(&layer_id);
                }
                Ok(CutOutcome::SkippedNoSamples) => {
                    self.final_cuts.remove(&layer_id);
                }
                Ok(CutOutcome::Deferred | CutOutcome::SkippedResync) => {}
                Err(e) => return Err(format!("final cut of layer {layer_id}: {e}")),
            }
        }
        let mut changed = Vec::new();
        self.drain_outputs(model, &mut changed)
    }

    /// Layers still owed their final cut.
    pub fn final_cuts_owed(&self) -> usize {
        self.final_cuts.len()
    }

    /// Whether the node has nothing left to deliver: no final cut owed, no delta
    /// unacknowledged.
    pub fn drained(&self) -> bool {
        self.final_cuts.is_empty() && self.client.undelivered() == 0
    }
}
