//! Wiring: build every part from the configuration, serve until told to stop,
//! then stop the background tasks in order.

use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use tokio::sync::Notify;

use crate::auth::{Authenticator, KeyStore};
use crate::clock::{Clock, SystemClock};
use crate::config::Config;
use crate::counter::Counter;
use crate::documents::Documents;
use crate::documents::processor::{OutboxWake, Processor};
use crate::documents::sink::{Sink, SinkSettings};
use crate::gaps::reconcile::{ReconcileSettings, Reconciler};
use crate::http::server::ServerLimits;
use crate::http::{AppInner, AppState};
use crate::issuance::Issuer;
use crate::pool::{PoolService, PoolSettings, RedisLink, RedisSettings};
use crate::sequence_store::SequenceStore;
use crate::stats::Stats;
use crate::supervise::Supervisor;
use crate::{db, http, idempotency, listen};

/// Parts tests replace.
pub struct Overrides {
    pub clock: Arc<dyn Clock>,
    pub pool: PoolSettings,
    /// Replaces the configured reconciliation timing (tests settle in seconds).
    pub reconcile: Option<ReconcileSettings>,
}

impl Default for Overrides {
    fn default() -> Self {
        Self {
            clock: Arc::new(SystemClock),
            pool: PoolSettings::default(),
            reconcile: None,
        }
    }
}

pub struct Application {
    listener: TcpListener,
    state: AppState,
    supervisor: Supervisor,
    stop: CancellationToken,
    server: ServerLimits,
}

impl Application {
    pub async fn build(config: &Config) -> anyhow::Result<Self> {
        Self::build_with(config, Overrides::default()).await
    }

    pub async fn build_with(config: &Config, overrides: Overrides) -> anyhow::Result<Self> {
        let limits = config.db_limits();
        let db = db::connect(&config.database_url, config.db_pool_size, limits).await?;
        if config.migrate.is_on() {
            db::migrate(&db).await?;
        }
        let stop = CancellationToken::new();
        let stats = Arc::new(Stats::default());
        let supervisor = Supervisor::new(stop.clone(), stats.clone());
        // The batch collectors of the hot path live as long as the
        // handles to them; tracked, not waited for.
        let batchers = TaskTracker::new();
        let redis = RedisLink::connect(
            &RedisSettings {
                url: config.redis_url.clone(),
                prefix: config.redis_prefix.clone(),
                clients: config.redis_clients,
                command_timeout: Duration::from_millis(config.redis_timeout_ms.max(1)),
            },
            stats.clone(),
        )?;
        let keys = Arc::new(KeyStore::new(db.clone()));
        let auth = Arc::new(if config.auth.is_on() {
            Authenticator::new(keys.clone(), config.rate_limit)
        } else {
            Authenticator::off(keys.clone())
        });
        let sequences = Arc::new(SequenceStore::new(
            db.clone(),
            config.max_sequences_per_project as usize,
        ));
        let options = (*db.connect_options()).clone();
        let refill_db = db::pool(
            options.clone(),
            config.refill_concurrency.clamp(1, 4) as u32,
            limits,
        )
        .await?;
        let background_db = db::pool(options, 2, limits.for_background()).await?;
        let instance_id = config.instance_id();
        let counter = Arc::new(Counter::new(refill_db, instance_id.clone()));
        let installation: uuid::Uuid = sqlx::query_scalar("SELECT id FROM installation")
            .fetch_one(&db)
            .await?;
        let pool_settings = PoolSettings {
            refill_concurrency: config.refill_concurrency,
            installation: installation.to_string(),
            ..overrides.pool
        };
        let pools = PoolService::new(
            redis,
            counter.clone(),
            sequences.clone(),
            stats.clone(),
            pool_settings,
            overrides.clock.clone(),
            &batchers,
        );
        let pipeline =
            crate::pipeline::Pipeline::spawn(db.clone(), pools.clone(), stats.clone(), &batchers);
        let issuer = Arc::new(Issuer {
            pipeline,
            sequences: sequences.clone(),
            pools: pools.clone(),
            counter,
            clock: overrides.clock.clone(),
            stats: stats.clone(),
            db: db.clone(),
        });
        let documents = Documents {
            issuer: issuer.clone(),
        };
        let reconciler = Arc::new(Reconciler {
            db: background_db,
            redis: pools.redis().clone(),
            pools: pools.clone(),
            sequences: sequences.clone(),
            clock: overrides.clock.clone(),
            stats: stats.clone(),
            settings: overrides
                .reconcile
                .unwrap_or_else(|| config.reconcile_settings()),
            instance_id: instance_id.clone(),
        });
        let outbox_wake = Arc::new(Notify::new());
        {
            let (pools, stop) = (pools.clone(), stop.clone());
            supervisor.spawn("redis watch", move || {
                pools.clone().watch_redis(stop.clone())
            });
        }
        {
            let subscribers: listen::Subscribers = vec![
                sequences.clone(),
                keys.clone(),
                Arc::new(OutboxWake(outbox_wake.clone())),
            ];
            let (db, stop) = (db.clone(), stop.clone());
            supervisor.spawn("notifications", move || {
                listen::run(db.clone(), subscribers.clone(), stop.clone())
            });
        }
        {
            let (auth, stop) = (auth.clone(), stop.clone());
            supervisor.spawn("key use", move || {
                crate::auth::record_use_periodically(auth.clone(), stop.clone())
            });
        }
        {
            let (db, stop) = (db.clone(), stop.clone());
            supervisor.spawn("idempotency pruning", move || {
                idempotency::prune_periodically(db.clone(), stop.clone())
            });
        }
        if config.reconcile.is_on() {
            let (reconciler, stop) = (reconciler.clone(), stop.clone());
            supervisor.spawn("reconciliation", move || {
                reconciler.clone().run_periodically(stop.clone())
            });
        }
        if config.outbox_processor.is_on() {
            let sink = Sink::build(
                &config.sink,
                &SinkSettings {
                    timeout: Duration::from_millis(config.webhook_timeout_ms),
                    concurrency: config.webhook_concurrency,
                    instance_id: instance_id.clone(),
                    secret: config.webhook_secret.clone(),
                    clock: overrides.clock.clone(),
                },
            )?;
            let processor = Arc::new(Processor::new(
                db.clone(),
                sink,
                config.processor_settings(),
                outbox_wake,
                stats.clone(),
            ));
            // Several loops, so delivery can use more than one core of
            // Postgres; SKIP LOCKED keeps them off each other's rows.
            for _ in 0..config.outbox_workers {
                let (processor, stop) = (processor.clone(), stop.clone());
                supervisor.spawn("outbox processor", move || {
                    processor.clone().run(stop.clone())
                });
            }
        }
        crate::db::warn_without_synchronous_standby(&db).await;
        // The first request takes from the pool like every later one: a
        // restart must not hand out numbers past the pool from Postgres.
        let wait = Duration::from_millis(config.redis_start_wait_ms);
        if !wait.is_zero() && !pools.redis().wait_up(wait).await {
            tracing::warn!(
                waited_ms = config.redis_start_wait_ms,
                "Redis pools not in use yet; serving from Postgres until they are"
            );
        }
        let state = AppState(Arc::new(AppInner {
            auth,
            issuer,
            documents,
            reconciler,
            sequences,
            pools,
            stats,
            clock: overrides.clock,
            db,
            request_timeout: config.request_timeout(),
            batch_slots: Arc::new(tokio::sync::Semaphore::new(config.batch_concurrency.max(1))),
        }));
        let listener = TcpListener::bind(&config.listen).await?;
        Ok(Self {
            listener,
            state,
            supervisor,
            stop,
            server: ServerLimits {
                header_timeout: config.header_timeout(),
                max_connections: config.max_connections as usize,
                drain: config.request_timeout() + Duration::from_secs(1),
            },
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
            stop,
            server,
        } = self;
        tracing::info!(address = %listener.local_addr()?, "idpool serving");
        let pools = state.pools.clone();
        http::server::serve(listener, http::app(state), server, stop.clone()).await;
        stop.cancel();
        supervisor.finish(Duration::from_secs(10)).await;
        pools.finish_refills(Duration::from_secs(5)).await;
        pools.redis().shutdown().await;
        tracing::info!("idpool stopped");
        Ok(())
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
