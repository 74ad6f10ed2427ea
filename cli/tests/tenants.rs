//! Fairness per tenant from the operator's side, against real Postgres: `outbox status` lists the tenants by lag,
//! `outbox tenants pause|list|resume` holds one tenant's events in the outbox and releases them (through the
//! binary), `--qstash` pauses its flow-control keys at the dev server, and the console's overview, topic page and
//! pause/resume buttons do the same, logged in the action log.

mod common;

use outbox_cli::status::{StatusArgs, run};
use outbox_testkit::db::event;
use outbox_testkit::text;
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
async fn is_paused(http: &reqwest::Client, dev: &qstash_dev::DevServer, key: &str) -> bool {
    let v: serde_json::Value = http
        .get(format!("{}/v2/flowControl/{key}", dev.url()))
        .bearer_auth(dev.token())
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
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
        assert_eq!(is_paused(&http, &dev, key).await, want, "{key}");
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
        assert!(!is_paused(&http, &dev, key).await, "{key}");
    }
    // A wrong token: QStash refuses the list, nothing is changed (exit non-zero).
    let (ok, _, err) = with_qstash(&["tenants", "pause", "acme", "--qstash"], "wrong-token").await;
    assert!(!ok && err.contains("QStash answered 401"), "{err}");
    assert!(err.contains("nothing was changed"), "{err}");
    assert_eq!(held(&pool, "acme").await, (0, 2));
    dev.shutdown().await;
}
