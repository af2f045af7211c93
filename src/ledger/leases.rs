//! What leases leave in the ledger: handouts to callers, and the
//! numbers a lease gives back taken off it.

use super::*;
use crate::db::Link;

#[derive(Debug, Clone)]
pub struct LeaseReport {
    pub sequence_id: i64,
    pub period: String,
    pub seqs: Vec<i64>,
}

/// Takes numbers a lease did not hand out off the ledger, so they can go
/// back to their pool: each lease row holding some is replaced by what is
/// left of it, in one transaction. Before they are pushed back, so no pool
/// ever offers a number the ledger calls issued.
#[tracing::instrument(skip_all, level = "debug")]
pub async fn release_lease(conn: &mut impl Link, unused: &LeaseReport) -> Result<(), sqlx::Error> {
    let released = runs(&unused.seqs);
    let (Some(first), Some(last)) = (released.first(), released.last()) else {
        return Ok(());
    };
    let mut tx = conn.begin().await?;
    let rows = sqlx::query!(
        "DELETE FROM issuance_ledger \
         WHERE sequence_id = $1 AND period = $2 AND via = $3 AND seqs && int8range($4, $5) \
         RETURNING lower(seqs) AS \"start!\", upper(seqs) AS \"end!\"",
        unused.sequence_id,
        &unused.period,
        Via::Lease.as_str(),
        first.start,
        last.end,
    )
    .fetch_all(tx.statements())
    .await?;
    let (mut starts, mut ends) = (Vec::new(), Vec::new());
    for row in rows {
        let (start, end) = (row.start, row.end);
        for kept in subtract(SeqRange::new(start, end), &released) {
            starts.push(kept.start);
            ends.push(kept.end);
        }
    }
    sqlx::query!(
        "INSERT INTO issuance_ledger (sequence_id, period, seqs, via) \
         SELECT $1, $2, int8range(a, b), $3 FROM UNNEST($4::bigint[], $5::bigint[]) AS t(a, b)",
        unused.sequence_id,
        &unused.period,
        Via::Lease.as_str(),
        &starts,
        &ends,
    )
    .execute(tx.statements())
    .await?;
    tx.commit().await
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

/// Of handouts whose commit was in doubt, whether they landed: true when
/// every number is recorded as handed out, false when none is, None when
/// only some are (not one statement's work: still unknown).
pub async fn handouts_landed(
    conn: &mut impl Link,
    handouts: &[LeaseReport],
) -> Result<Option<bool>, sqlx::Error> {
    let (mut sequence_ids, mut periods, mut seqs) = (Vec::new(), Vec::new(), Vec::new());
    for report in handouts {
        for seq in &report.seqs {
            sequence_ids.push(report.sequence_id);
            periods.push(report.period.as_str());
            seqs.push(*seq);
        }
    }
    let found = sqlx::query_scalar!(
        "SELECT count(*) AS \"found!\" \
         FROM UNNEST($1::bigint[], $2::text[], $3::bigint[]) AS w(s, p, seq) \
         WHERE EXISTS (SELECT 1 FROM lease_handouts h \
                       WHERE h.sequence_id = w.s AND h.period = w.p AND h.seqs @> w.seq)",
        &sequence_ids,
        &periods as &[&str],
        &seqs,
    )
    .fetch_one(conn.statements())
    .await? as usize;
    Ok(match found {
        0 => Some(false),
        n if n == seqs.len() => Some(true),
        _ => None,
    })
}
