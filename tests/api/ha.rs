//! Postgres high availability for real: two instances behind HAProxy in
//! front of three Patroni nodes (etcd), under steady `POST /ids` and
//! `POST /documents`, through two switchovers, a killed postmaster, a lost
//! node (synchronous mode) and a failover to a lagging standby
//! (asynchronous). Prints what each event cost; README's "Postgres high
//! availability" table is this test's output.

use std::collections::{BTreeMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use reqwest::StatusCode;
use serde_json::{Value, json};

use crate::support::app::eventually;
use crate::support::app::{ServeProcess, TestEnv, client_with_key};
use crate::support::patroni::PatroniCluster;

const PROJECT: &str = "HA";
const TYPES: [&str; 4] = ["A", "B", "C", "D"];
/// Gap reasons that write numbers off (a failover must cost none of them
/// in synchronous mode).
const WRITTEN_OFF: [&str; 3] = ["untracked_loss", "lease_lost", "pool_discarded"];

/// One answer of the load.
struct Answer {
    at: Instant,
    document: bool,
    status: StatusCode,
    retry_after: bool,
    /// (type, seq) of the numbers answered, or the document's ID.
    numbers: Vec<(String, i64)>,
    document_id: Option<String>,
    text: String,
}

struct Load {
    running: Arc<std::sync::atomic::AtomicBool>,
    answers: Arc<Mutex<Vec<Answer>>>,
    workers: Vec<tokio::task::JoinHandle<()>>,
}

impl Load {
    /// `ids` loops of `POST /ids` and `documents` loops of
    /// `POST /documents`, spread over `bases`.
    fn start(bases: Vec<String>, ids: usize, documents: usize) -> Self {
        let running = Arc::new(std::sync::atomic::AtomicBool::new(true));
        let answers = Arc::new(Mutex::new(Vec::new()));
        let client = reqwest::Client::builder()
            .timeout(Duration::from_secs(60))
            .pool_max_idle_per_host(64)
            .build()
            .expect("client");
        let workers = (0..ids + documents)
            .map(|w| {
                let (client, bases, running, answers) =
                    (client.clone(), bases.clone(), running.clone(), answers.clone());
                let document = w >= ids;
                tokio::spawn(async move {
                    let mut i = 0usize;
                    while running.load(std::sync::atomic::Ordering::Relaxed) {
                        i += 1;
                        let base = &bases[(w + i) % bases.len()];
                        let doc_type = TYPES[(w + i) % TYPES.len()];
                        let request = if document {
                            client.post(format!("{base}/documents")).json(&json!({
                                "project": PROJECT, "type": doc_type, "metadata": {"worker": w, "n": i}
                            }))
                        } else {
                            client.post(format!("{base}/ids")).json(
                                &json!({"project": PROJECT, "type": doc_type, "count": 1 + i % 3}),
                            )
                        };
                        let answer = match request.send().await {
                            Ok(r) => {
                                let status = r.status();
                                let retry_after = r
                                    .headers()
                                    .get("retry-after")
                                    .is_some_and(|v| v.as_bytes() == b"1");
                                let text = r.text().await.unwrap_or_default();
                                let body: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
                                // A document's number, or the numbers of POST /ids.
                                let numbers = body["seqs"]
                                    .as_array()
                                    .into_iter()
                                    .flatten()
                                    .chain(body.get("seq").filter(|_| document))
                                    .filter_map(Value::as_i64)
                                    .map(|seq| (doc_type.to_owned(), seq))
                                    .collect();
                                Answer {
                                    at: Instant::now(),
                                    document,
                                    status,
                                    retry_after,
                                    numbers,
                                    document_id: body["id"].as_str().map(str::to_owned),
                                    text: if status.is_success() { String::new() } else { text },
                                }
                            }
                            Err(e) => Answer {
                                at: Instant::now(),
                                document,
                                status: StatusCode::from_u16(599).expect("status"),
                                retry_after: false,
                                numbers: Vec::new(),
                                document_id: None,
                                text: e.to_string(),
                            },
                        };
                        answers.lock().expect("answers").push(answer);
                    }
                })
            })
            .collect();
        Self {
            running,
            answers,
            workers,
        }
    }

    fn len(&self) -> usize {
        self.answers.lock().expect("answers").len()
    }

    /// Until `more` further `POST /ids` are served.
    async fn served_more(&self, more: usize, within: Duration) {
        let count = || {
            self.answers
                .lock()
                .expect("answers")
                .iter()
                .filter(|a| !a.document && a.status == StatusCode::OK)
                .count()
        };
        let target = count() + more;
        eventually(within, "POST /ids served again", async || {
            (count() >= target).then_some(())
        })
        .await;
    }

    async fn stop(self) -> Vec<Answer> {
        self.running
            .store(false, std::sync::atomic::Ordering::Relaxed);
        for worker in self.workers {
            worker.await.expect("load worker");
        }
        Arc::try_unwrap(self.answers)
            .ok()
            .expect("workers ended")
            .into_inner()
            .expect("answers")
    }
}

/// What one event cost.
struct Cost {
    event: &'static str,
    outage: Duration,
    unavailable: usize,
    documents_acknowledged: usize,
    documents_lost: usize,
    numbers_lost: BTreeMap<String, i64>,
    /// Numbers answered whose record went with the old primary, by the
    /// reason of the gap that names each ("unexplained" if none does).
    records_lost: BTreeMap<String, i64>,
}

/// Numbers of the project in open gaps, by reason (through the API).
async fn gaps_by_reason(client: &reqwest::Client, base: &str) -> BTreeMap<String, i64> {
    let mut by_reason = BTreeMap::new();
    for doc_type in TYPES {
        let mut cursor: Option<String> = None;
        loop {
            let mut url =
                format!("{base}/api/v1/ids/gaps?project={PROJECT}&type={doc_type}&limit=1000");
            if let Some(c) = &cursor {
                url.push_str(&format!("&cursor={c}"));
            }
            let page: Value = client
                .get(&url)
                .send()
                .await
                .expect("gaps")
                .json()
                .await
                .expect("gaps page");
            for gap in page["gaps"].as_array().into_iter().flatten() {
                *by_reason
                    .entry(gap["reason"].as_str().unwrap_or("?").to_owned())
                    .or_default() += gap["count"].as_i64().unwrap_or(0);
            }
            match page["next_cursor"].as_str() {
                Some(c) => cursor = Some(c.to_owned()),
                None => break,
            }
        }
    }
    by_reason
}

/// One reconciliation run, tried again while it is answered 503 (Postgres
/// not back yet); any other answer, or none, fails the test.
async fn reconcile(client: &reqwest::Client, base: &str) {
    let url = format!("{base}/api/v1/ids/gaps/reconcile");
    eventually(
        Duration::from_secs(30),
        "a reconciliation run",
        async || {
            let answer = client
                .post(&url)
                .send()
                .await
                .unwrap_or_else(|e| panic!("reconciliation got no answer: {e}"));
            match answer.status() {
                StatusCode::OK => Some(()),
                StatusCode::SERVICE_UNAVAILABLE => None,
                status => panic!(
                    "reconciliation answered {status}: {}",
                    answer.text().await.unwrap_or_default()
                ),
            }
        },
    )
    .await
}

/// Documents answered 202 that are not in the outbox.
async fn documents_missing(cluster: &PatroniCluster, ids: &[String]) -> usize {
    let found = eventually(Duration::from_secs(30), "the outbox is read", async || {
        let mut conn = <sqlx::PgConnection as sqlx::Connection>::connect(&cluster.url("idpool_ha"))
            .await
            .ok()?;
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM id_outbox WHERE document_id = ANY($1)")
            .bind(ids)
            .fetch_one(&mut conn)
            .await
            .ok()
    })
    .await;
    ids.len() - found as usize
}

/// Of the numbers answered, those whose record (ledger row, lease handout,
/// document) Postgres no longer has, counted by the reason of the open gap
/// that names each; "unexplained" for those no gap names.
async fn records_lost(url: &str, answered: &[(String, i64)]) -> BTreeMap<String, i64> {
    let mut conn = <sqlx::PgConnection as sqlx::Connection>::connect(url)
        .await
        .expect("the new primary");
    let types: Vec<String> = answered.iter().map(|(t, _)| t.clone()).collect();
    let seqs: Vec<i64> = answered.iter().map(|(_, n)| *n).collect();
    let rows: Vec<(String, i64)> = sqlx::query_as(
        "SELECT coalesce(g.reason, 'unexplained'), count(*) \
         FROM UNNEST($2::text[], $3::bigint[]) AS a(t, n) \
         JOIN sequences s ON s.project = $1 AND s.doc_type = a.t \
         LEFT JOIN LATERAL (SELECT reason FROM id_gaps g WHERE g.sequence_id = s.id AND g.period = '' \
                            AND g.resolved_at IS NULL AND a.n BETWEEN g.from_seq AND g.to_seq LIMIT 1) g ON true \
         WHERE NOT EXISTS (SELECT 1 FROM issuance_ledger l WHERE l.sequence_id = s.id AND l.period = '' AND l.seqs @> a.n) \
           AND NOT EXISTS (SELECT 1 FROM lease_handouts h WHERE h.sequence_id = s.id AND h.period = '' AND h.seqs @> a.n) \
           AND NOT EXISTS (SELECT 1 FROM id_outbox o WHERE o.sequence_id = s.id AND o.period = '' AND o.seq = a.n) \
         GROUP BY 1",
    )
    .bind(PROJECT)
    .bind(&types)
    .bind(&seqs)
    .fetch_all(&mut conn)
    .await
    .expect("records lost");
    rows.into_iter().collect()
}

/// Until no instance has lease returns waiting for Postgres (those it
/// could not write during the event are tried again with backoff): what
/// reconciliation judges then is final.
async fn lease_returns_written(client: &reqwest::Client, bases: &[String]) {
    for base in bases {
        let what = format!("{base}: lease returns written");
        eventually(Duration::from_secs(30), &what, async || {
            let metrics = crate::support::app::metrics_at(client, base).await;
            let retrying = metrics.get("idpool_lease_returns_retrying").copied();
            (retrying.unwrap_or_default() == 0.0).then_some(())
        })
        .await;
    }
}

/// Whether reconciliation has judged every number answered (its
/// checkpoints are past them); what it has not judged yet, if not.
async fn judged(url: &str, answered: &[(String, i64)]) -> Result<(), String> {
    let mut conn = <sqlx::PgConnection as sqlx::Connection>::connect(url)
        .await
        .map_err(|e| e.to_string())?;
    for doc_type in TYPES {
        let highest = answered
            .iter()
            .filter(|(t, _)| t == doc_type)
            .map(|(_, n)| *n)
            .max();
        let Some(highest) = highest else { continue };
        let checkpoint: Option<i64> = sqlx::query_scalar(
            "SELECT r.checkpoint FROM reconcile_periods r JOIN sequences s ON s.id = r.sequence_id \
             WHERE s.project = $1 AND s.doc_type = $2 AND r.period = ''",
        )
        .bind(PROJECT)
        .bind(doc_type)
        .fetch_optional(&mut conn)
        .await
        .map_err(|e| e.to_string())?;
        if checkpoint.is_none_or(|c| c <= highest) {
            return Err(format!(
                "{PROJECT}/{doc_type}: reconciliation's checkpoint {checkpoint:?} is not past {highest}, \
                 the highest number answered"
            ));
        }
    }
    Ok(())
}

/// Reconciles until every number answered is judged, then counts the
/// gaps. Reconciliation judges only below each pool's head (a number still
/// in a pool may be issued any moment): numbers given back to the head (a
/// lease's unused ones, a write that did not land) hold it back until the
/// traffic, which goes on meanwhile, takes them.
async fn reconcile_until_judged(
    client: &reqwest::Client,
    base: &str,
    settle: Duration,
    url: &str,
    answered: &[(String, i64)],
) -> BTreeMap<String, i64> {
    let deadline = Instant::now() + Duration::from_secs(60);
    reconcile(client, base).await;
    let db = sqlx::PgPool::connect(url).await.expect("the cluster");
    loop {
        // Numbers younger than reconciliation's settle time are not judged.
        crate::support::app::wait_on_postgres_clock(&db, settle).await;
        reconcile(client, base).await;
        match judged(url, answered).await {
            Ok(()) => return gaps_by_reason(client, base).await,
            Err(why) => assert!(Instant::now() < deadline, "{why} after 60 s"),
        }
    }
}

/// The longest stretch in `[from, to]` without a served `POST /ids`.
fn longest_outage(answers: &[Answer], from: Instant, to: Instant) -> Duration {
    let mut served: Vec<Instant> = answers
        .iter()
        .filter(|a| !a.document && a.status == StatusCode::OK && a.at >= from && a.at <= to)
        .map(|a| a.at)
        .collect();
    served.sort();
    let mut last = from;
    let mut longest = Duration::ZERO;
    for at in served.into_iter().chain([to]) {
        longest = longest.max(at.duration_since(last));
        last = at;
    }
    longest
}

struct Bench {
    cluster: PatroniCluster,
    load: Load,
    client: reqwest::Client,
    base: String,
    bases: Vec<String>,
    settle: Duration,
    gaps_before: BTreeMap<String, i64>,
    costs: Vec<Cost>,
}

impl Bench {
    /// Runs `event`, waits until both instances serve again, and records
    /// its cost.
    async fn run<F: AsyncFnOnce(&mut PatroniCluster)>(&mut self, name: &'static str, event: F) {
        let answered_before = self.load.len();
        let started = Instant::now();
        event(&mut self.cluster).await;
        self.load.served_more(200, Duration::from_secs(60)).await;
        let ended = Instant::now();
        let (acknowledged, unavailable, answered, outage) = {
            let answers = self.load.answers.lock().expect("answers");
            let window = &answers[answered_before..];
            let acknowledged: Vec<String> = window
                .iter()
                .filter(|a| a.document && a.status == StatusCode::ACCEPTED)
                .filter_map(|a| a.document_id.clone())
                .collect();
            let unavailable = window
                .iter()
                .filter(|a| a.status == StatusCode::SERVICE_UNAVAILABLE)
                .count();
            let answered: Vec<(String, i64)> = window
                .iter()
                .flat_map(|a| a.numbers.iter().cloned())
                .collect();
            let outage = longest_outage(&answers, started, ended);
            (acknowledged, unavailable, answered, outage)
        };
        let url = self.cluster.url("idpool_ha");
        lease_returns_written(&self.client, &self.bases).await;
        let gaps =
            reconcile_until_judged(&self.client, &self.base, self.settle, &url, &answered).await;
        let documents_lost = documents_missing(&self.cluster, &acknowledged).await;
        let records_lost = records_lost(&self.cluster.url("idpool_ha"), &answered).await;
        let numbers_lost = gaps
            .iter()
            .filter(|(reason, _)| WRITTEN_OFF.contains(&reason.as_str()))
            .map(|(reason, n)| {
                (
                    reason.clone(),
                    n - self.gaps_before.get(reason).copied().unwrap_or(0),
                )
            })
            .filter(|(_, n)| *n != 0)
            .collect();
        self.gaps_before = gaps;
        self.costs.push(Cost {
            event: name,
            outage,
            unavailable,
            documents_acknowledged: acknowledged.len(),
            documents_lost,
            numbers_lost,
            records_lost,
        });
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn patroni_failovers_cost_only_what_the_data_lost() {
    // Failovers: a standby's refusals and lost connections are logged, and
    // so is the fence after the asynchronous one (this test counts what
    // each event wrote off).
    crate::support::app::expect_postgres_trouble();
    crate::support::app::expect_error_lines("Postgres was behind Redis");
    let cluster = PatroniCluster::start().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let mut env = TestEnv::new();
    env.database_url = cluster.url("idpool_ha");
    env.auth = false;
    // Reconciliation waits the longer of its settle time and the request
    // timeout before judging a number; 5 s keeps each event's check short.
    env.request_timeout_s = 5;
    let logs = [
        dir.path().join("idpool-1.log"),
        dir.path().join("idpool-2.log"),
    ];
    let first = ServeProcess::start_logging(&env, &logs[0], "warn").await;
    let second = ServeProcess::start_logging(&env, &logs[1], "warn").await;
    let bases: Vec<String> = [&first, &second]
        .iter()
        .map(|p| format!("http://127.0.0.1:{}", p.port))
        .collect();

    // An instance pointed straight at a standby is not ready.
    let replica = cluster.a_replica().await;
    let mut on_standby = env.clone();
    on_standby.database_url = cluster.nodes[replica].url("idpool_ha");
    on_standby
        .extra_env
        .push(("IDPOOL_MIGRATE".to_owned(), "off".to_owned()));
    let standby_log = dir.path().join("idpool-standby.log");
    let standby_instance = ServeProcess::start_unready(&on_standby, &standby_log, "warn").await;
    let client = client_with_key(None);
    let readyz = client
        .get(format!("http://127.0.0.1:{}/readyz", standby_instance.port))
        .send()
        .await
        .expect("readyz");
    assert_eq!(readyz.status(), StatusCode::SERVICE_UNAVAILABLE);
    let body: Value = readyz.json().await.expect("readyz body");
    assert_eq!(body["postgres"], "read_only", "{body}");
    drop(standby_instance);

    let load = Load::start(bases.clone(), 4, 2);
    load.served_more(500, Duration::from_secs(30)).await;
    let mut bench = Bench {
        cluster,
        load,
        client: client.clone(),
        base: bases[0].clone(),
        bases: bases.clone(),
        settle: env.settle.max(Duration::from_secs(env.request_timeout_s)),
        gaps_before: BTreeMap::new(),
        costs: Vec::new(),
    };
    let answered: Vec<(String, i64)> = bench
        .load
        .answers
        .lock()
        .expect("answers")
        .iter()
        .flat_map(|a| a.numbers.iter().cloned())
        .collect();
    let url = bench.cluster.url("idpool_ha");
    bench.gaps_before =
        reconcile_until_judged(&bench.client, &bench.base, bench.settle, &url, &answered).await;

    bench
        .run("switchover", async |c| c.switchover().await)
        .await;
    bench.cluster.wait_healthy().await;
    bench
        .run("switchover", async |c| c.switchover().await)
        .await;
    bench.cluster.wait_healthy().await;
    bench
        .run("postmaster kill -9", async |c| {
            let leader = c.leader().await;
            c.nodes[leader].kill_postmaster();
        })
        .await;
    bench.cluster.wait_healthy().await;
    bench
        .run("node lost", async |c| {
            let leader = c.leader().await;
            c.nodes[leader].lose();
            c.wait_new_leader(leader).await;
            c.nodes[leader].start();
        })
        .await;
    bench.cluster.wait_healthy().await;
    let synchronous_events = bench.costs.len();
    bench.cluster.go_asynchronous().await;
    bench.cluster.wait_healthy().await;
    bench
        .run("async failover, lagging standbys", async |c| {
            let leader = c.leader().await;
            // The primary goes on acknowledging what no standby receives:
            // 200 documents' worth, counted on the primary itself.
            let primary = sqlx::PgPool::connect(&c.nodes[leader].url("idpool_ha"))
                .await
                .expect("the primary");
            let documents = async || {
                sqlx::query_scalar::<_, i64>("SELECT count(*) FROM id_outbox")
                    .fetch_one(&primary)
                    .await
                    .ok()
            };
            let before = documents().await.expect("the outbox");
            assert_eq!(c.nodes[leader].stop_wal_senders(), 2, "WAL senders to stop");
            eventually(
                Duration::from_secs(30),
                "commits no standby receives",
                async || (documents().await? >= before + 200).then_some(()),
            )
            .await;
            primary.close().await;
            c.nodes[leader].lose();
            c.wait_new_leader(leader).await;
        })
        .await;

    let cluster_url = bench.cluster.url("idpool_ha");
    let Bench {
        load,
        costs,
        cluster,
        ..
    } = bench;
    let answers = load.stop().await;

    println!(
        "event | longest without a served POST /ids | 503 answers | documents acknowledged / lost \
         | numbers written off | numbers answered whose record was lost, by gap reason"
    );
    for cost in &costs {
        println!(
            "{} | {:.1} s | {} | {} / {} | {:?} | {:?}",
            cost.event,
            cost.outage.as_secs_f64(),
            cost.unavailable,
            cost.documents_acknowledged,
            cost.documents_lost,
            cost.numbers_lost,
            cost.records_lost
        );
    }
    // Reconciliation names every number whose record was lost.
    for cost in &costs {
        assert!(
            !cost.records_lost.contains_key("unexplained"),
            "{}: numbers whose record was lost, in no gap: {:?}\n{}",
            cost.event,
            cost.records_lost,
            state_detail(&cluster_url, &answers).await
        );
    }

    // What the lagging standby never received is named untracked_loss.
    for cost in &costs[synchronous_events..] {
        assert!(
            cost.records_lost.keys().all(|r| r == "untracked_loss"),
            "{}: lost records named other than untracked_loss: {:?}",
            cost.event,
            cost.records_lost
        );
    }

    // No number twice, over every event (asynchronous too).
    let mut seen = HashSet::new();
    let duplicates: Vec<&(String, i64)> = answers
        .iter()
        .flat_map(|a| a.numbers.iter())
        .filter(|n| !seen.insert((*n).clone()))
        .collect();
    assert!(
        duplicates.is_empty(),
        "numbers answered twice: {duplicates:?}"
    );
    // Only successes, or 503 with Retry-After.
    let unexpected: Vec<String> = answers
        .iter()
        .filter(|a| !a.status.is_success())
        .filter(|a| !(a.status == StatusCode::SERVICE_UNAVAILABLE && a.retry_after))
        .map(|a| format!("{} {}", a.status, a.text))
        .take(10)
        .collect();
    assert!(
        unexpected.is_empty(),
        "answers other than 2xx or 503 with Retry-After: {unexpected:?}"
    );
    let warnings: String = logs
        .iter()
        .flat_map(|log| {
            std::fs::read_to_string(log)
                .unwrap_or_default()
                .lines()
                .filter(|l| l.contains("discard") || l.contains("doubt"))
                .take(20)
                .map(str::to_owned)
                .collect::<Vec<_>>()
        })
        .collect::<Vec<_>>()
        .join("\n");
    for cost in &costs[..synchronous_events] {
        assert_eq!(
            cost.documents_lost, 0,
            "{}: acknowledged documents lost",
            cost.event
        );
        assert!(
            cost.records_lost.is_empty(),
            "{}: records lost: {:?}",
            cost.event,
            cost.records_lost
        );
        assert!(
            cost.numbers_lost.is_empty(),
            "{}: numbers written off: {:?}\n{}\n{warnings}",
            cost.event,
            cost.numbers_lost,
            written_off_detail(&cluster_url).await
        );
        let bound = match cost.event {
            "node lost" => Duration::from_secs(20),
            _ => Duration::from_secs(15),
        };
        assert!(
            cost.outage <= bound,
            "{}: {:?} without a served POST /ids",
            cost.event,
            cost.outage
        );
    }
    // Quiet logs: at most 20 warning or error lines in any second.
    for log in &logs {
        let text = std::fs::read_to_string(log).expect("log");
        let (second, busiest, said) =
            crate::support::app::busiest_warning_second(&text).unwrap_or_default();
        println!("{} busiest second {second}: {said:?}", log.display());
        println!(
            "{}: at most {busiest} warning or error lines in one second",
            log.display()
        );
        assert!(
            busiest <= 20,
            "{busiest} warning or error lines in one second:\n{text}"
        );
    }
    drop((first, second, cluster));
}

/// The open gaps that wrote numbers off, with the blocks they came from
/// (for a failure message).
async fn written_off_detail(url: &str) -> String {
    let Ok(mut conn) = <sqlx::PgConnection as sqlx::Connection>::connect(url).await else {
        return "(the database could not be read)".to_owned();
    };
    let rows: Vec<(String,)> = sqlx::query_as(
        "SELECT format('%s..%s %s: %s block %s of %s, reserved %s, pushed %s', g.from_seq, g.to_seq, g.reason, \
                       b.purpose, b.seqs, b.instance_id, b.reserved_at, b.pushed_at) \
         FROM id_gaps g JOIN blocks b ON b.sequence_id = g.sequence_id AND b.period = g.period \
              AND b.seqs && int8range(g.from_seq, g.to_seq + 1) \
         WHERE g.resolved_at IS NULL AND g.reason = ANY($1) ORDER BY g.from_seq",
    )
    .bind(WRITTEN_OFF.map(str::to_owned).to_vec())
    .fetch_all(&mut conn)
    .await
    .unwrap_or_default();
    let discards: Vec<(String, String)> = sqlx::query_as(
        "SELECT d.cause, d.seqs::text FROM pool_discards d JOIN id_gaps g ON g.sequence_id = d.sequence_id \
         AND g.reason = 'pool_discarded' AND g.resolved_at IS NULL AND d.seqs && int8range(g.from_seq, g.to_seq + 1) \
         WHERE d.cause <> 'postgres_behind_redis' ORDER BY d.id DESC LIMIT 20",
    )
    .fetch_all(&mut conn)
    .await
    .unwrap_or_default();
    rows.into_iter()
        .map(|(r,)| r)
        .chain(discards.iter().map(|d| format!("discarded: {d:?}")))
        .collect::<Vec<_>>()
        .join("\n")
}

/// Per type: the counter, the reconciliation checkpoint, the fence blocks,
/// and the answered numbers without a record (for a failure message).
async fn state_detail(url: &str, answers: &[Answer]) -> String {
    let Ok(mut conn) = <sqlx::PgConnection as sqlx::Connection>::connect(url).await else {
        return "(the database could not be read)".to_owned();
    };
    let mut text = String::new();
    for doc_type in TYPES {
        let seqs: Vec<i64> = answers
            .iter()
            .flat_map(|a| a.numbers.iter())
            .filter(|(t, _)| t == doc_type)
            .map(|(_, n)| *n)
            .collect();
        let row: Option<(String,)> = sqlx::query_as(
            "WITH lost AS (SELECT n FROM sequences s, UNNEST($3::bigint[]) n \
                           WHERE s.project = $1 AND s.doc_type = $2 \
                             AND NOT EXISTS (SELECT 1 FROM issuance_ledger l WHERE l.sequence_id = s.id AND l.seqs @> n) \
                             AND NOT EXISTS (SELECT 1 FROM lease_handouts h WHERE h.sequence_id = s.id AND h.seqs @> n) \
                             AND NOT EXISTS (SELECT 1 FROM id_outbox o WHERE o.sequence_id = s.id AND o.seq = n)) \
             SELECT format('counter %s, checkpoint %s, fences %s, records lost from %s to %s, open gaps %s', \
                    c.next_seq, r.checkpoint, \
                    (SELECT string_agg(b.seqs::text || ' ' || b.instance_id, ', ') FROM blocks b \
                     WHERE b.sequence_id = s.id AND b.instance_id LIKE 'fence:%'), \
                    (SELECT min(n) FROM lost), (SELECT max(n) FROM lost), \
                    (SELECT count(*) FROM id_gaps g WHERE g.sequence_id = s.id AND g.resolved_at IS NULL)) \
             FROM sequences s JOIN counters c ON c.sequence_id = s.id AND c.period = '' \
             LEFT JOIN reconcile_periods r ON r.sequence_id = s.id AND r.period = '' \
             WHERE s.project = $1 AND s.doc_type = $2",
        )
        .bind(PROJECT)
        .bind(doc_type)
        .bind(&seqs)
        .fetch_optional(&mut conn)
        .await
        .unwrap_or_else(|e| Some((e.to_string(),)));
        let row = row.map(|(r,)| r).unwrap_or_default();
        text.push_str(&format!("{doc_type}: {row}\n"));
    }
    text
}

#[test]
fn the_tested_patroni_and_haproxy_settings_are_those_of_deploy() {
    let deploy = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/patroni");
    let operator = std::fs::read_to_string(deploy.join("patroni.yml")).expect("patroni.yml");
    let operator_haproxy =
        std::fs::read_to_string(deploy.join("haproxy.cfg")).expect("haproxy.cfg");
    let dir = tempfile::tempdir().unwrap();
    let node = crate::support::patroni::PatroniNode {
        name: "pg1".into(),
        api_port: 8008,
        pg_port: 5432,
        config: dir.path().join("pg1.yml"),
        data: dir.path().join("pg1"),
        log: dir.path().join("pg1.log"),
        patroni: None,
    };
    let tested = crate::support::patroni::patroni_config_text(&node, 2379, dir.path());
    // What decides what a failover costs is the same in both; `loop_wait`
    // (1 s in the test, to be quick) and `max_connections` (sized for
    // many instances) are the operator's to tune.
    for key in [
        "ttl",
        "retry_timeout",
        "maximum_lag_on_failover",
        "synchronous_mode",
        "synchronous_mode_strict",
        "use_pg_rewind",
        "wal_log_hints",
        "max_wal_senders",
        "max_replication_slots",
    ] {
        let (theirs, ours) = (
            crate::support::patroni::setting(&operator, key),
            crate::support::patroni::setting(&tested, key),
        );
        assert!(theirs.is_some(), "deploy/patroni/patroni.yml sets no {key}");
        assert_eq!(theirs, ours, "{key}: deploy/ and the HA test differ");
    }
    assert_eq!(
        crate::support::patroni::setting(&operator, "synchronous_mode"),
        Some("true")
    );
    let tested_haproxy =
        crate::support::patroni::haproxy_config_text(5000, std::slice::from_ref(&node));
    for key in [
        "mode",
        "timeout connect",
        "timeout client",
        "timeout server",
        "timeout check",
        "option httpchk",
        "http-check expect",
        "default-server",
    ] {
        let (theirs, ours) = (
            crate::support::patroni::setting(&operator_haproxy, key),
            crate::support::patroni::setting(&tested_haproxy, key),
        );
        assert!(theirs.is_some(), "deploy/patroni/haproxy.cfg sets no {key}");
        assert_eq!(theirs, ours, "{key}: deploy/ and the HA test differ");
    }
    assert_eq!(
        crate::support::patroni::setting(&operator_haproxy, "option httpchk"),
        Some("GET /primary")
    );
    let servers = operator_haproxy
        .lines()
        .filter(|l| l.trim_start().starts_with("server ") && l.contains("check port 8008"))
        .count();
    assert_eq!(servers, 3, "three nodes, each checked at Patroni's API");
}
