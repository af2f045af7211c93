//! Adaptive pool size (Leaf's dynamic step): a pool refilled again soon
//! after its last refill grows, so steady traffic does not cost a refill per
//! request; one left idle shrinks back towards `pool_size`.

use std::sync::Arc;
use std::time::Duration;

use fred::prelude::*;
use idpool::domain::clock::ManualClock;
use idpool::records::pool::PoolSettings;
use reqwest::StatusCode;
use serde_json::json;

use crate::support::app::{TestApp, TestEnv, assert_distinct};

async fn pool_target(env: &TestEnv, app: &TestApp) -> i64 {
    let client = Builder::from_config(Config::from_url(&env.redis_url).unwrap())
        .build()
        .unwrap();
    client.init().await.unwrap();
    let meta = app
        .redis_pool_key("GROW", "1", "")
        .replace(":pool", ":meta");
    let target: Option<i64> = client.hget(meta, "target").await.unwrap();
    target.unwrap_or(0)
}

async fn pool_refills(app: &TestApp) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM blocks b JOIN sequences s ON s.id = b.sequence_id \
         WHERE s.project = 'GROW' AND b.purpose = 'pool'",
    )
    .fetch_one(&app.db)
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_pool_grows_and_an_idle_one_shrinks_back() {
    let env = TestEnv::new();
    let settings = PoolSettings {
        grow_within: Duration::from_millis(500),
        shrink_after: Duration::from_millis(1000),
        ..PoolSettings::default()
    };
    // The pools' sense of "soon" and "idle" is the injected clock: it
    // stands still while the requests below run, and moves on when told.
    let clock = Arc::new(ManualClock::new(chrono::Utc::now()));
    let app = env.spawn_with(clock.clone(), settings).await;
    let created = app
        .put_sequence("GROW", "1", json!({"pool_size": 100}))
        .await;
    assert_eq!(created.status(), StatusCode::CREATED);

    // 40 requests of 80 numbers, back to back: a pool of a fixed 100 would
    // need a refill for nearly every one of them.
    let mut seqs = Vec::new();
    for _ in 0..40 {
        seqs.extend(app.issue("GROW", "1", 80).await.1);
    }
    assert_distinct(&seqs, "GROW");
    let grown = pool_target(&env, &app).await;
    assert!(grown >= 800, "target after busy refills: {grown}");
    let refills = pool_refills(&app).await;
    assert!(
        refills <= 12,
        "{refills} refills for 3,200 numbers: the pool did not grow with its traffic"
    );

    // Idle past shrink_after: the next refill halves the target.
    clock.advance(chrono::Duration::milliseconds(1300));
    let view = app.ok_json("/api/v1/sequences/GROW/1").await;
    let depth = view["live"]["pool_depth"].as_i64().unwrap();
    let refills_before = pool_refills(&app).await;
    seqs.extend(app.issue("GROW", "1", depth + 1).await.1);
    assert_distinct(&seqs, "GROW after idling");
    // The drained pool's refill runs in the background, after the answer
    // (a request never waits on a refill): the target is read once it has
    // landed.
    crate::support::app::eventually(Duration::from_secs(10), "the pool refilled", async || {
        (pool_refills(&app).await > refills_before).then_some(())
    })
    .await;
    let shrunk = pool_target(&env, &app).await;
    assert_eq!(shrunk, grown / 2, "target after an idle spell");
}

/// However busy, a pool grows to at most `max_growth` times its defined
/// size (SPEC: per-tenant growth is bounded, pool size too): Redis holds
/// no more of one sequence than that.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_pool_grows_no_further_than_its_bound() {
    let env = TestEnv::new();
    let settings = PoolSettings {
        grow_within: Duration::from_millis(500),
        max_growth: 4,
        ..PoolSettings::default()
    };
    let clock = Arc::new(ManualClock::new(chrono::Utc::now()));
    let app = env.spawn_with(clock.clone(), settings).await;
    let created = app
        .put_sequence("GROW", "1", json!({"pool_size": 100}))
        .await;
    assert_eq!(created.status(), StatusCode::CREATED);
    // The traffic that grows an unbounded pool past 800 (above).
    let mut seqs = Vec::new();
    for _ in 0..40 {
        seqs.extend(app.issue("GROW", "1", 80).await.1);
    }
    assert_distinct(&seqs, "GROW");
    let grown = pool_target(&env, &app).await;
    assert!(
        (200..=400).contains(&grown),
        "target after busy refills with a bound of 4 × 100: {grown}"
    );
    let view = app.ok_json("/api/v1/sequences/GROW/1").await;
    let depth = view["live"]["pool_depth"].as_i64().unwrap();
    assert!(
        depth <= 400,
        "{depth} numbers held in Redis for a bound of 400"
    );
    // A definition past the largest pool size is refused.
    let refused = app
        .put_sequence("GROW", "2", json!({"pool_size": 100_001}))
        .await;
    crate::support::app::assert_problem(refused, StatusCode::BAD_REQUEST, "invalid_definition")
        .await;
}

/// A link of our own to `server`'s pools under `prefix`, up.
async fn link_to(
    server: &crate::support::redis_server::RedisServer,
    prefix: &str,
) -> Arc<idpool::records::pool::RedisLink> {
    let link = idpool::records::pool::RedisLink::connect(
        &idpool::records::pool::RedisSettings {
            url: server.url(),
            prefix: prefix.into(),
            clients: 1,
            command_timeout: Duration::from_secs(5),
        },
        Arc::new(idpool::infra::stats::Stats::default()),
    )
    .unwrap();
    // Nothing to check the pools against here: the circuit closes once the
    // client is connected and nothing failed since.
    crate::support::app::eventually(Duration::from_secs(10), "redis is up", async || {
        (link.all_connected() && link.mark_up(link.failure_count())).then_some(())
    })
    .await;
    link
}

/// Numbers given back keep the pool ascending, whatever order they come
/// back in: two leases returned lowest first once left the second above
/// the first, so numbers went out of order and reconciliation, trusting
/// the head to be the lowest, judged the first ones lost (hostile review).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn numbers_given_back_in_any_order_keep_the_pool_ascending() {
    use idpool::domain::numbers::SeqRange;
    use idpool::records::pool::{GiveBackToken, Pushed};

    let server = crate::support::redis_server::RedisServer::start();
    let link = link_to(&server, "idpool-back").await;
    let lists = idpool::records::pool::PoolLists::new(link.clone());
    let keys = link.keys("BACK", "1", "");
    let locked = lists
        .acquire(&keys, "refill", Duration::from_secs(30))
        .await
        .unwrap();
    assert!(locked.is_some());
    assert!(matches!(
        lists
            .push(&keys, "refill", SeqRange::new(1, 101), 100, 0)
            .await,
        Pushed::All(100)
    ));
    // Two leases take 1-10 and 11-20; their unused numbers come back, the
    // lower lease's first, then once more (a retried give-back).
    assert_eq!(
        lists.pop(&keys, 20).await.unwrap().seqs,
        (1..=20).collect::<Vec<i64>>()
    );
    lists
        .give_back(&keys, &[5, 6, 7, 8, 9, 10], &GiveBackToken::new())
        .await
        .unwrap();
    lists
        .give_back(&keys, &[15, 16, 17, 18, 19, 20], &GiveBackToken::new())
        .await
        .unwrap();
    lists
        .give_back(&keys, &[20, 5], &GiveBackToken::new())
        .await
        .unwrap();
    let runs = server.cli(&["LRANGE", &keys.pool, "0", "-1"]);
    let runs: Vec<&str> = runs.lines().map(str::trim).collect();
    // Runs, those given back joined where they touch.
    assert_eq!(runs, ["5-10", "15-100"]);
    let expected: Vec<i64> = (5..=10).chain(15..=100).collect();
    assert_eq!(crate::support::app::pool_numbers(&runs), expected);
    assert_eq!(lists.head(&keys).await.unwrap(), Some(5));
}

/// A give-back is taken once: tried again with its token (its first
/// answer was lost, say to a Redis that hung after running it), it puts
/// nothing back, though requests took its numbers again meanwhile. Taken
/// twice, issued numbers sat in the pool again (a review saw 46 and 47
/// answered, then back in their pool, and 944 numbers discarded as a
/// stale list). Another give-back of the same numbers (a later lease's)
/// is taken.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_give_back_tried_again_after_it_landed_puts_nothing_back_twice() {
    use idpool::domain::numbers::SeqRange;
    use idpool::records::pool::{GiveBackToken, Pushed};

    let server = crate::support::redis_server::RedisServer::start();
    let link = link_to(&server, "idpool-again").await;
    let lists = idpool::records::pool::PoolLists::new(link.clone());
    let keys = link.keys("AGAIN", "1", "");
    assert!(
        lists
            .acquire(&keys, "refill", Duration::from_secs(30))
            .await
            .unwrap()
            .is_some()
    );
    assert!(matches!(
        lists
            .push(&keys, "refill", SeqRange::new(1, 101), 100, 0)
            .await,
        Pushed::All(100)
    ));
    let pool = || -> Vec<i64> {
        let runs = server.cli(&["LRANGE", &keys.pool, "0", "-1"]);
        crate::support::app::pool_numbers(&runs.lines().collect::<Vec<_>>())
    };
    // A lease takes 1-10 and gives them back; requests take them again.
    let back: Vec<i64> = (1..=10).collect();
    assert_eq!(lists.pop(&keys, 10).await.unwrap().seqs, back);
    let token = GiveBackToken::new();
    assert!(lists.give_back(&keys, &back, &token).await.unwrap());
    assert_eq!(lists.pop(&keys, 10).await.unwrap().seqs, back);
    // The same give-back again: nothing.
    lists.give_back(&keys, &back, &token).await.unwrap();
    assert_eq!(
        pool(),
        (11..=100).collect::<Vec<i64>>(),
        "a give-back tried again put its numbers back twice"
    );
    // A later lease's give-back of the same numbers: taken.
    lists
        .give_back(&keys, &back, &GiveBackToken::new())
        .await
        .unwrap();
    assert_eq!(pool(), (1..=100).collect::<Vec<i64>>());
}

/// A give-back tried again past its window puts nothing back and says
/// so: an earlier try may have landed, and the pool been given back to
/// the counter since, its `inflight` (which knew the token) gone with it;
/// put back again, those numbers would be in the pool and in the counter
/// at once. The caller records them as discarded instead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_give_back_tried_again_past_its_window_puts_nothing_back() {
    use idpool::domain::numbers::SeqRange;
    use idpool::records::pool::{GiveBackToken, Pushed};

    let server = crate::support::redis_server::RedisServer::start();
    let link = link_to(&server, "idpool-late").await;
    link.set_give_back_window(Duration::from_millis(300));
    let lists = idpool::records::pool::PoolLists::new(link.clone());
    let keys = link.keys("LATE", "1", "");
    assert!(
        lists
            .acquire(&keys, "refill", Duration::from_secs(30))
            .await
            .unwrap()
            .is_some()
    );
    assert!(matches!(
        lists
            .push(&keys, "refill", SeqRange::new(1, 101), 100, 0)
            .await,
        Pushed::All(100)
    ));
    let taken = lists.pop(&keys, 10).await.unwrap().seqs;
    let token = GiveBackToken::new();
    assert!(lists.give_back(&keys, &taken, &token).await.unwrap());
    // The pool's numbers leave it (given back to the counter), its keys
    // with them, the token's record too.
    server.cli(&["DEL", &keys.pool, &keys.inflight, &keys.meta]);
    // The window is a span of Redis' clock: a real delay is the point.
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert!(
        !lists.give_back(&keys, &taken, &token).await.unwrap(),
        "past its window the give-back says it put nothing back"
    );
    assert_eq!(lists.depth(&keys).await.unwrap(), 0);
    // A new give-back opens a window of its own.
    assert!(
        lists
            .give_back(&keys, &taken, &GiveBackToken::new())
            .await
            .unwrap()
    );
    assert_eq!(lists.depth(&keys).await.unwrap(), 10);
}

/// A pool nobody used for its idle time is given up whole: what it held,
/// the numbers of a pop whose answer never came, and no key left behind
/// (an idle sequence costs Redis nothing). In use, or while a refill
/// holds its lock, it stays, and the sweep says its lowest number.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_unused_for_its_idle_time_is_given_up_whole_and_leaves_no_key() {
    use idpool::domain::numbers::SeqRange;
    use idpool::records::pool::{GiveBackToken, Pushed, Swept};

    let server = crate::support::redis_server::RedisServer::start();
    let link = link_to(&server, "idpool-idle").await;
    let lists = idpool::records::pool::PoolLists::new(link.clone());
    let keys = link.keys("IDLE", "1", "");
    assert!(
        lists
            .acquire(&keys, "refill", Duration::from_secs(30))
            .await
            .unwrap()
            .is_some()
    );
    // A refill holding the lock: the pool stays.
    assert_eq!(
        lists.sweep(&keys, Duration::ZERO).await.unwrap(),
        Swept::Kept { lowest: None }
    );
    assert!(matches!(
        lists
            .push(&keys, "refill", SeqRange::new(1, 1_001), 1000, 0)
            .await,
        Pushed::All(1000)
    ));
    // Answered pops, one given back in part; one pop whose answer is lost
    // (played by its script's record, which only a lost answer leaves).
    assert_eq!(
        lists.pop(&keys, 10).await.unwrap().seqs,
        (1..=10).collect::<Vec<i64>>()
    );
    assert!(
        lists
            .give_back(&keys, &[6, 7, 8, 9, 10], &GiveBackToken::new())
            .await
            .unwrap()
    );
    lists.forget_answered().await;
    assert_eq!(
        lists.pop(&keys, 5).await.unwrap().seqs,
        vec![6, 7, 8, 9, 10]
    );
    lists.forget_answered().await;
    server.cli(&["HSET", &keys.inflight, "lost-pop", "11,12"]);
    server.cli(&["LSET", &keys.pool, "0", "13-1000"]);
    assert_eq!(
        lists.sweep(&keys, Duration::from_secs(3600)).await.unwrap(),
        Swept::Kept { lowest: Some(13) },
        "used a moment ago"
    );
    // Idle time is a span of Redis' clock: a real delay is the point.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        lists
            .sweep(&keys, Duration::from_millis(200))
            .await
            .unwrap(),
        Swept::GivenUp {
            held: vec![SeqRange::new(13, 1_001)],
            popped: vec![SeqRange::new(11, 13)],
        }
    );
    assert_eq!(
        server.cli(&["--scan", "--pattern", "*IDLE*"]).trim(),
        "",
        "no key of the pool is left"
    );
    assert_eq!(
        lists.sweep(&keys, Duration::ZERO).await.unwrap(),
        Swept::Kept { lowest: None },
        "nothing left to give up"
    );
}

/// Redis runs one script at a time for every tenant: a pool of a million
/// numbers goes in, is trimmed and is emptied, each in one short script
/// (the pool's list holds runs, not numbers).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_million_numbers_go_in_and_out_of_a_pool_without_a_long_script() {
    use idpool::domain::numbers::SeqRange;
    use idpool::records::pool::Pushed;

    let server = crate::support::redis_server::RedisServer::start();
    // Anything over 50 ms is logged; each script here takes microseconds.
    server.cli(&["CONFIG", "SET", "slowlog-log-slower-than", "50000"]);
    server.cli(&["SLOWLOG", "RESET"]);
    let link = link_to(&server, "idpool-parts").await;
    let lists = idpool::records::pool::PoolLists::new(link.clone());
    let keys = link.keys("BIG", "1", "");
    let token = "refill-token";
    let locked = lists
        .acquire(&keys, token, Duration::from_secs(30))
        .await
        .unwrap();
    assert!(locked.is_some(), "the refill lock was free");
    match lists
        .push(&keys, token, SeqRange::new(1, 1_000_001), 1_000_000, 0)
        .await
    {
        Pushed::All(depth) => assert_eq!(depth, 1_000_000),
        _ => panic!("the block did not go in whole"),
    }
    assert_eq!(
        lists
            .acquire(&keys, "next", Duration::from_secs(30))
            .await
            .unwrap()
            .map(|l| l.depth),
        Some(1_000_000),
        "the last part released the lock"
    );
    lists.release(&keys, "next").await.unwrap();
    let trimmed = lists.trim_above(&keys, 900_000).await.unwrap();
    assert_eq!(trimmed, vec![SeqRange::new(900_001, 1_000_001)]);
    assert_eq!(lists.head(&keys).await.unwrap(), Some(1));
    let discarded = lists.discard(&keys, false).await.unwrap();
    assert_eq!(discarded, vec![SeqRange::new(1, 900_001)]);
    assert_eq!(lists.depth(&keys).await.unwrap(), 0);
    assert_eq!(
        server.cli(&["--scan", "--pattern", "*drain*"]).trim(),
        "",
        "the emptied pool's list is gone"
    );
    let slow = server.cli(&["SLOWLOG", "GET", "10"]);
    assert_eq!(
        server.cli(&["SLOWLOG", "LEN"]).trim(),
        "0",
        "scripts held Redis over 50 ms: {slow}"
    );
}

/// Lock waits on `counters` in the app's database: refills and takes of
/// numbers waiting for the row a test holds.
async fn waiting_on_counters(app: &TestApp) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() \
         AND wait_event_type = 'Lock' AND query ILIKE '%counters%'",
    )
    .fetch_one(&app.db)
    .await
    .unwrap()
}

/// A request that finds its pool short waits for the refill that has begun
/// numbering its block, however long that takes, instead of taking numbers
/// from the counter past that block: its numbers come in order. (With a
/// refill slower than the short wait, on a loaded machine, one request got
/// 1002 and the next ones 1, 2, ….)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_waits_for_the_block_a_slow_refill_has_taken_and_gets_its_numbers_in_order() {
    let mut env = TestEnv::new();
    env.leases = false;
    let app = env.spawn().await;
    let created = app
        .put_sequence("ORDER", "1", json!({"pool_size": 10}))
        .await;
    assert_eq!(created.status(), StatusCode::CREATED);
    // The first use takes from the counter; the next fills the pool.
    app.issue("ORDER", "1", 1).await;
    let (_, first) = app.issue("ORDER", "1", 1).await;
    // The pool's own refill after that pop has landed.
    let depth =
        crate::support::app::eventually(Duration::from_secs(10), "the pool refilled", async || {
            let metrics = app.metrics().await;
            let view = app.ok_json("/api/v1/sequences/ORDER/1").await;
            let depth = view["live"]["pool_depth"].as_i64()?;
            (metrics.get("idpool_refills_in_flight") == Some(&0.0) && depth > 0).then_some(depth)
        })
        .await;

    // Postgres holds the counter row, as a slow database would: the refill
    // of the next request's shortfall waits on it past the short wait.
    let mut holder = app.db.begin().await.unwrap();
    sqlx::query(
        "SELECT 1 FROM counters c JOIN sequences s ON s.id = c.sequence_id \
         WHERE s.project = 'ORDER' FOR UPDATE OF c",
    )
    .execute(&mut *holder)
    .await
    .unwrap();
    let short_wait = PoolSettings::default().short_wait;
    let watched = &app;
    let (issued, ()) = tokio::join!(app.issue("ORDER", "1", depth + 50), async move {
        crate::support::app::eventually(
            Duration::from_secs(10),
            "the refill waits for the counter row",
            async || (waiting_on_counters(watched).await >= 1).then_some(()),
        )
        .await;
        // Held past the short wait: a request that took numbers from the
        // counter meanwhile would wait on the row behind the refill.
        let _ = crate::support::app::within(short_wait * 4, async || {
            (waiting_on_counters(watched).await >= 2).then_some(())
        })
        .await;
        holder.commit().await.unwrap();
    });
    let (_, seqs) = issued;
    assert_eq!(seqs.len() as i64, depth + 50);
    assert_eq!(seqs[0], first[0] + 1, "{seqs:?}");
    assert!(
        seqs.windows(2).all(|pair| pair[1] == pair[0] + 1),
        "numbers out of order: {seqs:?}"
    );
}
