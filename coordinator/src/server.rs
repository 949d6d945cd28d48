//! The tokio shell around [`CoordinatorState`]: a QUIC endpoint (mutual TLS, via the
//! `transport` crate), one reader and one writer task per connection, dialers for the
//! subscriptions to aggregators, and the HTTP status endpoint.
//!
//! One task owns the state machine. Reader tasks feed it received messages over a channel;
//! it handles them, fires lease timeouts (`sleep_until` on
//! [`CoordinatorState::poll_timeout`]), answers status requests, and routes every
//! [`Output`] to the writer task of its connection (so messages to one peer leave in order
//! and a slow peer never blocks the others).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use protocol::{Message, Subscribe};
use serde::Serialize;
use tokio::sync::mpsc;
use tokio::task::AbortHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn};
use transport::{PeerConnection, QuicNode, TlsIdentity, TransportConfig, TransportError};

use crate::config::{ConnId, CoordinatorConfig};
use crate::http::{self, StatusRequest};
use crate::log::{log_event, EventCounts};
use crate::output::Output;
use crate::state::CoordinatorState;
use crate::status::StatusReport;

/// Node id the coordinator uses when it subscribes to aggregators (members get ids ≥ 1).
pub const COORDINATOR_NODE_ID: u64 = 0;
/// How long a single message may take to leave before its stream is reset.
const SEND_TIMEOUT: Duration = Duration::from_secs(5);
/// Time given to queued messages (e.g. an `Unauthorized` reply) to reach the peer before
/// its connection is closed.
const CLOSE_GRACE: Duration = Duration::from_millis(200);
/// Messages queued per connection before the peer counts as not reading (and is closed).
const OUTBOX_CAPACITY: usize = 1024;
/// Received messages queued for the state task (readers wait when it is full).
const INBOUND_CAPACITY: usize = 4096;
/// Retry interval bounds for dialing an aggregator.
const DIAL_BACKOFF: (Duration, Duration) = (Duration::from_millis(100), Duration::from_secs(5));

/// Everything [`run_coordinator`] needs.
#[derive(Clone, Debug)]
pub struct CoordinatorRunConfig {
    /// UDP address of the QUIC endpoint (port 0: any free port).
    pub listen: SocketAddr,
    /// TCP address of the HTTP status endpoint (`None`: no endpoint).
    pub status_addr: Option<SocketAddr>,
    /// Directory holding `ca.pem` and `<node_name>.pem/.key`.
    pub certs_dir: PathBuf,
    /// This coordinator's node name (its certificate CN).
    pub node_name: String,
    /// QUIC timeouts, windows and limits.
    pub transport: TransportConfig,
    /// The state machine's configuration.
    pub state: CoordinatorConfig,
}

/// Why the coordinator could not start.
#[derive(Debug, thiserror::Error)]
pub enum CoordinatorError {
    /// The configuration is unusable.
    #[error("invalid coordinator config: {0}")]
    InvalidConfig(String),
    /// The QUIC endpoint could not be set up (certificates, socket).
    #[error("QUIC endpoint on {addr}: {source}")]
    Transport {
        /// The address.
        addr: SocketAddr,
        /// The transport error.
        #[source]
        source: TransportError,
    },
    /// The status endpoint could not be bound.
    #[error("cannot bind the status endpoint on {addr}: {source}")]
    StatusBind {
        /// The address.
        addr: SocketAddr,
        /// The socket error.
        #[source]
        source: std::io::Error,
    },
    /// The status endpoint's thread could not be started.
    #[error("cannot start the status endpoint's thread: {0}")]
    StatusThread(#[source] std::io::Error),
}

/// What a coordinator run leaves behind.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct CoordinatorSummary {
    /// The status at shutdown.
    pub status: StatusReport,
    /// How often each kind of event happened.
    pub events: EventCounts,
}

/// A bound coordinator, not yet serving: lets a caller learn its addresses (port 0) first.
#[derive(Debug)]
pub struct CoordinatorServer {
    state: CoordinatorState,
    quic: Arc<QuicNode>,
    status_listener: Option<tokio::net::TcpListener>,
}

/// Bind and serve until `shutdown` is cancelled.
pub async fn run_coordinator(
    cfg: CoordinatorRunConfig,
    shutdown: CancellationToken,
) -> Result<CoordinatorSummary, CoordinatorError> {
    CoordinatorServer::bind(cfg).await?.run(shutdown).await
}

impl CoordinatorServer {
    /// Load the certificates, bind the QUIC endpoint and the status listener. Must be
    /// called inside a tokio runtime.
    pub async fn bind(cfg: CoordinatorRunConfig) -> Result<CoordinatorServer, CoordinatorError> {
        if cfg.state.lease_ms == 0 {
            return Err(CoordinatorError::InvalidConfig(
                "lease_ms must be positive".into(),
            ));
        }
        if cfg.state.credentials.is_empty() {
            warn!("[WARN] empty join credentials: any node with a cluster certificate can join");
        }
        let identity = TlsIdentity::in_dir(&cfg.certs_dir, &cfg.node_name);
        let quic = QuicNode::bind(cfg.listen, &identity, &cfg.transport).map_err(|source| {
            CoordinatorError::Transport {
                addr: cfg.listen,
                source,
            }
        })?;
        let status_listener = match cfg.status_addr {
            Some(addr) => Some(
                tokio::net::TcpListener::bind(addr)
                    .await
                    .map_err(|source| CoordinatorError::StatusBind { addr, source })?,
            ),
            None => None,
        };
        Ok(CoordinatorServer {
            state: CoordinatorState::new(cfg.state),
            quic: Arc::new(quic),
            status_listener,
        })
    }

    /// The QUIC endpoint's address.
    pub fn local_addr(&self) -> Result<SocketAddr, TransportError> {
        self.quic.local_addr()
    }

    /// The status endpoint's address, if it has one.
    pub fn status_addr(&self) -> Option<SocketAddr> {
        self.status_listener
            .as_ref()
            .and_then(|l| l.local_addr().ok())
    }

    /// Serve until `shutdown` is cancelled; returns the final status and event counts.
    pub async fn run(
        self,
        shutdown: CancellationToken,
    ) -> Result<CoordinatorSummary, CoordinatorError> {
        let (inbound_tx, inbound_rx) = mpsc::channel(INBOUND_CAPACITY);
        let (status_tx, status_rx) = mpsc::channel::<StatusRequest>(16);
        let addr = self.local_addr().ok();
        info!(
            "[START] coordinator listening on {} (status on {})",
            addr.map_or_else(|| "?".into(), |a| a.to_string()),
            self.status_addr()
                .map_or_else(|| "-".into(), |a| format!("http://{a}/status"))
        );
        // The operator endpoint runs on a thread and runtime of its own, so a probe never
        // queues behind the QUIC tasks of a large fleet on the shared worker threads.
        let http_task = match self.status_listener {
            Some(listener) => Some(
                spawn_status_thread(listener, status_tx, shutdown.clone())
                    .map_err(CoordinatorError::StatusThread)?,
            ),
            None => None,
        };
        let accept_task = tokio::spawn(accept_loop(
            Arc::clone(&self.quic),
            inbound_tx.clone(),
            shutdown.clone(),
        ));
        let mut shell = Shell {
            state: self.state,
            quic: Arc::clone(&self.quic),
            inbound_tx,
            links: HashMap::new(),
            subscriptions: HashMap::new(),
            next_subscription_conn: SUBSCRIPTION_CONN_BASE,
            counts: EventCounts::default(),
            start: Instant::now(),
        };
        let summary = shell.serve(inbound_rx, status_rx, shutdown).await;
        accept_task.abort();
        shell.stop();
        self.quic.close();
        if let Some(task) = http_task {
            if tokio::time::timeout(Duration::from_secs(2), task)
                .await
                .is_err()
            {
                warn!("[WARN] status endpoint did not stop within 2 s");
            }
        }
        info!(
            "[STOP] coordinator: {} members, map epoch {}",
            summary.status.members.len(),
            summary.status.map_epoch
        );
        Ok(summary)
    }
}

/// Connection ids of accepted connections count up from 1; those of subscriptions the
/// coordinator dials count up from here, so the two never collide.
const SUBSCRIPTION_CONN_BASE: ConnId = 1 << 62;

enum Inbound {
    Connected { conn: ConnId, link: PeerConnection },
    Message { conn: ConnId, msg: Message },
    Closed { conn: ConnId },
}

enum Outgoing {
    Message(Message),
    Close(String),
}

struct Link {
    peer: String,
    connection: PeerConnection,
    outbox: mpsc::Sender<Outgoing>,
    tasks: [AbortHandle; 2],
}

struct SubscriptionLink {
    conn: ConnId,
    addr: SocketAddr,
    name: String,
    dialer: AbortHandle,
}

struct Shell {
    state: CoordinatorState,
    quic: Arc<QuicNode>,
    inbound_tx: mpsc::Sender<Inbound>,
    links: HashMap<ConnId, Link>,
    /// Aggregator id → its subscription.
    subscriptions: HashMap<u64, SubscriptionLink>,
    next_subscription_conn: ConnId,
    counts: EventCounts,
    start: Instant,
}

impl Shell {
    fn now_ms(&self) -> u64 {
        u64::try_from(self.start.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    async fn serve(
        &mut self,
        mut inbound: mpsc::Receiver<Inbound>,
        mut status_requests: mpsc::Receiver<StatusRequest>,
        shutdown: CancellationToken,
    ) -> CoordinatorSummary {
        loop {
            let deadline = self
                .state
                .poll_timeout()
                .map(|ms| self.start + Duration::from_millis(ms));
            let lease_timer = async {
                match deadline {
                    Some(at) => tokio::time::sleep_until(at).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                () = shutdown.cancelled() => break,
                Some(event) = inbound.recv() => self.handle_inbound(event),
                Some(reply) = status_requests.recv() => {
                    let _ = reply.send(self.state.status(self.now_ms()));
                }
                () = lease_timer => {
                    let now = self.now_ms();
                    self.state.handle_timeout(now);
                }
            }
            self.route_outputs();
        }
        CoordinatorSummary {
            status: self.state.status(self.now_ms()),
            events: self.counts.clone(),
        }
    }

    fn handle_inbound(&mut self, event: Inbound) {
        match event {
            Inbound::Connected { conn, link } => self.register(conn, link),
            Inbound::Message { conn, msg } => {
                let Some(peer) = self.links.get(&conn).map(|l| l.peer.clone()) else {
                    return;
                };
                debug!(peer, kind = msg.kind(), "received");
                let now = self.now_ms();
                self.state.handle_message(now, conn, &peer, msg);
            }
            Inbound::Closed { conn } => {
                if let Some(link) = self.links.remove(&conn) {
                    debug!(peer = link.peer, conn, "connection closed");
                    link.tasks.iter().for_each(AbortHandle::abort);
                }
                self.state.handle_disconnect(conn);
                self.redial_if_still_wanted(conn);
            }
        }
    }

    fn register(&mut self, conn: ConnId, connection: PeerConnection) {
        let peer = connection.peer_name().to_owned();
        let (outbox, queued) = mpsc::channel(OUTBOX_CAPACITY);
        let reader = tokio::spawn(read_loop(conn, connection.clone(), self.inbound_tx.clone()));
        let writer = tokio::spawn(write_loop(connection.clone(), queued));
        debug!(peer, conn, addr = %connection.remote_addr(), "connection registered");
        self.links.insert(
            conn,
            Link {
                peer,
                connection,
                outbox,
                tasks: [reader.abort_handle(), writer.abort_handle()],
            },
        );
    }

    fn route_outputs(&mut self) {
        while let Some(output) = self.state.poll_output() {
            match output {
                Output::Send { conn, msg } => self.queue(conn, Outgoing::Message(msg)),
                Output::Close { conn, reason } => self.queue(conn, Outgoing::Close(reason)),
                Output::Subscribe {
                    aggregator_id,
                    addr,
                    name,
                } => self.subscribe(aggregator_id, &addr, name),
                Output::Unsubscribe { aggregator_id } => self.unsubscribe(aggregator_id),
                Output::Event(event) => log_event(&event, &mut self.counts),
            }
        }
    }

    fn queue(&mut self, conn: ConnId, item: Outgoing) {
        let Some(link) = self.links.get(&conn) else {
            debug!(conn, "dropping output for a closed connection");
            return;
        };
        if let Err(mpsc::error::TrySendError::Full(_)) = link.outbox.try_send(item) {
            warn!(
                "[WARN] peer={} is not reading ({OUTBOX_CAPACITY} messages queued); closing its connection",
                link.peer
            );
            link.connection.close("not reading");
        }
    }

    fn subscribe(&mut self, aggregator_id: u64, addr: &str, name: String) {
        self.unsubscribe(aggregator_id);
        let Ok(addr) = addr.parse::<SocketAddr>() else {
            // The state machine only admits aggregators with a socket address.
            error!("[ERROR] aggregator id={aggregator_id} has no dialable address {addr:?}");
            return;
        };
        let conn = self.next_subscription_conn;
        self.next_subscription_conn += 1;
        let dialer = self.spawn_dialer(conn, addr, name.clone(), Duration::ZERO);
        self.subscriptions.insert(
            aggregator_id,
            SubscriptionLink {
                conn,
                addr,
                name,
                dialer,
            },
        );
    }

    fn unsubscribe(&mut self, aggregator_id: u64) {
        if let Some(sub) = self.subscriptions.remove(&aggregator_id) {
            sub.dialer.abort();
            if let Some(link) = self.links.remove(&sub.conn) {
                link.connection.close("unsubscribed");
                link.tasks.iter().for_each(AbortHandle::abort);
            }
        }
    }

    /// A subscription link broke while its aggregator is still a member: dial it again.
    fn redial_if_still_wanted(&mut self, conn: ConnId) {
        let Some((&aggregator_id, _)) = self.subscriptions.iter().find(|(_, s)| s.conn == conn)
        else {
            return;
        };
        let still_member = self
            .state
            .member(aggregator_id)
            .is_some_and(|m| m.role == protocol::Role::Aggregator);
        if !still_member {
            self.subscriptions.remove(&aggregator_id);
            return;
        }
        let new_conn = self.next_subscription_conn;
        self.next_subscription_conn += 1;
        let Some(sub) = self.subscriptions.get(&aggregator_id) else {
            return;
        };
        let (addr, name) = (sub.addr, sub.name.clone());
        warn!("[WARN] subscription to aggregator id={aggregator_id} lost; dialing {addr} again");
        let dialer = self.spawn_dialer(new_conn, addr, name, DIAL_BACKOFF.0);
        if let Some(sub) = self.subscriptions.get_mut(&aggregator_id) {
            sub.conn = new_conn;
            sub.dialer = dialer;
        }
    }

    fn spawn_dialer(
        &self,
        conn: ConnId,
        addr: SocketAddr,
        name: String,
        delay: Duration,
    ) -> AbortHandle {
        let quic = Arc::clone(&self.quic);
        let inbound = self.inbound_tx.clone();
        tokio::spawn(async move {
            tokio::time::sleep(delay).await;
            let mut backoff = DIAL_BACKOFF.0;
            loop {
                match dial_subscription(&quic, addr, &name).await {
                    Ok(link) => {
                        info!("[SUB] subscribed to aggregator {name} at {addr}");
                        let _ = inbound.send(Inbound::Connected { conn, link }).await;
                        return;
                    }
                    Err(e) => {
                        warn!("[WARN] subscribing to aggregator {name} at {addr}: {e}; retry in {backoff:?}");
                        tokio::time::sleep(backoff).await;
                        backoff = (backoff * 2).min(DIAL_BACKOFF.1);
                    }
                }
            }
        })
        .abort_handle()
    }

    fn stop(&mut self) {
        for sub in self.subscriptions.values() {
            sub.dialer.abort();
        }
        for link in self.links.values() {
            link.tasks.iter().for_each(AbortHandle::abort);
            link.connection.close("coordinator shutting down");
        }
        self.links.clear();
    }
}

async fn dial_subscription(
    quic: &QuicNode,
    addr: SocketAddr,
    name: &str,
) -> Result<PeerConnection, TransportError> {
    let link = quic.connect(addr, name).await?;
    let subscribe = Message::Subscribe(Subscribe {
        node_id: COORDINATOR_NODE_ID,
    });
    link.send_with_timeout(&subscribe, SEND_TIMEOUT).await?;
    Ok(link)
}

async fn accept_loop(
    quic: Arc<QuicNode>,
    inbound: mpsc::Sender<Inbound>,
    shutdown: CancellationToken,
) {
    let mut next_conn: ConnId = 1;
    loop {
        let accepted = tokio::select! {
            a = quic.accept() => a,
            () = shutdown.cancelled() => return,
        };
        match accepted {
            Some(Ok(link)) => {
                let conn = next_conn;
                next_conn += 1;
                if inbound
                    .send(Inbound::Connected { conn, link })
                    .await
                    .is_err()
                {
                    return;
                }
            }
            Some(Err(e)) => warn!("[WARN] refused a connection: {e}"),
            None => return,
        }
    }
}

/// Reads messages from one connection into the state task's channel. A peer fault (a
/// garbage, oversized or padded frame) closes this connection only.
async fn read_loop(conn: ConnId, link: PeerConnection, inbound: mpsc::Sender<Inbound>) {
    loop {
        match link.recv().await {
            Ok(msg) => {
                if inbound.send(Inbound::Message { conn, msg }).await.is_err() {
                    return;
                }
            }
            Err(e) if e.is_peer_fault() => {
                error!("[ERROR] peer={} reason={e}", link.peer_name());
                link.close("protocol violation: bad frame");
                break;
            }
            Err(e) => {
                debug!(peer = link.peer_name(), "connection ended: {e}");
                break;
            }
        }
    }
    let _ = inbound.send(Inbound::Closed { conn }).await;
}

/// Sends one connection's queued messages in order; a close waits [`CLOSE_GRACE`] so what
/// was queued before it can reach the peer.
async fn write_loop(link: PeerConnection, mut queued: mpsc::Receiver<Outgoing>) {
    while let Some(item) = queued.recv().await {
        match item {
            Outgoing::Message(msg) => {
                if let Err(e) = link.send_with_timeout(&msg, SEND_TIMEOUT).await {
                    warn!(
                        "[WARN] peer={} sending {} failed: {e}",
                        link.peer_name(),
                        msg.kind()
                    );
                    if matches!(e, TransportError::Closed | TransportError::Connection(_)) {
                        return;
                    }
                }
            }
            Outgoing::Close(reason) => {
                tokio::time::sleep(CLOSE_GRACE).await;
                link.close(&reason);
                return;
            }
        }
    }
}

#[cfg(test)]
#[path = "server_tests.rs"]
mod tests;

/// Serves `/status`, `/metrics` and `/healthz` on a thread with a current-thread runtime of
/// its own until `shutdown`; the returned receiver resolves when it has stopped.
fn spawn_status_thread(
    listener: tokio::net::TcpListener,
    status_tx: mpsc::Sender<StatusRequest>,
    shutdown: CancellationToken,
) -> std::io::Result<tokio::sync::oneshot::Receiver<()>> {
    let listener = listener.into_std()?;
    let (stopped_tx, stopped_rx) = tokio::sync::oneshot::channel();
    std::thread::Builder::new()
        .name("status-http".into())
        .spawn(move || {
            let runtime = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(runtime) => runtime,
                Err(e) => {
                    error!("[ERROR] status endpoint: no runtime: {e}");
                    return;
                }
            };
            runtime.block_on(async move {
                let served = match tokio::net::TcpListener::from_std(listener) {
                    Ok(listener) => {
                        axum::serve(listener, http::router(status_tx))
                            .with_graceful_shutdown(shutdown.cancelled_owned())
                            .await
                    }
                    Err(e) => Err(e),
                };
                if let Err(e) = served {
                    error!("[ERROR] status endpoint stopped: {e}");
                }
            });
            let _ = stopped_tx.send(());
        })?;
    Ok(stopped_rx)
}
