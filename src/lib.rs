//! idpool: tenant-formatted sequential IDs from Redis pools over a Postgres
//! counter of record.
//!
//! One folder per layer, highest first; a module uses only its own layer
//! and those below (ARCHITECTURE.md; `make lint` checks it).

#![forbid(unsafe_code)]

pub mod domain;
pub mod edge;
pub mod features;
pub mod infra;
pub mod issuance;
pub mod records;
