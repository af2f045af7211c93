//! Refills: single-flight per pool inside an instance, serialised across
//! instances by a Redis lock, capped by a semaphore per instance; the
//! pool's target depth adapts to how fast it drains.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::FutureExt;
use futures::future::{BoxFuture, Shared};
use tokio::sync::{Semaphore, oneshot};
use tokio_util::task::TaskTracker;

use super::{
    DiscardCause, Discards, PoolKeys, PoolLists, PoolRef, PoolSettings, Popped, Pushed, RedisLink,
};
use crate::domain::clock::Clock;
use crate::infra::stats::Stats;
use crate::records::counter::{Counter, PoolBlock, Reserved};
use crate::records::sequence_store::SequenceStore;

/// A refill in flight, awaited by everyone who needs it.
pub type SharedRefill = Shared<BoxFuture<'static, RefillOutcome>>;

/// The refills of this instance's pools.
pub struct Refills {
    redis: Arc<RedisLink>,
    lists: PoolLists,
    counter: Arc<Counter>,
    sequences: Arc<SequenceStore>,
    stats: Arc<Stats>,
    settings: PoolSettings,
    clock: Arc<dyn Clock>,
    discards: Arc<Discards>,
    refills_in_flight: Mutex<HashMap<Arc<PoolKeys>, SharedRefill>>,
    /// Pools whose refill is taking its block from the counter or pushing
    /// it: numbers taken from the counter meanwhile would come after the
    /// block's, which later requests would then get.
    numbering: Mutex<std::collections::HashSet<Arc<PoolKeys>>>,
    /// Numbers requests of this instance are waiting for, per pool.
    demand: Mutex<HashMap<Arc<PoolKeys>, i64>>,
    /// Pools found empty and never filled that this instance was asked for
    /// once (at most [`MAX_ASKED`]; forgotten all at once beyond).
    asked: Mutex<std::collections::HashSet<String>>,
    /// Pools the shared pop found empty and never filled, until their
    /// request's `take` asks (at most [`MAX_ASKED`]; forgotten all at once
    /// beyond: a mark only spares a pop, the lock's answer decides).
    unfilled: Mutex<std::collections::HashSet<String>>,
    refill_slots: Arc<Semaphore>,
    /// Refills running in the background; awaited (for a while) at shutdown.
    refills: TaskTracker,
}

/// What [`Refills`] is made of.
pub(super) struct RefillParts {
    pub redis: Arc<RedisLink>,
    pub counter: Arc<Counter>,
    pub sequences: Arc<SequenceStore>,
    pub stats: Arc<Stats>,
    pub settings: PoolSettings,
    pub clock: Arc<dyn Clock>,
    pub discards: Arc<Discards>,
}

impl Refills {
    pub(super) fn new(parts: RefillParts) -> Arc<Self> {
        let RefillParts {
            redis,
            counter,
            sequences,
            stats,
            settings,
            clock,
            discards,
        } = parts;
        Arc::new(Self {
            refill_slots: Arc::new(Semaphore::new(settings.refill_concurrency.max(1))),
            lists: PoolLists::new(redis.clone()),
            redis,
            counter,
            sequences,
            stats,
            settings,
            clock,
            discards,
            refills_in_flight: Mutex::new(HashMap::new()),
            numbering: Mutex::new(std::collections::HashSet::new()),
            demand: Mutex::new(HashMap::new()),
            asked: Mutex::new(std::collections::HashSet::new()),
            unfilled: Mutex::new(std::collections::HashSet::new()),
            refills: TaskTracker::new(),
        })
    }

    /// Waits up to `limit` for the refills in flight, so a stopping
    /// instance does not leave a block reserved but never pushed.
    pub async fn finish(&self, limit: Duration) {
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

    pub(super) fn low_water(pool: &PoolRef, target: i64) -> i64 {
        let definition = &pool.sequence.definition;
        let target = target.max(i64::from(definition.pool_size));
        ((target as f64) * (1.0 - definition.refill_at)).floor() as i64
    }

    pub(super) fn refill_if_low(self: &Arc<Self>, pool: &PoolRef, popped: &Popped) {
        if popped.depth <= Self::low_water(pool, popped.target) {
            drop(self.handle(pool));
        }
    }

    /// The refill of `pool` running in this instance once it has begun to
    /// take its block from the counter (until it has pushed it); None
    /// otherwise. Bounded by the statement and Redis timeouts, unlike one
    /// still queued for a refill slot.
    pub(super) fn numbering(&self, pool: &PoolRef) -> Option<SharedRefill> {
        let numbering = self.numbering.lock().unwrap_or_else(|e| e.into_inner());
        if !numbering.contains(&pool.keys) {
            return None;
        }
        self.refills_in_flight
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&pool.keys)
            .cloned()
    }

    /// The refill of `pool` running in this instance, started if there is none.
    pub fn handle(self: &Arc<Self>, pool: &PoolRef) -> SharedRefill {
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

    pub(super) async fn refill(&self, pool: &PoolRef) -> RefillOutcome {
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

    pub(super) async fn refill_locked(&self, pool: &PoolRef) -> RefillOutcome {
        if !self.redis.is_up() {
            return RefillOutcome::Failed;
        }
        let token = uuid::Uuid::new_v4().simple().to_string();
        let locked = match self
            .lists
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
            let _ = self.lists.release(&pool.keys, &token).await;
            return RefillOutcome::NotNeeded;
        }
        let want = (target - locked.depth).max(0) + demand;
        let _numbering = Numbering::begin(self, &pool.keys);
        let block = match self.reserve_block(pool, want, lock_acquired_at).await {
            Ok(block) => block,
            Err(outcome) => {
                let _ = self.lists.release(&pool.keys, &token).await;
                return outcome;
            }
        };
        self.push_block(pool, &token, block, target, now_ms).await
    }

    /// A block of `want` numbers from the counter, or why there is none.
    pub(super) async fn reserve_block(
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
                self.sequences.forget(&pool.sequence).await;
                Err(RefillOutcome::Failed)
            }
            Err(e) => {
                // Every pool's refill fails at once while Postgres is away:
                // said once, then with a count.
                static FAILED: crate::infra::log_limit::Repeated =
                    crate::infra::log_limit::Repeated::new("block reservation failed");
                crate::infra::db::distrust_server_after(&e);
                FAILED.warn(&e);
                Err(RefillOutcome::Failed)
            }
        }
    }

    /// Pushes the block while the lock `token` still holds; a block that
    /// cannot be pushed is recorded as discarded.
    pub(super) async fn push_block(
        &self,
        pool: &PoolRef,
        token: &str,
        block: PoolBlock,
        target: i64,
        now_ms: i64,
    ) -> RefillOutcome {
        let pushed = self
            .lists
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
        self.discards
            .record_discard(&pool.sequence, pool.period.key(), &[rest], cause)
            .await;
        RefillOutcome::Failed
    }

    /// Whether this is the first time this instance is asked for `pool`
    /// finding it empty and never filled: then it is not filled yet.
    pub(super) fn first_ask(&self, pool: &PoolRef) -> bool {
        remember(&self.asked, &pool.keys.pool)
    }

    /// Remembers that the shared pop found `pool` empty and never filled.
    pub(super) fn note_unfilled(&self, pool: &PoolRef) {
        remember(&self.unfilled, &pool.keys.pool);
    }

    /// Whether the shared pop found `pool` empty and never filled since
    /// this was last asked (the mark is taken).
    pub(super) fn seen_unfilled(&self, pool: &PoolRef) -> bool {
        let mut unfilled = self.unfilled.lock().unwrap_or_else(|e| e.into_inner());
        unfilled.remove(&pool.keys.pool)
    }

    pub(super) fn add_demand(&self, pool: &PoolRef, numbers: usize) {
        let mut demand = self.demand.lock().unwrap_or_else(|e| e.into_inner());
        let waiting = demand.entry(pool.keys.clone()).or_default();
        *waiting = waiting
            .saturating_add(numbers as i64)
            .min(i64::from(MAX_TARGET));
    }

    /// A request that stopped waiting no longer lacks `numbers` here (what
    /// a refill took for it already stays taken).
    pub(super) fn withdraw_demand(&self, pool: &PoolRef, numbers: usize) {
        let mut demand = self.demand.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(waiting) = demand.get_mut(&pool.keys) {
            *waiting -= (numbers as i64).min(*waiting);
            if *waiting == 0 {
                demand.remove(&pool.keys);
            }
        }
    }

    /// What requests waiting on this pool lack; the refill about to reserve
    /// takes it all.
    pub(super) fn take_demand(&self, pool: &PoolRef) -> i64 {
        let mut demand = self.demand.lock().unwrap_or_else(|e| e.into_inner());
        demand.remove(&pool.keys).unwrap_or(0)
    }

    /// Leaf's dynamic step: a pool refilled again soon after its last refill
    /// doubles its depth, an idle one halves it back towards `pool_size`.
    pub(super) fn adapted_target(
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
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RefillOutcome {
    Refilled,
    NotNeeded,
    /// Another instance holds the lock.
    Busy,
    Exhausted,
    Failed,
}

/// Most pools an instance remembers having been asked for once.
const MAX_ASKED: usize = 100_000;

/// Adds `pool` to a set of pool names bounded by [`MAX_ASKED`] (forgotten
/// all at once beyond); whether it was new there.
fn remember(set: &Mutex<std::collections::HashSet<String>>, pool: &str) -> bool {
    let mut set = set.lock().unwrap_or_else(|e| e.into_inner());
    if set.len() >= MAX_ASKED {
        set.clear();
    }
    set.insert(pool.to_owned())
}

/// Upper bound for any pool's target depth.
const MAX_TARGET: u32 = 1_000_000;

/// Marks a pool's refill as numbering (`Refills::numbering`) from before
/// its block is taken until it is pushed, or the refill ends otherwise.
struct Numbering<'a> {
    service: &'a Refills,
    keys: &'a Arc<PoolKeys>,
}

impl<'a> Numbering<'a> {
    fn begin(service: &'a Refills, keys: &'a Arc<PoolKeys>) -> Self {
        service
            .numbering
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(keys.clone());
        Self { service, keys }
    }
}

impl Drop for Numbering<'_> {
    fn drop(&mut self) {
        self.service
            .numbering
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(self.keys);
    }
}

/// Unmarks a pool as refilling when its refill task ends, however it ends.
struct InFlightRefill<'a> {
    service: &'a Refills,
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
