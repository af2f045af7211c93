//! API keys: every protected operation of the OpenAPI document refuses a
//! missing or revoked key, a key never reaches outside its projects, admin
//! operations need an admin key, Idempotency-Keys and rate limits are per
//! key, and no log line ever holds a secret.

use crate::support::app::until;
use crate::support::probes::*;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpSocket;

use std::collections::{BTreeSet, HashMap};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use reqwest::{Method, StatusCode};
use serde_json::{Value, json};

use crate::support::app::eventually;
use crate::support::app::{
    ServeProcess, TestApp, TestEnv, assert_problem, client_with_key, create_key, create_key_with_id,
};

/// A request for an operation, aimed at `project`'s resources.
struct Aimed {
    method: Method,
    path: String,
    body: Option<Value>,
}

/// How to call each operation of the document at a project's resources.
/// An operation missing here fails the test: a new route cannot be left
/// out of the checks.
fn aim(operation: &str, project: &str) -> Option<Aimed> {
    let document = format!("{project}-T-2");
    let (method, path, body) = match operation {
        "issue_ids" => (
            Method::POST,
            "/api/v1/ids".to_owned(),
            Some(json!({"project": project, "type": "T"})),
        ),
        "issue_ids_short" => (
            Method::POST,
            "/ids".to_owned(),
            Some(json!({"project": project, "type": "T"})),
        ),
        "create_document" => (
            Method::POST,
            "/api/v1/documents".to_owned(),
            Some(json!({"project": project, "type": "T", "metadata": {}})),
        ),
        "create_document_short" => (
            Method::POST,
            "/documents".to_owned(),
            Some(json!({"project": project, "type": "T", "metadata": {}})),
        ),
        "create_batch" => (
            Method::POST,
            "/api/v1/documents/batch".to_owned(),
            Some(json!({"documents": [{"project": project, "type": "T", "metadata": {}}]})),
        ),
        "get_document" => (Method::GET, format!("/api/v1/documents/{document}"), None),
        "list_gaps" => (
            Method::GET,
            format!("/api/v1/ids/gaps?project={project}&type=T"),
            None,
        ),
        "reconcile_now" => (Method::POST, "/api/v1/ids/gaps/reconcile".to_owned(), None),
        "list_outbox" => (
            Method::GET,
            format!("/api/v1/outbox?project={project}"),
            None,
        ),
        "retry_document" => (
            Method::POST,
            format!("/api/v1/outbox/{document}/retry"),
            None,
        ),
        "abandon_document" => (
            Method::POST,
            format!("/api/v1/outbox/{document}/abandon"),
            None,
        ),
        "void_id" => (
            Method::POST,
            "/api/v1/ids/void".to_owned(),
            Some(json!({"project": project, "type": "T", "id": document, "reason": "r"})),
        ),
        "list_sequences" => (Method::GET, "/api/v1/sequences".to_owned(), None),
        "get_sequence" => (Method::GET, format!("/api/v1/sequences/{project}/T"), None),
        "put_sequence" => (
            Method::PUT,
            format!("/api/v1/sequences/{project}/T"),
            Some(json!({"pool_size": 50})),
        ),
        "create_endpoint" => (
            Method::POST,
            "/api/v1/endpoints".to_owned(),
            Some(json!({"project": project, "url": "http://127.0.0.1:9/in"})),
        ),
        "list_endpoints" => (
            Method::GET,
            format!("/api/v1/endpoints?project={project}"),
            None,
        ),
        "get_endpoint" => (Method::GET, endpoint_path(project, ""), None),
        "update_endpoint" => (
            Method::PATCH,
            endpoint_path(project, ""),
            Some(json!({"description": "changed"})),
        ),
        "delete_endpoint" => (Method::DELETE, endpoint_path(project, ""), None),
        "rotate_secret" => (Method::POST, endpoint_path(project, "/rotate-secret"), None),
        "list_attempts" => (Method::GET, endpoint_path(project, "/attempts"), None),
        "document_deliveries" => (
            Method::GET,
            format!("/api/v1/documents/{document}/deliveries"),
            None,
        ),
        "list_entries" => (
            Method::GET,
            format!("/api/v1/registers/{project}/T/entries"),
            None,
        ),
        "verify_register" => (
            Method::GET,
            format!("/api/v1/registers/{project}/T/verify"),
            None,
        ),
        "get_checkpoint" => (
            Method::GET,
            format!("/api/v1/registers/{project}/checkpoint"),
            None,
        ),
        "inclusion_proof" => (
            Method::GET,
            format!("/api/v1/registers/{project}/proofs/inclusion?index=0&tree_size=1"),
            None,
        ),
        "consistency_proof" => (
            Method::GET,
            format!("/api/v1/registers/{project}/proofs/consistency?from=1&to=1"),
            None,
        ),
        _ => return None,
    };
    Some(Aimed { method, path, body })
}

/// The endpoint the test gives a project: `ep_` and the project's code
/// in hex, padded (project Z's exists nowhere).
fn endpoint_id(project: &str) -> String {
    let hex: String = project.bytes().map(|b| format!("{b:02x}")).collect();
    format!("ep_{hex:0>24}")
}

fn endpoint_path(project: &str, rest: &str) -> String {
    format!("/api/v1/endpoints/{}{rest}", endpoint_id(project))
}

async fn send(app: &TestApp, client: &reqwest::Client, aimed: &Aimed) -> reqwest::Response {
    let mut request = client.request(aimed.method.clone(), app.url(&aimed.path));
    if let Some(body) = &aimed.body {
        request = request.json(body);
    }
    request.send().await.expect("request")
}

/// Every operation of the served document that needs a key: (operation id,
/// whether it needs an admin key).
async fn protected_operations(app: &TestApp) -> Vec<(String, bool)> {
    let (status, document) = app.get_json("/openapi.json").await;
    assert_eq!(status, StatusCode::OK);
    let mut operations = Vec::new();
    for (path, item) in document["paths"].as_object().expect("paths") {
        for (method, operation) in item.as_object().expect("path item") {
            let id = operation["operationId"].as_str().expect("operationId");
            let secured = operation["security"].is_array();
            assert_eq!(
                secured,
                idpool::edge::http::auth::is_protected(path),
                "{method} {path}: the document and the layer disagree"
            );
            if secured {
                let admin = operation["responses"]["403"].is_object();
                operations.push((id.to_owned(), admin));
            }
        }
    }
    operations
}

/// Project B as the operations are aimed at it: a sequence, two
/// documents and an endpoint.
async fn project_b(app: &TestApp) {
    app.issue("B", "T", 1).await;
    for _ in 0..2 {
        let response = app
            .post_document(&json!({"project": "B", "type": "T", "metadata": {}}), None)
            .await;
        assert_eq!(response.status(), StatusCode::ACCEPTED);
    }
    sqlx::query("INSERT INTO endpoints (id, project, url, secret) VALUES ($1, 'B', 'http://127.0.0.1:9/in', $2)")
        .bind(endpoint_id("B"))
        .bind(idpool::features::endpoints::new_secret())
        .execute(&app.db)
        .await
        .expect("B's endpoint");
}

/// No request path needs two pooled connections at once (SPEC, limits):
/// every protected operation of the document, four of each at once, on
/// the default pool's two turns for requests. A path that held one
/// connection and waited for a second would, so many at once, wait out
/// the acquire timeout and answer 503.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_protected_operation_at_once_needs_no_second_connection() {
    let mut env = TestEnv::new();
    env.processor = false;
    let app = env.spawn().await;
    project_b(&app).await;
    let operations = protected_operations(&app).await;
    let requests = operations.iter().flat_map(|(operation, _)| {
        let aimed = aim(operation, "B").expect("aimed");
        let app = &app;
        (0..4).map(move |_| {
            let aimed = Aimed {
                method: aimed.method.clone(),
                path: aimed.path.clone(),
                body: aimed.body.clone(),
            };
            let operation = operation.clone();
            async move {
                let response = send(app, &app.client, &aimed).await;
                let status = response.status();
                (operation, status, response.text().await.unwrap_or_default())
            }
        })
    });
    let answers = futures::future::join_all(requests).await;
    assert!(answers.len() >= 4 * 14, "{} requests", answers.len());
    let unavailable: Vec<_> = answers
        .iter()
        .filter(|(_, status, _)| {
            *status == StatusCode::SERVICE_UNAVAILABLE || status.is_server_error()
        })
        .collect();
    assert!(unavailable.is_empty(), "{unavailable:#?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_protected_operation_keeps_out_callers_without_a_valid_key_or_outside_its_projects() {
    let app = TestEnv::new().spawn().await;
    // Project B has a sequence and documents; project Z never existed.
    project_b(&app).await;
    let b_ledger = crate::support::app::ledger_numbers(&app.db, "B", "T", "").await;
    let key_a = client_with_key(Some(&create_key(&app.state, &["A"], false).await));
    let (revoked_id, revoked) = create_key_with_id(&app.state, &["A", "B"], false).await;
    app.state
        .auth
        .keys()
        .revoke(&revoked_id)
        .await
        .expect("revoked");
    let clients = [
        ("no key", client_with_key(None)),
        ("revoked key", client_with_key(Some(&revoked))),
        ("malformed key", client_with_key(Some("idp_not_a_key"))),
    ];

    let operations = protected_operations(&app).await;
    assert!(operations.len() >= 14, "{operations:?}");
    let unknown: Vec<&str> = operations
        .iter()
        .filter(|(id, _)| aim(id, "B").is_none())
        .map(|(id, _)| id.as_str())
        .collect();
    assert!(
        unknown.is_empty(),
        "operations without a test request: {unknown:?}"
    );
    let mut scopes = Vec::new();
    for (operation, admin) in &operations {
        let on_b = aim(operation, "B").expect("aimed");
        for (what, client) in &clients {
            let response = send(&app, client, &on_b).await;
            let challenge = response
                .headers()
                .get("www-authenticate")
                .and_then(|v| v.to_str().ok())
                .unwrap_or("")
                .to_owned();
            assert!(
                challenge.starts_with("Bearer"),
                "{operation} with {what}: WWW-Authenticate {challenge:?}"
            );
            assert_problem(response, StatusCode::UNAUTHORIZED, "unauthorized").await;
        }
        if *admin {
            let response = send(&app, &key_a, &on_b).await;
            assert_problem(response, StatusCode::FORBIDDEN, "forbidden").await;
            scopes.push((operation.clone(), "admin"));
            continue;
        }
        scopes.push((operation.clone(), "project"));
        // Outside its projects, a key meets exactly what a project that
        // does not exist answers.
        let b = send(&app, &key_a, &on_b).await;
        let b_status = b.status();
        let b_body = b.text().await.expect("body");
        let z = send(&app, &key_a, &aim(operation, "Z").expect("aimed")).await;
        let z_status = z.status();
        let z_body = z.text().await.expect("body").replace('Z', "B");
        assert_eq!(
            (b_status, &b_body),
            (z_status, &z_body),
            "{operation}: project B answered otherwise than a project that does not exist"
        );
        assert!(
            b_status.is_client_error() || b_status == StatusCode::OK,
            "{operation}: {b_status} {b_body}"
        );
        if b_status == StatusCode::OK {
            assert!(
                !b_body.contains("B-T-"),
                "{operation} showed B's IDs: {b_body}"
            );
        }
    }
    // Nothing of B changed, and lists show only the key's projects.
    assert_eq!(
        crate::support::app::ledger_numbers(&app.db, "B", "T", "").await,
        b_ledger
    );
    let listed: Value = crate::support::app::get_ok(&key_a, &app.url("/api/v1/sequences")).await;
    assert_eq!(listed["sequences"], json!([]), "{listed}");
    let outbox: Value = crate::support::app::get_ok(&key_a, &app.url("/api/v1/outbox")).await;
    assert_eq!(outbox["documents"], json!([]), "{outbox}");
    // The table of the closing note.
    for (operation, scope) in scopes {
        println!("| {operation} | {scope} |");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_project_key_works_inside_its_projects() {
    let app = TestEnv::new().spawn().await;
    let key = client_with_key(Some(&create_key(&app.state, &["A", "C"], false).await));
    for project in ["A", "C"] {
        let issued = key
            .post(app.url("/ids"))
            .json(&json!({"project": project, "type": "1", "count": 2}))
            .send()
            .await
            .unwrap();
        assert_eq!(issued.status(), StatusCode::OK);
    }
    let document = key
        .post(app.url("/documents"))
        .json(&json!({"project": "A", "type": "1", "metadata": {}}))
        .send()
        .await
        .unwrap();
    assert_eq!(document.status(), StatusCode::ACCEPTED);
    let id = document.json::<Value>().await.unwrap()["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let read = key
        .get(app.url(&format!("/api/v1/documents/{id}")))
        .send()
        .await
        .unwrap();
    assert_eq!(read.status(), StatusCode::OK);
    let listed: Value = crate::support::app::get_ok(&key, &app.url("/api/v1/sequences")).await;
    let projects: BTreeSet<&str> = listed["sequences"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["project"].as_str().unwrap())
        .collect();
    assert_eq!(projects, BTreeSet::from(["A", "C"]));
    let define = key
        .put(app.url("/api/v1/sequences/A/1"))
        .json(&json!({"pool_size": 10}))
        .send()
        .await
        .unwrap();
    assert_problem(define, StatusCode::FORBIDDEN, "forbidden").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_keys_sending_the_same_idempotency_key_each_get_their_own_answer() {
    let app = TestEnv::new().spawn().await;
    let first = client_with_key(Some(&create_key(&app.state, &["SHARED"], false).await));
    let second = client_with_key(Some(&create_key(&app.state, &["SHARED"], false).await));
    let body = json!({"project": "SHARED", "type": "1", "count": 3});
    let mut answers = HashMap::new();
    for (name, client) in [("first", &first), ("second", &second)] {
        let response = client
            .post(app.url("/ids"))
            .header("idempotency-key", "import-2026-11-23")
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), StatusCode::OK);
        assert!(!response.headers().contains_key("idempotent-replayed"));
        answers.insert(name, response.json::<Value>().await.unwrap()["ids"].clone());
    }
    assert_ne!(
        answers["first"], answers["second"],
        "one key saw the other's answer"
    );
    for (name, client) in [("first", &first), ("second", &second)] {
        let replay = client
            .post(app.url("/ids"))
            .header("idempotency-key", "import-2026-11-23")
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(replay.headers()["idempotent-replayed"], "true");
        assert_eq!(replay.json::<Value>().await.unwrap()["ids"], answers[name]);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_over_the_rate_is_429_and_another_key_is_served_meanwhile() {
    let mut env = TestEnv::new();
    env.rate_limit = 5;
    let app = env.spawn().await;
    let flooder = client_with_key(Some(&create_key(&app.state, &["F"], false).await));
    let other = client_with_key(Some(&create_key(&app.state, &["O"], false).await));
    let started = Instant::now();
    let flood = (0..40).map(|_| flooder.get(app.url("/api/v1/sequences")).send());
    let calm = (0..5).map(|_| other.get(app.url("/api/v1/sequences")).send());
    let (flood, calm) = tokio::join!(
        futures::future::join_all(flood),
        futures::future::join_all(calm)
    );
    // However long the burst took here, the bucket let through its burst
    // and what refilled meanwhile, no more.
    let refilled = (5.0 * started.elapsed().as_secs_f64()).ceil() as usize;
    let mut limited = 0;
    for response in flood {
        let response = response.unwrap();
        if response.status() == StatusCode::TOO_MANY_REQUESTS {
            let wait: u64 = response.headers()["retry-after"]
                .to_str()
                .unwrap()
                .parse()
                .unwrap();
            assert!(wait >= 1);
            assert_problem(response, StatusCode::TOO_MANY_REQUESTS, "rate_limited").await;
            limited += 1;
        } else {
            assert_eq!(response.status(), StatusCode::OK);
        }
    }
    // A burst of twice the rate passes, the rest is refused.
    let passed = 40 - limited;
    assert!(
        (10..=10 + refilled).contains(&passed),
        "{passed} of 40 passed, {refilled} refilled meanwhile"
    );
    for response in calm {
        assert_eq!(
            response.unwrap().status(),
            StatusCode::OK,
            "the calm key was throttled"
        );
    }
}

/// A request counts once toward its key's rate, however many numbers or
/// documents it asks for: ten thousand numbers, or a batch of a thousand,
/// each spend one token of the burst, and the burst's end is where it
/// would be for requests of one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_counts_once_toward_the_rate_whatever_it_asks_for() {
    let mut env = TestEnv::new();
    env.rate_limit = 1;
    let app = env.spawn().await;
    let key = client_with_key(Some(&create_key(&app.state, &["C"], false).await));
    let started = Instant::now();
    let many = key
        .post(app.url("/ids"))
        .json(&json!({"project": "C", "type": "1", "count": 10000}))
        .send()
        .await
        .unwrap();
    assert_eq!(
        many.status(),
        StatusCode::OK,
        "ten thousand numbers, one token"
    );
    let documents: Vec<Value> = (0..1000)
        .map(|n| json!({"project": "C", "type": "2", "metadata": {"n": n}}))
        .collect();
    let batch = key
        .post(app.url("/api/v1/documents/batch"))
        .json(&json!({ "documents": documents }))
        .send()
        .await
        .unwrap();
    assert_eq!(
        batch.status(),
        StatusCode::ACCEPTED,
        "a thousand documents, one token"
    );
    // The burst (twice the rate: 2) is spent by those two requests; what
    // refilled meanwhile passes, and the next is refused.
    let refilled = started.elapsed().as_secs_f64().floor() as usize;
    let mut passed = 0;
    loop {
        let next = key.get(app.url("/api/v1/sequences")).send().await.unwrap();
        if next.status() == StatusCode::TOO_MANY_REQUESTS {
            break;
        }
        assert_eq!(next.status(), StatusCode::OK);
        passed += 1;
        assert!(
            passed <= refilled + 1,
            "{passed} passed after the burst was spent"
        );
    }
    assert!(
        passed <= started.elapsed().as_secs_f64().ceil() as usize,
        "{passed} requests passed after a burst of 2 was spent by two requests"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn last_use_is_recorded_and_listed_without_secrets() {
    let app = TestEnv::new().spawn().await;
    let (id, key) = create_key_with_id(&app.state, &["U"], false).await;
    let used = client_with_key(Some(&key))
        .get(app.url("/api/v1/sequences"))
        .send()
        .await
        .unwrap();
    assert_eq!(used.status(), StatusCode::OK);
    app.state.auth.keys().record_use().await.unwrap();
    let listed = app.state.auth.keys().list().await.unwrap();
    let entry = listed.iter().find(|k| k.id == id).expect("listed");
    assert!(entry.last_used_at.is_some());
    let line = serde_json::to_string(entry).unwrap();
    let secret = &key[key.len() - 43..];
    assert!(!line.contains(secret), "{line}");
}

/// The lines of a JSON log above DEBUG, for a failure's message.
fn warnings_and_errors(log: &std::path::Path) -> String {
    std::fs::read(log)
        .map(|bytes| {
            String::from_utf8_lossy(&bytes)
                .lines()
                .filter(|l| {
                    !l.contains("\"level\":\"DEBUG\"") && !l.contains("\"level\":\"TRACE\"")
                })
                .collect::<Vec<_>>()
                .join("\n")
        })
        .unwrap_or_else(|e| format!("(log unreadable: {e})"))
}

/// `idpool keys ...` against the test's database; stdout.
fn cli(env: &TestEnv, args: &[&str]) -> String {
    let output = Command::new(env!("CARGO_BIN_EXE_idpool"))
        .args(args)
        .env("DATABASE_URL", &env.database_url)
        .output()
        .expect("idpool runs");
    assert!(
        output.status.success(),
        "idpool {args:?}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout).expect("utf-8")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_log_line_holds_a_secret_and_every_request_line_names_its_key() {
    let env = TestEnv::new();
    // The in-process app creates the database; the process under test logs.
    let _setup = env.spawn().await;
    let log = tempfile::NamedTempFile::new().unwrap();
    let mut server = ServeProcess::start_logging(&env, log.path(), "debug").await;
    let created: Value = serde_json::from_str(&cli(
        &env,
        &["keys", "create", "--project", "LOG", "--name", "logs"],
    ))
    .unwrap();
    let (id, key) = (
        created["id"].as_str().unwrap().to_owned(),
        created["key"].as_str().unwrap().to_owned(),
    );
    // The secret is base64url: it may hold '_' itself.
    let secret = key[key.len() - 43..].to_owned();
    assert_eq!(secret.len(), 43);
    let url = |path: &str| format!("http://127.0.0.1:{}{path}", server.port);
    let good = client_with_key(Some(&key));
    let wrong = client_with_key(Some(&format!("{}x", &key[..key.len() - 1])));
    let basic = crate::support::app::client_with_key(None);
    // A failure here names what the server logged (it logs to a file).
    let said = || warnings_and_errors(log.path());
    let answered = |sent: reqwest::Result<reqwest::Response>| {
        sent.unwrap_or_else(|e| panic!("{e}; the server said: {}", said()))
    };
    let expect = |sent: reqwest::Result<reqwest::Response>, status: StatusCode| {
        assert_eq!(
            answered(sent).status(),
            status,
            "the server said: {}",
            said()
        );
    };
    for _ in 0..3 {
        let ok = good
            .post(url("/ids"))
            .json(&json!({"project": "LOG", "type": "1"}))
            .send()
            .await;
        expect(ok, StatusCode::OK);
        let refused = wrong.get(url("/api/v1/sequences")).send().await;
        expect(refused, StatusCode::UNAUTHORIZED);
        let refused = basic
            .get(url("/api/v1/sequences"))
            .header("authorization", format!("Basic {key}"))
            .send()
            .await;
        expect(refused, StatusCode::UNAUTHORIZED);
    }
    let revoked: Value = serde_json::from_str(&cli(&env, &["keys", "revoke", &id])).unwrap();
    assert!(revoked["revoked_at"].is_string());
    // Every instance hears of it at once.
    eventually(
        Duration::from_secs(5),
        "the revocation is seen",
        async || {
            let status = answered(good.get(url("/api/v1/sequences")).send().await).status();
            (status == StatusCode::UNAUTHORIZED).then_some(())
        },
    )
    .await;
    let listed = cli(&env, &["keys", "list"]);
    assert!(
        listed.contains(&id) && !listed.contains(&secret),
        "{listed}"
    );
    server.stop();
    let logs = std::fs::read(log.path()).expect("the log file");
    let logs = String::from_utf8(logs).unwrap_or_else(|e| {
        panic!(
            "the log is not UTF-8 at byte {}",
            e.utf8_error().valid_up_to()
        )
    });
    assert!(
        logs.lines().count() > 10,
        "the process logged little: {logs}"
    );
    assert!(!logs.contains(&secret), "a log line holds the secret");
    assert!(
        !logs.contains("Bearer"),
        "a log line holds an Authorization value"
    );
    let named: Vec<&str> = logs
        .lines()
        .filter(|l| l.contains("\"/ids\"") && l.contains(&id))
        .collect();
    assert!(!named.is_empty(), "no request line names the key {id}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn authentication_is_off_only_when_asked_and_only_on_a_loopback_address() {
    let env = TestEnv::new();
    let _setup = env.spawn().await;
    let refused = Command::new(env!("CARGO_BIN_EXE_idpool"))
        .arg("serve")
        .env("DATABASE_URL", &env.database_url)
        .env("IDPOOL_AUTH", "off")
        .env("IDPOOL_LISTEN", "0.0.0.0:0")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .output()
        .expect("idpool runs");
    assert!(!refused.status.success());
    let said = String::from_utf8_lossy(&refused.stderr);
    assert!(
        said.contains("IDPOOL_AUTH=off") && said.contains("loopback"),
        "{said}"
    );

    let mut off = env.clone();
    off.auth = false;
    let log = tempfile::NamedTempFile::new().unwrap();
    let mut server = ServeProcess::start_logging(&off, log.path(), "info").await;
    let open = crate::support::app::client_with_key(None)
        .post(format!("http://127.0.0.1:{}/ids", server.port))
        .json(&json!({"project": "DEV", "type": "1"}))
        .send()
        .await
        .unwrap();
    assert_eq!(open.status(), StatusCode::OK);
    server.stop();
    let logs = std::fs::read_to_string(log.path()).unwrap();
    let first = logs.lines().next().unwrap_or_default();
    assert!(
        first.contains("authentication is OFF"),
        "first line: {first}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_in_use_is_never_read_again_from_postgres() {
    let app = TestEnv::new().spawn().await;
    let (id, secret) = crate::support::app::create_key_with_id(&app.state, &["KEPT"], false).await;
    let tenant = client_with_key(Some(&secret));
    let issue = async || {
        tenant
            .post(app.url("/ids"))
            .json(&json!({"project": "KEPT", "type": "1"}))
            .send()
            .await
            .expect("answer")
            .status()
    };
    assert_eq!(issue().await, StatusCode::OK);
    // Its row changes behind the service's back (nothing announces it): an
    // instance that read keys in use again would see another scope.
    sqlx::query("UPDATE api_keys SET projects = ARRAY['ELSEWHERE'] WHERE id = $1")
        .bind(&id)
        .execute(&app.db)
        .await
        .unwrap();
    // What the 30-second timer does (writing when keys were last used),
    // then two seconds of steady use on Postgres' clock.
    app.state
        .auth
        .keys()
        .record_use()
        .await
        .expect("use recorded");
    let mark = crate::support::app::postgres_now(&app.db)
        .await
        .expect("Postgres' clock");
    let mut requests = 0;
    eventually(Duration::from_secs(30), "two seconds of use", async || {
        assert_eq!(issue().await, StatusCode::OK, "the key was read again");
        requests += 1;
        let now = crate::support::app::postgres_now(&app.db).await?;
        (now - mark > chrono::Duration::seconds(2)).then_some(())
    })
    .await;
    assert!(requests > 10, "{requests} requests");
    // What is announced is heard at once.
    app.state.auth.keys().revoke(&id).await.expect("revoked");
    eventually(
        Duration::from_secs(5),
        "the revocation is heard",
        async || (issue().await == StatusCode::UNAUTHORIZED).then_some(()),
    )
    .await;
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
        let took = started.elapsed();
        assert_answer_within(
            "a flood of made-up keys",
            "a new key",
            neighbour.alone(),
            took,
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
    let took = started.elapsed();
    assert_answer_within(
        "a flood of made-up keys",
        "an unannounced key",
        neighbour.alone(),
        took,
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
    neighbour.assert_unharmed("a flood of made-up keys").await;
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
        .assert_unharmed("hundreds of one key's requests in flight")
        .await;
    drop(stalled);
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
        .assert_unharmed("a key taking numbers ten thousand at a time")
        .await;
}
