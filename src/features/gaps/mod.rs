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
    /// The sequence whose gaps are listed.
    pub sequence_id: i64,
    /// Whether it is gapless: its gaps are its voids.
    pub gapless: bool,
    pub period: Option<&'a str>,
    pub reason: Option<Reason>,
    /// Only `pool_discarded` gaps whose pool was emptied for this cause.
    pub cause: Option<&'a str>,
    /// (period, from_seq) of the last gap of the previous page.
    pub after: Option<(String, i64)>,
    pub limit: i64,
}

/// Open gaps of a sequence in (period, position) order: one walk of an
/// index in that order from the cursor, which the page's `LIMIT` ends.
/// The index holds the open gaps of each sequence
/// (`id_gaps_open_by_position`), or of each sequence and reason
/// (`id_gaps_open_by_reason`), so a filter on the period or the reason is
/// a bound of the walk, not rows read and thrown away. A cause is checked
/// on the gaps of its reason, `pool_discarded`; a discarded range's cause
/// is read from the discards it overlaps (`pool_discards_ranges`): one
/// index probe per listed gap.
#[tracing::instrument(skip_all, level = "debug")]
pub async fn list(db: &Db, query: &GapQuery<'_>) -> Result<Vec<Gap>, sqlx::Error> {
    let (after_period, after_seq) = query.after.clone().unwrap_or((String::new(), i64::MIN));
    if query.gapless {
        return voids(db, query, (&after_period, after_seq)).await;
    }
    // A cause belongs to discarded pools only.
    let reason = match (query.reason, query.cause) {
        (None, Some(_)) => Some(Reason::PoolDiscarded),
        (reason, _) => reason,
    };
    if query.cause.is_some() && reason != Some(Reason::PoolDiscarded) {
        return Ok(Vec::new());
    }
    // Each filter is written only when asked for: `$n IS NULL OR ...`
    // would leave the planner a generic plan that cannot bound the walk.
    let mut sql = String::from(
        "SELECT g.period, g.from_seq, g.to_seq, g.from_id, g.to_id, \
                g.to_seq - g.from_seq + 1 AS count, g.reason, \
                CASE WHEN g.reason = 'pool_discarded' THEN \
                  (SELECT string_agg(DISTINCT d.cause, ',' ORDER BY d.cause) FROM pool_discards d \
                   WHERE d.sequence_id = g.sequence_id AND d.period = g.period \
                     AND d.seqs && int8range(g.from_seq, g.to_seq, '[]')) \
                END AS note, \
                g.detected_at \
         FROM id_gaps g \
         WHERE g.sequence_id = $1 AND g.resolved_at IS NULL \
           AND (g.period, g.from_seq) > ($2, $3)",
    );
    if query.period.is_some() {
        sql.push_str(" AND g.period = $5::text");
    }
    if reason.is_some() {
        sql.push_str(" AND g.reason = $6::text");
    }
    if query.cause.is_some() {
        sql.push_str(
            " AND EXISTS (SELECT 1 FROM pool_discards d \
               WHERE d.sequence_id = g.sequence_id AND d.period = g.period AND d.cause = $7::text \
                 AND d.seqs && int8range(g.from_seq, g.to_seq, '[]'))",
        );
    }
    sql.push_str(" ORDER BY g.period, g.from_seq LIMIT $4");
    sqlx::query_as(sqlx::AssertSqlSafe(sql))
        .bind(query.sequence_id)
        .bind(after_period)
        .bind(after_seq)
        .bind(query.limit)
        .bind(query.period)
        .bind(reason.map(Reason::as_str))
        .bind(query.cause)
        .fetch_all(db)
        .await
}

/// The voids of a gapless sequence, one gap per number: reason `voided`
/// (with the caller's note) or `reservation_expired`.
async fn voids(db: &Db, query: &GapQuery<'_>, after: (&str, i64)) -> Result<Vec<Gap>, sqlx::Error> {
    let status = match query.reason {
        None => None,
        Some(Reason::Voided) => Some(ReservationStatus::Voided),
        Some(Reason::ReservationExpired) => Some(ReservationStatus::ReservationExpired),
        // A gapless sequence has no gap of any other reason.
        Some(_) => return Ok(Vec::new()),
    };
    let voids = reservations::voids(
        db,
        query.sequence_id,
        query.period,
        status,
        after,
        query.limit,
    )
    .await?;
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

#[cfg(test)]
mod tests;
