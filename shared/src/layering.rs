//! Keeps the module layering honest: one-way dependencies between the library's modules. It reads the "Layout"
//! list of the crate documentation (`lib.rs`) and every source file under `src/`, and checks that:
//!
//! - every module declared in `lib.rs` has an entry, and every entry names a declared module;
//! - every `crate::` path in a module's code (and every `super::` path that climbs to the crate root) names a
//!   module listed before it, a crate-root re-export being counted as the module it comes from and the crate
//!   root's own items (`install_crypto_provider`, …) being open to every module;
//! - the files of one module (`consumer/http.rs`, `consumer/batch.rs`, …) do not use each other in a circle,
//!   through `super::` or `crate::<module>::` paths (`mod.rs` itself, which declares them, is not counted).
//!
//! It reads the files as text, without comment lines: a path in documentation (an intra-doc link) does not make
//! the code depend on that module, and the docs of a low module may point up to where it is used. A path in a
//! string literal still counts, which errs on the strict side.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Module (or file of a module) → the ones it uses, each with the places that do.
type Graph = BTreeMap<String, BTreeMap<String, Vec<String>>>;

/// Files under `src/` that belong to no layer: the crate root and this test.
const NOT_LAYERED: [&str; 2] = ["lib.rs", "layering.rs"];

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

/// The "Layout" list of the crate doc, lowest first: entries `- `a`: what it owns.` (continued on indented
/// lines). The module of an entry is the first backticked name before the first `:`.
fn documented(lib: &str) -> Vec<String> {
    let mut order = Vec::new();
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
        if let (true, Some(entry)) = (in_layout, doc.strip_prefix("- ")) {
            let (head, _) = entry
                .split_once(':')
                .unwrap_or_else(|| panic!("Layout entry without `:`: {entry}"));
            let module = backticked(head)
                .into_iter()
                .next()
                .unwrap_or_else(|| panic!("Layout entry without a `module`: {entry}"));
            assert!(
                !order.contains(&module),
                "`{module}` has two Layout entries"
            );
            order.push(module);
        }
    }
    order
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

/// Items the crate root defines itself (`pub fn x`, `pub async fn x`, `pub static X`): they use no layer above
/// `schema` and are open to every module.
fn root_items(lib: &str) -> BTreeSet<String> {
    lib.lines()
        .filter_map(|l| {
            let l = l.strip_prefix("pub ")?;
            let l = l.strip_prefix("async ").unwrap_or(l);
            let l = l
                .strip_prefix("fn ")
                .or_else(|| l.strip_prefix("static "))
                .or_else(|| l.strip_prefix("const "))?;
            Some(l.chars().take_while(|c| is_ident_char(*c)).collect())
        })
        .collect()
}

/// The segments of each path at `s` (just after `crate::` or `super::`): `a::b::C` → `[a, b, C]`, `{a::B, c}` →
/// `[a, B]`, `[c]`.
fn paths_at(s: &str) -> Vec<Vec<String>> {
    fn segments(s: &str) -> Vec<String> {
        let mut out = Vec::new();
        let mut rest = s.trim_start();
        loop {
            let ident: String = rest.chars().take_while(|c| is_ident_char(*c)).collect();
            if ident.is_empty() {
                break;
            }
            rest = &rest[ident.len()..];
            out.push(ident);
            match rest.strip_prefix("::") {
                Some(r) if !r.starts_with('{') => rest = r,
                _ => break,
            }
        }
        out
    }
    if let Some(group) = s.strip_prefix('{') {
        let mut depth = 0;
        let mut items = vec![String::new()];
        for c in group.chars() {
            match c {
                '{' => depth += 1,
                '}' if depth == 0 => break,
                '}' => depth -= 1,
                ',' if depth == 0 => {
                    items.push(String::new());
                    continue;
                }
                _ => {}
            }
            if let Some(last) = items.last_mut() {
                last.push(c);
            }
        }
        items
            .iter()
            .map(|i| segments(i))
            .filter(|p| !p.is_empty())
            .collect()
    } else {
        let p = segments(s);
        if p.is_empty() { vec![] } else { vec![p] }
    }
}

/// A path found in a file: how many `super::` it starts with (`None` for `crate::`), and its segments.
#[derive(Debug, PartialEq)]
struct Ref {
    supers: Option<usize>,
    path: Vec<String>,
}

/// The `crate::` and `super::` paths in a file's code (comment lines skipped), with their line numbers.
fn refs(text: &str) -> Vec<(usize, Ref)> {
    let mut out = Vec::new();
    for (n, line) in text.lines().enumerate() {
        if line.trim_start().starts_with("//") {
            continue;
        }
        let mut i = 0;
        while i < line.len() {
            let rest = &line[i..];
            let starts_word = !line[..i].ends_with(|c: char| is_ident_char(c) || c == ':');
            if starts_word && rest.starts_with("crate::") {
                for path in paths_at(&rest["crate::".len()..]) {
                    out.push((n + 1, Ref { supers: None, path }));
                }
                i += "crate::".len();
            } else if starts_word && rest.starts_with("super::") {
                let mut k = 0;
                let mut after = rest;
                while let Some(r) = after.strip_prefix("super::") {
                    k += 1;
                    after = r;
                }
                for path in paths_at(after) {
                    out.push((
                        n + 1,
                        Ref {
                            supers: Some(k),
                            path,
                        },
                    ));
                }
                i += "super::".len() * k;
            } else {
                i += rest.chars().next().map_or(1, char::len_utf8);
            }
        }
    }
    out
}

/// A layered source file.
struct File {
    /// Its top-level module.
    module: String,
    /// Its file stem inside the module's directory (`None` for `src/x.rs` and `src/x/mod.rs`).
    sub: Option<String>,
    path: PathBuf,
}

/// Every layered source file (the crate's modules are at most one directory deep).
fn source_files() -> Vec<File> {
    let mut out = Vec::new();
    let mut top: Vec<PathBuf> = std::fs::read_dir(src_dir())
        .expect("listing src/")
        .map(|e| e.expect("directory entry").path())
        .collect();
    top.sort();
    for p in top {
        let name = p
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default()
            .to_string();
        if p.is_dir() {
            let mut files: Vec<PathBuf> = std::fs::read_dir(&p)
                .unwrap_or_else(|e| panic!("listing {}: {e}", p.display()))
                .map(|e| e.expect("directory entry").path())
                .collect();
            files.sort();
            for f in files {
                assert!(
                    !f.is_dir(),
                    "{} is nested deeper than the scan reads",
                    f.display()
                );
                let Some(stem) = f.file_stem().and_then(|s| s.to_str()).map(str::to_string) else {
                    continue;
                };
                let sub = (stem != "mod").then_some(stem);
                out.push(File {
                    module: name.clone(),
                    sub,
                    path: f,
                });
            }
        } else if let Some(stem) = name.strip_suffix(".rs")
            && !NOT_LAYERED.contains(&name.as_str())
        {
            out.push(File {
                module: stem.to_string(),
                sub: None,
                path: p,
            });
        }
    }
    out
}

/// What the files actually use: module → module, and module file → sibling file; plus the paths to nothing.
fn actual(lib: &str) -> (Graph, Graph, Vec<String>) {
    let modules = declared(lib);
    let exports = root_exports(lib);
    let items = root_items(lib);
    let files = source_files();
    let (mut uses, mut siblings, mut unknown) = (Graph::new(), Graph::new(), Vec::new());
    for file in &files {
        let is_sibling = |s: &str| {
            files
                .iter()
                .any(|f| f.module == file.module && f.sub.as_deref() == Some(s))
        };
        // How many `super::` climb from this file's code to the crate root.
        let depth = if file.sub.is_some() { 2 } else { 1 };
        uses.entry(file.module.clone()).or_default();
        for (line, r) in refs(&read(&file.path)) {
            let shown = file
                .path
                .strip_prefix(env!("CARGO_MANIFEST_DIR"))
                .unwrap_or(&file.path);
            let place = format!("{}:{line}", shown.display());
            let from_root: &[String] = match r.supers {
                None => &r.path,
                Some(k) if k >= depth => &r.path,
                // `super::x` in a module's file: a sibling file, or an item of `mod.rs` (not counted).
                Some(k) if k == depth - 1 => {
                    if let (Some(sub), true) = (&file.sub, is_sibling(&r.path[0]))
                        && *sub != r.path[0]
                    {
                        siblings
                            .entry(format!("{}/{sub}", file.module))
                            .or_default()
                            .entry(format!("{}/{}", file.module, r.path[0]))
                            .or_default()
                            .push(place);
                    }
                    continue;
                }
                // Inside an inline `mod tests`: its own file.
                Some(_) => continue,
            };
            let name = &from_root[0];
            let target = if modules.contains(name) {
                name.clone()
            } else if let Some(m) = exports.get(name) {
                m.clone()
            } else if items.contains(name) {
                continue;
            } else {
                // `super::super::x` from an inline `mod tests` may name an item of the file's parent.
                if r.supers.is_none() {
                    unknown.push(format!("{place}: crate::{name}"));
                }
                continue;
            };
            if target != file.module {
                uses.entry(file.module.clone())
                    .or_default()
                    .entry(target)
                    .or_default()
                    .push(place);
            } else if let (Some(next), Some(sub)) = (from_root.get(1), &file.sub)
                && is_sibling(next)
                && next != sub
            {
                siblings
                    .entry(format!("{}/{sub}", file.module))
                    .or_default()
                    .entry(format!("{}/{next}", file.module))
                    .or_default()
                    .push(place);
            }
        }
    }
    (uses, siblings, unknown)
}

/// Every cycle in `g` that passes through at least one edge not seen before, each as the list of nodes on it.
fn cycles(g: &Graph) -> Vec<Vec<String>> {
    fn visit(
        g: &Graph,
        m: &str,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
        found: &mut Vec<Vec<String>>,
    ) {
        if let Some(at) = path.iter().position(|p| p == m) {
            let mut cycle = path[at..].to_vec();
            cycle.push(m.to_string());
            found.push(cycle);
            return;
        }
        if done.contains(m) {
            return;
        }
        path.push(m.to_string());
        for next in g.get(m).into_iter().flat_map(BTreeMap::keys) {
            visit(g, next, path, done, found);
        }
        path.pop();
        done.insert(m.to_string());
    }
    let (mut done, mut found) = (BTreeSet::new(), Vec::new());
    for m in g.keys() {
        visit(g, m, &mut Vec::new(), &mut done, &mut found);
    }
    found
}

/// A cycle with the places that make each of its steps.
fn describe(g: &Graph, cycle: &[String]) -> String {
    let mut s = cycle.join(" → ");
    for step in cycle.windows(2) {
        let places = &g[&step[0]][&step[1]];
        s.push_str(&format!(
            "\n    {} → {}: {}",
            step[0],
            step[1],
            places.join(", ")
        ));
    }
    s
}

#[test]
fn the_scanner_sees_paths_groups_and_climbs() {
    let text = "use crate::{a::B, c as d};\nlet x = crate::e::f::G; mycrate::g; super::super::h;\n\
                // crate::not_code\nuse super::{i, j::K};";
    let found: Vec<_> = refs(text)
        .into_iter()
        .map(|(line, r)| (line, r.supers, r.path.join("::")))
        .collect();
    assert_eq!(
        found,
        [
            (1, None, "a::B".into()),
            (1, None, "c".into()),
            (2, None, "e::f::G".into()),
            (2, Some(2), "h".into()),
            (4, Some(1), "i".into()),
            (4, Some(1), "j::K".into()),
        ]
    );
    let edge = |a: &str, b: &str| (a.to_string(), BTreeMap::from([(b.to_string(), vec![])]));
    let cyclic = Graph::from([edge("x", "y"), edge("y", "x"), edge("z", "x")]);
    assert_eq!(cycles(&cyclic), [vec!["x", "y", "x"]]);
    assert!(cycles(&Graph::from([edge("x", "y"), edge("z", "y")])).is_empty());
}

#[test]
fn every_module_has_one_place_in_the_layout() {
    let lib = read(&src_dir().join("lib.rs"));
    let listed: BTreeSet<String> = documented(&lib).into_iter().collect();
    assert_eq!(
        listed,
        declared(&lib),
        "the Layout list of lib.rs and the modules it declares differ"
    );
}

#[test]
fn modules_use_only_modules_listed_before_them_in_the_layout() {
    let lib = read(&src_dir().join("lib.rs"));
    let order = documented(&lib);
    let rank = |m: &str| order.iter().position(|o| o == m);
    let (uses, _, unknown) = actual(&lib);
    assert!(
        unknown.is_empty(),
        "paths to nothing lib.rs declares or re-exports: {unknown:#?}"
    );
    assert!(
        uses.get("relay").is_some_and(|u| u.contains_key("db")),
        "the scanner found nothing: {uses:#?}"
    );
    let mut broken = Vec::new();
    for (m, found) in &uses {
        // A module missing from the list is reported by `every_module_has_one_place_in_the_layout`.
        let Some(own) = rank(m) else { continue };
        for (used, places) in found {
            if rank(used).is_none_or(|r| r >= own) {
                broken.push(format!(
                    "`{m}` uses `{used}`, which the Layout does not list before it: {}",
                    places.join(", ")
                ));
            }
        }
    }
    assert!(
        broken.is_empty(),
        "uses against the Layout list of lib.rs (move the code down, or change the list if the layering really \
         changes):\n{}",
        broken.join("\n")
    );
    let found = cycles(&uses);
    assert!(
        found.is_empty(),
        "the modules' uses form a cycle:\n{}",
        found
            .iter()
            .map(|c| describe(&uses, c))
            .collect::<Vec<_>>()
            .join("\n")
    );
}

#[test]
fn the_files_of_a_module_do_not_use_each_other_in_a_cycle() {
    let (_, siblings, _) = actual(&read(&src_dir().join("lib.rs")));
    assert!(
        siblings
            .get("consumer/batch")
            .is_some_and(|u| u.contains_key("consumer/registry")),
        "the scanner found no use between the files of a module: {siblings:#?}"
    );
    let found = cycles(&siblings);
    assert!(
        found.is_empty(),
        "files of one module use each other in a cycle (move what both need into a file of its own):\n{}",
        found
            .iter()
            .map(|c| describe(&siblings, c))
            .collect::<Vec<_>>()
            .join("\n")
    );
}
