//! Runs the official QStash SDKs (npm `@upstash/qstash` 2.12.0, PyPI `qstash` 3.4.0) against the dev server.
//! Needs `scripts/test-deps` (node_modules under qstash-dev/sdk-tests/js and the repo's .venv).

mod common;

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use outbox_testkit::repo_root;
use qstash_dev::DevServer;

async fn run(server: &DevServer, program: &Path, script: &str, dir: &Path) {
    let keys = server.signing_keys();
    let mut cmd = tokio::process::Command::new(program);
    cmd.arg(script)
        .current_dir(dir)
        .env("QSTASH_URL", server.url())
        .env("QSTASH_TOKEN", server.token())
        .env("QSTASH_CURRENT_SIGNING_KEY", &keys.current)
        .env("QSTASH_NEXT_SIGNING_KEY", &keys.next)
        .env_remove("QSTASH_DEV")
        .env_remove("QSTASH_REGION")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    let child = cmd
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", program.display()));
    let out = tokio::time::timeout(Duration::from_secs(180), child.wait_with_output())
        .await
        .unwrap_or_else(|_| panic!("{script} did not finish within 180 s"))
        .expect("wait for SDK script");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    println!("--- {script} stdout ---\n{stdout}\n--- {script} stderr ---\n{stderr}");
    assert!(
        out.status.success(),
        "{script} failed with {}:\n{stdout}\n{stderr}",
        out.status
    );
    assert!(
        stdout.contains("passed, 0 failed"),
        "{script} did not report its checks"
    );
}

async fn start() -> DevServer {
    common::server(0.001, |_| {}).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn official_js_sdk() {
    let dir = repo_root().join("qstash-dev/sdk-tests/js");
    assert!(
        dir.join("node_modules/@upstash/qstash/package.json")
            .exists(),
        "node_modules missing in {}: run scripts/test-deps (it runs `npm ci` there)",
        dir.display()
    );
    let server = start().await;
    run(&server, Path::new("node"), "compat.mjs", &dir).await;
    let stats = server.handle().stats();
    assert!(stats.delivered >= 5, "{stats:?}");
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn official_python_sdk() {
    let root = repo_root();
    let python = root.join(".venv/bin/python");
    assert!(
        python.exists(),
        "{} missing: run scripts/test-deps (it creates .venv with the pinned `qstash` SDK)",
        python.display()
    );
    let dir = root.join("qstash-dev/sdk-tests/python");
    let server = start().await;
    run(&server, &python, "compat.py", &dir).await;
    let stats = server.handle().stats();
    assert!(stats.delivered >= 4, "{stats:?}");
    server.shutdown().await;
}
