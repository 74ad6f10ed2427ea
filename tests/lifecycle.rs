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
