//! Signing like QStash does, for fixtures, tests and local tooling; production tokens come from QStash. Behind the
//! cargo feature `testing` (off by default), so the library and the Lambda binaries ship no token signer (the dev
//! keys' public values are in `crate::secrets`, where the functions use them only to refuse them).
#![cfg_attr(not(feature = "internals"), allow(dead_code))] // used through `crate::internals`

use base64::Engine;
use secrecy::SecretString;
use serde_json::{Map, Value};

use super::token::{B64URL, ISSUER, SIGNATURE_HEADER};
use super::verify::hmac_tag;
use super::{UrlSource, body_hash, request_url};

/// Signs like QStash does (same header, alphabetical claims, padded body hash, `nbf = -62135596800`,
/// `exp = iat + ttl`). For fixtures, tests and local tooling; production tokens come from QStash.
pub fn sign(key: &str, url: &str, body: &[u8], iat: i64, ttl_secs: i64) -> String {
    use rand::Rng;
    use std::fmt::Write;
    let mut padded = body_hash(body);
    while !padded.len().is_multiple_of(4) {
        padded.push('=');
    }
    let jti: String = {
        let mut rng = rand::rng();
        let mut s = String::from("jwt_");
        for _ in 0..28 {
            let c = rng.sample(rand::distr::Alphanumeric);
            let _ = write!(s, "{}", c as char);
        }
        s
    };
    let claims = serde_json::json!({
        "aud": "", "body": padded, "exp": iat + ttl_secs, "iat": iat, "iss": ISSUER, "jti": jti,
        "nbf": -62_135_596_800_i64, "sub": url,
    });
    let header = B64URL.encode(br#"{"alg":"HS256","typ":"JWT"}"#);
    let payload = B64URL.encode(claims.to_string());
    let input = format!("{header}.{payload}");
    let tag = hmac_tag(&SecretString::from(key.to_owned()), input.as_bytes());
    format!("{input}.{}", B64URL.encode(tag))
}

/// The claims of a token, decoded **without** verification (tooling only: e.g. to read a fixture's `iat`).
pub fn decode_unverified(token: &str) -> Option<Map<String, Value>> {
    let p64 = token.split('.').nth(1)?;
    serde_json::from_slice(&B64URL.decode(p64).ok()?).ok()
}

/// QStash's documented dev-server signing keys (`current`, `next`): the keys the `events/` fixtures are signed
/// with. Never configure them in a deployment (the functions refuse them without `OUTBOX_ALLOW_DEV_KEYS=true`).
pub const DEV_SIGNING_KEYS: (&str, &str) = (
    crate::secrets::DEV_CURRENT_SIGNING_KEY,
    crate::secrets::DEV_NEXT_SIGNING_KEY,
);

/// Re-signs a function-URL event (API Gateway v2 JSON, as in `events/`): computes the URL the request goes to
/// exactly as the receiver does ([`request_url`] on the request lambda_http builds from the event), signs it
/// with `key` at `iat` for `ttl_secs`, and replaces the old `upstash-signature` value in the text (the rest of
/// the file is left byte for byte).
pub fn resign_function_url_event(
    event_json: &str,
    key: &str,
    public_base_url: Option<&str>,
    iat: i64,
    ttl_secs: i64,
) -> Result<String, String> {
    let value: Value = serde_json::from_str(event_json).map_err(|e| format!("not JSON: {e}"))?;
    let old = value
        .get("headers")
        .and_then(Value::as_object)
        .and_then(|h| {
            h.iter()
                .find(|(k, _)| k.eq_ignore_ascii_case(SIGNATURE_HEADER))
                .and_then(|(_, v)| v.as_str())
        })
        .ok_or("the event has no upstash-signature header")?
        .to_owned();
    let req = lambda_http::request::from_str(event_json)
        .map_err(|e| format!("not a function URL event: {e}"))?;
    let url = request_url(
        &req,
        public_base_url.map_or(UrlSource::FunctionUrl, UrlSource::Public),
    );
    let token = sign(key, &url, req.body().as_ref(), iat, ttl_secs);
    let quoted = serde_json::to_string(&old).map_err(|e| e.to_string())?;
    if !event_json.contains(&quoted) {
        return Err(
            "the signature value is escaped in the file; cannot replace it in place".into(),
        );
    }
    Ok(event_json.replacen(&quoted, &format!("\"{token}\""), 1))
}
