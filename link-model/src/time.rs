//! Virtual time: integer nanoseconds since the start of a simulation.
//!
//! [`SimTime`] is an instant, [`SimDuration`] a span. Both are plain `u64` nanosecond counts so that
//! arithmetic is exact and reproducible on every platform (no floating point accumulates in the
//! clock). Conversions from seconds given as `f64` (scenario files) are checked: they return `None`
//! for negative, non-finite or out-of-range values instead of panicking.

use serde::{Deserialize, Serialize};
use std::fmt;
use std::ops::{Add, AddAssign, Mul, Sub};

/// Nanoseconds per second.
pub const NANOS_PER_SEC: u64 = 1_000_000_000;
/// Nanoseconds per millisecond.
pub const NANOS_PER_MILLI: u64 = 1_000_000;

/// An instant in virtual time, in nanoseconds since the simulation started.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
#[serde(transparent)]
pub struct SimTime(pub u64);

/// A span of virtual time in nanoseconds.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
#[serde(transparent)]
pub struct SimDuration(pub u64);

/// Converts seconds to nanoseconds, rounding to the nearest nanosecond; `None` when `secs` is
/// negative, NaN, infinite or does not fit in a `u64` of nanoseconds (~584 years).
fn secs_f64_to_nanos(secs: f64) -> Option<u64> {
    if !secs.is_finite() || secs < 0.0 {
        return None;
    }
    let nanos = (secs * NANOS_PER_SEC as f64).round();
    if nanos >= u64::MAX as f64 {
        return None;
    }
    Some(nanos as u64)
}

impl SimTime {
    /// The start of every simulation.
    pub const ZERO: SimTime = SimTime(0);
    /// The largest representable instant ("never").
    pub const MAX: SimTime = SimTime(u64::MAX);

    /// An instant `nanos` nanoseconds after the start.
    pub const fn from_nanos(nanos: u64) -> SimTime {
        SimTime(nanos)
    }

    /// An instant `ms` milliseconds after the start (saturating).
    pub const fn from_millis(ms: u64) -> SimTime {
        SimTime(ms.saturating_mul(NANOS_PER_MILLI))
    }

    /// An instant `s` whole seconds after the start (saturating).
    pub const fn from_secs(s: u64) -> SimTime {
        SimTime(s.saturating_mul(NANOS_PER_SEC))
    }

    /// An instant given in (fractional) seconds; `None` if negative, not finite or too large.
    pub fn try_from_secs_f64(secs: f64) -> Option<SimTime> {
        secs_f64_to_nanos(secs).map(SimTime)
    }

    /// Nanoseconds since the start.
    pub const fn as_nanos(self) -> u64 {
        self.0
    }

    /// Seconds since the start, as `f64` (for reports; never fed back into the clock).
    pub fn as_secs_f64(self) -> f64 {
        self.0 as f64 / NANOS_PER_SEC as f64
    }

    /// Milliseconds since the start, as `f64` (for reports).
    pub fn as_millis_f64(self) -> f64 {
        self.0 as f64 / NANOS_PER_MILLI as f64
    }

    /// The span from `earlier` to `self`, zero if `earlier` is later.
    pub const fn saturating_since(self, earlier: SimTime) -> SimDuration {
        SimDuration(self.0.saturating_sub(earlier.0))
    }

    /// `self + d`, saturating at [`SimTime::MAX`].
    pub const fn saturating_add(self, d: SimDuration) -> SimTime {
        SimTime(self.0.saturating_add(d.0))
    }

    /// `self + d`, or `None` on overflow.
    pub const fn checked_add(self, d: SimDuration) -> Option<SimTime> {
        match self.0.checked_add(d.0) {
            Some(v) => Some(SimTime(v)),
            None => None,
        }
    }
}

impl SimDuration {
    /// No time at all.
    pub const ZERO: SimDuration = SimDuration(0);
    /// The largest representable span.
    pub const MAX: SimDuration = SimDuration(u64::MAX);

    /// A span of `nanos` nanoseconds.
    pub const fn from_nanos(nanos: u64) -> SimDuration {
        SimDuration(nanos)
    }

    /// A span of `us` microseconds (saturating).
    pub const fn from_micros(us: u64) -> SimDuration {
        SimDuration(us.saturating_mul(1_000))
    }

    /// A span of `ms` milliseconds (saturating).
    pub const fn from_millis(ms: u64) -> SimDuration {
        SimDuration(ms.saturating_mul(NANOS_PER_MILLI))
    }

    /// A span of `s` whole seconds (saturating).
    pub const fn from_secs(s: u64) -> SimDuration {
        SimDuration(s.saturating_mul(NANOS_PER_SEC))
    }

    /// A span given in (fractional) seconds; `None` if negative, not finite or too large.
    pub fn try_from_secs_f64(secs: f64) -> Option<SimDuration> {
        secs_f64_to_nanos(secs).map(SimDuration)
    }

    /// A span given in (fractional) milliseconds; `None` if negative, not finite or too large.
    pub fn try_from_millis_f64(ms: f64) -> Option<SimDuration> {
        secs_f64_to_nanos(ms / 1e3).map(SimDuration)
    }

    /// Length in nanoseconds.
    pub const fn as_nanos(self) -> u64 {
        self.0
    }

    /// Length in seconds, as `f64` (for reports).
    pub fn as_secs_f64(self) -> f64 {
        self.0 as f64 / NANOS_PER_SEC as f64
    }

    /// Length in milliseconds, as `f64` (for reports).
    pub fn as_millis_f64(self) -> f64 {
        self.0 as f64 / NANOS_PER_MILLI as f64
    }

    /// `self * factor`, saturating at [`SimDuration::MAX`].
    pub const fn saturating_mul(self, factor: u64) -> SimDuration {
        SimDuration(self.0.saturating_mul(factor))
    }

    /// `self + other`, saturating at [`SimDuration::MAX`].
    pub const fn saturating_add(self, other: SimDuration) -> SimDuration {
        SimDuration(self.0.saturating_add(other.0))
    }
}

impl Add<SimDuration> for SimTime {
    type Output = SimTime;
    /// Saturating: adding to an instant near [`SimTime::MAX`] stays at `MAX` ("never").
    fn add(self, rhs: SimDuration) -> SimTime {
        self.saturating_add(rhs)
    }
}

impl AddAssign<SimDuration> for SimTime {
    fn add_assign(&mut self, rhs: SimDuration) {
        *self = *self + rhs;
    }
}

impl Sub<SimTime> for SimTime {
    type Output = SimDuration;
    /// Saturating: an earlier minus a later instant is zero.
    fn sub(self, rhs: SimTime) -> SimDuration {
        self.saturating_since(rhs)
    }
}

impl Add for SimDuration {
    type Output = SimDuration;
    fn add(self, rhs: SimDuration) -> SimDuration {
        self.saturating_add(rhs)
    }
}

impl Mul<u64> for SimDuration {
    type Output = SimDuration;
    fn mul(self, rhs: u64) -> SimDuration {
        self.saturating_mul(rhs)
    }
}

impl fmt::Display for SimTime {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}.{:09}s",
            self.0 / NANOS_PER_SEC,
            self.0 % NANOS_PER_SEC
        )
    }
}

impl fmt::Display for SimDuration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}.{:09}s",
            self.0 / NANOS_PER_SEC,
            self.0 % NANOS_PER_SEC
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conversions_are_exact_for_integers() {
        assert_eq!(SimTime::from_millis(1500).as_nanos(), 1_500_000_000);
        assert_eq!(SimTime::from_secs(2), SimTime(2 * NANOS_PER_SEC));
        assert_eq!(SimDuration::from_micros(3).as_nanos(), 3_000);
        assert_eq!(
            SimDuration::try_from_secs_f64(0.25),
            Some(SimDuration(250_000_000))
        );
        assert_eq!(
            SimDuration::try_from_millis_f64(1.5),
            Some(SimDuration(1_500_000))
        );
    }

    #[test]
    fn bad_float_seconds_are_rejected() {
        assert_eq!(SimTime::try_from_secs_f64(-1.0), None);
        assert_eq!(SimTime::try_from_secs_f64(f64::NAN), None);
        assert_eq!(SimDuration::try_from_secs_f64(f64::INFINITY), None);
        assert_eq!(SimDuration::try_from_secs_f64(1e30), None);
    }

    #[test]
    fn arithmetic_saturates() {
        let t = SimTime::from_millis(10);
        assert_eq!(t + SimDuration::from_millis(5), SimTime::from_millis(15));
        assert_eq!(SimTime::MAX + SimDuration::from_secs(1), SimTime::MAX);
        assert_eq!(SimTime::from_millis(3) - t, SimDuration::ZERO);
        assert_eq!(t - SimTime::from_millis(4), SimDuration::from_millis(6));
        assert_eq!(
            SimDuration::from_millis(3) * 4,
            SimDuration::from_millis(12)
        );
    }

    #[test]
    fn display_has_nanosecond_precision() {
        assert_eq!(SimTime(1_000_000_001).to_string(), "1.000000001s");
        assert_eq!(SimDuration::from_millis(90).to_string(), "0.090000000s");
    }
}
