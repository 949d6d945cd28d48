//! The launcher's probe of the coordinator's `/status` endpoint: one GET a second for the
//! whole run, timed, so a run says whether the coordinator stayed responsive under load
//! (`summary.json`'s `status_latency_ms`).

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use node::latency::LatencyHistogram;
use tokio_util::sync::CancellationToken;

use crate::cluster_summary::{LatencyReport, StatusLatencyReport};

/// How long one probe may take before it counts as failed.
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);

#[derive(Default)]
struct Probed {
    answered: LatencyHistogram,
    failures: u64,
    over_100ms: u64,
}

/// A running probe (see the module docs).
pub struct StatusProbe {
    probed: Arc<Mutex<Probed>>,
    stop: CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

impl StatusProbe {
    /// Starts probing `status` (the coordinator's HTTP address) once a second.
    pub fn start(status: SocketAddr) -> Self {
        let probed = Arc::new(Mutex::new(Probed::default()));
        let stop = CancellationToken::new();
        let (p, s) = (Arc::clone(&probed), stop.clone());
        let task = tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(1));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    _ = s.cancelled() => return,
                    _ = tick.tick() => {}
                }
                let started = Instant::now();
                let answer = tokio::time::timeout(
                    PROBE_TIMEOUT,
                    crate::cluster_cmd::http_get(status, "/status"),
                )
                .await;
                let ms = started.elapsed().as_secs_f64() * 1e3;
                let Ok(mut p) = p.lock() else { return };
                match answer {
                    Ok(Ok(_)) => {
                        p.answered.record_ms(ms);
                        if ms > 100.0 {
                            p.over_100ms += 1;
                            tracing::warn!("[WARN] the coordinator's /status took {ms:.0} ms");
                        }
                    }
                    _ => p.failures += 1,
                }
            }
        });
        StatusProbe { probed, stop, task }
    }

    /// Stops probing and reports what it saw.
    pub async fn finish(self) -> StatusLatencyReport {
        self.stop.cancel();
        let _ = self.task.await;
        let p = self
            .probed
            .lock()
            .map(|p| (LatencyReport::of(&p.answered), p.failures, p.over_100ms));
        let (answered, failures, over_100ms) = p.unwrap_or((None, 0, 0));
        StatusLatencyReport {
            answered,
            failures,
            over_100ms,
        }
    }
}
