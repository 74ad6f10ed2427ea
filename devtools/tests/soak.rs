//! The CI-sized soak: `outbox-dev soak`'s library entry with 3,000 events over 500 keys, poison
//! events, two relays, the consumer and the callback receiver as separate processes SIGKILLed at random moments,
//! their Postgres backends terminated, the dev server's faults on. No Postgres restart here: other tests share
//! the server. Fails on any lost, doubled or reordered event, a poison event applied, rows left leased, or a
//! non-poison dead letter that the dev server's own DLQ does not explain (or one it explains that is missing).

use outbox_devtools::soak::{self, SoakArgs};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn soak_with_kills_loses_doubles_and_reorders_nothing() {
    let base = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into());
    let database = format!("outbox_soak_test_{}", std::process::id());
    let log_dir = std::env::temp_dir().join(format!("outbox-soak-test-{}", std::process::id()));
    let mut args = SoakArgs::parse(&[
        "--events",
        "3000",
        "--keys",
        "500",
        "--poison-every",
        "50",
        "--rate",
        "100",
        "--relays",
        "2",
        "--kill-every-ms",
        "1500",
        "--seed",
        "7",
        "--progress-secs",
        "15",
        "--drain-timeout-secs",
        "150",
    ])
    .unwrap();
    args.db.database_url = base.clone();
    args.database = database.clone();
    args.log_dir = Some(log_dir.clone());
    args.worker_exe = Some(env!("CARGO_BIN_EXE_outbox-dev").into());
    let report = soak::run(args).await.unwrap();
    println!("{}", report.line());

    assert!(
        report.drained,
        "the pipeline drained (logs in {})",
        log_dir.display()
    );
    assert!(report.enqueued >= 3000, "{}", report.line());
    assert_eq!(report.lost, 0, "{}", report.line());
    assert_eq!(report.applied_twice, 0, "{}", report.line());
    assert_eq!(report.order_violations, 0, "{}", report.line());
    assert_eq!(report.poison_applied, 0, "{}", report.line());
    assert_eq!(report.left_leased, 0, "{}", report.line());
    assert_eq!(
        report.applied_once + report.dead_lettered_poison + report.dead_lettered_other,
        report.enqueued,
        "{}",
        report.line()
    );
    assert_eq!(
        report.dead_lettered_poison,
        report.poison,
        "every poison event is a dead letter: {}",
        report.line()
    );
    // The unexpected (non-poison) dead letters are exactly the events the dev server's own DLQ says QStash gave up
    // on after faults (kills, terminated backends, network faults) and the consumer did not apply.
    assert!(report.retries_exhaustible, "{}", report.line());
    assert_eq!(
        report.unexpected_dead_letters.len() as i64,
        report.dead_lettered_other,
        "{}",
        report.line()
    );
    if let Err(e) = report.dead_letter_bound() {
        panic!("{e}\n{}", report.line());
    }
    assert!(
        report.line().chars().count() < 500,
        "the summary stays one short line: {}",
        report.line()
    );
    assert!(
        report.relay_kills > 0 && report.consumer_kills > 0 && report.backend_kills > 0,
        "the chaos happened: {}",
        report.line()
    );
    assert!(report.ok, "{}", report.line());

    let admin = sqlx::PgPool::connect(&base).await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "DROP DATABASE IF EXISTS \"{database}\" WITH (FORCE)"
    )))
    .execute(&admin)
    .await
    .unwrap();
    let _ = std::fs::remove_dir_all(&log_dir);
}
