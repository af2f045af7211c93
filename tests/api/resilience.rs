//! Redis failing, coming back empty or stale, and many pools at once.

use serde_json::json;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use fred::prelude::*;
use reqwest::StatusCode;
use serde_json::Value;

use crate::support::app::eventually;
use crate::support::app::{TestApp, TestEnv, assert_distinct};
use crate::support::redis_server::RedisServer;

async fn redis_client(url: &str) -> Client {
    let client = Builder::from_config(Config::from_url(url).unwrap())
        .build()
        .unwrap();
    client.init().await.unwrap();
    client
}

/// Issues single IDs from `workers` loops until `running` clears; returns
/// every seq and every non-200 status seen.
fn load(
    app: Arc<TestApp>,
    workers: usize,
    running: Arc<AtomicBool>,
) -> tokio::task::JoinHandle<(Vec<i64>, Vec<u16>)> {
    tokio::spawn(async move {
        let mut tasks = Vec::new();
        for _ in 0..workers {
            let app = app.clone();
            let running = running.clone();
            tasks.push(tokio::spawn(async move {
                let mut seqs = Vec::new();
                let mut failures = Vec::new();
                while running.load(Ordering::Relaxed) {
                    let response = app.post_ids("LOAD", "1", 1).await;
                    let status = response.status();
                    if status == StatusCode::OK {
                        let body: Value = response.json().await.unwrap();
                        seqs.push(body["seqs"][0].as_i64().unwrap());
                    } else {
                        failures.push(status.as_u16());
                    }
                }
                (seqs, failures)
            }));
        }
        let mut seqs = Vec::new();
        let mut failures = Vec::new();
        for task in tasks {
            let (s, f) = task.await.unwrap();
            seqs.extend(s);
            failures.extend(f);
        }
        (seqs, failures)
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_killed_under_load_then_restarted_empty_loses_no_request_and_no_uniqueness() {
    let mut redis = RedisServer::start();
    let app = Arc::new(TestEnv::new().with_redis(&redis.url()).spawn().await);
    let running = Arc::new(AtomicBool::new(true));
    let loader = load(app.clone(), 8, running.clone());

    // The load is served from the pool before the kill.
    let from_pool = "idpool_ids_issued_total{source=\"pool\"}";
    let from_postgres = "idpool_ids_issued_total{source=\"direct\"}";
    app.wait_for_metric_above(from_pool, 100.0, Duration::from_secs(10))
        .await;

    redis.kill();
    app.wait_for_mode("fallback", Duration::from_secs(5)).await;
    let (status, ready) = app.get_json("/readyz").await;
    assert_eq!(status, StatusCode::OK, "ready without Redis: {ready}");
    assert_eq!(ready["redis"], "down");
    // IDs keep coming from Postgres while Redis is down.
    let direct_before = app.metrics().await[from_postgres];
    app.wait_for_metric_above(
        from_postgres,
        direct_before + 100.0,
        Duration::from_secs(10),
    )
    .await;

    redis.restart_empty();
    let resumed = app.wait_for_mode("pool", Duration::from_secs(10)).await;
    // Pool mode serves IDs again after the restart.
    let pool_before = app.metrics().await[from_pool];
    app.wait_for_metric_above(from_pool, pool_before + 100.0, Duration::from_secs(10))
        .await;
    running.store(false, Ordering::Relaxed);
    let (seqs, failures) = loader.await.unwrap();

    assert!(failures.is_empty(), "non-200 answers: {failures:?}");
    assert_distinct(&seqs, "whole run");
    println!(
        "pool mode resumed {resumed:?} after the restart; {} IDs issued",
        seqs.len()
    );
    // The numbers that were in the lost pools are untracked_loss; nothing
    // else is written off.
    app.settle_and_reconcile().await;
    crate::support::traffic::assert_every_number_explained(&app.db, "LOAD", "1", &seqs, &[]).await;
    let reasons: std::collections::BTreeSet<String> = app
        .gaps("LOAD", "1")
        .await
        .iter()
        .map(|gap| gap["reason"].as_str().unwrap_or("?").to_owned())
        .collect();
    assert!(
        reasons
            .iter()
            .all(|r| r == "untracked_loss" || r == "issued_unattached"),
        "{reasons:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_pool_list_never_yields_a_duplicate() {
    let app = TestEnv::new().spawn().await;
    let (_, first) = app.issue("STALE", "1", 50).await;
    // What a lagging replica would hand back after a failover: numbers
    // already issued, at the head of the list.
    let redis = redis_client(&app.env.redis_url).await;
    let key = app.redis_pool_key("STALE", "1", "");
    let stale: Vec<String> = first.iter().rev().map(i64::to_string).collect();
    let _: i64 = redis.lpush(key.as_str(), stale).await.unwrap();

    let mut later = Vec::new();
    for _ in 0..20 {
        later.extend(app.issue("STALE", "1", 5).await.1);
    }
    let mut all = first.clone();
    all.extend(&later);
    assert_distinct(&all, "stale list");
    let metrics = app.metrics().await;
    assert!(
        metrics["idpool_stale_numbers_rejected_total"] >= 1.0,
        "the ledger caught the stale numbers"
    );
    // The stale pool was discarded and its unissued numbers recorded.
    let discarded: i64 =
        sqlx::query_scalar("SELECT count(*) FROM pool_discards WHERE cause = 'stale_list'")
            .fetch_one(&app.db)
            .await
            .unwrap();
    assert!(discarded >= 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_filled_on_another_server_is_discarded_after_reconnect() {
    let mut redis = RedisServer::start();
    let app = TestEnv::new().with_redis(&redis.url()).spawn().await;
    // The first use takes from the counter; the next fills the pool.
    app.issue("FAIL", "1", 1).await;
    let (_, before) = app.issue("FAIL", "1", 10).await;
    // Same data, new server: like a failover to a replica.
    redis.restart_with_data();
    // The pools are checked against the new server (the old pool found
    // and discarded), then used again.
    let what = "the pool filled on the old server is discarded";
    crate::support::app::eventually(Duration::from_secs(10), what, async || {
        let discards: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pool_discards WHERE cause = 'redis_reconnect'",
        )
        .fetch_one(&app.db)
        .await
        .unwrap();
        (discards > 0).then_some(())
    })
    .await;
    app.wait_for_mode("pool", Duration::from_secs(10)).await;
    let (_, after) = app.issue("FAIL", "1", 10).await;
    let highest_block: i64 =
        sqlx::query_scalar("SELECT max(upper(seqs)) FROM blocks WHERE purpose = 'pool'")
            .fetch_one(&app.db)
            .await
            .unwrap();
    assert!(after[0] > before[9]);
    // The numbers of the old pool were recorded, and the new ones come from
    // a block reserved after the reconnect.
    let discarded: Vec<(i64, i64)> = sqlx::query_as(
        "SELECT lower(seqs), upper(seqs) FROM pool_discards WHERE cause = 'redis_reconnect'",
    )
    .fetch_all(&app.db)
    .await
    .unwrap();
    assert_eq!(discarded.len(), 1, "one pool discarded: {discarded:?}");
    assert_eq!(
        discarded[0].0,
        before[9] + 1,
        "discarded from the old pool's head"
    );
    assert!(after[0] >= discarded[0].1);
    assert!(after[9] < highest_block);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_pools_drained_at_once_refill_one_at_a_time_each_within_the_cap() {
    let mut env = TestEnv::new();
    env.refill_concurrency = 4;
    let apps = Arc::new(vec![env.spawn().await, env.spawn().await]);
    // Small pools, so every request below drains its pool.
    for i in 0..1000 {
        let created = apps[0]
            .put_sequence(
                &format!("P{i}"),
                "1",
                serde_json::json!({"pool_size": 20, "refill_at": 0.5}),
            )
            .await;
        assert_eq!(created.status(), StatusCode::CREATED);
    }
    let started = Instant::now();
    let mut by_sequence: HashMap<usize, Vec<i64>> = HashMap::new();
    // Three rounds; in each, all 1000 sequences are asked at once, split
    // over the two instances.
    for round in 0..3 {
        let mut tasks = Vec::new();
        for i in 0..1000 {
            let apps = apps.clone();
            tasks.push(tokio::spawn(async move {
                let app = &apps[(i + round) % 2];
                (i, app.issue(&format!("P{i}"), "1", 20).await.1)
            }));
        }
        for task in tasks {
            let (i, seqs) = task.await.unwrap();
            by_sequence.entry(i).or_default().extend(seqs);
        }
    }
    let elapsed = started.elapsed();
    for (i, seqs) in &by_sequence {
        assert_distinct(seqs, &format!("P{i}"));
        assert_eq!(seqs.len(), 60);
    }
    // Let the refills that requests did not wait for finish.
    for app in apps.iter() {
        eventually(Duration::from_secs(30), "the refills end", async || {
            (app.metrics().await["idpool_refills_in_flight"] == 0.0).then_some(())
        })
        .await;
    }
    // Per pool, the refills (lock taken .. block pushed) never overlapped,
    // across both instances.
    let refills: Vec<(i64, String, chrono::DateTime<chrono::Utc>, chrono::DateTime<chrono::Utc>)> =
        sqlx::query_as(
            "SELECT sequence_id, instance_id, lock_acquired_at, pushed_at FROM blocks \
             WHERE purpose = 'pool' AND pushed_at IS NOT NULL ORDER BY sequence_id, lock_acquired_at",
        )
        .fetch_all(&apps[0].db)
        .await
        .unwrap();
    let pools_refilled = refills.chunk_by(|a, b| a.0 == b.0).count();
    assert_eq!(pools_refilled, 1000, "every drained pool was refilled");
    let mut max_in_flight_per_pool = 0;
    let mut instances = std::collections::HashSet::new();
    for pool in refills.chunk_by(|a, b| a.0 == b.0) {
        for (i, refill) in pool.iter().enumerate() {
            instances.insert(refill.1.clone());
            let overlapping = pool[..i]
                .iter()
                .filter(|earlier| earlier.3 > refill.2)
                .count();
            max_in_flight_per_pool = max_in_flight_per_pool.max(overlapping + 1);
        }
    }
    assert_eq!(
        max_in_flight_per_pool, 1,
        "two refills of one pool overlapped"
    );
    assert_eq!(instances.len(), 2, "both instances refilled pools");
    for app in apps.iter() {
        let peak = app.metrics().await["idpool_refills_in_flight_peak"];
        assert!(peak <= 4.0, "refill cap exceeded: {peak}");
        assert!(
            peak >= 2.0,
            "refills ran concurrently up to the cap: {peak}"
        );
    }
    println!(
        "3000 requests over 1000 pools in {elapsed:?}; {} refills, none overlapping per pool",
        refills.len()
    );
}

/// A line of `/proc/<pid>/status`, in KiB.
fn status_kib(pid: u32, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    status
        .lines()
        .find_map(|line| line.strip_prefix(field))
        .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or_else(|| panic!("{field} in /proc/{pid}/status"))
}

/// How much an `idpool serve` process's peak resident memory grows while
/// `POOLS` new pools of `pool_size` numbers fill at once (64 requests in
/// flight, one ID each), over what it held before, in KiB.
async fn growth_while_pools_fill(pool_size: u32) -> u64 {
    const POOLS: usize = 2000;
    let mut env = TestEnv::new();
    // Keys are beside the point here.
    env.auth = false;
    env.extra_env = vec![
        ("IDPOOL_REFILL_CONCURRENCY".to_owned(), "4".to_owned()),
        (
            "IDPOOL_MAX_SEQUENCES_PER_PROJECT".to_owned(),
            POOLS.to_string(),
        ),
    ];
    let server = crate::support::app::ServeProcess::start(&env).await;
    let client = crate::support::app::client_with_key(None);
    let base = format!("http://127.0.0.1:{}", server.port);
    let each = |calls: Vec<(reqwest::Method, String, Value)>, expected: StatusCode| {
        let (client, base) = (client.clone(), base.clone());
        async move {
            let calls = Arc::new(std::sync::Mutex::new(calls));
            let workers: Vec<_> = (0..64)
                .map(|_| {
                    let (client, base, calls) = (client.clone(), base.clone(), calls.clone());
                    tokio::spawn(async move {
                        loop {
                            let Some((method, path, body)) = calls.lock().expect("calls").pop()
                            else {
                                return;
                            };
                            let answer = client
                                .request(method, format!("{base}{path}"))
                                .json(&body)
                                .send()
                                .await
                                .expect("request");
                            assert_eq!(answer.status(), expected, "{path}");
                        }
                    })
                })
                .collect();
            for worker in workers {
                worker.await.expect("worker");
            }
        }
    };
    let fills = (0..POOLS)
        .map(|i| {
            let body = json!({"project": "FILL", "type": format!("T{i}"), "count": 1});
            (reqwest::Method::POST, "/ids".to_owned(), body)
        })
        .collect();
    let definitions = (0..POOLS)
        .map(|i| {
            let path = format!("/api/v1/sequences/FILL/T{i}");
            let body = json!({"pool_size": pool_size, "refill_at": 0.5});
            (reqwest::Method::PUT, path, body)
        })
        .collect();
    each(definitions, StatusCode::CREATED).await;
    // The same traffic first on one pool: the connections' buffers and
    // the runtime's threads are in what it held before.
    let warm_up = (0..POOLS)
        .map(|_| {
            let body = json!({"project": "WARM", "type": "1", "count": 1});
            (reqwest::Method::POST, "/ids".to_owned(), body)
        })
        .collect();
    each(warm_up, StatusCode::OK).await;

    let pid = server.child.id();
    // Writing 5 to clear_refs sets the peak (VmHWM) to what is resident now.
    std::fs::write(format!("/proc/{pid}/clear_refs"), "5").expect("clear_refs");
    let before = status_kib(pid, "VmRSS:");
    each(fills, StatusCode::OK).await;
    eventually(Duration::from_secs(60), "every pool filled", async || {
        let metrics = client
            .get(format!("{base}/metrics"))
            .send()
            .await
            .ok()?
            .text()
            .await
            .ok()?;
        let in_flight = metrics
            .lines()
            .find_map(|line| line.strip_prefix("idpool_refills_in_flight "))?;
        (in_flight.trim() == "0").then_some(())
    })
    .await;
    status_kib(pid, "VmHWM:").saturating_sub(before)
}

/// Promise 5: thousands of pools draining at once do not grow memory
/// without bound. What the herd of refills moves is numbers, and the
/// instance never holds them: 2,000 pools of 2,000 numbers each (4 million
/// numbers, 32 MB as 64-bit integers) fill at once for no more memory than
/// 2,000 pools of 20.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thousands_of_large_pools_fill_at_once_for_the_memory_of_small_ones() {
    let small = growth_while_pools_fill(20).await;
    let large = growth_while_pools_fill(2000).await;
    println!("peak memory grew {small} KiB for pools of 20, {large} KiB for pools of 2,000");
    // 4 MiB is an eighth of the numbers the large pools took.
    assert!(
        large <= small + 4096,
        "pools of 2,000 grew the peak by {large} KiB, pools of 20 by {small} KiB"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keyed_requests_for_new_sequences_are_served_while_redis_is_down() {
    let mut redis = RedisServer::start();
    let app = Arc::new(TestEnv::new().with_redis(&redis.url()).spawn().await);
    redis.kill();
    app.wait_for_mode("fallback", Duration::from_secs(5)).await;
    let started = Instant::now();
    let clients = (0..32).map(|client| {
        let app = app.clone();
        tokio::spawn(async move {
            let mut answers = Vec::new();
            for request in 0..5 {
                let response = app
                    .client
                    .post(app.url("/ids"))
                    .header("idempotency-key", format!("k-{client}-{request}"))
                    .json(&json!({"project": "NEW", "type": format!("t{client}_{request}")}))
                    .send()
                    .await
                    .unwrap();
                answers.push(response.status());
            }
            answers
        })
    });
    let all = tokio::time::timeout(Duration::from_secs(30), futures::future::join_all(clients))
        .await
        .expect("keyed requests answered within 30 s");
    let statuses: Vec<StatusCode> = all.into_iter().flat_map(|a| a.unwrap()).collect();
    assert_eq!(statuses.len(), 160);
    assert!(
        statuses.iter().all(|s| *s == StatusCode::OK),
        "{statuses:?}"
    );
    println!(
        "160 keyed requests without Redis in {:?}",
        started.elapsed()
    );
    let replay = app
        .client
        .post(app.url("/ids"))
        .header("idempotency-key", "k-3-4")
        .json(&json!({"project": "NEW", "type": "t3_4"}))
        .send()
        .await
        .unwrap();
    assert_eq!(replay.status(), StatusCode::OK);
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
}
