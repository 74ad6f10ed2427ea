//! Public, serialisable views used by the library handle and the `/__dev/` inspection API.

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// What a delivery attempt was for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum AttemptKind {
    /// The published destination.
    Destination,
    /// An `Upstash-Callback` message.
    Callback,
    /// An `Upstash-Failure-Callback` message.
    FailureCallback,
}

/// One HTTP request the server made (or tried to make).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct DeliveryAttempt {
    /// Monotonic sequence number of the attempt (starts at 1).
    pub seq: u64,
    /// Wall-clock start, unix milliseconds.
    pub at_unix_ms: u64,
    /// Start relative to server start (monotonic clock), for measuring gaps between attempts.
    #[serde(with = "crate::config::duration_us", rename = "offset_us")]
    pub offset: Duration,
    /// The message id sent as `Upstash-Message-Id`.
    pub message_id: String,
    /// Destination / callback / failure callback.
    pub kind: AttemptKind,
    /// Target URL (= the `sub` claim).
    pub url: String,
    /// HTTP method.
    pub method: String,
    /// `Upstash-Retried` of this attempt (0 = first attempt).
    pub retried: u32,
    /// Response status, if a response arrived.
    pub status: Option<u16>,
    /// Transport error (connection refused, timeout, injected fault...), if any.
    pub error: Option<String>,
    /// Request headers as sent (lower-case names).
    pub request_headers: Vec<(String, String)>,
    /// Time from start until the response body was read (or the error).
    #[serde(with = "crate::config::duration_us", rename = "duration_us")]
    pub duration: Duration,
    /// The nominal (unscaled) wait that was scheduled before this attempt: delay / not-before distance for the
    /// first attempt, the backoff or Retry-After for retries. Multiply by `time_scale` for the real wait.
    #[serde(with = "crate::config::duration_us", rename = "planned_delay_us")]
    pub planned_delay: Duration,
    /// True for a duplicate delivery injected by `Faults::duplicate_delivery_rate`.
    pub duplicate: bool,
    /// Flow-control key of the message, if any.
    pub flow_control_key: Option<String>,
    /// Queue of the message (callbacks inherit their parent's), if any.
    pub queue_name: Option<String>,
    /// Length of the request body.
    pub body_len: usize,
}

impl DeliveryAttempt {
    /// A request header by (case-insensitive) name.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.request_headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    /// True when the destination answered 2xx.
    pub fn succeeded(&self) -> bool {
        matches!(self.status, Some(s) if (200..300).contains(&s)) && self.error.is_none()
    }
}

/// Counters and gauges.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Stats {
    /// Publish / enqueue / batch HTTP requests received (incl. rejected ones).
    pub publish_requests: u64,
    /// Messages accepted (new message ids, excluding duplicates). Includes DLQ retries, excludes callbacks.
    pub accepted: u64,
    /// Publishes answered as duplicates (202 / `deduplicated: true`).
    pub deduplicated: u64,
    /// Publishes (or batch items) rejected with a 4xx.
    pub rejected: u64,
    /// Messages (of any kind) delivered with a 2xx.
    pub delivered: u64,
    /// Messages (of any kind) moved to the DLQ.
    pub failed_to_dlq: u64,
    /// Delivery attempts made (incl. failures and injected duplicates).
    pub attempts: u64,
    /// Callback and failure-callback messages created.
    pub callbacks_created: u64,
    /// Messages cancelled through the API (or removed with a deleted queue).
    pub cancelled: u64,
    /// Duplicate deliveries injected.
    pub duplicate_deliveries: u64,
    /// Publish requests failed on purpose with a 5xx.
    pub injected_publish_errors: u64,
    /// Publish requests whose response was dropped on purpose.
    pub injected_dropped_responses: u64,
    /// Accepted messages lost on purpose before their first attempt (`message_loss_rate`); their ids are in
    /// `/__dev/lost`.
    pub injected_lost_messages: u64,
    /// Body bytes of the publish / enqueue / batch requests received (headers not counted).
    #[serde(default)]
    pub publish_bytes: u64,
    /// Other QStash API requests received (`/v2/messages`, `/v2/dlq`, queues, flow control, keys; the `/__dev/`
    /// API not counted): what a client spends on lookups.
    #[serde(default)]
    pub api_requests: u64,
    /// Delivery attempts after the first of their message (`Upstash-Retried` > 0; injected duplicates not
    /// counted).
    #[serde(default)]
    pub retries: u64,
    /// Delivery attempts of callback and failure-callback messages (part of `attempts`).
    #[serde(default)]
    pub callback_attempts: u64,
    /// Deliveries in flight right now (HTTP request outstanding).
    pub in_flight: u64,
    /// Live messages not in flight: delayed, waiting for retry, in a queue or flow-control waitlist, or ready.
    pub waiting: u64,
    /// Entries in the DLQ right now.
    pub dlq_size: u64,
}

/// A DLQ entry as the library handle reports it.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct DlqEntryInfo {
    /// `"<unix ms>-<n>"`.
    pub dlq_id: String,
    /// The failed message's id.
    pub message_id: String,
    /// Destination / callback / failure callback.
    pub kind: AttemptKind,
    /// Target URL.
    pub url: String,
    pub method: String,
    /// Body as published.
    pub body: Vec<u8>,
    /// `Upstash-Retried` of the last attempt.
    pub retried: u32,
    /// Retries allowed.
    pub max_retries: u32,
    /// Status of the last response, if any.
    pub response_status: Option<u16>,
    /// Last response body (possibly truncated).
    pub response_body: Vec<u8>,
    /// Transport error of the last attempt, if any.
    pub error: Option<String>,
    /// When it entered the DLQ (unix ms).
    pub created_at_unix_ms: u64,
    pub queue_name: Option<String>,
    /// Flow-control key, if any.
    pub flow_control_key: Option<String>,
    pub labels: Vec<String>,
}
