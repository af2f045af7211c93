//! The one layer that authenticates every protected route, and what
//! handlers use to stay inside the caller's projects.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{FromRequestParts, Request};
use axum::http::request::Parts;
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::conn_guard::{Activity, Holding};
use super::problem::ApiError;
use crate::infra::fair::FairSlots;
use crate::records::auth::{Authenticator, Caller, Rejected, Verdict};

/// Every route but `/healthz`, `/readyz`, `/metrics`, `/openapi.json`,
/// `/docs` (SPEC "Security") and the registers' public key (anyone may
/// check a signature).
pub fn is_protected(path: &str) -> bool {
    (path == "/ids" || path == "/documents" || path == "/api/v1" || path.starts_with("/api/v1/"))
        && path != "/api/v1/registers/public-key"
}

pub async fn authenticate(
    auth: Arc<Authenticator>,
    in_flight: Arc<FairSlots>,
    mut req: Request,
    next: Next,
) -> Response {
    if !is_protected(req.uri().path()) {
        return next.run(req).await;
    }
    let authorization = req
        .headers()
        .get(header::AUTHORIZATION)
        .map(HeaderValue::as_bytes);
    match auth.check(authorization).await {
        Verdict::Allowed(caller) => {
            tracing::Span::current().record("key_id", caller.id());
            if let Some(connection) = req.extensions().get::<Arc<Activity>>() {
                connection.carried_key(caller.id());
            }
            // A key's requests in flight, answers still being sent
            // included, are capped: what it holds of the instance (memory,
            // tasks, answers' buffers) is bounded whatever it sends. Its
            // further requests wait for its own turns (within the request
            // timeout), never for another key's.
            let turn = in_flight.acquire(caller.id()).await;
            req.extensions_mut().insert(caller);
            let response = next.run(req).await;
            response.map(|body| Body::new(Holding::new(body, turn)))
        }
        Verdict::Missing => unauthorized(
            "send the API key as Authorization: Bearer <key>",
            "Bearer realm=\"idpool\"",
        ),
        Verdict::Rejected(Rejected::Invalid) => unauthorized(
            "the API key is not valid or was revoked",
            "Bearer realm=\"idpool\", error=\"invalid_token\"",
        ),
        Verdict::Rejected(Rejected::Db(e)) => super::problem::db_error(e).into_response(),
        Verdict::Limited(wait) => {
            let seconds = wait.as_secs() + u64::from(wait.subsec_nanos() > 0);
            ApiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                "rate_limited",
                "this API key sent more requests than its rate allows; slow down",
            )
            .with_header(header::RETRY_AFTER, HeaderValue::from(seconds.max(1)))
            .into_response()
        }
    }
}

fn unauthorized(detail: &'static str, challenge: &'static str) -> Response {
    ApiError::new(StatusCode::UNAUTHORIZED, "unauthorized", detail)
        .with_header(
            header::WWW_AUTHENTICATE,
            HeaderValue::from_static(challenge),
        )
        .into_response()
}

impl<S: Send + Sync> FromRequestParts<S> for Caller {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, ApiError> {
        parts.extensions.get::<Caller>().cloned().ok_or_else(|| {
            ApiError::new(
                StatusCode::UNAUTHORIZED,
                "unauthorized",
                "send the API key as Authorization: Bearer <key>",
            )
        })
    }
}

/// Outside its projects a key meets what a project that does not exist
/// would answer: the same for every such project, existing or not.
pub fn within_scope(caller: &Caller, project: &str) -> Result<(), ApiError> {
    if caller.may_use(project) {
        Ok(())
    } else {
        Err(project_not_found(project))
    }
}

pub fn project_not_found(project: &str) -> ApiError {
    ApiError::not_found(
        "project_not_found",
        format!("project {project} does not exist or is not open to this key"),
    )
}

/// Admin keys only (defining sequences, reconciling).
pub fn require_admin(caller: &Caller) -> Result<(), ApiError> {
    if caller.is_admin() {
        Ok(())
    } else {
        Err(ApiError::new(
            StatusCode::FORBIDDEN,
            "forbidden",
            "this operation needs an admin key",
        ))
    }
}
