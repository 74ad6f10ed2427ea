//! Helpers for the receiving-side tests (consumer, callbacks, signatures, fixtures).
//!
//! The token signer here is deliberately independent of `outbox::receiver` (its own HMAC, hashing and
//! encoding), so a bug in the receiver cannot be mirrored by the code that makes the test tokens.
#![allow(dead_code)]

use std::path::PathBuf;

use base64::Engine;
use base64::engine::general_purpose::{STANDARD, URL_SAFE, URL_SAFE_NO_PAD};
use hmac::{Hmac, Mac};
use lambda_http::{Body, Request, Response};
use outbox::config::ConsumerConfig;
use outbox::consumer::{ConsumerState, ReceiverState, Registry};
use outbox::receiver::{Clock, KeyRing, SigningKeys};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use sqlx::PgPool;

/// QStash's documented dev-server signing keys (current, next).
pub const KEY: &str = "sig_7kYjw48mhY7kAjqNGcy6cr29RJ6r";
pub const NEXT: &str = "sig_5ZB6DVzB1wjE8S6rZ7eenA8Pdnhs";
/// The "now" every test state uses.
pub const NOW: i64 = 1_790_000_000;
/// The function URL host of the test consumer.
pub const HOST: &str = "abc123.lambda-url.eu-west-1.on.aws";
/// The go-zero-time `nbf` QStash sends since 2024.
pub const GO_ZERO_NBF: i64 = -62_135_596_800;

pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

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

/// The URL QStash would sign for a path on the test host.
pub fn url(path: &str) -> String {
    format!("https://{HOST}{path}")
}

/// A signed event delivery (POST `/events/{topic}`) with the contract headers.
pub fn event_request(topic: &str, outbox_id: i64, body: &[u8], extra: &[(&str, &str)]) -> Request {
    let path = format!("/events/{topic}");
    let sig = token(KEY, &url(&path), body);
    let id = outbox_id.to_string();
    let mut headers: Vec<(&str, &str)> = vec![
        ("upstash-signature", &sig),
        ("upstash-message-id", "msg_test"),
        ("upstash-retried", "0"),
        ("x-outbox-id", &id),
        ("x-outbox-topic", topic),
    ];
    headers.extend_from_slice(extra);
    request_from_event(&function_url_event("POST", &path, "", &headers, body))
}

/// A signed POST to `path` on the test host.
pub fn signed_post(path: &str, body: &[u8], extra: &[(&str, &str)]) -> Request {
    let sig = token(KEY, &url(path), body);
    let mut headers: Vec<(&str, &str)> = vec![("upstash-signature", &sig)];
    headers.extend_from_slice(extra);
    request_from_event(&function_url_event("POST", path, "", &headers, body))
}

/// Receiver state over `pool` with the dev keys, the clock fixed at [`NOW`] and metrics off.
pub fn receiver(pool: &PgPool, config: ConsumerConfig) -> ReceiverState {
    ReceiverState::new(
        config,
        pool.clone(),
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
