//! Publish options and their mapping to QStash request headers (`Upstash-*`).

use std::borrow::Cow;
use std::fmt;
use std::time::Duration;

use serde::Serialize;
use serde::ser::SerializeMap;

/// A header name: usually a `&'static str` constant (no allocation per message).
pub type HeaderName = Cow<'static, str>;

/// Per-key flow control (`Upstash-Flow-Control-Key` / `-Value`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FlowControl {
    /// The key (sanitised with [`flow_control_key`]).
    pub key: String,
    /// At most this many deliveries of the key in flight.
    pub parallelism: Option<u32>,
    /// At most this many deliveries started per `period`.
    pub rate: Option<u32>,
    /// The rate period (default 1 s).
    pub period: Option<Duration>,
}

impl FlowControl {
    /// The header value, e.g. `parallelism=1, rate=10, period=60s`; `None` when neither limit is set (QStash
    /// rejects that).
    pub fn value(&self) -> Option<String> {
        let mut parts = Vec::new();
        if let Some(p) = self.parallelism {
            parts.push(format!("parallelism={p}"));
        }
        if let Some(r) = self.rate {
            parts.push(format!("rate={r}"));
            if let Some(period) = self.period {
                parts.push(format!("period={}s", period.as_secs().max(1)));
            }
        }
        (!parts.is_empty()).then(|| parts.join(", "))
    }
}

/// A flow-control key QStash accepts: `[A-Za-z0-9._-]`, at most 100 characters. Other characters become `_`;
/// a key that had to be changed or shortened gets a short hash suffix so distinct keys stay distinct.
pub fn flow_control_key(raw: &str) -> String {
    const MAX: usize = 100;
    let clean: String = raw
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                c
            } else {
                '_'
            }
        })
        .collect();
    if clean == raw && clean.len() <= MAX {
        return clean;
    }
    // FNV-1a, 64 bit: stable across processes and versions (unlike std's hasher).
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in raw.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    let suffix = format!("-{h:016x}");
    let keep = MAX - suffix.len();
    let prefix: String = clean.chars().take(keep).collect();
    format!("{prefix}{suffix}")
}

/// Everything a publish can set. [`PublishOptions::headers`] is the option → header mapping.
#[derive(Debug, Clone, Default)]
pub struct PublishOptions {
    /// `Content-Type` of the body (forwarded to the destination).
    pub content_type: Option<String>,
    /// `Upstash-Method` (QStash's default is POST).
    pub method: Option<String>,
    /// `Upstash-Deduplication-Id` (must not contain `:`).
    pub deduplication_id: Option<String>,
    /// `Upstash-Retries`.
    pub retries: Option<u32>,
    /// `Upstash-Retry-Delay` expression (milliseconds, variable `retried`).
    pub retry_delay: Option<String>,
    /// `Upstash-Delay` (whole seconds).
    pub delay: Option<Duration>,
    /// `Upstash-Timeout` per delivery attempt (whole seconds).
    pub timeout: Option<Duration>,
    /// `Upstash-Callback`.
    pub callback: Option<String>,
    /// `Upstash-Failure-Callback`.
    pub failure_callback: Option<String>,
    /// `Upstash-Callback-Forward-<name>` headers.
    pub callback_forward: Vec<(HeaderName, String)>,
    /// `Upstash-Failure-Callback-Forward-<name>` headers.
    pub failure_callback_forward: Vec<(HeaderName, String)>,
    /// `Upstash-Forward-<name>` headers (delivered to the destination as `<name>`).
    pub forward: Vec<(HeaderName, String)>,
    pub flow_control: Option<FlowControl>,
    /// `Upstash-Label`.
    pub label: Option<String>,
}

/// A header name written as `prefix` + lower-cased `name`, straight into the serializer (no allocation).
struct Prefixed<'a>(&'static str, &'a str);

impl fmt::Display for Prefixed<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.0)?;
        for c in self.1.chars() {
            fmt::Write::write_char(f, c.to_ascii_lowercase())?;
        }
        Ok(())
    }
}

impl Serialize for Prefixed<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        // Header names are short: assemble them on the stack and hand the serializer one `&str` (going through
        // `Display` fed the JSON escaper one character at a time, a quarter of the relay's CPU in a profile).
        const MAX: usize = 128;
        let (prefix, name) = (self.0.as_bytes(), self.1.as_bytes());
        let len = prefix.len() + name.len();
        if len > MAX {
            return s.collect_str(self);
        }
        let mut buf = [0u8; MAX];
        buf[..prefix.len()].copy_from_slice(prefix);
        buf[prefix.len()..len].copy_from_slice(name);
        // Lower-casing ASCII bytes leaves every multi-byte UTF-8 sequence as it was: still valid UTF-8.
        buf[prefix.len()..len].make_ascii_lowercase();
        match std::str::from_utf8(&buf[..len]) {
            Ok(key) => s.serialize_str(key),
            Err(_) => s.collect_str(self),
        }
    }
}

impl PublishOptions {
    /// Calls `put(prefix, name, value)` for every header these options produce (names lower-case: `prefix` +
    /// lower-cased `name`). The one place that defines the option → header mapping.
    fn each_header<E>(
        &self,
        mut put: impl FnMut(&'static str, &str, &str) -> Result<(), E>,
    ) -> Result<(), E> {
        if let Some(v) = &self.content_type {
            put("content-type", "", v)?;
        }
        if let Some(v) = &self.method {
            put("upstash-method", "", v)?;
        }
        if let Some(v) = &self.deduplication_id {
            put("upstash-deduplication-id", "", v)?;
        }
        if let Some(v) = self.retries {
            put("upstash-retries", "", &v.to_string())?;
        }
        if let Some(v) = &self.retry_delay {
            put("upstash-retry-delay", "", v)?;
        }
        if let Some(v) = self.delay {
            put("upstash-delay", "", &format!("{}s", v.as_secs()))?;
        }
        if let Some(v) = self.timeout {
            put("upstash-timeout", "", &format!("{}s", v.as_secs().max(1)))?;
        }
        if let Some(v) = &self.callback {
            put("upstash-callback", "", v)?;
        }
        if let Some(v) = &self.failure_callback {
            put("upstash-failure-callback", "", v)?;
        }
        for (k, v) in &self.callback_forward {
            put("upstash-callback-forward-", k, v)?;
        }
        for (k, v) in &self.failure_callback_forward {
            put("upstash-failure-callback-forward-", k, v)?;
        }
        for (k, v) in &self.forward {
            put("upstash-forward-", k, v)?;
        }
        if let Some(fc) = &self.flow_control
            && let Some(value) = fc.value()
        {
            put("upstash-flow-control-key", "", &fc.key)?;
            put("upstash-flow-control-value", "", &value)?;
        }
        if let Some(v) = &self.label {
            put("upstash-label", "", v)?;
        }
        Ok(())
    }

    /// The request headers for these options (lower-case names, as the official JS SDK sends in batches).
    pub fn headers(&self) -> Vec<(String, String)> {
        let mut h: Vec<(String, String)> = Vec::with_capacity(16 + self.forward.len());
        let _ = self.each_header::<std::convert::Infallible>(|prefix, name, value| {
            h.push((Prefixed(prefix, name).to_string(), value.to_owned()));
            Ok(())
        });
        h
    }

    /// The headers as a JSON object, serialized in place (the `/v2/batch` item's `headers`).
    pub fn headers_json(&self) -> HeadersJson<'_> {
        HeadersJson(self)
    }
}

/// [`PublishOptions`] as a JSON object of headers, written without intermediate strings.
pub struct HeadersJson<'a>(&'a PublishOptions);

impl Serialize for HeadersJson<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut m = s.serialize_map(None)?;
        self.0
            .each_header(|prefix, name, value| m.serialize_entry(&Prefixed(prefix, name), value))?;
        m.end()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flow_control_keys_are_sanitised_and_stay_distinct() {
        assert_eq!(
            flow_control_key("invoices.customer-7"),
            "invoices.customer-7"
        );
        let a = flow_control_key("invoices.a:b");
        let b = flow_control_key("invoices.a/b");
        assert!(
            a.starts_with("invoices.a_b-") && b.starts_with("invoices.a_b-") && a != b,
            "{a} {b}"
        );
        let long = flow_control_key(&"k".repeat(300));
        assert_eq!(long.len(), 100);
        assert!(
            long.bytes()
                .all(|c| c.is_ascii_alphanumeric() || b"._-".contains(&c))
        );
        assert_ne!(long, flow_control_key(&"k".repeat(301)));
    }

    #[test]
    fn option_to_header_mapping() {
        let o = PublishOptions {
            content_type: Some("application/json".into()),
            deduplication_id: Some("outbox-1".into()),
            retries: Some(5),
            delay: Some(Duration::from_secs(90)),
            callback: Some("https://cb/delivered".into()),
            failure_callback: Some("https://cb/failure".into()),
            callback_forward: vec![("X-Outbox-Id".into(), "1".into())],
            failure_callback_forward: vec![("X-Outbox-Id".into(), "1".into())],
            forward: vec![
                ("Traceparent".into(), "00-x".into()),
                ("X-Ünïcode-\"Quoted\"".into(), "u".into()),
                (format!("X-{}", "Long".repeat(40)).into(), "l".into()),
            ],
            flow_control: Some(FlowControl {
                key: "k".into(),
                parallelism: Some(1),
                rate: Some(10),
                period: Some(Duration::from_secs(60)),
            }),
            label: Some("invoices".into()),
            ..Default::default()
        };
        let h = o.headers();
        let get = |n: &str| h.iter().find(|(k, _)| k == n).map(|(_, v)| v.as_str());
        assert_eq!(get("upstash-deduplication-id"), Some("outbox-1"));
        assert_eq!(get("upstash-retries"), Some("5"));
        assert_eq!(get("upstash-delay"), Some("90s"));
        assert_eq!(get("upstash-callback-forward-x-outbox-id"), Some("1"));
        assert_eq!(
            get("upstash-failure-callback-forward-x-outbox-id"),
            Some("1")
        );
        assert_eq!(get("upstash-forward-traceparent"), Some("00-x"));
        assert_eq!(
            get("upstash-flow-control-value"),
            Some("parallelism=1, rate=10, period=60s")
        );
        assert_eq!(get("upstash-label"), Some("invoices"));
        assert_eq!(get("upstash-method"), None);
        assert_eq!(get("upstash-forward-x-Ünïcode-\"quoted\""), Some("u"));
        assert_eq!(
            get(&format!("upstash-forward-x-{}", "long".repeat(40))),
            Some("l")
        );
        // The in-place JSON form is the same mapping, through the value serializer and through the writer
        // (escaping, short names assembled on the stack, long ones through `Display`).
        let text = serde_json::to_string(&o.headers_json()).unwrap();
        for json in [
            serde_json::to_value(o.headers_json()).unwrap(),
            serde_json::from_str::<serde_json::Value>(&text).unwrap(),
        ] {
            assert_eq!(json.as_object().unwrap().len(), h.len());
            for (k, v) in &h {
                assert_eq!(
                    json[k.as_str()],
                    serde_json::Value::String(v.clone()),
                    "{k}"
                );
            }
        }
        // No limits → no flow-control headers at all (QStash would reject a key without a value).
        let none = PublishOptions {
            flow_control: Some(FlowControl {
                key: "k".into(),
                parallelism: None,
                rate: None,
                period: None,
            }),
            ..Default::default()
        };
        assert!(none.headers().is_empty());
    }
}
