//! A crate's modules as files: from `src/lib.rs` (or `main.rs`), every `mod x;` followed to `x.rs` or
//! `x/mod.rs` beside the declaring file (inside its directory for a `mod.rs` or the crate root, in a directory
//! named after it otherwise), and every inline `mod x { … }` kept as part of its file.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::scan::{Scan, scan};

/// A module path from the crate root: `["relay", "drain"]`; the root is empty.
pub type ModPath = Vec<String>;

/// One source file of the crate.
pub struct File {
    /// Relative to the crate directory, for messages: `src/relay/drain.rs`.
    pub shown: String,
    /// The module the file is.
    pub module: ModPath,
    /// The file as read.
    pub text: String,
    pub scan: Scan,
}

/// The files and the module → file map (inline modules map to the file that holds them).
pub struct Tree {
    pub files: Vec<File>,
    pub modules: BTreeMap<ModPath, usize>,
}

/// Why a crate could not be read.
#[derive(Debug)]
pub struct ReadError(pub String);

impl Tree {
    /// Reads the crate whose `Cargo.toml` is in `crate_dir`, from `src/lib.rs`.
    pub fn read(crate_dir: &Path) -> Result<Tree, ReadError> {
        let mut tree = Tree {
            files: Vec::new(),
            modules: BTreeMap::new(),
        };
        let root = crate_dir.join("src").join("lib.rs");
        tree.add(crate_dir, &root, Vec::new(), true)?;
        Ok(tree)
    }

    fn add(
        &mut self,
        crate_dir: &Path,
        path: &Path,
        module: ModPath,
        owns_dir: bool,
    ) -> Result<(), ReadError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| ReadError(format!("reading {}: {e}", path.display())))?;
        let scan = scan(&text);
        let index = self.files.len();
        self.modules.insert(module.clone(), index);
        for inline in &scan.inline_modules {
            self.modules
                .insert([module.clone(), inline.clone()].concat(), index);
        }
        // Children of `x.rs` live in `x/`; of `mod.rs` and `lib.rs`, beside them.
        let dir: PathBuf = match (owns_dir, path.file_stem()) {
            (false, Some(stem)) => path.with_file_name(stem),
            _ => path.parent().map(Path::to_path_buf).unwrap_or_default(),
        };
        let children: Vec<(ModPath, String)> = scan.file_modules.clone();
        self.files.push(File {
            shown: path
                .strip_prefix(crate_dir)
                .unwrap_or(path)
                .display()
                .to_string(),
            module: module.clone(),
            text,
            scan,
        });
        for (inline, name) in children {
            let child_dir = inline.iter().fold(dir.clone(), |d, m| d.join(m));
            let flat = child_dir.join(format!("{name}.rs"));
            let nested = child_dir.join(&name).join("mod.rs");
            let (file, owns) = if flat.exists() {
                (flat, false)
            } else if nested.exists() {
                (nested, true)
            } else {
                return Err(ReadError(format!(
                    "{}: `mod {name};` names neither {} nor {}",
                    path.display(),
                    flat.display(),
                    nested.display()
                )));
            };
            let child = [module.clone(), inline, vec![name]].concat();
            self.add(crate_dir, &file, child, owns)?;
        }
        Ok(())
    }

    /// The file that holds `module` (a file module or an inline one).
    pub fn file_of(&self, module: &[String]) -> Option<usize> {
        self.modules.get(module).copied()
    }
}
