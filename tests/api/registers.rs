//! Registers an auditor can verify (SPEC "Registers an auditor can
//! verify"): hash-chained entries in the commit of each event, a signed
//! RFC 6962 tree per project, proofs, online and offline verification,
//! and VERI*FACTU's chain.

use std::time::Duration;

use reqwest::StatusCode;
use serde_json::{Value, json};

use idpool::domain::merkle::{self, Frontier};
use idpool::domain::signed_note::{Checkpoint, NoteVerifier};
use idpool::domain::verifactu::{Alta, Anulacion};
use idpool::features::registers::bundle;

use crate::support::app::{TestApp, TestEnv, assert_problem, create_key, eventually};

async fn define_chain(app: &TestApp, project: &str, doc_type: &str) {
    app.define(
        project,
        doc_type,
        json!({"numbering": "gapless", "register": "chain", "format": "{project}-{type}-{seq:4}"}),
    )
    .await;
}

async fn accept(app: &TestApp, body: Value) -> Value {
    let response = app.post_document(&body, None).await;
    let status = response.status();
    let body: Value = response.json().await.expect("json");
    assert_eq!(status, StatusCode::ACCEPTED, "{body}");
    body
}

async fn entries(app: &TestApp, project: &str, doc_type: &str) -> Vec<Value> {
    let mut all = Vec::new();
    let mut from = 1;
    loop {
        let page = app
            .ok_json(&format!(
                "/api/v1/registers/{project}/{doc_type}/entries?from_seq={from}&limit=3"
            ))
            .await;
        all.extend(page["entries"].as_array().expect("entries").iter().cloned());
        match page["next_from_seq"].as_i64() {
            Some(next) => from = next,
            None => return all,
        }
    }
}

async fn verify(app: &TestApp, project: &str, doc_type: &str) -> Value {
    app.ok_json(&format!("/api/v1/registers/{project}/{doc_type}/verify"))
        .await
}

/// The project's log as stored: every entry's body, in index order.
async fn bodies(app: &TestApp, project: &str) -> Vec<String> {
    sqlx::query_scalar("SELECT body FROM register_entries WHERE project = $1 ORDER BY log_index")
        .bind(project)
        .fetch_all(&app.db)
        .await
        .expect("bodies")
}

async fn public_key(app: &TestApp) -> NoteVerifier {
    // Open to anyone: no key sent.
    let body: Value = reqwest::get(app.url("/api/v1/registers/public-key"))
        .await
        .expect("public key")
        .json()
        .await
        .expect("json");
    let current = body["keys"]
        .as_array()
        .expect("keys")
        .iter()
        .find(|k| k["current"] == true)
        .expect("a current key");
    NoteVerifier::parse(current["verifier"].as_str().expect("verifier")).expect("a verifier key")
}

/// The project's checkpoint once it covers `size` entries, verified by
/// the published key.
async fn checkpoint_of(app: &TestApp, project: &str, size: u64) -> Checkpoint {
    let key = public_key(app).await;
    eventually(
        Duration::from_secs(20),
        "a checkpoint of the whole log",
        async || {
            let response = app
                .client
                .get(app.url(&format!("/api/v1/registers/{project}/checkpoint")))
                .send()
                .await
                .ok()?;
            let note = response.text().await.ok()?;
            let text = key.verify(&note).ok()?;
            let checkpoint = Checkpoint::parse(text).expect("a checkpoint");
            (checkpoint.size == size).then_some(checkpoint)
        },
    )
    .await
}

fn hash(hex_text: &Value) -> merkle::Hash {
    hex::decode(hex_text.as_str().expect("hex"))
        .expect("hex")
        .try_into()
        .expect("32 bytes")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_event_of_a_register_is_chained_signed_and_provable() {
    let mut env = TestEnv::new();
    env.reservation_ttl_s = 1;
    let app = env.spawn().await;
    define_chain(&app, "RG", "INV").await;
    // Documents by every path: single, keyed, batch; a reservation
    // attached, one voided with a reason, one left to expire.
    let doc = json!({"project": "RG", "type": "INV", "metadata": {"n": 1}});
    accept(&app, doc.clone()).await;
    let keyed = app.post_document(&doc, Some("rg-1")).await;
    assert_eq!(keyed.status(), StatusCode::ACCEPTED);
    let batch = app.post_batch(vec![doc.clone(), doc.clone()]).await;
    assert_eq!(batch.status(), StatusCode::ACCEPTED);
    let (reserved, _) = app.issue("RG", "INV", 3).await;
    accept(
        &app,
        json!({"project": "RG", "type": "INV", "metadata": {}, "id": reserved[0]}),
    )
    .await;
    let voided = app
        .client
        .post(app.url("/api/v1/ids/void"))
        .json(&json!({"project": "RG", "type": "INV", "id": reserved[1], "reason": "customer cancelled"}))
        .send()
        .await
        .expect("void");
    assert_eq!(voided.status(), StatusCode::OK);
    let log = eventually(
        Duration::from_secs(20),
        "the third reservation expired",
        async || {
            let log = entries(&app, "RG", "INV").await;
            (log.len() == 7).then_some(log)
        },
    )
    .await;

    // One entry per event, in chain order, each linked to the one before.
    let events: Vec<(&str, &str)> = log
        .iter()
        .map(|e| (e["event"].as_str().unwrap(), e["id"].as_str().unwrap()))
        .collect();
    let attached = events.iter().filter(|(e, _)| *e == "attached").count();
    assert_eq!(attached, 5, "{events:?}");
    assert!(
        events.contains(&("voided", reserved[1].as_str())),
        "{events:?}"
    );
    assert!(
        events.contains(&("expired", reserved[2].as_str())),
        "{events:?}"
    );
    let mut prev = String::new();
    for (position, entry) in log.iter().enumerate() {
        assert_eq!(entry["seq"], position as i64 + 1);
        assert_eq!(entry["prev_hash"], prev.as_str());
        let body = entry["body"].as_str().unwrap();
        use sha2::Digest;
        assert_eq!(
            entry["hash"],
            hex::encode(sha2::Sha256::digest(body.as_bytes()))
        );
        let parsed: Value = serde_json::from_str(body).unwrap();
        assert_eq!(parsed["prev"], prev.as_str());
        assert_eq!(parsed["id"], entry["id"]);
        prev = entry["hash"].as_str().unwrap().to_owned();
    }
    let void_body: Value = serde_json::from_str(
        log.iter().find(|e| e["event"] == "voided").unwrap()["body"]
            .as_str()
            .unwrap(),
    )
    .unwrap();
    assert_eq!(void_body["reason"], "customer cancelled");
    let verified = verify(&app, "RG", "INV").await;
    assert_eq!(verified["ok"], true, "{verified}");
    assert_eq!(verified["entries"], 7);
    assert_eq!(verified["head"], prev.as_str());

    // The signed checkpoint's root is the RFC 6962 root of the bodies.
    let bodies = bodies(&app, "RG").await;
    let mut tree = Frontier::default();
    for body in &bodies {
        tree.push(body.as_bytes());
    }
    let checkpoint = checkpoint_of(&app, "RG", 7).await;
    assert_eq!(checkpoint.root, tree.root());
    assert_eq!(checkpoint.origin, "idpool/RG");

    // Every entry's inclusion proof, and the consistency of every older
    // size, verify against the signed root.
    for (index, body) in bodies.iter().enumerate() {
        let proof = app
            .ok_json(&format!(
                "/api/v1/registers/RG/proofs/inclusion?index={index}&tree_size=7"
            ))
            .await;
        let hashes: Vec<merkle::Hash> = proof["hashes"]
            .as_array()
            .unwrap()
            .iter()
            .map(hash)
            .collect();
        let leaf = merkle::leaf_hash(body.as_bytes());
        assert!(
            merkle::verify_inclusion(index as u64, 7, &leaf, &hashes, &checkpoint.root),
            "entry {index}"
        );
        assert!(!merkle::verify_inclusion(
            index as u64,
            7,
            &merkle::leaf_hash(b"another body"),
            &hashes,
            &checkpoint.root
        ));
    }
    for from in 1..7u64 {
        let mut older = Frontier::default();
        for body in &bodies[..from as usize] {
            older.push(body.as_bytes());
        }
        let proof = app
            .ok_json(&format!(
                "/api/v1/registers/RG/proofs/consistency?from={from}&to=7"
            ))
            .await;
        let hashes: Vec<merkle::Hash> = proof["hashes"]
            .as_array()
            .unwrap()
            .iter()
            .map(hash)
            .collect();
        assert!(
            merkle::verify_consistency(from, 7, &older.root(), &checkpoint.root, &hashes),
            "from {from}"
        );
    }
    for bad in [
        "/api/v1/registers/RG/proofs/inclusion?index=7&tree_size=7",
        "/api/v1/registers/RG/proofs/inclusion?index=0&tree_size=8",
        "/api/v1/registers/RG/proofs/consistency?from=0&to=7",
        "/api/v1/registers/RG/proofs/consistency?from=5&to=4",
    ] {
        let response = app.client.get(app.url(bad)).send().await.unwrap();
        assert_problem(response, StatusCode::UNPROCESSABLE_ENTITY, "out_of_range").await;
    }
}

/// Changes an entry's stored column straight in Postgres.
async fn tamper(app: &TestApp, sql: &str) {
    sqlx::raw_sql(sqlx::AssertSqlSafe(sql.to_owned()))
        .execute(&app.db)
        .await
        .expect("tampering");
}

/// Rewrites entry `seq` of the project's chain (`from` becomes `to` in
/// its body) and every later entry's link, each hash recomputed: a chain
/// that reads whole, as a forger with write access would leave it.
async fn rehash_from(app: &TestApp, project: &str, seq: i64, from: &str, to: &str) {
    use sha2::Digest;
    let rows: Vec<(i64, String, String, String)> = sqlx::query_as(
        "SELECT seq, body, prev_hash, hash FROM register_entries WHERE project = $1 ORDER BY seq",
    )
    .bind(project)
    .fetch_all(&app.db)
    .await
    .expect("entries");
    let mut new_prev: Option<(String, String)> = None;
    for (position, body, prev, hash) in rows {
        if position < seq {
            continue;
        }
        let mut body = body.replace(from, to);
        let mut prev_hash = prev.clone();
        if let Some((old, new)) = &new_prev {
            body = body.replace(old.as_str(), new.as_str());
            prev_hash = new.clone();
        }
        let new_hash = hex::encode(sha2::Sha256::digest(body.as_bytes()));
        sqlx::query(
            "UPDATE register_entries SET body = $3, prev_hash = $4, hash = $5, \
                    id = replace(id, $6, $7) WHERE project = $1 AND seq = $2",
        )
        .bind(project)
        .bind(position)
        .bind(&body)
        .bind(&prev_hash)
        .bind(&new_hash)
        .bind(from)
        .bind(to)
        .execute(&app.db)
        .await
        .expect("rehashed");
        new_prev = Some((hash, new_hash));
    }
}

async fn export(app: &TestApp, project: &str) -> Vec<u8> {
    let mut out = Vec::new();
    bundle::export(app.state.registers.db(), project, &mut out)
        .await
        .expect("export");
    out
}

/// `idpool register verify` in a process of its own: its exit code and
/// what it printed.
fn verify_offline(bundle: &[u8], keys: &[String]) -> (i32, String) {
    verify_offline_with(bundle, keys, &[])
}

/// The same, with checkpoints the auditor kept (signed notes).
fn verify_offline_with(bundle: &[u8], keys: &[String], kept: &[String]) -> (i32, String) {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("bundle.jsonl");
    std::fs::write(&path, bundle).expect("bundle written");
    let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_idpool"));
    command.args(["register", "verify"]).arg(&path);
    for key in keys {
        command.args(["--key", key]);
    }
    for (n, note) in kept.iter().enumerate() {
        let file = dir.path().join(format!("kept-{n}.note"));
        std::fs::write(&file, note).expect("checkpoint written");
        command.arg("--checkpoint").arg(file);
    }
    let output = command.output().expect("idpool register verify");
    (
        output.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&output.stdout).into_owned(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_byte_a_deleted_entry_and_two_swapped_are_each_named_online_and_offline() {
    let env = TestEnv::new();
    let app = env.spawn().await;
    define_chain(&app, "TM", "1").await;
    for n in 0..6 {
        accept(
            &app,
            json!({"project": "TM", "type": "1", "metadata": {"n": n}}),
        )
        .await;
    }
    checkpoint_of(&app, "TM", 6).await;
    let key = public_key(&app).await.text();
    let good = export(&app, "TM").await;
    assert_eq!(
        verify_offline(&good, std::slice::from_ref(&key)).0,
        0,
        "the untouched bundle verifies"
    );
    assert_eq!(verify(&app, "TM", "1").await["ok"], true);
    let id_of = |seq: i64| format!("TM-1-{seq:04}");

    let cases: [(&str, &str, &str, i64); 3] = [
        (
            "a changed byte",
            "UPDATE register_entries SET body = replace(body, 'TM-1-0003', 'TM-1-0008') \
              WHERE project = 'TM' AND seq = 3",
            "UPDATE register_entries SET body = replace(body, 'TM-1-0008', 'TM-1-0003') \
              WHERE project = 'TM' AND seq = 3",
            3,
        ),
        (
            "a deleted entry",
            "CREATE TABLE kept AS SELECT * FROM register_entries WHERE project = 'TM' AND seq = 4; \
             DELETE FROM register_entries WHERE project = 'TM' AND seq = 4",
            "INSERT INTO register_entries SELECT * FROM kept; DROP TABLE kept",
            4,
        ),
        (
            "two swapped",
            "UPDATE register_entries e SET body = o.body, hash = o.hash, prev_hash = o.prev_hash, id = o.id \
               FROM register_entries o \
              WHERE e.project = 'TM' AND o.project = 'TM' AND ((e.seq, o.seq) IN ((2, 5), (5, 2)))",
            "UPDATE register_entries e SET body = o.body, hash = o.hash, prev_hash = o.prev_hash, id = o.id \
               FROM register_entries o \
              WHERE e.project = 'TM' AND o.project = 'TM' AND ((e.seq, o.seq) IN ((2, 5), (5, 2)))",
            2,
        ),
    ];
    for (what, break_it, mend_it, first_bad) in cases {
        tamper(&app, break_it).await;
        let online = verify(&app, "TM", "1").await;
        assert_eq!(online["ok"], false, "{what}: {online}");
        assert_eq!(online["first_bad_seq"], first_bad, "{what}: {online}");
        assert_eq!(online["entries"], first_bad - 1, "{what}: {online}");
        let (code, printed) = verify_offline(&export(&app, "TM").await, std::slice::from_ref(&key));
        assert_eq!(code, 1, "{what}: {printed}");
        assert!(
            printed.contains(&format!("entry {first_bad}")) || printed.contains("index"),
            "{what}: {printed}"
        );
        if what != "a deleted entry" {
            assert!(
                printed.contains(&id_of(first_bad)) || what == "two swapped",
                "{what}: {printed}"
            );
        }
        // The bundle written before the tampering still verifies: the
        // evidence an auditor holds does not change with the database.
        assert_eq!(verify_offline(&good, std::slice::from_ref(&key)).0, 0);
        tamper(&app, mend_it).await;
        assert_eq!(verify(&app, "TM", "1").await["ok"], true, "{what} mended");
    }

    // An entry changed and every later link rehashed to match: the chain
    // reads whole, the signed tree does not.
    rehash_from(&app, "TM", 2, "TM-1-0002", "TM-1-0077").await;
    let online = verify(&app, "TM", "1").await;
    assert_eq!(online["ok"], false, "{online}");
    assert!(
        online["why"]
            .as_str()
            .unwrap_or_default()
            .contains("signed"),
        "{online}"
    );
    let (code, printed) = verify_offline(&export(&app, "TM").await, std::slice::from_ref(&key));
    assert_eq!(code, 1, "{printed}");
    assert!(printed.contains("root"), "{printed}");

    // A bundle changed after export: a byte, a line removed, two lines
    // swapped, all named.
    let text = String::from_utf8(good.clone()).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    let rejoin = |lines: &[&str]| format!("{}\n", lines.join("\n")).into_bytes();
    let mut changed = lines.clone();
    let edited = lines[3].replace("TM-1-0003", "TM-1-0009");
    changed[3] = &edited;
    let mut removed = lines.clone();
    removed.remove(6);
    let mut swapped = lines.clone();
    swapped.swap(2, 3);
    for (what, bundle) in [
        ("changed", changed),
        ("removed", removed),
        ("swapped", swapped),
    ] {
        let (code, printed) = verify_offline(&rejoin(&bundle), std::slice::from_ref(&key));
        assert_eq!(code, 1, "{what}: {printed}");
        assert!(printed.starts_with("bad: "), "{what}: {printed}");
    }
    // Rebuilt without its checkpoints: nothing signs it. With fewer, a
    // checkpoint the auditor kept still tells.
    let header: Value = serde_json::from_str(lines[0]).unwrap();
    let mut stripped_header = header.clone();
    stripped_header["checkpoints"] = json!([]);
    let stripped_line = stripped_header.to_string();
    let mut stripped = lines.clone();
    stripped[0] = &stripped_line;
    let (code, printed) = verify_offline(&rejoin(&stripped), std::slice::from_ref(&key));
    assert_eq!(code, 1, "{printed}");
    assert!(printed.contains("no signed checkpoint"), "{printed}");
    // Every entry gone with them: an unsigned empty register proves nothing.
    let (code, printed) = verify_offline(&rejoin(&stripped[..1]), std::slice::from_ref(&key));
    assert_eq!(code, 1, "{printed}");
    assert!(printed.contains("no signed checkpoint"), "{printed}");
    let kept_note = header["checkpoints"][0]["note"]
        .as_str()
        .unwrap()
        .to_owned();
    // The database's rehashed chain (above), exported and its
    // checkpoints dropped: whole as a chain, refuted by the kept one.
    let rehashed = String::from_utf8(export(&app, "TM").await).unwrap();
    let mut forged: Vec<&str> = rehashed.lines().collect();
    forged[0] = &stripped_line;
    let (code, printed) = verify_offline_with(
        &rejoin(&forged),
        std::slice::from_ref(&key),
        std::slice::from_ref(&kept_note),
    );
    assert_eq!(code, 1, "{printed}");
    assert!(printed.contains("root"), "{printed}");
    let (code, _) = verify_offline_with(
        &rejoin(&lines),
        std::slice::from_ref(&key),
        std::slice::from_ref(&kept_note),
    );
    assert_eq!(code, 0, "the untouched bundle reaches the kept checkpoint");
    // A trailing blank line changes nothing; a key that is no key is a
    // usage error (2), not evidence (1).
    let mut padded = good.clone();
    padded.extend_from_slice(b"\n");
    assert_eq!(verify_offline(&padded, std::slice::from_ref(&key)).0, 0);
    assert_eq!(verify_offline(&good, &["not-a-key".to_owned()]).0, 2);

    // Signed by another key than the one trusted: refused.
    let stranger = idpool::domain::signed_note::NoteSigner::from_seed("idpool", [3; 32])
        .unwrap()
        .verifier()
        .text();
    let (code, printed) = verify_offline(&good, &[stranger]);
    assert_eq!(code, 1, "{printed}");
}

async fn define_verifactu(app: &TestApp, doc_type: &str) {
    app.define(
        "VF",
        doc_type,
        json!({
            "numbering": "gapless", "register": "verifactu", "issuer": "89890001K",
            "timezone": "Europe/Madrid", "format": "{seq:8}/G{type}"
        }),
    )
    .await;
}

fn invoice(total: &str) -> Value {
    json!({"date": "01-01-2024", "type": "F1", "tax_total": "12.35", "total": total})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verifactu_records_chain_per_issuer_with_aeat_huellas_and_annulments() {
    let env = TestEnv::new();
    let app = env.spawn().await;
    define_verifactu(&app, "33").await;
    define_verifactu(&app, "34").await;

    // Without the invoice, or a malformed one: 400, nothing written.
    let no_invoice = app
        .post_document(
            &json!({"project": "VF", "type": "33", "metadata": {}}),
            None,
        )
        .await;
    assert_problem(no_invoice, StatusCode::BAD_REQUEST, "invoice_required").await;
    for bad in [
        json!({"date": "2024-01-01", "type": "F1", "tax_total": "1", "total": "1"}),
        json!({"date": "01-01-2024", "type": "Z9", "tax_total": "1", "total": "1"}),
        json!({"date": "01-01-2024", "type": "F1", "tax_total": "1,5", "total": "1"}),
        json!({"date": "01-01-2024", "type": "F1", "tax_total": 1, "total": "1"}),
    ] {
        let response = app
            .post_document(
                &json!({"project": "VF", "type": "33", "metadata": {}, "invoice": bad}),
                None,
            )
            .await;
        assert_eq!(response.status(), StatusCode::BAD_REQUEST, "{bad}");
    }
    let refused: i64 =
        sqlx::query_scalar("SELECT count(*) FROM id_outbox WHERE tenant_code = 'VF'")
            .fetch_one(&app.db)
            .await
            .unwrap();
    assert_eq!(refused, 0);

    // Two invoices of one issuer in two series: one chain, AEAT's hashing.
    let first = accept(
        &app,
        json!({"project": "VF", "type": "33", "metadata": {}, "invoice": invoice("123.45")}),
    )
    .await;
    let second = accept(
        &app,
        json!({"project": "VF", "type": "34", "metadata": {}, "invoice": invoice("123.45")}),
    )
    .await;
    let stored: Vec<(String, String, chrono::DateTime<chrono::Utc>)> = sqlx::query_as(
        "SELECT body, hash, at FROM register_entries WHERE project = 'VF' ORDER BY log_index",
    )
    .fetch_all(&app.db)
    .await
    .unwrap();
    let generated = |at: chrono::DateTime<chrono::Utc>| {
        at.with_timezone(&chrono_tz::Europe::Madrid)
            .format("%Y-%m-%dT%H:%M:%S%:z")
            .to_string()
    };
    let first_alta = Alta {
        issuer: "89890001K",
        number: first["id"].as_str().unwrap(),
        issued_on: "01-01-2024",
        invoice_type: "F1",
        tax_total: "12.35",
        total: "123.45",
        previous: "",
        generated_at: &generated(stored[0].2),
    };
    assert_eq!(stored[0].0, first_alta.chained_text());
    assert_eq!(first["verifactu"]["huella"], first_alta.huella().as_str());
    let second_alta = Alta {
        number: second["id"].as_str().unwrap(),
        previous: &first_alta.huella(),
        generated_at: &generated(stored[1].2),
        ..first_alta.clone()
    };
    assert_eq!(second["verifactu"]["huella"], second_alta.huella().as_str());
    assert_eq!(
        first["verifactu"]["qr_url"],
        format!(
            "https://www2.agenciatributaria.gob.es/wlpl/TIKE-CONT/ValidarQR?nif=89890001K\
             &numserie={}&fecha=01%2D01%2D2024&importe=123%2E45",
            first["id"].as_str().unwrap().replace('/', "%2F")
        )
    );

    // Numbers come only with documents; a void of an invoice appends its
    // anulación, once, and the alta stays.
    let reserve = app.post_ids("VF", "33", 1).await;
    assert_problem(reserve, StatusCode::CONFLICT, "reservations_not_allowed").await;
    let void_body =
        json!({"project": "VF", "type": "34", "id": second["id"], "reason": "wrong customer"});
    let voided: Value = app
        .client
        .post(app.url("/api/v1/ids/void"))
        .json(&void_body)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(voided["reason"], "wrong customer", "{voided}");
    let again: Value = app
        .client
        .post(app.url("/api/v1/ids/void"))
        .json(&void_body)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(again["voided_at"], voided["voided_at"]);
    let log = entries(&app, "VF", "33").await;
    let events: Vec<&str> = log.iter().map(|e| e["event"].as_str().unwrap()).collect();
    assert_eq!(events, ["attached", "attached", "annulled"]);
    let (body, _, at) = &sqlx::query_as::<_, (String, String, chrono::DateTime<chrono::Utc>)>(
        "SELECT body, hash, at FROM register_entries WHERE project = 'VF' AND event = 'annulled'",
    )
    .fetch_one(&app.db)
    .await
    .unwrap();
    let annulment = Anulacion {
        issuer: "89890001K",
        number: second["id"].as_str().unwrap(),
        issued_on: "01-01-2024",
        previous: &second_alta.huella(),
        generated_at: &generated(*at),
    };
    assert_eq!(*body, annulment.chained_text());
    assert_eq!(log[2]["hash"], annulment.huella().as_str());
    let document = app
        .ok_json(&format!(
            "/api/v1/documents/{}",
            second["id"].as_str().unwrap().replace('/', "%2F")
        ))
        .await;
    assert_eq!(document["id"], second["id"], "the document stays");
    assert_eq!(verify(&app, "VF", "34").await["ok"], true);

    // An invoice where no VERI*FACTU register wants one is refused.
    app.define("VF", "P", json!({"numbering": "gapless"})).await;
    let stray = app
        .post_document(
            &json!({"project": "VF", "type": "P", "metadata": {}, "invoice": invoice("1")}),
            None,
        )
        .await;
    assert_problem(stray, StatusCode::BAD_REQUEST, "invoice_not_expected").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_register_is_defined_once_and_read_only_by_its_projects_keys() {
    let env = TestEnv::new();
    let app = env.spawn().await;
    for (body, says) in [
        (json!({"register": "chain"}), "numbering"),
        (
            json!({"numbering": "gapless", "register": "verifactu"}),
            "issuer",
        ),
        (
            json!({"numbering": "gapless", "register": "verifactu", "issuer": "bad nif"}),
            "issuer",
        ),
        (
            json!({"numbering": "gapless", "register": "chain", "issuer": "89890001K"}),
            "issuer",
        ),
    ] {
        let response = app.put_sequence("RD", "1", body.clone()).await;
        let problem = assert_problem(response, StatusCode::BAD_REQUEST, "invalid_definition").await;
        assert!(
            problem["detail"].as_str().unwrap().contains(says),
            "{problem}"
        );
    }
    define_chain(&app, "RD", "1").await;
    accept(&app, json!({"project": "RD", "type": "1", "metadata": {}})).await;
    let unchained = app
        .put_sequence(
            "RD",
            "1",
            json!({"numbering": "gapless", "format": "{project}-{type}-{seq:4}", "force": true}),
        )
        .await;
    assert_problem(unchained, StatusCode::CONFLICT, "sequence_in_use").await;
    let definition = app.ok_json("/api/v1/sequences/RD/1").await;
    assert_eq!(definition["register"], "chain");

    // Another project's key sees no register, no checkpoint, no proof.
    let other_key = create_key(&app.state, &["OTHER"], false).await;
    let other = crate::support::app::client_with_key(Some(&other_key));
    for path in [
        "/api/v1/registers/RD/1/entries",
        "/api/v1/registers/RD/1/verify",
        "/api/v1/registers/RD/checkpoint",
        "/api/v1/registers/RD/proofs/inclusion?index=0&tree_size=1",
    ] {
        let response = other.get(app.url(path)).send().await.unwrap();
        assert_eq!(response.status(), StatusCode::NOT_FOUND, "{path}");
    }
    let pooled = app.ok_json("/api/v1/sequences/RD/1").await;
    assert_eq!(pooled["numbering"], "gapless");
    app.define("RD", "2", json!({})).await;
    let not_a_register = app
        .client
        .get(app.url("/api/v1/registers/RD/2/entries"))
        .send()
        .await
        .unwrap();
    assert_problem(not_a_register, StatusCode::NOT_FOUND, "register_not_found").await;
}

/// Many VERI*FACTU documents at once on a small request pool: an answer
/// other than 202 wrote nothing, and every 202 was written (the hostile
/// review once saw 503s for invoices that were committed, when reading
/// their huella for the answer found the pool busy).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_invoice_answered_with_an_error_was_not_written() {
    let mut env = TestEnv::new();
    env.db_acquire_timeout_ms = 100;
    let app = std::sync::Arc::new(env.spawn().await);
    define_verifactu(&app, "33").await;
    let mut clients = Vec::new();
    for client in 0..32 {
        let app = app.clone();
        clients.push(tokio::spawn(async move {
            let mut answers = Vec::new();
            for n in 0..10 {
                let marker = format!("{client}-{n}");
                let body = json!({"project": "VF", "type": "33", "metadata": {"marker": marker},
                                  "invoice": invoice("10.00")});
                let response = app.post_document(&body, None).await;
                answers.push((marker, response.status()));
            }
            answers
        }));
    }
    let mut answers = Vec::new();
    for client in clients {
        answers.extend(client.await.expect("client"));
    }
    let written: std::collections::HashSet<String> =
        sqlx::query_scalar("SELECT payload->>'marker' FROM id_outbox WHERE tenant_code = 'VF'")
            .fetch_all(&app.db)
            .await
            .unwrap()
            .into_iter()
            .collect();
    for (marker, status) in &answers {
        assert_eq!(
            written.contains(marker),
            *status == StatusCode::ACCEPTED,
            "document {marker} answered {status}"
        );
    }
    let accepted = answers
        .iter()
        .filter(|(_, s)| *s == StatusCode::ACCEPTED)
        .count();
    eprintln!("{accepted} of {} accepted", answers.len());
    assert_eq!(verify(&app, "VF", "33").await["ok"], true);
}
