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
