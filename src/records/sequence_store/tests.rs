//! The definition cache against a real database, with a small bound.

use super::*;

const BOUND: u64 = 100;

fn names(n: usize, prefix: &str) -> Vec<(ProjectCode, TypeCode)> {
    (0..n)
        .map(|i| {
            (
                ProjectCode::parse(&format!("{prefix}{}", i / 50)).expect("project"),
                TypeCode::parse(&format!("{}", 1000 + i % 50)).expect("type"),
            )
        })
        .collect()
}

/// More sequences in use than the cache holds: 80 used over and over,
/// and 300 others each used once in between. The 80 stay cached (the
/// once-used do not push them out), so their uses after the first read no
/// definition; the cache never holds more than its bound.
#[tokio::test]
async fn sequences_used_often_stay_cached_past_the_bound_and_loads_are_counted() {
    let db = crate::infra::db::scratch().await;
    let store = SequenceStore::with_cache_bound(db, 1000, BOUND);
    let hot = names(80, "HOT");
    let cold = names(300, "COLD");
    for (project, doc_type) in hot.iter().chain(&cold) {
        store
            .get_or_create(project, doc_type)
            .await
            .expect("create");
    }
    // Warm: the hot set used a few times, so the cache knows it is used.
    for _ in 0..4 {
        for (project, doc_type) in &hot {
            store.get_or_create(project, doc_type).await.expect("use");
        }
    }
    store.cache.run_pending_tasks().await;
    let before = store.loads();
    for (round, cold) in cold.chunks(30).enumerate() {
        for (project, doc_type) in cold {
            store
                .get_or_create(project, doc_type)
                .await
                .expect("cold use");
        }
        for (project, doc_type) in &hot {
            store
                .get_or_create(project, doc_type)
                .await
                .expect("hot use");
        }
        store.cache.run_pending_tasks().await;
        assert!(
            store.cache.entry_count() <= BOUND,
            "round {round}: {} cached",
            store.cache.entry_count()
        );
    }
    let loads = store.loads() - before;
    // 300 cold uses may each read their definition; 10 rounds of 80 hot
    // uses (800) read at most a few between them.
    assert!(
        loads <= 300 + 40,
        "{loads} definitions read for 300 cold and 800 hot uses"
    );
}

/// Requests for one definition that is not cached wait for one read.
#[tokio::test]
async fn concurrent_misses_of_one_definition_read_it_once() {
    let db = crate::infra::db::scratch().await;
    let store = Arc::new(SequenceStore::with_cache_bound(db, 1000, BOUND));
    let (project, doc_type) = names(1, "ONCE").remove(0);
    store
        .get_or_create(&project, &doc_type)
        .await
        .expect("create");
    store.evict_all();
    store.cache.run_pending_tasks().await;
    let before = store.loads();
    let misses = (0..50).map(|_| {
        let (store, project, doc_type) = (store.clone(), project.clone(), doc_type.clone());
        tokio::spawn(async move { store.get_or_create(&project, &doc_type).await })
    });
    for miss in futures::future::join_all(misses).await {
        miss.expect("task").expect("definition");
    }
    assert_eq!(
        store.loads() - before,
        1,
        "one read for 50 concurrent misses"
    );
}

/// A key's page of sequences reads its own projects' rows (SPEC: a list
/// costs in proportion to its page), counted in rows by the plan Postgres
/// ran, beside a project with 3,000 sequences.
#[tokio::test]
async fn a_page_of_sequences_reads_its_own_rows_whatever_other_projects_hold() {
    let db = crate::infra::db::scratch().await;
    sqlx::raw_sql(
        "INSERT INTO sequences (project, doc_type, format, layout, start_seq, reset, timezone, \
           pool_size, refill_at) \
         SELECT p, t::text, '{project}-{type}-{seq}', 'text', 1, 'never', 'UTC', 100, 0.2 \
         FROM (VALUES ('P', 3), ('BIG', 3000), ('Q', 2)) AS projects (p, n), generate_series(1000, 999 + n) AS t; \
         ANALYZE sequences",
    )
    .execute(&db)
    .await
    .expect("seed the sequences");
    let explained = crate::infra::db::plans::Explained::on(&db).await;
    let store = SequenceStore::with_cache_bound(explained.db.clone(), 1000, BOUND);
    let rows_read = || {
        let plans = explained.take("FROM sequences");
        assert_eq!(plans.len(), 1, "one statement a page: {plans:?}");
        assert!(
            plans[0].sequential_scans().is_empty(),
            "read end to end: {:?}",
            plans[0].shape()
        );
        plans[0].rows_read()
    };
    let scope = ["P".to_owned(), "Q".to_owned()];
    let first = store.list(None, 2, Some(&scope)).await.expect("a page");
    let listed = |page: &[Sequence]| {
        page.iter()
            .map(|s| format!("{}/{}", s.project, s.doc_type))
            .collect::<Vec<_>>()
    };
    assert_eq!(listed(&first), ["P/1000", "P/1001"]);
    // Per project of the scope: its name, and its page and one more.
    let read = rows_read();
    assert!(
        read <= 2 * (1 + 2 + 1),
        "a page of 2 of P and Q read {read} rows"
    );
    let next = store
        .list(Some(("P", "1001")), 2, Some(&scope))
        .await
        .expect("the next page");
    assert_eq!(listed(&next), ["P/1002", "Q/1000"]);
    let read = rows_read();
    assert!(read <= 2 * (1 + 2 + 1), "the next page read {read} rows");
    // A page from the middle of BIG's 3,000 reads as little.
    let big = ["BIG".to_owned()];
    let middle = store
        .list(Some(("BIG", "2500")), 100, Some(&big))
        .await
        .expect("BIG's page");
    assert_eq!(middle.len(), 100);
    let read = rows_read();
    assert!(read <= 1 + 101, "a page of 100 of BIG read {read} rows");
}
