//! End-to-end test of the coordinator shell over real QUIC on 127.0.0.1: two test peers
//! speaking the real protocol, one as an aggregator and one as a worker, join; the
//! coordinator subscribes to the aggregator and caches its layer version, a bad join and a garbage frame are refused without disturbing anyone,
//! `/status`, `/metrics` and `/healthz` answer, and a lost lease rebalances.

use std::net::SocketAddr;
use std::time::Duration;

use protocol::{
    codec, Capabilities, Codec, ErrorCode, Heartbeat, Join, LayerVersion, Message, Role,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_util::sync::CancellationToken;
use transport::{create_cluster_certs, PeerConnection, QuicNode, TlsIdentity, TransportConfig};

use super::*;
use crate::config::LayerInfo;

const SECRET: &str = "cluster-token";
const LEASE_MS: u64 = 700;
const BOUND: Duration = Duration::from_secs(10);

fn localhost() -> SocketAddr {
    "127.0.0.1:0".parse().unwrap()
}

async fn bounded<F: std::future::Future>(what: &str, f: F) -> F::Output {
    tokio::time::timeout(BOUND, f)
        .await
        .unwrap_or_else(|_| panic!("timed out: {what}"))
}

/// Receives until `pick` accepts a message (skipping heartbeat echoes and the like).
async fn recv_until<T>(link: &PeerConnection, mut pick: impl FnMut(Message) -> Option<T>) -> T {
    bounded("waiting for a message", async {
        loop {
            let msg = link.recv().await.expect("connection alive");
            if let Some(t) = pick(msg) {
                return t;
            }
        }
    })
    .await
}

fn join(node_id: u64, role: Role, credentials: &str, listen_addr: String) -> Message {
    Message::Join(Join {
        node_id,
        role,
        credentials: credentials.into(),
        capabilities: Capabilities::default(),
        listen_addr,
    })
}

fn heartbeat(node_id: u64) -> Message {
    Message::Heartbeat(Heartbeat {
        node_id,
        lease_ms: 0,
        now_ms: 0,
    })
}

/// `GET path` over a plain TCP stream; returns (status line, body).
async fn http_get(addr: SocketAddr, path: &str) -> (String, String) {
    bounded("HTTP GET", async {
        let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        let request = format!("GET {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n");
        stream.write_all(request.as_bytes()).await.unwrap();
        let mut response = Vec::new();
        stream.read_to_end(&mut response).await.unwrap();
        let response = String::from_utf8(response).unwrap();
        let (head, body) = response.split_once("\r\n\r\n").unwrap();
        (head.lines().next().unwrap().to_owned(), body.to_owned())
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn members_join_subscribe_report_and_expire_over_quic() {
    let certs = tempfile::tempdir().unwrap();
    let names: Vec<String> = ["coordinator", "agg-1", "worker-1"]
        .map(String::from)
        .to_vec();
    create_cluster_certs(certs.path(), &names).unwrap();
    let layers = (0..2)
        .map(|i| LayerInfo {
            layer_id: i,
            name: format!("fc{i}"),
            shape: vec![4],
        })
        .collect();
    let server = CoordinatorServer::bind(CoordinatorRunConfig {
        listen: localhost(),
        status_addr: Some(localhost()),
        certs_dir: certs.path().to_owned(),
        node_name: "coordinator".into(),
        transport: TransportConfig::default(),
        state: CoordinatorConfig {
            credentials: SECRET.into(),
            lease_ms: LEASE_MS,
            layers,
            divergence: Default::default(),
        },
    })
    .await
    .unwrap();
    let coord_addr = server.local_addr().unwrap();
    let status_addr = server.status_addr().unwrap();
    let shutdown = CancellationToken::new();
    let running = tokio::spawn(server.run(shutdown.clone()));

    let transport = TransportConfig::default();
    let agg = QuicNode::bind(
        localhost(),
        &TlsIdentity::in_dir(certs.path(), "agg-1"),
        &transport,
    )
    .unwrap();
    let worker = QuicNode::bind(
        localhost(),
        &TlsIdentity::in_dir(certs.path(), "worker-1"),
        &transport,
    )
    .unwrap();

    // The aggregator joins, owns both layers, heartbeats, and gets subscribed to.
    let agg_link = bounded("agg connect", agg.connect(coord_addr, "coordinator"))
        .await
        .unwrap();
    let agg_addr = agg.local_addr().unwrap().to_string();
    agg_link
        .send(&join(7, Role::Aggregator, SECRET, agg_addr))
        .await
        .unwrap();
    let ack = recv_until(&agg_link, |m| match m {
        Message::JoinAck(ack) => Some(ack),
        _ => None,
    })
    .await;
    assert_eq!((ack.node_id, ack.map_epoch, ack.lease_ms), (7, 1, LEASE_MS));
    assert_eq!(ack.layer_owners, vec![(0, 7), (1, 7)]);
    let beating = {
        let link = agg_link.clone();
        tokio::spawn(async move {
            loop {
                let _ = link.send(&heartbeat(7)).await;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
    };
    let sub_link = bounded("subscription", agg.accept())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(sub_link.peer_name(), "coordinator");
    let subscribe = bounded("Subscribe", sub_link.recv()).await.unwrap();
    assert_eq!(
        subscribe,
        Message::Subscribe(Subscribe {
            node_id: COORDINATOR_NODE_ID
        })
    );
    let encoded = codec::encode(&[1.0, 2.0, 3.0, 4.0], Codec::RawF32).unwrap();
    let version = LayerVersion {
        aggregator_id: 7,
        layer_id: 0,
        layer_name: "fc0".into(),
        version: 3,
        shape: vec![4],
        codec: encoded.codec,
        payload: encoded.bytes,
        applied_seqs: Vec::new(),
    };
    sub_link
        .send(&Message::LayerVersion(version))
        .await
        .unwrap();

    // Wrong credentials: Unauthorized, then the connection is closed.
    let intruder = bounded("connect", worker.connect(coord_addr, "coordinator"))
        .await
        .unwrap();
    intruder
        .send(&join(9, Role::Worker, "guess", String::new()))
        .await
        .unwrap();
    let refusal = bounded("refusal", intruder.recv()).await.unwrap();
    assert!(matches!(refusal, Message::Error(e) if e.code == ErrorCode::Unauthorized));
    assert!(bounded("close after refusal", intruder.recv())
        .await
        .is_err());

    // The worker joins and sees the aggregator's map.
    let worker_link = bounded("connect", worker.connect(coord_addr, "coordinator"))
        .await
        .unwrap();
    worker_link
        .send(&join(3, Role::Worker, SECRET, String::new()))
        .await
        .unwrap();
    let ack = recv_until(&worker_link, |m| match m {
        Message::JoinAck(ack) => Some(ack),
        _ => None,
    })
    .await;
    assert_eq!(
        (ack.map_epoch, ack.layer_owners.len(), ack.aggregators.len()),
        (1, 2, 1)
    );
    let keep_worker = {
        let link = worker_link.clone();
        tokio::spawn(async move {
            loop {
                let _ = link.send(&heartbeat(3)).await;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
    };

    // A garbage frame closes that connection only.
    let garbage = bounded("connect", worker.connect(coord_addr, "coordinator"))
        .await
        .unwrap();
    garbage
        .send_frame(b"definitely not a dreamddp frame")
        .await
        .unwrap();
    assert!(bounded("close after garbage", garbage.recv())
        .await
        .is_err());
    let echo = recv_until(&worker_link, |m| match m {
        Message::Heartbeat(hb) => Some(hb),
        _ => None,
    })
    .await;
    assert_eq!((echo.node_id, echo.lease_ms), (3, LEASE_MS));

    // Status: both members, the cached version of layer 0.
    let report = bounded("checkpoint in /status", async {
        loop {
            let (line, body) = http_get(status_addr, "/status").await;
            assert!(line.contains("200"), "{line}");
            let json: serde_json::Value = serde_json::from_str(&body).unwrap();
            if json["layers"][0]["version"] == 3 {
                return json;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    assert_eq!(report["members"].as_array().unwrap().len(), 2);
    assert_eq!(report["layers"][0]["checkpoint_bytes"], 16);
    assert_eq!(report["members"][1]["name"], "agg-1");
    let (line, metrics) = http_get(status_addr, "/metrics").await;
    assert!(line.contains("200"), "{line}");
    assert!(
        metrics.contains("# TYPE dreamddp_layer_version gauge"),
        "{metrics}"
    );
    assert!(metrics
        .lines()
        .any(|l| l == "dreamddp_layer_version{layer=\"fc0\",layer_id=\"0\"} 3"));
    assert!(metrics
        .lines()
        .any(|l| l == "dreamddp_members{role=\"aggregator\"} 1"));
    assert_eq!(http_get(status_addr, "/healthz").await.1, "ok\n");
    assert!(http_get(status_addr, "/nope").await.0.contains("404"));

    // The aggregator stops heartbeating: its lease expires and the worker gets an empty map.
    beating.abort();
    let map = recv_until(&worker_link, |m| match m {
        Message::LayerMap(map) => Some(map),
        _ => None,
    })
    .await;
    keep_worker.abort();
    assert_eq!(map.epoch, 2);
    assert!(map.owners.is_empty() && map.aggregators.is_empty());

    shutdown.cancel();
    let summary = bounded("shutdown", running).await.unwrap().unwrap();
    assert_eq!(summary.events.joined, 2);
    assert_eq!(summary.events.refused, 1);
    assert_eq!(summary.events.lease_expired, 1);
    assert_eq!(summary.events.rebalanced, 2);
    assert_eq!(summary.status.members.len(), 1);
    assert_eq!(summary.status.layers[0].version, 3);
}
