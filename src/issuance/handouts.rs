//! The handout writer: which leased numbers went to which callers, recorded
//! for every request waiting at once in one statement (its own commit)
//! before their answers leave, so an ID answered is attachable at once
//! through any instance, and still after this one was killed.

use crate::db::{Conn, Db};
use tokio::sync::{mpsc, oneshot};
use tokio_util::task::TaskTracker;

use crate::db::Session;
use crate::ledger::{self, LeaseReport, LedgerError};

/// Writers of handouts working at once. One: everything that arrives while
/// it commits goes into its next commit. (Measured with the bench's ratio
/// and latency scenarios, alternating: one writer 0.43 / 0.42 of GET
/// /healthz and a p99 1.10 / 1.14 times pgbench's; two 0.38 / 0.39 and
/// 1.40 / 1.52; four 0.33 / 0.33 and 1.59 / 1.60. More commits cost more
/// than the wait they save.)
const HANDOUT_WRITERS: usize = 1;

/// Most handouts one statement records.
const HANDOUTS_PER_WRITE: usize = 4096;

/// Why numbers handed to a request could not be recorded as handed out.
#[derive(Debug, Clone)]
pub(super) enum HandoutFailed {
    /// Nothing was written: the numbers may be handed out again.
    NotWritten(LedgerError),
    /// Whether the write committed is unknown: the numbers are never handed
    /// out again (reconciliation tells what became of them).
    Unknown(LedgerError),
}

impl HandoutFailed {
    pub(super) fn error(self) -> LedgerError {
        match self {
            HandoutFailed::NotWritten(e) | HandoutFailed::Unknown(e) => e,
        }
    }
}

type Written = oneshot::Sender<Result<(), HandoutFailed>>;

struct Handout {
    report: LeaseReport,
    written: Written,
}

/// The queue to the writer; it holds at most the requests in flight.
pub(super) struct Handouts {
    queue: mpsc::UnboundedSender<Handout>,
}

impl Handouts {
    /// Starts the writers; they stop once the queue's sender is dropped
    /// and the queue is drained.
    pub(super) fn spawn(db: Db, tasks: &TaskTracker) -> Self {
        let (queue, receiver) = mpsc::unbounded_channel();
        let receiver = std::sync::Arc::new(tokio::sync::Mutex::new(receiver));
        for _ in 0..HANDOUT_WRITERS {
            let (db, receiver) = (db.clone(), receiver.clone());
            tasks.spawn(async move {
                let mut conn: Option<(Conn, Option<Session>)> = None;
                let mut batch = Vec::with_capacity(64);
                loop {
                    let taken = receiver
                        .lock()
                        .await
                        .recv_many(&mut batch, HANDOUTS_PER_WRITE)
                        .await;
                    if taken == 0 {
                        return;
                    }
                    write(&db, &mut conn, std::mem::take(&mut batch)).await;
                }
            });
        }
        Self { queue }
    }

    /// Queues `report` (no await: its numbers are the writer's once this
    /// returns); the receiver says how it went.
    pub(super) fn send(&self, report: LeaseReport) -> oneshot::Receiver<Result<(), HandoutFailed>> {
        let (written, answer) = oneshot::channel();
        if let Err(closed) = self.queue.send(Handout { report, written }) {
            let _ = closed
                .0
                .written
                .send(Err(HandoutFailed::NotWritten(LedgerError::Closed)));
        }
        answer
    }
}

/// Records the handouts of every request waiting in one statement (its
/// own commit) on the writer's connection, then answers each.
async fn write(db: &Db, conn: &mut Option<(Conn, Option<Session>)>, batch: Vec<Handout>) {
    let reports: Vec<LeaseReport> = batch.iter().map(|h| h.report.clone()).collect();
    let outcome = match writer_connection(db, conn).await {
        // No connection: nothing was written.
        Err(e) => Err(HandoutFailed::NotWritten(LedgerError::from(e))),
        Ok((held, session)) => match ledger::record_handouts(held, &reports).await {
            Ok(()) => Ok(()),
            Err(e) => {
                let e = LedgerError::from(e);
                if !e.numbers_reusable() {
                    // The connection may be broken: the next write takes
                    // a new one.
                    *conn = None;
                }
                if e.numbers_reusable() {
                    Err(HandoutFailed::NotWritten(e))
                } else {
                    settle_in_doubt(db, reports, e, session).await
                }
            }
        },
    };
    for handout in batch {
        let _ = handout.written.send(outcome.clone());
    }
}

/// Handouts whose commit is in doubt (the connection broke before its
/// answer), looked up once the server answers again: recorded, the callers
/// get their numbers; not, the numbers go back to their lease. Handouts
/// queued behind wait meanwhile; nothing could be written anyway.
async fn settle_in_doubt(
    db: &Db,
    reports: Vec<LeaseReport>,
    e: LedgerError,
    session: Option<Session>,
) -> Result<(), HandoutFailed> {
    let reports = std::sync::Arc::new(reports);
    let landed =
        crate::db::once_answering(db, crate::db::IN_DOUBT_PATIENCE, session, |mut conn| {
            let reports = reports.clone();
            async move { ledger::handouts_landed(&mut conn, &reports).await }
        })
        .await;
    match (landed.flatten(), e) {
        (Some(true), _) => Ok(()),
        (Some(false), LedgerError::Db(e)) => {
            Err(HandoutFailed::NotWritten(LedgerError::NotCommitted(e)))
        }
        (_, e) => Err(HandoutFailed::Unknown(e)),
    }
}

/// The writer's connection, taken from the pool when it has none, and
/// the server session it talks to.
async fn writer_connection<'c>(
    db: &Db,
    conn: &'c mut Option<(Conn, Option<Session>)>,
) -> Result<(&'c mut Conn, Option<Session>), sqlx::Error> {
    if conn.is_none() {
        let mut taken = db.acquire().await?;
        let session = taken.session().await;
        *conn = Some((taken, session));
    }
    match conn.as_mut() {
        Some((held, session)) => Ok((held, *session)),
        None => Err(sqlx::Error::PoolClosed),
    }
}
