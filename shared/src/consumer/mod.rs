//! The consumer runtime: `POST /events/{topic}` from QStash → cap the body → verify the signature → route to the
//! topic's handler → decode the typed payload → apply it inside [`crate::once::handle_once`] → map the outcome to
//! the HTTP status QStash acts on. What decides a write (outbox id, key, sequence, evidence, schema version) is
//! read from the signed envelope only ([`crate::contract`]).
//!
//! | outcome | status | QStash then |
//! |---|---|---|
//! | applied ([`Outcome::Processed`]) | 200 `{"status":"processed"}` | done |
//! | already applied ([`Outcome::Duplicate`]) | 200 `{"status":"duplicate"}` | done |
//! | missing / bad signature ([`Outcome::Unauthorized`]) | 401 `{"error":…}` — nothing read or written | retries |
//! | body over `MAX_BODY_BYTES` ([`Outcome::TooLarge`]) | 413 — before verification | retries (a redeploy with a higher cap can fix it) |
//! | altered request ([`Outcome::Tampered`]): a header copy disagrees with the signed envelope, or a legacy delivery's `x-outbox-id` names another event | 401 — nothing written | retries (a genuine delivery never has this) |
//! | permanent ([`Outcome::Permanent`]): malformed envelope or payload, unknown topic or path, unsupported schema version, failed validation, event older than one applied for its key, a legacy delivery that cannot be verified | 489 + `Upstash-NonRetryable-Error: true` | 489 + `Upstash-NonRetryable-Error: true` | DLQ at once, failure callback |
//! | transient ([`Outcome::Transient`]): database down, handler said so | 503 (+ `Retry-After` when known) | retries with backoff |
//!
//! The handler functions ([`handle_event`], [`crate::callbacks::handle_callback`]) are plain async functions of
//! `(&State, lambda_http::Request)`: the Lambda binaries, the tests and a local HTTP adapter call them the same
//! way. Decision records 0020–0023 explain the choices.

mod http;
mod registry;

use std::sync::Arc;

use sqlx::PgPool;

use crate::config::{ConfigError, ConsumerConfig, EnvSource, ProcessEnv, Vars};
use crate::db::DbConfig;
use crate::receiver::{Clock, KeyRing, RECEIVER_SECRETS, SigningKeys, UrlSource, VerifyOptions};
use crate::secrets::{SecretField, SecretSource};

pub use http::{NONRETRYABLE_HEADER, Outcome, STATUS_NONRETRYABLE, handle_event};
pub(crate) use http::{json_response, nonretryable_status, request_path};
pub use registry::{
    DEFAULT_SCHEMA_VERSION, Event, EventMeta, Handler, HandlerError, Registry, TopicRoute,
};

/// What every signed-webhook receiver (the consumer and the callback function) holds for its lifetime: built
/// once per Lambda environment, shared by all invocations.
#[derive(Debug)]
pub struct ReceiverState {
    /// Consumer settings (name, public URL, body cap, clock tolerance, secret refresh interval).
    pub config: ConsumerConfig,
    /// The lazily connecting pool.
    pub pool: PgPool,
    /// `DB_PERSISTENT_STATEMENTS`: passed to every query.
    pub persistent: bool,
    /// The signing keys.
    pub keys: KeyRing,
    /// The clock for `exp`/`nbf` (fixed in tests).
    pub clock: Clock,
    /// Print one EMF line per request (on by default; benchmarks turn it off).
    pub emit_metrics: bool,
}

impl ReceiverState {
    /// State from explicit parts (tests, the local pipeline).
    pub fn new(config: ConsumerConfig, pool: PgPool, keys: KeyRing) -> Self {
        ReceiverState {
            config,
            pool,
            persistent: true,
            keys,
            clock: Clock::System,
            emit_metrics: true,
        }
    }

    /// The Lambda setup: `ConsumerConfig` and `DbConfig` from the environment, the database URL and both signing
    /// keys from the secret (`OUTBOX_SECRET_ID`) or the environment, a lazily connecting pool (no I/O besides
    /// the secret read), and keys that are re-read when QStash rotates them.
    pub async fn from_env(application_name: &str) -> Result<Self, ConfigError> {
        crate::install_crypto_provider();
        let env: Arc<dyn EnvSource> = Arc::new(ProcessEnv);
        let vars = Vars::new(env.as_ref());
        let config = ConsumerConfig::from_vars(&vars)?;
        let mut db = DbConfig::from_vars(&vars, application_name)?;
        if application_name == "failure-callback" && vars.raw("DB_ASYNC_COMMIT").is_none() {
            // Delivery evidence is safe to lose (the relay republishes after its evidence timeout and the
            // consumer deduplicates), so the callback function commits asynchronously by default; its dead-letter
            // writes switch synchronous commit back on (see `dead_letters::record_qstash_failure`).
            db.async_commit = true;
        }
        let source = SecretSource::from_env(Arc::clone(&env)).await;
        let secrets = source.load(&RECEIVER_SECRETS).await?;
        let pool = db.pool(secrets.get(SecretField::DatabaseUrl)?)?;
        let keys = KeyRing::loaded(
            SigningKeys::from_secrets(&secrets)?,
            source,
            config.secret_refresh_interval,
        );
        Ok(ReceiverState {
            config,
            pool,
            persistent: db.persistent_statements,
            keys,
            clock: Clock::System,
            emit_metrics: true,
        })
    }

    /// Sets the prepared-statement switch.
    pub fn with_persistent(mut self, persistent: bool) -> Self {
        self.persistent = persistent;
        self
    }

    /// Sets the clock.
    pub fn with_clock(mut self, clock: Clock) -> Self {
        self.clock = clock;
        self
    }

    /// Turns the per-request EMF line on or off.
    pub fn with_metrics(mut self, emit: bool) -> Self {
        self.emit_metrics = emit;
        self
    }

    pub(crate) fn url_source(&self) -> UrlSource<'_> {
        UrlSource::from_config(
            self.config.public_base_url.as_deref(),
            self.config.trust_forwarded_headers,
        )
    }

    pub(crate) fn verify_options(&self) -> VerifyOptions {
        VerifyOptions {
            now: self.clock.now(),
            clock_tolerance_secs: i64::try_from(self.config.clock_tolerance.as_secs())
                .unwrap_or(i64::MAX),
        }
    }
}

/// The consumer function's state: the receiver state plus the topic handlers.
#[derive(Debug)]
pub struct ConsumerState {
    /// Pool, keys, config.
    pub receiver: ReceiverState,
    /// The topic handlers.
    pub registry: Registry,
}

impl ConsumerState {
    /// Combines the parts.
    pub fn new(receiver: ReceiverState, registry: Registry) -> Self {
        ConsumerState { receiver, registry }
    }

    /// [`ReceiverState::from_env`] with the application name `consumer`, plus `registry`.
    pub async fn from_env(registry: Registry) -> Result<Self, ConfigError> {
        Ok(ConsumerState {
            receiver: ReceiverState::from_env("consumer").await?,
            registry,
        })
    }
}
