//! [`ReceiverState`]: what the consumer and the callback function hold for their lifetime.

use std::sync::Arc;

use sqlx::PgPool;

use super::{Clock, KeyRing, RECEIVER_SECRETS, SigningKeys, UrlSource, VerifyOptions};
use crate::config::{ConfigError, ConsumerConfig, EnvSource, ProcessEnv, Vars};
use crate::db::DbConfig;
use crate::secrets::{SecretField, SecretSource};

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
