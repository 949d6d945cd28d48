//! Benchmark: an aggregator folding in one round of deltas from 8 senders (validation,
//! staleness weights, weighted average, version bump and the broadcast payload, through the
//! real `AggregatorState`) versus a plain `memcpy` of the same bytes, measured in the same run. Prints both bandwidths and the
//! ratio (target ≥ 0.8x of memcpy). Run: `cargo bench -p cpu-aggregator`.

use std::hint::black_box;
use std::time::Instant;

use cpu_aggregator::{AggregatorConfig, AggregatorState, OwnedLayer};
use protocol::{payload_from_f32, Codec, LayerMeta, Message};

const SENDERS: u64 = 8;
const LEN: usize = 1 << 20; // 4 MiB of f32 per delta
const ROUNDS: usize = 48;

fn main() {
    let layer = OwnedLayer {
        layer_id: 0,
        name: "fc1".into(),
        shape: vec![LEN as u32],
        values: vec![0.5; LEN],
    };
    let config = AggregatorConfig {
        round_size: SENDERS as usize,
        ..AggregatorConfig::default()
    };
    let mut agg = AggregatorState::new(100, vec![layer], config).expect("aggregator");
    let delta: Vec<f32> = (0..LEN).map(|i| (i % 97) as f32 * 1e-4).collect();
    let bytes_per_round = SENDERS as usize * LEN * 4;

    let mut agg_secs = Vec::new();
    let mut copy_secs = Vec::new();
    let src: Vec<Vec<f32>> = (0..SENDERS).map(|_| delta.clone()).collect();
    let mut dst = vec![0.0f32; LEN];
    let mut seq = 0u64;
    for round in 0..ROUNDS {
        let version = agg.layer(0).expect("owned").version;
        // Messages are built outside the timed region (they arrive decoded from the wire).
        let msgs: Vec<(u64, Message)> = (0..SENDERS)
            .map(|node| {
                seq += 1;
                let meta = LayerMeta {
                    node_id: node,
                    layer_id: 0,
                    layer_name: "fc1".into(),
                    step: round as u64,
                    base_version: version,
                    version,
                    seq,
                    sample_count: 32,
                };
                let p =
                    payload_from_f32(meta, &[LEN as u32], &delta, Codec::RawF32).expect("payload");
                (node, Message::LayerDelta(p))
            })
            .collect();
        let t = Instant::now();
        for (node, msg) in msgs {
            agg.handle_message(round as u64, node, msg);
        }
        while agg.poll_output().is_some() {}
        agg_secs.push(t.elapsed().as_secs_f64());
        assert_eq!(
            agg.layer(0).expect("owned").version,
            version + 1,
            "one round applied"
        );

        let t = Instant::now();
        for s in &src {
            dst.copy_from_slice(black_box(s));
            black_box(&mut dst);
        }
        copy_secs.push(t.elapsed().as_secs_f64());
    }
    // Drop the first (warm-up) round. Each round times the aggregator and then memcpy back to
    // back, so the ratio is taken per round (both halves saw the same machine load) and the
    // median of those is reported; the bandwidths are medians too.
    let median = |v: &[f64]| {
        let mut v = v[1..].to_vec();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let ratios: Vec<f64> = agg_secs
        .iter()
        .zip(&copy_secs)
        .map(|(a, c)| c / a)
        .collect();
    let gbs = |s: f64| bytes_per_round as f64 / s / 1e9;
    println!(
        "aggregator reduce: {SENDERS} senders x {} MiB: {:.2} GB/s (median of {} rounds)",
        (LEN * 4) >> 20,
        gbs(median(&agg_secs)),
        ROUNDS - 1
    );
    println!(
        "memcpy of the same bytes: {:.2} GB/s",
        gbs(median(&copy_secs))
    );
    println!(
        "ratio aggregator/memcpy = {:.2}x (median of per-round ratios; target >= 0.8x)",
        median(&ratios)
    );
    println!(
        "fused kernels dispatched to: {} (cpu: {})",
        engine::fused_reduce::simd_target(),
        cpu_model()
    );
}

/// The CPU's model name (`/proc/cpuinfo`), for the README's "which CPU" column.
fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|t| {
            t.lines()
                .find_map(|l| l.strip_prefix("model name"))
                .map(|rest| rest.trim_start_matches([' ', '\t', ':']).trim().to_string())
        })
        .unwrap_or_else(|| "unknown".into())
}
