//! Adaptive pool size (Leaf's dynamic step): a pool refilled again soon
//! after its last refill grows, so steady traffic does not cost a refill per
//! request; one left idle shrinks back towards `pool_size`.

use std::sync::Arc;
use std::time::Duration;

use fred::prelude::*;
use idpool::clock::ManualClock;
use idpool::pool::PoolSettings;
use reqwest::StatusCode;
use serde_json::json;

use crate::helpers::{TestApp, TestEnv, assert_distinct};

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
    seqs.extend(app.issue("GROW", "1", depth + 1).await.1);
    assert_distinct(&seqs, "GROW after idling");
    let shrunk = pool_target(&env, &app).await;
    assert_eq!(shrunk, grown / 2, "target after an idle spell");
}
