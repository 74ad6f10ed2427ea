//! The demo producer dead-letters nothing but its poison orders. During a Postgres restart an order's transaction
//! failed ("nothing was written") and a later order still cancelled it: the consumer rightly refused the
//! cancellation of an order it never charged, and `outbox-dev dev` counted one dead letter more than the poison
//! orders. A cancellation is now produced only for an order whose own transaction committed, and written only by
//! a transaction that found the order.

use std::time::Duration;

use orders_example::demo::{DemoCounts, DemoOptions, place_order, run_with};
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;
use tokio::sync::watch;

/// The orders whose cancellation is in the outbox, in order.
async fn cancellations(pool: &PgPool) -> Vec<String> {
    sqlx::query_scalar(
        "SELECT payload->>'order_id' FROM outbox \
         WHERE topic = 'orders' AND payload->>'type' = 'OrderCancelled' ORDER BY id",
    )
    .fetch_all(pool)
    .await
    .unwrap()
}

/// A pool whose every transaction fails, as during a Postgres restart.
async fn closed_pool(pool: &PgPool) -> PgPool {
    let closed = PgPoolOptions::new().connect_lazy_with((*pool.connect_options()).clone());
    closed.close().await;
    closed
}

#[sqlx::test(migrator = "outbox_testkit::MIGRATOR")]
async fn an_order_whose_transaction_failed_is_never_cancelled(pool: PgPool) {
    // Order 7's transaction fails; order 10 would cancel order 7, order 20 cancels order 17.
    let failing = closed_pool(&pool).await;
    let (stop_tx, stop_rx) = watch::channel(false);
    let (counts_tx, mut counts_rx) = watch::channel(DemoCounts::default());
    let opts = DemoOptions {
        orders_per_sec: 200.0,
        poison_every: 0,
    };
    let demo = tokio::spawn({
        let pool = pool.clone();
        run_with(opts, stop_rx, counts_tx, move |n, poison, cancel| {
            let pool = if n == 7 {
                failing.clone()
            } else {
                pool.clone()
            };
            async move { place_order(&pool, n, poison, cancel).await }
        })
    });
    let counts = *tokio::time::timeout(
        Duration::from_secs(60),
        counts_rx.wait_for(|c| c.orders + c.failed >= 20),
    )
    .await
    .expect("the demo places 20 orders")
    .unwrap();
    stop_tx.send(true).unwrap();
    demo.await.unwrap();

    assert_eq!(counts.failed, 1, "{counts:?}");
    let orders: Vec<String> = sqlx::query_scalar("SELECT id FROM orders ORDER BY id")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert!(
        !orders.contains(&"order-7".to_owned()),
        "order 7 failed: {orders:?}"
    );
    let cancelled = cancellations(&pool).await;
    assert!(
        !cancelled.contains(&"order-7".to_owned()),
        "order 7's transaction failed, yet its cancellation was produced (the consumer dead-letters it): \
         {cancelled:?}"
    );
    assert!(
        cancelled.contains(&"order-17".to_owned()),
        "committed orders are still cancelled: {cancelled:?}"
    );
    assert_eq!(counts.cancellations, cancelled.len() as u64, "{counts:?}");
}

#[sqlx::test(migrator = "outbox_testkit::MIGRATOR")]
async fn a_cancellation_is_written_only_for_an_order_that_exists(pool: PgPool) {
    // Order 1 was never written (its transaction failed): order 4's transaction cannot cancel it.
    let placed = place_order(&pool, 4, false, Some(1)).await.unwrap();
    assert!(!placed.cancelled, "{placed:?}");
    assert_eq!(placed.events, 2, "the order and its audit entry only");
    assert_eq!(cancellations(&pool).await, Vec::<String>::new());

    // Order 4 exists: order 7 cancels it.
    let placed = place_order(&pool, 7, false, Some(4)).await.unwrap();
    assert!(placed.cancelled);
    assert_eq!(placed.events, 3);
    assert_eq!(cancellations(&pool).await, vec!["order-4".to_owned()]);
}
