//! Delivers routed documents to their endpoints, so that a slow, hanging
//! or failing endpoint delays only its own deliveries:
//!
//! - claims are one committed statement each; no Postgres connection is
//!   held while an endpoint thinks, and outcomes are recorded after, in
//!   batches, by the recorder;
//! - deliveries in flight are capped per endpoint and in all, and the
//!   room is handed out one delivery at a time around the endpoints that
//!   have due deliveries (so between tenants too); each endpoint's claims
//!   wait in a lane of its own, so one endpoint's slowness holds up only
//!   its lane;
//! - an endpoint that failed `circuit_after` times in a row gets no
//!   attempt for a pause that doubles with every further failure, then
//!   one probe at a time until one succeeds;
//! - an endpoint whose every attempt failed for `disable_after` is
//!   disabled (`disabled_reason: failing`).

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{Notify, mpsc};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::deliveries::{self, Attempt, Claimed, Judgement, Target};
use super::url_guard::{self, UrlPolicy};
use crate::domain::clock::Clock;
use crate::features::documents::sink::{self, Delivery, DeliveryError};
use crate::infra::db::Db;
use crate::infra::retrying::Retrying;
use crate::infra::stats::Stats;

/// Channel the outbox trigger notifies on when it routes documents.
pub const DELIVERIES_CHANNEL: &str = "idpool_deliveries";

#[derive(Debug, Clone)]
pub struct DispatcherSettings {
    /// Time allowed per attempt.
    pub timeout: Duration,
    /// Deliveries in flight per endpoint, on this instance.
    pub per_endpoint: usize,
    /// Deliveries in flight in all, on this instance.
    pub in_flight: usize,
    /// Longest sleep when idle; routed documents wake it at once.
    pub poll: Duration,
    pub judgement: Judgement,
    pub policy: UrlPolicy,
    /// How long a stopping dispatcher waits for attempts under way.
    pub shutdown_grace: Duration,
}

/// Attempts recorded in one transaction at most.
const RECORD_BATCH: usize = 1_000;

/// What a claim holds a delivery for beyond its wait and attempt.
const CLAIM_MARGIN: Duration = Duration::from_secs(30);

/// Shortest idle sleep, so deliveries held by another instance are not
/// polled in a spin.
const MIN_IDLE_SLEEP: Duration = Duration::from_millis(20);

/// Claimed deliveries an endpoint may have waiting here beyond those in
/// flight, as a multiple of its cap: an attempt that ends starts the next
/// at once, without a round trip to Postgres, and claims come in batches.
const PREFETCH: usize = 4;

/// One endpoint's deliveries on this instance.
struct Lane {
    target: Arc<SigningTarget>,
    project: String,
    /// Its last attempts failed, as Postgres last said.
    failed_lately: bool,
    /// Claimed, not yet sent (in due order).
    waiting: VecDeque<Claimed>,
    in_flight: usize,
    /// Attempts in flight at most: its share, or one (a probe) while its
    /// circuit is open.
    cap: usize,
    /// Failures in a row seen here (a success ends it); at the circuit's
    /// threshold the waiting claims are given back and one probe at a
    /// time goes out, before the recorder has told Postgres.
    streak: i32,
}

impl Lane {
    fn held(&self) -> usize {
        self.in_flight + self.waiting.len()
    }

    /// Its last attempt failed (here or as Postgres last said).
    fn suspect(&self) -> bool {
        self.streak > 0 || self.failed_lately
    }
}

/// A project's lanes hold at most this fraction of the instance's budget.
const PROJECT_SHARE: usize = 4;

/// What a delivery is sent with: the target (URL and keys) and the URL as
/// saved (to check its address again before each attempt).
struct SigningTarget {
    target: sink::Target,
    url: String,
}

pub struct Dispatcher {
    db: Db,
    client: reqwest::Client,
    settings: DispatcherSettings,
    stats: Arc<Stats>,
    clock: Arc<dyn Clock>,
    instance_id: String,
    wake: Arc<Notify>,
    lanes: Mutex<HashMap<String, Lane>>,
    attempts: TaskTracker,
    /// Where a finished attempt goes to be recorded.
    outcomes: mpsc::UnboundedSender<Attempt>,
    pending_outcomes: Mutex<Option<mpsc::UnboundedReceiver<Attempt>>>,
    /// Where the round of hand-outs starts, moved on every round.
    turn: AtomicUsize,
    failures: crate::infra::log_limit::Repeated,
}

/// Routed documents (here or on another instance) wake the dispatcher.
pub struct DeliveriesWake(pub Arc<Notify>);

impl crate::infra::listen::Subscriber for DeliveriesWake {
    fn channel(&self) -> &'static str {
        DELIVERIES_CHANNEL
    }

    fn notified(&self, _payload: &str) {
        self.0.notify_one();
    }

    fn missed(&self) {
        self.0.notify_one();
    }
}

impl Dispatcher {
    pub fn new(
        db: Db,
        settings: DispatcherSettings,
        stats: Arc<Stats>,
        clock: Arc<dyn Clock>,
        instance_id: String,
        wake: Arc<Notify>,
    ) -> anyhow::Result<Self> {
        let client = url_guard::client(settings.policy, settings.timeout, settings.per_endpoint)?;
        let (outcomes, receiver) = mpsc::unbounded_channel();
        Ok(Self {
            db,
            client,
            settings,
            stats,
            clock,
            instance_id,
            wake,
            lanes: Mutex::default(),
            attempts: TaskTracker::new(),
            outcomes,
            pending_outcomes: Mutex::new(Some(receiver)),
            turn: Default::default(),
            failures: crate::infra::log_limit::Repeated::new("endpoint deliveries failed"),
        })
    }

    fn lanes(&self) -> std::sync::MutexGuard<'_, HashMap<String, Lane>> {
        self.lanes.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// How long a claim holds a delivery: its wait behind the endpoint's
    /// other claims here, its attempt, and a margin. Past it the delivery
    /// is due again for any dispatcher (this one died).
    fn lease(&self) -> Duration {
        self.settings.timeout * (PREFETCH as u32 + 1) + CLAIM_MARGIN
    }

    /// Runs until `stop`, then gives back what waits, lets attempts under
    /// way end (up to the grace) and records them.
    pub async fn run(self: Arc<Self>, stop: CancellationToken) {
        let Some(receiver) = self
            .pending_outcomes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
        else {
            return;
        };
        let attempts_ended = CancellationToken::new();
        let recorder = tokio::spawn(self.clone().record_all(receiver, attempts_ended.clone()));
        let sweeper = tokio::spawn(sweep_deleted_endpoints(self.db.clone(), stop.clone()));
        let mut failures = Retrying::new("endpoint dispatch failed");
        while !stop.is_cancelled() {
            // A failed step waits out its pause: a notification (or the
            // listener's every-second "missed" while Postgres is away) does
            // not cut it short.
            let (sleep, wakeable) = match self.step().await {
                Ok(sleep) => {
                    failures.succeeded();
                    (sleep, true)
                }
                Err(e) => (failures.failed(&e), false),
            };
            tokio::select! {
                _ = stop.cancelled() => break,
                _ = self.wake.notified(), if wakeable => {}
                _ = tokio::time::sleep(sleep) => {}
            }
        }
        let waiting: Vec<Claimed> = self
            .lanes()
            .values_mut()
            .flat_map(|lane| lane.waiting.drain(..))
            .collect();
        let _ = deliveries::release(&self.db, &waiting, Duration::ZERO).await;
        self.attempts.close();
        if tokio::time::timeout(self.settings.shutdown_grace, self.attempts.wait())
            .await
            .is_err()
        {
            tracing::warn!(
                "endpoint deliveries left under way at shutdown; they fall due again when their claims end"
            );
        }
        attempts_ended.cancel();
        let _ = sweeper.await;
        if tokio::time::timeout(self.settings.shutdown_grace, recorder)
            .await
            .is_err()
        {
            tracing::warn!("endpoint attempts left unrecorded at shutdown; they are sent again");
        }
    }

    /// Hands out the room there is to endpoints with due deliveries,
    /// claims them and starts what their caps allow; how long to sleep
    /// after (an attempt that ends wakes the loop when its lane runs low).
    pub async fn step(self: &Arc<Self>) -> Result<Duration, sqlx::Error> {
        let targets = deliveries::targets(&self.db).await?;
        let due: Vec<&Target> = targets.iter().filter(|t| t.due()).collect();
        let (ids, room) = self.hand_out(&due);
        let claimed = match ids.is_empty() {
            true => Vec::new(),
            false => deliveries::claim(&self.db, &ids, &room, self.lease()).await?,
        };
        let mut touched: Vec<String> = Vec::new();
        {
            let mut lanes = self.lanes();
            for delivery in claimed {
                // The lane may have gone meanwhile (its last attempt ended).
                let lane = match lanes.entry(delivery.endpoint_id.clone()) {
                    std::collections::hash_map::Entry::Occupied(lane) => lane.into_mut(),
                    std::collections::hash_map::Entry::Vacant(vacant) => {
                        let Some(target) = due.iter().find(|t| t.id == delivery.endpoint_id) else {
                            continue;
                        };
                        vacant.insert(self.new_lane(target))
                    }
                };
                if !touched.contains(&delivery.endpoint_id) {
                    touched.push(delivery.endpoint_id.clone());
                }
                lane.waiting.push_back(delivery);
            }
        }
        for endpoint in &touched {
            self.pump(endpoint);
        }
        // Lanes that hold nothing (and know of no failures) go.
        self.lanes()
            .retain(|_, lane| lane.held() > 0 || lane.streak > 0);
        // Endpoints with no room here wait for their lanes to run low
        // (which wakes this loop), not for a timer; the others for their
        // soonest delivery, as Postgres said.
        let lanes = self.lanes();
        let soonest = targets
            .iter()
            .filter(|t| {
                lanes
                    .get(&t.id)
                    .is_none_or(|lane| lane.held() < lane.cap * PREFETCH)
            })
            .map(|t| t.wait_s)
            .min_by(f64::total_cmp);
        drop(lanes);
        let next = soonest.map(|s| Duration::try_from_secs_f64(s).unwrap_or_default());
        Ok(next
            .unwrap_or(self.settings.poll)
            .max(MIN_IDLE_SLEEP)
            .min(self.settings.poll))
    }

    /// The room each due endpoint gets now: one delivery at a time around
    /// them, starting one further each round, within each endpoint's share
    /// (one probe for an endpoint whose circuit was open) and the total.
    fn hand_out(&self, due: &[&Target]) -> (Vec<String>, Vec<i32>) {
        let budget = self.settings.in_flight * PREFETCH;
        let mut lanes = self.lanes();
        let held: usize = lanes.values().map(Lane::held).sum();
        let mut total_room = budget.saturating_sub(held);
        // Endpoints that failed lately (hanging ones hold their room for a
        // whole timeout) share half of it, and a project at most a
        // quarter: endpoints that answer always find room.
        let mut suspect_room = (budget / 2)
            .saturating_sub(lanes.values().filter(|l| l.suspect()).map(Lane::held).sum());
        let mut project_room: HashMap<String, usize> = HashMap::new();
        for lane in lanes.values() {
            let left = project_room
                .entry(lane.project.clone())
                .or_insert(budget / PROJECT_SHARE);
            *left = left.saturating_sub(lane.held());
        }
        let after = self.settings.judgement.circuit_after;
        let mut room: Vec<usize> = due
            .iter()
            .map(|t| {
                let lane = lanes
                    .entry(t.id.clone())
                    .or_insert_with(|| self.new_lane(t));
                // Secrets may have rotated since the lane was made.
                lane.target = self.signing_target(t);
                lane.failed_lately = t.consecutive_failures > 0;
                lane.cap = match t.consecutive_failures >= after || lane.streak >= after {
                    true => 1,
                    false => self.settings.per_endpoint,
                };
                (lane.cap * PREFETCH).saturating_sub(lane.held())
            })
            .collect();
        let suspect: Vec<bool> = due
            .iter()
            .map(|t| lanes.get(&t.id).is_some_and(Lane::suspect))
            .collect();
        drop(lanes);
        let mut given = vec![0usize; due.len()];
        let start = self.turn.fetch_add(1, Ordering::Relaxed);
        let mut progress = true;
        while total_room > 0 && progress {
            progress = false;
            for k in 0..due.len() {
                let i = (start + k) % due.len();
                let project = project_room
                    .entry(due[i].project.clone())
                    .or_insert(budget / PROJECT_SHARE);
                let fits = total_room > 0
                    && room[i] > 0
                    && *project > 0
                    && (!suspect[i] || suspect_room > 0);
                if fits {
                    room[i] -= 1;
                    given[i] += 1;
                    total_room -= 1;
                    *project -= 1;
                    if suspect[i] {
                        suspect_room -= 1;
                    }
                    progress = true;
                }
            }
        }
        due.iter()
            .zip(given)
            .filter(|(_, n)| *n > 0)
            .map(|(t, n)| (t.id.clone(), n as i32))
            .unzip()
    }

    fn new_lane(&self, target: &Target) -> Lane {
        Lane {
            target: self.signing_target(target),
            project: target.project.clone(),
            failed_lately: target.consecutive_failures > 0,
            waiting: VecDeque::new(),
            in_flight: 0,
            cap: match target.consecutive_failures >= self.settings.judgement.circuit_after {
                true => 1,
                false => self.settings.per_endpoint,
            },
            streak: 0,
        }
    }

    fn signing_target(&self, target: &Target) -> Arc<SigningTarget> {
        let keys = std::iter::once(&target.secret)
            .chain(target.previous_secret.as_ref())
            .filter_map(|secret| sink::signing_key(secret).ok())
            .collect();
        Arc::new(SigningTarget {
            target: sink::Target {
                url: target.url.clone(),
                shown_url: crate::infra::redact::url_without_secrets(&target.url),
                instance_id: self.instance_id.clone(),
                keys,
                clock: self.clock.clone(),
            },
            url: target.url.clone(),
        })
    }

    /// Starts the endpoint's waiting deliveries its cap allows.
    fn pump(self: &Arc<Self>, endpoint: &str) {
        let mut lanes = self.lanes();
        let Some(lane) = lanes.get_mut(endpoint) else {
            return;
        };
        while lane.in_flight < lane.cap {
            let Some(delivery) = lane.waiting.pop_front() else {
                break;
            };
            lane.in_flight += 1;
            let (dispatcher, target) = (self.clone(), lane.target.clone());
            self.attempts
                .spawn(async move { dispatcher.attempt(target, delivery).await });
        }
    }

    /// One attempt: sent, timed, handed to the recorder; the endpoint's
    /// next waiting delivery starts.
    async fn attempt(self: Arc<Self>, target: Arc<SigningTarget>, claimed: Claimed) {
        let attempted_at = chrono::Utc::now();
        let started = std::time::Instant::now();
        let delivery = Delivery {
            row_id: claimed.outbox_id,
            document_id: claimed.document_id.clone(),
            project: claimed.project.clone(),
            doc_type: claimed.doc_type.clone(),
            seq: claimed.seq,
            created_at: claimed.created_at,
            payload: Some(claimed.payload.clone()),
        };
        // A literal address is checked again here (names are checked by
        // the client's resolver at every connection).
        let outcome = match url_guard::parse(&target.url, self.settings.policy) {
            Ok(_) => sink::post(&self.client, &target.target, &delivery)
                .await
                .map(|status| status.as_u16()),
            Err(_) => Err(DeliveryError::AddressNotAllowed {
                url: target.target.shown_url.clone(),
            }),
        };
        let duration_ms = started.elapsed().as_millis().min(i32::MAX as u128) as i32;
        let (status_code, error) = match &outcome {
            Ok(status) => (Some(i32::from(*status)), None),
            Err(e) => (e.status_code().map(i32::from), Some(classification(e))),
        };
        if let Err(e) = &outcome {
            self.failures.warn(&format_args!(
                "{e} (document {}, endpoint {})",
                claimed.document_id, claimed.endpoint_id
            ));
        }
        let endpoint = claimed.endpoint_id.clone();
        let _ = self.outcomes.send(Attempt {
            outbox_id: claimed.outbox_id,
            endpoint_id: claimed.endpoint_id,
            claim: claimed.claim,
            document_id: claimed.document_id,
            attempted_at,
            status_code,
            error,
            duration_ms,
        });
        self.ended(&endpoint, outcome.is_ok());
    }

    /// An attempt of `endpoint` ended: the next waiting one starts; at the
    /// circuit's threshold of failures in a row the waiting claims are
    /// given back; a lane running low wakes the loop to claim more.
    fn ended(self: &Arc<Self>, endpoint: &str, succeeded: bool) {
        let given_back = {
            let mut lanes = self.lanes();
            let Some(lane) = lanes.get_mut(endpoint) else {
                return;
            };
            lane.in_flight = lane.in_flight.saturating_sub(1);
            lane.streak = if succeeded { 0 } else { lane.streak + 1 };
            let given_back: Vec<Claimed> = if lane.streak >= self.settings.judgement.circuit_after {
                lane.cap = 1;
                lane.waiting.drain(..).collect()
            } else {
                Vec::new()
            };
            if lane.held() == 0 && lane.streak == 0 {
                lanes.remove(endpoint);
            }
            given_back
        };
        self.pump(endpoint);
        if !given_back.is_empty() {
            let (db, pause) = (self.db.clone(), self.settings.judgement.circuit_base);
            self.attempts.spawn(async move {
                if let Err(e) = deliveries::release(&db, &given_back, pause).await {
                    tracing::warn!(error = %e, "claims of a failing endpoint not given back; they fall due when they end");
                }
            });
        }
        let low = self
            .lanes()
            .get(endpoint)
            .is_none_or(|lane| lane.waiting.len() <= lane.cap);
        if low {
            self.wake.notify_one();
        }
    }

    /// Records finished attempts in batches, until `attempts_ended` and
    /// nothing is left to record; a batch the database refuses is tried
    /// again after a pause (its claims keep the deliveries from being sent
    /// again meanwhile).
    async fn record_all(
        self: Arc<Self>,
        mut receiver: mpsc::UnboundedReceiver<Attempt>,
        attempts_ended: CancellationToken,
    ) {
        let mut failures = Retrying::new("recording endpoint deliveries failed");
        let mut batch = Vec::new();
        loop {
            if batch.is_empty() {
                tokio::select! {
                    attempt = receiver.recv() => match attempt {
                        Some(attempt) => batch.push(attempt),
                        None => return,
                    },
                    _ = attempts_ended.cancelled() => {}
                }
            }
            while batch.len() < RECORD_BATCH {
                match receiver.try_recv() {
                    Ok(attempt) => batch.push(attempt),
                    Err(_) => break,
                }
            }
            if batch.is_empty() {
                return;
            }
            match deliveries::record(&self.db, &batch, &self.settings.judgement).await {
                Ok(recorded) => {
                    failures.succeeded();
                    self.count(&recorded);
                    batch.clear();
                }
                Err(e) => tokio::time::sleep(failures.failed(&e)).await,
            }
        }
    }

    fn count(&self, recorded: &deliveries::Recorded) {
        for lag in &recorded.lags {
            self.stats.outbox_lag.observe(*lag);
        }
        self.stats
            .outbox_delivered
            .inc_by(recorded.delivered as u64);
        self.stats
            .outbox_delivery_failures
            .inc_by(recorded.failed as u64);
        self.stats
            .outbox_dead_lettered
            .inc_by(recorded.dead_lettered as u64);
        for endpoint in &recorded.disabled {
            tracing::warn!(
                endpoint,
                "endpoint disabled: every attempt failed for too long"
            );
        }
    }
}

/// Rows one sweep step of a deleted endpoint changes at most: a short
/// transaction, whatever the endpoint left.
const SWEEP_CHUNK: i64 = 1_000;

/// How often deleted endpoints are looked for when none is left to sweep.
const SWEEP_EVERY: Duration = Duration::from_secs(2);

/// Sweeps what deleted endpoints left, a bounded step at a time, until
/// `stop`.
async fn sweep_deleted_endpoints(db: Db, stop: CancellationToken) {
    let mut failures = Retrying::new("sweeping deleted endpoints failed");
    while !stop.is_cancelled() {
        let pause = match super::store::sweep_deleted(&db, SWEEP_CHUNK).await {
            Ok(swept) => {
                failures.succeeded();
                match swept {
                    0 => SWEEP_EVERY,
                    _ => Duration::ZERO,
                }
            }
            Err(e) => failures.failed(&e),
        };
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(pause) => {}
        }
    }
}

/// What a tenant reads of a failure; an address refused by the guard is
/// said so.
fn classification(error: &DeliveryError) -> String {
    if let DeliveryError::WebhookUnreachable { source, .. } = error {
        let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(source.as_ref());
        while let Some(e) = cause {
            if e.downcast_ref::<url_guard::NotPublic>().is_some() {
                return "address not allowed".into();
            }
            cause = e.source();
        }
    }
    error.classification()
}
