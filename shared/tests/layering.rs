//! The library is layered as the Layout list of `src/lib.rs` says, by the workspace's one checker
//! (`outbox-layering`): no arrow against the list, no arrow from a file up to its `mod.rs` or the crate root, no
//! circle between files.

use std::path::Path;

#[test]
fn the_library_is_layered_as_its_layout_says() {
    let report = outbox_layering::assert_layered(Path::new(env!("CARGO_MANIFEST_DIR")));
    // The scan saw what it must (a checker that reads nothing passes everything).
    report.assert_saw(&[
        ("src/relay/cycle.rs", "src/relay/claim.rs"),
        ("src/relay/drain.rs", "src/relay/cycle.rs"),
        ("src/consumer/batch.rs", "src/consumer/registry.rs"),
        ("src/relay/claim.rs", "src/db.rs"),
    ]);
}

/// A reader can hold a function of at most 80 lines and a file of at most 650 (its tests not counted).
#[test]
fn no_function_over_80_lines_and_no_file_over_650() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let functions = outbox_layering::long_functions(dir, 80).expect("the sources read");
    assert!(
        functions.is_empty(),
        "functions over 80 lines: {functions:#?}"
    );
    let files = outbox_layering::long_files(dir, 650).expect("the sources read");
    assert!(files.is_empty(), "files over 650 lines: {files:#?}");
}
