//! POST /documents, batches, idempotency, sinks and the outbox processor.

use crate::support::app::client_with_key;
use crate::support::app::create_key;
use crate::support::app::until;
use crate::support::probes::*;
use std::sync::atomic::AtomicBool;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use idpool::domain::clock::SystemClock;
use idpool::features::documents::processor::{Processor, ProcessorSettings};
use idpool::features::documents::sink::{Sink, SinkConfig, SinkSettings};
use idpool::infra::stats::Stats;
use reqwest::StatusCode;
use serde_json::{Value, json};
use tokio::sync::Barrier;

use crate::support::app::{ServeProcess, TestEnv, assert_problem, ledger_numbers};
use crate::support::app::{eventually, eventually_every};
use crate::support::redis_server::RedisServer;
use crate::support::webhook::{Behaviour, Webhook};

fn doc(project: &str, doc_type: &str, metadata: Value) -> Value {
    json!({"project": project, "type": doc_type, "metadata": metadata})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_accepted_document_is_committed_in_the_default_sink_without_waiting_for_a_poll() {
    let mut env = TestEnv::new();
    // Polling alone would take ten minutes: the notification wakes it.
    env.outbox_poll_ms = 600_000;
    let app = env.spawn().await;
    let response = app
        .post_document(
            &doc("PROJ", "9012", json!({"title": "Level 3", "rev": 2})),
            None,
        )
        .await;
    assert_eq!(response.status(), StatusCode::ACCEPTED);
    let location = response.headers()["location"].to_str().unwrap().to_owned();
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["status"], "pending");
    assert_eq!(body["project"], "PROJ");
    assert_eq!(body["type"], "9012");
    let id = body["id"].as_str().unwrap();
    assert_eq!(id, format!("PROJ-9012-{}", body["seq"]));
    assert_eq!(location, format!("/api/v1/documents/{id}"));

    let took = app
        .wait_for_status(id, "committed", Duration::from_secs(60))
        .await;
    println!("202 -> committed in {took:?}");
    let stored: (String, Value, i64) =
        sqlx::query_as("SELECT project, metadata, seq FROM documents WHERE document_id = $1")
            .bind(id)
            .fetch_one(&app.db)
            .await
            .unwrap();
    assert_eq!(
        stored,
        (
            "PROJ".into(),
            json!({"title": "Level 3", "rev": 2}),
            body["seq"].as_i64().unwrap()
        )
    );
    let view = app.document(id).await;
    assert_eq!(view["retry_count"], 0);
    assert!(view["processed_at"].is_string());
    assert_eq!(view["next_retry_at"], Value::Null);
    // The number is in the ledger, attached.
    assert!(
        ledger_numbers(&app.db, "PROJ", "9012", "")
            .await
            .contains(&body["seq"].as_i64().unwrap())
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_webhook_failing_three_times_is_delivered_after_three_retries_at_the_backoff() {
    let webhook = Webhook::start(Behaviour::FailFirst(3)).await;
    let mut env = TestEnv::new();
    env.sink = SinkConfig::Webhook(webhook.url.clone());
    env.outbox_backoff_base_ms = 50;
    env.outbox_poll_ms = 50;
    let app = env.spawn().await;
    let body: Value = app
        .post_document(&doc("HOOK", "1", json!({"n": 1})), None)
        .await
        .json()
        .await
        .unwrap();
    let id = body["id"].as_str().unwrap();
    app.wait_for_status(id, "committed", Duration::from_secs(10))
        .await;
    let view = app.document(id).await;
    assert_eq!(view["retry_count"], 3);
    // Delivered: the error of an earlier attempt is no longer shown.
    assert_eq!(view["last_error"], Value::Null, "{view}");

    let attempts: Vec<_> = webhook
        .received()
        .into_iter()
        .filter(|r| r.document_id == id)
        .collect();
    assert_eq!(attempts.len(), 4, "three failures and one success");
    for (n, pair) in attempts.windows(2).enumerate() {
        let waited = pair[1].at - pair[0].at;
        let backoff = Duration::from_millis(50 * 2u64.pow(n as u32 + 1));
        assert!(
            waited >= backoff.mul_f64(0.9),
            "retry {} came after {waited:?}, backoff {backoff:?}",
            n + 1
        );
    }
    let delivered = attempts.last().unwrap();
    assert_eq!(delivered.idempotency_key.as_deref(), Some(id));
    assert_eq!(delivered.body["metadata"], json!({"n": 1}));
    assert_eq!(delivered.body["id"], id);
}

/// A target that answers 2xx with a body: its connections are reused
/// (the answer is read to its end), so 300 deliveries need no more
/// connections than deliveries in flight at once, not one each. The body
/// is larger than one read (32 KiB): a small one arrives with the status
/// line, and its connection is reused even unread.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_webhook_answering_with_a_body_keeps_its_connections() {
    let webhook = Webhook::start(Behaviour::Succeed).await;
    webhook.answer_with_body(32 * 1024);
    let mut env = TestEnv::new();
    env.sink = SinkConfig::Webhook(webhook.url.clone());
    let app = env.spawn().await;
    let mut ids = Vec::new();
    for round in 0..3 {
        let documents = (0..100)
            .map(|n| doc("KEEP", "1", json!({"round": round, "n": n})))
            .collect();
        let response = app.post_batch(documents).await;
        assert_eq!(response.status(), StatusCode::ACCEPTED);
        let body: Value = response.json().await.unwrap();
        for item in body["documents"].as_array().unwrap() {
            ids.push(item["id"].as_str().unwrap().to_owned());
        }
        for id in &ids {
            app.wait_for_status(id, "committed", Duration::from_secs(20))
                .await;
        }
    }
    assert_eq!(ids.len(), 300);
    // Two processor loops of the test app, each with up to 16 deliveries
    // in flight.
    let connections = webhook.connections();
    assert!(
        connections <= 2 * 16,
        "{connections} connections for 300 deliveries"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_can_be_listed_retried_and_abandoned() {
    let webhook = Webhook::start(Behaviour::AlwaysFail).await;
    let mut env = TestEnv::new();
    env.sink = SinkConfig::Webhook(webhook.url.clone());
    env.outbox_backoff_base_ms = 20;
    env.outbox_poll_ms = 50;
    env.outbox_max_retries = 3;
    let app = env.spawn().await;
    let mut ids = Vec::new();
    for n in 0..2 {
        let body: Value = app
            .post_document(&doc("DLQ", "1", json!({"n": n})), None)
            .await
            .json()
            .await
            .unwrap();
        ids.push(body["id"].as_str().unwrap().to_owned());
    }
    for id in &ids {
        app.wait_for_status(id, "dead_letter", Duration::from_secs(10))
            .await;
        let view = app.document(id).await;
        assert_eq!(view["retry_count"], 3);
        assert!(view["last_error"] == "HTTP 500", "{view}");
        assert_eq!(view["next_retry_at"], Value::Null);
    }
    let page = app
        .ok_json("/api/v1/outbox?status=dead_letter&project=DLQ&type=1")
        .await;
    let listed: Vec<&str> = page["documents"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["id"].as_str().unwrap())
        .collect();
    assert_eq!(listed, ids.iter().map(String::as_str).collect::<Vec<_>>());
    let first_page = app
        .ok_json("/api/v1/outbox?status=dead_letter&limit=1")
        .await;
    let cursor = first_page["next_cursor"].as_str().unwrap();
    let second_page = app
        .ok_json(&format!(
            "/api/v1/outbox?status=dead_letter&limit=1&cursor={cursor}"
        ))
        .await;
    assert_eq!(second_page["documents"][0]["id"], ids[1].as_str());

    // The target recovers: a retried dead letter is delivered.
    webhook.set(Behaviour::Succeed);
    let retried = app
        .client
        .post(app.url(&format!("/api/v1/outbox/{}/retry", ids[0])))
        .send()
        .await
        .unwrap();
    assert_eq!(retried.status(), StatusCode::OK);
    let retried: Value = retried.json().await.unwrap();
    assert_eq!(
        (retried["status"].as_str(), retried["retry_count"].as_i64()),
        (Some("pending"), Some(0))
    );
    app.wait_for_status(&ids[0], "committed", Duration::from_secs(5))
        .await;

    let abandoned = app
        .client
        .post(app.url(&format!("/api/v1/outbox/{}/abandon", ids[1])))
        .send()
        .await
        .unwrap();
    assert_eq!(abandoned.status(), StatusCode::OK);
    assert_eq!(app.document(&ids[1]).await["status"], "abandoned");

    let again = app
        .client
        .post(app.url(&format!("/api/v1/outbox/{}/retry", ids[0])))
        .send()
        .await
        .unwrap();
    assert_problem(again, StatusCode::CONFLICT, "not_retryable").await;
    let late = app
        .client
        .post(app.url(&format!("/api/v1/outbox/{}/abandon", ids[0])))
        .send()
        .await
        .unwrap();
    assert_problem(late, StatusCode::CONFLICT, "not_abandonable").await;
    let missing = app
        .client
        .post(app.url("/api/v1/outbox/NOPE-1-1/retry"))
        .send()
        .await
        .unwrap();
    assert_problem(missing, StatusCode::NOT_FOUND, "document_not_found").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_concurrent_requests_with_one_key_make_one_document() {
    let app = Arc::new(TestEnv::new().spawn().await);
    let barrier = Arc::new(Barrier::new(10));
    let body = doc("IDEM", "1", json!({"title": "once"}));
    let mut tasks = Vec::new();
    for _ in 0..10 {
        let (app, barrier, body) = (app.clone(), barrier.clone(), body.clone());
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            let response = app.post_document(&body, Some("order-7")).await;
            let status = response.status();
            let replayed = response.headers().contains_key("idempotent-replayed");
            (status, replayed, response.json::<Value>().await.unwrap())
        }));
    }
    let mut ids = HashSet::new();
    let mut replays = 0;
    for task in tasks {
        let (status, replayed, body) = task.await.unwrap();
        match status {
            StatusCode::ACCEPTED => {
                ids.insert(body["id"].as_str().unwrap().to_owned());
                replays += usize::from(replayed);
            }
            StatusCode::CONFLICT => assert_eq!(body["code"], "idempotency_key_in_use"),
            other => panic!("unexpected {other}: {body}"),
        }
    }
    assert_eq!(
        ids.len(),
        1,
        "every 2xx answer carries the same ID: {ids:?}"
    );
    assert!(replays >= 1, "twins were answered by replay");
    assert_eq!(app.outbox_count(None).await, 1, "one outbox row");
    assert_eq!(
        ledger_numbers(&app.db, "IDEM", "1", "").await.len(),
        1,
        "one number"
    );

    // A finished request replays with the header, same status and body.
    let replay = app.post_document(&body, Some("order-7")).await;
    assert_eq!(replay.status(), StatusCode::ACCEPTED);
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    assert!(replay.headers().contains_key("location"));
    let replayed: Value = replay.json().await.unwrap();
    assert_eq!(
        replayed["id"].as_str(),
        ids.iter().next().map(String::as_str)
    );

    // Same key, another body: 422, nothing written.
    let other = app
        .post_document(
            &doc("IDEM", "1", json!({"title": "twice"})),
            Some("order-7"),
        )
        .await;
    assert_problem(
        other,
        StatusCode::UNPROCESSABLE_ENTITY,
        "idempotency_key_reused",
    )
    .await;
    assert_eq!(app.outbox_count(None).await, 1);

    // Another API key's identical Idempotency-Key is its own.
    let other_key = crate::support::app::create_key(&app.state, &[], true).await;
    let other_caller = crate::support::app::client_with_key(Some(&other_key))
        .post(app.url("/documents"))
        .header("idempotency-key", "order-7")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(other_caller.status(), StatusCode::ACCEPTED);
    assert!(!other_caller.headers().contains_key("idempotent-replayed"));
    let other_id: Value = other_caller.json().await.unwrap();
    assert!(!ids.contains(other_id["id"].as_str().unwrap()));
    assert_eq!(app.outbox_count(None).await, 2);

    // Malformed keys are refused.
    let bad = app.post_document(&body, Some(&"k".repeat(256))).await;
    assert_problem(bad, StatusCode::BAD_REQUEST, "invalid_idempotency_key").await;
    // So are two keys: either could be the one meant.
    let two = app
        .client
        .post(app.url("/documents"))
        .header("idempotency-key", "order-7")
        .header("idempotency-key", "order-8")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_problem(two, StatusCode::BAD_REQUEST, "invalid_idempotency_key").await;
    assert_eq!(app.outbox_count(None).await, 2);
}

/// A retry is the same request however its JSON is written: keys in
/// another order, other whitespace, `2.0` for `2`. A changed value is not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_written_another_way_is_replayed_and_a_changed_one_refused() {
    let app = TestEnv::new().spawn().await;
    let send = |body: &'static str| {
        app.client
            .post(app.url("/documents"))
            .header("content-type", "application/json")
            .header("idempotency-key", "written-another-way")
            .body(body)
            .send()
    };
    let first = send(r#"{"project":"JCS","type":"1","metadata":{"b":[1,{"y":2,"x":"é"}],"a":2}}"#)
        .await
        .unwrap();
    assert_eq!(first.status(), StatusCode::ACCEPTED);
    let first: Value = first.json().await.unwrap();
    for retry in [
        r#"{"metadata":{"a":2,"b":[1,{"x":"é","y":2}]},"type":"1","project":"JCS"}"#,
        "{\n  \"type\" : \"1\",\n\t\"project\":\"JCS\", \"metadata\": { \"a\": 2.0, \"b\": [ 1, { \"y\": 2, \"x\": \"\\u00e9\" } ] }\n}",
    ] {
        let again = send(retry).await.unwrap();
        let status = again.status();
        let body: Value = again.json().await.unwrap();
        assert!(status.is_success(), "{retry}: {status} {body}");
        assert_eq!(body["id"], first["id"], "{retry}");
    }
    // Changed values, some of which a double cannot tell from the first:
    // the payload keeps the text, so each would be lost as a replay.
    for changed in [
        r#"{"project":"JCS","type":"1","metadata":{"b":[1,{"y":2,"x":"é"}],"a":3}}"#,
        r#"{"project":"JCS","type":"1","metadata":{"b":[1,{"y":2,"x":"é"}],"a":2.0000000000000000001}}"#,
        r#"{"project":"JCS","type":"1","metadata":{"b":[1.0000000000000000001,{"y":2,"x":"é"}],"a":2}}"#,
    ] {
        let answer = send(changed).await.unwrap();
        assert_eq!(
            answer.status(),
            StatusCode::UNPROCESSABLE_ENTITY,
            "{changed}"
        );
    }
    assert_eq!(
        app.outbox_count(None).await,
        1,
        "one document for the request and its retries"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ids_retried_with_their_key_come_back_the_same_and_burn_nothing() {
    let app = TestEnv::new().spawn().await;
    let send = || {
        app.client
            .post(app.url("/ids"))
            .header("idempotency-key", "migration-batch-1")
            .json(&json!({"project": "KEYED", "type": "1", "count": 1000}))
            .send()
    };
    let first = send().await.unwrap();
    assert_eq!(first.status(), StatusCode::OK);
    assert!(!first.headers().contains_key("idempotent-replayed"));
    let first: Value = first.json().await.unwrap();
    let second = send().await.unwrap();
    assert_eq!(second.headers()["idempotent-replayed"], "true");
    let second: Value = second.json().await.unwrap();
    assert_eq!(first["ids"], second["ids"]);
    assert_eq!(first["ids"].as_array().unwrap().len(), 1000);
    // The ledger holds the 1000 numbers once.
    assert_eq!(ledger_numbers(&app.db, "KEYED", "1", "").await.len(), 1000);
    let changed = app
        .client
        .post(app.url("/ids"))
        .header("idempotency-key", "migration-batch-1")
        .json(&json!({"project": "KEYED", "type": "1", "count": 999}))
        .send()
        .await
        .unwrap();
    assert_problem(
        changed,
        StatusCode::UNPROCESSABLE_ENTITY,
        "idempotency_key_reused",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_of_1000_is_one_transaction_and_a_bad_item_stops_it_all() {
    let app = TestEnv::new().spawn().await;
    let documents: Vec<Value> = (0..1000)
        .map(|n| doc("BATCH", "1", json!({"n": n})))
        .collect();
    let started = Instant::now();
    let response = app.post_batch(documents.clone()).await;
    let took = started.elapsed();
    assert_eq!(response.status(), StatusCode::ACCEPTED);
    let body: Value = response.json().await.unwrap();
    let results = body["documents"].as_array().unwrap();
    assert_eq!(results.len(), 1000);
    let seqs: Vec<i64> = results.iter().map(|r| r["seq"].as_i64().unwrap()).collect();
    assert!(
        seqs.windows(2).all(|w| w[0] < w[1]),
        "IDs ascending in request order"
    );
    assert_eq!(app.outbox_count(None).await, 1000);
    let metadata: Vec<(String, Value)> =
        sqlx::query_as("SELECT document_id, payload FROM id_outbox ORDER BY seq")
            .fetch_all(&app.db)
            .await
            .unwrap();
    for (n, (id, payload)) in metadata.iter().enumerate() {
        assert_eq!(id, results[n]["id"].as_str().unwrap());
        assert_eq!(payload, &json!({"n": n}));
    }
    println!("batch of 1000 accepted in {took:?}");

    // Item 500 is bad: 400 naming it, nothing written, no number taken.
    let ledger_before = ledger_numbers(&app.db, "BATCH", "1", "").await.len();
    let mut bad = documents.clone();
    bad[500] = doc("BA-TCH", "1", json!({}));
    let refused = app.post_batch(bad).await;
    let problem = assert_problem(refused, StatusCode::BAD_REQUEST, "invalid_project").await;
    assert_eq!(problem["index"], 500);
    assert!(
        problem["detail"]
            .as_str()
            .unwrap()
            .starts_with("documents[500]")
    );
    let mut not_object = documents.clone();
    not_object[7] = doc("BATCH", "1", json!([1, 2]));
    let problem = assert_problem(
        app.post_batch(not_object).await,
        StatusCode::BAD_REQUEST,
        "invalid_metadata",
    )
    .await;
    assert_eq!(problem["index"], 7);
    let mut unattachable = documents.clone();
    unattachable[3] =
        json!({"project": "BATCH", "type": "1", "metadata": {}, "id": "BATCH-1-999999"});
    let problem = assert_problem(
        app.post_batch(unattachable).await,
        StatusCode::CONFLICT,
        "id_not_attachable",
    )
    .await;
    assert_eq!(problem["index"], 3);
    assert_eq!(app.outbox_count(None).await, 1000, "nothing written");
    assert_eq!(
        ledger_numbers(&app.db, "BATCH", "1", "").await.len(),
        ledger_before,
        "no number consumed"
    );

    assert_problem(
        app.post_batch(vec![]).await,
        StatusCode::BAD_REQUEST,
        "invalid_batch_size",
    )
    .await;
    let too_many: Vec<Value> = (0..1001).map(|_| doc("BATCH", "1", json!({}))).collect();
    assert_problem(
        app.post_batch(too_many).await,
        StatusCode::BAD_REQUEST,
        "invalid_batch_size",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batch_items_with_keys_are_replayed_and_ids_from_post_ids_attach_once() {
    let app = TestEnv::new().spawn().await;
    let (ids, _) = app.issue("MIG", "1", 2).await;
    let items = vec![
        json!({"project": "MIG", "type": "1", "metadata": {"src": "a"}, "idempotency_key": "src-a"}),
        json!({"project": "MIG", "type": "1", "metadata": {"src": "b"}, "id": ids[0]}),
    ];
    let first: Value = app.post_batch(items.clone()).await.json().await.unwrap();
    assert_eq!(
        first["documents"][1]["id"],
        ids[0].as_str(),
        "the pre-issued ID was attached"
    );
    assert_eq!(first["documents"][0]["replayed"], Value::Null);

    // Resuming a migration: the keyed item comes back as it was.
    let resumed = app
        .post_batch(vec![
            items[0].clone(),
            json!({"project": "MIG", "type": "1", "metadata": {"src": "c"}, "idempotency_key": "src-c"}),
        ])
        .await;
    assert_eq!(resumed.status(), StatusCode::ACCEPTED);
    let resumed: Value = resumed.json().await.unwrap();
    assert_eq!(resumed["documents"][0]["id"], first["documents"][0]["id"]);
    assert_eq!(resumed["documents"][0]["replayed"], true);
    assert_eq!(app.outbox_count(None).await, 3);

    // An attached ID cannot be attached again; the other one still can.
    let twice = app
        .post_document(
            &json!({"project": "MIG", "type": "1", "metadata": {}, "id": ids[0]}),
            None,
        )
        .await;
    assert_problem(twice, StatusCode::CONFLICT, "id_not_attachable").await;
    let other_project = app
        .post_document(
            &json!({"project": "OTHER", "type": "1", "metadata": {}, "id": ids[1]}),
            None,
        )
        .await;
    assert_problem(other_project, StatusCode::CONFLICT, "id_not_attachable").await;
    let attached = app
        .post_document(
            &json!({"project": "MIG", "type": "1", "metadata": {}, "id": ids[1]}),
            None,
        )
        .await;
    assert_eq!(attached.status(), StatusCode::ACCEPTED);

    // One key, one item twice in one batch: one document, and the second
    // answer says it repeats the first (a script counting documents made by
    // `replayed` counts one).
    let repeated: Value = app
        .post_batch(vec![
            json!({"project": "MIG", "type": "1", "metadata": {"x": 1}, "idempotency_key": "twice"}),
            json!({"project": "MIG", "type": "1", "metadata": {"x": 1}, "idempotency_key": "twice"}),
        ])
        .await
        .json()
        .await
        .unwrap();
    let documents = &repeated["documents"];
    assert_eq!(documents[0]["id"], documents[1]["id"], "{repeated}");
    assert_eq!(documents[0]["replayed"], Value::Null, "{repeated}");
    assert_eq!(documents[1]["replayed"], true, "{repeated}");

    // One key, two different items in one batch: 422 at the second.
    let clash = app
        .post_batch(vec![
            json!({"project": "MIG", "type": "1", "metadata": {"v": 1}, "idempotency_key": "dup"}),
            json!({"project": "MIG", "type": "1", "metadata": {"v": 2}, "idempotency_key": "dup"}),
        ])
        .await;
    let problem = assert_problem(
        clash,
        StatusCode::UNPROCESSABLE_ENTITY,
        "idempotency_key_reused",
    )
    .await;
    assert_eq!(problem["index"], 1);

    // The same key with another source id is another request: replaying
    // it would tell the caller s3 has a document when it has none.
    let with_source = |source: &str| json!({"project": "MIG", "type": "1", "metadata": {"a": 4}, "source_id": source, "idempotency_key": "bk2"});
    let first = app.post_batch(vec![with_source("s2")]).await;
    assert_eq!(first.status(), StatusCode::ACCEPTED);
    let changed = app.post_batch(vec![with_source("s3")]).await;
    let problem = assert_problem(
        changed,
        StatusCode::UNPROCESSABLE_ENTITY,
        "idempotency_key_reused",
    )
    .await;
    assert_eq!(problem["index"], 0);
    let again = app.post_batch(vec![with_source("s2")]).await;
    let again: Value = again.json().await.unwrap();
    assert_eq!(again["documents"][0]["replayed"], true);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_documents_get_their_problems_and_change_nothing() {
    let app = TestEnv::new().spawn().await;
    // Metadata nesting 65 levels (the object, then 64 arrays): one more
    // than the bound (far deeper would exhaust Postgres' stack).
    let mut deep = json!([]);
    for _ in 1..64 {
        deep = json!([deep]);
    }
    let cases = vec![
        (
            json!({"project": "P", "type": "1", "metadata": {"a": deep}}),
            StatusCode::BAD_REQUEST,
            "invalid_metadata",
        ),
        (
            json!({"project": "P-", "type": "1", "metadata": {}}),
            StatusCode::BAD_REQUEST,
            "invalid_project",
        ),
        (
            json!({"project": "P", "type": "1", "metadata": "text"}),
            StatusCode::BAD_REQUEST,
            "invalid_metadata",
        ),
        (
            json!({"project": "P", "type": "1", "metadata": null}),
            StatusCode::BAD_REQUEST,
            "invalid_metadata",
        ),
        (
            json!({"project": "P", "type": "1"}),
            StatusCode::BAD_REQUEST,
            "invalid_body",
        ),
        (
            json!({"project": "P", "type": "1", "metadata": {}, "extra": 1}),
            StatusCode::BAD_REQUEST,
            "invalid_body",
        ),
        (
            json!({"project": "P", "type": "1", "metadata": {}, "id": ""}),
            StatusCode::BAD_REQUEST,
            "invalid_id",
        ),
        (
            json!({"project": "P", "type": "1", "metadata": {"big": "x".repeat(256 * 1024)}}),
            StatusCode::PAYLOAD_TOO_LARGE,
            "metadata_too_large",
        ),
        (
            json!({"project": "P", "type": "1", "metadata": {"big": "x".repeat(400 * 1024)}}),
            StatusCode::PAYLOAD_TOO_LARGE,
            "body_too_large",
        ),
    ];
    for (body, status, code) in cases {
        assert_problem(app.post_document(&body, None).await, status, code).await;
    }
    let missing = app
        .client
        .get(app.url("/api/v1/documents/P-1-1"))
        .send()
        .await
        .unwrap();
    assert_problem(missing, StatusCode::NOT_FOUND, "document_not_found").await;
    let header_on_batch = app
        .client
        .post(app.url("/api/v1/documents/batch"))
        .header("idempotency-key", "k")
        .json(&json!({"documents": [doc("P", "1", json!({}))]}))
        .send()
        .await
        .unwrap();
    assert_problem(
        header_on_batch,
        StatusCode::BAD_REQUEST,
        "idempotency_key_unsupported",
    )
    .await;
    assert_eq!(app.outbox_count(None).await, 0);
    let issued: i64 = sqlx::query_scalar("SELECT count(*) FROM issuance_ledger")
        .fetch_one(&app.db)
        .await
        .unwrap();
    assert_eq!(issued, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_redis_down_documents_are_accepted_with_numbers_from_postgres() {
    let mut redis = RedisServer::start();
    let app = TestEnv::new().with_redis(&redis.url()).spawn().await;
    redis.kill();
    app.wait_for_mode("fallback", Duration::from_secs(5)).await;
    let response = app
        .post_document(&doc("NORED", "1", json!({"a": 1})), None)
        .await;
    assert_eq!(response.status(), StatusCode::ACCEPTED);
    let body: Value = response.json().await.unwrap();
    app.wait_for_status(
        body["id"].as_str().unwrap(),
        "committed",
        Duration::from_secs(5),
    )
    .await;
    let batch = app
        .post_batch(vec![
            doc("NORED", "1", json!({"b": 1})),
            doc("NORED", "1", json!({"b": 2})),
        ])
        .await;
    assert_eq!(batch.status(), StatusCode::ACCEPTED);
    let metrics = app.metrics().await;
    assert_eq!(metrics["idpool_ids_issued_total{source=\"direct\"}"], 3.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expired_idempotency_keys_are_pruned() {
    let app = TestEnv::new().spawn().await;
    let body = doc("PRUNE", "1", json!({}));
    let first: Value = app
        .post_document(&body, Some("old-key"))
        .await
        .json()
        .await
        .unwrap();
    sqlx::query("UPDATE idempotency_keys SET created_at = now() - interval '25 hours'")
        .execute(&app.db)
        .await
        .unwrap();
    let pruned =
        idpool::records::idempotency::prune(&app.state.db, idpool::records::idempotency::KEY_TTL)
            .await
            .unwrap();
    assert_eq!(pruned, 1);
    let later = app.post_document(&body, Some("old-key")).await;
    assert!(!later.headers().contains_key("idempotent-replayed"));
    let later: Value = later.json().await.unwrap();
    assert_ne!(
        later["id"], first["id"],
        "a key older than 24 h is new again"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_processors_deliver_5000_rows_each_once_and_never_twice_at_a_time() {
    let webhook = Webhook::start(Behaviour::Succeed).await;
    webhook.slow_down(Duration::from_millis(1));
    let mut env = TestEnv::new();
    env.sink = SinkConfig::Webhook(webhook.url.clone());
    env.processor = false;
    let ingest = env.spawn().await;
    for chunk in 0..5 {
        let documents = (0..1000)
            .map(|n| doc("TWO", "1", json!({"n": chunk * 1000 + n})))
            .collect();
        assert_eq!(
            ingest.post_batch(documents).await.status(),
            StatusCode::ACCEPTED
        );
    }
    env.processor = true;
    env.outbox_batch = 100;
    env.outbox_poll_ms = 100;
    let (a, b) = (env.spawn().await, env.spawn().await);
    eventually(Duration::from_secs(60), "all 5000 delivered", async || {
        (ingest.outbox_count(Some("committed")).await >= 5000).then_some(())
    })
    .await;
    let received = webhook.received();
    let mut per_document: HashMap<String, usize> = HashMap::new();
    for r in &received {
        *per_document.entry(r.document_id.clone()).or_default() += 1;
    }
    assert_eq!(per_document.len(), 5000, "every row delivered");
    assert!(
        per_document.values().all(|&n| n == 1),
        "each delivered exactly once"
    );
    assert_eq!(
        webhook.most_at_once_per_document(),
        1,
        "never two deliveries of one row at once"
    );
    let instances: HashSet<_> = received.iter().filter_map(|r| r.instance.clone()).collect();
    assert_eq!(instances.len(), 2, "both processors delivered");
    drop((a, b));
}

fn json_files(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    std::fs::read_dir(dir)
        .unwrap()
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_processor_killed_mid_batch_loses_nothing_and_never_writes_other_content() {
    let dir = tempfile::tempdir().unwrap();
    let mut env = TestEnv::new();
    env.sink = SinkConfig::Dir(dir.path().to_owned());
    env.processor = false;
    let ingest = env.spawn().await;
    let filler = "x".repeat(2048);
    let mut accepted: HashMap<String, Value> = HashMap::new();
    for chunk in 0..5 {
        let documents = (0..1000)
            .map(|n| {
                doc(
                    "KILL",
                    "1",
                    json!({"n": chunk * 1000 + n, "filler": filler}),
                )
            })
            .collect();
        let body: Value = ingest.post_batch(documents).await.json().await.unwrap();
        for (n, result) in body["documents"].as_array().unwrap().iter().enumerate() {
            accepted.insert(
                result["id"].as_str().unwrap().to_owned(),
                json!({"n": chunk * 1000 + n as i64, "filler": filler}),
            );
        }
    }
    assert_eq!(accepted.len(), 5000);

    // One processor claims all 5000 rows in one transaction and dies while
    // writing files. One delivery loop: with two, the second could claim
    // the rows the first had not locked yet (SKIP LOCKED) and commit them
    // before the kill (83 of them in one CI run).
    env.processor = true;
    env.outbox_batch = 10_000;
    let mut single_loop = env.clone();
    single_loop
        .extra_env
        .push(("IDPOOL_OUTBOX_WORKERS".to_owned(), "1".to_owned()));
    let mut first = ServeProcess::start(&single_loop).await;
    eventually_every(
        Duration::from_secs(30),
        Duration::from_millis(1),
        "the processor writes",
        async || (json_files(dir.path()).len() >= 200).then_some(()),
    )
    .await;
    first.kill();
    let written_before_kill = json_files(dir.path()).len();
    let still_pending = ingest.outbox_count(Some("pending")).await;
    println!("killed after {written_before_kill} files; {still_pending} rows still pending");
    assert!(
        still_pending > 0,
        "the kill landed before the batch committed"
    );
    assert_eq!(
        ingest.outbox_count(Some("committed")).await,
        0,
        "a killed batch commits nothing"
    );

    // Restarted, everything that got a 202 ends committed.
    let _second = ServeProcess::start(&env).await;
    eventually(
        Duration::from_secs(60),
        "all committed after the restart",
        async || (ingest.outbox_count(Some("committed")).await >= 5000).then_some(()),
    )
    .await;
    let files = json_files(dir.path());
    assert_eq!(files.len(), 5000);
    for file in files {
        let content: Value = serde_json::from_slice(&std::fs::read(&file).unwrap()).unwrap();
        let id = content["id"].as_str().unwrap();
        assert_eq!(
            file.file_name().unwrap().to_str().unwrap(),
            format!("{id}.json")
        );
        assert_eq!(
            &content["metadata"], &accepted[id],
            "{id} was written with other content"
        );
        assert_eq!(content["project"], "KILL");
    }
}

/// A processor of the test's own, over a directory, driven one step at a
/// time (the app's own processor is off).
fn dir_processor(
    app: &crate::support::app::TestApp,
    dir: &std::path::Path,
    batch: i64,
) -> Processor {
    let sink = Sink::build(
        &SinkConfig::Dir(dir.to_owned()),
        &SinkSettings {
            timeout: Duration::from_secs(5),
            concurrency: 1,
            instance_id: "test".into(),
            secret: None,
            clock: Arc::new(SystemClock),
        },
    )
    .unwrap();
    let settings = ProcessorSettings {
        batch_size: batch,
        max_retries: 2,
        backoff_base: Duration::ZERO,
        ..ProcessorSettings::default()
    };
    Processor::new(
        app.state.db.clone(),
        sink,
        settings,
        Arc::new(tokio::sync::Notify::new()),
        Arc::new(Stats::default()),
    )
}

async fn accept_batch(app: &crate::support::app::TestApp, project: &str, count: usize) {
    let documents = (0..count)
        .map(|n| doc(project, "1", json!({"n": n})))
        .collect();
    assert_eq!(
        app.post_batch(documents).await.status(),
        StatusCode::ACCEPTED
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_processor_step_delivers_at_most_one_batch_of_due_rows() {
    let mut env = TestEnv::new();
    env.processor = false;
    let app = env.spawn().await;
    accept_batch(&app, "STEP", 5).await;
    let dir = tempfile::tempdir().unwrap();
    let processor = dir_processor(&app, dir.path(), 2);

    let delivered: Vec<usize> = [
        processor.step().await.unwrap(),
        processor.step().await.unwrap(),
        processor.step().await.unwrap(),
        processor.step().await.unwrap(),
    ]
    .iter()
    .map(|step| step.delivered)
    .collect();
    assert_eq!(delivered, vec![2, 2, 1, 0]);
    assert_eq!(json_files(dir.path()).len(), 5);
    assert_eq!(app.outbox_count(Some("committed")).await, 5);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delivery_that_keeps_failing_is_dead_lettered_after_its_last_retry() {
    let mut env = TestEnv::new();
    env.processor = false;
    let app = env.spawn().await;
    accept_batch(&app, "FAILS", 3).await;
    let dir = tempfile::tempdir().unwrap();
    let processor = dir_processor(&app, dir.path(), 10);
    // The directory goes away: every write fails.
    std::fs::remove_dir(dir.path()).unwrap();

    let first = processor.step().await.unwrap();
    assert_eq!(
        (first.claimed, first.failed, first.dead_lettered),
        (3, 3, 0)
    );
    assert_eq!(app.outbox_count(Some("pending")).await, 3, "due again");
    let last = processor.step().await.unwrap();
    assert_eq!((last.claimed, last.failed, last.dead_lettered), (3, 3, 3));
    assert_eq!(app.outbox_count(Some("dead_letter")).await, 3);
    let (status, listed) = app.get_json("/api/v1/outbox?status=dead_letter").await;
    assert_eq!(status, StatusCode::OK);
    let error = listed["documents"][0]["last_error"]
        .as_str()
        .unwrap_or_default();
    // What failed, classified; the server's path is for its log only.
    assert_eq!(error, "write failed", "last_error: {error}");
    let dir_name = dir.path().to_string_lossy().into_owned();
    assert!(!listed.to_string().contains(&dir_name), "{listed}");
    assert_eq!(processor.step().await.unwrap().claimed, 0, "nothing is due");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenants_backlog_delays_another_tenants_documents_by_one_batch() {
    let mut env = TestEnv::new();
    env.processor = false;
    let app = env.spawn().await;
    // A migration's backlog, accepted first...
    for _ in 0..5 {
        accept_batch(&app, "BACKLOG", 1000).await;
    }
    // ...then a handful of another tenant's documents.
    accept_batch(&app, "SMALL", 5).await;
    let dir = tempfile::tempdir().unwrap();
    let processor = dir_processor(&app, dir.path(), 100);
    let step = processor.step().await.unwrap();
    assert_eq!(step.delivered, 100);
    let delivered: Vec<(String, i64)> = sqlx::query_as(
        "SELECT tenant_code, count(*) FROM id_outbox WHERE status = 'committed' \
         GROUP BY tenant_code ORDER BY tenant_code",
    )
    .fetch_all(&app.db)
    .await
    .unwrap();
    assert_eq!(
        delivered,
        vec![("BACKLOG".to_owned(), 95), ("SMALL".to_owned(), 5)],
        "the first batch shares itself between the tenants with due rows"
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
        let took = started.elapsed();
        assert_answer_within(
            "slow batch bodies",
            "a one-item batch",
            neighbour.alone(),
            took,
        );
    }
    neighbour.assert_unharmed("slow batch bodies").await;
    for trickle in trickles {
        trickle.abort();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_migration_at_full_speed_leaves_batch_turns_for_another_tenant() {
    let app = TestEnv::new().spawn().await;
    let migrating_key = create_key(&app.state, &["MIGR"], false).await;
    let migrating = client_with_key(Some(&migrating_key));
    let other_key = create_key(&app.state, &["OTHER"], false).await;
    let other = client_with_key(Some(&other_key));
    // Another tenant's one-item batch, a migration at full speed or not.
    let one_item_batch = async |n: usize| {
        let answer = other
            .post(app.url("/api/v1/documents/batch"))
            .json(&json!({"documents": [{"project": "OTHER", "type": "1", "metadata": {"n": n}}]}))
            .send()
            .await
            .unwrap();
        assert_eq!(answer.status(), StatusCode::ACCEPTED);
    };
    let alone = timed(10, &one_item_batch).await;
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
    let beside = timed(10, &one_item_batch).await;
    running.store(false, Ordering::Relaxed);
    let mut batches = 0;
    for batch_loop in loops {
        batches += batch_loop.await.unwrap();
    }
    assert!(
        batches >= 4,
        "the migration went on meanwhile ({batches} batches)"
    );
    assert_slowdown_within(
        "a migration at full speed",
        "another tenant's one-item batch",
        &alone,
        &beside,
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
    // Another tenant's keyed document, beside HOLD's issuing, before and
    // while its attaches wait.
    let keyed_document = async |n: usize| {
        let answer = other
            .post(app.url("/documents"))
            .header("idempotency-key", format!("other-{n}"))
            .json(&json!({"project": "OTHB", "type": "1", "metadata": {"n": n}}))
            .send()
            .await
            .unwrap();
        assert_eq!(answer.status(), StatusCode::ACCEPTED);
    };
    let alone = timed(20, &keyed_document).await;
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
    let beside = timed(20, async |n| keyed_document(n + 20).await).await;
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
    assert_slowdown_within(
        "200 waiting attaches",
        "another tenant's keyed document",
        &alone,
        &beside,
    );
}

/// Notifying commits of a database queue on one lock (Postgres serialises
/// them), and a wait there counts against `lock_timeout`. Another tenant's
/// slow commits (here three sessions whose every commit of a NOTIFY takes
/// 100 ms, as large batches on a busy disk do) must not fail a small
/// document whose shared write waits its turn: no row of anybody's is in
/// its way, so nobody's request is at fault. (A hostile review's 503 for a
/// tenant beside another's document batches.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_document_queued_behind_other_tenants_slow_commits_is_written() {
    use sqlx::Connection;
    let env = TestEnv::new();
    let app = env.spawn().await;
    let stop = Arc::new(AtomicBool::new(false));
    let commits = Arc::new(AtomicU64::new(0));
    sqlx::query("CREATE TABLE elsewhere (n bigint)")
        .execute(&app.db)
        .await
        .expect("another tenant's table");
    let mut noise = Vec::new();
    for _ in 0..3 {
        let mut conn = sqlx::PgConnection::connect(&env.database_url)
            .await
            .expect("a session of its own");
        sqlx::raw_sql("SET commit_delay = 100000; SET commit_siblings = 0")
            .execute(&mut conn)
            .await
            .expect("slow commits");
        let (stop, commits) = (stop.clone(), commits.clone());
        noise.push(tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                // A commit that wrote WAL waits for its flush (and
                // commit_delay): one that only notifies would not.
                sqlx::raw_sql(
                    "BEGIN; INSERT INTO elsewhere VALUES (1); \
                     SELECT pg_notify('elsewhere', ''); COMMIT",
                )
                .execute(&mut conn)
                .await
                .expect("a notifying commit");
                commits.fetch_add(1, Ordering::Relaxed);
            }
        }));
    }
    eventually(
        Duration::from_secs(10),
        "the slow commits are under way",
        async || (commits.load(Ordering::Relaxed) >= 3).then_some(()),
    )
    .await;
    for n in 0..10 {
        let body = doc("QUIET", "1", json!({ "n": n }));
        let response = app.post_document(&body, None).await;
        let status = response.status();
        let answer: Value = response.json().await.expect("json");
        assert_eq!(status, StatusCode::ACCEPTED, "document {n}: {answer}");
    }
    stop.store(true, Ordering::Relaxed);
    for task in noise {
        task.await.expect("noise");
    }
    assert_eq!(app.outbox_count(None).await, 10);
}
