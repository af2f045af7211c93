//! Issuing: the one path from a caller to a number.
//!
//! Every caller that needs numbers (`POST /ids`, documents single, keyed,
//! attached or batched, the import) comes through [`Issuer::issue`] (the
//! shared path) or [`Issuer::issue_in`] (inside the caller's transaction).
//! The issuer only chooses; each stage is a type of its own file, in the
//! order a request meets them:
//!
//! 1. [`lease_path`]: this instance's lease memory, no I/O on the answer's
//!    path (`lease_store` is what it consults).
//! 2. [`shared_commit`]: the shared pop and the group commit (`writer`,
//!    which also writes the handouts the lease path reports).
//! 3. [`counter_path`]: the pool after a refill, or the counter of record.
//! 4. [`gapless_path`]: gapless sequences, numbered in the commit that
//!    writes their documents; [`reservations`] voids what it reserved.
//!
//! Numbers are recorded in the ledger before anything leaves. Work that
//! must outlive a caller who hangs up is detached in one place,
//! [`Issuer::detached`], on the one task tracker.

mod counter_path;
mod gapless_path;
mod handouts;
mod lease_path;
mod lease_returns;
pub mod lease_store;
mod placement;
pub mod reservations;
mod shared_commit;
mod transactions;
mod writer;

pub use gapless_path::MAX_OPEN_RESERVATIONS;
pub use lease_store::LeaseSettings;
pub use placement::Placement;
pub use reservations::Reservations;
pub use transactions::never_reuse;

use std::future::Future;
use std::sync::Arc;

use crate::infra::db::{Db, Tx, Unwitnessed, Witness};
use chrono::{DateTime, Utc};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::domain::clock::Clock;
use crate::domain::sequence::{LayoutRangeError, MAX_ID_LEN, Numbering, ProjectCode, TypeCode};
use crate::infra::stats::Stats;
use crate::records::ledger::outbox_rows::{Attachment, OutboxRow};
use crate::records::ledger::{LedgerError, Via};
use crate::records::pool::{PoolRef, PoolService};
use crate::records::sequence_store::{SequenceStore, StoreError};

use counter_path::{CounterPath, LedgerTarget};
use gapless_path::GaplessPath;
use handouts::Handouts;
use lease_path::{Begun, LeasePath, OnLease};
use lease_returns::LeaseReturns;
use lease_store::{Leases, OnItsOwn, Order};
use shared_commit::{Demand, SharedCommit};
use transactions::Transactions;

/// Most numbers one request may take (SPEC).
pub const MAX_COUNT: usize = 10_000;

/// Leased numbers a document without an ID of its own tries before it is
/// answered that its ID is taken: each taken one was a number of an ended
/// lease attached meanwhile, a few at most per request in flight.
const DOCUMENT_ID_TRIES: usize = 4;

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
    #[error(
        "{project}/{doc_type} has numbers below its max that wait to go back to its pool while \
         Redis is away; send the request again shortly"
    )]
    HeldBack { project: String, doc_type: String },
    #[error("the definition of {project}/{doc_type} changed while this request ran; send it again")]
    DefinitionChanged { project: String, doc_type: String },
    #[error(
        "Postgres failed over; its counters are being checked against the pools before \
         numbers are taken from it again; send the request again"
    )]
    PostgresMoved,
    #[error(
        "{project}/{doc_type} is a VERI*FACTU register: its numbers are taken only by documents \
         (POST /documents with \"invoice\"), never reserved"
    )]
    ReservationsNotAllowed { project: String, doc_type: String },
    #[error(
        "gapless sequence {project}/{doc_type} holds at most {max} reservations open at once; \
         {open} are open and {asked} more were asked for: ask for at most {room} \
         (confirm or void open ones, or wait for them to expire, to make room)",
        room = (max - open).max(0)
    )]
    TooManyReservations {
        project: String,
        doc_type: String,
        open: i64,
        asked: i64,
        max: i64,
    },
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Ledger(#[from] LedgerError),
    #[error(transparent)]
    NotAnswered(#[from] crate::infra::commitment::NotAnswered),
    /// A statement on the counter failed (shared by every request a
    /// joined reservation served).
    #[error("counter: {0}")]
    Counter(Arc<sqlx::Error>),
    /// The task that finished the request in the background panicked or
    /// was cancelled at shutdown.
    #[error("the task serving this request stopped: {0}")]
    Interrupted(#[from] tokio::task::JoinError),
}

impl From<sqlx::Error> for IssueError {
    fn from(e: sqlx::Error) -> Self {
        IssueError::Counter(Arc::new(e))
    }
}

impl IssueError {
    /// `count` numbers more than `pool`'s sequence has left in its period.
    fn exhausted(pool: &PoolRef, count: usize) -> Self {
        IssueError::Exhausted {
            project: pool.sequence.project.to_string(),
            doc_type: pool.sequence.doc_type.to_string(),
            period: pool.period.key().to_owned(),
            count,
            max: pool.sequence.definition.max_seq(),
        }
    }
}

/// What a caller asks of the issuer.
pub enum Want {
    /// `count` numbers, for `POST /ids`.
    Ids { count: usize },
    /// One number carrying a document's outbox row, written with it.
    Document { attachment: Arc<Attachment> },
}

/// Numbers issued to one caller, ascending, and the document written on
/// the number when one was asked for.
pub struct Issued {
    pub placement: Arc<Placement>,
    pub seqs: Vec<i64>,
    pub document: Option<(OutboxRow, DateTime<Utc>)>,
    /// Numbers of a gapless sequence for `POST /ids` are reserved until
    /// then.
    pub reserved_until: Option<DateTime<Utc>>,
}

impl Issued {
    fn numbers_of(placement: Arc<Placement>, seqs: Vec<i64>) -> Self {
        Self {
            placement,
            seqs,
            document: None,
            reserved_until: None,
        }
    }

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

/// What the issuer is made of.
pub struct IssuerParts {
    pub sequences: Arc<SequenceStore>,
    pub pools: Arc<PoolService>,
    pub clock: Arc<dyn Clock>,
    pub stats: Arc<Stats>,
    /// The requests' pool.
    pub db: Db,
    /// The shared writers' connections (their own limits).
    pub writer_db: Db,
    /// Background work's: handout records, lease returns, the expiry sweep.
    pub background_db: Db,
    pub leases: LeaseSettings,
    /// How long a gapless reservation waits for its document.
    pub reservation_ttl: std::time::Duration,
    /// The one tracker every task of the issuer is spawned on.
    pub tasks: TaskTracker,
}

/// The choice between the stages, and what they share.
pub struct Issuer {
    lease_path: LeasePath,
    shared: SharedCommit,
    counter_path: CounterPath,
    gapless_path: GaplessPath,
    reservations: Reservations,
    lease_returns: LeaseReturns,
    transactions: Transactions,
    sequences: Arc<SequenceStore>,
    pools: Arc<PoolService>,
    clock: Arc<dyn Clock>,
    db: Db,
    tasks: TaskTracker,
}

impl Issuer {
    /// The issuer; [`Issuer::report_leases`] must run for leases to be
    /// given back.
    pub fn new(parts: IssuerParts) -> Arc<Self> {
        let IssuerParts {
            sequences,
            pools,
            clock,
            stats,
            db,
            writer_db,
            background_db,
            leases,
            reservation_ttl,
            tasks,
        } = parts;
        let shared = SharedCommit::spawn(writer_db, pools.clone(), stats.clone(), &tasks);
        let handouts = Arc::new(Handouts::spawn(shared.clone(), stats.clone(), &tasks));
        let leases = Arc::new(Leases::new(clock.clone(), leases, stats.clone()));
        Arc::new(Self {
            lease_path: LeasePath::new(
                leases.clone(),
                handouts.clone(),
                shared.clone(),
                pools.clone(),
            ),
            counter_path: CounterPath::new(
                shared.clone(),
                pools.clone(),
                sequences.clone(),
                stats.clone(),
                db.clone(),
                &tasks,
            ),
            gapless_path: GaplessPath::new(
                shared.clone(),
                pools.counter().clone(),
                sequences.clone(),
                clock.clone(),
                stats.clone(),
                reservation_ttl,
            ),
            reservations: Reservations::new(
                sequences.clone(),
                clock.clone(),
                stats.clone(),
                background_db.clone(),
                reservation_ttl,
            ),
            lease_returns: LeaseReturns::new(leases, handouts, pools.clone(), stats, background_db),
            transactions: Transactions::new(db.clone(), pools.clone()),
            shared,
            sequences,
            pools,
            clock,
            db,
            tasks,
        })
    }

    pub fn sequences(&self) -> &Arc<SequenceStore> {
        &self.sequences
    }

    /// The request pool, for what callers read before their transaction.
    pub fn db(&self) -> &Db {
        &self.db
    }

    /// Voids of gapless reservations, and their expiry.
    pub fn reservations(&self) -> &Reservations {
        &self.reservations
    }

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

    /// The one entry of the shared path: `want` served from `placement`,
    /// recorded in the ledger (with the document, if one is asked for)
    /// before this returns. Whatever awaits once numbers are taken runs
    /// detached: a caller that goes away cannot leave a number taken but
    /// unrecorded. (Numbers a lease gives whole are handed to the handout
    /// reporter before any await, so that common case needs no task.)
    pub async fn issue(
        self: &Arc<Self>,
        placement: Arc<Placement>,
        want: Want,
    ) -> Result<Issued, IssueError> {
        let gapless = placement.sequence.definition.numbering == Numbering::Gapless;
        let issuer = self.clone();
        match want {
            Want::Ids { count } if gapless => {
                self.detached(async move {
                    let transaction = async |tx: &mut Tx<'_>| {
                        (issuer.gapless_path)
                            .issue_in(tx, &placement, count, Via::Ids)
                            .await
                    };
                    // Its rows are numbered inside the transaction; a
                    // stranger under a reused id is not told apart here.
                    issuer.transactions.run(&Unwitnessed, transaction).await
                })
                .await?
            }
            Want::Ids { count } => {
                let begun = self.lease_path.begin(&placement, count, |o| self.order(o));
                if let Begun::Complete(holder, got) = begun {
                    let seqs = self.lease_path.hand_out(&holder, got)?;
                    return Ok(Issued::numbers_of(placement, seqs));
                }
                self.detached(async move {
                    let seqs = issuer.ids(&placement, count, begun).await?;
                    Ok(Issued::numbers_of(placement, seqs))
                })
                .await?
            }
            Want::Document { attachment } => {
                self.detached(async move {
                    let (row, created_at) = match gapless {
                        true => issuer.gapless_path.document(&placement, attachment).await?,
                        false => issuer.document(&placement, attachment).await?,
                    };
                    Ok(Issued {
                        placement,
                        seqs: vec![row.seq],
                        document: Some((row, created_at)),
                        reserved_until: None,
                    })
                })
                .await?
            }
        }
    }

    /// `count` numbers recorded in the caller's transaction as received
    /// `via` (an idempotent request stores its answer in the same commit,
    /// a batch its documents). The placement is made before the
    /// transaction begins, so the request never holds one pooled
    /// connection while waiting for another. The caller runs the
    /// transaction [`Issuer::detached`], through [`Issuer::transaction`].
    pub async fn issue_in(
        &self,
        conn: &mut Tx<'_>,
        placement: &Arc<Placement>,
        count: usize,
        via: Via,
    ) -> Result<Issued, IssueError> {
        if placement.sequence.definition.numbering == Numbering::Gapless {
            return self
                .gapless_path
                .issue_in(conn, placement, count, via)
                .await;
        }
        let seqs = self
            .counter_path
            .issue(placement, count, LedgerTarget::Transaction(conn, via))
            .await?;
        Ok(Issued::numbers_of(placement.clone(), seqs))
    }

    /// `work` in a transaction whose commit answers a request: an error
    /// means nothing was written, and numbers it popped from pools go back
    /// to them. A commit in doubt counts as made only once `witness` finds
    /// the transaction's rows.
    pub async fn transaction<T, E>(
        &self,
        witness: &impl Witness,
        work: impl AsyncFnOnce(&mut Tx<'_>) -> Result<T, E>,
    ) -> Result<T, E>
    where
        E: From<sqlx::Error> + From<crate::infra::commitment::NotAnswered>,
    {
        self.transactions.run(witness, work).await
    }

    /// Runs `work` to its end whether or not its caller still waits: the
    /// one place where the issuing path leaves the client's task. It keeps
    /// the request's commitment: a write it has not sent by the request's
    /// deadline is withdrawn (`crate::infra::commitment`).
    ///
    /// Spawned at the call, boxed: the caller's own future holds only the
    /// task's handle across its await, not the work's whole state (moved
    /// by every layer a request's future passes, a large future costs a
    /// copy of itself per layer and per request).
    pub fn detached<T: Send + 'static>(
        &self,
        work: impl Future<Output = T> + Send + 'static,
    ) -> tokio::task::JoinHandle<T> {
        self.tasks
            .spawn(Box::pin(crate::infra::commitment::scope_detached(work)))
    }

    /// Every `report_every` gives back idle leases and writes the returns;
    /// at `stop` (once the server has drained: no request takes numbers
    /// any more) gives back every lease before it returns.
    pub async fn report_leases(self: Arc<Self>, stop: CancellationToken) {
        self.lease_returns.run(stop).await;
    }

    /// Waits (up to 5 s) until every lease given back so far is back in
    /// its pool.
    pub async fn lease_returns_written(&self) {
        self.lease_returns.written().await;
    }

    /// Lease holders this instance keeps in memory: one per pool in use,
    /// forgotten once idle (`Leases::sweep`).
    pub fn lease_holders(&self) -> usize {
        self.lease_returns.holders()
    }

    /// `count` numbers: what the lease gave or is bringing first (`begun`),
    /// the rest through the shared commit and the counter path.
    async fn ids(
        self: &Arc<Self>,
        placement: &Arc<Placement>,
        count: usize,
        begun: Begun,
    ) -> Result<Vec<i64>, IssueError> {
        let lease = &self.lease_path;
        let (holder, got, on_its_own) = match begun {
            Begun::Complete(holder, got) => return lease.hand_out(&holder, got),
            Begun::Waiting(holder, mut got) => {
                match lease
                    .wait(&holder, count, &mut got, |o| self.order(o))
                    .await
                {
                    Ok(()) => return lease.hand_out(&holder, got),
                    Err(on_its_own) => (Some(holder), got, on_its_own),
                }
            }
            Begun::Alone(holder, got, on_its_own) => (holder, got, on_its_own),
        };
        // Let go once this request's pop answered: a lease ordered
        // meanwhile is taken after it, so above its numbers.
        let more = match self
            .shared(placement, count - got.len(), Via::Ids, on_its_own)
            .await
        {
            Ok(more) => more,
            Err(e) => {
                if let Some(holder) = holder {
                    lease.put_back(&holder, got);
                }
                return Err(e);
            }
        };
        let mut seqs = match holder {
            Some(holder) => lease.hand_out(&holder, got)?,
            None => got,
        };
        seqs.extend(more);
        seqs.sort_unstable();
        Ok(seqs)
    }

    /// One document on a new number: on this instance's lease when the
    /// sequence is busy, else through the shared commit, else (the pool
    /// could not give one at once) after a refill or from the counter.
    async fn document(
        self: &Arc<Self>,
        placement: &Arc<Placement>,
        attachment: Arc<Attachment>,
    ) -> Result<(OutboxRow, DateTime<Utc>), IssueError> {
        // A number taken from the lease just before this instance stopped
        // running (paused, frozen) for longer than the lease's expiry can
        // meanwhile have been attached to another document by an attach
        // that ended the lease: nothing of this one was written, and it
        // names no ID of its own, so it takes another number.
        let mut tries = 0;
        let on_its_own = loop {
            tries += 1;
            let on_lease = (self.lease_path)
                .document(placement, &attachment, |o| self.order(o))
                .await;
            match on_lease {
                OnLease::Written(Err(IssueError::Ledger(LedgerError::DocumentIdTaken)))
                    if tries < DOCUMENT_ID_TRIES => {}
                OnLease::Written(written) => return written,
                OnLease::NotServed(on_its_own) => break on_its_own,
            }
        };
        let demand = Demand::Document {
            attachment: attachment.clone(),
        };
        // The ticket is let go once the pop answered (see OnItsOwn).
        let served = self
            .shared
            .submit(placement.clone(), demand, on_its_own)
            .await?;
        if let Some(document) = served.document {
            return Ok(document);
        }
        if !served.refused.is_empty() {
            let refused = served.refused.len();
            self.counter_path.refused(&placement.pool, refused).await;
        }
        loop {
            let seqs = (self.counter_path)
                .obtain(&placement.pool, 1, counter_path::Through::Joined)
                .await?
                .seqs;
            let demand = Demand::Document {
                attachment: attachment.clone(),
            };
            let served = self.shared.record(placement.clone(), demand, seqs).await?;
            if let Some(document) = served.document {
                return Ok(document);
            }
            let refused = served.refused.len().max(1);
            self.counter_path.refused(&placement.pool, refused).await;
        }
    }

    /// Takes `order`'s lease in a task of its own, as a request would:
    /// through the shared commit and the counter path.
    fn order(self: &Arc<Self>, order: Order) {
        let issuer = self.clone();
        self.tasks.spawn(async move {
            let until = issuer.lease_path.before_taking(&order).await;
            // A lease recorded in part is a smaller lease: the part already
            // committed is the lease's to hand out or give back, never
            // dropped (it would be a lost lease).
            let (leased, failed) = issuer
                .shared_as_many(&order.holder.pool, order.size, Via::Lease, None)
                .await;
            if let Some(e) = &failed {
                tracing::debug!(error = %e, size = order.size, got = leased.len(), "lease not taken whole; requests are served on their own");
            }
            issuer.lease_path.arrived(&order, leased, until);
        });
    }

    /// `count` numbers of `placement`'s pool recorded in the shared commit
    /// as received `via`: popped in the shared batch, and what it could not
    /// give after a refill or from the counter. Ascending.
    async fn shared(
        &self,
        placement: &Arc<Placement>,
        count: usize,
        via: Via,
        on_its_own: Option<OnItsOwn>,
    ) -> Result<Vec<i64>, IssueError> {
        match self.shared_as_many(placement, count, via, on_its_own).await {
            (seqs, None) => Ok(seqs),
            // A pool that ran short recorded nothing (`SharedCommit::submit`):
            // the slower path takes all or none. Only numbers recorded
            // before their replacements failed (the ledger refused some as
            // another's) stay issued (reconciliation says `issued_unattached`).
            (_, Some(e)) => Err(e),
        }
    }

    /// As many of `count` numbers as could be recorded (ascending), and
    /// the error that stopped the rest, if any: the first part may commit
    /// before the rest fails (the pool ran short, then Postgres went away).
    /// `on_its_own` is let go once the shared pop answered.
    async fn shared_as_many(
        &self,
        placement: &Arc<Placement>,
        count: usize,
        via: Via,
        on_its_own: Option<OnItsOwn>,
    ) -> (Vec<i64>, Option<IssueError>) {
        if count == 0 {
            return (Vec::new(), None);
        }
        let served = match self
            .shared
            .submit(placement.clone(), demand(via, count), on_its_own)
            .await
        {
            Ok(served) => served,
            Err(e) => return (Vec::new(), Some(e.into())),
        };
        let mut seqs = served.issued;
        if !served.refused.is_empty() {
            let refused = served.refused.len();
            self.counter_path.refused(&placement.pool, refused).await;
        }
        let mut failed = None;
        if seqs.len() < count {
            // The pool ran short, was stale, or Redis is down.
            let rest = count - seqs.len();
            match (self.counter_path)
                .issue(placement, rest, LedgerTarget::Shared(via))
                .await
            {
                Ok(more) => seqs.extend(more),
                Err(e) => failed = Some(e),
            }
            seqs.sort_unstable();
        }
        (seqs, failed)
    }
}

/// What a request for `count` numbers received `via` asks of the shared
/// commit.
fn demand(via: Via, count: usize) -> Demand {
    match via {
        Via::Lease => Demand::Lease { count },
        Via::Ids | Via::Document => Demand::Ids { count },
    }
}
