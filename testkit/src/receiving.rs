//! Helpers for the receiving-side tests (consumer, callbacks, signatures, fixtures, the template's handlers).
//!
//! The token signer here is deliberately independent of `outbox::internals::receiver` (its own HMAC, hashing and
//! encoding), so a bug in the receiver cannot be mirrored by the code that makes the test tokens. Keep it so:
//! nothing here may call `outbox::internals::receiver::sign` or `outbox::internals::contract::write_envelope`.

use base64::Engine;
use base64::engine::general_purpose::{STANDARD, URL_SAFE, URL_SAFE_NO_PAD};
use hmac::{Hmac, Mac};
use lambda_http::{Body, Request, Response};
use outbox::ReceiverState;
use outbox::config::ConsumerConfig;
use outbox::consumer::{ConsumerState, Registry};
use outbox::db::{Db, Statements};
use outbox::internals::receiver::{Clock, KeyRing, SigningKeys};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use sqlx::PgPool;

/// QStash's documented dev-server signing keys (current, next).
pub const KEY: &str = outbox::internals::secrets::DEV_CURRENT_SIGNING_KEY;
pub const NEXT: &str = outbox::internals::secrets::DEV_NEXT_SIGNING_KEY;
/// The "now" every test state uses.
pub const NOW: i64 = 1_790_000_000;
/// The function URL host of the test consumer.
pub const HOST: &str = "abc123.lambda-url.eu-west-1.on.aws";
/// The go-zero-time `nbf` QStash sends since 2024.
pub const GO_ZERO_NBF: i64 = -62_135_596_800;

/// base64url(SHA-256(body)), padded or not.
pub fn body_claim(body: &[u8], padded: bool) -> String {
    let digest = Sha256::digest(body);
    if padded {
        URL_SAFE.encode(digest)
    } else {
        URL_SAFE_NO_PAD.encode(digest)
    }
}

/// HMAC-SHA256 signature over `header.payload` (both given as JSON text), returned as a compact JWS.
pub fn jws(key: &[u8], header_json: &str, claims_json: &str) -> String {
    let h = URL_SAFE_NO_PAD.encode(header_json);
    let p = URL_SAFE_NO_PAD.encode(claims_json);
    let input = format!("{h}.{p}");
    let mut mac = Hmac::<Sha256>::new_from_slice(key).expect("hmac key");
    mac.update(input.as_bytes());
    let sig = URL_SAFE_NO_PAD.encode(mac.finalize().into_bytes());
    format!("{input}.{sig}")
}

pub const HS256_HEADER: &str = r#"{"alg":"HS256","typ":"JWT"}"#;

/// The claims QStash would send for `url` and `body` at `NOW`.
pub fn claims(url: &str, body: &[u8]) -> Value {
    json!({
        "aud": "",
        "body": body_claim(body, true),
        "exp": NOW + 300,
        "iat": NOW,
        "iss": "Upstash",
        "jti": "jwt_testtesttesttesttesttesttest",
        "nbf": GO_ZERO_NBF,
        "sub": url,
    })
}

/// A QStash-like token signed with `key`.
pub fn token(key: &str, url: &str, body: &[u8]) -> String {
    jws(key.as_bytes(), HS256_HEADER, &claims(url, body).to_string())
}

/// A token with custom claims.
pub fn token_with(key: &str, claims: &Value) -> String {
    jws(key.as_bytes(), HS256_HEADER, &claims.to_string())
}

/// A function-URL (API Gateway v2) event, as JSON text.
pub fn function_url_event(
    method: &str,
    raw_path: &str,
    raw_query: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> String {
    let mut h = serde_json::Map::new();
    h.insert("host".into(), HOST.into());
    h.insert("x-forwarded-proto".into(), "https".into());
    h.insert("content-type".into(), "application/json".into());
    h.insert("user-agent".into(), "Upstash-QStash".into());
    for (k, v) in headers {
        // Later entries win; a key differing only in case replaces the default too.
        let existing: Vec<String> = h
            .keys()
            .filter(|e| e.eq_ignore_ascii_case(k))
            .cloned()
            .collect();
        for e in existing {
            h.remove(&e);
        }
        h.insert((*k).to_owned(), Value::String((*v).to_owned()));
    }
    let (body, b64) = match std::str::from_utf8(body) {
        Ok(s) => (s.to_owned(), false),
        Err(_) => (STANDARD.encode(body), true),
    };
    json!({
        "version": "2.0",
        "routeKey": "$default",
        "rawPath": raw_path,
        "rawQueryString": raw_query,
        "headers": h,
        "requestContext": {
            "accountId": "anonymous",
            "apiId": "abc123",
            "domainName": HOST,
            "domainPrefix": "abc123",
            "http": {"method": method, "path": raw_path, "protocol": "HTTP/1.1",
                     "sourceIp": "203.0.113.7", "userAgent": "Upstash-QStash"},
            "requestId": "11111111-2222-3333-4444-555555555555",
            "routeKey": "$default",
            "stage": "$default",
            "time": "29/Nov/2026:08:00:00 +0000",
            "timeEpoch": 1_790_000_000_000_i64
        },
        "body": body,
        "isBase64Encoded": b64
    })
    .to_string()
}

/// Parses a function-URL event the way the Lambda runtime does.
pub fn request_from_event(event: &str) -> Request {
    lambda_http::request::from_str(event).expect("function URL event")
}

/// A function-URL POST of `body` to `path?query` carrying exactly `headers` besides the platform's (host,
/// `x-forwarded-proto`, content type, user agent; a header given here replaces one of those), as the Lambda
/// runtime hands it to a handler: what every signature case is made of, with whatever `upstash-signature` (or
/// none) the case needs.
pub fn post_with_headers(
    path: &str,
    query: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> Request {
    request_from_event(&function_url_event("POST", path, query, headers, body))
}

/// The URL QStash would sign for a path on the test host.
pub fn url(path: &str) -> String {
    format!("https://{HOST}{path}")
}

/// The URL QStash would sign for `path?query` on the test host (no `?` for an empty query).
pub fn url_with_query(path: &str, query: &str) -> String {
    if query.is_empty() {
        url(path)
    } else {
        format!("https://{HOST}{path}?{query}")
    }
}

/// The signed destination query of the current wire contract.
pub const CONTRACT_QUERY: &str = "contract=2";

/// The creation time the test envelopes carry by default.
pub const CREATED_AT: &str = "2026-11-30T12:00:00.000000Z";

/// A delivery in the current wire contract (decision record 0025), written here independently of
/// `outbox::internals::contract::write_envelope` (so a bug in the relay's writer is not mirrored by the tests): a JSON
/// envelope body POSTed to `/events/{topic}?contract=2`, signed for that URL (query included).
///
/// ```ignore
/// Delivery::new("orders", 42, &payload).key("customer-7").seq(3).schema_version(2)
///     .evidence_by_consumer().header("traceparent", "00-…").request()
/// ```
///
/// The request carries the relay's informational `x-outbox-id` copy (and `traceparent` when the event has
/// one); [`Delivery::request_header`] adds or replaces request headers (forged copies in the attack tests).
#[derive(Debug, Clone)]
pub struct Delivery {
    topic: String,
    envelope_topic: Option<String>,
    subscriber: Option<String>,
    id: i64,
    payload: Vec<u8>,
    key: String,
    seq: Option<i64>,
    schema_version: Option<u32>,
    evidence: Option<String>,
    created_at: Option<String>,
    headers: Vec<(String, String)>,
    request_headers: Vec<(String, String)>,
    id_copy: bool,
    path: Option<String>,
    query: String,
    /// The event this is a copy of (`event` in the envelope).
    event: Option<i64>,
    /// The subscriber key the relay signs this copy with (`&sig=` in the URL).
    subscriber_key: Option<String>,
}

/// The relay's subscriber signature of `body` with `key`, as decision record 0028 specifies it, written here
/// independently of `outbox::internals::subscriber_keys`: base64url without padding of HMAC-SHA256 over
/// `outbox-subscriber-signature-v1\n` followed by the body.
pub fn subscriber_signature(key: &str, body: &[u8]) -> String {
    let mut mac = Hmac::<Sha256>::new_from_slice(key.as_bytes()).expect("HMAC takes any key");
    mac.update(b"outbox-subscriber-signature-v1\n");
    mac.update(body);
    URL_SAFE_NO_PAD.encode(mac.finalize().into_bytes())
}

impl Delivery {
    /// Event `id` of `topic` with `payload` (JSON text, copied verbatim into the envelope); key `k-{id}`.
    pub fn new(topic: &str, id: i64, payload: &[u8]) -> Delivery {
        Delivery {
            topic: topic.to_owned(),
            envelope_topic: None,
            subscriber: None,
            id,
            payload: payload.to_vec(),
            key: format!("k-{id}"),
            seq: None,
            schema_version: None,
            evidence: None,
            created_at: Some(CREATED_AT.to_owned()),
            headers: Vec::new(),
            request_headers: Vec::new(),
            id_copy: true,
            path: None,
            query: CONTRACT_QUERY.to_owned(),
            event: None,
            subscriber_key: None,
        }
    }

    /// The envelope says this copy is of event `event` (fan-out, replay: the consumer's dedupe key).
    pub fn event(mut self, event: i64) -> Self {
        self.event = Some(event);
        self
    }

    /// The URL carries the relay's subscriber signature of the body made with `key` ([`subscriber_signature`]).
    pub fn signed_for_subscriber(mut self, key: &str) -> Self {
        self.subscriber_key = Some(key.to_owned());
        self
    }

    /// The destination query: [`Delivery::query`], and the subscriber signature when there is one.
    fn full_query(&self) -> String {
        match &self.subscriber_key {
            Some(k) => format!(
                "{}&sig={}",
                self.query,
                subscriber_signature(k, &self.body())
            ),
            None => self.query.clone(),
        }
    }

    /// The partition key.
    pub fn key(mut self, key: &str) -> Self {
        self.key = key.to_owned();
        self
    }

    /// The per-key sequence (an ordered topic).
    pub fn seq(mut self, seq: i64) -> Self {
        self.seq = Some(seq);
        self
    }

    /// The payload schema version.
    pub fn schema_version(mut self, v: u32) -> Self {
        self.schema_version = Some(v);
        self
    }

    /// `"evidence":"consumer"`: the consumer records the delivery evidence of this ordered event.
    pub fn evidence_by_consumer(self) -> Self {
        self.evidence("consumer")
    }

    /// `"evidence":"callback"`: QStash's delivery callback records it.
    pub fn evidence_by_callback(self) -> Self {
        self.evidence("callback")
    }

    fn evidence(mut self, who: &str) -> Self {
        self.evidence = Some(who.to_owned());
        self
    }

    /// The event's creation time (`None`: omitted).
    pub fn created_at(mut self, at: Option<&str>) -> Self {
        self.created_at = at.map(str::to_owned);
        self
    }

    /// An event header in the envelope (`traceparent`, `x-correlation-id`).
    pub fn header(mut self, name: &str, value: &str) -> Self {
        self.headers.push((name.to_owned(), value.to_owned()));
        self
    }

    /// A request header (not signed), added or replacing one the builder sets.
    pub fn request_header(mut self, name: &str, value: &str) -> Self {
        self.request_headers
            .push((name.to_owned(), value.to_owned()));
        self
    }

    /// No `x-outbox-id` copy on the request.
    pub fn without_id_copy(mut self) -> Self {
        self.id_copy = false;
        self
    }

    /// Another topic in the envelope than in the path.
    pub fn envelope_topic(mut self, topic: &str) -> Self {
        self.envelope_topic = Some(topic.to_owned());
        self
    }

    /// The envelope names this (named) subscriber, as the relay does for a named subscriber's copy (fan-out).
    pub fn subscriber(mut self, name: &str) -> Self {
        self.subscriber = Some(name.to_owned());
        self
    }

    /// Another path than `/events/{topic}`.
    pub fn path(mut self, path: &str) -> Self {
        self.path = Some(path.to_owned());
        self
    }

    /// Another query than `contract=2` (signed like the rest of the URL).
    pub fn query(mut self, query: &str) -> Self {
        self.query = query.to_owned();
        self
    }

    /// The topic (of the path).
    pub fn topic(&self) -> &str {
        &self.topic
    }

    /// The outbox id.
    pub fn id(&self) -> i64 {
        self.id
    }

    /// The request path.
    pub fn request_path(&self) -> String {
        self.path
            .clone()
            .unwrap_or_else(|| format!("/events/{}", self.topic))
    }

    /// The URL QStash signs (`sub`): the test host, the path and the query.
    pub fn signed_url(&self) -> String {
        url_with_query(&self.request_path(), &self.full_query())
    }

    /// The envelope body: every field but the payload through `serde_json`, the payload spliced in verbatim
    /// (what a relay does with the `jsonb` text; also lets a test send a payload that is not JSON).
    pub fn body(&self) -> Vec<u8> {
        self.envelope(&[self.event_json()])
    }

    /// The envelope around `events` (each one event's JSON text), with this delivery's topic and evidence.
    fn envelope(&self, events: &[Vec<u8>]) -> Vec<u8> {
        let mut out = json!({
            "contract": 2,
            "topic": self.envelope_topic.as_deref().unwrap_or(&self.topic),
        });
        if let Some(s) = &self.subscriber {
            out["subscriber"] = json!(s);
        }
        if let Some(e) = &self.evidence {
            out["evidence"] = json!(e);
        }
        let mut text = out.to_string();
        assert_eq!(text.pop(), Some('}'));
        let mut body = text.into_bytes();
        body.extend_from_slice(b",\"events\":[");
        for (i, e) in events.iter().enumerate() {
            if i > 0 {
                body.push(b',');
            }
            body.extend_from_slice(e);
        }
        body.extend_from_slice(b"]}");
        body
    }

    /// This event's JSON text inside an envelope's `events`.
    fn event_json(&self) -> Vec<u8> {
        let mut event = serde_json::Map::new();
        event.insert("id".into(), json!(self.id));
        if let Some(e) = self.event {
            event.insert("event".into(), json!(e));
        }
        event.insert("key".into(), json!(self.key));
        if let Some(seq) = self.seq {
            event.insert("seq".into(), json!(seq));
        }
        if let Some(at) = &self.created_at {
            event.insert("created_at".into(), json!(at));
        }
        if let Some(v) = self.schema_version {
            event.insert("schema_version".into(), json!(v));
        }
        if !self.headers.is_empty() {
            let h: serde_json::Map<String, Value> = self
                .headers
                .iter()
                .map(|(k, v)| (k.clone(), json!(v)))
                .collect();
            event.insert("headers".into(), Value::Object(h));
        }
        let mut event_text = Value::Object(event).to_string();
        assert_eq!(event_text.pop(), Some('}'));
        let mut body = event_text.into_bytes();
        body.extend_from_slice(b",\"payload\":");
        body.extend_from_slice(&self.payload);
        body.push(b'}');
        body
    }

    /// The signed function-URL request, as the Lambda runtime hands it to the handler.
    pub fn request(&self) -> Request {
        self.request_signed_by(|url, body| token(KEY, url, body))
    }

    /// The request with a token made by `sign(signed_url, body)`.
    pub fn request_signed_by(&self, sign: impl FnOnce(&str, &[u8]) -> String) -> Request {
        let body = self.body();
        let sig = sign(&self.signed_url(), &body);
        self.request_with_token(&body, Some(&sig))
    }

    /// The request with `body` instead of the envelope, signed for it.
    pub fn request_with_body(&self, body: &[u8]) -> Request {
        let sig = token(KEY, &self.signed_url(), body);
        self.request_with_token(body, Some(&sig))
    }

    /// The request with `body` (instead of the envelope) and `token` (none: unsigned).
    pub fn request_with_token(&self, body: &[u8], token: Option<&str>) -> Request {
        let id = self.id.to_string();
        let mut headers: Vec<(&str, &str)> =
            vec![("upstash-message-id", "msg_test"), ("upstash-retried", "0")];
        if let Some(t) = token {
            headers.push(("upstash-signature", t));
        }
        if self.id_copy {
            headers.push(("x-outbox-id", &id));
        }
        for (k, v) in &self.headers {
            if k.eq_ignore_ascii_case("traceparent") {
                headers.push(("traceparent", v));
            }
        }
        for (k, v) in &self.request_headers {
            headers.push((k, v));
        }
        post_with_headers(&self.request_path(), &self.full_query(), &headers, body)
    }
}

/// A batched delivery (decision record 0027): the events of several [`Delivery`]s in one envelope, in the order
/// given; topic, evidence, path and query are the first one's. The request's `x-outbox-id` copy is the ids joined
/// by `,`. Written here independently of the relay's writer, like [`Delivery`].
#[derive(Debug, Clone)]
pub struct Batch {
    events: Vec<Delivery>,
}

impl Batch {
    /// A batch of `events` (at least one).
    pub fn new(events: Vec<Delivery>) -> Batch {
        assert!(!events.is_empty(), "a batch holds at least one event");
        Batch { events }
    }

    /// The events.
    pub fn events(&self) -> &[Delivery] {
        &self.events
    }

    /// The outbox ids, in order.
    pub fn ids(&self) -> Vec<i64> {
        self.events.iter().map(Delivery::id).collect()
    }

    /// The envelope body.
    pub fn body(&self) -> Vec<u8> {
        let events: Vec<Vec<u8>> = self.events.iter().map(Delivery::event_json).collect();
        self.events[0].envelope(&events)
    }

    /// The URL QStash signs.
    pub fn signed_url(&self) -> String {
        self.events[0].signed_url()
    }

    /// The signed request, with the `x-outbox-id` copy `a,b,c`.
    pub fn request(&self) -> Request {
        let ids: Vec<String> = self.ids().iter().map(i64::to_string).collect();
        self.request_with_id_copy(&ids.join(","))
    }

    /// The signed request with another `x-outbox-id` copy (an altered request).
    pub fn request_with_id_copy(&self, copy: &str) -> Request {
        let body = self.body();
        let first = &self.events[0];
        let sig = token(KEY, &first.signed_url(), &body);
        let headers: Vec<(&str, &str)> = vec![
            ("upstash-message-id", "msg_batch"),
            ("upstash-retried", "0"),
            ("upstash-signature", &sig),
            ("x-outbox-id", copy),
        ];
        post_with_headers(&first.request_path(), &first.query, &headers, &body)
    }
}

/// A delivery in the previous wire format (published by a relay before the signed contract, still inside
/// QStash after an upgrade): the raw payload as body, POSTed to `/events/{topic}` without a contract version,
/// identity in `x-outbox-id`/`x-outbox-topic` (+ `headers`), signed for that URL.
pub fn legacy_request(
    topic: &str,
    outbox_id: i64,
    body: &[u8],
    headers: &[(&str, &str)],
) -> Request {
    let path = format!("/events/{topic}");
    let sig = token(KEY, &url(&path), body);
    let id = outbox_id.to_string();
    let mut h: Vec<(&str, &str)> = vec![
        ("upstash-signature", &sig),
        ("upstash-message-id", "msg_legacy"),
        ("upstash-retried", "0"),
        ("x-outbox-id", &id),
        ("x-outbox-topic", topic),
    ];
    h.extend_from_slice(headers);
    post_with_headers(&path, "", &h, body)
}

/// A signed POST to `path` on the test host.
pub fn signed_post(path: &str, body: &[u8], extra: &[(&str, &str)]) -> Request {
    signed_post_with_query(path, "", body, extra)
}

/// A signed POST to `path?query` on the test host (`sub` includes the query).
pub fn signed_post_with_query(
    path: &str,
    query: &str,
    body: &[u8],
    extra: &[(&str, &str)],
) -> Request {
    let sig = token(KEY, &url_with_query(path, query), body);
    let mut headers: Vec<(&str, &str)> = vec![("upstash-signature", &sig)];
    headers.extend_from_slice(extra);
    post_with_headers(path, query, &headers, body)
}

/// Receiver state over `pool` with the dev keys, the clock fixed at [`NOW`] and metrics off.
pub fn receiver(pool: &PgPool, config: ConsumerConfig) -> ReceiverState {
    ReceiverState::new(
        config,
        Db::new(pool.clone(), Statements::Prepared),
        KeyRing::fixed(SigningKeys::new(KEY, Some(NEXT.into()))),
    )
    .with_clock(Clock::Fixed(NOW))
    .with_metrics(false)
}

/// Consumer state over `pool` with `registry`.
pub fn consumer(pool: &PgPool, registry: Registry) -> ConsumerState {
    ConsumerState::new(receiver(pool, ConsumerConfig::defaults()), registry)
}

/// The status and JSON body of a response.
pub fn parts(resp: &Response<Body>) -> (u16, Value) {
    let body: &[u8] = resp.body().as_ref();
    let json = serde_json::from_slice(body).unwrap_or(Value::Null);
    (resp.status().as_u16(), json)
}

pub async fn count(pool: &PgPool, sql: &'static str) -> i64 {
    sqlx::query_scalar::<_, i64>(sql)
        .fetch_one(pool)
        .await
        .expect("count query")
}
