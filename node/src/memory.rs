//! The process's own memory use, as the kernel counts it: resident set size now and its
//! peak (`VmRSS` and `VmHWM` of `/proc/self/status`), which nodes put in their stats (the
//! coordinator's `/metrics`) and in `stats.json`, and the CPU time it used (`/proc/self/stat`).
//! On a system without `/proc` they read 0.

/// Resident memory of this process, bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct ProcessMemory {
    /// Resident set size now.
    pub rss_bytes: u64,
    /// Peak resident set size since the process started.
    pub peak_rss_bytes: u64,
}

/// Reads this process's memory use (zeros where `/proc/self/status` is unavailable).
pub fn process_memory() -> ProcessMemory {
    std::fs::read_to_string("/proc/self/status")
        .map(|s| parse_status(&s))
        .unwrap_or_default()
}

/// The `VmRSS` and `VmHWM` lines of a `/proc/<pid>/status` text (in kB there).
pub fn parse_status(status: &str) -> ProcessMemory {
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|rest| {
                rest.trim()
                    .trim_end_matches("kB")
                    .trim()
                    .parse::<u64>()
                    .ok()
            })
            .map_or(0, |kb| kb * 1024)
    };
    ProcessMemory {
        rss_bytes: field("VmRSS:"),
        peak_rss_bytes: field("VmHWM:"),
    }
}

/// CPU seconds this process has used, user and system together (`utime + stime` of
/// `/proc/self/stat`, in the kernel's fixed 100 Hz user ticks); 0 where it is unavailable.
pub fn process_cpu_seconds() -> f64 {
    std::fs::read_to_string("/proc/self/stat")
        .ok()
        .and_then(|s| parse_cpu_seconds(&s))
        .unwrap_or(0.0)
}

/// `utime + stime` of a `/proc/<pid>/stat` line, seconds (the command name in parentheses
/// may hold spaces, so fields are counted after its closing parenthesis).
pub fn parse_cpu_seconds(stat: &str) -> Option<f64> {
    let rest = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // After the name: state is field 3 of the line, utime 14 and stime 15.
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    Some((utime + stime) as f64 / 100.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_seconds_from_the_stat_line() {
        let line = "1234 (dream ddp) S 1 2 3 4 5 6 7 8 9 10 250 125 0 0 20 0 9 0";
        assert_eq!(parse_cpu_seconds(line), Some(3.75));
        assert_eq!(parse_cpu_seconds("garbage"), None);
        assert_eq!(parse_cpu_seconds("1 (x) S 1 2"), None);
    }

    #[test]
    fn parses_the_kernel_format_and_tolerates_garbage() {
        let text = "Name:\tdreamddp\nVmHWM:\t  130412 kB\nVmRSS:\t   98304 kB\nThreads:\t9\n";
        assert_eq!(
            parse_status(text),
            ProcessMemory {
                rss_bytes: 98304 * 1024,
                peak_rss_bytes: 130412 * 1024
            }
        );
        assert_eq!(parse_status("VmRSS: lots"), ProcessMemory::default());
    }

    #[test]
    fn this_process_has_resident_memory_on_linux() {
        let m = process_memory();
        if std::path::Path::new("/proc/self/status").exists() {
            assert!(m.rss_bytes > 0 && m.peak_rss_bytes >= m.rss_bytes, "{m:?}");
        }
    }
}
