//! The demo producer of `outbox-dev dev` (and of the whole-system tests): an order service writing sample orders
//! in business transactions — the order row and its `orders` event commit together — plus cancellations of
//! earlier orders (same key: they must be applied after their placement), `audit` events, and now and then a
//! poison order (negative amount) that the consumer rejects as permanent, so it visibly ends in the dead letters.
//!
//! Only poison orders end in the dead letters: an order is cancelled only when its own transaction is known to
//! have committed (a failed transaction wrote nothing, so there is nothing to cancel and the consumer would
//! rightly refuse the cancellation), and a cancellation event is written only when its transaction did cancel a
//! stored order.

use std::collections::BTreeSet;
use std::future::Future;
use std::time::Duration;

use outbox::db::{Db, Statements};
use outbox::producer::{EnqueueError, Producer};
use rand::Rng;
use sqlx::PgPool;
use tokio::sync::watch;

use crate::{
    AuditEntry, LineItem, OrderCancelled, OrderEvent, OrderPlaced, audit_event, order_event,
};

/// Demo settings.
#[derive(Debug, Clone)]
pub struct DemoOptions {
    pub orders_per_sec: f64,
    /// One order in `poison_every` is poison (0 = never).
    pub poison_every: u64,
}

/// What the demo wrote.
#[derive(Debug, Clone, Copy, Default)]
pub struct DemoCounts {
    /// Orders placed (incl. poison).
    pub orders: u64,
    /// Poison orders.
    pub poison: u64,
    pub cancellations: u64,
    /// Events enqueued in total.
    pub events: u64,
    /// Orders whose transaction failed (nothing was written; never cancelled later).
    pub failed: u64,
}

/// What one committed order transaction wrote.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Placed {
    /// Events enqueued.
    pub events: u64,
    /// The earlier order was found and cancelled (its cancellation event is among the events).
    pub cancelled: bool,
}

/// Places one order (and maybe cancels an earlier one) in one transaction. The cancellation event is written
/// only if the transaction found the earlier order and cancelled it: the events say what the transaction did.
pub async fn place_order(
    pool: &PgPool,
    n: u64,
    poison: bool,
    cancel: Option<u64>,
) -> Result<Placed, EnqueueError> {
    place_order_with(
        &Db::new(pool.clone(), Statements::Prepared),
        n,
        poison,
        cancel,
    )
    .await
}

/// [`place_order`] through a database handle: its statements (the order's, the cancellation's, the producer's)
/// go out in the handle's mode, unnamed behind a transaction-mode pooler (`DB_PERSISTENT_STATEMENTS=false`).
pub async fn place_order_with(
    db: &Db,
    n: u64,
    poison: bool,
    cancel: Option<u64>,
) -> Result<Placed, EnqueueError> {
    let order_id = format!("order-{n}");
    let (customer, amount) = {
        let mut r = rand::rng();
        (
            format!("customer-{}", r.random_range(1..50)),
            r.random_range(500..50_000i64),
        )
    };
    let amount = if poison { -amount } else { amount };
    let mut tx = db.pool().begin().await?;
    db.query(
        "INSERT INTO orders (id, customer_id, amount_cents, currency) VALUES ($1, $2, $3, 'EUR')",
    )
    .bind(&order_id)
    .bind(&customer)
    .bind(amount)
    .execute(&mut *tx)
    .await?;
    let mut events = vec![
        order_event(&OrderEvent::OrderPlaced(OrderPlaced {
            order_id: order_id.clone(),
            customer_id: customer.clone(),
            amount_cents: amount,
            currency: "EUR".into(),
            items: vec![LineItem {
                sku: format!("sku-{}", n % 17),
                quantity: 1 + (n % 3) as u32,
            }],
        }))?
        .correlation_id(format!("demo-{n}"))
        .traceparent(format!("00-{:032x}-{:016x}-01", u128::from(n) + 1, n + 1)),
        audit_event(
            &customer,
            &AuditEntry {
                actor: customer.clone(),
                action: "order.placed".into(),
                details: serde_json::json!({"order_id": order_id, "amount_cents": amount}),
            },
        )?
        // The application's own metadata: what caused this audit entry (read with `event.header(..)`).
        .header("causation-id", order_id.as_str()),
    ];
    let mut cancelled = false;
    if let Some(c) = cancel {
        let order = format!("order-{c}");
        let found = db
            .query(
                "UPDATE orders SET status = 'cancelled', updated_at = now() \
             WHERE id = $1 AND status <> 'cancelled'",
            )
            .bind(&order)
            .execute(&mut *tx)
            .await?
            .rows_affected();
        if found == 1 {
            cancelled = true;
            events.push(order_event(&OrderEvent::OrderCancelled(OrderCancelled {
                order_id: order,
                reason: Some("customer changed their mind".into()),
            }))?);
        }
    }
    let written = Producer::default()
        .statements(db.statements())
        .enqueue_batch(&mut tx, &events)
        .await?
        .len() as u64;
    tx.commit().await?;
    Ok(Placed {
        events: written,
        cancelled,
    })
}

/// Runs until `stop` turns true; reports counts through `counts`. Orders go through `db` (its statement mode
/// like the library's own: `DB_PERSISTENT_STATEMENTS`).
pub async fn run(
    db: Db,
    opts: DemoOptions,
    stop: watch::Receiver<bool>,
    counts: watch::Sender<DemoCounts>,
) {
    run_with(opts, stop, counts, move |n, poison, cancel| {
        let db = db.clone();
        async move { place_order_with(&db, n, poison, cancel).await }
    })
    .await
}

/// [`run`] with each order's transaction run by `place` (normally [`place_order`] on the pool; tests make one
/// fail). Order `n` is poison when `n` is a multiple of `poison_every`; every 10th order cancels the order
/// placed 3 before it, if that order's transaction committed and it was not poison.
pub async fn run_with<F, Fut>(
    opts: DemoOptions,
    mut stop: watch::Receiver<bool>,
    counts: watch::Sender<DemoCounts>,
    mut place: F,
) where
    F: FnMut(u64, bool, Option<u64>) -> Fut,
    Fut: Future<Output = Result<Placed, EnqueueError>>,
{
    let period = Duration::from_secs_f64(1.0 / opts.orders_per_sec.max(0.1));
    let mut tick = tokio::time::interval(period);
    let mut c = DemoCounts::default();
    let mut n = 0u64;
    // Good orders whose transaction committed and that a later order may still cancel.
    let mut committed = BTreeSet::new();
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.wait_for(|s| *s) => return,
        }
        n += 1;
        let poison = opts.poison_every > 0 && n.is_multiple_of(opts.poison_every);
        let cancel = (n.is_multiple_of(10) && n > 3 && committed.contains(&(n - 3))).then(|| n - 3);
        match place(n, poison, cancel).await {
            Ok(placed) => {
                if !poison {
                    committed.insert(n);
                }
                c.orders += 1;
                c.events += placed.events;
                c.poison += u64::from(poison);
                c.cancellations += u64::from(placed.cancelled);
            }
            Err(e) => {
                c.failed += 1;
                tracing::warn!(order = n, error = %e, "demo producer: transaction failed (nothing was written; the order will not be cancelled)")
            }
        }
        // Order m cancels order m - 3: nothing at or below n - 3 can be cancelled any more.
        committed.retain(|&k| k + 3 > n);
        let _ = counts.send(c);
    }
}

/// Whether an `orders` payload is one of the demo's poison orders (a placement with a negative amount, which the
/// consumer refuses as permanent): `outbox-dev dev` tells the dead letters it expects from the others.
pub fn is_poison(payload: &serde_json::Value) -> bool {
    payload["type"] == "OrderPlaced" && payload["amount_cents"].as_i64().is_some_and(|a| a < 0)
}
