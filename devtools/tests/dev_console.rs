//! `outbox-dev dev` as a newcomer's `> out.txt` (or CI) runs it: the real binary, stdout redirected to a file. What
//! lands in the file is plain progress at a calm rate — no escape codes, no log lines (those go to the log file it
//! names in its first lines, which holds every component's logs) — and its last line is the summary.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use outbox_testkit::db::url_of;
use sqlx::PgPool;

/// Marks of a log line (any component, any level): none may reach stdout.
const LOG_MARKS: [&str; 9] = [
    " TRACE ",
    " DEBUG ",
    " INFO ",
    " WARN ",
    " ERROR ",
    "answered=",
    "response_status=",
    "event handled",
    "relay invocation done",
];

fn is_log_line(line: &str) -> bool {
    // `2026-11-30T22:18:07.451130Z  INFO …`: fmt's timestamp first.
    let timestamped = line.len() > 20
        && line.as_bytes()[..4].iter().all(u8::is_ascii_digit)
        && line.as_bytes()[4] == b'-'
        && line.as_bytes()[10] == b'T';
    timestamped || LOG_MARKS.iter().any(|m| line.contains(m))
}

#[sqlx::test(migrator = "outbox_testkit::MIGRATOR")]
async fn redirected_stdout_is_calm_plain_progress_ending_with_the_summary(pool: PgPool) {
    let dir = std::env::temp_dir().join(format!(
        "outbox-dev-console-{}-{}",
        std::process::id(),
        pool.connect_options().get_database().unwrap_or("db")
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let stdout_path = dir.join("out.txt");
    let stdout = std::fs::File::create(&stdout_path).unwrap();
    let child = tokio::process::Command::new(env!("CARGO_BIN_EXE_outbox-dev"))
        .args([
            "dev",
            "--duration-secs",
            "10",
            "--existing-db",
            "--qstash-port",
            "0",
            "--console-port",
            "0",
        ])
        .arg("--database-url")
        .arg(url_of(&pool))
        // As a newcomer's shell has it: a colour terminal that stdout was redirected away from.
        .env("TERM", "xterm-256color")
        .env_remove("NO_COLOR")
        .env_remove("RUST_LOG")
        .env_remove("LOG_FORMAT")
        .current_dir(&dir)
        .stdin(Stdio::null())
        .stdout(stdout)
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let out = tokio::time::timeout(Duration::from_secs(180), child.wait_with_output())
        .await
        .expect("outbox-dev dev --duration-secs 10 stops on its own")
        .unwrap();
    let bytes = std::fs::read(&stdout_path).unwrap();
    let text = String::from_utf8_lossy(&bytes).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        out.status.success(),
        "exit {:?}\nstdout:\n{text}\nstderr:\n{stderr}",
        out.status
    );

    // 1. No escape code anywhere: not in the progress, not in a log line (there must be none).
    if let Some(at) = bytes.iter().position(|&b| b == 0x1b) {
        panic!(
            "ESC at byte {at} of stdout (redirected to a file):\n{}",
            String::from_utf8_lossy(&bytes[at.saturating_sub(200)..(at + 200).min(bytes.len())])
        );
    }

    // 2. No log line in stdout (nor, without --verbose, in stderr).
    let lines: Vec<&str> = text.lines().collect();
    let logged: Vec<&&str> = lines.iter().filter(|l| is_log_line(l)).collect();
    assert!(
        logged.is_empty(),
        "log lines in stdout:\n{}",
        logged
            .iter()
            .map(|l| l.to_string())
            .collect::<Vec<_>>()
            .join("\n")
    );
    assert!(
        !stderr.lines().any(is_log_line),
        "log lines in stderr without --verbose:\n{stderr}"
    );

    // 3. Plain progress lines at a calm rate (every 5 s by default, not every second).
    let progress = lines.iter().filter(|l| l.starts_with("t=")).count();
    assert!(
        (2..=6).contains(&progress),
        "{progress} progress lines in a 10 s run:\n{text}"
    );

    // The operator console runs alongside; its URL is in the first lines.
    assert!(
        lines
            .iter()
            .any(|l| l.starts_with("  console           http://127.0.0.1:")),
        "no console URL in the first lines:\n{text}"
    );

    // 4. The last line is the summary: enqueued, applied, dead-lettered by cause, pending.
    let last = lines.iter().rev().find(|l| !l.trim().is_empty()).unwrap();
    assert!(
        last.starts_with("summary: "),
        "last line:\n{last}\n\nstdout:\n{text}"
    );
    for part in [
        "events enqueued",
        "applied",
        "dead-lettered (demo poison ",
        "consumer refused it with consumer_status=489",
        "; other 0)",
        "0 pending",
        "drained",
    ] {
        assert!(last.contains(part), "the summary lacks {part:?}: {last}");
    }

    // 5. The log file named in the first lines exists and holds the components' logs.
    let named = lines
        .iter()
        .take(3)
        .find_map(|l| l.trim_start().strip_prefix("log file"))
        .unwrap_or_else(|| panic!("no log file named in the first lines:\n{text}"))
        .trim()
        .split("   ")
        .next()
        .unwrap()
        .to_owned();
    let log_path: PathBuf = if Path::new(&named).is_absolute() {
        PathBuf::from(&named)
    } else {
        dir.join(&named)
    };
    let log = std::fs::read_to_string(&log_path)
        .unwrap_or_else(|e| panic!("the log file {named:?} ({}): {e}", log_path.display()));
    for (component, mark) in [
        ("consumer", "consumer: event handled answered=200"),
        ("consumer, a poison order", "event refused permanently"),
        ("callback function", "callback: "),
        (
            "callback function's dead letter",
            "dead letter recorded answered=200",
        ),
        ("QStash dev server", "qstash-dev listening"),
        ("relay", "relay invocation done"),
    ] {
        assert!(
            log.contains(mark),
            "the log file has no {component} line ({mark:?}):\n{}",
            log.lines().take(40).collect::<Vec<_>>().join("\n")
        );
    }
    assert!(!log.contains('\u{1b}'), "escape codes in the log file");
    let _ = std::fs::remove_dir_all(&dir);
}
