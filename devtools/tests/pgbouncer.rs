//! `outbox-dev dev` (the real binary) through PgBouncer in transaction mode with `DB_PERSISTENT_STATEMENTS=false`:
//! the producer, the relay, and the consumer and failure-callback handlers (the same functions the Lambdas run)
//! all reach Postgres through a pooler that hands a server connection to a client for one transaction only, as
//! RDS Proxy or a PgBouncer in front of many Lambda environments does. Named prepared statements or session
//! state would break here; every component must work with unnamed statements and transaction-scoped state.
//!
//! sqlx runs an unnamed statement in two round trips (Parse/Describe/Sync, then Bind/Execute/Sync); outside an
//! explicit transaction PgBouncer returns the server connection to its pool at the first Sync and the Bind lands
//! on another connection (`unnamed prepared statement does not exist`). So with `DB_PERSISTENT_STATEMENTS=false`
//! the library runs each statement that would otherwise be autocommit (the relay's claim and settle, the outage
//! row, housekeeping, delivery evidence on a bare connection, the stack's startup checks) inside a transaction of
//! its own (`outbox::db::Autocommit`); this test shows that the whole pipeline then works through PgBouncer 1.18
//! in transaction mode. See `docs/scaling.md`.
//!
//! The test starts its own PgBouncer (`outbox_testkit::pgbouncer`, the Debian package that `scripts/test-deps`
//! installs) and skips, loudly, only when the binary is absent — and fails instead under CI (`CI=true`,
//! `outbox_testkit::skip_or_fail_under_ci`): a CI run never passes without it. The database is migrated directly (the migrator
//! takes a session-level advisory lock: run `outbox migrate` against Postgres, not through the pooler).

use std::process::Stdio;
use std::time::Duration;

use outbox_testkit::db::url_of;
use outbox_testkit::pgbouncer::PgBouncer;
use serde_json::Value;
use sqlx::PgPool;

#[sqlx::test(migrator = "outbox_testkit::MIGRATOR")]
async fn the_local_pipeline_runs_through_pgbouncer_in_transaction_mode(pool: PgPool) {
    let opts = pool.connect_options();
    let Some(bouncer) = PgBouncer::start(opts.get_host(), opts.get_port()).unwrap() else {
        outbox_testkit::skip_or_fail_under_ci(
            "pgbouncer",
            "scripts/test-deps installs it: apt-get install -y pgbouncer",
            "the pipeline was NOT tested through PgBouncer in transaction mode",
        );
        return;
    };
    let url = bouncer.url_for(&url_of(&pool));
    let dir = std::env::temp_dir().join(format!(
        "outbox-dev-pgbouncer-{}-{}",
        std::process::id(),
        bouncer.port()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    // The log in the scratch directory: read below for errors the pipeline recovered from.
    let log_file = dir.join("dev.log");
    let child = tokio::process::Command::new(env!("CARGO_BIN_EXE_outbox-dev"))
        .args([
            "dev",
            "--existing-db",
            "--duration-secs",
            "4",
            "--qstash-port",
            "0",
            "--console-port",
            "0",
            "--rate",
            "40",
            "--poison-every",
            "8",
            "--json",
            "--log-file",
        ])
        .arg(&log_file)
        .env("DATABASE_URL", &url)
        .env("DB_PERSISTENT_STATEMENTS", "false")
        .env("NO_COLOR", "1")
        .env_remove("RUST_LOG")
        .env_remove("OUTBOX_SCHEMA")
        .current_dir(&dir)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let out = tokio::time::timeout(Duration::from_secs(180), child.wait_with_output())
        .await
        .expect("outbox-dev dev --duration-secs 4 stops on its own")
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    let log = std::fs::read_dir(&dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| std::fs::read_to_string(e.path()).ok())
        .collect::<Vec<_>>()
        .join("\n");
    let _ = std::fs::remove_dir_all(&dir);
    let context = format!(
        "exit {:?}\nstdout:\n{stdout}\nstderr:\n{stderr}\npgbouncer log:\n{}\ndev log (tail):\n{}",
        out.status,
        bouncer.log(),
        log.lines()
            .rev()
            .take(40)
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .collect::<Vec<_>>()
            .join("\n")
    );
    assert!(out.status.success(), "{context}");
    // A statement split across two server connections fails and is retried (the relay's next cycle, QStash's
    // redelivery), so the pipeline may still drain: the log must show none.
    let full = format!("{stdout}\n{stderr}\n{log}");
    assert!(
        !full.contains("prepared statement"),
        "a statement failed behind the pooler:\n{}\n{context}",
        full.lines()
            .filter(|l| l.contains("prepared statement"))
            .take(5)
            .collect::<Vec<_>>()
            .join("\n")
    );
    let summary: Value = stdout
        .lines()
        .rev()
        .find_map(|l| serde_json::from_str::<Value>(l).ok())
        .unwrap_or_else(|| panic!("no JSON summary\n{context}"));
    let p = &summary["progress"];
    let n = |v: &Value| v.as_i64().unwrap_or(-1);
    assert_eq!(summary["drained"], true, "{summary}\n{context}");
    assert!(n(&summary["demo_orders"]) >= 20, "{summary}");
    assert_eq!(
        n(&summary["demo_failed"]),
        0,
        "an order's transaction failed: {summary}\n{context}"
    );
    assert!(n(&summary["demo_poison"]) >= 2, "{summary}");
    assert_eq!(n(&p["pending"]), 0, "{summary}");
    assert_eq!(n(&p["dispatched"]), n(&p["enqueued"]), "{summary}");
    assert_eq!(
        n(&p["applied"]) + n(&p["dead_lettered"]),
        n(&p["enqueued"]),
        "every event applied or dead-lettered: {summary}"
    );
    // The failure callback recorded each poison order through the pooler too.
    assert_eq!(
        n(&p["dead_lettered"]),
        n(&summary["demo_poison"]),
        "{summary}"
    );
    // And it really went through PgBouncer: it logged the components' logins.
    assert!(
        bouncer.log().contains("login attempt"),
        "no login through pgbouncer:\n{}",
        bouncer.log()
    );
}
