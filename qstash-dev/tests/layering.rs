//! The dev server's modules are layered as the Layout list of its crate documentation (`src/lib.rs`) says,
//! checked by the workspace's one checker (`outbox-layering`): each top-level module uses only the modules its
//! entry names, no file uses what its `mod.rs` (or `lib.rs`) itself defines, and no files use each other in a
//! circle.

use std::path::Path;

#[test]
fn the_dev_server_is_layered_as_its_layout_says() {
    let report = outbox_layering::assert_layered(Path::new(env!("CARGO_MANIFEST_DIR")));
    // Arrows the scan must have seen, so that the test cannot pass on a scan that found nothing.
    report.assert_saw(&[
        ("src/server.rs", "src/api/mod.rs"),
        // Through `core/mod.rs`'s re-export, to the file that defines `Core`.
        ("src/state/mod.rs", "src/core/machine.rs"),
        ("src/api/guard.rs", "src/api/request.rs"),
    ]);
}

/// A reader can hold a file of at most 650 lines (its tests not counted).
#[test]
fn no_file_over_650_lines() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let files = outbox_layering::long_files(dir, 650).expect("the sources read");
    assert!(files.is_empty(), "files over 650 lines: {files:#?}");
}
