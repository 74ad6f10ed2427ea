//! `outbox console` over HTTP against real Postgres, the real server on a free port: every page answers with the
//! data; hostile text stored in every field comes back escaped; CSRF, read-only, tokens, Host and Origin are
//! enforced; bulk actions need a filter and touch exactly what their confirmation page counted.

mod console_kit;

use console_kit::{
    Tab, args, assert_no_raw_hostile_text, by_id, csrf, field, form, hidden_fields, seed_hostile,
    selected, selection, token_file,
};
use outbox_cli::console::Console;
use outbox_testkit::db::{dead_letter, event, key_state};
use reqwest::StatusCode;
use reqwest::header::{HOST, HeaderValue, ORIGIN};
use sqlx::PgPool;

/// An ordered key blocked by its dead head (with a dead letter), one more event waiting behind it, and
/// `dispatched` delivered events of an unordered topic. Returns (head event, its dead letter).
async fn blocked_key(pool: &PgPool, topic: &str, key: &str) -> (i64, i64) {
    let head = event(
        pool,
        topic,
        key,
        Some(1),
        "dead_lettered_at = now(), attempts = 3, last_error = 'consumer refused it'",
    )
    .await;
    event(pool, topic, key, Some(2), "").await;
    key_state(
        pool,
        topic,
        key,
        2,
        0,
        &format!("blocked_at = now(), blocked_id = {head}, blocked_reason = 'consumer refused it'"),
    )
    .await;
    let dl = dead_letter(
        pool,
        "qstash",
        Some(head),
        "error = 'consumer answered 489 for order 17'",
    )
    .await;
    (head, dl)
}

async fn dispatched(pool: &PgPool, n: i64) {
    sqlx::query(
        "INSERT INTO outbox (topic, partition_key, payload, dispatched_at, delivered_at) \
         SELECT 'audit', 'a' || g, '{}', now() - make_interval(secs => g), now() FROM generate_series(1, $1) g",
    )
    .bind(n)
    .execute(pool)
    .await
    .unwrap();
}

async fn unhandled(pool: &PgPool, id: i64) -> bool {
    sqlx::query_scalar(
        "SELECT redriven_at IS NULL AND resolved_at IS NULL FROM dead_letters WHERE id = $1",
    )
    .bind(id)
    .fetch_one(pool)
    .await
    .unwrap()
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn every_page_answers_with_the_data(pool: PgPool) {
    let (head, dl) = blocked_key(&pool, "orders", "customer-42").await;
    dispatched(&pool, 30).await;
    event(&pool, "billing", "b-1", None, "").await;
    let console = Console::start(&args(&pool)).await.unwrap();
    let mut tab = Tab::new(&console);

    let overview = tab.get("/").await;
    assert_eq!(overview.status, StatusCode::OK);
    assert!(tab.cookie.is_some(), "the first visit starts a session");
    assert_eq!(by_id(&overview.body, "outage"), "");
    for (figure, want) in [
        ("backlog.pending", "2"),
        ("throughput.last_hour", "30"),
        ("blocked_keys.count", "1"),
        ("unresolved_dead_letters", "1"),
    ] {
        assert!(
            overview
                .body
                .contains(&format!("data-figure=\"{figure}\">{want}<")),
            "{figure} = {want} in the overview:\n{}",
            overview.body
        );
    }
    assert!(
        overview
            .body
            .contains("<meta http-equiv=\"refresh\" content=\"5\">")
    );
    assert!(
        overview.body.contains("customer-42") && overview.body.contains("<svg class=\"chart\"")
    );
    assert!(
        !tab.get("/?pause=1")
            .await
            .body
            .contains("http-equiv=\"refresh\"")
    );

    let topics = tab.get("/topics").await;
    assert_eq!(topics.status, StatusCode::OK);
    for t in ["orders", "billing"] {
        assert!(
            topics
                .body
                .contains(&format!("<a href=\"/topics?topic={t}\">{t}</a></td>")),
            "{t}:\n{}",
            topics.body
        );
    }

    let keys = tab.get("/keys?key=customer-4").await;
    assert_eq!(keys.status, StatusCode::OK);
    assert!(
        keys.body.contains("data-key-state=\"blocked\""),
        "{}",
        keys.body
    );
    assert!(keys.body.contains(&format!("href=\"/events/{head}\"")));
    let none = tab.get("/keys?key=nobody").await;
    assert!(none.body.contains("No key matches"));

    let ev = tab.get(&format!("/events/{head}")).await;
    assert_eq!(ev.status, StatusCode::OK);
    assert_eq!(by_id(&ev.body, "event-state"), "dead");
    assert!(ev.body.contains("blocks its key"));
    assert!(
        ev.body
            .contains(&format!("dead letter <a href=\"/dead-letters/{dl}\">"))
    );
    assert_eq!(
        tab.get("/events/999999").await.status,
        StatusCode::NOT_FOUND
    );
    let search = tab.get(&format!("/events?id=%23{head}")).await;
    assert_eq!(
        search.location.as_deref(),
        Some(format!("/events/{head}").as_str())
    );

    let dls = tab.get("/dead-letters").await;
    assert_eq!(dls.status, StatusCode::OK);
    assert_eq!(by_id(&dls.body, "total"), "1");
    assert!(
        dls.body.contains("consumer answered N for order N"),
        "grouped by the normalised error:\n{}",
        dls.body
    );
    let one = tab.get(&format!("/dead-letters/{dl}")).await;
    assert_eq!(one.status, StatusCode::OK);
    assert_eq!(by_id(&one.body, "dl-state"), "unhandled");
    assert!(one.body.contains("<form id=\"redrive\""));
    assert_eq!(tab.get("/actions").await.status, StatusCode::OK);
    assert_eq!(tab.get("/console.css").await.status, StatusCode::OK);
    console.stop().await.unwrap();
}

/// Hostile text in the topic, key, payload, headers, error, blocked reason, last error and response body: every
/// page that shows them escapes all of it, and still shows it (escaped, readable).
#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn hostile_text_is_escaped_on_every_page(pool: PgPool) {
    let (head, dl, topic, key) = seed_hostile(&pool).await;
    let console = Console::start(&args(&pool)).await.unwrap();
    let mut tab = Tab::new(&console);
    let enc = |s: &str| -> String { url::form_urlencoded::byte_serialize(s.as_bytes()).collect() };
    let pages = [
        "/".to_owned(),
        "/topics".to_owned(),
        "/keys".to_owned(),
        format!("/keys?topic={}&key={}", enc(&topic), enc(&key)),
        format!("/events/{head}"),
        "/dead-letters".to_owned(),
        format!(
            "/dead-letters?topic={}&error={}",
            enc(&topic),
            enc("<script>")
        ),
        format!("/dead-letters/{dl}"),
        format!("/dead-letters/confirm?action=purge&topic={}", enc(&topic)),
    ];
    for path in &pages {
        let page = tab.get(path).await;
        assert_eq!(page.status, StatusCode::OK, "{path}");
        assert_no_raw_hostile_text(&page.body, path);
    }
    // Shown, escaped: the markup as text, the bidi override and the controls as visible escapes.
    let ev = tab.get(&format!("/events/{head}")).await.body;
    for field in ["topic", "key", "payload", "header", "last-error", "error"] {
        assert!(
            ev.contains(&format!(
                "{field}-&lt;script&gt;document.title=&#39;pwned&#39;&lt;/script&gt;"
            )),
            "{field} in {ev}"
        );
    }
    assert!(
        ev.contains("\\u{202e}gnp.exe\\u{1b}[31m\\u{7}\\u{8}end"),
        "{ev}"
    );
    let dlp = tab.get(&format!("/dead-letters/{dl}")).await.body;
    for field in ["response", "raw", "parse", "error"] {
        assert!(
            dlp.contains(&format!("{field}-&lt;script&gt;")),
            "{field} in {dlp}"
        );
    }
    // An action on it (a refused purge of a blocking head still records its selection) shows on the log.
    let confirm = tab
        .get(&format!(
            "/dead-letters/confirm?action=redrive&topic={}",
            enc(&topic)
        ))
        .await;
    let mut fields = hidden_fields(&confirm.body, "confirm");
    assert_eq!(
        selected(&field(&confirm.body, "confirm", "selection"))["topic"],
        topic.as_str(),
        "the selection round-trips exactly"
    );
    fields.push(("out_of_order".into(), "1".into()));
    let report = tab.post("/dead-letters/bulk", &fields).await;
    assert_eq!(report.status, StatusCode::OK, "{}", report.body);
    assert_no_raw_hostile_text(&report.body, "bulk report");
    let log = tab.get("/actions").await;
    assert_no_raw_hostile_text(&log.body, "/actions");
    assert!(log.body.contains("topic-&lt;script&gt;"), "{}", log.body);
    console.stop().await.unwrap();
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn posts_without_the_session_s_csrf_token_are_refused(pool: PgPool) {
    let (_, dl) = blocked_key(&pool, "orders", "k").await;
    let console = Console::start(&args(&pool)).await.unwrap();
    let path = format!("/dead-letters/{dl}/redrive");

    // No session at all: refused before anything runs.
    let mut stranger = Tab::new(&console);
    let r = stranger.post(&path, &form(&[("csrf", "x")])).await;
    assert_eq!(r.status, StatusCode::FORBIDDEN);

    let mut tab = Tab::new(&console);
    let page = tab.get(&format!("/dead-letters/{dl}")).await;
    let token = csrf(&page.body);
    let mut other = Tab::new(&console);
    let other_token = csrf(&other.get(&format!("/dead-letters/{dl}")).await.body);
    assert_ne!(token, other_token);
    for (what, fields) in [
        ("missing", form(&[])),
        ("empty", form(&[("csrf", "")])),
        ("wrong", form(&[("csrf", "00")])),
        ("another session's", form(&[("csrf", &other_token)])),
    ] {
        let r = tab.post(&path, &fields).await;
        assert_eq!(r.status, StatusCode::FORBIDDEN, "{what}: {}", r.body);
        assert!(r.body.contains("CSRF"), "{what}");
        assert!(
            unhandled(&pool, dl).await,
            "{what} CSRF token: nothing happened"
        );
    }
    let ok = tab.post(&path, &form(&[("csrf", &token)])).await;
    assert_eq!(ok.status, StatusCode::OK, "{}", ok.body);
    assert!(ok.body.contains("its key is unblocked"), "{}", ok.body);
    assert!(!unhandled(&pool, dl).await);
    let (actor, action): (String, String) = sqlx::query_as(
        "SELECT actor, action FROM outbox_console_actions WHERE dead_letter_id = $1",
    )
    .bind(dl)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!((actor.as_str(), action.as_str()), ("local", "redrive"));
    console.stop().await.unwrap();
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn read_only_hides_and_refuses_every_action(pool: PgPool) {
    let (_, dl) = blocked_key(&pool, "orders", "k").await;
    let mut a = args(&pool);
    a.read_only = true;
    let console = Console::start(&a).await.unwrap();
    let mut tab = Tab::new(&console);
    let page = tab.get(&format!("/dead-letters/{dl}")).await;
    assert_eq!(page.status, StatusCode::OK);
    assert!(page.body.contains("id=\"read-only\""));
    assert!(
        !page.body.contains("<form id=\"redrive\""),
        "no redrive form"
    );
    assert!(
        !tab.get("/dead-letters").await.body.contains("id=\"bulk\""),
        "no bulk links"
    );
    let token = csrf(&page.body);
    let r = tab
        .post(
            &format!("/dead-letters/{dl}/redrive"),
            &form(&[("csrf", &token)]),
        )
        .await;
    assert_eq!(r.status, StatusCode::FORBIDDEN);
    let r = tab
        .get("/dead-letters/confirm?action=purge&topic=orders")
        .await;
    assert_eq!(r.status, StatusCode::FORBIDDEN);
    let r = tab
        .post(
            "/dead-letters/bulk",
            &form(&[
                ("csrf", &token),
                ("action", "purge"),
                (
                    "selection",
                    &selection(serde_json::json!({"topic": "orders", "max_id": 999})),
                ),
            ]),
        )
        .await;
    assert_eq!(r.status, StatusCode::FORBIDDEN);
    assert!(unhandled(&pool, dl).await);
    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM dead_letters")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(n, 1);
    console.stop().await.unwrap();
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn a_network_bind_needs_a_token_and_acts_under_its_name(pool: PgPool) {
    let mut a = args(&pool);
    a.bind = "0.0.0.0".parse().unwrap();
    let err = Console::start(&a)
        .await
        .err()
        .expect("refused without a token")
        .to_string();
    assert!(err.contains("--token-file"), "{err}");
    let (_dir, short) = token_file("ops:short\n");
    a.token_file = Some(short);
    assert!(
        Console::start(&a).await.is_err(),
        "a short secret is refused"
    );

    let (_dir, file) =
        token_file("# on-call\nalice:correct-horse-battery\nbob:staple-staple-staple\n");
    a.token_file = Some(file);
    let (_, dl) = blocked_key(&pool, "orders", "k").await;
    let console = Console::start(&a).await.unwrap();
    let mut tab = Tab::new(&console);
    let r = tab.get("/").await;
    assert_eq!(
        (r.status, r.location.as_deref()),
        (StatusCode::SEE_OTHER, Some("/login"))
    );
    let r = tab
        .post(
            &format!("/dead-letters/{dl}/redrive"),
            &form(&[("csrf", "x")]),
        )
        .await;
    assert_eq!(r.status, StatusCode::UNAUTHORIZED);
    for wrong in [
        "alice:staple-staple-staple",
        "alice:correct-horse-batter",
        "carol:correct-horse-battery",
        "",
    ] {
        let r = tab.post("/login", &form(&[("token", wrong)])).await;
        assert_eq!(r.status, StatusCode::UNAUTHORIZED, "{wrong:?}");
        assert!(tab.cookie.is_none());
    }
    let r = tab
        .post("/login", &form(&[("token", "alice:correct-horse-battery")]))
        .await;
    assert_eq!(r.status, StatusCode::SEE_OTHER);
    let page = tab.get(&format!("/dead-letters/{dl}")).await;
    assert_eq!(page.status, StatusCode::OK);
    assert!(page.body.contains("<span class=\"who\">alice"));
    let r = tab
        .post(
            &format!("/dead-letters/{dl}/redrive"),
            &form(&[("csrf", &csrf(&page.body))]),
        )
        .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    let actor: String = sqlx::query_scalar("SELECT actor FROM outbox_console_actions")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(actor, "alice");
    // A forged cookie (another name, same MAC) is no session.
    let hex = |s: &str| s.bytes().map(|b| format!("{b:02x}")).collect::<String>();
    let forged = tab
        .cookie
        .clone()
        .unwrap()
        .replace(&format!(".{}.", hex("alice")), &format!(".{}.", hex("bob")));
    assert_ne!(Some(&forged), tab.cookie.as_ref());
    tab.cookie = Some(forged);
    assert_eq!(tab.get("/").await.status, StatusCode::SEE_OTHER);
    console.stop().await.unwrap();
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn other_hosts_and_other_sites_are_refused(pool: PgPool) {
    let (_, dl) = blocked_key(&pool, "orders", "k").await;
    let console = Console::start(&args(&pool)).await.unwrap();
    let mut tab = Tab::new(&console);
    let page = tab.get(&format!("/dead-letters/{dl}")).await;
    let token = csrf(&page.body);
    let port = console.addr().port();

    tab.headers
        .insert(HOST, HeaderValue::from_static("evil.example"));
    assert_eq!(tab.get("/").await.status, StatusCode::MISDIRECTED_REQUEST);
    tab.headers.insert(
        HOST,
        HeaderValue::from_str(&format!("localhost:{port}")).unwrap(),
    );
    assert_eq!(tab.get("/").await.status, StatusCode::OK);

    tab.headers
        .insert(ORIGIN, HeaderValue::from_static("http://evil.example"));
    let r = tab
        .post(
            &format!("/dead-letters/{dl}/redrive"),
            &form(&[("csrf", &token)]),
        )
        .await;
    assert_eq!(r.status, StatusCode::FORBIDDEN);
    assert!(
        unhandled(&pool, dl).await,
        "a cross-site post changed nothing"
    );
    tab.headers.insert(ORIGIN, HeaderValue::from_static("null"));
    assert_eq!(tab.get("/").await.status, StatusCode::FORBIDDEN);
    tab.headers.insert(
        ORIGIN,
        HeaderValue::from_str(&format!("http://127.0.0.1:{port}")).unwrap(),
    );
    let r = tab
        .post(
            &format!("/dead-letters/{dl}/redrive"),
            &form(&[("csrf", &token)]),
        )
        .await;
    assert_eq!(r.status, StatusCode::OK, "same origin: {}", r.body);
    let csp = reqwest::get(format!("{}/", console.url())).await.unwrap();
    let policy = csp.headers()["content-security-policy"]
        .to_str()
        .unwrap()
        .to_owned();
    assert!(
        policy.contains("default-src 'none'") && !policy.contains("script-src"),
        "{policy}"
    );
    console.stop().await.unwrap();
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn a_bulk_redrive_redrives_exactly_what_its_confirmation_counted(pool: PgPool) {
    let mut counted = Vec::new();
    for i in 0..3 {
        let e = event(
            &pool,
            "orders",
            &format!("o-{i}"),
            None,
            "dead_lettered_at = now()",
        )
        .await;
        counted.push(dead_letter(&pool, "relay", Some(e), "").await);
    }
    let other_topic = {
        let e = event(&pool, "billing", "b", None, "dead_lettered_at = now()").await;
        dead_letter(&pool, "relay", Some(e), "").await
    };
    let console = Console::start(&args(&pool)).await.unwrap();
    let mut tab = Tab::new(&console);

    // No filter: refused, on the confirmation page and on a hand-made post.
    let r = tab.get("/dead-letters/confirm?action=redrive").await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    assert!(r.body.contains("id=\"refused\""));
    let token = csrf(&r.body);
    let everything = selection(serde_json::json!({"max_id": 999_999}));
    let unconfirmed = selection(serde_json::json!({"topic": "orders"}));
    for action in ["redrive", "purge"] {
        for (what, sel) in [
            ("no filter", everything.as_str()),
            ("no confirmation", unconfirmed.as_str()),
            ("none", ""),
        ] {
            let r = tab
                .post(
                    "/dead-letters/bulk",
                    &form(&[("csrf", &token), ("action", action), ("selection", sel)]),
                )
                .await;
            assert_eq!(
                r.status,
                StatusCode::BAD_REQUEST,
                "{action}, {what}: {}",
                r.body
            );
        }
    }
    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM dead_letters WHERE redriven_at IS NULL")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(n, 4, "nothing was touched");

    let confirm = tab
        .get("/dead-letters/confirm?action=redrive&topic=orders")
        .await;
    assert_eq!(confirm.status, StatusCode::OK);
    assert_eq!(by_id(&confirm.body, "count"), "3");
    let fields = hidden_fields(&confirm.body, "confirm");
    // Recorded after the confirmation: not part of what was counted.
    let late = {
        let e = event(&pool, "orders", "o-late", None, "dead_lettered_at = now()").await;
        dead_letter(&pool, "relay", Some(e), "").await
    };
    let report = tab.post("/dead-letters/bulk", &fields).await;
    assert_eq!(report.status, StatusCode::OK, "{}", report.body);
    assert_eq!(by_id(&report.body, "done"), "3");
    for id in &counted {
        assert!(!unhandled(&pool, *id).await, "{id} redriven");
    }
    assert!(unhandled(&pool, late).await, "the late one is untouched");
    assert!(
        unhandled(&pool, other_topic).await,
        "another topic is untouched"
    );
    let (action, selection, outcome): (String, serde_json::Value, serde_json::Value) = sqlx::query_as(
        "SELECT action, selection, outcome FROM outbox_console_actions ORDER BY id DESC LIMIT 1",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(action, "redrive_bulk");
    assert_eq!(selection["topic"], "orders");
    assert_eq!(outcome["redriven"], 3);

    // Purge the same way: the confirmation's count is what goes.
    let confirm = tab
        .get("/dead-letters/confirm?action=purge&topic=orders")
        .await;
    assert_eq!(
        by_id(&confirm.body, "count"),
        "4",
        "redriven ones and the late one"
    );
    let fields = hidden_fields(&confirm.body, "confirm");
    let report = tab.post("/dead-letters/bulk", &fields).await;
    assert_eq!(by_id(&report.body, "done"), "4");
    let left: Vec<i64> = sqlx::query_scalar("SELECT id FROM dead_letters ORDER BY id")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(left, [other_topic]);
    console.stop().await.unwrap();
}

/// The library queries behind the keys and dead-letter pages: keys page by (topic, key) and search by a literal
/// prefix (`%` and `_` in it match themselves); dead letters group by normalised error, and `max_id` and the
/// error filters select what they say.
#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn keys_page_by_key_and_dead_letters_group_by_error(pool: PgPool) {
    use outbox::dead_letters::{self, Filter};
    use outbox::ops::keys::{KeyCursor, KeyQuery, keys};

    for k in ["a%1", "a_2", "ab3", "b-1", "b-2"] {
        key_state(&pool, "t", k, 1, 1, "").await;
    }
    let mut conn = pool.acquire().await.unwrap();
    let page = |after: Option<KeyCursor>, prefix: Option<&str>| KeyQuery {
        key_prefix: prefix.map(str::to_owned),
        after,
        limit: 2,
        ..KeyQuery::default()
    };
    let mut seen = Vec::new();
    let mut after = None;
    loop {
        let p = keys(&mut conn, &page(after, None)).await.unwrap();
        seen.extend(p.items.iter().map(|k| k.partition_key.clone()));
        match p.next_after {
            Some(a) => after = Some(a),
            None => break,
        }
    }
    let mut sorted = seen.clone();
    sorted.sort();
    assert_eq!(seen.len(), 5, "every key once: {seen:?}");
    assert_eq!(seen, sorted, "in key order");
    let only = |prefix: &'static str| {
        let q = page(None, Some(prefix));
        let pool = pool.clone();
        async move {
            let mut c = pool.acquire().await.unwrap();
            keys(&mut c, &KeyQuery { limit: 10, ..q })
                .await
                .unwrap()
                .items
                .into_iter()
                .map(|k| k.partition_key)
                .collect::<Vec<_>>()
        }
    };
    assert_eq!(only("a%").await, ["a%1"]);
    assert_eq!(only("a_").await, ["a_2"]);
    assert_eq!(only("b-").await, ["b-1", "b-2"]);

    let mut ids = Vec::new();
    for (n, error) in [
        (3, "consumer answered 489 for order 17"),
        (2, "QStash refused the message: 400"),
    ] {
        for i in 0..n {
            let e = event(
                &pool,
                "orders",
                &format!("o{i}"),
                None,
                "dead_lettered_at = now()",
            )
            .await;
            let set = format!("error = '{}'", error.replace("17", &(17 + i).to_string()));
            ids.push(dead_letter(&pool, "relay", Some(e), &set).await);
        }
    }
    let (groups, total) = dead_letters::error_groups(
        &mut conn,
        &Filter::default(),
        dead_letters::Listing::Unhandled,
        10,
    )
    .await
    .unwrap();
    assert_eq!(total, 5);
    let summary: Vec<(&str, i64)> = groups
        .iter()
        .map(|g| (g.error_group.as_str(), g.count))
        .collect();
    assert_eq!(
        summary,
        [
            ("consumer answered N for order N", 3),
            ("QStash refused the message: N", 2)
        ]
    );
    assert_eq!(
        (groups[0].first_id, groups[0].last_id),
        (ids[0].into(), ids[2].into())
    );
    assert!(groups[0].first_at.is_some() && groups[0].last_at.is_some());
    let count = |f: Filter| {
        let pool = pool.clone();
        async move {
            let mut c = pool.acquire().await.unwrap();
            dead_letters::count_unhandled(&mut c, &f).await.unwrap()
        }
    };
    let filter = |error: Option<&str>, group: Option<&str>, max_id: Option<i64>| Filter {
        error: error.map(str::to_owned),
        error_group: group.map(str::to_owned),
        max_id: max_id.map(Into::into),
        ..Filter::default()
    };
    assert_eq!(
        count(filter(Some("ORDER 18"), None, None)).await,
        1,
        "case-insensitive text"
    );
    assert_eq!(
        count(filter(Some("%"), None, None)).await,
        0,
        "% is literal"
    );
    assert_eq!(
        count(filter(None, Some("QStash refused the message: N"), None)).await,
        2
    );
    assert_eq!(
        count(filter(None, None, Some(ids[1]))).await,
        2,
        "up to an id"
    );
    assert!(
        filter(None, None, Some(1)).is_empty(),
        "max_id alone is no selection"
    );
}

/// The purge confirmation of `topic` (its form's fields) and the count it shows.
async fn confirm_purge(tab: &mut Tab, topic: &str) -> (Vec<(String, String)>, String) {
    let confirm = tab
        .get(&format!("/dead-letters/confirm?action=purge&topic={topic}"))
        .await;
    assert_eq!(confirm.status, StatusCode::OK, "{}", confirm.body);
    (
        hidden_fields(&confirm.body, "confirm"),
        by_id(&confirm.body, "count"),
    )
}

/// The console's action log: (action, selection's topic, finished, outcome).
async fn logged(pool: &PgPool) -> Vec<(String, Option<String>, bool, Option<serde_json::Value>)> {
    sqlx::query_as(
        "SELECT action, selection->>'topic', finished_at IS NOT NULL, outcome FROM outbox_console_actions ORDER BY id",
    )
    .fetch_all(pool)
    .await
    .unwrap()
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn a_console_action_is_logged_before_it_runs_and_completed_after(pool: PgPool) {
    for i in 0..3 {
        let e = event(
            &pool,
            "orders",
            &format!("o{i}"),
            None,
            "dead_lettered_at = now()",
        )
        .await;
        dead_letter(&pool, "relay", Some(e), "").await;
    }
    let console = Console::start(&args(&pool)).await.unwrap();
    let mut tab = Tab::new(&console);
    let (fields, count) = confirm_purge(&mut tab, "orders").await;
    assert_eq!(count, "3");

    // Deleting waits on a lock the test holds: the action is under way, not done.
    let mut lock = pool.begin().await.unwrap();
    sqlx::query("LOCK TABLE dead_letters IN SHARE MODE")
        .execute(&mut *lock)
        .await
        .unwrap();
    let post = tokio::spawn(async move { tab.post("/dead-letters/bulk", &fields).await });
    let started = std::time::Instant::now();
    let mut seen = Vec::new();
    while started.elapsed() < std::time::Duration::from_secs(10) {
        seen = logged(&pool).await;
        if !seen.is_empty() {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert_eq!(
        seen,
        [("purge".to_owned(), Some("orders".to_owned()), false, None)],
        "the action is in the log while it runs, not yet finished"
    );
    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM dead_letters")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(n, 3, "and nothing is deleted yet");
    lock.rollback().await.unwrap();

    let report = post.await.unwrap();
    assert_eq!(report.status, StatusCode::OK, "{}", report.body);
    assert_eq!(by_id(&report.body, "done"), "3");
    let log = logged(&pool).await;
    assert_eq!(log.len(), 1, "one row, completed: {log:?}");
    assert!(log[0].2, "finished: {log:?}");
    assert_eq!(log[0].3.as_ref().unwrap()["deleted"], 3);
    console.stop().await.unwrap();
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn a_bulk_purge_that_stops_half_way_leaves_a_record_of_what_it_did(pool: PgPool) {
    // 1500 dead letters: the console purges 1000 a statement. The 1200th refuses to go (a trigger), so the
    // second statement fails after the first deleted 1000.
    sqlx::query(
        "INSERT INTO dead_letters (source, natural_id, topic, error) \
         SELECT 'relay', 'n-' || g, 'bulk', 'boom' FROM generate_series(1, 1500) g",
    )
    .execute(&pool)
    .await
    .unwrap();
    let refused: i64 =
        sqlx::query_scalar("SELECT id FROM dead_letters ORDER BY id OFFSET 1199 LIMIT 1")
            .fetch_one(&pool)
            .await
            .unwrap();
    sqlx::query(
        "CREATE FUNCTION refuse_delete() RETURNS trigger LANGUAGE plpgsql AS \
         $$ BEGIN RAISE EXCEPTION 'refused by the test'; END $$",
    )
    .execute(&pool)
    .await
    .unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "CREATE TRIGGER refuse BEFORE DELETE ON dead_letters FOR EACH ROW WHEN (OLD.id = {refused}) \
         EXECUTE FUNCTION refuse_delete()"
    )))
    .execute(&pool)
    .await
    .unwrap();
    let console = Console::start(&args(&pool)).await.unwrap();
    let mut tab = Tab::new(&console);
    let (fields, count) = confirm_purge(&mut tab, "bulk").await;
    assert_eq!(count, "1500");

    let report = tab.post("/dead-letters/bulk", &fields).await;
    assert_eq!(
        report.status,
        StatusCode::INTERNAL_SERVER_ERROR,
        "{}",
        report.body
    );
    assert!(
        report.body.contains("Stopped half-way")
            && report
                .body
                .contains("after deleting 1000 dead letter(s) (of 1500 counted)")
            && report.body.contains("refused by the test"),
        "{}",
        report.body
    );
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM dead_letters")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(left, 500);
    let log = logged(&pool).await;
    assert_eq!(log.len(), 1, "{log:?}");
    let (action, topic, finished, outcome) = &log[0];
    assert_eq!(
        (action.as_str(), topic.as_deref(), finished),
        ("purge", Some("bulk"), &true)
    );
    let outcome = outcome.as_ref().unwrap();
    assert_eq!(
        outcome["deleted"], 1000,
        "what it did before it stopped: {outcome}"
    );
    assert!(
        outcome["stopped"]
            .as_str()
            .is_some_and(|e| e.contains("refused by the test")),
        "{outcome}"
    );
    console.stop().await.unwrap();
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn a_page_whose_query_exceeds_the_statement_timeout_answers_with_a_clear_error(pool: PgPool) {
    let (_, dl) = blocked_key(&pool, "orders", "k").await;
    let mut a = args(&pool);
    a.statement_timeout_secs = 0;
    let refused = Console::start(&a)
        .await
        .err()
        .expect("0 is refused")
        .to_string();
    assert!(refused.contains("--statement-timeout-secs"), "{refused}");
    a.statement_timeout_secs = 1;
    let console = Console::start(&a).await.unwrap();
    let mut tab = Tab::new(&console);
    let page = tab.get(&format!("/dead-letters/{dl}")).await;
    let token = csrf(&page.body);

    let mut lock = pool.begin().await.unwrap();
    sqlx::query("LOCK TABLE dead_letters IN ACCESS EXCLUSIVE MODE")
        .execute(&mut *lock)
        .await
        .unwrap();
    let bound = std::time::Duration::from_secs(20);
    let started = std::time::Instant::now();
    let page = tokio::time::timeout(bound, tab.get("/dead-letters"))
        .await
        .expect("the page answers instead of waiting for the lock");
    assert_eq!(
        page.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{}",
        page.body
    );
    assert_eq!(
        by_id(&page.body, "timeout"),
        "The database did not answer in time"
    );
    assert!(
        page.body.contains("--statement-timeout-secs"),
        "{}",
        page.body
    );
    // An action waits no longer than a page, and says what happened.
    let r = tokio::time::timeout(
        bound,
        tab.post(
            &format!("/dead-letters/{dl}/redrive"),
            &form(&[("csrf", &token)]),
        ),
    )
    .await
    .expect("the action answers instead of waiting for the lock");
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE, "{}", r.body);
    assert!(
        r.body.contains("Not redriven") && r.body.contains("statement timeout"),
        "{}",
        r.body
    );
    assert!(started.elapsed() < bound, "{:?}", started.elapsed());
    lock.rollback().await.unwrap();

    assert!(
        unhandled(&pool, dl).await,
        "the timed-out redrive changed nothing"
    );
    let failed: serde_json::Value = sqlx::query_scalar(
        "SELECT outcome FROM outbox_console_actions WHERE action = 'redrive' AND finished_at IS NOT NULL",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert!(
        failed["failed"]
            .as_str()
            .is_some_and(|e| e.contains("statement timeout")),
        "{failed}"
    );
    assert_eq!(tab.get("/dead-letters").await.status, StatusCode::OK);
    console.stop().await.unwrap();
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn the_lists_purge_link_purges_what_the_list_matched(pool: PgPool) {
    // Two unhandled dead letters of orders, and two already redriven.
    let mut unhandled_ids = Vec::new();
    for i in 0..4 {
        let e = event(
            &pool,
            "orders",
            &format!("o{i}"),
            None,
            "dead_lettered_at = now()",
        )
        .await;
        let set = if i < 2 { "" } else { "redriven_at = now()" };
        let dl = dead_letter(&pool, "relay", Some(e), set).await;
        if i < 2 {
            unhandled_ids.push(dl);
        }
    }
    let console = Console::start(&args(&pool)).await.unwrap();
    let mut tab = Tab::new(&console);
    let purge_link = |page: &str| -> String {
        let bulk = &page[page.find("<p id=\"bulk\"").unwrap()..];
        let bulk = &bulk[..bulk.find("</p>").unwrap()];
        let last = bulk.rsplit("href=\"").next().unwrap();
        console_kit::unescape(&last[..last.find('"').unwrap()])
    };
    let remaining = || async {
        sqlx::query_scalar::<_, i64>("SELECT id FROM dead_letters ORDER BY id")
            .fetch_all(&pool)
            .await
            .unwrap()
    };

    // The list shows the unhandled ones: its purge counts and deletes those, not the handled ones too.
    let list = tab.get("/dead-letters?topic=orders").await;
    assert_eq!(by_id(&list.body, "total"), "2");
    let confirm = tab.get(&purge_link(&list.body)).await;
    assert_eq!(by_id(&confirm.body, "count"), "2", "{}", confirm.body);
    let report = tab
        .post(
            "/dead-letters/bulk",
            &hidden_fields(&confirm.body, "confirm"),
        )
        .await;
    assert_eq!(by_id(&report.body, "done"), "2", "{}", report.body);
    let left = remaining().await;
    assert_eq!(left.len(), 2);
    assert!(
        left.iter().all(|id| !unhandled_ids.contains(id)),
        "{left:?}"
    );

    // Including handled ones, the list and its purge take those too.
    let list = tab.get("/dead-letters?topic=orders&all=1").await;
    assert_eq!(by_id(&list.body, "total"), "2");
    let confirm = tab.get(&purge_link(&list.body)).await;
    assert_eq!(by_id(&confirm.body, "count"), "2", "{}", confirm.body);
    tab.post(
        "/dead-letters/bulk",
        &hidden_fields(&confirm.body, "confirm"),
    )
    .await;
    assert!(remaining().await.is_empty());
    console.stop().await.unwrap();
}
