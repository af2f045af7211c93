//! Issuing numbers to a caller: pool first, the counter for whatever the
//! pool cannot give, and the ledger before anything leaves.

use std::sync::Arc;

use sqlx::{PgConnection, PgPool};

use crate::clock::Clock;
use crate::counter::{Counter, Reserved};
use crate::ledger::{self, LedgerError, Via};
use crate::numbers;
use crate::pipeline::{Demand, Pipeline};
use crate::pool::{Placement, PoolRef, PoolService};
use crate::sequence::{LayoutRangeError, MAX_ID_LEN, ProjectCode, TypeCode};
use crate::sequence_store::{SequenceStore, StoreError};
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
    #[error(
        "IDs of {project}/{doc_type} would now be up to {length} characters long; the limit is \
         {MAX_ID_LEN} (its format prints longer than it did when it was defined)"
    )]
    IdTooLong {
        project: String,
        doc_type: String,
        length: usize,
    },
    #[error("the definition of {project}/{doc_type} changed while this request ran; send it again")]
    DefinitionChanged { project: String, doc_type: String },
    #[error(
        "Postgres failed over; its counters are being checked against the pools before \
         numbers are taken from it again; send the request again"
    )]
    PostgresMoved,
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Ledger(#[from] LedgerError),
    #[error("counter: {0}")]
    Counter(#[from] sqlx::Error),
    /// The task that finished the request in the background panicked or
    /// was cancelled at shutdown.
    #[error("the task serving this request stopped: {0}")]
    Interrupted(#[from] tokio::task::JoinError),
}

/// Numbers issued to one caller, ascending.
pub struct Issued {
    pub placement: Arc<Placement>,
    pub seqs: Vec<i64>,
}

impl Issued {
    pub fn ids(&self) -> Vec<String> {
        self.seqs
            .iter()
            .map(|&s| self.placement.shape.id(s))
            .collect()
    }

    pub fn numbers(&self) -> Vec<i64> {
        self.seqs
            .iter()
            .map(|&s| self.placement.shape.number(s))
            .collect()
    }
}

pub struct Issuer {
    pub pipeline: Pipeline,
    pub sequences: Arc<SequenceStore>,
    pub pools: Arc<PoolService>,
    pub counter: Arc<Counter>,
    pub clock: Arc<dyn Clock>,
    pub stats: Arc<Stats>,
    pub db: PgPool,
}

impl Issuer {
    /// The sequence (created with defaults on first use), its current
    /// period and pool, and the shape of IDs issued now.
    pub async fn place(
        &self,
        project: &ProjectCode,
        doc_type: &TypeCode,
    ) -> Result<Arc<Placement>, IssueError> {
        let sequence = self.sequences.get_or_create(project, doc_type).await?;
        let at = self.clock.now();
        let period = sequence.definition.period_at(at);
        let shape = sequence
            .definition
            .shape(project.as_str(), doc_type.as_str(), &period, at)?;
        // Every ID of this request is at most this long.
        let length = sequence.definition.longest_id(&shape);
        if length > MAX_ID_LEN {
            return Err(IssueError::IdTooLong {
                project: project.to_string(),
                doc_type: doc_type.to_string(),
                length,
            });
        }
        let pool = self.pools.pool_ref(sequence.clone(), period.clone());
        Ok(Arc::new(Placement {
            sequence,
            period,
            pool,
            shape,
            at,
        }))
    }

    /// Issues `count` numbers to `POST /ids`; they are recorded in the
    /// ledger before this returns. Once numbers are taken, the work runs
    /// in tasks of its own: a caller that goes away cannot leave a number
    /// taken but unrecorded.
    pub async fn issue(
        self: &Arc<Self>,
        project: &ProjectCode,
        doc_type: &TypeCode,
        count: usize,
    ) -> Result<Issued, IssueError> {
        let placement = self.place(project, doc_type).await?;
        let seqs = self
            .issue_placed(placement.clone(), count, Via::Ids)
            .await?;
        Ok(Issued { placement, seqs })
    }

    /// `count` numbers of `placement`'s pool, recorded in the shared ledger
    /// commit as received by `via` (a caller of `POST /ids`, or a lease of
    /// this instance). Ascending.
    pub async fn issue_placed(
        self: &Arc<Self>,
        placement: Arc<Placement>,
        count: usize,
        via: Via,
    ) -> Result<Vec<i64>, IssueError> {
        let served = self
            .pipeline
            .submit(placement.clone(), demand(via, count))
            .await?;
        let mut seqs = served.issued;
        if !served.refused.is_empty() || seqs.len() < count {
            // The pool ran short, was stale, or Redis is down.
            let issuer = self.clone();
            let slow = placement.clone();
            let missing = count - seqs.len();
            let more = tokio::spawn(async move {
                if !served.refused.is_empty() {
                    issuer.refused(&slow.pool, served.refused.len()).await;
                }
                issuer
                    .issue_with(&slow, missing, LedgerTarget::Shared(via))
                    .await
            })
            .await??;
            seqs.extend(more);
            seqs.sort_unstable();
        }
        Ok(seqs)
    }

    /// The same, with the ledger rows written in the caller's transaction
    /// (an idempotent request stores its response in the same commit).
    /// The placement is made before the transaction begins, so the request
    /// never holds one pooled connection while waiting for another.
    pub async fn issue_in(
        &self,
        conn: &mut PgConnection,
        placement: Arc<Placement>,
        count: usize,
    ) -> Result<Issued, IssueError> {
        let seqs = self
            .issue_with(&placement, count, LedgerTarget::Transaction(conn))
            .await?;
        Ok(Issued { placement, seqs })
    }

    /// Obtains numbers and records them in `ledger`, replacing any the
    /// ledger refuses until `count` are issued.
    async fn issue_with(
        &self,
        placement: &Arc<Placement>,
        count: usize,
        mut ledger: LedgerTarget<'_>,
    ) -> Result<Vec<i64>, IssueError> {
        let pool = &placement.pool;
        let (sequence_id, period) = (placement.sequence.id, placement.period.key());
        let mut issued = Vec::with_capacity(count);
        let mut pending = self.obtain(pool, count, ledger.db(&self.db)).await?;
        loop {
            let refused = match &mut ledger {
                LedgerTarget::Shared(via) => {
                    self.pipeline
                        .record(
                            placement.clone(),
                            demand(*via, pending.len()),
                            pending.clone(),
                        )
                        .await?
                        .refused
                }
                LedgerTarget::Transaction(conn) => {
                    ledger::record_in(conn, &self.stats, sequence_id, period, &pending, Via::Ids)
                        .await?
                }
            };
            let accepted = numbers::without(pending, &refused);
            issued.extend(accepted);
            if refused.is_empty() {
                break;
            }
            self.refused(pool, refused.len()).await;
            pending = self
                .obtain(pool, count - issued.len(), ledger.db(&self.db))
                .await?;
        }
        issued.sort_unstable();
        Ok(issued)
    }

    /// `count` numbers of the pool's period, not yet issued: popped from the
    /// pool, and reserved straight from the counter for whatever the pool
    /// cannot give (Redis down, or still short after waiting for a refill),
    /// through `db`. Ascending.
    pub async fn obtain(
        &self,
        pool: &PoolRef,
        count: usize,
        mut db: Db<'_>,
    ) -> Result<Vec<i64>, IssueError> {
        let mut seqs = match self.pools.take(pool, count).await {
            Ok(seqs) => seqs,
            Err(e) => {
                tracing::debug!(error = %e, "pool unavailable, taking numbers from postgres");
                Vec::new()
            }
        };
        self.stats.ids_from_pool.inc_by(seqs.len() as u64);
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
                    self.sequences.forget(&pool.sequence);
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
                    let more = self.pools.take(pool, missing).await.unwrap_or_default();
                    if more.is_empty() {
                        self.give_back(pool, &seqs).await;
                        return Err(self.exhausted(pool, count));
                    }
                    self.stats.ids_from_pool.inc_by(more.len() as u64);
                    seqs.extend(more);
                }
                Err(e) => {
                    self.give_back(pool, &seqs).await;
                    return Err(e.into());
                }
            }
        }
        seqs.sort_unstable();
        Ok(seqs)
    }

    async fn reserve_direct(
        &self,
        db: &mut Db<'_>,
        pool: &PoolRef,
        n: i64,
    ) -> Result<Reserved<crate::numbers::SeqRange>, sqlx::Error> {
        let (sequence, period) = (&pool.sequence, &pool.period);
        match db {
            Db::Transaction(conn) => self.counter.reserve_direct(conn, sequence, period, n).await,
            Db::Pool(pool) => {
                let mut conn = pool.acquire().await?;
                self.counter
                    .reserve_direct(&mut conn, sequence, period, n)
                    .await
            }
        }
    }

    /// The ledger refused numbers as issued before: the pool handed out a
    /// stale list. Nothing more is taken from it.
    pub async fn refused(&self, pool: &PoolRef, how_many: usize) {
        self.stats.stale_numbers_rejected.inc_by(how_many as u64);
        tracing::warn!(
            project = %pool.sequence.project, doc_type = %pool.sequence.doc_type,
            period = pool.period.key(), refused = how_many,
            "pool handed out numbers that were already issued; discarding the pool"
        );
        self.pools
            .invalidate(pool, crate::pool::DiscardCause::StaleList)
            .await;
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
                    crate::pool::DiscardCause::GiveBackFailed,
                )
                .await;
        }
    }
}

/// What a request for `count` numbers received `via` asks of the pipeline.
fn demand(via: Via, count: usize) -> Demand {
    match via {
        Via::Lease => Demand::Lease { count },
        Via::Ids | Via::Document => Demand::Ids { count },
    }
}

/// Where `POST /ids` (or a lease) records its numbers.
enum LedgerTarget<'a> {
    /// The pipeline's write stage: one statement and commit for concurrent
    /// requests.
    Shared(Via),
    /// The caller's transaction.
    Transaction(&'a mut PgConnection),
}

impl LedgerTarget<'_> {
    /// Where numbers straight from the counter are reserved: inside the
    /// caller's transaction if it has one (never a second connection).
    fn db<'s>(&'s mut self, pool: &'s PgPool) -> Db<'s> {
        match self {
            LedgerTarget::Shared(_) => Db::Pool(pool),
            LedgerTarget::Transaction(conn) => Db::Transaction(conn),
        }
    }
}

/// The connection a request works through.
pub enum Db<'a> {
    /// Takes a connection for each statement.
    Pool(&'a PgPool),
    /// The request's own transaction.
    Transaction(&'a mut PgConnection),
}
