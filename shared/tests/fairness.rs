//! Fairness between tenants (`outbox::fairness`, decision record 0076) at the claim: each key with waiting events
//! gets its share of a claim, the cursor reaches every key, a paused key waits (new events too, ordered heads too)
//! and resumes in order, bad keys are refused at enqueue, and a database from before fairness keys upgrades with
//! its events in flight and claims them as before.

use std::collections::{BTreeMap, BTreeSet};

use outbox::db::Statements;
use outbox::internals::claim::{ClaimStatements, ClaimedEvent};
use outbox::{EnqueueError, NewEvent, Producer, Topic};
use sqlx::PgPool;

const AUDIT: Topic = Topic::unordered("audit");
const ORDERS: Topic = Topic::ordered("orders");

/// `n` events of one fairness key (`None`: no key), in one transaction.
async fn flood(pool: &PgPool, topic: &Topic, fairness: Option<&str>, n: usize) -> Vec<i64> {
    let events: Vec<NewEvent> = (0..n)
        .map(|i| {
            let e = NewEvent::from_json(topic, format!("k{}", i % 7), format!("{{\"i\":{i}}}"));
            match fairness {
                Some(k) => e.fairness_key(k),
                None => e,
            }
        })
        .collect();
    let mut conn = pool.acquire().await.unwrap();
    Producer::default()
        .enqueue_batch(&mut conn, &events)
        .await
        .unwrap()
        .iter()
        .map(|e| e.id.get())
        .collect()
}

async fn claim(pool: &PgPool, claims: &ClaimStatements) -> Vec<ClaimedEvent> {
    let mut conn = pool.acquire().await.unwrap();
    claims.claim_unordered(&mut conn, 60.0).await.unwrap()
}

fn per_key(claimed: &[ClaimedEvent]) -> BTreeMap<String, usize> {
    let mut m = BTreeMap::new();
    for e in claimed {
        *m.entry(e.fairness_key.clone()).or_insert(0) += 1;
    }
    m
}

fn fair(batch: u32) -> ClaimStatements {
    ClaimStatements::new(batch, Statements::Prepared).with_fair_claims(true)
}

/// Ten tenants write ten events each after tenant A wrote 1,000: the fair claim of 100 gives each of them
/// `100 / 11 = 9` rows (A too) and the one left to the oldest; the unfair claim gives all 100 to A.
#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn a_flood_of_one_key_takes_its_share_of_a_claim_not_all_of_it(pool: PgPool) {
    flood(&pool, &AUDIT, Some("A"), 1000).await;
    let others: Vec<String> = (b'B'..=b'K').map(|c| (c as char).to_string()).collect();
    for k in &others {
        flood(&pool, &AUDIT, Some(k), 10).await;
    }
    let claimed = claim(&pool, &fair(100)).await;
    assert_eq!(claimed.len(), 100);
    let got = per_key(&claimed);
    let share = 100 / 11;
    for k in &others {
        assert!(got.get(k).copied().unwrap_or(0) >= share, "{k}: {got:?}");
    }
    assert!(got["A"] >= share && got["A"] <= share + 1, "{got:?}");

    // The same backlog claimed oldest first (RELAY_FAIR_CLAIMS=false): A's flood fills the claim.
    sqlx::query("UPDATE outbox SET available_at = now(), locked_until = NULL, lease_token = NULL")
        .execute(&pool)
        .await
        .unwrap();
    let unfair = claim(&pool, &ClaimStatements::new(100, Statements::Prepared)).await;
    assert_eq!(per_key(&unfair), BTreeMap::from([("A".to_owned(), 100)]));
}

/// No capacity is left unused: when only a flood waits, the fair claim takes a full batch of it; events without
/// a key are a key of their own.
#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn what_other_keys_leave_unused_goes_to_whoever_waits(pool: PgPool) {
    flood(&pool, &AUDIT, Some("A"), 300).await;
    flood(&pool, &AUDIT, None, 3).await;
    let claimed = claim(&pool, &fair(100)).await;
    assert_eq!(
        per_key(&claimed),
        BTreeMap::from([("".to_owned(), 3), ("A".to_owned(), 97)])
    );
    // Within a key, oldest first.
    let a: Vec<i64> = claimed
        .iter()
        .filter(|e| e.fairness_key == "A")
        .map(|e| e.id.get())
        .collect();
    let mut sorted = a.clone();
    sorted.sort();
    assert_eq!(a.len(), 97);
    assert_eq!(sorted, (sorted[0]..sorted[0] + 97).collect::<Vec<_>>());
}

/// More keys than one claim walks (outbox::fairness::KEYS_PER_CLAIM = 100): the cursor moves on, and two
/// claims reach all 150 keys.
#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn the_cursor_reaches_every_key_when_there_are_more_than_one_claim_walks(pool: PgPool) {
    for t in 0..150 {
        flood(&pool, &AUDIT, Some(&format!("t{t:03}")), 2).await;
    }
    let claims = fair(100);
    let first = claim(&pool, &claims).await;
    let second = claim(&pool, &claims).await;
    let seen: BTreeSet<String> = first
        .iter()
        .chain(&second)
        .map(|e| e.fairness_key.clone())
        .collect();
    assert_eq!(
        seen.len(),
        150,
        "keys reached in two claims: {}",
        seen.len()
    );
    // The first claim walked t000…t099, one row each: the keys after them are the second claim's.
    assert_eq!(per_key(&first).len(), 100);
    assert!(second.iter().any(|e| e.fairness_key.as_str() >= "t100"));
}

/// A paused key's waiting events, the ones written while it is paused and its ordered heads are not claimed;
/// resumed, they are claimed oldest first, and an ordered key goes on in sequence.
#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn a_paused_key_waits_and_resumes_in_order(pool: PgPool) {
    let before = flood(&pool, &AUDIT, Some("noisy"), 5).await;
    let ordered = flood(&pool, &ORDERS, Some("noisy"), 3).await;
    flood(&pool, &AUDIT, Some("quiet"), 2).await;
    let mut conn = pool.acquire().await.unwrap();
    let paused = outbox::fairness::pause(&mut conn, "noisy", "test", Some("import"))
        .await
        .unwrap();
    assert!(paused.changed);
    assert_eq!(paused.events, 5, "unordered events moved to wait");
    let during = flood(&pool, &AUDIT, Some("noisy"), 3).await;

    let claims = fair(100);
    let claimed = claim(&pool, &claims).await;
    assert_eq!(per_key(&claimed), BTreeMap::from([("quiet".to_owned(), 2)]));
    let heads = claims.claim_ordered(&mut conn, 60.0).await.unwrap();
    assert!(
        heads.is_empty(),
        "a paused key's ordered head was claimed: {heads:?}"
    );
    // The unfair claim respects the pause too (it never reaches rows at 'infinity').
    let unfair = claim(&pool, &ClaimStatements::new(100, Statements::Prepared)).await;
    assert!(unfair.is_empty(), "{unfair:?}");
    let listed = outbox::fairness::backlog(&mut conn, None, 10)
        .await
        .unwrap();
    let noisy = listed.iter().find(|b| b.fairness_key == "noisy").unwrap();
    assert_eq!(
        (noisy.pending, noisy.paused_reason.as_deref()),
        (11, Some("import"))
    );
    assert_eq!(noisy.paused_by.as_deref(), Some("test"));

    let resumed = outbox::fairness::resume(&mut conn, "noisy").await.unwrap();
    assert_eq!((resumed.changed, resumed.events), (true, 8));
    let claimed = claim(&pool, &claims).await;
    let ids: Vec<i64> = claimed.iter().map(|e| e.id.get()).collect();
    let mut sorted = ids.clone();
    sorted.sort();
    let expected: Vec<i64> = before.iter().chain(&during).copied().collect();
    assert_eq!(sorted, expected);
    // The ordered keys' heads are claimed again (each key was pushed back a second by the paused claim).
    sqlx::query("UPDATE outbox_keys SET available_at = now()")
        .execute(&pool)
        .await
        .unwrap();
    let heads = claims.claim_ordered(&mut conn, 60.0).await.unwrap();
    // Three keys (k0, k1, k2), each at its first event.
    let mut got: Vec<(i64, Option<i64>)> = heads.iter().map(|e| (e.id.get(), e.seq)).collect();
    got.sort();
    assert_eq!(
        got,
        ordered.iter().map(|&id| (id, Some(1))).collect::<Vec<_>>()
    );
    // Pausing twice or resuming a key that is not paused changes nothing, and says so.
    assert!(
        !outbox::fairness::resume(&mut conn, "noisy")
            .await
            .unwrap()
            .changed
    );
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn a_bad_fairness_key_is_refused_at_enqueue_with_the_reason_and_nothing_is_written(
    pool: PgPool,
) {
    let mut conn = pool.acquire().await.unwrap();
    for (key, says) in [
        ("", "is empty"),
        (&*"t".repeat(65), "longer than 64"),
        ("acme corp", "may only contain"),
        ("tenant\n1", "may only contain"),
    ] {
        let good = NewEvent::from_json(&AUDIT, "k", "{}").fairness_key("ok");
        let bad = NewEvent::from_json(&AUDIT, "k", "{}").fairness_key(key);
        let e = Producer::default()
            .enqueue_batch(&mut conn, &[good, bad])
            .await
            .unwrap_err();
        assert!(
            matches!(e, EnqueueError::Invalid { index: Some(1), .. }),
            "{e:?}"
        );
        let text = e.to_string();
        assert!(
            text.contains("fairness key") && text.contains(says),
            "{text}"
        );
    }
    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(n, 0);
    let e = outbox::fairness::pause(&mut conn, "a b", "test", None)
        .await
        .unwrap_err();
    assert!(e.to_string().contains("may only contain"), "{e}");
}

/// A database from before fairness keys, with events in flight (pending, leased, dispatched, an ordered key
/// mid-way), upgrades in place: every row reads as "no key", the fair claim takes exactly what the claim of before
/// takes, in the same order, and the leased row's lease still holds.
#[sqlx::test(migrations = false)]
async fn an_outbox_from_before_fairness_keys_upgrades_with_events_in_flight_unchanged(
    pool: PgPool,
) {
    const FAIRNESS: i64 = 20261207000301;
    outbox_testkit::db::library_migrations(|v| v < FAIRNESS)
        .run(&pool)
        .await
        .unwrap();
    sqlx::raw_sql(
        "INSERT INTO outbox (topic, partition_key, payload) \
           SELECT 'audit', 'k' || (g % 5), jsonb_build_object('g', g) FROM generate_series(1, 60) g; \
         UPDATE outbox SET dispatched_at = now() WHERE id <= 10; \
         UPDATE outbox SET attempts = 1, lease_token = 5, locked_until = now() + interval '1 minute', \
                available_at = now() + interval '1 minute' WHERE id BETWEEN 11 AND 15; \
         INSERT INTO outbox (topic, partition_key, seq, payload) \
           SELECT 'orders', 'c1', s, '{}'::jsonb FROM generate_series(1, 3) s; \
         INSERT INTO outbox_sequences (topic, partition_key, last_seq) VALUES ('orders', 'c1', 3); \
         INSERT INTO outbox_keys (topic, partition_key, done_seq) VALUES ('orders', 'c1', 1);",
    )
    .execute(&pool)
    .await
    .unwrap();
    outbox::MIGRATOR.run(&pool).await.unwrap();
    let keys: Vec<String> = sqlx::query_scalar("SELECT DISTINCT fairness_key FROM outbox")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(keys, [""]);
    // A producer of the previous version (no fairness_key column in its INSERT) still writes, as "no key".
    sqlx::query("INSERT INTO outbox (topic, partition_key, payload) VALUES ('audit', 'old', '{}')")
        .execute(&pool)
        .await
        .unwrap();

    let claimed = claim(&pool, &fair(500)).await;
    let ids: Vec<i64> = claimed.iter().map(|e| e.id.get()).collect();
    assert_eq!(
        ids,
        (16..=60).chain([64]).collect::<Vec<_>>(),
        "oldest first, as before"
    );
    let mut conn = pool.acquire().await.unwrap();
    let heads = fair(500).claim_ordered(&mut conn, 60.0).await.unwrap();
    assert_eq!(heads.iter().map(|e| e.seq).collect::<Vec<_>>(), [Some(2)]);
    let still_leased: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM outbox WHERE id BETWEEN 11 AND 15 AND lease_token = 5",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(still_leased, 5);
}

/// A subscriber added with its history replayed gets every copy under the event's fairness key, live copies too:
/// a paused tenant's replayed copies wait, and its lanes and limits apply to them.
#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn replayed_and_live_copies_keep_the_events_fairness_key(pool: PgPool) {
    use outbox::subscribers::{self, Start};
    let db = outbox::db::Db::new(pool.clone(), Statements::Prepared);
    let first = flood(&pool, &AUDIT, Some("acme"), 3).await[0];
    subscribers::add(
        &db,
        "audit",
        "billing",
        Some("http://127.0.0.1:9/"),
        Start::FromId(first),
        std::time::Duration::from_secs(5),
    )
    .await
    .unwrap();
    while let Some(p) = subscribers::replay_step(&db, "audit", "billing", 100)
        .await
        .unwrap()
    {
        if p.finished {
            break;
        }
    }
    flood(&pool, &AUDIT, Some("acme"), 1).await;
    let keys: Vec<(String, String)> = sqlx::query_as(
        "SELECT subscriber, fairness_key FROM outbox WHERE subscriber = 'billing' ORDER BY id",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(keys.len(), 4, "{keys:?}");
    assert!(keys.iter().all(|(_, k)| k == "acme"), "{keys:?}");
}
