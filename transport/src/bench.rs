//! Throughput of [`PeerConnection`] against raw quinn on loopback, measured
//! in the same run ([`bench_transport_vs_raw`]); used by
//! `benches/transport_vs_raw_quinn.rs` and available to the CLI.
//!
//! Both sides use the same TLS and transport settings. The transport side
//! sends `messages` LayerDelta messages through [`PeerConnection::send`] /
//! [`PeerConnection::recv`] (encode, frame, checksum, one stream each,
//! concurrent reads, decode). The raw side writes the same number of bytes
//! per stream with `write_all` and reads them with `read_to_end`, with no
//! framing or decoding. Rounds alternate transport, raw, transport, raw, ...

use std::path::PathBuf;
use std::time::{Duration, Instant};

use protocol::{payload_from_f32, Codec, LayerMeta, Message};
use tokio::task::JoinSet;

use crate::certs::{create_cluster_certs, TlsIdentity};
use crate::config::TransportConfig;
use crate::connection::PeerConnection;
use crate::error::TransportError;
use crate::node::QuicNode;
use crate::tls::quinn_configs;

/// What to measure.
#[derive(Clone, Debug)]
pub struct BenchParams {
    /// Directory for the benchmark's own CA and two node certificates.
    pub cert_dir: PathBuf,
    /// Messages per round.
    pub messages: usize,
    /// f32 values per message (262 144 ≈ 1 MiB).
    pub floats_per_message: usize,
    /// Rounds of each kind (alternating).
    pub rounds: usize,
}

impl BenchParams {
    /// 200 messages of 1 MiB, 3 rounds each, certificates in `cert_dir`.
    pub fn new(cert_dir: PathBuf) -> BenchParams {
        BenchParams {
            cert_dir,
            messages: 200,
            floats_per_message: 256 * 1024,
            rounds: 3,
        }
    }
}

/// Throughput of each side; MB = 10^6 bytes of frames (or raw stream bytes).
/// The headline figures are medians over the rounds, so one round slowed by
/// another process on a shared machine does not decide the ratio.
#[derive(Clone, Debug)]
pub struct BenchResult {
    /// Bytes each round moves (identical for both sides).
    pub bytes_per_round: u64,
    /// MB/s of each transport round, in order.
    pub transport_rounds_mb_s: Vec<f64>,
    /// MB/s of each raw quinn round, in order.
    pub raw_rounds_mb_s: Vec<f64>,
    /// Median MB/s of the transport rounds.
    pub transport_mb_s: f64,
    /// Median MB/s of the raw rounds.
    pub raw_mb_s: f64,
}

impl BenchResult {
    /// `transport_mb_s / raw_mb_s` (ratio of the medians).
    pub fn ratio(&self) -> f64 {
        self.transport_mb_s / self.raw_mb_s
    }
}

/// Median of `values` (mean of the middle two for an even count; 0 if empty).
fn median(values: &[f64]) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    match sorted.len() {
        0 => 0.0,
        n if n % 2 == 1 => sorted[n / 2],
        n => (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0,
    }
}

fn mb_per_s(bytes: u64, elapsed: Duration) -> f64 {
    bytes as f64 / 1e6 / elapsed.as_secs_f64().max(1e-9)
}

/// A layer delta of `floats` raw `f32` values (what the benchmark and `dreamddp link-check`
/// send).
pub fn bench_message(floats: usize) -> Result<Message, TransportError> {
    let values: Vec<f32> = (0..floats).map(|i| (i % 1000) as f32 * 1e-3).collect();
    let meta = LayerMeta {
        node_id: 1,
        layer_id: 7,
        layer_name: "bench.weight".into(),
        ..Default::default()
    };
    let floats_u32 = u32::try_from(floats)
        .map_err(|_| TransportError::InvalidConfig(format!("{floats} floats per message")))?;
    let payload = payload_from_f32(meta, &[floats_u32], &values, Codec::RawF32)
        .map_err(|e| TransportError::InvalidConfig(e.to_string()))?;
    Ok(Message::LayerDelta(payload))
}

/// Run the comparison on 127.0.0.1. Call inside a tokio runtime (a
/// multi-threaded one for meaningful figures).
pub async fn bench_transport_vs_raw(params: &BenchParams) -> Result<BenchResult, TransportError> {
    let names = vec!["bench-sender".to_string(), "bench-receiver".to_string()];
    create_cluster_certs(&params.cert_dir, &names)?;
    let config = TransportConfig::default();
    let localhost = std::net::SocketAddr::from(([127, 0, 0, 1], 0));
    let sender_identity = TlsIdentity::in_dir(&params.cert_dir, &names[0]);
    let receiver_identity = TlsIdentity::in_dir(&params.cert_dir, &names[1]);

    // Our transport.
    let sender_node = QuicNode::bind(localhost, &sender_identity, &config)?;
    let receiver_node = QuicNode::bind(localhost, &receiver_identity, &config)?;
    let (dialed, accepted) = tokio::join!(
        sender_node.connect(receiver_node.local_addr()?, &names[1]),
        receiver_node.accept()
    );
    let to_receiver = dialed?;
    let from_sender = accepted.ok_or(TransportError::Closed)??;

    // Raw quinn with the same TLS and transport settings.
    let raw_server_configs = quinn_configs(
        receiver_identity.load()?,
        &receiver_identity.ca_cert,
        &config,
    )?;
    let raw_client_configs =
        quinn_configs(sender_identity.load()?, &sender_identity.ca_cert, &config)?;
    let bind_error = |source| TransportError::Io {
        action: "bind",
        addr: Some(localhost),
        source,
    };
    let raw_server =
        quinn::Endpoint::server(raw_server_configs.server, localhost).map_err(bind_error)?;
    let mut raw_client = quinn::Endpoint::client(localhost).map_err(bind_error)?;
    raw_client.set_default_client_config(raw_client_configs.client);
    let raw_server_addr = raw_server.local_addr().map_err(bind_error)?;
    let connect = async {
        raw_client
            .connect(raw_server_addr, &names[1])
            .map_err(|e| TransportError::Connect {
                addr: raw_server_addr,
                server_name: names[1].clone(),
                reason: e.to_string(),
            })?
            .await
            .map_err(TransportError::Connection)
    };
    let accept = async {
        let incoming = raw_server.accept().await.ok_or(TransportError::Closed)?;
        incoming.await.map_err(TransportError::Connection)
    };
    let (raw_out, raw_in) = tokio::join!(connect, accept);
    let (raw_out, raw_in) = (raw_out?, raw_in?);

    let message = bench_message(params.floats_per_message)?;
    let frame_len = protocol::encode_frame(&message)
        .map_err(|source| TransportError::Encode {
            kind: message.kind(),
            source,
        })?
        .len();
    let raw_bytes = vec![0x5au8; frame_len];
    let bytes_per_round = (frame_len * params.messages) as u64;

    let mut result = BenchResult {
        bytes_per_round,
        transport_rounds_mb_s: Vec::new(),
        raw_rounds_mb_s: Vec::new(),
        transport_mb_s: 0.0,
        raw_mb_s: 0.0,
    };
    for _ in 0..params.rounds {
        let elapsed =
            transport_round(&to_receiver, &from_sender, &message, params.messages).await?;
        result
            .transport_rounds_mb_s
            .push(mb_per_s(bytes_per_round, elapsed));
        let elapsed = raw_round(
            &raw_out,
            &raw_in,
            &raw_bytes,
            params.messages,
            config.max_message_bytes,
        )
        .await?;
        result
            .raw_rounds_mb_s
            .push(mb_per_s(bytes_per_round, elapsed));
    }
    result.transport_mb_s = median(&result.transport_rounds_mb_s);
    result.raw_mb_s = median(&result.raw_rounds_mb_s);

    to_receiver.close("bench done");
    raw_out.close(0u32.into(), b"bench done");
    sender_node.close();
    receiver_node.close();
    raw_client.close(0u32.into(), b"bench done");
    raw_server.close(0u32.into(), b"bench done");
    Ok(result)
}

async fn transport_round(
    sender: &PeerConnection,
    receiver: &PeerConnection,
    message: &Message,
    count: usize,
) -> Result<Duration, TransportError> {
    let start = Instant::now();
    let send_all = async {
        for _ in 0..count {
            sender.send(message).await?;
        }
        Ok::<(), TransportError>(())
    };
    let receive_all = async {
        for _ in 0..count {
            let received = receiver.recv().await?;
            if !matches!(received, Message::LayerDelta(_)) {
                return Err(TransportError::InvalidConfig(format!(
                    "bench received a {} message",
                    received.kind()
                )));
            }
        }
        Ok(())
    };
    let (sent, received) = tokio::join!(send_all, receive_all);
    sent?;
    received?;
    Ok(start.elapsed())
}

async fn raw_round(
    sender: &quinn::Connection,
    receiver: &quinn::Connection,
    bytes: &[u8],
    count: usize,
    limit: usize,
) -> Result<Duration, TransportError> {
    let start = Instant::now();
    let send_all = async {
        for _ in 0..count {
            let mut stream = sender.open_uni().await?;
            stream
                .write_all(bytes)
                .await
                .map_err(|e| TransportError::Write {
                    peer: "raw".into(),
                    source: e,
                })?;
            stream.finish().map_err(|_| TransportError::Closed)?;
        }
        Ok::<(), TransportError>(())
    };
    let receive_all = async {
        let mut reads = JoinSet::new();
        for _ in 0..count {
            let mut stream = receiver.accept_uni().await?;
            reads.spawn(async move { stream.read_to_end(limit).await.map(|b| b.len()) });
        }
        while let Some(read) = reads.join_next().await {
            match read {
                Ok(Ok(_len)) => {}
                _ => return Err(TransportError::Closed),
            }
        }
        Ok(())
    };
    let (sent, received) = tokio::join!(send_all, receive_all);
    sent?;
    received?;
    Ok(start.elapsed())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_ignores_one_outlier() {
        assert_eq!(median(&[100.0, 5.0, 90.0]), 90.0);
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), 2.5);
        assert_eq!(median(&[]), 0.0);
    }

    #[tokio::test]
    async fn a_small_comparison_runs_and_moves_the_same_bytes_on_both_sides() {
        let dir = tempfile::tempdir().unwrap();
        let params = BenchParams {
            cert_dir: dir.path().to_path_buf(),
            messages: 4,
            floats_per_message: 1024,
            rounds: 1,
        };
        let result = tokio::time::timeout(Duration::from_secs(10), bench_transport_vs_raw(&params))
            .await
            .unwrap()
            .unwrap();
        assert!(result.bytes_per_round > 4 * 4096);
        assert_eq!(result.transport_rounds_mb_s.len(), 1);
        assert!(result.transport_mb_s > 0.0 && result.raw_mb_s > 0.0);
        assert!(result.ratio().is_finite());
    }
}
