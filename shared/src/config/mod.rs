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
//! | `fairness.rs` | the relay's fairness between tenants: [`FairnessConfig`], [`TenantLimits`] |

mod consumer;
mod env;
mod fairness;
mod policy;
mod relay;

/// The Postgres URL the local tools default to when `DATABASE_URL` is not set (the operator CLI's
/// `--database-url`, `outbox-dev`, `.cargo/config.toml`). The deployed functions have no default: they read
/// `DATABASE_URL` or its secret.
pub const LOCAL_DATABASE_URL: &str = "postgres://postgres@127.0.0.1:5432/postgres";

pub use consumer::{
    ConsumerConfig, LegacyDeliveries, MAX_CLOCK_TOLERANCE, MIN_SECRET_REFRESH_INTERVAL,
};
pub use env::{ConfigError, EnvSource, ProcessEnv, Vars};
pub(crate) use fairness::TenantLimit;
pub use fairness::{FairnessConfig, TenantLimits};
pub use policy::DeadHeadPolicy;
pub use relay::{
    AccountingConfig, DEFAULT_DELIVERY_BATCH, DeclaredSubscriber, DeliveryBatching, EvidenceMode,
    OutcomeSource, QstashConfig, RelayConfig, qstash_retry_horizon, reconcile_horizon,
};
