//! Link-capacity traces: parsing the two formats in `../shared/data/traces` and replaying them.
//!
//! * **mahimahi** (`*.up` / `*.down`): one integer per line, a time in ms. Each line is one
//!   opportunity to deliver [`MAHIMAHI_OPPORTUNITY_BYTES`] bytes; repeated timestamps give several
//!   opportunities in that ms. The period is the last timestamp (as in `mm-link`): opportunity `i`
//!   of loop `k` happens at `k·period + ts[i]`. Packets consume opportunity *credit* byte-wise (a
//!   1500-byte packet uses exactly one opportunity; a 9000-byte one six), like `mm-link`.
//! * **mbps** (Pensieve "cooked" format, e.g. `norway_bus_1`): rows `time_s  Mbit/s`, separated by
//!   tabs or spaces. Each rate holds until the next row's time (piecewise constant); the period is
//!   the last row's time, so the last row only marks the end (this matches the durations in
//!   `SOURCES.md`). If the first row starts after 0, its rate also covers `[0, first)`.
//!
//! With `looped = false`, the link has no capacity at all after the end of the trace.
//! Parse errors name the file and the 1-based line.

use crate::time::{SimDuration, SimTime, NANOS_PER_MILLI, NANOS_PER_SEC};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use thiserror::Error;

/// Bytes one mahimahi delivery opportunity can carry.
pub const MAHIMAHI_OPPORTUNITY_BYTES: u64 = 1500;

/// Which of the two trace formats a file is in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TraceFormat {
    /// One ms timestamp per line, one 1500-byte delivery opportunity per line.
    Mahimahi,
    /// Rows of `time_s  Mbit/s`, piecewise constant.
    Mbps,
}

/// Why a trace could not be loaded.
#[derive(Debug, Error)]
pub enum TraceError {
    /// The file could not be read.
    #[error("cannot read trace {}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// A line is malformed.
    #[error("{}:{line}: {message}", path.display())]
    Parse {
        /// The file (or the name given to in-memory text).
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// What is wrong with the line.
        message: String,
    },
    /// The trace has too few samples to define a period.
    #[error("trace {} is empty or too short: {message}", path.display())]
    TooShort {
        /// The file.
        path: PathBuf,
        /// Details.
        message: String,
    },
    /// The trace never offers any capacity.
    #[error("trace {} offers no capacity at all (every rate is zero)", path.display())]
    NoCapacity {
        /// The file.
        path: PathBuf,
    },
}

/// Capacity schedule of a parsed trace.
#[derive(Clone, Debug)]
enum Schedule {
    /// Delivery opportunities (ns within one period, non-decreasing).
    Opportunities { at_ns: Vec<u64> },
    /// Piecewise-constant rate: segment `i` is `[times_ns[i], times_ns[i+1])` at `rates_bps[i]`;
    /// `bits_before[i]` is the capacity in `[0, times_ns[i])`.
    Rate {
        times_ns: Vec<u64>,
        rates_bps: Vec<f64>,
        bits_before: Vec<f64>,
    },
}

/// A parsed capacity trace, replayable in virtual time.
#[derive(Clone, Debug)]
pub struct Trace {
    source: PathBuf,
    format: TraceFormat,
    looped: bool,
    period_ns: u64,
    schedule: Schedule,
}

/// Position of a sender in a trace: which opportunity is the next unused one, and how many bytes
/// are left in the one before it. Only meaningful for mahimahi traces; rate traces are fluid and
/// need only the start time.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TraceCursor {
    next_opportunity: u64,
    leftover_bytes: u64,
}

fn parse_error(path: &Path, line: usize, message: String) -> TraceError {
    TraceError::Parse {
        path: path.to_path_buf(),
        line,
        message,
    }
}

impl Trace {
    /// Reads and parses `path` in the given format.
    pub fn load(path: &Path, format: TraceFormat, looped: bool) -> Result<Trace, TraceError> {
        let text = std::fs::read_to_string(path).map_err(|source| TraceError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Trace::parse(&text, path, format, looped)
    }

    /// Parses trace text; `source` names it in errors and reports.
    pub fn parse(
        text: &str,
        source: &Path,
        format: TraceFormat,
        looped: bool,
    ) -> Result<Trace, TraceError> {
        match format {
            TraceFormat::Mahimahi => Trace::parse_mahimahi(text, source, looped),
            TraceFormat::Mbps => Trace::parse_mbps(text, source, looped),
        }
    }

    /// Parses the mahimahi format (one ms timestamp per line).
    pub fn parse_mahimahi(text: &str, source: &Path, looped: bool) -> Result<Trace, TraceError> {
        let mut at_ns = Vec::with_capacity(text.len() / 6);
        let mut previous_ms = 0u64;
        for (index, raw) in text.lines().enumerate() {
            let line = raw.trim();
            if line.is_empty() {
                continue;
            }
            let ms: u64 = line.parse().map_err(|_| {
                parse_error(
                    source,
                    index + 1,
                    format!("expected a non-negative integer timestamp in ms, got `{line}`"),
                )
            })?;
            if ms < previous_ms {
                return Err(parse_error(
                    source,
                    index + 1,
                    format!(
                        "timestamp {ms} ms is earlier than the previous one ({previous_ms} ms)"
                    ),
                ));
            }
            let ns = ms.checked_mul(NANOS_PER_MILLI).ok_or_else(|| {
                parse_error(source, index + 1, format!("timestamp {ms} ms is too large"))
            })?;
            previous_ms = ms;
            at_ns.push(ns);
        }
        let Some(&period_ns) = at_ns.last() else {
            return Err(TraceError::TooShort {
                path: source.to_path_buf(),
                message: "no timestamps".into(),
            });
        };
        if period_ns == 0 {
            return Err(TraceError::TooShort {
                path: source.to_path_buf(),
                message: "the last timestamp is 0 ms, so the trace has no duration".into(),
            });
        }
        Ok(Trace {
            source: source.to_path_buf(),
            format: TraceFormat::Mahimahi,
            looped,
            period_ns,
            schedule: Schedule::Opportunities { at_ns },
        })
    }

    /// Parses the `time_s  Mbit/s` format (tab or space separated).
    pub fn parse_mbps(text: &str, source: &Path, looped: bool) -> Result<Trace, TraceError> {
        let mut times_ns: Vec<u64> = Vec::new();
        let mut rates_bps: Vec<f64> = Vec::new();
        for (index, raw) in text.lines().enumerate() {
            let line_no = index + 1;
            let line = raw.trim();
            if line.is_empty() {
                continue;
            }
            let mut fields = line.split_whitespace();
            let (Some(time_text), Some(rate_text), None) =
                (fields.next(), fields.next(), fields.next())
            else {
                return Err(parse_error(
                    source,
                    line_no,
                    format!("expected two columns `time_s Mbit/s`, got `{line}`"),
                ));
            };
            let time_s: f64 = time_text.parse().map_err(|_| {
                parse_error(
                    source,
                    line_no,
                    format!("time `{time_text}` is not a number"),
                )
            })?;
            let time = SimTime::try_from_secs_f64(time_s).ok_or_else(|| {
                parse_error(
                    source,
                    line_no,
                    format!("time {time_s} s must be finite and non-negative"),
                )
            })?;
            let mbps: f64 = rate_text.parse().map_err(|_| {
                parse_error(
                    source,
                    line_no,
                    format!("rate `{rate_text}` is not a number"),
                )
            })?;
            if !mbps.is_finite() || mbps < 0.0 {
                return Err(parse_error(
                    source,
                    line_no,
                    format!("rate {mbps} Mbit/s must be finite and non-negative"),
                ));
            }
            if let Some(&previous) = times_ns.last() {
                if time.as_nanos() < previous {
                    return Err(parse_error(
                        source,
                        line_no,
                        format!(
                            "time {time_s} s is earlier than the previous row ({} s)",
                            SimTime(previous).as_secs_f64()
                        ),
                    ));
                }
            } else if time.as_nanos() > 0 {
                // The first rate also covers [0, first).
                times_ns.push(0);
                rates_bps.push(mbps * 1e6);
            }
            times_ns.push(time.as_nanos());
            rates_bps.push(mbps * 1e6);
        }
        if times_ns.len() < 2 {
            return Err(TraceError::TooShort {
                path: source.to_path_buf(),
                message: "need at least two rows to define a duration".into(),
            });
        }
        let period_ns = times_ns[times_ns.len() - 1];
        if period_ns == 0 {
            return Err(TraceError::TooShort {
                path: source.to_path_buf(),
                message: "the last row is at 0 s, so the trace has no duration".into(),
            });
        }
        let mut bits_before = Vec::with_capacity(times_ns.len());
        let mut total = 0.0f64;
        bits_before.push(0.0);
        for i in 1..times_ns.len() {
            let seconds = (times_ns[i] - times_ns[i - 1]) as f64 / NANOS_PER_SEC as f64;
            total += rates_bps[i - 1] * seconds;
            bits_before.push(total);
        }
        if total <= 0.0 {
            return Err(TraceError::NoCapacity {
                path: source.to_path_buf(),
            });
        }
        Ok(Trace {
            source: source.to_path_buf(),
            format: TraceFormat::Mbps,
            looped,
            period_ns,
            schedule: Schedule::Rate {
                times_ns,
                rates_bps,
                bits_before,
            },
        })
    }

    /// The file (or name) the trace came from.
    pub fn source(&self) -> &Path {
        &self.source
    }

    /// The trace's format.
    pub fn format(&self) -> TraceFormat {
        self.format
    }

    /// Whether the trace repeats after its period.
    pub fn is_looped(&self) -> bool {
        self.looped
    }

    /// Length of one pass through the trace.
    pub fn period(&self) -> SimDuration {
        SimDuration(self.period_ns)
    }

    /// Bytes the trace can deliver in one period: `lines × 1500` for mahimahi (every line, also a
    /// line at exactly the period), the integral of the rate for mbps.
    pub fn bytes_per_period(&self) -> u64 {
        match &self.schedule {
            Schedule::Opportunities { at_ns } => at_ns.len() as u64 * MAHIMAHI_OPPORTUNITY_BYTES,
            Schedule::Rate { bits_before, .. } => (bits_before[bits_before.len() - 1] / 8.0) as u64,
        }
    }

    /// The trace's mean rate over one period, bits per second.
    pub fn mean_bits_per_sec(&self) -> f64 {
        self.bytes_per_period() as f64 * 8.0 / self.period().as_secs_f64().max(1e-9)
    }

    /// Bytes the trace can deliver in the window `[from, to)` (0 if `to <= from`). For mahimahi
    /// that is 1500 × the opportunities in the window; for mbps the integral of the rate, floored.
    pub fn bytes_deliverable(&self, from: SimTime, to: SimTime) -> u64 {
        if to <= from {
            return 0;
        }
        match &self.schedule {
            Schedule::Opportunities { at_ns } => {
                let count = self.opportunities_before(at_ns, to.as_nanos())
                    - self.opportunities_before(at_ns, from.as_nanos());
                count.saturating_mul(MAHIMAHI_OPPORTUNITY_BYTES)
            }
            Schedule::Rate {
                times_ns,
                rates_bps,
                bits_before,
            } => {
                let bits = self.bits_before(times_ns, rates_bps, bits_before, to.as_nanos())
                    - self.bits_before(times_ns, rates_bps, bits_before, from.as_nanos());
                (bits / 8.0).max(0.0) as u64
            }
        }
    }

    /// Number of delivery opportunities strictly before `t_ns` (equivalently, the global index of
    /// the first opportunity at or after `t_ns`, since opportunity times never decrease).
    fn opportunities_before(&self, at_ns: &[u64], t_ns: u64) -> u64 {
        let before = |x: u64| at_ns.partition_point(|&a| a < x) as u64;
        if !self.looped {
            return before(t_ns);
        }
        let n = at_ns.len() as u64;
        let loops = t_ns / self.period_ns;
        let within = t_ns % self.period_ns;
        if loops == 0 {
            before(within)
        } else {
            // Loops 0..loops-1 are complete except for lines at exactly the period in loop
            // `loops-1` (which happen at `t` when `within == 0`), then loop `loops` up to `within`.
            (loops - 1)
                .saturating_mul(n)
                .saturating_add(before(self.period_ns + within))
                .saturating_add(before(within))
        }
    }

    /// Time of the global opportunity `index`, or `None` past the end of a non-looped trace.
    fn opportunity_time(&self, at_ns: &[u64], index: u64) -> Option<SimTime> {
        let n = at_ns.len() as u64;
        if !self.looped && index >= n {
            return None;
        }
        let loops = index / n;
        let line = (index % n) as usize;
        loops
            .checked_mul(self.period_ns)?
            .checked_add(at_ns[line])
            .map(SimTime)
    }

    /// Capacity in bits in `[0, t_ns)`.
    fn bits_before(
        &self,
        times_ns: &[u64],
        rates_bps: &[f64],
        bits_before: &[f64],
        t_ns: u64,
    ) -> f64 {
        let per_period = bits_before[bits_before.len() - 1];
        let (loops, within) = if self.looped {
            (t_ns / self.period_ns, t_ns % self.period_ns)
        } else if t_ns >= self.period_ns {
            return per_period;
        } else {
            (0, t_ns)
        };
        // times_ns[0] == 0 <= within < period == last time, so 0 <= segment <= len-2.
        let segment = times_ns.partition_point(|&x| x <= within) - 1;
        let inside =
            rates_bps[segment] * (within - times_ns[segment]) as f64 / NANOS_PER_SEC as f64;
        loops as f64 * per_period + bits_before[segment] + inside
    }

    /// Serializes `bytes` starting no earlier than `start`; returns when the last byte leaves, or
    /// `None` if a non-looped trace ends first. Advances `cursor` (mahimahi credit).
    pub fn transmit(
        &self,
        cursor: &mut TraceCursor,
        start: SimTime,
        bytes: u64,
    ) -> Option<SimTime> {
        if bytes == 0 {
            // An empty packet needs no capacity, but a link whose trace has ended is dead.
            let dead = !self.looped && start.as_nanos() > self.period_ns;
            return (!dead).then_some(start);
        }
        match &self.schedule {
            Schedule::Opportunities { at_ns } => {
                let mut remaining = bytes;
                let mut end = start;
                if cursor.leftover_bytes > 0 && cursor.next_opportunity > 0 {
                    let t = self.opportunity_time(at_ns, cursor.next_opportunity - 1)?;
                    if t >= start {
                        let take = cursor.leftover_bytes.min(remaining);
                        remaining -= take;
                        cursor.leftover_bytes -= take;
                        end = t;
                    } else {
                        cursor.leftover_bytes = 0;
                    }
                }
                if remaining == 0 {
                    return Some(end);
                }
                let mut index = cursor
                    .next_opportunity
                    .max(self.opportunities_before(at_ns, start.as_nanos()));
                while remaining > 0 {
                    end = self.opportunity_time(at_ns, index)?;
                    let take = MAHIMAHI_OPPORTUNITY_BYTES.min(remaining);
                    remaining -= take;
                    cursor.leftover_bytes = MAHIMAHI_OPPORTUNITY_BYTES - take;
                    index += 1;
                }
                cursor.next_opportunity = index;
                Some(end)
            }
            Schedule::Rate {
                times_ns,
                rates_bps,
                ..
            } => {
                let mut need_bits = bytes as f64 * 8.0;
                let mut t = start.as_nanos();
                loop {
                    if !self.looped && t >= self.period_ns {
                        return None;
                    }
                    let base = (t / self.period_ns) * self.period_ns;
                    let within = t - base;
                    let segment = times_ns.partition_point(|&x| x <= within) - 1;
                    let segment_end = base.checked_add(times_ns[segment + 1])?;
                    let rate = rates_bps[segment];
                    if rate > 0.0 {
                        let available = rate * (segment_end - t) as f64 / NANOS_PER_SEC as f64;
                        if available >= need_bits {
                            let dt = (need_bits / rate * NANOS_PER_SEC as f64).ceil() as u64;
                            return Some(SimTime(t.saturating_add(dt).min(segment_end)));
                        }
                        need_bits -= available;
                    }
                    t = segment_end;
                }
            }
        }
    }

    /// Gives back opportunities at or after `to` that the cursor had already consumed (a sender
    /// that aborts at `to` frees the capacity after it).
    pub fn rewind_cursor(&self, cursor: &mut TraceCursor, to: SimTime) {
        if let Schedule::Opportunities { at_ns } = &self.schedule {
            let first_free = self.opportunities_before(at_ns, to.as_nanos());
            if cursor.next_opportunity > first_free {
                cursor.next_opportunity = first_free;
                cursor.leftover_bytes = 0;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mm(text: &str, looped: bool) -> Trace {
        Trace::parse_mahimahi(text, Path::new("test.up"), looped).unwrap()
    }

    fn ms(v: u64) -> SimTime {
        SimTime::from_millis(v)
    }

    #[test]
    fn mahimahi_counts_opportunities_per_window() {
        // Opportunities at 0, 5, 5, 10 (period 10 ms): loop k adds 10k ms.
        let t = mm("0\n5\n5\n10\n", true);
        assert_eq!(t.period(), SimDuration::from_millis(10));
        assert_eq!(t.bytes_per_period(), 4 * 1500);
        assert_eq!(t.bytes_deliverable(ms(0), ms(5)), 1500);
        assert_eq!(t.bytes_deliverable(ms(0), ms(6)), 3 * 1500);
        // [0,10): 0,5,5 ; at 10 there are two (line "10" of loop 0, line "0" of loop 1).
        assert_eq!(t.bytes_deliverable(ms(0), ms(10)), 3 * 1500);
        assert_eq!(t.bytes_deliverable(ms(0), ms(11)), 5 * 1500);
        assert_eq!(t.bytes_deliverable(ms(0), ms(30)), 3 * 4 * 1500 - 1500);
        assert_eq!(t.bytes_deliverable(ms(7), ms(7)), 0);
        let once = mm("0\n5\n5\n10\n", false);
        assert_eq!(once.bytes_deliverable(ms(0), ms(1000)), 4 * 1500);
    }

    #[test]
    fn mahimahi_transmit_uses_credit_and_loops() {
        let t = mm("2\n2\n4\n", true); // period 4 ms
        let mut c = TraceCursor::default();
        // 1000 bytes: first opportunity at 2 ms, leaves 500 bytes of credit.
        assert_eq!(t.transmit(&mut c, ms(0), 1000), Some(ms(2)));
        // 1000 more at 2 ms: 500 leftover + 500 of the second opportunity at 2 ms.
        assert_eq!(t.transmit(&mut c, ms(2), 1000), Some(ms(2)));
        // 1500: the rest of opp #2 (1000) is at 2 ms, the next 500 at 4 ms.
        assert_eq!(t.transmit(&mut c, ms(2), 1500), Some(ms(4)));
        // Starting later wastes leftover credit; loop 1's opportunities are at 6, 6 and 8 ms.
        assert_eq!(t.transmit(&mut c, ms(5), 1500), Some(ms(6)));
        assert_eq!(t.transmit(&mut c, ms(5), 3000), Some(ms(8)));
        let once = mm("2\n2\n4\n", false);
        let mut c = TraceCursor::default();
        assert_eq!(once.transmit(&mut c, ms(0), 4500), Some(ms(4)));
        assert_eq!(once.transmit(&mut c, ms(4), 1), None);
    }

    #[test]
    fn mbps_integrates_piecewise_constant() {
        // 8 Mbit/s for 1 s, 0 for 1 s, 16 Mbit/s for 1 s; period 3 s.
        let t = Trace::parse_mbps("0 8\n1\t0\n2   16\n3 99\n", Path::new("r"), true).unwrap();
        assert_eq!(t.period(), SimDuration::from_secs(3));
        assert_eq!(t.bytes_per_period(), 3_000_000);
        assert_eq!(
            t.bytes_deliverable(SimTime::from_secs(0), SimTime::from_secs(1)),
            1_000_000
        );
        assert_eq!(
            t.bytes_deliverable(SimTime::from_millis(500), SimTime::from_millis(2500)),
            500_000 + 1_000_000
        );
        assert_eq!(
            t.bytes_deliverable(SimTime::ZERO, SimTime::from_secs(6)),
            6_000_000
        );
        let mut c = TraceCursor::default();
        // 1 MB from 0.5 s: 0.5 MB by 1 s, nothing until 2 s, then 0.5 MB at 2 MB/s = 0.25 s.
        assert_eq!(
            t.transmit(&mut c, SimTime::from_millis(500), 1_000_000),
            Some(SimTime::from_millis(2250))
        );
        // Wraps into the next loop: 2 MB from 2.5 s = 1 MB by 3 s, then 1 MB at 1 MB/s.
        assert_eq!(
            t.transmit(&mut c, SimTime::from_millis(2500), 2_000_000),
            Some(SimTime::from_secs(4))
        );
        let once = Trace::parse_mbps("0 8\n1 8\n", Path::new("r"), false).unwrap();
        assert_eq!(once.transmit(&mut c, SimTime::ZERO, 1_000_001), None);
    }

    #[test]
    fn mbps_first_row_after_zero_covers_the_start() {
        let t = Trace::parse_mbps("1 8\n2 8\n", Path::new("r"), false).unwrap();
        assert_eq!(
            t.bytes_deliverable(SimTime::ZERO, SimTime::from_secs(2)),
            2_000_000
        );
    }

    #[test]
    fn parse_errors_name_file_and_line() {
        let err = Trace::parse_mahimahi("0\n3\nx7\n", Path::new("a.up"), true).unwrap_err();
        assert_eq!(
            err.to_string(),
            "a.up:3: expected a non-negative integer timestamp in ms, got `x7`"
        );
        let err = Trace::parse_mahimahi("5\n3\n", Path::new("a.up"), true).unwrap_err();
        assert!(matches!(err, TraceError::Parse { line: 2, .. }), "{err}");
        let err = Trace::parse_mahimahi("0\n0\n", Path::new("a.up"), true).unwrap_err();
        assert!(matches!(err, TraceError::TooShort { .. }), "{err}");
        let err = Trace::parse_mahimahi("\n\n", Path::new("a.up"), true).unwrap_err();
        assert!(matches!(err, TraceError::TooShort { .. }), "{err}");

        let err = Trace::parse_mbps("0 1\n1 2 3\n", Path::new("bus"), true).unwrap_err();
        assert!(
            err.to_string().starts_with("bus:2: expected two columns"),
            "{err}"
        );
        let err = Trace::parse_mbps("0 1\n1 fast\n", Path::new("bus"), true).unwrap_err();
        assert_eq!(err.to_string(), "bus:2: rate `fast` is not a number");
        let err = Trace::parse_mbps("0 1\n-1 2\n", Path::new("bus"), true).unwrap_err();
        assert!(err.to_string().contains("bus:2: time -1 s"), "{err}");
        let err = Trace::parse_mbps("0 1\n2 1\n1 1\n", Path::new("bus"), true).unwrap_err();
        assert!(matches!(err, TraceError::Parse { line: 3, .. }), "{err}");
        let err = Trace::parse_mbps("0 1\n", Path::new("bus"), true).unwrap_err();
        assert!(matches!(err, TraceError::TooShort { .. }), "{err}");
        let err = Trace::parse_mbps("0 0\n1 0\n", Path::new("bus"), true).unwrap_err();
        assert!(matches!(err, TraceError::NoCapacity { .. }), "{err}");
        let err =
            Trace::load(Path::new("/nonexistent/trace"), TraceFormat::Mbps, true).unwrap_err();
        assert!(err.to_string().contains("/nonexistent/trace"), "{err}");
    }

    #[test]
    fn real_traces_match_sources_md_when_present() {
        let dir = Path::new(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../shared/data/traces"
        ));
        let alt = Path::new("/work/shared/data/traces");
        let dir = if dir.is_dir() { dir } else { alt };
        if !dir.is_dir() {
            eprintln!("skipping: no trace directory");
            return;
        }
        // (file, format, lines or rows, duration ms) from SOURCES.md.
        let att = dir.join("ATT-LTE-driving-2016.up");
        if att.is_file() {
            let t = Trace::load(&att, TraceFormat::Mahimahi, true).unwrap();
            assert_eq!(t.bytes_per_period(), 19101 * 1500);
            assert_eq!(t.period(), SimDuration::from_millis(120_002));
        }
        let bus = dir.join("norway_bus_1");
        if bus.is_file() {
            let t = Trace::load(&bus, TraceFormat::Mbps, true).unwrap();
            let mean_mbps = t.bytes_per_period() as f64 * 8.0 / t.period().as_secs_f64() / 1e6;
            assert!((mean_mbps - 2.953).abs() < 0.01, "mean {mean_mbps}");
        }
    }
}
