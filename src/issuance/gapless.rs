//! Gapless sequences: numbers taken from the counter inside the
//! transaction that writes their documents (or records their
//! reservations), never from a pool or a lease. A transaction that rolls
//! back gives its numbers back, so every number that exists is a document
//! or a reservation.

use std::sync::Arc;
use std::time::Duration;

use crate::db::Tx;
use chrono::{DateTime, SubsecRound, Utc};
use tokio::time::Instant;

use super::pipeline::{Demand, Served};
use super::{IssueError, Issued, Issuer, Want};
use crate::counter::Reserved;
use crate::ledger::outbox::{Attachment, carries_id};
use crate::ledger::reservations::{self, NewReservations, ReservationStatus};
use crate::ledger::{LedgerError, Via};
use crate::pool::Placement;
use crate::sequence::{Numbering, ProjectCode, Sequence, TypeCode};
use crate::sequence_store::StoreError;

/// Most reservations a gapless sequence holds open (neither confirmed nor
/// voided) at once.
pub const MAX_OPEN_RESERVATIONS: i64 = 1_000;

/// How long a document waits, in all, for its gapless counter held by
/// another transaction before it is answered 503: longer than a large
/// batch of the same sequence takes to commit.
const HELD_COUNTER_PATIENCE: Duration = Duration::from_secs(2);

impl Issuer {
    /// The shared path for a gapless sequence: a document numbered in the
    /// shared commit that writes it; numbers for `POST /ids` reserved in a
    /// transaction of their own.
    pub(super) async fn issue_gapless(
        self: &Arc<Self>,
        placement: Arc<Placement>,
        want: Want,
    ) -> Result<Issued, IssueError> {
        let issuer = self.clone();
        self.detached(async move {
            match want {
                Want::Document { attachment } => {
                    let served = match issuer
                        .document_in_shared_commit(&placement, attachment)
                        .await
                    {
                        Ok(served) => served,
                        Err(e) => return Err(issuer.gapless_error(&placement, 1, e).await),
                    };
                    let (row, created_at) = served.document.ok_or(LedgerError::Closed)?;
                    issuer.stats.ids_direct.inc();
                    Ok(Issued {
                        placement,
                        seqs: vec![row.seq],
                        document: Some((row, created_at)),
                        reserved_until: None,
                    })
                }
                Want::Ids { count } => {
                    issuer
                        .transaction(async |tx| {
                            issuer.gapless_in(tx, &placement, count, Via::Ids).await
                        })
                        .await
                }
            }
        })
        .await?
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
                .pipeline
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
    pub(super) async fn gapless_in(
        &self,
        conn: &mut Tx<'_>,
        placement: &Arc<Placement>,
        count: usize,
        via: Via,
    ) -> Result<Issued, IssueError> {
        let (sequence, period) = (&placement.sequence, &placement.period);
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
            LedgerError::Exhausted => self.exhausted(pool, count),
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

/// What a void names, resolved before its transaction.
#[derive(Debug, Clone)]
pub struct VoidTarget {
    sequence: Arc<Sequence>,
    seq: i64,
    id: String,
    /// `PROJECT/TYPE`, for the not-found answer.
    name: String,
}

/// A reservation voided (now, or earlier: a void answers the same again).
#[derive(Debug)]
pub struct Voided {
    pub id: String,
    /// The caller's reason, or `reservation_expired`.
    pub reason: String,
    pub voided_at: DateTime<Utc>,
}

#[derive(Debug, thiserror::Error)]
pub enum VoidError {
    /// No reservation of a gapless sequence prints this ID (another
    /// tenant's IDs get this too: nothing tells them apart).
    #[error("{id} is not an ID reserved by POST /ids for {sequence}")]
    NotFound { id: String, sequence: String },
    #[error("{0} carries a document; a document's number is never voided")]
    Attached(String),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Db(#[from] sqlx::Error),
}

impl Issuer {
    /// The reservation `id` would be, found before the caller's
    /// transaction: reading a definition may need a connection of its own,
    /// and a request holding one while it waits for another can starve
    /// them all (hostile review: every void of an instance timing out).
    pub async fn void_target(
        &self,
        project: &ProjectCode,
        doc_type: &TypeCode,
        id: &str,
    ) -> Result<VoidTarget, VoidError> {
        let name = format!("{project}/{doc_type}");
        let not_found = || VoidError::NotFound {
            id: id.to_owned(),
            sequence: name.clone(),
        };
        let sequence = self
            .sequences
            .get(project.as_str(), doc_type.as_str())
            .await?
            .filter(|s| s.definition.numbering == Numbering::Gapless)
            .ok_or_else(not_found)?;
        let seq = sequence.seq_of(id).ok_or_else(not_found)?;
        Ok(VoidTarget {
            sequence,
            seq,
            id: id.to_owned(),
            name,
        })
    }

    /// Voids the reservation of `id` on the gapless sequence
    /// `project`/`doc_type` with the caller's `reason`, in the caller's
    /// transaction. A reservation past its deadline is voided as
    /// `reservation_expired`, as the sweep would; one voided before
    /// answers as it was voided.
    pub async fn void_in(
        &self,
        conn: &mut Tx<'_>,
        target: &VoidTarget,
        reason: &str,
    ) -> Result<Voided, VoidError> {
        let VoidTarget {
            sequence,
            seq,
            id,
            name,
        } = target;
        let (seq, id) = (*seq, id.as_str());
        let not_found = || VoidError::NotFound {
            id: id.to_owned(),
            sequence: name.clone(),
        };
        let Some(reservation) = reservations::lock(&mut *conn, sequence.id, seq, id).await? else {
            // A document numbered when it was written.
            return Err(if carries_id(&mut *conn, sequence.id, id).await? {
                VoidError::Attached(id.to_owned())
            } else {
                not_found()
            });
        };
        let earlier = |reservation: &reservations::Reservation| Voided {
            id: id.to_owned(),
            reason: reservation
                .reason
                .clone()
                .unwrap_or_else(|| ReservationStatus::ReservationExpired.as_str().to_owned()),
            voided_at: reservation.voided_at.unwrap_or(reservation.reserved_until),
        };
        let now = self.clock.now().trunc_subsecs(6);
        let (status, note) = match reservation.status {
            ReservationStatus::Confirmed => return Err(VoidError::Attached(id.to_owned())),
            ReservationStatus::Voided | ReservationStatus::ReservationExpired => {
                return Ok(earlier(&reservation));
            }
            ReservationStatus::Reserved if reservation.reserved_until <= now => {
                (ReservationStatus::ReservationExpired, None)
            }
            ReservationStatus::Reserved => (ReservationStatus::Voided, Some(reason)),
        };
        let voided_at =
            reservations::void(&mut *conn, sequence.id, &reservation, status, note, now).await?;
        Ok(Voided {
            id: id.to_owned(),
            reason: note.unwrap_or(status.as_str()).to_owned(),
            voided_at,
        })
    }
}

/// Most reservations one sweep statement voids (the sweep goes on while
/// it finds this many).
const SWEEP_BATCH: i64 = 1000;

impl Issuer {
    /// Voids reservations whose deadline passed, as `reservation_expired`,
    /// until `stop`: whichever instance's sweep reaches one first, once.
    /// Looks every second, or sooner with a short deadline.
    pub async fn expire_reservations(self: Arc<Self>, stop: tokio_util::sync::CancellationToken) {
        let pause = (self.reservation_ttl / 4).clamp(
            std::time::Duration::from_millis(50),
            std::time::Duration::from_secs(1),
        );
        let failures = crate::log_limit::Repeated::new("expired reservations could not be voided");
        loop {
            match reservations::expire_due(&self.background_db, self.clock.now(), SWEEP_BATCH).await
            {
                Ok(n) => {
                    self.stats.reservations_expired.inc_by(n);
                    if n as i64 == SWEEP_BATCH {
                        continue;
                    }
                }
                Err(e) => failures.warn(&e),
            }
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(pause) => {}
            }
        }
    }
}
