//! Every error leaves as `application/problem+json` (RFC 9457) with a stable
//! `code`. Internal causes are logged, never sent.

use axum::Json;
use axum::extract::rejection::{JsonRejection, PathRejection, QueryRejection};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use utoipa::ToSchema;

use std::time::Duration;

use crate::features::documents::{BatchError, DocumentError};
use crate::infra::log_limit::{Repeated, Say};
use crate::issuance::IssueError;
use crate::records::idempotency::{ClaimError, IdempotencyKeyError};
use crate::records::ledger::LedgerError;
use crate::records::sequence_store::{PutError, StoreError};

/// An RFC 9457 problem document.
#[derive(Debug, Serialize, ToSchema)]
pub struct Problem {
    /// `urn:idpool:problem:<code>`.
    #[serde(rename = "type")]
    #[schema(example = "urn:idpool:problem:invalid_count")]
    pub problem_type: String,
    #[schema(example = "Bad Request")]
    pub title: String,
    #[schema(example = 400)]
    pub status: u16,
    #[schema(example = "count must be between 1 and 10000, got 0")]
    pub detail: String,
    /// Stable machine-readable error code.
    #[schema(example = "invalid_count")]
    pub code: String,
    /// For a batch: the index of the item at fault.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub index: Option<usize>,
}

#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    code: &'static str,
    detail: String,
    index: Option<usize>,
    headers: Vec<(header::HeaderName, HeaderValue)>,
}

impl ApiError {
    pub fn new(status: StatusCode, code: &'static str, detail: impl Into<String>) -> Self {
        Self {
            status,
            code,
            detail: detail.into(),
            index: None,
            headers: Vec::new(),
        }
    }

    /// Names the batch item at fault, in the detail and as `index`.
    pub fn at_index(mut self, index: usize) -> Self {
        self.detail = format!("documents[{index}]: {}", self.detail);
        self.index = Some(index);
        self
    }

    pub fn bad_request(code: &'static str, detail: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, code, detail)
    }

    pub fn not_found(code: &'static str, detail: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, code, detail)
    }

    pub fn conflict(code: &'static str, detail: impl Into<String>) -> Self {
        Self::new(StatusCode::CONFLICT, code, detail)
    }

    /// A failure of ours: logged with its cause (without flooding the log
    /// when many requests meet it), answered without it.
    pub fn internal(cause: impl std::fmt::Display) -> Self {
        static INTERNAL: Repeated = Repeated::every("internal error", Duration::from_secs(1));
        match INTERNAL.occurred() {
            Say::Started => tracing::error!(error = %cause, "internal error"),
            Say::Again(times) => tracing::error!(error = %cause, times, "internal error"),
            Say::Quiet => {}
        }
        Self::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal_error",
            "the server failed to handle this request; it was logged",
        )
    }

    /// A dependency we cannot do without (Postgres) is not answering:
    /// logged once when it starts, then with a count every 30 s.
    pub fn unavailable(cause: impl std::fmt::Display) -> Self {
        static UNAVAILABLE: Repeated = Repeated::new("dependency unavailable");
        match UNAVAILABLE.occurred() {
            Say::Started => tracing::error!(error = %cause, "dependency unavailable"),
            Say::Again(times) => tracing::error!(error = %cause, times, "dependency unavailable"),
            Say::Quiet => {}
        }
        Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "unavailable",
            "the database is not answering; retry shortly",
        )
        .with_header(header::RETRY_AFTER, HeaderValue::from_static("1"))
    }

    pub fn with_header(mut self, name: header::HeaderName, value: HeaderValue) -> Self {
        self.headers.push((name, value));
        self
    }

    pub fn status(&self) -> StatusCode {
        self.status
    }

    pub fn code(&self) -> &'static str {
        self.code
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = Problem {
            problem_type: format!("urn:idpool:problem:{}", self.code),
            title: self.status.canonical_reason().unwrap_or("Error").to_owned(),
            status: self.status.as_u16(),
            detail: self.detail,
            code: self.code.to_owned(),
            index: self.index,
        };
        let mut response = (self.status, Json(body)).into_response();
        response.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        for (name, value) in self.headers {
            response.headers_mut().insert(name, value);
        }
        response
    }
}

impl From<JsonRejection> for ApiError {
    fn from(rejection: JsonRejection) -> Self {
        match rejection {
            JsonRejection::MissingJsonContentType(_) => Self::new(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "unsupported_media_type",
                "send the body as JSON with Content-Type: application/json",
            ),
            JsonRejection::JsonSyntaxError(e) => Self::bad_request("invalid_json", e.body_text()),
            JsonRejection::JsonDataError(e) => Self::bad_request("invalid_body", e.body_text()),
            JsonRejection::BytesRejection(e) if e.status() == StatusCode::PAYLOAD_TOO_LARGE => {
                Self::new(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    "body_too_large",
                    "the request body is larger than this route accepts",
                )
            }
            other => Self::bad_request("invalid_body", other.body_text()),
        }
    }
}

impl From<QueryRejection> for ApiError {
    fn from(rejection: QueryRejection) -> Self {
        Self::bad_request("invalid_query", rejection.body_text())
    }
}

impl From<PathRejection> for ApiError {
    fn from(rejection: PathRejection) -> Self {
        Self::bad_request("invalid_path", rejection.body_text())
    }
}

impl From<StoreError> for ApiError {
    fn from(e: StoreError) -> Self {
        store_error(&e)
    }
}

fn store_error(e: &StoreError) -> ApiError {
    match e {
        StoreError::Db(db) => db_error(db),
        StoreError::Definition(d) => ApiError::bad_request("invalid_definition", d.to_string()),
        StoreError::Conflict { .. } => ApiError::conflict("format_conflict", e.to_string()),
        StoreError::TooMany { .. } => ApiError::conflict("sequence_limit_reached", e.to_string()),
        StoreError::NoDefault { .. } => ApiError::conflict("sequence_not_defined", e.to_string()),
        StoreError::Corrupt(..) => ApiError::internal(e),
        StoreError::Shared(inner) => store_error(inner),
    }
}

impl From<PutError> for ApiError {
    fn from(e: PutError) -> Self {
        match e {
            PutError::InUse
            | PutError::NumberingInUse
            | PutError::GaplessInUse
            | PutError::RegisterInUse
            | PutError::MaxDropped { .. } => Self::conflict("sequence_in_use", e.to_string()),
            PutError::Withdrawn => timed_out(),
            PutError::Store(e) => e.into(),
        }
    }
}

impl From<IssueError> for ApiError {
    fn from(e: IssueError) -> Self {
        match e {
            IssueError::Exhausted { .. } => Self::conflict("sequence_exhausted", e.to_string()),
            IssueError::Layout(e) => Self::conflict("layout_out_of_range", e.to_string()),
            IssueError::IdTooLong { .. } => Self::conflict("id_too_long", e.to_string()),
            IssueError::DefinitionChanged { .. } => Self::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "definition_changed",
                e.to_string(),
            )
            .with_header(header::RETRY_AFTER, HeaderValue::from_static("1")),
            IssueError::HeldBack { .. } => Self::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "unavailable",
                e.to_string(),
            )
            .with_header(header::RETRY_AFTER, HeaderValue::from_static("1")),
            IssueError::PostgresMoved => Self::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "postgres_failover",
                e.to_string(),
            )
            .with_header(header::RETRY_AFTER, HeaderValue::from_static("1")),
            IssueError::TooManyReservations { .. } => {
                Self::conflict("too_many_reservations", e.to_string())
            }
            IssueError::ReservationsNotAllowed { .. } => {
                Self::conflict("reservations_not_allowed", e.to_string())
            }
            IssueError::Store(e) => e.into(),
            IssueError::Ledger(e) => e.into(),
            IssueError::NotAnswered(e) => e.into(),
            IssueError::Counter(e) => db_error(e),
            IssueError::Interrupted(e) if e.is_cancelled() => Self::unavailable(e),
            IssueError::Interrupted(e) => Self::internal(e),
        }
    }
}

impl From<LedgerError> for ApiError {
    fn from(e: LedgerError) -> Self {
        match e {
            LedgerError::Unstorable(_) => Self::bad_request("unstorable_value", e.to_string()),
            LedgerError::DocumentIdTaken => Self::conflict("document_id_taken", e.to_string()),
            LedgerError::AlreadyAttached => Self::conflict("id_not_attachable", e.to_string()),
            LedgerError::SourceIdTaken => Self::conflict("source_id_in_use", e.to_string()),
            LedgerError::Exhausted => Self::conflict("sequence_exhausted", e.to_string()),
            LedgerError::DefinitionChanged => Self::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "definition_changed",
                e.to_string(),
            )
            .with_header(header::RETRY_AFTER, HeaderValue::from_static("1")),
            // The caller's own sequence is busy, not the database: said as
            // such, and not logged as an outage.
            LedgerError::CounterHeld => Self::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "unavailable",
                e.to_string(),
            )
            .with_header(header::RETRY_AFTER, HeaderValue::from_static("1")),
            LedgerError::Withdrawn => timed_out(),
            // Postgres answers: the write gave up on another transaction's
            // lock on a number it drew (written off, never drawn again).
            LedgerError::Waited(_) if e.lock_held_elsewhere() => {
                let mut problem = Self::unavailable(&e);
                problem.detail = "another transaction holds a number this request drew; \
                                  nothing was written; retry shortly"
                    .to_owned();
                problem
            }
            LedgerError::OutcomeUnknown(cause) => {
                crate::infra::commitment::NotAnswered::Unknown(cause.to_string()).into()
            }
            LedgerError::Db(_)
            | LedgerError::ReadOnly(_)
            | LedgerError::NotCommitted(_)
            | LedgerError::Statement(_)
            | LedgerError::Waited(_)
            | LedgerError::Closed => Self::unavailable(e),
        }
    }
}

impl From<crate::infra::commitment::NotAnswered> for ApiError {
    fn from(e: crate::infra::commitment::NotAnswered) -> Self {
        match e {
            crate::infra::commitment::NotAnswered::Withdrawn => timed_out(),
            // No Retry-After: a retry without an Idempotency-Key could
            // write twice. Logged like an outage (it is one).
            crate::infra::commitment::NotAnswered::Unknown(cause) => {
                static UNKNOWN: Repeated = Repeated::new("write outcome unknown");
                match UNKNOWN.occurred() {
                    Say::Started => tracing::error!(error = %cause, "write outcome unknown"),
                    Say::Again(times) => {
                        tracing::error!(error = %cause, times, "write outcome unknown")
                    }
                    Say::Quiet => {}
                }
                Self::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "outcome_unknown",
                    "the write was sent, and the database did not say whether it landed in all \
                     the time it was waited for; look the result up (GET /api/v1/documents/{id}) \
                     or retry with the same Idempotency-Key",
                )
            }
        }
    }
}

impl From<sqlx::Error> for ApiError {
    fn from(e: sqlx::Error) -> Self {
        db_error(e)
    }
}

/// The request's deadline passed before anything of it was written.
pub fn timed_out() -> ApiError {
    ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "timeout",
        "the request took longer than its timeout; nothing of it was written",
    )
    // Slow because a store is (a failover, an overload): worth a retry
    // soon, like every other 503.
    .with_header(header::RETRY_AFTER, HeaderValue::from_static("1"))
}

/// Connection trouble, timeouts and lock waits are a 503 the client may
/// retry; a value the database cannot store is the request's 400; anything
/// else is ours.
pub fn db_error<E>(e: E) -> ApiError
where
    E: std::borrow::Borrow<sqlx::Error> + std::fmt::Display,
{
    if crate::infra::db::distrust_server_after(e.borrow()) {
        // A standby, or a server going away in a failover.
        return ApiError::unavailable(e);
    }
    match e.borrow() {
        sqlx::Error::PoolTimedOut
        | sqlx::Error::Io(_)
        | sqlx::Error::PoolClosed
        | sqlx::Error::Tls(_)
        | sqlx::Error::Protocol(_) => ApiError::unavailable(e),
        sqlx::Error::Database(db) => {
            use crate::infra::db::sqlstate::*;
            let code = db.code().unwrap_or_default();
            if code.starts_with(DATA_EXCEPTION_CLASS) {
                ApiError::bad_request(
                    "unstorable_value",
                    format!(
                        "the database cannot store a value of this request: {}",
                        db.message()
                    ),
                )
            } else if code.starts_with(TRANSACTION_ROLLBACK_CLASS)
                || code.starts_with(CONNECTION_EXCEPTION_CLASS)
                || code.starts_with(INSUFFICIENT_RESOURCES_CLASS)
                || code.starts_with(OPERATOR_INTERVENTION_CLASS)
                || code == LOCK_NOT_AVAILABLE
                || code == IDLE_IN_TRANSACTION_TIMEOUT
            {
                // Serialization failures, deadlocks, a connection the
                // server or a pooler gave up (PgBouncer's query_wait_timeout,
                // its client limit), resources, timeouts, lock waits,
                // shutdowns, a transaction the server ended for idling
                // (rolled back): try again.
                ApiError::unavailable(e)
            } else {
                ApiError::internal(e)
            }
        }
        _ => ApiError::internal(e),
    }
}

impl From<DocumentError> for ApiError {
    fn from(e: DocumentError) -> Self {
        match e {
            DocumentError::Issue(e) => e.into(),
            DocumentError::NotAttachable { .. } => {
                Self::conflict("id_not_attachable", e.to_string())
            }
            DocumentError::IdTaken(_) => Self::conflict("document_id_taken", e.to_string()),
            DocumentError::SourceIdRepeated(_) => {
                Self::bad_request("duplicate_source_id", e.to_string())
            }
            DocumentError::SourceIdInUse => Self::conflict("source_id_in_use", e.to_string()),
            DocumentError::InvoiceMissing(_) => {
                Self::bad_request("invoice_required", e.to_string())
            }
            DocumentError::InvoiceUnexpected(_) => {
                Self::bad_request("invoice_not_expected", e.to_string())
            }
            DocumentError::Db(e) => db_error(e),
        }
    }
}

impl From<BatchError> for ApiError {
    fn from(e: BatchError) -> Self {
        let error: ApiError = e.error.into();
        match e.index {
            Some(index) => error.at_index(index),
            None => error,
        }
    }
}

impl From<IdempotencyKeyError> for ApiError {
    fn from(e: IdempotencyKeyError) -> Self {
        Self::bad_request("invalid_idempotency_key", e.to_string())
    }
}

impl From<ClaimError> for ApiError {
    fn from(e: ClaimError) -> Self {
        match e {
            ClaimError::InUse => Self::conflict("idempotency_key_in_use", e.to_string())
                .with_header(header::RETRY_AFTER, HeaderValue::from_static("1")),
            ClaimError::Db(e) => db_error(e),
        }
    }
}

/// The same key was sent with a different request.
pub fn key_reused() -> ApiError {
    ApiError::new(
        StatusCode::UNPROCESSABLE_ENTITY,
        "idempotency_key_reused",
        "this Idempotency-Key was used for a different request",
    )
}
