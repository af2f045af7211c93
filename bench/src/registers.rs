//! Registers: what chaining costs gapless documents, and how long an
//! auditor's export and offline verification of a million entries take.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use hyper::Method;
use serde_json::json;

use crate::load::{self, Call, Until};
use crate::services::Idpool;
use crate::{Bench, Sizes, documents_until_committed, metadata};

/// Chained ÷ unchained gapless documents, one sequence each, 64
/// connections, one after the other in this run; then the export and the
/// offline check of a register of a million entries.
pub async fn chained(
    bench: &mut Bench,
    idpool: &Idpool,
    binary: &Path,
    database: &str,
    sizes: &Sizes,
) -> anyhow::Result<()> {
    let definitions = [
        ("GAPU", json!({"numbering": "gapless"})),
        ("GAPR", json!({"numbering": "gapless", "register": "chain"})),
    ];
    for (project, definition) in &definitions {
        let path = format!("/api/v1/sequences/{project}/1");
        let body = Bytes::from(definition.to_string());
        let (status, answer) = load::send(bench.addr, Method::PUT, &path, body).await?;
        if status >= 300 {
            anyhow::bail!("defining {project}/1: {status} {answer:?}");
        }
    }
    let total = sizes.documents_total / 4;
    let mut rates = Vec::new();
    for (project, _) in definitions {
        let run = documents_until_committed(
            bench,
            idpool,
            project,
            total,
            Until::Count(total),
            Duration::from_secs(600),
            move |i| Call {
                method: Method::POST,
                path: "/documents",
                body: Bytes::from(
                    json!({"project": project, "type": "1", "metadata": metadata(i)}).to_string(),
                ),
                sequence: Some(Arc::from(format!("{project}/1"))),
            },
        )
        .await?;
        rates.push(run.load.per_second());
    }
    let (unchained, chained) = (rates[0], rates[1]);
    bench.context(
        "gapless POST /documents, no register, 64 connections",
        unchained,
        "req/s",
    );
    bench.context(
        "gapless POST /documents, chain register, 64 connections",
        chained,
        "req/s",
    );
    let ratio = chained / unchained;
    bench.row(
        "chained ÷ unchained gapless POST /documents",
        ratio,
        "ratio",
        ">= 0.8",
        Some(ratio >= 0.8),
    );
    export_and_verify(bench, binary, database, sizes).await
}

/// A register of a million entries (a tenth with --quick), written by the
/// same triggers as documents' (rows inserted straight into the outbox,
/// as delivered), then exported and verified by the command line as an
/// auditor runs it.
async fn export_and_verify(
    bench: &mut Bench,
    binary: &Path,
    database: &str,
    sizes: &Sizes,
) -> anyhow::Result<()> {
    let entries: i64 = if sizes.scale < 1.0 {
        100_000
    } else {
        1_000_000
    };
    let label = if entries == 1_000_000 {
        "1,000,000"
    } else {
        "100,000"
    };
    let body = Bytes::from(json!({"numbering": "gapless", "register": "chain"}).to_string());
    let (status, answer) =
        load::send(bench.addr, Method::PUT, "/api/v1/sequences/GAPM/1", body).await?;
    if status >= 300 {
        anyhow::bail!("defining GAPM/1: {status} {answer:?}");
    }
    let sequence_id: i64 =
        sqlx::query_scalar("SELECT id FROM sequences WHERE project = 'GAPM' AND doc_type = '1'")
            .fetch_one(&bench.db)
            .await?;
    let started = Instant::now();
    let chunk = 50_000;
    for from in (1..=entries).step_by(chunk as usize) {
        sqlx::query(
            "INSERT INTO id_outbox (document_id, tenant_code, entity_type_id, payload, sequence_id, \
                                    period, seq, seq_number, status, processed_at) \
             SELECT 'GAPM-1-' || g, 'GAPM', '1', '{}', $1, '', g, g, 'committed', now() \
               FROM generate_series($2::bigint, $3::bigint) g",
        )
        .bind(sequence_id)
        .bind(from)
        .bind((from + chunk - 1).min(entries))
        .execute(&bench.db)
        .await?;
    }
    bench.context(
        &format!("{label} register entries appended (outbox insert + chain + tree)"),
        entries as f64 / started.elapsed().as_secs_f64(),
        "entries/s",
    );
    // The checkpoint that covers them all, within two intervals.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let signed: Option<i64> =
            sqlx::query_scalar("SELECT max(size) FROM register_checkpoints WHERE project = 'GAPM'")
                .fetch_one(&bench.db)
                .await?;
        if signed == Some(entries) {
            break;
        }
        if Instant::now() > deadline {
            anyhow::bail!("no checkpoint of GAPM's {entries} entries within 60 s");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let dir = tempfile::tempdir()?;
    let file = dir.path().join("GAPM.jsonl");
    let started = Instant::now();
    let export = std::process::Command::new(binary)
        .args(["register", "export", "--project", "GAPM", "--out"])
        .arg(&file)
        .env("DATABASE_URL", database)
        .output()?;
    let exported = started.elapsed().as_secs_f64();
    if !export.status.success() {
        anyhow::bail!(
            "idpool register export: {}",
            String::from_utf8_lossy(&export.stderr)
        );
    }
    let started = Instant::now();
    let verify = std::process::Command::new(binary)
        .args(["register", "verify"])
        .arg(&file)
        .output()?;
    let verified = started.elapsed().as_secs_f64();
    let printed = String::from_utf8_lossy(&verify.stdout);
    if !verify.status.success() || !printed.contains(&format!("ok: {entries} entries")) {
        anyhow::bail!("idpool register verify: {printed}");
    }
    let size_mib = std::fs::metadata(&file)?.len() as f64 / (1024.0 * 1024.0);
    bench.context(&format!("bundle of {label} entries"), size_mib, "MiB");
    let goal = 10.0 * entries as f64 / 1_000_000.0;
    bench.row(
        &format!("idpool register export, {label} entries"),
        exported,
        "s",
        &format!("<= {goal}"),
        Some(exported <= goal),
    );
    bench.row(
        &format!("idpool register verify (no database), {label} entries"),
        verified,
        "s",
        &format!("<= {goal}"),
        Some(verified <= goal),
    );
    Ok(())
}
