//! Outbox operations: list, retry dead letters, abandon.

use axum::extract::State;
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::AppState;
use super::extract::{OptionalJson, Path, Query};
use super::ids::{parse_project, parse_type};
use super::page::Page;
use super::problem::{ApiError, Problem, db_error};
use super::responses::NoSuchDocument;
use crate::features::documents::delivery_queue::{
    self, DocumentStatus, DocumentView, ListError, ListFilter, TransitionError,
};
use crate::records::auth::Caller;

/// The outbox's cursor: the document a page ended with, encoded. It names
/// only the caller's own document (no row number or count that would
/// tell another tenant's volume), and is refused unless the caller may see
/// that document.
mod cursor {
    use base64::Engine as _;

    const ENGINE: base64::engine::GeneralPurpose = base64::engine::general_purpose::URL_SAFE_NO_PAD;

    pub fn after(document_id: &str) -> String {
        ENGINE.encode(document_id)
    }

    /// A cursor of the documented form (it may still name no document).
    pub fn well_formed(cursor: &str) -> Option<String> {
        let ok = (1..=344).contains(&cursor.len())
            && cursor
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
        ok.then(|| cursor.to_owned())
    }

    /// The document a well-formed cursor names, if it names one at all.
    pub fn document_of(cursor: &str) -> Option<String> {
        let bytes = ENGINE.decode(cursor).ok()?;
        let id = String::from_utf8(bytes).ok()?;
        let fits = (1..=crate::domain::sequence::MAX_ID_LEN).contains(&id.chars().count())
            && !id.chars().any(char::is_control);
        fits.then_some(id)
    }
}

#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct OutboxQuery {
    /// Only documents with this status (all when left out).
    pub status: Option<DocumentStatus>,
    /// Only this project's documents.
    #[param(pattern = r"^[A-Za-z0-9_]{1,32}$", min_length = 1, max_length = 32)]
    pub project: Option<String>,
    /// Only this document type's documents.
    #[serde(rename = "type")]
    #[param(
        rename = "type",
        pattern = r"^[A-Za-z0-9_]{1,32}$",
        min_length = 1,
        max_length = 32
    )]
    pub doc_type: Option<String>,
    /// Page size, 1 to 1000 (default 100).
    #[param(minimum = 1, maximum = 1000)]
    pub limit: Option<i64>,
    /// `next_cursor` of the previous page (opaque).
    #[param(pattern = r"^[A-Za-z0-9_-]{1,344}$", min_length = 1, max_length = 344)]
    pub cursor: Option<String>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct OutboxPage {
    pub documents: Vec<DocumentView>,
    /// Pass as `cursor` for the next page; null on the last page.
    pub next_cursor: Option<String>,
}

pub fn router() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(list_outbox))
        .routes(routes!(retry_document))
        .routes(routes!(abandon_document))
}

/// List outbox entries (dead letters with `status=dead_letter`).
#[utoipa::path(
    get,
    path = "/api/v1/outbox",
    tag = "outbox",
    params(OutboxQuery),
    responses(
        (status = 200, description = "One page of outbox entries", body = OutboxPage),
        (status = 400, description = "Invalid filter, limit or cursor", body = Problem, content_type = "application/problem+json"),
        (status = 422, description = "unknown_cursor: the cursor names no document this key can list", body = Problem, content_type = "application/problem+json"),
    )
)]
#[tracing::instrument(skip_all, level = "debug")]
pub async fn list_outbox(
    State(state): State<AppState>,
    caller: Caller,
    Query(query): Query<OutboxQuery>,
) -> Result<axum::Json<OutboxPage>, ApiError> {
    let limit = Page::<i64>::limit(query.limit)?;
    // Filters name codes: anything else is no code, and said so.
    if let Some(project) = &query.project {
        parse_project(project)?;
    }
    if let Some(doc_type) = &query.doc_type {
        parse_type(doc_type)?;
    }
    let page = Page::with_limit(limit, query.cursor.as_deref(), cursor::well_formed)?;
    // A cursor of the right form that names no document this key can see
    // (made up, or another tenant's) is refused alike.
    let after = match &page.after {
        None => None,
        Some(cursor) => Some(cursor::document_of(cursor).ok_or_else(unknown_cursor)?),
    };
    let listed = state
        .auth
        .rows()
        .charged(&caller, page.limit as usize, async {
            let _turn = state.db_turn(&caller).await;
            delivery_queue::list(
                &state.db,
                &ListFilter {
                    status: query.status,
                    projects: caller.projects(),
                    project: query.project.as_deref(),
                    doc_type: query.doc_type.as_deref(),
                    after: after.as_deref(),
                    limit: page.limit,
                },
            )
            .await
        });
    let documents = listed.await.map_err(|e| match e {
        ListError::Cursor => unknown_cursor(),
        ListError::Db(e) => db_error(e),
    })?;
    let next_cursor = page.next_cursor(&documents, |d| cursor::after(&d.id));
    Ok(axum::Json(OutboxPage {
        documents,
        next_cursor,
    }))
}

fn unknown_cursor() -> ApiError {
    ApiError::new(
        axum::http::StatusCode::UNPROCESSABLE_ENTITY,
        "unknown_cursor",
        "the cursor names no document this key can list; start without a cursor",
    )
}

fn transition_error(e: TransitionError) -> ApiError {
    match e {
        TransitionError::NotFound(_) => ApiError::not_found("document_not_found", e.to_string()),
        TransitionError::NotAllowed {
            action: "retry", ..
        } => ApiError::conflict("not_retryable", e.to_string()),
        TransitionError::NotAllowed { .. } => ApiError::conflict("not_abandonable", e.to_string()),
        TransitionError::InFlight { until, .. } => {
            // Whole seconds until the claim ends, at least one.
            let wait = (until - chrono::Utc::now()).num_milliseconds().max(0) / 1000 + 1;
            ApiError::conflict("delivery_in_flight", e.to_string()).with_header(
                axum::http::header::RETRY_AFTER,
                axum::http::HeaderValue::from(wait),
            )
        }
        TransitionError::Db(e) => db_error(e),
    }
}

/// Optional body of retry and abandon: one endpoint's delivery only.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct DeliveryChoice {
    /// Only this endpoint's delivery of the document (every endpoint's
    /// when left out).
    pub endpoint_id: Option<String>,
}

/// Applies a retry or an abandon: to the deliveries of a document routed
/// to endpoints, else to the document's delivery to the sink.
async fn transition(
    state: &AppState,
    caller: &Caller,
    id: &str,
    choice: Option<DeliveryChoice>,
    retry: bool,
) -> Result<DocumentView, ApiError> {
    let endpoint_id = choice.and_then(|c| c.endpoint_id);
    let _turn = state.db_turn(caller).await;
    let routed = crate::features::endpoints::deliveries::transition_routed(
        &state.db,
        id,
        caller.projects(),
        endpoint_id.as_deref(),
        retry,
    )
    .await
    .map_err(transition_error)?;
    if let Some(view) = routed {
        return Ok(view);
    }
    let sink = match retry {
        true => delivery_queue::retry(&state.db, id, caller.projects()).await,
        false => delivery_queue::abandon(&state.db, id, caller.projects()).await,
    };
    sink.map_err(transition_error)
}

/// Put a dead letter back to `pending` with its retry count reset.
#[utoipa::path(
    post,
    path = "/api/v1/outbox/{id}/retry",
    tag = "outbox",
    params(("id" = String, Path, description = "The document ID (percent-encoded)", min_length = 1, max_length = 64, pattern = r"^[^\u0000]*$")),
    request_body(content = Option<DeliveryChoice>, description = "Optional: one endpoint's delivery only"),
    responses(
        (status = 200, description = "Back to pending, retry count reset", body = DocumentView),
        (status = 400, description = "invalid_body: the optional body holds other than endpoint_id", body = Problem, content_type = "application/problem+json"),
        NoSuchDocument,
        (status = 409, description = "Not a dead letter (or abandoned)", body = Problem, content_type = "application/problem+json"),
    )
)]
#[tracing::instrument(skip_all, level = "debug")]
pub async fn retry_document(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    OptionalJson(choice): OptionalJson<DeliveryChoice>,
) -> Result<axum::Json<DocumentView>, ApiError> {
    transition(&state, &caller, &id, choice, true)
        .await
        .map(axum::Json)
}

/// Give up on a document; its number becomes a gap with reason `abandoned`.
#[utoipa::path(
    post,
    path = "/api/v1/outbox/{id}/abandon",
    tag = "outbox",
    params(("id" = String, Path, description = "The document ID (percent-encoded)", min_length = 1, max_length = 64, pattern = r"^[^\u0000]*$")),
    request_body(content = Option<DeliveryChoice>, description = "Optional: one endpoint's delivery only"),
    responses(
        (status = 200, description = "Abandoned: its number is a gap", body = DocumentView),
        (status = 400, description = "invalid_body: the optional body holds other than endpoint_id", body = Problem, content_type = "application/problem+json"),
        NoSuchDocument,
        (status = 409, description = "not_abandonable: already committed; delivery_in_flight: an attempt is under way, whose outcome would contradict the answer (nothing changed; try again after Retry-After)", body = Problem, content_type = "application/problem+json",
         headers(("Retry-After" = u64, description = "delivery_in_flight: seconds until the attempt's claim ends"))),
    )
)]
#[tracing::instrument(skip_all, level = "debug")]
pub async fn abandon_document(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    OptionalJson(choice): OptionalJson<DeliveryChoice>,
) -> Result<axum::Json<DocumentView>, ApiError> {
    transition(&state, &caller, &id, choice, false)
        .await
        .map(axum::Json)
}
