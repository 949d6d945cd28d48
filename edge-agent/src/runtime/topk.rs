//! Top-k sparsification of a layer's delta at cut time (`sync.codec = "topk:F"`), with error
//! feedback through the sync client's anchor accounting.
//!
//! The driver hands the [`crate::SyncClient`] a *sparsified* θ for each due layer:
//! `θ' = anchor + topk(θ − anchor)`, where `topk` keeps the `k = ceil(F · len)` elements of
//! largest magnitude and zeroes the rest. The client cuts `Δ = θ' − anchor` (exactly zero off
//! the top k, since `(a + 0) − a = 0`) and advances the anchor by exactly `Δ`. The model's own
//! θ is untouched, so the elements not sent — the error-feedback residual — remain in
//! `θ − anchor` and are part of the next cut, when their accumulated size may put them in the
//! top k. This is the same error feedback `protocol::codec::TopKCompressor` gives, without a
//! second residual buffer (which would count the unsent part twice: once in the buffer and
//! once in `θ − anchor`).
//!
//! Exactly-once: `Δ` is owned by the client's delivery machinery from the moment it is cut —
//! in flight, then, if its deadlines pass, in the durable weak-sync cache as the same dense
//! vector (possibly-delivered entries are retransmitted as-is under their seq, so the
//! aggregator's dedup applies them at most once). The residual never enters the cache, so a
//! delta is neither lost nor sent twice, and a rebase on a new global version keeps the
//! residual with the rest of the local progress (`θ ← θ_global + (θ − θ_at_cut)`).

use protocol::codec::{decode, encode};
use protocol::{Codec, CodecError};

/// Keeps the `ceil(fraction · len)` largest-magnitude elements of each delta.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TopKSparsifier {
    fraction: f64,
}

impl TopKSparsifier {
    /// A sparsifier sending `fraction` of each layer's elements (`0 < fraction ≤ 1`; config
    /// validation guarantees it, a value outside is clamped).
    pub fn new(fraction: f64) -> Self {
        TopKSparsifier {
            fraction: if fraction.is_finite() {
                fraction.clamp(f64::MIN_POSITIVE, 1.0)
            } else {
                1.0
            },
        }
    }

    /// `k` for a layer of `len` elements: `ceil(fraction · len)`, at least 1, at most `len`.
    pub fn k(&self, len: usize) -> usize {
        ((self.fraction * len as f64).ceil() as usize).clamp(1.min(len), len)
    }

    /// `anchor + topk(theta − anchor)`: what the sync client should cut against `anchor`.
    pub fn sparsify(&self, theta: &[f32], anchor: &[f32]) -> Result<Vec<f32>, CodecError> {
        let len = theta.len().min(anchor.len());
        let k = self.k(len);
        if k >= len {
            return Ok(theta.to_vec());
        }
        let delta: Vec<f32> = theta.iter().zip(anchor).map(|(t, a)| t - a).collect();
        let k32 = u32::try_from(k).unwrap_or(u32::MAX);
        let codec = Codec::TopK { k: k32 };
        let sparse = encode(&delta, codec)?;
        let kept = decode(&sparse.bytes, sparse.codec, len as u64)?;
        Ok(anchor.iter().zip(&kept).map(|(a, d)| a + d).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{ClientConfig, LayerInit, LayerSpec};
    use crate::state::{Output, SyncClient};
    use cpu_aggregator::{
        AggEvent, AggregatorConfig, AggregatorState, Output as AggOutput, OwnedLayer,
    };
    use proptest::prelude::*;
    use protocol::Message;

    #[test]
    fn k_is_a_ceiling_fraction_within_bounds() {
        let s = TopKSparsifier::new(0.01);
        assert_eq!(s.k(1000), 10);
        assert_eq!(s.k(1001), 11);
        assert_eq!(s.k(5), 1);
        assert_eq!(s.k(0), 0);
        assert_eq!(TopKSparsifier::new(1.0).k(7), 7);
    }

    proptest! {
        #[test]
        fn sparsified_delta_keeps_exactly_the_k_largest(
            pairs in prop::collection::vec((-10.0f32..10.0, -1.0f32..1.0), 1..200),
            fraction in 0.01f64..1.0,
        ) {
            let (anchor, step): (Vec<f32>, Vec<f32>) = pairs.into_iter().unzip();
            let theta: Vec<f32> = anchor.iter().zip(&step).map(|(a, d)| a + d).collect();
            let s = TopKSparsifier::new(fraction);
            let out = s.sparsify(&theta, &anchor).unwrap();
            let k = s.k(theta.len());
            let delta: Vec<f32> = out.iter().zip(&anchor).map(|(o, a)| o - a).collect();
            let kept: Vec<usize> = (0..delta.len()).filter(|&i| delta[i] != 0.0).collect();
            prop_assert!(kept.len() <= k);
            // Every kept element is at least as large as every dropped one.
            let full: Vec<f32> = theta.iter().zip(&anchor).map(|(t, a)| t - a).collect();
            let min_kept = kept.iter().map(|&i| full[i].abs()).fold(f32::INFINITY, f32::min);
            for (i, d) in full.iter().enumerate() {
                if !kept.contains(&i) && kept.len() == k {
                    prop_assert!(d.abs() <= min_kept, "dropped {} > kept {}", d, min_kept);
                }
            }
        }
    }

    fn client(len: usize) -> SyncClient {
        let spec = LayerSpec {
            layer_id: 0,
            name: "fc".into(),
            shape: vec![len as u32],
            period_steps: 1,
            phase: 0,
            deadline_ns: 1_000,
            owner: 9,
            max_stale_steps: None,
            matrix_rows: None,
        };
        let config = ClientConfig {
            max_attempts: 1,
            delta_codec: Codec::ZstdRawF32,
            flush_interval_ns: 0,
            first_seq: 1,
            ..ClientConfig::default()
        };
        let init = LayerInit {
            spec,
            values: vec![0.0; len],
            version: 0,
        };
        SyncClient::new(1, vec![init], config).unwrap()
    }

    /// The real aggregator of layer 0 (owner 9): every delta is applied on arrival with
    /// `θ ← θ + Δ` (round size 1, outer lr 1), at most once per seq; no staleness limit,
    /// since this client never receives versions.
    fn aggregator(len: usize) -> AggregatorState {
        let layer = OwnedLayer {
            layer_id: 0,
            name: "fc".into(),
            shape: vec![len as u32],
            values: vec![0.0; len],
        };
        let config = AggregatorConfig {
            tau_max: u64::MAX,
            ..AggregatorConfig::default()
        };
        AggregatorState::new(9, vec![layer], config).unwrap()
    }

    /// Runs the client's outputs against the aggregator. `lose`: the fresh delta with this
    /// seq misses its deadline — with `true` it reached the aggregator and only its ack was
    /// lost, with `false` it never arrived.
    fn pump(
        c: &mut SyncClient,
        agg: &mut AggregatorState,
        now: &mut u64,
        k: usize,
        fresh_seq: u64,
        lose: Option<bool>,
    ) {
        for _ in 0..1000 {
            let Some(out) = c.poll_output() else { return };
            match out {
                Output::Send {
                    msg: Message::LayerDelta(p),
                    ..
                } => {
                    let seq = p.seq;
                    // A message sent from the cache may carry several coalesced cuts.
                    let fresh = c.in_flight(0).is_some_and(|f| !f.from_cache);
                    if seq == fresh_seq && fresh {
                        let values = p.decode_values().unwrap();
                        let nonzero = values.iter().filter(|v| **v != 0.0).count();
                        assert!(nonzero <= k, "fresh delta has {nonzero} > {k} non-zeros");
                    }
                    let lost = (seq == fresh_seq).then_some(lose).flatten();
                    if lost != Some(false) {
                        agg.handle_message(*now, 1, Message::LayerDelta(p));
                    }
                    while let Some(reply) = agg.poll_output() {
                        match reply {
                            AggOutput::Send { to: 1, msg } if lost.is_none() => {
                                c.handle_message(*now, msg)
                            }
                            AggOutput::Event(AggEvent::BadInput { reason, .. }) => {
                                panic!("the aggregator refused a delta: {reason}")
                            }
                            _ => {}
                        }
                    }
                    if lost.is_some() {
                        *now += 10_000;
                        c.handle_timeout(*now);
                    }
                }
                Output::CachePut { entry } => {
                    let nonzero = entry.delta.iter().filter(|v| **v != 0.0).count();
                    if entry.seq == fresh_seq {
                        assert!(nonzero <= k, "weak-synced delta has {nonzero} > {k}");
                    }
                    c.cache_put_done(*now, entry.layer_id, entry.seq);
                }
                Output::CacheReplace { put, .. } => c.cache_put_done(*now, put.layer_id, put.seq),
                _ => {}
            }
        }
        panic!("the client never went quiet");
    }

    /// Error feedback through the client, with acks, lost deltas (weak-synced into the cache,
    /// some applied anyway) and coalesced backlog: every fresh delta has at most k non-zeros,
    /// the aggregator applies each cut exactly once, and what it applied plus the residual
    /// `θ − anchor` equals all local progress.
    #[test]
    fn residual_carries_forward_and_every_cut_is_applied_exactly_once() {
        let len = 100;
        let s = TopKSparsifier::new(0.05);
        let k = s.k(len);
        let mut c = client(len);
        let mut agg = aggregator(len);
        let mut theta = vec![0.0f32; len];
        let mut now = 0;
        for step in 1..=24u64 {
            for (i, t) in theta.iter_mut().enumerate() {
                *t += (i as f32 * 0.37 + step as f32).sin() * 0.01;
            }
            let cut = s.sparsify(&theta, c.anchor(0).unwrap()).unwrap();
            let fresh_seq = c.next_seq();
            c.on_step_end(now, step, 1, |_| cut.as_slice()).unwrap();
            let lose = (step % 4 == 0).then_some(step % 8 == 0);
            pump(&mut c, &mut agg, &mut now, k, fresh_seq, lose);
            if step % 4 == 2 {
                c.on_link_up(now);
                pump(&mut c, &mut agg, &mut now, k, 0, None);
            }
            now += 1;
        }
        for _ in 0..50 {
            if c.undelivered() == 0 {
                break;
            }
            c.on_link_up(now);
            pump(&mut c, &mut agg, &mut now, k, 0, None);
        }
        assert_eq!(c.undelivered(), 0);
        let counters = c.counters();
        assert!(counters.weak_sync_events >= 3, "{counters:?}");
        let anchor = c.anchor(0).unwrap();
        let total: Vec<f64> = agg
            .layer(0)
            .unwrap()
            .values
            .iter()
            .map(|&v| f64::from(v))
            .collect();
        let agg_counters = agg.counters();
        assert!(
            agg_counters.duplicates_rejected >= 1,
            "a delta applied before its ack was lost came back: {agg_counters:?}"
        );
        // θ₀ = 0: applied + residual = θ, i.e. applied = anchor.
        for i in 0..len {
            assert!(
                (total[i] - f64::from(anchor[i])).abs() < 1e-5,
                "element {i}: applied {} vs anchor {}",
                total[i],
                anchor[i]
            );
        }
        let residual = theta.iter().zip(anchor).filter(|(t, a)| t != a).count();
        assert!(residual > 0, "top-k must leave a residual");
        let reached = total.iter().filter(|t| **t != 0.0).count();
        assert!(
            reached > k,
            "error feedback sends more than the first k elements over time"
        );
    }

    /// The wire choice: a sparsified delta as zstd-wrapped dense f32 is no larger than the
    /// `Codec::TopK` layout (8 bytes per kept element) on incompressible values.
    #[test]
    fn zstd_dense_payload_is_smaller_than_the_top_k_layout() {
        use protocol::codec::maybe_compress;
        let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
        for &(len, fraction) in &[(100_000usize, 0.01f64), (8192, 0.05)] {
            let theta: Vec<f32> = (0..len)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    ((x >> 11) as f64 / (1u64 << 53) as f64 - 0.5) as f32 * 0.02
                })
                .collect();
            let s = TopKSparsifier::new(fraction);
            let cut = s.sparsify(&theta, &vec![0.0; len]).unwrap();
            let wire = maybe_compress(encode(&cut, Codec::RawF32).unwrap()).unwrap();
            assert_eq!(wire.codec, Codec::ZstdRawF32);
            assert!(
                wire.bytes.len() < 8 * s.k(len),
                "{} bytes for k = {}",
                wire.bytes.len(),
                s.k(len)
            );
        }
    }
}
