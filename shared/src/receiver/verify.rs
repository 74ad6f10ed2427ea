//! The token check itself: [`verify`] runs checks 1–8 of the module table on a token, a body and a URL. Pure: no
//! I/O, the clock injected ([`Clock`]).

use std::time::{SystemTime, UNIX_EPOCH};

use base64::Engine;
use hmac::{Hmac, Mac};
use secrecy::{ExposeSecret, SecretString};
use serde_json::{Map, Value};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use super::signing_keys::SigningKeys;
use super::token::{B64URL, ISSUER, MAX_TOKEN_BYTES};

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
        exp: i64,
        /// The verifier's clock.
        now: i64,
        /// The tolerance applied.
        tolerance: i64,
    },
    /// `nbf` is in the future.
    #[error("token not valid before {nbf} (now {now}, clock tolerance {tolerance} s)")]
    NotYetValid {
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

pub(super) fn hmac_tag(key: &SecretString, signing_input: &[u8]) -> [u8; 32] {
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
    // 1–2. Three segments; the header: only HS256.
    let segments = Segments::split(token)?;
    check_header(segments.header)?;
    // 3. Signature under the current key, else the next key (constant-time compares).
    let key = check_signature(&segments, keys)?;
    // 4–8. Claims (only parsed once the signature holds).
    let claims = decode_claims(segments.payload)?;
    let iss = check_issuer(&claims)?;
    let (exp, nbf) = check_validity(&claims, opts)?;
    let iat = claim_i64(&claims, "iat")?;
    let sub = check_subject(&claims, url)?;
    let body_claim = check_body(&claims, body)?;
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

/// The three base64url segments of a compact JWS, and the bytes its signature covers.
struct Segments<'t> {
    header: &'t str,
    payload: &'t str,
    signature: &'t str,
    /// `header.payload`, as sent.
    signing_input: &'t [u8],
}

impl<'t> Segments<'t> {
    /// Check 1: splits a token (trimmed; not empty, at most [`MAX_TOKEN_BYTES`]) into its three segments.
    fn split(token: &'t str) -> Result<Self, VerifyError> {
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
        let (Some(header), Some(payload), Some(signature), None) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return Err(VerifyError::Malformed(
                "expected three dot-separated base64url segments".into(),
            ));
        };
        Ok(Segments {
            header,
            payload,
            signature,
            signing_input: &token.as_bytes()[..header.len() + 1 + payload.len()],
        })
    }
}

/// Check 2: the header is a JSON object whose `alg` is HS256.
fn check_header(h64: &str) -> Result<(), VerifyError> {
    let header = B64URL
        .decode(h64)
        .map_err(|_| VerifyError::Malformed("header is not base64url".into()))?;
    let header: Map<String, Value> = serde_json::from_slice(&header)
        .map_err(|_| VerifyError::Malformed("header is not a JSON object".into()))?;
    match header.get("alg") {
        Some(Value::String(alg)) if alg == "HS256" => Ok(()),
        Some(Value::String(alg)) => Err(VerifyError::Algorithm(truncated(alg, 20))),
        _ => Err(VerifyError::Algorithm("(missing)".into())),
    }
}

/// Check 3: which key's HMAC the signature is, the current key's or else the next key's (constant-time compares).
fn check_signature(segments: &Segments<'_>, keys: &SigningKeys) -> Result<KeyUsed, VerifyError> {
    let sig = B64URL
        .decode(segments.signature)
        .map_err(|_| VerifyError::Malformed("signature is not base64url".into()))?;
    if sig.len() != 32 {
        return Err(VerifyError::Malformed(format!(
            "signature is {} bytes, HS256 needs 32",
            sig.len()
        )));
    }
    let signing_input = segments.signing_input;
    if bool::from(hmac_tag(&keys.current, signing_input).ct_eq(&sig[..])) {
        Ok(KeyUsed::Current)
    } else if keys
        .next
        .as_ref()
        .is_some_and(|next| bool::from(hmac_tag(next, signing_input).ct_eq(&sig[..])))
    {
        Ok(KeyUsed::Next)
    } else {
        Err(VerifyError::Signature)
    }
}

/// The payload's claims: a JSON object.
fn decode_claims(p64: &str) -> Result<Map<String, Value>, VerifyError> {
    let payload = B64URL
        .decode(p64)
        .map_err(|_| VerifyError::Malformed("payload is not base64url".into()))?;
    serde_json::from_slice(&payload)
        .map_err(|_| VerifyError::Malformed("payload is not a JSON object".into()))
}

/// The error of a required claim that is absent.
fn missing(claim: &'static str) -> VerifyError {
    VerifyError::Claim {
        claim,
        problem: "is missing",
    }
}

/// Check 4: `iss` is `Upstash`.
fn check_issuer(claims: &Map<String, Value>) -> Result<&str, VerifyError> {
    let iss = claim_str(claims, "iss")?.ok_or(missing("iss"))?;
    if iss != ISSUER {
        return Err(VerifyError::Issuer(truncated(iss, 40)));
    }
    Ok(iss)
}

/// Checks 5–6: `exp` has not passed and `nbf` (if any) has come, within the clock tolerance; `(exp, nbf)`.
fn check_validity(
    claims: &Map<String, Value>,
    opts: VerifyOptions,
) -> Result<(i64, Option<i64>), VerifyError> {
    let tolerance = opts.clock_tolerance_secs.max(0);
    let now = opts.now;
    let exp = claim_i64(claims, "exp")?.ok_or(missing("exp"))?;
    if exp <= now.saturating_sub(tolerance) {
        return Err(VerifyError::Expired {
            exp,
            now,
            tolerance,
        });
    }
    let nbf = claim_i64(claims, "nbf")?;
    if let Some(nbf) = nbf
        && nbf > now.saturating_add(tolerance)
    {
        return Err(VerifyError::NotYetValid {
            nbf,
            now,
            tolerance,
        });
    }
    Ok((exp, nbf))
}

/// Check 7: `sub` is the URL this request was sent to.
fn check_subject<'c>(claims: &'c Map<String, Value>, url: &str) -> Result<&'c str, VerifyError> {
    let sub = claim_str(claims, "sub")?.ok_or(missing("sub"))?;
    if !ct_eq_str(sub, url) {
        return Err(VerifyError::Subject {
            got: truncated(sub, 300),
            want: truncated(url, 300),
        });
    }
    Ok(sub)
}

/// Check 8: the `body` claim is the body's hash (padded or not).
fn check_body<'c>(claims: &'c Map<String, Value>, body: &[u8]) -> Result<&'c str, VerifyError> {
    let body_claim = claim_str(claims, "body")?.ok_or(missing("body"))?;
    let computed = body_hash(body);
    if !ct_eq_str(body_claim.trim_end_matches('='), &computed) {
        return Err(VerifyError::BodyHash);
    }
    Ok(body_claim)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::receiver::sign;

    const KEY: &str = crate::secrets::DEV_CURRENT_SIGNING_KEY;
    const NEXT: &str = crate::secrets::DEV_NEXT_SIGNING_KEY;

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
}
