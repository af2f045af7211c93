//! Wiring: build every part from the configuration, serve until told to stop,
//! then stop the background tasks in order.

use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use tokio::sync::Notify;

use crate::clock::{Clock, SystemClock};
use crate::config::Config;
use crate::counter::Counter;
use crate::documents::Documents;
use crate::documents::processor::Processor;
use crate::documents::sink::Sink;
use crate::gaps::reconcile::{ReconcileSettings, Reconciler};
use crate::http::{AppInner, AppState};
use crate::issuance::Issuer;
use crate::pool::{PoolService, PoolSettings, RedisLink, RedisSettings};
use crate::sequence::store::SequenceStore;
use crate::stats::Stats;
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
    background: Vec<JoinHandle<()>>,
    stop: CancellationToken,
}

impl Application {
    pub async fn build(config: &Config) -> anyhow::Result<Self> {
        Self::build_with(config, Overrides::default()).await
    }

    pub async fn build_with(config: &Config, overrides: Overrides) -> anyhow::Result<Self> {
        let db = db::connect(&config.database_url, config.db_pool_size).await?;
        if config.migrate.is_on() {
            db::migrate(&db).await?;
        }
        let stats = Arc::new(Stats::default());
        let redis = RedisLink::connect(
            &RedisSettings {
                url: config.redis_url.clone(),
                prefix: config.redis_prefix.clone(),
                clients: config.redis_clients,
                command_timeout: Duration::from_millis(config.redis_timeout_ms.max(1)),
            },
            stats.clone(),
        )?;
        let sequences = Arc::new(SequenceStore::new(db.clone()));
        let refill_db = db::pool(
            (*db.connect_options()).clone(),
            config.refill_concurrency.clamp(1, 4) as u32,
        )
        .await?;
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
        );
        let pipeline = crate::pipeline::Pipeline::spawn(db.clone(), pools.clone(), stats.clone());
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
            db: db.clone(),
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
        let stop = CancellationToken::new();
        let outbox_wake = Arc::new(Notify::new());
        let mut background = vec![
            tokio::spawn(pools.clone().watch_redis(stop.clone())),
            tokio::spawn(listen::run(
                db.clone(),
                sequences.clone(),
                outbox_wake.clone(),
                stop.clone(),
            )),
            tokio::spawn(idempotency::prune_periodically(db.clone(), stop.clone())),
        ];
        if config.reconcile.is_on() {
            background.push(tokio::spawn(
                reconciler.clone().run_periodically(stop.clone()),
            ));
        }
        if config.outbox_processor.is_on() {
            let sink = Sink::build(
                &config.sink,
                Duration::from_millis(config.webhook_timeout_ms),
                config.webhook_concurrency,
                &instance_id,
            )?;
            let processor = Arc::new(Processor::new(
                db.clone(),
                sink,
                config.processor_settings(),
                outbox_wake,
            ));
            // Several loops, so delivery can use more than one core of
            // Postgres; SKIP LOCKED keeps them off each other's rows.
            for _ in 0..config.outbox_workers.max(1) {
                background.push(tokio::spawn(processor.clone().run(stop.clone())));
            }
        }
        let state = AppState(Arc::new(AppInner {
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
            background,
            stop,
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
    /// then the background tasks stop.
    pub async fn run_until_stopped(self) -> anyhow::Result<()> {
        let Self {
            listener,
            state,
            background,
            stop,
        } = self;
        tracing::info!(address = %listener.local_addr()?, "idpool serving");
        let redis = state.pools.redis().clone();
        let app = axum::ServiceExt::<axum::extract::Request>::into_make_service(http::app(state));
        // Answers go out as soon as they are written, not after the
        // client's ACK of the previous one (Nagle).
        let listener = axum::serve::ListenerExt::tap_io(listener, |tcp| {
            if let Err(e) = tcp.set_nodelay(true) {
                tracing::debug!(error = %e, "could not set TCP_NODELAY");
            }
        });
        let served = axum::serve(listener, app)
            .with_graceful_shutdown(stop.clone().cancelled_owned())
            .await;
        stop.cancel();
        for task in background {
            let _ = task.await;
        }
        redis.shutdown().await;
        tracing::info!("idpool stopped");
        Ok(served?)
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
