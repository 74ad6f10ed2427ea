//! The `Upstash-Signature` corpus, driven through the real consumer handler on real Postgres: each case is a
//! function-URL request; accepted ones must be applied (200 "processed"), refused ones must answer 401 naming
//! the failed check and leave the database untouched. Tokens come from the independent signer in `outbox_testkit::receiving`.
//! Plus the real QStash tokens (known-answer vectors) and key rotation. Deliveries are in the signed wire
//! contract: an envelope body POSTed to `/events/audit?contract=2`, so `sub` carries the query.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use base64::Engine;
use base64::engine::general_purpose::{STANDARD, URL_SAFE_NO_PAD};
use lambda_http::Request;
use outbox::config::{ConsumerConfig, EnvSource};
use outbox::consumer::{ConsumerState, handle_event};
use outbox::db::{Db, Statements};
use outbox::internals::receiver::{
    Clock, KeyRing, KeyUsed, SigningKeys, UrlSource, VerifyError, VerifyOptions, request_url,
    verify,
};
use outbox::internals::secrets::SecretSource;
use outbox_testkit::receiving::*;
use serde_json::{Value, json};
use sqlx::PgPool;

const TOPIC: &str = "audit";
const PATH: &str = "/events/audit";

/// The URL QStash signs for an audit delivery: the test host, the path and the contract query.
fn sub() -> String {
    url_with_query(PATH, CONTRACT_QUERY)
}

#[derive(Debug, Clone, PartialEq)]
enum Want {
    /// Verified and applied.
    Applied,
    /// 401 with this `check`.
    Rejected(&'static str),
    /// Another status (the signature held or was never looked at).
    Status(u16),
}

struct Case {
    name: &'static str,
    req: Request,
    want: Want,
    config: Option<ConsumerConfig>,
}

fn audit_payload(n: i64) -> String {
    format!(r#"{{"actor":"user-{n}","action":"login","details":{{"n":{n}}}}}"#)
}

/// The envelope of audit event `n`.
fn audit_body(n: i64) -> Vec<u8> {
    Delivery::new(TOPIC, n, audit_payload(n).as_bytes())
        .key(&format!("user-{n}"))
        .body()
}

/// A delivery of audit event `id` with the given signature header(s) and body.
fn delivery(id: i64, body: &[u8], headers: &[(&str, &str)]) -> Request {
    delivery_to(PATH, CONTRACT_QUERY, id, body, headers)
}

fn delivery_to(path: &str, query: &str, id: i64, body: &[u8], headers: &[(&str, &str)]) -> Request {
    let id = id.to_string();
    let mut h: Vec<(&str, &str)> = vec![("x-outbox-id", &id), ("upstash-message-id", "msg_corpus")];
    h.extend_from_slice(headers);
    post_with_headers(path, query, &h, body)
}

fn claims_for(id: i64) -> (Vec<u8>, Value) {
    let body = audit_body(id);
    let c = claims(&sub(), &body);
    (body, c)
}

fn with(mut c: Value, key: &str, v: Value) -> Value {
    c[key] = v;
    c
}

fn without(mut c: Value, key: &str) -> Value {
    c.as_object_mut().unwrap().remove(key);
    c
}

/// A body whose base64url SHA-256 contains `-` or `_`, so standard base64 differs from base64url.
fn body_with_url_specific_hash(start: i64) -> (i64, Vec<u8>) {
    (start..start + 1000)
        .map(|n| (n, audit_body(n)))
        .find(|(_, b)| {
            let h = body_claim(b, false);
            h.contains('-') || h.contains('_')
        })
        .expect("some hash has - or _")
}

fn corpus() -> Vec<Case> {
    let mut cases = Vec::new();
    let mut id = 1000;
    let mut next = || {
        id += 1;
        id
    };
    let mut push = |name: &'static str, req: Request, want: Want| {
        cases.push(Case {
            name,
            req,
            want,
            config: None,
        })
    };

    // --- accepted ---
    let i = next();
    let (b, c) = claims_for(i);
    push(
        "valid token, current key",
        delivery(i, &b, &[("upstash-signature", &token_with(KEY, &c))]),
        Want::Applied,
    );
    let i = next();
    let (b, c) = claims_for(i);
    push(
        "valid token, next key",
        delivery(i, &b, &[("upstash-signature", &token_with(NEXT, &c))]),
        Want::Applied,
    );
    let i = next();
    let (b, c) = claims_for(i);
    push(
        "negative nbf (Go zero time, what QStash sends)",
        delivery(
            i,
            &b,
            &[(
                "upstash-signature",
                &token_with(KEY, &with(c, "nbf", json!(GO_ZERO_NBF))),
            )],
        ),
        Want::Applied,
    );
    let i = next();
    let (b, c) = claims_for(i);
    push(
        "nbf = iat = now (pre-2024 tokens)",
        delivery(
            i,
            &b,
            &[(
                "upstash-signature",
                &token_with(KEY, &with(c, "nbf", json!(NOW))),
            )],
        ),
        Want::Applied,
    );
    let i = next();
    let (b, c) = claims_for(i);
    push(
        "no nbf at all",
        delivery(
            i,
            &b,
            &[("upstash-signature", &token_with(KEY, &without(c, "nbf")))],
        ),
        Want::Applied,
    );
    let i = next();
    let (b, c) = claims_for(i);
    push(
        "exp one second ahead",
        delivery(
            i,
            &b,
            &[(
                "upstash-signature",
                &token_with(KEY, &with(c, "exp", json!(NOW + 1))),
            )],
        ),
        Want::Applied,
    );
    let i = next();
    let (b, c) = claims_for(i);
    push(
        "padded body claim (QStash's form)",
        delivery(
            i,
            &b,
            &[(
                "upstash-signature",
                &token_with(KEY, &with(c, "body", json!(body_claim(&b, true)))),
            )],
        ),
        Want::Applied,
    );
    let i = next();
    let (b, c) = claims_for(i);
    push(
        "unpadded body claim",
        delivery(
            i,
            &b,
            &[(
                "upstash-signature",
                &token_with(KEY, &with(c, "body", json!(body_claim(&b, false)))),
            )],
        ),
        Want::Applied,
    );
    let i = next();
    let (b, _) = claims_for(i);
    push(
        "header name in upper case",
        delivery(i, &b, &[("UPSTASH-SIGNATURE", &token(KEY, &sub(), &b))]),
        Want::Applied,
    );
    let i = next();
    let (b, _) = claims_for(i);
    push(
        "header name in mixed case",
        delivery(i, &b, &[("Upstash-Signature", &token(KEY, &sub(), &b))]),
        Want::Applied,
    );
    let i = next();
    let (b, c) = claims_for(i);
    push(
        "header without typ",
        delivery(
            i,
            &b,
            &[(
                "upstash-signature",
                &jws(KEY.as_bytes(), r#"{"alg":"HS256"}"#, &c.to_string()),
            )],
        ),
        Want::Applied,
    );
    let i = next();
    let (b, c) = claims_for(i);
    push(
        "non-empty aud is ignored",
        delivery(
            i,
            &b,
            &[(
                "upstash-signature",
                &token_with(KEY, &with(c, "aud", json!("someone"))),
            )],
        ),
        Want::Applied,
    );
    let i = next();
    let (b, c) = claims_for(i);
    push(
        "fractional exp",
        delivery(
            i,
            &b,
            &[(
                "upstash-signature",
                &token_with(KEY, &with(c, "exp", json!(NOW as f64 + 10.5))),
            )],
        ),
        Want::Applied,
    );
    let i = next();
    let b = audit_body(i);
    let q_url = url_with_query(PATH, "tenant=a%20b&contract=2&x=1");
    push(
        "raw query string is part of sub",
        delivery_to(
            PATH,
            "tenant=a%20b&contract=2&x=1",
            i,
            &b,
            &[("upstash-signature", &token(KEY, &q_url, &b))],
        ),
        Want::Applied,
    );

    // --- refused: the header ---
    let i = next();
    push(
        "missing header",
        delivery(i, &audit_body(i), &[]),
        Want::Rejected("missing_header"),
    );
    let i = next();
    push(
        "empty header",
        delivery(i, &audit_body(i), &[("upstash-signature", "")]),
        Want::Rejected("missing_header"),
    );
    let i = next();
    push(
        "not a JWS",
        delivery(i, &audit_body(i), &[("upstash-signature", "hello")]),
        Want::Rejected("malformed"),
    );
    let i = next();
    let (b, _) = claims_for(i);
    let t = token(KEY, &sub(), &b);
    push(
        "four segments",
        delivery(i, &b, &[("upstash-signature", &format!("{t}.AAAA"))]),
        Want::Rejected("malformed"),
    );
    let i = next();
    push(
        "header segment not base64url",
        delivery(i, &audit_body(i), &[("upstash-signature", "e30!.e30.AAAA")]),
        Want::Rejected("malformed"),
    );
    let i = next();
    let (b, c) = claims_for(i);
    push(
        "header segment not JSON",
        delivery(
            i,
            &b,
            &[(
                "upstash-signature",
                &jws(KEY.as_bytes(), "not json", &c.to_string()),
            )],
        ),
        Want::Rejected("malformed"),
    );
    let i = next();
    let (b, c) = claims_for(i);
    let none_token = format!(
        "{}.{}.",
        URL_SAFE_NO_PAD.encode(r#"{"alg":"none","typ":"JWT"}"#),
        URL_SAFE_NO_PAD.encode(c.to_string())
    );
    push(
        "alg none, empty signature",
        delivery(i, &b, &[("upstash-signature", &none_token)]),
        Want::Rejected("algorithm"),
    );
    let i = next();
    let (b, c) = claims_for(i);
    push(
        "alg none, HMAC signature anyway",
        delivery(
            i,
            &b,
            &[(
                "upstash-signature",
                &jws(
                    KEY.as_bytes(),
                    r#"{"alg":"none","typ":"JWT"}"#,
                    &c.to_string(),
                ),
            )],
        ),
        Want::Rejected("algorithm"),
    );
    let i = next();
    let (b, c) = claims_for(i);
    push(
        "alg HS512",
        delivery(
            i,
            &b,
            &[(
                "upstash-signature",
                &jws(
                    KEY.as_bytes(),
                    r#"{"alg":"HS512","typ":"JWT"}"#,
                    &c.to_string(),
                ),
            )],
        ),
        Want::Rejected("algorithm"),
    );
    let i = next();
    let (b, c) = claims_for(i);
    push(
        "alg missing",
        delivery(
            i,
            &b,
            &[(
                "upstash-signature",
                &jws(KEY.as_bytes(), r#"{"typ":"JWT"}"#, &c.to_string()),
            )],
        ),
        Want::Rejected("algorithm"),
    );
    let i = next();
    let long = format!("{}.{}.{}", "a".repeat(3000), "b".repeat(3000), "c");
    push(
        "oversized token",
        delivery(i, &audit_body(i), &[("upstash-signature", &long)]),
        Want::Rejected("malformed"),
    );

    // --- refused: the key / signature ---
    let i = next();
    let (b, c) = claims_for(i);
    push(
        "wrong key",
        delivery(
            i,
            &b,
            &[(
                "upstash-signature",
                &token_with("sig_notTheRightKeyAtAll0000000", &c),
            )],
        ),
        Want::Rejected("signature"),
    );
    let i = next();
    let (b, c) = claims_for(i);
    let decoded_key = STANDARD
        .decode(KEY.trim_start_matches("sig_").to_owned() + "==")
        .unwrap_or_else(|_| b"decoded".to_vec());
    push(
        "key base64-decoded instead of its string bytes",
        delivery(
            i,
            &b,
            &[(
                "upstash-signature",
                &jws(&decoded_key, HS256_HEADER, &c.to_string()),
            )],
        ),
        Want::Rejected("signature"),
    );
    let i = next();
    let (b, c) = claims_for(i);
    let good = token_with(KEY, &c);
    let (input, sig) = good.rsplit_once('.').unwrap();
    let mut raw = URL_SAFE_NO_PAD.decode(sig).unwrap();
    raw[0] ^= 1;
    push(
        "one signature bit flipped",
        delivery(
            i,
            &b,
            &[(
                "upstash-signature",
                &format!("{input}.{}", URL_SAFE_NO_PAD.encode(&raw)),
            )],
        ),
        Want::Rejected("signature"),
    );
    let i = next();
    let (b, c) = claims_for(i);
    let good = token_with(KEY, &c);
    let (_, sig) = good.rsplit_once('.').unwrap();
    push(
        "signature truncated to 31 bytes",
        delivery(
            i,
            &b,
            &[(
                "upstash-signature",
                &format!(
                    "{}.{}",
                    good.rsplit_once('.').unwrap().0,
                    URL_SAFE_NO_PAD.encode(&URL_SAFE_NO_PAD.decode(sig).unwrap()[..31])
                ),
            )],
        ),
        Want::Rejected("malformed"),
    );
    let i = next();
    let (b, c) = claims_for(i);
    let good = token_with(KEY, &c);
    let parts: Vec<&str> = good.split('.').collect();
    let forged_claims = with(
        c,
        "sub",
        json!(url_with_query("/events/other", CONTRACT_QUERY)),
    );
    push(
        "claims swapped under the original signature",
        delivery(
            i,
            &b,
            &[(
                "upstash-signature",
                &format!(
                    "{}.{}.{}",
                    parts[0],
                    URL_SAFE_NO_PAD.encode(forged_claims.to_string()),
                    parts[2]
                ),
            )],
        ),
        Want::Rejected("signature"),
    );

    // --- refused: time ---
    let i = next();
    let (b, c) = claims_for(i);
    push(
        "expired",
        delivery(
            i,
            &b,
            &[(
                "upstash-signature",
                &token_with(KEY, &with(c, "exp", json!(NOW - 1))),
            )],
        ),
        Want::Rejected("expired"),
    );
    let i = next();
    let (b, c) = claims_for(i);
    push(
        "exp == now (exp is exclusive)",
        delivery(
            i,
            &b,
            &[(
                "upstash-signature",
                &token_with(KEY, &with(c, "exp", json!(NOW))),
            )],
        ),
        Want::Rejected("expired"),
    );
    let i = next();
    let (b, c) = claims_for(i);
    push(
        "nbf in the future",
        delivery(
            i,
            &b,
            &[(
                "upstash-signature",
                &token_with(KEY, &with(c, "nbf", json!(NOW + 10))),
            )],
        ),
        Want::Rejected("not_yet_valid"),
    );
    let i = next();
    let (b, c) = claims_for(i);
    push(
        "no exp",
        delivery(
            i,
            &b,
            &[("upstash-signature", &token_with(KEY, &without(c, "exp")))],
        ),
        Want::Rejected("claim"),
    );
    let i = next();
    let (b, c) = claims_for(i);
    push(
        "exp as a string",
        delivery(
            i,
            &b,
            &[(
                "upstash-signature",
                &token_with(KEY, &with(c, "exp", json!((NOW + 300).to_string()))),
            )],
        ),
        Want::Rejected("claim"),
    );

    // --- refused: issuer ---
    let i = next();
    let (b, c) = claims_for(i);
    push(
        "iss in lower case",
        delivery(
            i,
            &b,
            &[(
                "upstash-signature",
                &token_with(KEY, &with(c, "iss", json!("upstash"))),
            )],
        ),
        Want::Rejected("issuer"),
    );
    let i = next();
    let (b, c) = claims_for(i);
    push(
        "no iss",
        delivery(
            i,
            &b,
            &[("upstash-signature", &token_with(KEY, &without(c, "iss")))],
        ),
        Want::Rejected("claim"),
    );

    // --- refused: subject ---
    let i = next();
    let b = audit_body(i);
    push(
        "sub is another path",
        delivery(
            i,
            &b,
            &[(
                "upstash-signature",
                &token(KEY, &url_with_query("/events/orders", CONTRACT_QUERY), &b),
            )],
        ),
        Want::Rejected("subject"),
    );
    let i = next();
    let b = audit_body(i);
    push(
        "sub with a trailing slash",
        delivery(
            i,
            &b,
            &[(
                "upstash-signature",
                &token(
                    KEY,
                    &url_with_query(&format!("{PATH}/"), CONTRACT_QUERY),
                    &b,
                ),
            )],
        ),
        Want::Rejected("subject"),
    );
    let i = next();
    let b = audit_body(i);
    push(
        "sub host in upper case",
        delivery(
            i,
            &b,
            &[(
                "upstash-signature",
                &token(
                    KEY,
                    &format!("https://{}{PATH}?{CONTRACT_QUERY}", HOST.to_uppercase()),
                    &b,
                ),
            )],
        ),
        Want::Rejected("subject"),
    );
    let i = next();
    let b = audit_body(i);
    push(
        "sub over http while the request came over https",
        delivery(
            i,
            &b,
            &[(
                "upstash-signature",
                &token(KEY, &format!("http://{HOST}{PATH}?{CONTRACT_QUERY}"), &b),
            )],
        ),
        Want::Rejected("subject"),
    );
    let i = next();
    let b = audit_body(i);
    push(
        "sub with a query the request lacks",
        delivery(
            i,
            &b,
            &[(
                "upstash-signature",
                &token(KEY, &url_with_query(PATH, "contract=2&x=1"), &b),
            )],
        ),
        Want::Rejected("subject"),
    );
    let i = next();
    let b = audit_body(i);
    push(
        "sub without the contract query (a token for an old-format URL)",
        delivery(i, &b, &[("upstash-signature", &token(KEY, &url(PATH), &b))]),
        Want::Rejected("subject"),
    );
    let i = next();
    let b = audit_body(i);
    push(
        "token for the failure callback replayed at the consumer",
        delivery(
            i,
            &b,
            &[("upstash-signature", &token(KEY, &url("/failure"), &b))],
        ),
        Want::Rejected("subject"),
    );
    let i = next();
    let (b, c) = claims_for(i);
    push(
        "no sub",
        delivery(
            i,
            &b,
            &[("upstash-signature", &token_with(KEY, &without(c, "sub")))],
        ),
        Want::Rejected("claim"),
    );

    // --- refused: body ---
    let i = next();
    let (b, c) = claims_for(i);
    let mut tampered = b.clone();
    let pos = tampered.iter().position(|&x| x == b'l').unwrap();
    tampered[pos] = b'L';
    push(
        "tampered body",
        delivery(i, &tampered, &[("upstash-signature", &token_with(KEY, &c))]),
        Want::Rejected("body_hash"),
    );
    // A user header decides things in a handler (a tenant): it is inside the signed body, so rewriting it breaks
    // the signature.
    let i = next();
    let with_tenant = Delivery::new(TOPIC, i, audit_payload(i).as_bytes())
        .key(&format!("user-{i}"))
        .header("tenant", "acme");
    let b = with_tenant.body();
    let c = claims(&sub(), &b);
    let forged = String::from_utf8(b.clone())
        .unwrap()
        .replace("\"acme\"", "\"globex\"")
        .into_bytes();
    assert_ne!(forged, b);
    push(
        "envelope user header rewritten (tenant)",
        delivery(i, &forged, &[("upstash-signature", &token_with(KEY, &c))]),
        Want::Rejected("body_hash"),
    );
    let i = next();
    let with_tenant = Delivery::new(TOPIC, i, audit_payload(i).as_bytes())
        .key(&format!("user-{i}"))
        .header("tenant", "acme");
    push(
        "envelope with a user header, untouched",
        with_tenant.request(),
        Want::Applied,
    );
    let i = next();
    let (b, c) = claims_for(i);
    let reserialised =
        serde_json::to_vec_pretty(&serde_json::from_slice::<Value>(&b).unwrap()).unwrap();
    assert_ne!(reserialised, b);
    push(
        "JSON body re-serialised (same value, other bytes)",
        delivery(
            i,
            &reserialised,
            &[("upstash-signature", &token_with(KEY, &c))],
        ),
        Want::Rejected("body_hash"),
    );
    let i = next();
    let (b, c) = claims_for(i);
    push(
        "no body claim",
        delivery(
            i,
            &b,
            &[("upstash-signature", &token_with(KEY, &without(c, "body")))],
        ),
        Want::Rejected("claim"),
    );
    let (i, b) = body_with_url_specific_hash(next() * 1000);
    let c = claims(&sub(), &b);
    let std_hash = STANDARD.encode(<sha2::Sha256 as sha2::Digest>::digest(&b));
    push(
        "body claim in standard base64 instead of base64url",
        delivery(
            i,
            &b,
            &[(
                "upstash-signature",
                &token_with(KEY, &with(c, "body", json!(std_hash))),
            )],
        ),
        Want::Rejected("body_hash"),
    );
    let i = next();
    let (b, c) = claims_for(i);
    push(
        "body claim of an empty body on a non-empty body",
        delivery(
            i,
            &b,
            &[(
                "upstash-signature",
                &token_with(
                    KEY,
                    &with(
                        c,
                        "body",
                        json!("47DEQpj8HBSa-_TImW-5JCeuQeRkm5NMpJWZG3hSuFU="),
                    ),
                ),
            )],
        ),
        Want::Rejected("body_hash"),
    );

    // --- non-UTF-8 bodies: the hash is over raw bytes ---
    let i = next();
    let binary: Vec<u8> = vec![0xff, 0xfe, b'{', 0x80, b'}'];
    push(
        "non-UTF-8 body, correctly signed: verified, then refused as a malformed payload",
        delivery(
            i,
            &binary,
            &[("upstash-signature", &token(KEY, &sub(), &binary))],
        ),
        Want::Status(489),
    );
    let i = next();
    let lossy = String::from_utf8_lossy(&binary).into_owned().into_bytes();
    push(
        "non-UTF-8 body, token over its lossy UTF-8 text",
        delivery(
            i,
            &binary,
            &[("upstash-signature", &token(KEY, &sub(), &lossy))],
        ),
        Want::Rejected("body_hash"),
    );

    // --- body size cap (checked before the signature) ---
    let small_cap = ConsumerConfig {
        max_body_bytes: 1024,
        ..ConsumerConfig::defaults()
    };
    let i = next();
    let padded = |fill: usize| {
        let payload = format!(
            r#"{{"actor":"a","action":"b","details":{{"pad":"{}"}}}}"#,
            "x".repeat(fill)
        );
        Delivery::new(TOPIC, i, payload.as_bytes()).body()
    };
    let big = padded(1024 - padded(0).len());
    assert_eq!(big.len(), 1024);
    cases.push(Case {
        name: "body exactly at the cap",
        req: delivery(i, &big, &[("upstash-signature", &token(KEY, &sub(), &big))]),
        want: Want::Applied,
        config: Some(small_cap.clone()),
    });
    let i = next();
    let over = padded(1024 - padded(0).len() + 1);
    assert_eq!(over.len(), 1025);
    cases.push(Case {
        name: "body one byte over the cap, validly signed",
        req: delivery(
            i,
            &over,
            &[("upstash-signature", &token(KEY, &sub(), &over))],
        ),
        want: Want::Status(413),
        config: Some(small_cap),
    });

    // --- clock tolerance ---
    let tolerant = ConsumerConfig {
        clock_tolerance: Duration::from_secs(60),
        ..ConsumerConfig::defaults()
    };
    let i = next();
    let (b, c) = claims_for(i);
    cases.push(Case {
        name: "expired 30 s ago, tolerance 60 s",
        req: delivery(
            i,
            &b,
            &[(
                "upstash-signature",
                &token_with(KEY, &with(c, "exp", json!(NOW - 30))),
            )],
        ),
        want: Want::Applied,
        config: Some(tolerant.clone()),
    });
    let i = next();
    let (b, c) = claims_for(i);
    cases.push(Case {
        name: "expired 61 s ago, tolerance 60 s",
        req: delivery(
            i,
            &b,
            &[(
                "upstash-signature",
                &token_with(KEY, &with(c, "exp", json!(NOW - 61))),
            )],
        ),
        want: Want::Rejected("expired"),
        config: Some(tolerant.clone()),
    });
    let i = next();
    let (b, c) = claims_for(i);
    cases.push(Case {
        name: "nbf 30 s ahead, tolerance 60 s",
        req: delivery(
            i,
            &b,
            &[(
                "upstash-signature",
                &token_with(KEY, &with(c, "nbf", json!(NOW + 30))),
            )],
        ),
        want: Want::Applied,
        config: Some(tolerant),
    });

    // --- TRUST_FORWARDED_HEADERS: a proxy in front sets X-Forwarded-Host/-Proto ---
    let trusting = ConsumerConfig {
        trust_forwarded_headers: true,
        ..ConsumerConfig::defaults()
    };
    let fwd_url = "http://proxy.example.com/events/audit?contract=2";
    let fwd_headers = |sig: String| -> Vec<(&'static str, String)> {
        vec![
            ("x-forwarded-host", "proxy.example.com".to_owned()),
            ("x-forwarded-proto", "http".to_owned()),
            ("upstash-signature", sig),
        ]
    };
    for (name, config, want) in [
        (
            "x-forwarded-host/-proto ignored by default",
            None,
            Want::Rejected("subject"),
        ),
        (
            "x-forwarded-host/-proto rebuild the URL with TRUST_FORWARDED_HEADERS",
            Some(trusting.clone()),
            Want::Applied,
        ),
    ] {
        let i = next();
        let b = audit_body(i);
        let h = fwd_headers(token(KEY, fwd_url, &b));
        let h: Vec<(&str, &str)> = h.iter().map(|(k, v)| (*k, v.as_str())).collect();
        cases.push(Case {
            name,
            req: delivery(i, &b, &h),
            want,
            config,
        });
    }

    // --- PUBLIC_BASE_URL wins over the request's host ---
    let public = ConsumerConfig {
        public_base_url: Some("https://events.example.com".into()),
        ..ConsumerConfig::defaults()
    };
    let i = next();
    let b = audit_body(i);
    cases.push(Case {
        name: "PUBLIC_BASE_URL set: sub on the public URL accepted",
        req: delivery(
            i,
            &b,
            &[(
                "upstash-signature",
                &token(
                    KEY,
                    "https://events.example.com/events/audit?contract=2",
                    &b,
                ),
            )],
        ),
        want: Want::Applied,
        config: Some(public.clone()),
    });
    let i = next();
    let b = audit_body(i);
    cases.push(Case {
        name: "PUBLIC_BASE_URL set: sub on the function URL refused",
        req: delivery(i, &b, &[("upstash-signature", &token(KEY, &sub(), &b))]),
        want: Want::Rejected("subject"),
        config: Some(public),
    });
    cases
}

#[sqlx::test(migrator = "outbox_testkit::MIGRATOR")]
async fn signature_corpus_through_the_consumer(pool: PgPool) {
    let cases = corpus();
    assert!(cases.len() >= 30, "corpus has {} cases", cases.len());
    let mut applied = 0;
    let mut failures = Vec::new();
    for case in cases {
        let config = case.config.clone().unwrap_or_else(ConsumerConfig::defaults);
        let state = ConsumerState::new(receiver(&pool, config), orders_example::registry());
        let before = count(&pool, "SELECT count(*) FROM processed_messages").await;
        let resp = handle_event(&state, case.req).await;
        let (status, body) = parts(&resp);
        let after = count(&pool, "SELECT count(*) FROM processed_messages").await;
        let ok = match &case.want {
            Want::Applied => {
                applied += 1;
                status == 200 && body["status"] == "processed" && after == before + 1
            }
            Want::Rejected(check) => {
                status == 401
                    && body["check"] == *check
                    && after == before
                    && !body["error"].as_str().unwrap_or("").contains(KEY)
                    && !body["error"].as_str().unwrap_or("").contains(NEXT)
            }
            Want::Status(s) => status == *s && after == before,
        };
        if !ok {
            failures.push(format!(
                "{}: want {:?}, got {status} {body}",
                case.name, case.want
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    assert_eq!(
        count(&pool, "SELECT count(*) FROM audit_log").await,
        applied,
        "exactly the accepted cases wrote their row"
    );
}

#[sqlx::test(migrator = "outbox_testkit::MIGRATOR")]
async fn token_for_another_host_replayed_with_forwarded_host_is_refused_unless_trusted(
    pool: PgPool,
) {
    // A token QStash issued for a delivery to another service (other.example) is replayed to our function URL
    // with Host and X-Forwarded-Host set to that host. Rebuilding the URL from client headers would make `sub`
    // match: the receiver must take the host from the function-URL event (requestContext.domainName) unless
    // TRUST_FORWARDED_HEADERS says a proxy in front sets them.
    let id = 4242;
    let body = audit_body(id);
    let sig = token(KEY, "https://other.example/events/audit?contract=2", &body);
    let replay = || {
        delivery(
            id,
            &body,
            &[
                ("host", "other.example"),
                ("x-forwarded-host", "other.example"),
                ("upstash-signature", &sig),
            ],
        )
    };
    let state = ConsumerState::new(
        receiver(&pool, ConsumerConfig::defaults()),
        orders_example::registry(),
    );
    let (status, json) = parts(&handle_event(&state, replay()).await);
    assert_eq!((status, &json["check"]), (401, &json!("subject")), "{json}");
    assert_eq!(
        count(&pool, "SELECT count(*) FROM processed_messages").await,
        0
    );
    assert_eq!(count(&pool, "SELECT count(*) FROM audit_log").await, 0);

    let trusting = ConsumerState::new(
        receiver(
            &pool,
            ConsumerConfig {
                trust_forwarded_headers: true,
                ..ConsumerConfig::defaults()
            },
        ),
        orders_example::registry(),
    );
    let (status, json) = parts(&handle_event(&trusting, replay()).await);
    assert_eq!(
        (status, &json["status"]),
        (200, &json!("processed")),
        "accepted only when the forwarded headers are trusted: {json}"
    );
}

// ---------------------------------------------------------------------------------------------------------
// Real QStash tokens (from the public QStash SDKs' tests): verified with "now" injected.

const DART_KEY: &str = "sig_7dskHhQGd7zBn4pUmfcuuhoVv8dV";
const DART_TOKEN: &str = "eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9.eyJhdWQiOiIiLCJib2R5IjoicFpHbTFBdjBJRUJLQVJjeno3ZXhrTllzWmI4THphTXJWN0ozMmEyZkZHND0iLCJleHAiOjE2NjU2MTUwMzgsImlhdCI6MTY2NTYxNDczOCwiaXNzIjoiVXBzdGFzaCIsImp0aSI6Imp3dF82ZDRCUXd6RzRDb0hadGU4VkNoSk54SnVuMTVDIiwibmJmIjoxNjY1NjE0NzM4LCJzdWIiOiJodHRwczovL3JlYmF6LXFzdGFzaC5yZXF1ZXN0Y2F0Y2hlci5jb20vdGVzdCJ9.y0_9NlMBUmO9dlPxG0PlnyekjfO88oIKfgmJfcoYo8k";
const DART_URL: &str = "https://rebaz-qstash.requestcatcher.com/test";
const PHP_KEY: &str = "sig_561zQH6V9b96E63sS3b9wvGXosi7";
const PHP_TOKEN: &str = "eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9.eyJhdWQiOiIiLCJib2R5IjoiLVcyTk4xZnZNaGFxLVhlT0JJcXE4SUE4ajdMSlhxTDhaY1NDMXJoRE1CVT0iLCJleHAiOjE3MjEwNjkxNTEsImlhdCI6MTcyMTA2ODg1MSwiaXNzIjoiVXBzdGFzaCIsImp0aSI6Imp3dF82Y2tnQTdSUW5qNngzWE1LU25mVWI4YXRUc1pQIiwibmJmIjoxNzIxMDY4ODUxLCJzdWIiOiJodHRwczovL3dlYmhvb2suc2l0ZS83N2FlODk4OC1lZWNmLTRhMDEtOWE3Ni0yYTM3MjEyYzc1YTgifQ.ppulAF6fmnYfeVdR72HprfzLSIN_6KX65JOXwdxRMyk";
const PHP_URL: &str = "https://webhook.site/77ae8988-eecf-4a01-9a76-2a37212c75a8";

fn at(now: i64) -> VerifyOptions {
    VerifyOptions {
        now,
        clock_tolerance_secs: 0,
    }
}

#[test]
fn real_qstash_tokens_verify() {
    let dart = SigningKeys::new(DART_KEY, Some("sig_unrelatedNextKey".into()));
    let c = verify(
        DART_TOKEN,
        b"Hello World",
        DART_URL,
        &dart,
        at(1_665_614_800),
    )
    .unwrap();
    assert_eq!(c.key, KeyUsed::Current);
    assert_eq!(c.sub, DART_URL);
    assert_eq!(c.exp, 1_665_615_038);
    // As the next key too (rotation in progress).
    let as_next = SigningKeys::new("sig_unrelatedCurrent", Some(DART_KEY.into()));
    assert_eq!(
        verify(
            DART_TOKEN,
            b"Hello World",
            DART_URL,
            &as_next,
            at(1_665_614_800)
        )
        .unwrap()
        .key,
        KeyUsed::Next
    );

    let php = SigningKeys::new(PHP_KEY, None);
    let c = verify(
        PHP_TOKEN,
        br#"{"message":"hello world"}"#,
        PHP_URL,
        &php,
        at(1_721_069_141),
    )
    .unwrap();
    assert_eq!(c.iat, Some(1_721_068_851));
}

#[test]
fn real_qstash_tokens_fail_the_right_check() {
    let dart = SigningKeys::new(DART_KEY, None);
    let now = at(1_665_614_800);
    assert!(matches!(
        verify(
            DART_TOKEN,
            b"Hello World",
            DART_URL,
            &dart,
            at(1_665_615_038)
        ),
        Err(VerifyError::Expired { .. })
    ));
    assert!(matches!(
        verify(
            DART_TOKEN,
            b"Hello World",
            DART_URL,
            &dart,
            at(1_665_614_737)
        ),
        Err(VerifyError::NotYetValid { .. })
    ));
    assert_eq!(
        verify(DART_TOKEN, b"Hello World!", DART_URL, &dart, now),
        Err(VerifyError::BodyHash)
    );
    assert!(matches!(
        verify(
            DART_TOKEN,
            b"Hello World",
            &format!("{DART_URL}/"),
            &dart,
            now
        ),
        Err(VerifyError::Subject { .. })
    ));
    assert_eq!(
        verify(
            DART_TOKEN,
            b"Hello World",
            DART_URL,
            &SigningKeys::new(PHP_KEY, None),
            now
        ),
        Err(VerifyError::Signature)
    );
    // The wrong key's check message never contains a key.
    let msg = VerifyError::Signature.to_string();
    assert!(!msg.contains("sig_"), "{msg}");
}

// ---------------------------------------------------------------------------------------------------------
// Key rotation: re-read the secret when both keys fail, at most once per interval.

/// An environment whose values can change under a running function, counting reads of the current key.
#[derive(Default)]
struct RotatingEnv {
    vars: Mutex<HashMap<String, String>>,
    reads: Mutex<u32>,
}

impl RotatingEnv {
    fn set_keys(&self, current: &str, next: &str) {
        let mut v = self.vars.lock().unwrap();
        v.insert("QSTASH_CURRENT_SIGNING_KEY".into(), current.into());
        v.insert("QSTASH_NEXT_SIGNING_KEY".into(), next.into());
    }
    fn reads(&self) -> u32 {
        *self.reads.lock().unwrap()
    }
}

impl EnvSource for RotatingEnv {
    fn var(&self, key: &str) -> Option<String> {
        if key == "QSTASH_CURRENT_SIGNING_KEY" {
            *self.reads.lock().unwrap() += 1;
        }
        self.vars.lock().unwrap().get(key).cloned()
    }
}

const K3: &str = "sig_ThirdKeyAfterRotation0000";
const K4: &str = "sig_FourthKeyAfterRotation000";

#[tokio::test]
async fn rotated_keys_are_picked_up_without_redeploy() {
    let env = Arc::new(RotatingEnv::default());
    env.set_keys(KEY, NEXT);
    let source = SecretSource::Env(env.clone());
    // Interval 0: every signature mismatch may re-read.
    let ring = KeyRing::loaded(
        SigningKeys::new(KEY, Some(NEXT.into())),
        source,
        Duration::ZERO,
    );
    let u = url(PATH);
    let opts = at(NOW);
    // QStash rotated twice (current = K3, next = K4) and signs with K3.
    env.set_keys(K3, K4);
    let t = token(K3, &u, b"x");
    let c = ring.verify(&t, b"x", &u, opts).await.unwrap();
    assert_eq!(c.key, KeyUsed::Current);
    assert_eq!(env.reads(), 1, "one re-read");
    // Now in use without further reads.
    ring.verify(&t, b"x", &u, opts).await.unwrap();
    assert_eq!(env.reads(), 1);
    // A bad token still fails and (interval 0) re-reads: nothing new, still refused.
    let bad = token("sig_attacker", &u, b"x");
    assert_eq!(
        ring.verify(&bad, b"x", &u, opts).await,
        Err(VerifyError::Signature)
    );
    // Failures that are not about the key never re-read.
    let reads = env.reads();
    let expired = token_with(K3, &with(claims(&u, b"x"), "exp", json!(NOW - 5)));
    assert!(matches!(
        ring.verify(&expired, b"x", &u, opts).await,
        Err(VerifyError::Expired { .. })
    ));
    assert_eq!(env.reads(), reads);
}

#[tokio::test]
async fn secret_is_re_read_at_most_once_per_interval() {
    let env = Arc::new(RotatingEnv::default());
    env.set_keys(KEY, NEXT);
    let ring = Arc::new(KeyRing::refreshable(
        SigningKeys::new(KEY, Some(NEXT.into())),
        SecretSource::Env(env.clone()),
        Duration::from_secs(3600),
    ));
    let u = url(PATH);
    let bad = token("sig_attacker", &u, b"x");
    // 50 concurrent bad signatures: one re-read at most.
    let futs = (0..50).map(|_| {
        let ring = ring.clone();
        let (bad, u) = (bad.clone(), u.clone());
        async move { ring.verify(&bad, b"x", &u, at(NOW)).await }
    });
    for r in futures::future::join_all(futs).await {
        assert_eq!(r, Err(VerifyError::Signature));
    }
    assert_eq!(env.reads(), 1);
    // A rotation inside the interval is not seen until the interval passes.
    env.set_keys(K3, K4);
    let t = token(K3, &u, b"x");
    assert_eq!(
        ring.verify(&t, b"x", &u, at(NOW)).await,
        Err(VerifyError::Signature)
    );
    assert_eq!(env.reads(), 1);

    // A freshly loaded ring counts its startup read: no re-read within the interval either.
    let env2 = Arc::new(RotatingEnv::default());
    env2.set_keys(K3, K4);
    let loaded = KeyRing::loaded(
        SigningKeys::new(KEY, Some(NEXT.into())),
        SecretSource::Env(env2.clone()),
        Duration::from_secs(3600),
    );
    assert_eq!(
        loaded.verify(&t, b"x", &u, at(NOW)).await,
        Err(VerifyError::Signature)
    );
    assert_eq!(env2.reads(), 0);
}

// ---------------------------------------------------------------------------------------------------------
// The URL that `sub` is compared with.

#[test]
fn url_is_rebuilt_from_the_function_url_event() {
    let req = post_with_headers("/events/a%2Fb", "x=1&y=a%20b", &[], b"");
    assert_eq!(
        request_url(&req, UrlSource::FunctionUrl),
        format!("https://{HOST}/events/a%2Fb?x=1&y=a%20b")
    );
    assert_eq!(
        request_url(&req, UrlSource::Public("https://public.example.com")),
        "https://public.example.com/events/a%2Fb?x=1&y=a%20b"
    );
    // Without a host header the function URL's domain name is used.
    let mut ev: Value =
        serde_json::from_str(&function_url_event("POST", "/failure", "", &[], b"")).unwrap();
    ev["headers"].as_object_mut().unwrap().remove("host");
    let req = request_from_event(&ev.to_string());
    assert_eq!(
        request_url(&req, UrlSource::FunctionUrl),
        format!("https://{HOST}/failure")
    );
    // Client-sent Host and X-Forwarded-* headers choose nothing unless a setting trusts a proxy in front.
    let req = post_with_headers(
        "/failure",
        "",
        &[
            ("host", "attacker.example"),
            ("x-forwarded-host", "a.example.com, b.example.com"),
            // (lambda_http itself panics on a list in x-forwarded-proto while building the URI, so one value.)
            ("x-forwarded-proto", "http"),
        ],
        b"",
    );
    assert_eq!(
        request_url(&req, UrlSource::FunctionUrl),
        format!("https://{HOST}/failure")
    );
    // TRUST_FORWARDED_HEADERS: forwarded headers (first value of a list) win over host.
    assert_eq!(
        request_url(&req, UrlSource::Forwarded),
        "http://a.example.com/failure"
    );
}

#[tokio::test]
async fn clock_is_the_system_clock_by_default() {
    // A token made "now" verifies with the default (system) clock: no injected time in production.
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64;
    let u = url(PATH);
    let t = token_with(KEY, &with(claims(&u, b"{}"), "exp", json!(now + 300)));
    let ring = KeyRing::fixed(SigningKeys::new(KEY, None));
    ring.verify(&t, b"{}", &u, at(Clock::System.now()))
        .await
        .unwrap();
}

// ---------------------------------------------------------------------------------------------------------
// A flood of badly signed requests: no database work, no WARN line per request, every one counted.

/// Requests per receiver in the flood.
const FLOOD: usize = 24;

/// The `i`-th forged request for `path`: no signature, garbage, a foreign key, an expired token, in turn.
fn forged(path: &str, query: &str, i: usize) -> Request {
    let body = audit_body(i as i64 + 1);
    let url = url_with_query(path, query);
    let sig = match i % 4 {
        0 => None,
        1 => Some("not.a.jwt".to_owned()),
        2 => Some(token("sig_someoneElsesKey000000000000", &url, &body)),
        _ => Some(token_with(
            KEY,
            &with(claims(&url, &body), "exp", json!(NOW - 600)),
        )),
    };
    let mut headers: Vec<(&str, &str)> = vec![("upstash-message-id", "msg_flood")];
    if let Some(s) = &sig {
        headers.push(("upstash-signature", s));
    }
    post_with_headers(path, query, &headers, &body)
}

/// The child of [`a_flood_of_bad_signatures_does_no_database_work_logs_no_warn_per_request_and_is_counted`]: both
/// receivers with the production log setup and their EMF lines on, over a pool whose database does not exist
/// (every connection attempt is refused), answer the flood; then one genuine delivery, which needs the database.
#[tokio::test]
#[ignore = "run as a subprocess by a_flood_of_bad_signatures_does_no_database_work_logs_no_warn_per_request_and_is_counted"]
async fn flood_child() {
    if std::env::var_os("OUTBOX_FLOOD_CHILD").is_none() {
        return;
    }
    outbox::telemetry::init(outbox::telemetry::LogFormat::Json);
    let pool = sqlx::postgres::PgPoolOptions::new()
        .acquire_timeout(Duration::from_secs(2))
        .connect_lazy("postgres://postgres@127.0.0.1:1/nowhere")
        .unwrap();
    let receiver = || {
        outbox::internals::receiver::ReceiverState::new(
            ConsumerConfig::defaults(),
            Db::new(pool.clone(), Statements::Prepared),
            KeyRing::fixed(SigningKeys::new(KEY, Some(NEXT.into()))),
        )
        .with_clock(Clock::Fixed(NOW))
    };
    let consumer = ConsumerState::new(receiver(), orders_example::registry());
    let callbacks = receiver();
    for i in 0..FLOOD {
        let r = handle_event(&consumer, forged(PATH, CONTRACT_QUERY, i)).await;
        assert_eq!(
            parts(&r).0,
            401,
            "consumer, forged request {i}: {:?}",
            parts(&r)
        );
        let path = if i % 2 == 0 { "/failure" } else { "/delivered" };
        let r =
            outbox::internals::callbacks::handle_callback(&callbacks, forged(path, "", i)).await;
        assert_eq!(
            parts(&r).0,
            401,
            "callback, forged request {i}: {:?}",
            parts(&r)
        );
    }
    // The control: a genuine delivery gets past verification and finds no database.
    let genuine = Delivery::new(TOPIC, 1, audit_payload(1).as_bytes()).key("user-1");
    let r = handle_event(&consumer, genuine.request()).await;
    assert_eq!(parts(&r).0, 503, "{:?}", parts(&r));
}

#[test]
fn a_flood_of_bad_signatures_does_no_database_work_logs_no_warn_per_request_and_is_counted() {
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            outbox_testkit::test_path(module_path!(), "flood_child").as_str(),
            "--exact",
            "--ignored",
            "--nocapture",
        ])
        .env("OUTBOX_FLOOD_CHILD", "1")
        // Everything of ours down to DEBUG, where each rejection is logged.
        .env("RUST_LOG", "debug,sqlx=error,hyper=warn")
        .env_remove("AWS_LAMBDA_LOG_LEVEL")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "the child failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines: Vec<Value> = stdout
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    // 1. Every request is answered 401 over a pool that cannot connect (the child checked the statuses), while the
    // genuine delivery needed the database and got 503: nothing before verification touches the database.

    // 2. One EMF line per request, each rejection counted.
    let emf = |function: &str| -> Vec<&Value> {
        lines
            .iter()
            .filter(|l| l.get("_aws").is_some() && l["Function"] == function)
            .collect()
    };
    let sum = |ls: &[&Value], m: &str| ls.iter().filter_map(|l| l[m].as_f64()).sum::<f64>();
    let consumer = emf("consumer");
    let callbacks = emf("failure-callback");
    assert_eq!(consumer.len(), FLOOD + 1, "{stdout}");
    assert_eq!(callbacks.len(), FLOOD, "{stdout}");
    assert_eq!(sum(&consumer, "RejectedSignatures"), FLOOD as f64);
    assert_eq!(sum(&consumer, "TransientFailures"), 1.0, "the genuine one");
    assert_eq!(sum(&callbacks, "RejectedSignatures"), FLOOD as f64);

    // 3. Each rejection is a DEBUG line; WARN sees only the rate-limited summary, not one line per request.
    let logs: Vec<&Value> = lines.iter().filter(|l| l.get("_aws").is_none()).collect();
    let per_request: Vec<&&Value> = logs
        .iter()
        .filter(|l| l["message"] == "signature rejected")
        .collect();
    assert_eq!(per_request.len(), 2 * FLOOD, "{stdout}");
    let loud: Vec<&&&Value> = per_request
        .iter()
        .filter(|l| l["level"] != "DEBUG")
        .collect();
    assert!(
        loud.is_empty(),
        "{} of {} rejections logged above DEBUG, the first: {}",
        loud.len(),
        per_request.len(),
        loud[0]
    );
    let warned: Vec<&&Value> = logs
        .iter()
        .filter(|l| l["level"] == "WARN" || l["level"] == "ERROR")
        .collect();
    let summaries: Vec<&&Value> = warned
        .iter()
        .copied()
        .filter(|l| {
            l["message"]
                .as_str()
                .is_some_and(|m| m.starts_with("signature rejections: "))
        })
        .collect();
    assert!(
        !summaries.is_empty() && summaries.len() < FLOOD,
        "a summary, and not one per request: {summaries:?}"
    );
    assert_eq!(
        summaries[0]["rejected"], 1,
        "the first rejection of a process is reported at once"
    );
    let others: Vec<&&Value> = warned
        .iter()
        .copied()
        .filter(|l| !summaries.contains(l))
        .collect();
    assert!(
        others.len() == 1 && others[0]["message"] == "transient failure (QStash retries)",
        "the only other WARN line is the genuine delivery's: {others:?}"
    );
}

/// A secret re-read after a signature mismatch that now holds the dev server's public signing key is refused, as
/// startup refuses it: a token signed with it is not accepted and the keys in use stay. With
/// `OUTBOX_ALLOW_DEV_KEYS=true` (the ring built with it) the re-read takes them.
#[tokio::test]
async fn a_key_refresh_refuses_the_dev_servers_public_keys_as_startup_does() {
    use outbox::internals::secrets::{DEV_CURRENT_SIGNING_KEY, DEV_NEXT_SIGNING_KEY};
    let env = Arc::new(RotatingEnv::default());
    env.set_keys(K3, K4);
    let ring = KeyRing::loaded(
        SigningKeys::new(K3, Some(K4.into())),
        SecretSource::Env(env.clone()),
        Duration::ZERO,
    );
    let u = url(PATH);
    env.set_keys(DEV_CURRENT_SIGNING_KEY, DEV_NEXT_SIGNING_KEY);
    let forged = token(DEV_CURRENT_SIGNING_KEY, &u, b"x");
    assert_eq!(
        ring.verify(&forged, b"x", &u, at(NOW)).await,
        Err(VerifyError::Signature)
    );
    assert_eq!(env.reads(), 1, "the secret was re-read");
    let good = token(K3, &u, b"x");
    assert!(
        ring.verify(&good, b"x", &u, at(NOW)).await.is_ok(),
        "the keys in use stay"
    );

    let allowed = KeyRing::loaded(
        SigningKeys::new(K3, Some(K4.into())),
        SecretSource::Env(env.clone()),
        Duration::ZERO,
    )
    .allowing_dev_keys(true);
    assert!(allowed.verify(&forged, b"x", &u, at(NOW)).await.is_ok());
}
