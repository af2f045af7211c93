//! Pools: pre-reserved numbers of one sequence period, waiting in a Redis
//! list, popped in ascending order and refilled in the background.
//!
//! Refills are single-flight per pool inside an instance, serialised across
//! instances by a Redis lock (`SET NX PX` + compare-and-delete), and capped by
//! a semaphore per instance, so thousands of pools draining at once cost at
//! most `refill_concurrency` refills, each holding nothing but two integers:
//! the numbers themselves are generated inside Redis by the push script.

mod discard;
mod placement;
mod redis;
mod scripts;
mod shared_pop;
pub use self::shared_pop::pop_shared;
pub mod url;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::clock::Clock;
use futures::FutureExt;
use futures::future::{BoxFuture, Shared};
use tokio::sync::{Semaphore, oneshot};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

pub use self::discard::DiscardCause;
pub use self::placement::Placement;
pub use self::redis::{PoolKeys, Popped, Pushed, RedisFailure, RedisLink, RedisSettings};
use crate::batch::Batcher;
use crate::counter::{Counter, PoolBlock, Reserved};
use crate::numbers::SeqRange;
use crate::sequence::{Period, ProjectCode, Sequence, TypeCode};
use crate::sequence_store::SequenceStore;
use crate::stats::Stats;

/// One sequence period's pool.
#[derive(Clone)]
pub struct PoolRef {
    pub sequence: Arc<Sequence>,
    pub period: Period,
    pub keys: Arc<PoolKeys>,
}

#[derive(Debug, Clone)]
pub struct PoolSettings {
    /// Refills running at once in this instance.
    pub refill_concurrency: usize,
    /// How long a refill lock lives if its holder dies.
    pub lock_ttl: Duration,
    /// How long a request the pool could not serve waits for the refill it
    /// needs before taking the rest from Postgres.
    pub short_wait: Duration,
    /// A pool refilled again within this time doubles its target depth...
    pub grow_within: Duration,
    /// ...and one idle longer than this halves it, never below `pool_size`.
    pub shrink_after: Duration,
    /// Largest target depth as a multiple of `pool_size`.
    pub max_growth: u32,
    /// This database's installation id; the Redis key prefix must be its own.
    pub installation: String,
}

impl Default for PoolSettings {
    fn default() -> Self {
        Self {
            refill_concurrency: 8,
            lock_ttl: Duration::from_secs(10),
            short_wait: Duration::from_millis(250),
            grow_within: Duration::from_secs(2),
            shrink_after: Duration::from_secs(60),
            max_growth: 64,
            installation: String::new(),
        }
    }
}

/// How long a request the pool could not serve waits before looking again
/// while another instance holds the refill lock.
const BUSY_POLL: Duration = Duration::from_millis(3);

/// Upper bound for any pool's target depth.
const MAX_TARGET: u32 = 1_000_000;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RefillOutcome {
    Refilled,
    NotNeeded,
    /// Another instance holds the lock.
    Busy,
    Exhausted,
    Failed,
}

struct PopRequest {
    keys: Arc<PoolKeys>,
    count: usize,
    reply: oneshot::Sender<Result<Popped, RedisFailure>>,
}

type SharedRefill = Shared<BoxFuture<'static, RefillOutcome>>;

pub struct PoolService {
    redis: Arc<RedisLink>,
    counter: Arc<Counter>,
    sequences: Arc<SequenceStore>,
    stats: Arc<Stats>,
    settings: PoolSettings,
    clock: Arc<dyn Clock>,
    pops: Batcher<PopRequest>,
    refills_in_flight: Mutex<HashMap<Arc<PoolKeys>, SharedRefill>>,
    /// Numbers requests of this instance are waiting for, per pool.
    demand: Mutex<HashMap<Arc<PoolKeys>, i64>>,
    /// The current pool of each sequence seen, by sequence id and period.
    pool_refs: Mutex<HashMap<i64, HashMap<String, PoolRef>>>,
    refill_slots: Arc<Semaphore>,
    /// Refills running in the background; awaited (for a while) at shutdown.
    refills: TaskTracker,
    /// Which Postgres the last resync checked the pools against.
    postgres_seen: Mutex<Option<crate::counter::PostgresIdentity>>,
}

/// Most sequences whose current pool one instance remembers.
const MAX_POOL_REFS: usize = 10_000;

impl PoolService {
    pub fn new(
        redis: Arc<RedisLink>,
        counter: Arc<Counter>,
        sequences: Arc<SequenceStore>,
        stats: Arc<Stats>,
        settings: PoolSettings,
        clock: Arc<dyn Clock>,
        tasks: &TaskTracker,
    ) -> Arc<Self> {
        let (pop_link, pop_stats) = (redis.clone(), stats.clone());
        let pops = Batcher::spawn(tasks, "pool pops", 4096, move |batch| {
            pop_batch(pop_link.clone(), pop_stats.clone(), batch)
        });
        Arc::new(Self {
            refill_slots: Arc::new(Semaphore::new(settings.refill_concurrency.max(1))),
            redis,
            counter,
            sequences,
            stats,
            settings,
            clock,
            pops,
            refills_in_flight: Mutex::new(HashMap::new()),
            demand: Mutex::new(HashMap::new()),
            pool_refs: Mutex::new(HashMap::new()),
            refills: TaskTracker::new(),
            postgres_seen: Mutex::new(None),
        })
    }

    /// Waits up to `limit` for the refills in flight, so a stopping
    /// instance does not leave a block reserved but never pushed.
    pub async fn finish_refills(&self, limit: Duration) {
        self.refills.close();
        if tokio::time::timeout(limit, self.refills.wait())
            .await
            .is_err()
        {
            tracing::warn!(
                running = self.refills.len(),
                "refills still running at shutdown; their blocks are recorded as lost"
            );
        }
    }

    pub fn counter(&self) -> &Arc<Counter> {
        &self.counter
    }

    pub fn redis(&self) -> &Arc<RedisLink> {
        &self.redis
    }

    /// The pool of `sequence` in `period`; kept between requests, since
    /// building its keys is most of the work.
    pub fn pool_ref(&self, sequence: Arc<Sequence>, period: Period) -> PoolRef {
        let mut known = self.pool_refs.lock().unwrap_or_else(|e| e.into_inner());
        if known.len() >= MAX_POOL_REFS && !known.contains_key(&sequence.id) {
            known.clear();
        }
        let periods = known.entry(sequence.id).or_default();
        if let Some(pool) = periods.get(period.key())
            && Arc::ptr_eq(&pool.sequence, &sequence)
        {
            return pool.clone();
        }
        let keys = Arc::new(self.redis.keys(
            sequence.project.as_str(),
            sequence.doc_type.as_str(),
            period.key(),
        ));
        let pool = PoolRef {
            sequence,
            period,
            keys,
        };
        // One period at a time is current; older ones are not needed here.
        periods.clear();
        periods.insert(pool.period.key().to_owned(), pool.clone());
        pool
    }

    /// Pops up to `count` numbers. A pool that runs short gets the refill it
    /// needs (waited for up to `short_wait`) and one more pop; what is still
    /// missing is the caller's to take from Postgres.
    pub async fn take(
        self: &Arc<Self>,
        pool: &PoolRef,
        count: usize,
    ) -> Result<Vec<i64>, RedisFailure> {
        let mut popped = self.pop(pool, count).await?;
        let mut seqs = self
            .within_max(pool, std::mem::take(&mut popped.seqs))
            .await;
        if seqs.len() < count {
            self.stats.pool_short.inc();
            // The refill also brings what waiting requests lack, so a big
            // request is served from the pool, in order, rather than from
            // the counter past numbers a refill just pushed. Registered
            // before any refill can start, so the next one sees it.
            self.add_demand(pool, count - seqs.len());
        }
        self.refill_if_low(pool, &popped);
        if seqs.len() < count {
            let deadline = tokio::time::Instant::now() + self.settings.short_wait;
            while seqs.len() < count {
                let refill = tokio::time::timeout_at(deadline, self.refill_handle(pool)).await;
                match refill {
                    Ok(RefillOutcome::Refilled | RefillOutcome::NotNeeded) => {}
                    // Another instance is refilling: give it a moment
                    // rather than queueing lock attempts behind the cap.
                    Ok(RefillOutcome::Busy) => {
                        if tokio::time::Instant::now() + BUSY_POLL >= deadline {
                            break;
                        }
                        tokio::time::sleep(BUSY_POLL).await;
                    }
                    Ok(RefillOutcome::Exhausted | RefillOutcome::Failed) | Err(_) => break,
                }
                let mut again = self.pop(pool, count - seqs.len()).await?;
                seqs.extend(self.within_max(pool, std::mem::take(&mut again.seqs)).await);
                if seqs.len() < count {
                    self.add_demand(pool, count - seqs.len());
                }
                self.refill_if_low(pool, &again);
            }
        }
        Ok(seqs)
    }

    /// One pop, shared with every request waiting for one (a Redis call
    /// per pool for all of them). A pool that runs low is refilled in the
    /// background; one that came up short is left to the callers' `take`
    /// for the rest, whose refill brings what they lack along with the
    /// pool's own depth.
    pub async fn pop_once(
        self: &Arc<Self>,
        pool: &PoolRef,
        count: usize,
    ) -> Result<Vec<i64>, RedisFailure> {
        let popped = self.pop(pool, count).await?;
        if popped.seqs.len() == count {
            self.refill_if_low(pool, &popped);
        }
        Ok(self.within_max(pool, popped.seqs).await)
    }

    /// Numbers above the sequence's `max` (a pool filled before `max` was
    /// lowered) are never issued: they are recorded as discarded.
    async fn within_max(&self, pool: &PoolRef, mut seqs: Vec<i64>) -> Vec<i64> {
        let max = pool.sequence.definition.max_seq();
        if seqs.iter().all(|s| *s <= max) {
            return seqs;
        }
        let above: Vec<i64> = seqs.iter().copied().filter(|s| *s > max).collect();
        seqs.retain(|s| *s <= max);
        let ranges = crate::numbers::runs(&above);
        self.record_discard(
            &pool.sequence,
            pool.period.key(),
            &ranges,
            DiscardCause::AboveMax,
        )
        .await;
        seqs
    }

    /// Removes numbers above `max` from every pool of `sequence` (its `max`
    /// was lowered) and records them.
    pub async fn trim_sequence_pools(&self, sequence: &Sequence) {
        let max = sequence.definition.max_seq();
        let pools = match self.pools_of(sequence).await {
            Ok(pools) => pools,
            Err(e) => {
                tracing::warn!(error = %e, "could not list pools to trim; numbers above max are dropped when popped");
                return;
            }
        };
        for (keys, period) in pools {
            match self.redis.trim_above(&keys, max).await {
                Ok(ranges) => {
                    self.record_discard(sequence, &period, &ranges, DiscardCause::AboveMax)
                        .await
                }
                Err(e) => tracing::warn!(error = %e, pool = %keys.pool, "could not trim pool"),
            }
        }
    }

    /// The pools Redis holds for `sequence`, each with its period.
    async fn pools_of(&self, sequence: &Sequence) -> Result<Vec<(PoolKeys, String)>, RedisFailure> {
        let listed = self
            .redis
            .pool_keys(Some((
                sequence.project.as_str(),
                sequence.doc_type.as_str(),
            )))
            .await?;
        Ok(listed
            .iter()
            .filter_map(|key| {
                let (project, doc_type, period) =
                    PoolKeys::parse_pool_key(self.redis.prefix(), key)?;
                Some((
                    self.redis.keys(project, doc_type, period),
                    period.to_owned(),
                ))
            })
            .collect())
    }

    async fn pop(&self, pool: &PoolRef, count: usize) -> Result<Popped, RedisFailure> {
        if !self.redis.is_up() {
            return Err(RedisFailure::Open);
        }
        let (reply, answer) = oneshot::channel();
        let request = PopRequest {
            keys: pool.keys.clone(),
            count,
            reply,
        };
        if self.pops.submit(request).await.is_err() {
            return Err(RedisFailure::Open);
        }
        answer.await.unwrap_or(Err(RedisFailure::Open))
    }

    fn low_water(pool: &PoolRef, target: i64) -> i64 {
        let definition = &pool.sequence.definition;
        let target = target.max(i64::from(definition.pool_size));
        ((target as f64) * (1.0 - definition.refill_at)).floor() as i64
    }

    fn refill_if_low(self: &Arc<Self>, pool: &PoolRef, popped: &Popped) {
        if popped.depth <= Self::low_water(pool, popped.target) {
            drop(self.refill_handle(pool));
        }
    }

    /// The refill of `pool` running in this instance, started if there is none.
    pub fn refill_handle(self: &Arc<Self>, pool: &PoolRef) -> SharedRefill {
        let mut running = self
            .refills_in_flight
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if let Some(refill) = running.get(&pool.keys) {
            return refill.clone();
        }
        let (done, outcome) = oneshot::channel();
        let refill = outcome
            .map(|r| r.unwrap_or(RefillOutcome::Failed))
            .boxed()
            .shared();
        running.insert(pool.keys.clone(), refill.clone());
        let service = self.clone();
        let pool = pool.clone();
        self.refills.spawn(async move {
            // Whatever becomes of the refill, even a panic, the pool must
            // not stay marked as refilling: nobody would refill it again.
            let _in_flight = InFlightRefill {
                service: &service,
                keys: &pool.keys,
            };
            let outcome = std::panic::AssertUnwindSafe(service.refill(&pool))
                .catch_unwind()
                .await
                .unwrap_or_else(|_| {
                    tracing::error!(pool = %pool.keys.pool, "refill panicked");
                    service.stats.task_panics.inc();
                    RefillOutcome::Failed
                });
            let _ = done.send(outcome);
        });
        refill
    }

    async fn refill(&self, pool: &PoolRef) -> RefillOutcome {
        let Ok(_slot) = self.refill_slots.acquire().await else {
            return RefillOutcome::Failed;
        };
        let _gauge = self.stats.refill_started();
        let started = std::time::Instant::now();
        let outcome = self.refill_locked(pool).await;
        let counter = match outcome {
            RefillOutcome::Refilled => {
                let took = started.elapsed().as_secs_f64();
                self.stats.refill_duration.observe(took);
                &self.stats.refills_done
            }
            RefillOutcome::Busy => &self.stats.refills_busy,
            RefillOutcome::Failed => &self.stats.refills_failed,
            RefillOutcome::NotNeeded | RefillOutcome::Exhausted => return outcome,
        };
        counter.inc();
        outcome
    }

    async fn refill_locked(&self, pool: &PoolRef) -> RefillOutcome {
        if !self.redis.is_up() {
            return RefillOutcome::Failed;
        }
        let token = uuid::Uuid::new_v4().simple().to_string();
        let locked = match self
            .redis
            .acquire(&pool.keys, &token, self.settings.lock_ttl)
            .await
        {
            Ok(Some(locked)) => locked,
            Ok(None) => return RefillOutcome::Busy,
            Err(e) => {
                tracing::warn!(error = %e, pool = %pool.keys.pool, "refill lock failed");
                return RefillOutcome::Failed;
            }
        };
        let lock_acquired_at = self.clock.now();
        let now_ms = lock_acquired_at.timestamp_millis();
        let target = self.adapted_target(pool, locked.target, locked.refilled_at_ms, now_ms);
        let demand = self.take_demand(pool);
        // Double check under the lock: another instance may have refilled
        // between our pop and our lock.
        if locked.depth > Self::low_water(pool, target) && locked.depth >= demand {
            let _ = self.redis.release(&pool.keys, &token).await;
            return RefillOutcome::NotNeeded;
        }
        let want = (target - locked.depth).max(0) + demand;
        let block = match self.reserve_block(pool, want, lock_acquired_at).await {
            Ok(block) => block,
            Err(outcome) => {
                let _ = self.redis.release(&pool.keys, &token).await;
                return outcome;
            }
        };
        self.push_block(pool, &token, block, target, now_ms).await
    }

    /// A block of `want` numbers from the counter, or why there is none.
    async fn reserve_block(
        &self,
        pool: &PoolRef,
        want: i64,
        lock_acquired_at: chrono::DateTime<chrono::Utc>,
    ) -> Result<PoolBlock, RefillOutcome> {
        let reserved = self
            .counter
            .reserve_pool_block(&pool.sequence, &pool.period, want, lock_acquired_at)
            .await;
        match reserved {
            Ok(Reserved::Got(block)) => Ok(block),
            Ok(Reserved::Exhausted) => Err(RefillOutcome::Exhausted),
            // The watch fences the counters, then refills go on.
            Ok(Reserved::Unfenced) => Err(RefillOutcome::Failed),
            Ok(Reserved::Stale) => {
                // The definition changed: the next request reads it anew.
                self.sequences.forget(&pool.sequence);
                Err(RefillOutcome::Failed)
            }
            Err(e) => {
                tracing::error!(error = %e, pool = %pool.keys.pool, "block reservation failed");
                Err(RefillOutcome::Failed)
            }
        }
    }

    /// Pushes the block while the lock `token` still holds; a block that
    /// cannot be pushed is recorded as discarded.
    async fn push_block(
        &self,
        pool: &PoolRef,
        token: &str,
        block: PoolBlock,
        target: i64,
        now_ms: i64,
    ) -> RefillOutcome {
        let pushed = self
            .redis
            .push(&pool.keys, token, block.range, target, now_ms)
            .await;
        let (cause, rest) = match pushed {
            Pushed::All(_depth) => {
                if let Err(e) = self.counter.mark_pushed(block.id).await {
                    tracing::warn!(error = %e, block = block.id, "could not mark block pushed");
                }
                return RefillOutcome::Refilled;
            }
            Pushed::LockLost(rest) => {
                tracing::warn!(pool = %pool.keys.pool, "refill lock expired before the push; rest of the block discarded");
                (DiscardCause::RefillLockLost, rest)
            }
            Pushed::Failed(e, rest) => {
                tracing::warn!(error = %e, pool = %pool.keys.pool, "push failed; rest of the block discarded");
                (DiscardCause::PushFailed, rest)
            }
        };
        self.record_discard(&pool.sequence, pool.period.key(), &[rest], cause)
            .await;
        RefillOutcome::Failed
    }

    fn add_demand(&self, pool: &PoolRef, numbers: usize) {
        let mut demand = self.demand.lock().unwrap_or_else(|e| e.into_inner());
        let waiting = demand.entry(pool.keys.clone()).or_default();
        *waiting = waiting
            .saturating_add(numbers as i64)
            .min(i64::from(MAX_TARGET));
    }

    /// What requests waiting on this pool lack; the refill about to reserve
    /// takes it all.
    fn take_demand(&self, pool: &PoolRef) -> i64 {
        let mut demand = self.demand.lock().unwrap_or_else(|e| e.into_inner());
        demand.remove(&pool.keys).unwrap_or(0)
    }

    /// Leaf's dynamic step: a pool refilled again soon after its last refill
    /// doubles its depth, an idle one halves it back towards `pool_size`.
    fn adapted_target(
        &self,
        pool: &PoolRef,
        current: i64,
        refilled_at_ms: i64,
        now_ms: i64,
    ) -> i64 {
        let base = i64::from(pool.sequence.definition.pool_size);
        let cap = (base * i64::from(self.settings.max_growth))
            .clamp(base, i64::from(MAX_TARGET).max(base));
        let current = if current <= 0 {
            base
        } else {
            current.clamp(base, cap)
        };
        if refilled_at_ms <= 0 {
            return current;
        }
        let since = Duration::from_millis(now_ms.saturating_sub(refilled_at_ms).max(0) as u64);
        if since < self.settings.grow_within {
            (current * 2).min(cap)
        } else if since > self.settings.shrink_after {
            (current / 2).max(base)
        } else {
            current
        }
    }

    pub async fn give_back(&self, pool: &PoolRef, seqs: &[i64]) -> Result<(), RedisFailure> {
        let mut sorted = seqs.to_vec();
        sorted.sort_unstable();
        self.redis.give_back(&pool.keys, &sorted).await
    }

    /// Empties a pool whose list cannot be trusted and records its numbers.
    pub async fn invalidate(&self, pool: &PoolRef, cause: DiscardCause) {
        match self.redis.discard(&pool.keys, false).await {
            Ok(ranges) => {
                self.record_discard(&pool.sequence, pool.period.key(), &ranges, cause)
                    .await
            }
            Err(e) => {
                tracing::warn!(error = %e, pool = %pool.keys.pool, "could not invalidate pool")
            }
        }
    }

    pub async fn record_discard(
        &self,
        sequence: &Sequence,
        period: &str,
        ranges: &[SeqRange],
        cause: DiscardCause,
    ) {
        if ranges.is_empty() {
            return;
        }
        let numbers: i64 = ranges.iter().map(SeqRange::len).sum();
        self.stats.pool_numbers_discarded.inc_by(numbers as u64);
        let starts: Vec<i64> = ranges.iter().map(|r| r.start).collect();
        let ends: Vec<i64> = ranges.iter().map(|r| r.end).collect();
        let written = sqlx::query(
            "INSERT INTO pool_discards (sequence_id, period, seqs, cause) \
             SELECT $1, $2, int8range(s, e), $3 FROM UNNEST($4::bigint[], $5::bigint[]) AS t(s, e)",
        )
        .bind(sequence.id)
        .bind(period)
        .bind(cause)
        .bind(&starts)
        .bind(&ends)
        .execute(self.counter.refill_db())
        .await;
        match written {
            Ok(_) => tracing::info!(
                project = %sequence.project, doc_type = %sequence.doc_type, period,
                numbers, %cause, "pool numbers discarded"
            ),
            Err(e) => tracing::error!(
                error = %e, project = %sequence.project, doc_type = %sequence.doc_type, period,
                numbers, %cause, "could not record discarded pool numbers"
            ),
        }
    }

    /// Empties every period's pool of `sequence` (its definition changed).
    pub async fn discard_sequence_pools(&self, sequence: &Sequence, cause: DiscardCause) {
        let pools = match self.pools_of(sequence).await {
            Ok(pools) => pools,
            Err(e) => {
                tracing::warn!(error = %e, "could not list pools to discard; they stay until the next reconnect check");
                return;
            }
        };
        for (keys, period) in pools {
            match self.redis.discard(&keys, false).await {
                Ok(ranges) => self.record_discard(sequence, &period, &ranges, cause).await,
                Err(e) => tracing::warn!(error = %e, pool = %keys.pool, "could not discard pool"),
            }
        }
    }

    /// After any (re)connect, before a single number is popped again: each
    /// pool not filled on the server now holding it (a restarted node, a
    /// promoted replica with a stale list) is emptied and its numbers
    /// recorded; then Postgres is checked against what Redis has seen.
    pub async fn resync(&self) -> Result<Resynced, ResyncError> {
        self.stats.redis_resyncs.inc();
        self.redis.claim_prefix(&self.settings.installation).await?;
        let mut resynced = Resynced::default();
        for key in self.redis.pool_keys(None).await? {
            let Some((project, doc_type, period)) =
                PoolKeys::parse_pool_key(self.redis.prefix(), &key)
            else {
                continue;
            };
            let keys = self.redis.keys(project, doc_type, period);
            let ranges = self.redis.discard(&keys, true).await?;
            if ranges.is_empty() {
                continue;
            }
            resynced.discarded_pools += 1;
            match self.sequences.get(project, doc_type).await {
                Ok(Some(sequence)) => {
                    self.record_discard(&sequence, period, &ranges, DiscardCause::RedisReconnect)
                        .await
                }
                _ => tracing::error!(key, "discarded a pool of an unknown sequence"),
            }
        }
        // Read first: a failover during the fence leaves the counters
        // unfenced on the new timeline, and reservations refuse it.
        let identity = self.counter.postgres_identity().await?;
        resynced.fenced_periods = self.fence_postgres().await?;
        self.counter.fenced_on(identity.timeline.clone());
        *self.postgres_seen.lock().unwrap_or_else(|e| e.into_inner()) = Some(identity);
        Ok(resynced)
    }

    /// Each store fences the other: a pool filled up to `max_end` means
    /// Postgres handed out numbers below it. A counter found behind that (a
    /// failover to a standby that missed the last commits) is moved past it
    /// before anything is served, the numbers in between recorded as taken,
    /// and the period's pool emptied. The periods fenced.
    async fn fence_postgres(&self) -> Result<usize, ResyncError> {
        let mut seen: Vec<(String, String, String, i64)> = Vec::new();
        for key in self.redis.meta_keys().await? {
            let Some((project, doc_type, period)) =
                PoolKeys::parse_meta_key(self.redis.prefix(), &key)
            else {
                continue;
            };
            let keys = self.redis.keys(project, doc_type, period);
            let max_end = self.redis.max_end(&keys).await?;
            if max_end > 0 {
                seen.push((project.into(), doc_type.into(), period.into(), max_end));
            }
        }
        if seen.is_empty() {
            return Ok(0);
        }
        let behind = self.counter.behind(&seen).await?;
        let mut fenced = 0;
        for (project, doc_type, period_key, max_end) in behind {
            let (Ok(project), Ok(doc_type)) =
                (ProjectCode::parse(&project), TypeCode::parse(&doc_type))
            else {
                continue;
            };
            // A sequence Postgres lost entirely comes back with the defaults.
            let sequence = self.sequences.get_or_create(&project, &doc_type).await?;
            let definition = &sequence.definition;
            let Some(period) = definition
                .reset
                .period_named(definition.timezone, &period_key)
            else {
                continue;
            };
            let Some(skipped) = self.counter.fence(&sequence, &period, max_end).await? else {
                continue;
            };
            let keys = self
                .redis
                .keys(project.as_str(), doc_type.as_str(), &period_key);
            let ranges = self.redis.discard(&keys, false).await?;
            self.record_discard(
                &sequence,
                &period_key,
                &ranges,
                DiscardCause::PostgresBehindRedis,
            )
            .await;
            tracing::error!(
                project = %project, doc_type = %doc_type, period = period_key,
                from = skipped.start, to = skipped.last(),
                "Postgres was behind Redis (a failover to a standby that missed commits?): \
                 counter moved past every number Redis had seen"
            );
            fenced += 1;
        }
        Ok(fenced)
    }

    /// Whether Postgres is another server (or timeline) than at the last
    /// resync: a failover the connection pool followed silently.
    async fn postgres_changed(&self) -> bool {
        let Ok(now) = self.counter.postgres_identity().await else {
            return false;
        };
        let seen = self.postgres_seen.lock().unwrap_or_else(|e| e.into_inner());
        seen.as_ref().is_some_and(|seen| *seen != now)
    }

    /// Keeps the circuit honest: after a failure or reconnect, waits for
    /// Redis to answer, checks the pools, then lets requests use them again.
    /// Every few seconds it also asks which Postgres it talks to: a new
    /// timeline stops the pools until they are checked against it.
    pub async fn watch_redis(self: Arc<Self>, stop: CancellationToken) {
        let mut last_complaint: Option<(String, std::time::Instant)> = None;
        // Since when the pools could not be used for want of a connection.
        let mut unreachable_since: Option<std::time::Instant> = None;
        let mut postgres_checked = std::time::Instant::now();
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = self.redis.woken() => {}
                _ = self.counter.moved() => {
                    self.redis.trip("Postgres is on a new timeline (failover); fencing its counters");
                }
                _ = tokio::time::sleep(Duration::from_millis(500)) => {}
            }
            if self.redis.is_up() {
                if postgres_checked.elapsed() >= POSTGRES_CHECK {
                    postgres_checked = std::time::Instant::now();
                    if self.postgres_changed().await {
                        self.redis
                            .trip("Postgres changed (failover?); checking the pools against it");
                    }
                }
                continue;
            }
            let failures_before = self.redis.failure_count();
            let reachable = self.redis.all_connected() && self.redis.ping().await.is_ok();
            let outcome = if reachable {
                self.resync().await.map_err(PoolsNotInUse::from)
            } else {
                // fred reports failed connection attempts only at debug level.
                let last = self.redis.last_failure();
                Err(if last.is_empty() {
                    PoolsNotInUse::NotConnected
                } else {
                    PoolsNotInUse::Unreachable(last)
                })
            };
            match outcome {
                Ok(resynced) => {
                    if resynced.discarded_pools > 0 {
                        tracing::warn!(
                            pools = resynced.discarded_pools,
                            "pools filled before the reconnect discarded"
                        );
                    }
                    if self.redis.mark_up(failures_before) {
                        unreachable_since = None;
                        last_complaint = None;
                    }
                }
                Err(e) => {
                    // A connection being made (at start, after a blip) is
                    // no error yet; what Redis or Postgres answered is.
                    let connecting = matches!(
                        e,
                        PoolsNotInUse::NotConnected | PoolsNotInUse::Unreachable(_)
                    );
                    let since = *unreachable_since.get_or_insert_with(std::time::Instant::now);
                    if connecting && since.elapsed() < CONNECT_GRACE {
                        continue;
                    }
                    if !connecting {
                        unreachable_since = None;
                    }
                    let message = e.to_string();
                    // Say it when it changes (at most every 10 s), and once
                    // a minute while it lasts.
                    let quiet = last_complaint.as_ref().is_some_and(|(m, at)| {
                        let wait = if *m == message { 60 } else { 10 };
                        at.elapsed() < Duration::from_secs(wait)
                    });
                    if !quiet {
                        tracing::error!(error = %message, "pools not in use");
                        last_complaint = Some((message, std::time::Instant::now()));
                    }
                }
            }
        }
    }
}

/// How long Redis may take to connect (at start, or after a reconnect)
/// before the watch calls it an error.
const CONNECT_GRACE: Duration = Duration::from_secs(3);

/// How often the watch asks which Postgres it talks to.
const POSTGRES_CHECK: Duration = Duration::from_secs(2);

/// What a resync did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Resynced {
    /// Pools emptied because the server holding them did not fill them.
    pub discarded_pools: usize,
    /// Periods whose counter was found behind Redis and moved past it.
    pub fenced_periods: usize,
}

#[derive(Debug, thiserror::Error)]
pub enum ResyncError {
    #[error(transparent)]
    Redis(#[from] RedisFailure),
    #[error("postgres: {0}")]
    Postgres(#[from] sqlx::Error),
    #[error(transparent)]
    Store(#[from] crate::sequence_store::StoreError),
}

/// Why the watch keeps the pools out of use.
#[derive(Debug, thiserror::Error)]
enum PoolsNotInUse {
    #[error("Redis not connected yet (RUST_LOG=fred=debug shows each attempt)")]
    NotConnected,
    /// fred's last word on the connection.
    #[error("Redis unreachable: {0}")]
    Unreachable(String),
    #[error(transparent)]
    Resync(#[from] ResyncError),
}

/// Unmarks a pool as refilling when its refill task ends, however it ends.
struct InFlightRefill<'a> {
    service: &'a PoolService,
    keys: &'a Arc<PoolKeys>,
}

impl Drop for InFlightRefill<'_> {
    fn drop(&mut self) {
        self.service
            .refills_in_flight
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(self.keys);
    }
}

/// One pop per pool for the whole batch, answers in arrival order: the
/// one place where concurrent requests' pops are joined.
async fn pop_batch(redis: Arc<RedisLink>, stats: Arc<Stats>, batch: Vec<PopRequest>) {
    stats.pipeline_pop_batch.observe(batch.len() as f64);
    let popped = pop_shared(
        batch,
        |request| &request.keys,
        |request| request.count,
        |request, total| {
            let (redis, keys) = (redis.clone(), request.keys.clone());
            async move { redis.pop(&keys, total).await }
        },
    )
    .await;
    for (request, outcome) in popped {
        let _ = request.reply.send(outcome);
    }
}
