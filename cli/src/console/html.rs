//! HTML output that cannot carry stored text unescaped.
//!
//! [`Html`] is the only thing a page handler can answer with, and it grows in three ways only: literal markup
//! from the program's own `'static` text ([`Html::lit`]), a value passed through [`escape`] ([`Html::text`],
//! [`Html::lines`]), or a link built from a fixed path and escaped, percent-encoded parameters ([`Html::href`]).
//! A stored string is never `'static`, so it cannot reach `lit`; the way to put it in a page is the escaper.

use std::fmt::{Display, Write};

/// A fragment of HTML built only from the program's own markup and escaped values.
#[derive(Debug, Clone, Default)]
pub struct Html(String);

impl Html {
    /// An empty fragment.
    pub fn new() -> Self {
        Html(String::new())
    }

    /// Appends literal markup: text of the program itself (a `'static` string), never a stored value.
    pub fn lit(&mut self, markup: &'static str) -> &mut Self {
        self.0.push_str(markup);
        self
    }

    /// Appends a value as text, escaped for an element's content or a double-quoted attribute: one line (a
    /// newline shows as `\n`).
    pub fn text(&mut self, value: impl Display) -> &mut Self {
        escape_into(&mut self.0, &value.to_string(), false);
        self
    }

    /// Appends a multi-line value (a pretty-printed payload, a response body) for a `<pre>`: newlines and tabs
    /// stay, everything else as [`Html::text`].
    pub fn lines(&mut self, value: &str) -> &mut Self {
        escape_into(&mut self.0, value, true);
        self
    }

    /// Appends `path` with `params` as its query string (each name and value percent-encoded, then escaped for
    /// the attribute it goes in), for `href="…"` and `action="…"`. Empty values are left out.
    pub fn href(&mut self, path: &'static str, params: &[(&str, &str)]) -> &mut Self {
        self.0.push_str(path);
        let query = query_string(params);
        if !query.is_empty() {
            self.0.push('?');
            escape_into(&mut self.0, &query, false);
        }
        self
    }

    /// `path` followed by a number (`/events/12`): the number is the program's own formatting.
    pub fn path_id(&mut self, path: &'static str, id: impl std::fmt::Display) -> &mut Self {
        self.0.push_str(path);
        let _ = write!(self.0, "{id}");
        self
    }

    /// Appends another fragment.
    pub fn push(&mut self, other: &Html) -> &mut Self {
        self.0.push_str(&other.0);
        self
    }

    /// The finished markup.
    pub fn into_string(self) -> String {
        self.0
    }

    /// The markup so far (tests).
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// `a=1&b=x%20y`: names and values percent-encoded (`application/x-www-form-urlencoded`), empty values left out.
pub fn query_string(params: &[(&str, &str)]) -> String {
    let mut s = url::form_urlencoded::Serializer::new(String::new());
    for (k, v) in params.iter().filter(|(_, v)| !v.is_empty()) {
        s.append_pair(k, v);
    }
    s.finish()
}

/// Escapes `value` for HTML text and double- or single-quoted attributes: `& < > " '` become entities; control
/// characters, bidirectional controls and the Unicode line separators become visible `\u{…}` text (the same set
/// the terminal output escapes, `crate::util::printable`), so that stored text can neither open markup nor
/// reorder or hide what the page shows. With `multi_line`, newlines and tabs stay.
pub fn escape(value: &str, multi_line: bool) -> String {
    let mut out = String::with_capacity(value.len());
    escape_into(&mut out, value, multi_line);
    out
}

fn escape_into(out: &mut String, value: &str, multi_line: bool) {
    let printable = if multi_line {
        crate::util::printable_lines(value)
    } else {
        crate::util::printable(value)
    };
    for c in printable.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn markup_and_quotes_become_entities() {
        assert_eq!(
            escape(
                r#"<script>alert('x')</script> "><img src=x onerror=alert(1)> & co"#,
                false
            ),
            "&lt;script&gt;alert(&#39;x&#39;)&lt;/script&gt; &quot;&gt;&lt;img src=x onerror=alert(1)&gt; &amp; co"
        );
    }

    #[test]
    fn controls_and_bidi_overrides_become_visible() {
        assert_eq!(
            escape("a\u{202e}b\x1b[31mc\rd\ne", false),
            "a\\u{202e}b\\u{1b}[31mc\\rd\\ne"
        );
        assert_eq!(escape("a\n\tb\u{2066}", true), "a\n\tb\\u{2066}");
    }

    #[test]
    fn links_encode_then_escape() {
        let mut h = Html::new();
        h.href("/keys", &[("key", "a&b\"<c> é"), ("topic", "")]);
        assert_eq!(h.as_str(), "/keys?key=a%26b%22%3Cc%3E+%C3%A9");
        let mut h = Html::new();
        h.href("/x", &[("a", "1"), ("b", "2")]);
        assert_eq!(h.as_str(), "/x?a=1&amp;b=2");
    }
}
