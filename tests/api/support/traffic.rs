//! Steady traffic against one or more instances, and what a test checks of
//! it afterwards: no number twice, every number explained.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use reqwest::StatusCode;
use serde_json::{Value, json};
use sqlx::PgPool;

#[derive(Debug, Default)]
pub struct Outcome {
    /// (type, seq) of every number answered.
    pub issued: Vec<(String, i64)>,
    /// Answers that were not 200, as "{status} retry-after={header} {body}"
    /// (and errors of requests that got none).
    pub failures: Vec<String>,
}

pub struct Traffic {
    running: Arc<AtomicBool>,
    /// Requests answered so far (any status, or an error).
    answered: Arc<AtomicUsize>,
    workers: Vec<tokio::task::JoinHandle<Outcome>>,
}

impl Traffic {
    /// `workers` loops of `POST /ids` for project `project`, over `types`,
    /// spread over the instances at `bases`.
    pub fn start(
        client: reqwest::Client,
        bases: Vec<String>,
        project: &str,
        types: &[&str],
        workers: usize,
    ) -> Self {
        let running = Arc::new(AtomicBool::new(true));
        let answered = Arc::new(AtomicUsize::new(0));
        let bases = Arc::new(bases);
        let types: Arc<Vec<String>> = Arc::new(types.iter().map(|t| t.to_string()).collect());
        let workers = (0..workers)
            .map(|w| {
                let (client, bases, types, running, answered) = (
                    client.clone(),
                    bases.clone(),
                    types.clone(),
                    running.clone(),
                    answered.clone(),
                );
                let project = project.to_owned();
                tokio::spawn(async move {
                    let mut out = Outcome::default();
                    let mut i = 0usize;
                    while running.load(Ordering::Relaxed) {
                        i += 1;
                        let base = &bases[(w + i) % bases.len()];
                        let doc_type = &types[(w + 2 * i) % types.len()];
                        let response = client
                            .post(format!("{base}/ids"))
                            .json(
                                &json!({"project": project, "type": doc_type, "count": 1 + i % 3}),
                            )
                            .send()
                            .await;
                        match response {
                            Ok(r) if r.status() == StatusCode::OK => {
                                let body: Value = r.json().await.unwrap_or(Value::Null);
                                for seq in body["seqs"].as_array().into_iter().flatten() {
                                    out.issued
                                        .push((doc_type.clone(), seq.as_i64().unwrap_or(-1)));
                                }
                            }
                            Ok(r) => out.failures.push(failure(r).await),
                            Err(e) => out.failures.push(e.to_string()),
                        }
                        answered.fetch_add(1, Ordering::Relaxed);
                    }
                    out
                })
            })
            .collect();
        Self {
            running,
            answered,
            workers,
        }
    }

    /// Waits until the traffic has had `more` answers since now: a phase of
    /// a test measured in requests, not in time.
    pub async fn answers(&self, more: usize) {
        let target = self.answered.load(Ordering::Relaxed) + more;
        let what = format!("{more} more answers");
        crate::support::app::eventually(Duration::from_secs(60), &what, async || {
            (self.answered.load(Ordering::Relaxed) >= target).then_some(())
        })
        .await
    }

    pub async fn stop(self) -> Outcome {
        self.running.store(false, Ordering::Relaxed);
        let mut all = Outcome::default();
        for worker in self.workers {
            let out = worker.await.expect("worker");
            all.issued.extend(out.issued);
            all.failures.extend(out.failures);
        }
        all
    }
}

/// An answer that was not the one hoped for, as a failure of
/// [`Outcome::failures`]: "{status} retry-after={header} {body}".
pub async fn failure(response: reqwest::Response) -> String {
    let status = response.status();
    let retry_after = response
        .headers()
        .get("retry-after")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("-")
        .to_owned();
    let body = response.text().await.unwrap_or_default();
    format!("{status} retry-after={retry_after} {body}")
}

impl Outcome {
    /// No (type, number) answered twice.
    pub fn assert_distinct(&self) {
        let mut seen = HashSet::new();
        for (doc_type, seq) in &self.issued {
            assert!(
                seen.insert((doc_type, *seq)),
                "{doc_type} {seq} was handed out twice"
            );
        }
    }
}

/// After reconciliation: every number of the sequence taken from the
/// counter below its checkpoint carries a live document or sits in exactly
/// one open gap, and numbers `issued` to callers without a document are
/// `issued_unattached`. Numbers in `records_lost` were issued but their
/// record went with a failed Postgres primary: they can only be
/// `untracked_loss` (`lease_lost` when only their lease was kept,
/// `issued_unattached` when only a lease's report of the handout was). The number of numbers judged.
pub async fn assert_every_number_explained(
    db: &PgPool,
    project: &str,
    doc_type: &str,
    issued: &[i64],
    records_lost: &[i64],
) -> i64 {
    let Some((sequence_id, checkpoint)): Option<(i64, i64)> = sqlx::query_as(
        "SELECT r.sequence_id, r.checkpoint FROM reconcile_periods r \
         JOIN sequences s ON s.id = r.sequence_id WHERE s.project = $1 AND s.doc_type = $2 AND r.period = ''",
    )
    .bind(project)
    .bind(doc_type)
    .fetch_optional(db)
    .await
    .expect("checkpoint")
    else {
        panic!("{project}/{doc_type} was never reconciled");
    };
    let blocks: Vec<(i64, i64)> = sqlx::query_as(
        "SELECT lower(seqs), upper(seqs) FROM blocks WHERE sequence_id = $1 AND period = ''",
    )
    .bind(sequence_id)
    .fetch_all(db)
    .await
    .expect("blocks");
    let attached: HashMap<i64, String> = sqlx::query_as::<_, (i64, String)>(
        "SELECT seq, status::text FROM id_outbox WHERE sequence_id = $1",
    )
    .bind(sequence_id)
    .fetch_all(db)
    .await
    .expect("outbox")
    .into_iter()
    .collect();
    let gaps: Vec<(i64, i64, String)> = sqlx::query_as(
        "SELECT from_seq, to_seq, reason FROM id_gaps WHERE sequence_id = $1 AND resolved_at IS NULL",
    )
    .bind(sequence_id)
    .fetch_all(db)
    .await
    .expect("gaps");
    let mut explained: HashMap<i64, Vec<&str>> = HashMap::new();
    for (from, to, reason) in &gaps {
        for n in *from..=*to {
            explained.entry(n).or_default().push(reason);
        }
    }
    let issued: HashSet<i64> = issued.iter().copied().collect();
    let records_lost: HashSet<i64> = records_lost.iter().copied().collect();
    let mut judged = 0;
    let mut unexplained = Vec::new();
    for (start, end) in blocks {
        for n in start..end.min(checkpoint) {
            judged += 1;
            let live = matches!(
                attached.get(&n).map(String::as_str),
                Some("pending" | "committed")
            );
            let reasons = explained.get(&n).cloned().unwrap_or_default();
            let fine = match (live, reasons.as_slice()) {
                // Lost with the primary: the ledger has no record of the
                // number, or only its lease and not the report of its
                // handout, or (a lease's) only the report, sent later.
                _ if records_lost.contains(&n) => {
                    !live
                        && matches!(
                            reasons.as_slice(),
                            ["untracked_loss" | "lease_lost" | "issued_unattached"]
                        )
                }
                (true, []) => true,
                (false, [reason]) => {
                    !issued.contains(&n)
                        || attached.contains_key(&n)
                        || *reason == "issued_unattached"
                }
                _ => false,
            };
            if !fine {
                unexplained.push((n, reasons));
            }
        }
    }
    assert!(
        unexplained.is_empty(),
        "{project}/{doc_type}: {} numbers unexplained, first {:?}",
        unexplained.len(),
        &unexplained[..unexplained.len().min(10)]
    );
    judged
}
