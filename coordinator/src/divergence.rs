//! The divergence monitor (sans-IO): per layer, how far the trainers' models have drifted
//! from the global model, and a warning when that spread grows.
//!
//! Each trainer reports, per layer, its distance to the newest global version it holds,
//! relative to that version's norm (`protocol::NodeStats::layer_divergence`, computed by
//! `engine::divergence::relative_distance`). A layer's **spread** is the largest distance over the trainers
//! that reported it (the mean is kept beside it). The monitor keeps each layer's spreads of
//! the last [`DivergenceConfig::window_ms`]; a new spread above
//! [`DivergenceConfig::warn_ratio`] × the lowest spread of that window, and above
//! [`DivergenceConfig::min_spread`], for at least [`DivergenceConfig::sustain_ms`], is a
//! [`DivergenceWarning`] (at most one per layer per [`DivergenceConfig::warn_every_ms`]):
//! "the spread grew `warn_ratio`-fold within a minute, and stayed there". The sustain
//! keeps one late delivery on a lossy link (a blip of a few seconds) from raising an alarm. The baseline is the window's minimum, not its mean or median, because a spread
//! that grows for as long as an outage lasts drags any average up with it, and early in
//! training every model moves fast, so the spreads fall for a long while before they settle.
//! A ratio rather than a threshold, because distances differ by orders of magnitude between
//! layers, models and learning rates. Zero spreads (nothing trained yet) are not recorded.
//! The window is time, not a count of samples, so the coordinator (a sample per second) and
//! the simulator (one per evaluation) judge alike.
//!
//! The coordinator feeds it from `Stats` messages; the simulator feeds it the same
//! distances at each evaluation, so a scenario shows the warnings a real run would print.

use std::collections::{BTreeMap, VecDeque};

use serde::{Deserialize, Serialize};

/// When the monitor warns.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DivergenceConfig {
    /// Warn when a layer's spread exceeds this many times its lowest spread of the last
    /// `window_ms` (0 turns the warnings off; the spreads are still measured and exported).
    pub warn_ratio: f32,
    /// Never warn below this spread (relative distance; 0.01 = 1 % of the layer's norm).
    pub min_spread: f32,
    /// How far back a layer's baseline looks, milliseconds (it warns once its history spans
    /// half of this).
    pub window_ms: u64,
    /// The spread must stay above the threshold this long before it warns, milliseconds.
    pub sustain_ms: u64,
    /// At most one warning per layer per this many milliseconds.
    pub warn_every_ms: u64,
}

impl Default for DivergenceConfig {
    fn default() -> Self {
        DivergenceConfig {
            warn_ratio: 3.0,
            min_spread: 0.01,
            window_ms: 60_000,
            sustain_ms: 10_000,
            warn_every_ms: 30_000,
        }
    }
}

impl DivergenceConfig {
    /// Checks the values, naming the key that is wrong.
    pub fn validate(&self) -> Result<(), String> {
        if !self.warn_ratio.is_finite() || (self.warn_ratio != 0.0 && self.warn_ratio <= 1.0) {
            return Err(format!(
                "divergence.warn_ratio = {}: must be 0 (off) or greater than 1",
                self.warn_ratio
            ));
        }
        if !self.min_spread.is_finite() || self.min_spread < 0.0 {
            return Err(format!(
                "divergence.min_spread = {}: must be a finite number ≥ 0",
                self.min_spread
            ));
        }
        if self.window_ms < 2_000 {
            return Err(format!(
                "divergence.window_ms = {}: must be at least 2000 (the coordinator samples once a second)",
                self.window_ms
            ));
        }
        Ok(())
    }
}

/// A layer's spread grew past its baseline.
#[derive(Clone, Debug, PartialEq)]
pub struct DivergenceWarning {
    /// The layer.
    pub layer_id: u32,
    /// Its spread now (largest relative distance over the trainers).
    pub spread: f32,
    /// Its lowest spread of the last `window_ms`.
    pub baseline: f32,
    /// The trainer farthest from the global model.
    pub farthest_node: u64,
}

/// The latest spread of one layer.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct LayerSpread {
    /// Largest relative distance over the trainers that reported the layer.
    pub max: f32,
    /// Mean relative distance over them.
    pub mean: f32,
    /// The trainer with the largest distance.
    pub farthest_node: u64,
    /// How many trainers reported it.
    pub nodes: u32,
}

#[derive(Debug, Default)]
struct LayerHistory {
    /// `(ms, spread)`, oldest first, none older than the window.
    spreads: VecDeque<(u64, f32)>,
    last_warned_ms: Option<u64>,
    /// Since when the spread has been above the threshold without a break.
    above_since_ms: Option<u64>,
}

/// Per-layer spreads and their histories. See the module docs.
#[derive(Debug)]
pub struct DivergenceMonitor {
    config: DivergenceConfig,
    latest: BTreeMap<u32, LayerSpread>,
    history: BTreeMap<u32, LayerHistory>,
    warnings: u64,
}

impl DivergenceMonitor {
    /// A monitor with no history.
    pub fn new(config: DivergenceConfig) -> Self {
        DivergenceMonitor {
            config,
            latest: BTreeMap::new(),
            history: BTreeMap::new(),
            warnings: 0,
        }
    }

    /// Records the distances of every reporting trainer at `now_ms`, as
    /// `(node_id, [(layer_id, distance)])`, and returns the layers whose spread grew past
    /// their baseline. Non-finite or negative distances are ignored.
    pub fn observe<'a>(
        &mut self,
        now_ms: u64,
        nodes: impl IntoIterator<Item = (u64, &'a [(u32, f32)])>,
    ) -> Vec<DivergenceWarning> {
        let mut by_layer: BTreeMap<u32, (f32, f64, u64, u32)> = BTreeMap::new();
        for (node_id, distances) in nodes {
            for &(layer_id, d) in distances {
                if !d.is_finite() || d < 0.0 {
                    continue;
                }
                let e = by_layer.entry(layer_id).or_insert((-1.0, 0.0, node_id, 0));
                if d > e.0 {
                    e.0 = d;
                    e.2 = node_id;
                }
                e.1 += f64::from(d);
                e.3 += 1;
            }
        }
        let mut warnings = Vec::new();
        for (layer_id, (max, sum, farthest_node, nodes)) in by_layer {
            let spread = LayerSpread {
                max,
                mean: (sum / f64::from(nodes)) as f32,
                farthest_node,
                nodes,
            };
            self.latest.insert(layer_id, spread);
            if let Some(w) = self.record(now_ms, layer_id, spread) {
                warnings.push(w);
            }
        }
        self.warnings += warnings.len() as u64;
        warnings
    }

    fn record(
        &mut self,
        now_ms: u64,
        layer_id: u32,
        spread: LayerSpread,
    ) -> Option<DivergenceWarning> {
        let c = &self.config;
        let h = self.history.entry(layer_id).or_default();
        let oldest = now_ms.saturating_sub(c.window_ms);
        while h.spreads.front().is_some_and(|&(t, _)| t < oldest) {
            h.spreads.pop_front();
        }
        let spans_half = h
            .spreads
            .front()
            .is_some_and(|&(t, _)| now_ms.saturating_sub(t) >= c.window_ms / 2);
        let baseline = spans_half.then(|| {
            h.spreads
                .iter()
                .map(|&(_, x)| x)
                .fold(f32::INFINITY, f32::min)
        });
        if spread.max > 0.0 {
            h.spreads.push_back((now_ms, spread.max));
        }
        let baseline = baseline?;
        let grew =
            c.warn_ratio > 0.0 && spread.max > c.min_spread && spread.max > c.warn_ratio * baseline;
        if !grew {
            h.above_since_ms = None;
            return None;
        }
        let since = *h.above_since_ms.get_or_insert(now_ms);
        let sustained = now_ms.saturating_sub(since) >= c.sustain_ms;
        let quiet = h
            .last_warned_ms
            .is_some_and(|t| now_ms.saturating_sub(t) < c.warn_every_ms);
        if !sustained || quiet {
            return None;
        }
        h.last_warned_ms = Some(now_ms);
        Some(DivergenceWarning {
            layer_id,
            spread: spread.max,
            baseline,
            farthest_node: spread.farthest_node,
        })
    }

    /// The latest spread of each layer that was reported.
    pub fn spreads(&self) -> &BTreeMap<u32, LayerSpread> {
        &self.latest
    }

    /// Warnings so far.
    pub fn warnings(&self) -> u64 {
        self.warnings
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn feed(m: &mut DivergenceMonitor, t: u64, d: &[(u64, f32)]) -> Vec<DivergenceWarning> {
        let reports: Vec<(u64, Vec<(u32, f32)>)> =
            d.iter().map(|&(n, x)| (n, vec![(0, x)])).collect();
        m.observe(t, reports.iter().map(|(n, v)| (*n, v.as_slice())))
    }

    #[test]
    fn a_growing_spread_warns_once_and_names_the_farthest_node() {
        let mut m = DivergenceMonitor::new(DivergenceConfig::default());
        for t in 0..32 {
            assert!(feed(&mut m, t * 1000, &[(1, 0.04), (2, 0.05)]).is_empty());
        }
        // Above the threshold, but not yet for the sustain (10 s).
        for t in 32..42 {
            assert!(
                feed(&mut m, t * 1000, &[(1, 0.04), (2, 0.4)]).is_empty(),
                "{t}"
            );
        }
        let w = feed(&mut m, 42_000, &[(1, 0.04), (2, 0.4)]);
        assert_eq!(w.len(), 1, "{w:?}");
        assert_eq!((w[0].layer_id, w[0].farthest_node), (0, 2));
        assert!((w[0].baseline - 0.05).abs() < 1e-6 && (w[0].spread - 0.4).abs() < 1e-6);
        // Rate limited: still diverged a second later, no second warning.
        assert!(feed(&mut m, 43_000, &[(1, 0.04), (2, 0.5)]).is_empty());
        assert_eq!(m.warnings(), 1);
        let s = m.spreads()[&0];
        assert_eq!((s.nodes, s.farthest_node), (2, 2));
        assert!((s.mean - 0.27).abs() < 1e-6, "{s:?}");
    }

    #[test]
    fn the_config_decides_whether_it_warns() {
        for (config, warns) in [
            (DivergenceConfig::default(), true),
            (
                DivergenceConfig {
                    warn_ratio: 0.0,
                    ..Default::default()
                },
                false,
            ),
            (
                DivergenceConfig {
                    warn_ratio: 20.0,
                    ..Default::default()
                },
                false,
            ),
            (
                DivergenceConfig {
                    min_spread: 1.0,
                    ..Default::default()
                },
                false,
            ),
        ] {
            let mut m = DivergenceMonitor::new(config.clone());
            for t in 0..8 {
                feed(&mut m, t * 5_000, &[(1, 0.05)]);
            }
            let mut w = feed(&mut m, 40_000, &[(1, 0.5)]);
            w.extend(feed(&mut m, 50_000, &[(1, 0.5)]));
            assert_eq!(!w.is_empty(), warns, "{config:?}");
        }
    }

    /// What an outage looks like: early training's spreads fall for a while, then one node
    /// drifts for longer than the window's half. The lowest spread of the window catches the
    /// growth that a median over the same window (dragged up by the drift itself) would not.
    #[test]
    fn a_slow_drift_after_falling_spreads_warns() {
        let mut m = DivergenceMonitor::new(DivergenceConfig::default());
        let mut warned_at = None;
        for t in 0..120u64 {
            let settled = 0.5 * (-(t as f32) / 10.0).exp() + 0.005;
            let drift = if t >= 60 {
                0.001 * (t - 60) as f32
            } else {
                0.0
            };
            if !feed(&mut m, t * 1000, &[(1, settled), (2, settled + drift)]).is_empty() {
                warned_at.get_or_insert(t);
            }
        }
        let at = warned_at.expect("the drift warns");
        assert!((60..100).contains(&at), "warned at {at} s");
        assert_eq!(m.warnings(), 1 + (119 - at) / 30);
    }

    #[test]
    fn a_blip_shorter_than_the_sustain_does_not_warn() {
        let mut m = DivergenceMonitor::new(DivergenceConfig::default());
        for t in 0..100u64 {
            let d = if (50..55).contains(&t) { 0.5 } else { 0.02 };
            assert!(feed(&mut m, t * 1000, &[(1, d)]).is_empty(), "{t}");
        }
    }

    #[test]
    fn zero_spreads_are_no_baseline() {
        let mut m = DivergenceMonitor::new(DivergenceConfig::default());
        for t in 0..40 {
            assert!(feed(&mut m, t * 1000, &[(1, 0.0)]).is_empty());
        }
        assert!(
            feed(&mut m, 40_000, &[(1, 0.3)]).is_empty(),
            "no history yet"
        );
    }

    #[test]
    fn no_baseline_no_warning_and_bad_values_are_ignored() {
        let mut m = DivergenceMonitor::new(DivergenceConfig::default());
        assert!(feed(&mut m, 0, &[(1, 0.01)]).is_empty());
        assert!(feed(&mut m, 1, &[(1, 5.0), (2, f32::NAN), (3, -1.0)]).is_empty());
        assert_eq!(m.spreads()[&0].nodes, 1);
    }

    #[test]
    fn bad_configs_name_their_key() {
        for (c, key) in [
            (
                DivergenceConfig {
                    warn_ratio: 0.5,
                    ..Default::default()
                },
                "warn_ratio",
            ),
            (
                DivergenceConfig {
                    min_spread: f32::NAN,
                    ..Default::default()
                },
                "min_spread",
            ),
            (
                DivergenceConfig {
                    window_ms: 100,
                    ..Default::default()
                },
                "window_ms",
            ),
        ] {
            assert!(c.validate().unwrap_err().contains(key));
        }
        assert!(DivergenceConfig::default().validate().is_ok());
    }
}
