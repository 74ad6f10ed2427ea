//! One test binary for this package's integration tests (one link instead of one per file: most of a warm
//! re-run was linking). Each file in this directory is a module here, and stays runnable alone through it:
//! `cargo test -p <package> --test it <file>::` (or `scripts/test <path of the file>`). A new file must be added
//! below (or as a `[[test]]` of its own in Cargo.toml, if it needs process-global state of its own): the
//! whole-system test `tests/test_layout.rs` fails on a file that no test binary compiles.

mod bench_cost;
mod bench_report;
mod bench_sustained;
mod dev_console;
mod explore;
mod explore_check;
mod help;
mod layering;
mod pg_local;
mod pgbouncer;
mod soak;
mod soak_verdict;
