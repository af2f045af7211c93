//! Health, readiness, metrics, the OpenAPI document, start without Redis,
//! and graceful shutdown of the real binary.

use crate::support::app::until;
use crate::support::probes::*;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering;

use std::process::Command;
use std::time::Duration;

use reqwest::StatusCode;

use crate::support::app::{TestEnv, base_database_url, replace_database};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_readiness_and_metrics_answer() {
    let app = TestEnv::new().spawn().await;
    let (status, health) = app.get_json("/healthz").await;
    assert_eq!(
        (status, health["status"].as_str()),
        (StatusCode::OK, Some("ok"))
    );
    let (status, ready) = app.get_json("/readyz").await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(
        ready,
        serde_json::json!({"postgres": "up", "redis": "up", "mode": "pool"})
    );
    // The first use takes from the counter, the next from the pool it fills.
    app.issue("M", "1", 3).await;
    app.issue("M", "1", 3).await;
    let metrics = app.metrics().await;
    assert_eq!(metrics["idpool_ids_issued_total{source=\"direct\"}"], 3.0);
    assert_eq!(metrics["idpool_ids_issued_total{source=\"pool\"}"], 3.0);
    assert_eq!(metrics["idpool_mode_pool"], 1.0);
    assert_eq!(metrics["idpool_ready"], 1.0);
    assert_eq!(metrics["idpool_postgres_read_only"], 0.0);
    let response = app.client.get(app.url("/healthz")).send().await.unwrap();
    assert!(
        response.headers().contains_key("x-request-id"),
        "every response carries a request id"
    );
    // Ids tell nothing of others' traffic: two in a row are not neighbours.
    let id_of = async |id: Option<&str>| {
        let mut request = app.client.get(app.url("/healthz"));
        if let Some(id) = id {
            request = request.header("x-request-id", id);
        }
        let response = request.send().await.unwrap();
        response.headers()["x-request-id"]
            .to_str()
            .unwrap()
            .to_owned()
    };
    let counted = |id: &str| u64::from_str_radix(id.rsplit('-').next().unwrap_or(""), 16).ok();
    let (a, b) = (id_of(None).await, id_of(None).await);
    let (a, b) = (counted(&a).unwrap(), counted(&b).unwrap());
    assert!(
        a.abs_diff(b) > 1_000_000,
        "request ids {a:x} and {b:x} count requests"
    );
    // A client's own id is kept when it is plain and short, else replaced.
    assert_eq!(id_of(Some("trace-7.a:b_c")).await, "trace-7.a:b_c");
    let long = "x".repeat(65);
    for forged in [long.as_str(), "a b", "a/b<script>"] {
        let given = id_of(Some(forged)).await;
        assert_ne!(given, forged);
        assert!(counted(&given).is_some(), "{given}");
    }
    // Without a key: the operations routes are open, the API is not.
    let keyless = crate::support::app::client_with_key(None);
    let mut open = Vec::new();
    for path in ["/healthz", "/readyz", "/metrics", "/openapi.json", "/docs"] {
        let status = keyless.get(app.url(path)).send().await.unwrap().status();
        open.push((path, status.as_u16()));
    }
    assert_eq!(
        open,
        [
            ("/healthz", 200),
            ("/readyz", 200),
            ("/metrics", 200),
            ("/openapi.json", 200),
            ("/docs", 200)
        ],
        "open without a key"
    );
    let closed = keyless
        .get(app.url("/api/v1/sequences"))
        .send()
        .await
        .unwrap();
    crate::support::app::assert_problem(closed, StatusCode::UNAUTHORIZED, "unauthorized").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_time_requests_by_route_and_report_refills_batches_and_outbox_lag() {
    let app = TestEnv::new().spawn().await;
    app.issue("M", "1", 1).await;
    app.issue("M", "1", 1).await;
    let accepted = app
        .post_document(
            &serde_json::json!({"project": "M", "type": "2", "metadata": {}}),
            None,
        )
        .await;
    assert_eq!(accepted.status(), StatusCode::ACCEPTED);
    let id = accepted.json::<serde_json::Value>().await.unwrap()["id"]
        .as_str()
        .expect("id")
        .to_owned();
    app.wait_for_status(&id, "committed", Duration::from_secs(10))
        .await;
    let missing = app
        .client
        .get(app.url("/no/such/route"))
        .send()
        .await
        .unwrap();
    assert_eq!(missing.status(), StatusCode::NOT_FOUND);

    let metrics = app.metrics().await;
    let count = |series: &str| metrics.get(series).copied().unwrap_or_default();
    let ids =
        "idpool_http_request_duration_seconds_count{method=\"POST\",route=\"/ids\",status=\"200\"}";
    assert_eq!(count(ids), 2.0, "one series per route and status");
    let documents = "idpool_http_request_duration_seconds_count{method=\"POST\",route=\"/documents\",status=\"202\"}";
    assert_eq!(count(documents), 1.0);
    let unmatched = "idpool_http_request_duration_seconds_count{method=\"GET\",route=\"unmatched\",status=\"404\"}";
    assert_eq!(count(unmatched), 1.0, "unknown paths share one series");
    assert!(
        !metrics.keys().any(|k| k.contains("/no/such/route")),
        "raw paths never become labels"
    );
    assert!(
        count("idpool_refill_duration_seconds_count") >= 1.0,
        "pools were filled"
    );
    assert!(count("idpool_pipeline_pop_batch_size_count") >= 3.0);
    assert!(count("idpool_pipeline_write_batch_size_count") >= 1.0);
    assert_eq!(
        count("idpool_outbox_lag_seconds_count"),
        1.0,
        "one document delivered"
    );

    let openmetrics = app
        .client
        .get(app.url("/metrics"))
        .header(
            "accept",
            "application/openmetrics-text;version=1.0.0,text/plain;q=0.5",
        )
        .send()
        .await
        .unwrap();
    assert_eq!(openmetrics.status(), StatusCode::OK);
    assert_eq!(
        openmetrics.headers()["content-type"],
        "application/openmetrics-text; version=1.0.0; charset=utf-8"
    );
    assert!(openmetrics.text().await.unwrap().ends_with("# EOF\n"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_committed_openapi_document_matches_the_code() {
    let generated = idpool::edge::http::openapi().to_pretty_json().unwrap();
    let committed =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/openapi/openapi.json"))
            .expect("openapi/openapi.json is committed");
    assert!(
        generated.trim() == committed.trim(),
        "openapi/openapi.json is stale: run `make openapi` (cargo run -- openapi > openapi/openapi.json)"
    );
    let app = TestEnv::new().spawn().await;
    let (status, served) = app.get_json("/openapi.json").await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(
        served,
        serde_json::from_str::<serde_json::Value>(&committed).unwrap()
    );
    assert!(served["paths"]["/ids"]["post"].is_object());
    assert!(served["paths"]["/api/v1/ids"]["post"].is_object());
    let docs = app.client.get(app.url("/docs/")).send().await.unwrap();
    assert_eq!(docs.status(), StatusCode::OK);
    assert!(
        docs.text().await.unwrap().contains("swagger"),
        "the docs UI is served from the binary"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_redis_at_start_ids_come_from_postgres() {
    // Nothing listens on port 1.
    let mut app = TestEnv::new().with_redis("redis://127.0.0.1:1");
    app.redis_start_wait_ms = 300;
    let config = app.config();
    let application = idpool::edge::startup::Application::build(&config)
        .await
        .unwrap();
    let address = format!("http://127.0.0.1:{}", application.port());
    let stop = application.stop_token();
    let key = crate::support::app::create_key(application.state(), &["NOREDIS"], false).await;
    let server = tokio::spawn(application.run_until_stopped());
    let client = crate::support::app::client_with_key(Some(&key));
    let ready: serde_json::Value =
        crate::support::app::get_ok(&client, &format!("{address}/readyz")).await;
    assert_eq!(
        ready,
        serde_json::json!({"postgres": "up", "redis": "down", "mode": "fallback"})
    );
    let issued: serde_json::Value = crate::support::app::post_ok(
        &client,
        &format!("{address}/ids"),
        &serde_json::json!({"project": "NOREDIS", "type": "1", "count": 3}),
    )
    .await;
    assert_eq!(
        issued["ids"],
        serde_json::json!(["NOREDIS-1-1", "NOREDIS-1-2", "NOREDIS-1-3"])
    );
    stop.cancel();
    server.await.unwrap().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_stops_cleanly_on_sigterm() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let database = format!(
        "idpool_test_{}",
        &uuid::Uuid::new_v4().simple().to_string()[..16]
    );
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("idpool.log");
    let mut child = Command::new(env!("CARGO_BIN_EXE_idpool"))
        .arg("serve")
        .env(
            "DATABASE_URL",
            replace_database(&base_database_url(), &database),
        )
        .env("IDPOOL_LISTEN", format!("127.0.0.1:{port}"))
        .env("IDPOOL_REDIS_PREFIX", format!("t{database}"))
        // Local development mode: allowed on a loopback address.
        .env("IDPOOL_AUTH", "off")
        .env("RUST_LOG", "warn")
        .stdout(crate::support::app::child_output())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let client = crate::support::app::client_with_key(None);
    let readyz = format!("http://127.0.0.1:{port}/readyz");
    crate::support::app::eventually(Duration::from_secs(20), "the binary is ready", async || {
        let r = client.get(&readyz).send().await.ok()?;
        (r.status() == StatusCode::OK).then_some(())
    })
    .await;
    let issued = client
        .post(format!("http://127.0.0.1:{port}/ids"))
        .json(&serde_json::json!({"project": "BIN", "type": "1"}))
        .send()
        .await
        .unwrap();
    assert_eq!(issued.status(), StatusCode::OK);
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    let status = crate::support::app::eventually(
        Duration::from_secs(10),
        "the binary stops after SIGTERM",
        async || child.try_wait().unwrap(),
    )
    .await;
    assert!(status.success(), "exit status {status}");
    let errors = lines_at(&log, &["ERROR"]);
    assert!(errors.is_empty(), "a clean start and stop: {errors:#?}");
}

/// The lines of a JSON log at `level` and above (WARN, ERROR).
fn lines_at(log: &std::path::Path, levels: &[&str]) -> Vec<String> {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .filter(|l| {
            levels
                .iter()
                .any(|level| l.contains(&format!("\"level\":\"{level}\"")))
        })
        .map(str::to_owned)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_starts_without_an_error_and_logs_each_request_with_its_key_and_nothing_per_stranger()
 {
    let env = TestEnv::new();
    let setup = env.spawn().await;
    let log = tempfile::NamedTempFile::new().unwrap();
    let mut server =
        crate::support::app::ServeProcess::start_logging(&env, log.path(), "info").await;
    let base = format!("http://127.0.0.1:{}", server.port);
    let ok = setup
        .client
        .post(format!("{base}/ids"))
        .json(&serde_json::json!({"project": "OPS", "type": "1"}))
        .send()
        .await
        .unwrap();
    assert_eq!(ok.status(), StatusCode::OK);
    // Strangers with made-up keys: answered, and not one log line each.
    let stranger = crate::support::app::client_with_key(None);
    for n in 0..200 {
        let refused = stranger
            .get(format!("{base}/api/v1/sequences"))
            .bearer_auth(format!("idp_{:012}_{}", n, "x".repeat(43)))
            .send()
            .await
            .unwrap();
        assert_eq!(refused.status(), StatusCode::UNAUTHORIZED);
    }
    server.stop();
    let troubles = lines_at(log.path(), &["WARN", "ERROR"]);
    assert!(troubles.is_empty(), "warnings or errors: {troubles:?}");
    let key_id = setup.admin_key.split('_').nth(1).unwrap().to_owned();
    let logs = std::fs::read_to_string(log.path()).unwrap();
    let request_lines: Vec<&str> = logs
        .lines()
        .filter(|l| l.contains("idpool::request") && l.contains("\"level\":\"INFO\""))
        .collect();
    assert!(
        request_lines
            .iter()
            .any(|l| l.contains("\"/ids\"") && l.contains(&key_id)),
        "no request line names the key: {request_lines:?}"
    );
    assert!(
        !logs.contains("SELECT") && !logs.contains("INSERT"),
        "statements at info: {logs}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_prefix_of_another_database_is_named_at_once() {
    let first = TestEnv::new();
    let _owner = first.spawn().await;
    // Another database (a recreated one, say) with the same prefix.
    let mut second = TestEnv::new();
    second.prefix = first.prefix.clone();
    // The prefix's owner is named as an error, which this test is after.
    crate::support::app::expect_error_lines("belongs to another database");
    // Its database made and migrated by a process that is gone again.
    crate::support::app::ServeProcess::start(&second)
        .await
        .stop();
    let log = tempfile::NamedTempFile::new().unwrap();
    let mut server =
        crate::support::app::ServeProcess::start_logging(&second, log.path(), "info").await;
    let first_error =
        crate::support::app::eventually(Duration::from_secs(5), "the cause is named", async || {
            lines_at(log.path(), &["ERROR"]).into_iter().next()
        })
        .await;
    assert!(
        first_error.contains("belongs to another database"),
        "the first error names the cause: {first_error}"
    );
    server.stop();
    let logs = std::fs::read_to_string(log.path()).unwrap();
    assert!(!logs.contains("unreachable: reconnected"), "{logs}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn maintenance_commands_never_create_a_database_and_show_only_their_own_options() {
    let missing = format!(
        "idpool_typo_{}",
        &uuid::Uuid::new_v4().simple().to_string()[..12]
    );
    let url = replace_database(&base_database_url(), &missing);
    let listed = Command::new(env!("CARGO_BIN_EXE_idpool"))
        .args(["keys", "list"])
        .env("DATABASE_URL", &url)
        .output()
        .unwrap();
    assert!(
        !listed.status.success(),
        "keys list on a missing database succeeded"
    );
    let said = String::from_utf8_lossy(&listed.stderr);
    assert!(said.contains("does not exist"), "{said}");
    let db = sqlx::PgPool::connect(&replace_database(&base_database_url(), "postgres"))
        .await
        .unwrap();
    let created: bool =
        sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)")
            .bind(&missing)
            .fetch_one(&db)
            .await
            .unwrap();
    assert!(!created, "keys list created the database it was pointed at");

    let help = |args: &[&str]| {
        let output = Command::new(env!("CARGO_BIN_EXE_idpool"))
            .args(args)
            .output()
            .unwrap();
        String::from_utf8_lossy(&output.stdout).into_owned()
    };
    for command in [
        &["keys", "create", "--help"][..],
        &["keys", "list", "--help"],
        &["db", "migrate", "--help"],
        &["import", "--help"],
    ] {
        let text = help(command);
        assert!(
            !text.contains("IDPOOL_MAX_CONNECTIONS"),
            "{command:?} lists serve's options: {text}"
        );
        for line in text.lines().filter(|l| l.trim_start().starts_with("--")) {
            let described = line.split_whitespace().count() > 2;
            assert!(described, "{command:?}: an option without help: {line}");
        }
    }
    assert!(help(&["serve", "--help"]).contains("IDPOOL_MAX_CONNECTIONS"));
    assert!(help(&["import", "--help"]).contains("--key-file"));
}

/// Runs `promtool` with `args` in `deploy/prometheus/`; its output, or the
/// test fails with it.
fn promtool(args: &[&str]) -> String {
    let repo = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    // The script takes its own lock: tests run in processes of their own.
    let installed = Command::new(repo.join("scripts/promtool.sh"))
        .output()
        .expect("scripts/promtool.sh runs");
    assert!(
        installed.status.success(),
        "installing promtool: {}",
        String::from_utf8_lossy(&installed.stderr)
    );
    let path = String::from_utf8_lossy(&installed.stdout).trim().to_owned();
    let output = Command::new(path)
        .args(args)
        .current_dir(repo.join("deploy/prometheus"))
        .output()
        .expect("promtool runs");
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(output.status.success(), "promtool {args:?}:\n{said}");
    said
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn alert_rules_are_valid_fire_when_they_should_and_name_only_exported_metrics() {
    promtool(&["check", "rules", "idpool.rules.yml"]);
    // Each alert fires for its "bad" instance and stays quiet for "good".
    promtool(&["test", "rules", "idpool.rules.test.yml"]);

    let app = TestEnv::new().spawn().await;
    // A sequence that has used up its numbers, and one far from its max.
    app.define("NM", "1", serde_json::json!({"max": 20, "pool_size": 10}))
        .await;
    app.define("NM", "2", serde_json::json!({"max": 1000000}))
        .await;
    for doc_type in ["1", "2"] {
        assert_eq!(
            app.post_ids("NM", doc_type, 19).await.status(),
            StatusCode::OK
        );
    }
    // What reconciliation reports is there after its first run.
    app.reconcile().await;
    let text = app
        .client
        .get(app.url("/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        text.lines().any(|l| l == "idpool_sequences_near_max 1"),
        "one sequence near its max:\n{text}"
    );
    // Families (`# TYPE name kind`) and samples (`name{...} value`).
    let mut exported = std::collections::HashSet::new();
    for line in text.lines() {
        let name = match line.strip_prefix("# TYPE ") {
            Some(rest) => rest.split(' ').next(),
            None if !line.starts_with('#') => line.split(['{', ' ']).next(),
            None => None,
        };
        exported.extend(name.map(str::to_owned));
    }
    let rules = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/prometheus/idpool.rules.yml"),
    )
    .unwrap();
    let mut named: Vec<&str> = rules
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .filter(|word| word.starts_with("idpool_"))
        .collect();
    named.sort_unstable();
    named.dedup();
    assert!(
        named.len() >= 10,
        "the rules name idpool's metrics: {named:?}"
    );
    let family = |name: &str| {
        ["_total", "_bucket", "_count", "_sum"]
            .iter()
            .find_map(|suffix| name.strip_suffix(suffix))
            .unwrap_or(name)
            .to_owned()
    };
    let missing: Vec<&&str> = named
        .iter()
        .filter(|name| !exported.contains(**name) && !exported.contains(&family(name)))
        .collect();
    assert!(
        missing.is_empty(),
        "rules name metrics /metrics does not export: {missing:?}"
    );
}

#[test]
fn the_resource_inventory_gives_every_resource_a_bound_and_a_test() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let architecture = std::fs::read_to_string(root.join("ARCHITECTURE.md")).unwrap();
    let inventory = architecture
        .split("## Shared resources")
        .nth(1)
        .expect("ARCHITECTURE.md has its \"Shared resources\" section");
    let rows: Vec<Vec<&str>> = inventory
        .lines()
        .skip_while(|l| !l.starts_with("| resource"))
        .skip(2)
        .take_while(|l| l.starts_with('|'))
        .map(|l| l.trim_matches('|').split(" | ").map(str::trim).collect())
        .collect();
    assert!(rows.len() >= 10, "{} rows", rows.len());
    for row in &rows {
        assert_eq!(row.len(), 5, "resource, bound, who, share, test: {row:?}");
        assert!(row.iter().all(|cell| !cell.is_empty()), "{row:?}");
        // Every test a row names exists.
        let named: Vec<&str> = row[4]
            .split('`')
            .skip(1)
            .step_by(2)
            .filter(|name| name.contains("::"))
            .collect();
        assert!(
            !named.is_empty() || row[4].contains("bench"),
            "{}: no test",
            row[0]
        );
        for name in named {
            let (module, test) = name.split_once("::").unwrap();
            let file = root.join(format!("tests/api/{module}.rs"));
            let text = std::fs::read_to_string(&file).unwrap_or_default();
            assert!(
                text.contains(&format!("fn {test}(")),
                "{}: {name} is not a test",
                row[0]
            );
        }
    }
    // Each resource SPEC names has its row.
    let resources = rows
        .iter()
        .map(|r| r[0].to_lowercase())
        .collect::<Vec<_>>()
        .join(" / ");
    for resource in [
        "connections",
        "buffers",
        "postgres",
        "batch",
        "key",
        "cache",
        "outbox",
        "redis",
    ] {
        assert!(
            resources.contains(resource),
            "no row for {resource}: {resources}"
        );
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
        .assert_unharmed("a flood of /readyz and /metrics")
        .await;
}

/// `idpool db migrate` applies every migration of the repository to an
/// empty database, once: run again, it changes nothing. `keys create`
/// prints the one object SPEC names, with what was asked for; `keys list`
/// shows it without its secret.
#[tokio::test]
async fn db_migrate_applies_every_migration_once_and_keys_create_prints_its_fields() {
    let name = format!(
        "idpool_test_{}",
        &uuid::Uuid::new_v4().simple().to_string()[..16]
    );
    let server = sqlx::PgPool::connect(&replace_database(&base_database_url(), "postgres"))
        .await
        .expect("the server's postgres database");
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
        .execute(&server)
        .await
        .expect("an empty database");
    let url = replace_database(&base_database_url(), &name);
    // (whether it succeeded, its stdout, its stderr)
    let run = |args: &[&str]| {
        let output = Command::new(env!("CARGO_BIN_EXE_idpool"))
            .args(args)
            .env("DATABASE_URL", &url)
            .output()
            .expect("idpool runs");
        (
            output.status.success(),
            output.stdout,
            String::from_utf8_lossy(&output.stderr).into_owned(),
        )
    };
    let idpool = |args: &[&str]| {
        let (succeeded, stdout, said) = run(args);
        assert!(succeeded, "idpool {args:?}: {said}");
        assert!(!said.contains("ERROR"), "idpool {args:?}: {said}");
        String::from_utf8(stdout).expect("utf-8")
    };
    let db = sqlx::PgPool::connect(&url).await.expect("the new database");
    let applied = || async {
        sqlx::query_as::<_, (i64, bool)>(
            "SELECT version, success FROM _sqlx_migrations ORDER BY version",
        )
        .fetch_all(&db)
        .await
        .expect("the migrations applied")
    };
    let mut in_repository: Vec<i64> =
        std::fs::read_dir(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("migrations"))
            .expect("migrations/")
            .filter_map(|entry| {
                let name = entry.ok()?.file_name().into_string().ok()?;
                name.strip_suffix(".sql")?.split('_').next()?.parse().ok()
            })
            .collect();
    in_repository.sort_unstable();
    idpool(&["db", "migrate"]);
    let first = applied().await;
    assert_eq!(
        first.iter().map(|(v, _)| *v).collect::<Vec<_>>(),
        in_repository,
        "every migration, in order"
    );
    assert!(first.iter().all(|(_, ok)| *ok), "{first:?}");
    idpool(&["db", "migrate"]);
    assert_eq!(applied().await, first, "run again, it changed nothing");

    for (args, projects, admin) in [
        (
            &["--project", "P", "--project", "Q", "--name", "ci"][..],
            vec!["P", "Q"],
            false,
        ),
        // An admin key reaches every project: none is named.
        (&["--admin", "--name", "ops"], vec![], true),
    ] {
        let started = chrono::Utc::now();
        let printed = idpool(&[&["keys", "create"][..], args].concat());
        assert_eq!(printed.lines().count(), 1, "one JSON object: {printed}");
        let created: serde_json::Value = serde_json::from_str(&printed).expect("JSON");
        let mut fields: Vec<&str> = created
            .as_object()
            .expect("an object")
            .keys()
            .map(String::as_str)
            .collect();
        fields.sort_unstable();
        assert_eq!(
            fields,
            ["admin", "created_at", "id", "key", "name", "projects"]
        );
        let name = args[args.len() - 1];
        assert_eq!(
            (&created["name"], &created["projects"], &created["admin"]),
            (
                &serde_json::json!(name),
                &serde_json::json!(projects),
                &serde_json::json!(admin)
            )
        );
        let at = chrono::DateTime::parse_from_rfc3339(created["created_at"].as_str().unwrap_or(""))
            .expect("created_at is RFC 3339");
        assert!(
            (at.to_utc() - started).num_seconds().abs() < 60,
            "created at {at}"
        );
        let (id, key) = (
            created["id"].as_str().expect("id"),
            created["key"].as_str().expect("key"),
        );
        assert!(key.len() >= 43, "a secret of at least 128 bits: {key}");
        let listed = idpool(&["keys", "list"]);
        let line: serde_json::Value = listed
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .find(|l| l["id"] == id)
            .unwrap_or_else(|| panic!("{id} not listed: {listed}"));
        assert_eq!(line["name"], name);
        assert!(
            !listed.contains(&key[key.len() - 43..]),
            "the secret listed"
        );
        assert!(line.get("key").is_none(), "{line}");
    }
    let refused = |args: &[&str]| {
        let (succeeded, _, said) = run(args);
        assert!(!succeeded, "idpool {args:?} succeeded");
        said
    };
    // A name a log line or a list could be forged with is refused.
    let long = "n".repeat(101);
    for name in ["evil\nname", "", long.as_str()] {
        let said = refused(&["keys", "create", "--project", "P", "--name", name]);
        assert!(said.contains("name"), "{said}");
    }
    // A whole key given to revoke by mistake is not repeated.
    let secret = "SECRETsecretSECRETsecretSECRETsecretSECRETs";
    let said = refused(&["keys", "revoke", &format!("idp_abcdefgh1234_{secret}")]);
    assert!(!said.contains(secret), "the secret was repeated: {said}");
    assert!(said.contains("no key"), "{said}");
    db.close().await;
}
