//! Wiring: build every part from the configuration, serve until told to stop,
//! then stop the background tasks in order.

use std::sync::Arc;
use std::time::Duration;

use crate::infra::db::Db;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use tokio::sync::Notify;

use crate::domain::clock::{Clock, OffsetClock, SystemClock};
use crate::edge::config::Config;
use crate::edge::http::server::ServerLimits;
use crate::edge::http::{AppInner, AppState};
use crate::features::documents::processor::{OutboxWake, PendingTenants, Processor};
use crate::features::documents::sink::{Sink, SinkSettings};
use crate::features::documents::{Documents, HandoutWaits};
use crate::features::endpoints::Endpoints;
use crate::features::endpoints::dispatcher::{DeliveriesWake, Dispatcher};
use crate::features::gaps::reconcile::{ReconcileSettings, Reconciler};
use crate::features::registers::Registers;
use crate::infra::backoff::Backoff;
use crate::infra::fair::FairSlots;
use crate::infra::log_limit::Repeated;
use crate::infra::stats::Stats;
use crate::infra::supervise::Supervisor;
use crate::issuance::LeaseSettings;
use crate::issuance::{Issuer, IssuerParts};
use crate::records::auth::{Authenticator, KeyStore};
use crate::records::counter::Counter;
use crate::records::pool::{PoolService, PoolSettings, RedisLink, RedisSettings};
use crate::records::sequence_store::SequenceStore;
use crate::{edge::http, infra::db, infra::listen, records::idempotency};

/// Parts tests replace.
pub struct Overrides {
    pub clock: Arc<dyn Clock>,
    pub pool: PoolSettings,
    /// Replaces the configured reconciliation timing (tests settle in seconds).
    pub reconcile: Option<ReconcileSettings>,
    /// Replaces the lease timing (`enabled` still follows `IDPOOL_LEASES`).
    pub leases: Option<LeaseSettings>,
}

impl Default for Overrides {
    fn default() -> Self {
        Self {
            clock: Arc::new(SystemClock),
            pool: PoolSettings::default(),
            reconcile: None,
            leases: None,
        }
    }
}

/// A clock `file` says how far ahead of the system's to run (seconds),
/// read now and every half second while the clock lives; a file that
/// cannot be read leaves the offset as it was.
async fn offset_clock(file: &std::path::Path) -> anyhow::Result<Arc<dyn Clock>> {
    async fn read(file: &std::path::Path) -> anyhow::Result<chrono::Duration> {
        let text = tokio::fs::read_to_string(file).await?;
        let seconds: i64 = text.trim().parse()?;
        Ok(chrono::Duration::seconds(seconds))
    }
    let clock = Arc::new(OffsetClock::default());
    let offset = read(file)
        .await
        .map_err(|e| anyhow::anyhow!("IDPOOL_CLOCK_OFFSET_FILE {}: {e}", file.display()))?;
    clock.set_offset(offset);
    tracing::warn!(file = %file.display(), offset_s = offset.num_seconds(),
        "the service's clock follows IDPOOL_CLOCK_OFFSET_FILE (benchmarks and tests only)");
    let following = Arc::downgrade(&clock);
    let file = file.to_owned();
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_millis(500)).await;
            let Some(clock) = following.upgrade() else {
                return;
            };
            if let Ok(offset) = read(&file).await {
                clock.set_offset(offset);
            }
        }
    });
    Ok(clock)
}

pub struct Application {
    listener: TcpListener,
    state: AppState,
    supervisor: Supervisor,
    /// The lease reporter, stopped once the server has drained.
    lease_supervisor: Supervisor,
    stop: CancellationToken,
    server: ServerLimits,
}

impl Application {
    pub async fn build(config: &Config) -> anyhow::Result<Self> {
        let mut overrides = Overrides::default();
        if let Some(file) = &config.clock_offset_file {
            overrides.clock = offset_clock(file).await?;
        }
        Self::build_with(config, overrides).await
    }

    pub async fn build_with(config: &Config, overrides: Overrides) -> anyhow::Result<Self> {
        let budget = ConnectionBudget::of(config);
        let db = db::connect(
            &config.database_url,
            budget.requests + budget.listener,
            config.db_limits(),
            config.pg_pooler,
        )
        .await?;
        let server = server_limits(config);
        // Bound only once the schema is there (a client that connects may
        // use it), unless the instance had to say it was not ready yet.
        let bound = match config.migrate.is_on() {
            true => migrate_when_writable(&db, config, server).await?,
            false => None,
        };
        // A stop drains in order, each stage on a token of its own: the
        // server (`stop`), then the lease reporter, which gives back what
        // requests did not take (`drained`), then the rest of the
        // background work (`background`), which keeps Redis watched and
        // Postgres listened to until then.
        let stop = CancellationToken::new();
        let drained = CancellationToken::new();
        let background = CancellationToken::new();
        let stats = Arc::new(Stats::default());
        let supervisor = Supervisor::new(background.clone(), stats.clone());
        let lease_supervisor = Supervisor::new(drained.clone(), stats.clone());
        let parts = Parts::build(config, &overrides, db, stats).await?;
        parts
            .start_background(config, &overrides, &supervisor, &background)
            .await?;
        let issuer = parts.issuer.clone();
        lease_supervisor.spawn("lease reports", move || {
            issuer.clone().report_leases(drained.clone())
        });
        crate::infra::db::warn_without_synchronous_standby(&parts.db).await;
        parts.wait_for_pools(config).await;
        let state = parts.into_state(config, overrides.clock);
        let listener = match bound {
            Some(listener) => listener,
            None => TcpListener::bind(&config.listen).await?,
        };
        Ok(Self {
            listener,
            state,
            supervisor,
            lease_supervisor,
            stop,
            server,
        })
    }

    pub fn port(&self) -> u16 {
        self.listener.local_addr().map(|a| a.port()).unwrap_or(0)
    }

    pub fn state(&self) -> &AppState {
        &self.state
    }

    /// Cancelling this token shuts the application down gracefully.
    pub fn stop_token(&self) -> CancellationToken {
        self.stop.clone()
    }

    /// Serves until the stop token is cancelled; requests in flight finish,
    /// then the background tasks stop and refills in flight end.
    pub async fn run_until_stopped(self) -> anyhow::Result<()> {
        let Self {
            listener,
            state,
            supervisor,
            lease_supervisor,
            stop,
            server,
        } = self;
        tracing::info!(address = %listener.local_addr()?, "idpool serving");
        let pools = state.pools.clone();
        http::server::serve(listener, http::app(state), server, stop.clone()).await;
        stop.cancel();
        lease_supervisor.stop(Duration::from_secs(10)).await;
        supervisor.stop(Duration::from_secs(10)).await;
        pools.refills().finish(Duration::from_secs(5)).await;
        pools.discards().return_held(true).await;
        pools.redis().shutdown().await;
        tracing::info!("idpool stopped");
        Ok(())
    }
}

fn server_limits(config: &Config) -> ServerLimits {
    ServerLimits {
        deadlines: crate::edge::http::conn_guard::Deadlines {
            header: config.header_timeout(),
            idle: Duration::from_secs(config.idle_timeout_s),
            write: Duration::from_secs(config.write_timeout_s),
        },
        max_connections: config.max_connections as usize,
        drain: config.request_timeout() + Duration::from_secs(1),
    }
}

/// Runs the migrations once Postgres takes writes. Started while its
/// address is read-only (a standby, a failover under way), the instance
/// does not exit: it binds its address, answers that it is not ready, and
/// tries again, backing off, until the address leads to a primary; the
/// listener it bound then, if any.
async fn migrate_when_writable(
    db: &Db,
    config: &Config,
    server: ServerLimits,
) -> anyhow::Result<Option<TcpListener>> {
    static WAITING: Repeated = Repeated::new(
        "Postgres takes no writes (a standby, or a failover under way): not ready; migrations wait",
    );
    let mut backoff = Backoff::background();
    let mut listener = None;
    loop {
        let error = match db::migrate(db).await {
            Ok(()) => {
                WAITING.ended();
                return Ok(listener);
            }
            Err(
                sqlx::migrate::MigrateError::Execute(e)
                | sqlx::migrate::MigrateError::ExecuteMigration(e, _),
            ) if db::distrust_server_after(&e) => e,
            Err(e) if e.to_string().contains("prepared statement") => {
                return Err(anyhow::anyhow!(
                    "{e}: DATABASE_URL seems to lead to a pooler in transaction mode; set IDPOOL_PG_POOLER=transaction"
                ));
            }
            Err(e) => return Err(e.into()),
        };
        WAITING.warn(&error);
        let listener = match &mut listener {
            Some(listener) => listener,
            None => listener.insert(TcpListener::bind(&config.listen).await?),
        };
        let pause = CancellationToken::new();
        let until_retry = backoff.next_pause();
        let timer = pause.clone();
        tokio::spawn(async move {
            tokio::time::sleep(until_retry).await;
            timer.cancel();
        });
        http::server::serve(&*listener, http::health::not_ready_app(), server, pause).await;
    }
}

/// Everything the routes and the background tasks share, built once.
struct Parts {
    /// Requests' connections (and the notification listener's).
    db: Db,
    /// Background work's own: it never takes the requests'.
    background_db: Db,
    stats: Arc<Stats>,
    keys: Arc<KeyStore>,
    auth: Arc<Authenticator>,
    sequences: Arc<SequenceStore>,
    pools: Arc<PoolService>,
    issuer: Arc<Issuer>,
    /// Attaches waiting for handout records, looked at together.
    handout_waits: Arc<HandoutWaits>,
    reconciler: Arc<Reconciler>,
    /// Registers' entries, proofs and checkpoints.
    registers: Arc<Registers>,
    instance_id: String,
}

impl Parts {
    async fn build(
        config: &Config,
        overrides: &Overrides,
        db: Db,
        stats: Arc<Stats>,
    ) -> anyhow::Result<Self> {
        let budget = ConnectionBudget::of(config);
        let background_db = db
            .sibling(budget.background, config.db_limits().for_background())
            .await?;
        // The shared writers keep a connection each, with their own limit on
        // lock waits as a startup parameter (no transaction wrapped around
        // each write for a SET LOCAL): a wait means another transaction
        // holds a number it should not, and everyone queued behind the write
        // waits with it, so it gives up soon and the request at fault is found.
        let writer_db = db
            .sibling(
                budget.writers,
                crate::infra::db::Limits {
                    lock: crate::infra::db::WRITER_LOCK_WAIT,
                    ..config.db_limits()
                },
            )
            .await?;
        // Keys new to the instance are looked up for the request that
        // names them: the requests' pool.
        let keys = Arc::new(KeyStore::new(db.clone()));
        keys.load_all().await?;
        let auth = Self::auth(config, &keys);
        let sequences = Arc::new(SequenceStore::new(
            db.clone(),
            config.max_sequences_per_project as usize,
        ));
        let instance_id = config.instance_id();
        // The one tracker of the issuing wing's tasks: batchers, handout
        // writer, lease fetches and requests' detached work.
        let tasks = TaskTracker::new();
        let pools = Self::pools(
            config,
            overrides,
            &db,
            &sequences,
            &stats,
            &instance_id,
            &tasks,
        )
        .await?;
        let issuer = Issuer::new(IssuerParts {
            sequences: sequences.clone(),
            pools: pools.clone(),
            clock: overrides.clock.clone(),
            stats: stats.clone(),
            db: db.clone(),
            writer_db,
            background_db: background_db.clone(),
            leases: LeaseSettings {
                enabled: config.leases.is_on(),
                ..overrides.leases.clone().unwrap_or_default()
            },
            reservation_ttl: Duration::from_secs(config.reservation_ttl_s),
            tasks: tasks.clone(),
        });
        let reconciler = Self::reconciler(
            config,
            overrides,
            &background_db,
            &pools,
            &stats,
            &instance_id,
        )
        .await?;
        let handout_waits = HandoutWaits::spawn(db.clone(), &tasks);
        let registers = Arc::new(Registers::new(
            db.clone(),
            background_db.clone(),
            &config.register_settings()?,
        )?);
        Ok(Self {
            db,
            background_db,
            registers,
            handout_waits,
            stats,
            keys,
            auth,
            sequences,
            pools,
            issuer,
            reconciler,
            instance_id,
        })
    }

    /// Keys checked per request, or (auth off) every caller let in.
    fn auth(config: &Config, keys: &Arc<KeyStore>) -> Arc<Authenticator> {
        Arc::new(if config.auth.is_on() {
            Authenticator::new(
                keys.clone(),
                config.rate_limit,
                crate::records::auth::Budgets {
                    rows_per_second: config.list_rows_per_key,
                    numbers_per_second: config.numbers_per_key,
                },
            )
        } else {
            Authenticator::off(keys.clone())
        })
    }

    /// Reconciliation, on the background pool (a run holds two
    /// connections: its work, definitions read on it too, and its
    /// heartbeat's).
    async fn reconciler(
        config: &Config,
        overrides: &Overrides,
        db: &Db,
        pools: &Arc<PoolService>,
        stats: &Arc<Stats>,
        instance_id: &str,
    ) -> anyhow::Result<Arc<Reconciler>> {
        Ok(Arc::new(Reconciler::new(
            db.clone(),
            pools.clone(),
            overrides.clock.clone(),
            stats.clone(),
            overrides
                .reconcile
                .clone()
                .unwrap_or_else(|| config.reconcile_settings()),
            instance_id.to_owned(),
        )))
    }

    /// Redis, the counter on its own small connection pool (refills must
    /// not queue behind requests), and the pool service over both.
    async fn pools(
        config: &Config,
        overrides: &Overrides,
        db: &Db,
        sequences: &Arc<SequenceStore>,
        stats: &Arc<Stats>,
        instance_id: &str,
        tasks: &TaskTracker,
    ) -> anyhow::Result<Arc<PoolService>> {
        let redis = RedisLink::connect(
            &RedisSettings {
                url: config.redis_url.clone(),
                prefix: config.redis_prefix.clone(),
                clients: config.redis_clients,
                command_timeout: Duration::from_millis(config.redis_timeout_ms.max(1)),
            },
            stats.clone(),
        )?;
        let refill_db = db
            .sibling(ConnectionBudget::of(config).refills, config.db_limits())
            .await?;
        let counter = Arc::new(Counter::new(refill_db, instance_id.to_owned()));
        let installation = sqlx::query_scalar!("SELECT id FROM installation")
            .fetch_one(db)
            .await?;
        let settings = PoolSettings {
            refill_concurrency: config.refill_concurrency,
            installation: installation.to_string(),
            idle_after: Duration::from_secs(config.pool_idle_s),
            ..overrides.pool.clone()
        };
        // The batch collectors of the hot path live as long as the handles
        // to them; tracked, not waited for.
        Ok(PoolService::new(
            redis,
            counter,
            sequences.clone(),
            stats.clone(),
            settings,
            overrides.clock.clone(),
            tasks,
        ))
    }

    /// The supervised loops: Redis watch, notifications, key use,
    /// idempotency pruning, and (when on) reconciliation and the outbox.
    async fn start_background(
        &self,
        config: &Config,
        overrides: &Overrides,
        supervisor: &Supervisor,
        stop: &CancellationToken,
    ) -> anyhow::Result<()> {
        let outbox_wake = Arc::new(Notify::new());
        let deliveries_wake = Arc::new(Notify::new());
        let pending_tenants = Arc::new(PendingTenants::default());
        let (pools, auth, db) = (self.pools.clone(), self.auth.clone(), self.db.clone());
        let watch_stop = stop.clone();
        supervisor.spawn("redis watch", move || {
            pools.watch().clone().watch_redis(watch_stop.clone())
        });
        let subscribers: listen::Subscribers = vec![
            self.sequences.clone(),
            self.keys.clone(),
            Arc::new(OutboxWake {
                wake: outbox_wake.clone(),
                tenants: pending_tenants.clone(),
            }),
            Arc::new(DeliveriesWake(deliveries_wake.clone())),
        ];
        let source = listen::Source::new(&db, config.pg_listen_url.as_deref());
        let listen_stop = stop.clone();
        supervisor.spawn("notifications", move || {
            listen::run(source.clone(), subscribers.clone(), listen_stop.clone())
        });
        let key_stop = stop.clone();
        supervisor.spawn("keys", move || {
            crate::records::auth::maintain_keys(auth.clone(), key_stop.clone())
        });
        let (issuer, expiry_stop) = (self.issuer.clone(), stop.clone());
        supervisor.spawn("reservation expiry", move || {
            let (issuer, stop) = (issuer.clone(), expiry_stop.clone());
            async move { issuer.reservations().expire_reservations(stop).await }
        });
        let (registers, checkpoint_stop) = (self.registers.clone(), stop.clone());
        let interval = Duration::from_secs(config.checkpoint_interval_s);
        supervisor.spawn("register checkpoints", move || {
            registers
                .clone()
                .run_checkpoints(interval, checkpoint_stop.clone())
        });
        let (prune_db, prune_stop) = (self.background_db.clone(), stop.clone());
        supervisor.spawn("idempotency pruning", move || {
            idempotency::prune_periodically(prune_db.clone(), prune_stop.clone())
        });
        if config.reconcile.is_on() {
            let (reconciler, stop) = (self.reconciler.clone(), stop.clone());
            supervisor.spawn("reconciliation", move || {
                reconciler.clone().run_periodically(stop.clone())
            });
        }
        if config.outbox_processor.is_on() {
            self.start_outbox(
                config,
                overrides,
                supervisor,
                stop,
                (outbox_wake, pending_tenants),
            )?;
            self.start_dispatcher(config, overrides, supervisor, stop, deliveries_wake)?;
        }
        Ok(())
    }

    /// The dispatcher of deliveries to projects' own endpoints, on the
    /// background pool: it holds one connection at a time, for a statement
    /// (a claim) or a short transaction (recording outcomes), never while
    /// an endpoint answers.
    fn start_dispatcher(
        &self,
        config: &Config,
        overrides: &Overrides,
        supervisor: &Supervisor,
        stop: &CancellationToken,
        wake: Arc<Notify>,
    ) -> anyhow::Result<()> {
        let dispatcher = Arc::new(Dispatcher::new(
            self.background_db.clone(),
            config.dispatcher_settings(),
            self.stats.clone(),
            overrides.clock.clone(),
            self.instance_id.clone(),
            wake,
        )?);
        let stop = stop.clone();
        supervisor.spawn("endpoint deliveries", move || {
            dispatcher.clone().run(stop.clone())
        });
        Ok(())
    }

    fn start_outbox(
        &self,
        config: &Config,
        overrides: &Overrides,
        supervisor: &Supervisor,
        stop: &CancellationToken,
        (wake, tenants): (Arc<Notify>, Arc<PendingTenants>),
    ) -> anyhow::Result<()> {
        let sink = Sink::build(
            &config.sink,
            &SinkSettings {
                timeout: Duration::from_millis(config.webhook_timeout_ms),
                concurrency: config.webhook_concurrency,
                instance_id: self.instance_id.clone(),
                secret: config.webhook_secret.clone(),
                clock: overrides.clock.clone(),
            },
        )?;
        let processor = Arc::new(Processor::with_tenants(
            self.background_db.clone(),
            sink,
            config.processor_settings(),
            wake,
            self.stats.clone(),
            tenants,
        ));
        // Several loops, so delivery can use more than one core of
        // Postgres; SKIP LOCKED keeps them off each other's rows.
        for _ in 0..config.outbox_workers {
            let (processor, stop) = (processor.clone(), stop.clone());
            supervisor.spawn("outbox processor", move || {
                processor.clone().run(stop.clone())
            });
        }
        Ok(())
    }

    /// The first request takes from the pool like every later one: a
    /// restart must not hand out numbers past the pool from Postgres.
    async fn wait_for_pools(&self, config: &Config) {
        let wait = Duration::from_millis(config.redis_start_wait_ms);
        if !wait.is_zero() && !self.pools.redis().wait_up(wait).await {
            tracing::warn!(
                waited_ms = config.redis_start_wait_ms,
                "Redis pools not in use yet; serving from Postgres until they are"
            );
        }
    }

    fn into_state(self, config: &Config, clock: Arc<dyn Clock>) -> AppState {
        AppState(Arc::new(AppInner {
            auth: self.auth,
            documents: Documents {
                issuer: self.issuer.clone(),
                handout_waits: self.handout_waits,
            },
            issuer: self.issuer,
            endpoints: Endpoints::new(self.db.clone(), config.endpoint_settings()),
            reconciler: self.reconciler,
            registers: self.registers,
            sequences: self.sequences,
            pools: self.pools,
            stats: self.stats,
            clock,
            db: self.db,
            request_timeout: config.request_timeout(),
            batch_turns: FairSlots::new(config.batch_concurrency, config.batch_concurrency),
            batch_bodies: FairSlots::new(2 * config.batch_concurrency, BATCH_BODIES_PER_KEY),
            probes: Default::default(),
            in_flight: FairSlots::new(usize::MAX / 2, config.max_in_flight_per_key as usize),
            db_turns: FairSlots::new(
                ConnectionBudget::of(config).requests as usize,
                usize::MAX / 2,
            ),
        }))
    }
}

/// Batch bodies one key may send at once: its further batches wait before
/// their bodies are read, so a key's memory is bounded and its slow bodies
/// hold up only itself. All keys together may have twice the batch turns'
/// bodies read or held (a body is held until its batch is answered), which
/// bounds what batches take of the instance's memory.
pub const BATCH_BODIES_PER_KEY: usize = 4;

/// How the instance's Postgres connections (`IDPOOL_DB_POOL_SIZE`, all
/// told) are shared. Each share is a pool of its own, so no kind of work
/// waits on a connection another kind holds: requests (handed out fairly
/// per key as database turns; the lookups of keys new to the instance
/// too), the shared writers that answer requests, background work (the
/// outbox loops, each holding its connection through a batch of
/// deliveries to Postgres or a directory but never while a webhook
/// answers, and two more for the rest: handout records, lease returns,
/// sweeps, key reloads, reconciliation, the endpoint dispatcher), refills (a busy request path makes them slower, never
/// leaves the pools empty), and the listener when it listens on the pool.
/// The pools open connections as their work needs them and close those
/// left unused, so an instance holds the connections it uses now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectionBudget {
    /// Requests that hold a connection of their own (lists, reads, keyed
    /// and batched writes, PUT) and the counter when the pool is short.
    pub requests: u32,
    /// The shared ledger writer and the gapless write stage, one each.
    pub writers: u32,
    /// One per outbox loop (none with the processor off) and two for the
    /// rest, which the loops can never take.
    pub background: u32,
    pub refills: u32,
    pub listener: u32,
}

impl ConnectionBudget {
    pub fn of(config: &Config) -> Self {
        let total = config.db_pool_size;
        let listener =
            match listen::Source::new_kind(config.pg_pooler, config.pg_listen_url.is_some()) {
                listen::Kind::Pool => 1,
                _ => 0,
            };
        let refills = (config.refill_concurrency as u32).clamp(1, if total >= 12 { 2 } else { 1 });
        let writers = 2;
        let outbox = match config.outbox_processor.is_on() {
            true => config.outbox_workers.max(1) as u32,
            false => 0,
        };
        // Reconciliation holds two at once (its work, its heartbeat).
        let background = outbox + 2;
        let others = refills + listener + writers + background;
        Self {
            requests: total.saturating_sub(others).max(2),
            writers,
            background,
            refills,
            listener,
        }
    }
}

/// Cancels `stop` on SIGTERM or SIGINT.
pub fn stop_on_signals(stop: CancellationToken) {
    tokio::spawn(async move {
        let ctrl_c = tokio::signal::ctrl_c();
        #[cfg(unix)]
        let terminate = async {
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(mut signal) => {
                    signal.recv().await;
                }
                Err(e) => {
                    tracing::error!(error = %e, "cannot handle SIGTERM");
                    std::future::pending::<()>().await
                }
            }
        };
        #[cfg(not(unix))]
        let terminate = std::future::pending::<()>();
        tokio::select! {
            _ = ctrl_c => tracing::info!("SIGINT: shutting down"),
            _ = terminate => tracing::info!("SIGTERM: shutting down"),
        }
        stop.cancel();
    });
}
