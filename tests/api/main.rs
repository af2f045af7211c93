//! End-to-end tests against real Postgres and Redis.

mod answers;
mod auth;
mod clients;
mod config;
mod connections;
mod database;
mod deliveries;
mod documents;
mod endpoints;
mod failover;
mod gapless;
mod gaps;
mod ha;
mod ids;
mod import;
mod inputs;
mod leases;
mod operations;
mod pooler;
mod pools;
mod registers;
mod resilience;
mod sequences;
mod support;
