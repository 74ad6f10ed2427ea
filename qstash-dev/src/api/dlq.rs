//! The DLQ API: list, get, delete and retry dead-lettered messages (`/v2/dlq`).

use axum::extract::{Path, Request, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use super::messages::{Filters, MessageFilter};
use super::request::{S, read_body};
use super::response::{json_response, ok_json};
use crate::core::{DlqEntry, parse_dlq_id};
use crate::error::ApiError;
use crate::options::{OptionsBuilder, PublishOptions};
use crate::view::{body_fields, message_json};

fn dlq_json(e: &DlqEntry) -> Value {
    let mut o = message_json(&e.data);
    o.insert("dlqId".into(), json!(e.dlq_id));
    o.insert("responseStatus".into(), json!(e.status.unwrap_or(0)));
    o.insert(
        "responseHeader".into(),
        crate::core::headermap_multimap(&e.resp_headers),
    );
    body_fields(&mut o, "responseBody", "responseBodyBase64", &e.resp_body);
    o.insert("retried".into(), json!(e.retried));
    if let Some(err) = &e.error {
        o.insert("error".into(), json!(err));
    }
    Value::Object(o)
}

struct DlqQuery {
    filter: MessageFilter,
    dlq_ids: Vec<(u64, u64)>,
    statuses: Vec<u16>,
    count: usize,
    cursor: Option<(u64, u64)>,
    latest_first: bool,
}

impl DlqQuery {
    fn new(f: &Filters, default_latest_first: bool) -> Result<DlqQuery, ApiError> {
        let mut dlq_ids = Vec::new();
        for id in f.all("dlqIds").into_iter().chain(f.all("dlqId")) {
            // Unknown ids simply match nothing.
            dlq_ids.push(parse_dlq_id(id).unwrap_or((u64::MAX, u64::MAX)));
        }
        let mut statuses = Vec::new();
        for v in f.all("responseStatus") {
            statuses
                .push(v.parse().map_err(|_| {
                    ApiError::bad_request(format!("invalid responseStatus: {v:?}"))
                })?);
        }
        let count = f.num("count")?.unwrap_or(100).clamp(1, 100) as usize;
        let cursor = match f.one("cursor") {
            None => None,
            Some(c) => Some(
                parse_dlq_id(c)
                    .ok_or_else(|| ApiError::bad_request(format!("invalid cursor: {c:?}")))?,
            ),
        };
        let latest_first = match f.one("order") {
            None => default_latest_first,
            Some("latestFirst") => true,
            Some("earliestFirst") => false,
            Some(o) => return Err(ApiError::bad_request(format!("invalid order: {o:?}"))),
        };
        Ok(DlqQuery {
            filter: MessageFilter::new(f)?,
            dlq_ids,
            statuses,
            count,
            cursor,
            latest_first,
        })
    }

    fn matches(&self, key: (u64, u64), e: &DlqEntry) -> bool {
        if !self.dlq_ids.is_empty() {
            return self.dlq_ids.contains(&key);
        }
        (self.statuses.is_empty() || e.status.is_some_and(|s| self.statuses.contains(&s)))
            && self.filter.matches(&e.data, e.created_ms)
    }

    /// Matching keys from the cursor on (at most `count`), and the cursor of the next page.
    fn select(
        &self,
        dlq: &std::collections::BTreeMap<(u64, u64), DlqEntry>,
    ) -> (Vec<(u64, u64)>, Option<String>) {
        let iter: Box<dyn Iterator<Item = (&(u64, u64), &DlqEntry)>> =
            match (self.latest_first, self.cursor) {
                (true, Some(c)) => Box::new(dlq.range(..=c).rev()),
                (true, None) => Box::new(dlq.iter().rev()),
                (false, Some(c)) => Box::new(dlq.range(c..)),
                (false, None) => Box::new(dlq.iter()),
            };
        let mut keys = Vec::new();
        let mut next = None;
        for (k, e) in iter {
            if !self.matches(*k, e) {
                continue;
            }
            if keys.len() == self.count {
                next = Some(format!("{}-{}", k.0, k.1));
                break;
            }
            keys.push(*k);
        }
        (keys, next)
    }
}

pub(super) async fn list_dlq(State(s): S, req: Request) -> Response {
    let filters = match Filters::from_request(req.uri().query(), &[]) {
        Ok(f) => f,
        Err(e) => return e.into_response(),
    };
    let mut q = match DlqQuery::new(&filters, true) {
        Ok(q) => q,
        Err(e) => return e.into_response(),
    };
    if s.faults().dlq_message_filter_ignored {
        q.filter.ignore_message_ids();
    }
    let mut core = s.core();
    core.purge_dlq();
    let (keys, cursor) = q.select(&core.dlq);
    let messages: Vec<Value> = keys
        .iter()
        .filter_map(|k| core.dlq.get(k))
        .map(dlq_json)
        .collect();
    let mut o = json!({"messages": messages});
    if let Some(c) = cursor {
        o["cursor"] = json!(c);
    }
    ok_json(o)
}

pub(super) async fn get_dlq(State(s): S, Path(id): Path<String>) -> Response {
    let mut core = s.core();
    core.purge_dlq();
    match parse_dlq_id(&id).and_then(|k| core.dlq.get(&k)) {
        Some(e) => ok_json(dlq_json(e)),
        None => ApiError::not_found(format!("dlq message {id} not found")).into_response(),
    }
}

pub(super) async fn delete_dlq_one(State(s): S, Path(id): Path<String>) -> Response {
    let mut core = s.core();
    core.purge_dlq();
    match parse_dlq_id(&id).and_then(|k| core.dlq.remove(&k)) {
        Some(_) => ok_json(json!({"deleted": 1})),
        None => ApiError::not_found(format!("dlq message {id} not found")).into_response(),
    }
}

pub(super) async fn delete_dlq_bulk(State(s): S, req: Request) -> Response {
    let (parts, body) = req.into_parts();
    let body = match read_body(&s, body).await {
        Ok(b) => b,
        Err(e) => return e.into_response(),
    };
    let q = match Filters::from_request(parts.uri.query(), &body)
        .and_then(|f| DlqQuery::new(&f, false))
    {
        Ok(q) => q,
        Err(e) => return e.into_response(),
    };
    let mut core = s.core();
    core.purge_dlq();
    let (keys, cursor) = q.select(&core.dlq);
    let n = keys.iter().filter(|k| core.dlq.remove(k).is_some()).count();
    let mut o = json!({"deleted": n});
    if let Some(c) = cursor {
        o["cursor"] = json!(c);
    }
    ok_json(o)
}

fn retry_options(headers: &HeaderMap) -> Result<PublishOptions, ApiError> {
    let mut b = OptionsBuilder::default();
    for (k, v) in headers {
        let name = k.as_str();
        // Only config headers override; Content-Type and forwarded headers of the retry request are ignored.
        if name.starts_with("upstash-") && !name.starts_with("upstash-forward-") {
            b.add(name, v.as_bytes())?;
        }
    }
    b.build()
}

pub(super) async fn retry_dlq_one(
    State(s): S,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Response {
    let opts = match retry_options(&headers) {
        Ok(o) => o,
        Err(e) => return e.into_response(),
    };
    let Some(key) = parse_dlq_id(&id) else {
        return ApiError::not_found(format!("dlq message {id} not found")).into_response();
    };
    match s.with_core(|core, fx| {
        core.purge_dlq();
        core.retry_dlq(key, &opts, fx)
    }) {
        Some(mid) => json_response(StatusCode::CREATED, &json!({"messageId": mid.as_ref()})),
        None => ApiError::not_found(format!("dlq message {id} not found")).into_response(),
    }
}

pub(super) async fn retry_dlq_bulk(State(s): S, req: Request) -> Response {
    let (parts, body) = req.into_parts();
    let body = match read_body(&s, body).await {
        Ok(b) => b,
        Err(e) => return e.into_response(),
    };
    let opts = match retry_options(&parts.headers) {
        Ok(o) => o,
        Err(e) => return e.into_response(),
    };
    let q = match Filters::from_request(parts.uri.query(), &body)
        .and_then(|f| DlqQuery::new(&f, false))
    {
        Ok(q) => q,
        Err(e) => return e.into_response(),
    };
    let (ids, cursor) = s.with_core(|core, fx| {
        core.purge_dlq();
        let (keys, cursor) = q.select(&core.dlq);
        let ids: Vec<Value> = keys
            .into_iter()
            .filter_map(|k| core.retry_dlq(k, &opts, fx))
            .map(|id| json!({"messageId": id.as_ref()}))
            .collect();
        (ids, cursor)
    });
    let mut o = json!({"responses": ids});
    if let Some(c) = cursor {
        o["cursor"] = json!(c);
    }
    json_response(StatusCode::CREATED, &o)
}
