//! The named subscribers of `outbox-dev dev --subscribers N`: consumers of their own for the example topics, each
//! recording what it applied in `dev_subscriber_log` (its name, the event's topic, key, sequence and outbox id),
//! in the consumer's dedupe transaction. One of them rejects some events the others accept (a permanent error):
//! the audit entries of orders whose id ends in 7, so its dead letters show next to the others' progress (an
//! unordered topic: nothing waits behind them).

use orders_example::{AUDIT, ORDERS, ORDERS_SCHEMA_VERSION};
use outbox::consumer::{Event, Handler, HandlerError, Registry, TopicRoute};
use serde_json::Value;
use sqlx::PgConnection;

/// Names given to the named subscribers, in order (then `sub-5`, `sub-6`, …).
const NAMES: [&str; 4] = ["billing", "shipping", "search", "analytics"];

/// The names of the `n - 1` named subscribers beside the default one.
pub fn names(n: u32) -> Vec<String> {
    (1..n.max(1))
        .map(|i| {
            NAMES
                .get(i as usize - 1)
                .map_or_else(|| format!("sub-{}", i + 1), |s| (*s).to_owned())
        })
        .collect()
}

/// The table the named subscribers write (created if missing).
pub const CREATE_SQL: &str = "CREATE TABLE IF NOT EXISTS dev_subscriber_log (\
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, subscriber text NOT NULL, topic text NOT NULL, \
    partition_key text, seq bigint, outbox_id bigint NOT NULL, applied_at timestamptz NOT NULL DEFAULT now())";

/// Records each event; when `picky`, refuses the audit entries of orders whose id ends in 7.
#[derive(Debug, Clone)]
struct Mirror {
    name: String,
    picky: bool,
}

impl Handler<Value> for Mirror {
    async fn handle(
        &self,
        conn: &mut PgConnection,
        event: &Event<Value>,
    ) -> Result<(), HandlerError> {
        let key = event.meta.key.as_ref().map(|k| k.as_str());
        if self.picky && event.meta.topic.as_str() == AUDIT.name() && refused(&event.payload) {
            return Err(HandlerError::permanent(format!(
                "{} does not take the audit entries of orders whose id ends in 7 (the demo's picky subscriber)",
                self.name
            )));
        }
        event
            .statements
            .query(
                "INSERT INTO dev_subscriber_log (subscriber, topic, partition_key, seq, outbox_id) \
                 VALUES ($1, $2, $3, $4, $5)",
            )
            .bind(&self.name)
            .bind(event.meta.topic.as_str())
            .bind(key)
            .bind(event.meta.seq)
            .bind(event.meta.outbox_id)
            .execute(&mut *conn)
            .await?;
        Ok(())
    }
}

/// What the picky subscriber refuses: an audit entry about an order whose id ends in 7.
pub fn refused(audit_entry: &Value) -> bool {
    audit_entry
        .pointer("/details/order_id")
        .and_then(Value::as_str)
        .is_some_and(|id| id.ends_with('7'))
}

/// The registry of the named subscriber `name`; the picky one refuses some audit entries.
pub fn registry(name: &str, picky: bool) -> Registry {
    let mirror = Mirror {
        name: name.to_owned(),
        picky,
    };
    Registry::new()
        .route(TopicRoute::new(ORDERS.name(), mirror.clone()).versions(1..=ORDERS_SCHEMA_VERSION))
        .on(AUDIT.name(), mirror)
}

#[cfg(test)]
mod tests {
    #[test]
    fn names_follow_the_list_then_number() {
        assert!(super::names(1).is_empty());
        assert_eq!(super::names(3), ["billing", "shipping"]);
        assert_eq!(super::names(6)[4], "sub-6");
    }
}
