//! The outbox under its own Postgres schema (`OUTBOX_SCHEMA`) beside an application's tables.
//!
//! * `outbox migrate` (the real binary) on a database that already holds an application's `orders`, `charges`,
//!   `shipments` and `audit_log`: in `public` it adds only the outbox's tables and changes none of the
//!   application's (definitions and rows compared before and after); with `OUTBOX_SCHEMA=outbox` it succeeds
//!   beside an application `dead_letters` table of the same name, and nothing at all lands in `public`.
//! * The whole pipeline with `OUTBOX_SCHEMA=outbox`: producer, relay, consumer (whose handlers write the
//!   application's tables in `public`, in the dedupe row's transaction, on the application's own `search_path`),
//!   failure callback, and the operator commands (`status`, `dead-letters list/show/redrive`, `prune`) run as the
//!   real binary with the variable set.
//!
//! Every in-process statement of this test binary uses the `outbox` schema (one outbox schema per process, see
//! `outbox::schema`); the `public` cases run the CLI as a child process.

mod common;

use std::time::Duration;

use outbox_testkit::db::url_of;
use outbox_testkit::stack::{LocalStack, StackOptions};
use serde_json::Value;
use sqlx::PgPool;

/// The outbox's tables, as the migrations create them.
const OUTBOX_TABLES: [&str; 13] = [
    "_sqlx_migrations",
    "consumer_sequences",
    "dead_letters",
    "outbox",
    "outbox_accounting",
    "outbox_console_actions",
    "outbox_default_consumer",
    "outbox_keys",
    "outbox_paused_keys",
    "outbox_relay_outage",
    "outbox_sequences",
    "outbox_subscribers",
    "processed_messages",
];

/// An application's own tables, with rows, before the outbox arrives (names chosen to clash with the example
/// application's and, with `with_dead_letters`, with the outbox's own `dead_letters`).
async fn application_tables(pool: &PgPool, with_dead_letters: bool) {
    let mut ddl = vec![
        "CREATE TABLE orders (id text PRIMARY KEY, amount_cents bigint NOT NULL CHECK (amount_cents > 0))",
        "CREATE TABLE charges (order_id text PRIMARY KEY REFERENCES orders (id), status text NOT NULL)",
        "CREATE TABLE shipments (order_id text PRIMARY KEY, carrier text)",
        "CREATE INDEX shipments_carrier_idx ON shipments (carrier)",
        "CREATE TABLE audit_log (id bigserial PRIMARY KEY, action text NOT NULL, at timestamptz DEFAULT now())",
        "INSERT INTO orders VALUES ('o-1', 1200), ('o-2', 800)",
        "INSERT INTO charges VALUES ('o-1', 'captured')",
        "INSERT INTO shipments VALUES ('o-1', 'dhl')",
        "INSERT INTO audit_log (action, at) VALUES ('order.placed', '2026-01-01T00:00:00Z')",
    ];
    if with_dead_letters {
        ddl.push(
            "CREATE TABLE dead_letters (id serial PRIMARY KEY, job text NOT NULL, reason text)",
        );
        ddl.push("INSERT INTO dead_letters (job, reason) VALUES ('email-42', 'smtp timeout')");
    }
    for sql in ddl {
        sqlx::query(sql).execute(pool).await.unwrap();
    }
}

/// Every relation of a schema with its definition: kind, columns (name, type, nullability, default), indexes,
/// constraints; and every table's rows as JSON.
async fn snapshot(pool: &PgPool, schema: &str) -> Vec<(String, String, String)> {
    sqlx::query_as(
        "SELECT c.relname::text, CASE WHEN c.relispartition THEN 'partition' ELSE c.relkind::text END, \
                concat_ws(' | ', \
                  (SELECT string_agg(a.attname || ' ' || format_type(a.atttypid, a.atttypmod) \
                                     || CASE WHEN a.attnotnull THEN ' not null' ELSE '' END \
                                     || coalesce(' default ' || pg_get_expr(d.adbin, d.adrelid), ''), ', ' \
                                     ORDER BY a.attnum) \
                     FROM pg_attribute a LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum \
                    WHERE a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped), \
                  (SELECT string_agg(pg_get_indexdef(i.indexrelid), '; ' ORDER BY 1) \
                     FROM pg_index i WHERE i.indrelid = c.oid), \
                  (SELECT string_agg(conname || ' ' || pg_get_constraintdef(k.oid), '; ' ORDER BY 1) \
                     FROM pg_constraint k WHERE k.conrelid = c.oid), \
                  CASE WHEN c.relkind = 'r' THEN \
                    query_to_xml(format('SELECT * FROM %I.%I ORDER BY 1', n.nspname, c.relname), false, false, '')::text \
                  END) \
         FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace \
         WHERE n.nspname = $1 ORDER BY 1",
    )
    .bind(schema)
    .fetch_all(pool)
    .await
    .unwrap()
}

fn tables(snapshot: &[(String, String, String)]) -> Vec<String> {
    snapshot
        .iter()
        // Tables and partitioned tables (the outbox), not their partitions.
        .filter(|(_, kind, _)| kind == "r" || kind == "p")
        .map(|(name, _, _)| name.clone())
        .collect()
}

/// Runs the `outbox` binary; `schema` is `OUTBOX_SCHEMA` (unset when `None`).
async fn cli(pool: &PgPool, schema: Option<&str>, args: &[&str]) -> (bool, String, String) {
    let mut cmd = tokio::process::Command::from(common::outbox(pool, args));
    cmd.kill_on_drop(true);
    if let Some(s) = schema {
        cmd.env("OUTBOX_SCHEMA", s);
    }
    let out = tokio::time::timeout(Duration::from_secs(120), cmd.output())
        .await
        .expect("the CLI finishes")
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[sqlx::test(migrations = false)]
async fn migrate_in_public_adds_only_outbox_tables_and_changes_no_application_table(pool: PgPool) {
    application_tables(&pool, false).await;
    let before = snapshot(&pool, "public").await;
    let (ok, stdout, stderr) = cli(&pool, None, &["migrate"]).await;
    assert!(ok, "outbox migrate failed:\n{stdout}\n{stderr}");
    let after = snapshot(&pool, "public").await;
    for relation in &before {
        assert!(
            after.contains(relation),
            "outbox migrate changed the application's {relation:?}"
        );
    }
    let mut added: Vec<String> = tables(&after)
        .into_iter()
        .filter(|t| !tables(&before).contains(t))
        .collect();
    added.sort();
    assert_eq!(added, OUTBOX_TABLES);
}

#[sqlx::test(migrations = false)]
async fn migrate_in_its_own_schema_lands_nothing_in_public(pool: PgPool) {
    application_tables(&pool, true).await;
    let before = snapshot(&pool, "public").await;

    // Twice: the second run finds everything applied (its bookkeeping is in the outbox schema too).
    for _ in 0..2 {
        let (ok, stdout, stderr) = cli(&pool, Some("outbox"), &["migrate"]).await;
        assert!(
            ok,
            "OUTBOX_SCHEMA=outbox outbox migrate failed:\n{stdout}\n{stderr}"
        );
        assert!(stdout.contains("schema version"), "{stdout}");
    }
    assert_eq!(
        snapshot(&pool, "public").await,
        before,
        "something in public changed"
    );
    assert_eq!(tables(&snapshot(&pool, "outbox").await), OUTBOX_TABLES);
    let public_outbox_relations: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM information_schema.tables \
         WHERE table_schema = 'public' AND table_name IN ('outbox', 'outbox_keys', 'outbox_sequences', \
               'processed_messages', 'consumer_sequences', '_sqlx_migrations')",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(public_outbox_relations, 0);
    let app_dead_letter: String = sqlx::query_scalar("SELECT job FROM public.dead_letters")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(app_dead_letter, "email-42");

    // The same database without the schema: the outbox's dead_letters clashes with the application's.
    let (ok, _, stderr) = cli(&pool, None, &["migrate"]).await;
    assert!(
        !ok,
        "migrating into public beside an application dead_letters table must fail"
    );
    assert!(stderr.contains("dead_letters"), "{stderr}");
}

#[sqlx::test(migrations = false)]
async fn an_invalid_schema_name_is_refused_before_anything_runs(pool: PgPool) {
    for bad in ["Outbox", "out;box", "pg_outbox"] {
        let (ok, _, stderr) = cli(&pool, Some(bad), &["migrate"]).await;
        assert!(!ok, "{bad:?} accepted");
        assert!(
            stderr.contains("OUTBOX_SCHEMA") && stderr.contains("invalid outbox schema name"),
            "{stderr}"
        );
    }
    let schemas: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_namespace WHERE nspname NOT LIKE 'pg\\_%' \
         AND nspname NOT IN ('public', 'information_schema')",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(schemas, 0);
}

async fn scalar(pool: &PgPool, sql: &str) -> i64 {
    sqlx::query_scalar::<_, i64>(sqlx::AssertSqlSafe(sql.to_owned()))
        .fetch_one(pool)
        .await
        .unwrap()
}

async fn wait_for(pool: &PgPool, sql: &str, want: i64) {
    for _ in 0..600 {
        if scalar(pool, sql).await == want {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("timed out waiting for {sql} = {want}");
}

#[sqlx::test(migrations = false)]
async fn the_whole_pipeline_runs_with_the_outbox_in_its_own_schema(pool: PgPool) {
    let schema = outbox::schema::Schema::new("outbox").unwrap();
    outbox::schema::install(&schema).unwrap();
    // The application's own dead_letters in public, which the outbox must never touch.
    sqlx::query("CREATE TABLE dead_letters (id serial PRIMARY KEY, job text NOT NULL)")
        .execute(&pool)
        .await
        .unwrap();
    sqlx::query("INSERT INTO dead_letters (job) VALUES ('email-42')")
        .execute(&pool)
        .await
        .unwrap();

    let mut opts = StackOptions::new(&url_of(&pool)).unwrap();
    opts.dev.time_scale = 0.005;
    let stack = LocalStack::start(opts).await.unwrap();
    // The example application's migrations went to public (its handlers' tables), the outbox's to "outbox".
    assert_eq!(
        tables(&snapshot(&pool, "outbox").await),
        OUTBOX_TABLES,
        "the outbox's tables"
    );
    assert_eq!(
        scalar(
            &pool,
            "SELECT count(*) FROM information_schema.tables WHERE table_schema = 'public' \
             AND table_name IN ('outbox', 'outbox_keys', 'processed_messages')"
        )
        .await,
        0
    );

    // 10 orders (order 5 and 10 poison: the consumer answers 489, QStash calls the failure callback).
    let orders = 10u64;
    for n in 1..=orders {
        orders_example::demo::place_order(&stack.pool, n, n % 5 == 0, None)
            .await
            .unwrap();
    }
    assert!(
        stack.wait_quiet(Duration::from_secs(120)).await,
        "the pipeline did not drain"
    );
    // The consumer's handlers wrote the application's tables in public; dedupe rows and dead letters are the
    // outbox's, in its schema; the application's dead_letters is untouched.
    let good = (orders - 2) as i64;
    assert_eq!(
        scalar(&pool, "SELECT count(*) FROM public.charges").await,
        good
    );
    assert_eq!(
        scalar(&pool, "SELECT count(*) FROM public.audit_log").await,
        orders as i64
    );
    let events = scalar(&pool, "SELECT count(*) FROM outbox.outbox").await;
    assert_eq!(
        scalar(&pool, "SELECT count(*) FROM outbox.processed_messages").await
            + scalar(&pool, "SELECT count(*) FROM outbox.dead_letters").await,
        events
    );
    assert_eq!(
        scalar(
            &pool,
            "SELECT count(*) FROM outbox.dead_letters WHERE source = 'qstash' AND status = 489"
        )
        .await,
        2
    );
    assert_eq!(
        scalar(&pool, "SELECT count(*) FROM public.dead_letters").await,
        1
    );

    // The operator commands, as the real binary with OUTBOX_SCHEMA=outbox.
    let (ok, stdout, stderr) = cli(&pool, Some("outbox"), &["status", "--json"]).await;
    assert!(ok, "{stderr}");
    let status: Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(status["backlog"]["pending"], 0, "{status}");
    assert_eq!(status["blocked_keys"]["count"], 2, "{status}");

    let (ok, stdout, stderr) =
        cli(&pool, Some("outbox"), &["dead-letters", "list", "--json"]).await;
    assert!(ok, "{stderr}");
    let page: Value = serde_json::from_str(&stdout).unwrap();
    let items = page["items"].as_array().cloned().unwrap_or_default();
    assert_eq!(items.len(), 2, "{page}");
    let id = items[0]["id"].as_i64().unwrap().to_string();
    let (ok, stdout, stderr) = cli(&pool, Some("outbox"), &["dead-letters", "show", &id]).await;
    assert!(ok && stdout.contains("order-"), "{stdout}\n{stderr}");

    // Redrive the first: the event goes out again, is refused again (still poison), and dead-letters again.
    let (ok, stdout, stderr) = cli(
        &pool,
        Some("outbox"),
        &["dead-letters", "redrive", &id, "--yes"],
    )
    .await;
    assert!(ok, "{stdout}\n{stderr}");
    wait_for(&pool, "SELECT count(*) FROM outbox.dead_letters", 3).await;
    assert!(stack.wait_quiet(Duration::from_secs(120)).await);
    assert_eq!(
        scalar(
            &pool,
            "SELECT count(*) FROM outbox.dead_letters WHERE redriven_at IS NOT NULL"
        )
        .await,
        1
    );

    // Housekeeping: prune every dispatched, delivered row older than a second and the dedupe rows.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let before = scalar(&pool, "SELECT count(*) FROM outbox.outbox").await;
    let (ok, stdout, stderr) = cli(
        &pool,
        Some("outbox"),
        &[
            "prune",
            "--outbox-hours",
            "0.0002",
            "--processed-hours",
            "0.0002",
            "--json",
        ],
    )
    .await;
    assert!(ok, "{stdout}\n{stderr}");
    let after = scalar(&pool, "SELECT count(*) FROM outbox.outbox").await;
    assert!(
        after < before,
        "prune deleted nothing ({before} rows): {stdout}"
    );
    assert_eq!(
        scalar(&pool, "SELECT count(*) FROM outbox.processed_messages").await,
        0
    );
    assert_eq!(
        scalar(&pool, "SELECT count(*) FROM public.dead_letters").await,
        1
    );
    assert_eq!(
        scalar(&pool, "SELECT count(*) FROM public.charges").await,
        good
    );
    stack.stop().await;
}
