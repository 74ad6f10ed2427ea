//! The relay's outage and settings, as the operator sees them: `outbox status` shows a recorded QStash outage
//! (decision record 0012), and `outbox relay` refuses an invocation too short for one lease plus the margin
//! instead of spinning (issue 13.5).

use std::time::{Duration, Instant};

use outbox_cli::status::{StatusArgs, run};
use outbox_cli::util::DbArgs;
use outbox_testkit::db::url_of;
use outbox_testkit::text;
use sqlx::PgPool;

async fn table(pool: &PgPool, json: bool) -> String {
    let mut out = Vec::new();
    run(
        StatusArgs {
            db: DbArgs {
                database_url: url_of(pool),
            },
            json,
            warn_age_secs: 300,
        },
        &mut out,
    )
    .await
    .unwrap();
    text(&out)
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn status_shows_the_qstash_outage(pool: PgPool) {
    let t = table(&pool, false).await;
    assert!(t.contains("QStash outage"), "{t}");
    assert!(
        t.contains(
            "QStash outage (relays publish nothing until the next probe gets through)\n  none"
        ),
        "{t}"
    );

    sqlx::query(
        "UPDATE outbox_relay_outage SET since = now() - interval '5 minutes', failures = 4, \
         last_error = 'connection failed: Connection refused', next_probe_at = now() + interval '40 seconds'",
    )
    .execute(&pool)
    .await
    .unwrap();
    let t = table(&pool, false).await;
    for needle in [
        "(5m 00s ago)",
        "failed cycles/probes   4",
        "next probe             in 3",
        "last error             connection failed: Connection refused",
    ] {
        assert!(t.contains(needle), "table lacks {needle:?}:\n{t}");
    }
    let j: serde_json::Value = serde_json::from_str(&table(&pool, true).await).unwrap();
    assert_eq!(j["qstash_outage"]["failures"], 4);
    assert!(j["qstash_outage"]["since"].is_string(), "{j}");
    assert!(j["qstash_outage"]["next_probe_at"].is_string(), "{j}");
}

/// Issue 13.5: `outbox relay --invocation-secs 10` with the default 15 s lease used to claim nothing and start a
/// new invocation every few milliseconds, logging success each time. Now it exits with an error naming both.
#[test]
fn relay_refuses_an_invocation_shorter_than_a_lease_plus_the_margin() {
    let bin = env!("CARGO_BIN_EXE_outbox");
    let mut child = std::process::Command::new(bin)
        .args(["relay", "--invocation-secs", "10"])
        .env_clear()
        // The pool connects lazily: the refusal comes before any connection.
        .env("DATABASE_URL", "postgres://postgres@127.0.0.1:1/none")
        .env("QSTASH_TOKEN", "t")
        .env("QSTASH_URL", "http://127.0.0.1:1")
        .env("CONSUMER_URL", "http://127.0.0.1:1")
        .env("CALLBACK_URL", "http://127.0.0.1:1")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // A hang here is the old spin: stop it rather than hang the suite.
    let started = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if started.elapsed() > Duration::from_secs(60) {
            child.kill().unwrap();
            panic!("`outbox relay --invocation-secs 10` kept running instead of refusing");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let out = child.wait_with_output().unwrap();
    let err = text(&out.stderr);
    assert!(!status.success(), "{err}");
    for needle in [
        "--invocation-secs of 10 s",
        "RELAY_LEASE_SECS",
        "15 s",
        "3000 ms",
    ] {
        assert!(err.contains(needle), "{needle:?} missing from: {err}");
    }
}
