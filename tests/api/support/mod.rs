//! What the tests share, apart from the tests: the instance under test
//! and its clients (`app`), the Redis, Postgres and Patroni servers tests
//! start, stop and cut off, the stalling proxy and the refusing gate, the traffic generators
//! and the webhook target.

pub mod app;
pub mod endpoint;
pub mod gate;
pub mod patroni;
pub mod probes;
pub mod redis_server;
pub mod stall;
pub mod topology;
pub mod traffic;
pub mod webhook;
