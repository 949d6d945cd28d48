//! The `fidelity` report on the terminal: per strategy the simulated and real time to target,
//! final accuracy, bytes and weak-sync events with their differences, each real run's values
//! under `--real-runs`, each simulated seed's under `--sim-seeds`, the pace of a strategy whose
//! real runs never reached the target, the real run's warnings, and per access link the bytes
//! in both engines.

use crate::fidelity_cmd::{FidelityReport, StrategyFidelity};

fn pct(v: Option<f64>) -> String {
    v.map_or("-".into(), |e| format!("{:+.1}%", e * 100.0))
}

pub(crate) fn secs(v: Option<f64>) -> String {
    v.map_or("never".into(), |t| format!("{t:.1}"))
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1u64 << 20) as f64
}

fn acc(v: Option<f64>) -> String {
    v.map_or("-".into(), |a| format!("{:.2}%", a * 100.0))
}

/// `items` through `cell`, comma-separated.
fn joined<T>(items: &[T], cell: impl Fn(&T) -> String) -> String {
    items.iter().map(cell).collect::<Vec<_>>().join(", ")
}

pub(crate) fn print_report(r: &FidelityReport) {
    println!();
    println!(
        "fidelity of scenario {} (seed {}), target {}: simulated vs real (errors are (sim − real) / real)",
        r.scenario, r.seed, r.target
    );
    println!(
        "{:<17} {:>9} {:>9} {:>8} {:>9} {:>9} {:>7} {:>10} {:>10} {:>7} {:>9} {:>6}",
        "strategy",
        "sim tt s",
        "real tt s",
        "tt err",
        "sim acc",
        "real acc",
        "Δ pts",
        "sim MiB",
        "real MiB",
        "B err",
        "weak s/r",
        "TV τ"
    );
    for s in &r.strategies {
        println!(
            "{:<17} {:>9} {:>9} {:>8} {:>9} {:>9} {:>7} {:>10.1} {:>10.1} {:>7} {:>9} {:>6}",
            s.strategy,
            secs(s.sim_time_to_target_s),
            secs(s.real_time_to_target_s),
            pct(s.time_to_target_error),
            acc(s.sim_final_accuracy),
            acc(s.real_final_accuracy),
            s.final_accuracy_diff
                .map_or("-".into(), |d| format!("{d:+.2}")),
            mib(s.sim_bytes),
            mib(s.real_bytes),
            pct(s.bytes_error),
            format!("{}/{}", s.sim_weak_sync_events, s.real_weak_sync_events),
            s.staleness_distance
                .map_or("-".into(), |d| format!("{d:.2}")),
        );
        if let Some(runs) = (!r.runs.is_empty()).then_some(&r.runs) {
            let mine: Vec<&StrategyFidelity> = runs
                .iter()
                .filter_map(|run| run.iter().find(|x| x.strategy == s.strategy))
                .collect();
            println!(
                "  {} real runs: time to target {}; final accuracy {}; MiB {}",
                mine.len(),
                joined(&mine, |x| secs(x.real_time_to_target_s)),
                joined(&mine, |x| acc(x.real_final_accuracy)),
                joined(&mine, |x| format!("{:.1}", mib(x.real_bytes))),
            );
        }
        if let Some(spread) = &s.sim_spread {
            println!(
                "  {} simulated network seeds ({}): time to target {}; final accuracy {}; MiB {}",
                spread.seeds.len(),
                joined(&spread.seeds, u64::to_string),
                joined(&spread.time_to_target_s, |t| secs(*t)),
                joined(&spread.final_accuracy, |a| acc(*a)),
                joined(&spread.bytes, |b| format!("{:.1}", mib(*b))),
            );
        }
        if let Some(p) = s
            .pace
            .as_ref()
            .filter(|_| s.real_time_to_target_s.is_none())
        {
            println!(
                "  pace (no target): time to {} (the lowest final of any seed or run): sim {:.1} s, real {:.1} s ({}); MiB by then {:.1} / {:.1} ({})",
                acc(Some(p.level)),
                p.sim_time_s,
                p.real_time_s,
                pct(p.error),
                mib(p.sim_bytes),
                mib(p.real_bytes),
                pct(p.bytes_error),
            );
        }
        if let Some(p) = &s.past_cutoff {
            println!(
                "  past the cutoff: the simulated seeds run on to {:.0} s reach the target at {}: typical {} against the real {} ({})",
                p.virtual_s,
                joined(&p.sim_times_s, |t| secs(*t)),
                secs(p.sim_time_to_target_s),
                secs(s.real_time_to_target_s),
                pct(p.time_to_target_error),
            );
        }
        if s.real_pace_overruns > 0 {
            println!(
                "[WARN] {}: {} paced steps overran their device class's step time on this machine",
                s.strategy, s.real_pace_overruns
            );
        }
        for p in &s.real_problems {
            println!("[WARN] {}: real run: {p}", s.strategy);
        }
    }
    print_links(r);
}

/// Per strategy, one line per node: its uplink's and downlink's MiB in both engines.
fn print_links(r: &FidelityReport) {
    for s in r.strategies.iter().filter(|s| !s.links.is_empty()) {
        println!("{}: MiB per access link, sim / real (error)", s.strategy);
        let nodes: std::collections::BTreeSet<&str> = s
            .links
            .keys()
            .filter_map(|k| k.rsplit_once('.').map(|(n, _)| n))
            .collect();
        for node in nodes {
            let cell = |dir: &str| {
                s.links
                    .get(&format!("{node}.{dir}"))
                    .map_or("-".to_string(), |l| {
                        format!("{:.1} / {:.1} ({})", mib(l.sim), mib(l.real), pct(l.error))
                    })
            };
            println!("  {node:<10} up {:<28} down {}", cell("up"), cell("down"));
        }
    }
}

/// `fidelity --real-runs 0`: each strategy's typical simulated run and its seeds.
pub(crate) fn print_simulated_only(
    scenario: &str,
    combined: &[simulations::report::StrategyResult],
    spreads: &[crate::fidelity_seeds::SimSpread],
    access_bytes: impl Fn(&simulations::report::StrategyResult) -> u64,
) {
    println!();
    println!("simulated side of scenario {scenario} alone (no real runs): the typical run, then each network seed");
    for (r, spread) in combined.iter().zip(spreads) {
        println!(
            "{:<17} time to target {} s, final accuracy {}, access-link bytes {:.1} MiB",
            r.strategy,
            secs(r.time_to_target_s),
            acc(r.final_accuracy),
            mib(access_bytes(r))
        );
        println!(
            "{:<17} seeds {}: {} s; {}; {} MiB",
            "",
            joined(&spread.seeds, |s| s.to_string()),
            joined(&spread.time_to_target_s, |t| secs(*t)),
            joined(&spread.final_accuracy, |a| acc(*a)),
            joined(&spread.bytes, |b| format!("{:.1}", mib(*b)))
        );
    }
}
