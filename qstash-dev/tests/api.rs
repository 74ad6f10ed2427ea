//! The management API, dedup, batch, auth, inspection API and fault injection.

mod common;

use std::time::{Duration, Instant};

use common::*;
use qstash_dev::Faults;
use reqwest::Method;
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auth_bearer_and_query_token() {
    let sink = Sink::start().await;
    let server = server(0.001, |_| {}).await;
    let c = http();
    let url = format!("{}/v2/publish/{}", server.url(), sink.url("/a"));
    let r = c.post(&url).body("x").send().await.unwrap();
    assert_eq!(r.status(), 401);
    let v: serde_json::Value = r.json().await.unwrap();
    assert!(v["error"].is_string());
    let r = c
        .post(&url)
        .bearer_auth("wrong")
        .body("x")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    let r = c
        .post(&url)
        .bearer_auth(server.token())
        .body("x")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let r = c
        .post(format!("{url}?qstash_token={}", urlencode(server.token())))
        .body("x")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let r = c
        .get(format!("{}/v2/keys", server.url()))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    // The default token is the documented dev token, and /v2/keys answers the dev keys (JS SDK health check).
    assert_eq!(server.token(), qstash_dev::DEV_TOKEN);
    let api = Api::new(&server);
    let (st, k) = api.call(Method::GET, "/v2/keys").await;
    assert_eq!(st, 200);
    assert_eq!(
        k,
        json!({"current": "sig_7kYjw48mhY7kAjqNGcy6cr29RJ6r", "next": "sig_5ZB6DVzB1wjE8S6rZ7eenA8Pdnhs"})
    );
    server.handle().wait_idle(WAIT).await.unwrap();
    assert_eq!(sink.received_at("/a").len(), 2);
}

fn urlencode(s: &str) -> String {
    url::form_urlencoded::byte_serialize(s.as_bytes()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dedup_window_returns_existing_id_then_expires() {
    // Within the window: the default ten minutes, which no run of this test comes near, however slow.
    let sink = Sink::start().await;
    let server = server(0.001, |_| {}).await;
    let api = Api::new(&server);
    let dest = sink.url("/d");
    let (st, first) = api
        .publish(&dest, &[("Upstash-Deduplication-Id", "outbox-1")], "a")
        .await;
    assert_eq!(st, 200);
    assert!(
        first.get("deduplicated").is_none(),
        "no deduplicated key when false: {first}"
    );
    let (st, dup) = api
        .publish(&dest, &[("Upstash-Deduplication-Id", "outbox-1")], "b")
        .await;
    assert_eq!(st, 202);
    assert_eq!(
        dup,
        json!({"messageId": first["messageId"], "deduplicated": true})
    );
    // Survives delivery (and failure): still deduplicated after the message is gone.
    server.handle().wait_idle(WAIT).await.unwrap();
    let (st, _) = api
        .publish(&dest, &[("Upstash-Deduplication-Id", "outbox-1")], "c")
        .await;
    assert_eq!(st, 202);
    server.handle().wait_idle(WAIT).await.unwrap();
    let s = server.handle().stats();
    assert_eq!((s.accepted, s.deduplicated), (1, 2));

    // After the window: a short one, and the id is published again until it is new. How long that takes does
    // not matter; a window that never ends fails at WAIT.
    let server = common::server(0.001, |c| c.dedup_window = Duration::from_millis(50)).await;
    let api = Api::new(&server);
    let dest = sink.url("/e");
    let first = api
        .publish_ok(&dest, &[("Upstash-Deduplication-Id", "outbox-1")], "a")
        .await;
    let deadline = tokio::time::Instant::now() + WAIT;
    let mut tries = 0;
    let again = loop {
        tries += 1;
        let (st, v) = api
            .publish(
                &dest,
                &[("Upstash-Deduplication-Id", "outbox-1")],
                format!("again-{tries}"),
            )
            .await;
        let id = v["messageId"].as_str().unwrap().to_string();
        if st == 200 {
            break id;
        }
        assert_eq!((st, id.as_str()), (202, first.as_str()), "{v}");
        assert!(
            tokio::time::Instant::now() < deadline,
            "the deduplication id never expired"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_ne!(again, first);
    server.handle().wait_idle(WAIT).await.unwrap();
    let bodies: Vec<_> = sink
        .received_at("/d")
        .into_iter()
        .chain(sink.received_at("/e"))
        .map(|r| r.body)
        .collect();
    assert_eq!(
        bodies,
        vec![
            bytes::Bytes::from("a"),
            bytes::Bytes::from("a"),
            bytes::Bytes::from(format!("again-{tries}"))
        ],
        "only the first publish of each window is delivered"
    );
    let s = server.handle().stats();
    assert_eq!((s.accepted, s.deduplicated), (2, tries - 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dedup_id_survives_failure_and_colon_is_rejected() {
    let sink = Sink::with(|_, _| Reply::status(500)).await;
    let server = server(0.0001, |_| {}).await;
    let api = Api::new(&server);
    let h = [
        ("Upstash-Deduplication-Id", "x-1"),
        ("Upstash-Retries", "0"),
    ];
    let id = api.publish_ok(&sink.url("/f"), &h, "a").await;
    server.handle().wait_idle(WAIT).await.unwrap();
    assert_eq!(server.handle().dlq_entries().len(), 1);
    let (st, v) = api.publish(&sink.url("/f"), &h, "a").await;
    assert_eq!((st, v["messageId"].as_str()), (202, Some(id.as_str())));
    let (st, v) = api
        .publish(
            &sink.url("/f"),
            &[("Upstash-Deduplication-Id", "outbox:1")],
            "a",
        )
        .await;
    assert_eq!(st, 400);
    assert_eq!(v, json!({"error": "DeduplicationId cannot contain ':'"}));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn content_based_dedup() {
    let sink = Sink::start().await;
    let server = server(0.001, |_| {}).await;
    let api = Api::new(&server);
    let cbd = ("Upstash-Content-Based-Deduplication", "True");
    let a = api
        .publish_ok(
            &sink.url("/c"),
            &[cbd, ("Content-Type", "text/plain")],
            "same",
        )
        .await;
    let (st, v) = api
        .publish(
            &sink.url("/c"),
            &[cbd, ("Content-Type", "text/plain")],
            "same",
        )
        .await;
    assert_eq!((st, v["messageId"].as_str()), (202, Some(a.as_str())));
    for (headers, body, dest) in [
        (vec![cbd, ("Content-Type", "text/plain")], "other", "/c"),
        (
            vec![cbd, ("Content-Type", "application/json")],
            "same",
            "/c",
        ),
        (
            vec![
                cbd,
                ("Content-Type", "text/plain"),
                ("Upstash-Forward-X-A", "1"),
            ],
            "same",
            "/c",
        ),
        (vec![cbd, ("Content-Type", "text/plain")], "same", "/other"),
        (vec![("Content-Type", "text/plain")], "same", "/c"),
    ] {
        let (st, v) = api.publish(&sink.url(dest), &headers, body).await;
        assert_eq!(st, 200, "{headers:?} {body} {dest}: {v}");
    }
    let (st, _) = api
        .publish(
            &sink.url("/c"),
            &[("Upstash-Content-Based-Deduplication", "maybe")],
            "x",
        )
        .await;
    assert_eq!(st, 400);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batch_per_item_results_with_a_bad_item() {
    let sink = Sink::start().await;
    let server = server(0.001, |_| {}).await;
    let api = Api::new(&server);
    let items = json!([
        {"destination": sink.url("/b1"), "headers": {"Content-Type": "application/json", "upstash-deduplication-id": "b-1"}, "body": "{\"i\":1}"},
        {"destination": sink.url("/b2"), "headers": {"upstash-deduplication-id": "bad:id"}, "body": "x"},
        {"destination": sink.url("/b3"), "headers": null, "body": null, "queue": null},
        {"destination": sink.url("/b1"), "headers": {"UPSTASH-DEDUPLICATION-ID": "b-1"}, "body": "{\"i\":1}"},
        {"destination": "not-a-url", "body": "x"},
        {"destination": sink.url("/b4"), "queue": "batchq", "body": "q"},
        {"destination": sink.url("/b5"), "queue": "batchq", "headers": {"Upstash-Delay": "10s"}},
    ]);
    let (st, v) = api.call_json(Method::POST, "/v2/batch", items).await;
    assert_eq!(st, 200, "{v}");
    let arr = v.as_array().unwrap();
    assert_eq!(arr.len(), 7);
    let id1 = arr[0]["messageId"].as_str().unwrap();
    assert!(id1.starts_with("msg_"));
    assert_eq!(
        arr[1],
        json!({"error": "DeduplicationId cannot contain ':'", "status": 400})
    );
    assert!(arr[2]["messageId"].is_string());
    assert_eq!(arr[3], json!({"messageId": id1, "deduplicated": true}));
    assert_eq!(arr[4]["status"], 400);
    assert!(
        arr[4]["error"]
            .as_str()
            .unwrap()
            .contains("invalid destination url")
    );
    assert!(arr[5]["messageId"].is_string());
    assert_eq!(arr[6]["status"], 400);
    server.handle().wait_idle(WAIT).await.unwrap();
    assert_eq!(sink.received_at("/b1").len(), 1);
    assert_eq!(
        sink.received_at("/b1")[0].header("content-type"),
        Some("application/json")
    );
    assert_eq!(sink.received_at("/b3")[0].body.len(), 0);
    assert_eq!(sink.received_at("/b4").len(), 1);
    assert!(sink.received_at("/b2").is_empty() && sink.received_at("/b5").is_empty());
    // A body that is not an array is a 400 for the whole request.
    let (st, v) = api
        .call_json(Method::POST, "/v2/batch", json!({"destination": "x"}))
        .await;
    assert_eq!(st, 400);
    assert!(v["error"].is_string());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publish_validation_errors() {
    let server = server(0.001, |_| {}).await;
    let api = Api::new(&server);
    let sink_url = "http://127.0.0.1:9/x";
    for (headers, needle) in [
        (vec![("Upstash-Delay", "10x")], "Upstash-Delay"),
        (vec![("Upstash-Retries", "-1")], "Upstash-Retries"),
        (vec![("Upstash-Method", "BREW")], "Upstash-Method"),
        (
            vec![
                ("Upstash-Flow-Control-Key", "k"),
                ("Upstash-Flow-Control-Value", "period=1m"),
            ],
            "should be either rate=X or parallelism=Y",
        ),
        (vec![("Upstash-Callback", "ftp://x")], "invalid scheme"),
        (vec![("Upstash-Timeout", "soon")], "Upstash-Timeout"),
    ] {
        let (st, v) = api.publish(sink_url, &headers, "x").await;
        assert_eq!(st, 400, "{headers:?}");
        assert!(
            v["error"].as_str().unwrap().contains(needle),
            "{headers:?}: {v}"
        );
    }
    let (st, v) = api.publish("example.com/x", &[], "x").await;
    assert_eq!(st, 400);
    assert_eq!(
        v["error"],
        "invalid destination url: endpoint has invalid scheme, add http:// or https://"
    );
    let r = api
        .req(Method::POST, &format!("/v2/enqueue/q1/{sink_url}"))
        .header("Upstash-Delay", "5s")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    assert_eq!(server.handle().stats().rejected, 8);
    assert_eq!(server.handle().stats().accepted, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_get_and_cancel() {
    let sink = Sink::start().await;
    let server = server(1.0, |_| {}).await;
    let api = Api::new(&server);
    let id = api
        .publish_ok(
            &sink.url("/later"),
            &[
                ("Upstash-Delay", "1h"),
                ("Content-Type", "text/plain"),
                ("Upstash-Forward-X-A", "1"),
                ("Upstash-Label", "billing,eu"),
                ("Upstash-Retry-Delay", "pow(2, retried) * 1000"),
                ("Upstash-Flow-Control-Key", "fk"),
                ("Upstash-Flow-Control-Value", "rate=10, period=1m"),
            ],
            "hello",
        )
        .await;
    let (st, m) = api.call(Method::GET, &format!("/v2/messages/{id}")).await;
    assert_eq!(st, 200);
    assert_eq!(m["messageId"], id);
    assert_eq!(m["url"], sink.url("/later"));
    assert_eq!(m["method"], "POST");
    assert_eq!(m["body"], "hello");
    assert_eq!(m["header"]["Content-Type"], json!(["text/plain"]));
    assert_eq!(m["header"]["X-A"], json!(["1"]));
    assert_eq!(m["maxRetries"], 3);
    assert_eq!(m["retryDelayExpression"], "pow(2, retried) * 1000");
    assert_eq!(m["labels"], json!(["billing", "eu"]));
    assert_eq!(m["label"], "billing");
    assert_eq!(
        (
            m["flowControlKey"].as_str(),
            m["rate"].as_u64(),
            m["period"].as_u64()
        ),
        (Some("fk"), Some(10), Some(60))
    );
    let created = m["createdAt"].as_u64().unwrap();
    assert_eq!(m["notBefore"].as_u64().unwrap() - created, 3_600_000);
    let (st, c) = api
        .call(Method::DELETE, &format!("/v2/messages/{id}"))
        .await;
    assert_eq!((st, c), (200, json!({"cancelled": 1})));
    let (st, e) = api.call(Method::GET, &format!("/v2/messages/{id}")).await;
    assert_eq!(st, 404);
    assert!(e["error"].is_string());
    let (st, _) = api
        .call(Method::DELETE, &format!("/v2/messages/{id}"))
        .await;
    assert_eq!(st, 404);

    // Bulk: by ids (JSON body), then everything.
    let a = api
        .publish_ok(&sink.url("/later"), &[("Upstash-Delay", "1h")], "a")
        .await;
    let _b = api
        .publish_ok(&sink.url("/later"), &[("Upstash-Delay", "1h")], "b")
        .await;
    let _c = api
        .publish_ok(&sink.url("/later"), &[("Upstash-Delay", "1h")], "c")
        .await;
    let (st, v) = api
        .call_json(Method::DELETE, "/v2/messages", json!({"messageIds": [a]}))
        .await;
    assert_eq!((st, v), (200, json!({"cancelled": 1})));
    let (st, v) = api.call(Method::DELETE, "/v2/messages").await;
    assert_eq!((st, v), (200, json!({"cancelled": 2})));
    server.handle().wait_idle(WAIT).await.unwrap();
    assert!(sink.received().is_empty());

    // Delivered messages disappear from the messages API.
    let d = api.publish_ok(&sink.url("/now"), &[], "x").await;
    server.handle().wait_idle(WAIT).await.unwrap();
    assert_eq!(
        api.call(Method::GET, &format!("/v2/messages/{d}")).await.0,
        404
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dlq_list_filter_cursor_get_delete_retry() {
    let sink = Sink::with(|_, _| {
        Reply::status(500)
            .header("X-Why", "down")
            .body(&[0xff, 0xfe])
    })
    .await;
    let server = server(0.0001, |_| {}).await;
    let api = Api::new(&server);
    let mut ids = vec![];
    for (i, path) in ["/a", "/b", "/a", "/c"].iter().enumerate() {
        ids.push(
            api.publish_ok(
                &sink.url(path),
                &[
                    ("Upstash-Retries", "0"),
                    ("Upstash-Label", if i == 3 { "special" } else { "plain" }),
                ],
                format!("body-{i}"),
            )
            .await,
        );
        server.handle().wait_idle(WAIT).await.unwrap();
    }
    let (st, all) = api.call(Method::GET, "/v2/dlq").await;
    assert_eq!(st, 200);
    let msgs = all["messages"].as_array().unwrap();
    assert_eq!(msgs.len(), 4);
    assert!(all.get("cursor").is_none());
    assert_eq!(msgs[0]["messageId"], ids[3], "latestFirst by default");
    let m = &msgs[0];
    assert_eq!(m["responseStatus"], 500);
    assert_eq!(m["responseHeader"]["X-Why"], json!(["down"]));
    assert_eq!(m["responseBodyBase64"], "//4=");
    assert_eq!(m["body"], "body-3");
    assert!(m["dlqId"].as_str().unwrap().split_once('-').is_some());

    let (_, f) = api
        .call(
            Method::GET,
            &format!("/v2/dlq?url={}", urlencode(&sink.url("/a"))),
        )
        .await;
    assert_eq!(f["messages"].as_array().unwrap().len(), 2);
    let (_, f) = api.call(Method::GET, "/v2/dlq?label=special").await;
    assert_eq!(f["messages"][0]["messageId"], ids[3]);
    let (_, f) = api
        .call(
            Method::GET,
            &format!("/v2/dlq?messageId={}&messageId={}", ids[0], ids[1]),
        )
        .await;
    assert_eq!(f["messages"].as_array().unwrap().len(), 2);
    let (_, f) = api.call(Method::GET, "/v2/dlq?responseStatus=404").await;
    assert_eq!(f["messages"].as_array().unwrap().len(), 0);

    // Paging, earliest first.
    let mut seen = vec![];
    let mut cursor: Option<String> = None;
    loop {
        let path = match &cursor {
            Some(c) => format!("/v2/dlq?count=3&order=earliestFirst&cursor={c}"),
            None => "/v2/dlq?count=3&order=earliestFirst".to_string(),
        };
        let (_, page) = api.call(Method::GET, &path).await;
        for m in page["messages"].as_array().unwrap() {
            seen.push(m["messageId"].as_str().unwrap().to_string());
        }
        match page.get("cursor").and_then(|c| c.as_str()) {
            Some(c) => cursor = Some(c.to_string()),
            None => break,
        }
    }
    assert_eq!(seen, ids);

    let dlq_id = |i: usize| {
        msgs.iter().find(|m| m["messageId"] == ids[i]).unwrap()["dlqId"]
            .as_str()
            .unwrap()
            .to_string()
    };
    let (st, one) = api
        .call(Method::GET, &format!("/v2/dlq/{}", dlq_id(0)))
        .await;
    assert_eq!(
        (st, one["messageId"].as_str()),
        (200, Some(ids[0].as_str()))
    );
    assert_eq!(
        api.call(Method::DELETE, &format!("/v2/dlq/{}", dlq_id(0)))
            .await
            .0,
        200
    );
    assert_eq!(
        api.call(Method::DELETE, &format!("/v2/dlq/{}", dlq_id(0)))
            .await
            .0,
        404
    );
    assert_eq!(
        api.call(Method::GET, &format!("/v2/dlq/{}", dlq_id(0)))
            .await
            .0,
        404
    );

    // Retry one, with a config header overriding the stored retries; the sink now succeeds.
    sink.set(|_, _| Reply::ok());
    let r = api
        .req(Method::POST, &format!("/v2/dlq/retry/{}", dlq_id(1)))
        .header("Upstash-Retries", "5")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    let v: serde_json::Value = r.json().await.unwrap();
    let new_id = v["messageId"].as_str().unwrap().to_string();
    assert_ne!(new_id, ids[1]);
    assert_eq!(
        api.call(Method::GET, &format!("/v2/dlq/{}", dlq_id(1)))
            .await
            .0,
        404
    );
    server.handle().wait_idle(WAIT).await.unwrap();
    let got = sink.received_at("/b");
    assert_eq!(
        got.last().unwrap().header("upstash-message-id"),
        Some(new_id.as_str())
    );
    assert_eq!(got.last().unwrap().body.as_ref(), b"body-1");

    // Bulk retry by query id (what the JS SDK sends), bulk delete by JSON body (Python / Go).
    let r = api
        .req(Method::POST, &format!("/v2/dlq/retry?dlqIds={}", dlq_id(2)))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    let v: serde_json::Value = r.json().await.unwrap();
    assert_eq!(v["responses"].as_array().unwrap().len(), 1);
    let (st, v) = api
        .call_json(
            Method::DELETE,
            "/v2/dlq",
            json!({"dlqIds": [dlq_id(3), "1-0"]}),
        )
        .await;
    assert_eq!((st, v), (200, json!({"deleted": 1})));
    server.handle().wait_idle(WAIT).await.unwrap();
    assert!(server.handle().dlq_entries().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queues_api_and_paused_queue() {
    let sink = Sink::start().await;
    let server = server(0.001, |_| {}).await;
    let api = Api::new(&server);
    let (st, _) = api
        .call_json(
            Method::POST,
            "/v2/queues",
            json!({"queueName": "jobs", "parallelism": 2, "paused": true}),
        )
        .await;
    assert_eq!(st, 200);
    let (st, _) = api
        .call_json(
            Method::POST,
            "/v2/queues",
            json!({"queueName": "bad name!"}),
        )
        .await;
    assert_eq!(st, 400);
    let r = api
        .req(
            Method::POST,
            &format!("/v2/enqueue/jobs/{}", sink.url("/j")),
        )
        .body("1")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let (_, q) = api.call(Method::GET, "/v2/queues/jobs").await;
    assert_eq!(
        (
            q["name"].as_str(),
            q["parallelism"].as_u64(),
            q["paused"].as_bool(),
            q["lag"].as_u64()
        ),
        (Some("jobs"), Some(2), Some(true), Some(1))
    );
    assert!(q["createdAt"].as_u64().unwrap() > 1_600_000_000_000);
    assert!(
        server
            .handle()
            .wait_idle(Duration::from_millis(300))
            .await
            .is_err(),
        "paused queue does not deliver"
    );
    assert!(sink.received().is_empty());
    assert_eq!(
        api.call(Method::POST, "/v2/queues/jobs/resume").await.0,
        200
    );
    server.handle().wait_idle(WAIT).await.unwrap();
    assert_eq!(sink.received_at("/j").len(), 1);
    assert_eq!(api.call(Method::POST, "/v2/queues/jobs/pause").await.0, 200);
    let (_, list) = api.call(Method::GET, "/v2/queues").await;
    assert_eq!(list.as_array().unwrap().len(), 1);
    assert_eq!(list[0]["paused"], true);
    assert_eq!(api.call(Method::DELETE, "/v2/queues/jobs").await.0, 200);
    assert_eq!(api.call(Method::GET, "/v2/queues/jobs").await.0, 404);
    assert_eq!(api.call(Method::POST, "/v2/queues/jobs/pause").await.0, 404);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flow_control_api_pause_resume_and_global_parallelism() {
    let sink = Sink::start().await;
    let server = server(0.001, |_| {}).await;
    let api = Api::new(&server);
    assert_eq!(
        api.call(Method::POST, "/v2/flowControl/fk/pause").await.0,
        200
    );
    for i in 0..3 {
        api.publish_ok(
            &sink.url("/fc"),
            &[
                ("Upstash-Flow-Control-Key", "fk"),
                ("Upstash-Flow-Control-Value", "parallelism=1"),
            ],
            i.to_string(),
        )
        .await;
    }
    let (_, fc) = api.call(Method::GET, "/v2/flowControl/fk").await;
    assert_eq!(fc["isPaused"], true);
    assert_eq!(fc["waitListSize"], 3);
    let (_, list) = api.call(Method::GET, "/v2/flowControl?search=f").await;
    assert_eq!(list.as_array().unwrap().len(), 1);
    assert_eq!(
        api.call(Method::POST, "/v2/flowControl/fk/resume").await.0,
        200
    );
    server.handle().wait_idle(WAIT).await.unwrap();
    assert_eq!(sink.received_at("/fc").len(), 3);
    let (_, g) = api.call(Method::GET, "/v2/globalParallelism").await;
    assert_eq!(g["parallelismMax"], 256);
    assert_eq!(api.call(Method::GET, "/v2/flowControl/nope").await.0, 404);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn key_rotation_changes_the_signing_key() {
    let sink = Sink::start().await;
    let server = server(0.001, |_| {}).await;
    let api = Api::new(&server);
    let before = server.signing_keys();
    let (st, k) = api.call(Method::POST, "/v2/keys/rotate").await;
    assert_eq!(st, 200);
    assert_eq!(k["current"], before.next);
    assert!(k["next"].as_str().unwrap().starts_with("sig_"));
    api.publish_ok(&sink.url("/k"), &[], "x").await;
    let r = &sink.wait_for("/k", 1).await[0];
    verify_signature(
        r.header("upstash-signature").unwrap(),
        &before.next,
        &sink.url("/k"),
        b"x",
        false,
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fault_publish_5xx_stores_nothing() {
    let sink = Sink::start().await;
    let server = server(0.001, |c| c.faults.publish_5xx_rate = 1.0).await;
    let api = Api::new(&server);
    let (st, v) = api.publish(&sink.url("/x"), &[], "x").await;
    assert_eq!(st, 500);
    assert!(v["error"].as_str().unwrap().contains("injected"));
    let (st, _) = api
        .call_json(
            Method::POST,
            "/v2/batch",
            json!([{"destination": sink.url("/x")}]),
        )
        .await;
    assert_eq!(st, 500);
    server.handle().wait_idle(WAIT).await.unwrap();
    let s = server.handle().stats();
    assert_eq!((s.accepted, s.injected_publish_errors), (0, 2));
    assert!(sink.received().is_empty());
}

async fn fault_pattern(seed: u64) -> Vec<u16> {
    let server = server(0.001, |c| {
        c.seed = seed;
        c.deliver = false;
        c.faults.publish_5xx_rate = 0.5;
    })
    .await;
    let api = Api::new(&server);
    let mut out = vec![];
    for _ in 0..24 {
        out.push(api.publish("http://127.0.0.1:9/x", &[], "x").await.0);
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn faults_are_deterministic_per_seed() {
    let a = fault_pattern(11).await;
    let b = fault_pattern(11).await;
    let c = fault_pattern(12).await;
    assert_eq!(a, b);
    assert_ne!(a, c);
    assert!(a.contains(&500) && a.contains(&200));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fault_dropped_response_still_delivers() {
    let sink = Sink::start().await;
    let server = server(0.001, |c| c.faults.publish_drop_response_rate = 1.0).await;
    let api = Api::new(&server);
    let err = api
        .req(Method::POST, &format!("/v2/publish/{}", sink.url("/drop")))
        .header("Upstash-Deduplication-Id", "amb-1")
        .body("x")
        .send()
        .await
        .expect_err("the client gets no response");
    assert!(
        !err.is_timeout(),
        "the connection is closed, not left hanging: {err:?}"
    );
    let got = sink.wait_for("/drop", 1).await;
    assert_eq!(got.len(), 1);
    // A retry by the client is deduplicated once the fault is off.
    server.handle().set_faults(Faults::default()).unwrap();
    let (st, v) = api
        .publish(
            &sink.url("/drop"),
            &[("Upstash-Deduplication-Id", "amb-1")],
            "x",
        )
        .await;
    assert_eq!(st, 202);
    assert_eq!(v["messageId"].as_str(), got[0].header("upstash-message-id"));
    assert_eq!(server.handle().stats().injected_dropped_responses, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fault_dlq_message_filter_ignored_answers_every_entry() {
    let sink = Sink::with(|_, _| Reply::status(500)).await;
    let server = server(0.0001, |_| {}).await;
    let api = Api::new(&server);
    let mut ids = vec![];
    for path in ["/a", "/b"] {
        ids.push(
            api.publish_ok(&sink.url(path), &[("Upstash-Retries", "0")], "x")
                .await,
        );
    }
    server.handle().wait_idle(WAIT).await.unwrap();
    let ask = format!("/v2/dlq?messageId={}", ids[0]);
    let (_, page) = api.call(Method::GET, &ask).await;
    assert_eq!(page["messages"].as_array().unwrap().len(), 1, "{page}");
    server
        .handle()
        .set_faults(Faults {
            dlq_message_filter_ignored: true,
            ..Default::default()
        })
        .unwrap();
    let (_, page) = api.call(Method::GET, &ask).await;
    let mut got: Vec<&str> = page["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["messageId"].as_str().unwrap())
        .collect();
    got.sort_unstable();
    let mut want: Vec<&str> = ids.iter().map(String::as_str).collect();
    want.sort_unstable();
    assert_eq!(got, want, "the filter is ignored: every entry comes back");
    // Other filters still apply.
    let (_, page) = api
        .call(
            Method::GET,
            &format!("{ask}&url={}", urlencode(&sink.url("/b"))),
        )
        .await;
    assert_eq!(page["messages"][0]["messageId"], ids[1]);
    assert_eq!(page["messages"].as_array().unwrap().len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fault_duplicate_delivery_and_response_delay() {
    let sink = Sink::start().await;
    let server = server(0.001, |_| {}).await;
    let h = server.handle();
    h.set_faults(Faults {
        duplicate_delivery_rate: 1.0,
        publish_response_delay: Duration::from_millis(250),
        ..Default::default()
    })
    .unwrap();
    let api = Api::new(&server);
    let t = Instant::now();
    let id = api.publish_ok(&sink.url("/dup"), &[], "x").await;
    assert!(t.elapsed() >= Duration::from_millis(250));
    h.wait_idle(WAIT).await.unwrap();
    let got = sink.received_at("/dup");
    assert_eq!(got.len(), 2);
    assert!(
        got.iter()
            .all(|r| r.header("upstash-message-id") == Some(id.as_str()))
    );
    assert_ne!(
        got[0].header("upstash-signature"),
        got[1].header("upstash-signature")
    );
    let a = h.attempts_for(&id);
    assert_eq!(a.iter().filter(|a| a.duplicate).count(), 1);
    assert_eq!(h.stats().delivered, 1);
    assert_eq!(h.stats().duplicate_deliveries, 1);
    assert!(
        h.set_faults(Faults {
            duplicate_delivery_rate: 2.0,
            ..Default::default()
        })
        .is_err()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fault_delivery_network_error_and_lost_response() {
    let sink = Sink::start().await;
    let server = server(0.0001, |c| c.faults.delivery_network_error_rate = 1.0).await;
    let api = Api::new(&server);
    let id = api
        .publish_ok(&sink.url("/net"), &[("Upstash-Retries", "1")], "x")
        .await;
    let h = server.handle();
    h.wait_idle(WAIT).await.unwrap();
    assert!(sink.received().is_empty());
    let a = h.attempts_for(&id);
    assert_eq!(a.len(), 2);
    assert!(
        a.iter()
            .all(|a| a.error.as_deref().unwrap().contains("injected"))
    );
    assert_eq!(h.dlq_entries().len(), 1);

    h.set_faults(Faults {
        delivery_lost_response_rate: 1.0,
        ..Default::default()
    })
    .unwrap();
    let id = api
        .publish_ok(&sink.url("/lost"), &[("Upstash-Retries", "1")], "x")
        .await;
    h.wait_idle(WAIT).await.unwrap();
    assert_eq!(
        sink.received_at("/lost").len(),
        2,
        "the destination got every attempt"
    );
    assert_eq!(h.attempts_for(&id)[0].status, Some(200));
    assert_eq!(h.dlq_entries().len(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inspection_http_api() {
    let sink = Sink::start().await;
    let server = server(0.001, |_| {}).await;
    let api = Api::new(&server);
    let id = api.publish_ok(&sink.url("/i"), &[], "x").await;
    let r = api
        .req(Method::POST, "/__dev/wait-idle?timeout_ms=20000")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let attempts: serde_json::Value = api
        .req(Method::GET, &format!("/__dev/attempts?message_id={id}"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let a = &attempts[0];
    assert_eq!(a["message_id"], id);
    assert_eq!(a["kind"], "Destination");
    assert_eq!(a["status"], 200);
    assert_eq!(a["retried"], 0);
    let stats: serde_json::Value = api
        .req(Method::GET, "/__dev/stats")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(
        (stats["accepted"].as_u64(), stats["delivered"].as_u64()),
        (Some(1), Some(1))
    );
    let r = api
        .req(Method::PUT, "/__dev/faults")
        .body(r#"{"publish_5xx_rate": 1.0, "publish_response_delay_ms": 5}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(server.handle().faults().publish_5xx_rate, 1.0);
    assert_eq!(
        server.handle().faults().publish_response_delay,
        Duration::from_millis(5)
    );
    let r = api
        .req(Method::PUT, "/__dev/faults")
        .body(r#"{"publish_5xx_rate": 3}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let r = api
        .req(Method::PUT, "/__dev/faults")
        .body(r#"{"nope": 1}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let r = api.req(Method::POST, "/__dev/reset").send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(server.handle().stats().accepted, 0);
    assert!(server.handle().attempts().is_empty());
    // Paused queue → wait-idle times out with 408.
    api.call_json(
        Method::POST,
        "/v2/queues",
        json!({"queueName": "p", "paused": true}),
    )
    .await;
    server.handle().set_faults(Faults::default()).unwrap();
    api.req(Method::POST, &format!("/v2/enqueue/p/{}", sink.url("/i")))
        .send()
        .await
        .unwrap();
    let r = api
        .req(Method::POST, "/__dev/wait-idle?timeout_ms=100")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 408);
    let msgs: serde_json::Value = api
        .req(Method::GET, "/__dev/messages")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(msgs.as_array().unwrap().len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attempt_log_is_capped() {
    let sink = Sink::start().await;
    let server = server(0.001, |c| c.attempt_log_capacity = 5).await;
    let api = Api::new(&server);
    let items: Vec<_> = (0..12)
        .map(|i| json!({"destination": sink.url("/cap"), "body": i.to_string()}))
        .collect();
    api.call_json(Method::POST, "/v2/batch", json!(items)).await;
    server.handle().wait_idle(WAIT).await.unwrap();
    let a = server.handle().attempts();
    assert_eq!(a.len(), 5);
    assert_eq!(a.last().unwrap().seq, 12);
    assert_eq!(server.handle().stats().attempts, 12);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn accept_only_mode_stores_nothing() {
    let sink = Sink::start().await;
    let server = server(0.001, |c| c.deliver = false).await;
    let api = Api::new(&server);
    let id = api
        .publish_ok(&sink.url("/n"), &[("Upstash-Deduplication-Id", "z")], "x")
        .await;
    let (st, v) = api
        .publish(&sink.url("/n"), &[("Upstash-Deduplication-Id", "z")], "x")
        .await;
    assert_eq!((st, v["messageId"].as_str()), (202, Some(id.as_str())));
    server.handle().wait_idle(WAIT).await.unwrap();
    assert!(sink.received().is_empty());
    assert_eq!(
        api.call(Method::GET, &format!("/v2/messages/{id}")).await.0,
        404
    );
    assert_eq!(server.handle().messages_accepted(), 1);
}
