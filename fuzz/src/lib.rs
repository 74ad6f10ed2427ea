//! The fuzz targets' properties live in [`checks`], as plain functions over bytes, so that
//! `tests/fuzz_regressions.rs` (stable Rust, part of `scripts/test`) runs every kept input through the same code.

pub mod checks;
