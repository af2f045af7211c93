//! The connection to Redis: fred clients, the pool scripts, and the circuit
//! breaker that decides whether pools may be used at all.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use fred::prelude::*;
use fred::types::scripts::Script;
use futures::StreamExt;
use tokio::sync::Notify;

use super::scripts;

use crate::infra::stats::Stats;

/// The keys of one sequence period's pool. They share the hash tag
/// `{PROJ:9012:20261122}`, so every script on them stays in one cluster slot.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PoolKeys {
    pub pool: String,
    pub meta: String,
    pub lock: String,
    /// What pops took, by token, until their callers have their answers
    /// (see `scripts::POP`).
    pub inflight: String,
}

impl PoolKeys {
    /// A key of the same slot, new each time, for a pool being emptied.
    pub(super) fn drain_key(&self) -> String {
        let tag = self.pool.strip_suffix(":pool").unwrap_or(&self.pool);
        format!("{tag}:drain:{:016x}", rand::random::<u64>())
    }

    pub fn new(prefix: &str, project: &str, doc_type: &str, period: &str) -> Self {
        let tag = format!("{prefix}:{{{project}:{doc_type}:{period}}}");
        Self {
            pool: format!("{tag}:pool"),
            meta: format!("{tag}:meta"),
            lock: format!("{tag}:lock"),
            inflight: format!("{tag}:inflight"),
        }
    }

    /// Reads (project, type, period) back from a pool key of `prefix`.
    pub fn parse_pool_key<'a>(prefix: &str, key: &'a str) -> Option<(&'a str, &'a str, &'a str)> {
        Self::parse_key(prefix, key, "}:pool")
    }

    /// The same for a meta key (which outlives an emptied pool).
    pub fn parse_meta_key<'a>(prefix: &str, key: &'a str) -> Option<(&'a str, &'a str, &'a str)> {
        Self::parse_key(prefix, key, "}:meta")
    }

    fn parse_key<'a>(
        prefix: &str,
        key: &'a str,
        suffix: &str,
    ) -> Option<(&'a str, &'a str, &'a str)> {
        let tag = key
            .strip_prefix(prefix)?
            .strip_prefix(":{")?
            .strip_suffix(suffix)?;
        let mut parts = tag.splitn(3, ':');
        Some((parts.next()?, parts.next()?, parts.next()?))
    }
}

#[derive(Debug, Clone, thiserror::Error)]
pub enum RedisFailure {
    #[error("Redis is not in use (circuit open)")]
    Open,
    #[error("Redis: {0}")]
    Command(#[from] fred::error::Error),
    #[error("Redis answered something unexpected: {0}")]
    Reply(String),
    #[error(
        "the Redis key prefix {prefix:?} belongs to another database (installation {owner}); \
         give each database its own IDPOOL_REDIS_PREFIX. Serving from Postgres meanwhile"
    )]
    ForeignPrefix { prefix: String, owner: String },
}

pub(super) struct Scripts {
    pub(super) pop: Script,
    pub(super) acquire: Script,
    pub(super) push: Script,
    pub(super) release: Script,
    pub(super) discard: Script,
    pub(super) trim_above: Script,
    pub(super) give_back: Script,
    pub(super) drain: Script,
    pub(super) claim_prefix: Script,
    pub(super) resolve_pop: Script,
    pub(super) clock: Script,
    pub(super) depth: Script,
    pub(super) sweep: Script,
}

/// Pops whose answers arrived (their tokens are forgotten with the next
/// pop of the same pool), and pops whose callers got no answer (settled
/// before the pools are used again).
#[derive(Default)]
pub(super) struct PopBook {
    pub(super) to_forget: std::collections::HashMap<String, Vec<String>>,
    pub(super) in_doubt: Vec<(PoolKeys, String)>,
}

pub struct RedisLink {
    pub(super) clients: Pool,
    prefix: String,
    pub(super) options: Options,
    pub(super) scripts: Scripts,
    up: AtomicBool,
    /// Woken when the pools come into use.
    came_up: Notify,
    /// Bumped by every failure, so a resync that overlapped one does not
    /// declare Redis healthy.
    failures: AtomicU64,
    /// What the last failure said, for the watch to report while Redis
    /// stays unreachable (a TLS or password mistake shows here).
    last_failure: std::sync::Mutex<String>,
    wake: Notify,
    pub(super) stats: Arc<Stats>,
    pub(super) pops: std::sync::Mutex<PopBook>,
    /// The server's clock less ours, in ms, as last seen (a pop's deadline
    /// is set on the server's clock); None until first seen.
    pub(super) clock_offset_ms: std::sync::Mutex<Option<i64>>,
    pub(super) command_timeout: Duration,
    /// How long after its first try a give-back may still land (ms; see
    /// `scripts::GIVE_BACK`): less than a pool's idle time, so none lands
    /// in a pool given back meanwhile.
    give_back_window_ms: AtomicU64,
}

/// The give-back window until the pools' service sets its own.
const DEFAULT_GIVE_BACK_WINDOW: Duration = Duration::from_secs(30);

pub struct RedisSettings {
    pub url: String,
    pub prefix: String,
    pub clients: usize,
    pub command_timeout: Duration,
}

/// The fred clients: retrying a Redis that is down, never replaying a
/// command, each command within its timeout.
fn clients(settings: &RedisSettings) -> anyhow::Result<Pool> {
    let mut config = super::url::parse(&settings.url)?;
    // Keep retrying a Redis that is down at start instead of failing boot.
    config.fail_fast = false;
    Ok(Builder::from_config(config)
        .with_connection_config(|c| {
            c.connection_timeout = Duration::from_secs(1);
            c.internal_command_timeout = Duration::from_secs(2);
            // A command is never replayed on a new connection: after a
            // reconnect the pools must be checked before anything pops.
            c.max_command_attempts = 1;
            // Pops of concurrent batches share a connection; Nagle
            // would hold each small command back until the reply to
            // the one before it arrived.
            c.tcp = fred::types::config::TcpConfig {
                nodelay: Some(true),
                ..Default::default()
            };
            // A server that stops answering (hung, or cut off) gets its
            // connection closed and reopened, so nothing queued on it is
            // answered late, and the reconnect makes the pools checked.
            c.unresponsive = fred::types::config::UnresponsiveConfig {
                max_timeout: Some(settings.command_timeout * 2),
                interval: (settings.command_timeout / 2).max(Duration::from_millis(50)),
            };
        })
        .with_performance_config(|p| {
            p.default_command_timeout = settings.command_timeout;
        })
        .set_policy(ReconnectPolicy::new_exponential(0, 50, 2_000, 2))
        .build_pool(settings.clients.max(1))?)
}

impl RedisLink {
    /// Builds the clients and starts connecting in the background: the
    /// service serves from Postgres until Redis answers.
    pub fn connect(settings: &RedisSettings, stats: Arc<Stats>) -> anyhow::Result<Arc<Self>> {
        let clients = clients(settings)?;
        let link = Arc::new(Self {
            clients,
            prefix: settings.prefix.clone(),
            options: Options {
                fail_fast: true,
                max_attempts: Some(1),
                timeout: Some(settings.command_timeout),
                ..Default::default()
            },
            scripts: Scripts {
                pop: Script::from_lua(scripts::POP),
                acquire: Script::from_lua(scripts::ACQUIRE),
                push: Script::from_lua(scripts::PUSH),
                release: Script::from_lua(scripts::RELEASE),
                discard: Script::from_lua(scripts::DISCARD),
                trim_above: Script::from_lua(scripts::TRIM_ABOVE),
                give_back: Script::from_lua(scripts::GIVE_BACK),
                drain: Script::from_lua(scripts::DRAIN),
                claim_prefix: Script::from_lua(scripts::CLAIM_PREFIX),
                resolve_pop: Script::from_lua(scripts::RESOLVE_POP),
                clock: Script::from_lua(scripts::CLOCK),
                depth: Script::from_lua(scripts::DEPTH),
                sweep: Script::from_lua(scripts::SWEEP),
            },
            up: AtomicBool::new(false),
            came_up: Notify::new(),
            failures: AtomicU64::new(0),
            last_failure: std::sync::Mutex::new(String::new()),
            wake: Notify::new(),
            stats,
            pops: Default::default(),
            clock_offset_ms: Default::default(),
            command_timeout: settings.command_timeout,
            give_back_window_ms: AtomicU64::new(DEFAULT_GIVE_BACK_WINDOW.as_millis() as u64),
        });
        link.watch_connections();
        link.clients.connect_pool();
        Ok(link)
    }

    /// Every connection's failure trips the breaker; every reconnect
    /// (the first connection too) has the pools checked again.
    fn watch_connections(self: &Arc<Self>) {
        for client in self.clients.clients() {
            let on_error = Arc::downgrade(self);
            client.on_error(move |(error, _server)| {
                let link = on_error.clone();
                async move {
                    if let Some(link) = link.upgrade() {
                        link.trip(&error.to_string());
                    }
                    Ok(())
                }
            });
            let on_reconnect = Arc::downgrade(self);
            client.on_reconnect(move |_server| {
                let link = on_reconnect.clone();
                async move {
                    if let Some(link) = link.upgrade() {
                        // Stop popping until the pools were checked against
                        // the server we are now talking to. (fred calls this
                        // for the first connection too: nothing failed.)
                        link.recheck();
                    }
                    Ok(())
                }
            });
        }
    }

    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    pub(super) fn give_back_window(&self) -> Duration {
        Duration::from_millis(self.give_back_window_ms.load(Ordering::Relaxed))
    }

    /// Give-backs land within `window` of their first try (the pools'
    /// service sets it below their idle time).
    pub fn set_give_back_window(&self, window: Duration) {
        self.give_back_window_ms
            .store(window.as_millis() as u64, Ordering::Relaxed);
    }

    pub fn keys(&self, project: &str, doc_type: &str, period: &str) -> PoolKeys {
        PoolKeys::new(&self.prefix, project, doc_type, period)
    }

    pub fn is_up(&self) -> bool {
        self.up.load(Ordering::Acquire)
    }

    /// Opens the circuit: requests take numbers from Postgres until a resync.
    pub fn trip(&self, why: &str) {
        self.failures.fetch_add(1, Ordering::AcqRel);
        why.clone_into(&mut self.last_failure.lock().unwrap_or_else(|e| e.into_inner()));
        if self.up.swap(false, Ordering::AcqRel) {
            self.stats.redis_trips.inc();
            tracing::warn!(reason = why, "redis unavailable, serving from postgres");
        }
        self.wake.notify_one();
    }

    /// A (re)connection: the connection is fine, but the pools must be
    /// checked against the server before anything pops.
    pub fn recheck(&self) {
        self.failures.fetch_add(1, Ordering::AcqRel);
        self.last_failure
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clear();
        if self.up.swap(false, Ordering::AcqRel) {
            self.stats.redis_trips.inc();
            tracing::warn!("redis reconnected; checking the pools before using them again");
        }
        self.wake.notify_one();
    }

    pub fn failure_count(&self) -> u64 {
        self.failures.load(Ordering::Acquire)
    }

    /// Closes the circuit unless a failure happened since `failures_before`.
    pub fn mark_up(&self, failures_before: u64) -> bool {
        if self.failures.load(Ordering::Acquire) != failures_before {
            return false;
        }
        if !self.up.swap(true, Ordering::AcqRel) {
            tracing::info!("redis pools in use");
            self.came_up.notify_waiters();
        }
        true
    }

    pub async fn woken(&self) {
        self.wake.notified().await
    }

    pub async fn shutdown(&self) {
        let _ = self.clients.quit().await;
    }

    pub(super) async fn eval(
        &self,
        script: &Script,
        keys: Vec<String>,
        args: Vec<String>,
    ) -> Result<Value, RedisFailure> {
        let client = self.clients.next().with_options(&self.options);
        let result: Result<Value, _> = client
            .evalsha(script.sha1().clone(), keys.clone(), args.clone())
            .await;
        match result {
            Err(e) if e.details().starts_with("NOSCRIPT") => {
                let source = script.lua().cloned().unwrap_or_default();
                Ok(client.eval(source, keys, args).await?)
            }
            other => Ok(other?),
        }
    }

    /// Runs `f` and trips the circuit when Redis fails.
    pub(super) async fn guarded<T>(
        &self,
        f: impl Future<Output = Result<T, RedisFailure>>,
    ) -> Result<T, RedisFailure> {
        let result = f.await;
        if let Err(RedisFailure::Command(e)) = &result {
            self.trip(&e.to_string());
        }
        result
    }

    /// Direct access for operations and tests (push a stale list, flush).
    pub fn client(&self) -> &Client {
        self.clients.next()
    }

    /// Whether every client of the pool has a live connection.
    pub fn last_failure(&self) -> String {
        self.last_failure
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    pub fn all_connected(&self) -> bool {
        self.clients.clients().iter().all(|c| c.is_connected())
    }

    pub async fn ping(&self) -> Result<(), RedisFailure> {
        let client = self.clients.next().with_options(&self.options);
        let _: Value = client.ping(None).await?;
        Ok(())
    }

    /// Waits up to `limit` for the pools to be in use; whether they are.
    pub async fn wait_up(&self, limit: Duration) -> bool {
        let up = async {
            loop {
                // Registered before the flag is read, so coming up in
                // between still wakes this.
                let came_up = self.came_up.notified();
                tokio::pin!(came_up);
                came_up.as_mut().enable();
                if self.is_up() {
                    return;
                }
                came_up.await;
            }
        };
        tokio::time::timeout(limit, up).await.is_ok()
    }

    /// Makes sure the key prefix is ours: the first database to use it owns it.
    pub async fn claim_prefix(&self, installation: &str) -> Result<(), RedisFailure> {
        let reply = self
            .eval(
                &self.scripts.claim_prefix,
                vec![format!("{}:installation", self.prefix)],
                vec![installation.to_owned()],
            )
            .await?;
        let owner = match reply {
            Value::String(s) => s.to_string(),
            Value::Bytes(b) => String::from_utf8_lossy(&b).into_owned(),
            other => return Err(RedisFailure::Reply(format!("prefix owner: {other:?}"))),
        };
        if owner == installation {
            Ok(())
        } else {
            Err(RedisFailure::ForeignPrefix {
                prefix: self.prefix.clone(),
                owner,
            })
        }
    }

    /// Every pool key under our prefix, or of one sequence's periods.
    pub async fn pool_keys(&self, of: Option<(&str, &str)>) -> Result<Vec<String>, RedisFailure> {
        let pattern = match of {
            // Codes are [A-Za-z0-9_]: nothing in them is special to a glob.
            Some((project, doc_type)) => format!("{}:{{{project}:{doc_type}:*}}:pool", self.prefix),
            None => format!("{}:{{*}}:pool", self.prefix),
        };
        self.scan(pattern).await
    }

    /// Every pool's meta key (they outlive emptied pools).
    pub async fn meta_keys(&self) -> Result<Vec<String>, RedisFailure> {
        self.scan(format!("{}:{{*}}:meta", self.prefix)).await
    }

    /// Keys matching `pattern` on every node.
    async fn scan(&self, pattern: String) -> Result<Vec<String>, RedisFailure> {
        let client = self.clients.next();
        let mut keys = Vec::new();
        let mut stream = if client.is_clustered() {
            client
                .scan_cluster_buffered(pattern, Some(1000), None)
                .boxed()
        } else {
            client.scan_buffered(pattern, Some(1000), None).boxed()
        };
        while let Some(key) = stream.next().await {
            if let Some(key) = key?.as_str() {
                keys.push(key.to_owned());
            }
        }
        Ok(keys)
    }
}

#[cfg(test)]
mod tests;
