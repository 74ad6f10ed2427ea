//! Messages: `GET`/`DELETE /v2/messages`, and the filters shared with the DLQ.

use std::collections::HashSet;

use axum::extract::{Path, Request, State};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use super::request::{S, query_pairs, read_body};
use super::response::ok_json;
use crate::core::MsgData;
use crate::error::ApiError;
use crate::view::message_json;

pub(super) async fn get_message(State(s): S, Path(id): Path<String>) -> Response {
    let core = s.core();
    match core.msgs.get(id.as_str()) {
        Some(m) => ok_json(Value::Object(message_json(&m.data))),
        None => ApiError::not_found(format!("message {id} not found")).into_response(),
    }
}

pub(super) async fn cancel_message(State(s): S, Path(id): Path<String>) -> Response {
    if s.with_core(|core, fx| core.cancel(&id, fx)) {
        ok_json(json!({"cancelled": 1}))
    } else {
        ApiError::not_found(format!("message {id} not found")).into_response()
    }
}

/// Multi-valued filter parameters: repeated keys and comma lists, from the query and an optional JSON body.
#[derive(Default, Debug)]
pub(super) struct Filters {
    values: Vec<(String, String)>,
}

impl Filters {
    pub(super) fn from_request(query: Option<&str>, body: &[u8]) -> Result<Filters, ApiError> {
        let mut values = Vec::new();
        for (k, v) in query_pairs(query) {
            if k == "qstash_token" {
                continue;
            }
            for part in v.split(',') {
                values.push((k.clone(), part.trim().to_string()));
            }
        }
        if !body.iter().all(|b| b.is_ascii_whitespace()) {
            let v: Value = serde_json::from_slice(body)
                .map_err(|e| ApiError::bad_request(format!("invalid JSON body: {e}")))?;
            let Value::Object(m) = v else {
                return Err(ApiError::bad_request("JSON body must be an object"));
            };
            for (k, v) in m {
                match v {
                    Value::Array(a) => {
                        for x in a {
                            values.push((k.clone(), scalar(&x)));
                        }
                    }
                    Value::Null => {}
                    other => values.push((k.clone(), scalar(&other))),
                }
            }
        }
        Ok(Filters { values })
    }

    pub(super) fn all(&self, key: &str) -> Vec<&str> {
        self.values
            .iter()
            .filter(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
            .filter(|v| !v.is_empty())
            .collect()
    }

    pub(super) fn one(&self, key: &str) -> Option<&str> {
        self.all(key).into_iter().next()
    }

    pub(super) fn num(&self, key: &str) -> Result<Option<u64>, ApiError> {
        self.one(key)
            .map(|v| {
                v.parse::<u64>()
                    .map_err(|_| ApiError::bad_request(format!("invalid {key}: {v:?}")))
            })
            .transpose()
    }
}

fn scalar(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// Filters common to DLQ entries and messages.
pub(super) struct MessageFilter {
    message_ids: HashSet<String>,
    urls: Vec<String>,
    queues: Vec<String>,
    labels: Vec<String>,
    flow_keys: Vec<String>,
    caller_ips: Vec<String>,
    topic_or_schedule: bool,
    from: Option<u64>,
    to: Option<u64>,
}

impl MessageFilter {
    pub(super) fn new(f: &Filters) -> Result<MessageFilter, ApiError> {
        let own = |k: &str| f.all(k).into_iter().map(str::to_string).collect::<Vec<_>>();
        Ok(MessageFilter {
            message_ids: own("messageId")
                .into_iter()
                .chain(own("messageIds"))
                .collect(),
            urls: own("url"),
            queues: own("queueName"),
            labels: own("label"),
            flow_keys: own("flowControlKey"),
            caller_ips: own("callerIp").into_iter().chain(own("callerIP")).collect(),
            topic_or_schedule: !f.all("topicName").is_empty() || !f.all("scheduleId").is_empty(),
            from: f.num("fromDate")?,
            to: f.num("toDate")?,
        })
    }

    /// Drops the message-id filter (the `dlq_message_filter_ignored` fault).
    pub(super) fn ignore_message_ids(&mut self) {
        self.message_ids.clear();
    }

    pub(super) fn matches(&self, d: &MsgData, time_ms: u64) -> bool {
        let any = |want: &Vec<String>, have: Option<&str>| {
            want.is_empty() || have.is_some_and(|h| want.iter().any(|w| w == h))
        };
        if self.topic_or_schedule {
            return false;
        }
        (self.message_ids.is_empty() || self.message_ids.contains(d.id.as_ref()))
            && any(&self.urls, Some(&d.url))
            && any(&self.queues, d.queue.as_deref())
            && (self.labels.is_empty() || d.labels.iter().any(|l| self.labels.contains(l)))
            && any(&self.flow_keys, d.flow.as_ref().map(|f| f.key.as_str()))
            && any(&self.caller_ips, Some(&d.caller_ip))
            && self.from.is_none_or(|f| time_ms >= f)
            && self.to.is_none_or(|t| time_ms <= t)
    }
}

pub(super) async fn cancel_messages(State(s): S, req: Request) -> Response {
    let (parts, body) = req.into_parts();
    let body = match read_body(&s, body).await {
        Ok(b) => b,
        Err(e) => return e.into_response(),
    };
    let filters = match Filters::from_request(parts.uri.query(), &body) {
        Ok(f) => f,
        Err(e) => return e.into_response(),
    };
    let mf = match MessageFilter::new(&filters) {
        Ok(m) => m,
        Err(e) => return e.into_response(),
    };
    let n = s.with_core(|core, fx| {
        let ids = core.find_messages(|d| mf.matches(d, d.created_at_ms));
        ids.iter().filter(|id| core.cancel(id, fx)).count()
    });
    ok_json(json!({"cancelled": n}))
}
