//! [`ReceiverState`]: what the consumer and the callback function hold for their lifetime.

use std::sync::Arc;

use super::{Clock, KeyRing, RECEIVER_SECRETS, SigningKeys, UrlSource, VerifyOptions};
use crate::config::{ConfigError, ConsumerConfig, EnvSource, ProcessEnv, Vars};
use crate::db::{Db, DbConfig};
use crate::secrets::{SecretField, SecretSource};
use crate::subscriber_keys::{KeyConfigError, OwnKey, SubscriberKeys};
use secrecy::ExposeSecret;

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

    /// The secret fields it reads: the database URL and QStash's signing keys; a consumer its own subscriber key,
    /// the callback function every subscriber's (both optional, [`crate::subscriber_keys`]).
    pub fn secret_fields(self) -> Vec<SecretField> {
        let mut fields = RECEIVER_SECRETS.to_vec();
        match self {
            Receiver::Consumer => {
                fields.extend([SecretField::SubscriberKey, SecretField::SubscriberNextKey])
            }
            Receiver::Callbacks => fields.push(SecretField::SubscriberKeys),
        }
        fields
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
    /// The consumer's own subscriber key (`SUBSCRIBER_CURRENT_SIGNING_KEY`, `SUBSCRIBER_NEXT_SIGNING_KEY`): with one, it
    /// accepts only deliveries the relay signed with it ([`crate::subscriber_keys`]). The callback function has
    /// none.
    pub own_key: Option<OwnKey>,
    /// Every subscriber's keys (`SUBSCRIBER_SIGNING_KEYS`), for the callback function: a callback about a copy of a
    /// subscriber with a key is believed only with its signature. Empty in a consumer.
    pub subscriber_keys: SubscriberKeys,
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
            own_key: None,
            subscriber_keys: SubscriberKeys::none(),
        }
    }

    /// A consumer that accepts only deliveries signed with `key` ([`crate::subscriber_keys`]).
    pub fn with_own_key(mut self, key: OwnKey) -> Self {
        self.own_key = Some(key);
        self
    }

    /// A callback function that checks callbacks about each subscriber's copies with `keys`.
    pub fn with_subscriber_keys(mut self, keys: SubscriberKeys) -> Self {
        self.subscriber_keys = keys;
        self
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
        crate::tls::install_crypto_provider();
        let vars = Vars::new(env.as_ref());
        let config = ConsumerConfig::from_vars(&vars)?;
        let db = receiver.db_config(&vars)?;
        let source = SecretSource::from_env(Arc::clone(&env)).await;
        let secrets = source.load(&receiver.secret_fields()).await?;
        crate::secrets::refuse_dev_values(&secrets, &vars)?;
        let handle = db.handle(secrets.get(SecretField::DatabaseUrl)?)?;
        let malformed = |field: SecretField, e: KeyConfigError| ConfigError::MalformedSecret {
            origin: secrets.origin().to_owned(),
            reason: format!("{}: {e}", field.name()),
        };
        let own_key = match secrets.optional(SecretField::SubscriberKey) {
            None => None,
            Some(current) => Some(
                OwnKey::new(
                    current.clone(),
                    secrets.optional(SecretField::SubscriberNextKey).cloned(),
                )
                .map_err(|e| malformed(SecretField::SubscriberKey, e))?,
            ),
        };
        let subscriber_keys = match secrets.optional(SecretField::SubscriberKeys) {
            None => SubscriberKeys::none(),
            Some(text) => SubscriberKeys::parse(text.expose_secret())
                .map_err(|e| malformed(SecretField::SubscriberKeys, e))?,
        };
        let keys = KeyRing::loaded(
            SigningKeys::from_secrets(&secrets)?,
            source,
            config.secret_refresh_interval,
        )
        .allowing_dev_keys(vars.bool_or(crate::secrets::ALLOW_DEV_KEYS_VAR, false)?);
        Ok(ReceiverState {
            config,
            db: handle,
            keys,
            clock: Clock::System,
            emit_metrics: true,
            own_key,
            subscriber_keys,
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
