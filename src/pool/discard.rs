//! Why numbers left a pool without being issued (`pool_discards.cause`).

/// The word stored in `pool_discards.cause` and logged.
#[derive(Debug, Clone, Copy, PartialEq, Eq, sqlx::Type, strum::IntoStaticStr, strum::Display)]
#[sqlx(type_name = "text", rename_all = "snake_case")]
#[strum(serialize_all = "snake_case")]
pub enum DiscardCause {
    /// The sequence's `max` was lowered below numbers in the pool.
    AboveMax,
    /// The refill lock expired before the block was pushed.
    RefillLockLost,
    /// Pushing a refilled block to Redis failed.
    PushFailed,
    /// Numbers a request did not use could not be pushed back.
    GiveBackFailed,
    /// The pool's list held numbers the ledger had already recorded.
    StaleList,
    /// The sequence's definition changed; its pools were emptied.
    DefinitionChanged,
    /// The pool's period ended; reconciliation closed it.
    PeriodEnded,
    /// Pools filled before Redis came back were emptied.
    RedisReconnect,
    /// Postgres was found behind Redis (a failover); its pools were emptied.
    PostgresBehindRedis,
    /// A lease's numbers this instance did not hand out, which could not be
    /// taken off the ledger to go back to their pool.
    LeaseReturned,
    /// A leased number whose document's outbox row was not written (or
    /// whether it was is unknown): never handed out again.
    DocumentNotWritten,
}

#[cfg(test)]
mod tests {
    use super::DiscardCause;

    #[test]
    fn causes_keep_the_words_already_stored() {
        assert_eq!(DiscardCause::AboveMax.to_string(), "above_max");
        assert_eq!(
            DiscardCause::PostgresBehindRedis.to_string(),
            "postgres_behind_redis"
        );
        let word: &str = DiscardCause::GiveBackFailed.into();
        assert_eq!(word, "give_back_failed");
    }
}
