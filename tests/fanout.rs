//! Fan-out (decision record 0068, `outbox::subscribers`), the whole system: one event, three subscribers (the
//! default consumer and two named ones, each a consumer of its own on its own port behind the QStash-compatible
//! dev server). Each applies every event exactly once, in its own per-key order, with its own retries, dead
//! letters and redrive; a subscriber that is down or rejects an event holds back nobody else; a subscriber added
//! later gets the retained history (with a start) or only new events (without).
//!
//! Every subscriber's handler writes what it applied to `fanout_applied` (its name, the event's number, key and
//! sequence) in the consumer's dedupe transaction, so the checks read what each one really applied, in order.

use std::collections::BTreeMap;
use std::time::Duration;

use outbox::consumer::{Event, Handler, HandlerError, Registry};
use outbox::subscribers::{self, Start};
use outbox::{NewEvent, Topic};
use outbox_testkit::db::url_of;
use outbox_testkit::stack::{LocalStack, StackOptions, SubscriberOptions};
use qstash_dev::{Faults, WaitlistOrder};
use serde::{Deserialize, Serialize};
use sqlx::{PgConnection, PgPool};

pub(crate) const ORDERED: Topic = Topic::ordered("fan.ordered");
pub(crate) const UNORDERED: Topic = Topic::unordered("fan.unordered");

/// The subscribers of these tests: the default one (the stack's consumer, `CONSUMER_NAME` `consumer`) and two
/// named ones.
pub(crate) const DEFAULT: &str = "consumer";
pub(crate) const A: &str = "a";
pub(crate) const B: &str = "b";

/// A test event: its number (the same in every subscriber's copy) and the subscribers whose handler rejects it
/// until it is cured (`fanout_cured`).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct FanEvent {
    pub(crate) n: i64,
    #[serde(default)]
    pub(crate) poison_for: Vec<String>,
}

/// Records what one subscriber applied.
#[derive(Debug, Clone)]
struct Ledger {
    subscriber: &'static str,
}

impl Handler<FanEvent> for Ledger {
    async fn handle(
        &self,
        conn: &mut PgConnection,
        event: &Event<FanEvent>,
    ) -> Result<(), HandlerError> {
        let e = &event.payload;
        if e.poison_for.iter().any(|s| s == self.subscriber) {
            let cured: bool =
                sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM fanout_cured WHERE n = $1)")
                    .bind(e.n)
                    .fetch_one(&mut *conn)
                    .await?;
            if !cured {
                return Err(HandlerError::permanent(format!(
                    "{} refuses event {}",
                    self.subscriber, e.n
                )));
            }
        }
        sqlx::query(
            "INSERT INTO fanout_applied (subscriber, topic, key, seq, n, outbox_id) VALUES ($1, $2, $3, $4, $5, $6)",
        )
        .bind(self.subscriber)
        .bind(event.meta.topic.as_str())
        .bind(event.meta.key.as_ref().map(|k| k.as_str()))
        .bind(event.meta.seq)
        .bind(e.n)
        .bind(event.meta.outbox_id)
        .execute(&mut *conn)
        .await?;
        Ok(())
    }
}

pub(crate) fn registry(subscriber: &'static str) -> Registry {
    Registry::new()
        .on(ORDERED.name(), Ledger { subscriber })
        .on(UNORDERED.name(), Ledger { subscriber })
}

pub(crate) async fn ledger_tables(pool: &PgPool) {
    sqlx::raw_sql(
        "CREATE TABLE fanout_applied (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, subscriber text NOT NULL, \
           topic text NOT NULL, key text, seq bigint, n bigint NOT NULL, outbox_id bigint NOT NULL); \
         CREATE TABLE fanout_cured (n bigint PRIMARY KEY);",
    )
    .execute(pool)
    .await
    .unwrap();
}

/// A stack whose default consumer is subscriber `consumer` and with `named` subscribers served (made live for
/// both topics when `live`).
pub(crate) async fn stack_with(
    pool: &PgPool,
    named: &[&'static str],
    live: bool,
    tune: impl FnOnce(&mut StackOptions),
) -> LocalStack {
    ledger_tables(pool).await;
    let mut opts = StackOptions::new(&url_of(pool)).unwrap();
    opts.registry = registry(DEFAULT);
    opts.consumer_name = DEFAULT.into();
    opts.relay.poll_interval = Duration::from_millis(20);
    opts.relay.lease = Duration::from_secs(2);
    opts.invocation = Duration::from_secs(5);
    opts.subscribers = named
        .iter()
        .map(|&name| SubscriberOptions {
            name: name.into(),
            topics: if live {
                vec![ORDERED.name().into(), UNORDERED.name().into()]
            } else {
                Vec::new()
            },
            registry: registry(name),
        })
        .collect();
    tune(&mut opts);
    LocalStack::start(opts).await.unwrap()
}

/// Enqueues `keys` × `per_key` ordered events and `unordered` unordered ones, numbered from `first`, in
/// transactions of ten; `poison` says which subscribers refuse event `n`.
pub(crate) async fn enqueue(
    pool: &PgPool,
    first: i64,
    keys: i64,
    per_key: i64,
    unordered: i64,
    poison: impl Fn(i64) -> Vec<String>,
) -> i64 {
    let mut events = Vec::new();
    let mut n = first;
    for round in 0..per_key {
        for k in 0..keys {
            let _ = round;
            events.push(
                NewEvent::new(
                    &ORDERED,
                    format!("k{k}"),
                    &FanEvent {
                        n,
                        poison_for: poison(n),
                    },
                )
                .unwrap(),
            );
            n += 1;
        }
    }
    for _ in 0..unordered {
        events.push(
            NewEvent::new(
                &UNORDERED,
                format!("u{n}"),
                &FanEvent {
                    n,
                    poison_for: poison(n),
                },
            )
            .unwrap(),
        );
        n += 1;
    }
    for chunk in events.chunks(10) {
        let mut tx = pool.begin().await.unwrap();
        outbox::enqueue_batch(&mut tx, chunk).await.unwrap();
        tx.commit().await.unwrap();
    }
    n - first
}

/// What one subscriber applied: event numbers in the order applied.
pub(crate) async fn applied(
    pool: &PgPool,
    subscriber: &str,
) -> Vec<(String, Option<String>, Option<i64>, i64)> {
    sqlx::query_as(
        "SELECT topic, key, seq, n FROM fanout_applied WHERE subscriber = $1 ORDER BY id",
    )
    .bind(subscriber)
    .fetch_all(pool)
    .await
    .unwrap()
}

/// Checks that `subscriber` applied exactly the events `expected` (numbers), each once, and each ordered key's
/// events in sequence order with no gap.
pub(crate) async fn assert_applied_once_in_order(
    pool: &PgPool,
    subscriber: &str,
    expected: &[i64],
) {
    let rows = applied(pool, subscriber).await;
    let mut seen: BTreeMap<i64, usize> = BTreeMap::new();
    for r in &rows {
        *seen.entry(r.3).or_default() += 1;
    }
    let twice: Vec<i64> = seen
        .iter()
        .filter(|(_, c)| **c > 1)
        .map(|(n, _)| *n)
        .collect();
    assert!(
        twice.is_empty(),
        "{subscriber} applied events {twice:?} more than once"
    );
    let got: Vec<i64> = seen.keys().copied().collect();
    let mut want = expected.to_vec();
    want.sort();
    assert_eq!(got, want, "{subscriber} applied a different set of events");
    let mut last: BTreeMap<String, i64> = BTreeMap::new();
    for (topic, key, seq, n) in &rows {
        if topic != ORDERED.name() {
            continue;
        }
        let (Some(key), Some(seq)) = (key, seq) else {
            panic!("{subscriber}: ordered event {n} without key or sequence");
        };
        let prev = last.insert(key.clone(), *seq);
        if let Some(prev) = prev {
            assert!(
                *seq > prev,
                "{subscriber} applied {key} sequence {seq} after {prev}: order broken"
            );
        }
    }
}

pub(crate) async fn scalar(pool: &PgPool, sql: &'static str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.unwrap()
}

/// Waits until `subscriber` applied `n` events; false on timeout.
pub(crate) async fn wait_applied(
    pool: &PgPool,
    subscriber: &str,
    n: usize,
    timeout: Duration,
) -> bool {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if applied(pool, subscriber).await.len() >= n {
            return true;
        }
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Every event reaches each of three subscribers exactly once, each key in order for each of them, with the dev
/// server's publish faults, duplicate deliveries and a shuffled flow-control waitlist, in batched deliveries.
#[sqlx::test(migrator = "outbox_testkit::MIGRATOR")]
async fn every_subscriber_applies_every_event_once_in_its_own_key_order_under_faults(pool: PgPool) {
    let stack = stack_with(&pool, &[A, B], true, |o| {
        o.relay.batching.default_n = 5;
        o.qstash_batch_size = 3;
        o.dev.time_scale = 0.005;
        o.dev.seed = 7;
        o.dev.waitlist_order = WaitlistOrder::Shuffled;
        o.dev.faults = Faults {
            publish_5xx_rate: 0.15,
            publish_drop_response_rate: 0.10,
            duplicate_delivery_rate: 0.25,
            ..Default::default()
        };
    })
    .await;
    let n = enqueue(&pool, 1, 10, 8, 60, |_| Vec::new()).await;
    assert!(
        stack.wait_quiet(Duration::from_secs(120)).await,
        "the pipeline did not drain"
    );
    let all: Vec<i64> = (1..=n).collect();
    for s in [DEFAULT, A, B] {
        assert_applied_once_in_order(&pool, s, &all).await;
    }
    // One outbox row per event and subscriber, each delivered; nothing dead.
    assert_eq!(scalar(&pool, "SELECT count(*) FROM outbox").await, 3 * n);
    assert_eq!(
        scalar(
            &pool,
            "SELECT count(*) FROM outbox WHERE delivered_at IS NULL"
        )
        .await,
        0
    );
    assert_eq!(scalar(&pool, "SELECT count(*) FROM dead_letters").await, 0);
    let stats = stack.dev.handle().stats();
    assert!(
        stats.duplicate_deliveries > 0 && stats.injected_publish_errors > 0,
        "the faults must have happened: {stats:?}"
    );
    stack.stop().await;
}

/// A's handler rejects the first event of a key: that is one dead letter, A's only, and blocks A's lane of the key
/// only. B's lane of the key sits at the same place meanwhile (B is down until A's dead letter is recorded): B and
/// the default subscriber apply the event and the ones behind it. Redriven once cured, it is applied at A only,
/// then A's later events of the key follow in order.
#[sqlx::test(migrator = "outbox_testkit::MIGRATOR")]
async fn a_poison_for_one_subscriber_is_its_dead_letter_alone_and_its_redrive_applies_there_only(
    pool: PgPool,
) {
    let stack = stack_with(&pool, &[A, B], true, |o| {
        // QStash's first retry of B's deliveries after 0.6 s.
        o.dev.time_scale = 0.05;
        o.qstash_retries = 5;
    })
    .await;
    assert!(stack.set_subscriber_down(B, true));
    // Key k0 gets events 1, 3, 5 (sequences 1..3), k1 gets 2, 4, 6; event 1 is poison for A.
    let n = enqueue(&pool, 1, 2, 3, 4, |n| {
        if n == 1 {
            vec![A.to_owned()]
        } else {
            Vec::new()
        }
    })
    .await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while scalar(&pool, "SELECT count(*) FROM dead_letters").await == 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "A's poison was not dead-lettered"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(stack.set_subscriber_down(B, false));
    assert!(
        stack.wait_quiet(Duration::from_secs(60)).await,
        "did not drain"
    );
    let all: Vec<i64> = (1..=n).collect();
    assert_applied_once_in_order(&pool, DEFAULT, &all).await;
    assert_applied_once_in_order(&pool, B, &all).await;
    let a_without: Vec<i64> = all
        .iter()
        .copied()
        .filter(|n| ![1, 3, 5].contains(n))
        .collect();
    assert_applied_once_in_order(&pool, A, &a_without).await;
    let dead: Vec<(i64, String, i64)> = sqlx::query_as(
        "SELECT id, subscriber, seq FROM dead_letters WHERE resolved_at IS NULL ORDER BY id",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(dead.len(), 1, "one dead letter: {dead:?}");
    assert_eq!((dead[0].1.as_str(), dead[0].2), (A, 1));
    let blocked: Vec<(String, String)> = sqlx::query_as(
        "SELECT partition_key, subscriber FROM outbox_keys WHERE blocked_at IS NOT NULL",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(blocked, [("k0".to_owned(), A.to_owned())]);
    // `outbox status` says the same per subscriber: A has the blocked key and the dead letter, B and the default
    // subscriber nothing.
    let status = outbox::ops::status_with_horizon(&pool, Duration::from_secs(3600))
        .await
        .unwrap();
    let of = |topic: &str, name: &str| {
        let s = status
            .subscribers
            .iter()
            .find(|s| s.topic == topic && s.subscriber == name)
            .unwrap_or_else(|| panic!("no status for {name} of {topic}: {:?}", status.subscribers));
        // Events behind a dead head that rode in its message count as in flight, the others as pending.
        (s.pending + s.in_flight, s.blocked_keys, s.dead_letters)
    };
    assert_eq!(
        of(ORDERED.name(), A),
        (2, 1, 1),
        "A's k0 waits behind its dead head"
    );
    assert_eq!(of(ORDERED.name(), B), (0, 0, 0));
    assert_eq!(of(ORDERED.name(), ""), (0, 0, 0));
    assert_eq!(
        status.subscribers.len(),
        6,
        "three subscribers of two topics"
    );

    sqlx::query("INSERT INTO fanout_cured VALUES (1)")
        .execute(&pool)
        .await
        .unwrap();
    let mut conn = pool.acquire().await.unwrap();
    outbox::dead_letters::redrive(&mut conn, dead[0].0, Default::default())
        .await
        .unwrap();
    drop(conn);
    assert!(
        stack.wait_quiet(Duration::from_secs(60)).await,
        "did not drain after the redrive"
    );
    assert_applied_once_in_order(&pool, A, &all).await;
    assert_applied_once_in_order(&pool, DEFAULT, &all).await;
    assert_applied_once_in_order(&pool, B, &all).await;
    stack.stop().await;
}

/// B's consumer is down: the default subscriber and A apply everything meanwhile; B, back up, catches up through
/// QStash's retries with every event once and in order.
#[sqlx::test(migrator = "outbox_testkit::MIGRATOR")]
async fn a_subscriber_that_is_down_holds_back_nobody_and_catches_up(pool: PgPool) {
    let stack = stack_with(&pool, &[A, B], true, |o| {
        // QStash's retry delays (12 s, 2.5 min, …) scaled to 0.6 s, 7.4 s, …: B's downtime outlasts the first.
        o.dev.time_scale = 0.05;
        o.qstash_retries = 5;
    })
    .await;
    assert!(stack.set_subscriber_down(B, true));
    let n = enqueue(&pool, 1, 5, 4, 20, |_| Vec::new()).await;
    for s in [DEFAULT, A] {
        assert!(
            wait_applied(&pool, s, n as usize, Duration::from_secs(30)).await,
            "{s} was held back by B being down"
        );
    }
    assert!(applied(&pool, B).await.is_empty());
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(stack.set_subscriber_down(B, false));
    assert!(
        stack.wait_quiet(Duration::from_secs(120)).await,
        "B did not catch up"
    );
    let all: Vec<i64> = (1..=n).collect();
    for s in [DEFAULT, A, B] {
        assert_applied_once_in_order(&pool, s, &all).await;
    }
    assert_eq!(scalar(&pool, "SELECT count(*) FROM dead_letters").await, 0);
    stack.stop().await;
}

/// C is added with a start at the first event: the retained history is replayed to it (each event once, each key
/// in order, the live events behind the replayed ones), while D, added from now, gets only the events written
/// after it was added. Removing D stops its deliveries and keeps the others going.
#[sqlx::test(migrator = "outbox_testkit::MIGRATOR")]
async fn a_subscriber_added_with_history_gets_every_retained_event_once_in_order_and_one_from_now_only_new_ones(
    pool: PgPool,
) {
    const C: &str = "c";
    const D: &str = "d";
    const REPLAY_PARALLELISM: u32 = 2;
    let stack = stack_with(&pool, &[C, D], false, |o| {
        o.dev.time_scale = 0.005;
        o.relay.batching.default_n = 10;
        o.replay_parallelism = REPLAY_PARALLELISM;
    })
    .await;
    let before = enqueue(&pool, 1, 6, 5, 30, |_| Vec::new()).await;
    assert!(
        stack.wait_quiet(Duration::from_secs(60)).await,
        "did not drain"
    );
    let db = outbox::db::Db::new(pool.clone(), outbox::db::Statements::Prepared);
    let wait = Duration::from_secs(10);
    for topic in [ORDERED.name(), UNORDERED.name()] {
        let added = subscribers::add(
            &db,
            topic,
            C,
            stack.subscriber_url(C),
            Start::FromId(1),
            wait,
        )
        .await
        .unwrap();
        assert!(added.to_replay.unwrap() > 0);
        subscribers::add(&db, topic, D, stack.subscriber_url(D), Start::Now, wait)
            .await
            .unwrap();
    }
    // Live events while C's history is not yet copied: C's keys wait for the replay, however long it takes (here:
    // until D has applied them all, so a lane that did not wait would have had C's live events delivered).
    let after = enqueue(&pool, before + 1, 6, 2, 10, |_| Vec::new()).await;
    assert!(wait_applied(&pool, D, after as usize, Duration::from_secs(30)).await);
    tokio::time::sleep(Duration::from_millis(300)).await;
    for topic in [ORDERED.name(), UNORDERED.name()] {
        let mut steps = 0;
        let last = subscribers::replay(&db, topic, C, wait, |_| steps += 1)
            .await
            .unwrap()
            .unwrap();
        assert!(last.finished && steps >= 1);
    }
    assert!(
        stack.wait_quiet(Duration::from_secs(60)).await,
        "did not drain after the replay"
    );
    let all: Vec<i64> = (1..=before + after).collect();
    let new: Vec<i64> = (before + 1..=before + after).collect();
    assert_applied_once_in_order(&pool, DEFAULT, &all).await;
    assert_applied_once_in_order(&pool, C, &all).await;
    assert_applied_once_in_order(&pool, D, &new).await;
    // C's history went through QStash under flow control of its own, one key per topic at the replay's
    // parallelism (so a replay's backlog queues apart from everyone's live events); nobody else's did.
    let flows = outbox_testkit::dev_api::get(&stack.dev, "/v2/flowControl").await;
    let flows = flows.as_array().expect("a list of flow-control keys");
    let replay_keys: Vec<(&str, u64)> = flows
        .iter()
        .filter_map(|f| {
            let key = f["flowControlKey"].as_str()?;
            key.contains("replay")
                .then(|| (key, f["parallelismMax"].as_u64().unwrap_or(0)))
        })
        .collect();
    assert_eq!(replay_keys.len(), 2, "one replay key per topic: {flows:?}");
    for (key, parallelism) in replay_keys {
        assert!(key.contains(C), "{key}");
        assert_eq!(parallelism, u64::from(REPLAY_PARALLELISM), "{key}");
    }

    // D removed: no copies for it any more; the others go on.
    for topic in [ORDERED.name(), UNORDERED.name()] {
        subscribers::remove(&db, topic, D, wait).await.unwrap();
    }
    let more = enqueue(&pool, before + after + 1, 2, 1, 2, |_| Vec::new()).await;
    assert!(
        stack.wait_quiet(Duration::from_secs(60)).await,
        "did not drain after the removal"
    );
    let total = before + after + more;
    let everything: Vec<i64> = (1..=total).collect();
    assert_applied_once_in_order(&pool, C, &everything).await;
    assert_applied_once_in_order(&pool, DEFAULT, &everything).await;
    assert_applied_once_in_order(&pool, D, &new).await;
    stack.stop().await;
}
