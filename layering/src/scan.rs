//! One file read as tokens: the modules it declares (files and inline `mod x { … }`), the items each of its
//! modules defines, its `use` declarations, and every `crate::`, `super::` and `self::` path in its code, each
//! with the module scope (the file's module plus the inline modules around it) and the line it is on.

use crate::lexer::code_only;

/// A path found in code, or one leaf of a `use` tree: its segments (`*` for a glob), as written.
#[derive(Debug, Clone, PartialEq)]
pub struct Path {
    /// Inline modules between the file's module and the place (`["tests"]` inside `mod tests { … }`).
    pub scope: Vec<String>,
    pub segments: Vec<String>,
    pub line: usize,
}

/// A `use` leaf: the path, and the name it brings into its scope (`None` for a glob).
#[derive(Debug, Clone, PartialEq)]
pub struct Use {
    pub path: Path,
    pub name: Option<String>,
    /// Inside a function body or other block: brings the name into that block only, never re-exported.
    pub in_block: bool,
}

/// A declaration visible outside the crate when its module is (`pub`, not `pub(crate)` or `pub(super)`).
#[derive(Debug, Clone, PartialEq)]
pub struct Public {
    /// Inline modules between the file's module and the declaration.
    pub scope: Vec<String>,
    pub what: Declared,
    pub line: usize,
}

/// What a public declaration is.
#[derive(Debug, Clone, PartialEq)]
pub enum Declared {
    /// `pub mod name` (a file or inline).
    Module(String),
    /// `pub fn name`, `pub struct name`, …: the keyword and the name.
    Item(&'static str, String),
    /// `pub use path` (one leaf): the name it binds, `None` for a glob.
    Use(Vec<String>, Option<String>),
}

/// What a file holds, as far as the checker cares.
#[derive(Debug, Default)]
pub struct Scan {
    /// `mod x;` declarations: (inline scope, name).
    pub file_modules: Vec<(Vec<String>, String)>,
    /// `mod x { … }`: the inline scope of each inline module, itself included.
    pub inline_modules: Vec<Vec<String>>,
    /// Items defined at module level: (inline scope, name).
    pub items: Vec<(Vec<String>, String)>,
    pub uses: Vec<Use>,
    /// Paths outside `use` declarations that start with `crate`, `super` or `self`.
    pub paths: Vec<Path>,
    /// The `pub` declarations at module level.
    pub public: Vec<Public>,
}

#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Tok {
    Ident(String),
    Punct(char),
    /// `::`
    Sep,
}

pub(crate) fn tokens(code: &str) -> Vec<(Tok, usize)> {
    let mut out = Vec::new();
    let (mut line, mut chars) = (1, code.char_indices().peekable());
    while let Some((i, c)) = chars.next() {
        match c {
            '\n' => line += 1,
            c if c.is_whitespace() => {}
            c if c.is_alphanumeric() || c == '_' || c == '$' => {
                let mut end = i + c.len_utf8();
                while let Some(&(j, d)) = chars.peek() {
                    if !(d.is_alphanumeric() || d == '_') {
                        break;
                    }
                    end = j + d.len_utf8();
                    chars.next();
                }
                out.push((Tok::Ident(code[i..end].to_string()), line));
            }
            ':' if chars.peek().map(|&(_, d)| d) == Some(':') => {
                chars.next();
                out.push((Tok::Sep, line));
            }
            c => out.push((Tok::Punct(c), line)),
        }
    }
    out
}

/// `#[cfg(test)]`, token by token.
const CFG_TEST: [&str; 7] = ["#", "[", "cfg", "(", "test", ")", "]"];

/// Whether `#[cfg(test)]` starts at token `start`.
pub(crate) fn cfg_test_at(toks: &[(Tok, usize)], start: usize) -> bool {
    CFG_TEST
        .iter()
        .enumerate()
        .all(|(k, a)| match toks.get(start + k).map(|t| &t.0) {
            Some(Tok::Ident(s)) => s == a,
            Some(Tok::Punct(c)) => a.len() == 1 && a.starts_with(*c),
            _ => false,
        })
}

const ITEM_KEYWORDS: [&str; 8] = [
    "fn", "struct", "enum", "trait", "type", "const", "static", "union",
];

/// What an open brace belongs to.
enum Brace {
    Module,
    /// A `#[cfg(test)]` inline module: test code, outside the graph (a unit test may use a test helper of a
    /// sibling that itself uses the file under test).
    TestModule,
    Block,
}

/// Reads one file's text.
pub fn scan(text: &str) -> Scan {
    let toks = tokens(&code_only(text));
    let ident = |i: usize| match toks.get(i) {
        Some((Tok::Ident(s), _)) => Some(s.as_str()),
        _ => None,
    };
    let is = |i: usize, t: Tok| toks.get(i).map(|(x, _)| x) == Some(&t);
    let mut out = Scan::default();
    let (mut scope, mut braces): (Vec<String>, Vec<Brace>) = (Vec::new(), Vec::new());
    let in_block = |braces: &[Brace]| matches!(braces.last(), Some(Brace::Block));
    let after_quote = |i: usize| i > 0 && is(i - 1, Tok::Punct('\''));
    // `pub` (unrestricted) before the declaration keyword at `i`, over `async`, `const`, `unsafe`, `extern`.
    let is_pub = |i: usize| {
        let mut j = i;
        while j > 0 {
            j -= 1;
            match &toks[j].0 {
                Tok::Ident(s) if ["async", "const", "unsafe", "extern"].contains(&s.as_str()) => {}
                Tok::Ident(s) => return s == "pub",
                _ => return false,
            }
        }
        false
    };
    // `#[cfg(test)]` just before token `i`.
    let cfg_test = |i: usize| i >= CFG_TEST.len() && cfg_test_at(&toks, i - CFG_TEST.len());
    let mut i = 0;
    while i < toks.len() {
        if braces.iter().any(|b| matches!(b, Brace::TestModule)) {
            match toks[i].0 {
                Tok::Punct('{') => braces.push(Brace::Block),
                Tok::Punct('}') => {
                    if let Some(Brace::TestModule) = braces.pop() {
                        scope.pop();
                    }
                }
                _ => {}
            }
            i += 1;
            continue;
        }
        let line = toks[i].1;
        let word = ident(i);
        let after_sep = i > 0 && is(i - 1, Tok::Sep);
        match word {
            Some("mod") if !in_block(&braces) => {
                if let Some(name) = ident(i + 1) {
                    if is(i + 2, Tok::Punct(';')) {
                        // A `#[cfg(test)] mod x;` file is test code, like an inline one.
                        if !cfg_test(i) {
                            out.file_modules.push((scope.clone(), name.to_string()));
                            if is_pub(i) {
                                out.public.push(Public {
                                    scope: scope.clone(),
                                    what: Declared::Module(name.to_string()),
                                    line,
                                });
                            }
                        }
                        i += 3;
                        continue;
                    }
                    if is(i + 2, Tok::Punct('{')) {
                        if is_pub(i) && !cfg_test(i) {
                            out.public.push(Public {
                                scope: scope.clone(),
                                what: Declared::Module(name.to_string()),
                                line,
                            });
                        }
                        scope.push(name.to_string());
                        out.inline_modules.push(scope.clone());
                        braces.push(if cfg_test(i) {
                            Brace::TestModule
                        } else {
                            Brace::Module
                        });
                        i += 3;
                        continue;
                    }
                }
            }
            Some("use") if !after_sep => {
                let end = (i..toks.len())
                    .find(|&j| is(j, Tok::Punct(';')))
                    .unwrap_or(toks.len());
                let public = is_pub(i) && !in_block(&braces);
                for (segments, name) in use_tree(&toks[i + 1..end]) {
                    if public {
                        out.public.push(Public {
                            scope: scope.clone(),
                            what: Declared::Use(segments.clone(), name.clone()),
                            line,
                        });
                    }
                    out.uses.push(Use {
                        path: Path {
                            scope: scope.clone(),
                            segments,
                            line,
                        },
                        name,
                        in_block: in_block(&braces),
                    });
                }
                i = end + 1;
                continue;
            }
            Some("macro_rules") if !in_block(&braces) && is(i + 1, Tok::Punct('!')) => {
                if let Some(name) = ident(i + 2) {
                    out.items.push((scope.clone(), name.to_string()));
                }
            }
            // Not `&'static str`: a lifetime is a quote and an identifier.
            Some(k)
                if ITEM_KEYWORDS.contains(&k)
                    && !in_block(&braces)
                    && !after_sep
                    && !after_quote(i) =>
            {
                // `const fn f`, `unsafe fn`: the name is after the last keyword.
                if let Some(name) = ident(i + 1).filter(|n| !ITEM_KEYWORDS.contains(n) && *n != "_")
                {
                    out.items.push((scope.clone(), name.to_string()));
                    if is_pub(i) {
                        let kind = ITEM_KEYWORDS
                            .iter()
                            .find(|kw| **kw == k)
                            .copied()
                            .unwrap_or("item");
                        out.public.push(Public {
                            scope: scope.clone(),
                            what: Declared::Item(kind, name.to_string()),
                            line,
                        });
                    }
                }
            }
            Some(root @ ("crate" | "$crate" | "super" | "self"))
                if !after_sep && is(i + 1, Tok::Sep) =>
            {
                let mut segments = vec![root.to_string()];
                let mut j = i + 1;
                while is(j, Tok::Sep) {
                    match ident(j + 1) {
                        Some(s) => segments.push(s.to_string()),
                        None => break,
                    }
                    j += 2;
                }
                out.paths.push(Path {
                    scope: scope.clone(),
                    segments,
                    line,
                });
                i = j;
                continue;
            }
            _ => {}
        }
        match toks[i].0 {
            Tok::Punct('{') => braces.push(Brace::Block),
            Tok::Punct('}') => {
                if let Some(Brace::Module | Brace::TestModule) = braces.pop() {
                    scope.pop();
                }
            }
            _ => {}
        }
        i += 1;
    }
    out
}

/// The leaves of a `use` tree (the tokens between `use` and `;`, visibility already behind): each path with
/// the name it binds (`None` for a glob). `a::{self, b::C as D, e::*}` → `[a] a`, `[a, b, C] D`, `[a, e, *]`.
fn use_tree(toks: &[(Tok, usize)]) -> Vec<(Vec<String>, Option<String>)> {
    fn tree(
        toks: &[(Tok, usize)],
        i: &mut usize,
        prefix: &[String],
        out: &mut Vec<(Vec<String>, Option<String>)>,
    ) {
        let mut path = prefix.to_vec();
        loop {
            match toks.get(*i).map(|t| &t.0) {
                Some(Tok::Sep) => *i += 1,
                Some(Tok::Ident(s)) if s == "as" => {
                    *i += 1;
                    if let Some(Tok::Ident(alias)) = toks.get(*i).map(|t| &t.0) {
                        *i += 1;
                        let alias = (alias != "_").then(|| alias.clone());
                        if let Some(a) = alias {
                            out.push((path, Some(a)));
                        }
                        return;
                    }
                }
                Some(Tok::Ident(s)) if s == "self" && !path.is_empty() => {
                    *i += 1;
                    let name = path.last().cloned();
                    out.push((path, name));
                    return;
                }
                Some(Tok::Ident(s)) => {
                    path.push(s.clone());
                    *i += 1;
                }
                Some(Tok::Punct('*')) => {
                    *i += 1;
                    path.push("*".to_string());
                    out.push((path, None));
                    return;
                }
                Some(Tok::Punct('{')) => {
                    *i += 1;
                    loop {
                        match toks.get(*i).map(|t| &t.0) {
                            None => return,
                            Some(Tok::Punct('}')) => {
                                *i += 1;
                                return;
                            }
                            Some(Tok::Punct(',')) => *i += 1,
                            _ => tree(toks, i, &path, out),
                        }
                    }
                }
                _ => {
                    if path.len() > prefix.len() {
                        let name = path.last().cloned();
                        out.push((path, name));
                    }
                    return;
                }
            }
        }
    }
    // Skip `pub`, `pub(crate)`, `pub(in a::b)` before the tree: the scanner stopped at `use`, so nothing to do.
    let mut out = Vec::new();
    let mut i = 0;
    tree(toks, &mut i, &[], &mut out);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn leaves(src: &str) -> Vec<String> {
        scan(src)
            .uses
            .iter()
            .map(|u| format!("{} {:?}", u.path.segments.join("::"), u.name))
            .collect()
    }

    #[test]
    fn use_trees_expand_to_their_leaves() {
        assert_eq!(
            leaves("pub(crate) use a::{self, b::C as D, e::*, f::{g, h}};"),
            [
                "a Some(\"a\")",
                "a::b::C Some(\"D\")",
                "a::e::* None",
                "a::f::g Some(\"g\")",
                "a::f::h Some(\"h\")"
            ]
        );
        assert_eq!(leaves("use super::*;"), ["super::* None"]);
        assert_eq!(leaves("use ::std::fmt;"), ["std::fmt Some(\"fmt\")"]);
    }

    #[test]
    fn modules_items_and_paths_have_their_scope_and_line() {
        let s = scan(
            "mod a;\n#[cfg(test)]\nmod t;\npub mod b {\n  pub fn f() { let x = crate::c::D::new(); }\n  struct S;\n}\n\
             impl T { fn m() {} }\nconst fn g() {}\n#[cfg(test)]\nmod tests { use super::*; }\n",
        );
        assert_eq!(s.file_modules, [(vec![], "a".to_string())]);
        assert_eq!(
            s.inline_modules,
            [vec!["b".to_string()], vec!["tests".to_string()]]
        );
        let items: Vec<_> = s.items.iter().map(|(sc, n)| format!("{sc:?}{n}")).collect();
        assert_eq!(items, ["[\"b\"]f", "[\"b\"]S", "[]g"]);
        assert_eq!(s.paths.len(), 1);
        assert_eq!(s.paths[0].segments, ["crate", "c", "D", "new"]);
        assert_eq!(
            (s.paths[0].scope.clone(), s.paths[0].line),
            (vec!["b".to_string()], 5)
        );
        // A `#[cfg(test)]` module is test code: nothing in it is drawn.
        assert!(s.uses.is_empty(), "{:?}", s.uses);
        let s = scan("mod inline { use super::*; }\n");
        assert_eq!(s.uses[0].path.scope, ["inline"]);
        assert!(!s.uses[0].in_block);
    }
}
