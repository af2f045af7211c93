//! A real idpool per test: its own Postgres database and Redis key prefix on
//! the servers at DATABASE_URL / REDIS_URL (or a redis-server of its own).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use idpool::domain::clock::{Clock, ManualClock, SystemClock};
use idpool::edge::config::{Config, Switch};
use idpool::edge::startup::{Application, Overrides};
use idpool::features::documents::sink::SinkConfig;
use idpool::features::gaps::reconcile::ReconcileSettings;
use idpool::records::pool::PoolSettings;
use reqwest::StatusCode;
use serde_json::{Value, json};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

/// `TEST_LOG=1`: the logs of in-process apps (at `RUST_LOG`, default
/// debug) and the output of child processes go to the test's output, which
/// the test runner shows for a failing test (or all, with --no-capture).
pub fn test_log() -> bool {
    std::env::var_os("TEST_LOG").is_some_and(|v| !v.is_empty() && v != "0")
}

/// Error lines the in-process apps of this test wrote (nextest runs each
/// test in a process of its own), and the texts a test said to expect.
static ERROR_LINES: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());
static EXPECTED_ERRORS: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());

/// Keeps every ERROR event, its message and fields, for [`TestApp`]'s drop.
struct ErrorLines;

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for ErrorLines {
    fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        struct Text(String);
        impl tracing::field::Visit for Text {
            fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
                self.0.push_str(&format!(" {}={value:?}", field.name()));
            }
        }
        let mut text = Text(event.metadata().target().to_owned());
        event.record(&mut text);
        ERROR_LINES
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(text.0);
    }
}

fn init_test_logging() {
    use tracing_subscriber::layer::SubscriberExt as _;
    use tracing_subscriber::util::SubscriberInitExt as _;
    use tracing_subscriber::{Layer as _, filter::LevelFilter};
    let shown = test_log().then(|| {
        let filter = tracing_subscriber::EnvFilter::try_from_default_env()
            .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("debug"));
        tracing_subscriber::fmt::layer()
            .with_test_writer()
            .with_filter(filter)
    });
    // Every app of the test process shares the first subscriber.
    let _ = tracing_subscriber::registry()
        .with(ErrorLines.with_filter(LevelFilter::ERROR))
        .with(shown)
        .try_init();
}

/// Says error lines holding `text` are part of what this test does (a
/// store it stops, a value it corrupts); any other fails the test. How
/// many were written so far.
pub fn expect_error_lines(text: &str) -> usize {
    EXPECTED_ERRORS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .push(text.to_owned());
    ERROR_LINES
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .filter(|line| line.contains(text))
        .count()
}

/// What an app logs as an error while the test has Redis down, hung, cut
/// off or replaced (the harness says so when it does that).
pub fn expect_redis_trouble() {
    expect_error_lines("pools not in use");
    expect_error_lines("dependency unavailable");
}

/// What an app logs as an error while the test has Postgres stopped,
/// read-only or moved (for longer than a write in doubt waits, too).
pub fn expect_postgres_trouble() {
    // The pools' watch reads Postgres too (a standby's "recovery is in
    // progress" takes the pools out of use).
    expect_error_lines("pools not in use");
    expect_error_lines("dependency unavailable");
    expect_error_lines("ledger writes in doubt: Postgres did not answer again in time");
    expect_error_lines("could not record discarded pool numbers");
}

/// Error lines written so far that no [`expect_error_lines`] covers.
fn unexpected_error_lines() -> Vec<String> {
    let expected = EXPECTED_ERRORS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clone();
    ERROR_LINES
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .filter(|line| !expected.iter().any(|text| line.contains(text)))
        .cloned()
        .collect()
}

/// Where a child process's output goes: the test's output with
/// `TEST_LOG=1`, else nowhere.
pub fn child_output() -> std::process::Stdio {
    if test_log() {
        std::process::Stdio::inherit()
    } else {
        std::process::Stdio::null()
    }
}

/// How often a wait looks again.
const POLL: Duration = Duration::from_millis(20);

/// The one way a test waits: asks `check` until it answers `Some`, and
/// fails the test, naming `what`, once `limit` has passed without it. A
/// fixed sleep is no synchronisation; the sleep in [`within`] only spaces
/// the questions.
pub async fn eventually<T>(
    limit: Duration,
    what: &str,
    check: impl AsyncFnMut() -> Option<T>,
) -> T {
    match within(limit, check).await {
        Some(done) => done,
        None => panic!("{what}: not within {limit:?}"),
    }
}

/// [`eventually`] for a condition that only holds or not.
pub async fn until(limit: Duration, what: &str, mut holds: impl AsyncFnMut() -> bool) {
    eventually(limit, what, async || holds().await.then_some(())).await
}

/// What `check` answers first within `limit`, or `None` once it has passed.
pub async fn within<T>(limit: Duration, check: impl AsyncFnMut() -> Option<T>) -> Option<T> {
    within_every(limit, POLL, check).await
}

/// [`eventually`], asking every `poll`: for a test that must act within
/// moments of a condition (a kill in the middle of a batch).
pub async fn eventually_every<T>(
    limit: Duration,
    poll: Duration,
    what: &str,
    check: impl AsyncFnMut() -> Option<T>,
) -> T {
    match within_every(limit, poll, check).await {
        Some(done) => done,
        None => panic!("{what}: not within {limit:?}"),
    }
}

async fn within_every<T>(
    limit: Duration,
    poll: Duration,
    mut check: impl AsyncFnMut() -> Option<T>,
) -> Option<T> {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(done) = check().await {
            return Some(done);
        }
        if Instant::now() >= deadline {
            return None;
        }
        tokio::time::sleep(poll).await; // spaces the questions; bounded by `limit`
    }
}

/// [`eventually`] for a test's own threads (no runtime to yield to).
pub fn eventually_blocking<T>(limit: Duration, what: &str, check: impl FnMut() -> Option<T>) -> T {
    match within_blocking(limit, check) {
        Some(done) => done,
        None => panic!("{what}: not within {limit:?}"),
    }
}

/// [`within`] for a test's own threads.
pub fn within_blocking<T>(limit: Duration, mut check: impl FnMut() -> Option<T>) -> Option<T> {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(done) = check() {
            return Some(done);
        }
        if Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(POLL); // spaces the questions; bounded by `limit`
    }
}

/// GET `url`: asserts 200 and returns the JSON body.
pub async fn get_ok(client: &reqwest::Client, url: &str) -> Value {
    let response = client.get(url).send().await.expect("request");
    let status = response.status();
    let body: Value = response.json().await.expect("JSON body");
    assert_eq!(status, StatusCode::OK, "GET {url}: {body}");
    body
}

/// POST `body` to `url`: asserts 200 and returns the JSON body.
pub async fn post_ok(client: &reqwest::Client, url: &str, body: &Value) -> Value {
    let response = client.post(url).json(body).send().await.expect("request");
    let status = response.status();
    let answer: Value = response.json().await.expect("JSON body");
    assert_eq!(status, StatusCode::OK, "POST {url}: {answer}");
    answer
}

pub fn base_database_url() -> String {
    std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/idpool".into())
}

pub fn base_redis_url() -> String {
    std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into())
}

/// Database and Redis namespace shared by the instances of one test.
#[derive(Clone)]
pub struct TestEnv {
    pub database_url: String,
    pub redis_url: String,
    pub prefix: String,
    pub refill_concurrency: usize,
    pub redis_timeout_ms: u64,
    pub sink: SinkConfig,
    pub processor: bool,
    pub outbox_poll_ms: u64,
    pub outbox_max_retries: i32,
    pub outbox_backoff_base_ms: u64,
    pub outbox_backoff_max_ms: u64,
    pub outbox_batch: i64,
    /// Reconciliation timing; tests run it on demand.
    pub settle: Duration,
    /// `IDPOOL_POOL_IDLE_S`: how long a pool goes unused before
    /// reconciliation gives it up.
    pub pool_idle: Duration,
    pub header_timeout_s: u64,
    pub write_timeout_s: u64,
    pub idle_timeout_s: u64,
    pub request_timeout_s: u64,
    pub max_connections: u64,
    pub max_sequences_per_project: u64,
    pub db_pool_size: u32,
    /// The webhook sink's signing key (Standard Webhooks form).
    pub webhook_secret: String,
    /// Authentication on (the default, as in production).
    pub auth: bool,
    /// Requests per second per key: high, so load tests are not throttled.
    pub rate_limit: u32,
    pub numbers_per_key: u32,
    pub redis_start_wait_ms: u64,
    /// `IDPOOL_LEASES` (on by default, as in production).
    pub leases: bool,
    /// `IDPOOL_RESERVATION_TTL_S`.
    pub reservation_ttl_s: u64,
    /// More environment for `ServeProcess` (after the settings above).
    pub extra_env: Vec<(String, String)>,
    /// `IDPOOL_PG_POOLER`, `IDPOOL_PG_LISTEN_URL`.
    pub pg_pooler: idpool::infra::db::Pooler,
    pub pg_listen_url: Option<String>,
    /// The test's own checks connect here when the app's URL leads
    /// through a pooler.
    pub direct_database_url: Option<String>,
    pub db_statement_timeout_ms: u64,
    /// How long a request waits for a pooled connection before its 503.
    pub db_acquire_timeout_ms: u64,
    /// `IDPOOL_ENDPOINTS_ALLOW_PRIVATE`: on, so endpoints on loopback
    /// serve as test targets (the tests of the guard turn it off).
    pub endpoints_allow_private: bool,
    /// `IDPOOL_WEBHOOK_TIMEOUT_MS`: time allowed per delivery.
    pub webhook_timeout_ms: u64,
    /// `IDPOOL_ENDPOINT_CONCURRENCY`, `IDPOOL_ENDPOINT_CIRCUIT_MAX_S`,
    /// `IDPOOL_ENDPOINT_DISABLE_AFTER_S`, `IDPOOL_MAX_ENDPOINTS_PER_PROJECT`.
    pub endpoint_concurrency: usize,
    pub endpoint_circuit_max_s: u64,
    pub endpoint_disable_after_s: u64,
    pub max_endpoints_per_project: i64,
    pub secret_overlap_s: u64,
    /// `IDPOOL_CHECKPOINT_INTERVAL_S`: short, so tests see checkpoints soon.
    pub checkpoint_interval_s: u64,
}

/// The signing key of test webhooks: `whsec_` and base64 of 32 bytes.
pub const TEST_WEBHOOK_SECRET: &str = "whsec_MDEyMzQ1Njc4OWFiY2RlZjAxMjM0NTY3ODlhYmNkZWY=";

impl TestEnv {
    pub fn new() -> Self {
        let tag = uuid::Uuid::new_v4().simple().to_string();
        let database_url =
            replace_database(&base_database_url(), &format!("idpool_test_{}", &tag[..16]));
        Self {
            database_url,
            redis_url: base_redis_url(),
            prefix: format!("t{}", &tag[..12]),
            refill_concurrency: 8,
            redis_timeout_ms: 1000,
            sink: SinkConfig::Postgres,
            processor: true,
            outbox_poll_ms: 2000,
            outbox_max_retries: 5,
            outbox_backoff_base_ms: 1000,
            outbox_backoff_max_ms: 3_600_000,
            outbox_batch: 500,
            settle: Duration::from_secs(2),
            pool_idle: Duration::from_secs(60),
            header_timeout_s: 10,
            write_timeout_s: 30,
            idle_timeout_s: 60,
            request_timeout_s: 30,
            max_connections: 10_000,
            max_sequences_per_project: 1000,
            db_pool_size: 12,
            webhook_secret: TEST_WEBHOOK_SECRET.to_owned(),
            auth: true,
            rate_limit: 1_000_000,
            numbers_per_key: 50_000,
            redis_start_wait_ms: 5000,
            leases: true,
            reservation_ttl_s: 300,
            checkpoint_interval_s: 1,
            extra_env: Vec::new(),
            pg_pooler: idpool::infra::db::Pooler::None,
            pg_listen_url: None,
            direct_database_url: None,
            db_statement_timeout_ms: 10_000,
            db_acquire_timeout_ms: 2_000,
            endpoints_allow_private: true,
            webhook_timeout_ms: 5_000,
            endpoint_concurrency: 8,
            endpoint_circuit_max_s: 300,
            endpoint_disable_after_s: 432_000,
            max_endpoints_per_project: 20,
            secret_overlap_s: 86_400,
        }
    }

    /// Environment variables that make a separate `idpool serve` process
    /// join this test's database and Redis namespace.
    pub fn process_env(&self, port: u16) -> Vec<(String, String)> {
        let sink = match &self.sink {
            SinkConfig::Postgres => "postgres".to_owned(),
            SinkConfig::Dir(dir) => format!("dir:{}", dir.display()),
            SinkConfig::Webhook(url) => format!("webhook:{url}"),
        };
        [
            ("DATABASE_URL", self.database_url.clone()),
            ("REDIS_URL", self.redis_url.clone()),
            ("IDPOOL_LISTEN", format!("127.0.0.1:{port}")),
            ("IDPOOL_REDIS_PREFIX", self.prefix.clone()),
            ("IDPOOL_SINK", sink),
            (
                "IDPOOL_OUTBOX_PROCESSOR",
                if self.processor { "on" } else { "off" }.to_owned(),
            ),
            ("IDPOOL_OUTBOX_POLL_MS", self.outbox_poll_ms.to_string()),
            (
                "IDPOOL_OUTBOX_MAX_RETRIES",
                self.outbox_max_retries.to_string(),
            ),
            (
                "IDPOOL_OUTBOX_BACKOFF_BASE_MS",
                self.outbox_backoff_base_ms.to_string(),
            ),
            (
                "IDPOOL_OUTBOX_BACKOFF_MAX_MS",
                self.outbox_backoff_max_ms.to_string(),
            ),
            ("IDPOOL_OUTBOX_BATCH", self.outbox_batch.to_string()),
            ("IDPOOL_DB_POOL_SIZE", self.db_pool_size.to_string()),
            ("IDPOOL_WEBHOOK_SECRET", self.webhook_secret.clone()),
            ("IDPOOL_HEADER_TIMEOUT_S", self.header_timeout_s.to_string()),
            ("IDPOOL_WRITE_TIMEOUT_S", self.write_timeout_s.to_string()),
            ("IDPOOL_IDLE_TIMEOUT_S", self.idle_timeout_s.to_string()),
            (
                "IDPOOL_AUTH",
                if self.auth { "on" } else { "off" }.to_owned(),
            ),
            ("IDPOOL_RATE_LIMIT", self.rate_limit.to_string()),
            ("IDPOOL_RECONCILE", "off".to_owned()),
            (
                "IDPOOL_RECONCILE_SETTLE_S",
                self.settle.as_secs().max(1).to_string(),
            ),
            (
                "IDPOOL_POOL_IDLE_S",
                self.pool_idle.as_secs().max(1).to_string(),
            ),
            (
                "IDPOOL_REQUEST_TIMEOUT_S",
                self.request_timeout_s.to_string(),
            ),
            (
                "IDPOOL_REDIS_START_WAIT_MS",
                self.redis_start_wait_ms.to_string(),
            ),
            (
                "IDPOOL_LEASES",
                if self.leases { "on" } else { "off" }.to_owned(),
            ),
            (
                "IDPOOL_RESERVATION_TTL_S",
                self.reservation_ttl_s.to_string(),
            ),
            (
                "IDPOOL_CHECKPOINT_INTERVAL_S",
                self.checkpoint_interval_s.to_string(),
            ),
            (
                "IDPOOL_ENDPOINTS_ALLOW_PRIVATE",
                self.endpoints_allow_private.to_string(),
            ),
            (
                "IDPOOL_WEBHOOK_TIMEOUT_MS",
                self.webhook_timeout_ms.to_string(),
            ),
            (
                "IDPOOL_ENDPOINT_CONCURRENCY",
                self.endpoint_concurrency.to_string(),
            ),
            (
                "IDPOOL_ENDPOINT_CIRCUIT_MAX_S",
                self.endpoint_circuit_max_s.to_string(),
            ),
            (
                "IDPOOL_ENDPOINT_DISABLE_AFTER_S",
                self.endpoint_disable_after_s.to_string(),
            ),
            (
                "IDPOOL_MAX_ENDPOINTS_PER_PROJECT",
                self.max_endpoints_per_project.to_string(),
            ),
            ("IDPOOL_SECRET_OVERLAP_S", self.secret_overlap_s.to_string()),
            ("RUST_LOG", "warn".to_owned()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .chain(self.extra_env.iter().cloned())
        .collect()
    }

    pub fn with_redis(mut self, url: &str) -> Self {
        self.redis_url = url.to_owned();
        self
    }

    pub fn config(&self) -> Config {
        Config {
            database_url: self.database_url.clone(),
            pg_pooler: self.pg_pooler,
            pg_listen_url: self.pg_listen_url.clone(),
            redis_url: self.redis_url.clone(),
            listen: "127.0.0.1:0".into(),
            migrate: Switch::On,
            redis_prefix: self.prefix.clone(),
            redis_clients: 2,
            redis_timeout_ms: self.redis_timeout_ms,
            db_pool_size: self.db_pool_size,
            refill_concurrency: self.refill_concurrency,
            pool_idle_s: self.pool_idle.as_secs().max(1),
            request_timeout_s: self.request_timeout_s,
            instance_id: Some(format!("test-{}", uuid::Uuid::new_v4().simple())),
            clock_offset_file: None,
            sink: self.sink.clone(),
            outbox_processor: if self.processor {
                Switch::On
            } else {
                Switch::Off
            },
            outbox_poll_ms: self.outbox_poll_ms,
            outbox_max_retries: self.outbox_max_retries,
            outbox_backoff_base_ms: self.outbox_backoff_base_ms,
            outbox_backoff_max_ms: self.outbox_backoff_max_ms,
            outbox_batch: self.outbox_batch,
            outbox_workers: 2,
            batch_concurrency: 4,
            webhook_timeout_ms: self.webhook_timeout_ms,
            webhook_concurrency: 16,
            max_endpoints_per_project: self.max_endpoints_per_project,
            endpoint_disable_after_s: self.endpoint_disable_after_s,
            endpoints_allow_private: self.endpoints_allow_private,
            secret_overlap_s: self.secret_overlap_s,
            endpoint_concurrency: self.endpoint_concurrency,
            endpoint_in_flight: 256,
            endpoint_circuit_max_s: self.endpoint_circuit_max_s,
            reconcile: Switch::Off,
            reconcile_interval_s: 60,
            reconcile_settle_s: 60,
            header_timeout_s: self.header_timeout_s,
            write_timeout_s: self.write_timeout_s,
            idle_timeout_s: self.idle_timeout_s,
            max_connections: self.max_connections,
            db_statement_timeout_ms: self.db_statement_timeout_ms,
            db_acquire_timeout_ms: self.db_acquire_timeout_ms,
            max_sequences_per_project: self.max_sequences_per_project,
            webhook_secret: Some(self.webhook_secret.clone()),
            auth: if self.auth { Switch::On } else { Switch::Off },
            rate_limit: self.rate_limit,
            max_in_flight_per_key: 256,
            list_rows_per_key: 10_000,
            numbers_per_key: self.numbers_per_key,
            redis_start_wait_ms: self.redis_start_wait_ms,
            leases: if self.leases { Switch::On } else { Switch::Off },
            reservation_ttl_s: self.reservation_ttl_s,
            register_key_file: None,
            register_key: None,
            register_origin: "idpool".into(),
            checkpoint_interval_s: self.checkpoint_interval_s,
        }
    }

    pub async fn spawn(&self) -> TestApp {
        self.spawn_with(Arc::new(SystemClock), PoolSettings::default())
            .await
    }

    pub async fn spawn_with_clock(&self, clock: Arc<ManualClock>) -> TestApp {
        self.spawn_with(clock, PoolSettings::default()).await
    }

    pub async fn spawn_with(&self, clock: Arc<dyn Clock>, pool: PoolSettings) -> TestApp {
        init_test_logging();
        let config = self.config();
        let reconcile = Some(ReconcileSettings {
            interval: Duration::from_secs(3600),
            settle: self.settle,
            lookback: Duration::from_secs(600),
        });
        let app = Application::build_with(
            &config,
            Overrides {
                clock,
                pool,
                reconcile,
                leases: None,
            },
        )
        .await
        .expect("application builds");
        let address = format!("http://127.0.0.1:{}", app.port());
        let stop = app.stop_token();
        let state = app.state().clone();
        let admin_key = create_key(&state, &[], true).await;
        tokio::spawn(async move {
            let _ = app.run_until_stopped().await;
        });
        let direct = self
            .direct_database_url
            .as_ref()
            .unwrap_or(&self.database_url);
        let db = PgPool::connect(direct).await.expect("test db");
        let test_app = TestApp {
            address,
            client: client_with_key(Some(&admin_key)),
            admin_key,
            db,
            env: self.clone(),
            stop,
            state,
        };
        test_app
            .wait_for_mode("pool", Duration::from_secs(10))
            .await;
        test_app
    }
}

/// Creates an API key the way `idpool keys create` does; its secret.
pub async fn create_key(
    state: &idpool::edge::http::AppState,
    projects: &[&str],
    admin: bool,
) -> String {
    create_key_with_id(state, projects, admin).await.1
}

/// The same; (id, secret).
pub async fn create_key_with_id(
    state: &idpool::edge::http::AppState,
    projects: &[&str],
    admin: bool,
) -> (String, String) {
    let created = state
        .auth
        .keys()
        .create(&idpool::records::auth::keys::NewKey {
            name: Some("test".into()),
            admin,
            projects: projects
                .iter()
                .map(|p| idpool::domain::sequence::ProjectCode::parse(p).expect("project code"))
                .collect(),
        })
        .await
        .expect("key created");
    (created.id, created.key)
}

/// A client that sends `key` as its bearer token on every request.
pub fn client_with_key(key: Option<&str>) -> reqwest::Client {
    let mut headers = reqwest::header::HeaderMap::new();
    if let Some(key) = key {
        let mut value =
            reqwest::header::HeaderValue::from_str(&format!("Bearer {key}")).expect("header");
        value.set_sensitive(true);
        headers.insert(reqwest::header::AUTHORIZATION, value);
    }
    reqwest::Client::builder()
        .pool_max_idle_per_host(256)
        .default_headers(headers)
        // The app speaks plain HTTP: loading the system's roots costs about
        // 45 ms of a runtime thread per client, which a test making dozens
        // of clients would take from the server it runs beside.
        .tls_certs_only(Vec::<reqwest::Certificate>::new())
        .build()
        .expect("client")
}

pub fn replace_database(url: &str, name: &str) -> String {
    let (head, tail) = match url.split_once('?') {
        Some((h, t)) => (h, Some(t)),
        None => (url, None),
    };
    let scheme_end = head.find("://").map(|i| i + 3).unwrap_or(0);
    let base = match head[scheme_end..].find('/') {
        Some(i) => &head[..scheme_end + i],
        None => head,
    };
    match tail {
        Some(t) => format!("{base}/{name}?{t}"),
        None => format!("{base}/{name}"),
    }
}

pub struct TestApp {
    pub address: String,
    /// Sends the admin key.
    pub client: reqwest::Client,
    pub admin_key: String,
    pub db: PgPool,
    pub env: TestEnv,
    stop: CancellationToken,
    /// The application's parts, for tests that call them directly.
    pub state: idpool::edge::http::AppState,
}

impl Drop for TestApp {
    fn drop(&mut self) {
        self.stop.cancel();
        // Every test ends here: a background task that panicked was
        // restarted and counted, and nothing else would tell.
        if !std::thread::panicking() {
            let panics = self.state.stats.task_panics.get();
            assert_eq!(panics, 0, "{panics} background tasks panicked");
            let unexpected = unexpected_error_lines();
            assert!(
                unexpected.is_empty(),
                "error lines the test did not expect: {unexpected:#?}"
            );
        }
    }
}

impl TestApp {
    pub fn url(&self, path: &str) -> String {
        format!("{}{}", self.address, path)
    }

    pub async fn post_ids(&self, project: &str, doc_type: &str, count: i64) -> reqwest::Response {
        self.client
            .post(self.url("/ids"))
            .json(&json!({"project": project, "type": doc_type, "count": count}))
            .send()
            .await
            .expect("request")
    }

    /// Issues IDs and returns (ids, seqs), failing the test on any error.
    pub async fn issue(
        &self,
        project: &str,
        doc_type: &str,
        count: i64,
    ) -> (Vec<String>, Vec<i64>) {
        let response = self.post_ids(project, doc_type, count).await;
        let status = response.status();
        let body: Value = response.json().await.expect("json");
        assert_eq!(status, StatusCode::OK, "POST /ids failed: {body}");
        let ids = body["ids"]
            .as_array()
            .expect("ids")
            .iter()
            .map(|v| v.as_str().expect("id").to_owned())
            .collect();
        (ids, seqs_of(&body))
    }

    pub async fn post_document(&self, body: &Value, key: Option<&str>) -> reqwest::Response {
        let mut request = self.client.post(self.url("/documents")).json(body);
        if let Some(key) = key {
            request = request.header("idempotency-key", key);
        }
        request.send().await.expect("request")
    }

    /// Accepts a document of `project`/`doc_type` (asserting the 202); its ID.
    pub async fn accept(&self, project: &str, doc_type: &str) -> String {
        let body = json!({"project": project, "type": doc_type, "metadata": {}});
        let response = self.post_document(&body, None).await;
        let status = response.status();
        let answer: Value = response.json().await.expect("json");
        assert_eq!(status, StatusCode::ACCEPTED, "POST /documents: {answer}");
        answer["id"].as_str().expect("id").to_owned()
    }

    pub async fn post_batch(&self, documents: Vec<Value>) -> reqwest::Response {
        self.client
            .post(self.url("/api/v1/documents/batch"))
            .json(&json!({"documents": documents}))
            .send()
            .await
            .expect("request")
    }

    /// The document's status, or panics if it does not exist.
    pub async fn document(&self, id: &str) -> Value {
        let (status, body) = self.get_json(&format!("/api/v1/documents/{id}")).await;
        assert_eq!(status, StatusCode::OK, "GET document {id}: {body}");
        body
    }

    /// Polls until the document has `status`; returns how long it took.
    pub async fn wait_for_status(&self, id: &str, status: &str, limit: Duration) -> Duration {
        let started = Instant::now();
        let what = format!("document {id} {status}");
        eventually(limit, &what, async || {
            (self.document(id).await["status"] == status).then(|| started.elapsed())
        })
        .await
    }

    pub async fn outbox_count(&self, status: Option<&str>) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM id_outbox WHERE ($1::text IS NULL OR status = $1)")
            .bind(status)
            .fetch_one(&self.db)
            .await
            .expect("outbox count")
    }

    /// Runs reconciliation now; its summary.
    pub async fn reconcile(&self) -> Value {
        let response = self
            .client
            .post(self.url("/api/v1/ids/gaps/reconcile"))
            .send()
            .await
            .expect("reconcile");
        let status = response.status();
        let body: Value = response.json().await.expect("summary");
        assert_eq!(status, StatusCode::OK, "reconcile: {body}");
        body
    }

    /// A run to note where the pools are, the settle time, and a run that
    /// judges everything that left them before the first.
    pub async fn settle_and_reconcile(&self) -> Value {
        self.reconcile().await;
        self.wait_out_the_settle_time().await;
        self.reconcile().await
    }

    /// Waits until Postgres' clock, which reconciliation reads, is past the
    /// settle time from now: a run then judges what the last one observed.
    pub async fn wait_out_the_settle_time(&self) {
        wait_on_postgres_clock(&self.db, self.env.settle).await
    }

    /// Every open gap of a sequence (all pages).
    pub async fn gaps(&self, project: &str, doc_type: &str) -> Vec<Value> {
        let mut gaps = Vec::new();
        let mut cursor: Option<String> = None;
        loop {
            let mut path = format!("/api/v1/ids/gaps?project={project}&type={doc_type}&limit=1000");
            if let Some(c) = &cursor {
                path.push_str(&format!("&cursor={c}"));
            }
            let (status, page) = self.get_json(&path).await;
            assert_eq!(status, StatusCode::OK, "gaps: {page}");
            gaps.extend(page["gaps"].as_array().unwrap().clone());
            match page["next_cursor"].as_str() {
                Some(c) => cursor = Some(c.to_owned()),
                None => return gaps,
            }
        }
    }

    pub async fn put_sequence(
        &self,
        project: &str,
        doc_type: &str,
        body: Value,
    ) -> reqwest::Response {
        self.client
            .put(self.url(&format!("/api/v1/sequences/{project}/{doc_type}")))
            .json(&body)
            .send()
            .await
            .expect("request")
    }

    /// Defines a new sequence, failing the test unless it is created.
    pub async fn define(&self, project: &str, doc_type: &str, body: Value) -> Value {
        let response = self.put_sequence(project, doc_type, body).await;
        let status = response.status();
        let view: Value = response.json().await.expect("sequence JSON");
        assert_eq!(
            status,
            StatusCode::CREATED,
            "PUT {project}/{doc_type}: {view}"
        );
        view
    }

    /// GET `path`: asserts 200 and returns the JSON body.
    pub async fn ok_json(&self, path: &str) -> Value {
        let (status, body) = self.get_json(path).await;
        assert_eq!(status, StatusCode::OK, "GET {path}: {body}");
        body
    }

    pub async fn get_json(&self, path: &str) -> (StatusCode, Value) {
        let response = self
            .client
            .get(self.url(path))
            .send()
            .await
            .expect("request");
        let status = response.status();
        (status, response.json().await.unwrap_or(Value::Null))
    }

    pub async fn mode(&self) -> Option<String> {
        let (_, body) = self.get_json("/readyz").await;
        body["mode"].as_str().map(str::to_owned)
    }

    /// Waits until `/readyz` reports `mode`; panics after `limit`.
    pub async fn wait_for_mode(&self, mode: &str, limit: Duration) -> Duration {
        let started = Instant::now();
        let what = format!("/readyz mode {mode}");
        eventually(limit, &what, async || {
            (self.mode().await.as_deref() == Some(mode)).then(|| started.elapsed())
        })
        .await
    }

    pub async fn metrics(&self) -> HashMap<String, f64> {
        metrics_at(&self.client, &self.address).await
    }

    /// Waits until the metric `series` exceeds `above`; returns its value.
    pub async fn wait_for_metric_above(&self, series: &str, above: f64, limit: Duration) -> f64 {
        let what = format!("{series} above {above}");
        eventually(limit, &what, async || {
            let value = self.metrics().await.get(series).copied();
            value.filter(|value| *value > above)
        })
        .await
    }

    pub fn redis_pool_key(&self, project: &str, doc_type: &str, period: &str) -> String {
        format!("{}:{{{project}:{doc_type}:{period}}}:pool", self.env.prefix)
    }

    /// Every Redis key of one sequence period's pool (list, meta, lock,
    /// pops in flight), sorted.
    pub async fn redis_keys_of(&self, project: &str, doc_type: &str, period: &str) -> Vec<String> {
        let pattern = format!("{}:{{{project}:{doc_type}:{period}}}:*", self.env.prefix);
        let client = self.state.pools.redis().client().clone();
        let mut keys: Vec<String> =
            fred::prelude::ClientLike::custom(&client, fred::cmd!("KEYS"), vec![pattern])
                .await
                .expect("KEYS");
        keys.sort();
        keys
    }
}

/// The numbers a pool's list elements hold: each is a run `first-last`
/// (or a bare number), lowest first.
pub fn pool_numbers<S: AsRef<str>>(elements: &[S]) -> Vec<i64> {
    elements
        .iter()
        .flat_map(|element| {
            let element = element.as_ref().trim();
            let (first, last) = element.split_once('-').unwrap_or((element, element));
            let (first, last): (i64, i64) = (
                first.parse().expect("a run's first number"),
                last.parse().expect("a run's last number"),
            );
            first..=last
        })
        .collect()
}

/// The numbers of a `POST /ids` answer.
pub fn seqs_of(body: &Value) -> Vec<i64> {
    body["seqs"]
        .as_array()
        .expect("seqs")
        .iter()
        .map(|v| v.as_i64().expect("seq"))
        .collect()
}

/// A problem+json answer: asserts the status, media type and code.
pub async fn assert_problem(response: reqwest::Response, status: StatusCode, code: &str) -> Value {
    assert_eq!(response.status(), status, "status");
    let content_type = response
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_owned();
    let body: Value = response.json().await.expect("problem body is JSON");
    assert_eq!(
        content_type, "application/problem+json",
        "content type of {body}"
    );
    assert_eq!(body["code"], code, "code in {body}");
    assert_eq!(body["status"], status.as_u16(), "status in {body}");
    assert!(
        body["type"].as_str().is_some_and(|t| t.ends_with(code)),
        "type in {body}"
    );
    assert!(
        body["title"].is_string() && body["detail"].is_string(),
        "title/detail in {body}"
    );
    body
}

/// Numbers the ledger holds for a sequence period, expanded.
/// Numbers recorded as handed to callers (the ledger's per-request rows
/// and what leases reported handing out), once the reports have settled.
pub async fn ledger_numbers(db: &PgPool, project: &str, doc_type: &str, period: &str) -> Vec<i64> {
    let read = || async {
        let rows: Vec<(i64, i64)> = sqlx::query_as(
            "SELECT lower(l.seqs), upper(l.seqs) FROM issuance_ledger l JOIN sequences s ON s.id = l.sequence_id \
             WHERE s.project = $1 AND s.doc_type = $2 AND l.period = $3 AND l.via <> 'lease' \
             UNION ALL \
             SELECT lower(h.seqs), upper(h.seqs) FROM lease_handouts h JOIN sequences s ON s.id = h.sequence_id \
             WHERE s.project = $1 AND s.doc_type = $2 AND h.period = $3 \
             ORDER BY 1",
        )
        .bind(project)
        .bind(doc_type)
        .bind(period)
        .fetch_all(db)
        .await
        .expect("ledger");
        rows.into_iter()
            .flat_map(|(s, e)| s..e)
            .collect::<Vec<i64>>()
    };
    // Leases report in the background within milliseconds: settled once
    // nothing changed for 100 ms.
    let mut last = (read().await, Instant::now());
    eventually(Duration::from_secs(10), "the ledger settles", async || {
        let now = read().await;
        if now != last.0 {
            last = (now, Instant::now());
            return None;
        }
        (last.1.elapsed() >= Duration::from_millis(100)).then(|| last.0.clone())
    })
    .await
}

/// Waits until the clock of the Postgres at `db` (which reconciliation and
/// Postgres' own timeouts read) is `settle` past now.
pub async fn wait_on_postgres_clock(db: &PgPool, settle: Duration) {
    let mark = postgres_now(db).await.expect("Postgres' clock");
    let past = mark
        + chrono::Duration::from_std(settle).expect("settle")
        + chrono::Duration::milliseconds(1);
    eventually(
        settle * 2 + Duration::from_secs(5),
        "Postgres' clock moves on",
        async || (postgres_now(db).await? > past).then_some(()),
    )
    .await
}

/// The time on the clock of the Postgres at `db`.
pub async fn postgres_now(db: &PgPool) -> Option<chrono::DateTime<chrono::Utc>> {
    sqlx::query_scalar("SELECT clock_timestamp()")
        .fetch_one(db)
        .await
        .ok()
}

pub fn assert_distinct(seqs: &[i64], what: &str) {
    let mut sorted = seqs.to_vec();
    sorted.sort_unstable();
    let before = sorted.len();
    sorted.dedup();
    assert_eq!(
        sorted.len(),
        before,
        "{what}: {} duplicates",
        before - sorted.len()
    );
}

/// An `idpool serve` process of the test's own, killed when dropped.
pub struct ServeProcess {
    pub child: std::process::Child,
    pub port: u16,
    /// Where its logs go: read for ERROR lines when the test ends.
    log: std::path::PathBuf,
    /// The directory of a log the test did not ask for.
    _log_dir: Option<tempfile::TempDir>,
}

impl ServeProcess {
    /// Starts the binary on `env` and waits until it answers /readyz.
    pub async fn start(env: &TestEnv) -> Self {
        let dir = tempfile::tempdir().expect("log directory");
        let log = dir.path().join("idpool.log");
        let file = std::fs::File::create(&log).expect("log file");
        let stdout = file.try_clone().expect("log file");
        let mut process = Self::launch_until(env, stdout.into(), (file, None, log), |status| {
            status == StatusCode::OK
        })
        .await;
        process._log_dir = Some(dir);
        process
    }

    /// The same, its logs (at `level`) written to `log`.
    pub async fn start_logging(env: &TestEnv, log: &std::path::Path, level: &str) -> Self {
        let file = std::fs::File::create(log).expect("log file");
        let stdout = file.try_clone().expect("log file");
        let log = (file, Some(level), log.to_owned());
        Self::launch_until(env, stdout.into(), log, |status| status == StatusCode::OK).await
    }

    /// Starts the binary on `env`, its logs (at `level`) written to `log`,
    /// and waits until /readyz answers at all (503 too).
    pub async fn start_unready(env: &TestEnv, log: &std::path::Path, level: &str) -> Self {
        let file = std::fs::File::create(log).expect("log file");
        let stdout = file.try_clone().expect("log file");
        Self::launch_until(
            env,
            stdout.into(),
            (file, Some(level), log.to_owned()),
            |_| true,
        )
        .await
    }

    /// Starts the binary on the defaults: only where Postgres and Redis
    /// are, its port, its Redis prefix and `settings` are set, every other
    /// setting as an operator who sets nothing gets it.
    pub async fn start_on_defaults(env: &TestEnv, settings: &[(&str, &str)]) -> Self {
        let dir = tempfile::tempdir().expect("log directory");
        let log = dir.path().join("idpool.log");
        let file = std::fs::File::create(&log).expect("log file");
        let stdout = file.try_clone().expect("log file");
        let settings: Vec<(String, String)> = settings
            .iter()
            .map(|(name, value)| ((*name).to_owned(), (*value).to_owned()))
            .collect();
        let mut process = Self::launch_with(
            |port| {
                let mut vars = vec![
                    ("DATABASE_URL".to_owned(), env.database_url.clone()),
                    ("REDIS_URL".to_owned(), env.redis_url.clone()),
                    ("IDPOOL_LISTEN".to_owned(), format!("127.0.0.1:{port}")),
                    ("IDPOOL_REDIS_PREFIX".to_owned(), env.prefix.clone()),
                ];
                vars.extend(settings.iter().cloned());
                vars
            },
            stdout.into(),
            (file, None, log),
            |status| status == StatusCode::OK,
        )
        .await;
        process._log_dir = Some(dir);
        process
    }

    /// Starts the binary, its output in `log`'s file (at `log`'s level, or
    /// the environment's), and waits until /readyz answers as `answered`
    /// wants.
    async fn launch_until(
        env: &TestEnv,
        stdout: std::process::Stdio,
        log: (std::fs::File, Option<&str>, std::path::PathBuf),
        answered: fn(StatusCode) -> bool,
    ) -> Self {
        Self::launch_with(|port| env.process_env(port), stdout, log, answered).await
    }

    /// [`Self::launch_until`] with the environment `vars` gives for a port,
    /// in place of the harness's whole one.
    async fn launch_with(
        vars: impl FnOnce(u16) -> Vec<(String, String)>,
        stdout: std::process::Stdio,
        log: (std::fs::File, Option<&str>, std::path::PathBuf),
        answered: fn(StatusCode) -> bool,
    ) -> Self {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_idpool"));
        // Only the settings given: none leaks in from the test's own.
        for (name, _) in std::env::vars() {
            if name.starts_with("IDPOOL_") {
                command.env_remove(name);
            }
        }
        command.arg("serve").envs(vars(port)).stdout(stdout);
        let (file, level, log) = log;
        command.stderr(file);
        if let Some(level) = level {
            command.env("RUST_LOG", level);
        }
        let child = command.spawn().expect("idpool binary starts");
        let process = Self {
            child,
            port,
            log,
            _log_dir: None,
        };
        let client = client_with_key(None);
        let readyz = format!("http://127.0.0.1:{port}/readyz");
        eventually(
            Duration::from_secs(30),
            "the idpool process answers /readyz",
            async || {
                let response = client.get(&readyz).send().await.ok()?;
                answered(response.status()).then_some(())
            },
        )
        .await;
        process
    }

    /// What it has logged so far.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// SIGTERM, and waits (up to 10 s) for a clean stop.
    pub fn stop(&mut self) {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.child.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        );
        let child = &mut self.child;
        let stopped = within_blocking(Duration::from_secs(10), || child.try_wait().ok().flatten());
        if stopped.is_none() {
            self.kill();
        }
    }

    /// SIGKILL: no shutdown, no cleanup.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for ServeProcess {
    /// Ends the process, and fails the test on an ERROR line of its log
    /// the test did not expect ([`expect_error_lines`]), as an in-process
    /// app's drop does.
    fn drop(&mut self) {
        self.kill();
        let written = std::fs::read_to_string(&self.log).unwrap_or_default();
        if test_log() {
            eprintln!("--- idpool serve on port {} ---\n{written}", self.port);
        }
        if std::thread::panicking() {
            return;
        }
        let expected = EXPECTED_ERRORS
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        let unexpected: Vec<&str> = written
            .lines()
            .filter(|line| line.contains(r#""level":"ERROR""#))
            .filter(|line| !expected.iter().any(|text| line.contains(text.as_str())))
            .collect();
        assert!(
            unexpected.is_empty(),
            "error lines of `idpool serve` (port {}) the test did not expect: {unexpected:#?}",
            self.port
        );
    }
}

/// The `/metrics` series of the instance at `base` (any instance, a
/// separate process too), by name with labels.
pub async fn metrics_at(client: &reqwest::Client, base: &str) -> HashMap<String, f64> {
    let text = client
        .get(format!("{base}/metrics"))
        .send()
        .await
        .expect("metrics")
        .text()
        .await
        .expect("text");
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .filter_map(|l| l.rsplit_once(' '))
        .filter_map(|(name, value)| Some((name.to_owned(), value.parse().ok()?)))
        .collect()
}

/// The second of a JSON log (`"timestamp":"2026-11-25T23:14:26.257996Z"`,
/// to the second) with the most warning or error lines: the second, how
/// many, and what they said (by message). None when there are none.
pub fn busiest_warning_second(
    text: &str,
) -> Option<(String, usize, std::collections::BTreeMap<String, usize>)> {
    let warnings = || {
        text.lines()
            .filter(|l| l.contains("WARN") || l.contains("ERROR"))
    };
    let second_of = |line: &str| {
        line.split_once(r#""timestamp":""#)
            .and_then(|(_, rest)| rest.get(..19))
            .unwrap_or("?")
            .to_owned()
    };
    let mut per_second: std::collections::BTreeMap<String, usize> = Default::default();
    for line in warnings() {
        *per_second.entry(second_of(line)).or_default() += 1;
    }
    let (second, count) = per_second.into_iter().max_by_key(|(_, n)| *n)?;
    let mut said: std::collections::BTreeMap<String, usize> = Default::default();
    for line in warnings().filter(|l| second_of(l) == second) {
        let message = line
            .split_once(r#""message":""#)
            .and_then(|(_, rest)| rest.split_once('"'))
            .map_or(line, |(m, _)| m);
        *said.entry(message.to_owned()).or_default() += 1;
    }
    Some((second, count, said))
}
