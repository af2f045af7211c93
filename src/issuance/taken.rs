//! Numbers popped from a pool into a request's transaction: if that
//! transaction surely does not commit (its work failed, it was withdrawn
//! at its deadline, its `COMMIT` was refused or looked up and not found),
//! nobody received them, and they go back to their pool rather than being
//! lost as `untracked_loss`. Numbers reserved straight from the counter in
//! the transaction need nothing: the counter rolls back with it.

use std::sync::{Arc, Mutex};

use super::Issuer;
use crate::db::{Answered, Tx};
use crate::pool::PoolRef;

type Popped = Arc<Mutex<Vec<(PoolRef, Vec<i64>)>>>;

tokio::task_local! {
    static POPPED: Popped;
}

/// Notes `seqs`, popped from `pool` and recorded in the transaction the
/// current task runs through [`Issuer::transaction`] (none outside one).
pub(super) fn popped_into_transaction(pool: &PoolRef, seqs: Vec<i64>) {
    if seqs.is_empty() {
        return;
    }
    let _ = POPPED.try_with(|popped| {
        popped
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push((pool.clone(), seqs));
    });
}

impl Issuer {
    /// `work` in a transaction whose commit answers a request
    /// (`db::answer_in_transaction`: an error means nothing was written);
    /// numbers it popped from pools go back to them when it surely did not
    /// commit.
    pub async fn transaction<T, E>(
        &self,
        work: impl AsyncFnOnce(&mut Tx<'_>) -> Result<T, E>,
    ) -> Result<T, E>
    where
        E: From<sqlx::Error> + From<crate::commitment::NotAnswered>,
    {
        let popped: Popped = Arc::default();
        let answered = POPPED
            .scope(
                popped.clone(),
                crate::db::answer_in_transaction(&self.db, work),
            )
            .await;
        if let Answered::NotWritten(_) = &answered {
            let popped = std::mem::take(&mut *popped.lock().unwrap_or_else(|e| e.into_inner()));
            for (pool, seqs) in popped {
                self.pools.return_unissued(&pool, &seqs).await;
            }
        }
        answered.into_result()
    }
}
