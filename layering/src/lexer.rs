//! Rust source as code only: comments, string literals and character literals blanked out (each character
//! replaced by a space, newlines kept), so that offsets and line numbers still match the file and no path written
//! in documentation or in a string counts as a use.

/// `text` with every comment and literal blanked; same length in bytes, same lines.
pub fn code_only(text: &str) -> String {
    let b = text.as_bytes();
    let mut out = b.to_vec();
    let mut i = 0;
    while i < b.len() {
        let start = i;
        i = match b[i] {
            b'/' if b.get(i + 1) == Some(&b'/') => line_end(b, i),
            b'/' if b.get(i + 1) == Some(&b'*') => block_comment_end(b, i),
            b'"' => string_end(b, i + 1),
            b'r' | b'b' if !follows_ident(b, i) => match raw_or_byte_string(b, i) {
                Some(end) => end,
                None => i + 1,
            },
            b'\'' => match char_literal_end(b, i) {
                Some(end) => end,
                None => i + 1,
            },
            _ => i + 1,
        };
        if i > start + 1 {
            blank(&mut out[start..i]);
        }
    }
    // Only ASCII bytes were replaced, and only whole characters inside blanked ranges: still UTF-8.
    String::from_utf8(out).unwrap_or_else(|_| text.to_string())
}

/// Spaces for every byte but newlines (a multi-byte character becomes several spaces: offsets stay right).
fn blank(range: &mut [u8]) {
    for c in range {
        if *c != b'\n' {
            *c = b' ';
        }
    }
}

fn follows_ident(b: &[u8], i: usize) -> bool {
    i > 0 && (b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'_')
}

fn line_end(b: &[u8], i: usize) -> usize {
    b[i..]
        .iter()
        .position(|&c| c == b'\n')
        .map_or(b.len(), |p| i + p)
}

/// The end of a (possibly nested) block comment starting at `i`.
fn block_comment_end(b: &[u8], mut i: usize) -> usize {
    let mut depth = 0;
    while i < b.len() {
        if b[i..].starts_with(b"/*") {
            depth += 1;
            i += 2;
        } else if b[i..].starts_with(b"*/") {
            depth -= 1;
            i += 2;
            if depth == 0 {
                return i;
            }
        } else {
            i += 1;
        }
    }
    b.len()
}

/// The end (after the closing quote) of a string whose contents start at `i`.
fn string_end(b: &[u8], mut i: usize) -> usize {
    while i < b.len() {
        match b[i] {
            b'\\' => i += 2,
            b'"' => return i + 1,
            _ => i += 1,
        }
    }
    b.len()
}

/// `r"…"`, `r#"…"#`, `b"…"`, `br#"…"#`, `c"…"` forms starting at `i`: the end, or `None` for an identifier.
fn raw_or_byte_string(b: &[u8], i: usize) -> Option<usize> {
    let mut j = i;
    if b[j] == b'b' {
        j += 1;
        if b.get(j) == Some(&b'"') {
            return Some(string_end(b, j + 1));
        }
        if b.get(j) == Some(&b'\'') {
            return char_literal_end(b, j);
        }
    }
    if b.get(j) != Some(&b'r') {
        return None;
    }
    j += 1;
    let hashes = b[j..].iter().take_while(|&&c| c == b'#').count();
    j += hashes;
    if b.get(j) != Some(&b'"') {
        return None;
    }
    let mut close = vec![b'"'];
    close.extend(std::iter::repeat_n(b'#', hashes));
    let body = j + 1;
    Some(
        b[body..]
            .windows(close.len())
            .position(|w| w == close.as_slice())
            .map_or(b.len(), |p| body + p + close.len()),
    )
}

/// A character literal at `i` (`'a'`, `'\n'`, `'\u{1F600}'`, `'é'`): its end; `None` for a lifetime (`'a`).
fn char_literal_end(b: &[u8], i: usize) -> Option<usize> {
    if b.get(i + 1) == Some(&b'\\') {
        let close = b[i + 2..].iter().position(|&c| c == b'\'')?;
        return Some(i + 2 + close + 1);
    }
    // One character (1 to 4 bytes in UTF-8), then the closing quote.
    let len = match *b.get(i + 1)? {
        c if c < 0x80 => 1,
        c if c >= 0xF0 => 4,
        c if c >= 0xE0 => 3,
        _ => 2,
    };
    (b.get(i + 1 + len) == Some(&b'\'')).then_some(i + 2 + len)
}

#[cfg(test)]
mod tests {
    use super::code_only;

    #[test]
    fn comments_strings_and_chars_are_blanked_lifetimes_are_not() {
        let src = "use a; // crate::x\n/* crate::y /* nested */ still */ let s = \"crate::z \\\" q\";\n\
                   let r = r#\"crate::w \"# ; let c = '\\''; let d = '{'; fn f<'a>(x: &'a str) {}";
        let code = code_only(src);
        assert_eq!(code.len(), src.len());
        assert_eq!(code.lines().count(), src.lines().count());
        assert!(!code.contains("crate::"), "{code}");
        assert!(
            !code.contains('{') || code.contains("x: &'a str) {}"),
            "{code}"
        );
        assert!(code.contains("fn f<'a>(x: &'a str) {}"), "{code}");
        assert_eq!(code.matches('{').count(), 1, "{code}");
    }
}
