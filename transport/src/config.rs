//! [`TransportConfig`]: the knobs of a dreamddp QUIC connection (timeouts,
//! flow-control windows, message size limit) and their translation into a
//! `quinn::TransportConfig`.

use std::sync::Arc;
use std::time::Duration;

use quinn::{IdleTimeout, VarInt};

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
}

/// QUIC congestion controller.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Congestion {
    /// BBR: paces by measured bandwidth and RTT and does not halve its window on every loss,
    /// so random loss on a lossy edge link (not congestion) does not starve the connection.
    #[default]
    Bbr,
    /// CUBIC (quinn's default): loss-based, backs off on every loss.
    Cubic,
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
        }
    }
}

impl TransportConfig {
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
                quinn_config.congestion_controller_factory(Arc::new(
                    quinn::congestion::BbrConfig::default(),
                ));
            }
            Congestion::Cubic => {
                quinn_config.congestion_controller_factory(Arc::new(
                    quinn::congestion::CubicConfig::default(),
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
}
