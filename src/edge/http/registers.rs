//! Registers an auditor can verify: a register's entries, its online
//! verification, the project's signed checkpoint and proofs, and the
//! installation's public keys.

use axum::extract::State;
use axum::http::{HeaderValue, header};
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::AppState;
use super::auth::within_scope;
use super::extract::{Path, Query};
use super::ids::{parse_codes, parse_project};
use super::problem::{ApiError, Problem, db_error};
use crate::domain::sequence::Sequence;
use crate::features::registers::{EntryView, PublicKey, RegisterError, Verification};
use crate::records::auth::Caller;

pub fn router() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(list_entries))
        .routes(routes!(verify_register))
        .routes(routes!(get_checkpoint))
        .routes(routes!(inclusion_proof))
        .routes(routes!(consistency_proof))
        .routes(routes!(public_keys))
}

fn register_error(e: RegisterError) -> ApiError {
    match e {
        RegisterError::Invalid(detail) => ApiError::bad_request("invalid_parameter", detail),
        // Well-formed, but past what the log holds.
        RegisterError::OutOfRange { .. } => ApiError::new(
            axum::http::StatusCode::UNPROCESSABLE_ENTITY,
            "out_of_range",
            e.to_string(),
        ),
        RegisterError::Incomplete(_) => ApiError::internal(e),
        RegisterError::Db(e) => db_error(e),
    }
}

/// Another project's register, or a sequence that is none, answers as
/// one that does not exist.
fn no_such_register() -> ApiError {
    ApiError::not_found(
        "register_not_found",
        "no register by that project and type, or not open to this key",
    )
}

/// The register `project`/`doc_type`, if the key may read it.
async fn register(
    state: &AppState,
    caller: &Caller,
    project: &str,
    doc_type: &str,
) -> Result<std::sync::Arc<Sequence>, ApiError> {
    let (project, doc_type) = parse_codes(project, doc_type)?;
    if !caller.may_use(project.as_str()) {
        return Err(no_such_register());
    }
    state
        .sequences
        .get(project.as_str(), doc_type.as_str())
        .await?
        .filter(|s| s.definition.register.kind().is_some())
        .ok_or_else(no_such_register)
}

#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct EntriesQuery {
    /// The first chain position to list (default 1).
    #[param(minimum = 1)]
    pub from_seq: Option<i64>,
    /// Page size, 1 to 1000 (default 100).
    #[param(minimum = 1, maximum = 1000)]
    pub limit: Option<i64>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct EntryPage {
    /// In chain order.
    pub entries: Vec<EntryView>,
    /// Pass as `from_seq` for the next page; null on the last page.
    pub next_from_seq: Option<i64>,
}

/// A register's entries, in chain order.
///
/// A `verifactu` register's chain is its issuer's, across the project's
/// sequences of that issuer.
#[utoipa::path(
    get,
    path = "/api/v1/registers/{project}/{type}/entries",
    tag = "registers",
    params(
        ("project" = String, Path, pattern = r"^[A-Za-z0-9_]{1,32}$"),
        ("type" = String, Path, pattern = r"^[A-Za-z0-9_]{1,32}$"),
        EntriesQuery,
    ),
    responses(
        (status = 200, description = "A page of entries", body = EntryPage),
        (status = 400, description = "invalid_project, invalid_type, invalid_parameter", body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "register_not_found", body = Problem, content_type = "application/problem+json"),
    )
)]
#[tracing::instrument(skip_all, level = "debug")]
pub async fn list_entries(
    State(state): State<AppState>,
    caller: Caller,
    Path((project, doc_type)): Path<(String, String)>,
    Query(query): Query<EntriesQuery>,
) -> Result<axum::Json<EntryPage>, ApiError> {
    let limit = query.limit.unwrap_or(100);
    if !(1..=1000).contains(&limit) {
        return Err(ApiError::bad_request(
            "invalid_parameter",
            "limit must be 1 to 1000",
        ));
    }
    let from = query.from_seq.unwrap_or(1);
    if from < 1 {
        return Err(ApiError::bad_request(
            "invalid_parameter",
            "from_seq must be 1 or more",
        ));
    }
    let sequence = register(&state, &caller, &project, &doc_type).await?;
    let entries = state
        .auth
        .rows()
        .charged(&caller, limit as usize, async {
            let _turn = state.db_turn(&caller).await;
            state.registers.entries(&sequence, from, limit + 1).await
        })
        .await
        .map_err(register_error)?;
    let mut entries = entries;
    let next_from_seq = if entries.len() as i64 > limit {
        entries.truncate(limit as usize);
        entries.last().map(|e| e.seq + 1)
    } else {
        None
    };
    Ok(axum::Json(EntryPage {
        entries,
        next_from_seq,
    }))
}

/// Verify a register's chain from its first entry.
///
/// Each entry's position, hash, link to the previous one and body, that
/// each is the project tree's leaf at its index, and that the latest
/// signed checkpoint's signature holds and its root is the tree's.
/// `{"ok": false}` names the first entry that is not what it should be.
#[utoipa::path(
    get,
    path = "/api/v1/registers/{project}/{type}/verify",
    tag = "registers",
    params(
        ("project" = String, Path, pattern = r"^[A-Za-z0-9_]{1,32}$"),
        ("type" = String, Path, pattern = r"^[A-Za-z0-9_]{1,32}$"),
    ),
    responses(
        (status = 200, description = "What verification found", body = Verification),
        (status = 400, description = "invalid_project, invalid_type", body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "register_not_found", body = Problem, content_type = "application/problem+json"),
    )
)]
#[tracing::instrument(skip_all, level = "debug")]
pub async fn verify_register(
    State(state): State<AppState>,
    caller: Caller,
    Path((project, doc_type)): Path<(String, String)>,
) -> Result<axum::Json<Verification>, ApiError> {
    let sequence = register(&state, &caller, &project, &doc_type).await?;
    let _verifying = state.registers.verify_turn(caller.id()).await;
    let _turn = state.db_turn(&caller).await;
    let found = state
        .registers
        .verify(&sequence)
        .await
        .map_err(register_error)?;
    Ok(axum::Json(found))
}

/// A project named in a path, if the key may read it.
fn readable_project(caller: &Caller, project: &str) -> Result<String, ApiError> {
    let project = parse_project(project)?;
    within_scope(caller, project.as_str())?;
    Ok(project.to_string())
}

/// The project's latest signed checkpoint.
///
/// A C2SP signed note: the log's origin (`<IDPOOL_REGISTER_ORIGIN>/<project>`),
/// its size and its RFC 6962 root (base64), then an Ed25519 signature line.
#[utoipa::path(
    get,
    path = "/api/v1/registers/{project}/checkpoint",
    tag = "registers",
    params(("project" = String, Path, pattern = r"^[A-Za-z0-9_]{1,32}$")),
    responses(
        (status = 200, description = "The signed note", body = String, content_type = "text/plain"),
        (status = 400, description = "invalid_project", body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "project_not_found, or checkpoint_not_found (no checkpoint signed yet)", body = Problem, content_type = "application/problem+json"),
    )
)]
#[tracing::instrument(skip_all, level = "debug")]
pub async fn get_checkpoint(
    State(state): State<AppState>,
    caller: Caller,
    Path(project): Path<String>,
) -> Result<Response, ApiError> {
    let project = readable_project(&caller, &project)?;
    let _turn = state.db_turn(&caller).await;
    let note = state
        .registers
        .checkpoint(&project)
        .await
        .map_err(register_error)?
        .ok_or_else(|| {
            ApiError::not_found(
                "checkpoint_not_found",
                "the project's registers have no signed checkpoint yet",
            )
        })?;
    let mut response = note.into_response();
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    Ok(response)
}

#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct InclusionQuery {
    /// The leaf's index (an entry's `index`).
    #[param(minimum = 0)]
    pub index: i64,
    /// The tree's size (a checkpoint's).
    #[param(minimum = 1)]
    pub tree_size: i64,
}

#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct ConsistencyQuery {
    /// The older tree's size.
    #[param(minimum = 1)]
    pub from: i64,
    /// The newer tree's size.
    #[param(minimum = 1)]
    pub to: i64,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct Proof {
    /// RFC 6962 proof hashes, hex, in the RFC's order.
    pub hashes: Vec<String>,
}

fn proof(hashes: Vec<crate::domain::merkle::Hash>) -> axum::Json<Proof> {
    axum::Json(Proof {
        hashes: hashes.iter().map(hex::encode).collect(),
    })
}

/// The inclusion proof of a leaf in the project's tree of `tree_size`.
#[utoipa::path(
    get,
    path = "/api/v1/registers/{project}/proofs/inclusion",
    tag = "registers",
    params(("project" = String, Path, pattern = r"^[A-Za-z0-9_]{1,32}$"), InclusionQuery),
    responses(
        (status = 200, description = "The proof", body = Proof),
        (status = 400, description = "invalid_project, or a parameter that is not a number", body = Problem, content_type = "application/problem+json"),
        (status = 422, description = "out_of_range: index ≥ tree_size, or tree_size past the log", body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "project_not_found", body = Problem, content_type = "application/problem+json"),
    )
)]
#[tracing::instrument(skip_all, level = "debug")]
pub async fn inclusion_proof(
    State(state): State<AppState>,
    caller: Caller,
    Path(project): Path<String>,
    Query(query): Query<InclusionQuery>,
) -> Result<axum::Json<Proof>, ApiError> {
    let project = readable_project(&caller, &project)?;
    let _turn = state.db_turn(&caller).await;
    state
        .registers
        .inclusion(&project, query.index, query.tree_size)
        .await
        .map(proof)
        .map_err(register_error)
}

/// The consistency proof between two sizes of the project's tree.
#[utoipa::path(
    get,
    path = "/api/v1/registers/{project}/proofs/consistency",
    tag = "registers",
    params(("project" = String, Path, pattern = r"^[A-Za-z0-9_]{1,32}$"), ConsistencyQuery),
    responses(
        (status = 200, description = "The proof", body = Proof),
        (status = 400, description = "invalid_project, or a parameter that is not a number", body = Problem, content_type = "application/problem+json"),
        (status = 422, description = "out_of_range: not 0 < from ≤ to ≤ the log's size", body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "project_not_found", body = Problem, content_type = "application/problem+json"),
    )
)]
#[tracing::instrument(skip_all, level = "debug")]
pub async fn consistency_proof(
    State(state): State<AppState>,
    caller: Caller,
    Path(project): Path<String>,
    Query(query): Query<ConsistencyQuery>,
) -> Result<axum::Json<Proof>, ApiError> {
    let project = readable_project(&caller, &project)?;
    let _turn = state.db_turn(&caller).await;
    state
        .registers
        .consistency(&project, query.from, query.to)
        .await
        .map(proof)
        .map_err(register_error)
}

#[derive(Debug, Serialize, ToSchema)]
pub struct PublicKeys {
    /// Every key that ever signed a checkpoint here, oldest first.
    pub keys: Vec<PublicKey>,
}

/// The keys that sign the registers' checkpoints (open to anyone).
#[utoipa::path(
    get,
    path = "/api/v1/registers/public-key",
    tag = "registers",
    responses(
        (status = 200, description = "The keys", body = PublicKeys),
    )
)]
#[tracing::instrument(skip_all, level = "debug")]
pub async fn public_keys(
    State(state): State<AppState>,
) -> Result<axum::Json<PublicKeys>, ApiError> {
    let keys = state
        .registers
        .public_keys()
        .await
        .map_err(register_error)?;
    Ok(axum::Json(PublicKeys { keys }))
}
