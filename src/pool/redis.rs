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

/// Most numbers one push script appends: about 2 ms of Redis, which every
/// other pool waits for.
pub const PUSH_PART: i64 = 8_192;

/// What became of a block pushed to its pool.
pub enum Pushed {
    /// All of it is in the pool, now this deep.
    All(i64),
    /// The refill lock expired; the numbers from this range on are not in
    /// the pool.
    LockLost(SeqRange),
    /// Redis failed; the numbers from this range on may not be in the pool.
    Failed(RedisFailure, SeqRange),
}
use crate::numbers::SeqRange;
use crate::stats::Stats;

/// The keys of one sequence period's pool. They share the hash tag
/// `{PROJ:9012:20261122}`, so every script on them stays in one cluster slot.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PoolKeys {
    pub pool: String,
    pub meta: String,
    pub lock: String,
}

impl PoolKeys {
    /// A key of the same slot, new each time, for a pool being emptied.
    fn drain_key(&self) -> String {
        let tag = self.pool.strip_suffix(":pool").unwrap_or(&self.pool);
        format!("{tag}:drain:{:016x}", rand::random::<u64>())
    }

    pub fn new(prefix: &str, project: &str, doc_type: &str, period: &str) -> Self {
        let tag = format!("{prefix}:{{{project}:{doc_type}:{period}}}");
        Self {
            pool: format!("{tag}:pool"),
            meta: format!("{tag}:meta"),
            lock: format!("{tag}:lock"),
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

/// What one pop returned.
#[derive(Debug, Clone, Default)]
pub struct Popped {
    pub seqs: Vec<i64>,
    pub depth: i64,
    pub target: i64,
}

/// Depth, target and last refill time seen right after taking the lock.
#[derive(Debug, Clone, Copy)]
pub struct LockedPool {
    pub depth: i64,
    pub target: i64,
    pub refilled_at_ms: i64,
}

struct Scripts {
    pop: Script,
    acquire: Script,
    push: Script,
    release: Script,
    discard: Script,
    trim_above: Script,
    drain: Script,
    claim_prefix: Script,
}

pub struct RedisLink {
    clients: Pool,
    prefix: String,
    options: Options,
    scripts: Scripts,
    up: AtomicBool,
    /// Bumped by every failure, so a resync that overlapped one does not
    /// declare Redis healthy.
    failures: AtomicU64,
    /// What the last failure said, for the watch to report while Redis
    /// stays unreachable (a TLS or password mistake shows here).
    last_failure: std::sync::Mutex<String>,
    wake: Notify,
    stats: Arc<Stats>,
}

pub struct RedisSettings {
    pub url: String,
    pub prefix: String,
    pub clients: usize,
    pub command_timeout: Duration,
}

impl RedisLink {
    /// Builds the clients and starts connecting in the background: the
    /// service serves from Postgres until Redis answers.
    pub fn connect(settings: &RedisSettings, stats: Arc<Stats>) -> anyhow::Result<Arc<Self>> {
        let mut config = super::url::parse(&settings.url)?;
        // Keep retrying a Redis that is down at start instead of failing boot.
        config.fail_fast = false;
        let clients = Builder::from_config(config)
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
            .build_pool(settings.clients.max(1))?;
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
                drain: Script::from_lua(scripts::DRAIN),
                claim_prefix: Script::from_lua(scripts::CLAIM_PREFIX),
            },
            up: AtomicBool::new(false),
            failures: AtomicU64::new(0),
            last_failure: std::sync::Mutex::new(String::new()),
            wake: Notify::new(),
            stats,
        });
        for client in link.clients.clients() {
            let on_error = Arc::downgrade(&link);
            client.on_error(move |(error, _server)| {
                let link = on_error.clone();
                async move {
                    if let Some(link) = link.upgrade() {
                        link.trip(&error.to_string());
                    }
                    Ok(())
                }
            });
            let on_reconnect = Arc::downgrade(&link);
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
        link.clients.connect_pool();
        Ok(link)
    }

    pub fn prefix(&self) -> &str {
        &self.prefix
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
        }
        true
    }

    pub async fn woken(&self) {
        self.wake.notified().await
    }

    pub async fn shutdown(&self) {
        let _ = self.clients.quit().await;
    }

    async fn eval(
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
    async fn guarded<T>(
        &self,
        f: impl Future<Output = Result<T, RedisFailure>>,
    ) -> Result<T, RedisFailure> {
        let result = f.await;
        if let Err(RedisFailure::Command(e)) = &result {
            self.trip(&e.to_string());
        }
        result
    }

    pub async fn pop(&self, keys: &PoolKeys, count: usize) -> Result<Popped, RedisFailure> {
        if !self.is_up() {
            return Err(RedisFailure::Open);
        }
        self.stats.pool_pops.inc();
        self.guarded(async {
            let reply = self
                .eval(
                    &self.scripts.pop,
                    vec![keys.pool.clone(), keys.meta.clone()],
                    vec![count.to_string()],
                )
                .await?;
            let mut parts = array(reply)?.into_iter();
            let seqs = match parts.next() {
                Some(Value::Array(values)) => {
                    values.into_iter().filter_map(|v| integer(&v)).collect()
                }
                Some(Value::Null) | None => Vec::new(),
                Some(other) => return Err(RedisFailure::Reply(format!("pop list: {other:?}"))),
            };
            let depth = parts.next().as_ref().and_then(integer).unwrap_or(0);
            let target = parts.next().as_ref().and_then(integer).unwrap_or(0);
            Ok(Popped {
                seqs,
                depth,
                target,
            })
        })
        .await
    }

    /// Takes the pool's refill lock; `None` when another holder has it.
    pub async fn acquire(
        &self,
        keys: &PoolKeys,
        token: &str,
        ttl: Duration,
    ) -> Result<Option<LockedPool>, RedisFailure> {
        self.guarded(async {
            let reply = self
                .eval(
                    &self.scripts.acquire,
                    vec![keys.lock.clone(), keys.pool.clone(), keys.meta.clone()],
                    vec![token.to_owned(), ttl.as_millis().to_string()],
                )
                .await?;
            if matches!(reply, Value::Null | Value::Boolean(false)) {
                return Ok(None);
            }
            let parts = array(reply)?;
            let get = |i: usize| parts.get(i).and_then(integer).unwrap_or(0);
            Ok(Some(LockedPool {
                depth: get(0),
                target: get(1),
                refilled_at_ms: get(2),
            }))
        })
        .await
    }

    /// Appends `block` and releases the lock. The block goes in parts of at
    /// most [`PUSH_PART`] numbers, one script each, so other pools' pops run
    /// between them; what a lost lock or a failure left out is reported.
    pub async fn push(
        &self,
        keys: &PoolKeys,
        token: &str,
        block: SeqRange,
        target: i64,
        now_ms: i64,
    ) -> Pushed {
        let mut start = block.start;
        loop {
            let end = start.saturating_add(PUSH_PART).min(block.end);
            let last = end >= block.end;
            let part = self
                .guarded(async {
                    let reply = self
                        .eval(
                            &self.scripts.push,
                            vec![keys.lock.clone(), keys.pool.clone(), keys.meta.clone()],
                            vec![
                                token.to_owned(),
                                start.to_string(),
                                end.to_string(),
                                target.to_string(),
                                now_ms.to_string(),
                                if last { "1" } else { "0" }.to_owned(),
                            ],
                        )
                        .await?;
                    integer(&reply).ok_or_else(|| RedisFailure::Reply(format!("push: {reply:?}")))
                })
                .await;
            let rest = SeqRange {
                start,
                end: block.end,
            };
            match part {
                Err(e) => return Pushed::Failed(e, rest),
                Ok(depth) if depth < 0 => return Pushed::LockLost(rest),
                Ok(depth) if last => return Pushed::All(depth),
                Ok(_) => start = end,
            }
        }
    }

    pub async fn release(&self, keys: &PoolKeys, token: &str) -> Result<(), RedisFailure> {
        self.guarded(async {
            self.eval(
                &self.scripts.release,
                vec![keys.lock.clone()],
                vec![token.to_owned()],
            )
            .await
            .map(|_| ())
        })
        .await
    }

    /// Empties the pool (with `keep_if_filled_here`, only if the server
    /// holding it did not fill it: a restart, a promoted replica), returning
    /// the numbers it held. The pool is emptied in one step; its numbers are
    /// then read back in parts of [`PUSH_PART`], so that no script holds
    /// Redis for long. Parts a failure left unread are logged and expire.
    pub async fn discard(
        &self,
        keys: &PoolKeys,
        keep_if_filled_here: bool,
    ) -> Result<Vec<SeqRange>, RedisFailure> {
        let mode = if keep_if_filled_here {
            "foreign"
        } else {
            "all"
        };
        let drain = keys.drain_key();
        let moved = self
            .guarded(async {
                let reply = self
                    .eval(
                        &self.scripts.discard,
                        vec![keys.pool.clone(), keys.meta.clone(), drain.clone()],
                        vec![mode.to_owned()],
                    )
                    .await?;
                Ok(integer(&reply) == Some(1))
            })
            .await?;
        let mut ranges: Vec<SeqRange> = Vec::new();
        if !moved {
            return Ok(ranges);
        }
        loop {
            let part = self
                .guarded(async {
                    let reply = self
                        .eval(
                            &self.scripts.drain,
                            vec![drain.clone()],
                            vec![PUSH_PART.to_string()],
                        )
                        .await?;
                    counted_runs(reply)
                })
                .await;
            match part {
                Ok((left, runs)) => {
                    merge_runs(&mut ranges, runs);
                    if left <= 0 {
                        break;
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, pool = %keys.pool, drained = ?ranges,
                        "emptied pool only partly read back; the rest goes unrecorded");
                    break;
                }
            }
        }
        Ok(ranges)
    }

    /// Removes the numbers above `max` and returns them, [`PUSH_PART`] at
    /// a time.
    pub async fn trim_above(
        &self,
        keys: &PoolKeys,
        max: i64,
    ) -> Result<Vec<SeqRange>, RedisFailure> {
        let mut ranges: Vec<SeqRange> = Vec::new();
        loop {
            let (more, runs) = self
                .guarded(async {
                    let reply = self
                        .eval(
                            &self.scripts.trim_above,
                            vec![keys.pool.clone()],
                            vec![max.to_string(), PUSH_PART.to_string()],
                        )
                        .await?;
                    counted_runs(reply)
                })
                .await?;
            merge_runs(&mut ranges, runs);
            if more == 0 {
                return Ok(ranges);
            }
        }
    }

    /// Puts numbers back at the head of the pool, lowest first.
    pub async fn give_back(&self, keys: &PoolKeys, seqs: &[i64]) -> Result<(), RedisFailure> {
        if !self.is_up() {
            return Err(RedisFailure::Open);
        }
        let mut descending: Vec<String> = seqs.iter().map(i64::to_string).collect();
        descending.reverse();
        self.guarded(async {
            let client = self.clients.next().with_options(&self.options);
            let _: i64 = client.lpush(keys.pool.as_str(), descending).await?;
            Ok(())
        })
        .await
    }

    /// The lowest number waiting in the pool, if any.
    pub async fn head(&self, keys: &PoolKeys) -> Result<Option<i64>, RedisFailure> {
        self.guarded(async {
            let client = self.clients.next().with_options(&self.options);
            let head: Option<String> = client.lindex(keys.pool.as_str(), 0).await?;
            Ok(head.and_then(|h| h.parse().ok()))
        })
        .await
    }

    pub async fn depth(&self, keys: &PoolKeys) -> Result<i64, RedisFailure> {
        self.guarded(async {
            let client = self.clients.next().with_options(&self.options);
            Ok(client.llen(keys.pool.as_str()).await?)
        })
        .await
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

    /// The highest block end ever pushed into the pool; 0 when none.
    pub async fn max_end(&self, keys: &PoolKeys) -> Result<i64, RedisFailure> {
        self.guarded(async {
            let client = self.clients.next().with_options(&self.options);
            let value: Option<String> = client.hget(keys.meta.as_str(), "max_end").await?;
            Ok(value.and_then(|v| v.parse().ok()).unwrap_or(0))
        })
        .await
    }

    /// Waits up to `limit` for the pools to be in use; whether they are.
    pub async fn wait_up(&self, limit: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + limit;
        while !self.is_up() {
            if tokio::time::Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        true
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

fn array(value: Value) -> Result<Vec<Value>, RedisFailure> {
    match value {
        Value::Array(values) => Ok(values),
        Value::Null => Ok(Vec::new()),
        other => Err(RedisFailure::Reply(format!(
            "expected an array, got {other:?}"
        ))),
    }
}

/// A script's `{count, {first, last, first, last, ...}}` answer.
fn counted_runs(reply: Value) -> Result<(i64, Vec<SeqRange>), RedisFailure> {
    let mut parts = array(reply)?.into_iter();
    let count = parts
        .next()
        .as_ref()
        .and_then(integer)
        .ok_or_else(|| RedisFailure::Reply("expected a count".into()))?;
    let bounds: Vec<i64> = match parts.next() {
        Some(runs) => array(runs)?.iter().filter_map(integer).collect(),
        None => Vec::new(),
    };
    Ok((
        count,
        bounds
            .chunks_exact(2)
            .map(|pair| SeqRange::new(pair[0], pair[1] + 1))
            .collect(),
    ))
}

/// Adds `runs` to `ranges`, joining a run that continues the one before.
fn merge_runs(ranges: &mut Vec<SeqRange>, runs: Vec<SeqRange>) {
    for run in runs {
        match ranges.last_mut() {
            Some(last) if last.end == run.start => last.end = run.end,
            Some(last) if run.end == last.start => last.start = run.start,
            _ => ranges.push(run),
        }
    }
}

fn integer(value: &Value) -> Option<i64> {
    match value {
        Value::Integer(i) => Some(*i),
        Value::String(s) => s.parse().ok(),
        Value::Bytes(b) => std::str::from_utf8(b).ok()?.parse().ok(),
        Value::Double(d) if d.fract() == 0.0 => Some(*d as i64),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pool_keys_share_one_hash_tag_and_parse_back() {
        let keys = PoolKeys::new("idpool", "PROJ", "9012", "20261122");
        assert_eq!(keys.pool, "idpool:{PROJ:9012:20261122}:pool");
        assert_eq!(keys.lock, "idpool:{PROJ:9012:20261122}:lock");
        assert_eq!(
            PoolKeys::parse_pool_key("idpool", &keys.pool),
            Some(("PROJ", "9012", "20261122"))
        );
        let never = PoolKeys::new("t1", "P", "T", "");
        assert_eq!(
            PoolKeys::parse_pool_key("t1", &never.pool),
            Some(("P", "T", ""))
        );
        assert_eq!(PoolKeys::parse_pool_key("other", &never.pool), None);
    }
}
