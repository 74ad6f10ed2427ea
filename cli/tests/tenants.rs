//! Fairness per tenant from the operator's side, against real Postgres: `outbox status` lists the tenants by lag,
//! `outbox tenants pause|list|resume` holds one tenant's events in the outbox and releases them (through the
//! binary), `--qstash` pauses its flow-control keys at the dev server, and the console's overview, topic page and
//! pause/resume buttons do the same, logged in the action log.

mod common;
mod console_kit;

use console_kit::{Tab, args, assert_no_raw_hostile_text, by_id, csrf, field, form, hostile};
use outbox_cli::console::Console;
use outbox_cli::status::{StatusArgs, run};
use outbox_testkit::db::event;
use outbox_testkit::text;
use reqwest::StatusCode;
use sqlx::PgPool;

use common::{db, outbox};

/// `n` pending unordered events of `topic` for the fairness key `key`, written `mins` minutes ago.
async fn tenant_events(pool: &PgPool, topic: &str, key: &str, n: usize, mins: i64) -> Vec<i64> {
    let mut ids = Vec::new();
    for i in 0..n {
        ids.push(
            event(
                pool,
                topic,
                &format!("{key}-{i}"),
                None,
                &format!(
                    "fairness_key = '{key}', created_at = now() - make_interval(mins => {mins})"
                ),
            )
            .await,
        );
    }
    ids
}

/// How many of `key`'s pending events wait at `available_at = 'infinity'` (held), and how many do not.
async fn held(pool: &PgPool, key: &str) -> (i64, i64) {
    sqlx::query_as(
        "SELECT count(*) FILTER (WHERE available_at = 'infinity'), count(*) FILTER (WHERE available_at <> 'infinity') \
         FROM outbox WHERE fairness_key = $1 AND dispatched_at IS NULL",
    )
    .bind(key)
    .fetch_one(pool)
    .await
    .unwrap()
}

/// Runs the binary: (success, stdout, stderr).
fn cli(pool: &PgPool, args: &[&str]) -> (bool, String, String) {
    let out = outbox(pool, args).output().expect("running outbox");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn status_lists_the_tenants_by_lag_with_their_pause(pool: PgPool) {
    tenant_events(&pool, "audit", "acme", 3, 30).await;
    tenant_events(&pool, "audit", "globex", 2, 5).await;
    event(
        &pool,
        "audit",
        "plain",
        None,
        "created_at = now() - interval '10 minutes'",
    )
    .await;
    let mut conn = pool.acquire().await.unwrap();
    outbox::fairness::pause(&mut conn, "initech", "ops-anna", Some("noisy import"))
        .await
        .unwrap();

    let mut out = Vec::new();
    let a = |json| StatusArgs {
        db: db(&pool),
        json,
        warn_age_secs: 300,
    };
    run(a(false), &mut out).await.unwrap();
    let t = text(&out);
    let section = &t[t.find("Tenants (fairness keys) by lag").expect(&t)..];
    let lines: Vec<&str> = section.lines().skip(2).take(4).collect();
    assert!(
        lines[0].starts_with("  acme ") && lines[0].contains("  3 ") && lines[0].contains("30m"),
        "{section}"
    );
    assert!(
        lines[1].starts_with("  (none) ") && lines[1].contains("10m"),
        "{section}"
    );
    assert!(
        lines[2].starts_with("  globex ") && lines[2].contains("  2 "),
        "{section}"
    );
    assert!(
        lines[3].starts_with("  initech ") && lines[3].contains("by ops-anna: noisy import"),
        "{section}"
    );

    let mut out = Vec::new();
    run(a(true), &mut out).await.unwrap();
    let v: serde_json::Value = serde_json::from_slice(&out).unwrap();
    let keys: Vec<(&str, i64)> = v["tenants"]
        .as_array()
        .unwrap()
        .iter()
        .map(|k| {
            (
                k["fairness_key"].as_str().unwrap(),
                k["pending"].as_i64().unwrap(),
            )
        })
        .collect();
    assert_eq!(keys, [("acme", 3), ("", 1), ("globex", 2), ("initech", 0)]);
    assert_eq!(v["tenants"][3]["paused_by"], "ops-anna");
    assert_eq!(
        v["backlog"]["pending"], 6,
        "the rest of the figures are still there"
    );
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn a_tenant_paused_and_resumed_from_the_cli_is_held_then_released(pool: PgPool) {
    tenant_events(&pool, "audit", "acme", 3, 20).await;
    tenant_events(&pool, "audit", "globex", 2, 1).await;

    let (ok, out, err) = cli(
        &pool,
        &[
            "tenants", "pause", "acme", "--reason", "flood", "--by", "ops-anna",
        ],
    );
    assert!(ok, "{err}");
    assert_eq!(out.trim(), "paused acme: 3 waiting events held");
    assert_eq!(held(&pool, "acme").await, (3, 0));
    assert_eq!(held(&pool, "globex").await, (0, 2), "the others flow");

    let (ok, out, err) = cli(&pool, &["tenants", "pause", "acme"]);
    assert!(ok, "{err}");
    assert_eq!(out.trim(), "acme was already paused");

    let (ok, out, err) = cli(&pool, &["tenants", "list"]);
    assert!(ok, "{err}");
    let acme = out.lines().find(|l| l.starts_with("  acme ")).expect(&out);
    assert!(acme.contains("by ops-anna: flood"), "{out}");
    assert!(
        out.lines()
            .any(|l| l.starts_with("  globex ") && l.ends_with("  -")),
        "{out}"
    );
    let (ok, out, err) = cli(&pool, &["tenants", "list", "--topic", "orders", "--json"]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        v.as_array().unwrap().len(),
        1,
        "another topic: only the paused key: {v}"
    );
    assert_eq!(
        (v[0]["fairness_key"].as_str(), v[0]["pending"].as_i64()),
        (Some("acme"), Some(0))
    );

    let (ok, out, err) = cli(&pool, &["tenants", "resume", "acme"]);
    assert!(ok, "{err}");
    assert_eq!(out.trim(), "resumed acme: 3 waiting events due again");
    assert_eq!(held(&pool, "acme").await, (0, 3));
    let (ok, out, _) = cli(&pool, &["tenants", "resume", "acme"]);
    assert!(ok);
    assert_eq!(out.trim(), "acme was not paused");
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn a_bad_key_is_refused_with_the_reason_and_changes_nothing(pool: PgPool) {
    tenant_events(&pool, "audit", "acme", 1, 1).await;
    for (key, reason) in [
        ("a b", "may only contain A-Z a-z 0-9 . _ - :"),
        (&"k".repeat(65), "is longer than 64 characters"),
        ("", "is empty"),
    ] {
        let (ok, out, err) = cli(&pool, &["tenants", "pause", key]);
        assert!(!ok, "{key:?} accepted: {out}");
        assert!(
            err.starts_with("error: ") && err.contains(reason),
            "{key:?}: {err}"
        );
    }
    let (ok, _, err) = cli(&pool, &["tenants", "pause", "acme", "--qstash"]);
    assert!(!ok && err.contains("QSTASH_URL and QSTASH_TOKEN"), "{err}");
    let paused: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox_paused_keys")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(paused, 0);
    assert_eq!(held(&pool, "acme").await, (0, 1));
}

/// `isPaused` of a flow-control key at the dev server.
async fn is_paused(dev: &qstash_dev::DevServer, key: &str) -> bool {
    let v = outbox_testkit::dev_api::get(dev, &format!("/v2/flowControl/{key}")).await;
    v["isPaused"]
        .as_bool()
        .unwrap_or_else(|| panic!("{key}: {v}"))
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn with_qstash_the_tenants_flow_control_keys_are_paused_there_too(pool: PgPool) {
    outbox::install_crypto_provider();
    let dev = qstash_dev::DevServer::start(qstash_dev::Config::for_tests(0.001))
        .await
        .unwrap();
    let http = reqwest::Client::new();
    // The tenant's lanes on two topics (one of a named subscriber, whose name the relay hashes), and two other
    // tenants' lanes; a flow-control key exists at QStash once something used it.
    let keys = [
        "audit.tenant-acme",
        "orders_billing.tenant-acme-00112233445566ff",
        "audit.tenant-acme2",
        "audit.tenant-globex",
    ];
    for key in keys {
        let r = http
            .post(format!("{}/v2/flowControl/{key}/resetRate", dev.url()))
            .bearer_auth(dev.token())
            .send()
            .await
            .unwrap();
        assert!(r.status().is_success(), "{key}");
    }
    tenant_events(&pool, "audit", "acme", 2, 1).await;
    // The binary runs beside the test's runtime, which serves the dev server meanwhile.
    let with_qstash = |args: &[&str], token: &str| {
        let mut cmd = outbox(&pool, args);
        cmd.env("QSTASH_URL", dev.url()).env("QSTASH_TOKEN", token);
        async move {
            let out = tokio::task::spawn_blocking(move || cmd.output().unwrap())
                .await
                .unwrap();
            (
                out.status.success(),
                String::from_utf8_lossy(&out.stdout).into_owned(),
                String::from_utf8_lossy(&out.stderr).into_owned(),
            )
        }
    };

    let (ok, out, err) = with_qstash(&["tenants", "pause", "acme", "--qstash"], dev.token()).await;
    assert!(ok, "{err}");
    assert_eq!(
        out.lines().collect::<Vec<_>>(),
        [
            "paused acme: 2 waiting events held",
            "QStash: paused flow-control key audit.tenant-acme",
            "QStash: paused flow-control key orders_billing.tenant-acme-00112233445566ff",
        ]
    );
    let paused = [true, true, false, false];
    for (key, want) in keys.iter().zip(paused) {
        assert_eq!(is_paused(&dev, key).await, want, "{key}");
    }
    assert_eq!(held(&pool, "acme").await, (2, 0));

    let (ok, out, err) = with_qstash(
        &["tenants", "resume", "acme", "--qstash", "--json"],
        dev.token(),
    )
    .await;
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["outcome"]["changed"], true);
    assert_eq!(v["qstash_flow_control_keys"].as_array().unwrap().len(), 2);
    for key in keys {
        assert!(!is_paused(&dev, key).await, "{key}");
    }
    // A wrong token: QStash refuses the list, nothing is changed (exit non-zero).
    let (ok, _, err) = with_qstash(&["tenants", "pause", "acme", "--qstash"], "wrong-token").await;
    assert!(!ok && err.contains("QStash answered 401"), "{err}");
    assert!(err.contains("nothing was changed"), "{err}");
    assert_eq!(held(&pool, "acme").await, (0, 2));
    dev.shutdown().await;
}

/// The console's action log: (actor, action, selection, outcome), oldest first.
async fn logged(
    pool: &PgPool,
) -> Vec<(String, String, serde_json::Value, Option<serde_json::Value>)> {
    sqlx::query_as(
        "SELECT actor, action, selection, outcome FROM outbox_console_actions ORDER BY id",
    )
    .fetch_all(pool)
    .await
    .unwrap()
}

/// The `<tr>` of `key` in the tenants table of `page`.
fn tenant_row<'p>(page: &'p str, key: &str) -> &'p str {
    let start = page
        .find(&format!("<tr data-tenant=\"{key}\">"))
        .unwrap_or_else(|| panic!("no tenant {key} in:\n{page}"));
    &page[start..start + page[start..].find("</tr>").unwrap()]
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn the_console_lists_tenants_and_pauses_one_with_a_logged_action(pool: PgPool) {
    tenant_events(&pool, "audit", "acme", 3, 20).await;
    tenant_events(&pool, "audit", "globex", 1, 5).await;
    tenant_events(&pool, "billing", "initech", 2, 30).await;
    let console = Console::start(&args(&pool)).await.unwrap();
    let mut tab = Tab::new(&console);

    let overview = tab.get("/").await;
    assert_eq!(overview.status, StatusCode::OK);
    let order: Vec<&str> = overview
        .body
        .split("<tr data-tenant=\"")
        .skip(1)
        .map(|r| &r[..r.find('"').unwrap()])
        .collect();
    assert_eq!(
        order,
        ["initech", "acme", "globex"],
        "by lag, over all topics"
    );
    assert!(tenant_row(&overview.body, "acme").contains(">3<"));
    // A topic's page: its own tenants only.
    let topic = tab.get("/topics?topic=audit").await;
    assert_eq!(topic.status, StatusCode::OK);
    assert!(
        topic.body.contains("<tr data-tenant=\"acme\">"),
        "{}",
        topic.body
    );
    assert!(
        !topic.body.contains("data-tenant=\"initech\""),
        "{}",
        topic.body
    );
    assert!(
        tab.get("/topics")
            .await
            .body
            .contains("href=\"/topics?topic=audit\"")
    );

    let mut fields = vec![
        ("csrf".to_owned(), field(&topic.body, "pause-acme", "csrf")),
        ("key".to_owned(), field(&topic.body, "pause-acme", "key")),
    ];
    fields.push(("reason".into(), "noisy import".into()));
    let done = tab.post("/tenants/pause", &fields).await;
    assert_eq!(done.status, StatusCode::OK, "{}", done.body);
    assert_eq!(
        by_id(&done.body, "report"),
        "paused acme: 3 waiting events held"
    );
    assert_eq!(held(&pool, "acme").await, (3, 0));
    assert_eq!(held(&pool, "globex").await, (0, 1));
    let page = tab.get("/").await.body;
    let row = tenant_row(&page, "acme");
    assert!(
        row.contains("paused</span> since") && row.contains("by local: "),
        "{row}"
    );
    assert!(
        row.contains("noisy import") && row.contains("<form id=\"resume-acme\""),
        "{row}"
    );

    // A key the library refuses: 400 with its reason, logged as refused, nothing changed.
    let token = csrf(&page);
    let bad = tab
        .post("/tenants/pause", &form(&[("csrf", &token), ("key", "a b")]))
        .await;
    assert_eq!(bad.status, StatusCode::BAD_REQUEST, "{}", bad.body);
    assert!(
        by_id(&bad.body, "report").contains("may only contain A-Z a-z 0-9 . _ - :"),
        "{}",
        bad.body
    );
    // Without the session's CSRF token: refused before anything is logged.
    let r = tab
        .post("/tenants/resume", &form(&[("csrf", "00"), ("key", "acme")]))
        .await;
    assert_eq!(r.status, StatusCode::FORBIDDEN);
    let resumed = tab
        .post(
            "/tenants/resume",
            &form(&[("csrf", &token), ("key", "acme")]),
        )
        .await;
    assert_eq!(
        by_id(&resumed.body, "report"),
        "resumed acme: 3 waiting events due again"
    );
    assert_eq!(held(&pool, "acme").await, (0, 3));

    let log = logged(&pool).await;
    let summary: Vec<(&str, &str, &serde_json::Value)> = log
        .iter()
        .map(|(who, what, sel, _)| (who.as_str(), what.as_str(), &sel["fairness_key"]))
        .collect();
    assert_eq!(
        summary,
        [
            ("local", "pause_tenant", &serde_json::json!("acme")),
            ("local", "pause_tenant", &serde_json::json!("a b")),
            ("local", "resume_tenant", &serde_json::json!("acme")),
        ]
    );
    assert_eq!(
        log[0].3,
        Some(serde_json::json!({"paused": {"changed": true, "events": 3}}))
    );
    assert!(
        log[1].3.as_ref().unwrap()["refused"].is_string(),
        "{:?}",
        log[1].3
    );
    assert!(tab.get("/actions").await.body.contains("pause_tenant"));
    console.stop().await.unwrap();
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn a_read_only_console_shows_tenants_without_buttons_and_refuses_a_pause(pool: PgPool) {
    tenant_events(&pool, "audit", "acme", 1, 1).await;
    let mut a = args(&pool);
    a.read_only = true;
    let console = Console::start(&a).await.unwrap();
    let mut tab = Tab::new(&console);
    let page = tab.get("/").await.body;
    assert!(!tenant_row(&page, "acme").contains("<form"), "{page}");
    let r = tab
        .post(
            "/tenants/pause",
            &form(&[("csrf", &csrf(&page)), ("key", "acme")]),
        )
        .await;
    assert_eq!(r.status, StatusCode::FORBIDDEN);
    assert_eq!(held(&pool, "acme").await, (0, 1));
    assert!(logged(&pool).await.is_empty());
    console.stop().await.unwrap();
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn hostile_keys_and_reasons_are_escaped_on_the_tenants_tables(pool: PgPool) {
    // The producer refuses such a key; a row written around it, and a pause's reason, are still stored text.
    event(&pool, "audit", "k", None, "").await;
    sqlx::query("UPDATE outbox SET fairness_key = $1")
        .bind(hostile("tenant"))
        .execute(&pool)
        .await
        .unwrap();
    let mut conn = pool.acquire().await.unwrap();
    outbox::fairness::pause(&mut conn, "acme", &hostile("by"), Some(&hostile("reason")))
        .await
        .unwrap();
    let console = Console::start(&args(&pool)).await.unwrap();
    let mut tab = Tab::new(&console);
    for path in ["/", "/topics?topic=audit"] {
        let page = tab.get(path).await;
        assert_eq!(page.status, StatusCode::OK, "{path}");
        assert_no_raw_hostile_text(&page.body, path);
        assert!(
            page.body.contains("tenant-&lt;script&gt;"),
            "{path}: {}",
            page.body
        );
    }
    assert!(tab.get("/").await.body.contains("reason-&lt;script&gt;"));
    console.stop().await.unwrap();
    let (ok, out, err) = cli(&pool, &["tenants", "list"]);
    assert!(ok, "{err}");
    assert!(
        !out.contains('\u{1b}') && !out.contains('\u{202e}'),
        "{out}"
    );
    assert!(out.contains("by-<script>"), "cut, not dropped: {out}");
}
