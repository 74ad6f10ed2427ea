//! The two management API calls the reconciler makes ([`crate::accounting`], decision record 0015), as QStash
//! documents them:
//!
//! - `GET /v2/dlq?messageId=a&messageId=b&count=100[&cursor=…]`: the DLQ entries of up to 100 messages in one
//!   request (a multi-valued filter is an OR), paged by cursor;
//! - `GET /v2/messages/{messageId}`: the message while QStash still holds it (waiting, delivering, retrying); 404
//!   once it was delivered, cancelled, expired, or never accepted.
//!
//! QStash rate-limits the management API per second (a 429 with `Burst-RateLimit-*` headers): the caller paces its
//! requests and stops for the invocation at the first 429 ([`ManageError::RateLimited`]).
//!
//! An answer is read up to a bound ([`MAX_ANSWER_BYTES`], [`QstashClient::with_answer_limit`]) and refused beyond
//! it ([`ManageError::TooLarge`]; a `Content-Length` over the bound is refused before a byte is read): a DLQ page
//! carries the messages' bodies, and whatever answers at `QSTASH_URL` must not be able to exhaust the relay's
//! memory. The caller asks again about fewer messages ([`crate::accounting`]).

use std::time::Duration;

use secrecy::ExposeSecret;
use serde_json::Value;

use super::{QstashClient, retry_after};

/// The most message ids one DLQ request filters on (QStash's page size is at most 100).
pub const DLQ_IDS_PER_REQUEST: usize = 100;

/// A management API call that did not give an answer.
#[derive(Debug, thiserror::Error)]
pub enum ManageError {
    /// 429: over the per-second (or daily) limit.
    #[error("QStash rate-limited the management API (retry after {retry_after:?})")]
    RateLimited {
        /// The server's hint, if any.
        retry_after: Option<Duration>,
    },
    /// Any other non-2xx answer (404 is an answer for [`QstashClient::message`], not an error).
    #[error("QStash answered {status} to {what}: {body}")]
    Status {
        /// Which call.
        what: &'static str,
        /// The HTTP status.
        status: u16,
        /// The start of the body.
        body: String,
    },
    /// No answer (connection, timeout).
    #[error("{what} failed: {error}")]
    Transport {
        /// Which call.
        what: &'static str,
        /// The error chain.
        error: String,
    },
    /// An answer longer than the client reads ([`QstashClient::with_answer_limit`]); nothing of it was used.
    #[error("QStash's answer to {what} is longer than {limit} bytes, the most this client reads")]
    TooLarge {
        /// Which call.
        what: &'static str,
        /// The bound, bytes.
        limit: usize,
    },
    /// A 2xx that is not the documented JSON.
    #[error("unreadable answer to {what}: {error}")]
    Unreadable {
        /// Which call.
        what: &'static str,
        /// What was wrong.
        error: String,
    },
}

/// One page of [`QstashClient::dlq_page`].
#[derive(Debug, Clone, Default)]
pub struct DlqPage {
    /// The DLQ messages, as QStash returned them (`messageId`, `dlqId`, `header`, `body`, `responseStatus`, …).
    pub messages: Vec<Value>,
    /// The cursor of the next page; `None` at the end.
    pub cursor: Option<String>,
}

impl QstashClient {
    async fn get_json(&self, what: &'static str, url: &str) -> Result<Option<Value>, ManageError> {
        let resp = self
            .http
            .get(url)
            .bearer_auth(self.token.expose_secret())
            .send()
            .await
            .map_err(|e| ManageError::Transport {
                what,
                error: crate::telemetry::error_chain(&e),
            })?;
        let status = resp.status().as_u16();
        if status == 404 {
            return Ok(None);
        }
        if status == 429 {
            return Err(ManageError::RateLimited {
                retry_after: retry_after(resp.headers()),
            });
        }
        let bytes = self.read_bounded(what, resp).await?;
        if !(200..300).contains(&status) {
            return Err(ManageError::Status {
                what,
                status,
                body: String::from_utf8_lossy(&bytes).chars().take(300).collect(),
            });
        }
        serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(|e| ManageError::Unreadable {
                what,
                error: e.to_string(),
            })
    }

    /// The answer's body, at most `answer_limit` bytes: refused unread when its `Content-Length` says more,
    /// refused as soon as more arrives otherwise.
    async fn read_bounded(
        &self,
        what: &'static str,
        mut resp: reqwest::Response,
    ) -> Result<Vec<u8>, ManageError> {
        let limit = self.answer_limit;
        let too_large = ManageError::TooLarge { what, limit };
        if resp.content_length().is_some_and(|n| n > limit as u64) {
            return Err(too_large);
        }
        let mut body = Vec::new();
        while let Some(chunk) = resp.chunk().await.map_err(|e| ManageError::Transport {
            what,
            error: crate::telemetry::error_chain(&e),
        })? {
            if body.len() + chunk.len() > limit {
                return Err(too_large);
            }
            body.extend_from_slice(&chunk);
        }
        Ok(body)
    }

    /// `GET /v2/dlq` filtered on `message_ids` (at most [`DLQ_IDS_PER_REQUEST`]; more are an error of the
    /// caller's), `count=100`, from `cursor`.
    pub async fn dlq_page(
        &self,
        message_ids: &[String],
        cursor: Option<&str>,
    ) -> Result<DlqPage, ManageError> {
        const WHAT: &str = "GET /v2/dlq";
        let mut url = reqwest::Url::parse(&format!("{}/v2/dlq", self.base_url)).map_err(|e| {
            ManageError::Transport {
                what: WHAT,
                error: format!("bad QSTASH_URL: {e}"),
            }
        })?;
        {
            let mut q = url.query_pairs_mut();
            q.append_pair("count", "100");
            for id in message_ids.iter().take(DLQ_IDS_PER_REQUEST) {
                q.append_pair("messageId", id);
            }
            if let Some(c) = cursor {
                q.append_pair("cursor", c);
            }
        }
        let Some(v) = self.get_json(WHAT, url.as_str()).await? else {
            return Err(ManageError::Status {
                what: WHAT,
                status: 404,
                body: "no DLQ endpoint at this QSTASH_URL".into(),
            });
        };
        let messages = match v.get("messages") {
            Some(Value::Array(a)) => a.clone(),
            None | Some(Value::Null) => Vec::new(),
            Some(other) => {
                return Err(ManageError::Unreadable {
                    what: WHAT,
                    error: format!("`messages` is not an array: {other}"),
                });
            }
        };
        let cursor = v
            .get("cursor")
            .and_then(Value::as_str)
            .filter(|c| !c.is_empty())
            .map(str::to_owned);
        Ok(DlqPage { messages, cursor })
    }

    /// `GET /v2/messages/{id}`: `Some` while QStash holds the message, `None` (404) when it does not.
    pub async fn message(&self, message_id: &str) -> Result<Option<Value>, ManageError> {
        let url = format!(
            "{}/v2/messages/{}",
            self.base_url,
            urlencoding_path(message_id)
        );
        self.get_json("GET /v2/messages/{id}", &url).await
    }
}

/// Percent-encodes what may not appear in one path segment (QStash's ids are `msg_…` in base62, so this is a
/// guard, not a need).
fn urlencoding_path(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}
