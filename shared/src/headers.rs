//! User headers: an application's own metadata on an event (tenant, causation id, the payload's media type, …),
//! set with [`crate::NewEvent::header`] and read by the handler with [`crate::consumer::Event::header`]
//! (decision record 0026).
//!
//! They travel inside the signed envelope (`outbox::contract`), never as plain request headers, so a handler may
//! decide things from them: whoever replays a delivery cannot change them without breaking the signature.
//!
//! The rules, checked when the event is enqueued (an event that breaks one is refused with
//! [`crate::InvalidEvent::Header`] naming the header and the rule, or one of the size errors):
//!
//! - a name is 1–[`MAX_NAME_BYTES`] HTTP token characters (`A-Z a-z 0-9 ! # $ % & ' * + - . ^ _ ` | ~`),
//!   stored lower-cased; names are case-insensitive, so setting one twice (in any case) is refused;
//! - a name the pipeline owns or that means something to HTTP is refused ([`RESERVED_NAMES`],
//!   [`RESERVED_PREFIXES`]): user headers can never set or override the outbox's own metadata;
//! - a value is at most [`MAX_VALUE_BYTES`] bytes of UTF-8 without control characters (no CR, LF, NUL, tab, …:
//!   values end up in logs and on the operator's terminal);
//! - at most [`MAX_HEADERS`] headers and [`MAX_TOTAL_BYTES`] bytes of names and values per event.

use std::collections::BTreeMap;
use std::time::Duration;

/// Most user headers on one event.
pub(crate) const MAX_HEADERS: usize = 32;
/// Longest header name, in bytes.
pub(crate) const MAX_NAME_BYTES: usize = 64;
/// Longest header value, in bytes.
pub(crate) const MAX_VALUE_BYTES: usize = 1024;
/// Most bytes of names plus values on one event (they travel in every delivery and every dead letter).
pub(crate) const MAX_TOTAL_BYTES: usize = 8192;

/// Why an event was rejected before anything was written (by [`crate::producer`]: its topic, key, payload,
/// delay, or a user header that breaks a rule of this module). Re-exported as `outbox::InvalidEvent` and
/// `outbox::producer::InvalidEvent`.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum InvalidEvent {
    /// The topic name is empty.
    #[error("topic is empty")]
    EmptyTopic,
    /// The topic name has characters that cannot be a URL path segment, or is too long.
    #[error("topic {0:?} may only contain A-Z a-z 0-9 . _ - and be at most 100 characters")]
    InvalidTopic(String),
    /// The partition key is empty.
    #[error("partition key is empty")]
    EmptyKey,
    /// The partition key is too long.
    #[error("partition key is {len} bytes; the maximum is {max}")]
    KeyTooLong { len: usize, max: usize },
    /// The JSON payload is larger than the configured maximum.
    #[error("payload is {size} bytes; the maximum is {max}")]
    PayloadTooLarge { size: usize, max: usize },
    /// The payload is not valid JSON.
    #[error("payload is not valid JSON: {0}")]
    NotJson(String),
    /// The payload bytes are not UTF-8, so they cannot be JSON text.
    #[error(
        "payload is not UTF-8 (invalid bytes after the first {valid_up_to}), so it cannot be JSON text"
    )]
    NotUtf8 {
        /// How many leading bytes are valid UTF-8.
        valid_up_to: usize,
    },
    /// The payload contains a NUL character.
    #[error("payload contains \\u0000, which Postgres jsonb cannot store")]
    NulInPayload,
    /// A header value is malformed.
    #[error("{name} is invalid: {reason}")]
    InvalidHeader {
        /// Which header.
        name: &'static str,
        reason: String,
    },
    /// The fairness key ([`crate::NewEvent::fairness_key`]) is empty, too long or has other characters.
    #[error("fairness key {key:?} {reason}")]
    InvalidFairnessKey {
        /// The key as given (at most 80 characters of it).
        key: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// The delay is longer than [`crate::producer::MAX_DELAY`].
    #[error("delay of {0:?} is longer than the maximum of 365 days")]
    DelayTooLong(Duration),
    /// A user header ([`crate::producer::NewEvent::header`]) breaks a rule of this module.
    #[error("header {name:?} refused: {rule}")]
    Header {
        /// The header name as given (at most 80 characters of it).
        name: String,
        /// The rule it breaks.
        rule: HeaderRule,
    },
    /// More user headers than [`MAX_HEADERS`].
    #[error("{count} headers; the maximum is {max}")]
    TooManyHeaders {
        /// How many were set.
        count: usize,
        /// The limit.
        max: usize,
    },
    /// The user headers' names and values together exceed [`MAX_TOTAL_BYTES`].
    #[error("headers total {size} bytes of names and values; the maximum is {max}")]
    HeadersTooLarge {
        /// Their size.
        size: usize,
        /// The limit.
        max: usize,
    },
}

/// Names the pipeline owns or that mean something to HTTP, refused as user headers (lower case). `traceparent`,
/// `x-correlation-id` and `x-schema-version` have their own setters on [`crate::NewEvent`]; `tracestate` and
/// `baggage` belong to trace propagation; the rest are transport headers a proxy, QStash or the Lambda front end
/// set or strip, which would be confusing to see in a handler.
pub(crate) const RESERVED_NAMES: &[&str] = &[
    "traceparent",
    "tracestate",
    "baggage",
    "x-correlation-id",
    "x-schema-version",
    "authorization",
    "proxy-authorization",
    "cookie",
    "set-cookie",
    "host",
    "content-type",
    "content-length",
    "content-encoding",
    "transfer-encoding",
    "connection",
    "keep-alive",
    "te",
    "trailer",
    "upgrade",
    "expect",
    "forwarded",
    "via",
    "user-agent",
];

/// Name prefixes refused as user headers: the outbox's own (`x-outbox-`), QStash's (`upstash-`), AWS's
/// (`x-amz-`, `x-amzn-`) and proxies' (`x-forwarded-`, `proxy-`).
pub(crate) const RESERVED_PREFIXES: &[&str] = &[
    "x-outbox-",
    "upstash-",
    "x-amz-",
    "x-amzn-",
    "x-forwarded-",
    "proxy-",
];

/// Why one user header was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HeaderRule {
    /// The name is empty.
    #[error("a header name cannot be empty")]
    EmptyName,
    /// The name has a character HTTP does not allow in a header name.
    #[error(
        "a header name may only contain letters, digits and ! # $ % & ' * + - . ^ _ ` | ~ (HTTP token characters)"
    )]
    NotToken,
    /// The name is longer than [`MAX_NAME_BYTES`].
    #[error("the name is {len} bytes; the maximum is {max}")]
    NameTooLong {
        /// Its length.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// The pipeline owns the name (or it means something to HTTP).
    #[error(
        "the name is reserved for the pipeline or HTTP (x-outbox-*, upstash-*, traceparent, content-type, \
         authorization, …: see outbox::headers::RESERVED_NAMES); use the event's own setter or another name"
    )]
    Reserved,
    /// The value is longer than [`MAX_VALUE_BYTES`].
    #[error("the value is {len} bytes; the maximum is {max}")]
    ValueTooLong {
        /// Its length.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// The value holds a control character.
    #[error("the value contains a control character (CR, LF, NUL, tab, …)")]
    ControlCharacter,
    /// The same name (ignoring case) was set twice.
    #[error("set twice (names are case-insensitive)")]
    Duplicate,
}

/// Whether `name` (lower case) is reserved for the pipeline or HTTP.
pub(crate) fn is_reserved(name: &str) -> bool {
    RESERVED_NAMES.contains(&name) || RESERVED_PREFIXES.iter().any(|p| name.starts_with(p))
}

fn is_token(b: u8) -> bool {
    b.is_ascii_alphanumeric()
        || matches!(
            b,
            b'!' | b'#'
                | b'$'
                | b'%'
                | b'&'
                | b'\''
                | b'*'
                | b'+'
                | b'-'
                | b'.'
                | b'^'
                | b'_'
                | b'`'
                | b'|'
                | b'~'
        )
}

/// Checks a name and returns it lower-cased.
pub(crate) fn normalize_name(name: &str) -> Result<String, HeaderRule> {
    if name.is_empty() {
        return Err(HeaderRule::EmptyName);
    }
    if !name.bytes().all(is_token) {
        return Err(HeaderRule::NotToken);
    }
    if name.len() > MAX_NAME_BYTES {
        return Err(HeaderRule::NameTooLong {
            len: name.len(),
            max: MAX_NAME_BYTES,
        });
    }
    let lower = name.to_ascii_lowercase();
    if is_reserved(&lower) {
        return Err(HeaderRule::Reserved);
    }
    Ok(lower)
}

/// Checks a value.
pub(crate) fn check_value(value: &str) -> Result<(), HeaderRule> {
    if value.len() > MAX_VALUE_BYTES {
        return Err(HeaderRule::ValueTooLong {
            len: value.len(),
            max: MAX_VALUE_BYTES,
        });
    }
    if value.chars().any(char::is_control) {
        return Err(HeaderRule::ControlCharacter);
    }
    Ok(())
}

/// A name as an error shows it: at most 80 characters (the rest is elided), escaped by `{:?}` where it is
/// printed, so a hostile name cannot forge log lines.
fn shown(name: &str) -> String {
    let mut s: String = name.chars().take(80).collect();
    if s.len() < name.len() {
        s.push('…');
    }
    s
}

/// Checks an event's user headers in the order they were set and returns them by lower-cased name.
pub fn validate(headers: &[(String, String)]) -> Result<BTreeMap<String, String>, InvalidEvent> {
    if headers.len() > MAX_HEADERS {
        return Err(InvalidEvent::TooManyHeaders {
            count: headers.len(),
            max: MAX_HEADERS,
        });
    }
    let mut out = BTreeMap::new();
    let mut total = 0usize;
    for (name, value) in headers {
        let refused = |rule| InvalidEvent::Header {
            name: shown(name),
            rule,
        };
        let lower = normalize_name(name).map_err(refused)?;
        check_value(value).map_err(refused)?;
        total += lower.len() + value.len();
        if out.insert(lower, value.clone()).is_some() {
            return Err(refused(HeaderRule::Duplicate));
        }
    }
    if total > MAX_TOTAL_BYTES {
        return Err(InvalidEvent::HeadersTooLarge {
            size: total,
            max: MAX_TOTAL_BYTES,
        });
    }
    Ok(out)
}

/// The user headers among an envelope event's headers: every name the pipeline does not own (the envelope's
/// `headers` also carries `traceparent` and `x-correlation-id`, which the handler reads from
/// [`crate::consumer::EventMeta`]).
pub(crate) fn user_headers_of(
    envelope_headers: &BTreeMap<String, String>,
) -> BTreeMap<String, String> {
    envelope_headers
        .iter()
        .filter(|(name, _)| !is_reserved(name))
        .map(|(n, v)| (n.clone(), v.clone()))
        .collect()
}

/// The longest fairness key, in characters (it is part of a QStash flow-control key and of the console's URLs).
pub(crate) const MAX_FAIRNESS_KEY_CHARS: usize = 64;

/// Checks a fairness key ([`crate::NewEvent::fairness_key`]): 1–[`MAX_FAIRNESS_KEY_CHARS`] characters of
/// `A-Z a-z 0-9 . _ - :`.
pub(crate) fn validate_fairness_key(key: &str) -> Result<(), InvalidEvent> {
    let reason = if key.is_empty() {
        "is empty (leave it unset for no key)"
    } else if key.chars().count() > MAX_FAIRNESS_KEY_CHARS {
        "is longer than 64 characters"
    } else if !key
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-' | b':'))
    {
        "may only contain A-Z a-z 0-9 . _ - :"
    } else {
        return Ok(());
    };
    Err(InvalidEvent::InvalidFairnessKey {
        key: key.chars().take(80).collect(),
        reason,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn one(name: &str, value: &str) -> Result<BTreeMap<String, String>, InvalidEvent> {
        validate(&[(name.to_owned(), value.to_owned())])
    }

    fn rule_of(r: Result<BTreeMap<String, String>, InvalidEvent>) -> HeaderRule {
        match r {
            Err(InvalidEvent::Header { rule, .. }) => rule,
            other => panic!("expected a refused header, got {other:?}"),
        }
    }

    #[test]
    fn names_are_lower_cased_and_values_kept() {
        let h = validate(&[
            ("Tenant".into(), "acme".into()),
            ("causation-id".into(), "order-7/cancel".into()),
            (
                "payload-content-type".into(),
                "application/vnd.acme+json; v=2".into(),
            ),
            ("x-note".into(), "grüße, ünïcødé ok".into()),
            ("empty".into(), String::new()),
        ])
        .unwrap();
        assert_eq!(h["tenant"], "acme");
        assert_eq!(h["x-note"], "grüße, ünïcødé ok");
        assert_eq!(h["empty"], "");
        assert_eq!(h.len(), 5);
    }

    #[test]
    fn reserved_names_are_refused_in_any_case() {
        for name in [
            "traceparent",
            "TraceParent",
            "tracestate",
            "x-correlation-id",
            "x-schema-version",
            "X-Outbox-Id",
            "x-outbox-anything",
            "Upstash-Forward-Tenant",
            "upstash-signature",
            "content-type",
            "Content-Length",
            "host",
            "authorization",
            "cookie",
            "x-amzn-trace-id",
            "x-forwarded-for",
        ] {
            assert_eq!(rule_of(one(name, "v")), HeaderRule::Reserved, "{name}");
        }
        // Near misses are fine.
        assert!(one("outbox-tenant", "v").is_ok());
        assert!(one("x-outboxes", "v").is_ok());
        assert!(one("content-type-of-payload", "v").is_ok());
    }

    #[test]
    fn bad_names_are_refused() {
        assert_eq!(rule_of(one("", "v")), HeaderRule::EmptyName);
        for name in [
            "ten ant",
            "tenant:",
            "tenant\r\nx-outbox-id",
            "ténant",
            "a/b",
            "(x)",
            "t\0",
        ] {
            assert_eq!(rule_of(one(name, "v")), HeaderRule::NotToken, "{name:?}");
        }
        assert!(one(&"n".repeat(MAX_NAME_BYTES), "v").is_ok());
        assert_eq!(
            rule_of(one(&"n".repeat(MAX_NAME_BYTES + 1), "v")),
            HeaderRule::NameTooLong {
                len: MAX_NAME_BYTES + 1,
                max: MAX_NAME_BYTES
            }
        );
    }

    #[test]
    fn bad_values_are_refused() {
        for value in [
            "a\r\nx-outbox-id: 1",
            "nul\0",
            "tab\there",
            "del\u{7f}",
            "c1\u{85}",
        ] {
            assert_eq!(
                rule_of(one("tenant", value)),
                HeaderRule::ControlCharacter,
                "{value:?}"
            );
        }
        assert!(one("tenant", &"v".repeat(MAX_VALUE_BYTES)).is_ok());
        assert_eq!(
            rule_of(one("tenant", &"v".repeat(MAX_VALUE_BYTES + 1))),
            HeaderRule::ValueTooLong {
                len: MAX_VALUE_BYTES + 1,
                max: MAX_VALUE_BYTES
            }
        );
    }

    #[test]
    fn duplicates_count_and_total_size_are_capped() {
        let dup = validate(&[("tenant".into(), "a".into()), ("TENANT".into(), "b".into())]);
        assert_eq!(
            dup,
            Err(InvalidEvent::Header {
                name: "TENANT".into(),
                rule: HeaderRule::Duplicate
            })
        );

        let many = |n: usize| -> Vec<(String, String)> {
            (0..n).map(|i| (format!("h{i}"), "v".into())).collect()
        };
        assert!(validate(&many(MAX_HEADERS)).is_ok());
        assert_eq!(
            validate(&many(MAX_HEADERS + 1)),
            Err(InvalidEvent::TooManyHeaders {
                count: MAX_HEADERS + 1,
                max: MAX_HEADERS
            })
        );

        // Each header within its own limits, together over the total: 9 × (2 + 1000) bytes.
        let big: Vec<(String, String)> = (0..9)
            .map(|i| (format!("h{i}"), "v".repeat(1000)))
            .collect();
        assert_eq!(
            validate(&big),
            Err(InvalidEvent::HeadersTooLarge {
                size: 9 * 1002,
                max: MAX_TOTAL_BYTES
            })
        );
    }

    #[test]
    fn errors_name_the_header_and_the_rule() {
        let e = one("X-Outbox-Id", "42").unwrap_err().to_string();
        assert!(e.contains("\"X-Outbox-Id\""), "{e}");
        assert!(e.contains("reserved"), "{e}");
        let e = one("tenant", "a\nb").unwrap_err().to_string();
        assert!(
            e.contains("\"tenant\"") && e.contains("control character"),
            "{e}"
        );
        // A hostile name is escaped and cut short.
        let e = one(&format!("evil\n{}", "x".repeat(500)), "v")
            .unwrap_err()
            .to_string();
        assert!(!e.contains('\n') && e.len() < 400, "{e}");
    }

    #[test]
    fn the_consumer_keeps_only_user_headers() {
        let env = BTreeMap::from([
            ("traceparent".to_owned(), "00-…".to_owned()),
            ("x-correlation-id".to_owned(), "req-9".to_owned()),
            ("x-outbox-id".to_owned(), "42".to_owned()),
            ("tenant".to_owned(), "acme".to_owned()),
        ]);
        let user = user_headers_of(&env);
        assert_eq!(
            user.into_iter().collect::<Vec<_>>(),
            [("tenant".to_owned(), "acme".to_owned())]
        );
    }
}
