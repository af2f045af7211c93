//! The circuit watch: after a Redis failure or reconnect, the pools are
//! checked (and Postgres fenced past anything Redis has seen) before
//! requests use them again; a Postgres failover stops them the same way.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use super::{DiscardCause, Discards, PoolKeys, PoolLists, PoolSettings, RedisFailure, RedisLink};
use crate::domain::sequence::{ProjectCode, TypeCode};
use crate::infra::backoff::Backoff;
use crate::infra::stats::Stats;
use crate::records::counter::{Counter, PostgresIdentity};
use crate::records::sequence_store::SequenceStore;

/// The circuit watch of the pools.
pub struct PoolWatch {
    redis: Arc<RedisLink>,
    lists: PoolLists,
    counter: Arc<Counter>,
    sequences: Arc<SequenceStore>,
    stats: Arc<Stats>,
    settings: PoolSettings,
    discards: Arc<Discards>,
    /// Which Postgres the last resync checked the pools against.
    postgres_seen: Mutex<Option<PostgresIdentity>>,
}

impl PoolWatch {
    pub(super) fn new(
        redis: Arc<RedisLink>,
        counter: Arc<Counter>,
        sequences: Arc<SequenceStore>,
        stats: Arc<Stats>,
        settings: PoolSettings,
        discards: Arc<Discards>,
    ) -> Self {
        Self {
            lists: PoolLists::new(redis.clone()),
            redis,
            counter,
            sequences,
            stats,
            settings,
            discards,
            postgres_seen: Mutex::new(None),
        }
    }

    /// After any (re)connect, before a single number is popped again: each
    /// pool not filled on the server now holding it (a restarted node, a
    /// promoted replica with a stale list) is emptied and its numbers
    /// recorded; then Postgres is checked against what Redis has seen.
    pub async fn resync(&self) -> Result<Resynced, ResyncError> {
        self.stats.redis_resyncs.inc();
        self.redis.claim_prefix(&self.settings.installation).await?;
        self.lists.read_server_clock().await?;
        // Numbers of pops whose answers were lost go back before any pool
        // is judged or used.
        self.lists.resolve_pops_in_doubt().await?;
        let mut resynced = Resynced::default();
        for key in self.redis.pool_keys(None).await? {
            let Some((project, doc_type, period)) =
                PoolKeys::parse_pool_key(self.redis.prefix(), &key)
            else {
                continue;
            };
            let keys = self.redis.keys(project, doc_type, period);
            let ranges = self.lists.discard(&keys, true).await?;
            if ranges.is_empty() {
                continue;
            }
            resynced.discarded_pools += 1;
            match self.sequences.get(project, doc_type).await {
                Ok(Some(sequence)) => {
                    self.discards
                        .record_discard(&sequence, period, &ranges, DiscardCause::RedisReconnect)
                        .await
                }
                _ => tracing::error!(key, "discarded a pool of an unknown sequence"),
            }
        }
        // Read first: a failover during the fence leaves the counters
        // unfenced on the new timeline, and reservations refuse it.
        let identity = self.counter.postgres_identity().await?;
        resynced.fenced_periods = self.fence_postgres().await?;
        self.counter.fenced_on(identity.timeline.clone());
        *self.postgres_seen.lock().unwrap_or_else(|e| e.into_inner()) = Some(identity);
        Ok(resynced)
    }

    /// Each store fences the other: a pool filled up to `max_end` means
    /// Postgres handed out numbers below it. A counter found behind that (a
    /// failover to a standby that missed the last commits) is moved past it
    /// before anything is served, the numbers in between recorded as taken,
    /// and the period's pool emptied. The periods fenced.
    pub(super) async fn fence_postgres(&self) -> Result<usize, ResyncError> {
        let mut seen: Vec<(String, String, String, i64)> = Vec::new();
        for key in self.redis.meta_keys().await? {
            let Some((project, doc_type, period)) =
                PoolKeys::parse_meta_key(self.redis.prefix(), &key)
            else {
                continue;
            };
            let keys = self.redis.keys(project, doc_type, period);
            let max_end = self.lists.max_end(&keys).await?;
            if max_end > 0 {
                seen.push((project.into(), doc_type.into(), period.into(), max_end));
            }
        }
        if seen.is_empty() {
            return Ok(0);
        }
        let behind = self.counter.behind(&seen).await?;
        let mut fenced = 0;
        for (project, doc_type, period_key, max_end) in behind {
            let (Ok(project), Ok(doc_type)) =
                (ProjectCode::parse(&project), TypeCode::parse(&doc_type))
            else {
                continue;
            };
            // A sequence Postgres lost entirely comes back with the defaults.
            let sequence = self.sequences.get_or_create(&project, &doc_type).await?;
            let definition = &sequence.definition;
            let Some(period) = definition
                .reset
                .period_named(definition.timezone, &period_key)
            else {
                continue;
            };
            let Some(skipped) = self.counter.fence(&sequence, &period, max_end).await? else {
                continue;
            };
            let keys = self
                .redis
                .keys(project.as_str(), doc_type.as_str(), &period_key);
            let ranges = self.lists.discard(&keys, false).await?;
            self.discards
                .record_discard(
                    &sequence,
                    &period_key,
                    &ranges,
                    DiscardCause::PostgresBehindRedis,
                )
                .await;
            tracing::error!(
                project = %project, doc_type = %doc_type, period = period_key,
                from = skipped.start, to = skipped.last(),
                "Postgres was behind Redis (a failover to a standby that missed commits?): \
                 counter moved past every number Redis had seen"
            );
            self.stats.fences.inc();
            fenced += 1;
        }
        Ok(fenced)
    }

    /// Whether Postgres is another server (or timeline) than at the last
    /// resync: a failover the connection pool followed silently. `None`:
    /// Postgres did not say.
    pub(super) async fn postgres_changed(&self) -> Option<bool> {
        let now = self.counter.postgres_identity().await.ok()?;
        let seen = self.postgres_seen.lock().unwrap_or_else(|e| e.into_inner());
        Some(seen.as_ref().is_some_and(|seen| *seen != now))
    }

    /// Keeps the circuit honest: after a failure or reconnect, waits for
    /// Redis to answer, checks the pools, then lets requests use them again.
    /// Every few seconds it also asks which Postgres it talks to: a new
    /// timeline stops the pools until they are checked against it.
    pub async fn watch_redis(self: Arc<Self>, stop: CancellationToken) {
        let mut watch = Watch {
            complained: None,
            unreachable_since: None,
            postgres_next_check: Instant::now() + POSTGRES_CHECK,
            postgres_backoff: Backoff::between(POSTGRES_CHECK, Duration::from_secs(10)),
        };
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = self.redis.woken() => {}
                _ = self.counter.moved() => {
                    self.redis.trip("Postgres is on a new timeline (failover); fencing its counters");
                }
                _ = tokio::time::sleep(Duration::from_millis(500)) => {}
            }
            if self.redis.is_up() {
                if Instant::now() >= watch.postgres_next_check {
                    // While Postgres does not answer, asked less and less often.
                    let changed = self.postgres_changed().await;
                    let wait = match changed {
                        Some(_) => {
                            watch.postgres_backoff.reset();
                            POSTGRES_CHECK
                        }
                        None => watch.postgres_backoff.next_pause().max(POSTGRES_CHECK),
                    };
                    watch.postgres_next_check = Instant::now() + wait;
                    if changed == Some(true) {
                        self.redis
                            .trip("Postgres changed (failover?); checking the pools against it");
                    }
                }
                continue;
            }
            let failures_before = self.redis.failure_count();
            match self.bring_back().await {
                Ok(resynced) => {
                    if resynced.discarded_pools > 0 {
                        tracing::warn!(
                            pools = resynced.discarded_pools,
                            "pools filled before the reconnect discarded"
                        );
                    }
                    if self.redis.mark_up(failures_before) {
                        watch.unreachable_since = None;
                        watch.complained = None;
                        self.discards.return_held(false).await;
                    }
                }
                Err(e) => watch.not_in_use(e),
            }
        }
    }

    /// Checks the pools once Redis answers on every connection.
    async fn bring_back(&self) -> Result<Resynced, PoolsNotInUse> {
        if self.redis.all_connected() && self.redis.ping().await.is_ok() {
            return Ok(self.resync().await?);
        }
        // fred reports failed connection attempts only at debug level.
        let last = self.redis.last_failure();
        Err(if last.is_empty() {
            PoolsNotInUse::NotConnected
        } else {
            PoolsNotInUse::Unreachable(last)
        })
    }
}

/// What the watch remembers between rounds.
struct Watch {
    /// What it last said was wrong, and when.
    complained: Option<(String, Instant)>,
    /// Since when the pools could not be used for want of a connection.
    unreachable_since: Option<Instant>,
    /// When to ask again which Postgres it talks to.
    postgres_next_check: Instant,
    postgres_backoff: Backoff,
}

impl Watch {
    /// Says why the pools are not in use: when it changes (at most every
    /// 10 s), and once a minute while it lasts. A connection being made
    /// (at start, after a blip) is no error yet; what Redis or Postgres
    /// answered is.
    fn not_in_use(&mut self, e: PoolsNotInUse) {
        let connecting = matches!(
            e,
            PoolsNotInUse::NotConnected | PoolsNotInUse::Unreachable(_)
        );
        let since = *self.unreachable_since.get_or_insert_with(Instant::now);
        if connecting && since.elapsed() < CONNECT_GRACE {
            return;
        }
        if !connecting {
            self.unreachable_since = None;
        }
        let message = e.to_string();
        let quiet = self.complained.as_ref().is_some_and(|(said, at)| {
            let wait = if *said == message { 60 } else { 10 };
            at.elapsed() < Duration::from_secs(wait)
        });
        if !quiet {
            tracing::error!(error = %message, "pools not in use");
            self.complained = Some((message, Instant::now()));
        }
    }
}

/// How long Redis may take to connect (at start, or after a reconnect)
/// before the watch calls it an error.
const CONNECT_GRACE: Duration = Duration::from_secs(3);

/// How often the watch asks which Postgres it talks to.
const POSTGRES_CHECK: Duration = Duration::from_secs(2);

/// What a resync did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Resynced {
    /// Pools emptied because the server holding them did not fill them.
    pub discarded_pools: usize,
    /// Periods whose counter was found behind Redis and moved past it.
    pub fenced_periods: usize,
}

#[derive(Debug, thiserror::Error)]
pub enum ResyncError {
    #[error(transparent)]
    Redis(#[from] RedisFailure),
    #[error("postgres: {0}")]
    Postgres(#[from] sqlx::Error),
    #[error(transparent)]
    Store(#[from] crate::records::sequence_store::StoreError),
}

/// Why the watch keeps the pools out of use.
#[derive(Debug, thiserror::Error)]
enum PoolsNotInUse {
    #[error("Redis not connected yet (RUST_LOG=fred=debug shows each attempt)")]
    NotConnected,
    /// fred's last word on the connection.
    #[error("Redis unreachable: {0}")]
    Unreachable(String),
    #[error(transparent)]
    Resync(#[from] ResyncError),
}
