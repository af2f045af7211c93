//! End-to-end tests against real Postgres and Redis.

mod answers;
mod auth;
mod clients;
mod config;
mod documents;
mod failover;
mod gapless;
mod gaps;
mod ha;
mod hostile;
mod ids;
mod import;
mod inputs;
mod isolation;
mod leases;
mod operations;
mod pooler;
mod pools;
mod resilience;
mod sequences;
mod support;
