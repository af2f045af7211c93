//! The deployments idpool runs on, tried as an operator would, with real
//! servers of the tests' own: a Redis Cluster losing a master, a Sentinel
//! failover to a lagging replica, a Postgres failover to a standby that
//! missed commits, a hung or cut-off Redis, a Postgres restart, and an
//! instance restarted under traffic. Each row of README's failure table is
//! one of these (or a test it names).

use std::time::{Duration, Instant};

use reqwest::StatusCode;
use serde_json::Value;

use crate::support::app::{
    ServeProcess, TestApp, TestEnv, client_with_key, create_key, eventually, seqs_of, until,
};
use crate::support::redis_server::RedisServer;
use crate::support::topology::{
    MovableAddress, Partition, PostgresServer, RedisCluster, RedisSentinel, TlsRedis, postgres_dir,
};
use crate::support::traffic::{Traffic, assert_every_number_explained};

const TYPES: [&str; 6] = ["A", "B", "C", "D", "E", "F"];

/// A client's pause before it sends a refused request again.
fn pause(ms: u64) -> tokio::time::Sleep {
    tokio::time::sleep(Duration::from_millis(ms)) // a client's own pacing, not a wait for the service
}

/// Settle, reconcile, and check every type of `project`.
async fn reconcile_and_explain(app: &TestApp, project: &str, issued: &[(String, i64)]) -> i64 {
    app.settle_and_reconcile().await;
    let mut judged = 0;
    for doc_type in TYPES {
        let mine: Vec<i64> = issued
            .iter()
            .filter(|(t, _)| t == doc_type)
            .map(|(_, n)| *n)
            .collect();
        if mine.is_empty() {
            continue;
        }
        judged += assert_every_number_explained(&app.db, project, doc_type, &mine, &[]).await;
    }
    judged
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rediss_url_takes_the_pools_over_tls() {
    let tls = TlsRedis::start();
    let mut env = TestEnv::new().with_redis(&format!("rediss://127.0.0.1:{}", tls.port));
    env.auth = false;
    // The CA is trusted the way operators add theirs: the system's store
    // or SSL_CERT_FILE.
    env.extra_env.push((
        "SSL_CERT_FILE".into(),
        tls.ca().to_string_lossy().into_owned(),
    ));
    let server = ServeProcess::start(&env).await;
    let client = crate::support::app::client_with_key(None);
    let ready: Value =
        crate::support::app::get_ok(&client, &format!("http://127.0.0.1:{}/readyz", server.port))
            .await;
    assert_eq!(ready["mode"], "pool", "{ready}");
    for expected in 1..=3 {
        let response = client
            .post(format!("http://127.0.0.1:{}/ids", server.port))
            .json(&serde_json::json!({"project": "TLS", "type": "A"}))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), StatusCode::OK);
        let body: Value = response.json().await.unwrap();
        assert_eq!(body["seqs"][0], expected);
    }
    assert_eq!(
        tls.keys(&format!("{}:{{TLS:A:}}:pool", env.prefix)).len(),
        1,
        "the pool lives on the TLS server"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_cluster_spreads_pools_over_its_masters_and_outlives_losing_one() {
    let mut cluster = RedisCluster::start();
    let env = TestEnv::new().with_redis(&cluster.url());
    let a = env.spawn().await;
    let b = ServeProcess::start(&env).await;
    let bases = vec![a.address.clone(), format!("http://127.0.0.1:{}", b.port)];
    let traffic = Traffic::start(a.client.clone(), bases, "CL", &TYPES, 8);
    traffic.answers(300).await;
    let holding: Vec<usize> = cluster
        .nodes
        .iter()
        .map(|n| n.keys(&format!("{}:{{*}}:pool", env.prefix)).len())
        .collect();
    assert!(
        holding.iter().filter(|n| **n > 0).count() >= 2,
        "pools spread over the masters: {holding:?}"
    );
    // A master dies: its slots are gone, the service answers from Postgres.
    cluster.nodes[0].kill();
    traffic.answers(500).await;
    let outcome = traffic.stop().await;
    println!(
        "cluster: {} numbers, pools per master {holding:?}",
        outcome.issued.len()
    );
    assert!(
        outcome.failures.is_empty(),
        "{:?}",
        &outcome.failures[..outcome.failures.len().min(5)]
    );
    outcome.assert_distinct();
    // Back empty: its pools are lost numbers; the others judge as usual.
    // Numbers that were on their way into or back to the dead master's
    // pools (a refill's push, a give-back held until it returned) are
    // discarded for that cause; no other cause may appear.
    cluster.nodes[0].restart_with_data();
    a.wait_for_mode("pool", Duration::from_secs(15)).await;
    reconcile_and_explain(&a, "CL", &outcome.issued).await;
    assert_lost_only_as(
        &a,
        "CL",
        &[
            "untracked_loss",
            "pool_discarded(push_failed)",
            "pool_discarded(refill_lock_lost)",
            "pool_discarded(give_back_failed)",
            "pool_discarded(redis_reconnect)",
        ],
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_node_back_with_stale_lists_costs_only_its_own_pools() {
    let mut cluster = RedisCluster::start();
    let env = TestEnv::new().with_redis(&cluster.url());
    let app = env.spawn().await;
    for doc_type in TYPES {
        // A first use takes from the counter; the second fills the pool.
        app.issue("PN", doc_type, 1).await;
        app.issue("PN", doc_type, 1).await;
    }
    let pattern = format!("{}:{{*}}:pool", env.prefix);
    let before: Vec<Vec<String>> = cluster.nodes.iter().map(|n| n.keys(&pattern)).collect();
    let (stale, _) = before
        .iter()
        .enumerate()
        .max_by_key(|(_, keys)| keys.len())
        .expect("a node");
    assert!(!before[stale].is_empty());
    let old_run_id = cluster.nodes[stale].run_id();
    cluster.nodes[stale].restart_with_data();
    assert_ne!(cluster.nodes[stale].run_id(), old_run_id);
    // The node's lists came back as they were; the instance must not pop
    // from them, and must keep every other node's.
    let what = format!(
        "the {} pools of node {stale} discarded",
        before[stale].len()
    );
    let discards = eventually(Duration::from_secs(15), &what, async || {
        let discarded: Vec<String> = sqlx::query_scalar(
            "SELECT s.doc_type FROM pool_discards d JOIN sequences s ON s.id = d.sequence_id \
             WHERE d.cause = 'redis_reconnect' ORDER BY 1",
        )
        .fetch_all(&app.db)
        .await
        .unwrap();
        (discarded.len() == before[stale].len()).then_some(discarded)
    })
    .await;
    app.wait_for_mode("pool", Duration::from_secs(15)).await;
    let after: Vec<Vec<String>> = cluster.nodes.iter().map(|n| n.keys(&pattern)).collect();
    for (node, keys) in before.iter().enumerate() {
        if node != stale {
            assert_eq!(&after[node], keys, "node {node} kept its pools");
        }
    }
    println!(
        "one node back stale: {} of {} pools discarded ({discards:?})",
        discards.len(),
        before.iter().map(Vec::len).sum::<usize>()
    );
    for doc_type in TYPES {
        app.issue("PN", doc_type, 1).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sentinel_failover_to_a_lagging_replica_hands_out_no_number_twice() {
    let mut sentinel = RedisSentinel::start();
    let env = TestEnv::new().with_redis(&sentinel.url());
    let a = env.spawn().await;
    let b = ServeProcess::start(&env).await;
    let bases = vec![a.address.clone(), format!("http://127.0.0.1:{}", b.port)];
    let traffic = Traffic::start(a.client.clone(), bases, "SE", &TYPES, 8);
    traffic.answers(300).await;
    // The replica falls behind; the master refills pools it never sees.
    sentinel.replica.pause();
    let done = "idpool_refills_total{outcome=\"done\"}";
    let refills = a.metrics().await.get(done).copied().unwrap_or_default();
    // Refills follow the traffic's rate, which a loaded machine slows: a
    // safety net, not a bound.
    a.wait_for_metric_above(done, refills + 6.0, Duration::from_secs(120))
        .await;
    sentinel.master.kill();
    sentinel.replica.resume();
    let started = Instant::now();
    eventually(
        Duration::from_secs(20),
        "the sentinel fails over",
        async || (sentinel.master_port() == sentinel.replica.port).then_some(()),
    )
    .await;
    a.wait_for_mode("pool", Duration::from_secs(20)).await;
    traffic.answers(1000).await;
    let outcome = traffic.stop().await;
    println!(
        "sentinel: {} numbers, failover after {:?}",
        outcome.issued.len(),
        started.elapsed()
    );
    assert!(
        outcome.failures.is_empty(),
        "{:?}",
        &outcome.failures[..outcome.failures.len().min(5)]
    );
    outcome.assert_distinct();
    reconcile_and_explain(&a, "SE", &outcome.issued).await;
    // The replica's lists were filled by the old master: emptied on the
    // new one and recorded, and what was judged of them never handed out
    // is pool_discarded.
    let discarded: Vec<(String, i64, i64)> = sqlx::query_as(
        "SELECT s.doc_type, lower(d.seqs), upper(d.seqs) FROM pool_discards d \
         JOIN sequences s ON s.id = d.sequence_id \
         WHERE s.project = 'SE' AND d.cause = 'redis_reconnect'",
    )
    .fetch_all(&a.db)
    .await
    .unwrap();
    assert!(
        !discarded.is_empty(),
        "the old master's pools were not emptied"
    );
    let issued: std::collections::HashSet<(String, i64)> = outcome.issued.iter().cloned().collect();
    for doc_type in TYPES {
        let mut reason_of = std::collections::HashMap::new();
        for gap in a.gaps("SE", doc_type).await {
            for n in gap["from_seq"].as_i64().unwrap()..=gap["to_seq"].as_i64().unwrap() {
                reason_of.insert(n, gap["reason"].as_str().unwrap_or("?").to_owned());
            }
        }
        for (_, from, to) in discarded.iter().filter(|(t, _, _)| t == doc_type) {
            for n in *from..*to {
                if let (false, Some(reason)) = (
                    issued.contains(&(doc_type.to_owned(), n)),
                    reason_of.get(&n),
                ) {
                    assert_eq!(reason, "pool_discarded", "SE/{doc_type} {n}");
                }
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_postgres_failover_to_a_standby_that_missed_commits_hands_out_no_number_twice() {
    postgres_failover(AfterFailover::Restarted).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_following_its_postgres_address_to_a_lagging_standby_hands_out_no_number_twice()
{
    postgres_failover(AfterFailover::Followed).await;
}

enum AfterFailover {
    /// idpool is started again, pointed at the promoted standby.
    Restarted,
    /// The same idpool goes on; its Postgres address moves to the standby.
    Followed,
}

/// A primary with a streaming standby; the standby stops receiving while
/// the primary commits 1,000 more numbers (and the refills behind them),
/// then the primary crashes and the standby is promoted.
async fn postgres_failover(after_failover: AfterFailover) {
    let dir = postgres_dir();
    let mut primary = PostgresServer::primary(dir.path());
    let mut standby = PostgresServer::standby_of(&primary, dir.path());
    let address = MovableAddress::start(primary.port).await;
    let redis = RedisServer::start();
    let mut env = TestEnv::new().with_redis(&redis.url());
    env.database_url = format!(
        "postgres://postgres@127.0.0.1:{}/idpool_failover",
        address.port
    );
    env.auth = false;
    env.request_timeout_s = 2;
    let client = crate::support::app::client_with_key(None);
    // Numbers of `n` requests of 10; a 503 (Postgres away, or its counters
    // being fenced) is sent again, as a client would.
    let issue = async |port: u16, n: usize| -> Vec<i64> {
        let mut seqs = Vec::new();
        let started = Instant::now();
        while seqs.len() < n * 10 {
            let response = client
                .post(format!("http://127.0.0.1:{port}/ids"))
                .json(&serde_json::json!({"project": "FO", "type": "A", "count": 10}))
                .send()
                .await
                .unwrap();
            if response.status() == StatusCode::SERVICE_UNAVAILABLE {
                // What SPEC tells a client to send again: a 503 with Retry-After.
                assert_eq!(
                    response.headers().get("retry-after").map(|v| v.as_bytes()),
                    Some(&b"1"[..]),
                    "a 503 says when to retry"
                );
                assert!(started.elapsed() < Duration::from_secs(30), "503 for 30 s");
                pause(50).await;
                continue;
            }
            assert_eq!(response.status(), StatusCode::OK);
            let body: Value = response.json().await.unwrap();
            seqs.extend(seqs_of(&body));
        }
        seqs
    };
    let mut first = ServeProcess::start(&env).await;
    let mut before = issue(first.port, 50).await;
    // Handouts from a lease are reported within a few report intervals
    // (20 ms): the standby gets those of the first 500 numbers too.
    let recorded = sqlx::PgPool::connect(&env.database_url).await.unwrap();
    eventually(
        Duration::from_secs(10),
        "the first 500 numbers recorded",
        async || {
            let numbers: i64 = sqlx::query_scalar(
                "SELECT coalesce(sum(upper(seqs) - lower(seqs)), 0)::bigint FROM \
             (SELECT seqs FROM issuance_ledger WHERE via <> 'lease' \
              UNION ALL SELECT seqs FROM lease_handouts) recorded",
            )
            .fetch_one(&recorded)
            .await
            .ok()?;
            (numbers >= before.len() as i64).then_some(())
        },
    )
    .await;
    recorded.close().await;
    primary.wait_for_standbys().await;
    standby.stop("fast");
    before.extend(issue(first.port, 100).await);
    if let AfterFailover::Restarted = after_failover {
        first.kill();
    }
    primary.stop("immediate");
    standby.start();
    standby.promote();
    address.move_to(standby.port);
    let serving = match after_failover {
        AfterFailover::Restarted => ServeProcess::start(&env).await,
        AfterFailover::Followed => first,
    };

    let after = issue(serving.port, 200).await;
    let earlier: std::collections::HashSet<i64> = before.iter().copied().collect();
    let twice: Vec<i64> = after
        .iter()
        .filter(|n| earlier.contains(n))
        .copied()
        .collect();
    assert!(
        twice.is_empty(),
        "{} numbers issued twice, e.g. {:?}",
        twice.len(),
        &twice[..twice.len().min(5)]
    );
    let db = sqlx::PgPool::connect(&env.database_url).await.unwrap();
    let fenced: i64 =
        sqlx::query_scalar("SELECT count(*) FROM blocks WHERE instance_id LIKE 'fence:%'")
            .fetch_one(&db)
            .await
            .unwrap();
    assert!(
        fenced >= 1,
        "the counter was moved past what Redis had seen"
    );
    let metrics =
        crate::support::app::metrics_at(&client, &format!("http://127.0.0.1:{}", serving.port))
            .await;
    assert!(
        metrics["idpool_fences_total"] >= 1.0,
        "the fence is counted where an operator looks"
    );
    // And said in its log, once, as the error it is (an operator's first
    // sign of a standby that missed commits).
    crate::support::app::expect_error_lines("Postgres was behind Redis");
    let said = serving.log_text();
    assert!(
        said.lines()
            .any(|l| l.contains(r#""level":"ERROR""#) && l.contains("Postgres was behind Redis")),
        "the fence is in the log:\n{said}"
    );

    // Every number, the lost ones included, is explained.
    let reconcile = async || {
        let response = client
            .post(format!(
                "http://127.0.0.1:{}/api/v1/ids/gaps/reconcile",
                serving.port
            ))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), StatusCode::OK);
    };
    reconcile().await;
    crate::support::app::wait_on_postgres_clock(&db, env.settle).await;
    reconcile().await;
    let issued: Vec<i64> = before.iter().chain(&after).copied().collect();
    // What was issued after the standby stopped, Postgres no longer knows
    // was issued: those numbers are lost, never handed out again.
    let judged = assert_every_number_explained(&db, "FO", "A", &issued, &before[500..]).await;
    // The numbers whose record went with the primary, each in a gap.
    let lost: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM UNNEST($1::bigint[]) AS n(seq) WHERE EXISTS \
         (SELECT 1 FROM id_gaps g WHERE g.resolved_at IS NULL AND n.seq BETWEEN g.from_seq AND g.to_seq)",
    )
    .bind(&before[500..])
    .fetch_one(&db)
    .await
    .unwrap();
    println!(
        "postgres failover ({}): {} before, {} after, {judged} judged, {lost} lost with the primary",
        match after_failover {
            AfterFailover::Restarted => "restarted",
            AfterFailover::Followed => "followed",
        },
        before.len(),
        after.len()
    );
    assert!(lost >= 1000, "the numbers the standby missed are gaps");
    // The pool the fence emptied is found by its cause.
    let gaps = |query: &str| {
        client
            .get(format!(
                "http://127.0.0.1:{}/api/v1/ids/gaps?project=FO&type=A&{query}",
                serving.port
            ))
            .send()
    };
    let fenced: Value = gaps("cause=postgres_behind_redis")
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let fenced = fenced["gaps"].as_array().unwrap().clone();
    // The fence empties the pools Redis still held (none, when the
    // instance had drained them into its leases).
    let discarded: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pool_discards WHERE cause = 'postgres_behind_redis'",
    )
    .fetch_one(&db)
    .await
    .unwrap();
    assert_eq!(
        fenced.is_empty(),
        discarded == 0,
        "the fenced pools' numbers are listed by cause ({discarded} discards)"
    );
    for gap in &fenced {
        assert_eq!(gap["reason"], "pool_discarded");
        assert!(
            gap["note"]
                .as_str()
                .unwrap()
                .contains("postgres_behind_redis"),
            "{gap}"
        );
    }
    assert_eq!(
        gaps("cause=nonsense").await.unwrap().status(),
        StatusCode::BAD_REQUEST
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_restarted_under_traffic_goes_on_with_the_next_number() {
    let env = TestEnv::new();
    let setup = env.spawn().await;
    let key = create_key(&setup.state, &["RS"], false).await;
    let client = client_with_key(Some(&key));
    let mut server = ServeProcess::start(&env).await;
    let mut seqs = Vec::new();
    let mut restarted = false;
    let started = Instant::now();
    let mut retried = 0;
    while seqs.len() < 120 {
        if seqs.len() == 60 && !restarted {
            server.stop();
            server = ServeProcess::start(&env).await;
            restarted = true;
        }
        let response = client
            .post(format!("http://127.0.0.1:{}/ids", server.port))
            .json(&serde_json::json!({"project": "RS", "type": "1"}))
            .send()
            .await
            .expect("an answer");
        match response.status() {
            StatusCode::OK => {
                let body: Value = response.json().await.unwrap();
                seqs.push(body["seqs"][0].as_i64().unwrap());
            }
            // What a client sends again: a 503 with Retry-After.
            StatusCode::SERVICE_UNAVAILABLE => {
                assert_eq!(response.headers()["retry-after"], "1");
                retried += 1;
                pause(50).await;
            }
            other => panic!("{other}: {}", response.text().await.unwrap_or_default()),
        }
        assert!(started.elapsed() < Duration::from_secs(60));
    }
    println!("restarted: {retried} answers 503, sent again");
    let expected: Vec<i64> = (seqs[0]..seqs[0] + 120).collect();
    assert_eq!(
        seqs, expected,
        "the numbers go on in order across the restart"
    );
    // Nothing recorded: a clean stop gives back what it held.
    setup.settle_and_reconcile().await;
    let gaps = setup.gaps("RS", "1").await;
    assert!(
        gaps.iter()
            .all(|g| g["reason"].as_str() == Some("issued_unattached")),
        "a clean restart writes nothing off: {gaps:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_cut_off_or_hung_then_back_loses_no_request_no_number_and_no_uniqueness() {
    let redis = RedisServer::start();
    let partition = Partition::start(redis.port).await;
    let mut env = TestEnv::new().with_redis(&format!("redis://127.0.0.1:{}", partition.port));
    env.redis_timeout_ms = 300;
    let app = env.spawn().await;
    let traffic = Traffic::start(
        app.client.clone(),
        vec![app.address.clone()],
        "HU",
        &TYPES,
        6,
    );
    traffic.answers(300).await;
    partition.cut();
    app.wait_for_mode("fallback", Duration::from_secs(5)).await;
    traffic.answers(300).await;
    partition.heal();
    app.wait_for_mode("pool", Duration::from_secs(15)).await;
    traffic.answers(300).await;
    redis.pause();
    app.wait_for_mode("fallback", Duration::from_secs(5)).await;
    traffic.answers(300).await;
    redis.resume();
    app.wait_for_mode("pool", Duration::from_secs(15)).await;
    traffic.answers(300).await;
    let outcome = traffic.stop().await;
    println!("cut off and hung: {} numbers", outcome.issued.len());
    assert!(
        outcome.failures.is_empty(),
        "{:?}",
        &outcome.failures[..outcome.failures.len().min(5)]
    );
    outcome.assert_distinct();
    reconcile_and_explain(&app, "HU", &outcome.issued).await;
    // The same server came back: its pools are used again, nothing emptied.
    let emptied: i64 =
        sqlx::query_scalar("SELECT count(*) FROM pool_discards WHERE cause = 'redis_reconnect'")
            .fetch_one(&app.db)
            .await
            .unwrap();
    assert_eq!(emptied, 0, "pools filled on the same server are used again");
    // A pop the hung server ran after its caller gave up took nothing (its
    // deadline), and one whose answer was lost with its connection gave
    // its numbers back: nothing is untracked_loss.
    assert_lost_only_as(&app, "HU", &[]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_postgres_restart_is_503_while_it_lasts_and_served_after() {
    let dir = postgres_dir();
    let mut postgres = PostgresServer::primary(dir.path());
    let mut env = TestEnv::new();
    env.database_url = postgres.url("idpool_restart");
    let app = env.spawn().await;
    let traffic = Traffic::start(
        app.client.clone(),
        vec![app.address.clone()],
        "PR",
        &TYPES,
        4,
    );
    traffic.answers(300).await;
    postgres.stop("fast");
    // Stopped: every request is answered (503) while it is down. Each
    // waits out the 2 s pool acquire timeout, and the writes in doubt at
    // the stop wait up to `IN_DOUBT_PATIENCE` (30 s) for Postgres to say
    // whether they landed: the outage lasts until one new request is
    // refused, so that a loaded machine still brings Postgres back well
    // within it, and they get their true answer. (Waiting for answers of
    // the traffic's clients, as this once did, waited out the patience
    // whenever every client had a write in doubt: `outcome_unknown`.) The
    // probe is keyed: its transaction needs a request connection of its
    // own, refused within the acquire timeout, where an unkeyed request
    // queues behind the shared writer while it settles what is in doubt.
    let probes = std::sync::atomic::AtomicUsize::new(0);
    let refused = eventually(
        Duration::from_secs(10),
        "a 503 while it is down",
        async || {
            let probe = probes.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let response = app
                .client
                .post(app.url("/ids"))
                .header("idempotency-key", format!("down-{probe}"))
                .json(&serde_json::json!({"project": "PR", "type": "A", "count": 1}))
                .send()
                .await
                .expect("request");
            if response.status() != StatusCode::SERVICE_UNAVAILABLE {
                return None;
            }
            let header = |name: &str| {
                response
                    .headers()
                    .get(name)
                    .and_then(|v| v.to_str().ok())
                    .map(str::to_owned)
            };
            let (retry_after, content_type) = (header("retry-after"), header("content-type"));
            let body: Value = response.json().await.unwrap();
            match body["code"].as_str() {
                Some("unavailable") => Some((retry_after, content_type, body)),
                // A request the stop met half-way, at its deadline.
                Some("timeout") => None,
                _ => panic!("an unexpected 503 while Postgres is down: {body}"),
            }
        },
    )
    .await;
    let (retry_after, content_type, body) = refused;
    assert_eq!(retry_after.as_deref(), Some("1"), "{body}");
    assert_eq!(
        content_type.as_deref(),
        Some("application/problem+json"),
        "{body}"
    );
    postgres.start();
    eventually(Duration::from_secs(20), "served again", async || {
        (app.post_ids("PR", "A", 1).await.status() == StatusCode::OK).then_some(())
    })
    .await;
    traffic.answers(300).await;
    let outcome = traffic.stop().await;
    // 503 with Retry-After: 1, `unavailable`; or `timeout` for a request
    // whose shared commit the shutdown cut: it waits for the true answer,
    // which needs Postgres back, up to the request timeout.
    let unexpected: Vec<&String> = outcome
        .failures
        .iter()
        .filter(|f| {
            !(f.starts_with("503 Service Unavailable retry-after=1 ")
                && (f.contains(r#""code":"unavailable""#) || f.contains(r#""code":"timeout""#)))
        })
        .collect();
    println!(
        "postgres restart: {} numbers, {} answered 503 while it was down",
        outcome.issued.len(),
        outcome.failures.len()
    );
    assert!(unexpected.is_empty(), "{unexpected:?}");
    outcome.assert_distinct();
    // Leases whose return Postgres could not take while it was down are
    // tried again: written by now.
    app.state.issuer.lease_returns_written().await;
    // Every number explained; what a 40-second outage wrote off (numbers
    // in flight whose record or return could not be written) is named.
    reconcile_and_explain(&app, "PR", &outcome.issued).await;
    println!(
        "postgres restart: lost as {:?}",
        lost_by_reason(&app, "PR").await
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_only_primary_is_503_and_not_ready_and_the_next_primary_is_found_at_its_address() {
    let dir = postgres_dir();
    let primary = PostgresServer::primary(dir.path());
    let mut standby = PostgresServer::standby_of(&primary, dir.path());
    let address = MovableAddress::start(primary.port).await;
    let mut env = TestEnv::new();
    env.database_url = format!("postgres://postgres@127.0.0.1:{}/idpool_ro", address.port);
    let app = env.spawn().await;
    let document = serde_json::json!({"project": "RO", "type": "A", "metadata": {}});
    // Keyed documents are written on request connections: several open.
    let keyed = |n: usize| {
        let document = &document;
        let app = &app;
        async move {
            let key = format!("ro-{n}");
            app.post_document(document, Some(&key)).await.status()
        }
    };
    let warm = futures::future::join_all((0..8).map(keyed)).await;
    assert!(warm.iter().all(|s| *s == StatusCode::ACCEPTED), "{warm:?}");
    let ready = async || {
        let response = app.client.get(app.url("/readyz")).send().await.unwrap();
        (response.status(), response.json::<Value>().await.unwrap())
    };
    assert_eq!(ready().await.0, StatusCode::OK);

    // The primary is demoted in place: it answers, and takes no writes.
    crate::support::app::expect_error_lines("read-only transaction");
    let direct = sqlx::PgPool::connect(&primary.url("postgres"))
        .await
        .unwrap();
    for statement in [
        "ALTER SYSTEM SET default_transaction_read_only = on",
        "SELECT pg_reload_conf()",
    ] {
        sqlx::query(statement).execute(&direct).await.unwrap();
    }
    until(
        Duration::from_secs(10),
        "readyz says read_only",
        async || {
            let (status, body) = ready().await;
            status == StatusCode::SERVICE_UNAVAILABLE && body["postgres"] == "read_only"
        },
    )
    .await;
    for n in 0..20 {
        let key = (n % 2 == 0).then(|| format!("ro-read-only-{n}"));
        let response = app.post_document(&document, key.as_deref()).await;
        assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(response.headers()["retry-after"], "1");
        let problem: Value = response.json().await.unwrap();
        assert_eq!(problem["code"], "unavailable");
    }
    assert_eq!(
        app.outbox_count(None).await,
        8,
        "nothing written while read-only"
    );

    // The standby takes over the address; the connections open to the old
    // primary stay open, as through a proxy that does not end them.
    primary.wait_for_standbys().await;
    standby.promote();
    address.redirect(standby.port);
    let mut attempt = 100;
    until(
        Duration::from_secs(15),
        "documents written again",
        async || {
            attempt += 1;
            let status = keyed(attempt).await;
            assert!(
                status == StatusCode::ACCEPTED || status == StatusCode::SERVICE_UNAVAILABLE,
                "{status}"
            );
            status == StatusCode::ACCEPTED
        },
    )
    .await;
    // The first refusal from the old primary closes every connection
    // opened before it: no request meets the old primary again. (Kept
    // open, each pooled connection would fail in turn, for minutes.)
    assert!(
        attempt <= 103,
        "{} refusals after the failover",
        attempt - 101
    );
    until(Duration::from_secs(10), "ready again", async || {
        ready().await.0 == StatusCode::OK
    })
    .await;
    standby.stop("fast");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_pointed_at_a_standby_is_not_ready_and_logs_quietly() {
    let dir = postgres_dir();
    let primary = PostgresServer::primary(dir.path());
    let mut standby = PostgresServer::standby_of(&primary, dir.path());
    let mut env = TestEnv::new();
    env.database_url = primary.url("idpool_standby");
    // The schema exists (made on the primary, streamed to the standby).
    drop(env.spawn().await);
    primary.wait_for_standbys().await;
    env.database_url = standby.url("idpool_standby");
    env.auth = false;
    env.extra_env
        .push(("IDPOOL_MIGRATE".to_owned(), "off".to_owned()));
    // A standby refuses writes: the errors of Postgres trouble are logged.
    crate::support::app::expect_postgres_trouble();
    let log = dir.path().join("idpool-on-standby.log");
    let instance = ServeProcess::start_unready(&env, &log, "warn").await;
    let client = client_with_key(None);
    let readyz = format!("http://127.0.0.1:{}/readyz", instance.port);
    let response = client.get(&readyz).send().await.unwrap();
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["postgres"], "read_only");
    // Observed for 3 s while clients keep trying: every background retry
    // fails at once on a standby.
    let observed = Instant::now();
    while observed.elapsed() < Duration::from_secs(3) {
        let answer = client
            .post(format!("http://127.0.0.1:{}/ids", instance.port))
            .json(&serde_json::json!({"project": "SB", "type": "A"}))
            .send()
            .await
            .unwrap();
        assert_eq!(answer.status(), StatusCode::SERVICE_UNAVAILABLE);
        pause(20).await;
    }
    drop(instance);
    let text = std::fs::read_to_string(&log).unwrap();
    let busiest = crate::support::app::busiest_warning_second(&text).map_or(0, |(_, n, _)| n);
    assert!(
        busiest <= 20,
        "{busiest} warning lines in one second:\n{text}"
    );
    let warnings = text
        .lines()
        .filter(|l| l.contains("WARN") || l.contains("ERROR"))
        .count();
    assert!(warnings <= 20, "{warnings} warning lines in 3 s:\n{text}");
    standby.stop("fast");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_started_on_a_standby_waits_not_ready_then_migrates_and_serves_once_it_is_promoted()
 {
    let dir = postgres_dir();
    let primary = PostgresServer::primary(dir.path());
    let mut standby = PostgresServer::standby_of(&primary, dir.path());
    let direct = sqlx::PgPool::connect(&primary.url("postgres"))
        .await
        .unwrap();
    // The database exists, with no schema yet: the instance must migrate.
    // (Made after the base backup, which would otherwise wait for a
    // spread checkpoint of it.)
    sqlx::query("CREATE DATABASE idpool_late")
        .execute(&direct)
        .await
        .unwrap();
    primary.wait_for_standbys().await;
    let mut env = TestEnv::new();
    env.database_url = standby.url("idpool_late");
    env.auth = false;
    let log = dir.path().join("idpool-started-on-standby.log");
    let instance = ServeProcess::start_unready(&env, &log, "warn").await;
    let base = format!("http://127.0.0.1:{}", instance.port);
    let client = client_with_key(None);
    let response = client.get(format!("{base}/readyz")).send().await.unwrap();
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["postgres"], "read_only");
    // Alive while not ready; every other route refused, with Retry-After.
    let health = client.get(format!("{base}/healthz")).send().await.unwrap();
    assert_eq!(health.status(), StatusCode::OK, "alive while not ready");
    let other = client
        .get(format!("{base}/api/v1/ids/gaps?project=LT&type=A"))
        .send()
        .await
        .unwrap();
    assert_eq!(other.headers()["retry-after"], "1");
    crate::support::app::assert_problem(other, StatusCode::SERVICE_UNAVAILABLE, "unavailable")
        .await;
    let ids = || {
        client
            .post(format!("{base}/ids"))
            .json(&serde_json::json!({"project": "LT", "type": "A", "count": 2}))
            .send()
    };
    let waiting = ids().await.unwrap();
    assert_eq!(waiting.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(waiting.headers()["retry-after"], "1");

    standby.promote();
    until(Duration::from_secs(30), "migrated and ready", async || {
        let answer = client.get(format!("{base}/readyz")).send().await;
        answer.is_ok_and(|a| a.status() == StatusCode::OK)
    })
    .await;
    let served = ids().await.unwrap();
    assert_eq!(served.status(), StatusCode::OK);
    let body: Value = served.json().await.unwrap();
    assert_eq!(seqs_of(&body), vec![1, 2]);
    standby.stop("fast");
}

/// Asserts that `project`'s gaps hold no reason but `allowed` (and
/// `issued_unattached`, numbers answered and never attached). A
/// `pool_discarded` gap is allowed by its cause, `pool_discarded(cause)`.
async fn assert_lost_only_as(app: &TestApp, project: &str, allowed: &[&str]) {
    let lost = lost_by_reason(app, project).await;
    let allows = |reason: &str| {
        reason == "issued_unattached"
            || allowed.contains(&reason)
            || reason
                .strip_prefix("pool_discarded(")
                .and_then(|causes| causes.strip_suffix(')'))
                .is_some_and(|causes| {
                    causes
                        .split(',')
                        .all(|c| allowed.contains(&format!("pool_discarded({c})").as_str()))
                })
    };
    assert!(
        lost.keys().all(|r| allows(r)),
        "{project}: lost as {lost:?}, only {allowed:?} expected"
    );
}

/// Numbers of `project`'s gaps by reason, over every type; a
/// `pool_discarded` gap by its cause too, as `pool_discarded(cause)`, so
/// that a failure says why a pool lost numbers.
async fn lost_by_reason(app: &TestApp, project: &str) -> std::collections::BTreeMap<String, i64> {
    let mut lost = std::collections::BTreeMap::new();
    for doc_type in TYPES {
        for gap in app.gaps(project, doc_type).await {
            let mut reason = gap["reason"].as_str().unwrap_or("?").to_owned();
            if let Some(cause) = gap["note"].as_str().filter(|_| reason == "pool_discarded") {
                reason = format!("{reason}({cause})");
            }
            *lost.entry(reason).or_default() += gap["count"].as_i64().unwrap_or(0);
        }
    }
    lost
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_postgres_crash_under_traffic_costs_no_number() {
    let dir = postgres_dir();
    let mut postgres = PostgresServer::primary(dir.path());
    let mut env = TestEnv::new();
    env.database_url = postgres.url("idpool_crash");
    let app = env.spawn().await;
    let traffic = Traffic::start(
        app.client.clone(),
        vec![app.address.clone()],
        "PK",
        &TYPES,
        6,
    );
    let documents = DocumentTraffic::start(&app, "PK", 2);
    // Under load: commits in flight when Postgres goes.
    let commits = "idpool_ledger_batches_total";
    app.wait_for_metric_above(commits, 200.0, Duration::from_secs(20))
        .await;
    // Killed mid-commit: the postmaster and its backends end at once.
    postgres.stop("immediate");
    postgres.start();
    until(Duration::from_secs(20), "served again", async || {
        app.post_ids("PK", "A", 1).await.status() == StatusCode::OK
    })
    .await;
    let after = app
        .metrics()
        .await
        .get(commits)
        .copied()
        .unwrap_or_default();
    app.wait_for_metric_above(commits, after + 200.0, Duration::from_secs(20))
        .await;
    let outcome = traffic.stop().await;
    let accepted = documents.stop().await;
    // While it is down: 503 unavailable with Retry-After: 1, nothing else.
    let unexpected: Vec<&String> = outcome
        .failures
        .iter()
        .chain(&accepted.failures)
        .filter(|f| {
            !(f.starts_with("503 Service Unavailable retry-after=1 ")
                && f.contains(r#""code":"unavailable""#))
        })
        .collect();
    assert!(unexpected.is_empty(), "{unexpected:?}");
    outcome.assert_distinct();
    let stored: i64 =
        sqlx::query_scalar("SELECT count(*) FROM id_outbox WHERE document_id = ANY($1)")
            .bind(&accepted.ids)
            .fetch_one(&app.db)
            .await
            .expect("outbox");
    assert_eq!(
        stored,
        accepted.ids.len() as i64,
        "documents answered 202 but not stored"
    );
    reconcile_and_explain(&app, "PK", &outcome.issued).await;
    let lost = lost_by_reason(&app, "PK").await;
    println!(
        "postgres crash: {} numbers and {} documents served, {} answered 503, \
         {} writes in doubt settled, gaps {lost:?}",
        outcome.issued.len(),
        accepted.ids.len(),
        outcome.failures.len() + accepted.failures.len(),
        app.metrics()
            .await
            .get("idpool_in_doubt_settled_total")
            .copied()
            .unwrap_or_default()
    );
    let written_off: i64 = lost
        .iter()
        .filter(|(reason, _)| {
            ["untracked_loss", "lease_lost"].contains(&reason.as_str())
                || reason.starts_with("pool_discarded")
        })
        .map(|(_, count)| count)
        .sum();
    assert_eq!(written_off, 0, "numbers written off at a crash: {lost:?}");
}

/// Loops of `POST /documents` (type A of `project`), keeping the ID of
/// every document answered 202.
struct DocumentTraffic {
    running: std::sync::Arc<std::sync::atomic::AtomicBool>,
    workers: Vec<tokio::task::JoinHandle<Accepted>>,
}

#[derive(Default)]
struct Accepted {
    ids: Vec<String>,
    failures: Vec<String>,
}

impl DocumentTraffic {
    fn start(app: &TestApp, project: &str, workers: usize) -> Self {
        use std::sync::atomic::{AtomicBool, Ordering};
        let running = std::sync::Arc::new(AtomicBool::new(true));
        let workers = (0..workers)
            .map(|w| {
                let (client, url, running) =
                    (app.client.clone(), app.url("/documents"), running.clone());
                let project = project.to_owned();
                tokio::spawn(async move {
                    let mut out = Accepted::default();
                    let mut n = 0;
                    while running.load(Ordering::Relaxed) {
                        n += 1;
                        let body = serde_json::json!({
                            "project": project, "type": "A", "metadata": {"worker": w, "n": n}
                        });
                        match client.post(&url).json(&body).send().await {
                            Ok(r) if r.status() == StatusCode::ACCEPTED => {
                                let body: Value = r.json().await.unwrap_or(Value::Null);
                                out.ids.push(body["id"].as_str().unwrap_or("?").to_owned());
                            }
                            Ok(r) => out.failures.push(crate::support::traffic::failure(r).await),
                            Err(e) => out.failures.push(e.to_string()),
                        }
                    }
                    out
                })
            })
            .collect();
        Self { running, workers }
    }

    async fn stop(self) -> Accepted {
        self.running
            .store(false, std::sync::atomic::Ordering::Relaxed);
        let mut all = Accepted::default();
        for worker in self.workers {
            let out = worker.await.expect("worker");
            all.ids.extend(out.ids);
            all.failures.extend(out.failures);
        }
        all
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_turned_replica_is_left_out_of_use_quietly_and_taken_back_once_writable() {
    let redis = RedisServer::start();
    let mut env = TestEnv::new();
    env.redis_url = redis.url();
    env.auth = false;
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("idpool.log");
    let instance = ServeProcess::start_logging(&env, &log, "warn").await;
    let base = format!("http://127.0.0.1:{}", instance.port);
    let client = client_with_key(None);
    let mode = async || {
        let ready: Value = client
            .get(format!("{base}/readyz"))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        ready["mode"].as_str().unwrap_or_default().to_owned()
    };
    assert_eq!(mode().await, "pool");
    // A master demoted (a Sentinel failover, an operator's REPLICAOF): it
    // still answers PING and reads, but refuses every write.
    crate::support::app::expect_redis_trouble();
    redis.cli(&["REPLICAOF", "127.0.0.1", "1"]);
    let observed = Instant::now();
    let mut served = 0;
    while observed.elapsed() < Duration::from_secs(3) {
        let answer = client
            .post(format!("{base}/ids"))
            .json(&serde_json::json!({"project": "RO", "type": "A"}))
            .send()
            .await
            .unwrap();
        assert_eq!(answer.status(), StatusCode::OK, "served from Postgres");
        served += 1;
    }
    assert_eq!(mode().await, "fallback", "not back in use while read-only");
    redis.cli(&["REPLICAOF", "NO", "ONE"]);
    until(Duration::from_secs(10), "pools in use again", async || {
        mode().await == "pool"
    })
    .await;
    drop(instance);
    let text = std::fs::read_to_string(&log).unwrap();
    let (second, busiest, said) =
        crate::support::app::busiest_warning_second(&text).unwrap_or_default();
    println!("{served} served; busiest second {second}: {busiest} lines {said:?}");
    assert!(
        busiest <= 20,
        "{busiest} warning lines in one second:\n{text}"
    );
    // Nothing recorded: the pools were checked with a write and kept.
    let db = sqlx::PgPool::connect(&env.database_url).await.unwrap();
    let discards: i64 = sqlx::query_scalar("SELECT count(*) FROM pool_discards")
        .fetch_one(&db)
        .await
        .unwrap();
    assert_eq!(discards, 0, "the pools were kept");
}

/// SPEC: every retry loop backs off exponentially (about 100 ms up to
/// 10 s) and starts again from the floor once it succeeds. Counted in
/// connections an idle instance on the defaults attempts while Postgres
/// turns every one away: the second four seconds see at most half the
/// attempts of the first four (loops retrying at a steady pace would see
/// as many). Once Postgres takes connections again the instance is ready,
/// and a second refusal is retried at the floor's pace again: its first two
/// seconds see more attempts than the last two of the first refusal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn while_postgres_refuses_connections_retries_thin_out_and_start_again_once_it_answers() {
    use crate::support::gate::Gate;
    let mut env = TestEnv::new();
    // The in-process app creates and migrates the database.
    let _setup = env.spawn().await;
    let gate = Gate::start("127.0.0.1:5432").await;
    env.database_url = gate.url_for(&env.database_url);
    let instance = ServeProcess::start_on_defaults(&env, &[]).await;
    let ready = || async {
        let answer = client_with_key(None)
            .get(format!("http://127.0.0.1:{}/readyz", instance.port))
            .send()
            .await;
        answer.is_ok_and(|a| a.status() == StatusCode::OK)
    };
    // A window of the refusal: the test counts what the instance attempts
    // in it, so it lasts its length whatever happens.
    let window = |seconds: u64| tokio::time::sleep(Duration::from_secs(seconds)); // a measuring window, not a wait for the service

    gate.shut();
    let shut = Instant::now();
    window(8).await;
    let first = gate.attempts_between(shut, shut + Duration::from_secs(4));
    let second =
        gate.attempts_between(shut + Duration::from_secs(4), shut + Duration::from_secs(8));
    let last_two =
        gate.attempts_between(shut + Duration::from_secs(6), shut + Duration::from_secs(8));
    assert!(
        first >= 4,
        "only {first} attempts in the first 4 s: the test saw no retrying"
    );
    assert!(
        second * 2 <= first,
        "attempts did not thin out: {first} in the first 4 s, {second} in the next 4 s"
    );

    gate.open();
    until(
        Duration::from_secs(30),
        "the instance is ready again",
        ready,
    )
    .await;
    // Every loop that failed has succeeded since: each trouble it warned
    // of is logged as over.
    let troubles = |log: &str| -> (Vec<String>, Vec<String>) {
        let lines: Vec<Value> = log
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect();
        let said = |level: &str| -> Vec<String> {
            lines
                .iter()
                .filter(|l| l["level"] == level)
                .filter_map(|l| l["message"].as_str())
                .map(|m| m.split(" (again;").next().unwrap_or(m).to_owned())
                .collect()
        };
        let over = said("INFO")
            .into_iter()
            .filter_map(|m| m.strip_suffix(": over").map(str::to_owned))
            .collect();
        (said("WARN"), over)
    };
    until(
        Duration::from_secs(40),
        "every failed loop has succeeded again",
        async || {
            let (started, over) = troubles(&instance.log_text());
            !started.is_empty() && started.iter().all(|t| over.contains(t))
        },
    )
    .await;
    gate.shut();
    let again = Instant::now();
    window(2).await;
    let restarted = gate.attempts_between(again, again + Duration::from_secs(2));
    assert!(
        restarted > last_two,
        "retries did not start again from the floor: {restarted} attempts in the first 2 s \
         of the second refusal, {last_two} in the last 2 s of the first"
    );
    gate.open();
    until(
        Duration::from_secs(30),
        "the instance is ready at the end",
        ready,
    )
    .await;
    drop(instance);
}
