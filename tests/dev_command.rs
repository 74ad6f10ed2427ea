//! The README's first command, `outbox-dev dev`, started from the test suite for a few seconds against a fresh
//! database: events must flow end to end (produced, dispatched, applied), the demo's poison orders (and nothing
//! else) must end in the dead letters, and the shutdown must drain cleanly. What its console looks like with
//! stdout redirected is `devtools/tests/dev_console.rs` (the real binary).

use outbox_cli::util::DbArgs;
use outbox_devtools::dev::{DevArgs, run};
use outbox_testkit::db::url_of;
use sqlx::PgPool;

#[sqlx::test(migrator = "outbox_testkit::MIGRATOR")]
async fn the_local_pipeline_runs_end_to_end(pool: PgPool) {
    let summary = run(DevArgs {
        db: DbArgs {
            database_url: url_of(&pool),
        },
        existing_db: true,
        no_demo: false,
        faults: false,
        rate: 40.0,
        poison_every: 8,
        qstash_port: 0,
        duration_secs: Some(4),
        drain_secs: 60,
        json: true,
        verbose: false,
        log_file: None,
        progress_secs: 1,
    })
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
