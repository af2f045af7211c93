//! Gapless sequences: numbers taken from the counter inside the
//! transaction that writes their documents (or records their
//! reservations), never from a pool or a lease. A transaction that rolls
//! back gives its numbers back, so every number that exists is a document
//! or a reservation.

use std::sync::Arc;
use std::time::Duration;

use crate::infra::db::Tx;
use chrono::{DateTime, SubsecRound, Utc};
use tokio::time::Instant;

use super::shared_commit::{Demand, Served, SharedCommit};
use super::{IssueError, Issued, Placement};
use crate::domain::clock::Clock;
use crate::infra::stats::Stats;
use crate::records::counter::{Counter, Reserved};
use crate::records::ledger::outbox_rows::{Attachment, OutboxRow};
use crate::records::ledger::reservations::{self, NewReservations};
use crate::records::ledger::{LedgerError, Via};
use crate::records::sequence_store::SequenceStore;

/// Most reservations a gapless sequence holds open (neither confirmed nor
/// voided) at once.
pub const MAX_OPEN_RESERVATIONS: i64 = 1_000;

/// How long a document waits, in all, for its gapless counter held by
/// another transaction before it is answered 503: longer than a large
/// batch of the same sequence takes to commit.
const HELD_COUNTER_PATIENCE: Duration = Duration::from_secs(2);

/// The gapless path: numbers taken from the counter in the commit that
/// writes what they are for.
pub(super) struct GaplessPath {
    shared: SharedCommit,
    counter: Arc<Counter>,
    sequences: Arc<SequenceStore>,
    clock: Arc<dyn Clock>,
    stats: Arc<Stats>,
    /// How long a reservation waits for its document.
    reservation_ttl: Duration,
}

impl GaplessPath {
    pub(super) fn new(
        shared: SharedCommit,
        counter: Arc<Counter>,
        sequences: Arc<SequenceStore>,
        clock: Arc<dyn Clock>,
        stats: Arc<Stats>,
        reservation_ttl: Duration,
    ) -> Self {
        Self {
            shared,
            counter,
            sequences,
            clock,
            stats,
            reservation_ttl,
        }
    }

    /// A document numbered in the shared commit that writes it.
    pub(super) async fn document(
        &self,
        placement: &Arc<Placement>,
        attachment: Arc<Attachment>,
    ) -> Result<(OutboxRow, DateTime<Utc>), IssueError> {
        let served = match self.document_in_shared_commit(placement, attachment).await {
            Ok(served) => served,
            Err(e) => return Err(self.gapless_error(placement, 1, e).await),
        };
        let document = served.document.ok_or(LedgerError::Closed)?;
        self.stats.ids_direct.inc();
        Ok(document)
    }

    /// A document numbered in the gapless write stage's next commit. While
    /// another transaction holds its counter (a batch of the same
    /// sequence, another instance's commit) the commit goes on without it
    /// and it tries again in a later one, for a while: the wait is its
    /// sequence's alone.
    async fn document_in_shared_commit(
        &self,
        placement: &Arc<Placement>,
        attachment: Arc<Attachment>,
    ) -> Result<Served, LedgerError> {
        let deadline = Instant::now() + HELD_COUNTER_PATIENCE;
        let mut pause = Duration::from_millis(2);
        loop {
            let demand = Demand::Gapless {
                attachment: attachment.clone(),
            };
            match self
                .shared
                .record(placement.clone(), demand, Vec::new())
                .await
            {
                Err(LedgerError::CounterHeld) => {
                    self.stats.gapless_counter_held.inc();
                    if Instant::now() + pause >= deadline {
                        return Err(LedgerError::CounterHeld);
                    }
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_millis(50));
                }
                served => return served,
            }
        }
    }

    /// `count` numbers of a gapless sequence taken in the caller's
    /// transaction (the counter row stays locked until it ends). For
    /// `POST /ids` they are reserved, in the same transaction, until the
    /// deadline.
    pub(super) async fn issue_in(
        &self,
        conn: &mut Tx<'_>,
        placement: &Arc<Placement>,
        count: usize,
        via: Via,
    ) -> Result<Issued, IssueError> {
        let (sequence, period) = (&placement.sequence, &placement.period);
        if via == Via::Ids && sequence.definition.register.issuer().is_some() {
            return Err(IssueError::ReservationsNotAllowed {
                project: sequence.project.to_string(),
                doc_type: sequence.doc_type.to_string(),
            });
        }
        let taken = self
            .counter
            .take_gapless(&mut *conn, sequence, period, count as i64)
            .await?;
        let range = match taken {
            Reserved::Got(range) => range,
            Reserved::Exhausted => {
                return Err(self
                    .gapless_error(placement, count, LedgerError::Exhausted)
                    .await);
            }
            Reserved::Stale | Reserved::Unfenced => {
                return Err(self
                    .gapless_error(placement, count, LedgerError::DefinitionChanged)
                    .await);
            }
        };
        self.stats.ids_direct.inc_by(count as u64);
        let mut issued = Issued::numbers_of(placement.clone(), range.iter().collect());
        if via == Via::Ids {
            // Reservations are kept for good (the register's record): one
            // sequence holds a bounded number open at once. Counted under
            // the counter's lock, so a period's reservations queue here.
            let open =
                reservations::open_count(&mut *conn, sequence.id, MAX_OPEN_RESERVATIONS).await?;
            if open + count as i64 > MAX_OPEN_RESERVATIONS {
                return Err(IssueError::TooManyReservations {
                    project: sequence.project.to_string(),
                    doc_type: sequence.doc_type.to_string(),
                    open,
                    asked: count as i64,
                    max: MAX_OPEN_RESERVATIONS,
                });
            }
            // Microseconds, as Postgres keeps them: the answer says what
            // the record says.
            let reserved_at = self.clock.now().trunc_subsecs(6);
            let ttl =
                chrono::Duration::from_std(self.reservation_ttl).unwrap_or(chrono::Duration::MAX);
            let reserved_until = reserved_at + ttl;
            let ids = issued.ids();
            let new = NewReservations {
                sequence_id: sequence.id,
                period: period.key(),
                seqs: &issued.seqs,
                ids: &ids,
                reserved_at,
                reserved_until,
            };
            reservations::insert(&mut *conn, &new).await?;
            issued.reserved_until = Some(reserved_until);
        }
        Ok(issued)
    }

    /// What a refusal of a gapless counter means to the caller.
    async fn gapless_error(
        &self,
        placement: &Placement,
        count: usize,
        e: LedgerError,
    ) -> IssueError {
        let pool = &placement.pool;
        match e {
            LedgerError::Exhausted => IssueError::exhausted(pool, count),
            LedgerError::DefinitionChanged => {
                self.sequences.forget(&pool.sequence).await;
                IssueError::DefinitionChanged {
                    project: pool.sequence.project.to_string(),
                    doc_type: pool.sequence.doc_type.to_string(),
                }
            }
            e => e.into(),
        }
    }
}
