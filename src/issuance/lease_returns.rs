//! The lease reporter: gives back what leases no longer need (idle, too
//! old, or everything at a clean stop) to the head of their pools, off the
//! ledger first, so the next caller gets them and no gap is left.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use super::Placement;
use super::handouts::Handouts;
use super::lease_store::{Leases, Returned};
use crate::domain::numbers::runs;
use crate::infra::backoff::Backoff;
use crate::infra::db::Db;
use crate::infra::log_limit::Repeated;
use crate::infra::stats::Stats;
use crate::records::ledger::{self, LeaseReport};
use crate::records::pool::{DiscardCause, GiveBackToken, PoolService};

/// Longest a clean stop waits for leases being taken to arrive.
const FETCHES_AT_STOP: Duration = Duration::from_secs(2);

/// Longest a clean stop waits for the handouts to be written.
const HANDOUTS_AT_STOP: Duration = Duration::from_secs(5);

/// Longest [`LeaseReturns::written`] waits.
const RETURNS_WAIT: Duration = Duration::from_secs(5);

/// What leases give back, written; at a stop, the handouts caught up.
pub(super) struct LeaseReturns {
    leases: Arc<Leases>,
    handouts: Arc<Handouts>,
    pools: Arc<PoolService>,
    stats: Arc<Stats>,
    background_db: Db,
}

impl LeaseReturns {
    pub(super) fn new(
        leases: Arc<Leases>,
        handouts: Arc<Handouts>,
        pools: Arc<PoolService>,
        stats: Arc<Stats>,
        background_db: Db,
    ) -> Self {
        Self {
            leases,
            handouts,
            pools,
            stats,
            background_db,
        }
    }

    /// Every `report_every` gives back idle leases and writes the returns;
    /// at `stop` (once the server has drained: no request takes numbers
    /// any more) gives back every lease before it returns.
    pub(super) async fn run(&self, stop: CancellationToken) {
        let mut returns = self.leases.pending_returns().await;
        let mut tick = tokio::time::interval(self.leases.settings().report_every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // Returns Postgres could not take (a failover): kept, and tried
        // again with backoff, rather than written off as lost leases.
        // Each keeps the token of its first try, so the pool takes it once
        // even when a try whose answer was lost had landed.
        let mut retrying: Vec<(Arc<Placement>, LeaseReport, GiveBackToken)> = Vec::new();
        let mut backoff = Backoff::background();
        let mut retry_at = Instant::now();
        loop {
            let stopping = tokio::select! {
                _ = stop.cancelled() => true,
                _ = tick.tick() => false,
            };
            self.leases.sweep(stopping);
            if stopping {
                // Leases still being taken arrive (and are given back)
                // before the last write, within a bound.
                let _ = tokio::time::timeout(FETCHES_AT_STOP, self.leases.fetches_done()).await;
                self.leases.sweep(true);
            }
            let mut returned = Vec::new();
            while let Ok(one) = returns.try_recv() {
                returned.push(one);
            }
            let written = returned.len();
            let mut tries: Vec<(Arc<Placement>, LeaseReport, GiveBackToken)> =
                merge_per_pool(returned)
                    .into_iter()
                    .map(|(placement, report)| (placement, report, GiveBackToken::new()))
                    .collect();
            if !retrying.is_empty() && (stopping || Instant::now() >= retry_at) {
                tries.append(&mut retrying);
            }
            let mut failed = false;
            for (placement, report, token) in tries {
                if let Err(e) = self
                    .give_back_lease(&placement, &report, &token, stopping)
                    .await
                {
                    RETURNS_FAILING.warn(&e);
                    failed = true;
                    retrying.push((placement, report, token));
                }
            }
            self.pools.discards().lease_returns_waiting(
                retrying
                    .iter()
                    .map(|(placement, _, _)| placement.pool.keys.clone()),
            );
            let retrying_numbers: usize = retrying.iter().map(|(_, r, _)| r.seqs.len()).sum();
            self.stats
                .lease_returns_retrying
                .set(retrying_numbers as i64);
            if failed {
                retry_at = Instant::now() + backoff.next_pause();
            } else if retrying.is_empty() {
                backoff.reset();
                RETURNS_FAILING.ended();
            }
            self.leases.returns_written(written);
            if stopping {
                // What requests were handed is on record before the
                // process goes (else it would be judged lease_lost).
                if !self.handouts.written(HANDOUTS_AT_STOP).await {
                    tracing::warn!(
                        "lease handouts not all recorded at the stop; reconciliation calls them lease_lost unless attached"
                    );
                }
                tracing::info!("leases given back");
                return;
            }
        }
    }

    /// Waits (up to 5 s) until every lease given back so far is back in
    /// its pool.
    pub(super) async fn written(&self) {
        let _ = tokio::time::timeout(RETURNS_WAIT, self.leases.all_returns_written()).await;
    }

    /// Lease holders in memory (one per pool requests use).
    pub(super) fn holders(&self) -> usize {
        self.leases.holders()
    }

    /// Numbers a lease did not hand out go back to the head of their pool
    /// (off the ledger first; those of a lease an attach ended stay its),
    /// or, once their period has ended, are recorded as discarded.
    /// When Postgres or Redis cannot take them
    /// (a failover) they are handed back to be tried again, unless this is
    /// the `last` try (a stop); where it cannot be done they are recorded as
    /// discarded.
    async fn give_back_lease(
        &self,
        placement: &Placement,
        unused: &LeaseReport,
        token: &GiveBackToken,
        last: bool,
    ) -> Result<(), ReturnFailed> {
        let released = match self.background_db.acquire().await {
            Ok(mut conn) => ledger::release_lease(&mut conn, unused).await,
            Err(e) => Err(e),
        };
        let (cause, numbers) = match released {
            // An ended period's pool is given up once and never looked at
            // again: pushed back, they would sit in Redis unrecorded.
            Ok(free) if self.leases.period_ended(placement) => (DiscardCause::PeriodEnded, free),
            // Taking them off the ledger again finds nothing to take: the
            // next try only pushes them.
            Ok(free) => match self
                .pools
                .discards()
                .give_back(&placement.pool, &free, token)
                .await
            {
                Ok(()) => return Ok(()),
                Err(e) if !last => return Err(ReturnFailed::Pool(e)),
                Err(e) => {
                    tracing::warn!(error = %e, "unused lease numbers not pushed back to the pool");
                    (DiscardCause::GiveBackFailed, free)
                }
            },
            Err(e) if !last => {
                crate::infra::db::distrust_server_after(&e);
                return Err(ReturnFailed::Ledger(e));
            }
            Err(e) => {
                tracing::warn!(error = %e, "unused lease numbers stay recorded as leased");
                (DiscardCause::LeaseReturned, unused.seqs.clone())
            }
        };
        self.pools
            .discards()
            .record_discard(&placement.sequence, &unused.period, &runs(&numbers), cause)
            .await;
        Ok(())
    }
}

/// Why a lease return is tried again.
#[derive(Debug, thiserror::Error)]
enum ReturnFailed {
    #[error("taking them off the ledger: {0}")]
    Ledger(#[from] sqlx::Error),
    #[error("pushing them back to the pool: {0}")]
    Pool(#[from] crate::records::pool::RedisFailure),
}

/// Lease returns Postgres did not take: said once, then with a count.
static RETURNS_FAILING: Repeated =
    Repeated::new("unused lease numbers not back in their pool yet; trying again");

/// The numbers returned to each pool, in one ascending report per pool.
/// Each give-back pushes to the head of the pool, so two given back apart
/// would put the later one's (a lease that arrived at a clean stop, say)
/// in front of lower numbers.
fn merge_per_pool(returned: Vec<Returned>) -> Vec<(Arc<Placement>, LeaseReport)> {
    let mut merged: Vec<(Arc<Placement>, LeaseReport)> = Vec::new();
    for Returned {
        pool: placement,
        seqs,
    } in returned
    {
        match merged.iter_mut().find(|(p, _)| {
            p.pool.keys.pool == placement.pool.keys.pool && p.sequence.id == placement.sequence.id
        }) {
            Some((_, into)) => into.seqs.extend(seqs),
            None => {
                let report = LeaseReport {
                    sequence_id: placement.sequence.id,
                    period: placement.period.key().to_owned(),
                    seqs,
                };
                merged.push((placement, report));
            }
        }
    }
    for (_, report) in &mut merged {
        report.seqs.sort_unstable();
    }
    merged
}
