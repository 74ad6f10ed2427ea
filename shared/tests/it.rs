//! One test binary for this package's integration tests (one link instead of one per file: most of a warm
//! re-run was linking). Each file in this directory is a module here, and stays runnable alone through it:
//! `cargo test -p <package> --test it <file>::` (or `scripts/test <path of the file>`). A new file must be added
//! below (or as a `[[test]]` of its own in Cargo.toml, if it needs process-global state of its own): the
//! whole-system test `tests/test_layout.rs` fails on a file that no test binary compiles.

mod attacks;
mod batches;
mod callbacks;
mod claim_plans;
mod config;
mod consumer;
mod fairness;
mod fixtures;
mod health;
mod housekeeping;
mod layering;
mod ordering_keys;
mod partitions;
mod pool;
mod producer;
mod public_api;
mod reconciler;
mod relay;
mod relay_batches;
mod relay_handler;
mod relay_outage;
mod signatures;
mod subscribers;
