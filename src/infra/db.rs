//! Postgres: create the database when missing, connect, migrate.

use std::str::FromStr;
use std::sync::LazyLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use sqlx::postgres::{PgConnectOptions, PgPoolOptions, PgSslMode};
use sqlx::{ConnectOptions, Connection};

mod link;
#[cfg(test)]
pub(crate) mod plans;
pub use link::{Conn, Db, Link, Pooler, Statements, Tx};

/// The migrations, applied by `migrate`.
static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations");

/// How long Postgres may work or wait for one connection of ours.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// `statement_timeout`: no statement runs longer.
    pub statement: Duration,
    /// `lock_timeout`: no statement waits longer for a lock.
    pub lock: Duration,
    /// `idle_in_transaction_session_timeout`: a transaction left idle this
    /// long is ended by the server (a task that hung holding it).
    pub idle_in_transaction: Duration,
    /// How long a request waits for a free connection before its 503.
    pub acquire: Duration,
    /// Ping a connection before handing it out. Off on the request path
    /// (a round trip per statement; a dead connection shows up as its
    /// statement's error), on for background work, which must not fail
    /// once per connection after a Postgres restart.
    pub ping_on_acquire: bool,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            statement: Duration::from_secs(10),
            lock: Duration::from_secs(2),
            idle_in_transaction: Duration::from_secs(30),
            acquire: Duration::from_secs(2),
            ping_on_acquire: false,
        }
    }
}

impl Limits {
    /// For background jobs that read a lot at once (reconciliation).
    pub fn for_background(self) -> Self {
        Self {
            statement: Duration::from_secs(300),
            lock: Duration::from_secs(30),
            idle_in_transaction: Duration::from_secs(300),
            acquire: Duration::from_secs(30),
            ping_on_acquire: true,
        }
    }

    fn settings(&self) -> [(&'static str, String); 3] {
        let ms = |d: Duration| format!("{}ms", d.as_millis().max(1));
        [
            ("statement_timeout", ms(self.statement)),
            ("lock_timeout", ms(self.lock)),
            (
                "idle_in_transaction_session_timeout",
                ms(self.idle_in_transaction),
            ),
        ]
    }

    /// The limits as `SET LOCAL` statements, for the start of a
    /// transaction.
    fn set_local(&self) -> String {
        self.settings()
            .iter()
            .map(|(name, value)| format!("SET LOCAL {name} = '{value}'"))
            .collect::<Vec<_>>()
            .join("; ")
    }

    fn apply(&self, options: PgConnectOptions, pooler: Pooler) -> PgConnectOptions {
        // Every statement at trace only: debug logs stay readable (slow
        // statements are still logged as warnings).
        let options = options.log_statements(log::LevelFilter::Trace);
        match pooler {
            Pooler::None => options.options(self.settings()),
            // A pooler refuses startup parameters it does not know (or is
            // told to drop them): none is sent, and the limits are set in
            // every transaction instead (see `link`).
            Pooler::Session => options.extra_float_digits(None),
            Pooler::Transaction => options.extra_float_digits(None).statement_cache_capacity(0),
        }
    }
}

/// Connects to `url`, creating its database first if it does not exist.
pub async fn connect(
    url: &str,
    max_connections: u32,
    limits: Limits,
    pooler: Pooler,
) -> anyhow::Result<Db> {
    let options = connect_options(url)?;
    // Behind a pooler the database is the pooler's to know: it serves only
    // those it is configured for, and creating one is the operator's step.
    if pooler == Pooler::None {
        ensure_database(&options).await?;
    }
    pool(options, max_connections, limits, pooler).await
}

/// Options from `url`. Without an explicit `sslmode` (in the URL or
/// `PGSSLMODE`), a loopback server is spoken to in plain text: TLS on the
/// same host protects nothing and costs CPU on every statement.
pub fn connect_options(url: &str) -> anyhow::Result<PgConnectOptions> {
    let options = PgConnectOptions::from_str(url)?;
    let explicit = url.contains("sslmode=") || std::env::var_os("PGSSLMODE").is_some();
    let host = options.get_host();
    let loopback = host == "localhost"
        || host.starts_with('/')
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback());
    Ok(if loopback && !explicit {
        options.ssl_mode(PgSslMode::Disable)
    } else {
        options
    })
}

/// A pool on a database that exists, every connection bounded by `limits`.
pub async fn pool(
    options: PgConnectOptions,
    max_connections: u32,
    limits: Limits,
    pooler: Pooler,
) -> anyhow::Result<Db> {
    let options = limits.apply(options, pooler);
    let pool = pool_options(max_connections, &limits)
        .min_connections(0)
        .idle_timeout(IDLE)
        .connect_with(options)
        .await?;
    Ok(Db::new(pool, link::Shape::new(pooler, &limits)))
}

/// How a pool of `max_connections` hands out connections under `limits`.
fn pool_options(max_connections: u32, limits: &Limits) -> PgPoolOptions {
    PgPoolOptions::new()
        .test_before_acquire(limits.ping_on_acquire)
        // A connection opened before its server was seen read-only or
        // going away is closed rather than used: the address (HAProxy, a
        // DNS name) leads a new one to the writable primary.
        .before_acquire(|_, meta| Box::pin(async move { Ok(!opened_before_distrust(meta.age)) }))
        .max_connections(max_connections.max(1))
        .acquire_timeout(limits.acquire)
}

/// How long a connection stays open unused: the instance holds the server
/// connections its work uses now, not all it ever used (an instance at
/// full throughput holds at most 8, SPEC). Work that comes now and then (a
/// definition read, an outbox poll, a refill) opens one again (about a
/// millisecond on the same host).
const IDLE: Duration = Duration::from_secs(1);
const SIBLING_IDLE: Duration = IDLE;

/// When a server was last seen unable to take writes (read-only, shutting
/// down), in milliseconds after `EPOCH`; 0 for never.
static DISTRUSTED_AT_MS: AtomicU64 = AtomicU64::new(0);
static EPOCH: LazyLock<Instant> = LazyLock::new(Instant::now);

/// Whether `e` says the connection's server takes no writes now (a standby,
/// a demoted or stopping primary). Every connection opened until now is
/// then closed at its next checkout instead of being used again: after a
/// failover the same address leads new connections to the new primary.
pub fn distrust_server_after(e: &sqlx::Error) -> bool {
    let gone = matches!(
        sqlstate::of(e).as_deref(),
        Some(
            sqlstate::READ_ONLY_SQL_TRANSACTION
                | sqlstate::ADMIN_SHUTDOWN
                | sqlstate::CRASH_SHUTDOWN
                | sqlstate::CANNOT_CONNECT_NOW
        )
    );
    if gone {
        distrust_open_connections();
    }
    gone
}

/// Whether a statement that failed with `e` may still have committed: the
/// connection broke (or the server went away) before its answer arrived.
/// A statement the server refused, or one never sent (no connection from
/// the pool), did not.
pub fn may_have_committed(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Io(_) | sqlx::Error::Protocol(_) | sqlx::Error::WorkerCrashed => true,
        sqlx::Error::Database(_) => matches!(
            sqlstate::of(e).as_deref(),
            Some(sqlstate::ADMIN_SHUTDOWN | sqlstate::CRASH_SHUTDOWN)
        ),
        _ => false,
    }
}

/// Closes every connection open now at its next checkout.
pub fn distrust_open_connections() {
    // +1: a connection opened in this very millisecond is distrusted too.
    let now = EPOCH.elapsed().as_millis() as u64 + 1;
    DISTRUSTED_AT_MS.fetch_max(now, Ordering::Relaxed);
}

fn opened_before_distrust(age: Duration) -> bool {
    let distrusted_at = DISTRUSTED_AT_MS.load(Ordering::Relaxed);
    if distrusted_at == 0 {
        return false;
    }
    let opened_at = EPOCH.elapsed().saturating_sub(age).as_millis() as u64;
    opened_at < distrusted_at
}

async fn ensure_database(options: &PgConnectOptions) -> anyhow::Result<()> {
    let Some(name) = options.get_database().map(str::to_owned) else {
        return Ok(());
    };
    // Connecting straight away is the common case and needs no rights on
    // the maintenance database.
    if options.clone().connect().await.is_ok() {
        return Ok(());
    }
    let mut maintenance = options.clone().database("postgres").connect().await?;
    let exists = sqlx::query_scalar!(
        r#"SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1) AS "exists!""#,
        &name,
    )
    .fetch_one(&mut maintenance)
    .await?;
    if !exists {
        let quoted = format!("\"{}\"", name.replace('"', "\"\""));
        let created = sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {quoted}")))
            .execute(&mut maintenance)
            .await;
        match created {
            Ok(_) => tracing::info!(database = %name, "created database"),
            // Another instance created it first.
            Err(sqlx::Error::Database(e))
                if e.code().as_deref() == Some(sqlstate::DUPLICATE_DATABASE) => {}
            Err(e) => return Err(e.into()),
        }
    }
    maintenance.close().await?;
    Ok(())
}

/// How long a statement of the shared write stage waits for a lock: a wait
/// means another transaction holds a number it should not, and every
/// request queued behind the write waits with it, so it gives up soon and
/// the request at fault is found (`ledger::write_shared`).
pub const WRITER_LOCK_WAIT: Duration = Duration::from_millis(200);

/// How long a write whose commit is in doubt waits for the server to
/// answer again before it is given up as unknown. About the outage of a
/// Patroni failover (ttl 10 s) with room to spare: until then nothing could
/// be written anyway, and the answer to the caller is the true one.
pub const IN_DOUBT_PATIENCE: Duration = Duration::from_secs(30);

/// A server session (backend) of ours: its pid and when it started.
#[derive(Debug, Clone, Copy)]
pub struct Session {
    pid: i32,
    started: chrono::DateTime<chrono::Utc>,
}

/// The session `conn` talks to.
async fn session_of<'c>(conn: impl sqlx::PgExecutor<'c>) -> Result<Session, sqlx::Error> {
    let row = sqlx::query!(
        r#"SELECT pid AS "pid!", backend_start AS "started!" FROM pg_stat_activity WHERE pid = pg_backend_pid()"#
    )
    .fetch_one(conn)
    .await?;
    Ok(Session {
        pid: row.pid,
        started: row.started,
    })
}

/// Ends `session` if it still runs, and returns once it has. A connection
/// cut between us and a live server leaves its backend running: it may
/// still be committing what we gave up on, so what it wrote is final only
/// once it is gone. (After a crash or a failover it is gone already; a pid
/// met again on another server is another session: the start tells.)
async fn end_session(conn: &mut Conn, session: Session) -> Result<(), sqlx::Error> {
    loop {
        let running = sqlx::query_scalar!(
            r#"SELECT pg_terminate_backend(pid) AS "ended!" FROM pg_stat_activity
               WHERE pid = $1 AND backend_start = $2"#,
            session.pid,
            session.started,
        )
        .fetch_optional(&mut *conn)
        .await?;
        if running.is_none() {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn server_now(conn: &mut Conn) -> Result<chrono::DateTime<chrono::Utc>, sqlx::Error> {
    sqlx::query_scalar!(r#"SELECT clock_timestamp() AS "now!""#)
        .fetch_one(conn)
        .await
}

/// Returns once no commit that began in a transaction older than `cutoff`
/// is still running (ours, whose answer was lost, among them).
async fn commits_begun_before_ended(
    conn: &mut Conn,
    cutoff: chrono::DateTime<chrono::Utc>,
) -> Result<(), sqlx::Error> {
    loop {
        let running = sqlx::query_scalar!(
            r#"SELECT EXISTS (SELECT 1 FROM pg_stat_activity
                              WHERE state = 'active' AND query = 'COMMIT' AND xact_start < $1
                                AND pid <> pg_backend_pid()) AS "running!""#,
            cutoff,
        )
        .fetch_one(&mut *conn)
        .await?;
        if !running {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// What became of a commit whose connection failed before its answer
/// arrived (a crash, a failover): `ask` runs on a new connection once the
/// server answers again (retried with backoff for up to `patience`), after
/// the `lost` session that sent the commit, if known, has ended. None when
/// it never answered in time: the commit stays in doubt.
pub async fn once_answering<T, Asked>(
    db: &Db,
    patience: Duration,
    lost: Option<Session>,
    mut ask: impl FnMut(Conn) -> Asked,
) -> Option<T>
where
    Asked: std::future::Future<Output = Result<T, sqlx::Error>>,
{
    let deadline = Instant::now() + patience;
    let mut cutoff = None;
    let mut backoff =
        crate::infra::backoff::Backoff::between(Duration::from_millis(50), Duration::from_secs(2));
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return None;
        }
        let answer = tokio::time::timeout(left, async {
            let mut conn = db.acquire().await?;
            match lost {
                Some(lost) => end_session(&mut conn, lost).await?,
                // Behind a pooler the session is not ours to know: every
                // commit under way since before the lookup began ends first.
                None if db.pooler() != Pooler::None => {
                    let cutoff = *match &mut cutoff {
                        Some(cutoff) => cutoff,
                        None => cutoff.insert(server_now(&mut conn).await?),
                    };
                    commits_begun_before_ended(&mut conn, cutoff).await?;
                }
                None => {}
            }
            ask(conn).await
        })
        .await;
        match answer {
            Ok(Ok(known)) => return Some(known),
            Ok(Err(e)) => {
                distrust_server_after(&e);
                tracing::debug!(error = %e, "a commit in doubt: the server does not answer yet");
            }
            Err(_) => return None,
        }
        let pause = backoff
            .next_pause()
            .min(deadline.saturating_duration_since(Instant::now()));
        tokio::time::sleep(pause).await;
    }
}

/// Runs `work` in a transaction on `conn` and always ends it: a commit when
/// it succeeds, a ROLLBACK sent at once when it fails. (A dropped sqlx
/// transaction only queues its ROLLBACK until the connection is next used;
/// a connection kept between uses would sit idle in an aborted transaction
/// until Postgres ends it, failing whoever uses it next.) When the ROLLBACK
/// itself fails, the connection is broken and that error wins.
pub async fn in_transaction<T, E>(
    conn: &mut impl Link,
    work: impl AsyncFnOnce(&mut Tx<'_>) -> Result<T, E>,
) -> Result<T, E>
where
    E: From<sqlx::Error>,
{
    let mut tx = conn.begin().await?;
    match work(&mut tx).await {
        Ok(done) => {
            tx.commit().await?;
            Ok(done)
        }
        Err(e) => {
            tx.rollback().await?;
            Err(e)
        }
    }
}

/// Longest a request waits for the answer to a `COMMIT` it sent before it
/// takes the connection for broken and asks a fresh one what became of the
/// commit (a network that stalls without closing never answers).
pub const COMMIT_ANSWER_WAIT: Duration = Duration::from_secs(10);

/// A transaction to be looked up should its commit's answer be lost: its
/// id and the session that runs it.
#[derive(Debug, Clone, Copy)]
struct TransactionId {
    xid: i64,
    session: Option<Session>,
}

impl TransactionId {
    /// Of the transaction `tx` runs (one round trip; assigns it an id).
    async fn of(tx: &mut Tx<'_>) -> Result<Self, sqlx::Error> {
        let row = sqlx::query!(
            r#"SELECT txid_current() AS "xid!", pg_backend_pid() AS "pid!",
                      (SELECT backend_start FROM pg_stat_activity WHERE pid = pg_backend_pid()) AS started"#
        )
        .fetch_one(&mut *tx)
        .await?;
        let session = match (tx.is_ours(), row.started) {
            (true, Some(started)) => Some(Session {
                pid: row.pid,
                started,
            }),
            _ => None,
        };
        Ok(Self {
            xid: row.xid,
            session,
        })
    }

    /// Whether it committed, asked on a fresh connection once the server
    /// answers (after its session ended); None when that took longer than
    /// `IN_DOUBT_PATIENCE`. A "committed" id counts only once `witness`
    /// finds the transaction's own rows.
    async fn committed(self, db: &Db, witness: &impl Witness) -> Option<bool> {
        once_answering(db, IN_DOUBT_PATIENCE, self.session, |mut conn| async move {
            let status = match sqlx::query_scalar!(r#"SELECT txid_status($1) AS status"#, self.xid)
                .fetch_one(&mut conn)
                .await
            {
                Ok(status) => status,
                // Past every id the server knows: after a crash the ids of
                // transactions whose records never reached the disk are
                // handed out again. Had it committed, its commit record
                // would have carried the server past it: it did not.
                Err(e) if beyond_the_servers_ids(&e) => return Ok(false),
                Err(e) => return Err(e),
            };
            match status.as_deref() {
                Some("committed") => witness.written_by(&mut conn, self.xid).await,
                Some("aborted") => Ok(false),
                // Still running (behind a pooler, where its session is not
                // ours to end) or forgotten: asked again.
                _ => Err(sqlx::Error::Protocol(format!(
                    "transaction {} still {status:?}",
                    self.xid
                ))),
            }
        })
        .await
    }
}

/// `txid_status` of an id the server has not handed out (yet).
fn beyond_the_servers_ids(e: &sqlx::Error) -> bool {
    sqlstate::of(e).as_deref() == Some("22023")
        && e.as_database_error()
            .is_some_and(|d| d.message().contains("is in the future"))
}

/// Whether transaction `xid` (`txid_current()`), run by `session`,
/// committed: asked on a fresh connection once the server answers, after
/// that session ended; None when Postgres did not say within
/// `IN_DOUBT_PATIENCE`.
pub async fn transaction_committed(
    db: &Db,
    xid: i64,
    session: Option<Session>,
    witness: &impl Witness,
) -> Option<bool> {
    TransactionId { xid, session }.committed(db, witness).await
}

/// What tells a transaction's commit from another's under the same id.
/// After a crash the server hands out again the ids of transactions whose
/// records never reached the disk, so "committed" may be the status of a
/// stranger that took the id of ours: a row only ours could have written
/// (its `xmin` our id) settles it.
pub trait Witness: Sync {
    /// Whether transaction `xid`, which the server says committed, wrote
    /// the rows this witness knows of.
    fn written_by(
        &self,
        conn: &mut Conn,
        xid: i64,
    ) -> impl std::future::Future<Output = Result<bool, sqlx::Error>> + Send;
}

/// No row to look for: the server's "committed" is taken as it is said.
pub struct Unwitnessed;

impl Witness for Unwitnessed {
    async fn written_by(&self, _: &mut Conn, _: i64) -> Result<bool, sqlx::Error> {
        Ok(true)
    }
}

/// The 32-bit transaction id a row's `xmin` shows for `xid` (a
/// `txid_current()`, which carries the epoch above it).
pub fn xmin_of(xid: i64) -> String {
    (xid & 0xffff_ffff).to_string()
}

/// Runs `work` in a transaction whose commit answers a request, so that an
/// error means nothing was written: the request's commitment
/// (`crate::infra::commitment`) is asked before the `COMMIT` is sent (a request
/// withdrawn at its deadline rolls back), and a `COMMIT` whose answer was
/// lost (the connection broke, or gave no answer within
/// `COMMIT_ANSWER_WAIT`) is looked up by its transaction id on a fresh
/// connection: committed (and found by `witness`), the request gets its
/// answer; not, its error.
/// Only when Postgres does not say within `IN_DOUBT_PATIENCE` is the
/// outcome unknown (`NotAnswered::Unknown`).
pub async fn answer_in_transaction<T, E>(
    db: &Db,
    witness: &impl Witness,
    work: impl AsyncFnOnce(&mut Tx<'_>) -> Result<T, E>,
) -> Answered<T, E>
where
    E: From<sqlx::Error> + From<crate::infra::commitment::NotAnswered>,
{
    use crate::infra::commitment::{Commitment, NotAnswered};
    // Nothing sent can have committed before the COMMIT: any error until
    // then (a lost connection included) is NotWritten.
    let mut conn = match db.acquire().await {
        Ok(conn) => conn,
        Err(e) => return Answered::NotWritten(e.into()),
    };
    let mut tx = match conn.begin().await {
        Ok(tx) => tx,
        Err(e) => return Answered::NotWritten(e.into()),
    };
    let id = match TransactionId::of(&mut tx).await {
        Ok(id) => id,
        Err(e) => return Answered::NotWritten(e.into()),
    };
    let done = match work(&mut tx).await {
        Ok(done) => done,
        Err(e) => {
            let _ = tx.rollback().await;
            return Answered::NotWritten(e);
        }
    };
    let commitment = Commitment::current();
    if commitment.as_ref().is_some_and(|c| !c.begin_send()) {
        let _ = tx.rollback().await;
        return Answered::NotWritten(NotAnswered::Withdrawn.into());
    }
    let not_written = || {
        if let Some(commitment) = &commitment {
            commitment.not_written();
        }
    };
    let error = match tokio::time::timeout(COMMIT_ANSWER_WAIT, tx.commit()).await {
        Ok(Ok(())) => return Answered::Committed(done),
        Ok(Err(e)) if !may_have_committed(&e) => {
            not_written();
            return Answered::NotWritten(e.into());
        }
        Ok(Err(e)) => e,
        Err(_) => sqlx::Error::Io(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            "no answer to COMMIT",
        )),
    };
    // The connection may be mid-answer: closed, never reused.
    conn.discard();
    match id.committed(db, witness).await {
        Some(true) => Answered::Committed(done),
        Some(false) => {
            not_written();
            Answered::NotWritten(error.into())
        }
        None => Answered::Unknown(NotAnswered::Unknown(error.to_string()).into()),
    }
}

/// What became of a request's transaction ([`answer_in_transaction`]).
#[derive(Debug)]
pub enum Answered<T, E> {
    Committed(T),
    /// Surely not committed: nothing of it was written.
    NotWritten(E),
    /// Its `COMMIT` was sent and nobody could say whether it landed.
    Unknown(E),
}

impl<T, E> Answered<T, E> {
    pub fn into_result(self) -> Result<T, E> {
        match self {
            Answered::Committed(done) => Ok(done),
            Answered::NotWritten(e) | Answered::Unknown(e) => Err(e),
        }
    }
}

/// Applies the migrations not applied yet, in sqlx's bookkeeping table
/// (`_sqlx_migrations`), all in one transaction that holds a
/// transaction-scoped advisory lock: instances started together apply them
/// once, and a pooler can neither keep the lock on a server connection nor
/// hand a half-migrated schema to anyone. (sqlx's own migrator takes a
/// session lock and leaves named statements behind.) The SQL of each
/// migration runs as a simple query, which needs no prepared statement.
pub async fn migrate(db: &Db) -> Result<(), sqlx::migrate::MigrateError> {
    use sqlx::migrate::MigrateError;
    let mut tx = db.begin().await?;
    sqlx::query("SELECT pg_advisory_xact_lock(hashtextextended('idpool:migrations', 0))")
        .execute(&mut tx)
        .await?;
    sqlx::raw_sql(
        "CREATE TABLE IF NOT EXISTS _sqlx_migrations (
            version BIGINT PRIMARY KEY,
            description TEXT NOT NULL,
            installed_on TIMESTAMPTZ NOT NULL DEFAULT now(),
            success BOOLEAN NOT NULL,
            checksum BYTEA NOT NULL,
            execution_time BIGINT NOT NULL
        )",
    )
    .execute(&mut tx)
    .await?;
    let applied: Vec<(i64, Vec<u8>, bool)> =
        sqlx::query_as("SELECT version, checksum, success FROM _sqlx_migrations")
            .fetch_all(&mut tx)
            .await?;
    let applied: std::collections::HashMap<i64, (Vec<u8>, bool)> = applied
        .into_iter()
        .map(|(version, checksum, success)| (version, (checksum, success)))
        .collect();
    for migration in MIGRATOR.iter() {
        if !migration.migration_type.is_up_migration() {
            continue;
        }
        match applied.get(&migration.version) {
            Some((_, false)) => return Err(MigrateError::Dirty(migration.version)),
            Some((checksum, true)) if checksum[..] != migration.checksum[..] => {
                return Err(MigrateError::VersionMismatch(migration.version));
            }
            Some(_) => continue,
            None => {}
        }
        let started = Instant::now();
        sqlx::raw_sql(migration.sql.clone())
            .execute(&mut tx)
            .await
            .map_err(|e| MigrateError::ExecuteMigration(e, migration.version))?;
        sqlx::query(
            "INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time)
             VALUES ($1, $2, TRUE, $3, $4)",
        )
        .bind(migration.version)
        .bind(&*migration.description)
        .bind(&*migration.checksum)
        .bind(started.elapsed().as_nanos() as i64)
        .execute(&mut tx)
        .await?;
    }
    tx.commit().await?;
    Ok(())
}

/// Asynchronous replication can lose the last commits in a failover; idpool
/// fences what it can (see `PoolService::resync`), synchronous replication
/// loses nothing. Says so when the primary has replicas but none is
/// synchronous.
pub async fn warn_without_synchronous_standby(db: &Db) {
    let seen = sqlx::query!(
        r#"SELECT (SELECT count(*) FROM pg_stat_replication) AS "replicas!",
                  current_setting('synchronous_standby_names') AS "names!""#
    )
    .fetch_one(db)
    .await
    .map(|r| (r.replicas, r.names));
    if let Ok((replicas, names)) = seen
        && replicas > 0
        && names.trim().is_empty()
    {
        tracing::warn!(
            replicas,
            "Postgres replicates asynchronously (synchronous_standby_names is empty): a failover \
             may lose the last commits; idpool then moves its counters past what Redis has seen, \
             and numbers taken directly from Postgres meanwhile may be lost. Set a synchronous \
             standby to lose nothing"
        );
    }
}

/// The SQLSTATE codes idpool tells apart (Postgres, appendix A).
pub mod sqlstate {
    /// Class 22, data exception: a value the database cannot store.
    pub const DATA_EXCEPTION_CLASS: &str = "22";
    /// Class 08, connection exception (PgBouncer's own errors, such as
    /// `query_wait_timeout` or too many clients, are 08P01).
    pub const CONNECTION_EXCEPTION_CLASS: &str = "08";
    /// Class 40, transaction rollback (serialization failure, deadlock).
    pub const TRANSACTION_ROLLBACK_CLASS: &str = "40";
    /// Class 53, insufficient resources.
    pub const INSUFFICIENT_RESOURCES_CLASS: &str = "53";
    /// Class 57, operator intervention (a cancelled statement, a shutdown).
    pub const OPERATOR_INTERVENTION_CLASS: &str = "57";
    pub const DEADLOCK_DETECTED: &str = "40P01";
    /// `lock_timeout` ran out.
    pub const LOCK_NOT_AVAILABLE: &str = "55P03";
    /// `statement_timeout` ran out (or the statement was cancelled).
    pub const QUERY_CANCELED: &str = "57014";
    pub const DUPLICATE_DATABASE: &str = "42P04";
    /// A write on a server that takes none (a standby, a demoted primary).
    pub const READ_ONLY_SQL_TRANSACTION: &str = "25006";
    /// The server ended the session: an admin or crash shutdown, or it
    /// cannot take connections now (starting, a failover).
    pub const ADMIN_SHUTDOWN: &str = "57P01";
    pub const CRASH_SHUTDOWN: &str = "57P02";
    pub const CANNOT_CONNECT_NOW: &str = "57P03";
    /// No space left on the database's disk.
    pub const DISK_FULL: &str = "53100";
    /// `idle_in_transaction_session_timeout` ran out: the server ended the
    /// session and rolled its transaction back (statements held up on
    /// their way, a network that stalls).
    pub const IDLE_IN_TRANSACTION_TIMEOUT: &str = "25P03";

    /// The SQLSTATE of a database error, if `e` is one.
    pub fn of(e: &sqlx::Error) -> Option<String> {
        match e {
            sqlx::Error::Database(db) => db.code().map(|c| c.into_owned()),
            _ => None,
        }
    }
}

/// A new database migrated from `migrations/`, for tests of storage
/// modules: named like the API tests' (`make test` drops those of earlier
/// runs), on the server of `DATABASE_URL`.
#[cfg(test)]
pub(crate) async fn scratch() -> Db {
    let base = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/idpool".to_owned());
    let server = base.split('?').next().and_then(|u| u.rsplit_once('/'));
    let Some((server, _)) = server else {
        panic!("DATABASE_URL {base:?} names no database");
    };
    let name = uuid::Uuid::new_v4().simple().to_string();
    let url = format!("{server}/idpool_test_{}", &name[..16]);
    let pool = connect(&url, 4, Limits::default(), Pooler::None)
        .await
        .expect("a scratch database on the server of DATABASE_URL");
    migrate(&pool).await.expect("migrations");
    pool
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The writers' pool is a sibling of the requests' with a shorter lock
    /// wait, given as a startup parameter: it must win over the one the
    /// requests' options already carry.
    #[tokio::test]
    async fn a_sibling_pool_connects_with_its_own_limits() {
        let db = scratch().await;
        let writers = db
            .sibling(
                1,
                Limits {
                    lock: Duration::from_millis(200),
                    ..Limits::default()
                },
            )
            .await
            .expect("the writers' pool");
        let lock: String = sqlx::query_scalar("SHOW lock_timeout")
            .fetch_one(&writers)
            .await
            .expect("SHOW");
        assert_eq!(lock, "200ms");
        let requests: String = sqlx::query_scalar("SHOW lock_timeout")
            .fetch_one(&db)
            .await
            .expect("SHOW");
        assert_eq!(requests, "2s");
    }
}
