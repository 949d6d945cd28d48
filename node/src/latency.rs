//! A latency histogram with logarithmic buckets ([`LatencyHistogram`]): what a node records of
//! its delta→ack times and the `cluster` launcher merges across processes to report p50/p99.
//! Buckets grow by 5 % from 0.1 ms, so a quantile read off it is within 5 % of the exact one;
//! it serializes as its non-empty buckets only.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// The lower bound of bucket 0, milliseconds (anything faster lands in bucket 0).
const FIRST_MS: f64 = 0.1;
/// Growth factor between bucket bounds.
const GROWTH: f64 = 1.05;
/// The last bucket (≈ 4.6 hours); anything slower lands there.
const LAST_BUCKET: u32 = 520;

/// Counts of latencies by logarithmic bucket (see the module docs).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LatencyHistogram {
    /// Non-empty buckets: bucket index → count.
    buckets: BTreeMap<u32, u64>,
}

fn bucket_of(ms: f64) -> u32 {
    if ms.is_nan() || ms <= FIRST_MS {
        return 0;
    }
    if !ms.is_finite() {
        return LAST_BUCKET;
    }
    let b = ((ms / FIRST_MS).ln() / GROWTH.ln()).floor();
    (b as u32).min(LAST_BUCKET)
}

/// The upper bound of bucket `b`, milliseconds.
fn upper_ms(b: u32) -> f64 {
    FIRST_MS * GROWTH.powi(b as i32 + 1)
}

impl LatencyHistogram {
    /// An empty histogram.
    pub fn new() -> Self {
        Self::default()
    }

    /// Records one latency in milliseconds.
    pub fn record_ms(&mut self, ms: f64) {
        *self.buckets.entry(bucket_of(ms)).or_default() += 1;
    }

    /// Adds every count of `other`.
    pub fn merge(&mut self, other: &LatencyHistogram) {
        for (&b, &n) in &other.buckets {
            *self.buckets.entry(b).or_default() += n;
        }
    }

    /// Latencies recorded.
    pub fn count(&self) -> u64 {
        self.buckets.values().sum()
    }

    /// The `q` quantile (`0 ≤ q ≤ 1`) in milliseconds: the upper bound of the bucket that
    /// holds it (at most 5 % above the exact value). `None` when empty.
    pub fn quantile_ms(&self, q: f64) -> Option<f64> {
        let total = self.count();
        if total == 0 {
            return None;
        }
        let rank = ((q.clamp(0.0, 1.0) * total as f64).ceil() as u64).max(1);
        let mut seen = 0;
        for (&b, &n) in &self.buckets {
            seen += n;
            if seen >= rank {
                return Some(upper_ms(b));
            }
        }
        self.buckets.keys().last().map(|&b| upper_ms(b))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn quantiles_of_a_known_spread() {
        let mut h = LatencyHistogram::new();
        for ms in 1..=100 {
            h.record_ms(f64::from(ms));
        }
        assert_eq!(h.count(), 100);
        let p50 = h.quantile_ms(0.5).unwrap();
        let p99 = h.quantile_ms(0.99).unwrap();
        assert!((50.0..=52.5).contains(&p50), "p50 {p50}");
        assert!((99.0..=104.0).contains(&p99), "p99 {p99}");
        assert!(LatencyHistogram::new().quantile_ms(0.5).is_none());
    }

    #[test]
    fn odd_values_land_in_the_end_buckets() {
        let mut h = LatencyHistogram::new();
        for ms in [f64::NAN, -1.0, 0.0, f64::INFINITY, 1e12] {
            h.record_ms(ms);
        }
        assert_eq!(h.count(), 5);
        assert!(h.quantile_ms(1.0).unwrap() > 1e6);
        assert!(h.quantile_ms(0.0).unwrap() <= FIRST_MS * GROWTH);
    }

    #[test]
    fn survives_a_json_round_trip_and_merges() {
        let mut a = LatencyHistogram::new();
        a.record_ms(3.0);
        let mut b = LatencyHistogram::new();
        b.record_ms(300.0);
        b.record_ms(300.0);
        let json = serde_json::to_string(&b).unwrap();
        let b2: LatencyHistogram = serde_json::from_str(&json).unwrap();
        assert_eq!(b, b2);
        a.merge(&b2);
        assert_eq!(a.count(), 3);
        assert!(a.quantile_ms(0.5).unwrap() >= 300.0);
    }

    proptest! {
        /// The reported quantile is never below the exact one and at most one bucket above.
        #[test]
        fn quantile_is_within_one_bucket(values in proptest::collection::vec(0.2f64..1e6, 1..200), q in 0.0f64..=1.0) {
            let mut h = LatencyHistogram::new();
            for &v in &values {
                h.record_ms(v);
            }
            let mut sorted = values.clone();
            sorted.sort_by(f64::total_cmp);
            let rank = ((q * sorted.len() as f64).ceil() as usize).max(1);
            let exact = sorted[rank - 1];
            let got = h.quantile_ms(q).unwrap();
            prop_assert!(got >= exact * 0.999_999, "got {got} exact {exact}");
            prop_assert!(got <= exact * GROWTH * 1.000_001, "got {got} exact {exact}");
        }
    }
}
