//! Joined direct reservations against a real database.

use super::*;
use crate::domain::sequence::{ProjectCode, TypeCode};
use crate::records::sequence_store::SequenceStore;

async fn defined(store: &SequenceStore, project: &str, doc_type: &str) -> Arc<Sequence> {
    let project = ProjectCode::parse(project).expect("project");
    let doc_type = TypeCode::parse(doc_type).expect("type");
    store
        .get_or_create(&project, &doc_type)
        .await
        .expect("sequence")
}

fn got(reply: &Result<Reserved<SeqRange>, DirectError>) -> SeqRange {
    match reply {
        Ok(Reserved::Got(range)) => *range,
        other => panic!("expected numbers, got {other:?}"),
    }
}

/// Concurrent asks of many counters: one statement and block per
/// counter for all its askers, each ask its own run of numbers in the
/// order asked, none shared; an ask under a definition changed meanwhile is told so beside
/// one under the new definition that is served; asks that together
/// exceed what is left below `max` are served one by one while they fit.
#[tokio::test]
async fn concurrent_asks_share_one_statement_and_each_gets_its_own_numbers() {
    let db = crate::infra::db::scratch().await;
    let store = SequenceStore::new(db.clone(), 100);
    let counter = Arc::new(Counter::new(db.clone(), "test".to_owned()));
    let tasks = TaskTracker::new();
    let direct = DirectReservations::spawn(counter.clone(), db.clone(), &tasks);

    let busy: Vec<Arc<Sequence>> = futures::future::join_all((0..20).map(|i| {
        let store = &store;
        async move { defined(store, &format!("J{i}"), "1").await }
    }))
    .await;
    let period = busy[0].definition.period_at(chrono::Utc::now());

    // A sequence whose identity changes after it was read.
    let stale = defined(&store, "JOLD", "1").await;
    sqlx::query("UPDATE sequences SET identity_version = identity_version + 1 WHERE id = $1")
        .bind(stale.id)
        .execute(&db)
        .await
        .expect("identity changed");
    let fresh = store
        .get("JOLD", "1")
        .await
        .expect("read")
        .expect("defined");

    // A sequence with ten numbers left.
    let near = defined(&store, "JMAX", "1").await;
    let first = near.first_number(&period);
    sqlx::query("UPDATE sequences SET max_seq = $2 WHERE id = $1")
        .bind(near.id)
        .bind(first + 9)
        .execute(&db)
        .await
        .expect("max set");
    let near = store
        .get("JMAX", "1")
        .await
        .expect("read")
        .expect("defined");

    // Every ask queued before the worker runs (one thread): one batch.
    let mut asks = Vec::new();
    for round in 0..3 {
        for sequence in &busy {
            asks.push((sequence.clone(), 2 + round));
        }
    }
    asks.push((stale.clone(), 1));
    asks.push((fresh.clone(), 1));
    for _ in 0..3 {
        asks.push((near.clone(), 4));
    }
    let replies = futures::future::join_all(
        asks.iter()
            .map(|(sequence, n)| direct.reserve(sequence, &period, *n)),
    )
    .await;

    for (i, sequence) in busy.iter().enumerate() {
        let runs: Vec<SeqRange> = (0..3).map(|round| got(&replies[round * 20 + i])).collect();
        let start = sequence.first_number(&period);
        assert_eq!(
            runs,
            vec![
                SeqRange::new(start, start + 2),
                SeqRange::new(start + 2, start + 5),
                SeqRange::new(start + 5, start + 9),
            ],
            "{}: each ask its own numbers, in the order asked",
            sequence.project
        );
    }
    assert!(
        matches!(replies[60], Ok(Reserved::Stale)),
        "an ask under the old definition: {:?}",
        replies[60]
    );
    assert_eq!(got(&replies[61]).len(), 1);
    assert_eq!(got(&replies[62]), SeqRange::new(first, first + 4));
    assert_eq!(got(&replies[63]), SeqRange::new(first + 4, first + 8));
    assert!(
        matches!(replies[64], Ok(Reserved::Exhausted)),
        "two numbers left for an ask of four: {:?}",
        replies[64]
    );

    let busy_ids: Vec<i64> = busy.iter().map(|s| s.id).collect();
    let blocks: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM blocks WHERE purpose = 'direct' AND sequence_id = ANY($1)",
    )
    .bind(&busy_ids)
    .fetch_one(&db)
    .await
    .expect("blocks");
    assert_eq!(blocks, 20, "one block per counter for its three asks");
    let next: Vec<i64> = sqlx::query_scalar(
        "SELECT next_seq FROM counters WHERE sequence_id = ANY($1) ORDER BY sequence_id",
    )
    .bind(&busy_ids)
    .fetch_all(&db)
    .await
    .expect("counters");
    assert!(
        next.iter()
            .zip(&busy)
            .all(|(next, s)| *next == s.first_number(&period) + 9),
        "each counter moved by its asks' total: {next:?}"
    );
}
