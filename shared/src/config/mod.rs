//! Typed configuration from environment variables.
//!
//! Every Lambda reads only the sections it needs, so a variable one function requires never breaks another.
//! Values are parsed into domain types at this edge; an invalid value is a [`ConfigError`] that names the
//! variable (and, for non-secret variables only, the offending value). Secrets are not read here: see
//! [`crate::secrets`].
//!
//! | file | what |
//! |---|---|
//! | `env.rs` | [`EnvSource`], [`Vars`] (typed, checked reads) and [`ConfigError`] |
//! | `relay.rs` | the relay function's: [`QstashConfig`], [`RelayConfig`], [`DeliveryBatching`], [`AccountingConfig`] |
//! | `consumer.rs` | the receivers' (consumer and callback function): [`ConsumerConfig`] |

mod consumer;
mod env;
mod relay;

/// The Postgres URL the local tools default to when `DATABASE_URL` is not set (the operator CLI's
/// `--database-url`, `outbox-dev`, `.cargo/config.toml`). The deployed functions have no default: they read
/// `DATABASE_URL` or its secret.
pub const LOCAL_DATABASE_URL: &str = "postgres://postgres@127.0.0.1:5432/postgres";

pub use consumer::{
    ConsumerConfig, LegacyDeliveries, MAX_CLOCK_TOLERANCE, MIN_SECRET_REFRESH_INTERVAL,
};
pub use env::{ConfigError, EnvSource, ProcessEnv, Vars};
pub use relay::{
    AccountingConfig, DEDUPE_MARGIN, DEFAULT_DELIVERY_BATCH, DeclaredSubscriber, DeliveryBatching,
    EvidenceMode, MAX_DELIVERY_BATCH, OutcomeSource, QstashConfig, RelayConfig, delivery_window,
    qstash_retry_horizon, reconcile_horizon,
};

/// What happens to the later events of an ordered key whose head is dead.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeadHeadPolicy {
    /// The key stops until an operator redrives or discards the head (default).
    Block,
    /// The head is recorded as a dead letter and the key moves on.
    Skip,
}

impl DeadHeadPolicy {
    /// The policy for `topic`: [`DeadHeadPolicy::Skip`] when it is one of `skip_topics`
    /// (`RELAY_SKIP_DEAD_HEAD_TOPICS`), else [`DeadHeadPolicy::Block`]. The relay and the callback function
    /// decide alike ([`RelayConfig::dead_head_policy`], [`ConsumerConfig::dead_head_policy`]).
    pub fn for_topic(skip_topics: &[String], topic: &str) -> Self {
        if skip_topics.iter().any(|t| t == topic) {
            DeadHeadPolicy::Skip
        } else {
            DeadHeadPolicy::Block
        }
    }
}
