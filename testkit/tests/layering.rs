//! The test kit is layered by the workspace's one checker (`outbox-layering`, the rules that need no Layout): no
//! arrow from a file up to a module above it (its parent's file, the crate root), no circle between files.

use std::path::Path;

#[test]
fn the_test_kit_has_no_arrow_up_the_tree_and_no_circle() {
    let report = outbox_layering::assert_tree(Path::new(env!("CARGO_MANIFEST_DIR")));
    // The scan saw what it must (a checker that reads nothing passes everything).
    report.assert_saw(&[
        ("src/sam/insights.rs", "src/sam/metric.rs"),
        ("src/stack/start.rs", "src/stack/recording.rs"),
        ("src/moto.rs", "src/repo.rs"),
    ]);
}

/// A reader can hold a file of at most 650 lines (its tests not counted).
#[test]
fn no_file_over_650_lines() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let files = outbox_layering::long_files(dir, 650).expect("the sources read");
    assert!(files.is_empty(), "files over 650 lines: {files:#?}");
}
