//! Tests of the coordinator state machine: joins, leases, rebalancing with hand-over of the
//! global checkpoint, error replies, and a property test feeding random message sequences.

use proptest::prelude::*;
use protocol::{
    codec, Capabilities, Codec, DeltaAck, ErrorCode, Heartbeat, Join, LayerVersion, Leave, Message,
    NodeStats, Role, Subscribe,
};

use crate::config::{ConnId, CoordinatorConfig, LayerInfo};
use crate::error::{InputError, RefusalReason};
use crate::layer_map;
use crate::output::{CoordEvent, Output};
use crate::state::CoordinatorState;

const SECRET: &str = "s3cret";
const LEASE: u64 = 1_000;
const N_LAYERS: u32 = 8;

fn config() -> CoordinatorConfig {
    CoordinatorConfig {
        credentials: SECRET.into(),
        lease_ms: LEASE,
        layers: (0..N_LAYERS)
            .map(|i| LayerInfo {
                layer_id: i,
                name: format!("fc{i}"),
                shape: vec![2, 2],
            })
            .collect(),
        divergence: Default::default(),
    }
}

fn join(node_id: u64, role: Role, addr: &str) -> Message {
    Message::Join(Join {
        node_id,
        role,
        credentials: SECRET.into(),
        capabilities: Capabilities::default(),
        listen_addr: addr.into(),
    })
}

fn heartbeat(node_id: u64) -> Message {
    Message::Heartbeat(Heartbeat {
        node_id,
        lease_ms: LEASE,
        now_ms: 0,
    })
}

fn version(aggregator_id: u64, layer_id: u32, version: u64, fill: f32) -> LayerVersion {
    let encoded = codec::encode(&[fill; 4], Codec::RawF32).unwrap();
    LayerVersion {
        aggregator_id,
        layer_id,
        layer_name: format!("fc{layer_id}"),
        version,
        shape: vec![2, 2],
        codec: encoded.codec,
        payload: encoded.bytes,
        applied_seqs: Vec::new(),
    }
}

fn drain(state: &mut CoordinatorState) -> Vec<Output> {
    std::iter::from_fn(|| state.poll_output()).collect()
}

fn sent_to(outputs: &[Output], to: ConnId) -> Vec<Message> {
    outputs
        .iter()
        .filter_map(|o| match o {
            Output::Send { conn, msg } if *conn == to => Some(msg.clone()),
            _ => None,
        })
        .collect()
}

fn events(outputs: &[Output]) -> Vec<CoordEvent> {
    outputs
        .iter()
        .filter_map(|o| match o {
            Output::Event(e) => Some(e.clone()),
            _ => None,
        })
        .collect()
}

fn error_code(msgs: &[Message]) -> Option<ErrorCode> {
    msgs.iter().find_map(|m| match m {
        Message::Error(e) => Some(e.code),
        _ => None,
    })
}

/// A coordinator with a worker (node 1, conn 1) and an aggregator (node 10, conn 10).
fn cluster() -> CoordinatorState {
    let mut s = CoordinatorState::new(config());
    s.handle_message(0, 1, "worker-1", join(1, Role::Worker, ""));
    s.handle_message(
        0,
        10,
        "agg-10",
        join(10, Role::Aggregator, "127.0.0.1:7010"),
    );
    drain(&mut s);
    s
}

#[test]
fn bad_credentials_are_refused_and_closed() {
    let mut s = CoordinatorState::new(config());
    let Message::Join(mut j) = join(5, Role::Edge, "") else {
        unreachable!()
    };
    j.credentials = "guess".into();
    s.handle_message(0, 3, "intruder", Message::Join(j));
    let out = drain(&mut s);
    assert_eq!(error_code(&sent_to(&out, 3)), Some(ErrorCode::Unauthorized));
    assert!(out
        .iter()
        .any(|o| matches!(o, Output::Close { conn: 3, .. })));
    assert!(events(&out).contains(&CoordEvent::Refused {
        conn: 3,
        peer: "intruder".into(),
        reason: RefusalReason::BadCredentials,
    }));
    assert_eq!(RefusalReason::BadCredentials.to_string(), "bad credentials");
    assert!(s.member(5).is_none());
    // A prefix of the secret is not the secret.
    let Message::Join(mut j) = join(5, Role::Edge, "") else {
        unreachable!()
    };
    j.credentials = "s3cre".into();
    s.handle_message(0, 4, "intruder", Message::Join(j));
    assert!(s.member(5).is_none());
}

#[test]
fn aggregator_needs_a_socket_address() {
    let mut s = CoordinatorState::new(config());
    s.handle_message(0, 3, "agg", join(3, Role::Aggregator, "not an address"));
    let out = drain(&mut s);
    assert_eq!(error_code(&sent_to(&out, 3)), Some(ErrorCode::BadRequest));
    assert!(!out.iter().any(|o| matches!(o, Output::Close { .. })));
    assert!(s.member(3).is_none());
    assert_eq!(s.epoch(), 0);
}

#[test]
fn worker_join_gets_the_current_map() {
    let mut s = CoordinatorState::new(config());
    s.handle_message(5, 1, "worker-1", join(1, Role::Worker, ""));
    let out = drain(&mut s);
    let msgs = sent_to(&out, 1);
    let [Message::JoinAck(ack)] = msgs.as_slice() else {
        panic!("{msgs:?}")
    };
    assert_eq!(ack.node_id, 1);
    assert_eq!(ack.lease_ms, LEASE);
    assert_eq!(ack.map_epoch, 0);
    assert!(ack.layer_owners.is_empty());
    assert_eq!(ack.layer_versions.len(), N_LAYERS as usize);
    assert!(ack.layer_versions.iter().all(|&(_, v)| v == 0));
    assert_eq!(s.poll_timeout(), Some(5 + LEASE));
    assert!(matches!(
        events(&out).as_slice(),
        [CoordEvent::Joined {
            node_id: 1,
            rejoin: false,
            role: Role::Worker,
            ..
        }]
    ));
}

#[test]
fn aggregator_join_builds_the_map_and_tells_everyone() {
    let mut s = CoordinatorState::new(config());
    s.handle_message(0, 1, "worker-1", join(1, Role::Worker, ""));
    drain(&mut s);
    s.handle_message(
        0,
        10,
        "agg-10",
        join(10, Role::Aggregator, "127.0.0.1:7010"),
    );
    let out = drain(&mut s);
    assert_eq!(s.epoch(), 1);
    assert_eq!(s.owners().len(), N_LAYERS as usize);
    let [Message::JoinAck(ack)] = <[Message; 1]>::try_from(sent_to(&out, 10)).unwrap() else {
        panic!()
    };
    assert_eq!(ack.map_epoch, 1);
    assert_eq!(ack.aggregators.len(), 1);
    assert_eq!(ack.aggregators[0].addr, "127.0.0.1:7010");
    let [Message::LayerMap(map)] = <[Message; 1]>::try_from(sent_to(&out, 1)).unwrap() else {
        panic!()
    };
    assert_eq!(
        (map.epoch, map.owners.clone()),
        (1, ack.layer_owners.clone())
    );
    assert!(out.contains(&Output::Subscribe {
        aggregator_id: 10,
        addr: "127.0.0.1:7010".into(),
        name: "agg-10".into(),
    }));
    assert!(events(&out)
        .iter()
        .any(|e| matches!(e, CoordEvent::Rebalanced { epoch: 1, moved, .. } if moved.len() == 8)));
}

#[test]
fn second_aggregator_takes_its_layers_with_their_checkpoint() {
    let mut s = cluster();
    for layer in 0..N_LAYERS {
        // Layer 0 stays at version 0 (nothing to hand over), the others advance.
        let v = u64::from(layer);
        s.handle_message(
            1,
            10,
            "agg-10",
            Message::LayerVersion(version(10, layer, v, 1.0)),
        );
    }
    drain(&mut s);
    s.handle_message(
        2,
        11,
        "agg-11",
        join(11, Role::Aggregator, "127.0.0.1:7011"),
    );
    let out = drain(&mut s);
    assert_eq!(s.epoch(), 2);
    let layers: Vec<(u32, u64)> = s.layers.values().map(|l| (l.layer_id, l.bytes())).collect();
    let expected = layer_map::assign_owners(&layers, &[10, 11]);
    assert_eq!(
        s.owners(),
        expected.iter().map(|(&l, &a)| (l, a)).collect::<Vec<_>>()
    );
    let moved: Vec<u32> = expected
        .iter()
        .filter(|(_, &a)| a == 11)
        .map(|(&l, _)| l)
        .collect();
    assert!(
        !moved.is_empty() && moved.len() < N_LAYERS as usize,
        "{moved:?}"
    );
    // Two-phase hand-over: agg-10 is alive, so nothing is handed over yet; the coordinator
    // waits for agg-10's final version of each moved layer.
    let handed = |out: &[Output]| -> Vec<(u32, u64)> {
        sent_to(out, 11)
            .into_iter()
            .filter_map(|m| match m {
                Message::LayerVersion(v) => Some((v.layer_id, v.version)),
                _ => None,
            })
            .collect()
    };
    assert_eq!(handed(&out), vec![]);
    // The old owner and the worker learn the new map; agg-11 has it in its JoinAck, with the
    // versions to wait for and who produced them.
    for conn in [1, 10] {
        assert!(sent_to(&out, conn)
            .iter()
            .any(|m| matches!(m, Message::LayerMap(map) if map.epoch == 2)));
    }
    let ack = sent_to(&out, 11)
        .into_iter()
        .find_map(|m| match m {
            Message::JoinAck(a) => Some(a),
            _ => None,
        })
        .expect("a JoinAck");
    let mut releasing = ack.releasing_layers.clone();
    releasing.sort_unstable();
    assert_eq!(releasing, moved, "agg-11 learns which layers to wait for");
    assert!(!ack.layer_producers.is_empty());
    assert!(ack.layer_producers.iter().all(|&(_, p)| p == 10));
    assert!(!sent_to(&out, 11)
        .iter()
        .any(|m| matches!(m, Message::LayerMap(_))));
    let moving: Vec<u32> = moved.iter().copied().filter(|&l| l > 0).collect();
    assert!(!moving.is_empty(), "{moved:?}");
    let status = s.status(2);
    for &l in &moving {
        assert_eq!(status.layers[l as usize].releasing_from, Some(10));
        assert_eq!(status.layers[l as usize].produced_by, Some(10));
    }
    // agg-10 releases the first moved layer with its final version (one more than the
    // checkpoint): it is handed to agg-11 at once.
    let first = moving[0];
    let last = u64::from(first) + 1;
    s.handle_message(
        3,
        10,
        "agg-10",
        Message::LayerVersion(version(10, first, last, 2.0)),
    );
    let out = drain(&mut s);
    assert_eq!(handed(&out), vec![(first, last)]);
    assert_eq!(s.cached_version(first).unwrap().version, last);
    // Another final version of the same layer from agg-10 comes too late: the layer belongs
    // to agg-11 now, so it neither advances the checkpoint nor is handed over.
    s.handle_message(
        4,
        10,
        "agg-10",
        Message::LayerVersion(version(10, first, last + 5, 3.0)),
    );
    let out = drain(&mut s);
    assert_eq!(handed(&out), vec![]);
    assert_eq!(s.cached_version(first).unwrap().version, last);
    // The other moved layers never get a final version: after the release timeout, their
    // checkpoints are handed over instead.
    assert_eq!(
        s.poll_timeout(),
        Some(2 + crate::state::RELEASE_TIMEOUT_MS).min(s.poll_timeout())
    );
    s.handle_timeout(2 + crate::state::RELEASE_TIMEOUT_MS);
    let out = drain(&mut s);
    let rest: Vec<(u32, u64)> = moving[1..].iter().map(|&l| (l, u64::from(l))).collect();
    assert_eq!(handed(&out), rest);
    let timed_out = events(&out)
        .into_iter()
        .filter(|e| matches!(e, CoordEvent::ReleaseTimedOut { from: 10, .. }))
        .count();
    assert_eq!(timed_out, rest.len());
}

#[test]
fn heartbeats_renew_leases_and_expiry_removes_members() {
    let mut s = cluster();
    s.handle_message(600, 1, "worker-1", heartbeat(1));
    let out = drain(&mut s);
    assert!(matches!(
        sent_to(&out, 1).as_slice(),
        [Message::Heartbeat(Heartbeat {
            node_id: 1,
            lease_ms: LEASE,
            now_ms: 600
        })]
    ));
    assert_eq!(s.poll_timeout(), Some(LEASE));
    s.handle_timeout(999);
    assert!(drain(&mut s).is_empty());
    s.handle_timeout(LEASE);
    let out = drain(&mut s);
    assert!(s.member(10).is_none(), "the aggregator did not heartbeat");
    assert!(s.member(1).is_some());
    assert!(s.owners().is_empty());
    assert_eq!(s.epoch(), 2);
    let ev = events(&out);
    assert!(ev
        .iter()
        .any(|e| matches!(e, CoordEvent::LeaseExpired { node_id: 10, .. })));
    assert!(ev.contains(&CoordEvent::NoAggregators { epoch: 2 }));
    assert!(out.contains(&Output::Unsubscribe { aggregator_id: 10 }));
    assert!(out
        .iter()
        .any(|o| matches!(o, Output::Close { conn: 10, .. })));
    assert!(sent_to(&out, 1)
        .iter()
        .any(|m| matches!(m, Message::LayerMap(map) if map.owners.is_empty() && map.epoch == 2)));
    assert_eq!(s.poll_timeout(), Some(600 + LEASE));
}

#[test]
fn losing_an_aggregator_hands_its_layers_to_the_survivor() {
    let mut s = cluster();
    s.handle_message(
        0,
        11,
        "agg-11",
        join(11, Role::Aggregator, "127.0.0.1:7011"),
    );
    for layer in 0..N_LAYERS {
        let owner = s.owners()[layer as usize].1;
        s.handle_message(
            0,
            owner,
            "x",
            Message::LayerVersion(version(owner, layer, 5, 2.0)),
        );
    }
    drain(&mut s);
    let lost: Vec<u32> = s
        .owners()
        .iter()
        .filter(|(_, a)| *a == 11)
        .map(|(l, _)| *l)
        .collect();
    s.handle_message(
        10,
        11,
        "agg-11",
        Message::Leave(Leave {
            node_id: 11,
            reason: "bye".into(),
        }),
    );
    let out = drain(&mut s);
    assert!(s.owners().iter().all(|&(_, a)| a == 10));
    let handed: Vec<u32> = sent_to(&out, 10)
        .into_iter()
        .filter_map(|m| match m {
            Message::LayerVersion(v) if v.version == 5 => Some(v.layer_id),
            _ => None,
        })
        .collect();
    assert_eq!(handed, lost);
    assert!(events(&out)
        .iter()
        .any(|e| matches!(e, CoordEvent::Left { node_id: 11, .. })));
    assert!(out
        .iter()
        .any(|o| matches!(o, Output::Close { conn: 11, .. })));
}

#[test]
fn member_messages_need_a_join_and_the_right_node_id() {
    let mut s = cluster();
    s.handle_message(0, 99, "stranger", heartbeat(1));
    s.handle_message(0, 1, "worker-1", heartbeat(2));
    s.handle_message(
        0,
        1,
        "worker-1",
        Message::Leave(Leave {
            node_id: 10,
            reason: String::new(),
        }),
    );
    let out = drain(&mut s);
    assert_eq!(error_code(&sent_to(&out, 99)), Some(ErrorCode::UnknownNode));
    let replies = sent_to(&out, 1);
    assert_eq!(replies.len(), 2);
    assert!(replies
        .iter()
        .all(|m| matches!(m, Message::Error(e) if e.code == ErrorCode::BadRequest)));
    assert!(s.member(10).is_some());
    assert!(!out.iter().any(|o| matches!(o, Output::Close { .. })));
}

#[test]
fn unexpected_kinds_get_bad_request_naming_the_kind() {
    let mut s = cluster();
    let ack = DeltaAck {
        node_id: 1,
        layer_id: 0,
        seq: 1,
        applied: true,
        new_version: 1,
    };
    s.handle_message(0, 1, "worker-1", Message::DeltaAck(ack));
    s.handle_message(
        0,
        1,
        "worker-1",
        Message::Subscribe(Subscribe { node_id: 1 }),
    );
    let out = drain(&mut s);
    let texts: Vec<String> = sent_to(&out, 1)
        .into_iter()
        .map(|m| match m {
            Message::Error(e) if e.code == ErrorCode::BadRequest => e.text,
            other => panic!("{other:?}"),
        })
        .collect();
    assert!(
        texts[0].contains("DeltaAck") && texts[1].contains("Subscribe"),
        "{texts:?}"
    );
    assert!(events(&out).contains(&CoordEvent::BadInput {
        conn: 1,
        peer: "worker-1".into(),
        reason: InputError::UnexpectedKind { kind: "DeltaAck" },
    }));
    assert!(!out.iter().any(|o| matches!(o, Output::Close { .. })));
}

#[test]
fn rejoin_replaces_the_connection_and_foreign_names_are_refused() {
    let mut s = cluster();
    s.handle_message(100, 2, "worker-1", join(1, Role::Worker, ""));
    let out = drain(&mut s);
    assert!(out
        .iter()
        .any(|o| matches!(o, Output::Close { conn: 1, .. })));
    assert!(events(&out).iter().any(|e| matches!(
        e,
        CoordEvent::Joined {
            node_id: 1,
            rejoin: true,
            ..
        }
    )));
    assert_eq!(s.member(1).unwrap().conn, Some(2));
    assert_eq!(s.node_of_conn(1), None);
    // The old connection no longer speaks for node 1.
    s.handle_message(100, 1, "worker-1", heartbeat(1));
    assert_eq!(
        error_code(&sent_to(&drain(&mut s), 1)),
        Some(ErrorCode::UnknownNode)
    );
    // Another certificate cannot take node 1 over.
    s.handle_message(100, 3, "mallory", join(1, Role::Worker, ""));
    let out = drain(&mut s);
    assert_eq!(error_code(&sent_to(&out, 3)), Some(ErrorCode::BadRequest));
    assert!(events(&out).iter().any(|e| matches!(
        e,
        CoordEvent::Refused {
            reason: RefusalReason::NodeIdTaken { node_id: 1, .. },
            ..
        }
    )));
    assert_eq!(s.member(1).unwrap().conn, Some(2));
}

#[test]
fn aggregator_rejoin_at_the_same_address_keeps_the_epoch_but_gets_its_checkpoint() {
    let mut s = cluster();
    s.handle_message(
        0,
        10,
        "agg-10",
        Message::LayerVersion(version(10, 3, 7, 1.5)),
    );
    drain(&mut s);
    s.handle_message(
        50,
        20,
        "agg-10",
        join(10, Role::Aggregator, "127.0.0.1:7010"),
    );
    let out = drain(&mut s);
    assert_eq!(s.epoch(), 1);
    let msgs = sent_to(&out, 20);
    assert!(matches!(msgs[0], Message::JoinAck(_)));
    assert!(msgs
        .iter()
        .any(|m| matches!(m, Message::LayerVersion(v) if v.layer_id == 3 && v.version == 7)));
    assert!(out.iter().any(|o| matches!(
        o,
        Output::Subscribe {
            aggregator_id: 10,
            ..
        }
    )));
}

#[test]
fn node_id_zero_gets_a_fresh_id() {
    let mut s = cluster();
    s.handle_message(0, 5, "edge-a", join(0, Role::Edge, ""));
    s.handle_message(0, 6, "edge-b", join(0, Role::Edge, ""));
    let out = drain(&mut s);
    let id = |conn| match sent_to(&out, conn).first() {
        Some(Message::JoinAck(ack)) => ack.node_id,
        other => panic!("{other:?}"),
    };
    let (a, b) = (id(5), id(6));
    assert!(a != b && a != 0 && b != 0 && ![1, 10].contains(&a) && ![1, 10].contains(&b));
}

#[test]
fn the_checkpoint_keeps_the_newest_valid_version() {
    let mut s = cluster();
    s.handle_message(
        0,
        10,
        "agg-10",
        Message::LayerVersion(version(10, 2, 4, 1.0)),
    );
    s.handle_message(
        0,
        10,
        "agg-10",
        Message::LayerVersion(version(10, 2, 3, 9.0)),
    );
    // Via the subscription connection: not joined, same certificate name.
    s.handle_message(
        0,
        77,
        "agg-10",
        Message::LayerVersion(version(10, 1, 2, 0.5)),
    );
    let out = drain(&mut s);
    assert!(sent_to(&out, 10).is_empty() && sent_to(&out, 77).is_empty());
    let ckpt = s.global_checkpoint().unwrap();
    assert_eq!(ckpt.len(), 2);
    assert_eq!(
        (ckpt[0].layer_id, ckpt[0].version, ckpt[0].values.clone()),
        (1, 2, vec![0.5; 4])
    );
    assert_eq!(
        (ckpt[1].layer_id, ckpt[1].version, ckpt[1].values.clone()),
        (2, 4, vec![1.0; 4])
    );
    assert_eq!(ckpt[1].name, "fc2");
    assert_eq!(s.layer_versions()[2], (2, 4));

    // Refusals: a worker posing as the aggregator, an unknown layer, a wrong shape, garbage.
    s.handle_message(
        0,
        1,
        "worker-1",
        Message::LayerVersion(version(10, 2, 9, 0.0)),
    );
    s.handle_message(
        0,
        10,
        "agg-10",
        Message::LayerVersion(version(10, 99, 9, 0.0)),
    );
    let mut wrong_shape = version(10, 2, 9, 0.0);
    wrong_shape.shape = vec![4, 1];
    s.handle_message(0, 10, "agg-10", Message::LayerVersion(wrong_shape));
    let mut garbage = version(10, 2, 9, 0.0);
    garbage.payload.truncate(3);
    s.handle_message(0, 10, "agg-10", Message::LayerVersion(garbage));
    let out = drain(&mut s);
    let reasons: Vec<InputError> = events(&out)
        .into_iter()
        .filter_map(|e| match e {
            CoordEvent::BadInput { reason, .. } => Some(reason),
            _ => None,
        })
        .collect();
    assert!(matches!(
        reasons.as_slice(),
        [
            InputError::NotAnAggregator { aggregator_id: 10 },
            InputError::UnknownLayer { layer_id: 99 },
            InputError::ShapeMismatch { layer_id: 2, .. },
            InputError::UndecodablePayload { layer_id: 2, .. },
        ]
    ));
    assert_eq!(s.cached_version(2).unwrap().version, 4);
}

#[test]
fn disconnected_members_stay_until_their_lease_ends() {
    let mut s = cluster();
    s.handle_disconnect(1);
    assert_eq!(s.member(1).unwrap().conn, None);
    s.handle_message(
        0,
        11,
        "agg-11",
        join(11, Role::Aggregator, "127.0.0.1:7011"),
    );
    let out = drain(&mut s);
    assert!(
        sent_to(&out, 1).is_empty(),
        "nothing is routed to a closed connection"
    );
    s.handle_timeout(LEASE);
    assert!(s.member(1).is_none());
}

/// Two trainers report their distances every second; one drifts away. The coordinator
/// warns once, names the layer and the drifting node, and exports the spread.
#[test]
fn a_drifting_trainer_raises_a_divergence_warning_naming_it() {
    let run = |divergence: crate::DivergenceConfig| {
        let mut s = CoordinatorState::new(CoordinatorConfig {
            divergence,
            ..config()
        });
        s.handle_message(0, 1, "worker-1", join(1, Role::Worker, ""));
        s.handle_message(0, 2, "edge-2", join(2, Role::Edge, ""));
        s.handle_message(
            0,
            10,
            "agg-10",
            join(10, Role::Aggregator, "127.0.0.1:7010"),
        );
        drain(&mut s);
        let stats = |node_id, d: f32| {
            Message::Stats(NodeStats {
                node_id,
                role: Role::Edge,
                layer_divergence: vec![(3, d), (4, 0.01)],
                ..Default::default()
            })
        };
        let mut warnings = Vec::new();
        for t in 0..60u64 {
            let drift = if t < 40 { 0.02 } else { 0.02 * (t - 38) as f32 };
            s.handle_message(t * 1000, 1, "worker-1", stats(1, 0.02));
            s.handle_message(t * 1000 + 10, 2, "edge-2", stats(2, drift));
            // Aggregators report no distances and never count as trainers.
            s.handle_message(t * 1000 + 20, 10, "agg-10", stats(10, 9.0));
            for (conn, name) in [(10, "agg-10"), (1, "worker-1"), (2, "edge-2")] {
                s.handle_message(t * 1000, conn, name, heartbeat(conn));
            }
            for out in drain(&mut s) {
                if let Output::Event(e @ CoordEvent::Divergence { .. }) = out {
                    warnings.push(e);
                }
            }
        }
        (s, warnings)
    };
    let (s, warnings) = run(Default::default());
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    let CoordEvent::Divergence {
        layer_id,
        layer,
        farthest,
        baseline,
        ..
    } = &warnings[0]
    else {
        unreachable!()
    };
    assert_eq!(
        (*layer_id, layer.as_str(), farthest.as_str()),
        (3, "fc3", "edge-2")
    );
    assert!((baseline - 0.02).abs() < 1e-6, "{baseline}");
    let report = s.status(60_000);
    assert_eq!(report.divergence_warnings, 1);
    let spread = report.layers[3].divergence.unwrap();
    assert_eq!((spread.nodes, spread.farthest_node), (2, 2));
    let metrics = crate::prometheus_text(&report);
    assert!(
        metrics.contains("dreamddp_divergence_warnings_total 1"),
        "{metrics}"
    );
    assert!(
        metrics.contains("dreamddp_layer_divergence{node=\"edge-2\",node_id=\"2\",layer=\"fc3\",layer_id=\"3\"} 0.42"),
        "{metrics}"
    );
    // The same run with the warnings turned off: measured, not warned.
    let (s, warnings) = run(crate::DivergenceConfig {
        warn_ratio: 0.0,
        ..Default::default()
    });
    assert!(warnings.is_empty(), "{warnings:?}");
    assert!(s.status(60_000).layers[3].divergence.is_some());
}

#[test]
fn stats_keep_the_latest_per_node_and_sum_into_totals() {
    let mut s = cluster();
    let stats = |node_id, bytes_sent, hist: Vec<u64>| {
        Message::Stats(NodeStats {
            node_id,
            bytes_sent,
            deltas_applied: bytes_sent / 10,
            staleness_histogram: hist,
            ..Default::default()
        })
    };
    s.handle_message(0, 1, "worker-1", stats(1, 100, vec![]));
    s.handle_message(0, 1, "worker-1", stats(1, 300, vec![]));
    s.handle_message(0, 10, "agg-10", stats(10, 50, vec![4, 2, 1]));
    s.handle_message(0, 1, "worker-1", stats(10, 1, vec![]));
    assert_eq!(
        error_code(&sent_to(&drain(&mut s), 1)),
        Some(ErrorCode::BadRequest)
    );
    let report = s.status(400);
    assert_eq!(report.totals.bytes_sent, 350);
    assert_eq!(report.totals.deltas_applied, 35);
    assert_eq!(report.totals.staleness_histogram, vec![4, 2, 1]);
    assert_eq!(report.totals.reporting_nodes, 2);
    let worker = report.members.iter().find(|m| m.node_id == 1).unwrap();
    assert_eq!(worker.stats.as_ref().unwrap().bytes_sent, 300);
    assert_eq!(worker.lease_expires_in_ms, LEASE - 400);
    // Stats survive the node leaving (cluster totals do not shrink).
    s.handle_message(
        0,
        1,
        "worker-1",
        Message::Leave(Leave {
            node_id: 1,
            reason: "done".into(),
        }),
    );
    assert_eq!(s.status(0).totals.bytes_sent, 350);
}

#[test]
fn peer_errors_are_reported_not_answered() {
    let mut s = cluster();
    let err = protocol::ErrorReply {
        code: ErrorCode::Busy,
        text: "later".into(),
    };
    s.handle_message(0, 10, "agg-10", Message::Error(err));
    let out = drain(&mut s);
    assert!(sent_to(&out, 10).is_empty());
    assert!(matches!(
        events(&out).as_slice(),
        [CoordEvent::PeerError { conn: 10, .. }]
    ));
}

// ---- property test: random message sequences never panic and keep the invariants ----

fn role() -> impl Strategy<Value = Role> {
    prop_oneof![Just(Role::Worker), Just(Role::Edge), Just(Role::Aggregator)]
}

fn message() -> impl Strategy<Value = Message> {
    let node = 0u64..6;
    prop_oneof![
        (
            node.clone(),
            role(),
            any::<bool>(),
            prop_oneof![Just(""), Just("127.0.0.1:9"), Just("::1"), Just("[::1]:80")]
        )
            .prop_map(|(node_id, role, good, addr)| Message::Join(Join {
                node_id,
                role,
                credentials: if good { SECRET.into() } else { "x".into() },
                capabilities: Capabilities::default(),
                listen_addr: addr.into(),
            })),
        (node.clone(), any::<u64>()).prop_map(|(node_id, lease_ms)| Message::Heartbeat(
            Heartbeat {
                node_id,
                lease_ms,
                now_ms: 0
            }
        )),
        node.clone().prop_map(|node_id| Message::Leave(Leave {
            node_id,
            reason: "r".into()
        })),
        (
            node.clone(),
            any::<u64>(),
            proptest::collection::vec(any::<u64>(), 0..4)
        )
            .prop_map(|(node_id, bytes_sent, staleness_histogram)| Message::Stats(
                NodeStats {
                    node_id,
                    bytes_sent,
                    staleness_histogram,
                    ..Default::default()
                }
            )),
        (
            node.clone(),
            0u32..10,
            any::<u64>(),
            proptest::collection::vec(0u32..4, 0..3),
            proptest::collection::vec(any::<u8>(), 0..20)
        )
            .prop_map(|(aggregator_id, layer_id, version, shape, payload)| {
                Message::LayerVersion(LayerVersion {
                    aggregator_id,
                    layer_id,
                    layer_name: String::new(),
                    version,
                    shape,
                    codec: Codec::RawF32,
                    payload,
                    applied_seqs: Vec::new(),
                })
            }),
        (node.clone(), 0u32..10, any::<u64>(), any::<f32>())
            .prop_map(|(a, l, v, x)| Message::LayerVersion(version(a, l, v, x))),
        node.prop_map(|node_id| Message::Subscribe(Subscribe { node_id })),
    ]
}

#[derive(Debug, Clone)]
enum Step {
    Msg {
        conn: ConnId,
        name: usize,
        msg: Message,
    },
    Timeout,
    Disconnect(ConnId),
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        6 => (0u64..5, 0usize..3, message()).prop_map(|(conn, name, msg)| Step::Msg { conn, name, msg }),
        1 => Just(Step::Timeout),
        1 => (0u64..5).prop_map(Step::Disconnect),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]
    #[test]
    fn random_sequences_keep_the_invariants(
        steps in proptest::collection::vec((0u64..400, step()), 0..60)
    ) {
        let mut s = CoordinatorState::new(CoordinatorConfig { lease_ms: 500, ..config() });
        let names = ["a", "b", "c"];
        let mut now = 0u64;
        let mut last_epoch = 0;
        for (dt, step) in steps {
            now += dt;
            match step {
                Step::Msg { conn, name, msg } => s.handle_message(now, conn, names[name], msg),
                Step::Timeout => s.handle_timeout(now),
                Step::Disconnect(conn) => s.handle_disconnect(conn),
            }
            let out = drain(&mut s);
            // The map covers every layer iff an aggregator is live, and only live ones own.
            let aggregators: Vec<u64> = s.members().filter(|m| m.role == Role::Aggregator).map(|m| m.node_id).collect();
            let owners = s.owners();
            if aggregators.is_empty() {
                prop_assert!(owners.is_empty());
            } else {
                prop_assert_eq!(owners.len(), N_LAYERS as usize);
                prop_assert!(owners.iter().all(|(_, a)| aggregators.contains(a)));
            }
            prop_assert!(s.epoch() >= last_epoch);
            last_epoch = s.epoch();
            // Every LayerMap sent carries the current epoch and owners.
            for o in &out {
                if let Output::Send { msg: Message::LayerMap(map), .. } = o {
                    prop_assert_eq!(map.epoch, s.epoch());
                    prop_assert_eq!(&map.owners, &owners);
                }
            }
            // Every member with a connection is found by it.
            for m in s.members() {
                if let Some(conn) = m.conn {
                    prop_assert_eq!(s.node_of_conn(conn), Some(m.node_id));
                }
                prop_assert!(m.lease_expires_at_ms <= now + 500);
            }
            // The status and its exposition never fail.
            let report = s.status(now);
            prop_assert_eq!(report.members.len(), s.members().count());
            let _ = crate::prometheus_text(&report);
            prop_assert!(s.global_checkpoint().is_ok());
        }
    }
}
