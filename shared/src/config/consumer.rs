//! The receivers' settings (the consumer and the callback function): [`ConsumerConfig`].

use std::time::Duration;

use super::DeadHeadPolicy;
use super::env::{ConfigError, Vars};

/// What the consumer does with a delivery in the pre-upgrade wire format, whose event identity (outbox id, topic)
/// travels only in unsigned headers (`LEGACY_DELIVERIES`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LegacyDeliveries {
    /// `verify` (default): apply it only if the outbox row with that id has the same topic and payload.
    Verify,
    /// `refuse`: dead-letter it without applying.
    Refuse,
}

/// Consumer and callback receiver settings.
#[derive(Debug, Clone)]
pub struct ConsumerConfig {
    /// `CONSUMER_NAME` (default `consumer`): the dedupe namespace in `processed_messages`.
    pub name: String,
    /// `PUBLIC_BASE_URL` (optional): the URL QStash calls, used for the signature's `sub`. When unset the URL
    /// is rebuilt from the request (its host as [`ConsumerConfig::trust_forwarded_headers`] says, raw path, raw
    /// query).
    pub public_base_url: Option<String>,
    /// `MAX_BODY_BYTES` (default 1048576): larger event bodies are refused (413) before verification.
    pub max_body_bytes: usize,
    /// `CALLBACK_MAX_BODY_BYTES` (default 6291456, Lambda's request limit): the cap for QStash callbacks, whose
    /// bodies carry the original message *and* the response base64-encoded (about 1.4× the message plus the
    /// response), so they must not share the event cap: a refused failure callback would lose a dead letter.
    pub callback_max_body_bytes: usize,
    /// `SIGNATURE_CLOCK_TOLERANCE_SECS` (default 0, at most [`MAX_CLOCK_TOLERANCE`] = 60): leeway for the
    /// token's `exp`/`nbf`. A QStash token lives five minutes; every second of tolerance lengthens the window in
    /// which a leaked token can be replayed.
    pub clock_tolerance: Duration,
    /// `SECRET_REFRESH_INTERVAL_SECS` (default 60, at least [`MIN_SECRET_REFRESH_INTERVAL`] = 30): at most one
    /// re-read of the secret per interval when both signing keys fail (key rotation without redeploy). Each
    /// re-read is a Secrets Manager call that anyone sending a bad signature can trigger once per interval and
    /// Lambda environment.
    pub secret_refresh_interval: Duration,
    /// `RELAY_SKIP_DEAD_HEAD_TOPICS`: the failure callback applies the same dead-head policy as the relay.
    pub skip_topics: Vec<String>,
    /// `TRUST_FORWARDED_HEADERS` (default false): without `PUBLIC_BASE_URL`, build the URL compared with the
    /// token's `sub` from `X-Forwarded-Proto`/`X-Forwarded-Host` only when this is true (a proxy in front sets
    /// them); otherwise from what the platform reports (the function URL's `requestContext.domainName`), never
    /// from headers a client can send.
    pub trust_forwarded_headers: bool,
    /// `LEGACY_DELIVERIES` (`verify`, the default, or `refuse`): deliveries in the pre-upgrade wire format.
    pub legacy_deliveries: LegacyDeliveries,
}

/// The largest `SIGNATURE_CLOCK_TOLERANCE_SECS` accepted.
pub const MAX_CLOCK_TOLERANCE: Duration = Duration::from_secs(60);
/// The smallest `SECRET_REFRESH_INTERVAL_SECS` accepted.
pub const MIN_SECRET_REFRESH_INTERVAL: Duration = Duration::from_secs(30);

impl ConsumerConfig {
    /// The defaults (what an empty environment gives): name `consumer`, no public base URL, 1 MiB event cap,
    /// 6 MiB callback cap, clock tolerance 0, secret refresh 60 s, no skip topics, forwarded headers not
    /// trusted, legacy deliveries verified.
    pub fn defaults() -> Self {
        ConsumerConfig {
            name: "consumer".into(),
            public_base_url: None,
            max_body_bytes: 1_048_576,
            callback_max_body_bytes: 6 * 1_048_576,
            clock_tolerance: Duration::ZERO,
            secret_refresh_interval: Duration::from_secs(60),
            skip_topics: Vec::new(),
            trust_forwarded_headers: false,
            legacy_deliveries: LegacyDeliveries::Verify,
        }
    }

    /// Reads the consumer variables.
    pub fn from_vars(v: &Vars<'_>) -> Result<Self, ConfigError> {
        let name = v.raw("CONSUMER_NAME").unwrap_or_else(|| "consumer".into());
        if name.len() > 100 {
            return Err(ConfigError::InvalidVar {
                name: "CONSUMER_NAME",
                value: name,
                reason: "at most 100 characters".into(),
            });
        }
        Ok(ConsumerConfig {
            name,
            public_base_url: v.url("PUBLIC_BASE_URL")?,
            max_body_bytes: v.ranged_or("MAX_BODY_BYTES", 1_048_576, 1024, 64 * 1_048_576)?,
            callback_max_body_bytes: v.ranged_or(
                "CALLBACK_MAX_BODY_BYTES",
                6 * 1_048_576,
                1024,
                64 * 1_048_576,
            )?,
            clock_tolerance: v.duration_within(
                "SIGNATURE_CLOCK_TOLERANCE_SECS",
                Duration::ZERO,
                Duration::ZERO,
                MAX_CLOCK_TOLERANCE,
                "a larger tolerance widens the replay window of a leaked token",
            )?,
            secret_refresh_interval: v.duration_within(
                "SECRET_REFRESH_INTERVAL_SECS",
                Duration::from_secs(60),
                MIN_SECRET_REFRESH_INTERVAL,
                Duration::MAX,
                "each refresh is a Secrets Manager call that a bad signature can trigger",
            )?,
            skip_topics: v.list("RELAY_SKIP_DEAD_HEAD_TOPICS"),
            trust_forwarded_headers: v.bool_or("TRUST_FORWARDED_HEADERS", false)?,
            legacy_deliveries: match v
                .raw("LEGACY_DELIVERIES")
                .map(|m| m.trim().to_ascii_lowercase())
            {
                None => LegacyDeliveries::Verify,
                Some(m) if m == "verify" => LegacyDeliveries::Verify,
                Some(m) if m == "refuse" => LegacyDeliveries::Refuse,
                Some(m) => {
                    return Err(ConfigError::InvalidVar {
                        name: "LEGACY_DELIVERIES",
                        value: m,
                        reason: "expected verify or refuse".into(),
                    });
                }
            },
        })
    }

    /// The policy for a topic's dead heads (same rule as the relay's).
    pub fn dead_head_policy(&self, topic: &str) -> DeadHeadPolicy {
        DeadHeadPolicy::for_topic(&self.skip_topics, topic)
    }
}
