//! The Postgres connections: bounded statements and transactions, turns
//! taken fairly, no request waiting on a second connection.

use crate::support::app::TestEnv;
use crate::support::app::assert_problem;
use crate::support::app::client_with_key;
use crate::support::app::create_key;
use crate::support::app::until;
use reqwest::StatusCode;
use serde_json::json;
use std::time::Duration;

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
    let asked = std::time::Instant::now();
    let refused = client
        .get(app.url(&format!("/api/v1/documents/{id}")))
        .bearer_auth(&app.admin_key)
        .send()
        .await
        .expect("an answer while the pool is taken");
    // "At once rather than after 30 s": after the pool's acquire timeout
    // (300 ms here), far from the request timeout (30 s).
    let took = asked.elapsed();
    assert!(
        took < Duration::from_secs(app.env.request_timeout_s) / 10,
        "a request that found the pool taken was answered after {took:?}"
    );
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
