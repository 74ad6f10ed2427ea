//! The relay's settings: QStash publishing ([`QstashConfig`]), the relay loop ([`RelayConfig`]), delivery
//! batching ([`DeliveryBatching`]) and the accounting of every event's outcome ([`AccountingConfig`]).

use std::time::Duration;

use super::DeadHeadPolicy;
use super::env::{ConfigError, Vars};

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
    /// `QSTASH_REPLAY_PARALLELISM` (default 4): `parallelism` of the one flow-control key a subscriber's replayed
    /// copies share (`crate::subscribers`): how many messages of a replay QStash delivers at once, so a replay's
    /// backlog waits in its own queue instead of ahead of everyone's live events.
    pub replay_parallelism: u32,
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
    /// `QSTASH_REPLAY_PARALLELISM`'s default.
    pub const DEFAULT_REPLAY_PARALLELISM: u32 = 4;

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
            replay_parallelism: v.ranged_or(
                "QSTASH_REPLAY_PARALLELISM",
                Self::DEFAULT_REPLAY_PARALLELISM,
                1,
                1000,
            )?,
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

/// Where the delivery evidence of an ordered event comes from (decision record 0007).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EvidenceMode {
    /// QStash's delivery callback (`Upstash-Callback`) to the callback function: works with any consumer.
    Callback,
    /// The consumer records it in the transaction that applies the event: needs the consumer to share the
    /// outbox's database; saves one QStash message and one callback invocation per event.
    Consumer,
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
    /// `OUTBOX_SUBSCRIBERS` (comma list of `topic:name=url`): named subscribers the relay makes live at its first
    /// invocation, from now on, updating the URL of one that exists (fan-out, `crate::subscribers::ensure`; never
    /// removes one and never replays: `outbox subscribers` does that).
    pub subscribers: Vec<DeclaredSubscriber>,
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
    /// `RELAY_FAIR_CLAIMS` and `RELAY_TENANT_LIMITS`: fairness between tenants ([`crate::fairness`]).
    pub fairness: super::FairnessConfig,
}

/// One item of `OUTBOX_SUBSCRIBERS`: `topic:name=url` (the name and URL are checked when the relay applies it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeclaredSubscriber {
    pub topic: String,
    pub name: String,
    /// The consumer's base URL.
    pub url: String,
}

impl DeclaredSubscriber {
    /// Splits `topic:name=url`.
    pub fn parse(item: &str) -> Result<Self, ConfigError> {
        let bad = |reason: &str| ConfigError::InvalidVar {
            name: "OUTBOX_SUBSCRIBERS",
            value: item.to_owned(),
            reason: format!(
                "{reason} (each item is topic:name=url, e.g. orders:billing=https://billing.example)"
            ),
        };
        let (lane, url) = item
            .split_once('=')
            .ok_or_else(|| bad("no '=' before the URL"))?;
        let (topic, name) = lane
            .split_once(':')
            .ok_or_else(|| bad("no ':' between topic and name"))?;
        let (topic, name, url) = (topic.trim(), name.trim(), url.trim());
        if topic.is_empty() || name.is_empty() || url.is_empty() {
            return Err(bad("topic, name and URL are all required"));
        }
        Ok(DeclaredSubscriber {
            topic: topic.to_owned(),
            name: name.to_owned(),
            url: url.to_owned(),
        })
    }
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
    /// How long QStash may go on delivering one message ([`delivery_window`] for `QSTASH_RETRIES` and
    /// `QSTASH_DELIVERY_TIMEOUT_SECS`; derived, not a variable): an event is published again only if this much
    /// time, plus [`DEDUPE_MARGIN`], is left before a dedupe row written at its first claim expires
    /// ([`AccountingConfig::republish_window`]).
    pub delivery_window: Duration,
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
            delivery_window: delivery_window(5, None),
        }
    }
}

/// Time kept free between anything the reconciler relies on and the end of a dedupe row's life
/// (`PROCESSED_TTL_HOURS`): the relay's publish after a claim, the pass's own duration, clocks.
pub const DEDUPE_MARGIN: Duration = Duration::from_secs(3600);

/// How long QStash may go on delivering one message after accepting it: its retries
/// (`Σ_{n=1..R} min(86400, e^(2.5·n)) s`, [`qstash_retry_horizon`]) and every attempt up to its timeout
/// (`(R + 1) · T`), with R = `QSTASH_RETRIES` and T = `QSTASH_DELIVERY_TIMEOUT_SECS` (QStash's longest HTTP
/// timeout, 15 min, when unset). For R = 5: 110,395 + 5,400 s ≈ 32.2 h.
pub fn delivery_window(retries: u32, delivery_timeout: Option<Duration>) -> Duration {
    let attempt = delivery_timeout.unwrap_or(Duration::from_secs(15 * 60));
    qstash_retry_horizon(retries) + attempt * (retries + 1)
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
    delivery_window(retries, delivery_timeout) * 2 + Duration::from_secs(3600)
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
            delivery_window: delivery_window(retries, delivery_timeout),
        })
    }

    /// How long after an event's first claim the reconciler may still publish it again:
    /// `PROCESSED_TTL_HOURS − delivery window − margin`. A dedupe row written by an application of any earlier
    /// message of the event (at the first claim at the earliest) then outlives every delivery of the new one, so
    /// the consumer absorbs it. Zero when nothing fits.
    pub fn republish_window(&self, processed_ttl: Duration) -> Duration {
        processed_ttl
            .saturating_sub(self.delivery_window)
            .saturating_sub(DEDUPE_MARGIN)
    }

    /// Refuses settings under which the reconciler would act on an event after the consumer's dedupe row of a
    /// first application may be gone (`processed_ttl` = `PROCESSED_TTL_HOURS`, `retries` = `QSTASH_RETRIES`, for
    /// the error): a horizon (plus [`DEDUPE_MARGIN`]) reaching the rows' end, or, while it may publish events
    /// again, a horizon plus a message's [`delivery_window`] doing so (no republish could ever be safe). With the
    /// reconciler off (`RELAY_RECONCILE_MAX_LOOKUPS=0`) nothing is checked.
    pub fn check_dedupe_lifetime(
        &self,
        processed_ttl: Duration,
        retries: u32,
    ) -> Result<(), ConfigError> {
        if self.max_lookups == 0 {
            return Ok(());
        }
        let ttl = hours(processed_ttl);
        let need = |d: Duration| (d.as_secs_f64() / 3600.0).floor() as u64 + 1;
        let looked_up = self.horizon + DEDUPE_MARGIN;
        if looked_up >= processed_ttl {
            return Err(ConfigError::ReconcilerOutlivesDedupe {
                reason: format!(
                    "it looks events up RELAY_RECONCILE_AFTER_SECS = {} after their dispatch, plus a margin of 1 h, \
                     which is not within PROCESSED_TTL_HOURS = {ttl}, how long the consumer's dedupe rows are kept: \
                     what it records then (a failure QStash reported for an event that was in fact applied) could \
                     no longer be told from a real one. Set PROCESSED_TTL_HOURS to at least {} h, lower \
                     RELAY_RECONCILE_AFTER_SECS (or QSTASH_RETRIES, which sets its default), or turn the reconciler \
                     off with RELAY_RECONCILE_MAX_LOOKUPS=0",
                    hours(self.horizon),
                    need(looked_up)
                ),
            });
        }
        let republished = looked_up + self.delivery_window;
        if self.max_republish > 0 && republished >= processed_ttl {
            return Err(ConfigError::ReconcilerOutlivesDedupe {
                reason: format!(
                    "it may publish an event QStash lost again (RELAY_RECONCILE_MAX_REPUBLISH = {}) no earlier than \
                     RELAY_RECONCILE_AFTER_SECS = {} after it was first published, and QStash may go on delivering \
                     that message for {} (its retries for QSTASH_RETRIES = {retries}, each attempt up to \
                     QSTASH_DELIVERY_TIMEOUT_SECS); with a margin of 1 h that is {}, not within \
                     PROCESSED_TTL_HOURS = {ttl}, how long the dedupe row that makes a second delivery harmless is \
                     kept: no event could ever be published again safely. Set PROCESSED_TTL_HOURS to at least {} h, \
                     lower RELAY_RECONCILE_AFTER_SECS or QSTASH_RETRIES, or set RELAY_RECONCILE_MAX_REPUBLISH=0 \
                     (events QStash lost then become dead letters at once)",
                    self.max_republish,
                    hours(self.horizon),
                    hours(self.delivery_window),
                    hours(republished),
                    need(republished)
                ),
            });
        }
        Ok(())
    }
}

/// `48 h`, `65.3 h`: a duration in hours for an error message.
fn hours(d: Duration) -> String {
    let h = d.as_secs_f64() / 3600.0;
    if (h - h.round()).abs() < 0.05 {
        format!("{:.0} h", h.round())
    } else {
        format!("{h:.1} h")
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

/// `RELAY_LEASE_SECS` (default 15 s): at least a second.
fn lease_of(v: &Vars<'_>) -> Result<Duration, ConfigError> {
    let lease = v.duration_or("RELAY_LEASE_SECS", Duration::from_secs(15))?;
    if lease < Duration::from_secs(1) {
        return Err(ConfigError::InvalidVar {
            name: "RELAY_LEASE_SECS",
            value: format!("{}", lease.as_secs_f64()),
            reason: "must be at least 1 second".into(),
        });
    }
    Ok(lease)
}

/// A positive number of hours (`name`, default `default`).
fn hours_or(v: &Vars<'_>, name: &'static str, default: f64) -> Result<Duration, ConfigError> {
    let h: f64 = v.parse_or(name, default)?;
    if !h.is_finite() || h <= 0.0 {
        return Err(ConfigError::InvalidVar {
            name,
            value: h.to_string(),
            reason: "must be a positive number of hours".into(),
        });
    }
    Ok(Duration::from_secs_f64(h * 3600.0))
}

/// The first and the longest wait before probing QStash after an outage (`RELAY_OUTAGE_PROBE_BASE_MS`,
/// `RELAY_OUTAGE_PROBE_CAP_SECS`).
fn outage_probes_of(v: &Vars<'_>) -> Result<(Duration, Duration), ConfigError> {
    let base = v.duration_within(
        "RELAY_OUTAGE_PROBE_BASE_MS",
        Duration::from_secs(2),
        Duration::from_millis(100),
        Duration::from_secs(60),
        "the first wait before probing QStash after an outage",
    )?;
    let cap = v.duration_within(
        "RELAY_OUTAGE_PROBE_CAP_SECS",
        Duration::from_secs(300),
        base,
        Duration::from_secs(3600),
        "the longest wait between probes, and so how long a recovered QStash may go unused",
    )?;
    Ok((base, cap))
}

/// `RELAY_ORDERED_EVIDENCE`: `callback` (the default) or `consumer`.
fn ordered_evidence_of(v: &Vars<'_>) -> Result<EvidenceMode, ConfigError> {
    match v
        .raw("RELAY_ORDERED_EVIDENCE")
        .map(|m| m.trim().to_ascii_lowercase())
    {
        None => Ok(EvidenceMode::Callback),
        Some(m) if m == "callback" => Ok(EvidenceMode::Callback),
        Some(m) if m == "consumer" => Ok(EvidenceMode::Consumer),
        Some(m) => Err(ConfigError::InvalidVar {
            name: "RELAY_ORDERED_EVIDENCE",
            value: m,
            reason: "expected callback or consumer".into(),
        }),
    }
}

impl RelayConfig {
    /// Reads the `RELAY_*` variables; `qstash_retries` sets the default evidence timeout.
    pub fn from_vars(v: &Vars<'_>, qstash_retries: u32) -> Result<Self, ConfigError> {
        let lease = lease_of(v)?;
        let (outage_probe_base, outage_probe_cap) = outage_probes_of(v)?;
        let ordered_evidence = ordered_evidence_of(v)?;
        let delivery_timeout = match v.raw("QSTASH_DELIVERY_TIMEOUT_SECS") {
            Some(_) => Some(v.duration_or("QSTASH_DELIVERY_TIMEOUT_SECS", Duration::ZERO)?),
            None => None,
        };
        let cfg = RelayConfig {
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
            subscribers: v
                .list("OUTBOX_SUBSCRIBERS")
                .iter()
                .map(|item| DeclaredSubscriber::parse(item))
                .collect::<Result<_, _>>()?,
            evidence_timeout: v.duration_or(
                "RELAY_EVIDENCE_TIMEOUT_SECS",
                qstash_retry_horizon(qstash_retries) + Duration::from_secs(3600),
            )?,
            retention: hours_or(
                v,
                "OUTBOX_RETENTION_HOURS",
                (qstash_retry_horizon(qstash_retries).as_secs_f64() / 3600.0 + 24.0).ceil(),
            )?,
            processed_ttl: hours_or(v, "PROCESSED_TTL_HOURS", 168.0)?,
            housekeeping_batch: v.ranged_or("RELAY_HOUSEKEEPING_BATCH", 1000, 1, 100_000)?,
            listen_notify: v.bool_or("RELAY_LISTEN_NOTIFY", false)?,
            fairness: super::FairnessConfig::from_vars(v)?,
        };
        cfg.accounting
            .check_dedupe_lifetime(cfg.processed_ttl, qstash_retries)?;
        Ok(cfg)
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
        DeadHeadPolicy::for_topic(&self.skip_topics, topic)
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
