//! Configuration and secrets: environment only, Secrets Manager through a local moto server, a missing field,
//! malformed JSON, a receiver secret that holds the QStash token, the dev server's public keys refused at start, the
//! receivers' bounded and new settings. Each load error must name what is wrong without echoing secret values.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use outbox::config::{
    ConfigError, ConsumerConfig, DeadHeadPolicy, LegacyDeliveries, QstashConfig, RelayConfig, Vars,
};
use outbox::db::DbConfig;
use outbox::internals::handler::RelayState;
use outbox::internals::receiver::{RECEIVER_SECRETS, Receiver, ReceiverState};
use outbox::internals::secrets::{
    ALLOW_DEV_KEYS_VAR, DEV_CURRENT_SIGNING_KEY, DEV_NEXT_SIGNING_KEY, DEV_QSTASH_TOKEN,
    SecretField, SecretSource, SecretsManagerOptions, WITHHELD_TOKEN_WARNING,
};
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
    assert_eq!(d.statements, outbox::db::Statements::Unnamed);

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

async fn moto_source(moto: &outbox_testkit::moto::Moto, secret_id: &str) -> SecretSource {
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
    let moto = outbox_testkit::moto::start_moto();
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

/// Everything a subscriber configured like the functions' (JSON lines with the current span, the telemetry's caps
/// on sqlx/hyper/aws) writes, at TRACE, the most verbose `LogLevel` the stack offers.
#[derive(Clone, Default)]
struct Captured(Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Captured {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }
    fn subscriber(&self) -> impl tracing::Subscriber + Send + Sync + 'static {
        let sink = self.clone();
        tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new(
                "trace,sqlx=warn,hyper=warn,aws=warn",
            ))
            .with_writer(move || sink.clone())
            .with_ansi(false)
            .json()
            .flatten_event(true)
            .with_current_span(true)
            .finish()
    }
}

#[tokio::test]
async fn a_receiver_secret_holding_the_qstash_token_warns_once_and_never_keeps_it() {
    const TOKEN: &str = "qstash-token-c0ffee-do-not-leak";
    let moto = outbox_testkit::moto::start_moto();
    let log = Captured::default();
    let _guard = tracing::subscriber::set_default(log.subscriber());

    // The old single secret given to a receiver: every field, the token included.
    let source = moto_source(&moto, "outbox/receiver-with-token").await;
    create_secret(
        &source,
        "outbox/receiver-with-token",
        &format!(
            r#"{{"DATABASE_URL":"postgres://app:pw@db/app","QSTASH_TOKEN":"{TOKEN}","QSTASH_CURRENT_SIGNING_KEY":"sig_cur","QSTASH_NEXT_SIGNING_KEY":"sig_nxt"}}"#
        ),
    )
    .await;
    // What a receiver loads at start, then at a signing-key refresh.
    let at_start = source.load(&RECEIVER_SECRETS).await.unwrap();
    let refreshed = source
        .load(&[SecretField::CurrentSigningKey])
        .await
        .unwrap();
    for s in [&at_start, &refreshed] {
        assert!(
            matches!(
                s.get(SecretField::QstashToken),
                Err(ConfigError::MissingSecretField {
                    field: "QSTASH_TOKEN",
                    ..
                })
            ),
            "the receiver kept the token"
        );
        assert_eq!(s.withheld(), &[SecretField::QstashToken]);
        for field in SecretField::ALL {
            if let Ok(v) = s.get(field) {
                assert!(!v.expose_secret().contains(TOKEN), "{field:?}");
            }
        }
        assert!(!format!("{s:?}").contains(TOKEN));
        assert_eq!(
            s.get(SecretField::NextSigningKey).unwrap().expose_secret(),
            "sig_nxt"
        );
    }
    assert_eq!(
        at_start
            .get(SecretField::DatabaseUrl)
            .unwrap()
            .expose_secret(),
        "postgres://app:pw@db/app"
    );

    // One warning (at start, not again at the refresh) naming the field, the secret and the README section.
    let text = log.text();
    assert!(!text.contains(TOKEN), "the token reached the log:\n{text}");
    let warnings: Vec<serde_json::Value> = text
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|l| l["level"] == "WARN")
        .collect();
    assert_eq!(warnings.len(), 1, "{text}");
    let w = &warnings[0];
    assert_eq!(w["message"], WITHHELD_TOKEN_WARNING, "{w}");
    assert_eq!(w["field"], "QSTASH_TOKEN", "{w}");
    assert_eq!(w["secret_id"], "outbox/receiver-with-token", "{w}");
    let message = w["message"].as_str().unwrap();
    assert!(
        message.contains("receiver secret should not hold the QStash token")
            && message.contains("\"Fill the secrets\""),
        "{message}"
    );
    // The section it names exists.
    let readme = std::fs::read_to_string(outbox_testkit::repo_root().join("README.md")).unwrap();
    assert!(readme.contains("\n### Fill the secrets\n"));

    // The relay's secret: the relay asks for the token and gets it, without a warning; a receiver secret whose
    // QSTASH_TOKEN is empty (as the old single secret was created) loads without one too.
    let relay = moto_source(&moto, "outbox/relay").await;
    create_secret(
        &relay,
        "outbox/relay",
        &format!(r#"{{"DATABASE_URL":"postgres://app:pw@db/app","QSTASH_TOKEN":"{TOKEN}"}}"#),
    )
    .await;
    let s = relay
        .load(&[SecretField::DatabaseUrl, SecretField::QstashToken])
        .await
        .unwrap();
    assert_eq!(
        s.get(SecretField::QstashToken).unwrap().expose_secret(),
        TOKEN
    );
    let receiver = moto_source(&moto, "outbox/receiver").await;
    create_secret(
        &receiver,
        "outbox/receiver",
        r#"{"DATABASE_URL":"postgres://app:pw@db/app","QSTASH_TOKEN":"","QSTASH_CURRENT_SIGNING_KEY":"sig_cur","QSTASH_NEXT_SIGNING_KEY":"sig_nxt"}"#,
    )
    .await;
    let s = receiver.load(&RECEIVER_SECRETS).await.unwrap();
    assert!(s.withheld().is_empty());
    let text = log.text();
    assert!(!text.contains(TOKEN), "the token reached the log:\n{text}");
    assert_eq!(
        text.lines()
            .filter(|l| l.contains("\"level\":\"WARN\""))
            .count(),
        1,
        "{text}"
    );
}

fn consumer(pairs: &[(&str, &str)]) -> Result<ConsumerConfig, ConfigError> {
    let e = env(pairs);
    ConsumerConfig::from_vars(&Vars::new(e.as_ref()))
}

fn refused(pairs: &[(&str, &str)]) -> String {
    consumer(pairs)
        .expect_err("the value was accepted")
        .to_string()
}

#[test]
fn the_clock_tolerance_is_at_most_a_minute() {
    assert_eq!(consumer(&[]).unwrap().clock_tolerance, Duration::ZERO);
    assert_eq!(
        consumer(&[("SIGNATURE_CLOCK_TOLERANCE_SECS", "60")])
            .unwrap()
            .clock_tolerance,
        Duration::from_secs(60)
    );
    assert_eq!(
        refused(&[("SIGNATURE_CLOCK_TOLERANCE_SECS", "61")]),
        "environment variable SIGNATURE_CLOCK_TOLERANCE_SECS=\"61\" is invalid: must be at most 60 seconds \
         (a larger tolerance widens the replay window of a leaked token)"
    );
    // Fractions count: a hair over the bound is over it.
    let err = refused(&[("SIGNATURE_CLOCK_TOLERANCE_SECS", "60.5")]);
    assert!(
        err.contains("SIGNATURE_CLOCK_TOLERANCE_SECS=\"60.5\"") && err.contains("at most 60"),
        "{err}"
    );
    let err = refused(&[("SIGNATURE_CLOCK_TOLERANCE_SECS", "-1")]);
    assert!(err.contains("SIGNATURE_CLOCK_TOLERANCE_SECS"), "{err}");
}

#[test]
fn the_secret_refresh_interval_is_at_least_thirty_seconds() {
    assert_eq!(
        consumer(&[]).unwrap().secret_refresh_interval,
        Duration::from_secs(60)
    );
    assert_eq!(
        consumer(&[("SECRET_REFRESH_INTERVAL_SECS", "30")])
            .unwrap()
            .secret_refresh_interval,
        Duration::from_secs(30)
    );
    assert_eq!(
        refused(&[("SECRET_REFRESH_INTERVAL_SECS", "29")]),
        "environment variable SECRET_REFRESH_INTERVAL_SECS=\"29\" is invalid: must be at least 30 seconds \
         (each refresh is a Secrets Manager call that a bad signature can trigger)"
    );
    for v in ["29.9", "0"] {
        let err = refused(&[("SECRET_REFRESH_INTERVAL_SECS", v)]);
        assert!(
            err.contains(&format!("SECRET_REFRESH_INTERVAL_SECS=\"{v}\""))
                && err.contains("at least 30"),
            "{err}"
        );
    }
    // No upper bound: an hour is fine.
    assert!(consumer(&[("SECRET_REFRESH_INTERVAL_SECS", "3600")]).is_ok());
}

#[test]
fn forwarded_headers_are_trusted_only_when_asked() {
    assert!(!consumer(&[]).unwrap().trust_forwarded_headers);
    assert!(!ConsumerConfig::defaults().trust_forwarded_headers);
    for (v, want) in [
        ("true", true),
        ("TRUE", true),
        ("1", true),
        ("false", false),
        ("off", false),
    ] {
        assert_eq!(
            consumer(&[("TRUST_FORWARDED_HEADERS", v)])
                .unwrap()
                .trust_forwarded_headers,
            want,
            "{v}"
        );
    }
    let err = refused(&[("TRUST_FORWARDED_HEADERS", "proxy")]);
    assert_eq!(
        err,
        "environment variable TRUST_FORWARDED_HEADERS=\"proxy\" is invalid: expected true or false"
    );
}

#[test]
fn legacy_deliveries_are_verified_unless_refused() {
    assert_eq!(
        consumer(&[]).unwrap().legacy_deliveries,
        LegacyDeliveries::Verify
    );
    assert_eq!(
        ConsumerConfig::defaults().legacy_deliveries,
        LegacyDeliveries::Verify
    );
    for (v, want) in [
        ("verify", LegacyDeliveries::Verify),
        (" Verify ", LegacyDeliveries::Verify),
        ("refuse", LegacyDeliveries::Refuse),
        ("REFUSE", LegacyDeliveries::Refuse),
    ] {
        assert_eq!(
            consumer(&[("LEGACY_DELIVERIES", v)])
                .unwrap()
                .legacy_deliveries,
            want,
            "{v:?}"
        );
    }
    let err = refused(&[("LEGACY_DELIVERIES", "accept")]);
    assert_eq!(
        err,
        "environment variable LEGACY_DELIVERIES=\"accept\" is invalid: expected verify or refuse"
    );
}

/// An invocation budget that cannot hold one lease plus the deadline margin is refused with both values named (the CLI's `--invocation-secs` and the Lambda share this check), not run as a silent spin.
#[test]
fn an_invocation_shorter_than_a_lease_plus_the_margin_is_refused() {
    let e = env(&[]);
    let relay = RelayConfig::from_vars(&Vars::new(e.as_ref()), 5).unwrap();
    assert_eq!(relay.lease, Duration::from_secs(15));
    assert_eq!(relay.deadline_margin, Duration::from_secs(3));
    let err = relay
        .check_invocation_budget(Duration::from_secs(10), "--invocation-secs")
        .unwrap_err();
    assert!(matches!(err, ConfigError::InvocationTooShort { .. }));
    let msg = err.to_string();
    for part in [
        "--invocation-secs of 10 s",
        "RELAY_LEASE_SECS",
        "15 s",
        "3000 ms",
    ] {
        assert!(msg.contains(part), "{part:?} missing from: {msg}");
    }
    // Exactly a lease plus the margin fits; the defaults' Lambda timeout (75 s) does too.
    relay
        .check_invocation_budget(Duration::from_secs(18), "--invocation-secs")
        .unwrap();
    relay
        .check_invocation_budget(Duration::from_secs(75), "the Lambda timeout")
        .unwrap();
    assert!(
        relay
            .check_invocation_budget(Duration::from_millis(17_999), "the Lambda timeout")
            .is_err()
    );
}

/// A reconciler that could act after the consumer's dedupe rows are gone is refused at start, naming the settings,
/// their values and what to change: its horizon (plus an hour) must stay inside `PROCESSED_TTL_HOURS`, and while it
/// may publish events again, the horizon plus a republished message's own delivery (QStash's retries) too.
#[test]
fn a_reconciler_that_could_outlive_the_dedupe_rows_is_refused_at_start() {
    let relay = |pairs: &[(&str, &str)]| {
        let e = env(pairs);
        RelayConfig::from_vars(&Vars::new(e.as_ref()), 5)
    };
    // The defaults fit: horizon ≈ 65.3 h, a republished message delivered within ≈ 32.2 h, dedupe rows 168 h.
    relay(&[]).unwrap();
    // Dedupe rows kept 48 h: the horizon alone reaches past them.
    let err = relay(&[("PROCESSED_TTL_HOURS", "48")])
        .unwrap_err()
        .to_string();
    for part in [
        "RELAY_RECONCILE_AFTER_SECS",
        "PROCESSED_TTL_HOURS",
        "48 h",
        "65.3 h",
        "at least 67 h",
    ] {
        assert!(err.contains(part), "{part:?} missing from: {err}");
    }
    // 90 h: the horizon fits, but a republished event could still be delivered 98.5 h after its first claim.
    let err = relay(&[("PROCESSED_TTL_HOURS", "90")])
        .unwrap_err()
        .to_string();
    for part in [
        "RELAY_RECONCILE_MAX_REPUBLISH",
        "QSTASH_RETRIES",
        "90 h",
        "32.2 h",
        "at least 99 h",
        "RELAY_RECONCILE_MAX_REPUBLISH=0",
    ] {
        assert!(err.contains(part), "{part:?} missing from: {err}");
    }
    // Without republishing that is fine; without the reconciler, so is 48 h.
    relay(&[
        ("PROCESSED_TTL_HOURS", "90"),
        ("RELAY_RECONCILE_MAX_REPUBLISH", "0"),
    ])
    .unwrap();
    relay(&[
        ("PROCESSED_TTL_HOURS", "48"),
        ("RELAY_RECONCILE_MAX_LOOKUPS", "0"),
    ])
    .unwrap();
    // A shorter horizon, or dedupe rows kept longer, fit too.
    relay(&[
        ("PROCESSED_TTL_HOURS", "90"),
        ("RELAY_RECONCILE_AFTER_SECS", "36000"),
    ])
    .unwrap();
    relay(&[("PROCESSED_TTL_HOURS", "99")]).unwrap();
    // More QStash retries lengthen both the horizon and a message's delivery: 6 retries need 172 h.
    let e = env(&[]);
    let err = RelayConfig::from_vars(&Vars::new(e.as_ref()), 6)
        .unwrap_err()
        .to_string();
    assert!(err.contains("at least 172 h"), "{err}");
}

#[test]
fn the_outage_probe_settings_are_bounded() {
    let relay = |pairs: &[(&str, &str)]| {
        let e = env(pairs);
        RelayConfig::from_vars(&Vars::new(e.as_ref()), 5)
    };
    let d = relay(&[]).unwrap();
    assert_eq!(d.outage_probe_base, Duration::from_secs(2));
    assert_eq!(d.outage_probe_cap, Duration::from_secs(300));
    let err = relay(&[("RELAY_OUTAGE_PROBE_BASE_MS", "10")])
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("RELAY_OUTAGE_PROBE_BASE_MS") && err.contains("at least 100 ms"),
        "{err}"
    );
    let err = relay(&[
        ("RELAY_OUTAGE_PROBE_BASE_MS", "5000"),
        ("RELAY_OUTAGE_PROBE_CAP_SECS", "4"),
    ])
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("RELAY_OUTAGE_PROBE_CAP_SECS") && err.contains("at least 5 seconds"),
        "{err}"
    );
    assert!(relay(&[("RELAY_OUTAGE_PROBE_CAP_SECS", "3601")]).is_err());
}

/// Delivery batching settings: the default N events per message (`DEFAULT_DELIVERY_BATCH`) and message size cap;
/// per-topic overrides; every malformed value is refused with the variable and the problem named.
#[test]
fn the_delivery_batch_settings_are_validated() {
    let relay = |pairs: &[(&str, &str)]| {
        let e = env(pairs);
        RelayConfig::from_vars(&Vars::new(e.as_ref()), 5)
    };
    let d = relay(&[]).unwrap().batching;
    assert_eq!(d.default_n, outbox::config::DEFAULT_DELIVERY_BATCH);
    assert_eq!(d.max_message_bytes, 1_000_000);
    assert_eq!(d.any_batching(), outbox::config::DEFAULT_DELIVERY_BATCH > 1);
    let b = relay(&[
        ("RELAY_DELIVERY_BATCH", "20"),
        ("RELAY_DELIVERY_BATCH_TOPICS", " orders = 5, audit=1000 "),
        ("QSTASH_MAX_MESSAGE_BYTES", "500000"),
    ])
    .unwrap()
    .batching;
    assert_eq!(
        (b.n_for("orders"), b.n_for("audit"), b.n_for("other")),
        (5, 1000, 20)
    );
    assert_eq!(b.max_message_bytes, 500_000);
    for (pairs, must) in [
        (vec![("RELAY_DELIVERY_BATCH", "0")], "between 1 and 1000"),
        (vec![("RELAY_DELIVERY_BATCH", "1001")], "between 1 and 1000"),
        (vec![("QSTASH_MAX_MESSAGE_BYTES", "10")], "between 1000"),
        (
            vec![("RELAY_DELIVERY_BATCH_TOPICS", "orders")],
            "is not topic=n",
        ),
        (vec![("RELAY_DELIVERY_BATCH_TOPICS", "=3")], "no topic"),
        (
            vec![("RELAY_DELIVERY_BATCH_TOPICS", "orders=0")],
            "orders: \"0\" must be a whole number between 1 and 1000",
        ),
        (
            vec![("RELAY_DELIVERY_BATCH_TOPICS", "orders=x")],
            "must be a whole number",
        ),
        (
            vec![("RELAY_DELIVERY_BATCH_TOPICS", "a=2,a=3")],
            "listed twice",
        ),
    ] {
        let err = relay(&pairs).unwrap_err().to_string();
        assert!(
            err.contains(pairs[0].0) && err.contains(must),
            "{pairs:?}: {err}"
        );
    }
}

/// The variables a relay and a receiver need, with `overrides` replacing or adding some.
fn startup_env(overrides: &[(&str, &str)]) -> Arc<HashMap<String, String>> {
    let mut pairs: HashMap<String, String> = [
        // The pool connects lazily: nothing is reached at start.
        ("DATABASE_URL", "postgres://postgres@127.0.0.1:1/none"),
        ("QSTASH_URL", "http://127.0.0.1:1"),
        ("QSTASH_TOKEN", "a-real-token"),
        ("QSTASH_CURRENT_SIGNING_KEY", "sig_aRealCurrentKey"),
        ("QSTASH_NEXT_SIGNING_KEY", "sig_aRealNextKey"),
        ("CONSUMER_URL", "https://consumer.example.com"),
        ("CALLBACK_URL", "https://callback.example.com"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v.to_owned()))
    .collect();
    for (k, v) in overrides {
        pairs.insert((*k).to_owned(), (*v).to_owned());
    }
    Arc::new(pairs)
}

async fn start_relay(overrides: &[(&str, &str)]) -> Result<(), String> {
    RelayState::from_env(startup_env(overrides))
        .await
        .map(|_| ())
        .map_err(|e| e.to_string())
}

async fn start_receiver(receiver: Receiver, overrides: &[(&str, &str)]) -> Result<(), String> {
    ReceiverState::from_env_source(receiver, startup_env(overrides))
        .await
        .map(|_| ())
        .map_err(|e| e.to_string())
}

#[tokio::test]
async fn the_functions_refuse_the_dev_servers_public_keys_unless_allowed() {
    // The library's copies are the dev server's values.
    assert_eq!(DEV_QSTASH_TOKEN, qstash_dev::DEV_TOKEN);
    assert_eq!(DEV_CURRENT_SIGNING_KEY, qstash_dev::DEV_CURRENT_SIGNING_KEY);
    assert_eq!(DEV_NEXT_SIGNING_KEY, qstash_dev::DEV_NEXT_SIGNING_KEY);
    // Real values start.
    start_relay(&[]).await.unwrap();
    for r in [Receiver::Consumer, Receiver::Callbacks] {
        start_receiver(r, &[]).await.unwrap();
    }

    let refused = |err: &str, field: &str| {
        assert!(
            err.starts_with(&format!(
                "{field} in secret environment is the QStash dev server's public value"
            )),
            "{err}"
        );
        assert!(err.contains("OUTBOX_ALLOW_DEV_KEYS=true"), "{err}");
        for value in [
            DEV_QSTASH_TOKEN,
            DEV_CURRENT_SIGNING_KEY,
            DEV_NEXT_SIGNING_KEY,
        ] {
            assert!(!err.contains(value), "the value is not echoed: {err}");
        }
    };
    // The relay: the dev token, with or without an explicit "false"; trailing blanks do not hide it.
    let dev_token = format!(" {DEV_QSTASH_TOKEN} ");
    for extra in [None, Some("false"), Some("0")] {
        let mut o = vec![("QSTASH_TOKEN", dev_token.as_str())];
        if let Some(v) = extra {
            o.push((ALLOW_DEV_KEYS_VAR, v));
        }
        refused(&start_relay(&o).await.unwrap_err(), "QSTASH_TOKEN");
    }
    // The receivers: either dev signing key, in either field.
    for r in [Receiver::Consumer, Receiver::Callbacks] {
        for (field, value) in [
            ("QSTASH_CURRENT_SIGNING_KEY", DEV_CURRENT_SIGNING_KEY),
            ("QSTASH_NEXT_SIGNING_KEY", DEV_NEXT_SIGNING_KEY),
            ("QSTASH_NEXT_SIGNING_KEY", DEV_CURRENT_SIGNING_KEY),
        ] {
            refused(
                &start_receiver(r, &[(field, value)]).await.unwrap_err(),
                field,
            );
        }
        // The dev token in a receiver's environment is not kept (only the relay publishes): nothing to refuse.
        start_receiver(r, &[("QSTASH_TOKEN", DEV_QSTASH_TOKEN)])
            .await
            .unwrap();
    }

    // The opt-in: the whole dev set starts.
    let dev = [
        ("QSTASH_TOKEN", DEV_QSTASH_TOKEN),
        ("QSTASH_CURRENT_SIGNING_KEY", DEV_CURRENT_SIGNING_KEY),
        ("QSTASH_NEXT_SIGNING_KEY", DEV_NEXT_SIGNING_KEY),
    ];
    for allow in ["true", "1", "yes"] {
        let mut o = dev.to_vec();
        o.push((ALLOW_DEV_KEYS_VAR, allow));
        start_relay(&o).await.unwrap();
        for r in [Receiver::Consumer, Receiver::Callbacks] {
            start_receiver(r, &o).await.unwrap();
        }
    }
    // A value that is not a boolean is refused like every other.
    let mut o = dev.to_vec();
    o.push((ALLOW_DEV_KEYS_VAR, "please"));
    let err = start_relay(&o).await.unwrap_err();
    assert!(err.contains("OUTBOX_ALLOW_DEV_KEYS=\"please\""), "{err}");
}
