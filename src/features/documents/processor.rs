//! The outbox processor: claims due rows with `FOR UPDATE SKIP LOCKED`,
//! delivers them to the sink, and records the outcome. For the Postgres
//! and directory sinks all of it is one transaction: a processor that dies
//! releases its rows with its connection, so they are due again at once.
//! A webhook's answers take as long as the target likes, so its claim is
//! committed first (the rows are not due again until the batch's longest
//! possible delivery has passed) and no connection is held while it
//! answers. Many processors (instances) can run at once: a row is only
//! ever held by one.

use crate::infra::db::Tx;
use std::sync::Arc;
use std::time::Duration;

use crate::infra::db::Db;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use super::delivery_queue;
use super::sink::Sink;
use crate::infra::stats::Stats;

/// How soon a processor that found every delivery slot taken tries again.
const DELIVERY_SLOT_WAIT: Duration = Duration::from_millis(250);

#[derive(Debug, Clone)]
pub struct ProcessorSettings {
    /// Longest sleep when idle; new rows wake the processor at once.
    pub poll: Duration,
    /// Failed attempts after which a document is dead-lettered.
    pub max_retries: i32,
    /// Retry n waits base × 2^n, at most `backoff_max`, plus up to a
    /// quarter more at random (see [`delivery_queue::Retry`]).
    pub backoff_base: Duration,
    pub backoff_max: Duration,
    pub batch_size: i64,
    /// How long a stopping processor may finish its batch before it lets
    /// go of it (the rows are then due again).
    pub shutdown_grace: Duration,
}

impl Default for ProcessorSettings {
    fn default() -> Self {
        Self {
            poll: Duration::from_millis(2000),
            max_retries: 5,
            backoff_base: Duration::from_millis(1000),
            backoff_max: Duration::from_secs(3600),
            batch_size: 500,
            shutdown_grace: Duration::from_secs(5),
        }
    }
}

/// Channel the outbox trigger notifies on insert.
pub const OUTBOX_CHANNEL: &str = "idpool_outbox";

/// The tenants with pending rows, as far as this instance knows: told by
/// the notification of every new row (its payload names the tenants), and
/// found again by a scan at least every [`TENANT_SCAN_EVERY`] (for what
/// notifications do not tell: another instance's retries and abandons, a
/// listener that reconnected). A tenant leaves once a step finds nothing
/// of it pending.
#[derive(Debug, Default)]
pub struct PendingTenants {
    known: std::sync::Mutex<Known>,
}

#[derive(Debug, Default)]
struct Known {
    tenants: std::collections::BTreeSet<String>,
    scanned: Option<std::time::Instant>,
}

/// Longest a processor goes without scanning for tenants with pending rows.
const TENANT_SCAN_EVERY: Duration = Duration::from_secs(1);

impl PendingTenants {
    fn known(&self) -> std::sync::MutexGuard<'_, Known> {
        self.known.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A notification: the tenants it names have new rows; one that names
    /// none (a retried dead letter) asks for a scan.
    pub fn told(&self, payload: &str) {
        let mut known = self.known();
        if payload.is_empty() {
            known.scanned = None;
        }
        for tenant in payload.split(',').filter(|t| !t.is_empty()) {
            if !known.tenants.contains(tenant) {
                known.tenants.insert(tenant.to_owned());
            }
        }
    }

    /// Notifications may have been missed: scan at the next step.
    pub fn rescan(&self) {
        self.known().scanned = None;
    }

    /// The tenants to serve now, scanning first when it is time.
    async fn current(&self, conn: &mut Tx<'_>) -> Result<Vec<String>, sqlx::Error> {
        let due = self
            .known()
            .scanned
            .is_none_or(|at| at.elapsed() >= TENANT_SCAN_EVERY);
        if due {
            let scanned_at = std::time::Instant::now();
            let found = delivery_queue::tenants_with_pending_rows(conn).await?;
            let mut known = self.known();
            known.tenants.extend(found);
            known.scanned = Some(scanned_at);
        }
        Ok(self.known().tenants.iter().cloned().collect())
    }

    /// `tenant` has nothing pending.
    fn idle(&self, tenant: &str) {
        self.known().tenants.remove(tenant);
    }
}

/// New outbox rows (here or on another instance) wake a waiting processor
/// and name their tenants.
pub struct OutboxWake {
    pub wake: Arc<Notify>,
    pub tenants: Arc<PendingTenants>,
}

impl crate::infra::listen::Subscriber for OutboxWake {
    fn channel(&self) -> &'static str {
        OUTBOX_CHANNEL
    }

    fn notified(&self, payload: &str) {
        self.tenants.told(payload);
        self.wake.notify_one();
    }

    fn missed(&self) {
        self.tenants.rescan();
        self.wake.notify_one();
    }
}

/// How often the processor looks at its oldest pending row (for
/// `idpool_outbox_oldest_pending_seconds`).
const OLDEST_PENDING_EVERY: Duration = Duration::from_secs(1);

/// Shortest idle sleep, so rows held by another processor are not polled in a spin.
const MIN_IDLE_SLEEP: Duration = Duration::from_millis(20);

/// What one step did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Step {
    pub claimed: usize,
    pub delivered: usize,
    pub failed: usize,
    pub dead_lettered: usize,
    /// After a batch that was not full: how long until the next pending row
    /// is due (zero: one is due now, held by another processor); None when
    /// nothing is pending.
    pub next_due: Option<Duration>,
}

pub struct Processor {
    db: Db,
    sink: Sink,
    settings: ProcessorSettings,
    wake: Arc<Notify>,
    stats: Arc<Stats>,
    /// Failed deliveries, logged without flooding the log.
    failures: crate::infra::log_limit::Repeated,
    tenants: Arc<PendingTenants>,
}

impl Processor {
    pub fn new(
        db: Db,
        sink: Sink,
        settings: ProcessorSettings,
        wake: Arc<Notify>,
        stats: Arc<Stats>,
    ) -> Self {
        Self::with_tenants(db, sink, settings, wake, stats, Default::default())
    }

    /// The same, told of tenants with new rows through `tenants` (see
    /// [`OutboxWake`]).
    pub fn with_tenants(
        db: Db,
        sink: Sink,
        settings: ProcessorSettings,
        wake: Arc<Notify>,
        stats: Arc<Stats>,
        tenants: Arc<PendingTenants>,
    ) -> Self {
        Self {
            db,
            sink,
            settings,
            wake,
            stats,
            failures: crate::infra::log_limit::Repeated::new("outbox deliveries failed"),
            tenants,
        }
    }

    /// Claims and delivers one batch of due rows.
    pub async fn step(&self) -> Result<Step, sqlx::Error> {
        if let Some(webhook) = self.sink.webhook() {
            return self.step_without_holding(webhook).await;
        }
        let mut tx = self.db.begin().await?;
        if self.db.pooler() != crate::infra::db::Pooler::None
            && !delivery_queue::take_delivery_slot(&mut tx).await?
        {
            // Every slot is another delivery's: try again soon.
            return Ok(Step {
                next_due: Some(DELIVERY_SLOT_WAIT),
                ..Step::default()
            });
        }
        let tenants = self.tenants.current(&mut tx).await?;
        let claimed = delivery_queue::claim_due(
            &mut tx,
            self.settings.batch_size,
            self.sink.needs_payload(),
            &tenants,
        )
        .await?;
        if claimed.is_empty() {
            let next_due = self.next_due(&mut tx, &tenants).await?;
            return Ok(Step {
                next_due,
                ..Step::default()
            });
        }
        let outcomes = self.sink.deliver(&mut tx, &claimed).await;
        self.record(tx, &tenants, &claimed, outcomes, self.settings.batch_size)
            .await
    }

    /// A webhook's step: the claim is committed before anything is sent
    /// (it moves the rows' due time past the batch's longest possible
    /// delivery, which is also its token), no connection is held while the
    /// target answers, and the outcomes are recorded after, for the rows
    /// whose claim still holds (a batch that outlived its claim changes
    /// nothing another processor did meanwhile).
    async fn step_without_holding(
        &self,
        webhook: &super::sink::Webhook,
    ) -> Result<Step, sqlx::Error> {
        let limit = self.settings.batch_size.min(webhook.batch_limit());
        let mut tx = self.db.begin().await?;
        let tenants = self.tenants.current(&mut tx).await?;
        let claimed = delivery_queue::claim_due(&mut tx, limit, true, &tenants).await?;
        if claimed.is_empty() {
            let next_due = self.next_due(&mut tx, &tenants).await?;
            return Ok(Step {
                next_due,
                ..Step::default()
            });
        }
        let ids: Vec<i64> = claimed.iter().map(|d| d.row_id).collect();
        let claims = delivery_queue::hold(&mut tx, &ids, webhook.longest_batch()).await?;
        tx.commit().await?;
        let outcomes = self.sink.deliver_unheld(&claimed).await;
        let mut tx = self.db.begin().await?;
        let held = delivery_queue::still_held(&mut tx, &claims).await?;
        let (claimed, outcomes): (Vec<_>, Vec<_>) = claimed
            .into_iter()
            .zip(outcomes)
            .filter(|(delivery, _)| held.contains(&delivery.row_id))
            .unzip();
        self.record(tx, &tenants, &claimed, outcomes, limit).await
    }

    /// Records a batch's outcomes in `tx`, commits, and counts them.
    async fn record(
        &self,
        mut tx: Tx<'_>,
        tenants: &[String],
        claimed: &[super::sink::Delivery],
        outcomes: Vec<Result<(), super::sink::DeliveryError>>,
        limit: i64,
    ) -> Result<Step, sqlx::Error> {
        let full = claimed.len() as i64 >= limit;
        let mut delivered = Vec::new();
        let mut failed = Vec::new();
        let mut first_failure = None;
        for (delivery, outcome) in claimed.iter().zip(outcomes) {
            match outcome {
                Ok(()) => delivered.push(delivery.row_id),
                Err(error) => {
                    // The tenant reads the classification; the whole error
                    // (the target's answer, a path) is for the log.
                    failed.push((delivery.row_id, error.classification()));
                    first_failure.get_or_insert((delivery.document_id.clone(), error));
                }
            }
        }
        let retry = delivery_queue::Retry {
            max_retries: self.settings.max_retries,
            backoff_base: self.settings.backoff_base,
            backoff_max: self.settings.backoff_max,
        };
        let recorded =
            delivery_queue::record_outcomes(&mut tx, &delivered, &failed, &retry).await?;
        let next_due = if full {
            None
        } else {
            self.next_due(&mut tx, tenants).await?
        };
        tx.commit().await?;
        for lag in recorded.lags {
            self.stats.outbox_lag.observe(lag);
        }
        let dead_lettered = recorded.dead_lettered;
        self.stats.outbox_delivered.inc_by(delivered.len() as u64);
        self.stats
            .outbox_delivery_failures
            .inc_by(failed.len() as u64);
        self.stats.outbox_dead_lettered.inc_by(dead_lettered as u64);
        match first_failure {
            Some((document_id, error)) => self.failures.warn(&format_args!(
                "{error} (document {document_id}; {} of {} in the batch failed, {dead_lettered} dead-lettered)",
                failed.len(),
                claimed.len()
            )),
            None => self.failures.ended(),
        }
        Ok(Step {
            claimed: claimed.len(),
            delivered: delivered.len(),
            failed: failed.len(),
            dead_lettered,
            next_due,
        })
    }

    /// How long until the next pending row of `tenants` is due; tenants
    /// with none pending are forgotten.
    async fn next_due(
        &self,
        conn: &mut Tx<'_>,
        tenants: &[String],
    ) -> Result<Option<Duration>, sqlx::Error> {
        let mut soonest: Option<Duration> = None;
        for tenant in tenants {
            match delivery_queue::next_due_of(conn, tenant).await? {
                Some(due) => soonest = Some(soonest.map_or(due, |s| s.min(due))),
                None => self.tenants.idle(tenant),
            }
        }
        Ok(soonest)
    }

    /// Runs until `stop`: a full batch goes straight on to the next; else it
    /// sleeps until woken by a new row, the next retry falls due, or the
    /// poll interval passes.
    pub async fn run(self: Arc<Self>, stop: CancellationToken) {
        let mut failures = crate::infra::retrying::Retrying::new("outbox step failed");
        let mut looked_at_oldest: Option<tokio::time::Instant> = None;
        loop {
            if stop.is_cancelled() {
                return;
            }
            if looked_at_oldest.is_none_or(|at| at.elapsed() >= OLDEST_PENDING_EVERY) {
                looked_at_oldest = Some(tokio::time::Instant::now());
                if let Ok(age) = delivery_queue::oldest_pending_age(&self.db).await {
                    self.stats.outbox_oldest_pending_seconds.set(age as i64);
                }
            }
            let step = self.step();
            tokio::pin!(step);
            let result = tokio::select! {
                result = &mut step => result,
                _ = stop.cancelled() => {
                    // Finish the batch if it is quick; else drop it, which
                    // rolls back and leaves its rows due for another processor.
                    match tokio::time::timeout(self.settings.shutdown_grace, &mut step).await {
                        Ok(result) => { let _ = result; }
                        Err(_) => tracing::warn!("outbox batch released unfinished at shutdown"),
                    }
                    return;
                }
            };
            let (claimed, next_due) = match result {
                Ok(step) if step.claimed as i64 >= self.settings.batch_size => {
                    // More is waiting: a sleeping loop of this instance can help.
                    self.wake.notify_one();
                    continue;
                }
                Ok(step) => {
                    failures.succeeded();
                    (step.claimed, step.next_due)
                }
                Err(e) => {
                    tokio::select! {
                        _ = stop.cancelled() => return,
                        _ = tokio::time::sleep(failures.failed(&e)) => {}
                    }
                    continue;
                }
            };
            let until_due = next_due.unwrap_or(self.settings.poll);
            // A row that is due but was not claimed is held by another
            // processor: look again shortly instead of spinning.
            if until_due.is_zero() && claimed > 0 {
                continue;
            }
            let sleep = until_due.max(MIN_IDLE_SLEEP).min(self.settings.poll);
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = self.wake.notified() => {}
                _ = tokio::time::sleep(sleep) => {}
            }
        }
    }
}
