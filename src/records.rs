//! What Postgres and Redis keep: the ledger, idempotency, definitions, keys, pools, counters.

pub mod auth;
pub mod batch;
pub mod counter;
pub mod idempotency;
pub mod ledger;
pub mod pool;
pub mod sequence_store;
