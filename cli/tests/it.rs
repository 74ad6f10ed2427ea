//! One test binary for this package's integration tests (one link instead of one per file: most of a warm
//! re-run was linking). Each file in this directory is a module here, and stays runnable alone through it:
//! `cargo test -p <package> --test it <file>::` (or `scripts/test <path of the file>`). A new file must be added
//! below (or as a `[[test]]` of its own in Cargo.toml, if it needs process-global state of its own): the
//! whole-system test `tests/test_layout.rs` fails on a file that no test binary compiles.
//!
//! Files that declare `mod common;` (or `mod console_kit;`) are loaded with `#[path]`, so that the module
//! resolves to `common/mod.rs` (`console_kit/mod.rs`) beside them as it does when the file is a binary's root.

// Each of those files has its own copy of `common` (as when each was a binary of its own), so that the files
// stay as they are.
#![allow(clippy::duplicate_mod)]

#[path = "console.rs"]
mod console;
#[path = "console_browser.rs"]
mod console_browser;
#[path = "console_fanout.rs"]
mod console_fanout;
#[path = "control_chars.rs"]
mod control_chars;
#[path = "dead_letters.rs"]
mod dead_letters;
mod help;
mod layering;
mod observability;
#[path = "prune.rs"]
mod prune;
#[path = "redrive_pipeline.rs"]
mod redrive_pipeline;
#[path = "relay_outage.rs"]
mod relay_outage;
#[path = "status.rs"]
mod status;
#[path = "subscribers.rs"]
mod subscribers;
#[path = "tenants.rs"]
mod tenants;
