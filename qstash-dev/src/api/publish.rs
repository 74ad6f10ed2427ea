//! Publishing: `/v2/publish`, `/v2/enqueue` and `/v2/batch`, with the publish-side fault injection.

use std::borrow::Cow;
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use serde::Deserialize;
use serde::de::{MapAccess, Visitor};
use serde_json::{Value, json};

use super::request::{S, read_body};
use super::response::json_response;
use crate::core::{Accepted, Counters, Effects, NewMessage, message_identity};
use crate::draw::Fingerprint;
use crate::error::ApiError;
use crate::options::{OptionsBuilder, PublishOptions, check_url, split_query};
use crate::state::{ConnCtx, PublishDraw, Shared};

fn caller_ip(ctx: Option<&ConnCtx>) -> Arc<str> {
    Arc::from(ctx.map(|c| c.peer.ip().to_string()).unwrap_or_default())
}

/// Draws a publish-type request's faults on `key`, what it publishes ([`request_key`], [`batch_key`]), which is
/// why the body is read and validated first. `Err` is the injected 5xx: nothing is stored.
fn publish_prelude(s: &Shared, key: u64) -> Result<PublishDraw, ApiError> {
    let draw = s.draw_publish(key);
    if draw.fail_5xx {
        Counters::inc(&s.counters.injected_publish_errors);
        return Err(ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "injected fault: internal server error (nothing was stored)",
        ));
    }
    Ok(draw)
}

/// The fault key of a single publish / enqueue (decision record 0114): the message's identity (its
/// deduplication id, else its content), or, when the request is invalid, its target and body.
fn request_key(target: &str, body: &[u8], item: &Result<NewMessage, ApiError>) -> u64 {
    match item {
        Ok(m) => m.identity,
        Err(_) => raw_key(target, body),
    }
}

/// The fault key of a request that does not say what it publishes: its target and body.
fn raw_key(target: &str, body: &[u8]) -> u64 {
    Fingerprint::new(b"request")
        .bytes(target.as_bytes())
        .bytes(body)
        .finish()
}

/// The fault key of a batch: its items' identities in order (an invalid item counts by its error).
fn batch_key(items: &[Result<NewMessage, ApiError>]) -> u64 {
    items
        .iter()
        .fold(Fingerprint::new(b"batch"), |f, item| match item {
            Ok(m) => f.u64(m.identity),
            Err(e) => f.bytes(e.message.as_bytes()),
        })
        .finish()
}

/// Applies the response delay and the drop-response fault.
async fn publish_epilogue(
    s: &Shared,
    pf: &PublishDraw,
    ctx: Option<ConnCtx>,
    resp: Response,
) -> Response {
    let delay = s.faults().publish_response_delay;
    if !delay.is_zero() {
        tokio::time::sleep(delay).await;
    }
    if pf.drop_response
        && let Some(ctx) = ctx
    {
        Counters::inc(&s.counters.injected_dropped_responses);
        tracing::debug!(peer = %ctx.peer, "injected fault: dropping publish response");
        ctx.kill.notify_one();
        // The connection task drops this future together with the connection.
        std::future::pending::<()>().await;
    }
    resp
}

fn accepted_json(a: &Accepted) -> Value {
    if a.deduplicated {
        json!({"messageId": a.message_id.as_ref(), "deduplicated": true})
    } else {
        json!({"messageId": a.message_id.as_ref()})
    }
}

fn accepted_response(a: &Accepted) -> Response {
    let status = if a.deduplicated {
        StatusCode::ACCEPTED
    } else {
        StatusCode::OK
    };
    json_response(status, &accepted_json(a))
}

/// Percent-decodes a destination only when the whole URL was encoded (`https%3A%2F%2F...`).
fn normalize_destination(raw: &str) -> Cow<'_, str> {
    let has = |p: &str| {
        raw.len() >= p.len() && raw.as_bytes()[..p.len()].eq_ignore_ascii_case(p.as_bytes())
    };
    if has("http%3a") || has("https%3a") {
        Cow::Owned(
            url::form_urlencoded::parse(format!("x={raw}").as_bytes())
                .next()
                .map(|(_, v)| v.into_owned())
                .unwrap_or_else(|| raw.to_string()),
        )
    } else {
        Cow::Borrowed(raw)
    }
}

pub(super) fn valid_queue_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 256
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.')
}

/// Builds a message from path remainder, query, headers and body.
fn build_from_request(
    dest_raw: &str,
    query: Option<&str>,
    headers: &HeaderMap,
    body: Bytes,
    queue: Option<String>,
    caller_ip: Arc<str>,
) -> Result<NewMessage, ApiError> {
    let mut b = OptionsBuilder::default();
    for (k, v) in headers {
        b.add(k.as_str(), v.as_bytes())?;
    }
    let (config, keep) = split_query(query.unwrap_or(""));
    for (k, v) in &config {
        b.add(k, v)?;
    }
    let opts = b.build()?;
    let mut url = normalize_destination(dest_raw).into_owned();
    if !keep.is_empty() {
        url.push(if url.contains('?') { '&' } else { '?' });
        url.push_str(&keep.join("&"));
    }
    finish_message(url, body, opts, queue, caller_ip)
}

/// Validates the destination (`check_url` remembers recent valid URLs, so a batch repeating one destination
/// parses it once) and the queue, and assembles the message.
fn finish_message(
    url: String,
    body: Bytes,
    opts: PublishOptions,
    queue: Option<String>,
    caller_ip: Arc<str>,
) -> Result<NewMessage, ApiError> {
    check_url(&|| "destination".into(), &url)?;
    if let Some(q) = &queue {
        if !valid_queue_name(q) {
            return Err(ApiError::bad_request(
                "invalid queue name: only alphanumerics, '-', '_' and '.' are allowed",
            ));
        }
        if opts.delay.is_some() || opts.not_before.is_some() {
            return Err(ApiError::bad_request(
                "Upstash-Delay and Upstash-Not-Before are not supported when enqueueing",
            ));
        }
    }
    let identity = message_identity(&url, &body, &opts);
    Ok(NewMessage {
        url,
        body,
        opts,
        queue,
        caller_ip,
        identity,
    })
}

fn publish_one(s: &Shared, item: Result<NewMessage, ApiError>) -> Response {
    match item {
        Err(e) => {
            Counters::inc(&s.counters.rejected);
            e.into_response()
        }
        Ok(item) => {
            let url = item.url.clone();
            let a = s.with_core(|core, fx| core.publish(item, fx));
            tracing::debug!(message_id = %a.message_id, %url, deduplicated = a.deduplicated, "published");
            accepted_response(&a)
        }
    }
}

/// Adds a publish-type request's body to the bytes received.
fn count_bytes(s: &Shared, body: &Result<Bytes, ApiError>) {
    if let Ok(b) = body {
        Counters::add(&s.counters.publish_bytes, b.len() as u64);
    }
}

/// The target of a publish-type request as the client wrote it (path and query).
fn target(parts: &http::request::Parts) -> &str {
    parts.uri.path_and_query().map(|p| p.as_str()).unwrap_or("")
}

pub(super) async fn publish(State(s): S, req: Request) -> Response {
    let (parts, body) = req.into_parts();
    let ctx = parts.extensions.get::<ConnCtx>().cloned();
    Counters::inc(&s.counters.publish_requests);
    let body = read_body(&s, body).await;
    count_bytes(&s, &body);
    let item = body.as_ref().map_err(Clone::clone).and_then(|body| {
        let dest = parts.uri.path().strip_prefix("/v2/publish/").unwrap_or("");
        build_from_request(
            dest,
            parts.uri.query(),
            &parts.headers,
            body.clone(),
            None,
            caller_ip(ctx.as_ref()),
        )
    });
    let raw = body.as_deref().unwrap_or_default();
    let pf = match publish_prelude(&s, request_key(target(&parts), raw, &item)) {
        Ok(pf) => pf,
        Err(e) => return e.into_response(),
    };
    let resp = match body {
        Err(e) => e.into_response(),
        Ok(_) => publish_one(&s, item),
    };
    publish_epilogue(&s, &pf, ctx, resp).await
}

pub(super) async fn enqueue(State(s): S, req: Request) -> Response {
    let (parts, body) = req.into_parts();
    let ctx = parts.extensions.get::<ConnCtx>().cloned();
    Counters::inc(&s.counters.publish_requests);
    let body = read_body(&s, body).await;
    count_bytes(&s, &body);
    let item = body.as_ref().map_err(Clone::clone).and_then(|body| {
        let rest = parts.uri.path().strip_prefix("/v2/enqueue/").unwrap_or("");
        let (queue, dest) = rest.split_once('/').unwrap_or((rest, ""));
        let queue = url::form_urlencoded::parse(format!("q={queue}").as_bytes())
            .next()
            .map(|(_, v)| v.into_owned())
            .unwrap_or_default();
        build_from_request(
            dest,
            parts.uri.query(),
            &parts.headers,
            body.clone(),
            Some(queue),
            caller_ip(ctx.as_ref()),
        )
    });
    let raw = body.as_deref().unwrap_or_default();
    let pf = match publish_prelude(&s, request_key(target(&parts), raw, &item)) {
        Ok(pf) => pf,
        Err(e) => return e.into_response(),
    };
    let resp = match body {
        Err(e) => e.into_response(),
        Ok(_) => publish_one(&s, item),
    };
    publish_epilogue(&s, &pf, ctx, resp).await
}

/// A batch item's `headers` object as (name, value) pairs; `null` values are skipped.
#[derive(Default)]
struct HeaderList<'a>(Vec<(Cow<'a, str>, Cow<'a, str>)>);

impl<'de: 'a, 'a> Deserialize<'de> for HeaderList<'a> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<'a>(std::marker::PhantomData<&'a ()>);
        impl<'de: 'a, 'a> Visitor<'de> for V<'a> {
            type Value = HeaderList<'a>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("an object of header names to string values")
            }
            fn visit_unit<E>(self) -> Result<Self::Value, E> {
                Ok(HeaderList::default())
            }
            fn visit_map<M: MapAccess<'de>>(self, mut m: M) -> Result<Self::Value, M::Error> {
                let mut out = Vec::with_capacity(m.size_hint().unwrap_or(8));
                while let Some(k) = m.next_key::<Cow<'a, str>>()? {
                    let v: Option<StrOrNum<'a>> = m.next_value()?;
                    if let Some(v) = v {
                        out.push((k, v.0));
                    }
                }
                Ok(HeaderList(out))
            }
        }
        d.deserialize_any(V(std::marker::PhantomData))
    }
}

/// A header value: a string, or a number/bool written without quotes.
struct StrOrNum<'a>(Cow<'a, str>);

impl<'de: 'a, 'a> Deserialize<'de> for StrOrNum<'a> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<'a>(std::marker::PhantomData<&'a ()>);
        impl<'de: 'a, 'a> Visitor<'de> for V<'a> {
            type Value = StrOrNum<'a>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a string")
            }
            fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Self::Value, E> {
                Ok(StrOrNum(Cow::Borrowed(v)))
            }
            fn visit_str<E>(self, v: &str) -> Result<Self::Value, E> {
                Ok(StrOrNum(Cow::Owned(v.to_string())))
            }
            fn visit_string<E>(self, v: String) -> Result<Self::Value, E> {
                Ok(StrOrNum(Cow::Owned(v)))
            }
            fn visit_i64<E>(self, v: i64) -> Result<Self::Value, E> {
                Ok(StrOrNum(Cow::Owned(v.to_string())))
            }
            fn visit_u64<E>(self, v: u64) -> Result<Self::Value, E> {
                Ok(StrOrNum(Cow::Owned(v.to_string())))
            }
            fn visit_f64<E>(self, v: f64) -> Result<Self::Value, E> {
                Ok(StrOrNum(Cow::Owned(v.to_string())))
            }
            fn visit_bool<E>(self, v: bool) -> Result<Self::Value, E> {
                Ok(StrOrNum(Cow::Owned(v.to_string())))
            }
        }
        d.deserialize_any(V(std::marker::PhantomData))
    }
}

#[derive(Deserialize)]
struct BatchItem<'a> {
    #[serde(borrow, default)]
    destination: Option<StrOrNum<'a>>,
    #[serde(borrow, default)]
    headers: HeaderList<'a>,
    #[serde(borrow, default)]
    body: Option<StrOrNum<'a>>,
    #[serde(borrow, default)]
    queue: Option<StrOrNum<'a>>,
}

fn item_error_json(e: &ApiError) -> Value {
    json!({"error": e.message, "status": e.status.as_u16()})
}

fn build_batch_item(item: BatchItem<'_>, caller_ip: &Arc<str>) -> Result<NewMessage, ApiError> {
    let Some(dest) = item.destination.map(|d| d.0).filter(|d| !d.is_empty()) else {
        return Err(ApiError::bad_request("destination is required"));
    };
    let mut b = OptionsBuilder::default();
    for (k, v) in &item.headers.0 {
        b.add(k, v.as_bytes())?;
    }
    let opts = b.build()?;
    let body = match item.body {
        Some(StrOrNum(Cow::Owned(s))) => Bytes::from(s),
        Some(StrOrNum(Cow::Borrowed(s))) => Bytes::copy_from_slice(s.as_bytes()),
        None => Bytes::new(),
    };
    let queue = item
        .queue
        .map(|q| q.0.into_owned())
        .filter(|q| !q.is_empty());
    finish_message(
        normalize_destination(&dest).into_owned(),
        body,
        opts,
        queue,
        caller_ip.clone(),
    )
}

pub(super) async fn batch(State(s): S, req: Request) -> Response {
    let (parts, body) = req.into_parts();
    let ctx = parts.extensions.get::<ConnCtx>().cloned();
    Counters::inc(&s.counters.publish_requests);
    let body = read_body(&s, body).await;
    count_bytes(&s, &body);
    let built = body
        .as_ref()
        .map_err(Clone::clone)
        .and_then(|body| parse_batch(body, &caller_ip(ctx.as_ref())));
    let key = match &built {
        Ok(items) => batch_key(items),
        Err(_) => raw_key(target(&parts), body.as_deref().unwrap_or_default()),
    };
    let pf = match publish_prelude(&s, key) {
        Ok(pf) => pf,
        Err(e) => return e.into_response(),
    };
    let resp = match (body, built) {
        (Err(e), _) => e.into_response(),
        (Ok(_), Err(e)) => {
            Counters::inc(&s.counters.rejected);
            e.into_response()
        }
        (Ok(_), Ok(built)) => publish_batch(&s, built),
    };
    publish_epilogue(&s, &pf, ctx, resp).await
}

/// Parses and validates a batch body: `Err` when it is not a JSON array of messages, else one result per item.
fn parse_batch(
    body: &[u8],
    caller_ip: &Arc<str>,
) -> Result<Vec<Result<NewMessage, ApiError>>, ApiError> {
    let items: Vec<BatchItem<'_>> = serde_json::from_slice(body).map_err(|e| {
        ApiError::bad_request(format!(
            "invalid batch body: expected a JSON array of messages: {e}"
        ))
    })?;
    Ok(items
        .into_iter()
        .map(|i| build_batch_item(i, caller_ip))
        .collect())
}

fn publish_batch(s: &Shared, built: Vec<Result<NewMessage, ApiError>>) -> Response {
    let mut out = Vec::with_capacity(built.len());
    let mut fx = Effects::default();
    {
        let mut core = s.core();
        for item in built {
            match item {
                Ok(m) => out.push(Ok(core.publish(m, &mut fx))),
                Err(e) => out.push(Err(e)),
            }
        }
    }
    s.apply(fx);
    let mut body = String::with_capacity(out.len() * 44 + 2);
    body.push('[');
    for (i, r) in out.iter().enumerate() {
        if i > 0 {
            body.push(',');
        }
        match r {
            Ok(a) if !a.deduplicated => {
                body.push_str(r#"{"messageId":""#);
                body.push_str(&a.message_id);
                body.push_str(r#""}"#);
            }
            Ok(a) => body.push_str(&accepted_json(a).to_string()),
            Err(e) => {
                Counters::inc(&s.counters.rejected);
                body.push_str(&item_error_json(e).to_string());
            }
        }
    }
    body.push(']');
    tracing::debug!(items = out.len(), "batch published");
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, "application/json")],
        body,
    )
        .into_response()
}
