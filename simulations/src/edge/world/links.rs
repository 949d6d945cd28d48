//! How messages cross the edge world's links: every message takes two hops (the sender's
//! access link, then the receiver's), each a [`MuxLink`] that shares its link between the
//! messages in flight as a QUIC connection shares it between streams; and how the aggregators'
//! layer versions reach the nodes (one slot per node and layer, freed when the frame enters
//! the send window of the connection to the node, i.e. is admitted on the node's down link, as
//! the real aggregator's `send_version` frees it when QUIC has buffered it; newer versions wait
//! in the slot, the newest replacing the older).
//!
//! Each link's acknowledgements wait behind the other direction's standing queue
//! ([`MuxLink::set_reverse_delay`], kept current at every submission and wake-up) and then
//! for that direction's next delivery opportunity ([`MuxLink::carry_acks_on`]), which
//! lengthens the round trip its BBR window must cover.
//!
//! The windows are the real processes': on a node's links (both directions), the node's
//! connection window, sized from its access link as `dreamddp cluster` sizes it
//! ([`node_window`]): its send window bounds what it has buffered for the aggregator, its
//! receive window (the same size) the flow-control credit of the aggregator's sends to it,
//! which is what blocks the aggregator's write of a version. On an aggregator's own links,
//! the transport default.

use std::collections::BTreeMap;
use std::rc::Rc;

use protocol::{Message, Subscribe};
use transport::config::{LinkWindows, TransportConfig, EDGE_CONNECTION_WINDOW};

use super::{Cargo, Event, LinkRef, PendingVersion, World};
use crate::link::{connected_at, handshake_done, reconnected_at, LinkSpec, MuxEvent, MuxLink};
use crate::time::{SimDuration, SimTime};

/// A message on one of its hops.
pub(super) struct InFlight {
    pub(super) hop: u8,
    pub(super) deadline: Option<SimTime>,
    pub(super) bytes: u64,
    pub(super) cargo: Box<Cargo>,
}

/// Connection window (send and receive) of a node: sized from its access link like a real
/// edge's (`cluster_file::relay_link_figures`: the faster direction's nominal rate, both
/// directions' latency and jitter as the round trip), or the edge default when the link adds
/// no delay.
pub(super) fn node_window(up: &LinkSpec, down: &LinkSpec, up_bps: f64, down_bps: f64) -> u64 {
    let rtt_ms = up.latency_ms + down.latency_ms + up.jitter_ms + down.jitter_ms;
    if rtt_ms > 0.0 {
        LinkWindows::for_link(up_bps.max(down_bps) / 1e6, rtt_ms).send_window
    } else {
        EDGE_CONNECTION_WINDOW
    }
}

/// How long a real dial waits for an answer: the transport's idle timeout.
fn dial_timeout() -> SimDuration {
    let nanos = TransportConfig::default().idle_timeout.as_nanos();
    SimDuration::from_nanos(u64::try_from(nanos).unwrap_or(u64::MAX))
}

/// Send window of an aggregator's connections (the transport default).
pub(super) fn aggregator_send_window() -> u64 {
    TransportConfig::default().send_window
}

impl super::SimNode {
    /// When a dial at `dial` over this node's access link is up ([`handshake_done`]), `None`
    /// when it fails.
    fn handshake(&mut self, dial: SimTime) -> Option<SimTime> {
        handshake_done(
            dial,
            &mut self.handshake_up,
            &mut self.handshake_down,
            dial_timeout(),
        )
    }
}

impl World<'_> {
    pub(super) fn link_mut(&mut self, r: LinkRef) -> &mut MuxLink {
        match r {
            LinkRef::NodeUp(i) => &mut self.nodes[i].up,
            LinkRef::NodeDown(i) => &mut self.nodes[i].down,
            LinkRef::AggUp(a) => &mut self.aggs[a].up,
            LinkRef::AggDown(a) => &mut self.aggs[a].down,
        }
    }

    fn class_of(&self, r: LinkRef) -> &'static str {
        match r {
            LinkRef::NodeUp(i) | LinkRef::NodeDown(i) => self.nodes[i].class.label(),
            LinkRef::AggUp(_) | LinkRef::AggDown(_) => "aggregator",
        }
    }

    fn route(cargo: &Cargo, hop: u8) -> LinkRef {
        match (cargo, hop) {
            (Cargo::Delta { from, .. }, 0) => LinkRef::NodeUp(*from),
            (Cargo::Delta { agg, .. }, _) => LinkRef::AggDown(*agg),
            (Cargo::ToNode { agg, .. }, 0) => LinkRef::AggUp(*agg),
            (Cargo::ToNode { node, .. }, _) => LinkRef::NodeDown(*node),
            (Cargo::Bootstrap { .. }, 0) => LinkRef::AggUp(0),
            (Cargo::Bootstrap { node, .. }, _) => LinkRef::NodeDown(*node),
        }
    }

    /// Hands `cargo` to hop `hop` of its route, now.
    pub(super) fn transmit(
        &mut self,
        hop: u8,
        deadline: Option<SimTime>,
        bytes: u64,
        cargo: Box<Cargo>,
    ) {
        let now = self.now();
        let r = Self::route(&cargo, hop);
        self.sync_reverse_delay(r);
        let id = self.link_mut(r).submit(now, bytes, deadline);
        self.in_flight.insert(
            (r, id),
            InFlight {
                hop,
                deadline,
                bytes,
                cargo,
            },
        );
        self.pump_link(r);
    }

    /// A link's wake-up: runs it to now and handles what happened.
    pub(super) fn link_wake(&mut self, r: LinkRef, at: SimTime) {
        if self.link_wakes.get(&r) != Some(&at) {
            return; // superseded by an earlier wake-up
        }
        self.link_wakes.remove(&r);
        let now = self.now();
        self.sync_reverse_delay(r);
        self.link_mut(r).advance_through(now);
        self.pump_link(r);
    }

    /// Tells `r` how long its acknowledgements now wait on the other direction of the same
    /// access link (that direction's standing queue).
    fn sync_reverse_delay(&mut self, r: LinkRef) {
        let other = match r {
            LinkRef::NodeUp(i) => LinkRef::NodeDown(i),
            LinkRef::NodeDown(i) => LinkRef::NodeUp(i),
            LinkRef::AggUp(a) => LinkRef::AggDown(a),
            LinkRef::AggDown(a) => LinkRef::AggUp(a),
        };
        let now = self.now();
        let delay = self.link_mut(other).current_queue_wait(now);
        self.link_mut(r).set_reverse_delay(delay);
    }

    /// Counts the bytes `r` has serialized since the last count (retransmissions, lost packets
    /// and messages still on their way included, as a real relay counts what it received from
    /// the sender).
    fn count_link_bytes(&mut self, r: LinkRef) {
        let serialized = self.link_mut(r).bytes_serialized();
        let counted = self.bytes_counted.entry(r).or_insert(0);
        let new = serialized - *counted;
        *counted = serialized;
        let class = self.class_of(r);
        *self.bytes_by_class.entry(class.to_string()).or_default() += new;
        self.bytes_total += new;
    }

    /// Bytes counted so far on each link, by `NODE.up` / `NODE.down` (`agg-A.up` / `agg-A.down`
    /// for an aggregator's own access link).
    pub(super) fn bytes_by_link(&self) -> BTreeMap<String, u64> {
        self.bytes_counted
            .iter()
            .map(|(r, &bytes)| {
                let name = match *r {
                    LinkRef::NodeUp(i) => format!("{}.up", self.nodes[i].name),
                    LinkRef::NodeDown(i) => format!("{}.down", self.nodes[i].name),
                    LinkRef::AggUp(a) => format!("agg-{a}.up"),
                    LinkRef::AggDown(a) => format!("agg-{a}.down"),
                };
                (name, bytes)
            })
            .collect()
    }

    /// Runs every link up to now and counts its bytes, without handling its events (their
    /// wake-ups, at or before them, do that): for an evaluation and the end of the run.
    pub(super) fn count_all_link_bytes(&mut self) {
        let now = self.now();
        let links: Vec<LinkRef> = (0..self.nodes.len())
            .flat_map(|i| [LinkRef::NodeUp(i), LinkRef::NodeDown(i)])
            .chain((0..self.aggs.len()).flat_map(|a| [LinkRef::AggUp(a), LinkRef::AggDown(a)]))
            .collect();
        for r in links {
            self.link_mut(r).advance_through(now);
            self.count_link_bytes(r);
        }
    }

    /// Handles a link's events, counts its bytes and schedules its next wake-up.
    fn pump_link(&mut self, r: LinkRef) {
        self.count_link_bytes(r);
        for event in self.link_mut(r).take_events() {
            match event {
                // A version's slot frees when the node has it (`arrive`) or it is lost, as the
                // real aggregator's frees when the subscriber acknowledged it.
                MuxEvent::Admitted { .. } => {}
                MuxEvent::Finished { id, transfer, .. } => {
                    let Some(f) = self.in_flight.remove(&(r, id)) else {
                        continue;
                    };
                    match transfer.delivered_at {
                        Some(at) => self.schedule(
                            at,
                            Event::Hop {
                                hop: f.hop + 1,
                                deadline: f.deadline,
                                bytes: f.bytes,
                                cargo: f.cargo,
                            },
                        ),
                        None => self.lost(*f.cargo),
                    }
                }
            }
        }
        if let Some(died) = self.link_mut(r).take_connection_lost() {
            self.reconnect(r, died);
        }
        if let Some(wake) = self.link_mut(r).next_wake() {
            if self.link_wakes.get(&r).is_none_or(|&s| wake < s) {
                self.link_wakes.insert(r, wake);
                self.schedule(wake, Event::LinkWake { link: r, at: wake });
            }
        }
    }

    /// `r`'s connection died at `died` (its idle timeout): a node's connection carries both
    /// directions of its access link, so the other direction loses what it had in flight too,
    /// and neither sends before the agent has reconnected ([`reconnected_at`]); the node
    /// flushes its weak-sync backlog then, as a real agent does when its link is up again. An
    /// aggregator's own access link carries many connections and goes on at once.
    fn reconnect(&mut self, r: LinkRef, died: SimTime) {
        let (LinkRef::NodeUp(node) | LinkRef::NodeDown(node)) = r else {
            return;
        };
        let n = &mut self.nodes[node];
        let back = reconnected_at(died, dial_timeout(), |dial| n.handshake(dial));
        let other = match r {
            LinkRef::NodeUp(i) => LinkRef::NodeDown(i),
            _ => LinkRef::NodeUp(node),
        };
        self.link_mut(r).pause_until(back);
        let now = self.now();
        self.link_mut(other).connection_lost(now, back);
        self.pump_link(other);
        let gen = self.nodes[node].gen;
        self.schedule(back, Event::Reconnected { node, gen });
    }

    /// Node `node` dials its aggregator now (it starts, or starts again after a crash): its
    /// access link carries nothing before the connection is up ([`connected_at`], the
    /// handshake over the link); returns when that is.
    pub(super) fn dial(&mut self, node: usize) -> SimTime {
        let now = self.now();
        let n = &mut self.nodes[node];
        let up_at = connected_at(now, dial_timeout(), |dial| n.handshake(dial));
        self.link_mut(LinkRef::NodeUp(node)).pause_until(up_at);
        self.link_mut(LinkRef::NodeDown(node)).pause_until(up_at);
        up_at
    }

    /// The node's new connection is up: it subscribes again, and every aggregator answers
    /// with the current version of each of its layers (`answer_subscribe`), as in a real run;
    /// the node flushes its weak-sync backlog.
    pub(super) fn reconnected(&mut self, node: usize, gen: u64) {
        let n = &self.nodes[node];
        if n.gen != gen || !n.subscribed || n.client.is_none() {
            return;
        }
        let wire = n.wire;
        let now = self.now().as_nanos();
        for a in 0..self.aggs.len() {
            let subscribe = Message::Subscribe(Subscribe { node_id: wire });
            self.aggs[a].state.handle_message(now, wire, subscribe);
            self.pump_agg(a);
        }
        if let Some(c) = self.nodes[node].client.as_mut() {
            c.on_link_up(now);
            self.after_node_activity(node);
        }
    }

    fn lost(&mut self, cargo: Cargo) {
        match cargo {
            Cargo::Delta { key, .. } => self.leave_transit(key),
            Cargo::ToNode {
                node,
                gen,
                msg,
                version: Some((layer, version)),
                ..
            } => {
                self.free_version_slot(node, gen, layer);
                if self.nodes[node].gen == gen {
                    let n = &mut self.nodes[node];
                    let l = layer as usize;
                    n.sent_version[l] = n
                        .client
                        .as_ref()
                        .and_then(|c| c.version(layer))
                        .unwrap_or(0);
                    if !n.pending_versions.contains_key(&layer) {
                        let bytes = self.layers[l].version_frame_bytes;
                        self.enqueue_version(node, layer, version, bytes, Rc::new(msg), true);
                    }
                }
            }
            Cargo::ToNode { .. } => {}
            Cargo::Bootstrap { node, gen, .. } => {
                let now = self.now();
                self.schedule(now + super::BOOTSTRAP_RETRY, Event::Rejoin { node, gen });
            }
        }
    }

    pub(super) fn leave_transit(&mut self, key: super::DeltaKey) {
        if let Some(count) = self.in_transit.get_mut(&key) {
            *count -= 1;
            if *count == 0 {
                self.in_transit.remove(&key);
            }
        }
    }

    pub(super) fn arrive(
        &mut self,
        hop: u8,
        deadline: Option<SimTime>,
        bytes: u64,
        cargo: Box<Cargo>,
    ) {
        if hop < 2 {
            return self.transmit(hop, deadline, bytes, cargo);
        }
        let now = self.now().as_nanos();
        match *cargo {
            Cargo::Delta {
                from,
                agg,
                key,
                msg,
            } => {
                self.leave_transit(key);
                let wire = self.nodes[from].wire;
                self.aggs[agg].state.handle_message(now, wire, msg);
                self.pump_agg(agg);
            }
            Cargo::ToNode {
                node,
                gen,
                msg,
                version,
                ..
            } => {
                if let Some((layer, _)) = version {
                    self.free_version_slot(node, gen, layer);
                }
                let n = &mut self.nodes[node];
                if n.gen != gen {
                    return;
                }
                let Some(client) = n.client.as_mut() else {
                    return;
                };
                client.handle_message(now, msg);
                self.after_node_activity(node);
            }
            Cargo::Bootstrap {
                node,
                gen,
                values,
                versions,
            } => {
                if self.nodes[node].gen == gen {
                    if let Err(e) = self.finish_bootstrap(node, values, &versions) {
                        self.fatal = Some(e);
                    }
                }
            }
        }
    }

    // ----- versions: one slot per node and layer, latest wins -----------------------------

    /// Queues a layer version for `node` (latest wins). A `forced` version (a direct reply,
    /// e.g. after a resync) goes out even if the node already received that version.
    pub(super) fn enqueue_version(
        &mut self,
        node: usize,
        layer: u32,
        version: u64,
        bytes: u64,
        msg: Rc<Message>,
        forced: bool,
    ) {
        let n = &mut self.nodes[node];
        if !n.subscribed || (!forced && version <= n.sent_version[layer as usize]) {
            return;
        }
        if n.pending_versions
            .get(&layer)
            .is_some_and(|p| p.version >= version)
        {
            return;
        }
        self.version_order += 1;
        let order = self.version_order;
        self.nodes[node].pending_versions.insert(
            layer,
            PendingVersion {
                version,
                order,
                bytes,
                msg,
            },
        );
        self.try_send_versions(node);
    }

    /// The frame of `layer`'s version for `node` reached it (or was lost): its slot is free.
    fn free_version_slot(&mut self, node: usize, gen: u64, layer: u32) {
        if self.nodes[node].gen == gen && self.nodes[node].version_busy.remove(&layer) {
            self.try_send_versions(node);
        }
    }

    /// Sends every pending version whose slot is free, oldest first.
    pub(super) fn try_send_versions(&mut self, node: usize) {
        loop {
            let n = &mut self.nodes[node];
            if !n.subscribed {
                return;
            }
            let Some(layer) = n
                .pending_versions
                .iter()
                .filter(|(l, _)| !n.version_busy.contains(l))
                .min_by_key(|(_, p)| p.order)
                .map(|(&l, _)| l)
            else {
                return;
            };
            let Some(p) = n.pending_versions.remove(&layer) else {
                return;
            };
            n.version_busy.insert(layer);
            n.sent_version[layer as usize] = n.sent_version[layer as usize].max(p.version);
            let msg = Rc::try_unwrap(p.msg).unwrap_or_else(|rc| (*rc).clone());
            let gen = n.gen;
            let agg = self.layers[layer as usize].owner;
            self.transmit(
                0,
                None,
                p.bytes,
                Box::new(Cargo::ToNode {
                    agg,
                    node,
                    gen,
                    msg,
                    version: Some((layer, p.version)),
                }),
            );
        }
    }
}
