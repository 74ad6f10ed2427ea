//! Crates written into a directory of their own under the system's temporary directory, for the checker to read.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

/// A crate directory that is removed when dropped.
pub struct Crate(pub PathBuf);

impl Drop for Crate {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn fresh_dir() -> PathBuf {
    static N: AtomicUsize = AtomicUsize::new(0);
    let dir = std::env::temp_dir().join(format!(
        "outbox-layering-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::SeqCst)
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("creating a temporary crate directory");
    dir
}

/// A crate made of `files` (paths relative to the crate directory, `src/lib.rs` among them).
pub fn krate(files: &[(&str, &str)]) -> Crate {
    let dir = fresh_dir();
    for (path, text) in files {
        let path = dir.join(path);
        std::fs::create_dir_all(path.parent().expect("a file in a directory")).expect("mkdir");
        std::fs::write(&path, text).expect("writing a source file");
    }
    Crate(dir)
}

/// A copy of the `src/` tree of the workspace crate in directory `name` (`shared`, `cli`, `qstash-dev`).
pub fn copy_of(name: &str) -> Crate {
    fn copy(from: &Path, to: &Path) {
        std::fs::create_dir_all(to).expect("mkdir");
        for entry in std::fs::read_dir(from).expect("listing a source directory") {
            let entry = entry.expect("a directory entry");
            let target = to.join(entry.file_name());
            if entry.path().is_dir() {
                copy(&entry.path(), &target);
            } else {
                std::fs::copy(entry.path(), target).expect("copying a source file");
            }
        }
    }
    let dir = fresh_dir();
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    copy(&workspace.join(name).join("src"), &dir.join("src"));
    Crate(dir)
}
