//! The coordinator state machine (sans-IO): membership with leases, elastic join/leave,
//! the layer → aggregator map and its rebalancing, the global checkpoint and node stats.
//!
//! Time is an explicit `now_ms` (milliseconds of whatever monotonic clock the shell uses);
//! nothing here reads a clock, sleeps or touches a socket. The shell feeds
//! [`CoordinatorState::handle_message`], [`CoordinatorState::handle_disconnect`] and
//! [`CoordinatorState::handle_timeout`] (when [`CoordinatorState::poll_timeout`] passes),
//! then drains [`CoordinatorState::poll_output`].
//!
//! ## Semantics
//!
//! * **Join** — wrong credentials: `Error(Unauthorized)`, then `Close`. An aggregator must
//!   give a `listen_addr` that parses as a socket address (`Error(BadRequest)` otherwise).
//!   Node id 0 asks for a fresh id. A node id held by a member with another certificate name
//!   is refused; the same name rejoining replaces the old membership (its old connection is
//!   closed). Every joiner gets a `JoinAck` (map, versions, aggregator addresses, lease).
//!   When the aggregator set changes the map is recomputed by rendezvous hashing
//!   ([`crate::layer_map`]); if it differs the epoch goes up by one and every other member
//!   gets the new `LayerMap`. Each layer that moved to an aggregator, and every layer a
//!   (re)joining aggregator owns, is handed over: the cached `LayerVersion` (if newer than
//!   version 0) is sent to its owner, which keeps whichever is newer. A joining aggregator
//!   gets an [`Output::Subscribe`].
//! * **Heartbeat** — renews the lease (`now + lease_ms`) and is echoed with the granted
//!   lease. A member that does not heartbeat in time is removed by
//!   [`CoordinatorState::handle_timeout`]; **Leave** removes at once. Removing an aggregator
//!   rebalances; when none remains the map is empty and [`CoordEvent::NoAggregators`] says
//!   so.
//! * **LayerVersion** from a live aggregator (on its own connection or on the subscription
//!   connection to it) of a known layer, with the manifest's shape and a payload that
//!   decodes to finite values: kept if newer than the cached one — the global checkpoint
//!   a newcomer or a new owner bootstraps from.
//! * **Stats** — the latest per node (kept after the node leaves, for cluster totals). A
//!   trainer's per-layer distances to the global model feed the divergence monitor
//!   ([`crate::divergence`]) at most once per [`DIVERGENCE_SAMPLE_MS`], over the live
//!   trainers; a layer whose spread grew is a [`CoordEvent::Divergence`].
//! * **Error** from a peer — reported as [`CoordEvent::PeerError`], never answered.
//! * Anything else — `Error(BadRequest)` naming [`Message::kind`]; the connection stays
//!   open. Heartbeat/Leave/Stats from a connection that has not joined get
//!   `Error(UnknownNode)`.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::net::SocketAddr;

use protocol::{
    AggregatorAddr, Capabilities, CodecError, ErrorReply, Heartbeat, Join, JoinAck, LayerMap,
    LayerVersion, Leave, Message, NodeStats, Role,
};

use crate::config::{ConnId, CoordinatorConfig, LayerInfo};
use crate::divergence::DivergenceMonitor;
use crate::error::{InputError, RefusalReason};
use crate::layer_map::{self, LayerMove, Owners};
use crate::output::{CoordEvent, Output};

/// A member of the cluster.
#[derive(Clone, Debug, PartialEq)]
pub struct Member {
    /// Node id.
    pub node_id: u64,
    /// Certificate name (CN) of the peer that joined.
    pub name: String,
    /// Its role.
    pub role: Role,
    /// Where it listens (`host:port`; empty for nodes that only dial out).
    pub addr: String,
    /// Its connection, `None` while disconnected (it stays a member until its lease ends).
    pub conn: Option<ConnId>,
    /// When its lease ends, in the shell's milliseconds.
    pub lease_expires_at_ms: u64,
    /// What it said it can do.
    pub capabilities: Capabilities,
}

/// One layer of the global checkpoint, decoded.
#[derive(Clone, Debug, PartialEq)]
pub struct CheckpointLayer {
    /// Layer index.
    pub layer_id: u32,
    /// Layer name.
    pub name: String,
    /// Global version.
    pub version: u64,
    /// Tensor shape.
    pub shape: Vec<u32>,
    /// Dense row-major parameters.
    pub values: Vec<f32>,
}

/// The coordinator state machine. See the module documentation for its semantics.
#[derive(Debug)]
pub struct CoordinatorState {
    pub(crate) config: CoordinatorConfig,
    /// Manifest layers by id (the first of a repeated id wins).
    pub(crate) layers: BTreeMap<u32, LayerInfo>,
    pub(crate) members: BTreeMap<u64, Member>,
    /// Joined connection → node id.
    conns: HashMap<ConnId, u64>,
    pub(crate) owners: Owners,
    pub(crate) epoch: u64,
    /// Aggregator addresses of the map at `epoch`.
    published_addrs: Vec<AggregatorAddr>,
    /// Newest version of each layer seen from an aggregator.
    pub(crate) checkpoint: BTreeMap<u32, LayerVersion>,
    /// Latest stats per node id (kept after the node leaves).
    pub(crate) stats: BTreeMap<u64, NodeStats>,
    /// Layers moving away from a live aggregator: their hand-over to the new owner waits for
    /// the old owner's final version (sent when it releases the layer), so that what it
    /// applied and acknowledged after our checkpoint is not lost. Layer → (old owner, since
    /// when, in ms).
    pub(crate) pending_release: BTreeMap<u32, (u64, u64)>,
    /// The shell's clock at the last input (pending releases are stamped with it).
    now_ms: u64,
    outputs: VecDeque<Output>,
    next_node_id: u64,
    pub(crate) divergence: DivergenceMonitor,
    /// When the divergence monitor last took a sample.
    divergence_sampled_ms: Option<u64>,
}

/// The divergence monitor samples the live trainers' distances at most this often, so its
/// history spans the same time however many trainers report.
pub const DIVERGENCE_SAMPLE_MS: u64 = 1_000;

/// How long a hand-over waits for the old owner's final version before the checkpoint is
/// handed over instead (the old owner may be partitioned away).
pub const RELEASE_TIMEOUT_MS: u64 = 2_000;

/// Compares two secrets in time independent of where they differ.
fn credentials_match(given: &str, expected: &str) -> bool {
    let (a, b) = (given.as_bytes(), expected.as_bytes());
    let diff = a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y));
    diff == 0 && a.len() == b.len()
}

impl CoordinatorState {
    /// A coordinator with no members, an empty map at epoch 0 and no checkpoint.
    pub fn new(config: CoordinatorConfig) -> Self {
        let mut layers = BTreeMap::new();
        for layer in &config.layers {
            layers
                .entry(layer.layer_id)
                .or_insert_with(|| layer.clone());
        }
        let divergence = DivergenceMonitor::new(config.divergence.clone());
        CoordinatorState {
            config,
            layers,
            members: BTreeMap::new(),
            conns: HashMap::new(),
            owners: Owners::new(),
            epoch: 0,
            published_addrs: Vec::new(),
            checkpoint: BTreeMap::new(),
            stats: BTreeMap::new(),
            pending_release: BTreeMap::new(),
            now_ms: 0,
            outputs: VecDeque::new(),
            next_node_id: 1,
            divergence,
            divergence_sampled_ms: None,
        }
    }

    /// The configuration.
    pub fn config(&self) -> &CoordinatorConfig {
        &self.config
    }

    /// Current map epoch (0 before the first aggregator joined).
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Current map, `(layer_id, aggregator_id)` in layer order.
    pub fn owners(&self) -> Vec<(u32, u64)> {
        self.owners.iter().map(|(&l, &a)| (l, a)).collect()
    }

    /// The member with this node id.
    pub fn member(&self, node_id: u64) -> Option<&Member> {
        self.members.get(&node_id)
    }

    /// All members, by node id.
    pub fn members(&self) -> impl Iterator<Item = &Member> {
        self.members.values()
    }

    /// The node id that joined on `conn`, if any.
    pub fn node_of_conn(&self, conn: ConnId) -> Option<u64> {
        self.conns.get(&conn).copied()
    }

    /// Live aggregators and where they listen, by node id.
    pub fn aggregator_addrs(&self) -> Vec<AggregatorAddr> {
        self.members
            .values()
            .filter(|m| m.role == Role::Aggregator)
            .map(|m| AggregatorAddr {
                node_id: m.node_id,
                addr: m.addr.clone(),
            })
            .collect()
    }

    /// Global version of every manifest layer (0 where no version was seen).
    pub fn layer_versions(&self) -> Vec<(u32, u64)> {
        self.layers
            .keys()
            .map(|&id| (id, self.checkpoint.get(&id).map_or(0, |v| v.version)))
            .collect()
    }

    /// Which aggregator produced each cached version (layers never updated are absent).
    pub fn layer_producers(&self) -> Vec<(u32, u64)> {
        self.checkpoint
            .iter()
            .map(|(&id, v)| (id, v.aggregator_id))
            .collect()
    }

    /// The cached newest [`LayerVersion`] of a layer.
    pub fn cached_version(&self, layer_id: u32) -> Option<&LayerVersion> {
        self.checkpoint.get(&layer_id)
    }

    /// The latest stats a node reported.
    pub fn node_stats(&self, node_id: u64) -> Option<&NodeStats> {
        self.stats.get(&node_id)
    }

    /// The global checkpoint: every layer a version was seen for, decoded, in layer order.
    /// Payloads were checked when they arrived, so an error here means a codec bug.
    pub fn global_checkpoint(&self) -> Result<Vec<CheckpointLayer>, CodecError> {
        self.checkpoint
            .values()
            .map(|v| {
                Ok(CheckpointLayer {
                    layer_id: v.layer_id,
                    name: self
                        .layers
                        .get(&v.layer_id)
                        .map_or_else(|| v.layer_name.clone(), |l| l.name.clone()),
                    version: v.version,
                    shape: v.shape.clone(),
                    values: v.decode_values()?,
                })
            })
            .collect()
    }

    /// Next output for the shell, in order.
    pub fn poll_output(&mut self) -> Option<Output> {
        self.outputs.pop_front()
    }

    /// When [`CoordinatorState::handle_timeout`] must next be called: the earliest lease end
    /// or release deadline.
    pub fn poll_timeout(&self) -> Option<u64> {
        let leases = self.members.values().map(|m| m.lease_expires_at_ms);
        let releases = self
            .pending_release
            .values()
            .map(|&(_, since)| since.saturating_add(RELEASE_TIMEOUT_MS));
        leases.chain(releases).min()
    }

    /// Removes every member whose lease ended at or before `now_ms`, and hands over the
    /// checkpoint of every layer whose old owner did not release it in time.
    pub fn handle_timeout(&mut self, now_ms: u64) {
        self.now_ms = self.now_ms.max(now_ms);
        let overdue: Vec<u32> = self
            .pending_release
            .iter()
            .filter(|(_, &(_, since))| since.saturating_add(RELEASE_TIMEOUT_MS) <= now_ms)
            .map(|(&layer, _)| layer)
            .collect();
        for layer_id in overdue {
            if let Some((from, _)) = self.pending_release.remove(&layer_id) {
                self.event(CoordEvent::ReleaseTimedOut { layer_id, from });
                self.hand_over(layer_id, false);
            }
        }
        let expired: Vec<u64> = self
            .members
            .values()
            .filter(|m| m.lease_expires_at_ms <= now_ms)
            .map(|m| m.node_id)
            .collect();
        if expired.is_empty() {
            return;
        }
        let mut aggregator_removed = false;
        for node_id in expired {
            let Some(member) = self.remove_member(node_id) else {
                continue;
            };
            aggregator_removed |= member.role == Role::Aggregator;
            self.event(CoordEvent::LeaseExpired {
                node_id,
                name: member.name.clone(),
                role: member.role,
            });
            if let Some(conn) = member.conn {
                self.outputs.push_back(Output::Close {
                    conn,
                    reason: format!("lease of node {node_id} expired"),
                });
            }
        }
        self.rebalance(aggregator_removed);
    }

    /// The shell lost connection `conn`. Its member stays until its lease ends (it may
    /// rejoin on a new connection); messages for it are no longer routed.
    pub fn handle_disconnect(&mut self, conn: ConnId) {
        if let Some(node_id) = self.conns.remove(&conn) {
            if let Some(member) = self.members.get_mut(&node_id) {
                member.conn = None;
            }
        }
    }

    /// Handle one message received on `conn` from the peer whose certificate name is
    /// `peer_name`.
    pub fn handle_message(&mut self, now_ms: u64, conn: ConnId, peer_name: &str, msg: Message) {
        self.now_ms = self.now_ms.max(now_ms);
        let kind = msg.kind();
        let result = match msg {
            Message::Join(join) => {
                self.handle_join(now_ms, conn, peer_name, join);
                Ok(())
            }
            Message::Heartbeat(hb) => self.handle_heartbeat(now_ms, conn, hb),
            Message::Leave(leave) => self.handle_leave(conn, leave),
            Message::Stats(stats) => self.handle_stats(now_ms, conn, stats),
            Message::LayerVersion(version) => self.handle_layer_version(conn, peer_name, version),
            Message::Error(error) => {
                self.event(CoordEvent::PeerError {
                    conn,
                    peer: peer_name.to_owned(),
                    error,
                });
                Ok(())
            }
            _ => Err(InputError::UnexpectedKind { kind }),
        };
        if let Err(reason) = result {
            self.send(
                conn,
                Message::Error(ErrorReply {
                    code: reason.code(),
                    text: reason.to_string(),
                }),
            );
            self.event(CoordEvent::BadInput {
                conn,
                peer: peer_name.to_owned(),
                reason,
            });
        }
    }

    fn handle_join(&mut self, now_ms: u64, conn: ConnId, peer_name: &str, join: Join) {
        if !credentials_match(&join.credentials, &self.config.credentials) {
            self.refuse(conn, peer_name, RefusalReason::BadCredentials);
            self.outputs.push_back(Output::Close {
                conn,
                reason: "refused: bad credentials".into(),
            });
            return;
        }
        if join.role == Role::Aggregator && join.listen_addr.parse::<SocketAddr>().is_err() {
            let addr = join.listen_addr;
            self.refuse(conn, peer_name, RefusalReason::InvalidListenAddr { addr });
            return;
        }
        let node_id = match self.conns.get(&conn) {
            Some(&bound) if join.node_id != bound && join.node_id != 0 => {
                let reason = RefusalReason::ConnectionAlreadyJoined { node_id: bound };
                self.refuse(conn, peer_name, reason);
                return;
            }
            Some(&bound) => bound,
            None if join.node_id == 0 => self.fresh_node_id(),
            None => join.node_id,
        };
        if let Some(holder) = self.members.get(&node_id) {
            if holder.name != peer_name {
                let reason = RefusalReason::NodeIdTaken {
                    node_id,
                    holder: holder.name.clone(),
                };
                self.refuse(conn, peer_name, reason);
                return;
            }
        }

        let previous = self.members.remove(&node_id);
        let rejoin = previous.is_some();
        let mut aggregators_changed = join.role == Role::Aggregator;
        if let Some(old) = &previous {
            aggregators_changed |= old.role == Role::Aggregator;
            if let Some(old_conn) = old.conn.filter(|&c| c != conn) {
                self.conns.remove(&old_conn);
                self.outputs.push_back(Output::Close {
                    conn: old_conn,
                    reason: format!("node {node_id} rejoined on a new connection"),
                });
            }
            if old.role == Role::Aggregator && join.role != Role::Aggregator {
                self.outputs.push_back(Output::Unsubscribe {
                    aggregator_id: node_id,
                });
            }
        }
        self.members.insert(
            node_id,
            Member {
                node_id,
                name: peer_name.to_owned(),
                role: join.role,
                addr: join.listen_addr.clone(),
                conn: Some(conn),
                lease_expires_at_ms: now_ms.saturating_add(self.config.lease_ms),
                capabilities: join.capabilities,
            },
        );
        self.conns.insert(conn, node_id);
        self.next_node_id = self.next_node_id.max(node_id.saturating_add(1));

        let new_map = aggregators_changed.then(|| self.recompute_map()).flatten();
        if let Some(moved) = &new_map {
            // Before the JoinAck, so that a joiner taking layers over knows to wait.
            self.note_releases(moved);
        }
        self.event(CoordEvent::Joined {
            node_id,
            name: peer_name.to_owned(),
            role: join.role,
            addr: join.listen_addr.clone(),
            rejoin,
        });
        self.send(
            conn,
            Message::JoinAck(JoinAck {
                node_id,
                lease_ms: self.config.lease_ms,
                layer_owners: self.owners(),
                layer_versions: self.layer_versions(),
                map_epoch: self.epoch,
                aggregators: self.aggregator_addrs(),
                layer_producers: self.layer_producers(),
                releasing_layers: self.pending_release.keys().copied().collect(),
            }),
        );
        let mut handover: BTreeSet<u32> = BTreeSet::new();
        if join.role == Role::Aggregator {
            handover.extend(
                self.owners
                    .iter()
                    .filter(|(_, &owner)| owner == node_id)
                    .map(|(&layer, _)| layer),
            );
        }
        self.publish_map(new_map, Some(node_id), handover);
        if join.role == Role::Aggregator {
            self.outputs.push_back(Output::Subscribe {
                aggregator_id: node_id,
                addr: join.listen_addr,
                name: peer_name.to_owned(),
            });
        }
    }

    fn handle_heartbeat(
        &mut self,
        now_ms: u64,
        conn: ConnId,
        hb: Heartbeat,
    ) -> Result<(), InputError> {
        let node_id = self.joined_node(conn, "Heartbeat", hb.node_id)?;
        let lease_ms = self.config.lease_ms;
        if let Some(member) = self.members.get_mut(&node_id) {
            member.lease_expires_at_ms = now_ms.saturating_add(lease_ms);
        }
        self.send(
            conn,
            Message::Heartbeat(Heartbeat {
                node_id,
                lease_ms,
                now_ms,
            }),
        );
        Ok(())
    }

    fn handle_leave(&mut self, conn: ConnId, leave: Leave) -> Result<(), InputError> {
        let node_id = self.joined_node(conn, "Leave", leave.node_id)?;
        if let Some(member) = self.remove_member(node_id) {
            self.event(CoordEvent::Left {
                node_id,
                name: member.name,
                reason: leave.reason,
            });
            self.outputs.push_back(Output::Close {
                conn,
                reason: format!("node {node_id} left"),
            });
            self.rebalance(member.role == Role::Aggregator);
        }
        Ok(())
    }

    fn handle_stats(
        &mut self,
        now_ms: u64,
        conn: ConnId,
        stats: NodeStats,
    ) -> Result<(), InputError> {
        let node_id = self.joined_node(conn, "Stats", stats.node_id)?;
        let reports_divergence = !stats.layer_divergence.is_empty();
        self.stats.insert(node_id, stats);
        let due = self
            .divergence_sampled_ms
            .is_none_or(|t| now_ms.saturating_sub(t) >= DIVERGENCE_SAMPLE_MS);
        if reports_divergence && due {
            self.divergence_sampled_ms = Some(now_ms);
            self.sample_divergence(now_ms);
        }
        Ok(())
    }

    /// Feeds the live trainers' latest distances to the divergence monitor.
    fn sample_divergence(&mut self, now_ms: u64) {
        let trainers = self
            .members
            .values()
            .filter(|m| m.role != Role::Aggregator)
            .filter_map(|m| {
                let s = self.stats.get(&m.node_id)?;
                Some((m.node_id, s.layer_divergence.as_slice()))
            });
        let warnings = self.divergence.observe(now_ms, trainers);
        for w in warnings {
            let layer = self
                .layers
                .get(&w.layer_id)
                .map_or_else(|| w.layer_id.to_string(), |l| l.name.clone());
            let farthest = self
                .members
                .get(&w.farthest_node)
                .map_or_else(|| w.farthest_node.to_string(), |m| m.name.clone());
            self.event(CoordEvent::Divergence {
                layer_id: w.layer_id,
                layer,
                spread: w.spread,
                baseline: w.baseline,
                farthest_node: w.farthest_node,
                farthest,
            });
        }
    }

    fn handle_layer_version(
        &mut self,
        conn: ConnId,
        peer_name: &str,
        version: LayerVersion,
    ) -> Result<(), InputError> {
        let aggregator_id = version.aggregator_id;
        let from_that_aggregator = self.members.get(&aggregator_id).is_some_and(|m| {
            m.role == Role::Aggregator
                && (m.conn == Some(conn)
                    || (m.name == peer_name && !self.conns.contains_key(&conn)))
        });
        if !from_that_aggregator {
            return Err(InputError::NotAnAggregator { aggregator_id });
        }
        let layer_id = version.layer_id;
        let Some(layer) = self.layers.get(&layer_id) else {
            return Err(InputError::UnknownLayer { layer_id });
        };
        if layer.shape != version.shape {
            return Err(InputError::ShapeMismatch {
                layer_id,
                got: version.shape,
                expected: layer.shape.clone(),
            });
        }
        let values = version
            .decode_values()
            .map_err(|e| InputError::UndecodablePayload {
                layer_id,
                reason: e.to_string(),
            })?;
        if let Some(index) = values.iter().position(|v| !v.is_finite()) {
            return Err(InputError::NonFiniteValue { layer_id, index });
        }
        // Only the owner's versions advance the checkpoint (a late broadcast from a former
        // owner belongs to a branch of history that was handed over without it), except the
        // final version of a layer being released, which is then handed to the new owner.
        let releasing = self
            .pending_release
            .get(&layer_id)
            .is_some_and(|&(from, _)| from == aggregator_id);
        if self.owners.get(&layer_id) != Some(&aggregator_id) && !releasing {
            return Ok(());
        }
        let newer = match self.checkpoint.get(&layer_id) {
            Some(cached) => version.version > cached.version,
            None => true,
        };
        if newer {
            self.event(CoordEvent::CheckpointAdvanced {
                layer_id,
                version: version.version,
                aggregator_id,
            });
            self.checkpoint.insert(layer_id, version);
        }
        if releasing {
            self.pending_release.remove(&layer_id);
            self.hand_over(layer_id, true);
        }
        Ok(())
    }

    /// The node that joined on `conn`, checking that the message names it.
    fn joined_node(
        &self,
        conn: ConnId,
        kind: &'static str,
        claimed: u64,
    ) -> Result<u64, InputError> {
        let joined = *self
            .conns
            .get(&conn)
            .ok_or(InputError::NotJoined { kind })?;
        if claimed != joined {
            return Err(InputError::WrongNode {
                kind,
                claimed,
                joined,
            });
        }
        Ok(joined)
    }

    fn fresh_node_id(&mut self) -> u64 {
        while self.members.contains_key(&self.next_node_id) || self.next_node_id == 0 {
            self.next_node_id = self.next_node_id.wrapping_add(1);
        }
        self.next_node_id
    }

    /// Removes a member (no rebalance, no close): forgets its connection and its
    /// subscription.
    fn remove_member(&mut self, node_id: u64) -> Option<Member> {
        let member = self.members.remove(&node_id)?;
        if let Some(conn) = member.conn {
            self.conns.remove(&conn);
        }
        if member.role == Role::Aggregator {
            self.outputs.push_back(Output::Unsubscribe {
                aggregator_id: node_id,
            });
        }
        Some(member)
    }

    /// Recomputes the map over the live aggregators. When the owners or the aggregator
    /// addresses differ from the published ones, installs it, bumps the epoch and returns
    /// the layers that moved.
    fn recompute_map(&mut self) -> Option<Vec<LayerMove>> {
        let layer_ids: Vec<u32> = self.layers.keys().copied().collect();
        let sized: Vec<(u32, u64)> = self
            .layers
            .values()
            .map(|l| (l.layer_id, l.bytes()))
            .collect();
        let aggregators: Vec<u64> = self
            .members
            .values()
            .filter(|m| m.role == Role::Aggregator)
            .map(|m| m.node_id)
            .collect();
        let owners = layer_map::assign_owners(&sized, &aggregators);
        let addrs = self.aggregator_addrs();
        if owners == self.owners && addrs == self.published_addrs {
            return None;
        }
        let moved = layer_map::moves(&layer_ids, &self.owners, &owners);
        self.owners = owners;
        self.published_addrs = addrs;
        self.epoch += 1;
        Some(moved)
    }

    /// After an aggregator was removed: recompute, publish, hand layers over.
    fn rebalance(&mut self, aggregator_removed: bool) {
        if !aggregator_removed {
            return;
        }
        let new_map = self.recompute_map();
        self.publish_map(new_map, None, BTreeSet::new());
        if self.published_addrs.is_empty() {
            self.event(CoordEvent::NoAggregators { epoch: self.epoch });
        }
    }

    /// Sends a new map (if any) to every member but `except`, reports it, and hands each
    /// layer that moved to an aggregator, plus the layers in `handover`, over to its owner.
    fn publish_map(
        &mut self,
        new_map: Option<Vec<LayerMove>>,
        except: Option<u64>,
        mut handover: BTreeSet<u32>,
    ) {
        let changed = new_map.is_some();
        let moved = new_map.unwrap_or_default();
        handover.extend(moved.iter().filter(|m| m.to.is_some()).map(|m| m.layer_id));
        self.note_releases(&moved);
        handover.retain(|layer| !self.pending_release.contains_key(layer));
        let mut handed_over = Vec::new();
        let mut sends = Vec::new();
        for layer_id in handover {
            let (Some(&owner), Some(cached)) =
                (self.owners.get(&layer_id), self.checkpoint.get(&layer_id))
            else {
                continue;
            };
            let owner_conn = self.members.get(&owner).and_then(|m| m.conn);
            if let (true, Some(conn)) = (cached.version > 0, owner_conn) {
                handed_over.push((layer_id, cached.version, owner));
                sends.push((conn, Message::LayerVersion(cached.clone())));
            }
        }
        if changed {
            let map = LayerMap {
                epoch: self.epoch,
                owners: self.owners(),
                aggregators: self.published_addrs.clone(),
                layer_versions: self.layer_versions(),
                layer_producers: self.layer_producers(),
                releasing_layers: self.pending_release.keys().copied().collect(),
            };
            let targets: Vec<ConnId> = self
                .members
                .values()
                .filter(|m| Some(m.node_id) != except)
                .filter_map(|m| m.conn)
                .collect();
            for conn in targets {
                self.send(conn, Message::LayerMap(map.clone()));
            }
            self.event(CoordEvent::Rebalanced {
                epoch: self.epoch,
                owners: self.owners(),
                moved,
                handed_over,
            });
        }
        for (conn, msg) in sends {
            self.send(conn, msg);
        }
    }

    /// Records the layers of `moved` that leave a live aggregator: their hand-over waits for
    /// that aggregator's final version. (A layer moving elsewhere again is re-recorded; one
    /// whose old owner is gone needs no release.)
    fn note_releases(&mut self, moved: &[LayerMove]) {
        for m in moved {
            let live_from = m
                .from
                .filter(|from| self.members.get(from).is_some_and(|a| a.conn.is_some()));
            match (live_from, m.to) {
                (Some(from), Some(to)) if from != to => {
                    self.pending_release
                        .entry(m.layer_id)
                        .or_insert((from, self.now_ms));
                }
                _ => {
                    self.pending_release.remove(&m.layer_id);
                }
            }
        }
    }

    /// Sends the checkpoint of `layer_id` to its current owner. A version 0 (nothing applied
    /// yet) is sent only after a release (`released`), where it tells the new owner that
    /// the old one applied nothing before the move; otherwise there is nothing to hand over.
    fn hand_over(&mut self, layer_id: u32, released: bool) {
        let (Some(&owner), Some(cached)) =
            (self.owners.get(&layer_id), self.checkpoint.get(&layer_id))
        else {
            return;
        };
        let Some(conn) = self.members.get(&owner).and_then(|m| m.conn) else {
            return;
        };
        if cached.version == 0 && !released {
            return;
        }
        let msg = Message::LayerVersion(cached.clone());
        self.event(CoordEvent::HandedOver {
            layer_id,
            version: cached.version,
            to: owner,
        });
        self.send(conn, msg);
    }

    fn refuse(&mut self, conn: ConnId, peer_name: &str, reason: RefusalReason) {
        self.send(
            conn,
            Message::Error(ErrorReply {
                code: reason.code(),
                text: reason.to_string(),
            }),
        );
        self.event(CoordEvent::Refused {
            conn,
            peer: peer_name.to_owned(),
            reason,
        });
    }

    fn send(&mut self, conn: ConnId, msg: Message) {
        self.outputs.push_back(Output::Send { conn, msg });
    }

    fn event(&mut self, event: CoordEvent) {
        self.outputs.push_back(Output::Event(event));
    }
}
