//! The aggregator process: a tokio + QUIC shell around the sans-IO [`AggregatorState`].
//!
//! One task owns the state machine. Connection tasks only read frames and forward them. After
//! each batch of inputs the shell persists the shard file (snapshot + applied ledger) **before**
//! it transmits the acks of that batch (group commit), so an acknowledged delta survives
//! `kill -9`, and a restarted aggregator resumes at the persisted versions (never going
//! backwards). The coordinator's layer map says which layers this aggregator owns.

use std::collections::{HashMap, HashSet};

use std::sync::Arc;
use std::time::{Duration, Instant};

use protocol::{
    encode_frame, Capabilities, ErrorCode, ErrorReply, Heartbeat, Join, LayerVersion, Leave,
    Message, NodeStats, Role,
};
use serde::Serialize;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn};
use transport::{PeerConnection, QuicNode, TlsIdentity};

use super::config::{version_interval, AggregatorRunConfig};
use super::initial::InitialLayers;
use super::shard_file::{AppliedEntry, ShardFileError, ShardStore};
use crate::config::{AggregatorConfig, OwnedLayer};
use crate::state::{AggEvent, AggregatorCounters, AggregatorState, Output};

/// Connection id of the coordinator link.
const COORDINATOR: u64 = 0;
/// Staleness histogram buckets (`τ = 0 .. 15`, then `≥ 16`).
const STALENESS_BUCKETS: usize = 17;
/// How long a layer released to us, of which no version was ever published, waits for the
/// old owner's release before starting from the initial weights (longer than the
/// coordinator's release timeout).
const FRESH_LAYER_WAIT: Duration = Duration::from_secs(3);

/// Why an aggregator process stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum AggregatorRunError {
    /// Config or model/data.
    #[error("{0}")]
    Setup(String),
    /// The shard file.
    #[error(transparent)]
    Shard(#[from] ShardFileError),
    /// QUIC endpoint.
    #[error("transport: {0}")]
    Transport(#[from] transport::TransportError),
    /// The coordinator refused us.
    #[error("the coordinator refused this aggregator: {0}")]
    Refused(String),
}

/// What an aggregator did (also written to `<data_dir>/stats.json` at exit).
#[derive(Clone, Debug, Serialize)]
pub struct AggregatorSummary {
    /// Node name.
    pub name: String,
    /// Node id.
    pub node_id: u64,
    /// Whether it resumed from a shard file.
    pub resumed: bool,
    /// Counters.
    pub deltas_received: u64,
    /// Deltas folded in.
    pub deltas_applied: u64,
    /// Duplicates rejected.
    pub duplicates_rejected: u64,
    /// Stale deltas refused.
    pub dropped_stale: u64,
    /// Bad inputs.
    pub bad_inputs: u64,
    /// Payload bytes in.
    pub bytes_in: u64,
    /// Payload bytes out.
    pub bytes_out: u64,
    /// Connections dropped for sending bad frames.
    pub bad_peers_disconnected: u64,
    /// `(layer_id, version)` of every owned layer.
    pub layer_versions: Vec<(u32, u64)>,
    /// Entries in the applied ledger.
    pub ledger_len: usize,
    /// Staleness τ of the deltas applied by this run of the process: counts for `τ = 0 .. 15`,
    /// then `τ ≥ 16`.
    pub staleness_histogram: Vec<u64>,
    /// Resident memory at exit and its peak over the run.
    pub memory: node::memory::ProcessMemory,
    /// CPU seconds the process used (user and system).
    pub cpu_seconds: f64,
    /// Subscribers connected at the end (nodes that asked for global versions).
    pub subscribers: usize,
    /// Layer versions sent to subscribers (each subscriber's copy counts).
    pub fanout: Fanout,
}

/// What an aggregator's broadcasts cost (`AggregatorSummary::fanout`).
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct Fanout {
    /// Layer-version sends to subscribers (one per subscriber and version sent).
    pub sends: u64,
    /// Frame bytes of those sends.
    pub bytes: u64,
    /// Versions replaced by a newer one while they waited for a busy subscriber (never sent).
    pub superseded: u64,
    /// Version sends that failed: the connection closed, or the stream stalled for
    /// [`VERSION_STALL_TIMEOUT`].
    pub failed: u64,
}

/// How long one layer-version send may take, until the subscriber has acknowledged every
/// byte, before its stream is reset.
///
/// A version's slot (one per subscriber and layer) is busy until the subscriber has the whole
/// frame; newer versions wait in it meanwhile, the newest replacing older ones. So a slow
/// subscriber has at most one version per layer in QUIC's buffers and gets the latest one
/// next, not a backlog (freeing the slot once the frame was merely buffered queued every
/// version in the connection, and a large layer never reached a device on a cellular link:
/// docs/fidelity.md, "Layer versions that never reached a slow device"). A slow link is not a
/// reason to reset either (a reset throws away every byte already sent): a dead peer is found
/// by QUIC's idle timeout, which fails the send at once; this bound is for a peer that keeps
/// its connection alive but stops reading.
pub const VERSION_STALL_TIMEOUT: Duration = Duration::from_secs(120);

enum Inbound {
    Message {
        conn: u64,
        peer: String,
        msg: Message,
    },
    /// A layer-version send to a subscriber finished (delivered, failed or timed out).
    VersionSent {
        conn: u64,
        layer: u32,
        /// The send failed (connection closed, or stalled: [`VERSION_STALL_TIMEOUT`]).
        failed: bool,
    },
    Connected {
        conn: u64,
        link: PeerConnection,
    },
    Closed {
        conn: u64,
    },
    BadPeer,
}

struct Shell {
    name: String,
    id: u64,
    state: AggregatorState,
    initial: InitialLayers,
    shard: ShardStore,
    /// Ledger entries applied since the last commit (they go to the log with it).
    pending_ledger: Vec<AppliedEntry>,
    /// The coordinator's certificate name: its subscription gets each version's ledger.
    coordinator_name: String,
    conns: HashMap<u64, PeerConnection>,
    conn_node: HashMap<u64, u64>,
    node_conn: HashMap<u64, u64>,
    subscribers: HashSet<u64>,
    clock: Instant,
    staleness: Vec<u64>,
    map_epoch: u64,
    /// The layers the newest map gives us.
    map_mine: HashSet<u32>,
    bad_peers: u64,
    resumed: bool,
    send_timeout: Duration,
    /// `[aggregation] broadcast_interval_ms`.
    broadcast_interval_ms: u64,
    /// `[aggregation] fanout_per_layer_per_s`.
    fanout_per_layer_per_s: u64,
    /// Per (subscriber, layer): a version send is in progress (until the subscriber has
    /// acknowledged it: [`VERSION_STALL_TIMEOUT`]), and the newest frame waiting behind it
    /// (older waiting versions are superseded, never queued: a slow subscriber gets the latest
    /// version, not a backlog).
    version_slots: HashMap<(u64, u32), Option<bytes::Bytes>>,
    /// What the broadcasts cost: per-subscriber version sends, their frame bytes, and
    /// versions replaced by a newer one before a busy subscriber could take them.
    fanout: Fanout,
    inbound_tx: mpsc::UnboundedSender<Inbound>,
    /// Layers the map gave us whose newest version is elsewhere: not served (deltas get
    /// `NotOwner`, their senders retry) until the coordinator's hand-over of at least this
    /// version arrives. Value: (version, since when we wait, when we last logged it).
    awaiting_handover: HashMap<u32, (u64, Instant, Instant)>,
    /// Hand-overs that arrived before the map that gives us their layer.
    early_handovers: HashMap<u32, LayerVersion>,
}

/// The frames of one broadcast: the coordinator's, with the version's at-most-once ledger
/// (it hands the ledger to the layer's next owner after a rebalance), and everyone else's,
/// without it (no trainer reads it, and with a fleet it is 16 bytes per node that ever
/// contributed to the layer, on every version to every subscriber).
struct BroadcastFrames {
    with_ledger: bytes::Bytes,
    without_ledger: bytes::Bytes,
}

/// Encodes a broadcast (see [`BroadcastFrames`]): the frame with the ledger only when
/// `with_ledger_needed` (the coordinator subscribes) and the version has one, else both are
/// the same frame; the payload is never copied. Also returns the layer of a version (`None`
/// for another message, e.g. a `Resync`: those are never superseded).
fn broadcast_frames(
    mut msg: Message,
    with_ledger_needed: bool,
) -> Result<(Option<u32>, BroadcastFrames), protocol::FrameError> {
    let (layer, ledger) = match &mut msg {
        Message::LayerVersion(v) => (Some(v.layer_id), std::mem::take(&mut v.applied_seqs)),
        _ => (None, Vec::new()),
    };
    let without_ledger = bytes::Bytes::from(encode_frame(&msg)?);
    let with_ledger = match &mut msg {
        Message::LayerVersion(v) if with_ledger_needed && !ledger.is_empty() => {
            v.applied_seqs = ledger;
            bytes::Bytes::from(encode_frame(&msg)?)
        }
        _ => without_ledger.clone(),
    };
    let frames = BroadcastFrames {
        with_ledger,
        without_ledger,
    };
    Ok((layer, frames))
}

/// Runs an aggregator until `shutdown` is cancelled.
pub async fn run_aggregator(
    config: AggregatorRunConfig,
    shutdown: CancellationToken,
) -> Result<AggregatorSummary, AggregatorRunError> {
    let state_config = config
        .state_config()
        .map_err(|e| AggregatorRunError::Setup(e.to_string()))?;
    let opened = {
        let config = config.clone();
        tokio::task::spawn_blocking(move || open_startup(&config, state_config))
            .await
            .map_err(|e| AggregatorRunError::Setup(e.to_string()))??
    };
    let Startup {
        state,
        resumed,
        initial,
        shard,
    } = opened;
    let versions: Vec<String> = state
        .layer_ids()
        .filter_map(|id| state.layer(id).map(|l| format!("{}@{}", l.name, l.version)))
        .collect();
    info!(
        "[START] aggregator={} id={} {} listen={}",
        config.node.name,
        config.node.id,
        if resumed {
            format!(
                "resumed from {} ({})",
                shard.path().display(),
                versions.join(" ")
            )
        } else {
            "fresh".to_string()
        },
        config.node.listen
    );

    let identity = TlsIdentity::in_dir(&config.node.certs_dir, &config.node.name);
    let transport_config = config
        .transport
        .to_config()
        .map_err(|e| AggregatorRunError::Setup(e.to_string()))?;
    let quic = Arc::new(QuicNode::bind(
        config.node.listen,
        &identity,
        &transport_config,
    )?);
    let listen = quic.local_addr()?;
    let (tx, mut rx) = mpsc::unbounded_channel::<Inbound>();
    tokio::spawn(accept_loop(Arc::clone(&quic), tx.clone(), shutdown.clone()));
    tokio::spawn(coordinator_link(
        Arc::clone(&quic),
        config.clone(),
        listen.to_string(),
        tx.clone(),
        shutdown.clone(),
    ));

    let mut shell = Shell {
        name: config.node.name.clone(),
        id: config.node.id,
        state,
        initial,
        shard,
        pending_ledger: Vec::new(),
        coordinator_name: config.node.coordinator_name.clone(),
        conns: HashMap::new(),
        conn_node: HashMap::new(),
        node_conn: HashMap::new(),
        subscribers: HashSet::new(),
        clock: Instant::now(),
        staleness: vec![0; STALENESS_BUCKETS],
        map_epoch: 0,
        map_mine: HashSet::new(),
        bad_peers: 0,
        resumed,
        send_timeout: Duration::from_secs(10),
        broadcast_interval_ms: config.aggregation.broadcast_interval_ms,
        fanout_per_layer_per_s: config.aggregation.fanout_per_layer_per_s,
        version_slots: HashMap::new(),
        fanout: Fanout::default(),
        inbound_tx: tx.clone(),
        awaiting_handover: HashMap::new(),
        early_handovers: HashMap::new(),
    };
    let mut stats_tick = tokio::time::interval(Duration::from_millis(500));
    let mut fatal = None;
    loop {
        let timeout = shell
            .state
            .poll_timeout()
            .map(|t| shell.clock + Duration::from_nanos(t));
        tokio::select! {
            () = shutdown.cancelled() => break,
            item = rx.recv() => {
                let Some(item) = item else { break };
                if let Err(e) = shell.handle(item) {
                    fatal = Some(e);
                    break;
                }
                // Group commit: take everything already queued before persisting once.
                let mut n = 0;
                while n < 256 {
                    match rx.try_recv() {
                        Ok(item) => {
                            if let Err(e) = shell.handle(item) {
                                fatal = Some(e);
                                break;
                            }
                        }
                        Err(_) => break,
                    }
                    n += 1;
                }
                if fatal.is_some() {
                    break;
                }
                shell.flush()?;
            }
            () = sleep_until_opt(timeout) => {
                let now = shell.now();
                shell.state.handle_timeout(now);
                shell.flush()?;
            }
            _ = stats_tick.tick() => {
                shell.report_waiting();
                shell.report_stats();
            }
        }
    }
    shell.flush()?;
    shell.persist()?;
    if let Some(c) = shell.conns.get(&COORDINATOR) {
        let leave = Message::Leave(Leave {
            node_id: shell.id,
            reason: "shutting down".into(),
        });
        let _ = c
            .send_with_timeout(&leave, Duration::from_millis(500))
            .await;
    }
    quic.close();
    let summary = shell.summary();
    let path = config.node.data_dir.join("stats.json");
    let _ = std::fs::write(
        &path,
        serde_json::to_string_pretty(&summary).unwrap_or_default(),
    );
    if let Some(e) = fatal {
        return Err(e);
    }
    info!(
        "[DONE] aggregator={} applied={} duplicates={}",
        summary.name, summary.deltas_applied, summary.duplicates_rejected
    );
    Ok(summary)
}

/// What an aggregator starts from.
#[derive(Debug)]
struct Startup {
    state: AggregatorState,
    resumed: bool,
    initial: InitialLayers,
    shard: ShardStore,
}

/// Opens the shard file: a restart resumes from it **without building the initial
/// weights**; a fresh start builds them from the model section (no data set is read).
fn open_startup(
    config: &AggregatorRunConfig,
    state_config: AggregatorConfig,
) -> Result<Startup, AggregatorRunError> {
    let mut initial =
        InitialLayers::new(config.model.clone()).map_err(AggregatorRunError::Setup)?;
    std::fs::create_dir_all(&config.node.data_dir).map_err(|source| ShardFileError::Io {
        path: config.node.data_dir.clone(),
        source,
    })?;
    let shard_path = config.node.data_dir.join("shard.bin");
    let (shard, snapshot) = ShardStore::open(&shard_path)?;
    let (state, resumed) = match snapshot {
        Some(snapshot) => {
            let state = AggregatorState::restore(&snapshot, state_config)
                .map_err(|e| AggregatorRunError::Setup(format!("{}: {e}", shard_path.display())))?;
            (state, true)
        }
        None => {
            initial.build().map_err(AggregatorRunError::Setup)?;
            let state = AggregatorState::new(config.node.id, Vec::new(), state_config)
                .map_err(|e| AggregatorRunError::Setup(e.to_string()))?;
            (state, false)
        }
    };
    Ok(Startup {
        state,
        resumed,
        initial,
        shard,
    })
}

async fn sleep_until_opt(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(tokio::time::Instant::from_std(at)).await,
        None => std::future::pending().await,
    }
}

async fn accept_loop(
    quic: Arc<QuicNode>,
    tx: mpsc::UnboundedSender<Inbound>,
    shutdown: CancellationToken,
) {
    let mut next_conn = COORDINATOR + 1;
    loop {
        let incoming = tokio::select! {
            i = quic.accept() => i,
            () = shutdown.cancelled() => return,
        };
        match incoming {
            None => return,
            Some(Err(e)) => debug!("handshake failed: {e}"),
            Some(Ok(link)) => {
                let conn = next_conn;
                next_conn += 1;
                debug!(
                    "connection {conn} from {} ({})",
                    link.peer_name(),
                    link.remote_addr()
                );
                let _ = tx.send(Inbound::Connected {
                    conn,
                    link: link.clone(),
                });
                tokio::spawn(read_loop(conn, link, tx.clone()));
            }
        }
    }
}

/// Forwards every message of one connection; a peer sending bad frames is disconnected.
async fn read_loop(conn: u64, link: PeerConnection, tx: mpsc::UnboundedSender<Inbound>) {
    let peer = link.peer_name().to_string();
    loop {
        match link.recv().await {
            Ok(msg) => {
                if tx
                    .send(Inbound::Message {
                        conn,
                        peer: peer.clone(),
                        msg,
                    })
                    .is_err()
                {
                    return;
                }
            }
            Err(e) if e.is_peer_fault() => {
                error!(
                    "[ERROR] peer={peer} addr={} sent a bad frame: {e}; disconnected",
                    link.remote_addr()
                );
                link.close("bad frame");
                let _ = tx.send(Inbound::BadPeer);
                let _ = tx.send(Inbound::Closed { conn });
                return;
            }
            Err(e) => {
                debug!("connection {conn} ({peer}) closed: {e}");
                let _ = tx.send(Inbound::Closed { conn });
                return;
            }
        }
    }
}

/// Joins the coordinator as an aggregator, heartbeats, and re-joins after a lost link.
async fn coordinator_link(
    quic: Arc<QuicNode>,
    config: AggregatorRunConfig,
    listen: String,
    tx: mpsc::UnboundedSender<Inbound>,
    shutdown: CancellationToken,
) {
    let mut backoff = Duration::from_millis(100);
    loop {
        if shutdown.is_cancelled() {
            return;
        }
        let attempt = tokio::select! {
            r = quic.connect(config.node.coordinator, &config.node.coordinator_name) => r,
            () = shutdown.cancelled() => return,
        };
        match attempt {
            Ok(link) => {
                backoff = Duration::from_millis(100);
                let local_ip = link
                    .local_ip()
                    .or_else(|| super::advertise::route_source_ip(config.node.coordinator));
                let listen_addr =
                    super::advertise::advertised_addr(config.node.advertise, &listen, local_ip);
                info!(
                    "[JOIN] joining the coordinator at {}, advertised as {listen_addr}",
                    config.node.coordinator
                );
                let join = Message::Join(Join {
                    node_id: config.node.id,
                    role: Role::Aggregator,
                    credentials: config.node.credentials.clone(),
                    capabilities: Capabilities::default(),
                    listen_addr,
                });
                if let Err(e) = link.send_with_timeout(&join, Duration::from_secs(5)).await {
                    warn!("[WARN] join message to the coordinator failed: {e}");
                } else {
                    let _ = tx.send(Inbound::Connected {
                        conn: COORDINATOR,
                        link: link.clone(),
                    });
                    let beat = {
                        let link = link.clone();
                        let id = config.node.id;
                        tokio::spawn(async move {
                            // First beat after the join had time to land (separate streams may
                            // complete out of order).
                            let period = Duration::from_millis(500);
                            let mut tick = tokio::time::interval_at(
                                tokio::time::Instant::now() + period,
                                period,
                            );
                            loop {
                                tick.tick().await;
                                let hb = Message::Heartbeat(Heartbeat {
                                    node_id: id,
                                    lease_ms: 0,
                                    now_ms: 0,
                                });
                                if link
                                    .send_with_timeout(&hb, Duration::from_secs(2))
                                    .await
                                    .is_err()
                                {
                                    return;
                                }
                            }
                        })
                    };
                    loop {
                        let next = tokio::select! {
                            r = link.recv() => r,
                            () = shutdown.cancelled() => { beat.abort(); return; }
                        };
                        match next {
                            Ok(msg) => {
                                let _ = tx.send(Inbound::Message {
                                    conn: COORDINATOR,
                                    peer: link.peer_name().to_string(),
                                    msg,
                                });
                            }
                            Err(e) => {
                                warn!("[WARN] coordinator link lost: {e}; re-joining");
                                break;
                            }
                        }
                    }
                    beat.abort();
                    let _ = tx.send(Inbound::Closed { conn: COORDINATOR });
                }
            }
            Err(e) => debug!("connecting to the coordinator: {e}"),
        }
        tokio::select! {
            () = tokio::time::sleep(backoff) => {}
            () = shutdown.cancelled() => return,
        }
        backoff = (backoff * 2).min(Duration::from_secs(2));
    }
}

impl Shell {
    fn now(&self) -> u64 {
        self.clock.elapsed().as_nanos() as u64
    }

    fn handle(&mut self, item: Inbound) -> Result<(), AggregatorRunError> {
        match item {
            Inbound::Connected { conn, link } => {
                self.conns.insert(conn, link);
            }
            Inbound::Closed { conn } => {
                self.conns.remove(&conn);
                self.version_slots.retain(|(c, _), _| *c != conn);
                self.subscribers.remove(&conn);
                if let Some(node) = self.conn_node.remove(&conn) {
                    if self.node_conn.get(&node) == Some(&conn) {
                        self.node_conn.remove(&node);
                    }
                }
            }
            Inbound::BadPeer => self.bad_peers += 1,
            Inbound::VersionSent {
                conn,
                layer,
                failed,
            } => {
                self.fanout.failed += u64::from(failed);
                let next = self.version_slots.remove(&(conn, layer)).flatten();
                if let Some(frame) = next {
                    self.send_version(conn, layer, frame);
                }
            }
            Inbound::Message { conn, peer, msg } if conn == COORDINATOR => {
                self.handle_coordinator(msg)?;
                let _ = peer;
            }
            Inbound::Message { conn, peer, msg } => self.handle_node(conn, &peer, msg),
        }
        Ok(())
    }

    fn handle_coordinator(&mut self, msg: Message) -> Result<(), AggregatorRunError> {
        match msg {
            Message::JoinAck(ack) => {
                info!(
                    "[JOIN] aggregator={} admitted (map epoch {})",
                    self.name, ack.map_epoch
                );
                self.apply_map(
                    ack.map_epoch,
                    &ack.layer_owners,
                    &ack.layer_versions,
                    &ack.layer_producers,
                    &ack.releasing_layers,
                );
            }
            Message::LayerMap(map) => self.apply_map(
                map.epoch,
                &map.owners,
                &map.layer_versions,
                &map.layer_producers,
                &map.releasing_layers,
            ),
            Message::LayerVersion(v) => self.take_handover(v),
            Message::Error(e) if e.code == ErrorCode::Unauthorized => {
                return Err(AggregatorRunError::Refused(e.text));
            }
            Message::Error(e) => error!("[ERROR] coordinator replied {:?}: {}", e.code, e.text),
            Message::Heartbeat(_) => {}
            other => debug!("ignoring {} from the coordinator", other.kind()),
        }
        Ok(())
    }

    /// A hand-over: the newest version the coordinator saw of a layer we now own. One that
    /// arrives before the map that gives us the layer (they travel on separate streams) is
    /// kept until that map comes.
    fn take_handover(&mut self, v: LayerVersion) {
        let awaited = self.awaiting_handover.get(&v.layer_id).map(|w| w.0);
        if awaited.is_none() && self.state.layer(v.layer_id).is_none() {
            debug!("hand-over of layer {} before its map; kept", v.layer_name);
            let newer = self
                .early_handovers
                .get(&v.layer_id)
                .is_none_or(|kept| kept.version < v.version);
            if newer {
                self.early_handovers.insert(v.layer_id, v);
            }
            return;
        }
        if let Some(want) = awaited.filter(|&want| v.version < want) {
            debug!(
                "hand-over of layer {} at version {} is older than the {want} awaited",
                v.layer_name, v.version
            );
            return;
        }
        let values = match v.decode_values() {
            Ok(values) => values,
            Err(e) => {
                return error!(
                    "[ERROR] handover of layer {} does not decode: {e}",
                    v.layer_name
                )
            }
        };
        let layer = OwnedLayer {
            layer_id: v.layer_id,
            name: v.layer_name.clone(),
            shape: v.shape.clone(),
            values,
        };
        match self.state.adopt_layer(layer, v.version, &v.applied_seqs) {
            Ok(adopted) => {
                self.awaiting_handover.remove(&v.layer_id);
                if adopted {
                    info!(
                        "[MAP] layer={} adopted at version {}",
                        v.layer_name, v.version
                    );
                }
            }
            Err(e) => error!("[ERROR] handover of layer {} refused: {e}", v.layer_name),
        }
    }

    /// Follows a new layer map. A layer that moved away is released after its final version
    /// went to the coordinator, which hands it to the new owner (so nothing applied and
    /// acknowledged here is lost). A layer given to us is served at once if it has never
    /// been updated (initial weights) or we hold the coordinator's newest version of it
    /// ourselves (same producer, at least the same number); otherwise we wait for the
    /// coordinator's hand-over before serving it, so that no delta is applied to a version
    /// that the hand-over would then replace.
    fn apply_map(
        &mut self,
        epoch: u64,
        owners: &[(u32, u64)],
        versions: &[(u32, u64)],
        producers: &[(u32, u64)],
        releasing: &[u32],
    ) {
        let mine: HashSet<u32> = owners
            .iter()
            .filter(|(_, owner)| *owner == self.id)
            .map(|(layer, _)| *layer)
            .collect();
        if epoch < self.map_epoch {
            return self.release_never_served(epoch, &mine);
        }
        self.map_epoch = epoch;
        self.map_mine.clone_from(&mine);
        let newest: HashMap<u32, u64> = versions.iter().copied().collect();
        let producer: HashMap<u32, u64> = producers.iter().copied().collect();
        self.awaiting_handover
            .retain(|layer, _| mine.contains(layer));
        let owned: Vec<u32> = self.state.layer_ids().collect();
        for layer_id in owned {
            if mine.contains(&layer_id) {
                continue;
            }
            match self.state.current_version_message(layer_id) {
                Some(Ok(last)) => self.send_to_coordinator(last),
                Some(Err(e)) => error!("[ERROR] layer {layer_id}: final version not encoded: {e}"),
                None => {}
            }
            if self.state.release_layer(layer_id) {
                info!(
                    "[MAP] layer {layer_id} moved away (epoch {epoch}); final version sent for the hand-over"
                );
            }
        }
        let now = Instant::now();
        for &layer_id in &mine {
            let want = newest.get(&layer_id).copied().unwrap_or(0);
            let have = self.state.layer(layer_id).map(|l| l.version);
            let ours = producer.get(&layer_id).is_none_or(|&p| p == self.id);
            let released_to_us = releasing.contains(&layer_id);
            if !released_to_us && (want == 0 || (ours && have.is_some_and(|v| v >= want))) {
                continue;
            }
            if have.is_some() {
                // A stale copy (e.g. from our shard file while another aggregator moved the
                // layer on): stop serving it until the newer version is handed over.
                self.state.release_layer(layer_id);
            }
            if self
                .awaiting_handover
                .insert(layer_id, (want, now, now))
                .is_none()
            {
                info!(
                    "[MAP] layer {layer_id}: waiting for the hand-over of version {want} before serving it"
                );
            }
        }
        let early: Vec<LayerVersion> = self
            .awaiting_handover
            .keys()
            .filter_map(|id| self.early_handovers.remove(id))
            .collect();
        for v in early {
            self.take_handover(v);
        }
        self.early_handovers.retain(|id, _| mine.contains(id));
        let mut missing: Vec<u32> = mine
            .iter()
            .copied()
            .filter(|&id| {
                self.state.layer(id).is_none() && !self.awaiting_handover.contains_key(&id)
            })
            .collect();
        missing.sort_unstable();
        self.own_from_initial(missing);
        let names: Vec<String> = self
            .state
            .layer_ids()
            .filter_map(|id| self.state.layer(id).map(|l| l.name.to_string()))
            .collect();
        info!(
            "[MAP] epoch={epoch} aggregator={} owns [{}]",
            self.name,
            names.join(", ")
        );
    }

    fn handle_node(&mut self, conn: u64, peer: &str, msg: Message) {
        let claimed = match &msg {
            Message::Subscribe(s) => Some(s.node_id),
            Message::LayerDelta(p) => Some(p.node_id),
            _ => None,
        };
        let node = match (claimed, self.conn_node.get(&conn).copied()) {
            (Some(c), Some(bound)) if c != bound => {
                error!(
                    "[ERROR] peer={peer} claims node {c} on a connection of node {bound}; refused"
                );
                self.reply_error(
                    conn,
                    ErrorCode::BadRequest,
                    format!("this connection belongs to node {bound}, not {c}"),
                );
                return;
            }
            (Some(c), _) => {
                self.conn_node.insert(conn, c);
                self.node_conn.insert(c, conn);
                c
            }
            (None, Some(bound)) => bound,
            (None, None) => {
                self.reply_error(
                    conn,
                    ErrorCode::BadRequest,
                    format!("send Subscribe first (got {})", msg.kind()),
                );
                return;
            }
        };
        if matches!(msg, Message::Subscribe(_)) {
            self.subscribers.insert(conn);
        }
        let now = self.now();
        self.state.handle_message(now, node, msg);
    }

    /// Sends `msg` to the coordinator (dropped with a warning when the link is down).
    fn send_to_coordinator(&self, msg: Message) {
        let Some(link) = self.conns.get(&COORDINATOR).cloned() else {
            return warn!("[WARN] no coordinator link: {} not sent", msg.kind());
        };
        let timeout = self.send_timeout;
        tokio::spawn(async move {
            if let Err(e) = link.send_with_timeout(&msg, timeout).await {
                warn!("[WARN] {} to the coordinator failed: {e}", msg.kind());
            }
        });
    }

    fn reply_error(&self, conn: u64, code: ErrorCode, text: String) {
        if let Some(link) = self.conns.get(&conn).cloned() {
            let msg = Message::Error(ErrorReply { code, text });
            let timeout = self.send_timeout;
            tokio::spawn(async move {
                let _ = link.send_with_timeout(&msg, timeout).await;
            });
        }
    }

    /// The certificate name of the connection node `node` speaks on, for logs.
    fn peer_name_of(&self, node: u64) -> String {
        self.node_conn
            .get(&node)
            .and_then(|c| self.conns.get(c))
            .map_or_else(|| "?".to_string(), |l| l.peer_name().to_string())
    }

    /// Drains the state machine's outputs: persists first if anything was applied, then
    /// transmits.
    fn flush(&mut self) -> Result<(), AggregatorRunError> {
        let mut outputs = Vec::new();
        while let Some(o) = self.state.poll_output() {
            outputs.push(o);
        }
        if outputs.is_empty() {
            return Ok(());
        }
        let mut applied_any = false;
        for o in &outputs {
            match o {
                Output::Event(AggEvent::Applied {
                    layer_id,
                    version,
                    n_deltas,
                    staleness,
                }) => {
                    applied_any = true;
                    for &tau in staleness {
                        let b = (tau as usize).min(STALENESS_BUCKETS - 1);
                        self.staleness[b] += 1;
                    }
                    let name = self.state.layer(*layer_id).map_or("?", |l| l.name);
                    debug!("[APPLY] layer={name} version={version} deltas={n_deltas} staleness={staleness:?}");
                }
                Output::Send {
                    msg: Message::DeltaAck(ack),
                    ..
                } if ack.applied => {
                    self.pending_ledger.push(AppliedEntry {
                        node: ack.node_id,
                        layer: ack.layer_id,
                        seq: ack.seq,
                    });
                }
                Output::Event(AggEvent::DuplicateRejected {
                    from,
                    layer_id,
                    seq,
                }) => {
                    info!(
                        "[DUP] node={from} layer={layer_id} seq={seq} already applied; acked again"
                    );
                }
                Output::Event(AggEvent::BadInput { from, reason }) => {
                    let peer = self.peer_name_of(*from);
                    error!("[ERROR] peer={peer} node={from} bad input: {reason}");
                }
                Output::Event(AggEvent::DroppedStale {
                    from,
                    layer_id,
                    seq,
                    reason,
                }) => {
                    warn!("[WARN] node={from} layer={layer_id} seq={seq} refused ({reason:?}); sender told to re-sync");
                }
                _ => {}
            }
        }
        if applied_any {
            tokio::task::block_in_place(|| self.persist())?;
        }
        for o in outputs {
            match o {
                Output::Send { to, msg } => {
                    let Some(link) = self
                        .node_conn
                        .get(&to)
                        .and_then(|c| self.conns.get(c))
                        .cloned()
                    else {
                        debug!("no connection to node {to}; {} dropped", msg.kind());
                        continue;
                    };
                    let timeout = self.send_timeout;
                    tokio::spawn(async move {
                        let _ = link.send_with_timeout(&msg, timeout).await;
                    });
                }
                Output::Broadcast { msg } => {
                    let subscribers: Vec<u64> = self.subscribers.iter().copied().collect();
                    let coordinator = subscribers
                        .iter()
                        .copied()
                        .find(|&c| self.is_coordinator(c));
                    let (layer, frames) = match broadcast_frames(msg, coordinator.is_some()) {
                        Ok(v) => v,
                        Err(e) => {
                            error!("[ERROR] encoding a broadcast failed: {e}");
                            continue;
                        }
                    };
                    for conn in subscribers {
                        let frame = if Some(conn) == coordinator {
                            frames.with_ledger.clone()
                        } else {
                            frames.without_ledger.clone()
                        };
                        let Some(layer) = layer else {
                            self.send_frame(conn, frame);
                            continue;
                        };
                        match self.version_slots.get_mut(&(conn, layer)) {
                            // Busy: the newest version waits (replacing an older one).
                            Some(waiting) => {
                                if waiting.replace(frame).is_some() {
                                    self.fanout.superseded += 1;
                                }
                            }
                            None => self.send_version(conn, layer, frame),
                        }
                    }
                }
                Output::Event(_) => {}
            }
        }
        Ok(())
    }

    /// Sends a frame that is not a layer version (never superseded, not paced).
    fn send_frame(&self, conn: u64, frame: bytes::Bytes) {
        let Some(link) = self.conns.get(&conn).cloned() else {
            return;
        };
        let timeout = self.send_timeout;
        tokio::spawn(async move {
            let _ = link.send_frame_with_timeout(frame, timeout).await;
        });
    }

    /// Whether connection `conn` is the coordinator's (its certificate name).
    fn is_coordinator(&self, conn: u64) -> bool {
        self.conns
            .get(&conn)
            .is_some_and(|c| c.peer_name() == self.coordinator_name)
    }

    /// Sends one layer-version frame to a subscriber; its acknowledgement frees the slot, but
    /// not before the version interval has passed since the send began (`broadcast_interval_ms`,
    /// or the fan-out budget shared by the subscribers, whichever is longer; newer versions
    /// wait in the slot meanwhile, the newest replacing the older).
    fn send_version(&mut self, conn: u64, layer: u32, frame: bytes::Bytes) {
        let Some(link) = self.conns.get(&conn).cloned() else {
            return;
        };
        self.version_slots.insert((conn, layer), None);
        self.fanout.sends += 1;
        self.fanout.bytes += frame.len() as u64;
        let interval = version_interval(
            self.broadcast_interval_ms,
            self.fanout_per_layer_per_s,
            self.subscribers.len(),
        );
        let done = self.inbound_tx.clone();
        tokio::spawn(async move {
            let started = tokio::time::Instant::now();
            let bytes = frame.len();
            let failed = match link
                .send_frame_acknowledged(frame, VERSION_STALL_TIMEOUT)
                .await
            {
                Ok(()) => false,
                Err(e) => {
                    debug!("version send: layer={layer} bytes={bytes} to {conn} failed: {e}");
                    true
                }
            };
            tokio::time::sleep_until(started + interval).await;
            let _ = done.send(Inbound::VersionSent {
                conn,
                layer,
                failed,
            });
        });
    }

    /// One group commit: the round's new ledger entries and the snapshot.
    fn persist(&mut self) -> Result<(), AggregatorRunError> {
        self.shard
            .commit(&self.state.snapshot(), &self.pending_ledger)?;
        self.pending_ledger.clear();
        Ok(())
    }

    /// Takes ownership of `layers` at version 0 with the model's initial weights (built on
    /// first use).
    /// A map older than the one we follow (the join answer and the next map travel on
    /// separate streams, so the join answer can arrive second) gave us layers that the newer
    /// map gives to another aggregator. We never served them, so our final version of each
    /// is its initial weights at version 0: send that for the hand-over at once, as a
    /// release, instead of leaving the coordinator to wait for a release that would never
    /// come (and the new owner without the layer until its timeouts pass).
    fn release_never_served(&mut self, epoch: u64, stale_mine: &HashSet<u32>) {
        let mut never_served: Vec<u32> = stale_mine
            .iter()
            .copied()
            .filter(|id| !self.map_mine.contains(id) && self.state.layer(*id).is_none())
            .filter(|id| !self.awaiting_handover.contains_key(id))
            .collect();
        never_served.sort_unstable();
        for layer_id in never_served {
            self.own_from_initial(vec![layer_id]);
            match self.state.current_version_message(layer_id) {
                Some(Ok(initial)) => self.send_to_coordinator(initial),
                Some(Err(e)) => {
                    error!("[ERROR] layer {layer_id}: initial version not encoded: {e}")
                }
                None => continue,
            }
            self.state.release_layer(layer_id);
            info!(
                "[MAP] layer {layer_id}: given to us by the older map epoch {epoch} and moved away before we served it; initial weights sent for the hand-over"
            );
        }
    }

    fn own_from_initial(&mut self, missing: Vec<u32>) {
        if !missing.is_empty() && !self.initial.is_built() {
            info!(
                "[MAP] building the initial weights for layers {missing:?} (not in the shard file)"
            );
            let initial = &mut self.initial;
            if let Err(e) = tokio::task::block_in_place(|| initial.build()) {
                return error!("[ERROR] cannot build the initial weights: {e}");
            }
        }
        for layer_id in missing {
            let def = match self.initial.layout() {
                Ok(layout) => layout.iter().find(|d| d.layer_id == layer_id).cloned(),
                Err(_) => None,
            };
            let (Some(def), Ok(Some(values))) = (def, self.initial.values(layer_id)) else {
                error!("[ERROR] the layer map assigns layer {layer_id}, which this model lacks");
                continue;
            };
            let layer = OwnedLayer {
                layer_id,
                name: def.name.clone(),
                shape: vec![def.len as u32],
                values: values.to_vec(),
            };
            if let Err(e) = self.state.adopt_layer(layer, 0, &[]) {
                error!("[ERROR] cannot own layer {}: {e}", def.name);
            }
        }
    }

    /// Logs layers still waiting for their hand-over (every 10 s each). A layer whose
    /// coordinator never saw any version (awaited version 0: only its old owner's release
    /// was awaited) starts from the initial weights once that release is overdue.
    fn report_waiting(&mut self) {
        let now = Instant::now();
        let fresh: Vec<u32> = self
            .awaiting_handover
            .iter()
            .filter(|(_, (want, since, _))| {
                *want == 0 && now.duration_since(*since) >= FRESH_LAYER_WAIT
            })
            .map(|(&layer, _)| layer)
            .collect();
        for layer_id in fresh {
            self.awaiting_handover.remove(&layer_id);
            warn!(
                "[WARN] layer {layer_id}: no hand-over after {} s and no version was ever published; starting it from the initial weights",
                FRESH_LAYER_WAIT.as_secs()
            );
            self.own_from_initial(vec![layer_id]);
        }
        for (layer_id, (want, since, logged)) in self.awaiting_handover.iter_mut() {
            if now.duration_since(*logged) >= Duration::from_secs(10) {
                *logged = now;
                warn!(
                    "[WARN] layer {layer_id}: still waiting for the hand-over of version {want} after {:.0} s (the coordinator resends it when we re-join)",
                    now.duration_since(*since).as_secs_f64()
                );
            }
        }
    }

    fn report_stats(&self) {
        let Some(link) = self.conns.get(&COORDINATOR).cloned() else {
            return;
        };
        let c: AggregatorCounters = self.state.counters();
        let memory = node::memory::process_memory();
        let stats = NodeStats {
            node_id: self.id,
            role: Role::Aggregator,
            step: 0,
            bytes_sent: c.bytes_out,
            bytes_received: c.bytes_in,
            weak_sync_events: 0,
            cached_pending: 0,
            deltas_applied: c.deltas_applied,
            duplicates_rejected: c.duplicates_rejected,
            dropped_stale: c.dropped_stale,
            layer_versions: self.layer_versions(),
            staleness_histogram: self.staleness.clone(),
            accuracy: None,
            rss_bytes: memory.rss_bytes,
            peak_rss_bytes: memory.peak_rss_bytes,
            layer_divergence: Vec::new(),
        };
        tokio::spawn(async move {
            let _ = link
                .send_with_timeout(&Message::Stats(stats), Duration::from_secs(2))
                .await;
        });
    }

    fn layer_versions(&self) -> Vec<(u32, u64)> {
        self.state
            .layer_ids()
            .filter_map(|id| self.state.layer(id).map(|l| (id, l.version)))
            .collect()
    }

    fn summary(&self) -> AggregatorSummary {
        let c = self.state.counters();
        AggregatorSummary {
            name: self.name.clone(),
            node_id: self.id,
            resumed: self.resumed,
            deltas_received: c.deltas_received,
            deltas_applied: c.deltas_applied,
            duplicates_rejected: c.duplicates_rejected,
            dropped_stale: c.dropped_stale,
            bad_inputs: c.bad_inputs,
            bytes_in: c.bytes_in,
            bytes_out: c.bytes_out,
            bad_peers_disconnected: self.bad_peers,
            layer_versions: self.layer_versions(),
            ledger_len: (self.shard.committed() as usize) + self.pending_ledger.len(),
            staleness_histogram: self.staleness.to_vec(),
            memory: node::memory::process_memory(),
            cpu_seconds: node::memory::process_cpu_seconds(),
            subscribers: self.subscribers.len(),
            fanout: self.fanout,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    fn config(data_dir: PathBuf) -> AggregatorRunConfig {
        let text = format!(
            r#"
[model]
model = "mlp"
dataset = "mnist"
data_dir = "/nonexistent/dreamddp-no-data-here"
seed = 1

[node]
name = "agg-1"
id = 2
certs_dir = "certs"
data_dir = {data_dir:?}
listen = "127.0.0.1:0"
coordinator = "127.0.0.1:1"
credentials = "x"
"#
        );
        toml::from_str(&text).unwrap()
    }

    #[test]
    fn only_the_coordinators_frame_of_a_version_carries_the_ledger() {
        let ledger: Vec<protocol::AppliedSeq> = (0..1000)
            .map(|node_id| protocol::AppliedSeq { node_id, seq: 7 })
            .collect();
        let version = Message::LayerVersion(LayerVersion {
            aggregator_id: 2,
            layer_id: 3,
            layer_name: "fc2".into(),
            version: 9,
            shape: vec![4],
            codec: protocol::Codec::RawF32,
            payload: vec![0; 16],
            applied_seqs: ledger.clone(),
        });
        let (layer, frames) = broadcast_frames(version.clone(), true).unwrap();
        assert_eq!(layer, Some(3));
        let decode = |frame: &bytes::Bytes| match protocol::decode_frame(frame).unwrap().0 {
            Message::LayerVersion(v) => v,
            other => panic!("not a version: {}", other.kind()),
        };
        assert_eq!(decode(&frames.with_ledger).applied_seqs, ledger);
        let plain = decode(&frames.without_ledger);
        assert!(plain.applied_seqs.is_empty());
        assert_eq!((plain.version, plain.payload.len()), (9, 16));
        assert!(
            frames.without_ledger.len() + 16 * 1000 <= frames.with_ledger.len(),
            "{} vs {}",
            frames.without_ledger.len(),
            frames.with_ledger.len()
        );
        // No coordinator among the subscribers: the ledger frame is not made at all.
        let (_, frames) = broadcast_frames(version, false).unwrap();
        assert_eq!(frames.with_ledger, frames.without_ledger);
        assert!(decode(&frames.with_ledger).applied_seqs.is_empty());
        let resync = Message::Resync(protocol::Resync {
            layer_id: 3,
            current_version: 9,
            refused_seq: None,
            reason: protocol::ResyncReason::AggregatorRestarted,
        });
        let (layer, frames) = broadcast_frames(resync, true).unwrap();
        assert_eq!(layer, None, "a resync is never superseded by a version");
        assert_eq!(frames.with_ledger, frames.without_ledger);
    }

    #[test]
    fn a_fresh_start_builds_initial_weights_without_the_data_set_and_a_restart_none() {
        let dir = std::env::temp_dir().join(format!("ddp-agg-startup-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let config = config(dir.clone());
        let state_config = config.state_config().unwrap();

        // Fresh: MNIST's data folder does not exist, yet the MNIST-shaped weights are built.
        let mut fresh = open_startup(&config, state_config.clone()).unwrap();
        assert!(!fresh.resumed);
        assert!(fresh.initial.is_built());
        let first = fresh.initial.layout().unwrap()[0].clone();
        assert_eq!(first.len, 784 * 512 + 512);
        let values = fresh
            .initial
            .values(first.layer_id)
            .unwrap()
            .unwrap()
            .to_vec();
        fresh
            .state
            .adopt_layer(
                OwnedLayer {
                    layer_id: first.layer_id,
                    name: first.name.clone(),
                    shape: vec![first.len as u32],
                    values,
                },
                0,
                &[],
            )
            .unwrap();
        let mut shard = fresh.shard;
        shard.commit(&fresh.state.snapshot(), &[]).unwrap();
        drop(shard);

        // Restart: the shard file is there, so no initial weights are built.
        let restarted = open_startup(&config, state_config).unwrap();
        assert!(restarted.resumed);
        assert!(!restarted.initial.is_built());
        assert!(restarted.state.layer(first.layer_id).is_some());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_model_that_does_not_fit_its_data_set_is_a_setup_error() {
        let dir = std::env::temp_dir().join(format!("ddp-agg-badmodel-{}", std::process::id()));
        let mut config = config(dir.clone());
        config.model.model = "gpt-tiny".into();
        let state_config = config.state_config().unwrap();
        let e = open_startup(&config, state_config).unwrap_err();
        assert!(matches!(e, AggregatorRunError::Setup(_)), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
