//! The end of training ([`FinalCuts`]): each layer's progress since its last cut is cut once
//! more and delivered before the node leaves, so the global model holds all of the node's
//! training (without it, up to a period of every layer's steps — and, for a large layer whose
//! delta was still in flight, everything since that delta's cut — stayed on the node). A layer
//! whose previous delta is in flight, or that waits for a re-sync, is cut when that clears.
//! The edge agent's driver and the simulator's finished nodes both keep one, so a real run
//! and a simulated one end alike.

use std::collections::BTreeSet;

use crate::error::ClientError;
use crate::state::{CutOutcome, SyncClient};

/// The layers still owed their last cut.
#[derive(Clone, Debug, Default)]
pub struct FinalCuts {
    owed: BTreeSet<u32>,
}

impl FinalCuts {
    /// Every one of `layers` owes its last cut.
    pub fn all(layers: impl IntoIterator<Item = u32>) -> FinalCuts {
        FinalCuts {
            owed: layers.into_iter().collect(),
        }
    }

    /// Layers still owed their last cut.
    pub fn owed(&self) -> usize {
        self.owed.len()
    }

    /// Whether no cut is owed.
    pub fn is_empty(&self) -> bool {
        self.owed.is_empty()
    }

    /// Cuts each owed layer whose previous delta is no longer in flight and that does not wait
    /// for a re-sync, at `step`, from its values `theta(layer_id)` (dense: a top-k residual
    /// goes out whole; `None`: a layer the caller does not have, no longer owed). Returns the
    /// `(layer, seq)` of each delta cut (sent or queued behind the layer's cache); a layer with
    /// no samples since its last cut owes nothing more.
    pub fn cut_free_layers(
        &mut self,
        client: &mut SyncClient,
        now: u64,
        step: u64,
        mut theta: impl FnMut(u32) -> Option<Vec<f32>>,
    ) -> Result<Vec<(u32, u64)>, ClientError> {
        let mut cut = Vec::new();
        let owed: Vec<u32> = self.owed.iter().copied().collect();
        for layer_id in owed {
            let busy = client.in_flight(layer_id).is_some_and(|f| !f.from_cache);
            if busy || client.needs_resync(layer_id) {
                continue;
            }
            let Some(values) = theta(layer_id) else {
                self.owed.remove(&layer_id);
                continue;
            };
            match client.cut_layer(now, step, layer_id, &values)? {
                CutOutcome::Sent(seq) | CutOutcome::Cached(seq) => {
                    self.owed.remove(&layer_id);
                    cut.push((layer_id, seq));
                }
                CutOutcome::SkippedNoSamples => {
                    self.owed.remove(&layer_id);
                }
                CutOutcome::Deferred | CutOutcome::SkippedResync => {}
            }
        }
        Ok(cut)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{ClientConfig, LayerInit, LayerSpec};
    use protocol::{DeltaAck, Message};

    fn client() -> SyncClient {
        let spec = LayerSpec {
            layer_id: 0,
            name: "fc".into(),
            shape: vec![4],
            period_steps: 8,
            phase: 7,
            deadline_ns: 1_000_000_000,
            owner: 9,
            max_stale_steps: None,
            matrix_rows: None,
        };
        let init = LayerInit {
            spec,
            values: vec![0.0; 4],
            version: 0,
        };
        SyncClient::new(1, vec![init], ClientConfig::default()).unwrap()
    }

    #[test]
    fn a_layer_in_flight_is_cut_once_acknowledged_and_an_unknown_one_owes_nothing() {
        let mut c = client();
        // Step 7 cuts layer 0 (phase 7); step 8 trains on.
        c.on_step_end(7, 7, 1, |_| &[1.0; 4]).unwrap();
        c.on_step_end(8, 8, 1, |_| &[1.0; 4]).unwrap();
        while c.poll_output().is_some() {}
        let seq = c.in_flight(0).expect("the step-7 delta is in flight").seq;
        let mut cuts = FinalCuts::all([0, 99]);
        let theta = |id: u32| (id == 0).then(|| vec![1.5; 4]);
        assert!(cuts
            .cut_free_layers(&mut c, 10, 8, theta)
            .unwrap()
            .is_empty());
        assert_eq!(cuts.owed(), 1, "layer 99 is not the client's: dropped");
        let ack = DeltaAck {
            node_id: 1,
            layer_id: 0,
            seq,
            applied: true,
            new_version: 1,
        };
        c.handle_message(11, Message::DeltaAck(ack));
        let cut = cuts.cut_free_layers(&mut c, 12, 8, theta).unwrap();
        assert_eq!(cut.len(), 1);
        assert_eq!(cut[0].0, 0);
        assert!(cuts.is_empty());
    }
}
