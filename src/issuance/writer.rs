//! The group-commit writer: everything handed to it since its last write
//! (requests' ledger rows and documents' outbox rows, lease handouts) in
//! one statement and commit on one kept connection, then answered; a
//! commit in doubt is settled before anything else is written. One type
//! for both write stages of the shared commit (`issuance::shared_commit`).

use std::sync::Arc;

use chrono::{DateTime, Utc};
use tokio::sync::oneshot;

use super::Placement;
use crate::domain::numbers::without;
use crate::infra::commitment::Commitment;
use crate::infra::db::{Conn, Db, Session};
use crate::infra::stats::Stats;
use crate::records::counter::Counter;
use crate::records::ledger::outbox_rows::Attachment;
use crate::records::ledger::outbox_rows::OutboxRow;
use crate::records::ledger::{
    self, GaplessTake, LeaseReport, LedgerError, LedgerWrite, Recorded, Unnumbered, Via,
    numbered_in,
};
use crate::records::pool::{DiscardCause, PoolService};

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
    pub(super) fn numbers(&self) -> usize {
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

pub(super) type Reply = oneshot::Sender<Result<Served, LedgerError>>;

pub(super) struct Job {
    pub placement: Arc<Placement>,
    pub demand: Demand,
    pub reply: Reply,
    /// The request's, when one waits: asked before the job's write is sent.
    pub commitment: Option<Arc<Commitment>>,
}

/// A job whose numbers were popped, on its way to the write stage.
pub(super) struct PoppedJob {
    pub job: Job,
    pub seqs: Vec<i64>,
}

/// What the writer is handed.
pub(super) enum ToWrite {
    /// A request's numbers and documents, answered once committed.
    Job(PoppedJob),
    /// Which leased numbers went to callers (the handout reporter's).
    Handouts(Vec<LeaseReport>, oneshot::Sender<Result<(), LedgerError>>),
}

/// A handout write's answer.
type HandoutsReply = tokio::sync::oneshot::Sender<Result<(), LedgerError>>;

/// The write stage. It keeps one connection between batches (one batch at
/// a time uses it), so a batch costs no pool checkout and return.
pub(super) struct Writer {
    db: Db,
    pools: Arc<PoolService>,
    counter: Arc<Counter>,
    stats: Arc<Stats>,
    /// The connection, and the server session it talks to (looked up when
    /// it is taken, so a commit in doubt can wait for that session's end).
    conn: tokio::sync::Mutex<Option<(Conn, Option<Session>)>>,
}

impl Writer {
    pub(super) fn new(db: Db, pools: Arc<PoolService>, stats: Arc<Stats>) -> Self {
        Self {
            db,
            counter: pools.counter().clone(),
            pools,
            stats,
            conn: tokio::sync::Mutex::new(None),
        }
    }

    /// Everything handed in since the last write: the requests' records in
    /// one statement and commit, answered; then the handouts.
    pub(super) async fn write(self: Arc<Self>, batches: Vec<Vec<ToWrite>>) {
        let mut jobs = Vec::new();
        let mut handouts = Vec::new();
        for entry in batches.into_iter().flatten() {
            match entry {
                ToWrite::Job(popped) => jobs.push(popped),
                ToWrite::Handouts(reports, reply) => handouts.push((reports, reply)),
            }
        }
        self.write_jobs(jobs).await;
        if !handouts.is_empty() {
            self.write_handouts(handouts).await;
        }
    }

    /// Requests' records in one statement and commit, then answered.
    async fn write_jobs(&self, jobs: Vec<PoppedJob>) {
        // A request withdrawn at its deadline sends nothing: its numbers
        // go back, and it was answered already.
        let (popped, withdrawn): (Vec<PoppedJob>, Vec<PoppedJob>) = jobs
            .into_iter()
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
            .map(|PoppedJob { job, seqs }| {
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
                            sequence: placement.sequence.clone(),
                            period: placement.period.clone(),
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
        let (mut outcomes, session, gapless_takes) = self.record(&writes).await;
        if outcomes
            .iter()
            .any(|o| o.as_ref().is_err_and(LedgerError::in_doubt))
        {
            self.settle_in_doubt(&writes, &mut outcomes, session, &gapless_takes)
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
    ) -> (
        Vec<Result<Recorded, LedgerError>>,
        Option<Session>,
        Vec<GaplessTake>,
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
        // A connection that stalls without closing never answers: past the
        // wait it is taken for broken and the writes are looked up.
        // Kept outside the write: a write given up on still says which
        // transactions numbered gapless documents.
        let gapless_takes = std::sync::Mutex::new(Vec::new());
        let outcomes = tokio::time::timeout(
            crate::infra::db::COMMIT_ANSWER_WAIT,
            ledger::write_shared(conn, &self.stats, &self.counter, writes, &gapless_takes),
        )
        .await
        .unwrap_or_else(|_| {
            let e = LedgerError::Db(Arc::new(no_answer()));
            ledger::failed_all(writes, &e)
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
        let gapless_takes = gapless_takes
            .into_inner()
            .unwrap_or_else(|e| e.into_inner());
        (outcomes, session, gapless_takes)
    }

    /// Which leased numbers went to callers, for every report handed in,
    /// in one statement. A failure is answered to the reporter, which keeps
    /// them and hands them in again (a handout written twice says the same
    /// thing twice: one in doubt is simply written again).
    async fn write_handouts(&self, handouts: Vec<(Vec<LeaseReport>, HandoutsReply)>) {
        let mut reports: Vec<LeaseReport> = Vec::new();
        let mut replies = Vec::with_capacity(handouts.len());
        for (handed, reply) in handouts {
            reports.extend(handed);
            replies.push(reply);
        }
        let mut held = self.conn.lock().await;
        let written = match held.as_mut() {
            Some(held) => Ok(held),
            None => writer_connection(&self.db)
                .await
                .map(|taken| held.insert(taken)),
        };
        let outcome = match written {
            Ok((conn, _)) => tokio::time::timeout(
                crate::infra::db::COMMIT_ANSWER_WAIT,
                ledger::record_handouts(conn, &reports),
            )
            .await
            .unwrap_or_else(|_| Err(no_answer())),
            Err(e) => Err(e),
        };
        let outcome = outcome.map_err(|e| {
            if let Some((conn, _)) = held.take() {
                conn.discard();
            }
            LedgerError::Db(Arc::new(e))
        });
        for reply in replies {
            let _ = reply.send(outcome.clone());
        }
    }

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
        gapless_takes: &[GaplessTake],
    ) {
        self.settle_by_content(writes, outcomes, session).await;
        self.settle_gapless(writes, outcomes, session, gapless_takes)
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
        gapless_takes: &[GaplessTake],
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
            let Some((xid, numbered)) = numbered_in(gapless_takes, writes, i) else {
                outcomes[i] = Err(LedgerError::NotCommitted(e.clone()));
                continue;
            };
            if let std::collections::hash_map::Entry::Vacant(slot) = committed.entry(xid) {
                slot.insert(
                    crate::infra::db::transaction_committed(
                        &self.db,
                        xid,
                        session,
                        // Its rows are looked for below, write by write.
                        &crate::infra::db::Unwitnessed,
                    )
                    .await,
                );
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
            match landed {
                ledger::Landed::Yes(mut recorded) => {
                    self.stats.in_doubt_settled.inc();
                    recorded.numbered = numbered.documents;
                    outcomes[i] = Ok(recorded);
                }
                // Its transaction id says committed, yet none of its rows
                // is there: after a crash the id went to another
                // transaction (ids whose records never reached the disk
                // are handed out again). Had this one committed, its rows
                // would be there: nothing of it was written.
                ledger::Landed::No => {
                    if let Err(LedgerError::Db(e)) = &outcomes[i] {
                        self.stats.in_doubt_settled.inc();
                        outcomes[i] = Err(LedgerError::NotCommitted(e.clone()));
                    }
                }
                _ => {}
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
        crate::infra::db::once_answering(
            &self.db,
            crate::infra::db::IN_DOUBT_PATIENCE,
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
    /// its caller). Those of a write that gave up on another transaction's
    /// lock are recorded as discarded instead: the head of the pool, they
    /// would fail the next request too, and that transaction may yet
    /// commit them.
    async fn give_back_unwritten(
        &self,
        popped: &[PoppedJob],
        outcomes: &[Result<Recorded, LedgerError>],
    ) {
        for (popped, outcome) in popped.iter().zip(outcomes) {
            let Err(e) = outcome else { continue };
            let from_pool = matches!(
                popped.job.demand,
                Demand::Ids { .. } | Demand::Lease { .. } | Demand::Document { .. }
            );
            if !from_pool || popped.seqs.is_empty() {
                continue;
            }
            let pool = &popped.job.placement.pool;
            if e.lock_held_elsewhere() {
                self.pools
                    .discards()
                    .discard_numbers(pool, &popped.seqs, DiscardCause::LockedElsewhere)
                    .await;
            } else if e.numbers_reusable() {
                self.pools
                    .discards()
                    .return_unissued(pool, &popped.seqs)
                    .await;
            }
        }
    }
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
    popped: Vec<PoppedJob>,
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

/// What a statement that got no answer within `COMMIT_ANSWER_WAIT` failed
/// with.
fn no_answer() -> sqlx::Error {
    sqlx::Error::Io(std::io::Error::new(
        std::io::ErrorKind::TimedOut,
        "no answer from Postgres",
    ))
}
