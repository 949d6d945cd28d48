//! Test-only helpers: proptest strategies for every [`Message`] variant and a
//! fixed set of sample messages for the frame fuzzer.

use proptest::prelude::*;

use crate::message::{
    AggregatorAddr, AppliedSeq, Capabilities, Codec, DeltaAck, ErrorCode, ErrorReply, Heartbeat,
    Join, JoinAck, LayerMap, LayerPayload, LayerVersion, Leave, Message, NodeStats, Resync,
    ResyncReason, Role, Subscribe,
};

/// Any codec.
pub fn arb_codec() -> impl Strategy<Value = Codec> {
    prop_oneof![
        Just(Codec::RawF32),
        Just(Codec::F16),
        Just(Codec::Bf16),
        any::<u32>().prop_map(|k| Codec::TopK { k }),
        Just(Codec::ZstdRawF32),
        Just(Codec::ZstdF16),
        Just(Codec::ZstdBf16),
        any::<u32>().prop_map(|k| Codec::ZstdTopK { k }),
        (any::<u32>(), any::<u32>()).prop_map(|(rows, rank)| Codec::LowRank { rows, rank }),
    ]
}

fn arb_text() -> impl Strategy<Value = String> {
    ".{0,24}"
}

fn arb_bytes() -> impl Strategy<Value = Vec<u8>> {
    prop::collection::vec(any::<u8>(), 0..300)
}

fn arb_shape() -> impl Strategy<Value = Vec<u32>> {
    prop::collection::vec(any::<u32>(), 0..4)
}

fn arb_pairs() -> impl Strategy<Value = Vec<(u32, u64)>> {
    prop::collection::vec((any::<u32>(), any::<u64>()), 0..12)
}

fn arb_layer_payload() -> impl Strategy<Value = LayerPayload> {
    (
        (any::<u64>(), any::<u32>(), arb_text(), any::<u64>()),
        (any::<u64>(), any::<u64>(), any::<u64>(), any::<u64>()),
        (arb_shape(), arb_codec(), arb_bytes()),
    )
        .prop_map(
            |(
                (node_id, layer_id, layer_name, step),
                (base_version, version, seq, sample_count),
                (shape, codec, payload),
            )| LayerPayload {
                node_id,
                layer_id,
                layer_name,
                step,
                base_version,
                version,
                seq,
                sample_count,
                shape,
                codec,
                payload,
            },
        )
}

fn arb_join() -> impl Strategy<Value = Join> {
    let role = prop_oneof![Just(Role::Worker), Just(Role::Edge), Just(Role::Aggregator)];
    let capabilities = (
        any::<u32>(),
        any::<u32>(),
        any::<u64>(),
        any::<u64>(),
        prop::collection::vec(arb_codec(), 0..8),
    )
        .prop_map(
            |(gpus, cpu_cores, memory_bytes, link_bytes_per_sec, codecs)| Capabilities {
                gpus,
                cpu_cores,
                memory_bytes,
                link_bytes_per_sec,
                codecs,
            },
        );
    (any::<u64>(), role, arb_text(), capabilities, arb_text()).prop_map(
        |(node_id, role, credentials, capabilities, listen_addr)| Join {
            node_id,
            role,
            credentials,
            capabilities,
            listen_addr,
        },
    )
}

fn arb_aggregators() -> impl Strategy<Value = Vec<AggregatorAddr>> {
    prop::collection::vec(
        (any::<u64>(), arb_text()).prop_map(|(node_id, addr)| AggregatorAddr { node_id, addr }),
        0..4,
    )
}

fn arb_stats() -> impl Strategy<Value = NodeStats> {
    let role = prop_oneof![Just(Role::Worker), Just(Role::Edge), Just(Role::Aggregator)];
    (
        (any::<u64>(), role, any::<u64>(), any::<u64>(), any::<u64>()),
        (
            any::<u64>(),
            any::<u64>(),
            any::<u64>(),
            any::<u64>(),
            any::<u64>(),
        ),
        (
            arb_pairs(),
            prop::collection::vec(any::<u64>(), 0..6),
            any::<Option<f32>>(),
        ),
        (
            any::<u64>(),
            any::<u64>(),
            prop::collection::vec((any::<u32>(), any::<f32>()), 0..6),
        ),
    )
        .prop_map(
            |(
                (node_id, role, step, bytes_sent, bytes_received),
                (
                    weak_sync_events,
                    cached_pending,
                    deltas_applied,
                    duplicates_rejected,
                    dropped_stale,
                ),
                (layer_versions, staleness_histogram, accuracy),
                (rss_bytes, peak_rss_bytes, layer_divergence),
            )| NodeStats {
                node_id,
                role,
                step,
                bytes_sent,
                bytes_received,
                weak_sync_events,
                cached_pending,
                deltas_applied,
                duplicates_rejected,
                dropped_stale,
                layer_versions,
                staleness_histogram,
                accuracy,
                rss_bytes,
                peak_rss_bytes,
                layer_divergence,
            },
        )
}

fn arb_resync_reason() -> impl Strategy<Value = ResyncReason> {
    prop_oneof![
        (any::<u64>(), any::<u64>()).prop_map(|(staleness, max_staleness)| {
            ResyncReason::TooStale {
                staleness,
                max_staleness,
            }
        }),
        Just(ResyncReason::UnknownBaseVersion),
        Just(ResyncReason::ShapeMismatch),
        Just(ResyncReason::AggregatorRestarted),
    ]
}

fn arb_error_code() -> impl Strategy<Value = ErrorCode> {
    prop_oneof![
        Just(ErrorCode::Unauthorized),
        Just(ErrorCode::UnknownNode),
        Just(ErrorCode::NotOwner),
        Just(ErrorCode::BadRequest),
        Just(ErrorCode::Busy),
        Just(ErrorCode::Internal),
    ]
}

/// Any message, every variant reachable.
pub fn arb_message() -> impl Strategy<Value = Message> {
    prop_oneof![
        arb_join().prop_map(Message::Join),
        (
            any::<u64>(),
            any::<u64>(),
            arb_pairs(),
            arb_pairs(),
            any::<u64>(),
            arb_aggregators(),
            arb_pairs(),
            prop::collection::vec(any::<u32>(), 0..4),
        )
            .prop_map(
                |(
                    node_id,
                    lease_ms,
                    layer_owners,
                    layer_versions,
                    map_epoch,
                    aggregators,
                    layer_producers,
                    releasing_layers,
                )| {
                    Message::JoinAck(JoinAck {
                        node_id,
                        lease_ms,
                        layer_owners,
                        layer_versions,
                        map_epoch,
                        aggregators,
                        layer_producers,
                        releasing_layers,
                    })
                }
            ),
        (
            any::<u64>(),
            arb_pairs(),
            arb_aggregators(),
            arb_pairs(),
            arb_pairs(),
            prop::collection::vec(any::<u32>(), 0..4),
        )
            .prop_map(
                |(epoch, owners, aggregators, versions, producers, releasing)| {
                    Message::LayerMap(LayerMap {
                        epoch,
                        owners,
                        aggregators,
                        layer_versions: versions,
                        layer_producers: producers,
                        releasing_layers: releasing,
                    })
                }
            ),
        any::<u64>().prop_map(|node_id| Message::Subscribe(Subscribe { node_id })),
        arb_stats().prop_map(Message::Stats),
        (any::<u64>(), any::<u64>(), any::<u64>()).prop_map(|(node_id, lease_ms, now_ms)| {
            Message::Heartbeat(Heartbeat {
                node_id,
                lease_ms,
                now_ms,
            })
        }),
        (any::<u64>(), arb_text())
            .prop_map(|(node_id, reason)| Message::Leave(Leave { node_id, reason })),
        arb_layer_payload().prop_map(Message::LayerDelta),
        (
            (any::<u64>(), any::<u32>(), arb_text(), any::<u64>()),
            (
                arb_shape(),
                arb_codec(),
                arb_bytes(),
                proptest::collection::vec((any::<u64>(), any::<u64>()), 0..4),
            ),
        )
            .prop_map(
                |(
                    (aggregator_id, layer_id, layer_name, version),
                    (shape, codec, payload, seqs),
                )| {
                    Message::LayerVersion(LayerVersion {
                        aggregator_id,
                        layer_id,
                        layer_name,
                        version,
                        shape,
                        codec,
                        payload,
                        applied_seqs: seqs
                            .into_iter()
                            .map(|(node_id, seq)| AppliedSeq { node_id, seq })
                            .collect(),
                    })
                }
            ),
        (
            any::<u64>(),
            any::<u32>(),
            any::<u64>(),
            any::<bool>(),
            any::<u64>()
        )
            .prop_map(|(node_id, layer_id, seq, applied, new_version)| {
                Message::DeltaAck(DeltaAck {
                    node_id,
                    layer_id,
                    seq,
                    applied,
                    new_version,
                })
            }),
        (
            any::<u32>(),
            any::<u64>(),
            any::<Option<u64>>(),
            arb_resync_reason()
        )
            .prop_map(|(layer_id, current_version, refused_seq, reason)| {
                Message::Resync(Resync {
                    layer_id,
                    current_version,
                    refused_seq,
                    reason,
                })
            }),
        (arb_error_code(), arb_text())
            .prop_map(|(code, text)| Message::Error(ErrorReply { code, text })),
    ]
}

/// One hand-written message of every variant (small bodies, for fuzzing).
pub fn sample_messages() -> Vec<Message> {
    vec![
        Message::Join(Join {
            node_id: 42,
            role: Role::Edge,
            credentials: "secret-token".into(),
            capabilities: Capabilities {
                gpus: 1,
                cpu_cores: 8,
                memory_bytes: 16 << 30,
                link_bytes_per_sec: 12_500_000,
                codecs: vec![Codec::RawF32, Codec::ZstdTopK { k: 10 }, Codec::Bf16],
            },
            listen_addr: String::new(),
        }),
        Message::JoinAck(JoinAck {
            node_id: 42,
            lease_ms: 5_000,
            layer_owners: vec![(0, 1), (1, 1), (2, 2)],
            layer_versions: vec![(0, 10), (1, 11), (2, 0)],
            map_epoch: 3,
            aggregators: vec![AggregatorAddr {
                node_id: 1,
                addr: "127.0.0.1:7001".into(),
            }],
            layer_producers: vec![(0, 1), (1, 1)],
            releasing_layers: vec![],
        }),
        Message::LayerMap(LayerMap {
            epoch: 4,
            owners: vec![(0, 1), (1, 2)],
            aggregators: vec![
                AggregatorAddr {
                    node_id: 1,
                    addr: "127.0.0.1:7001".into(),
                },
                AggregatorAddr {
                    node_id: 2,
                    addr: "[::1]:7002".into(),
                },
            ],
            layer_versions: vec![(0, 12), (1, 0)],
            layer_producers: vec![(0, 1)],
            releasing_layers: vec![0],
        }),
        Message::Subscribe(Subscribe { node_id: 42 }),
        Message::Stats(NodeStats {
            node_id: 42,
            role: Role::Edge,
            step: 300,
            bytes_sent: 1 << 20,
            bytes_received: 2 << 20,
            weak_sync_events: 3,
            cached_pending: 1,
            deltas_applied: 0,
            duplicates_rejected: 0,
            dropped_stale: 0,
            layer_versions: vec![(0, 10), (1, 12)],
            staleness_histogram: vec![5, 2, 1],
            accuracy: Some(0.91),
            rss_bytes: 90 << 20,
            peak_rss_bytes: 120 << 20,
            layer_divergence: vec![(0, 0.02), (1, 0.5)],
        }),
        Message::Heartbeat(Heartbeat {
            node_id: 42,
            lease_ms: 5_000,
            now_ms: 1_700_000_000_000,
        }),
        Message::Leave(Leave {
            node_id: 42,
            reason: "maintenance".into(),
        }),
        Message::LayerDelta(LayerPayload {
            node_id: 42,
            layer_id: 3,
            layer_name: "conv2.weight".into(),
            step: 1234,
            base_version: 7,
            version: 7,
            seq: 99,
            sample_count: 256,
            shape: vec![4, 4],
            codec: Codec::F16,
            payload: (0..32).collect(),
        }),
        Message::LayerDelta(LayerPayload {
            node_id: 1,
            layer_id: 0,
            layer_name: String::new(),
            step: 0,
            base_version: 0,
            version: 0,
            seq: 0,
            sample_count: 0,
            shape: vec![],
            codec: Codec::TopK { k: 0 },
            payload: vec![],
        }),
        Message::LayerVersion(LayerVersion {
            aggregator_id: 2,
            layer_id: 3,
            layer_name: "fc.bias".into(),
            version: 8,
            shape: vec![10],
            codec: Codec::RawF32,
            payload: vec![0xab; 40],
            applied_seqs: vec![AppliedSeq {
                node_id: 5,
                seq: 17,
            }],
        }),
        Message::DeltaAck(DeltaAck {
            node_id: 42,
            layer_id: 3,
            seq: 99,
            applied: true,
            new_version: 8,
        }),
        Message::Resync(Resync {
            layer_id: 3,
            current_version: 20,
            refused_seq: Some(98),
            reason: ResyncReason::TooStale {
                staleness: 13,
                max_staleness: 8,
            },
        }),
        Message::Error(ErrorReply {
            code: ErrorCode::NotOwner,
            text: "layer 3 is owned by aggregator 2".into(),
        }),
    ]
}
