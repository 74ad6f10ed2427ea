//! Where the repository is, for the tests and tools that read its files.

use std::path::PathBuf;

/// The repository root (the workspace directory).
pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the test kit lives in the repository")
        .to_path_buf()
}
