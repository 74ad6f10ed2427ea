//! A QStash outage is an outage, not every event's failure (decision record 0012): against real Postgres and the
//! dev server made unreachable (connection refused), failing every request (5xx) or refusing the relay's token
//! (401) for longer than the relay's whole retry horizon, then brought back.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use outbox::config::RelayConfig;
use outbox::db::{Db, Statements};
use outbox::internals::outage;
use outbox::producer::{NewEvent, Topic, enqueue_batch};
use outbox::relay::{DrainSummary, Relay};
use outbox_testkit::relaying;
use outbox_testkit::sink::Sink;
use qstash_dev::{Config as DevConfig, DevServer, Faults};
use serde_json::json;
use sqlx::PgPool;

const ORDERS: Topic = Topic::ordered("orders");
const AUDIT: Topic = Topic::unordered("audit");

/// A budget of 3 attempts with 1 s backoff windows: without outage handling the whole horizon is a few seconds.
fn relay_config() -> RelayConfig {
    RelayConfig {
        max_attempts: 3,
        backoff_base: Duration::from_millis(250),
        backoff_cap: Duration::from_secs(1),
        evidence_timeout: Duration::from_secs(60),
        ..relaying::relay_config()
    }
}

fn dev_config(port: u16, token: &str) -> DevConfig {
    DevConfig {
        port,
        token: token.to_owned(),
        ..DevConfig::for_tests(0.0005)
    }
}

/// The tests' database handle: named statements.
fn db(pool: &PgPool) -> Db {
    Db::new(pool.clone(), Statements::Prepared)
}

/// A relay publishing to `url` with `token` (3 QStash retries, 500 ms per publish), delivering to `sink`.
fn relay(pool: &PgPool, url: &str, token: &str, sink: &Sink) -> Relay {
    relaying::relay_to(
        pool,
        token,
        relay_config(),
        relaying::qstash_config(url, sink, 3, Duration::from_millis(500)),
    )
}

async fn enqueue(pool: &PgPool) -> Vec<i64> {
    let mut events = Vec::new();
    for i in 0..8 {
        events.push(NewEvent::new(&AUDIT, format!("a-{i}"), &json!({"i": i})).unwrap());
    }
    for round in 0..2 {
        for k in 0..3 {
            events.push(
                NewEvent::new(
                    &ORDERS,
                    format!("key-{k}"),
                    &json!({"k": k, "round": round}),
                )
                .unwrap(),
            );
        }
    }
    let mut tx = pool.begin().await.unwrap();
    let out = enqueue_batch(&mut tx, &events).await.unwrap();
    tx.commit().await.unwrap();
    out.into_iter().map(|e| e.id.get()).collect()
}

async fn scalar(pool: &PgPool, sql: &'static str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.unwrap()
}

/// One simulated invocation (the Lambda's drain with a 1.5 s budget).
async fn invoke(relay: &Relay) -> DrainSummary {
    relay
        .drain(Instant::now() + Duration::from_millis(1500))
        .await
        .unwrap()
}

#[derive(Clone, Copy, Debug)]
enum Fault {
    ConnectionRefused,
    All5xx,
    WrongToken,
}

const RIGHT: &str = "right-token";
const WRONG: &str = "wrong-token";

/// Runs the outage for `outage_for`, then brings QStash back and drains. Checks: no dead letters, every event
/// delivered once, no attempt spent during the outage, and the first probe after the return got through.
async fn outage_then_back(pool: PgPool, fault: Fault) {
    let sink = Sink::start(pool.clone()).await;
    let dev = DevServer::start(dev_config(0, RIGHT)).await.unwrap();
    let addr: SocketAddr = dev.addr();
    let url = dev.url();
    let token = match fault {
        Fault::WrongToken => WRONG,
        _ => RIGHT,
    };
    let relay = relay(&pool, &url, token, &sink);
    let ids = enqueue(&pool).await;

    let mut dev = Some(dev);
    match fault {
        Fault::ConnectionRefused => dev.take().unwrap().shutdown().await,
        Fault::All5xx => dev
            .as_ref()
            .unwrap()
            .handle()
            .set_faults(Faults {
                publish_5xx_rate: 1.0,
                ..Default::default()
            })
            .unwrap(),
        Fault::WrongToken => {}
    }

    // Longer than the whole retry horizon (3 attempts, windows of at most 1 s) several times over.
    let outage_for = Duration::from_secs(6);
    let started = Instant::now();
    let mut invocations = 0;
    let mut waited = 0;
    while started.elapsed() < outage_for {
        let s = invoke(&relay).await;
        invocations += 1;
        assert_eq!(s.dispatched, 0, "{fault:?}: nothing gets through: {s:?}");
        assert_eq!(s.dead_lettered, 0, "{fault:?}: {s:?}");
        if s.claimed == 0 {
            waited += 1;
        }
        assert!(s.qstash_outage, "{fault:?}: the outage is recorded: {s:?}");
        assert_eq!(s.stopped, "outage", "{fault:?}: {s:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(invocations > waited, "{fault:?}: some invocations probed");
    assert_eq!(
        scalar(&pool, "SELECT count(*) FROM dead_letters").await,
        0,
        "{fault:?}: no dead letter during the outage"
    );
    assert_eq!(
        scalar(
            &pool,
            "SELECT coalesce(max(attempts), 0)::bigint FROM outbox"
        )
        .await,
        0,
        "{fault:?}: the outage spent no attempt"
    );
    assert_eq!(
        scalar(
            &pool,
            "SELECT count(*) FROM outbox WHERE locked_until IS NOT NULL"
        )
        .await,
        0,
        "{fault:?}: every claim was given back"
    );
    let state = outage::load(&db(&pool)).await.unwrap();
    assert!(
        state.active() && state.failures >= 2,
        "{fault:?}: {state:?}"
    );
    assert!(
        state.last_error.is_some(),
        "{fault:?}: the error is recorded"
    );

    // QStash is back.
    let dev = match fault {
        Fault::ConnectionRefused => DevServer::start(dev_config(addr.port(), RIGHT))
            .await
            .unwrap(),
        Fault::All5xx => {
            let dev = dev.take().unwrap();
            dev.handle().set_faults(Faults::default()).unwrap();
            dev
        }
        Fault::WrongToken => {
            // The operator fixed the token: here the server accepts the relay's instead.
            dev.take().unwrap().shutdown().await;
            DevServer::start(dev_config(addr.port(), WRONG))
                .await
                .unwrap()
        }
    };
    let back = outage::load(&db(&pool)).await.unwrap();
    // The next probe is at most one probe window (the cap) away, on the database's clock.
    assert!(
        back.until_probe() <= relay_config().outage_probe_cap,
        "{fault:?}: {back:?}"
    );
    let back_at = Instant::now();
    let mut first_dispatch = None;
    // Invocations end at once while the probe is not due: pace them like a schedule, bounded by count.
    for _ in 0..200 {
        let s = invoke(&relay).await;
        if s.claimed == 0 {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        if s.dispatched > 0 && first_dispatch.is_none() {
            first_dispatch = Some(back_at.elapsed());
        }
        let now = outage::load(&db(&pool)).await.unwrap();
        assert!(
            now.failures <= back.failures,
            "{fault:?}: a probe after QStash came back failed: {now:?}"
        );
        let done = scalar(
            &pool,
            "SELECT count(*) FROM outbox WHERE dispatched_at IS NOT NULL AND (seq IS NULL OR delivered_at IS NOT NULL)",
        )
        .await;
        if done == ids.len() as i64 {
            break;
        }
    }
    eprintln!(
        "{fault:?}: {invocations} invocations during the outage ({waited} waited without claiming); first dispatch \
         {first_dispatch:?} after QStash came back (next probe was {:?} away)",
        back.until_probe()
    );
    dev.handle()
        .wait_idle(Duration::from_secs(20))
        .await
        .unwrap();
    assert!(
        !outage::load(&db(&pool)).await.unwrap().active(),
        "{fault:?}: the outage is cleared"
    );
    assert_eq!(scalar(&pool, "SELECT count(*) FROM dead_letters").await, 0);
    let mut per_id: HashMap<i64, usize> = HashMap::new();
    for s in sink.accepted() {
        *per_id.entry(s.outbox_id).or_default() += 1;
    }
    for id in &ids {
        assert_eq!(
            per_id.get(id),
            Some(&1),
            "{fault:?}: event {id} delivered exactly once: {per_id:?}"
        );
    }
    assert_eq!(
        scalar(&pool, "SELECT max(attempts)::bigint FROM outbox").await,
        1,
        "{fault:?}: one attempt each: the one that got through"
    );
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn connection_refused_is_an_outage_that_spends_nothing(pool: PgPool) {
    outage_then_back(pool, Fault::ConnectionRefused).await;
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn every_request_failing_with_5xx_is_an_outage_that_spends_nothing(pool: PgPool) {
    outage_then_back(pool, Fault::All5xx).await;
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn a_wrong_token_is_an_outage_that_spends_nothing(pool: PgPool) {
    outage_then_back(pool, Fault::WrongToken).await;
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn a_relay_started_during_an_outage_does_not_publish_before_the_probe(pool: PgPool) {
    let sink = Sink::start(pool.clone()).await;
    let dev = DevServer::start(dev_config(0, RIGHT)).await.unwrap();
    let ids = enqueue(&pool).await;
    // Another relay recorded an outage; its next probe is a minute away.
    sqlx::query(
        "UPDATE outbox_relay_outage SET since = now(), failures = 3, last_error = 'connection failed', \
         next_probe_at = now() + interval '60 seconds'",
    )
    .execute(&pool)
    .await
    .unwrap();
    let fresh = relay(&pool, &dev.url(), RIGHT, &sink);
    for _ in 0..3 {
        let s = invoke(&fresh).await;
        assert_eq!((s.claimed, s.stopped), (0, "outage"), "{s:?}");
        assert!(s.qstash_outage && s.outage_secs >= 0.0);
    }
    assert_eq!(
        dev.handle().stats().publish_requests,
        0,
        "no request before next_probe_at"
    );
    assert_eq!(
        scalar(
            &pool,
            "SELECT coalesce(max(attempts), 0)::bigint FROM outbox"
        )
        .await,
        0,
        "nothing was claimed"
    );

    // The probe comes due: exactly one of several relays takes it.
    sqlx::query("UPDATE outbox_relay_outage SET next_probe_at = now() - interval '1 ms'")
        .execute(&pool)
        .await
        .unwrap();
    let handle = db(&pool);
    let takes = futures::future::join_all(
        (0..6).map(|_| outage::take_probe(&handle, Duration::from_secs(1))),
    )
    .await;
    assert_eq!(
        takes.iter().filter(|t| *t.as_ref().unwrap()).count(),
        1,
        "{takes:?}"
    );
    assert_eq!(dev.handle().stats().publish_requests, 0);

    // After that probe lease, the relay probes, succeeds, and drains in the same invocation.
    sqlx::query("UPDATE outbox_relay_outage SET next_probe_at = now() - interval '1 ms'")
        .execute(&pool)
        .await
        .unwrap();
    let s = invoke(&fresh).await;
    assert!(s.dispatched >= 2, "the probe and what follows: {s:?}");
    assert!(!s.qstash_outage, "{s:?}");
    assert!(!outage::load(&db(&pool)).await.unwrap().active());
    for _ in 0..20 {
        // Nothing claimed in a whole invocation: drained (ordered heads wait only for their evidence).
        if invoke(&fresh).await.claimed == 0 {
            break;
        }
    }
    dev.handle()
        .wait_idle(Duration::from_secs(20))
        .await
        .unwrap();
    let got: std::collections::HashSet<i64> = sink.accepted().iter().map(|s| s.outbox_id).collect();
    assert_eq!(got, ids.iter().copied().collect());
}

/// Records an outage as another relay would have, with its next probe `probe_in` away.
async fn outage_with_probe_in(pool: &PgPool, probe_in: Duration) {
    sqlx::query(
        "UPDATE outbox_relay_outage SET since = now() - interval '30 seconds', failures = 3, \
         last_error = 'QStash answered 503', next_probe_at = now() + make_interval(secs => $1)",
    )
    .bind(probe_in.as_secs_f64())
    .execute(pool)
    .await
    .unwrap();
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn invocations_started_during_an_outage_wait_for_the_probe_and_drain_everything(
    pool: PgPool,
) {
    let sink = Sink::start(pool.clone()).await;
    let dev = DevServer::start(dev_config(0, RIGHT)).await.unwrap();
    let ids = enqueue(&pool).await;
    // QStash fails every publish (fault injection): one invocation finds out and records the outage.
    dev.handle()
        .set_faults(Faults {
            publish_5xx_rate: 1.0,
            ..Default::default()
        })
        .unwrap();
    let first = relay(&pool, &dev.url(), RIGHT, &sink);
    let s = invoke(&first).await;
    assert_eq!((s.dispatched, s.stopped), (0, "outage"), "{s:?}");
    assert!(outage::load(&db(&pool)).await.unwrap().active());

    // QStash recovers; the recorded outage's next probe is two seconds away. Two relays start now, each with a
    // deadline well past the probe plus a lease: both wait instead of returning, one takes the probe, it gets
    // through, and between them they drain everything in these same invocations.
    dev.handle().set_faults(Faults::default()).unwrap();
    outage_with_probe_in(&pool, Duration::from_secs(2)).await;
    let published_before = dev.handle().stats().publish_requests;
    let second = relay(&pool, &dev.url(), RIGHT, &sink);
    let deadline = Instant::now() + Duration::from_secs(8);
    let (a, b) = tokio::join!(first.drain(deadline), second.drain(deadline));
    let (a, b) = (a.unwrap(), b.unwrap());
    for s in [&a, &b] {
        assert_eq!(s.stopped, "deadline", "{s:?}");
        assert!(!s.qstash_outage, "{s:?}");
        assert_eq!(s.dead_lettered, 0, "{s:?}");
    }
    assert_eq!(
        a.dispatched + b.dispatched,
        ids.len() as u64,
        "every event dispatched once, in these invocations: {a:?} {b:?}"
    );
    let state = outage::load(&db(&pool)).await.unwrap();
    assert!(!state.active(), "the probe cleared the outage: {state:?}");
    assert!(
        dev.handle().stats().publish_requests > published_before,
        "published after the probe"
    );
    dev.handle()
        .wait_idle(Duration::from_secs(20))
        .await
        .unwrap();
    let mut per_id: HashMap<i64, usize> = HashMap::new();
    for s in sink.accepted() {
        *per_id.entry(s.outbox_id).or_default() += 1;
    }
    for id in &ids {
        assert_eq!(per_id.get(id), Some(&1), "event {id}: {per_id:?}");
    }
    assert_eq!(
        scalar(
            &pool,
            "SELECT count(*) FROM outbox WHERE dispatched_at IS NULL OR (seq IS NOT NULL AND delivered_at IS NULL)"
        )
        .await,
        0,
        "nothing left for a later invocation"
    );
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn an_invocation_whose_deadline_comes_before_the_probe_returns_without_publishing(
    pool: PgPool,
) {
    let sink = Sink::start(pool.clone()).await;
    let dev = DevServer::start(dev_config(0, RIGHT)).await.unwrap();
    enqueue(&pool).await;
    // The probe is 2 s away; the invocation has 2.5 s, so its last claim (one 1 s lease before the deadline)
    // would come before the probe: it waits for nothing and publishes nothing.
    outage_with_probe_in(&pool, Duration::from_secs(2)).await;
    let before = outage::load(&db(&pool)).await.unwrap();
    let fresh = relay(&pool, &dev.url(), RIGHT, &sink);
    let s = fresh
        .drain(Instant::now() + Duration::from_millis(2500))
        .await
        .unwrap();
    assert_eq!(
        (s.claimed, s.dispatched, s.stopped),
        (0, 0, "outage"),
        "{s:?}"
    );
    assert!(s.qstash_outage, "{s:?}");
    assert_eq!(dev.handle().stats().publish_requests, 0);
    let after = outage::load(&db(&pool)).await.unwrap();
    assert_eq!(
        (after.failures, after.next_probe_at),
        (before.failures, before.next_probe_at),
        "the probe was neither taken nor moved"
    );
    assert_eq!(
        scalar(
            &pool,
            "SELECT coalesce(max(attempts), 0)::bigint FROM outbox"
        )
        .await,
        0,
        "nothing was claimed"
    );
}
