//! `outbox console` in a real browser: headless Chromium driven over WebDriver (`chromedriver`), the console on a
//! free port against real Postgres. The overview shows the numbers of `outbox status --json`; an operator finds a
//! blocked key, opens its head event's timeline, redrives it, and sees the key move on with the pipeline running
//! underneath; a bulk purge without a filter is refused; read-only mode offers and allows no action; the hostile
//! corpus runs nothing and the pages stay readable.
//!
//! Needs Debian's `chromium` and `chromium-driver` (`scripts/test-deps` installs them): without them these tests
//! skip loudly, and fail under CI. With `CONSOLE_SCREENSHOTS=<dir>` they save screenshots of each page there
//! (`docs/console/` holds the ones in docs/console.md).

mod console_kit;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use console_kit::webdriver::{Browser, find_tools};
use console_kit::{args, seed_hostile};
use outbox::consumer::{Event, Handler, HandlerError, Registry, TopicRoute};
use outbox::producer::{NewEvent, Topic, enqueue_batch};
use outbox_cli::console::Console;
use outbox_cli::status::{StatusArgs, run as status};
use outbox_cli::util::DbArgs;
use outbox_testkit::db::{dead_letter, event, key_state, url_of};
use outbox_testkit::stack::{LocalStack, StackOptions};
use serde_json::{Value, json};
use sqlx::PgPool;

/// A browser, or `None` (the test returns) when Chromium or chromedriver is missing outside CI.
async fn browser() -> Option<Browser> {
    match find_tools() {
        Some((driver, chromium)) => Some(Browser::start(&driver, &chromium).await),
        None => {
            outbox_testkit::skip_or_fail_under_ci(
                "chromium / chromedriver",
                "apt-get install chromium chromium-driver, or run scripts/test-deps as root",
                "the console's browser tests did not run",
            );
            None
        }
    }
}

/// A screenshot of the whole page (the window grown to the page's height), checked to be a PNG, and saved as
/// `<name>.png` under `CONSOLE_SCREENSHOTS` when that is set.
async fn screenshot(b: &Browser, name: &str) {
    let body = b.one("body").await;
    let h = b
        .property(&body, "scrollHeight")
        .await
        .as_u64()
        .unwrap_or(900) as u32;
    b.resize(1280, h.clamp(600, 2400) + 90).await;
    let png = b.screenshot().await;
    b.resize(1280, 900).await;
    assert!(png.starts_with(b"\x89PNG"), "{name}: not a PNG");
    if let Ok(dir) = std::env::var("CONSOLE_SCREENSHOTS") {
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(std::path::Path::new(&dir).join(format!("{name}.png")), png).unwrap();
    }
}

/// The value at `path` (`backlog.pending`) of `outbox status --json`, as the console prints it.
fn status_figure(status: &Value, path: &str) -> Value {
    match path {
        "unresolved_dead_letters" => json!(
            status["dead_letters"]
                .as_array()
                .unwrap()
                .iter()
                .map(|d| d["unresolved"].as_i64().unwrap())
                .sum::<i64>()
        ),
        "qstash_outage.active" => json!(!status["qstash_outage"]["since"].is_null()),
        _ => path.split('.').fold(status.clone(), |v, k| v[k].clone()),
    }
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn the_overview_shows_the_numbers_of_outbox_status_json(pool: PgPool) {
    let Some(b) = browser().await else { return };
    // A blocked key with a dead letter, pending and flapping events, a stuck lease, dispatched and in-flight ones.
    let head = event(
        &pool,
        "orders",
        "c-1",
        Some(1),
        "dead_lettered_at = now(), attempts = 3",
    )
    .await;
    event(&pool, "orders", "c-1", Some(2), "").await;
    key_state(
        &pool,
        "orders",
        "c-1",
        2,
        0,
        &format!("blocked_at = now(), blocked_id = {head}, blocked_reason = 'refused'"),
    )
    .await;
    dead_letter(&pool, "qstash", Some(head), "").await;
    event(
        &pool,
        "billing",
        "b-1",
        None,
        "attempts = 7, last_error = 'QStash said 500'",
    )
    .await;
    event(
        &pool,
        "billing",
        "b-2",
        None,
        "locked_until = now() - interval '1 minute', attempts = 1",
    )
    .await;
    sqlx::query(
        "INSERT INTO outbox (topic, partition_key, payload, dispatched_at, delivered_at) \
         SELECT 'audit', 'a' || g, '{}', now() - make_interval(secs => g * 20), \
                CASE WHEN g % 4 = 0 THEN NULL ELSE now() END FROM generate_series(1, 120) g",
    )
    .execute(&pool)
    .await
    .unwrap();

    let mut out = Vec::new();
    status(
        StatusArgs {
            db: DbArgs {
                database_url: url_of(&pool),
            },
            json: true,
            warn_age_secs: 300,
        },
        &mut out,
    )
    .await
    .unwrap();
    let want: Value = serde_json::from_slice(&out).unwrap();

    let console = Console::start(&args(&pool)).await.unwrap();
    b.goto(&format!("{}/?pause=1", console.url())).await;
    assert_eq!(b.title().await, "Overview · outbox console");
    let mut compared = Vec::new();
    for e in b.all("[data-figure]").await {
        let path = b.attr(&e, "data-figure").await.unwrap();
        let shown = b.text(&e).await;
        let expected = status_figure(&want, &path);
        match path.as_str() {
            // Seconds that kept growing between the two reads.
            "backlog.oldest_pending_age_secs" => {
                let (s, w): (f64, f64) = (shown.parse().unwrap(), expected.as_f64().unwrap());
                assert!((s - w).abs() < 30.0, "{path}: {shown} vs {w}");
            }
            "qstash_outage.active" => {
                assert_eq!(
                    shown == "outage",
                    expected.as_bool().unwrap(),
                    "{path}: {shown}"
                );
            }
            _ => assert_eq!(shown, expected.to_string(), "{path}"),
        }
        compared.push(path);
    }
    for p in [
        "backlog.pending",
        "in_flight.total",
        "throughput.last_hour",
        "blocked_keys.count",
        "unresolved_dead_letters",
        "stuck_leases.count",
        "backlog.flapping",
    ] {
        assert!(
            compared.iter().any(|c| c == p),
            "{p} is on the overview ({compared:?})"
        );
    }
    assert_ne!(
        status_figure(&want, "throughput.last_hour"),
        json!(0),
        "the data is not all zeros"
    );
    // 60 bars, one per minute.
    assert_eq!(b.all("svg.chart rect").await.len(), 60);
    b.quit().await;
    console.stop().await.unwrap();
}

const LEDGER: Topic = Topic::ordered("ledger");

/// Applies every event, except the ones marked poison while `fail` is set (the bug not yet fixed).
struct Ledger {
    fail: Arc<AtomicBool>,
}

impl Handler<Value> for Ledger {
    async fn handle(
        &self,
        _conn: &mut sqlx::PgConnection,
        event: &Event<Value>,
    ) -> Result<(), HandlerError> {
        if self.fail.load(Ordering::SeqCst) && event.payload["poison"] == json!(true) {
            return Err(HandlerError::permanent(
                "order 17: amount_cents is -5 (poisoned until the fix)",
            ));
        }
        Ok(())
    }
}

async fn wait_for(pool: &PgPool, what: &str, sql: &'static str, want: i64) {
    for _ in 0..600 {
        let n: i64 = sqlx::query_scalar(sql).fetch_one(pool).await.unwrap();
        if n == want {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("timed out waiting for {what}");
}

/// Text of the first element matching `css`, once it contains `want` (the page reloaded until then).
async fn wait_for_text(b: &Browser, url: &str, css: &str, want: &str) -> String {
    let mut last = String::new();
    for _ in 0..120 {
        b.goto(url).await;
        if let Some(e) = b.all(css).await.into_iter().next() {
            last = b.text(&e).await;
            if last.contains(want) {
                return last;
            }
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    panic!("{url}: {css} never showed {want:?} (last: {last:?})");
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn a_blocked_key_is_found_its_head_redriven_and_the_key_moves_on(pool: PgPool) {
    let Some(b) = browser().await else { return };
    let fail = Arc::new(AtomicBool::new(true));
    let mut opts = StackOptions::new(&url_of(&pool)).unwrap();
    opts.migrators = vec![&outbox::MIGRATOR];
    opts.registry = Registry::new().route(TopicRoute::new("ledger", Ledger { fail: fail.clone() }));
    let stack = LocalStack::start(opts).await.unwrap();

    let mut events = vec![
        NewEvent::new(
            &LEDGER,
            "acct-17",
            &json!({"order": 17, "amount_cents": -5, "poison": true}),
        )
        .unwrap(),
        NewEvent::new(
            &LEDGER,
            "acct-17",
            &json!({"order": 18, "amount_cents": 1200}),
        )
        .unwrap(),
        NewEvent::new(
            &LEDGER,
            "acct-17",
            &json!({"order": 19, "amount_cents": 300}),
        )
        .unwrap(),
    ];
    for i in 0..20 {
        events.push(
            NewEvent::new(
                &LEDGER,
                format!("acct-{}", 100 + i % 5),
                &json!({"order": 100 + i}),
            )
            .unwrap(),
        );
    }
    let mut tx = pool.begin().await.unwrap();
    let ids: Vec<i64> = enqueue_batch(&mut tx, &events)
        .await
        .unwrap()
        .iter()
        .map(|e| e.id.get())
        .collect();
    tx.commit().await.unwrap();
    wait_for(
        &pool,
        "the poisoned head to block its key",
        "SELECT count(*) FROM outbox_keys WHERE blocked_at IS NOT NULL",
        1,
    )
    .await;
    wait_for(
        &pool,
        "its dead letter",
        "SELECT count(*) FROM dead_letters",
        1,
    )
    .await;
    wait_for(
        &pool,
        "the other keys to be delivered",
        "SELECT count(*) FROM outbox WHERE delivered_at IS NOT NULL",
        20,
    )
    .await;

    let console = Console::start(&args(&pool)).await.unwrap();
    let base = console.url();
    b.goto(&format!("{base}/?pause=1")).await;
    screenshot(&b, "overview").await;
    assert_eq!(
        b.text(&b.one("[data-figure='blocked_keys.count']").await)
            .await,
        "1"
    );

    // Find the blocked key and open its head event.
    b.goto(&format!("{base}/keys?blocked=1")).await;
    screenshot(&b, "keys").await;
    let row = b.one("#keys tr[data-key-state='blocked']").await;
    assert!(b.text(&row).await.contains("acct-17"));
    b.click(
        &b.one("#keys tr[data-key-state='blocked'] td:nth-child(8) a")
            .await,
    )
    .await;
    assert_eq!(b.text(&b.one("#event-state").await).await, "dead");
    assert_eq!(b.url().await, format!("{base}/events/{}", ids[0]));
    let timeline = b.text(&b.one("#timeline").await).await;
    assert!(
        timeline.contains("written by the producer") && timeline.contains("dead letter #"),
        "{timeline}"
    );
    assert!(timeline.contains("amount_cents is -5"), "{timeline}");
    screenshot(&b, "event").await;

    // The fix is deployed: redrive from the dead letter's page.
    b.click(&b.one("#timeline a[href^='/dead-letters/']").await)
        .await;
    assert_eq!(b.text(&b.one("#dl-state").await).await, "unhandled");
    screenshot(&b, "dead-letter").await;
    fail.store(false, Ordering::SeqCst);
    b.click(&b.one("#redrive button").await).await;
    let report = b.text(&b.one("#report").await).await;
    assert!(
        report.contains("redriven") && report.contains("its key is unblocked"),
        "{report}"
    );

    // The key moves on: the head and the two behind it are delivered, the key has nothing left.
    let key_url = format!("{base}/keys?key=acct-17");
    wait_for_text(&b, &key_url, "#keys tr td:nth-child(4)", "idle").await;
    wait_for(
        &pool,
        "acct-17 delivered",
        "SELECT count(*) FROM outbox WHERE partition_key = 'acct-17' AND delivered_at IS NOT NULL",
        3,
    )
    .await;
    b.goto(&format!("{base}/events/{}", ids[0])).await;
    assert_eq!(b.text(&b.one("#event-state").await).await, "delivered");
    let timeline = b.text(&b.one("#timeline").await).await;
    assert!(timeline.contains("console: redrive by local"), "{timeline}");
    assert!(timeline.contains("redriven (dead letter"), "{timeline}");
    screenshot(&b, "event-after-redrive").await;
    b.goto(&format!("{base}/dead-letters?all=1")).await;
    screenshot(&b, "dead-letters").await;
    b.goto(&format!("{base}/actions")).await;
    assert!(b.text(&b.one("#actions").await).await.contains("redrive"));
    b.goto(&format!("{base}/topics")).await;
    screenshot(&b, "topics").await;

    b.quit().await;
    console.stop().await.unwrap();
    stack.stop().await;
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn a_bulk_purge_needs_a_filter_and_then_purges_what_it_counted(pool: PgPool) {
    let Some(b) = browser().await else { return };
    for (topic, n) in [("orders", 3), ("billing", 2)] {
        for i in 0..n {
            let e = event(
                &pool,
                topic,
                &format!("{topic}-{i}"),
                None,
                "dead_lettered_at = now()",
            )
            .await;
            dead_letter(
                &pool,
                "relay",
                Some(e),
                &format!("error = 'QStash refused the message: 400 for event {e}'"),
            )
            .await;
        }
    }
    let count = || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM dead_letters")
            .fetch_one(&pool)
            .await
            .unwrap()
    };
    let console = Console::start(&args(&pool)).await.unwrap();
    let base = console.url();

    // No filter: the purge link leads to a refusal, and nothing is deleted.
    b.goto(&format!("{base}/dead-letters")).await;
    b.click(&b.all("#bulk a").await[1]).await;
    assert!(
        b.text(&b.one("#refused").await)
            .await
            .contains("needs a filter")
    );
    assert_eq!(count().await, 5);

    // A filter typed into the form: the confirmation counts, the purge deletes exactly that.
    b.goto(&format!("{base}/dead-letters")).await;
    b.type_into(&b.one("form.filters input[name='topic']").await, "orders")
        .await;
    b.click(&b.one("form.filters button").await).await;
    assert_eq!(b.text_of("#total", "3").await, "3");
    screenshot(&b, "dead-letters-filtered").await;
    b.click(&b.all("#bulk a").await[1]).await;
    assert_eq!(b.text(&b.one("#count").await).await, "3");
    screenshot(&b, "confirm-purge").await;
    b.click(&b.one("#confirm button").await).await;
    assert_eq!(b.text(&b.one("#done").await).await, "3");
    screenshot(&b, "purge-report").await;
    assert_eq!(count().await, 2);
    let left: Vec<String> = sqlx::query_scalar("SELECT DISTINCT topic FROM dead_letters")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(left, ["billing"]);
    b.quit().await;
    console.stop().await.unwrap();
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn read_only_mode_offers_no_action_and_refuses_them(pool: PgPool) {
    let Some(b) = browser().await else { return };
    let e = event(&pool, "orders", "o-1", None, "dead_lettered_at = now()").await;
    let dl = dead_letter(&pool, "relay", Some(e), "").await;
    let mut a = args(&pool);
    a.read_only = true;
    let console = Console::start(&a).await.unwrap();
    let base = console.url();
    b.goto(&format!("{base}/dead-letters/{dl}")).await;
    assert!(
        b.text(&b.one("#read-only").await)
            .await
            .contains("Read-only")
    );
    assert!(b.all("#redrive").await.is_empty(), "no redrive form");
    assert!(
        b.all("form[method='post']").await.is_empty(),
        "no form that changes anything"
    );
    screenshot(&b, "read-only").await;
    b.goto(&format!("{base}/dead-letters")).await;
    assert!(b.all("#bulk").await.is_empty(), "no bulk actions");
    b.goto(&format!(
        "{base}/dead-letters/confirm?action=purge&topic=orders"
    ))
    .await;
    assert!(b.text(&b.one("main").await).await.contains("read-only"));
    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM dead_letters WHERE redriven_at IS NULL")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(n, 1);
    b.quit().await;
    console.stop().await.unwrap();
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn the_hostile_corpus_runs_nothing_and_stays_readable(pool: PgPool) {
    let Some(b) = browser().await else { return };
    let (head, dl, topic, _) = seed_hostile(&pool).await;
    let console = Console::start(&args(&pool)).await.unwrap();
    let base = console.url();
    let pages = [
        ("/?pause=1", "Overview"),
        ("/topics", "Topics"),
        ("/keys", "Keys"),
        (&*format!("/events/{head}"), "Event"),
        ("/dead-letters", "Dead letters"),
        (&*format!("/dead-letters/{dl}"), "Dead letter"),
    ];
    for (path, title) in pages {
        b.goto(&format!("{base}{path}")).await;
        // The corpus would set the title, add a <blink>, and carries <img>, <svg onload> and <script> elements.
        assert_eq!(
            b.title().await,
            format!("{title} · outbox console"),
            "{path}"
        );
        for css in [
            "blink",
            "img",
            "script",
            "svg[onload]",
            "[onerror]",
            "[onload]",
        ] {
            assert!(
                b.all(css).await.is_empty(),
                "{path}: a {css} element made it into the page"
            );
        }
        let source = b.source().await;
        assert!(!source.contains('\u{202e}'), "{path}: a raw bidi override");
    }
    // Readable: the stored text is there as text, the override and controls as visible escapes.
    b.goto(&format!("{base}/events/{head}")).await;
    let shown = b.text(&b.one("#event tr:nth-child(2) td").await).await;
    assert!(
        shown.starts_with("topic-<script>document.title='pwned'</script>\"><img"),
        "{shown}"
    );
    assert!(
        shown.contains("\\u{202e}gnp.exe\\u{1b}[31m\\u{7}\\u{8}end"),
        "{shown}"
    );
    assert!(topic.contains('\u{202e}'));
    screenshot(&b, "hostile").await;
    b.quit().await;
    console.stop().await.unwrap();
}
