//! [`ReceiverState`]: what the consumer and the callback function hold for their lifetime.

use std::sync::Arc;

use super::{Clock, KeyRing, RECEIVER_SECRETS, SigningKeys, UrlSource, VerifyOptions};
use crate::config::{ConfigError, ConsumerConfig, EnvSource, ProcessEnv, Vars};
use crate::db::{Db, DbConfig};
use crate::secrets::{SecretField, SecretSource};

/// Which receiver a function is. The two differ in their database defaults only.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Receiver {
    /// `functions/consumer`: applies events.
    Consumer,
    /// `functions/failure-callback`: QStash's failure and delivery callbacks.
    Callbacks,
}

impl Receiver {
    /// The function's name: its `application_name` in `pg_stat_activity` unless `DB_APPLICATION_NAME` is set.
    pub fn name(self) -> &'static str {
        match self {
            Receiver::Consumer => "consumer",
            Receiver::Callbacks => "failure-callback",
        }
    }

    /// Its pool settings: the `DB_*` variables over its defaults, which differ in `DB_ASYNC_COMMIT` (decision
    /// record 0006). The consumer commits synchronously: its commit is the side effect, and QStash does not
    /// deliver again after a 200. The callback function commits asynchronously: delivery evidence is safe to lose
    /// (the relay republishes after its evidence timeout and the consumer deduplicates), and its dead-letter
    /// writes switch synchronous commit back on (see `dead_letters::record_qstash_failure`).
    pub fn db_config(self, vars: &Vars<'_>) -> Result<DbConfig, ConfigError> {
        let defaults = DbConfig {
            async_commit: match self {
                Receiver::Consumer => false,
                Receiver::Callbacks => true,
            },
            ..DbConfig::defaults(self.name())
        };
        DbConfig::from_vars_over(vars, defaults)
    }
}

/// What every signed-webhook receiver (the consumer and the callback function) holds for its lifetime: built
/// once per Lambda environment, shared by all invocations.
#[derive(Debug)]
pub struct ReceiverState {
    /// Consumer settings (name, public URL, body cap, clock tolerance, secret refresh interval).
    pub config: ConsumerConfig,
    /// The database handle: a lazily connecting pool and the statement mode (`DB_PERSISTENT_STATEMENTS`).
    pub db: Db,
    /// The signing keys.
    pub keys: KeyRing,
    /// The clock for `exp`/`nbf` (fixed in tests).
    pub clock: Clock,
    /// Print one EMF line per request (on by default; benchmarks turn it off).
    pub emit_metrics: bool,
}

impl ReceiverState {
    /// State from explicit parts (tests, the local pipeline).
    pub fn new(config: ConsumerConfig, db: Db, keys: KeyRing) -> Self {
        ReceiverState {
            config,
            db,
            keys,
            clock: Clock::System,
            emit_metrics: true,
        }
    }

    /// The Lambda setup for `receiver`: `ConsumerConfig` and its `DbConfig` from the environment, the database URL and both signing
    /// keys from the secret (`OUTBOX_SECRET_ID`) or the environment, a lazily connecting pool (no I/O besides
    /// the secret read), and keys that are re-read when QStash rotates them. Refuses the QStash dev server's
    /// public signing keys unless `OUTBOX_ALLOW_DEV_KEYS=true` ([`crate::secrets::refuse_dev_values`]).
    pub async fn from_env(receiver: Receiver) -> Result<Self, ConfigError> {
        Self::from_env_source(receiver, Arc::new(ProcessEnv)).await
    }

    /// [`ReceiverState::from_env`] with the variables read from `env` (tests).
    pub async fn from_env_source(
        receiver: Receiver,
        env: Arc<dyn EnvSource>,
    ) -> Result<Self, ConfigError> {
        crate::install_crypto_provider();
        let vars = Vars::new(env.as_ref());
        let config = ConsumerConfig::from_vars(&vars)?;
        let db = receiver.db_config(&vars)?;
        let source = SecretSource::from_env(Arc::clone(&env)).await;
        let secrets = source.load(&RECEIVER_SECRETS).await?;
        crate::secrets::refuse_dev_values(&secrets, &vars)?;
        let handle = db.handle(secrets.get(SecretField::DatabaseUrl)?)?;
        let keys = KeyRing::loaded(
            SigningKeys::from_secrets(&secrets)?,
            source,
            config.secret_refresh_interval,
        );
        Ok(ReceiverState {
            config,
            db: handle,
            keys,
            clock: Clock::System,
            emit_metrics: true,
        })
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

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    #[test]
    fn only_the_callback_function_commits_asynchronously_by_default_and_db_async_commit_overrides_both()
     {
        let unset: HashMap<&'static str, &'static str> = HashMap::new();
        let consumer = Receiver::Consumer.db_config(&Vars::new(&unset)).unwrap();
        let callbacks = Receiver::Callbacks.db_config(&Vars::new(&unset)).unwrap();
        assert!(!consumer.async_commit);
        assert!(callbacks.async_commit);
        assert_eq!(
            (
                consumer.application_name.as_str(),
                callbacks.application_name.as_str()
            ),
            ("consumer", "failure-callback")
        );

        let flipped: HashMap<&'static str, &'static str> = [("DB_ASYNC_COMMIT", "true")].into();
        assert!(
            Receiver::Consumer
                .db_config(&Vars::new(&flipped))
                .unwrap()
                .async_commit
        );
        let flipped: HashMap<&'static str, &'static str> = [("DB_ASYNC_COMMIT", "false")].into();
        assert!(
            !Receiver::Callbacks
                .db_config(&Vars::new(&flipped))
                .unwrap()
                .async_commit
        );
    }
}
