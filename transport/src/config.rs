//! [`TransportConfig`]: the knobs of a dreamddp QUIC connection (timeouts,
//! flow-control windows, message size limit) and their translation into a
//! `quinn::TransportConfig`; [`TransportSection`]: the `[transport]` table of a process
//! config, which sizes the windows for the link ([`LinkWindows::for_link`]).
//!
//! ## Window sizing (bandwidth-delay product)
//!
//! With `link_mbps` and `rtt_ms` given, `BDP = link_mbps · 10⁶ / 8 · rtt_ms / 10³` bytes and
//!
//! * `stream_receive_window = clamp(2 · BDP, 1 MiB, 256 MiB)` — one stream (one layer
//!   message) can keep the link busy for two round trips, so a loss recovery does not stall it;
//! * `receive_window = send_window = min(4 · stream_receive_window, 1 GiB)` — room for
//!   several layer messages in flight at once.
//!
//! The floor keeps a slow link's windows large enough that a typical layer message is not
//! throttled by flow control; the ceilings bound the memory a peer can make us buffer.
//! Explicit `stream_receive_window` / `receive_window` / `send_window` keys override the
//! computed values; without link figures the defaults (16/64/64 MiB) apply.

use std::sync::Arc;
use std::time::Duration;

use quinn::{IdleTimeout, VarInt};
use serde::{Deserialize, Serialize};

use crate::bbr::DeliveryBbrConfig;
use crate::error::TransportError;

/// Streams (one per message) a peer may have open towards us at once.
pub const MAX_CONCURRENT_UNI_STREAMS: u32 = 1024;
/// Bidirectional streams a peer may open (only the connection check uses one).
pub const MAX_CONCURRENT_BIDI_STREAMS: u32 = 4;

/// Timeouts, windows and limits of every connection of a [`crate::QuicNode`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TransportConfig {
    /// A connection with no traffic for this long is closed (default 10 s).
    pub idle_timeout: Duration,
    /// Interval of keep-alive packets; must be below `idle_timeout` (default 2 s).
    pub keep_alive: Duration,
    /// Bytes a peer may send on one stream before we read them (default 16 MiB).
    pub stream_receive_window: u64,
    /// Bytes a peer may send on all streams before we read them (default 64 MiB).
    pub receive_window: u64,
    /// Bytes we buffer for sending across all streams (default 64 MiB).
    pub send_window: u64,
    /// Largest frame (header + body) accepted from a peer; a longer stream is
    /// stopped and reported as [`TransportError::TooLarge`]
    /// (default `HEADER_LEN + DEFAULT_MAX_BODY_LEN`).
    pub max_message_bytes: usize,
    /// Congestion controller of every connection (default [`Congestion::Bbr`]).
    pub congestion: Congestion,
    /// Largest UDP payload this endpoint accepts (default 65 527, quinn's). The endpoint's
    /// receive buffer is sized from it (about 2 MiB at the default, 46 KiB at 1 472): what a
    /// process that runs a thousand endpoints (`dreamddp swarm`) lowers.
    pub max_udp_payload: u16,
}

/// Smallest `max_udp_payload` QUIC allows (RFC 9000 §18.2).
pub const MIN_UDP_PAYLOAD: u16 = 1200;

/// QUIC congestion controller.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Congestion {
    /// BBR: paces by measured bandwidth and RTT and does not halve its window on every loss,
    /// so random loss on a lossy edge link (not congestion) does not starve the connection.
    /// dreamddp's own ([`crate::bbr`]): BBRv1's window over the IETF draft's delivery-rate
    /// samples, which bunched acknowledgements cannot inflate.
    #[default]
    Bbr,
    /// quinn's BBR (experimental in quinn): its bandwidth samples are per ACK frame, and
    /// acknowledgements that share a loaded reverse link inflate them ([`crate::bbr`]).
    QuinnBbr,
    /// CUBIC (quinn's default): loss-based, backs off on every loss.
    Cubic,
    /// NewReno: the classic loss-based controller (halves its window on every loss).
    NewReno,
}

impl std::str::FromStr for Congestion {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "bbr" => Ok(Congestion::Bbr),
            "quinn-bbr" => Ok(Congestion::QuinnBbr),
            "cubic" => Ok(Congestion::Cubic),
            "newreno" | "new-reno" => Ok(Congestion::NewReno),
            other => Err(format!(
                "unknown congestion controller {other:?}; use bbr, quinn-bbr, cubic or newreno"
            )),
        }
    }
}

/// Floor of a link-sized `stream_receive_window` (1 MiB).
pub const MIN_STREAM_WINDOW: u64 = 1 << 20;
/// Ceiling of a link-sized `stream_receive_window` (256 MiB).
pub const MAX_STREAM_WINDOW: u64 = 256 << 20;
/// Ceiling of a link-sized `receive_window` / `send_window` (1 GiB).
pub const MAX_CONNECTION_WINDOW: u64 = 1 << 30;

/// Flow-control windows sized for one link (see the module docs for the formula).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LinkWindows {
    /// Bandwidth-delay product of the link, bytes.
    pub bdp_bytes: u64,
    /// Per-stream receive window.
    pub stream_receive_window: u64,
    /// Connection receive window.
    pub receive_window: u64,
    /// Send buffer across all streams.
    pub send_window: u64,
}

impl LinkWindows {
    /// Windows for a link of `link_mbps` megabits per second and `rtt_ms` milliseconds of
    /// round trip (both finite and positive; callers validate).
    pub fn for_link(link_mbps: f64, rtt_ms: f64) -> Self {
        let bdp = link_mbps * 1e6 / 8.0 * rtt_ms / 1e3;
        // `as` saturates: a huge product lands on the ceiling.
        let bdp_bytes = bdp.max(0.0).ceil() as u64;
        let stream_receive_window = bdp_bytes
            .saturating_mul(2)
            .clamp(MIN_STREAM_WINDOW, MAX_STREAM_WINDOW);
        let connection = stream_receive_window
            .saturating_mul(4)
            .min(MAX_CONNECTION_WINDOW);
        LinkWindows {
            bdp_bytes,
            stream_receive_window,
            receive_window: connection,
            send_window: connection,
        }
    }
}

/// The `[transport]` table of an aggregator or node process config (every key optional).
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct TransportSection {
    /// Bandwidth of this process's link, megabits per second (with `rtt_ms`: windows are
    /// sized as a bandwidth-delay product).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub link_mbps: Option<f64>,
    /// Round-trip time of this process's link, milliseconds (with `link_mbps`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rtt_ms: Option<f64>,
    /// Per-stream receive window, bytes (overrides the computed/default value).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream_receive_window: Option<u64>,
    /// Connection receive window, bytes (overrides the computed/default value).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub receive_window: Option<u64>,
    /// Send buffer, bytes (overrides the computed/default value).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub send_window: Option<u64>,
    /// Congestion controller: `bbr` (default), `cubic` or `newreno`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub congestion: Option<String>,
    /// Largest UDP payload accepted, bytes (1200..=65527; default 65527).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_udp_payload: Option<u16>,
}

/// A `[transport]` value that cannot be used; names the key.
#[derive(Debug, thiserror::Error, PartialEq)]
#[error("transport.{key} = {value}: {why}")]
pub struct TransportSectionError {
    /// The key inside `[transport]`.
    pub key: &'static str,
    /// The value given.
    pub value: String,
    /// What is expected.
    pub why: String,
}

impl TransportSection {
    /// The transport settings these keys ask for (defaults for the rest), validated.
    pub fn to_config(&self) -> Result<TransportConfig, TransportSectionError> {
        self.to_config_over(TransportConfig::default())
    }

    /// [`Self::to_config`] over other defaults than [`TransportConfig::default`] (e.g.
    /// [`TransportConfig::edge_device`] for an edge agent).
    pub fn to_config_over(
        &self,
        base: TransportConfig,
    ) -> Result<TransportConfig, TransportSectionError> {
        let err = |key, value: String, why: String| TransportSectionError { key, value, why };
        let mut config = base;
        for (key, value) in [("link_mbps", self.link_mbps), ("rtt_ms", self.rtt_ms)] {
            if let Some(v) = value {
                if !(v.is_finite() && v > 0.0) {
                    return Err(err(key, v.to_string(), "must be a positive number".into()));
                }
            }
        }
        match (self.link_mbps, self.rtt_ms) {
            (Some(mbps), Some(rtt)) => {
                let w = LinkWindows::for_link(mbps, rtt);
                config.stream_receive_window = w.stream_receive_window;
                config.receive_window = w.receive_window;
                config.send_window = w.send_window;
            }
            (None, None) => {}
            (Some(mbps), None) => {
                return Err(err(
                    "link_mbps",
                    mbps.to_string(),
                    "needs rtt_ms too (windows are sized as bandwidth x round trip)".into(),
                ))
            }
            (None, Some(rtt)) => {
                return Err(err(
                    "rtt_ms",
                    rtt.to_string(),
                    "needs link_mbps too (windows are sized as bandwidth x round trip)".into(),
                ))
            }
        }
        let limit = VarInt::MAX.into_inner();
        for (key, value, slot) in [
            (
                "stream_receive_window",
                self.stream_receive_window,
                &mut config.stream_receive_window,
            ),
            (
                "receive_window",
                self.receive_window,
                &mut config.receive_window,
            ),
            ("send_window", self.send_window, &mut config.send_window),
        ] {
            if let Some(v) = value {
                if v == 0 || v > limit {
                    return Err(err(
                        key,
                        v.to_string(),
                        format!("must be in 1..={limit} bytes"),
                    ));
                }
                *slot = v;
            }
        }
        if config.stream_receive_window > config.receive_window {
            let key = if self.stream_receive_window.is_some() {
                "stream_receive_window"
            } else {
                "receive_window"
            };
            return Err(err(
                key,
                if key == "receive_window" {
                    config.receive_window.to_string()
                } else {
                    config.stream_receive_window.to_string()
                },
                format!(
                    "stream_receive_window ({}) must not exceed receive_window ({})",
                    config.stream_receive_window, config.receive_window
                ),
            ));
        }
        if let Some(v) = self.max_udp_payload {
            if !(MIN_UDP_PAYLOAD..=65_527).contains(&v) {
                return Err(err(
                    "max_udp_payload",
                    v.to_string(),
                    format!("must be in {MIN_UDP_PAYLOAD}..=65527 bytes"),
                ));
            }
            config.max_udp_payload = v;
        }
        if let Some(name) = &self.congestion {
            config.congestion = name
                .parse()
                .map_err(|why| err("congestion", name.clone(), why))?;
        }
        config
            .validate()
            .map_err(|e| err("windows", String::new(), e.to_string()))?;
        Ok(config)
    }
}

impl Default for TransportConfig {
    fn default() -> Self {
        TransportConfig {
            idle_timeout: Duration::from_secs(10),
            keep_alive: Duration::from_secs(2),
            stream_receive_window: 16 << 20,
            receive_window: 64 << 20,
            send_window: 64 << 20,
            max_message_bytes: protocol::HEADER_LEN + protocol::DEFAULT_MAX_BODY_LEN as usize,
            congestion: Congestion::default(),
            max_udp_payload: 65_527,
        }
    }
}

/// Per-stream receive window of an edge device without link figures (2 MiB).
pub const EDGE_STREAM_WINDOW: u64 = 2 << 20;
/// Connection receive and send windows of an edge device without link figures (4 MiB).
pub const EDGE_CONNECTION_WINDOW: u64 = 4 << 20;

impl TransportConfig {
    /// The defaults of an edge agent, a constrained device: 2 MiB stream and 4 MiB
    /// connection windows. The windows bound what QUIC buffers per connection, unacknowledged
    /// sends and out-of-order receives alike: on a lossy link the 16/64/64 MiB server
    /// defaults let an MNIST edge agent's resident memory grow by ~80 MB with its traffic in
    /// flight (docs/cluster.md, "Edge agent memory"). 4 MiB still covers a 160 Mbit/s link at
    /// 200 ms of round trip; link figures (`link_mbps`, `rtt_ms`) size them instead.
    pub fn edge_device() -> Self {
        TransportConfig {
            stream_receive_window: EDGE_STREAM_WINDOW,
            receive_window: EDGE_CONNECTION_WINDOW,
            send_window: EDGE_CONNECTION_WINDOW,
            ..TransportConfig::default()
        }
    }

    /// Check the values are consistent and representable in QUIC.
    pub fn validate(&self) -> Result<(), TransportError> {
        let invalid = |reason: String| Err(TransportError::InvalidConfig(reason));
        if self.idle_timeout.is_zero() {
            return invalid("idle_timeout must be above zero".into());
        }
        if IdleTimeout::try_from(self.idle_timeout).is_err() {
            return invalid(format!("idle_timeout {:?} is too long", self.idle_timeout));
        }
        if self.keep_alive.is_zero() || self.keep_alive >= self.idle_timeout {
            return invalid(format!(
                "keep_alive ({:?}) must be above zero and below idle_timeout ({:?})",
                self.keep_alive, self.idle_timeout
            ));
        }
        for (name, value) in [
            ("stream_receive_window", self.stream_receive_window),
            ("receive_window", self.receive_window),
            ("send_window", self.send_window),
        ] {
            if value == 0 || VarInt::from_u64(value).is_err() {
                return invalid(format!("{name} ({value}) must be in 1..2^62"));
            }
        }
        if self.stream_receive_window > self.receive_window {
            return invalid(format!(
                "stream_receive_window ({}) must not exceed receive_window ({})",
                self.stream_receive_window, self.receive_window
            ));
        }
        let max_frame = protocol::HEADER_LEN as u64 + u64::from(u32::MAX);
        if self.max_message_bytes <= protocol::HEADER_LEN
            || self.max_message_bytes as u64 > max_frame
        {
            return invalid(format!(
                "max_message_bytes ({}) must be above the {}-byte frame header and at most {max_frame}",
                self.max_message_bytes,
                protocol::HEADER_LEN
            ));
        }
        Ok(())
    }

    /// Largest frame body accepted (`max_message_bytes` less the header).
    pub fn max_body_len(&self) -> u32 {
        let body = self.max_message_bytes.saturating_sub(protocol::HEADER_LEN);
        u32::try_from(body).unwrap_or(u32::MAX)
    }

    /// The quinn transport parameters for these settings (call
    /// [`TransportConfig::validate`] first).
    pub(crate) fn to_quinn(&self) -> Result<Arc<quinn::TransportConfig>, TransportError> {
        self.validate()?;
        let varint = |value: u64| {
            VarInt::from_u64(value)
                .map_err(|_| TransportError::InvalidConfig(format!("{value} exceeds 2^62")))
        };
        let idle = IdleTimeout::try_from(self.idle_timeout)
            .map_err(|_| TransportError::InvalidConfig("idle_timeout too long".into()))?;
        let mut quinn_config = quinn::TransportConfig::default();
        quinn_config
            .max_idle_timeout(Some(idle))
            .keep_alive_interval(Some(self.keep_alive))
            .stream_receive_window(varint(self.stream_receive_window)?)
            .receive_window(varint(self.receive_window)?)
            .send_window(self.send_window)
            .max_concurrent_uni_streams(MAX_CONCURRENT_UNI_STREAMS.into())
            .max_concurrent_bidi_streams(MAX_CONCURRENT_BIDI_STREAMS.into());
        match self.congestion {
            Congestion::Bbr => {
                quinn_config.congestion_controller_factory(Arc::new(DeliveryBbrConfig));
            }
            Congestion::QuinnBbr => {
                quinn_config.congestion_controller_factory(Arc::new(
                    quinn::congestion::BbrConfig::default(),
                ));
            }
            Congestion::Cubic => {
                quinn_config.congestion_controller_factory(Arc::new(
                    quinn::congestion::CubicConfig::default(),
                ));
            }
            Congestion::NewReno => {
                quinn_config.congestion_controller_factory(Arc::new(
                    quinn::congestion::NewRenoConfig::default(),
                ));
            }
        }
        Ok(Arc::new(quinn_config))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_edge_device_gets_small_windows_unless_its_keys_or_link_figures_say_otherwise() {
        let edge = TransportConfig::edge_device();
        assert_eq!(
            (
                edge.stream_receive_window,
                edge.receive_window,
                edge.send_window
            ),
            (2 << 20, 4 << 20, 4 << 20)
        );
        assert!(edge.validate().is_ok());
        let none = TransportSection::default();
        assert_eq!(none.to_config_over(edge.clone()).unwrap(), edge);
        assert_eq!(none.to_config().unwrap(), TransportConfig::default());
        let keys = TransportSection {
            send_window: Some(8 << 20),
            ..TransportSection::default()
        };
        let c = keys.to_config_over(edge.clone()).unwrap();
        assert_eq!((c.receive_window, c.send_window), (4 << 20, 8 << 20));
        let link = TransportSection {
            link_mbps: Some(1000.0),
            rtt_ms: Some(100.0),
            ..TransportSection::default()
        };
        let c = link.to_config_over(edge).unwrap();
        let w = LinkWindows::for_link(1000.0, 100.0);
        assert_eq!(
            (c.stream_receive_window, c.send_window),
            (w.stream_receive_window, w.send_window)
        );
    }

    #[test]
    fn default_is_valid_and_matches_the_protocol_limit() {
        let config = TransportConfig::default();
        config.validate().unwrap();
        assert_eq!(config.max_body_len(), protocol::DEFAULT_MAX_BODY_LEN);
        config.to_quinn().unwrap();
    }

    #[test]
    fn rejects_inconsistent_values() {
        let base = TransportConfig::default();
        let cases = [
            TransportConfig {
                keep_alive: base.idle_timeout,
                ..base.clone()
            },
            TransportConfig {
                idle_timeout: Duration::ZERO,
                ..base.clone()
            },
            TransportConfig {
                receive_window: 0,
                ..base.clone()
            },
            TransportConfig {
                stream_receive_window: base.receive_window + 1,
                ..base.clone()
            },
            TransportConfig {
                send_window: 1 << 62,
                ..base.clone()
            },
            TransportConfig {
                max_message_bytes: protocol::HEADER_LEN,
                ..base.clone()
            },
        ];
        for case in cases {
            let err = case.validate().unwrap_err();
            assert!(matches!(err, TransportError::InvalidConfig(_)), "{case:?}");
        }
    }

    #[test]
    fn windows_are_the_bandwidth_delay_product_within_floor_and_ceiling() {
        // 100 Mbit/s x 200 ms = 2.5 MB: stream window 2 x BDP, connection 4 x stream.
        let w = LinkWindows::for_link(100.0, 200.0);
        assert_eq!(w.bdp_bytes, 2_500_000);
        assert_eq!(w.stream_receive_window, 5_000_000);
        assert_eq!(w.receive_window, 20_000_000);
        assert_eq!(w.send_window, 20_000_000);
        // A slow link: the floor.
        let slow = LinkWindows::for_link(2.0, 40.0);
        assert_eq!(slow.bdp_bytes, 10_000);
        assert_eq!(slow.stream_receive_window, MIN_STREAM_WINDOW);
        assert_eq!(slow.receive_window, 4 * MIN_STREAM_WINDOW);
        // A huge link: the ceilings.
        let huge = LinkWindows::for_link(1e6, 1e4);
        assert_eq!(huge.stream_receive_window, MAX_STREAM_WINDOW);
        assert_eq!(huge.receive_window, MAX_CONNECTION_WINDOW);
    }

    #[test]
    fn every_congestion_controller_parses_and_builds() {
        for (name, expected) in [
            ("bbr", Congestion::Bbr),
            ("quinn-bbr", Congestion::QuinnBbr),
            ("cubic", Congestion::Cubic),
            ("newreno", Congestion::NewReno),
        ] {
            let parsed: Congestion = name.parse().unwrap();
            assert_eq!(parsed, expected);
            let config = TransportConfig {
                congestion: parsed,
                ..TransportConfig::default()
            };
            config.to_quinn().unwrap();
        }
        let err = "bbr2".parse::<Congestion>().unwrap_err();
        assert!(err.contains("quinn-bbr"), "{err}");
    }

    #[test]
    fn section_sizes_windows_and_explicit_keys_override() {
        let section = TransportSection {
            link_mbps: Some(100.0),
            rtt_ms: Some(200.0),
            send_window: Some(3 << 20),
            congestion: Some("newreno".into()),
            ..TransportSection::default()
        };
        let c = section.to_config().unwrap();
        assert_eq!(c.stream_receive_window, 5_000_000);
        assert_eq!(c.receive_window, 20_000_000);
        assert_eq!(c.send_window, 3 << 20);
        assert_eq!(c.congestion, Congestion::NewReno);
        c.to_quinn().unwrap();
        assert_eq!(
            TransportSection::default().to_config().unwrap(),
            TransportConfig::default()
        );
        let small = TransportSection {
            max_udp_payload: Some(1472),
            ..TransportSection::default()
        };
        assert_eq!(small.to_config().unwrap().max_udp_payload, 1472);
    }

    #[test]
    fn bad_section_values_name_their_key() {
        let cases = [
            (
                TransportSection {
                    link_mbps: Some(10.0),
                    ..TransportSection::default()
                },
                "transport.link_mbps",
            ),
            (
                TransportSection {
                    rtt_ms: Some(10.0),
                    ..TransportSection::default()
                },
                "transport.rtt_ms",
            ),
            (
                TransportSection {
                    link_mbps: Some(-1.0),
                    rtt_ms: Some(10.0),
                    ..TransportSection::default()
                },
                "transport.link_mbps",
            ),
            (
                TransportSection {
                    link_mbps: Some(10.0),
                    rtt_ms: Some(f64::NAN),
                    ..TransportSection::default()
                },
                "transport.rtt_ms",
            ),
            (
                TransportSection {
                    congestion: Some("vegas".into()),
                    ..TransportSection::default()
                },
                "transport.congestion",
            ),
            (
                TransportSection {
                    send_window: Some(0),
                    ..TransportSection::default()
                },
                "transport.send_window",
            ),
            (
                TransportSection {
                    max_udp_payload: Some(1000),
                    ..TransportSection::default()
                },
                "transport.max_udp_payload",
            ),
            (
                TransportSection {
                    stream_receive_window: Some(128 << 20),
                    ..TransportSection::default()
                },
                "transport.stream_receive_window",
            ),
            (
                TransportSection {
                    receive_window: Some(1 << 20),
                    ..TransportSection::default()
                },
                "transport.receive_window",
            ),
        ];
        for (section, key) in cases {
            let e = section.to_config().unwrap_err().to_string();
            assert!(e.starts_with(key), "{e} (expected {key})");
        }
    }
}
