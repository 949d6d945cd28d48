//! [`LinkSpec`]: one direction of a link, the one spec both engines read. A scenario's
//! `[links.*]`, a relay config's `up`/`down` and a cluster file's `[edges.relay]` are all this
//! type, written in this crate's vocabulary ([`Bandwidth`], [`GilbertElliottSpec`],
//! [`OutageSpec`], [`PeriodicOutageSpec`], [`TraceSpec`]).
//!
//! [`LinkSpec::checked`] validates every field (errors name the field and the bad value) and
//! converts it to integer nanoseconds ([`CheckedLink`]); each engine then adds its own rule:
//! the simulator needs a capacity (`bandwidth` or `trace`) and has no periodic outages, the
//! relay may be unlimited (no capacity: it only delays and drops). Fields one engine does not
//! model: `queue_ms`/`queue_bytes` and `jitter_reorders` shape real datagrams in the relay (the
//! simulator's sender is paced and never fills a queue, and it models messages, not datagram
//! order); `mtu` and `idle_timeout_s` are the simulator's QUIC model (the relay carries real
//! QUIC, whose endpoints have their own).

use crate::time::{NANOS_PER_MILLI, NANOS_PER_SEC};
use crate::trace::{Trace, TraceError};
use crate::vocabulary::{Bandwidth, GilbertElliottSpec, OutageSpec, PeriodicOutageSpec, TraceSpec};
use serde::{Deserialize, Serialize};
use std::path::Path;
use std::sync::Arc;
use thiserror::Error;

/// Default bound on the bandwidth queue, in milliseconds of the link's rate.
pub const DEFAULT_QUEUE_MS: f64 = 200.0;

/// One direction of a link. Every field is optional; the default is a transparent link (which
/// the simulator refuses: it needs a capacity).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LinkSpec {
    /// Constant capacity (`"20mbit"`, `10e6`, ...). With neither this nor `trace`, unlimited.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bandwidth: Option<Bandwidth>,
    /// One-way delay added to every datagram, in ms.
    #[serde(default)]
    pub latency_ms: f64,
    /// Extra delay per datagram, uniform in `[0, jitter_ms]`. Deliveries keep their order (a
    /// datagram never arrives before one offered earlier), as delay variation from queueing and
    /// radio scheduling does; see `jitter_reorders`.
    #[serde(default)]
    pub jitter_ms: f64,
    /// Let jittered datagrams overtake each other (by at most `jitter_ms`), as `netem`'s
    /// independent per-packet delays do. QUIC declares a packet lost when three later ones are
    /// acknowledged, so reordering on a fast link reads as loss. Default false.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub jitter_reorders: bool,
    /// I.i.d. drop probability in `[0, 1]`.
    #[serde(default)]
    pub loss: f64,
    /// Bursty loss (a Gilbert–Elliott chain stepped once per datagram, or once per `step_ms`), in
    /// addition to `loss`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gilbert_elliott: Option<GilbertElliottSpec>,
    /// Windows (seconds since the relay started) during which every datagram is dropped.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub outages: Vec<OutageSpec>,
    /// A repeating outage, in addition to `outages`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub periodic_outage: Option<PeriodicOutageSpec>,
    /// Trace-driven capacity (mahimahi or `time_s Mbit/s`), replayed from the relay's start.
    /// Relative paths are resolved against the config file's directory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trace: Option<TraceSpec>,
    /// Relay: bound of the bandwidth queue in ms worth of the link's rate (the trace's mean
    /// rate for a trace); a datagram that would overflow it is dropped. Absent: 200 ms
    /// ([`DEFAULT_QUEUE_MS`]) in a relay config; a scenario's link run as a relay gets
    /// [`SCENARIO_QUEUE_MS`]. Ignored when the link is unlimited or `queue_bytes` is given.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queue_ms: Option<f64>,
    /// Relay: bound of the bandwidth queue in bytes; overrides `queue_ms`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queue_bytes: Option<u64>,
    /// Simulator: largest packet payload in bytes (default 1500).
    #[serde(default = "default_mtu", skip_serializing_if = "is_default_mtu")]
    pub mtu: u32,
    /// Simulator: the connection is declared dead after this long without an acknowledgement
    /// (default 10 s, the transport's `idle_timeout`; a real run always uses the transport's).
    #[serde(
        default = "default_idle_timeout_s",
        skip_serializing_if = "is_default_idle_timeout"
    )]
    pub idle_timeout_s: f64,
}

/// The same type under the name the relay's code and docs use.
pub type RelayLinkSpec = LinkSpec;

/// Queue bound (ms of the link's rate) of a scenario's link when it runs as a relay. The
/// simulator's link is a FIFO without bound, as mahimahi's default droptail queue is, and a
/// paced QUIC sender (BBR) keeps it short; the relay's 200 ms default instead tail-dropped a
/// third of all datagrams in `fidelity-smoke`.
pub const SCENARIO_QUEUE_MS: f64 = 10_000.0;

fn default_mtu() -> u32 {
    1500
}

/// The transport's idle timeout (`transport::config::TransportConfig::default`).
fn default_idle_timeout_s() -> f64 {
    10.0
}

fn is_default_mtu(mtu: &u32) -> bool {
    *mtu == default_mtu()
}

fn is_default_idle_timeout(t: &f64) -> bool {
    *t == default_idle_timeout_s()
}

impl Default for LinkSpec {
    fn default() -> LinkSpec {
        LinkSpec {
            bandwidth: None,
            latency_ms: 0.0,
            jitter_ms: 0.0,
            jitter_reorders: false,
            loss: 0.0,
            gilbert_elliott: None,
            outages: Vec::new(),
            periodic_outage: None,
            trace: None,
            queue_ms: None,
            queue_bytes: None,
            mtu: default_mtu(),
            idle_timeout_s: default_idle_timeout_s(),
        }
    }
}

/// A [`LinkSpec`] field with a bad value.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("{field} {problem}")]
pub struct LinkSpecError {
    /// The field, e.g. `loss` or `outages[1].duration_s`.
    pub field: String,
    /// What is wrong, e.g. `must be in [0,1], got 1.5`.
    pub problem: String,
}

/// The same type under the name the relay's code uses.
pub type RelaySpecError = LinkSpecError;

fn spec_error<T>(field: impl Into<String>, problem: String) -> Result<T, LinkSpecError> {
    Err(LinkSpecError {
        field: field.into(),
        problem,
    })
}

/// Where a direction's capacity comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CapacitySource {
    /// No serialization delay and no queue.
    Unlimited,
    /// A constant rate.
    Constant {
        /// Bits per second.
        bits_per_sec: u64,
    },
    /// A replayed trace.
    Trace,
}

/// A validated [`LinkSpec`] in integer nanoseconds.
#[derive(Clone, Debug, PartialEq)]
pub struct CheckedLink {
    /// One-way delay.
    pub latency_ns: u64,
    /// Upper bound of the extra per-datagram (per-packet) delay.
    pub jitter_ns: u64,
    /// I.i.d. drop probability.
    pub loss: f64,
    /// Sorted, merged, half-open `[start, end)` windows in ns.
    pub outages: Vec<(u64, u64)>,
    /// `(offset, period, duration)` in ns.
    pub periodic_outage: Option<(u64, u64, u64)>,
    /// Where the capacity comes from.
    pub capacity: CapacitySource,
    /// Simulator: largest packet payload, bytes.
    pub mtu: u32,
    /// Simulator: QUIC idle timeout, ns.
    pub idle_timeout_ns: u64,
}

fn nanos(field: &str, value: f64, scale: u64) -> Result<u64, LinkSpecError> {
    let ns = value * scale as f64;
    if !value.is_finite() || value < 0.0 || ns >= u64::MAX as f64 / 2.0 {
        return spec_error(field, format!("must be finite and >= 0, got {value}"));
    }
    Ok(ns.round() as u64)
}

fn positive_nanos(field: &str, value: f64, scale: u64) -> Result<u64, LinkSpecError> {
    match nanos(field, value, scale) {
        Ok(0) | Err(_) => spec_error(field, format!("must be finite and > 0, got {value}")),
        Ok(ns) => Ok(ns),
    }
}

fn probability(field: &str, p: f64) -> Result<f64, LinkSpecError> {
    if (0.0..=1.0).contains(&p) {
        Ok(p)
    } else {
        spec_error(field, format!("must be in [0,1], got {p}"))
    }
}

impl LinkSpec {
    /// A lossless link of constant `bandwidth` and one-way `latency_ms`, everything else default.
    pub fn constant(bandwidth: Bandwidth, latency_ms: f64) -> LinkSpec {
        LinkSpec {
            bandwidth: Some(bandwidth),
            latency_ms,
            ..LinkSpec::default()
        }
    }

    /// Checks every field as a relay reads it (a link without capacity is allowed); the error
    /// names the field and the bad value.
    pub fn validate(&self) -> Result<(), LinkSpecError> {
        self.checked().map(|_| ())
    }

    /// The relay's queue bound in ms of the link's rate.
    pub fn queue_ms_or_default(&self) -> f64 {
        self.queue_ms.unwrap_or(DEFAULT_QUEUE_MS)
    }

    /// Validates every field and converts it to integer nanoseconds.
    pub fn checked(&self) -> Result<CheckedLink, LinkSpecError> {
        let capacity = match (&self.bandwidth, &self.trace) {
            (Some(_), Some(_)) => {
                return spec_error(
                    "bandwidth",
                    "and `trace` are exclusive: give one of them".into(),
                )
            }
            (Some(b), None) if b.bits_per_sec() == 0 => {
                return spec_error("bandwidth", "must be positive, got 0".into())
            }
            (Some(b), None) => CapacitySource::Constant {
                bits_per_sec: b.bits_per_sec(),
            },
            (None, Some(_)) => CapacitySource::Trace,
            (None, None) => CapacitySource::Unlimited,
        };
        let latency_ns = nanos("latency_ms", self.latency_ms, NANOS_PER_MILLI)?;
        let jitter_ns = nanos("jitter_ms", self.jitter_ms, NANOS_PER_MILLI)?;
        let loss = probability("loss", self.loss)?;
        if let Some(ge) = &self.gilbert_elliott {
            probability("gilbert_elliott.p_good_to_bad", ge.p_good_to_bad)?;
            probability("gilbert_elliott.p_bad_to_good", ge.p_bad_to_good)?;
            probability("gilbert_elliott.loss_good", ge.loss_good)?;
            probability("gilbert_elliott.loss_bad", ge.loss_bad)?;
            if let Some(step_ms) = ge.step_ms {
                positive_nanos("gilbert_elliott.step_ms", step_ms, NANOS_PER_MILLI)?;
            }
        }
        let mut windows = Vec::with_capacity(self.outages.len());
        for (i, outage) in self.outages.iter().enumerate() {
            let start = nanos(
                &format!("outages[{i}].start_s"),
                outage.start_s,
                NANOS_PER_SEC,
            )?;
            let length = positive_nanos(
                &format!("outages[{i}].duration_s"),
                outage.duration_s,
                NANOS_PER_SEC,
            )?;
            windows.push((start, start.saturating_add(length)));
        }
        windows.sort_unstable();
        let mut outages: Vec<(u64, u64)> = Vec::with_capacity(windows.len());
        for (start, end) in windows {
            match outages.last_mut() {
                Some(last) if start <= last.1 => last.1 = last.1.max(end),
                _ => outages.push((start, end)),
            }
        }
        let periodic_outage = match &self.periodic_outage {
            None => None,
            Some(p) => {
                let period = positive_nanos("periodic_outage.period_s", p.period_s, NANOS_PER_SEC)?;
                let duration =
                    positive_nanos("periodic_outage.duration_s", p.duration_s, NANOS_PER_SEC)?;
                let offset = nanos("periodic_outage.offset_s", p.offset_s, NANOS_PER_SEC)?;
                if duration >= period {
                    return spec_error(
                        "periodic_outage.duration_s",
                        format!(
                            "must be less than period_s ({}), got {}",
                            p.period_s, p.duration_s
                        ),
                    );
                }
                Some((offset, period, duration))
            }
        };
        if let Some(q) = self.queue_ms {
            positive_nanos("queue_ms", q, NANOS_PER_MILLI)?;
        }
        if self.queue_bytes == Some(0) {
            return spec_error("queue_bytes", "must be > 0, got 0".into());
        }
        if self.mtu == 0 || self.mtu > 65_535 {
            return spec_error(
                "mtu",
                format!("must be in 1..=65535 bytes, got {}", self.mtu),
            );
        }
        let idle_timeout_ns = positive_nanos("idle_timeout_s", self.idle_timeout_s, NANOS_PER_SEC)?;
        Ok(CheckedLink {
            latency_ns,
            jitter_ns,
            loss,
            outages,
            periodic_outage,
            capacity,
            mtu: self.mtu,
            idle_timeout_ns,
        })
    }

    /// Loads the trace the spec names (its path as written, so resolve it first), if any.
    pub fn load_trace(&self) -> Result<Option<Arc<Trace>>, TraceError> {
        self.trace
            .as_ref()
            .map(|t| Trace::load(&t.path, t.format, t.looped).map(Arc::new))
            .transpose()
    }

    /// Makes a relative trace path relative to `base_dir` instead of the working directory.
    pub fn resolve_paths(&mut self, base_dir: &Path) {
        if let Some(trace) = &mut self.trace {
            if trace.path.is_relative() {
                trace.path = base_dir.join(&trace.path);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn error_of(toml_text: &str) -> String {
        let spec: RelayLinkSpec = toml::from_str(toml_text).unwrap();
        spec.validate().unwrap_err().to_string()
    }

    #[test]
    fn defaults_are_a_transparent_link() {
        let spec: RelayLinkSpec = toml::from_str("").unwrap();
        assert_eq!(spec, RelayLinkSpec::default());
        let params = spec.checked().unwrap();
        assert!(matches!(params.capacity, CapacitySource::Unlimited));
        assert_eq!((params.latency_ns, params.jitter_ns), (0, 0));
    }

    #[test]
    fn parses_simulator_vocabulary() {
        let spec: RelayLinkSpec = toml::from_str(
            r#"
bandwidth = "20mbit"
latency_ms = 25
jitter_ms = 2.5
loss = 0.01
gilbert_elliott = { p_good_to_bad = 0.01, p_bad_to_good = 0.25 }
outages = [{ start_s = 3, duration_s = 1 }, { start_s = 3.5, duration_s = 2 }]
periodic_outage = { period_s = 10, duration_s = 0.5, offset_s = 1 }
queue_ms = 50
"#,
        )
        .unwrap();
        assert_eq!(spec.bandwidth, Some(Bandwidth::from_mbit(20)));
        let params = spec.checked().unwrap();
        assert_eq!(params.latency_ns, 25_000_000);
        assert_eq!(params.jitter_ns, 2_500_000);
        assert_eq!(params.outages, vec![(3_000_000_000, 5_500_000_000)]);
        assert_eq!(
            params.periodic_outage,
            Some((1_000_000_000, 10_000_000_000, 500_000_000))
        );
        assert_eq!(spec.gilbert_elliott.unwrap().loss_bad, 1.0);
    }

    #[test]
    fn bad_values_name_the_field() {
        assert_eq!(error_of("loss = 1.5"), "loss must be in [0,1], got 1.5");
        assert_eq!(
            error_of("latency_ms = -1"),
            "latency_ms must be finite and >= 0, got -1"
        );
        assert_eq!(
            error_of("outages = [{ start_s = 1, duration_s = 0 }]"),
            "outages[0].duration_s must be finite and > 0, got 0"
        );
        assert_eq!(
            error_of("periodic_outage = { period_s = 1, duration_s = 2 }"),
            "periodic_outage.duration_s must be less than period_s (1), got 2"
        );
        assert_eq!(
            error_of("gilbert_elliott = { p_good_to_bad = 2, p_bad_to_good = 0.1 }"),
            "gilbert_elliott.p_good_to_bad must be in [0,1], got 2"
        );
        assert_eq!(
            error_of("gilbert_elliott = { p_good_to_bad = 0.1, p_bad_to_good = 0.1, step_ms = 0 }"),
            "gilbert_elliott.step_ms must be finite and > 0, got 0"
        );
        assert!(
            error_of("bandwidth = \"1mbit\"\ntrace = { path = \"x\", format = \"mahimahi\" }")
                .starts_with("bandwidth and `trace` are exclusive")
        );
        assert_eq!(
            error_of("queue_bytes = 0"),
            "queue_bytes must be > 0, got 0"
        );
        let err = toml::from_str::<RelayLinkSpec>("latncy_ms = 3").unwrap_err();
        assert!(
            err.to_string().contains("unknown field `latncy_ms`"),
            "{err}"
        );
    }

    #[test]
    fn relative_traces_resolve_against_the_config_folder() {
        let mut traced: RelayLinkSpec =
            toml::from_str("trace = { path = \"t/a.up\", format = \"mahimahi\" }").unwrap();
        traced.resolve_paths(Path::new("/etc/relay"));
        assert_eq!(
            traced.trace.as_ref().unwrap().path,
            Path::new("/etc/relay/t/a.up")
        );
        traced.resolve_paths(Path::new("/elsewhere"));
        assert_eq!(
            traced.trace.unwrap().path,
            Path::new("/etc/relay/t/a.up"),
            "absolute paths are kept"
        );
    }
}
