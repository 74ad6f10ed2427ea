//! The seam through which the workspace's own benchmarks, soak and tests reach the library's internals: relay
//! steps they measure or drive one at a time (the claim statements, one settle, the housekeeping batches, the
//! partition maintenance, the outage row, the handler's metrics) and the modules below the API (the wire
//! contract, the signature check, the QStash client, secrets, ordering, per-subscriber keys, metrics, health).
//! Feature `internals`, off by default: not part of the library's API, no promise of stability, never enabled by
//! the Lambda functions or the operator CLI. What an application or operator needs is in the public modules.

/// Step 1's statements and what they return.
pub mod claim {
    pub use crate::relay::claim::*;
}

/// The relay's Lambda handler, with its metrics and deadlines.
pub mod handler {
    pub use crate::relay::handler::*;
}

/// Retention and pruning, batch by batch.
pub mod housekeeping {
    pub use crate::relay::housekeeping::*;
}

/// The outbox's partitions and their maintenance.
pub mod partitions {
    pub use crate::relay::partitions::*;
}

/// Step 3's fenced statement.
pub mod settle {
    pub use crate::relay::settle::*;
}

/// The shared outage row and its probe.
pub mod outage {
    pub use crate::relay::outage::*;
}

/// Trace export on its own (not the process's), for the benchmarks' collector-fault checks.
pub mod trace {
    pub use crate::telemetry::export::TraceRig;
}

/// Secrets Manager and the environment: the database URL, QStash token and signing keys.
pub mod secrets {
    pub use crate::secrets::*;
}

/// Per-key order: sequences, heads, delivery evidence.
pub mod ordering {
    pub use crate::ordering::*;
}

/// Per-subscriber signing keys.
pub mod subscriber_keys {
    pub use crate::subscriber_keys::*;
}

/// CloudWatch EMF records.
pub mod metrics {
    pub use crate::metrics::*;
}

/// The signed wire contract between relay, QStash and the receivers.
pub mod contract {
    pub use crate::contract::*;
}

/// The `Upstash-Signature` check and what both receiver functions share.
pub mod receiver {
    pub use crate::receiver::*;
}

/// The QStash client.
pub mod qstash {
    pub use crate::qstash::*;
}

/// QStash's failure and delivery callbacks, parsed and recorded.
pub mod callbacks {
    pub use crate::callbacks::*;
}

/// The database's own state: the xmin horizon and bloat.
pub mod health {
    pub use crate::health::*;
}

/// One cycle's steps as the benchmarks and tests drive them: the messages formed, what publishing them answered,
/// and the settle's pieces.
pub mod cycle {
    pub use crate::relay::forming::{Formed, Outgoing};
    pub use crate::relay::pipeline::{SETTLE_PIECE_ROWS, pieces};
    pub use crate::relay::published::{Published, PublishedEvent, Reach};
}

/// The reconciler and the sweep of applied events, called one at a time.
pub mod accounting {
    pub use crate::accounting::reconcile::{ReconcileError, Reconciler, reconcile};
    pub use crate::accounting::sweep::sweep_applied;
}

/// The relay's single steps and its parts, as the tests and benchmarks drive them one at a time (a cycle runs
/// the steps in order: [`crate::relay::Relay::run_cycle`]). Bring the trait into scope and call them as methods:
/// `use outbox::internals::RelaySteps;`.
#[allow(async_fn_in_trait)] // the workspace's own tests and benchmarks only
pub trait RelaySteps: Sized {
    /// A relay from its parts (the Lambda function builds one from the environment: `relay::RelayState`).
    fn new(
        db: crate::db::Db,
        client: crate::qstash::QstashClient,
        cfg: crate::config::RelayConfig,
        qstash: crate::config::QstashConfig,
    ) -> Self;
    /// With every subscriber's signing key.
    fn with_subscriber_keys(self, keys: crate::subscriber_keys::SubscriberKeys) -> Self;
    /// The claim statements (plan inspection).
    fn claim_statements(&self) -> &crate::relay::claim::ClaimStatements;
    /// Step 1: the claim.
    async fn claim(
        &self,
    ) -> Result<Vec<crate::relay::claim::ClaimedEvent>, crate::relay::RelayError>;
    /// The message of one claimed event.
    fn message_for(&self, ev: &crate::relay::claim::ClaimedEvent) -> crate::qstash::Message;
    /// The messages a claim forms.
    fn messages_for(
        &self,
        events: &[crate::relay::claim::ClaimedEvent],
    ) -> crate::relay::forming::Formed;
    /// Step 2: one outcome per event, and each request's latency.
    async fn publish(
        &self,
        events: &[crate::relay::claim::ClaimedEvent],
    ) -> (Vec<crate::qstash::PublishOutcome>, Vec<std::time::Duration>);
    /// Step 2, classified.
    async fn publish_classified(
        &self,
        events: &[crate::relay::claim::ClaimedEvent],
    ) -> crate::relay::published::Published;
    /// What to record for each published event.
    fn decide(
        &self,
        events: &[crate::relay::claim::ClaimedEvent],
        outcomes: &[crate::qstash::PublishOutcome],
    ) -> Vec<crate::relay::settle::SettleItem>;
    /// Step 3: one fenced statement.
    async fn settle(
        &self,
        items: &[crate::relay::settle::SettleItem],
    ) -> Result<crate::relay::settle::SettleCounts, crate::relay::RelayError>;
}

impl RelaySteps for crate::relay::Relay {
    fn new(
        db: crate::db::Db,
        client: crate::qstash::QstashClient,
        cfg: crate::config::RelayConfig,
        qstash: crate::config::QstashConfig,
    ) -> Self {
        crate::relay::Relay::new(db, client, cfg, qstash)
    }
    fn with_subscriber_keys(self, keys: crate::subscriber_keys::SubscriberKeys) -> Self {
        crate::relay::Relay::with_subscriber_keys(self, keys)
    }
    fn claim_statements(&self) -> &crate::relay::claim::ClaimStatements {
        crate::relay::Relay::claim_statements(self)
    }
    async fn claim(
        &self,
    ) -> Result<Vec<crate::relay::claim::ClaimedEvent>, crate::relay::RelayError> {
        crate::relay::Relay::claim(self).await
    }
    fn message_for(&self, ev: &crate::relay::claim::ClaimedEvent) -> crate::qstash::Message {
        crate::relay::Relay::message_for(self, ev)
    }
    fn messages_for(
        &self,
        events: &[crate::relay::claim::ClaimedEvent],
    ) -> crate::relay::forming::Formed {
        crate::relay::Relay::messages_for(self, events)
    }
    async fn publish(
        &self,
        events: &[crate::relay::claim::ClaimedEvent],
    ) -> (Vec<crate::qstash::PublishOutcome>, Vec<std::time::Duration>) {
        crate::relay::Relay::publish(self, events).await
    }
    async fn publish_classified(
        &self,
        events: &[crate::relay::claim::ClaimedEvent],
    ) -> crate::relay::published::Published {
        crate::relay::Relay::publish_classified(self, events).await
    }
    fn decide(
        &self,
        events: &[crate::relay::claim::ClaimedEvent],
        outcomes: &[crate::qstash::PublishOutcome],
    ) -> Vec<crate::relay::settle::SettleItem> {
        crate::relay::Relay::decide(self, events, outcomes)
    }
    async fn settle(
        &self,
        items: &[crate::relay::settle::SettleItem],
    ) -> Result<crate::relay::settle::SettleCounts, crate::relay::RelayError> {
        crate::relay::Relay::settle(self, items).await
    }
}
