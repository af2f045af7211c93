//! What every layer may use: database links, telemetry, supervision, fairness, limits.

pub mod backoff;
pub mod coalesce;
pub mod commitment;
pub mod db;
pub mod fair;
pub mod listen;
pub mod log_limit;
pub mod redact;
pub mod retrying;
pub mod stats;
pub mod supervise;
pub mod telemetry;
