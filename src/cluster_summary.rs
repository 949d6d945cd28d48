//! What a finished `cluster` run reports: [`ClusterSummary`] (written as `summary.json`), one
//! [`NodeSummary`] per process, the global model's [`GlobalPoint`] series, and the table and
//! clean / not-clean verdict [`print_table`] prints.

use std::collections::BTreeMap;

use node::latency::LatencyHistogram;
use serde::Serialize;

/// One node in `summary.json`.
#[derive(Clone, Debug, Serialize)]
pub struct NodeSummary {
    /// Name.
    pub name: String,
    /// `coordinator`, `aggregator`, `worker`, `edge`.
    pub role: String,
    /// Behind a lossy relay.
    pub relayed: bool,
    /// Payload bytes sent (deltas for trainers, versions for aggregators).
    pub bytes_sent: u64,
    /// Deltas weak-synced (trainers).
    pub weak_sync_events: u64,
    /// Deltas applied (aggregators).
    pub deltas_applied: u64,
    /// Duplicates rejected (aggregators).
    pub duplicates_rejected: u64,
    /// Deltas whose acknowledgement it received (trainers; its last run).
    pub deltas_acked: u64,
    /// Local accuracy at the end (trainers).
    pub local_accuracy: Option<f64>,
    /// Deltas still undelivered at exit (trainers): from its `stats.json`, or, for a
    /// trainer that never exited cleanly, counted in its durable cache on disk afterwards.
    pub undelivered: Option<u64>,
    /// Whether `undelivered` was read from the durable cache after the process died.
    pub undelivered_from_disk: bool,
    /// Why the node counts as lost (it died or failed outside the chaos plan), if it does.
    pub lost: Option<String>,
    /// When its certificate was revoked by `[[revoke]]` (seconds after the trainers
    /// started): it is then expected to end cut off, with its deltas still cached.
    #[serde(default)]
    pub revoked_at_s: Option<f64>,
    /// Times it was killed with SIGKILL and restarted.
    pub kills: u32,
    /// Exit status of its last run.
    pub exit: String,
    /// Stopped on purpose at `[cluster] stop_after_s` while still training or draining.
    pub stopped_at_end: bool,
    /// Deltas its cache still held when it was stopped at the end (not a problem: a longer
    /// run would deliver them).
    pub cached_at_end: Option<u64>,
    /// Paced steps whose real compute took longer than their paced time (`[edges.pace]`).
    pub pace_overruns: Option<u64>,
    /// Steps it trained (its last run).
    pub steps: Option<u64>,
    /// Trainers: delta→ack latency of the deltas they had acknowledged.
    pub ack_latency: Option<LatencyReport>,
    /// The histogram behind `ack_latency` (merged into the run's).
    #[serde(skip)]
    pub ack_histogram: Option<LatencyHistogram>,
    /// Peak resident memory of its last run (from its `stats.json`).
    pub peak_rss_bytes: Option<u64>,
    /// CPU seconds of its last run (aggregators and swarm processes).
    pub cpu_seconds: Option<f64>,
    /// Aggregators: layer-version sends to subscribers (one per subscriber and version).
    pub fanout_sends: Option<u64>,
    /// Aggregators: layer-version frame bytes sent to subscribers, each subscriber's copy
    /// counted (`bytes_sent` counts a broadcast once).
    pub fanout_bytes: Option<u64>,
    /// Aggregators: versions a busy subscriber never got because a newer one replaced them.
    pub fanout_superseded: Option<u64>,
    /// Aggregators: version sends that failed (the subscriber's connection closed, or it
    /// stopped reading for `cpu_aggregator::server::VERSION_STALL_TIMEOUT`).
    pub fanout_failed: Option<u64>,
    /// Aggregators: staleness τ of the deltas applied (`τ = 0 .. 15`, then `τ ≥ 16`).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub staleness_histogram: Vec<u64>,
}

/// Quantiles of a latency histogram, milliseconds (each within 5 % above the exact value).
#[derive(Clone, Debug, Serialize)]
pub struct LatencyReport {
    /// Latencies recorded.
    pub count: u64,
    /// Median.
    pub p50_ms: f64,
    /// 99th percentile.
    pub p99_ms: f64,
    /// Largest.
    pub max_ms: f64,
}

impl LatencyReport {
    /// The report of `h` (`None` when it is empty).
    pub fn of(h: &LatencyHistogram) -> Option<Self> {
        Some(LatencyReport {
            count: h.count(),
            p50_ms: h.quantile_ms(0.5)?,
            p99_ms: h.quantile_ms(0.99)?,
            max_ms: h.quantile_ms(1.0)?,
        })
    }
}

/// How the coordinator's `/status` answered the launcher's probe (one GET a second for the
/// whole run).
#[derive(Clone, Debug, Serialize)]
pub struct StatusLatencyReport {
    /// Answer times.
    pub answered: Option<LatencyReport>,
    /// Probes that failed or took over 2 s.
    pub failures: u64,
    /// Probes answered in more than 100 ms.
    pub over_100ms: u64,
}

/// What a `[swarm]` run adds to the summary.
#[derive(Clone, Debug, Serialize)]
pub struct SwarmReport {
    /// Clients in all.
    pub clients: usize,
    /// Swarm processes.
    pub processes: usize,
    /// Step time of each client, ms.
    pub step_ms: u64,
    /// Clients that failed (could not join, a cache write failed, ...).
    pub clients_failed: usize,
    /// Layer-version bytes the aggregators sent to subscribers (every copy) per delta they
    /// applied.
    pub aggregator_bytes_per_applied_delta: Option<f64>,
    /// The same per applied delta and subscriber: what one client received per delta the
    /// fleet sent (1 × the mean layer size would be every version to every client).
    pub aggregator_bytes_per_applied_delta_per_client: Option<f64>,
}

/// One evaluation of the global model during a run (`[cluster] eval_every_s`).
#[derive(Clone, Debug, Serialize)]
pub struct GlobalPoint {
    /// Seconds since the trainers started.
    pub time_s: f64,
    /// Test accuracy (classification).
    pub accuracy: Option<f64>,
    /// Test loss.
    pub loss: f64,
    /// Bytes the nodes' senders put on the relayed links so far (the relays' `bytes_in`), both
    /// directions, all nodes.
    pub relay_bytes: u64,
}

/// `summary.json`.
#[derive(Clone, Debug, Serialize)]
pub struct ClusterSummary {
    /// Cluster name.
    pub cluster: String,
    /// Whether relays were removed.
    pub clean_links: bool,
    /// Data set used.
    pub dataset: String,
    /// Accuracy of the global model (the aggregators' layers) on the full test set.
    pub final_accuracy: Option<f64>,
    /// Its loss.
    pub final_loss: f64,
    /// Per node.
    pub nodes: Vec<NodeSummary>,
    /// Deltas applied, all aggregators.
    pub deltas_applied: u64,
    /// Duplicates rejected, all aggregators.
    pub duplicates_rejected: u64,
    /// Weak-sync events, all trainers.
    pub weak_sync_events: u64,
    /// `(node, layer, seq)` applied more than once according to the ledgers of the
    /// aggregators that are part of the final system (must be 0).
    pub ledger_duplicates: u64,
    /// Deltas that an aggregator lost for good (`[[chaos]] restart = false`) had applied in
    /// versions the coordinator never received, and that their senders (never acknowledged)
    /// retransmitted to the layer's new owner, which applied them: applied once in the
    /// surviving history, so not duplicates.
    pub reapplied_after_loss: u64,
    /// Distinct `(node, layer, seq)` in the ledgers of the final system's aggregators: every
    /// acknowledged delta must be among them.
    pub ledger_entries: u64,
    /// Acknowledgements the trainers received (their last runs).
    pub deltas_acked: u64,
    /// Datagrams the relays dropped.
    pub relay_dropped_datagrams: u64,
    /// The drops by cause (`random_loss`, `burst_loss`, `outage`, `queue_full`,
    /// `trace_ended`) and the datagrams the relays received (`datagrams_in`).
    pub relay_datagrams: BTreeMap<String, u64>,
    /// Wall seconds.
    pub wall_seconds: f64,
    /// Everything that makes this run not clean (lost nodes, undelivered deltas, deltas
    /// applied twice), one sentence each; `cluster` exits non-zero when there is any.
    pub problems: Vec<String>,
    /// What may be wrong but cannot be told from the ledgers (printed as `[WARN]`).
    pub warnings: Vec<String>,
    /// Evaluations of the global model during the run (`[cluster] eval_every_s`).
    pub series: Vec<GlobalPoint>,
    /// Bytes the senders put on the relayed links (the datagram payloads each relay received,
    /// both directions, QUIC headers and acknowledgements included; datagrams the link model then
    /// lost included, as a simulated link counts every packet its sender serialized) by the
    /// relayed node's link class.
    pub relay_bytes_by_link_class: BTreeMap<String, u64>,
    /// The same by relayed link: `NODE.up` (node to aggregators) and `NODE.down`, summed over
    /// the node's relays (one per aggregator).
    pub relay_bytes_by_link: BTreeMap<String, u64>,
    /// Seconds from the trainers' start to the end of the run (their last exit, or the stop).
    pub trainers_seconds: f64,
    /// When the trainers were started, seconds since the Unix epoch (the origin of `series`).
    pub trainers_started_unix_s: f64,
    /// The coordinator's divergence warnings (its `/status` at the end; `None`: not read).
    pub divergence_warnings: Option<u64>,
    /// Delta→ack latency over every trainer's acknowledged deltas.
    pub ack_latency_ms: Option<LatencyReport>,
    /// How fast the coordinator's `/status` answered during the run.
    pub status_latency_ms: StatusLatencyReport,
    /// The `[swarm]` load test, when there was one.
    pub swarm: Option<SwarmReport>,
}

/// Prints the per-node table and the clean / not-clean verdict.
pub fn print_table(s: &ClusterSummary) {
    println!(
        "cluster {} ({}, {}): global model accuracy {} (loss {:.4}), {:.0} s wall",
        s.cluster,
        s.dataset,
        if s.clean_links {
            "clean links"
        } else {
            "as configured"
        },
        s.final_accuracy
            .map_or("-".into(), |a| format!("{:.2}%", a * 100.0)),
        s.final_loss,
        s.wall_seconds
    );
    println!(
        "{:<14} {:<10} {:>7} {:>12} {:>9} {:>8} {:>6} {:>9} {:>6}  exit",
        "node",
        "role",
        "relayed",
        "bytes_sent",
        "weak_sync",
        "applied",
        "dups",
        "local_acc",
        "kills"
    );
    for n in &s.nodes {
        println!(
            "{:<14} {:<10} {:>7} {:>12} {:>9} {:>8} {:>6} {:>9} {:>6}  {}",
            n.name,
            n.role,
            if n.relayed { "yes" } else { "" },
            n.bytes_sent,
            n.weak_sync_events,
            n.deltas_applied,
            n.duplicates_rejected,
            n.local_accuracy
                .map_or("-".into(), |a| format!("{:.2}%", a * 100.0)),
            n.kills,
            n.exit
        );
    }
    println!(
        "deltas applied {} · acknowledged {} · in the ledgers {} · duplicates rejected {} · weak-sync events {} · ledger duplicates {} · relay drops {}",
        s.deltas_applied, s.deltas_acked, s.ledger_entries, s.duplicates_rejected, s.weak_sync_events, s.ledger_duplicates, s.relay_dropped_datagrams
    );
    if let Some(a) = &s.ack_latency_ms {
        println!(
            "delta→ack latency: p50 {:.1} ms · p99 {:.1} ms · max {:.1} ms over {} deltas",
            a.p50_ms, a.p99_ms, a.max_ms, a.count
        );
    }
    let st = &s.status_latency_ms;
    if let Some(a) = &st.answered {
        println!(
            "coordinator /status: p50 {:.1} ms · p99 {:.1} ms · max {:.1} ms over {} probes · {} over 100 ms · {} failed",
            a.p50_ms, a.p99_ms, a.max_ms, a.count, st.over_100ms, st.failures
        );
    }
    if let Some(sw) = &s.swarm {
        let aggs: Vec<&NodeSummary> = s.nodes.iter().filter(|n| n.role == "aggregator").collect();
        println!(
            "swarm: {} clients in {} processes, a step every {} ms · {} failed · aggregators sent {} per applied delta · aggregator peak RSS {} · CPU {}",
            sw.clients,
            sw.processes,
            sw.step_ms,
            sw.clients_failed,
            sw.aggregator_bytes_per_applied_delta
                .map_or("-".into(), |b| format!("{:.2} MB", b / 1e6)),
            aggs.iter()
                .map(|n| n.peak_rss_bytes.map_or("-".into(), |b| format!("{:.0} MB", b as f64 / 1e6)))
                .collect::<Vec<_>>()
                .join("/"),
            aggs.iter()
                .map(|n| n.cpu_seconds.map_or("-".into(), |c| format!("{c:.0} s")))
                .collect::<Vec<_>>()
                .join("/"),
        );
    }
    let undelivered: u64 = s.nodes.iter().filter_map(|n| n.undelivered).sum();
    let lost = s.nodes.iter().filter(|n| n.lost.is_some()).count();
    for w in &s.warnings {
        println!("[WARN] {w}");
    }
    if s.problems.is_empty() {
        println!("clean: no node lost, nothing left undelivered");
    } else {
        println!("NOT CLEAN: {lost} node(s) lost · {undelivered} deltas left undelivered");
        for p in &s.problems {
            println!("[WARN] {p}");
        }
    }
    if s.reapplied_after_loss > 0 {
        println!(
            "{} deltas applied by an aggregator lost for good, in versions the coordinator never got, were retransmitted and applied by the new owner",
            s.reapplied_after_loss
        );
    }
}
