//! Typed configuration from environment variables.
//!
//! Every Lambda reads only the sections it needs, so a variable one function requires never breaks another.
//! Values are parsed into domain types at this edge; an invalid value is a [`ConfigError`] that names the
//! variable (and, for non-secret variables only, the offending value). Secrets are not read here: see
//! [`crate::secrets`].

use std::collections::HashMap;
use std::fmt;
use std::str::FromStr;
use std::time::Duration;

/// Where configuration values come from: the process environment in Lambda, a map in tests.
pub trait EnvSource: Send + Sync {
    /// The value of `key`, if set. Empty strings count as unset.
    fn var(&self, key: &str) -> Option<String>;
}

/// The real process environment.
#[derive(Debug, Clone, Copy, Default)]
pub struct ProcessEnv;

impl EnvSource for ProcessEnv {
    fn var(&self, key: &str) -> Option<String> {
        std::env::var(key).ok().filter(|v| !v.trim().is_empty())
    }
}

impl EnvSource for HashMap<String, String> {
    fn var(&self, key: &str) -> Option<String> {
        self.get(key).filter(|v| !v.trim().is_empty()).cloned()
    }
}

impl EnvSource for HashMap<&'static str, &'static str> {
    fn var(&self, key: &str) -> Option<String> {
        self.get(key)
            .filter(|v| !v.trim().is_empty())
            .map(|v| (*v).to_owned())
    }
}

/// A configuration problem found at startup. Messages name the variable or secret field; secret values are
/// never included.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// A required environment variable is not set.
    #[error("environment variable {name} is required ({hint})")]
    MissingVar {
        /// The variable.
        name: &'static str,
        /// What it is for.
        hint: &'static str,
    },
    /// A variable is set but its value does not parse.
    #[error("environment variable {name}={value:?} is invalid: {reason}")]
    InvalidVar {
        /// The variable.
        name: &'static str,
        /// The value as given (never used for secret variables).
        value: String,
        /// Why it was rejected.
        reason: String,
    },
    /// The Secrets Manager call failed.
    #[error("could not read secret {secret_id:?} from AWS Secrets Manager: {reason}")]
    SecretFetch {
        /// The secret id or ARN.
        secret_id: String,
        /// The SDK error with its cause chain.
        reason: String,
    },
    /// The secret exists but is not usable JSON.
    #[error("secret {origin} is malformed: {reason}")]
    MalformedSecret {
        /// Secret id, or "environment".
        origin: String,
        /// What is wrong (never the content).
        reason: String,
    },
    /// A field the function needs is missing from the secret (or from the environment fallback).
    #[error("secret {origin} has no field {field} (a non-empty string is required)")]
    MissingSecretField {
        /// Secret id, or "environment".
        origin: String,
        /// The JSON field / environment variable name.
        field: &'static str,
    },
    /// The relay's invocation budget cannot hold one lease plus the deadline margin: it would never claim.
    #[error(
        "{what} of {budget_secs} s cannot fit one RELAY_LEASE_SECS lease of {lease_secs} s plus the \
         RELAY_DEADLINE_MARGIN_MS margin of {margin_ms} ms: the relay would never claim an event. Raise {what} or \
         lower RELAY_LEASE_SECS"
    )]
    InvocationTooShort {
        /// Where the budget came from (`--invocation-secs`, the Lambda timeout).
        what: &'static str,
        /// The budget.
        budget_secs: f64,
        /// `RELAY_LEASE_SECS`.
        lease_secs: f64,
        /// `RELAY_DEADLINE_MARGIN_MS`.
        margin_ms: u64,
    },
    /// A secret field holds one of the QStash dev server's public values (`crate::secrets::refuse_dev_values`).
    #[error(
        "{field} in secret {origin} is the QStash dev server's public value ({risk}): set the one from the \
         Upstash console, or set OUTBOX_ALLOW_DEV_KEYS=true for a local run against the dev server (never in a \
         deployment)"
    )]
    DevCredential {
        /// Secret id, or "environment".
        origin: String,
        /// The JSON field / environment variable name.
        field: &'static str,
        /// What anyone could do with it.
        risk: &'static str,
    },
    /// The database URL does not parse (the URL itself is not echoed: it holds a password).
    #[error("DATABASE_URL is not a valid Postgres URL: {reason}")]
    InvalidDatabaseUrl {
        /// Parser message with the URL removed.
        reason: String,
    },
}

/// Reads typed values from an [`EnvSource`].
pub struct Vars<'a> {
    env: &'a dyn EnvSource,
}

impl<'a> Vars<'a> {
    /// Wraps an environment source.
    pub fn new(env: &'a dyn EnvSource) -> Self {
        Self { env }
    }

    /// The raw value, if set.
    pub fn raw(&self, name: &str) -> Option<String> {
        self.env.var(name)
    }

    /// A required string.
    pub fn required(&self, name: &'static str, hint: &'static str) -> Result<String, ConfigError> {
        self.env
            .var(name)
            .map(|v| v.trim().to_owned())
            .ok_or(ConfigError::MissingVar { name, hint })
    }

    /// An optional value parsed with `FromStr`, or `default`.
    pub fn parse_or<T>(&self, name: &'static str, default: T) -> Result<T, ConfigError>
    where
        T: FromStr,
        T::Err: fmt::Display,
    {
        match self.env.var(name) {
            None => Ok(default),
            Some(v) => v
                .trim()
                .parse()
                .map_err(|e: T::Err| ConfigError::InvalidVar {
                    name,
                    value: v.clone(),
                    reason: e.to_string(),
                }),
        }
    }

    /// A boolean (`true/false/1/0/yes/no/on/off`), or `default`.
    pub fn bool_or(&self, name: &'static str, default: bool) -> Result<bool, ConfigError> {
        match self.env.var(name) {
            None => Ok(default),
            Some(v) => match v.trim().to_ascii_lowercase().as_str() {
                "true" | "1" | "yes" | "on" => Ok(true),
                "false" | "0" | "no" | "off" => Ok(false),
                _ => Err(ConfigError::InvalidVar {
                    name,
                    value: v,
                    reason: "expected true or false".into(),
                }),
            },
        }
    }

    /// A duration given in the unit named by the variable (`…_MS` or `…_SECS`), or `default`.
    pub fn duration_or(
        &self,
        name: &'static str,
        default: Duration,
    ) -> Result<Duration, ConfigError> {
        let millis = name.ends_with("_MS");
        match self.env.var(name) {
            None => Ok(default),
            Some(v) => {
                let n: f64 = v.trim().parse().map_err(|_| ConfigError::InvalidVar {
                    name,
                    value: v.clone(),
                    reason: "expected a number".into(),
                })?;
                if !n.is_finite() || n < 0.0 {
                    return Err(ConfigError::InvalidVar {
                        name,
                        value: v,
                        reason: "expected a non-negative number".into(),
                    });
                }
                // `try_`: a number too large for a Duration is an error, not a panic at start.
                Duration::try_from_secs_f64(if millis { n / 1000.0 } else { n }).map_err(|_| {
                    ConfigError::InvalidVar {
                        name,
                        value: v,
                        reason: "too large".into(),
                    }
                })
            }
        }
    }

    /// [`Vars::duration_or`] within `[min, max]` (inclusive). A value outside is an error that names the variable,
    /// the value and the bound it crosses, followed by `why` (what the bound protects).
    pub fn duration_within(
        &self,
        name: &'static str,
        default: Duration,
        min: Duration,
        max: Duration,
        why: &str,
    ) -> Result<Duration, ConfigError> {
        let d = self.duration_or(name, default)?;
        let unit = |d: Duration| {
            if name.ends_with("_MS") {
                format!("{} ms", d.as_millis())
            } else {
                format!("{} seconds", d.as_secs_f64())
            }
        };
        let bound = if d < min {
            format!("must be at least {}", unit(min))
        } else if d > max {
            format!("must be at most {}", unit(max))
        } else {
            return Ok(d);
        };
        Err(ConfigError::InvalidVar {
            name,
            value: self.raw(name).unwrap_or_default().trim().to_owned(),
            reason: if why.is_empty() {
                bound
            } else {
                format!("{bound} ({why})")
            },
        })
    }

    /// An `http(s)` URL (trailing `/` removed), if set.
    pub fn url(&self, name: &'static str) -> Result<Option<String>, ConfigError> {
        match self.env.var(name) {
            None => Ok(None),
            Some(v) => {
                let v = v.trim();
                match url::Url::parse(v) {
                    Ok(u) if u.scheme() == "http" || u.scheme() == "https" => {
                        Ok(Some(v.trim_end_matches('/').to_owned()))
                    }
                    Ok(_) => Err(ConfigError::InvalidVar {
                        name,
                        value: v.to_owned(),
                        reason: "expected an http:// or https:// URL".into(),
                    }),
                    Err(e) => Err(ConfigError::InvalidVar {
                        name,
                        value: v.to_owned(),
                        reason: e.to_string(),
                    }),
                }
            }
        }
    }

    /// A comma-separated list (empty items dropped).
    pub fn list(&self, name: &'static str) -> Vec<String> {
        self.env
            .var(name)
            .map(|v| {
                v.split(',')
                    .map(|s| s.trim().to_owned())
                    .filter(|s| !s.is_empty())
                    .collect()
            })
            .unwrap_or_default()
    }

    /// A number within `[min, max]`, or `default`.
    pub fn ranged_or<T>(
        &self,
        name: &'static str,
        default: T,
        min: T,
        max: T,
    ) -> Result<T, ConfigError>
    where
        T: FromStr + PartialOrd + fmt::Display + Copy,
        T::Err: fmt::Display,
    {
        let v = self.parse_or(name, default)?;
        if v < min || v > max {
            return Err(ConfigError::InvalidVar {
                name,
                value: v.to_string(),
                reason: format!("must be between {min} and {max}"),
            });
        }
        Ok(v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&'static str, &'static str)]) -> HashMap<&'static str, &'static str> {
        pairs.iter().copied().collect()
    }

    #[test]
    fn durations_follow_the_unit_in_the_name() {
        let e = env(&[("A_MS", "1500"), ("B_SECS", "2.5")]);
        let v = Vars::new(&e);
        assert_eq!(
            v.duration_or("A_MS", Duration::ZERO).unwrap(),
            Duration::from_millis(1500)
        );
        assert_eq!(
            v.duration_or("B_SECS", Duration::ZERO).unwrap(),
            Duration::from_millis(2500)
        );
        assert_eq!(
            v.duration_or("C_SECS", Duration::from_secs(7)).unwrap(),
            Duration::from_secs(7)
        );
    }

    #[test]
    fn invalid_values_name_the_variable() {
        let e = env(&[("N", "lots"), ("B", "maybe"), ("U", "ftp://x"), ("R", "0")]);
        let v = Vars::new(&e);
        let err = v.parse_or::<u32>("N", 1).unwrap_err().to_string();
        assert!(err.contains("N=\"lots\""), "{err}");
        assert!(
            v.bool_or("B", false)
                .unwrap_err()
                .to_string()
                .contains("true or false")
        );
        assert!(v.url("U").unwrap_err().to_string().contains("http"));
        assert!(
            v.ranged_or::<u32>("R", 5, 1, 10)
                .unwrap_err()
                .to_string()
                .contains("between 1 and 10")
        );
        let missing = v.required("NOPE", "the thing").unwrap_err().to_string();
        assert_eq!(missing, "environment variable NOPE is required (the thing)");
    }

    #[test]
    fn bounded_durations_name_the_variable_the_value_and_the_bound() {
        let e = env(&[
            ("LOW_SECS", "29.5"),
            ("HIGH_MS", "1001"),
            ("HUGE_SECS", "1e30"),
        ]);
        let v = Vars::new(&e);
        let (one, two) = (Duration::from_secs(1), Duration::from_secs(2));
        let err = v
            .duration_within("LOW_SECS", two, Duration::from_secs(30), two * 60, "why")
            .unwrap_err()
            .to_string();
        assert_eq!(
            err,
            "environment variable LOW_SECS=\"29.5\" is invalid: must be at least 30 seconds (why)"
        );
        let err = v
            .duration_within("HIGH_MS", one, Duration::ZERO, one, "")
            .unwrap_err()
            .to_string();
        assert_eq!(
            err,
            "environment variable HIGH_MS=\"1001\" is invalid: must be at most 1000 ms"
        );
        // Unset: the default.
        assert_eq!(
            v.duration_within("UNSET_SECS", two, one, two, "").unwrap(),
            two
        );
        // Too large for a Duration: an error, not a panic.
        let err = v.duration_or("HUGE_SECS", one).unwrap_err().to_string();
        assert!(
            err.contains("HUGE_SECS") && err.contains("too large"),
            "{err}"
        );
    }

    #[test]
    fn empty_values_count_as_unset() {
        let e = env(&[("E", "  ")]);
        let v = Vars::new(&e);
        assert_eq!(v.parse_or::<u32>("E", 3).unwrap(), 3);
        assert!(v.list("E").is_empty());
    }
}

/// QStash publishing settings (relay).
#[derive(Debug, Clone)]
pub struct QstashConfig {
    /// `QSTASH_URL` (default `https://qstash.upstash.io`).
    pub base_url: String,
    /// `QSTASH_RETRIES` (default 5): QStash-level delivery retries after the first attempt.
    pub retries: u32,
    /// `QSTASH_PUBLISH_TIMEOUT_MS` (default 5000): HTTP timeout of one publish call (keep well below the lease).
    pub publish_timeout: Duration,
    /// `QSTASH_BATCH_SIZE` (default 100): messages per `/v2/batch` request (requests of one claim run
    /// concurrently).
    pub batch_size: u32,
    /// `QSTASH_DELIVERY_TIMEOUT_SECS` (optional): `Upstash-Timeout` per delivery attempt.
    pub delivery_timeout: Option<Duration>,
    /// `QSTASH_FLOW_PARALLELISM` (default 10): `parallelism` of the per-key flow-control key.
    pub flow_parallelism: u32,
    /// `QSTASH_FLOW_RATE` (optional): `rate` per `QSTASH_FLOW_PERIOD_SECS` (default 1).
    pub flow_rate: Option<u32>,
    /// `QSTASH_FLOW_PERIOD_SECS`.
    pub flow_period: Duration,
    /// `CONSUMER_URL` (required by the relay): events go to `{CONSUMER_URL}/events/{topic}`.
    pub consumer_url: String,
    /// `CALLBACK_URL` (required by the relay): the failure-callback function's URL; QStash failure callbacks go
    /// to `{CALLBACK_URL}/failure`, delivery callbacks of ordered topics to `{CALLBACK_URL}/delivered`.
    pub callback_url: String,
}

impl QstashConfig {
    /// Reads the `QSTASH_*`, `CONSUMER_URL` and `CALLBACK_URL` variables.
    pub fn from_vars(v: &Vars<'_>) -> Result<Self, ConfigError> {
        Ok(QstashConfig {
            base_url: v
                .url("QSTASH_URL")?
                .unwrap_or_else(|| "https://qstash.upstash.io".into()),
            retries: v.ranged_or("QSTASH_RETRIES", 5, 0, 100)?,
            publish_timeout: v.duration_or("QSTASH_PUBLISH_TIMEOUT_MS", Duration::from_secs(5))?,
            batch_size: v.ranged_or("QSTASH_BATCH_SIZE", 100, 1, 1000)?,
            delivery_timeout: match v.raw("QSTASH_DELIVERY_TIMEOUT_SECS") {
                Some(_) => Some(v.duration_or("QSTASH_DELIVERY_TIMEOUT_SECS", Duration::ZERO)?),
                None => None,
            },
            flow_parallelism: v.ranged_or("QSTASH_FLOW_PARALLELISM", 10, 1, 1000)?,
            flow_rate: match v.raw("QSTASH_FLOW_RATE") {
                Some(_) => Some(v.ranged_or("QSTASH_FLOW_RATE", 1, 1, 1_000_000)?),
                None => None,
            },
            flow_period: v.duration_or("QSTASH_FLOW_PERIOD_SECS", Duration::from_secs(1))?,
            consumer_url: v.url("CONSUMER_URL")?.ok_or(ConfigError::MissingVar {
                name: "CONSUMER_URL",
                hint: "the consumer function URL QStash delivers events to",
            })?,
            callback_url: v.url("CALLBACK_URL")?.ok_or(ConfigError::MissingVar {
                name: "CALLBACK_URL",
                hint: "the failure-callback function URL",
            })?,
        })
    }
}

/// What happens to the later events of an ordered key whose head is dead.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeadHeadPolicy {
    /// The key stops until an operator redrives or discards the head (default).
    Block,
    /// The head is recorded as a dead letter and the key moves on.
    Skip,
}

/// Where the delivery evidence of an ordered event comes from (decision record 0007).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EvidenceMode {
    /// QStash's delivery callback (`Upstash-Callback`) to the callback function: works with any consumer.
    Callback,
    /// The consumer records it in the transaction that applies the event: needs the consumer to share the
    /// outbox's database; saves one QStash message and one callback invocation per event.
    Consumer,
}

/// What the consumer does with a delivery in the pre-upgrade wire format, whose event identity (outbox id, topic)
/// travels only in unsigned headers (`LEGACY_DELIVERIES`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LegacyDeliveries {
    /// `verify` (default): apply it only if the outbox row with that id has the same topic and payload.
    Verify,
    /// `refuse`: dead-letter it without applying.
    Refuse,
}

/// Relay settings.
#[derive(Debug, Clone)]
pub struct RelayConfig {
    /// `RELAY_BATCH_SIZE` (default 500): rows per claim.
    pub batch_size: u32,
    /// `RELAY_LEASE_SECS` (default 15): how long a claim is exclusive. Must exceed the publish timeout plus
    /// the settle; the relay never claims with less time left in the invocation than this.
    pub lease: Duration,
    /// `RELAY_MAX_ATTEMPTS` (default 12): publish attempts before the relay dead-letters an event.
    pub max_attempts: u32,
    /// `RELAY_BACKOFF_BASE_SECS` (default 30).
    pub backoff_base: Duration,
    /// `RELAY_BACKOFF_CAP_SECS` (default 3600).
    pub backoff_cap: Duration,
    /// `RELAY_POLL_INTERVAL_MS` (default 500): wait between claims when the last one was not full.
    pub poll_interval: Duration,
    /// `RELAY_DEADLINE_MARGIN_MS` (default 3000): stop this long before the invocation's deadline.
    pub deadline_margin: Duration,
    /// `RELAY_CONCURRENCY` (default 8, decision 0009): claim/publish/settle cycles in flight at once (each holds a pooled
    /// connection only while it talks to Postgres; a cycle's publish overlaps the others' claims and settles).
    pub concurrency: u32,
    /// `RELAY_SKIP_DEAD_HEAD_TOPICS` (comma list): ordered topics whose dead heads are skipped, not blocking.
    pub skip_topics: Vec<String>,
    /// `RELAY_EVIDENCE_TIMEOUT_SECS`: an ordered head accepted by QStash without delivery evidence for this
    /// long is published again. Default: QStash's whole retry horizon for `QSTASH_RETRIES`, plus an hour.
    pub evidence_timeout: Duration,
    /// `OUTBOX_RETENTION_HOURS`: dispatched rows are deleted after this. Default: QStash's retry horizon for
    /// `QSTASH_RETRIES` plus a day (≈ 55 h for 5 retries), so a late failure callback still finds its event.
    pub retention: Duration,
    /// `PROCESSED_TTL_HOURS` (default 168 = 7 days): consumer dedupe rows are pruned after this.
    pub processed_ttl: Duration,
    /// `RELAY_HOUSEKEEPING_BATCH` (default 1000): rows deleted per housekeeping statement.
    pub housekeeping_batch: u32,
    /// `RELAY_LISTEN_NOTIFY` (default false): wake on `NOTIFY outbox_new` instead of waiting a full poll.
    pub listen_notify: bool,
    /// `RELAY_ORDERED_EVIDENCE` (`callback`, the default, or `consumer`).
    pub ordered_evidence: EvidenceMode,
    /// `RELAY_OUTAGE_PROBE_BASE_MS` (default 2000, 100 ms – 60 s): the first wait after QStash failed as a whole
    /// before one relay probes it again (decision record 0012); doubles per failed probe.
    pub outage_probe_base: Duration,
    /// `RELAY_OUTAGE_PROBE_CAP_SECS` (default 300, from the base to 3600): the longest wait between probes, i.e.
    /// how long after QStash comes back the relay may still be waiting.
    pub outage_probe_cap: Duration,
    /// `RELAY_DELIVERY_BATCH`, `RELAY_DELIVERY_BATCH_TOPICS` and `QSTASH_MAX_MESSAGE_BYTES`: how many events
    /// one QStash message may carry (decision record 0014).
    pub batching: DeliveryBatching,
    /// How the relay learns every event's outcome and closes what callbacks leave open (decision record 0015).
    pub accounting: AccountingConfig,
}

/// Where the outcome of an **unordered** event comes from (decision record 0015). Ordered events always have one:
/// their key waits for its delivery evidence ([`EvidenceMode`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutcomeSource {
    /// The consumer's dedupe row in `processed_messages` (namespace `CONSUMER_NAME`) proves the event applied; the
    /// relay reads it in bulk. Costs no QStash message; needs the consumer to share the outbox's database.
    DedupeRow,
    /// QStash's delivery callback (`Upstash-Callback`) on unordered messages too: one more QStash message per
    /// message. For a consumer in another database.
    Callback,
}

/// The reconciler's settings (decision record 0015, `outbox::accounting`).
#[derive(Debug, Clone, PartialEq)]
pub struct AccountingConfig {
    /// `RELAY_UNORDERED_EVIDENCE` (`dedupe` or `callback`); `None` (unset) follows `RELAY_ORDERED_EVIDENCE`:
    /// `dedupe` with `consumer` (the consumer shares the database), else `callback`. Read it through
    /// [`RelayConfig::unordered_outcome`].
    pub unordered: Option<OutcomeSource>,
    /// `CONSUMER_NAME` (default `consumer`): the dedupe namespace the relay reads with [`OutcomeSource::DedupeRow`].
    pub consumer_name: String,
    /// `RELAY_RECONCILE_AFTER_SECS`: an event in flight for longer is looked up at QStash. Default:
    /// [`reconcile_horizon`] for `QSTASH_RETRIES` and `QSTASH_DELIVERY_TIMEOUT_SECS`.
    pub horizon: Duration,
    /// `RELAY_APPLIED_GRACE_SECS` (default 30): in-flight events younger than this are not yet checked against
    /// their dedupe rows (most are still being delivered).
    pub applied_grace: Duration,
    /// `RELAY_RECONCILE_MAX_LOOKUPS` (default 50, 0 = reconciler off): QStash management API requests per
    /// invocation, at most.
    pub max_lookups: u32,
    /// `RELAY_RECONCILE_MIN_INTERVAL_MS` (default 200): the least time between two management API requests (QStash
    /// rate-limits them per second).
    pub lookup_interval: Duration,
    /// `RELAY_RECONCILE_MAX_REPUBLISH` (default 3): how often an event unknown to QStash is published again before
    /// it becomes a dead letter instead.
    pub max_republish: u32,
}

impl Default for AccountingConfig {
    fn default() -> Self {
        AccountingConfig {
            unordered: None,
            consumer_name: "consumer".into(),
            horizon: reconcile_horizon(5, None),
            applied_grace: Duration::from_secs(30),
            max_lookups: 50,
            lookup_interval: Duration::from_millis(200),
            max_republish: 3,
        }
    }
}

/// The longest QStash may legitimately take to report an event's fate, and so when the reconciler may ask
/// (decision record 0015): the message's retries, then the failure callback's own (QStash retries a callback with
/// the original message's retry settings), each attempt up to its timeout, plus an hour:
///
/// `2 · Σ_{n=1..R} min(86400, e^(2.5·n)) s + 2 · (R + 1) · T + 3600 s`
///
/// with R = `QSTASH_RETRIES` and T = `QSTASH_DELIVERY_TIMEOUT_SECS` (QStash's longest HTTP timeout, 15 min, when
/// unset). For R = 5 and T unset: 2 · 110,395 + 12 · 900 + 3600 = 235,190 s ≈ 65.3 h.
pub fn reconcile_horizon(retries: u32, delivery_timeout: Option<Duration>) -> Duration {
    let attempt = delivery_timeout.unwrap_or(Duration::from_secs(15 * 60));
    qstash_retry_horizon(retries) * 2 + attempt * (2 * (retries + 1)) + Duration::from_secs(3600)
}

impl AccountingConfig {
    /// Reads the accounting variables; `retries` and `delivery_timeout` set the default horizon.
    pub fn from_vars(
        v: &Vars<'_>,
        retries: u32,
        delivery_timeout: Option<Duration>,
    ) -> Result<Self, ConfigError> {
        let unordered = match v
            .raw("RELAY_UNORDERED_EVIDENCE")
            .map(|m| m.trim().to_ascii_lowercase())
        {
            None => None,
            Some(m) if m == "dedupe" => Some(OutcomeSource::DedupeRow),
            Some(m) if m == "callback" => Some(OutcomeSource::Callback),
            Some(m) => {
                return Err(ConfigError::InvalidVar {
                    name: "RELAY_UNORDERED_EVIDENCE",
                    value: m,
                    reason: "expected dedupe or callback".into(),
                });
            }
        };
        let horizon = v.duration_or(
            "RELAY_RECONCILE_AFTER_SECS",
            reconcile_horizon(retries, delivery_timeout),
        )?;
        if horizon < Duration::from_secs(1) {
            return Err(ConfigError::InvalidVar {
                name: "RELAY_RECONCILE_AFTER_SECS",
                value: format!("{}", horizon.as_secs_f64()),
                reason: "must be at least 1 second (QStash must have had time to deliver)".into(),
            });
        }
        Ok(AccountingConfig {
            unordered,
            consumer_name: v
                .raw("CONSUMER_NAME")
                .filter(|n| !n.trim().is_empty())
                .unwrap_or_else(|| "consumer".into()),
            horizon,
            applied_grace: v.duration_or("RELAY_APPLIED_GRACE_SECS", Duration::from_secs(30))?,
            max_lookups: v.ranged_or("RELAY_RECONCILE_MAX_LOOKUPS", 50, 0, 10_000)?,
            lookup_interval: v.duration_or(
                "RELAY_RECONCILE_MIN_INTERVAL_MS",
                Duration::from_millis(200),
            )?,
            max_republish: v.ranged_or("RELAY_RECONCILE_MAX_REPUBLISH", 3, 0, 100)?,
        })
    }
}

/// How many events one QStash message carries (decision record 0014). The default: up to
/// [`DEFAULT_DELIVERY_BATCH`] events per message, under 1,000,000 bytes; `RELAY_DELIVERY_BATCH=1` publishes
/// exactly what the relay published before batching existed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeliveryBatching {
    /// `RELAY_DELIVERY_BATCH` (default [`DEFAULT_DELIVERY_BATCH`], 1..=1000): the most events per message.
    pub default_n: u32,
    /// `RELAY_DELIVERY_BATCH_TOPICS` (`topic=n,topic=n`): per-topic overrides of `default_n`.
    pub topics: Vec<(String, u32)>,
    /// `QSTASH_MAX_MESSAGE_BYTES` (default 1,000,000, 1,000..=100,000,000): a message body with more than one
    /// event stays under this many bytes (a single larger event is still published alone; QStash decides).
    pub max_message_bytes: usize,
}

/// The default `RELAY_DELIVERY_BATCH`: 50 events per message at most, the measured choice (decision record
/// 0014, "Default": most of the gain of 100 with half the work per delivery, and under the 64 subtransactions a
/// Postgres backend tracks without overflowing). Upgrading from a version whose consumer cannot read batches:
/// deploy with 1 first (the README's upgrade notes).
pub const DEFAULT_DELIVERY_BATCH: u32 = 50;

impl Default for DeliveryBatching {
    fn default() -> Self {
        DeliveryBatching {
            default_n: DEFAULT_DELIVERY_BATCH,
            topics: Vec::new(),
            max_message_bytes: 1_000_000,
        }
    }
}

/// The largest `RELAY_DELIVERY_BATCH` (the consumer refuses envelopes with more events).
pub const MAX_DELIVERY_BATCH: u32 = 1000;

impl DeliveryBatching {
    /// Reads `RELAY_DELIVERY_BATCH`, `RELAY_DELIVERY_BATCH_TOPICS` and `QSTASH_MAX_MESSAGE_BYTES`.
    pub fn from_vars(v: &Vars<'_>) -> Result<Self, ConfigError> {
        let default_n = v.ranged_or(
            "RELAY_DELIVERY_BATCH",
            DEFAULT_DELIVERY_BATCH,
            1,
            MAX_DELIVERY_BATCH,
        )?;
        let max_message_bytes = v.ranged_or(
            "QSTASH_MAX_MESSAGE_BYTES",
            1_000_000usize,
            1_000,
            100_000_000,
        )?;
        let mut topics: Vec<(String, u32)> = Vec::new();
        let raw = v.raw("RELAY_DELIVERY_BATCH_TOPICS").unwrap_or_default();
        let invalid = |reason: String| ConfigError::InvalidVar {
            name: "RELAY_DELIVERY_BATCH_TOPICS",
            value: raw.trim().to_owned(),
            reason,
        };
        for item in raw.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let Some((topic, n)) = item.split_once('=') else {
                return Err(invalid(format!(
                    "{item:?} is not topic=n (expected a comma-separated list like orders=50,audit=200)"
                )));
            };
            let topic = topic.trim();
            if topic.is_empty() {
                return Err(invalid(format!("{item:?} has no topic before '='")));
            }
            let n: u32 = match n.trim().parse() {
                Ok(n) if (1..=MAX_DELIVERY_BATCH).contains(&n) => n,
                _ => {
                    return Err(invalid(format!(
                        "{topic}: {:?} must be a whole number between 1 and {MAX_DELIVERY_BATCH}",
                        n.trim()
                    )));
                }
            };
            if topics.iter().any(|(t, _)| t == topic) {
                return Err(invalid(format!("topic {topic} is listed twice")));
            }
            topics.push((topic.to_owned(), n));
        }
        Ok(DeliveryBatching {
            default_n,
            topics,
            max_message_bytes,
        })
    }

    /// The most events per message for a topic.
    pub fn n_for(&self, topic: &str) -> u32 {
        self.topics
            .iter()
            .find(|(t, _)| t == topic)
            .map_or(self.default_n, |(_, n)| *n)
    }

    /// Whether some topic may get messages of more than one event.
    pub fn any_batching(&self) -> bool {
        self.default_n > 1 || self.topics.iter().any(|(_, n)| *n > 1)
    }
}

/// QStash's default retry delays (seconds before the n-th retry): `min(86400, e^(2.5·n))`.
pub fn qstash_retry_horizon(retries: u32) -> Duration {
    let secs: f64 = (1..=retries)
        .map(|n| (2.5 * n as f64).exp().min(86_400.0))
        .sum();
    Duration::from_secs_f64(secs)
}

impl RelayConfig {
    /// Reads the `RELAY_*` variables; `qstash_retries` sets the default evidence timeout.
    pub fn from_vars(v: &Vars<'_>, qstash_retries: u32) -> Result<Self, ConfigError> {
        let lease = v.duration_or("RELAY_LEASE_SECS", Duration::from_secs(15))?;
        if lease < Duration::from_secs(1) {
            return Err(ConfigError::InvalidVar {
                name: "RELAY_LEASE_SECS",
                value: format!("{}", lease.as_secs_f64()),
                reason: "must be at least 1 second".into(),
            });
        }
        let hours = |name: &'static str, default: f64| -> Result<Duration, ConfigError> {
            let h: f64 = v.parse_or(name, default)?;
            if !h.is_finite() || h <= 0.0 {
                return Err(ConfigError::InvalidVar {
                    name,
                    value: h.to_string(),
                    reason: "must be a positive number of hours".into(),
                });
            }
            Ok(Duration::from_secs_f64(h * 3600.0))
        };
        let outage_probe_base = v.duration_within(
            "RELAY_OUTAGE_PROBE_BASE_MS",
            Duration::from_secs(2),
            Duration::from_millis(100),
            Duration::from_secs(60),
            "the first wait before probing QStash after an outage",
        )?;
        let outage_probe_cap = v.duration_within(
            "RELAY_OUTAGE_PROBE_CAP_SECS",
            Duration::from_secs(300),
            outage_probe_base,
            Duration::from_secs(3600),
            "the longest wait between probes, and so how long a recovered QStash may go unused",
        )?;
        let ordered_evidence = match v
            .raw("RELAY_ORDERED_EVIDENCE")
            .map(|m| m.trim().to_ascii_lowercase())
        {
            None => EvidenceMode::Callback,
            Some(m) if m == "callback" => EvidenceMode::Callback,
            Some(m) if m == "consumer" => EvidenceMode::Consumer,
            Some(m) => {
                return Err(ConfigError::InvalidVar {
                    name: "RELAY_ORDERED_EVIDENCE",
                    value: m,
                    reason: "expected callback or consumer".into(),
                });
            }
        };
        let delivery_timeout = match v.raw("QSTASH_DELIVERY_TIMEOUT_SECS") {
            Some(_) => Some(v.duration_or("QSTASH_DELIVERY_TIMEOUT_SECS", Duration::ZERO)?),
            None => None,
        };
        Ok(RelayConfig {
            accounting: AccountingConfig::from_vars(v, qstash_retries, delivery_timeout)?,
            ordered_evidence,
            batching: DeliveryBatching::from_vars(v)?,
            outage_probe_base,
            outage_probe_cap,
            batch_size: v.ranged_or("RELAY_BATCH_SIZE", 500, 1, 5000)?,
            lease,
            max_attempts: v.ranged_or("RELAY_MAX_ATTEMPTS", 12, 1, 1000)?,
            backoff_base: v.duration_or("RELAY_BACKOFF_BASE_SECS", Duration::from_secs(30))?,
            backoff_cap: v.duration_or("RELAY_BACKOFF_CAP_SECS", Duration::from_secs(3600))?,
            poll_interval: v.duration_or("RELAY_POLL_INTERVAL_MS", Duration::from_millis(500))?,
            deadline_margin: v.duration_or("RELAY_DEADLINE_MARGIN_MS", Duration::from_secs(3))?,
            concurrency: v.ranged_or("RELAY_CONCURRENCY", 8, 1, 16)?,
            skip_topics: v.list("RELAY_SKIP_DEAD_HEAD_TOPICS"),
            evidence_timeout: v.duration_or(
                "RELAY_EVIDENCE_TIMEOUT_SECS",
                qstash_retry_horizon(qstash_retries) + Duration::from_secs(3600),
            )?,
            retention: hours(
                "OUTBOX_RETENTION_HOURS",
                (qstash_retry_horizon(qstash_retries).as_secs_f64() / 3600.0 + 24.0).ceil(),
            )?,
            processed_ttl: hours("PROCESSED_TTL_HOURS", 168.0)?,
            housekeeping_batch: v.ranged_or("RELAY_HOUSEKEEPING_BATCH", 1000, 1, 100_000)?,
            listen_notify: v.bool_or("RELAY_LISTEN_NOTIFY", false)?,
        })
    }

    /// Where an unordered event's outcome comes from: `RELAY_UNORDERED_EVIDENCE`, else what
    /// `RELAY_ORDERED_EVIDENCE` implies (the consumer records ordered evidence in the outbox's database: its dedupe
    /// rows are there too).
    pub fn unordered_outcome(&self) -> OutcomeSource {
        self.accounting
            .unordered
            .unwrap_or(match self.ordered_evidence {
                EvidenceMode::Consumer => OutcomeSource::DedupeRow,
                EvidenceMode::Callback => OutcomeSource::Callback,
            })
    }

    /// The policy for a topic's dead heads.
    pub fn dead_head_policy(&self, topic: &str) -> DeadHeadPolicy {
        if self.skip_topics.iter().any(|t| t == topic) {
            DeadHeadPolicy::Skip
        } else {
            DeadHeadPolicy::Block
        }
    }

    /// Refuses an invocation budget (the Lambda timeout, or the CLI's `--invocation-secs`) that cannot hold one
    /// lease plus the deadline margin. The drain never claims with less than a lease left before the deadline
    /// minus the margin, so such a relay would claim nothing, end at once, and (run in a loop) spin while
    /// reporting success. `what` names where the budget came from, for the error.
    pub fn check_invocation_budget(
        &self,
        budget: Duration,
        what: &'static str,
    ) -> Result<(), ConfigError> {
        if budget < self.lease + self.deadline_margin {
            return Err(ConfigError::InvocationTooShort {
                what,
                budget_secs: budget.as_secs_f64(),
                lease_secs: self.lease.as_secs_f64(),
                margin_ms: self.deadline_margin.as_millis() as u64,
            });
        }
        Ok(())
    }
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
        if self.skip_topics.iter().any(|t| t == topic) {
            DeadHeadPolicy::Skip
        } else {
            DeadHeadPolicy::Block
        }
    }
}
