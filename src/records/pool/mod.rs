//! Pools: pre-reserved numbers of one sequence period, waiting in a Redis
//! list, popped in ascending order and refilled in the background.
//!
//! Refills are single-flight per pool inside an instance, serialised across
//! instances by a Redis lock (`SET NX PX` + compare-and-delete), and capped by
//! a semaphore per instance, so thousands of pools draining at once cost at
//! most `refill_concurrency` refills, each holding nothing but two integers:
//! the numbers themselves are generated inside Redis by the push script.

mod discard;
mod lists;
mod redis;
mod refill;
mod scripts;
pub mod url;
mod watch;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::domain::clock::Clock;
use tokio::sync::oneshot;
use tokio_util::task::TaskTracker;

pub use self::discard::{DiscardCause, Discards};
pub use self::lists::{GiveBackToken, PoolLists, Popped, Pushed, Swept};
pub use self::redis::{PoolKeys, RedisFailure, RedisLink, RedisSettings};
use self::refill::RefillParts;
pub use self::refill::{RefillOutcome, Refills};
pub use self::watch::{PoolWatch, ResyncError, Resynced};
use crate::domain::numbers::SeqRange;
use crate::domain::sequence::{Period, Sequence};
use crate::infra::stats::Stats;
use crate::records::batch::Batcher;
use crate::records::counter::Counter;
use crate::records::sequence_store::SequenceStore;

/// The refill lock a sequence's first use holds while it takes its
/// numbers from the counter ([`PoolService::take`]); released by
/// [`FirstUse::release`], or when dropped.
pub struct FirstUse {
    lists: PoolLists,
    keys: Arc<PoolKeys>,
    token: Option<String>,
}

impl FirstUse {
    pub async fn release(mut self) {
        if let Some(token) = self.token.take() {
            let _ = self.lists.release(&self.keys, &token).await;
        }
    }
}

impl Drop for FirstUse {
    fn drop(&mut self) {
        let Some(token) = self.token.take() else {
            return;
        };
        // An error path that did not release it: let go at once rather
        // than hold the pool's refills for the lock's whole life.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let (lists, keys) = (self.lists.clone(), self.keys.clone());
            runtime.spawn(async move {
                let _ = lists.release(&keys, &token).await;
            });
        }
    }
}

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
    /// A pool nobody popped from or gave back to for this long is given
    /// up by reconciliation: its numbers go back to the counter (or are
    /// recorded), its keys leave Redis. Give-backs land within half of it.
    pub idle_after: Duration,
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
            idle_after: Duration::from_secs(60),
            max_growth: 64,
            installation: String::new(),
        }
    }
}

/// How long a request the pool could not serve waits before looking again
/// while another instance holds the refill lock.
const BUSY_POLL: Duration = Duration::from_millis(3);

struct PopRequest {
    keys: Arc<PoolKeys>,
    count: usize,
    reply: oneshot::Sender<Result<Popped, RedisFailure>>,
}

/// The pools: pops (joined per pool), and the parts that refill, empty
/// and watch them.
pub struct PoolService {
    redis: Arc<RedisLink>,
    lists: PoolLists,
    counter: Arc<Counter>,
    stats: Arc<Stats>,
    settings: PoolSettings,
    pops: Batcher<PopRequest>,
    /// The current pool of each sequence seen, by sequence id and period.
    pool_refs: Mutex<HashMap<i64, HashMap<String, PoolRef>>>,
    discards: Arc<Discards>,
    refills: Arc<Refills>,
    watch: Arc<PoolWatch>,
}

/// How often the pops whose answers arrived are forgotten in their pools
/// (a pool's next pop forgets them too).
const FORGET_ANSWERED_EVERY: Duration = Duration::from_secs(1);

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
        redis.set_give_back_window(settings.idle_after / 2);
        let forgetting = Arc::downgrade(&redis);
        tasks.spawn(async move {
            loop {
                tokio::time::sleep(FORGET_ANSWERED_EVERY).await;
                let Some(link) = forgetting.upgrade() else {
                    return;
                };
                PoolLists::new(link).forget_answered().await;
            }
        });
        let lists = PoolLists::new(redis.clone());
        let (pop_lists, pop_stats) = (lists.clone(), stats.clone());
        let pops = Batcher::spawn(tasks, "pool pops", 4096, move |batch| {
            pop_batch(pop_lists.clone(), pop_stats.clone(), batch)
        });
        let discards = Arc::new(Discards::new(redis.clone(), counter.clone(), stats.clone()));
        let refills = Refills::new(RefillParts {
            redis: redis.clone(),
            counter: counter.clone(),
            sequences: sequences.clone(),
            stats: stats.clone(),
            settings: settings.clone(),
            clock,
            discards: discards.clone(),
        });
        let watch = Arc::new(PoolWatch::new(
            redis.clone(),
            counter.clone(),
            sequences,
            stats.clone(),
            settings.clone(),
            discards.clone(),
        ));
        Arc::new(Self {
            redis,
            lists,
            counter,
            stats,
            settings,
            pops,
            pool_refs: Mutex::new(HashMap::new()),
            discards,
            refills,
            watch,
        })
    }

    /// Numbers going back to their pools, and pools emptied.
    pub fn discards(&self) -> &Discards {
        &self.discards
    }

    /// The refills of this instance.
    pub fn refills(&self) -> &Arc<Refills> {
        &self.refills
    }

    /// The circuit watch.
    pub fn watch(&self) -> &Arc<PoolWatch> {
        &self.watch
    }

    pub fn counter(&self) -> &Arc<Counter> {
        &self.counter
    }

    pub fn redis(&self) -> &Arc<RedisLink> {
        &self.redis
    }

    /// Whether requests take numbers from the pools now (Redis up and
    /// checked since its last failure).
    pub fn in_use(&self) -> bool {
        self.redis.is_up()
    }

    /// Whether Redis answers at all (pools in use or not).
    pub async fn redis_answers(&self) -> bool {
        self.redis.is_up() || self.redis.ping().await.is_ok()
    }

    /// How many numbers `pool` holds; None while the pools are not in use.
    pub async fn depth(&self, pool: &PoolRef) -> Option<i64> {
        if !self.redis.is_up() {
            return None;
        }
        self.lists.depth(&pool.keys).await.ok()
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
    /// needs (waited for up to `short_wait`, or until it is pushed once it
    /// has taken its block) and one more pop; what is still missing is the
    /// caller's to take from Postgres.
    /// With `first_use`, a pool's first use takes its numbers from the
    /// counter (see [`FirstUse`]): for callers that take them outside any
    /// transaction (a rollback would hand the counter's numbers out again,
    /// where a pool's stay refused).
    pub async fn take(
        self: &Arc<Self>,
        pool: &PoolRef,
        count: usize,
        first_use: bool,
    ) -> Result<(Vec<i64>, Option<FirstUse>), RedisFailure> {
        // The shared pop found the pool empty and never filled a moment
        // ago: a first use needs no second pop to know it (the lock's
        // answer says, under the lock, whether it still is).
        if first_use
            && self.refills.seen_unfilled(pool)
            && let Some(claim) = self.claim_first_use(pool).await
        {
            return Ok((Vec::new(), Some(claim)));
        }
        let mut popped = self.pop(pool, count).await?;
        let mut seqs = self
            .within_max(pool, std::mem::take(&mut popped.seqs))
            .await;
        if first_use
            && seqs.is_empty()
            && popped.target == 0
            && let Some(claim) = self.claim_first_use(pool).await
        {
            // A pool never filled (or given up), asked for the first time
            // here: the request's numbers come from the counter, and the
            // pool is filled only when it is asked again. A sequence used
            // once costs Redis nothing, and ten thousand first uses at
            // once wait for no refill.
            return Ok((seqs, Some(claim)));
        }
        if seqs.len() < count {
            self.stats.pool_short.inc();
            // The refill also brings what waiting requests lack, so a big
            // request is served from the pool, in order, rather than from
            // the counter past numbers a refill just pushed. Registered
            // before any refill can start, so the next one sees it.
            self.refills.add_demand(pool, count - seqs.len());
        }
        self.refills.refill_if_low(pool, &popped);
        if seqs.len() < count {
            let deadline = tokio::time::Instant::now() + self.settings.short_wait;
            let mut waited_past_deadline = false;
            while seqs.len() < count {
                let mut refill = tokio::time::timeout_at(deadline, self.refills.handle(pool)).await;
                if refill.is_err() && !waited_past_deadline {
                    // A refill that has begun to number its block is waited
                    // for, however long it takes (its statement and Redis
                    // timeouts bound it): the counter would now give numbers
                    // past that block, out of order with those the block
                    // then gives later requests. Once, so a pool drained by
                    // others as fast as it fills cannot hold this request.
                    if let Some(numbering) = self.refills.numbering(pool) {
                        waited_past_deadline = true;
                        refill = Ok(numbering.await);
                    }
                }
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
                    self.refills.add_demand(pool, count - seqs.len());
                }
                self.refills.refill_if_low(pool, &again);
            }
            if seqs.len() < count {
                // The rest comes from the counter: a refill not begun yet
                // must not bring it too (the pool would hold it past its
                // bound, for nobody).
                self.refills.withdraw_demand(pool, count - seqs.len());
            }
        }
        Ok((seqs, None))
    }

    /// The refill lock of a pool found empty and never filled, held while
    /// the counter hands out its first use's numbers: no refill can take a
    /// block meanwhile, so those numbers stay below every block the pool
    /// gets (taken while another instance's refill had begun, they came
    /// after its block, and that instance's next answers went below them).
    /// None when this instance was asked for the pool before (it is filled
    /// now), a refill holds the lock, or the pool has numbers or was filled
    /// before.
    async fn claim_first_use(&self, pool: &PoolRef) -> Option<FirstUse> {
        if !self.refills.first_ask(pool) {
            return None;
        }
        let token = uuid::Uuid::new_v4().simple().to_string();
        let locked = self
            .lists
            .acquire(&pool.keys, &token, self.settings.lock_ttl)
            .await
            .ok()??;
        let claim = FirstUse {
            lists: self.lists.clone(),
            keys: pool.keys.clone(),
            token: Some(token),
        };
        // Numbers in it, or filled before (its target set): not a first
        // use, the pool's refill serves it.
        if locked.depth > 0 || locked.target != 0 {
            claim.release().await;
            return None;
        }
        Some(claim)
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
            self.refills.refill_if_low(pool, &popped);
        } else if popped.seqs.is_empty() && popped.target == 0 {
            self.refills.note_unfilled(pool);
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
        let ranges = crate::domain::numbers::runs(&above);
        self.discards
            .record_discard(
                &pool.sequence,
                pool.period.key(),
                &ranges,
                DiscardCause::AboveMax,
            )
            .await;
        seqs
    }

    /// How long a pool may go unused before it is given up.
    pub fn idle_after(&self) -> Duration {
        self.settings.idle_after
    }

    /// Gives up the pool of `sequence` in the period named `period` if
    /// nobody used it for `idle` (zero: whatever its use, unless a refill
    /// is pushing to it); see [`Swept`].
    pub async fn sweep(
        &self,
        sequence: &Sequence,
        period: &str,
        idle: Duration,
    ) -> Result<Swept, RedisFailure> {
        let keys = self.redis.keys(
            sequence.project.as_str(),
            sequence.doc_type.as_str(),
            period,
        );
        let swept = self.lists.sweep(&keys, idle).await?;
        if let Swept::GivenUp { held, .. } = &swept {
            self.stats.pools_given_up.inc();
            let numbers: i64 = held.iter().map(SeqRange::len).sum();
            self.stats
                .pool_numbers_given_up
                .inc_by(numbers.max(0) as u64);
        }
        Ok(swept)
    }

    /// Puts runs a sweep took back in their pool (recording them failed):
    /// nobody was handed them.
    pub async fn restore(
        &self,
        sequence: &Sequence,
        period: &str,
        runs: &[SeqRange],
    ) -> Result<(), RedisFailure> {
        let keys = self.redis.keys(
            sequence.project.as_str(),
            sequence.doc_type.as_str(),
            period,
        );
        self.lists
            .give_back_runs(&keys, runs, &GiveBackToken::new())
            .await
            .map(|_| ())
    }

    /// The runs the pool of `sequence` in `period` holds, lowest first.
    pub async fn runs(
        &self,
        sequence: &Sequence,
        period: &str,
    ) -> Result<Vec<SeqRange>, RedisFailure> {
        let keys = self.redis.keys(
            sequence.project.as_str(),
            sequence.doc_type.as_str(),
            period,
        );
        self.lists.runs(&keys).await
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
}

/// One pop per pool for the whole batch, answers in arrival order: the
/// one place where concurrent requests' pops are joined. Each pool is
/// popped once for its requests' total and each request gets its share,
/// in the order the requests came; a failed pop fails every request of its
/// pool alike.
async fn pop_batch(lists: PoolLists, stats: Arc<Stats>, batch: Vec<PopRequest>) {
    stats.pipeline_pop_batch.observe(batch.len() as f64);
    let mut groups: HashMap<Arc<PoolKeys>, Vec<PopRequest>> = HashMap::new();
    for request in batch {
        groups
            .entry(request.keys.clone())
            .or_default()
            .push(request);
    }
    let pops = groups.into_iter().map(|(keys, group)| {
        let total: usize = group.iter().map(|request| request.count).sum();
        let lists = lists.clone();
        async move { (group, lists.pop(&keys, total).await) }
    });
    for (group, popped) in futures::future::join_all(pops).await {
        match popped {
            Ok(popped) => {
                let mut seqs = popped.seqs.into_iter();
                for request in group {
                    let share = Popped {
                        seqs: seqs.by_ref().take(request.count).collect(),
                        depth: popped.depth,
                        target: popped.target,
                    };
                    let _ = request.reply.send(Ok(share));
                }
            }
            Err(e) => {
                for request in group {
                    let _ = request.reply.send(Err(e.clone()));
                }
            }
        }
    }
}
