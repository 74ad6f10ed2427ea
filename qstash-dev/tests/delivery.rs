//! Delivery behaviour: signing, forwarding, retries/backoff, Retry-After, 489, timeouts, flow control,
//! queues, callbacks.

mod common;

use std::time::{Duration, Instant};

use base64::Engine;
use common::*;
use qstash_dev::{AttemptKind, NbfMode, WaitlistOrder};
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delivery_forwards_raw_body_headers_and_signs_like_qstash() {
    let sink = Sink::start().await;
    let server = server(0.001, |_| {}).await;
    let api = Api::new(&server);
    let body: Vec<u8> = vec![0xff, 0x00, 0xfe, b'{', 0x80, b'}'];
    let dest = sink.url("/hook//double?x=1");
    let id = api
        .publish_ok(
            &format!("{dest}&qstash_token=ignored&upstash-retries=0"),
            &[
                ("Content-Type", "application/octet-stream"),
                ("Upstash-Forward-Authorization", "Bearer downstream"),
                ("Upstash-Forward-X-Outbox-Id", "42"),
                ("X-Not-Forwarded", "1"),
                ("Upstash-Telemetry-Sdk", "test"),
            ],
            body.clone(),
        )
        .await;
    let got = sink.wait_for("/hook//double", 1).await;
    let r = &got[0];
    assert_eq!(r.method, "POST");
    assert_eq!(
        r.target, "/hook//double?x=1",
        "slashes and destination query preserved, config stripped"
    );
    assert_eq!(r.body.as_ref(), body.as_slice(), "raw body byte-for-byte");
    assert_eq!(r.header("content-type"), Some("application/octet-stream"));
    assert_eq!(r.header("authorization"), Some("Bearer downstream"));
    assert_eq!(r.header("x-outbox-id"), Some("42"));
    assert_eq!(r.header("x-not-forwarded"), None);
    assert_eq!(r.header("upstash-telemetry-sdk"), None);
    assert_eq!(r.header("user-agent"), Some("Upstash-QStash"));
    assert_eq!(r.header("upstash-message-id"), Some(id.as_str()));
    assert_eq!(r.header("upstash-retried"), Some("0"));
    assert_eq!(r.header("upstash-caller-ip"), Some("127.0.0.1"));
    assert_eq!(r.header("upstash-region"), Some("EU-CENTRAL-1"));

    let keys = server.signing_keys();
    let v = verify_signature(
        r.header("upstash-signature").unwrap(),
        &keys.current,
        &dest,
        &body,
        false,
    );
    assert_eq!(v.header_text, r#"{"alg":"HS256","typ":"JWT"}"#);
    let c = &v.claims;
    assert_eq!(c["iss"], "Upstash");
    assert_eq!(c["aud"], "");
    assert_eq!(c["nbf"], json!(-62135596800i64));
    assert_eq!(c["exp"].as_i64().unwrap() - c["iat"].as_i64().unwrap(), 300);
    let jti = c["jti"].as_str().unwrap();
    assert!(
        jti.starts_with("jwt_")
            && jti.len() == 32
            && jti[4..].bytes().all(|b| b.is_ascii_alphanumeric())
    );
    let keys_in_order: Vec<&str> =
        ["aud", "body", "exp", "iat", "iss", "jti", "nbf", "sub"].to_vec();
    let positions: Vec<usize> = keys_in_order
        .iter()
        .map(|k| {
            v.payload_text
                .find(&format!("\"{k}\":"))
                .expect("claim present")
        })
        .collect();
    assert!(
        positions.windows(2).all(|w| w[0] < w[1]),
        "claims in alphabetical order: {}",
        v.payload_text
    );
    // The next key must not verify a token signed with the current key.
    let wrong = std::panic::catch_unwind(|| {
        verify_signature(
            r.header("upstash-signature").unwrap(),
            &keys.next,
            &dest,
            &body,
            false,
        )
    });
    assert!(wrong.is_err());
    server.handle().wait_idle(WAIT).await.unwrap();
    assert_eq!(server.handle().stats().delivered, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nbf_now_mode_and_fresh_token_per_attempt() {
    let sink = Sink::with(|_, n| {
        if n < 1 {
            Reply::status(500)
        } else {
            Reply::ok()
        }
    })
    .await;
    let server = server(0.0001, |c| c.nbf = NbfMode::Now).await;
    let api = Api::new(&server);
    let dest = sink.url("/n");
    api.publish_ok(&dest, &[("Upstash-Retries", "2")], "hi")
        .await;
    let got = sink.wait_for("/n", 2).await;
    let t0 = got[0].header("upstash-signature").unwrap();
    let t1 = got[1].header("upstash-signature").unwrap();
    assert_ne!(t0, t1, "each attempt gets a fresh token (new jti)");
    let v = verify_signature(t1, &server.signing_keys().current, &dest, b"hi", true);
    assert_eq!(v.claims["nbf"], v.claims["iat"]);
    assert_eq!(got[1].header("upstash-retried"), Some("1"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn default_backoff_schedule_shape() {
    let sink = Sink::with(|_, _| Reply::status(500)).await;
    let scale = 0.001;
    let server = server(scale, |_| {}).await;
    let api = Api::new(&server);
    let id = api.publish_ok(&sink.url("/fail"), &[], "x").await;
    let h = server.handle();
    h.wait_idle(WAIT).await.unwrap();
    let attempts = h.attempts_for(&id);
    assert_eq!(attempts.len(), 4, "default retries = 3 → 4 attempts");
    let retried: Vec<u32> = attempts.iter().map(|a| a.retried).collect();
    assert_eq!(retried, vec![0, 1, 2, 3]);
    let planned: Vec<u64> = attempts
        .iter()
        .map(|a| a.planned_delay.as_millis() as u64)
        .collect();
    // min(86400, e^(2.5 n)) seconds before the attempt with Upstash-Retried = n.
    let want: Vec<u64> = (0..4)
        .map(|n| {
            if n == 0 {
                0
            } else {
                ((2.5 * n as f64).exp().min(86400.0) * 1000.0) as u64
            }
        })
        .collect();
    for (p, w) in planned.iter().zip(&want) {
        assert!(p.abs_diff(*w) <= 1, "planned {planned:?} want {want:?}");
    }
    // Real gaps are at least the scaled backoff (timers never fire early).
    for i in 1..4 {
        let gap = attempts[i].offset - attempts[i - 1].offset;
        let min = Duration::from_millis(want[i]).mul_f64(scale);
        assert!(gap >= min, "gap {i} = {gap:?} < {min:?}");
    }
    let dlq = h.dlq_entries();
    assert_eq!(dlq.len(), 1);
    assert_eq!(dlq[0].message_id, id);
    assert_eq!(dlq[0].retried, 3);
    assert_eq!(dlq[0].response_status, Some(500));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_delay_expression_schedule() {
    let sink = Sink::with(|_, _| Reply::status(503)).await;
    let server = server(0.01, |_| {}).await;
    let api = Api::new(&server);
    let id = api
        .publish_ok(
            &sink.url("/f"),
            &[
                ("Upstash-Retries", "3"),
                ("Upstash-Retry-Delay", "1000 * (1 + retried)"),
            ],
            "x",
        )
        .await;
    server.handle().wait_idle(WAIT).await.unwrap();
    let a = server.handle().attempts_for(&id);
    let planned: Vec<u128> = a.iter().map(|a| a.planned_delay.as_millis()).collect();
    assert_eq!(
        planned,
        vec![0, 1000, 2000, 3000],
        "retried = 0 for the first retry"
    );
    for i in 1..4 {
        assert!(a[i].offset - a[i - 1].offset >= Duration::from_millis(planned[i] as u64 / 100));
    }
    // An invalid expression is a 400.
    let (st, v) = api
        .publish(&sink.url("/f"), &[("Upstash-Retry-Delay", "pow(2,")], "x")
        .await;
    assert_eq!(st, 400);
    assert!(v["error"].as_str().unwrap().contains("Upstash-Retry-Delay"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_after_is_honoured_and_over_a_day_ignored() {
    let sink = Sink::with(|r, n| match (r.target.as_str(), n) {
        ("/ra", 0) => Reply::status(429).header("Retry-After", "7"),
        ("/ra", 1) => Reply::status(503).header("X-RateLimit-Reset", "1m30s"),
        ("/long", 0) => Reply::status(429).header("Retry-After", "100000"),
        _ => Reply::ok(),
    })
    .await;
    let server = server(0.001, |_| {}).await;
    let api = Api::new(&server);
    let id = api
        .publish_ok(&sink.url("/ra"), &[("Upstash-Retry-Delay", "5000")], "x")
        .await;
    let long = api.publish_ok(&sink.url("/long"), &[], "x").await;
    server.handle().wait_idle(WAIT).await.unwrap();
    let a = server.handle().attempts_for(&id);
    let planned: Vec<u128> = a.iter().map(|a| a.planned_delay.as_millis()).collect();
    assert_eq!(
        planned,
        vec![0, 7000, 90_000],
        "Retry-After wins over Retry-Delay; Go durations accepted"
    );
    assert!(a[2].succeeded());
    let l = server.handle().attempts_for(&long);
    assert_eq!(l.len(), 2);
    assert_eq!(
        l[1].planned_delay.as_millis(),
        12_182,
        "Retry-After above one day falls back to the backoff"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_489_with_header_goes_to_dlq_at_once_but_500_is_retried() {
    let sink = Sink::with(|r, _| match r.target.as_str() {
        "/nr" => Reply::status(489)
            .header("Upstash-NonRetryable-Error", "true")
            .body(b"bad payload"),
        "/489-no-header" => Reply::status(489),
        "/hdr-400" => Reply::status(400).header("Upstash-NonRetryable-Error", "true"),
        _ => Reply::status(500),
    })
    .await;
    let server = server(0.0001, |_| {}).await;
    let api = Api::new(&server);
    let nr = api
        .publish_ok(&sink.url("/nr"), &[("Upstash-Retries", "5")], "x")
        .await;
    let plain = api
        .publish_ok(&sink.url("/500"), &[("Upstash-Retries", "2")], "x")
        .await;
    let no_hdr = api
        .publish_ok(
            &sink.url("/489-no-header"),
            &[("Upstash-Retries", "1")],
            "x",
        )
        .await;
    let hdr400 = api
        .publish_ok(&sink.url("/hdr-400"), &[("Upstash-Retries", "1")], "x")
        .await;
    let h = server.handle();
    h.wait_idle(WAIT).await.unwrap();
    assert_eq!(h.attempts_for(&nr).len(), 1);
    assert_eq!(h.attempts_for(&plain).len(), 3);
    assert_eq!(
        h.attempts_for(&no_hdr).len(),
        2,
        "489 without the header is an ordinary failure"
    );
    assert_eq!(
        h.attempts_for(&hdr400).len(),
        2,
        "default: the header alone does not stop retries"
    );
    let dlq = h.dlq_entries();
    let e = dlq.iter().find(|e| e.message_id == nr).unwrap();
    assert_eq!(e.response_status, Some(489));
    assert_eq!(e.response_body, b"bad payload");
    assert_eq!(dlq.len(), 4);

    // HeaderAlone mode: a 400 + header is final too.
    let server2 = common::server(0.0001, |c| {
        c.non_retryable = qstash_dev::NonRetryableMode::HeaderAlone
    })
    .await;
    let api2 = Api::new(&server2);
    let id = api2
        .publish_ok(&sink.url("/hdr-400"), &[("Upstash-Retries", "3")], "x")
        .await;
    server2.handle().wait_idle(WAIT).await.unwrap();
    assert_eq!(server2.handle().attempts_for(&id).len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_attempt_timeout() {
    let sink = Sink::with(|_, _| Reply::ok().delay(Duration::from_secs(5))).await;
    let server = server(0.001, |_| {}).await;
    let api = Api::new(&server);
    let id = api
        .publish_ok(
            &sink.url("/slow"),
            &[("Upstash-Timeout", "1s"), ("Upstash-Retries", "0")],
            "x",
        )
        .await;
    let h = server.handle();
    h.wait_idle(WAIT).await.unwrap();
    let a = h.attempts_for(&id);
    assert_eq!(a.len(), 1);
    assert!(a[0].status.is_none());
    assert!(
        a[0].error.as_deref().unwrap().contains("timeout"),
        "{:?}",
        a[0].error
    );
    assert!(a[0].duration >= Duration::from_secs(1));
    assert_eq!(h.dlq_entries().len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flow_control_parallelism_is_never_exceeded() {
    let sink = Sink::with(|_, _| Reply::ok().delay(Duration::from_millis(100))).await;
    let server = server(0.001, |_| {}).await;
    let api = Api::new(&server);
    let mut items = vec![];
    for i in 0..16 {
        items.push(json!({
            "destination": sink.url("/p"),
            "headers": {"upstash-flow-control-key": "tenant-1", "upstash-flow-control-value": "parallelism=2"},
            "body": i.to_string(),
        }));
    }
    let (st, v) = api
        .call_json(reqwest::Method::POST, "/v2/batch", json!(items))
        .await;
    assert_eq!(st, 200, "{v}");
    let (st, fc) = api
        .call(reqwest::Method::GET, "/v2/flowControl/tenant-1")
        .await;
    assert_eq!(st, 200);
    assert_eq!(fc["flowControlKey"], "tenant-1");
    assert_eq!(fc["parallelismMax"], 2);
    assert!(fc["waitListSize"].as_u64().unwrap() > 0, "{fc}");
    server.handle().wait_idle(WAIT).await.unwrap();
    assert_eq!(sink.received_at("/p").len(), 16);
    assert!(
        sink.max_in_flight() <= 2,
        "max in flight {}",
        sink.max_in_flight()
    );
    assert!(sink.max_in_flight() >= 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flow_control_rate_limit() {
    let sink = Sink::start().await;
    let scale = 0.5; // period 1s → 500 ms
    let server = server(scale, |_| {}).await;
    // Attempt offsets count from the server's start, which lies before this instant...
    let server_started_by = Instant::now();
    let api = Api::new(&server);
    // ...and the key's first window opens after this one.
    let first_publish = Instant::now();
    for i in 0..7 {
        api.publish_ok(
            &sink.url("/r"),
            &[
                ("Upstash-Flow-Control-Key", "rk"),
                ("Upstash-Flow-Control-Value", "rate=3, period=1s"),
            ],
            i.to_string(),
        )
        .await;
    }
    server.handle().wait_idle(WAIT).await.unwrap();
    let mut offs: Vec<Duration> = server
        .handle()
        .attempts()
        .iter()
        .map(|a| a.offset)
        .collect();
    offs.sort();
    assert_eq!(offs.len(), 7);
    // 3 per window: at most three attempts start before the second window (at least 500 ms after the first
    // opened), at most six before the third. Lower bounds that hold however slow the machine: timers never fire
    // early, and the first window opened no earlier than `first_publish`.
    let window = Duration::from_millis(500);
    let opened = first_publish - server_started_by;
    assert!(offs[3] >= opened + window, "{opened:?} {offs:?}");
    assert!(offs[6] >= opened + 2 * window, "{opened:?} {offs:?}");
}

async fn delivery_order(order: WaitlistOrder, seed: u64) -> Vec<String> {
    let sink = Sink::with(|_, _| Reply::ok().delay(Duration::from_millis(5))).await;
    let server = server(0.001, |c| {
        c.waitlist_order = order;
        c.seed = seed;
    })
    .await;
    let api = Api::new(&server);
    let items: Vec<_> = (0..20)
        .map(|i| {
            json!({
                "destination": sink.url("/o"),
                "headers": {"Upstash-Flow-Control-Key": "ord", "Upstash-Flow-Control-Value": "parallelism=1"},
                "body": i.to_string(),
            })
        })
        .collect();
    let (st, _) = api
        .call_json(reqwest::Method::POST, "/v2/batch", json!(items))
        .await;
    assert_eq!(st, 200);
    server.handle().wait_idle(WAIT).await.unwrap();
    sink.received_at("/o")
        .iter()
        .map(|r| String::from_utf8(r.body.to_vec()).unwrap())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shuffled_waitlist_reorders_and_fifo_does_not() {
    let sorted: Vec<String> = (0..20).map(|i| i.to_string()).collect();
    let fifo = delivery_order(WaitlistOrder::Fifo, 7).await;
    assert_eq!(fifo, sorted);
    let shuffled = delivery_order(WaitlistOrder::Shuffled, 7).await;
    assert_eq!(shuffled.len(), 20);
    assert_ne!(shuffled, sorted, "a later message overtakes an earlier one");
    let mut s = shuffled.clone();
    s.sort_by_key(|x| x.parse::<u32>().unwrap());
    assert_eq!(s, sorted, "every message delivered once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queue_is_fifo_through_retries_and_callbacks() {
    let sink = Sink::with(|r, n| match r.target.as_str() {
        "/q/a" if n < 2 => Reply::status(500),
        "/cb" => Reply::ok().delay(Duration::from_millis(30)),
        _ => Reply::ok(),
    })
    .await;
    let server = server(0.001, |_| {}).await;
    let api = Api::new(&server);
    let mut ids = vec![];
    for p in ["a", "b", "c"] {
        let resp = api
            .req(
                reqwest::Method::POST,
                &format!("/v2/enqueue/orders/{}", sink.url(&format!("/q/{p}"))),
            )
            .header("Upstash-Retry-Delay", "20")
            .header("Upstash-Callback", sink.url("/cb"))
            .body(p)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        let v: serde_json::Value = resp.json().await.unwrap();
        ids.push(v["messageId"].as_str().unwrap().to_string());
    }
    let h = server.handle();
    h.wait_idle(WAIT).await.unwrap();
    let attempts = h.attempts();
    let received = sink.received();
    let dest_order: Vec<&str> = received
        .iter()
        .map(|r| r.target.as_str())
        .filter(|p| p.starts_with("/q/"))
        .collect();
    assert_eq!(dest_order, vec!["/q/a", "/q/a", "/q/a", "/q/b", "/q/c"]);
    // Every callback of a finished before b's first attempt started; b's callback before c.
    let end = |a: &qstash_dev::DeliveryAttempt| a.offset + a.duration;
    let first_of = |id: &str| {
        attempts
            .iter()
            .filter(|a| a.message_id == id)
            .map(|a| a.offset)
            .min()
            .unwrap()
    };
    let a_related_end = attempts
        .iter()
        .filter(|a| {
            a.message_id == ids[0]
                || (a.kind == AttemptKind::Callback && a.offset < first_of(&ids[1]))
        })
        .map(end)
        .max()
        .unwrap();
    assert_eq!(
        attempts
            .iter()
            .filter(|a| a.kind == AttemptKind::Callback)
            .count(),
        5,
        "one callback per attempt"
    );
    let cb_before_b = attempts
        .iter()
        .filter(|a| a.kind == AttemptKind::Callback && a.offset < first_of(&ids[1]))
        .count();
    assert_eq!(
        cb_before_b, 3,
        "all three callbacks of a ran before b started"
    );
    assert!(a_related_end <= first_of(&ids[1]));
    let (st, q) = api.call(reqwest::Method::GET, "/v2/queues/orders").await;
    assert_eq!(st, 200);
    assert_eq!(q["parallelism"], 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn callback_and_failure_callback_bodies() {
    let sink = Sink::with(|r, _| match r.target.as_str() {
        "/dest" => Reply::status(500)
            .header("X-Reason", "db down")
            .body("nope ✗".as_bytes()),
        _ => Reply::ok(),
    })
    .await;
    let server = server(0.0001, |_| {}).await;
    let api = Api::new(&server);
    let dest = sink.url("/dest");
    let cb = sink.url("/cb?k=v");
    let fcb = sink.url("/fcb");
    let id = api
        .publish_ok(
            &dest,
            &[
                ("Content-Type", "application/json"),
                ("Upstash-Retries", "1"),
                ("Upstash-Forward-X-Trace", "t1"),
                ("Upstash-Callback", &cb),
                ("Upstash-Callback-Forward-X-Cb", "yes"),
                ("Upstash-Failure-Callback", &fcb),
                ("Upstash-Failure-Callback-Forward-X-Fcb", "yes"),
                ("Upstash-Failure-Callback-Retries", "0"),
            ],
            r#"{"order":1}"#,
        )
        .await;
    server.handle().wait_idle(WAIT).await.unwrap();
    let cbs = sink.received_at("/cb");
    assert_eq!(cbs.len(), 2, "a callback per attempt");
    let fcbs = sink.received_at("/fcb");
    assert_eq!(fcbs.len(), 1, "one failure callback");
    let keys = server.signing_keys();
    for (r, url) in cbs
        .iter()
        .map(|r| (r, &cb))
        .chain(fcbs.iter().map(|r| (r, &fcb)))
    {
        assert_eq!(r.header("content-type"), Some("application/json"));
        verify_signature(
            r.header("upstash-signature").unwrap(),
            &keys.current,
            url,
            &r.body,
            false,
        );
        assert_ne!(
            r.header("upstash-message-id"),
            Some(id.as_str()),
            "callbacks are messages of their own"
        );
    }
    assert_eq!(cbs[0].header("x-cb"), Some("yes"));
    assert_eq!(fcbs[0].header("x-fcb"), Some("yes"));
    let b64 = base64::engine::general_purpose::STANDARD;
    let mut retried: Vec<i64> = cbs
        .iter()
        .map(|r| r.json()["retried"].as_i64().unwrap())
        .collect();
    retried.sort();
    assert_eq!(retried, vec![0, 1]);
    let f = fcbs[0].json();
    assert_eq!(f["status"], 500);
    assert_eq!(
        b64.decode(f["body"].as_str().unwrap()).unwrap(),
        "nope ✗".as_bytes()
    );
    assert_eq!(f["header"]["X-Reason"], json!(["db down"]));
    assert_eq!(f["retried"], 1);
    assert_eq!(f["maxRetries"], 1);
    assert_eq!(f["sourceMessageId"], id);
    assert_eq!(f["url"], dest);
    assert_eq!(f["method"], "POST");
    assert_eq!(
        f["sourceHeader"]["Content-Type"],
        json!(["application/json"])
    );
    assert_eq!(f["sourceHeader"]["X-Trace"], json!(["t1"]));
    assert_eq!(
        b64.decode(f["sourceBody"].as_str().unwrap()).unwrap(),
        br#"{"order":1}"#
    );
    assert!(f["notBefore"].is_u64() && f["createdAt"].is_u64());
    assert_eq!(f["callerIP"], "127.0.0.1");
    let dlq = server.handle().dlq_entries();
    assert_eq!(dlq.len(), 1);
    assert_eq!(f["dlqId"], dlq[0].dlq_id);
    assert!(cbs.iter().all(|r| r.json().get("dlqId").is_none()));

    // Success callback.
    sink.set(|_, _| Reply::ok().body(b"done"));
    api.publish_ok(
        &sink.url("/ok"),
        &[("Upstash-Callback", &sink.url("/cb2"))],
        "x",
    )
    .await;
    let c = sink.wait_for("/cb2", 1).await[0].json();
    assert_eq!(c["status"], 200);
    assert_eq!(c["body"], b64.encode("done"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn method_not_before_and_delay() {
    let sink = Sink::start().await;
    let server = server(0.00001, |_| {}).await;
    let api = Api::new(&server);
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let nb = (now + 3600).to_string();
    let a = api
        .publish_ok(
            &sink.url("/m"),
            &[("Upstash-Method", "PUT"), ("Upstash-Delay", "1d10h30m")],
            "x",
        )
        .await;
    let b = api
        .publish_ok(
            &sink.url("/m"),
            &[("Upstash-Delay", "1d"), ("Upstash-Not-Before", &nb)],
            "y",
        )
        .await;
    let g = api
        .publish_ok(&sink.url("/get"), &[("Upstash-Method", "GET")], "")
        .await;
    server.handle().wait_idle(WAIT).await.unwrap();
    let h = server.handle();
    let pa = h.attempts_for(&a)[0].planned_delay;
    assert_eq!(pa, Duration::from_secs(86400 + 36000 + 1800));
    assert_eq!(h.attempts_for(&a)[0].method, "PUT");
    let pb = h.attempts_for(&b)[0].planned_delay;
    assert!(
        pb <= Duration::from_secs(3600) && pb >= Duration::from_secs(3590),
        "not-before overrides delay: {pb:?}"
    );
    assert_eq!(h.attempts_for(&g)[0].method, "GET");
    assert_eq!(sink.received_at("/get")[0].method, "GET");
}
