//! Reservations of gapless sequences (`gapless_reservations`): numbers
//! `POST /ids` reserved, each confirmed by a document, voided with the
//! caller's reason, or voided when its deadline passed. Rows are kept for
//! good: with the documents they account for every number of a gapless
//! sequence.

use crate::infra::db::{Db, Link};
use chrono::{DateTime, Utc};
use serde::Serialize;
use utoipa::ToSchema;

/// Where a reservation stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, ToSchema, strum::IntoStaticStr)]
#[serde(rename_all = "snake_case")]
#[strum(serialize_all = "snake_case")]
pub enum ReservationStatus {
    Reserved,
    /// A document was attached to it.
    Confirmed,
    /// Voided by a caller, with a reason.
    Voided,
    /// Neither confirmed nor voided by its deadline.
    ReservationExpired,
}

impl ReservationStatus {
    pub fn as_str(self) -> &'static str {
        self.into()
    }

    fn parse(word: &str) -> Option<Self> {
        [
            Self::Reserved,
            Self::Confirmed,
            Self::Voided,
            Self::ReservationExpired,
        ]
        .into_iter()
        .find(|s| s.as_str() == word)
    }
}

/// Numbers reserved together, and the IDs they print.
pub struct NewReservations<'a> {
    pub sequence_id: i64,
    pub period: &'a str,
    pub seqs: &'a [i64],
    pub ids: &'a [String],
    pub reserved_at: DateTime<Utc>,
    pub reserved_until: DateTime<Utc>,
}

/// Records reservations in the caller's transaction (the one that took
/// their numbers from the counter).
pub async fn insert(conn: &mut impl Link, new: &NewReservations<'_>) -> Result<(), sqlx::Error> {
    sqlx::query!(
        "INSERT INTO gapless_reservations (sequence_id, period, seq, id, reserved_at, reserved_until) \
         SELECT $1, $2, s, i, $5, $6 FROM UNNEST($3::bigint[], $4::text[]) AS u(s, i)",
        new.sequence_id,
        new.period,
        new.seqs,
        new.ids,
        new.reserved_at,
        new.reserved_until,
    )
    .execute(conn.statements())
    .await?;
    Ok(())
}

/// One reservation as recorded.
#[derive(Debug, Clone)]
pub struct Reservation {
    pub period: String,
    pub seq: i64,
    pub id: String,
    pub status: ReservationStatus,
    pub reserved_at: DateTime<Utc>,
    pub reserved_until: DateTime<Utc>,
    pub reason: Option<String>,
    pub voided_at: Option<DateTime<Utc>>,
}

/// The reservation of `seq` printed as `id` in the sequence, locked until
/// the caller's transaction ends (so a confirmation, a void and the
/// expiry sweep see it one at a time).
pub async fn lock(
    conn: &mut impl Link,
    sequence_id: i64,
    seq: i64,
    id: &str,
) -> Result<Option<Reservation>, sqlx::Error> {
    let row = sqlx::query!(
        "SELECT period, seq, id, status, reserved_at, reserved_until, reason, voided_at \
         FROM gapless_reservations WHERE sequence_id = $1 AND seq = $2 AND id = $3 FOR UPDATE",
        sequence_id,
        seq,
        id,
    )
    .fetch_optional(conn.statements())
    .await?;
    Ok(row.and_then(|r| {
        Some(Reservation {
            status: ReservationStatus::parse(&r.status)?,
            period: r.period,
            seq: r.seq,
            id: r.id,
            reserved_at: r.reserved_at,
            reserved_until: r.reserved_until,
            reason: r.reason,
            voided_at: r.voided_at,
        })
    }))
}

/// Marks a locked reservation confirmed (a document was attached).
pub async fn confirm(
    conn: &mut impl Link,
    sequence_id: i64,
    reservation: &Reservation,
) -> Result<(), sqlx::Error> {
    sqlx::query!(
        "UPDATE gapless_reservations SET status = 'confirmed' \
         WHERE sequence_id = $1 AND period = $2 AND seq = $3",
        sequence_id,
        &reservation.period,
        reservation.seq,
    )
    .execute(conn.statements())
    .await?;
    Ok(())
}

/// Voids a locked reservation: `voided` with the caller's reason, or
/// `reservation_expired` (no reason); returns when.
pub async fn void(
    conn: &mut impl Link,
    sequence_id: i64,
    reservation: &Reservation,
    status: ReservationStatus,
    reason: Option<&str>,
    now: DateTime<Utc>,
) -> Result<DateTime<Utc>, sqlx::Error> {
    sqlx::query!(
        "UPDATE gapless_reservations SET status = $4, reason = $5, voided_at = $6 \
         WHERE sequence_id = $1 AND period = $2 AND seq = $3",
        sequence_id,
        &reservation.period,
        reservation.seq,
        status.as_str(),
        reason,
        now,
    )
    .execute(conn.statements())
    .await?;
    Ok(now)
}

/// Voids up to `limit` reservations whose deadline passed before `now`, as
/// `reservation_expired`; rows another transaction holds (a confirmation
/// or a void under way) are left to it. Exactly once: a row leaves
/// `reserved` in one transaction only. Returns how many.
pub async fn expire_due(db: &Db, now: DateTime<Utc>, limit: i64) -> Result<u64, sqlx::Error> {
    let expired = sqlx::query!(
        "UPDATE gapless_reservations r SET status = 'reservation_expired', voided_at = $1 \
         FROM (SELECT sequence_id, period, seq FROM gapless_reservations \
               WHERE status = 'reserved' AND reserved_until <= $1 \
               ORDER BY reserved_until LIMIT $2 FOR UPDATE SKIP LOCKED) due \
         WHERE r.sequence_id = due.sequence_id AND r.period = due.period AND r.seq = due.seq",
        now,
        limit,
    )
    .execute(db)
    .await?;
    Ok(expired.rows_affected())
}

/// A void as the gap list shows it.
#[derive(Debug, Clone)]
pub struct Void {
    pub period: String,
    pub seq: i64,
    pub id: String,
    pub status: ReservationStatus,
    /// The caller's reason (voids by a caller only).
    pub note: Option<String>,
    pub voided_at: DateTime<Utc>,
}

/// Reservations of the sequence neither confirmed nor voided, counted up
/// to `up_to` (the count costs no more than the cap).
pub async fn open_count(
    conn: &mut impl Link,
    sequence_id: i64,
    up_to: i64,
) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar!(
        r#"SELECT count(*) AS "open!" FROM (
             SELECT 1 FROM gapless_reservations
             WHERE sequence_id = $1 AND status = 'reserved' LIMIT $2
           ) open"#,
        sequence_id,
        up_to,
    )
    .fetch_one(conn.statements())
    .await
}

/// Voids of one sequence in (period, number) order after `after`, up to
/// `limit`, of one period and one status if asked.
pub async fn voids(
    db: &Db,
    sequence_id: i64,
    period: Option<&str>,
    status: Option<ReservationStatus>,
    after: (&str, i64),
    limit: i64,
) -> Result<Vec<Void>, sqlx::Error> {
    let rows = sqlx::query!(
        "SELECT period, seq, id, status, reason, voided_at AS \"voided_at!\" \
         FROM gapless_reservations \
         WHERE sequence_id = $1 AND status IN ('voided', 'reservation_expired') \
           AND ($2::text IS NULL OR period = $2) AND ($3::text IS NULL OR status = $3) \
           AND (period, seq) > ($4, $5) \
         ORDER BY period, seq LIMIT $6",
        sequence_id,
        period,
        status.map(ReservationStatus::as_str),
        after.0,
        after.1,
        limit,
    )
    .fetch_all(db)
    .await?;
    Ok(rows
        .into_iter()
        .filter_map(|r| {
            Some(Void {
                status: ReservationStatus::parse(&r.status)?,
                period: r.period,
                seq: r.seq,
                id: r.id,
                note: r.reason,
                voided_at: r.voided_at,
            })
        })
        .collect())
}

/// The highest number of `period` a gapless sequence gave a document or a
/// reservation, and how many of its numbers are voids (a gapless
/// sequence's live figures: it has no ledger rows).
pub async fn last_taken_and_voids(
    db: &Db,
    sequence_id: i64,
    period: &str,
) -> Result<(Option<i64>, i64), sqlx::Error> {
    let row = sqlx::query!(
        "SELECT greatest( \
             (SELECT max(seq) FROM id_outbox WHERE sequence_id = $1 AND period = $2), \
             (SELECT max(seq) FROM gapless_reservations WHERE sequence_id = $1 AND period = $2) \
         ) AS last, \
         (SELECT count(*) FROM gapless_reservations \
          WHERE sequence_id = $1 AND status IN ('voided', 'reservation_expired')) AS \"voids!\"",
        sequence_id,
        period,
    )
    .fetch_one(db)
    .await?;
    Ok((row.last, row.voids))
}

/// Appends the anulación of VERI*FACTU document `id` of the sequence with
/// the caller's reason, in the caller's transaction; its time. None when
/// the ID carries no document of it, or was annulled already.
pub async fn annul(
    conn: &mut impl Link,
    sequence_id: i64,
    id: &str,
    reason: &str,
) -> Result<Option<DateTime<Utc>>, sqlx::Error> {
    sqlx::query_scalar("SELECT idpool_register_annul($1, $2, $3)")
        .bind(sequence_id)
        .bind(id)
        .bind(reason)
        .fetch_one(conn.statements())
        .await
}

/// When document `id` of the sequence was annulled, and why.
pub async fn annulment(
    conn: &mut impl Link,
    sequence_id: i64,
    id: &str,
) -> Result<Option<(String, DateTime<Utc>)>, sqlx::Error> {
    sqlx::query_as(
        "SELECT coalesce(note, ''), at FROM register_entries \
          WHERE sequence_id = $1 AND id = $2 AND event = 'annulled'",
    )
    .bind(sequence_id)
    .bind(id)
    .fetch_optional(conn.statements())
    .await
}
