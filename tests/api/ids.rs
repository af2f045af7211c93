//! POST /ids: distinct, ascending, formatted, across instances.

use crate::support::probes::*;
use serde_json::Value;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use chrono::{DateTime, Duration, Utc};
use idpool::domain::clock::{ManualClock, SystemClock};
use idpool::records::pool::PoolSettings;
use reqwest::StatusCode;
use serde_json::json;
use tokio::sync::Barrier;

use crate::support::app::{TestEnv, assert_distinct, assert_problem, ledger_numbers};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hundred_requests_released_at_once_get_hundred_distinct_ids() {
    let app = Arc::new(TestEnv::new().spawn().await);
    let barrier = Arc::new(Barrier::new(100));
    let mut tasks = Vec::new();
    for _ in 0..100 {
        let app = app.clone();
        let barrier = barrier.clone();
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            app.issue("PROJ", "9012", 1).await
        }));
    }
    let mut ids = Vec::new();
    let mut seqs = Vec::new();
    for task in tasks {
        let (i, s) = task.await.unwrap();
        ids.extend(i);
        seqs.extend(s);
    }
    assert_eq!(ids.len(), 100);
    let distinct: std::collections::HashSet<_> = ids.iter().collect();
    assert_eq!(distinct.len(), 100, "duplicate IDs");
    for (id, seq) in ids.iter().zip(&seqs) {
        assert_eq!(id, &format!("PROJ-9012-{seq}"));
    }
    // Every number handed out is in the ledger, and nothing else is.
    let mut ledgered = ledger_numbers(&app.db, "PROJ", "9012", "").await;
    ledgered.sort_unstable();
    seqs.sort_unstable();
    assert_eq!(ledgered, seqs);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_of_10000_is_distinct_ascending_and_formatted() {
    // A request bigger than the pool waits for the refill it needs, and
    // the next request continues above it: when that refill arrives within
    // the wait. Under a loaded machine it may not within the default 250 ms
    // (the rest then comes from the counter, above the refill's block), so
    // this test gives the wait room rather than racing it.
    let settings = PoolSettings {
        short_wait: std::time::Duration::from_secs(60),
        ..PoolSettings::default()
    };
    let app = TestEnv::new()
        .spawn_with(Arc::new(SystemClock), settings)
        .await;
    let (ids, seqs) = app.issue("BIG", "7", 10_000).await;
    assert_eq!(ids.len(), 10_000);
    assert!(
        seqs.windows(2).all(|w| w[0] < w[1]),
        "seqs not strictly ascending"
    );
    for (id, seq) in ids.iter().zip(&seqs) {
        assert_eq!(id, &format!("BIG-7-{seq}"));
    }
    // A second batch continues above the first.
    let (_, more) = app.issue("BIG", "7", 10_000).await;
    assert!(more[0] > seqs[9_999]);
    let mut all = seqs.clone();
    all.extend(&more);
    assert_distinct(&all, "two batches");
}

/// One observed request: when it was sent and answered, what it got.
struct Observed {
    instance: usize,
    sent: Instant,
    received: Instant,
    seq: i64,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_instances_issue_30000_ids_over_3_sequences_without_duplicates_in_order() {
    let env = TestEnv::new();
    let apps = Arc::new(vec![
        env.spawn().await,
        env.spawn().await,
        env.spawn().await,
    ]);
    let sequences = ["SEQA", "SEQB", "SEQC"];
    let workers_per_sequence = 20;
    let per_worker = 10_000 / workers_per_sequence;
    let mut tasks = Vec::new();
    for (s, sequence) in sequences.iter().enumerate() {
        for w in 0..workers_per_sequence {
            let apps = apps.clone();
            let sequence = sequence.to_string();
            tasks.push(tokio::spawn(async move {
                let mut seen = Vec::with_capacity(per_worker);
                for i in 0..per_worker {
                    let instance = (s + w + i) % apps.len();
                    let app = &apps[instance];
                    let sent = Instant::now();
                    let (ids, seqs) = app.issue(&sequence, "1", 1).await;
                    let received = Instant::now();
                    assert_eq!(ids[0], format!("{sequence}-1-{}", seqs[0]));
                    seen.push(Observed {
                        instance,
                        sent,
                        received,
                        seq: seqs[0],
                    });
                }
                (sequence, seen)
            }));
        }
    }
    let mut by_sequence: HashMap<String, Vec<Observed>> = HashMap::new();
    for task in tasks {
        let (sequence, seen) = task.await.unwrap();
        by_sequence.entry(sequence).or_default().extend(seen);
    }
    let mut total = 0;
    // Answers below a number the instance had answered before they were
    // asked for: (sequence, instance, number, highest answered before).
    let mut late = Vec::new();
    for (sequence, mut observed) in by_sequence {
        total += observed.len();
        let seqs: Vec<i64> = observed.iter().map(|o| o.seq).collect();
        assert_distinct(&seqs, &sequence);
        // Issue order on each instance: a request sent after another was
        // answered by the same instance gets a higher number, but for
        // numbers a lease gave back (unused within its time) to the head
        // of the pool, which go out next to whichever instance asks.
        // (Across instances each serves from its own lease at this rate.)
        // Sweep requests by send time, tracking the highest number among
        // those already answered.
        observed.sort_by_key(|o| o.sent);
        for instance in 0..apps.len() {
            let mine: Vec<&Observed> = observed.iter().filter(|o| o.instance == instance).collect();
            let mut answered = mine.clone();
            answered.sort_by_key(|o| o.received);
            let mut highest_answered = i64::MIN;
            let mut next = 0;
            for request in &mine {
                while next < answered.len() && answered[next].received < request.sent {
                    highest_answered = highest_answered.max(answered[next].seq);
                    next += 1;
                }
                if request.seq < highest_answered {
                    late.push((sequence.clone(), instance, request.seq, highest_answered));
                }
            }
        }
        // All three instances' numbers are in the one ledger.
        let ledgered = ledger_numbers(&apps[0].db, &sequence, "1", "").await;
        assert_eq!(ledgered.len(), seqs.len());
    }
    assert_eq!(total, 30_000);
    let mut given_back = 0.0;
    for app in apps.iter() {
        given_back += app
            .metrics()
            .await
            .get("idpool_lease_numbers_returned_total")
            .copied()
            .unwrap_or_default();
    }
    assert!(
        late.len() as f64 <= given_back,
        "{} answers below a number their instance had answered, {given_back} numbers given back by leases: {:?}",
        late.len(),
        &late[..late.len().min(20)]
    );
    // Every ID came from a pool while Redis was up but first uses: a
    // sequence's first request an instance sees takes its number straight
    // from the counter (the pool is filled once it is asked again), so at
    // most one per sequence and instance. (Leases count what they take, so
    // the pools gave at least the rest.)
    let (mut from_pool, mut direct) = (0.0, 0.0);
    for app in apps.iter() {
        let metrics = app.metrics().await;
        from_pool += metrics["idpool_ids_issued_total{source=\"pool\"}"];
        direct += metrics
            .get("idpool_ids_issued_total{source=\"direct\"}")
            .copied()
            .unwrap_or_default();
    }
    let first_uses = (sequences.len() * apps.len()) as f64;
    assert!(
        direct <= first_uses,
        "{direct} IDs taken straight from the counter"
    );
    assert!(from_pool >= 30_000.0 - direct, "{from_pool} from pools");
}

fn at(s: &str) -> DateTime<Utc> {
    DateTime::parse_from_rfc3339(s).unwrap().with_timezone(&Utc)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_daily_sequence_restarts_each_day_and_refuses_the_10000th_number() {
    let clock = Arc::new(ManualClock::new(at("2026-11-22T09:00:00Z")));
    let app = TestEnv::new().spawn_with_clock(clock.clone()).await;
    let created = app
        .put_sequence(
            "SHOP",
            "IS",
            json!({"format": "{type}{date:%Y%m%d}{seq:4}", "reset": "daily", "max": 9999}),
        )
        .await;
    assert_eq!(created.status(), StatusCode::CREATED);

    let (first, _) = app.issue("SHOP", "IS", 1).await;
    assert_eq!(first, vec!["IS202611220001"]);
    let (rest, seqs) = app.issue("SHOP", "IS", 9_998).await;
    assert_eq!(rest.last().unwrap(), "IS202611229999");
    assert_eq!(seqs.len(), 9_998);
    let refused = app.post_ids("SHOP", "IS", 1).await;
    let problem = assert_problem(refused, StatusCode::CONFLICT, "sequence_exhausted").await;
    assert!(problem["detail"].as_str().unwrap().contains("20261122"));

    // Midnight: a new period, counting from start again.
    clock.set(at("2026-11-23T00:00:00Z"));
    let (next_day, _) = app.issue("SHOP", "IS", 2).await;
    assert_eq!(next_day, vec!["IS202611230001", "IS202611230002"]);
    assert_eq!(
        ledger_numbers(&app.db, "SHOP", "IS", "20261122")
            .await
            .len(),
        9_999
    );

    // The day before is still exhausted, not wrapped.
    clock.set(at("2026-11-22T23:59:59Z"));
    assert_problem(
        app.post_ids("SHOP", "IS", 1).await,
        StatusCode::CONFLICT,
        "sequence_exhausted",
    )
    .await;
    clock.advance(Duration::seconds(1));
    let (later, _) = app.issue("SHOP", "IS", 1).await;
    assert_eq!(later, vec!["IS202611230003"]);
}

/// A request for more numbers than a sequence has left is refused and
/// takes none: the numbers left are still there for a smaller request, and
/// none of them is reported as handed out (promise 11, `max`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_past_max_takes_nothing_and_the_numbers_left_are_still_issued() {
    let app = TestEnv::new().spawn().await;
    let created = app.put_sequence("LAST", "M", json!({"max": 5})).await;
    assert_eq!(created.status(), StatusCode::CREATED);
    let (_, first) = app.issue("LAST", "M", 3).await;
    assert_eq!(first, [1, 2, 3]);
    for count in [3, 3] {
        let refused = app.post_ids("LAST", "M", count).await;
        assert_problem(refused, StatusCode::CONFLICT, "sequence_exhausted").await;
    }
    let (_, left) = app.issue("LAST", "M", 2).await;
    assert_eq!(left, [4, 5], "the numbers a refused request left");
    assert_problem(
        app.post_ids("LAST", "M", 1).await,
        StatusCode::CONFLICT,
        "sequence_exhausted",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_int64_layout_returns_numbers_and_decimal_strings() {
    let clock = Arc::new(ManualClock::new(at("2026-11-22T09:30:00Z")));
    let app = TestEnv::new().spawn_with_clock(clock).await;
    let created = app
        .put_sequence("SHOP", "coupon", json!({"layout": "int64"}))
        .await;
    assert_eq!(created.status(), StatusCode::CREATED);
    let (ids, seqs) = app.issue("SHOP", "coupon", 3).await;
    let day_seconds = at("2026-11-22T00:00:00Z").timestamp() - 1_640_995_200;
    assert_eq!(
        seqs,
        vec![
            (day_seconds << 32) | 1,
            (day_seconds << 32) | 2,
            (day_seconds << 32) | 3
        ]
    );
    assert_eq!(ids, seqs.iter().map(i64::to_string).collect::<Vec<_>>());
    let view = app.ok_json("/api/v1/sequences/SHOP/coupon").await;
    assert_eq!(view["layout"], "int64");
    assert_eq!(view["reset"], "daily");
    assert_eq!(view["max"], serde_json::Value::Null);
    assert_eq!(view["live"]["last_issued"], (day_seconds << 32) | 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poisoned_request_fails_alone_when_it_shares_a_commit() {
    let app = TestEnv::new().spawn().await;
    // Valid JSON that Postgres' jsonb cannot hold: the edge knows it now,
    // so over HTTP it is refused before any number is taken.
    let poisoned = json!({"project": "PO", "type": "1", "metadata": {}})
        .to_string()
        .replace("{}", r#"{"n": 1e1000000}"#);
    let requests = (0..160).map(|i| {
        let app = &app;
        let poisoned = poisoned.clone();
        async move {
            let request = app
                .client
                .post(app.url("/documents"))
                .header("content-type", "application/json");
            let request = if i % 32 == 7 {
                request.body(poisoned)
            } else {
                request
                    .body(json!({"project": "PO", "type": "1", "metadata": {"i": i}}).to_string())
            };
            (i % 32 == 7, request.send().await.unwrap())
        }
    });
    let answers = futures::future::join_all(requests).await;
    let mut accepted = 0;
    for (poisoned, response) in answers {
        if poisoned {
            let problem =
                assert_problem(response, StatusCode::BAD_REQUEST, "unstorable_value").await;
            assert!(
                problem["detail"]
                    .as_str()
                    .is_some_and(|d| d.contains("1e1000000")),
                "{problem}"
            );
        } else {
            assert_eq!(response.status(), StatusCode::ACCEPTED);
            accepted += 1;
        }
    }
    assert_eq!(accepted, 155);
    assert_eq!(count(&app, "id_outbox").await, 155);
    let seqs: i64 = sqlx::query_scalar("SELECT max(seq_number) FROM id_outbox")
        .fetch_one(&app.db)
        .await
        .unwrap();
    assert_eq!(seqs, 155, "the refused requests took no number");

    // Through the library, past the edge: only the database knows, and a
    // poisoned document sharing a commit fails alone.
    let issuer = &app.state.documents;
    let documents = (0..160).map(|i| {
        let metadata = match i % 32 {
            7 => r#"{"n": 1e1000000}"#.to_owned(),
            9 => r#"{"a": "\u0000"}"#.to_owned(),
            _ => format!(r#"{{"lib": {i}}}"#),
        };
        let accepted = issuer.accept(Arc::new(idpool::features::documents::DocumentInput {
            project: idpool::domain::sequence::ProjectCode::parse("PO").unwrap(),
            doc_type: idpool::domain::sequence::TypeCode::parse("1").unwrap(),
            metadata: metadata.into(),
            id: None,
            source_id: None,
            invoice: None,
        }));
        async move { (matches!(i % 32, 7 | 9), accepted.await) }
    });
    for (poisoned, accepted) in futures::future::join_all(documents).await {
        assert_eq!(accepted.is_err(), poisoned, "{accepted:?}");
    }
    assert_eq!(count(&app, "id_outbox").await, 305);
    let split = app.metrics().await["idpool_ledger_writes_split_total"];
    assert!(split >= 1.0, "no poisoned document shared a commit");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_number_locked_by_a_hung_transaction_delays_only_its_own_request() {
    // Without leases, so a request (not a lease being taken) meets the
    // locked number: the writer treats both alike.
    let mut env = TestEnv::new();
    env.leases = false;
    let app = env.spawn().await;
    app.issue("LK", "1", 1).await;
    // Twenty at once, nothing held: the yardstick.
    let at_once = async || {
        let requests = (0..20).map(|_| async {
            let started = Instant::now();
            let response = app.post_ids("LK", "1", 1).await;
            (started.elapsed(), response)
        });
        futures::future::join_all(requests).await
    };
    let alone: Vec<std::time::Duration> = at_once()
        .await
        .into_iter()
        .map(|(took, response)| {
            assert_eq!(response.status(), StatusCode::OK);
            took
        })
        .collect();
    let sequence_id: i64 =
        sqlx::query_scalar("SELECT id FROM sequences WHERE project = 'LK' AND doc_type = '1'")
            .fetch_one(&app.db)
            .await
            .unwrap();
    let redis = fred::prelude::Builder::from_config(
        fred::prelude::Config::from_url(&app.env.redis_url).unwrap(),
    )
    .build()
    .unwrap();
    fred::prelude::ClientLike::init(&redis).await.unwrap();
    let head: String =
        fred::prelude::ListInterface::lindex(&redis, app.redis_pool_key("LK", "1", ""), 0)
            .await
            .unwrap();
    let next: i64 = crate::support::app::pool_numbers(&[head])[0];
    // Another transaction holds the next number and never finishes: the
    // request that meets it is refused (and says so in the log).
    crate::support::app::expect_error_lines("canceling statement due to lock timeout");
    let mut hung = app.db.begin().await.unwrap();
    sqlx::query(
        "INSERT INTO issuance_ledger (sequence_id, period, seqs, via) VALUES ($1, '', int8range($2, $3), 'ids')",
    )
    .bind(sequence_id)
    .bind(next)
    .bind(next + 1)
    .execute(&mut *hung)
    .await
    .unwrap();
    let answers = at_once().await;
    let mut served = Vec::new();
    let mut beside = Vec::new();
    let mut refusals = Vec::new();
    for (took, response) in answers {
        match response.status() {
            StatusCode::OK => {
                beside.push(took);
                let body: Value = response.json().await.unwrap();
                served.push(body["seqs"][0].as_i64().unwrap());
            }
            StatusCode::SERVICE_UNAVAILABLE => {
                refusals.push(response.text().await.unwrap_or_default())
            }
            other => panic!("unexpected {other}"),
        }
    }
    let refused = refusals.len();
    // A request sharing the commit that meets the held number waits with
    // it until the writers' lock wait gives up, and again while the
    // shared write is split to find the request at fault: by design, a
    // few lock waits, never more.
    assert_slowdown_within_and(
        "a hung transaction",
        "a request",
        &alone,
        &beside,
        idpool::infra::db::WRITER_LOCK_WAIT * 4,
    );
    // The locked number is written off, never put back in the pool, where
    // the next request would meet it again.
    assert_eq!(
        refused, 1,
        "only the request holding the locked number fails: {refusals:?} served {served:?} next {next}"
    );
    assert_eq!(served.len(), 20 - refused, "{served:?}");
    for refusal in &refusals {
        assert!(
            refusal.contains("another transaction holds a number this request drew"),
            "{refusal}"
        );
    }
    assert!(!served.contains(&next), "the locked number was issued");
    hung.rollback().await.unwrap();
    app.issue("LK", "1", 1).await;
    // The locked number is written off (its holder might have committed
    // it), not lost: the gap says why.
    app.settle_and_reconcile().await;
    let gaps = app.gaps("LK", "1").await;
    let locked = gaps.iter().find(|g| {
        g["from_seq"].as_i64().is_some_and(|from| from <= next)
            && g["to_seq"].as_i64().is_some_and(|to| to >= next)
    });
    assert_eq!(
        locked.map(|g| (g["reason"].clone(), g["note"].clone())),
        Some((json!("pool_discarded"), json!("locked_elsewhere"))),
        "{gaps:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_number_two_requests_of_one_shared_write_hold_is_recorded_for_one() {
    use idpool::records::ledger::Via;
    use idpool::records::ledger::outbox_rows::OutboxRow;
    use idpool::records::ledger::{LedgerWrite, write_shared};
    let app = TestEnv::new().spawn().await;
    app.issue("LG", "1", 1).await;
    let sequence_id: i64 =
        sqlx::query_scalar("SELECT id FROM sequences WHERE project = 'LG' AND doc_type = '1'")
            .fetch_one(&app.db)
            .await
            .unwrap();
    // A stale list handed number 5000 to an ID request and a document at once.
    let writes = [
        LedgerWrite {
            sequence_id,
            period: String::new(),
            seqs: vec![5000],
            via: Via::Ids,
            documents: vec![],
            unnumbered: vec![],
        },
        LedgerWrite {
            sequence_id,
            period: String::new(),
            seqs: vec![5000],
            via: Via::Document,
            documents: vec![OutboxRow {
                seq: 5000,
                document_id: "LG-1-5000".into(),
                project: "LG".into(),
                doc_type: "1".into(),
                seq_number: 5000,
                payload: "{}".into(),
                source_id: None,
                invoice: None,
            }],
            unnumbered: vec![],
        },
    ];
    let mut conn = app.state.db.acquire().await.unwrap();
    let numberings = std::sync::Mutex::new(Vec::new());
    let outcomes = write_shared(
        &mut conn,
        &app.state.stats,
        app.state.pools.counter(),
        &writes,
        &numberings,
    )
    .await;
    let first = outcomes[0].as_ref().unwrap();
    let second = outcomes[1].as_ref().unwrap();
    assert!(first.refused.is_empty(), "{first:?}");
    assert_eq!(second.refused, vec![5000], "the second holder is refused");
    assert!(second.documents.is_empty(), "its document was not written");
    let holders: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM issuance_ledger WHERE sequence_id = $1 AND seqs @> 5000::bigint",
    )
    .bind(sequence_id)
    .fetch_one(&app.db)
    .await
    .unwrap();
    assert_eq!(holders, 1);
    assert_eq!(count(&app, "id_outbox").await, 0);
}
