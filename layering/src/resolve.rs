//! Where a path leads: from the module it is written in, through `crate`, `super`, `self`, child modules,
//! imports and re-exports (`pub use`, globs), to the file that defines what it names. A path that leaves the
//! crate (`std::…`, `sqlx::…`) leads nowhere.

use std::collections::{BTreeMap, BTreeSet};

use crate::tree::{ModPath, Tree};

/// How many imports a path may be followed through: more is a loop of globs.
const MAX_HOPS: usize = 16;

/// What a path names: a module, or an item of a module.
#[derive(Debug, Clone, PartialEq)]
enum Target {
    Module(ModPath),
    Item(ModPath),
}

impl Target {
    fn module(&self) -> &ModPath {
        match self {
            Target::Module(m) | Target::Item(m) => m,
        }
    }
}

/// A module's imports (outside function bodies): explicit ones by the name they bind, and globs.
#[derive(Default)]
struct Imports {
    named: BTreeMap<String, Vec<String>>,
    globs: Vec<Vec<String>>,
}

/// The name tables of a crate, for resolving paths.
pub struct Resolver<'t> {
    tree: &'t Tree,
    items: BTreeMap<ModPath, BTreeSet<String>>,
    imports: BTreeMap<ModPath, Imports>,
}

impl<'t> Resolver<'t> {
    pub fn new(tree: &'t Tree) -> Self {
        let (mut items, mut imports) = (BTreeMap::new(), BTreeMap::<ModPath, Imports>::new());
        for file in &tree.files {
            for (scope, name) in &file.scan.items {
                let m = [file.module.clone(), scope.clone()].concat();
                items
                    .entry(m)
                    .or_insert_with(BTreeSet::new)
                    .insert(name.clone());
            }
            for u in file.scan.uses.iter().filter(|u| !u.in_block) {
                let m = [file.module.clone(), u.path.scope.clone()].concat();
                let table = imports.entry(m).or_default();
                match &u.name {
                    Some(name) => {
                        table.named.insert(name.clone(), u.path.segments.clone());
                    }
                    None => table
                        .globs
                        .push(u.path.segments[..u.path.segments.len() - 1].to_vec()),
                }
            }
        }
        Resolver {
            tree,
            items,
            imports,
        }
    }

    /// The file (index into the tree's files) that defines what `segments`, written in `scope`, names.
    pub fn file(&self, scope: &[String], segments: &[String]) -> Option<usize> {
        let target = self.resolve(scope, segments, 0)?;
        self.tree.file_of(target.module())
    }

    fn resolve(&self, scope: &[String], segments: &[String], hops: usize) -> Option<Target> {
        if hops > MAX_HOPS {
            return None;
        }
        let (first, rest) = segments.split_first()?;
        let mut at = match first.as_str() {
            "crate" | "$crate" => Target::Module(Vec::new()),
            "self" => Target::Module(scope.to_vec()),
            "super" => {
                let ups = segments.iter().take_while(|s| *s == "super").count();
                let base = scope.get(..scope.len().checked_sub(ups)?)?.to_vec();
                return self.walk(Target::Module(base), &segments[ups..], hops);
            }
            // A bare path: a child module or an import of the scope; anything else is another crate.
            _ => self.lookup(scope, first, hops)?,
        };
        at = self.walk(at, rest, hops)?;
        Some(at)
    }

    /// Follows `rest` from `at`: through modules, to the item it names (what comes after an item is a member).
    fn walk(&self, mut at: Target, rest: &[String], hops: usize) -> Option<Target> {
        for seg in rest {
            let Target::Module(m) = &at else { break };
            if seg == "*" {
                break;
            }
            // A name the module's file does not show (made by a macro, say) is taken to be its own.
            at = self
                .lookup(m, seg, hops)
                .unwrap_or_else(|| Target::Item(m.clone()));
        }
        Some(at)
    }

    /// `name` as module `m` sees it: a child module, an item of its own, an import, a glob import's name.
    fn lookup(&self, m: &[String], name: &str, hops: usize) -> Option<Target> {
        let child = [m.to_vec(), vec![name.to_string()]].concat();
        if self.tree.modules.contains_key(&child) {
            return Some(Target::Module(child));
        }
        if self.items.get(m).is_some_and(|i| i.contains(name)) {
            return Some(Target::Item(m.to_vec()));
        }
        let imports = self.imports.get(m)?;
        if let Some(path) = imports.named.get(name) {
            return self.resolve(m, path, hops + 1);
        }
        imports
            .globs
            .iter()
            .find_map(|glob| match self.resolve(m, glob, hops + 1)? {
                Target::Module(g) if g != m => self.lookup(&g, name, hops + 1),
                _ => None,
            })
    }
}
