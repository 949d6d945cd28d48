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

/// Gilbert–Elliott bursty loss: a two-state Markov chain (good/bad) stepped once per packet.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GilbertElliottSpec {
    /// Probability of moving from good to bad, per packet.
    pub p_good_to_bad: f64,
    /// Probability of moving from bad to good, per packet.
    pub p_bad_to_good: f64,
    /// Loss probability in the good state.
    #[serde(default)]
    pub loss_good: f64,
    /// Loss probability in the bad state.
    #[serde(default = "default_loss_bad")]
    pub loss_bad: f64,
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
}

impl GilbertElliott {
    /// A chain in the good state.
    pub fn new(spec: GilbertElliottSpec) -> GilbertElliott {
        GilbertElliott {
            spec,
            in_bad_state: false,
        }
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
        let loss = if self.in_bad_state {
            self.spec.loss_bad
        } else {
            self.spec.loss_good
        };
        rng.bernoulli(loss)
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
