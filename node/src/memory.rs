//! The process's own memory use, as the kernel counts it: resident set size now and its
//! peak (`VmRSS` and `VmHWM` of `/proc/self/status`), which nodes put in their stats (the
//! coordinator's `/metrics`) and in `stats.json`. On a system without `/proc` both read 0.

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

#[cfg(test)]
mod tests {
    use super::*;

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
