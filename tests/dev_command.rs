//! The README's first command, `outbox-dev dev`, started from the test suite for a few seconds against a fresh
//! database: events must flow end to end (produced, dispatched, applied), the demo's poison orders (and nothing
//! else) must end in the dead letters, and the shutdown must drain cleanly. What its console looks like with
//! stdout redirected is `devtools/tests/dev_console.rs` (the real binary).

use outbox_cli::util::DbArgs;
use outbox_devtools::dev::{DevArgs, run};
use outbox_testkit::db::url_of;
use sqlx::PgPool;

/// Four seconds of the demo at 40 orders/s (one in 8 poison) on the test's database, with `subscribers` per topic.
fn four_seconds(pool: &PgPool, subscribers: u32) -> DevArgs {
    DevArgs {
        db: DbArgs {
            database_url: url_of(pool),
        },
        existing_db: true,
        no_demo: false,
        faults: false,
        rate: 40.0,
        poison_every: 8,
        qstash_port: 0,
        // A port of its own: tests run side by side, and the console's default 7070 is one for all.
        console_port: 0,
        duration_secs: Some(4),
        drain_secs: 60,
        json: true,
        verbose: false,
        log_file: None,
        progress_secs: 1,
        subscribers,
        otlp: None,
    }
}

#[sqlx::test(migrator = "outbox_testkit::MIGRATOR")]
async fn the_local_pipeline_runs_end_to_end(pool: PgPool) {
    let summary = run(four_seconds(&pool, 1))
        .await
        .expect("outbox-dev dev runs");
    let p = summary.progress;
    assert!(summary.drained, "shutdown did not drain: {summary:?}");
    assert!(
        summary.demo_orders >= 20,
        "the demo producer wrote only {} orders",
        summary.demo_orders
    );
    assert!(summary.demo_poison >= 2);
    assert_eq!(p.pending, 0);
    assert_eq!(p.dispatched, p.enqueued, "{p:?}");
    assert_eq!(
        p.applied + p.dead_lettered,
        p.enqueued,
        "every event applied or dead-lettered: {p:?}"
    );
    assert_eq!(
        p.dead_lettered, summary.demo_poison as i64,
        "each poison order is a dead letter: {p:?}"
    );
    assert!(
        summary
            .dead_letters_by_cause
            .iter()
            .all(|c| c.demo_poison && c.cause.contains("consumer_status=489")),
        "only the demo's poison orders are dead letters: {:?}",
        summary.dead_letters_by_cause
    );
    assert_eq!(
        summary
            .dead_letters_by_cause
            .iter()
            .map(|c| c.count)
            .sum::<u64>(),
        summary.demo_poison
    );
    let charges: i64 = sqlx::query_scalar("SELECT count(*) FROM charges")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(charges as u64, summary.demo_orders - summary.demo_poison);
}

/// `outbox-dev dev --subscribers 3`: the default consumer and two named subscribers, the last of which refuses the
/// audit entries of orders whose id ends in 7. Each gets a copy of every event; the default one dead-letters the
/// demo's poison orders, the picky one exactly the entries it refuses, the other nothing; the summary says so per
/// subscriber.
#[sqlx::test(migrator = "outbox_testkit::MIGRATOR")]
async fn the_local_pipeline_runs_with_three_subscribers(pool: PgPool) {
    let summary = run(four_seconds(&pool, 3))
        .await
        .expect("outbox-dev dev runs");
    assert!(summary.drained, "shutdown did not drain: {summary:?}");
    let per: Vec<(&str, i64, i64, i64)> = summary
        .subscribers
        .iter()
        .map(|s| {
            (
                s.subscriber.as_str(),
                s.enqueued,
                s.applied,
                s.dead_lettered,
            )
        })
        .collect();
    assert_eq!(
        per.iter().map(|p| p.0).collect::<Vec<_>>(),
        ["default", "billing", "shipping"]
    );
    let events = summary.progress.enqueued / 3;
    assert!(events >= 40, "{per:?}");
    let refused: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM outbox WHERE subscriber = '' AND topic = 'audit' \
           AND payload->'details'->>'order_id' LIKE '%7'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert!(refused >= 1, "the run must include orders ending in 7");
    let poison = summary.demo_poison as i64;
    assert_eq!(per[0], ("default", events, events - poison, poison));
    assert_eq!(per[1], ("billing", events, events, 0));
    assert_eq!(per[2], ("shipping", events, events - refused, refused));
    let line = outbox_devtools::dev::summary_line(&summary);
    assert!(
        line.contains(&format!(
            "shipping {events} enqueued / {} applied / {refused} dead-lettered",
            events - refused
        )),
        "{line}"
    );
}

/// The ports `outbox-dev dev` is told (by default 7070 for the console, 8080 for the dev server) taken by someone
/// else: each is bound once, found taken, and the server starts on a free port instead — no look before the bind,
/// which two runs side by side could both pass.
#[sqlx::test(migrator = "outbox_testkit::MIGRATOR")]
async fn taken_console_and_dev_server_ports_fall_back_to_free_ones(pool: PgPool) {
    let console = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let qstash = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let args = DevArgs {
        console_port: console.local_addr().unwrap().port(),
        qstash_port: qstash.local_addr().unwrap().port(),
        duration_secs: Some(2),
        ..four_seconds(&pool, 1)
    };
    let summary = run(args)
        .await
        .expect("outbox-dev dev starts on free ports");
    assert!(summary.drained, "shutdown did not drain: {summary:?}");
    assert!(summary.progress.enqueued > 0, "{summary:?}");
}
