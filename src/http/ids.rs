//! `POST /ids` and `POST /api/v1/ids`.

use axum::extract::State;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::AppState;
use super::extract::Json;
use super::problem::{ApiError, Problem};
use crate::counter::Via;
use crate::issuance::MAX_COUNT;
use crate::sequence::{ProjectCode, TypeCode};

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct IssueIdsRequest {
    /// Project code, `[A-Za-z0-9_]{1,32}`.
    #[schema(example = "PROJ")]
    pub project: String,
    /// Document type code, `[A-Za-z0-9_]{1,32}`.
    #[serde(rename = "type")]
    #[schema(example = "9012")]
    pub doc_type: String,
    /// How many IDs, 1 to 10,000 (default 1).
    #[serde(default = "one")]
    #[schema(example = 1, minimum = 1, maximum = 10000)]
    pub count: i64,
}

fn one() -> i64 {
    1
}

#[derive(Debug, Serialize, ToSchema)]
pub struct IssuedIds {
    #[schema(example = "PROJ")]
    pub project: String,
    #[serde(rename = "type")]
    #[schema(example = "9012")]
    pub doc_type: String,
    /// Formatted IDs, ascending.
    #[schema(example = json!(["PROJ-9012-1001"]))]
    pub ids: Vec<String>,
    /// The same IDs as numbers (the whole 64-bit value for the int64 layout).
    #[schema(example = json!([1001]))]
    pub seqs: Vec<i64>,
}

pub fn router() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(issue_ids))
        .routes(routes!(issue_ids_short))
}

/// Validated `POST /ids` input.
pub struct IdsInput {
    pub project: ProjectCode,
    pub doc_type: TypeCode,
    pub count: usize,
}

pub fn parse_codes(project: &str, doc_type: &str) -> Result<(ProjectCode, TypeCode), ApiError> {
    let project = ProjectCode::parse(project)
        .map_err(|e| ApiError::bad_request("invalid_project", format!("project: {e}")))?;
    let doc_type = TypeCode::parse(doc_type)
        .map_err(|e| ApiError::bad_request("invalid_type", format!("type: {e}")))?;
    Ok((project, doc_type))
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
    responses(
        (status = 200, description = "IDs issued", body = IssuedIds),
        (status = 400, description = "Invalid project, type, count or body", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "Sequence exhausted for this period", body = Problem, content_type = "application/problem+json"),
        (status = 413, description = "Body too large", body = Problem, content_type = "application/problem+json"),
        (status = 415, description = "Body is not JSON", body = Problem, content_type = "application/problem+json"),
        (status = 503, description = "Postgres unavailable", body = Problem, content_type = "application/problem+json"),
    )
)]
pub async fn issue_ids(
    State(state): State<AppState>,
    Json(body): Json<IssueIdsRequest>,
) -> Result<axum::Json<IssuedIds>, ApiError> {
    let input = IdsInput::parse(&body)?;
    issue(state, input).await.map(axum::Json)
}

/// Issue IDs (short path of `POST /api/v1/ids`).
#[utoipa::path(
    post,
    path = "/ids",
    tag = "ids",
    operation_id = "issue_ids_short",
    request_body = IssueIdsRequest,
    responses(
        (status = 200, description = "IDs issued", body = IssuedIds),
        (status = 400, description = "Invalid project, type, count or body", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "Sequence exhausted for this period", body = Problem, content_type = "application/problem+json"),
        (status = 413, description = "Body too large", body = Problem, content_type = "application/problem+json"),
        (status = 415, description = "Body is not JSON", body = Problem, content_type = "application/problem+json"),
        (status = 503, description = "Postgres unavailable", body = Problem, content_type = "application/problem+json"),
    )
)]
pub async fn issue_ids_short(
    state: State<AppState>,
    body: Json<IssueIdsRequest>,
) -> Result<axum::Json<IssuedIds>, ApiError> {
    issue_ids(state, body).await
}

/// Runs the issue in its own task: a client hanging up mid-request must not
/// cancel it between taking numbers and recording them.
pub async fn issue(state: AppState, input: IdsInput) -> Result<IssuedIds, ApiError> {
    tokio::spawn(async move {
        let issued = state
            .issuer
            .issue(&input.project, &input.doc_type, input.count, Via::Ids)
            .await?;
        Ok(IssuedIds {
            ids: issued.ids(),
            seqs: issued.numbers(),
            project: input.project.to_string(),
            doc_type: input.doc_type.to_string(),
        })
    })
    .await
    .map_err(ApiError::internal)?
}
