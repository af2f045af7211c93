//! What a page of gaps reads (SPEC: a list costs in proportion to the page
//! it returns, an index serving each filter), counted in rows by the plans
//! Postgres ran, beside a sequence of another project with 20,000 gaps.

use super::*;
use crate::infra::db::plans::Explained;

/// Sequence 1 (A/T): gaps at 10, 20, 30, 40 of which 40 is a discarded
/// pool. Sequence 2 (B/T): 20,000 open gaps of its own, none discarded but
/// the last, and 20,000 resolved.
async fn beside_a_big_one() -> Db {
    let db = crate::infra::db::scratch().await;
    sqlx::raw_sql(
        "INSERT INTO sequences (id, project, doc_type, format, layout, start_seq, reset, timezone, \
           pool_size, refill_at) VALUES \
           (1, 'A', 'T', '{project}-{seq}', 'text', 1, 'never', 'UTC', 100, 0.2), \
           (2, 'B', 'T', '{project}-{seq}', 'text', 1, 'never', 'UTC', 100, 0.2); \
         INSERT INTO id_gaps (sequence_id, period, from_seq, to_seq, from_id, to_id, reason, detected_at) \
           SELECT 1, '', n, n, 'A-' || n, 'A-' || n, \
                  CASE WHEN n = 40 THEN 'pool_discarded' ELSE 'untracked_loss' END, now() \
           FROM unnest(ARRAY[10, 20, 30, 40]) AS n; \
         INSERT INTO id_gaps (sequence_id, period, from_seq, to_seq, from_id, to_id, reason, detected_at, resolved_at) \
           SELECT 2, '', n, n, 'B-' || n, 'B-' || n, \
                  CASE WHEN n = 40000 THEN 'pool_discarded' ELSE 'untracked_loss' END, now(), \
                  CASE WHEN n % 2 = 0 THEN NULL ELSE now() END \
           FROM generate_series(1, 40000) AS n; \
         INSERT INTO pool_discards (sequence_id, period, seqs, cause) VALUES \
           (1, '', '[40,41)', 'redis_lost'), (2, '', '[40000,40001)', 'redis_lost'); \
         ANALYZE id_gaps; ANALYZE sequences; ANALYZE pool_discards",
    )
    .execute(&db)
    .await
    .expect("seed the gaps");
    db
}

fn query<'a>(sequence_id: i64) -> GapQuery<'a> {
    GapQuery {
        sequence_id,
        gapless: false,
        period: None,
        reason: None,
        cause: None,
        after: None,
        limit: 2,
    }
}

/// Rows the one listing statement read, and that it scanned no table of
/// gaps from end to end.
fn rows_read(explained: &Explained) -> u64 {
    let plans = explained.take("FROM id_gaps");
    assert_eq!(plans.len(), 1, "one statement a page: {plans:?}");
    let plan = &plans[0];
    assert!(
        !plan.sequential_scans().iter().any(|t| t == "id_gaps"),
        "the gaps were read end to end: {}",
        plan.describe()
    );
    plan.rows_read()
}

#[tokio::test]
async fn a_page_of_gaps_reads_its_own_rows_whatever_other_sequences_hold() {
    let db = beside_a_big_one().await;
    let explained = Explained::on(&db).await;
    // Every page of A, through its cursor: two gaps, then two, then none.
    let mut after = None;
    let mut seen = Vec::new();
    for want in [2, 2, 0] {
        let page = list(
            &explained.db,
            &GapQuery {
                after: after.clone(),
                ..query(1)
            },
        )
        .await
        .expect("a page");
        assert_eq!(page.len(), want, "{page:?}");
        // The page, and the two discards (of A and B) the cause of a
        // discarded gap is looked for among.
        let read = rows_read(&explained);
        assert!(read <= 2 + 2, "A's page of {want} read {read} rows");
        after = page.last().map(|g| (g.period.clone(), g.from_seq));
        seen.extend(page.into_iter().map(|g| g.from_seq));
    }
    assert_eq!(seen, [10, 20, 30, 40]);
    // A page from the middle of B's 20,000 reads as little.
    let page = list(
        &explained.db,
        &GapQuery {
            after: Some((String::new(), 20_000)),
            limit: 100,
            ..query(2)
        },
    )
    .await
    .expect("B's page");
    assert_eq!(page.first().map(|g| g.from_seq), Some(20_002));
    let read = rows_read(&explained);
    assert!(read <= 101, "B's page of 100 read {read} rows");
}

#[tokio::test]
async fn a_page_of_gaps_of_one_reason_reads_only_gaps_of_that_reason() {
    let db = beside_a_big_one().await;
    let explained = Explained::on(&db).await;
    // B's one discarded pool comes after 19,999 gaps of another reason.
    let discarded = Some(Reason::PoolDiscarded);
    for (reason, cause) in [
        (discarded, None),
        (discarded, Some("redis_lost")),
        (None, Some("redis_lost")),
    ] {
        let page = list(
            &explained.db,
            &GapQuery {
                reason,
                cause,
                ..query(2)
            },
        )
        .await
        .expect("B's discarded pools");
        assert_eq!(
            page.iter().map(|g| g.from_seq).collect::<Vec<_>>(),
            [40_000]
        );
        // The gap, and the two discards looked among for its cause, twice
        // when the cause is asked.
        let read = rows_read(&explained);
        assert!(
            read <= 1 + 2 + 2,
            "one discarded pool of B ({reason:?}, {cause:?}) read {read} rows"
        );
    }
    // A cause is a discarded pool's only.
    let none = list(
        &explained.db,
        &GapQuery {
            reason: Some(Reason::UntrackedLoss),
            cause: Some("redis_lost"),
            ..query(2)
        },
    )
    .await
    .expect("no such gaps");
    assert!(none.is_empty(), "{none:?}");
}
