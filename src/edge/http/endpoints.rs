//! A project's own delivery endpoints: create, list, read, change,
//! delete, rotate the secret, and read the attempts; a document's
//! deliveries.

use axum::extract::State;
use axum::http::StatusCode;
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::AppState;
use super::auth::within_scope;
use super::extract::{Json, Path, Query};
use super::ids::parse_project;
use super::page::Page;
use super::problem::{ApiError, Problem, db_error};
use super::responses::{JsonBodyProblems, NoSuchDocument};
use crate::features::endpoints::deliveries::{self, AttemptView, DeliveryView};
use crate::features::endpoints::{
    CreatedEndpoint, Endpoint, EndpointError, EndpointPatch, NewEndpoint, RotatedSecret, store,
};
use crate::records::auth::Caller;

pub fn router() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(create_endpoint, list_endpoints))
        .routes(routes!(get_endpoint, update_endpoint, delete_endpoint))
        .routes(routes!(rotate_secret))
        .routes(routes!(list_attempts))
        .routes(routes!(document_deliveries))
}

fn endpoint_error(e: EndpointError) -> ApiError {
    match e {
        EndpointError::NotFound(_) => no_such_endpoint(),
        EndpointError::LimitReached(_) => {
            ApiError::conflict("endpoint_limit_reached", e.to_string())
        }
        EndpointError::InvalidUrl(refused) => {
            ApiError::bad_request("invalid_endpoint_url", format!("url: {refused}"))
        }
        EndpointError::Invalid(detail) => ApiError::bad_request("invalid_endpoint", detail),
        EndpointError::RotationPending(_) => {
            ApiError::conflict("secret_rotation_pending", e.to_string())
        }
        EndpointError::Db(e) => db_error(e),
    }
}

/// A cursor of the documented form that names nothing this key can list.
fn unknown_cursor() -> ApiError {
    ApiError::new(
        StatusCode::UNPROCESSABLE_ENTITY,
        "unknown_cursor",
        "the cursor names nothing this key can list; start without a cursor",
    )
}

/// Another project's endpoint answers as one that does not exist.
fn no_such_endpoint() -> ApiError {
    ApiError::not_found(
        "endpoint_not_found",
        "no such endpoint, or not open to this key",
    )
}

/// An endpoint id is `ep_` and 24 hex digits; anything else names none.
fn well_formed_id(id: &str) -> bool {
    id.len() == 27 && id.starts_with("ep_") && id[3..].bytes().all(|b| b.is_ascii_hexdigit())
}

/// A path's endpoint id, refused as no endpoint when it is not of the
/// form ids have.
fn named_endpoint(id: &str) -> Result<(), ApiError> {
    match well_formed_id(id) {
        true => Ok(()),
        false => Err(no_such_endpoint()),
    }
}

/// Register an endpoint for a project's documents.
#[utoipa::path(
    post,
    path = "/api/v1/endpoints",
    tag = "endpoints",
    request_body = NewEndpoint,
    responses(
        (status = 201, description = "Created; the secret is shown only here", body = CreatedEndpoint),
        (status = 400, description = "invalid_endpoint_url (scheme, form, or an address that is not public), invalid_endpoint, invalid_project", body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "project_not_found: the project is not open to this key", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "endpoint_limit_reached", body = Problem, content_type = "application/problem+json"),
        JsonBodyProblems,
    )
)]
#[tracing::instrument(skip_all, level = "debug")]
pub async fn create_endpoint(
    State(state): State<AppState>,
    caller: Caller,
    Json(body): Json<NewEndpoint>,
) -> Result<(StatusCode, axum::Json<CreatedEndpoint>), ApiError> {
    parse_project(&body.project)?;
    within_scope(&caller, &body.project)?;
    let url = state
        .endpoints
        .checked_url(&body.url)
        .await
        .map_err(endpoint_error)?;
    let _turn = state.db_turn(&caller).await;
    let created = state
        .endpoints
        .create(&body, &url)
        .await
        .map_err(endpoint_error)?;
    Ok((StatusCode::CREATED, axum::Json(created)))
}

#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct EndpointsQuery {
    /// The project whose endpoints to list.
    #[param(pattern = r"^[A-Za-z0-9_]{1,32}$", min_length = 1, max_length = 32)]
    pub project: String,
    /// Page size, 1 to 1000 (default 100).
    #[param(minimum = 1, maximum = 1000)]
    pub limit: Option<i64>,
    /// `next_cursor` of the previous page (opaque).
    #[param(pattern = r"^ep_[0-9a-f]{24}$")]
    pub cursor: Option<String>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct EndpointPage {
    pub endpoints: Vec<Endpoint>,
    /// Pass as `cursor` for the next page; null on the last page.
    pub next_cursor: Option<String>,
}

/// List a project's endpoints (no secrets), in the order they were made.
#[utoipa::path(
    get,
    path = "/api/v1/endpoints",
    tag = "endpoints",
    params(EndpointsQuery),
    responses(
        (status = 200, description = "One page of endpoints", body = EndpointPage),
        (status = 400, description = "Invalid project, limit or cursor", body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "project_not_found: the project is not open to this key", body = Problem, content_type = "application/problem+json"),
        (status = 422, description = "unknown_cursor: the cursor names no endpoint of the project", body = Problem, content_type = "application/problem+json"),
    )
)]
#[tracing::instrument(skip_all, level = "debug")]
pub async fn list_endpoints(
    State(state): State<AppState>,
    caller: Caller,
    Query(query): Query<EndpointsQuery>,
) -> Result<axum::Json<EndpointPage>, ApiError> {
    parse_project(&query.project)?;
    within_scope(&caller, &query.project)?;
    let page = Page::parse(query.limit, query.cursor.as_deref(), |c| {
        well_formed_id(c).then_some(c)
    })?;
    let _turn = state.db_turn(&caller).await;
    let db = state.endpoints.db();
    if let Some(after) = page.after
        && !store::belongs(db, after, &query.project)
            .await
            .map_err(db_error)?
    {
        return Err(unknown_cursor());
    }
    let endpoints = store::list(db, &query.project, page.after, page.limit)
        .await
        .map_err(db_error)?;
    let next_cursor = page.next_cursor(&endpoints, |e| e.id.clone());
    Ok(axum::Json(EndpointPage {
        endpoints,
        next_cursor,
    }))
}

const ID_PARAM: &str = "The endpoint's id";

/// Read an endpoint (no secrets).
#[utoipa::path(
    get,
    path = "/api/v1/endpoints/{id}",
    tag = "endpoints",
    params(("id" = String, Path, description = ID_PARAM, pattern = r"^ep_[0-9a-f]{24}$")),
    responses(
        (status = 200, description = "The endpoint", body = Endpoint),
        (status = 404, description = "endpoint_not_found", body = Problem, content_type = "application/problem+json"),
    )
)]
#[tracing::instrument(skip_all, level = "debug")]
pub async fn get_endpoint(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<axum::Json<Endpoint>, ApiError> {
    named_endpoint(&id)?;
    let _turn = state.db_turn(&caller).await;
    store::find(state.endpoints.db(), &id, caller.projects())
        .await
        .map_err(db_error)?
        .map(axum::Json)
        .ok_or_else(no_such_endpoint)
}

/// Change an endpoint: URL, description, types, disabled.
#[utoipa::path(
    patch,
    path = "/api/v1/endpoints/{id}",
    tag = "endpoints",
    params(("id" = String, Path, description = ID_PARAM, pattern = r"^ep_[0-9a-f]{24}$")),
    request_body = EndpointPatch,
    responses(
        (status = 200, description = "Changed", body = Endpoint),
        (status = 400, description = "invalid_endpoint_url, invalid_endpoint", body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "endpoint_not_found", body = Problem, content_type = "application/problem+json"),
        JsonBodyProblems,
    )
)]
#[tracing::instrument(skip_all, level = "debug")]
pub async fn update_endpoint(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    Json(mut patch): Json<EndpointPatch>,
) -> Result<axum::Json<Endpoint>, ApiError> {
    named_endpoint(&id)?;
    if let Some(url) = &patch.url {
        let checked = state
            .endpoints
            .checked_url(url)
            .await
            .map_err(endpoint_error)?;
        patch.url = Some(checked.to_string());
    }
    let _turn = state.db_turn(&caller).await;
    state
        .endpoints
        .update(&id, caller.projects(), patch)
        .await
        .map(axum::Json)
        .map_err(endpoint_error)
}

/// Delete an endpoint; its undelivered documents are abandoned for it.
#[utoipa::path(
    delete,
    path = "/api/v1/endpoints/{id}",
    tag = "endpoints",
    params(("id" = String, Path, description = ID_PARAM, pattern = r"^ep_[0-9a-f]{24}$")),
    responses(
        (status = 204, description = "Deleted"),
        (status = 404, description = "endpoint_not_found", body = Problem, content_type = "application/problem+json"),
    )
)]
#[tracing::instrument(skip_all, level = "debug")]
pub async fn delete_endpoint(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<StatusCode, ApiError> {
    named_endpoint(&id)?;
    let _turn = state.db_turn(&caller).await;
    match store::delete(state.endpoints.db(), &id, caller.projects()).await {
        Ok(true) => Ok(StatusCode::NO_CONTENT),
        Ok(false) => Err(no_such_endpoint()),
        Err(e) => Err(db_error(e)),
    }
}

/// Make a new signing secret; the previous one signs too until
/// `previous_expires_at` (`IDPOOL_SECRET_OVERLAP_S`).
#[utoipa::path(
    post,
    path = "/api/v1/endpoints/{id}/rotate-secret",
    tag = "endpoints",
    params(("id" = String, Path, description = ID_PARAM, pattern = r"^ep_[0-9a-f]{24}$")),
    responses(
        (status = 200, description = "The new secret, shown only here", body = RotatedSecret),
        (status = 404, description = "endpoint_not_found", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "secret_rotation_pending: the secret rotated out last still signs (until the time the detail names); nothing changed", body = Problem, content_type = "application/problem+json"),
    )
)]
#[tracing::instrument(skip_all, level = "debug")]
pub async fn rotate_secret(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<axum::Json<RotatedSecret>, ApiError> {
    named_endpoint(&id)?;
    let _turn = state.db_turn(&caller).await;
    state
        .endpoints
        .rotate_secret(&id, caller.projects())
        .await
        .map(axum::Json)
        .map_err(endpoint_error)
}

/// The attempts cursor: an attempt's time (microseconds) and document,
/// both the tenant's own.
mod cursor {
    use base64::Engine as _;
    use chrono::{DateTime, Utc};
    const ENGINE: base64::engine::GeneralPurpose = base64::engine::general_purpose::URL_SAFE_NO_PAD;

    pub fn after(at: DateTime<Utc>, document_id: &str) -> String {
        ENGINE.encode(format!("{}:{document_id}", at.timestamp_micros()))
    }

    /// A cursor of the documented form (it may still name nothing).
    pub fn well_formed(cursor: &str) -> Option<&str> {
        let ok = (1..=400).contains(&cursor.len())
            && cursor
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
        ok.then_some(cursor)
    }

    pub fn read(cursor: &str) -> Option<(DateTime<Utc>, String)> {
        let text = String::from_utf8(ENGINE.decode(cursor).ok()?).ok()?;
        let (micros, document) = text.split_once(':')?;
        let at = DateTime::<Utc>::from_timestamp_micros(micros.parse().ok()?)?;
        let fits = (1..=crate::domain::sequence::MAX_ID_LEN).contains(&document.chars().count())
            && !document.chars().any(char::is_control);
        fits.then(|| (at, document.to_owned()))
    }
}

#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct AttemptsQuery {
    /// Page size, 1 to 1000 (default 100).
    #[param(minimum = 1, maximum = 1000)]
    pub limit: Option<i64>,
    /// `next_cursor` of the previous page (opaque).
    #[param(pattern = r"^[A-Za-z0-9_-]{1,400}$", max_length = 400)]
    pub cursor: Option<String>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct AttemptPage {
    pub attempts: Vec<AttemptView>,
    /// Pass as `cursor` for the next page; null on the last page.
    pub next_cursor: Option<String>,
}

/// An endpoint's delivery attempts, newest first.
#[utoipa::path(
    get,
    path = "/api/v1/endpoints/{id}/attempts",
    tag = "endpoints",
    params(("id" = String, Path, description = ID_PARAM, pattern = r"^ep_[0-9a-f]{24}$"), AttemptsQuery),
    responses(
        (status = 200, description = "One page of attempts", body = AttemptPage),
        (status = 400, description = "Invalid limit or cursor", body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "endpoint_not_found", body = Problem, content_type = "application/problem+json"),
        (status = 422, description = "unknown_cursor: the cursor is of the documented form but not one this API returned", body = Problem, content_type = "application/problem+json"),
    )
)]
#[tracing::instrument(skip_all, level = "debug")]
pub async fn list_attempts(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    Query(query): Query<AttemptsQuery>,
) -> Result<axum::Json<AttemptPage>, ApiError> {
    named_endpoint(&id)?;
    let page = Page::parse(query.limit, query.cursor.as_deref(), cursor::well_formed)?;
    let after = match &page.after {
        None => None,
        Some(cursor) => Some(cursor::read(cursor).ok_or_else(unknown_cursor)?),
    };
    let _turn = state.db_turn(&caller).await;
    let db = state.endpoints.db();
    store::find(db, &id, caller.projects())
        .await
        .map_err(db_error)?
        .ok_or_else(no_such_endpoint)?;
    let after = after.as_ref().map(|(at, doc)| (*at, doc.as_str()));
    let attempts = deliveries::attempts_of(db, &id, after, page.limit)
        .await
        .map_err(db_error)?;
    let next_cursor =
        page.next_cursor(&attempts, |a| cursor::after(a.attempted_at, &a.document_id));
    Ok(axum::Json(AttemptPage {
        attempts,
        next_cursor,
    }))
}

#[derive(Debug, Serialize, ToSchema)]
pub struct DocumentDeliveries {
    pub id: String,
    /// One per endpoint the document was routed to; empty for a document
    /// delivered to the installation's sink.
    pub deliveries: Vec<DeliveryView>,
}

/// A document's deliveries, per endpoint.
#[utoipa::path(
    get,
    path = "/api/v1/documents/{id}/deliveries",
    tag = "endpoints",
    params(("id" = String, Path, description = "The document ID (percent-encoded)", min_length = 1, max_length = 64, pattern = r"^[^\u0000]*$")),
    responses(
        (status = 200, description = "Its deliveries", body = DocumentDeliveries),
        NoSuchDocument,
    )
)]
#[tracing::instrument(skip_all, level = "debug")]
pub async fn document_deliveries(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<axum::Json<DocumentDeliveries>, ApiError> {
    let _turn = state.db_turn(&caller).await;
    let found = deliveries::of_document(state.endpoints.db(), &id, caller.projects())
        .await
        .map_err(db_error)?;
    let deliveries = found
        .ok_or_else(|| ApiError::not_found("document_not_found", format!("no document {id}")))?;
    Ok(axum::Json(DocumentDeliveries { id, deliveries }))
}
