//! Throughput of `PeerConnection::send`/`recv` against raw quinn streams on
//! loopback, measured in the same run: 200 LayerDelta messages of 256k f32
//! (~1 MiB) per round, transport and raw rounds alternating, 3 of each.
//! Prints MB/s of each round, the medians, and `ratio transport/raw = X.XXx`
//! (ratio of the medians; target >= 0.8).

use transport::{bench_transport_vs_raw, BenchParams};

fn main() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    let cert_dir = tempfile::tempdir().expect("temporary directory");
    let params = BenchParams::new(cert_dir.path().to_path_buf());
    let result = match runtime.block_on(bench_transport_vs_raw(&params)) {
        Ok(result) => result,
        Err(error) => {
            eprintln!("benchmark failed: {error}");
            std::process::exit(1);
        }
    };
    println!(
        "{} messages x {} f32 per round, {:.1} MB per round, {} rounds each",
        params.messages,
        params.floats_per_message,
        result.bytes_per_round as f64 / 1e6,
        params.rounds
    );
    for (round, (ours, raw)) in result
        .transport_rounds_mb_s
        .iter()
        .zip(&result.raw_rounds_mb_s)
        .enumerate()
    {
        println!("round {round}: transport {ours:8.1} MB/s   raw quinn {raw:8.1} MB/s");
    }
    println!(
        "transport (PeerConnection) {:8.1} MB/s",
        result.transport_mb_s
    );
    println!("raw quinn uni streams      {:8.1} MB/s", result.raw_mb_s);
    println!("ratio transport/raw = {:.2}x", result.ratio());
}
