//! `outbox-dev bench console`: each page of the operator console (`outbox console`) on a big database — by
//! default 1,000,000 outbox rows, 100,000 dead letters and 10,000 ordered keys, bulk-generated with
//! `generate_series` — timed by the console itself (its `Server-Timing` header: from the request's arrival to the
//! page's last byte built), the median of several requests after a warm-up. Prints a table and one `BENCH_JSON`
//! line; pages over the budget (200 ms) are named. Never an assertion.

use std::time::Instant;

use anyhow::{Context, bail};
use clap::Args;
use outbox_cli::console::{Console, ConsoleArgs};
use outbox_cli::util::DbArgs;
use outbox_testkit::{median, percentile};
use serde_json::json;

use super::support::ScratchDb;

/// Arguments of `outbox-dev bench console`.
#[derive(Args, Debug)]
pub struct ConsoleBenchArgs {
    /// Outbox rows in total.
    #[arg(long, default_value_t = 1_000_000)]
    pub rows: i64,
    /// Dead letters (each of a dead event).
    #[arg(long, default_value_t = 100_000)]
    pub dead_letters: i64,
    /// Ordered keys (five events each; one in twenty blocked by a dead head, one in twenty in flight).
    #[arg(long, default_value_t = 10_000)]
    pub keys: i64,
    /// Timed requests per page (after one warm-up).
    #[arg(long, default_value_t = 9)]
    pub requests: usize,
    /// The budget per page, milliseconds (pages over it are named).
    #[arg(long, default_value_t = 200.0)]
    pub budget_ms: f64,
    /// Keep the scratch database (its name is printed) instead of dropping it.
    #[arg(long)]
    pub keep: bool,
    #[command(flatten)]
    pub db: DbArgs,
}

/// The data, statement by statement: `$1` rows, `$2` dead letters, `$3` keys. Unordered history is delivered and
/// spread over the last 24 hours (what the relay's retention keeps), 10,000 events are pending and 2,000 in
/// flight; ordered keys have five events each; dead events carry dead letters in six error families with numbers
/// in them (so they group), a tenth of them handled.
const SEED: &[(&str, &str)] = &[
    (
        "ordered events",
        "INSERT INTO outbox (topic, partition_key, seq, payload, created_at, available_at, dispatched_at, delivered_at, \
                             dead_lettered_at, attempts, last_error) \
         SELECT 'ledger', 'acct-' || lpad(k::text, 5, '0'), s, jsonb_build_object('account', k, 'entry', s, 'pad', repeat('x', 80)), \
                now() - interval '2 hours' + make_interval(secs => s * 60), now() - interval '2 hours' + make_interval(secs => s * 60), \
                CASE WHEN (k % 20 = 0 AND s >= 3) OR (k % 20 = 1 AND s = 5) THEN NULL \
                     ELSE now() - interval '2 hours' + make_interval(secs => s * 60 + 1) END, \
                CASE WHEN (k % 20 = 0 AND s >= 3) OR (k % 20 = 1 AND s >= 4) THEN NULL \
                     ELSE now() - interval '2 hours' + make_interval(secs => s * 60 + 2) END, \
                CASE WHEN k % 20 = 0 AND s = 3 THEN now() - make_interval(secs => k) END, \
                CASE WHEN k % 20 = 0 AND s = 3 THEN 1 ELSE 1 END, \
                CASE WHEN k % 20 = 0 AND s = 3 THEN 'consumer answered 489: account ' || k || ' is closed' END \
         FROM generate_series(0, $3::bigint - 1) k CROSS JOIN generate_series(1, 5) s",
    ),
    (
        "ordered keys",
        "INSERT INTO outbox_sequences (topic, partition_key, last_seq) \
         SELECT 'ledger', 'acct-' || lpad(k::text, 5, '0'), 5 FROM generate_series(0, $3::bigint - 1) k",
    ),
    (
        "ordered key state",
        "INSERT INTO outbox_keys (topic, partition_key, done_seq, available_at, inflight_id, inflight_since, blocked_at, \
                                  blocked_id, blocked_reason) \
         SELECT 'ledger', o.partition_key, CASE WHEN k % 20 = 0 THEN 2 WHEN k % 20 = 1 THEN 3 ELSE 5 END, now(), \
                CASE WHEN k % 20 = 1 THEN o.id END, CASE WHEN k % 20 = 1 THEN o.dispatched_at END, \
                CASE WHEN k % 20 = 0 THEN o.dead_lettered_at END, CASE WHEN k % 20 = 0 THEN o.id END, \
                CASE WHEN k % 20 = 0 THEN o.last_error END \
         FROM generate_series(0, $3::bigint - 1) k \
         JOIN outbox o ON o.topic = 'ledger' AND o.partition_key = 'acct-' || lpad(k::text, 5, '0') \
                      AND o.seq = CASE WHEN k % 20 = 0 THEN 3 ELSE 4 END",
    ),
    (
        "dead events",
        "INSERT INTO outbox (topic, partition_key, payload, created_at, available_at, dead_lettered_at, attempts, last_error) \
         SELECT 'topic-' || (g % 20), 'k' || (g % 50000), jsonb_build_object('order', g, 'pad', repeat('x', 120)), \
                now() - make_interval(secs => g * 6), now() - make_interval(secs => g * 6), \
                now() - make_interval(secs => g * 6 - 5), 3, 'gave up' \
         FROM generate_series(1, $2::bigint - $3::bigint / 20) g",
    ),
    (
        "pending and in-flight events",
        "INSERT INTO outbox (topic, partition_key, payload, created_at, available_at, dispatched_at, attempts, last_error) \
         SELECT 'topic-' || (g % 20), 'p' || g, jsonb_build_object('order', g, 'pad', repeat('x', 120)), \
                now() - make_interval(secs => (g % 600)), now() - make_interval(secs => (g % 600)), \
                CASE WHEN g > 10000 THEN now() - make_interval(secs => (g % 600)) END, \
                CASE WHEN g > 10000 THEN 1 ELSE g % 6 END, \
                CASE WHEN g <= 10000 AND g % 6 > 0 THEN 'QStash answered 503 (attempt ' || (g % 6) || ')' END \
         FROM generate_series(1, 12000) g",
    ),
    (
        "delivered history",
        "INSERT INTO outbox (topic, partition_key, payload, created_at, available_at, dispatched_at, delivered_at, attempts) \
         SELECT 'topic-' || (g % 20), 'k' || (g % 50000), jsonb_build_object('order', g, 'pad', repeat('x', 120)), \
                now() - make_interval(secs => (n - g) * 86400.0 / n + 1), now() - make_interval(secs => (n - g) * 86400.0 / n + 1), \
                now() - make_interval(secs => (n - g) * 86400.0 / n), now() - make_interval(secs => (n - g) * 86400.0 / n), 1 \
         FROM (SELECT greatest($1::bigint - (SELECT count(*) FROM outbox), 0) AS n) c, generate_series(1, c.n) g",
    ),
    (
        "dead letters",
        "INSERT INTO dead_letters (source, natural_id, outbox_id, topic, partition_key, seq, payload, headers, error, status, \
                                   response_body, attempts, qstash_message_id, created_at, resolved_at, resolution) \
         SELECT CASE WHEN o.id % 3 = 0 THEN 'relay' ELSE 'qstash' END, o.id || '/1', o.id, o.topic, o.partition_key, o.seq, \
                o.payload, o.headers, \
                CASE WHEN o.seq IS NOT NULL THEN o.last_error ELSE (ARRAY[ \
                  'consumer answered 489: order ' || o.id || ' has amount_cents -' || (o.id % 97), \
                  'QStash gave up after 3 attempt(s); last status 503; upstream timeout after ' || (o.id % 30000) || 'ms', \
                  'QStash refused the message: 400 invalid destination for event ' || o.id, \
                  'consumer answered 422: schema version ' || (o.id % 4) || ' is not supported', \
                  'QStash gave up after 5 attempt(s); last status 500; connection reset by peer', \
                  'relay gave up after 10 attempts: QStash answered 429 (quota ' || (o.id % 1000) || ')'])[1 + o.id % 6] END, \
                CASE WHEN o.id % 3 = 0 THEN 400 ELSE 489 END, '{\"error\":\"refused\"}', 3, 'msg_' || o.id, \
                o.dead_lettered_at, CASE WHEN o.id % 10 = 7 AND o.seq IS NULL THEN now() END, \
                CASE WHEN o.id % 10 = 7 AND o.seq IS NULL THEN 'delivered' END \
         FROM outbox o WHERE o.dead_lettered_at IS NOT NULL",
    ),
    (
        "dedupe rows",
        "INSERT INTO processed_messages (consumer, message_id, processed_at) \
         SELECT 'consumer', id::text, delivered_at FROM outbox WHERE delivered_at IS NOT NULL AND id % 8 = 0",
    ),
];

/// The pages timed: a name, and the path (`{event}`, `{dead_letter}`, `{topic}` filled in).
const PAGES: &[(&str, &str)] = &[
    ("overview", "/?pause=1"),
    ("topics", "/topics"),
    ("keys, first page", "/keys"),
    (
        "keys, a middle page",
        "/keys?after_topic=ledger&after_key=acct-05000",
    ),
    ("keys, blocked only", "/keys?blocked=1"),
    ("keys, search by prefix", "/keys?key=acct-0421"),
    ("one event (blocked head)", "/events/{event}"),
    ("dead letters", "/dead-letters"),
    ("dead letters, with handled", "/dead-letters?all=1"),
    (
        "dead letters, topic + error text",
        "/dead-letters?topic=topic-3&error=timeout",
    ),
    ("dead letters, one group", "/dead-letters?group={group}"),
    (
        "dead letters, a later page",
        "/dead-letters?after={dead_letter}",
    ),
    ("one dead letter", "/dead-letters/{dead_letter}"),
    (
        "confirm bulk redrive (topic)",
        "/dead-letters/confirm?action=redrive&topic=topic-3",
    ),
    (
        "confirm bulk purge (group)",
        "/dead-letters/confirm?action=purge&group={group}",
    ),
    ("action log", "/actions"),
];

/// Runs the benchmark.
pub async fn run(args: ConsoleBenchArgs) -> anyhow::Result<()> {
    let db = ScratchDb::create(&args.db.database_url, "outbox_bench_console").await?;
    println!(
        "database {} ({})",
        db.name,
        if args.keep {
            "kept"
        } else {
            "dropped at the end"
        }
    );
    let t = Instant::now();
    for (what, sql) in SEED {
        let s = Instant::now();
        sqlx::query(sqlx::AssertSqlSafe(*sql))
            .bind(args.rows)
            .bind(args.dead_letters)
            .bind(args.keys)
            .execute(&db.pool)
            .await
            .with_context(|| format!("seeding {what}"))?;
        println!("  seeded {what} in {:.1}s", s.elapsed().as_secs_f64());
    }
    sqlx::query("VACUUM ANALYZE").execute(&db.pool).await?;
    let (rows, dead, keys): (i64, i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM outbox), (SELECT count(*) FROM dead_letters), (SELECT count(*) FROM outbox_keys)",
    )
    .fetch_one(&db.pool)
    .await?;
    println!(
        "seeded {rows} outbox rows, {dead} dead letters, {keys} ordered keys in {:.0}s (VACUUM ANALYZE included)",
        t.elapsed().as_secs_f64()
    );
    let event: i64 =
        sqlx::query_scalar("SELECT blocked_id FROM outbox_keys WHERE blocked_id IS NOT NULL ORDER BY partition_key LIMIT 1 OFFSET 100")
            .fetch_one(&db.pool)
            .await?;
    let dead_letter: i64 =
        sqlx::query_scalar("SELECT id FROM dead_letters ORDER BY id LIMIT 1 OFFSET 50000")
            .fetch_one(&db.pool)
            .await?;
    let group: String = sqlx::query_scalar(
        "SELECT error_group FROM dead_letters WHERE error LIKE 'QStash gave up after 3%' LIMIT 1",
    )
    .fetch_one(&db.pool)
    .await?;

    let console = Console::start(&ConsoleArgs {
        db: DbArgs {
            database_url: db.url.clone(),
        },
        port: 0,
        bind: std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST),
        read_only: false,
        token_file: None,
        allow_host: Vec::new(),
        consumers: vec!["consumer".into()],
        refresh_secs: 0,
        statement_timeout_secs: outbox_cli::console::DEFAULT_STATEMENT_TIMEOUT_SECS,
    })
    .await?;
    outbox::install_crypto_provider();
    let http = reqwest::Client::new();
    // A session, as a browser would have one.
    let first = http.get(format!("{}/", console.url())).send().await?;
    let cookie = first
        .headers()
        .get(reqwest::header::SET_COOKIE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .map(str::to_owned)
        .context("no session cookie")?;

    let enc = |s: &str| -> String { url::form_urlencoded::byte_serialize(s.as_bytes()).collect() };
    println!(
        "\n{:<34} {:>10} {:>10} {:>10} {:>9}",
        "page", "median ms", "p90 ms", "client ms", "bytes"
    );
    let mut results = Vec::new();
    let mut over = Vec::new();
    for (name, path) in PAGES {
        let path = path
            .replace("{event}", &event.to_string())
            .replace("{dead_letter}", &dead_letter.to_string())
            .replace("{group}", &enc(&group));
        let mut server = Vec::new();
        let mut client = Vec::new();
        let mut bytes = 0;
        for i in 0..=args.requests.max(1) {
            let t = Instant::now();
            let r = http
                .get(format!("{}{path}", console.url()))
                .header(reqwest::header::COOKIE, &cookie)
                .send()
                .await?;
            let status = r.status();
            let timing = r
                .headers()
                .get("server-timing")
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.split("dur=").nth(1))
                .and_then(|v| v.parse::<f64>().ok());
            let body = r.bytes().await?;
            let elapsed = t.elapsed().as_secs_f64() * 1000.0;
            if !status.is_success() {
                bail!("{name} ({path}) answered {status}");
            }
            if i == 0 {
                continue; // warm-up
            }
            server.push(timing.context("no Server-Timing header")?);
            client.push(elapsed);
            bytes = body.len();
        }
        let (m, p90, c) = (median(&server), percentile(&server, 0.9), median(&client));
        println!("{name:<34} {m:>10.1} {p90:>10.1} {c:>10.1} {bytes:>9}");
        if m > args.budget_ms {
            over.push(name.to_string());
        }
        results.push(json!({"page": name, "path": path, "median_ms": m, "p90_ms": p90, "client_median_ms": c, "bytes": bytes}));
    }
    console.stop().await?;
    if over.is_empty() {
        println!("\nevery page's median is within {} ms", args.budget_ms);
    } else {
        println!("\nover {} ms: {}", args.budget_ms, over.join(", "));
    }
    println!(
        "BENCH_JSON {}",
        json!({
            "bench": "console",
            "outbox_rows": rows,
            "dead_letters": dead,
            "ordered_keys": keys,
            "requests": args.requests.max(1),
            "budget_ms": args.budget_ms,
            "over_budget": over,
            "pages": results,
        })
    );
    if args.keep {
        println!("kept database {} ({})", db.name, db.url);
    } else {
        db.drop_now().await?;
    }
    Ok(())
}
