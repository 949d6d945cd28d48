//! A cluster across network namespaces: the coordinator, two aggregators, a worker node and
//! two edge agents each get a namespace of their own with its own address (veth pairs on a
//! bridge in a hub namespace, 10.231.0.0/24, nothing outside this machine), so nothing can
//! assume that its peers share its host or its loopback. The aggregators listen on
//! `0.0.0.0`, as on a real host, and must advertise an address the others can reach.
//!
//! Needs root and iproute2 (`ip netns`); where namespaces cannot be made, the test says so
//! and passes without running (CI machines differ; this one can).

#[allow(dead_code)] // this test uses only `scratch`
mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::scratch;

/// The hosts: (name, role, last octet of the address).
const HOSTS: [(&str, &str, u8); 6] = [
    ("coordinator", "coordinator", 1),
    ("agg-1", "aggregator", 11),
    ("agg-2", "aggregator", 12),
    ("node-1", "worker", 31),
    ("edge-1", "edge", 21),
    ("edge-2", "edge", 22),
];

fn addr(octet: u8) -> String {
    format!("10.231.0.{octet}")
}

/// Run `ip ARGS`, the error carrying what `ip` printed.
fn ip(args: &[&str]) -> Result<(), String> {
    let o = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("cannot run `ip`: {e}"))?;
    if o.status.success() {
        Ok(())
    } else {
        Err(format!(
            "`ip {}` failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&o.stderr).trim()
        ))
    }
}

/// The namespaces made for this test; deleted (with their veths) when dropped.
struct Namespaces {
    prefix: String,
    made: Vec<String>,
}

impl Namespaces {
    fn ns(&self, host: &str) -> String {
        format!("{}-{host}", self.prefix)
    }

    fn add(&mut self, host: &str) -> Result<String, String> {
        let name = self.ns(host);
        ip(&["netns", "add", &name])?;
        self.made.push(name.clone());
        ip(&["-n", &name, "link", "set", "lo", "up"])?;
        Ok(name)
    }

    /// A hub namespace with a bridge, and one namespace per host on it.
    fn build(prefix: String) -> Result<Namespaces, String> {
        let mut n = Namespaces {
            prefix,
            made: Vec::new(),
        };
        let hub = n.add("hub")?;
        ip(&["-n", &hub, "link", "add", "br0", "type", "bridge"])?;
        ip(&["-n", &hub, "link", "set", "br0", "up"])?;
        for (i, (host, _, octet)) in HOSTS.iter().enumerate() {
            let ns = n.add(host)?;
            // Interface names are at most 15 characters.
            let (inside, outside) = (format!("ddv{i}"), format!("ddb{i}"));
            ip(&[
                "-n", &ns, "link", "add", &inside, "type", "veth", "peer", "name", &outside,
                "netns", &hub,
            ])?;
            ip(&["-n", &hub, "link", "set", &outside, "master", "br0"])?;
            ip(&["-n", &hub, "link", "set", &outside, "up"])?;
            let cidr = format!("{}/24", addr(*octet));
            ip(&["-n", &ns, "addr", "add", &cidr, "dev", &inside])?;
            ip(&["-n", &ns, "link", "set", &inside, "up"])?;
        }
        Ok(n)
    }
}

impl Drop for Namespaces {
    fn drop(&mut self) {
        for name in self.made.iter().rev() {
            let _ = ip(&["netns", "del", name]);
        }
    }
}

/// Kills the processes still running when dropped (a failed assertion leaves none behind).
struct Processes(Vec<(String, Child)>);

impl Drop for Processes {
    fn drop(&mut self) {
        for (_, child) in &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

fn config(host: &str, role: &str, id: u64, certs: &Path, data: &Path) -> String {
    let coordinator = format!("{}:7000", addr(1));
    let model = "[model]\nmodel = \"mlp\"\ndataset = \"auto\"\nseed = 1\n\n";
    let certs = certs.display();
    let data = data.display();
    match role {
        "coordinator" => format!(
            "{model}[node]\nname = \"coordinator\"\nlisten = \"0.0.0.0:7000\"\n\
             status = \"0.0.0.0:7080\"\ncerts_dir = \"{certs}\"\n\
             credentials = \"netns-test\"\nlease_ms = 3000\n"
        ),
        "aggregator" => format!(
            "{model}[node]\nname = \"{host}\"\nid = {id}\ncerts_dir = \"{certs}\"\n\
             data_dir = \"{data}\"\nlisten = \"0.0.0.0:7001\"\ncoordinator = \"{coordinator}\"\n\
             credentials = \"netns-test\"\n\n[aggregation]\nround_size = 1\n"
        ),
        _ => {
            let (workers, first_rank) = match host {
                "node-1" => (2, 0),
                "edge-1" => (1, 2),
                _ => (1, 3),
            };
            format!(
                "{model}[node]\nname = \"{host}\"\nid = {id}\ncerts_dir = \"{certs}\"\n\
                 data_dir = \"{data}\"\ncoordinator = \"{coordinator}\"\n\
                 credentials = \"netns-test\"\nbind = \"0.0.0.0:0\"\n\n\
                 [training]\nworkers = {workers}\nfirst_rank = {first_rank}\nworld = 4\n\
                 steps = 600\neval_every = 0\n\n[sync]\nperiod_steps = 4\ndrain_timeout_s = 30\n"
            )
        }
    }
}

fn spawn(ns: &str, role: &str, config: &Path, log: &Path) -> Child {
    let out = std::fs::File::create(log).unwrap();
    let err = out.try_clone().unwrap();
    Command::new("ip")
        .args([
            "netns",
            "exec",
            ns,
            env!("CARGO_BIN_EXE_dreamddp"),
            role,
            "--config",
        ])
        .arg(config)
        .env("RUST_LOG", "info")
        .stdout(Stdio::from(out))
        .stderr(Stdio::from(err))
        .spawn()
        .expect("ip netns exec starts")
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}

#[test]
fn a_cluster_across_network_namespaces_trains_with_every_node_on_its_own_address() {
    if !cfg!(target_os = "linux") {
        eprintln!("skipped: network namespaces are Linux-only");
        return;
    }
    let prefix = format!("ddp{}", std::process::id());
    let namespaces = match Namespaces::build(prefix) {
        Ok(n) => n,
        Err(why) => {
            eprintln!(
                "skipped: cannot make network namespaces on this machine ({why}); the test \
                 needs root and iproute2"
            );
            return;
        }
    };
    let dir = scratch("netns");
    let certs = dir.join("certs");
    let names: Vec<String> = HOSTS.iter().map(|(h, _, _)| h.to_string()).collect();
    transport::create_cluster_certs(&certs, &names).unwrap();

    let mut processes = Processes(Vec::new());
    let mut logs: Vec<(String, PathBuf)> = Vec::new();
    for (i, (host, role, _)) in HOSTS.iter().enumerate() {
        let node_dir = dir.join(host);
        std::fs::create_dir_all(&node_dir).unwrap();
        let id = match *role {
            "aggregator" => i as u64,
            _ => 100 + i as u64,
        };
        let file = node_dir.join("config.toml");
        std::fs::write(
            &file,
            config(host, role, id, &certs, &node_dir.join("data")),
        )
        .unwrap();
        let log = node_dir.join("log.txt");
        processes.0.push((
            host.to_string(),
            spawn(&namespaces.ns(host), role, &file, &log),
        ));
        logs.push((host.to_string(), log));
        if *role == "coordinator" {
            std::thread::sleep(Duration::from_millis(300));
        }
    }

    // Wait for the three trainers to finish (they exit on their own).
    let started = Instant::now();
    let limit = Duration::from_secs(300);
    loop {
        let mut running = 0;
        for (host, child) in &mut processes.0 {
            let trainer = matches!(host.as_str(), "node-1" | "edge-1" | "edge-2");
            if let Some(status) = child.try_wait().unwrap() {
                let log = read(&dir.join(host.as_str()).join("log.txt"));
                assert!(
                    trainer && status.success(),
                    "{host} exited ({status}) before the trainers were done:\n{log}"
                );
            } else if trainer {
                running += 1;
            }
        }
        if running == 0 {
            break;
        }
        assert!(
            started.elapsed() < limit,
            "trainers still running after {limit:?}; edge-1's log:\n{}",
            read(&dir.join("edge-1/log.txt"))
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    drop(processes);

    // The edges reached the aggregators at the addresses the coordinator handed out: the
    // aggregators' own namespace addresses, not 0.0.0.0 or loopback.
    for edge in ["edge-1", "edge-2"] {
        let log = read(&dir.join(edge).join("log.txt"));
        for agg in [11u8, 12] {
            let up = format!("at {}:7001 up", addr(agg));
            assert!(log.contains(&up), "{edge} never linked {up}:\n{log}");
        }
        assert!(!log.contains("0.0.0.0:7001"), "{edge}:\n{log}");
    }
    // Every trainer delivered everything and learned.
    for trainer in ["node-1", "edge-1", "edge-2"] {
        let stats: serde_json::Value =
            serde_json::from_str(&read(&dir.join(trainer).join("data/stats.json")))
                .unwrap_or_else(|e| panic!("{trainer} stats.json: {e}"));
        assert_eq!(stats["steps"], 600, "{trainer}: {stats}");
        assert_eq!(stats["undelivered"], 0, "{trainer}: {stats}");
        assert!(
            stats["final_accuracy"].as_f64().unwrap() > 0.8,
            "{trainer}: {stats}"
        );
    }
    // Both aggregators applied deltas from the other hosts.
    for agg in ["agg-1", "agg-2"] {
        let log = read(&dir.join(agg).join("log.txt"));
        assert!(
            log.contains(&format!(
                "advertised as {}:7001",
                addr(if agg == "agg-1" { 11 } else { 12 })
            )),
            "{agg}:\n{log}"
        );
    }
    drop(namespaces);
    let _ = std::fs::remove_dir_all(&dir);
}
