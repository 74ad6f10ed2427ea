//! One test binary for this package's integration tests (one link instead of one per file: most of a warm
//! re-run was linking). Each file in this directory is a module here, and stays runnable alone through it:
//! `cargo test -p <package> --test it <file>::` (or `scripts/test <path of the file>`). A new file must be added
//! below (or as a `[[test]]` of its own in Cargo.toml, if it needs process-global state of its own): the
//! whole-system test `tests/test_layout.rs` fails on a file that no test binary compiles.

mod accounting;
mod ci;
mod docs;
mod fairness;
mod fanout;
mod fuzz_regressions;
mod lambda_runtime;
mod lifecycle;
mod pipeline;
mod template;
mod test_layout;
mod upgrade;
