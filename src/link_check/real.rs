//! The real side of `link-check`: dreamddp's QUIC transport with an edge agent's settings
//! through a relay replaying the scenario's link, one direction loaded or both at once.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use protocol::Message;
use relay::{spawn_relay, RelayConfig};
use simulations::LinkSpec;
use transport::certs::create_cluster_certs;
use transport::config::TransportSection;
use transport::{PeerConnection, QuicNode, TlsIdentity, TransportConfig};

use super::LinkCheckArgs;
use crate::cluster_file::relay_link_figures;
use crate::scenario_cluster::scenario_relay;

/// The edge's QUIC settings behind the scenario relay of `up` / `down`: windows sized for the
/// link as `dreamddp cluster` sizes them, or the given `send_window`.
pub(super) fn sender_config(
    up: &LinkSpec,
    down: &LinkSpec,
    seed: u64,
    send_window: Option<u64>,
) -> Result<TransportConfig> {
    let edge = scenario_relay(up, down, seed);
    let mut section = TransportSection::default();
    if let Some((mbps, rtt)) = relay_link_figures(&edge, Path::new("."))? {
        section.link_mbps = Some(mbps);
        section.rtt_ms = Some(rtt);
    }
    section.send_window = send_window;
    section
        .to_config_over(TransportConfig::edge_device())
        .map_err(|e| anyhow::anyhow!("{e}"))
}

/// What the real transport moved through the relay in one direction.
#[derive(Default)]
pub(super) struct RealDirection {
    pub(super) delivered_mb: f64,
    pub(super) wire_mb: f64,
    pub(super) queue_wait_ms: f64,
    pub(super) queue_wait_max_ms: f64,
    pub(super) cwnd_mean_kb: f64,
    pub(super) cwnd_max_kb: f64,
}

impl RealDirection {
    fn new(delivered: u64, stats: &relay::DirectionStats, cwnd_kb: &[f64]) -> RealDirection {
        RealDirection {
            delivered_mb: delivered as f64 / 1e6,
            // What the sender put on the link, lost datagrams included, as the simulator counts.
            wire_mb: stats.bytes_in as f64 / 1e6,
            queue_wait_ms: stats.mean_queue_wait_ms(),
            queue_wait_max_ms: stats.queue_wait_ns_max as f64 / 1e6,
            cwnd_mean_kb: cwnd_kb.iter().sum::<f64>() / cwnd_kb.len().max(1) as f64,
            cwnd_max_kb: cwnd_kb.iter().copied().fold(0.0, f64::max),
        }
    }
}

/// What the real transport moved through the relay: up, and down with `--both-ways`.
pub(super) struct RealOutcome {
    pub(super) up: RealDirection,
    pub(super) drops: u64,
    pub(super) error: Option<String>,
    pub(super) down: Option<RealDirection>,
}

/// Payload bytes of the messages `conn` receives until `end`.
async fn count_received(conn: PeerConnection, end: Instant) -> u64 {
    let mut delivered = 0u64;
    while let Ok(Ok(m)) = tokio::time::timeout_at(end.into(), conn.recv()).await {
        delivered += protocol::encode_frame(&m).map_or(0, |f| f.len() as u64);
    }
    delivered
}

/// Sends `messages` (cycled) on `conn` until `end`, `streams` at once; why it stopped early.
async fn send_until(
    conn: PeerConnection,
    messages: Arc<Vec<Message>>,
    streams: usize,
    end: Instant,
) -> Option<String> {
    let mut in_flight = tokio::task::JoinSet::new();
    let mut next = 0usize;
    let mut error = None;
    while Instant::now() < end && error.is_none() {
        while in_flight.len() < streams {
            let conn = conn.clone();
            let msg = messages[next % messages.len()].clone();
            next += 1;
            in_flight.spawn(async move { conn.send(&msg).await });
        }
        match tokio::time::timeout_at(end.into(), in_flight.join_next()).await {
            Ok(Some(Ok(Err(e)))) => error = Some(format!("sending failed: {e}")),
            Ok(_) => {}
            Err(_) => break,
        }
    }
    in_flight.abort_all();
    error
}

/// Congestion-window samples of each connection, KB, every 100 ms until `end`.
async fn sample_windows(conns: Vec<PeerConnection>, end: Instant) -> Vec<Vec<f64>> {
    let mut samples = vec![Vec::new(); conns.len()];
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    while Instant::now() < end {
        tick.tick().await;
        for (c, s) in conns.iter().zip(&mut samples) {
            s.push(c.congestion_window() as f64 / 1e3);
        }
    }
    samples
}

pub(super) async fn real(
    up: &LinkSpec,
    down: &LinkSpec,
    sender_config: &TransportConfig,
    messages: &[Message],
    args: &LinkCheckArgs,
    seed: u64,
) -> Result<RealOutcome> {
    let dir = tempfile::tempdir().context("temporary folder for certificates")?;
    let names = ["link-sender".to_string(), "link-receiver".to_string()];
    create_cluster_certs(dir.path(), &names)?;
    let localhost = std::net::SocketAddr::from(([127, 0, 0, 1], 0));
    let receiver = QuicNode::bind(
        localhost,
        &TlsIdentity::in_dir(dir.path(), &names[1]),
        &TransportConfig {
            send_window: args
                .send_window
                .unwrap_or(TransportConfig::default().send_window),
            ..TransportConfig::default()
        },
    )?;
    let edge = scenario_relay(up, down, seed);
    let (up, down) = (edge.up.clone(), edge.down.clone());
    let sender = QuicNode::bind(
        localhost,
        &TlsIdentity::in_dir(dir.path(), &names[0]),
        sender_config,
    )?;
    let relay = spawn_relay(RelayConfig {
        listen: localhost,
        upstream: receiver.local_addr()?,
        up,
        down,
        seed,
    })
    .await
    .context("starting the relay")?;
    // The relay's link time starts now; so does the window.
    let start = Instant::now();
    let end = start + Duration::from_secs_f64(args.seconds);
    let (dialed, accepted) = tokio::join!(
        sender.connect(relay.local_addr(), &names[1]),
        receiver.accept()
    );
    let (to_receiver, from_sender) = match (dialed, accepted) {
        (Ok(d), Some(Ok(a))) => (d, a),
        (Err(e), _) | (_, Some(Err(e))) => {
            relay.shutdown().await;
            return Ok(RealOutcome {
                up: RealDirection::default(),
                drops: 0,
                error: Some(format!("connecting through the relay failed: {e}")),
                down: None,
            });
        }
        (_, None) => bail!("the receiving endpoint closed"),
    };
    let messages = Arc::new(messages.to_vec());
    let counted_up = tokio::spawn(count_received(from_sender.clone(), end));
    let counted_down = tokio::spawn(count_received(to_receiver.clone(), end));
    let sampled = tokio::spawn(sample_windows(
        vec![to_receiver.clone(), from_sender.clone()],
        end,
    ));
    let sent_down = args.both_ways.then(|| {
        tokio::spawn(send_until(
            from_sender.clone(),
            Arc::clone(&messages),
            args.streams,
            end,
        ))
    });
    let mut error = send_until(to_receiver.clone(), messages, args.streams, end).await;
    if let Some(task) = sent_down {
        let down_error = task.await.context("the down sender")?;
        error = error.or(down_error.map(|e| format!("down: {e}")));
    }
    let delivered_up = counted_up.await.context("the receiving task")?;
    let delivered_down = counted_down.await.context("the sending side's receiver")?;
    let cwnd = sampled.await.context("the window sampler")?;
    let stats = relay.stats();
    for (side, conn) in [("edge", &to_receiver), ("far end", &from_sender)] {
        let q = conn.stats();
        tracing::info!(
            "[QUIC] {side}: {} packets sent, {} declared lost ({} bytes), {} UDP bytes sent, \
             {} STREAM frames sent, {} ACK frames sent, {} congestion events",
            q.path.sent_packets,
            q.path.lost_packets,
            q.path.lost_bytes,
            q.udp_tx.bytes,
            q.frame_tx.stream,
            q.frame_tx.acks,
            q.path.congestion_events,
        );
    }
    to_receiver.close("link-check done");
    sender.close();
    receiver.close();
    relay.shutdown().await;
    Ok(RealOutcome {
        up: RealDirection::new(delivered_up, &stats.up, &cwnd[0]),
        drops: stats.up.dropped.total(),
        error,
        down: args
            .both_ways
            .then(|| RealDirection::new(delivered_down, &stats.down, &cwnd[1])),
    })
}
