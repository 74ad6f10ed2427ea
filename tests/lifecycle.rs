//! A subscriber's whole lifecycle, the whole system, through the operator's own commands (`outbox subscribers …`,
//! run here by the CLI's library exactly as the binary runs them): added, removed while its copies are in flight,
//! added again with its history. Every event is applied once per subscriber, in order per key, whatever copies
//! of it the removal, the replay and QStash's retries made (decision record 0070: a subscriber's dedupe key is the
//! event, not the copy).
//!
//! The ledger, the subscribers and the helpers are `tests/fanout.rs`'s.

use std::time::Duration;

use clap::Parser;
use outbox_testkit::db::url_of;
use sqlx::PgPool;

use crate::fanout::{
    B, DEFAULT, ORDERED, UNORDERED, applied, assert_applied_once_in_order, enqueue, scalar,
    stack_with, wait_applied,
};

/// `outbox subscribers …` as the binary parses it.
#[derive(Parser)]
struct Subscribers {
    #[command(subcommand)]
    command: outbox_cli::subscribers::SubscribersCommand,
}

/// Runs `outbox subscribers <args>` against the test's database; its output, or its error as the binary prints it.
async fn outbox_subscribers(pool: &PgPool, args: &[&str]) -> Result<String, String> {
    let url = url_of(pool);
    let mut argv = vec!["subscribers", args[0], "--database-url", url.as_str()];
    argv.extend_from_slice(&args[1..]);
    let cmd = Subscribers::try_parse_from(&argv).map_err(|e| e.to_string())?;
    let mut out = Vec::new();
    outbox_cli::subscribers::run(cmd.command, &mut out)
        .await
        .map_err(|e| format!("{e:#}"))?;
    Ok(String::from_utf8_lossy(&out).into_owned())
}

async fn count(pool: &PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(sqlx::AssertSqlSafe(sql.to_owned()))
        .fetch_one(pool)
        .await
        .unwrap()
}

/// Waits until `sql` counts `want`; false on timeout.
async fn wait_count(pool: &PgPool, sql: &str, want: i64, timeout: Duration) -> bool {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if count(pool, sql).await == want {
            return true;
        }
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// B is down while its copies are published, so they sit at QStash retrying; the operator removes B (its
/// unfinished copies are deleted), B comes back and QStash still delivers what it holds, then the operator adds B
/// again with its history from the first event. The replay copies every event B has no copy of — those it was
/// delivered after its removal among them — and B applies each event exactly once, in order per key, with no dead
/// letter. Before the identity was the event, B applied the unordered ones twice and refused the ordered ones as
/// late (dead letters, blocked lanes).
#[sqlx::test(migrator = "outbox_testkit::MIGRATOR")]
async fn a_subscriber_removed_while_in_flight_and_added_again_with_history_applies_each_event_once(
    pool: PgPool,
) {
    let stack = stack_with(&pool, &[B], true, |o| {
        // QStash's retry delays (12 s, 2.5 min, …) scaled to 0.6 s, 7.5 s, …: B's copies wait at QStash while
        // B is down, and the retry after it is back delivers them.
        o.dev.time_scale = 0.05;
        o.qstash_retries = 5;
    })
    .await;
    assert!(stack.set_subscriber_down(B, true));
    // Three keys of three ordered events and six unordered ones.
    let n = enqueue(&pool, 1, 3, 3, 6, |_| Vec::new()).await;
    assert!(wait_applied(&pool, DEFAULT, n as usize, Duration::from_secs(30)).await);
    // B's copies in flight: every unordered one, and each ordered key's head (with the rest of its run, if the
    // relay batches; the rest of a lane waits for the head's evidence).
    let in_flight = "SELECT count(*) FROM outbox WHERE subscriber = 'b' AND dispatched_at IS NOT NULL \
                     AND delivered_at IS NULL AND dead_lettered_at IS NULL AND (seq IS NULL OR seq = 1)";
    assert!(
        wait_count(&pool, in_flight, 3 + 6, Duration::from_secs(30)).await,
        "B's copies were not all in flight"
    );
    for topic in [ORDERED.name(), UNORDERED.name()] {
        let out = outbox_subscribers(&pool, &["remove", topic, B, "--wait-secs", "10"])
            .await
            .unwrap();
        assert!(out.contains("undelivered copies"), "{out}");
    }
    assert_eq!(
        count(&pool, "SELECT count(*) FROM outbox WHERE subscriber = 'b'").await,
        0
    );
    // Back up: QStash delivers what it still holds for B.
    assert!(stack.set_subscriber_down(B, false));
    assert!(
        wait_applied(&pool, B, 3 + 6, Duration::from_secs(30)).await,
        "QStash did not deliver B's in-flight copies after its removal"
    );
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while !stack.dev.handle().is_idle() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "QStash kept retrying"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let url = stack.subscriber_url(B).unwrap().to_owned();
    // Without --again the operator is told what would and would not be replayed, and nothing changes.
    let err = outbox_subscribers(
        &pool,
        &[
            "add",
            UNORDERED.name(),
            B,
            &url,
            "--from",
            "1",
            "--wait-secs",
            "10",
        ],
    )
    .await
    .unwrap_err();
    assert!(
        err.contains("was removed at")
            && err.contains("replays the 6 retained event(s)")
            && err.contains("--again"),
        "{err}"
    );
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM outbox_subscribers WHERE name = 'b' AND removed_at IS NULL"
        )
        .await,
        0
    );
    for topic in [ORDERED.name(), UNORDERED.name()] {
        let out = outbox_subscribers(
            &pool,
            &[
                "add",
                topic,
                B,
                &url,
                "--from",
                "1",
                "--again",
                "--wait-secs",
                "10",
            ],
        )
        .await
        .unwrap();
        assert!(out.contains("done"), "{out}");
    }
    assert!(
        stack.wait_quiet(Duration::from_secs(60)).await,
        "did not drain after B was added again"
    );
    let all: Vec<i64> = (1..=n).collect();
    assert_applied_once_in_order(&pool, B, &all).await;
    assert_applied_once_in_order(&pool, DEFAULT, &all).await;
    assert_eq!(
        scalar(&pool, "SELECT count(*) FROM dead_letters").await,
        0,
        "{:?}",
        applied(&pool, B).await
    );
    stack.stop().await;
}

/// The ids of the events numbered `from..=to` (their first copies), in order.
async fn ids_of(pool: &PgPool, from: i64, to: i64) -> (i64, i64) {
    sqlx::query_as(
        "SELECT min(id), max(id) FROM outbox WHERE event_id IS NULL AND (payload->>'n')::bigint BETWEEN $1 AND $2",
    )
    .bind(from)
    .bind(to)
    .fetch_one(pool)
    .await
    .unwrap()
}

/// Waits until the dev server holds nothing (no message waiting or retrying).
async fn wait_dev_idle(stack: &outbox_testkit::stack::LocalStack) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while !stack.dev.handle().is_idle() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "QStash kept retrying"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A subscriber's whole lifecycle, three subscribers, ordered and unordered topics, under the dev server's faults
/// (publish errors, dropped publish answers, duplicate deliveries), every step an operator command:
///
/// 1. A is live; B is added while traffic flows and the relay's subscriber cache is warm; C is added with its
///    history from the first event, its replay interrupted after one chunk and resumed with `replay`;
/// 2. B is down while more events are published, removed while its copies are in flight, and back up (QStash
///    still delivers what it holds);
/// 3. more events while B is not a subscriber; B added again with its history from phase 2 on (`--again`);
/// 4. B removed while idle; events it does not get; B added again from now; events it gets.
///
/// Every subscriber applies every event it is owed exactly once, each key in order, and no dead letter is left.
#[sqlx::test(migrator = "outbox_testkit::MIGRATOR")]
async fn a_subscribers_whole_lifecycle_under_faults_applies_each_event_once_in_order(pool: PgPool) {
    use crate::fanout::A;
    use qstash_dev::Faults;
    const C: &str = "c";
    let stack = stack_with(&pool, &[A, B, C], false, |o| {
        o.relay.batching.default_n = 5;
        o.qstash_batch_size = 3;
        o.qstash_retries = 5;
        // QStash's retry delays scaled to 0.6 s, 7.5 s, …: B's copies wait at QStash while it is down.
        o.dev.time_scale = 0.05;
        o.dev.seed = 35;
        o.dev.faults = Faults {
            publish_5xx_rate: 0.1,
            publish_drop_response_rate: 0.1,
            duplicate_delivery_rate: 0.2,
            ..Default::default()
        };
    })
    .await;
    let (url_a, url_b, url_c) = (
        stack.subscriber_url(A).unwrap().to_owned(),
        stack.subscriber_url(B).unwrap().to_owned(),
        stack.subscriber_url(C).unwrap().to_owned(),
    );
    let (ordered, unordered) = (ORDERED, UNORDERED);
    let topics = [ordered.name(), unordered.name()];
    let cli = |args: Vec<String>| {
        let pool = pool.clone();
        async move {
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            outbox_subscribers(&pool, &args).await
        }
    };
    let s = |v: &[&str]| v.iter().map(|s| (*s).to_owned()).collect::<Vec<String>>();
    for t in topics {
        cli(s(&["add", t, A, &url_a])).await.unwrap();
    }
    // Phase 1: traffic, during which B is added (warm relay) and C replays its history.
    let first = enqueue(&pool, 1, 4, 3, 12, |_| Vec::new()).await;
    let mut n = first;
    // Six rounds of eight events a tenth of a second apart: the commands below run while they are written.
    let traffic = tokio::spawn({
        let pool = pool.clone();
        async move {
            let mut written = 0;
            for _ in 0..6 {
                written += enqueue(&pool, first + 1 + written, 2, 2, 4, |_| Vec::new()).await;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            written
        }
    });
    for t in topics {
        cli(s(&["add", t, B, &url_b])).await.unwrap();
        cli(s(&["add", t, C, &url_c, "--from", "1", "--no-replay"]))
            .await
            .unwrap();
        let db = outbox::db::Db::new(pool.clone(), outbox::db::Statements::Unnamed);
        let step = outbox::subscribers::replay_step(&db, t, C, 5)
            .await
            .unwrap()
            .unwrap();
        assert!(
            !step.finished,
            "the replay is interrupted after its first chunk"
        );
    }
    n += traffic.await.unwrap();
    for t in topics {
        let out = cli(s(&["replay", t, C])).await.unwrap();
        assert!(out.contains("done"), "{out}");
    }
    let b_first_life_to = n;
    assert!(
        stack.wait_quiet(Duration::from_secs(120)).await,
        "did not drain after phase 1"
    );
    // Phase 2: B down; its copies go to QStash and wait there; B removed meanwhile, then back.
    assert!(stack.set_subscriber_down(B, true));
    let phase2 = n + 1;
    n += enqueue(&pool, phase2, 4, 2, 8, |_| Vec::new()).await;
    let in_flight = "SELECT count(*) FROM outbox o WHERE subscriber = 'b' AND dispatched_at IS NOT NULL \
                     AND delivered_at IS NULL AND dead_lettered_at IS NULL";
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while count(&pool, in_flight).await < 8 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "B's copies never got in flight"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for t in topics {
        cli(s(&["remove", t, B])).await.unwrap();
    }
    assert!(stack.set_subscriber_down(B, false));
    wait_dev_idle(&stack).await;
    // Phase 3: events B is not subscribed to, then B back with its history from phase 2 on.
    n += enqueue(&pool, n + 1, 4, 2, 8, |_| Vec::new()).await;
    let (from, _) = ids_of(&pool, phase2, phase2).await;
    for t in topics {
        let out = cli(s(&[
            "add",
            t,
            B,
            &url_b,
            "--from",
            &from.to_string(),
            "--again",
        ]))
        .await
        .unwrap();
        assert!(out.contains("done"), "{out}");
    }
    assert!(
        stack.wait_quiet(Duration::from_secs(120)).await,
        "did not drain after B's second life"
    );
    let b_third_life_to = n;
    // Phase 4: B removed while idle; events it does not get; B added from now; events it gets.
    for t in topics {
        cli(s(&["remove", t, B])).await.unwrap();
    }
    let missed_from = n + 1;
    n += enqueue(&pool, missed_from, 4, 1, 4, |_| Vec::new()).await;
    let missed_to = n;
    for t in topics {
        cli(s(&["add", t, B, &url_b])).await.unwrap();
    }
    n += enqueue(&pool, n + 1, 4, 2, 8, |_| Vec::new()).await;
    assert!(
        stack.wait_quiet(Duration::from_secs(120)).await,
        "did not drain at the end"
    );
    let all: Vec<i64> = (1..=n).collect();
    assert_applied_once_in_order(&pool, A, &all).await;
    assert_applied_once_in_order(&pool, C, &all).await;
    assert_applied_once_in_order(&pool, DEFAULT, &all).await;
    // B's first life: the events written after it was added (a producer's statement sees it from then on), each
    // with a copy for it; then everything from phase 2 on but the events written while it was removed in phase 4.
    let first_life: Vec<i64> = sqlx::query_scalar(
        "SELECT DISTINCT (payload->>'n')::bigint FROM outbox WHERE subscriber = 'b' \
         AND (payload->>'n')::bigint <= $1 ORDER BY 1",
    )
    .bind(b_first_life_to)
    .fetch_all(&pool)
    .await
    .unwrap();
    assert!(
        !first_life.is_empty() && first_life.len() < b_first_life_to as usize,
        "B was added while the traffic was written: {first_life:?}"
    );
    let b: Vec<i64> = first_life
        .into_iter()
        .chain((phase2..=n).filter(|e| !(missed_from..=missed_to).contains(e)))
        .collect();
    assert!(b_first_life_to < b_third_life_to && b_third_life_to < missed_from);
    assert_applied_once_in_order(&pool, B, &b).await;
    assert_eq!(
        scalar(&pool, "SELECT count(*) FROM dead_letters").await,
        0,
        "{:?}",
        sqlx::query_as::<_, (String, String)>("SELECT subscriber, error FROM dead_letters")
            .fetch_all(&pool)
            .await
            .unwrap()
    );
    let stats = stack.dev.handle().stats();
    assert!(
        stats.duplicate_deliveries > 0 && stats.injected_publish_errors > 0,
        "the faults must have happened: {stats:?}"
    );
    stack.stop().await;
}
