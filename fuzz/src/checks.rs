//! What each fuzz target checks, as plain functions over the fuzzer's bytes. A panic is a finding. The same
//! functions run on stable Rust over every input kept in `fuzz/regressions/<target>/` (`tests/fuzz_regressions.rs`),
//! so a crash once found stays a test.

use std::sync::Once;
use std::time::Duration;

use lambda_http::http::{HeaderMap, HeaderName, HeaderValue, Method, Uri};
use outbox::internals::callbacks::{parse_callback, source_event};
use outbox::internals::contract::{WireEvent, parse_envelope, write_envelope};
use outbox::internals::receiver::{
    Claims, SigningKeys, UrlSource, VerifyOptions, body_hash, request_url, sign,
    verify as verify_token,
};
use outbox::local::{AdapterError, lambda_request};
use qstash_dev::expr::RetryDelayExpr;

const CURRENT: &str = "sig_fuzz_current_key";
const NEXT: &str = "sig_fuzz_next_key";
const URL: &str = "https://consumer.example.com/events/orders?contract=2";
const NOW: i64 = 1_767_225_600;

fn split_at_nul(data: &[u8]) -> (&[u8], &[u8]) {
    match data.iter().position(|b| *b == 0) {
        Some(i) => (&data[..i], &data[i + 1..]),
        None => (data, &[]),
    }
}

fn accepted(claims: &Claims, body: &[u8]) {
    assert_eq!(claims.sub, URL, "accepted a token for another URL");
    assert_eq!(
        claims.body.trim_end_matches('='),
        body_hash(body),
        "accepted a token for another body"
    );
}

/// The signature verifier (`outbox::internals::receiver::verify`). The first byte chooses the mode and the clock tolerance.
/// Mode "as given": the rest is a token and a body separated by the first NUL byte. Mode "tampered": a body is
/// signed with the current or the next key, then up to seven fuzzer-chosen bytes of the token are overwritten.
/// The verifier never panics; whatever it accepts names this URL and this body; an untouched token verifies.
pub fn verify(data: &[u8]) {
    let Some((&sel, rest)) = data.split_first() else {
        return;
    };
    let keys = SigningKeys::new(CURRENT, Some(NEXT.to_owned()));
    let opts = VerifyOptions {
        now: NOW,
        clock_tolerance_secs: i64::from(sel >> 4),
    };
    if sel & 1 == 0 {
        let (token, body) = split_at_nul(rest);
        if let Ok(claims) = verify_token(&String::from_utf8_lossy(token), body, URL, &keys, opts) {
            accepted(&claims, body);
        }
        return;
    }
    let Some((&n, rest)) = rest.split_first() else {
        return;
    };
    let edits_len = usize::from(n % 8) * 3;
    if rest.len() < edits_len {
        return;
    }
    let (edits, body) = rest.split_at(edits_len);
    let key = if sel & 2 == 0 { CURRENT } else { NEXT };
    let token = sign(key, URL, body, NOW - 10, 300);
    let mut bytes = token.clone().into_bytes();
    for e in edits.chunks_exact(3) {
        let pos = usize::from(u16::from_le_bytes([e[0], e[1]])) % bytes.len();
        bytes[pos] = e[2];
    }
    let changed = String::from_utf8_lossy(&bytes).into_owned();
    match verify_token(&changed, body, URL, &keys, opts) {
        Ok(claims) => accepted(&claims, body),
        Err(e) => assert!(
            changed != token,
            "a token signed with a configured key was refused: {e}"
        ),
    }
}

/// The failure/delivery callback body parser (`outbox::internals::callbacks::parse_callback`) and what the callback
/// function reads from it (`source_event`): never panics; an event it names has a positive id.
pub fn callback(data: &[u8]) {
    let Ok(parsed) = parse_callback(data) else {
        return;
    };
    let event = source_event(&parsed.body);
    if let Some(id) = event.outbox_id {
        assert!(id.get() > 0, "a callback named outbox id {id}");
    }
}

/// The dev server's `Upstash-Retry-Delay` expression parser: never panics; what it accepts evaluates to a delay
/// within the cap for any retry count, and its source parses again to the same expression.
pub fn retry_expr(data: &[u8]) {
    let Ok(source) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(expr) = RetryDelayExpr::parse(source) else {
        return;
    };
    let max = Duration::from_secs(86_400);
    for retried in [0, 1, 2, 7, 1_000, u32::MAX] {
        assert!(expr.delay(retried, max) <= max);
    }
    assert_eq!(
        RetryDelayExpr::parse(expr.source()).as_ref(),
        Ok(&expr),
        "an accepted expression does not parse again to itself"
    );
}

static QUIET_PANICS: Once = Once::new();

/// The local function-URL adapter (`outbox::local::lambda_request`): any method, path, query, headers and body
/// an HTTP client can send become the request `lambda_http` would give the handler in Lambda, or an error that the
/// adapter answers 400 — never a panic that takes the listener down. What it builds carries the body byte for
/// byte and the path as sent, and the receivers can compute the URL they compare with `sub`. Input: method, path
/// and query, `name: value` header lines, separated by NUL bytes; the rest is the body.
pub fn function_url(data: &[u8]) {
    // lambda_http panics on some inputs; the adapter catches that (AdapterError::Panicked). libFuzzer's hook
    // would abort on the caught panic, so this hook only prints, and stays quiet about lambda_http's own: an
    // uncaught panic still ends the run (the fuzz target's catch aborts, the test harness fails the test).
    QUIET_PANICS.call_once(|| {
        std::panic::set_hook(Box::new(|info| {
            if !info
                .location()
                .is_some_and(|l| l.file().contains("lambda_http"))
            {
                eprintln!("{info}");
            }
        }))
    });
    let mut parts = data.splitn(4, |b| *b == 0);
    let (Some(m), Some(pq), Some(hs)) = (parts.next(), parts.next(), parts.next()) else {
        return;
    };
    let body = parts.next().unwrap_or_default();
    let Ok(method) = Method::from_bytes(m) else {
        return;
    };
    let Some(uri) = std::str::from_utf8(pq)
        .ok()
        .filter(|s| s.starts_with('/'))
        .and_then(|s| s.parse::<Uri>().ok())
    else {
        return;
    };
    let mut headers = HeaderMap::new();
    for line in hs.split(|b| *b == b'\n') {
        let Some(i) = line.iter().position(|b| *b == b':') else {
            continue;
        };
        let value = line[i + 1..].trim_ascii();
        if let (Ok(n), Ok(v)) = (
            HeaderName::from_bytes(&line[..i]),
            HeaderValue::from_bytes(value),
        ) {
            headers.append(n, v);
        }
    }
    match lambda_request(&method, &uri, &headers, body, "127.0.0.1") {
        Ok(req) => {
            assert_eq!(req.body().as_ref(), body, "the body changed on the way");
            for trusted in [false, true] {
                let url = request_url(&req, UrlSource::from_config(None, trusted));
                assert!(
                    url.contains(uri.path()) || uri.path().is_empty(),
                    "{url} lost the path {}",
                    uri.path()
                );
            }
        }
        Err(AdapterError::Refused(_) | AdapterError::Panicked(_)) => {}
    }
}

/// The signed envelope: the consumer's reader (`parse_envelope`) never panics, and whatever it accepts, written
/// again by the relay's writer (`write_envelope`), reads back as the same events.
pub fn envelope(data: &[u8]) {
    let Ok(env) = parse_envelope(data) else {
        return;
    };
    let headers: Vec<Vec<(&str, &str)>> = env
        .events
        .iter()
        .map(|e| {
            e.headers
                .iter()
                .map(|(k, v)| (k.as_str(), v.as_str()))
                .collect()
        })
        .collect();
    let wire: Vec<WireEvent<'_>> = env
        .events
        .iter()
        .zip(&headers)
        .map(|(e, h)| WireEvent {
            id: e.id,
            event_id: e.event.unwrap_or(e.id),
            key: &e.key,
            seq: e.seq,
            created_at: e.created_at.unwrap_or_default(),
            schema_version: e.schema_version,
            headers: h,
            payload: e.payload.get(),
            resent: e.resent,
        })
        .collect();
    let text = write_envelope(&env.topic, env.subscriber.as_deref(), env.evidence, &wire);
    let again = match parse_envelope(text.as_bytes()) {
        Ok(a) => a,
        Err(e) => panic!("the relay's writer produced an envelope its reader refuses: {e}\n{text}"),
    };
    assert_eq!(again.topic, env.topic);
    assert_eq!(again.evidence, env.evidence);
    assert_eq!(again.events.len(), env.events.len());
    for (a, b) in again.events.iter().zip(&env.events) {
        assert_eq!(
            (a.id, &a.key, a.seq, a.schema_version, &a.headers),
            (b.id, &b.key, b.seq, b.schema_version, &b.headers)
        );
        assert_eq!(a.payload.get(), b.payload.get());
    }
}
