//! `outbox console` with fan-out (several subscribers per topic), over HTTP against real Postgres: a subscriber
//! filter reaches the dead-letter list, every link and form of the page, the confirmation's count and the bulk
//! action (purging or redriving one subscriber's dead letters leaves another's alone); the keys page shows each
//! subscriber's lane once with its own head; the subscribers page shows each subscriber's lag, in flight, blocked
//! lanes, dead letters and replay; an event's page lists every copy's state.

mod console_kit;

use console_kit::{Tab, args, by_id, hidden_fields, unescape};
use outbox_cli::console::Console;
use outbox_testkit::db::{dead_letter, event};
use reqwest::StatusCode;
use sqlx::PgPool;

/// Every `href` in `fragment`, unescaped.
fn hrefs(fragment: &str) -> Vec<String> {
    fragment
        .split("href=\"")
        .skip(1)
        .map(|s| unescape(&s[..s.find('"').unwrap()]))
        .collect()
}

/// The part of `page` from `from` up to the next `to`.
fn section<'a>(page: &'a str, from: &str, to: &str) -> &'a str {
    let start = page
        .find(from)
        .unwrap_or_else(|| panic!("no {from:?} in the page:\n{page}"));
    let rest = &page[start..];
    &rest[..rest.find(to).unwrap_or(rest.len())]
}

/// The table rows of `page` that start with `marker` (`<tr data-…`), each up to its `</tr>`.
fn rows<'a>(page: &'a str, marker: &str) -> Vec<&'a str> {
    page.split(marker)
        .skip(1)
        .map(|r| &r[..r.find("</tr>").unwrap()])
        .collect()
}

/// Three events of `topic`, each with a copy for `billing` (the first copy) and one for `shipping`. Shipping's
/// three copies are dead with a relay dead letter each; billing's first two, the third is delivered. Returns the
/// dead letters (billing's, shipping's).
async fn dead_copies(pool: &PgPool, topic: &str) -> (Vec<i64>, Vec<i64>) {
    let (mut billing, mut shipping) = (Vec::new(), Vec::new());
    for i in 0..3 {
        let dead = if i < 2 {
            "dead_lettered_at = now()"
        } else {
            "delivered_at = now()"
        };
        let b = event(
            pool,
            topic,
            &format!("k{i}"),
            None,
            &format!("subscriber = 'billing', dispatched_at = now(), {dead}"),
        )
        .await;
        if i < 2 {
            billing.push(dead_letter(pool, "relay", Some(b), "subscriber = 'billing'").await);
        }
        let s = event(
            pool,
            topic,
            &format!("k{i}"),
            None,
            &format!("subscriber = 'shipping', event_id = {b}, dead_lettered_at = now()"),
        )
        .await;
        shipping.push(dead_letter(pool, "relay", Some(s), "subscriber = 'shipping'").await);
    }
    (billing, shipping)
}

/// Dead letters by id: (id, redriven).
async fn dead_letters(pool: &PgPool) -> Vec<(i64, bool)> {
    sqlx::query_as("SELECT id, redriven_at IS NOT NULL FROM dead_letters ORDER BY id")
        .fetch_all(pool)
        .await
        .unwrap()
}

/// The producer's sequence of `key` of topic `orders`, handed out up to `last_seq`.
async fn sequence(pool: &PgPool, key: &str, last_seq: i64) {
    sqlx::query(
        "INSERT INTO outbox_sequences (topic, partition_key, last_seq) VALUES ('orders', $1, $2)",
    )
    .bind(key)
    .bind(last_seq)
    .execute(pool)
    .await
    .unwrap();
}

/// `subscriber`'s lane of `key` of topic `orders`: done up to `done_seq`, blocked by `blocked_by` when given.
async fn lane(pool: &PgPool, key: &str, subscriber: &str, done_seq: i64, blocked_by: Option<i64>) {
    sqlx::query(
        "INSERT INTO outbox_keys (topic, partition_key, subscriber, done_seq, blocked_at, blocked_id, blocked_reason) \
         VALUES ('orders', $1, $2, $3, CASE WHEN $4::bigint IS NOT NULL THEN now() END, $4, \
                 CASE WHEN $4::bigint IS NOT NULL THEN 'consumer refused it' END)",
    )
    .bind(key)
    .bind(subscriber)
    .bind(done_seq)
    .bind(blocked_by)
    .execute(pool)
    .await
    .unwrap();
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn a_subscriber_filter_reaches_the_list_the_confirmation_and_the_action(pool: PgPool) {
    let (billing, shipping) = dead_copies(&pool, "orders").await;
    let console = Console::start(&args(&pool)).await.unwrap();
    let mut tab = Tab::new(&console);

    // The subscriber alone is a selection, and the page says so.
    let page = tab.get("/dead-letters?subscriber=shipping").await;
    assert_eq!(page.status, StatusCode::OK, "{}", page.body);
    assert_eq!(by_id(&page.body, "total"), "3");
    assert!(!page.body.contains("no filter"), "{}", page.body);
    assert!(
        page.body.contains("subscriber <code>shipping</code>"),
        "{}",
        page.body
    );

    // Filtered on topic and subscriber: the list shows shipping's only, with the subscriber as a column; the
    // filter form, the groups' links and the bulk links all carry the subscriber.
    let page = tab
        .get("/dead-letters?topic=orders&subscriber=shipping")
        .await;
    assert_eq!(by_id(&page.body, "total"), "3");
    let listed = section(&page.body, "<table id=\"dead-letters\"", "</table>");
    assert_eq!(listed.matches("<td>shipping</td>").count(), 3, "{listed}");
    assert!(!listed.contains("<td>billing</td>"), "{listed}");
    let form = section(&page.body, "<form class=\"filters\"", "</form>");
    assert!(
        form.contains("name=\"subscriber\" size=\"14\" value=\"shipping\""),
        "{form}"
    );
    let groups = hrefs(section(&page.body, "<table id=\"groups\"", "</table>"));
    let bulk = hrefs(section(&page.body, "<p id=\"bulk\"", "</p>"));
    assert_eq!(bulk.len(), 2, "{bulk:?}");
    for link in groups.iter().chain(&bulk) {
        if link.starts_with("/dead-letters?") || link.starts_with("/dead-letters/confirm?") {
            assert!(link.contains("subscriber=shipping"), "{link} widens");
        }
    }

    // The redrive link: its confirmation counts shipping's three, and the action redrives exactly those.
    let confirm = tab.get(&bulk[0]).await;
    assert_eq!(confirm.status, StatusCode::OK, "{}", confirm.body);
    assert_eq!(by_id(&confirm.body, "count"), "3", "{}", confirm.body);
    assert!(confirm.body.contains("subscriber <code>shipping</code>"));
    let report = tab
        .post(
            "/dead-letters/bulk",
            &hidden_fields(&confirm.body, "confirm"),
        )
        .await;
    assert_eq!(report.status, StatusCode::OK, "{}", report.body);
    assert_eq!(by_id(&report.body, "done"), "3");
    let now = dead_letters(&pool).await;
    for (id, redriven) in &now {
        assert_eq!(
            *redriven,
            shipping.contains(id),
            "dead letter #{id}: only shipping's are redriven"
        );
    }

    // The purge link of the list with handled ones, the same way: shipping's (redriven) dead letters go,
    // billing's stay.
    let page = tab
        .get("/dead-letters?topic=orders&subscriber=shipping&all=1")
        .await;
    let bulk = hrefs(section(&page.body, "<p id=\"bulk\"", "</p>"));
    assert!(bulk[1].contains("subscriber=shipping"), "{bulk:?}");
    let confirm = tab.get(&bulk[1]).await;
    assert_eq!(by_id(&confirm.body, "count"), "3", "{}", confirm.body);
    let report = tab
        .post(
            "/dead-letters/bulk",
            &hidden_fields(&confirm.body, "confirm"),
        )
        .await;
    assert_eq!(by_id(&report.body, "done"), "3", "{}", report.body);
    let left: Vec<i64> = dead_letters(&pool).await.into_iter().map(|d| d.0).collect();
    assert_eq!(left, billing, "billing's dead letters are untouched");
    console.stop().await.unwrap();
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn the_keys_page_shows_each_subscribers_lane_once_with_its_own_head(pool: PgPool) {
    use outbox::ops::keys::{KeyQuery, keys};

    // Key k1 of an ordered topic, two events, a copy of each for the default subscriber and for shipping. The
    // default lane is done up to 1 (its head is its copy of seq 2); shipping's lane is blocked by its dead copy
    // of seq 1. Key k2 has no work for anyone.
    let d1 = event(&pool, "orders", "k1", Some(1), "delivered_at = now()").await;
    let s1 = event(
        &pool,
        "orders",
        "k1",
        Some(1),
        &format!("subscriber = 'shipping', event_id = {d1}, dead_lettered_at = now()"),
    )
    .await;
    let d2 = event(&pool, "orders", "k1", Some(2), "").await;
    let s2 = event(
        &pool,
        "orders",
        "k1",
        Some(2),
        &format!("subscriber = 'shipping', event_id = {d2}"),
    )
    .await;
    sequence(&pool, "k1", 2).await;
    lane(&pool, "k1", "", 1, None).await;
    lane(&pool, "k1", "shipping", 0, Some(s1)).await;
    sequence(&pool, "k2", 4).await;
    let console = Console::start(&args(&pool)).await.unwrap();
    let mut tab = Tab::new(&console);

    let page = tab.get("/keys?topic=orders").await;
    assert_eq!(page.status, StatusCode::OK, "{}", page.body);
    let lines = rows(&page.body, "<tr data-key-state=");
    assert_eq!(
        lines.len(),
        3,
        "a line per lane, and k2 once:\n{}",
        page.body
    );
    let line = |sub: &str| {
        lines
            .iter()
            .find(|l| l.contains(&format!("<td class=\"subscriber\">{sub}</td>")))
            .unwrap_or_else(|| panic!("no line of {sub}:\n{}", page.body))
            .to_owned()
    };
    let default = line("default");
    assert!(default.starts_with("\"pending\""), "{default}");
    assert!(
        default.contains(&format!("href=\"/events/{d2}\"")),
        "{default}"
    );
    let shipping = line("shipping");
    assert!(shipping.starts_with("\"blocked\""), "{shipping}");
    assert!(
        shipping.contains(&format!("href=\"/events/{s1}\""))
            && !shipping.contains(&format!("/events/{d1}\"")),
        "shipping's head is its own copy: {shipping}"
    );
    assert!(!page.body.contains(&format!("/events/{s2}\"")));

    // One subscriber: each key once, with that subscriber's state.
    let page = tab.get("/keys?topic=orders&subscriber=shipping").await;
    let lines = rows(&page.body, "<tr data-key-state=");
    assert_eq!(lines.len(), 2, "{}", page.body);
    assert!(lines[0].starts_with("\"blocked\"") && lines[0].contains(">k1<"));
    assert!(lines[1].starts_with("\"idle\"") && lines[1].contains(">k2<"));
    let page = tab.get("/keys?subscriber=default&blocked=1").await;
    assert!(page.body.contains("No key matches"), "{}", page.body);
    assert_eq!(
        tab.get("/keys?subscriber=Not%20A%20Name").await.status,
        StatusCode::BAD_REQUEST
    );

    // Paging one line at a time: every lane once, in (topic, key, subscriber) order.
    let mut conn = pool.acquire().await.unwrap();
    let mut seen = Vec::new();
    let mut after = None;
    loop {
        let q = KeyQuery {
            topic: Some("orders".into()),
            after,
            limit: 1,
            ..KeyQuery::default()
        };
        let p = keys(&mut conn, &q).await.unwrap();
        seen.extend(
            p.items
                .iter()
                .map(|k| (k.partition_key.to_string(), k.subscriber.clone())),
        );
        match p.next_after {
            Some(a) => after = Some(a),
            None => break,
        }
    }
    assert_eq!(
        seen,
        [
            ("k1".to_owned(), Some(String::new())),
            ("k1".to_owned(), Some("shipping".to_owned())),
            ("k2".to_owned(), None),
        ]
    );
    console.stop().await.unwrap();
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn the_subscribers_page_shows_each_subscribers_lag_in_flight_blocked_keys_dead_letters_and_replay(
    pool: PgPool,
) {
    use outbox::db::{Db, Statements};
    use outbox::subscribers::{self, Start};

    let console = Console::start(&args(&pool)).await.unwrap();
    let mut tab = Tab::new(&console);
    let page = tab.get("/subscribers").await;
    assert_eq!(page.status, StatusCode::OK, "{}", page.body);
    assert!(page.body.contains("id=\"no-fanout\""), "{}", page.body);

    let db = Db::new(pool.clone(), Statements::Prepared);
    let wait = std::time::Duration::from_secs(5);
    for name in ["shipping", "audit", "billing"] {
        let url = format!("https://{name}.example.com");
        subscribers::add(&db, "orders", name, Some(&url), Start::Now, wait)
            .await
            .unwrap();
    }
    // audit replays events 10 to 20 and has copied 5, up to 14; billing was removed.
    sqlx::query(
        "UPDATE outbox_subscribers SET replay_from = 10, replay_to = 20, replayed_to = 14, replayed = 5 \
         WHERE name = 'audit'",
    )
    .execute(&pool)
    .await
    .unwrap();
    sqlx::query("UPDATE outbox_subscribers SET removed_at = now() WHERE name = 'billing'")
        .execute(&pool)
        .await
        .unwrap();
    // shipping: two pending copies (the older a minute old), one in flight, a dead head that blocks its lane with
    // its dead letter. The default subscriber: one pending copy.
    let sub = "subscriber = 'shipping'";
    event(
        &pool,
        "orders",
        "a",
        None,
        &format!("{sub}, created_at = now() - interval '1 minute'"),
    )
    .await;
    event(&pool, "orders", "b", None, sub).await;
    event(
        &pool,
        "orders",
        "c",
        None,
        &format!("{sub}, dispatched_at = now()"),
    )
    .await;
    let head = event(
        &pool,
        "orders",
        "k",
        Some(1),
        &format!("{sub}, dead_lettered_at = now()"),
    )
    .await;
    dead_letter(&pool, "qstash", Some(head), sub).await;
    sequence(&pool, "k", 1).await;
    lane(&pool, "k", "shipping", 0, Some(head)).await;
    event(&pool, "orders", "d", None, "").await;

    let page = tab.get("/subscribers").await;
    assert_eq!(page.status, StatusCode::OK, "{}", page.body);
    let line = |name: &str| -> String {
        let found = rows(&page.body, "<tr data-subscriber=");
        found
            .into_iter()
            .find(|r| r.starts_with(&format!("\"{name}\"")))
            .unwrap_or_else(|| panic!("no line of {name}:\n{}", page.body))
            .to_owned()
    };
    let shipping = line("shipping");
    for figure in [
        "data-figure=\"pending\">2<",
        "data-figure=\"in_flight\">1<",
        "href=\"/keys?topic=orders&amp;subscriber=shipping&amp;blocked=1\">1<",
        "href=\"/dead-letters?topic=orders&amp;subscriber=shipping\">1<",
        "https://shipping.example.com",
        "data-state=\"live\"",
    ] {
        assert!(shipping.contains(figure), "{figure} in {shipping}");
    }
    assert!(shipping.contains("1m "), "its lag, a minute: {shipping}");
    let default = line("default");
    assert!(default.contains("data-figure=\"pending\">1<"), "{default}");
    assert!(default.contains("CONSUMER_URL"), "{default}");
    let audit = line("audit");
    assert!(audit.contains("data-state=\"replaying\""), "{audit}");
    assert!(
        audit.contains("events 10–20: 5 copied, up to 14"),
        "{audit}"
    );
    let billing = line("billing");
    assert!(billing.contains("data-state=\"removed\""), "{billing}");

    // Linked from every page's navigation, and summed up on the overview.
    assert!(
        page.body
            .contains("<a href=\"/subscribers\">Subscribers</a>")
    );
    let overview = tab.get("/").await;
    let table = section(
        &overview.body,
        "<table id=\"overview-subscribers\"",
        "</table>",
    );
    assert!(table.contains("<td>shipping</td>"), "{table}");
    // One topic's only.
    let other = tab.get("/subscribers?topic=billing").await;
    assert!(other.body.contains("id=\"no-fanout\""), "{}", other.body);
    console.stop().await.unwrap();
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn an_events_page_lists_each_copys_state(pool: PgPool) {
    // One event of an ordered topic, three copies: the default subscriber's delivered and applied, shipping's
    // dead (its dead letter unhandled, its lane blocked by it), billing's pending.
    let first = event(
        &pool,
        "orders",
        "k",
        Some(1),
        "dispatched_at = now(), delivered_at = now()",
    )
    .await;
    let shipping = event(
        &pool,
        "orders",
        "k",
        Some(1),
        &format!(
            "subscriber = 'shipping', event_id = {first}, attempts = 3, dead_lettered_at = now()"
        ),
    )
    .await;
    let billing = event(
        &pool,
        "orders",
        "k",
        Some(1),
        &format!("subscriber = 'billing', event_id = {first}"),
    )
    .await;
    let dl = dead_letter(&pool, "qstash", Some(shipping), "subscriber = 'shipping'").await;
    sequence(&pool, "k", 1).await;
    lane(&pool, "k", "shipping", 0, Some(shipping)).await;
    lane(&pool, "k", "billing", 0, None).await;
    sqlx::query("INSERT INTO processed_messages (consumer, message_id) VALUES ('consumer', $1)")
        .bind(first.to_string())
        .execute(&pool)
        .await
        .unwrap();
    let console = Console::start(&args(&pool)).await.unwrap();
    let mut tab = Tab::new(&console);

    for page_of in [first, shipping, billing] {
        let page = tab.get(&format!("/events/{page_of}")).await;
        assert_eq!(page.status, StatusCode::OK, "{}", page.body);
        let copies = rows(
            section(&page.body, "<table id=\"copies\"", "</table>"),
            "<tr data-copy-state=",
        );
        assert_eq!(copies.len(), 3, "{}", page.body);
        let copy = |id: i64| -> &str {
            copies
                .iter()
                .find(|c| c.contains(&format!("<td><a href=\"/events/{id}\">")))
                .unwrap_or_else(|| panic!("no copy #{id}: {copies:?}"))
        };
        let d = copy(first);
        assert!(
            d.starts_with("\"delivered\"") && d.contains("<td>default</td>"),
            "{d}"
        );
        assert!(!d.contains("<td>-</td><td class=\"wrap\">"), "applied: {d}");
        let s = copy(shipping);
        assert!(
            s.starts_with("\"dead\"") && s.contains("<td>shipping</td>"),
            "{s}"
        );
        assert!(s.contains("blocked by this copy"), "{s}");
        assert!(s.contains(&format!("href=\"/dead-letters/{dl}\"")), "{s}");
        let b = copy(billing);
        assert!(
            b.starts_with("\"pending\"") && b.contains("<td>billing</td>"),
            "{b}"
        );
        assert!(b.contains("done up to 0"), "{b}");
    }
    let page = tab.get(&format!("/events/{shipping}")).await;
    let who = section(&page.body, "<td id=\"event-subscriber\">", "</td>");
    assert!(
        who.contains("shipping") && who.contains(&format!("href=\"/events/{first}\"")),
        "the row says whose copy it is, and of which event: {who}"
    );
    console.stop().await.unwrap();
}
