//! The relay's outage and settings, as the operator sees them: `outbox status` shows a recorded QStash outage
//! (decision record 0012), `outbox relay --until-empty` rides one out, and `outbox relay` refuses an invocation too
//! short for one lease plus the margin instead of spinning.

mod common;

use std::time::{Duration, Instant};

use outbox_cli::status::{StatusArgs, run};
use outbox_testkit::db::url_of;
use outbox_testkit::text;
use sqlx::PgPool;

use common::db;

async fn table(pool: &PgPool, json: bool) -> String {
    let mut out = Vec::new();
    run(
        StatusArgs {
            db: db(pool),
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

/// `outbox relay --invocation-secs 10` with the default 15 s lease would claim nothing and start a new invocation
/// every few milliseconds, logging success each time: it exits with an error naming both values instead.
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

/// `outbox relay --until-empty` started during a QStash outage whose next probe comes before its timeout: it used
/// to exit at once with `"stopped":"outage"` and everything still pending. Now it waits for the probe, drains and
/// exits because the outbox is empty.
#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn relay_until_empty_rides_out_a_qstash_outage_instead_of_exiting(pool: PgPool) {
    const TOKEN: &str = "cli-outage-token";
    let sink = outbox_testkit::sink::Sink::start(pool.clone()).await;
    let dev = qstash_dev::DevServer::start(qstash_dev::Config {
        token: TOKEN.into(),
        ..qstash_dev::Config::for_tests(0.0005)
    })
    .await
    .unwrap();
    let audit = outbox::Topic::unordered("audit");
    let events: Vec<outbox::NewEvent> = (0..5)
        .map(|i| {
            outbox::NewEvent::new(&audit, format!("a-{i}"), &serde_json::json!({"i": i})).unwrap()
        })
        .collect();
    let mut tx = pool.begin().await.unwrap();
    let ids: Vec<i64> = outbox::enqueue_batch(&mut tx, &events)
        .await
        .unwrap()
        .iter()
        .map(|e| e.id.get())
        .collect();
    tx.commit().await.unwrap();
    // Another relay recorded an outage; its next probe is two seconds away.
    sqlx::query(
        "UPDATE outbox_relay_outage SET since = now(), failures = 2, last_error = 'QStash answered 503', \
         next_probe_at = now() + interval '2 seconds'",
    )
    .execute(&pool)
    .await
    .unwrap();

    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_outbox"))
        .args(["relay", "--until-empty", "--timeout-secs", "60"])
        .env_clear()
        .env("DATABASE_URL", url_of(&pool))
        .env("QSTASH_URL", dev.url())
        .env("QSTASH_TOKEN", TOKEN)
        .env("CONSUMER_URL", &sink.url)
        .env("CALLBACK_URL", &sink.url)
        .env("RELAY_LEASE_SECS", "1")
        .env("RELAY_POLL_INTERVAL_MS", "50")
        // One event per message: the sink records one delivery per event.
        .env("RELAY_DELIVERY_BATCH", "1")
        .env("RUST_LOG", "warn")
        .stdin(std::process::Stdio::null())
        .output()
        .await
        .unwrap();
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", text(&out.stderr));
    let line: serde_json::Value = stdout
        .lines()
        .rev()
        .find_map(|l| serde_json::from_str(l).ok())
        .unwrap_or_else(|| panic!("no JSON summary in: {stdout}"));
    let s = &line["summary"];
    assert_eq!(s["stopped"], "empty", "{line}");
    assert_eq!(s["qstash_outage"], false, "{line}");
    assert_eq!(s["dispatched"], ids.len(), "{line}");
    let pending: i64 =
        sqlx::query_scalar("SELECT count(*) FROM outbox WHERE dispatched_at IS NULL")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(pending, 0);
    dev.handle()
        .wait_idle(Duration::from_secs(20))
        .await
        .unwrap();
    let mut got: Vec<i64> = sink.accepted().iter().map(|s| s.outbox_id).collect();
    got.sort();
    assert_eq!(got, ids);
}
