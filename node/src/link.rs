//! Link shaper: bandwidth + latency model of an interconnect, parsed from `1gbit,200us`.
//!
//! This module owns [`LinkModel`] (the two numbers that describe a link), its textual
//! form (the `--link` option: `FromStr` and a `Display` that round-trips exactly), the
//! typed [`LinkSpecError`] for bad specs, and the ring all-reduce cost model that the
//! thread collective uses to decide when an operation completes.
//!
//! Spec grammar: `none` | `unlimited` | `BANDWIDTH[,LATENCY]`, where BANDWIDTH is a
//! number followed by a unit — bits per second `bit|kbit|mbit|gbit|tbit` (also written
//! `bps|kbps|mbps|gbps|tbps`, `kb/s`, `gbit/s`, …), bytes per second
//! `B/s|kB/s|MB/s|GB/s|TB/s` (capital `B`; binary `KiB/s|MiB/s|GiB/s|TiB/s` too) — or
//! `unlimited`/`inf`, and LATENCY is a number followed by `ns|us|µs|ms|s`. Decimal
//! prefixes are powers of 1000.

use std::fmt;
use std::str::FromStr;

use thiserror::Error;

/// Bandwidth and latency of an emulated interconnect.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LinkModel {
    /// Bytes per second; `f64::INFINITY` means the link is not shaped by bandwidth.
    pub bandwidth_bytes_per_s: f64,
    /// One-way per-message latency in seconds (≥ 0).
    pub latency_s: f64,
}

impl Default for LinkModel {
    fn default() -> Self {
        Self::unshaped()
    }
}

impl LinkModel {
    /// A link with infinite bandwidth and zero latency: collectives complete as soon as
    /// every rank has submitted.
    pub fn unshaped() -> Self {
        Self {
            bandwidth_bytes_per_s: f64::INFINITY,
            latency_s: 0.0,
        }
    }

    /// True when the link adds no delay at all.
    pub fn is_unshaped(&self) -> bool {
        self.bandwidth_bytes_per_s == f64::INFINITY && self.latency_s == 0.0
    }

    /// Bytes each rank sends in a ring all-reduce of a `bytes`-byte buffer among `world`
    /// ranks: reduce-scatter plus all-gather, `2(N−1)/N · bytes`. Zero for `world <= 1`.
    pub fn ring_allreduce_bytes_per_rank(bytes: usize, world: usize) -> f64 {
        if world <= 1 {
            return 0.0;
        }
        let n = world as f64;
        2.0 * (n - 1.0) / n * bytes as f64
    }

    /// Seconds a ring all-reduce of a `bytes`-byte buffer among `world` ranks takes on
    /// this link: `2(N−1)·latency + 2(N−1)/N·bytes/bandwidth`. Zero for `world <= 1`.
    pub fn ring_allreduce_seconds(&self, bytes: usize, world: usize) -> f64 {
        if world <= 1 {
            return 0.0;
        }
        let steps = 2.0 * (world as f64 - 1.0);
        steps * self.latency_s
            + Self::ring_allreduce_bytes_per_rank(bytes, world) / self.bandwidth_bytes_per_s
    }
}

/// A `--link` spec that could not be parsed.
#[derive(Debug, Clone, PartialEq, Error)]
#[error("bad --link '{spec}': {problem}; expected e.g. 1gbit,200us")]
pub struct LinkSpecError {
    /// The spec as given.
    pub spec: String,
    /// What is wrong with it.
    pub problem: LinkSpecProblem,
}

/// What is wrong with a link spec.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum LinkSpecProblem {
    /// Nothing was given.
    #[error("empty spec")]
    Empty,
    /// More than `BANDWIDTH,LATENCY`.
    #[error("too many comma-separated parts ({0}); at most bandwidth and latency")]
    TooManyParts(usize),
    /// A part does not start with a number.
    #[error("'{0}' does not start with a number")]
    MissingNumber(String),
    /// The numeric part is not a valid number.
    #[error("bad number '{0}'")]
    BadNumber(String),
    /// A number without a unit.
    #[error("'{0}' has no unit")]
    MissingUnit(String),
    /// A bandwidth unit that is not recognised.
    #[error("unknown unit '{0}'")]
    UnknownUnit(String),
    /// A time unit in the bandwidth position.
    #[error("'{0}' is a latency; the bandwidth comes first")]
    LatencyWhereBandwidthExpected(String),
    /// A latency unit that is not recognised.
    #[error("unknown latency unit '{0}' (use ns, us, ms or s)")]
    UnknownLatencyUnit(String),
    /// Zero bandwidth would make every transfer take forever.
    #[error("bandwidth must be positive, got '{0}'")]
    ZeroBandwidth(String),
    /// A number so large it overflows.
    #[error("'{0}' is out of range")]
    OutOfRange(String),
}

/// Display units for bandwidth, largest first: (suffix, bytes per second per unit).
/// Every factor is exactly representable, so parsing is one correctly rounded product.
const BIT_UNITS: [(&str, f64); 5] = [
    ("tbit", 1e12 / 8.0),
    ("gbit", 1e9 / 8.0),
    ("mbit", 1e6 / 8.0),
    ("kbit", 1e3 / 8.0),
    ("bit", 1.0 / 8.0),
];

/// Latency units, largest first: (suffix, units per second). Parsing divides by the
/// (exact) divisor, one correctly rounded quotient.
const LATENCY_UNITS: [(&str, f64); 4] = [("s", 1.0), ("ms", 1e3), ("us", 1e6), ("ns", 1e9)];

/// Splits `part` into its leading decimal number (digits and one optional point) and
/// the unit that follows, both trimmed.
fn split_number(part: &str) -> Result<(f64, &str), LinkSpecProblem> {
    let end = part
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(part.len());
    let (number_text, unit) = (&part[..end], part[end..].trim());
    if number_text.is_empty() {
        return Err(LinkSpecProblem::MissingNumber(part.to_string()));
    }
    let number: f64 = number_text
        .parse()
        .map_err(|_| LinkSpecProblem::BadNumber(number_text.to_string()))?;
    if unit.is_empty() {
        return Err(LinkSpecProblem::MissingUnit(part.to_string()));
    }
    Ok((number, unit))
}

/// Bytes per second per unit of a bandwidth unit, or `None` when unknown.
fn bandwidth_unit_factor(unit: &str) -> Option<f64> {
    let base = unit
        .strip_suffix("/s")
        .or_else(|| unit.strip_suffix("ps"))
        .unwrap_or(unit);
    let bit_prefix = base
        .len()
        .checked_sub(3)
        .filter(|&start| {
            base.get(start..)
                .is_some_and(|tail| tail.eq_ignore_ascii_case("bit"))
        })
        .map(|start| &base[..start]);
    let (prefix, bytes_per_unit) = if let Some(prefix) = bit_prefix {
        (prefix, 1.0 / 8.0)
    } else if let Some(prefix) = base.strip_suffix('B') {
        (prefix, 1.0)
    } else if let Some(prefix) = base.strip_suffix('b') {
        (prefix, 1.0 / 8.0)
    } else {
        return None;
    };
    let multiplier = match prefix.to_ascii_lowercase().as_str() {
        "" => 1.0,
        "k" => 1e3,
        "m" => 1e6,
        "g" => 1e9,
        "t" => 1e12,
        "ki" => 1024.0,
        "mi" => 1024.0 * 1024.0,
        "gi" => 1024.0 * 1024.0 * 1024.0,
        "ti" => 1024.0 * 1024.0 * 1024.0 * 1024.0,
        _ => return None,
    };
    Some(multiplier * bytes_per_unit)
}

/// Units per second of a latency unit, or `None` when unknown.
fn latency_unit_divisor(unit: &str) -> Option<f64> {
    match unit.to_ascii_lowercase().as_str() {
        "s" | "sec" => Some(1.0),
        "ms" => Some(1e3),
        "us" | "µs" => Some(1e6),
        "ns" => Some(1e9),
        _ => None,
    }
}

fn parse_bandwidth(part: &str) -> Result<f64, LinkSpecProblem> {
    if ["unlimited", "inf", "none"]
        .iter()
        .any(|word| part.eq_ignore_ascii_case(word))
    {
        return Ok(f64::INFINITY);
    }
    let (number, unit) = split_number(part)?;
    let factor = match bandwidth_unit_factor(unit) {
        Some(factor) => factor,
        None if latency_unit_divisor(unit).is_some() => {
            return Err(LinkSpecProblem::LatencyWhereBandwidthExpected(
                part.to_string(),
            ))
        }
        None => return Err(LinkSpecProblem::UnknownUnit(unit.to_string())),
    };
    let bytes_per_s = number * factor;
    if bytes_per_s == 0.0 {
        return Err(LinkSpecProblem::ZeroBandwidth(part.to_string()));
    }
    if !bytes_per_s.is_finite() {
        return Err(LinkSpecProblem::OutOfRange(part.to_string()));
    }
    Ok(bytes_per_s)
}

fn parse_latency(part: &str) -> Result<f64, LinkSpecProblem> {
    let (number, unit) = split_number(part)?;
    let divisor = latency_unit_divisor(unit)
        .ok_or_else(|| LinkSpecProblem::UnknownLatencyUnit(unit.to_string()))?;
    let seconds = number / divisor;
    if !seconds.is_finite() {
        return Err(LinkSpecProblem::OutOfRange(part.to_string()));
    }
    Ok(seconds)
}

impl FromStr for LinkModel {
    type Err = LinkSpecError;

    fn from_str(spec: &str) -> Result<Self, Self::Err> {
        let fail = |problem| LinkSpecError {
            spec: spec.to_string(),
            problem,
        };
        let trimmed = spec.trim();
        if trimmed.is_empty() {
            return Err(fail(LinkSpecProblem::Empty));
        }
        let parts: Vec<&str> = trimmed.split(',').map(str::trim).collect();
        let (bandwidth_part, latency_part) = match parts.as_slice() {
            [bandwidth] => (*bandwidth, None),
            [bandwidth, latency] => (*bandwidth, Some(*latency)),
            _ => return Err(fail(LinkSpecProblem::TooManyParts(parts.len()))),
        };
        let bandwidth_bytes_per_s = parse_bandwidth(bandwidth_part).map_err(fail)?;
        let latency_s = match latency_part {
            Some(part) => parse_latency(part).map_err(fail)?,
            None => 0.0,
        };
        Ok(Self {
            bandwidth_bytes_per_s,
            latency_s,
        })
    }
}

/// Writes `value` in the first unit of `units` (starting from the largest one in which
/// it is at least 1) whose decimal text, with as few significant digits as possible,
/// converts back to exactly `value` through `from_units`. Falls back to the last unit.
fn format_round_trip(
    value: f64,
    units: &[(&'static str, f64)],
    to_units: impl Fn(f64, f64) -> f64,
    from_units: impl Fn(f64, f64) -> f64,
) -> (String, &'static str) {
    let first = units
        .iter()
        .position(|&(_, scale)| to_units(value, scale) >= 1.0)
        .unwrap_or(units.len() - 1);
    for &(suffix, scale) in &units[first..] {
        let in_units = to_units(value, scale);
        for precision in 0..17 {
            // Round to `precision + 1` significant digits, then print without exponent.
            let rounded: f64 = match format!("{in_units:.precision$e}").parse() {
                Ok(rounded) => rounded,
                Err(_) => break,
            };
            if from_units(rounded, scale) == value {
                return (format!("{rounded}"), suffix);
            }
        }
    }
    let &(suffix, scale) = units.last().expect("unit table is not empty");
    (format!("{}", to_units(value, scale)), suffix)
}

impl fmt::Display for LinkModel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_unshaped() {
            return f.write_str("none");
        }
        if self.bandwidth_bytes_per_s == f64::INFINITY {
            f.write_str("unlimited")?;
        } else {
            // Bits first; bytes per second (factor 1, always exact) as the last resort.
            let mut units: Vec<(&'static str, f64)> = BIT_UNITS.to_vec();
            units.push(("B/s", 1.0));
            let (number, suffix) = format_round_trip(
                self.bandwidth_bytes_per_s,
                &units,
                |value, factor| value / factor,
                |number, factor| number * factor,
            );
            write!(f, "{number}{suffix}")?;
        }
        if self.latency_s != 0.0 {
            let mut units = LATENCY_UNITS.to_vec();
            // Seconds (divisor 1, always exact) as the last resort.
            units.push(("s", 1.0));
            let (number, suffix) = format_round_trip(
                self.latency_s,
                &units,
                |value, divisor| value * divisor,
                |number, divisor| number / divisor,
            );
            write!(f, ",{number}{suffix}")?;
        }
        Ok(())
    }
}

impl LinkModel {
    /// A link on which a ring all-reduce of `bytes` over `world` ranks takes `target_s`
    /// seconds, `latency_s` included (used by `--link auto`). Falls back to unshaped when
    /// the target is too small to hold the latency term.
    pub fn calibrated(bytes: usize, world: usize, target_s: f64, latency_s: f64) -> Self {
        let steps = 2.0 * (world.max(1) as f64 - 1.0);
        let wire = Self::ring_allreduce_bytes_per_rank(bytes, world);
        let transfer_s = target_s - steps * latency_s;
        if world <= 1 || transfer_s <= 0.0 || wire <= 0.0 {
            return Self::unshaped();
        }
        // Three significant digits (in bit/s) keep the printed spec short and re-parsable.
        let bits = wire / transfer_s * 8.0;
        let scale = 10f64.powi(bits.log10().floor() as i32 - 2);
        let bits = (bits / scale).round() * scale;
        Self {
            bandwidth_bytes_per_s: bits / 8.0,
            latency_s,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn link(bandwidth_bytes_per_s: f64, latency_s: f64) -> LinkModel {
        LinkModel {
            bandwidth_bytes_per_s,
            latency_s,
        }
    }

    #[test]
    fn parses_the_documented_specs() {
        let table: &[(&str, f64, f64)] = &[
            ("1gbit,200us", 125e6, 200e-6),
            ("100mbit,5ms", 12.5e6, 5e-3),
            ("10gbit", 1.25e9, 0.0),
            ("2.5gbps", 2.5e9 / 8.0, 0.0),
            ("2.5Gbps", 2.5e9 / 8.0, 0.0),
            ("1Gbit/s, 1s", 125e6, 1.0),
            ("1gb/s", 125e6, 0.0),
            ("100MB/s,1ms", 100e6, 1e-3),
            ("100MBps", 100e6, 0.0),
            ("64kB/s,10ns", 64e3, 10e-9),
            ("3GB/s", 3e9, 0.0),
            ("1TB/s", 1e12, 0.0),
            ("8bit", 1.0, 0.0),
            ("800kbit", 100e3, 0.0),
            ("1tbit", 125e9, 0.0),
            ("1MiB/s", 1048576.0, 0.0),
            ("2GiB/s", 2.0 * 1073741824.0, 0.0),
            ("1gbit,2µs", 125e6, 2e-6),
            ("none", f64::INFINITY, 0.0),
            ("unlimited", f64::INFINITY, 0.0),
            ("Unlimited,5ms", f64::INFINITY, 5e-3),
            (" 1gbit , 200us ", 125e6, 200e-6),
        ];
        for &(spec, bandwidth, latency) in table {
            let parsed: LinkModel = spec.parse().unwrap_or_else(|e| panic!("{spec}: {e}"));
            assert_eq!(parsed, link(bandwidth, latency), "{spec}");
        }
    }

    #[test]
    fn rejects_bad_specs_with_a_typed_reason() {
        use LinkSpecProblem as P;
        let table: &[(&str, LinkSpecProblem)] = &[
            ("", P::Empty),
            ("   ", P::Empty),
            ("1gbt", P::UnknownUnit("gbt".into())),
            ("1gbit,2ms,3", P::TooManyParts(3)),
            ("fast", P::MissingNumber("fast".into())),
            ("-1gbit", P::MissingNumber("-1gbit".into())),
            ("1.2.3gbit", P::BadNumber("1.2.3".into())),
            ("100", P::MissingUnit("100".into())),
            ("1gbit,5", P::MissingUnit("5".into())),
            ("5ms", P::LatencyWhereBandwidthExpected("5ms".into())),
            ("1gbit,5min", P::UnknownLatencyUnit("min".into())),
            ("1gbit,5mbit", P::UnknownLatencyUnit("mbit".into())),
            ("0gbit", P::ZeroBandwidth("0gbit".into())),
            ("1xB/s", P::UnknownUnit("xB/s".into())),
            ("1gbit,", P::MissingNumber("".into())),
        ];
        for (spec, problem) in table {
            let err = spec.parse::<LinkModel>().unwrap_err();
            assert_eq!(&err.problem, problem, "{spec}");
            assert_eq!(err.spec, *spec);
        }
        let big = format!("{}TB/s", "9".repeat(400));
        assert!(matches!(
            big.parse::<LinkModel>().unwrap_err().problem,
            P::OutOfRange(_)
        ));
    }

    #[test]
    fn error_message_names_spec_unit_and_example() {
        let err = "1gbt".parse::<LinkModel>().unwrap_err();
        assert_eq!(
            err.to_string(),
            "bad --link '1gbt': unknown unit 'gbt'; expected e.g. 1gbit,200us"
        );
    }

    #[test]
    fn displays_in_readable_units() {
        let table: &[(&str, &str)] = &[
            ("1gbit,200us", "1gbit,200us"),
            ("100mbit,5ms", "100mbit,5ms"),
            ("10gbit", "10gbit"),
            ("2.5gbps", "2.5gbit"),
            ("100MB/s,1ms", "800mbit,1ms"),
            ("none", "none"),
            ("unlimited,5ms", "unlimited,5ms"),
            ("1gbit,1.5s", "1gbit,1.5s"),
            ("1gbit,250ns", "1gbit,250ns"),
        ];
        for &(spec, shown) in table {
            let parsed: LinkModel = spec.parse().unwrap();
            assert_eq!(parsed.to_string(), shown, "{spec}");
        }
    }

    #[test]
    fn ring_cost_model_matches_the_formula() {
        let shaped = link(100e6, 1e-3);
        // 4 ranks, 1 MB: 6 latency steps + 1.5 MB over 100 MB/s.
        let seconds = shaped.ring_allreduce_seconds(1_000_000, 4);
        assert!((seconds - (6e-3 + 15e-3)).abs() < 1e-12, "{seconds}");
        assert_eq!(
            LinkModel::ring_allreduce_bytes_per_rank(1_000_000, 4),
            1.5e6
        );
        assert_eq!(LinkModel::ring_allreduce_bytes_per_rank(1_000, 2), 1_000.0);
        assert_eq!(LinkModel::ring_allreduce_bytes_per_rank(1_000, 1), 0.0);
        assert_eq!(shaped.ring_allreduce_seconds(1_000_000, 1), 0.0);
        assert_eq!(
            LinkModel::unshaped().ring_allreduce_seconds(1 << 30, 8),
            0.0
        );
        // Latency-only link: bandwidth term vanishes.
        let latency_only = link(f64::INFINITY, 2e-3);
        assert_eq!(latency_only.ring_allreduce_seconds(1 << 20, 3), 8e-3);
    }

    fn bandwidth_unit() -> impl Strategy<Value = (&'static str, f64)> {
        prop::sample::select(vec![
            ("bit", 0.125),
            ("kbit", 125.0),
            ("mbit", 125e3),
            ("gbit", 125e6),
            ("tbit", 125e9),
            ("gbps", 125e6),
            ("Mb/s", 125e3),
            ("B/s", 1.0),
            ("kB/s", 1e3),
            ("MB/s", 1e6),
            ("GB/s", 1e9),
            ("MiB/s", 1048576.0),
        ])
    }

    fn latency_unit() -> impl Strategy<Value = (&'static str, f64)> {
        prop::sample::select(vec![("s", 1.0), ("ms", 1e3), ("us", 1e6), ("ns", 1e9)])
    }

    proptest! {
        #[test]
        fn display_round_trips_any_model(
            bandwidth in prop_oneof![Just(f64::INFINITY), 1e-3f64..1e15],
            latency in prop_oneof![Just(0.0f64), 1e-10f64..100.0],
        ) {
            let model = link(bandwidth, latency);
            let shown = model.to_string();
            let parsed: LinkModel = shown.parse().map_err(|e| TestCaseError::fail(format!("{e}")))?;
            prop_assert_eq!(parsed, model, "shown as {}", shown);
        }

        #[test]
        fn spec_parses_to_number_times_unit_and_round_trips(
            whole in 1u32..100_000,
            tenths in 0u32..10,
            (bw_unit, bw_factor) in bandwidth_unit(),
            latency_whole in 0u32..10_000,
            (lat_unit, lat_divisor) in latency_unit(),
        ) {
            let number: f64 = format!("{whole}.{tenths}").parse().unwrap();
            let spec = format!("{whole}.{tenths}{bw_unit},{latency_whole}{lat_unit}");
            let parsed: LinkModel = spec.parse().map_err(|e| TestCaseError::fail(format!("{e}")))?;
            prop_assert_eq!(parsed.bandwidth_bytes_per_s, number * bw_factor);
            prop_assert_eq!(parsed.latency_s, f64::from(latency_whole) / lat_divisor);
            let reparsed: LinkModel = parsed.to_string().parse().unwrap();
            prop_assert_eq!(reparsed, parsed);
        }

        #[test]
        fn parsing_arbitrary_text_never_panics(spec in ".{0,24}") {
            let _ = spec.parse::<LinkModel>();
        }
    }
}
