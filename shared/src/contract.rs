//! The wire contract between relay, QStash and the receivers: the HTTP headers an event carries to its
//! consumer, and the callback paths. Kept in one place so relay and consumer cannot drift apart.

/// Outbox id of the event: the consumer's dedupe key (stable across republishes and redrives).
pub const OUTBOX_ID: &str = "x-outbox-id";
/// Topic of the event (also the last path segment of the destination).
pub const OUTBOX_TOPIC: &str = "x-outbox-topic";
/// Partition key, percent-encoded (RFC 3986 unreserved characters are kept as is).
pub const OUTBOX_KEY: &str = "x-outbox-key";
/// Per-key sequence (ordered topics only).
pub const OUTBOX_SEQ: &str = "x-outbox-seq";
/// When the producer's transaction wrote the event (RFC 3339, UTC), for end-to-end latency.
pub const OUTBOX_CREATED_AT: &str = "x-outbox-created-at";
/// W3C trace context of the producer.
pub const TRACEPARENT: &str = "traceparent";
/// Correlation id.
pub const CORRELATION_ID: &str = "x-correlation-id";
/// Payload schema version.
pub const SCHEMA_VERSION: &str = "x-schema-version";

/// Set to `consumer` when the relay asks the consumer to record the delivery evidence of an ordered event in
/// its own transaction (`RELAY_ORDERED_EVIDENCE=consumer`, decision record 0007) instead of QStash's callback.
pub const OUTBOX_EVIDENCE: &str = "x-outbox-evidence";
/// The value of [`OUTBOX_EVIDENCE`].
pub const EVIDENCE_BY_CONSUMER: &str = "consumer";

/// Path (under `CALLBACK_URL`) of QStash failure callbacks.
pub const FAILURE_PATH: &str = "/failure";
/// Path (under `CALLBACK_URL`) of QStash delivery callbacks (ordered topics).
pub const DELIVERED_PATH: &str = "/delivered";
/// Path prefix (under `CONSUMER_URL`) of event deliveries: `/events/{topic}`.
pub const EVENTS_PATH: &str = "/events/";

/// QStash's deduplication id for an event: `outbox-<id>`, and `outbox-<id>-r<n>` after the n-th redrive (a
/// redrive must not be swallowed by QStash's dedup window). Never contains `:` (QStash rejects it).
pub fn dedup_id(outbox_id: i64, redrive_count: i32) -> String {
    if redrive_count > 0 {
        format!("outbox-{outbox_id}-r{redrive_count}")
    } else {
        format!("outbox-{outbox_id}")
    }
}

/// Percent-encodes a partition key for an HTTP header value.
pub fn encode_key(key: &str) -> String {
    let mut out = String::with_capacity(key.len());
    for b in key.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// Decodes [`encode_key`]; `None` for malformed input or non-UTF-8 results.
pub fn decode_key(encoded: &str) -> Option<String> {
    let bytes = encoded.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = encoded.get(i + 1..i + 3)?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_round_trip() {
        for k in ["plain", "a b/c:d", "ünïcødé", "100%", "x\u{1F600}y"] {
            let e = encode_key(k);
            assert!(e.bytes().all(|b| b.is_ascii_graphic()), "{e}");
            assert_eq!(decode_key(&e).as_deref(), Some(k));
        }
        assert_eq!(decode_key("%zz"), None);
        assert_eq!(decode_key("%4"), None);
    }

    #[test]
    fn dedup_ids_never_contain_colons() {
        assert_eq!(dedup_id(42, 0), "outbox-42");
        assert_eq!(dedup_id(42, 3), "outbox-42-r3");
    }
}
