//! The link vocabulary both the simulator and the relay speak: capacities ([`Bandwidth`]),
//! bursty loss ([`GilbertElliottSpec`] and its chain [`GilbertElliott`]), outage windows
//! ([`OutageSpec`], [`PeriodicOutageSpec`]) and capacity traces ([`TraceSpec`]).

use crate::rng::SimRng;
use crate::trace::TraceFormat;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;
use thiserror::Error;

fn default_true() -> bool {
    true
}

/// A link capacity in bits per second. In TOML: a number of bits/s (`100e6`) or a string with a
/// unit (`"100mbit"`, `"1.5 Gbit/s"`, `"500kbps"`; units bit, kbit, mbit, gbit, tbit and their
/// `bps` spellings, case-insensitive, optional `/s`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Bandwidth {
    bits_per_sec: u64,
}

/// A bandwidth string or number that could not be understood.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("invalid bandwidth `{input}`: {reason}")]
pub struct BandwidthParseError {
    /// The text as given.
    pub input: String,
    /// What is wrong with it.
    pub reason: String,
}

impl Bandwidth {
    /// A bandwidth of `bits_per_sec` (must be positive to be valid in a [`LinkSpec`]).
    pub const fn from_bits_per_sec(bits_per_sec: u64) -> Bandwidth {
        Bandwidth { bits_per_sec }
    }

    /// A bandwidth of `mbit` megabits (10^6 bits) per second.
    pub const fn from_mbit(mbit: u64) -> Bandwidth {
        Bandwidth {
            bits_per_sec: mbit.saturating_mul(1_000_000),
        }
    }

    /// Bits per second.
    pub const fn bits_per_sec(self) -> u64 {
        self.bits_per_sec
    }

    fn from_f64(value: f64, input: &str) -> Result<Bandwidth, BandwidthParseError> {
        if !value.is_finite() || value <= 0.0 {
            return Err(BandwidthParseError {
                input: input.to_string(),
                reason: "must be a positive, finite number of bits per second".into(),
            });
        }
        let rounded = value.round();
        if rounded < 1.0 || rounded >= u64::MAX as f64 {
            return Err(BandwidthParseError {
                input: input.to_string(),
                reason: "out of range (1 bit/s ..= 1.8e19 bit/s)".into(),
            });
        }
        Ok(Bandwidth {
            bits_per_sec: rounded as u64,
        })
    }
}

impl FromStr for Bandwidth {
    type Err = BandwidthParseError;

    fn from_str(input: &str) -> Result<Bandwidth, BandwidthParseError> {
        let lower = input.trim().to_ascii_lowercase();
        let text = lower.strip_suffix("/s").unwrap_or(&lower);
        let split = text
            .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '_'))
            .unwrap_or(text.len());
        let (number, unit) = text.split_at(split);
        let number = number.replace('_', "");
        let value: f64 = number.parse().map_err(|_| BandwidthParseError {
            input: input.to_string(),
            reason: "expected a number followed by a unit such as `100mbit`".into(),
        })?;
        let scale = match unit.trim() {
            "" | "bit" | "bps" => 1.0,
            "kbit" | "kbps" => 1e3,
            "mbit" | "mbps" => 1e6,
            "gbit" | "gbps" => 1e9,
            "tbit" | "tbps" => 1e12,
            other => {
                return Err(BandwidthParseError {
                    input: input.to_string(),
                    reason: format!(
                    "unknown unit `{other}` (use bit, kbit, mbit, gbit, tbit or kbps, mbps, ...)"
                ),
                })
            }
        };
        Bandwidth::from_f64(value * scale, input)
    }
}

impl fmt::Display for Bandwidth {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let b = self.bits_per_sec as f64;
        if b >= 1e9 {
            write!(f, "{}gbit", b / 1e9)
        } else if b >= 1e6 {
            write!(f, "{}mbit", b / 1e6)
        } else if b >= 1e3 {
            write!(f, "{}kbit", b / 1e3)
        } else {
            write!(f, "{}bit", b)
        }
    }
}

impl Serialize for Bandwidth {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_u64(self.bits_per_sec)
    }
}

impl<'de> Deserialize<'de> for Bandwidth {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Bandwidth, D::Error> {
        struct BandwidthVisitor;
        impl serde::de::Visitor<'_> for BandwidthVisitor {
            type Value = Bandwidth;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a bandwidth: bits per second, or a string like \"100mbit\"")
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<Bandwidth, E> {
                Bandwidth::from_f64(v as f64, &v.to_string()).map_err(E::custom)
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<Bandwidth, E> {
                Bandwidth::from_f64(v as f64, &v.to_string()).map_err(E::custom)
            }
            fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<Bandwidth, E> {
                Bandwidth::from_f64(v, &v.to_string()).map_err(E::custom)
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Bandwidth, E> {
                v.parse().map_err(E::custom)
            }
        }
        deserializer.deserialize_any(BandwidthVisitor)
    }
}

/// Gilbert–Elliott bursty loss: a two-state Markov chain (good/bad) stepped once per packet, or
/// once per `step_ms` of elapsed time when that is set.
///
/// Per packet, a burst lasts a number of *packets*: a sender that slows down in a burst (QUIC
/// waiting for its probe timeout, or the ack direction, which sends a packet per few received)
/// stretches the burst in time, to tens of seconds on a link that loses 95 % in the bad state.
/// A radio channel fades for a time whatever the sender does, so `step_ms` is the model for
/// cellular bursts: the chain is a function of time alone.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GilbertElliottSpec {
    /// Probability of moving from good to bad, per step (a packet, or `step_ms`).
    pub p_good_to_bad: f64,
    /// Probability of moving from bad to good, per step (a packet, or `step_ms`).
    pub p_bad_to_good: f64,
    /// Loss probability in the good state.
    #[serde(default)]
    pub loss_good: f64,
    /// Loss probability in the bad state.
    #[serde(default = "default_loss_bad")]
    pub loss_bad: f64,
    /// When set, the chain steps once per this many milliseconds of elapsed time (counted from
    /// the link's start) instead of once per packet.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step_ms: Option<f64>,
}

fn default_loss_bad() -> f64 {
    1.0
}

impl GilbertElliottSpec {
    /// Long-run fraction of packets in the bad state: `p_gb / (p_gb + p_bg)` (0 if both are 0,
    /// since the chain starts and stays good).
    pub fn stationary_bad(&self) -> f64 {
        let sum = self.p_good_to_bad + self.p_bad_to_good;
        if sum <= 0.0 {
            0.0
        } else {
            self.p_good_to_bad / sum
        }
    }

    /// Long-run loss rate: `π_good · loss_good + π_bad · loss_bad`.
    pub fn stationary_loss(&self) -> f64 {
        let bad = self.stationary_bad();
        (1.0 - bad) * self.loss_good + bad * self.loss_bad
    }
}

/// The state of a Gilbert–Elliott chain.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GilbertElliott {
    spec: GilbertElliottSpec,
    in_bad_state: bool,
    /// With `step_ms`: the time (ns since the link's start) up to which the chain has stepped.
    stepped_until_ns: u64,
}

impl GilbertElliott {
    /// A chain in the good state.
    pub fn new(spec: GilbertElliottSpec) -> GilbertElliott {
        GilbertElliott {
            spec,
            in_bad_state: false,
            stepped_until_ns: 0,
        }
    }

    /// Decides whether a packet sent at `now_ns` (ns since the link's start) is lost: the chain
    /// steps once for the packet, or, with `step_ms`, for every whole step elapsed since the last
    /// packet (in closed form, one draw however many steps).
    pub fn packet_lost_at(&mut self, now_ns: u64, rng: &mut SimRng) -> bool {
        let Some(step_ms) = self.spec.step_ms else {
            return self.next_packet_lost(rng);
        };
        let step_ns = (step_ms * 1e6).max(1.0) as u64;
        let steps = now_ns.saturating_sub(self.stepped_until_ns) / step_ns;
        self.stepped_until_ns = self
            .stepped_until_ns
            .saturating_add(steps.saturating_mul(step_ns));
        self.in_bad_state = rng.bernoulli(self.bad_after(steps));
        self.draw_loss(rng)
    }

    /// Probability that the chain is bad `steps` steps from now, given its state now:
    /// `π + (1{bad} − π)·λ^steps` with `π` the stationary bad fraction and `λ = 1 − p_gb − p_bg`.
    fn bad_after(&self, steps: u64) -> f64 {
        let pi = self.spec.stationary_bad();
        let lambda = 1.0 - self.spec.p_good_to_bad - self.spec.p_bad_to_good;
        let magnitude = lambda.abs().powf(steps as f64);
        let lambda_pow = if lambda < 0.0 && steps % 2 == 1 {
            -magnitude
        } else {
            magnitude
        };
        let now = if self.in_bad_state { 1.0 } else { 0.0 };
        (pi + (now - pi) * lambda_pow).clamp(0.0, 1.0)
    }

    fn draw_loss(&self, rng: &mut SimRng) -> bool {
        let loss = if self.in_bad_state {
            self.spec.loss_bad
        } else {
            self.spec.loss_good
        };
        rng.bernoulli(loss)
    }

    /// Whether the chain is in the bad state.
    pub fn is_bad(&self) -> bool {
        self.in_bad_state
    }

    /// Steps the chain for one packet, then decides whether that packet is lost.
    pub fn next_packet_lost(&mut self, rng: &mut SimRng) -> bool {
        let switch = if self.in_bad_state {
            self.spec.p_bad_to_good
        } else {
            self.spec.p_good_to_bad
        };
        if rng.bernoulli(switch) {
            self.in_bad_state = !self.in_bad_state;
        }
        self.draw_loss(rng)
    }
}

/// A period during which the link delivers nothing.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OutageSpec {
    /// Start, in seconds of virtual time.
    pub start_s: f64,
    /// Length in seconds.
    pub duration_s: f64,
}

/// A capacity trace for a link.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TraceSpec {
    /// The trace file; relative paths are resolved against the scenario file's directory.
    pub path: PathBuf,
    /// `"mahimahi"` or `"mbps"`.
    pub format: TraceFormat,
    /// Whether to replay the trace in a loop (default `true`, like `mm-link`); without a loop the
    /// link has no capacity after the trace ends.
    #[serde(rename = "loop", default = "default_true")]
    pub looped: bool,
}

/// A repeating outage: the link is down during `[offset_s + k·period_s, offset_s + k·period_s +
/// duration_s)` for every `k ≥ 0` (seconds since the relay started).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PeriodicOutageSpec {
    /// Time between the starts of two outages, in seconds.
    pub period_s: f64,
    /// Length of each outage in seconds (less than `period_s`).
    pub duration_s: f64,
    /// Start of the first outage, in seconds since the relay started (default 0).
    #[serde(default)]
    pub offset_s: f64,
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const BURSTY: GilbertElliottSpec = GilbertElliottSpec {
        p_good_to_bad: 0.002,
        p_bad_to_good: 0.005,
        loss_good: 0.0,
        loss_bad: 0.95,
        step_ms: Some(10.0),
    };

    /// Fraction of time in the bad state and mean bad-burst length in seconds, sampling the chain
    /// with one packet every `gap_ms` for `seconds`.
    fn sample(gap_ms: u64, seconds: u64, seed: u64) -> (f64, f64) {
        let mut chain = GilbertElliott::new(BURSTY);
        let mut rng = SimRng::new(seed);
        let (mut bad, mut samples, mut bursts) = (0u64, 0u64, 0u64);
        let mut was_bad = false;
        for i in 0..seconds * 1000 / gap_ms {
            chain.packet_lost_at(i * gap_ms * 1_000_000, &mut rng);
            samples += 1;
            if chain.is_bad() {
                bad += 1;
                bursts += u64::from(!was_bad);
            }
            was_bad = chain.is_bad();
        }
        let bad_s = bad as f64 * gap_ms as f64 / 1e3;
        (bad as f64 / samples as f64, bad_s / bursts.max(1) as f64)
    }

    #[test]
    fn a_time_stepped_burst_lasts_the_same_time_whatever_the_packet_rate() {
        // 10 ms steps, p_bg = 0.005: a bad burst lasts 2 s on average, π_bad = 2/7.
        let stationary = BURSTY.stationary_bad();
        for gap_ms in [1, 25, 200] {
            let (bad_fraction, burst_s) = sample(gap_ms, 40_000, gap_ms);
            eprintln!("one packet per {gap_ms} ms: bad {bad_fraction:.3}, burst {burst_s:.2} s");
            assert!((bad_fraction - stationary).abs() < 0.03, "{bad_fraction}");
            // Sparse sampling misses short bursts and rounds up to whole gaps: allow for it.
            let tolerance = 0.25 + gap_ms as f64 / 1e3;
            assert!(
                (burst_s - 2.0).abs() < tolerance,
                "{gap_ms} ms: {burst_s} s"
            );
        }
    }

    #[test]
    fn per_packet_stepping_is_unchanged_without_step_ms() {
        let spec = GilbertElliottSpec {
            step_ms: None,
            ..BURSTY
        };
        let (mut by_time, mut by_packet) = (GilbertElliott::new(spec), GilbertElliott::new(spec));
        let (mut rng_a, mut rng_b) = (SimRng::new(3), SimRng::new(3));
        for i in 0..10_000u64 {
            // Time is ignored: one step per packet, however far apart.
            let a = by_time.packet_lost_at(i * i * 1_000_000_000, &mut rng_a);
            let b = by_packet.next_packet_lost(&mut rng_b);
            assert_eq!(a, b);
        }
    }

    proptest! {
        /// The closed form equals stepping the two-state distribution one step at a time.
        #[test]
        fn bad_after_matches_iterated_steps(
            p_gb in 0.0f64..=1.0,
            p_bg in 0.0f64..=1.0,
            steps in 0u64..200,
            bad in any::<bool>(),
        ) {
            let spec = GilbertElliottSpec { p_good_to_bad: p_gb, p_bad_to_good: p_bg, ..BURSTY };
            let chain = GilbertElliott { spec, in_bad_state: bad, stepped_until_ns: 0 };
            let mut p_bad = if bad { 1.0 } else { 0.0 };
            for _ in 0..steps {
                p_bad = p_bad * (1.0 - p_bg) + (1.0 - p_bad) * p_gb;
            }
            prop_assert!((chain.bad_after(steps) - p_bad).abs() < 1e-9);
        }
    }
}
