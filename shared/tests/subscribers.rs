//! Fan-out's database side (`outbox::subscribers`, decision record 0068): the producer's copies, adding and
//! removing subscribers, and the upgrade of a single-consumer database with events in flight. The whole system
//! with three subscribers is in the repository's `tests/fanout.rs`.

use std::time::Duration;

use outbox::db::{Db, Statements};
use outbox::internals::claim::ClaimStatements;
use outbox::internals::ordering::{self, DeliveryRecorded};
use outbox::subscribers::{self, Ensured, Start, SubscriberError};
use outbox::{NewEvent, OutboxId, Topic};
use sqlx::PgPool;

const ORDERS: Topic = Topic::ordered("orders");
const AUDIT: Topic = Topic::unordered("audit");
const WAIT: Duration = Duration::from_secs(5);

fn db(pool: &PgPool) -> Db {
    Db::new(pool.clone(), Statements::Prepared)
}

async fn enqueue(pool: &PgPool, topic: &Topic, key: &str, n: i64) -> i64 {
    let mut conn = pool.acquire().await.unwrap();
    outbox::enqueue(
        &mut conn,
        NewEvent::new(topic, key, &serde_json::json!({ "n": n })).unwrap(),
    )
    .await
    .unwrap()
    .id
    .get()
}

/// Makes `billing` (a consumer at an unused port) a subscriber of `orders` from now on.
async fn add_billing(db: &Db) {
    subscribers::add(
        db,
        "orders",
        "billing",
        Some("http://127.0.0.1:9"),
        Start::Now,
        WAIT,
    )
    .await
    .unwrap();
}

/// `remove orders billing` while a transaction from before is open: it waits for it, then gives up with a clear
/// error, the subscriber marked removed and its copies and lanes still there (the transaction then ends).
async fn remove_billing_stopped_by_an_open_transaction(pool: &PgPool, db: &Db) {
    let mut open = pool.begin().await.unwrap();
    sqlx::query("SELECT 1").execute(&mut *open).await.unwrap();
    let err = subscribers::remove(db, "orders", "billing", Duration::from_millis(300))
        .await
        .unwrap_err();
    assert!(
        matches!(err, SubscriberError::OldTransactions { .. }),
        "{err}"
    );
    open.rollback().await.unwrap();
}

/// (subscriber, event id, seq) of every row of a topic, by id.
async fn copies(pool: &PgPool, topic: &str) -> Vec<(String, i64, Option<i64>)> {
    sqlx::query_as(
        "SELECT subscriber, coalesce(event_id, id), seq FROM outbox WHERE topic = $1 ORDER BY id",
    )
    .bind(topic)
    .fetch_all(pool)
    .await
    .unwrap()
}

/// The producer writes one copy per live subscriber, sharing the sequence, the first copy's id being the event's;
/// a topic without subscribers gets the default one only, as before fan-out.
#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn the_producer_writes_one_copy_per_subscriber_of_the_topic(pool: PgPool) {
    let db = db(&pool);
    let first = enqueue(&pool, &ORDERS, "c1", 1).await;
    assert_eq!(
        copies(&pool, "orders").await,
        [(String::new(), first, Some(1))]
    );
    for name in ["billing", "search"] {
        let added = subscribers::add(
            &db,
            "orders",
            name,
            Some("http://127.0.0.1:9/"),
            Start::Now,
            WAIT,
        )
        .await
        .unwrap();
        assert_eq!(added.subscriber.url.as_deref(), Some("http://127.0.0.1:9"));
    }
    let second = enqueue(&pool, &ORDERS, "c1", 2).await;
    let rows = copies(&pool, "orders").await;
    assert_eq!(
        rows[1..],
        [
            (String::new(), second, Some(2)),
            ("billing".into(), second, Some(2)),
            ("search".into(), second, Some(2)),
        ]
    );
    // Each lane of the key starts where its first copy is: the new ones at sequence 1 done (their first copy is 2).
    let lanes: Vec<(String, i64)> = sqlx::query_as(
        "SELECT subscriber, done_seq FROM outbox_keys WHERE topic = 'orders' ORDER BY subscriber",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(
        lanes,
        [
            (String::new(), 0),
            ("billing".into(), 1),
            ("search".into(), 1)
        ]
    );
    // Another topic is untouched.
    let audit = enqueue(&pool, &AUDIT, "a", 3).await;
    assert_eq!(copies(&pool, "audit").await, [(String::new(), audit, None)]);
}

/// Clear refusals, and nothing changed by them.
#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn subscriber_changes_refuse_what_would_lose_or_misroute_events(pool: PgPool) {
    let db = db(&pool);
    let url = Some("http://127.0.0.1:9");
    let err = subscribers::remove(&db, "orders", "", WAIT)
        .await
        .unwrap_err();
    assert!(
        matches!(err, SubscriberError::LastSubscriber { .. }),
        "{err}"
    );
    assert!(matches!(
        subscribers::add(&db, "orders", "billing", None, Start::Now, WAIT).await,
        Err(SubscriberError::MissingUrl(_))
    ));
    assert!(matches!(
        subscribers::add(&db, "orders", "billing", Some("ftp://x"), Start::Now, WAIT).await,
        Err(SubscriberError::InvalidUrl { .. })
    ));
    assert!(matches!(
        subscribers::add(&db, "orders", "", url, Start::Now, WAIT).await,
        Err(SubscriberError::DefaultUrl)
    ));
    assert!(matches!(
        subscribers::add(&db, "orders", "", None, Start::Now, WAIT).await,
        Err(SubscriberError::Exists { .. })
    ));
    subscribers::add(&db, "orders", "billing", url, Start::Now, WAIT)
        .await
        .unwrap();
    assert!(matches!(
        subscribers::add(&db, "orders", "billing", url, Start::Now, WAIT).await,
        Err(SubscriberError::Exists { .. })
    ));
    // The default one can go now that billing is there; billing then cannot.
    subscribers::remove(&db, "orders", "", WAIT).await.unwrap();
    assert!(matches!(
        subscribers::remove(&db, "orders", "billing", WAIT).await,
        Err(SubscriberError::LastSubscriber { .. })
    ));
    let id = enqueue(&pool, &ORDERS, "k", 1).await;
    assert_eq!(
        copies(&pool, "orders").await,
        [("billing".into(), id, Some(1))]
    );
    // A start in the future has nothing to replay.
    let later = chrono::Utc::now() + chrono::Duration::hours(1);
    assert!(matches!(
        subscribers::add(&db, "orders", "search", url, Start::Since(later), WAIT).await,
        Err(SubscriberError::NothingSince { .. })
    ));
    assert!(
        !subscribers::list(&db)
            .await
            .unwrap()
            .iter()
            .any(|s| s.name == "search")
    );
    // A declaration: added, then unchanged, then its URL moved.
    assert_eq!(
        subscribers::ensure(&db, "audit", "search", "http://127.0.0.1:9")
            .await
            .unwrap(),
        Ensured::Added
    );
    assert_eq!(
        subscribers::ensure(&db, "audit", "search", "http://127.0.0.1:9")
            .await
            .unwrap(),
        Ensured::Unchanged
    );
    assert_eq!(
        subscribers::ensure(&db, "audit", "search", "http://127.0.0.1:10")
            .await
            .unwrap(),
        Ensured::UrlChanged
    );
}

/// Removing a subscriber deletes its unfinished copies and lanes and keeps its dead-lettered copy and dead
/// letter; a transaction that began before the removal holds it up (it may still write copies for it).
#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn a_removed_subscriber_loses_its_pending_copies_and_keeps_its_dead_letters(pool: PgPool) {
    let db = db(&pool);
    add_billing(&db).await;
    enqueue(&pool, &ORDERS, "k", 1).await;
    enqueue(&pool, &ORDERS, "k", 2).await;
    sqlx::raw_sql(
        "UPDATE outbox SET dead_lettered_at = now() WHERE subscriber = 'billing' AND seq = 1; \
         INSERT INTO dead_letters (source, natural_id, outbox_id, topic, partition_key, subscriber, seq, error) \
           SELECT 'relay', id || '/1', id, topic, partition_key, subscriber, seq, 'poison' \
           FROM outbox WHERE subscriber = 'billing' AND seq = 1;",
    )
    .execute(&pool)
    .await
    .unwrap();
    // An open transaction from before: the removal waits for it, then gives up with a clear error.
    remove_billing_stopped_by_an_open_transaction(&pool, &db).await;
    // Marked removed already (no new copies); running it again finishes the job.
    let removed = subscribers::remove(&db, "orders", "billing", WAIT)
        .await
        .unwrap();
    assert_eq!((removed.copies_deleted, removed.keys_deleted), (1, 1));
    let left: Vec<(String, i64, Option<i64>)> = copies(&pool, "orders").await;
    assert_eq!(
        left.iter().filter(|c| c.0 == "billing").count(),
        1,
        "{left:?}"
    );
    assert_eq!(
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM dead_letters WHERE subscriber = 'billing'"
        )
        .fetch_one(&pool)
        .await
        .unwrap(),
        1
    );
    enqueue(&pool, &ORDERS, "k", 3).await;
    assert_eq!(copies(&pool, "orders").await.len(), 3 + 1);
}

/// A single-consumer database with events in every state upgrades without a change: every row, key and dead
/// letter belongs to the default subscriber, the in-flight head's evidence moves its key on, the next event
/// continues the key's sequence with one copy, and the relay claims it.
#[sqlx::test(migrations = false)]
async fn a_single_consumer_database_upgrades_with_events_in_flight_unchanged(pool: PgPool) {
    const FAN_OUT: i64 = 20261205000001;
    let before = outbox_testkit::db::library_migrations(|v| v < FAN_OUT);
    before.run(&pool).await.unwrap();
    sqlx::raw_sql(
        "INSERT INTO outbox (topic, partition_key, payload, dispatched_at, delivered_at) \
           SELECT 'audit', 'k', jsonb_build_object('n', g), now(), now() FROM generate_series(1, 5) g; \
         INSERT INTO outbox (topic, partition_key, payload, dispatched_at) VALUES ('audit', 'k', '{}', now()); \
         INSERT INTO outbox (topic, partition_key, payload) VALUES ('audit', 'k', '{}'); \
         INSERT INTO outbox (topic, partition_key, payload, dead_lettered_at) VALUES ('audit', 'k', '{}', now()); \
         INSERT INTO dead_letters (source, natural_id, outbox_id, topic, partition_key, error) \
           SELECT 'relay', id || '/1', id, topic, partition_key, 'poison' FROM outbox WHERE dead_lettered_at IS NOT NULL; \
         INSERT INTO outbox (topic, partition_key, seq, payload, dispatched_at, delivered_at) \
           SELECT 'orders', 'c1', s, '{}'::jsonb, now(), now() FROM generate_series(1, 2) s; \
         INSERT INTO outbox (topic, partition_key, seq, payload, dispatched_at, qstash_message_id) \
           VALUES ('orders', 'c1', 3, '{}', now(), 'msg_3'); \
         INSERT INTO outbox (topic, partition_key, seq, payload) \
           SELECT 'orders', 'c1', s, '{}'::jsonb FROM generate_series(4, 5) s; \
         INSERT INTO outbox_sequences (topic, partition_key, last_seq) VALUES ('orders', 'c1', 5); \
         INSERT INTO outbox_keys (topic, partition_key, done_seq, inflight_id, inflight_since) \
           SELECT 'orders', 'c1', 2, id, now() FROM outbox WHERE topic = 'orders' AND seq = 3;",
    )
    .execute(&pool)
    .await
    .unwrap();
    let snapshot = |pool: PgPool| async move {
        sqlx::query_as::<_, (serde_json::Value,)>(
            "SELECT jsonb_build_object('outbox', (SELECT jsonb_agg(to_jsonb(o) - 'subscriber' - 'event_id' - 'first_claimed_at' - 'republish_by' - 'fairness_key' ORDER BY id) FROM outbox o), \
               'keys', (SELECT jsonb_agg(to_jsonb(k) - 'subscriber') FROM outbox_keys k), \
               'dead', (SELECT jsonb_agg(to_jsonb(d) - 'subscriber' ORDER BY id) FROM dead_letters d))",
        )
        .fetch_one(&pool)
        .await
        .unwrap()
        .0
    };
    let old = snapshot(pool.clone()).await;
    outbox::MIGRATOR.run(&pool).await.unwrap();
    assert_eq!(snapshot(pool.clone()).await, old, "every row as it was");
    let named: i64 = sqlx::query_scalar(
        "SELECT (SELECT count(*) FROM outbox WHERE subscriber <> '' OR event_id IS NOT NULL) \
              + (SELECT count(*) FROM outbox_keys WHERE subscriber <> '') \
              + (SELECT count(*) FROM dead_letters WHERE subscriber <> '') \
              + (SELECT count(*) FROM outbox_subscribers)",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(named, 0, "everything belongs to the default subscriber");
    // The reconciler's columns (a later migration): rows that may have been published count from their creation,
    // rows never claimed and rows delivered are left unset; nothing is put back to be republished.
    let backfill: Vec<(String, bool, bool)> = sqlx::query_as(
        "SELECT topic || '/' || coalesce(seq::text, id::text), first_claimed_at IS NOT DISTINCT FROM created_at, \
                republish_by IS NULL \
         FROM outbox WHERE first_claimed_at IS NOT NULL OR republish_by IS NOT NULL ORDER BY id",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert!(
        backfill
            .iter()
            .all(|(_, from_creation, no_republish)| *from_creation && *no_republish),
        "{backfill:?}"
    );
    assert_eq!(
        backfill.len(),
        3,
        "the in-flight audit event, the dead one and the ordered head: {backfill:?}"
    );

    // The in-flight head's evidence moves the key on; the next event continues the sequence, once.
    let head: i64 = sqlx::query_scalar("SELECT id FROM outbox WHERE topic = 'orders' AND seq = 3")
        .fetch_one(&pool)
        .await
        .unwrap();
    let mut conn = pool.acquire().await.unwrap();
    let recorded = ordering::record_delivery(&mut conn, OutboxId(head), Statements::Prepared)
        .await
        .unwrap();
    assert_eq!(recorded, DeliveryRecorded::Recorded { key_advanced: true });
    let next = enqueue(&pool, &ORDERS, "c1", 6).await;
    assert_eq!(
        copies(&pool, "orders").await.last(),
        Some(&(String::new(), next, Some(6)))
    );
    let claims = ClaimStatements::new(100, Statements::Prepared);
    let ordered = claims.claim_ordered(&mut conn, 30.0).await.unwrap();
    assert_eq!(
        ordered
            .iter()
            .map(|e| (e.seq, e.subscriber.as_str()))
            .collect::<Vec<_>>(),
        [(Some(4), "")]
    );
    let unordered = claims.claim_unordered(&mut conn, 30.0).await.unwrap();
    assert_eq!(unordered.len(), 1);
    assert_eq!(unordered[0].subscriber, "");
}

/// `OUTBOX_SUBSCRIBERS`: the relay makes the declared subscribers live at its first invocation (from now on), a
/// later process with a changed URL updates it, and a bad URL stops the invocation with a message naming the item.
#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn the_relay_makes_its_declared_subscribers_live_and_refuses_a_bad_one(pool: PgPool) {
    use outbox::config::{DeclaredSubscriber, QstashConfig};
    let qstash = |url: &str| QstashConfig {
        base_url: "http://127.0.0.1:9".into(),
        retries: 0,
        publish_timeout: Duration::from_secs(1),
        batch_size: 10,
        delivery_timeout: None,
        flow_parallelism: 1,
        replay_parallelism: 4,
        flow_rate: None,
        flow_period: Duration::from_secs(1),
        consumer_url: url.into(),
        callback_url: url.into(),
    };
    let relay_with = |items: &str| {
        let mut cfg = outbox_testkit::relaying::relay_config();
        cfg.subscribers = items
            .split(',')
            .map(|i| DeclaredSubscriber::parse(i).unwrap())
            .collect();
        outbox_testkit::relaying::relay_to(&pool, "token", cfg, qstash("http://127.0.0.1:9"))
    };
    let relay = relay_with("orders:billing=http://127.0.0.1:9/b,audit:search=http://127.0.0.1:9/s");
    relay.declare_subscribers().await.unwrap();
    relay.declare_subscribers().await.unwrap();
    let urls = |pool: PgPool| async move {
        sqlx::query_as::<_, (String, String, String)>(
            "SELECT topic, name, url FROM outbox_subscribers WHERE removed_at IS NULL ORDER BY 1, 2",
        )
        .fetch_all(&pool)
        .await
        .unwrap()
    };
    assert_eq!(
        urls(pool.clone()).await,
        [
            (
                "audit".into(),
                "search".into(),
                "http://127.0.0.1:9/s".into()
            ),
            (
                "orders".into(),
                "billing".into(),
                "http://127.0.0.1:9/b".into()
            ),
        ]
    );
    relay_with("orders:billing=http://127.0.0.1:10/b")
        .declare_subscribers()
        .await
        .unwrap();
    assert_eq!(urls(pool.clone()).await[1].2, "http://127.0.0.1:10/b");
    let err = relay_with("orders:Billing=http://127.0.0.1:9/b")
        .declare_subscribers()
        .await
        .unwrap_err();
    assert!(
        err.to_string()
            .contains("OUTBOX_SUBSCRIBERS: orders:Billing: invalid subscriber name"),
        "{err}"
    );
    assert!(DeclaredSubscriber::parse("orders-billing=http://x").is_err());
    assert!(DeclaredSubscriber::parse("orders:billing").is_err());
}

/// A lane a producer opened with `'infinity'` for a subscriber whose replay ended meanwhile is opened by the
/// relay's housekeeping; a lane of a subscriber still replaying keeps waiting.
#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn lanes_left_waiting_after_a_replay_are_released_and_a_replaying_ones_are_not(pool: PgPool) {
    sqlx::raw_sql(
        "INSERT INTO outbox_subscribers (topic, name, url, replay_from, replay_to, replayed_to, replay_done_at) VALUES \
           ('orders', 'done', 'http://127.0.0.1:9', 1, 10, 10, now()), \
           ('orders', 'busy', 'http://127.0.0.1:9', 1, 10, 5, NULL); \
         INSERT INTO outbox_keys (topic, partition_key, subscriber, done_seq, available_at) VALUES \
           ('orders', 'k', 'done', 3, 'infinity'), ('orders', 'k', 'busy', 3, 'infinity');",
    )
    .execute(&pool)
    .await
    .unwrap();
    let released = subscribers::release_waiting_lanes(&db(&pool))
        .await
        .unwrap();
    assert_eq!(released, 1);
    let waiting: Vec<String> = sqlx::query_scalar(
        "SELECT subscriber FROM outbox_keys WHERE available_at = 'infinity' ORDER BY 1",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(waiting, ["busy"]);
}

/// The operator's timeline of one copy shows that copy's lane (not another subscriber's lane of the same key)
/// and the dedupe row in its subscriber's namespace, even when the console was started with the default
/// consumer's name only.
#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn an_events_timeline_shows_its_subscribers_lane_and_dedupe_row(pool: PgPool) {
    let db = db(&pool);
    add_billing(&db).await;
    enqueue(&pool, &ORDERS, "c1", 1).await;
    enqueue(&pool, &ORDERS, "c1", 2).await;
    let billing_copy: i64 = sqlx::query_scalar(
        "SELECT id FROM outbox WHERE topic = 'orders' AND subscriber = 'billing' AND seq = 2",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    // The default lane has moved on; billing's has not. Billing applied its copy of event 2 (dedupe row).
    sqlx::raw_sql(
        "UPDATE outbox_keys SET done_seq = 2 WHERE topic = 'orders' AND subscriber = ''; \
         UPDATE outbox_keys SET done_seq = 1 WHERE topic = 'orders' AND subscriber = 'billing';",
    )
    .execute(&pool)
    .await
    .unwrap();
    sqlx::query("INSERT INTO processed_messages (consumer, message_id) VALUES ('billing', $1)")
        .bind(billing_copy.to_string())
        .execute(&pool)
        .await
        .unwrap();
    let mut conn = pool.acquire().await.unwrap();
    let t =
        outbox::ops::timeline::timeline(&mut conn, OutboxId(billing_copy), &["consumer".into()])
            .await
            .unwrap()
            .expect("the copy's timeline");
    let event = t.event.as_ref().expect("the row");
    assert_eq!(event.subscriber, "billing");
    assert_eq!(
        t.key.as_ref().map(|k| k.done_seq),
        Some(1),
        "billing's lane"
    );
    let applied: Vec<&str> = t.applied.iter().map(|a| a.consumer.as_str()).collect();
    assert_eq!(applied, ["billing"]);
}

/// A named subscriber's own replay parallelism reaches the relay's view of its subscribers; the default one's is
/// the relay's setting, and a value outside 1–1000 is refused.
#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn a_subscribers_own_replay_parallelism_reaches_the_relay(pool: PgPool) {
    let db = db(&pool);
    add_billing(&db).await;
    let load = || subscribers::Destinations::load(&db);
    assert_eq!(
        load()
            .await
            .unwrap()
            .replay_parallelism("orders", "billing"),
        None
    );
    let s = subscribers::set_replay_parallelism(&db, "orders", "billing", Some(12))
        .await
        .unwrap();
    assert_eq!(s.replay_parallelism, Some(12));
    assert_eq!(
        load()
            .await
            .unwrap()
            .replay_parallelism("orders", "billing"),
        Some(12)
    );
    assert!(matches!(
        subscribers::set_replay_parallelism(&db, "orders", "billing", Some(0)).await,
        Err(SubscriberError::InvalidParallelism(0))
    ));
    assert!(matches!(
        subscribers::set_replay_parallelism(&db, "orders", "", Some(3)).await,
        Err(SubscriberError::DefaultParallelism)
    ));
    assert!(matches!(
        subscribers::set_replay_parallelism(&db, "orders", "search", Some(3)).await,
        Err(SubscriberError::NotFound { .. })
    ));
    subscribers::set_replay_parallelism(&db, "orders", "billing", None)
        .await
        .unwrap();
    assert_eq!(
        load()
            .await
            .unwrap()
            .replay_parallelism("orders", "billing"),
        None
    );
}

/// A subscriber added while a relay holds the subscribers it read a moment ago: the relay's next claim holds a copy
/// for it, which the relay's cache does not know; it reads the subscribers again (they were read before the claim
/// began) and publishes the copy, instead of dead-lettering it as "no destination" (which, on an ordered topic,
/// blocked the new subscriber's lane).
#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn a_subscriber_added_while_a_relay_caches_the_subscribers_gets_its_copies_published(
    pool: PgPool,
) {
    let env = outbox_testkit::relaying::RelayEnv::start(
        pool.clone(),
        qstash_dev::Config::for_tests(0.001),
    )
    .await;
    let relay = env.relay();
    let db = db(&pool);
    let url = env.sink.url.clone();
    subscribers::add(&db, "orders", "billing", Some(&url), Start::Now, WAIT)
        .await
        .unwrap();
    enqueue(&pool, &ORDERS, "k1", 1).await;
    // The relay reads the subscribers for billing's copy: its cache now knows billing, not shipping.
    let first = relay.run_cycle().await.unwrap();
    assert_eq!(first.claimed, 2, "{first:?}");
    for topic in ["orders", "audit"] {
        subscribers::add(&db, topic, "shipping", Some(&url), Start::Now, WAIT)
            .await
            .unwrap();
    }
    enqueue(&pool, &ORDERS, "k2", 2).await;
    enqueue(&pool, &AUDIT, "a1", 3).await;
    // At once, well within the cache's life.
    let report = relay.run_cycle().await.unwrap();
    let dead: Vec<(String, String)> =
        sqlx::query_as("SELECT subscriber, error FROM dead_letters ORDER BY id")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert!(dead.is_empty(), "{dead:?} ({report:?})");
    let published: Vec<(String, String)> = sqlx::query_as(
        "SELECT topic, partition_key FROM outbox WHERE subscriber = 'shipping' AND dispatched_at IS NOT NULL \
         ORDER BY id",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(
        published,
        [
            ("orders".to_owned(), "k2".to_owned()),
            ("audit".to_owned(), "a1".to_owned())
        ],
        "{report:?}"
    );
}

/// A replay started by a role that may not read other roles' statistics (as the deployment docs create them:
/// `pg_stat_activity.xact_start` is NULL for others' sessions): `add --from` still waits for a producer's
/// transaction that began before the subscriber existed, and the event it commits afterwards is replayed. Before,
/// the wait saw no older transaction, the replay's end was fixed below that event, and the new subscriber never got
/// it.
#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn a_replay_by_a_plain_role_waits_for_an_older_producer_and_copies_its_event(pool: PgPool) {
    let role = format!("replay_operator_{}", std::process::id());
    for sql in [
        format!("DROP ROLE IF EXISTS {role}"),
        format!("CREATE ROLE {role} LOGIN NOSUPERUSER NOINHERIT"),
        format!("GRANT ALL ON ALL TABLES IN SCHEMA public TO {role}"),
        format!("GRANT ALL ON ALL SEQUENCES IN SCHEMA public TO {role}"),
    ] {
        sqlx::query(sqlx::AssertSqlSafe(sql))
            .execute(&pool)
            .await
            .unwrap();
    }
    let mut url = url::Url::parse(&outbox_testkit::db::url_of(&pool)).unwrap();
    url.set_username(&role).unwrap();
    let operator = sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .connect(url.as_str())
        .await
        .unwrap();
    let stats: bool = sqlx::query_scalar(
        "SELECT rolsuper OR pg_has_role(current_user, 'pg_read_all_stats', 'MEMBER') FROM pg_roles \
         WHERE rolname = current_user",
    )
    .fetch_one(&operator)
    .await
    .unwrap();
    assert!(
        !stats,
        "the operator's role must not read other roles' statistics"
    );
    let first = enqueue(&pool, &AUDIT, "a", 1).await;
    // A producer's transaction, begun (and its event written, with the subscriber list it saw) before the add.
    let mut producer = pool.begin().await.unwrap();
    let late = outbox::enqueue(
        &mut producer,
        NewEvent::new(&AUDIT, "b", &serde_json::json!({ "n": 2 })).unwrap(),
    )
    .await
    .unwrap()
    .id
    .get();
    let adding = tokio::spawn({
        let db = Db::new(operator.clone(), Statements::Unnamed);
        async move {
            subscribers::add(
                &db,
                "audit",
                "search",
                Some("http://127.0.0.1:9"),
                Start::FromId(1),
                Duration::from_secs(20),
            )
            .await
        }
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        !adding.is_finished(),
        "the add did not wait for the older producer transaction"
    );
    producer.commit().await.unwrap();
    adding.await.unwrap().unwrap();
    let db = Db::new(operator, Statements::Unnamed);
    subscribers::replay(&db, "audit", "search", WAIT, |_| {})
        .await
        .unwrap();
    let search: Vec<i64> = sqlx::query_scalar(
        "SELECT coalesce(event_id, id) FROM outbox WHERE subscriber = 'search' ORDER BY 1",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(
        search,
        [first, late],
        "every event written before or while it was added"
    );
    db.pool().close().await;
    for sql in [format!("DROP OWNED BY {role}"), format!("DROP ROLE {role}")] {
        sqlx::query(sqlx::AssertSqlSafe(sql))
            .execute(&pool)
            .await
            .unwrap();
    }
}

/// A named subscriber is its consumer's dedupe namespace, the default subscriber the relay's `CONSUMER_NAME`: the
/// two must differ, or each takes the other's events for duplicates. With the relay's name on record, a subscriber
/// of that name is refused; a relay whose `CONSUMER_NAME` is a live subscriber's refuses to go on (its
/// invocation fails with the reason); nothing changes in either case. A subscriber URL in plain http that is not on
/// this machine is refused too (QStash calls public URLs).
#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn a_subscriber_may_not_share_the_default_consumers_namespace_or_use_plain_http(
    pool: PgPool,
) {
    let db = db(&pool);
    subscribers::record_default_consumer(&db, "consumer")
        .await
        .unwrap();
    let err = subscribers::add(
        &db,
        "orders",
        "consumer",
        Some("http://127.0.0.1:9"),
        Start::Now,
        WAIT,
    )
    .await
    .unwrap_err();
    assert!(
        matches!(err, SubscriberError::DefaultNamespace { .. }),
        "{err}"
    );
    assert!(
        err.to_string().contains("share its dedupe namespace"),
        "{err}"
    );
    let err = subscribers::add(
        &db,
        "orders",
        "ledger",
        Some("http://ledger.example.com"),
        Start::Now,
        WAIT,
    )
    .await
    .unwrap_err();
    assert!(err.to_string().contains("use https"), "{err}");
    let live: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox_subscribers")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(live, 0, "nothing was added");

    subscribers::add(
        &db,
        "orders",
        "ledger",
        Some("https://ledger.example.com"),
        Start::Now,
        WAIT,
    )
    .await
    .unwrap();
    let mut cfg = outbox_testkit::relaying::relay_config();
    cfg.accounting.consumer_name = "ledger".into();
    let relay = outbox_testkit::relaying::relay_to(
        &pool,
        "token",
        cfg,
        outbox::config::QstashConfig {
            base_url: "http://127.0.0.1:9".into(),
            retries: 0,
            publish_timeout: Duration::from_secs(1),
            batch_size: 10,
            delivery_timeout: None,
            flow_parallelism: 1,
            replay_parallelism: 4,
            flow_rate: None,
            flow_period: Duration::from_secs(1),
            consumer_url: "http://127.0.0.1:9".into(),
            callback_url: "http://127.0.0.1:9".into(),
        },
    );
    let err = relay.declare_subscribers().await.unwrap_err().to_string();
    assert!(
        err.contains("CONSUMER_NAME") && err.contains("ledger") && err.contains("orders"),
        "{err}"
    );
    let recorded: String = sqlx::query_scalar("SELECT consumer_name FROM outbox_default_consumer")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(
        recorded, "consumer",
        "the relay's refused name was not recorded"
    );
}

/// `add --from <time>` starts at the first event written at or after that time, by the events' own times: the
/// copies another subscriber's replay made a moment ago are of older events and do not pull the start back
/// (before, their creation time was the replay's, and the new subscriber got the whole replayed history).
#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn a_replay_from_a_time_starts_at_the_events_written_since_whatever_other_replays_copied(
    pool: PgPool,
) {
    let db = db(&pool);
    let old: Vec<i64> = vec![
        enqueue(&pool, &AUDIT, "a", 1).await,
        enqueue(&pool, &AUDIT, "b", 2).await,
    ];
    tokio::time::sleep(Duration::from_millis(20)).await;
    let since: chrono::DateTime<chrono::Utc> = sqlx::query_scalar("SELECT clock_timestamp()")
        .fetch_one(&pool)
        .await
        .unwrap();
    let new = enqueue(&pool, &AUDIT, "c", 3).await;
    // Another subscriber replays everything: copies of the old events, written now.
    subscribers::add(
        &db,
        "audit",
        "archive",
        Some("http://127.0.0.1:9"),
        Start::FromId(1),
        WAIT,
    )
    .await
    .unwrap();
    subscribers::replay(&db, "audit", "archive", WAIT, |_| {})
        .await
        .unwrap();
    let added = subscribers::add(
        &db,
        "audit",
        "search",
        Some("http://127.0.0.1:9"),
        Start::Since(since),
        WAIT,
    )
    .await
    .unwrap();
    assert_eq!(
        added.subscriber.replay.as_ref().map(|r| r.from),
        Some(new),
        "{old:?}"
    );
    subscribers::replay(&db, "audit", "search", WAIT, |_| {})
        .await
        .unwrap();
    let search: Vec<i64> = sqlx::query_scalar(
        "SELECT coalesce(event_id, id) FROM outbox WHERE subscriber = 'search' ORDER BY 1",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(search, [new]);
}

/// A subscriber whose removal stopped at its wait for older transactions (its copies and lanes still there) and
/// that is then added again `--from` (the explorer's seed 111): the addition finishes the removal first, so the
/// replay makes the subscriber's ordered lane afresh and waiting, and copies the whole history. Before, the old
/// lane and copies stayed: the lane open, so live copies of later sequences could go before the replayed ones,
/// which the consumer then refused as late.
#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn adding_again_after_an_unfinished_removal_finishes_it_first(pool: PgPool) {
    let db = db(&pool);
    add_billing(&db).await;
    let first = enqueue(&pool, &ORDERS, "k", 1).await;
    enqueue(&pool, &ORDERS, "k", 2).await;
    remove_billing_stopped_by_an_open_transaction(&pool, &db).await;
    // Written while billing is removed: no copy for it.
    enqueue(&pool, &ORDERS, "k", 3).await;
    // Added again with its history, one chunk at a time so that the replay is seen under way.
    let added = subscribers::add_again(
        &db,
        "orders",
        "billing",
        Some("http://127.0.0.1:9"),
        Start::FromId(first),
        WAIT,
    )
    .await
    .unwrap();
    assert!(added.to_replay.is_some(), "{added:?}");
    // The removal was finished first: its unfinished copies (sequences 1 and 2) and its lane are gone.
    let billing = |pool: PgPool| async move {
        copies(&pool, "orders")
            .await
            .into_iter()
            .filter(|c| c.0 == "billing")
            .map(|c| c.2)
            .collect::<Vec<_>>()
    };
    assert!(billing(pool.clone()).await.is_empty());
    let lanes: i64 =
        sqlx::query_scalar("SELECT count(*) FROM outbox_keys WHERE subscriber = 'billing'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(lanes, 0);
    // The replay copies the whole history in order, on a lane of its own from the start.
    subscribers::replay(&db, "orders", "billing", WAIT, |_| {})
        .await
        .unwrap();
    assert_eq!(billing(pool.clone()).await, [Some(1), Some(2), Some(3)]);
    let done: i64 = sqlx::query_scalar(
        "SELECT done_seq FROM outbox_keys WHERE topic = 'orders' AND partition_key = 'k' AND subscriber = 'billing'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(done, 0);
}

/// Adding back a subscriber whose removal is unfinished while a transaction older than that removal is still open
/// (the explorer's seed 113): the addition cannot finish the removal, says so, and records nothing — the subscriber
/// stays removed, so the operator's "run it again" is an addition again. Before, it failed with the error that
/// means "recorded, run the command again" (`OldTransactions`), the operator resumed a replay instead, and the
/// subscriber was never added back: every event of the topic from then on was lost to it.
#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn adding_again_while_the_removal_still_waits_records_nothing_and_says_so(pool: PgPool) {
    let db = db(&pool);
    add_billing(&db).await;
    let first = enqueue(&pool, &ORDERS, "k", 1).await;
    remove_billing_stopped_by_an_open_transaction(&pool, &db).await;
    // Another transaction older than the next attempt stays open through it.
    let mut open = pool.begin().await.unwrap();
    sqlx::query("SELECT 1").execute(&mut *open).await.unwrap();
    let err = subscribers::add_again(
        &db,
        "orders",
        "billing",
        Some("http://127.0.0.1:9"),
        Start::FromId(first),
        Duration::from_millis(300),
    )
    .await
    .unwrap_err();
    assert!(
        matches!(err, SubscriberError::RemovalUnfinished { .. }),
        "{err}"
    );
    assert!(err.to_string().contains("nothing changed"), "{err}");
    let s = subscribers::get(&db, "orders", "billing").await.unwrap();
    assert!(s.removed_at.is_some(), "{s:?}");
    open.rollback().await.unwrap();
    // Run again once the transaction ended: added, with its history.
    let added = subscribers::add_again(
        &db,
        "orders",
        "billing",
        Some("http://127.0.0.1:9"),
        Start::FromId(first),
        WAIT,
    )
    .await
    .unwrap();
    assert!(added.subscriber.removed_at.is_none(), "{added:?}");
    assert_eq!(added.to_replay, Some(1));
}

/// A copy a relay dead-lettered "no destination" after the removal began — it was unfinished at the removal, and
/// the relay got to it during the removal's wait for older transactions (the explorer's seed 115) — is withdrawn
/// with the rest when the removal finishes: deleted, its dead letter resolved `withdrawn`, so QStash later giving
/// up on its message records nothing open either. Before, it stayed dead with an open dead letter for an event the
/// subscriber was not owed (and, added back, refused "out of order"). A dead letter from before the removal stays.
#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn a_copy_dead_lettered_no_destination_during_the_removal_is_withdrawn_with_it(pool: PgPool) {
    let db = db(&pool);
    add_billing(&db).await;
    let before = enqueue(&pool, &ORDERS, "k", 1).await;
    let during = enqueue(&pool, &ORDERS, "j", 2).await;
    let copy_of = |event: i64| {
        let pool = pool.clone();
        async move {
            sqlx::query_scalar::<_, i64>(
                "SELECT id FROM outbox WHERE subscriber = 'billing' AND event_id = $1",
            )
            .bind(event)
            .fetch_one(&pool)
            .await
            .unwrap()
        }
    };
    let (old_copy, copy) = (copy_of(before).await, copy_of(during).await);
    // Poison before the removal: dead-lettered by the relay then.
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "UPDATE outbox SET dead_lettered_at = now() WHERE id = {old_copy}; \
         INSERT INTO dead_letters (source, natural_id, outbox_id, topic, partition_key, subscriber, error) \
           VALUES ('relay', '{old_copy}/1', {old_copy}, 'orders', 'k', 'billing', 'poison');"
    )))
    .execute(&pool)
    .await
    .unwrap();
    remove_billing_stopped_by_an_open_transaction(&pool, &db).await;
    // During the removal's wait, a relay finds no destination for the other copy.
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "UPDATE outbox SET dead_lettered_at = now() WHERE id = {copy}; \
         INSERT INTO dead_letters (source, natural_id, outbox_id, topic, partition_key, subscriber, error) \
           VALUES ('relay', '{copy}/1', {copy}, 'orders', 'j', 'billing', \
                   'no destination: subscriber \"billing\" of topic orders is not configured');"
    )))
    .execute(&pool)
    .await
    .unwrap();
    let removed = subscribers::remove(&db, "orders", "billing", WAIT)
        .await
        .unwrap();
    assert_eq!(removed.copies_deleted, 1, "{removed:?}");
    let left: Vec<i64> =
        sqlx::query_scalar("SELECT id FROM outbox WHERE subscriber = 'billing' ORDER BY id")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(left, [old_copy], "the poisoned copy from before stays");
    let letters: Vec<(i64, Option<String>)> = sqlx::query_as(
        "SELECT outbox_id, resolution FROM dead_letters WHERE subscriber = 'billing' ORDER BY outbox_id",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(
        letters,
        [(old_copy, None), (copy, Some("withdrawn".to_owned()))]
    );
}
