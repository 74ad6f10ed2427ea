//! Sizes a reader can hold: the functions and the files of a crate's non-test code over a limit of lines.
//! `#[cfg(test)]` modules do not count; a function counts from its `fn` line to its closing brace.

use std::path::Path;

use crate::lexer::code_only;
use crate::scan::{Tok, cfg_test_at, tokens};
use crate::tree::Tree;

/// Every function of the crate in `crate_dir` longer than `max` lines: `file:line name (n lines)`.
pub fn long_functions(crate_dir: &Path, max: usize) -> Result<Vec<String>, String> {
    let mut out = Vec::new();
    for (shown, text) in files(crate_dir)? {
        for (name, first, lines) in functions(&text) {
            if lines > max {
                out.push(format!("{shown}:{first} {name} ({lines} lines)"));
            }
        }
    }
    Ok(out)
}

/// Every file of the crate in `crate_dir` whose non-test code (up to its first `#[cfg(test)]` line at the left
/// margin) is longer than `max` lines: `file (n lines)`.
pub fn long_files(crate_dir: &Path, max: usize) -> Result<Vec<String>, String> {
    let mut out = Vec::new();
    for (shown, text) in files(crate_dir)? {
        let lines = text
            .lines()
            .take_while(|l| !l.starts_with("#[cfg(test)]"))
            .count();
        if lines > max {
            out.push(format!("{shown} ({lines} lines)"));
        }
    }
    Ok(out)
}

fn files(crate_dir: &Path) -> Result<Vec<(String, String)>, String> {
    let tree = Tree::read(crate_dir).map_err(|e| e.0)?;
    Ok(tree.files.into_iter().map(|f| (f.shown, f.text)).collect())
}

/// The functions with a body in `text`, outside `#[cfg(test)]` modules: name, first line, lines.
fn functions(text: &str) -> Vec<(String, usize, usize)> {
    let toks = tokens(&code_only(text));
    let punct = |i: usize, c: char| matches!(toks.get(i), Some((Tok::Punct(p), _)) if *p == c);
    let ident = |i: usize| match toks.get(i) {
        Some((Tok::Ident(s), _)) => Some(s.as_str()),
        _ => None,
    };
    let mut out = Vec::new();
    let mut i = 0;
    while i < toks.len() {
        // `#[cfg(test)] mod x { … }`: skipped whole.
        if cfg_test_at(&toks, i) && ident(i + 7) == Some("mod") && punct(i + 9, '{') {
            i = closing(&toks, i + 9) + 1;
            continue;
        }
        if let (Some("fn"), Some(name)) = (ident(i), ident(i + 1)) {
            // The body opens at the first `{` outside parentheses; a `;` first means no body.
            let mut j = i + 2;
            let mut parens = 0i32;
            while j < toks.len() {
                match toks[j].0 {
                    Tok::Punct('(') => parens += 1,
                    Tok::Punct(')') => parens -= 1,
                    Tok::Punct('{') | Tok::Punct(';') if parens == 0 => break,
                    _ => {}
                }
                j += 1;
            }
            if punct(j, '{') {
                let end = closing(&toks, j);
                let first = toks[i].1;
                let last = toks.get(end).map_or(first, |t| t.1);
                out.push((name.to_string(), first, last - first + 1));
            }
        }
        i += 1;
    }
    out
}

/// The index of the `}` that closes the `{` at `open` (the last token when it never closes).
fn closing(toks: &[(Tok, usize)], open: usize) -> usize {
    let mut depth = 0i32;
    for (k, (t, _)) in toks.iter().enumerate().skip(open) {
        match t {
            Tok::Punct('{') => depth += 1,
            Tok::Punct('}') => {
                depth -= 1;
                if depth == 0 {
                    return k;
                }
            }
            _ => {}
        }
    }
    toks.len().saturating_sub(1)
}

#[cfg(test)]
mod tests {
    use super::functions;

    #[test]
    fn functions_are_measured_from_fn_to_their_closing_brace_tests_left_out() {
        let text = "pub fn a() {\n    let s = \"}\";\n}\nfn b<T>(x: T) -> Vec<T>\nwhere\n    T: Clone,\n{\n    vec![x]\n}\n\
                    trait T { fn c(&self); }\n#[cfg(test)]\nmod tests {\n    fn d() {\n    }\n}\n";
        let found = functions(text);
        assert_eq!(found, [("a".to_string(), 1, 3), ("b".to_string(), 4, 6)]);
    }
}
