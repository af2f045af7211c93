//! `POST /ids` and `POST /api/v1/ids`.

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::AppState;
use super::auth::within_scope;
use super::extract::Json;
use super::idempotent::{self, Answer, IdempotencyKey, Keyed};
use super::problem::{ApiError, Problem};
use super::responses::{IssuingUnavailable, JsonBodyProblems, KeyReused, ProjectNotFound};
use crate::domain::sequence::{ProjectCode, TypeCode};
use crate::issuance::{Issued, MAX_COUNT, Want};
use crate::records::auth::Caller;
use crate::records::idempotency;
use crate::records::ledger::Via;

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct IssueIdsRequest {
    #[schema(schema_with = super::schema::project_code)]
    pub project: String,
    #[serde(rename = "type")]
    #[schema(schema_with = super::schema::type_code)]
    pub doc_type: String,
    /// How many IDs, 1 to 10,000 (default 1).
    #[serde(
        default = "one",
        deserialize_with = "crate::domain::numbers::whole::exact_i64"
    )]
    #[schema(example = 1, minimum = 1, maximum = 10000)]
    pub count: i64,
}

fn one() -> i64 {
    1
}

#[derive(Debug, Serialize, serde::Deserialize, ToSchema)]
pub struct IssuedIds {
    #[schema(schema_with = super::schema::project_code)]
    pub project: String,
    #[serde(rename = "type")]
    #[schema(schema_with = super::schema::type_code)]
    pub doc_type: String,
    /// Formatted IDs, ascending.
    #[schema(example = json!(["PROJ-9012-1001"]))]
    pub ids: Vec<String>,
    /// The same IDs as numbers (the whole 64-bit value for the int64 layout).
    #[schema(example = json!([1001]))]
    pub seqs: Vec<i64>,
    /// Gapless sequences only: the IDs are reserved until then; attach a
    /// document to each (`POST /documents` with `"id"`) or void it
    /// (`POST /api/v1/ids/void`) before, or it is voided as `reservation_expired`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reserved_until: Option<DateTime<Utc>>,
}

pub fn router() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(issue_ids))
        // Its short path: the same handler, documented by `super::short_paths`.
        .route("/ids", axum::routing::post(issue_ids))
}

/// Validated `POST /ids` input.
pub struct IdsInput {
    pub project: ProjectCode,
    pub doc_type: TypeCode,
    pub count: usize,
}

/// A project code and a type code, each checked (every route that names a
/// sequence, and the outbox filters, answer bad codes alike).
pub fn parse_codes(project: &str, doc_type: &str) -> Result<(ProjectCode, TypeCode), ApiError> {
    Ok((parse_project(project)?, parse_type(doc_type)?))
}

pub fn parse_project(project: &str) -> Result<ProjectCode, ApiError> {
    ProjectCode::parse(project)
        .map_err(|e| ApiError::bad_request("invalid_project", format!("project: {e}")))
}

pub fn parse_type(doc_type: &str) -> Result<TypeCode, ApiError> {
    TypeCode::parse(doc_type)
        .map_err(|e| ApiError::bad_request("invalid_type", format!("type: {e}")))
}

impl IdsInput {
    pub fn parse(body: &IssueIdsRequest) -> Result<Self, ApiError> {
        let (project, doc_type) = parse_codes(&body.project, &body.doc_type)?;
        if !(1..=MAX_COUNT as i64).contains(&body.count) {
            return Err(ApiError::bad_request(
                "invalid_count",
                format!(
                    "count must be between 1 and {MAX_COUNT}, got {}",
                    body.count
                ),
            ));
        }
        Ok(Self {
            project,
            doc_type,
            count: body.count as usize,
        })
    }
}

/// Issue IDs.
///
/// Takes `count` numbers of the sequence (created with the default
/// definition on first use) and returns them formatted, ascending. Every
/// number is recorded as issued before the response is sent and is never
/// issued again.
#[utoipa::path(
    post,
    path = "/api/v1/ids",
    tag = "ids",
    operation_id = "issue_ids",
    request_body = IssueIdsRequest,
    params(
        ("Idempotency-Key" = Option<String>, Header, description = "1 to 255 printable ASCII characters; a retry with it gets the same IDs (kept 24 h)", pattern = r"^[ -~]{1,255}$", min_length = 1, max_length = 255),
    ),
    responses(
        (status = 200, description = "IDs issued", body = IssuedIds,
         headers(("Idempotent-Replayed" = String, description = "true when this answers a retry"))),
        (status = 400, description = "Invalid project, type, count or body", body = Problem, content_type = "application/problem+json"),
        ProjectNotFound,
        (status = 409, description = "sequence_exhausted, idempotency_key_in_use, format_conflict, sequence_limit_reached or sequence_not_defined (a new sequence), id_too_long, too_many_reservations (a gapless sequence holds 1,000 open)", body = Problem, content_type = "application/problem+json"),
        (status = 413, description = "Body too large", body = Problem, content_type = "application/problem+json"),
        JsonBodyProblems,
        KeyReused,
        IssuingUnavailable,
    )
)]
#[tracing::instrument(skip_all, level = "debug")]
pub async fn issue_ids(
    State(state): State<AppState>,
    caller: Caller,
    IdempotencyKey(key): IdempotencyKey,
    Json(body): Json<IssueIdsRequest>,
) -> Result<Response, ApiError> {
    let input = IdsInput::parse(&body)?;
    within_scope(&caller, input.project.as_str())?;
    state.auth.numbers().take(&caller, input.count).await;
    let Some(key) = key else {
        // The hot path: numbers are popped and recorded inside the shared
        // batch, so a client hanging up cannot leave one half-taken.
        let placement = state.issuer.place(&input.project, &input.doc_type).await?;
        let issued = state
            .issuer
            .issue(placement, Want::Ids { count: input.count })
            .await?;
        return Ok(axum::Json(answer(&input, &issued)).into_response());
    };
    // A keyed request holds a connection for its transaction.
    let db_turn = state.db_turn(&caller).await;
    let caller = idempotency::Owner::key(caller.id());
    // Detached: a client hanging up must not cancel the transaction
    // between taking numbers and recording them.
    let issuer = state.issuer.clone();
    issuer
        .detached(async move {
            let answer = issue_once(state, caller, key, input).await;
            drop(db_turn);
            answer
        })
        .await
        .map_err(ApiError::internal)?
}

fn answer(input: &IdsInput, issued: &Issued) -> IssuedIds {
    IssuedIds {
        project: input.project.to_string(),
        doc_type: input.doc_type.to_string(),
        ids: issued.ids(),
        seqs: issued.numbers(),
        reserved_until: issued.reserved_until,
    }
}

/// Issues under an idempotency key: the ledger rows and the stored answer
/// commit together, so a retry gets the same IDs and burns no numbers.
async fn issue_once(
    state: AppState,
    caller: idempotency::Owner,
    key: String,
    input: IdsInput,
) -> Result<Response, ApiError> {
    let canonical = serde_json::json!({
        "project": input.project.as_str(),
        "type": input.doc_type.as_str(),
        "count": input.count,
    });
    let keyed = Keyed {
        key,
        fingerprint: idempotency::fingerprint("ids", &canonical),
    };
    // Before the transaction: placing may read or create the sequence.
    let placement = state.issuer.place(&input.project, &input.doc_type).await?;
    let issuer = state.issuer.clone();
    let answers = idempotent::run(
        &state,
        &caller,
        &[Some(keyed)],
        200,
        false,
        async |tx, _| {
            let issued = issuer
                .issue_in(tx, &placement, input.count, Via::Ids)
                .await?;
            Ok(vec![Answer {
                body: serde_json::to_value(answer(&input, &issued)).map_err(ApiError::internal)?,
                replayed: false,
            }])
        },
    )
    .await?;
    idempotent::only_answer(answers)
}
