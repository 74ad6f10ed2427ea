//! Secrets: database URL, QStash token, current and next signing keys.
//!
//! In Lambda they come from an AWS Secrets Manager secret (a JSON object whose field names are the same as the
//! environment variables below), named by each function's `OUTBOX_SECRET_ID`. The stack gives the relay and the
//! receivers different secrets: the relay's holds `DATABASE_URL` and `QSTASH_TOKEN`, the receivers'
//! (consumer, failure callback: public URLs that only *verify* QStash's signatures) `DATABASE_URL` and the two
//! signing keys. Without `OUTBOX_SECRET_ID` the plain environment variables are used (local runs, tests).
//!
//! Each function asks only for the fields it needs; a missing or malformed field is a startup [`ConfigError`]
//! naming the field. The QStash token is kept only when asked for ([`SecretField::kept_unrequested`]): a
//! function that does not publish never holds it, even when its secret contains it, and a Secrets Manager source
//! warns once when it sees one there. Values are held as [`SecretString`] so they never reach a log through
//! `Debug`.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use aws_sdk_secretsmanager::config::Credentials;
use secrecy::{ExposeSecret, SecretString};
use serde_json::Value;

use crate::config::{ConfigError, EnvSource, Vars};

/// One secret value the functions use. The name is both the JSON field in the secret and the environment
/// variable of the local fallback.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SecretField {
    /// `DATABASE_URL`: Postgres connection URL.
    DatabaseUrl,
    /// `QSTASH_TOKEN`: bearer token for publishing.
    QstashToken,
    /// `QSTASH_CURRENT_SIGNING_KEY`: verifies `Upstash-Signature`.
    CurrentSigningKey,
    /// `QSTASH_NEXT_SIGNING_KEY`: verifies `Upstash-Signature` during key rotation.
    NextSigningKey,
    /// `SUBSCRIBER_SIGNING_KEYS`: every subscriber's key ([`crate::subscriber_keys`]), with which the relay signs
    /// each subscriber's deliveries and the failure callback checks what a callback says about them.
    SubscriberKeys,
    /// `SUBSCRIBER_CURRENT_SIGNING_KEY`: a consumer's own subscriber key: it accepts only deliveries signed with it.
    SubscriberKey,
    /// `SUBSCRIBER_NEXT_SIGNING_KEY`: a consumer's next subscriber key, accepted too while the relay switches.
    SubscriberNextKey,
}

impl SecretField {
    /// The JSON field / environment variable name.
    pub const fn name(self) -> &'static str {
        match self {
            SecretField::DatabaseUrl => "DATABASE_URL",
            SecretField::QstashToken => "QSTASH_TOKEN",
            SecretField::CurrentSigningKey => "QSTASH_CURRENT_SIGNING_KEY",
            SecretField::NextSigningKey => "QSTASH_NEXT_SIGNING_KEY",
            SecretField::SubscriberKeys => "SUBSCRIBER_SIGNING_KEYS",
            SecretField::SubscriberKey => "SUBSCRIBER_CURRENT_SIGNING_KEY",
            SecretField::SubscriberNextKey => "SUBSCRIBER_NEXT_SIGNING_KEY",
        }
    }

    /// Whether a load keeps this field when it is present but was not asked for. Every field but the QStash
    /// token and every subscriber's keys: with the token anyone can publish, and QStash then signs whatever was
    /// published; with the subscribers' keys anyone can sign deliveries to every subscriber. Each is held only by
    /// the functions that ask for it (the token: the relay; the keys: the relay and the failure callback). (The
    /// optional next signing key, for example, is kept when present although only the current one is required.)
    pub const fn kept_unrequested(self) -> bool {
        !matches!(self, SecretField::QstashToken | SecretField::SubscriberKeys)
    }

    /// Whether a function that asks for this field fails to start without it. The subscriber keys are optional
    /// (without them nothing is signed or checked per subscriber, [`crate::subscriber_keys`]).
    pub const fn required_when_asked(self) -> bool {
        !matches!(
            self,
            SecretField::SubscriberKeys
                | SecretField::SubscriberKey
                | SecretField::SubscriberNextKey
        )
    }

    /// Every field.
    pub const ALL: [SecretField; 7] = [
        SecretField::DatabaseUrl,
        SecretField::QstashToken,
        SecretField::CurrentSigningKey,
        SecretField::NextSigningKey,
        SecretField::SubscriberKeys,
        SecretField::SubscriberKey,
        SecretField::SubscriberNextKey,
    ];
}

/// The secret values that were requested (and found).
#[derive(Clone, Default)]
pub struct Secrets {
    origin: String,
    values: std::collections::HashMap<SecretField, SecretString>,
    withheld: Vec<SecretField>,
}

impl std::fmt::Debug for Secrets {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut d = f.debug_struct("Secrets");
        d.field("origin", &self.origin);
        for field in SecretField::ALL {
            d.field(field.name(), &self.values.get(&field).map(|_| "[redacted]"));
        }
        d.field("withheld", &self.withheld).finish()
    }
}

impl Secrets {
    /// Builds secrets from explicit values (tests, the local stack).
    pub fn from_values(
        database_url: Option<&str>,
        qstash_token: Option<&str>,
        current_signing_key: Option<&str>,
        next_signing_key: Option<&str>,
    ) -> Self {
        let mut secrets = Secrets {
            origin: "explicit values".into(),
            ..Default::default()
        };
        for (field, value) in [
            (SecretField::DatabaseUrl, database_url),
            (SecretField::QstashToken, qstash_token),
            (SecretField::CurrentSigningKey, current_signing_key),
            (SecretField::NextSigningKey, next_signing_key),
        ] {
            if let Some(v) = value {
                secrets.set(field, v.to_owned());
            }
        }
        secrets
    }

    /// With one more field's value (tests, the local stack).
    pub fn with(mut self, field: SecretField, value: &str) -> Self {
        self.set(field, value.to_owned());
        self
    }

    /// Fields that were present (non-empty) in the source but not kept, because they were not asked for and
    /// are not [`SecretField::kept_unrequested`]: the QStash token in a function that does not publish, every
    /// subscriber's keys in a consumer.
    pub fn withheld(&self) -> &[SecretField] {
        &self.withheld
    }

    /// Where the values came from ("environment" or the secret id), for messages.
    pub fn origin(&self) -> &str {
        &self.origin
    }

    /// A field's value, or the error naming it.
    pub fn get(&self, field: SecretField) -> Result<&SecretString, ConfigError> {
        self.values
            .get(&field)
            .ok_or_else(|| ConfigError::MissingSecretField {
                origin: self.origin.clone(),
                field: field.name(),
            })
    }

    /// A field's value when it is present (for optional fields).
    pub fn optional(&self, field: SecretField) -> Option<&SecretString> {
        self.values.get(&field)
    }

    fn set(&mut self, field: SecretField, value: String) {
        self.values.insert(field, SecretString::from(value));
    }

    /// Parses the JSON text of a secret, keeping the `needed` fields (each must be a non-empty string, unless it is
    /// not [`SecretField::required_when_asked`]) and any
    /// other known field that is present and [`SecretField::kept_unrequested`]; a present field that is neither is
    /// dropped and listed in [`Secrets::withheld`]. Errors never include the secret's content.
    pub fn parse_json(
        origin: &str,
        text: &str,
        needed: &[SecretField],
    ) -> Result<Secrets, ConfigError> {
        let malformed = |reason: String| ConfigError::MalformedSecret {
            origin: origin.to_owned(),
            reason,
        };
        let value: Value = serde_json::from_str(text).map_err(|e| {
            malformed(format!(
                "not valid JSON ({} at line {}, column {})",
                match e.classify() {
                    serde_json::error::Category::Eof => "unexpected end of input",
                    serde_json::error::Category::Syntax => "syntax error",
                    serde_json::error::Category::Data => "invalid data",
                    serde_json::error::Category::Io => "read error",
                },
                e.line(),
                e.column()
            ))
        })?;
        let Value::Object(map) = value else {
            return Err(malformed(
                "expected a JSON object with string fields".into(),
            ));
        };
        let mut secrets = Secrets {
            origin: origin.to_owned(),
            ..Default::default()
        };
        // Wrong types first (a clearer message than "missing"), then the fields this function needs.
        for field in SecretField::ALL {
            match map.get(field.name()) {
                Some(Value::String(s)) if !s.trim().is_empty() => {
                    if needed.contains(&field) || field.kept_unrequested() {
                        secrets.set(field, s.trim().to_owned())
                    } else {
                        secrets.withheld.push(field)
                    }
                }
                Some(Value::String(_)) | None | Some(Value::Null) => {}
                Some(_) => {
                    return Err(malformed(format!(
                        "field {} must be a string",
                        field.name()
                    )));
                }
            }
        }
        for field in needed.iter().filter(|f| f.required_when_asked()) {
            secrets.get(*field)?;
        }
        Ok(secrets)
    }

    /// Reads the fields from environment variables; the `needed` ones must be set. Like [`Secrets::parse_json`],
    /// a field that was not asked for and is not [`SecretField::kept_unrequested`] is not kept (locally one
    /// environment usually serves every function, so this is not reported as withheld).
    pub fn from_env(env: &dyn EnvSource, needed: &[SecretField]) -> Result<Secrets, ConfigError> {
        let mut secrets = Secrets {
            origin: "environment".into(),
            ..Default::default()
        };
        for field in SecretField::ALL {
            match env.var(field.name()) {
                Some(_) if !needed.contains(&field) && !field.kept_unrequested() => {}
                Some(v) => secrets.set(field, v.trim().to_owned()),
                None if needed.contains(&field) && field.required_when_asked() => {
                    return Err(ConfigError::MissingSecretField {
                        origin: "environment".into(),
                        field: field.name(),
                    });
                }
                None => {}
            }
        }
        Ok(secrets)
    }
}

/// Options for the Secrets Manager client. In Lambda everything comes from the default provider chain;
/// tests point it at a local Secrets Manager (moto) with static credentials.
#[derive(Debug, Clone, Default)]
pub struct SecretsManagerOptions {
    /// Endpoint override (e.g. `http://127.0.0.1:5055`). `AWS_ENDPOINT_URL` also works without this.
    pub endpoint_url: Option<String>,
    /// Region override (`AWS_REGION` otherwise).
    pub region: Option<String>,
    /// Static credentials `(access key id, secret access key)` instead of the provider chain.
    pub static_credentials: Option<(String, String)>,
}

/// Where secrets are read from, kept for the process lifetime so a consumer can re-read them after a key
/// rotation.
#[derive(Clone)]
pub enum SecretSource {
    /// Plain environment variables (local fallback).
    Env(Arc<dyn EnvSource>),
    /// One Secrets Manager secret holding a JSON object.
    SecretsManager {
        /// The SDK client, built once.
        client: aws_sdk_secretsmanager::Client,
        /// Secret id or ARN.
        secret_id: String,
        /// Set once the "holds a QStash token it should not" warning was logged (shared by clones, so a receiver
        /// warns at start and not again at each signing-key refresh).
        warned_withheld: Arc<AtomicBool>,
    },
}

impl std::fmt::Debug for SecretSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SecretSource::Env(_) => f.write_str("SecretSource::Env"),
            SecretSource::SecretsManager { secret_id, .. } => {
                write!(f, "SecretSource::SecretsManager({secret_id})")
            }
        }
    }
}

/// The environment variable naming the Secrets Manager secret.
pub const SECRET_ID_VAR: &str = "OUTBOX_SECRET_ID";

impl SecretSource {
    /// Secrets Manager when `OUTBOX_SECRET_ID` is set, else the environment.
    pub async fn from_env(env: Arc<dyn EnvSource>) -> SecretSource {
        match env.var(SECRET_ID_VAR) {
            Some(id) => {
                SecretSource::secrets_manager(id.trim(), SecretsManagerOptions::default()).await
            }
            None => SecretSource::Env(env),
        }
    }

    /// A Secrets Manager source. The SDK uses rustls with ring (the same TLS stack as the rest of the crate).
    pub async fn secrets_manager(secret_id: &str, options: SecretsManagerOptions) -> SecretSource {
        crate::tls::install_crypto_provider();
        let http = aws_smithy_http_client::Builder::new()
            .tls_provider(aws_smithy_http_client::tls::Provider::Rustls(
                aws_smithy_http_client::tls::rustls_provider::CryptoMode::Ring,
            ))
            .build_https();
        let mut loader =
            aws_config::defaults(aws_config::BehaviorVersion::latest()).http_client(http);
        if let Some(url) = options.endpoint_url {
            loader = loader.endpoint_url(url);
        }
        if let Some(region) = options.region {
            loader = loader.region(aws_config::Region::new(region));
        }
        if let Some((id, secret)) = options.static_credentials {
            loader =
                loader.credentials_provider(Credentials::new(id, secret, None, None, "static"));
        }
        let sdk = loader.load().await;
        SecretSource::SecretsManager {
            client: aws_sdk_secretsmanager::Client::new(&sdk),
            secret_id: secret_id.to_owned(),
            warned_withheld: Arc::default(),
        }
    }

    /// Loads the secrets, requiring the `needed` fields. A secret that holds a QStash token although `needed`
    /// does not ask for it (a receiver's) gets one warning per source, naming the field, never its value; the
    /// token is not kept ([`Secrets::withheld`]).
    #[tracing::instrument(name = "secrets.load", skip_all, fields(source = ?self))]
    pub async fn load(&self, needed: &[SecretField]) -> Result<Secrets, ConfigError> {
        match self {
            SecretSource::Env(env) => Secrets::from_env(env.as_ref(), needed),
            SecretSource::SecretsManager {
                client,
                secret_id,
                warned_withheld,
            } => {
                let out = client
                    .get_secret_value()
                    .secret_id(secret_id)
                    .send()
                    .await
                    .map_err(|e| ConfigError::SecretFetch {
                        secret_id: secret_id.clone(),
                        reason: aws_sdk_secretsmanager::error::DisplayErrorContext(&e).to_string(),
                    })?;
                let text = out
                    .secret_string()
                    .ok_or_else(|| ConfigError::MalformedSecret {
                        origin: secret_id.clone(),
                        reason: "the secret has no SecretString (binary secrets are not supported)"
                            .into(),
                    })?;
                let secrets = Secrets::parse_json(secret_id, text, needed)?;
                if secrets.withheld.contains(&SecretField::QstashToken)
                    && !warned_withheld.swap(true, Ordering::Relaxed)
                {
                    tracing::warn!(
                        secret_id = %secret_id,
                        field = SecretField::QstashToken.name(),
                        "{WITHHELD_TOKEN_WARNING}"
                    );
                }
                Ok(secrets)
            }
        }
    }
}

/// The QStash dev server's documented token (base64 of `{"UserID":"defaultUser","Password":"defaultPassword"}`).
///
/// The three values below are public: they are the defaults of QStash's own local dev server, which
/// `qstash-dev/src/config.rs` (`DEV_TOKEN`, `DEV_CURRENT_SIGNING_KEY`, `DEV_NEXT_SIGNING_KEY`) copies, and they are
/// printed in QStash's documentation. Anyone can publish with the token and sign deliveries with the keys, so the
/// functions refuse to start with any of them ([`refuse_dev_values`]) unless [`ALLOW_DEV_KEYS_VAR`] opts in. This
/// is the library's one copy of them (it does not depend on `qstash-dev`).
pub const DEV_QSTASH_TOKEN: &str =
    "eyJVc2VySUQiOiJkZWZhdWx0VXNlciIsIlBhc3N3b3JkIjoiZGVmYXVsdFBhc3N3b3JkIn0=";
/// The QStash dev server's documented current signing key (see [`DEV_QSTASH_TOKEN`]).
pub const DEV_CURRENT_SIGNING_KEY: &str = "sig_7kYjw48mhY7kAjqNGcy6cr29RJ6r";
/// The QStash dev server's documented next signing key (see [`DEV_QSTASH_TOKEN`]).
pub const DEV_NEXT_SIGNING_KEY: &str = "sig_5ZB6DVzB1wjE8S6rZ7eenA8Pdnhs";

/// `OUTBOX_ALLOW_DEV_KEYS` (default false): lets a function start with the QStash dev server's public token or
/// signing keys. Only for local runs against `qstash-dev` (`outbox-dev`, `cargo lambda watch`, the tests); never
/// set it in a deployment.
pub const ALLOW_DEV_KEYS_VAR: &str = "OUTBOX_ALLOW_DEV_KEYS";

/// Refuses secrets that hold one of the dev server's public values ([`DEV_QSTASH_TOKEN`],
/// [`DEV_CURRENT_SIGNING_KEY`], [`DEV_NEXT_SIGNING_KEY`]) in any field, unless `OUTBOX_ALLOW_DEV_KEYS=true` in
/// `vars`: with those, anyone can sign deliveries a receiver accepts, or publish as the relay. The error names the
/// field and the setting, never a value. Checks only the fields that were loaded (a receiver never keeps the
/// token). With the opt-in set and a public value in use, logs one warning.
pub(crate) fn refuse_dev_values(secrets: &Secrets, vars: &Vars<'_>) -> Result<(), ConfigError> {
    let public = [
        DEV_QSTASH_TOKEN,
        DEV_CURRENT_SIGNING_KEY,
        DEV_NEXT_SIGNING_KEY,
    ];
    let found = [
        SecretField::QstashToken,
        SecretField::CurrentSigningKey,
        SecretField::NextSigningKey,
    ]
    .into_iter()
    .find(|f| {
        secrets
            .get(*f)
            .is_ok_and(|v| public.contains(&v.expose_secret().trim()))
    });
    let Some(field) = found else {
        return Ok(());
    };
    if vars.bool_or(ALLOW_DEV_KEYS_VAR, false)? {
        tracing::warn!(
            field = field.name(),
            "{} holds the QStash dev server's public value, allowed by {ALLOW_DEV_KEYS_VAR}=true: never in a \
             deployment",
            field.name()
        );
        return Ok(());
    }
    Err(ConfigError::DevCredential {
        origin: secrets.origin().to_owned(),
        field: field.name(),
        risk: match field {
            SecretField::QstashToken => "it is public, so it authenticates nobody",
            _ => "it is public, so anyone can sign deliveries that the receivers accept",
        },
    })
}

/// The warning logged when a receiver's secret holds the QStash token.
pub const WITHHELD_TOKEN_WARNING: &str = "this secret holds QSTASH_TOKEN, but this function only verifies \
     QStash signatures and never publishes: the receiver secret should not hold the QStash token (anyone who \
     reads it can publish messages that QStash then signs). The token was ignored; remove the field from this \
     secret (README, Deploy: \"Fill the secrets\")";

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    const ALL: &[SecretField] = &SecretField::ALL;

    #[test]
    fn parses_a_complete_secret() {
        let s = Secrets::parse_json(
            "app/outbox",
            r#"{"DATABASE_URL":"postgres://u:p@h/db","QSTASH_TOKEN":"tok","QSTASH_CURRENT_SIGNING_KEY":"sig_a","QSTASH_NEXT_SIGNING_KEY":"sig_b","other":1}"#,
            ALL,
        )
        .unwrap();
        assert_eq!(
            s.get(SecretField::QstashToken).unwrap().expose_secret(),
            "tok"
        );
        assert_eq!(
            s.get(SecretField::NextSigningKey).unwrap().expose_secret(),
            "sig_b"
        );
    }

    #[test]
    fn missing_field_is_named() {
        let err = Secrets::parse_json("app/outbox", r#"{"DATABASE_URL":"postgres://x"}"#, ALL)
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "secret app/outbox has no field QSTASH_TOKEN (a non-empty string is required)"
        );
        // Only what a function needs is required.
        let s = Secrets::parse_json(
            "app/outbox",
            r#"{"DATABASE_URL":"postgres://x"}"#,
            &[SecretField::DatabaseUrl],
        );
        assert!(s.is_ok());
    }

    #[test]
    fn malformed_json_never_echoes_content() {
        let err = Secrets::parse_json(
            "app/outbox",
            r#"{"DATABASE_URL": "postgres://user:hunter2@h/db""#,
            ALL,
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.starts_with("secret app/outbox is malformed: not valid JSON"),
            "{err}"
        );
        assert!(!err.contains("hunter2"), "{err}");
        let err = Secrets::parse_json("s", r#"{"QSTASH_TOKEN": 12345678}"#, ALL)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("field QSTASH_TOKEN must be a string") && !err.contains("12345678"),
            "{err}"
        );
        let err = Secrets::parse_json("s", r#"["hunter2"]"#, ALL)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("JSON object") && !err.contains("hunter2"),
            "{err}"
        );
    }

    #[test]
    fn debug_redacts_values() {
        let s = Secrets::from_values(
            Some("postgres://u:hunter2@h/db"),
            Some("tok-hunter2"),
            None,
            None,
        );
        let d = format!("{s:?}");
        assert!(!d.contains("hunter2"), "{d}");
    }

    const FULL: &str = r#"{"DATABASE_URL":"postgres://u:p@h/db","QSTASH_TOKEN":"tok-hunter2","QSTASH_CURRENT_SIGNING_KEY":"sig_a","QSTASH_NEXT_SIGNING_KEY":"sig_b"}"#;

    #[test]
    fn the_token_is_kept_only_when_asked_for() {
        // A receiver (its start-up load, then a signing-key refresh): no token, the optional next key kept. (That
        // the receiver's list is the first one is checked in `receiver::keys`, which may use this module.)
        for needed in [
            &[
                SecretField::DatabaseUrl,
                SecretField::CurrentSigningKey,
                SecretField::NextSigningKey,
            ][..],
            &[SecretField::CurrentSigningKey],
        ] {
            let s = Secrets::parse_json("receiver", FULL, needed).unwrap();
            assert!(
                matches!(
                    s.get(SecretField::QstashToken),
                    Err(ConfigError::MissingSecretField {
                        field: "QSTASH_TOKEN",
                        ..
                    })
                ),
                "{needed:?}"
            );
            assert_eq!(s.withheld(), &[SecretField::QstashToken]);
            assert_eq!(
                s.get(SecretField::NextSigningKey).unwrap().expose_secret(),
                "sig_b"
            );
            assert!(!format!("{s:?}").contains("hunter2"));
        }
        // The relay asks for it.
        let s = Secrets::parse_json(
            "relay",
            FULL,
            &[SecretField::DatabaseUrl, SecretField::QstashToken],
        )
        .unwrap();
        assert_eq!(
            s.get(SecretField::QstashToken).unwrap().expose_secret(),
            "tok-hunter2"
        );
        assert!(s.withheld().is_empty());
        // Present but empty: nothing withheld.
        let s = Secrets::parse_json(
            "receiver",
            r#"{"DATABASE_URL":"postgres://x","QSTASH_TOKEN":" ","QSTASH_CURRENT_SIGNING_KEY":"k"}"#,
            &[SecretField::CurrentSigningKey],
        )
        .unwrap();
        assert!(s.withheld().is_empty());
        // The environment fallback keeps it only when asked for, too.
        let env: HashMap<String, String> =
            [("QSTASH_TOKEN", "tok"), ("DATABASE_URL", "postgres://x")]
                .into_iter()
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
                .collect();
        let s = Secrets::from_env(&env, &[SecretField::DatabaseUrl]).unwrap();
        assert!(s.get(SecretField::QstashToken).is_err());
        let s = Secrets::from_env(&env, &[SecretField::QstashToken]).unwrap();
        assert!(s.get(SecretField::QstashToken).is_ok());
    }

    #[test]
    fn env_fallback_requires_needed_fields() {
        let mut env: HashMap<String, String> = HashMap::new();
        env.insert("DATABASE_URL".into(), "postgres://x".into());
        let s = Secrets::from_env(&env, &[SecretField::DatabaseUrl]).unwrap();
        assert_eq!(s.origin(), "environment");
        let err = Secrets::from_env(
            &env,
            &[SecretField::DatabaseUrl, SecretField::CurrentSigningKey],
        )
        .unwrap_err();
        assert_eq!(
            err.to_string(),
            "secret environment has no field QSTASH_CURRENT_SIGNING_KEY (a non-empty string is required)"
        );
    }
}
