//! Every statement of the outbox that is put together at run time (the
//! status and type filters of a listing, a transition's columns, a claim
//! with or without payloads), run against a real database: the query
//! macros check the others at compile time.

use super::*;

/// (document, project, type, status); seq is the position in this list.
/// IDs whose text sorts otherwise than the order they came in (9 before
/// 10), as numbers past 9 do.
const DOCUMENTS: [(&str, &str, &str, DocumentStatus); 9] = [
    ("AAA-T1-9", "AAA", "T1", DocumentStatus::Pending),
    ("AAA-T1-10", "AAA", "T1", DocumentStatus::Committed),
    ("AAA-T1-11", "AAA", "T1", DocumentStatus::Pending),
    ("AAA-T2-9", "AAA", "T2", DocumentStatus::DeadLetter),
    ("AAA-T2-10", "AAA", "T2", DocumentStatus::DeadLetter),
    ("AAA-T2-11", "AAA", "T2", DocumentStatus::Abandoned),
    ("AAA-T2-12", "AAA", "T2", DocumentStatus::Pending),
    ("BBB-T1-9", "BBB", "T1", DocumentStatus::Pending),
    ("BBB-T1-10", "BBB", "T1", DocumentStatus::Pending),
];

async fn seeded() -> Db {
    let db = crate::infra::db::scratch().await;
    for (seq, (id, project, doc_type, status)) in DOCUMENTS.iter().enumerate() {
        sqlx::query(
            "INSERT INTO id_outbox (document_id, tenant_code, entity_type_id, payload, status, \
             sequence_id, period, seq, seq_number, next_retry_at) \
             VALUES ($1, $2, $3, '{\"n\": 1}', $4, 1, '', $5, $5, now() - interval '1 second')",
        )
        .bind(id)
        .bind(project)
        .bind(doc_type)
        .bind(status.as_str())
        .bind(seq as i64)
        .execute(&db)
        .await
        .expect("seed document");
    }
    db
}

/// The seeded documents matching, in the order a listing gives them.
fn expected(
    project: Option<&str>,
    doc_type: Option<&str>,
    status: Option<DocumentStatus>,
) -> Vec<&'static str> {
    DOCUMENTS
        .iter()
        .filter(|d| project.is_none_or(|p| d.1 == p))
        .filter(|d| doc_type.is_none_or(|t| d.2 == t))
        .filter(|d| status.is_none_or(|s| d.3 == s))
        .map(|d| d.0)
        .collect()
}

fn ids(page: &[DocumentView]) -> Vec<&str> {
    page.iter().map(|d| d.id.as_str()).collect()
}

#[tokio::test]
async fn every_listing_filter_lists_what_it_names() {
    let db = seeded().await;
    let aaa = ["AAA".to_owned()];
    let statuses = DocumentStatus::ALL.map(Some);
    for status in statuses.into_iter().chain([None]) {
        for doc_type in [None, Some("T2")] {
            // A key of one project (list_project), an admin (list_everything).
            for projects in [Some(&aaa[..]), None] {
                let filter = ListFilter {
                    status,
                    projects,
                    project: None,
                    doc_type,
                    after: None,
                    limit: 100,
                };
                let page = list(&db, &filter).await.expect("list");
                let project = projects.map(|_| "AAA");
                let want = expected(project, doc_type, status);
                let case = format!("status {status:?}, type {doc_type:?}, projects {projects:?}");
                assert_eq!(ids(&page), want, "{case}");
                // Page by page, each from the cursor of the one before.
                let mut paged: Vec<String> = Vec::new();
                loop {
                    let one = ListFilter {
                        after: paged.last().map(String::as_str),
                        limit: 1,
                        ..filter
                    };
                    let page = list(&db, &one).await.expect("a page");
                    if page.is_empty() {
                        break;
                    }
                    paged.extend(page.into_iter().map(|d| d.id));
                    assert!(paged.len() <= want.len(), "{case}: pages repeat {paged:?}");
                }
                assert_eq!(paged, want, "{case}: paged");
            }
        }
    }
    let after_first = ListFilter {
        status: None,
        projects: Some(&aaa),
        project: None,
        doc_type: None,
        after: Some("AAA-T1-9"),
        limit: 2,
    };
    let page = list(&db, &after_first).await.expect("list after a cursor");
    assert_eq!(ids(&page), ["AAA-T1-10", "AAA-T1-11"]);
}

#[tokio::test]
async fn a_document_is_found_only_by_a_caller_of_its_project() {
    let db = seeded().await;
    let found = find(&db, "AAA-T2-9", None).await.expect("find");
    let found = found.expect("an admin finds any document");
    assert_eq!(
        (
            found.project.as_str(),
            found.doc_type.as_str(),
            found.status
        ),
        ("AAA", "T2", DocumentStatus::DeadLetter)
    );
    let bbb = ["BBB".to_owned()];
    let hidden = find(&db, "AAA-T2-9", Some(&bbb)).await.expect("find");
    assert!(hidden.is_none(), "another project's key sees nothing");
}

/// SPEC: another project's document answers as one that does not exist,
/// in the same timing class. Either way the lookup is the same single probe
/// of the index on the ID and sends nothing back; the other project's row
/// costs the one row its project is checked on, whatever that project
/// holds.
#[tokio::test]
async fn another_projects_document_is_looked_up_like_one_that_does_not_exist() {
    let db = seeded().await;
    // Enough documents that the index is the way to any of them.
    sqlx::raw_sql(
        "INSERT INTO id_outbox (document_id, tenant_code, entity_type_id, payload, status, \
         sequence_id, period, seq, seq_number) \
         SELECT 'BIG-' || n, 'BIG', 'T', '{}', 'committed', 2, '', n, n \
         FROM generate_series(1, 20000) AS n; ANALYZE id_outbox",
    )
    .execute(&db)
    .await
    .expect("another project's documents");
    let explained = crate::infra::db::plans::Explained::on(&db).await;
    let bbb = ["BBB".to_owned()];
    let mut plans = Vec::new();
    for id in ["BIG-7", "BIG-999999"] {
        let found = find(&explained.db, id, Some(&bbb)).await.expect("find");
        assert!(found.is_none(), "{id} is not BBB's");
        let mut taken = explained.take("FROM id_outbox");
        assert_eq!(taken.len(), 1, "one statement: {taken:?}");
        plans.push(taken.remove(0));
    }
    let (foreign, made_up) = (&plans[0], &plans[1]);
    assert_eq!(foreign.shape(), made_up.shape(), "one plan for both");
    assert!(
        foreign.sequential_scans().is_empty(),
        "{:?}",
        foreign.shape()
    );
    assert_eq!(
        (foreign.rows_returned(), made_up.rows_returned()),
        (0, 0),
        "no row leaves the server"
    );
    assert!(
        foreign.rows_read() <= made_up.rows_read() + 1,
        "another project's document read {} rows, a made-up one {}",
        foreign.rows_read(),
        made_up.rows_read()
    );
    assert!(
        foreign.pages() <= made_up.pages() + 1,
        "another project's document read {} pages, a made-up one {}",
        foreign.pages(),
        made_up.pages()
    );
}

#[tokio::test]
async fn retry_and_abandon_set_what_they_promise() {
    let db = seeded().await;
    let retried = retry(&db, "AAA-T2-9", None).await.expect("retry");
    assert_eq!(retried.status, DocumentStatus::Pending);
    assert_eq!(retried.retry_count, 0);
    assert!(retried.processed_at.is_none() && retried.next_retry_at.is_some());
    let abandoned = abandon(&db, "AAA-T1-9", None).await.expect("abandon");
    assert_eq!(abandoned.status, DocumentStatus::Abandoned);
    assert!(abandoned.processed_at.is_some() && abandoned.next_retry_at.is_none());
    let refused = abandon(&db, "AAA-T1-10", None).await;
    assert!(
        matches!(refused, Err(TransitionError::NotAllowed { .. })),
        "a delivered document is not abandoned"
    );
}

#[tokio::test]
async fn a_claim_takes_due_pending_documents_with_or_without_payloads() {
    let db = seeded().await;
    let tenants = ["AAA".to_owned(), "BBB".to_owned()];
    for with_payload in [true, false] {
        let mut tx = db.begin().await.expect("begin");
        let claimed = claim_due(&mut tx, 10, with_payload, &tenants)
            .await
            .expect("claim");
        let mut claimed: Vec<(&str, Option<&str>)> = claimed
            .iter()
            .map(|d| (d.document_id.as_str(), d.payload.as_deref()))
            .collect();
        claimed.sort_unstable();
        let payload = with_payload.then_some("{\"n\": 1}");
        assert_eq!(
            claimed,
            [
                ("AAA-T1-11", payload),
                ("AAA-T1-9", payload),
                ("AAA-T2-12", payload),
                ("BBB-T1-10", payload),
                ("BBB-T1-9", payload)
            ],
            "with payload: {with_payload}"
        );
        tx.rollback().await.expect("rollback");
    }
}

/// The most retries the configuration allows at the default base and cap:
/// every failure is recorded (before the cap, the 44th wait did not fit a
/// timestamp and the row was delivered again forever), no wait is longer
/// than the cap and its jitter, waits of one failure differ between rows,
/// and the last failure dead-letters the document.
#[tokio::test]
async fn a_delivery_failing_as_often_as_allowed_ends_dead_lettered_after_capped_waits() {
    let db = seeded().await;
    let retry = Retry {
        max_retries: 1000,
        backoff_base: std::time::Duration::from_secs(1),
        backoff_max: std::time::Duration::from_secs(3600),
    };
    let rows: Vec<i64> =
        sqlx::query_scalar("SELECT id FROM id_outbox WHERE tenant_code = 'BBB' ORDER BY id")
            .fetch_all(&db)
            .await
            .expect("rows");
    let cap = retry.backoff_max.as_secs_f64() * (1.0 + JITTER);
    let mut dead = 0;
    let mut capped_waits_differ = false;
    for failure in 1..=retry.max_retries {
        let mut tx = db.begin().await.expect("begin");
        let failed: Vec<(i64, String)> = rows.iter().map(|id| (*id, "http_500".into())).collect();
        dead += mark_failed(&mut tx, &failed, &retry)
            .await
            .unwrap_or_else(|e| panic!("failure {failure} not recorded: {e}"));
        tx.commit().await.expect("commit");
        let waits: Vec<f64> = sqlx::query_scalar(
            "SELECT extract(epoch FROM next_retry_at - clock_timestamp())::float8 \
             FROM id_outbox WHERE tenant_code = 'BBB' ORDER BY id",
        )
        .fetch_all(&db)
        .await
        .expect("waits");
        for wait in &waits {
            assert!(
                *wait <= cap,
                "failure {failure}: wait {wait} s above the cap"
            );
        }
        if failure == 100 {
            // Deep in the capped part: each wait is between the cap and
            // the cap plus its jitter, and the two rows' differ.
            assert!(
                waits
                    .iter()
                    .all(|w| *w >= retry.backoff_max.as_secs_f64() - 5.0)
            );
            capped_waits_differ = (waits[0] - waits[1]).abs() > 0.001;
        }
    }
    assert!(
        capped_waits_differ,
        "deliveries that failed together retry together"
    );
    assert_eq!(
        dead,
        rows.len(),
        "each document dead-lettered once, at the last failure"
    );
    let statuses: Vec<(String, i32)> = sqlx::query_as(
        "SELECT status, retry_count FROM id_outbox WHERE tenant_code = 'BBB' ORDER BY id",
    )
    .fetch_all(&db)
    .await
    .expect("statuses");
    assert_eq!(
        statuses,
        vec![
            ("dead_letter".to_owned(), 1000),
            ("dead_letter".to_owned(), 1000)
        ]
    );
}

#[test]
fn the_longest_total_wait_adds_every_capped_wait_and_its_jitter() {
    let defaults = Retry {
        max_retries: 5,
        backoff_base: std::time::Duration::from_secs(1),
        backoff_max: std::time::Duration::from_secs(3600),
    };
    // Waits after failures 1-4 (the 5th dead-letters): 2 + 4 + 8 + 16 s.
    assert_eq!(defaults.longest_total_wait().as_secs_f64(), 30.0 * 1.25);
    let most = Retry {
        max_retries: 1000,
        backoff_base: std::time::Duration::from_millis(3_600_000),
        backoff_max: std::time::Duration::from_millis(86_400_000),
    };
    // Past 4 doublings every wait is the 1-day cap: under 3.5 years.
    let years = most.longest_total_wait().as_secs_f64() / (365.0 * 86_400.0);
    assert!(years < 3.5, "{years}");
}
