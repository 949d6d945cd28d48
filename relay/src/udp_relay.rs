//! The tokio shell around two [`LinkShaper`]s: [`spawn_relay`] and [`RelayHandle`].
//!
//! Tasks:
//! * the **listen loop** receives from clients on `listen`. Each client source address gets its
//!   own upstream socket (a *session*, connected to `upstream`), so several clients can share a
//!   relay and the server sees one address per client. Every datagram is offered to the `up`
//!   shaper;
//! * one **session loop** per client receives the server's replies on that session's socket and
//!   offers them to the `down` shaper, addressed back to the client through `listen`;
//! * one **delivery loop** per direction holds the accepted datagrams in a delay queue (a binary
//!   heap by delivery time, FIFO among equal times), sleeps until the earliest one is due
//!   (`tokio::time::sleep_until`, no polling) and sends it.
//!
//! Both directions of every session share their direction's shaper: the relay models one link
//! (a shared bottleneck), not one link per client. Time zero of the shapers (outages, traces) is
//! the moment [`spawn_relay`] was called, or the one given to [`spawn_relay_with_zero`].
//! Sessions live as long as the relay.

use crate::config::RelayConfig;
use crate::error::RelayError;
use crate::shaper::{LinkShaper, Verdict};
use crate::stats::{DirectionCounters, RelayStats};
use link_model::SimRng;
use socket2::SockRef;
use std::cmp::{Ordering as CmpOrdering, Reverse};
use std::collections::{BinaryHeap, HashMap};
use std::io::ErrorKind;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::net::UdpSocket;
use tokio::sync::mpsc;
use tokio::task::{JoinHandle, JoinSet};
use tokio::time::{sleep, sleep_until, Instant};
use transport::udp_buffers::{enlarge, UdpBuffers};

/// Largest UDP payload.
const MAX_DATAGRAM: usize = 65_535;
/// Pause after an unexpected socket error, so that a persistent error cannot spin a loop.
const ERROR_BACKOFF: Duration = Duration::from_millis(10);

/// A datagram the shaper accepted, waiting for its delivery time.
struct Outgoing {
    at: Instant,
    payload: Vec<u8>,
    socket: Arc<UdpSocket>,
    /// `None` for a connected socket.
    to: Option<SocketAddr>,
}

/// An [`Outgoing`] in the delay queue, ordered by (delivery time, arrival order).
struct Scheduled {
    at: Instant,
    seq: u64,
    outgoing: Outgoing,
}

impl PartialEq for Scheduled {
    fn eq(&self, other: &Self) -> bool {
        (self.at, self.seq) == (other.at, other.seq)
    }
}

impl Eq for Scheduled {}

impl PartialOrd for Scheduled {
    fn partial_cmp(&self, other: &Self) -> Option<CmpOrdering> {
        Some(self.cmp(other))
    }
}

impl Ord for Scheduled {
    fn cmp(&self, other: &Self) -> CmpOrdering {
        (self.at, self.seq).cmp(&(other.at, other.seq))
    }
}

/// One direction: its shaper, counters and the queue to its delivery loop.
struct DirectionPath {
    name: &'static str,
    shaper: Mutex<LinkShaper>,
    counters: Arc<DirectionCounters>,
    outbox: mpsc::UnboundedSender<Outgoing>,
    start: Instant,
}

impl DirectionPath {
    /// Shapes one received datagram and queues it for delivery through `socket` (to `to`).
    fn offer(&self, payload: &[u8], socket: &Arc<UdpSocket>, to: Option<SocketAddr>) {
        self.counters.received(payload.len());
        let now_ns = u64::try_from(self.start.elapsed().as_nanos()).unwrap_or(u64::MAX);
        // The lock is held while queueing so that the delivery loop sees datagrams in shaping
        // order (ties in delivery time keep that order).
        let mut shaper = self.shaper.lock().unwrap_or_else(|e| e.into_inner());
        match shaper.on_datagram(now_ns, payload.len()) {
            Verdict::Drop(reason) => {
                tracing::trace!(
                    direction = self.name,
                    ?reason,
                    len = payload.len(),
                    "dropped"
                );
                self.counters.dropped(reason);
            }
            Verdict::Deliver { at_ns } => {
                self.counters.queued(shaper.last_queue_wait_ns());
                let outgoing = Outgoing {
                    at: self.start + Duration::from_nanos(at_ns),
                    payload: payload.to_vec(),
                    socket: Arc::clone(socket),
                    to,
                };
                // Fails only while the relay is shutting down.
                let _ = self.outbox.send(outgoing);
            }
        }
    }
}

/// A running relay. Dropping it stops the relay too (without waiting for its tasks).
#[derive(Debug)]
pub struct RelayHandle {
    local_addr: SocketAddr,
    up: Arc<DirectionCounters>,
    down: Arc<DirectionCounters>,
    sessions: Arc<AtomicU64>,
    tasks: Vec<JoinHandle<()>>,
}

impl RelayHandle {
    /// The address clients send to (the bound port when the config asked for port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Current counters of both directions.
    pub fn stats(&self) -> RelayStats {
        RelayStats {
            up: self.up.snapshot(),
            down: self.down.snapshot(),
            sessions: self.sessions.load(Ordering::Relaxed),
        }
    }

    /// Stops every task of the relay (datagrams still in the delay queues are discarded) and
    /// waits until they have ended, so the sockets are closed when this returns.
    pub async fn shutdown(mut self) {
        let tasks = std::mem::take(&mut self.tasks);
        for task in &tasks {
            task.abort();
        }
        for task in tasks {
            // A task ends either cancelled or (never, in practice) by returning.
            let _ = task.await;
        }
    }
}

impl Drop for RelayHandle {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

/// Starts a relay: binds `config.listen`, loads the traces, and spawns its tasks on the current
/// tokio runtime. Its links' time zero (outages, traces) is now.
pub async fn spawn_relay(config: RelayConfig) -> Result<RelayHandle, RelayError> {
    spawn_relay_with_zero(config, Instant::now()).await
}

/// [`spawn_relay`] whose links' time zero is `zero` (which may be in the future: until then
/// the links stand at their time 0), e.g. the moment a launcher releases its trainers, so
/// that a trace starts when the node behind the relay does.
pub async fn spawn_relay_with_zero(
    config: RelayConfig,
    zero: Instant,
) -> Result<RelayHandle, RelayError> {
    config.validate()?;
    let root = SimRng::new(config.seed);
    let shaper = |direction: &'static str, spec: &crate::RelayLinkSpec| {
        let trace = spec.load_trace()?;
        LinkShaper::new(spec, trace, root.fork(direction).key()).map_err(|source| {
            RelayError::InvalidLink {
                path: Path::new("<config>").to_path_buf(),
                direction,
                source,
            }
        })
    };
    let up_shaper = shaper("up", &config.up)?;
    let down_shaper = shaper("down", &config.down)?;

    let bind_error = |source| RelayError::Bind {
        addr: config.listen,
        source,
    };
    let listen = UdpSocket::bind(config.listen).await.map_err(bind_error)?;
    warn_if_small(enlarge(SockRef::from(&listen)));
    let local_addr = listen.local_addr().map_err(bind_error)?;
    let listen = Arc::new(listen);
    let start = zero;

    let up_counters = Arc::new(DirectionCounters::default());
    let down_counters = Arc::new(DirectionCounters::default());
    let sessions = Arc::new(AtomicU64::new(0));
    let (up_outbox, up_inbox) = mpsc::unbounded_channel();
    let (down_outbox, down_inbox) = mpsc::unbounded_channel();
    let up = Arc::new(DirectionPath {
        name: "up",
        shaper: Mutex::new(up_shaper),
        counters: Arc::clone(&up_counters),
        outbox: up_outbox,
        start,
    });
    let down = Arc::new(DirectionPath {
        name: "down",
        shaper: Mutex::new(down_shaper),
        counters: Arc::clone(&down_counters),
        outbox: down_outbox,
        start,
    });
    let tasks = vec![
        tokio::spawn(delivery_loop("up", up_inbox, Arc::clone(&up_counters))),
        tokio::spawn(delivery_loop(
            "down",
            down_inbox,
            Arc::clone(&down_counters),
        )),
        tokio::spawn(listen_loop(
            listen,
            config.upstream,
            up,
            down,
            Arc::clone(&sessions),
        )),
    ];
    tracing::info!(listen = %local_addr, upstream = %config.upstream, "relay started");
    Ok(RelayHandle {
        local_addr,
        up: up_counters,
        down: down_counters,
        sessions,
        tasks,
    })
}

/// Errors a UDP socket reports for an earlier datagram (ICMP unreachable); not fatal.
fn is_transient(error: &std::io::Error) -> bool {
    matches!(
        error.kind(),
        ErrorKind::ConnectionRefused | ErrorKind::ConnectionReset | ErrorKind::Interrupted
    )
}

/// Receives from clients, opening a session per new source address.
async fn listen_loop(
    listen: Arc<UdpSocket>,
    upstream: SocketAddr,
    up: Arc<DirectionPath>,
    down: Arc<DirectionPath>,
    session_count: Arc<AtomicU64>,
) {
    let mut sessions: HashMap<SocketAddr, Arc<UdpSocket>> = HashMap::new();
    // Dropped (and so aborted) with this task.
    let mut session_tasks = JoinSet::new();
    let mut buf = vec![0u8; MAX_DATAGRAM];
    loop {
        let (len, client) = match listen.recv_from(&mut buf).await {
            Ok(received) => received,
            Err(e) if is_transient(&e) => continue,
            Err(e) => {
                tracing::warn!(error = %e, "relay: receive from clients failed");
                sleep(ERROR_BACKOFF).await;
                continue;
            }
        };
        let socket = match sessions.get(&client) {
            Some(socket) => Arc::clone(socket),
            None => match open_session(upstream).await {
                Ok(socket) => {
                    tracing::debug!(%client, local = ?socket.local_addr().ok(), "relay: new session");
                    sessions.insert(client, Arc::clone(&socket));
                    session_count.fetch_add(1, Ordering::Relaxed);
                    session_tasks.spawn(session_loop(
                        Arc::clone(&socket),
                        client,
                        Arc::clone(&listen),
                        Arc::clone(&down),
                    ));
                    socket
                }
                Err(e) => {
                    tracing::warn!(%client, error = %e, "relay: cannot open an upstream socket");
                    continue;
                }
            },
        };
        up.offer(&buf[..len], &socket, None);
    }
}

/// Below this receive buffer a relay replaying a fast link loses datagrams in the kernel
/// whenever it is not scheduled for a millisecond or two ([`transport::udp_buffers`]).
const SMALL_RECV_BUFFER: usize = 1 << 20;

/// Says once per relay when the kernel refused the large receive buffer.
fn warn_if_small(buffers: UdpBuffers) {
    if buffers.recv < SMALL_RECV_BUFFER {
        tracing::warn!(
            "[WARN] the relay's UDP receive buffer is {} KiB (net.core.rmem_max caps it): on a fast \
             link the kernel will drop datagrams the link model would deliver; raise it with \
             `sysctl -w net.core.rmem_max=8388608`",
            buffers.recv >> 10
        );
    }
}

/// A socket connected to `upstream`, bound to loopback when the upstream is on loopback.
async fn open_session(upstream: SocketAddr) -> std::io::Result<Arc<UdpSocket>> {
    let ip = match upstream.ip() {
        ip if ip.is_loopback() => ip,
        IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
        IpAddr::V6(_) => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
    };
    let socket = UdpSocket::bind(SocketAddr::new(ip, 0)).await?;
    enlarge(SockRef::from(&socket));
    socket.connect(upstream).await?;
    Ok(Arc::new(socket))
}

/// Receives the server's replies for one client.
async fn session_loop(
    socket: Arc<UdpSocket>,
    client: SocketAddr,
    listen: Arc<UdpSocket>,
    down: Arc<DirectionPath>,
) {
    let mut buf = vec![0u8; MAX_DATAGRAM];
    loop {
        match socket.recv(&mut buf).await {
            Ok(len) => down.offer(&buf[..len], &listen, Some(client)),
            Err(e) if is_transient(&e) => {}
            Err(e) => {
                tracing::warn!(%client, error = %e, "relay: receive from upstream failed");
                sleep(ERROR_BACKOFF).await;
            }
        }
    }
}

/// Sends each accepted datagram of one direction at its delivery time.
async fn delivery_loop(
    name: &'static str,
    mut inbox: mpsc::UnboundedReceiver<Outgoing>,
    counters: Arc<DirectionCounters>,
) {
    let mut queue: BinaryHeap<Reverse<Scheduled>> = BinaryHeap::new();
    let mut seq = 0u64;
    loop {
        let next_at = queue.peek().map(|Reverse(s)| s.at);
        tokio::select! {
            received = inbox.recv() => match received {
                Some(outgoing) => {
                    queue.push(Reverse(Scheduled { at: outgoing.at, seq, outgoing }));
                    seq += 1;
                }
                None => return,
            },
            () = sleep_until(next_at.unwrap_or_else(Instant::now)), if next_at.is_some() => {
                let now = Instant::now();
                while queue.peek().is_some_and(|Reverse(s)| s.at <= now) {
                    let Some(Reverse(due)) = queue.pop() else { break };
                    let Outgoing { payload, socket, to, .. } = due.outgoing;
                    let sent = match to {
                        Some(addr) => socket.send_to(&payload, addr).await,
                        None => socket.send(&payload).await,
                    };
                    match sent {
                        Ok(_) => counters.sent(payload.len()),
                        Err(e) => {
                            tracing::debug!(direction = name, error = %e, "relay: send failed");
                            counters.send_failed();
                        }
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::RelayLinkSpec;
    use std::time::Duration;
    use tokio::time::timeout;

    /// A UDP echo server on loopback; returns its address and task.
    async fn echo_server() -> (SocketAddr, JoinHandle<()>) {
        let socket = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let addr = socket.local_addr().unwrap();
        let task = tokio::spawn(async move {
            let mut buf = vec![0u8; MAX_DATAGRAM];
            while let Ok((len, from)) = socket.recv_from(&mut buf).await {
                let _ = socket.send_to(&buf[..len], from).await;
            }
        });
        (addr, task)
    }

    fn config(upstream: SocketAddr, up: RelayLinkSpec, down: RelayLinkSpec) -> RelayConfig {
        RelayConfig {
            up,
            down,
            seed: 3,
            ..RelayConfig::transparent("127.0.0.1:0".parse().unwrap(), upstream)
        }
    }

    async fn client() -> UdpSocket {
        UdpSocket::bind("127.0.0.1:0").await.unwrap()
    }

    /// Receives datagrams until none arrives for `quiet`.
    async fn drain(socket: &UdpSocket, quiet: Duration) -> Vec<Vec<u8>> {
        let mut received = Vec::new();
        let mut buf = vec![0u8; MAX_DATAGRAM];
        while let Ok(Ok(len)) = timeout(quiet, socket.recv(&mut buf)).await {
            received.push(buf[..len].to_vec());
        }
        received
    }

    #[tokio::test]
    async fn latency_is_added_both_ways() {
        timeout(Duration::from_secs(10), async {
            let (server, echo) = echo_server().await;
            let delayed = RelayLinkSpec {
                latency_ms: 40.0,
                ..RelayLinkSpec::default()
            };
            let relay = spawn_relay(config(server, delayed.clone(), delayed))
                .await
                .unwrap();
            let socket = client().await;
            socket.connect(relay.local_addr()).await.unwrap();
            let mut rtts = Vec::new();
            let mut buf = [0u8; 64];
            for i in 0..5u8 {
                let sent = std::time::Instant::now();
                socket.send(&[i; 32]).await.unwrap();
                let len = socket.recv(&mut buf).await.unwrap();
                assert_eq!(&buf[..len], &[i; 32]);
                rtts.push(sent.elapsed());
            }
            rtts.sort();
            eprintln!("RTTs through a 40 ms + 40 ms relay: {rtts:?}");
            assert!(rtts[0] >= Duration::from_millis(80), "{rtts:?}");
            assert!(rtts[2] < Duration::from_millis(250), "{rtts:?}");
            let stats = relay.stats();
            assert_eq!((stats.up.datagrams_in, stats.up.datagrams_out), (5, 5));
            assert_eq!((stats.down.datagrams_in, stats.down.datagrams_out), (5, 5));
            assert_eq!((stats.up.bytes_out, stats.sessions), (160, 1));
            relay.shutdown().await;
            echo.abort();
        })
        .await
        .expect("bounded in time");
    }

    #[tokio::test]
    async fn loss_shows_up_and_clients_get_only_their_replies() {
        timeout(Duration::from_secs(10), async {
            let (server, echo) = echo_server().await;
            let lossy = RelayLinkSpec {
                loss: 0.3,
                latency_ms: 5.0,
                ..RelayLinkSpec::default()
            };
            let relay = spawn_relay(config(server, lossy, RelayLinkSpec::default()))
                .await
                .unwrap();
            let (a, b) = (client().await, client().await);
            for i in 0..50u8 {
                a.send_to(&[b'a', i], relay.local_addr()).await.unwrap();
                b.send_to(&[b'b', i], relay.local_addr()).await.unwrap();
            }
            let quiet = Duration::from_millis(300);
            let (from_a, from_b) = tokio::join!(drain(&a, quiet), drain(&b, quiet));
            assert!(from_a.iter().all(|d| d[0] == b'a'));
            assert!(from_b.iter().all(|d| d[0] == b'b'));
            let stats = relay.stats();
            assert_eq!(stats.sessions, 2);
            assert_eq!(stats.up.datagrams_in, 100);
            let lost = stats.up.dropped.random_loss;
            assert!((10..=50).contains(&lost), "lost {lost} of 100 at 30%");
            assert_eq!(stats.up.datagrams_out, 100 - lost);
            assert_eq!((from_a.len() + from_b.len()) as u64, 100 - lost);
            assert_eq!(stats.down.dropped.total(), 0);
            relay.shutdown().await;
            echo.abort();
        })
        .await
        .expect("bounded in time");
    }

    #[tokio::test]
    async fn an_outage_blacks_out_the_start_and_shutdown_releases_the_port() {
        timeout(Duration::from_secs(10), async {
            let (server, echo) = echo_server().await;
            let down = RelayLinkSpec {
                outages: vec![link_model::OutageSpec {
                    start_s: 0.0,
                    duration_s: 0.2,
                }],
                ..RelayLinkSpec::default()
            };
            let relay = spawn_relay(config(server, RelayLinkSpec::default(), down))
                .await
                .unwrap();
            let addr = relay.local_addr();
            let socket = client().await;
            socket.send_to(b"early", addr).await.unwrap();
            assert!(drain(&socket, Duration::from_millis(100)).await.is_empty());
            sleep(Duration::from_millis(150)).await;
            socket.send_to(b"late", addr).await.unwrap();
            let replies = drain(&socket, Duration::from_millis(200)).await;
            assert_eq!(replies, vec![b"late".to_vec()]);
            assert_eq!(relay.stats().down.dropped.outage, 1);
            relay.shutdown().await;
            // The listen socket is closed: its port can be bound again.
            UdpSocket::bind(addr).await.expect("port released");
            echo.abort();
        })
        .await
        .expect("bounded in time");
    }

    #[tokio::test]
    async fn a_bad_trace_file_is_named() {
        let missing = RelayLinkSpec {
            trace: Some(link_model::TraceSpec {
                path: "/nonexistent/relay-test.up".into(),
                format: link_model::TraceFormat::Mahimahi,
                looped: true,
            }),
            ..RelayLinkSpec::default()
        };
        let err = spawn_relay(config(
            "127.0.0.1:9".parse().unwrap(),
            missing,
            RelayLinkSpec::default(),
        ))
        .await
        .unwrap_err();
        assert!(
            err.to_string().contains("/nonexistent/relay-test.up"),
            "{err}"
        );
    }
}
