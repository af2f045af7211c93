use super::*;

#[test]
fn an_item_carries_its_source_id_as_json() {
    let settings = Settings {
        file: "-".into(),
        project: ProjectCode::parse("PROJ").unwrap(),
        doc_type: TypeCode::parse("9012").unwrap(),
        url: String::new(),
        key: None,
        batch: 1,
        concurrency: 1,
        out: None,
    };
    let body = document_body(&settings, "a\"b\\c", r#"{"x":1}"#);
    let item: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(item["source_id"], "a\"b\\c");
    assert_eq!(item["project"], "PROJ");
    assert_eq!(item["metadata"]["x"], 1);
}

#[test]
fn a_refusal_naming_an_item_rejects_that_item_alone() {
    let conflict = reqwest::StatusCode::CONFLICT;
    let named = r#"{"code": "document_id_taken", "index": 3}"#;
    assert_eq!(item_at_fault(conflict, named, 10), Some(3));
    assert_eq!(item_at_fault(conflict, named, 3), None);
    let whole = r#"{"code": "source_id_in_use"}"#;
    assert_eq!(item_at_fault(conflict, whole, 10), None);
    assert_eq!(
        item_at_fault(reqwest::StatusCode::TOO_MANY_REQUESTS, named, 10),
        None
    );
    let unavailable = r#"{"code": "unavailable", "index": 3}"#;
    assert_eq!(
        item_at_fault(reqwest::StatusCode::SERVICE_UNAVAILABLE, unavailable, 10),
        None
    );
}

#[test]
fn lines_are_read_or_rejected_with_a_reason() {
    assert_eq!(
        json_document(r#"{"source_id": "a-1", "metadata": {"x": 1}}"#).ok(),
        Some(("a-1".into(), r#"{"x": 1}"#.into()))
    );
    assert_eq!(
        json_document(r#"{"source_id": 42}"#).ok(),
        Some(("42".into(), "{}".into()))
    );
    assert!(json_document(r#"{"metadata": {}}"#).is_err());
    assert!(json_document(r#"{"source_id": ""}"#).is_err());
    assert!(json_document(r#"{"source_id": "a", "metadata": [1]}"#).is_err());
    assert!(json_document("not json").is_err());
}

#[test]
fn rejects_sit_beside_the_mapping() {
    assert_eq!(
        rejects_path(Some(Path::new("/tmp/out/map.jsonl"))),
        PathBuf::from("/tmp/out/map.rejects.jsonl")
    );
    assert_eq!(rejects_path(None), PathBuf::from("import.rejects.jsonl"));
}

#[test]
fn a_retry_waits_at_least_what_the_server_asked_for_within_a_minute() {
    let now = httpdate::parse_http_date("Wed, 21 Oct 2015 07:28:00 GMT").unwrap();
    let asked = |value| retry_after(value, now);
    assert_eq!(asked("3"), Some(Duration::from_secs(3)));
    assert_eq!(asked(" 1 "), Some(Duration::from_secs(1)));
    assert_eq!(asked("86400"), Some(MAX_RETRY_AFTER));
    assert_eq!(asked("99999999999999999999999"), Some(MAX_RETRY_AFTER));
    // An HTTP date (a proxy's): the time until then, within the minute.
    assert_eq!(
        asked("Wed, 21 Oct 2015 07:28:20 GMT"),
        Some(Duration::from_secs(20))
    );
    assert_eq!(
        asked("Wed, 21 Oct 2015 09:00:00 GMT"),
        Some(MAX_RETRY_AFTER)
    );
    assert_eq!(asked("Wed, 21 Oct 2015 07:00:00 GMT"), Some(Duration::ZERO));
    assert_eq!(asked("soon"), None);
    assert_eq!(asked("-3"), None);
    for attempt in 1..4 {
        // The backoff of these attempts is at most 1.6 s: the server's 3 s
        // win.
        assert!(retry_wait(attempt, Some(Duration::from_secs(3))) >= Duration::from_secs(3));
        assert!(retry_wait(attempt, None) <= Duration::from_millis(1600));
    }
    // A backoff longer than what was asked is kept.
    assert!(retry_wait(6, Some(Duration::from_secs(1))) >= Duration::from_secs(5));
}

#[test]
fn source_ids_are_told_apart_by_128_bits() {
    assert_ne!(fingerprint("a"), fingerprint("b"));
    assert_eq!(fingerprint("same"), fingerprint("same"));
    let distinct: std::collections::HashSet<u128> =
        (0..100_000).map(|n| fingerprint(&n.to_string())).collect();
    assert_eq!(distinct.len(), 100_000);
}
