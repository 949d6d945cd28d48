//! `dreamddp link-check SCENARIO`: the link model measured alone, against the real transport.
//!
//! For each chosen node of an edge scenario, the same stream of messages (`--message-kib`,
//! cycled) goes up the node's access link for `--seconds`:
//!
//! * **simulated**: the simulator's [`MuxLink`] built from the node's `up` spec (packet model,
//!   messages sharing the link round-robin up to the edge's send window), with `--streams`
//!   sends outstanding, a send returning when its message is admitted to the window;
//! * **real**: dreamddp's QUIC transport with the edge agent's settings (windows sized for the
//!   link, as `dreamddp cluster` sizes them) through a relay replaying the same spec (the
//!   scenario queue depth a fidelity run gives it), `--streams` sends outstanding at once.
//!
//! With `--both-ways` the same stream also goes down the link at the same time (the simulated
//! down link's acknowledgements waiting behind the up link's queue and the reverse, as in the
//! edge world; the real one from the receiving side of the same connection), and the down
//! direction's figures are reported beside the up's.
//!
//! It prints, per node, the payload delivered by the deadline on each side (whole messages),
//! their ratio, the link's capacity over the window, and the bytes each side put on the link
//! (the simulator's serialized packets, retransmissions included; the packets the relay
//! forwarded, QUIC headers included), and writes them as JSON. This is where the fidelity
//! report's bytes error is taken apart: no training, no aggregator, one link.
//!
//! A real `send` returns once the message is in QUIC's send buffer, so `--streams` bounds the
//! sends outstanding, not what is on the wire: as in an edge agent, the connection's send
//! window does, and QUIC interleaves the buffered messages' streams.

mod real;

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::Args;
use protocol::Message;
use serde::Serialize;
use simulations::edge::plan_edge;
use simulations::{Link, LinkSpec, MuxEvent, MuxLink, SimRng, SimTime};

use crate::cluster_file::direction_mbps;
use crate::scenario_cluster::{load, ScenarioOverrides};
use real::{real, sender_config, RealDirection};

/// Flags of `link-check`.
#[derive(Args, Debug, Clone)]
pub struct LinkCheckArgs {
    /// An edge-kind scenario: a file or a built-in name (`default`, `fidelity-smoke`, ...).
    pub scenario: String,
    /// Nodes whose up link is measured (`edge-0,edge-3`), or `all` (each distinct link once).
    #[arg(long, default_value = "all")]
    pub nodes: String,
    /// Seconds of sending on each link.
    #[arg(long, default_value_t = 20.0)]
    pub seconds: f64,
    /// Message sizes in KiB, sent in this order and cycled (a model's layer deltas).
    #[arg(long, default_value = "1568,256,40")]
    pub message_kib: String,
    /// Sends outstanding at once on both sides (one QUIC stream each; a send returns when its
    /// message is in the send window, so more may be on the link).
    #[arg(long, default_value_t = 1)]
    pub streams: usize,
    /// Also send the same stream down the link at the same time (from the receiving side),
    /// as an aggregator's layer versions share a device's link with its deltas: each
    /// direction's acknowledgements then wait behind the other's queue.
    #[arg(long)]
    pub both_ways: bool,
    /// Both ends' QUIC send window, bytes (what may be sent and not yet acknowledged),
    /// instead of the edge's link-sized window and the aggregator's default.
    #[arg(long)]
    pub send_window: Option<u64>,
    /// Where to write the JSON report.
    #[arg(long, default_value = "link-check.json")]
    pub out: PathBuf,
}

/// One link measured both ways (by the simulator and by the real transport).
#[derive(Debug, Serialize)]
pub struct LinkCheckRow {
    /// The node whose up link this is.
    pub node: String,
    /// Seconds measured.
    pub seconds: f64,
    /// The up link's mean capacity over the window, MB (10^6 bytes).
    pub capacity_mb: f64,
    /// The up direction's figures.
    #[serde(flatten)]
    pub up: DirectionFigures,
    /// Datagrams the relay dropped going up (queue, outage, loss).
    pub real_drops: u64,
    /// `real_mb / simulated_mb` going up.
    pub real_over_simulated: f64,
    /// Why the real connection stopped before the window ended (e.g. an outage longer than
    /// the idle timeout); its figures are up to that point.
    pub real_error: Option<String>,
    /// With `--both-ways`: the down direction's figures, sent at the same time.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub down: Option<DirectionFigures>,
}

/// One direction of a link, simulated and real.
#[derive(Debug, Serialize)]
pub struct DirectionFigures {
    /// The link, as the scenario gives it (bandwidth or trace, latency, loss).
    pub link: String,
    /// Payload (message frames) the simulator delivered by the deadline, MB.
    pub simulated_mb: f64,
    /// Bytes the simulator serialized by the deadline (retransmissions included), MB.
    pub simulated_wire_mb: f64,
    /// Mean delay the simulator's standing queue added to a packet, ms.
    pub simulated_queue_wait_ms: f64,
    /// Payload the real transport delivered by the deadline, MB.
    pub real_mb: f64,
    /// Bytes the relay forwarded in this direction during the window (QUIC packets), MB.
    pub real_wire_mb: f64,
    /// Mean wait of a real datagram in the relay's bandwidth queue, ms (the queueing delay
    /// QUIC's sender builds up).
    pub real_queue_wait_ms: f64,
    /// The longest such wait, ms.
    pub real_queue_wait_max_ms: f64,
    /// The real sender's congestion window, sampled every 100 ms: mean, KB.
    pub real_cwnd_mean_kb: f64,
    /// Its largest sample, KB.
    pub real_cwnd_max_kb: f64,
}

impl DirectionFigures {
    fn new(spec: &LinkSpec, sim: &Simulated, real: &RealDirection) -> DirectionFigures {
        DirectionFigures {
            link: describe(spec),
            simulated_mb: sim.delivered_mb,
            simulated_wire_mb: sim.wire_mb,
            simulated_queue_wait_ms: sim.queue_wait_ms,
            real_mb: real.delivered_mb,
            real_wire_mb: real.wire_mb,
            real_queue_wait_ms: real.queue_wait_ms,
            real_queue_wait_max_ms: real.queue_wait_max_ms,
            real_cwnd_mean_kb: real.cwnd_mean_kb,
            real_cwnd_max_kb: real.cwnd_max_kb,
        }
    }

    /// `simulated … real …` for the printed report.
    fn summary(&self) -> String {
        format!(
            "simulated {:>7.2} MB (wire {:>7.2}, queue wait mean {:.0} ms)  real {:>7.2} MB \
             (relay forwarded {:>7.2}, queue wait mean {:.0} ms, max {:.0} ms, \
             cwnd mean {:.0} KB, max {:.0} KB)",
            self.simulated_mb,
            self.simulated_wire_mb,
            self.simulated_queue_wait_ms,
            self.real_mb,
            self.real_wire_mb,
            self.real_queue_wait_ms,
            self.real_queue_wait_max_ms,
            self.real_cwnd_mean_kb,
            self.real_cwnd_max_kb
        )
    }
}

/// Runs the check.
pub fn run(args: &LinkCheckArgs) -> Result<()> {
    if !(args.seconds.is_finite() && args.seconds > 0.0) {
        bail!("--seconds {}: must be a positive number", args.seconds);
    }
    if args.streams == 0 {
        bail!("--streams must be at least 1");
    }
    let sizes: Vec<usize> = args
        .message_kib
        .split(',')
        .map(|s| {
            s.trim()
                .parse::<f64>()
                .ok()
                .filter(|k| k.is_finite() && *k > 0.0)
                .map(|k| ((k * 1024.0) as usize / 4).max(1))
                .with_context(|| format!("--message-kib: '{s}' is not a positive number of KiB"))
        })
        .collect::<Result<_>>()?;
    let loaded = load(&args.scenario, &ScenarioOverrides::default())?;
    let strategy = loaded
        .scenario
        .strategies
        .first()
        .cloned()
        .unwrap_or_else(|| "elastic".into());
    let plan = plan_edge(&loaded.scenario, &loaded.task, &strategy).map_err(anyhow::Error::msg)?;
    let mut chosen: Vec<(String, LinkSpec, LinkSpec)> = Vec::new();
    for n in &plan.nodes {
        let wanted = if args.nodes == "all" {
            !plan
                .nodes
                .iter()
                .take_while(|m| m.name != n.name)
                .any(|m| m.up == n.up)
        } else {
            args.nodes.split(',').any(|x| x.trim() == n.name)
        };
        if wanted {
            // Trace paths are relative to the scenario's folder, as the simulator reads them.
            let (mut up, mut down) = (n.up.clone(), n.down.clone());
            up.resolve_paths(&loaded.scenario.base_dir);
            down.resolve_paths(&loaded.scenario.base_dir);
            chosen.push((n.name.clone(), up, down));
        }
    }
    if chosen.is_empty() {
        bail!(
            "--nodes {}: no such node in {} (nodes: {})",
            args.nodes,
            loaded.scenario.name,
            plan.nodes
                .iter()
                .map(|n| n.name.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    let messages: Vec<Message> = sizes
        .iter()
        .map(|&floats| transport::bench::bench_message(floats))
        .collect::<Result<_, _>>()?;
    let frames: Vec<usize> = messages
        .iter()
        .map(|m| protocol::encode_frame(m).map(|f| f.len()))
        .collect::<Result<_, _>>()
        .context("encoding a message")?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("tokio runtime")?;
    let mut rows = Vec::new();
    println!(
        "link-check {}: {} s per link, messages {} KiB, {} stream(s)",
        loaded.scenario.name, args.seconds, args.message_kib, args.streams
    );
    for (i, (node, up, down)) in chosen.iter().enumerate() {
        let seed = loaded
            .scenario
            .seed
            .wrapping_mul(1000)
            .wrapping_add(i as u64);
        let config = sender_config(up, down, seed, args.send_window)?;
        let sim = simulated(
            up,
            down,
            args.both_ways,
            &frames,
            args.seconds,
            seed,
            config.send_window,
            args.streams,
        )?;
        let real = runtime.block_on(real(up, down, &config, &messages, args, seed))?;
        let up_figures = DirectionFigures::new(up, &sim[0], &real.up);
        let row = LinkCheckRow {
            node: node.clone(),
            seconds: args.seconds,
            capacity_mb: capacity_mb(up, args.seconds)?,
            real_drops: real.drops,
            real_over_simulated: if up_figures.simulated_mb > 0.0 {
                up_figures.real_mb / up_figures.simulated_mb
            } else {
                f64::NAN
            },
            up: up_figures,
            real_error: real.error,
            down: match (sim.get(1), &real.down) {
                (Some(s), Some(r)) => Some(DirectionFigures::new(down, s, r)),
                _ => None,
            },
        };
        println!(
            "  {:<8} {:<44} capacity {:>7.2} MB  {}  dropped {}  real/simulated {:.3}",
            row.node,
            row.up.link,
            row.capacity_mb,
            row.up.summary(),
            row.real_drops,
            row.real_over_simulated
        );
        if let Some(d) = &row.down {
            println!("  {:<8} down {:<39} {}", row.node, d.link, d.summary());
        }
        if let Some(e) = &row.real_error {
            println!("           the real connection stopped early: {e}");
        }
        rows.push(row);
    }
    std::fs::write(&args.out, serde_json::to_string_pretty(&rows)?)
        .with_context(|| format!("cannot write {}", args.out.display()))?;
    println!("report: {}", args.out.display());
    Ok(())
}

/// `bandwidth` or trace file, latency and loss, in a few words.
fn describe(spec: &LinkSpec) -> String {
    let capacity = match (&spec.bandwidth, &spec.trace) {
        (Some(b), _) => format!("{:.1} Mbit/s", b.bits_per_sec() as f64 / 1e6),
        (None, Some(t)) => t
            .path
            .file_name()
            .map_or_else(|| "trace".into(), |n| n.to_string_lossy().into_owned()),
        (None, None) => "unlimited".into(),
    };
    let mut text = format!("{capacity}, {} ms, loss {}", spec.latency_ms, spec.loss);
    if spec.gilbert_elliott.is_some() {
        text.push_str(", burst loss");
    }
    if !spec.outages.is_empty() {
        text.push_str(&format!(", {} outage(s)", spec.outages.len()));
    }
    text
}

/// Mean capacity of `spec` over `seconds`, MB (the rate `dreamddp cluster` sizes windows by).
fn capacity_mb(spec: &LinkSpec, seconds: f64) -> Result<f64> {
    Ok(direction_mbps(spec, Path::new("."))?
        .map_or(f64::NAN, |mbps| mbps * 1e6 / 8.0 * seconds / 1e6))
}

/// One direction's simulated figures: payload delivered by the deadline, bytes serialized,
/// MB, and the mean standing-queue delay of a packet, ms.
#[derive(Clone, Copy, Debug)]
struct Simulated {
    delivered_mb: f64,
    wire_mb: f64,
    queue_wait_ms: f64,
}

/// One simulated sender: its link and the sends it has outstanding.
struct SimSender {
    link: MuxLink,
    outstanding: usize,
    delivered: u64,
    next: usize,
}

impl SimSender {
    /// Handles the link's events; whether a send was admitted (another may go).
    fn take_events(&mut self, deadline: SimTime) -> bool {
        let mut admitted = false;
        for event in self.link.take_events() {
            match event {
                MuxEvent::Admitted { .. } => {
                    self.outstanding -= 1;
                    admitted = true;
                }
                MuxEvent::Finished { transfer, .. } => {
                    if transfer.delivered_at.is_some_and(|at| at <= deadline) {
                        self.delivered += transfer.bytes;
                    }
                }
            }
        }
        admitted
    }
}

/// The simulator's links (`up`, and `down` at the same time when `both_ways`) by `seconds`:
/// `streams` sends outstanding per direction, each returning when its message enters the
/// `window`; each direction's acknowledgements go back over the other's capacity and, with
/// both loaded, wait behind its queue, as in the edge world.
fn simulated(
    up: &LinkSpec,
    down: &LinkSpec,
    both_ways: bool,
    frames: &[usize],
    seconds: f64,
    seed: u64,
    window: u64,
    streams: usize,
) -> Result<Vec<Simulated>> {
    let rng = SimRng::new(seed);
    let build = |spec: &LinkSpec, fork: &str| -> Result<MuxLink> {
        let trace = spec.load_trace().context("loading the link's trace")?;
        let link =
            Link::new(spec, trace, &rng.fork(fork)).context("building the simulated link")?;
        Ok(MuxLink::new(link, window))
    };
    // Each direction's acknowledgements ride the other's capacity, loaded or not.
    let (up_link, down_link) =
        MuxLink::pair(build(up, "link-check")?, build(down, "link-check-down")?);
    let mut links = vec![up_link];
    if both_ways {
        links.push(down_link);
    }
    let mut senders: Vec<SimSender> = links
        .into_iter()
        .map(|link| SimSender {
            link,
            outstanding: 0,
            delivered: 0,
            next: 0,
        })
        .collect();
    let deadline = SimTime::from_nanos((seconds * 1e9) as u64);
    let mut now = SimTime::ZERO;
    loop {
        for sender in &mut senders {
            while sender.outstanding < streams {
                let bytes = frames[sender.next % frames.len()];
                sender.next += 1;
                sender.link.submit(now, bytes as u64, None);
                sender.outstanding += 1;
            }
        }
        sync_reverse_delays(&mut senders, now);
        let mut admitted = false;
        for sender in &mut senders {
            admitted |= sender.take_events(deadline);
        }
        if admitted {
            continue;
        }
        match senders.iter_mut().filter_map(|s| s.link.next_wake()).min() {
            Some(wake) if wake <= deadline => {
                now = wake;
                for sender in &mut senders {
                    sender.link.advance_through(wake);
                }
            }
            _ => break,
        }
    }
    Ok(senders
        .iter_mut()
        .map(|sender| {
            sender.link.advance_through(deadline);
            sender.take_events(deadline);
            Simulated {
                delivered_mb: sender.delivered as f64 / 1e6,
                wire_mb: sender.link.bytes_serialized() as f64 / 1e6,
                queue_wait_ms: sender.link.mean_queue_wait().as_millis_f64(),
            }
        })
        .collect())
}

/// With two directions: each one's acknowledgements wait behind the other's queue as it
/// stands at `now`.
fn sync_reverse_delays(senders: &mut [SimSender], now: SimTime) {
    if let [up, down] = senders {
        let (up_queue, down_queue) = (
            up.link.current_queue_wait(now),
            down.link.current_queue_wait(now),
        );
        up.link.set_reverse_delay(down_queue);
        down.link.set_reverse_delay(up_queue);
    }
}
