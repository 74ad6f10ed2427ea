//! The soak's two topics, and the reason its consumer rejects a poison event with.

use outbox::Topic;

/// The soak's ordered topic (dead heads are skipped: `RELAY_SKIP_DEAD_HEAD_TOPICS`).
pub const ORDERED: Topic = Topic::ordered("soak_ordered");
/// The soak's unordered topic.
pub const UNORDERED: Topic = Topic::unordered("soak_unordered");
/// What the consumer's handler answers a poison event (the dead letter's recognisable reason).
pub const POISON_REASON: &str = "soak poison event";
