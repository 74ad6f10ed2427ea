//! `outbox-dev`'s help never shows a secret from the environment (clap prints `[env: NAME=value]` unless told
//! not to), and the operator commands are not here (they are the `outbox` CLI's).

use std::process::Command;

#[test]
fn help_hides_the_database_url_from_the_environment() {
    let secret = "hunter2-help-8d41";
    let bin = env!("CARGO_BIN_EXE_outbox-dev");
    for args in [
        &["--help"][..],
        &["dev", "--help"],
        &["bench", "--help"],
        &["bench", "relay", "--help"],
        &["bench", "report", "--help"],
        &["soak", "--help"],
        &["example", "migrate", "--help"],
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
    let o = Command::new(bin).arg("--help").output().unwrap();
    let text = String::from_utf8_lossy(&o.stdout);
    for operator in ["status", "dead-letters", "prune", "migrate"] {
        assert!(
            !text.contains(&format!("\n  {operator} ")),
            "{operator} is an operator command (outbox):\n{text}"
        );
    }
}
