//! Dead letters against real Postgres: the redrive contract (decision record 0060) on hand-built states — ordered
//! heads unblock their key, middle events are refused unless out of order, pruned events are re-inserted with
//! their id, refusals change nothing — and the CLI: bulk redrive moves exactly the filtered set, bulk operations
//! need a filter and a confirmation, paging, purge, show.

mod common;

use std::collections::HashMap;
use std::time::Duration;

use outbox::config::{QstashConfig, RelayConfig, Vars};
use outbox::db::{Db, Statements};
use outbox::dead_letters::{
    self, Filter, ListQuery, Listing, PurgeError, RedriveError, RedriveOptions, RedriveOrder,
    Source,
};
use outbox::internals::RelaySteps;
use outbox::internals::qstash::QstashClient;
use outbox::relay::Relay;
use outbox_cli::dead_letters::{
    Confirm, DeadLettersCommand, FilterArgs, ListArgs, PurgeArgs, RedriveArgs, ShowArgs, run,
};
use outbox_testkit::db::{dead_letter, event, key_state};
use outbox_testkit::text;
use secrecy::SecretString;
use serde_json::json;
use sqlx::PgPool;

use common::{db, outbox};

const IN_ORDER: RedriveOptions = RedriveOptions {
    out_of_order: false,
};
const OUT_OF_ORDER: RedriveOptions = RedriveOptions { out_of_order: true };

/// A relay whose QStash is never called (claims and message building only).
fn relay(pool: &PgPool) -> Relay {
    // One event per message: the redrive tests look at the head's own claim and message.
    let vars: HashMap<String, String> =
        [("RELAY_DELIVERY_BATCH".to_owned(), "1".to_owned())].into();
    let cfg = RelayConfig::from_vars(&Vars::new(&vars), 3).unwrap();
    let qstash = QstashConfig {
        base_url: "http://127.0.0.1:9".into(),
        retries: 3,
        publish_timeout: Duration::from_secs(1),
        batch_size: 10,
        delivery_timeout: None,
        flow_parallelism: 1,
        replay_parallelism: 4,
        flow_rate: None,
        flow_period: Duration::from_secs(1),
        consumer_url: "http://consumer.test".into(),
        callback_url: "http://callbacks.test".into(),
    };
    let client = QstashClient::new(
        "http://127.0.0.1:9",
        SecretString::from("t".to_owned()),
        Duration::from_secs(1),
    )
    .unwrap();
    Relay::new(
        Db::new(pool.clone(), Statements::Prepared),
        client,
        cfg,
        qstash,
    )
}

/// Every outbox row and dead letter, to prove that refusals and filtered operations touch nothing else.
async fn snapshot(
    pool: &PgPool,
) -> (
    Vec<serde_json::Value>,
    Vec<serde_json::Value>,
    Vec<serde_json::Value>,
) {
    let q = |sql: &'static str| {
        let pool = pool.clone();
        async move {
            sqlx::query_scalar::<_, serde_json::Value>(sql)
                .fetch_all(&pool)
                .await
                .unwrap()
        }
    };
    (
        q("SELECT to_jsonb(o) FROM outbox o ORDER BY id").await,
        q("SELECT to_jsonb(d) FROM dead_letters d ORDER BY id").await,
        q("SELECT to_jsonb(k) FROM outbox_keys k ORDER BY topic, partition_key").await,
    )
}

#[derive(Debug, sqlx::FromRow)]
struct Row {
    seq: Option<i64>,
    attempts: i32,
    redrive_count: i32,
    dispatched: bool,
    dead: bool,
    due: bool,
    leased: bool,
    last_error: Option<String>,
}

async fn row(pool: &PgPool, id: i64) -> Row {
    sqlx::query_as(
        "SELECT seq, attempts, redrive_count, dispatched_at IS NOT NULL AS dispatched, \
                dead_lettered_at IS NOT NULL AS dead, available_at <= now() AS due, \
                (lease_token IS NOT NULL OR locked_until IS NOT NULL) AS leased, last_error \
         FROM outbox WHERE id = $1",
    )
    .bind(id)
    .fetch_one(pool)
    .await
    .unwrap()
}

async fn redriven_at_set(pool: &PgPool, dl: i64) -> bool {
    sqlx::query_scalar("SELECT redriven_at IS NOT NULL FROM dead_letters WHERE id = $1")
        .bind(dl)
        .fetch_one(pool)
        .await
        .unwrap()
}

/// A blocked ordered key: `seq 1` dead (its QStash dead letter), `2` and `3` waiting behind it.
async fn blocked_key(pool: &PgPool, key: &str) -> (i64, i64, i64, i64) {
    let head = event(
        pool,
        "orders",
        key,
        Some(1),
        "attempts = 2, dispatched_at = now(), dead_lettered_at = now(), qstash_message_id = 'msg_1', \
         last_error = 'consumer said 489'",
    )
    .await;
    let e2 = event(pool, "orders", key, Some(2), "").await;
    let e3 = event(pool, "orders", key, Some(3), "").await;
    key_state(
        pool,
        "orders",
        key,
        3,
        0,
        &format!("blocked_at = now(), blocked_id = {head}, blocked_reason = 'dead', lease_token = 5, locked_until = now()"),
    )
    .await;
    let dl = dead_letter(pool, "qstash", Some(head), "").await;
    (head, e2, e3, dl)
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn redriving_a_blocking_head_unblocks_its_key_in_order(pool: PgPool) {
    let (head, e2, e3, dl) = blocked_key(&pool, "k1").await;
    let mut conn = pool.acquire().await.unwrap();
    let r = dead_letters::redrive(&mut conn, dl, IN_ORDER)
        .await
        .unwrap();
    assert_eq!(
        r.outbox_id, head,
        "the event keeps its outbox id (the consumer's dedupe key)"
    );
    assert_eq!(
        r.order,
        RedriveOrder::InOrder {
            seq: 1,
            key_unblocked: true
        }
    );
    assert!(!r.reinserted);
    assert_eq!(r.redrive_count, 1);
    assert_eq!(r.dedup_id, format!("outbox-{head}-r1"));
    let h = row(&pool, head).await;
    assert_eq!(h.seq, Some(1), "a head keeps its sequence");
    assert_eq!((h.attempts, h.redrive_count), (0, 1));
    assert!(!h.dispatched && !h.dead && h.due && !h.leased, "{h:?}");
    assert_eq!(
        h.last_error.as_deref(),
        Some(format!("redriven from dead letter #{dl} (was: consumer said 489)").as_str())
    );
    assert!(redriven_at_set(&pool, dl).await);
    let key: (Option<i64>, Option<i64>, bool, i64) = sqlx::query_as(
        "SELECT blocked_id, lease_token, available_at <= now(), done_seq FROM outbox_keys WHERE partition_key = 'k1'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(
        key,
        (None, None, true, 0),
        "unblocked, unleased, due, nothing skipped"
    );

    // The relay claims the head — and only the head — and publishes it with the fresh dedup id.
    let relay = relay(&pool);
    let claimed = relay.claim().await.unwrap();
    assert_eq!(claimed.iter().map(|c| c.id).collect::<Vec<_>>(), vec![head]);
    let msg = relay.message_for(&claimed[0]);
    assert_eq!(
        msg.options.deduplication_id.as_deref(),
        Some(format!("outbox-{head}-r1").as_str())
    );
    let env = outbox::internals::contract::parse_envelope(msg.body.as_bytes()).unwrap();
    assert_eq!(
        (env.events[0].id.get(), env.events[0].seq),
        (head, Some(1)),
        "the signed envelope carries the head's id and sequence"
    );
    assert!(
        msg.destination.ends_with("/events/orders?contract=2"),
        "{}",
        msg.destination
    );
    assert!(msg.options.callback.is_some(), "ordered: delivery callback");
    for e in [e2, e3] {
        assert_eq!(
            row(&pool, e).await.attempts,
            0,
            "behind the head: untouched"
        );
    }
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn an_event_behind_unfinished_events_of_its_key_waits_its_turn(pool: PgPool) {
    // Seq 2 is dead (say QStash gave up after a republish), the key is still at 0: it is not a middle event.
    let e1 = event(&pool, "orders", "k", Some(1), "").await;
    let e2 = event(&pool, "orders", "k", Some(2), "dead_lettered_at = now()").await;
    key_state(
        &pool,
        "orders",
        "k",
        2,
        0,
        &format!("blocked_at = now(), blocked_id = {e1}"),
    )
    .await;
    let dl = dead_letter(&pool, "qstash", Some(e2), "").await;
    let before =
        sqlx::query_scalar::<_, serde_json::Value>("SELECT to_jsonb(k) FROM outbox_keys k")
            .fetch_one(&pool)
            .await
            .unwrap();
    let mut conn = pool.acquire().await.unwrap();
    let r = dead_letters::redrive(&mut conn, dl, IN_ORDER)
        .await
        .unwrap();
    assert_eq!(
        r.order,
        RedriveOrder::InOrder {
            seq: 2,
            key_unblocked: false
        }
    );
    let after = sqlx::query_scalar::<_, serde_json::Value>("SELECT to_jsonb(k) FROM outbox_keys k")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(before, after, "the key (blocked by #{e1}) is left alone");
    assert_eq!(row(&pool, e2).await.seq, Some(2));
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn a_middle_event_is_refused_unless_out_of_order_and_then_goes_unordered(pool: PgPool) {
    // Key k: seq 2 died and was skipped (skip policy), 3 was delivered: the key is at 3.
    event(
        &pool,
        "orders",
        "k",
        Some(1),
        "dispatched_at = now(), delivered_at = now()",
    )
    .await;
    let mid = event(&pool, "orders", "k", Some(2), "dead_lettered_at = now()").await;
    event(
        &pool,
        "orders",
        "k",
        Some(3),
        "dispatched_at = now(), delivered_at = now()",
    )
    .await;
    key_state(&pool, "orders", "k", 3, 3, "").await;
    let dl = dead_letter(&pool, "relay", Some(mid), "").await;
    // Key g: the key row is gone (every later event finished, the key went idle).
    let gone = event(&pool, "orders", "g", Some(1), "dead_lettered_at = now()").await;
    let dl_gone = dead_letter(&pool, "qstash", Some(gone), "").await;

    let before = snapshot(&pool).await;
    let mut conn = pool.acquire().await.unwrap();
    for (d, needle) in [(dl, "has moved past it"), (dl_gone, "no pending work")] {
        let e = dead_letters::redrive(&mut conn, d, IN_ORDER)
            .await
            .unwrap_err();
        assert!(e.is_out_of_order(), "{e}");
        let msg = e.to_string();
        assert!(
            msg.contains("--out-of-order") && msg.contains(needle),
            "{msg}"
        );
        assert!(msg.contains("AFTER later events"), "{msg}");
    }
    assert_eq!(before, snapshot(&pool).await, "a refusal changes nothing");

    let r = dead_letters::redrive(&mut conn, dl, OUT_OF_ORDER)
        .await
        .unwrap();
    assert_eq!(r.order, RedriveOrder::OutOfOrder { former_seq: 2 });
    let m = row(&pool, mid).await;
    assert_eq!(
        m.seq, None,
        "republished unordered: the consumer's sequence check would refuse seq 2 as late"
    );
    assert!(!m.dead && m.due);
    let done: i64 =
        sqlx::query_scalar("SELECT done_seq FROM outbox_keys WHERE partition_key = 'k'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(done, 3, "the key is not rewound");

    // The unordered claim picks it up; its message carries no sequence and no key evidence.
    let relay = relay(&pool);
    let claimed = relay.claim().await.unwrap();
    assert_eq!(claimed.iter().map(|c| c.id).collect::<Vec<_>>(), vec![mid]);
    let msg = relay.message_for(&claimed[0]);
    let env = outbox::internals::contract::parse_envelope(msg.body.as_bytes()).unwrap();
    assert_eq!(
        (env.events[0].id.get(), env.events[0].seq, env.evidence),
        (mid, None, None),
        "no sequence and no evidence in the signed envelope"
    );
    // A delivery callback, if any, reports an unordered event's outcome (`RELAY_UNORDERED_EVIDENCE`, decision
    // 0015), never evidence for a key: the envelope above names none.
    assert_eq!(
        msg.options.callback.is_some(),
        relay.config().unordered_outcome() == outbox::config::OutcomeSource::Callback
    );
    assert_eq!(
        msg.options.deduplication_id.as_deref(),
        Some(format!("outbox-{mid}-r1").as_str())
    );
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn a_pruned_event_is_reinserted_with_its_id(pool: PgPool) {
    // An unordered event dispatched, pruned, then QStash gave up: the dead letter carries the original headers.
    let id = event(&pool, "audit", "a-1", None, "").await;
    let later = event(&pool, "audit", "a-2", None, "dispatched_at = now()").await;
    let dl = dead_letter(
        &pool,
        "qstash",
        Some(id),
        r#"headers = '{"Traceparent":["00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"],"Upstash-Forward-X-Correlation-Id":["corr-9"],"X-Schema-Version":["2"]}'"#,
    )
    .await;
    // An earlier redrive of the same event (its dead letter is handled): the dedup id must not repeat it.
    dead_letter(
        &pool,
        "relay",
        Some(id),
        "redriven_at = now() - interval '2 days'",
    )
    .await;
    sqlx::query("DELETE FROM outbox WHERE id = $1")
        .bind(id)
        .execute(&pool)
        .await
        .unwrap();

    let mut conn = pool.acquire().await.unwrap();
    let r = dead_letters::redrive(&mut conn, dl, IN_ORDER)
        .await
        .unwrap();
    assert!(r.reinserted);
    assert_eq!(r.outbox_id, id);
    assert_eq!(r.order, RedriveOrder::Unordered);
    assert_eq!(r.redrive_count, 2);
    assert_eq!(r.dedup_id, format!("outbox-{id}-r2"));
    let (topic, key, payload, headers, seq): (
        String,
        String,
        serde_json::Value,
        serde_json::Value,
        Option<i64>,
    ) = sqlx::query_as(
        "SELECT topic, partition_key, payload, headers, seq FROM outbox WHERE id = $1",
    )
    .bind(id)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!((topic.as_str(), key.as_str(), seq), ("audit", "a-1", None));
    assert_eq!(payload, json!({"n": "a-1"}));
    assert_eq!(
        headers,
        json!({"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
               "correlation_id": "corr-9", "schema_version": 2})
    );
    let h = row(&pool, id).await;
    assert!(!h.dead && !h.dispatched && h.due);
    // The identity sequence is untouched: new events still get fresh ids.
    let next = event(&pool, "audit", "a-3", None, "").await;
    assert!(next > later);

    // A pruned ordered event is a middle event: only as unordered.
    let o = event(&pool, "orders", "k", Some(4), "dead_lettered_at = now()").await;
    let dl_o = dead_letter(&pool, "qstash", Some(o), "").await;
    sqlx::query("DELETE FROM outbox WHERE id = $1")
        .bind(o)
        .execute(&pool)
        .await
        .unwrap();
    let e = dead_letters::redrive(&mut conn, dl_o, IN_ORDER)
        .await
        .unwrap_err();
    assert!(
        e.is_out_of_order() && e.to_string().contains("pruned"),
        "{e}"
    );
    let r = dead_letters::redrive(&mut conn, dl_o, OUT_OF_ORDER)
        .await
        .unwrap();
    assert!(r.reinserted);
    assert_eq!(r.order, RedriveOrder::OutOfOrder { former_seq: 4 });
    assert_eq!(row(&pool, o).await.seq, None);

    // Nothing to rebuild from: a body that was not JSON, a callback without an outbox id.
    let gone = event(&pool, "audit", "b", None, "").await;
    let dl_body = dead_letter(
        &pool,
        "qstash",
        Some(gone),
        "payload = NULL, body = '\\x01'::bytea",
    )
    .await;
    sqlx::query("DELETE FROM outbox WHERE id = $1")
        .bind(gone)
        .execute(&pool)
        .await
        .unwrap();
    let dl_raw = dead_letter(
        &pool,
        "qstash",
        None,
        "raw_callback = '\\x00'::bytea, parse_error = 'bad'",
    )
    .await;
    let before = snapshot(&pool).await;
    let e = dead_letters::redrive(&mut conn, dl_body, OUT_OF_ORDER)
        .await
        .unwrap_err();
    assert!(
        matches!(
            e,
            RedriveError::CannotRebuild {
                missing: "JSON payload",
                ..
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("republish by hand"), "{e}");
    let e = dead_letters::redrive(&mut conn, dl_raw, OUT_OF_ORDER)
        .await
        .unwrap_err();
    assert!(
        matches!(
            e,
            RedriveError::NoOutboxId {
                parse_error: true,
                ..
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("cannot be redriven"), "{e}");
    assert_eq!(before, snapshot(&pool).await);
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn refusals_change_nothing(pool: PgPool) {
    let a = event(&pool, "audit", "a", None, "dead_lettered_at = now()").await;
    let dl_redriven = dead_letter(&pool, "relay", Some(a), "redriven_at = now()").await;
    let b = event(
        &pool,
        "orders",
        "b",
        Some(1),
        "dispatched_at = now(), delivered_at = now()",
    )
    .await;
    let dl_resolved = dead_letter(&pool, "qstash", Some(b), "resolved_at = now()").await;
    let dl_delivered = dead_letter(&pool, "qstash", Some(b), "").await;
    let c = event(&pool, "audit", "c", None, "").await; // live again (pending)
    let dl_live = dead_letter(&pool, "relay", Some(c), "").await;
    let before = snapshot(&pool).await;
    let mut conn = pool.acquire().await.unwrap();
    let e = dead_letters::redrive(&mut conn, dl_redriven, IN_ORDER)
        .await
        .unwrap_err();
    assert!(matches!(e, RedriveError::AlreadyRedriven { .. }), "{e}");
    for d in [dl_resolved, dl_delivered] {
        let e = dead_letters::redrive(&mut conn, d, IN_ORDER)
            .await
            .unwrap_err();
        assert!(matches!(e, RedriveError::Delivered { .. }), "{e}");
    }
    let e = dead_letters::redrive(&mut conn, dl_live, IN_ORDER)
        .await
        .unwrap_err();
    assert!(
        matches!(
            e,
            RedriveError::NotDead {
                state: "pending",
                ..
            }
        ),
        "{e}"
    );
    let e = dead_letters::redrive(&mut conn, 999_999, IN_ORDER)
        .await
        .unwrap_err();
    assert!(
        matches!(e, RedriveError::NotFound(outbox::DeadLetterId(999_999))),
        "{e}"
    );
    assert_eq!(before, snapshot(&pool).await);
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn one_redrive_marks_every_unhandled_dead_letter_of_the_event(pool: PgPool) {
    let a = event(&pool, "audit", "a", None, "dead_lettered_at = now()").await;
    let old = dead_letter(
        &pool,
        "relay",
        Some(a),
        "redriven_at = now() - interval '1 day'",
    )
    .await;
    let first = dead_letter(&pool, "relay", Some(a), "").await;
    let second = dead_letter(&pool, "qstash", Some(a), "").await;
    let other = dead_letter(
        &pool,
        "relay",
        Some(event(&pool, "audit", "x", None, "dead_lettered_at = now()").await),
        "",
    )
    .await;
    let mut conn = pool.acquire().await.unwrap();
    let r = dead_letters::redrive(&mut conn, second, IN_ORDER)
        .await
        .unwrap();
    assert_eq!(r.also_marked, vec![first]);
    assert_eq!(r.redrive_count, 1);
    assert!(redriven_at_set(&pool, first).await && redriven_at_set(&pool, second).await);
    assert!(!redriven_at_set(&pool, other).await);
    let old_at: chrono::DateTime<chrono::Utc> =
        sqlx::query_scalar("SELECT redriven_at FROM dead_letters WHERE id = $1")
            .bind(old)
            .fetch_one(&pool)
            .await
            .unwrap();
    assert!(
        old_at < chrono::Utc::now() - chrono::TimeDelta::hours(20),
        "an earlier redrive keeps its time"
    );
}

fn redrive_args(
    pool: &PgPool,
    filter: FilterArgs,
    out_of_order: bool,
    yes: bool,
) -> DeadLettersCommand {
    DeadLettersCommand::Redrive(RedriveArgs {
        db: db(pool),
        id: None,
        filter,
        out_of_order,
        yes,
        json: false,
    })
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn bulk_redrive_moves_exactly_the_filtered_set(pool: PgPool) {
    // Matching (topic audit, source qstash, recorded in the last day): two unordered events and one middle
    // ordered event (topic audit too, key moved past it).
    let m1 = event(
        &pool,
        "audit",
        "m1",
        None,
        "dispatched_at = now(), dead_lettered_at = now()",
    )
    .await;
    let m2 = event(
        &pool,
        "audit",
        "m2",
        None,
        "dispatched_at = now(), dead_lettered_at = now()",
    )
    .await;
    let dl_m1 = dead_letter(&pool, "qstash", Some(m1), "").await;
    let dl_m2 = dead_letter(
        &pool,
        "qstash",
        Some(m2),
        "created_at = now() - interval '3 hours'",
    )
    .await;
    let mid = event(
        &pool,
        "audit",
        "ordered-key",
        Some(1),
        "dead_lettered_at = now()",
    )
    .await;
    key_state(&pool, "audit", "ordered-key", 2, 2, "").await;
    let dl_mid = dead_letter(&pool, "qstash", Some(mid), "").await;
    // Not matching: other source, other topic, too old, already redriven.
    let n1 = event(&pool, "audit", "n1", None, "dead_lettered_at = now()").await;
    let dl_n1 = dead_letter(&pool, "relay", Some(n1), "").await;
    let n2 = event(&pool, "billing", "n2", None, "dead_lettered_at = now()").await;
    let dl_n2 = dead_letter(&pool, "qstash", Some(n2), "").await;
    let n3 = event(&pool, "audit", "n3", None, "dead_lettered_at = now()").await;
    let dl_n3 = dead_letter(
        &pool,
        "qstash",
        Some(n3),
        "created_at = now() - interval '3 days'",
    )
    .await;
    let n4 = event(&pool, "audit", "n4", None, "dead_lettered_at = now()").await;
    dead_letter(&pool, "qstash", Some(n4), "redriven_at = now()").await;

    let filter = FilterArgs {
        topic: Some("audit".into()),
        source: Some(Source::Qstash),
        since: Some(chrono::Utc::now() - chrono::TimeDelta::days(1)),
        ..Default::default()
    };
    // Declined confirmation: nothing happens.
    let before = snapshot(&pool).await;
    let mut out = Vec::new();
    run(
        redrive_args(&pool, filter.clone(), false, false),
        &mut out,
        Confirm::Answer(false),
    )
    .await
    .unwrap();
    assert!(
        text(&out).contains("cancelled: nothing was redriven"),
        "{}",
        text(&out)
    );
    assert_eq!(before, snapshot(&pool).await);

    let mut out = Vec::new();
    run(
        redrive_args(&pool, filter.clone(), false, false),
        &mut out,
        Confirm::Answer(true),
    )
    .await
    .unwrap();
    let t = text(&out);
    assert!(
        t.contains("3 unhandled dead letter(s) match topic=audit source=qstash since="),
        "{t}"
    );
    assert!(
        t.contains(&format!(
            "#{dl_m1} redriven: event #{m1} (audit/m1) dedup id outbox-{m1}-r1"
        )),
        "{t}"
    );
    assert!(t.contains(&format!("#{dl_m2} redriven")), "{t}");
    assert!(
        t.contains(&format!("#{dl_mid} skipped")) && t.contains("--out-of-order"),
        "{t}"
    );
    assert!(t.contains("redriven 2, skipped 1, failed 0"), "{t}");
    for (e, dl) in [(m1, dl_m1), (m2, dl_m2)] {
        let r = row(&pool, e).await;
        assert!(!r.dead && !r.dispatched && r.redrive_count == 1, "{r:?}");
        assert!(redriven_at_set(&pool, dl).await);
    }
    // Nothing outside the set moved.
    for (e, dl) in [(mid, dl_mid), (n1, dl_n1), (n2, dl_n2), (n3, dl_n3)] {
        let r = row(&pool, e).await;
        assert!(r.dead && r.redrive_count == 0, "event #{e}: {r:?}");
        assert!(!redriven_at_set(&pool, dl).await, "dead letter #{dl}");
    }
    assert!(row(&pool, n4).await.dead);

    // Again with --out-of-order: only the skipped middle event is left, and it goes unordered.
    let mut out = Vec::new();
    run(
        redrive_args(&pool, filter, true, true),
        &mut out,
        Confirm::NoTerminal,
    )
    .await
    .unwrap();
    let t = text(&out);
    assert!(t.contains("1 unhandled dead letter(s) match"), "{t}");
    assert!(t.contains("OUT OF ORDER (was seq 1), now unordered"), "{t}");
    let r = row(&pool, mid).await;
    assert!(!r.dead && r.seq.is_none());
    for e in [n1, n2, n3] {
        assert!(row(&pool, e).await.dead);
    }
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn bulk_operations_need_a_filter_and_a_confirmation(pool: PgPool) {
    let a = event(&pool, "audit", "a", None, "dead_lettered_at = now()").await;
    let dl = dead_letter(&pool, "relay", Some(a), "").await;
    let before = snapshot(&pool).await;

    let e = dead_letters::redrive_matching(&pool, &Filter::default(), IN_ORDER, |_| {})
        .await
        .unwrap_err();
    assert!(matches!(e, RedriveError::FilterRequired), "{e}");
    let e = dead_letters::purge(
        &pool,
        &Filter::default(),
        dead_letters::PurgeScope::Any,
        100,
        |_| {},
    )
    .await
    .unwrap_err();
    assert!(matches!(e, PurgeError::FilterRequired), "{e}");

    let mut out = Vec::new();
    let e = run(
        redrive_args(&pool, FilterArgs::default(), false, true),
        &mut out,
        Confirm::Answer(true),
    )
    .await
    .unwrap_err();
    assert!(e.to_string().contains("at least one filter"), "{e}");
    let filter = FilterArgs {
        topic: Some("audit".into()),
        ..Default::default()
    };
    let e = run(
        redrive_args(&pool, filter.clone(), false, false),
        &mut out,
        Confirm::NoTerminal,
    )
    .await
    .unwrap_err();
    assert!(e.to_string().contains("re-run with --yes"), "{e}");
    let e = run(
        DeadLettersCommand::Purge(PurgeArgs {
            db: db(&pool),
            filter: filter.clone(),
            handled_only: false,
            batch: 10,
            yes: false,
            json: false,
        }),
        &mut out,
        Confirm::NoTerminal,
    )
    .await
    .unwrap_err();
    assert!(e.to_string().contains("--yes"), "{e}");
    assert_eq!(before, snapshot(&pool).await);

    // The binary, without a terminal: refuses without --yes (exit 1, says what to do), works with it.
    let o = outbox(&pool, &["dead-letters", "redrive", "--topic", "audit"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1));
    let err = text(&o.stderr);
    assert!(
        err.contains("standard input is not a terminal") && err.contains("--yes"),
        "{err}"
    );
    assert_eq!(before, snapshot(&pool).await);
    let o = outbox(&pool, &["dlq", "redrive", "--topic", "audit", "--yes"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert!(text(&o.stdout).contains("redriven 1, skipped 0, failed 0"));
    assert!(redriven_at_set(&pool, dl).await);
    // A single redrive by id needs no confirmation; a refused one exits 1 with the reason.
    let o = outbox(&pool, &["dlq", "redrive", &dl.to_string()])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1));
    assert!(
        text(&o.stderr).contains("already redriven"),
        "{}",
        text(&o.stderr)
    );
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn list_pages_by_cursor_and_hides_handled_ones(pool: PgPool) {
    let mut ids = Vec::new();
    for i in 0..5 {
        let e = event(
            &pool,
            "audit",
            &format!("k{i}"),
            None,
            "dead_lettered_at = now()",
        )
        .await;
        ids.push(dead_letter(&pool, "relay", Some(e), "").await);
    }
    let handled = dead_letter(
        &pool,
        "qstash",
        None,
        "topic = 'audit', redriven_at = now()",
    )
    .await;
    let other = dead_letter(&pool, "qstash", None, "topic = 'billing'").await;
    let mut conn = pool.acquire().await.unwrap();
    let q = |after, listing| ListQuery {
        filter: Filter {
            topic: Some("audit".into()),
            ..Default::default()
        },
        listing,
        after,
        limit: 2,
    };
    let p1 = dead_letters::list(&mut conn, &q(None, Listing::Unhandled))
        .await
        .unwrap();
    assert_eq!(p1.items.iter().map(|d| d.id).collect::<Vec<_>>(), ids[0..2]);
    assert_eq!(p1.next_after, Some(ids[1].into()));
    let p2 = dead_letters::list(&mut conn, &q(p1.next_after, Listing::Unhandled))
        .await
        .unwrap();
    assert_eq!(p2.items.iter().map(|d| d.id).collect::<Vec<_>>(), ids[2..4]);
    let p3 = dead_letters::list(&mut conn, &q(p2.next_after, Listing::Unhandled))
        .await
        .unwrap();
    assert_eq!(p3.items.iter().map(|d| d.id).collect::<Vec<_>>(), ids[4..5]);
    assert_eq!(p3.next_after, None, "last page");
    let all = dead_letters::list(&mut conn, &q(p2.next_after, Listing::All))
        .await
        .unwrap();
    assert_eq!(
        all.items.iter().map(|d| d.id).collect::<Vec<_>>(),
        vec![ids[4], handled]
    );
    assert_eq!(all.items[1].state(), "redriven");
    assert!(!all.items.iter().any(|d| d.id == other));

    // The CLI prints the table and the command for the next page.
    let mut out = Vec::new();
    run(
        DeadLettersCommand::List(ListArgs {
            db: db(&pool),
            filter: FilterArgs {
                topic: Some("audit".into()),
                ..Default::default()
            },
            include_redriven: false,
            after: None,
            limit: 2,
            json: false,
        }),
        &mut out,
        Confirm::NoTerminal,
    )
    .await
    .unwrap();
    let t = text(&out);
    assert!(
        t.contains(&format!(
            "more: outbox dead-letters list --after {} --limit 2 --topic audit",
            ids[1]
        )),
        "{t}"
    );
    assert!(t.contains("unhandled"), "{t}");
    assert_eq!(
        t.lines().filter(|l| l.contains(" relay ")).count(),
        2,
        "{t}"
    );
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn purge_deletes_only_the_filtered_set_and_keeps_blocking_heads(pool: PgPool) {
    let (head, _, _, dl_head) = blocked_key(&pool, "k1").await;
    let a = event(&pool, "orders", "u", None, "dead_lettered_at = now()").await;
    let dl_a = dead_letter(&pool, "qstash", Some(a), "").await;
    let dl_handled = dead_letter(
        &pool,
        "relay",
        None,
        "topic = 'orders', redriven_at = now()",
    )
    .await;
    let dl_other = dead_letter(&pool, "qstash", None, "topic = 'audit'").await;
    let before_outbox = snapshot(&pool).await.0;

    let purge = |handled_only, yes| {
        DeadLettersCommand::Purge(PurgeArgs {
            db: db(&pool),
            filter: FilterArgs {
                topic: Some("orders".into()),
                ..Default::default()
            },
            handled_only,
            batch: 1,
            yes,
            json: false,
        })
    };
    let mut out = Vec::new();
    run(purge(true, true), &mut out, Confirm::NoTerminal)
        .await
        .unwrap();
    let remaining = || async {
        sqlx::query_scalar::<_, i64>("SELECT id FROM dead_letters ORDER BY id")
            .fetch_all(&pool)
            .await
            .unwrap()
    };
    assert_eq!(
        remaining().await,
        vec![dl_head, dl_a, dl_other],
        "--handled-only: only the redriven one"
    );

    let mut out = Vec::new();
    run(purge(false, false), &mut out, Confirm::Answer(true))
        .await
        .unwrap();
    let t = text(&out);
    assert!(
        t.contains("1 dead letter(s) match topic=orders. Their outbox rows are not touched."),
        "{t}"
    );
    assert!(t.contains("deleted 1/1"), "{t}");
    assert!(t.contains("Kept 1 whose events block ordered keys"), "{t}");
    assert_eq!(remaining().await, vec![dl_head, dl_other]);
    assert_eq!(
        before_outbox,
        snapshot(&pool).await.0,
        "purge never touches the outbox"
    );
    assert!(row(&pool, head).await.dead && row(&pool, a).await.dead);
    let _ = dl_handled;
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn show_prints_payload_error_attempts_response_and_the_event_state(pool: PgPool) {
    let (head, _, _, dl) = blocked_key(&pool, "k1").await;
    sqlx::query("UPDATE dead_letters SET response_body = '{\"error\":\"amount is negative\"}', attempts = 6 WHERE id = $1")
        .bind(dl)
        .execute(&pool)
        .await
        .unwrap();
    let mut out = Vec::new();
    run(
        DeadLettersCommand::Show(ShowArgs {
            db: db(&pool),
            id: dl.into(),
            json: false,
        }),
        &mut out,
        Confirm::NoTerminal,
    )
    .await
    .unwrap();
    let t = text(&out);
    for needle in [
        format!("dead letter #{dl}  (unhandled)"),
        "QStash gave up delivering".into(),
        "topic / key   orders / k1  (seq 1)".into(),
        "attempts      6".into(),
        "status        489".into(),
        "error         boom".into(),
        "response      {\"error\":\"amount is negative\"}".into(),
        "\"n\": \"k1\"".into(),
        format!("event #{head} now: dead, 2 attempt(s), redriven 0 time(s), seq 1"),
        format!("key: done up to seq 0, blocked by event #{head}"),
        format!("redrive: outbox dead-letters redrive {dl}"),
    ] {
        assert!(t.contains(&needle), "show lacks {needle:?}:\n{t}");
    }
    let mut out = Vec::new();
    run(
        DeadLettersCommand::Show(ShowArgs {
            db: db(&pool),
            id: dl.into(),
            json: true,
        }),
        &mut out,
        Confirm::NoTerminal,
    )
    .await
    .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&out).unwrap();
    assert_eq!(v["dead_letter"]["payload"], json!({"n": "k1"}));
    assert_eq!(v["event"]["key_blocked_by"], head);
    let e = run(
        DeadLettersCommand::Show(ShowArgs {
            db: db(&pool),
            id: 424242.into(),
            json: false,
        }),
        &mut Vec::new(),
        Confirm::NoTerminal,
    )
    .await
    .unwrap_err();
    assert!(e.to_string().contains("does not exist"), "{e}");
}

/// Dead copies of three events on one topic: shipping's three and billing's first two, with a relay dead letter
/// each. Returns the dead letters (billing's, shipping's).
async fn two_subscribers_dead_letters(pool: &PgPool) -> (Vec<i64>, Vec<i64>) {
    let (mut billing, mut shipping) = (Vec::new(), Vec::new());
    for i in 0..3 {
        let key = format!("k{i}");
        let b = event(
            pool,
            "orders",
            &key,
            None,
            "subscriber = 'billing', dead_lettered_at = now()",
        )
        .await;
        if i < 2 {
            billing.push(dead_letter(pool, "relay", Some(b), "subscriber = 'billing'").await);
        }
        let s = event(
            pool,
            "orders",
            &key,
            None,
            &format!("subscriber = 'shipping', event_id = {b}, dead_lettered_at = now()"),
        )
        .await;
        shipping.push(dead_letter(pool, "relay", Some(s), "subscriber = 'shipping'").await);
    }
    (billing, shipping)
}

/// Every outbox row and dead letter of `subscriber`.
async fn rows_of(pool: &PgPool, subscriber: &str) -> Vec<serde_json::Value> {
    sqlx::query_scalar(
        "SELECT to_jsonb(o) FROM outbox o WHERE subscriber = $1 \
         UNION ALL SELECT to_jsonb(d) FROM dead_letters d WHERE subscriber = $1",
    )
    .bind(subscriber)
    .fetch_all(pool)
    .await
    .unwrap()
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn a_subscriber_filter_reaches_the_count_the_action_and_the_next_page(pool: PgPool) {
    let (billing, shipping) = two_subscribers_dead_letters(&pool).await;
    let billing_before = rows_of(&pool, "billing").await;
    let only_shipping = FilterArgs {
        subscriber: Some("shipping".into()),
        ..Default::default()
    };

    // The list: shipping's only, with the subscriber shown, and the next page's command keeps the filter.
    let mut out = Vec::new();
    run(
        DeadLettersCommand::List(ListArgs {
            db: db(&pool),
            filter: only_shipping.clone(),
            include_redriven: false,
            after: None,
            limit: 2,
            json: false,
        }),
        &mut out,
        Confirm::NoTerminal,
    )
    .await
    .unwrap();
    let t = text(&out);
    assert_eq!(t.matches(" shipping ").count(), 2, "{t}");
    assert!(!t.contains(" billing "), "{t}");
    assert!(
        t.contains(&format!(
            "more: outbox dead-letters list --after {} --limit 2 --subscriber shipping",
            shipping[1]
        )),
        "{t}"
    );

    // A single redrive by id cannot be combined with a filter the id would ignore: refused, nothing changes.
    let before = snapshot(&pool).await;
    let o = outbox(
        &pool,
        &[
            "dlq",
            "redrive",
            &billing[0].to_string(),
            "--subscriber",
            "shipping",
        ],
    )
    .output()
    .unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", text(&o.stderr));
    assert!(
        text(&o.stderr).contains("--subscriber"),
        "{}",
        text(&o.stderr)
    );
    assert_eq!(before, snapshot(&pool).await);

    // Bulk redrive: the count and the action are shipping's.
    let mut out = Vec::new();
    run(
        redrive_args(&pool, only_shipping.clone(), false, false),
        &mut out,
        Confirm::Answer(true),
    )
    .await
    .unwrap();
    let t = text(&out);
    assert!(
        t.contains("3 unhandled dead letter(s) match subscriber=shipping"),
        "{t}"
    );
    assert!(t.contains("redriven 3, skipped 0, failed 0"), "{t}");
    for dl in &shipping {
        assert!(redriven_at_set(&pool, *dl).await);
    }
    assert_eq!(
        billing_before,
        rows_of(&pool, "billing").await,
        "billing's untouched"
    );

    // Purge through the binary, the same way.
    let o = outbox(
        &pool,
        &["dlq", "purge", "--subscriber", "shipping", "--yes"],
    )
    .output()
    .unwrap();
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert!(
        text(&o.stdout).contains("purged 3 dead letter(s)"),
        "{}",
        text(&o.stdout)
    );
    let left: Vec<i64> = sqlx::query_scalar("SELECT id FROM dead_letters ORDER BY id")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(left, billing);
    assert_eq!(
        billing_before,
        rows_of(&pool, "billing").await,
        "billing's untouched"
    );
}
