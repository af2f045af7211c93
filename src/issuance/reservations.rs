//! Reservations of gapless sequences after they are made: voided by
//! their caller, or by the expiry sweep once their deadline passed.

use std::sync::Arc;

use chrono::{DateTime, SubsecRound, Utc};

use crate::domain::clock::Clock;
use crate::domain::sequence::{Numbering, ProjectCode, Sequence, TypeCode};
use crate::infra::db::{Db, Tx};
use crate::infra::stats::Stats;
use crate::records::ledger::outbox_rows::carries_id;
use crate::records::ledger::reservations::{self, ReservationStatus};
use crate::records::sequence_store::{SequenceStore, StoreError};

/// Voids and the expiry sweep.
pub struct Reservations {
    sequences: Arc<SequenceStore>,
    clock: Arc<dyn Clock>,
    stats: Arc<Stats>,
    /// The sweep's.
    background_db: Db,
    /// How long a reservation waits for its document.
    reservation_ttl: std::time::Duration,
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

/// Most reservations one sweep statement voids (the sweep goes on while
/// it finds this many).
const SWEEP_BATCH: i64 = 1000;

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

impl Reservations {
    pub(super) fn new(
        sequences: Arc<SequenceStore>,
        clock: Arc<dyn Clock>,
        stats: Arc<Stats>,
        background_db: Db,
        reservation_ttl: std::time::Duration,
    ) -> Self {
        Self {
            sequences,
            clock,
            stats,
            background_db,
            reservation_ttl,
        }
    }

    /// The reservation `id` would be, found before the caller's
    /// transaction: reading a definition may need a connection of its own,
    /// and a request holding one while it waits for another can starve
    /// them all (every void of an instance once timed out so).
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
        if sequence.definition.register.issuer().is_some() {
            // A VERI*FACTU register numbers documents only; voiding one
            // appends its anulación record.
            return annul(conn, sequence, id, reason)
                .await?
                .ok_or_else(not_found);
        }
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

    /// Voids reservations whose deadline passed, as `reservation_expired`,
    /// until `stop`: whichever instance's sweep reaches one first, once.
    /// Looks every second, or sooner with a short deadline.
    pub async fn expire_reservations(&self, stop: tokio_util::sync::CancellationToken) {
        let pause = (self.reservation_ttl / 4).clamp(
            std::time::Duration::from_millis(50),
            std::time::Duration::from_secs(1),
        );
        // A failing sweep (Postgres away) looks again less and less often.
        let mut failures =
            crate::infra::retrying::Retrying::new("expired reservations could not be voided");
        loop {
            let wait =
                match reservations::expire_due(&self.background_db, self.clock.now(), SWEEP_BATCH)
                    .await
                {
                    Ok(n) => {
                        failures.succeeded();
                        self.stats.reservations_expired.inc_by(n);
                        if n as i64 == SWEEP_BATCH {
                            continue;
                        }
                        pause
                    }
                    Err(e) => failures.failed(&e).max(pause),
                };
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(wait) => {}
            }
        }
    }
}

/// The anulación of VERI*FACTU document `id`: appended now, or the one
/// appended before (a void answers the same again). None when the ID
/// carries no document of the sequence.
async fn annul(
    conn: &mut Tx<'_>,
    sequence: &Sequence,
    id: &str,
    reason: &str,
) -> Result<Option<Voided>, VoidError> {
    let voided = |(reason, voided_at): (String, DateTime<Utc>)| Voided {
        id: id.to_owned(),
        reason,
        voided_at,
    };
    if let Some(earlier) = reservations::annulment(&mut *conn, sequence.id, id).await? {
        return Ok(Some(voided(earlier)));
    }
    if let Some(at) = reservations::annul(&mut *conn, sequence.id, id, reason).await? {
        return Ok(Some(voided((reason.to_owned(), at))));
    }
    // Annulled meanwhile by a concurrent void, or no document of it.
    Ok(reservations::annulment(&mut *conn, sequence.id, id)
        .await?
        .map(voided))
}
