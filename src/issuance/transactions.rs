//! Numbers popped from a pool into a request's transaction: if that
//! transaction surely does not commit (its work failed, it was withdrawn
//! at its deadline, its `COMMIT` was refused or looked up and not found),
//! nobody received them, and they go back to their pool rather than being
//! lost as `untracked_loss`. Numbers reserved straight from the counter in
//! the transaction need nothing: the counter rolls back with it.

use std::sync::{Arc, Mutex};

use crate::infra::db::{Answered, Db, Tx, Witness};
use crate::records::pool::{DiscardCause, PoolRef, PoolService};

/// Numbers popped into the current transaction, and those of them that
/// must never go back: the ID one prints is another document's.
#[derive(Default)]
struct Taken {
    popped: Vec<(PoolRef, Vec<i64>)>,
    never_again: Vec<(i64, String, i64)>,
    all_never_again: bool,
}

type PoppedNote = Arc<Mutex<Taken>>;

tokio::task_local! {
    static POPPED: PoppedNote;
}

/// Notes `seqs`, popped from `pool` and recorded in the transaction the
/// current task runs through [`Transactions::run`] (none outside one).
pub(super) fn popped_into_transaction(pool: &PoolRef, seqs: Vec<i64>) {
    if seqs.is_empty() {
        return;
    }
    let _ = POPPED.try_with(|popped| {
        popped
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .popped
            .push((pool.clone(), seqs));
    });
}

/// Takes `refused` (numbers of `pool` the ledger says another holds) off
/// what [`popped_into_transaction`] noted: they never go back to the pool.
pub(super) fn refused_in_transaction(pool: &PoolRef, refused: &[i64]) {
    if refused.is_empty() {
        return;
    }
    let _ = POPPED.try_with(|popped| {
        let mut taken = popped.lock().unwrap_or_else(|e| e.into_inner());
        for (noted, seqs) in taken.popped.iter_mut() {
            if noted.keys.pool == pool.keys.pool {
                seqs.retain(|seq| !refused.contains(seq));
            }
        }
    });
}

/// Number `seq` of sequence `sequence_id` in `period` prints an ID another
/// document holds: whatever becomes of the current transaction, it never
/// goes back to its pool (it would print that ID again); `None` for every
/// number of it (which one is not known).
pub fn never_reuse(number: Option<(i64, &str, i64)>) {
    let _ = POPPED.try_with(|popped| {
        let mut taken = popped.lock().unwrap_or_else(|e| e.into_inner());
        match number {
            Some((sequence_id, period, seq)) => {
                taken
                    .never_again
                    .push((sequence_id, period.to_owned(), seq))
            }
            None => taken.all_never_again = true,
        }
    });
}

/// Requests' transactions, on the requests' pool.
pub(super) struct Transactions {
    db: Db,
    pools: Arc<PoolService>,
}

impl Transactions {
    pub(super) fn new(db: Db, pools: Arc<PoolService>) -> Self {
        Self { db, pools }
    }

    /// `work` in a transaction whose commit answers a request
    /// (`db::answer_in_transaction`: an error means nothing was written);
    /// numbers it popped from pools go back to them when it surely did not
    /// commit.
    pub(super) async fn run<T, E>(
        &self,
        witness: &impl Witness,
        work: impl AsyncFnOnce(&mut Tx<'_>) -> Result<T, E>,
    ) -> Result<T, E>
    where
        E: From<sqlx::Error> + From<crate::infra::commitment::NotAnswered>,
    {
        let popped: PoppedNote = Arc::default();
        let answered = POPPED
            .scope(
                popped.clone(),
                crate::infra::db::answer_in_transaction(&self.db, witness, work),
            )
            .await;
        if let Answered::NotWritten(_) = &answered {
            let taken = std::mem::take(&mut *popped.lock().unwrap_or_else(|e| e.into_inner()));
            for (pool, seqs) in taken.popped {
                let (sequence_id, period) = (pool.sequence.id, pool.period.key());
                let (never, back): (Vec<i64>, Vec<i64>) = seqs.into_iter().partition(|seq| {
                    taken.all_never_again
                        || taken
                            .never_again
                            .iter()
                            .any(|(s, p, n)| *s == sequence_id && p == period && n == seq)
                });
                self.pools.discards().return_unissued(&pool, &back).await;
                if !never.is_empty() {
                    self.pools
                        .discards()
                        .record_discard(
                            &pool.sequence,
                            period,
                            &crate::domain::numbers::runs(&never),
                            DiscardCause::DocumentNotWritten,
                        )
                        .await;
                }
            }
        }
        answered.into_result()
    }
}
