//! The operator's HTTP endpoint (axum): `GET /status` (JSON [`StatusReport`]),
//! `GET /metrics` (Prometheus text) and `GET /healthz`.
//!
//! Handlers ask the task that owns the state machine for a fresh report over a channel, so
//! the state is never shared behind a lock. When that task is busy (a large fleet on a
//! saturated machine) and has not answered within [`FRESH_WAIT`], the handler answers with
//! the last report it has, if it is younger than [`MAX_STALE`], and the pending request
//! refreshes that report for the next caller. The `x-report-age-ms` header says how old the
//! answer is (0: made for this request). A report's JSON is rendered once and kept with it,
//! so the answers made from the last report cost no serialization (with 1,000 nodes it is
//! 640 kB).

use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::http::{header, HeaderName, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use tokio::sync::{mpsc, oneshot};

use crate::status::{prometheus_text, StatusReport};

/// A request for the current [`StatusReport`], answered by the state task.
pub(crate) type StatusRequest = oneshot::Sender<StatusReport>;

/// Content type of the Prometheus text exposition format.
const PROMETHEUS_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// How long a handler waits for a fresh report before it answers with the last one.
pub(crate) const FRESH_WAIT: Duration = Duration::from_millis(20);

/// The oldest last report a handler answers with; older, it waits for a fresh one.
pub(crate) const MAX_STALE: Duration = Duration::from_secs(5);

/// The header that says how old the answer is, in milliseconds.
const AGE_HEADER: HeaderName = HeaderName::from_static("x-report-age-ms");

/// A report and its JSON, rendered on first use.
struct Rendered {
    report: StatusReport,
    json: OnceLock<Result<axum::body::Bytes, String>>,
}

impl Rendered {
    fn json(&self) -> &Result<axum::body::Bytes, String> {
        self.json.get_or_init(|| {
            serde_json::to_vec(&self.report)
                .map(axum::body::Bytes::from)
                .map_err(|e| e.to_string())
        })
    }
}

/// The newest report and when it was made.
type LastReport = Arc<Mutex<Option<(Instant, Arc<Rendered>)>>>;

#[derive(Clone)]
struct AppState {
    requests: mpsc::Sender<StatusRequest>,
    last: LastReport,
}

/// The router serving `/status`, `/metrics` and `/healthz`.
pub(crate) fn router(requests: mpsc::Sender<StatusRequest>) -> Router {
    Router::new()
        .route("/status", get(status))
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok\n" }))
        .with_state(AppState {
            requests,
            last: Arc::new(Mutex::new(None)),
        })
}

fn unavailable() -> Response {
    (
        StatusCode::SERVICE_UNAVAILABLE,
        "the coordinator is shutting down\n",
    )
        .into_response()
}

/// A fresh report, or the last one when the state task is busy (see the module docs), with
/// its age in milliseconds.
async fn current_report(app: &AppState) -> Result<(Arc<Rendered>, u64), Response> {
    let (reply, answer) = oneshot::channel();
    app.requests.send(reply).await.map_err(|_| unavailable())?;
    let last = Arc::clone(&app.last);
    // The answer is stored by a task of its own, so a request that times out here still
    // refreshes the last report when the state task gets to it.
    let mut fresh = tokio::spawn(async move {
        let report = Arc::new(Rendered {
            report: answer.await.ok()?,
            json: OnceLock::new(),
        });
        if let Ok(mut slot) = last.lock() {
            *slot = Some((Instant::now(), Arc::clone(&report)));
        }
        Some(report)
    });
    if let Ok(done) = tokio::time::timeout(FRESH_WAIT, &mut fresh).await {
        return done.ok().flatten().map(|r| (r, 0)).ok_or_else(unavailable);
    }
    let recent = app.last.lock().ok().and_then(|slot| {
        slot.as_ref()
            .filter(|(at, _)| at.elapsed() <= MAX_STALE)
            .map(|(at, r)| (Arc::clone(r), at.elapsed().as_millis() as u64))
    });
    match recent {
        Some(answer) => Ok(answer),
        None => fresh
            .await
            .ok()
            .flatten()
            .map(|r| (r, 0))
            .ok_or_else(unavailable),
    }
}

async fn status(State(app): State<AppState>) -> Response {
    match current_report(&app).await {
        Ok((rendered, age_ms)) => match rendered.json() {
            Ok(body) => (
                [
                    (header::CONTENT_TYPE, "application/json".to_string()),
                    (AGE_HEADER, age_ms.to_string()),
                ],
                body.clone(),
            )
                .into_response(),
            Err(e) => (
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("the status report does not serialize: {e}\n"),
            )
                .into_response(),
        },
        Err(response) => response,
    }
}

async fn metrics(State(app): State<AppState>) -> Response {
    match current_report(&app).await {
        Ok((report, age_ms)) => (
            [
                (header::CONTENT_TYPE, PROMETHEUS_CONTENT_TYPE.to_string()),
                (AGE_HEADER, age_ms.to_string()),
            ],
            prometheus_text(&report.report),
        )
            .into_response(),
        Err(response) => response,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{CoordinatorConfig, LayerInfo};
    use crate::state::CoordinatorState;
    use std::sync::atomic::{AtomicU64, Ordering};

    /// A state task answering each request after `delay_ms` (read per request).
    fn state_task(delay_ms: Arc<AtomicU64>) -> AppState {
        let (requests, mut rx) = mpsc::channel::<StatusRequest>(16);
        let state = CoordinatorState::new(CoordinatorConfig {
            credentials: "x".into(),
            lease_ms: 1_000,
            layers: vec![LayerInfo {
                layer_id: 0,
                name: "fc1".into(),
                shape: vec![4],
            }],
            divergence: Default::default(),
        });
        tokio::spawn(async move {
            while let Some(reply) = rx.recv().await {
                let delay = Duration::from_millis(delay_ms.load(Ordering::SeqCst));
                tokio::time::sleep(delay).await;
                let _ = reply.send(state.status(0));
            }
        });
        AppState {
            requests,
            last: Arc::new(Mutex::new(None)),
        }
    }

    fn made_at(app: &AppState) -> Option<Instant> {
        app.last.lock().unwrap().as_ref().map(|(at, _)| *at)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_busy_state_task_is_answered_for_by_the_last_report_which_it_then_refreshes() {
        let delay = Arc::new(AtomicU64::new(0));
        let app = state_task(Arc::clone(&delay));
        // Idle: a fresh report, remembered.
        let (report, age) = current_report(&app).await.unwrap();
        assert_eq!((age, report.report.layers.len()), (0, 1));
        let json = report.json().as_ref().unwrap();
        assert!(serde_json::from_slice::<serde_json::Value>(json).is_ok());
        let first = made_at(&app).expect("the fresh report is kept");

        // Busy for 600 ms: the last report answers within the wait, not after 600 ms.
        delay.store(600, Ordering::SeqCst);
        let asked = Instant::now();
        let (_, age) = current_report(&app).await.unwrap();
        let took = asked.elapsed();
        assert!(took < Duration::from_millis(400), "answered in {took:?}");
        assert!(age < MAX_STALE.as_millis() as u64);
        assert_eq!(made_at(&app), Some(first), "not refreshed yet");
        // The request that timed out still refreshes the last report when answered.
        tokio::time::sleep(Duration::from_millis(900)).await;
        assert!(
            made_at(&app).unwrap() > first,
            "refreshed by the late answer"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn without_a_recent_report_the_handler_waits_for_a_fresh_one() {
        let delay = Arc::new(AtomicU64::new(200));
        let app = state_task(delay);
        let asked = Instant::now();
        let (_, age) = current_report(&app).await.unwrap();
        assert_eq!(age, 0);
        assert!(asked.elapsed() >= Duration::from_millis(200));
        // A report older than MAX_STALE is not served either.
        let old = Instant::now().checked_sub(MAX_STALE + Duration::from_secs(1));
        if let Some(old) = old {
            let report = app.last.lock().unwrap().as_ref().unwrap().1.clone();
            *app.last.lock().unwrap() = Some((old, report));
            let asked = Instant::now();
            let (_, age) = current_report(&app).await.unwrap();
            assert_eq!(age, 0);
            assert!(asked.elapsed() >= Duration::from_millis(200));
        }
    }
}
