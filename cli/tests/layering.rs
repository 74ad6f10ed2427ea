//! The CLI's library is layered as the Layout list of `src/lib.rs` says, by the workspace's one checker
//! (`outbox-layering`): no arrow against the list, no arrow from a file up to its `mod.rs`, no circle between
//! files.

use std::path::Path;

#[test]
fn the_cli_is_layered_as_its_layout_says() {
    let report = outbox_layering::assert_layered(Path::new(env!("CARGO_MANIFEST_DIR")));
    // The scan saw what it must (a checker that reads nothing passes everything).
    for (from, to) in [
        ("src/console/layout.rs", "src/status.rs"),
        (
            "src/console/dead_letters/filter.rs",
            "src/dead_letters/args.rs",
        ),
        ("src/prune.rs", "src/util.rs"),
    ] {
        assert!(
            report.uses(from, to),
            "the checker did not see {from} use {to}: {} arrows in {} files",
            report.arrows.len(),
            report.files.len()
        );
    }
}
