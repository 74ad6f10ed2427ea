//! The minimal example through the whole pipeline, as the whole-system tests run the example application: its
//! producer writes a signup and its event, the relay (through its Lambda handler) publishes it to the
//! QStash-compatible dev server, which delivers it, signed, to the consumer handler serving this example's
//! registry, which welcomes the signup once. The signup's tenant reaches the handler as an event header: the
//! handler welcomes a signup only under the tenant the header names.

use std::time::Duration;

use minimal_example::{MIGRATOR, registry, sign_up};
use outbox_testkit::db::url_of;
use outbox_testkit::stack::{LocalStack, StackOptions};
use sqlx::PgPool;

#[sqlx::test(migrations = false)]
async fn a_signup_is_welcomed_once_through_the_whole_pipeline(pool: PgPool) {
    let mut opts = StackOptions::new(&url_of(&pool)).unwrap();
    opts.migrators = vec![&outbox::MIGRATOR, &MIGRATOR];
    opts.registry = registry();
    // Every delivery twice: the handler must still apply each event once.
    opts.dev.faults.duplicate_delivery_rate = 1.0;
    let stack = LocalStack::start(opts).await.unwrap();

    let ada = sign_up(&stack.pool, "acme", "ada@example.com")
        .await
        .unwrap();
    let grace = sign_up(&stack.pool, "globex", "grace@example.com")
        .await
        .unwrap();
    assert!(
        stack.wait_quiet(Duration::from_secs(60)).await,
        "the pipeline did not drain"
    );

    let welcomed: Vec<(i64, bool)> =
        sqlx::query_as("SELECT id, welcomed_at IS NOT NULL FROM signups ORDER BY id")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(welcomed, [(ada, true), (grace, true)]);
    let scalar = |sql: &'static str| {
        let pool = pool.clone();
        async move {
            sqlx::query_scalar::<_, i64>(sql)
                .fetch_one(&pool)
                .await
                .unwrap()
        }
    };
    assert_eq!(
        scalar("SELECT count(*) FROM outbox WHERE dispatched_at IS NOT NULL").await,
        2
    );
    assert_eq!(scalar("SELECT count(*) FROM processed_messages").await, 2);
    assert_eq!(scalar("SELECT count(*) FROM dead_letters").await, 0);
    // Both events may travel in one message (RELAY_DELIVERY_BATCH): every message was delivered twice.
    let stats = stack.dev.handle().stats();
    assert!(
        stats.duplicate_deliveries >= 1 && stats.duplicate_deliveries >= stats.accepted,
        "the dev server delivered each message twice: {stats:?}"
    );
    // Only this application's tables: the example application's were not migrated.
    assert_eq!(
        scalar("SELECT count(*) FROM information_schema.tables WHERE table_name = 'charges'").await,
        0
    );
    stack.stop().await;
}
