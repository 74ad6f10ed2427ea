//! `Upstash-Signature` tokens: HS256 JWTs laid out byte-for-byte like production QStash's.

use base64::Engine;
use base64::engine::general_purpose::{URL_SAFE, URL_SAFE_NO_PAD};
use hmac::{Hmac, Mac};
use rand::Rng;
use sha2::{Digest, Sha256};

/// The protected header exactly as QStash sends it.
pub const JWT_HEADER: &str = r#"{"alg":"HS256","typ":"JWT"}"#;

/// Go's zero `time.Time` as unix seconds: the `nbf` production QStash sends since September 2024.
pub const GO_ZERO_TIME_UNIX: i64 = -62_135_596_800;

/// Token lifetime (`exp - iat`).
pub const TOKEN_LIFETIME_SECS: i64 = 300;

/// How the `nbf` claim is filled.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NbfMode {
    /// `-62135596800` (Go's zero time), as production QStash sends today.
    #[default]
    GoZero,
    /// `nbf = iat`, as QStash sent before September 2024.
    Now,
}

/// `base64url(SHA-256(body))` **with** `=` padding (the `body` claim).
pub fn body_claim(body: &[u8]) -> String {
    URL_SAFE.encode(Sha256::digest(body))
}

/// Random `jwt_` + 28 alphanumerics.
pub fn new_jti() -> String {
    const ALNUM: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
    let mut rng = rand::rng();
    let mut s = String::with_capacity(32);
    s.push_str("jwt_");
    for _ in 0..28 {
        s.push(ALNUM[rng.random_range(0..ALNUM.len())] as char);
    }
    s
}

/// Encodes a JSON string the way Go's `encoding/json` does by default (HTML-safe: `<`, `>`, `&`, U+2028 and
/// U+2029 escaped), so tokens match production byte-for-byte. Decoded values are identical either way.
fn go_json_string(s: &str) -> String {
    let plain = serde_json::Value::String(s.to_owned()).to_string();
    if !plain.contains(['<', '>', '&', '\u{2028}', '\u{2029}']) {
        return plain;
    }
    let mut out = String::with_capacity(plain.len() + 16);
    for c in plain.chars() {
        match c {
            '<' => out.push_str("\\u003c"),
            '>' => out.push_str("\\u003e"),
            '&' => out.push_str("\\u0026"),
            '\u{2028}' => out.push_str("\\u2028"),
            '\u{2029}' => out.push_str("\\u2029"),
            c => out.push(c),
        }
    }
    out
}

/// Builds the claims JSON, keys in alphabetical order like production.
pub fn claims_json(sub: &str, body: &[u8], iat: i64, jti: &str, nbf: NbfMode) -> String {
    let nbf = match nbf {
        NbfMode::GoZero => GO_ZERO_TIME_UNIX,
        NbfMode::Now => iat,
    };
    format!(
        r#"{{"aud":"","body":"{}","exp":{},"iat":{},"iss":"Upstash","jti":"{}","nbf":{},"sub":{}}}"#,
        body_claim(body),
        iat + TOKEN_LIFETIME_SECS,
        iat,
        jti,
        nbf,
        go_json_string(sub)
    )
}

/// Signs a compact HS256 JWS over `claims` with the key string's UTF-8 bytes.
pub fn sign_claims(key: &str, claims: &str) -> String {
    let mut token = String::with_capacity(64 + claims.len() * 4 / 3 + 48);
    URL_SAFE_NO_PAD.encode_string(JWT_HEADER.as_bytes(), &mut token);
    token.push('.');
    URL_SAFE_NO_PAD.encode_string(claims.as_bytes(), &mut token);
    // An HMAC key may have any length, so this cannot fail.
    let mut mac = match Hmac::<Sha256>::new_from_slice(key.as_bytes()) {
        Ok(m) => m,
        Err(_) => unreachable_hmac(),
    };
    mac.update(token.as_bytes());
    let sig = mac.finalize().into_bytes();
    token.push('.');
    URL_SAFE_NO_PAD.encode_string(sig, &mut token);
    token
}

#[cold]
fn unreachable_hmac() -> ! {
    // HMAC accepts keys of any length; `new_from_slice` only errors for fixed-key-size MACs.
    panic!("HMAC-SHA256 rejected a key, which it never does")
}

/// A fresh `Upstash-Signature` for a request to `sub` carrying `body`, issued at `iat` (unix seconds).
pub fn sign(key: &str, sub: &str, body: &[u8], iat: i64, nbf: NbfMode) -> String {
    sign_claims(key, &claims_json(sub, body, iat, &new_jti(), nbf))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_answer_vector_from_qstash_dart() {
        // Token from rebaz94/qstash_dart test/receiver_test.dart (its first vector), nbf = iat.
        let want = "eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9.eyJhdWQiOiIiLCJib2R5IjoicFpHbTFBdjBJRUJLQVJjeno3ZXhrTllzWmI4THphTXJWN0ozMmEyZkZHND0iLCJleHAiOjE2NjU2MTUwMzgsImlhdCI6MTY2NTYxNDczOCwiaXNzIjoiVXBzdGFzaCIsImp0aSI6Imp3dF82ZDRCUXd6RzRDb0hadGU4VkNoSk54SnVuMTVDIiwibmJmIjoxNjY1NjE0NzM4LCJzdWIiOiJodHRwczovL3JlYmF6LXFzdGFzaC5yZXF1ZXN0Y2F0Y2hlci5jb20vdGVzdCJ9.y0_9NlMBUmO9dlPxG0PlnyekjfO88oIKfgmJfcoYo8k";
        let claims = claims_json(
            "https://rebaz-qstash.requestcatcher.com/test",
            b"Hello World",
            1_665_614_738,
            "jwt_6d4BQwzG4CoHZte8VChJNxJun15C",
            NbfMode::Now,
        );
        assert_eq!(
            sign_claims("sig_7dskHhQGd7zBn4pUmfcuuhoVv8dV", &claims),
            want
        );
    }

    #[test]
    fn known_answer_vector_from_qstash_php() {
        let want = "eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9.eyJhdWQiOiIiLCJib2R5IjoiLVcyTk4xZnZNaGFxLVhlT0JJcXE4SUE4ajdMSlhxTDhaY1NDMXJoRE1CVT0iLCJleHAiOjE3MjEwNjkxNTEsImlhdCI6MTcyMTA2ODg1MSwiaXNzIjoiVXBzdGFzaCIsImp0aSI6Imp3dF82Y2tnQTdSUW5qNngzWE1LU25mVWI4YXRUc1pQIiwibmJmIjoxNzIxMDY4ODUxLCJzdWIiOiJodHRwczovL3dlYmhvb2suc2l0ZS83N2FlODk4OC1lZWNmLTRhMDEtOWE3Ni0yYTM3MjEyYzc1YTgifQ.ppulAF6fmnYfeVdR72HprfzLSIN_6KX65JOXwdxRMyk";
        let claims = claims_json(
            "https://webhook.site/77ae8988-eecf-4a01-9a76-2a37212c75a8",
            br#"{"message":"hello world"}"#,
            1_721_068_851,
            "jwt_6ckgA7RQnj6x3XMKSnfUb8atTsZP",
            NbfMode::Now,
        );
        // This token's exp is iat + 300 as well.
        assert_eq!(
            sign_claims("sig_561zQH6V9b96E63sS3b9wvGXosi7", &claims),
            want
        );
    }

    #[test]
    fn empty_body_claim_and_go_escaping() {
        assert_eq!(
            body_claim(b""),
            "47DEQpj8HBSa-_TImW-5JCeuQeRkm5NMpJWZG3hSuFU="
        );
        assert_eq!(
            go_json_string("http://a/?x=1&y=<2>"),
            r#""http://a/?x=1\u0026y=\u003c2\u003e""#
        );
        let jti = new_jti();
        assert_eq!(jti.len(), 32);
        assert!(jti[4..].bytes().all(|b| b.is_ascii_alphanumeric()));
    }
}
