//! QStash's JSON view of a message, as `GET /v2/messages/{id}` returns it; DLQ entries (`/v2/dlq`) and
//! `/__dev/messages` extend it.

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use serde_json::{Map, Value, json};

use crate::core::{MsgData, header_multimap};

pub(crate) fn body_fields(obj: &mut Map<String, Value>, key: &str, key_b64: &str, body: &[u8]) {
    match std::str::from_utf8(body) {
        Ok(s) => obj.insert(key.into(), json!(s)),
        Err(_) => obj.insert(key_b64.into(), json!(STANDARD.encode(body))),
    };
}

pub(crate) fn message_json(d: &MsgData) -> Map<String, Value> {
    let mut o = Map::new();
    o.insert("messageId".into(), json!(d.id.as_ref()));
    o.insert("url".into(), json!(d.url));
    o.insert("method".into(), json!(d.method.as_str()));
    o.insert(
        "header".into(),
        header_multimap(d.source_header_pairs().into_iter()),
    );
    body_fields(&mut o, "body", "bodyBase64", &d.body);
    o.insert("maxRetries".into(), json!(d.max_retries));
    if let Some(e) = &d.retry_delay {
        o.insert("retryDelayExpression".into(), json!(e.source()));
    }
    o.insert("notBefore".into(), json!(d.not_before_ms));
    o.insert("createdAt".into(), json!(d.created_at_ms));
    if let Some(t) = d.timeout {
        o.insert("timeout".into(), json!(t.as_secs()));
    }
    for (key, hkey, spec) in [
        ("callback", "callbackHeader", &d.callback),
        (
            "failureCallback",
            "failureCallbackHeader",
            &d.failure_callback,
        ),
    ] {
        if let Some(cb) = spec {
            o.insert(key.into(), json!(cb.url));
            if !cb.forward.is_empty() {
                o.insert(
                    hkey.into(),
                    header_multimap(
                        cb.forward
                            .iter()
                            .map(|(k, v)| (k.as_str(), v.to_str().unwrap_or(""))),
                    ),
                );
            }
        }
    }
    o.insert("callerIP".into(), json!(d.caller_ip.as_ref()));
    o.insert("callerIp".into(), json!(d.caller_ip.as_ref()));
    if let Some(q) = &d.queue {
        o.insert("queueName".into(), json!(q));
    }
    if let Some(f) = &d.flow {
        o.insert("flowControlKey".into(), json!(f.key));
        if let Some(p) = f.parallelism {
            o.insert("parallelism".into(), json!(p));
        }
        if let Some(r) = f.rate {
            o.insert("rate".into(), json!(r));
            o.insert("period".into(), json!(f.period.as_secs()));
        }
    }
    if let Some(first) = d.labels.first() {
        o.insert("label".into(), json!(first));
        o.insert("labels".into(), json!(d.labels));
    }
    if let Some(r) = &d.redact {
        o.insert("redactFields".into(), json!(r));
    }
    if let Some(src) = &d.source_message_id {
        o.insert("sourceMessageId".into(), json!(src.as_ref()));
    }
    o
}
