//! One test binary for this package's integration tests (as in every package of the workspace).

mod common;
mod real_crates;
mod rules;
