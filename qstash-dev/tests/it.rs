//! One test binary for this package's integration tests (one link instead of one per file: most of a warm
//! re-run was linking). Each file in this directory is a module here, and stays runnable alone through it:
//! `cargo test -p <package> --test it <file>::` (or `scripts/test <path of the file>`). A new file must be added
//! below (or as a `[[test]]` of its own in Cargo.toml, if it needs process-global state of its own): the
//! whole-system test `tests/test_layout.rs` fails on a file that no test binary compiles.
//!
//! Files that declare `mod common;` are loaded with `#[path]`, so that their `common` resolves to
//! `common/mod.rs` beside them as it does when the file is a test binary's root.

// Each of those files has its own copy of `common` (as when each was a binary of its own), so that the files
// stay as they are.
#![allow(clippy::duplicate_mod)]

#[path = "api.rs"]
mod api;
#[path = "delivery.rs"]
mod delivery;
#[path = "fault_replay.rs"]
mod fault_replay;
#[path = "layering.rs"]
mod layering;
#[path = "local_safety.rs"]
mod local_safety;
#[path = "sdk_compat.rs"]
mod sdk_compat;
