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

use crate::infra::db::{Db, Link};
use chrono::{DateTime, Utc};
use serde::Serialize;
use tokio_util::sync::CancellationToken;

use super::classify::{self, Judged, OpenGap, Reason};
use super::evidence::{FetchedEvidence, fetch_evidence, open_gaps_near};
use super::store::{self, ActivePeriod};
use crate::domain::clock::Clock;
use crate::domain::numbers::{SeqRange, runs};
use crate::domain::sequence::Sequence;
use crate::infra::stats::Stats;
use crate::records::counter::Counter;
use crate::records::pool::{DiscardCause, PoolService, Swept};
use crate::records::sequence_store::SequenceStore;

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

/// How long a run is taken to be under way after it last said so, unless
/// it finished or failed: an instance that died mid-run holds up the next
/// run at most this long.
const RUN_LEASE: Duration = Duration::from_secs(60);

/// How often a run under way says so.
const RUN_HEARTBEAT: Duration = Duration::from_secs(10);

/// What one run did.
#[derive(Debug, Default, Clone, Serialize)]
pub struct RunSummary {
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
    pub gaps_added: BTreeMap<Reason, i64>,
    pub gaps_resolved: BTreeMap<Reason, i64>,
    /// Pools of ended periods emptied (their numbers become pool_discarded).
    pub pools_closed: usize,
    /// Numbers of gapless sequences that are neither a document nor a
    /// reservation (each one a broken promise, logged as an error).
    pub gapless_violations: i64,
    pub duration_ms: u64,
}

/// How hard a run works: a periodic run, which nobody waits for, rests
/// after each period for three times what the period took, so it works
/// the instance's processors and Postgres a quarter of the time at most,
/// however much there is to judge (its one connection stays held through
/// the rests, as through the whole run; a crowd of sequences
/// used at once cost a busy tenant half its rate while a full-speed run
/// judged it). A run asked for is not paced.
struct Pace {
    rest_per_work: u32,
    since: Instant,
    owed: Duration,
}

/// Rest owed is taken once it reaches this (a timer's granularity).
const PACE_REST_STEP: Duration = Duration::from_millis(20);

impl Pace {
    fn background() -> Self {
        Self {
            rest_per_work: 3,
            since: Instant::now(),
            owed: Duration::ZERO,
        }
    }

    fn unpaced() -> Self {
        Self {
            rest_per_work: 0,
            ..Self::background()
        }
    }

    /// After a period's work: rests what is owed for it, once enough is.
    async fn step(&mut self) {
        if self.rest_per_work == 0 {
            return;
        }
        self.owed += self.since.elapsed() * self.rest_per_work;
        if self.owed >= PACE_REST_STEP {
            tokio::time::sleep(std::mem::take(&mut self.owed)).await;
        }
        self.since = Instant::now();
    }
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
    db: Db,
    pools: Arc<PoolService>,
    clock: Arc<dyn Clock>,
    stats: Arc<Stats>,
    settings: ReconcileSettings,
    instance_id: String,
}

#[derive(Debug, thiserror::Error)]
pub enum ReconcileError {
    #[error(transparent)]
    Db(#[from] sqlx::Error),
    #[error(transparent)]
    Store(#[from] crate::records::sequence_store::StoreError),
    #[error(transparent)]
    Redis(#[from] crate::records::pool::RedisFailure),
}

impl Reconciler {
    /// The reconciler, working on `db` (connections of its own, so a run
    /// never waits behind requests).
    pub fn new(
        db: Db,
        pools: Arc<PoolService>,
        clock: Arc<dyn Clock>,
        stats: Arc<Stats>,
        settings: ReconcileSettings,
        instance_id: String,
    ) -> Self {
        Self {
            db,
            pools,
            clock,
            stats,
            settings,
            instance_id,
        }
    }

    /// Runs every `interval` until `stop`.
    pub async fn run_periodically(self: Arc<Self>, stop: CancellationToken) {
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(self.settings.interval) => {}
            }
            static FAILED: crate::infra::log_limit::Repeated =
                crate::infra::log_limit::Repeated::new("reconciliation failed");
            match self.run(Pace::background()).await {
                Ok(_) => FAILED.ended(),
                Err(e) => FAILED.warn(&e),
            }
        }
    }

    /// One run, unless another is under way, as fast as it can (asked for
    /// by an operator, or a test).
    pub async fn run_once(&self) -> Result<RunSummary, ReconcileError> {
        self.run(Pace::unpaced()).await
    }

    /// One run, unless another is under way, working at `pace`.
    async fn run(&self, mut pace: Pace) -> Result<RunSummary, ReconcileError> {
        let started = Instant::now();
        let mut conn = self.db.acquire().await?;
        let Some(run) = store::start_run(&mut conn, &self.instance_id, RUN_LEASE).await? else {
            // The instance that runs reconciliation says how many; a stale
            // figure here would keep an alert firing.
            self.stats.sequences_near_max.set(0);
            return Ok(RunSummary {
                skipped: true,
                ..Default::default()
            });
        };
        let result = tokio::select! {
            result = self.run_started(&mut conn, &run, &mut pace) => result,
            lost = self.keep_alive(run.id) => Err(lost),
        };
        drop(conn);
        if result.is_err() {
            self.abandon(run.id).await;
        }
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

    /// Says every `RUN_HEARTBEAT` that run `id` is under way; ends (the
    /// run with it) once it could not for half the lease, before another
    /// instance may take the run for dead and start one of its own.
    async fn keep_alive(&self, id: i64) -> ReconcileError {
        let mut said = Instant::now();
        loop {
            tokio::time::sleep(RUN_HEARTBEAT).await;
            match store::still_running(&self.db, id).await {
                Ok(()) => said = Instant::now(),
                Err(e) if said.elapsed() >= RUN_LEASE / 2 => return e.into(),
                Err(_) => {}
            }
        }
    }

    /// Forgets a failed run, on a connection of its own (the run's may
    /// have broken), retrying for a while: until then the next run waits
    /// for the lease to lapse.
    async fn abandon(&self, id: i64) {
        let mut backoff = crate::infra::backoff::Backoff::between(
            Duration::from_millis(100),
            Duration::from_secs(2),
        );
        let deadline = Instant::now() + RUN_LEASE;
        loop {
            match store::abandon_run(&self.db, id).await {
                Ok(()) => return,
                Err(e) if Instant::now() >= deadline => {
                    tracing::warn!(error = %e, "a failed reconciliation run stays recorded; the next starts once its lease lapses");
                    return;
                }
                Err(_) => tokio::time::sleep(backoff.next_pause()).await,
            }
        }
    }

    async fn record_open_gaps(&self) {
        if let Ok(rows) = store::open_gap_totals(&self.db).await {
            // Every reason, 0 where none is open: an alert on a reason
            // sees its series from the first run on.
            let open: Vec<(&'static str, i64)> = Reason::ALL
                .iter()
                .map(|reason| {
                    let numbers = rows
                        .iter()
                        .find(|(r, _)| r == reason)
                        .map_or(0, |(_, n)| *n);
                    (reason.as_str(), numbers)
                })
                .collect();
            self.stats.set_gaps_open(&open);
        }
        if let Ok(near) = store::sequences_near_max(&self.db).await {
            self.stats.sequences_near_max.set(near);
        }
    }

    async fn run_started(
        &self,
        conn: &mut impl Link,
        run: &store::Run,
        pace: &mut Pace,
    ) -> Result<RunSummary, ReconcileError> {
        let mut summary = RunSummary {
            redis_available: self.pools.in_use(),
            ..Default::default()
        };
        let mut sequences: HashMap<i64, Arc<Sequence>> = HashMap::new();
        // Periods with numbers not judged yet: observe them, then judge
        // what has settled.
        for mut period in store::active_periods(conn).await? {
            let period = &mut period;
            let Some(sequence) = self
                .sequence(conn, &mut sequences, period.sequence_id)
                .await?
            else {
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
            // Judged to its counter, and this run saw its pool empty (its
            // mark is the counter): nothing to do until numbers are taken
            // again.
            if summary.redis_available && period.checkpoint >= period.next_seq {
                store::settle_due(conn, period, period.checkpoint).await?;
            }
            pace.step().await;
        }
        // Numbers already judged whose evidence changed since the last run.
        if let Some(previous) = run.previous {
            let since =
                previous - chrono::Duration::from_std(self.settings.lookback).unwrap_or_default();
            for ((sequence_id, period), seqs) in self.changed_since(conn, since).await? {
                let Some(sequence) = self.sequence(conn, &mut sequences, sequence_id).await? else {
                    continue;
                };
                let windows = runs(&seqs);
                self.rejudge(conn, &sequence, &period, &windows, run.now, &mut summary)
                    .await?;
                pace.step().await;
            }
        }
        // Gapless sequences are not judged: every number below a period's
        // counter must be a document or a reservation.
        let mut violations = 0;
        for period in store::gapless_periods(conn).await? {
            let Some(sequence) = self
                .sequence(conn, &mut sequences, period.sequence_id)
                .await?
            else {
                continue;
            };
            let checked = super::gapless::check_period(conn, &sequence, &period).await?;
            summary.periods_scanned += 1;
            summary.numbers_checked += checked.numbers;
            violations += checked.violations;
            pace.step().await;
        }
        self.count_gapless_violations(violations);
        summary.gapless_violations = violations;
        let record = serde_json::to_value(&summary).unwrap_or_default();
        store::finish_run(conn, run.id, record).await?;
        Ok(summary)
    }

    /// Judges the numbers of `period` below its newest mark that is older
    /// than the settle time, then moves its checkpoint there.
    async fn judge_settled(
        &self,
        conn: &mut impl Link,
        sequence: &Arc<Sequence>,
        period: &mut ActivePeriod,
        now: DateTime<Utc>,
        summary: &mut RunSummary,
    ) -> Result<(), ReconcileError> {
        let settled_before =
            now - chrono::Duration::from_std(self.settings.settle).unwrap_or_default();
        // Numbers can go back to a pool after leaving it (what a lease did
        // not hand out goes back to the head), so the newest mark, which
        // sees them in the pool again, caps the settled one.
        let (settled, newest) = store::marks(conn, period, settled_before).await?;
        let bound = settled.map(|b| newest.map_or(b, |n| b.min(n)));
        let Some(bound) = bound.filter(|b| *b > period.checkpoint) else {
            return Ok(());
        };
        let window = SeqRange::new(period.checkpoint, bound);
        self.rejudge(conn, sequence, &period.period, &[window], now, summary)
            .await?;
        store::move_checkpoint(conn, period, bound, settled_before).await?;
        period.checkpoint = bound;
        Ok(())
    }

    fn count_gapless_violations(&self, n: i64) {
        self.stats.gapless_violations.inc_by(n.max(0) as u64);
    }

    async fn sequence(
        &self,
        conn: &mut impl Link,
        cache: &mut HashMap<i64, Arc<Sequence>>,
        id: i64,
    ) -> Result<Option<Arc<Sequence>>, ReconcileError> {
        if let Some(sequence) = cache.get(&id) {
            return Ok(Some(sequence.clone()));
        }
        let sequence = SequenceStore::by_id(conn, id).await?.map(Arc::new);
        if let Some(sequence) = &sequence {
            cache.insert(id, sequence.clone());
        }
        Ok(sequence)
    }

    /// Notes a mark for the period: every number below the counter read at
    /// the start of this run, and below the pool's head now, has left both.
    /// A pool unused for its idle time, or of a period that ended, is given
    /// up first (see [`Reconciler::give_up_pool`]); an ended period's mark
    /// then covers everything. Returns whether a pool was closed.
    async fn observe(
        &self,
        conn: &mut impl Link,
        sequence: &Arc<Sequence>,
        period: &mut ActivePeriod,
        now: DateTime<Utc>,
    ) -> Result<bool, ReconcileError> {
        let current = sequence.definition.period_at(self.clock.now());
        let ended =
            current.key() != period.period && self.ended_long_enough(sequence, &period.period);
        let mut closed = false;
        let bound = if period.pool_closed {
            period.next_seq
        } else {
            let idle = if ended {
                Duration::ZERO
            } else {
                self.pools.idle_after()
            };
            match self.pools.sweep(sequence, &period.period, idle).await? {
                Swept::Kept { lowest } => {
                    lowest.map_or(period.next_seq, |h| h.min(period.next_seq))
                }
                Swept::GivenUp { held, popped } => {
                    let cause = if ended {
                        DiscardCause::PeriodEnded
                    } else {
                        DiscardCause::Idle
                    };
                    self.give_up_pool(conn, sequence, period, &held, &popped, cause)
                        .await?;
                    if ended {
                        closed = true;
                        // Nothing can leave this period any more: all of it
                        // is settled once the settle time has passed.
                        store::close_pool(conn, period).await?
                    } else {
                        period.next_seq
                    }
                }
            }
        };
        store::add_mark(conn, period, now, bound).await?;
        Ok(closed)
    }

    /// What a given-up pool held: the run at its top goes back to the
    /// counter when it ends where the counter stands (the counter moves
    /// down, as if those numbers were never taken: nothing to explain);
    /// the rest, and the numbers of pops whose answers never came, are
    /// recorded as discarded with `cause`. In one transaction with the
    /// checkpoint and marks brought down to the counter. Should that fail,
    /// the numbers go back to the pool.
    async fn give_up_pool(
        &self,
        conn: &mut impl Link,
        sequence: &Sequence,
        period: &mut ActivePeriod,
        held: &[SeqRange],
        popped: &[SeqRange],
        cause: DiscardCause,
    ) -> Result<(), ReconcileError> {
        if held.is_empty() && popped.is_empty() {
            // Only its keys were left (what a pop of an empty pool stamps).
            return Ok(());
        }
        let recorded = async {
            let mut tx = conn.begin().await?;
            let (left, next) = Counter::take_back(&mut tx, sequence, &period.period, held).await?;
            let mut discarded = left;
            discarded.extend_from_slice(popped);
            discarded.sort();
            Counter::record_discards_in(
                &mut tx,
                sequence.id,
                &period.period,
                &discarded,
                cause.into(),
            )
            .await?;
            if let Some(next) = next {
                store::lower_to(&mut tx, period, next).await?;
            }
            tx.commit().await?;
            Ok::<_, sqlx::Error>((discarded, next))
        }
        .await;
        match recorded {
            Ok((discarded, next)) => {
                let numbers: i64 = discarded.iter().map(SeqRange::len).sum();
                self.stats
                    .pool_numbers_discarded
                    .inc_by(numbers.max(0) as u64);
                if let Some(next) = next {
                    period.next_seq = next;
                    period.checkpoint = period.checkpoint.min(next);
                }
                Ok(())
            }
            Err(e) => {
                if let Err(back) = self.pools.restore(sequence, &period.period, held).await {
                    tracing::error!(error = %back, held = ?held, pool_error = %e,
                        "numbers of a given-up pool neither recorded nor back in it");
                }
                Err(e.into())
            }
        }
    }

    /// Whether `period` ended more than the settle time ago, so no request
    /// for it can still be running.
    fn ended_long_enough(&self, sequence: &Sequence, period: &str) -> bool {
        let definition = &sequence.definition;
        let Some(named) = definition.reset.period_named(definition.timezone, period) else {
            return false;
        };
        let Some(end) = named.ends_at() else {
            return false;
        };
        let settle = chrono::Duration::from_std(self.settings.settle).unwrap_or_default();
        self.clock.now() - end > settle
    }

    /// Numbers already judged whose document, ledger record or discard
    /// changed since `since` in a way the gap list does not show yet.
    async fn changed_since(
        &self,
        conn: &mut impl Link,
        since: DateTime<Utc>,
    ) -> Result<BTreeMap<(i64, String), Vec<i64>>, sqlx::Error> {
        let rows = store::contradicting_changes(conn, since).await?;
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
        conn: &mut impl Link,
        sequence: &Sequence,
        period: &str,
        windows: &[SeqRange],
        now: DateTime<Utc>,
        summary: &mut RunSummary,
    ) -> Result<(), sqlx::Error> {
        if windows.is_empty() {
            return Ok(());
        }
        let mut tx = conn.begin().await?;
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
            store::resolve_gaps(&mut tx, &plan.resolve, now).await?;
        }
        if !plan.insert.is_empty() {
            let mut labels = Labels::new(sequence, period, &evidence, &existing, now);
            let mut from_ids = Vec::new();
            let mut to_ids = Vec::new();
            for piece in &plan.insert {
                from_ids.push(labels.id(&mut tx, piece.range.start).await?);
                to_ids.push(labels.id(&mut tx, piece.range.last()).await?);
            }
            store::insert_gaps(
                &mut tx,
                sequence.id,
                period,
                &plan.insert,
                &from_ids,
                &to_ids,
            )
            .await?;
        }
        tx.commit().await
    }
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

    async fn id(&mut self, conn: &mut impl Link, seq: i64) -> Result<String, sqlx::Error> {
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
                store::issue_time(conn, self.sequence.id, self.period, seq).await?
            }
        };
        let definition = &self.sequence.definition;
        let period = definition
            .reset
            .period_named(definition.timezone, self.period)
            .unwrap_or_else(crate::domain::sequence::Period::never);
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
