//! Server configuration and fault-injection settings.

use std::net::{IpAddr, Ipv4Addr};
use std::time::Duration;

use serde::{Deserialize, Serialize};

pub use crate::sign::NbfMode;

/// The documented local-dev token: base64 of `{"UserID":"defaultUser","Password":"defaultPassword"}`.
pub const DEV_TOKEN: &str =
    "eyJVc2VySUQiOiJkZWZhdWx0VXNlciIsIlBhc3N3b3JkIjoiZGVmYXVsdFBhc3N3b3JkIn0=";
/// The documented local-dev current signing key.
pub const DEV_CURRENT_SIGNING_KEY: &str = "sig_7kYjw48mhY7kAjqNGcy6cr29RJ6r";
/// The documented local-dev next signing key.
pub const DEV_NEXT_SIGNING_KEY: &str = "sig_5ZB6DVzB1wjE8S6rZ7eenA8Pdnhs";

/// Order in which a flow-control key's waitlist hands out free slots.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WaitlistOrder {
    /// First come, first served.
    Fifo,
    /// A seeded random pick among the waiting messages: a later message can overtake an earlier one, which
    /// QStash documents as possible. Use it to make ordering bugs show up in tests.
    #[default]
    Shuffled,
}

/// When a failed response counts as "non-retryable" (straight to the DLQ).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NonRetryableMode {
    /// Status 489 **and** `Upstash-NonRetryable-Error: true` (the documented contract).
    #[default]
    Require489,
    /// The header alone, with any non-2xx status.
    HeaderAlone,
}

/// JSON type of `notBefore` / `createdAt` in callback bodies.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TimestampFormat {
    /// Unix milliseconds as JSON numbers.
    #[default]
    Number,
    /// Unix milliseconds as JSON strings (as in the docs' example).
    String,
}

/// Fault injection. All rates are probabilities in `[0, 1]`. Each decision is a pure function of
/// [`Config::seed`], the kind of fault, whose it is (a message's deduplication id or content, a publish request's
/// content) and which try it is (the attempt, the how-many-th request with that content), so the same seed and
/// workload inject the same faults per message however concurrent requests interleave (decision record 0114).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Faults {
    /// Share of publish / enqueue / batch requests answered `500 {"error":"..."}` with nothing stored.
    pub publish_5xx_rate: f64,
    /// Share of publish / enqueue / batch requests that are accepted and stored (and will be delivered) but
    /// whose connection is then closed without any response bytes: the ambiguous case.
    pub publish_drop_response_rate: f64,
    /// Share of successful deliveries that are delivered a second time (same message id, a fresh signature).
    pub duplicate_delivery_rate: f64,
    /// Extra wall-clock delay before every publish / enqueue / batch response (not scaled by `time_scale`).
    #[serde(with = "duration_ms", rename = "publish_response_delay_ms")]
    pub publish_response_delay: Duration,
    /// Share of delivery attempts that fail inside the server as if the network failed (nothing is sent).
    pub delivery_network_error_rate: f64,
    /// Share of delivery attempts whose request reaches the destination but whose response is treated as lost
    /// (a network error after the destination did the work: it will be retried).
    pub delivery_lost_response_rate: f64,
    /// Share of accepted messages the server loses before their first attempt: never delivered, no callback, not
    /// in the DLQ, unknown to `GET /v2/messages/{id}` (the publisher got its message id; nothing else happens).
    /// What an at-least-once service may do after a crash; the outbox's reconciler must notice it.
    pub message_loss_rate: f64,
    /// `GET /v2/dlq` answers as if no `messageId` / `messageIds` filter had been given (every other filter still
    /// applies): what a client relying on a filter the server does not know (renamed, or never supported) gets —
    /// every entry of the account, other publishers' included. Not a rate: the whole DLQ API misbehaves.
    pub dlq_message_filter_ignored: bool,
}

impl Faults {
    /// Rejects rates outside `[0, 1]` or NaN.
    pub fn validate(&self) -> Result<(), String> {
        for (name, v) in [
            ("publish_5xx_rate", self.publish_5xx_rate),
            (
                "publish_drop_response_rate",
                self.publish_drop_response_rate,
            ),
            ("duplicate_delivery_rate", self.duplicate_delivery_rate),
            (
                "delivery_network_error_rate",
                self.delivery_network_error_rate,
            ),
            (
                "delivery_lost_response_rate",
                self.delivery_lost_response_rate,
            ),
            ("message_loss_rate", self.message_loss_rate),
        ] {
            if !(0.0..=1.0).contains(&v) {
                return Err(format!("{name} must be within [0, 1], got {v}"));
            }
        }
        Ok(())
    }
}

/// Everything the dev server can be told. `Config::default()` is what the binary runs with out of the box.
#[derive(Clone, Debug)]
pub struct Config {
    /// Address to bind (loopback by default). Any other address needs a `token` other than [`DEV_TOKEN`].
    pub bind: IpAddr,
    /// Port; 0 picks a free one (what tests want).
    pub port: u16,
    /// The accepted bearer token (`Authorization: Bearer ...` or `?qstash_token=`).
    pub token: String,
    /// Key that signs deliveries.
    pub current_signing_key: String,
    /// The next key (reported by `/v2/keys`; becomes current on rotation).
    pub next_signing_key: String,
    /// How long a deduplication id (explicit or content-based) is remembered. Not scaled by `time_scale`.
    pub dedup_window: Duration,
    /// Multiplies every wait: delay, not-before distance, retry backoff, Retry-After, flow-control period.
    /// `1.0` = real time, `0.001` = a 12 s backoff takes 12 ms. Per-attempt HTTP timeouts are *not* scaled.
    pub time_scale: f64,
    /// `Upstash-Retries` when the publish does not say.
    pub default_retries: u32,
    /// Upper bound accepted for `Upstash-Retries` (larger values are clamped).
    pub max_retries: u32,
    /// Flow-control waitlist order.
    pub waitlist_order: WaitlistOrder,
    /// Seed for fault injection (reproducible per message, 0114) and the waitlist shuffle (which depends on the
    /// order in which messages reach the waitlist too).
    pub seed: u64,
    /// `false` = accept-only mode: publishes are validated, deduplicated, counted and then dropped; nothing is
    /// stored or delivered. For pure-accept benchmarks.
    pub deliver: bool,
    /// Maximum deliveries in flight at once, over all destinations.
    pub max_concurrency: usize,
    /// Per-attempt HTTP timeout cap (the plan's "max HTTP response duration"); `Upstash-Timeout` only shortens it.
    pub max_timeout: Duration,
    /// `nbf` claim of delivery signatures.
    pub nbf: NbfMode,
    /// When a failed response is non-retryable.
    pub non_retryable: NonRetryableMode,
    /// Whether a retry scheduled from `Retry-After` / `X-RateLimit-Reset*` uses up one of the message's retries.
    pub retry_after_consumes_retry: bool,
    /// `upstash-region` header sent on deliveries; `None` leaves it out.
    pub region: Option<String>,
    /// JSON type of `notBefore` / `createdAt` in callback bodies.
    pub callback_timestamps: TimestampFormat,
    /// Capacity of the in-memory attempt log (oldest entries dropped first).
    pub attempt_log_capacity: usize,
    /// How long DLQ entries are kept (wall clock, not scaled).
    pub dlq_retention: Duration,
    /// Largest accepted request body (a single publish, or a whole batch).
    pub max_request_bytes: usize,
    /// Largest destination response body kept for DLQ entries and callback bodies (longer ones are truncated).
    pub max_response_body_bytes: usize,
    /// Initial fault-injection settings.
    pub faults: Faults,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            bind: IpAddr::V4(Ipv4Addr::LOCALHOST),
            port: 8080,
            token: DEV_TOKEN.to_string(),
            current_signing_key: DEV_CURRENT_SIGNING_KEY.to_string(),
            next_signing_key: DEV_NEXT_SIGNING_KEY.to_string(),
            dedup_window: Duration::from_secs(600),
            time_scale: 1.0,
            default_retries: 3,
            max_retries: 100,
            waitlist_order: WaitlistOrder::Shuffled,
            seed: 0,
            deliver: true,
            max_concurrency: 256,
            max_timeout: Duration::from_secs(15 * 60),
            nbf: NbfMode::GoZero,
            non_retryable: NonRetryableMode::Require489,
            retry_after_consumes_retry: true,
            region: Some("EU-CENTRAL-1".to_string()),
            callback_timestamps: TimestampFormat::Number,
            attempt_log_capacity: 50_000,
            dlq_retention: Duration::from_secs(7 * 86_400),
            max_request_bytes: 64 * 1024 * 1024,
            max_response_body_bytes: 1024 * 1024,
            faults: Faults::default(),
        }
    }
}

impl Config {
    /// A config for tests: random port, the given time scale, everything else default.
    pub fn for_tests(time_scale: f64) -> Config {
        Config {
            port: 0,
            time_scale,
            ..Config::default()
        }
    }

    pub(crate) fn validate(&self) -> Result<(), String> {
        if !(self.time_scale.is_finite() && self.time_scale >= 0.0) {
            return Err(format!(
                "time_scale must be a finite number >= 0, got {}",
                self.time_scale
            ));
        }
        if self.max_concurrency == 0 {
            return Err("max_concurrency must be at least 1".into());
        }
        if self.token.is_empty() {
            return Err("token must not be empty".into());
        }
        if !is_loopback(self.bind) && self.token == DEV_TOKEN {
            return Err(format!(
                "refusing to listen on {} (not a loopback address) with the documented default dev token, \
                 which anyone who can reach the port could use: set a token of your own with --token or \
                 QSTASH_DEV_TOKEN (library: Config::token), or bind a loopback address (--bind 127.0.0.1, the \
                 default)",
                self.bind
            ));
        }
        self.faults.validate()
    }
}

/// 127.0.0.0/8, ::1, or an IPv4-mapped loopback address: reachable from this machine only.
pub(crate) fn is_loopback(ip: IpAddr) -> bool {
    ip.to_canonical().is_loopback()
}

/// Serde helper: a `Duration` as integer milliseconds.
pub(crate) mod duration_ms {
    use serde::{Deserialize, Deserializer, Serializer};
    use std::time::Duration;

    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        Ok(Duration::from_millis(u64::deserialize(d)?))
    }
}

/// Serde helper: a `Duration` as integer microseconds.
pub(crate) mod duration_us {
    use serde::{Deserialize, Deserializer, Serializer};
    use std::time::Duration;

    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        Ok(Duration::from_micros(u64::deserialize(d)?))
    }
}
