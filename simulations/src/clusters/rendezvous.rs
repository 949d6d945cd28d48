//! The inter-cluster collectives of a clusters simulation as the clusters' sync machines see
//! them: each cluster joins a collective (its [`ReduceKey`]) with its staged buffer and the
//! virtual time its data was ready; once every cluster has joined, the collective is resolved
//! on the [`Fabric`] (it starts when the last cluster joined, behind earlier collectives) and
//! its result is the weighted mean of the buffers. Clusters then wait on it (their compute
//! stream jumps to its end) and apply its slices.

use std::collections::BTreeMap;

use node::collective::ReduceKey;

use crate::time::SimTime;

use super::fabric::{CollectiveSpan, Fabric};
use super::ClustersError;

/// One inter-cluster collective between launch and the last cluster's last apply.
struct Collective {
    /// Its sync units (plan unit ids), backward order.
    units: Vec<usize>,
    /// Per cluster: when it joined and the buffer it brought.
    joined: Vec<Option<(SimTime, Vec<f32>)>>,
    /// Once resolved: when it moved and the weighted mean.
    result: Option<(CollectiveSpan, Vec<f32>)>,
    /// Slices still to be applied over all clusters.
    applies_left: usize,
}

/// A collective resolved on the fabric, as reported to the simulation.
pub(super) struct Resolved {
    /// When it moved.
    pub span: CollectiveSpan,
    /// Its sync units (plan unit ids), backward order.
    pub units: Vec<usize>,
}

/// The collectives in progress, keyed (and resolved) in launch order.
pub(super) struct Rendezvous {
    weights: Vec<f32>,
    collectives: BTreeMap<ReduceKey, Collective>,
}

impl Rendezvous {
    /// Collectives among clusters averaged with `weights` (one per cluster, summing to 1).
    pub(super) fn new(weights: Vec<f32>) -> Self {
        Self {
            weights,
            collectives: BTreeMap::new(),
        }
    }

    /// Cluster `cluster` joins collective `key` at `at` with `buffer`.
    pub(super) fn join(
        &mut self,
        key: ReduceKey,
        units: Vec<usize>,
        cluster: usize,
        at: SimTime,
        buffer: Vec<f32>,
    ) {
        let world = self.weights.len();
        let c = self.collectives.entry(key).or_insert_with(|| Collective {
            applies_left: units.len() * world,
            units,
            joined: vec![None; world],
            result: None,
        });
        assert!(c.joined[cluster].is_none(), "{key} joined twice");
        c.joined[cluster] = Some((at, buffer));
    }

    /// Resolves, in launch order, every collective all clusters have joined.
    pub(super) fn resolve(&mut self, fabric: &mut Fabric) -> Result<Vec<Resolved>, ClustersError> {
        let mut out = Vec::new();
        for c in self.collectives.values_mut() {
            if c.result.is_some() || c.joined.iter().any(Option::is_none) {
                continue;
            }
            let mut ready = SimTime::ZERO;
            let mut mean: Vec<f32> = Vec::new();
            for (joined, &w) in c.joined.iter_mut().zip(&self.weights) {
                let (at, buffer) = joined.take().expect("every cluster joined");
                ready = ready.max(at);
                if mean.is_empty() {
                    mean.resize(buffer.len(), 0.0);
                }
                for (m, v) in mean.iter_mut().zip(&buffer) {
                    *m += w * v;
                }
            }
            let span = fabric.all_reduce(ready, mean.len() as u64 * 4)?;
            out.push(Resolved {
                span,
                units: c.units.clone(),
            });
            c.result = Some((span, mean));
        }
        Ok(out)
    }

    /// When collective `key` ends, if it has been resolved.
    pub(super) fn end_of(&self, key: ReduceKey) -> Option<SimTime> {
        let (span, _) = self.collectives.get(&key)?.result.as_ref()?;
        Some(span.end)
    }

    /// Hands `len` values of `key`'s result from `offset` to `apply`; the collective is
    /// forgotten after its last slice.
    pub(super) fn apply(
        &mut self,
        key: ReduceKey,
        offset: usize,
        len: usize,
        apply: impl FnOnce(&[f32]),
    ) {
        let c = self
            .collectives
            .get_mut(&key)
            .expect("applied collectives exist");
        let (_, mean) = c.result.as_ref().expect("applied collectives are resolved");
        apply(&mean[offset..offset + len]);
        c.applies_left -= 1;
        if c.applies_left == 0 {
            self.collectives.remove(&key);
        }
    }
}
