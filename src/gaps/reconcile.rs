//! The reconciliation job: for every sequence period, compares the blocks
//! taken from the counter, the pool, the ledger, the outbox and the pool
//! discards, and keeps `id_gaps` saying what became of every number.
//!
//! It only judges numbers no request can still be carrying: each run notes,
//! per period, a bound below which every number had left the counter and
//! the pool ("marks"); a mark older than the settle time makes the numbers
//! below it judgeable. Work per run follows what happened since the last
//! one: new numbers from a per-period checkpoint, and re-judging only the
//! numbers whose document, ledger record or discard changed since.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::{PgConnection, PgPool};
use tokio_util::sync::CancellationToken;
use utoipa::ToSchema;

use super::classify::{self, Evidence, Judged, OpenGap, Reason};
use crate::clock::Clock;
use crate::ledger::Via;
use crate::ledger::outbox::DocumentStatus;
use crate::numbers::{SeqRange, merge, runs};
use crate::pool::{PoolService, RedisLink};
use crate::sequence::Sequence;
use crate::sequence_store::SequenceStore;
use crate::stats::Stats;

/// Advisory lock key: one reconciliation at a time across instances.
const LOCK_KEY: i64 = 0x1d_9001_9a95;

#[derive(Debug, Clone)]
pub struct ReconcileSettings {
    pub interval: Duration,
    /// Age a mark needs before the numbers below it are judged; at least
    /// the longest a request may hold a number (the request timeout).
    pub settle: Duration,
    /// How far before the previous run changes are looked for again, for
    /// transactions that committed after that run looked.
    pub lookback: Duration,
}

impl Default for ReconcileSettings {
    fn default() -> Self {
        Self {
            interval: Duration::from_secs(60),
            settle: Duration::from_secs(60),
            lookback: Duration::from_secs(600),
        }
    }
}

/// What one run did.
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
    #[schema(value_type = HashMap<String, i64>)]
    pub gaps_added: BTreeMap<Reason, i64>,
    #[schema(value_type = HashMap<String, i64>)]
    pub gaps_resolved: BTreeMap<Reason, i64>,
    /// Pools of ended periods emptied (their numbers become pool_discarded).
    pub pools_closed: usize,
    pub duration_ms: u64,
}

/// `issued_unattached=3 untracked_loss=1`: counts by the API's reason codes.
fn reason_counts(counts: &BTreeMap<Reason, i64>) -> String {
    counts
        .iter()
        .map(|(reason, n)| format!("{}={n}", reason.as_str()))
        .collect::<Vec<_>>()
        .join(" ")
}

pub struct Reconciler {
    pub db: PgPool,
    pub redis: Arc<RedisLink>,
    pub pools: Arc<PoolService>,
    pub sequences: Arc<SequenceStore>,
    pub clock: Arc<dyn Clock>,
    pub stats: Arc<Stats>,
    pub settings: ReconcileSettings,
    pub instance_id: String,
}

struct ActivePeriod {
    sequence_id: i64,
    period: String,
    next_seq: i64,
    checkpoint: i64,
    pool_closed: bool,
}

/// One run as recorded in `reconcile_runs`.
struct Run {
    id: i64,
    /// When it started, by the database's clock.
    now: DateTime<Utc>,
    /// When the last finished run started.
    previous: Option<DateTime<Utc>>,
}

#[derive(Debug, thiserror::Error)]
pub enum ReconcileError {
    #[error(transparent)]
    Db(#[from] sqlx::Error),
    #[error(transparent)]
    Store(#[from] crate::sequence_store::StoreError),
    #[error(transparent)]
    Redis(#[from] crate::pool::RedisFailure),
}

impl Reconciler {
    /// Runs every `interval` until `stop`.
    pub async fn run_periodically(self: Arc<Self>, stop: CancellationToken) {
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(self.settings.interval) => {}
            }
            if let Err(e) = self.run_once().await {
                tracing::error!(error = %e, "reconciliation failed");
            }
        }
    }

    /// One run, unless another instance holds the lock.
    pub async fn run_once(&self) -> Result<Summary, ReconcileError> {
        let started = Instant::now();
        // Advisory locks belong to a session: take and release it on one connection.
        let mut conn = self.db.acquire().await?;
        let locked: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock($1)")
            .bind(LOCK_KEY)
            .fetch_one(&mut *conn)
            .await?;
        if !locked {
            return Ok(Summary {
                skipped: true,
                ..Default::default()
            });
        }
        let result = self.run_locked(&mut conn).await;
        let _ = sqlx::query("SELECT pg_advisory_unlock($1)")
            .bind(LOCK_KEY)
            .execute(&mut *conn)
            .await;
        let mut summary = result?;
        summary.duration_ms = started.elapsed().as_millis() as u64;
        self.stats.reconcile_runs.inc();
        self.stats
            .reconcile_last_ms
            .set(i64::try_from(summary.duration_ms).unwrap_or(i64::MAX));
        self.record_open_gaps().await;
        tracing::info!(
            periods = summary.periods_scanned,
            numbers = summary.numbers_checked,
            rows = summary.rows_read,
            added = %reason_counts(&summary.gaps_added),
            resolved = %reason_counts(&summary.gaps_resolved),
            pools_closed = summary.pools_closed,
            redis = summary.redis_available,
            duration_ms = summary.duration_ms,
            "reconciliation run"
        );
        Ok(summary)
    }

    async fn record_open_gaps(&self) {
        let rows: Result<Vec<(Reason, i64)>, _> = sqlx::query_as(
            "SELECT reason, sum(to_seq - from_seq + 1)::bigint FROM id_gaps WHERE resolved_at IS NULL GROUP BY reason",
        )
        .fetch_all(&self.db)
        .await;
        if let Ok(rows) = rows {
            let open: Vec<(&'static str, i64)> =
                rows.iter().map(|(r, n)| (r.as_str(), *n)).collect();
            self.stats.set_gaps_open(&open);
        }
    }

    async fn run_locked(&self, conn: &mut PgConnection) -> Result<Summary, ReconcileError> {
        let run = self.start_run(conn).await?;
        let mut summary = Summary {
            redis_available: self.redis.is_up(),
            ..Default::default()
        };
        let mut sequences: HashMap<i64, Arc<Sequence>> = HashMap::new();
        // Periods with numbers not judged yet: observe them, then judge
        // what has settled.
        for period in &self.active_periods(conn).await? {
            let Some(sequence) = self.sequence(&mut sequences, period.sequence_id).await? else {
                continue;
            };
            if summary.redis_available {
                match self.observe(conn, &sequence, period, run.now).await {
                    Ok(closed) => summary.pools_closed += usize::from(closed),
                    Err(ReconcileError::Redis(e)) => {
                        tracing::warn!(error = %e, "could not observe a pool; new numbers wait for the next run");
                        summary.redis_available = false;
                    }
                    Err(e) => return Err(e),
                }
            }
            self.judge_settled(conn, &sequence, period, run.now, &mut summary)
                .await?;
        }
        // Numbers already judged whose evidence changed since the last run.
        if let Some(previous) = run.previous {
            let since =
                previous - chrono::Duration::from_std(self.settings.lookback).unwrap_or_default();
            for ((sequence_id, period), seqs) in self.changed_since(conn, since).await? {
                let Some(sequence) = self.sequence(&mut sequences, sequence_id).await? else {
                    continue;
                };
                let windows = runs(&seqs);
                self.rejudge(conn, &sequence, &period, &windows, run.now, &mut summary)
                    .await?;
            }
        }
        sqlx::query(
            "UPDATE reconcile_runs SET finished_at = clock_timestamp(), summary = $2 WHERE id = $1",
        )
        .bind(run.id)
        .bind(serde_json::to_value(&summary).unwrap_or_default())
        .execute(&mut *conn)
        .await?;
        Ok(summary)
    }

    /// Records the run's start, by the database's clock, and finds when
    /// the last finished run started.
    async fn start_run(&self, conn: &mut PgConnection) -> Result<Run, sqlx::Error> {
        let now: DateTime<Utc> = sqlx::query_scalar("SELECT clock_timestamp()")
            .fetch_one(&mut *conn)
            .await?;
        let previous: Option<DateTime<Utc>> = sqlx::query_scalar(
            "SELECT started_at FROM reconcile_runs WHERE finished_at IS NOT NULL ORDER BY id DESC LIMIT 1",
        )
        .fetch_optional(&mut *conn)
        .await?;
        let id: i64 = sqlx::query_scalar(
            "INSERT INTO reconcile_runs (instance_id, started_at) VALUES ($1, $2) RETURNING id",
        )
        .bind(&self.instance_id)
        .bind(now)
        .fetch_one(&mut *conn)
        .await?;
        Ok(Run { id, now, previous })
    }

    /// Judges the numbers of `period` below its newest mark that is older
    /// than the settle time, then moves its checkpoint there.
    async fn judge_settled(
        &self,
        conn: &mut PgConnection,
        sequence: &Arc<Sequence>,
        period: &ActivePeriod,
        now: DateTime<Utc>,
        summary: &mut Summary,
    ) -> Result<(), ReconcileError> {
        let settled_before =
            now - chrono::Duration::from_std(self.settings.settle).unwrap_or_default();
        // Numbers can go back to a pool after leaving it (what a lease did
        // not hand out goes back to the head), so the newest mark, which
        // sees them in the pool again, caps the settled one.
        let (settled, newest): (Option<i64>, Option<i64>) = sqlx::query_as(
            "SELECT max(bound) FILTER (WHERE observed_at <= $3), \
                    (array_agg(bound ORDER BY observed_at DESC))[1] \
             FROM reconcile_marks WHERE sequence_id = $1 AND period = $2",
        )
        .bind(period.sequence_id)
        .bind(&period.period)
        .bind(settled_before)
        .fetch_one(&mut *conn)
        .await?;
        let bound = settled.map(|b| newest.map_or(b, |n| b.min(n)));
        let Some(bound) = bound.filter(|b| *b > period.checkpoint) else {
            return Ok(());
        };
        let window = SeqRange::new(period.checkpoint, bound);
        self.rejudge(conn, sequence, &period.period, &[window], now, summary)
            .await?;
        sqlx::query(
            "INSERT INTO reconcile_periods (sequence_id, period, checkpoint) VALUES ($1, $2, $3) \
             ON CONFLICT (sequence_id, period) DO UPDATE SET checkpoint = EXCLUDED.checkpoint",
        )
        .bind(period.sequence_id)
        .bind(&period.period)
        .bind(bound)
        .execute(&mut *conn)
        .await?;
        // Marks older than the one just used will never be needed again.
        sqlx::query(
            "DELETE FROM reconcile_marks WHERE sequence_id = $1 AND period = $2 AND observed_at < \
             (SELECT max(observed_at) FROM reconcile_marks WHERE sequence_id = $1 AND period = $2 \
              AND observed_at <= $3)",
        )
        .bind(period.sequence_id)
        .bind(&period.period)
        .bind(settled_before)
        .execute(&mut *conn)
        .await?;
        Ok(())
    }

    async fn sequence(
        &self,
        cache: &mut HashMap<i64, Arc<Sequence>>,
        id: i64,
    ) -> Result<Option<Arc<Sequence>>, ReconcileError> {
        if let Some(sequence) = cache.get(&id) {
            return Ok(Some(sequence.clone()));
        }
        let sequence = self.sequences.by_id(id).await?.map(Arc::new);
        if let Some(sequence) = &sequence {
            cache.insert(id, sequence.clone());
        }
        Ok(sequence)
    }

    async fn active_periods(
        &self,
        conn: &mut PgConnection,
    ) -> Result<Vec<ActivePeriod>, sqlx::Error> {
        #[derive(sqlx::FromRow)]
        struct Row {
            sequence_id: i64,
            period: String,
            next_seq: i64,
            checkpoint: Option<i64>,
            pool_closed_at: Option<DateTime<Utc>>,
            first_block: Option<i64>,
        }
        let rows: Vec<Row> = sqlx::query_as(
            "SELECT c.sequence_id, c.period, c.next_seq, r.checkpoint, r.pool_closed_at, \
                    CASE WHEN r.checkpoint IS NULL THEN \
                        (SELECT min(lower(b.seqs)) FROM blocks b WHERE b.sequence_id = c.sequence_id AND b.period = c.period) \
                    END AS first_block \
             FROM counters c LEFT JOIN reconcile_periods r USING (sequence_id, period) \
             WHERE r.checkpoint IS NULL OR r.checkpoint < c.next_seq OR r.pool_closed_at IS NULL \
             ORDER BY c.sequence_id, c.period",
        )
        .fetch_all(&mut *conn)
        .await?;
        Ok(rows
            .into_iter()
            .filter_map(|row| {
                Some(ActivePeriod {
                    sequence_id: row.sequence_id,
                    period: row.period,
                    next_seq: row.next_seq,
                    checkpoint: row.checkpoint.or(row.first_block)?,
                    pool_closed: row.pool_closed_at.is_some(),
                })
            })
            .collect())
    }

    /// Notes a mark for the period: every number below the counter read at
    /// the start of this run, and below the pool's head now, has left both.
    /// An ended period's pool is discarded first (once), so its mark covers
    /// everything. Returns whether a pool was closed.
    async fn observe(
        &self,
        conn: &mut PgConnection,
        sequence: &Arc<Sequence>,
        period: &ActivePeriod,
        now: DateTime<Utc>,
    ) -> Result<bool, ReconcileError> {
        let current = sequence.definition.period_at(self.clock.now());
        let keys = self.redis.keys(
            sequence.project.as_str(),
            sequence.doc_type.as_str(),
            &period.period,
        );
        let ended =
            current.key() != period.period && self.ended_long_enough(sequence, &period.period);
        let mut closed = false;
        let bound = if period.pool_closed {
            period.next_seq
        } else if ended {
            let ranges = self.redis.discard(&keys, false).await?;
            self.pools
                .record_discard(
                    sequence,
                    &period.period,
                    &ranges,
                    crate::pool::DiscardCause::PeriodEnded,
                )
                .await;
            sqlx::query(
                "INSERT INTO reconcile_periods (sequence_id, period, checkpoint, pool_closed_at) \
                 VALUES ($1, $2, $3, now()) \
                 ON CONFLICT (sequence_id, period) DO UPDATE SET pool_closed_at = now()",
            )
            .bind(period.sequence_id)
            .bind(&period.period)
            .bind(period.checkpoint)
            .execute(&mut *conn)
            .await?;
            closed = true;
            // Nothing can leave this period any more: all of it is settled
            // once the settle time has passed.
            let next: i64 = sqlx::query_scalar(
                "SELECT next_seq FROM counters WHERE sequence_id = $1 AND period = $2",
            )
            .bind(period.sequence_id)
            .bind(&period.period)
            .fetch_one(&mut *conn)
            .await?;
            next
        } else {
            match self.redis.head(&keys).await? {
                Some(head) => head.min(period.next_seq),
                None => period.next_seq,
            }
        };
        sqlx::query(
            "INSERT INTO reconcile_marks (sequence_id, period, observed_at, bound) VALUES ($1, $2, $3, $4) \
             ON CONFLICT DO NOTHING",
        )
        .bind(period.sequence_id)
        .bind(&period.period)
        .bind(now)
        .bind(bound)
        .execute(&mut *conn)
        .await?;
        Ok(closed)
    }

    /// Whether `period` ended more than the settle time ago, so no request
    /// for it can still be running.
    fn ended_long_enough(&self, sequence: &Sequence, period: &str) -> bool {
        let definition = &sequence.definition;
        let Some(named) = definition.reset.period_named(definition.timezone, period) else {
            return false;
        };
        let Some(start) = named.starts_at() else {
            return false;
        };
        // The first instant that falls in a later period ends this one.
        let mut probe = start;
        let step = chrono::Duration::hours(6);
        let now = self.clock.now();
        while probe <= now {
            if definition.period_at(probe).key() != period {
                let settle = chrono::Duration::from_std(self.settings.settle).unwrap_or_default();
                return now - probe > settle;
            }
            probe += step;
        }
        false
    }

    /// Numbers already judged whose document, ledger record or discard
    /// changed since `since` in a way the gap list does not show yet.
    async fn changed_since(
        &self,
        conn: &mut PgConnection,
        since: DateTime<Utc>,
    ) -> Result<BTreeMap<(i64, String), Vec<i64>>, sqlx::Error> {
        // Only changes that contradict the gap list: a document whose status
        // disagrees with it, a ledger record or discard of a number judged
        // never issued (a late write, a late discard record).
        let rows: Vec<(i64, String, i64, i64)> = sqlx::query_as(
            "SELECT o.sequence_id, o.period, o.seq, o.seq + 1 FROM id_outbox o \
               JOIN reconcile_periods r ON r.sequence_id = o.sequence_id AND r.period = o.period \
              WHERE o.status_changed_at > $1 AND o.seq < r.checkpoint \
                AND CASE o.status::text \
                      WHEN $2 THEN NOT EXISTS (SELECT 1 FROM id_gaps g WHERE g.sequence_id = o.sequence_id \
                          AND g.period = o.period AND g.resolved_at IS NULL AND g.reason = $3 \
                          AND int8range(g.from_seq, g.to_seq, '[]') @> o.seq) \
                      WHEN $4 THEN NOT EXISTS (SELECT 1 FROM id_gaps g WHERE g.sequence_id = o.sequence_id \
                          AND g.period = o.period AND g.resolved_at IS NULL AND g.reason = $5 \
                          AND int8range(g.from_seq, g.to_seq, '[]') @> o.seq) \
                      ELSE EXISTS (SELECT 1 FROM id_gaps g WHERE g.sequence_id = o.sequence_id \
                          AND g.period = o.period AND g.resolved_at IS NULL \
                          AND int8range(g.from_seq, g.to_seq, '[]') @> o.seq) \
                    END \
             UNION ALL \
             SELECT l.sequence_id, l.period, greatest(lower(l.seqs), g.from_seq), least(upper(l.seqs), g.to_seq + 1) \
               FROM issuance_ledger l JOIN id_gaps g ON g.sequence_id = l.sequence_id AND g.period = l.period \
                AND g.resolved_at IS NULL AND g.reason IN ($6, $7) \
                AND int8range(g.from_seq, g.to_seq, '[]') && l.seqs \
              WHERE l.issued_at > $1 \
             UNION ALL \
             SELECT d.sequence_id, d.period, greatest(lower(d.seqs), g.from_seq), least(upper(d.seqs), g.to_seq + 1) \
               FROM pool_discards d JOIN id_gaps g ON g.sequence_id = d.sequence_id AND g.period = d.period \
                AND g.resolved_at IS NULL AND g.reason IN ($6, $8) \
                AND int8range(g.from_seq, g.to_seq, '[]') && d.seqs \
              WHERE d.discarded_at > $1 \
             UNION ALL \
             SELECT h.sequence_id, h.period, greatest(lower(h.seqs), g.from_seq), least(upper(h.seqs), g.to_seq + 1) \
               FROM lease_handouts h JOIN id_gaps g ON g.sequence_id = h.sequence_id AND g.period = h.period \
                AND g.resolved_at IS NULL AND g.reason = $8 \
                AND int8range(g.from_seq, g.to_seq, '[]') && h.seqs \
              WHERE h.reported_at > $1",
        )
        .bind(since)
        .bind(DocumentStatus::DeadLetter)
        .bind(Reason::OutboxDlq)
        .bind(DocumentStatus::Abandoned)
        .bind(Reason::Abandoned)
        .bind(Reason::UntrackedLoss)
        .bind(Reason::PoolDiscarded)
        .bind(Reason::LeaseLost)
        .fetch_all(&mut *conn)
        .await?;
        let mut changed: BTreeMap<(i64, String), Vec<i64>> = BTreeMap::new();
        for (sequence_id, period, start, end) in rows {
            changed
                .entry((sequence_id, period))
                .or_default()
                .extend(start..end);
        }
        Ok(changed)
    }

    /// Judges `windows` of one period from the evidence and brings
    /// `id_gaps` in line, in one transaction.
    async fn rejudge(
        &self,
        conn: &mut PgConnection,
        sequence: &Sequence,
        period: &str,
        windows: &[SeqRange],
        now: DateTime<Utc>,
        summary: &mut Summary,
    ) -> Result<(), sqlx::Error> {
        if windows.is_empty() {
            return Ok(());
        }
        let mut tx = sqlx::Connection::begin(&mut *conn).await?;
        let evidence = fetch_evidence(&mut tx, sequence.id, period, windows).await?;
        let judged: Vec<Judged> = windows
            .iter()
            .flat_map(|w| classify::judge(*w, &evidence.ranges))
            .collect();
        let existing = open_gaps_near(&mut tx, sequence.id, period, windows).await?;
        let plan = classify::plan(
            windows,
            &judged,
            &existing
                .iter()
                .map(|(g, _, _)| g.clone())
                .collect::<Vec<_>>(),
            now,
        );
        summary.periods_scanned += 1;
        summary.numbers_checked += windows.iter().map(SeqRange::len).sum::<i64>();
        summary.rows_read += evidence.rows_read + existing.len() as i64;
        for (reason, n) in &plan.added {
            *summary.gaps_added.entry(*reason).or_default() += n;
        }
        for (reason, n) in &plan.resolved {
            *summary.gaps_resolved.entry(*reason).or_default() += n;
        }
        if !plan.resolve.is_empty() {
            sqlx::query("UPDATE id_gaps SET resolved_at = $2 WHERE id = ANY($1)")
                .bind(&plan.resolve)
                .bind(now)
                .execute(&mut *tx)
                .await?;
        }
        if !plan.insert.is_empty() {
            let mut labels = Labels::new(sequence, period, &evidence, &existing, now);
            let mut from_ids = Vec::new();
            let mut to_ids = Vec::new();
            for piece in &plan.insert {
                from_ids.push(labels.id(&mut tx, piece.range.start).await?);
                to_ids.push(labels.id(&mut tx, piece.range.last()).await?);
            }
            let starts: Vec<i64> = plan.insert.iter().map(|p| p.range.start).collect();
            let lasts: Vec<i64> = plan.insert.iter().map(|p| p.range.last()).collect();
            let reasons: Vec<&str> = plan.insert.iter().map(|p| p.reason.as_str()).collect();
            let detected: Vec<DateTime<Utc>> = plan.insert.iter().map(|p| p.detected_at).collect();
            sqlx::query(
                "INSERT INTO id_gaps (sequence_id, period, from_seq, to_seq, from_id, to_id, reason, detected_at) \
                 SELECT $1, $2, f, t, fi, ti, r, d \
                 FROM UNNEST($3::bigint[], $4::bigint[], $5::text[], $6::text[], $7::text[], $8::timestamptz[]) \
                      AS u(f, t, fi, ti, r, d)",
            )
            .bind(sequence.id)
            .bind(period)
            .bind(&starts)
            .bind(&lasts)
            .bind(&from_ids)
            .bind(&to_ids)
            .bind(&reasons)
            .bind(&detected)
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await
    }
}

/// Evidence for some windows, plus what is needed to print IDs.
struct FetchedEvidence {
    ranges: Evidence,
    /// (range, reserved_at) of blocks, (range, issued_at) of ledger rows.
    block_times: Vec<(SeqRange, DateTime<Utc>)>,
    issue_times: Vec<(SeqRange, DateTime<Utc>)>,
    document_ids: HashMap<i64, String>,
    rows_read: i64,
}

/// The tables that hold runs of a period's numbers and nothing the
/// judgement needs besides them.
#[derive(Clone, Copy)]
enum RunsTable {
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
async fn overlapping_runs(
    conn: &mut PgConnection,
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
        .fetch_all(&mut *conn)
        .await
}

async fn fetch_evidence(
    conn: &mut PgConnection,
    sequence_id: i64,
    period: &str,
    windows: &[SeqRange],
) -> Result<FetchedEvidence, sqlx::Error> {
    let los: Vec<i64> = windows.iter().map(|w| w.start).collect();
    let his: Vec<i64> = windows.iter().map(|w| w.end).collect();
    let blocks: Vec<(i64, i64, DateTime<Utc>)> = sqlx::query_as(
        "SELECT DISTINCT lower(b.seqs), upper(b.seqs), b.reserved_at \
         FROM UNNEST($3::bigint[], $4::bigint[]) AS w(lo, hi) \
         JOIN blocks b ON b.sequence_id = $1 AND b.period = $2 AND b.seqs && int8range(w.lo, w.hi) \
         ORDER BY 1",
    )
    .bind(sequence_id)
    .bind(period)
    .bind(&los)
    .bind(&his)
    .fetch_all(&mut *conn)
    .await?;
    let ledger: Vec<(i64, i64, DateTime<Utc>, bool)> = sqlx::query_as(
        "SELECT DISTINCT lower(l.seqs), upper(l.seqs), l.issued_at, l.via = $5 \
         FROM UNNEST($3::bigint[], $4::bigint[]) AS w(lo, hi) \
         JOIN issuance_ledger l ON l.sequence_id = $1 AND l.period = $2 AND l.seqs && int8range(w.lo, w.hi) \
         ORDER BY 1",
    )
    .bind(sequence_id)
    .bind(period)
    .bind(&los)
    .bind(&his)
    .bind(Via::Lease.as_str())
    .fetch_all(&mut *conn)
    .await?;
    let handouts = overlapping_runs(
        conn,
        RunsTable::LeaseHandouts,
        sequence_id,
        period,
        &los,
        &his,
    )
    .await?;
    let documents: Vec<(i64, DocumentStatus, String)> = sqlx::query_as(
        "SELECT DISTINCT o.seq, o.status::text, o.document_id \
         FROM UNNEST($3::bigint[], $4::bigint[]) AS w(lo, hi) \
         JOIN id_outbox o ON o.sequence_id = $1 AND o.period = $2 AND o.seq >= w.lo AND o.seq < w.hi \
         ORDER BY 1",
    )
    .bind(sequence_id)
    .bind(period)
    .bind(&los)
    .bind(&his)
    .fetch_all(&mut *conn)
    .await?;
    let discards = overlapping_runs(
        conn,
        RunsTable::PoolDiscards,
        sequence_id,
        period,
        &los,
        &his,
    )
    .await?;
    let rows_read =
        (blocks.len() + ledger.len() + handouts.len() + documents.len() + discards.len()) as i64;
    let ledger_part = |lease: bool| -> Vec<(i64, i64)> {
        ledger
            .iter()
            .filter(|(_, _, _, leased)| *leased == lease)
            .map(|(s, e, _, _)| (*s, *e))
            .collect()
    };
    let seq_ranges = |rows: &[(i64, i64)]| -> Vec<SeqRange> {
        let numbers: Vec<SeqRange> = rows.iter().map(|(s, e)| SeqRange::new(*s, *e)).collect();
        merge(numbers)
    };
    let statuses = documents
        .iter()
        .map(|(seq, status, _)| (*seq, *status))
        .collect();
    Ok(FetchedEvidence {
        ranges: Evidence {
            taken: seq_ranges(&blocks.iter().map(|(s, e, _)| (*s, *e)).collect::<Vec<_>>()),
            issued: seq_ranges(&ledger_part(false)),
            leased: seq_ranges(&ledger_part(true)),
            handed_out: seq_ranges(&handouts),
            documents: statuses,
            discarded: seq_ranges(&discards),
        },
        block_times: blocks
            .iter()
            .map(|(s, e, t)| (SeqRange::new(*s, *e), *t))
            .collect(),
        issue_times: ledger
            .iter()
            .map(|(s, e, t, _)| (SeqRange::new(*s, *e), *t))
            .collect(),
        document_ids: documents
            .into_iter()
            .map(|(seq, _, id)| (seq, id))
            .collect(),
        rows_read,
    })
}

/// Open gaps overlapping or touching the windows, with their printed IDs.
async fn open_gaps_near(
    conn: &mut PgConnection,
    sequence_id: i64,
    period: &str,
    windows: &[SeqRange],
) -> Result<Vec<(OpenGap, String, String)>, sqlx::Error> {
    let los: Vec<i64> = windows.iter().map(|w| w.start - 1).collect();
    let his: Vec<i64> = windows.iter().map(|w| w.end).collect();
    #[derive(sqlx::FromRow)]
    struct Row {
        id: i64,
        from_seq: i64,
        to_seq: i64,
        reason: Reason,
        detected_at: DateTime<Utc>,
        from_id: String,
        to_id: String,
    }
    let rows: Vec<Row> = sqlx::query_as(
        "SELECT DISTINCT g.id, g.from_seq, g.to_seq, g.reason, g.detected_at, g.from_id, g.to_id \
         FROM UNNEST($3::bigint[], $4::bigint[]) AS w(lo, hi) \
         JOIN id_gaps g ON g.sequence_id = $1 AND g.period = $2 AND g.resolved_at IS NULL \
          AND int8range(g.from_seq, g.to_seq, '[]') && int8range(w.lo, w.hi, '[]') \
         ORDER BY 2",
    )
    .bind(sequence_id)
    .bind(period)
    .bind(&los)
    .bind(&his)
    .fetch_all(&mut *conn)
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

/// Prints the ID of a number as its holder saw it: the document's ID, or
/// formatted at the time it was issued, or else when it was reserved.
struct Labels<'a> {
    sequence: &'a Sequence,
    period: &'a str,
    evidence: &'a FetchedEvidence,
    known: HashMap<i64, String>,
    /// When this run started: the time printed for a number whose issue
    /// time nothing records, in a period that has no start.
    now: DateTime<Utc>,
}

impl<'a> Labels<'a> {
    fn new(
        sequence: &'a Sequence,
        period: &'a str,
        evidence: &'a FetchedEvidence,
        existing: &[(OpenGap, String, String)],
        now: DateTime<Utc>,
    ) -> Self {
        let mut known = HashMap::new();
        for (gap, from_id, to_id) in existing {
            known.insert(gap.range.start, from_id.clone());
            known.insert(gap.range.last(), to_id.clone());
        }
        Self {
            sequence,
            period,
            evidence,
            known,
            now,
        }
    }

    async fn id(&mut self, conn: &mut PgConnection, seq: i64) -> Result<String, sqlx::Error> {
        if let Some(id) = self
            .known
            .get(&seq)
            .or_else(|| self.evidence.document_ids.get(&seq))
        {
            return Ok(id.clone());
        }
        let within = |rows: &[(SeqRange, DateTime<Utc>)]| {
            rows.iter().find(|(r, _)| r.contains(seq)).map(|(_, t)| *t)
        };
        let at = match within(&self.evidence.issue_times)
            .or_else(|| within(&self.evidence.block_times))
        {
            Some(at) => Some(at),
            None => {
                // Outside the windows (a split of an older gap): ask.
                sqlx::query_scalar(
                    "SELECT coalesce( \
                        (SELECT issued_at FROM issuance_ledger WHERE sequence_id = $1 AND period = $2 AND seqs @> $3::bigint), \
                        (SELECT reserved_at FROM blocks WHERE sequence_id = $1 AND period = $2 AND seqs @> $3::bigint))",
                )
                .bind(self.sequence.id)
                .bind(self.period)
                .bind(seq)
                .fetch_one(&mut *conn)
                .await?
            }
        };
        let definition = &self.sequence.definition;
        let period = definition
            .reset
            .period_named(definition.timezone, self.period)
            .unwrap_or_else(crate::sequence::Period::never);
        let at = definition.time_within(&period, at.or(period.starts_at()).unwrap_or(self.now));
        let id = definition
            .shape(
                self.sequence.project.as_str(),
                self.sequence.doc_type.as_str(),
                &period,
                at,
            )
            .map(|shape| shape.id(seq))
            .unwrap_or_else(|_| seq.to_string());
        self.known.insert(seq, id.clone());
        Ok(id)
    }
}
