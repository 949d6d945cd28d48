//! `kill -9` durability of [`DurableCache`]: the `cache_writer` helper binary writes the
//! deterministic workload (`src/bin/cache_writer/workload.rs`) and prints `ACK <index>`
//! after each durable operation; this test SIGKILLs it at seeded random moments, reopens
//! the cache and checks that its contents are exactly the acknowledged operations, plus
//! possibly the one operation in flight (applied whole: a replace leaves either the three
//! parts or the bundle, never both, never a mix).

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use edge_agent::{CacheEntry, DurableCache};

#[allow(dead_code)]
#[path = "../src/bin/cache_writer/workload.rs"]
mod workload;

use workload::CacheOp;

const ROUNDS: u64 = 20;
/// Longest a round may take before the test gives up (the child is killed either way).
const ROUND_LIMIT: Duration = Duration::from_secs(5);

/// Seeded splitmix64, enough for choosing kill moments.
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

type Contents = BTreeMap<(u32, u64), CacheEntry>;

fn apply(contents: &mut Contents, op: &CacheOp) {
    match op {
        CacheOp::Put(e) => {
            contents.insert((e.layer_id, e.seq), e.clone());
        }
        CacheOp::Replace {
            layer_id,
            remove,
            put,
        } => {
            for seq in remove {
                contents.remove(&(*layer_id, *seq));
            }
            contents.insert((put.layer_id, put.seq), put.clone());
        }
    }
}

fn read_back(dir: &Path) -> Contents {
    let (cache, report) = DurableCache::open(dir).expect("reopen after kill -9");
    if !report.is_clean() {
        eprintln!("open after kill -9 was not clean: {report:?}");
    }
    let entries = cache.entries().expect("entries");
    entries
        .into_iter()
        .map(|e| ((e.layer_id, e.seq), e))
        .collect()
}

fn describe(contents: &Contents) -> Vec<(u32, u64)> {
    contents.keys().copied().collect()
}

/// Spawns the writer for `round` and returns it with a channel of its acknowledged op
/// indices (closed when its stdout reaches EOF, i.e. after it died).
fn spawn_writer(dir: &Path, round: u64) -> (Child, mpsc::Receiver<u64>) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_cache_writer"))
        .arg(dir)
        .arg(round.to_string())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn cache_writer");
    let stdout = child.stdout.take().expect("piped stdout");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            let index = line
                .strip_prefix("ACK ")
                .and_then(|s| s.parse::<u64>().ok())
                .unwrap_or_else(|| panic!("unexpected writer output {line:?}"));
            if tx.send(index).is_err() {
                break;
            }
        }
    });
    (child, rx)
}

#[test]
fn every_acknowledged_write_survives_sigkill() {
    let seed = std::env::var("KILL9_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x5EED_CAC4E);
    let mut rng = SplitMix(seed);
    let base: PathBuf =
        std::env::temp_dir().join(format!("edge-agent-kill9-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&base);
    std::fs::create_dir_all(&base).unwrap();
    let dir = base.join("cache");

    let mut contents = Contents::new();
    let mut total_acked = 0u64;
    let mut in_flight_applied = 0u32;
    for round in 0..ROUNDS {
        let kill_after_acks = 1 + rng.below(40);
        let extra_delay = Duration::from_micros(rng.below(3_000));
        let started = Instant::now();
        let (mut child, acks) = spawn_writer(&dir, round);
        let mut acked = 0u64;
        while acked < kill_after_acks {
            let left = ROUND_LIMIT.saturating_sub(started.elapsed());
            match acks.recv_timeout(left) {
                Ok(index) => {
                    assert_eq!(index, acked, "acks arrive in op order");
                    acked += 1;
                }
                Err(e) => {
                    let _ = child.kill();
                    let _ = child.wait();
                    panic!("round {round}: writer stopped acknowledging after {acked}: {e:?}");
                }
            }
        }
        std::thread::sleep(extra_delay);
        child.kill().expect("SIGKILL the writer");
        let status = child.wait().expect("reap the writer");
        assert!(
            !status.success(),
            "round {round}: writer was killed, not finished"
        );
        // Acks written before the kill are still in the pipe.
        for index in acks.iter() {
            assert_eq!(index, acked, "acks arrive in op order");
            acked += 1;
        }
        total_acked += acked;

        for index in 0..acked {
            apply(&mut contents, &workload::op(round, index));
        }
        let mut with_in_flight = contents.clone();
        apply(&mut with_in_flight, &workload::op(round, acked));

        let found = read_back(&dir);
        if found == with_in_flight && found != contents {
            in_flight_applied += 1;
        } else if found != contents {
            let lost: Vec<_> = contents
                .iter()
                .filter(|(k, e)| found.get(k) != Some(e))
                .map(|(k, _)| *k)
                .collect();
            panic!(
                "round {round} (seed {seed:#x}, {acked} acked): cache is neither the acked \
                 state nor that plus op {acked}\n acked entries missing or altered: {lost:?}\n \
                 found: {:?}\n expected: {:?}\n or: {:?}",
                describe(&found),
                describe(&contents),
                describe(&with_in_flight)
            );
        }
        contents = found;
    }
    eprintln!(
        "kill9: {ROUNDS} rounds, {total_acked} acknowledged ops, in-flight op found applied \
         {in_flight_applied} times, {} entries at the end",
        contents.len()
    );
    assert!(total_acked >= ROUNDS, "every round acknowledged something");
    std::fs::remove_dir_all(&base).unwrap();
}
