//! Sequence definitions: defaults on first use, the 409/force rule, live figures.

use crate::support::probes::*;
use serde_json::Value;
use std::collections::HashSet;

use reqwest::StatusCode;
use serde_json::json;

use crate::support::app::{TestEnv, assert_problem};

/// Issue #45: two thousand projects making their first request at once
/// are all served, each sequence created once with the defaults and its
/// first number 1, while a tenant's busy sequence beside them is no slower
/// than sharing the cores makes it (their first uses are read and created
/// per batch, on one request connection at a time).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crowd_of_first_uses_is_served_and_leaves_a_busy_sequence_unharmed() {
    use futures::StreamExt;
    let app = TestEnv::new().spawn().await;
    let probe = Probe::start(&app).await;
    let projects = 2_000;
    let answers: Vec<(usize, StatusCode, Value)> = futures::stream::iter(0..projects)
        .map(|p| {
            let app = &app;
            async move {
                let response = app.post_ids(&format!("FU{p}"), "1", 1).await;
                let status = response.status();
                (p, status, response.json().await.unwrap_or(Value::Null))
            }
        })
        .buffer_unordered(64)
        .collect()
        .await;
    for (p, status, body) in &answers {
        assert_eq!(*status, StatusCode::OK, "FU{p}: {body}");
        assert_eq!(body["ids"][0], format!("FU{p}-1-1"), "FU{p}: {body}");
    }
    let created: i64 =
        sqlx::query_scalar("SELECT count(*) FROM sequences WHERE project LIKE 'FU%'")
            .fetch_one(&app.db)
            .await
            .unwrap();
    assert_eq!(created, projects as i64, "one sequence per project");
    probe
        .assert_unharmed("two thousand first uses at once")
        .await;
}

/// Issue #45: a sequence's first use asks its pool's Redis keys three
/// things: the shared pop that finds the pool empty, the lock that keeps
/// refills off while the counter gives the numbers (its answer says the
/// pool is still empty and never filled, so no second pop asks again), and
/// the lock's release. A crowd of first uses is bounded by such calls.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_first_use_asks_redis_to_pop_lock_and_release_and_nothing_more() {
    let redis = crate::support::redis_server::RedisServer::start();
    let app = TestEnv::new().with_redis(&redis.url()).spawn().await;
    // Another sequence first: the scripts are loaded by then.
    app.issue("WARM", "1", 1).await;
    let monitor = redis.monitor();
    let (ids, _) = app.issue("ONCE", "1", 1).await;
    assert_eq!(ids, vec!["ONCE-1-1".to_string()]);
    let seen = monitor.seen_so_far();
    // The keys of the pool's period (list, meta, lock, pops in flight).
    let pool = app.redis_pool_key("ONCE", "1", "");
    let its_keys = pool.trim_end_matches("pool");
    let scripts: Vec<&String> = seen
        .iter()
        .filter(|l| l.contains("\"EVALSHA\"") && l.contains(its_keys))
        .collect();
    assert_eq!(scripts.len(), 3, "{scripts:#?}");
    let lock_taken = seen
        .iter()
        .filter(|l| l.contains(" lua]") && l.contains("\"SET\"") && l.contains("\"NX\""))
        .filter(|l| l.contains(its_keys))
        .count();
    assert_eq!(lock_taken, 1, "the refill lock, taken once: {seen:#?}");
    // And it left nothing behind: a sequence used once holds no pool.
    assert_eq!(
        app.redis_keys_of("ONCE", "1", "").await,
        Vec::<String>::new()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sequence_used_before_it_is_defined_gets_the_defaults() {
    let app = TestEnv::new().spawn().await;
    // Its first use takes from the counter: a sequence used once holds no
    // pool (issue #45: an idle sequence costs Redis nothing).
    app.issue("NEW", "1", 1).await;
    let (_, once) = app.get_json("/api/v1/sequences/NEW/1").await;
    assert_eq!(once["live"]["last_issued"], 1);
    assert_eq!(once["live"]["pool_depth"], 0, "{once}");
    assert_eq!(once["live"]["refills"], 0, "{once}");
    app.issue("NEW", "1", 1).await;
    let (status, view) = app.get_json("/api/v1/sequences/NEW/1").await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(view["format"], "{project}-{type}-{seq}");
    assert_eq!(view["start"], 1);
    assert_eq!(view["reset"], "never");
    assert_eq!(view["timezone"], "UTC");
    assert_eq!(view["pool_size"], 1000);
    assert_eq!(view["refill_at"], 0.75);
    assert_eq!(view["live"]["last_issued"], 2);
    assert_eq!(view["live"]["last_issued_id"], "NEW-1-2");
    // Asked again, it is filled: the first refill brought the pool up to
    // pool_size after serving the request.
    assert_eq!(view["live"]["pool_depth"], 1000);
    assert_eq!(view["live"]["refills"], 1);

    let list = app.ok_json("/api/v1/sequences").await;
    assert_eq!(list["sequences"].as_array().unwrap().len(), 1);
    assert_eq!(list["sequences"][0]["project"], "NEW");
    assert_eq!(list["next_cursor"], serde_json::Value::Null);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn changing_how_ids_read_needs_force_once_numbers_were_issued() {
    let app = TestEnv::new().spawn().await;
    let created = app
        .put_sequence(
            "PROJ",
            "9012",
            json!({"format": "{project}-{type}-{seq:5}", "start": 1001}),
        )
        .await;
    assert_eq!(created.status(), StatusCode::CREATED);
    // Before anything is issued, the format may change freely.
    let changed = app
        .put_sequence(
            "PROJ",
            "9012",
            json!({"format": "{project}-{type}-{seq}", "start": 1001}),
        )
        .await;
    assert_eq!(changed.status(), StatusCode::OK);
    let (ids, _) = app.issue("PROJ", "9012", 2).await;
    assert_eq!(ids, vec!["PROJ-9012-1001", "PROJ-9012-1002"]);

    let refused = app
        .put_sequence("PROJ", "9012", json!({"format": "{project}/{seq}"}))
        .await;
    assert_problem(refused, StatusCode::CONFLICT, "sequence_in_use").await;
    let refused_tz = app
        .put_sequence("PROJ", "9012", json!({"timezone": "Asia/Tokyo"}))
        .await;
    assert_problem(refused_tz, StatusCode::CONFLICT, "sequence_in_use").await;
    // Pool tuning is not an identity change.
    let tuned = app
        .put_sequence(
            "PROJ",
            "9012",
            json!({"format": "{project}-{type}-{seq}", "start": 1001, "pool_size": 50}),
        )
        .await;
    assert_eq!(tuned.status(), StatusCode::OK);
    let (_, ids_still) = app.issue("PROJ", "9012", 1).await;
    assert_eq!(ids_still, vec![1003]);

    let forced = app
        .put_sequence(
            "PROJ",
            "9012",
            json!({"format": "{project}/{seq}", "force": true}),
        )
        .await;
    assert_eq!(forced.status(), StatusCode::OK);
    let view: serde_json::Value = forced.json().await.unwrap();
    assert_eq!(view["version"], 4);
    let (ids, seqs) = app.issue("PROJ", "9012", 1).await;
    assert_eq!(ids, vec![format!("PROJ/{}", seqs[0])]);
    // The old pool's numbers were discarded (and recorded), never issued.
    assert!(seqs[0] > 1003);
    let discarded: i64 =
        sqlx::query_scalar("SELECT coalesce(sum(upper(seqs) - lower(seqs)), 0)::bigint FROM pool_discards WHERE cause = 'definition_changed'")
            .fetch_one(&app.db)
            .await
            .unwrap();
    assert!(discarded > 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sequence_list_pages_with_a_cursor() {
    let app = TestEnv::new().spawn().await;
    for i in 0..5 {
        let r = app.put_sequence("LIST", &format!("T{i}"), json!({})).await;
        assert_eq!(r.status(), StatusCode::CREATED);
    }
    let first = app.ok_json("/api/v1/sequences?limit=2").await;
    let cursor = first["next_cursor"].as_str().unwrap().to_owned();
    let second = app
        .ok_json(&format!("/api/v1/sequences?limit=2&cursor={cursor}"))
        .await;
    let third = app
        .ok_json(&format!(
            "/api/v1/sequences?limit=2&cursor={}",
            second["next_cursor"].as_str().unwrap()
        ))
        .await;
    let types: Vec<String> = [first, second, third.clone()]
        .iter()
        .flat_map(|page| page["sequences"].as_array().unwrap().clone())
        .map(|s| s["type"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(types, vec!["T0", "T1", "T2", "T3", "T4"]);
    assert_eq!(third["next_cursor"], serde_json::Value::Null);

    // A scoped key's cursor names only its own rows: a cursor naming
    // another project's sequence that exists is answered exactly as one
    // naming a sequence that does not.
    let scoped = crate::support::app::client_with_key(Some(
        &crate::support::app::create_key(&app.state, &["MINE"], false).await,
    ));
    for i in 0..3 {
        let r = app.put_sequence("MINE", &format!("T{i}"), json!({})).await;
        assert_eq!(r.status(), StatusCode::CREATED);
    }
    let page_after = async |cursor: &str| {
        let answer = scoped
            .get(app.url(&format!("/api/v1/sequences?limit=2&cursor={cursor}")))
            .send()
            .await
            .unwrap();
        (answer.status(), answer.text().await.unwrap())
    };
    let foreign = page_after("LIST/T2").await;
    let made_up = page_after("LISU/T2").await;
    assert_eq!(foreign.0, StatusCode::OK, "{}", foreign.1);
    assert_eq!(
        foreign, made_up,
        "another project's existing sequence as a cursor"
    );
    assert!(!foreign.1.contains("LIST"), "{}", foreign.1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attaching_any_id_to_any_accepted_format_takes_one_pass() {
    let app = TestEnv::new().spawn().await;
    // Ten fixed-width date tokens read back one way: accepted.
    let format = format!("{}{{seq}}", "{date:%Y}".repeat(10));
    let response = app
        .put_sequence("BT", "A", json!({ "format": format }))
        .await;
    assert_eq!(response.status(), StatusCode::CREATED);
    let probe = Probe::start(&app).await;
    let hostile_ids = [
        "1".repeat(64),
        "2026".repeat(16),
        format!("{}{}", "2026".repeat(10), "9".repeat(24)),
        "a".repeat(64),
    ];
    let bodies: Vec<Value> = hostile_ids
        .iter()
        .cycle()
        .take(32)
        .map(|id| json!({"project": "BT", "type": "A", "metadata": {}, "id": id}))
        .collect();
    let attaches = bodies.iter().map(|body| app.post_document(body, None));
    for response in futures::future::join_all(attaches).await {
        assert_problem(response, StatusCode::CONFLICT, "id_not_attachable").await;
    }
    probe.assert_unharmed("32 hostile attaches").await;
    nothing_written(&app, 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn formats_that_read_more_than_one_way_or_grow_without_bound_are_refused() {
    let app = TestEnv::new().spawn().await;
    let cases = [
        // Sub-second fractions print 0 to 10 characters: 73-character IDs.
        (format!("{}{{seq}}", "{date:%.f}".repeat(7)), "varying"),
        // Nov 1 number 15 and Nov 11 number 5 print the same ID.
        ("{date:%Y%m%-d}{seq}".to_owned(), "varying"),
        ("{date:%-m%-d}-{seq}".to_owned(), "varying"),
        ("{date:%B}{seq}".to_owned(), "varying"),
        (format!("{}{{seq}}", "{type}".repeat(16)), "tokens"),
        (format!("{{date:{}}}{{seq}}", "%y".repeat(33)), "items"),
        (format!("{}{{seq}}", "x".repeat(300)), "bytes long"),
        ("{date:%Z}-{seq}".to_owned(), "not supported"),
        ("a\t{seq}".to_owned(), "control"),
        ("{date:%n}{seq}".to_owned(), "control"),
        (
            format!("{}-{{seq}}", "{date:%Y%m%d%H%M%S}".repeat(4)),
            "characters long",
        ),
    ];
    let probe = Probe::start(&app).await;
    for (format, mention) in &cases {
        let response = app
            .put_sequence("BT", "B", json!({ "format": format }))
            .await;
        let problem = assert_problem(response, StatusCode::BAD_REQUEST, "invalid_definition").await;
        let detail = problem["detail"].as_str().unwrap();
        assert!(
            detail.contains(mention),
            "{format}: {detail:?} should mention {mention:?}"
        );
    }
    probe.assert_unharmed("refused formats").await;
    nothing_written(&app, 0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_sequence_prints_an_id_another_sequence_of_its_project_prints() {
    let app = TestEnv::new().spawn().await;
    let same = json!({"format": "{project}{type}{seq}"});
    let first = app.put_sequence("P", "A1", same.clone()).await;
    assert_eq!(first.status(), StatusCode::CREATED);
    // PA12 + 3 reads like PA1 + 23.
    let second = app.put_sequence("P", "A12", same.clone()).await;
    let problem = assert_problem(second, StatusCode::CONFLICT, "format_conflict").await;
    let detail = problem["detail"].as_str().unwrap();
    assert!(
        detail.contains("P/A1") && detail.contains("PA12"),
        "{detail}"
    );
    // Another project may print the same shape.
    let elsewhere = app.put_sequence("Q", "A12", same).await;
    assert_eq!(elsewhere.status(), StatusCode::CREATED);

    // A custom format that prints what a default one would.
    let custom = app
        .put_sequence("P", "X", json!({"format": "P-Y-{seq}"}))
        .await;
    assert_eq!(custom.status(), StatusCode::CREATED);
    let first_use = app.post_ids("P", "Y", 1).await;
    assert_problem(first_use, StatusCode::CONFLICT, "format_conflict").await;
    let (status, _) = app.get_json("/api/v1/sequences/P/Y").await;
    assert_eq!(status, StatusCode::NOT_FOUND, "P/Y was not created");
    nothing_written(&app, 3).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forced_change_never_prints_an_earlier_id_again() {
    let app = TestEnv::new().spawn().await;
    let format = "{date:%Y%m%d}-{seq}";
    let created = app
        .put_sequence("R", "1", json!({ "format": format }))
        .await;
    assert_eq!(created.status(), StatusCode::CREATED);
    let (before, before_seqs) = app.issue("R", "1", 5).await;

    // A daily reset starts a new counter; the same format would print
    // today's IDs again from 1.
    let daily = app
        .put_sequence(
            "R",
            "1",
            json!({"format": format, "reset": "daily", "force": true}),
        )
        .await;
    assert_eq!(daily.status(), StatusCode::OK);
    let (after, after_seqs) = app.issue("R", "1", 5).await;
    let before: HashSet<String> = before.into_iter().collect();
    assert!(
        after.iter().all(|id| !before.contains(id)),
        "{after:?} repeats {before:?}"
    );
    assert!(after_seqs[0] > *before_seqs.last().unwrap());

    // And back: the never-resetting counter starts above the daily one.
    let never = app
        .put_sequence(
            "R",
            "1",
            json!({"format": format, "reset": "never", "force": true}),
        )
        .await;
    assert_eq!(never.status(), StatusCode::OK);
    let (again, _) = app.issue("R", "1", 5).await;
    assert!(
        again
            .iter()
            .all(|id| !before.contains(id) && !after.contains(id)),
        "{again:?}"
    );

    // A format that could print what an earlier one printed is refused,
    // force or not.
    let overlapping = app
        .put_sequence(
            "R",
            "1",
            json!({"format": "{date:%Y%m%d}-1{seq}", "force": true}),
        )
        .await;
    let problem = assert_problem(overlapping, StatusCode::CONFLICT, "format_conflict").await;
    assert!(
        problem["detail"]
            .as_str()
            .unwrap()
            .contains("earlier format"),
        "{problem}"
    );
    let disjoint = app
        .put_sequence("R", "1", json!({"format": "R1/{seq}", "force": true}))
        .await;
    assert_eq!(disjoint.status(), StatusCode::OK);

    // The 64-bit layout prints (day since epoch << 32 | counter): a new
    // epoch would move today's IDs onto another day's.
    let int64 = app.put_sequence("R", "2", json!({"layout": "int64"})).await;
    assert_eq!(int64.status(), StatusCode::CREATED);
    app.issue("R", "2", 3).await;
    let moved = app
        .put_sequence(
            "R",
            "2",
            json!({"layout": "int64", "epoch": "2022-01-02T00:00:00Z", "force": true}),
        )
        .await;
    let problem = assert_problem(moved, StatusCode::CONFLICT, "format_conflict").await;
    assert!(
        problem["detail"]
            .as_str()
            .unwrap()
            .contains("earlier epoch"),
        "{problem}"
    );
}

/// PUT replaces a definition, and a field left out takes its default: a
/// change of pool size sent without the `max` must not end a used
/// sequence's exhaustion unnoticed, pooled or gapless.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_put_that_leaves_out_a_used_sequences_max_is_refused_unless_forced() {
    let app = TestEnv::new().spawn().await;
    let created = app
        .put_sequence("MK", "1", json!({"pool_size": 10, "max": 3}))
        .await;
    assert_eq!(created.status(), StatusCode::CREATED);
    app.issue("MK", "1", 1).await;
    let dropped = app.put_sequence("MK", "1", json!({"pool_size": 20})).await;
    assert_problem(dropped, StatusCode::CONFLICT, "sequence_in_use").await;
    let kept = app
        .put_sequence("MK", "1", json!({"pool_size": 20, "max": 3}))
        .await;
    assert_eq!(kept.status(), StatusCode::OK);
    let (_, seqs) = app.issue("MK", "1", 2).await;
    assert_eq!(seqs, [2, 3]);
    let past = app.post_ids("MK", "1", 1).await;
    assert_problem(past, StatusCode::CONFLICT, "sequence_exhausted").await;
    // Said with force, the max goes.
    let forced = app
        .put_sequence("MK", "1", json!({"pool_size": 20, "force": true}))
        .await;
    assert_eq!(forced.status(), StatusCode::OK);
    let view: Value = forced.json().await.unwrap();
    assert_eq!(view["max"], Value::Null, "{view}");
    assert_eq!(app.post_ids("MK", "1", 1).await.status(), StatusCode::OK);

    // Gapless: the last invoice number stays the last.
    let gapless = json!({"numbering": "gapless", "max": 1});
    let created = app.put_sequence("MK", "2", gapless).await;
    assert_eq!(created.status(), StatusCode::CREATED);
    let document = json!({"project": "MK", "type": "2", "metadata": {}});
    assert_eq!(
        app.post_document(&document, None).await.status(),
        StatusCode::ACCEPTED
    );
    let dropped = app
        .put_sequence("MK", "2", json!({"numbering": "gapless", "pool_size": 50}))
        .await;
    assert_problem(dropped, StatusCode::CONFLICT, "sequence_in_use").await;
    let past = app.post_document(&document, None).await;
    assert_problem(past, StatusCode::CONFLICT, "sequence_exhausted").await;
    // A sequence with no number yet takes the definition as sent.
    let created = app.put_sequence("MK", "3", json!({"max": 5})).await;
    assert_eq!(created.status(), StatusCode::CREATED);
    let replaced = app.put_sequence("MK", "3", json!({})).await;
    assert_eq!(replaced.status(), StatusCode::OK);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lowering_max_takes_the_numbers_past_it_out_of_the_pool() {
    let app = TestEnv::new().spawn().await;
    let created = app.put_sequence("MX", "1", json!({"pool_size": 100})).await;
    assert_eq!(created.status(), StatusCode::CREATED);
    // The first use takes from the counter; the second fills the pool.
    app.issue("MX", "1", 1).await;
    app.issue("MX", "1", 1).await;
    let lowered = app
        .put_sequence("MX", "1", json!({"pool_size": 100, "max": 10}))
        .await;
    assert_eq!(lowered.status(), StatusCode::OK);
    let redis = fred::prelude::Builder::from_config(
        fred::prelude::Config::from_url(&app.env.redis_url).unwrap(),
    )
    .build()
    .unwrap();
    fred::prelude::ClientLike::init(&redis).await.unwrap();
    let pool: Vec<String> =
        fred::prelude::ListInterface::lrange(&redis, app.redis_pool_key("MX", "1", ""), 0, -1)
            .await
            .unwrap();
    assert!(
        crate::support::app::pool_numbers(&pool)
            .iter()
            .all(|n| *n <= 10),
        "{pool:?}"
    );
    let discarded: i64 = sqlx::query_scalar(
        "SELECT coalesce(sum(upper(seqs) - lower(seqs)), 0)::bigint FROM pool_discards WHERE cause = 'above_max'",
    )
    .fetch_one(&app.db)
    .await
    .unwrap();
    assert!(discarded > 0, "the trimmed numbers were recorded");
    let (_, seqs) = app.issue("MX", "1", 8).await;
    assert_eq!(*seqs.last().unwrap(), 10);
    let past = app.post_ids("MX", "1", 1).await;
    assert_problem(past, StatusCode::CONFLICT, "sequence_exhausted").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_project_holds_at_most_its_limit_of_sequences() {
    let mut env = TestEnv::new();
    env.max_sequences_per_project = 3;
    let app = env.spawn().await;
    for doc_type in ["A", "B", "C"] {
        app.issue("LIM", doc_type, 1).await;
    }
    let fourth = app.post_ids("LIM", "D", 1).await;
    assert_problem(fourth, StatusCode::CONFLICT, "sequence_limit_reached").await;
    let defined = app.put_sequence("LIM", "E", json!({})).await;
    assert_problem(defined, StatusCode::CONFLICT, "sequence_limit_reached").await;
    // Existing sequences go on; other projects have their own room.
    app.issue("LIM", "A", 1).await;
    app.issue("OTHER", "D", 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_refused_for_want_of_room_creates_none_of_its_sequences() {
    let mut env = TestEnv::new();
    env.max_sequences_per_project = 3;
    let app = env.spawn().await;
    app.issue("ROOM", "A", 1).await;
    let item = |doc_type: &str| json!({"project": "ROOM", "type": doc_type, "metadata": {}});
    let refused = app
        .post_batch(vec![item("A"), item("B"), item("C"), item("D"), item("E")])
        .await;
    let problem = assert_problem(refused, StatusCode::CONFLICT, "sequence_limit_reached").await;
    assert_eq!(problem["index"], 3, "the first item past the room is named");
    let types = async || -> Vec<String> {
        sqlx::query_scalar(
            "SELECT doc_type FROM sequences WHERE project = 'ROOM' ORDER BY doc_type",
        )
        .fetch_all(&app.db)
        .await
        .unwrap()
    };
    assert_eq!(
        types().await,
        vec!["A"],
        "the refused batch left no sequence behind"
    );
    assert_eq!(count(&app, "id_outbox").await, 0);
    // Room for two more: a batch within it is taken whole.
    let taken = app.post_batch(vec![item("B"), item("C"), item("A")]).await;
    assert_eq!(taken.status(), StatusCode::ACCEPTED);
    assert_eq!(types().await, vec!["A", "B", "C"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_id_over_the_limit_is_never_issued_even_from_an_old_definition() {
    let app = TestEnv::new().spawn().await;
    // A definition stored before the checks existed.
    sqlx::query(
        "INSERT INTO sequences (project, doc_type, format, layout, start_seq, reset, timezone, pool_size, refill_at) \
         VALUES ('OLD', '1', $1, 'text', 1, 'never', 'UTC', 1000, 0.75)",
    )
    .bind(format!("{}{{seq}}", "x".repeat(60)))
    .execute(&app.db)
    .await
    .unwrap();
    let response = app.post_ids("OLD", "1", 1).await;
    assert_problem(response, StatusCode::CONFLICT, "id_too_long").await;
    assert_eq!(count(&app, "issuance_ledger").await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_definition_may_print_another_projects_ids() {
    let app = TestEnv::new().spawn().await;
    // Two projects that both want INV-000001: the second is refused.
    app.define("P1", "INV", json!({"format": "INV-{seq:6}"}))
        .await;
    let refused = app
        .put_sequence("P2", "INV", json!({"format": "INV-{seq:6}"}))
        .await;
    assert_problem(refused, StatusCode::CONFLICT, "format_conflict").await;
    // With the project in it, each prints its own.
    app.define("P2", "INV", json!({"format": "{project}-INV-{seq:6}"}))
        .await;
    // A format that could print what another project's default sequences
    // print (Q/X's first ID is Q-X-1) is refused, used yet or not.
    let refused = app
        .put_sequence("P3", "A", json!({"format": "{type}-X-{seq}"}))
        .await;
    assert_problem(refused, StatusCode::CONFLICT, "format_conflict").await;
    app.define("P3", "B", json!({"format": "P3-{type}-{seq:4}"}))
        .await;
    // Two int64 layouts with one epoch print the same numbers; an epoch a
    // second later never does.
    app.define("P4", "N", json!({"layout": "int64", "reset": "daily"}))
        .await;
    let refused = app
        .put_sequence("P5", "N", json!({"layout": "int64", "reset": "daily"}))
        .await;
    assert_problem(refused, StatusCode::CONFLICT, "format_conflict").await;
    app.define(
        "P5",
        "N",
        json!({"layout": "int64", "reset": "daily", "epoch": "2022-01-01T00:00:01Z"}),
    )
    .await;

    // Each project's documents take their own IDs, none refused because
    // of the other's.
    let mut seen = std::collections::HashSet::new();
    for (project, doc_type) in [("P1", "INV"), ("P2", "INV"), ("P4", "N"), ("P5", "N")] {
        for _ in 0..3 {
            let response = app
                .post_document(
                    &json!({"project": project, "type": doc_type, "metadata": {}}),
                    None,
                )
                .await;
            let status = response.status();
            let body: Value = response.json().await.unwrap();
            assert_eq!(status, StatusCode::ACCEPTED, "{project}/{doc_type}: {body}");
            assert!(
                seen.insert(body["id"].as_str().unwrap().to_owned()),
                "{body}"
            );
        }
    }
}
