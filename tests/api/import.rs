//! `idpool import`, the customer migration tool, as a customer runs it: a
//! child process against a running idpool, killed and run again.

use crate::support::app::client_with_key;
use crate::support::app::until;
use crate::support::probes::*;
use reqwest::StatusCode;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::sync::atomic::Ordering;
use std::time::Instant;

use std::collections::HashSet;
use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use serde_json::{Value, json};

use crate::support::app::{TestApp, TestEnv, create_key};
use crate::support::app::{eventually, eventually_every};

fn import(app: &TestApp, key: &str, file: &Path, out: &Path, extra: &[&str]) -> Command {
    import_as(app, "1", key, file, out, extra)
}

/// `idpool import` of `file` into IMP/`doc_type`, the key in IDPOOL_KEY.
fn import_as(
    app: &TestApp,
    doc_type: &str,
    key: &str,
    file: &Path,
    out: &Path,
    extra: &[&str],
) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_idpool"));
    command
        .arg("import")
        .arg(file)
        .args([
            "--project",
            "IMP",
            "--type",
            doc_type,
            "--url",
            &app.address,
        ])
        .env("IDPOOL_KEY", key)
        .arg("--out")
        .arg(out)
        .args(extra)
        .stdout(crate::support::app::child_output())
        .stderr(Stdio::piped());
    command
}

/// A JSON-lines file of documents `{source_id, metadata}`.
fn write_lines(path: &Path, lines: impl Iterator<Item = (String, Value)>) {
    let mut file = std::fs::File::create(path).unwrap();
    for (source_id, metadata) in lines {
        writeln!(
            file,
            "{}",
            json!({"source_id": source_id, "metadata": metadata})
        )
        .unwrap();
    }
}

fn mapping(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        // A line cut off by SIGKILL is not a line yet.
        .filter_map(|line| serde_json::from_str(line).ok())
        .collect()
}

async fn count(app: &TestApp, sql: &'static str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(&app.db).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_import_killed_midway_and_run_again_gives_every_source_id_one_document() {
    let app = TestEnv::new().spawn().await;
    let key = create_key(&app.state, &["IMP"], false).await;
    let work = tempfile::tempdir().unwrap();
    let input = work.path().join("legacy.jsonl");
    let mut file = std::fs::File::create(&input).unwrap();
    for i in 0..5000 {
        let line = json!({"source_id": format!("legacy-{i}"), "metadata": {"n": i, "pad": "x".repeat(200)}});
        writeln!(file, "{line}").unwrap();
    }
    drop(file);

    let first_out = work.path().join("first.jsonl");
    let mut first = import(
        &app,
        &key,
        &input,
        &first_out,
        &["--batch", "50", "--concurrency", "2"],
    )
    .spawn()
    .unwrap();
    eventually_every(
        Duration::from_secs(60),
        Duration::from_millis(5),
        "the first run maps 1000 lines",
        async || {
            assert!(
                first.try_wait().unwrap().is_none(),
                "the first run finished before it could be killed"
            );
            (mapping(&first_out).len() >= 1000).then_some(())
        },
    )
    .await;
    first.kill().unwrap();
    first.wait().unwrap();
    let before = mapping(&first_out);
    println!("killed after {} of 5000 lines", before.len());
    assert!(before.len() < 5000);

    let second_out = work.path().join("second.jsonl");
    let second = import(&app, &key, &input, &second_out, &[])
        .output()
        .unwrap();
    assert!(
        second.status.success(),
        "{}",
        String::from_utf8_lossy(&second.stderr)
    );
    let after = mapping(&second_out);
    assert_eq!(after.len(), 5000, "every line mapped");
    for (i, line) in after.iter().enumerate() {
        assert_eq!(line["source_id"], format!("legacy-{i}"), "input order");
    }
    let ids: HashSet<&str> = after.iter().map(|l| l["id"].as_str().unwrap()).collect();
    assert_eq!(ids.len(), 5000, "one ID per source id");
    // What the first run wrote, the second says again, as a replay.
    for (first, second) in before.iter().zip(&after) {
        assert_eq!(
            (&first["source_id"], &first["id"]),
            (&second["source_id"], &second["id"])
        );
        assert_eq!(second["replayed"], true);
    }
    assert_eq!(
        count(
            &app,
            "SELECT count(*) FROM id_outbox WHERE tenant_code = 'IMP'"
        )
        .await,
        5000,
        "no document twice"
    );
    eventually(Duration::from_secs(60), "all delivered", async || {
        (count(&app, "SELECT count(*) FROM documents WHERE project = 'IMP'").await >= 5000)
            .then_some(())
    })
    .await;
    assert_eq!(
        count(
            &app,
            "SELECT count(*) FROM id_outbox WHERE tenant_code = 'IMP' AND status <> 'committed'"
        )
        .await,
        0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_lines_are_rejected_with_their_reason_and_every_good_line_is_imported() {
    let app = TestEnv::new().spawn().await;
    let key = create_key(&app.state, &["IMP"], false).await;
    let work = tempfile::tempdir().unwrap();
    let input = work.path().join("mixed.jsonl");
    let huge = "y".repeat(300 * 1024);
    let lines = [
        json!({"source_id": "a-1", "metadata": {"ok": true}}).to_string(),
        json!({"metadata": {"no": "source id"}}).to_string(),
        json!({"source_id": "a-2", "metadata": {"ok": true}}).to_string(),
        json!({"source_id": "a-1", "metadata": {"again": true}}).to_string(),
        "{not json".to_owned(),
        json!({"source_id": "a-3", "metadata": {"big": huge}}).to_string(),
        r#"{"source_id": "a-4", "metadata": {"nul": "x\u0000"}}"#.to_owned(),
        json!({"source_id": 5, "metadata": {}}).to_string(),
        r#"{"source_id": "a-\u0000-9", "metadata": {}}"#.to_owned(),
        // Past 2^64: as floats these two would be one id.
        r#"{"source_id": 184467440737095516160001, "metadata": {}}"#.to_owned(),
        r#"{"source_id": 184467440737095516160002, "metadata": {}}"#.to_owned(),
    ];
    std::fs::write(&input, lines.join("\n")).unwrap();
    let out = work.path().join("map.jsonl");
    let run = import(&app, &key, &input, &out, &[]).output().unwrap();
    assert_eq!(
        run.status.code(),
        Some(1),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let mapped = mapping(&out);
    let sources: Vec<&str> = mapped
        .iter()
        .map(|l| l["source_id"].as_str().unwrap())
        .collect();
    assert_eq!(
        sources,
        [
            "a-1",
            "a-2",
            "5",
            "184467440737095516160001",
            "184467440737095516160002"
        ]
    );
    let rejects = mapping(&work.path().join("map.rejects.jsonl"));
    let reasons: Vec<(i64, String)> = rejects
        .iter()
        .map(|r| {
            (
                r["line"].as_i64().unwrap(),
                r["reason"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    let expected = [
        (2, "source_id"),
        (4, "duplicate"),
        (5, "JSON"),
        (6, "limit"),
        (7, "NUL"),
        (9, "NUL"),
    ];
    assert_eq!(reasons.len(), expected.len(), "{reasons:?}");
    for ((line, reason), (want_line, mention)) in reasons.iter().zip(expected) {
        assert_eq!(*line, want_line, "{reasons:?}");
        assert!(reason.contains(mention), "line {line}: {reason}");
    }
    assert_eq!(
        count(
            &app,
            "SELECT count(*) FROM id_outbox WHERE tenant_code = 'IMP'"
        )
        .await,
        5
    );

    // Naming the input as the mapping would wipe it: refused, kept.
    let before = std::fs::read(&input).unwrap();
    let run = import(&app, &key, &input, &input, &[]).output().unwrap();
    assert_eq!(run.status.code(), Some(2));
    let said = String::from_utf8_lossy(&run.stderr);
    assert!(said.contains("is the input file"), "{said}");
    assert_eq!(std::fs::read(&input).unwrap(), before);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_csv_file_is_imported_with_its_columns_as_metadata() {
    let app = TestEnv::new().spawn().await;
    let key = create_key(&app.state, &["IMP"], false).await;
    let work = tempfile::tempdir().unwrap();
    let input = work.path().join("legacy.csv");
    std::fs::write(
        &input,
        "title,source_id,amount\n\"Level 3, east\",L-1,12.50\nLevel 4,L-2,7\n",
    )
    .unwrap();
    let out = work.path().join("map.jsonl");
    let run = import(&app, &key, &input, &out, &[]).output().unwrap();
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let mapped = mapping(&out);
    assert_eq!(mapped.len(), 2);
    let metadata: Value =
        sqlx::query_scalar("SELECT payload FROM id_outbox WHERE document_id = $1")
            .bind(mapped[0]["id"].as_str().unwrap())
            .fetch_one(&app.db)
            .await
            .unwrap();
    assert_eq!(
        metadata,
        json!({"title": "Level 3, east", "amount": "12.50"})
    );
}

/// What editors and exports get wrong about text: a byte-order mark, a
/// line in another encoding, a misspelt field. Each is a line's fate at
/// most, never the run's, and never silently dropped data.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn encoding_marks_bad_bytes_and_unknown_fields_are_each_one_lines_fate() {
    let app = TestEnv::new().spawn().await;
    let key = create_key(&app.state, &["IMP"], false).await;
    let work = tempfile::tempdir().unwrap();
    let input = work.path().join("exported.jsonl");
    let mut bytes = b"\xEF\xBB\xBF".to_vec();
    bytes.extend_from_slice(br#"{"source_id": "e-1", "metadata": {"a": 1}}"#);
    bytes.extend_from_slice(b"\r\n");
    bytes.extend_from_slice(b"{\"source_id\": \"e-2\", \"metadata\": {\"name\": \"Mu\xF1oz\"}}\n");
    bytes.extend_from_slice(br#"{"source_id": "e-3", "metdata": {"lost": true}}"#);
    bytes.push(b'\n');
    bytes.extend_from_slice(br#"{"source_id": "e-4", "metadata": {"a": 4}}"#);
    bytes.push(b'\n');
    std::fs::write(&input, &bytes).unwrap();
    let out = work.path().join("map.jsonl");
    let run = import(&app, &key, &input, &out, &[]).output().unwrap();
    assert_eq!(
        run.status.code(),
        Some(1),
        "a rejected line, not the end of the run: {}",
        String::from_utf8_lossy(&run.stderr)
    );
    let sources: Vec<String> = mapping(&out)
        .iter()
        .map(|l| l["source_id"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(sources, ["e-1", "e-4"], "the lines past the bad ones too");
    let rejects: Vec<(i64, Value, String)> = mapping(&work.path().join("map.rejects.jsonl"))
        .iter()
        .map(|r| {
            let reason = r["reason"].as_str().unwrap().to_owned();
            (r["line"].as_i64().unwrap(), r["source_id"].clone(), reason)
        })
        .collect();
    assert_eq!(rejects.len(), 2, "{rejects:?}");
    assert_eq!(rejects[0].0, 2, "{rejects:?}");
    assert!(rejects[0].2.contains("UTF-8"), "{rejects:?}");
    assert_eq!(rejects[1].0, 3, "{rejects:?}");
    assert_eq!(rejects[1].1, json!("e-3"), "{rejects:?}");
    assert!(
        rejects[1].2.contains("unknown field `metdata`"),
        "{rejects:?}"
    );
    let metadata: Value =
        sqlx::query_scalar("SELECT payload FROM id_outbox WHERE source_id = 'e-1'")
            .fetch_one(&app.db)
            .await
            .unwrap();
    assert_eq!(
        metadata,
        json!({"a": 1}),
        "line 1 read past its byte-order mark"
    );
    assert_eq!(
        count(
            &app,
            "SELECT count(*) FROM id_outbox WHERE tenant_code = 'IMP'"
        )
        .await,
        2
    );

    // A CSV export with a byte-order mark before its header.
    let csv = work.path().join("exported.csv");
    std::fs::write(&csv, b"\xEF\xBB\xBFsource_id,title\nc-1,first\n").unwrap();
    let run = import(&app, &key, &csv, &work.path().join("csv.jsonl"), &[])
        .output()
        .unwrap();
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    // A header that names a column twice: refused before anything is sent,
    // rather than one `source_id` taken and the other made metadata.
    let twice = work.path().join("twice.csv");
    std::fs::write(&twice, "source_id,title,source_id\nd-1,first,d-9\n").unwrap();
    let run = import(&app, &key, &twice, &work.path().join("twice.jsonl"), &[])
        .output()
        .unwrap();
    assert_eq!(run.status.code(), Some(2));
    let said = String::from_utf8_lossy(&run.stderr);
    assert!(said.contains("\"source_id\" twice"), "{said}");
    assert_eq!(
        count(
            &app,
            "SELECT count(*) FROM id_outbox WHERE source_id LIKE 'd-%'"
        )
        .await,
        0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_import_over_its_keys_rate_waits_and_retries_until_done() {
    let mut env = TestEnv::new();
    env.rate_limit = 2;
    let app = env.spawn().await;
    let key = create_key(&app.state, &["IMP"], false).await;
    let work = tempfile::tempdir().unwrap();
    let input = work.path().join("legacy.jsonl");
    let lines: Vec<String> = (0..100)
        .map(|i| json!({"source_id": i, "metadata": {}}).to_string())
        .collect();
    std::fs::write(&input, lines.join("\n")).unwrap();
    let out = work.path().join("map.jsonl");
    let run = import(
        &app,
        &key,
        &input,
        &out,
        &["--batch", "10", "--concurrency", "4"],
    )
    .output()
    .unwrap();
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    assert_eq!(mapping(&out).len(), 100);
    assert_eq!(
        count(
            &app,
            "SELECT count(*) FROM id_outbox WHERE tenant_code = 'IMP'"
        )
        .await,
        100
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_import_run_again_days_later_with_another_key_creates_no_document_twice() {
    let app = TestEnv::new().spawn().await;
    let first_key = create_key(&app.state, &["IMP"], false).await;
    let second_key = create_key(&app.state, &["IMP"], false).await;
    let work = tempfile::tempdir().unwrap();
    let input = work.path().join("legacy.jsonl");
    write_lines(
        &input,
        (0..300).map(|i| (format!("old-{i}"), json!({"n": i}))),
    );
    let first_out = work.path().join("first.jsonl");
    let first = import(&app, &first_key, &input, &first_out, &["--batch", "100"])
        .output()
        .unwrap();
    assert!(
        first.status.success(),
        "{}",
        String::from_utf8_lossy(&first.stderr)
    );
    // Days later every Idempotency-Key record is gone, and the customer
    // runs it again with another key, read from a file.
    sqlx::query("DELETE FROM idempotency_keys")
        .execute(&app.db)
        .await
        .unwrap();
    let key_file = work.path().join("key");
    std::fs::write(&key_file, format!("{second_key}\n")).unwrap();
    let second_out = work.path().join("second.jsonl");
    let second = import(
        &app,
        "not-this-one",
        &input,
        &second_out,
        &["--batch", "100"],
    )
    .arg("--key-file")
    .arg(&key_file)
    .output()
    .unwrap();
    assert!(
        second.status.success(),
        "{}",
        String::from_utf8_lossy(&second.stderr)
    );
    let (first, second) = (mapping(&first_out), mapping(&second_out));
    assert_eq!(first.len(), 300);
    assert_eq!(second.len(), 300);
    for (a, b) in first.iter().zip(&second) {
        assert_eq!(a["source_id"], b["source_id"]);
        assert_eq!(a["id"], b["id"], "one ID per source id, for ever");
        assert_eq!(b["replayed"], true);
    }
    assert_eq!(count(&app, "SELECT count(*) FROM id_outbox").await, 300);

    // A document the server refuses is a reject line, never the end of the
    // run: here one whose ID another document holds (a definition saved
    // before such definitions were refused).
    sqlx::query(
        "INSERT INTO sequences (project, doc_type, format, layout, start_seq, reset, timezone, \
                                pool_size, refill_at) \
         VALUES ('IMP', '2', 'TAKEN-{seq}', 'text', 1, 'never', 'UTC', 1000, 0.75)",
    )
    .execute(&app.db)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO id_outbox (document_id, tenant_code, entity_type_id, payload, sequence_id, \
                                period, seq, seq_number) \
         VALUES ('TAKEN-1', 'OTHER', '1', '{}', -1, '', 1, 1)",
    )
    .execute(&app.db)
    .await
    .unwrap();
    let some = work.path().join("some.jsonl");
    write_lines(&some, (0..5).map(|i| (format!("new-{i}"), json!({}))));
    let third_out = work.path().join("third.jsonl");
    let third = import_as(
        &app,
        "2",
        &first_key,
        &some,
        &third_out,
        &["--key", &first_key],
    )
    .output()
    .unwrap();
    let said = String::from_utf8_lossy(&third.stderr);
    assert_eq!(
        third.status.code(),
        Some(1),
        "rejects end the run with 1: {said}"
    );
    assert!(
        said.contains("--key"),
        "a key on the command line is warned about: {said}"
    );
    assert_eq!(
        mapping(&third_out).len(),
        4,
        "the other lines were imported: {:?}",
        std::fs::read_to_string(work.path().join("third.rejects.jsonl"))
    );
    let rejects = std::fs::read_to_string(work.path().join("third.rejects.jsonl")).unwrap();
    assert!(rejects.contains("document_id_taken"), "{rejects}");
}

/// Tenant A migrates 100,000 documents with `idpool import` (8 batches at
/// once) into one instance while tenant B sends keyed requests one at a
/// time to another, both on one Postgres and two cores; B's instance
/// delivers every tenant's documents to a webhook that answers in half a
/// second (its outbox loops hold their connections through A's backlog)
/// and reconciles all along.
/// B gets no error (no connection it needs is held by A's work or by
/// background work), a key made for B during the import is served at
/// once, and B's p99 grows by no more than the machine's share of it: what B's
/// process waits for a core (its `GET /healthz` p99) plus three times what
/// a bare transaction of B's size on the same Postgres waits more
/// meanwhile. Every answer of B waits for its transaction, and the import
/// slows every statement of that Postgres, idpool's or not (BENCHMARKS.md
/// has the figures of a release build).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenants_import_fails_no_request_of_another_and_slows_it_no_more_than_postgres() {
    let env = TestEnv::new();
    let setup = env.spawn().await;
    let key_a = create_key(&setup.state, &["TENA"], false).await;
    let key_b = create_key(&setup.state, &["TENB"], false).await;
    sqlx::query("CREATE TABLE bare_commits (id bigserial PRIMARY KEY, at timestamptz NOT NULL)")
        .execute(&setup.db)
        .await
        .expect("a table of our own");
    let instance_a = crate::support::app::ServeProcess::start(&env).await;
    let webhook =
        crate::support::webhook::Webhook::start(crate::support::webhook::Behaviour::Succeed).await;
    webhook.slow_down(Duration::from_millis(500));
    let mut delivering = env.clone();
    delivering.sink = idpool::features::documents::sink::SinkConfig::Webhook(webhook.url.clone());
    let instance_b = crate::support::app::ServeProcess::start(&delivering).await;
    let base_b = format!("http://127.0.0.1:{}", instance_b.port);
    let client_b = client_with_key(Some(&key_b));

    let dir = tempfile::tempdir().expect("a directory");
    let input = dir.path().join("tena.jsonl");
    let mut lines = String::with_capacity(100_000 * 64);
    for n in 0..100_000 {
        lines.push_str(&format!(
            "{{\"source_id\": \"a-{n}\", \"metadata\": {{\"n\": {n}, \"pad\": \"xxxxxxxxxxxxxxxx\"}}}}\n"
        ));
    }
    std::fs::write(&input, lines).expect("the input");

    // Alone (after a warm-up: first use creates B's sequences).
    tenant_b_one_at_a_time(&client_b, &base_b, 50, None).await;
    let mut alone = tenant_b_one_at_a_time(&client_b, &base_b, 400, None).await;
    assert!(alone.failures.is_empty(), "B alone: {:?}", alone.failures);
    let alone_p99 = p99(&mut alone.issuing);
    let healthz_alone = p99(&mut alone.healthz);
    let floor_alone = p99(&mut bare_commits(&setup.db, 400, None).await);

    let mut import = std::process::Command::new(env!("CARGO_BIN_EXE_idpool"))
        .arg("import")
        .arg(&input)
        .args(["--project", "TENA", "--type", "1", "--concurrency", "8"])
        .args(["--url", &format!("http://127.0.0.1:{}", instance_a.port)])
        .arg("--out")
        .arg(dir.path().join("tena.map.jsonl"))
        .env("IDPOOL_KEY", &key_a)
        .stdout(crate::support::app::child_output())
        .stderr(crate::support::app::child_output())
        .spawn()
        .expect("idpool import starts");
    let importing = Arc::new(AtomicBool::new(true));
    let beside = {
        let (client_b, base_b, importing) = (client_b.clone(), base_b.clone(), importing.clone());
        tokio::spawn(async move {
            tenant_b_one_at_a_time(&client_b, &base_b, 100, Some(&importing)).await
        })
    };
    let floor = {
        let (db, importing) = (setup.db.clone(), importing.clone());
        tokio::spawn(async move { bare_commits(&db, 100, Some(&importing)).await })
    };
    // B's instance reconciles meanwhile, as each instance does on its
    // interval (a run reads what the import writes).
    let reconciling = {
        let (client, url, importing) = (
            setup.client.clone(),
            format!("{base_b}/api/v1/ids/gaps/reconcile"),
            importing.clone(),
        );
        tokio::spawn(async move {
            while importing.load(Ordering::Relaxed) {
                let _ = client.post(&url).send().await;
            }
        })
    };
    // A key made meanwhile: B's instance looks it up for its first request.
    until(
        Duration::from_secs(10),
        "A's backlog reaches B's outbox",
        async || webhook.received().len() + webhook.connections() > 0,
    )
    .await;
    let new_key = client_with_key(Some(&create_key(&setup.state, &["TENB"], false).await));
    let started = Instant::now();
    let first = new_key
        .post(format!("{base_b}/ids"))
        .json(&json!({"project": "TENB", "type": "1", "count": 1}))
        .send()
        .await
        .expect("B's instance answers");
    let new_key_took = started.elapsed();
    assert_eq!(first.status(), StatusCode::OK, "a new key's first request");
    let status = tokio::task::spawn_blocking(move || import.wait())
        .await
        .expect("import")
        .expect("import ran");
    importing.store(false, Ordering::Relaxed);
    reconciling.await.expect("reconciliation runs");
    let mut beside = beside.await.expect("B beside the import");
    let floor_beside = p99(&mut floor.await.expect("bare commits beside the import"));
    assert!(status.success(), "the import failed: {status}");
    let imported: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM id_outbox WHERE tenant_code = 'TENA' AND source_id IS NOT NULL",
    )
    .fetch_one(&setup.db)
    .await
    .expect("count");
    assert_eq!(imported, 100_000, "every line imported");
    let failures = &beside.failures;
    assert!(
        failures.is_empty(),
        "B beside A's import: {} of {} not 2xx, e.g. {:?}",
        failures.len(),
        beside.issuing.len() + beside.healthz.len(),
        &failures[..failures.len().min(3)]
    );
    let beside_p99 = p99(&mut beside.issuing);
    let healthz_beside = p99(&mut beside.healthz);
    println!(
        "B's p99 alone {alone_p99:?}, beside the import {beside_p99:?} ({} requests); its \
         GET /healthz {healthz_alone:?} and {healthz_beside:?}; a bare transaction's \
         {floor_alone:?} and {floor_beside:?}",
        beside.issuing.len()
    );
    assert_answer_within(
        "A's import",
        "a key made during it, its first answer",
        &alone.issuing,
        new_key_took,
    );
    let grown = beside_p99.saturating_sub(alone_p99);
    let cores = healthz_beside.saturating_sub(healthz_alone);
    let commits = floor_beside.saturating_sub(floor_alone);
    assert!(
        grown <= cores + commits * 3,
        "B's p99 grew by {grown:?} ({alone_p99:?} alone, {beside_p99:?} beside A's import); \
         waiting for a core grew by {cores:?}, a bare transaction by {commits:?}"
    );
}
