//! Bad input gets a clear 4xx problem+json answer and changes nothing.

use crate::support::probes::*;
use std::time::Duration;

use reqwest::StatusCode;
use serde_json::{Value, json};

use crate::support::app::{TestApp, TestEnv, assert_problem};

async fn post_raw(
    app: &TestApp,
    path: &str,
    content_type: Option<&str>,
    body: impl Into<reqwest::Body>,
) -> reqwest::Response {
    let mut request = app.client.post(app.url(path)).body(body);
    if let Some(content_type) = content_type {
        request = request.header("content-type", content_type);
    }
    request.send().await.unwrap()
}

async fn nothing_was_created(app: &TestApp) {
    let (status, list) = app.get_json("/api/v1/sequences").await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(
        list["sequences"],
        json!([]),
        "a rejected request created a sequence"
    );
    let ledger: i64 = sqlx::query_scalar("SELECT count(*) FROM issuance_ledger")
        .fetch_one(&app.db)
        .await
        .unwrap();
    assert_eq!(ledger, 0, "a rejected request issued numbers");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_bad_ids_request_gets_its_problem_and_changes_nothing() {
    let app = TestEnv::new().spawn().await;
    let json_type = Some("application/json");
    let cases: Vec<(Value, &str)> = vec![
        (
            json!({"project": "PR-OJ", "type": "9012"}),
            "invalid_project",
        ),
        (json!({"project": "", "type": "9012"}), "invalid_project"),
        (
            json!({"project": "P".repeat(33), "type": "9012"}),
            "invalid_project",
        ),
        (json!({"project": "PROJ", "type": "90 12"}), "invalid_type"),
        (json!({"project": "PROJ", "type": ""}), "invalid_type"),
        (
            json!({"project": "PROJ", "type": "9012", "count": 0}),
            "invalid_count",
        ),
        (
            json!({"project": "PROJ", "type": "9012", "count": 10001}),
            "invalid_count",
        ),
        (
            json!({"project": "PROJ", "type": "9012", "count": -5}),
            "invalid_count",
        ),
        (
            json!({"project": "PROJ", "type": "9012", "count": 1.5}),
            "invalid_body",
        ),
        (
            json!({"project": "PROJ", "type": "9012", "count": "3"}),
            "invalid_body",
        ),
        (
            json!({"project": "PROJ", "type": "9012", "extra": true}),
            "invalid_body",
        ),
        (json!({"type": "9012"}), "invalid_body"),
        (json!({"project": 7, "type": "9012"}), "invalid_body"),
        (json!(["PROJ", "9012"]), "invalid_body"),
    ];
    for path in ["/ids", "/api/v1/ids"] {
        for (body, code) in &cases {
            let response = post_raw(&app, path, json_type, body.to_string()).await;
            let problem = assert_problem(response, StatusCode::BAD_REQUEST, code).await;
            assert!(!problem["detail"].as_str().unwrap().is_empty());
        }
        // Past a double's precision: as written, these are no integers.
        for count in ["1.9999999999999999999", "10000.000000000000001"] {
            let body = format!(r#"{{"project": "PROJ", "type": "9012", "count": {count}}}"#);
            let response = post_raw(&app, path, json_type, body).await;
            assert_problem(response, StatusCode::BAD_REQUEST, "invalid_body").await;
        }
        let malformed = post_raw(&app, path, json_type, "{\"project\": \"PROJ\",").await;
        assert_problem(malformed, StatusCode::BAD_REQUEST, "invalid_json").await;
        let with_bom = post_raw(
            &app,
            path,
            json_type,
            "\u{feff}{\"project\": \"PROJ\", \"type\": \"9012\"}",
        )
        .await;
        let problem = assert_problem(with_bom, StatusCode::BAD_REQUEST, "invalid_body").await;
        assert!(
            problem["detail"]
                .as_str()
                .unwrap_or_default()
                .contains("byte-order mark"),
            "{problem}"
        );
        let empty = post_raw(&app, path, json_type, "").await;
        assert_eq!(empty.status(), StatusCode::BAD_REQUEST);
        let no_type = post_raw(
            &app,
            path,
            None,
            json!({"project": "PROJ", "type": "9012"}).to_string(),
        )
        .await;
        assert_problem(
            no_type,
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported_media_type",
        )
        .await;
        let text = post_raw(&app, path, Some("text/plain"), "PROJ 9012").await;
        assert_problem(
            text,
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported_media_type",
        )
        .await;
        let ids = json!({"project": "PROJ", "type": "9012"}).to_string();
        let latin1 = post_raw(
            &app,
            path,
            Some("application/json; charset=latin1"),
            ids.clone(),
        );
        assert_problem(
            latin1.await,
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported_media_type",
        )
        .await;
        let gzip = app
            .client
            .post(app.url(path))
            .header("content-type", "application/json")
            .header("content-encoding", "gzip")
            .body(ids)
            .send()
            .await
            .unwrap();
        assert_problem(
            gzip,
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported_media_type",
        )
        .await;

        let huge = format!(
            "{{\"project\": \"PROJ\", \"type\": \"9012\", \"pad\": \"{}\"}}",
            "x".repeat(70_000)
        );
        let too_large = post_raw(&app, path, json_type, huge).await;
        assert_problem(too_large, StatusCode::PAYLOAD_TOO_LARGE, "body_too_large").await;
    }
    nothing_was_created(&app).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_sequence_definitions_and_queries_get_their_problems() {
    let app = TestEnv::new().spawn().await;
    let cases: Vec<(Value, &str)> = vec![
        (json!({"format": "{project}-{type}"}), "seq"),
        (json!({"format": "{project}-{seq}-{seq}"}), "seq"),
        (json!({"format": "{user}-{seq}"}), "unknown token"),
        (json!({"format": "{seq:0}"}), "seq:N"),
        (json!({"format": "{date:%Q}{seq}"}), "strftime"),
        // chrono reads %#z but cannot print it.
        (
            json!({"format": "{project}-{date:%#z}-{seq}"}),
            "not supported",
        ),
        (json!({"format": "{seq", "reset": "never"}), "never closed"),
        (
            json!({"format": "{type}{date:%Y%m}{seq:4}", "reset": "daily"}),
            "change every period",
        ),
        (json!({"timezone": "Mars/Olympus"}), "IANA"),
        (json!({"start": 10, "max": 5}), "max"),
        (json!({"pool_size": 0}), "pool_size"),
        (json!({"refill_at": 1.5}), "refill_at"),
        (json!({"layout": "int64", "reset": "monthly"}), "daily"),
        (
            json!({"format": format!("{}{{seq}}", "x".repeat(60))}),
            "64",
        ),
        // IDs that would print as other IDs: a direction override, a
        // zero-width space.
        (json!({"format": "S\u{202E}{seq}"}), "U+202E"),
        (json!({"format": "{project}\u{200B}-{seq}"}), "U+200B"),
    ];
    for (body, mention) in cases {
        let response = app.put_sequence("PROJ", "9012", body.clone()).await;
        let problem = assert_problem(response, StatusCode::BAD_REQUEST, "invalid_definition").await;
        let detail = problem["detail"].as_str().unwrap();
        assert!(
            detail.contains(mention),
            "{body}: detail {detail:?} should mention {mention:?}"
        );
    }
    let unknown = app
        .put_sequence("PROJ", "9012", json!({"colour": "blue"}))
        .await;
    assert_problem(unknown, StatusCode::BAD_REQUEST, "invalid_body").await;
    let wrong_reset = app
        .put_sequence("PROJ", "9012", json!({"reset": "hourly"}))
        .await;
    assert_problem(wrong_reset, StatusCode::BAD_REQUEST, "invalid_body").await;
    let bad_path = app.put_sequence("PR-OJ", "9012", json!({})).await;
    assert_problem(bad_path, StatusCode::BAD_REQUEST, "invalid_project").await;

    let missing = app
        .client
        .get(app.url("/api/v1/sequences/NOPE/1"))
        .send()
        .await
        .unwrap();
    assert_problem(missing, StatusCode::NOT_FOUND, "sequence_not_found").await;
    let bad_limit = app
        .client
        .get(app.url("/api/v1/sequences?limit=0"))
        .send()
        .await
        .unwrap();
    assert_problem(bad_limit, StatusCode::BAD_REQUEST, "invalid_limit").await;
    let bad_cursor = app
        .client
        .get(app.url("/api/v1/sequences?cursor=zzz"))
        .send()
        .await
        .unwrap();
    assert_problem(bad_cursor, StatusCode::BAD_REQUEST, "invalid_cursor").await;
    let unknown_param = app
        .client
        .get(app.url("/api/v1/sequences?colour=blue"))
        .send()
        .await
        .unwrap();
    assert_problem(unknown_param, StatusCode::BAD_REQUEST, "invalid_query").await;
    let no_route = app
        .client
        .get(app.url("/api/v1/nothing"))
        .send()
        .await
        .unwrap();
    assert_problem(no_route, StatusCode::NOT_FOUND, "not_found").await;
    let wrong_method = app.client.get(app.url("/ids")).send().await.unwrap();
    assert_problem(
        wrong_method,
        StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
    )
    .await;
    nothing_was_created(&app).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strings_postgres_cannot_store_are_refused_wherever_they_appear() {
    let app = TestEnv::new().spawn().await;
    let probe = Probe::start(&app).await;
    let documents = [
        r#"{"project":"P","type":"T","metadata":{"a":"x\u0000y"}}"#,
        r#"{"project":"P","type":"T","metadata":{"a":{"b":[1,{"c":"\u0000"}]}}}"#,
        r#"{"project":"P","type":"T","metadata":{"k\u0000":1}}"#,
        r#"{"project":"P","type":"T","metadata":{"a":"\ud800"}}"#,
        r#"{"project":"P","type":"T","metadata":{"a":"\udc00\ud800"}}"#,
        r#"{"project":"P","type":"T","metadata":{},"id":"P-T-\u0000"}"#,
        r#"{"project":"P\u0000","type":"T","metadata":{}}"#,
    ];
    for body in documents {
        for path in ["/documents", "/api/v1/documents"] {
            let response = app
                .client
                .post(app.url(path))
                .header("content-type", "application/json")
                .header("idempotency-key", "same-key")
                .body(body)
                .send()
                .await
                .unwrap();
            assert_problem(response, StatusCode::BAD_REQUEST, "invalid_character").await;
        }
    }
    // A batch names its first bad item, as it does for every other fault.
    let good = r#"{"project":"P","type":"T","metadata":{}}"#;
    for (bad, index) in [(documents[0], 0), (documents[3], 2), (documents[2], 1)] {
        let mut items = vec![good; 3];
        items.insert(index, bad);
        let batch = format!(r#"{{"documents":[{}]}}"#, items.join(","));
        let response = app
            .client
            .post(app.url("/api/v1/documents/batch"))
            .header("content-type", "application/json")
            .body(batch)
            .send()
            .await
            .unwrap();
        let problem = assert_problem(response, StatusCode::BAD_REQUEST, "invalid_character").await;
        assert_eq!(problem["index"], index, "{problem}");
    }
    let ids = app
        .client
        .post(app.url("/ids"))
        .header("content-type", "application/json")
        .body(r#"{"project":"P","type":"\u0000"}"#)
        .send()
        .await
        .unwrap();
    assert_problem(ids, StatusCode::BAD_REQUEST, "invalid_character").await;
    let definition = app
        .client
        .put(app.url("/api/v1/sequences/P/T"))
        .header("content-type", "application/json")
        .body(r#"{"format":"{seq}\u0000"}"#)
        .send()
        .await
        .unwrap();
    assert_problem(definition, StatusCode::BAD_REQUEST, "invalid_character").await;

    for path in [
        "/api/v1/documents/%00",
        "/api/v1/documents/P-T-1%00",
        "/api/v1/outbox?project=%00",
        "/api/v1/outbox?status=pending&type=T%00",
        "/api/v1/ids/gaps?project=P&type=T&period=%00",
        "/api/v1/sequences?cursor=%00",
        "/api/v1/sequences/P/T%00",
    ] {
        let response = app.client.get(app.url(path)).send().await.unwrap();
        assert_problem(response, StatusCode::BAD_REQUEST, "invalid_character").await;
    }
    for path in [
        "/api/v1/outbox/P-T-1%00/retry",
        "/api/v1/outbox/%00/abandon",
    ] {
        let response = app.client.post(app.url(path)).send().await.unwrap();
        assert_problem(response, StatusCode::BAD_REQUEST, "invalid_character").await;
    }

    // Header values: the HTTP parser refuses a NUL byte outright, and a
    // key that is not printable ASCII is the request's 400.
    let body = r#"{"project":"P","type":"T"}"#;
    let with_nul = format!(
        "POST /ids HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nIdempotency-Key: a\0b\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    let answer = raw_exchange(&app, with_nul.as_bytes(), Duration::from_secs(2)).await;
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
    let mut high = format!(
        "POST /ids HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nIdempotency-Key: a",
        app.admin_key,
        body.len()
    )
    .into_bytes();
    high.extend_from_slice(b"\xff\xfeb\r\nConnection: close\r\n\r\n");
    high.extend_from_slice(body.as_bytes());
    let answer = raw_exchange(&app, &high, Duration::from_secs(2)).await;
    assert!(
        answer.starts_with("HTTP/1.1 400") && answer.contains("invalid_idempotency_key"),
        "{answer}"
    );
    probe.assert_unharmed("unstorable strings").await;
    nothing_written(&app, 0).await;
}

/// `jsonb` prints a number in full: `1e131000` is 8 bytes sent and
/// 131,001 characters in every outbox read and delivery, so a small
/// document of such numbers stalled every tenant's deliveries (hostile
/// review). Metadata is bounded as it is printed, and nothing is taken
/// for a refused one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn numbers_printed_past_the_metadata_limit_are_refused_before_a_number_is_taken() {
    let app = TestEnv::new().spawn().await;
    let probe = Probe::start(&app).await;
    let many: Vec<String> = (0..9000).map(|i| format!(r#""k{i}": 1e131000"#)).collect();
    let refused = [
        (
            format!("{{{}}}", many.join(",")),
            StatusCode::PAYLOAD_TOO_LARGE,
            "metadata_too_large",
        ),
        (
            r#"{"n": [1e131000, 1e131000, 1e131000]}"#.to_owned(),
            StatusCode::PAYLOAD_TOO_LARGE,
            "metadata_too_large",
        ),
        (
            r#"{"n": 1e200000}"#.to_owned(),
            StatusCode::BAD_REQUEST,
            "unstorable_value",
        ),
        (
            r#"{"n": -1e-20000}"#.to_owned(),
            StatusCode::BAD_REQUEST,
            "unstorable_value",
        ),
        // A zero, but an exponent numeric refuses to read.
        (
            r#"{"a": 0e99999999999999999999}"#.to_owned(),
            StatusCode::BAD_REQUEST,
            "unstorable_value",
        ),
    ];
    for (metadata, status, code) in &refused {
        let body = format!(r#"{{"project":"BIG","type":"1","metadata":{metadata}}}"#);
        let single = app
            .client
            .post(app.url("/documents"))
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await
            .unwrap();
        assert_problem(single, *status, code).await;
        let good = r#"{"project":"BIG","type":"1","metadata":{}}"#;
        let batch = format!(
            r#"{{"documents":[{good},{good},{{"project":"BIG","type":"1","metadata":{metadata}}}]}}"#
        );
        let batch = app
            .client
            .post(app.url("/api/v1/documents/batch"))
            .header("content-type", "application/json")
            .body(batch)
            .send()
            .await
            .unwrap();
        let problem = assert_problem(batch, *status, code).await;
        assert_eq!(problem["index"], 2, "{problem}");
    }
    probe.assert_unharmed("numbers printed in full").await;
    nothing_written(&app, 0).await;
    // Within the limit as printed, numbers of any size are kept exactly.
    let kept = app
        .client
        .post(app.url("/documents"))
        .header("content-type", "application/json")
        .body(r#"{"project":"BIG","type":"1","metadata":{"n":1e100000,"d":0.10000000000000000000001}}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(kept.status(), StatusCode::ACCEPTED);
}
