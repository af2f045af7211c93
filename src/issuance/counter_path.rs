//! Numbers the shared batch could not give: from the pool after a
//! refill, or straight from the counter, recorded in the shared commit or
//! the caller's transaction; numbers the ledger refuses are replaced.

use std::sync::Arc;

use tokio_util::task::TaskTracker;

use crate::infra::db::{Db, Tx};

use super::shared_commit::SharedCommit;
use super::{IssueError, Placement, demand, transactions};
use crate::domain::numbers;
use crate::infra::stats::Stats;
use crate::records::counter::{Counter, DirectReservations, Reserved};
use crate::records::ledger::{self, Via};
use crate::records::pool::{PoolRef, PoolService};
use crate::records::sequence_store::SequenceStore;

/// The slower path: the pool after a refill, or the counter of record.
pub(super) struct CounterPath {
    shared: SharedCommit,
    pools: Arc<PoolService>,
    counter: Arc<Counter>,
    sequences: Arc<SequenceStore>,
    stats: Arc<Stats>,
    /// Reservations outside any transaction, on the requests' pool.
    direct: DirectReservations,
}

impl CounterPath {
    pub(super) fn new(
        shared: SharedCommit,
        pools: Arc<PoolService>,
        sequences: Arc<SequenceStore>,
        stats: Arc<Stats>,
        db: Db,
        tasks: &TaskTracker,
    ) -> Self {
        Self {
            shared,
            counter: pools.counter().clone(),
            direct: DirectReservations::spawn(pools.counter().clone(), db, tasks),
            pools,
            sequences,
            stats,
        }
    }

    /// Obtains numbers and records them in `ledger`, replacing any the
    /// ledger refuses until `count` are issued.
    pub(super) async fn issue(
        &self,
        placement: &Arc<Placement>,
        count: usize,
        mut ledger: LedgerTarget<'_, '_>,
    ) -> Result<Vec<i64>, IssueError> {
        let pool = &placement.pool;
        let (sequence_id, period) = (placement.sequence.id, placement.period.key());
        let mut issued = Vec::with_capacity(count);
        let Obtained {
            seqs: mut pending,
            mut popped,
        } = self.obtain(pool, count, ledger.through()).await?;
        loop {
            let refused = match &mut ledger {
                LedgerTarget::Shared(via) => {
                    self.shared
                        .record(
                            placement.clone(),
                            demand(*via, pending.len()),
                            pending.clone(),
                        )
                        .await?
                        .refused
                }
                LedgerTarget::Transaction(conn, via) => {
                    // Popped from Redis into a transaction that may yet
                    // roll back: given back then (see
                    // `Transactions::run`). Noted before the statement,
                    // which may itself fail (a connection lost or ended
                    // mid-transaction); those the ledger refuses are
                    // another's and are taken off the note again.
                    let from_pool: Vec<i64> = pending
                        .iter()
                        .copied()
                        .filter(|s| popped.binary_search(s).is_ok())
                        .collect();
                    transactions::popped_into_transaction(pool, from_pool);
                    let refused =
                        ledger::record_in(conn, &self.stats, sequence_id, period, &pending, *via)
                            .await?;
                    transactions::refused_in_transaction(pool, &refused);
                    refused
                }
            };
            let accepted = numbers::without(pending, &refused);
            issued.extend(accepted);
            if refused.is_empty() {
                break;
            }
            self.refused(pool, refused.len()).await;
            Obtained {
                seqs: pending,
                popped,
            } = self
                .obtain(pool, count - issued.len(), ledger.through())
                .await?;
        }
        issued.sort_unstable();
        Ok(issued)
    }

    /// `count` numbers of the pool's period, not yet issued: popped from the
    /// pool, and reserved straight from the counter for whatever the pool
    /// cannot give (Redis down, or still short after waiting for a refill),
    /// through `db`. Ascending, with which of them came from the pool.
    pub(super) async fn obtain(
        &self,
        pool: &PoolRef,
        count: usize,
        mut db: Through<'_, '_>,
    ) -> Result<Obtained, IssueError> {
        let outside_transactions = matches!(db, Through::Joined);
        let (mut seqs, first_use) = match self.pools.take(pool, count, outside_transactions).await {
            Ok(taken) => taken,
            Err(e) => {
                tracing::debug!(error = %e, "pool unavailable, taking numbers from postgres");
                (Vec::new(), None)
            }
        };
        self.stats.ids_from_pool.inc_by(seqs.len() as u64);
        let mut popped = seqs.clone();
        while seqs.len() < count {
            let missing = count - seqs.len();
            let reserved = self.reserve_direct(&mut db, pool, missing as i64).await;
            match reserved {
                Ok(Reserved::Got(range)) => {
                    self.stats.ids_direct.inc_by(missing as u64);
                    seqs.extend(range.iter());
                }
                Ok(Reserved::Stale) => {
                    self.give_back(pool, &seqs).await;
                    self.sequences.forget(&pool.sequence).await;
                    return Err(IssueError::DefinitionChanged {
                        project: pool.sequence.project.to_string(),
                        doc_type: pool.sequence.doc_type.to_string(),
                    });
                }
                Ok(Reserved::Unfenced) => {
                    self.give_back(pool, &seqs).await;
                    return Err(IssueError::PostgresMoved);
                }
                Ok(Reserved::Exhausted) => {
                    // The counter is spent, but a refill may have moved its
                    // last numbers into the pool.
                    let (more, _) = self
                        .pools
                        .take(pool, missing, false)
                        .await
                        .unwrap_or_default();
                    if more.is_empty() {
                        self.give_back(pool, &seqs).await;
                        // Numbers of the pool wait here for Redis: not
                        // spent, only out of reach for now.
                        if self.pools.discards().holds_back(&pool.keys) {
                            return Err(IssueError::HeldBack {
                                project: pool.sequence.project.to_string(),
                                doc_type: pool.sequence.doc_type.to_string(),
                            });
                        }
                        return Err(IssueError::exhausted(pool, count));
                    }
                    self.stats.ids_from_pool.inc_by(more.len() as u64);
                    popped.extend(&more);
                    seqs.extend(more);
                }
                Err(e) => {
                    self.give_back(pool, &seqs).await;
                    return Err(e);
                }
            }
        }
        if let Some(first_use) = first_use {
            first_use.release().await;
        }
        seqs.sort_unstable();
        popped.sort_unstable();
        Ok(Obtained { seqs, popped })
    }

    async fn reserve_direct(
        &self,
        db: &mut Through<'_, '_>,
        pool: &PoolRef,
        n: i64,
    ) -> Result<Reserved<numbers::SeqRange>, IssueError> {
        let (sequence, period) = (&pool.sequence, &pool.period);
        match db {
            Through::Transaction(conn) => {
                let tag = self.counter.direct_tag();
                Ok(self
                    .counter
                    .reserve_direct(conn, sequence, period, n, &tag)
                    .await?)
            }
            Through::Joined => self
                .direct
                .reserve(sequence, period, n)
                .await
                .map_err(IssueError::Counter),
        }
    }

    /// The ledger refused numbers as issued before: the pool handed out a
    /// stale list. Nothing more is taken from it.
    pub(super) async fn refused(&self, pool: &PoolRef, how_many: usize) {
        self.stats.stale_numbers_rejected.inc_by(how_many as u64);
        tracing::warn!(
            project = %pool.sequence.project, doc_type = %pool.sequence.doc_type,
            period = pool.period.key(), refused = how_many,
            "pool handed out numbers that were already issued; discarding the pool"
        );
        self.pools
            .discards()
            .invalidate(pool, crate::records::pool::DiscardCause::StaleList)
            .await;
    }

    /// Returns unissued numbers to the head of their pool, in order, so a
    /// refused request near `max` does not burn them.
    async fn give_back(&self, pool: &PoolRef, seqs: &[i64]) {
        self.pools.discards().return_unissued(pool, seqs).await;
    }
}

/// Numbers [`CounterPath::obtain`] got, ascending, and those of them popped
/// from the pool (the rest came straight from the counter).
pub(super) struct Obtained {
    pub seqs: Vec<i64>,
    pub popped: Vec<i64>,
}

/// Where numbers of the slower path are recorded.
pub(super) enum LedgerTarget<'a, 't> {
    /// The pipeline's write stage: one statement and commit for concurrent
    /// requests.
    Shared(Via),
    /// The caller's transaction.
    Transaction(&'a mut Tx<'t>, Via),
}

impl<'t> LedgerTarget<'_, 't> {
    /// Where numbers straight from the counter are reserved: inside the
    /// caller's transaction if it has one (never a second connection).
    fn through(&mut self) -> Through<'_, 't> {
        match self {
            LedgerTarget::Shared(_) => Through::Joined,
            LedgerTarget::Transaction(conn, _) => Through::Transaction(conn),
        }
    }
}

/// How a request reaches the counter.
pub(super) enum Through<'a, 't> {
    /// Joined with concurrent requests' reservations in one statement.
    Joined,
    /// The request's own transaction.
    Transaction(&'a mut Tx<'t>),
}
