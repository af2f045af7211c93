//! `GET /api/v1/sequences`, `GET`/`PUT /api/v1/sequences/{project}/{type}`.

use axum::extract::State;
use axum::http::StatusCode;
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::AppState;
use super::auth::require_admin;
use super::extract::{Json, Path, Query};
use super::ids::parse_codes;
use super::page::Page;
use super::problem::{ApiError, Problem, db_error};
use super::responses::JsonBodyProblems;
use crate::domain::sequence::{
    Definition, DefinitionInput, LayoutKind, Numbering, RegisterKind, Reset, Sequence,
};
use crate::records::auth::Caller;

#[derive(Debug, Serialize, ToSchema)]
pub struct SequenceView {
    #[schema(schema_with = super::schema::project_code)]
    pub project: String,
    #[serde(rename = "type")]
    #[schema(schema_with = super::schema::type_code)]
    pub doc_type: String,
    #[schema(example = "{project}-{type}-{seq}")]
    pub format: String,
    pub layout: LayoutKind,
    /// Epoch of the int64 layout; null for text.
    pub epoch: Option<DateTime<Utc>>,
    pub start: i64,
    pub max: Option<i64>,
    pub reset: Reset,
    #[schema(example = "UTC")]
    pub timezone: String,
    pub pool_size: u32,
    pub refill_at: f64,
    pub numbering: Numbering,
    /// `chain` or `verifactu`; null for none.
    pub register: Option<RegisterKind>,
    /// The VERI*FACTU issuer's NIF; null otherwise.
    pub issuer: Option<String>,
    /// Bumped by every PUT.
    pub version: i32,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
    /// Live figures (only on `GET /api/v1/sequences/{project}/{type}`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub live: Option<LiveFigures>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct LiveFigures {
    /// The current period (`""` for sequences that never reset).
    #[schema(example = "")]
    pub period: String,
    /// Numbers waiting in the current period's Redis pool; null while Redis is down.
    pub pool_depth: Option<i64>,
    /// Highest number issued in the current period, as in `seqs`.
    pub last_issued: Option<i64>,
    pub last_issued_id: Option<String>,
    /// Blocks reserved for pools, all periods.
    pub refills: i64,
    /// Numbers in open gaps, all periods (as of the last reconciliation).
    pub gaps: i64,
}

impl SequenceView {
    fn of(sequence: &Sequence, live: Option<LiveFigures>) -> Self {
        let d = &sequence.definition;
        Self {
            project: sequence.project.to_string(),
            doc_type: sequence.doc_type.to_string(),
            format: d.format.as_str().to_owned(),
            layout: d.layout_kind(),
            epoch: d.epoch(),
            start: d.start,
            max: d.max,
            reset: d.reset,
            timezone: d.timezone.name().to_owned(),
            pool_size: d.pool_size,
            refill_at: d.refill_at,
            numbering: d.numbering,
            register: d.register.kind(),
            issuer: d.register.issuer().map(str::to_owned),
            version: sequence.version,
            created_at: sequence.created_at,
            updated_at: sequence.updated_at,
            live,
        }
    }
}

#[derive(Debug, Serialize, ToSchema)]
pub struct SequenceList {
    pub sequences: Vec<SequenceView>,
    /// Pass as `cursor` for the next page; null on the last page.
    pub next_cursor: Option<String>,
}

#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct ListQuery {
    /// Page size, 1 to 1000 (default 100).
    #[param(minimum = 1, maximum = 1000)]
    pub limit: Option<i64>,
    /// `next_cursor` of the previous page.
    #[param(pattern = r"^[A-Za-z0-9_]{1,32}/[A-Za-z0-9_]{1,32}$")]
    pub cursor: Option<String>,
}

pub fn router() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(list_sequences))
        .routes(routes!(get_sequence, put_sequence))
}

/// List sequences.
#[utoipa::path(
    get,
    path = "/api/v1/sequences",
    tag = "sequences",
    params(ListQuery),
    responses(
        (status = 200, description = "One page of sequences", body = SequenceList),
        (status = 400, description = "Invalid limit or cursor", body = Problem, content_type = "application/problem+json"),
    )
)]
#[tracing::instrument(skip_all, level = "debug")]
pub async fn list_sequences(
    State(state): State<AppState>,
    caller: Caller,
    Query(query): Query<ListQuery>,
) -> Result<axum::Json<SequenceList>, ApiError> {
    let page = Page::parse(query.limit, query.cursor.as_deref(), |c| c.split_once('/'))?;
    let sequences = state
        .auth
        .rows()
        .charged(&caller, page.limit as usize, async {
            let _turn = state.db_turn(&caller).await;
            state
                .sequences
                .list(page.after, page.limit, caller.projects())
                .await
        })
        .await?;
    let next_cursor = page.next_cursor(&sequences, |s| format!("{}/{}", s.project, s.doc_type));
    Ok(axum::Json(SequenceList {
        sequences: sequences
            .iter()
            .map(|s| SequenceView::of(s, None))
            .collect(),
        next_cursor,
    }))
}

/// Read one sequence with its live figures.
#[utoipa::path(
    get,
    path = "/api/v1/sequences/{project}/{type}",
    tag = "sequences",
    params(("project" = String, Path, description = "Project code", pattern = r"^[A-Za-z0-9_]{1,32}$", min_length = 1, max_length = 32), ("type" = String, Path, description = "Document type code", pattern = r"^[A-Za-z0-9_]{1,32}$", min_length = 1, max_length = 32)),
    responses(
        (status = 200, description = "The definition and its live figures", body = SequenceView),
        (status = 400, description = "Invalid project or type", body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "Never defined nor used", body = Problem, content_type = "application/problem+json"),
    )
)]
#[tracing::instrument(skip_all, level = "debug")]
pub async fn get_sequence(
    State(state): State<AppState>,
    caller: Caller,
    Path((project, doc_type)): Path<(String, String)>,
) -> Result<axum::Json<SequenceView>, ApiError> {
    let (project, doc_type) = parse_codes(&project, &doc_type)?;
    let _turn = state.db_turn(&caller).await;
    let found = if caller.may_use(project.as_str()) {
        state
            .sequences
            .get(project.as_str(), doc_type.as_str())
            .await?
    } else {
        None
    };
    let sequence = found.ok_or_else(|| {
        ApiError::not_found(
            "sequence_not_found",
            format!("sequence {project}/{doc_type} was never defined nor used"),
        )
    })?;
    let live = live_figures(&state, &sequence).await?;
    Ok(axum::Json(SequenceView::of(&sequence, Some(live))))
}

async fn live_figures(
    state: &AppState,
    sequence: &std::sync::Arc<Sequence>,
) -> Result<LiveFigures, ApiError> {
    let now = state.clock.now();
    let period = sequence.definition.period_at(now);
    let pool = state.pools.pool_ref(sequence.clone(), period.clone());
    let pool_depth = state.pools.depth(&pool).await;
    let (last_seq, refills, gaps) = if sequence.definition.numbering == Numbering::Gapless {
        // No ledger rows and no gap rows: its documents, reservations and voids.
        let (last, voids) = crate::records::ledger::reservations::last_taken_and_voids(
            &state.db,
            sequence.id,
            period.key(),
        )
        .await
        .map_err(db_error)?;
        (last, 0, voids)
    } else {
        let (last, refills) =
            crate::records::ledger::last_issued_and_refills(&state.db, sequence.id, period.key())
                .await
                .map_err(db_error)?;
        let gaps = crate::features::gaps::open_numbers(&state.db, sequence.id)
            .await
            .map_err(db_error)?;
        (last, refills, gaps)
    };
    let shape = sequence
        .definition
        .shape(
            sequence.project.as_str(),
            sequence.doc_type.as_str(),
            &period,
            now,
        )
        .ok();
    Ok(LiveFigures {
        period: period.key().to_owned(),
        pool_depth,
        last_issued: last_seq.map(|s| shape.as_ref().map_or(s, |sh| sh.number(s))),
        last_issued_id: last_seq.and_then(|s| shape.as_ref().map(|sh| sh.id(s))),
        refills,
        gaps,
    })
}

/// Define or change a sequence.
///
/// Every field is optional and takes its default when left out. Changing
/// `format`, `layout`, `reset` or `timezone` of a sequence that has issued
/// numbers is refused with 409 unless `"force": true`; the pools of the old
/// definition are then discarded. So is a definition that leaves out the
/// `max` of a sequence that has taken numbers (it would end its exhaustion).
#[utoipa::path(
    put,
    path = "/api/v1/sequences/{project}/{type}",
    tag = "sequences",
    params(("project" = String, Path, description = "Project code", pattern = r"^[A-Za-z0-9_]{1,32}$", min_length = 1, max_length = 32), ("type" = String, Path, description = "Document type code", pattern = r"^[A-Za-z0-9_]{1,32}$", min_length = 1, max_length = 32)),
    request_body = DefinitionInput,
    responses(
        (status = 200, description = "Replaced", body = SequenceView),
        (status = 201, description = "Created", body = SequenceView),
        (status = 400, description = "Invalid definition", body = Problem, content_type = "application/problem+json"),
        (status = 403, description = "forbidden: defining a sequence needs an admin key", body = Problem, content_type = "application/problem+json"),
        (status = 413, description = "Body too large", body = Problem, content_type = "application/problem+json"),
        JsonBodyProblems,
        (status = 409, description = "sequence_in_use (an identity change, or a used sequence's max left out, without force), format_conflict (its IDs could read like another sequence's, or like this one's before), sequence_limit_reached", body = Problem, content_type = "application/problem+json"),
    )
)]
#[tracing::instrument(skip_all, level = "debug")]
pub async fn put_sequence(
    State(state): State<AppState>,
    caller: Caller,
    Path((project, doc_type)): Path<(String, String)>,
    Json(input): Json<DefinitionInput>,
) -> Result<(StatusCode, axum::Json<SequenceView>), ApiError> {
    require_admin(&caller)?;
    let (project, doc_type) = parse_codes(&project, &doc_type)?;
    // IDs are read by people: a direction override or a zero-width space
    // would print one ID as another. Refused when a format is written
    // (formats stored before stay readable by the service).
    if let Some(c) = input
        .format
        .as_deref()
        .and_then(|format| format.chars().find(|c| crate::domain::text::invisible(*c)))
    {
        return Err(ApiError::bad_request(
            "invalid_definition",
            format!(
                "the format may not contain invisible formatting characters (found U+{:04X})",
                u32::from(c)
            ),
        ));
    }
    let definition = Definition::from_input(&input, &project, &doc_type)
        .map_err(|e| ApiError::bad_request("invalid_definition", e.to_string()))?;
    let _turn = state.db_turn(&caller).await;
    let outcome = state
        .sequences
        .put(&project, &doc_type, &definition, input.force)
        .await?;
    if let Some(old) = &outcome.replaced_identity {
        state
            .pools
            .discards()
            .discard_sequence_pools(old, crate::records::pool::DiscardCause::DefinitionChanged)
            .await;
    } else if let Some(old) = &outcome.previous
        && outcome.sequence.definition.max_seq() < old.definition.max_seq()
    {
        // Pools filled under the higher max hold numbers past the new one.
        state
            .pools
            .discards()
            .trim_sequence_pools(&outcome.sequence)
            .await;
    }
    let status = if outcome.created {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    Ok((
        status,
        axum::Json(SequenceView::of(&outcome.sequence, None)),
    ))
}
