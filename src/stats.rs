//! Counters of one instance, rendered for `GET /metrics` (Prometheus text).
//!
//! Plain atomics owned by the application rather than a global recorder, so
//! several instances in one test process each report their own figures.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};

#[derive(Default)]
pub struct Stats {
    pub ids_from_pool: AtomicU64,
    pub ids_direct: AtomicU64,
    pub pool_pops: AtomicU64,
    pub pool_short: AtomicU64,
    pub refills_done: AtomicU64,
    pub refills_busy: AtomicU64,
    pub refills_failed: AtomicU64,
    pub refills_in_flight: AtomicU64,
    pub refills_in_flight_peak: AtomicU64,
    pub stale_numbers_rejected: AtomicU64,
    pub pool_numbers_discarded: AtomicU64,
    pub redis_trips: AtomicU64,
    pub redis_resyncs: AtomicU64,
    pub ledger_batches: AtomicU64,
    pub ledger_rows: AtomicU64,
    pub reconcile_runs: AtomicU64,
    /// Background tasks and batch handlers that panicked (and were restarted).
    pub task_panics: AtomicU64,
    /// Shared ledger writes that failed and were split to find the request at fault.
    pub ledger_writes_split: AtomicU64,
    pub reconcile_last_ms: AtomicU64,
    /// Numbers in open gaps by reason, as of the last reconciliation.
    pub gaps_open: std::sync::Mutex<std::collections::BTreeMap<String, i64>>,
}

/// Holds one refill slot in the in-flight gauge while alive.
pub struct InFlight<'a>(&'a Stats);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.refills_in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Stats {
    pub fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    pub fn refill_started(&self) -> InFlight<'_> {
        let now = self.refills_in_flight.fetch_add(1, Ordering::Relaxed) + 1;
        self.refills_in_flight_peak
            .fetch_max(now, Ordering::Relaxed);
        InFlight(self)
    }

    pub fn render(&self, mode_pool: bool) -> String {
        let mut out = String::with_capacity(2048);
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        let mut metric = |name: &str, kind: &str, help: &str, samples: &[(&str, u64)]| {
            let _ = writeln!(out, "# HELP {name} {help}");
            let _ = writeln!(out, "# TYPE {name} {kind}");
            for (labels, value) in samples {
                let _ = writeln!(out, "{name}{labels} {value}");
            }
        };
        metric(
            "idpool_ids_issued_total",
            "counter",
            "Numbers issued to callers, by where they came from.",
            &[
                ("{source=\"pool\"}", get(&self.ids_from_pool)),
                ("{source=\"direct\"}", get(&self.ids_direct)),
            ],
        );
        metric(
            "idpool_pool_pops_total",
            "counter",
            "Pop round trips to Redis.",
            &[("", get(&self.pool_pops))],
        );
        metric(
            "idpool_pool_short_total",
            "counter",
            "Requests a pool could not fully serve at once.",
            &[("", get(&self.pool_short))],
        );
        metric(
            "idpool_refills_total",
            "counter",
            "Pool refills by outcome.",
            &[
                ("{outcome=\"done\"}", get(&self.refills_done)),
                ("{outcome=\"busy\"}", get(&self.refills_busy)),
                ("{outcome=\"failed\"}", get(&self.refills_failed)),
            ],
        );
        metric(
            "idpool_refills_in_flight",
            "gauge",
            "Refills running in this instance now.",
            &[("", get(&self.refills_in_flight))],
        );
        metric(
            "idpool_refills_in_flight_peak",
            "gauge",
            "Most refills this instance ever ran at once.",
            &[("", get(&self.refills_in_flight_peak))],
        );
        metric(
            "idpool_stale_numbers_rejected_total",
            "counter",
            "Popped numbers the issuance ledger refused as already issued.",
            &[("", get(&self.stale_numbers_rejected))],
        );
        metric(
            "idpool_pool_numbers_discarded_total",
            "counter",
            "Numbers removed from pools unissued (recorded as pool_discarded).",
            &[("", get(&self.pool_numbers_discarded))],
        );
        metric(
            "idpool_redis_trips_total",
            "counter",
            "Times Redis failed and the instance fell back to Postgres.",
            &[("", get(&self.redis_trips))],
        );
        metric(
            "idpool_redis_resyncs_total",
            "counter",
            "Pool checks after a Redis (re)connect.",
            &[("", get(&self.redis_resyncs))],
        );
        metric(
            "idpool_ledger_batches_total",
            "counter",
            "Shared ledger statements written.",
            &[("", get(&self.ledger_batches))],
        );
        metric(
            "idpool_ledger_rows_total",
            "counter",
            "Ledger ranges written by those statements.",
            &[("", get(&self.ledger_rows))],
        );
        metric(
            "idpool_task_panics_total",
            "counter",
            "Background tasks and batch handlers that panicked; each was restarted.",
            &[("", get(&self.task_panics))],
        );
        metric(
            "idpool_ledger_writes_split_total",
            "counter",
            "Shared ledger writes that failed and were split until the request at fault stood alone.",
            &[("", get(&self.ledger_writes_split))],
        );
        metric(
            "idpool_reconcile_runs_total",
            "counter",
            "Reconciliation runs of this instance.",
            &[("", get(&self.reconcile_runs))],
        );
        metric(
            "idpool_reconcile_last_duration_ms",
            "gauge",
            "Duration of this instance's last reconciliation run.",
            &[("", get(&self.reconcile_last_ms))],
        );
        let open: Vec<(String, u64)> = self
            .gaps_open
            .lock()
            .map(|g| {
                g.iter()
                    .map(|(r, n)| (format!("{{reason=\"{r}\"}}"), *n as u64))
                    .collect()
            })
            .unwrap_or_default();
        let open: Vec<(&str, u64)> = open.iter().map(|(l, n)| (l.as_str(), *n)).collect();
        metric(
            "idpool_gaps_open",
            "gauge",
            "Numbers in open gaps by reason, as of the last reconciliation run here.",
            &open,
        );
        metric(
            "idpool_mode_pool",
            "gauge",
            "1 while IDs come from Redis pools, 0 in Postgres fallback.",
            &[("", u64::from(mode_pool))],
        );
        out
    }
}
