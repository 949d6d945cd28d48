//! The asynchronous half of a training node's cluster runtime (tokio + QUIC): joins the
//! coordinator (re-joining after a lost connection), renews the lease, keeps one connection
//! per aggregator of the layer map (subscribing on every (re)connect so the newest global
//! versions arrive), and moves messages between those connections and the
//! [`super::driver::SyncDriver`] on the training thread. It holds no protocol logic.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use protocol::{
    AggregatorAddr, Capabilities, Heartbeat, Join, JoinAck, Leave, Message, Role, Subscribe,
};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn};
use transport::{PeerConnection, QuicNode};

use super::driver::{NetEvent, Outbox};
use super::mailbox::VersionMailbox;
use crate::config::NodeId;

/// What the network task needs to know.
#[derive(Clone, Debug)]
pub struct NetConfig {
    /// This node's id.
    pub node_id: NodeId,
    /// Its role (worker or edge).
    pub role: Role,
    /// Coordinator address and certificate name.
    pub coordinator: SocketAddr,
    /// The coordinator's node name (its certificate's CN).
    pub coordinator_name: String,
    /// Join credentials.
    pub credentials: String,
    /// Rewrites of aggregator addresses (e.g. through a lossy relay): `real → dial`.
    pub address_overrides: HashMap<SocketAddr, SocketAddr>,
    /// Heartbeat interval.
    pub heartbeat_every: Duration,
    /// Timeout of one message send (a stream that cannot finish is reset).
    pub send_timeout: Duration,
}

/// Commands from the driver.
#[derive(Debug)]
enum NetCommand {
    ToAggregator(NodeId, Message),
    ToCoordinator(Message),
}

/// The driver's [`Outbox`]: a channel into the network task.
#[derive(Clone, Debug)]
pub struct ChannelOutbox {
    tx: mpsc::UnboundedSender<NetCommand>,
}

impl Outbox for ChannelOutbox {
    fn to_aggregator(&self, to: NodeId, msg: Message) {
        let _ = self.tx.send(NetCommand::ToAggregator(to, msg));
    }
    fn to_coordinator(&self, msg: Message) {
        let _ = self.tx.send(NetCommand::ToCoordinator(msg));
    }
}

/// Live connections, shared by the tasks of the network side.
#[derive(Default)]
struct Links {
    coordinator: Option<PeerConnection>,
    aggregators: HashMap<NodeId, PeerConnection>,
    /// Aggregators a connection task runs for.
    managed: HashSet<NodeId>,
}

/// The network side of a node, started by [`start_node_net`].
pub struct NodeNet {
    /// Give this to the driver.
    pub outbox: ChannelOutbox,
    /// The first `JoinAck` (the map and versions a node bootstraps with).
    pub join_ack: JoinAck,
    links: Arc<Mutex<Links>>,
    shutdown: CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

impl NodeNet {
    /// Sends `Leave` to the coordinator (best effort, bounded) and stops every task.
    pub async fn leave(self, reason: &str) {
        let coordinator = self.links.lock().ok().and_then(|l| l.coordinator.clone());
        if let Some(c) = coordinator {
            let msg = Message::Leave(Leave {
                node_id: self.join_ack.node_id,
                reason: reason.to_string(),
            });
            let _ = c.send_with_timeout(&msg, Duration::from_secs(1)).await;
            c.close("leaving");
        }
        self.shutdown.cancel();
        let _ = tokio::time::timeout(Duration::from_secs(2), self.task).await;
    }

    /// Whether a connection to aggregator `id` is up.
    pub fn aggregator_connected(&self, id: NodeId) -> bool {
        self.links
            .lock()
            .map(|l| l.aggregators.contains_key(&id))
            .unwrap_or(false)
    }
}

/// Why the node could not join.
#[derive(Debug, thiserror::Error)]
pub enum JoinError {
    /// The coordinator refused us (wrong credentials, ...).
    #[error("the coordinator at {addr} refused to admit this node: {reason}")]
    Refused {
        /// Coordinator address.
        addr: SocketAddr,
        /// Its reason.
        reason: String,
    },
    /// No coordinator answered in time.
    #[error("no answer from the coordinator at {addr} within {secs} s (is it running? are the certificates from the same `dreamddp certs` run?): {last}")]
    Unreachable {
        /// Coordinator address.
        addr: SocketAddr,
        /// How long we tried.
        secs: u64,
        /// Last error seen.
        last: String,
    },
}

/// Joins the cluster (retrying for up to `join_timeout`) and starts the network tasks;
/// events for the driver go to `events`.
pub async fn start_node_net(
    quic: Arc<QuicNode>,
    config: NetConfig,
    capabilities: Capabilities,
    join_timeout: Duration,
    events: std::sync::mpsc::Sender<NetEvent>,
) -> Result<NodeNet, JoinError> {
    let (coordinator, join_ack) = join(&quic, &config, &capabilities, join_timeout).await?;
    info!(
        "[JOIN] node={} joined: map epoch {} with {} aggregators",
        config.node_id,
        join_ack.map_epoch,
        join_ack.aggregators.len()
    );
    let links = Arc::new(Mutex::new(Links {
        coordinator: Some(coordinator.clone()),
        ..Links::default()
    }));
    let shutdown = CancellationToken::new();
    let (tx, rx) = mpsc::unbounded_channel();
    let ctx = Ctx {
        quic,
        config,
        capabilities,
        links: Arc::clone(&links),
        events,
        shutdown: shutdown.clone(),
        delta_sends: Arc::default(),
        versions: Arc::default(),
    };
    ctx.ensure_aggregators(&join_ack.aggregators);
    let task = tokio::spawn(ctx.run(coordinator, rx));
    Ok(NodeNet {
        outbox: ChannelOutbox { tx },
        join_ack,
        links,
        shutdown,
        task,
    })
}

async fn join(
    quic: &QuicNode,
    config: &NetConfig,
    capabilities: &Capabilities,
    timeout: Duration,
) -> Result<(PeerConnection, JoinAck), JoinError> {
    let started = tokio::time::Instant::now();
    let mut backoff = Duration::from_millis(100);
    let mut last = String::from("not tried");
    while started.elapsed() < timeout {
        match join_once(quic, config, capabilities).await {
            Ok(ok) => return Ok(ok),
            Err(JoinAttempt::Refused(reason)) => {
                return Err(JoinError::Refused {
                    addr: config.coordinator,
                    reason,
                })
            }
            Err(JoinAttempt::Retry(e)) => {
                debug!("join attempt failed: {e}");
                last = e;
            }
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(2));
    }
    Err(JoinError::Unreachable {
        addr: config.coordinator,
        secs: timeout.as_secs(),
        last,
    })
}

enum JoinAttempt {
    Refused(String),
    Retry(String),
}

async fn join_once(
    quic: &QuicNode,
    config: &NetConfig,
    capabilities: &Capabilities,
) -> Result<(PeerConnection, JoinAck), JoinAttempt> {
    let conn = quic
        .connect(config.coordinator, &config.coordinator_name)
        .await
        .map_err(|e| JoinAttempt::Retry(e.to_string()))?;
    let join = Message::Join(Join {
        node_id: config.node_id,
        role: config.role,
        credentials: config.credentials.clone(),
        capabilities: capabilities.clone(),
        listen_addr: String::new(),
    });
    conn.send_with_timeout(&join, config.send_timeout)
        .await
        .map_err(|e| JoinAttempt::Retry(e.to_string()))?;
    let answer = tokio::time::timeout(Duration::from_secs(5), conn.recv())
        .await
        .map_err(|_| JoinAttempt::Retry("no JoinAck within 5 s".into()))?
        .map_err(|e| JoinAttempt::Retry(e.to_string()))?;
    match answer {
        Message::JoinAck(ack) => Ok((conn, ack)),
        Message::Error(e) => Err(JoinAttempt::Refused(format!("{:?}: {}", e.code, e.text))),
        other => Err(JoinAttempt::Retry(format!(
            "expected JoinAck, got {}",
            other.kind()
        ))),
    }
}

#[derive(Clone)]
struct Ctx {
    quic: Arc<QuicNode>,
    config: NetConfig,
    capabilities: Capabilities,
    links: Arc<Mutex<Links>>,
    events: std::sync::mpsc::Sender<NetEvent>,
    shutdown: CancellationToken,
    /// Global versions waiting for the training thread.
    versions: Arc<VersionMailbox>,
    /// The latest delta send per (aggregator, layer): a new attempt of a layer cancels the
    /// previous one — its send task if it is still handing the frame to QUIC, its stream if
    /// QUIC still holds bytes of it — so retransmissions never pile up on a slow link or in
    /// the connection's send buffer.
    delta_sends: Arc<Mutex<HashMap<(NodeId, u32), DeltaSend>>>,
}

/// One delta send of [`Ctx::delta_sends`].
struct DeltaSend {
    /// Tells this attempt from a newer one of the same slot.
    generation: u64,
    task: tokio::task::AbortHandle,
    /// The finished stream, once the task handed the whole frame to QUIC.
    sent: Option<transport::SentStream>,
}

impl DeltaSend {
    /// Cancels the send and discards what QUIC still holds of it.
    fn cancel(self) {
        self.task.abort();
        if let Some(sent) = self.sent {
            sent.discard();
        }
    }
}

impl Ctx {
    fn links(&self) -> std::sync::MutexGuard<'_, Links> {
        self.links.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Starts a connection task for every aggregator not yet managed.
    fn ensure_aggregators(&self, aggregators: &[AggregatorAddr]) {
        for a in aggregators {
            let Ok(addr) = a.addr.parse::<SocketAddr>() else {
                error!(
                    "[ERROR] coordinator sent an unparsable aggregator address {:?}",
                    a.addr
                );
                continue;
            };
            if !self.links().managed.insert(a.node_id) {
                continue;
            }
            let dial = self
                .config
                .address_overrides
                .get(&addr)
                .copied()
                .unwrap_or(addr);
            let ctx = self.clone();
            let id = a.node_id;
            tokio::spawn(async move { ctx.aggregator_link(id, dial).await });
        }
    }

    /// Keeps a connection to one aggregator up until shutdown.
    async fn aggregator_link(self, id: NodeId, addr: SocketAddr) {
        let name = format!("aggregator-{id}");
        let mut backoff = Duration::from_millis(100);
        let mut revoked_reported = false;
        loop {
            if self.shutdown.is_cancelled() {
                return;
            }
            let attempt = tokio::select! {
                r = self.quic.connect(addr, "localhost") => r,
                () = self.shutdown.cancelled() => return,
            };
            match attempt {
                Ok(conn) => {
                    backoff = Duration::from_millis(100);
                    let sub = Message::Subscribe(Subscribe {
                        node_id: self.config.node_id,
                    });
                    if let Err(e) = conn.send_with_timeout(&sub, self.config.send_timeout).await {
                        warn!("[WARN] subscribing to {name} at {addr} failed: {e}");
                        continue;
                    }
                    self.links().aggregators.insert(id, conn.clone());
                    info!("[LINK] {name} at {addr} up");
                    let _ = self.events.send(NetEvent::AggregatorUp(id));
                    let reason = self.read_loop(&conn).await;
                    self.links().aggregators.remove(&id);
                    if self.shutdown.is_cancelled() {
                        return;
                    }
                    warn!("[WARN] link to {name} at {addr} lost: {reason}; reconnecting");
                }
                Err(e) if e.is_certificate_revoked() => {
                    if !revoked_reported {
                        error!(
                            "[ERROR] {name} at {addr} refuses this node: its certificate was \
                             revoked by the cluster's operator; training goes on offline and \
                             deltas stay cached. Ask for a new certificate \
                             (`dreamddp certs --nodes NAME`) and restart with it"
                        );
                        revoked_reported = true;
                    }
                }
                Err(e) => debug!("connecting to {name} at {addr}: {e}"),
            }
            tokio::select! {
                () = tokio::time::sleep(backoff) => {}
                () = self.shutdown.cancelled() => return,
            }
            backoff = (backoff * 2).min(Duration::from_secs(2));
        }
    }

    /// Forwards messages from `conn` to the driver until it fails; returns why.
    async fn read_loop(&self, conn: &PeerConnection) -> String {
        loop {
            let next = tokio::select! {
                r = conn.recv() => r,
                () = self.shutdown.cancelled() => return "shutdown".into(),
            };
            match next {
                Ok(Message::LayerMap(map)) => {
                    self.ensure_aggregators(&map.aggregators);
                    let _ = self.events.send(NetEvent::Message(Message::LayerMap(map)));
                }
                Ok(Message::LayerVersion(v)) => {
                    debug!(
                        "version received: layer={} version={} bytes={}",
                        v.layer_id,
                        v.version,
                        v.payload.len()
                    );
                    let notify = self.versions.put(v);
                    if notify
                        && self
                            .events
                            .send(NetEvent::Versions(Arc::clone(&self.versions)))
                            .is_err()
                    {
                        return "driver gone".into();
                    }
                }
                Ok(msg) => {
                    if self.events.send(NetEvent::Message(msg)).is_err() {
                        return "driver gone".into();
                    }
                }
                Err(e) if e.is_peer_fault() => {
                    error!(
                        "[ERROR] peer={} sent a bad frame: {e}; disconnecting",
                        conn.peer_name()
                    );
                    conn.close("bad frame");
                    return e.to_string();
                }
                Err(e) => return e.to_string(),
            }
        }
    }

    async fn run(
        self,
        coordinator: PeerConnection,
        mut commands: mpsc::UnboundedReceiver<NetCommand>,
    ) {
        let coord_task = tokio::spawn(self.clone().coordinator_link(coordinator));
        let mut heartbeat = tokio::time::interval(self.config.heartbeat_every);
        loop {
            tokio::select! {
                () = self.shutdown.cancelled() => break,
                cmd = commands.recv() => {
                    let Some(cmd) = cmd else { break };
                    self.dispatch(cmd);
                }
                _ = heartbeat.tick() => {
                    self.dispatch(NetCommand::ToCoordinator(Message::Heartbeat(Heartbeat {
                        node_id: self.config.node_id,
                        lease_ms: 0,
                        now_ms: 0,
                    })));
                }
            }
        }
        coord_task.abort();
    }

    fn dispatch(&self, cmd: NetCommand) {
        let (conn, msg, slot) = match cmd {
            NetCommand::ToAggregator(id, msg) => {
                let slot = match &msg {
                    Message::LayerDelta(p) => Some((id, p.layer_id)),
                    _ => None,
                };
                (self.links().aggregators.get(&id).cloned(), msg, slot)
            }
            NetCommand::ToCoordinator(msg) => (self.links().coordinator.clone(), msg, None),
        };
        let Some(conn) = conn else {
            debug!("no connection for a {} message; dropped", msg.kind());
            return;
        };
        let timeout = self.config.send_timeout;
        let Some(slot) = slot else {
            tokio::spawn(async move {
                if let Err(e) = conn.send_with_timeout(&msg, timeout).await {
                    debug!("send of {} to {} failed: {e}", msg.kind(), conn.peer_name());
                }
            });
            return;
        };
        let sends = Arc::clone(&self.delta_sends);
        let mut table = self.delta_sends.lock().unwrap_or_else(|p| p.into_inner());
        let generation = table.get(&slot).map_or(0, |d| d.generation + 1);
        let task = tokio::spawn(async move {
            match conn.send_replaceable(&msg, timeout).await {
                Ok(sent) => {
                    let mut table = sends.lock().unwrap_or_else(|p| p.into_inner());
                    match table.get_mut(&slot) {
                        Some(d) if d.generation == generation => d.sent = Some(sent),
                        // Superseded while it was being handed over.
                        _ => sent.discard(),
                    }
                }
                Err(e) => debug!("send of {} to {} failed: {e}", msg.kind(), conn.peer_name()),
            }
        });
        let previous = table.insert(
            slot,
            DeltaSend {
                generation,
                task: task.abort_handle(),
                sent: None,
            },
        );
        drop(table);
        if let Some(previous) = previous {
            previous.cancel();
        }
    }

    /// Reads from the coordinator; re-joins when the connection is lost.
    async fn coordinator_link(self, mut conn: PeerConnection) {
        loop {
            let reason = self.read_loop(&conn).await;
            self.links().coordinator = None;
            if self.shutdown.is_cancelled() {
                return;
            }
            warn!("[WARN] coordinator connection lost: {reason}; re-joining");
            loop {
                match join(
                    &self.quic,
                    &self.config,
                    &self.capabilities,
                    Duration::from_secs(30),
                )
                .await
                {
                    Ok((c, ack)) => {
                        info!("[JOIN] re-joined: map epoch {}", ack.map_epoch);
                        self.ensure_aggregators(&ack.aggregators);
                        let _ = self.events.send(NetEvent::Message(Message::LayerMap(
                            protocol::LayerMap {
                                epoch: ack.map_epoch,
                                owners: ack.layer_owners.clone(),
                                aggregators: ack.aggregators.clone(),
                                layer_versions: ack.layer_versions.clone(),
                                layer_producers: ack.layer_producers.clone(),
                                releasing_layers: ack.releasing_layers.clone(),
                            },
                        )));
                        self.links().coordinator = Some(c.clone());
                        conn = c;
                        break;
                    }
                    Err(JoinError::Refused { reason, .. }) => {
                        let _ = self.events.send(NetEvent::Fatal(format!(
                            "the coordinator refused the re-join: {reason}"
                        )));
                        return;
                    }
                    Err(e) => {
                        if self.shutdown.is_cancelled() {
                            return;
                        }
                        warn!("[WARN] {e}");
                    }
                }
            }
        }
    }
}
