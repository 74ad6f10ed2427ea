//! [`QstashClient`]: publish, enqueue and batch requests, and each answer classified ([`PublishOutcome`],
//! [`request_level_failure`]); the table is in the module's documentation.

use std::time::Duration;

use secrecy::{ExposeSecret, SecretString};
use serde::Serialize;
use serde_json::Value;

use super::options::{HeadersJson, PublishOptions};

/// The most bytes of one management API answer read by default: one DLQ entry of the largest message QStash
/// takes (10 MB on its paid plans, the body possibly escaped or base64-encoded, plus the last response) fits, so
/// asking about one message at a time always gets an answer.
pub const MAX_ANSWER_BYTES: usize = 32 * 1024 * 1024;

/// One message to publish.
#[derive(Debug, Clone)]
pub struct Message {
    /// Absolute destination URL.
    pub destination: String,
    /// Raw body.
    pub body: String,
    /// Options (mapped to headers).
    pub options: PublishOptions,
}

/// What happened to one message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PublishOutcome {
    /// QStash has the message (`deduplicated`: it already had it, within its dedup window).
    Accepted {
        /// QStash's message id.
        message_id: String,
        /// A duplicate of an earlier publish (HTTP 202).
        deduplicated: bool,
    },
    /// QStash refused this message; retrying will not help.
    Permanent {
        /// HTTP status (400 when QStash gave none for a batch item).
        status: u16,
        /// Response text.
        error: String,
    },
    /// Try again later.
    Transient {
        /// HTTP status, if a response arrived.
        status: Option<u16>,
        /// The server's retry hint.
        retry_after: Option<Duration>,
        error: String,
        /// A token/base-URL problem rather than anything about the message.
        config_problem: bool,
    },
}

/// The answer to one `/v2/batch` request: one outcome per message plus whether the request itself failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchResponse {
    /// One outcome per message, in order (a failed request gives every message the request's outcome).
    pub outcomes: Vec<PublishOutcome>,
    /// The request as a whole failed at request level (see [`request_level_failure`]): the outcomes say nothing
    /// about the messages, so the relay must not count them against the events.
    pub request_failed: bool,
}

/// Whether the outcome of a *whole request* (a single publish, or a batch answered with a non-2xx status or not
/// at all) means QStash as a whole is unavailable to this relay rather than that the message is bad: a transport
/// error or timeout (no status), 5xx, 408, 429 (account or rate limit), or 401/403/404/405 (token or base URL).
/// An unreadable 2xx and every other 4xx are about the message. Never call this on a batch *item*'s outcome:
/// an item's 429 or 5xx is that message's problem, because its siblings in the same request got through.
pub fn request_level_failure(outcome: &PublishOutcome) -> bool {
    match outcome {
        PublishOutcome::Transient { status: None, .. } => true,
        PublishOutcome::Transient {
            status: Some(s), ..
        } => matches!(*s, 401 | 403 | 404 | 405 | 408 | 429 | 500..=599),
        PublishOutcome::Accepted { .. } | PublishOutcome::Permanent { .. } => false,
    }
}

impl PublishOutcome {
    fn transient(status: Option<u16>, error: impl Into<String>) -> Self {
        PublishOutcome::Transient {
            status,
            retry_after: None,
            error: error.into(),
            config_problem: false,
        }
    }
}

/// A client construction error.
#[derive(Debug, thiserror::Error)]
pub enum QstashClientError {
    /// reqwest could not build a client.
    #[error("could not build the HTTP client")]
    Build(#[source] reqwest::Error),
}

/// The QStash client.
#[derive(Clone)]
pub struct QstashClient {
    pub(super) http: reqwest::Client,
    pub(super) base_url: String,
    pub(super) token: SecretString,
    /// The most bytes of a management API answer read ([`QstashClient::with_answer_limit`]).
    pub(super) answer_limit: usize,
}

impl std::fmt::Debug for QstashClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QstashClient")
            .field("base_url", &self.base_url)
            .finish_non_exhaustive()
    }
}

#[derive(Serialize)]
struct BatchItem<'a> {
    destination: &'a str,
    headers: HeadersJson<'a>,
    body: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    queue: Option<&'a str>,
}

impl QstashClient {
    /// A client for `base_url` (e.g. `https://qstash.upstash.io`) with a per-request timeout.
    pub fn new(
        base_url: &str,
        token: SecretString,
        timeout: Duration,
    ) -> Result<Self, QstashClientError> {
        crate::tls::install_crypto_provider();
        let http = reqwest::Client::builder()
            .timeout(timeout)
            .connect_timeout(timeout.min(Duration::from_secs(5)))
            .pool_max_idle_per_host(32)
            .tcp_nodelay(true)
            .user_agent(concat!("outbox-relay/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(QstashClientError::Build)?;
        Ok(QstashClient {
            http,
            base_url: base_url.trim_end_matches('/').to_owned(),
            token,
            answer_limit: MAX_ANSWER_BYTES,
        })
    }

    /// The most bytes of one management API answer this client reads (default [`MAX_ANSWER_BYTES`]); a longer
    /// answer is [`ManageError::TooLarge`].
    pub fn with_answer_limit(mut self, bytes: usize) -> Self {
        self.answer_limit = bytes;
        self
    }

    /// The base URL.
    pub fn base_url(&self) -> &str {
        &self.base_url
    }

    /// `POST /v2/publish/{destination}`.
    pub async fn publish(&self, msg: &Message) -> PublishOutcome {
        let url = format!("{}/v2/publish/{}", self.base_url, msg.destination);
        self.send_one(url, msg).await
    }

    /// `POST /v2/enqueue/{queue}/{destination}` (FIFO queue; QStash rejects delays here).
    pub async fn enqueue(&self, queue: &str, msg: &Message) -> PublishOutcome {
        let url = format!("{}/v2/enqueue/{}/{}", self.base_url, queue, msg.destination);
        self.send_one(url, msg).await
    }

    async fn send_one(&self, url: String, msg: &Message) -> PublishOutcome {
        let mut req = self
            .http
            .post(url)
            .bearer_auth(self.token.expose_secret())
            .body(msg.body.clone());
        for (k, v) in msg.options.headers() {
            req = req.header(k, v);
        }
        match req.send().await {
            Err(e) => request_error(&e),
            Ok(resp) => {
                let status = resp.status().as_u16();
                let retry_after = retry_after(resp.headers());
                let text = resp.text().await.unwrap_or_default();
                classify_response(status, retry_after, &text, parse_accepted)
            }
        }
    }

    /// `POST /v2/batch`: one outcome per message, in order. A failure of the whole request gives every message
    /// that request's outcome.
    pub async fn batch(&self, msgs: &[Message]) -> Vec<PublishOutcome> {
        self.batch_classified(msgs).await.outcomes
    }

    /// [`QstashClient::batch`], also telling whether the request as a whole failed at request level (the relay's
    /// outage detection needs to tell that apart from every item failing on its own).
    pub async fn batch_classified(&self, msgs: &[Message]) -> BatchResponse {
        let outcomes = self.batch_inner(msgs).await;
        match outcomes {
            Ok(outcomes) => BatchResponse {
                outcomes,
                request_failed: false,
            },
            Err(o) => BatchResponse {
                request_failed: request_level_failure(&o),
                outcomes: vec![o; msgs.len()],
            },
        }
    }

    /// `Err`: the outcome of the whole request (no per-item answer).
    async fn batch_inner(&self, msgs: &[Message]) -> Result<Vec<PublishOutcome>, PublishOutcome> {
        if msgs.is_empty() {
            return Ok(Vec::new());
        }
        let items: Vec<BatchItem<'_>> = msgs
            .iter()
            .map(|m| BatchItem {
                destination: &m.destination,
                headers: m.options.headers_json(),
                body: &m.body,
                queue: None,
            })
            .collect();
        // ~600 bytes per message: one allocation for the whole body.
        let mut body = Vec::with_capacity(msgs.len() * 768);
        let body = match serde_json::to_writer(&mut body, &items).map(|_| body) {
            Ok(b) => b,
            Err(e) => {
                return Err(PublishOutcome::transient(
                    None,
                    format!("could not encode the batch: {e}"),
                ));
            }
        };
        let resp = self
            .http
            .post(format!("{}/v2/batch", self.base_url))
            .bearer_auth(self.token.expose_secret())
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await;
        let resp = match resp {
            Err(e) => return Err(request_error(&e)),
            Ok(r) => r,
        };
        let status = resp.status().as_u16();
        let hint = retry_after(resp.headers());
        let text = resp.text().await.unwrap_or_default();
        if !(200..300).contains(&status) {
            return Err(classify_response(status, hint, &text, |_| None));
        }
        Ok(match serde_json::from_str::<Vec<Value>>(&text) {
            Ok(items) if items.len() == msgs.len() => {
                items.iter().map(classify_batch_item).collect()
            }
            Ok(items) => vec![
                PublishOutcome::transient(
                    Some(status),
                    format!(
                        "batch response has {} items for {} messages",
                        items.len(),
                        msgs.len()
                    )
                );
                msgs.len()
            ],
            Err(e) => vec![
                PublishOutcome::transient(
                    Some(status),
                    format!("unreadable batch response: {e}")
                );
                msgs.len()
            ],
        })
    }
}

fn request_error(e: &reqwest::Error) -> PublishOutcome {
    let mut msg = if e.is_timeout() {
        "timeout (QStash may have accepted the message; the retry is deduplicated)".to_owned()
    } else if e.is_connect() {
        "connection failed".to_owned()
    } else {
        "request failed".to_owned()
    };
    let mut source: Option<&dyn std::error::Error> = Some(e);
    while let Some(s) = source {
        msg.push_str(": ");
        msg.push_str(&s.to_string());
        source = s.source();
    }
    PublishOutcome::transient(None, msg)
}

/// `Retry-After` in seconds (QStash's 429s also carry `RateLimit-Reset` / `Burst-RateLimit-Reset`).
pub(super) fn retry_after(h: &reqwest::header::HeaderMap) -> Option<Duration> {
    for name in ["retry-after", "burst-ratelimit-reset", "ratelimit-reset"] {
        if let Some(secs) = h
            .get(name)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<f64>().ok())
            .filter(|s| s.is_finite() && *s >= 0.0 && *s < 86_400.0 * 2.0)
        {
            return Some(Duration::from_secs_f64(secs));
        }
    }
    None
}

fn parse_accepted(v: &Value) -> Option<PublishOutcome> {
    match v {
        Value::Object(o) => {
            o.get("messageId")
                .and_then(Value::as_str)
                .map(|id| PublishOutcome::Accepted {
                    message_id: id.to_owned(),
                    deduplicated: o
                        .get("deduplicated")
                        .and_then(Value::as_bool)
                        .unwrap_or(false),
                })
        }
        // A URL Group destination: one entry per endpoint; accepted when every entry is.
        Value::Array(a) if !a.is_empty() => {
            let all: Option<Vec<&str>> = a
                .iter()
                .map(|e| e.get("messageId").and_then(Value::as_str))
                .collect();
            all.map(|ids| PublishOutcome::Accepted {
                message_id: ids.join(","),
                deduplicated: a.iter().all(|e| {
                    e.get("deduplicated")
                        .and_then(Value::as_bool)
                        .unwrap_or(false)
                }),
            })
        }
        _ => None,
    }
}

fn error_text(text: &str) -> String {
    let t = serde_json::from_str::<Value>(text)
        .ok()
        .and_then(|v| v.get("error").and_then(Value::as_str).map(str::to_owned))
        .unwrap_or_else(|| text.to_owned());
    t.chars().take(2000).collect()
}

fn classify_response(
    status: u16,
    retry_after: Option<Duration>,
    text: &str,
    accepted: impl Fn(&Value) -> Option<PublishOutcome>,
) -> PublishOutcome {
    match status {
        200..=299 => serde_json::from_str::<Value>(text)
            .ok()
            .and_then(|v| accepted(&v))
            .unwrap_or_else(|| {
                PublishOutcome::transient(
                    Some(status),
                    format!("unreadable {status} response: {}", error_text(text)),
                )
            }),
        401 | 403 | 404 | 405 => PublishOutcome::Transient {
            status: Some(status),
            retry_after: None,
            error: format!(
                "QStash answered {status} to the request (check QSTASH_TOKEN and QSTASH_URL): {}",
                error_text(text)
            ),
            config_problem: true,
        },
        408 | 429 | 500..=599 => PublishOutcome::Transient {
            status: Some(status),
            retry_after,
            error: format!("QStash answered {status}: {}", error_text(text)),
            config_problem: false,
        },
        _ => PublishOutcome::Permanent {
            status,
            error: error_text(text),
        },
    }
}

fn classify_batch_item(v: &Value) -> PublishOutcome {
    if let Some(ok) = parse_accepted(v) {
        return ok;
    }
    let error = v
        .get("error")
        .and_then(Value::as_str)
        .map(str::to_owned)
        .unwrap_or_else(|| v.to_string());
    let status = v
        .get("status")
        .and_then(Value::as_u64)
        .and_then(|s| u16::try_from(s).ok());
    match status {
        Some(s @ (408 | 429 | 500..=599)) => PublishOutcome::transient(Some(s), error),
        // A per-item error without a status is taken as a verdict on the item (QStash validates items).
        s => PublishOutcome::Permanent {
            status: s.unwrap_or(400),
            error: error.chars().take(2000).collect(),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn classification_table() {
        let acc = |t: &str| classify_response(200, None, t, parse_accepted);
        assert_eq!(
            acc(r#"{"messageId":"msg_1"}"#),
            PublishOutcome::Accepted {
                message_id: "msg_1".into(),
                deduplicated: false
            }
        );
        assert_eq!(
            classify_response(
                202,
                None,
                r#"{"messageId":"msg_1","deduplicated":true}"#,
                parse_accepted
            ),
            PublishOutcome::Accepted {
                message_id: "msg_1".into(),
                deduplicated: true
            }
        );
        assert!(matches!(
            acc("garbage"),
            PublishOutcome::Transient {
                status: Some(200),
                ..
            }
        ));
        assert_eq!(
            classify_response(
                400,
                None,
                r#"{"error":"DeduplicationId cannot contain ':'"}"#,
                parse_accepted
            ),
            PublishOutcome::Permanent {
                status: 400,
                error: "DeduplicationId cannot contain ':'".into()
            }
        );
        assert!(matches!(
            classify_response(413, None, "too big", parse_accepted),
            PublishOutcome::Permanent { status: 413, .. }
        ));
        for s in [408u16, 429, 500, 502, 503] {
            assert!(
                matches!(
                    classify_response(s, None, "", parse_accepted),
                    PublishOutcome::Transient {
                        config_problem: false,
                        ..
                    }
                ),
                "{s}"
            );
        }
        assert!(matches!(
            classify_response(429, Some(Duration::from_secs(7)), "", parse_accepted),
            PublishOutcome::Transient { retry_after: Some(d), .. } if d == Duration::from_secs(7)
        ));
        for s in [401u16, 403, 404] {
            assert!(
                matches!(
                    classify_response(s, None, "", parse_accepted),
                    PublishOutcome::Transient {
                        config_problem: true,
                        ..
                    }
                ),
                "{s}"
            );
        }
    }

    #[test]
    fn request_level_failures_are_told_from_message_failures() {
        let t = |status: Option<u16>| PublishOutcome::transient(status, "x");
        // QStash unavailable to this relay as a whole: no response, 5xx, rate limit, token or URL refused.
        for o in [
            t(None),
            t(Some(500)),
            t(Some(503)),
            t(Some(408)),
            t(Some(429)),
        ] {
            assert!(request_level_failure(&o), "{o:?}");
        }
        for s in [401u16, 403, 404, 405] {
            let o = classify_response(s, None, "", parse_accepted);
            assert!(request_level_failure(&o), "{s}");
        }
        // About the message: accepted, refused (400, 413, 422), or an unreadable 2xx.
        for o in [
            PublishOutcome::Accepted {
                message_id: "m".into(),
                deduplicated: false,
            },
            classify_response(400, None, "bad destination", parse_accepted),
            classify_response(413, None, "", parse_accepted),
            classify_response(422, None, "", parse_accepted),
            classify_response(200, None, "garbage", parse_accepted),
        ] {
            assert!(!request_level_failure(&o), "{o:?}");
        }
    }

    #[tokio::test]
    async fn a_batch_that_never_reaches_qstash_failed_as_a_request() {
        // A closed port, held for the test (bound, not listening): connection refused, whatever the messages.
        let closed = outbox_testkit::ports::ReservedPort::new().unwrap();
        let port = closed.port();
        let client = QstashClient::new(
            &format!("http://127.0.0.1:{port}"),
            SecretString::from("t".to_owned()),
            Duration::from_secs(2),
        )
        .unwrap();
        let msg = Message {
            destination: "http://127.0.0.1:1/x".into(),
            body: "{}".into(),
            options: PublishOptions::default(),
        };
        let r = client.batch_classified(&[msg.clone(), msg]).await;
        assert!(r.request_failed, "{r:?}");
        assert_eq!(r.outcomes.len(), 2);
        let empty = client.batch_classified(&[]).await;
        assert!(!empty.request_failed && empty.outcomes.is_empty());
    }

    #[test]
    fn batch_items() {
        assert!(matches!(
            classify_batch_item(&json!({"messageId":"m"})),
            PublishOutcome::Accepted { .. }
        ));
        assert!(matches!(
            classify_batch_item(&json!({"error":"bad"})),
            PublishOutcome::Permanent { status: 400, .. }
        ));
        assert!(matches!(
            classify_batch_item(&json!({"error":"busy","status":503})),
            PublishOutcome::Transient { .. }
        ));
        assert!(matches!(
            classify_batch_item(
                &json!([{"messageId":"a","url":"u1"},{"messageId":"b","url":"u2"}])
            ),
            PublishOutcome::Accepted { .. }
        ));
    }
}
