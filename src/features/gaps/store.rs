//! The SQL of reconciliation: runs, marks, checkpoints, the evidence of a
//! period's numbers and the gap rows. The judgement is in `reconcile` and
//! `classify`; nothing here decides.

use crate::infra::db::{Db, Link};
use chrono::{DateTime, Utc};

use super::classify::{GapPiece, Reason};

pub(super) struct ActivePeriod {
    pub(super) sequence_id: i64,
    pub(super) period: String,
    pub(super) next_seq: i64,
    pub(super) checkpoint: i64,
    pub(super) pool_closed: bool,
}

/// One run as recorded in `reconcile_runs`.
pub(super) struct Run {
    pub(super) id: i64,
    /// When it started, by the database's clock.
    pub(super) now: DateTime<Utc>,
    /// When the last finished run started.
    pub(super) previous: Option<DateTime<Utc>>,
}

/// Advisory lock key: one run starts at a time across instances.
const LOCK_KEY: i64 = 0x1d_9001_9a95;

/// Numbers in open gaps, per reason (kept by `id_gaps`' triggers, so a
/// run reads a row per reason, not every open gap).
pub(super) async fn open_gap_totals(db: &Db) -> Result<Vec<(Reason, i64)>, sqlx::Error> {
    let rows = sqlx::query!(
        r#"SELECT reason AS "reason: Reason", numbers AS "numbers!" FROM gap_totals"#,
    )
    .fetch_all(db)
    .await?;
    Ok(rows.into_iter().map(|r| (r.reason, r.numbers)).collect())
}

/// Sequences whose latest period has less than a tenth of its numbers
/// left before its `max` (or none): they will soon refuse every request.
pub(super) async fn sequences_near_max(db: &Db) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar!(
        r#"SELECT count(*) AS "near!" FROM (
             SELECT DISTINCT ON (c.sequence_id) c.next_seq, s.max_seq, s.start_seq
             FROM counters c JOIN sequences s ON s.id = c.sequence_id
             WHERE s.max_seq IS NOT NULL
             ORDER BY c.sequence_id, c.period DESC
           ) latest
           WHERE (latest.max_seq - latest.next_seq + 1) * 10 < latest.max_seq - latest.start_seq + 1"#,
    )
    .fetch_one(db)
    .await
}

/// Records the run's start, by the database's clock, and finds when the
/// last finished run started.
pub(super) async fn start_run(
    conn: &mut impl Link,
    instance_id: &str,
    lease: std::time::Duration,
) -> Result<Option<Run>, sqlx::Error> {
    // A run under way is its row without `finished_at`, younger than
    // `lease`: no lock is held for the run (a session's lock would stay
    // with a server connection a pooler hands to someone else), and one
    // transaction-scoped lock lets one instance at a time look and start.
    let mut tx = conn.begin().await?;
    sqlx::query_scalar!("SELECT pg_advisory_xact_lock($1)", LOCK_KEY)
        .fetch_one(&mut tx)
        .await?;
    let now = sqlx::query_scalar!(r#"SELECT clock_timestamp() AS "now!""#)
        .fetch_one(&mut tx)
        .await?;
    let since = now - chrono::Duration::from_std(lease).unwrap_or_default();
    let running = sqlx::query_scalar!(
        r#"SELECT EXISTS (SELECT 1 FROM reconcile_runs
                          WHERE finished_at IS NULL AND coalesce(alive_at, started_at) > $1) AS "running!""#,
        since,
    )
    .fetch_one(&mut tx)
    .await?;
    if running {
        return Ok(None);
    }
    let previous = sqlx::query_scalar!(
        "SELECT started_at FROM reconcile_runs WHERE finished_at IS NOT NULL ORDER BY id DESC LIMIT 1",
    )
    .fetch_optional(&mut tx)
    .await?;
    let id = sqlx::query_scalar!(
        "INSERT INTO reconcile_runs (instance_id, started_at, alive_at) VALUES ($1, $2, $2) RETURNING id",
        instance_id,
        now,
    )
    .fetch_one(&mut tx)
    .await?;
    tx.commit().await?;
    Ok(Some(Run { id, now, previous }))
}

/// Says run `id` is still under way.
pub(super) async fn still_running(db: &Db, id: i64) -> Result<(), sqlx::Error> {
    sqlx::query!(
        "UPDATE reconcile_runs SET alive_at = clock_timestamp() WHERE id = $1",
        id
    )
    .execute(db)
    .await?;
    Ok(())
}

/// Forgets a run that failed: the next one starts at once, and judges
/// from where the last finished run left off.
pub(super) async fn abandon_run(db: &Db, id: i64) -> Result<(), sqlx::Error> {
    sqlx::query!("DELETE FROM reconcile_runs WHERE id = $1", id)
        .execute(db)
        .await?;
    Ok(())
}

/// Records the run as finished, with what it did.
pub(super) async fn finish_run(
    conn: &mut impl Link,
    id: i64,
    summary: serde_json::Value,
) -> Result<(), sqlx::Error> {
    sqlx::query!(
        "UPDATE reconcile_runs SET finished_at = clock_timestamp(), summary = $2 WHERE id = $1",
        id,
        summary,
    )
    .execute(conn.statements())
    .await?;
    Ok(())
}

/// The highest mark of `period` observed by `settled_before`, and its
/// newest mark.
pub(super) async fn marks(
    conn: &mut impl Link,
    period: &ActivePeriod,
    settled_before: DateTime<Utc>,
) -> Result<(Option<i64>, Option<i64>), sqlx::Error> {
    let row = sqlx::query!(
        "SELECT max(bound) FILTER (WHERE observed_at <= $3) AS settled, \
                (array_agg(bound ORDER BY observed_at DESC))[1] AS newest \
         FROM reconcile_marks WHERE sequence_id = $1 AND period = $2",
        period.sequence_id,
        &period.period,
        settled_before,
    )
    .fetch_one(conn.statements())
    .await?;
    Ok((row.settled, row.newest))
}

/// Moves `period`'s checkpoint to `bound` and drops the marks older than
/// the one that settled it (never needed again).
pub(super) async fn move_checkpoint(
    conn: &mut impl Link,
    period: &ActivePeriod,
    bound: i64,
    settled_before: DateTime<Utc>,
) -> Result<(), sqlx::Error> {
    sqlx::query!(
        "INSERT INTO reconcile_periods (sequence_id, period, checkpoint) VALUES ($1, $2, $3) \
         ON CONFLICT (sequence_id, period) DO UPDATE SET checkpoint = EXCLUDED.checkpoint",
        period.sequence_id,
        &period.period,
        bound,
    )
    .execute(conn.statements())
    .await?;
    sqlx::query!(
        "DELETE FROM reconcile_marks WHERE sequence_id = $1 AND period = $2 AND observed_at < \
         (SELECT max(observed_at) FROM reconcile_marks WHERE sequence_id = $1 AND period = $2 \
          AND observed_at <= $3)",
        period.sequence_id,
        &period.period,
        settled_before,
    )
    .execute(conn.statements())
    .await?;
    Ok(())
}

pub(super) async fn active_periods(conn: &mut impl Link) -> Result<Vec<ActivePeriod>, sqlx::Error> {
    struct Row {
        sequence_id: i64,
        period: String,
        next_seq: i64,
        checkpoint: Option<i64>,
        pool_closed_at: Option<DateTime<Utc>>,
        first_block: Option<i64>,
    }
    // The due periods only (`reconcile_due`): those a reservation took
    // numbers of since everything below their counter was judged.
    let rows = sqlx::query_as!(
        Row,
        "SELECT c.sequence_id, c.period, c.next_seq, r.checkpoint AS \"checkpoint?\", \
                r.pool_closed_at AS \"pool_closed_at?\", \
                CASE WHEN r.checkpoint IS NULL THEN \
                    (SELECT min(lower(b.seqs)) FROM blocks b WHERE b.sequence_id = c.sequence_id AND b.period = c.period) \
                END AS first_block \
         FROM reconcile_due d JOIN counters c USING (sequence_id, period) \
              LEFT JOIN reconcile_periods r USING (sequence_id, period) \
         ORDER BY c.sequence_id, c.period",
    )
    .fetch_all(conn.statements())
    .await?;
    Ok(rows
        .into_iter()
        .map(|row| ActivePeriod {
            sequence_id: row.sequence_id,
            period: row.period,
            next_seq: row.next_seq,
            // No block yet (a counter whose first take rolled back): the
            // counter's own number, below which nothing was taken.
            checkpoint: row.checkpoint.or(row.first_block).unwrap_or(row.next_seq),
            pool_closed: row.pool_closed_at.is_some(),
        })
        .collect())
}

/// Takes `period` off the due list (and drops its marks) once everything
/// below its counter is judged (`judged_to`), unless a reservation moved
/// the counter since:
/// the counter's row is locked first, so one under way is waited for and
/// its numbers keep the period due.
pub(super) async fn settle_due(
    conn: &mut impl Link,
    period: &ActivePeriod,
    judged_to: i64,
) -> Result<bool, sqlx::Error> {
    let mut tx = conn.begin().await?;
    let next = sqlx::query_scalar!(
        "SELECT next_seq FROM counters WHERE sequence_id = $1 AND period = $2 FOR UPDATE",
        period.sequence_id,
        &period.period,
    )
    .fetch_optional(tx.statements())
    .await?;
    let settled = next.is_none_or(|next| next <= judged_to);
    if settled {
        sqlx::query!(
            "DELETE FROM reconcile_due WHERE sequence_id = $1 AND period = $2",
            period.sequence_id,
            &period.period,
        )
        .execute(tx.statements())
        .await?;
        // Its marks are spent: numbers taken later are marked anew.
        sqlx::query!(
            "DELETE FROM reconcile_marks WHERE sequence_id = $1 AND period = $2",
            period.sequence_id,
            &period.period,
        )
        .execute(tx.statements())
        .await?;
    }
    tx.commit().await?;
    Ok(settled)
}

/// Notes that `period`'s pool was closed (its numbers discarded); the
/// counter's next number, below which everything has left.
pub(super) async fn close_pool(
    conn: &mut impl Link,
    period: &ActivePeriod,
) -> Result<i64, sqlx::Error> {
    sqlx::query!(
        "INSERT INTO reconcile_periods (sequence_id, period, checkpoint, pool_closed_at) \
         VALUES ($1, $2, $3, now()) \
         ON CONFLICT (sequence_id, period) DO UPDATE SET pool_closed_at = now()",
        period.sequence_id,
        &period.period,
        period.checkpoint,
    )
    .execute(conn.statements())
    .await?;
    sqlx::query_scalar!(
        "SELECT next_seq FROM counters WHERE sequence_id = $1 AND period = $2",
        period.sequence_id,
        &period.period,
    )
    .fetch_one(conn.statements())
    .await
}

/// The period's counter moved down to `next` (a given-up pool's numbers
/// went back to it): its checkpoint and marks come down with it, so the
/// numbers it hands out again are judged when they settle.
pub(super) async fn lower_to(
    conn: &mut impl Link,
    period: &ActivePeriod,
    next: i64,
) -> Result<(), sqlx::Error> {
    sqlx::query!(
        "UPDATE reconcile_periods SET checkpoint = $3 \
         WHERE sequence_id = $1 AND period = $2 AND checkpoint > $3",
        period.sequence_id,
        &period.period,
        next,
    )
    .execute(conn.statements())
    .await?;
    sqlx::query!(
        "UPDATE reconcile_marks SET bound = $3 \
         WHERE sequence_id = $1 AND period = $2 AND bound > $3",
        period.sequence_id,
        &period.period,
        next,
    )
    .execute(conn.statements())
    .await?;
    Ok(())
}

/// Every number of `period` below `bound` had left the counter and the
/// pool at `now`.
pub(super) async fn add_mark(
    conn: &mut impl Link,
    period: &ActivePeriod,
    now: DateTime<Utc>,
    bound: i64,
) -> Result<(), sqlx::Error> {
    sqlx::query!(
        "INSERT INTO reconcile_marks (sequence_id, period, observed_at, bound) VALUES ($1, $2, $3, $4) \
         ON CONFLICT DO NOTHING",
        period.sequence_id,
        &period.period,
        now,
        bound,
    )
    .execute(conn.statements())
    .await?;
    Ok(())
}

/// Ranges `[start, end)` of numbers whose document, ledger record, discard
/// or handout changed since `since` in a way the open gaps contradict: a
/// document whose status disagrees with them, a ledger record or discard
/// of a number judged never issued (a late write, a late discard record).
pub(super) async fn contradicting_changes(
    conn: &mut impl Link,
    since: DateTime<Utc>,
) -> Result<Vec<(i64, String, i64, i64)>, sqlx::Error> {
    let mut changed = documents_contradicting(conn, since).await?;
    let late: [(LateRuns, &[Reason]); 4] = [
        // A late ledger write of a number judged lost or discarded.
        (
            LateRuns::Ledger,
            &[Reason::UntrackedLoss, Reason::PoolDiscarded],
        ),
        // A number judged lease-lost while its lease was still held (a
        // settle time shorter than a lease lives), then given back and
        // issued again: a late record of it issued, not leased (its own
        // lease row, or what is left of it after a return, says nothing
        // new, and would have every run judge the gap again).
        (LateRuns::LedgerIssued, &[Reason::LeaseLost]),
        // A late discard record of a number judged lost or lease-lost.
        (
            LateRuns::Discards,
            &[Reason::UntrackedLoss, Reason::LeaseLost],
        ),
        // A late handout record of a number judged lease-lost.
        (LateRuns::Handouts, &[Reason::LeaseLost]),
    ];
    for (table, reasons) in late {
        changed.extend(late_runs(conn, table, since, reasons).await?);
    }
    Ok(changed)
}

/// Documents whose status changed since `since` and disagrees with the
/// open gaps: dead-lettered or abandoned without the gap that says so, or
/// pending or delivered inside a gap. Not a probe of the gaps per changed
/// document: an import of hundreds of thousands of documents inside the
/// lookback had every run probe them all (3.6 s with 300,000 and 51 open
/// gaps). Ended documents come from their own partial index (migration
/// 0023; the statuses are literals so that the planner may use it). A
/// document inside a gap is looked up only in the open gaps of periods
/// whose documents changed, a probe of the documents' index per gap, so a
/// run costs what changed: probing every open gap made it cost what
/// history left (an idle sequence keeps its unattached numbers' gap open).
/// `OFFSET 0` keeps the planner from turning the probe around, as it
/// cannot tell a gap spans a few numbers, and reading all the period's
/// documents when let.
async fn documents_contradicting(
    conn: &mut impl Link,
    since: DateTime<Utc>,
) -> Result<Vec<(i64, String, i64, i64)>, sqlx::Error> {
    let rows = sqlx::query!(
        "SELECT o.sequence_id AS \"sequence_id!\", o.period AS \"period!\", o.seq AS \"seq!\", \
                o.seq + 1 AS \"end!\" FROM id_outbox o \
           JOIN reconcile_periods r ON r.sequence_id = o.sequence_id AND r.period = o.period \
          WHERE o.status IN ('dead_letter', 'abandoned') AND o.status_changed_at > $1 \
            AND o.seq < r.checkpoint \
            AND NOT EXISTS (SELECT 1 FROM id_gaps g WHERE g.sequence_id = o.sequence_id \
                AND g.period = o.period AND g.resolved_at IS NULL \
                AND g.reason = CASE o.status WHEN 'dead_letter' THEN $2 ELSE $3 END \
                AND int8range(g.from_seq, g.to_seq, '[]') @> o.seq) \
         UNION ALL \
         SELECT o.sequence_id, o.period, o.seq, o.seq + 1 \
           FROM (SELECT DISTINCT c.sequence_id, c.period FROM id_outbox c \
                  WHERE c.status_changed_at > $1 AND c.status NOT IN ('dead_letter', 'abandoned')) changed \
           JOIN id_gaps g ON g.sequence_id = changed.sequence_id AND g.period = changed.period \
           JOIN reconcile_periods r ON r.sequence_id = g.sequence_id AND r.period = g.period \
           CROSS JOIN LATERAL (SELECT o.sequence_id, o.period, o.seq FROM id_outbox o \
             WHERE o.sequence_id = g.sequence_id AND o.period = g.period \
               AND o.seq >= g.from_seq AND o.seq <= least(g.to_seq, r.checkpoint - 1) \
               AND o.status_changed_at > $1 AND o.status NOT IN ('dead_letter', 'abandoned') \
             OFFSET 0) o \
          WHERE g.resolved_at IS NULL",
        since,
        Reason::OutboxDlq.as_str(),
        Reason::Abandoned.as_str(),
    )
    .fetch_all(conn.statements())
    .await?;
    Ok(rows
        .into_iter()
        .map(|r| (r.sequence_id, r.period, r.seq, r.end))
        .collect())
}

/// Tables of runs of numbers with the time each run was written.
#[derive(Clone, Copy)]
enum LateRuns {
    Ledger,
    /// The ledger's records of numbers issued, not leased.
    LedgerIssued,
    Discards,
    Handouts,
}

impl LateRuns {
    /// The table, its time column and a condition on its rows (ours,
    /// never caller input).
    fn source(self) -> (&'static str, &'static str, &'static str) {
        match self {
            Self::Ledger => ("issuance_ledger", "issued_at", ""),
            Self::LedgerIssued => ("issuance_ledger", "issued_at", " AND t.via <> 'lease'"),
            Self::Discards => ("pool_discards", "discarded_at", ""),
            Self::Handouts => ("lease_handouts", "reported_at", ""),
        }
    }
}

/// The parts of runs of `table` written since `since` that fall in open
/// gaps of one of `reasons`.
async fn late_runs(
    conn: &mut impl Link,
    table: LateRuns,
    since: DateTime<Utc>,
    reasons: &[Reason],
) -> Result<Vec<(i64, String, i64, i64)>, sqlx::Error> {
    let (name, written_at, rows) = table.source();
    let query = format!(
        "SELECT t.sequence_id, t.period, greatest(lower(t.seqs), g.from_seq), least(upper(t.seqs), g.to_seq + 1) \
           FROM {name} t JOIN id_gaps g ON g.sequence_id = t.sequence_id AND g.period = t.period \
            AND g.resolved_at IS NULL AND g.reason = ANY($2) \
            AND int8range(g.from_seq, g.to_seq, '[]') && t.seqs \
          WHERE t.{written_at} > $1{rows}"
    );
    let reasons: Vec<&str> = reasons.iter().map(|r| r.as_str()).collect();
    sqlx::query_as(sqlx::AssertSqlSafe(query))
        .bind(since)
        .bind(&reasons)
        .fetch_all(conn.statements())
        .await
}

pub(super) async fn resolve_gaps(
    conn: &mut impl Link,
    ids: &[i64],
    now: DateTime<Utc>,
) -> Result<(), sqlx::Error> {
    sqlx::query!(
        "UPDATE id_gaps SET resolved_at = $2 WHERE id = ANY($1)",
        ids,
        now
    )
    .execute(conn.statements())
    .await?;
    Ok(())
}

/// Inserts new gaps, `from_ids[i]` and `to_ids[i]` printing the ends of
/// `pieces[i]`.
pub(super) async fn insert_gaps(
    conn: &mut impl Link,
    sequence_id: i64,
    period: &str,
    pieces: &[GapPiece],
    from_ids: &[String],
    to_ids: &[String],
) -> Result<(), sqlx::Error> {
    let starts: Vec<i64> = pieces.iter().map(|p| p.range.start).collect();
    let lasts: Vec<i64> = pieces.iter().map(|p| p.range.last()).collect();
    let reasons: Vec<&str> = pieces.iter().map(|p| p.reason.as_str()).collect();
    let detected: Vec<DateTime<Utc>> = pieces.iter().map(|p| p.detected_at).collect();
    sqlx::query!(
        "INSERT INTO id_gaps (sequence_id, period, from_seq, to_seq, from_id, to_id, reason, detected_at) \
         SELECT $1, $2, f, t, fi, ti, r, d \
         FROM UNNEST($3::bigint[], $4::bigint[], $5::text[], $6::text[], $7::text[], $8::timestamptz[]) \
              AS u(f, t, fi, ti, r, d)",
        sequence_id,
        period,
        &starts,
        &lasts,
        from_ids,
        to_ids,
        &reasons as &[&str],
        &detected,
    )
    .execute(conn.statements())
    .await?;
    Ok(())
}

/// When `seq` was issued, or else reserved from the counter; None when
/// nothing records either.
pub(super) async fn issue_time(
    conn: &mut impl Link,
    sequence_id: i64,
    period: &str,
    seq: i64,
) -> Result<Option<DateTime<Utc>>, sqlx::Error> {
    sqlx::query_scalar!(
        "SELECT coalesce( \
            (SELECT issued_at FROM issuance_ledger WHERE sequence_id = $1 AND period = $2 AND seqs @> $3::bigint), \
            (SELECT reserved_at FROM blocks WHERE sequence_id = $1 AND period = $2 AND seqs @> $3::bigint))",
        sequence_id,
        period,
        seq,
    )
    .fetch_one(conn.statements())
    .await
}

/// A period of a gapless sequence with numbers not checked yet.
pub(super) struct GaplessPeriod {
    pub(super) sequence_id: i64,
    pub(super) period: String,
    pub(super) next_seq: i64,
    /// Every number below was checked (None: none was).
    pub(super) checked_below: Option<i64>,
}

pub(super) async fn gapless_periods(
    conn: &mut impl Link,
) -> Result<Vec<GaplessPeriod>, sqlx::Error> {
    sqlx::query_as!(
        GaplessPeriod,
        "SELECT c.sequence_id, c.period, c.next_seq, k.checked_below AS \"checked_below?\" \
         FROM counters c JOIN sequences s ON s.id = c.sequence_id AND s.numbering = 'gapless' \
              LEFT JOIN gapless_checkpoints k USING (sequence_id, period) \
         WHERE k.checked_below IS NULL OR k.checked_below < c.next_seq \
         ORDER BY c.sequence_id, c.period",
    )
    .fetch_all(conn.statements())
    .await
}

/// Numbers of `[from, to)` of a gapless period that are neither a
/// document nor a reservation, ascending (at most `limit`).
pub(super) async fn gapless_holes(
    conn: &mut impl Link,
    period: &GaplessPeriod,
    (from, to): (i64, i64),
    limit: i64,
) -> Result<Vec<i64>, sqlx::Error> {
    // Set differences of three range reads (each an index range scan):
    // linear in the span whatever plan is cached, where a probe per number
    // could become a scan of the sequence's rows per number.
    sqlx::query_scalar!(
        "SELECT n AS \"n!\" FROM ( \
             SELECT n FROM generate_series($3::bigint, $4::bigint - 1) AS n \
             EXCEPT SELECT seq FROM id_outbox \
                    WHERE sequence_id = $1 AND period = $2 AND seq >= $3 AND seq < $4 \
             EXCEPT SELECT seq FROM gapless_reservations \
                    WHERE sequence_id = $1 AND period = $2 AND seq >= $3 AND seq < $4) AS holes \
         ORDER BY n LIMIT $5",
        period.sequence_id,
        &period.period,
        from,
        to,
        limit,
    )
    .fetch_all(conn.statements())
    .await
}

pub(super) async fn move_gapless_checkpoint(
    conn: &mut impl Link,
    period: &GaplessPeriod,
    checked_below: i64,
) -> Result<(), sqlx::Error> {
    sqlx::query!(
        "INSERT INTO gapless_checkpoints (sequence_id, period, checked_below) VALUES ($1, $2, $3) \
         ON CONFLICT (sequence_id, period) DO UPDATE SET checked_below = EXCLUDED.checked_below",
        period.sequence_id,
        &period.period,
        checked_below,
    )
    .execute(conn.statements())
    .await?;
    Ok(())
}

#[cfg(test)]
mod tests;
