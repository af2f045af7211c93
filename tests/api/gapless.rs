//! Gapless sequences (SPEC "Gapless sequences", promise 9): every number
//! from the start to the last one issued is a committed document or a
//! recorded void.

use crate::support::probes::assert_slowdown_within;
use std::sync::Arc;
use std::time::{Duration, Instant};

use reqwest::StatusCode;
use serde_json::{Value, json};

use crate::support::app::{TestApp, TestEnv, assert_problem, create_key};

async fn gapless(app: &TestApp, project: &str, doc_type: &str, extra: Value) -> Value {
    let mut body = json!({"numbering": "gapless", "format": "{project}-{type}-{seq:4}"});
    if let (Some(body), Some(extra)) = (body.as_object_mut(), extra.as_object()) {
        body.extend(extra.clone());
    }
    app.define(project, doc_type, body).await
}

/// The numbers of the sequence's documents, ascending.
async fn document_numbers(app: &TestApp, project: &str, doc_type: &str) -> Vec<i64> {
    sqlx::query_scalar(
        "SELECT seq_number FROM id_outbox WHERE tenant_code = $1 AND entity_type_id = $2 \
         ORDER BY seq_number",
    )
    .bind(project)
    .bind(doc_type)
    .fetch_all(&app.db)
    .await
    .expect("document numbers")
}

async fn void(app: &TestApp, key: Option<&str>, body: Value) -> reqwest::Response {
    let mut request = app.client.post(app.url("/api/v1/ids/void")).json(&body);
    if let Some(key) = key {
        request = request.bearer_auth(key);
    }
    request.send().await.expect("void")
}

fn accepted_id(body: &Value) -> String {
    body["id"].as_str().expect("id").to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_writers_on_two_instances_leave_exactly_start_to_n() {
    let env = TestEnv::new();
    let apps = Arc::new([env.spawn().await, env.spawn().await]);
    gapless(&apps[0], "GL", "1", json!({})).await;
    let mut tasks = Vec::new();
    for writer in 0..16usize {
        let apps = apps.clone();
        tasks.push(tokio::spawn(async move {
            let app = &apps[writer % 2];
            let mut accepted = 0;
            for i in 0..40 {
                let response = match i % 4 {
                    // Single documents, through the shared commit. The
                    // gapless stage skips a counter that keyed requests
                    // and batches keep held (a queue of them on one
                    // counter can hold it past the stage's 2 s of
                    // tries on a loaded machine): that is the documented
                    // 503 `unavailable` with Retry-After, which writes
                    // nothing (the numbers below stay exactly 1..=n), and
                    // a client tries again after it, here at most 4 times.
                    0 | 1 => {
                        let body = json!({"project": "GL", "type": "1", "metadata": {"w": writer}});
                        let mut tries = 1;
                        loop {
                            let response = app.post_document(&body, None).await;
                            if response.status() != StatusCode::SERVICE_UNAVAILABLE || tries == 5 {
                                break response;
                            }
                            let retry_after: u64 = response.headers()["retry-after"]
                                .to_str()
                                .unwrap()
                                .parse()
                                .unwrap();
                            let problem: Value = response.json().await.unwrap();
                            assert_eq!(problem["code"], "unavailable", "{problem}");
                            tries += 1;
                            // A real delay is the point: the client honours Retry-After.
                            tokio::time::sleep(std::time::Duration::from_secs(retry_after)).await;
                        }
                    }
                    // Keyed: in a transaction of its own.
                    2 => {
                        let body = json!({"project": "GL", "type": "1", "metadata": {"i": i}});
                        app.post_document(&body, Some(&format!("k-{writer}-{i}")))
                            .await
                    }
                    // A batch of three.
                    _ => {
                        let doc = json!({"project": "GL", "type": "1", "metadata": {}});
                        app.post_batch(vec![doc.clone(), doc.clone(), doc]).await
                    }
                };
                let status = response.status();
                assert_eq!(
                    status,
                    StatusCode::ACCEPTED,
                    "{}",
                    response.text().await.unwrap()
                );
                accepted += if i % 4 == 3 { 3 } else { 1 };
            }
            accepted
        }));
    }
    let mut accepted = 0;
    for task in tasks {
        accepted += task.await.unwrap();
    }
    let numbers = document_numbers(&apps[0], "GL", "1").await;
    assert_eq!(
        numbers,
        (1..=accepted).collect::<Vec<i64>>(),
        "not exactly 1..={accepted}"
    );
    // No pool, no lease, no ledger rows: Postgres alone.
    let ledger: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM issuance_ledger l JOIN sequences s ON s.id = l.sequence_id \
         WHERE s.project = 'GL'",
    )
    .fetch_one(&apps[0].db)
    .await
    .unwrap();
    assert_eq!(ledger, 0);
    let summary = apps[1].reconcile().await;
    assert_eq!(summary["gapless_violations"], 0, "{summary}");
    assert!(apps[0].gaps("GL", "1").await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_that_fails_takes_no_number() {
    let app = TestEnv::new().spawn().await;
    gapless(&app, "GF", "1", json!({})).await;
    let doc =
        |source: &str| json!({"project": "GF", "type": "1", "metadata": {}, "source_id": source});
    let first = app.post_batch(vec![doc("a"), doc("b")]).await;
    assert_eq!(first.status(), StatusCode::ACCEPTED);
    // An item refused in the middle of a batch: nothing of it is written,
    // and its numbers go to the next writer.
    let refused = app
        .post_batch(vec![
            doc("c"),
            json!({"project": "GF", "type": "1", "metadata": []}),
        ])
        .await;
    assert_eq!(refused.status(), StatusCode::BAD_REQUEST);
    let again = app
        .post_document(&json!({"project": "GF", "type": "1", "metadata": {}}), None)
        .await;
    assert_eq!(again.status(), StatusCode::ACCEPTED);
    let body: Value = again.json().await.unwrap();
    assert_eq!(body["id"], "GF-1-0003");
    assert_eq!(document_numbers(&app, "GF", "1").await, [1, 2, 3]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reservation_is_confirmed_by_its_document_or_voided_with_its_reason() {
    let app = TestEnv::new().spawn().await;
    gapless(&app, "GR", "1", json!({})).await;
    let before = chrono::Utc::now();
    let response = app.post_ids("GR", "1", 3).await;
    assert_eq!(response.status(), StatusCode::OK);
    let reserved: Value = response.json().await.unwrap();
    assert_eq!(
        reserved["ids"],
        json!(["GR-1-0001", "GR-1-0002", "GR-1-0003"])
    );
    let until: chrono::DateTime<chrono::Utc> = reserved["reserved_until"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    let ttl = until - before;
    assert!(
        ttl > chrono::Duration::seconds(290) && ttl <= chrono::Duration::seconds(301),
        "reserved for {ttl}"
    );
    // Confirm the first.
    let attach = json!({"project": "GR", "type": "1", "metadata": {}, "id": "GR-1-0001"});
    let attached = app.post_document(&attach, None).await;
    assert_eq!(attached.status(), StatusCode::ACCEPTED);
    assert_eq!(accepted_id(&attached.json().await.unwrap()), "GR-1-0001");
    // Void the second; again answers the first void.
    let body =
        json!({"project": "GR", "type": "1", "id": "GR-1-0002", "reason": "order cancelled"});
    let voided = void(&app, None, body.clone()).await;
    assert_eq!(voided.status(), StatusCode::OK);
    let voided: Value = voided.json().await.unwrap();
    assert_eq!(voided["status"], "voided");
    assert_eq!(voided["reason"], "order cancelled");
    assert_eq!(voided["id"], "GR-1-0002");
    let mut again = body.clone();
    again["reason"] = json!("said twice");
    let twice: Value = void(&app, None, again).await.json().await.unwrap();
    assert_eq!(
        (twice["reason"].clone(), twice["voided_at"].clone()),
        (json!("order cancelled"), voided["voided_at"].clone())
    );
    // A voided number is not attached, an attached one not voided.
    let late = json!({"project": "GR", "type": "1", "metadata": {}, "id": "GR-1-0002"});
    assert_problem(
        app.post_document(&late, None).await,
        StatusCode::CONFLICT,
        "id_not_attachable",
    )
    .await;
    let attached_void = json!({"project": "GR", "type": "1", "id": "GR-1-0001", "reason": "x"});
    assert_problem(
        void(&app, None, attached_void).await,
        StatusCode::CONFLICT,
        "id_attached",
    )
    .await;
    let unknown = json!({"project": "GR", "type": "1", "id": "GR-1-0099", "reason": "x"});
    assert_problem(
        void(&app, None, unknown).await,
        StatusCode::NOT_FOUND,
        "id_not_found",
    )
    .await;
    // A document written without a reservation is attached too.
    let direct = app
        .post_document(&json!({"project": "GR", "type": "1", "metadata": {}}), None)
        .await;
    let direct_id = accepted_id(&direct.json().await.unwrap());
    assert_eq!(direct_id, "GR-1-0004");
    let direct_void = json!({"project": "GR", "type": "1", "id": direct_id, "reason": "x"});
    assert_problem(
        void(&app, None, direct_void).await,
        StatusCode::CONFLICT,
        "id_attached",
    )
    .await;
    // The gaps are the voids, with the caller's note.
    let gaps = app.gaps("GR", "1").await;
    assert_eq!(gaps.len(), 1, "{gaps:?}");
    assert_eq!(gaps[0]["reason"], "voided");
    assert_eq!(gaps[0]["note"], "order cancelled");
    assert_eq!(gaps[0]["from_id"], "GR-1-0002");
    // 0003 is still reserved: neither a gap nor a violation.
    let summary = app.reconcile().await;
    assert_eq!(summary["gapless_violations"], 0, "{summary}");
    // The live figures count documents, reservations and voids.
    let live = app.ok_json("/api/v1/sequences/GR/1").await["live"].clone();
    assert_eq!(
        (live["last_issued_id"].clone(), live["gaps"].clone()),
        (json!("GR-1-0004"), json!(1)),
        "{live}"
    );
}

/// A void reads its sequence's definition before its transaction: read
/// inside it, with the definition no longer cached, each void held a
/// connection while the read waited for another, and a few at once took
/// the whole pool until every void answered 503 (hostile review).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn voids_of_a_sequence_no_longer_cached_do_not_starve_the_pool() {
    let mut env = TestEnv::new();
    // The smallest pool there is: two connections for requests.
    env.db_pool_size = 10;
    let app = env.spawn().await;
    gapless(&app, "GV", "1", json!({})).await;
    let mut keys = Vec::new();
    for _ in 0..4 {
        keys.push(create_key(&app.state, &["GV"], false).await);
    }
    let reserved: Value = app.post_ids("GV", "1", 40).await.json().await.unwrap();
    let ids: Vec<String> = reserved["ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|id| id.as_str().unwrap().to_owned())
        .collect();
    assert_eq!(ids.len(), 40);
    for round in ids.chunks(10) {
        let sequence = app.state.sequences.get("GV", "1").await.unwrap().unwrap();
        app.state.sequences.forget(&sequence).await;
        let voids = round.iter().enumerate().map(|(i, id)| {
            let body = json!({"project": "GV", "type": "1", "id": id, "reason": "cancelled"});
            void(&app, Some(keys[i % keys.len()].as_str()), body)
        });
        for response in futures::future::join_all(voids).await {
            assert_eq!(response.status(), StatusCode::OK);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reservation_past_its_deadline_is_voided_once_and_cannot_be_attached() {
    let mut env = TestEnv::new();
    env.reservation_ttl_s = 1;
    let apps = [env.spawn().await, env.spawn().await];
    gapless(&apps[0], "GE", "1", json!({})).await;
    let (ids, _) = apps[0].issue("GE", "1", 2).await;
    let gaps = crate::support::app::eventually(
        Duration::from_secs(10),
        "both reservations expire",
        async || {
            let gaps = apps[1].gaps("GE", "1").await;
            (gaps.len() == 2).then_some(gaps)
        },
    )
    .await;
    for (gap, id) in gaps.iter().zip(&ids) {
        assert_eq!(gap["reason"], "reservation_expired");
        assert_eq!(&gap["from_id"], id);
        assert!(gap.get("note").is_none(), "{gap}");
    }
    // Exactly once: two instances swept, each reservation counted once.
    let mut expired = 0.0;
    for app in &apps {
        expired += app
            .metrics()
            .await
            .get("idpool_reservations_expired_total")
            .copied()
            .unwrap_or(0.0);
    }
    assert_eq!(expired, 2.0);
    let attach = json!({"project": "GE", "type": "1", "metadata": {}, "id": ids[0]});
    assert_problem(
        apps[0].post_document(&attach, None).await,
        StatusCode::CONFLICT,
        "id_not_attachable",
    )
    .await;
    let void_late = json!({"project": "GE", "type": "1", "id": ids[1], "reason": "too late"});
    let answer: Value = void(&apps[0], None, void_late).await.json().await.unwrap();
    assert_eq!(answer["reason"], "reservation_expired");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_voids_get_their_problems_and_change_nothing() {
    let app = TestEnv::new().spawn().await;
    gapless(&app, "GH", "1", json!({})).await;
    gapless(&app, "GO", "1", json!({})).await;
    let (ids, _) = app.issue("GH", "1", 1).await;
    let (other_ids, _) = app.issue("GO", "1", 1).await;
    let cases = [
        (
            json!({"project": "GH", "type": "1", "id": ids[0], "reason": "a\u{0}b"}),
            StatusCode::BAD_REQUEST,
            "invalid_character",
        ),
        (
            json!({"project": "GH", "type": "1", "id": ids[0], "reason": "line\nbreak"}),
            StatusCode::BAD_REQUEST,
            "invalid_reason",
        ),
        (
            json!({"project": "GH", "type": "1", "id": ids[0], "reason": "x".repeat(10_000)}),
            StatusCode::BAD_REQUEST,
            "invalid_reason",
        ),
        (
            json!({"project": "GH", "type": "1", "id": ids[0], "reason": ""}),
            StatusCode::BAD_REQUEST,
            "invalid_reason",
        ),
        // Reasons an auditor could not read as written.
        (
            json!({"project": "GH", "type": "1", "id": ids[0], "reason": " \u{3000}\t "}),
            StatusCode::BAD_REQUEST,
            "invalid_reason",
        ),
        (
            json!({"project": "GH", "type": "1", "id": ids[0], "reason": "\u{200B}"}),
            StatusCode::BAD_REQUEST,
            "invalid_reason",
        ),
        (
            json!({"project": "GH", "type": "1", "id": ids[0], "reason": "paid \u{202E}001$"}),
            StatusCode::BAD_REQUEST,
            "invalid_reason",
        ),
        (
            json!({"project": "GH", "type": "1", "id": "GH-1-\u{7}", "reason": "x"}),
            StatusCode::BAD_REQUEST,
            "invalid_id",
        ),
        (
            json!({"project": "GH", "type": "1", "id": "x".repeat(65), "reason": "x"}),
            StatusCode::BAD_REQUEST,
            "invalid_id",
        ),
        (
            json!({"project": "GH", "type": "1", "id": ids[0]}),
            StatusCode::BAD_REQUEST,
            "invalid_body",
        ),
        (
            json!({"project": "G-H", "type": "1", "id": ids[0], "reason": "x"}),
            StatusCode::BAD_REQUEST,
            "invalid_project",
        ),
        // Another sequence's reservation, named under this one.
        (
            json!({"project": "GH", "type": "1", "id": other_ids[0], "reason": "x"}),
            StatusCode::NOT_FOUND,
            "id_not_found",
        ),
    ];
    for (body, status, code) in cases {
        assert_problem(void(&app, None, body).await, status, code).await;
    }
    // A key of another project: its reservation does not exist for it.
    let stranger = create_key(&app.state, &["GO"], false).await;
    let theirs = json!({"project": "GH", "type": "1", "id": ids[0], "reason": "x"});
    assert_problem(
        void(&app, Some(&stranger), theirs).await,
        StatusCode::NOT_FOUND,
        "project_not_found",
    )
    .await;
    let voided: i64 =
        sqlx::query_scalar("SELECT count(*) FROM gapless_reservations WHERE status <> 'reserved'")
            .fetch_one(&app.db)
            .await
            .unwrap();
    assert_eq!(voided, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn numbering_cannot_change_once_numbers_were_taken() {
    let app = TestEnv::new().spawn().await;
    gapless(&app, "GN", "1", json!({})).await;
    app.issue("GN", "1", 1).await;
    let back = app
        .put_sequence(
            "GN",
            "1",
            json!({"numbering": "pooled", "force": true, "format": "{project}-{type}-{seq:4}"}),
        )
        .await;
    assert_problem(back, StatusCode::CONFLICT, "sequence_in_use").await;
    app.issue("GP", "1", 1).await;
    let to_gapless = app
        .put_sequence("GP", "1", json!({"numbering": "gapless", "force": true}))
        .await;
    assert_problem(to_gapless, StatusCode::CONFLICT, "sequence_in_use").await;
    // Nor its numbering rules: each would leave holes or strand open
    // reservations.
    for change in [
        json!({"numbering": "gapless", "force": true, "reset": "daily", "format": "{project}-{type}-{date:%Y%m%d}-{seq:4}"}),
        json!({"numbering": "gapless", "force": true, "format": "{project}/{type}/{seq:5}"}),
        json!({"numbering": "gapless", "force": true, "format": "{project}-{type}-{seq:4}", "start": 0}),
        json!({"numbering": "gapless", "force": true, "format": "{project}-{type}-{seq:4}", "timezone": "Europe/Berlin"}),
    ] {
        let refused = app.put_sequence("GN", "1", change).await;
        assert_problem(refused, StatusCode::CONFLICT, "sequence_in_use").await;
    }
    let view = app.ok_json("/api/v1/sequences/GN/1").await;
    assert_eq!(view["numbering"], "gapless");
    assert_eq!(view["format"], "{project}-{type}-{seq:4}");
    let (ids, _) = app.issue("GN", "1", 1).await;
    assert_eq!(ids, vec!["GN-1-0002".to_owned()]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_redis_gone_gapless_documents_and_reservations_carry_on() {
    let mut redis = crate::support::redis_server::RedisServer::start();
    let app = TestEnv::new().with_redis(&redis.url()).spawn().await;
    gapless(&app, "GD", "1", json!({})).await;
    let doc = json!({"project": "GD", "type": "1", "metadata": {}});
    assert_eq!(
        app.post_document(&doc, None).await.status(),
        StatusCode::ACCEPTED
    );
    redis.kill();
    // Postgres alone: the same answers, no fallback, no hole.
    for _ in 0..5 {
        let response = app.post_document(&doc, None).await;
        assert_eq!(
            response.status(),
            StatusCode::ACCEPTED,
            "{}",
            response.text().await.unwrap()
        );
    }
    let (ids, _) = app.issue("GD", "1", 2).await;
    assert_eq!(ids, ["GD-1-0007", "GD-1-0008"]);
    let batch = app.post_batch(vec![doc.clone(), doc.clone()]).await;
    assert_eq!(batch.status(), StatusCode::ACCEPTED);
    assert_eq!(
        document_numbers(&app, "GD", "1").await,
        [1, 2, 3, 4, 5, 6, 9, 10]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_daily_gapless_sequence_starts_again_at_one_after_midnight_in_its_time_zone() {
    use chrono::TimeZone;
    use idpool::domain::clock::ManualClock;
    // 23:59:59 in Berlin (UTC+1 in November).
    let before = chrono::Utc
        .with_ymd_and_hms(2026, 11, 25, 22, 59, 59)
        .unwrap();
    let clock = Arc::new(ManualClock::new(before));
    let app = TestEnv::new().spawn_with_clock(clock.clone()).await;
    gapless(
        &app,
        "GM",
        "1",
        json!({"reset": "daily", "timezone": "Europe/Berlin", "format": "{project}-{date:%Y%m%d}-{seq:4}"}),
    )
    .await;
    let doc = json!({"project": "GM", "type": "1", "metadata": {}});
    let mut ids = Vec::new();
    for _ in 0..2 {
        let response = app.post_document(&doc, None).await;
        ids.push(accepted_id(&response.json().await.unwrap()));
    }
    let (reserved, _) = app.issue("GM", "1", 1).await;
    clock.advance(chrono::Duration::seconds(2));
    for _ in 0..2 {
        let response = app.post_document(&doc, None).await;
        ids.push(accepted_id(&response.json().await.unwrap()));
    }
    assert_eq!(
        ids,
        [
            "GM-20261125-0001",
            "GM-20261125-0002",
            "GM-20261126-0001",
            "GM-20261126-0002"
        ]
    );
    assert_eq!(reserved, ["GM-20261125-0003"]);
    // The reservation of the day before is still attached to its own day.
    let attach = json!({"project": "GM", "type": "1", "metadata": {}, "id": reserved[0]});
    assert_eq!(
        app.post_document(&attach, None).await.status(),
        StatusCode::ACCEPTED
    );
    let summary = app.reconcile().await;
    assert_eq!(summary["gapless_violations"], 0, "{summary}");
}

/// Writers on two instances while one instance is SIGKILLed, Redis is
/// killed and Postgres crashes (`-m immediate`) and comes back: the
/// sequence's documents are exactly 1..N, and every document answered 202
/// is among them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_instance_lost_redis_and_crashed_postgres_leave_no_hole_and_lose_nothing_acknowledged()
 {
    use crate::support::app::{ServeProcess, client_with_key};
    use crate::support::topology::{PostgresServer, postgres_dir};
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicBool, Ordering};

    let dir = postgres_dir();
    let mut postgres = PostgresServer::primary(dir.path());
    let mut redis = crate::support::redis_server::RedisServer::start();
    let mut env = TestEnv::new().with_redis(&redis.url());
    env.database_url = postgres.url("idpool_gapless_chaos");
    env.auth = false;
    env.request_timeout_s = 2;
    let mut first = ServeProcess::start(&env).await;
    let second = ServeProcess::start(&env).await;
    let client = client_with_key(None);
    let url = |port: u16, path: &str| format!("http://127.0.0.1:{port}{path}");
    let defined = client
        .put(url(second.port, "/api/v1/sequences/GC/1"))
        .json(&json!({"numbering": "gapless", "register": "chain", "format": "{project}-{type}-{seq:6}"}))
        .send()
        .await
        .unwrap();
    assert_eq!(defined.status(), StatusCode::CREATED);

    let acknowledged = Arc::new(Mutex::new(Vec::<String>::new()));
    let stop = Arc::new(AtomicBool::new(false));
    let mut writers = Vec::new();
    for writer in 0..8usize {
        let (acknowledged, stop, client) = (acknowledged.clone(), stop.clone(), client.clone());
        let ports = [first.port, second.port];
        writers.push(tokio::spawn(async move {
            let doc = json!({"project": "GC", "type": "1", "metadata": {"w": writer}});
            let mut i = 0usize;
            while !stop.load(Ordering::Relaxed) {
                i += 1;
                let port = ports[(writer + i) % 2];
                let request = if i.is_multiple_of(4) {
                    client
                        .post(url(port, "/api/v1/documents/batch"))
                        .json(&json!({"documents": [doc.clone(), doc.clone()]}))
                } else {
                    client.post(url(port, "/documents")).json(&doc)
                };
                let Ok(Ok(response)) =
                    tokio::time::timeout(Duration::from_secs(5), request.send()).await
                else {
                    continue;
                };
                if response.status() != StatusCode::ACCEPTED {
                    continue;
                }
                let Ok(body) = response.json::<Value>().await else {
                    continue;
                };
                let ids: Vec<String> = match body["documents"].as_array() {
                    Some(documents) => documents.iter().map(accepted_id).collect(),
                    None => vec![accepted_id(&body)],
                };
                acknowledged.lock().unwrap().extend(ids);
            }
        }));
    }
    let count = || acknowledged.lock().unwrap().len();
    let wait_for_more = async |more: usize, what: &str| {
        let target = count() + more;
        let what = format!("{more} documents acknowledged {what}");
        crate::support::app::eventually(Duration::from_secs(60), &what, async || {
            (count() >= target).then_some(())
        })
        .await;
    };
    wait_for_more(200, "at first").await;
    first.kill();
    wait_for_more(200, "after an instance was killed").await;
    redis.kill();
    wait_for_more(200, "after Redis was killed").await;
    postgres.stop("immediate");
    postgres.start();
    wait_for_more(200, "after Postgres crashed and came back").await;
    stop.store(true, Ordering::Relaxed);
    for writer in writers {
        writer.await.unwrap();
    }

    let db = sqlx::PgPool::connect(&env.database_url).await.unwrap();
    let documents: Vec<(String, i64)> = sqlx::query_as(
        "SELECT document_id, seq_number FROM id_outbox WHERE tenant_code = 'GC' ORDER BY seq_number",
    )
    .fetch_all(&db)
    .await
    .unwrap();
    let numbers: Vec<i64> = documents.iter().map(|d| d.1).collect();
    let n = numbers.len() as i64;
    assert_eq!(numbers, (1..=n).collect::<Vec<i64>>(), "a hole in 1..={n}");
    let written: std::collections::HashSet<&str> = documents.iter().map(|d| d.0.as_str()).collect();
    let acknowledged = acknowledged.lock().unwrap().clone();
    let lost: Vec<&String> = acknowledged
        .iter()
        .filter(|id| !written.contains(id.as_str()))
        .collect();
    assert!(
        lost.is_empty(),
        "{} acknowledged documents lost: {:?}",
        lost.len(),
        &lost[..lost.len().min(5)]
    );
    let summary: Value = client
        .post(url(second.port, "/api/v1/ids/gaps/reconcile"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(summary["gapless_violations"], 0, "{summary}");
    // The register's chain grew through it all: one entry per document,
    // none lost, none twice, one chain (no fork), verified end to end.
    let chained: Vec<(i64, String)> =
        sqlx::query_as("SELECT seq, id FROM register_entries WHERE project = 'GC' ORDER BY seq")
            .fetch_all(&db)
            .await
            .unwrap();
    let positions: Vec<i64> = chained.iter().map(|c| c.0).collect();
    assert_eq!(
        positions,
        (1..=n).collect::<Vec<i64>>(),
        "the chain's positions"
    );
    let chained_ids: std::collections::HashSet<&str> =
        chained.iter().map(|c| c.1.as_str()).collect();
    assert_eq!(chained_ids, written, "one entry per document");
    let verified: Value = client
        .get(url(second.port, "/api/v1/registers/GC/1/verify"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(verified["ok"], true, "{verified}");
    assert_eq!(verified["entries"], n, "{verified}");
    eprintln!(
        "chaos: {} documents acknowledged, {n} written and chained, numbers 1..={n} without a hole",
        acknowledged.len()
    );
}

/// A transaction holding the counters of `project`'s sequences, as a batch
/// or an import of that tenant does while it runs.
async fn hold_counters(app: &TestApp, project: &str) -> sqlx::Transaction<'static, sqlx::Postgres> {
    let mut holding = app.db.begin().await.unwrap();
    sqlx::query(
        "SELECT c.next_seq FROM counters c JOIN sequences s ON s.id = c.sequence_id \
         WHERE s.project = $1 FOR UPDATE",
    )
    .bind(project)
    .execute(&mut *holding)
    .await
    .unwrap();
    holding
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gapless_counter_held_by_one_tenant_fails_only_its_own_documents() {
    let app = TestEnv::new().spawn().await;
    gapless(&app, "GA", "1", json!({})).await;
    gapless(&app, "GB", "1", json!({})).await;
    gapless(&app, "GC", "1", json!({})).await;
    // The yardstick: the same sixty documents at once, of two tenants
    // whose counters nobody holds (a commit that waited for a held counter
    // would take 200 ms, its lock timeout, per document of its tenant).
    let at_once = async |a: &'static str, b: &'static str| {
        let requests = (0..60).map(|i| {
            let project = if i % 2 == 0 { a } else { b };
            let body = json!({"project": project, "type": "1", "metadata": {"i": i}});
            let app = &app;
            async move {
                let started = Instant::now();
                let response = app.post_document(&body, None).await;
                (project, started.elapsed(), response.status())
            }
        });
        futures::future::join_all(requests).await
    };
    let alone: Vec<Duration> = at_once("GC", "GC")
        .await
        .into_iter()
        .map(|(_, took, status)| {
            assert_eq!(status, StatusCode::ACCEPTED);
            took
        })
        .collect();
    let first = json!({"project": "GA", "type": "1", "metadata": {}});
    assert_eq!(
        app.post_document(&first, None).await.status(),
        StatusCode::ACCEPTED
    );
    // Tenant A's counter is locked by a transaction that never finishes
    // (a batch or an import of its own, hung), and A keeps sending
    // documents of that sequence while B sends its own.
    let hung = hold_counters(&app, "GA").await;
    let mut beside = Vec::new();
    for (project, took, status) in at_once("GA", "GB").await {
        match project {
            "GB" => {
                assert_eq!(status, StatusCode::ACCEPTED);
                beside.push(took);
            }
            _ => assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE),
        }
    }
    assert_slowdown_within(
        "a held gapless counter",
        "tenant B's document",
        &alone,
        &beside,
    );
    // No shared commit waited for A's counter: A's documents were left
    // out of the commits B's went into.
    assert_eq!(app.metrics().await["idpool_ledger_writes_split_total"], 0.0);
    hung.rollback().await.unwrap();
    assert_eq!(
        document_numbers(&app, "GB", "1").await,
        (1..=30).collect::<Vec<i64>>()
    );
    // A's numbers were given back: its next document takes 2.
    let next = app.post_document(&first, None).await;
    assert_eq!(accepted_id(&next.json().await.unwrap()), "GA-1-0002");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn documents_that_met_their_held_counter_are_written_once_it_is_free() {
    let app = TestEnv::new().spawn().await;
    gapless(&app, "GH", "1", json!({})).await;
    let first = json!({"project": "GH", "type": "1", "metadata": {}});
    assert_eq!(
        app.post_document(&first, None).await.status(),
        StatusCode::ACCEPTED
    );
    // The tenant's own batch holds the counter for a moment.
    let batch = hold_counters(&app, "GH").await;
    let waiting = (0..5).map(|i| {
        let body = json!({"project": "GH", "type": "1", "metadata": {"i": i}});
        let app = &app;
        async move { app.post_document(&body, None).await.status() }
    });
    let release = async {
        // Until the documents have met the held counter (every meeting
        // counts).
        app.wait_for_metric_above(
            "idpool_gapless_counter_held_total",
            4.0,
            Duration::from_secs(10),
        )
        .await;
        batch.rollback().await.unwrap();
    };
    let (statuses, ()) = tokio::join!(futures::future::join_all(waiting), release);
    assert!(
        statuses.iter().all(|s| *s == StatusCode::ACCEPTED),
        "{statuses:?}"
    );
    assert_eq!(
        document_numbers(&app, "GH", "1").await,
        (1..=6).collect::<Vec<i64>>()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idempotency_keys_replay_reservations_and_voids() {
    let app = TestEnv::new().spawn().await;
    gapless(&app, "GK", "1", json!({})).await;
    let reserve = || {
        app.client
            .post(app.url("/ids"))
            .header("idempotency-key", "reserve-1")
            .json(&json!({"project": "GK", "type": "1", "count": 2}))
            .send()
    };
    let first: Value = reserve().await.unwrap().json().await.unwrap();
    let again = reserve().await.unwrap();
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    let again: Value = again.json().await.unwrap();
    assert_eq!(first, again, "a retry gets the same reservation");
    let reserved: i64 = sqlx::query_scalar("SELECT count(*) FROM gapless_reservations")
        .fetch_one(&app.db)
        .await
        .unwrap();
    assert_eq!(reserved, 2, "the retry reserved nothing more");
    let void = |reason: &str| {
        app.client
            .post(app.url("/api/v1/ids/void"))
            .header("idempotency-key", "void-1")
            .json(&json!({"project": "GK", "type": "1", "id": first["ids"][0], "reason": reason}))
            .send()
    };
    let voided = void("mistake").await.unwrap();
    assert_eq!(voided.status(), StatusCode::OK);
    let replayed = void("mistake").await.unwrap();
    assert_eq!(replayed.headers()["idempotent-replayed"], "true");
    assert_problem(
        void("another reason").await.unwrap(),
        StatusCode::UNPROCESSABLE_ENTITY,
        "idempotency_key_reused",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_number_that_is_neither_a_document_nor_a_void_is_reported_as_a_violation() {
    let app = TestEnv::new().spawn().await;
    gapless(&app, "GV", "1", json!({})).await;
    let doc = json!({"project": "GV", "type": "1", "metadata": {}});
    assert_eq!(
        app.post_document(&doc, None).await.status(),
        StatusCode::ACCEPTED
    );
    let clean = app.reconcile().await;
    assert_eq!(clean["gapless_violations"], 0, "{clean}");
    // A number lost behind idpool's back (a restore, a hand edit).
    sqlx::query(
        "UPDATE counters SET next_seq = next_seq + 1 FROM sequences s \
         WHERE s.id = counters.sequence_id AND s.project = 'GV'",
    )
    .execute(&app.db)
    .await
    .unwrap();
    assert_eq!(
        app.post_document(&doc, None).await.status(),
        StatusCode::ACCEPTED
    );
    let found = app.reconcile().await;
    assert_eq!(found["gapless_violations"], 1, "{found}");
    assert_eq!(found["numbers_checked"], 2, "{found}");
    let metrics = app.metrics().await;
    assert_eq!(metrics.get("idpool_gapless_violations_total"), Some(&1.0));
    // Its gaps are still only voids: the violation is an error, not a reason.
    assert!(app.gaps("GV", "1").await.is_empty());
    assert_eq!(
        crate::support::app::expect_error_lines("neither a document nor a void"),
        1,
        "the violation is logged as an error"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_first_write_that_fails_leaves_the_period_usable() {
    let app = TestEnv::new().spawn().await;
    gapless(&app, "GF", "1", json!({})).await;
    // The first write of the period: a number Postgres cannot store.
    let refused = app
        .client
        .post(app.url("/documents"))
        .header("content-type", "application/json")
        .body(r#"{"project": "GF", "type": "1", "metadata": {"b": 1e1000000}}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), StatusCode::BAD_REQUEST);
    let document = json!({"project": "GF", "type": "1", "metadata": {}});
    let accepted = app.post_document(&document, None).await;
    assert_eq!(accepted.status(), StatusCode::ACCEPTED);
    assert_eq!(accepted_id(&accepted.json().await.unwrap()), "GF-1-0001");
    let (ids, _) = app.issue("GF", "1", 1).await;
    assert_eq!(ids, vec!["GF-1-0002".to_owned()]);

    // Many first users of a fresh sequence at once: none is refused.
    gapless(&app, "GF", "2", json!({})).await;
    let first = (0..12).map(|i| {
        let app = &app;
        async move {
            let response = if i % 2 == 0 {
                app.post_ids("GF", "2", 2).await
            } else {
                app.post_document(&json!({"project": "GF", "type": "2", "metadata": {}}), None)
                    .await
            };
            response.status()
        }
    });
    let statuses = futures::future::join_all(first).await;
    assert!(statuses.iter().all(|s| s.is_success()), "{statuses:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sequence_holds_a_bounded_number_of_open_reservations() {
    let app = TestEnv::new().spawn().await;
    gapless(&app, "GR", "1", json!({})).await;
    // More than the sequence can ever hold open: refused, and told how
    // many it may ask for (not advice that cannot work).
    let too_many = assert_problem(
        app.post_ids("GR", "1", 1001).await,
        StatusCode::CONFLICT,
        "too_many_reservations",
    )
    .await;
    let detail = too_many["detail"].as_str().unwrap_or_default();
    assert!(detail.contains("ask for at most 1000"), "{detail}");
    let (ids, _) = app.issue("GR", "1", 1000).await;
    assert_problem(
        app.post_ids("GR", "1", 1).await,
        StatusCode::CONFLICT,
        "too_many_reservations",
    )
    .await;
    // Nothing was taken by the refusal: a void frees a place, and the next
    // reservation is the next number.
    let voided = void(
        &app,
        None,
        json!({"project": "GR", "type": "1", "id": ids[0], "reason": "not needed"}),
    )
    .await;
    assert_eq!(voided.status(), StatusCode::OK);
    let (next, _) = app.issue("GR", "1", 1).await;
    assert_eq!(next, vec!["GR-1-1001".to_owned()]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abandoned_gapless_document_stays_in_the_register() {
    let mut env = TestEnv::new();
    // Documents stay pending: the processor does not run.
    env.processor = false;
    let app = env.spawn().await;
    gapless(&app, "GB", "1", json!({})).await;
    let mut ids = Vec::new();
    for _ in 0..3 {
        let response = app
            .post_document(&json!({"project": "GB", "type": "1", "metadata": {}}), None)
            .await;
        ids.push(accepted_id(&response.json().await.unwrap()));
    }
    let abandoned = app
        .client
        .post(app.url(&format!("/api/v1/outbox/{}/abandon", ids[1])))
        .send()
        .await
        .unwrap();
    assert_eq!(abandoned.status(), StatusCode::OK);
    // Delivery stopped; the number is still its document, with its
    // payload, found by its ID and by the outbox listing: not a gap.
    assert_eq!(app.document(&ids[1]).await["status"], "abandoned");
    let (status, listed) = app.get_json("/api/v1/outbox?status=abandoned").await;
    assert_eq!(status, StatusCode::OK);
    assert!(listed.to_string().contains(&ids[1]), "{listed}");
    assert!(app.gaps("GB", "1").await.is_empty());
    let summary = app.reconcile().await;
    assert_eq!(summary["gapless_violations"], 0);
    assert_eq!(document_numbers(&app, "GB", "1").await, vec![1, 2, 3]);
}
