//! The `Upstash-Signature` receiver: QStash signs every delivery (and every callback) with an HS256 JWT whose
//! claims bind the token to the URL it was sent to (`sub`) and to the exact body bytes (`body` =
//! base64url(SHA-256(body))). Nothing is read from or written to the database before this check passes.
//!
//! What is checked, in this order (decision record 0020):
//!
//! 1. the token is three base64url segments, at most [`MAX_TOKEN_BYTES`] long;
//! 2. the protected header says `"alg":"HS256"` (so `none`, `RS256`, `HS512`… are refused before any HMAC);
//! 3. the HMAC-SHA256 of `header.payload`, keyed with the **bytes of the signing-key string** (the `sig_`
//!    prefix included, no base64 decoding), equals the signature under the **current** key, else under the
//!    **next** key — compared in constant time;
//! 4. `iss == "Upstash"`;
//! 5. `exp` is present and `exp > now - tolerance`;
//! 6. `nbf`, when present, is `<= now + tolerance` — parsed as `i64`: QStash sends `-62135596800` since 2024;
//! 7. `sub` equals the URL this request was sent to ([`request_url`]), exactly (constant time);
//! 8. `body` equals base64url(SHA-256(raw body bytes)), with trailing `=` ignored on both sides (constant time).
//!
//! Each failure is a [`VerifyError`] that names the failed check and never includes a key. The clock is
//! injectable ([`Clock`]) so the real QStash tokens in the tests verify years after they expired.
//!
//! **Key rotation without redeploy:** [`KeyRing`] holds the keys and, when a token matches neither, re-reads the
//! secret (at most once per `SECRET_REFRESH_INTERVAL_SECS`, default 60) and tries again.
//!
//! **The URL (`sub`) is never chosen by the client** (decision record 0021): QStash signs the URL it was *told*
//! to call. Without `PUBLIC_BASE_URL` the receiver rebuilds it from what AWS sets on the function-URL event
//! (`requestContext.domainName`), not from client-sent `Host` or `X-Forwarded-*` headers — otherwise a token
//! issued for another host could be replayed here. Behind CloudFront, API Gateway, a custom domain or `cargo
//! lambda watch` the function sees another host or path than the public one: set `PUBLIC_BASE_URL` (the
//! scheme+host[+prefix] QStash calls), or `TRUST_FORWARDED_HEADERS=true` when the proxy in front sets them.

use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use base64::Engine;
use base64::engine::{DecodePaddingMode, GeneralPurpose, GeneralPurposeConfig};
use hmac::{Hmac, Mac};
use lambda_http::RequestExt;
use secrecy::{ExposeSecret, SecretString};
use serde_json::{Map, Value};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use crate::config::ConfigError;
use crate::secrets::{SecretField, SecretSource, Secrets};

/// The request header carrying the token (header names are case-insensitive).
pub const SIGNATURE_HEADER: &str = "upstash-signature";
/// The only issuer accepted.
pub const ISSUER: &str = "Upstash";
/// Tokens longer than this are refused without further work (real ones are ~450 bytes).
pub const MAX_TOKEN_BYTES: usize = 4096;

/// base64url, no padding written; padding tolerated when reading.
const B64URL: GeneralPurpose = GeneralPurpose::new(
    &base64::alphabet::URL_SAFE,
    GeneralPurposeConfig::new()
        .with_encode_padding(false)
        .with_decode_padding_mode(DecodePaddingMode::Indifferent),
);

type HmacSha256 = Hmac<Sha256>;

/// Why a signature was refused. The message names the failed check; it never contains a signing key.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum VerifyError {
    /// No `Upstash-Signature` header.
    #[error("missing Upstash-Signature header")]
    MissingHeader,
    /// The token is not a compact JWS we can read.
    #[error("malformed token: {0}")]
    Malformed(String),
    /// The header names another algorithm than HS256 (including `none`).
    #[error("unsupported token algorithm {0:?}: only HS256 is accepted")]
    Algorithm(String),
    /// The HMAC matches neither the current nor the next signing key.
    #[error("signature does not match the current or the next signing key")]
    Signature,
    /// A required claim is missing or has the wrong type.
    #[error("claim {claim:?} {problem}")]
    Claim {
        /// The claim name.
        claim: &'static str,
        /// What is wrong with it.
        problem: &'static str,
    },
    /// `iss` is not `Upstash`.
    #[error("issuer (iss) is {0:?}, expected \"Upstash\"")]
    Issuer(String),
    /// `exp` has passed.
    #[error("token expired at {exp} (now {now}, clock tolerance {tolerance} s)")]
    Expired {
        /// The `exp` claim.
        exp: i64,
        /// The verifier's clock.
        now: i64,
        /// The tolerance applied.
        tolerance: i64,
    },
    /// `nbf` is in the future.
    #[error("token not valid before {nbf} (now {now}, clock tolerance {tolerance} s)")]
    NotYetValid {
        /// The `nbf` claim.
        nbf: i64,
        /// The verifier's clock.
        now: i64,
        /// The tolerance applied.
        tolerance: i64,
    },
    /// `sub` is not the URL this request was sent to.
    #[error(
        "subject (sub) {got:?} is not the URL this request was sent to ({want:?}); behind a proxy or custom domain set PUBLIC_BASE_URL"
    )]
    Subject {
        /// The `sub` claim (truncated).
        got: String,
        /// The URL the receiver computed.
        want: String,
    },
    /// The body's hash differs from the `body` claim.
    #[error("body hash does not match the body claim (the body was altered or re-serialised)")]
    BodyHash,
}

impl VerifyError {
    /// A short stable name of the failed check, for logs and metrics.
    pub fn check(&self) -> &'static str {
        match self {
            VerifyError::MissingHeader => "missing_header",
            VerifyError::Malformed(_) => "malformed",
            VerifyError::Algorithm(_) => "algorithm",
            VerifyError::Signature => "signature",
            VerifyError::Claim { .. } => "claim",
            VerifyError::Issuer(_) => "issuer",
            VerifyError::Expired { .. } => "expired",
            VerifyError::NotYetValid { .. } => "not_yet_valid",
            VerifyError::Subject { .. } => "subject",
            VerifyError::BodyHash => "body_hash",
        }
    }
}

/// The claims of a verified token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Claims {
    /// `iss` (always `Upstash`).
    pub iss: String,
    /// `sub`: the URL QStash called.
    pub sub: String,
    /// `exp` (unix seconds).
    pub exp: i64,
    /// `nbf` (unix seconds; QStash sends `-62135596800`).
    pub nbf: Option<i64>,
    /// `iat` (unix seconds), not checked.
    pub iat: Option<i64>,
    /// `jti`, not checked.
    pub jti: Option<String>,
    /// `body`: base64url(SHA-256(body)) as sent (usually padded).
    pub body: String,
    /// Which key matched.
    pub key: KeyUsed,
}

/// Which signing key verified a token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyUsed {
    /// `QSTASH_CURRENT_SIGNING_KEY`.
    Current,
    /// `QSTASH_NEXT_SIGNING_KEY` (QStash rotated; update the secret soon).
    Next,
}

/// The current and next signing keys. `Debug` is redacted.
#[derive(Clone)]
pub struct SigningKeys {
    current: SecretString,
    next: Option<SecretString>,
}

impl std::fmt::Debug for SigningKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SigningKeys")
            .field("current", &"[redacted]")
            .field("next", &self.next.as_ref().map(|_| "[redacted]"))
            .finish()
    }
}

impl SigningKeys {
    /// Keys from explicit values.
    pub fn new(current: impl Into<String>, next: Option<String>) -> Self {
        SigningKeys {
            current: SecretString::from(current.into()),
            next: next.filter(|n| !n.is_empty()).map(SecretString::from),
        }
    }

    /// The keys from loaded secrets (`QSTASH_CURRENT_SIGNING_KEY` required, `QSTASH_NEXT_SIGNING_KEY` optional
    /// here; the functions require both at startup).
    pub fn from_secrets(secrets: &Secrets) -> Result<Self, ConfigError> {
        Ok(SigningKeys {
            current: secrets.get(SecretField::CurrentSigningKey)?.clone(),
            next: secrets.get(SecretField::NextSigningKey).ok().cloned(),
        })
    }

    fn same_as(&self, other: &SigningKeys) -> bool {
        let eq = |a: &SecretString, b: &SecretString| -> bool {
            bool::from(
                a.expose_secret()
                    .as_bytes()
                    .ct_eq(b.expose_secret().as_bytes()),
            )
        };
        eq(&self.current, &other.current)
            && match (&self.next, &other.next) {
                (Some(a), Some(b)) => eq(a, b),
                (None, None) => true,
                _ => false,
            }
    }
}

/// Verification settings.
#[derive(Debug, Clone, Copy)]
pub struct VerifyOptions {
    /// "Now", unix seconds.
    pub now: i64,
    /// Clock tolerance in seconds applied to `exp` and `nbf` (default 0, as the official receivers).
    pub clock_tolerance_secs: i64,
}

/// The clock used for `exp`/`nbf`: the system clock, or a fixed instant (tests, known-answer vectors).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Clock {
    /// `SystemTime::now()`.
    #[default]
    System,
    /// A fixed unix time in seconds.
    Fixed(i64),
}

impl Clock {
    /// Now, in unix seconds.
    pub fn now(self) -> i64 {
        match self {
            Clock::System => SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_secs() as i64)
                .unwrap_or(0),
            Clock::Fixed(t) => t,
        }
    }
}

/// base64url(SHA-256(body)) without padding.
pub fn body_hash(body: &[u8]) -> String {
    B64URL.encode(Sha256::digest(body))
}

fn ct_eq_str(a: &str, b: &str) -> bool {
    bool::from(a.as_bytes().ct_eq(b.as_bytes()))
}

fn hmac_tag(key: &SecretString, signing_input: &[u8]) -> [u8; 32] {
    // HMAC accepts keys of any length, so this cannot fail.
    let mut mac = <HmacSha256 as Mac>::new_from_slice(key.expose_secret().as_bytes())
        .unwrap_or_else(|_| unreachable!("HMAC takes keys of any length"));
    mac.update(signing_input);
    mac.finalize().into_bytes().into()
}

fn claim_i64(map: &Map<String, Value>, claim: &'static str) -> Result<Option<i64>, VerifyError> {
    match map.get(claim) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) => {
            if let Some(i) = n.as_i64() {
                Ok(Some(i))
            } else if let Some(f) = n.as_f64().filter(|f| f.is_finite()) {
                // NumericDate may carry a fraction; saturating cast is fine for any sane value.
                Ok(Some(f.floor() as i64))
            } else {
                Err(VerifyError::Claim {
                    claim,
                    problem: "is not a valid number",
                })
            }
        }
        Some(_) => Err(VerifyError::Claim {
            claim,
            problem: "is not a number",
        }),
    }
}

fn claim_str<'m>(
    map: &'m Map<String, Value>,
    claim: &'static str,
) -> Result<Option<&'m str>, VerifyError> {
    match map.get(claim) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.as_str())),
        Some(_) => Err(VerifyError::Claim {
            claim,
            problem: "is not a string",
        }),
    }
}

fn truncated(s: &str, max: usize) -> String {
    if s.len() <= max {
        s.to_owned()
    } else {
        let mut end = max;
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        format!("{}…", &s[..end])
    }
}

/// Verifies a QStash token against the raw body and the URL the request was sent to. Pure: no I/O.
pub fn verify(
    token: &str,
    body: &[u8],
    url: &str,
    keys: &SigningKeys,
    opts: VerifyOptions,
) -> Result<Claims, VerifyError> {
    let token = token.trim();
    if token.is_empty() {
        return Err(VerifyError::MissingHeader);
    }
    if token.len() > MAX_TOKEN_BYTES {
        return Err(VerifyError::Malformed(format!(
            "token is {} bytes, more than {MAX_TOKEN_BYTES}",
            token.len()
        )));
    }
    let mut parts = token.split('.');
    let (Some(h64), Some(p64), Some(s64), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(VerifyError::Malformed(
            "expected three dot-separated base64url segments".into(),
        ));
    };

    // 1–2. Header: only HS256.
    let header = B64URL
        .decode(h64)
        .map_err(|_| VerifyError::Malformed("header is not base64url".into()))?;
    let header: Map<String, Value> = serde_json::from_slice(&header)
        .map_err(|_| VerifyError::Malformed("header is not a JSON object".into()))?;
    match header.get("alg") {
        Some(Value::String(alg)) if alg == "HS256" => {}
        Some(Value::String(alg)) => return Err(VerifyError::Algorithm(truncated(alg, 20))),
        _ => return Err(VerifyError::Algorithm("(missing)".into())),
    }

    // 3. Signature under the current key, else the next key (constant-time compares).
    let sig = B64URL
        .decode(s64)
        .map_err(|_| VerifyError::Malformed("signature is not base64url".into()))?;
    if sig.len() != 32 {
        return Err(VerifyError::Malformed(format!(
            "signature is {} bytes, HS256 needs 32",
            sig.len()
        )));
    }
    let signing_input = &token.as_bytes()[..h64.len() + 1 + p64.len()];
    let key = if bool::from(hmac_tag(&keys.current, signing_input).ct_eq(&sig[..])) {
        KeyUsed::Current
    } else if keys
        .next
        .as_ref()
        .is_some_and(|next| bool::from(hmac_tag(next, signing_input).ct_eq(&sig[..])))
    {
        KeyUsed::Next
    } else {
        return Err(VerifyError::Signature);
    };

    // 4–8. Claims (only parsed once the signature holds).
    let payload = B64URL
        .decode(p64)
        .map_err(|_| VerifyError::Malformed("payload is not base64url".into()))?;
    let claims: Map<String, Value> = serde_json::from_slice(&payload)
        .map_err(|_| VerifyError::Malformed("payload is not a JSON object".into()))?;

    let iss = claim_str(&claims, "iss")?.ok_or(VerifyError::Claim {
        claim: "iss",
        problem: "is missing",
    })?;
    if iss != ISSUER {
        return Err(VerifyError::Issuer(truncated(iss, 40)));
    }
    let tolerance = opts.clock_tolerance_secs.max(0);
    let now = opts.now;
    let exp = claim_i64(&claims, "exp")?.ok_or(VerifyError::Claim {
        claim: "exp",
        problem: "is missing",
    })?;
    if exp <= now.saturating_sub(tolerance) {
        return Err(VerifyError::Expired {
            exp,
            now,
            tolerance,
        });
    }
    let nbf = claim_i64(&claims, "nbf")?;
    if let Some(nbf) = nbf
        && nbf > now.saturating_add(tolerance)
    {
        return Err(VerifyError::NotYetValid {
            nbf,
            now,
            tolerance,
        });
    }
    let iat = claim_i64(&claims, "iat")?;
    let sub = claim_str(&claims, "sub")?.ok_or(VerifyError::Claim {
        claim: "sub",
        problem: "is missing",
    })?;
    if !ct_eq_str(sub, url) {
        return Err(VerifyError::Subject {
            got: truncated(sub, 300),
            want: truncated(url, 300),
        });
    }
    let body_claim = claim_str(&claims, "body")?.ok_or(VerifyError::Claim {
        claim: "body",
        problem: "is missing",
    })?;
    let computed = body_hash(body);
    if !ct_eq_str(body_claim.trim_end_matches('='), &computed) {
        return Err(VerifyError::BodyHash);
    }
    Ok(Claims {
        iss: iss.to_owned(),
        sub: sub.to_owned(),
        exp,
        nbf,
        iat,
        jti: claim_str(&claims, "jti")?.map(str::to_owned),
        body: body_claim.to_owned(),
        key,
    })
}

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
/// with. Never configure them in a deployment.
pub const DEV_SIGNING_KEYS: (&str, &str) = (
    "sig_7kYjw48mhY7kAjqNGcy6cr29RJ6r",
    "sig_5ZB6DVzB1wjE8S6rZ7eenA8Pdnhs",
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

/// The signing keys of a running function, re-read from the secret when a token matches neither key (QStash
/// rotated them), at most once per refresh interval, so a key rotation needs no redeploy.
pub struct KeyRing {
    keys: RwLock<Arc<SigningKeys>>,
    source: Option<SecretSource>,
    refresh_interval: Duration,
    last_refresh: tokio::sync::Mutex<Option<Instant>>,
}

impl std::fmt::Debug for KeyRing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KeyRing")
            .field("source", &self.source)
            .field("refresh_interval", &self.refresh_interval)
            .finish_non_exhaustive()
    }
}

/// The secret fields a receiver needs.
pub const RECEIVER_SECRETS: [SecretField; 3] = [
    SecretField::DatabaseUrl,
    SecretField::CurrentSigningKey,
    SecretField::NextSigningKey,
];

impl KeyRing {
    /// Fixed keys, never re-read.
    pub fn fixed(keys: SigningKeys) -> Self {
        KeyRing {
            keys: RwLock::new(Arc::new(keys)),
            source: None,
            refresh_interval: Duration::MAX,
            last_refresh: tokio::sync::Mutex::new(None),
        }
    }

    /// Keys already read from `source` (at startup): that read counts as the last refresh, so the next one
    /// happens at the earliest `refresh_interval` later.
    pub fn loaded(keys: SigningKeys, source: SecretSource, refresh_interval: Duration) -> Self {
        KeyRing {
            keys: RwLock::new(Arc::new(keys)),
            source: Some(source),
            refresh_interval,
            last_refresh: tokio::sync::Mutex::new(Some(Instant::now())),
        }
    }

    /// Keys from somewhere else, refreshable from `source` (the first refresh may happen at once).
    pub fn refreshable(
        keys: SigningKeys,
        source: SecretSource,
        refresh_interval: Duration,
    ) -> Self {
        KeyRing {
            keys: RwLock::new(Arc::new(keys)),
            source: Some(source),
            refresh_interval,
            last_refresh: tokio::sync::Mutex::new(None),
        }
    }

    /// The keys in use.
    pub fn keys(&self) -> Arc<SigningKeys> {
        match self.keys.read() {
            Ok(k) => Arc::clone(&k),
            Err(poisoned) => Arc::clone(&poisoned.into_inner()),
        }
    }

    /// [`verify`] with these keys; when neither key matches, re-reads the secret (rate-limited) and retries once.
    pub async fn verify(
        &self,
        token: &str,
        body: &[u8],
        url: &str,
        opts: VerifyOptions,
    ) -> Result<Claims, VerifyError> {
        let keys = self.keys();
        match verify(token, body, url, &keys, opts) {
            Err(VerifyError::Signature) if self.source.is_some() => {
                match self.refresh_after_failure(&keys).await {
                    Some(fresh) => verify(token, body, url, &fresh, opts),
                    None => Err(VerifyError::Signature),
                }
            }
            other => other,
        }
    }

    /// Re-reads the keys unless that happened less than the refresh interval ago. Returns keys worth trying:
    /// new ones (from this call or a concurrent one), or `None`.
    async fn refresh_after_failure(&self, tried: &Arc<SigningKeys>) -> Option<Arc<SigningKeys>> {
        let source = self.source.as_ref()?;
        let mut last = self.last_refresh.lock().await;
        let current = self.keys();
        if !Arc::ptr_eq(&current, tried) {
            return Some(current); // another request refreshed while we waited
        }
        if last.is_some_and(|t| t.elapsed() < self.refresh_interval) {
            return None;
        }
        *last = Some(Instant::now());
        let fresh = match source.load(&[SecretField::CurrentSigningKey]).await {
            Ok(secrets) => match SigningKeys::from_secrets(&secrets) {
                Ok(k) => k,
                Err(e) => {
                    tracing::warn!(error = %e, "signing keys could not be re-read");
                    return None;
                }
            },
            Err(e) => {
                tracing::warn!(error = %e, "signing keys could not be re-read");
                return None;
            }
        };
        if fresh.same_as(&current) {
            tracing::info!("signing keys re-read after a signature mismatch: unchanged");
            return None;
        }
        tracing::info!("signing keys re-read after a signature mismatch: new keys in use");
        let fresh = Arc::new(fresh);
        match self.keys.write() {
            Ok(mut k) => *k = Arc::clone(&fresh),
            Err(poisoned) => *poisoned.into_inner() = Arc::clone(&fresh),
        }
        Some(fresh)
    }
}

/// How a receiver learns the URL QStash called (the `sub` it compares).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum UrlSource<'a> {
    /// `PUBLIC_BASE_URL`: that base + the raw path (+ `?` + raw query).
    Public(&'a str),
    /// What AWS sets on a function-URL event: `https://` + `requestContext.domainName` + raw path (+ query).
    /// Client-sent `Host` and `X-Forwarded-*` headers are ignored.
    #[default]
    FunctionUrl,
    /// `TRUST_FORWARDED_HEADERS=true`, for a proxy in front that sets them: `X-Forwarded-Proto` (default
    /// `https`) `://` `X-Forwarded-Host`, else `Host`, else the function URL's domain name.
    Forwarded,
}

impl<'a> UrlSource<'a> {
    /// The source for a receiver's settings.
    pub fn from_config(public_base_url: Option<&'a str>, trust_forwarded_headers: bool) -> Self {
        match (public_base_url, trust_forwarded_headers) {
            (Some(base), _) => UrlSource::Public(base),
            (None, true) => UrlSource::Forwarded,
            (None, false) => UrlSource::FunctionUrl,
        }
    }
}

/// The URL QStash called, for the `sub` check (decision record 0021), from `source` ([`UrlSource`]).
///
/// The raw path is the function URL's `rawPath` (`RequestExt::raw_http_path`), falling back to the URI path for
/// requests built without it (local adapters); the query is `rawQueryString` verbatim (lambda_http appends it
/// unchanged to the URI). Without a function-URL context (a request not built from a Lambda event), the URI's
/// authority stands in for the domain name.
pub fn request_url<B>(req: &http::Request<B>, source: UrlSource<'_>) -> String {
    let raw_path = req.raw_http_path();
    let path = if raw_path.is_empty() {
        req.uri().path()
    } else {
        raw_path
    };
    let context_host = || -> Option<&str> {
        match req.request_context_ref() {
            Some(lambda_http::request::RequestContext::ApiGatewayV2(c)) => c.domain_name.as_deref(),
            Some(_) => None,
            None => req.uri().authority().map(|a| a.as_str()),
        }
    };
    let header = |name: &str| {
        req.headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.split(',').next())
            .map(str::trim)
            .filter(|v| !v.is_empty())
    };
    let mut url = match source {
        UrlSource::Public(base) => format!("{}{path}", base.trim_end_matches('/')),
        UrlSource::FunctionUrl => {
            format!("https://{}{path}", context_host().unwrap_or("localhost"))
        }
        UrlSource::Forwarded => {
            let proto = header("x-forwarded-proto").unwrap_or("https");
            let host = header("x-forwarded-host")
                .or_else(|| header("host"))
                .or_else(context_host)
                .unwrap_or("localhost");
            format!("{proto}://{host}{path}")
        }
    };
    if let Some(q) = req.uri().query().filter(|q| !q.is_empty()) {
        url.push('?');
        url.push_str(q);
    }
    url
}

/// Reads the `Upstash-Signature` header of `req` and verifies it against the body and [`request_url`].
pub async fn verify_request(
    keys: &KeyRing,
    req: &lambda_http::Request,
    source: UrlSource<'_>,
    opts: VerifyOptions,
) -> Result<Claims, VerifyError> {
    let token = match req.headers().get(SIGNATURE_HEADER) {
        None => return Err(VerifyError::MissingHeader),
        Some(v) => v.to_str().map_err(|_| {
            VerifyError::Malformed("Upstash-Signature header is not visible ASCII".into())
        })?,
    };
    let url = request_url(req, source);
    keys.verify(token, req.body().as_ref(), &url, opts).await
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY: &str = "sig_7kYjw48mhY7kAjqNGcy6cr29RJ6r";
    const NEXT: &str = "sig_5ZB6DVzB1wjE8S6rZ7eenA8Pdnhs";

    fn opts(now: i64) -> VerifyOptions {
        VerifyOptions {
            now,
            clock_tolerance_secs: 0,
        }
    }

    #[test]
    fn own_signer_round_trips_and_binds_url_and_body() {
        let keys = SigningKeys::new(KEY, Some(NEXT.into()));
        let t = sign(KEY, "https://x.example/events/a", b"{}", 1000, 300);
        let c = verify(&t, b"{}", "https://x.example/events/a", &keys, opts(1100)).unwrap();
        assert_eq!(c.key, KeyUsed::Current);
        assert_eq!(c.nbf, Some(-62_135_596_800));
        assert_eq!(c.body.len(), 44, "QStash pads the body claim");
        assert_eq!(
            verify(&t, b"{ }", "https://x.example/events/a", &keys, opts(1100)),
            Err(VerifyError::BodyHash)
        );
        assert!(matches!(
            verify(&t, b"{}", "https://x.example/events/b", &keys, opts(1100)),
            Err(VerifyError::Subject { .. })
        ));
        assert!(matches!(
            verify(&t, b"{}", "https://x.example/events/a", &keys, opts(1300)),
            Err(VerifyError::Expired { .. })
        ));
        let n = sign(NEXT, "u", b"", 1000, 300);
        assert_eq!(
            verify(&n, b"", "u", &keys, opts(1000)).unwrap().key,
            KeyUsed::Next
        );
    }

    #[test]
    fn errors_never_echo_keys() {
        let keys = SigningKeys::new(KEY, Some(NEXT.into()));
        let t = sign("sig_other", "u", b"", 1000, 300);
        let err = verify(&t, b"", "u", &keys, opts(1000)).unwrap_err();
        let text = format!("{err} {err:?} {keys:?}");
        assert!(!text.contains(KEY) && !text.contains(NEXT), "{text}");
    }

    #[test]
    fn request_url_prefers_the_public_base() {
        let req = http::Request::builder()
            .uri("https://internal.example/events/invoices?a=1&b=x%20y")
            .header("host", "internal.example")
            .header("x-forwarded-host", "proxy.example")
            .header("x-forwarded-proto", "http")
            .body(())
            .unwrap();
        assert_eq!(
            request_url(&req, UrlSource::Public("https://public.example/")),
            "https://public.example/events/invoices?a=1&b=x%20y"
        );
        assert_eq!(
            request_url(&req, UrlSource::Forwarded),
            "http://proxy.example/events/invoices?a=1&b=x%20y"
        );
        // Without the setting that trusts a proxy, forwarded headers are ignored.
        assert_eq!(
            request_url(&req, UrlSource::FunctionUrl),
            "https://internal.example/events/invoices?a=1&b=x%20y"
        );
        let req = http::Request::builder()
            .uri("/failure")
            .header("host", "cb.example")
            .body(())
            .unwrap();
        assert_eq!(
            request_url(&req, UrlSource::Forwarded),
            "https://cb.example/failure"
        );
        assert_eq!(
            request_url(&req, UrlSource::FunctionUrl),
            "https://localhost/failure"
        );
    }
}
