//! Gaps: numbers taken from a counter that carry no document, each with the
//! reason, kept in `id_gaps` by the reconciliation job.

pub mod classify;
mod evidence;
mod gapless;
pub mod reconcile;
mod store;

use crate::infra::db::Db;
use chrono::{DateTime, Utc};
use serde::Serialize;
use utoipa::ToSchema;

pub use classify::Reason;

use crate::records::ledger::reservations::{self, ReservationStatus};

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
    /// Voids of gapless sequences: the caller's reason. `pool_discarded`:
    /// why the pool was emptied (e.g. `postgres_behind_redis`, a fence after
    /// a failover), several separated by commas.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(example = "customer cancelled the order")]
    pub note: Option<String>,
    pub detected_at: DateTime<Utc>,
}

pub struct GapQuery<'a> {
    pub project: &'a str,
    pub doc_type: &'a str,
    pub period: Option<&'a str>,
    pub reason: Option<Reason>,
    /// Only `pool_discarded` gaps whose pool was emptied for this cause.
    pub cause: Option<&'a str>,
    /// (period, from_seq) of the last gap of the previous page.
    pub after: Option<(String, i64)>,
    pub limit: i64,
    /// The sequence's id when it is gapless: its gaps are its voids.
    pub gapless: Option<i64>,
}

/// Open gaps of a sequence in (period, position) order, from the index.
#[tracing::instrument(skip_all, level = "debug")]
pub async fn list(db: &Db, query: &GapQuery<'_>) -> Result<Vec<Gap>, sqlx::Error> {
    let (after_period, after_seq) = query.after.clone().unwrap_or((String::new(), i64::MIN));
    if let Some(sequence_id) = query.gapless {
        return voids(db, query, sequence_id, (&after_period, after_seq)).await;
    }
    // A discarded range's cause is read from the discards it overlaps
    // (`pool_discards_ranges`): one index probe per listed gap.
    sqlx::query_as!(
        Gap,
        "SELECT g.period, g.from_seq, g.to_seq, g.from_id, g.to_id, g.to_seq - g.from_seq + 1 AS \"count!\", \
                g.reason, \
                CASE WHEN g.reason = 'pool_discarded' THEN \
                  (SELECT string_agg(DISTINCT d.cause, ',' ORDER BY d.cause) FROM pool_discards d \
                   WHERE d.sequence_id = g.sequence_id AND d.period = g.period \
                     AND d.seqs && int8range(g.from_seq, g.to_seq, '[]')) \
                END AS note, \
                g.detected_at \
         FROM id_gaps g JOIN sequences s ON s.id = g.sequence_id \
         WHERE s.project = $1 AND s.doc_type = $2 AND g.resolved_at IS NULL \
           AND ($3::text IS NULL OR g.period = $3) AND ($4::text IS NULL OR g.reason = $4) \
           AND ($8::text IS NULL OR (g.reason = 'pool_discarded' AND EXISTS ( \
                SELECT 1 FROM pool_discards d \
                WHERE d.sequence_id = g.sequence_id AND d.period = g.period AND d.cause = $8 \
                  AND d.seqs && int8range(g.from_seq, g.to_seq, '[]')))) \
           AND (g.period, g.from_seq) > ($5, $6) \
         ORDER BY g.period, g.from_seq LIMIT $7",
        query.project,
        query.doc_type,
        query.period,
        query.reason.map(Reason::as_str),
        after_period,
        after_seq,
        query.limit,
        query.cause,
    )
    .fetch_all(db)
    .await
}

/// The voids of a gapless sequence, one gap per number: reason `voided`
/// (with the caller's note) or `reservation_expired`.
async fn voids(
    db: &Db,
    query: &GapQuery<'_>,
    sequence_id: i64,
    after: (&str, i64),
) -> Result<Vec<Gap>, sqlx::Error> {
    let status = match query.reason {
        None => None,
        Some(Reason::Voided) => Some(ReservationStatus::Voided),
        Some(Reason::ReservationExpired) => Some(ReservationStatus::ReservationExpired),
        // A gapless sequence has no gap of any other reason.
        Some(_) => return Ok(Vec::new()),
    };
    let voids =
        reservations::voids(db, sequence_id, query.period, status, after, query.limit).await?;
    Ok(voids
        .into_iter()
        .map(|v| Gap {
            period: v.period,
            from_seq: v.seq,
            to_seq: v.seq,
            from_id: v.id.clone(),
            to_id: v.id,
            count: 1,
            reason: match v.status {
                ReservationStatus::Voided => Reason::Voided,
                _ => Reason::ReservationExpired,
            }
            .as_str()
            .to_owned(),
            note: v.note,
            detected_at: v.voided_at,
        })
        .collect())
}

/// Numbers of a sequence currently in open gaps.
pub async fn open_numbers(db: &Db, sequence_id: i64) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar!(
        "SELECT coalesce(sum(to_seq - from_seq + 1), 0)::bigint AS \"numbers!\" FROM id_gaps \
         WHERE sequence_id = $1 AND resolved_at IS NULL",
        sequence_id,
    )
    .fetch_one(db)
    .await
}
