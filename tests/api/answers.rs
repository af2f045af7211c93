//! The answer and its record (SPEC promise 11): an error answer means
//! nothing was written, whatever the network or Redis does meanwhile.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use reqwest::StatusCode;
use serde_json::{Value, json};

use crate::support::app::{TestEnv, expect_postgres_trouble, until};
use crate::support::stall::StallingProxy;

/// What one request was and what it was answered.
#[derive(Debug, Clone)]
struct Sent {
    kind: &'static str,
    /// The document tags it carried (one per document), or the key of a
    /// keyed `POST /ids`.
    marks: Vec<String>,
    status: StatusCode,
    code: Option<String>,
    retry_after: bool,
    took: Duration,
}

/// Sends requests of `kind` one after another until `running` ends.
async fn send_until_stopped(
    client: reqwest::Client,
    base: String,
    kind: &'static str,
    running: Arc<AtomicBool>,
) -> Vec<Sent> {
    let mut sent = Vec::new();
    while running.load(Ordering::Relaxed) {
        let tag = uuid::Uuid::new_v4().simple().to_string();
        let document =
            |project: &str| json!({"project": project, "type": "1", "metadata": {"tag": tag}});
        let (request, marks) = match kind {
            "document" => (
                client
                    .post(format!("{base}/documents"))
                    .json(&document("STALL")),
                vec![tag.clone()],
            ),
            "keyed document" => (
                client
                    .post(format!("{base}/documents"))
                    .header("idempotency-key", &tag)
                    .json(&document("STALL")),
                vec![tag.clone()],
            ),
            "gapless document" => (
                client
                    .post(format!("{base}/documents"))
                    .json(&document("STALLG")),
                vec![tag.clone()],
            ),
            "batch" => {
                let tags: Vec<String> = (0..10).map(|i| format!("{tag}-{i}")).collect();
                let items: Vec<Value> = tags
                    .iter()
                    .map(|t| json!({"project": "STALL", "type": "1", "metadata": {"tag": t}}))
                    .collect();
                (
                    client
                        .post(format!("{base}/api/v1/documents/batch"))
                        .json(&json!({"documents": items})),
                    tags,
                )
            }
            _ => (
                client
                    .post(format!("{base}/ids"))
                    .header("idempotency-key", &tag)
                    .json(&json!({"project": "STALL", "type": "2", "count": 3})),
                vec![tag.clone()],
            ),
        };
        let started = Instant::now();
        let response = request.send().await.expect("the instance answers");
        let status = response.status();
        let retry_after = response.headers().contains_key("retry-after");
        let body: Value = response.json().await.unwrap_or(Value::Null);
        sent.push(Sent {
            kind,
            marks,
            status,
            code: body["code"].as_str().map(str::to_owned),
            retry_after,
            took: started.elapsed(),
        });
    }
    sent
}

/// One instance reaches Postgres through a network that stalls for 6 s
/// (its request timeout is 2 s) while clients send documents (plain,
/// keyed, gapless, in batches) and keyed `POST /ids`, each marked. Once
/// the network is back: every accepted document exists once, no document
/// or stored answer of an error answer exists, every error is a 503 with
/// Retry-After, and no number is lost (those of error answers went back).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_network_to_postgres_leaves_nothing_behind_an_error_answer() {
    let kinds = [
        "document",
        "document",
        "keyed document",
        "keyed document",
        "gapless document",
        "batch",
        "keyed ids",
        "keyed ids",
    ];
    stalled_network(&kinds, false).await;
}

/// The same with gapless documents alone, the stall starting right after
/// the gapless write stage's `COMMIT` reached the server and lasting past
/// `COMMIT_ANSWER_WAIT`: that commit landed, its answer did not come, and
/// it is looked up by its transaction id. Its documents are answered 202;
/// every error answer's document is absent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gapless_commit_whose_answer_is_lost_is_answered_as_it_landed() {
    stalled_network(&["gapless document"; 4], true).await;
}

/// Sends `kinds` through a stalling network (see the two tests above);
/// `in_doubt`: the stall starts right after a gapless `COMMIT` and lasts
/// past `COMMIT_ANSWER_WAIT`, else it starts at once and lasts 6 s.
async fn stalled_network(kinds: &[&'static str], in_doubt: bool) {
    let mut env = TestEnv::new();
    env.request_timeout_s = 2;
    let proxy = StallingProxy::start("127.0.0.1:5432").await;
    let direct = env.database_url.clone();
    env.database_url = proxy.url_for(&direct);
    env.direct_database_url = Some(direct);
    // The gapless write stage's connection: the one that takes numbers
    // from a gapless counter inside its commit (`Counter::take_gapless_unless_held`).
    proxy.mark_connections_sending("(SELECT first FROM taken) AS first, txid_current()");
    let app = env.spawn().await;
    app.define("STALLG", "1", json!({"numbering": "gapless"}))
        .await;
    // Every kind's sequence exists before the stall (a first use reads
    // and writes definitions).
    let pooled = kinds.iter().any(|kind| *kind != "gapless document");
    if pooled {
        for (project, doc_type) in [("STALL", "1"), ("STALL", "2")] {
            app.issue(project, doc_type, 1).await;
        }
    }

    let running = Arc::new(AtomicBool::new(true));
    let senders: Vec<_> = kinds
        .iter()
        .map(|&kind| {
            tokio::spawn(send_until_stopped(
                app.client.clone(),
                app.address.clone(),
                kind,
                running.clone(),
            ))
        })
        .collect();
    // Some answers before the stall, then 6 s of a hung network.
    let before = Instant::now();
    until(
        Duration::from_secs(20),
        "documents accepted before the stall",
        async || {
            sqlx::query_scalar::<_, i64>("SELECT count(*) FROM id_outbox")
                .fetch_one(&app.db)
                .await
                .is_ok_and(|n| n >= 200)
        },
    )
    .await;
    expect_postgres_trouble();
    let stall = if in_doubt {
        proxy.stall_after_next_marked_commit();
        until(
            Duration::from_secs(20),
            "a gapless commit stalled",
            async || proxy.is_stalled(),
        )
        .await;
        // Longer than a COMMIT's answer is waited for.
        idpool::infra::db::COMMIT_ANSWER_WAIT + Duration::from_secs(1)
    } else {
        proxy.stall();
        Duration::from_secs(6)
    };
    let stalled_at = before.elapsed();
    // The stall is what is tested, not a wait for something.
    tokio::time::sleep(stall).await;
    proxy.resume();
    // Requests after the network came back are answered again.
    let resumed = Instant::now();
    until(
        Duration::from_secs(30),
        "answers after the stall",
        async || {
            let (status, _) = app.get_json("/readyz").await;
            status == StatusCode::OK && resumed.elapsed() > Duration::from_secs(1)
        },
    )
    .await;
    running.store(false, Ordering::Relaxed);
    let mut sent = Vec::new();
    for sender in senders {
        sent.extend(sender.await.expect("sender"));
    }

    let documents: HashMap<String, i64> = sqlx::query_as(
        "SELECT payload->>'tag', count(*) FROM id_outbox WHERE payload ? 'tag' GROUP BY 1",
    )
    .fetch_all(&app.db)
    .await
    .expect("documents")
    .into_iter()
    .collect();
    let stored: std::collections::HashSet<String> =
        sqlx::query_scalar("SELECT key FROM idempotency_keys")
            .fetch_all(&app.db)
            .await
            .expect("stored answers")
            .into_iter()
            .collect();
    let written = |sent: &Sent, mark: &str| match sent.kind {
        "keyed ids" => i64::from(stored.contains(mark)),
        _ => documents.get(mark).copied().unwrap_or(0),
    };
    let mut errors = 0;
    let mut waited_through = 0;
    for one in &sent {
        if one.status.is_success() {
            if one.took > Duration::from_secs(2) {
                waited_through += 1;
            }
            for mark in &one.marks {
                assert_eq!(
                    written(one, mark),
                    1,
                    "{} answered {}: {one:?}",
                    mark,
                    one.status
                );
            }
            continue;
        }
        errors += 1;
        assert_eq!(one.status, StatusCode::SERVICE_UNAVAILABLE, "{one:?}");
        assert!(one.retry_after, "a 503 without Retry-After: {one:?}");
        assert!(
            matches!(one.code.as_deref(), Some("timeout" | "unavailable")),
            "{one:?}"
        );
        for mark in &one.marks {
            assert_eq!(
                written(one, mark),
                0,
                "an error answer's write landed after all: {one:?}"
            );
        }
    }
    let settled_gapless = sent
        .iter()
        .filter(|one| one.kind == "gapless document" && one.status.is_success())
        .filter(|one| one.took > idpool::infra::db::COMMIT_ANSWER_WAIT)
        .count();
    assert!(
        !in_doubt || settled_gapless > 0,
        "no gapless document of the commit in doubt was answered 202"
    );
    let answered_ok = sent.len() - errors;
    eprintln!(
        "stall at {stalled_at:?}: {} requests, {answered_ok} succeeded ({waited_through} of them \
         after waiting out the stall, {settled_gapless} gapless ones looked up), {errors} answered 503",
        sent.len()
    );
    assert!(errors > 0, "the stall cost no request: it did not stall");
    // Numbers an error answer's request had taken went back to their pool
    // (or rolled back with their transaction): none is lost.
    app.settle_and_reconcile().await;
    let pooled_types: &[&str] = if pooled { &["1", "2"] } else { &[] };
    for doc_type in pooled_types {
        for gap in app.gaps("STALL", doc_type).await {
            assert_eq!(
                gap["reason"], "issued_unattached",
                "STALL/{doc_type}: {gap}"
            );
        }
    }
}

/// SPEC: an error answer means nothing was written. A definition changed
/// while the pools' Redis hangs past the request's deadline (the PUT
/// trims the pools after its commit): the answer says what was done. It
/// was `503 timeout` ("nothing of it was written") while the change had
/// committed (a review found it with Redis down).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_definition_changed_while_redis_hangs_is_answered_as_done() {
    let redis = crate::support::redis_server::RedisServer::start();
    let mut env = TestEnv::new().with_redis(&redis.url());
    env.request_timeout_s = 1;
    env.redis_timeout_ms = 3000;
    let app = env.spawn().await;
    let created = app.put_sequence("HG", "1", json!({"pool_size": 20})).await;
    assert_eq!(created.status(), StatusCode::CREATED);
    app.issue("HG", "1", 5).await;
    redis.pause();
    let changed = app
        .put_sequence("HG", "1", json!({"pool_size": 20, "max": 100}))
        .await;
    let status = changed.status();
    let body: Value = changed.json().await.unwrap_or(Value::Null);
    redis.resume();
    let now: Value = app
        .client
        .get(app.url("/api/v1/sequences/HG/1"))
        .send()
        .await
        .expect("GET")
        .json()
        .await
        .expect("json");
    assert_eq!(
        now["max"],
        json!(100),
        "the change is made whatever the answer"
    );
    assert_eq!(
        status,
        StatusCode::OK,
        "answered {status} {body} for a change that was made"
    );
}
