//! Leases: busy sequences served from numbers recorded ahead, reported in
//! the background, given back at a clean stop, `lease_lost` when the
//! instance dies holding them.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use chrono::Utc;
use idpool::domain::clock::ManualClock;
use idpool::records::pool::PoolSettings;
use serde_json::{Value, json};
use sqlx::PgPool;

use crate::support::app::{ServeProcess, TestApp, TestEnv, metrics_at, seqs_of};
use crate::support::app::{eventually, until};
use crate::support::redis_server::RedisServer;

/// Ledger rows of a sequence recorded `via`, in the order they were written.
async fn ledger_rows(db: &PgPool, project: &str, via: &str) -> Vec<(i64, i64)> {
    type_ledger_rows(db, project, None, via).await
}

/// The same, of one type of the project only.
async fn type_ledger_rows(
    db: &PgPool,
    project: &str,
    doc_type: Option<&str>,
    via: &str,
) -> Vec<(i64, i64)> {
    sqlx::query_as(
        "SELECT lower(l.seqs), upper(l.seqs) FROM issuance_ledger l \
         JOIN sequences s ON s.id = l.sequence_id \
         WHERE s.project = $1 AND ($3::text IS NULL OR s.doc_type = $3) AND l.via = $2 \
         ORDER BY l.issued_at, lower(l.seqs)",
    )
    .bind(project)
    .bind(via)
    .bind(doc_type)
    .fetch_all(db)
    .await
    .unwrap()
}

fn numbers_of(rows: &[(i64, i64)]) -> BTreeSet<i64> {
    rows.iter().flat_map(|(a, b)| *a..*b).collect()
}

async fn handed_out(db: &PgPool, project: &str) -> BTreeSet<i64> {
    let rows: Vec<(i64, i64)> = sqlx::query_as(
        "SELECT lower(h.seqs), upper(h.seqs) FROM lease_handouts h \
         JOIN sequences s ON s.id = h.sequence_id WHERE s.project = $1",
    )
    .bind(project)
    .fetch_all(db)
    .await
    .unwrap();
    numbers_of(&rows)
}

async fn discarded(db: &PgPool, project: &str, cause: &str) -> BTreeSet<i64> {
    let rows: Vec<(i64, i64)> = sqlx::query_as(
        "SELECT lower(d.seqs), upper(d.seqs) FROM pool_discards d \
         JOIN sequences s ON s.id = d.sequence_id WHERE s.project = $1 AND d.cause = $2",
    )
    .bind(project)
    .bind(cause)
    .fetch_all(db)
    .await
    .unwrap();
    numbers_of(&rows)
}

async fn metric(client: &reqwest::Client, base: &str, series: &str) -> f64 {
    metrics_at(client, base)
        .await
        .get(series)
        .copied()
        .unwrap_or_default()
}

/// Numbers this instance holds in leases right now (recorded, neither
/// handed out nor given back).
async fn held(client: &reqwest::Client, base: &str) -> f64 {
    // One read of /metrics: the three counters of one moment.
    let metrics = metrics_at(client, base).await;
    let counter = |series: &str| metrics.get(series).copied().unwrap_or_default();
    counter("idpool_lease_numbers_total")
        - counter("idpool_lease_numbers_served_total")
        - counter("idpool_lease_numbers_returned_total")
}

#[tokio::test]
async fn lease_size_follows_the_rate_on_the_injected_clock() {
    let env = TestEnv::new();
    let clock = Arc::new(ManualClock::new(Utc::now()));
    let app = env.spawn_with(clock.clone(), PoolSettings::default()).await;
    app.define("RATE", "1", json!({"format": "{seq}", "pool_size": 1000}))
        .await;
    let mut issued = Vec::new();

    // One request a second: a lease would be the request itself, so each
    // is recorded on its own, in strict order.
    for _ in 0..20 {
        clock.advance(chrono::Duration::seconds(1));
        issued.extend(app.issue("RATE", "1", 1).await.1);
    }
    assert!(ledger_rows(&app.db, "RATE", "lease").await.is_empty());
    assert_eq!(ledger_rows(&app.db, "RATE", "ids").await.len(), 20);
    assert!(issued.windows(2).all(|w| w[0] < w[1]), "{issued:?}");

    // 200 a second: leases of about 50 ms of it (10 numbers).
    for _ in 0..150 {
        clock.advance(chrono::Duration::milliseconds(5));
        issued.extend(app.issue("RATE", "1", 1).await.1);
    }
    // The widest lease of each phase: the rate builds up over its first
    // requests, and a lease given back in part (idle on a slow machine)
    // leaves a narrower row.
    let widest = |rows: &[(i64, i64)]| rows.iter().map(|(a, b)| b - a).max();
    let slow = ledger_rows(&app.db, "RATE", "lease").await;
    let slow_width = widest(&slow).expect("leases at 200 a second");
    assert!(
        (5..=15).contains(&slow_width),
        "lease at 200/s: {slow_width}"
    );
    let slow_end = slow.iter().map(|(_, b)| *b).max().unwrap_or_default();

    // 4,000 a second: leases of about 200.
    for _ in 0..1000 {
        clock.advance(chrono::Duration::microseconds(250));
        issued.extend(app.issue("RATE", "1", 1).await.1);
    }
    let fast: Vec<(i64, i64)> = ledger_rows(&app.db, "RATE", "lease")
        .await
        .into_iter()
        .filter(|(a, _)| *a >= slow_end)
        .collect();
    let fast_width = widest(&fast).expect("leases at 4,000 a second");
    assert!(
        (150..=250).contains(&fast_width),
        "lease at 4000/s: {fast_width}"
    );

    // Quiet again: the idle lease goes back to the pool, and the next
    // request, recorded on its own, gets its first number. What was leased
    // is read before the quiet: a return takes its rows off the ledger,
    // and one that landed before the read left no unused number to see.
    let leased = numbers_of(&ledger_rows(&app.db, "RATE", "lease").await);
    clock.advance(chrono::Duration::seconds(10));
    app.wait_for_metric_above(
        "idpool_lease_numbers_returned_total",
        0.0,
        Duration::from_secs(5),
    )
    .await;
    app.state.issuer.lease_returns_written().await;
    let handed = handed_out(&app.db, "RATE").await;
    let unused: BTreeSet<i64> = leased.difference(&handed).copied().collect();
    assert!(!unused.is_empty());
    let (_, last) = app.issue("RATE", "1", 1).await;
    assert_eq!(
        Some(&last[0]),
        unused.first(),
        "the given-back numbers come next"
    );
    let per_request = numbers_of(&ledger_rows(&app.db, "RATE", "ids").await);
    assert!(per_request.contains(&last[0]));
    issued.extend(last);
    let distinct: HashSet<i64> = issued.iter().copied().collect();
    assert_eq!(distinct.len(), issued.len(), "a number issued twice");
    // What stays recorded as leased is exactly what was handed out.
    assert_eq!(
        numbers_of(&ledger_rows(&app.db, "RATE", "lease").await),
        handed
    );
    assert!(
        discarded(&app.db, "RATE", "lease_returned")
            .await
            .is_empty()
    );
}

#[tokio::test]
async fn documents_on_a_busy_sequence_carry_leased_numbers_and_never_reuse_a_refused_one() {
    let env = TestEnv::new();
    // The clock stands still: every request adds to the rate.
    let clock = Arc::new(ManualClock::new(Utc::now()));
    let app = env.spawn_with(clock.clone(), PoolSettings::default()).await;
    // Another sequence of the same project prints the same IDs; its
    // documents take SAME-1..=60. (A PUT refuses that now; a definition
    // saved before the check still can, so PP/1 is written as such a one
    // was. Another project's IDs never refuse PP's documents: SPEC.)
    app.define(
        "PP",
        "0",
        json!({"format": "SAME-{seq}", "pool_size": 1000}),
    )
    .await;
    sqlx::query(
        "INSERT INTO sequences (project, doc_type, format, layout, epoch, start_seq, max_seq, \
                                reset, timezone, pool_size, refill_at) \
         SELECT 'PP', '1', format, layout, epoch, start_seq, max_seq, reset, timezone, \
                pool_size, refill_at FROM sequences WHERE project = 'PP' AND doc_type = '0'",
    )
    .execute(&app.db)
    .await
    .expect("a definition from before the cross-sequence check");
    for _ in 0..60 {
        let occupier = json!({"project": "PP", "type": "0", "metadata": {}});
        let response = app.post_document(&occupier, None).await;
        assert_eq!(response.status(), reqwest::StatusCode::ACCEPTED);
    }

    // PP/1's numbers 1..=60 print IDs PP/0's documents carry: refused. Eight
    // clients at once keep the sequence busy.
    let app = Arc::new(app);
    let sent = Arc::new(AtomicUsize::new(0));
    let workers: Vec<_> = (0..8)
        .map(|_| {
            let (app, sent) = (app.clone(), sent.clone());
            tokio::spawn(async move {
                let mut answers = Vec::new();
                while sent.fetch_add(1, Ordering::Relaxed) < 130 {
                    let body = json!({"project": "PP", "type": "1", "metadata": {}});
                    let response = app.post_document(&body, None).await;
                    let status = response.status();
                    let body: Value = response.json().await.expect("json");
                    answers.push((status, body));
                }
                answers
            })
        })
        .collect();
    let mut accepted = Vec::new();
    let mut refused = 0;
    for worker in workers {
        for (status, body) in worker.await.expect("worker") {
            match status {
                reqwest::StatusCode::ACCEPTED => accepted.push(body["seq"].as_i64().unwrap()),
                reqwest::StatusCode::CONFLICT => {
                    assert_eq!(body["code"], "document_id_taken", "{body}");
                    refused += 1;
                }
                other => panic!("{other}: {body}"),
            }
        }
    }
    assert_eq!(accepted.len() + refused, 130);
    assert!(accepted.iter().all(|s| *s > 60), "{accepted:?}");
    let distinct: HashSet<i64> = accepted.iter().copied().collect();
    assert_eq!(
        distinct.len(),
        accepted.len(),
        "a number carries two documents"
    );

    // Busy: documents carry numbers of leases, each recorded once, and
    // only the outbox row says which went to a document (no handout).
    let leased = numbers_of(&type_ledger_rows(&app.db, "PP", Some("1"), "lease").await);
    let per_request = numbers_of(&type_ledger_rows(&app.db, "PP", Some("1"), "document").await);
    let from_leases = accepted.iter().filter(|s| leased.contains(s)).count();
    assert!(
        from_leases >= 50,
        "{from_leases} of {} accepted documents on leased numbers",
        accepted.len()
    );
    assert!(
        accepted
            .iter()
            .all(|s| leased.contains(s) != per_request.contains(s)),
        "a document's number recorded twice or not at all"
    );
    assert!(handed_out(&app.db, "PP").await.is_empty());

    // A leased number whose document was refused is never handed out
    // again: recorded as discarded, a pool_discarded gap.
    let poisoned = discarded(&app.db, "PP", "document_not_written").await;
    assert!(
        !poisoned.is_empty(),
        "no refused document had a leased number"
    );
    assert!(poisoned.iter().all(|s| *s <= 60), "{poisoned:?}");
    // The clock moves on: the leases, idle now, go back to the pool.
    clock.advance(chrono::Duration::seconds(2));
    eventually(
        Duration::from_secs(5),
        "the leases are given back",
        async || (held(&app.client, &app.address).await <= 0.0).then_some(()),
    )
    .await;
    app.state.issuer.lease_returns_written().await;
    app.settle_and_reconcile().await;
    let gaps = reasons(&app, "PP").await;
    for seq in &poisoned {
        assert_eq!(
            gaps.get(seq),
            Some(&vec!["pool_discarded".to_owned()]),
            "{seq}"
        );
    }
    for seq in &accepted {
        assert!(
            !gaps.contains_key(seq),
            "{seq} carries a document: {:?}",
            gaps[seq]
        );
    }
    assert!(
        gaps.values()
            .flatten()
            .all(|r| r != "lease_lost" && r != "issued_unattached"),
        "{gaps:?}"
    );
}

#[tokio::test]
async fn redis_stopped_mid_lease_serves_the_lease_then_groups_the_fallback() {
    let mut redis = RedisServer::start();
    let env = TestEnv::new().with_redis(&redis.url());
    // The clock stands still: every request adds to the rate, so the
    // sequence is busy from the first few requests on.
    let clock = Arc::new(ManualClock::new(Utc::now()));
    let app = env.spawn_with(clock, PoolSettings::default()).await;
    app.define("RDS", "1", json!({"format": "{seq}", "pool_size": 1000}))
        .await;
    let mut issued = Vec::new();
    while held(&app.client, &app.address).await < 50.0 {
        issued.extend(app.issue("RDS", "1", 1).await.1);
        assert!(issued.len() < 2000, "no lease taken");
    }
    let leased_before = numbers_of(&ledger_rows(&app.db, "RDS", "lease").await);
    redis.kill();

    // Served from the lease: no Redis call on the path.
    for _ in 0..10 {
        let (_, seqs) = app.issue("RDS", "1", 1).await;
        assert!(
            leased_before.contains(&seqs[0]),
            "{} not from the lease",
            seqs[0]
        );
        issued.extend(seqs);
    }
    // Then from Postgres, a lease at a time: far fewer counter updates
    // than requests.
    let direct_before = metric(
        &app.client,
        &app.address,
        "idpool_ids_issued_total{source=\"direct\"}",
    )
    .await;
    for _ in 0..400 {
        issued.extend(app.issue("RDS", "1", 1).await.1);
    }
    let direct = metric(
        &app.client,
        &app.address,
        "idpool_ids_issued_total{source=\"direct\"}",
    )
    .await;
    assert!(direct > direct_before, "nothing came from Postgres");
    let direct_blocks: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM blocks b JOIN sequences s ON s.id = b.sequence_id \
         WHERE s.project = 'RDS' AND b.purpose = 'direct'",
    )
    .fetch_one(&app.db)
    .await
    .unwrap();
    assert!(
        (1..=20).contains(&direct_blocks),
        "{direct_blocks} counter updates for 400 requests"
    );
    let distinct: HashSet<i64> = issued.iter().copied().collect();
    assert_eq!(distinct.len(), issued.len(), "a number issued twice");
}

/// Requests on `base` from `workers` clients until `running` is cleared;
/// every number each answer carried.
fn load(
    client: &reqwest::Client,
    base: String,
    project: &'static str,
    workers: usize,
    running: Arc<AtomicBool>,
    answered: Arc<AtomicUsize>,
) -> Vec<tokio::task::JoinHandle<Vec<i64>>> {
    (0..workers)
        .map(|w| {
            let (client, base, running, answered) = (
                client.clone(),
                base.clone(),
                running.clone(),
                answered.clone(),
            );
            tokio::spawn(async move {
                let mut seqs = Vec::new();
                let mut i = 0usize;
                while running.load(Ordering::Relaxed) {
                    i += 1;
                    let body = json!({"project": project, "type": "1", "count": 1 + (w + i) % 3});
                    let Ok(response) = client.post(format!("{base}/ids")).json(&body).send().await
                    else {
                        continue;
                    };
                    assert_eq!(response.status(), 200, "POST /ids on {base}");
                    let body: Value = response.json().await.unwrap();
                    seqs.extend(seqs_of(&body));
                    answered.fetch_add(1, Ordering::Relaxed);
                }
                seqs
            })
        })
        .collect()
}

async fn collect(workers: Vec<tokio::task::JoinHandle<Vec<i64>>>) -> Vec<i64> {
    let mut seqs = Vec::new();
    for worker in workers {
        seqs.extend(worker.await.unwrap());
    }
    seqs
}

async fn wait_for_answers(answered: &AtomicUsize, n: usize) {
    eventually(Duration::from_secs(60), "traffic goes on", async || {
        (answered.load(Ordering::Relaxed) >= n).then_some(())
    })
    .await;
}

/// Open gaps of a sequence as number → reasons.
async fn reasons(app: &TestApp, project: &str) -> HashMap<i64, Vec<String>> {
    let mut by_number: HashMap<i64, Vec<String>> = HashMap::new();
    for gap in app.gaps(project, "1").await {
        for n in gap["from_seq"].as_i64().unwrap()..=gap["to_seq"].as_i64().unwrap() {
            by_number
                .entry(n)
                .or_default()
                .push(gap["reason"].as_str().unwrap().to_owned());
        }
    }
    by_number
}

async fn judged_below(app: &TestApp, project: &str) -> (i64, i64) {
    sqlx::query_as(
        "SELECT r.checkpoint, (SELECT min(lower(seqs)) FROM blocks b WHERE b.sequence_id = r.sequence_id) \
         FROM reconcile_periods r JOIN sequences s ON s.id = r.sequence_id WHERE s.project = $1",
    )
    .bind(project)
    .fetch_one(&app.db)
    .await
    .unwrap()
}

#[tokio::test]
async fn a_clean_stop_gives_the_lease_back() {
    let env = TestEnv::new();
    let a = env.spawn().await;
    a.define("STOP", "1", json!({"format": "{seq}"})).await;
    let mut b = ServeProcess::start(&env).await;
    let b_url = format!("http://127.0.0.1:{}", b.port);
    let (running, answered) = (
        Arc::new(AtomicBool::new(true)),
        Arc::new(AtomicUsize::new(0)),
    );
    let workers = load(
        &a.client,
        b_url.clone(),
        "STOP",
        8,
        running.clone(),
        answered.clone(),
    );
    wait_for_answers(&answered, 1500).await;
    running.store(false, Ordering::Relaxed);
    let issued = collect(workers).await;
    let still_held = held(&a.client, &b_url).await;
    assert!(still_held > 0.0, "the instance held no lease when stopped");
    b.stop();
    assert!(b.child.try_wait().unwrap().is_some(), "b stopped cleanly");

    // What b handed out stays recorded as leased, and nothing else does:
    // the rest went back to the pool.
    let handed = handed_out(&a.db, "STOP").await;
    let on_their_own = numbers_of(&ledger_rows(&a.db, "STOP", "ids").await);
    for seq in &issued {
        assert!(
            handed.contains(seq) || on_their_own.contains(seq),
            "{seq} was handed out but not reported"
        );
    }
    assert_eq!(
        numbers_of(&ledger_rows(&a.db, "STOP", "lease").await),
        handed
    );
    // No gap: the next caller gets the first number b did not hand out.
    let first_unused = (1..)
        .find(|seq| !handed.contains(seq) && !on_their_own.contains(seq))
        .unwrap();
    let (_, next) = a.issue("STOP", "1", 1).await;
    assert_eq!(next[0], first_unused, "the given-back numbers come next");
    a.settle_and_reconcile().await;
    let gaps = reasons(&a, "STOP").await;
    assert!(
        gaps.values().flatten().all(|r| r != "lease_lost"),
        "a clean stop lost lease numbers: {gaps:?}"
    );
}

#[tokio::test]
async fn two_instances_under_load_one_killed_mid_lease() {
    let mut env = TestEnv::new();
    env.settle = Duration::from_secs(2);
    let a = Arc::new(env.spawn().await);
    a.define("KIL", "1", json!({"format": "{seq}"})).await;
    let mut b = ServeProcess::start(&env).await;
    let b_url = format!("http://127.0.0.1:{}", b.port);

    let (a_running, a_answered) = (
        Arc::new(AtomicBool::new(true)),
        Arc::new(AtomicUsize::new(0)),
    );
    let (b_running, b_answered) = (
        Arc::new(AtomicBool::new(true)),
        Arc::new(AtomicUsize::new(0)),
    );
    let a_workers = load(
        &a.client,
        a.address.clone(),
        "KIL",
        4,
        a_running.clone(),
        a_answered.clone(),
    );
    let b_workers = load(
        &a.client,
        b_url.clone(),
        "KIL",
        8,
        b_running.clone(),
        b_answered.clone(),
    );
    wait_for_answers(&b_answered, 2000).await;
    // b's clients finish; it reports what it handed out, and dies while
    // its lease still holds numbers it never handed out.
    b_running.store(false, Ordering::Relaxed);
    let from_b = collect(b_workers).await;
    eventually(
        Duration::from_secs(10),
        "b reports what it handed out",
        async || {
            let recorded: Vec<(i64, i64)> = sqlx::query_as(
                "SELECT lower(l.seqs), upper(l.seqs) FROM issuance_ledger l \
             JOIN sequences s ON s.id = l.sequence_id WHERE s.project = 'KIL' AND l.via <> 'lease' \
             UNION ALL SELECT lower(h.seqs), upper(h.seqs) FROM lease_handouts h \
             JOIN sequences s ON s.id = h.sequence_id WHERE s.project = 'KIL'",
            )
            .fetch_all(&a.db)
            .await
            .ok()?;
            let recorded: HashSet<i64> = recorded.into_iter().flat_map(|(s, e)| s..e).collect();
            from_b.iter().all(|n| recorded.contains(n)).then_some(())
        },
    )
    .await;
    let held_at_kill = held(&a.client, &b_url).await;
    b.kill();
    let a_so_far = a_answered.load(Ordering::Relaxed);
    wait_for_answers(&a_answered, a_so_far + 500).await;
    a_running.store(false, Ordering::Relaxed);
    let from_a = collect(a_workers).await;

    let mut seen = HashSet::new();
    for seq in from_a.iter().chain(&from_b) {
        assert!(seen.insert(*seq), "{seq} handed out twice");
    }
    assert!(
        !ledger_rows(&a.db, "KIL", "lease").await.is_empty(),
        "no lease taken"
    );

    a.settle_and_reconcile().await;
    a.settle_and_reconcile().await;
    let gaps = reasons(&a, "KIL").await;
    let (checkpoint, first) = judged_below(&a, "KIL").await;
    let mut unexplained = Vec::new();
    for n in first..checkpoint {
        if gaps.get(&n).map(Vec::len) != Some(1) {
            unexplained.push((n, gaps.get(&n).cloned()));
        }
    }
    assert!(
        unexplained.is_empty(),
        "unexplained numbers: {unexplained:?}"
    );
    let reason = |n: &i64| gaps.get(n).map(|r| r[0].as_str());
    for n in from_a.iter().filter(|n| **n < checkpoint) {
        assert_eq!(reason(n), Some("issued_unattached"), "{n} from a");
    }
    for n in from_b.iter().filter(|n| **n < checkpoint) {
        assert_eq!(
            reason(n),
            Some("issued_unattached"),
            "{n} from b, reported before the kill"
        );
    }
    let lost = gaps.values().filter(|r| r[0] == "lease_lost").count();
    assert!(
        lost as f64 >= held_at_kill,
        "{held_at_kill} numbers held at the kill, {lost} lease_lost"
    );
    assert!(held_at_kill > 0.0, "b held no lease when killed");
    let allowed = ["issued_unattached", "lease_lost", "untracked_loss"];
    assert!(
        gaps.values()
            .flatten()
            .all(|r| allowed.contains(&r.as_str())),
        "a killed instance costs lease_lost and untracked_loss only: {gaps:?}"
    );
    // Nothing a caller received is called lost.
    for n in from_a.iter().chain(&from_b) {
        assert_ne!(reason(n), Some("lease_lost"), "{n} was handed out");
    }
}

/// Issues on `port` from 16 clients until `stop`; every answered ID is
/// handed to `attach` at once.
async fn issue_and_attach(
    port: u16,
    key: String,
    stop: Arc<AtomicBool>,
    attached: tokio::sync::mpsc::UnboundedSender<String>,
) {
    let issuing = (0..16).map(|_| {
        let (stop, attached) = (stop.clone(), attached.clone());
        let client = crate::support::app::client_with_key(Some(&key));
        async move {
            while !stop.load(Ordering::Relaxed) {
                let answer = client
                    .post(format!("http://127.0.0.1:{port}/ids"))
                    .json(&json!({"project": "ATT", "type": "1", "count": 1}))
                    .send()
                    .await;
                // The instance may be killed under us: what it answered counts.
                let Ok(answer) = answer else { return };
                if answer.status() != reqwest::StatusCode::OK {
                    continue;
                }
                let Ok(body) = answer.json::<Value>().await else {
                    return;
                };
                if let Some(id) = body["ids"][0].as_str() {
                    let _ = attached.send(id.to_owned());
                }
            }
        }
    });
    futures::future::join_all(issuing).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_id_answered_is_attachable_at_once_through_any_instance_and_after_its_instance_is_killed()
 {
    let env = TestEnv::new();
    // The instance that attaches; the one that answers is a process of
    // its own, so it can be killed.
    let attaching = env.spawn().await;
    let mut answering = ServeProcess::start(&env).await;
    let key = attaching.admin_key.clone();
    let attach = |id: String| {
        let (client, url) = (attaching.client.clone(), attaching.url("/documents"));
        async move {
            let response = client
                .post(url)
                .json(&json!({"project": "ATT", "type": "1", "id": id, "metadata": {}}))
                .send()
                .await
                .expect("attach");
            let status = response.status();
            let body: Value = response.json().await.unwrap_or(Value::Null);
            (id, status, body)
        }
    };

    // Busy enough for leases; each ID attached through the other instance
    // the moment it is answered.
    let (sent, mut answered) = tokio::sync::mpsc::unbounded_channel();
    let stop = Arc::new(AtomicBool::new(false));
    let issuing = tokio::spawn(issue_and_attach(
        answering.port,
        key.clone(),
        stop.clone(),
        sent.clone(),
    ));
    let mut at_once = 0;
    let started = Instant::now();
    // Fifty IDs tell; how soon they come depends on the machine.
    while at_once < 50 && started.elapsed() < Duration::from_secs(15) {
        let Some(id) = answered.recv().await else {
            break;
        };
        let (id, status, body) = attach(id).await;
        assert_eq!(
            status,
            reqwest::StatusCode::ACCEPTED,
            "{id} attached at once: {body}"
        );
        at_once += 1;
    }
    stop.store(true, Ordering::Relaxed);
    issuing.await.unwrap();
    assert!(at_once >= 50, "too few IDs to tell ({at_once})");
    let leased = ledger_rows(&attaching.db, "ATT", "lease").await;
    assert!(!leased.is_empty(), "the answering instance served no lease");

    // Killed mid-burst: every ID it had answered is still attachable.
    let stop = Arc::new(AtomicBool::new(false));
    let issuing = tokio::spawn(issue_and_attach(
        answering.port,
        key.clone(),
        stop.clone(),
        sent,
    ));
    let mut before_kill = Vec::new();
    while before_kill.len() < 200 {
        before_kill.push(answered.recv().await.expect("answers"));
    }
    answering.kill();
    stop.store(true, Ordering::Relaxed);
    issuing.await.unwrap();
    while let Ok(id) = answered.try_recv() {
        before_kill.push(id);
    }
    for id in before_kill {
        let (id, status, body) = attach(id).await;
        assert_eq!(
            status,
            reqwest::StatusCode::ACCEPTED,
            "{id}, answered before the kill: {body}"
        );
    }
}

/// An instance answers IDs from its lease while its network to Postgres
/// hangs (so not one handout of them is written), and is killed. Every ID
/// it answered is attachable through another instance: an attach waits
/// for the handout, or for the lease's expiry, never fails for it; and
/// reconciliation lists none of them as a gap once attached.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ids_answered_with_no_handout_written_before_a_kill_are_attachable() {
    let env = TestEnv::new();
    let attaching = env.spawn().await;
    let proxy = crate::support::stall::StallingProxy::start("127.0.0.1:5432").await;
    let mut through_proxy = env.clone();
    through_proxy.database_url = proxy.url_for(&env.database_url);
    let mut answering = ServeProcess::start(&through_proxy).await;
    let base = format!("http://127.0.0.1:{}", answering.port);

    let (sent, mut answered) = tokio::sync::mpsc::unbounded_channel::<(Instant, String)>();
    let running = Arc::new(AtomicBool::new(true));
    // The clients hold off while paused, so the lease is not drawn on
    // between the look at what it holds and the stall.
    let (pause, paused) = tokio::sync::watch::channel(false);
    let in_flight = Arc::new(AtomicUsize::new(0));
    let clients: Vec<_> = (0..16)
        .map(|_| {
            let (client, url, sent, running, mut paused, in_flight) = (
                attaching.client.clone(),
                format!("{base}/ids"),
                sent.clone(),
                running.clone(),
                paused.clone(),
                in_flight.clone(),
            );
            tokio::spawn(async move {
                while running.load(Ordering::Relaxed) {
                    if paused.wait_for(|p| !*p).await.is_err() {
                        return;
                    }
                    in_flight.fetch_add(1, Ordering::SeqCst);
                    let answer = async {
                        let response = client
                            .post(&url)
                            .json(&json!({"project": "ATK", "type": "1", "count": 1}))
                            .send()
                            .await
                            .ok()?;
                        response.json::<Value>().await.ok()
                    }
                    .await;
                    in_flight.fetch_sub(1, Ordering::SeqCst);
                    let Some(body) = answer else {
                        return;
                    };
                    if let Some(id) = body["ids"][0].as_str() {
                        let _ = sent.send((Instant::now(), id.to_owned()));
                    }
                }
            })
        })
        .collect();
    drop(sent);
    let mut ids: Vec<(Instant, String)> = Vec::new();
    // Busy long enough to hold a good part of a lease; then the clients
    // pause, and the instance, stalled with numbers in memory, answers
    // them for a while from memory alone. A lease carries 50 ms of
    // traffic, so what it holds follows the machine's speed: 20 numbers
    // (more than one for each of the 16 clients) are some 400 a second,
    // reached within seconds even on a loaded machine.
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut most_held = 0.0_f64;
    loop {
        ids.push(answered.recv().await.expect("answers"));
        while let Ok(one) = answered.try_recv() {
            ids.push(one);
        }
        if ids.len() < 2000 {
            continue;
        }
        let now_held = held(&attaching.client, &base).await;
        most_held = most_held.max(now_held);
        if now_held >= 20.0 {
            pause.send_replace(true);
            until(Duration::from_secs(10), "the clients paused", async || {
                in_flight.load(Ordering::SeqCst) == 0
            })
            .await;
            // Drawn on until the pause; a lease taken meanwhile counts.
            if held(&attaching.client, &base).await >= 1.0 {
                break;
            }
            pause.send_replace(false);
        }
        assert!(
            Instant::now() < deadline,
            "the lease never held 20 numbers in 60 s (at most {most_held})"
        );
    }
    proxy.stall();
    let stalled_at = Instant::now();
    pause.send_replace(false);
    // The lease keeps answering without Postgres until it runs dry.
    while let Ok(Some(one)) =
        tokio::time::timeout(Duration::from_millis(300), answered.recv()).await
    {
        ids.push(one);
    }
    answering.kill();
    running.store(false, Ordering::Relaxed);
    for client in clients {
        let _ = client.await;
    }
    while let Ok(one) = answered.try_recv() {
        ids.push(one);
    }
    proxy.resume();
    let after_stall: Vec<&String> = ids
        .iter()
        // Nothing was in flight at the stall: an answer received after it
        // was asked for after it.
        .filter(|(at, _)| *at > stalled_at)
        .map(|(_, id)| id)
        .collect();
    assert!(
        !after_stall.is_empty(),
        "the lease answered nothing while Postgres was out of reach"
    );

    // Every ID answered after the stall, then the last 200 before it,
    // attached through the other instance: the first while their lease
    // has not expired yet.
    let mut slowest = Duration::ZERO;
    let before_stall: Vec<&String> = ids
        .iter()
        .map(|(_, id)| id)
        .filter(|id| !after_stall.contains(id))
        .collect();
    let last_before = &before_stall[before_stall.len().saturating_sub(200)..];
    for &id in after_stall.iter().chain(last_before) {
        let started = Instant::now();
        let response = attaching
            .post_document(
                &json!({"project": "ATK", "type": "1", "id": id, "metadata": {}}),
                None,
            )
            .await;
        let status = response.status();
        let body: Value = response.json().await.unwrap_or(Value::Null);
        assert_eq!(status, reqwest::StatusCode::ACCEPTED, "{id}: {body}");
        slowest = slowest.max(started.elapsed());
    }
    // An attach waits at most for a lease's expiry, and a little more.
    assert!(
        slowest <= idpool::records::ledger::LEASE_TTL + Duration::from_secs(2),
        "an attach waited {slowest:?}"
    );
    let numbers: Vec<i64> = after_stall
        .iter()
        .map(|id| {
            id.rsplit('-')
                .next()
                .and_then(|n| n.parse().ok())
                .expect("a number")
        })
        .collect();
    let reported = handed_out(&attaching.db, "ATK").await;
    let unreported = numbers.iter().filter(|n| !reported.contains(n)).count();
    assert!(
        unreported > 0,
        "every handout was written before the kill: the test did not test"
    );
    println!(
        "{} IDs answered, {} after the stall ({unreported} never reported); slowest attach {slowest:?}",
        ids.len(),
        after_stall.len()
    );
    attaching.settle_and_reconcile().await;
    let gaps = reasons(&attaching, "ATK").await;
    for n in &numbers {
        assert!(
            !gaps.contains_key(n),
            "{n} was attached, yet a gap: {:?}",
            gaps[n]
        );
    }
}

/// SPEC: `409 sequence_exhausted` means the sequence has no numbers left
/// below its `max`. With Redis down, a lease's unused numbers wait in this
/// instance to go back to their pool; a request that then finds the
/// counter spent is told 503 with Retry-After (they come back with
/// Redis). It was told 409 while they were there (a review: P7/M1
/// answered 409 91 times while 489..499 waited, and issued them once
/// Redis was back).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_exhausted_answer_while_numbers_held_back_wait_for_redis() {
    let mut redis = RedisServer::start();
    let env = TestEnv::new().with_redis(&redis.url());
    let clock = Arc::new(ManualClock::new(Utc::now()));
    let app = env.spawn_with(clock.clone(), PoolSettings::default()).await;
    app.define("HELD", "1", json!({"max": 200, "pool_size": 20}))
        .await;
    // Fast enough on the injected clock to take a lease.
    for _ in 0..20 {
        clock.advance(chrono::Duration::microseconds(250));
        app.issue("HELD", "1", 1).await;
    }
    redis.kill();
    app.wait_for_mode("fallback", Duration::from_secs(10)).await;
    // The lease goes idle and is given back: Redis cannot take it.
    eventually(
        Duration::from_secs(10),
        "the lease's numbers wait to go back",
        async || (app.metrics().await["idpool_lease_returns_retrying"] > 0.0).then_some(()),
    )
    .await;
    let mut last = None;
    for _ in 0..400 {
        let response = app.post_ids("HELD", "1", 1).await;
        let status = response.status();
        if status != reqwest::StatusCode::OK {
            let body: Value = response.json().await.unwrap_or(Value::Null);
            last = Some((status, body));
            break;
        }
    }
    let (status, body) = last.expect("the sequence ran out within 400 requests");
    let held = app.metrics().await["idpool_lease_returns_retrying"];
    assert!(
        held > 0.0,
        "the lease's numbers still wait: the test tested"
    );
    assert_eq!(
        (status, body["code"].as_str()),
        (
            reqwest::StatusCode::SERVICE_UNAVAILABLE,
            Some("unavailable")
        ),
        "answered {body} while {held} numbers waited to go back to the pool"
    );
}

/// Issue 40's hostile review, finding 1, left open (see its closing note):
/// an instance that is killed (or paused past its lease's expiry) leaves
/// the numbers of its lease that it never answered attachable, since
/// nothing written tells them from numbers it answered in the last few
/// milliseconds before it stopped. Reconciliation lists them as
/// `lease_lost`, and an attached one leaves the gap list; but a caller who
/// guesses such an ID gets it accepted. Closing this needs the holder to
/// commit a mark ahead of what it answers. Fails today; run it with
/// `cargo nextest run --run-ignored only -E 'test(never_answered)'`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "issue 40 review finding 1, open: a killed holder's never-answered lease numbers are attachable"]
async fn a_killed_holders_never_answered_lease_numbers_are_not_attachable() {
    let env = TestEnv::new();
    let attaching = env.spawn().await;
    let mut answering = ServeProcess::start(&env).await;
    let url = format!("http://127.0.0.1:{}/ids", answering.port);
    let mut answered = BTreeSet::new();
    // Busy enough for leases of many numbers; every request ends before
    // the kill, so every number answered is known here.
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(1) {
        let replies = futures::future::join_all((0..8).map(|_| {
            attaching
                .client
                .post(&url)
                .json(&json!({"project": "NA", "type": "1", "count": 1}))
                .send()
        }))
        .await;
        for reply in replies {
            let body: Value = reply.expect("answer").json().await.expect("json");
            answered.extend(seqs_of(&body));
        }
    }
    answering.kill();
    let leased = numbers_of(&ledger_rows(&attaching.db, "NA", "lease").await);
    let never_answered: Vec<i64> = leased.difference(&answered).copied().collect();
    assert!(
        !never_answered.is_empty(),
        "the killed instance's leases were used up: the test did not test"
    );
    let mut accepted = Vec::new();
    for seq in never_answered.iter().rev().take(5) {
        let response = attaching
            .post_document(
                &json!({"project": "NA", "type": "1", "id": format!("NA-1-{seq}"), "metadata": {}}),
                None,
            )
            .await;
        if response.status() == reqwest::StatusCode::ACCEPTED {
            accepted.push(*seq);
        }
    }
    assert!(
        accepted.is_empty(),
        "never answered, yet attached: {accepted:?} (answered up to {:?})",
        answered.last()
    );
}

/// Clients post documents with no ID of their own to one instance, which
/// then stops running (SIGSTOP) for longer than its leases' expiry; a
/// tenant meanwhile attaches, through another instance, every number of
/// those leases that carries no document (each attach ends its lease once
/// past the expiry). Resumed, the instance writes the documents it had in
/// flight on other numbers: no answer is `409 document_id_taken` (nothing
/// of such a document was written, and it named no ID).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn documents_in_flight_on_a_frozen_instance_take_other_numbers_once_theirs_were_attached() {
    use nix::sys::signal::{Signal, kill};
    use nix::unistd::Pid;
    let env = TestEnv::new();
    let attaching = env.spawn().await;
    let frozen = ServeProcess::start(&env).await;
    let url = format!("http://127.0.0.1:{}/documents", frozen.port);
    let running = Arc::new(AtomicBool::new(true));
    let clients: Vec<_> = (0..8)
        .map(|_| {
            let (client, url, running) = (attaching.client.clone(), url.clone(), running.clone());
            tokio::spawn(async move {
                let mut statuses = Vec::new();
                while running.load(Ordering::Relaxed) {
                    let response = client
                        .post(&url)
                        .json(&json!({"project": "FZ", "type": "1", "metadata": {}}))
                        .send()
                        .await
                        .expect("the instance answers");
                    let status = response.status();
                    let body: Value = response.json().await.unwrap_or(Value::Null);
                    statuses.push((status, body["code"].as_str().map(str::to_owned)));
                }
                statuses
            })
        })
        .collect();
    let documents = async || -> BTreeSet<i64> {
        sqlx::query_scalar(
            "SELECT o.seq FROM id_outbox o JOIN sequences s ON s.id = o.sequence_id \
             WHERE s.project = 'FZ'",
        )
        .fetch_all(&attaching.db)
        .await
        .expect("documents")
        .into_iter()
        .collect()
    };
    until(
        Duration::from_secs(30),
        "documents on leased numbers",
        async || {
            documents().await.len() >= 300
                && !ledger_rows(&attaching.db, "FZ", "lease").await.is_empty()
        },
    )
    .await;
    let pid = Pid::from_raw(frozen.child.id() as i32);
    // Frozen with numbers of its leases still free: a stop that lands
    // just as its leases ran out leaves nothing to attach, so the
    // instance is let go and frozen again.
    let free = eventually(
        Duration::from_secs(30),
        "frozen while a lease holds free numbers",
        async || {
            kill(pid, Signal::SIGSTOP).expect("SIGSTOP");
            let leased = numbers_of(&ledger_rows(&attaching.db, "FZ", "lease").await);
            let written = documents().await;
            let free: Vec<i64> = leased.difference(&written).copied().collect();
            if free.is_empty() {
                kill(pid, Signal::SIGCONT).expect("SIGCONT");
                return None;
            }
            Some(free)
        },
    )
    .await;
    let attaches = futures::future::join_all(free.iter().map(|seq| {
        let body =
            json!({"project": "FZ", "type": "1", "id": format!("FZ-1-{seq}"), "metadata": {}});
        let attaching = &attaching;
        async move {
            let response = attaching.post_document(&body, None).await;
            let status = response.status();
            (
                status,
                response.json::<Value>().await.unwrap_or(Value::Null),
            )
        }
    }))
    .await;
    let attached = attaches
        .iter()
        .filter(|(status, _)| *status == reqwest::StatusCode::ACCEPTED)
        .count();
    // Not attached: a document written on it just before the stop
    // (committed, not yet read above).
    let not_attached: Vec<&(reqwest::StatusCode, Value)> = attaches
        .iter()
        .filter(|(status, _)| *status != reqwest::StatusCode::ACCEPTED)
        .collect();
    assert!(
        not_attached
            .iter()
            .all(|(status, _)| *status == reqwest::StatusCode::CONFLICT),
        "attaches refused otherwise than for a document already there: {not_attached:?}"
    );
    kill(pid, Signal::SIGCONT).expect("SIGCONT");
    assert!(
        attached > 0,
        "none of the {} free leased numbers was attached: the test did not test",
        free.len()
    );
    // Answers after the resume, then the clients stop.
    let resumed_with = documents().await.len();
    until(
        Duration::from_secs(30),
        "documents after the resume",
        async || documents().await.len() > resumed_with + 100,
    )
    .await;
    running.store(false, Ordering::Relaxed);
    let mut statuses = Vec::new();
    for client in clients {
        statuses.extend(client.await.expect("client"));
    }
    let refused: Vec<_> = statuses
        .iter()
        .filter(|(status, _)| *status != reqwest::StatusCode::ACCEPTED)
        .collect();
    println!(
        "{} documents posted, {attached} of {} free leased numbers attached meanwhile, refused: {refused:?}",
        statuses.len(),
        free.len()
    );
    assert!(
        refused.iter().all(
            |(status, code)| *status == reqwest::StatusCode::SERVICE_UNAVAILABLE
                && code.as_deref() != Some("document_id_taken")
        ),
        "{refused:?}"
    );
}

/// SPEC, limits: "the in-memory caches (entries of idle sequences are
/// evicted)". A lease holder is kept per pool in use: fifty sequences used
/// once each and then left alone are forgotten, with every number their
/// leases held back in the pools, while one still in use keeps its holder.
#[tokio::test]
async fn lease_holders_of_sequences_gone_quiet_are_forgotten() {
    let env = TestEnv::new();
    let clock = Arc::new(ManualClock::new(Utc::now()));
    let app = env.spawn_with(clock.clone(), PoolSettings::default()).await;
    // A burst on each, fast enough on the injected clock to take leases.
    for i in 0..50 {
        for _ in 0..20 {
            clock.advance(chrono::Duration::microseconds(250));
            app.issue("QUIET", &format!("T{i}"), 1).await;
        }
    }
    let busy = app.state.issuer.lease_holders();
    assert!(busy >= 50, "{busy} holders for 50 sequences in use");

    // Ten minutes pass; only BUSY is asked for meanwhile, once a second.
    for _ in 0..600 {
        clock.advance(chrono::Duration::seconds(1));
        app.issue("QUIET", "BUSY", 1).await;
    }
    let what = "the holders of the quiet sequences forgotten";
    crate::support::app::eventually(Duration::from_secs(10), what, async || {
        (app.state.issuer.lease_holders() == 1).then_some(())
    })
    .await;
    app.state.issuer.lease_returns_written().await;
    let issued: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM issuance_ledger l JOIN sequences s ON s.id = l.sequence_id \
         WHERE s.project = 'QUIET' AND l.via = 'lease'",
    )
    .fetch_one(&app.db)
    .await
    .expect("leases");
    assert!(issued > 0, "the bursts were served from leases");
    let reconciled = app.reconcile().await;
    assert_eq!(
        reconciled["gaps_added"]["untracked_loss"]
            .as_i64()
            .unwrap_or(0),
        0,
        "{reconciled}"
    );
}
