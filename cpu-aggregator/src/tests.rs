//! Unit tests of the aggregator state machine and its snapshots (deterministic; messages are
//! handed in directly with a virtual `now`).

use engine::staleness::StalenessFn;
use proptest::prelude::*;
use protocol::{
    payload_from_f32, Codec, DeltaAck, ErrorCode, Heartbeat, LayerMeta, Message, ResyncReason,
};

use crate::{
    AggEvent, AggregatorConfig, AggregatorState, InputError, Output, OwnedLayer, SnapshotError,
};

const AGG: u64 = 100;

fn layer(id: u32, values: Vec<f32>) -> OwnedLayer {
    OwnedLayer {
        layer_id: id,
        name: format!("l{id}"),
        shape: vec![values.len() as u32],
        values,
    }
}

fn agg(config: AggregatorConfig) -> AggregatorState {
    AggregatorState::new(
        AGG,
        vec![layer(0, vec![1.0; 4]), layer(1, vec![0.0; 2])],
        config,
    )
    .unwrap()
}

fn delta(node: u64, layer_id: u32, seq: u64, base: u64, samples: u64, d: &[f32]) -> Message {
    let meta = LayerMeta {
        node_id: node,
        layer_id,
        layer_name: format!("l{layer_id}"),
        step: 0,
        base_version: base,
        version: base,
        seq,
        sample_count: samples,
    };
    Message::LayerDelta(payload_from_f32(meta, &[d.len() as u32], d, Codec::RawF32).unwrap())
}

fn drain(a: &mut AggregatorState) -> Vec<Output> {
    std::iter::from_fn(|| a.poll_output()).collect()
}

fn acks(outs: &[Output]) -> Vec<(u64, DeltaAck)> {
    outs.iter()
        .filter_map(|o| match o {
            Output::Send {
                to,
                msg: Message::DeltaAck(a),
            } => Some((*to, *a)),
            _ => None,
        })
        .collect()
}

#[test]
fn async_round_applies_on_arrival_and_broadcasts() {
    let mut a = agg(AggregatorConfig::default());
    a.handle_message(5, 7, delta(7, 0, 1, 0, 32, &[1.0, -2.0, 0.5, 0.0]));
    let outs = drain(&mut a);
    assert_eq!(a.layer(0).unwrap().values, [2.0, -1.0, 1.5, 1.0]);
    assert_eq!(a.layer(0).unwrap().version, 1);
    assert!(
        matches!(&outs[0], Output::Event(AggEvent::Applied { layer_id: 0, version: 1, n_deltas: 1, staleness }) if staleness == &[0])
    );
    assert_eq!(
        acks(&outs),
        [(
            7,
            DeltaAck {
                node_id: 7,
                layer_id: 0,
                seq: 1,
                applied: true,
                new_version: 1
            }
        )]
    );
    let Some(Output::Broadcast {
        msg: Message::LayerVersion(v),
    }) = outs.last()
    else {
        panic!("no broadcast: {outs:?}")
    };
    assert_eq!((v.version, v.aggregator_id), (1, AGG));
    assert_eq!(v.decode_values().unwrap(), [2.0, -1.0, 1.5, 1.0]);
    assert_eq!(a.highest_applied_seq(7, 0), Some(1));
    assert_eq!(a.counters().bytes_in, 16);
    assert_eq!(a.counters().bytes_out, 16);
    assert_eq!(a.poll_timeout(), None);
}

#[test]
fn round_waits_for_distinct_senders_or_times_out() {
    let config = AggregatorConfig {
        round_size: 2,
        round_timeout_ns: 1_000,
        outer_lr: 0.5,
        staleness: StalenessFn::Constant,
        ..Default::default()
    };
    let mut a = agg(config);
    a.handle_message(10, 1, delta(1, 1, 1, 0, 10, &[2.0, 0.0]));
    assert!(drain(&mut a).is_empty());
    // A retransmission of the waiting delta is a duplicate without an ack (the ack follows).
    a.handle_message(11, 1, delta(1, 1, 1, 0, 10, &[2.0, 0.0]));
    let outs = drain(&mut a);
    assert!(acks(&outs).is_empty());
    assert!(matches!(
        outs[..],
        [Output::Event(AggEvent::DuplicateRejected {
            from: 1,
            seq: 1,
            ..
        })]
    ));
    a.handle_message(20, 2, delta(2, 1, 9, 0, 30, &[0.0, 4.0]));
    let outs = drain(&mut a);
    // θ += 0.5·(10·(2,0) + 30·(0,4))/40 = (0.25, 1.5)
    assert_eq!(a.layer(1).unwrap().values, [0.25, 1.5]);
    assert_eq!(acks(&outs).len(), 2);

    a.handle_message(100, 3, delta(3, 1, 1, 1, 1, &[1.0, 1.0]));
    assert_eq!(a.poll_timeout(), Some(1_100));
    a.handle_timeout(1_099);
    assert_eq!(a.layer(1).unwrap().version, 1);
    a.handle_timeout(1_100);
    assert_eq!(a.layer(1).unwrap().version, 2);
    assert_eq!(a.layer(1).unwrap().values, [0.75, 2.0]);
    assert_eq!(a.poll_timeout(), None);
}

#[test]
fn duplicates_are_rejected_with_an_unapplied_ack() {
    let mut a = agg(AggregatorConfig::default());
    a.handle_message(0, 4, delta(4, 0, 5, 0, 1, &[1.0; 4]));
    drain(&mut a);
    for seq in [5, 3] {
        a.handle_message(1, 4, delta(4, 0, seq, 0, 1, &[1.0; 4]));
        let outs = drain(&mut a);
        assert_eq!(
            acks(&outs),
            [(
                4,
                DeltaAck {
                    node_id: 4,
                    layer_id: 0,
                    seq,
                    applied: false,
                    new_version: 1
                }
            )]
        );
        assert!(outs.contains(&Output::Event(AggEvent::DuplicateRejected {
            from: 4,
            layer_id: 0,
            seq
        })));
    }
    assert_eq!(a.layer(0).unwrap().values, [2.0; 4]);
    assert_eq!(a.counters().duplicates_rejected, 2);
    assert_eq!(a.counters().deltas_applied, 1);
    // Same seq on another layer, or from another node, is not a duplicate.
    a.handle_message(2, 4, delta(4, 1, 5, 0, 1, &[1.0; 2]));
    a.handle_message(2, 8, delta(8, 0, 5, 1, 1, &[1.0; 4]));
    assert_eq!(a.counters().deltas_applied, 3);
}

#[test]
fn stale_and_future_bases_get_a_resync_and_the_current_version() {
    let config = AggregatorConfig {
        tau_max: 1,
        ..Default::default()
    };
    let mut a = agg(config);
    for seq in 1..=3 {
        a.handle_message(0, 1, delta(1, 0, seq, seq - 1, 1, &[0.0; 4]));
    }
    drain(&mut a);
    assert_eq!(a.layer(0).unwrap().version, 3);
    // τ = 3 − 1 = 2 > 1.
    a.handle_message(1, 2, delta(2, 0, 1, 1, 1, &[5.0; 4]));
    let outs = drain(&mut a);
    let reason = ResyncReason::TooStale {
        staleness: 2,
        max_staleness: 1,
    };
    assert!(
        matches!(&outs[0], Output::Send { to: 2, msg: Message::Resync(r) } if r.reason == reason && r.current_version == 3 && r.refused_seq == Some(1))
    );
    assert!(
        matches!(&outs[1], Output::Send { to: 2, msg: Message::LayerVersion(v) } if v.version == 3)
    );
    assert_eq!(
        outs[2],
        Output::Event(AggEvent::DroppedStale {
            from: 2,
            layer_id: 0,
            seq: 1,
            reason
        })
    );
    // τ = 1 is fine.
    a.handle_message(1, 2, delta(2, 0, 2, 2, 1, &[5.0; 4]));
    assert_eq!(a.layer(0).unwrap().version, 4);
    drain(&mut a);
    a.handle_message(1, 2, delta(2, 0, 3, 9, 1, &[5.0; 4]));
    let outs = drain(&mut a);
    assert!(
        matches!(&outs[0], Output::Send { msg: Message::Resync(r), .. } if r.reason == ResyncReason::UnknownBaseVersion && r.refused_seq == Some(3))
    );
    assert_eq!(a.counters().dropped_stale, 2);
}

fn error_reply(outs: &[Output]) -> (u64, ErrorCode) {
    match &outs[0] {
        Output::Send {
            to,
            msg: Message::Error(e),
        } => (*to, e.code),
        other => panic!("expected an error reply, got {other:?}"),
    }
}

#[test]
fn bad_input_is_rejected_with_typed_errors_and_serving_goes_on() {
    let mut a = agg(AggregatorConfig::default());
    let check = |a: &mut AggregatorState,
                 from: u64,
                 msg: Message,
                 code: ErrorCode,
                 want: &dyn Fn(&InputError) -> bool| {
        a.handle_message(0, from, msg);
        let outs = drain(a);
        assert_eq!(error_reply(&outs), (from, code));
        let Output::Event(AggEvent::BadInput { reason, .. }) = &outs[1] else {
            panic!("{outs:?}")
        };
        assert!(want(reason), "{reason}");
    };
    check(
        &mut a,
        3,
        delta(3, 9, 1, 0, 1, &[1.0]),
        ErrorCode::NotOwner,
        &|r| matches!(r, InputError::NotOwner { layer_id: 9 }),
    );
    check(
        &mut a,
        3,
        delta(3, 0, 1, 0, 1, &[1.0; 3]),
        ErrorCode::BadRequest,
        &|r| matches!(r, InputError::ShapeMismatch { .. }),
    );
    check(
        &mut a,
        3,
        delta(4, 0, 1, 0, 1, &[1.0; 4]),
        ErrorCode::BadRequest,
        &|r| {
            matches!(
                r,
                InputError::NodeMismatch {
                    claimed: 4,
                    from: 3
                }
            )
        },
    );
    check(
        &mut a,
        3,
        delta(3, 0, 1, 0, 0, &[1.0; 4]),
        ErrorCode::BadRequest,
        &|r| matches!(r, InputError::ZeroSamples { .. }),
    );
    check(
        &mut a,
        3,
        delta(3, 0, 1, 0, 1, &[1.0, f32::NAN, 0.0, 0.0]),
        ErrorCode::BadRequest,
        &|r| matches!(r, InputError::NonFinite { index: 1, .. }),
    );
    let Message::LayerDelta(mut truncated) = delta(3, 0, 1, 0, 1, &[1.0; 4]) else {
        unreachable!()
    };
    truncated.payload.pop();
    check(
        &mut a,
        3,
        Message::LayerDelta(truncated),
        ErrorCode::BadRequest,
        &|r| matches!(r, InputError::Decode { .. }),
    );
    let hb = Message::Heartbeat(Heartbeat {
        node_id: 3,
        lease_ms: 1,
        now_ms: 0,
    });
    check(&mut a, 3, hb, ErrorCode::BadRequest, &|r| {
        matches!(r, InputError::Unexpected { kind: "Heartbeat" })
    });
    assert_eq!(a.counters().bad_inputs, 7);
    assert_eq!(a.layer(0).unwrap().version, 0);
    // Still serving, and the rejected seq 1 of node 3 was not recorded as applied.
    a.handle_message(1, 3, delta(3, 0, 1, 0, 1, &[1.0; 4]));
    assert_eq!(a.layer(0).unwrap().values, [2.0; 4]);
}

#[test]
fn construction_rejects_bad_layers_and_config() {
    assert!(AggregatorState::new(
        1,
        vec![layer(0, vec![1.0]), layer(0, vec![1.0])],
        Default::default()
    )
    .is_err());
    let mut bad = layer(0, vec![1.0; 3]);
    bad.shape = vec![2, 2];
    assert!(AggregatorState::new(1, vec![bad], Default::default()).is_err());
    let config = AggregatorConfig {
        round_size: 0,
        ..Default::default()
    };
    assert!(AggregatorState::new(1, vec![], config).is_err());
    let config = AggregatorConfig {
        staleness: StalenessFn::Polynomial { a: -1.0 },
        ..Default::default()
    };
    assert!(AggregatorState::new(1, vec![], config).is_err());
}

#[test]
fn snapshot_round_trip_restores_values_versions_and_dedup() {
    let mut a = agg(AggregatorConfig::default());
    a.handle_message(0, 4, delta(4, 0, 5, 0, 1, &[1.0, 2.0, 3.0, 4.0]));
    a.handle_message(0, 6, delta(6, 1, 2, 0, 1, &[0.5, 0.5]));
    drain(&mut a);
    let bytes = a.snapshot();
    let mut b = AggregatorState::restore(&bytes, AggregatorConfig::default()).unwrap();
    assert_eq!(b.id(), AGG);
    // The restored aggregator re-broadcasts every layer, which counts as bytes out.
    let mut restored = b.counters();
    assert_eq!(restored.bytes_out, 2 * a.counters().bytes_out);
    restored.bytes_out = a.counters().bytes_out;
    assert_eq!(restored, a.counters());
    for id in [0, 1] {
        let (x, y) = (a.layer(id).unwrap(), b.layer(id).unwrap());
        assert_eq!(
            (x.values, x.version, x.name, x.shape),
            (y.values, y.version, y.name, y.shape)
        );
    }
    let outs = drain(&mut b);
    assert!(
        matches!(&outs[0], Output::Broadcast { msg: Message::Resync(r) } if r.reason == ResyncReason::AggregatorRestarted && r.current_version == 1 && r.refused_seq.is_none())
    );
    assert!(matches!(
        &outs[1],
        Output::Broadcast {
            msg: Message::LayerVersion(_)
        }
    ));
    // Dedup survives the restart.
    b.handle_message(1, 4, delta(4, 0, 5, 1, 1, &[1.0; 4]));
    assert!(!acks(&drain(&mut b))[0].1.applied);
}

#[test]
fn corrupt_snapshots_are_typed_errors() {
    let a = agg(AggregatorConfig::default());
    let bytes = a.snapshot();
    let restore = |b: &[u8]| AggregatorState::restore(b, AggregatorConfig::default()).map(|_| ());
    assert!(matches!(
        restore(&bytes[..10]),
        Err(SnapshotError::Truncated { .. })
    ));
    let mut bad = bytes.clone();
    bad[0] = b'X';
    assert_eq!(restore(&bad), Err(SnapshotError::BadMagic));
    let mut bad = bytes.clone();
    bad[8] = 9;
    assert_eq!(restore(&bad), Err(SnapshotError::UnsupportedVersion(9)));
    let mut bad = bytes.clone();
    let mid = bad.len() / 2;
    bad[mid] ^= 0x10;
    assert!(matches!(restore(&bad), Err(SnapshotError::Checksum { .. })));
    assert!(matches!(
        restore(&bytes[..bytes.len() - 3]),
        Err(SnapshotError::Checksum { .. }) | Err(SnapshotError::Truncated { .. })
    ));
}

proptest! {
    #[test]
    fn any_single_bit_flip_or_truncation_is_rejected(
        values in prop::collection::vec(-10.0f32..10.0, 1..16),
        at in any::<prop::sample::Index>(),
        bit in 0u8..8,
        cut in any::<prop::sample::Index>(),
    ) {
        let a = AggregatorState::new(3, vec![layer(2, values)], Default::default()).unwrap();
        let bytes = a.snapshot();
        let mut bad = bytes.clone();
        let i = at.index(bad.len());
        bad[i] ^= 1 << bit;
        prop_assert!(AggregatorState::restore(&bad, Default::default()).is_err());
        let n = cut.index(bytes.len());
        prop_assert!(AggregatorState::restore(&bytes[..n], Default::default()).is_err());
    }

    #[test]
    fn fresh_equal_sample_round_is_the_plain_mean(
        deltas in prop::collection::vec(prop::collection::vec(-100i32..100, 3), 1..6),
    ) {
        let config = AggregatorConfig { round_size: deltas.len(), ..Default::default() };
        let mut a = AggregatorState::new(1, vec![layer(0, vec![0.5; 3])], config).unwrap();
        for (i, d) in deltas.iter().enumerate() {
            let d: Vec<f32> = d.iter().map(|&x| x as f32).collect();
            a.handle_message(0, i as u64, delta(i as u64, 0, 1, 0, 8, &d));
        }
        let v = a.layer(0).unwrap();
        prop_assert_eq!(v.version, 1);
        for k in 0..3 {
            let mean = deltas.iter().map(|d| d[k] as f64).sum::<f64>() / deltas.len() as f64;
            prop_assert!((v.values[k] as f64 - (0.5 + mean)).abs() < 1e-4);
        }
    }
}

#[test]
fn subscribe_answers_current_version_of_every_owned_layer_past_the_initial_one() {
    let mut a = agg(AggregatorConfig::default());
    a.handle_message(0, 7, delta(7, 0, 1, 0, 10, &[1.0; 4]));
    drain(&mut a);
    a.handle_message(1, 9, Message::Subscribe(protocol::Subscribe { node_id: 9 }));
    let versions: Vec<(u64, u32, u64, Vec<f32>)> = drain(&mut a)
        .into_iter()
        .filter_map(|o| match o {
            Output::Send {
                to,
                msg: Message::LayerVersion(v),
            } => Some((to, v.layer_id, v.version, v.decode_values().unwrap())),
            _ => None,
        })
        .collect();
    // Layer 1 is still at version 0, the initial values the node has already.
    assert_eq!(versions, vec![(9, 0, 1, vec![2.0; 4])]);
}

#[test]
fn adopt_layer_keeps_the_newer_version_and_release_forgets_the_layer() {
    let mut a = agg(AggregatorConfig::default());
    // A new layer is adopted at the coordinator's version.
    assert!(a.adopt_layer(layer(2, vec![3.0; 3]), 5, &[]).unwrap());
    assert_eq!(a.layer(2).unwrap().version, 5);
    // An older or equal version never replaces the current one.
    a.handle_message(0, 7, delta(7, 2, 1, 5, 10, &[1.0; 3]));
    drain(&mut a);
    assert_eq!(a.layer(2).unwrap().version, 6);
    assert!(!a.adopt_layer(layer(2, vec![0.0; 3]), 6, &[]).unwrap());
    assert_eq!(a.layer(2).unwrap().values, &[4.0; 3]);
    // A newer one does.
    assert!(a.adopt_layer(layer(2, vec![9.0; 3]), 8, &[]).unwrap());
    assert_eq!(a.layer(2).unwrap().values, &[9.0; 3]);
    // A wrong shape is refused with a typed error.
    assert!(a.adopt_layer(layer(2, vec![9.0; 4]), 9, &[]).is_err());
    // Released layers are no longer owned; the others keep working.
    assert!(a.release_layer(0));
    assert!(!a.release_layer(0));
    assert!(a.layer(0).is_none());
    a.handle_message(1, 7, delta(7, 1, 2, 0, 10, &[1.0; 2]));
    assert_eq!(a.layer(1).unwrap().version, 1);
    a.handle_message(2, 7, delta(7, 0, 3, 0, 10, &[1.0; 4]));
    assert!(drain(&mut a)
        .iter()
        .any(|o| matches!(o, Output::Event(AggEvent::BadInput { .. }))));
}

/// A round of `round_size` senders on layer 0 (4 values, all 1.0), with `outer_lr = 1`.
fn round_of(n: usize) -> AggregatorState {
    agg(AggregatorConfig {
        round_size: n,
        ..AggregatorConfig::default()
    })
}

#[test]
fn a_non_finite_delta_mid_round_is_refused_and_the_round_is_as_if_it_never_came() {
    // Reference: two good deltas close a round of 2.
    let mut reference = round_of(2);
    reference.handle_message(0, 1, delta(1, 0, 1, 0, 10, &[1.0, 2.0, 3.0, 4.0]));
    reference.handle_message(0, 2, delta(2, 0, 1, 0, 30, &[-1.0, 0.5, 0.25, 8.0]));
    // Same, with a third sender's NaN delta between them in a round of 3, then a timeout.
    let mut a = round_of(3);
    a.handle_message(0, 1, delta(1, 0, 1, 0, 10, &[1.0, 2.0, 3.0, 4.0]));
    a.handle_message(0, 3, delta(3, 0, 1, 0, 50, &[0.5, f32::NAN, 0.0, 0.0]));
    let outs = drain(&mut a);
    assert_eq!(error_reply(&outs), (3, ErrorCode::BadRequest));
    assert!(outs.iter().any(|o| matches!(
        o,
        Output::Event(AggEvent::BadInput {
            from: 3,
            reason: InputError::NonFinite { index: 1, .. }
        })
    )));
    a.handle_message(0, 2, delta(2, 0, 1, 0, 30, &[-1.0, 0.5, 0.25, 8.0]));
    assert_eq!(a.layer(0).unwrap().version, 0, "round of 3 still open");
    a.handle_timeout(2_000_000_000);
    let outs = drain(&mut a);
    assert_eq!(a.layer(0).unwrap().version, 1);
    let bits = |s: &AggregatorState| -> Vec<u32> {
        s.layer(0)
            .unwrap()
            .values
            .iter()
            .map(|v| v.to_bits())
            .collect()
    };
    assert_eq!(
        bits(&a),
        bits(&reference),
        "bit-identical to the round without the NaN"
    );
    let acked: Vec<u64> = acks(&outs).iter().map(|(to, _)| *to).collect();
    assert_eq!(acked, [1, 2]);
}

#[test]
fn a_non_finite_closing_delta_is_refused_alone_and_the_round_stays_open() {
    let mut a = round_of(2);
    a.handle_message(0, 1, delta(1, 0, 1, 0, 10, &[1.0, 1.0, 1.0, 1.0]));
    a.handle_message(0, 2, delta(2, 0, 1, 0, 10, &[0.0, 0.0, 0.0, f32::INFINITY]));
    let outs = drain(&mut a);
    assert_eq!(error_reply(&outs), (2, ErrorCode::BadRequest));
    assert!(acks(&outs).is_empty());
    assert_eq!(a.layer(0).unwrap().values, [1.0; 4], "model untouched");
    assert_eq!(a.layer(0).unwrap().version, 0);
    assert_eq!(a.layer(0).unwrap().pending, 1);
    // The sender's next (good) delta closes the round: mean of (1, 3) added to 1.
    a.handle_message(0, 2, delta(2, 0, 2, 0, 10, &[3.0, 3.0, 3.0, 3.0]));
    assert_eq!(a.layer(0).unwrap().values, [3.0; 4]);
    assert_eq!(a.layer(0).unwrap().version, 1);
}

#[test]
fn an_overflowing_round_is_not_applied_and_nothing_is_acknowledged() {
    let mut a = AggregatorState::new(
        AGG,
        vec![layer(0, vec![f32::MAX; 4])],
        AggregatorConfig::default(),
    )
    .unwrap();
    a.handle_message(0, 1, delta(1, 0, 1, 0, 10, &[f32::MAX; 4]));
    let outs = drain(&mut a);
    assert!(acks(&outs).is_empty());
    assert!(outs.iter().any(|o| matches!(
        o,
        Output::Event(AggEvent::InternalError { layer_id: 0, .. })
    )));
    assert_eq!(a.layer(0).unwrap().values, [f32::MAX; 4]);
    assert_eq!(a.layer(0).unwrap().version, 0);
    // The aggregator keeps serving: a sane delta is applied.
    a.handle_message(0, 1, delta(1, 0, 2, 0, 10, &[-f32::MAX; 4]));
    assert_eq!(a.layer(0).unwrap().values, [0.0; 4]);
}

#[test]
fn the_broadcast_payload_is_the_new_version_bit_for_bit_in_every_codec_path() {
    for (codec, lossy) in [
        (Codec::RawF32, false),
        (Codec::ZstdRawF32, false),
        (Codec::F16, true),
    ] {
        let mut a = agg(AggregatorConfig {
            round_size: 2,
            broadcast_codec: codec,
            ..AggregatorConfig::default()
        });
        a.handle_message(0, 1, delta(1, 0, 1, 0, 3, &[0.1, 0.2, 0.3, 0.4]));
        a.handle_message(0, 2, delta(2, 0, 1, 0, 5, &[0.5, -0.25, 1e-3, 7.0]));
        let outs = drain(&mut a);
        let version = outs
            .iter()
            .find_map(|o| match o {
                Output::Broadcast {
                    msg: Message::LayerVersion(v),
                } => Some(v.clone()),
                _ => None,
            })
            .expect("a broadcast");
        let got = version.decode_values().unwrap();
        let want = a.layer(0).unwrap().values;
        if lossy {
            for (g, w) in got.iter().zip(want) {
                assert!(
                    (g - w).abs() <= 1e-2 * w.abs().max(1.0),
                    "{codec:?}: {g} vs {w}"
                );
            }
        } else {
            assert_eq!(got, want, "{codec:?}");
        }
    }
}

#[test]
fn a_handed_over_version_carries_its_ledger_so_a_retransmission_is_not_applied_twice() {
    // Aggregator A applies node 7's delta seq 4 and broadcasts version 1; its ack is lost
    // with A. The coordinator hands A's broadcast over to B.
    let mut a = agg(AggregatorConfig::default());
    a.handle_message(0, 7, delta(7, 0, 4, 0, 10, &[1.0; 4]));
    let handed_over = drain(&mut a)
        .into_iter()
        .find_map(|o| match o {
            Output::Broadcast {
                msg: Message::LayerVersion(v),
            } => Some(v),
            _ => None,
        })
        .expect("a broadcast");
    assert_eq!(
        handed_over.applied_seqs,
        [protocol::AppliedSeq { node_id: 7, seq: 4 }]
    );
    let mut b = AggregatorState::new(101, vec![], AggregatorConfig::default()).unwrap();
    let owned = layer(0, handed_over.decode_values().unwrap());
    assert!(b
        .adopt_layer(owned, handed_over.version, &handed_over.applied_seqs)
        .unwrap());
    // Node 7 retransmits seq 4 to the new owner: a duplicate, acked as not applied.
    b.handle_message(1, 7, delta(7, 0, 4, 0, 10, &[1.0; 4]));
    let outs = drain(&mut b);
    assert_eq!(b.layer(0).unwrap().values, [2.0; 4], "applied once");
    assert!(!acks(&outs)[0].1.applied);
    // Its next delta is applied normally.
    b.handle_message(2, 7, delta(7, 0, 5, 1, 10, &[1.0; 4]));
    assert_eq!(b.layer(0).unwrap().values, [3.0; 4]);
    // A version that is not adopted (older than what B has) does not touch B's ledger.
    let stale = layer(0, vec![0.0; 4]);
    let ledger = [protocol::AppliedSeq { node_id: 8, seq: 9 }];
    assert!(!b.adopt_layer(stale, 1, &ledger).unwrap());
    assert_eq!(b.highest_applied_seq(8, 0), None);
}

#[test]
fn fedbuff_rounds_scale_by_staleness_and_divide_by_the_buffer_size() {
    // K = 2, s(τ) = 1/√(1+τ), η = 1. Version 1 first (one fresh delta of a round of 1 is
    // not possible with K = 2, so the first round is two fresh deltas).
    let mut a = agg(AggregatorConfig {
        staleness: StalenessFn::Polynomial { a: 0.5 },
        round_size: 2,
        aggregation: crate::Aggregation::Buffered,
        ..AggregatorConfig::default()
    });
    // Sample counts are ignored by FedBuff: 1 and 100 weigh the same.
    a.handle_message(1, 7, delta(7, 0, 1, 0, 1, &[2.0; 4]));
    a.handle_message(2, 8, delta(8, 0, 1, 0, 100, &[4.0; 4]));
    drain(&mut a);
    // θ = 1 + (2 + 4) / 2 = 4.
    assert_eq!(a.layer(0).unwrap().values, [4.0; 4]);
    // Round 2: one delta one version stale (s = 1/√2), one fresh (s = 1).
    a.handle_message(3, 7, delta(7, 0, 2, 0, 1, &[2.0; 4]));
    a.handle_message(4, 8, delta(8, 0, 2, 1, 1, &[2.0; 4]));
    drain(&mut a);
    let want = 4.0 + (2.0 / 2f32.sqrt() + 2.0) / 2.0;
    for v in a.layer(0).unwrap().values {
        assert!((v - want).abs() < 1e-5, "{v} vs {want}");
    }
    // The weighted mean would have moved θ by exactly 2 here: FedBuff's 1/K does not
    // renormalize the staleness weights.
    assert!((want - 6.0).abs() > 0.2);
}

#[test]
fn a_round_below_its_minimum_completion_is_refused_at_the_deadline() {
    let mut a = agg(AggregatorConfig {
        round_size: 4,
        min_round_senders: 2,
        round_timeout_ns: 100,
        ..AggregatorConfig::default()
    });
    a.handle_message(10, 7, delta(7, 0, 1, 0, 32, &[1.0; 4]));
    drain(&mut a);
    a.handle_timeout(200);
    let outs = drain(&mut a);
    assert_eq!(a.layer(0).unwrap().values, [1.0; 4], "nothing applied");
    assert_eq!(a.layer(0).unwrap().version, 0);
    let resync = outs.iter().find_map(|o| match o {
        Output::Send {
            to: 7,
            msg: Message::Resync(r),
        } => Some(*r),
        _ => None,
    });
    let r = resync.expect("the sender is told");
    assert_eq!(r.refused_seq, Some(1));
    assert_eq!(
        r.reason,
        ResyncReason::RoundIncomplete {
            senders: 1,
            required: 2
        }
    );
    // A round that reaches the minimum is applied at its deadline.
    a.handle_message(300, 7, delta(7, 0, 2, 0, 32, &[1.0; 4]));
    a.handle_message(301, 8, delta(8, 0, 1, 0, 32, &[3.0; 4]));
    a.handle_timeout(500);
    drain(&mut a);
    assert_eq!(a.layer(0).unwrap().values, [3.0; 4]);
}

#[test]
fn contributor_scaling_moves_the_model_by_the_mean_of_the_nodes_training_now() {
    const S: u64 = 1_000_000_000;
    let config = |outer_lr_scaling| AggregatorConfig {
        outer_lr_scaling,
        staleness: StalenessFn::Constant,
        tau_max: 1000,
        ..Default::default()
    };
    // Layer 1 (2 values, at 0). Each of `nodes` sends `+1` every 2 s.
    let period = |a: &mut AggregatorState, nodes: u64, t: u64, seq: u64| -> f32 {
        let before = a.layer(1).unwrap().values[0];
        for node in 0..nodes {
            let base = a.layer(1).unwrap().version;
            a.handle_message(t + node, node, delta(node, 1, seq, base, 32, &[1.0, 1.0]));
            drain(a);
        }
        a.layer(1).unwrap().values[0] - before
    };
    let mut scaled = agg(config(crate::OuterLrScaling::Contributors));
    let mut fixed = agg(config(crate::OuterLrScaling::Fixed));
    for seq in 1..=3 {
        period(&mut scaled, 4, seq * 2 * S, seq);
        period(&mut fixed, 4, seq * 2 * S, seq);
    }
    // Steady state: 4 nodes, each delta applied with 1/4: the period adds their mean.
    let moved = period(&mut scaled, 4, 8 * S, 4);
    assert!((moved - 1.0).abs() < 1e-6, "{moved}");
    // A fixed η = 1 adds their sum.
    assert!((period(&mut fixed, 4, 8 * S, 4) - 4.0).abs() < 1e-6);
    // Twice the nodes, same config: still their mean, once every node has been seen.
    period(&mut scaled, 8, 10 * S, 5);
    let moved = period(&mut scaled, 8, 12 * S, 6);
    assert!((moved - 1.0).abs() < 1e-6, "{moved}");
    // Nodes 2..8 lose their links; a minute after their last delta only 0 and 1 count,
    // and the model moves at the pace of the two that train.
    for (i, seq) in (7..=40).enumerate() {
        period(&mut scaled, 2, (14 + 2 * i as u64) * S, seq);
    }
    let moved = period(&mut scaled, 2, 82 * S, 41);
    assert!((moved - 1.0).abs() < 1e-6, "{moved}");
}

#[test]
fn a_restored_aggregator_counts_the_senders_of_its_ledger() {
    const S: u64 = 1_000_000_000;
    let config = AggregatorConfig {
        outer_lr_scaling: crate::OuterLrScaling::Contributors,
        staleness: StalenessFn::Constant,
        tau_max: 1000,
        ..Default::default()
    };
    let mut a = agg(config.clone());
    for node in 0..4 {
        a.handle_message(node, node, delta(node, 1, 1, 0, 32, &[1.0, 1.0]));
    }
    drain(&mut a);
    let mut restored = AggregatorState::restore(&a.snapshot(), config.clone()).unwrap();
    let before = restored.layer(1).unwrap().values[0];
    let v = restored.layer(1).unwrap().version;
    restored.handle_message(5 * S, 0, delta(0, 1, 2, v, 32, &[1.0, 1.0]));
    // One of the four known senders: a quarter of its delta, not all of it.
    let moved = restored.layer(1).unwrap().values[0] - before;
    assert!((moved - 0.25).abs() < 1e-6, "{moved}");
}

#[test]
fn with_contributor_scaling_tau_max_counts_the_fleets_periods_not_versions() {
    const S: u64 = 1_000_000_000;
    let config = |outer_lr_scaling| AggregatorConfig {
        outer_lr_scaling,
        tau_max: 2,
        ..Default::default()
    };
    // 8 nodes each send one delta of layer 1 per period from the version at the period's
    // start, so the k-th sender is k versions behind: less than one period of the fleet. A
    // fixed `tau_max = 2` versions refuses 5 of every 8 deltas; counted in periods
    // (2 · 8 nodes / round_size 1 = 16 versions) none is refused.
    let run = |outer_lr_scaling| {
        let mut a = agg(config(outer_lr_scaling));
        for period in 1..=6u64 {
            let base = a.layer(1).unwrap().version;
            for node in 0..8 {
                a.handle_message(
                    period * 2 * S + node,
                    node,
                    delta(node, 1, period, base, 1, &[0.5; 2]),
                );
                drain(&mut a);
            }
        }
        a.counters().dropped_stale
    };
    assert_eq!(run(crate::OuterLrScaling::Fixed), 6 * 5);
    assert_eq!(run(crate::OuterLrScaling::Contributors), 0);
    // The bound still holds: a delta 17 versions behind (more than 2 periods of 8) is refused,
    // and the resync names the bound in versions.
    let mut a = agg(config(crate::OuterLrScaling::Contributors));
    for seq in 1..=3u64 {
        for node in 0..8 {
            let base = a.layer(1).unwrap().version;
            a.handle_message(
                seq * 2 * S + node,
                node,
                delta(node, 1, seq, base, 1, &[0.5; 2]),
            );
            drain(&mut a);
        }
    }
    assert_eq!(a.layer(1).unwrap().version, 24);
    a.handle_message(7 * S, 3, delta(3, 1, 4, 7, 1, &[0.5; 2]));
    let outs = drain(&mut a);
    assert!(
        outs.iter().any(
            |o| matches!(o, Output::Send { to: 3, msg: Message::Resync(r) }
            if r.reason == ResyncReason::TooStale { staleness: 17, max_staleness: 16 })
        ),
        "{outs:?}"
    );
}
