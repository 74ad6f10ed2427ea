//! One trace from the producer's commit to the consumer's side effect (issue 38, decision record 0074), the whole
//! system: producer → relay → QStash-compatible dev server → consumers, exporting by OTLP/HTTP to a receiver in
//! the test that decodes the real protocol (`outbox_testkit::otlp`). The span tree it must see:
//!
//! - the caller's span → one `create` span per event (its context is what the event carries);
//! - the relay's `send` spans link every event they carry;
//! - a first delivery's `process` span is a child of the event's `create` span, for each subscriber's copy, with
//!   the subscriber attribute; a retry's is linked instead; a batch's links every event;
//! - a handler's own `tracing` spans are children of the `process` span;
//!
//! and then, with the receiver refusing (503), the next event is still applied and its spans are dropped and
//! counted.
//!
//! A binary of its own: it installs the process's global subscriber and tracer provider.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use outbox::consumer::{Event, Handler, HandlerError, Registry};
use outbox::{NewEvent, Topic};
use outbox_testkit::db::url_of;
use outbox_testkit::otlp::{Behaviour, OtlpReceiver, ReceivedSpan};
use outbox_testkit::stack::{LocalStack, StackOptions, SubscriberOptions};
use serde::{Deserialize, Serialize};
use sqlx::{PgConnection, PgPool};
use tracing::Instrument;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

/// One event per message.
const SINGLE: Topic = Topic::unordered("traced.single");
/// Up to ten events per message.
const BATCHED: Topic = Topic::unordered("traced.batched");
const DEFAULT: &str = "consumer";
const AUDIT: &str = "audit";

const PRODUCER: i32 = 4;
const CONSUMER: i32 = 5;
const CLIENT: i32 = 3;

#[derive(Debug, Serialize, Deserialize)]
struct Traced {
    n: i64,
    /// The default subscriber refuses it (transiently) on its first attempt.
    fail_once: bool,
}

#[derive(Clone)]
struct Apply {
    subscriber: &'static str,
    failed: Arc<Mutex<HashSet<i64>>>,
}

impl Handler<Traced> for Apply {
    async fn handle(
        &self,
        conn: &mut PgConnection,
        event: &Event<Traced>,
    ) -> Result<(), HandlerError> {
        let e = &event.payload;
        let span = tracing::info_span!("apply", n = e.n, subscriber = self.subscriber);
        async {
            if e.fail_once && self.subscriber == DEFAULT && self.failed.lock().unwrap().insert(e.n)
            {
                return Err(HandlerError::transient("first attempt refused on purpose"));
            }
            sqlx::query("INSERT INTO traced_applied (subscriber, n) VALUES ($1, $2)")
                .bind(self.subscriber)
                .bind(e.n)
                .execute(&mut *conn)
                .await?;
            Ok(())
        }
        .instrument(span)
        .await
    }
}

fn registry(subscriber: &'static str) -> Registry {
    let h = Apply {
        subscriber,
        failed: Arc::default(),
    };
    Registry::new()
        .on(SINGLE.name(), h.clone())
        .on(BATCHED.name(), h)
}

fn event(topic: &Topic, n: i64, fail_once: bool) -> NewEvent {
    NewEvent::new(topic, format!("k{n}"), &Traced { n, fail_once }).unwrap()
}

fn named<'a>(spans: &'a [ReceivedSpan], name: &str) -> Vec<&'a ReceivedSpan> {
    spans.iter().filter(|s| s.name == name).collect()
}

fn attempt(s: &ReceivedSpan) -> Option<&str> {
    s.attr("messaging.qstash.message.delivery_attempt")
}

#[sqlx::test]
async fn one_trace_from_the_producer_to_each_consumer(pool: PgPool) {
    let receiver = OtlpReceiver::start(Behaviour::Accept).await.unwrap();
    let layer = outbox::telemetry::trace_layer(Some(&receiver.url)).expect("export set up");
    tracing_subscriber::registry()
        .with(tracing_subscriber::EnvFilter::new("info"))
        .with(layer)
        .with(tracing_subscriber::fmt::layer().with_test_writer())
        .try_init()
        .expect("the only subscriber of this binary");

    sqlx::raw_sql("CREATE TABLE traced_applied (subscriber text NOT NULL, n bigint NOT NULL)")
        .execute(&pool)
        .await
        .unwrap();
    let mut opts = StackOptions::new(&url_of(&pool)).unwrap();
    opts.registry = registry(DEFAULT);
    opts.consumer_name = DEFAULT.into();
    opts.dev.time_scale = 0.01;
    opts.relay.poll_interval = Duration::from_millis(20);
    opts.relay.lease = Duration::from_secs(1);
    opts.invocation = Duration::from_secs(3);
    opts.relay.batching.default_n = 1;
    opts.relay.batching.topics = vec![(BATCHED.name().into(), 10)];
    opts.subscribers = vec![SubscriberOptions {
        name: AUDIT.into(),
        topics: vec![SINGLE.name().into()],
        registry: registry(AUDIT),
    }];
    let stack = LocalStack::start(opts).await.unwrap();

    // The caller's span: every `create` span is its child.
    let checkout = tracing::info_span!("checkout");
    let ids = async {
        let mut tx = pool.begin().await.unwrap();
        let first = outbox::enqueue(&mut tx, event(&SINGLE, 1, false))
            .await
            .unwrap();
        let retried = outbox::enqueue(&mut tx, event(&SINGLE, 2, true))
            .await
            .unwrap();
        let batch: Vec<NewEvent> = (3..6).map(|n| event(&BATCHED, n, false)).collect();
        let batch = outbox::enqueue_batch(&mut tx, &batch).await.unwrap();
        tx.commit().await.unwrap();
        (
            first.id.get(),
            retried.id.get(),
            batch.iter().map(|e| e.id.get()).collect::<Vec<_>>(),
        )
    }
    .instrument(checkout)
    .await;
    let (first, retried, batch) = ids;

    // 2 events × 2 subscribers + 3 batched events, each applied once.
    wait_applied(&pool, 7).await;
    // The relay's send spans leave when its invocation ends; flush until every span is in.
    let complete = |s: &[ReceivedSpan]| {
        s.iter().any(|x| x.name.starts_with("send"))
            && named(s, "process traced.single").len() >= 5
            && !named(s, "process traced.batched").is_empty()
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while !complete(&receiver.spans()) && tokio::time::Instant::now() < deadline {
        outbox::telemetry::flush().await;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let spans = receiver.spans();
    check_tree(&spans, first, retried, &batch);
    let stats = outbox::telemetry::stats();
    assert_eq!(stats.dropped_full + stats.dropped_failed, 0, "{stats:?}");

    // A collector that refuses fails nothing: the next event is applied by both subscribers, its spans are
    // dropped and counted.
    receiver.set_behaviour(Behaviour::Refuse(503));
    let mut tx = pool.begin().await.unwrap();
    outbox::enqueue(&mut tx, event(&SINGLE, 6, false))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    wait_applied(&pool, 9).await;
    outbox::telemetry::flush().await;
    let after = outbox::telemetry::stats();
    assert!(
        after.dropped_failed > 0 && after.failed_flushes > 0,
        "refused spans are counted: {after:?}"
    );
    stack.stop().await;
}

/// Waits (at most a minute) until `n` copies were applied, and checks it is exactly `n`.
async fn wait_applied(pool: &PgPool, n: i64) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let applied: i64 = sqlx::query_scalar("SELECT count(*) FROM traced_applied")
            .fetch_one(pool)
            .await
            .unwrap();
        if applied >= n || tokio::time::Instant::now() > deadline {
            assert_eq!(applied, n, "every copy applied once");
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn check_tree(spans: &[ReceivedSpan], first: i64, retried: i64, batch: &[i64]) {
    let dump = || {
        spans
            .iter()
            .map(|s| format!("{s:?}"))
            .collect::<Vec<_>>()
            .join("\n")
    };
    let checkout = named(spans, "checkout");
    assert_eq!(checkout.len(), 1, "{}", dump());
    let create = |id: i64| -> &ReceivedSpan {
        let found: Vec<&ReceivedSpan> = spans
            .iter()
            .filter(|s| {
                s.name.starts_with("create ")
                    && s.attr("messaging.message.id") == Some(&id.to_string())
            })
            .collect();
        assert_eq!(
            found.len(),
            1,
            "one create span for event {id}:\n{}",
            dump()
        );
        found[0]
    };
    for &id in [first, retried].iter().chain(batch) {
        let c = create(id);
        assert!(
            c.is_child_of(checkout[0]),
            "create {id} under the caller's span:\n{}",
            dump()
        );
        assert_eq!(c.kind, PRODUCER);
        // The relay's send spans link every event they carry.
        assert!(
            spans
                .iter()
                .any(|s| s.name.starts_with("send") && s.kind == CLIENT && s.links_to(c)),
            "a send span links event {id}:\n{}",
            dump()
        );
    }

    let process = named(spans, "process traced.single");
    let of = |id: i64, subscriber: &str| -> Vec<&ReceivedSpan> {
        process
            .iter()
            .copied()
            .filter(|s| {
                s.attr("messaging.message.id") == Some(&id.to_string())
                    && s.attr("messaging.destination.subscription.name") == Some(subscriber)
            })
            .collect()
    };
    // A first delivery: a child of the producer's span, for each subscriber's copy.
    for sub in [DEFAULT, AUDIT] {
        let p = of(first, sub);
        assert_eq!(p.len(), 1, "{sub}'s copy of {first}:\n{}", dump());
        assert!(
            p[0].is_child_of(create(first)),
            "{sub}: child of create:\n{}",
            dump()
        );
        assert_eq!(p[0].kind, CONSUMER);
        assert_eq!(attempt(p[0]), Some("1"));
    }
    let audit = of(retried, AUDIT);
    assert!(
        audit.len() == 1 && audit[0].is_child_of(create(retried)),
        "{}",
        dump()
    );
    // The default subscriber refused its first attempt: that one is a child, the retry is linked.
    let attempts = of(retried, DEFAULT);
    let first_try = attempts
        .iter()
        .find(|s| attempt(s) == Some("1"))
        .expect("first attempt");
    assert!(
        first_try.is_child_of(create(retried)) && first_try.status == 2,
        "{}",
        dump()
    );
    let retry = attempts
        .iter()
        .find(|s| attempt(s) == Some("2"))
        .expect("a retry");
    assert!(
        retry.links_to(create(retried)) && retry.parent_span_id.is_empty(),
        "the retry links the producer's span:\n{}",
        dump()
    );
    // A batch delivery links each of its events.
    let batched = named(spans, "process traced.batched");
    assert!(
        batch
            .iter()
            .all(|&id| batched.iter().any(|p| p.links_to(create(id)))),
        "the batch's process spans link every event:\n{}",
        dump()
    );
    assert!(
        batched
            .iter()
            .any(|p| p.attr("messaging.batch.message_count") == Some("3"))
    );
    // The handler's own spans nest under the process span.
    let applied = named(spans, "apply");
    assert!(!applied.is_empty());
    for a in applied {
        assert!(
            spans
                .iter()
                .any(|p| p.name.starts_with("process ") && a.is_child_of(p)),
            "handler span under a process span:\n{}",
            dump()
        );
    }
}
