//! Two instances behind PgBouncer in transaction mode, through a pool of
//! ten server connections: every promise holds, and nothing of theirs
//! (a statement, a setting, a lock) outlives its transaction.

use std::collections::HashSet;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use reqwest::StatusCode;
use serde_json::{Value, json};
use sqlx::postgres::PgConnectOptions;

use crate::support::app::{
    TestApp, TestEnv, base_database_url, client_with_key, create_key_with_id,
};
use crate::support::topology::free_port;
use crate::support::webhook::{Behaviour, Webhook};
use idpool::features::documents::sink::SinkConfig;

/// PgBouncer on a free loopback port in front of the server of
/// `DATABASE_URL`; ended when dropped.
pub struct PgBouncer {
    child: Child,
    port: u16,
    user: String,
    _dir: tempfile::TempDir,
}

impl PgBouncer {
    pub fn start(pool_mode: &str, pool_size: u32) -> Self {
        let base: PgConnectOptions = base_database_url().parse().expect("DATABASE_URL");
        let host = base.get_host().to_owned();
        let server_port = base.get_port();
        let user = base.get_username().to_owned();
        let dir = tempfile::tempdir().expect("temp dir");
        let port = free_port();
        let path = |name: &str| dir.path().join(name).display().to_string();
        std::fs::write(dir.path().join("users.txt"), format!("\"{user}\" \"\"\n")).expect("users");
        let config = format!(
            "[databases]\n* = host={host} port={server_port}\n\n[pgbouncer]\n\
             listen_addr = 127.0.0.1\nlisten_port = {port}\nunix_socket_dir =\n\
             auth_type = trust\nauth_file = {users}\nadmin_users = {user}\n\
             pool_mode = {pool_mode}\ndefault_pool_size = {pool_size}\nmax_client_conn = 2000\n\
             ignore_startup_parameters = extra_float_digits,options\n\
             logfile = {log}\npidfile = {pid}\n",
            users = path("users.txt"),
            log = path("pgbouncer.log"),
            pid = path("pgbouncer.pid"),
        );
        std::fs::write(dir.path().join("pgbouncer.ini"), config).expect("config");
        let mut command = Command::new("pgbouncer");
        // PgBouncer refuses to run as root.
        if crate::support::topology::is_root() {
            set_owner(dir.path(), "postgres");
            command.args(["-u", "postgres"]);
        }
        let child = command
            .arg(dir.path().join("pgbouncer.ini"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("pgbouncer (scripts/dev-services.sh ha-tools installs it)");
        crate::support::app::eventually_blocking(
            Duration::from_secs(10),
            "PgBouncer starts",
            || std::net::TcpStream::connect(("127.0.0.1", port)).ok(),
        );
        Self {
            child,
            port,
            user,
            _dir: dir,
        }
    }

    /// `database` on the server, through PgBouncer.
    pub fn url(&self, database: &str) -> String {
        format!(
            "postgres://{}@127.0.0.1:{}/{database}",
            self.user, self.port
        )
    }
}

fn set_owner(dir: &Path, user: &str) {
    let status = Command::new("chown")
        .args(["-R", user])
        .arg(dir)
        .status()
        .expect("chown");
    assert!(status.success());
}

impl Drop for PgBouncer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn database_of(url: &str) -> String {
    let options: PgConnectOptions = url.parse().expect("URL");
    options.get_database().expect("a database").to_owned()
}

/// A test environment whose instances reach a new database through
/// `bouncer` in transaction mode (the test's own checks go straight to it).
async fn behind(bouncer: &PgBouncer) -> TestEnv {
    let mut env = TestEnv::new();
    let direct = env.database_url.clone();
    // The database is the operator's to create behind a pooler.
    idpool::infra::db::connect(
        &direct,
        1,
        idpool::infra::db::Limits::default(),
        idpool::infra::db::Pooler::None,
    )
    .await
    .expect("the test database")
    .close()
    .await;
    env.database_url = bouncer.url(&database_of(&direct));
    env.pg_pooler = idpool::infra::db::Pooler::Transaction;
    env.direct_database_url = Some(direct);
    env
}

/// Two instances of one database behind `bouncer`: the first listens for
/// notifications on a direct connection, the second polls.
async fn two_instances(bouncer: &PgBouncer, statement_timeout_ms: u64) -> (TestApp, TestApp) {
    let mut env = behind(bouncer).await;
    env.db_statement_timeout_ms = statement_timeout_ms;
    let mut listening = env.clone();
    listening.pg_listen_url = env.direct_database_url.clone();
    // Both start at once: their migrations meet through the pooler.
    tokio::join!(listening.spawn(), env.spawn())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_behind_a_transaction_pooler_keep_every_promise() {
    let bouncer = PgBouncer::start("transaction", 10);
    let (a, b) = two_instances(&bouncer, 1_000).await;

    // IDs from both at once: all answered, none twice.
    let mut requests = Vec::new();
    for app in [&a, &b] {
        for _ in 0..20 {
            let (client, url) = (app.client.clone(), app.url("/ids"));
            requests.push(tokio::spawn(async move {
                client
                    .post(url)
                    .json(&json!({"project": "POOL", "type": "1", "count": 50}))
                    .send()
                    .await
                    .expect("request")
            }));
        }
    }
    let mut ids = HashSet::new();
    for request in requests {
        let response = request.await.expect("task");
        assert_eq!(response.status(), StatusCode::OK);
        let body: Value = response.json().await.expect("json");
        for id in body["ids"].as_array().expect("ids") {
            assert!(
                ids.insert(id.as_str().expect("id").to_owned()),
                "{id} twice"
            );
        }
    }
    assert_eq!(ids.len(), 2 * 20 * 50);

    // Documents through each: delivered, by notification (a) and by
    // polling (b).
    let mut accepted = Vec::new();
    for (n, app) in [&a, &b].into_iter().enumerate() {
        for i in 0..25 {
            let response = app
                .post_document(
                    &json!({"project": "POOL", "type": "2", "metadata": {"from": n, "i": i}}),
                    None,
                )
                .await;
            assert_eq!(response.status(), StatusCode::ACCEPTED);
            let body: Value = response.json().await.expect("json");
            accepted.push(body["id"].as_str().expect("id").to_owned());
        }
    }
    let what = format!("all {} documents delivered", accepted.len());
    crate::support::app::eventually(Duration::from_secs(20), &what, async || {
        let delivered: i64 =
            sqlx::query_scalar("SELECT count(*) FROM documents WHERE document_id = ANY($1)")
                .bind(&accepted)
                .fetch_one(&a.db)
                .await
                .expect("count");
        (delivered == accepted.len() as i64).then_some(())
    })
    .await;

    // Reconciliation from both at once, again and again: never two runs
    // under way together.
    for _ in 0..5 {
        let ask = |app: &TestApp| {
            app.client
                .post(app.url("/api/v1/ids/gaps/reconcile"))
                .send()
        };
        let (x, y) = tokio::join!(ask(&a), ask(&b));
        for answer in [x, y] {
            let status = answer.expect("reconcile").status();
            assert!(
                status == StatusCode::OK || status == StatusCode::CONFLICT,
                "reconcile answered {status}"
            );
        }
    }
    let runs: Vec<(
        chrono::DateTime<chrono::Utc>,
        Option<chrono::DateTime<chrono::Utc>>,
    )> = sqlx::query_as("SELECT started_at, finished_at FROM reconcile_runs ORDER BY started_at")
        .fetch_all(&a.db)
        .await
        .expect("runs");
    assert!(runs.len() >= 5, "{} runs", runs.len());
    for pair in runs.windows(2) {
        let finished = pair[0].1.expect("every run finished");
        assert!(finished <= pair[1].0, "two runs overlapped: {pair:?}");
    }

    // A key revoked through one instance is refused by the other (which
    // polls) within the stated staleness.
    let (key_id, key) = create_key_with_id(&a.state, &["POOL"], false).await;
    let user = client_with_key(Some(&key));
    let first = user
        .post(b.url("/ids"))
        .json(&json!({"project": "POOL", "type": "1", "count": 1}))
        .send()
        .await
        .expect("request");
    assert_eq!(first.status(), StatusCode::OK);
    a.state.auth.keys().revoke(&key_id).await.expect("revoked");
    let what = "the revocation seen within the stated staleness";
    crate::support::app::eventually(idpool::infra::listen::POLL * 3, what, async || {
        let status = user
            .post(b.url("/ids"))
            .json(&json!({"project": "POOL", "type": "1", "count": 1}))
            .send()
            .await
            .expect("request")
            .status();
        if status == StatusCode::UNAUTHORIZED {
            return Some(());
        }
        assert_eq!(status, StatusCode::OK);
        None
    })
    .await;

    // The statement timeout holds although the pooler dropped the
    // startup parameters.
    let slept = sqlx::query("SELECT pg_sleep(5)") // a statement that outlasts the 1 s timeout: the delay is the point
        .execute(&b.state.db)
        .await
        .expect_err("cancelled by statement_timeout");
    assert_eq!(
        idpool::infra::db::sqlstate::of(&slept).as_deref(),
        Some(idpool::infra::db::sqlstate::QUERY_CANCELED),
        "{slept}"
    );

    // Nothing of ours is left on the server connections.
    let pooled = bouncer.url(&database_of(
        a.env.direct_database_url.as_ref().expect("direct"),
    ));
    let settings: Vec<(String, String)> = {
        // Through the pooler, by the simple protocol only (no statement of
        // the test's own is left behind either).
        let mut conn = <sqlx::PgConnection as sqlx::Connection>::connect_with(
            &pooled
                .parse::<sqlx::postgres::PgConnectOptions>()
                .expect("url")
                .extra_float_digits(None),
        )
        .await
        .expect("through the pooler");
        let mut found = Vec::new();
        for _ in 0..10 {
            use sqlx::Row;
            let rows = sqlx::raw_sql(
                "SELECT name, setting FROM pg_settings WHERE name IN ('statement_timeout', 'lock_timeout') \
                 UNION ALL SELECT 'prepared', name FROM pg_prepared_statements \
                 UNION ALL SELECT 'lock', objid::text FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()",
            )
            .fetch_all(&mut conn)
            .await
            .expect("settings");
            for row in rows {
                found.push((row.get::<String, _>(0), row.get::<String, _>(1)));
            }
        }
        found
    };
    for (name, value) in &settings {
        match name.as_str() {
            "statement_timeout" | "lock_timeout" => {
                assert_eq!(value, "0", "{name} left on a server connection")
            }
            other => panic!("{other} {value} left on a server connection"),
        }
    }
}

/// Behind a pooler every server connection is shared by every instance. A
/// webhook's batch holds none while the target answers (its claim is
/// committed before anything is sent), so one tenant's backlog to a slow
/// target takes none of them, and another tenant is served throughout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backlog_to_a_slow_target_leaves_the_pooler_to_other_tenants() {
    let bouncer = PgBouncer::start("transaction", 4);
    let webhook = Webhook::start(Behaviour::Succeed).await;
    webhook.slow_down(Duration::from_millis(1500));
    let mut env = behind(&bouncer).await;
    env.sink = SinkConfig::Webhook(webhook.url.clone());
    env.outbox_poll_ms = 50;
    // Small batches: every delivery loop of both instances has rows to
    // claim, and would hold a server connection with them if it held one
    // while the target answers (1.5 s). A claim's own transaction is idle
    // for a moment between its statements; one idle for over 0.5 s waits
    // on something else.
    env.outbox_batch = 5;
    let (a, b) = tokio::join!(env.spawn(), env.spawn());

    for i in 0..60 {
        let app = if i % 2 == 0 { &a } else { &b };
        let response = app
            .post_document(
                &json!({"project": "BACKLOG", "type": "1", "metadata": {"i": i}}),
                None,
            )
            .await;
        assert_eq!(response.status(), StatusCode::ACCEPTED);
    }
    crate::support::app::eventually(Duration::from_secs(20), "a delivery begins", async || {
        (!webhook.received().is_empty()).then_some(())
    })
    .await;

    let (_, key) = create_key_with_id(&a.state, &["OTHER"], false).await;
    let other = client_with_key(Some(&key));
    let mut most_held = 0;
    for i in 0..40 {
        let app = if i % 2 == 0 { &a } else { &b };
        let status = other
            .post(app.url("/ids"))
            .json(&json!({"project": "OTHER", "type": "1", "count": 1}))
            .send()
            .await
            .expect("request")
            .status();
        assert_eq!(status, StatusCode::OK, "request {i} of the other tenant");
        let held: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() \
             AND state = 'idle in transaction' AND query LIKE '%id_outbox%' \
             AND state_change < clock_timestamp() - interval '500 milliseconds'",
        )
        .fetch_one(&a.db)
        .await
        .expect("held");
        most_held = most_held.max(held);
    }
    assert_eq!(
        most_held, 0,
        "deliveries held server connections while the target answered"
    );
    assert!(
        !webhook.received().is_empty(),
        "the backlog was being delivered meanwhile"
    );
}

/// Server connections `bouncer` holds open for `database` now. PgBouncer
/// opens one only when a transaction finds none free, and keeps it for
/// `server_idle_timeout` (10 min), so this is the most the instances
/// behind it ever had in transactions at once.
async fn server_connections(bouncer: &PgBouncer, database: &str) -> usize {
    use sqlx::Row;
    let admin = bouncer
        .url("pgbouncer")
        .parse::<PgConnectOptions>()
        .expect("url")
        .extra_float_digits(None);
    let mut conn = <sqlx::PgConnection as sqlx::Connection>::connect_with(&admin)
        .await
        .expect("PgBouncer's console");
    // The console speaks the simple protocol only.
    let servers = sqlx::raw_sql("SHOW SERVERS")
        .fetch_all(&mut conn)
        .await
        .expect("SHOW SERVERS");
    servers
        .iter()
        .filter(|row| row.try_get::<String, _>("database").ok().as_deref() == Some(database))
        .count()
}

/// SPEC: "An instance reaches full throughput with at most 8 server
/// connections". Behind a pooler that offers it 32, an instance under
/// more load than it can serve (IDs, documents and their delivery, the
/// refills and checkpoints behind them) never has more than 8
/// transactions open at once, so a pool of 8 never makes it wait. The
/// throughput with 8 against 32 is the bench's (`poolers`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_at_full_throughput_needs_at_most_eight_server_connections() {
    let bouncer = PgBouncer::start("transaction", 32);
    let mut env = behind(&bouncer).await;
    env.pg_listen_url = env.direct_database_url.clone();
    env.outbox_poll_ms = 50;
    let app = env.spawn().await;
    let database = database_of(env.direct_database_url.as_ref().expect("direct"));
    // First uses create the sequences, each in a transaction of its own:
    // done before, as the load is the steady state.
    for kind in ["t0", "t1", "t2", "t3"] {
        app.issue("FULL", kind, 1).await;
    }
    let first = app
        .post_document(
            &json!({"project": "FULL", "type": "doc", "metadata": {}}),
            None,
        )
        .await;
    assert_eq!(first.status(), StatusCode::ACCEPTED);

    const CLIENTS: usize = 48;
    const EACH: usize = 60;
    let mut load = Vec::new();
    for client in 0..CLIENTS {
        let (http, ids, documents) = (app.client.clone(), app.url("/ids"), app.url("/documents"));
        load.push(tokio::spawn(async move {
            for i in 0..EACH {
                let (url, body, expected) = match i % 2 {
                    0 => (
                        &ids,
                        json!({"project": "FULL", "type": format!("t{}", client % 4), "count": 1}),
                        StatusCode::OK,
                    ),
                    _ => (
                        &documents,
                        json!({"project": "FULL", "type": "doc", "metadata": {"c": client, "i": i}}),
                        StatusCode::ACCEPTED,
                    ),
                };
                let status = http
                    .post(url.as_str())
                    .json(&body)
                    .send()
                    .await
                    .expect("request")
                    .status();
                assert_eq!(status, expected, "{url} {body}");
            }
        }));
    }
    for task in load {
        task.await.expect("client");
    }
    let accepted = (CLIENTS * EACH / 2 + 1) as i64;
    crate::support::app::eventually(
        Duration::from_secs(30),
        "every document delivered",
        async || {
            let delivered: i64 = sqlx::query_scalar("SELECT count(*) FROM documents")
                .fetch_one(&app.db)
                .await
                .expect("count");
            (delivered == accepted).then_some(())
        },
    )
    .await;

    let opened = server_connections(&bouncer, &database).await;
    println!("{opened} server connections opened at full throughput");
    assert!(opened >= 1, "the load went through the pooler");
    assert!(
        opened <= 8,
        "{opened} server connections opened for one instance at full throughput"
    );
}
