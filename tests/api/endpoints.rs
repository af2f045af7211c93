//! Delivery endpoints per project: managed by their project only, guarded
//! against requests into the instance's network, signed with their own
//! secrets (both during a rotation), attempts recorded, dead letters and
//! disabling per endpoint, and one tenant's hanging endpoint delaying
//! nobody else's deliveries.

use std::collections::HashMap;
use std::process::Command;
use std::time::{Duration, Instant};

use reqwest::StatusCode;
use serde_json::{Value, json};

use crate::support::app::{
    TestApp, TestEnv, assert_problem, client_with_key, create_key, eventually, until,
};
use crate::support::endpoint::{Endpoint, Mode};

async fn create_endpoint(
    app: &TestApp,
    client: &reqwest::Client,
    body: Value,
) -> reqwest::Response {
    client
        .post(app.url("/api/v1/endpoints"))
        .json(&body)
        .send()
        .await
        .expect("request")
}

/// Registers `url` for `project`; the endpoint's id and secret.
async fn register(
    app: &TestApp,
    client: &reqwest::Client,
    project: &str,
    url: &str,
) -> (String, String) {
    let response = create_endpoint(app, client, json!({"project": project, "url": url})).await;
    assert_eq!(response.status(), StatusCode::CREATED);
    let created: Value = response.json().await.expect("json");
    (
        created["id"].as_str().expect("id").to_owned(),
        created["secret"].as_str().expect("secret").to_owned(),
    )
}

async fn accept(app: &TestApp, client: &reqwest::Client, project: &str, n: usize) -> String {
    let response = client
        .post(app.url("/documents"))
        .json(&json!({"project": project, "type": "INV", "metadata": {"n": n}}))
        .send()
        .await
        .expect("request");
    assert_eq!(response.status(), StatusCode::ACCEPTED);
    let answer: Value = response.json().await.expect("json");
    answer["id"].as_str().expect("id").to_owned()
}

async fn get(client: &reqwest::Client, url: &str) -> (StatusCode, Value) {
    let response = client.get(url).send().await.expect("request");
    let status = response.status();
    (status, response.json().await.unwrap_or(Value::Null))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_projects_endpoints_are_its_own_to_manage_and_nobody_elses_to_see() {
    let mut env = TestEnv::new();
    env.max_endpoints_per_project = 3;
    let app = env.spawn().await;
    let mine = client_with_key(Some(&create_key(&app.state, &["MINE"], false).await));
    let other = client_with_key(Some(&create_key(&app.state, &["OTHER"], false).await));

    let response = create_endpoint(
        &app,
        &mine,
        json!({"project": "MINE", "url": "http://127.0.0.1:9/in", "description": "ledger", "types": ["INV"]}),
    )
    .await;
    assert_eq!(response.status(), StatusCode::CREATED);
    let created: Value = response.json().await.unwrap();
    let id = created["id"].as_str().unwrap().to_owned();
    let secret = created["secret"].as_str().unwrap();
    assert!(secret.starts_with("whsec_"), "{created}");
    assert_eq!(created["types"], json!(["INV"]));
    assert_eq!(created["disabled"], false);

    // Read back, never with its secret.
    let endpoint_url = app.url(&format!("/api/v1/endpoints/{id}"));
    let (status, read) = get(&mine, &endpoint_url).await;
    assert_eq!(status, StatusCode::OK);
    assert!(read.get("secret").is_none(), "{read}");
    assert!(!read.to_string().contains(secret));
    let (_, listed) = get(&mine, &app.url("/api/v1/endpoints?project=MINE")).await;
    assert_eq!(listed["endpoints"].as_array().unwrap().len(), 1, "{listed}");
    assert!(!listed.to_string().contains(secret));

    // Another project's key meets what a missing endpoint answers.
    let (status, foreign) = get(&other, &endpoint_url).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    let (_, missing) = get(
        &other,
        &app.url("/api/v1/endpoints/ep_000000000000000000000000"),
    )
    .await;
    assert_eq!(foreign, missing);
    for response in [
        other
            .patch(&endpoint_url)
            .json(&json!({"description": "mine now"}))
            .send()
            .await
            .unwrap(),
        other.delete(&endpoint_url).send().await.unwrap(),
        other
            .post(format!("{endpoint_url}/rotate-secret"))
            .send()
            .await
            .unwrap(),
        other
            .get(format!("{endpoint_url}/attempts"))
            .send()
            .await
            .unwrap(),
    ] {
        assert_problem(response, StatusCode::NOT_FOUND, "endpoint_not_found").await;
    }
    assert_problem(
        other
            .get(app.url("/api/v1/endpoints?project=MINE"))
            .send()
            .await
            .unwrap(),
        StatusCode::NOT_FOUND,
        "project_not_found",
    )
    .await;
    assert_problem(
        create_endpoint(
            &app,
            &other,
            json!({"project": "MINE", "url": "http://127.0.0.1:9/"}),
        )
        .await,
        StatusCode::NOT_FOUND,
        "project_not_found",
    )
    .await;

    // Changes: types back to every type with null; bad input changes nothing.
    let patched: Value = mine
        .patch(&endpoint_url)
        .json(&json!({"types": null, "description": "all of them"}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(patched["types"], Value::Null, "{patched}");
    assert_eq!(patched["description"], "all of them");
    for bad in [
        json!({"types": []}),
        json!({"types": ["no-dashes"]}),
        json!({"url": "ftp://127.0.0.1/"}),
        json!({"colour": "red"}),
    ] {
        let response = mine.patch(&endpoint_url).json(&bad).send().await.unwrap();
        assert_eq!(response.status(), StatusCode::BAD_REQUEST, "{bad}");
    }
    let (_, unchanged) = get(&mine, &endpoint_url).await;
    assert_eq!(unchanged["description"], "all of them");

    // At most IDPOOL_MAX_ENDPOINTS_PER_PROJECT, per project.
    for _ in 0..2 {
        register(&app, &mine, "MINE", "http://127.0.0.1:9/more").await;
    }
    assert_problem(
        create_endpoint(
            &app,
            &mine,
            json!({"project": "MINE", "url": "http://127.0.0.1:9/x"}),
        )
        .await,
        StatusCode::CONFLICT,
        "endpoint_limit_reached",
    )
    .await;
    register(&app, &other, "OTHER", "http://127.0.0.1:9/theirs").await;

    // Paged in the order they were made.
    let (_, first) = get(&mine, &app.url("/api/v1/endpoints?project=MINE&limit=2")).await;
    let cursor = first["next_cursor"]
        .as_str()
        .expect("a next page")
        .to_owned();
    let (_, second) = get(
        &mine,
        &app.url(&format!(
            "/api/v1/endpoints?project=MINE&limit=2&cursor={cursor}"
        )),
    )
    .await;
    assert_eq!(second["endpoints"].as_array().unwrap().len(), 1, "{second}");
    assert_eq!(second["next_cursor"], Value::Null);

    let response = mine.delete(&endpoint_url).send().await.unwrap();
    assert_eq!(response.status(), StatusCode::NO_CONTENT);
    let (status, _) = get(&mine, &endpoint_url).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn endpoint_urls_into_the_instances_own_network_are_refused() {
    let mut env = TestEnv::new();
    env.endpoints_allow_private = false;
    let app = env.spawn().await;
    let client = client_with_key(Some(&create_key(&app.state, &["P"], false).await));
    for url in [
        "http://127.0.0.1/in",
        "http://169.254.169.254/latest/meta-data/",
        "http://[::1]/in",
        "http://0x7f.1/in",
        "http://2130706433/in",
        "http://10.0.0.8/in",
        "http://[fd00::1]/in",
        "http://localhost:8080/in",
        "file:///etc/passwd",
        "gopher://example.com/",
    ] {
        let problem = assert_problem(
            create_endpoint(&app, &client, json!({"project": "P", "url": url})).await,
            StatusCode::BAD_REQUEST,
            "invalid_endpoint_url",
        )
        .await;
        assert!(
            problem["detail"].as_str().unwrap().starts_with("url: "),
            "{problem}"
        );
    }
    let (_, listed) = get(&client, &app.url("/api/v1/endpoints?project=P")).await;
    assert_eq!(listed["endpoints"], json!([]), "nothing was saved");
}

/// Checks signatures as a receiver would, with the `standardwebhooks`
/// library (PyPI): for each (secret, request), whether it verifies.
fn verified_by_standard_webhooks(
    checks: &[(&str, &crate::support::endpoint::Request)],
) -> Vec<bool> {
    let sdk = crate::clients::tools();
    let input: Vec<Value> = checks
        .iter()
        .map(|(secret, request)| {
            json!({
                "secret": secret,
                "body": String::from_utf8(request.body.clone()).expect("utf-8 body"),
                "headers": {
                    "webhook-id": request.webhook_id,
                    "webhook-timestamp": request.timestamp,
                    "webhook-signature": request.signature,
                },
            })
        })
        .collect();
    let script = r#"
import json, sys
from standardwebhooks.webhooks import Webhook
results = []
for check in json.load(sys.stdin):
    try:
        Webhook(check["secret"]).verify(check["body"], check["headers"])
        results.append(True)
    except Exception:
        results.append(False)
print(json.dumps(results))
"#;
    let mut child = Command::new(sdk.join("venv/bin/python"))
        .args(["-c", script])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("python");
    use std::io::Write as _;
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(serde_json::to_string(&input).unwrap().as_bytes())
        .expect("write");
    let output = child.wait_with_output().expect("python ran");
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).expect("results")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn documents_go_to_their_projects_endpoints_signed_with_every_live_secret() {
    let mut env = TestEnv::new();
    env.outbox_poll_ms = 200;
    let app = env.spawn().await;
    let client = client_with_key(Some(&create_key(&app.state, &["SIGN"], false).await));
    let target = Endpoint::start(Mode::Answer(204)).await;
    let (endpoint_id, first_secret) = register(&app, &client, "SIGN", &target.url).await;

    let first = accept(&app, &client, "SIGN", 1).await;
    app.wait_for_status(&first, "committed", Duration::from_secs(10))
        .await;
    // As through the sink, retry_count counts the attempts that failed.
    let delivered = app.document(&first).await;
    assert_eq!(delivered["retry_count"], 0, "{delivered}");
    let routed_to_the_sink: i64 =
        sqlx::query_scalar("SELECT count(*) FROM documents WHERE document_id = $1")
            .bind(&first)
            .fetch_one(&app.db)
            .await
            .unwrap();
    assert_eq!(
        routed_to_the_sink, 0,
        "a project with an endpoint bypasses the sink"
    );

    let rotated: Value = client
        .post(app.url(&format!("/api/v1/endpoints/{endpoint_id}/rotate-secret")))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let second_secret = rotated["secret"].as_str().unwrap().to_owned();
    assert_ne!(second_secret, first_secret);
    assert!(rotated["previous_expires_at"].is_string(), "{rotated}");
    let second = accept(&app, &client, "SIGN", 2).await;
    app.wait_for_status(&second, "committed", Duration::from_secs(10))
        .await;

    let requests = target.requests();
    let before = requests
        .iter()
        .find(|r| r.document_id == first)
        .expect("first sent");
    let during = requests
        .iter()
        .find(|r| r.document_id == second)
        .expect("second sent");
    assert_eq!(before.webhook_id, first);
    assert_eq!(
        during.signature.split(' ').count(),
        2,
        "{}",
        during.signature
    );
    let wrong = idpool::features::endpoints::new_secret();
    assert_eq!(
        verified_by_standard_webhooks(&[
            (&first_secret, before),
            (&first_secret, during),
            (&second_secret, during),
            (&second_secret, before),
            (&wrong, during),
        ]),
        [true, true, true, false, false]
    );

    // What the project reads back: per endpoint, and per attempt.
    let (_, deliveries) = get(
        &client,
        &app.url(&format!("/api/v1/documents/{second}/deliveries")),
    )
    .await;
    assert_eq!(
        deliveries["deliveries"][0]["endpoint_id"], endpoint_id,
        "{deliveries}"
    );
    assert_eq!(deliveries["deliveries"][0]["status"], "committed");
    assert_eq!(deliveries["deliveries"][0]["attempts"], 1);
    let (_, attempts) = get(
        &client,
        &app.url(&format!("/api/v1/endpoints/{endpoint_id}/attempts?limit=1")),
    )
    .await;
    assert_eq!(
        attempts["attempts"][0]["document_id"], second,
        "newest first: {attempts}"
    );
    assert_eq!(attempts["attempts"][0]["status_code"], 204);
    let cursor = attempts["next_cursor"].as_str().expect("a second page");
    let (_, older) = get(
        &client,
        &app.url(&format!(
            "/api/v1/endpoints/{endpoint_id}/attempts?cursor={cursor}"
        )),
    )
    .await;
    assert_eq!(older["attempts"][0]["document_id"], first, "{older}");
    assert_eq!(older["next_cursor"], Value::Null);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_endpoint_dead_letters_its_own_deliveries_and_is_disabled() {
    let mut env = TestEnv::new();
    env.outbox_poll_ms = 100;
    env.outbox_max_retries = 2;
    env.outbox_backoff_base_ms = 10;
    env.outbox_backoff_max_ms = 50;
    env.endpoint_circuit_max_s = 1;
    env.endpoint_disable_after_s = 2;
    let app = env.spawn().await;
    let client = client_with_key(Some(&create_key(&app.state, &["FAIL"], false).await));
    let failing = Endpoint::start(Mode::Answer(500)).await;
    let working = Endpoint::start(Mode::Answer(200)).await;
    let (failing_id, _) = register(&app, &client, "FAIL", &failing.url).await;
    let (working_id, _) = register(&app, &client, "FAIL", &working.url).await;

    let id = accept(&app, &client, "FAIL", 0).await;
    app.wait_for_status(&id, "dead_letter", Duration::from_secs(15))
        .await;
    let (_, deliveries) = get(
        &client,
        &app.url(&format!("/api/v1/documents/{id}/deliveries")),
    )
    .await;
    let by_endpoint: HashMap<&str, &Value> = deliveries["deliveries"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| (d["endpoint_id"].as_str().unwrap(), d))
        .collect();
    assert_eq!(
        by_endpoint[failing_id.as_str()]["status"],
        "dead_letter",
        "{deliveries}"
    );
    assert_eq!(by_endpoint[failing_id.as_str()]["attempts"], 2);
    assert_eq!(by_endpoint[failing_id.as_str()]["last_error"], "HTTP 500");
    assert_eq!(by_endpoint[working_id.as_str()]["status"], "committed");
    assert_eq!(working.delivered(), 1, "the working endpoint got it once");

    // A dead letter is retried per endpoint: the working one is not sent it again.
    let url = app.url(&format!("/api/v1/outbox/{id}/retry"));
    let retried = client
        .post(&url)
        .json(&json!({"endpoint_id": failing_id}))
        .send()
        .await
        .unwrap();
    assert_eq!(retried.status(), StatusCode::OK);
    app.wait_for_status(&id, "dead_letter", Duration::from_secs(15))
        .await;
    assert_eq!(failing.requests().len(), 4);
    assert_eq!(working.requests().len(), 1);

    // Failing for IDPOOL_ENDPOINT_DISABLE_AFTER_S: disabled, and said so.
    let endpoint_url = app.url(&format!("/api/v1/endpoints/{failing_id}"));
    let mut n = 1;
    let disabled = eventually(
        Duration::from_secs(20),
        "the failing endpoint disabled",
        async || {
            n += 1;
            accept(&app, &client, "FAIL", n).await;
            let (_, endpoint) = get(&client, &endpoint_url).await;
            (endpoint["disabled"] == true).then_some(endpoint)
        },
    )
    .await;
    assert_eq!(disabled["disabled_reason"], "failing", "{disabled}");
    assert!(disabled["failing_since"].is_string());
    let (_, working_now) = get(
        &client,
        &app.url(&format!("/api/v1/endpoints/{working_id}")),
    )
    .await;
    assert_eq!(working_now["disabled"], false, "the other endpoint stays");

    // Enabled again and answering: what was retried is delivered.
    failing.set(Mode::Answer(200));
    client
        .post(&url)
        .json(&json!({"endpoint_id": failing_id}))
        .send()
        .await
        .unwrap();
    let enabled: Value = client
        .patch(&endpoint_url)
        .json(&json!({"disabled": false}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(enabled["disabled_reason"], Value::Null, "{enabled}");
    app.wait_for_status(&id, "committed", Duration::from_secs(15))
        .await;
}

/// Accepts `count` documents of `project` in batches; when each batch was
/// accepted, per document.
async fn accept_many(
    app: &TestApp,
    client: &reqwest::Client,
    project: &str,
    count: usize,
    batch: usize,
) -> HashMap<String, Instant> {
    let mut accepted = HashMap::new();
    let mut sent = 0;
    while sent < count {
        let size = batch.min(count - sent);
        let documents: Vec<Value> = (0..size)
            .map(|n| json!({"project": project, "type": "INV", "metadata": {"n": sent + n}}))
            .collect();
        let response = client
            .post(app.url("/api/v1/documents/batch"))
            .json(&json!({"documents": documents}))
            .send()
            .await
            .expect("request");
        assert_eq!(
            response.status(),
            StatusCode::ACCEPTED,
            "batch of {project}"
        );
        let at = Instant::now();
        let answer: Value = response.json().await.expect("json");
        for document in answer["documents"].as_array().expect("documents") {
            accepted.insert(document["id"].as_str().expect("id").to_owned(), at);
        }
        sent += size;
    }
    accepted
}

/// B's documents, accepted 100 at a time: the slowest one's time from
/// acceptance to its endpoint, and B's deliveries per second.
async fn tenant_b_round(app: &TestApp, client: &reqwest::Client, b: &Endpoint) -> (Duration, f64) {
    let before = b.delivered();
    let started = Instant::now();
    let accepted = accept_many(app, client, "TB", 1_000, 100).await;
    println!("accepted in {:?}", started.elapsed());
    until(
        Duration::from_secs(60),
        "B's documents delivered",
        async || b.delivered() >= before + accepted.len(),
    )
    .await;
    let requests = b.requests();
    let mut slowest = Duration::ZERO;
    let mut last = started;
    for request in requests
        .iter()
        .filter(|r| accepted.contains_key(&r.document_id))
    {
        slowest = slowest.max(
            request
                .arrived
                .saturating_duration_since(accepted[&request.document_id]),
        );
        last = last.max(request.arrived);
    }
    let rate = accepted.len() as f64 / last.duration_since(started).as_secs_f64();
    (slowest, rate)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hanging_endpoint_with_a_backlog_delays_only_its_own_tenant() {
    let mut env = TestEnv::new();
    env.outbox_poll_ms = 200;
    env.webhook_timeout_ms = 1_000;
    env.outbox_backoff_base_ms = 100;
    env.outbox_backoff_max_ms = 1_000;
    env.outbox_max_retries = 50;
    env.endpoint_circuit_max_s = 2;
    let app = env.spawn().await;
    let client_a = client_with_key(Some(&create_key(&app.state, &["TA"], false).await));
    let client_b = client_with_key(Some(&create_key(&app.state, &["TB"], false).await));
    let a = Endpoint::start(Mode::Hang).await;
    let b = Endpoint::start(Mode::Answer(200)).await;
    register(&app, &client_a, "TA", &a.url).await;
    register(&app, &client_b, "TB", &b.url).await;

    let (alone_slowest, alone_rate) = tenant_b_round(&app, &client_b, &b).await;

    let backlog = accept_many(&app, &client_a, "TA", 20_000, 1_000).await;
    let hang_started = Instant::now();
    until(
        Duration::from_secs(10),
        "A's endpoint holding requests",
        async || !a.requests().is_empty(),
    )
    .await;
    let (beside_slowest, beside_rate) = tenant_b_round(&app, &client_b, &b).await;
    // B's other requests meanwhile: never a 503.
    for _ in 0..50 {
        let response = client_b
            .post(app.url("/ids"))
            .json(&json!({"project": "TB", "type": "INV"}))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), StatusCode::OK);
    }
    println!(
        "B alone: slowest {alone_slowest:?}, {alone_rate:.0}/s; beside A hanging: slowest {beside_slowest:?}, {beside_rate:.0}/s"
    );
    assert!(
        beside_slowest <= Duration::from_secs(2),
        "B's slowest delivery took {beside_slowest:?}"
    );
    assert!(
        beside_rate >= alone_rate / 2.0,
        "B delivered {beside_rate:.0}/s beside A, {alone_rate:.0}/s alone"
    );
    // Its circuit stops the hammering: a first round of its cap, then one
    // probe at a time, at most one a second.
    let sent_while_hanging = a.requests().len();
    let hung_for = hang_started.elapsed().as_secs() as usize;
    assert!(
        sent_while_hanging <= 2 * 8 + hung_for,
        "A was sent {sent_while_hanging} requests in {hung_for} s of hanging"
    );

    // A answers again: its backlog is delivered, none lost, and a document
    // is sent again only after an attempt that was never answered.
    a.set(Mode::Answer(200));
    until(
        Duration::from_secs(180),
        "A's backlog delivered",
        async || a.delivered() >= backlog.len(),
    )
    .await;
    let per_document = a.requests_per_document();
    assert_eq!(per_document.len(), backlog.len());
    for (document, requests) in &per_document {
        assert!(backlog.contains_key(document));
        let (last, earlier) = requests.split_last().expect("sent");
        assert_eq!(last.status, Some(200), "{document}");
        for request in earlier {
            assert_eq!(
                request.status, None,
                "{document} sent again after an answer"
            );
        }
        assert!(requests.iter().all(|r| r.webhook_id == *document));
    }
    until(
        Duration::from_secs(30),
        "A's documents committed",
        async || {
            let unsettled: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM id_outbox WHERE tenant_code = 'TA' AND status <> 'committed'",
            )
            .fetch_one(&app.db)
            .await
            .unwrap();
            unsettled == 0
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_an_endpoint_with_a_backlog_is_quick_and_abandons_it_for_that_endpoint_only() {
    let mut env = TestEnv::new();
    env.outbox_poll_ms = 200;
    let app = env.spawn().await;
    let client = client_with_key(Some(&create_key(&app.state, &["DEL"], false).await));
    let other = client_with_key(Some(&create_key(&app.state, &["KEEP"], false).await));
    let target = Endpoint::start(Mode::Answer(200)).await;
    let (endpoint_id, _) = register(&app, &client, "DEL", &target.url).await;
    // Disabled: its deliveries wait, pending.
    client
        .patch(app.url(&format!("/api/v1/endpoints/{endpoint_id}")))
        .json(&json!({"disabled": true}))
        .send()
        .await
        .unwrap();
    register(&app, &other, "KEEP", &target.url).await;
    let backlog = accept_many(&app, &client, "DEL", 5_000, 1_000).await;
    let pending: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM endpoint_deliveries WHERE endpoint_id = $1 AND status = 'pending'",
    )
    .bind(&endpoint_id)
    .fetch_one(&app.db)
    .await
    .unwrap();
    assert_eq!(pending, 0, "a disabled endpoint takes no new documents");
    client
        .patch(app.url(&format!("/api/v1/endpoints/{endpoint_id}")))
        .json(&json!({"disabled": false}))
        .send()
        .await
        .unwrap();
    target.set(Mode::Hang);
    let backlog_too = accept_many(&app, &client, "DEL", 5_000, 1_000).await;

    // The delete is one row, however large the backlog; the sweep follows.
    let response = client
        .delete(app.url(&format!("/api/v1/endpoints/{endpoint_id}")))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::NO_CONTENT);
    target.set(Mode::Answer(200));
    let kept = accept(&app, &other, "KEEP", 0).await;
    app.wait_for_status(&kept, "committed", Duration::from_secs(10))
        .await;
    until(Duration::from_secs(60), "the deleted endpoint's backlog abandoned", async || {
        let unsettled: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM id_outbox WHERE tenant_code = 'DEL' AND routed AND status = 'pending'",
        )
        .fetch_one(&app.db)
        .await
        .unwrap();
        unsettled == 0
    })
    .await;
    let some = backlog_too.keys().next().unwrap();
    let document = app.document(some).await;
    // Delivered before the delete, or abandoned for the deleted endpoint.
    assert!(
        document["status"] == "abandoned" || document["status"] == "committed",
        "{document}"
    );
    if document["status"] == "abandoned" {
        assert_eq!(document["last_error"], "endpoint deleted", "{document}");
    }
    // The first backlog went to the sink while the endpoint was disabled.
    let first = backlog.keys().next().unwrap();
    assert_eq!(app.document(first).await["status"], "committed");
}

/// A rotation's answer promises the secret it replaced signs until
/// `previous_expires_at`: a second rotation before then is refused and
/// changes nothing, and of ten at once exactly one rotates. (A review
/// rotated twice and the first secret stopped signing at once; ten at
/// once answered ten secrets of which two ever signed.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rotation_keeps_the_promise_of_the_one_before() {
    let app = TestEnv::new().spawn().await;
    let mine = client_with_key(Some(&create_key(&app.state, &["TURN"], false).await));
    let rotate = async |id: &str| {
        mine.post(app.url(&format!("/api/v1/endpoints/{id}/rotate-secret")))
            .send()
            .await
            .unwrap()
    };
    let (id, _) = register(&app, &mine, "TURN", "http://127.0.0.1:9/in").await;
    let first = rotate(&id).await;
    assert_eq!(first.status(), StatusCode::OK);
    let promised: Value = first.json().await.unwrap();
    let until = promised["previous_expires_at"].as_str().unwrap().to_owned();
    let again = rotate(&id).await;
    let problem = assert_problem(again, StatusCode::CONFLICT, "secret_rotation_pending").await;
    assert!(
        problem["detail"].as_str().unwrap().contains(&until[..19]),
        "{problem} names {until}"
    );

    let (other, _) = register(&app, &mine, "TURN", "http://127.0.0.1:9/other").await;
    let answers =
        futures::future::join_all((0..10).map(|_| async { rotate(&other).await.status() })).await;
    let rotated = answers.iter().filter(|s| **s == StatusCode::OK).count();
    let refused = answers
        .iter()
        .filter(|s| **s == StatusCode::CONFLICT)
        .count();
    assert_eq!((rotated, refused), (1, 9), "{answers:?}");
}

/// An abandon answered while an attempt is under way would be contradicted
/// by its outcome (the target takes the document): it is refused with
/// `409 delivery_in_flight` and a Retry-After, and changes nothing; once
/// the attempt has ended the document's status says what happened.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_document_whose_delivery_is_under_way_is_not_abandoned() {
    let mut env = TestEnv::new();
    env.outbox_poll_ms = 200;
    let app = env.spawn().await;
    let client = client_with_key(Some(&create_key(&app.state, &["FLIGHT"], false).await));
    let target = Endpoint::start(Mode::Hang).await;
    register(&app, &client, "FLIGHT", &target.url).await;
    let id = accept(&app, &client, "FLIGHT", 1).await;
    crate::support::app::eventually(Duration::from_secs(10), "the attempt begins", async || {
        (!target.requests().is_empty()).then_some(())
    })
    .await;

    let abandon = client
        .post(app.url(&format!("/api/v1/outbox/{id}/abandon")))
        .send()
        .await
        .expect("abandon");
    assert_eq!(abandon.status(), StatusCode::CONFLICT);
    assert!(
        abandon.headers().contains_key("retry-after"),
        "{:?}",
        abandon.headers()
    );
    let problem: Value = abandon.json().await.expect("problem");
    assert_eq!(problem["code"], "delivery_in_flight", "{problem}");
    assert_eq!(app.document(&id).await["status"], "pending");

    target.set(Mode::Answer(204));
    app.wait_for_status(&id, "committed", Duration::from_secs(10))
        .await;
    let late = client
        .post(app.url(&format!("/api/v1/outbox/{id}/abandon")))
        .send()
        .await
        .expect("abandon");
    assert_eq!(late.status(), StatusCode::CONFLICT);
    let problem: Value = late.json().await.expect("problem");
    assert_eq!(problem["code"], "not_abandonable", "{problem}");
    assert_eq!(app.document(&id).await["status"], "committed");
}
