//! `cache_writer DIR ROUND [MAX_OPS]` — test helper for `tests/kill9.rs`: opens the
//! [`DurableCache`] in `DIR` and performs the deterministic workload of round `ROUND`
//! (see `workload.rs`), printing `ACK <index>` on stdout after each operation is durable
//! (`put_durable` / `replace` returned `Ok`). The test SIGKILLs it at random moments and
//! checks that everything acknowledged survived. An open report that is not clean goes to
//! stderr as `[ERROR] cache ...`. Exits after `MAX_OPS` operations (default 100 000).

use std::io::Write;
use std::process::ExitCode;

use edge_agent::DurableCache;

mod workload;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let (Some(dir), Some(Ok(round))) = (args.get(1), args.get(2).map(|s| s.parse::<u64>())) else {
        eprintln!("usage: cache_writer DIR ROUND [MAX_OPS]");
        return ExitCode::from(2);
    };
    let max_ops = match args.get(3).map(|s| s.parse::<u64>()) {
        None => 100_000,
        Some(Ok(n)) => n,
        Some(Err(e)) => {
            eprintln!("cache_writer: bad MAX_OPS: {e}");
            return ExitCode::from(2);
        }
    };
    let (cache, report) = match DurableCache::open(dir) {
        Ok(opened) => opened,
        Err(e) => {
            eprintln!("[ERROR] {e}");
            return ExitCode::FAILURE;
        }
    };
    if let Some(aside) = &report.moved_aside {
        eprintln!(
            "[ERROR] cache {dir} moved aside to {}: {}",
            aside.path.display(),
            aside.reason
        );
    }
    let mut stdout = std::io::stdout().lock();
    for index in 0..max_ops {
        let done = match workload::op(round, index) {
            workload::CacheOp::Put(entry) => cache.put_durable(&entry),
            workload::CacheOp::Replace {
                layer_id,
                remove,
                put,
            } => cache.replace(layer_id, &remove, &put),
        };
        if let Err(e) = done {
            eprintln!("[ERROR] {e}");
            return ExitCode::FAILURE;
        }
        if writeln!(stdout, "ACK {index}")
            .and_then(|()| stdout.flush())
            .is_err()
        {
            return ExitCode::FAILURE;
        }
    }
    ExitCode::SUCCESS
}
