//! The simulator's half of the divergence monitor: at each evaluation, every training
//! device's per-layer distance to the global model (the owning aggregator's current
//! values, relative to their norm: `engine::divergence::relative_distance`) goes to the
//! same `coordinator::DivergenceMonitor` the real coordinator runs, with the scenario's
//! `[edge.divergence]` settings. A real trainer measures against the newest global version
//! it holds, which lags the aggregator's by its download time; the simulator measures
//! against the aggregator's, the distance an operator means.

use coordinator::DivergenceWarning;
use engine::divergence::relative_distance;

use super::{Status, World};

impl World<'_> {
    /// Feeds the monitor at virtual second `now_s` and returns the largest distance of any
    /// training device to the global model (`None` when no device is training); warnings
    /// are counted in the result.
    pub(super) fn observe_divergence(&mut self, now_s: f64) -> Option<f64> {
        let mut reports: Vec<(u64, Vec<(u32, f32)>)> = Vec::new();
        let mut buf = Vec::new();
        for (i, n) in self.nodes.iter_mut().enumerate() {
            if !matches!(n.status, Status::Training | Status::Waiting) {
                continue;
            }
            let Some(replica) = n.replica.as_mut() else {
                continue;
            };
            let mut distances = Vec::with_capacity(self.layers.len());
            for l in &self.layers {
                let Some(view) = self.aggs[l.owner].state.layer(l.id) else {
                    continue;
                };
                replica.values_into(l.model_index, &mut buf);
                if let Some(d) = relative_distance(&buf, view.values) {
                    distances.push((l.id, d));
                }
            }
            reports.push((i as u64, distances));
        }
        let now_ms = (now_s * 1e3).round() as u64;
        let warnings: Vec<DivergenceWarning> = self
            .divergence
            .observe(now_ms, reports.iter().map(|(n, d)| (*n, d.as_slice())));
        self.divergence_warnings += warnings.len() as u64;
        reports
            .iter()
            .flat_map(|(_, d)| d.iter().map(|&(_, x)| f64::from(x)))
            .reduce(f64::max)
    }
}
