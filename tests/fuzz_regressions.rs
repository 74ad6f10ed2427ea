//! Every input kept in `fuzz/regressions/<target>/` (crashes the fuzzers found, once fixed, and hand-made edge
//! cases) runs through the same check the fuzz target runs (`fuzz/src/checks.rs`), on stable Rust, in every
//! test run. A new crash found by `scripts/fuzz-run` is copied there with the fix (docs/fuzzing.md).

#[path = "../fuzz/src/checks.rs"]
mod checks;

use std::path::PathBuf;

fn inputs(target: &str) -> Vec<(PathBuf, Vec<u8>)> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz/regressions")
        .join(target);
    let mut out: Vec<(PathBuf, Vec<u8>)> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|entry| {
            let path = entry.unwrap().path();
            let bytes = std::fs::read(&path).unwrap();
            (path, bytes)
        })
        .collect();
    out.sort();
    assert!(!out.is_empty(), "no kept inputs in {}", dir.display());
    out
}

fn run(target: &str, check: fn(&[u8])) {
    for (path, bytes) in inputs(target) {
        eprintln!("{target}: {}", path.display());
        check(&bytes);
    }
}

#[test]
fn kept_verify_inputs_pass() {
    run("verify", checks::verify);
}

#[test]
fn kept_callback_inputs_pass() {
    run("callback", checks::callback);
}

#[test]
fn kept_retry_expr_inputs_pass() {
    run("retry_expr", checks::retry_expr);
}

#[test]
fn kept_function_url_inputs_pass() {
    run("function_url", checks::function_url);
}

#[test]
fn kept_envelope_inputs_pass() {
    run("envelope", checks::envelope);
}
