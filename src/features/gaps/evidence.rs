//! The evidence of a period's numbers: every row that says what became of
//! the numbers in some windows (blocks, ledger, handouts, documents,
//! discards), and the open gaps near them. Read by reconciliation only.

use std::collections::HashMap;

use crate::infra::db::Link;
use chrono::{DateTime, Utc};

use super::classify::{Evidence, OpenGap, Reason};
use crate::domain::numbers::{SeqRange, merge};
use crate::records::ledger::Via;
use crate::records::ledger::outbox_rows::DocumentStatus;

/// Evidence for some windows, plus what is needed to print IDs.
pub(super) struct FetchedEvidence {
    pub(super) ranges: Evidence,
    /// (range, reserved_at) of blocks, (range, issued_at) of ledger rows.
    pub(super) block_times: Vec<(SeqRange, DateTime<Utc>)>,
    pub(super) issue_times: Vec<(SeqRange, DateTime<Utc>)>,
    pub(super) document_ids: HashMap<i64, String>,
    pub(super) rows_read: i64,
}

/// The tables that hold runs of a period's numbers and nothing the
/// judgement needs besides them.
#[derive(Clone, Copy)]
pub(super) enum RunsTable {
    LeaseHandouts,
    PoolDiscards,
}

impl RunsTable {
    fn name(self) -> &'static str {
        match self {
            Self::LeaseHandouts => "lease_handouts",
            Self::PoolDiscards => "pool_discards",
        }
    }
}

/// The runs of `table` that overlap the windows `[los[i], his[i])`.
pub(super) async fn overlapping_runs(
    conn: &mut impl Link,
    table: RunsTable,
    sequence_id: i64,
    period: &str,
    los: &[i64],
    his: &[i64],
) -> Result<Vec<(i64, i64)>, sqlx::Error> {
    // The table name is one of ours, never caller input.
    let query = format!(
        "SELECT DISTINCT lower(t.seqs), upper(t.seqs) \
         FROM UNNEST($3::bigint[], $4::bigint[]) AS w(lo, hi) \
         JOIN {} t ON t.sequence_id = $1 AND t.period = $2 AND t.seqs && int8range(w.lo, w.hi) \
         ORDER BY 1",
        table.name()
    );
    sqlx::query_as(sqlx::AssertSqlSafe(query))
        .bind(sequence_id)
        .bind(period)
        .bind(los)
        .bind(his)
        .fetch_all(conn.statements())
        .await
}

/// Rows of one period whose numbers fall in some windows `[los[i], his[i])`.
struct Windows<'a> {
    sequence_id: i64,
    period: &'a str,
    los: Vec<i64>,
    his: Vec<i64>,
}

type Blocks = Vec<(i64, i64, DateTime<Utc>)>;
/// (start, end, issued_at, leased).
type LedgerRows = Vec<(i64, i64, DateTime<Utc>, bool)>;
type DocumentsSeen = Vec<(i64, DocumentStatus, String)>;

/// Every statement of `Windows` binds the same four: `$1` sequence, `$2`
/// period, `$3` and `$4` the windows' starts and ends.
impl Windows<'_> {
    async fn blocks(&self, conn: &mut impl Link) -> Result<Blocks, sqlx::Error> {
        let rows = sqlx::query!(
            "SELECT DISTINCT lower(b.seqs) AS \"start!\", upper(b.seqs) AS \"end!\", b.reserved_at \
             FROM UNNEST($3::bigint[], $4::bigint[]) AS w(lo, hi) \
             JOIN blocks b ON b.sequence_id = $1 AND b.period = $2 AND b.seqs && int8range(w.lo, w.hi) \
             ORDER BY 1",
            self.sequence_id,
            self.period,
            &self.los,
            &self.his,
        )
        .fetch_all(conn.statements())
        .await?;
        Ok(rows
            .into_iter()
            .map(|r| (r.start, r.end, r.reserved_at))
            .collect())
    }

    async fn ledger(&self, conn: &mut impl Link) -> Result<LedgerRows, sqlx::Error> {
        let rows = sqlx::query!(
            "SELECT DISTINCT lower(l.seqs) AS \"start!\", upper(l.seqs) AS \"end!\", l.issued_at, \
                    l.via = $5 AS \"leased!\" \
             FROM UNNEST($3::bigint[], $4::bigint[]) AS w(lo, hi) \
             JOIN issuance_ledger l ON l.sequence_id = $1 AND l.period = $2 AND l.seqs && int8range(w.lo, w.hi) \
             ORDER BY 1",
            self.sequence_id,
            self.period,
            &self.los,
            &self.his,
            Via::Lease.as_str(),
        )
        .fetch_all(conn.statements())
        .await?;
        Ok(rows
            .into_iter()
            .map(|r| (r.start, r.end, r.issued_at, r.leased))
            .collect())
    }

    async fn documents(&self, conn: &mut impl Link) -> Result<DocumentsSeen, sqlx::Error> {
        let rows = sqlx::query!(
            "SELECT DISTINCT o.seq, o.status::text AS \"status!: DocumentStatus\", o.document_id \
             FROM UNNEST($3::bigint[], $4::bigint[]) AS w(lo, hi) \
             JOIN id_outbox o ON o.sequence_id = $1 AND o.period = $2 AND o.seq >= w.lo AND o.seq < w.hi \
             ORDER BY 1",
            self.sequence_id,
            self.period,
            &self.los,
            &self.his,
        )
        .fetch_all(conn.statements())
        .await?;
        Ok(rows
            .into_iter()
            .map(|r| (r.seq, r.status, r.document_id))
            .collect())
    }

    async fn runs(
        &self,
        conn: &mut impl Link,
        table: RunsTable,
    ) -> Result<Vec<(i64, i64)>, sqlx::Error> {
        overlapping_runs(
            conn,
            table,
            self.sequence_id,
            self.period,
            &self.los,
            &self.his,
        )
        .await
    }
}

/// Everything that says what became of the numbers in `windows`.
pub(super) async fn fetch_evidence(
    conn: &mut impl Link,
    sequence_id: i64,
    period: &str,
    windows: &[SeqRange],
) -> Result<FetchedEvidence, sqlx::Error> {
    let windows = Windows {
        sequence_id,
        period,
        los: windows.iter().map(|w| w.start).collect(),
        his: windows.iter().map(|w| w.end).collect(),
    };
    let blocks = windows.blocks(conn).await?;
    let ledger = windows.ledger(conn).await?;
    let handouts = windows.runs(conn, RunsTable::LeaseHandouts).await?;
    let documents = windows.documents(conn).await?;
    let discards = windows.runs(conn, RunsTable::PoolDiscards).await?;
    Ok(FetchedEvidence::of(
        blocks, ledger, handouts, documents, discards,
    ))
}

impl FetchedEvidence {
    fn of(
        blocks: Blocks,
        ledger: LedgerRows,
        handouts: Vec<(i64, i64)>,
        documents: DocumentsSeen,
        discards: Vec<(i64, i64)>,
    ) -> Self {
        let rows_read =
            (blocks.len() + ledger.len() + handouts.len() + documents.len() + discards.len())
                as i64;
        let ledger_part = |lease: bool| -> Vec<(i64, i64)> {
            ledger
                .iter()
                .filter(|(_, _, _, leased)| *leased == lease)
                .map(|(s, e, _, _)| (*s, *e))
                .collect()
        };
        let seq_ranges = |rows: &[(i64, i64)]| -> Vec<SeqRange> {
            merge(rows.iter().map(|(s, e)| SeqRange::new(*s, *e)).collect())
        };
        Self {
            ranges: Evidence {
                taken: seq_ranges(&blocks.iter().map(|(s, e, _)| (*s, *e)).collect::<Vec<_>>()),
                issued: seq_ranges(&ledger_part(false)),
                leased: seq_ranges(&ledger_part(true)),
                handed_out: seq_ranges(&handouts),
                documents: documents
                    .iter()
                    .map(|(seq, status, _)| (*seq, *status))
                    .collect(),
                discarded: seq_ranges(&discards),
            },
            block_times: (blocks
                .iter()
                .map(|(s, e, t)| (SeqRange::new(*s, *e), *t))
                .collect()),
            issue_times: (ledger
                .iter()
                .map(|(s, e, t, _)| (SeqRange::new(*s, *e), *t))
                .collect()),
            document_ids: documents
                .into_iter()
                .map(|(seq, _, id)| (seq, id))
                .collect(),
            rows_read,
        }
    }
}

/// Open gaps overlapping or touching the windows, with their printed IDs.
pub(super) async fn open_gaps_near(
    conn: &mut impl Link,
    sequence_id: i64,
    period: &str,
    windows: &[SeqRange],
) -> Result<Vec<(OpenGap, String, String)>, sqlx::Error> {
    let los: Vec<i64> = windows.iter().map(|w| w.start - 1).collect();
    let his: Vec<i64> = windows.iter().map(|w| w.end).collect();
    struct Row {
        id: i64,
        from_seq: i64,
        to_seq: i64,
        reason: Reason,
        detected_at: DateTime<Utc>,
        from_id: String,
        to_id: String,
    }
    let rows = sqlx::query_as!(
        Row,
        "SELECT DISTINCT g.id, g.from_seq, g.to_seq, g.reason AS \"reason: Reason\", g.detected_at, \
                g.from_id, g.to_id \
         FROM UNNEST($3::bigint[], $4::bigint[]) AS w(lo, hi) \
         JOIN id_gaps g ON g.sequence_id = $1 AND g.period = $2 AND g.resolved_at IS NULL \
          AND int8range(g.from_seq, g.to_seq, '[]') && int8range(w.lo, w.hi, '[]') \
         ORDER BY 2",
        sequence_id,
        period,
        &los,
        &his,
    )
    .fetch_all(conn.statements())
    .await?;
    Ok(rows
        .into_iter()
        .map(|row| {
            (
                OpenGap {
                    row_id: row.id,
                    range: SeqRange::new(row.from_seq, row.to_seq + 1),
                    reason: row.reason,
                    detected_at: row.detected_at,
                },
                row.from_id,
                row.to_id,
            )
        })
        .collect())
}
