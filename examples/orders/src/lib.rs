//! The example application the consumer Lambda ships with, end to end: an order service writes an `orders` event
//! in the same transaction as its order; the consumer turns `OrderPlaced` into a charge and a shipment, and
//! `OrderCancelled` into a refund and a cancelled shipment. Its tables are its own migrations ([`MIGRATOR`]), next
//! to the library's (`outbox::MIGRATOR`); [`demo`] is the producer `outbox-dev dev` runs.
//!
//! * `orders` is **ordered**, keyed by order id: an order's cancellation is never applied before its placement.
//!   Payloads are [`OrderEvent`] (internally tagged by `type`), schema version 2; version 1 (before `currency`
//!   existed) is upcast with currency `EUR`.
//! * `audit` is **unordered**: one `audit_log` row per event.
//!
//! A negative amount, an empty id, a malformed currency or an empty item list is a **permanent** error (489:
//! QStash dead-letters it at once) — the tests use it as the poison message.

use serde::{Deserialize, Serialize};
use serde_json::Value;
use sqlx::PgConnection;

use outbox::consumer::{Event, Handler, HandlerError, Registry, TopicRoute};
use outbox::producer::{EnqueueError, NewEvent, Topic};
use sqlx::migrate::Migrator;

pub mod demo;

/// The example's tables (`examples/orders/migrations/`): charges, shipments and the audit log the handlers write,
/// and the orders table the producer writes. Run it after `outbox::MIGRATOR`, on the same database.
///
/// The files keep the versions and bytes they had when they were part of the library's migrations (a database
/// that applied them then has them in `_sqlx_migrations` with their checksums), and `ignore_missing` is set on
/// both migrators: each finds the other's versions applied and leaves them alone (decision record 0010).
pub static MIGRATOR: Migrator = Migrator {
    ignore_missing: true,
    ..sqlx::migrate!("./migrations")
};

/// The ordered `orders` topic (key: the order id).
pub const ORDERS: Topic = Topic::ordered("orders");
/// The unordered `audit` topic.
pub const AUDIT: Topic = Topic::unordered("audit");
/// The current schema version of [`OrderEvent`].
pub const ORDERS_SCHEMA_VERSION: u32 = 2;

/// One line of an order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LineItem {
    /// Stock-keeping unit.
    pub sku: String,
    /// How many (≥ 1).
    pub quantity: u32,
}

/// An order was placed: charge the customer and ship the items.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OrderPlaced {
    /// The order id (also the partition key).
    pub order_id: String,
    /// Who pays.
    pub customer_id: String,
    /// Amount in minor units (must not be negative).
    pub amount_cents: i64,
    /// ISO 4217 code, three upper-case letters.
    pub currency: String,
    /// What to ship (at least one line).
    pub items: Vec<LineItem>,
}

/// An order was cancelled: refund the charge and cancel the shipment.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OrderCancelled {
    pub order_id: String,
    #[serde(default)]
    pub reason: Option<String>,
}

/// The payload of the `orders` topic (schema version 2).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type")]
pub enum OrderEvent {
    OrderPlaced(OrderPlaced),
    OrderCancelled(OrderCancelled),
}

/// `OrderPlaced` at schema version 1 (no currency).
#[derive(Debug, Clone, Deserialize)]
pub struct OrderPlacedV1 {
    pub order_id: String,
    /// Who pays.
    pub customer_id: String,
    /// Amount in minor units.
    pub amount_cents: i64,
    /// What to ship.
    pub items: Vec<LineItem>,
}

/// The `orders` payload at schema version 1.
#[derive(Debug, Clone, Deserialize)]
#[serde(tag = "type")]
pub enum OrderEventV1 {
    /// Placed (no currency yet).
    OrderPlaced(OrderPlacedV1),
    /// Cancelled (unchanged since).
    OrderCancelled(OrderCancelled),
}

impl From<OrderEventV1> for OrderEvent {
    fn from(v1: OrderEventV1) -> Self {
        match v1 {
            OrderEventV1::OrderPlaced(p) => OrderEvent::OrderPlaced(OrderPlaced {
                order_id: p.order_id,
                customer_id: p.customer_id,
                amount_cents: p.amount_cents,
                currency: "EUR".into(),
                items: p.items,
            }),
            OrderEventV1::OrderCancelled(c) => OrderEvent::OrderCancelled(c),
        }
    }
}

impl OrderPlaced {
    /// The business rules; a violation is permanent.
    pub fn validate(&self) -> Result<(), HandlerError> {
        if self.order_id.trim().is_empty() || self.order_id.len() > 100 {
            return Err(HandlerError::permanent("order_id must be 1–100 characters"));
        }
        if self.customer_id.trim().is_empty() {
            return Err(HandlerError::permanent("customer_id is empty"));
        }
        if self.amount_cents < 0 {
            return Err(HandlerError::permanent(format!(
                "order {}: amount_cents is {}; a charge cannot be negative",
                self.order_id, self.amount_cents
            )));
        }
        if !(self.currency.len() == 3 && self.currency.bytes().all(|b| b.is_ascii_uppercase())) {
            return Err(HandlerError::permanent(format!(
                "order {}: currency {:?} is not an ISO 4217 code",
                self.order_id, self.currency
            )));
        }
        if self.items.is_empty() || self.items.iter().any(|i| i.quantity == 0) {
            return Err(HandlerError::permanent(format!(
                "order {}: at least one item, each with quantity ≥ 1",
                self.order_id
            )));
        }
        Ok(())
    }
}

/// The `orders` handler.
#[derive(Debug, Clone, Copy, Default)]
pub struct OrdersHandler;

impl Handler<OrderEvent> for OrdersHandler {
    async fn handle(
        &self,
        conn: &mut PgConnection,
        event: &Event<OrderEvent>,
    ) -> Result<(), HandlerError> {
        let st = event.statements;
        match &event.payload {
            OrderEvent::OrderPlaced(o) => {
                o.validate()?;
                st.query(
                    "INSERT INTO charges (order_id, customer_id, amount_cents, currency, outbox_id) \
                     VALUES ($1, $2, $3, $4, $5)",
                )
                .bind(&o.order_id)
                .bind(&o.customer_id)
                .bind(o.amount_cents)
                .bind(&o.currency)
                .bind(event.meta.outbox_id)
                .execute(&mut *conn)
                .await?;
                st.query(
                    "INSERT INTO shipments (order_id, customer_id, items, outbox_id) VALUES ($1, $2, $3, $4)",
                )
                .bind(&o.order_id)
                .bind(&o.customer_id)
                .bind(sqlx::types::Json(&o.items))
                .bind(event.meta.outbox_id)
                .execute(&mut *conn)
                .await?;
                Ok(())
            }
            OrderEvent::OrderCancelled(c) => {
                let refunded = st.query(
                    "UPDATE charges SET status = 'refunded', updated_at = now() WHERE order_id = $1",
                )
                .bind(&c.order_id)
                .execute(&mut *conn)
                .await?
                .rows_affected();
                if refunded == 0 {
                    return Err(HandlerError::permanent(format!(
                        "cannot cancel order {:?}: no charge for it",
                        c.order_id
                    )));
                }
                st.query(
                    "UPDATE shipments SET status = 'cancelled', updated_at = now() WHERE order_id = $1",
                )
                .bind(&c.order_id)
                .execute(&mut *conn)
                .await?;
                Ok(())
            }
        }
    }
}

/// The payload of the `audit` topic.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AuditEntry {
    /// Who did it.
    pub actor: String,
    /// What they did.
    pub action: String,
    /// Anything else.
    #[serde(default)]
    pub details: Value,
}

/// The `audit` handler.
#[derive(Debug, Clone, Copy, Default)]
pub struct AuditHandler;

impl Handler<AuditEntry> for AuditHandler {
    async fn handle(
        &self,
        conn: &mut PgConnection,
        event: &Event<AuditEntry>,
    ) -> Result<(), HandlerError> {
        let a = &event.payload;
        if a.actor.is_empty() || a.action.is_empty() {
            return Err(HandlerError::permanent("actor and action are required"));
        }
        let details = if a.details.is_null() {
            Value::Object(Default::default())
        } else {
            a.details.clone()
        };
        event
            .statements
            .query(
                "INSERT INTO audit_log (outbox_id, actor, action, details) VALUES ($1, $2, $3, $4)",
            )
            .bind(event.meta.outbox_id)
            .bind(&a.actor)
            .bind(&a.action)
            .bind(details)
            .execute(&mut *conn)
            .await?;
        Ok(())
    }
}

/// The consumer's registry for the example domain.
pub fn registry() -> Registry {
    Registry::new()
        .route(
            TopicRoute::new(ORDERS.name(), OrdersHandler)
                .versions([ORDERS_SCHEMA_VERSION])
                .upcast(1, |v1: OrderEventV1| OrderEvent::from(v1)),
        )
        .on(AUDIT.name(), AuditHandler)
}

/// The producer side: an `orders` event keyed by its order id, at the current schema version. Enqueue it in the
/// transaction that writes the order.
pub fn order_event(event: &OrderEvent) -> Result<NewEvent, EnqueueError> {
    let order_id = match event {
        OrderEvent::OrderPlaced(o) => &o.order_id,
        OrderEvent::OrderCancelled(c) => &c.order_id,
    };
    Ok(NewEvent::new(&ORDERS, order_id.clone(), event)?.schema_version(ORDERS_SCHEMA_VERSION))
}

/// The producer side of `audit`.
pub fn audit_event(key: &str, entry: &AuditEntry) -> Result<NewEvent, EnqueueError> {
    NewEvent::new(&AUDIT, key, entry)
}
