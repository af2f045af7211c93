//! Numbers that left a pool without being issued: why (`pool_discards.cause`),
//! and the pool operations that discard them.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};

use super::{GiveBackToken, PoolKeys, PoolLists, PoolRef, RedisFailure, RedisLink};
use crate::domain::numbers::SeqRange;
use crate::domain::sequence::Sequence;
use crate::infra::stats::Stats;
use crate::records::counter::Counter;

/// Most numbers held for giving back at once; beyond, they are recorded
/// as discarded at once.
const MAX_UNRETURNED: usize = 100_000;

/// Numbers going back to their pools, and those emptied out of them,
/// recorded.
pub struct Discards {
    redis: Arc<RedisLink>,
    lists: PoolLists,
    counter: Arc<Counter>,
    stats: Arc<Stats>,
    /// Numbers surely not issued that Redis could not take back (the
    /// circuit open: a failover): given back once the pools are checked
    /// and in use again. At most `MAX_UNRETURNED` numbers.
    unreturned: Mutex<Vec<(PoolRef, Vec<i64>, GiveBackToken)>>,
    /// Pools whose numbers the lease returns are still trying to give
    /// back (Redis away).
    returns_waiting: Mutex<HashSet<Arc<PoolKeys>>>,
}

/// The word stored in `pool_discards.cause`, logged, and shown as the note
/// of a `pool_discarded` gap (by which the gap list can be filtered).
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    sqlx::Type,
    serde::Serialize,
    utoipa::ToSchema,
    strum::IntoStaticStr,
    strum::Display,
    strum::EnumString,
)]
#[sqlx(type_name = "text", rename_all = "snake_case")]
#[serde(rename_all = "snake_case")]
#[strum(serialize_all = "snake_case")]
pub enum DiscardCause {
    /// The sequence's `max` was lowered below numbers in the pool.
    AboveMax,
    /// The refill lock expired before the block was pushed.
    RefillLockLost,
    /// Pushing a refilled block to Redis failed.
    PushFailed,
    /// Numbers a request did not use could not be pushed back.
    GiveBackFailed,
    /// A give-back tried again past its window: an earlier try may have
    /// landed in a pool given back to the counter since, so these numbers
    /// are not put in a pool again.
    GiveBackLate,
    /// The pool went unused for its idle time and gave its numbers back;
    /// these could not go back to the counter (numbers were taken above
    /// them).
    Idle,
    /// The pool's list held numbers the ledger had already recorded.
    StaleList,
    /// The sequence's definition changed; its pools were emptied.
    DefinitionChanged,
    /// The pool's period ended; reconciliation closed it.
    PeriodEnded,
    /// Pools filled before Redis came back were emptied.
    RedisReconnect,
    /// Postgres was found behind Redis (a failover); its pools were emptied.
    PostgresBehindRedis,
    /// A lease's numbers this instance did not hand out, which could not be
    /// taken off the ledger to go back to their pool.
    LeaseReturned,
    /// A number whose document's outbox row was not written (or whether it
    /// was is unknown, or the ID it prints is another document's): never
    /// handed out again.
    DocumentNotWritten,
    /// A number whose ledger write gave up waiting for another
    /// transaction's lock on it (that transaction may yet commit it):
    /// never handed out again.
    LockedElsewhere,
}

impl Discards {
    pub(super) fn new(redis: Arc<RedisLink>, counter: Arc<Counter>, stats: Arc<Stats>) -> Self {
        Self {
            lists: PoolLists::new(redis.clone()),
            redis,
            counter,
            stats,
            unreturned: Mutex::new(Vec::new()),
            returns_waiting: Mutex::new(HashSet::new()),
        }
    }

    /// Numbers back to the head of their pool, once per `token` (a retry
    /// of a give-back whose answer was lost carries its token); recorded
    /// as discarded instead when the token's window has passed.
    pub async fn give_back(
        &self,
        pool: &PoolRef,
        seqs: &[i64],
        token: &GiveBackToken,
    ) -> Result<(), RedisFailure> {
        if !self.lists.give_back(&pool.keys, seqs, token).await? {
            let ranges = crate::domain::numbers::runs(seqs);
            self.record_discard(
                &pool.sequence,
                pool.period.key(),
                &ranges,
                DiscardCause::GiveBackLate,
            )
            .await;
        }
        Ok(())
    }

    /// Numbers taken from the pool (or the counter) but surely not issued:
    /// back to the head of their pool, in order, so none is burnt; recorded
    /// as discarded when Redis cannot take them.
    pub async fn return_unissued(&self, pool: &PoolRef, seqs: &[i64]) {
        if seqs.is_empty() {
            return;
        }
        let token = GiveBackToken::new();
        if let Err(e) = self.give_back(pool, seqs, &token).await {
            // Redis out of use (a failover): held until the pools are in
            // use again, not written off.
            if self.hold_unreturned(pool, seqs, token) {
                return;
            }
            tracing::warn!(error = %e, "could not return numbers to the pool; recording them as discarded");
            self.record_unreturned(pool, seqs).await;
        }
    }

    /// The pools whose lease returns wait for Redis now.
    pub fn lease_returns_waiting(&self, pools: impl IntoIterator<Item = Arc<PoolKeys>>) {
        *self
            .returns_waiting
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = pools.into_iter().collect();
    }

    /// Whether this instance holds numbers of the pool that wait to go
    /// back to it: its counter being spent does not make the sequence so.
    pub fn holds_back(&self, keys: &PoolKeys) -> bool {
        self.returns_waiting
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains(keys)
            || self
                .unreturned
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .iter()
                .any(|(pool, _, _)| *pool.keys == *keys)
    }

    /// Keeps numbers Redis could not take, within `MAX_UNRETURNED`.
    fn hold_unreturned(&self, pool: &PoolRef, seqs: &[i64], token: GiveBackToken) -> bool {
        let mut held = self.unreturned.lock().unwrap_or_else(|e| e.into_inner());
        let holding: usize = held.iter().map(|(_, s, _)| s.len()).sum();
        if holding + seqs.len() > MAX_UNRETURNED {
            return false;
        }
        held.push((pool.clone(), seqs.to_vec(), token));
        self.stats
            .numbers_unreturned
            .set((holding + seqs.len()) as i64);
        true
    }

    async fn record_unreturned(&self, pool: &PoolRef, seqs: &[i64]) {
        self.discard_numbers(pool, seqs, DiscardCause::GiveBackFailed)
            .await;
    }

    /// [`Discards::record_discard`] of numbers of `pool`.
    pub async fn discard_numbers(&self, pool: &PoolRef, seqs: &[i64], cause: DiscardCause) {
        let ranges = crate::domain::numbers::runs(seqs);
        self.record_discard(&pool.sequence, pool.period.key(), &ranges, cause)
            .await;
    }

    /// Gives back what Redis could not take before (the pools are in use
    /// again); what it still cannot take stays held, or at the `last` try
    /// (a stop) is recorded as discarded.
    pub async fn return_held(&self, last: bool) {
        let held = std::mem::take(&mut *self.unreturned.lock().unwrap_or_else(|e| e.into_inner()));
        self.stats.numbers_unreturned.set(0);
        for (pool, seqs, token) in held {
            let given = self.give_back(&pool, &seqs, &token).await.is_ok();
            if !given && (last || !self.hold_unreturned(&pool, &seqs, token)) {
                self.record_unreturned(&pool, &seqs).await;
            }
        }
    }

    /// Empties a pool whose list cannot be trusted and records its numbers.
    pub async fn invalidate(&self, pool: &PoolRef, cause: DiscardCause) {
        match self.lists.discard(&pool.keys, false).await {
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
        let written = self
            .counter
            .record_discards(sequence.id, period, ranges, cause.into())
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
            match self.lists.discard(&keys, false).await {
                Ok(ranges) => self.record_discard(sequence, &period, &ranges, cause).await,
                Err(e) => tracing::warn!(error = %e, pool = %keys.pool, "could not discard pool"),
            }
        }
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
            match self.lists.trim_above(&keys, max).await {
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
}

#[cfg(test)]
mod tests {
    use super::DiscardCause;

    #[test]
    pub(super) fn causes_keep_the_words_already_stored() {
        assert_eq!(DiscardCause::AboveMax.to_string(), "above_max");
        assert_eq!(
            DiscardCause::PostgresBehindRedis.to_string(),
            "postgres_behind_redis"
        );
        let word: &str = DiscardCause::GiveBackFailed.into();
        assert_eq!(word, "give_back_failed");
    }
}
