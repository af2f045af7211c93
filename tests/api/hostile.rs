//! A hostile client's requests: each is refused with a 4xx problem (or cut
//! off), writes nothing, and leaves well-behaved clients served as usual
//! while it runs.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use reqwest::StatusCode;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::support::app::eventually;
use crate::support::app::{TestApp, TestEnv, assert_problem, create_key};
use crate::support::redis_server::RedisServer;

/// Slowest answer a well-behaved request may get while a hostile one runs
/// (they take milliseconds; a service frozen by one request takes seconds).
const USUAL: Duration = Duration::from_millis(1500);

/// Well-behaved traffic beside a hostile request: `GET /healthz` and
/// `POST /ids` in a loop, every answer timed.
struct Probe {
    running: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<ProbeReport>,
}

#[derive(Debug)]
struct ProbeReport {
    answers: usize,
    failures: Vec<String>,
    slowest: Duration,
}

impl Probe {
    fn start(app: &TestApp) -> Self {
        let running = Arc::new(AtomicBool::new(true));
        let (client, address) = (app.client.clone(), app.address.clone());
        let flag = running.clone();
        let task = tokio::spawn(async move {
            let mut report = ProbeReport {
                answers: 0,
                failures: Vec::new(),
                slowest: Duration::ZERO,
            };
            while flag.load(Ordering::Relaxed) {
                let started = Instant::now();
                let health = client.get(format!("{address}/healthz")).send().await;
                let ids = client
                    .post(format!("{address}/ids"))
                    .json(&json!({"project": "PROBE", "type": "ok", "count": 1}))
                    .send()
                    .await;
                report.slowest = report.slowest.max(started.elapsed() / 2);
                for (what, answer) in [("healthz", health), ("POST /ids", ids)] {
                    match answer {
                        Ok(r) if r.status().is_success() => report.answers += 1,
                        Ok(r) => report.failures.push(format!("{what}: {}", r.status())),
                        Err(e) => report.failures.push(format!("{what}: {e}")),
                    }
                }
                tokio::time::sleep(Duration::from_millis(20)).await; // the probe's own pace: a steady trickle of requests
            }
            report
        });
        Self { running, task }
    }

    /// Stops the probe and asserts it was served throughout.
    async fn assert_unharmed(self, during: &str) {
        self.running.store(false, Ordering::Relaxed);
        let report = self.task.await.expect("probe");
        assert!(
            report.failures.is_empty(),
            "{during}: well-behaved requests failed: {:?}",
            report.failures
        );
        assert!(report.answers >= 2, "{during}: the probe got no answers");
        assert!(
            report.slowest < USUAL,
            "{during}: a well-behaved request took {:?}",
            report.slowest
        );
    }
}

async fn count(app: &TestApp, table: &'static str) -> i64 {
    let sql = match table {
        "id_outbox" => "SELECT count(*) FROM id_outbox",
        "issuance_ledger" => "SELECT count(*) FROM issuance_ledger",
        _ => "SELECT count(*) FROM sequences WHERE project <> 'PROBE'",
    };
    sqlx::query_scalar(sql).fetch_one(&app.db).await.unwrap()
}

/// Nothing but the probe's own numbers was written.
async fn nothing_written(app: &TestApp, sequences: i64) {
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
async fn raw_exchange(app: &TestApp, request: &[u8], wait: Duration) -> String {
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attaching_any_id_to_any_accepted_format_takes_one_pass() {
    let app = TestEnv::new().spawn().await;
    // Ten fixed-width date tokens read back one way: accepted.
    let format = format!("{}{{seq}}", "{date:%Y}".repeat(10));
    let response = app
        .put_sequence("BT", "A", json!({ "format": format }))
        .await;
    assert_eq!(response.status(), StatusCode::CREATED);
    let probe = Probe::start(&app);
    let hostile_ids = [
        "1".repeat(64),
        "2026".repeat(16),
        format!("{}{}", "2026".repeat(10), "9".repeat(24)),
        "a".repeat(64),
    ];
    let bodies: Vec<Value> = hostile_ids
        .iter()
        .cycle()
        .take(32)
        .map(|id| json!({"project": "BT", "type": "A", "metadata": {}, "id": id}))
        .collect();
    let attaches = bodies.iter().map(|body| app.post_document(body, None));
    for response in futures::future::join_all(attaches).await {
        assert_problem(response, StatusCode::CONFLICT, "id_not_attachable").await;
    }
    probe.assert_unharmed("32 hostile attaches").await;
    nothing_written(&app, 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn formats_that_read_more_than_one_way_or_grow_without_bound_are_refused() {
    let app = TestEnv::new().spawn().await;
    let cases = [
        // Sub-second fractions print 0 to 10 characters: 73-character IDs.
        (format!("{}{{seq}}", "{date:%.f}".repeat(7)), "varying"),
        // Nov 1 number 15 and Nov 11 number 5 print the same ID.
        ("{date:%Y%m%-d}{seq}".to_owned(), "varying"),
        ("{date:%-m%-d}-{seq}".to_owned(), "varying"),
        ("{date:%B}{seq}".to_owned(), "varying"),
        (format!("{}{{seq}}", "{type}".repeat(16)), "tokens"),
        (format!("{{date:{}}}{{seq}}", "%y".repeat(33)), "items"),
        (format!("{}{{seq}}", "x".repeat(300)), "bytes long"),
        ("{date:%Z}-{seq}".to_owned(), "not supported"),
        ("a\t{seq}".to_owned(), "control"),
        ("{date:%n}{seq}".to_owned(), "control"),
        (
            format!("{}-{{seq}}", "{date:%Y%m%d%H%M%S}".repeat(4)),
            "characters long",
        ),
    ];
    let probe = Probe::start(&app);
    for (format, mention) in &cases {
        let response = app
            .put_sequence("BT", "B", json!({ "format": format }))
            .await;
        let problem = assert_problem(response, StatusCode::BAD_REQUEST, "invalid_definition").await;
        let detail = problem["detail"].as_str().unwrap();
        assert!(
            detail.contains(mention),
            "{format}: {detail:?} should mention {mention:?}"
        );
    }
    probe.assert_unharmed("refused formats").await;
    nothing_written(&app, 0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_sequence_prints_an_id_another_sequence_of_its_project_prints() {
    let app = TestEnv::new().spawn().await;
    let same = json!({"format": "{project}{type}{seq}"});
    let first = app.put_sequence("P", "A1", same.clone()).await;
    assert_eq!(first.status(), StatusCode::CREATED);
    // PA12 + 3 reads like PA1 + 23.
    let second = app.put_sequence("P", "A12", same.clone()).await;
    let problem = assert_problem(second, StatusCode::CONFLICT, "format_conflict").await;
    let detail = problem["detail"].as_str().unwrap();
    assert!(
        detail.contains("P/A1") && detail.contains("PA12"),
        "{detail}"
    );
    // Another project may print the same shape.
    let elsewhere = app.put_sequence("Q", "A12", same).await;
    assert_eq!(elsewhere.status(), StatusCode::CREATED);

    // A custom format that prints what a default one would.
    let custom = app
        .put_sequence("P", "X", json!({"format": "P-Y-{seq}"}))
        .await;
    assert_eq!(custom.status(), StatusCode::CREATED);
    let first_use = app.post_ids("P", "Y", 1).await;
    assert_problem(first_use, StatusCode::CONFLICT, "format_conflict").await;
    let (status, _) = app.get_json("/api/v1/sequences/P/Y").await;
    assert_eq!(status, StatusCode::NOT_FOUND, "P/Y was not created");
    nothing_written(&app, 3).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forced_change_never_prints_an_earlier_id_again() {
    let app = TestEnv::new().spawn().await;
    let format = "{date:%Y%m%d}-{seq}";
    let created = app
        .put_sequence("R", "1", json!({ "format": format }))
        .await;
    assert_eq!(created.status(), StatusCode::CREATED);
    let (before, before_seqs) = app.issue("R", "1", 5).await;

    // A daily reset starts a new counter; the same format would print
    // today's IDs again from 1.
    let daily = app
        .put_sequence(
            "R",
            "1",
            json!({"format": format, "reset": "daily", "force": true}),
        )
        .await;
    assert_eq!(daily.status(), StatusCode::OK);
    let (after, after_seqs) = app.issue("R", "1", 5).await;
    let before: HashSet<String> = before.into_iter().collect();
    assert!(
        after.iter().all(|id| !before.contains(id)),
        "{after:?} repeats {before:?}"
    );
    assert!(after_seqs[0] > *before_seqs.last().unwrap());

    // And back: the never-resetting counter starts above the daily one.
    let never = app
        .put_sequence(
            "R",
            "1",
            json!({"format": format, "reset": "never", "force": true}),
        )
        .await;
    assert_eq!(never.status(), StatusCode::OK);
    let (again, _) = app.issue("R", "1", 5).await;
    assert!(
        again
            .iter()
            .all(|id| !before.contains(id) && !after.contains(id)),
        "{again:?}"
    );

    // A format that could print what an earlier one printed is refused,
    // force or not.
    let overlapping = app
        .put_sequence(
            "R",
            "1",
            json!({"format": "{date:%Y%m%d}-1{seq}", "force": true}),
        )
        .await;
    let problem = assert_problem(overlapping, StatusCode::CONFLICT, "format_conflict").await;
    assert!(
        problem["detail"]
            .as_str()
            .unwrap()
            .contains("earlier format"),
        "{problem}"
    );
    let disjoint = app
        .put_sequence("R", "1", json!({"format": "R1/{seq}", "force": true}))
        .await;
    assert_eq!(disjoint.status(), StatusCode::OK);

    // The 64-bit layout prints (day since epoch << 32 | counter): a new
    // epoch would move today's IDs onto another day's.
    let int64 = app.put_sequence("R", "2", json!({"layout": "int64"})).await;
    assert_eq!(int64.status(), StatusCode::CREATED);
    app.issue("R", "2", 3).await;
    let moved = app
        .put_sequence(
            "R",
            "2",
            json!({"layout": "int64", "epoch": "2022-01-02T00:00:00Z", "force": true}),
        )
        .await;
    let problem = assert_problem(moved, StatusCode::CONFLICT, "format_conflict").await;
    assert!(
        problem["detail"]
            .as_str()
            .unwrap()
            .contains("earlier epoch"),
        "{problem}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strings_postgres_cannot_store_are_refused_wherever_they_appear() {
    let app = TestEnv::new().spawn().await;
    let probe = Probe::start(&app);
    let documents = [
        r#"{"project":"P","type":"T","metadata":{"a":"x\u0000y"}}"#,
        r#"{"project":"P","type":"T","metadata":{"a":{"b":[1,{"c":"\u0000"}]}}}"#,
        r#"{"project":"P","type":"T","metadata":{"k\u0000":1}}"#,
        r#"{"project":"P","type":"T","metadata":{"a":"\ud800"}}"#,
        r#"{"project":"P","type":"T","metadata":{"a":"\udc00\ud800"}}"#,
        r#"{"project":"P","type":"T","metadata":{},"id":"P-T-\u0000"}"#,
        r#"{"project":"P\u0000","type":"T","metadata":{}}"#,
    ];
    for body in documents {
        for path in ["/documents", "/api/v1/documents"] {
            let response = app
                .client
                .post(app.url(path))
                .header("content-type", "application/json")
                .header("idempotency-key", "same-key")
                .body(body)
                .send()
                .await
                .unwrap();
            assert_problem(response, StatusCode::BAD_REQUEST, "invalid_character").await;
        }
    }
    // A batch names its first bad item, as it does for every other fault.
    let good = r#"{"project":"P","type":"T","metadata":{}}"#;
    for (bad, index) in [(documents[0], 0), (documents[3], 2), (documents[2], 1)] {
        let mut items = vec![good; 3];
        items.insert(index, bad);
        let batch = format!(r#"{{"documents":[{}]}}"#, items.join(","));
        let response = app
            .client
            .post(app.url("/api/v1/documents/batch"))
            .header("content-type", "application/json")
            .body(batch)
            .send()
            .await
            .unwrap();
        let problem = assert_problem(response, StatusCode::BAD_REQUEST, "invalid_character").await;
        assert_eq!(problem["index"], index, "{problem}");
    }
    let ids = app
        .client
        .post(app.url("/ids"))
        .header("content-type", "application/json")
        .body(r#"{"project":"P","type":"\u0000"}"#)
        .send()
        .await
        .unwrap();
    assert_problem(ids, StatusCode::BAD_REQUEST, "invalid_character").await;
    let definition = app
        .client
        .put(app.url("/api/v1/sequences/P/T"))
        .header("content-type", "application/json")
        .body(r#"{"format":"{seq}\u0000"}"#)
        .send()
        .await
        .unwrap();
    assert_problem(definition, StatusCode::BAD_REQUEST, "invalid_character").await;

    for path in [
        "/api/v1/documents/%00",
        "/api/v1/documents/P-T-1%00",
        "/api/v1/outbox?project=%00",
        "/api/v1/outbox?status=pending&type=T%00",
        "/api/v1/ids/gaps?project=P&type=T&period=%00",
        "/api/v1/sequences?cursor=%00",
        "/api/v1/sequences/P/T%00",
    ] {
        let response = app.client.get(app.url(path)).send().await.unwrap();
        assert_problem(response, StatusCode::BAD_REQUEST, "invalid_character").await;
    }
    for path in [
        "/api/v1/outbox/P-T-1%00/retry",
        "/api/v1/outbox/%00/abandon",
    ] {
        let response = app.client.post(app.url(path)).send().await.unwrap();
        assert_problem(response, StatusCode::BAD_REQUEST, "invalid_character").await;
    }

    // Header values: the HTTP parser refuses a NUL byte outright, and a
    // key that is not printable ASCII is the request's 400.
    let body = r#"{"project":"P","type":"T"}"#;
    let with_nul = format!(
        "POST /ids HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nIdempotency-Key: a\0b\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    let answer = raw_exchange(&app, with_nul.as_bytes(), Duration::from_secs(2)).await;
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
    let mut high = format!(
        "POST /ids HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nIdempotency-Key: a",
        app.admin_key,
        body.len()
    )
    .into_bytes();
    high.extend_from_slice(b"\xff\xfeb\r\nConnection: close\r\n\r\n");
    high.extend_from_slice(body.as_bytes());
    let answer = raw_exchange(&app, &high, Duration::from_secs(2)).await;
    assert!(
        answer.starts_with("HTTP/1.1 400") && answer.contains("invalid_idempotency_key"),
        "{answer}"
    );
    probe.assert_unharmed("unstorable strings").await;
    nothing_written(&app, 0).await;
}

/// A body declared far past the route's limit is answered at once, not
/// waited for until the body timeout (hostile review).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_declared_far_too_large_is_refused_at_once() {
    let app = TestEnv::new().spawn().await;
    let request = format!(
        "POST /ids HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {}\r\nContent-Type: application/json\r\nContent-Length: 1000000000\r\n\r\n{{\"project\":",
        app.admin_key
    );
    // Waiting for the body, the server would answer after 30 s (408):
    // within 5 s, only an answer given at once arrives.
    let answer = raw_exchange(&app, request.as_bytes(), Duration::from_secs(5)).await;
    assert!(
        answer.starts_with("HTTP/1.1 413") && answer.contains("body_too_large"),
        "{answer}"
    );
    nothing_written(&app, 0).await;
}

/// `jsonb` prints a number in full: `1e131000` is 8 bytes sent and
/// 131,001 characters in every outbox read and delivery, so a small
/// document of such numbers stalled every tenant's deliveries (hostile
/// review). Metadata is bounded as it is printed, and nothing is taken
/// for a refused one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn numbers_printed_past_the_metadata_limit_are_refused_before_a_number_is_taken() {
    let app = TestEnv::new().spawn().await;
    let probe = Probe::start(&app);
    let many: Vec<String> = (0..9000).map(|i| format!(r#""k{i}": 1e131000"#)).collect();
    let refused = [
        (
            format!("{{{}}}", many.join(",")),
            StatusCode::PAYLOAD_TOO_LARGE,
            "metadata_too_large",
        ),
        (
            r#"{"n": [1e131000, 1e131000, 1e131000]}"#.to_owned(),
            StatusCode::PAYLOAD_TOO_LARGE,
            "metadata_too_large",
        ),
        (
            r#"{"n": 1e200000}"#.to_owned(),
            StatusCode::BAD_REQUEST,
            "unstorable_value",
        ),
        (
            r#"{"n": -1e-20000}"#.to_owned(),
            StatusCode::BAD_REQUEST,
            "unstorable_value",
        ),
        // A zero, but an exponent numeric refuses to read.
        (
            r#"{"a": 0e99999999999999999999}"#.to_owned(),
            StatusCode::BAD_REQUEST,
            "unstorable_value",
        ),
    ];
    for (metadata, status, code) in &refused {
        let body = format!(r#"{{"project":"BIG","type":"1","metadata":{metadata}}}"#);
        let single = app
            .client
            .post(app.url("/documents"))
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await
            .unwrap();
        assert_problem(single, *status, code).await;
        let good = r#"{"project":"BIG","type":"1","metadata":{}}"#;
        let batch = format!(
            r#"{{"documents":[{good},{good},{{"project":"BIG","type":"1","metadata":{metadata}}}]}}"#
        );
        let batch = app
            .client
            .post(app.url("/api/v1/documents/batch"))
            .header("content-type", "application/json")
            .body(batch)
            .send()
            .await
            .unwrap();
        let problem = assert_problem(batch, *status, code).await;
        assert_eq!(problem["index"], 2, "{problem}");
    }
    probe.assert_unharmed("numbers printed in full").await;
    nothing_written(&app, 0).await;
    // Within the limit as printed, numbers of any size are kept exactly.
    let kept = app
        .client
        .post(app.url("/documents"))
        .header("content-type", "application/json")
        .body(r#"{"project":"BIG","type":"1","metadata":{"n":1e100000,"d":0.10000000000000000000001}}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(kept.status(), StatusCode::ACCEPTED);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poisoned_request_fails_alone_when_it_shares_a_commit() {
    let app = TestEnv::new().spawn().await;
    // Valid JSON that Postgres' jsonb cannot hold: the edge knows it now,
    // so over HTTP it is refused before any number is taken.
    let poisoned = json!({"project": "PO", "type": "1", "metadata": {}})
        .to_string()
        .replace("{}", r#"{"n": 1e1000000}"#);
    let requests = (0..160).map(|i| {
        let app = &app;
        let poisoned = poisoned.clone();
        async move {
            let request = app
                .client
                .post(app.url("/documents"))
                .header("content-type", "application/json");
            let request = if i % 32 == 7 {
                request.body(poisoned)
            } else {
                request
                    .body(json!({"project": "PO", "type": "1", "metadata": {"i": i}}).to_string())
            };
            (i % 32 == 7, request.send().await.unwrap())
        }
    });
    let answers = futures::future::join_all(requests).await;
    let mut accepted = 0;
    for (poisoned, response) in answers {
        if poisoned {
            let problem =
                assert_problem(response, StatusCode::BAD_REQUEST, "unstorable_value").await;
            assert!(
                problem["detail"]
                    .as_str()
                    .is_some_and(|d| d.contains("1e1000000")),
                "{problem}"
            );
        } else {
            assert_eq!(response.status(), StatusCode::ACCEPTED);
            accepted += 1;
        }
    }
    assert_eq!(accepted, 155);
    assert_eq!(count(&app, "id_outbox").await, 155);
    let seqs: i64 = sqlx::query_scalar("SELECT max(seq_number) FROM id_outbox")
        .fetch_one(&app.db)
        .await
        .unwrap();
    assert_eq!(seqs, 155, "the refused requests took no number");

    // Through the library, past the edge: only the database knows, and a
    // poisoned document sharing a commit fails alone.
    let issuer = &app.state.documents;
    let documents = (0..160).map(|i| {
        let metadata = match i % 32 {
            7 => r#"{"n": 1e1000000}"#.to_owned(),
            9 => r#"{"a": "\u0000"}"#.to_owned(),
            _ => format!(r#"{{"lib": {i}}}"#),
        };
        let accepted = issuer.accept(Arc::new(idpool::features::documents::DocumentInput {
            project: idpool::domain::sequence::ProjectCode::parse("PO").unwrap(),
            doc_type: idpool::domain::sequence::TypeCode::parse("1").unwrap(),
            metadata: metadata.into(),
            id: None,
            source_id: None,
        }));
        async move { (matches!(i % 32, 7 | 9), accepted.await) }
    });
    for (poisoned, accepted) in futures::future::join_all(documents).await {
        assert_eq!(accepted.is_err(), poisoned, "{accepted:?}");
    }
    assert_eq!(count(&app, "id_outbox").await, 305);
    let split = app.metrics().await["idpool_ledger_writes_split_total"];
    assert!(split >= 1.0, "no poisoned document shared a commit");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_number_locked_by_a_hung_transaction_delays_only_its_own_request() {
    let app = TestEnv::new().spawn().await;
    app.issue("LK", "1", 1).await;
    let sequence_id: i64 =
        sqlx::query_scalar("SELECT id FROM sequences WHERE project = 'LK' AND doc_type = '1'")
            .fetch_one(&app.db)
            .await
            .unwrap();
    let redis = fred::prelude::Builder::from_config(
        fred::prelude::Config::from_url(&app.env.redis_url).unwrap(),
    )
    .build()
    .unwrap();
    fred::prelude::ClientLike::init(&redis).await.unwrap();
    let head: String =
        fred::prelude::ListInterface::lindex(&redis, app.redis_pool_key("LK", "1", ""), 0)
            .await
            .unwrap();
    let next: i64 = head.parse().unwrap();
    // Another transaction holds the next number and never finishes: the
    // request that meets it is refused (and says so in the log).
    crate::support::app::expect_error_lines("canceling statement due to lock timeout");
    let mut hung = app.db.begin().await.unwrap();
    sqlx::query(
        "INSERT INTO issuance_ledger (sequence_id, period, seqs, via) VALUES ($1, '', int8range($2, $3), 'ids')",
    )
    .bind(sequence_id)
    .bind(next)
    .bind(next + 1)
    .execute(&mut *hung)
    .await
    .unwrap();
    let requests = (0..20).map(|_| async {
        let started = Instant::now();
        let response = app.post_ids("LK", "1", 1).await;
        (started.elapsed(), response)
    });
    let answers = futures::future::join_all(requests).await;
    let mut served = Vec::new();
    let mut refused = 0;
    for (took, response) in answers {
        match response.status() {
            StatusCode::OK => {
                assert!(took < USUAL, "a request beside the hung one took {took:?}");
                let body: Value = response.json().await.unwrap();
                served.push(body["seqs"][0].as_i64().unwrap());
            }
            StatusCode::SERVICE_UNAVAILABLE => refused += 1,
            other => panic!("unexpected {other}"),
        }
    }
    assert_eq!(
        refused, 1,
        "only the request holding the locked number fails"
    );
    assert_eq!(served.len(), 19);
    assert!(!served.contains(&next), "the locked number was issued");
    hung.rollback().await.unwrap();
    app.issue("LK", "1", 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keyed_requests_for_new_sequences_are_served_while_redis_is_down() {
    let mut redis = RedisServer::start();
    let app = Arc::new(TestEnv::new().with_redis(&redis.url()).spawn().await);
    redis.kill();
    app.wait_for_mode("fallback", Duration::from_secs(5)).await;
    let started = Instant::now();
    let clients = (0..32).map(|client| {
        let app = app.clone();
        tokio::spawn(async move {
            let mut answers = Vec::new();
            for request in 0..5 {
                let response = app
                    .client
                    .post(app.url("/ids"))
                    .header("idempotency-key", format!("k-{client}-{request}"))
                    .json(&json!({"project": "NEW", "type": format!("t{client}_{request}")}))
                    .send()
                    .await
                    .unwrap();
                answers.push(response.status());
            }
            answers
        })
    });
    let all = tokio::time::timeout(Duration::from_secs(30), futures::future::join_all(clients))
        .await
        .expect("keyed requests answered within 30 s");
    let statuses: Vec<StatusCode> = all.into_iter().flat_map(|a| a.unwrap()).collect();
    assert_eq!(statuses.len(), 160);
    assert!(
        statuses.iter().all(|s| *s == StatusCode::OK),
        "{statuses:?}"
    );
    println!(
        "160 keyed requests without Redis in {:?}",
        started.elapsed()
    );
    let replay = app
        .client
        .post(app.url("/ids"))
        .header("idempotency-key", "k-3-4")
        .json(&json!({"project": "NEW", "type": "t3_4"}))
        .send()
        .await
        .unwrap();
    assert_eq!(replay.status(), StatusCode::OK);
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_that_never_finish_their_headers_are_cut_off() {
    let mut env = TestEnv::new();
    env.header_timeout_s = 2;
    let app = env.spawn().await;
    let probe = Probe::start(&app);
    let address = app.address.trim_start_matches("http://").to_owned();
    let started = Instant::now();
    let slow = (0..300).map(|_| {
        let address = address.clone();
        tokio::spawn(async move {
            let mut stream = TcpStream::connect(&address).await.ok()?;
            stream
                .write_all(b"POST /ids HTTP/1.1\r\nHost: x\r\n")
                .await
                .ok()?;
            // One byte a second, never the end of the headers.
            let mut buffer = [0u8; 512];
            for _ in 0..10 {
                if stream.write_all(b"X").await.is_err() {
                    return Some(started.elapsed());
                }
                match tokio::time::timeout(Duration::from_secs(1), stream.read(&mut buffer)).await {
                    Ok(Ok(0)) | Ok(Err(_)) => return Some(started.elapsed()),
                    _ => {}
                }
            }
            None
        })
    });
    let closed = futures::future::join_all(slow).await;
    probe.assert_unharmed("300 slow-header clients").await;
    let cut: Vec<Duration> = closed
        .into_iter()
        .filter_map(|c| c.ok().flatten())
        .collect();
    assert_eq!(cut.len(), 300, "some slow clients were never cut off");
    let latest = cut.iter().max().unwrap();
    assert!(
        *latest < Duration::from_secs(5),
        "cut off after {latest:?} with a 2 s header timeout"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_that_never_arrives_is_answered_408_and_the_connection_closed() {
    let mut env = TestEnv::new();
    env.request_timeout_s = 2;
    let app = env.spawn().await;
    let started = Instant::now();
    let answer = raw_exchange(
        &app,
        format!(
            "POST /documents HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {}\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{{\"proj",
            app.admin_key
        )
        .as_bytes(),
        Duration::from_secs(5),
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains("body_timeout"), "{answer}");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "the connection stayed open"
    );
    nothing_written(&app, 0).await;
}

/// Sends `request` on `stream`; its answer's first bytes, or `None` when
/// none came within `wait` (or the connection was closed).
async fn answer_on(stream: &mut TcpStream, request: &[u8], wait: Duration) -> Option<String> {
    stream.write_all(request).await.ok()?;
    let mut buffer = [0u8; 1024];
    match tokio::time::timeout(wait, stream.read(&mut buffer)).await {
        Ok(Ok(n)) if n > 0 => Some(String::from_utf8_lossy(&buffer[..n]).into_owned()),
        _ => None,
    }
}

/// Whether the server closed `stream` (a read sees the end at once).
async fn closed(stream: &mut TcpStream) -> bool {
    let mut buffer = [0u8; 64];
    matches!(
        tokio::time::timeout(Duration::from_millis(300), stream.read(&mut buffer)).await,
        Ok(Ok(0) | Err(_))
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_the_cap_a_new_client_takes_the_slot_of_the_keyless_connection_idle_longest() {
    let mut env = TestEnv::new();
    env.max_connections = 8;
    let app = env.spawn().await;
    let address = app.address.trim_start_matches("http://").to_owned();
    let keyed_request = format!(
        "GET /api/v1/sequences HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {}\r\n\r\n",
        app.admin_key
    );
    let mut keyed = TcpStream::connect(&address).await.unwrap();
    let first = answer_on(&mut keyed, keyed_request.as_bytes(), Duration::from_secs(2)).await;
    assert!(first.is_some_and(|a| a.starts_with("HTTP/1.1 200")));
    // A stranger opens twice the cap of keep-alive connections: each is
    // served at once, taking the slot of the keyless one idle longest.
    let mut stranger = Vec::new();
    for n in 0..16 {
        let mut stream = TcpStream::connect(&address).await.unwrap();
        let answer = answer_on(
            &mut stream,
            b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n",
            Duration::from_secs(2),
        )
        .await;
        assert!(
            answer.is_some_and(|a| a.starts_with("HTTP/1.1 200")),
            "connection {n} over a full instance was not served"
        );
        stranger.push(stream);
    }
    let mut open = 0;
    for stream in &mut stranger {
        if !closed(stream).await {
            open += 1;
        }
    }
    assert!(
        open < 8,
        "{open} of the stranger's connections still open with a cap of 8"
    );
    assert!(
        closed(&mut stranger[0]).await,
        "the oldest was closed first"
    );
    // The tenant's connection, idle longer than any of them, still serves.
    let again = answer_on(&mut keyed, keyed_request.as_bytes(), Duration::from_secs(2)).await;
    assert!(
        again.is_some_and(|a| a.starts_with("HTTP/1.1 200")),
        "the keyed connection was closed for a stranger's"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_beyond_the_cap_wait_while_every_one_is_serving() {
    let mut env = TestEnv::new();
    env.max_connections = 4;
    let app = env.spawn().await;
    // Four keys, each with one request whose body is still coming: every
    // slot is busy, and none of them holds more than its share.
    let mut busy = Vec::new();
    for _ in 0..4 {
        let key = create_key(&app.state, &[], true).await;
        busy.push(slow_body(&app, &key).await);
    }
    let address = app.address.trim_start_matches("http://").to_owned();
    let mut waiting = TcpStream::connect(&address).await.unwrap();
    let health = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n";
    assert_eq!(
        answer_on(&mut waiting, health, Duration::from_millis(800)).await,
        None,
        "a connection over the cap was served while every slot was busy"
    );
    drop(busy.pop());
    let mut buffer = [0u8; 256];
    let n = tokio::time::timeout(Duration::from_secs(3), waiting.read(&mut buffer))
        .await
        .expect("served once a busy one ended")
        .unwrap();
    assert!(String::from_utf8_lossy(&buffer[..n]).starts_with("HTTP/1.1 200"));
}

/// A connection whose `POST /documents` under `key` has begun (the server
/// asked for the body) and whose body is still coming.
async fn slow_body(app: &TestApp, key: &str) -> TcpStream {
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_key_sending_slow_bodies_on_every_slot_keeps_no_one_out() {
    let mut env = TestEnv::new();
    env.max_connections = 4;
    let app = env.spawn().await;
    let hog = create_key(&app.state, &[], true).await;
    let mut held = Vec::new();
    for _ in 0..4 {
        held.push(slow_body(&app, &hog).await);
    }
    // Another tenant's request on a new connection is served at once: a
    // connection of the key holding every slot gives its place up.
    let other = create_key(&app.state, &["OTHER"], false).await;
    let served = tokio::time::timeout(
        Duration::from_secs(5),
        app.client
            .post(app.url("/ids"))
            .bearer_auth(&other)
            .json(&json!({"project": "OTHER", "type": "1"}))
            .send(),
    )
    .await
    .expect("served while one key held every slot")
    .unwrap();
    assert_eq!(served.status(), StatusCode::OK);
    // One of the hog's requests was cut before its body arrived: nothing
    // of it was written.
    let mut cut = 0;
    for stream in &mut held {
        let mut buffer = [0u8; 256];
        // Closed (end of stream or reset), or answered and closed; a
        // connection still waiting for its body says nothing.
        match tokio::time::timeout(Duration::from_millis(200), stream.read(&mut buffer)).await {
            Ok(Ok(_)) | Ok(Err(_)) => cut += 1,
            Err(_) => {}
        }
    }
    assert!(
        cut >= 1,
        "no connection of the key holding every slot was closed"
    );
    assert_eq!(app.outbox_count(None).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lowering_max_takes_the_numbers_past_it_out_of_the_pool() {
    let app = TestEnv::new().spawn().await;
    let created = app.put_sequence("MX", "1", json!({"pool_size": 100})).await;
    assert_eq!(created.status(), StatusCode::CREATED);
    app.issue("MX", "1", 1).await;
    let lowered = app
        .put_sequence("MX", "1", json!({"pool_size": 100, "max": 10}))
        .await;
    assert_eq!(lowered.status(), StatusCode::OK);
    let redis = fred::prelude::Builder::from_config(
        fred::prelude::Config::from_url(&app.env.redis_url).unwrap(),
    )
    .build()
    .unwrap();
    fred::prelude::ClientLike::init(&redis).await.unwrap();
    let pool: Vec<String> =
        fred::prelude::ListInterface::lrange(&redis, app.redis_pool_key("MX", "1", ""), 0, -1)
            .await
            .unwrap();
    assert!(
        pool.iter().all(|n| n.parse::<i64>().unwrap() <= 10),
        "{pool:?}"
    );
    let discarded: i64 = sqlx::query_scalar(
        "SELECT coalesce(sum(upper(seqs) - lower(seqs)), 0)::bigint FROM pool_discards WHERE cause = 'above_max'",
    )
    .fetch_one(&app.db)
    .await
    .unwrap();
    assert!(discarded > 0, "the trimmed numbers were recorded");
    let (_, seqs) = app.issue("MX", "1", 9).await;
    assert_eq!(*seqs.last().unwrap(), 10);
    let past = app.post_ids("MX", "1", 1).await;
    assert_problem(past, StatusCode::CONFLICT, "sequence_exhausted").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_project_holds_at_most_its_limit_of_sequences() {
    let mut env = TestEnv::new();
    env.max_sequences_per_project = 3;
    let app = env.spawn().await;
    for doc_type in ["A", "B", "C"] {
        app.issue("LIM", doc_type, 1).await;
    }
    let fourth = app.post_ids("LIM", "D", 1).await;
    assert_problem(fourth, StatusCode::CONFLICT, "sequence_limit_reached").await;
    let defined = app.put_sequence("LIM", "E", json!({})).await;
    assert_problem(defined, StatusCode::CONFLICT, "sequence_limit_reached").await;
    // Existing sequences go on; other projects have their own room.
    app.issue("LIM", "A", 1).await;
    app.issue("OTHER", "D", 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_refused_for_want_of_room_creates_none_of_its_sequences() {
    let mut env = TestEnv::new();
    env.max_sequences_per_project = 3;
    let app = env.spawn().await;
    app.issue("ROOM", "A", 1).await;
    let item = |doc_type: &str| json!({"project": "ROOM", "type": doc_type, "metadata": {}});
    let refused = app
        .post_batch(vec![item("A"), item("B"), item("C"), item("D"), item("E")])
        .await;
    let problem = assert_problem(refused, StatusCode::CONFLICT, "sequence_limit_reached").await;
    assert_eq!(problem["index"], 3, "the first item past the room is named");
    let types = async || -> Vec<String> {
        sqlx::query_scalar(
            "SELECT doc_type FROM sequences WHERE project = 'ROOM' ORDER BY doc_type",
        )
        .fetch_all(&app.db)
        .await
        .unwrap()
    };
    assert_eq!(
        types().await,
        vec!["A"],
        "the refused batch left no sequence behind"
    );
    assert_eq!(count(&app, "id_outbox").await, 0);
    // Room for two more: a batch within it is taken whole.
    let taken = app.post_batch(vec![item("B"), item("C"), item("A")]).await;
    assert_eq!(taken.status(), StatusCode::ACCEPTED);
    assert_eq!(types().await, vec!["A", "B", "C"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_id_over_the_limit_is_never_issued_even_from_an_old_definition() {
    let app = TestEnv::new().spawn().await;
    // A definition stored before the checks existed.
    sqlx::query(
        "INSERT INTO sequences (project, doc_type, format, layout, start_seq, reset, timezone, pool_size, refill_at) \
         VALUES ('OLD', '1', $1, 'text', 1, 'never', 'UTC', 1000, 0.75)",
    )
    .bind(format!("{}{{seq}}", "x".repeat(60)))
    .execute(&app.db)
    .await
    .unwrap();
    let response = app.post_ids("OLD", "1", 1).await;
    assert_problem(response, StatusCode::CONFLICT, "id_too_long").await;
    assert_eq!(count(&app, "issuance_ledger").await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_bounds_every_statement_lock_wait_and_idle_transaction() {
    let app = TestEnv::new().spawn().await;
    let mut conn = app.state.db.acquire().await.unwrap();
    let mut show = async |setting: &'static str| -> String {
        sqlx::query_scalar(sqlx::AssertSqlSafe(format!("SHOW {setting}")))
            .fetch_one(&mut conn)
            .await
            .unwrap()
    };
    assert_eq!(show("statement_timeout").await, "10s");
    assert_eq!(show("lock_timeout").await, "2s");
    assert_eq!(show("idle_in_transaction_session_timeout").await, "35s");
}

/// A webhook receiver with three doors: one that takes deliveries, one that
/// redirects to it, one that answers 500 with an endless-looking body.
async fn receiver() -> (
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
async fn deliver_through(address: &str, door: &str) -> (String, Value) {
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn webhook_deliveries_are_signed_never_redirected_and_never_name_the_secret_url() {
    let (address, received) = receiver().await;

    let (id, document) = deliver_through(&address, "hook").await;
    assert_eq!(document["status"], "committed", "{document}");
    let (headers, body) = received.lock().unwrap()[0].clone();
    let header = |name: &str| headers[name].to_str().unwrap().to_owned();
    assert_eq!(header("webhook-id"), id);
    let timestamp: i64 = header("webhook-timestamp").parse().unwrap();
    assert!((chrono::Utc::now().timestamp() - timestamp).abs() < 60);
    let key =
        idpool::features::documents::sink::signing_key(crate::support::app::TEST_WEBHOOK_SECRET)
            .unwrap();
    assert_eq!(
        header("webhook-signature"),
        idpool::features::documents::sink::signature(&key, &id, timestamp, &body),
        "the signature covers id, timestamp and the exact body"
    );

    for (door, says) in [
        ("moved", "redirects are not followed"),
        ("huge", "HTTP 500"),
    ] {
        let (_, document) = deliver_through(&address, door).await;
        assert_eq!(document["status"], "dead_letter", "{document}");
        let error = document["last_error"].as_str().unwrap();
        assert!(error.contains(says), "{error}");
        assert!(error.len() < 400, "{} bytes of error", error.len());
        for secret in ["s3cret", "token", "pw", "user"] {
            assert!(!error.contains(secret), "{error} shows {secret}");
        }
    }
    assert_eq!(
        received.lock().unwrap().len(),
        1,
        "the redirect was not followed"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_number_two_requests_of_one_shared_write_hold_is_recorded_for_one() {
    use idpool::records::ledger::Via;
    use idpool::records::ledger::outbox_rows::OutboxRow;
    use idpool::records::ledger::{LedgerWrite, write_shared};
    let app = TestEnv::new().spawn().await;
    app.issue("LG", "1", 1).await;
    let sequence_id: i64 =
        sqlx::query_scalar("SELECT id FROM sequences WHERE project = 'LG' AND doc_type = '1'")
            .fetch_one(&app.db)
            .await
            .unwrap();
    // A stale list handed number 5000 to an ID request and a document at once.
    let writes = [
        LedgerWrite {
            sequence_id,
            period: String::new(),
            seqs: vec![5000],
            via: Via::Ids,
            documents: vec![],
            unnumbered: vec![],
        },
        LedgerWrite {
            sequence_id,
            period: String::new(),
            seqs: vec![5000],
            via: Via::Document,
            documents: vec![OutboxRow {
                seq: 5000,
                document_id: "LG-1-5000".into(),
                project: "LG".into(),
                doc_type: "1".into(),
                seq_number: 5000,
                payload: "{}".into(),
                source_id: None,
            }],
            unnumbered: vec![],
        },
    ];
    let mut conn = app.state.db.acquire().await.unwrap();
    let numberings = std::sync::Mutex::new(Vec::new());
    let outcomes = write_shared(
        &mut conn,
        &app.state.stats,
        app.state.pools.counter(),
        &writes,
        &numberings,
    )
    .await;
    let first = outcomes[0].as_ref().unwrap();
    let second = outcomes[1].as_ref().unwrap();
    assert!(first.refused.is_empty(), "{first:?}");
    assert_eq!(second.refused, vec![5000], "the second holder is refused");
    assert!(second.documents.is_empty(), "its document was not written");
    let holders: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM issuance_ledger WHERE sequence_id = $1 AND seqs @> 5000::bigint",
    )
    .bind(sequence_id)
    .fetch_one(&app.db)
    .await
    .unwrap();
    assert_eq!(holders, 1);
    assert_eq!(count(&app, "id_outbox").await, 0);
}
