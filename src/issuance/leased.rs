//! The first step of the path: numbers from this instance's lease memory.
//! The lease store (`crate::lease`) says what a holder has and when a
//! lease is due; this takes leases (through the shared commit), records
//! handouts and writes documents on leased numbers.

use std::sync::Arc;

use chrono::{DateTime, Utc};
use tokio::sync::oneshot;

use super::handouts::HandoutFailed;
use super::pipeline::Demand;
use super::{IssueError, Issuer};
use crate::lease::{Holder, OnItsOwn, Order, Progress};
use crate::ledger::outbox::{Attachment, OutboxRow};
use crate::ledger::{LeaseReport, LedgerError, Via};
use crate::numbers::SeqRange;
use crate::pool::{DiscardCause, Placement};

type LeaseHolder = Holder<Arc<Placement>>;

/// Held by a request served on its own until its pop has answered.
pub(super) type OnItsOwnTicket = OnItsOwn<Arc<Placement>>;

/// Where a request for numbers stands after its first look at the lease.
pub(super) enum Begun {
    /// The lease had every number: `got`, not handed out yet.
    Complete(Arc<LeaseHolder>, Vec<i64>),
    /// A lease is on its way; `got` holds what there was.
    Waiting(Arc<LeaseHolder>, Vec<i64>),
    /// No lease is coming (or leases are off): `got` (maybe empty) is all
    /// the lease gives; the ticket is kept until the rest is popped.
    Alone(Option<Arc<LeaseHolder>>, Vec<i64>, Option<OnItsOwnTicket>),
}

/// A document's outcome on the lease.
pub(super) enum OnLease {
    Written(Result<(OutboxRow, DateTime<Utc>), IssueError>),
    /// No lease serves the sequence now: the document goes on its own,
    /// keeping the ticket (if any) until its number is popped.
    NotServed(Option<OnItsOwnTicket>),
}

/// The most numbers one lease of `holder`'s pool may carry.
fn pool_size(holder: &LeaseHolder) -> usize {
    holder.pool.sequence.definition.pool_size as usize
}

impl Issuer {
    fn holder(&self, placement: &Arc<Placement>) -> Arc<LeaseHolder> {
        let sequence = &placement.sequence;
        let key = (
            sequence.id,
            sequence.version,
            placement.period.key().to_owned(),
        );
        self.leases.holder(key, || placement.clone())
    }

    /// Takes what the lease has toward `count` numbers, without waiting:
    /// under the lease's lock, counting the request in the rate, and
    /// ordering the next lease if one is due.
    pub(super) fn begin_ids(self: &Arc<Self>, placement: &Arc<Placement>, count: usize) -> Begun {
        if !self.leases.enabled() {
            return Begun::Alone(None, Vec::new(), None);
        }
        let holder = self.holder(placement);
        let mut got = Vec::with_capacity(count);
        let (progress, order) =
            self.leases
                .take(&holder, count, pool_size(&holder), &mut got, true);
        if let Some(order) = order {
            self.order(order);
        }
        match progress {
            Progress::Complete => Begun::Complete(holder, got),
            Progress::Waiting => Begun::Waiting(holder, got),
            Progress::Alone(on_its_own) => Begun::Alone(Some(holder), got, Some(on_its_own)),
        }
    }

    /// Waits for the lease on its way until `got` holds `count` numbers;
    /// an error when none is coming after all (see [`crate::lease::Leases::fill`]).
    pub(super) async fn wait_for_lease(
        self: &Arc<Self>,
        holder: &Arc<LeaseHolder>,
        count: usize,
        got: &mut Vec<i64>,
    ) -> Result<(), Option<OnItsOwnTicket>> {
        self.leases
            .fill(holder, count, pool_size(holder), got, |order| {
                self.order(order)
            })
            .await
    }

    /// Takes a lease in a task of its own, through the shared commit.
    fn order(self: &Arc<Self>, order: Order<Arc<Placement>>) {
        let issuer = self.clone();
        self.tasks.spawn(async move {
            let Order { holder, size } = order;
            issuer.leases.after_those_on_their_own(&holder).await;
            // A lease recorded in part is a smaller lease: the part already
            // committed is the lease's to hand out or give back, never
            // dropped (it would be a lost lease).
            let (leased, failed) = issuer
                .shared_as_many(&holder.pool, size, Via::Lease, ())
                .await;
            if let Some(e) = &failed {
                tracing::debug!(error = %e, size, got = leased.len(), "lease not taken whole; requests are served on their own");
            }
            issuer
                .leases
                .arrived(&holder, (!leased.is_empty()).then_some(leased));
        });
    }

    /// Records `seqs` as handed out; they are the caller's once that
    /// committed. Numbers whose handout surely was not written go back to
    /// the lease, also when the caller went away meanwhile (a handout in
    /// doubt waits for Postgres to answer again; the request may time out).
    pub(super) async fn hand_out(
        self: &Arc<Self>,
        holder: &Arc<LeaseHolder>,
        seqs: Vec<i64>,
    ) -> Result<Vec<i64>, IssueError> {
        if seqs.is_empty() {
            return Ok(seqs);
        }
        self.leases.served(seqs.len());
        let written = self.handouts.send(LeaseReport {
            sequence_id: holder.pool.sequence.id,
            period: holder.pool.period.key().to_owned(),
            seqs: seqs.clone(),
        });
        let mut pending = PendingHandout {
            issuer: self.clone(),
            holder: holder.clone(),
            seqs: Some(seqs),
            written: Some(written),
        };
        pending.outcome().await
    }

    /// A document on a number of this instance's lease, its outbox row
    /// written in the shared commit (the lease's ledger record covers the
    /// number).
    pub(super) async fn document_on_lease(
        self: &Arc<Self>,
        placement: &Arc<Placement>,
        attachment: &Arc<Attachment>,
    ) -> OnLease {
        let (holder, mut got) = match self.begin_ids(placement, 1) {
            Begun::Complete(holder, got) => (holder, got),
            Begun::Waiting(holder, mut got) => {
                if let Err(on_its_own) = self.wait_for_lease(&holder, 1, &mut got).await {
                    return OnLease::NotServed(on_its_own);
                }
                (holder, got)
            }
            Begun::Alone(_, _, on_its_own) => return OnLease::NotServed(on_its_own),
        };
        let Some(seq) = got.pop() else {
            return OnLease::NotServed(None);
        };
        self.leases.served(1);
        let demand = Demand::LeasedDocument {
            attachment: attachment.clone(),
        };
        let written = self
            .pipeline
            .record(placement.clone(), demand, vec![seq])
            .await
            .and_then(|served| served.document.ok_or(LedgerError::Closed));
        OnLease::Written(match written {
            Ok(document) => Ok(document),
            Err(e) => {
                self.not_written(&holder, seq, e.numbers_reusable()).await;
                Err(e.into())
            }
        })
    }

    /// A leased number whose document was not written. When the database
    /// surely rolled the write back and the number itself is not at fault,
    /// it goes back to the lease; otherwise (the outcome is unknown, or the
    /// ID it prints is taken) it is recorded as discarded, never handed out
    /// again.
    async fn not_written(&self, holder: &LeaseHolder, seq: i64, reusable: bool) {
        if reusable {
            self.leases.put_back(holder, vec![seq]);
            return;
        }
        let placement = &holder.pool;
        self.pools
            .record_discard(
                &placement.sequence,
                placement.period.key(),
                &[SeqRange::single(seq)],
                DiscardCause::DocumentNotWritten,
            )
            .await;
    }
}

/// A handout on its way to the ledger. Dropped before its outcome arrived
/// (the caller went away), it leaves a task to put the numbers back if the
/// handout turns out not written.
struct PendingHandout {
    issuer: Arc<Issuer>,
    holder: Arc<LeaseHolder>,
    seqs: Option<Vec<i64>>,
    written: Option<oneshot::Receiver<Result<(), HandoutFailed>>>,
}

impl PendingHandout {
    async fn outcome(&mut self) -> Result<Vec<i64>, IssueError> {
        let outcome = match self.written.as_mut() {
            Some(written) => written
                .await
                .unwrap_or(Err(HandoutFailed::Unknown(LedgerError::Closed))),
            None => Err(HandoutFailed::Unknown(LedgerError::Closed)),
        };
        self.written = None;
        let seqs = self.seqs.take().unwrap_or_default();
        match outcome {
            Ok(()) => Ok(seqs),
            Err(failed @ HandoutFailed::NotWritten(_)) => {
                self.issuer.leases.put_back(&self.holder, seqs);
                Err(IssueError::Ledger(failed.error()))
            }
            Err(failed) => Err(IssueError::Ledger(failed.error())),
        }
    }
}

impl Drop for PendingHandout {
    fn drop(&mut self) {
        let (Some(written), Some(seqs)) = (self.written.take(), self.seqs.take()) else {
            return;
        };
        let (issuer, holder) = (self.issuer.clone(), self.holder.clone());
        self.issuer.tasks.spawn(async move {
            if let Ok(Err(HandoutFailed::NotWritten(_))) = written.await {
                issuer.leases.put_back(&holder, seqs);
            }
        });
    }
}
