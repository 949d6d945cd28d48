//! What a finished `cluster` run owes its user beyond the numbers: which processes died
//! outside the `[[chaos]]` plan (the OOM killer, a signal, a crash, a timeout), how many
//! deltas a trainer that never exited cleanly still held in its durable cache (read from disk
//! after the fact), and the list of problems the headline prints and the exit status reflects.
//! A run that lost a node or left anything undelivered never looks clean.

use std::path::Path;

use edge_agent::durable_cache::DurableCache;

/// The exit the launcher records for a process `[[chaos]] restart = false` killed on purpose.
pub const PLANNED_KILL: &str = "killed (signal 9), not restarted";

/// The exit the launcher records for a late joiner the run ended before it was due to start.
pub const NEVER_STARTED: &str = "never started (the run ended before its start_at_s)";

/// How a process's last run ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Fate {
    /// It exited with status 0.
    Clean,
    /// The chaos plan killed it for good.
    PlannedKill,
    /// It died or failed outside the plan; why, in operators' words.
    Lost(String),
}

/// Classifies a recorded exit (`ExitStatus`'s `Display`, or one of the launcher's own words).
pub fn fate(exit: &str) -> Fate {
    if exit == "exit status: 0" {
        return Fate::Clean;
    }
    if exit == PLANNED_KILL || exit == NEVER_STARTED {
        return Fate::PlannedKill;
    }
    let why = if exit.contains("SIGKILL") || exit.contains("signal: 9") {
        format!("killed by SIGKILL outside the chaos plan ({exit}); the kernel's OOM killer sends SIGKILL: check `dmesg` and the node's peak_rss_bytes")
    } else if exit.contains("signal") {
        format!("killed by a signal outside the chaos plan ({exit})")
    } else if exit == "killed after timeout" {
        "still running at the cluster timeout, killed ([cluster] timeout_s)".to_string()
    } else if exit.is_empty() || exit == "not running" {
        "never ran to an exit the launcher saw".to_string()
    } else {
        format!("failed ({exit}); its log.txt says why")
    };
    Fate::Lost(why)
}

/// Why a process with this recorded exit counts as lost, if it does.
pub fn lost_reason(exit: &str) -> Option<String> {
    match fate(exit) {
        Fate::Lost(why) => Some(why),
        Fate::Clean | Fate::PlannedKill => None,
    }
}

/// Deltas still held in the durable weak-sync cache under `data_dir/cache` of a trainer that
/// is no longer running, plus those of a swarm process's clients (`data_dir/clients/*/cache`).
/// Each cache is opened, validated, and counted; a damaged one is repaired the way a
/// restarted node would. `Ok(0)` when the node never created one.
pub fn undelivered_on_disk(data_dir: &Path) -> Result<u64, String> {
    let mut dirs = vec![data_dir.join("cache")];
    if let Ok(clients) = std::fs::read_dir(data_dir.join("clients")) {
        let mut more: Vec<_> = clients
            .filter_map(|e| e.ok().map(|e| e.path().join("cache")))
            .collect();
        more.sort();
        dirs.extend(more);
    }
    let mut total = 0;
    for dir in dirs.iter().filter(|d| d.exists()) {
        let (cache, report) =
            DurableCache::open(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        total += cache.len() as u64 + report.dropped_corrupt as u64;
    }
    Ok(total)
}

/// One node as the problems list sees it.
#[derive(Clone, Debug)]
pub struct NodeOutcome<'a> {
    /// Node name.
    pub name: &'a str,
    /// Role.
    pub role: &'a str,
    /// Why it counts as lost ([`fate`] of its exit), if it does.
    pub lost: Option<&'a str>,
    /// Deltas left undelivered (trainers), and whether the count was read from disk after the
    /// process died (it never wrote its stats).
    pub undelivered: Option<(u64, bool)>,
}

/// Every problem of a finished run, one sentence each (empty: the run is clean).
pub fn problems(nodes: &[NodeOutcome<'_>]) -> Vec<String> {
    let mut out = Vec::new();
    for n in nodes {
        if let Some(why) = n.lost {
            out.push(format!("{} ({}) was lost: {why}", n.name, n.role));
        }
        match n.undelivered {
            Some((count, from_disk)) if count > 0 => out.push(format!(
                "{}: {count} deltas left undelivered{}",
                n.name,
                if from_disk {
                    " (counted in its durable cache after it died; restart it with the same data_dir to deliver them)"
                } else {
                    " at its exit (raise [sync] drain_timeout_s, or restart it to retry)"
                }
            )),
            None if n.role != "aggregator" && n.role != "coordinator" => out.push(format!(
                "{}: undelivered deltas unknown (no stats.json and no readable cache)",
                n.name
            )),
            _ => {}
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exits_are_classified_in_operators_words() {
        assert_eq!(fate("exit status: 0"), Fate::Clean);
        assert_eq!(fate(PLANNED_KILL), Fate::PlannedKill);
        let Fate::Lost(why) = fate("signal: 9 (SIGKILL)") else {
            panic!("lost")
        };
        assert!(why.contains("OOM") && why.contains("dmesg"), "{why}");
        assert!(matches!(fate("exit status: 1"), Fate::Lost(w) if w.contains("log.txt")));
        assert!(matches!(fate("killed after timeout"), Fate::Lost(w) if w.contains("timeout_s")));
    }

    #[test]
    fn a_lost_node_and_undelivered_deltas_are_problems_a_clean_run_has_none() {
        let clean = NodeOutcome {
            name: "edge-1",
            role: "edge",
            lost: None,
            undelivered: Some((0, false)),
        };
        let agg = NodeOutcome {
            name: "agg-1",
            role: "aggregator",
            lost: None,
            undelivered: None,
        };
        assert!(problems(&[clean.clone(), agg]).is_empty());
        let dead = NodeOutcome {
            name: "edge-2",
            role: "edge",
            lost: Some("killed by SIGKILL outside the chaos plan"),
            undelivered: Some((7, true)),
        };
        let p = problems(&[clean, dead]);
        assert_eq!(p.len(), 2, "{p:?}");
        assert!(p[0].starts_with("edge-2 (edge) was lost"), "{p:?}");
        assert!(p[1].contains("7 deltas left undelivered (counted in its durable cache"));
    }

    #[test]
    fn the_cache_on_disk_is_counted_after_the_fact() {
        let dir = std::env::temp_dir().join(format!("dreamddp-health-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(undelivered_on_disk(&dir), Ok(0), "no cache yet");
        let fill = |cache_dir: std::path::PathBuf, n: u64| {
            let (cache, _) = DurableCache::open(cache_dir).unwrap();
            for seq in 1..=n {
                cache
                    .put_durable(&edge_agent::cache::CacheEntry {
                        layer_id: 0,
                        seq,
                        base_version: 0,
                        sample_count: 1,
                        step: seq,
                        delta: vec![1.0; 4],
                    })
                    .unwrap();
            }
        };
        fill(dir.join("cache"), 3);
        assert_eq!(undelivered_on_disk(&dir), Ok(3));
        // A swarm process keeps one cache per client: they are all counted.
        fill(dir.join("clients").join("swarm-0001").join("cache"), 2);
        fill(dir.join("clients").join("swarm-0002").join("cache"), 4);
        assert_eq!(undelivered_on_disk(&dir), Ok(9));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
