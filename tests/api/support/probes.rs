//! What isolation and hostile tests share: a second tenant measuring its
//! requests beside an attacker, raw HTTP exchanges, receivers and targets
//! of deliveries.

use crate::support::app::TestApp;
use crate::support::app::TestEnv;
use crate::support::app::client_with_key;
use crate::support::app::create_key;
use crate::support::app::eventually;
use crate::support::app::until;
use base64::Engine as _;
use reqwest::StatusCode;
use serde_json::Value;
use serde_json::json;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering;
use std::time::Duration;
use std::time::Instant;
use tokio::io::AsyncReadExt;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpSocket;
use tokio::net::TcpStream;

/// How much slower a well-behaved tenant's requests may be beside a hostile
/// one than alone, measured in the same test on the same machine: at the
/// 90th percentile, and at the slowest. A request queued behind the
/// attacker, a missing index or a lost fair share costs tens to thousands
/// of times a millisecond answer; the attacker's own use of the two cores
/// costs a few times.
pub const SLOWDOWN_P90: u32 = 20;
pub const SLOWDOWN_SLOWEST: u32 = 200;
/// Below this a latency says more about the scheduler than about us: a
/// loaded two-core machine leaves a ready process waiting for a few
/// milliseconds at a time.
pub const SCHEDULER_GRAIN: Duration = Duration::from_millis(5);
/// Rounds of a well-behaved tenant measured alone, before the attack.
const ALONE_ROUNDS: usize = 25;

/// The time of each of `runs` runs of `request` (a well-behaved tenant's),
/// one at a time.
pub async fn timed(runs: usize, mut request: impl AsyncFnMut(usize)) -> Vec<Duration> {
    let mut latencies = Vec::with_capacity(runs);
    for n in 0..runs {
        let started = Instant::now();
        request(n).await;
        latencies.push(started.elapsed());
    }
    latencies
}

/// Asserts one answer `took` beside an attack within the slowest answer
/// [`assert_slowdown_within`] allows of the same requests `alone`.
pub fn assert_answer_within(during: &str, who: &str, alone: &[Duration], took: Duration) {
    assert!(!alone.is_empty(), "{during}: {who} was not measured alone");
    let base = percentile(alone, 90).max(SCHEDULER_GRAIN);
    assert!(
        took <= base * SLOWDOWN_SLOWEST,
        "{during}: {who} took {took:?} beside it; alone: 90th percentile {:?} of {} \
         answers: over {SLOWDOWN_SLOWEST}× of {base:?}",
        percentile(alone, 90),
        alone.len()
    );
}

/// The `pct`th percentile of `latencies`.
pub fn percentile(latencies: &[Duration], pct: usize) -> Duration {
    let mut sorted = latencies.to_vec();
    sorted.sort_unstable();
    sorted
        .get((sorted.len() * pct / 100).min(sorted.len().saturating_sub(1)))
        .copied()
        .unwrap_or_default()
}

/// Asserts `beside` (latencies next to the attack) within the slowdowns
/// above of `alone` (the same requests before it).
pub fn assert_slowdown_within(during: &str, who: &str, alone: &[Duration], beside: &[Duration]) {
    assert_slowdown_within_and(during, who, alone, beside, Duration::ZERO);
}

/// [`assert_slowdown_within`], with `designed` more allowed: a wait the
/// service is built to make (a lock wait it gives up after), which the
/// victim shares by design.
pub fn assert_slowdown_within_and(
    during: &str,
    who: &str,
    alone: &[Duration],
    beside: &[Duration],
    designed: Duration,
) {
    assert!(
        !alone.is_empty() && !beside.is_empty(),
        "{during}: {who} was not measured"
    );
    let base = percentile(alone, 90).max(SCHEDULER_GRAIN);
    let (p90, slowest) = (percentile(beside, 90), percentile(beside, 100));
    let said = format!(
        "{during}: {who} beside it: 90th percentile {p90:?}, slowest {slowest:?}; \
         alone: 90th percentile {:?} ({} answers beside, {} alone)",
        percentile(alone, 90),
        beside.len(),
        alone.len()
    );
    assert!(
        p90 <= base * SLOWDOWN_P90 + designed,
        "{said}: over {SLOWDOWN_P90}× of {base:?} and {designed:?}"
    );
    assert!(
        slowest <= base * SLOWDOWN_SLOWEST + designed,
        "{said}: over {SLOWDOWN_SLOWEST}× of {base:?} and {designed:?}"
    );
}

/// Well-behaved traffic beside a hostile request: `GET /healthz` and
/// `POST /ids` in a loop, every answer timed.
pub struct Probe {
    pub running: Arc<AtomicBool>,
    pub task: tokio::task::JoinHandle<ProbeReport>,
    /// What it measured alone, before the test's attack.
    alone: ProbeReport,
}

#[derive(Debug, Default)]
pub struct ProbeReport {
    pub answers: usize,
    pub failures: Vec<String>,
    /// Each round's time (a `GET /healthz` and a `POST /ids`), halved.
    pub latencies: Vec<Duration>,
}

impl ProbeReport {
    /// One round of the probe.
    async fn round(&mut self, client: &reqwest::Client, address: &str) {
        let started = Instant::now();
        let health = client.get(format!("{address}/healthz")).send().await;
        let ids = client
            .post(format!("{address}/ids"))
            .json(&json!({"project": "PROBE", "type": "ok", "count": 1}))
            .send()
            .await;
        self.latencies.push(started.elapsed() / 2);
        for (what, answer) in [("healthz", health), ("POST /ids", ids)] {
            match answer {
                Ok(r) if r.status().is_success() => self.answers += 1,
                Ok(r) => self.failures.push(format!("{what}: {}", r.status())),
                Err(e) => self.failures.push(format!("{what}: {e}")),
            }
        }
    }
}

impl Probe {
    /// Measures the probe alone, then keeps it running beside whatever the
    /// test does next.
    pub async fn start(app: &TestApp) -> Self {
        let (client, address) = (app.client.clone(), app.address.clone());
        let mut alone = ProbeReport::default();
        for _ in 0..ALONE_ROUNDS {
            alone.round(&client, &address).await;
            tokio::time::sleep(Duration::from_millis(20)).await; // the probe's own pace
        }
        let running = Arc::new(AtomicBool::new(true));
        let flag = running.clone();
        let task = tokio::spawn(async move {
            let mut report = ProbeReport::default();
            while flag.load(Ordering::Relaxed) {
                report.round(&client, &address).await;
                tokio::time::sleep(Duration::from_millis(20)).await; // the probe's own pace: a steady trickle of requests
            }
            report
        });
        Self {
            running,
            task,
            alone,
        }
    }

    /// Stops the probe and asserts it was served throughout, no slower
    /// beside the attack than [`assert_slowdown_within`] allows of it alone.
    pub async fn assert_unharmed(self, during: &str) {
        let alone = self.alone;
        self.running.store(false, Ordering::Relaxed);
        let report = self.task.await.expect("probe");
        assert!(
            alone.failures.is_empty(),
            "{during}: alone: {:?}",
            alone.failures
        );
        assert!(
            report.failures.is_empty(),
            "{during}: well-behaved requests failed: {:?}",
            report.failures
        );
        assert!(report.answers >= 2, "{during}: the probe got no answers");
        assert_slowdown_within(during, "the probe", &alone.latencies, &report.latencies);
    }
}

pub async fn count(app: &TestApp, table: &'static str) -> i64 {
    let sql = match table {
        "id_outbox" => "SELECT count(*) FROM id_outbox",
        "issuance_ledger" => "SELECT count(*) FROM issuance_ledger",
        _ => "SELECT count(*) FROM sequences WHERE project <> 'PROBE'",
    };
    sqlx::query_scalar(sql).fetch_one(&app.db).await.unwrap()
}

/// Nothing but the probe's own numbers was written.
pub async fn nothing_written(app: &TestApp, sequences: i64) {
    assert_eq!(
        count(app, "id_outbox").await,
        0,
        "an outbox row was written"
    );
    assert_eq!(
        count(app, "sequences").await,
        sequences,
        "sequences changed"
    );
    let foreign: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM issuance_ledger l JOIN sequences s ON s.id = l.sequence_id \
         WHERE s.project <> 'PROBE'",
    )
    .fetch_one(&app.db)
    .await
    .unwrap();
    assert_eq!(foreign, 0, "numbers were issued");
}

/// Sends raw bytes and returns what the server answered (until it closes
/// or goes quiet for `wait`).
pub async fn raw_exchange(app: &TestApp, request: &[u8], wait: Duration) -> String {
    let address = app.address.trim_start_matches("http://");
    let mut stream = TcpStream::connect(address).await.unwrap();
    stream.write_all(request).await.unwrap();
    let mut answer = Vec::new();
    let mut buffer = [0u8; 4096];
    loop {
        match tokio::time::timeout(wait, stream.read(&mut buffer)).await {
            Ok(Ok(0)) | Ok(Err(_)) | Err(_) => break,
            Ok(Ok(n)) => answer.extend_from_slice(&buffer[..n]),
        }
    }
    String::from_utf8_lossy(&answer).into_owned()
}

/// Sends `request` on `stream`; its answer's first bytes, or `None` when
/// none came within `wait` (or the connection was closed).
pub async fn answer_on(stream: &mut TcpStream, request: &[u8], wait: Duration) -> Option<String> {
    stream.write_all(request).await.ok()?;
    let mut buffer = [0u8; 1024];
    match tokio::time::timeout(wait, stream.read(&mut buffer)).await {
        Ok(Ok(n)) if n > 0 => Some(String::from_utf8_lossy(&buffer[..n]).into_owned()),
        _ => None,
    }
}

/// Whether the server closed `stream` (a read sees the end at once).
pub async fn closed(stream: &mut TcpStream) -> bool {
    let mut buffer = [0u8; 64];
    matches!(
        tokio::time::timeout(Duration::from_millis(300), stream.read(&mut buffer)).await,
        Ok(Ok(0) | Err(_))
    )
}

/// A connection whose `POST /documents` under `key` has begun (the server
/// asked for the body) and whose body is still coming.
pub async fn slow_body(app: &TestApp, key: &str) -> TcpStream {
    let address = app.address.trim_start_matches("http://").to_owned();
    let head = format!(
        "POST /documents HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n\
         Content-Type: application/json\r\nContent-Length: 60\r\nExpect: 100-continue\r\n\r\n"
    );
    let mut stream = TcpStream::connect(&address).await.unwrap();
    // The interim answer says the handler is reading the body: the
    // connection is serving, not waiting for its head.
    let interim = answer_on(&mut stream, head.as_bytes(), Duration::from_secs(2)).await;
    assert!(
        interim.is_some_and(|a| a.starts_with("HTTP/1.1 100")),
        "no 100 Continue"
    );
    stream.write_all(b"{\"project\"").await.unwrap();
    stream
}

/// A webhook receiver with three doors: one that takes deliveries, one that
/// redirects to it, one that answers 500 with an endless-looking body.
pub async fn receiver() -> (
    String,
    Arc<std::sync::Mutex<Vec<(axum::http::HeaderMap, bytes::Bytes)>>>,
) {
    use axum::routing::post;
    let received: Arc<std::sync::Mutex<Vec<_>>> = Arc::default();
    let log = received.clone();
    let app = axum::Router::new()
        .route(
            "/hook",
            post(move |headers: axum::http::HeaderMap, body: bytes::Bytes| {
                let log = log.clone();
                async move {
                    log.lock().unwrap().push((headers, body));
                    StatusCode::OK
                }
            }),
        )
        .route(
            "/moved",
            post(|| async { (StatusCode::TEMPORARY_REDIRECT, [("location", "/hook")]) }),
        )
        .route(
            "/huge",
            post(|| async { (StatusCode::INTERNAL_SERVER_ERROR, "x".repeat(8 << 20)) }),
        );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap().to_string();
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    (address, received)
}

/// The final state of one document delivered through the webhook at `door`.
pub async fn deliver_through(address: &str, door: &str) -> (String, Value) {
    let mut env = TestEnv::new();
    env.sink = idpool::features::documents::sink::SinkConfig::Webhook(format!(
        "http://user:pw@{address}/{door}?token=s3cret"
    ));
    env.outbox_max_retries = 1;
    env.outbox_poll_ms = 50;
    let app = env.spawn().await;
    let id = app.accept("WH", "1").await;
    let document = eventually(Duration::from_secs(15), "the delivery ends", async || {
        let document = app.document(&id).await;
        (document["status"] != "pending").then_some(document)
    })
    .await;
    (id, document)
}

/// A second tenant going about its business: `POST /ids`, a document, and
/// reading it back, in a loop, every answer timed; measured alone first.
pub struct Neighbour {
    pub running: Arc<AtomicBool>,
    pub rounds: Arc<AtomicU64>,
    pub task: tokio::task::JoinHandle<Report>,
    /// What it measured alone, before the test's attack.
    alone: Report,
}

#[derive(Debug, Default)]
pub struct Report {
    pub rounds: usize,
    pub failures: Vec<String>,
    /// Every answer's time.
    pub latencies: Vec<Duration>,
    pub slowest: Duration,
    pub slowest_what: &'static str,
}

impl Report {
    fn timed(&mut self, what: &'static str, took: Duration) {
        self.latencies.push(took);
        if took > self.slowest {
            self.slowest = took;
            self.slowest_what = what;
        }
    }

    /// One round of the second tenant's business.
    async fn round(&mut self, client: &reqwest::Client, address: &str, project: &str) {
        let started = Instant::now();
        let ids = client
            .post(format!("{address}/ids"))
            .json(&json!({"project": project, "type": "1", "count": 1}))
            .send()
            .await;
        self.timed("POST /ids", started.elapsed());
        match ids {
            Ok(r) if r.status() == StatusCode::OK => {}
            Ok(r) => self.failures.push(format!("POST /ids: {}", r.status())),
            Err(e) => self.failures.push(format!("POST /ids: {e}")),
        }
        let started = Instant::now();
        let document = client
            .post(format!("{address}/documents"))
            .json(&json!({"project": project, "type": "1", "metadata": {"n": self.rounds}}))
            .send()
            .await;
        self.timed("POST /documents", started.elapsed());
        let id = match document {
            Ok(r) if r.status() == StatusCode::ACCEPTED => r
                .json::<Value>()
                .await
                .ok()
                .and_then(|b| b["id"].as_str().map(str::to_owned)),
            Ok(r) => {
                self.failures
                    .push(format!("POST /documents: {}", r.status()));
                None
            }
            Err(e) => {
                self.failures.push(format!("POST /documents: {e}"));
                None
            }
        };
        if let Some(id) = id {
            let started = Instant::now();
            let read = client
                .get(format!("{address}/api/v1/documents/{id}"))
                .send()
                .await;
            self.timed("GET /api/v1/documents/{id}", started.elapsed());
            match read {
                Ok(r) if r.status() == StatusCode::OK => {}
                Ok(r) => self.failures.push(format!("GET document: {}", r.status())),
                Err(e) => self.failures.push(format!("GET document: {e}")),
            }
        }
        self.rounds += 1;
    }
}

impl Neighbour {
    /// Its answers' times alone, before the attack: the yardstick for
    /// another request of a well-behaved tenant beside it.
    pub fn alone(&self) -> &[Duration] {
        &self.alone.latencies
    }

    /// Measures the loop alone, with a key of `project` alone, then keeps
    /// it running beside whatever the test does next.
    pub async fn start(app: &TestApp, project: &'static str) -> Self {
        let key = create_key(&app.state, &[project], false).await;
        let client = client_with_key(Some(&key));
        let address = app.address.clone();
        let mut alone = Report::default();
        for _ in 0..ALONE_ROUNDS {
            alone.round(&client, &address, project).await;
            tokio::time::sleep(Duration::from_millis(10)).await; // a tenant's pace
        }
        let running = Arc::new(AtomicBool::new(true));
        let flag = running.clone();
        let rounds = Arc::new(AtomicU64::new(0));
        let counted = rounds.clone();
        let task = tokio::spawn(async move {
            let mut report = Report::default();
            while flag.load(Ordering::Relaxed) {
                report.round(&client, &address, project).await;
                counted.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(10)).await; // a tenant's pace, not a flood
            }
            report
        });
        Self {
            running,
            rounds,
            task,
            alone,
        }
    }

    /// Stops the loop and asserts the tenant was served throughout, no
    /// slower beside the attack than [`assert_slowdown_within`] allows of
    /// it alone.
    pub async fn assert_unharmed(self, during: &str) {
        // Enough rounds to tell, however quickly the neighbour's worst was
        // over.
        let rounds = self.rounds.clone();
        until(
            Duration::from_secs(20),
            "three rounds of the second tenant",
            async || rounds.load(Ordering::Relaxed) >= 3,
        )
        .await;
        self.running.store(false, Ordering::Relaxed);
        let report = self.task.await.expect("neighbour loop");
        assert!(
            self.alone.failures.is_empty(),
            "{during}: the second tenant alone: {:?}",
            self.alone.failures
        );
        assert!(
            report.failures.is_empty(),
            "{during}: the second tenant's requests failed: {:?}",
            report.failures
        );
        assert!(
            report.rounds >= 3,
            "{during}: the second tenant got few answers: {} rounds",
            report.rounds
        );
        let who = format!("the second tenant (slowest: {})", report.slowest_what);
        assert_slowdown_within(during, &who, &self.alone.latencies, &report.latencies);
    }
}

pub fn host_of(app: &TestApp) -> String {
    app.address.trim_start_matches("http://").to_owned()
}

/// A well-formed key nobody created.
pub fn made_up_key() -> String {
    let id: String = uuid::Uuid::new_v4().simple().to_string()[..12].to_owned();
    let bytes: Vec<u8> = (0..2)
        .flat_map(|_| *uuid::Uuid::new_v4().as_bytes())
        .collect();
    let secret = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes);
    format!("idp_{id}_{}", &secret[..43])
}

/// `idpool keys create` against the test's database, as an operator runs
/// it; the key's secret.
pub fn create_key_with_cli(app: &TestApp, project: &str) -> String {
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_idpool"))
        .args(["keys", "create", "--project", project])
        .env("DATABASE_URL", &app.env.database_url)
        .output()
        .expect("idpool keys create");
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let created: Value = serde_json::from_slice(&output.stdout).expect("one JSON object");
    created["key"].as_str().expect("key").to_owned()
}

/// A socket with a small receive buffer that asks for the largest asset
/// many times over and never reads.
pub async fn never_reading_client(host: &str) -> TcpStream {
    let socket = TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let mut stream = socket.connect(host.parse().unwrap()).await.unwrap();
    let request = b"GET /docs/swagger-ui-bundle.js HTTP/1.1\r\nhost: x\r\n\r\n";
    for _ in 0..32 {
        stream.write_all(request).await.unwrap();
    }
    stream
}

/// A target that answers every delivery 500 with `body`.
pub async fn refusing_target(body: &'static [u8], gzip: bool) -> String {
    use axum::routing::post;
    let app = axum::Router::new().route(
        "/hook",
        post(move || async move {
            let mut response = axum::response::Response::new(axum::body::Body::from(body));
            *response.status_mut() = StatusCode::INTERNAL_SERVER_ERROR;
            if gzip {
                response.headers_mut().insert(
                    "content-encoding",
                    axum::http::HeaderValue::from_static("gzip"),
                );
            }
            response
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/hook", listener.local_addr().unwrap());
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    url
}

/// Rows of type F of a tenant, written straight into the outbox (delivered
/// long ago).
pub async fn fill_outbox(app: &TestApp, project: &str, rows: i64) {
    sqlx::query(
        "INSERT INTO id_outbox (document_id, tenant_code, entity_type_id, payload, status, \
                                sequence_id, period, seq, seq_number, processed_at) \
         SELECT $1 || '-F-' || g, $1, 'F', '{\"filler\": true}', 'committed', -1, '', g, g, now() \
         FROM generate_series(1, $2) g",
    )
    .bind(project)
    .bind(rows)
    .execute(&app.db)
    .await
    .expect("filler rows");
    sqlx::query("ANALYZE id_outbox")
        .execute(&app.db)
        .await
        .unwrap();
}

/// What tenant B saw: the latencies of its `POST /ids` and
/// `POST /documents`, those of `GET /healthz` on the same instance between
/// them (what any request of that process waits for a core), and every
/// answer that was not a 2xx.
#[derive(Default)]
pub struct TenantB {
    pub issuing: Vec<Duration>,
    pub healthz: Vec<Duration>,
    pub failures: Vec<String>,
}

/// Tenant B's requests, one at a time (`POST /ids`, `GET /healthz`,
/// `POST /documents`, `GET /healthz`, ...; the first two with an
/// Idempotency-Key, so each holds a connection of its own), at least
/// `at_least` issuing ones and, given `running`, until it ends.
pub async fn tenant_b_one_at_a_time(
    client: &reqwest::Client,
    base: &str,
    at_least: usize,
    running: Option<&AtomicBool>,
) -> TenantB {
    let mut seen = TenantB::default();
    let mut n = 0u64;
    while seen.issuing.len() < at_least || running.is_some_and(|r| r.load(Ordering::Relaxed)) {
        n += 1;
        let key = format!("b-{}-{n}", uuid::Uuid::new_v4().simple());
        let request = match n % 4 {
            0 => client
                .post(format!("{base}/ids"))
                .header("idempotency-key", key)
                .json(&json!({"project": "TENB", "type": "1", "count": 1})),
            2 => client
                .post(format!("{base}/documents"))
                .header("idempotency-key", key)
                .json(&json!({"project": "TENB", "type": "2", "metadata": {"n": n}})),
            _ => client.get(format!("{base}/healthz")),
        };
        let started = Instant::now();
        let response = request.send().await.expect("B's instance answers");
        let status = response.status();
        let body = response.text().await.unwrap_or_default();
        let took = started.elapsed();
        match n % 2 {
            0 => seen.issuing.push(took),
            _ => seen.healthz.push(took),
        }
        if !status.is_success() {
            seen.failures.push(format!("{status} {body}"));
        }
    }
    seen
}

/// The floor under an answer that waits for a transaction like a keyed
/// request's (a claim, a number, a row, the stored answer, a commit):
/// five bare single-row INSERTs and a commit on one connection, one
/// transaction at a time, at least `at_least` times and, given `running`,
/// until it ends. Its latencies.
pub async fn bare_commits(
    db: &sqlx::PgPool,
    at_least: usize,
    running: Option<&AtomicBool>,
) -> Vec<Duration> {
    let mut conn = db.acquire().await.expect("a connection");
    let mut latencies = Vec::new();
    while latencies.len() < at_least || running.is_some_and(|r| r.load(Ordering::Relaxed)) {
        let started = Instant::now();
        let mut tx = sqlx::Connection::begin(&mut *conn).await.expect("BEGIN");
        for _ in 0..5 {
            sqlx::query("INSERT INTO bare_commits (at) VALUES (now())")
                .execute(&mut *tx)
                .await
                .expect("an INSERT");
        }
        tx.commit().await.expect("COMMIT");
        latencies.push(started.elapsed());
    }
    latencies
}

pub fn p99(latencies: &mut [Duration]) -> Duration {
    latencies.sort_unstable();
    latencies[(latencies.len() * 99 / 100).min(latencies.len() - 1)]
}

/// The slowdown bound fails what a queue behind an attacker looks like (a
/// fifth of the answers waiting 200 ms where they took 1 ms), and passes
/// the few-fold slowdown of sharing the cores.
#[test]
fn a_slowdown_fails_a_queue_and_passes_shared_cores() {
    let ms = Duration::from_millis;
    let alone = vec![ms(1); 25];
    let shared: Vec<Duration> = (0..50).map(|i| ms(1 + i % 4)).collect();
    assert_slowdown_within("shared cores", "a tenant", &alone, &shared);
    let queued: Vec<Duration> = (0..50)
        .map(|i| if i % 5 == 0 { ms(200) } else { ms(2) })
        .collect();
    let caught =
        std::panic::catch_unwind(|| assert_slowdown_within("a queue", "a tenant", &alone, &queued));
    assert!(caught.is_err(), "a fifth of the answers 200× slower passed");
    let stalled: Vec<Duration> = (0..50)
        .map(|i| if i == 7 { ms(2_000) } else { ms(2) })
        .collect();
    let caught = std::panic::catch_unwind(|| {
        assert_slowdown_within("a stall", "a tenant", &alone, &stalled)
    });
    assert!(caught.is_err(), "one answer stalled for 2 s passed");
}
