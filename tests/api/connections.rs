//! HTTP connections: slow, idle, half-sent and unread ones, and the cap
//! on how many there are, keep no tenant from being served.

use crate::support::app::TestEnv;
use crate::support::app::client_with_key;
use crate::support::app::create_key;
use crate::support::probes::*;
use reqwest::StatusCode;
use serde_json::json;
use std::time::Duration;
use std::time::Instant;
use tokio::io::AsyncReadExt;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

/// A body declared far past the route's limit is answered at once, not
/// waited for until the body timeout (hostile review).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_declared_far_too_large_is_refused_at_once() {
    let app = TestEnv::new().spawn().await;
    let request = format!(
        "POST /ids HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {}\r\nContent-Type: application/json\r\nContent-Length: 1000000000\r\n\r\n{{\"project\":",
        app.admin_key
    );
    // Waiting for the body, the server would answer after 30 s (408):
    // within 5 s, only an answer given at once arrives.
    let answer = raw_exchange(&app, request.as_bytes(), Duration::from_secs(5)).await;
    assert!(
        answer.starts_with("HTTP/1.1 413") && answer.contains("body_too_large"),
        "{answer}"
    );
    nothing_written(&app, 0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_that_never_finish_their_headers_are_cut_off() {
    let mut env = TestEnv::new();
    env.header_timeout_s = 2;
    let app = env.spawn().await;
    let probe = Probe::start(&app).await;
    let address = app.address.trim_start_matches("http://").to_owned();
    let started = Instant::now();
    let slow = (0..300).map(|_| {
        let address = address.clone();
        tokio::spawn(async move {
            let mut stream = TcpStream::connect(&address).await.ok()?;
            stream
                .write_all(b"POST /ids HTTP/1.1\r\nHost: x\r\n")
                .await
                .ok()?;
            // One byte a second, never the end of the headers.
            let mut buffer = [0u8; 512];
            for _ in 0..10 {
                if stream.write_all(b"X").await.is_err() {
                    return Some(started.elapsed());
                }
                match tokio::time::timeout(Duration::from_secs(1), stream.read(&mut buffer)).await {
                    Ok(Ok(0)) | Ok(Err(_)) => return Some(started.elapsed()),
                    _ => {}
                }
            }
            None
        })
    });
    let closed = futures::future::join_all(slow).await;
    probe.assert_unharmed("300 slow-header clients").await;
    let cut: Vec<Duration> = closed
        .into_iter()
        .filter_map(|c| c.ok().flatten())
        .collect();
    assert_eq!(cut.len(), 300, "some slow clients were never cut off");
    let latest = cut.iter().max().unwrap();
    assert!(
        *latest < Duration::from_secs(5),
        "cut off after {latest:?} with a 2 s header timeout"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_that_never_arrives_is_answered_408_and_the_connection_closed() {
    let mut env = TestEnv::new();
    env.request_timeout_s = 2;
    let app = env.spawn().await;
    let started = Instant::now();
    let answer = raw_exchange(
        &app,
        format!(
            "POST /documents HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {}\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{{\"proj",
            app.admin_key
        )
        .as_bytes(),
        Duration::from_secs(5),
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains("body_timeout"), "{answer}");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "the connection stayed open"
    );
    nothing_written(&app, 0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_the_cap_a_new_client_takes_the_slot_of_the_keyless_connection_idle_longest() {
    let mut env = TestEnv::new();
    env.max_connections = 8;
    let app = env.spawn().await;
    let address = app.address.trim_start_matches("http://").to_owned();
    let keyed_request = format!(
        "GET /api/v1/sequences HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {}\r\n\r\n",
        app.admin_key
    );
    let mut keyed = TcpStream::connect(&address).await.unwrap();
    let first = answer_on(&mut keyed, keyed_request.as_bytes(), Duration::from_secs(2)).await;
    assert!(first.is_some_and(|a| a.starts_with("HTTP/1.1 200")));
    // A stranger opens twice the cap of keep-alive connections: each is
    // served at once, taking the slot of the keyless one idle longest.
    let mut stranger = Vec::new();
    for n in 0..16 {
        let mut stream = TcpStream::connect(&address).await.unwrap();
        let answer = answer_on(
            &mut stream,
            b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n",
            Duration::from_secs(2),
        )
        .await;
        assert!(
            answer.is_some_and(|a| a.starts_with("HTTP/1.1 200")),
            "connection {n} over a full instance was not served"
        );
        stranger.push(stream);
    }
    let mut open = 0;
    for stream in &mut stranger {
        if !closed(stream).await {
            open += 1;
        }
    }
    assert!(
        open < 8,
        "{open} of the stranger's connections still open with a cap of 8"
    );
    assert!(
        closed(&mut stranger[0]).await,
        "the oldest was closed first"
    );
    // The tenant's connection, idle longer than any of them, still serves.
    let again = answer_on(&mut keyed, keyed_request.as_bytes(), Duration::from_secs(2)).await;
    assert!(
        again.is_some_and(|a| a.starts_with("HTTP/1.1 200")),
        "the keyed connection was closed for a stranger's"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_beyond_the_cap_wait_while_every_one_is_serving() {
    let mut env = TestEnv::new();
    env.max_connections = 4;
    let app = env.spawn().await;
    // Four keys, each with one request whose body is still coming: every
    // slot is busy, and none of them holds more than its share.
    let mut busy = Vec::new();
    for _ in 0..4 {
        let key = create_key(&app.state, &[], true).await;
        busy.push(slow_body(&app, &key).await);
    }
    let address = app.address.trim_start_matches("http://").to_owned();
    let mut waiting = TcpStream::connect(&address).await.unwrap();
    let health = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n";
    assert_eq!(
        answer_on(&mut waiting, health, Duration::from_millis(800)).await,
        None,
        "a connection over the cap was served while every slot was busy"
    );
    drop(busy.pop());
    let mut buffer = [0u8; 256];
    let n = tokio::time::timeout(Duration::from_secs(3), waiting.read(&mut buffer))
        .await
        .expect("served once a busy one ended")
        .unwrap();
    assert!(String::from_utf8_lossy(&buffer[..n]).starts_with("HTTP/1.1 200"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_key_sending_slow_bodies_on_every_slot_keeps_no_one_out() {
    let mut env = TestEnv::new();
    env.max_connections = 4;
    let app = env.spawn().await;
    let hog = create_key(&app.state, &[], true).await;
    let mut held = Vec::new();
    for _ in 0..4 {
        held.push(slow_body(&app, &hog).await);
    }
    // Another tenant's request on a new connection is served at once: a
    // connection of the key holding every slot gives its place up.
    let other = create_key(&app.state, &["OTHER"], false).await;
    let served = tokio::time::timeout(
        Duration::from_secs(5),
        app.client
            .post(app.url("/ids"))
            .bearer_auth(&other)
            .json(&json!({"project": "OTHER", "type": "1"}))
            .send(),
    )
    .await
    .expect("served while one key held every slot")
    .unwrap();
    assert_eq!(served.status(), StatusCode::OK);
    // One of the hog's requests was cut before its body arrived: nothing
    // of it was written.
    let mut cut = 0;
    for stream in &mut held {
        let mut buffer = [0u8; 256];
        // Closed (end of stream or reset), or answered and closed; a
        // connection still waiting for its body says nothing.
        match tokio::time::timeout(Duration::from_millis(200), stream.read(&mut buffer)).await {
            Ok(Ok(_)) | Ok(Err(_)) => cut += 1,
            Err(_) => {}
        }
    }
    assert!(
        cut >= 1,
        "no connection of the key holding every slot was closed"
    );
    assert_eq!(app.outbox_count(None).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_that_never_read_their_answers_lose_their_connections_after_the_write_timeout() {
    let mut env = TestEnv::new();
    env.max_connections = 4;
    env.write_timeout_s = 2;
    let app = env.spawn().await;
    let host = host_of(&app);
    let hogs: Vec<TcpStream> =
        futures::future::join_all((0..4).map(|_| never_reading_client(&host))).await;
    // Every connection is taken by a client that does not read; the
    // next one waits to be accepted until the write timeout frees one.
    let started = Instant::now();
    let health = crate::support::app::client_with_key(None)
        .get(app.url("/healthz"))
        .timeout(Duration::from_secs(20))
        .send()
        .await
        .expect("a fifth client is answered once a stalled connection is closed");
    assert_eq!(health.status(), StatusCode::OK);
    let waited = started.elapsed();
    assert!(
        waited < Duration::from_secs(2) + Duration::from_secs(3),
        "answered after {waited:?}; the write timeout is 2 s"
    );
    drop(hogs);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_keep_the_idle_timeout_and_requests_the_header_timeout() {
    let mut env = TestEnv::new();
    env.header_timeout_s = 1;
    env.idle_timeout_s = 3;
    let app = env.spawn().await;
    let mut stream = TcpStream::connect(host_of(&app)).await.unwrap();
    let request = b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n";
    let mut buffer = vec![0u8; 4096];
    stream.write_all(request).await.unwrap();
    let n = stream.read(&mut buffer).await.unwrap();
    assert!(String::from_utf8_lossy(&buffer[..n]).starts_with("HTTP/1.1 200"));

    // Idle longer than the header timeout, shorter than the idle timeout:
    // the keep-alive connection still serves.
    tokio::time::sleep(Duration::from_millis(1800)).await; // the client idles on purpose: past the header timeout
    stream.write_all(request).await.unwrap();
    let n = tokio::time::timeout(Duration::from_secs(2), stream.read(&mut buffer))
        .await
        .expect("an answer")
        .unwrap();
    assert!(
        String::from_utf8_lossy(&buffer[..n]).starts_with("HTTP/1.1 200"),
        "an idle connection within the idle timeout was closed"
    );

    // A request started and never finished has the header timeout.
    stream
        .write_all(b"GET /healthz HTTP/1.1\r\nhost")
        .await
        .unwrap();
    let started = Instant::now();
    let closed = tokio::time::timeout(Duration::from_secs(3), stream.read(&mut buffer))
        .await
        .expect("closed within the header timeout");
    assert!(matches!(closed, Ok(0) | Err(_)), "{closed:?}");
    assert!(
        started.elapsed() < Duration::from_millis(2500),
        "{:?}",
        started.elapsed()
    );

    // A connection idle past the idle timeout is closed.
    let mut idle = TcpStream::connect(host_of(&app)).await.unwrap();
    idle.write_all(request).await.unwrap();
    let _ = idle.read(&mut buffer).await.unwrap();
    let started = Instant::now();
    let closed = tokio::time::timeout(Duration::from_secs(6), idle.read(&mut buffer))
        .await
        .expect("closed after the idle timeout");
    assert!(matches!(closed, Ok(0) | Err(_)), "{closed:?}");
    assert!(
        started.elapsed() >= Duration::from_millis(2500),
        "closed early: {:?}",
        started.elapsed()
    );

    // A request head larger than a connection may buffer is refused (431,
    // or the connection closed): within the header timeout, whether it is
    // 20 KB or a megabyte. A server that kept reading, or buffered it and
    // never answered, would leave the connection open.
    for size in [20_000, 1_000_000] {
        let mut big = TcpStream::connect(host_of(&app)).await.unwrap();
        let head = format!(
            "GET /healthz HTTP/1.1\r\nhost: x\r\nx-pad: {}\r\n\r\n",
            "a".repeat(size)
        );
        let _ = big.write_all(head.as_bytes()).await;
        let mut answer = Vec::new();
        let ended = tokio::time::timeout(
            Duration::from_secs(app.env.header_timeout_s) * 3,
            big.read_to_end(&mut answer),
        )
        .await;
        let answer = String::from_utf8_lossy(&answer);
        assert!(
            ended.is_ok(),
            "a {size}-byte head was neither refused nor closed: {answer:?}"
        );
        assert!(
            answer.is_empty() || answer.starts_with("HTTP/1.1 431"),
            "a {size}-byte head was answered {answer:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stranger_holding_every_connection_slot_keeps_no_tenant_from_connecting() {
    let mut env = TestEnv::new();
    env.max_connections = 64;
    let app = env.spawn().await;
    let neighbour = Neighbour::start(&app, "SLOTS").await;
    let key = create_key(&app.state, &["SLOTS"], false).await;
    // A stranger opens keep-alive connections, four times the cap, and
    // holds every one.
    let host = host_of(&app);
    let stranger = tokio::spawn(async move {
        let mut held = Vec::new();
        let mut served = 0;
        for _ in 0..256 {
            let Ok(mut stream) = TcpStream::connect(&host).await else {
                continue;
            };
            if stream
                .write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
                .await
                .is_err()
            {
                continue;
            }
            let mut buffer = [0u8; 512];
            if let Ok(Ok(n)) =
                tokio::time::timeout(Duration::from_secs(5), stream.read(&mut buffer)).await
                && n > 0
            {
                served += 1;
            }
            held.push(stream);
        }
        (served, held)
    });
    // Meanwhile a tenant's client opens a new connection for every request.
    let mut slowest = Duration::ZERO;
    while !stranger.is_finished() {
        let fresh = client_with_key(Some(&key));
        let started = Instant::now();
        let answer = fresh
            .get(app.url("/api/v1/sequences"))
            .timeout(Duration::from_secs(20))
            .send()
            .await
            .expect("a new connection beside a stranger's hundreds is served");
        assert_eq!(answer.status(), StatusCode::OK);
        slowest = slowest.max(started.elapsed());
        tokio::time::sleep(Duration::from_millis(20)).await; // new clients arrive over the flood, not at once
    }
    let (served, held) = stranger.await.unwrap();
    assert_eq!(
        served, 256,
        "each of the stranger's connections is served in turn"
    );
    assert_answer_within(
        "a stranger holding every connection slot",
        "a tenant's new connection",
        neighbour.alone(),
        slowest,
    );
    neighbour
        .assert_unharmed("a stranger holding every connection slot")
        .await;
    drop(held);
}

/// A head a proxy in front could read otherwise than the service does is
/// refused and changes nothing: two Authorization headers (the first a
/// valid key), two Content-Types (the first JSON). A body framed both by
/// Content-Length and Transfer-Encoding is read by the latter alone and
/// the connection closed after the answer (RFC 9112 §6.1), so nothing sent
/// behind it on that connection is read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_head_that_reads_two_ways_is_refused_and_changes_nothing() {
    let app = TestEnv::new().spawn().await;
    let key = &app.admin_key;
    let body = r#"{"project":"TWO","type":"1","count":1}"#;
    let two_keys = format!(
        "POST /ids HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\nAuthorization: Bearer nope\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let two_types = format!(
        "POST /ids HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\nContent-Type: application/json\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    for (what, request) in [
        ("two Authorization headers", two_keys),
        ("two Content-Types", two_types),
    ] {
        let answer = raw_exchange(&app, request.as_bytes(), Duration::from_secs(5)).await;
        assert!(
            answer.starts_with("HTTP/1.1 400") && answer.contains("invalid_header"),
            "{what}: {answer}"
        );
    }
    let issued: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM issuance_ledger l JOIN sequences s ON s.id = l.sequence_id \
         WHERE s.project = 'TWO'",
    )
    .fetch_one(&app.db)
    .await
    .unwrap();
    assert_eq!(issued, 0, "a refused head issued numbers");
    // Framed twice, then a second request on the same connection: only
    // the first is answered, and the connection is closed at once.
    let smuggled = r#"{"project":"TWO","type":"2","count":1}"#;
    let framed_twice = format!(
        "POST /ids HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\nContent-Type: application/json\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n{:x}\r\n{body}\r\n0\r\n\r\nPOST /ids HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{smuggled}",
        body.len(),
        smuggled.len()
    );
    let started = Instant::now();
    let answer = raw_exchange(&app, framed_twice.as_bytes(), Duration::from_secs(5)).await;
    assert!(
        started.elapsed() < Duration::from_secs(4),
        "not closed: {answer}"
    );
    assert_eq!(answer.matches("HTTP/1.1 ").count(), 1, "{answer}");
    let second: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM sequences WHERE project = 'TWO' AND doc_type = '2'",
    )
    .fetch_one(&app.db)
    .await
    .unwrap();
    assert_eq!(second, 0, "the request behind a twice-framed body was read");
}
