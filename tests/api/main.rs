//! End-to-end tests against real Postgres and Redis.

mod auth;
mod clients;
mod config;
mod documents;
mod failover;
mod gapless;
mod gaps;
mod ha;
mod helpers;
mod hostile;
mod ids;
mod import;
mod inputs;
mod isolation;
mod leases;
mod operations;
mod patroni;
mod pooler;
mod pools;
mod redis_server;
mod resilience;
mod sequences;
mod topology;
mod traffic;
mod webhook;
