//! The reconciler (decision record 0015) at its edges, against real Postgres and the QStash-compatible dev server:
//! it may never cause a second application of an event, and never leave an event without a state. Hours pass by
//! ageing the event (every timestamp of its outbox row moved into the past, as if it had all happened earlier),
//! the way `RelayEnv::make_due` skips backoffs; QStash losing messages, or answering about messages nobody asked
//! about, are the dev server's faults.

use std::time::Duration;

use outbox::config::{AccountingConfig, OutcomeSource, QstashConfig, RelayConfig};
use outbox::dead_letters::{RedriveOptions, redrive};
use outbox::internals::RelaySteps;
use outbox::internals::qstash::QstashClient;
use outbox::producer::{NewEvent, Topic, enqueue_batch};
use outbox::relay::Relay;
use outbox_testkit::relaying::{RelayEnv, relay_config};
use qstash_dev::{AttemptKind, Config as DevConfig, Faults};
use secrecy::SecretString;
use serde_json::json;
use sqlx::PgPool;

const AUDIT: Topic = Topic::unordered("audit");

/// An accounting pass's wall-time budget (far more than any of these needs).
const PASS: Duration = Duration::from_secs(30);

/// Loses every accepted message (never delivered, not in the DLQ, unknown to `GET /v2/messages/{id}`).
fn lossy() -> Faults {
    Faults {
        message_loss_rate: 1.0,
        ..Faults::default()
    }
}

fn dev(faults: Faults) -> DevConfig {
    DevConfig {
        faults,
        ..DevConfig::for_tests(0.0005)
    }
}

/// The relay tests' settings with the production accounting defaults (horizon ≈ 65.3 h for 5 QStash retries,
/// dedupe rows kept 168 h, 3 republishes), lookups not paced.
fn config() -> RelayConfig {
    RelayConfig {
        accounting: AccountingConfig {
            unordered: Some(OutcomeSource::DedupeRow),
            lookup_interval: Duration::ZERO,
            ..AccountingConfig::default()
        },
        ..relay_config()
    }
}

async fn enqueue(pool: &PgPool, n: usize, pad: usize) -> Vec<i64> {
    let events: Vec<NewEvent> = (0..n)
        .map(|i| {
            NewEvent::new(
                &AUDIT,
                format!("k-{i}"),
                &json!({"i": i, "pad": "x".repeat(pad)}),
            )
            .unwrap()
        })
        .collect();
    let mut tx = pool.begin().await.unwrap();
    let out = enqueue_batch(&mut tx, &events).await.unwrap();
    tx.commit().await.unwrap();
    out.into_iter().map(|e| e.id.get()).collect()
}

/// Moves event `id` `hours` into the past: every `timestamptz` column of its outbox row.
async fn age(pool: &PgPool, id: i64, hours: f64) {
    let columns: Vec<String> = sqlx::query_scalar(
        "SELECT column_name::text FROM information_schema.columns \
         WHERE table_schema = current_schema() AND table_name = 'outbox' \
           AND data_type = 'timestamp with time zone'",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    let set: Vec<String> = columns
        .iter()
        .map(|c| format!("{c} = {c} - make_interval(secs => $2)"))
        .collect();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "UPDATE outbox SET {} WHERE id = $1",
        set.join(", ")
    )))
    .bind(id)
    .bind(hours * 3600.0)
    .execute(pool)
    .await
    .unwrap();
}

/// `(dispatched, dead, republish_count)` of an event.
async fn state(pool: &PgPool, id: i64) -> (bool, bool, i32) {
    sqlx::query_as(
        "SELECT dispatched_at IS NOT NULL, dead_lettered_at IS NOT NULL, republish_count FROM outbox WHERE id = $1",
    )
    .bind(id)
    .fetch_one(pool)
    .await
    .unwrap()
}

/// The open (neither resolved nor redriven) dead letters of an event: `(id, natural id, error)`.
async fn open_dead_letters(pool: &PgPool, id: i64) -> Vec<(i64, String, String)> {
    sqlx::query_as(
        "SELECT id, natural_id, error FROM dead_letters \
         WHERE outbox_id = $1 AND resolved_at IS NULL AND redriven_at IS NULL ORDER BY id",
    )
    .bind(id)
    .fetch_all(pool)
    .await
    .unwrap()
}

/// One relay cycle that must publish (and, QStash losing it, leave in flight) exactly `n` events.
async fn publish(relay: &Relay, n: u64) {
    let r = relay.run_cycle().await.unwrap();
    assert_eq!(r.settled.dispatched, n, "{r:?}");
}

/// A dev server that loses every message, a relay, and one event it published (and QStash lost).
async fn one_lost_event(pool: PgPool) -> (RelayEnv, Relay, i64) {
    let env = RelayEnv::start(pool, dev(lossy())).await;
    let relay = env.relay_with(config());
    let id = enqueue(&env.pool, 1, 0).await[0];
    publish(&relay, 1).await;
    (env, relay, id)
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn a_republish_is_anchored_on_the_first_claim_and_leaves_room_for_its_own_delivery(
    pool: PgPool,
) {
    let (env, relay, id) = one_lost_event(pool).await;

    // 66 h after the first claim QStash has no trace of the message: published again. Its delivery (up to QStash's
    // retry horizon for 5 retries, ≈ 32.2 h) ends well before a dedupe row written at the first claim expires
    // (168 h).
    age(&env.pool, id, 66.0).await;
    let r = relay.account(PASS).await.unwrap();
    assert_eq!((r.republished, r.unaccounted_dead), (1, 0), "{r:?}");
    publish(&relay, 1).await;

    // Lost again and looked up 70 h after that dispatch: 136 h after the first claim. A delivery of a third
    // message could end at 136 + 32.2 h, past the 168 h a dedupe row of a first application lives: not published
    // again (measured from the last dispatch, 70 h, it would have been), an "unaccounted" dead letter instead.
    age(&env.pool, id, 70.0).await;
    let r = relay.account(PASS).await.unwrap();
    assert_eq!((r.republished, r.unaccounted_dead), (0, 1), "{r:?}");
    assert_eq!(state(&env.pool, id).await, (true, true, 1));
    let open = open_dead_letters(&env.pool, id).await;
    assert_eq!(open.len(), 1, "{open:?}");
    assert!(open[0].2.contains("PROCESSED_TTL_HOURS"), "{open:?}");
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn a_publish_whose_answer_was_lost_is_the_first_claim(pool: PgPool) {
    // QStash accepts the first publish (and loses the message) but the answer never reaches the relay: as far as
    // the relay knows nothing was published, yet a consumer could have applied it from then on.
    let env = RelayEnv::start(
        pool,
        dev(Faults {
            publish_drop_response_rate: 1.0,
            ..lossy()
        }),
    )
    .await;
    let relay = env.relay_with(config());
    let id = enqueue(&env.pool, 1, 0).await[0];
    let r = relay.run_cycle().await.unwrap();
    assert_eq!((r.claimed, r.settled.dispatched), (1, 0), "{r:?}");
    // 70 h later (QStash was unreachable, say) it is published again; QStash loses that message too.
    age(&env.pool, id, 70.0).await;
    env.dev.handle().set_faults(lossy()).unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        env.make_due().await;
        if relay.run_cycle().await.unwrap().settled.dispatched == 1 {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "never dispatched");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Looked up 66 h after its dispatch, 136 h after its first claim: a new message's delivery could end at
    // 136 + 32.2 + 1 h, past the 168 h a dedupe row of an application at the first publish lives. Not published
    // again (measured from the recorded dispatch, 66 h, it would have been).
    age(&env.pool, id, 66.0).await;
    let r = relay.account(PASS).await.unwrap();
    assert_eq!((r.republished, r.unaccounted_dead), (0, 1), "{r:?}");
    assert_eq!(open_dead_letters(&env.pool, id).await.len(), 1);
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn a_redrive_keeps_the_first_claim_and_a_reinserted_event_is_never_republished(pool: PgPool) {
    let env = RelayEnv::start(pool, dev(lossy())).await;
    let relay = env.relay_with(config());
    let ids = enqueue(&env.pool, 2, 0).await;
    let (kept, pruned) = (ids[0], ids[1]);
    publish(&relay, 2).await;
    // Both lost, looked up after 140 h: too late to publish again (140 + 32.2 + 1 > 168): dead letters.
    age(&env.pool, kept, 140.0).await;
    age(&env.pool, pruned, 140.0).await;
    let r = relay.account(PASS).await.unwrap();
    assert_eq!((r.republished, r.unaccounted_dead), (0, 2), "{r:?}");

    // The operator redrives both; one of the rows had been deleted meanwhile (pruned), so the redrive re-inserts
    // it from its dead letter: when it was first published is no longer known.
    sqlx::query("DELETE FROM outbox WHERE id = $1")
        .bind(pruned)
        .execute(&env.pool)
        .await
        .unwrap();
    let mut conn = env.pool.acquire().await.unwrap();
    for id in [kept, pruned] {
        let dl = open_dead_letters(&env.pool, id).await[0].0;
        redrive(&mut conn, dl, RedriveOptions::default())
            .await
            .unwrap();
    }
    // Published and lost again, looked up after the horizon (66 h): the redriven event's first claim is 206 h
    // old, and the re-inserted one's unknown. Neither is published again by the reconciler; each gets one open
    // dead letter.
    publish(&relay, 2).await;
    age(&env.pool, kept, 66.0).await;
    age(&env.pool, pruned, 66.0).await;
    let r = relay.account(PASS).await.unwrap();
    assert_eq!((r.republished, r.unaccounted_dead), (0, 2), "{r:?}");
    for id in [kept, pruned] {
        assert_eq!(state(&env.pool, id).await, (true, true, 0), "event {id}");
        assert_eq!(
            open_dead_letters(&env.pool, id).await.len(),
            1,
            "event {id}"
        );
    }
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn a_republished_event_not_published_before_its_deadline_becomes_a_dead_letter(pool: PgPool) {
    let (env, relay, id) = one_lost_event(pool).await;
    age(&env.pool, id, 66.0).await;
    let r = relay.account(PASS).await.unwrap();
    assert_eq!(r.republished, 1, "{r:?}");
    // No relay publishes it for 70 h (QStash down, say): its first claim is now 136 h old, and a delivery started
    // now could end after a first application's dedupe row is gone. It must not be published any more.
    age(&env.pool, id, 70.0).await;
    let r = relay.account(PASS).await.unwrap();
    assert_eq!(r.unaccounted_dead, 1, "{r:?}");
    assert_eq!(relay.run_cycle().await.unwrap().claimed, 0);
    assert_eq!(state(&env.pool, id).await, (false, true, 1));
    let open = open_dead_letters(&env.pool, id).await;
    assert_eq!(open.len(), 1, "{open:?}");
}

/// Publishes a message straight to the dev server (as another publisher sharing the QStash account would) to a
/// destination that refuses connections, without retries, so it lands in the DLQ at once. Returns its id.
async fn publish_foreign(env: &RelayEnv, headers: &[(&str, String)], body: String) -> String {
    let mut req = reqwest::Client::new()
        .post(format!(
            "{}/v2/publish/http://127.0.0.1:9/elsewhere",
            env.dev.url()
        ))
        .bearer_auth(env.dev.token())
        .header("Upstash-Retries", "0");
    for (k, v) in headers {
        req = req.header(*k, v);
    }
    let resp = req.body(body).send().await.unwrap();
    assert!(resp.status().is_success(), "{resp:?}");
    let v: serde_json::Value = resp.json().await.unwrap();
    v["messageId"].as_str().unwrap().to_owned()
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn a_dlq_entry_the_reconciler_did_not_ask_about_is_never_recorded(pool: PgPool) {
    let env = RelayEnv::start(pool, dev(Faults::default())).await;
    let relay = env.relay_with(config());
    let id = enqueue(&env.pool, 1, 0).await[0];
    // Another deployment on the same QStash account dead-letters a message whose x-outbox-id happens to be ours.
    publish_foreign(
        &env,
        &[("Upstash-Forward-X-Outbox-Id", id.to_string())],
        "{}".into(),
    )
    .await;
    env.dev
        .handle()
        .wait_idle(Duration::from_secs(10))
        .await
        .unwrap();
    assert_eq!(env.dev.handle().dlq_entries().len(), 1);
    // Our event's message is lost; looked up after the horizon, QStash answers the DLQ question with every entry.
    env.dev.handle().set_faults(lossy()).unwrap();
    publish(&relay, 1).await;
    age(&env.pool, id, 66.0).await;
    env.dev
        .handle()
        .set_faults(Faults {
            dlq_message_filter_ignored: true,
            ..lossy()
        })
        .unwrap();
    let r = relay.account(PASS).await.unwrap();
    // The foreign entry is not ours to record: our event is published again, as its own message was lost.
    assert_eq!(
        (r.recorded_from_dlq, r.republished, r.unasked_dlq_entries),
        (0, 1, 1),
        "{r:?}"
    );
    let dead: i64 = sqlx::query_scalar("SELECT count(*) FROM dead_letters")
        .fetch_one(&env.pool)
        .await
        .unwrap();
    assert_eq!(dead, 0);
    assert_eq!(state(&env.pool, id).await, (false, false, 1));
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn a_row_another_reconciler_already_republished_is_not_marked_unaccounted(pool: PgPool) {
    let env = RelayEnv::start(pool, dev(Faults::default())).await;
    let (a, b) = (env.relay_with(config()), env.relay_with(config()));
    let id = enqueue(&env.pool, 1, 0).await[0];
    publish(&a, 1).await;
    // An event dispatched by a relay that did not record message ids, 66 h ago: nothing to ask QStash about, so
    // both relays' reconcilers publish it again at once.
    sqlx::query("UPDATE outbox SET qstash_message_id = NULL, delivered_at = NULL WHERE id = $1")
        .bind(id)
        .execute(&env.pool)
        .await
        .unwrap();
    age(&env.pool, id, 66.0).await;
    // Both read it as a candidate, then queue behind a lock on the row; one publishes it again first, then the
    // other finds it no longer in flight.
    let mut lock = env.pool.begin().await.unwrap();
    sqlx::query("SELECT id FROM outbox WHERE id = $1 FOR UPDATE")
        .bind(id)
        .execute(&mut *lock)
        .await
        .unwrap();
    let (ra, rb, ()) = tokio::join!(a.account(PASS), b.account(PASS), async {
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        loop {
            let waiting: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_stat_activity \
                 WHERE datname = current_database() AND wait_event_type = 'Lock'",
            )
            .fetch_one(&env.pool)
            .await
            .unwrap();
            if waiting >= 2 || std::time::Instant::now() > deadline {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        lock.commit().await.unwrap();
    });
    let (ra, rb) = (ra.unwrap(), rb.unwrap());
    assert_eq!(ra.republished + rb.republished, 1, "{ra:?} {rb:?}");
    assert_eq!(
        ra.unaccounted_dead + rb.unaccounted_dead,
        0,
        "{ra:?} {rb:?}"
    );
    assert_eq!(state(&env.pool, id).await, (false, false, 1));
    assert!(open_dead_letters(&env.pool, id).await.is_empty());
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn a_management_answer_over_the_bound_is_refused_without_reading_it(pool: PgPool) {
    let env = RelayEnv::start(pool, dev(Faults::default())).await;
    let client = QstashClient::new(
        &env.dev.url(),
        SecretString::from(env.dev.token().to_owned()),
        Duration::from_secs(30),
    )
    .unwrap();
    // 100 dead-lettered messages of 400 KB: a DLQ page of about 40 MB, over the client's 32 MiB bound.
    let mut ids = Vec::new();
    for i in 0..100 {
        ids.push(publish_foreign(&env, &[], format!("{i:03}{}", "y".repeat(400_000))).await);
    }
    env.dev
        .handle()
        .wait_idle(Duration::from_secs(60))
        .await
        .unwrap();
    let err = client.dlq_page(&ids, None).await.unwrap_err();
    let text = err.to_string();
    assert!(
        matches!(err, outbox::internals::qstash::ManageError::TooLarge { .. }),
        "{text}"
    );
    assert!(
        text.contains("GET /v2/dlq") && text.contains("bytes"),
        "{text}"
    );
    // Asked for fewer at a time, it answers.
    let page = client.dlq_page(&ids[..10], None).await.unwrap();
    assert_eq!(page.messages.len(), 10);
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn a_dlq_page_over_the_bound_is_asked_for_again_in_halves(pool: PgPool) {
    let env = RelayEnv::start(pool, dev(Faults::default())).await;
    env.sink.set_policy(|_| 500);
    // Four events of ~30 KB whose deliveries fail at once (no QStash retries): four DLQ entries of ~31 KB. The
    // client reads at most 80 KB: the four together do not fit, two do.
    let ids = enqueue(&env.pool, 4, 30_000).await;
    let client = QstashClient::new(
        &env.dev.url(),
        SecretString::from(env.dev.token().to_owned()),
        Duration::from_secs(5),
    )
    .unwrap()
    .with_answer_limit(80_000);
    // Their failure callbacks go nowhere (the callback function is down): only the reconciler can record them.
    let qstash = QstashConfig {
        callback_url: "http://127.0.0.1:9".into(),
        ..env.qstash(0)
    };
    let relay = Relay::new(
        outbox::db::Db::new(env.pool.clone(), outbox::db::Statements::Prepared),
        client,
        config(),
        qstash,
    );
    publish(&relay, 4).await;
    env.dev
        .handle()
        .wait_idle(Duration::from_secs(10))
        .await
        .unwrap();
    let dead_messages = env
        .dev
        .handle()
        .dlq_entries()
        .iter()
        .filter(|e| e.kind == AttemptKind::Destination)
        .count();
    assert_eq!(dead_messages, 4);
    for id in &ids {
        age(&env.pool, *id, 66.0).await;
    }
    let r = relay.account(PASS).await.unwrap();
    assert_eq!(r.recorded_from_dlq, 4, "{r:?}");
    assert!(
        r.lookup_failures >= 1,
        "the first, too large, answer: {r:?}"
    );
    for id in ids {
        assert_eq!(state(&env.pool, id).await, (true, true, 0));
        assert_eq!(open_dead_letters(&env.pool, id).await.len(), 1);
    }
}

/// A relay may dead-letter a copy QStash delivered after all: "no destination" once its subscriber's removal began
/// (the explorer's seed 2), or a retry budget spent on publishes whose answers were lost. When the consumer's dedupe
/// row shows it applied, the accounting pass's sweep resolves the dead letter as "applied" and records the copy
/// delivered, like late delivery evidence: an ordered key blocked on it moves on. A dead letter the consumer
/// refused (no dedupe row) stays open.
#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn a_dead_lettered_copy_the_consumer_applied_is_resolved_by_the_sweep(pool: PgPool) {
    let insert = |sql: &'static str| {
        let pool = pool.clone();
        async move {
            sqlx::query_scalar::<_, i64>(sql)
                .fetch_one(&pool)
                .await
                .unwrap()
        }
    };
    let event = insert(
        "INSERT INTO outbox (topic, partition_key, payload, dispatched_at, delivered_at) \
         VALUES ('audit', 'k', '{}', now(), now()) RETURNING id",
    )
    .await;
    let copy: i64 = sqlx::query_scalar(
        "INSERT INTO outbox (topic, partition_key, payload, subscriber, event_id, dead_lettered_at) \
         VALUES ('audit', 'k', '{}', 'search', $1, now()) RETURNING id",
    )
    .bind(event)
    .fetch_one(&pool)
    .await
    .unwrap();
    let head = insert(
        "INSERT INTO outbox (topic, partition_key, payload, seq, dead_lettered_at) \
         VALUES ('orders', 'c1', '{}', 1, now()) RETURNING id",
    )
    .await;
    let poison = insert(
        "INSERT INTO outbox (topic, partition_key, payload, subscriber, dead_lettered_at) \
         VALUES ('audit', 'p', '{}', 'search', now()) RETURNING id",
    )
    .await;
    // Ids from this test's own rows, formatted into the statement.
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "INSERT INTO outbox (topic, partition_key, payload, seq) VALUES ('orders', 'c1', '{{}}', 2); \
         INSERT INTO outbox_keys (topic, partition_key, done_seq, blocked_at, blocked_id, blocked_reason) \
           VALUES ('orders', 'c1', 0, now(), {head}, 'retry budget exhausted'); \
         INSERT INTO dead_letters (source, natural_id, outbox_id, topic, partition_key, subscriber, error) VALUES \
           ('relay', '{copy}/1', {copy}, 'audit', 'k', 'search', 'no destination: subscriber \"search\" …'), \
           ('relay', '{head}/1', {head}, 'orders', 'c1', '', 'retry budget of 8 attempts exhausted'), \
           ('relay', '{poison}/1', {poison}, 'audit', 'p', 'search', 'poison'); \
         INSERT INTO processed_messages (consumer, message_id) VALUES ('search', '{event}'), ('orders-app', '{head}');"
    )))
    .execute(&pool)
    .await
    .unwrap();

    let db = outbox::db::Db::new(pool.clone(), outbox::db::Statements::Prepared);
    let marked =
        outbox::internals::accounting::sweep_applied(&db, "orders-app", Duration::ZERO, PASS)
            .await
            .unwrap();
    assert_eq!(marked, 2);
    let resolved: Vec<(i64, Option<String>, bool, bool)> = sqlx::query_as(
        "SELECT d.outbox_id, d.resolution, o.delivered_at IS NOT NULL, o.dead_lettered_at IS NOT NULL \
         FROM dead_letters d JOIN outbox o ON o.id = d.outbox_id ORDER BY d.outbox_id",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(
        resolved,
        [
            (copy, Some("applied".to_owned()), true, false),
            (head, Some("applied".to_owned()), true, false),
            (poison, None, false, true),
        ]
    );
    let key: (i64, bool) = sqlx::query_as(
        "SELECT done_seq, blocked_at IS NOT NULL FROM outbox_keys WHERE topic = 'orders'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(key, (1, false), "the key moves on past its applied head");
}

/// QStash forgets a message once a delivery succeeds. A lookup that comes after the consumer applied the event but
/// before anything recorded its outcome (the explorer's seeds 105 and 108: a dead letter "unaccounted" 8 ms after
/// the application) finds no record of it: the reconciler checks the dedupe row before marking the event
/// unaccounted, and leaves it to the sweep.
#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn an_event_applied_just_before_its_lookup_is_not_marked_unaccounted(pool: PgPool) {
    let env = RelayEnv::start(pool, dev(lossy())).await;
    // A sweep that waits longer than this test ages the event: the dedupe row is found by the reconciler only.
    let mut cfg = config();
    cfg.accounting.applied_grace = Duration::from_secs(1000 * 3600);
    let consumer = cfg.accounting.consumer_name.clone();
    let relay = env.relay_with(cfg);
    let id = enqueue(&env.pool, 1, 0).await[0];
    publish(&relay, 1).await;
    // Past the republish window (as in the first test above): a lost event would be an "unaccounted" dead letter.
    age(&env.pool, id, 136.0).await;
    sqlx::query("INSERT INTO processed_messages (consumer, message_id) VALUES ($1, $2)")
        .bind(&consumer)
        .bind(id.to_string())
        .execute(&env.pool)
        .await
        .unwrap();
    let r = relay.account(PASS).await.unwrap();
    assert_eq!((r.republished, r.unaccounted_dead), (0, 0), "{r:?}");
    assert_eq!(state(&env.pool, id).await, (true, false, 0));
    assert!(open_dead_letters(&env.pool, id).await.is_empty());
}
