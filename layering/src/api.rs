//! A crate's public surface as a list: every module reachable from the root through `pub mod`, and every item
//! and re-export declared `pub` in those modules, one line each (`fn crate::relay::drain`), sorted. Methods and
//! fields are not listed: they come with their type; nor are items a macro defines (the ids' newtypes), which
//! show through their re-exports. A committed copy of the list, compared in a test, makes a
//! change of the API visible in review.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use crate::scan::Declared;
use crate::tree::{ModPath, Tree};

/// One public item: its line in the list, and where it is declared.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct ApiItem {
    /// `fn crate::relay::drain`, `use crate::Relay = relay::cycle::Relay`.
    pub text: String,
    /// The declaring file, relative to the crate directory, and the line.
    pub file: String,
    pub line: usize,
}

/// The public surface of the crate in `crate_dir`, one item per line, sorted.
pub fn public_api(crate_dir: &Path) -> Result<Vec<ApiItem>, String> {
    let tree = Tree::read(crate_dir).map_err(|e| e.0)?;
    let mut declared: BTreeMap<ModPath, Vec<(&Declared, &str, usize)>> = BTreeMap::new();
    for file in &tree.files {
        for p in &file.scan.public {
            let m = [file.module.clone(), p.scope.clone()].concat();
            declared
                .entry(m)
                .or_default()
                .push((&p.what, file.shown.as_str(), p.line));
        }
    }
    let show = |m: &[String], name: &str| {
        let mut parts = vec!["crate".to_string()];
        parts.extend(m.iter().cloned());
        parts.push(name.to_string());
        parts.join("::")
    };
    let mut out = BTreeSet::new();
    let mut queue = vec![ModPath::new()];
    while let Some(m) = queue.pop() {
        for (d, file, line) in declared.get(&m).into_iter().flatten() {
            let text = match d {
                Declared::Module(name) => {
                    queue.push([m.clone(), vec![name.clone()]].concat());
                    format!("mod {}", show(&m, name))
                }
                Declared::Item(kind, name) => format!("{kind} {}", show(&m, name)),
                Declared::Use(path, name) => {
                    let name = name.as_deref().unwrap_or("*");
                    format!("use {} = {}", show(&m, name), path.join("::"))
                }
            };
            out.insert(ApiItem {
                text,
                file: file.to_string(),
                line: *line,
            });
        }
    }
    Ok(out.into_iter().collect())
}
