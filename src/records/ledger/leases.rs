//! What leases leave in the ledger: handouts to callers, and the
//! numbers a lease gives back taken off it.

use super::*;
use crate::infra::db::Link;

#[derive(Debug, Clone)]
pub struct LeaseReport {
    pub sequence_id: i64,
    pub period: String,
    pub seqs: Vec<i64>,
}

/// Takes numbers a lease did not hand out off the ledger, so they can go
/// back to their pool: each lease row holding some is replaced by what is
/// left of it (its expiry kept), in one transaction. Before they are pushed
/// back, so no pool ever offers a number the ledger calls issued. Returns
/// the numbers that may go back: all of `unused` but those of a lease an
/// attach ended (past its expiry, one of its numbers may have gone to a
/// document: they stay the lease's, never issued again). A number found in
/// no lease row was taken off by an earlier try whose commit was in doubt:
/// it goes back too.
#[tracing::instrument(skip_all, level = "debug")]
pub async fn release_lease(
    conn: &mut impl Link,
    unused: &LeaseReport,
) -> Result<Vec<i64>, sqlx::Error> {
    let released = runs(&unused.seqs);
    let (Some(first), Some(last)) = (released.first(), released.last()) else {
        return Ok(Vec::new());
    };
    let mut tx = conn.begin().await?;
    let rows = sqlx::query!(
        "DELETE FROM issuance_ledger \
         WHERE sequence_id = $1 AND period = $2 AND via = $3 AND seqs && int8range($4, $5) \
           AND lease_ended_at IS NULL \
         RETURNING lower(seqs) AS \"start!\", upper(seqs) AS \"end!\", lease_expires_at",
        unused.sequence_id,
        &unused.period,
        Via::Lease.as_str(),
        first.start,
        last.end,
    )
    .fetch_all(tx.statements())
    .await?;
    let (mut starts, mut ends, mut expiries) = (Vec::new(), Vec::new(), Vec::new());
    for row in rows {
        for kept in subtract(SeqRange::new(row.start, row.end), &released) {
            starts.push(kept.start);
            ends.push(kept.end);
            expiries.push(row.lease_expires_at);
        }
    }
    sqlx::query!(
        "INSERT INTO issuance_ledger (sequence_id, period, seqs, via, lease_expires_at) \
         SELECT $1, $2, int8range(a, b), $3, e \
         FROM UNNEST($4::bigint[], $5::bigint[], $6::timestamptz[]) AS t(a, b, e)",
        unused.sequence_id,
        &unused.period,
        Via::Lease.as_str(),
        &starts,
        &ends,
        &expiries as &[Option<DateTime<Utc>>],
    )
    .execute(tx.statements())
    .await?;
    // Rows an attach ended keep their numbers (read after the DELETE,
    // which waited for any ending under way and left those rows alone).
    let ended: Vec<SeqRange> = sqlx::query!(
        "SELECT lower(seqs) AS \"start!\", upper(seqs) AS \"end!\" FROM issuance_ledger \
         WHERE sequence_id = $1 AND period = $2 AND via = $3 AND seqs && int8range($4, $5) \
           AND lease_ended_at IS NOT NULL",
        unused.sequence_id,
        &unused.period,
        Via::Lease.as_str(),
        first.start,
        last.end,
    )
    .fetch_all(tx.statements())
    .await?
    .into_iter()
    .map(|r| SeqRange::new(r.start, r.end))
    .collect();
    tx.commit().await?;
    Ok(unused
        .seqs
        .iter()
        .copied()
        .filter(|seq| !ended.iter().any(|r| r.contains(*seq)))
        .collect())
}

/// What the ledger says of a number an attach names, while its handout
/// record may still be on its way.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaseWait {
    /// Recorded as issued to `POST /ids` (per request or handed out of a
    /// lease), or in a lease that was ended: the attach goes on.
    Settled,
    /// In a lease whose holder may still hand it out or report it: the
    /// attach waits (at most until the lease's expiry).
    Pending,
    /// In a lease past its expiry that nobody ended yet: the attach ends it.
    Expired,
}

/// The state for an attach of each number of `numbers` (sequence id,
/// number); one that is in no lease at all is `Settled` (the attach's own
/// check refuses it if nothing issued it).
pub async fn lease_waits(
    conn: &mut impl Link,
    numbers: &[(i64, i64)],
) -> Result<Vec<LeaseWait>, sqlx::Error> {
    let (sequence_ids, seqs): (Vec<i64>, Vec<i64>) = numbers.iter().copied().unzip();
    let rows = sqlx::query!(
        "SELECT w.s AS \"sequence_id!\", w.seq AS \"seq!\", \
                bool_or(l.lease_expires_at < clock_timestamp()) AS \"expired!\" \
           FROM UNNEST($1::bigint[], $2::bigint[]) AS w(s, seq) \
           JOIN issuance_ledger l ON l.sequence_id = w.s AND l.seqs @> w.seq AND l.via = $3 \
          WHERE l.lease_ended_at IS NULL AND l.lease_expires_at IS NOT NULL \
            AND NOT EXISTS (SELECT 1 FROM lease_handouts h \
                            WHERE h.sequence_id = w.s AND h.period = l.period AND h.seqs @> w.seq) \
          GROUP BY w.s, w.seq",
        &sequence_ids,
        &seqs,
        Via::Lease.as_str(),
    )
    .fetch_all(conn.statements())
    .await?;
    let waiting: HashMap<(i64, i64), bool> = rows
        .into_iter()
        .map(|r| ((r.sequence_id, r.seq), r.expired))
        .collect();
    Ok(numbers
        .iter()
        .map(|number| match waiting.get(number) {
            None => LeaseWait::Settled,
            Some(false) => LeaseWait::Pending,
            Some(true) => LeaseWait::Expired,
        })
        .collect())
}

/// Ends the leases past their expiry holding any of `numbers` (sequence
/// id, number): their holder hands out nothing more of them and gives none
/// of their numbers back, so the numbers can be attached.
pub async fn end_expired_leases(
    conn: &mut impl Link,
    numbers: &[(i64, i64)],
) -> Result<u64, sqlx::Error> {
    let (sequence_ids, seqs): (Vec<i64>, Vec<i64>) = numbers.iter().copied().unzip();
    let ended = sqlx::query!(
        "UPDATE issuance_ledger l SET lease_ended_at = clock_timestamp() \
          FROM UNNEST($1::bigint[], $2::bigint[]) AS w(s, seq) \
          WHERE l.sequence_id = w.s AND l.seqs @> w.seq AND l.via = $3 \
            AND l.lease_ended_at IS NULL AND l.lease_expires_at < clock_timestamp()",
        &sequence_ids,
        &seqs,
        Via::Lease.as_str(),
    )
    .execute(conn.statements())
    .await?;
    Ok(ended.rows_affected())
}

/// Records the handouts in one statement (one row per run of consecutive
/// numbers of a period).
#[tracing::instrument(skip_all, level = "debug")]
pub async fn record_handouts(
    conn: &mut impl Link,
    handouts: &[LeaseReport],
) -> Result<(), sqlx::Error> {
    let mut sequence_ids = Vec::new();
    let mut periods: Vec<&str> = Vec::new();
    let mut starts = Vec::new();
    let mut ends = Vec::new();
    let mut by_period: HashMap<(i64, &str), Vec<i64>> = HashMap::new();
    for report in handouts {
        by_period
            .entry((report.sequence_id, report.period.as_str()))
            .or_default()
            .extend(&report.seqs);
    }
    for ((sequence_id, period), mut seqs) in by_period {
        seqs.sort_unstable();
        seqs.dedup();
        for range in runs(&seqs) {
            sequence_ids.push(sequence_id);
            periods.push(period);
            starts.push(range.start);
            ends.push(range.end);
        }
    }
    if starts.is_empty() {
        return Ok(());
    }
    sqlx::query!(
        "INSERT INTO lease_handouts (sequence_id, period, seqs) \
         SELECT s, p, int8range(a, b) \
         FROM UNNEST($1::bigint[], $2::text[], $3::bigint[], $4::bigint[]) AS t(s, p, a, b)",
        &sequence_ids,
        &periods as &[&str],
        &starts,
        &ends,
    )
    .execute(conn.statements())
    .await?;
    Ok(())
}
