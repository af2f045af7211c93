//! idpool: tenant-formatted sequential IDs from Redis pools over a Postgres
//! counter of record.

#![forbid(unsafe_code)]

pub mod auth;
pub mod backoff;
pub mod batch;
pub mod cli;
pub mod clock;
pub mod coalesce;
pub mod commitment;
pub mod config;
pub mod counter;
pub mod db;
pub mod documents;
pub mod fair;
pub mod gaps;
pub mod http;
pub mod idempotency;
pub mod import;
pub mod issuance;
pub mod json_number;
pub mod ledger;
pub mod listen;
pub mod log_limit;
pub mod numbers;
pub mod pool;
pub mod redact;
pub mod sequence;
pub mod sequence_store;
pub mod startup;
pub mod stats;
pub mod supervise;
pub mod telemetry;
pub mod text;
