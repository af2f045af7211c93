//! Test support: the plans Postgres ran a storage function's statements
//! with, counted in rows and pages (auto_explain, analyzed, reported to the
//! client as notices). A test then asserts what a query reads, which does
//! not vary with the machine's load, instead of how long it took.

use std::sync::{Arc, Mutex};

use serde_json::Value;
use tracing::field::{Field, Visit};
use tracing_subscriber::layer::{Context, SubscriberExt};

use super::{Db, Limits, Pooler};

/// A pool of one connection on `db`'s database whose every statement is
/// explained, and the plans explained so far. Its notices are caught on the
/// test's thread: use it from a current-thread runtime (`#[tokio::test]`).
pub(crate) struct Explained {
    pub db: Db,
    plans: Arc<Mutex<Vec<Plan>>>,
    _caught: tracing::subscriber::DefaultGuard,
}

impl Explained {
    pub async fn on(db: &Db) -> Self {
        let options = db.connect_options().options([
            ("session_preload_libraries", "auto_explain"),
            ("auto_explain.log_min_duration", "0"),
            ("auto_explain.log_analyze", "on"),
            ("auto_explain.log_buffers", "on"),
            ("auto_explain.log_timing", "off"),
            ("auto_explain.log_nested_statements", "on"),
            ("auto_explain.log_format", "json"),
            ("auto_explain.log_level", "notice"),
        ]);
        let plans = Arc::new(Mutex::new(Vec::new()));
        let subscriber = tracing_subscriber::registry().with(Notices(plans.clone()));
        let caught = tracing::subscriber::set_default(subscriber);
        let db = super::pool(options, 1, Limits::default(), Pooler::None)
            .await
            .expect("an explaining pool");
        Self {
            db,
            plans,
            _caught: caught,
        }
    }

    /// The plans of the statements run since the last call whose text
    /// contains `query_part` (sqlx's own statements are left out this way).
    pub fn take(&self, query_part: &str) -> Vec<Plan> {
        let mut plans = self.plans.lock().expect("plans");
        std::mem::take(&mut *plans)
            .into_iter()
            .filter(|p| p.query().contains(query_part))
            .collect()
    }
}

/// One statement's plan as auto_explain gives it (`FORMAT JSON`).
#[derive(Debug, Clone)]
pub(crate) struct Plan(Value);

impl Plan {
    pub fn query(&self) -> &str {
        self.0["Query Text"].as_str().unwrap_or_default()
    }

    /// Every node, depth first.
    pub fn nodes(&self) -> Vec<&Value> {
        fn walk<'a>(node: &'a Value, out: &mut Vec<&'a Value>) {
            out.push(node);
            for child in node["Plans"].as_array().into_iter().flatten() {
                walk(child, out);
            }
        }
        let mut out = Vec::new();
        walk(&self.0["Plan"], &mut out);
        out
    }

    /// Tables read from start to end.
    pub fn sequential_scans(&self) -> Vec<String> {
        self.nodes()
            .into_iter()
            .filter(|n| n["Node Type"] == "Seq Scan")
            .map(|n| n["Relation Name"].as_str().unwrap_or_default().to_owned())
            .collect()
    }

    /// Rows the scans of tables and indexes produced or threw away, over
    /// all their loops: what the statement read, whatever it returned.
    pub fn rows_read(&self) -> u64 {
        let count = |n: &Value, key: &str| n[key].as_f64().unwrap_or(0.0);
        self.nodes()
            .into_iter()
            .filter(|n| n["Node Type"].as_str().is_some_and(|t| t.ends_with("Scan")))
            .map(|n| {
                let loops = count(n, "Actual Loops").max(1.0);
                let read = count(n, "Actual Rows")
                    + count(n, "Rows Removed by Filter")
                    + count(n, "Rows Removed by Index Recheck");
                (read * loops) as u64
            })
            .sum()
    }

    /// Rows the statement sent back.
    pub fn rows_returned(&self) -> u64 {
        self.0["Plan"]["Actual Rows"].as_f64().unwrap_or(0.0) as u64
    }

    /// Pages of tables and indexes the statement touched, in memory or not.
    pub fn pages(&self) -> u64 {
        let plan = &self.0["Plan"];
        ["Shared Hit Blocks", "Shared Read Blocks"]
            .iter()
            .map(|k| plan[*k].as_u64().unwrap_or(0))
            .sum()
    }

    /// The kinds of node, depth first (`Index Scan on id_outbox_document_id_key`).
    pub fn shape(&self) -> Vec<String> {
        self.nodes().into_iter().map(kind).collect()
    }

    /// Each node with the rows it produced and threw away, for messages.
    pub fn describe(&self) -> String {
        self.nodes()
            .into_iter()
            .map(|n| {
                format!(
                    "{}: {} rows x {} loops, {} filtered out",
                    kind(n),
                    n["Actual Rows"],
                    n["Actual Loops"],
                    n["Rows Removed by Filter"].as_f64().unwrap_or(0.0)
                )
            })
            .collect::<Vec<_>>()
            .join("; ")
    }
}

fn kind(node: &Value) -> String {
    let kind = node["Node Type"].as_str().unwrap_or_default();
    match node["Index Name"]
        .as_str()
        .or(node["Relation Name"].as_str())
    {
        Some(on) => format!("{kind} on {on}"),
        None => kind.to_owned(),
    }
}

/// Catches auto_explain's notices, which sqlx reports as events.
struct Notices(Arc<Mutex<Vec<Plan>>>);

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Notices {
    fn on_event(&self, event: &tracing::Event<'_>, _: Context<'_, S>) {
        if event.metadata().target() != "sqlx::postgres::notice" {
            return;
        }
        let mut message = Message(String::new());
        event.record(&mut message);
        // "duration: 0.1 ms  plan:\n{...}"
        let Some((_, json)) = message.0.split_once("plan:") else {
            return;
        };
        if let Ok(plan) = serde_json::from_str(json.trim()) {
            self.0.lock().expect("plans").push(Plan(plan));
        }
    }
}

struct Message(String);

impl Visit for Message {
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" {
            self.0 = value.to_owned();
        }
    }

    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            self.0 = format!("{value:?}");
        }
    }
}
