//! The first step of the path: numbers from this instance's lease memory.
//! The lease store (`crate::lease`) says what a holder has and when a
//! lease is due; this takes leases (through the shared commit), records
//! handouts and writes documents on leased numbers.

use std::sync::Arc;

use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};

use super::pipeline::Demand;
use super::{IssueError, Issuer};
use crate::lease::{Holder, OnItsOwn, Order, Progress};
use crate::ledger::outbox::{Attachment, OutboxRow};
use crate::ledger::{LEASE_TTL, LeaseReport, LedgerError, Via};
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

/// How much sooner than the lease's expiry in the ledger its holder stops
/// handing out its numbers: room for its clock running a little fast
/// against Postgres' (the deadline is counted from before the lease was
/// even sent, so the statement's time is later still).
const DEADLINE_MARGIN: Duration = Duration::from_millis(500);

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
            // Before the lease is sent: its expiry in the ledger is later.
            let until = Instant::now() + LEASE_TTL - DEADLINE_MARGIN;
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
                .arrived(&holder, (!leased.is_empty()).then_some(leased), until);
        });
    }

    /// Hands `seqs` to the caller: the lease's ledger row covers them, so
    /// the answer goes out at once; which numbers went out is written in
    /// the background (`handouts.rs`). A request withdrawn at its deadline
    /// (it was answered 503 already) gets none: they go back.
    pub(super) fn hand_out(
        &self,
        holder: &LeaseHolder,
        seqs: Vec<i64>,
    ) -> Result<Vec<i64>, IssueError> {
        if seqs.is_empty() {
            return Ok(seqs);
        }
        if !crate::commitment::Commitment::begin_send_current() {
            self.leases.put_back(holder, seqs);
            return Err(LedgerError::Withdrawn.into());
        }
        self.leases.served(seqs.len());
        self.handouts.send(LeaseReport {
            sequence_id: holder.pool.sequence.id,
            period: holder.pool.period.key().to_owned(),
            seqs: seqs.clone(),
        });
        Ok(seqs)
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
    /// it goes back to its pool; otherwise (the outcome is unknown, or the
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
