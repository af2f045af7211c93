//! Metrics of one instance, rendered for `GET /metrics`.
//!
//! A `prometheus-client` registry owned by the application rather than a
//! global one, so several instances in one test process each report their
//! own figures. The names are those of the hand-written renderer this
//! replaced (users' dashboards use them); counters are registered without
//! `_total`, which the encoder appends.

use std::borrow::Cow;
use std::sync::atomic::Ordering;
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

/// One label, both parts fixed words of ours.
type Label = [(&'static str, &'static str); 1];

/// A request's route (the matched template, never the raw path) and answer.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    pub method: Cow<'static, str>,
    pub route: Cow<'static, str>,
    pub status: u16,
}

type Histograms<L> = Family<L, Histogram, fn() -> Histogram>;

pub struct Stats {
    registry: Registry,
    pub ids_from_pool: Counter,
    pub ids_direct: Counter,
    pub pool_pops: Counter,
    pub pool_short: Counter,
    pub refills_done: Counter,
    pub refills_busy: Counter,
    pub refills_failed: Counter,
    refills_in_flight: Gauge,
    refills_in_flight_peak: Gauge,
    pub stale_numbers_rejected: Counter,
    pub reservations_expired: Counter,
    pub gapless_violations: Counter,
    /// Gapless documents left out of a shared commit because another
    /// transaction held their counter (each tries again later).
    pub gapless_counter_held: Counter,
    /// Periods whose Postgres counter was found behind Redis and moved past
    /// it (a failover lost commits).
    pub fences: Counter,
    /// Writes whose commit was in doubt (the connection broke before its
    /// answer), looked up once Postgres answered again.
    pub in_doubt_settled: Counter,
    /// Sequences with less than a tenth of their numbers left before their
    /// `max`, as of this instance's last reconciliation run (0 on instances
    /// that did not run it).
    pub sequences_near_max: Gauge,
    /// 1 while `/readyz` would answer 200 (Postgres answers and takes
    /// writes), as of the last scrape or probe.
    ready: Gauge,
    /// 1 while Postgres answers but is read-only (a standby, a demoted
    /// primary).
    postgres_read_only: Gauge,
    /// Outbox deliveries: delivered, failed (to be retried or
    /// dead-lettered), dead-lettered.
    pub outbox_delivered: Counter,
    pub outbox_delivery_failures: Counter,
    pub outbox_dead_lettered: Counter,
    /// Age of the oldest pending outbox row, as of the processor's last look.
    pub outbox_oldest_pending_seconds: Gauge,
    pub pool_numbers_discarded: Counter,
    /// Pools given up after going unused (or their period ended), and the
    /// numbers they held.
    pub pools_given_up: Counter,
    pub pool_numbers_given_up: Counter,
    pub redis_trips: Counter,
    pub redis_resyncs: Counter,
    pub ledger_batches: Counter,
    pub ledger_rows: Counter,
    pub reconcile_runs: Counter,
    /// Background tasks and batch handlers that panicked (and were restarted).
    pub task_panics: Counter,
    /// Shared ledger writes that failed and were split to find the request at fault.
    pub ledger_writes_split: Counter,
    pub reconcile_last_ms: Gauge,
    /// Leases recorded for this instance, and their numbers.
    pub leases_taken: Counter,
    /// Numbers leases gave back that are not back in their pool yet
    /// (Postgres or Redis could not take them): tried again with backoff.
    pub lease_returns_retrying: Gauge,
    /// Numbers surely not issued that Redis could not take back, held until
    /// the pools are in use again.
    pub numbers_unreturned: Gauge,
    /// Numbers handed out of leases whose handout record is not written
    /// yet (written every few milliseconds, off the answers' path).
    pub handouts_unreported: Gauge,
    pub lease_numbers: Counter,
    /// Numbers handed to callers from a lease (no Redis call, no commit).
    pub lease_numbers_served: Counter,
    /// Lease numbers given back unused (an idle lease, a clean stop).
    pub lease_numbers_returned: Counter,
    /// Numbers in open gaps in open gaps by reason, as of the last reconciliation.
    gaps_open: Family<Label, Gauge>,
    mode_pool: Gauge,
    requests: Histograms<RequestLabels>,
    pub refill_duration: Histogram,
    /// Requests served by one pop of the pipeline.
    pub pipeline_pop_batch: Histogram,
    /// Requests recorded by one commit of the pipeline.
    pub pipeline_write_batch: Histogram,
    /// From a document's acceptance to its delivery.
    pub outbox_lag: Histogram,
}

/// Holds one refill slot in the in-flight gauge while alive.
pub struct InFlight<'a>(&'a Stats);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.refills_in_flight.dec();
    }
}

/// Seconds from half a millisecond to about 16 s.
fn latency_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.0005, 2.0, 16))
}

/// Batch sizes from 1 to 4096.
fn batch_histogram() -> Histogram {
    Histogram::new(exponential_buckets(1.0, 2.0, 13))
}

/// Name (after `idpool_`; counters get `_total` from the encoder) and help
/// of every metric: the names users' dashboards know.
const METRICS: &[(&str, &str)] = &[
    (
        "ids_issued",
        "Numbers taken for callers (leases included), by where they came from",
    ),
    ("pool_pops", "Pop round trips to Redis"),
    (
        "pool_short",
        "Requests a pool could not fully serve at once",
    ),
    ("refills", "Pool refills by outcome"),
    ("refills_in_flight", "Refills running in this instance now"),
    (
        "refills_in_flight_peak",
        "Most refills this instance ever ran at once",
    ),
    (
        "stale_numbers_rejected",
        "Popped numbers the issuance ledger refused as already issued",
    ),
    (
        "reservations_expired",
        "Reservations of gapless sequences voided because their deadline passed",
    ),
    (
        "gapless_violations",
        "Numbers of gapless sequences reconciliation found neither a document nor a void",
    ),
    (
        "pool_numbers_discarded",
        "Numbers removed from pools unissued (recorded as pool_discarded)",
    ),
    (
        "pools_given_up",
        "Pools given up after going unused or at the end of their period (their keys left Redis)",
    ),
    (
        "pool_numbers_given_up",
        "Numbers of given-up pools (back to the counter where they were its last, else pool_discarded)",
    ),
    (
        "redis_trips",
        "Times Redis failed and the instance fell back to Postgres",
    ),
    ("redis_resyncs", "Pool checks after a Redis (re)connect"),
    ("ledger_batches", "Shared ledger statements written"),
    ("ledger_rows", "Ledger ranges written by those statements"),
    (
        "task_panics",
        "Background tasks and batch handlers that panicked; each was restarted",
    ),
    (
        "sequences_near_max",
        "Sequences whose latest period has less than a tenth of its numbers left before max (set by the instance running reconciliation; 0 elsewhere)",
    ),
    (
        "ready",
        "1 while Postgres answers and takes writes (what /readyz says), 0 otherwise",
    ),
    (
        "postgres_read_only",
        "1 while Postgres answers but takes no writes (a standby, a demoted primary)",
    ),
    ("outbox_delivered", "Outbox rows delivered to the sink"),
    (
        "outbox_delivery_failures",
        "Outbox deliveries that failed (retried later, or dead-lettered)",
    ),
    (
        "outbox_dead_lettered",
        "Outbox rows dead-lettered after their last retry",
    ),
    (
        "outbox_oldest_pending_seconds",
        "Age of the oldest pending outbox row (0 when none), as of the processor's last look",
    ),
    (
        "fences",
        "Periods whose Postgres counter was found behind Redis (a failover lost commits) and moved past it",
    ),
    (
        "in_doubt_settled",
        "Writes whose commit was in doubt (the connection broke before its answer), looked up once Postgres answered again",
    ),
    (
        "gapless_counter_held",
        "Gapless documents left out of a shared commit because another transaction held their counter",
    ),
    (
        "ledger_writes_split",
        "Shared ledger writes that failed and were split until the request at fault stood alone",
    ),
    ("reconcile_runs", "Reconciliation runs of this instance"),
    (
        "leases",
        "Leases this instance recorded before handing out their numbers",
    ),
    (
        "lease_returns_retrying",
        "Numbers leases gave back that are not back in their pool yet (Postgres or Redis could not take them; tried again with backoff)",
    ),
    (
        "numbers_unreturned",
        "Numbers surely not issued that Redis could not take back, held until the pools are in use again",
    ),
    (
        "handouts_unreported",
        "Numbers handed out of leases whose handout record is not written yet (written every few milliseconds, off the answers' path)",
    ),
    (
        "lease_numbers",
        "Numbers in the leases this instance recorded",
    ),
    (
        "lease_numbers_served",
        "Numbers handed to callers from a lease in memory",
    ),
    (
        "lease_numbers_returned",
        "Lease numbers given back unused (to their pool, or recorded as pool_discarded)",
    ),
    (
        "reconcile_last_duration_ms",
        "Duration of this instance's last reconciliation run",
    ),
    (
        "gaps_open",
        "Numbers in open gaps by reason, as of the last reconciliation run here",
    ),
    (
        "mode_pool",
        "1 while IDs come from Redis pools, 0 in Postgres fallback",
    ),
    (
        "http_request_duration_seconds",
        "Time from a request's arrival to its answer, by route and status",
    ),
    (
        "refill_duration_seconds",
        "Time one pool refill took, lock to push",
    ),
    (
        "pipeline_pop_batch_size",
        "Requests served by one pop stage of the pipeline",
    ),
    (
        "pipeline_write_batch_size",
        "Requests recorded by one shared ledger commit",
    ),
    (
        "outbox_lag_seconds",
        "Time from a document's acceptance to its delivery to the sink",
    ),
];

/// Registers `metric` under `name` (one of [`METRICS`]) and returns it.
fn registered<M>(registry: &mut Registry, name: &'static str, metric: M) -> M
where
    M: prometheus_client::registry::Metric + Clone,
{
    let help = METRICS
        .iter()
        .find(|(known, _)| *known == name)
        .map_or("", |(_, help)| help);
    registry.register(name, help, metric.clone());
    metric
}

impl Default for Stats {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("idpool");
        let r = &mut registry;
        let issued = registered(r, "ids_issued", Family::<Label, Counter>::default());
        let refills = registered(r, "refills", Family::<Label, Counter>::default());
        let requests: Histograms<RequestLabels> = Family::new_with_constructor(latency_histogram);
        Self {
            ids_from_pool: issued.get_or_create_owned(&[("source", "pool")]),
            ids_direct: issued.get_or_create_owned(&[("source", "direct")]),
            pool_pops: registered(r, "pool_pops", Counter::default()),
            pool_short: registered(r, "pool_short", Counter::default()),
            refills_done: refills.get_or_create_owned(&[("outcome", "done")]),
            refills_busy: refills.get_or_create_owned(&[("outcome", "busy")]),
            refills_failed: refills.get_or_create_owned(&[("outcome", "failed")]),
            refills_in_flight: registered(r, "refills_in_flight", Gauge::default()),
            refills_in_flight_peak: registered(r, "refills_in_flight_peak", Gauge::default()),
            stale_numbers_rejected: registered(r, "stale_numbers_rejected", Counter::default()),
            reservations_expired: registered(r, "reservations_expired", Counter::default()),
            gapless_violations: registered(r, "gapless_violations", Counter::default()),
            gapless_counter_held: registered(r, "gapless_counter_held", Counter::default()),
            fences: registered(r, "fences", Counter::default()),
            in_doubt_settled: registered(r, "in_doubt_settled", Counter::default()),
            sequences_near_max: registered(r, "sequences_near_max", Gauge::default()),
            ready: registered(r, "ready", Gauge::default()),
            postgres_read_only: registered(r, "postgres_read_only", Gauge::default()),
            outbox_delivered: registered(r, "outbox_delivered", Counter::default()),
            outbox_delivery_failures: registered(r, "outbox_delivery_failures", Counter::default()),
            outbox_dead_lettered: registered(r, "outbox_dead_lettered", Counter::default()),
            outbox_oldest_pending_seconds: registered(
                r,
                "outbox_oldest_pending_seconds",
                Gauge::default(),
            ),
            pool_numbers_discarded: registered(r, "pool_numbers_discarded", Counter::default()),
            pools_given_up: registered(r, "pools_given_up", Counter::default()),
            pool_numbers_given_up: registered(r, "pool_numbers_given_up", Counter::default()),
            redis_trips: registered(r, "redis_trips", Counter::default()),
            redis_resyncs: registered(r, "redis_resyncs", Counter::default()),
            ledger_batches: registered(r, "ledger_batches", Counter::default()),
            ledger_rows: registered(r, "ledger_rows", Counter::default()),
            task_panics: registered(r, "task_panics", Counter::default()),
            leases_taken: registered(r, "leases", Counter::default()),
            lease_returns_retrying: registered(r, "lease_returns_retrying", Gauge::default()),
            numbers_unreturned: registered(r, "numbers_unreturned", Gauge::default()),
            handouts_unreported: registered(r, "handouts_unreported", Gauge::default()),
            lease_numbers: registered(r, "lease_numbers", Counter::default()),
            lease_numbers_served: registered(r, "lease_numbers_served", Counter::default()),
            lease_numbers_returned: registered(r, "lease_numbers_returned", Counter::default()),
            ledger_writes_split: registered(r, "ledger_writes_split", Counter::default()),
            reconcile_runs: registered(r, "reconcile_runs", Counter::default()),
            reconcile_last_ms: registered(r, "reconcile_last_duration_ms", Gauge::default()),
            gaps_open: registered(r, "gaps_open", Family::default()),
            mode_pool: registered(r, "mode_pool", Gauge::default()),
            requests: registered(r, "http_request_duration_seconds", requests),
            refill_duration: registered(r, "refill_duration_seconds", latency_histogram()),
            pipeline_pop_batch: registered(r, "pipeline_pop_batch_size", batch_histogram()),
            pipeline_write_batch: registered(r, "pipeline_write_batch_size", batch_histogram()),
            outbox_lag: registered(r, "outbox_lag_seconds", latency_histogram()),
            registry,
        }
    }
}

impl Stats {
    pub fn refill_started(&self) -> InFlight<'_> {
        let now = self.refills_in_flight.inc() + 1;
        self.refills_in_flight_peak
            .inner()
            .fetch_max(now, Ordering::Relaxed);
        InFlight(self)
    }

    pub fn observe_request(&self, labels: &RequestLabels, took: Duration) {
        self.requests
            .get_or_create(labels)
            .observe(took.as_secs_f64());
    }

    /// The open gaps of every reason; reasons not named have none.
    pub fn set_gaps_open(&self, open: &[(&'static str, i64)]) {
        self.gaps_open.clear();
        for (reason, numbers) in open {
            self.gaps_open
                .get_or_create(&[("reason", reason)])
                .set(*numbers);
        }
    }

    /// What the last readiness probe found.
    pub fn set_readiness(&self, ready: bool, read_only: bool) {
        self.ready.set(i64::from(ready));
        self.postgres_read_only.set(i64::from(read_only));
    }

    /// OpenMetrics text, which Prometheus also reads as its text format.
    pub fn render(&self, mode_pool: bool) -> String {
        self.mode_pool.set(i64::from(mode_pool));
        let mut out = String::with_capacity(8192);
        if let Err(e) = prometheus_client::encoding::text::encode(&mut out, &self.registry) {
            tracing::error!(error = %e, "metrics could not be rendered");
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(text: &str, name: &str) -> Option<f64> {
        text.lines()
            .filter(|l| !l.starts_with('#'))
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
    }

    #[test]
    fn existing_metric_names_keep_their_names() {
        let stats = Stats::default();
        stats.ids_from_pool.inc_by(3);
        stats.refills_busy.inc();
        let _running = stats.refill_started();
        stats.set_gaps_open(&[("outbox_dlq", 7)]);
        let text = stats.render(true);
        assert_eq!(
            sample(&text, "idpool_ids_issued_total{source=\"pool\"}"),
            Some(3.0)
        );
        assert_eq!(
            sample(&text, "idpool_ids_issued_total{source=\"direct\"}"),
            Some(0.0)
        );
        assert_eq!(
            sample(&text, "idpool_refills_total{outcome=\"busy\"}"),
            Some(1.0)
        );
        assert_eq!(sample(&text, "idpool_refills_in_flight"), Some(1.0));
        assert_eq!(sample(&text, "idpool_refills_in_flight_peak"), Some(1.0));
        assert_eq!(
            sample(&text, "idpool_gaps_open{reason=\"outbox_dlq\"}"),
            Some(7.0)
        );
        assert_eq!(sample(&text, "idpool_mode_pool"), Some(1.0));
        assert_eq!(sample(&text, "idpool_ledger_writes_split_total"), Some(0.0));
        assert!(text.contains("# HELP idpool_pool_pops Pop round trips to Redis.\n"));
    }

    #[test]
    fn every_metric_is_described_once() {
        let stats = Stats::default();
        // Families are described once they have a member.
        stats.set_gaps_open(&[("abandoned", 1)]);
        let labels = RequestLabels {
            method: "GET".into(),
            route: "/healthz".into(),
            status: 200,
        };
        stats.observe_request(&labels, Duration::from_millis(1));
        let text = stats.render(true);
        for (name, help) in METRICS {
            let line = format!("# HELP idpool_{name} {help}.\n");
            assert_eq!(text.matches(&line).count(), 1, "{line}");
        }
        assert_eq!(text.matches("# HELP ").count(), METRICS.len());
    }

    #[test]
    fn request_latency_is_a_histogram_per_route_and_status() {
        let stats = Stats::default();
        let labels = RequestLabels {
            method: "POST".into(),
            route: "/api/v1/ids".into(),
            status: 200,
        };
        stats.observe_request(&labels, Duration::from_millis(3));
        stats.observe_request(&labels, Duration::from_millis(300));
        let text = stats.render(false);
        let series = "idpool_http_request_duration_seconds_count{method=\"POST\",route=\"/api/v1/ids\",status=\"200\"}";
        assert_eq!(sample(&text, series), Some(2.0));
        let bucket = text
            .lines()
            .find(|l| {
                l.starts_with("idpool_http_request_duration_seconds_bucket{")
                    && l.contains("route=\"/api/v1/ids\"")
                    && l.contains("le=\"0.004\"")
            })
            .and_then(|l| l.rsplit_once(' '))
            .and_then(|(_, n)| n.parse::<f64>().ok());
        assert_eq!(bucket, Some(1.0), "{text}");
    }
}
