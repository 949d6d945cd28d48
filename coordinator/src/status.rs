//! The operator's view of the cluster: [`StatusReport`] (served as JSON) built by
//! [`CoordinatorState::status`], and its Prometheus text exposition ([`prometheus_text`]).

use std::fmt::Write as _;

use protocol::{NodeStats, Role};
use serde::Serialize;

use crate::divergence::LayerSpread;
use crate::state::CoordinatorState;

/// Everything an operator sees about the cluster at one instant.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct StatusReport {
    /// Epoch of the layer map.
    pub map_epoch: u64,
    /// Lease length granted to members, milliseconds.
    pub lease_ms: u64,
    /// Live members, by node id.
    pub members: Vec<MemberStatus>,
    /// Manifest layers, by layer id.
    pub layers: Vec<LayerStatus>,
    /// Counters summed over every node that reported stats (including nodes that left).
    pub totals: Totals,
    /// Divergence warnings so far ([`crate::divergence`]).
    pub divergence_warnings: u64,
}

/// One member.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct MemberStatus {
    /// Node id.
    pub node_id: u64,
    /// Certificate name.
    pub name: String,
    /// `worker`, `edge` or `aggregator`.
    pub role: &'static str,
    /// Listen address (empty for nodes that only dial out).
    pub addr: String,
    /// Whether its connection is open.
    pub connected: bool,
    /// Milliseconds until its lease ends (0: ends at the next timeout).
    pub lease_expires_in_ms: u64,
    /// Layers it owns (aggregators).
    pub owned_layers: Vec<u32>,
    /// Its latest stats, if it reported any.
    pub stats: Option<StatsReport>,
}

/// One layer.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct LayerStatus {
    /// Layer id.
    pub layer_id: u32,
    /// Layer name.
    pub name: String,
    /// Tensor shape.
    pub shape: Vec<u32>,
    /// Owning aggregator (`None` while no aggregator is live).
    pub owner: Option<u64>,
    /// Version of the cached global checkpoint (0: none seen).
    pub version: u64,
    /// Encoded bytes of the cached checkpoint (0: none).
    pub checkpoint_bytes: u64,
    /// Which aggregator produced the cached checkpoint.
    pub produced_by: Option<u64>,
    /// While the layer moves away from a live aggregator: that aggregator, whose final
    /// version the hand-over waits for (at most [`crate::state::RELEASE_TIMEOUT_MS`]).
    pub releasing_from: Option<u64>,
    /// The latest spread of the trainers' distances to the global layer (`None` until a
    /// trainer reported one).
    pub divergence: Option<LayerSpread>,
}

/// A node's counters ([`NodeStats`] in serde form).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct StatsReport {
    /// Local training steps.
    pub step: u64,
    /// Payload bytes sent.
    pub bytes_sent: u64,
    /// Payload bytes received.
    pub bytes_received: u64,
    /// Deltas that went to the weak-sync cache.
    pub weak_sync_events: u64,
    /// Weak-synced deltas not yet acknowledged.
    pub cached_pending: u64,
    /// Deltas folded into the global model.
    pub deltas_applied: u64,
    /// Retransmissions rejected as already applied.
    pub duplicates_rejected: u64,
    /// Deltas refused as too stale.
    pub dropped_stale: u64,
    /// `(layer_id, version)` the node holds.
    pub layer_versions: Vec<(u32, u64)>,
    /// Entry `i` counts applied deltas with staleness `i` (last: `≥ len − 1`).
    pub staleness_histogram: Vec<u64>,
    /// Latest evaluation accuracy.
    pub accuracy: Option<f32>,
    /// Resident memory of the node's process, bytes.
    pub rss_bytes: u64,
    /// Peak resident memory of the node's process, bytes.
    pub peak_rss_bytes: u64,
    /// Per layer, the trainer's distance to the newest global version it holds, relative to
    /// that version's norm.
    pub layer_divergence: Vec<(u32, f32)>,
}

impl From<&NodeStats> for StatsReport {
    fn from(s: &NodeStats) -> Self {
        StatsReport {
            step: s.step,
            bytes_sent: s.bytes_sent,
            bytes_received: s.bytes_received,
            weak_sync_events: s.weak_sync_events,
            cached_pending: s.cached_pending,
            deltas_applied: s.deltas_applied,
            duplicates_rejected: s.duplicates_rejected,
            dropped_stale: s.dropped_stale,
            layer_versions: s.layer_versions.clone(),
            staleness_histogram: s.staleness_histogram.clone(),
            accuracy: s.accuracy,
            rss_bytes: s.rss_bytes,
            peak_rss_bytes: s.peak_rss_bytes,
            layer_divergence: s.layer_divergence.clone(),
        }
    }
}

/// Cluster-wide sums of the latest stats of every node that reported.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Totals {
    /// Nodes whose stats are summed.
    pub reporting_nodes: u64,
    /// Payload bytes sent.
    pub bytes_sent: u64,
    /// Payload bytes received.
    pub bytes_received: u64,
    /// Weak-sync events.
    pub weak_sync_events: u64,
    /// Deltas folded into the global model.
    pub deltas_applied: u64,
    /// Retransmissions rejected as already applied.
    pub duplicates_rejected: u64,
    /// Deltas refused as too stale.
    pub dropped_stale: u64,
    /// Element-wise sum of the staleness histograms (last entry: `≥ len − 1`; histograms
    /// of different lengths are aligned at 0 and a shorter one's last bucket is added to
    /// the same index).
    pub staleness_histogram: Vec<u64>,
}

/// `worker`, `edge` or `aggregator`.
pub fn role_name(role: Role) -> &'static str {
    match role {
        Role::Worker => "worker",
        Role::Edge => "edge",
        Role::Aggregator => "aggregator",
    }
}

impl CoordinatorState {
    /// The operator's view at `now_ms`.
    pub fn status(&self, now_ms: u64) -> StatusReport {
        let members = self
            .members
            .values()
            .map(|m| MemberStatus {
                node_id: m.node_id,
                name: m.name.clone(),
                role: role_name(m.role),
                addr: m.addr.clone(),
                connected: m.conn.is_some(),
                lease_expires_in_ms: m.lease_expires_at_ms.saturating_sub(now_ms),
                owned_layers: self
                    .owners
                    .iter()
                    .filter(|(_, &owner)| owner == m.node_id)
                    .map(|(&layer, _)| layer)
                    .collect(),
                stats: self.stats.get(&m.node_id).map(StatsReport::from),
            })
            .collect();
        let layers = self
            .layers
            .values()
            .map(|l| {
                let cached = self.checkpoint.get(&l.layer_id);
                LayerStatus {
                    layer_id: l.layer_id,
                    name: l.name.clone(),
                    shape: l.shape.clone(),
                    owner: self.owners.get(&l.layer_id).copied(),
                    version: cached.map_or(0, |v| v.version),
                    checkpoint_bytes: cached.map_or(0, |v| v.payload.len() as u64),
                    produced_by: cached.map(|v| v.aggregator_id),
                    releasing_from: self.pending_release.get(&l.layer_id).map(|&(from, _)| from),
                    divergence: self.divergence.spreads().get(&l.layer_id).copied(),
                }
            })
            .collect();
        let mut totals = Totals::default();
        for s in self.stats.values() {
            totals.reporting_nodes += 1;
            totals.bytes_sent = totals.bytes_sent.saturating_add(s.bytes_sent);
            totals.bytes_received = totals.bytes_received.saturating_add(s.bytes_received);
            totals.weak_sync_events = totals.weak_sync_events.saturating_add(s.weak_sync_events);
            totals.deltas_applied = totals.deltas_applied.saturating_add(s.deltas_applied);
            totals.duplicates_rejected = totals
                .duplicates_rejected
                .saturating_add(s.duplicates_rejected);
            totals.dropped_stale = totals.dropped_stale.saturating_add(s.dropped_stale);
            add_histogram(&mut totals.staleness_histogram, &s.staleness_histogram);
        }
        StatusReport {
            map_epoch: self.epoch,
            lease_ms: self.config.lease_ms,
            members,
            layers,
            totals,
            divergence_warnings: self.divergence.warnings(),
        }
    }
}

/// Adds `h` into `sum` element-wise. The last entry of each histogram counts "≥ that
/// index", so when lengths differ the longer one decides the buckets: a shorter
/// histogram's tail count lands on its own last index (a lower bound of its staleness).
fn add_histogram(sum: &mut Vec<u64>, h: &[u64]) {
    if sum.len() < h.len() {
        sum.resize(h.len(), 0);
    }
    for (total, &count) in sum.iter_mut().zip(h) {
        *total = total.saturating_add(count);
    }
}

/// Escapes a Prometheus label value (backslash, double quote, newline).
fn label(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    for c in value.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    out
}

fn family(out: &mut String, name: &str, kind: &str, help: &str) {
    // Writing to a String cannot fail.
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {kind}");
}

/// The report in the Prometheus text exposition format (version 0.0.4).
///
/// Families: `dreamddp_map_epoch`, `dreamddp_members{role}`,
/// `dreamddp_layer_version{layer,layer_id}`, `dreamddp_layer_checkpoint_bytes{layer,layer_id}`,
/// `dreamddp_node_bytes_sent_total{node,node_id,role}`,
/// `dreamddp_weak_sync_events_total{node,node_id}`, `dreamddp_node_accuracy{node,node_id}`,
/// `dreamddp_node_resident_bytes{node,node_id,role}`, `dreamddp_node_peak_resident_bytes{…}`,
/// `dreamddp_deltas_applied_total`, `dreamddp_duplicates_rejected_total`,
/// `dreamddp_bytes_sent_total`, `dreamddp_layer_divergence{node,node_id,layer,layer_id}`,
/// `dreamddp_layer_divergence_spread{layer,layer_id}`, `dreamddp_layer_divergence_mean{…}`,
/// `dreamddp_divergence_warnings_total`, and the histogram `dreamddp_staleness` (buckets
/// `le="0"`… cumulative, the histogram's open last entry only in `le="+Inf"`; no `_sum`,
/// since the open bucket's staleness is unknown).
pub fn prometheus_text(report: &StatusReport) -> String {
    let mut out = String::new();
    family(
        &mut out,
        "dreamddp_map_epoch",
        "gauge",
        "Epoch of the layer to aggregator map.",
    );
    let _ = writeln!(out, "dreamddp_map_epoch {}", report.map_epoch);

    family(
        &mut out,
        "dreamddp_members",
        "gauge",
        "Live members by role.",
    );
    for role in [Role::Worker, Role::Edge, Role::Aggregator] {
        let name = role_name(role);
        let n = report.members.iter().filter(|m| m.role == name).count();
        let _ = writeln!(out, "dreamddp_members{{role=\"{name}\"}} {n}");
    }

    family(
        &mut out,
        "dreamddp_layer_version",
        "gauge",
        "Global version of each layer in the coordinator's checkpoint.",
    );
    for l in &report.layers {
        let _ = writeln!(
            out,
            "dreamddp_layer_version{{layer=\"{}\",layer_id=\"{}\"}} {}",
            label(&l.name),
            l.layer_id,
            l.version
        );
    }
    family(
        &mut out,
        "dreamddp_layer_checkpoint_bytes",
        "gauge",
        "Encoded bytes of each layer's cached checkpoint.",
    );
    for l in &report.layers {
        let _ = writeln!(
            out,
            "dreamddp_layer_checkpoint_bytes{{layer=\"{}\",layer_id=\"{}\"}} {}",
            label(&l.name),
            l.layer_id,
            l.checkpoint_bytes
        );
    }

    let reporting: Vec<(&MemberStatus, &StatsReport)> = report
        .members
        .iter()
        .filter_map(|m| m.stats.as_ref().map(|s| (m, s)))
        .collect();
    family(
        &mut out,
        "dreamddp_node_bytes_sent_total",
        "counter",
        "Payload bytes a live member sent.",
    );
    for (m, s) in &reporting {
        let _ = writeln!(
            out,
            "dreamddp_node_bytes_sent_total{{node=\"{}\",node_id=\"{}\",role=\"{}\"}} {}",
            label(&m.name),
            m.node_id,
            m.role,
            s.bytes_sent
        );
    }
    family(
        &mut out,
        "dreamddp_weak_sync_events_total",
        "counter",
        "Layer deltas of a live member that missed their deadline and went to the weak-sync cache.",
    );
    for (m, s) in &reporting {
        let _ = writeln!(
            out,
            "dreamddp_weak_sync_events_total{{node=\"{}\",node_id=\"{}\"}} {}",
            label(&m.name),
            m.node_id,
            s.weak_sync_events
        );
    }
    family(
        &mut out,
        "dreamddp_node_accuracy",
        "gauge",
        "Latest local evaluation accuracy of a live member, in [0, 1].",
    );
    for (m, s) in &reporting {
        if let Some(accuracy) = s.accuracy.filter(|a| a.is_finite()) {
            let _ = writeln!(
                out,
                "dreamddp_node_accuracy{{node=\"{}\",node_id=\"{}\"}} {accuracy}",
                label(&m.name),
                m.node_id
            );
        }
    }

    for (metric, help, value) in [
        (
            "dreamddp_node_resident_bytes",
            "Resident memory of a live member's process (VmRSS).",
            (|s: &StatsReport| s.rss_bytes) as fn(&StatsReport) -> u64,
        ),
        (
            "dreamddp_node_peak_resident_bytes",
            "Peak resident memory of a live member's process since it started (VmHWM).",
            |s: &StatsReport| s.peak_rss_bytes,
        ),
    ] {
        family(&mut out, metric, "gauge", help);
        for (m, s) in &reporting {
            let _ = writeln!(
                out,
                "{metric}{{node=\"{}\",node_id=\"{}\",role=\"{}\"}} {}",
                label(&m.name),
                m.node_id,
                m.role,
                value(s)
            );
        }
    }

    let layer_names: std::collections::BTreeMap<u32, &str> = report
        .layers
        .iter()
        .map(|l| (l.layer_id, l.name.as_str()))
        .collect();
    family(
        &mut out,
        "dreamddp_layer_divergence",
        "gauge",
        "A live trainer's distance to the newest global version of a layer it holds, relative to that version's norm.",
    );
    for (m, s) in &reporting {
        for &(layer_id, d) in &s.layer_divergence {
            if !d.is_finite() {
                continue;
            }
            let _ = writeln!(
                out,
                "dreamddp_layer_divergence{{node=\"{}\",node_id=\"{}\",layer=\"{}\",layer_id=\"{layer_id}\"}} {d}",
                label(&m.name),
                m.node_id,
                label(layer_names.get(&layer_id).copied().unwrap_or("?")),
            );
        }
    }
    for (metric, help, value) in [
        (
            "dreamddp_layer_divergence_spread",
            "Largest relative distance to the global layer over the live trainers (the divergence monitor's spread).",
            (|s: &LayerSpread| s.max) as fn(&LayerSpread) -> f32,
        ),
        (
            "dreamddp_layer_divergence_mean",
            "Mean relative distance to the global layer over the live trainers.",
            |s: &LayerSpread| s.mean,
        ),
    ] {
        family(&mut out, metric, "gauge", help);
        for l in &report.layers {
            if let Some(spread) = &l.divergence {
                let _ = writeln!(
                    out,
                    "{metric}{{layer=\"{}\",layer_id=\"{}\"}} {}",
                    label(&l.name),
                    l.layer_id,
                    value(spread)
                );
            }
        }
    }

    let t = &report.totals;
    for (name, help, value) in [
        (
            "dreamddp_bytes_sent_total",
            "Payload bytes sent by every node that reported.",
            t.bytes_sent,
        ),
        (
            "dreamddp_deltas_applied_total",
            "Deltas folded into the global model.",
            t.deltas_applied,
        ),
        (
            "dreamddp_duplicates_rejected_total",
            "Retransmitted deltas rejected as already applied.",
            t.duplicates_rejected,
        ),
        (
            "dreamddp_divergence_warnings_total",
            "Times a layer's divergence spread grew warn_ratio-fold over its recent low.",
            report.divergence_warnings,
        ),
    ] {
        family(&mut out, name, "counter", help);
        let _ = writeln!(out, "{name} {value}");
    }

    family(
        &mut out,
        "dreamddp_staleness",
        "histogram",
        "Staleness (versions behind) of applied deltas.",
    );
    let h = &t.staleness_histogram;
    let mut cumulative = 0u64;
    for (tau, &count) in h.iter().enumerate().take(h.len().saturating_sub(1)) {
        cumulative = cumulative.saturating_add(count);
        let _ = writeln!(
            out,
            "dreamddp_staleness_bucket{{le=\"{tau}\"}} {cumulative}"
        );
    }
    let total: u64 = h.iter().fold(0u64, |a, &c| a.saturating_add(c));
    let _ = writeln!(out, "dreamddp_staleness_bucket{{le=\"+Inf\"}} {total}");
    let _ = writeln!(out, "dreamddp_staleness_count {total}");
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{CoordinatorConfig, LayerInfo};
    use protocol::{codec, Capabilities, Codec, Join, LayerVersion, Message};

    fn state_with_traffic() -> CoordinatorState {
        let layers = ["fc1", "fc\"2"]
            .iter()
            .enumerate()
            .map(|(i, name)| LayerInfo {
                layer_id: i as u32,
                name: (*name).into(),
                shape: vec![3],
            })
            .collect();
        let mut s = CoordinatorState::new(CoordinatorConfig {
            credentials: "k".into(),
            lease_ms: 1000,
            layers,
            divergence: Default::default(),
        });
        let join = |node_id, role, addr: &str| {
            Message::Join(Join {
                node_id,
                role,
                credentials: "k".into(),
                capabilities: Capabilities::default(),
                listen_addr: addr.into(),
            })
        };
        s.handle_message(0, 1, "edge-1", join(1, Role::Edge, ""));
        s.handle_message(0, 2, "agg-2", join(2, Role::Aggregator, "127.0.0.1:7000"));
        let encoded = codec::encode(&[1.0, 2.0, 3.0], Codec::RawF32).unwrap();
        s.handle_message(
            0,
            2,
            "agg-2",
            Message::LayerVersion(LayerVersion {
                aggregator_id: 2,
                layer_id: 0,
                layer_name: "fc1".into(),
                version: 7,
                shape: vec![3],
                codec: encoded.codec,
                payload: encoded.bytes,
                applied_seqs: Vec::new(),
            }),
        );
        s.handle_message(
            0,
            1,
            "edge-1",
            Message::Stats(NodeStats {
                node_id: 1,
                role: Role::Edge,
                bytes_sent: 1234,
                weak_sync_events: 3,
                accuracy: Some(0.5),
                rss_bytes: 50 << 20,
                peak_rss_bytes: 60 << 20,
                ..Default::default()
            }),
        );
        s.handle_message(
            0,
            2,
            "agg-2",
            Message::Stats(NodeStats {
                node_id: 2,
                role: Role::Aggregator,
                bytes_sent: 66,
                deltas_applied: 10,
                duplicates_rejected: 2,
                staleness_histogram: vec![5, 3, 0, 2],
                ..Default::default()
            }),
        );
        while s.poll_output().is_some() {}
        s
    }

    #[test]
    fn status_reports_members_layers_and_totals() {
        let s = state_with_traffic();
        let report = s.status(250);
        assert_eq!(report.map_epoch, 1);
        assert_eq!(report.members.len(), 2);
        let agg = &report.members[1];
        assert_eq!(
            (agg.role, agg.addr.as_str()),
            ("aggregator", "127.0.0.1:7000")
        );
        assert_eq!(agg.owned_layers, vec![0, 1]);
        assert_eq!(agg.lease_expires_in_ms, 750);
        assert_eq!(report.layers[0].version, 7);
        assert_eq!(report.layers[0].checkpoint_bytes, 12);
        assert_eq!(report.layers[0].owner, Some(2));
        assert_eq!(report.layers[1].version, 0);
        assert_eq!(report.totals.bytes_sent, 1300);
        assert_eq!(report.totals.staleness_histogram, vec![5, 3, 0, 2]);
        let json = serde_json::to_value(&report).unwrap();
        assert_eq!(json["members"][0]["name"], "edge-1");
        assert_eq!(json["members"][0]["stats"]["weak_sync_events"], 3);
        assert_eq!(json["layers"][0]["name"], "fc1");
        assert_eq!(json["totals"]["deltas_applied"], 10);
    }

    /// Checks one exposition line: a `# HELP`/`# TYPE` comment or `name{labels} value`.
    /// Returns the metric name of a sample line.
    fn check_line(line: &str) -> Option<String> {
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let (name, help) = rest.split_once(' ').expect("HELP needs a name and a text");
            assert!(!help.is_empty() && name.starts_with("dreamddp_"), "{line}");
            return None;
        }
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').expect("TYPE needs a name and a kind");
            assert!(name.starts_with("dreamddp_"), "{line}");
            assert!(["counter", "gauge", "histogram"].contains(&kind), "{line}");
            return None;
        }
        let (series, value) = line.rsplit_once(' ').expect("sample needs a value");
        assert!(value == "+Inf" || value.parse::<f64>().is_ok(), "{line}");
        let name = match series.split_once('{') {
            Some((name, labels)) => {
                let labels = labels.strip_suffix('}').expect("labels end with }");
                // label="value" pairs separated by commas; values may hold escaped quotes.
                let mut rest = labels;
                while !rest.is_empty() {
                    let (key, after) = rest.split_once("=\"").expect("label=\"value\"");
                    assert!(
                        key.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'),
                        "{line}"
                    );
                    let mut end = None;
                    let mut escaped = false;
                    for (i, c) in after.char_indices() {
                        match (escaped, c) {
                            (true, _) => escaped = false,
                            (false, '\\') => escaped = true,
                            (false, '"') => {
                                end = Some(i);
                                break;
                            }
                            _ => {}
                        }
                    }
                    let end = end.expect("closing quote");
                    rest = after[end + 1..]
                        .strip_prefix(',')
                        .unwrap_or(&after[end + 1..]);
                }
                name
            }
            None => series,
        };
        assert!(
            name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'),
            "{line}"
        );
        Some(name.to_owned())
    }

    #[test]
    fn prometheus_text_is_well_formed_line_by_line() {
        let text = prometheus_text(&state_with_traffic().status(0));
        assert!(text.ends_with('\n'));
        let mut typed: Vec<(String, String)> = Vec::new();
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                let (name, kind) = rest.split_once(' ').unwrap();
                typed.push((name.to_owned(), kind.to_owned()));
            }
            if let Some(name) = check_line(line) {
                // Every sample belongs to the family declared last (histograms by suffix).
                let (family, kind) = typed.last().expect("sample before any TYPE");
                let ok = &name == family
                    || (kind == "histogram"
                        && [format!("{family}_bucket"), format!("{family}_count")].contains(&name));
                assert!(ok, "sample {name} under family {family}");
            }
        }
        for expected in [
            "dreamddp_map_epoch 1",
            "dreamddp_members{role=\"edge\"} 1",
            "dreamddp_members{role=\"aggregator\"} 1",
            "dreamddp_members{role=\"worker\"} 0",
            "dreamddp_layer_version{layer=\"fc1\",layer_id=\"0\"} 7",
            "dreamddp_layer_version{layer=\"fc\\\"2\",layer_id=\"1\"} 0",
            "dreamddp_node_bytes_sent_total{node=\"edge-1\",node_id=\"1\",role=\"edge\"} 1234",
            "dreamddp_weak_sync_events_total{node=\"edge-1\",node_id=\"1\"} 3",
            "dreamddp_node_accuracy{node=\"edge-1\",node_id=\"1\"} 0.5",
            "dreamddp_node_resident_bytes{node=\"edge-1\",node_id=\"1\",role=\"edge\"} 52428800",
            "dreamddp_node_peak_resident_bytes{node=\"edge-1\",node_id=\"1\",role=\"edge\"} 62914560",
            "dreamddp_deltas_applied_total 10",
            "dreamddp_duplicates_rejected_total 2",
            "dreamddp_staleness_bucket{le=\"0\"} 5",
            "dreamddp_staleness_bucket{le=\"1\"} 8",
            "dreamddp_staleness_bucket{le=\"2\"} 8",
            "dreamddp_staleness_bucket{le=\"+Inf\"} 10",
            "dreamddp_staleness_count 10",
        ] {
            assert!(
                text.lines().any(|l| l == expected),
                "missing {expected:?} in\n{text}"
            );
        }
        // The open last entry (τ ≥ 3) has no finite bucket of its own.
        assert!(!text.contains("le=\"3\""));
        // Each family is declared once.
        let mut names: Vec<&String> = typed.iter().map(|(n, _)| n).collect();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), typed.len());
    }

    #[test]
    fn histograms_of_different_lengths_add_up() {
        let mut sum = vec![1, 1];
        add_histogram(&mut sum, &[1, 2, 3]);
        add_histogram(&mut sum, &[]);
        assert_eq!(sum, vec![2, 3, 3]);
        assert_eq!(label("a\\b\"c\nd"), "a\\\\b\\\"c\\nd");
    }
}
