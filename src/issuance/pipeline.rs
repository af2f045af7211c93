//! The shared pop-and-commit of the issuing path: concurrent requests are
//! served together, in two stages that overlap.
//!
//! A request's pop joins every other request waiting for one (the pool's
//! one pop batcher: one Redis call per pool for all of them). The write
//! stage records everything handed to it since its last write (ledger rows
//! and documents' outbox rows) in one statement and commit, and only then
//! answers. So while one batch waits for its commit, the next one is
//! already being popped, and a commit serves every request that arrived
//! meanwhile.
//!
//! Callers are detached from their clients (`Issuer::issue`), so a client
//! that hangs up cannot leave a number popped but unrecorded. Whatever a
//! batch cannot finish (a pool that ran short, Redis down, a stale number)
//! is left to the caller's slower path (`issuance::obtain`).

use std::sync::Arc;

use chrono::{DateTime, Utc};
use tokio::sync::oneshot;
use tokio_util::task::TaskTracker;

use crate::batch::Batcher;
use crate::commitment::Commitment;
use crate::counter::{Counter, Reserved};
use crate::db::{Conn, Db, Link, Session};
use crate::ledger::outbox::{Attachment, OutboxRow};
use crate::ledger::{self, GaplessCounter, LedgerError, LedgerWrite, Recorded, Unnumbered, Via};
use crate::numbers::without;
use crate::pool::{Placement, PoolService};
use crate::stats::Stats;

/// What a request wants from a batch.
pub enum Demand {
    Ids {
        count: usize,
    },
    /// Numbers leased to this instance, handed out later from memory.
    Lease {
        count: usize,
    },
    /// One number, carrying a document's outbox row.
    Document {
        attachment: Arc<Attachment>,
    },
    /// A document's outbox row on a number of this instance's lease: the
    /// lease's ledger record covers the number, so only the row is written.
    LeasedDocument {
        attachment: Arc<Attachment>,
    },
    /// A document of a gapless sequence, numbered in the commit that
    /// writes it.
    Gapless {
        attachment: Arc<Attachment>,
    },
}

impl Demand {
    fn numbers(&self) -> usize {
        match self {
            Demand::Ids { count } | Demand::Lease { count } => *count,
            Demand::Document { .. } | Demand::LeasedDocument { .. } => 1,
            Demand::Gapless { .. } => 0,
        }
    }
}

/// What a batch did for one request: numbers recorded as issued to it,
/// numbers the ledger refused (a stale pool), and the document written.
#[derive(Debug, Default)]
pub struct Served {
    pub issued: Vec<i64>,
    pub refused: Vec<i64>,
    pub document: Option<(OutboxRow, DateTime<Utc>)>,
}

type Reply = oneshot::Sender<Result<Served, LedgerError>>;

struct Job {
    placement: Arc<Placement>,
    demand: Demand,
    reply: Reply,
    /// The request's, when one waits: asked before the job's write is sent.
    commitment: Option<Arc<Commitment>>,
}

/// A job whose numbers were popped, on its way to the write stage.
struct Popped {
    job: Job,
    seqs: Vec<i64>,
}

#[derive(Clone)]
pub struct Pipeline {
    pools: Arc<PoolService>,
    stats: Arc<Stats>,
    writes: Batcher<Vec<Popped>>,
    /// Documents of gapless sequences commit in a write stage of their
    /// own: their counter rows may be held by another transaction (a batch,
    /// another instance), and a pooled request must never wait for that.
    gapless_writes: Batcher<Vec<Popped>>,
}

impl Pipeline {
    pub fn spawn(db: Db, pools: Arc<PoolService>, stats: Arc<Stats>, tasks: &TaskTracker) -> Self {
        let stage = |name: &'static str| {
            let writer = Arc::new(Writer {
                db: db.clone(),
                pools: pools.clone(),
                counter: pools.counter().clone(),
                stats: stats.clone(),
                conn: tokio::sync::Mutex::new(None),
            });
            // One commit at a time: a commit costs Postgres far more than
            // the rows it carries, so everything popped while one runs
            // waits for the next (two at a time measured slower: smaller
            // commits).
            Batcher::spawn(tasks, name, 4096, move |batches: Vec<Vec<Popped>>| {
                writer.clone().write(batches)
            })
        };
        Self {
            writes: stage("ledger writes"),
            gapless_writes: stage("gapless writes"),
            pools,
            stats,
        }
    }

    /// Pops what `demand` needs in the shared pop and records it in the
    /// next shared commit. Nothing is recorded (and nothing issued) when
    /// the pool gave nothing at once: the caller takes the slower path.
    /// `held` is let go once the pop has answered (a request on its own
    /// lets a lease be taken once its numbers are known).
    pub async fn submit<Held>(
        &self,
        placement: Arc<Placement>,
        demand: Demand,
        held: Held,
    ) -> Result<Served, LedgerError> {
        let seqs = self
            .pools
            .pop_once(&placement.pool, demand.numbers())
            .await
            .unwrap_or_default();
        drop(held);
        self.stats.ids_from_pool.inc_by(seqs.len() as u64);
        if seqs.is_empty() {
            return Ok(Served::default());
        }
        self.record(placement, demand, seqs).await
    }

    /// Records numbers the caller holds (popped, leased, or obtained on
    /// the slower paths: after a refill, or straight from the counter) in
    /// the write stage's next shared commit.
    pub async fn record(
        &self,
        placement: Arc<Placement>,
        demand: Demand,
        seqs: Vec<i64>,
    ) -> Result<Served, LedgerError> {
        let (reply, answer) = oneshot::channel();
        let stage = match demand {
            Demand::Gapless { .. } => &self.gapless_writes,
            _ => &self.writes,
        };
        let job = Job {
            placement,
            demand,
            reply,
            commitment: Commitment::current(),
        };
        stage
            .submit(vec![Popped { job, seqs }])
            .await
            .map_err(|_| LedgerError::Closed)?;
        answer.await.map_err(|_| LedgerError::Closed)?
    }
}

/// The write stage. It keeps one connection between batches (one batch at
/// a time uses it), so a batch costs no pool checkout and return.
struct Writer {
    db: Db,
    pools: Arc<PoolService>,
    counter: Arc<Counter>,
    stats: Arc<Stats>,
    /// The connection, and the server session it talks to (looked up when
    /// it is taken, so a commit in doubt can wait for that session's end).
    conn: tokio::sync::Mutex<Option<(Conn, Option<Session>)>>,
}

impl Writer {
    /// Everything popped since the last write, recorded in one statement
    /// and commit, then answered.
    async fn write(self: Arc<Self>, batches: Vec<Vec<Popped>>) {
        // A request withdrawn at its deadline sends nothing: its numbers
        // go back, and it was answered already.
        let (popped, withdrawn): (Vec<Popped>, Vec<Popped>) = batches
            .into_iter()
            .flatten()
            .partition(|p| p.job.commitment.as_ref().is_none_or(|c| c.begin_send()));
        if !withdrawn.is_empty() {
            let outcomes: Vec<_> = withdrawn
                .iter()
                .map(|_| Err(LedgerError::Withdrawn))
                .collect();
            self.give_back_unwritten(&withdrawn, &outcomes).await;
            for popped in withdrawn {
                let _ = popped.job.reply.send(Err(LedgerError::Withdrawn));
            }
        }
        if popped.is_empty() {
            return;
        }
        self.stats.pipeline_write_batch.observe(popped.len() as f64);
        let writes: Vec<LedgerWrite> = popped
            .iter()
            .map(|Popped { job, seqs }| {
                let placement = &job.placement;
                let row = |attachment: &Attachment| vec![attachment.row(&placement.shape, seqs[0])];
                let mut unnumbered = Vec::new();
                let (via, ledger_seqs, documents) = match &job.demand {
                    Demand::Ids { .. } => (Via::Ids, seqs.clone(), Vec::new()),
                    Demand::Lease { .. } => (Via::Lease, seqs.clone(), Vec::new()),
                    Demand::Document { attachment } => {
                        (Via::Document, seqs.clone(), row(attachment))
                    }
                    Demand::LeasedDocument { attachment } => {
                        (Via::Document, Vec::new(), row(attachment))
                    }
                    Demand::Gapless { attachment } => {
                        unnumbered.push(Unnumbered {
                            attachment: attachment.clone(),
                            shape: placement.shape.clone(),
                        });
                        (Via::Document, Vec::new(), Vec::new())
                    }
                };
                LedgerWrite {
                    sequence_id: placement.sequence.id,
                    period: placement.period.key().to_owned(),
                    seqs: ledger_seqs,
                    via,
                    documents,
                    unnumbered,
                }
            })
            .collect();
        let (mut outcomes, session, numberings) = self.record(&writes, &popped).await;
        if outcomes
            .iter()
            .any(|o| o.as_ref().is_err_and(LedgerError::in_doubt))
        {
            self.settle_in_doubt(&writes, &mut outcomes, session, &numberings)
                .await;
        }
        self.give_back_unwritten(&popped, &outcomes).await;
        for (popped, outcome) in popped.iter().zip(&outcomes) {
            if let (Some(commitment), Err(e)) = (&popped.job.commitment, outcome)
                && (e.numbers_reusable() || matches!(e, LedgerError::CounterHeld))
            {
                commitment.not_written();
            }
        }
        answer(popped, writes, outcomes);
    }

    async fn record(
        &self,
        writes: &[LedgerWrite],
        popped: &[Popped],
    ) -> (
        Vec<Result<Recorded, LedgerError>>,
        Option<Session>,
        Vec<GaplessNumbering>,
    ) {
        let mut held = self.conn.lock().await;
        let (conn, session) = match held.as_mut() {
            Some(held) => held,
            None => match writer_connection(&self.db).await {
                Ok(taken) => held.insert(taken),
                // Nothing was sent: the numbers go back, nothing to look up.
                Err(e) => {
                    let e = LedgerError::NotCommitted(Arc::new(e));
                    return (ledger::failed_all(writes, &e), None, Vec::new());
                }
            },
        };
        let session = *session;
        let gapless = GaplessOf {
            counter: &self.counter,
            popped,
            numberings: std::sync::Mutex::new(Vec::new()),
        };
        // A connection that stalls without closing never answers: past the
        // wait it is taken for broken and the writes are looked up.
        let outcomes = tokio::time::timeout(
            crate::db::COMMIT_ANSWER_WAIT,
            ledger::write_shared_numbering(conn, &self.stats, writes, &gapless),
        )
        .await
        .unwrap_or_else(|_| {
            let stalled = sqlx::Error::Io(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "no answer from Postgres",
            ));
            ledger::failed_all(writes, &LedgerError::Db(Arc::new(stalled)))
        });
        if outcomes
            .iter()
            .any(|o| matches!(o, Err(LedgerError::Db(_) | LedgerError::ReadOnly(_))))
        {
            // The connection may have broken: the next batch takes a fresh
            // one. This one is closed rather than returned, with its
            // writer's settings.
            if let Some((conn, _)) = held.take() {
                conn.discard();
            }
        }
        let numberings = gapless
            .numberings
            .into_inner()
            .unwrap_or_else(|e| e.into_inner());
        (outcomes, session, numberings)
    }
}

impl Writer {
    /// The writes whose commit is in doubt (the connection broke before its
    /// answer: a crash, a failover) are looked up once the server answers
    /// again: the caller gets the true answer, and numbers that did not
    /// land go back to their pool instead of being written off. Everything
    /// queued behind waits meanwhile; nothing could be written anyway.
    /// A gapless document is numbered inside the transaction, so its
    /// rows cannot be looked up by content (after a rollback another
    /// document takes the same number): its write is settled by the id of
    /// the transaction that numbered it. What stays unknown is answered as
    /// unknown, never as a failure to retry.
    async fn settle_in_doubt(
        &self,
        writes: &[LedgerWrite],
        outcomes: &mut [Result<Recorded, LedgerError>],
        session: Option<Session>,
        numberings: &[GaplessNumbering],
    ) {
        self.settle_by_content(writes, outcomes, session).await;
        self.settle_gapless(writes, outcomes, session, numberings)
            .await;
        for outcome in outcomes.iter_mut() {
            if let Err(LedgerError::Db(e)) = outcome {
                *outcome = Err(LedgerError::OutcomeUnknown(e.clone()));
            }
        }
    }

    /// The in-doubt writes of gapless documents, by the transaction that
    /// numbered each (the last one to, should the write have been split):
    /// committed, its rows are the write's; rolled back, or never numbered,
    /// nothing of it was written.
    async fn settle_gapless(
        &self,
        writes: &[LedgerWrite],
        outcomes: &mut [Result<Recorded, LedgerError>],
        session: Option<Session>,
        numberings: &[GaplessNumbering],
    ) {
        // Each write in doubt as its transaction numbered it; each
        // transaction asked about once, however many writes it numbered.
        let mut numbered_writes = Vec::new();
        let mut committed: std::collections::HashMap<i64, Option<bool>> =
            std::collections::HashMap::new();
        for i in 0..writes.len() {
            let Err(LedgerError::Db(e)) = &outcomes[i] else {
                continue;
            };
            if writes[i].unnumbered.is_empty() {
                continue;
            }
            let Some((xid, numbered)) = numbered_in(numberings, writes, i) else {
                outcomes[i] = Err(LedgerError::NotCommitted(e.clone()));
                continue;
            };
            if let std::collections::hash_map::Entry::Vacant(slot) = committed.entry(xid) {
                slot.insert(crate::db::transaction_committed(&self.db, xid, session).await);
            }
            match committed[&xid] {
                Some(false) => outcomes[i] = Err(LedgerError::NotCommitted(e.clone())),
                None => {}
                Some(true) => numbered_writes.push((i, numbered)),
            }
        }
        if numbered_writes.is_empty() {
            return;
        }
        // Committed: their rows are there; read for the answers.
        let asked = numbered_writes.iter().map(|(_, w)| w.clone()).collect();
        let Some(landed) = self.landed(asked, None).await else {
            return;
        };
        for ((i, numbered), landed) in numbered_writes.into_iter().zip(landed) {
            if let ledger::Landed::Yes(mut recorded) = landed {
                self.stats.in_doubt_settled.inc();
                recorded.numbered = numbered.documents;
                outcomes[i] = Ok(recorded);
            }
        }
    }

    /// What of `asked` is in the database, read on a fresh connection once
    /// the server answers (after `session` ended); None when it did not
    /// within `IN_DOUBT_PATIENCE`.
    async fn landed(
        &self,
        asked: Vec<LedgerWrite>,
        session: Option<Session>,
    ) -> Option<Vec<ledger::Landed>> {
        let asked = Arc::new(asked);
        crate::db::once_answering(
            &self.db,
            crate::db::IN_DOUBT_PATIENCE,
            session,
            |mut conn| {
                let asked = asked.clone();
                async move { ledger::landed(&mut conn, &asked).await }
            },
        )
        .await
    }

    /// The in-doubt writes whose rows say whether they landed.
    async fn settle_by_content(
        &self,
        writes: &[LedgerWrite],
        outcomes: &mut [Result<Recorded, LedgerError>],
        session: Option<Session>,
    ) {
        let doubtful: Vec<usize> = (0..writes.len())
            .filter(|&i| outcomes[i].as_ref().is_err_and(LedgerError::in_doubt))
            .filter(|&i| writes[i].unnumbered.is_empty())
            .collect();
        if doubtful.is_empty() {
            return;
        }
        let asked = doubtful.iter().map(|&i| writes[i].clone()).collect();
        let Some(landed) = self.landed(asked, session).await else {
            tracing::error!(
                writes = doubtful.len(),
                "ledger writes in doubt: Postgres did not answer again in time; their numbers are written off"
            );
            return;
        };
        self.stats.in_doubt_settled.inc_by(doubtful.len() as u64);
        for (i, landed) in doubtful.into_iter().zip(landed) {
            let outcome = &mut outcomes[i];
            match (landed, std::mem::replace(outcome, Err(LedgerError::Closed))) {
                (ledger::Landed::Yes(recorded), _) => *outcome = Ok(recorded),
                (ledger::Landed::No, Err(LedgerError::Db(e))) => {
                    *outcome = Err(LedgerError::NotCommitted(e))
                }
                (_, previous) => *outcome = previous,
            }
        }
    }

    /// Numbers of writes that surely wrote nothing go back to the head of
    /// their pool (those of a lease's documents go back to the lease, by
    /// its caller).
    async fn give_back_unwritten(
        &self,
        popped: &[Popped],
        outcomes: &[Result<Recorded, LedgerError>],
    ) {
        for (popped, outcome) in popped.iter().zip(outcomes) {
            let Err(e) = outcome else { continue };
            let from_pool = matches!(
                popped.job.demand,
                Demand::Ids { .. } | Demand::Lease { .. } | Demand::Document { .. }
            );
            if from_pool && e.numbers_reusable() && !popped.seqs.is_empty() {
                self.pools
                    .return_unissued(&popped.job.placement.pool, &popped.seqs)
                    .await;
            }
        }
    }
}

/// The counters of the batch's gapless sequences, by write; what each
/// take gave, and in which transaction, is kept for a commit in doubt.
struct GaplessOf<'a> {
    counter: &'a Counter,
    popped: &'a [Popped],
    numberings: std::sync::Mutex<Vec<GaplessNumbering>>,
}

/// Numbers a gapless counter gave to writes of a shared write, in order
/// from `first`, inside transaction `xid`.
struct GaplessNumbering {
    xid: i64,
    first: i64,
    writes: Vec<usize>,
}

impl GaplessCounter for GaplessOf<'_> {
    async fn take(
        &self,
        conn: &mut impl Link,
        writes: &[usize],
        n: i64,
    ) -> Result<i64, LedgerError> {
        let Some(&index) = writes.first() else {
            return Err(LedgerError::Closed);
        };
        let placement = &self.popped[index].job.placement;
        let (taken, xid) = self
            .counter
            .take_gapless_unless_held(conn, &placement.sequence, &placement.period, n)
            .await?
            .ok_or(LedgerError::CounterHeld)?;
        match taken {
            Reserved::Got(range) => {
                self.numberings
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push(GaplessNumbering {
                        xid,
                        first: range.start,
                        writes: writes.to_vec(),
                    });
                Ok(range.start)
            }
            Reserved::Exhausted => Err(LedgerError::Exhausted),
            Reserved::Stale | Reserved::Unfenced => Err(LedgerError::DefinitionChanged),
        }
    }
}

/// Write `index` as the last numbering that included it numbered it, and
/// that numbering's transaction; None when none did.
fn numbered_in(
    numberings: &[GaplessNumbering],
    writes: &[LedgerWrite],
    index: usize,
) -> Option<(i64, LedgerWrite)> {
    let numbering = numberings
        .iter()
        .rev()
        .find(|n| n.writes.contains(&index))?;
    let mut next = numbering.first;
    for &before in numbering.writes.iter().take_while(|&&w| w != index) {
        next += writes[before].unnumbered.len() as i64;
    }
    let mut numbered = writes[index].clone();
    for document in std::mem::take(&mut numbered.unnumbered) {
        numbered
            .documents
            .push(document.attachment.row(&document.shape, next));
        next += 1;
    }
    Some((numbering.xid, numbered))
}

/// A connection for the write stage, from the writers' pool, whose
/// connections wait at most 200 ms for a lock (see `startup`). Requests
/// never contend for the numbers they record, so a wait means another
/// transaction holds a number it should not; everyone queued behind the
/// write waits with it, so it gives up soon and the request at fault is
/// found (see `ledger::write_shared`).
async fn writer_connection(db: &Db) -> Result<(Conn, Option<Session>), sqlx::Error> {
    let mut conn = db.acquire().await?;
    // Without it a commit in doubt is looked up without waiting for its
    // session to end (right after a crash or failover, where it is gone).
    let session = conn.session().await;
    Ok((conn, session))
}

/// Each job's answer: what of its numbers the ledger took, its document.
fn answer(
    popped: Vec<Popped>,
    writes: Vec<LedgerWrite>,
    outcomes: Vec<Result<Recorded, LedgerError>>,
) {
    for ((popped, write), outcome) in popped.into_iter().zip(writes).zip(outcomes) {
        let answer = outcome.map(|recorded| {
            let rows = match recorded.numbered.is_empty() {
                true => write.documents,
                false => recorded.numbered,
            };
            let document = rows.into_iter().next().and_then(|row| {
                let created_at = *recorded.documents.get(&row.document_id)?;
                Some((row, created_at))
            });
            Served {
                issued: without(popped.seqs, &recorded.refused),
                refused: recorded.refused,
                document,
            }
        });
        let _ = popped.job.reply.send(answer);
    }
}
