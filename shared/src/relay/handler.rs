//! The relay Lambda's handler: `functions/relay` only builds a [`RelayState`] at cold start and passes
//! [`handle`] to `lambda_runtime::run`.
//!
//! It accepts whatever the schedule sends: an EventBridge rule's scheduled event
//! (`{"source":"aws.events","detail-type":"Scheduled Event",…}`), an EventBridge Scheduler (`ScheduleV2`) payload,
//! which is only the configured `Input` (e.g. `{"trigger":"schedule"}`), or anything else (the payload is only
//! logged). Each invocation: bounded housekeeping, drain until the Lambda deadline minus
//! `RELAY_DEADLINE_MARGIN_MS`, then one JSON summary log line and one EMF metrics line, plus one EMF line per
//! subscriber of the topics that have named subscribers ([`subscriber_emf`]).

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use lambda_runtime::LambdaEvent;
use serde::Serialize;
use serde_json::Value;

use super::housekeeping::{self, BacklogGauges, HousekeepingReport, Retention};
use super::{DrainSummary, Relay, RelayError};
use crate::accounting::AccountingReport;
use crate::config::{ConfigError, EnvSource, ProcessEnv, QstashConfig, RelayConfig, Vars};
use crate::db::DbConfig;
use crate::metrics::{EmfRecord, Unit};
use crate::qstash::{QstashClient, QstashClientError};
use crate::secrets::{SecretField, SecretSource};
use crate::subscriber_keys::SubscriberKeys;
use crate::subscribers::status::SubscriberStatus;
use secrecy::ExposeSecret;

/// Why the relay could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartupError {
    /// Configuration or secrets.
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Client(#[from] QstashClientError),
}

/// Everything the relay keeps across invocations.
pub struct RelayState {
    pub relay: Relay,
    /// Name used in metrics and logs.
    pub function_name: String,
    margin: Duration,
    emit_metrics: bool,
    budget_without_deadline: Duration,
}

impl RelayState {
    /// Builds the state from an environment source: config, secrets (`DATABASE_URL`, `QSTASH_TOKEN`), a lazily
    /// connecting pool (async commit on: see decision record 0006), the QStash client. No network I/O except
    /// the Secrets Manager call when `OUTBOX_SECRET_ID` is set. Refuses the QStash dev server's public token
    /// unless `OUTBOX_ALLOW_DEV_KEYS=true` ([`crate::secrets::refuse_dev_values`]).
    pub async fn from_env(env: Arc<dyn EnvSource>) -> Result<Self, StartupError> {
        let vars = Vars::new(env.as_ref());
        let qstash = QstashConfig::from_vars(&vars)?;
        let relay_cfg = RelayConfig::from_vars(&vars, qstash.retries)?;
        let relay_defaults = DbConfig {
            async_commit: true, // decision record 0006
            ..DbConfig::defaults("outbox-relay")
        };
        let mut db = DbConfig::from_vars_over(&vars, relay_defaults)?;
        db.max_connections = db
            .max_connections
            .max(relay_cfg.concurrency + 1 + u32::from(relay_cfg.listen_notify));
        let secrets = SecretSource::from_env(env.clone())
            .await
            .load(&[
                SecretField::DatabaseUrl,
                SecretField::QstashToken,
                SecretField::SubscriberKeys,
            ])
            .await?;
        crate::secrets::refuse_dev_values(&secrets, &vars)?;
        let subscriber_keys = match secrets.optional(SecretField::SubscriberKeys) {
            None => SubscriberKeys::none(),
            Some(text) => SubscriberKeys::parse(text.expose_secret()).map_err(|e| {
                ConfigError::MalformedSecret {
                    origin: secrets.origin().to_owned(),
                    reason: format!("{}: {e}", SecretField::SubscriberKeys.name()),
                }
            })?,
        };
        let handle = db.handle(secrets.get(SecretField::DatabaseUrl)?)?;
        let client = QstashClient::new(
            &qstash.base_url,
            secrets.get(SecretField::QstashToken)?.clone(),
            qstash.publish_timeout,
        )?;
        // Lambda's own runtime does not export the timeout, but emulators (SAM local) do: refuse at cold start
        // when it is known; otherwise every invocation checks its deadline (`handle`).
        if let Some(t) = vars.raw("AWS_LAMBDA_FUNCTION_TIMEOUT") {
            let secs: f64 = t.trim().parse().map_err(|_| ConfigError::InvalidVar {
                name: "AWS_LAMBDA_FUNCTION_TIMEOUT",
                value: t.clone(),
                reason: "expected a number of seconds".into(),
            })?;
            relay_cfg.check_invocation_budget(
                Duration::try_from_secs_f64(secs.max(0.0)).unwrap_or(Duration::ZERO),
                "the Lambda timeout (AWS_LAMBDA_FUNCTION_TIMEOUT)",
            )?;
        }
        let function_name = vars
            .raw("AWS_LAMBDA_FUNCTION_NAME")
            .unwrap_or_else(|| "relay".into());
        let budget_without_deadline = vars.duration_or(
            "RELAY_EMULATOR_TIMEOUT_SECS",
            DEFAULT_BUDGET_WITHOUT_DEADLINE,
        )?;
        Ok(RelayState {
            emit_metrics: true,
            budget_without_deadline,
            margin: relay_cfg.deadline_margin,
            relay: Relay::new(handle, client, relay_cfg, qstash)
                .with_subscriber_keys(subscriber_keys),
            function_name,
        })
    }

    /// From the process environment.
    pub async fn from_process_env() -> Result<Self, StartupError> {
        Self::from_env(Arc::new(ProcessEnv)).await
    }

    /// Wraps an already built relay (tests, the local pipeline).
    pub fn new(relay: Relay, function_name: &str) -> Self {
        RelayState {
            margin: relay.config().deadline_margin,
            relay,
            function_name: function_name.to_owned(),
            emit_metrics: true,
            budget_without_deadline: DEFAULT_BUDGET_WITHOUT_DEADLINE,
        }
    }

    /// Turns the per-invocation EMF line on (default) or off (local terminal runs).
    pub fn with_metrics(mut self, emit: bool) -> Self {
        self.emit_metrics = emit;
        self
    }
}

/// The invocation summary (also the handler's response). `Default` is an empty one (for tests and fixtures).
#[derive(Debug, Clone, Default, Serialize)]
pub struct InvocationSummary {
    /// Lambda request id.
    pub request_id: String,
    /// What triggered it (`source` of the event, or `schedule-input`).
    pub trigger: String,
    #[serde(flatten)]
    pub drain: DrainSummary,
    pub housekeeping: HousekeepingReport,
    /// What the accounting pass did ([`crate::accounting`]).
    pub accounting: AccountingReport,
    /// Why the accounting pass failed, if it did (the drain's figures stand).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub accounting_error: Option<String>,
    /// Backlog at the end.
    pub backlog: BacklogGauges,
    /// The database's xmin horizon and the outbox tables' bloat ([`crate::health`]); none when they could not
    /// be read (the invocation's other figures stand, and no health metric is emitted).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub database: Option<HealthGauges>,
    /// Per subscriber of the topics that have named subscribers, at the end ([`crate::subscribers::status`]; the
    /// metrics of [`subscriber_emf`]). Empty when no topic has named subscribers, or when the read failed.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub subscribers: Vec<SubscriberStatus>,
    /// Why the per-subscriber read failed, if it did (the invocation's other figures stand, and no
    /// per-subscriber metric is emitted).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub subscribers_error: Option<String>,
    /// Wall time, ms.
    pub duration_ms: u64,
}

/// The figures of [`crate::health::DatabaseHealth`] the relay reports on every invocation.
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct HealthGauges {
    /// [`crate::health::XminHorizon::oldest_transaction_age_secs`] (metric `OldestTransactionAge`).
    pub oldest_transaction_age_secs: f64,
    /// [`crate::health::XminHorizon::horizon_age_xids`] (metric `XminHorizonAge`).
    pub horizon_age_xids: i64,
    /// What holds the horizon, if anything.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub held_by: Option<String>,
    /// Whether other roles' sessions were visible.
    pub sees_all_sessions: bool,
    /// [`crate::health::DatabaseHealth::max_dead_percent`] (metric `DeadTuplePercent`).
    pub dead_tuple_percent: f64,
    /// The `outbox` table with its indexes, bytes (metric `OutboxTableBytes`).
    pub outbox_bytes: i64,
}

impl From<&crate::health::DatabaseHealth> for HealthGauges {
    fn from(h: &crate::health::DatabaseHealth) -> Self {
        HealthGauges {
            oldest_transaction_age_secs: h.horizon.oldest_transaction_age_secs,
            horizon_age_xids: h.horizon.horizon_age_xids,
            held_by: h.horizon.held_by.clone(),
            sees_all_sessions: h.horizon.sees_all_sessions,
            dead_tuple_percent: h.max_dead_percent(),
            outbox_bytes: h
                .tables
                .iter()
                .find(|t| t.table == "outbox")
                .map_or(0, |t| t.total_bytes),
        }
    }
}

/// Reads [`HealthGauges`]; a failure is logged, not the invocation's failure (monitoring must not stop the relay).
async fn health_gauges(db: &crate::db::Db) -> Option<HealthGauges> {
    match crate::health::read(db).await {
        Ok(h) => {
            if !h.horizon.sees_all_sessions {
                tracing::warn!(
                    "the relay's role sees only its own sessions' transactions: OldestTransactionAge and \
                     XminHorizonAge miss other roles' (grant it pg_read_all_stats; docs/operations.md)"
                );
            }
            Some(HealthGauges::from(&h))
        }
        Err(e) => {
            tracing::warn!(error = %e, "cannot read the database's health figures");
            None
        }
    }
}

/// The longest the per-subscriber read may run in one invocation (its statement timeout). It runs after the
/// drain, within `RELAY_DEADLINE_MARGIN_MS` of the deadline, beside the backlog and health reads.
pub const SUBSCRIBERS_READ_TIMEOUT: Duration = Duration::from_secs(1);

/// Reads the per-subscriber figures ([`crate::subscribers::status::read_within`]); a failure (a timeout among them)
/// is logged and returned as text, not the invocation's failure: monitoring must not stop the relay.
async fn subscriber_gauges(db: &crate::db::Db) -> (Vec<SubscriberStatus>, Option<String>) {
    match crate::subscribers::status::read_within(db, SUBSCRIBERS_READ_TIMEOUT).await {
        Ok(rows) => (rows, None),
        Err(e) => {
            tracing::warn!(error = %e, "cannot read the per-subscriber figures");
            (Vec::new(), Some(crate::telemetry::error_chain(&e)))
        }
    }
}

fn trigger_of(payload: &Value) -> String {
    payload
        .get("source")
        .and_then(Value::as_str)
        .map(str::to_owned)
        .or_else(|| {
            payload
                .get("trigger")
                .and_then(Value::as_str)
                .map(|t| format!("input:{t}"))
        })
        .unwrap_or_else(|| "schedule-input".into())
}

/// The invocation budget assumed when the runtime sends no usable deadline, as local emulators do
/// (`RELAY_EMULATOR_TIMEOUT_SECS`).
pub const DEFAULT_BUDGET_WITHOUT_DEADLINE: Duration = Duration::from_secs(30);

/// The deadline (epoch ms) to drain to: the context's, unless it lies more than a day in the past, which no real
/// Lambda invocation can see but `cargo lambda watch` always sends (a fixed `Lambda-Runtime-Deadline-Ms: 600000`,
/// i.e. 1970); then `now + budget_without_deadline`, so local runs drain instead of stopping at once.
pub fn effective_deadline_ms(
    context_deadline_ms: u64,
    now_ms: u64,
    budget_without_deadline: Duration,
) -> u64 {
    if context_deadline_ms.saturating_add(86_400_000) < now_ms {
        now_ms.saturating_add(budget_without_deadline.as_millis() as u64)
    } else {
        context_deadline_ms
    }
}

/// Converts the Lambda context's deadline (epoch ms) into an `Instant`, minus the margin.
pub fn deadline_from(context_deadline_ms: u64, margin: Duration) -> Instant {
    let deadline = SystemTime::UNIX_EPOCH + Duration::from_millis(context_deadline_ms);
    let left = deadline
        .duration_since(SystemTime::now())
        .unwrap_or(Duration::ZERO);
    Instant::now() + left.saturating_sub(margin)
}

/// The longest an accounting pass may take in one invocation.
pub const ACCOUNTING_BUDGET: Duration = Duration::from_secs(20);

/// The handler: housekeeping, then the drain until the deadline beside one accounting pass and more housekeeping
/// while rows past retention remain, then the summary log + EMF line.
#[tracing::instrument(name = "relay.invoke", skip_all, fields(request_id = %event.context.request_id))]
pub async fn handle(
    state: &RelayState,
    event: LambdaEvent<Value>,
) -> Result<InvocationSummary, RelayError> {
    let started = Instant::now();
    let (payload, context) = event.into_parts();
    let deadline_ms = checked_deadline_ms(state, context.deadline)?;
    let relay = &state.relay;
    let cfg = relay.config();
    relay.declare_subscribers().await?;
    let deadline = deadline_from(deadline_ms, state.margin);
    let retention = retention_of(cfg);
    let pruned = housekeeping::run(relay.db(), retention)
        .await
        .map_err(|source| RelayError::Database {
            step: "housekeeping",
            source,
        })?;
    // The accounting pass runs beside the drain (its QStash lookups are paced; the drain must not wait for them),
    // bounded by a share of the invocation.
    let accounting_budget = deadline
        .saturating_duration_since(Instant::now())
        .min(ACCOUNTING_BUDGET);
    // Housekeeping keeps going beside the drain too, so that retention keeps up with any write rate; it stops
    // when the drain does, and like the drain's workers starts nothing within a lease of the deadline.
    let drained = tokio::sync::Notify::new();
    let drain = async {
        let d = relay.drain(deadline).await;
        drained.notify_one();
        d
    };
    let (drain, accounting, pruned) = tokio::join!(
        drain,
        relay.account(accounting_budget),
        housekeeping::keep_up(
            relay.db(),
            retention,
            pruned,
            deadline.checked_sub(cfg.lease).unwrap_or(deadline),
            &drained,
        )
    );
    // The invocation's spans (export on only) leave before it returns: the environment may freeze after.
    crate::telemetry::flush().await;
    let drain = drain?;
    let (accounting, accounting_error) = accounting_outcome(accounting);
    let backlog = housekeeping::backlog(relay.db(), cfg.accounting.horizon)
        .await
        .map_err(|source| RelayError::Database {
            step: "backlog",
            source,
        })?;
    let (subscribers, subscribers_error) = subscriber_gauges(relay.db()).await;
    let summary = InvocationSummary {
        request_id: context.request_id.clone(),
        trigger: trigger_of(&payload),
        drain,
        housekeeping: pruned,
        accounting,
        accounting_error,
        backlog,
        database: health_gauges(relay.db()).await,
        subscribers,
        subscribers_error,
        duration_ms: started.elapsed().as_millis() as u64,
    };
    report(state, &summary);
    Ok(summary)
}

/// The deadline to drain to, epoch ms ([`effective_deadline_ms`]; a warning when the runtime sent no usable one),
/// refused when the time to it cannot hold a lease plus the margin.
fn checked_deadline_ms(state: &RelayState, context_deadline_ms: u64) -> Result<u64, ConfigError> {
    let now_ms = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0);
    let deadline_ms =
        effective_deadline_ms(context_deadline_ms, now_ms, state.budget_without_deadline);
    if deadline_ms != context_deadline_ms {
        tracing::warn!(
            context_deadline_ms,
            budget_secs = state.budget_without_deadline.as_secs_f64(),
            "the runtime sent no usable deadline (a local emulator): draining for RELAY_EMULATOR_TIMEOUT_SECS"
        );
    }
    // A timeout that cannot hold a lease plus the margin would end every invocation at once with nothing
    // claimed, reported as success: refuse instead, naming both values.
    state.relay.config().check_invocation_budget(
        Duration::from_millis(deadline_ms.saturating_sub(now_ms)),
        "the Lambda invocation's time to its deadline (the function's timeout)",
    )?;
    Ok(deadline_ms)
}

/// What housekeeping may delete in one invocation, and how long one pass may take.
fn retention_of(cfg: &RelayConfig) -> Retention {
    Retention {
        outbox: cfg.retention,
        processed: cfg.processed_ttl,
        batch: cfg.housekeeping_batch,
        time_budget: Duration::from_secs(2),
    }
}

/// The accounting pass's report; when it failed, an empty one and why (logged): the drain's figures stand.
fn accounting_outcome(
    result: Result<AccountingReport, RelayError>,
) -> (AccountingReport, Option<String>) {
    match result {
        Ok(r) => (r, None),
        Err(e) => {
            tracing::error!(error = %e, cause = ?std::error::Error::source(&e), "accounting pass failed");
            (
                AccountingReport::default(),
                Some(crate::telemetry::error_chain(&e)),
            )
        }
    }
}

/// Logs the invocation's summary, and emits its EMF line ([`emf`]) and one per subscriber ([`subscriber_emf`])
/// unless metrics are off.
fn report(state: &RelayState, summary: &InvocationSummary) {
    tracing::info!(summary = %serde_json::to_string(summary).unwrap_or_default(), "relay invocation done");
    if state.emit_metrics {
        emf(&state.function_name, summary).emit();
        for record in subscriber_emf(&state.function_name, summary) {
            record.emit();
        }
    }
}

/// The EMF records of an invocation's per-subscriber figures: one per (topic, subscriber) of
/// [`InvocationSummary::subscribers`], with the dimensions `Function`, `Topic` and `Subscriber` (the subscriber's
/// [`crate::subscribers::label`]: `default` for the relay's `CONSUMER_URL`). The alarms `SubscriberLagAlarm` and
/// `SubscriberBlockedKeysAlarm` read `SubscriberOldestPendingAge` and `SubscriberBlockedKeys` through Metrics
/// Insights queries grouped by topic and subscriber (decision record 0069).
pub fn subscriber_emf(function: &str, s: &InvocationSummary) -> Vec<EmfRecord> {
    s.subscribers
        .iter()
        .map(|sub| {
            EmfRecord::new(function)
                .dimension("Topic", &sub.topic)
                .dimension("Subscriber", crate::subscribers::label(&sub.subscriber))
                .metric("SubscriberPending", Unit::Count, sub.pending as f64)
                .metric(
                    "SubscriberOldestPendingAge",
                    Unit::Seconds,
                    sub.oldest_pending_age_secs,
                )
                .metric("SubscriberInFlight", Unit::Count, sub.in_flight as f64)
                .metric(
                    "SubscriberOldestInFlightAge",
                    Unit::Seconds,
                    sub.oldest_in_flight_age_secs,
                )
                .metric(
                    "SubscriberBlockedKeys",
                    Unit::Count,
                    sub.blocked_keys as f64,
                )
                .metric(
                    "SubscriberDeadLetters",
                    Unit::Count,
                    sub.dead_letters as f64,
                )
                .property("requestId", s.request_id.clone())
                .property("replaying", sub.replaying)
        })
        .collect()
}

/// The EMF record of an invocation (the alarms read `OldestPendingAge`, `DeadLettered` and `QStashOutage`).
pub fn emf(function: &str, s: &InvocationSummary) -> EmfRecord {
    let record = EmfRecord::new(function);
    let record = drain_metrics(record, &s.drain);
    let record = backlog_metrics(record, &s.backlog);
    let record = accounting_metrics(record, &s.accounting);
    let record = latency_metrics(record, &s.drain).property("requestId", s.request_id.clone());
    match &s.database {
        Some(h) => health_metrics(record, h),
        None => record,
    }
}

/// The drain's counts: claimed, dispatched, retried, dead-lettered…, and the QStash outage.
fn drain_metrics(record: EmfRecord, d: &DrainSummary) -> EmfRecord {
    record
        .metric("Claimed", Unit::Count, d.claimed as f64)
        .metric("Dispatched", Unit::Count, d.dispatched as f64)
        .metric("Retried", Unit::Count, d.retried as f64)
        .metric("DeadLettered", Unit::Count, d.dead_lettered as f64)
        .metric("Fenced", Unit::Count, d.fenced as f64)
        .metric("ConfigProblems", Unit::Count, d.config_problems as f64)
        .metric("Released", Unit::Count, d.released as f64)
        .metric(
            "QStashOutage",
            Unit::Count,
            if d.qstash_outage { 1.0 } else { 0.0 },
        )
        .metric("OutageSeconds", Unit::Seconds, d.outage_secs)
}

/// The backlog at the end: pending, blocked keys, awaiting evidence, in flight.
fn backlog_metrics(record: EmfRecord, b: &BacklogGauges) -> EmfRecord {
    record
        .metric("Pending", Unit::Count, b.pending as f64)
        .metric("OldestPendingAge", Unit::Seconds, b.oldest_pending_age_secs)
        .metric("BlockedKeys", Unit::Count, b.blocked_keys as f64)
        .metric("AwaitingEvidence", Unit::Count, b.awaiting_evidence as f64)
        .metric(
            "OldestAwaitingEvidenceAge",
            Unit::Seconds,
            b.oldest_awaiting_evidence_secs,
        )
        .metric("InFlight", Unit::Count, b.in_flight as f64)
        .metric("UnaccountedEvents", Unit::Count, b.unaccounted as f64)
}

/// What the accounting pass did.
fn accounting_metrics(record: EmfRecord, a: &AccountingReport) -> EmfRecord {
    record
        .metric("ReconciledFromDlq", Unit::Count, a.recorded_from_dlq as f64)
        .metric("Republished", Unit::Count, a.republished as f64)
        .metric("StillRetrying", Unit::Count, a.still_retrying as f64)
        .metric(
            "UnaccountedDeadLettered",
            Unit::Count,
            a.unaccounted_dead as f64,
        )
}

/// The drain's publish and claim latencies.
fn latency_metrics(record: EmfRecord, d: &DrainSummary) -> EmfRecord {
    record
        .metric("PublishLatencyP50", Unit::Milliseconds, d.publish_p50_ms)
        .metric("PublishLatencyP99", Unit::Milliseconds, d.publish_p99_ms)
        .metric("ClaimLatencyP50", Unit::Milliseconds, d.claim_p50_ms)
        .metric("ClaimLatencyP99", Unit::Milliseconds, d.claim_p99_ms)
}

/// The database's health: the xmin horizon, dead tuples, the outbox table's size.
fn health_metrics(record: EmfRecord, h: &HealthGauges) -> EmfRecord {
    record
        .metric(
            "OldestTransactionAge",
            Unit::Seconds,
            h.oldest_transaction_age_secs,
        )
        .metric("XminHorizonAge", Unit::Count, h.horizon_age_xids as f64)
        .metric("DeadTuplePercent", Unit::Percent, h.dead_tuple_percent)
        .metric("OutboxTableBytes", Unit::Bytes, h.outbox_bytes as f64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn summary_with(subscribers: Vec<SubscriberStatus>) -> InvocationSummary {
        InvocationSummary {
            request_id: "r".into(),
            trigger: "t".into(),
            subscribers,
            ..Default::default()
        }
    }

    fn subscriber(name: &str, pending: i64, blocked_keys: i64) -> SubscriberStatus {
        SubscriberStatus {
            topic: "orders".into(),
            subscriber: name.into(),
            pending,
            oldest_pending_age_secs: 12.5,
            in_flight: 2,
            oldest_in_flight_age_secs: 3.0,
            blocked_keys,
            dead_letters: 1,
            replaying: false,
            added_at: None,
        }
    }

    /// One record per (topic, subscriber), dimensions `[Function, Topic, Subscriber]` with the default subscriber
    /// shown as `default`; none without named subscribers, and the summary line then has no `subscribers` field.
    #[test]
    fn one_record_per_subscriber_with_topic_and_subscriber_dimensions() {
        let s = summary_with(vec![subscriber("", 4, 0), subscriber("billing", 9, 1)]);
        let lines: Vec<Value> = subscriber_emf("relay", &s)
            .iter()
            .map(|r| serde_json::from_str(&r.to_json()).unwrap())
            .collect();
        assert_eq!(lines.len(), 2);
        for (line, (name, pending, blocked)) in
            lines.iter().zip([("default", 4, 0), ("billing", 9, 1)])
        {
            let directive = &line["_aws"]["CloudWatchMetrics"][0];
            assert_eq!(
                directive["Dimensions"],
                json!([["Function", "Topic", "Subscriber"]])
            );
            let names: Vec<&str> = directive["Metrics"]
                .as_array()
                .unwrap()
                .iter()
                .map(|m| m["Name"].as_str().unwrap())
                .collect();
            assert_eq!(
                names,
                [
                    "SubscriberPending",
                    "SubscriberOldestPendingAge",
                    "SubscriberInFlight",
                    "SubscriberOldestInFlightAge",
                    "SubscriberBlockedKeys",
                    "SubscriberDeadLetters"
                ]
            );
            assert_eq!(line["Function"], "relay");
            assert_eq!(line["Topic"], "orders");
            assert_eq!(line["Subscriber"], name);
            assert_eq!(line["SubscriberPending"], pending as f64);
            assert_eq!(line["SubscriberOldestPendingAge"], 12.5);
            assert_eq!(line["SubscriberBlockedKeys"], blocked as f64);
            assert_eq!(line["SubscriberDeadLetters"], 1.0);
        }
        // The invocation's own record is unchanged by them.
        let main: Value = serde_json::from_str(&emf("relay", &s).to_json()).unwrap();
        assert_eq!(
            main["_aws"]["CloudWatchMetrics"][0]["Dimensions"],
            json!([["Function"]])
        );

        let none = summary_with(Vec::new());
        assert!(subscriber_emf("relay", &none).is_empty());
        let text = serde_json::to_value(&none).unwrap();
        assert!(text.get("subscribers").is_none(), "{text}");
        assert!(text.get("subscribers_error").is_none(), "{text}");
    }

    #[test]
    fn triggers() {
        assert_eq!(
            trigger_of(&json!({"source":"aws.events","detail-type":"Scheduled Event"})),
            "aws.events"
        );
        assert_eq!(trigger_of(&json!({"trigger":"schedule"})), "input:schedule");
        assert_eq!(trigger_of(&json!("anything")), "schedule-input");
    }

    #[test]
    fn deadline_subtracts_the_margin() {
        let now_ms = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap()
            .as_millis() as u64;
        let d = deadline_from(now_ms + 10_000, Duration::from_secs(3));
        let left = d.saturating_duration_since(Instant::now());
        assert!(
            left > Duration::from_millis(6500) && left <= Duration::from_secs(7),
            "{left:?}"
        );
        // A deadline in the past leaves no time at all...
        let d = deadline_from(now_ms.saturating_sub(5000), Duration::from_secs(3));
        assert!(d <= Instant::now());
    }

    #[test]
    fn emulator_deadlines_get_the_budget() {
        let now_ms = 1_795_945_596_306;
        let budget = Duration::from_secs(30);
        // cargo lambda watch sends a fixed 600000 (1970): replaced by now + budget.
        assert_eq!(
            effective_deadline_ms(600_000, now_ms, budget),
            now_ms + 30_000
        );
        // Real deadlines, even slightly past ones, are kept.
        assert_eq!(
            effective_deadline_ms(now_ms + 75_000, now_ms, budget),
            now_ms + 75_000
        );
        assert_eq!(
            effective_deadline_ms(now_ms - 5_000, now_ms, budget),
            now_ms - 5_000
        );
    }
}
