//! The handout reporter: which leased numbers went to callers, handed to
//! the group-commit writer (`issuance::writer`) every few milliseconds,
//! for everything handed out meanwhile in one statement. No answer waits for it: the lease's ledger
//! row already covers the numbers (committed before any of them went out),
//! and an attach of an ID whose handout is not written yet waits for it, or
//! for the lease's expiry (`ledger::LEASE_TTL`) if this instance died first.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::sync::{Notify, mpsc};
use tokio_util::task::TaskTracker;

use super::shared_commit::SharedCommit;
use crate::infra::backoff::Backoff;
use crate::infra::log_limit::Repeated;
use crate::infra::stats::Stats;
use crate::records::ledger::LeaseReport;

/// Shortest time between two writes: everything handed out meanwhile goes
/// into the next one. An attach through another instance waits about this
/// long for an ID just answered; Postgres sees at most 200 handout commits a
/// second per instance however busy it is.
const REPORT_EVERY: Duration = Duration::from_millis(5);

/// Most handouts one statement records (more wait for the next write).
const HANDOUTS_PER_WRITE: usize = 4096;

/// The queue to the reporter. It holds what requests were handed since the
/// last write that landed: at most the numbers leases held.
pub(super) struct Handouts {
    queue: mpsc::UnboundedSender<LeaseReport>,
    /// Handouts queued and handouts known written, counted in reports: a
    /// stop waits until the second has caught up with the first.
    queued: Arc<AtomicU64>,
    written: Arc<AtomicU64>,
    caught_up: Arc<Notify>,
}

impl Handouts {
    /// Starts the reporter; it stops once the queue's sender is dropped and
    /// what was queued is written (or Postgres stays away).
    pub(super) fn spawn(writer: SharedCommit, stats: Arc<Stats>, tasks: &TaskTracker) -> Self {
        let (queue, receiver) = mpsc::unbounded_channel();
        let handouts = Self {
            queue,
            queued: Arc::new(AtomicU64::new(0)),
            written: Arc::new(AtomicU64::new(0)),
            caught_up: Arc::new(Notify::new()),
        };
        let reporter = Reporter {
            writer,
            stats,
            receiver,
            written: handouts.written.clone(),
            caught_up: handouts.caught_up.clone(),
        };
        tasks.spawn(reporter.run());
        handouts
    }

    /// Queues `report`; no await, and nothing for the caller to wait for.
    pub(super) fn send(&self, report: LeaseReport) {
        self.queued.fetch_add(1, Ordering::AcqRel);
        if self.queue.send(report).is_err() {
            // The reporter has stopped (the issuer is going away): the
            // lease rows stay, and reconciliation calls the numbers
            // lease_lost unless attached.
            self.written.fetch_add(1, Ordering::AcqRel);
        }
    }

    /// Until every handout queued so far is written, or `limit` passed.
    pub(super) async fn written(&self, limit: Duration) -> bool {
        let target = self.queued.load(Ordering::Acquire);
        let caught_up = async {
            loop {
                let notified = self.caught_up.notified();
                tokio::pin!(notified);
                notified.as_mut().enable();
                if self.written.load(Ordering::Acquire) >= target {
                    return;
                }
                notified.await;
            }
        };
        tokio::time::timeout(limit, caught_up).await.is_ok()
    }
}

struct Reporter {
    writer: SharedCommit,
    stats: Arc<Stats>,
    receiver: mpsc::UnboundedReceiver<LeaseReport>,
    written: Arc<AtomicU64>,
    caught_up: Arc<Notify>,
}

impl Reporter {
    async fn run(mut self) {
        let mut pending: Vec<LeaseReport> = Vec::new();
        let mut backoff = Backoff::between(Duration::from_millis(50), Duration::from_secs(2));
        loop {
            if pending.is_empty() {
                // Nothing to write: wait for the next handout.
                if self
                    .receiver
                    .recv_many(&mut pending, HANDOUTS_PER_WRITE)
                    .await
                    == 0
                {
                    return;
                }
            }
            let next_write = tokio::time::Instant::now() + REPORT_EVERY;
            while pending.len() < HANDOUTS_PER_WRITE
                && let Ok(report) = self.receiver.try_recv()
            {
                pending.push(report);
            }
            let numbers: usize = pending.iter().map(|r| r.seqs.len()).sum();
            self.stats.handouts_unreported.set(numbers as i64);
            match self.writer.record_handouts(pending.clone()).await {
                Ok(()) => {
                    FAILING.ended();
                    backoff.reset();
                    self.written
                        .fetch_add(pending.len() as u64, Ordering::AcqRel);
                    pending.clear();
                    self.stats.handouts_unreported.set(0);
                    self.caught_up.notify_waiters();
                    tokio::time::sleep_until(next_write).await;
                }
                Err(e) => {
                    // Kept and written again: a handout recorded twice
                    // says the same thing twice (a commit in doubt may
                    // have landed). Until then an attach of these numbers
                    // waits for the lease's expiry.
                    FAILING.warn(&e);
                    tokio::time::sleep(backoff.next_pause()).await;
                }
            }
        }
    }
}

/// Handouts Postgres did not take: said once, then with a count.
static FAILING: Repeated =
    Repeated::new("lease handouts not recorded yet; attaching their IDs waits; trying again");
