//! Issuing numbers to a caller: pool first, Postgres for whatever the pool
//! cannot give, and the ledger before anything leaves.

use std::collections::HashMap;
use std::sync::Arc;

use chrono::{DateTime, Utc};
use sqlx::PgPool;

use crate::clock::Clock;
use crate::counter::{Counter, Via};
use crate::ledger::{Ledger, LedgerError};
use crate::pool::{PoolRef, PoolService};
use crate::sequence::store::{SequenceStore, StoreError};
use crate::sequence::{IdShape, LayoutRangeError, Period, ProjectCode, Sequence, TypeCode};
use crate::stats::Stats;

/// Most numbers one request may take (SPEC).
pub const MAX_COUNT: usize = 10_000;

#[derive(Debug, thiserror::Error)]
pub enum IssueError {
    #[error(
        "sequence {project}/{doc_type} has no {count} numbers left in period {period:?} (max {max})"
    )]
    Exhausted {
        project: String,
        doc_type: String,
        period: String,
        count: usize,
        max: i64,
    },
    #[error(transparent)]
    Layout(#[from] LayoutRangeError),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Ledger(#[from] LedgerError),
    #[error("counter: {0}")]
    Counter(#[from] sqlx::Error),
}

/// Numbers issued to one caller, ascending.
pub struct Issued {
    pub sequence: Arc<Sequence>,
    pub period: Period,
    pub seqs: Vec<i64>,
    pub shape: IdShape,
    pub at: DateTime<Utc>,
}

impl Issued {
    pub fn ids(&self) -> Vec<String> {
        self.seqs.iter().map(|&s| self.shape.id(s)).collect()
    }

    pub fn numbers(&self) -> Vec<i64> {
        self.seqs.iter().map(|&s| self.shape.number(s)).collect()
    }
}

pub struct Issuer {
    pub sequences: Arc<SequenceStore>,
    pub pools: Arc<PoolService>,
    pub ledger: Ledger,
    pub counter: Arc<Counter>,
    pub clock: Arc<dyn Clock>,
    pub stats: Arc<Stats>,
    pub db: PgPool,
}

impl Issuer {
    /// Issues `count` numbers of `project`/`doc_type` (created with defaults
    /// on first use). Nothing is returned before its ledger record commits.
    pub async fn issue(
        &self,
        project: &ProjectCode,
        doc_type: &TypeCode,
        count: usize,
        via: Via,
    ) -> Result<Issued, IssueError> {
        let sequence = self.sequences.get_or_create(project, doc_type).await?;
        let at = self.clock.now();
        let period = sequence.definition.period_at(at);
        let shape = sequence
            .definition
            .shape(project.as_str(), doc_type.as_str(), &period, at)?;
        let pool = self.pools.pool_ref(sequence.clone(), period.clone());
        let seqs = self.take(&pool, count, via).await?;
        Ok(Issued {
            sequence,
            period,
            seqs,
            shape,
            at,
        })
    }

    /// `count` ledgered numbers of `pool`'s period, ascending.
    pub async fn take(
        &self,
        pool: &PoolRef,
        count: usize,
        via: Via,
    ) -> Result<Vec<i64>, IssueError> {
        let sequence = &pool.sequence;
        let mut popped = match self.pools.take(pool, count).await {
            Ok(seqs) => seqs,
            Err(e) => {
                tracing::debug!(error = %e, "pool unavailable, taking numbers from postgres");
                Vec::new()
            }
        };
        let mut issued = Vec::with_capacity(count);
        loop {
            let missing = count - issued.len() - popped.len();
            if missing > 0 {
                match self.take_direct(pool, missing, via).await {
                    Ok(direct) => issued.extend(direct),
                    Err(IssueError::Exhausted { .. }) => {
                        // The counter is spent, but a refill may have moved
                        // its last numbers into the pool.
                        let more = self.pools.take(pool, missing).await.unwrap_or_default();
                        if more.is_empty() {
                            self.give_back(pool, &popped).await;
                            return Err(self.exhausted(pool, count));
                        }
                        popped.extend(more);
                        continue;
                    }
                    Err(e) => {
                        self.give_back(pool, &popped).await;
                        return Err(e);
                    }
                }
            }
            if popped.is_empty() {
                break;
            }
            let refused = self
                .ledger
                .record(sequence.id, pool.period.key(), &popped, via)
                .await?;
            let accepted = without(std::mem::take(&mut popped), &refused);
            Stats::add(&self.stats.ids_from_pool, accepted.len() as u64);
            issued.extend(accepted);
            if refused.is_empty() {
                break;
            }
            Stats::add(&self.stats.stale_numbers_rejected, refused.len() as u64);
            tracing::warn!(
                project = %sequence.project, doc_type = %sequence.doc_type,
                period = pool.period.key(), refused = refused.len(),
                "pool handed out numbers that were already issued; discarding the pool"
            );
            self.pools.invalidate(pool, "stale_list").await;
        }
        issued.sort_unstable();
        Ok(issued)
    }

    async fn take_direct(
        &self,
        pool: &PoolRef,
        n: usize,
        via: Via,
    ) -> Result<Vec<i64>, IssueError> {
        let mut conn = self.db.acquire().await?;
        let taken = self
            .counter
            .take_direct(&mut conn, &pool.sequence, &pool.period, n as i64, via)
            .await?;
        let Some(range) = taken else {
            return Err(self.exhausted(pool, n));
        };
        Stats::add(&self.stats.ids_direct, n as u64);
        Ok(range.iter().collect())
    }

    pub fn exhausted(&self, pool: &PoolRef, count: usize) -> IssueError {
        IssueError::Exhausted {
            project: pool.sequence.project.to_string(),
            doc_type: pool.sequence.doc_type.to_string(),
            period: pool.period.key().to_owned(),
            count,
            max: pool.sequence.definition.max_seq(),
        }
    }

    /// Returns unissued numbers to the head of their pool, in order, so a
    /// refused request near `max` does not burn them.
    async fn give_back(&self, pool: &PoolRef, seqs: &[i64]) {
        if seqs.is_empty() {
            return;
        }
        if let Err(e) = self.pools.give_back(pool, seqs).await {
            tracing::warn!(error = %e, "could not return numbers to the pool; recording them as discarded");
            let ranges = crate::numbers::runs(seqs);
            self.pools
                .record_discard(
                    &pool.sequence,
                    pool.period.key(),
                    &ranges,
                    "give_back_failed",
                )
                .await;
        }
    }
}

/// `seqs` minus one occurrence per entry of `refused`.
fn without(seqs: Vec<i64>, refused: &[i64]) -> Vec<i64> {
    if refused.is_empty() {
        return seqs;
    }
    let mut remove: HashMap<i64, usize> = HashMap::new();
    for seq in refused {
        *remove.entry(*seq).or_default() += 1;
    }
    seqs.into_iter()
        .filter(|seq| match remove.get_mut(seq) {
            Some(n) if *n > 0 => {
                *n -= 1;
                false
            }
            _ => true,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::without;

    #[test]
    fn without_removes_one_occurrence_per_refusal() {
        assert_eq!(without(vec![5, 6, 7], &[6]), vec![5, 7]);
        assert_eq!(without(vec![5, 5, 6], &[5]), vec![5, 6]);
        assert_eq!(without(vec![5, 6], &[5, 5, 5]), vec![6]);
        assert_eq!(without(vec![1, 2], &[]), vec![1, 2]);
    }
}
