//! Headers as QStash reports them: Go-style canonical names, grouped into `{name: [values...]}`.

use serde_json::{Map, Value};

use super::message::MsgData;

/// Go-style canonical header name (`content-type` → `Content-Type`).
pub(crate) fn canonical_header(name: &str) -> String {
    let mut out = String::with_capacity(name.len());
    let mut upper = true;
    for c in name.chars() {
        if upper {
            out.extend(c.to_uppercase());
        } else {
            out.extend(c.to_lowercase());
        }
        upper = c == '-';
    }
    out
}

/// [`header_multimap`] of a `HeaderMap` (non-UTF-8 values decoded lossily).
pub(crate) fn headermap_multimap(h: &http::HeaderMap) -> Value {
    let owned: Vec<(&str, String)> = h
        .iter()
        .map(|(k, v)| {
            (
                k.as_str(),
                String::from_utf8_lossy(v.as_bytes()).into_owned(),
            )
        })
        .collect();
    header_multimap(owned.iter().map(|(k, v)| (*k, v.as_str())))
}

/// `{name: [values...]}` with canonical names, values grouped in order.
pub(crate) fn header_multimap<'a>(pairs: impl Iterator<Item = (&'a str, &'a str)>) -> Value {
    let mut map: Map<String, Value> = Map::new();
    for (k, v) in pairs {
        let entry = map
            .entry(canonical_header(k))
            .or_insert_with(|| Value::Array(Vec::new()));
        if let Value::Array(a) = entry {
            a.push(Value::String(v.to_string()));
        }
    }
    Value::Object(map)
}

impl MsgData {
    /// A published message (not a callback of one).
    pub fn is_destination(&self) -> bool {
        self.kind == crate::types::AttemptKind::Destination
    }

    /// The headers the destination receives from the publisher: Content-Type and the forwarded ones.
    pub fn source_header_pairs(&self) -> Vec<(&str, &str)> {
        let mut v = Vec::with_capacity(self.forward.len() + 1);
        if let Some(ct) = &self.content_type {
            v.push(("content-type", ct.to_str().unwrap_or("")));
        }
        for (k, val) in &self.forward {
            v.push((k.as_str(), val.to_str().unwrap_or("")));
        }
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn canonical_names() {
        assert_eq!(canonical_header("content-type"), "Content-Type");
        assert_eq!(canonical_header("x-outbox-id"), "X-Outbox-Id");
    }
}
