//! Reading a callback body: [`parse_callback`] (leniently, as the parent module describes: a field QStash sent in
//! another shape is read anyway, or listed as a problem, never fatal) and [`source_event`], what the signed body
//! says about the original message's event.

use std::collections::BTreeMap;

use base64::Engine;
use base64::engine::{DecodePaddingMode, GeneralPurpose, GeneralPurposeConfig};
use serde_json::{Map, Value};

use crate::contract;
use crate::ids::{OutboxId, PartitionKey, TopicName};

const B64_STD: GeneralPurpose = GeneralPurpose::new(
    &base64::alphabet::STANDARD,
    GeneralPurposeConfig::new().with_decode_padding_mode(DecodePaddingMode::Indifferent),
);
const B64_URL: GeneralPurpose = GeneralPurpose::new(
    &base64::alphabet::URL_SAFE,
    GeneralPurposeConfig::new().with_decode_padding_mode(DecodePaddingMode::Indifferent),
);

/// A QStash callback body, as far as it could be read.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CallbackBody {
    /// The destination's HTTP status.
    pub status: Option<i32>,
    /// The destination's response headers (normalised to `{name: [values]}`).
    pub header: Option<Value>,
    /// The destination's response body (decoded from base64).
    pub body: Option<Vec<u8>>,
    /// How many times the message was retried (0 = first attempt).
    pub retried: Option<i32>,
    /// The retry budget.
    pub max_retries: Option<i32>,
    /// The DLQ id (failure callbacks only).
    pub dlq_id: Option<String>,
    /// QStash's id of the original message.
    pub source_message_id: Option<String>,
    /// URL group name, if any.
    pub topic_name: Option<String>,
    /// URL group endpoint name, if any.
    pub endpoint_name: Option<String>,
    /// The destination URL.
    pub url: Option<String>,
    /// The HTTP method used.
    pub method: Option<String>,
    /// The original message's headers (normalised to `{name: [values]}`).
    pub source_header: Option<Value>,
    /// The original message body (decoded from base64).
    pub source_body: Option<Vec<u8>>,
    /// Unix ms.
    pub not_before: Option<i64>,
    /// Unix ms.
    pub created_at: Option<i64>,
    /// Schedule id, if any.
    pub schedule_id: Option<String>,
    /// The publisher's IP.
    pub caller_ip: Option<String>,
}

/// A parsed callback and the field-level problems met on the way (wrong type, bad base64); a field with a
/// problem is left `None`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ParsedCallback {
    /// What could be read.
    pub body: CallbackBody,
    /// What could not.
    pub problems: Vec<String>,
}

fn get_int(m: &Map<String, Value>, name: &str, problems: &mut Vec<String>) -> Option<i64> {
    match m.get(name) {
        None | Some(Value::Null) => None,
        Some(Value::Number(n)) => n
            .as_i64()
            .or_else(|| {
                n.as_f64()
                    .filter(|f| f.is_finite() && f.fract() == 0.0)
                    .map(|f| f as i64)
            })
            .or_else(|| {
                problems.push(format!("{name}: {n} is not an integer"));
                None
            }),
        Some(Value::String(s)) => s.trim().parse().ok().or_else(|| {
            problems.push(format!(
                "{name}: {:?} is not an integer",
                s.chars().take(40).collect::<String>()
            ));
            None
        }),
        Some(other) => {
            problems.push(format!(
                "{name}: expected a number, got {}",
                type_name(other)
            ));
            None
        }
    }
}

fn get_i32(m: &Map<String, Value>, name: &str, problems: &mut Vec<String>) -> Option<i32> {
    let v = get_int(m, name, problems)?;
    i32::try_from(v).ok().or_else(|| {
        problems.push(format!("{name}: {v} is out of range"));
        None
    })
}

fn get_str(m: &Map<String, Value>, name: &str, problems: &mut Vec<String>) -> Option<String> {
    match m.get(name) {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(Value::Number(n)) => Some(n.to_string()),
        Some(other) => {
            problems.push(format!(
                "{name}: expected a string, got {}",
                type_name(other)
            ));
            None
        }
    }
}

fn get_base64(m: &Map<String, Value>, name: &str, problems: &mut Vec<String>) -> Option<Vec<u8>> {
    let s = get_str(m, name, problems)?;
    let s = s.trim();
    B64_STD
        .decode(s)
        .or_else(|_| B64_URL.decode(s))
        .map_err(|e| problems.push(format!("{name}: not base64 ({e})")))
        .ok()
}

/// `{name: [values]}` from a map of string arrays or strings.
fn get_headers(m: &Map<String, Value>, name: &str, problems: &mut Vec<String>) -> Option<Value> {
    match m.get(name) {
        None | Some(Value::Null) => None,
        Some(Value::Object(h)) => {
            let mut out = Map::new();
            for (k, v) in h {
                let values: Vec<Value> = match v {
                    Value::Array(items) => items
                        .iter()
                        .map(|i| match i {
                            Value::String(s) => Value::String(s.clone()),
                            other => Value::String(other.to_string()),
                        })
                        .collect(),
                    Value::String(s) => vec![Value::String(s.clone())],
                    Value::Null => Vec::new(),
                    other => vec![Value::String(other.to_string())],
                };
                out.insert(k.clone(), Value::Array(values));
            }
            Some(Value::Object(out))
        }
        Some(other) => {
            problems.push(format!(
                "{name}: expected an object, got {}",
                type_name(other)
            ));
            None
        }
    }
}

fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// Parses a callback body. `Err` when it is not a JSON object at all; field-level problems are listed in
/// [`ParsedCallback::problems`].
pub fn parse_callback(raw: &[u8]) -> Result<ParsedCallback, String> {
    let value: Value =
        serde_json::from_slice(raw).map_err(|e| format!("callback body is not JSON: {e}"))?;
    let Value::Object(m) = value else {
        return Err(format!(
            "callback body is {}, not a JSON object",
            type_name(&value)
        ));
    };
    let mut p = Vec::new();
    let body = CallbackBody {
        status: get_i32(&m, "status", &mut p),
        header: get_headers(&m, "header", &mut p),
        body: get_base64(&m, "body", &mut p),
        retried: get_i32(&m, "retried", &mut p),
        max_retries: get_i32(&m, "maxRetries", &mut p),
        dlq_id: get_str(&m, "dlqId", &mut p).filter(|s| !s.is_empty()),
        source_message_id: get_str(&m, "sourceMessageId", &mut p),
        topic_name: get_str(&m, "topicName", &mut p),
        endpoint_name: get_str(&m, "endpointName", &mut p),
        url: get_str(&m, "url", &mut p),
        method: get_str(&m, "method", &mut p),
        source_header: get_headers(&m, "sourceHeader", &mut p),
        source_body: get_base64(&m, "sourceBody", &mut p),
        not_before: get_int(&m, "notBefore", &mut p),
        created_at: get_int(&m, "createdAt", &mut p),
        schedule_id: get_str(&m, "scheduleId", &mut p),
        caller_ip: get_str(&m, "callerIP", &mut p).or_else(|| get_str(&m, "callerIp", &mut p)),
    };
    Ok(ParsedCallback { body, problems: p })
}

/// A header of the original message (`sourceHeader`), by name or with QStash's `Upstash-Forward-` prefix, any
/// case; the first value.
pub fn source_header<'b>(b: &'b CallbackBody, name: &str) -> Option<&'b str> {
    let headers = b.source_header.as_ref()?.as_object()?;
    let forwarded = format!("upstash-forward-{name}");
    headers.iter().find_map(|(k, v)| {
        if k.eq_ignore_ascii_case(name) || k.eq_ignore_ascii_case(&forwarded) {
            v.as_array()?.iter().find_map(Value::as_str)
        } else {
            None
        }
    })
}

/// What a callback's signed body says about the original message's event: from the envelope (a current
/// delivery: its URL names [`contract::CONTRACT_VERSION`] and its `sourceBody` is the envelope), else from the
/// headers its publisher set (`sourceHeader`: `x-outbox-id`, `x-outbox-topic`, `x-outbox-key`, as relays before
/// the signed contract sent them), else the topic from the URL's path. Never from a header of the callback
/// request itself: those are not signed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SourceEvent {
    pub outbox_id: Option<OutboxId>,
    pub topic: Option<TopicName>,
    pub partition_key: Option<PartitionKey>,
    /// The per-key sequence (an ordered event of a current envelope).
    pub seq: Option<i64>,
    /// The named subscriber the message was for (a current envelope's `subscriber`).
    pub subscriber: Option<String>,
    /// The event the copy is of (a current envelope's `event`, when it differs from the copy's id).
    pub event_id: Option<OutboxId>,
    /// The event's payload (for the dead letter): the envelope's payload, or the whole body of a legacy message.
    pub payload: Option<Vec<u8>>,
    /// The envelope's event headers and its schema version (as `x-schema-version`), for a redrive that must
    /// re-create a pruned event.
    pub headers: BTreeMap<String, String>,
}

/// Reads [`SourceEvent`] from a parsed callback body: the message's one event. A batch (several events, decision
/// record 0027) names no single event: then only the topic of its URL ([`source_events`] reads them all).
pub fn source_event(b: &CallbackBody) -> SourceEvent {
    let mut events = source_events(b);
    if events.len() == 1 {
        return events.pop().unwrap_or_default();
    }
    SourceEvent {
        topic: b.url.as_deref().and_then(topic_of_url),
        ..SourceEvent::default()
    }
}

/// Every event of the original message, in envelope order: one [`SourceEvent`] per event of a current envelope
/// (a batch holds several), else the one event [`source_event`] describes from the publisher's headers.
pub fn source_events(b: &CallbackBody) -> Vec<SourceEvent> {
    let parse_id = |s: &str| {
        s.trim()
            .parse::<i64>()
            .ok()
            .filter(|id| *id > 0)
            .map(OutboxId)
    };
    let url_query = b
        .url
        .as_deref()
        .and_then(|u| u.split('#').next())
        .and_then(|u| u.split_once('?'))
        .map(|(_, q)| q);
    let current = b.url.is_some()
        && contract::contract_of_query(url_query) == Ok(contract::Contract::Current);
    if current
        && let Some(env) = b
            .source_body
            .as_deref()
            .and_then(|body| contract::parse_envelope(body).ok())
    {
        return env
            .events
            .iter()
            .map(|ev| {
                let mut headers = ev.headers.clone();
                if let Some(v) = ev.schema_version {
                    headers.insert(contract::legacy::SCHEMA_VERSION.to_owned(), v.to_string());
                }
                SourceEvent {
                    outbox_id: Some(ev.id),
                    topic: Some(env.topic.clone()),
                    partition_key: Some(ev.key.clone()),
                    seq: ev.seq,
                    subscriber: env.subscriber.clone(),
                    event_id: ev.event,
                    payload: Some(ev.payload.get().as_bytes().to_vec()),
                    headers,
                }
            })
            .collect();
    }
    vec![SourceEvent {
        outbox_id: source_header(b, contract::legacy::OUTBOX_ID).and_then(parse_id),
        topic: source_header(b, contract::legacy::OUTBOX_TOPIC)
            .map(TopicName::from)
            .or_else(|| topic_of_url(b.url.as_deref()?)),
        partition_key: source_header(b, contract::legacy::OUTBOX_KEY)
            .and_then(contract::decode_key)
            .map(PartitionKey::from),
        seq: None,
        subscriber: None,
        event_id: None,
        payload: (!current).then(|| b.source_body.clone()).flatten(),
        headers: BTreeMap::new(),
    }]
}

/// What the consumer's last response (the callback's `body`) says about each event: `(outbox id, outcome,
/// error)` from its `events` list (decision record 0027). `None` when the body has no readable list (an older
/// consumer, a timeout, a proxy's error page).
pub fn consumer_verdicts(b: &CallbackBody) -> Option<Vec<(OutboxId, String, Option<String>)>> {
    let body: Value = serde_json::from_slice(b.body.as_deref()?).ok()?;
    let list = body.get("events")?.as_array()?;
    let verdicts: Vec<_> = list
        .iter()
        .filter_map(|e| {
            Some((
                OutboxId(e.get("id")?.as_i64()?),
                e.get("outcome")?.as_str()?.to_owned(),
                e.get("error").and_then(Value::as_str).map(str::to_owned),
            ))
        })
        .collect();
    (!verdicts.is_empty()).then_some(verdicts)
}

/// The last segment of a `/events/{topic}` URL.
fn topic_of_url(url: &str) -> Option<TopicName> {
    let path = url.split(['?', '#']).next()?;
    let (_, topic) = path.rsplit_once(contract::EVENTS_PATH)?;
    crate::producer::validate_topic(topic).ok()?;
    Some(TopicName::from(topic))
}

/// The body as text (invalid UTF-8 replaced), cut after `max_chars` characters with a marker.
pub(super) fn lossy_truncated(bytes: &[u8], max_chars: usize) -> String {
    let text = String::from_utf8_lossy(bytes);
    if text.chars().count() <= max_chars {
        text.into_owned()
    } else {
        let mut s: String = text.chars().take(max_chars).collect();
        s.push_str("…(truncated)");
        s
    }
}
