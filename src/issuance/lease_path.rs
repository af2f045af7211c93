//! The first stage of the path: numbers from this instance's lease memory.
//! The lease store (`issuance::lease_store`) says what a holder has and
//! when a lease is due; this stage hands numbers out, has handouts
//! recorded and writes documents on leased numbers. Taking a lease is the
//! issuer's (`Issuer::order`): it goes through the shared commit and the
//! counter path like any request.

use std::sync::Arc;

use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};

use super::handouts::Handouts;
use super::lease_store::{Holder, LeaseProgress, Leases, OnItsOwn, Order};
use super::shared_commit::{Demand, SharedCommit};
use super::{IssueError, Placement};
use crate::domain::numbers::SeqRange;
use crate::records::ledger::outbox_rows::{Attachment, OutboxRow};
use crate::records::ledger::{LEASE_TTL, LeaseReport, LedgerError};
use crate::records::pool::{DiscardCause, PoolService};

/// Where a request for numbers stands after its first look at the lease.
pub(super) enum Begun {
    /// The lease had every number: `got`, not handed out yet.
    Complete(Arc<Holder>, Vec<i64>),
    /// A lease is on its way; `got` holds what there was.
    Waiting(Arc<Holder>, Vec<i64>),
    /// No lease is coming (or leases are off): `got` (maybe empty) is all
    /// the lease gives; the ticket is kept until the rest is popped.
    Alone(Option<Arc<Holder>>, Vec<i64>, Option<OnItsOwn>),
}

/// A document's outcome on the lease.
pub(super) enum OnLease {
    Written(Result<(OutboxRow, DateTime<Utc>), IssueError>),
    /// No lease serves the sequence now: the document goes on its own,
    /// keeping the ticket (if any) until its number is popped.
    NotServed(Option<OnItsOwn>),
}

/// How much sooner than the lease's expiry in the ledger its holder stops
/// handing out its numbers: room for its clock running a little fast
/// against Postgres' (the deadline is counted from before the lease was
/// even sent, so the statement's time is later still).
const DEADLINE_MARGIN: Duration = Duration::from_millis(500);

/// The most numbers one lease of `holder`'s pool may carry.
fn pool_size(holder: &Holder) -> usize {
    holder.pool.sequence.definition.pool_size as usize
}

/// The lease path: the store of this instance's leases, the reporter of
/// what they hand out, and the shared commit that writes documents on
/// leased numbers.
pub(super) struct LeasePath {
    leases: Arc<Leases>,
    handouts: Arc<Handouts>,
    shared: SharedCommit,
    pools: Arc<PoolService>,
}

impl LeasePath {
    pub(super) fn new(
        leases: Arc<Leases>,
        handouts: Arc<Handouts>,
        shared: SharedCommit,
        pools: Arc<PoolService>,
    ) -> Self {
        Self {
            leases,
            handouts,
            shared,
            pools,
        }
    }

    fn holder(&self, placement: &Arc<Placement>) -> Arc<Holder> {
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
    /// handing the next lease to `order` if one is due.
    pub(super) fn begin(
        &self,
        placement: &Arc<Placement>,
        count: usize,
        order: impl FnOnce(Order),
    ) -> Begun {
        if !self.leases.enabled() {
            return Begun::Alone(None, Vec::new(), None);
        }
        let holder = self.holder(placement);
        let mut got = Vec::with_capacity(count);
        let (progress, next) = self
            .leases
            .take(&holder, count, pool_size(&holder), &mut got, true);
        if let Some(next) = next {
            order(next);
        }
        match progress {
            LeaseProgress::Complete => Begun::Complete(holder, got),
            LeaseProgress::Waiting => Begun::Waiting(holder, got),
            LeaseProgress::Alone(on_its_own) => Begun::Alone(Some(holder), got, Some(on_its_own)),
        }
    }

    /// Waits for the lease on its way until `got` holds `count` numbers;
    /// an error when none is coming after all (see [`crate::lease::Leases::fill`]).
    pub(super) async fn wait(
        &self,
        holder: &Arc<Holder>,
        count: usize,
        got: &mut Vec<i64>,
        order: impl FnMut(Order),
    ) -> Result<(), Option<OnItsOwn>> {
        self.leases
            .fill(holder, count, pool_size(holder), got, order)
            .await
    }

    /// Puts numbers taken from `holder` back, unanswered.
    pub(super) fn put_back(&self, holder: &Holder, seqs: Vec<i64>) {
        self.leases.put_back(holder, seqs);
    }

    /// Once the requests on their own of `holder` have their numbers, the
    /// moment before `order`'s lease is sent; the instant until which the
    /// lease's numbers may be handed out.
    pub(super) async fn before_taking(&self, order: &Order) -> Instant {
        self.leases.after_those_on_their_own(&order.holder).await;
        // Before the lease is sent: its expiry in the ledger is later.
        Instant::now() + LEASE_TTL - DEADLINE_MARGIN
    }

    /// `order`'s lease arrived with `leased` (none: it failed).
    pub(super) fn arrived(&self, order: &Order, leased: Vec<i64>, until: Instant) {
        self.leases
            .arrived(&order.holder, (!leased.is_empty()).then_some(leased), until);
    }

    /// Hands `seqs` to the caller: the lease's ledger row covers them, so
    /// the answer goes out at once; which numbers went out is written in
    /// the background (`handouts.rs`). A request withdrawn at its deadline
    /// (it was answered 503 already) gets none: they go back.
    pub(super) fn hand_out(&self, holder: &Holder, seqs: Vec<i64>) -> Result<Vec<i64>, IssueError> {
        if seqs.is_empty() {
            return Ok(seqs);
        }
        if !crate::infra::commitment::Commitment::begin_send_current() {
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
    pub(super) async fn document(
        &self,
        placement: &Arc<Placement>,
        attachment: &Arc<Attachment>,
        mut order: impl FnMut(Order),
    ) -> OnLease {
        let (holder, mut got) = match self.begin(placement, 1, &mut order) {
            Begun::Complete(holder, got) => (holder, got),
            Begun::Waiting(holder, mut got) => {
                if let Err(on_its_own) = self.wait(&holder, 1, &mut got, order).await {
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
            .shared
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
    async fn not_written(&self, holder: &Holder, seq: i64, reusable: bool) {
        if reusable {
            self.leases.put_back(holder, vec![seq]);
            return;
        }
        let placement = &holder.pool;
        self.pools
            .discards()
            .record_discard(
                &placement.sequence,
                placement.period.key(),
                &[SeqRange::single(seq)],
                DiscardCause::DocumentNotWritten,
            )
            .await;
    }
}
