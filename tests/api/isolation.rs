//! Isolation by construction: each shared resource of an instance (see
//! ARCHITECTURE.md, "Shared resources") is pushed to its limit by a
//! stranger or a hostile tenant while a second tenant's requests are timed:
//! they stay within their usual bound, and nothing acknowledged is lost.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use base64::Engine as _;
use reqwest::StatusCode;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};

use crate::support::app::{TestApp, TestEnv, assert_problem, client_with_key, create_key, until};

/// Slowest answer a well-behaved request may get while a neighbour does
/// its worst (they take milliseconds; a starved one takes seconds).
const USUAL: Duration = Duration::from_millis(1500);

/// A second tenant going about its business: `POST /ids`, a document, and
/// reading it back, in a loop, every answer timed.
struct Neighbour {
    running: Arc<AtomicBool>,
    rounds: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<Report>,
}

#[derive(Debug, Default)]
struct Report {
    rounds: usize,
    failures: Vec<String>,
    slowest: Duration,
    slowest_what: &'static str,
}

impl Neighbour {
    /// Starts the loop with a key of `project` alone.
    async fn start(app: &TestApp, project: &'static str) -> Self {
        let key = create_key(&app.state, &[project], false).await;
        let client = client_with_key(Some(&key));
        let address = app.address.clone();
        let running = Arc::new(AtomicBool::new(true));
        let flag = running.clone();
        let rounds = Arc::new(AtomicU64::new(0));
        let counted = rounds.clone();
        let task = tokio::spawn(async move {
            let mut report = Report::default();
            let timed = |what: &'static str, took: Duration, report: &mut Report| {
                if took > report.slowest {
                    report.slowest = took;
                    report.slowest_what = what;
                }
            };
            while flag.load(Ordering::Relaxed) {
                let started = Instant::now();
                let ids = client
                    .post(format!("{address}/ids"))
                    .json(&json!({"project": project, "type": "1", "count": 1}))
                    .send()
                    .await;
                timed("POST /ids", started.elapsed(), &mut report);
                match ids {
                    Ok(r) if r.status() == StatusCode::OK => {}
                    Ok(r) => report.failures.push(format!("POST /ids: {}", r.status())),
                    Err(e) => report.failures.push(format!("POST /ids: {e}")),
                }
                let started = Instant::now();
                let document = client
                    .post(format!("{address}/documents"))
                    .json(
                        &json!({"project": project, "type": "1", "metadata": {"n": report.rounds}}),
                    )
                    .send()
                    .await;
                timed("POST /documents", started.elapsed(), &mut report);
                let id = match document {
                    Ok(r) if r.status() == StatusCode::ACCEPTED => r
                        .json::<Value>()
                        .await
                        .ok()
                        .and_then(|b| b["id"].as_str().map(str::to_owned)),
                    Ok(r) => {
                        report
                            .failures
                            .push(format!("POST /documents: {}", r.status()));
                        None
                    }
                    Err(e) => {
                        report.failures.push(format!("POST /documents: {e}"));
                        None
                    }
                };
                if let Some(id) = id {
                    let started = Instant::now();
                    let read = client
                        .get(format!("{address}/api/v1/documents/{id}"))
                        .send()
                        .await;
                    timed("GET /api/v1/documents/{id}", started.elapsed(), &mut report);
                    match read {
                        Ok(r) if r.status() == StatusCode::OK => {}
                        Ok(r) => report
                            .failures
                            .push(format!("GET document: {}", r.status())),
                        Err(e) => report.failures.push(format!("GET document: {e}")),
                    }
                }
                report.rounds += 1;
                counted.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(10)).await; // a tenant's pace, not a flood
            }
            report
        });
        Self {
            running,
            rounds,
            task,
        }
    }

    /// Stops the loop and asserts the tenant was served throughout, each
    /// answer within `bound`.
    async fn assert_unharmed(self, during: &str, bound: Duration) {
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
            report.failures.is_empty(),
            "{during}: the second tenant's requests failed: {:?}",
            report.failures
        );
        assert!(
            report.rounds >= 3,
            "{during}: the second tenant got few answers: {report:?}"
        );
        assert!(
            report.slowest < bound,
            "{during}: the second tenant's {} took {:?}",
            report.slowest_what,
            report.slowest
        );
    }
}

fn host_of(app: &TestApp) -> String {
    app.address.trim_start_matches("http://").to_owned()
}

/// A well-formed key nobody created.
fn made_up_key() -> String {
    let id: String = uuid::Uuid::new_v4().simple().to_string()[..12].to_owned();
    let bytes: Vec<u8> = (0..2)
        .flat_map(|_| *uuid::Uuid::new_v4().as_bytes())
        .collect();
    let secret = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes);
    format!("idp_{id}_{}", &secret[..43])
}

/// `idpool keys create` against the test's database, as an operator runs
/// it; the key's secret.
fn create_key_with_cli(app: &TestApp, project: &str) -> String {
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn made_up_and_revoked_keys_never_make_a_valid_key_wait_or_fail() {
    let app = TestEnv::new().spawn().await;
    let neighbour = Neighbour::start(&app, "KEYS").await;
    let revoked = create_key(&app.state, &["KEYS"], false).await;
    let revoked_id = revoked.split('_').nth(1).unwrap().to_owned();
    app.state.auth.keys().revoke(&revoked_id).await.unwrap();

    // A stranger's flood: thousands of made-up keys and a revoked one.
    let flooding = Arc::new(AtomicBool::new(true));
    let refused = Arc::new(AtomicU64::new(0));
    let mut flood = Vec::new();
    for n in 0..32 {
        let (flooding, refused, address) = (flooding.clone(), refused.clone(), app.address.clone());
        let revoked = revoked.clone();
        flood.push(tokio::spawn(async move {
            let client = crate::support::app::client_with_key(None);
            let mut other = Vec::new();
            while flooding.load(Ordering::Relaxed) {
                let key = if n == 0 {
                    revoked.clone()
                } else {
                    made_up_key()
                };
                match client
                    .get(format!("{address}/api/v1/sequences"))
                    .bearer_auth(key)
                    .send()
                    .await
                {
                    Ok(r) if r.status() == StatusCode::UNAUTHORIZED => {
                        refused.fetch_add(1, Ordering::Relaxed);
                    }
                    Ok(r) => other.push(r.status()),
                    Err(e) => panic!("the flood's request failed: {e}"),
                }
            }
            other
        }));
    }
    // Meanwhile keys are created: by the CLI (another process, as an
    // operator does), and behind every instance's back (no notification:
    // found by the first request that brings it). Each works at once.
    for project in ["NEW1", "NEW2", "NEW3"] {
        let key = create_key_with_cli(&app, project);
        let started = Instant::now();
        let answer = client_with_key(Some(&key))
            .get(app.url("/api/v1/sequences"))
            .send()
            .await
            .unwrap();
        assert_eq!(
            answer.status(),
            StatusCode::OK,
            "a new key beside the flood"
        );
        assert!(
            started.elapsed() < USUAL,
            "a new key waited {:?}",
            started.elapsed()
        );
    }
    let unannounced = {
        let secret = "s".repeat(43);
        let id = "unannounced0";
        let hash = <sha2::Sha256 as sha2::Digest>::digest(secret.as_bytes()).to_vec();
        sqlx::query(
            "INSERT INTO api_keys (id, name, secret_hash, admin, projects) VALUES ($1, 'quiet', $2, false, '{NEW4}')",
        )
        .bind(id)
        .bind(hash)
        .execute(&app.db)
        .await
        .unwrap();
        format!("idp_{id}_{secret}")
    };
    let started = Instant::now();
    let answer = client_with_key(Some(&unannounced))
        .get(app.url("/api/v1/sequences"))
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status(), StatusCode::OK);
    assert!(
        started.elapsed() < USUAL,
        "an unannounced key waited {:?}",
        started.elapsed()
    );

    // The second tenant is timed through a flood of thousands.
    until(
        Duration::from_secs(30),
        "two thousand made-up keys",
        async || refused.load(Ordering::Relaxed) >= 2000,
    )
    .await;
    flooding.store(false, Ordering::Relaxed);
    for task in flood {
        let other = task.await.unwrap();
        assert!(
            other.is_empty(),
            "made-up or revoked keys answered {other:?}, not 401"
        );
    }
    neighbour
        .assert_unharmed("a flood of made-up keys", USUAL)
        .await;
}

/// A socket with a small receive buffer that asks for the largest asset
/// many times over and never reads.
async fn never_reading_client(host: &str) -> TcpStream {
    let socket = TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let mut stream = socket.connect(host.parse().unwrap()).await.unwrap();
    let request = b"GET /docs/swagger-ui-bundle.js HTTP/1.1\r\nhost: x\r\n\r\n";
    for _ in 0..32 {
        stream.write_all(request).await.unwrap();
    }
    stream
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_that_never_read_their_answers_lose_their_connections_after_the_write_timeout() {
    let mut env = TestEnv::new();
    env.max_connections = 4;
    env.write_timeout_s = 2;
    let app = env.spawn().await;
    let host = host_of(&app);
    let hogs: Vec<TcpStream> =
        futures::future::join_all((0..4).map(|_| never_reading_client(&host))).await;
    // Every connection is taken by a client that does not read; the
    // next one waits to be accepted until the write timeout frees one.
    let started = Instant::now();
    let health = crate::support::app::client_with_key(None)
        .get(app.url("/healthz"))
        .timeout(Duration::from_secs(20))
        .send()
        .await
        .expect("a fifth client is answered once a stalled connection is closed");
    assert_eq!(health.status(), StatusCode::OK);
    let waited = started.elapsed();
    assert!(
        waited < Duration::from_secs(2) + Duration::from_secs(3),
        "answered after {waited:?}; the write timeout is 2 s"
    );
    drop(hogs);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_keep_the_idle_timeout_and_requests_the_header_timeout() {
    let mut env = TestEnv::new();
    env.header_timeout_s = 1;
    env.idle_timeout_s = 3;
    let app = env.spawn().await;
    let mut stream = TcpStream::connect(host_of(&app)).await.unwrap();
    let request = b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n";
    let mut buffer = vec![0u8; 4096];
    stream.write_all(request).await.unwrap();
    let n = stream.read(&mut buffer).await.unwrap();
    assert!(String::from_utf8_lossy(&buffer[..n]).starts_with("HTTP/1.1 200"));

    // Idle longer than the header timeout, shorter than the idle timeout:
    // the keep-alive connection still serves.
    tokio::time::sleep(Duration::from_millis(1800)).await; // the client idles on purpose: past the header timeout
    stream.write_all(request).await.unwrap();
    let n = tokio::time::timeout(Duration::from_secs(2), stream.read(&mut buffer))
        .await
        .expect("an answer")
        .unwrap();
    assert!(
        String::from_utf8_lossy(&buffer[..n]).starts_with("HTTP/1.1 200"),
        "an idle connection within the idle timeout was closed"
    );

    // A request started and never finished has the header timeout.
    stream
        .write_all(b"GET /healthz HTTP/1.1\r\nhost")
        .await
        .unwrap();
    let started = Instant::now();
    let closed = tokio::time::timeout(Duration::from_secs(3), stream.read(&mut buffer))
        .await
        .expect("closed within the header timeout");
    assert!(matches!(closed, Ok(0) | Err(_)), "{closed:?}");
    assert!(
        started.elapsed() < Duration::from_millis(2500),
        "{:?}",
        started.elapsed()
    );

    // A connection idle past the idle timeout is closed.
    let mut idle = TcpStream::connect(host_of(&app)).await.unwrap();
    idle.write_all(request).await.unwrap();
    let _ = idle.read(&mut buffer).await.unwrap();
    let started = Instant::now();
    let closed = tokio::time::timeout(Duration::from_secs(6), idle.read(&mut buffer))
        .await
        .expect("closed after the idle timeout");
    assert!(matches!(closed, Ok(0) | Err(_)), "{closed:?}");
    assert!(
        started.elapsed() >= Duration::from_millis(2500),
        "closed early: {:?}",
        started.elapsed()
    );

    // A request head larger than a connection may buffer is refused.
    let mut big = TcpStream::connect(host_of(&app)).await.unwrap();
    let head = format!(
        "GET /healthz HTTP/1.1\r\nhost: x\r\nx-pad: {}\r\n\r\n",
        "a".repeat(20_000)
    );
    let _ = big.write_all(head.as_bytes()).await;
    let mut answer = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(3), big.read_to_end(&mut answer)).await;
    let answer = String::from_utf8_lossy(&answer);
    assert!(
        answer.is_empty() || answer.starts_with("HTTP/1.1 431"),
        "a 20 KB head was answered {answer:?}"
    );
}

/// A target that answers every delivery 500 with `body`.
async fn refusing_target(body: &'static [u8], gzip: bool) -> String {
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn whatever_a_target_answers_every_due_document_ends_dead_lettered() {
    const GZIP: &[u8] = &[
        0x1f, 0x8b, 0x08, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x03, 0x4b, 0x4a, 0x4c, 0x01, 0x00,
        0x00, 0xff, 0xff,
    ];
    for (body, gzip) in [
        (&b"bad\x00request"[..], false),
        (GZIP, true),
        (&[0xff, 0xfe, 0x00][..], false),
    ] {
        let mut env = TestEnv::new();
        env.sink = idpool::features::documents::sink::SinkConfig::Webhook(
            refusing_target(body, gzip).await,
        );
        env.outbox_max_retries = 3;
        env.outbox_backoff_base_ms = 10;
        env.outbox_poll_ms = 50;
        let app = env.spawn().await;
        let mut ids = Vec::new();
        for project in ["TA", "TB"] {
            let key = create_key(&app.state, &[project], false).await;
            let client = client_with_key(Some(&key));
            for n in 0..5 {
                let answer: Value = client
                    .post(app.url("/documents"))
                    .json(&json!({"project": project, "type": "1", "metadata": {"n": n}}))
                    .send()
                    .await
                    .unwrap()
                    .json()
                    .await
                    .unwrap();
                ids.push((client.clone(), answer["id"].as_str().unwrap().to_owned()));
            }
        }
        for (client, id) in &ids {
            let url = app.url(&format!("/api/v1/documents/{id}"));
            let mut last = Value::Null;
            until(Duration::from_secs(20), "dead-lettered", async || {
                last = client.get(&url).send().await.unwrap().json().await.unwrap();
                last["status"] == "dead_letter"
            })
            .await;
            assert_eq!(last["retry_count"], 3, "{last}");
            // A short classification; the target's bytes stay in the log.
            assert_eq!(last["last_error"], "HTTP 500", "{last}");
        }
    }
}

/// Rows of type F of a tenant, written straight into the outbox (delivered
/// long ago).
async fn fill_outbox(app: &TestApp, project: &str, rows: i64) {
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_small_outbox_lists_in_the_time_of_its_page_beside_a_huge_one() {
    let app = TestEnv::new().spawn().await;
    fill_outbox(&app, "HUGE", 300_000).await;
    let key = create_key(&app.state, &["SMALL"], false).await;
    let small = client_with_key(Some(&key));
    let mut mine = Vec::new();
    for n in 0..3 {
        let answer: Value = small
            .post(app.url("/documents"))
            .json(&json!({"project": "SMALL", "type": "1", "metadata": {"n": n}}))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        mine.push(answer["id"].as_str().unwrap().to_owned());
    }
    for id in &mine {
        app.wait_for_status(id, "committed", Duration::from_secs(10))
            .await;
    }
    let neighbour = Neighbour::start(&app, "HUGE").await;
    // Rounds of the largest listings the small tenant may ask for, sixty
    // at once: each costs its own page.
    for _ in 0..3 {
        let listings = (0..60).map(|_| {
            let small = small.clone();
            let url = app.url("/api/v1/outbox?status=committed&limit=1000");
            async move {
                let started = Instant::now();
                let page: Value = small.get(&url).send().await.unwrap().json().await.unwrap();
                (started.elapsed(), page)
            }
        });
        for (took, page) in futures::future::join_all(listings).await {
            assert_eq!(
                page["documents"].as_array().map(Vec::len),
                Some(3),
                "{page}"
            );
            assert!(took < USUAL, "a listing of three documents took {took:?}");
        }
    }
    neighbour
        .assert_unharmed("sixty listings at once", USUAL)
        .await;

    // Paging: the cursor names the small tenant's own document, nothing
    // else; another tenant's document as a cursor is refused exactly as a
    // made-up one.
    let page: Value = small
        .get(app.url("/api/v1/outbox?limit=1"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let cursor = page["next_cursor"].as_str().expect("a next page");
    let named = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(cursor)
        .map(|b| String::from_utf8_lossy(&b).into_owned())
        .unwrap_or_default();
    assert_eq!(named, mine[0], "the cursor names the page's last document");
    let next: Value = small
        .get(app.url(&format!("/api/v1/outbox?limit=1&cursor={cursor}")))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(next["documents"][0]["id"], mine[1].as_str());
    let foreign = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode("HUGE-F-5");
    let made_up = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode("HUGE-F-999999999");
    let mut answers = Vec::new();
    for cursor in [foreign, made_up] {
        let response = small
            .get(app.url(&format!("/api/v1/outbox?limit=1&cursor={cursor}")))
            .send()
            .await
            .unwrap();
        answers.push(
            assert_problem(response, StatusCode::UNPROCESSABLE_ENTITY, "unknown_cursor").await,
        );
    }
    assert_eq!(
        answers[0], answers[1],
        "another tenant's document reads as a made-up one"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_sending_slow_batch_bodies_holds_up_only_its_own_batches() {
    let mut env = TestEnv::new();
    env.request_timeout_s = 20;
    let app = env.spawn().await;
    let hostile = create_key(&app.state, &["SLOW"], false).await;
    let neighbour = Neighbour::start(&app, "FAST").await;
    let fast_key = create_key(&app.state, &["FAST"], false).await;
    let fast = client_with_key(Some(&fast_key));
    // More batch bodies than there are batch turns, a byte at a time.
    let mut trickles = Vec::new();
    let trickled = Arc::new(AtomicU64::new(0));
    for _ in 0..8 {
        let mut stream = TcpStream::connect(host_of(&app)).await.unwrap();
        let head = format!(
            "POST /api/v1/documents/batch HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
             authorization: Bearer {hostile}\r\ncontent-length: 100000\r\n\r\n"
        );
        stream.write_all(head.as_bytes()).await.unwrap();
        let trickled = trickled.clone();
        trickles.push(tokio::spawn(async move {
            for _ in 0..60 {
                if stream.write_all(b" ").await.is_err() {
                    return;
                }
                trickled.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(100)).await; // the hostile client trickles on purpose
            }
        }));
    }
    until(Duration::from_secs(10), "every body trickles", async || {
        trickled.load(Ordering::Relaxed) >= 8 * 3
    })
    .await;
    for n in 0..5 {
        let started = Instant::now();
        let answer = fast
            .post(app.url("/api/v1/documents/batch"))
            .json(&json!({"documents": [{"project": "FAST", "type": "2", "metadata": {"n": n}}]}))
            .send()
            .await
            .unwrap();
        assert_eq!(answer.status(), StatusCode::ACCEPTED);
        assert!(
            started.elapsed() < USUAL,
            "a one-item batch waited {:?}",
            started.elapsed()
        );
    }
    neighbour.assert_unharmed("slow batch bodies", USUAL).await;
    for trickle in trickles {
        trickle.abort();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_definition_may_print_another_projects_ids() {
    let app = TestEnv::new().spawn().await;
    // Two projects that both want INV-000001: the second is refused.
    app.define("P1", "INV", json!({"format": "INV-{seq:6}"}))
        .await;
    let refused = app
        .put_sequence("P2", "INV", json!({"format": "INV-{seq:6}"}))
        .await;
    assert_problem(refused, StatusCode::CONFLICT, "format_conflict").await;
    // With the project in it, each prints its own.
    app.define("P2", "INV", json!({"format": "{project}-INV-{seq:6}"}))
        .await;
    // A format that could print what another project's default sequences
    // print (Q/X's first ID is Q-X-1) is refused, used yet or not.
    let refused = app
        .put_sequence("P3", "A", json!({"format": "{type}-X-{seq}"}))
        .await;
    assert_problem(refused, StatusCode::CONFLICT, "format_conflict").await;
    app.define("P3", "B", json!({"format": "P3-{type}-{seq:4}"}))
        .await;
    // Two int64 layouts with one epoch print the same numbers; an epoch a
    // second later never does.
    app.define("P4", "N", json!({"layout": "int64", "reset": "daily"}))
        .await;
    let refused = app
        .put_sequence("P5", "N", json!({"layout": "int64", "reset": "daily"}))
        .await;
    assert_problem(refused, StatusCode::CONFLICT, "format_conflict").await;
    app.define(
        "P5",
        "N",
        json!({"layout": "int64", "reset": "daily", "epoch": "2022-01-01T00:00:01Z"}),
    )
    .await;

    // Each project's documents take their own IDs, none refused because
    // of the other's.
    let mut seen = std::collections::HashSet::new();
    for (project, doc_type) in [("P1", "INV"), ("P2", "INV"), ("P4", "N"), ("P5", "N")] {
        for _ in 0..3 {
            let response = app
                .post_document(
                    &json!({"project": project, "type": doc_type, "metadata": {}}),
                    None,
                )
                .await;
            let status = response.status();
            let body: Value = response.json().await.unwrap();
            assert_eq!(status, StatusCode::ACCEPTED, "{project}/{doc_type}: {body}");
            assert!(
                seen.insert(body["id"].as_str().unwrap().to_owned()),
                "{body}"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_value_leaves_no_connection_in_a_transaction() {
    let mut env = TestEnv::new();
    env.request_timeout_s = 2;
    let app = env.spawn().await;
    // Busy enough that documents share the pipeline's commit.
    let documents = (0..40).map(|n| {
        let app = &app;
        async move {
            let body = json!({"project": "NUM", "type": "1", "metadata": {"n": n}});
            app.post_document(&body, None).await
        }
    });
    for response in futures::future::join_all(documents).await {
        assert_eq!(response.status(), StatusCode::ACCEPTED);
    }
    let response = app
        .client
        .post(app.url("/documents"))
        .header("content-type", "application/json")
        .body(r#"{"project": "NUM", "type": "1", "metadata": {"a": 1e1000000}}"#)
        .send()
        .await
        .unwrap();
    assert_problem(response, StatusCode::BAD_REQUEST, "unstorable_value").await;
    let database = app.env.database_url.rsplit('/').next().unwrap().to_owned();
    let aborted = || async {
        let n: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = $1 \
             AND state LIKE 'idle in transaction%'",
        )
        .bind(&database)
        .fetch_one(&app.db)
        .await
        .unwrap();
        n
    };
    // The refused write's transaction is ended by us at once (its rollback
    // may still be on its way when the answer is), not when its connection
    // is next used, nor by Postgres' idle-in-transaction timeout (35 s).
    until(
        Duration::from_secs(2),
        "no connection sits in a transaction",
        async || aborted().await == 0,
    )
    .await;
    // Past the idle-in-transaction timeout (request timeout + 5 s), every
    // request is still served.
    crate::support::app::wait_on_postgres_clock(&app.db, Duration::from_secs(8)).await;
    let documents = (0..20).map(|n| {
        let app = &app;
        async move {
            let body = json!({"project": "NUM", "type": "1", "metadata": {"later": n}});
            app.post_document(&body, None).await
        }
    });
    for response in futures::future::join_all(documents).await {
        assert_eq!(response.status(), StatusCode::ACCEPTED);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn anyone_asking_for_readiness_and_metrics_costs_the_tenants_nothing() {
    let app = TestEnv::new().spawn().await;
    let neighbour = Neighbour::start(&app, "READY").await;
    let flooding = Arc::new(AtomicBool::new(true));
    let asked = Arc::new(AtomicU64::new(0));
    // The stranger's clients run on a runtime of their own, as they would
    // on their own machine: only the server's work is shared.
    let flood = {
        let (flooding, asked, address) = (flooding.clone(), asked.clone(), app.address.clone());
        std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .enable_all()
                .build()
                .unwrap();
            runtime.block_on(async move {
                let clients: Vec<_> = (0..64)
                    .map(|n| {
                        let (flooding, asked, address) =
                            (flooding.clone(), asked.clone(), address.clone());
                        tokio::spawn(async move {
                            let client = crate::support::app::client_with_key(None);
                            let path = if n % 2 == 0 { "/readyz" } else { "/metrics" };
                            while flooding.load(Ordering::Relaxed) {
                                let r =
                                    client.get(format!("{address}{path}")).send().await.unwrap();
                                assert!(r.status().is_success());
                                let _ = r.bytes().await;
                                asked.fetch_add(1, Ordering::Relaxed);
                            }
                        })
                    })
                    .collect();
                for client in clients {
                    client.await.unwrap();
                }
            })
        })
    };
    until(
        Duration::from_secs(60),
        "a flood of 2000 requests",
        async || asked.load(Ordering::Relaxed) >= 2000,
    )
    .await;
    flooding.store(false, Ordering::Relaxed);
    tokio::task::spawn_blocking(move || flood.join())
        .await
        .unwrap()
        .unwrap();
    assert!(
        asked.load(Ordering::Relaxed) > 200,
        "the flood was too small to tell"
    );
    neighbour
        .assert_unharmed("a flood of /readyz and /metrics", USUAL)
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_with_hundreds_of_requests_in_flight_holds_up_only_itself() {
    let app = TestEnv::new().spawn().await;
    fill_outbox(&app, "GREEDY", 20_000).await;
    let greedy = client_with_key(Some(&create_key(&app.state, &["GREEDY"], false).await));
    let neighbour = Neighbour::start(&app, "MODEST").await;
    // Six hundred listings at once and fifty clients that ask for the
    // largest and never read it: more rows than its list budget allows in
    // a second, and more requests than it may have in flight.
    let readers_stop = Arc::new(AtomicBool::new(false));
    let key = create_key(&app.state, &["GREEDY"], false).await;
    let mut stalled = Vec::new();
    for _ in 0..50 {
        let socket = TcpSocket::new_v4().unwrap();
        socket.set_recv_buffer_size(4096).unwrap();
        let mut stream = socket
            .connect(host_of(&app).parse().unwrap())
            .await
            .unwrap();
        let request = format!(
            "GET /api/v1/outbox?limit=1000 HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {key}\r\n\r\n"
        );
        stream.write_all(request.as_bytes()).await.unwrap();
        stalled.push(stream);
    }
    let listings = (0..600).map(|_| {
        let greedy = greedy.clone();
        let url = app.url("/api/v1/outbox?limit=20");
        async move { greedy.get(&url).send().await.map(|r| r.status()) }
    });
    let answered = futures::future::join_all(listings).await;
    assert!(
        answered
            .iter()
            .all(|a| matches!(a, Ok(s) if s.is_success())),
        "the greedy key's own requests wait their turn, not fail"
    );
    readers_stop.store(true, Ordering::Relaxed);
    neighbour
        .assert_unharmed("hundreds of one key's requests in flight", USUAL)
        .await;
    drop(stalled);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stranger_holding_every_connection_slot_keeps_no_tenant_from_connecting() {
    let mut env = TestEnv::new();
    env.max_connections = 64;
    let app = env.spawn().await;
    let neighbour = Neighbour::start(&app, "SLOTS").await;
    let key = create_key(&app.state, &["SLOTS"], false).await;
    // A stranger opens keep-alive connections, four times the cap, and
    // holds every one.
    let host = host_of(&app);
    let stranger = tokio::spawn(async move {
        let mut held = Vec::new();
        let mut served = 0;
        for _ in 0..256 {
            let Ok(mut stream) = TcpStream::connect(&host).await else {
                continue;
            };
            if stream
                .write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
                .await
                .is_err()
            {
                continue;
            }
            let mut buffer = [0u8; 512];
            if let Ok(Ok(n)) =
                tokio::time::timeout(Duration::from_secs(5), stream.read(&mut buffer)).await
                && n > 0
            {
                served += 1;
            }
            held.push(stream);
        }
        (served, held)
    });
    // Meanwhile a tenant's client opens a new connection for every request.
    let mut slowest = Duration::ZERO;
    while !stranger.is_finished() {
        let fresh = client_with_key(Some(&key));
        let started = Instant::now();
        let answer = fresh
            .get(app.url("/api/v1/sequences"))
            .timeout(Duration::from_secs(20))
            .send()
            .await
            .expect("a new connection beside a stranger's hundreds is served");
        assert_eq!(answer.status(), StatusCode::OK);
        slowest = slowest.max(started.elapsed());
        tokio::time::sleep(Duration::from_millis(20)).await; // new clients arrive over the flood, not at once
    }
    let (served, held) = stranger.await.unwrap();
    assert_eq!(
        served, 256,
        "each of the stranger's connections is served in turn"
    );
    assert!(
        slowest < USUAL,
        "a tenant's new connection waited {slowest:?} beside the stranger's"
    );
    neighbour
        .assert_unharmed("a stranger holding every connection slot", USUAL)
        .await;
    drop(held);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_taking_numbers_ten_thousand_at_a_time_is_held_to_its_budget() {
    let mut env = TestEnv::new();
    env.numbers_per_key = 20_000;
    let app = env.spawn().await;
    let greedy_key = create_key(&app.state, &["GREEDY"], false).await;
    let greedy = client_with_key(Some(&greedy_key));
    let neighbour = Neighbour::start(&app, "MODEST").await;
    // 160,000 numbers from four loops at once: a second's worth (20,000,
    // and the requests already let through) goes at once, the rest at
    // 20,000 a second, so no sooner than in about 6 s.
    let started = Instant::now();
    let mut loops = Vec::new();
    for _ in 0..4 {
        let greedy = greedy.clone();
        let url = app.url("/ids");
        loops.push(tokio::spawn(async move {
            let mut taken = Vec::new();
            for _ in 0..4 {
                let answer = greedy
                    .post(&url)
                    .json(&json!({"project": "GREEDY", "type": "1", "count": 10_000}))
                    .send()
                    .await
                    .unwrap();
                assert_eq!(answer.status(), StatusCode::OK);
                let body: Value = answer.json().await.unwrap();
                taken.extend(
                    body["seqs"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .map(|n| n.as_i64().unwrap()),
                );
            }
            taken
        }));
    }
    let mut numbers = Vec::new();
    for taken in loops {
        numbers.extend(taken.await.unwrap());
    }
    let took = started.elapsed();
    numbers.sort_unstable();
    numbers.dedup();
    assert_eq!(numbers.len(), 160_000, "every number asked for, once");
    assert!(
        took >= Duration::from_secs(5),
        "160,000 numbers on a budget of 20,000 a second took only {took:?}"
    );
    neighbour
        .assert_unharmed("a key taking numbers ten thousand at a time", USUAL)
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_migration_at_full_speed_leaves_batch_turns_for_another_tenant() {
    let app = TestEnv::new().spawn().await;
    let migrating_key = create_key(&app.state, &["MIGR"], false).await;
    let migrating = client_with_key(Some(&migrating_key));
    let other_key = create_key(&app.state, &["OTHER"], false).await;
    let other = client_with_key(Some(&other_key));
    let running = Arc::new(AtomicBool::new(true));
    // As many batches of a thousand at once as there are batch turns.
    let mut loops = Vec::new();
    for _ in 0..4 {
        let migrating = migrating.clone();
        let url = app.url("/api/v1/documents/batch");
        let running = running.clone();
        loops.push(tokio::spawn(async move {
            let documents: Vec<Value> = (0..1000)
                .map(|n| json!({"project": "MIGR", "type": "1", "metadata": {"n": n, "pad": "x".repeat(200)}}))
                .collect();
            let mut batches = 0;
            while running.load(Ordering::Relaxed) {
                let answer = migrating
                    .post(&url)
                    .json(&json!({ "documents": documents }))
                    .send()
                    .await
                    .unwrap();
                assert_eq!(answer.status(), StatusCode::ACCEPTED);
                batches += 1;
            }
            batches
        }));
    }
    let mut slowest = Duration::ZERO;
    for n in 0..10 {
        let started = Instant::now();
        let answer = other
            .post(app.url("/api/v1/documents/batch"))
            .json(&json!({"documents": [{"project": "OTHER", "type": "1", "metadata": {"n": n}}]}))
            .send()
            .await
            .unwrap();
        assert_eq!(answer.status(), StatusCode::ACCEPTED);
        slowest = slowest.max(started.elapsed());
    }
    running.store(false, Ordering::Relaxed);
    let mut batches = 0;
    for batch_loop in loops {
        batches += batch_loop.await.unwrap();
    }
    assert!(
        batches >= 4,
        "the migration went on meanwhile ({batches} batches)"
    );
    assert!(
        slowest < USUAL,
        "another tenant's one-item batch waited {slowest:?} beside a migration"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_that_finds_the_postgres_pool_taken_is_answered_503_at_once() {
    let mut env = TestEnv::new();
    env.processor = false;
    env.db_acquire_timeout_ms = 300;
    let app = env.spawn().await;
    let id = app.accept("TAKEN", "1").await;
    // Every connection of the request pool taken (as requests stuck on a
    // slow Postgres would hold them): the pool answers no more.
    crate::support::app::expect_error_lines("pool timed out");
    let mut held = Vec::new();
    while let Ok(conn) = app.state.db.acquire().await {
        held.push(conn);
        assert!(held.len() <= 100, "a request pool without a bound");
    }
    // The answer comes while every connection is still held: 503 with
    // Retry-After, not a wait for one to come back.
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(20))
        .build()
        .unwrap();
    let refused = client
        .get(app.url(&format!("/api/v1/documents/{id}")))
        .bearer_auth(&app.admin_key)
        .send()
        .await
        .expect("an answer while the pool is taken");
    assert!(
        refused.headers().contains_key("retry-after"),
        "{:?}",
        refused.headers()
    );
    assert_problem(refused, StatusCode::SERVICE_UNAVAILABLE, "unavailable").await;
    drop(held);
    let (status, document) = app.get_json(&format!("/api/v1/documents/{id}")).await;
    assert_eq!(status, StatusCode::OK, "{document}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_route_at_once_on_two_database_turns_needs_no_second_connection() {
    // The default pool: two turns for requests on the connections the
    // instance's own work leaves. A path that held one connection and
    // waited for another would, many at once, wait out the acquire timeout
    // (503): none may.
    let mut env = TestEnv::new();
    env.processor = false;
    let app = env.spawn().await;
    let key = create_key(&app.state, &["ONE"], false).await;
    let tenant = client_with_key(Some(&key));
    app.issue("ONE", "1", 1).await;
    let (_, first) = app.issue("ONE", "2", 40).await;
    let id = app.accept("ONE", "1").await;
    let requests = (0..80).map(|n| {
        let (app, tenant, id, first) = (&app, &tenant, &id, &first);
        async move {
            let url = |path: &str| app.url(path);
            let request = match n % 8 {
                0 => tenant
                    .post(url("/ids"))
                    .json(&json!({"project": "ONE", "type": "1", "count": 3})),
                1 => tenant
                    .post(url("/documents"))
                    .header("idempotency-key", format!("once-{n}"))
                    .json(&json!({"project": "ONE", "type": "1", "metadata": {"n": n}})),
                2 => tenant.post(url("/api/v1/documents/batch")).json(&json!({
                    "documents": [{"project": "ONE", "type": "1", "metadata": {"n": n}}]
                })),
                3 => tenant.get(url(&format!("/api/v1/documents/{id}"))),
                4 => tenant.get(url("/api/v1/outbox?project=ONE&limit=50")),
                5 => tenant.get(url("/api/v1/ids/gaps?project=ONE&type=1")),
                6 => tenant.get(url("/api/v1/sequences")),
                _ => tenant.post(url("/documents")).json(&json!({
                    "project": "ONE", "type": "2", "id": format!("ONE-2-{}", first[n / 8 % first.len()]),
                    "metadata": {}
                })),
            };
            let response = request.send().await.expect("an answer");
            let status = response.status();
            (n % 8, status, response.text().await.unwrap_or_default())
        }
    });
    let answers = futures::future::join_all(requests).await;
    let failed: Vec<_> = answers
        .iter()
        .filter(|(_, status, _)| !status.is_success())
        .collect();
    assert!(failed.is_empty(), "{failed:?}");
}

/// What tenant B saw: the latencies of its `POST /ids` and
/// `POST /documents`, those of `GET /healthz` on the same instance between
/// them (what any request of that process waits for a core), and every
/// answer that was not a 2xx.
#[derive(Default)]
struct TenantB {
    issuing: Vec<Duration>,
    healthz: Vec<Duration>,
    failures: Vec<String>,
}

/// Tenant B's requests, one at a time (`POST /ids`, `GET /healthz`,
/// `POST /documents`, `GET /healthz`, ...; the first two with an
/// Idempotency-Key, so each holds a connection of its own), at least
/// `at_least` issuing ones and, given `running`, until it ends.
async fn tenant_b_one_at_a_time(
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
async fn bare_commits(
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

fn p99(latencies: &mut [Duration]) -> Duration {
    latencies.sort_unstable();
    latencies[(latencies.len() * 99 / 100).min(latencies.len() - 1)]
}

/// Tenant A migrates 100,000 documents with `idpool import` (8 batches at
/// once) into one instance while tenant B sends keyed requests one at a
/// time to another, both on one Postgres and two cores; B's instance
/// delivers every tenant's documents to a webhook that answers in half a
/// second (its outbox loops hold their connections through A's backlog)
/// and reconciles all along.
/// B gets no error (no connection it needs is held by A's work or by
/// background work), a key made for B during the import is served at
/// once, and B's p99 grows by no more than the machine's share of it: what B's
/// process waits for a core (its `GET /healthz` p99) plus three times what
/// a bare transaction of B's size on the same Postgres waits more
/// meanwhile. Every answer of B waits for its transaction, and the import
/// slows every statement of that Postgres, idpool's or not (BENCHMARKS.md
/// has the figures of a release build).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenants_import_fails_no_request_of_another_and_slows_it_no_more_than_postgres() {
    let env = TestEnv::new();
    let setup = env.spawn().await;
    let key_a = create_key(&setup.state, &["TENA"], false).await;
    let key_b = create_key(&setup.state, &["TENB"], false).await;
    sqlx::query("CREATE TABLE bare_commits (id bigserial PRIMARY KEY, at timestamptz NOT NULL)")
        .execute(&setup.db)
        .await
        .expect("a table of our own");
    let instance_a = crate::support::app::ServeProcess::start(&env).await;
    let webhook =
        crate::support::webhook::Webhook::start(crate::support::webhook::Behaviour::Succeed).await;
    webhook.slow_down(Duration::from_millis(500));
    let mut delivering = env.clone();
    delivering.sink = idpool::features::documents::sink::SinkConfig::Webhook(webhook.url.clone());
    let instance_b = crate::support::app::ServeProcess::start(&delivering).await;
    let base_b = format!("http://127.0.0.1:{}", instance_b.port);
    let client_b = client_with_key(Some(&key_b));

    let dir = tempfile::tempdir().expect("a directory");
    let input = dir.path().join("tena.jsonl");
    let mut lines = String::with_capacity(100_000 * 64);
    for n in 0..100_000 {
        lines.push_str(&format!(
            "{{\"source_id\": \"a-{n}\", \"metadata\": {{\"n\": {n}, \"pad\": \"xxxxxxxxxxxxxxxx\"}}}}\n"
        ));
    }
    std::fs::write(&input, lines).expect("the input");

    // Alone (after a warm-up: first use creates B's sequences).
    tenant_b_one_at_a_time(&client_b, &base_b, 50, None).await;
    let mut alone = tenant_b_one_at_a_time(&client_b, &base_b, 400, None).await;
    assert!(alone.failures.is_empty(), "B alone: {:?}", alone.failures);
    let alone_p99 = p99(&mut alone.issuing);
    let healthz_alone = p99(&mut alone.healthz);
    let floor_alone = p99(&mut bare_commits(&setup.db, 400, None).await);

    let mut import = std::process::Command::new(env!("CARGO_BIN_EXE_idpool"))
        .arg("import")
        .arg(&input)
        .args(["--project", "TENA", "--type", "1", "--concurrency", "8"])
        .args(["--url", &format!("http://127.0.0.1:{}", instance_a.port)])
        .arg("--out")
        .arg(dir.path().join("tena.map.jsonl"))
        .env("IDPOOL_KEY", &key_a)
        .stdout(crate::support::app::child_output())
        .stderr(crate::support::app::child_output())
        .spawn()
        .expect("idpool import starts");
    let importing = Arc::new(AtomicBool::new(true));
    let beside = {
        let (client_b, base_b, importing) = (client_b.clone(), base_b.clone(), importing.clone());
        tokio::spawn(async move {
            tenant_b_one_at_a_time(&client_b, &base_b, 100, Some(&importing)).await
        })
    };
    let floor = {
        let (db, importing) = (setup.db.clone(), importing.clone());
        tokio::spawn(async move { bare_commits(&db, 100, Some(&importing)).await })
    };
    // B's instance reconciles meanwhile, as each instance does on its
    // interval (a run reads what the import writes).
    let reconciling = {
        let (client, url, importing) = (
            setup.client.clone(),
            format!("{base_b}/api/v1/ids/gaps/reconcile"),
            importing.clone(),
        );
        tokio::spawn(async move {
            while importing.load(Ordering::Relaxed) {
                let _ = client.post(&url).send().await;
            }
        })
    };
    // A key made meanwhile: B's instance looks it up for its first request.
    until(
        Duration::from_secs(10),
        "A's backlog reaches B's outbox",
        async || webhook.received().len() + webhook.connections() > 0,
    )
    .await;
    let new_key = client_with_key(Some(&create_key(&setup.state, &["TENB"], false).await));
    let started = Instant::now();
    let first = new_key
        .post(format!("{base_b}/ids"))
        .json(&json!({"project": "TENB", "type": "1", "count": 1}))
        .send()
        .await
        .expect("B's instance answers");
    let new_key_took = started.elapsed();
    assert_eq!(first.status(), StatusCode::OK, "a new key's first request");
    let status = tokio::task::spawn_blocking(move || import.wait())
        .await
        .expect("import")
        .expect("import ran");
    importing.store(false, Ordering::Relaxed);
    reconciling.await.expect("reconciliation runs");
    let mut beside = beside.await.expect("B beside the import");
    let floor_beside = p99(&mut floor.await.expect("bare commits beside the import"));
    assert!(status.success(), "the import failed: {status}");
    let imported: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM id_outbox WHERE tenant_code = 'TENA' AND source_id IS NOT NULL",
    )
    .fetch_one(&setup.db)
    .await
    .expect("count");
    assert_eq!(imported, 100_000, "every line imported");
    let failures = &beside.failures;
    assert!(
        failures.is_empty(),
        "B beside A's import: {} of {} not 2xx, e.g. {:?}",
        failures.len(),
        beside.issuing.len() + beside.healthz.len(),
        &failures[..failures.len().min(3)]
    );
    let beside_p99 = p99(&mut beside.issuing);
    let healthz_beside = p99(&mut beside.healthz);
    println!(
        "B's p99 alone {alone_p99:?}, beside the import {beside_p99:?} ({} requests); its \
         GET /healthz {healthz_alone:?} and {healthz_beside:?}; a bare transaction's \
         {floor_alone:?} and {floor_beside:?}",
        beside.issuing.len()
    );
    assert!(
        new_key_took < USUAL,
        "a key made during the import waited {new_key_took:?} for its first answer"
    );
    let grown = beside_p99.saturating_sub(alone_p99);
    let cores = healthz_beside.saturating_sub(healthz_alone);
    let commits = floor_beside.saturating_sub(floor_alone);
    assert!(
        grown <= cores + commits * 3,
        "B's p99 grew by {grown:?} ({alone_p99:?} alone, {beside_p99:?} beside A's import); \
         waiting for a core grew by {cores:?}, a bare transaction by {commits:?}"
    );
}

/// A tenant attaching numbers of its busy sequence that its lease has not
/// handed out yet (each attach waits for a handout that may never come,
/// at most until the lease's expiry) holds no database turn meanwhile:
/// another tenant's keyed documents are answered as usual, and every
/// waiting attach ends 202 or 409, never an error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attaches_waiting_for_handouts_hold_up_no_other_tenant() {
    let app = TestEnv::new().spawn().await;
    let hostile = client_with_key(Some(&create_key(&app.state, &["HOLD"], false).await));
    let other = client_with_key(Some(&create_key(&app.state, &["OTHB"], false).await));
    // HOLD's sequence busy enough to be served from a lease, all along.
    let issuing = Arc::new(AtomicBool::new(true));
    let highest = Arc::new(AtomicU64::new(0));
    let issuers: Vec<_> = (0..8)
        .map(|_| {
            let (client, url) = (hostile.clone(), app.url("/ids"));
            let (issuing, highest) = (issuing.clone(), highest.clone());
            tokio::spawn(async move {
                while issuing.load(Ordering::Relaxed) {
                    let body: Value = client
                        .post(&url)
                        .json(&json!({"project": "HOLD", "type": "1", "count": 1}))
                        .send()
                        .await
                        .unwrap()
                        .json()
                        .await
                        .unwrap();
                    highest.fetch_max(body["seqs"][0].as_u64().unwrap_or(0), Ordering::Relaxed);
                }
            })
        })
        .collect();
    until(Duration::from_secs(10), "HOLD holds a lease", async || {
        let metrics = app.metrics().await;
        metrics.get("idpool_leases_total").copied().unwrap_or(0.0) > 0.0
            && highest.load(Ordering::Relaxed) > 500
    })
    .await;
    let ahead = highest.load(Ordering::Relaxed) + 1;
    let attaches: Vec<_> = (ahead..ahead + 200)
        .map(|n| {
            let (client, url) = (hostile.clone(), app.url("/documents"));
            tokio::spawn(async move {
                let body = json!({"project": "HOLD", "type": "1", "id": format!("HOLD-1-{n}"), "metadata": {}});
                client.post(&url).json(&body).send().await.unwrap().status()
            })
        })
        .collect();
    let mut slowest = Duration::ZERO;
    for n in 0..20 {
        let started = Instant::now();
        let answer = other
            .post(app.url("/documents"))
            .header("idempotency-key", format!("other-{n}"))
            .json(&json!({"project": "OTHB", "type": "1", "metadata": {"n": n}}))
            .send()
            .await
            .unwrap();
        assert_eq!(answer.status(), StatusCode::ACCEPTED);
        slowest = slowest.max(started.elapsed());
    }
    let mut statuses = std::collections::BTreeMap::new();
    for attach in attaches {
        *statuses.entry(attach.await.unwrap().as_u16()).or_insert(0) += 1;
    }
    issuing.store(false, Ordering::Relaxed);
    for issuer in issuers {
        issuer.await.unwrap();
    }
    assert!(
        statuses.keys().all(|s| *s == 202 || *s == 409),
        "attaches ahead of the lease: {statuses:?}"
    );
    assert!(
        slowest < USUAL,
        "another tenant's keyed document waited {slowest:?} beside 200 waiting attaches"
    );
}
