//! Observability of the whole local stack, as CloudWatch would see it: the test runs the stack in a child process
//! (this test binary again, running the ignored test `child_runs_the_stack`) with the production log setup
//! (`outbox::telemetry`, JSON, every crate at TRACE) and the EMF lines on stdout, and with distinctive secrets — a
//! database password, a QStash token, both signing keys — then reads everything the child wrote:
//!
//! * no secret appears anywhere (not in a log line, not in an EMF line, not in an error);
//! * the producer's `traceparent` is on the consumer's log line for that event;
//! * log lines carry outbox id, message id, topic, key and attempt where they apply (consumer, failure callback,
//!   relay dead-letter warning, redrive);
//! * the relay's EMF lines carry Pending, OldestPendingAge, Dispatched, Retried, DeadLettered, BlockedKeys and
//!   publish latency; the consumer's carry Applied, Duplicates, RejectedSignatures, PermanentFailures and
//!   TransientFailures, with values that match what happened.

use std::collections::{BTreeSet, HashMap};
use std::time::Duration;

use orders_example::{LineItem, OrderEvent, OrderPlaced, order_event};
use outbox::db::{Db, Statements};
use outbox::internals::RelaySteps;
use outbox::producer::enqueue_batch;
use outbox_testkit::db::url_with_password;
use outbox_testkit::stack::{LocalStack, StackOptions};
use serde_json::{Value, json};
use sqlx::PgPool;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const PASSWORD: &str = "pw-S3cr3t-7f1c9e0d";
const TOKEN: &str = "qstash-tok-5b2e8d0a9c4f";
const CURRENT_KEY: &str = "sig-current-1a2b3c4d5e";
const NEXT_KEY: &str = "sig-next-9z8y7x6w5v";
const TRACEPARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

fn order(id: &str, amount: i64) -> outbox::NewEvent {
    order_event(&OrderEvent::OrderPlaced(OrderPlaced {
        order_id: id.into(),
        customer_id: "c-1".into(),
        amount_cents: amount,
        currency: "EUR".into(),
        items: vec![LineItem {
            sku: "sku-1".into(),
            quantity: 1,
        }],
    }))
    .unwrap()
}

/// The child: runs the stack with the secrets it is given, prints the ids it produced on its last line.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "run as a subprocess by logs_and_metrics_of_the_whole_stack"]
async fn child_runs_the_stack() {
    let url = std::env::var("OBS_DATABASE_URL").expect("run by the parent test");
    outbox::telemetry::init(outbox::telemetry::LogFormat::Json);
    let mut opts = StackOptions::new(&url).unwrap();
    opts.dev.token = TOKEN.into();
    opts.dev.current_signing_key = CURRENT_KEY.into();
    opts.dev.next_signing_key = NEXT_KEY.into();
    opts.consumer_metrics = true;
    opts.relay.lease = Duration::from_secs(1);
    opts.invocation = Duration::from_secs(3);
    let stack = LocalStack::start(opts).await.unwrap();

    let mut tx = stack.pool.begin().await.unwrap();
    let ids: Vec<i64> = enqueue_batch(
        &mut tx,
        &[
            order("order-good", 1200).traceparent(TRACEPARENT),
            order("order-poison", -5),
        ],
    )
    .await
    .unwrap()
    .iter()
    .map(|e| e.id.get())
    .collect();
    tx.commit().await.unwrap();

    // A forged delivery: rejected before anything is read.
    let addr = stack.consumer_url.trim_start_matches("http://").to_owned();
    let mut s = tokio::net::TcpStream::connect(&addr).await.unwrap();
    let body = r#"{"contract":2,"topic":"orders","events":[{"id":1,"key":"forged","payload":{}}]}"#;
    s.write_all(
        format!(
            "POST /events/orders?contract=2 HTTP/1.1\r\nhost: {addr}\r\nupstash-signature: not.a.jwt\r\nx-outbox-id: 1\r\n\
             content-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
            body.len()
        )
        .as_bytes(),
    )
    .await
    .unwrap();
    let mut response = String::new();
    s.read_to_string(&mut response).await.unwrap();
    assert!(response.starts_with("HTTP/1.1 401"), "{response}");

    assert!(
        stack.wait_quiet(Duration::from_secs(60)).await,
        "the stack did not drain"
    );
    stack.stop().await;

    // A relay that cannot reach QStash, with a budget of one attempt: its dead-letter warning.
    let audit = {
        let mut tx = sqlx::PgPool::connect(&url)
            .await
            .unwrap()
            .begin()
            .await
            .unwrap();
        let ev = orders_example::audit_event(
            "actor-9",
            &orders_example::AuditEntry {
                actor: "actor-9".into(),
                action: "x".into(),
                details: json!({}),
            },
        )
        .unwrap();
        let id = enqueue_batch(&mut tx, &[ev]).await.unwrap()[0].id;
        tx.commit().await.unwrap();
        id
    };
    // A "QStash" that refuses every message with 400 (a verdict on the message): a dead letter at once. A closed
    // port would be a QStash outage, which spends no attempt and dead-letters nothing (decision record 0012).
    let refuser = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let refuser_url = format!("http://{}", refuser.local_addr().unwrap());
    tokio::spawn(async move {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        while let Ok((mut sock, _)) = refuser.accept().await {
            let mut buf = Vec::new();
            let mut chunk = [0u8; 4096];
            // Read the whole request (headers, then Content-Length bytes) before answering.
            while let Ok(n) = sock.read(&mut chunk).await {
                if n == 0 {
                    break;
                }
                buf.extend_from_slice(&chunk[..n]);
                let text = String::from_utf8_lossy(&buf).to_string();
                if let Some(end) = text.find("\r\n\r\n") {
                    let len = text[..end]
                        .lines()
                        .find_map(|l| {
                            let (k, v) = l.split_once(':')?;
                            k.eq_ignore_ascii_case("content-length")
                                .then(|| v.trim().parse::<usize>().ok())?
                        })
                        .unwrap_or(0);
                    if buf.len() >= end + 4 + len {
                        break;
                    }
                }
            }
            let body = r#"{"error":"invalid destination"}"#;
            let resp = format!(
                "HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            );
            let _ = sock.write_all(resp.as_bytes()).await;
        }
    });
    let empty: HashMap<String, String> = HashMap::new();
    let mut cfg =
        outbox::config::RelayConfig::from_vars(&outbox::config::Vars::new(&empty), 3).unwrap();
    cfg.max_attempts = 1;
    let qstash = outbox::config::QstashConfig {
        base_url: refuser_url.clone(),
        retries: 3,
        publish_timeout: Duration::from_secs(1),
        batch_size: 10,
        delivery_timeout: None,
        flow_parallelism: 1,
        replay_parallelism: 4,
        flow_rate: None,
        flow_period: Duration::from_secs(1),
        consumer_url: "http://127.0.0.1:9".into(),
        callback_url: "http://127.0.0.1:9".into(),
    };
    let client = outbox::internals::qstash::QstashClient::new(
        &refuser_url,
        secrecy::SecretString::from(TOKEN.to_owned()),
        Duration::from_secs(1),
    )
    .unwrap();
    let pool = outbox::db::DbConfig::defaults("obs")
        .pool(&secrecy::SecretString::from(url.clone()))
        .unwrap();
    let relay = outbox::relay::Relay::new(
        Db::new(pool.clone(), Statements::Prepared),
        client,
        cfg,
        qstash,
    );
    let r = relay.run_cycle().await.unwrap();
    assert_eq!(r.settled.dead, 1);

    // An operator redrives it and looks at the status (their log lines count too).
    let dl: i64 = sqlx::query_scalar("SELECT id FROM dead_letters WHERE outbox_id = $1")
        .bind(audit)
        .fetch_one(&pool)
        .await
        .unwrap();
    let mut conn = pool.acquire().await.unwrap();
    outbox::dead_letters::redrive(&mut conn, dl, Default::default())
        .await
        .unwrap();
    outbox::ops::status(&pool).await.unwrap();
    println!(
        "OBS_IDS {}",
        json!({"good": ids[0], "poison": ids[1], "audit": audit})
    );
}

fn metric_names(line: &Value) -> BTreeSet<String> {
    line["_aws"]["CloudWatchMetrics"][0]["Metrics"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|m| m["Name"].as_str().map(str::to_owned))
        .collect()
}

fn sum(lines: &[&Value], metric: &str) -> f64 {
    lines.iter().filter_map(|l| l[metric].as_f64()).sum()
}

#[sqlx::test(migrator = "outbox_testkit::MIGRATOR")]
async fn logs_and_metrics_of_the_whole_stack(pool: PgPool) {
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            outbox_testkit::test_path(module_path!(), "child_runs_the_stack").as_str(),
            "--exact",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("OBS_DATABASE_URL", url_with_password(&pool, Some(PASSWORD)))
        .env("RUST_LOG", "trace")
        .env_remove("AWS_LAMBDA_LOG_LEVEL")
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        out.status.success(),
        "child failed:\n{}\n{stderr}",
        stdout.lines().rev().take(40).collect::<Vec<_>>().join("\n")
    );

    // 1. No secret anywhere.
    let everything = format!("{stdout}\n{stderr}");
    for secret in [PASSWORD, TOKEN, CURRENT_KEY, NEXT_KEY] {
        if let Some(line) = everything.lines().find(|l| l.contains(secret)) {
            panic!(
                "secret {secret:?} was written: {}",
                line.chars().take(600).collect::<String>()
            );
        }
    }

    let lines: Vec<Value> = stdout
        .lines()
        // (libtest may print "test child_runs_the_stack ... " in front of the first line)
        .filter_map(|l| serde_json::from_str::<Value>(&l[l.find('{')?..]).ok())
        .filter(Value::is_object)
        .collect();
    // The check above means something only if the logs really are verbose: TRACE and DEBUG lines from every layer.
    let levels: BTreeSet<&str> = lines.iter().filter_map(|l| l["level"].as_str()).collect();
    assert!(
        levels.contains("TRACE") && levels.contains("DEBUG"),
        "{levels:?}"
    );
    assert!(lines.len() > 100, "only {} JSON lines", lines.len());
    let ids: Value = stdout
        .lines()
        .find_map(|l| l.strip_prefix("OBS_IDS "))
        .and_then(|l| serde_json::from_str(l).ok())
        .expect("the child reports its ids");
    let (good, poison, audit) = (&ids["good"], &ids["poison"], &ids["audit"]);

    let logs: Vec<&Value> = lines.iter().filter(|l| l.get("_aws").is_none()).collect();
    let find = |message: &str, pred: &dyn Fn(&Value) -> bool| -> Value {
        logs.iter()
            .find(|l| l["message"] == message && pred(l))
            .map(|l| (*l).clone())
            .unwrap_or_else(|| panic!("no {message:?} line matching"))
    };

    // 2. The producer's trace context reaches the consumer's log line for that event, with its ids.
    let handled = find("event handled", &|l| l["span"]["outbox_id"] == *good);
    assert_eq!(handled["span"]["traceparent"], TRACEPARENT, "{handled}");
    assert_eq!(handled["span"]["topic"], "orders");
    assert_eq!(handled["span"]["key"], "order-good");
    assert_eq!(
        handled["span"]["retried"], 0,
        "the attempt (QStash's retry counter)"
    );
    assert!(
        handled["span"]["message_id"]
            .as_str()
            .is_some_and(|m| m.starts_with("msg_")),
        "{handled}"
    );

    // 3. The poison event: the consumer's refusal and the failure callback's dead letter carry its ids.
    let refused = find("event refused permanently (QStash dead-letters it)", &|l| {
        l["span"]["outbox_id"] == *poison
    });
    assert_eq!(refused["span"]["key"], "order-poison");
    let recorded = find("QStash gave up on an event: dead letter recorded", &|l| {
        l["span"]["outbox_id"] == *poison
    });
    assert_eq!(recorded["span"]["topic"], "orders", "{recorded}");
    assert_eq!(recorded["span"]["key"], "order-poison");
    assert!(
        recorded["span"]["message_id"].as_str().is_some(),
        "{recorded}"
    );
    find("signature rejected", &|_| true);

    // 4. The relay's dead-letter warning and the redrive.
    let dead = find("dead-lettering event", &|l| l["outbox_id"] == *audit);
    assert_eq!(
        (&dead["topic"], &dead["key"], &dead["attempt"]),
        (&json!("audit"), &json!("actor-9"), &json!(1)),
        "{dead}"
    );
    let redriven = find("dead letter redriven", &|l| l["outbox_id"] == *audit);
    assert_eq!(redriven["redrive_count"], 1);

    // 5. EMF lines.
    let emf = |function: &str| -> Vec<&Value> {
        lines
            .iter()
            .filter(|l| l.get("_aws").is_some() && l["Function"] == function)
            .collect()
    };
    let relay = emf("relay");
    assert!(!relay.is_empty(), "no relay EMF line");
    for l in &relay {
        let names = metric_names(l);
        for m in [
            "Pending",
            "OldestPendingAge",
            "Dispatched",
            "Retried",
            "DeadLettered",
            "BlockedKeys",
            "PublishLatencyP50",
            "PublishLatencyP99",
        ] {
            assert!(names.contains(m), "relay EMF lacks {m}: {l}");
            assert!(l[m].is_number(), "{m} has no value: {l}");
        }
        assert_eq!(l["_aws"]["CloudWatchMetrics"][0]["Namespace"], "Outbox");
    }
    assert_eq!(
        sum(&relay, "Dispatched"),
        2.0,
        "both orders dispatched once"
    );
    assert_eq!(
        relay.last().map(|l| l["BlockedKeys"].clone()),
        Some(json!(1.0)),
        "the poison order's key"
    );
    let consumer = emf("consumer");
    for l in &consumer {
        let names = metric_names(l);
        for m in [
            "Applied",
            "Duplicates",
            "RejectedSignatures",
            "PermanentFailures",
            "TransientFailures",
        ] {
            assert!(names.contains(m), "consumer EMF lacks {m}: {l}");
        }
    }
    assert_eq!(consumer.len(), 3, "one line per request");
    assert_eq!(sum(&consumer, "Applied"), 1.0);
    assert_eq!(sum(&consumer, "PermanentFailures"), 1.0);
    assert_eq!(sum(&consumer, "RejectedSignatures"), 1.0);
    assert_eq!(sum(&consumer, "Duplicates"), 0.0);
    assert_eq!(sum(&consumer, "TransientFailures"), 0.0);
}
