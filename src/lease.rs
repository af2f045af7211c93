//! Leases: `POST /ids` served from memory.
//!
//! An instance takes numbers from a pool in runs sized to about 50 ms of
//! the sequence's traffic on it, and records each run in the issuance
//! ledger as leased to it (one shared commit) before handing out any
//! number of it. Requests then take numbers from memory: no Redis call and
//! no commit on their path. The next lease is taken while a quarter of the
//! current one is left, so a request waits only when a lease runs dry
//! faster than a commit. At low rates a lease would be the request itself,
//! so the request is recorded on its own as before (strict order, one
//! commit per request).
//!
//! Which numbers went to callers is recorded before the answer leaves
//! (`lease_handouts`, written for all requests waiting at once in one
//! shared commit), so an ID answered is attachable at once through any
//! instance, and still after this one was killed. Numbers a lease still
//! holds when it goes idle or the instance stops cleanly are taken off the
//! ledger and pushed back to the head of their pool, so the next caller
//! gets them; where that fails they are recorded as `pool_discarded`.
//! Numbers of an instance that died holding a lease are judged
//! `lease_lost`: none of them was answered.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::PgPool;
use tokio::sync::{Notify, mpsc, oneshot};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::clock::Clock;
use crate::issuance::{IssueError, Issued, Issuer};
use crate::ledger::{self, LeaseReport, LedgerError, Via};
use crate::numbers::{SeqRange, runs};
use crate::pool::{DiscardCause, Placement, PoolRef, PoolService};
use crate::sequence::{ProjectCode, Sequence, TypeCode};
use crate::stats::Stats;

#[derive(Debug, Clone)]
pub struct LeaseSettings {
    /// Off: every request is recorded on its own (`IDPOOL_LEASES=off`).
    pub enabled: bool,
    /// How much of a sequence's traffic one lease carries.
    pub traffic: Duration,
    /// A lease no request has taken a number from for this long is given
    /// back.
    pub max_idle: Duration,
    /// A lease not used up this long after it was taken is given back even
    /// while requests still use it, so a live instance never holds numbers
    /// long enough for reconciliation to judge them (its settle time is
    /// never below the request timeout, at least a second).
    pub max_age: Duration,
    /// How often idle leases are looked for and returns written.
    pub report_every: Duration,
}

impl Default for LeaseSettings {
    fn default() -> Self {
        Self {
            enabled: true,
            traffic: Duration::from_millis(50),
            max_idle: Duration::from_millis(500),
            max_age: Duration::from_secs(1),
            report_every: Duration::from_millis(20),
        }
    }
}

/// How quickly the rate estimate forgets: a burst counts for about this long.
const RATE_MEMORY: Duration = Duration::from_millis(100);

/// Numbers asked of one pool per second on this instance, as an
/// exponentially decaying sum (a steady rate r reads r).
#[derive(Debug, Clone, Copy, Default)]
pub struct Rate {
    per_second: f64,
    at: Option<DateTime<Utc>>,
}

impl Rate {
    fn decayed(&self, now: DateTime<Utc>) -> f64 {
        let Some(at) = self.at else {
            return 0.0;
        };
        let elapsed = (now - at).to_std().unwrap_or_default();
        self.per_second * (-elapsed.as_secs_f64() / RATE_MEMORY.as_secs_f64()).exp()
    }

    pub fn add(&mut self, numbers: usize, now: DateTime<Utc>) {
        self.per_second = self.decayed(now) + numbers as f64 / RATE_MEMORY.as_secs_f64();
        self.at = Some(now.max(self.at.unwrap_or(now)));
    }

    pub fn per_second(&self, now: DateTime<Utc>) -> f64 {
        self.decayed(now)
    }
}

/// The smallest lease worth taking: a lease costs a commit, as a request
/// recorded on its own does, and a smaller one saves few. It also keeps a
/// short burst on a quiet sequence (a handful of requests within
/// milliseconds reads as tens a second) on the strictly ordered path.
pub const MIN_LEASE: usize = 8;

/// The lease to take for a request still missing `missing` numbers, at
/// `rate`: about `traffic` of it, at most `pool_size`. None when that is
/// no more than the request or less than [`MIN_LEASE`] (the request is
/// recorded on its own).
pub fn lease_size(rate: f64, traffic: Duration, missing: usize, pool_size: usize) -> Option<usize> {
    let size = (rate * traffic.as_secs_f64()).ceil() as usize;
    let size = size.min(pool_size);
    (size > missing && size >= MIN_LEASE).then_some(size)
}

/// The leased numbers of one pool (sequence version and period) on this
/// instance.
struct Holder {
    pool: PoolRef,
    sequence: Arc<Sequence>,
    period: String,
    state: Mutex<State>,
    /// Woken when a lease arrives or fails.
    changed: Notify,
}

#[derive(Default)]
struct State {
    /// Leased, not handed out yet; ascending.
    numbers: VecDeque<i64>,
    fetching: bool,
    /// Failed lease attempts so far: a waiter that sees this grow stops
    /// waiting and is served on its own.
    failures: u64,
    last_size: usize,
    leased_at: Option<Instant>,
    /// When a sweep last found fewer numbers left than the sweep before
    /// (a request took some), and how many it found: measured by the
    /// sweep, so requests read no clock.
    used_at: Option<Instant>,
    left_at_sweep: usize,
    rate: Rate,
    /// The instance is stopping: nothing more is leased or handed out.
    closed: bool,
}

impl Holder {
    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

type HolderKey = (i64, i32, String);

/// A document's place on a lease: its number, or a lease on its way.
pub struct LeaseClaim {
    holder: Arc<Holder>,
    placement: Arc<Placement>,
    seq: Option<i64>,
}

/// A number taken from a lease for a document.
pub struct Leased {
    holder: Arc<Holder>,
    pub seq: i64,
}

/// Where a request stands after taking what a lease had.
enum Progress {
    Complete,
    /// A lease is on its way.
    Waiting,
    /// No lease is coming: the rest is recorded for this request alone.
    Alone,
}

enum Report {
    Returned(PoolRef, LeaseReport),
}

/// Numbers handed to a request, on their way to the shared handout write.
struct Handout {
    report: LeaseReport,
    written: oneshot::Sender<Result<(), HandoutFailed>>,
}

/// Why numbers handed to a request could not be recorded as handed out.
#[derive(Debug, Clone)]
enum HandoutFailed {
    /// Nothing was written: the numbers may be handed out again.
    NotWritten(LedgerError),
    /// Whether the write committed is unknown: the numbers are never handed
    /// out again (reconciliation tells what became of them).
    Unknown(LedgerError),
}

impl HandoutFailed {
    fn error(self) -> LedgerError {
        match self {
            HandoutFailed::NotWritten(e) | HandoutFailed::Unknown(e) => e,
        }
    }
}

pub struct Leases {
    issuer: Arc<Issuer>,
    pools: Arc<PoolService>,
    /// Measures the rate; injected so tests can set it.
    clock: Arc<dyn Clock>,
    settings: LeaseSettings,
    holders: Mutex<HashMap<HolderKey, Arc<Holder>>>,
    /// Handouts of concurrent requests, written together.
    handouts: mpsc::UnboundedSender<Handout>,
    reports: mpsc::UnboundedSender<Report>,
    /// Held by the reporter while it runs (a restarted one takes it over).
    received: tokio::sync::Mutex<mpsc::UnboundedReceiver<Report>>,
    /// Returns not yet given back.
    unwritten: AtomicUsize,
    stats: Arc<Stats>,
}

impl Leases {
    /// The leases; [`Leases::report`] must run for their reports to be
    /// written.
    pub fn new(
        issuer: Arc<Issuer>,
        pools: Arc<PoolService>,
        clock: Arc<dyn Clock>,
        settings: LeaseSettings,
        stats: Arc<Stats>,
    ) -> Arc<Self> {
        let (reports, received) = mpsc::unbounded_channel();
        // Lives as long as the leases (past the server's drain): every
        // request that took numbers gets its answer written.
        let handouts = spawn_handout_writers(issuer.db.clone());
        Arc::new(Self {
            issuer,
            pools,
            clock,
            settings,
            holders: Mutex::new(HashMap::new()),
            handouts,
            reports,
            received: tokio::sync::Mutex::new(received),
            unwritten: AtomicUsize::new(0),
            stats,
        })
    }

    /// Issues `count` numbers to `POST /ids`: from this instance's lease
    /// when the sequence's rate makes one worthwhile, on their own otherwise.
    pub async fn issue(
        self: &Arc<Self>,
        project: &ProjectCode,
        doc_type: &TypeCode,
        count: usize,
    ) -> Result<Issued, IssueError> {
        if !self.settings.enabled {
            return self.issuer.issue(project, doc_type, count).await;
        }
        let placement = self.issuer.place(project, doc_type).await?;
        let holder = self.holder(&placement);
        let mut got = Vec::with_capacity(count);
        // The common case takes numbers under the lock and hands their
        // handout to the shared writer before any await, so a caller going
        // away cannot drop numbers on the floor; the answer waits for the
        // handout's commit.
        match self.take_or_fetch(&holder, &placement, count, &mut got, true) {
            Progress::Complete => {
                let written = self.hand_out(&holder, &got);
                return self.answer(&holder, placement, got, written).await;
            }
            Progress::Alone if got.is_empty() => {
                // A quiet sequence: the lease would be this request.
                let seqs = self
                    .issuer
                    .issue_placed(placement.clone(), count, Via::Ids)
                    .await?;
                return Ok(Issued { placement, seqs });
            }
            Progress::Alone | Progress::Waiting => {}
        }
        // Waiting for a lease (or recording the rest on its own) runs in a
        // task of its own, for the same reason.
        let leases = self.clone();
        let waiting = placement.clone();
        let seqs =
            tokio::spawn(async move { leases.wait(holder, waiting, count, got).await }).await??;
        Ok(Issued { placement, seqs })
    }

    /// Starts recording `seqs` as handed out (no await: they are the
    /// writer's once this returns); the receiver says how it went.
    fn hand_out(
        &self,
        holder: &Holder,
        seqs: &[i64],
    ) -> oneshot::Receiver<Result<(), HandoutFailed>> {
        let (written, answer) = oneshot::channel();
        if seqs.is_empty() {
            let _ = written.send(Ok(()));
            return answer;
        }
        self.stats.lease_numbers_served.inc_by(seqs.len() as u64);
        let handout = Handout {
            report: LeaseReport {
                sequence_id: holder.sequence.id,
                period: holder.period.clone(),
                seqs: seqs.to_vec(),
            },
            written,
        };
        if let Err(closed) = self.handouts.send(handout) {
            let _ = closed
                .0
                .written
                .send(Err(HandoutFailed::NotWritten(LedgerError::Closed)));
        }
        answer
    }

    /// The answer to a request once its handout is written; numbers whose
    /// handout surely was not written go back to the lease.
    async fn answer(
        &self,
        holder: &Holder,
        placement: Arc<Placement>,
        seqs: Vec<i64>,
        written: oneshot::Receiver<Result<(), HandoutFailed>>,
    ) -> Result<Issued, IssueError> {
        let seqs = self.written(holder, seqs, written).await?;
        Ok(Issued { placement, seqs })
    }

    async fn written(
        &self,
        holder: &Holder,
        seqs: Vec<i64>,
        written: oneshot::Receiver<Result<(), HandoutFailed>>,
    ) -> Result<Vec<i64>, IssueError> {
        let outcome = written
            .await
            .unwrap_or(Err(HandoutFailed::Unknown(LedgerError::Closed)));
        match outcome {
            Ok(()) => Ok(seqs),
            Err(failed @ HandoutFailed::NotWritten(_)) => {
                self.put_back(holder, seqs);
                Err(IssueError::Ledger(failed.error()))
            }
            Err(failed) => Err(IssueError::Ledger(failed.error())),
        }
    }

    fn holder(&self, placement: &Placement) -> Arc<Holder> {
        let sequence = &placement.sequence;
        let key = (
            sequence.id,
            sequence.version,
            placement.period.key().to_owned(),
        );
        let mut holders = self.holders.lock().unwrap_or_else(|e| e.into_inner());
        holders
            .entry(key)
            .or_insert_with(|| {
                Arc::new(Holder {
                    pool: placement.pool.clone(),
                    sequence: sequence.clone(),
                    period: placement.period.key().to_owned(),
                    state: Mutex::new(State::default()),
                    changed: Notify::new(),
                })
            })
            .clone()
    }

    /// Moves leased numbers into `got` until it holds `count`, and starts
    /// the next lease when a quarter of the last one is left (or none is,
    /// and the rate asks for one).
    fn take_or_fetch(
        self: &Arc<Self>,
        holder: &Arc<Holder>,
        placement: &Arc<Placement>,
        count: usize,
        got: &mut Vec<i64>,
        first_visit: bool,
    ) -> Progress {
        let now = self.clock.now();
        let mut state = holder.state();
        if first_visit {
            state.rate.add(count, now);
        }
        if state.closed {
            return Progress::Alone;
        }
        let take = (count - got.len()).min(state.numbers.len());
        got.extend(state.numbers.drain(..take));
        let missing = count - got.len();
        let low = state.numbers.len() * 4 <= state.last_size;
        if !state.fetching && (missing > 0 || low) {
            let pool_size = placement.sequence.definition.pool_size as usize;
            let rate = state.rate.per_second(now);
            if let Some(size) = lease_size(rate, self.settings.traffic, missing, pool_size) {
                state.fetching = true;
                state.last_size = size;
                drop(state);
                self.fetch(holder.clone(), placement.clone(), size);
                return if missing == 0 {
                    Progress::Complete
                } else {
                    Progress::Waiting
                };
            }
        }
        if missing == 0 {
            Progress::Complete
        } else if state.fetching {
            Progress::Waiting
        } else {
            Progress::Alone
        }
    }

    /// Waits for leases until `count` numbers are in `got`; whatever no
    /// lease is coming for is recorded on its own.
    async fn wait(
        self: Arc<Self>,
        holder: Arc<Holder>,
        placement: Arc<Placement>,
        count: usize,
        mut got: Vec<i64>,
    ) -> Result<Vec<i64>, IssueError> {
        if !self.fill(&holder, &placement, count, &mut got).await {
            return self.on_its_own(&holder, placement, count, got).await;
        }
        let written = self.hand_out(&holder, &got);
        let mut got = self.written(&holder, got, written).await?;
        got.sort_unstable();
        Ok(got)
    }

    /// Waits for leases until `count` numbers are in `got`. False when no
    /// lease is coming (the rate asks for none, or taking one failed: the
    /// caller finds out why on its own).
    async fn fill(
        self: &Arc<Self>,
        holder: &Arc<Holder>,
        placement: &Arc<Placement>,
        count: usize,
        got: &mut Vec<i64>,
    ) -> bool {
        loop {
            let changed = holder.changed.notified();
            tokio::pin!(changed);
            // Registered before the state is read, so a lease arriving in
            // between still wakes this request.
            changed.as_mut().enable();
            let failures = holder.state().failures;
            match self.take_or_fetch(holder, placement, count, got, false) {
                Progress::Complete => return true,
                Progress::Alone => return false,
                Progress::Waiting => {}
            }
            changed.await;
            if holder.state().failures != failures {
                return false;
            }
        }
    }

    /// A document's claim on this instance's lease, made without waiting:
    /// None when the sequence's rate asks for no lease (the document takes
    /// the per-request path). A claim may already hold its number, so the
    /// caller hands it at once to a task a client cannot cancel, which
    /// turns it into a number ([`Leases::document_number`]), writes the
    /// document's outbox row (the lease's ledger record already covers the
    /// number) and then says how that went ([`Leases::unwritten`]).
    pub fn claim_for_document(self: &Arc<Self>, placement: &Arc<Placement>) -> Option<LeaseClaim> {
        if !self.settings.enabled {
            return None;
        }
        let holder = self.holder(placement);
        let mut got = Vec::with_capacity(1);
        let seq = match self.take_or_fetch(&holder, placement, 1, &mut got, true) {
            Progress::Complete => got.pop(),
            Progress::Waiting => None,
            Progress::Alone => return None,
        };
        Some(LeaseClaim {
            holder,
            placement: placement.clone(),
            seq,
        })
    }

    /// The number of a claim, waiting for the lease on its way if the
    /// claim holds none yet; None when no lease came after all.
    pub async fn document_number(self: &Arc<Self>, claim: LeaseClaim) -> Option<Leased> {
        let LeaseClaim {
            holder,
            placement,
            seq,
        } = claim;
        let seq = match seq {
            Some(seq) => seq,
            None => {
                let mut got = Vec::with_capacity(1);
                if !self.fill(&holder, &placement, 1, &mut got).await {
                    return None;
                }
                got.pop()?
            }
        };
        self.stats.lease_numbers_served.inc();
        Some(Leased { holder, seq })
    }

    /// A leased number whose document was not written. When the database
    /// surely rolled the write back and the number itself is not at fault,
    /// it goes back to the lease; otherwise (the outcome is unknown, or the
    /// ID it prints is taken) it is recorded as discarded, never handed out
    /// again.
    pub async fn unwritten(&self, leased: Leased, reusable: bool) {
        let Leased { holder, seq } = leased;
        if reusable {
            self.put_back(&holder, vec![seq]);
            return;
        }
        self.pools
            .record_discard(
                &holder.sequence,
                &holder.period,
                &[SeqRange::single(seq)],
                DiscardCause::DocumentNotWritten,
            )
            .await;
    }

    /// The numbers `got` lacks, recorded for this request alone; `got`
    /// goes back to the lease if that fails.
    async fn on_its_own(
        &self,
        holder: &Holder,
        placement: Arc<Placement>,
        count: usize,
        got: Vec<i64>,
    ) -> Result<Vec<i64>, IssueError> {
        let missing = count - got.len();
        match self.issuer.issue_placed(placement, missing, Via::Ids).await {
            Ok(more) => {
                let written = self.hand_out(holder, &got);
                let mut got = self.written(holder, got, written).await?;
                got.extend(more);
                got.sort_unstable();
                Ok(got)
            }
            Err(e) => {
                self.put_back(holder, got);
                Err(e)
            }
        }
    }

    fn put_back(&self, holder: &Holder, seqs: Vec<i64>) {
        if seqs.is_empty() {
            return;
        }
        let mut state = holder.state();
        if state.closed {
            drop(state);
            self.returned(holder, seqs);
            return;
        }
        state.numbers.extend(seqs);
        state.numbers.make_contiguous().sort_unstable();
    }

    /// Takes a lease of `size` numbers in a task of its own.
    fn fetch(self: &Arc<Self>, holder: Arc<Holder>, placement: Arc<Placement>, size: usize) {
        let leases = self.clone();
        tokio::spawn(async move {
            let leased = leases
                .issuer
                .issue_placed(placement, size, Via::Lease)
                .await;
            let mut state = holder.state();
            state.fetching = false;
            match leased {
                Ok(seqs) => {
                    leases.stats.leases_taken.inc();
                    leases.stats.lease_numbers.inc_by(seqs.len() as u64);
                    if state.closed {
                        drop(state);
                        leases.returned(&holder, seqs);
                    } else {
                        state.numbers.extend(seqs);
                        state.numbers.make_contiguous().sort_unstable();
                        state.leased_at = Some(Instant::now());
                        drop(state);
                    }
                }
                Err(e) => {
                    state.failures += 1;
                    drop(state);
                    tracing::debug!(error = %e, size, "lease not taken; requests are served on their own");
                }
            }
            holder.changed.notify_waiters();
        });
    }

    fn returned(&self, holder: &Holder, seqs: Vec<i64>) {
        if seqs.is_empty() {
            return;
        }
        self.stats.lease_numbers_returned.inc_by(seqs.len() as u64);
        self.unwritten.fetch_add(1, Ordering::AcqRel);
        let report = LeaseReport {
            sequence_id: holder.sequence.id,
            period: holder.period.clone(),
            seqs,
        };
        let _ = self
            .reports
            .send(Report::Returned(holder.pool.clone(), report));
    }

    /// Gives back what leases idle longer than `max_idle`, or taken longer
    /// than `max_age` ago, still hold (all of it when `everything`, at a
    /// clean stop), and forgets holders no request uses any more.
    fn sweep(&self, everything: bool) {
        let now = self.clock.now();
        let mut holders = self.holders.lock().unwrap_or_else(|e| e.into_inner());
        let mut unused = Vec::new();
        for (key, holder) in holders.iter() {
            let mut state = holder.state();
            if everything {
                state.closed = true;
            }
            let left = state.numbers.len();
            if left < state.left_at_sweep {
                state.used_at = Some(Instant::now());
            }
            state.left_at_sweep = left;
            let idle = state
                .used_at
                .max(state.leased_at)
                .is_none_or(|at| at.elapsed() >= self.settings.max_idle);
            let old = state
                .leased_at
                .is_none_or(|at| at.elapsed() >= self.settings.max_age);
            if (everything || ((idle || old) && !state.fetching)) && !state.numbers.is_empty() {
                let seqs: Vec<i64> = state.numbers.drain(..).collect();
                state.left_at_sweep = 0;
                drop(state);
                self.returned(holder, seqs);
                continue;
            }
            // A holder keeps the sequence's rate: forgotten only once no
            // request uses it and the rate has faded.
            if idle
                && !state.fetching
                && state.numbers.is_empty()
                && state.rate.per_second(now) < 1.0
                && Arc::strong_count(holder) == 1
            {
                unused.push(key.clone());
            }
        }
        for key in unused {
            holders.remove(&key);
        }
    }

    /// At a clean stop: leases still being taken arrive (and are given
    /// back) before the last write, within a bound.
    async fn wait_for_fetches(&self) {
        let deadline = Instant::now() + Duration::from_secs(2);
        while Instant::now() < deadline {
            let fetching = {
                let holders = self.holders.lock().unwrap_or_else(|e| e.into_inner());
                holders.values().any(|h| h.state().fetching)
            };
            if !fetching {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Waits (up to 5 s) until every lease given back so far is back in
    /// its pool.
    pub async fn returns_written(&self) {
        let deadline = Instant::now() + Duration::from_secs(5);
        while self.unwritten.load(Ordering::Acquire) > 0 && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// The background reporter: every `report_every` gives back idle
    /// leases and writes the returns; at `stop` (once the server has
    /// drained: no request takes numbers any more) gives back every lease
    /// before it returns.
    pub async fn report(self: Arc<Self>, db: PgPool, stop: CancellationToken) {
        let mut reports = self.received.lock().await;
        let mut tick = tokio::time::interval(self.settings.report_every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let stopping = tokio::select! {
                _ = stop.cancelled() => true,
                _ = tick.tick() => false,
            };
            self.sweep(stopping);
            if stopping {
                self.wait_for_fetches().await;
                self.sweep(true);
            }
            let mut returned = Vec::new();
            while let Ok(Report::Returned(pool, report)) = reports.try_recv() {
                returned.push((pool, report));
            }
            let returns = returned.len();
            for (pool, unused) in merge_per_pool(returned) {
                self.give_back(&db, &pool, &unused).await;
            }
            self.unwritten.fetch_sub(returns, Ordering::AcqRel);
            if stopping {
                tracing::info!("leases given back");
                return;
            }
        }
    }
}

impl Leases {
    /// Numbers a lease did not hand out go back to the head of their pool
    /// (off the ledger first), so the next caller gets them and no gap is
    /// left. Where that cannot be done they are recorded as discarded.
    async fn give_back(&self, db: &PgPool, pool: &PoolRef, unused: &LeaseReport) {
        let released = match db.acquire().await {
            Ok(mut conn) => ledger::release_lease(&mut conn, unused).await,
            Err(e) => Err(e),
        };
        let cause = match released {
            Ok(()) => match self.pools.give_back(pool, &unused.seqs).await {
                Ok(()) => return,
                Err(e) => {
                    tracing::warn!(error = %e, "unused lease numbers not pushed back to the pool");
                    DiscardCause::GiveBackFailed
                }
            },
            Err(e) => {
                tracing::warn!(error = %e, "unused lease numbers stay recorded as leased");
                DiscardCause::LeaseReturned
            }
        };
        self.pools
            .record_discard(&pool.sequence, &unused.period, &runs(&unused.seqs), cause)
            .await;
    }
}

/// The numbers returned to each pool, in one ascending report per pool.
/// Each give-back pushes to the head of the pool, so two given back apart
/// would put the later one's (a lease that arrived at a clean stop, say)
/// in front of lower numbers.
fn merge_per_pool(returned: Vec<(PoolRef, LeaseReport)>) -> Vec<(PoolRef, LeaseReport)> {
    let mut merged: Vec<(PoolRef, LeaseReport)> = Vec::new();
    for (pool, report) in returned {
        match merged
            .iter_mut()
            .find(|(p, r)| p.keys.pool == pool.keys.pool && r.sequence_id == report.sequence_id)
        {
            Some((_, into)) => into.seqs.extend(report.seqs),
            None => merged.push((pool, report)),
        }
    }
    for (_, report) in &mut merged {
        report.seqs.sort_unstable();
    }
    merged
}

/// Writers of handouts working at once. One: everything that arrives while
/// it commits goes into its next commit. (Measured with the bench's ratio
/// and latency scenarios, alternating: one writer 0.43 / 0.42 of GET
/// /healthz and a p99 1.10 / 1.14 times pgbench's; two 0.38 / 0.39 and
/// 1.40 / 1.52; four 0.33 / 0.33 and 1.59 / 1.60. More commits cost more
/// than the wait they save.)
const HANDOUT_WRITERS: usize = 1;

/// Most handouts one statement records.
const HANDOUTS_PER_WRITE: usize = 4096;

/// Starts the handout writers; they stop once every sender is dropped and
/// the queue is drained. The queue holds at most the requests in flight.
fn spawn_handout_writers(db: PgPool) -> mpsc::UnboundedSender<Handout> {
    let (sender, receiver) = mpsc::unbounded_channel();
    let receiver = Arc::new(tokio::sync::Mutex::new(receiver));
    for _ in 0..HANDOUT_WRITERS {
        let (db, receiver) = (db.clone(), receiver.clone());
        tokio::spawn(async move {
            let mut conn: Option<sqlx::pool::PoolConnection<sqlx::Postgres>> = None;
            let mut batch = Vec::with_capacity(64);
            loop {
                let taken = receiver
                    .lock()
                    .await
                    .recv_many(&mut batch, HANDOUTS_PER_WRITE)
                    .await;
                if taken == 0 {
                    return;
                }
                write_handouts(&db, &mut conn, std::mem::take(&mut batch)).await;
            }
        });
    }
    sender
}

/// Records the handouts of every request waiting in one statement (its
/// own commit) on the writer's connection, then answers each.
async fn write_handouts(
    db: &PgPool,
    conn: &mut Option<sqlx::pool::PoolConnection<sqlx::Postgres>>,
    batch: Vec<Handout>,
) {
    let reports: Vec<LeaseReport> = batch.iter().map(|h| h.report.clone()).collect();
    let outcome = match writer_connection(db, conn).await {
        // No connection: nothing was written.
        Err(e) => Err(HandoutFailed::NotWritten(LedgerError::from(e))),
        Ok(held) => match ledger::record_handouts(held, &reports).await {
            Ok(()) => Ok(()),
            Err(e) => {
                let e = LedgerError::from(e);
                if !e.numbers_reusable() {
                    // The connection may be broken: the next write takes
                    // a new one.
                    *conn = None;
                }
                Err(if e.numbers_reusable() {
                    HandoutFailed::NotWritten(e)
                } else {
                    HandoutFailed::Unknown(e)
                })
            }
        },
    };
    for handout in batch {
        let _ = handout.written.send(outcome.clone());
    }
}

/// The writer's connection, taken from the pool when it has none.
async fn writer_connection<'c>(
    db: &PgPool,
    conn: &'c mut Option<sqlx::pool::PoolConnection<sqlx::Postgres>>,
) -> Result<&'c mut sqlx::PgConnection, sqlx::Error> {
    if conn.is_none() {
        *conn = Some(db.acquire().await?);
    }
    match conn.as_mut() {
        Some(held) => Ok(&mut **held),
        None => Err(sqlx::Error::PoolClosed),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::TimeZone;

    fn at(ms: i64) -> DateTime<Utc> {
        Utc.timestamp_millis_opt(1_800_000_000_000 + ms).unwrap()
    }

    #[test]
    fn a_steady_rate_reads_as_itself() {
        let mut rate = Rate::default();
        // 10,000 numbers a second: one every 100 µs, for a second.
        for i in 0..10_000 {
            rate.add(1, at(0) + chrono::Duration::microseconds(i * 100));
        }
        let read = rate.per_second(at(1000));
        assert!((9_000.0..11_000.0).contains(&read), "{read}");
    }

    #[test]
    fn a_quiet_sequence_gets_no_lease_and_a_busy_one_gets_50_ms_of_traffic() {
        let traffic = Duration::from_millis(50);
        // One request a second: the lease would be the request.
        let mut rate = Rate::default();
        for s in 0..10 {
            rate.add(1, at(s * 1000));
        }
        assert_eq!(
            lease_size(rate.per_second(at(9000)), traffic, 1, 1000),
            None
        );
        // 20,000 a second: 1,000 numbers is 50 ms of it.
        let mut rate = Rate::default();
        for i in 0..20_000 {
            rate.add(1, at(0) + chrono::Duration::microseconds(i * 50));
        }
        let size = lease_size(rate.per_second(at(1000)), traffic, 1, 5000).unwrap();
        assert!((900..=1100).contains(&size), "{size}");
        // Never more than the pool holds.
        assert_eq!(
            lease_size(rate.per_second(at(1000)), traffic, 1, 100),
            Some(100)
        );
        // A burst of six requests within milliseconds: no lease.
        let mut rate = Rate::default();
        for ms in 0..6 {
            rate.add(1, at(ms));
        }
        assert_eq!(lease_size(rate.per_second(at(6)), traffic, 1, 1000), None);
    }

    #[test]
    fn the_rate_forgets_a_burst() {
        let mut rate = Rate::default();
        rate.add(10_000, at(0));
        assert!(lease_size(rate.per_second(at(0)), Duration::from_millis(50), 1, 1000).is_some());
        assert_eq!(
            lease_size(
                rate.per_second(at(2000)),
                Duration::from_millis(50),
                1,
                1000
            ),
            None
        );
    }
}
