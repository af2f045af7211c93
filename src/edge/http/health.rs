//! `GET /healthz`, `GET /readyz`, `GET /metrics`.

use std::time::Duration;

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::IntoResponse;
use serde::Serialize;
use utoipa::ToSchema;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::AppState;
use crate::infra::coalesce::Coalesced;
use bytes::Bytes;

#[derive(Debug, Serialize, ToSchema)]
pub struct Health {
    #[schema(example = "ok")]
    pub status: &'static str,
}

#[derive(Debug, Clone, Copy, Serialize, ToSchema, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Dependency {
    Up,
    Down,
    /// Postgres answers but takes no writes (a standby, a demoted
    /// primary): nothing can be issued or written.
    ReadOnly,
}

#[derive(Debug, Clone, Copy, Serialize, ToSchema, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Numbers come from Redis pools.
    Pool,
    /// Redis is down or being checked; numbers come from Postgres.
    Fallback,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct Readiness {
    pub postgres: Dependency,
    pub redis: Dependency,
    pub mode: Mode,
}

pub fn router() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(healthz))
        .routes(routes!(readyz))
        .routes(routes!(metrics))
}

/// The process is up (no dependency is checked).
#[utoipa::path(get, path = "/healthz", tag = "operations", responses((status = 200, description = "The process is up", body = Health)))]
#[tracing::instrument(skip_all, level = "debug")]
pub async fn healthz() -> axum::Json<Health> {
    axum::Json(Health { status: "ok" })
}

/// Whether this instance can serve: 200 while Postgres answers and takes
/// writes (IDs are served without Redis), 503 when it does not answer or
/// is read-only (`"postgres": "read_only"`: a standby, a demoted primary).
#[utoipa::path(
    get,
    path = "/readyz",
    tag = "operations",
    responses((status = 200, description = "Postgres answers and takes writes: IDs can be served", body = Readiness), (status = 503, description = "Postgres does not answer, or is read-only", body = Readiness))
)]
#[tracing::instrument(skip_all, level = "debug")]
pub async fn readyz(State(state): State<AppState>) -> (StatusCode, axum::Json<Readiness>) {
    // Anyone may ask, as often as they like: one probe serves everyone
    // who asked meanwhile, so asking costs the pools nothing more.
    let (status, readiness) = state.probes.readiness.get(|| probe(&state)).await;
    (status, axum::Json(readiness))
}

/// Probes Postgres and Redis once.
async fn probe(state: &AppState) -> (StatusCode, Readiness) {
    // A standby answers queries too: readiness means writable.
    let postgres = tokio::time::timeout(
        Duration::from_secs(1),
        sqlx::query_scalar!(
            r#"SELECT pg_is_in_recovery() OR current_setting('transaction_read_only') = 'on' AS "read_only!""#
        )
        .fetch_one(&state.db),
    )
    .await;
    let postgres = match postgres {
        Ok(Ok(false)) => Dependency::Up,
        Ok(Ok(true)) => {
            crate::infra::db::distrust_open_connections();
            Dependency::ReadOnly
        }
        _ => Dependency::Down,
    };
    let pools_in_use = state.pools.in_use();
    let redis = if state.pools.redis_answers().await {
        Dependency::Up
    } else {
        Dependency::Down
    };
    let status = if postgres == Dependency::Up {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    state
        .stats
        .set_readiness(postgres == Dependency::Up, postgres == Dependency::ReadOnly);
    let mode = if pools_in_use {
        Mode::Pool
    } else {
        Mode::Fallback
    };
    (
        status,
        Readiness {
            postgres,
            redis,
            mode,
        },
    )
}

/// What an instance answers while it waits for Postgres to take writes
/// before it migrates (see `startup`): it is up, not ready, and serves
/// nothing else yet.
pub fn not_ready_app() -> axum::Router {
    let not_ready = Readiness {
        postgres: Dependency::ReadOnly,
        redis: Dependency::Down,
        mode: Mode::Fallback,
    };
    axum::Router::new()
        .route("/healthz", axum::routing::get(healthz))
        .route(
            "/readyz",
            axum::routing::get(move || async move {
                (StatusCode::SERVICE_UNAVAILABLE, axum::Json(not_ready))
            }),
        )
        .fallback(|| async {
            super::problem::ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "unavailable",
                "starting: Postgres takes no writes yet (a standby, or a failover under way)",
            )
            .with_header(
                header::RETRY_AFTER,
                axum::http::HeaderValue::from_static("1"),
            )
        })
}

/// Counters of this instance in Prometheus text format.
#[utoipa::path(
    get,
    path = "/metrics",
    tag = "operations",
    responses((status = 200, description = "Prometheus text format", content_type = "text/plain; version=0.0.4", body = String))
)]
#[tracing::instrument(skip_all, level = "debug")]
pub async fn metrics(State(state): State<AppState>, headers: HeaderMap) -> impl IntoResponse {
    // The text is OpenMetrics, which Prometheus reads under either name; a
    // scraper that asks for OpenMetrics is told so.
    let asks_openmetrics = headers
        .get_all(header::ACCEPT)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .any(|v| v.contains("application/openmetrics-text"));
    let content_type = if asks_openmetrics {
        "application/openmetrics-text; version=1.0.0; charset=utf-8"
    } else {
        "text/plain; version=0.0.4"
    };
    let text = state
        .probes
        .metrics
        .get(|| async {
            // Readiness is part of what is scraped (alerts read it); the
            // probe is shared with /readyz callers.
            state.probes.readiness.get(|| probe(&state)).await;
            Bytes::from(state.stats.render(state.pools.in_use()))
        })
        .await;
    ([(header::CONTENT_TYPE, content_type)], text)
}

/// What anyone may ask for, shared by everyone who asks at once.
pub struct Probes {
    pub readiness: Coalesced<(StatusCode, Readiness)>,
    pub metrics: Coalesced<Bytes>,
}

impl Default for Probes {
    fn default() -> Self {
        Self {
            readiness: Coalesced::new(Duration::from_millis(25)),
            metrics: Coalesced::new(Duration::from_millis(100)),
        }
    }
}
