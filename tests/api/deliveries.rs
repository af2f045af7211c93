//! Deliveries of the outbox: signed webhooks, what a target answers, dead
//! letters, and listing the outbox beside a huge one.

use crate::support::app::TestEnv;
use crate::support::app::assert_problem;
use crate::support::app::client_with_key;
use crate::support::app::create_key;
use crate::support::app::until;
use crate::support::probes::*;
use base64::Engine as _;
use reqwest::StatusCode;
use serde_json::Value;
use serde_json::json;
use std::time::Duration;
use std::time::Instant;

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

/// The credentials and query string of a webhook URL are secrets: no line
/// of the instance's log names them, at any level, whatever the delivery
/// met (accepted, refused, redirected).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_log_line_names_a_webhook_urls_credentials_or_query() {
    let (address, _received) = receiver().await;
    let dir = tempfile::tempdir().unwrap();
    for door in ["hook", "huge", "moved"] {
        let mut env = TestEnv::new();
        env.auth = false;
        env.sink = idpool::features::documents::sink::SinkConfig::Webhook(format!(
            "http://user:pw@{address}/{door}?token=s3cret"
        ));
        env.outbox_max_retries = 1;
        env.outbox_poll_ms = 50;
        let log = dir.path().join(format!("{door}.log"));
        crate::support::app::expect_error_lines("dead letter");
        let instance = crate::support::app::ServeProcess::start_logging(&env, &log, "debug").await;
        let base = format!("http://127.0.0.1:{}", instance.port);
        let client = client_with_key(None);
        let accepted: Value = client
            .post(format!("{base}/documents"))
            .json(&json!({"project": "WL", "type": "1", "metadata": {}}))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let url = format!(
            "{base}/api/v1/documents/{}",
            accepted["id"].as_str().unwrap()
        );
        until(Duration::from_secs(15), "the delivery ends", async || {
            let document: Value = client.get(&url).send().await.unwrap().json().await.unwrap();
            document["status"] != "pending"
        })
        .await;
        let said = instance.log_text();
        assert!(said.lines().count() > 10, "a debug log was written: {said}");
        for secret in ["s3cret", "token=", "user:pw", ":pw@"] {
            assert!(
                !said.contains(secret),
                "the log of a delivery to /{door} shows {secret}:\n{}",
                said.lines()
                    .filter(|l| l.contains(secret))
                    .collect::<Vec<_>>()
                    .join("\n")
            );
        }
    }
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
    // The small tenant's largest listing, alone: the yardstick.
    let listing = app.url("/api/v1/outbox?status=committed&limit=1000");
    let alone = timed(10, async |_| {
        let page: Value = small
            .get(&listing)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(
            page["documents"].as_array().map(Vec::len),
            Some(3),
            "{page}"
        );
    })
    .await;
    let neighbour = Neighbour::start(&app, "HUGE").await;
    // Rounds of the largest listings the small tenant may ask for, sixty
    // at once: each costs its own page (sixty at once on two cores wait
    // for each other: the slowest-answer bound, not the 90th percentile).
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
            assert_answer_within("sixty listings at once", "a listing of three", &alone, took);
        }
    }
    neighbour.assert_unharmed("sixty listings at once").await;

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

/// A webhook that takes its time holds no Postgres connection meanwhile:
/// the batch's claim is committed before anything is sent, and nothing of
/// the instance sits in a transaction while the target thinks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_webhook_that_thinks_holds_no_postgres_connection_meanwhile() {
    let target =
        crate::support::webhook::Webhook::start(crate::support::webhook::Behaviour::Succeed).await;
    target.slow_down(Duration::from_secs(3));
    let mut env = TestEnv::new();
    env.sink = idpool::features::documents::sink::SinkConfig::Webhook(target.url.clone());
    env.outbox_poll_ms = 100;
    let app = env.spawn().await;
    let mut ids = Vec::new();
    for _ in 0..40 {
        ids.push(app.accept("SLOW", "1").await);
    }
    // The claim shows as pending rows no longer due for a while.
    crate::support::app::until(
        Duration::from_secs(10),
        "a batch claimed and under way",
        async || {
            let held: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM id_outbox WHERE status = 'pending' \
               AND next_retry_at > now() + interval '10 seconds'",
            )
            .fetch_one(&app.db)
            .await
            .unwrap();
            held > 0
        },
    )
    .await;
    let in_transaction: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() \
           AND pid <> pg_backend_pid() AND state LIKE 'idle in transaction%'",
    )
    .fetch_one(&app.db)
    .await
    .unwrap();
    assert_eq!(
        in_transaction, 0,
        "a connection waits in a transaction while the target thinks"
    );
    for id in &ids {
        app.wait_for_status(id, "committed", Duration::from_secs(60))
            .await;
    }
    assert_eq!(target.most_at_once_per_document(), 1);
}

/// The sink's side of `endpoints::a_document_whose_delivery_is_under_way_
/// is_not_abandoned`: a webhook attempt under way keeps its document from
/// being abandoned (409 `delivery_in_flight`, Retry-After), and the
/// document ends as the attempt did.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_document_the_sink_is_delivering_is_not_abandoned() {
    let webhook =
        crate::support::webhook::Webhook::start(crate::support::webhook::Behaviour::Succeed).await;
    webhook.slow_down(Duration::from_secs(3));
    let mut env = TestEnv::new();
    env.sink = idpool::features::documents::sink::SinkConfig::Webhook(webhook.url.clone());
    env.outbox_poll_ms = 100;
    let app = env.spawn().await;
    let response = app
        .post_document(
            &json!({"project": "SINKF", "type": "1", "metadata": {}}),
            None,
        )
        .await;
    assert_eq!(response.status(), StatusCode::ACCEPTED);
    let id = response.json::<Value>().await.expect("json")["id"]
        .as_str()
        .expect("id")
        .to_owned();
    until(Duration::from_secs(10), "the attempt begins", async || {
        webhook.most_at_once_per_document() >= 1
    })
    .await;

    let abandon = app
        .client
        .post(app.url(&format!("/api/v1/outbox/{id}/abandon")))
        .send()
        .await
        .expect("abandon");
    assert_eq!(abandon.status(), StatusCode::CONFLICT);
    assert!(abandon.headers().contains_key("retry-after"));
    let problem: Value = abandon.json().await.expect("problem");
    assert_eq!(problem["code"], "delivery_in_flight", "{problem}");
    app.wait_for_status(&id, "committed", Duration::from_secs(15))
        .await;
}
