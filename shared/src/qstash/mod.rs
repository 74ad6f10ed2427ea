//! A small QStash client for the relay: publish, enqueue and batch, with every response classified into what
//! the relay acts on ([`PublishOutcome`]):
//!
//! | response | outcome |
//! |---|---|
//! | 2xx, including 202 "deduplicated" | `Accepted` |
//! | 4xx other than 408 / 429 for *this message* (bad request, too large, …) | `Permanent`: dead-letter now, keep the text |
//! | 5xx, 408, 429 (with its retry hint), timeouts, connection errors, an unreadable 2xx | `Transient`: back off and retry |
//! | 401 / 403 / 404 / 405 for the *request* (token, base URL) | `Transient` with `config_problem`: the message is not at fault |
//!
//! A timeout is ambiguous (QStash may have accepted the message); the retry carries the same
//! `Upstash-Deduplication-Id`, so QStash answers 202 with the first message id inside its dedup window, and the
//! consumer's dedupe covers anything later.
//!
//! One `reqwest::Client` (rustls + ring, one connection pool) lives in the relay state and is reused across
//! invocations.

mod options;

pub use options::{FlowControl, HeaderName, HeadersJson, PublishOptions, flow_control_key};

use std::time::Duration;

use secrecy::{ExposeSecret, SecretString};
use serde::Serialize;
use serde_json::Value;

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
    http: reqwest::Client,
    base_url: String,
    token: SecretString,
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
        crate::install_crypto_provider();
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
        })
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
        if msgs.is_empty() {
            return Vec::new();
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
                return vec![
                    PublishOutcome::transient(
                        None,
                        format!("could not encode the batch: {e}")
                    );
                    msgs.len()
                ];
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
            Err(e) => return vec![request_error(&e); msgs.len()],
            Ok(r) => r,
        };
        let status = resp.status().as_u16();
        let hint = retry_after(resp.headers());
        let text = resp.text().await.unwrap_or_default();
        if !(200..300).contains(&status) {
            let o = classify_response(status, hint, &text, |_| None);
            return vec![o; msgs.len()];
        }
        match serde_json::from_str::<Vec<Value>>(&text) {
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
        }
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
fn retry_after(h: &reqwest::header::HeaderMap) -> Option<Duration> {
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
