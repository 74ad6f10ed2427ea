//! The three functions under cargo-lambda: run by `cargo lambda watch` (the Lambda runtime API emulator) and
//! driven through it with `cargo lambda invoke --data-file events/…`, exactly as a developer would: the real
//! binaries, the real runtime loop, real HTTP between the runtime API and the functions. Not only direct handler
//! calls.
//!
//! * the consumer and the failure callback get their `events/` fixtures, re-signed with a fresh token (QStash
//!   tokens expire after five minutes; the copies go to a temp dir outside the workspace, the fixtures are left
//!   untouched), and answer with the statuses and database effects QStash relies on;
//! * the relay gets `events/scheduled-event.json` and `events/schedule-v2-input.json`, dispatches seeded events
//!   to the QStash-compatible dev server, which delivers them back through watch's function URLs (a route table
//!   maps `/events/{topic}`, `/failure` and `/delivered` to the functions): consumer applies, poison order ends as
//!   a dead letter via the failure callback, ordered event gets its delivery evidence;
//! * every alarm in `template.yaml` reads a metric these functions really print as EMF.
//!
//! Built for the host (debug). What ships — `cargo lambda build --release --arm64` as `sam build` runs it, each
//! `bootstrap` checked — is `scripts/build-arm64`, which `.ci/run` runs before `scripts/test`: in the test run
//! it took most of the time (docs/testing.md). Needs `./.venv` (`scripts/test-deps`: cargo-lambda, zig).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use orders_example::{AuditEntry, LineItem, OrderEvent, OrderPlaced, audit_event, order_event};
use outbox::internals::receiver::{DEV_SIGNING_KEYS, resign_function_url_event};
use outbox_testkit::db::url_of;
use outbox_testkit::ports::{NotStarted, listening_ports, retry_when_taken_async};
use outbox_testkit::repo_root;
use outbox_testkit::sam::{
    FunctionDimension, outbox_alarm_metrics, translated_template, venv_tool,
};
use qstash_dev::{Config as DevConfig, DevServer};
use serde_json::{Value, json};
use sqlx::PgPool;
use tokio::process::Command;

/// A scratch directory outside the workspace (files written inside it would make `cargo lambda watch` rebuild).
struct Scratch(PathBuf);

impl Scratch {
    fn new() -> Scratch {
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_nanos();
        let dir = std::env::temp_dir().join(format!(
            "outbox-lambda-runtime-{}-{nanos}",
            std::process::id()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        assert!(!dir.starts_with(repo_root()), "{}", dir.display());
        Scratch(dir)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

/// `PATH` with `./.venv/bin` first: cargo-lambda finds zig as `python3 -m ziglang` through the first `python3`.
fn path_with_venv() -> String {
    let venv = venv_tool("cargo-lambda").parent().unwrap().to_path_buf();
    format!(
        "{}:{}",
        venv.display(),
        std::env::var("PATH").unwrap_or_default()
    )
}

fn cargo() -> String {
    std::env::var("CARGO").unwrap_or_else(|_| "cargo".into())
}

/// A command for a nested cargo (or cargo-lambda) run: without the variables `cargo test` sets for this test
/// process (`CARGO_MANIFEST_DIR`, `CARGO_PKG_*`, …). Build scripts track some of them (ring's tracks
/// `CARGO_MANIFEST_DIR`), so inheriting them would make these builds differ from a developer's shell builds and
/// rebuild the dependency tree each time one follows the other.
fn nested(program: impl AsRef<std::ffi::OsStr>) -> Command {
    let mut cmd = Command::new(program);
    for (key, _) in std::env::vars_os() {
        let key = key.to_string_lossy().into_owned();
        if key.starts_with("CARGO_PKG_")
            || [
                "CARGO_MANIFEST_DIR",
                "CARGO_MANIFEST_PATH",
                "CARGO_CRATE_NAME",
                "CARGO_BIN_NAME",
                "CARGO_PRIMARY_PACKAGE",
                "CARGO_TARGET_TMPDIR",
                "OUT_DIR",
            ]
            .contains(&key.as_str())
        {
            cmd.env_remove(&key);
        }
    }
    cmd
}

/// Runs a command to completion within `limit`; panics with its output when it fails or hangs.
async fn run(what: &str, cmd: &mut Command, limit: Duration) -> String {
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    let started = Instant::now();
    let out = match tokio::time::timeout(limit, cmd.output()).await {
        Ok(out) => out.unwrap_or_else(|e| panic!("{what}: cannot start: {e}")),
        Err(_) => panic!("{what}: no result after {limit:?}"),
    };
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "{what} failed ({}):\n--- stdout\n{stdout}\n--- stderr\n{stderr}",
        out.status
    );
    eprintln!("{what}: ok in {:.1} s", started.elapsed().as_secs_f64());
    stdout
}

/// `cargo lambda watch`, in its own process group (it runs each function with `cargo run`); the whole group is
/// killed on drop.
struct Watch {
    child: tokio::process::Child,
    port: u16,
    log: PathBuf,
}

impl Drop for Watch {
    fn drop(&mut self) {
        if let Some(pid) = self.child.id() {
            for signal in ["-TERM", "-KILL"] {
                let _ = std::process::Command::new("kill")
                    .args([signal, "--", &format!("-{pid}")])
                    .stderr(Stdio::null())
                    .status();
                std::thread::sleep(Duration::from_millis(300));
            }
        }
    }
}

impl Watch {
    fn output(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// `cargo lambda invoke <function> --data-file <file>`: the function's response payload.
    async fn invoke(&self, function: &str, data_file: &Path) -> Value {
        let mut cmd = nested(venv_tool("cargo-lambda"));
        cmd.args(["lambda", "invoke", "-A", "127.0.0.1", "-P"])
            .arg(self.port.to_string())
            .arg(function)
            .arg("--data-file")
            .arg(data_file)
            .env("PATH", path_with_venv())
            .current_dir(repo_root());
        let what = format!(
            "cargo lambda invoke {function} --data-file {}",
            data_file.display()
        );
        let out = tokio::time::timeout(Duration::from_secs(240), async {
            run(&what, &mut cmd, Duration::from_secs(240)).await
        })
        .await
        .unwrap_or_else(|_| panic!("{what} hung; watch output:\n{}", self.output()));
        serde_json::from_str(out.trim()).unwrap_or_else(|e| {
            panic!(
                "{what} printed no JSON ({e}): {out}\nwatch output:\n{}",
                self.output()
            )
        })
    }
}

/// Status, lower-cased headers and JSON body of a function-URL response payload.
fn http_response(payload: &Value) -> (u16, Value, Value) {
    let status = payload["statusCode"]
        .as_u64()
        .unwrap_or_else(|| panic!("not a function-URL response: {payload}"))
        as u16;
    let mut headers = serde_json::Map::new();
    for (k, v) in payload["headers"].as_object().into_iter().flatten() {
        headers.insert(k.to_ascii_lowercase(), v.clone());
    }
    let body = payload["body"].as_str().unwrap_or("");
    let body = serde_json::from_str(body).unwrap_or(Value::String(body.to_owned()));
    (status, Value::Object(headers), body)
}

async fn count(pool: &PgPool, sql: &str) -> i64 {
    sqlx::query_scalar::<_, i64>(sqlx::AssertSqlSafe(sql.to_owned()))
        .fetch_one(pool)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
}

fn placed(order: &str, amount_cents: i64) -> OrderEvent {
    OrderEvent::OrderPlaced(OrderPlaced {
        order_id: order.into(),
        customer_id: "customer-9".into(),
        amount_cents,
        currency: "EUR".into(),
        items: vec![LineItem {
            sku: "BOOK-9".into(),
            quantity: 1,
        }],
    })
}

#[sqlx::test(migrator = "outbox_testkit::MIGRATOR")]
async fn functions_run_under_cargo_lambda_watch_and_invoke(pool: PgPool) {
    let started = Instant::now();
    let root = repo_root();
    let scratch = Scratch::new();
    let path = path_with_venv();

    // Build the host debug binaries with the selection `cargo lambda watch` uses (`cargo run --bin <fn>` at the
    // root), so that its lazy compile on the first invoke finds them built.
    let limit = Duration::from_secs(45 * 60);
    run(
        "cargo build --bin relay --bin consumer --bin failure-callback",
        nested(cargo())
            .args([
                "build",
                "--bin",
                "relay",
                "--bin",
                "consumer",
                "--bin",
                "failure-callback",
            ])
            .current_dir(&root),
        limit,
    )
    .await;
    eprintln!("build done after {:.0} s", started.elapsed().as_secs_f64());

    // The world the functions talk to: this test's database, a QStash-compatible dev server.
    let dev = DevServer::start(DevConfig::for_tests(0.01)).await.unwrap();
    let keys = dev.signing_keys();
    assert_eq!(
        (keys.current.as_str(), keys.next.as_str()),
        DEV_SIGNING_KEYS,
        "the fixtures are signed with QStash's documented dev keys"
    );

    // watch serves every function at /lambda-url/<fn>/…; this route table also serves the paths QStash calls at
    // the root, so one PUBLIC_BASE_URL (what QStash signs) is right for both receivers.
    let routes = scratch.0.join("cargo-lambda.toml");
    std::fs::write(
        &routes,
        "[watch.router]\n\"/events/{topic}\" = \"consumer\"\n\"/failure\" = \"failure-callback\"\n\
         \"/delivered\" = \"failure-callback\"\n",
    )
    .unwrap();
    let log = scratch.0.join("watch.log");
    let database_url = url_of(&pool);
    // watch cannot take port 0 (it gives the functions its address before it binds): a port the kernel hands out,
    // and another when watch finds it taken by then; it counts as started once watch itself listens there.
    let watch = retry_when_taken_async("cargo lambda watch", |port| {
        let base = format!("http://127.0.0.1:{port}");
        let log_file = std::fs::File::create(&log).unwrap();
        let mut cmd = nested(venv_tool("cargo-lambda"));
        cmd.args([
            "lambda",
            "watch",
            "--ignore-changes",
            "-A",
            "127.0.0.1",
            "-P",
        ])
        .arg(port.to_string())
        .arg("--global")
        .arg(&routes)
        .current_dir(&root)
        .env("PATH", &path)
        // The functions inherit watch's environment.
        .env("DATABASE_URL", &database_url)
        .env("QSTASH_URL", dev.url())
        .env("QSTASH_TOKEN", dev.token())
        .env("QSTASH_CURRENT_SIGNING_KEY", &keys.current)
        .env("QSTASH_NEXT_SIGNING_KEY", &keys.next)
        // The dev server's public keys and token: the functions refuse them without this opt-in.
        .env("OUTBOX_ALLOW_DEV_KEYS", "true")
        .env("CONSUMER_URL", &base)
        .env("CALLBACK_URL", &base)
        .env("PUBLIC_BASE_URL", &base)
        .env("QSTASH_RETRIES", "1")
        // Delivery evidence through QStash's callback, so the /delivered route is exercised too (the consumer
        // mode the template deploys is covered by tests/pipeline.rs).
        .env("RELAY_ORDERED_EVIDENCE", "callback")
        .env("RELAY_LEASE_SECS", "1")
        .env("RELAY_DEADLINE_MARGIN_MS", "200")
        .env("RELAY_POLL_INTERVAL_MS", "50")
        // watch sends no real deadline; the relay then drains for this long (see relay::handler).
        .env("RELAY_EMULATOR_TIMEOUT_SECS", "3")
        .env("AWS_EC2_METADATA_DISABLED", "true")
        .env_remove("OUTBOX_SECRET_ID")
        .env_remove("LOG_FORMAT")
        .stdin(Stdio::null())
        .stdout(log_file.try_clone().unwrap())
        .stderr(log_file)
        .process_group(0);
        let mut watch = Watch {
            child: cmd.spawn().expect("cannot start cargo lambda watch"),
            port,
            log: log.clone(),
        };
        async move {
            let pid = watch.child.id().expect("a running child has a pid");
            let deadline = Instant::now() + Duration::from_secs(60);
            loop {
                if listening_ports(pid).contains(&port) {
                    return Ok(watch);
                }
                if watch.output().contains("Address already in use") {
                    return Err(NotStarted::Taken);
                }
                let failed = match watch.child.try_wait() {
                    Ok(Some(status)) => Some(format!("exited with {status}")),
                    _ if Instant::now() > deadline => Some(format!("did not listen on {port}")),
                    _ => None,
                };
                if let Some(why) = failed {
                    return Err(NotStarted::Failed(anyhow::anyhow!(
                        "cargo lambda watch {why}:\n{}",
                        watch.output()
                    )));
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    })
    .await
    .unwrap_or_else(|e| panic!("{e:#}"));
    let base = format!("http://127.0.0.1:{}", watch.port);

    // --- The receivers with the events/ fixtures, re-signed (copies outside the workspace). ---
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64;
    let fixture = |name: &str| std::fs::read_to_string(root.join("events").join(name)).unwrap();
    let resigned = |name: &str| {
        let text = resign_function_url_event(&fixture(name), &keys.current, Some(&base), now, 600)
            .unwrap_or_else(|e| panic!("re-signing {name}: {e}"));
        let path = scratch.0.join(name);
        std::fs::write(&path, text).unwrap();
        path
    };
    let originals: Vec<(String, String)> = [
        "consumer-order-placed.json",
        "consumer-order-placed-poison.json",
        "failure-callback.json",
        "delivery-callback.json",
    ]
    .iter()
    .map(|n| (n.to_string(), fixture(n)))
    .collect();

    let placed_file = resigned("consumer-order-placed.json");
    let (status, _, body) = http_response(&watch.invoke("consumer", &placed_file).await);
    assert_eq!(
        (status, &body["status"]),
        (200, &json!("processed")),
        "{body}"
    );
    let charges = "SELECT count(*) FROM charges WHERE order_id = 'order-1001' AND outbox_id = 1";
    assert_eq!(count(&pool, charges).await, 1);
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM processed_messages WHERE message_id = '1'"
        )
        .await,
        1
    );
    // QStash redelivers: applied once.
    let (status, _, body) = http_response(&watch.invoke("consumer", &placed_file).await);
    assert_eq!(
        (status, &body["status"]),
        (200, &json!("duplicate")),
        "{body}"
    );
    assert_eq!(count(&pool, charges).await, 1);
    // The committed fixture's token has expired (and names the function URL host, not PUBLIC_BASE_URL): refused
    // before anything is read or written.
    let (status, _, body) = http_response(
        &watch
            .invoke("consumer", &root.join("events/consumer-order-placed.json"))
            .await,
    );
    assert_eq!(status, 401, "{body}");
    // A poison order: permanent, QStash must dead-letter it at once.
    let (status, headers, body) = http_response(
        &watch
            .invoke("consumer", &resigned("consumer-order-placed-poison.json"))
            .await,
    );
    assert_eq!(status, 489, "{body}");
    assert_eq!(headers["upstash-nonretryable-error"], "true", "{headers}");
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM charges WHERE order_id = 'order-1002'"
        )
        .await,
        0
    );

    let failure_file = resigned("failure-callback.json");
    let (status, _, body) = http_response(&watch.invoke("failure-callback", &failure_file).await);
    assert_eq!(
        (status, &body["status"]),
        (200, &json!("recorded")),
        "{body}"
    );
    let dead = "SELECT count(*) FROM dead_letters WHERE source = 'qstash' AND outbox_id = 1 \
                AND dlq_id = '1795939201000-0' AND status = 503";
    assert_eq!(count(&pool, dead).await, 1);
    let (status, _, body) = http_response(&watch.invoke("failure-callback", &failure_file).await);
    assert_eq!(
        (status, &body["status"]),
        (200, &json!("duplicate")),
        "{body}"
    );
    assert_eq!(count(&pool, dead).await, 1);
    // Delivery evidence for an event this database never had: acknowledged, nothing to advance.
    let (status, _, body) = http_response(
        &watch
            .invoke("failure-callback", &resigned("delivery-callback.json"))
            .await,
    );
    assert_eq!(
        (status, &body["status"]),
        (200, &json!("unknown_event")),
        "{body}"
    );
    for (name, text) in &originals {
        assert_eq!(&fixture(name), text, "events/{name} was modified");
    }

    // --- watch's function URL: /lambda-url/<fn>/<path>, prefix stripped before the function sees it. ---
    // The function rebuilds the URL as PUBLIC_BASE_URL + the path it saw (+ the query, which carries the contract
    // version), so a token for the URL actually called (with the prefix) is refused, and one for PUBLIC_BASE_URL +
    // /events/orders?contract=2 is accepted.
    outbox::install_crypto_provider();
    let http = reqwest::Client::new();
    let event: Value = serde_json::from_str(&fixture("consumer-order-placed.json")).unwrap();
    let body = event["body"].as_str().unwrap().to_owned();
    let post = |signed_for: String| {
        let mut req = http.post(format!(
            "{base}/lambda-url/consumer/events/orders?{}",
            outbox::internals::contract::CONTRACT_QUERY
        ));
        for (k, v) in event["headers"].as_object().unwrap() {
            if !["host", "upstash-signature", "content-length"].contains(&k.as_str()) {
                req = req.header(k.as_str(), v.as_str().unwrap());
            }
        }
        let token = outbox::internals::receiver::sign(
            &keys.current,
            &signed_for,
            body.as_bytes(),
            now,
            300,
        );
        req.header("upstash-signature", token)
            .body(body.clone())
            .send()
    };
    let called = post(outbox::internals::contract::destination(
        &format!("{base}/lambda-url/consumer"),
        "orders",
    ))
    .await
    .unwrap();
    assert_eq!(called.status().as_u16(), 401, "{:?}", called.text().await);
    let seen = post(outbox::internals::contract::destination(&base, "orders"))
        .await
        .unwrap();
    let status = seen.status().as_u16();
    let reply: Value = seen.json().await.unwrap();
    // Outbox id 1 was applied above: the function-URL path reaches the same function and dedupes.
    assert_eq!(
        (status, &reply["status"]),
        (200, &json!("duplicate")),
        "{reply}"
    );

    // --- The relay, from the schedule fixtures, feeding the whole pipeline through watch. ---
    // Outbox ids above the fixtures' (the consumer dedupes on the outbox id).
    sqlx::query("SELECT setval(pg_get_serial_sequence('outbox', 'id'), 1000)")
        .execute(&pool)
        .await
        .unwrap();
    let mut tx = pool.begin().await.unwrap();
    let good = outbox::enqueue(&mut tx, order_event(&placed("order-2001", 1250)).unwrap())
        .await
        .unwrap();
    let poison = outbox::enqueue(&mut tx, order_event(&placed("order-2002", -1)).unwrap())
        .await
        .unwrap();
    let audit = outbox::enqueue(
        &mut tx,
        audit_event(
            "deploy",
            &AuditEntry {
                actor: "ci".into(),
                action: "lambda-runtime-test".into(),
                details: json!({}),
            },
        )
        .unwrap(),
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
    let (good, poison, audit) = (good.id, poison.id, audit.id);

    let summary = watch
        .invoke("relay", &root.join("events/scheduled-event.json"))
        .await;
    assert_eq!(summary["trigger"], "aws.events", "{summary}");
    assert_eq!(summary["dispatched"], 3, "{summary}");
    assert_eq!(summary["dead_lettered"], 0, "{summary}");
    assert_eq!(summary["errors"], 0, "{summary}");

    // QStash (the dev server) delivers to watch's routes: consumer, failure callback, delivery callback.
    let checks = [
        format!(
            "SELECT count(*) FROM charges WHERE order_id = 'order-2001' AND outbox_id = {good}"
        ),
        format!("SELECT count(*) FROM audit_log WHERE outbox_id = {audit}"),
        format!(
            "SELECT count(*) FROM dead_letters WHERE source = 'qstash' AND outbox_id = {poison}"
        ),
        format!("SELECT count(*) FROM outbox WHERE id = {good} AND delivered_at IS NOT NULL"),
    ];
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let mut missing = Vec::new();
        for sql in &checks {
            if count(&pool, sql).await != 1 {
                missing.push(sql.clone());
            }
        }
        if missing.is_empty() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the pipeline did not finish through cargo lambda watch; still false:\n{}\ndev server: {:?}\n\
             watch output:\n{}",
            missing.join("\n"),
            dev.handle().stats(),
            watch.output()
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM charges WHERE order_id = 'order-2002'"
        )
        .await,
        0
    );

    // The EventBridge Scheduler payload: nothing left to do.
    let summary = watch
        .invoke("relay", &root.join("events/schedule-v2-input.json"))
        .await;
    assert_eq!(summary["trigger"], "input:schedule", "{summary}");
    assert_eq!(summary["backlog"]["pending"], 0, "{summary}");

    // --- Every alarm reads a metric these functions print (EMF, namespace Outbox). ---
    let mut emitted = BTreeSet::new();
    for line in watch.output().lines() {
        let Ok(v) = serde_json::from_str::<Value>(line.trim()) else {
            continue;
        };
        let Some(defs) = v["_aws"]["CloudWatchMetrics"][0].as_object() else {
            continue;
        };
        assert_eq!(defs["Namespace"], "Outbox", "{line}");
        let function = v["Function"].as_str().unwrap_or_default().to_owned();
        for m in defs["Metrics"].as_array().into_iter().flatten() {
            emitted.insert((function.clone(), m["Name"].as_str().unwrap().to_owned()));
        }
    }
    for alarm in outbox_alarm_metrics(&translated_template()) {
        let function = match &alarm.function {
            FunctionDimension::Literal(name) => name.clone(),
            // Under watch (and in Lambda) a function reports its own name.
            FunctionDimension::FunctionRef(id) => match id.as_str() {
                "RelayFunction" => "relay".into(),
                "ConsumerFunction" => "consumer".into(),
                "FailureCallbackFunction" => "failure-callback".into(),
                other => panic!("alarm {} refers to {other}", alarm.alarm),
            },
        };
        assert!(
            emitted.contains(&(function.clone(), alarm.metric.clone())),
            "alarm {} reads {}/{}, which no function printed; printed: {emitted:?}",
            alarm.alarm,
            function,
            alarm.metric
        );
    }

    drop(watch);
    dev.shutdown().await;
    eprintln!(
        "lambda runtime test done in {:.0} s",
        started.elapsed().as_secs_f64()
    );
}
