//! The layout a crate states in its root documentation: a `# Layout` section of `//!` lines whose entries read
//! `` - `a`: what it owns. `` (continued on indented lines). Two forms:
//!
//! - **ordered**: no entry says what it uses; the list runs from the bottom up and each module may use only the
//!   modules listed before it;
//! - **explicit**: entries end in `` Uses `x`, `y`. `` (none said: uses nothing); an entry may name several
//!   modules (`` - `sign`, `expr`: … ``).

use std::collections::{BTreeMap, BTreeSet};

/// A crate's stated layout.
pub enum Layout {
    /// Modules bottom up.
    Ordered(Vec<String>),
    /// Module → the modules it may use.
    Explicit(BTreeMap<String, BTreeSet<String>>),
}

fn backticked(s: &str) -> Vec<String> {
    s.split('`')
        .skip(1)
        .step_by(2)
        .map(str::to_string)
        .collect()
}

/// The entries of the `# Layout` section of `lib`'s leading `//!` lines, each joined into one line.
fn entries(lib: &str) -> Vec<String> {
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
    entries
}

impl Layout {
    /// The layout `lib` (a crate root's text) states, or why it states none.
    pub fn read(lib: &str) -> Result<Layout, String> {
        let entries = entries(lib);
        if entries.is_empty() {
            return Err("the crate documentation has no `# Layout` list".into());
        }
        let mut parsed = Vec::new();
        for e in &entries {
            let (head, _) = e
                .split_once(':')
                .ok_or_else(|| format!("Layout entry without `:`: {e}"))?;
            let modules = backticked(head);
            if modules.is_empty() {
                return Err(format!("Layout entry names no `module`: {e}"));
            }
            let uses = e.rfind("Uses `").map(|i| backticked(&e[i..]));
            parsed.push((modules, uses));
        }
        let explicit = parsed.iter().any(|(_, uses)| uses.is_some());
        let mut seen = BTreeSet::new();
        for m in parsed.iter().flat_map(|(ms, _)| ms) {
            if !seen.insert(m.clone()) {
                return Err(format!("`{m}` has two Layout entries"));
            }
        }
        if !explicit {
            if let Some((ms, _)) = parsed.iter().find(|(ms, _)| ms.len() > 1) {
                return Err(format!(
                    "an entry of an ordered Layout names one module, not {ms:?}"
                ));
            }
            return Ok(Layout::Ordered(
                parsed.into_iter().flat_map(|(m, _)| m).collect(),
            ));
        }
        let mut g = BTreeMap::new();
        for (modules, uses) in parsed {
            let uses: BTreeSet<String> = uses.unwrap_or_default().into_iter().collect();
            for m in modules {
                g.insert(m, uses.clone());
            }
        }
        Ok(Layout::Explicit(g))
    }

    /// The modules the layout lists.
    pub fn modules(&self) -> BTreeSet<String> {
        match self {
            Layout::Ordered(order) => order.iter().cloned().collect(),
            Layout::Explicit(g) => g.keys().cloned().collect(),
        }
    }

    /// Whether module `from` may use module `to`.
    pub fn allows(&self, from: &str, to: &str) -> bool {
        match self {
            Layout::Ordered(order) => {
                let rank = |m: &str| order.iter().position(|o| o == m);
                matches!((rank(from), rank(to)), (Some(f), Some(t)) if t < f)
            }
            Layout::Explicit(g) => g.get(from).is_some_and(|u| u.contains(to)),
        }
    }

    /// The stated "uses" relation as a graph (empty for an ordered list, acyclic by construction).
    pub fn stated(&self) -> BTreeMap<String, BTreeSet<String>> {
        match self {
            Layout::Ordered(_) => BTreeMap::new(),
            Layout::Explicit(g) => g.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Layout;

    #[test]
    fn both_forms_are_read() {
        let ordered = "//! # Layout\n//!\n//! - `a`: low.\n//! - `b`: uses a,\n//!   continued.\n";
        let l = Layout::read(ordered).unwrap();
        assert!(l.allows("b", "a") && !l.allows("a", "b") && !l.allows("a", "a"));
        let explicit =
            "//! # Layout\n//! - `s`: top. Uses `x`,\n//!   `y`.\n//! - `x`, `y`: leaves.\n";
        let l = Layout::read(explicit).unwrap();
        assert!(l.allows("s", "y") && l.allows("s", "x") && !l.allows("x", "y"));
        assert!(Layout::read("//! no list\n").is_err());
        assert!(Layout::read("//! # Layout\n//! - `a`: x.\n//! - `a`: y.\n").is_err());
    }
}
