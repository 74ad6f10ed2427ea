//! The relay's Lambda handler driven with the `events/` fixtures (EventBridge rule and Scheduler payloads).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use lambda_runtime::{Context, LambdaEvent};
use outbox::config::{QstashConfig, RelayConfig};
use outbox::db::{Db, Statements};
use outbox::internals::RelaySteps;
use outbox::internals::handler::{RelayState, handle};
use outbox::internals::qstash::QstashClient;
use outbox::producer::{NewEvent, Topic, enqueue_batch};
use outbox::relay::Relay;
use outbox_testkit::sink::Sink;
use qstash_dev::{Config as DevConfig, DevServer};
use secrecy::SecretString;
use serde_json::{Value, json};
use sqlx::PgPool;

fn fixture(name: &str) -> Value {
    let path = outbox_testkit::repo_root().join("events").join(name);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap()
}

fn context(deadline_in: Duration) -> Context {
    let mut ctx = Context::default();
    ctx.request_id = "test-request".into();
    let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap();
    ctx.deadline = (now + deadline_in).as_millis() as u64;
    ctx
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn handler_runs_from_the_scheduled_event_fixtures(pool: PgPool) {
    let dev = DevServer::start(DevConfig::for_tests(0.001)).await.unwrap();
    let sink = Sink::start(pool.clone()).await;
    let relay_cfg = RelayConfig {
        lease: Duration::from_secs(1),
        poll_interval: Duration::from_millis(20),
        deadline_margin: Duration::from_millis(200),
        // One event per message: the sink below counts deliveries as events.
        batching: outbox::config::DeliveryBatching {
            default_n: 1,
            ..Default::default()
        },
        ..RelayConfig::from_vars(
            &outbox::config::Vars::new(&std::collections::HashMap::<String, String>::new()),
            3,
        )
        .unwrap()
    };
    let qstash = QstashConfig {
        base_url: dev.url(),
        retries: 3,
        publish_timeout: Duration::from_secs(2),
        batch_size: 100,
        delivery_timeout: None,
        flow_parallelism: 10,
        replay_parallelism: 4,
        flow_rate: None,
        flow_period: Duration::from_secs(1),
        consumer_url: sink.url.clone(),
        callback_url: sink.url.clone(),
    };
    let client = QstashClient::new(
        &dev.url(),
        SecretString::from(dev.token().to_owned()),
        Duration::from_secs(2),
    )
    .unwrap();
    let state = RelayState::new(
        Relay::new(
            Db::new(pool.clone(), Statements::Prepared),
            client,
            relay_cfg,
            qstash,
        ),
        "relay",
    );

    for (name, trigger, n) in [
        ("scheduled-event.json", "aws.events", 7),
        ("schedule-v2-input.json", "input:schedule", 4),
    ] {
        let topic = Topic::unordered("audit");
        let events: Vec<NewEvent> = (0..n)
            .map(|i| NewEvent::new(&topic, "k", &json!({"i": i})).unwrap())
            .collect();
        let mut tx = pool.begin().await.unwrap();
        enqueue_batch(&mut tx, &events).await.unwrap();
        tx.commit().await.unwrap();

        // Invocations with the Lambda deadline 1.8 s away, until the backlog is empty (a slow machine may need
        // more than one; the limit only stops a hung test). Each one stops by itself with every claim settled:
        // the handler drains to the deadline minus the margin and claims only with a lease left before it.
        let mut dispatched = 0;
        let mut invocations = 0;
        let summary = loop {
            invocations += 1;
            assert!(
                invocations <= 50,
                "{name}: {dispatched}/{n} after 50 invocations"
            );
            let event = LambdaEvent::new(fixture(name), context(Duration::from_millis(1800)));
            let summary = tokio::time::timeout(Duration::from_secs(60), handle(&state, event))
                .await
                .expect("the handler returns by itself")
                .unwrap();
            assert_eq!(summary.trigger, trigger);
            assert_eq!(summary.request_id, "test-request");
            assert_eq!(summary.drain.stopped, "deadline");
            let leased: i64 =
                sqlx::query_scalar("SELECT count(*) FROM outbox WHERE locked_until IS NOT NULL")
                    .fetch_one(&pool)
                    .await
                    .unwrap();
            assert_eq!(
                leased, 0,
                "{name}: returned with a claim unsettled: {summary:?}"
            );
            let line = outbox::internals::handler::emf("relay", &summary).to_json();
            let v: Value = serde_json::from_str(&line).unwrap();
            assert_eq!(v["Dispatched"], json!(summary.drain.dispatched as f64));
            dispatched += summary.drain.dispatched;
            if summary.backlog.pending == 0 {
                break summary;
            }
        };
        assert_eq!(dispatched, n, "{name}: {summary:?}");
        let line = outbox::internals::handler::emf("relay", &summary).to_json();
        let v: Value = serde_json::from_str(&line).unwrap();
        assert_eq!(v["OldestPendingAge"], json!(0.0));
        // The database's health figures are read and emitted on every invocation.
        let health = summary.database.as_ref().expect("health figures read");
        assert!(health.outbox_bytes > 0, "{health:?}");
        assert!(health.sees_all_sessions, "the tests run as a superuser");
        for metric in [
            "OldestTransactionAge",
            "XminHorizonAge",
            "DeadTuplePercent",
            "OutboxTableBytes",
        ] {
            assert!(v[metric].is_number(), "{metric} missing from {line}");
        }
        assert_eq!(v["OutboxTableBytes"], json!(health.outbox_bytes as f64));
        // Every claim is timed, the empty ones too: a drain that ran cycles has a claim latency.
        assert!(
            summary.drain.claim_p50_ms > 0.0
                && summary.drain.claim_p99_ms >= summary.drain.claim_p50_ms,
            "{summary:?}"
        );
        // The EMF line carries the figure through a JSON number: equal up to its last printed digit.
        let p99 = v["ClaimLatencyP99"].as_f64().expect("a number");
        assert!(
            (p99 - summary.drain.claim_p99_ms).abs() <= 1e-9 * p99.abs().max(1.0),
            "{p99} vs {}",
            summary.drain.claim_p99_ms
        );
    }
    dev.handle()
        .wait_idle(Duration::from_secs(10))
        .await
        .unwrap();
    assert_eq!(sink.accepted().len(), 11);
}

/// The per-subscriber figures the handler reads after the backlog (`ops::subscribers::read_within`): none while
/// no topic has named subscribers; one row per subscriber of a topic that has, the default one included, in
/// either statement mode; and the read is bounded: its statement timeout, local to its own transaction, turns a
/// read stuck behind a lock into an error (which the handler logs and goes on without) and leaves the session's
/// own timeout as it was.
#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn per_subscriber_figures_are_read_within_a_statement_timeout(pool: PgPool) {
    use outbox::ops::subscribers::read_within;
    use outbox::subscribers::{self, Start};

    // One connection: the session read after `read_within` is the one it used.
    let one = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect_with(pool.connect_options().as_ref().clone())
        .await
        .unwrap();
    let before: String = sqlx::query_scalar("SHOW statement_timeout")
        .fetch_one(&one)
        .await
        .unwrap();
    let timeout = Duration::from_millis(300);
    for statements in [Statements::Prepared, Statements::Unnamed] {
        let db = Db::new(one.clone(), statements);
        assert!(read_within(&db, timeout).await.unwrap().is_empty());
    }

    let topic = Topic::unordered("audit");
    subscribers::add(
        &Db::new(pool.clone(), Statements::Prepared),
        "audit",
        "billing",
        Some("http://127.0.0.1:9/"),
        Start::Now,
        Duration::from_secs(5),
    )
    .await
    .unwrap();
    let events: Vec<NewEvent> = (0..3)
        .map(|i| NewEvent::new(&topic, "k", &json!({"i": i})).unwrap())
        .collect();
    let mut tx = pool.begin().await.unwrap();
    enqueue_batch(&mut tx, &events).await.unwrap();
    tx.commit().await.unwrap();
    for statements in [Statements::Prepared, Statements::Unnamed] {
        let rows = read_within(&Db::new(one.clone(), statements), timeout)
            .await
            .unwrap();
        let got: Vec<(&str, &str, i64)> = rows
            .iter()
            .map(|r| (r.topic.as_str(), r.subscriber.as_str(), r.pending))
            .collect();
        assert_eq!(got, [("audit", "", 3), ("audit", "billing", 3)]);
        assert!(rows.iter().all(|r| r.oldest_pending_age_secs >= 0.0));
    }
    let after: String = sqlx::query_scalar("SHOW statement_timeout")
        .fetch_one(&one)
        .await
        .unwrap();
    assert_eq!(after, before, "the timeout leaked into the session");

    // A read that would wait behind a lock on the subscribers table is cancelled by its timeout.
    let mut locker = pool.begin().await.unwrap();
    sqlx::query("LOCK TABLE outbox_subscribers IN ACCESS EXCLUSIVE MODE")
        .execute(&mut *locker)
        .await
        .unwrap();
    let started = std::time::Instant::now();
    let err = read_within(&Db::new(one.clone(), Statements::Prepared), timeout)
        .await
        .expect_err("the read waited for the lock");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    assert!(
        err.to_string().contains("statement timeout"),
        "not the statement timeout: {err}"
    );
    locker.rollback().await.unwrap();
    // The connection is usable again, with its own timeout.
    let after: String = sqlx::query_scalar("SHOW statement_timeout")
        .fetch_one(&one)
        .await
        .unwrap();
    assert_eq!(after, before);
}
