//! Keeps the module layering honest. It reads the "Layout" list of the crate documentation (`lib.rs`) and every
//! source file under `src/`, and checks that:
//!
//! - every module declared in `lib.rs` has an entry, and every entry names a declared module;
//! - the documented "uses" relation has no cycle;
//! - every `crate::` path in a module's files (and every `super::` path that climbs to the crate root) names a
//!   module its entry allows, a crate-root re-export being counted as the module it comes from;
//! - in particular, the routers and the delivery engine never reach back into the server, and do not know each
//!   other (the `api ↔ server ↔ inspect ↔ deliver` circle this crate once had).
//!
//! It reads the files as text: a path written in a comment counts as a use, which errs on the strict side.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Module → the modules it may use (documented) or does use (found in the files).
type Graph = BTreeMap<String, BTreeSet<String>>;

/// Files under `src/` that belong to no layer: the crate root, the binary, and this test.
const NOT_LAYERED: [&str; 3] = ["lib.rs", "main.rs", "layering.rs"];

fn src_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}

fn backticked(s: &str) -> Vec<String> {
    s.split('`')
        .skip(1)
        .step_by(2)
        .map(str::to_string)
        .collect()
}

fn is_ident_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// The "Layout" list of the crate doc: entries `- `a`, `b`: what they own. Uses `x`, `y`.` (continued on
/// indented lines). The modules are the backticked names before the first `:`, the allowed ones those after the
/// last `Uses ` (none when the entry has no `Uses `).
fn documented(lib: &str) -> Graph {
    let mut entries: Vec<String> = Vec::new();
    let (mut in_layout, mut in_code) = (false, false);
    for line in lib.lines() {
        let Some(doc) = line.strip_prefix("//!") else {
            break;
        };
        let doc = doc.strip_prefix(' ').unwrap_or(doc);
        if doc.starts_with("```") {
            in_code = !in_code;
            continue;
        }
        if in_code {
            continue;
        }
        if doc.starts_with('#') {
            in_layout = doc.trim_start_matches('#').trim() == "Layout";
            continue;
        }
        if !in_layout {
            continue;
        }
        if let Some(entry) = doc.strip_prefix("- ") {
            entries.push(entry.to_string());
        } else if let (true, Some(last)) = (doc.starts_with("  "), entries.last_mut()) {
            last.push(' ');
            last.push_str(doc.trim());
        }
    }
    let mut g = Graph::new();
    for e in &entries {
        let (head, _) = e
            .split_once(':')
            .unwrap_or_else(|| panic!("Layout entry without `:`: {e}"));
        let uses: BTreeSet<String> = match e.rfind("Uses ") {
            Some(i) => backticked(&e[i..]).into_iter().collect(),
            None => BTreeSet::new(),
        };
        for m in backticked(head) {
            assert!(
                g.insert(m.clone(), uses.clone()).is_none(),
                "`{m}` has two Layout entries"
            );
        }
    }
    g
}

/// Modules declared in `lib.rs` (`mod x;`, `pub mod x;`).
fn declared(lib: &str) -> BTreeSet<String> {
    lib.lines()
        .map(str::trim)
        .filter_map(|l| l.strip_prefix("pub ").unwrap_or(l).strip_prefix("mod "))
        .filter_map(|l| l.strip_suffix(';'))
        .filter(|m| *m != "layering")
        .map(str::to_string)
        .collect()
}

/// Names the crate root re-exports (`pub use m::{A, B};`, `pub use m::A;`) → the module they come from.
fn root_exports(lib: &str) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for stmt in lib.split(';') {
        let Some(path) = stmt.trim().strip_prefix("pub use ") else {
            continue;
        };
        let (module, rest) = path.split_once("::").expect("pub use of a module path");
        let names = rest.trim_start_matches('{').trim_end_matches('}');
        for name in names.split(',').map(str::trim).filter(|n| !n.is_empty()) {
            out.insert(name.to_string(), module.to_string());
        }
    }
    out
}

/// The first segment of each path at `s` (just after `crate::`): `a::b` → `a`, `{a::B, c}` → `a`, `c`.
fn first_segments(s: &str) -> Vec<String> {
    if let Some(group) = s.strip_prefix('{') {
        let mut depth = 0;
        let mut items = vec![String::new()];
        for c in group.chars() {
            match c {
                '{' => depth += 1,
                '}' if depth == 0 => break,
                '}' => depth -= 1,
                ',' if depth == 0 => items.push(String::new()),
                _ => {}
            }
            if depth == 0
                && c != ','
                && c != '}'
                && let Some(last) = items.last_mut()
            {
                last.push(c);
            }
        }
        items
            .iter()
            .map(|i| i.trim().chars().take_while(|c| is_ident_char(*c)).collect())
            .filter(|i: &String| !i.is_empty())
            .collect()
    } else {
        let ident: String = s.chars().take_while(|c| is_ident_char(*c)).collect();
        if ident.is_empty() {
            vec![]
        } else {
            vec![ident]
        }
    }
}

/// Crate-root names a file's text refers to: after `crate::`, and after a `super::` chain at least `depth` long
/// (`depth`: 1 for `src/x.rs` and `src/x/mod.rs`, 2 for `src/x/y.rs`, ...). For `super::` only names that are
/// modules or root re-exports count, since an inline `mod tests` makes `super::` mean its own file.
fn root_refs(text: &str, depth: usize, known: &dyn Fn(&str) -> bool) -> Vec<String> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < text.len() {
        let rest = &text[i..];
        let starts_word = !text[..i].ends_with(|c: char| is_ident_char(c) || c == ':');
        if starts_word && rest.starts_with("crate::") {
            out.extend(first_segments(&rest["crate::".len()..]));
            i += "crate::".len();
        } else if starts_word && rest.starts_with("super::") {
            let mut n = 0;
            let mut after = rest;
            while let Some(r) = after.strip_prefix("super::") {
                n += 1;
                after = r;
            }
            if n >= depth {
                out.extend(first_segments(after).into_iter().filter(|s| known(s)));
            }
            i += "super::".len() * n;
        } else {
            i += rest.chars().next().map_or(1, char::len_utf8);
        }
    }
    out
}

/// Every layered source file: (top-level module, path, depth).
fn source_files() -> Vec<(String, PathBuf, usize)> {
    fn walk(dir: &Path, top: Option<&str>, depth: usize, out: &mut Vec<(String, PathBuf, usize)>) {
        let mut entries: Vec<_> = std::fs::read_dir(dir)
            .unwrap_or_else(|e| panic!("listing {}: {e}", dir.display()))
            .map(|e| e.expect("directory entry").path())
            .collect();
        entries.sort();
        for p in entries {
            let name = p
                .file_name()
                .and_then(|n| n.to_str())
                .unwrap_or_default()
                .to_string();
            if p.is_dir() {
                walk(&p, Some(top.unwrap_or(&name)), depth + 1, out);
            } else if let Some(stem) = name.strip_suffix(".rs") {
                if top.is_none() && NOT_LAYERED.contains(&name.as_str()) {
                    continue;
                }
                let module = top.unwrap_or(stem).to_string();
                let d = if stem == "mod" { depth } else { depth + 1 };
                out.push((module, p, d));
            }
        }
    }
    let mut out = Vec::new();
    walk(&src_dir(), None, 0, &mut out);
    out
}

/// What each module's files actually use, and where (for the failure message).
fn actual(lib: &str) -> (Graph, Vec<String>) {
    let modules = declared(lib);
    let exports = root_exports(lib);
    let known = |s: &str| modules.contains(s) || exports.contains_key(s);
    let mut g = Graph::new();
    let mut unknown = Vec::new();
    for (module, path, depth) in source_files() {
        let uses = g.entry(module.clone()).or_default();
        for name in root_refs(&read(&path), depth, &known) {
            let target = if modules.contains(&name) {
                name
            } else if let Some(m) = exports.get(&name) {
                m.clone()
            } else {
                unknown.push(format!("{}: crate::{name}", path.display()));
                continue;
            };
            if target != module {
                uses.insert(target);
            }
        }
    }
    (g, unknown)
}

/// A cycle in `g`, if any, as the list of modules on it.
fn find_cycle(g: &Graph) -> Option<Vec<String>> {
    fn visit(
        g: &Graph,
        m: &str,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(at) = path.iter().position(|p| p == m) {
            let mut cycle = path[at..].to_vec();
            cycle.push(m.to_string());
            return Some(cycle);
        }
        if done.contains(m) {
            return None;
        }
        path.push(m.to_string());
        for next in g.get(m).into_iter().flatten() {
            if let Some(c) = visit(g, next, path, done) {
                return Some(c);
            }
        }
        path.pop();
        done.insert(m.to_string());
        None
    }
    let mut done = BTreeSet::new();
    g.keys()
        .find_map(|m| visit(g, m, &mut Vec::new(), &mut done))
}

#[test]
fn the_scanner_sees_paths_and_groups() {
    let known = |s: &str| ["a", "c", "f"].contains(&s);
    let text = "use crate::{a::B, c as d};\nlet x = crate::e::f; mycrate::g; super::super::f::h; super::i;";
    assert_eq!(root_refs(text, 2, &known), ["a", "c", "e", "f"]);
    assert_eq!(root_refs("use super::*; use super::f;", 1, &known), ["f"]);
    let cyclic = Graph::from([
        ("x".into(), BTreeSet::from(["y".into()])),
        ("y".into(), BTreeSet::from(["x".into()])),
    ]);
    assert_eq!(
        find_cycle(&cyclic),
        Some(vec!["x".into(), "y".into(), "x".into()])
    );
}

#[test]
fn every_module_is_documented_and_the_layers_have_no_cycle() {
    let lib = read(&src_dir().join("lib.rs"));
    let doc = documented(&lib);
    let modules = declared(&lib);
    let listed: BTreeSet<String> = doc.keys().cloned().collect();
    assert_eq!(
        listed, modules,
        "the Layout list of lib.rs and the modules it declares differ"
    );
    for (m, uses) in &doc {
        let unknown: Vec<_> = uses.difference(&modules).collect();
        assert!(
            unknown.is_empty(),
            "`{m}` may use unknown modules {unknown:?}"
        );
    }
    assert_eq!(find_cycle(&doc), None, "the documented layers have a cycle");
}

#[test]
fn modules_use_only_what_the_layout_allows() {
    let lib = read(&src_dir().join("lib.rs"));
    let doc = documented(&lib);
    let (uses, unknown) = actual(&lib);
    assert!(
        unknown.is_empty(),
        "paths to nothing lib.rs declares: {unknown:#?}"
    );
    assert!(
        uses.get("server").is_some_and(|u| u.contains("api")),
        "the scanner found nothing: {uses:#?}"
    );
    let mut broken = Vec::new();
    for (m, found) in &uses {
        let allowed = doc.get(m).cloned().unwrap_or_default();
        for extra in found.difference(&allowed) {
            broken.push(format!("`{m}` uses `{extra}`"));
        }
    }
    assert!(
        broken.is_empty(),
        "uses the Layout list of lib.rs does not allow (change the code, or the list if the layering really \
         changes): {broken:#?}"
    );
    assert_eq!(find_cycle(&uses), None, "the modules' uses form a cycle");
}

#[test]
fn the_server_wires_modules_that_do_not_know_each_other() {
    let (uses, _) = actual(&read(&src_dir().join("lib.rs")));
    let uses_ = |m: &str, other: &str| uses.get(m).is_some_and(|u| u.contains(other));
    for m in ["api", "inspect", "deliver", "state", "view", "core"] {
        assert!(!uses_(m, "server"), "`{m}` must not use the server");
    }
    for (a, b) in [
        ("api", "inspect"),
        ("api", "deliver"),
        ("inspect", "deliver"),
    ] {
        assert!(
            !uses_(a, b) && !uses_(b, a),
            "`{a}` and `{b}` must not know each other"
        );
    }
    for m in ["api", "inspect", "deliver", "server"] {
        assert!(!uses_("state", m), "`state` must not use `{m}`");
    }
}
