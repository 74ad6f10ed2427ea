//! What CI runs under (`.ci/env`, sourced by `.ci/run`): a missing test tool fails the run whatever the caller's
//! `CI` says, and the arm64 release build keeps its cache outside the checkout.

use std::process::Command;

use outbox_testkit::{is_ci, repo_root};

/// The value of `name` after `.ci/env` is sourced by a shell started with `env` only.
fn after_ci_env(env: &[(&str, &str)], name: &str) -> String {
    let out = Command::new("bash")
        .arg("-c")
        .arg(format!(". .ci/env && printf %s \"${name}\""))
        .current_dir(repo_root())
        .env_clear()
        .env("HOME", "/nonexistent-home")
        .envs(env.iter().copied())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "sourcing .ci/env failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn under_ci_run_a_missing_tool_fails_whatever_ci_says() {
    for caller in [None, Some("false"), Some("0"), Some(""), Some("true")] {
        let env: Vec<(&str, &str)> = caller.map(|v| ("CI", v)).into_iter().collect();
        let ci = after_ci_env(&env, "CI");
        assert!(
            is_ci(Some(&ci)),
            "CI={caller:?} before .ci/env left CI={ci:?}: a missing tool would skip, not fail"
        );
    }
}

#[test]
fn the_arm64_build_cache_is_outside_the_checkout_unless_set() {
    let cache = after_ci_env(&[], "OUTBOX_ARM64_CACHE");
    assert_eq!(cache, "/nonexistent-home/.cache/outbox-ci/arm64-release");
    assert!(!std::path::Path::new(&cache).starts_with(repo_root()));
    assert_eq!(
        after_ci_env(
            &[("OUTBOX_ARM64_CACHE", "/elsewhere")],
            "OUTBOX_ARM64_CACHE"
        ),
        "/elsewhere"
    );
}
