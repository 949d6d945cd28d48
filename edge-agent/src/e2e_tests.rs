//! End-to-end tests: one real [`cpu_aggregator::AggregatorState`] and several
//! [`SyncClient`]s wired by a tiny in-test event loop (virtual time in nanoseconds, a fixed
//! link latency, per-node link switches that drop messages), plus unit-level client checks.
//! Deterministic: nothing sleeps, nothing reads a clock.

use std::collections::{BTreeMap, VecDeque};

use cpu_aggregator::{AggEvent, AggregatorConfig, AggregatorState, InputError, OwnedLayer};
use engine::staleness::StalenessFn;
use proptest::prelude::*;
use protocol::{payload_from_f32, Codec, ErrorCode, LayerMeta, Message, ResyncReason};

use crate::{
    CacheEntry, ClientConfig, ClientEvent, CutOutcome, LayerInit, LayerSpec, Output, SyncClient,
};

const AGG: u64 = 100;
const LATENCY: u64 = 1_000_000; // 1 ms
const DEADLINE: u64 = 10_000_000; // 10 ms
const LEN: usize = 4;

/// A client node as its shell would run it: parameters, a durable cache store, a link.
struct Node {
    id: u64,
    client: SyncClient,
    theta: Vec<f32>,
    store: BTreeMap<u64, CacheEntry>,
    /// Messages from and to this node are dropped while false.
    link_up: bool,
    /// Messages from the aggregator to this node are dropped while false.
    replies_up: bool,
    events: Vec<ClientEvent>,
}

enum Dest {
    Agg { from: u64 },
    Node(usize),
}

struct World {
    now: u64,
    agg: AggregatorState,
    nodes: Vec<Node>,
    net: VecDeque<(u64, Dest, Message)>,
    agg_events: Vec<AggEvent>,
    theta0: Vec<f32>,
}

fn spec() -> LayerSpec {
    LayerSpec {
        layer_id: 0,
        name: "fc".into(),
        shape: vec![LEN as u32],
        period_steps: 1,
        phase: 0,
        deadline_ns: DEADLINE,
        owner: AGG,
        max_stale_steps: None,
        matrix_rows: None,
    }
}

fn new_client(id: u64, values: Vec<f32>, version: u64, first_seq: u64) -> SyncClient {
    let config = ClientConfig {
        first_seq,
        flush_interval_ns: 50_000_000,
        ..Default::default()
    };
    SyncClient::new(
        id,
        vec![LayerInit {
            spec: spec(),
            values,
            version,
        }],
        config,
    )
    .unwrap()
}

impl World {
    fn new(n: usize, config: AggregatorConfig) -> World {
        let theta0 = vec![1.0f32, -2.0, 0.5, 3.0];
        let layer = OwnedLayer {
            layer_id: 0,
            name: "fc".into(),
            shape: vec![LEN as u32],
            values: theta0.clone(),
        };
        let nodes = (0..n)
            .map(|i| Node {
                id: i as u64 + 1,
                client: new_client(i as u64 + 1, theta0.clone(), 0, 1),
                theta: theta0.clone(),
                store: BTreeMap::new(),
                link_up: true,
                replies_up: true,
                events: Vec::new(),
            })
            .collect();
        World {
            now: 0,
            agg: AggregatorState::new(AGG, vec![layer], config).unwrap(),
            nodes,
            net: VecDeque::new(),
            agg_events: Vec::new(),
            theta0,
        }
    }

    /// Drains every state machine's outputs until all are quiet.
    fn pump(&mut self) {
        loop {
            let mut progressed = false;
            for i in 0..self.nodes.len() {
                while let Some(out) = self.nodes[i].client.poll_output() {
                    progressed = true;
                    let now = self.now;
                    let node = &mut self.nodes[i];
                    match out {
                        Output::Send { to, msg } => {
                            assert_eq!(to, AGG);
                            if node.link_up {
                                self.net.push_back((
                                    now + LATENCY,
                                    Dest::Agg { from: node.id },
                                    msg,
                                ));
                            }
                        }
                        Output::CachePut { entry } => {
                            let (layer, seq) = (entry.layer_id, entry.seq);
                            // Durable encoding round trip, as the real shell stores bytes.
                            let stored = CacheEntry::from_bytes(&entry.to_bytes()).unwrap();
                            assert!(
                                node.store.insert(seq, stored).is_none(),
                                "seq {seq} stored twice"
                            );
                            node.client.cache_put_done(now, layer, seq);
                        }
                        Output::CacheReplace {
                            layer_id,
                            remove,
                            put,
                        } => {
                            for seq in &remove {
                                assert!(
                                    node.store.remove(seq).is_some(),
                                    "replace of missing seq {seq}"
                                );
                            }
                            let seq = put.seq;
                            node.store.insert(seq, put);
                            node.client.cache_put_done(now, layer_id, seq);
                        }
                        Output::CacheRemove { seqs, .. } => {
                            for seq in seqs {
                                assert!(
                                    node.store.remove(&seq).is_some(),
                                    "remove of missing seq {seq}"
                                );
                            }
                        }
                        Output::ApplyVersion {
                            layer_id,
                            version,
                            values,
                        } => {
                            node.client
                                .apply_version(layer_id, &mut node.theta, &values, version)
                                .unwrap();
                        }
                        Output::Event(e) => node.events.push(e),
                    }
                }
            }
            while let Some(out) = self.agg.poll_output() {
                progressed = true;
                match out {
                    cpu_aggregator::Output::Send { to, msg } => {
                        let i = self.nodes.iter().position(|n| n.id == to).unwrap();
                        if self.nodes[i].link_up && self.nodes[i].replies_up {
                            self.net.push_back((self.now + LATENCY, Dest::Node(i), msg));
                        }
                    }
                    cpu_aggregator::Output::Broadcast { msg } => {
                        for i in 0..self.nodes.len() {
                            if self.nodes[i].link_up && self.nodes[i].replies_up {
                                self.net.push_back((
                                    self.now + LATENCY,
                                    Dest::Node(i),
                                    msg.clone(),
                                ));
                            }
                        }
                    }
                    cpu_aggregator::Output::Event(e) => self.agg_events.push(e),
                }
            }
            if !progressed {
                return;
            }
        }
    }

    fn next_event_time(&self) -> Option<u64> {
        let net = self.net.front().map(|m| m.0);
        let clients = self.nodes.iter().filter_map(|n| n.client.poll_timeout());
        net.into_iter()
            .chain(self.agg.poll_timeout())
            .chain(clients)
            .min()
    }

    /// Runs the event loop up to virtual time `until`.
    fn run_until(&mut self, until: u64) {
        self.pump();
        while let Some(t) = self.next_event_time().filter(|&t| t <= until) {
            self.now = self.now.max(t);
            while self.net.front().is_some_and(|m| m.0 <= self.now) {
                let (_, dest, msg) = self.net.pop_front().unwrap();
                match dest {
                    Dest::Agg { from } => self.agg.handle_message(self.now, from, msg),
                    Dest::Node(i) => self.nodes[i].client.handle_message(self.now, msg),
                }
                self.pump();
            }
            self.agg.handle_timeout(self.now);
            for n in &mut self.nodes {
                n.client.handle_timeout(self.now);
            }
            self.pump();
        }
        self.now = until;
    }

    /// Node `i` trains: θ += `progress`, then ends step `step` on `samples` samples.
    fn train(&mut self, i: usize, step: u64, progress: &[f32], samples: u64) {
        let now = self.now;
        let node = &mut self.nodes[i];
        for (t, p) in node.theta.iter_mut().zip(progress) {
            *t += p;
        }
        let theta = node.theta.clone();
        node.client
            .on_step_end(now, step, samples, |_| &theta)
            .unwrap();
        self.pump();
    }

    fn global(&self) -> Vec<f32> {
        self.agg.layer(0).unwrap().values.to_vec()
    }
}

fn async_config() -> AggregatorConfig {
    AggregatorConfig {
        staleness: StalenessFn::Constant,
        tau_max: 1_000,
        outer_lr: 1.0,
        round_size: 1,
        ..Default::default()
    }
}

fn add(a: &[f32], b: &[f32]) -> Vec<f32> {
    a.iter().zip(b).map(|(x, y)| x + y).collect()
}

#[test]
fn fresh_equal_sample_deltas_average_plainly_and_clients_converge() {
    let config = AggregatorConfig {
        round_size: 3,
        ..Default::default()
    };
    let mut w = World::new(3, config);
    let deltas = [
        [3.0f32, 0.0, -3.0, 6.0],
        [0.0, 3.0, 3.0, 0.0],
        [3.0, 3.0, 3.0, -3.0],
    ];
    for (i, d) in deltas.iter().enumerate() {
        w.train(i, 1, d, 16);
    }
    // Node 0 keeps training before the new version arrives: its progress must survive.
    let late = [0.25f32, 0.0, 0.0, -0.5];
    w.train(0, 2, &late, 0); // no samples: no cut, θ still moves
    w.run_until(5 * LATENCY);
    let mean = [2.0f32, 2.0, 1.0, 1.0];
    assert_eq!(w.global(), add(&w.theta0, &mean));
    assert_eq!(w.agg.layer(0).unwrap().version, 1);
    assert!(
        matches!(&w.agg_events[0], AggEvent::Applied { n_deltas: 3, staleness, .. } if staleness == &[0, 0, 0])
    );
    for (i, n) in w.nodes.iter().enumerate() {
        assert_eq!(n.client.version(0), Some(1));
        let expected = if i == 0 {
            add(&w.global(), &late)
        } else {
            w.global()
        };
        assert_eq!(n.theta, expected, "node {i}");
        assert_eq!(n.client.anchor(0).unwrap(), w.global());
        assert_eq!(n.client.undelivered(), 0);
        assert_eq!(n.client.counters().deltas_acked, 1);
    }
}

#[test]
fn a_synchronous_round_completes_only_when_every_node_s_delta_is_in_the_version() {
    // Round size 2: node 0's delta is acknowledged only once node 1's arrives and the
    // round is applied; until the new version is back, node 0's round is not over.
    let config = AggregatorConfig {
        round_size: 2,
        round_timeout_ns: 1_000_000_000_000,
        ..Default::default()
    };
    let mut w = World::new(2, config);
    assert!(w.nodes[0].client.round_complete(), "nothing sent yet");
    w.train(0, 1, &[1.0; LEN], 8);
    assert!(!w.nodes[0].client.round_complete(), "delta in flight");
    w.run_until(10 * LATENCY);
    assert!(
        !w.nodes[0].client.round_complete(),
        "the round waits for node 1"
    );
    w.train(1, 1, &[3.0; LEN], 8);
    w.run_until(20 * LATENCY);
    for (i, n) in w.nodes.iter().enumerate() {
        assert!(n.client.round_complete(), "node {i}");
        assert_eq!(
            n.client.version(0),
            Some(1),
            "node {i} has the round's version"
        );
    }
    assert_eq!(w.global(), add(&w.theta0, &[2.0; LEN]));
}

#[test]
fn a_cut_during_flight_is_deferred_and_rebase_keeps_local_progress() {
    let mut w = World::new(2, async_config());
    w.train(0, 1, &[1.0; LEN], 8);
    // Still in flight (latency 1 ms, nothing run yet): the next due cut is deferred.
    w.train(0, 2, &[0.5; LEN], 8);
    assert!(w.nodes[0].events.contains(&ClientEvent::CutDeferred {
        layer_id: 0,
        step: 2
    }));
    w.train(1, 1, &[2.0; LEN], 8);
    w.run_until(10 * LATENCY);
    // The global model holds both deltas; node 0 keeps its deferred progress on top.
    let global = add(&w.theta0, &[3.0; LEN]);
    assert_eq!(w.global(), global);
    assert_eq!(w.nodes[0].theta, add(&global, &[0.5; LEN]));
    assert_eq!(w.nodes[1].theta, global);
    // The deferred progress goes out with the next cut, with 16 samples behind it.
    w.train(0, 3, &[0.0; LEN], 0);
    w.run_until(20 * LATENCY);
    assert_eq!(w.global(), add(&global, &[0.5; LEN]));
    assert_eq!(w.agg.counters().deltas_applied, 3);
}

#[test]
fn dropped_messages_weak_sync_then_coalesce_and_apply_exactly_once() {
    let mut w = World::new(3, async_config());
    w.nodes[0].link_up = false;
    w.train(0, 1, &[1.0, 0.0, 0.0, 0.0], 4);
    w.run_until(5 * DEADLINE);
    let n0 = &w.nodes[0];
    assert_eq!(n0.client.counters().retransmissions, 2);
    assert_eq!(n0.client.counters().weak_sync_events, 1);
    assert!(n0.events.iter().any(|e| matches!(
        e,
        ClientEvent::WeakSynced {
            layer_id: 0,
            seq: 1,
            pending: 1
        }
    )));
    assert_eq!(n0.store.len(), 1);
    // Backlogged: new cuts go straight to the cache; the other nodes keep syncing.
    w.train(0, 2, &[0.0, 2.0, 0.0, 0.0], 4);
    w.train(0, 3, &[0.0, 0.0, 3.0, 0.0], 4);
    w.train(1, 1, &[0.0, 0.0, 0.0, 5.0], 4);
    w.run_until(6 * DEADLINE);
    // Cut 3 was merged into the never-sent cut 2 as it was cached: an outage's backlog is
    // the possibly-delivered entry plus one, however many cuts it spans.
    assert_eq!(w.nodes[0].store.len(), 2);
    assert_eq!(w.nodes[0].client.undelivered(), 2);
    assert!(w.nodes[0].events.iter().any(|e| matches!(e, ClientEvent::Coalesced { seq: 3, from_seqs, base_version: 0, .. } if from_seqs == &[2])));
    assert_eq!(w.agg.counters().deltas_applied, 1);

    w.nodes[0].link_up = true;
    w.nodes[0].client.on_link_up(w.now);
    w.run_until(10 * DEADLINE);
    let n0 = &w.nodes[0];
    // Entry 1 was possibly delivered: retransmitted alone. Cuts 2 and 3 (never sent) went
    // out as the one coalesced entry.
    assert_eq!(n0.client.counters().coalesced, 1);
    assert_eq!(n0.client.undelivered(), 0);
    assert!(n0.store.is_empty());
    assert_eq!(w.agg.counters().deltas_applied, 3);
    assert_eq!(w.agg.counters().duplicates_rejected, 0);
    assert_eq!(w.global(), add(&w.theta0, &[1.0, 2.0, 3.0, 5.0]));
    for n in &w.nodes {
        assert_eq!(n.theta, w.global(), "node {}", n.id);
    }
}

#[test]
fn an_outage_backlog_stays_at_two_entries_however_many_cuts_it_spans() {
    let mut w = World::new(1, async_config());
    w.nodes[0].link_up = false;
    let mut expected = vec![0.0f32; LEN];
    for step in 1..=200u64 {
        let mut d = [0.0f32; LEN];
        d[(step as usize) % LEN] = step as f32 * 0.01;
        for (e, x) in expected.iter_mut().zip(&d) {
            *e += x;
        }
        w.train(0, step, &d, 4);
        w.run_until(w.now + DEADLINE);
        assert!(
            w.nodes[0].store.len() <= 2 && w.nodes[0].client.pending(0) <= 2,
            "step {step}: {} entries stored",
            w.nodes[0].store.len()
        );
    }
    assert!(w.nodes[0].client.counters().coalesced >= 190);
    w.nodes[0].link_up = true;
    w.nodes[0].client.on_link_up(w.now);
    w.run_until(w.now + 10 * DEADLINE);
    assert_eq!(w.nodes[0].client.undelivered(), 0);
    assert!(w.nodes[0].store.is_empty());
    for (g, e) in w.global().iter().zip(add(&w.theta0, &expected)) {
        assert!((g - e).abs() < 1e-4, "global {g} vs {e}");
    }
}

#[test]
fn lost_acks_make_retransmissions_duplicates_that_are_rejected() {
    let mut w = World::new(1, async_config());
    // The return path is down: acks and versions are lost.
    w.nodes[0].replies_up = false;
    w.train(0, 1, &[1.0; LEN], 4);
    w.run_until(5 * DEADLINE);
    // Applied on the first attempt; both retries were duplicates (unacked, as replies drop).
    assert_eq!(w.agg.counters().deltas_applied, 1);
    assert_eq!(w.agg.counters().duplicates_rejected, 2);
    assert_eq!(w.nodes[0].client.counters().weak_sync_events, 1);
    assert_eq!(w.nodes[0].store.len(), 1);
    w.nodes[0].replies_up = true;
    w.nodes[0].client.on_link_up(w.now);
    w.run_until(6 * DEADLINE);
    assert_eq!(w.agg.counters().duplicates_rejected, 3);
    assert!(w.agg_events.contains(&AggEvent::DuplicateRejected {
        from: 1,
        layer_id: 0,
        seq: 1
    }));
    assert!(w.nodes[0].events.contains(&ClientEvent::Delivered {
        layer_id: 0,
        seq: 1,
        applied: false,
        new_version: 1
    }));
    assert!(w.nodes[0].store.is_empty());
    assert_eq!(w.global(), add(&w.theta0, &[1.0; LEN]));
}

#[test]
fn a_too_stale_delta_gets_resync_and_the_node_rebases_on_the_current_version() {
    let config = AggregatorConfig {
        tau_max: 1,
        ..async_config()
    };
    let mut w = World::new(2, config);
    w.nodes[0].link_up = false;
    for step in 1..=3 {
        w.train(1, step, &[1.0; LEN], 4);
        w.run_until(w.now + 5 * LATENCY);
    }
    assert_eq!(w.agg.layer(0).unwrap().version, 3);
    w.nodes[0].link_up = true;
    w.train(0, 1, &[7.0; LEN], 4); // base version 0, τ = 3 > 1
    w.train(0, 2, &[0.5; LEN], 0); // local progress after the cut
    w.run_until(w.now + 5 * LATENCY);
    assert!(w.agg_events.iter().any(|e| matches!(
        e,
        AggEvent::DroppedStale {
            from: 1,
            reason: ResyncReason::TooStale {
                staleness: 3,
                max_staleness: 1
            },
            ..
        }
    )));
    let n0 = &w.nodes[0];
    assert!(n0
        .events
        .iter()
        .any(|e| matches!(e, ClientEvent::Dropped { seq: 1, .. })));
    assert_eq!(n0.client.counters().dropped_by_aggregator, 1);
    assert!(!n0.client.needs_resync(0));
    assert_eq!(n0.client.version(0), Some(3));
    // θ = θ_global + progress since the cut; the dropped delta is gone.
    assert_eq!(n0.theta, add(&w.global(), &[0.5; LEN]));
    assert_eq!(w.global(), add(&w.theta0, &[3.0; LEN]));
}

#[test]
fn a_late_resync_for_an_older_seq_keeps_the_in_flight_delta() {
    let mut w = World::new(1, async_config());
    w.train(0, 1, &[1.0; LEN], 4); // seq 1 goes out
                                   // A resync refusing an older copy (seq 0) arrives while seq 1 is in flight.
    let now = w.now;
    w.nodes[0].client.handle_message(
        now,
        Message::Resync(protocol::Resync {
            layer_id: 0,
            current_version: 0,
            refused_seq: Some(0),
            reason: ResyncReason::TooStale {
                staleness: 3,
                max_staleness: 1,
            },
        }),
    );
    w.run_until(w.now + 5 * LATENCY);
    let n0 = &w.nodes[0];
    assert!(!n0
        .events
        .iter()
        .any(|e| matches!(e, ClientEvent::Dropped { .. })));
    assert!(n0.events.iter().any(|e| matches!(
        e,
        ClientEvent::Delivered {
            seq: 1,
            applied: true,
            ..
        }
    )));
    assert_eq!(n0.client.counters().dropped_by_aggregator, 0);
    assert_eq!(w.global(), add(&w.theta0, &[1.0; LEN]));
    assert_eq!(n0.theta, w.global());
}

#[test]
fn bad_input_gets_typed_errors_while_others_are_served() {
    let mut w = World::new(2, async_config());
    let meta = |layer_id| LayerMeta {
        node_id: 2,
        layer_id,
        seq: 1,
        sample_count: 1,
        ..Default::default()
    };
    let wrong_len = payload_from_f32(meta(0), &[3], &[1.0; 3], Codec::RawF32).unwrap();
    let unknown = payload_from_f32(meta(9), &[4], &[1.0; 4], Codec::RawF32).unwrap();
    for p in [wrong_len, unknown] {
        w.net
            .push_back((w.now, Dest::Agg { from: 2 }, Message::LayerDelta(p)));
    }
    w.train(0, 1, &[1.0; LEN], 4);
    w.run_until(10 * LATENCY);
    let reasons: Vec<&InputError> = w
        .agg_events
        .iter()
        .filter_map(|e| match e {
            AggEvent::BadInput { from: 2, reason } => Some(reason),
            _ => None,
        })
        .collect();
    assert!(matches!(
        reasons[..],
        [
            InputError::ShapeMismatch { .. },
            InputError::NotOwner { layer_id: 9 }
        ]
    ));
    let codes: Vec<ErrorCode> = w.nodes[1]
        .events
        .iter()
        .filter_map(|e| match e {
            ClientEvent::PeerError { error } => Some(error.code),
            _ => None,
        })
        .collect();
    assert_eq!(codes, [ErrorCode::BadRequest, ErrorCode::NotOwner]);
    assert_eq!(w.global(), add(&w.theta0, &[1.0; LEN]));
    assert_eq!(w.nodes[0].client.counters().deltas_acked, 1);
}

#[test]
fn a_restarted_client_redelivers_its_durable_cache_exactly_once() {
    let mut w = World::new(1, async_config());
    w.nodes[0].link_up = false;
    w.train(0, 1, &[1.0; LEN], 4);
    w.run_until(5 * DEADLINE);
    w.train(0, 2, &[2.0; LEN], 4);
    w.train(0, 3, &[4.0; LEN], 4);
    assert_eq!(w.nodes[0].store.len(), 2, "cut 3 merged into cut 2");
    // kill -9: only the store, θ/anchor checkpoint and the persisted seq survive.
    let old = &w.nodes[0];
    let (anchor, theta, next_seq) = (
        old.client.anchor(0).unwrap().to_vec(),
        old.theta.clone(),
        old.client.next_seq(),
    );
    let entries: Vec<CacheEntry> = old.store.values().cloned().collect();
    let mut client = new_client(1, anchor, 0, next_seq);
    assert_eq!(
        client.restore_from_cache(w.now, entries.clone()).unwrap(),
        2
    );
    assert!(client
        .restore_from_cache(w.now, entries[..1].to_vec())
        .is_err());
    w.nodes[0].client = client;
    w.nodes[0].theta = theta;
    w.nodes[0].link_up = true;
    w.run_until(w.now + 10 * DEADLINE);
    assert!(w.nodes[0].store.is_empty());
    assert_eq!(w.nodes[0].client.undelivered(), 0);
    assert_eq!(w.agg.counters().deltas_applied, 2);
    assert_eq!(w.global(), add(&w.theta0, &[7.0; LEN]));
    assert_eq!(w.nodes[0].theta, w.global());
}

#[test]
fn aggregator_restart_from_snapshot_resyncs_clients() {
    let mut w = World::new(2, async_config());
    w.train(0, 1, &[1.0; LEN], 4);
    w.run_until(5 * LATENCY);
    let snapshot = w.agg.snapshot();
    w.train(1, 1, &[2.0; LEN], 4);
    w.run_until(10 * LATENCY);
    assert_eq!(w.nodes[1].client.version(0), Some(2));
    // The aggregator crashes and comes back from the older snapshot (version 1).
    w.agg = AggregatorState::restore(&snapshot, async_config()).unwrap();
    w.run_until(20 * LATENCY);
    for n in &w.nodes {
        assert_eq!(n.client.version(0), Some(1), "node {}", n.id);
        assert_eq!(n.theta, w.global());
    }
    assert_eq!(w.global(), add(&w.theta0, &[1.0; LEN]));
}

#[test]
fn client_rejects_misuse_with_typed_errors() {
    let mut c = new_client(1, vec![0.0; LEN], 0, 1);
    assert!(matches!(
        c.cut_layer(0, 1, 0, &[0.0; 3]),
        Err(crate::ClientError::LengthMismatch { .. })
    ));
    assert_eq!(
        c.cut_layer(0, 1, 7, &[0.0; LEN]),
        Err(crate::ClientError::UnknownLayer(7))
    );
    assert_eq!(
        c.cut_layer(0, 1, 0, &[0.0; LEN]),
        Ok(CutOutcome::SkippedNoSamples)
    );
    let mut theta = vec![0.0; LEN];
    assert!(c.apply_version(0, &mut theta, &[0.0; 2], 1).is_err());
    assert_eq!(c.apply_version(0, &mut theta, &[1.0; LEN], 0), Ok(false));
    let bad = LayerInit {
        spec: LayerSpec {
            period_steps: 0,
            ..spec()
        },
        values: vec![0.0; LEN],
        version: 0,
    };
    assert!(SyncClient::new(1, vec![bad], ClientConfig::default()).is_err());
}

#[derive(Clone, Debug)]
enum Op {
    Train { node: usize, progress: [i8; LEN] },
    Advance(u64),
    Link { node: usize, up: bool },
    Replies { node: usize, up: bool },
    LinkUpCall(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0usize..2, prop::array::uniform4(-3i8..=3)).prop_map(|(node, progress)| Op::Train { node, progress }),
        3 => (1u64..40).prop_map(|ms| Op::Advance(ms * 1_000_000)),
        2 => (0usize..2, any::<bool>()).prop_map(|(node, up)| Op::Link { node, up }),
        2 => (0usize..2, any::<bool>()).prop_map(|(node, up)| Op::Replies { node, up }),
        1 => (0usize..2).prop_map(Op::LinkUpCall),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    /// Whatever the losses and timings, once links are back and the system is quiet, every
    /// unit of local progress is either in the global model exactly once or still local:
    /// `Σ progress = (θ_global − θ₀) + Σ (θᵢ − anchorᵢ)`, with empty caches. Integer-valued
    /// deltas make the f32 arithmetic exact.
    #[test]
    fn no_delta_is_lost_or_applied_twice(ops in prop::collection::vec(op(), 1..40)) {
        let mut w = World::new(2, async_config());
        let mut total = [0.0f32; LEN];
        let mut steps = [0u64; 2];
        for op in ops {
            match op {
                Op::Train { node, progress } => {
                    let p: Vec<f32> = progress.iter().map(|&x| f32::from(x)).collect();
                    for (t, x) in total.iter_mut().zip(&p) {
                        *t += x;
                    }
                    steps[node] += 1;
                    w.train(node, steps[node], &p, 1);
                }
                Op::Advance(dt) => w.run_until(w.now + dt),
                Op::Link { node, up } => w.nodes[node].link_up = up,
                Op::Replies { node, up } => w.nodes[node].replies_up = up,
                Op::LinkUpCall(node) => {
                    let now = w.now;
                    w.nodes[node].client.on_link_up(now);
                }
            }
            // Nothing is stored twice or missing from the driver's store.
            for n in &w.nodes {
                let stored: Vec<u64> = n.store.keys().copied().collect();
                let believed: Vec<u64> = n.client.cached_entries(0).map(|e| e.seq).collect();
                prop_assert_eq!(stored, believed);
            }
        }
        for n in &mut w.nodes {
            n.link_up = true;
            n.replies_up = true;
        }
        for _ in 0..20 {
            w.run_until(w.now + 100_000_000);
        }
        let mut accounted = w.global();
        for (a, t0) in accounted.iter_mut().zip(&w.theta0) {
            *a -= t0;
        }
        for n in &w.nodes {
            prop_assert_eq!(n.client.undelivered(), 0);
            prop_assert!(n.store.is_empty());
            for k in 0..LEN {
                accounted[k] += n.theta[k] - n.client.anchor(0).unwrap()[k];
            }
        }
        prop_assert_eq!(accounted.to_vec(), total.to_vec());
    }
}
