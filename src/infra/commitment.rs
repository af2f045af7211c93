//! Whether a request has committed to its write: the line between an answer
//! that may still be withdrawn (an error, nothing written) and one that
//! must wait for its write's true outcome.
//!
//! Every request runs with a [`Commitment`] (the edge sets it for the
//! request's task; [`scope_detached`] carries it into the work detached
//! from the client). A write asks [`Commitment::begin_send`] just before
//! its statement or `COMMIT` leaves for Postgres: once it has, the request
//! is never answered with an error for a timeout, because the write may
//! land. At the request's deadline the edge asks
//! [`Commitment::withdraw`]: granted only while nothing was sent, and from
//! then on every write of the request is refused before it is sent. A
//! write that surely did not land ([`Commitment::not_written`]) makes the
//! request withdrawable again.
//!
//! Work outside any request (a lease being taken, background jobs) has no
//! commitment and is never withdrawn.

use std::future::Future;
use std::sync::{Arc, Mutex};

#[derive(Debug, Default)]
struct State {
    withdrawn: bool,
    /// Writes sent that may have landed.
    possibly_written: u32,
}

/// One request's commitment; see the module's documentation.
#[derive(Debug, Default)]
pub struct Commitment {
    state: Mutex<State>,
}

/// Why a request got no answer from its write.
#[derive(Debug, Clone, thiserror::Error)]
pub enum NotAnswered {
    /// Its deadline passed before its write was sent: nothing was written.
    #[error("the request was withdrawn at its deadline before anything was written")]
    Withdrawn,
    /// Its write was sent and Postgres did not say, in all the time it was
    /// waited for, whether it landed.
    #[error("whether the write landed is unknown: {0}")]
    Unknown(String),
}

tokio::task_local! {
    static CURRENT: Arc<Commitment>;
}

impl Commitment {
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A write is about to be sent: false (send nothing) once the request
    /// was withdrawn.
    pub fn begin_send(&self) -> bool {
        let mut state = self.state();
        if state.withdrawn {
            return false;
        }
        state.possibly_written += 1;
        true
    }

    /// A write sent surely did not land.
    pub fn not_written(&self) {
        let mut state = self.state();
        state.possibly_written = state.possibly_written.saturating_sub(1);
    }

    /// Withdraws the request unless a write of it may have landed; whether
    /// it is withdrawn.
    pub fn withdraw(&self) -> bool {
        let mut state = self.state();
        if state.possibly_written > 0 {
            return false;
        }
        state.withdrawn = true;
        true
    }

    /// The commitment of the request this task serves, if any.
    pub fn current() -> Option<Arc<Commitment>> {
        CURRENT.try_with(|c| c.clone()).ok()
    }

    /// Asks the current request's commitment before sending a write; true
    /// outside any request.
    pub fn begin_send_current() -> bool {
        Self::current().is_none_or(|c| c.begin_send())
    }

    /// Runs `work` as serving the request of `commitment`.
    pub async fn scope<T>(commitment: Arc<Commitment>, work: impl Future<Output = T>) -> T {
        CURRENT.scope(commitment, work).await
    }
}

/// `work`, to be spawned away from the client's task, keeping the
/// commitment of the request that spawns it (if any).
pub fn scope_detached<T>(
    work: impl Future<Output = T> + Send + 'static,
) -> impl Future<Output = T> + Send + 'static {
    let commitment = Commitment::current();
    async move {
        match commitment {
            Some(commitment) => CURRENT.scope(commitment, work).await,
            None => work.await,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_is_withdrawn_only_while_nothing_it_sent_may_have_landed() {
        let commitment = Commitment::new();
        assert!(commitment.begin_send());
        assert!(!commitment.withdraw(), "a write was sent");
        commitment.not_written();
        assert!(commitment.withdraw(), "the write surely did not land");
        assert!(!commitment.begin_send(), "withdrawn: nothing more is sent");
    }

    #[tokio::test]
    async fn detached_work_keeps_the_request_s_commitment() {
        let commitment = Commitment::new();
        let seen = Commitment::scope(commitment.clone(), async {
            tokio::spawn(scope_detached(async { Commitment::current() }))
                .await
                .unwrap()
        })
        .await;
        assert!(seen.is_some_and(|c| Arc::ptr_eq(&c, &commitment)));
        assert!(Commitment::current().is_none());
    }
}
