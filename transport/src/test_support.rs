//! Test helpers: a certificate directory, bound node pairs, connected pairs,
//! and sample messages.

use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;

use protocol::{payload_from_f32, Codec, DeltaAck, LayerMeta, Message};

use crate::{create_cluster_certs, PeerConnection, QuicNode, TlsIdentity, TransportConfig};

/// Every test future is bounded by this.
pub(crate) const TEST_TIMEOUT: Duration = Duration::from_secs(10);

/// 127.0.0.1, any port.
pub(crate) fn localhost() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 0))
}

/// Run `future` with [`TEST_TIMEOUT`], panicking when it is exceeded.
pub(crate) async fn bounded<F: Future>(future: F) -> F::Output {
    tokio::time::timeout(TEST_TIMEOUT, future)
        .await
        .expect("test step timed out")
}

/// A temporary certificate directory with the given nodes.
pub(crate) fn cert_dir(names: &[&str]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let names: Vec<String> = names.iter().map(|s| s.to_string()).collect();
    create_cluster_certs(dir.path(), &names).unwrap();
    dir
}

/// Bind node `name` from `dir` on 127.0.0.1.
pub(crate) fn bind(dir: &std::path::Path, name: &str, config: &TransportConfig) -> QuicNode {
    QuicNode::bind(localhost(), &TlsIdentity::in_dir(dir, name), config).unwrap()
}

/// `client` dials `server` (named `server_name`); returns (client side, server side).
pub(crate) async fn connect_pair(
    client: &QuicNode,
    server: &QuicNode,
    server_name: &str,
) -> (PeerConnection, PeerConnection) {
    let addr = server.local_addr().unwrap();
    let (dialed, accepted) =
        bounded(async { tokio::join!(client.connect(addr, server_name), server.accept()) }).await;
    (dialed.unwrap(), accepted.unwrap().unwrap())
}

/// A RawF32 LayerDelta of `floats` values.
pub(crate) fn layer_delta(layer_id: u32, seq: u64, floats: usize) -> Message {
    let values: Vec<f32> = (0..floats).map(|i| i as f32 * 0.25 - 3.0).collect();
    let meta = LayerMeta {
        node_id: 42,
        layer_id,
        layer_name: format!("layer{layer_id}"),
        seq,
        ..Default::default()
    };
    let payload = payload_from_f32(meta, &[floats as u32], &values, Codec::RawF32).unwrap();
    Message::LayerDelta(payload)
}

/// A DeltaAck.
pub(crate) fn delta_ack(layer_id: u32, seq: u64) -> Message {
    Message::DeltaAck(DeltaAck {
        node_id: 42,
        layer_id,
        seq,
        applied: true,
        new_version: seq + 1,
    })
}
