//! JSON logs on stdout, filtered by `RUST_LOG` (default `info`).
//!
//! Lines are written by a thread of their own from a bounded queue: a
//! request never waits for the terminal or a slow log collector, and a
//! flood of lines cannot grow memory (lines past the queue are dropped, and
//! counted in the next line that gets through).

use tracing_subscriber::EnvFilter;

/// Keeps the log writer running; logs written before it is dropped are
/// flushed when it is.
pub struct LogGuard(#[allow(dead_code)] Option<tracing_appender::non_blocking::WorkerGuard>);

/// sqlx's per-connection lines, kept to errors unless `RUST_LOG` names sqlx.
const QUIET_SQLX: [&str; 2] = [
    "sqlx::postgres::notice=error",
    "sqlx_core::pool::connection=error",
];

/// The TLS stack's per-connection lines, off unless `RUST_LOG` names rustls.
const QUIET_TLS: [&str; 2] = ["rustls_platform_verifier=off", "rustls=off"];

/// Lines the writer queue holds before it drops new ones.
const QUEUED_LINES: usize = 64 * 1024;

pub fn init() -> LogGuard {
    let mut filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let asked_for_sqlx = std::env::var("RUST_LOG").is_ok_and(|v| v.contains("sqlx"));
    // A tenant's endpoint with a bad certificate makes the TLS verifier
    // log an error line per attempt, unthrottled: the failure is already
    // in the attempt's record and in idpool's own (throttled) warning.
    if !std::env::var("RUST_LOG").is_ok_and(|v| v.contains("rustls")) {
        for quiet in QUIET_TLS {
            if let Ok(directive) = quiet.parse() {
                filter = filter.add_directive(directive);
            }
        }
    }
    if !asked_for_sqlx {
        // At a failover every pooled connection says the same through
        // sqlx (the server's "terminating connection" notice, a failed
        // check on release): a line per connection, not per trouble, which
        // idpool's own lines already say once with a count.
        for quiet in QUIET_SQLX {
            if let Ok(directive) = quiet.parse() {
                filter = filter.add_directive(directive);
            }
        }
    }
    let (writer, guard) = tracing_appender::non_blocking::NonBlockingBuilder::default()
        .buffered_lines_limit(QUEUED_LINES)
        .lossy(true)
        .finish(std::io::stdout());
    // A second init (several apps in one test process) keeps the first.
    let installed = tracing_subscriber::fmt()
        .json()
        .flatten_event(true)
        .with_current_span(true)
        .with_span_list(false)
        .with_env_filter(filter)
        .with_writer(writer)
        .try_init();
    LogGuard(installed.is_ok().then_some(guard))
}
