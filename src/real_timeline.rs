//! The per-layer timeline of a real run, read back from the trainers' logs: every
//! `[SYNC] layer=L … ms=M` line is an exchange that ended at the line's timestamp and started
//! `M` ms before, and so is every `[WARN] layer=L seq=S ms=M delta refused by its aggregator`
//! line (a refused delta's exchange ends as a delivered one's does, as in the simulator); every
//! `[WARN] layer=L deadline missed` line is a weak-synced one (drawn as
//! one deadline long). Times are seconds since the trainers were started, as in the
//! simulator's timeline.

use std::path::Path;

use simulations::report::SyncEvent;

/// Most events kept (as the simulator's timeline).
const TIMELINE_CAP: usize = 4000;

/// Seconds since the Unix epoch of a `tracing` timestamp `YYYY-MM-DDTHH:MM:SS.ffffffZ`.
pub fn parse_utc(ts: &str) -> Option<f64> {
    let (date, time) = ts.strip_suffix('Z')?.split_once('T')?;
    let mut d = date.splitn(3, '-').map(|p| p.parse::<i64>().ok());
    let (y, m, day) = (d.next()??, d.next()??, d.next()??);
    let mut t = time.splitn(3, ':');
    let (hh, mm) = (
        t.next()?.parse::<f64>().ok()?,
        t.next()?.parse::<f64>().ok()?,
    );
    let ss = t.next()?.parse::<f64>().ok()?;
    if !(1..=12).contains(&m) || !(1..=31).contains(&day) {
        return None;
    }
    // Days from the civil date (Howard Hinnant's algorithm).
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    Some(days as f64 * 86_400.0 + hh * 3600.0 + mm * 60.0 + ss)
}

fn field<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    let start = line.find(key)? + key.len();
    line[start..].split_whitespace().next()
}

/// The events in one node's log (`node` names it), relative to `t0_unix_s`; a missed deadline
/// is drawn `deadline_s` long.
pub fn node_events(log: &str, node: &str, t0_unix_s: f64, deadline_s: f64) -> Vec<SyncEvent> {
    let mut out = Vec::new();
    for line in log.lines() {
        let Some(ts) = line.split_whitespace().next().and_then(parse_utc) else {
            continue;
        };
        let end_s = ts - t0_unix_s;
        // A delivered delta, or one its aggregator refused (the simulator's timeline ends
        // both exchanges the same way).
        let key = if line.contains("[SYNC] layer=") {
            Some("[SYNC] layer=")
        } else if line.contains("delta refused by its aggregator") {
            Some("[WARN] layer=")
        } else {
            None
        };
        if let Some(key) = key {
            let (Some(layer), Some(ms)) = (
                field(line, key),
                field(line, " ms=").and_then(|m| m.parse::<f64>().ok()),
            ) else {
                continue;
            };
            out.push(SyncEvent {
                start_s: (end_s - ms / 1e3).max(0.0),
                end_s,
                node: node.to_string(),
                layer: layer.to_string(),
                weak: false,
            });
        } else if line.contains("deadline missed") {
            if let Some(layer) = field(line, "[WARN] layer=") {
                out.push(SyncEvent {
                    start_s: (end_s - deadline_s).max(0.0),
                    end_s,
                    node: node.to_string(),
                    layer: layer.to_string(),
                    weak: true,
                });
            }
        }
    }
    out
}

/// The timeline of a run whose trainers' logs are `<dir>/<node>/log.txt`.
pub fn timeline(dir: &Path, nodes: &[(String, f64)], t0_unix_s: f64) -> Vec<SyncEvent> {
    let mut all: Vec<SyncEvent> = nodes
        .iter()
        .flat_map(|(name, deadline_s)| {
            let log = std::fs::read_to_string(dir.join(name).join("log.txt")).unwrap_or_default();
            node_events(&log, name, t0_unix_s, *deadline_s)
        })
        .collect();
    all.sort_by(|a, b| a.start_s.total_cmp(&b.start_s));
    all.truncate(TIMELINE_CAP);
    all
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps_parse_to_unix_seconds() {
        assert_eq!(parse_utc("1970-01-01T00:00:00.000000Z"), Some(0.0));
        let t = parse_utc("2026-12-02T05:16:13.860228Z").unwrap();
        // 2026-12-02 is day 20_789 after the epoch.
        assert!((t - (20_789.0 * 86_400.0 + 5.0 * 3600.0 + 16.0 * 60.0 + 13.860228)).abs() < 1e-6);
        assert_eq!(parse_utc("not a time"), None);
        assert_eq!(parse_utc("2026-13-02T05:16:13Z"), None);
    }

    #[test]
    fn sync_refused_and_missed_deadline_lines_become_events() {
        let log = "\
2026-12-02T00:00:10.500000Z  INFO [SYNC] layer=fc3 version=4 bytes=131584 ms=1500.0 seq=7
2026-12-02T00:00:11.000000Z  WARN [WARN] layer=fc1 deadline missed, cached (1 pending)
2026-12-02T00:00:12.000000Z  WARN [WARN] layer=fc2 backlog, cached (2 pending)
2026-12-02T00:00:13.000000Z  WARN [WARN] layer=fc1 seq=9 ms=4000.0 delta refused by its aggregator: TooStale { staleness: 70, max_staleness: 32 }; re-syncing
garbage line
";
        let t0 = parse_utc("2026-12-02T00:00:00.000000Z").unwrap();
        let e = node_events(log, "edge-0", t0, 2.0);
        assert_eq!(e.len(), 3, "{e:?}");
        assert_eq!((e[2].layer.as_str(), e[2].weak), ("fc1", false));
        assert!((e[2].start_s - 9.0).abs() < 1e-6 && (e[2].end_s - 13.0).abs() < 1e-6);
        assert_eq!((e[0].layer.as_str(), e[0].weak), ("fc3", false));
        assert!((e[0].start_s - 9.0).abs() < 1e-6 && (e[0].end_s - 10.5).abs() < 1e-6);
        assert_eq!((e[1].layer.as_str(), e[1].weak), ("fc1", true));
        assert!((e[1].start_s - 9.0).abs() < 1e-6);
    }
}
