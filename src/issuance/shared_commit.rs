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
//! is left to the caller's slower path (`issuance::counter_path`).
//!
//! This is the front: what a request hands in and gets back. The commit
//! itself is the writer's (`issuance::writer`), the one group-commit
//! writer of the instance: the lease handouts (`issuance::handouts`) are
//! written by it too.

use std::sync::Arc;

use tokio::sync::oneshot;
use tokio_util::task::TaskTracker;

use super::Placement;
use super::lease_store::OnItsOwn;
pub(super) use super::writer::{Demand, Served};
use super::writer::{Job, PoppedJob, ToWrite, Writer};
use crate::infra::commitment::Commitment;
use crate::infra::db::Db;
use crate::infra::stats::Stats;
use crate::records::batch::Batcher;
use crate::records::ledger::{LeaseReport, LedgerError};
use crate::records::pool::PoolService;

/// The shared commit: requests' pops joined per pool, their records
/// written together by the writer.
#[derive(Clone)]
pub struct SharedCommit {
    pools: Arc<PoolService>,
    stats: Arc<Stats>,
    writes: Batcher<Vec<ToWrite>>,
    /// Documents of gapless sequences commit in a write stage of their
    /// own: their counter rows may be held by another transaction (a batch,
    /// another instance), and a pooled request must never wait for that.
    gapless_writes: Batcher<Vec<ToWrite>>,
}

impl SharedCommit {
    pub fn spawn(db: Db, pools: Arc<PoolService>, stats: Arc<Stats>, tasks: &TaskTracker) -> Self {
        let stage = |name: &'static str| {
            let writer = Arc::new(Writer::new(db.clone(), pools.clone(), stats.clone()));
            // One commit at a time: a commit costs Postgres far more than
            // the rows it carries, so everything popped while one runs
            // waits for the next (two at a time was slower: BENCHMARKS.md,
            // "Profile findings that changed the code").
            Batcher::spawn(tasks, name, 4096, move |batches: Vec<Vec<ToWrite>>| {
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
    /// the pool gave nothing at once, or fewer numbers than a request for
    /// IDs asked: the caller takes the slower path.
    /// `on_its_own` is let go once the pop has answered (a request on its
    /// own lets a lease be taken once its numbers are known).
    pub async fn submit(
        &self,
        placement: Arc<Placement>,
        demand: Demand,
        on_its_own: Option<OnItsOwn>,
    ) -> Result<Served, LedgerError> {
        let seqs = self
            .pools
            .pop_once(&placement.pool, demand.numbers())
            .await
            .unwrap_or_default();
        drop(on_its_own);
        if seqs.len() < demand.numbers() && matches!(demand, Demand::Ids { .. }) {
            // The pool ran short: the rest may not exist (a sequence at its
            // `max`) or not come (Postgres away), and a request refused
            // must have taken nothing. So nothing is recorded here: what
            // was popped goes back, and the slower path takes all or none.
            if !seqs.is_empty() {
                self.pools
                    .discards()
                    .return_unissued(&placement.pool, &seqs)
                    .await;
            }
            return Ok(Served::default());
        }
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
            .submit(vec![ToWrite::Job(PoppedJob { job, seqs })])
            .await
            .map_err(|_| LedgerError::Closed)?;
        answer.await.map_err(|_| LedgerError::Closed)?
    }

    /// Writes which leased numbers went to callers, in the writer's next
    /// turn (after that turn's commit is answered: no answer waits for
    /// it).
    pub async fn record_handouts(&self, reports: Vec<LeaseReport>) -> Result<(), LedgerError> {
        let (reply, answer) = oneshot::channel();
        self.writes
            .submit(vec![ToWrite::Handouts(reports, reply)])
            .await
            .map_err(|_| LedgerError::Closed)?;
        answer.await.map_err(|_| LedgerError::Closed)?
    }
}
