//! `GET /api/v1/ids/gaps` and `POST /api/v1/ids/gaps/reconcile`.

use crate::domain::sequence::Numbering;
use std::collections::BTreeMap;

use axum::extract::State;
use axum::http::{HeaderValue, header};
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::AppState;
use super::auth::require_admin;
use super::extract::Query;
use super::ids::parse_codes;
use super::page::Page;
use super::problem::{ApiError, Problem, db_error};
use crate::domain::sequence::Sequence;
use crate::features::gaps::reconcile::{self, ReconcileError};
use crate::features::gaps::{self, Gap, GapQuery, Reason};
use crate::records::auth::Caller;
use crate::records::pool::DiscardCause;

#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct GapsQuery {
    /// Project code.
    #[param(
        required = true,
        pattern = r"^[A-Za-z0-9_]{1,32}$",
        min_length = 1,
        max_length = 32
    )]
    pub project: Option<String>,
    /// Document type code.
    #[serde(rename = "type")]
    #[param(
        rename = "type",
        required = true,
        pattern = r"^[A-Za-z0-9_]{1,32}$",
        min_length = 1,
        max_length = 32
    )]
    pub doc_type: Option<String>,
    /// Only this period, e.g. `20261122` for a daily sequence (`""` never resets).
    #[param(pattern = r"^([0-9]{4}([0-9]{2}([0-9]{2})?)?)?$")]
    pub period: Option<String>,
    /// Only this reason.
    #[param(value_type = Option<Reason>)]
    pub reason: Option<String>,
    /// Only `pool_discarded` gaps whose pool was emptied for this cause,
    /// e.g. `postgres_behind_redis` (a fence after a failover).
    #[param(value_type = Option<DiscardCause>)]
    pub cause: Option<String>,
    /// Page size, 1 to 1000 (default 100).
    #[param(minimum = 1, maximum = 1000)]
    pub limit: Option<i64>,
    /// `next_cursor` of the previous page.
    #[param(pattern = r"^([0-9]{4}([0-9]{2}([0-9]{2})?)?)?:-?[0-9]{1,18}$")]
    pub cursor: Option<String>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct GapList {
    #[schema(schema_with = super::schema::project_code)]
    pub project: String,
    #[serde(rename = "type")]
    #[schema(schema_with = super::schema::type_code)]
    pub doc_type: String,
    /// Contiguous numbers with one reason are one range.
    pub gaps: Vec<Gap>,
    /// Pass as `cursor` for the next page; null on the last page.
    pub next_cursor: Option<String>,
}

pub fn router() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(list_gaps))
        .routes(routes!(reconcile_now))
}

/// Numbers of a sequence that carry no document, and why.
///
/// Answered from the `id_gaps` index kept by the reconciliation job. A
/// number whose request may still be running is not listed yet; one that
/// later gets its document leaves the list.
#[utoipa::path(
    get,
    path = "/api/v1/ids/gaps",
    tag = "gaps",
    params(GapsQuery),
    responses(
        (status = 200, description = "Open gaps in (period, position) order", body = GapList),
        (status = 400, description = "Missing or invalid project, type, period, reason, cause, limit or cursor", body = Problem, content_type = "application/problem+json"),
    )
)]
#[tracing::instrument(skip_all, level = "debug")]
pub async fn list_gaps(
    State(state): State<AppState>,
    caller: Caller,
    Query(query): Query<GapsQuery>,
) -> Result<axum::Json<GapList>, ApiError> {
    let (Some(project), Some(doc_type)) = (query.project.as_deref(), query.doc_type.as_deref())
    else {
        return Err(ApiError::bad_request(
            "missing_parameter",
            "project and type are required",
        ));
    };
    let (project, doc_type) = parse_codes(project, doc_type)?;
    if let Some(period) = &query.period {
        check_period_key(period)?;
    }
    let reason = query.reason.as_deref().map(parse_reason).transpose()?;
    let cause = query.cause.as_deref().map(parse_cause).transpose()?;
    let page = Page::parse(query.limit, query.cursor.as_deref(), |cursor| {
        let (period, seq) = cursor.rsplit_once(':')?;
        is_period_key(period).then_some(())?;
        Some((period.to_owned(), seq.parse::<i64>().ok()?))
    })?;
    // Outside the key's projects every sequence reads as one never used:
    // no gaps, whatever the project holds.
    let in_scope = caller.may_use(project.as_str());
    let sequence = if in_scope {
        state
            .sequences
            .get(project.as_str(), doc_type.as_str())
            .await?
    } else {
        None
    };
    if let (Some(period), Some(sequence)) = (&query.period, &sequence) {
        check_period_of(sequence, period)?;
    }
    // A sequence never used has no gaps.
    let gaps = match &sequence {
        None => Vec::new(),
        Some(sequence) => state
            .auth
            .rows()
            .charged(&caller, page.limit as usize, async {
                let _turn = state.db_turn(&caller).await;
                gaps::list(
                    &state.db,
                    &GapQuery {
                        sequence_id: sequence.id,
                        gapless: sequence.definition.numbering == Numbering::Gapless,
                        period: query.period.as_deref(),
                        reason,
                        cause: cause.map(<&'static str>::from),
                        after: page.after.clone(),
                        limit: page.limit,
                    },
                )
                .await
            })
            .await
            .map_err(db_error)?,
    };
    let next_cursor = page.next_cursor(&gaps, |g| format!("{}:{}", g.period, g.from_seq));
    Ok(axum::Json(GapList {
        project: project.to_string(),
        doc_type: doc_type.to_string(),
        gaps,
        next_cursor,
    }))
}

/// `""`, `YYYY`, `YYYYMM` or `YYYYMMDD`: what a period key can look like.
fn is_period_key(text: &str) -> bool {
    matches!(text.len(), 0 | 4 | 6 | 8) && text.bytes().all(|b| b.is_ascii_digit())
}

/// [`is_period_key`], or a problem naming `text`.
fn check_period_key(text: &str) -> Result<(), ApiError> {
    if is_period_key(text) {
        return Ok(());
    }
    Err(ApiError::bad_request(
        "invalid_period",
        format!("{text:?} is not a period: \"\", YYYY, YYYYMM or YYYYMMDD"),
    ))
}

/// A period the sequence's reset can have (a daily one has no `2026`).
fn check_period_of(sequence: &Sequence, period: &str) -> Result<(), ApiError> {
    let definition = &sequence.definition;
    if definition
        .reset
        .period_named(definition.timezone, period)
        .is_some()
    {
        return Ok(());
    }
    Err(ApiError::bad_request(
        "invalid_period",
        format!(
            "{period:?} is not a period of a {} sequence",
            definition.reset.as_str()
        ),
    ))
}

fn parse_cause(text: &str) -> Result<DiscardCause, ApiError> {
    text.parse().map_err(|_| {
        ApiError::bad_request(
            "invalid_cause",
            format!("cause {text:?} is not a cause of discarded pool numbers (e.g. postgres_behind_redis)"),
        )
    })
}

fn parse_reason(text: &str) -> Result<Reason, ApiError> {
    Reason::parse(text).ok_or_else(|| {
        let reasons: Vec<&str> = Reason::ALL.iter().map(|r| r.as_str()).collect();
        ApiError::bad_request(
            "invalid_reason",
            format!("reason {text:?} is not one of {}", reasons.join(", ")),
        )
    })
}

/// Run reconciliation now and return its summary (admin).
#[utoipa::path(
    post,
    path = "/api/v1/ids/gaps/reconcile",
    tag = "gaps",
    responses(
        (status = 200, description = "What the run did", body = Summary),
        (status = 403, description = "forbidden: reconciling needs an admin key", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "Another instance is reconciling", body = Problem, content_type = "application/problem+json"),
    )
)]
#[tracing::instrument(skip_all, level = "debug")]
pub async fn reconcile_now(
    State(state): State<AppState>,
    caller: Caller,
) -> Result<axum::Json<Summary>, ApiError> {
    require_admin(&caller)?;
    let reconciler = state.reconciler.clone();
    let summary = tokio::spawn(async move { reconciler.run_once().await })
        .await
        .map_err(ApiError::internal)?
        .map_err(|e| match e {
            ReconcileError::Db(e) => db_error(e),
            other => ApiError::internal(other),
        })?;
    if summary.skipped {
        return Err(ApiError::conflict(
            "reconcile_running",
            "another instance is reconciling right now",
        )
        .with_header(header::RETRY_AFTER, HeaderValue::from_static("5")));
    }
    Ok(axum::Json(Summary::from(summary)))
}

/// What one reconciliation run did (the answer of `POST /api/v1/ids/gaps/reconcile`).
#[derive(Debug, Default, Clone, Serialize, ToSchema)]
pub struct Summary {
    /// Another instance was running reconciliation; this run did nothing.
    pub skipped: bool,
    /// False when Redis could not be read: pools were not observed, so no
    /// new numbers were judged (numbers waiting on a pool wait for the next run).
    pub redis_available: bool,
    pub periods_scanned: usize,
    /// Numbers judged (new ones past the checkpoints, and re-judged ones).
    pub numbers_checked: i64,
    /// Rows read from blocks, ledger, outbox, discards and gaps.
    pub rows_read: i64,
    #[schema(value_type = std::collections::HashMap<String, i64>)]
    pub gaps_added: BTreeMap<&'static str, i64>,
    #[schema(value_type = std::collections::HashMap<String, i64>)]
    pub gaps_resolved: BTreeMap<&'static str, i64>,
    /// Pools of ended periods emptied (their numbers become pool_discarded).
    pub pools_closed: usize,
    /// Numbers of gapless sequences that are neither a document nor a void.
    pub gapless_violations: i64,
    pub duration_ms: u64,
}

impl From<reconcile::RunSummary> for Summary {
    fn from(run: reconcile::RunSummary) -> Self {
        let words = |counts: BTreeMap<Reason, i64>| {
            counts
                .into_iter()
                .map(|(reason, n)| (reason.as_str(), n))
                .collect()
        };
        Self {
            skipped: run.skipped,
            redis_available: run.redis_available,
            periods_scanned: run.periods_scanned,
            numbers_checked: run.numbers_checked,
            rows_read: run.rows_read,
            gaps_added: words(run.gaps_added),
            gaps_resolved: words(run.gaps_resolved),
            pools_closed: run.pools_closed,
            gapless_violations: run.gapless_violations,
            duration_ms: run.duration_ms,
        }
    }
}
