//! The issuance ledger: every number handed to a caller, written before the
//! caller hears of it.
//!
//! Writes of concurrent requests share one statement and one commit, and
//! numbers that follow each other become one range row, so a burst of 64
//! single-ID requests on one sequence is usually one row. The table's
//! exclusion constraint refuses any number issued before; such a number
//! (a stale pool list) is reported back so the caller can take another.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use sqlx::PgPool;
use tokio::sync::oneshot;

use crate::batch::Batcher;
use crate::counter::Via;
use crate::numbers::{SeqRange, runs, subtract};
use crate::stats::Stats;

#[derive(Debug, thiserror::Error)]
pub enum LedgerError {
    #[error("ledger write failed: {0}")]
    Db(String),
    #[error("the ledger writer has stopped")]
    Closed,
}

struct Write {
    sequence_id: i64,
    period: String,
    seqs: Vec<i64>,
    via: Via,
    reply: oneshot::Sender<Result<Vec<i64>, LedgerError>>,
}

#[derive(Clone)]
pub struct Ledger {
    writes: Batcher<Write>,
}

/// Rounds of "find what is taken, insert the rest" before a number that
/// keeps conflicting is given up as issued.
const CONFLICT_ROUNDS: usize = 3;

impl Ledger {
    pub fn spawn(db: PgPool, stats: Arc<Stats>, max_in_flight: usize) -> Self {
        let (writes, _collector) = Batcher::spawn(2048, max_in_flight, move |batch| {
            write_batch(db.clone(), stats.clone(), batch)
        });
        Self { writes }
    }

    /// Records `seqs` as issued. Returns the numbers the ledger refused
    /// because they were issued before; the rest are committed.
    pub async fn record(
        &self,
        sequence_id: i64,
        period: &str,
        seqs: &[i64],
        via: Via,
    ) -> Result<Vec<i64>, LedgerError> {
        if seqs.is_empty() {
            return Ok(Vec::new());
        }
        let (reply, answer) = oneshot::channel();
        self.writes
            .submit(Write {
                sequence_id,
                period: period.to_owned(),
                seqs: seqs.to_vec(),
                via,
                reply,
            })
            .await
            .map_err(|_| LedgerError::Closed)?;
        answer.await.map_err(|_| LedgerError::Closed)?
    }
}

#[derive(Clone, PartialEq, Eq, Hash)]
struct Group {
    sequence_id: i64,
    period: String,
    via: Via,
}

struct Row {
    group: usize,
    range: SeqRange,
}

async fn write_batch(db: PgPool, stats: Arc<Stats>, batch: Vec<Write>) {
    let mut groups: Vec<Group> = Vec::new();
    let mut group_index: HashMap<Group, usize> = HashMap::new();
    let mut claimed: Vec<HashSet<i64>> = Vec::new();
    // Per write: its group, and numbers it repeats (a list holding a number
    // twice, or two requests of this batch popping the same one), which it
    // must not get.
    let mut placed: Vec<(usize, Vec<i64>)> = Vec::with_capacity(batch.len());
    for write in &batch {
        let group = Group {
            sequence_id: write.sequence_id,
            period: write.period.clone(),
            via: write.via,
        };
        let index = *group_index.entry(group.clone()).or_insert_with(|| {
            groups.push(group);
            claimed.push(HashSet::new());
            groups.len() - 1
        });
        let repeats = write
            .seqs
            .iter()
            .copied()
            .filter(|seq| !claimed[index].insert(*seq))
            .collect();
        placed.push((index, repeats));
    }
    let rows: Vec<Row> = claimed
        .iter()
        .enumerate()
        .flat_map(|(group, seqs)| {
            let seqs: Vec<i64> = seqs.iter().copied().collect();
            runs(&seqs)
                .into_iter()
                .map(move |range| Row { group, range })
        })
        .collect();

    let refused = match insert_resolving_conflicts(&db, &stats, &groups, rows).await {
        Ok(refused) => refused,
        Err(e) => {
            tracing::error!(error = %e, "ledger batch failed");
            for write in batch {
                let _ = write.reply.send(Err(LedgerError::Db(e.to_string())));
            }
            return;
        }
    };
    for (write, (group, mut refused_here)) in batch.into_iter().zip(placed) {
        if let Some(ranges) = refused.get(&group) {
            refused_here.extend(
                write
                    .seqs
                    .iter()
                    .copied()
                    .filter(|s| ranges.iter().any(|r| r.contains(*s))),
            );
        }
        let _ = write.reply.send(Ok(refused_here));
    }
}

/// Inserts the rows; for any that conflict, inserts what is still free and
/// returns, per group, the ranges that were already issued.
async fn insert_resolving_conflicts(
    db: &PgPool,
    stats: &Stats,
    groups: &[Group],
    mut rows: Vec<Row>,
) -> Result<HashMap<usize, Vec<SeqRange>>, sqlx::Error> {
    let mut refused: HashMap<usize, Vec<SeqRange>> = HashMap::new();
    for round in 0..=CONFLICT_ROUNDS {
        if rows.is_empty() {
            break;
        }
        let conflicting = insert_rows(db, stats, groups, &rows).await?;
        if conflicting.is_empty() {
            break;
        }
        if round == CONFLICT_ROUNDS {
            for row in conflicting {
                refused.entry(row.group).or_default().push(row.range);
            }
            break;
        }
        // Split each conflicting range into what the ledger already holds
        // (refused) and what is free (tried again).
        rows = Vec::new();
        for row in conflicting {
            let group = &groups[row.group];
            let taken = issued_within(db, group, row.range).await?;
            refused
                .entry(row.group)
                .or_default()
                .extend(taken.iter().filter_map(|t| intersect(*t, row.range)));
            rows.extend(subtract(row.range, &taken).into_iter().map(|range| Row {
                group: row.group,
                range,
            }));
        }
    }
    Ok(refused)
}

fn intersect(a: SeqRange, b: SeqRange) -> Option<SeqRange> {
    let start = a.start.max(b.start);
    let end = a.end.min(b.end);
    (start < end).then(|| SeqRange::new(start, end))
}

/// One statement for all rows; returns the rows the constraint refused.
async fn insert_rows(
    db: &PgPool,
    stats: &Stats,
    groups: &[Group],
    rows: &[Row],
) -> Result<Vec<Row>, sqlx::Error> {
    let sequence_ids: Vec<i64> = rows.iter().map(|r| groups[r.group].sequence_id).collect();
    let periods: Vec<&str> = rows
        .iter()
        .map(|r| groups[r.group].period.as_str())
        .collect();
    let starts: Vec<i64> = rows.iter().map(|r| r.range.start).collect();
    let ends: Vec<i64> = rows.iter().map(|r| r.range.end).collect();
    let vias: Vec<&str> = rows.iter().map(|r| groups[r.group].via.as_str()).collect();
    let inserted: Vec<(i64, String, i64)> = sqlx::query_as(
        "INSERT INTO issuance_ledger (sequence_id, period, seqs, via) \
         SELECT s, p, int8range(a, b), v \
         FROM UNNEST($1::bigint[], $2::text[], $3::bigint[], $4::bigint[], $5::text[]) AS t(s, p, a, b, v) \
         ON CONFLICT DO NOTHING \
         RETURNING sequence_id, period, lower(seqs)",
    )
    .bind(&sequence_ids)
    .bind(&periods)
    .bind(&starts)
    .bind(&ends)
    .bind(&vias)
    .fetch_all(db)
    .await?;
    Stats::add(&stats.ledger_batches, 1);
    Stats::add(&stats.ledger_rows, inserted.len() as u64);
    if inserted.len() == rows.len() {
        return Ok(Vec::new());
    }
    let done: std::collections::HashSet<(i64, &str, i64)> = inserted
        .iter()
        .map(|(s, p, start)| (*s, p.as_str(), *start))
        .collect();
    Ok(rows
        .iter()
        .filter(|r| {
            let g = &groups[r.group];
            !done.contains(&(g.sequence_id, g.period.as_str(), r.range.start))
        })
        .map(|r| Row {
            group: r.group,
            range: r.range,
        })
        .collect())
}

/// Issued ranges overlapping `range`, clipped to it, sorted.
async fn issued_within(
    db: &PgPool,
    group: &Group,
    range: SeqRange,
) -> Result<Vec<SeqRange>, sqlx::Error> {
    let rows: Vec<(i64, i64)> = sqlx::query_as(
        "SELECT lower(seqs), upper(seqs) FROM issuance_ledger \
         WHERE sequence_id = $1 AND period = $2 AND seqs && int8range($3, $4) ORDER BY lower(seqs)",
    )
    .bind(group.sequence_id)
    .bind(&group.period)
    .bind(range.start)
    .bind(range.end)
    .fetch_all(db)
    .await?;
    Ok(rows.into_iter().map(|(s, e)| SeqRange::new(s, e)).collect())
}
