//! The workspace's one module-layering checker, used by the library (`outbox`), the operator CLI (`outbox-cli`)
//! and the QStash-compatible dev server (`qstash-dev`), each from a unit test that names its crate directory.
//!
//! It reads a crate the way the compiler finds it (from `src/lib.rs`, following every `mod x;`), draws the
//! import graph between its files from the code (every `use`, and every `crate::`, `super::` and `self::` path;
//! comments and strings do not count), and follows each path through re-exports and glob imports to the file
//! that defines what it names: `use super::Relay` in `relay/drain.rs` is an arrow to `relay/claim.rs` when
//! `relay/mod.rs` only re-exports `Relay` from there, and an arrow to `relay/mod.rs` when it defines it. Then:
//!
//! | rule | why |
//! |---|---|
//! | the crate's `# Layout` list names exactly the modules `lib.rs` declares | the list is the map a reader trusts |
//! | an arrow between two top-level modules is one the Layout allows | layers: a low module never knows a high one |
//! | no arrow from a file to a module above it in the tree (its `mod.rs`, the crate root) | a parent only declares and re-exports what its children define |
//! | no circle between files | a reader can take them one at a time, bottom up |
//!
//! The Layout's two forms (ordered, explicit) are in [`layout`].

mod api;
mod graph;
pub mod layout;
mod lexer;
mod resolve;
mod scan;
mod sizes;
mod tree;

use std::collections::BTreeMap;
use std::path::Path;

pub use api::{ApiItem, public_api};
use layout::Layout;
use resolve::Resolver;
pub use sizes::{long_files, long_functions};
use tree::Tree;

/// An arrow between two files (as shown: `src/relay/drain.rs`) → the places (`file:line`) that make it.
pub type Arrows = BTreeMap<(String, String), Vec<String>>;

/// What a check found.
pub struct Report {
    /// The crate's files, as shown.
    pub files: Vec<String>,
    pub arrows: Arrows,
    /// Each broken rule, with the places that break it. Empty: the crate is layered.
    pub problems: Vec<String>,
}

impl Report {
    /// Panics unless the scan saw each of `arrows` (`from` uses `to`): a checker that reads nothing passes
    /// everything, so each crate's test names arrows it must have drawn.
    pub fn assert_saw(&self, arrows: &[(&str, &str)]) {
        for (from, to) in arrows {
            assert!(
                self.uses(from, to),
                "the checker did not see {from} use {to}: {} arrows in {} files",
                self.arrows.len(),
                self.files.len()
            );
        }
    }

    /// Whether file `from` uses file `to` (paths relative to the crate directory, `src/…`).
    pub fn uses(&self, from: &str, to: &str) -> bool {
        self.arrows
            .contains_key(&(from.to_string(), to.to_string()))
    }
}

/// Checks the crate in `crate_dir` (the directory of its `Cargo.toml`); `Err` when it cannot be read or states
/// no Layout.
pub fn check(crate_dir: &Path) -> Result<Report, String> {
    let tree = Tree::read(crate_dir).map_err(|e| e.0)?;
    // The crate root is the tree's first file.
    let layout = Layout::read(&tree.files[0].text)?;
    Ok(report(&tree, Some(layout)))
}

/// The rules that need no Layout, for a crate that states none (the developer tools, the test kit): no arrow
/// from a file up to a module above it, no circle between files.
pub fn check_tree(crate_dir: &Path) -> Result<Report, String> {
    let tree = Tree::read(crate_dir).map_err(|e| e.0)?;
    Ok(report(&tree, None))
}

fn report(tree: &Tree, layout: Option<Layout>) -> Report {
    let arrows = arrows(tree);
    let mut problems = Vec::new();
    if let Some(layout) = &layout {
        problems.extend(listed_as_declared(tree, layout));
        problems.extend(against_layout(tree, layout, &arrows));
        problems.extend(graph::circles(&layout.stated(), "the Layout's stated uses"));
    }
    problems.extend(up_the_tree(tree, &arrows));
    problems.extend(graph::circles(&file_graph(&arrows), "files"));
    Report {
        files: tree.files.iter().map(|f| f.shown.clone()).collect(),
        arrows,
        problems,
    }
}

/// [`check`], panicking with every problem (a unit test's whole body). Returns the report, for a test to
/// check that the scan saw what it should.
pub fn assert_layered(crate_dir: &Path) -> Report {
    let report = check(crate_dir).unwrap_or_else(|e| panic!("{}: {e}", crate_dir.display()));
    assert!(
        report.problems.is_empty(),
        "{} is not layered as its Layout says (src/lib.rs):\n{}",
        crate_dir.display(),
        report.problems.join("\n")
    );
    report
}

/// [`check_tree`], panicking with every problem, like [`assert_layered`].
pub fn assert_tree(crate_dir: &Path) -> Report {
    let report = check_tree(crate_dir).unwrap_or_else(|e| panic!("{}: {e}", crate_dir.display()));
    assert!(
        report.problems.is_empty(),
        "{} has an arrow up the tree or a circle:\n{}",
        crate_dir.display(),
        report.problems.join("\n")
    );
    report
}

/// Every arrow between two different files.
fn arrows(tree: &Tree) -> Arrows {
    let resolver = Resolver::new(tree);
    let mut out = Arrows::new();
    for (index, file) in tree.files.iter().enumerate() {
        let uses = file.scan.uses.iter().map(|u| &u.path);
        for path in uses.chain(&file.scan.paths) {
            let scope = [file.module.clone(), path.scope.clone()].concat();
            let Some(to) = resolver.file(&scope, &path.segments) else {
                continue;
            };
            if to != index {
                out.entry((file.shown.clone(), tree.files[to].shown.clone()))
                    .or_default()
                    .push(format!(
                        "{}:{} ({})",
                        file.shown,
                        path.line,
                        path.segments.join("::")
                    ));
            }
        }
    }
    for places in out.values_mut() {
        places.dedup();
    }
    out
}

fn file_graph(arrows: &Arrows) -> graph::Graph {
    let mut g = graph::Graph::new();
    for (from, to) in arrows.keys() {
        g.entry(from.clone()).or_default().insert(to.clone());
    }
    g
}

/// The top-level modules `lib.rs` declares against the ones the Layout lists.
fn listed_as_declared(tree: &Tree, layout: &Layout) -> Vec<String> {
    let declared: std::collections::BTreeSet<String> = tree
        .files
        .iter()
        .filter(|f| f.module.len() == 1)
        .map(|f| f.module[0].clone())
        .collect();
    let listed = layout.modules();
    let mut out = Vec::new();
    for m in declared.difference(&listed) {
        out.push(format!(
            "`{m}` is declared in lib.rs but has no Layout entry"
        ));
    }
    for m in listed.difference(&declared) {
        out.push(format!(
            "the Layout lists `{m}`, which lib.rs does not declare"
        ));
    }
    out
}

/// Arrows between top-level modules that the Layout does not allow.
fn against_layout(tree: &Tree, layout: &Layout, arrows: &Arrows) -> Vec<String> {
    let top: BTreeMap<&str, Option<&str>> = tree
        .files
        .iter()
        .map(|f| (f.shown.as_str(), f.module.first().map(String::as_str)))
        .collect();
    let mut out = Vec::new();
    for ((from, to), places) in arrows {
        let (Some(Some(a)), Some(Some(b))) = (top.get(from.as_str()), top.get(to.as_str())) else {
            continue;
        };
        if a != b && !layout.allows(a, b) {
            out.push(format!(
                "`{a}` uses `{b}`, which its Layout entry does not allow: {}",
                places.join(", ")
            ));
        }
    }
    out
}

/// Arrows from a file to a module above it in the tree (its parent's `mod.rs`, the crate root).
fn up_the_tree(tree: &Tree, arrows: &Arrows) -> Vec<String> {
    let module: BTreeMap<&str, &[String]> = tree
        .files
        .iter()
        .map(|f| (f.shown.as_str(), f.module.as_slice()))
        .collect();
    let mut out = Vec::new();
    for ((from, to), places) in arrows {
        let (Some(a), Some(b)) = (module.get(from.as_str()), module.get(to.as_str())) else {
            continue;
        };
        if a.len() > b.len() && a.starts_with(b) {
            out.push(format!(
                "{from} uses what {to} defines, a module above it (a parent only declares and re-exports; move \
                 the item into a file of its own): {}",
                places.join(", ")
            ));
        }
    }
    out
}
