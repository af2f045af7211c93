//! Outbox operations: list, retry dead letters, abandon.

use axum::extract::State;
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::AppState;
use super::extract::{Path, Query};
use super::ids::{parse_project, parse_type};
use super::page::Page;
use super::problem::{ApiError, Problem, db_error};
use crate::auth::Caller;
use crate::documents::outbox::{self, DocumentStatus, DocumentView, ListFilter, TransitionError};

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
    /// `next_cursor` of the previous page.
    #[param(pattern = r"^[0-9]{1,18}$")]
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
    let page = Page::with_limit(limit, query.cursor.as_deref(), |c| c.parse::<i64>().ok())?;
    let documents = outbox::list(
        &state.db,
        &ListFilter {
            status: query.status,
            projects: caller.projects(),
            project: query.project.as_deref(),
            doc_type: query.doc_type.as_deref(),
            after_row: page.after.unwrap_or(0),
            limit: page.limit,
        },
    )
    .await
    .map_err(db_error)?;
    let next_cursor = page.next_cursor(&documents, |d| d.row_id.to_string());
    Ok(axum::Json(OutboxPage {
        documents,
        next_cursor,
    }))
}

fn transition_error(e: TransitionError) -> ApiError {
    match e {
        TransitionError::NotFound(_) => ApiError::not_found("document_not_found", e.to_string()),
        TransitionError::NotAllowed {
            action: "retry", ..
        } => ApiError::conflict("not_retryable", e.to_string()),
        TransitionError::NotAllowed { .. } => ApiError::conflict("not_abandonable", e.to_string()),
        TransitionError::Db(e) => db_error(e),
    }
}

/// Put a dead letter back to `pending` with its retry count reset.
#[utoipa::path(
    post,
    path = "/api/v1/outbox/{id}/retry",
    tag = "outbox",
    params(("id" = String, Path, description = "The document ID (percent-encoded)", min_length = 1, max_length = 64)),
    responses(
        (status = 200, description = "Back to pending, retry count reset", body = DocumentView),
        (status = 404, description = "No such document", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "Not a dead letter (or abandoned)", body = Problem, content_type = "application/problem+json"),
    )
)]
#[tracing::instrument(skip_all, level = "debug")]
pub async fn retry_document(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<axum::Json<DocumentView>, ApiError> {
    outbox::retry(&state.db, &id, caller.projects())
        .await
        .map(axum::Json)
        .map_err(transition_error)
}

/// Give up on a document; its number becomes a gap with reason `abandoned`.
#[utoipa::path(
    post,
    path = "/api/v1/outbox/{id}/abandon",
    tag = "outbox",
    params(("id" = String, Path, description = "The document ID (percent-encoded)", min_length = 1, max_length = 64)),
    responses(
        (status = 200, description = "Abandoned: its number is a gap", body = DocumentView),
        (status = 404, description = "No such document", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "Already committed", body = Problem, content_type = "application/problem+json"),
    )
)]
#[tracing::instrument(skip_all, level = "debug")]
pub async fn abandon_document(
    State(state): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<axum::Json<DocumentView>, ApiError> {
    outbox::abandon(&state.db, &id, caller.projects())
        .await
        .map(axum::Json)
        .map_err(transition_error)
}
