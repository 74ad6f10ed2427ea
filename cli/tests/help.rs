//! The CLI's help never shows a secret from the environment (clap prints `[env: NAME=value]` unless told not to),
//! lists operator commands only, and documents what a redrive of a middle event does.

use std::process::Command;

#[test]
fn help_hides_the_database_url_from_the_environment() {
    let secret = "hunter2-help-3f9a";
    let bin = env!("CARGO_BIN_EXE_outbox");
    for args in [
        &["--help"][..],
        &["migrate", "--help"],
        &["status", "--help"],
        &["prune", "--help"],
        &["dead-letters", "list", "--help"],
        &["dead-letters", "show", "--help"],
        &["dead-letters", "redrive", "--help"],
        &["dlq", "purge", "--help"],
    ] {
        let o = Command::new(bin)
            .args(args)
            .env(
                "DATABASE_URL",
                format!("postgres://u:{secret}@db.example/x"),
            )
            .output()
            .unwrap();
        assert!(o.status.success(), "{args:?}");
        let text = String::from_utf8_lossy(&o.stdout);
        assert!(
            !text.contains(secret),
            "{args:?} shows the password:\n{text}"
        );
    }
    // Operator commands only: the local pipeline and the benchmarks are `outbox-dev`'s.
    let o = Command::new(bin).arg("--help").output().unwrap();
    let text = String::from_utf8_lossy(&o.stdout);
    for developer in ["dev", "bench"] {
        assert!(
            !text.contains(&format!("\n  {developer} ")),
            "{developer} is a developer command (outbox-dev):\n{text}"
        );
    }
    let o = Command::new(bin)
        .args(["dlq", "redrive", "--help"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(
        text.contains("--out-of-order") && text.contains("AFTER later events"),
        "{text}"
    );
}
