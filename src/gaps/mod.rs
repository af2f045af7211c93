//! Gaps: numbers taken from a counter that carry no document, each with the
//! reason, kept in `id_gaps` by the reconciliation job.

pub mod classify;
mod evidence;
pub mod reconcile;
mod store;

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::PgPool;
use utoipa::ToSchema;

pub use classify::Reason;

/// One range of contiguous numbers with one reason.
#[derive(Debug, Clone, Serialize, ToSchema, sqlx::FromRow)]
pub struct Gap {
    /// The sequence period (`""` for sequences that never reset).
    #[schema(example = "")]
    pub period: String,
    #[schema(example = 1042)]
    pub from_seq: i64,
    #[schema(example = 1044)]
    pub to_seq: i64,
    #[schema(example = "PROJ-9012-1042")]
    pub from_id: String,
    #[schema(example = "PROJ-9012-1044")]
    pub to_id: String,
    #[schema(example = 3)]
    pub count: i64,
    #[schema(value_type = Reason)]
    pub reason: String,
    pub detected_at: DateTime<Utc>,
}

pub struct GapQuery<'a> {
    pub project: &'a str,
    pub doc_type: &'a str,
    pub period: Option<&'a str>,
    pub reason: Option<Reason>,
    /// (period, from_seq) of the last gap of the previous page.
    pub after: Option<(String, i64)>,
    pub limit: i64,
}

/// Open gaps of a sequence in (period, position) order, from the index.
#[tracing::instrument(skip_all, level = "debug")]
pub async fn list(db: &PgPool, query: &GapQuery<'_>) -> Result<Vec<Gap>, sqlx::Error> {
    let (after_period, after_seq) = query.after.clone().unwrap_or((String::new(), i64::MIN));
    sqlx::query_as!(
        Gap,
        "SELECT g.period, g.from_seq, g.to_seq, g.from_id, g.to_id, g.to_seq - g.from_seq + 1 AS \"count!\", \
                g.reason, g.detected_at \
         FROM id_gaps g JOIN sequences s ON s.id = g.sequence_id \
         WHERE s.project = $1 AND s.doc_type = $2 AND g.resolved_at IS NULL \
           AND ($3::text IS NULL OR g.period = $3) AND ($4::text IS NULL OR g.reason = $4) \
           AND (g.period, g.from_seq) > ($5, $6) \
         ORDER BY g.period, g.from_seq LIMIT $7",
        query.project,
        query.doc_type,
        query.period,
        query.reason.map(Reason::as_str),
        after_period,
        after_seq,
        query.limit,
    )
    .fetch_all(db)
    .await
}

/// Numbers of a sequence currently in open gaps.
pub async fn open_numbers(db: &PgPool, sequence_id: i64) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar!(
        "SELECT coalesce(sum(to_seq - from_seq + 1), 0)::bigint AS \"numbers!\" FROM id_gaps \
         WHERE sequence_id = $1 AND resolved_at IS NULL",
        sequence_id,
    )
    .fetch_one(db)
    .await
}
