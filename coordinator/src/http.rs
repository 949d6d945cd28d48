//! The operator's HTTP endpoint (axum): `GET /status` (JSON [`StatusReport`]),
//! `GET /metrics` (Prometheus text) and `GET /healthz`.
//!
//! Handlers ask the task that owns the state machine for a fresh report over a channel, so
//! the state is never shared behind a lock.

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use tokio::sync::{mpsc, oneshot};

use crate::status::{prometheus_text, StatusReport};

/// A request for the current [`StatusReport`], answered by the state task.
pub(crate) type StatusRequest = oneshot::Sender<StatusReport>;

/// Content type of the Prometheus text exposition format.
const PROMETHEUS_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

#[derive(Clone)]
struct AppState {
    requests: mpsc::Sender<StatusRequest>,
}

/// The router serving `/status`, `/metrics` and `/healthz`.
pub(crate) fn router(requests: mpsc::Sender<StatusRequest>) -> Router {
    Router::new()
        .route("/status", get(status))
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok\n" }))
        .with_state(AppState { requests })
}

async fn current_report(app: &AppState) -> Result<StatusReport, Response> {
    let (reply, answer) = oneshot::channel();
    let unavailable = || {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "the coordinator is shutting down\n",
        )
            .into_response()
    };
    app.requests.send(reply).await.map_err(|_| unavailable())?;
    answer.await.map_err(|_| unavailable())
}

async fn status(State(app): State<AppState>) -> Response {
    match current_report(&app).await {
        Ok(report) => Json(report).into_response(),
        Err(response) => response,
    }
}

async fn metrics(State(app): State<AppState>) -> Response {
    match current_report(&app).await {
        Ok(report) => (
            [(header::CONTENT_TYPE, PROMETHEUS_CONTENT_TYPE)],
            prometheus_text(&report),
        )
            .into_response(),
        Err(response) => response,
    }
}
