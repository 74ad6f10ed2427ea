//! The QStash HTTP API (`/v2/...`).

use std::borrow::Cow;
use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::{Path, Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::middleware::{Next, from_fn_with_state};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use bytes::Bytes;
use serde::Deserialize;
use serde::de::{MapAccess, Visitor};
use serde_json::{Map, Value, json};

use crate::core::{
    Accepted, Counters, DlqEntry, Effects, MsgData, NewMessage, header_multimap, now_ms,
    parse_dlq_id,
};
use crate::error::ApiError;
use crate::options::{OptionsBuilder, PublishOptions, check_url, split_query};
use crate::server::{ConnCtx, Shared};

type S = State<Arc<Shared>>;

pub(crate) fn router(shared: Arc<Shared>) -> Router {
    let v2 = Router::new()
        .route("/v2/publish/{*destination}", post(publish))
        .route("/v2/enqueue/{queue}/{*destination}", post(enqueue))
        .route("/v2/batch", post(batch))
        .route("/v2/messages", delete(cancel_messages))
        .route("/v2/messages/{id}", get(get_message).delete(cancel_message))
        .route("/v2/dlq", get(list_dlq).delete(delete_dlq_bulk))
        .route("/v2/dlq/retry", post(retry_dlq_bulk))
        .route("/v2/dlq/retry/{id}", post(retry_dlq_one))
        .route("/v2/dlq/{id}", get(get_dlq).delete(delete_dlq_one))
        .route("/v2/queues", post(upsert_queue).get(list_queues))
        .route("/v2/queues/{name}", get(get_queue).delete(delete_queue))
        .route("/v2/queues/{name}/pause", post(pause_queue))
        .route("/v2/queues/{name}/resume", post(resume_queue))
        .route("/v2/flowControl", get(list_flows))
        .route("/v2/flowControl/{key}", get(get_flow))
        .route("/v2/flowControl/{key}/{action}", post(flow_action))
        .route("/v2/globalParallelism", get(global_parallelism))
        .route("/v2/keys", get(get_keys))
        .route("/v2/keys/rotate", post(rotate_keys));
    // The inspection API needs the same token: it can reset the server, inject faults and read the token.
    v2.merge(crate::inspect::router())
        .route_layer(from_fn_with_state(shared.clone(), auth))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        // Outermost, so it also covers unknown paths and runs before the token check.
        .layer(from_fn_with_state(shared.clone(), check_host))
        .with_state(shared)
}

async fn not_found() -> ApiError {
    ApiError::not_found("not found")
}

async fn method_not_allowed() -> ApiError {
    ApiError::new(StatusCode::METHOD_NOT_ALLOWED, "method not allowed")
}

fn json_response(status: StatusCode, v: &Value) -> Response {
    (
        status,
        [(header::CONTENT_TYPE, "application/json")],
        v.to_string(),
    )
        .into_response()
}

fn ok_json(v: Value) -> Response {
    json_response(StatusCode::OK, &v)
}

fn empty_ok() -> Response {
    StatusCode::OK.into_response()
}

fn query_pairs(query: Option<&str>) -> Vec<(String, String)> {
    query
        .map(|q| {
            url::form_urlencoded::parse(q.as_bytes())
                .into_owned()
                .collect()
        })
        .unwrap_or_default()
}

async fn auth(State(s): S, req: Request, next: Next) -> Response {
    let token = &s.cfg.token;
    let bearer_ok = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| {
            v.strip_prefix("Bearer ")
                .or_else(|| v.strip_prefix("bearer "))
        })
        .is_some_and(|t| t.trim() == token);
    let ok = bearer_ok
        || query_pairs(req.uri().query())
            .iter()
            .any(|(k, v)| k == "qstash_token" && v == token);
    if ok {
        next.run(req).await
    } else {
        ApiError::unauthorized().into_response()
    }
}

/// Refuses requests whose `Host` (or absolute request target) does not name this server: a DNS-rebinding page
/// (0113). No `Host` at all (HTTP/1.0) passes.
async fn check_host(State(s): S, req: Request, next: Next) -> Response {
    let local = req
        .extensions()
        .get::<ConnCtx>()
        .map_or(s.bound, |c| c.local);
    let ok = |h: &str| crate::host::allowed(h, s.bound, local);
    let bad = req
        .headers()
        .get_all(header::HOST)
        .iter()
        .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
        .chain(req.uri().authority().map(|a| a.as_str().to_owned()))
        .find(|h| !ok(h));
    // A browser page may also *send* to the right Host (a fire-and-forget cross-site POST to
    // http://127.0.0.1:8080/__dev/reset?qstash_token=<the public dev token>): browsers name the page in `Origin`,
    // SDKs and curl send none. Any Origin that is not this server is refused.
    let bad_origin = req
        .headers()
        .get_all(header::ORIGIN)
        .iter()
        .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
        .find(|o| {
            !o.split_once("://")
                .is_some_and(|(_, authority)| ok(authority.trim_end_matches('/')))
        });
    if let Some(o) = bad_origin {
        return ApiError::new(
            StatusCode::FORBIDDEN,
            format!(
                "Origin {o:?} is a web page that is not this server: qstash-dev refuses cross-site requests from \
                 browsers"
            ),
        )
        .into_response();
    }
    match bad {
        None => next.run(req).await,
        Some(h) => ApiError::new(
            StatusCode::MISDIRECTED_REQUEST,
            format!(
                "Host {h:?} does not name this server: qstash-dev answers only to localhost, 127.0.0.1, [::1] \
                 and the address it listens on ({}), to refuse DNS-rebinding requests from web pages",
                s.bound
            ),
        )
        .into_response(),
    }
}

async fn read_body(s: &Shared, body: Body) -> Result<Bytes, ApiError> {
    axum::body::to_bytes(body, s.cfg.max_request_bytes)
        .await
        .map_err(|_| {
            ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                format!(
                    "request body too large (limit {} bytes)",
                    s.cfg.max_request_bytes
                ),
            )
        })
}

fn caller_ip(ctx: Option<&ConnCtx>) -> Arc<str> {
    Arc::from(ctx.map(|c| c.peer.ip().to_string()).unwrap_or_default())
}

/// Decisions taken for one publish-type request before it is processed.
struct PublishFaults {
    drop_response: bool,
}

fn publish_prelude(s: &Shared) -> Result<PublishFaults, ApiError> {
    Counters::inc(&s.counters.publish_requests);
    if s.draw_fault(|f| f.publish_5xx_rate) {
        Counters::inc(&s.counters.injected_publish_errors);
        return Err(ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "injected fault: internal server error (nothing was stored)",
        ));
    }
    Ok(PublishFaults {
        drop_response: s.draw_fault(|f| f.publish_drop_response_rate),
    })
}

/// Applies the response delay and the drop-response fault.
async fn publish_epilogue(
    s: &Shared,
    pf: &PublishFaults,
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

fn valid_queue_name(name: &str) -> bool {
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
    Ok(NewMessage {
        url,
        body,
        opts,
        queue,
        caller_ip,
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

async fn publish(State(s): S, req: Request) -> Response {
    let (parts, body) = req.into_parts();
    let ctx = parts.extensions.get::<ConnCtx>().cloned();
    let pf = match publish_prelude(&s) {
        Ok(pf) => pf,
        Err(e) => return e.into_response(),
    };
    let resp = match read_body(&s, body).await {
        Err(e) => e.into_response(),
        Ok(body) => {
            let dest = parts.uri.path().strip_prefix("/v2/publish/").unwrap_or("");
            let item = build_from_request(
                dest,
                parts.uri.query(),
                &parts.headers,
                body,
                None,
                caller_ip(ctx.as_ref()),
            );
            publish_one(&s, item)
        }
    };
    publish_epilogue(&s, &pf, ctx, resp).await
}

async fn enqueue(State(s): S, req: Request) -> Response {
    let (parts, body) = req.into_parts();
    let ctx = parts.extensions.get::<ConnCtx>().cloned();
    let pf = match publish_prelude(&s) {
        Ok(pf) => pf,
        Err(e) => return e.into_response(),
    };
    let resp = match read_body(&s, body).await {
        Err(e) => e.into_response(),
        Ok(body) => {
            let rest = parts.uri.path().strip_prefix("/v2/enqueue/").unwrap_or("");
            let (queue, dest) = rest.split_once('/').unwrap_or((rest, ""));
            let queue = url::form_urlencoded::parse(format!("q={queue}").as_bytes())
                .next()
                .map(|(_, v)| v.into_owned())
                .unwrap_or_default();
            let item = build_from_request(
                dest,
                parts.uri.query(),
                &parts.headers,
                body,
                Some(queue),
                caller_ip(ctx.as_ref()),
            );
            publish_one(&s, item)
        }
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

async fn batch(State(s): S, req: Request) -> Response {
    let (parts, body) = req.into_parts();
    let ctx = parts.extensions.get::<ConnCtx>().cloned();
    let pf = match publish_prelude(&s) {
        Ok(pf) => pf,
        Err(e) => return e.into_response(),
    };
    let resp = match read_body(&s, body).await {
        Err(e) => e.into_response(),
        Ok(body) => batch_inner(&s, &body, caller_ip(ctx.as_ref())),
    };
    publish_epilogue(&s, &pf, ctx, resp).await
}

fn batch_inner(s: &Shared, body: &[u8], caller_ip: Arc<str>) -> Response {
    let items: Vec<BatchItem<'_>> = match serde_json::from_slice(body) {
        Ok(v) => v,
        Err(e) => {
            Counters::inc(&s.counters.rejected);
            return ApiError::bad_request(format!(
                "invalid batch body: expected a JSON array of messages: {e}"
            ))
            .into_response();
        }
    };
    let built: Vec<Result<NewMessage, ApiError>> = items
        .into_iter()
        .map(|i| build_batch_item(i, &caller_ip))
        .collect();
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

// ---------------------------------------------------------------------------------------------------------
// Message views

fn body_fields(obj: &mut Map<String, Value>, key: &str, key_b64: &str, body: &[u8]) {
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

async fn get_message(State(s): S, Path(id): Path<String>) -> Response {
    let core = s.core();
    match core.msgs.get(id.as_str()) {
        Some(m) => ok_json(Value::Object(message_json(&m.data))),
        None => ApiError::not_found(format!("message {id} not found")).into_response(),
    }
}

async fn cancel_message(State(s): S, Path(id): Path<String>) -> Response {
    if s.with_core(|core, fx| core.cancel(&id, fx)) {
        ok_json(json!({"cancelled": 1}))
    } else {
        ApiError::not_found(format!("message {id} not found")).into_response()
    }
}

/// Multi-valued filter parameters: repeated keys and comma lists, from the query and an optional JSON body.
#[derive(Default, Debug)]
struct Filters {
    values: Vec<(String, String)>,
}

impl Filters {
    fn from_request(query: Option<&str>, body: &[u8]) -> Result<Filters, ApiError> {
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

    fn all(&self, key: &str) -> Vec<&str> {
        self.values
            .iter()
            .filter(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
            .filter(|v| !v.is_empty())
            .collect()
    }

    fn one(&self, key: &str) -> Option<&str> {
        self.all(key).into_iter().next()
    }

    fn num(&self, key: &str) -> Result<Option<u64>, ApiError> {
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
struct MessageFilter {
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
    fn new(f: &Filters) -> Result<MessageFilter, ApiError> {
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

    fn matches(&self, d: &MsgData, time_ms: u64) -> bool {
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

async fn cancel_messages(State(s): S, req: Request) -> Response {
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

// ---------------------------------------------------------------------------------------------------------
// DLQ

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

async fn list_dlq(State(s): S, req: Request) -> Response {
    let filters = match Filters::from_request(req.uri().query(), &[]) {
        Ok(f) => f,
        Err(e) => return e.into_response(),
    };
    let q = match DlqQuery::new(&filters, true) {
        Ok(q) => q,
        Err(e) => return e.into_response(),
    };
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

async fn get_dlq(State(s): S, Path(id): Path<String>) -> Response {
    let mut core = s.core();
    core.purge_dlq();
    match parse_dlq_id(&id).and_then(|k| core.dlq.get(&k)) {
        Some(e) => ok_json(dlq_json(e)),
        None => ApiError::not_found(format!("dlq message {id} not found")).into_response(),
    }
}

async fn delete_dlq_one(State(s): S, Path(id): Path<String>) -> Response {
    let mut core = s.core();
    core.purge_dlq();
    match parse_dlq_id(&id).and_then(|k| core.dlq.remove(&k)) {
        Some(_) => ok_json(json!({"deleted": 1})),
        None => ApiError::not_found(format!("dlq message {id} not found")).into_response(),
    }
}

async fn delete_dlq_bulk(State(s): S, req: Request) -> Response {
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

async fn retry_dlq_one(State(s): S, Path(id): Path<String>, headers: HeaderMap) -> Response {
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

async fn retry_dlq_bulk(State(s): S, req: Request) -> Response {
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

// ---------------------------------------------------------------------------------------------------------
// Queues

fn queue_json(q: &crate::core::Queue) -> Value {
    json!({
        "name": q.name,
        "createdAt": q.created_at_ms,
        "updatedAt": q.updated_at_ms,
        "parallelism": q.parallelism,
        "paused": q.paused,
        "lag": q.waitlist.len(),
    })
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct UpsertQueue {
    queue_name: Option<String>,
    parallelism: Option<u32>,
    paused: Option<bool>,
}

async fn upsert_queue(State(s): S, body: Bytes) -> Response {
    let req: UpsertQueue = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => return ApiError::bad_request(format!("invalid body: {e}")).into_response(),
    };
    let Some(name) = req.queue_name.filter(|n| valid_queue_name(n)) else {
        return ApiError::bad_request(
            "invalid queueName: only alphanumerics, '-', '_' and '.' are allowed",
        )
        .into_response();
    };
    let parallelism = req.parallelism.unwrap_or(1).max(1);
    s.with_core(|core, fx| {
        let now = now_ms();
        let q = core
            .queues
            .entry(name.clone())
            .or_insert_with(|| crate::core::Queue {
                name: name.clone(),
                created_at_ms: now,
                updated_at_ms: now,
                parallelism,
                paused: false,
                waitlist: Default::default(),
                active: 0,
            });
        q.parallelism = parallelism;
        q.paused = req.paused.unwrap_or(false);
        q.updated_at_ms = now;
        core.pump_queue(&name, fx);
    });
    empty_ok()
}

async fn list_queues(State(s): S) -> Response {
    let core = s.core();
    ok_json(Value::Array(core.queues.values().map(queue_json).collect()))
}

async fn get_queue(State(s): S, Path(name): Path<String>) -> Response {
    let core = s.core();
    match core.queues.get(&name) {
        Some(q) => ok_json(queue_json(q)),
        None => ApiError::not_found(format!("queue {name} not found")).into_response(),
    }
}

async fn delete_queue(State(s): S, Path(name): Path<String>) -> Response {
    let found = s.with_core(|core, fx| {
        let Some(q) = core.queues.remove(&name) else {
            return false;
        };
        for id in q.waitlist {
            core.cancel(&id, fx);
        }
        true
    });
    if found {
        empty_ok()
    } else {
        ApiError::not_found(format!("queue {name} not found")).into_response()
    }
}

fn set_queue_paused(s: &Shared, name: &str, paused: bool) -> Response {
    let found = s.with_core(|core, fx| {
        let Some(q) = core.queues.get_mut(name) else {
            return false;
        };
        q.paused = paused;
        q.updated_at_ms = now_ms();
        if !paused {
            core.pump_queue(name, fx);
        }
        true
    });
    if found {
        empty_ok()
    } else {
        ApiError::not_found(format!("queue {name} not found")).into_response()
    }
}

async fn pause_queue(State(s): S, Path(name): Path<String>) -> Response {
    set_queue_paused(&s, &name, true)
}

async fn resume_queue(State(s): S, Path(name): Path<String>) -> Response {
    set_queue_paused(&s, &name, false)
}

// ---------------------------------------------------------------------------------------------------------
// Flow control

fn flow_json(f: &crate::core::Flow) -> Value {
    let rate = f.effective_rate();
    json!({
        "flowControlKey": f.key,
        "waitListSize": f.waitlist.len(),
        "parallelismMax": f.effective_parallelism().unwrap_or(0),
        "parallelismCount": f.active,
        "rateMax": rate.map(|r| r.0).unwrap_or(0),
        "rateCount": if rate.is_some() { f.window_count } else { 0 },
        "ratePeriod": rate.map(|r| r.1.as_secs()).unwrap_or(0),
        "ratePeriodStart": f.window_start_ms,
        "isPaused": f.paused,
        "isPinnedParallelism": f.pinned_parallelism.is_some(),
        "isPinnedRate": f.pinned_rate.is_some(),
    })
}

async fn list_flows(State(s): S, req: Request) -> Response {
    let search = query_pairs(req.uri().query())
        .into_iter()
        .find(|(k, _)| k == "search")
        .map(|(_, v)| v);
    let core = s.core();
    let list: Vec<Value> = core
        .flows
        .values()
        .filter(|f| search.as_deref().is_none_or(|q| f.key.contains(q)))
        .map(flow_json)
        .collect();
    ok_json(Value::Array(list))
}

async fn get_flow(State(s): S, Path(key): Path<String>) -> Response {
    let core = s.core();
    match core.flows.get(&key) {
        Some(f) => ok_json(flow_json(f)),
        None => ApiError::not_found(format!("flow control key {key} not found")).into_response(),
    }
}

async fn flow_action(
    State(s): S,
    Path((key, action)): Path<(String, String)>,
    req: Request,
) -> Response {
    let params = query_pairs(req.uri().query());
    let param = |name: &str| {
        params
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.clone())
    };
    let result = s.with_core(|core, fx| -> Result<(), ApiError> {
        let flow = core
            .flows
            .entry(key.clone())
            .or_insert_with(|| crate::core::Flow::new(&key));
        match action.as_str() {
            "pause" => flow.paused = true,
            "resume" => flow.paused = false,
            "resetRate" => {
                flow.window_start = None;
                flow.window_count = 0;
            }
            "pin" => {
                if let Some(p) = param("parallelism") {
                    let p: u32 = p.parse().map_err(|_| {
                        ApiError::bad_request(format!("invalid parallelism: {p:?}"))
                    })?;
                    flow.pinned_parallelism = Some(p.max(1));
                }
                if let Some(r) = param("rate") {
                    let r: u32 = r
                        .parse()
                        .map_err(|_| ApiError::bad_request(format!("invalid rate: {r:?}")))?;
                    let period = match param("period") {
                        Some(p) => {
                            crate::duration::parse_period(&p).map_err(ApiError::bad_request)?
                        }
                        None => Duration::from_secs(1),
                    };
                    flow.pinned_rate = Some((r.max(1), period));
                }
            }
            "unpin" => {
                if param("parallelism").as_deref() == Some("true") {
                    flow.pinned_parallelism = None;
                }
                if param("rate").as_deref() == Some("true") {
                    flow.pinned_rate = None;
                }
            }
            other => {
                return Err(ApiError::not_found(format!(
                    "unknown flow-control action {other:?}"
                )));
            }
        }
        core.pump_flow(&key, fx);
        Ok(())
    });
    match result {
        Ok(()) => empty_ok(),
        Err(e) => e.into_response(),
    }
}

async fn global_parallelism(State(s): S) -> Response {
    let (_, in_flight) = s.jobs.load();
    ok_json(json!({"parallelismMax": s.cfg.max_concurrency, "parallelismCount": in_flight}))
}

async fn get_keys(State(s): S) -> Response {
    let k = s.signing_keys();
    ok_json(json!({"current": k.current, "next": k.next}))
}

async fn rotate_keys(State(s): S) -> Response {
    let k = s.rotate_keys();
    ok_json(json!({"current": k.current, "next": k.next}))
}
