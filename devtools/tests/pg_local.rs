//! The README's first command with no Postgres running: `outbox-dev dev` (the real binary) without DATABASE_URL
//! and nothing at the probed address starts a throwaway cluster, runs the pipeline on it, says so on stderr, and
//! stops the cluster when it ends. The server on the default address is left alone: the probe is pointed at a
//! port nothing listens on (`OUTBOX_PG_PROBE`), which is what "no Postgres at the default address" means to it.

use std::path::PathBuf;
use std::time::Duration;

use outbox_testkit::pg_local::{self, INSTALL, PROBE_VAR};
use outbox_testkit::ports::ReservedPort;
use outbox_testkit::skip_or_fail_under_ci;

#[tokio::test]
async fn dev_without_a_postgres_starts_a_throwaway_cluster_and_stops_it_at_exit() {
    if pg_local::server_binaries().is_none() {
        skip_or_fail_under_ci(
            "initdb",
            INSTALL,
            "outbox-dev dev's throwaway Postgres cluster was NOT tested",
        );
        return;
    }
    let log = std::env::temp_dir().join(format!("outbox-dev-pg-local-{}.log", std::process::id()));
    // Held until the command has ended: nobody can start listening there meanwhile.
    let nobody = ReservedPort::new().unwrap();
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_outbox-dev"))
        .args([
            "dev",
            "--duration-secs",
            "2",
            "--rate",
            "20",
            "--qstash-port",
            "0",
            "--console-port",
            "0",
            "--json",
        ])
        .arg("--log-file")
        .arg(&log)
        .env_remove("DATABASE_URL")
        .env(PROBE_VAR, nobody.addr().to_string())
        .stdin(std::process::Stdio::null())
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(Duration::from_secs(180), out)
        .await
        .expect("outbox-dev dev did not end")
        .unwrap();
    let _ = std::fs::remove_file(&log);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "outbox-dev dev failed:\n{stdout}\n{stderr}"
    );

    // "no Postgres at …; started a throwaway cluster at postgres://postgres@127.0.0.1:<port>/postgres (in <dir>; …"
    let announced = stderr
        .lines()
        .find(|l| l.contains("started a throwaway cluster at "))
        .unwrap_or_else(|| panic!("no announcement on stderr:\n{stderr}"));
    let url = announced
        .split("cluster at ")
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .unwrap();
    let port = url
        .trim_start_matches("postgres://postgres@127.0.0.1:")
        .split('/')
        .next()
        .unwrap();
    let dir = PathBuf::from(
        announced
            .split("(in ")
            .nth(1)
            .and_then(|r| r.split(';').next())
            .unwrap(),
    );
    assert!(
        url.ends_with("/postgres") && port.parse::<u16>().is_ok(),
        "{announced}"
    );

    // The pipeline ran on it: the summary (last stdout line, JSON) counts applied events.
    let summary: serde_json::Value =
        serde_json::from_str(stdout.lines().last().unwrap_or_default()).unwrap_or_else(|e| {
            panic!("no JSON summary ({e}):\n{stdout}");
        });
    assert!(
        summary["progress"]["applied"].as_i64().unwrap_or(0) > 0,
        "nothing applied: {summary}"
    );
    // And it is gone.
    assert!(
        !pg_local::answers(&format!("127.0.0.1:{port}")),
        "the throwaway cluster still answers on {port}"
    );
    assert!(!dir.exists(), "{} is left behind", dir.display());
}
