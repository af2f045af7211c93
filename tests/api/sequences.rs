//! Sequence definitions: defaults on first use, the 409/force rule, live figures.

use reqwest::StatusCode;
use serde_json::json;

use crate::support::app::{TestEnv, assert_problem};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sequence_used_before_it_is_defined_gets_the_defaults() {
    let app = TestEnv::new().spawn().await;
    app.issue("NEW", "1", 2).await;
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
    // The first refill brought the pool up to pool_size after serving the request.
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
}
