//! Configuration: every option an environment variable (SPEC names) and a
//! flag of the same name in kebab-case.

use std::time::Duration;

use clap::builder::TypedValueParser;
use clap::{Args, ValueEnum};

use crate::features::documents::sink::SinkConfig;
use crate::infra::redact::url_without_password;

/// Failures in a row that open an endpoint's circuit.
pub const ENDPOINT_CIRCUIT_AFTER: i32 = 5;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Switch {
    On,
    Off,
}

impl Switch {
    pub fn is_on(self) -> bool {
        self == Switch::On
    }
}

#[derive(Clone, Args)]
pub struct Config {
    /// Postgres; the database is created if it does not exist.
    #[arg(
        long = "database-url",
        env = "DATABASE_URL",
        value_name = "DATABASE_URL",
        hide_env_values = true,
        default_value = "postgres://postgres@127.0.0.1:5432/idpool"
    )]
    pub database_url: String,

    /// What sits between idpool and Postgres at `DATABASE_URL`: `none`,
    /// or a pooler in `session` or `transaction` mode (PgBouncer's
    /// `pool_mode`). Behind a pooler no statement, setting or lock outlives
    /// its transaction.
    #[arg(
        long = "idpool-pg-pooler",
        env = "IDPOOL_PG_POOLER",
        value_name = "IDPOOL_PG_POOLER",
        value_enum,
        default_value = "none"
    )]
    pub pg_pooler: crate::infra::db::Pooler,

    /// A connection straight to Postgres (not through a pooler) for
    /// listening to notifications. Without it, behind a pooler in
    /// transaction mode, idpool polls instead of listening.
    #[arg(
        long = "idpool-pg-listen-url",
        env = "IDPOOL_PG_LISTEN_URL",
        value_name = "IDPOOL_PG_LISTEN_URL",
        hide_env_values = true
    )]
    pub pg_listen_url: Option<String>,

    /// Redis; `redis-cluster://h1:p1?node=h2:p2` for a Redis Cluster.
    #[arg(
        long = "redis-url",
        env = "REDIS_URL",
        value_name = "REDIS_URL",
        hide_env_values = true,
        default_value = "redis://127.0.0.1:6379"
    )]
    pub redis_url: String,

    /// HTTP address to listen on.
    #[arg(
        long = "idpool-listen",
        visible_alias = "listen",
        env = "IDPOOL_LISTEN",
        value_name = "IDPOOL_LISTEN",
        default_value = "127.0.0.1:8080"
    )]
    pub listen: String,

    /// Apply migrations when `serve` starts.
    #[arg(
        long = "idpool-migrate",
        env = "IDPOOL_MIGRATE",
        value_name = "IDPOOL_MIGRATE",
        value_enum,
        default_value = "on"
    )]
    pub migrate: Switch,

    /// Prefix of every Redis key (several deployments can share one Redis).
    #[arg(
        long = "idpool-redis-prefix",
        env = "IDPOOL_REDIS_PREFIX",
        value_name = "IDPOOL_REDIS_PREFIX",
        default_value = "idpool",
        value_parser = redis_prefix,
    )]
    pub redis_prefix: String,

    /// Redis connections (commands on one are pipelined).
    #[arg(
        long = "idpool-redis-clients",
        env = "IDPOOL_REDIS_CLIENTS",
        value_name = "IDPOOL_REDIS_CLIENTS",
        default_value_t = 2,
        value_parser = clap::value_parser!(u64).range(1..=64).map(|n| n as usize),
    )]
    pub redis_clients: usize,

    /// Redis command timeout; past it the circuit opens and IDs come from Postgres.
    #[arg(
        long = "idpool-redis-timeout-ms",
        env = "IDPOOL_REDIS_TIMEOUT_MS",
        value_name = "IDPOOL_REDIS_TIMEOUT_MS",
        default_value_t = 1000,
        value_parser = clap::value_parser!(u64).range(1..=600_000),
    )]
    pub redis_timeout_ms: u64,

    /// How long `serve` waits at start for Redis before serving from
    /// Postgres alone (so the first requests take from the pools, in order).
    #[arg(
        long = "idpool-redis-start-wait-ms",
        env = "IDPOOL_REDIS_START_WAIT_MS",
        value_name = "IDPOOL_REDIS_START_WAIT_MS",
        default_value_t = 5000,
        value_parser = clap::value_parser!(u64).range(0..=600_000),
    )]
    pub redis_start_wait_ms: u64,

    /// Postgres connections of this instance, all told, shared out as
    /// `startup::ConnectionBudget` says (requests, the shared writers,
    /// outbox loops, other background work, refills, the notification
    /// listener); at least 10.
    #[arg(
        long = "idpool-db-pool-size",
        env = "IDPOOL_DB_POOL_SIZE",
        value_name = "IDPOOL_DB_POOL_SIZE",
        default_value_t = 12,
        value_parser = clap::value_parser!(u32).range(10..=10_000),
    )]
    pub db_pool_size: u32,

    /// Pool refills one instance runs at once.
    #[arg(
        long = "idpool-refill-concurrency",
        env = "IDPOOL_REFILL_CONCURRENCY",
        value_name = "IDPOOL_REFILL_CONCURRENCY",
        default_value_t = 8,
        value_parser = clap::value_parser!(u64).range(1..=1024).map(|n| n as usize),
    )]
    pub refill_concurrency: usize,

    /// Seconds a pool may go unused before reconciliation gives it up: its
    /// numbers go back to the counter (or are recorded as discarded) and
    /// its keys leave Redis, so a quiet sequence costs Redis nothing.
    #[arg(
        long = "idpool-pool-idle-s",
        env = "IDPOOL_POOL_IDLE_S",
        value_name = "IDPOOL_POOL_IDLE_S",
        default_value_t = 60,
        value_parser = clap::value_parser!(u64).range(1..=86_400),
    )]
    pub pool_idle_s: u64,

    /// Longest time a request may take before it is answered 503.
    #[arg(
        long = "idpool-request-timeout-s",
        env = "IDPOOL_REQUEST_TIMEOUT_S",
        value_name = "IDPOOL_REQUEST_TIMEOUT_S",
        default_value_t = 30,
        value_parser = clap::value_parser!(u64).range(1..=3600),
    )]
    pub request_timeout_s: u64,

    /// Target store: `postgres` (documents table), `dir:/path` (a JSON file
    /// per document) or `webhook:https://...` (POST each document).
    #[arg(
        long = "idpool-sink",
        env = "IDPOOL_SINK",
        value_name = "IDPOOL_SINK",
        default_value = "postgres",
        value_parser = SinkParser,
    )]
    pub sink: SinkConfig,

    /// Document batches one instance works on at once; more wait their
    /// turn before their bodies are read, so memory stays bounded.
    #[arg(
        long = "idpool-batch-concurrency",
        env = "IDPOOL_BATCH_CONCURRENCY",
        value_name = "IDPOOL_BATCH_CONCURRENCY",
        default_value_t = 4,
        value_parser = clap::value_parser!(u64).range(1..=1024).map(|n| n as usize),
    )]
    pub batch_concurrency: usize,

    /// Run the outbox processor in this process (`off` to run it elsewhere).
    #[arg(
        long = "idpool-outbox-processor",
        env = "IDPOOL_OUTBOX_PROCESSOR",
        value_name = "IDPOOL_OUTBOX_PROCESSOR",
        value_enum,
        default_value = "on"
    )]
    pub outbox_processor: Switch,

    /// Outbox poll interval; new rows also wake the processor at once.
    #[arg(
        long = "idpool-outbox-poll-ms",
        env = "IDPOOL_OUTBOX_POLL_MS",
        value_name = "IDPOOL_OUTBOX_POLL_MS",
        default_value_t = 2000,
        value_parser = clap::value_parser!(u64).range(1..=3_600_000),
    )]
    pub outbox_poll_ms: u64,

    /// Failed delivery attempts before a document is dead-lettered.
    #[arg(
        long = "idpool-outbox-max-retries",
        env = "IDPOOL_OUTBOX_MAX_RETRIES",
        value_name = "IDPOOL_OUTBOX_MAX_RETRIES",
        default_value_t = 5,
        value_parser = clap::value_parser!(i32).range(1..=1000),
    )]
    pub outbox_max_retries: i32,

    /// After failure n the next attempt waits base × 2^n (at most
    /// IDPOOL_OUTBOX_BACKOFF_MAX_MS), plus up to a quarter more at random.
    #[arg(
        long = "idpool-outbox-backoff-base-ms",
        env = "IDPOOL_OUTBOX_BACKOFF_BASE_MS",
        value_name = "IDPOOL_OUTBOX_BACKOFF_BASE_MS",
        default_value_t = 1000,
        value_parser = clap::value_parser!(u64).range(10..=3_600_000),
    )]
    pub outbox_backoff_base_ms: u64,

    /// The longest wait between two delivery attempts, before jitter.
    #[arg(
        long = "idpool-outbox-backoff-max-ms",
        env = "IDPOOL_OUTBOX_BACKOFF_MAX_MS",
        value_name = "IDPOOL_OUTBOX_BACKOFF_MAX_MS",
        default_value_t = 3_600_000,
        value_parser = clap::value_parser!(u64).range(1..=86_400_000),
    )]
    pub outbox_backoff_max_ms: u64,

    /// Processor loops this instance runs at once; each claims its own rows.
    #[arg(
        long = "idpool-outbox-workers",
        env = "IDPOOL_OUTBOX_WORKERS",
        value_name = "IDPOOL_OUTBOX_WORKERS",
        default_value_t = 2,
        value_parser = clap::value_parser!(u64).range(1..=64).map(|n| n as usize),
    )]
    pub outbox_workers: usize,

    /// Rows one processor claims per transaction.
    #[arg(
        long = "idpool-outbox-batch",
        env = "IDPOOL_OUTBOX_BATCH",
        value_name = "IDPOOL_OUTBOX_BATCH",
        default_value_t = 500,
        value_parser = clap::value_parser!(i64).range(1..=10_000),
    )]
    pub outbox_batch: i64,

    /// Webhook sink: milliseconds allowed per delivery.
    #[arg(
        long = "idpool-webhook-timeout-ms",
        env = "IDPOOL_WEBHOOK_TIMEOUT_MS",
        value_name = "IDPOOL_WEBHOOK_TIMEOUT_MS",
        default_value_t = 10_000,
        value_parser = clap::value_parser!(u64).range(1..=600_000),
    )]
    pub webhook_timeout_ms: u64,

    /// Webhook sink: deliveries in flight at once, per processor loop.
    #[arg(
        long = "idpool-webhook-concurrency",
        env = "IDPOOL_WEBHOOK_CONCURRENCY",
        value_name = "IDPOOL_WEBHOOK_CONCURRENCY",
        default_value_t = 16,
        value_parser = clap::value_parser!(u64).range(1..=1024).map(|n| n as usize),
    )]
    pub webhook_concurrency: usize,

    /// Endpoints one project may register.
    #[arg(
        long = "idpool-max-endpoints-per-project",
        env = "IDPOOL_MAX_ENDPOINTS_PER_PROJECT",
        value_name = "IDPOOL_MAX_ENDPOINTS_PER_PROJECT",
        default_value_t = 20,
        value_parser = clap::value_parser!(i64).range(0..=10_000),
    )]
    pub max_endpoints_per_project: i64,

    /// An endpoint whose every attempt failed for this many seconds is
    /// disabled (`disabled_reason: failing`).
    #[arg(
        long = "idpool-endpoint-disable-after-s",
        env = "IDPOOL_ENDPOINT_DISABLE_AFTER_S",
        value_name = "IDPOOL_ENDPOINT_DISABLE_AFTER_S",
        default_value_t = 432_000,
        value_parser = clap::value_parser!(u64).range(1..=31_536_000),
    )]
    pub endpoint_disable_after_s: u64,

    /// Allow endpoint URLs that lead to loopback, private, link-local or
    /// other non-public addresses (tests, private networks).
    #[arg(
        long = "idpool-endpoints-allow-private",
        env = "IDPOOL_ENDPOINTS_ALLOW_PRIVATE",
        value_name = "IDPOOL_ENDPOINTS_ALLOW_PRIVATE",
        default_value_t = false,
        action = clap::ArgAction::Set,
    )]
    pub endpoints_allow_private: bool,

    /// Seconds a rotated endpoint secret keeps signing beside the new one.
    #[arg(
        long = "idpool-secret-overlap-s",
        env = "IDPOOL_SECRET_OVERLAP_S",
        value_name = "IDPOOL_SECRET_OVERLAP_S",
        default_value_t = 86_400,
        value_parser = clap::value_parser!(u64).range(0..=2_592_000),
    )]
    pub secret_overlap_s: u64,

    /// Deliveries in flight to one endpoint, per instance.
    #[arg(
        long = "idpool-endpoint-concurrency",
        env = "IDPOOL_ENDPOINT_CONCURRENCY",
        value_name = "IDPOOL_ENDPOINT_CONCURRENCY",
        default_value_t = 8,
        value_parser = clap::value_parser!(u64).range(1..=256).map(|n| n as usize),
    )]
    pub endpoint_concurrency: usize,

    /// Deliveries in flight to all endpoints together, per instance.
    #[arg(
        long = "idpool-endpoint-in-flight",
        env = "IDPOOL_ENDPOINT_IN_FLIGHT",
        value_name = "IDPOOL_ENDPOINT_IN_FLIGHT",
        default_value_t = 256,
        value_parser = clap::value_parser!(u64).range(1..=10_000).map(|n| n as usize),
    )]
    pub endpoint_in_flight: usize,

    /// Longest pause of an endpoint's open circuit, in seconds.
    #[arg(
        long = "idpool-endpoint-circuit-max-s",
        env = "IDPOOL_ENDPOINT_CIRCUIT_MAX_S",
        value_name = "IDPOOL_ENDPOINT_CIRCUIT_MAX_S",
        default_value_t = 300,
        value_parser = clap::value_parser!(u64).range(1..=86_400),
    )]
    pub endpoint_circuit_max_s: u64,

    /// A file holding the registers' signing key (a note signer's private
    /// key, `PRIVATE+KEY+<name>+<hash>+<key>`). Without it or
    /// IDPOOL_REGISTER_KEY, the installation makes a key once and keeps it
    /// in Postgres.
    #[arg(
        long = "idpool-register-key-file",
        env = "IDPOOL_REGISTER_KEY_FILE",
        value_name = "IDPOOL_REGISTER_KEY_FILE"
    )]
    pub register_key_file: Option<std::path::PathBuf>,

    /// The registers' signing key itself (as in IDPOOL_REGISTER_KEY_FILE).
    #[arg(
        long = "idpool-register-key",
        env = "IDPOOL_REGISTER_KEY",
        value_name = "IDPOOL_REGISTER_KEY",
        hide_env_values = true
    )]
    pub register_key: Option<String>,

    /// The first part of each project's log origin (`<origin>/<project>`),
    /// and the name of a key the installation makes.
    #[arg(
        long = "idpool-register-origin",
        env = "IDPOOL_REGISTER_ORIGIN",
        value_name = "IDPOOL_REGISTER_ORIGIN",
        default_value = "idpool"
    )]
    pub register_origin: String,

    /// Seconds between signed checkpoints of a log that grew.
    #[arg(
        long = "idpool-checkpoint-interval-s",
        env = "IDPOOL_CHECKPOINT_INTERVAL_S",
        value_name = "IDPOOL_CHECKPOINT_INTERVAL_S",
        default_value_t = 5,
        value_parser = clap::value_parser!(u64).range(1..=3_600),
    )]
    pub checkpoint_interval_s: u64,

    /// Run the reconciliation job in this process.
    #[arg(
        long = "idpool-reconcile",
        env = "IDPOOL_RECONCILE",
        value_name = "IDPOOL_RECONCILE",
        value_enum,
        default_value = "on"
    )]
    pub reconcile: Switch,

    /// Seconds between reconciliation runs.
    #[arg(
        long = "idpool-reconcile-interval-s",
        env = "IDPOOL_RECONCILE_INTERVAL_S",
        value_name = "IDPOOL_RECONCILE_INTERVAL_S",
        default_value_t = 60,
        value_parser = clap::value_parser!(u64).range(1..=86_400),
    )]
    pub reconcile_interval_s: u64,

    /// Seconds a number must have left its pool before it is judged; never
    /// less than the request timeout (no request can hold a number longer).
    #[arg(
        long = "idpool-reconcile-settle-s",
        env = "IDPOOL_RECONCILE_SETTLE_S",
        value_name = "IDPOOL_RECONCILE_SETTLE_S",
        default_value_t = 60,
        value_parser = clap::value_parser!(u64).range(0..=604_800),
    )]
    pub reconcile_settle_s: u64,

    /// For benchmarks and tests of a running binary: a file holding a
    /// number of seconds the service's clock runs ahead of the system's
    /// (negative: behind), read at start and every half second after, so
    /// periods can be crossed without waiting for them. Unset in service.
    #[arg(
        long = "idpool-clock-offset-file",
        env = "IDPOOL_CLOCK_OFFSET_FILE",
        value_name = "IDPOOL_CLOCK_OFFSET_FILE"
    )]
    pub clock_offset_file: Option<std::path::PathBuf>,

    /// Name of this instance in block records and logs (default: host-pid).
    #[arg(
        long = "idpool-instance-id",
        env = "IDPOOL_INSTANCE_ID",
        value_name = "IDPOOL_INSTANCE_ID",
        value_parser = instance_id,
    )]
    pub instance_id: Option<String>,

    /// Seconds a client connection has to send a request's headers, from
    /// the connection's start or the request's first byte, before it is
    /// closed.
    #[arg(
        long = "idpool-header-timeout-s",
        env = "IDPOOL_HEADER_TIMEOUT_S",
        value_name = "IDPOOL_HEADER_TIMEOUT_S",
        default_value_t = 10,
        value_parser = clap::value_parser!(u64).range(1..=3600),
    )]
    pub header_timeout_s: u64,

    /// Seconds an answer may make no progress (a client that stops reading)
    /// before its connection is closed.
    #[arg(
        long = "idpool-write-timeout-s",
        env = "IDPOOL_WRITE_TIMEOUT_S",
        value_name = "IDPOOL_WRITE_TIMEOUT_S",
        default_value_t = 30,
        value_parser = clap::value_parser!(u64).range(1..=3600),
    )]
    pub write_timeout_s: u64,

    /// Seconds a keep-alive connection may wait idle for its next request.
    #[arg(
        long = "idpool-idle-timeout-s",
        env = "IDPOOL_IDLE_TIMEOUT_S",
        value_name = "IDPOOL_IDLE_TIMEOUT_S",
        default_value_t = 60,
        value_parser = clap::value_parser!(u64).range(1..=86_400),
    )]
    pub idle_timeout_s: u64,

    /// Open client connections per instance; more wait to be accepted.
    #[arg(
        long = "idpool-max-connections",
        env = "IDPOOL_MAX_CONNECTIONS",
        value_name = "IDPOOL_MAX_CONNECTIONS",
        default_value_t = 10_000,
        value_parser = clap::value_parser!(u64).range(1..=1_000_000),
    )]
    pub max_connections: u64,

    /// Longest a Postgres statement of a request may run (`statement_timeout`).
    #[arg(
        long = "idpool-db-statement-timeout-ms",
        env = "IDPOOL_DB_STATEMENT_TIMEOUT_MS",
        value_name = "IDPOOL_DB_STATEMENT_TIMEOUT_MS",
        default_value_t = 10_000,
        value_parser = clap::value_parser!(u64).range(1..=3_600_000),
    )]
    pub db_statement_timeout_ms: u64,

    /// How long a request waits for a free Postgres connection before it is
    /// answered 503 with `Retry-After`.
    #[arg(
        long = "idpool-db-acquire-timeout-ms",
        env = "IDPOOL_DB_ACQUIRE_TIMEOUT_MS",
        value_name = "IDPOOL_DB_ACQUIRE_TIMEOUT_MS",
        default_value_t = 2_000,
        value_parser = clap::value_parser!(u64).range(1..=600_000),
    )]
    pub db_acquire_timeout_ms: u64,

    /// Sequences one project may have (created by `PUT` or by first use).
    #[arg(
        long = "idpool-max-sequences-per-project",
        env = "IDPOOL_MAX_SEQUENCES_PER_PROJECT",
        value_name = "IDPOOL_MAX_SEQUENCES_PER_PROJECT",
        default_value_t = 1000,
        value_parser = clap::value_parser!(u64).range(1..=1_000_000),
    )]
    pub max_sequences_per_project: u64,

    /// `off` turns authentication, scopes and rate limits off: local
    /// development only, and only on a loopback address.
    #[arg(
        long = "idpool-auth",
        env = "IDPOOL_AUTH",
        value_name = "IDPOOL_AUTH",
        value_enum,
        default_value = "on"
    )]
    pub auth: Switch,

    /// `off` records every `POST /ids` request's numbers on its own instead
    /// of serving busy sequences from leases recorded ahead.
    #[arg(
        long = "idpool-leases",
        env = "IDPOOL_LEASES",
        value_name = "IDPOOL_LEASES",
        value_enum,
        default_value = "on"
    )]
    pub leases: Switch,

    /// Seconds a number reserved by `POST /ids` on a gapless sequence waits
    /// for its document before it is voided as `reservation_expired`.
    #[arg(
        long = "idpool-reservation-ttl-s",
        env = "IDPOOL_RESERVATION_TTL_S",
        value_name = "IDPOOL_RESERVATION_TTL_S",
        default_value_t = 300,
        value_parser = clap::value_parser!(u64).range(1..=31_536_000),
    )]
    pub reservation_ttl_s: u64,

    /// Requests one API key may have in flight at once (answers still being
    /// sent included); more wait for its own earlier ones to finish.
    #[arg(
        long = "idpool-max-in-flight-per-key",
        env = "IDPOOL_MAX_IN_FLIGHT_PER_KEY",
        value_name = "IDPOOL_MAX_IN_FLIGHT_PER_KEY",
        default_value_t = 256,
        value_parser = clap::value_parser!(u64).range(1..=1_000_000),
    )]
    pub max_in_flight_per_key: u64,

    /// Rows of lists (outbox, gaps, sequences) one API key may read per
    /// second (a second's worth at once); a key past it waits before its
    /// next list. 0: no limit.
    #[arg(
        long = "idpool-list-rows-per-key",
        env = "IDPOOL_LIST_ROWS_PER_KEY",
        value_name = "IDPOOL_LIST_ROWS_PER_KEY",
        default_value_t = 2_000,
        value_parser = clap::value_parser!(u32),
    )]
    pub list_rows_per_key: u32,

    /// Numbers one API key may take per second through `POST /ids` (a
    /// second's worth at once): each costs Redis, Postgres and formatting work every
    /// tenant shares, and a `count` of 10,000 is still one request to the
    /// rate limit. A key past it waits before its next `POST /ids`. (Batches
    /// are bounded by their turns.) 0: no limit.
    #[arg(
        long = "idpool-numbers-per-key",
        env = "IDPOOL_NUMBERS_PER_KEY",
        value_name = "IDPOOL_NUMBERS_PER_KEY",
        default_value_t = 50_000,
        value_parser = clap::value_parser!(u32),
    )]
    pub numbers_per_key: u32,

    /// Requests per second per API key (bursts of twice that).
    #[arg(
        long = "idpool-rate-limit",
        env = "IDPOOL_RATE_LIMIT",
        value_name = "IDPOOL_RATE_LIMIT",
        default_value_t = 1000,
        value_parser = clap::value_parser!(u32).range(1..),
    )]
    pub rate_limit: u32,

    /// Webhook sink: HMAC key for the Standard Webhooks signature
    /// (`whsec_<base64>`, or any other string used as it is).
    #[arg(
        long = "idpool-webhook-secret",
        env = "IDPOOL_WEBHOOK_SECRET",
        value_name = "IDPOOL_WEBHOOK_SECRET",
        hide_env_values = true
    )]
    pub webhook_secret: Option<String>,
}

/// Without the URLs' credentials or the webhook secret.
impl std::fmt::Debug for Config {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Config")
            .field("database_url", &url_without_password(&self.database_url))
            .field("pg_pooler", &self.pg_pooler)
            .field(
                "pg_listen_url",
                &self.pg_listen_url.as_deref().map(url_without_password),
            )
            .field("redis_url", &url_without_password(&self.redis_url))
            .field("listen", &self.listen)
            .field("auth", &self.auth)
            .field(
                "webhook_secret",
                &self.webhook_secret.as_ref().map(|_| "<hidden>"),
            )
            .finish_non_exhaustive()
    }
}

/// A Redis key prefix: no braces, which would make the prefix every key's
/// Redis Cluster hash tag and put all pools on one node.
fn redis_prefix(value: &str) -> Result<String, String> {
    if value.is_empty() || value.len() > 64 {
        return Err("1 to 64 characters".into());
    }
    if value.contains(['{', '}']) || value.chars().any(|c| c.is_control() || c.is_whitespace()) {
        return Err("no braces (Redis Cluster hash tags), spaces or control characters".into());
    }
    Ok(value.to_owned())
}

/// An instance id: it is sent in a webhook header and written in block
/// records, so visible ASCII only.
fn instance_id(value: &str) -> Result<String, String> {
    if (1..=128).contains(&value.len()) && value.bytes().all(|b| b.is_ascii_graphic()) {
        Ok(value.to_owned())
    } else {
        Err("1 to 128 visible ASCII characters (it is sent in an HTTP header)".into())
    }
}

/// Parses `IDPOOL_SINK` with an error of its own: clap's would repeat the
/// value, and a webhook URL may hold a password or a token.
#[derive(Clone)]
struct SinkParser;

impl TypedValueParser for SinkParser {
    type Value = SinkConfig;

    fn parse_ref(
        &self,
        _: &clap::Command,
        _: Option<&clap::Arg>,
        value: &std::ffi::OsStr,
    ) -> Result<SinkConfig, clap::Error> {
        let refused = |reason: &str| {
            clap::Error::raw(
                clap::error::ErrorKind::ValueValidation,
                format!("invalid IDPOOL_SINK (value not shown): {reason}\n"),
            )
        };
        value
            .to_str()
            .ok_or_else(|| refused("it is not UTF-8"))?
            .parse()
            .map_err(|reason: String| refused(&reason))
    }
}

/// A Postgres URL sqlx can connect with. The error names the variable and
/// never the value (it may hold a password).
pub fn check_database_url(url: &str) -> anyhow::Result<()> {
    let form = "DATABASE_URL must be postgres://[user[:password]@]host[:port]/database[?options]";
    if !(url.starts_with("postgres://") || url.starts_with("postgresql://")) {
        anyhow::bail!("{form}");
    }
    if let Err(e) = url.parse::<sqlx::postgres::PgConnectOptions>() {
        anyhow::bail!("{form} ({})", e.to_string().replace(url, "<the URL>"));
    }
    Ok(())
}

impl Config {
    pub fn processor_settings(&self) -> crate::features::documents::processor::ProcessorSettings {
        crate::features::documents::processor::ProcessorSettings {
            poll: Duration::from_millis(self.outbox_poll_ms),
            max_retries: self.outbox_max_retries,
            backoff_base: Duration::from_millis(self.outbox_backoff_base_ms),
            backoff_max: Duration::from_millis(self.outbox_backoff_max_ms),
            batch_size: self.outbox_batch,
            ..Default::default()
        }
    }

    /// The registers' settings, the key read from its file.
    pub fn register_settings(
        &self,
    ) -> anyhow::Result<crate::features::registers::RegisterSettings> {
        let key = match (&self.register_key_file, &self.register_key) {
            (Some(_), Some(_)) => {
                anyhow::bail!("give IDPOOL_REGISTER_KEY_FILE or IDPOOL_REGISTER_KEY, not both")
            }
            (Some(path), None) => Some(std::fs::read_to_string(path).map_err(|e| {
                anyhow::anyhow!("IDPOOL_REGISTER_KEY_FILE {}: {e}", path.display())
            })?),
            (None, key) => key.clone(),
        };
        Ok(crate::features::registers::RegisterSettings {
            key,
            origin: self.register_origin.clone(),
            checkpoint_interval: Duration::from_secs(self.checkpoint_interval_s),
        })
    }

    pub fn endpoint_settings(&self) -> crate::features::endpoints::EndpointSettings {
        crate::features::endpoints::EndpointSettings {
            max_per_project: self.max_endpoints_per_project,
            secret_overlap: Duration::from_secs(self.secret_overlap_s),
            policy: self.endpoint_policy(),
        }
    }

    fn endpoint_policy(&self) -> crate::features::endpoints::url_guard::UrlPolicy {
        crate::features::endpoints::url_guard::UrlPolicy {
            allow_private: self.endpoints_allow_private,
        }
    }

    pub fn dispatcher_settings(
        &self,
    ) -> crate::features::endpoints::dispatcher::DispatcherSettings {
        let outbox = self.processor_settings();
        crate::features::endpoints::dispatcher::DispatcherSettings {
            timeout: Duration::from_millis(self.webhook_timeout_ms),
            per_endpoint: self.endpoint_concurrency,
            in_flight: self.endpoint_in_flight.max(self.endpoint_concurrency),
            poll: outbox.poll,
            judgement: crate::features::endpoints::deliveries::Judgement {
                retry: crate::features::documents::delivery_queue::Retry {
                    max_retries: outbox.max_retries,
                    backoff_base: outbox.backoff_base,
                    backoff_max: outbox.backoff_max,
                },
                circuit_after: ENDPOINT_CIRCUIT_AFTER,
                circuit_base: Duration::from_secs(1),
                circuit_max: Duration::from_secs(self.endpoint_circuit_max_s),
                disable_after: Duration::from_secs(self.endpoint_disable_after_s),
            },
            policy: self.endpoint_policy(),
            shutdown_grace: outbox.shutdown_grace,
        }
    }

    pub fn reconcile_settings(&self) -> crate::features::gaps::reconcile::ReconcileSettings {
        crate::features::gaps::reconcile::ReconcileSettings {
            interval: Duration::from_secs(self.reconcile_interval_s),
            settle: Duration::from_secs(
                self.reconcile_settle_s
                    .max(self.request_timeout().as_secs()),
            ),
            ..Default::default()
        }
    }

    pub fn request_timeout(&self) -> Duration {
        Duration::from_secs(self.request_timeout_s)
    }

    /// Refuses URLs that cannot work, naming the variable and the accepted
    /// forms (never the value: it may hold a password).
    pub fn check_urls(&self) -> anyhow::Result<()> {
        check_database_url(&self.database_url)?;
        crate::records::pool::url::parse(&self.redis_url)?;
        if let Some(listen) = &self.pg_listen_url {
            check_database_url(listen).map_err(|e| {
                anyhow::anyhow!(
                    "IDPOOL_PG_LISTEN_URL: {}",
                    e.to_string().replace("DATABASE_URL", "it")
                )
            })?;
            // A listener through the pooler would leave LISTEN on a server
            // connection other clients get: their statements then fail on
            // notifications they never asked for.
            let address = |url: &str| {
                url.parse::<sqlx::postgres::PgConnectOptions>()
                    .map(|o| (o.get_host().to_owned(), o.get_port()))
                    .ok()
            };
            if self.pg_pooler != crate::infra::db::Pooler::None
                && address(listen) == address(&self.database_url)
            {
                anyhow::bail!(
                    "IDPOOL_PG_LISTEN_URL must lead straight to Postgres, not to the pooler of DATABASE_URL"
                );
            }
        }
        Ok(())
    }

    /// Refuses a redelivery schedule whose base is above its cap. Every
    /// other combination the ranges allow is storable: at most 1,000 waits
    /// of at most 1.25 days each.
    pub fn check_outbox_backoff(&self) -> anyhow::Result<()> {
        if self.outbox_backoff_base_ms > self.outbox_backoff_max_ms {
            anyhow::bail!(
                "IDPOOL_OUTBOX_BACKOFF_BASE_MS ({}) must not exceed IDPOOL_OUTBOX_BACKOFF_MAX_MS ({}): \
                 the cap is the longest wait between two delivery attempts",
                self.outbox_backoff_base_ms,
                self.outbox_backoff_max_ms
            );
        }
        Ok(())
    }

    /// Refuses to serve without authentication anywhere but a loopback
    /// address.
    pub fn check_auth_off_is_local(&self) -> anyhow::Result<()> {
        if self.auth.is_on() {
            return Ok(());
        }
        let host = match self.listen.rsplit_once(':') {
            Some((host, _port)) => host.trim_start_matches('[').trim_end_matches(']'),
            None => self.listen.as_str(),
        };
        let loopback = host == "localhost"
            || host
                .parse::<std::net::IpAddr>()
                .is_ok_and(|ip| ip.is_loopback());
        if loopback {
            Ok(())
        } else {
            anyhow::bail!(
                "IDPOOL_AUTH=off is for local development: IDPOOL_LISTEN must be a loopback \
                 address (127.0.0.1, [::1] or localhost), not {:?}",
                self.listen
            )
        }
    }

    pub fn header_timeout(&self) -> Duration {
        Duration::from_secs(self.header_timeout_s)
    }

    /// Bounds on every connection of the request pool. A transaction may
    /// sit idle no longer than a request may last.
    pub fn db_limits(&self) -> crate::infra::db::Limits {
        crate::infra::db::Limits {
            statement: Duration::from_millis(self.db_statement_timeout_ms),
            acquire: Duration::from_millis(self.db_acquire_timeout_ms),
            idle_in_transaction: self.request_timeout() + Duration::from_secs(5),
            ..Default::default()
        }
    }

    pub fn instance_id(&self) -> String {
        self.instance_id.clone().unwrap_or_else(|| {
            let host = std::fs::read_to_string("/etc/hostname")
                .map(|h| h.trim().to_owned())
                .unwrap_or_else(|_| "localhost".into());
            format!("{host}-{}", std::process::id())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::Config;
    use clap::Parser;

    #[derive(Parser)]
    struct Command {
        #[command(flatten)]
        config: Config,
    }

    /// The settings tables of SPEC.md and README.md: (name, default cell).
    fn stated_defaults() -> Vec<(&'static str, &'static str)> {
        let documents = [
            include_str!("../../docs/SPEC.md"),
            include_str!("../../README.md"),
        ];
        let mut stated = Vec::new();
        for line in documents.iter().flat_map(|d| d.lines()) {
            let Some((name, rest)) = line
                .strip_prefix("| `")
                .and_then(|rest| rest.split_once("` | "))
            else {
                continue;
            };
            if name.chars().all(|c| c.is_ascii_uppercase() || c == '_') {
                let cell = rest.split(" |").next().unwrap_or_default().trim();
                stated.push((name, cell));
            }
        }
        stated
    }

    /// What the documents say an operator who sets nothing gets is what
    /// the parser gives, and every setting the parser reads is in one of
    /// their tables.
    #[test]
    fn the_defaults_the_documents_state_are_the_parsers() {
        use clap::CommandFactory;
        let stated = stated_defaults();
        let command = Command::command();
        let mut compared = 0;
        for arg in command.get_arguments() {
            let Some(name) = arg.get_env().and_then(|env| env.to_str()) else {
                continue;
            };
            let defaults: Vec<String> = arg
                .get_default_values()
                .iter()
                .map(|value| value.to_string_lossy().into_owned())
                .collect();
            let cells: Vec<&str> = stated
                .iter()
                .filter(|(stated, _)| *stated == name)
                .map(|(_, cell)| *cell)
                .collect();
            assert!(
                !cells.is_empty(),
                "{name} is in no settings table of SPEC.md or README.md"
            );
            for cell in cells {
                match cell.strip_prefix('`').and_then(|c| c.strip_suffix('`')) {
                    Some(value) => {
                        assert_eq!(defaults, [value], "{name}: the documents say {cell}")
                    }
                    None if cell == "none" || cell == "unset" => {
                        assert!(
                            defaults.is_empty(),
                            "{name}: documented as {cell}, defaults to {defaults:?}"
                        )
                    }
                    // Made at start from the host's name and the process id.
                    None if cell == "host-pid" => assert!(defaults.is_empty(), "{name}"),
                    None => panic!(
                        "{name}: the documents state its default as {cell:?}, not as a value"
                    ),
                }
                compared += 1;
            }
        }
        assert!(compared > 50, "{compared} defaults compared");
    }

    fn parsed(args: &[&str]) -> Config {
        let args = std::iter::once("idpool").chain(args.iter().copied());
        Command::try_parse_from(args).expect("parses").config
    }

    #[test]
    fn a_redelivery_base_above_its_cap_is_refused_and_the_ranges_bound_the_rest() {
        let refused = parsed(&[
            "--idpool-outbox-backoff-base-ms=5000",
            "--idpool-outbox-backoff-max-ms=1000",
        ])
        .check_outbox_backoff()
        .expect_err("base above the cap");
        let said = refused.to_string();
        assert!(
            said.contains("IDPOOL_OUTBOX_BACKOFF_BASE_MS (5000)")
                && said.contains("IDPOOL_OUTBOX_BACKOFF_MAX_MS (1000)"),
            "{said}"
        );
        assert!(parsed(&[]).check_outbox_backoff().is_ok(), "the defaults");
        let over_a_day = ["idpool", "--idpool-outbox-backoff-max-ms=86400001"];
        assert!(Command::try_parse_from(over_a_day).is_err());
        let over_1000 = ["idpool", "--idpool-outbox-max-retries=1001"];
        assert!(Command::try_parse_from(over_1000).is_err());
        // A base of 0 would be no backoff at all: a failing target met in
        // a tight loop.
        let no_backoff = ["idpool", "--idpool-outbox-backoff-base-ms=0"];
        assert!(Command::try_parse_from(no_backoff).is_err());
        assert_eq!(
            parsed(&["--idpool-outbox-backoff-base-ms=10"]).outbox_backoff_base_ms,
            10
        );
    }

    #[test]
    fn prefixes_and_instance_ids_that_would_break_later_are_refused() {
        for refused in [
            ["idpool", "--idpool-redis-prefix", "{x}"],
            ["idpool", "--idpool-redis-prefix", "a b"],
            ["idpool", "--idpool-redis-prefix", ""],
            ["idpool", "--idpool-instance-id", "inst\r\nX-Injected: yes"],
            ["idpool", "--idpool-instance-id", "a b"],
            ["idpool", "--idpool-instance-id", ""],
        ] {
            assert!(Command::try_parse_from(refused).is_err(), "{refused:?}");
        }
        let kept = parsed(&[
            "--idpool-redis-prefix=tenant-a:idpool",
            "--idpool-instance-id=web-7.eu-1",
        ]);
        assert_eq!(kept.redis_prefix, "tenant-a:idpool");
        assert_eq!(kept.instance_id(), "web-7.eu-1");
    }

    #[test]
    fn a_refused_sink_is_not_repeated_in_the_error() {
        for value in [
            "webhook:ftp://u:Secret@hooks.example/in?token=Token",
            "webhook:https://u:12#Secret@hooks.example/in",
            "webhook:https://u:Secret@hooks.example:999999/in?token=Token",
            "https://u:Secret@hooks.example/in?token=Token",
        ] {
            let Err(refused) = Command::try_parse_from(["idpool", "--idpool-sink", value]) else {
                panic!("{value} was accepted");
            };
            let said = refused.to_string();
            assert!(said.contains("IDPOOL_SINK"), "{said}");
            for secret in ["Secret", "Token", "hooks.example"] {
                assert!(!said.contains(secret), "{value}: {said}");
            }
        }
    }
}
