//! A small QStash client for the relay: publish, enqueue and batch, with every response classified into what
//! the relay acts on ([`PublishOutcome`]):
//!
//! | response | outcome |
//! |---|---|
//! | 2xx, including 202 "deduplicated" | `Accepted` |
//! | 4xx other than 408 / 429 for *this message* (bad request, too large, …) | `Permanent`: dead-letter now, keep the text |
//! | 5xx, 408, 429 (with its retry hint), timeouts, connection errors, an unreadable 2xx | `Transient`: back off and retry |
//! | 401 / 403 / 404 / 405 for the *request* (token, base URL) | `Transient` with `config_problem`: the message is not at fault (and the relay spends no attempt on it, see below) |
//!
//! Independently of the outcome, each *request* is classified ([`request_level_failure`]): a transport error,
//! timeout, 5xx, 401/403/404/405, 408 or 429 answered to the publish or batch request itself says nothing about
//! the messages in it (QStash is down, unreachable, or refusing this relay's token, URL or account rate), while a
//! batch item's own error or a 4xx about a single message is a verdict on that message. The relay treats a cycle
//! whose every request failed at request level as an outage, not as each event's failure (decision record 0012).
//!
//! A timeout is ambiguous (QStash may have accepted the message); the retry carries the same
//! `Upstash-Deduplication-Id`, so QStash answers 202 with the first message id inside its dedup window, and the
//! consumer's dedupe covers anything later.
//!
//! One `reqwest::Client` (rustls + ring, one connection pool) lives in the relay state and is reused across
//! invocations.
//!
//! The same client makes the two management API calls of the relay's reconciler (`manage.rs`: the DLQ entries of
//! given messages, and whether QStash still holds a message; decision record 0015).

mod client;
mod manage;
mod options;

#[cfg_attr(not(feature = "internals"), allow(unused_imports))] // for `crate::internals`
pub use client::BatchResponse;
pub(crate) use client::request_level_failure;
use client::retry_after;
pub use client::{Message, PublishOutcome, QstashClient, QstashClientError};
pub(crate) use manage::DLQ_IDS_PER_REQUEST;
#[cfg_attr(not(feature = "internals"), allow(unused_imports))] // for `crate::internals`
pub use manage::DlqPage;
pub use manage::ManageError;
#[cfg_attr(not(feature = "internals"), allow(unused_imports))] // for `crate::internals`
pub use options::HeadersJson;
pub use options::{FlowControl, HeaderName, PublishOptions, flow_control_key};
