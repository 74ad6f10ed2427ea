//! Configuration and secrets: environment only, Secrets Manager through a local moto server, a missing field,
//! malformed JSON. Each load error must name what is wrong without echoing secret values.

mod common;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use outbox::config::{
    ConfigError, ConsumerConfig, DeadHeadPolicy, LegacyDeliveries, QstashConfig, RelayConfig, Vars,
};
use outbox::db::DbConfig;
use outbox::secrets::{SecretField, SecretSource, SecretsManagerOptions};
use secrecy::ExposeSecret;

fn env(pairs: &[(&str, &str)]) -> Arc<HashMap<String, String>> {
    Arc::new(
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
    )
}

#[tokio::test]
async fn env_only_configuration_loads_every_section() {
    let e = env(&[
        ("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/app"),
        ("QSTASH_TOKEN", "tok"),
        ("QSTASH_CURRENT_SIGNING_KEY", "sig_current"),
        ("QSTASH_NEXT_SIGNING_KEY", "sig_next"),
        ("QSTASH_URL", "http://127.0.0.1:8080/"),
        ("CONSUMER_URL", "https://consumer.example.com"),
        ("CALLBACK_URL", "https://callback.example.com/"),
        ("RELAY_BATCH_SIZE", "250"),
        ("RELAY_SKIP_DEAD_HEAD_TOPICS", "audit, payments"),
        ("DB_PERSISTENT_STATEMENTS", "false"),
        ("PUBLIC_BASE_URL", "https://abc.lambda-url.eu-west-1.on.aws"),
    ]);
    let vars = Vars::new(e.as_ref());
    let q = QstashConfig::from_vars(&vars).unwrap();
    assert_eq!(q.base_url, "http://127.0.0.1:8080");
    assert_eq!(q.callback_url, "https://callback.example.com");
    assert_eq!(q.retries, 5);
    let r = RelayConfig::from_vars(&vars, q.retries).unwrap();
    assert_eq!(r.batch_size, 250);
    assert_eq!(r.max_attempts, 12);
    assert_eq!(r.backoff_base, Duration::from_secs(30));
    assert_eq!(r.dead_head_policy("payments"), DeadHeadPolicy::Skip);
    assert_eq!(r.dead_head_policy("orders"), DeadHeadPolicy::Block);
    // QStash's retry horizon for 5 retries is ~30.7 h; the evidence timeout adds an hour.
    assert!(
        r.evidence_timeout > Duration::from_secs(30 * 3600)
            && r.evidence_timeout < Duration::from_secs(33 * 3600)
    );
    let c = ConsumerConfig::from_vars(&vars).unwrap();
    assert_eq!(
        c.public_base_url.as_deref(),
        Some("https://abc.lambda-url.eu-west-1.on.aws")
    );
    let d = DbConfig::from_vars(&vars, "relay").unwrap();
    assert!(!d.persistent_statements);

    let source = SecretSource::from_env(e.clone()).await;
    assert!(matches!(source, SecretSource::Env(_)));
    let s = source.load(&SecretField::ALL).await.unwrap();
    assert_eq!(
        s.get(SecretField::CurrentSigningKey)
            .unwrap()
            .expose_secret(),
        "sig_current"
    );
    assert_eq!(
        s.get(SecretField::DatabaseUrl).unwrap().expose_secret(),
        "postgres://postgres@127.0.0.1:5432/app"
    );
}

#[test]
fn receiver_contract_settings_default_to_the_safe_side() {
    // Without settings: the sub URL comes from the function URL (forwarded headers ignored) and deliveries in
    // the previous wire format are verified against the outbox row.
    let c = ConsumerConfig::from_vars(&Vars::new(env(&[]).as_ref())).unwrap();
    assert!(!c.trust_forwarded_headers);
    assert_eq!(c.legacy_deliveries, LegacyDeliveries::Verify);
    let d = ConsumerConfig::defaults();
    assert!(!d.trust_forwarded_headers);
    assert_eq!(d.legacy_deliveries, LegacyDeliveries::Verify);

    let e = env(&[
        ("TRUST_FORWARDED_HEADERS", "true"),
        ("LEGACY_DELIVERIES", "refuse"),
    ]);
    let c = ConsumerConfig::from_vars(&Vars::new(e.as_ref())).unwrap();
    assert!(c.trust_forwarded_headers);
    assert_eq!(c.legacy_deliveries, LegacyDeliveries::Refuse);
    let e = env(&[("LEGACY_DELIVERIES", "verify")]);
    let c = ConsumerConfig::from_vars(&Vars::new(e.as_ref())).unwrap();
    assert_eq!(c.legacy_deliveries, LegacyDeliveries::Verify);

    for (name, value) in [
        ("LEGACY_DELIVERIES", "accept"),
        ("TRUST_FORWARDED_HEADERS", "maybe"),
    ] {
        let e = env(&[(name, value)]);
        let err = ConsumerConfig::from_vars(&Vars::new(e.as_ref())).unwrap_err();
        assert!(
            matches!(&err, ConfigError::InvalidVar { name: n, .. } if *n == name),
            "{err}"
        );
    }
}

#[tokio::test]
async fn env_only_missing_values_are_named() {
    let e = env(&[("DATABASE_URL", "postgres://x@h/db")]);
    let err = QstashConfig::from_vars(&Vars::new(e.as_ref())).unwrap_err();
    assert!(
        matches!(
            err,
            ConfigError::MissingVar {
                name: "CONSUMER_URL",
                ..
            }
        ),
        "{err}"
    );
    let err = SecretSource::Env(e.clone())
        .load(&[SecretField::DatabaseUrl, SecretField::QstashToken])
        .await
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "secret environment has no field QSTASH_TOKEN (a non-empty string is required)"
    );
}

async fn moto_source(moto: &common::Moto, secret_id: &str) -> SecretSource {
    SecretSource::secrets_manager(
        secret_id,
        SecretsManagerOptions {
            endpoint_url: Some(moto.endpoint.clone()),
            region: Some("us-east-1".into()),
            static_credentials: Some(("test".into(), "test".into())),
        },
    )
    .await
}

async fn create_secret(source: &SecretSource, name: &str, value: &str) {
    let SecretSource::SecretsManager { client, .. } = source else {
        panic!("expected a Secrets Manager source")
    };
    client
        .create_secret()
        .name(name)
        .secret_string(value)
        .send()
        .await
        .expect("create_secret against moto");
}

#[tokio::test]
async fn secrets_manager_through_local_moto() {
    let moto = common::start_moto();
    let source = moto_source(&moto, "outbox/app").await;
    create_secret(
        &source,
        "outbox/app",
        r#"{"DATABASE_URL":"postgres://app:pw@db:5432/app","QSTASH_TOKEN":"qstash-token","QSTASH_CURRENT_SIGNING_KEY":"sig_cur","QSTASH_NEXT_SIGNING_KEY":"sig_nxt"}"#,
    )
    .await;
    let s = source.load(&SecretField::ALL).await.unwrap();
    assert_eq!(s.origin(), "outbox/app");
    assert_eq!(
        s.get(SecretField::QstashToken).unwrap().expose_secret(),
        "qstash-token"
    );
    assert_eq!(
        s.get(SecretField::NextSigningKey).unwrap().expose_secret(),
        "sig_nxt"
    );

    // A field missing from the secret is named; a function that does not need it still starts.
    let partial = moto_source(&moto, "outbox/partial").await;
    create_secret(
        &partial,
        "outbox/partial",
        r#"{"DATABASE_URL":"postgres://app:pw@db/app","QSTASH_TOKEN":"t"}"#,
    )
    .await;
    let err = partial
        .load(&[SecretField::DatabaseUrl, SecretField::CurrentSigningKey])
        .await
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "secret outbox/partial has no field QSTASH_CURRENT_SIGNING_KEY (a non-empty string is required)"
    );
    assert!(
        partial
            .load(&[SecretField::DatabaseUrl, SecretField::QstashToken])
            .await
            .is_ok()
    );

    // Malformed JSON: a clear error, never the content.
    let bad = moto_source(&moto, "outbox/bad").await;
    create_secret(
        &bad,
        "outbox/bad",
        r#"{"DATABASE_URL":"postgres://app:hunter2@db/app","#,
    )
    .await;
    let err = bad
        .load(&[SecretField::DatabaseUrl])
        .await
        .unwrap_err()
        .to_string();
    assert!(
        err.starts_with("secret outbox/bad is malformed: not valid JSON"),
        "{err}"
    );
    assert!(!err.contains("hunter2"), "{err}");

    // A secret that does not exist: the fetch error names the secret.
    let missing = moto_source(&moto, "outbox/nope").await;
    let err = missing.load(&[SecretField::DatabaseUrl]).await.unwrap_err();
    assert!(
        matches!(&err, ConfigError::SecretFetch { secret_id, .. } if secret_id == "outbox/nope"),
        "{err}"
    );
}

#[tokio::test]
async fn outbox_secret_id_selects_secrets_manager() {
    let e = env(&[
        (
            "OUTBOX_SECRET_ID",
            "arn:aws:secretsmanager:us-east-1:123:secret:x",
        ),
        ("AWS_REGION", "us-east-1"),
    ]);
    let source = SecretSource::from_env(e).await;
    assert!(
        matches!(source, SecretSource::SecretsManager { ref secret_id, .. } if secret_id.ends_with(":x"))
    );
}
