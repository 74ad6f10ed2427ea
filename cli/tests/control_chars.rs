//! Stored data never reaches the operator's terminal raw: topics, keys, errors, reasons, response bodies,
//! headers, payloads and callbacks holding ANSI escapes, `\r`, C1 controls and bidi overrides are printed
//! escaped by `status`, `dead-letters list`, `show` and `redrive`.

mod common;

use outbox_cli::dead_letters::{
    Confirm, DeadLettersCommand, FilterArgs, ListArgs, RedriveArgs, ShowArgs, run,
};
use outbox_cli::status::{self, StatusArgs};
use outbox_testkit::db::{dead_letter, event, key_state};
use outbox_testkit::text;
use sqlx::PgPool;

use common::db;

/// Red colour, carriage return, right-to-left override, and U+009B (the one-character C1 form of ESC `[`).
const NASTY: &str = "\x1b[31mred\r\u{202e}rev\u{9b}c1";
/// How the CLI prints [`NASTY`].
const ESCAPED: &str = "\\u{1b}[31mred\\r\\u{202e}rev\\u{9b}c1";

/// Every character of `out` is printable, or a newline (or a tab where `tabs`).
fn assert_printable(what: &str, out: &str, tabs: bool) {
    for c in out.chars() {
        let bidi = matches!(c, '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}');
        let ok = c == '\n' || (tabs && c == '\t') || !(c.is_control() || bidi);
        assert!(ok, "{what} printed a raw {c:?}:\n{}", out.escape_debug());
    }
}

async fn exec(pool: &PgPool, sql: &str, id: i64, value: &str) {
    sqlx::query(sqlx::AssertSqlSafe(sql.to_owned()))
        .bind(id)
        .bind(value)
        .execute(pool)
        .await
        .unwrap();
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn stored_control_characters_are_printed_escaped(pool: PgPool) {
    let topic = format!("t{NASTY}");
    let key = format!("k{NASTY}");
    // A flapping event whose lease ran out (status: flapping rows and stuck leases).
    let flapping = event(
        &pool,
        &topic,
        &key,
        None,
        "attempts = 5, locked_until = now() - interval '30 seconds', lease_token = 7",
    )
    .await;
    exec(
        &pool,
        "UPDATE outbox SET last_error = $2 WHERE id = $1",
        flapping,
        &format!("e{NASTY}"),
    )
    .await;
    // An ordered key blocked by a dead head (status: blocked keys), and the head's dead letter.
    let okey = format!("o{NASTY}");
    let head = event(
        &pool,
        &topic,
        &okey,
        Some(1),
        "attempts = 2, dispatched_at = now(), dead_lettered_at = now()",
    )
    .await;
    key_state(
        &pool,
        &topic,
        &okey,
        1,
        0,
        &format!("blocked_at = now(), blocked_id = {head}"),
    )
    .await;
    sqlx::query("UPDATE outbox_keys SET blocked_reason = $1")
        .bind(format!("r{NASTY}"))
        .execute(&pool)
        .await
        .unwrap();
    let dl = dead_letter(&pool, "qstash", Some(head), "").await;
    for (column, value) in [
        ("error", format!("e{NASTY}")),
        ("natural_id", format!("n{NASTY}")),
        ("parse_error", format!("p{NASTY}")),
        ("qstash_message_id", format!("m{NASTY}")),
        ("dlq_id", format!("d{NASTY}")),
        ("response_body", format!("line one\n\tline two {NASTY}")),
    ] {
        exec(
            &pool,
            &format!("UPDATE dead_letters SET {column} = $2 WHERE id = $1"),
            dl,
            &value,
        )
        .await;
    }
    for (column, value) in [
        ("payload", serde_json::json!({ "note": NASTY })),
        ("headers", serde_json::json!({ "X-Note": NASTY })),
    ] {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "UPDATE dead_letters SET {column} = $2 WHERE id = $1"
        )))
        .bind(dl)
        .bind(value)
        .execute(&pool)
        .await
        .unwrap();
    }
    sqlx::query("UPDATE dead_letters SET raw_callback = $2 WHERE id = $1")
        .bind(dl)
        .bind(format!("{{\"x\": \"{NASTY}\"}}").into_bytes())
        .execute(&pool)
        .await
        .unwrap();

    // outbox status
    let mut out = Vec::new();
    status::run(
        StatusArgs {
            db: db(&pool),
            json: false,
            warn_age_secs: 300,
        },
        &mut out,
    )
    .await
    .unwrap();
    let t = text(&out);
    assert_printable("status", &t, false);
    for needle in [
        format!("event #{flapping} t{ESCAPED}/k{ESCAPED}  5 attempts"),
        format!("e{ESCAPED}"),
        format!("t{ESCAPED}/o{ESCAPED}  since"),
        format!(": r{ESCAPED}"),
        // The dead-letter table's topic cell is cut at 24 characters, never inside an escape.
        "t\\u{1b}[31mred\\r…".to_owned(),
    ] {
        assert!(t.contains(&needle), "status lacks {needle:?}:\n{t}");
    }

    // outbox dead-letters list
    let list = |filter: FilterArgs| {
        DeadLettersCommand::List(ListArgs {
            db: db(&pool),
            filter,
            include_redriven: false,
            after: None,
            limit: 50,
            json: false,
        })
    };
    let mut out = Vec::new();
    run(list(FilterArgs::default()), &mut out, Confirm::NoTerminal)
        .await
        .unwrap();
    let t = text(&out);
    assert_printable("dead-letters list", &t, false);
    for needle in [
        format!("e{ESCAPED}"),
        "t\\u{1b}[31mred…".to_owned(),
        "o\\u{1b}[31mred\\r…".to_owned(),
    ] {
        assert!(t.contains(&needle), "list lacks {needle:?}:\n{t}");
    }

    // outbox dead-letters show
    let mut out = Vec::new();
    run(
        DeadLettersCommand::Show(ShowArgs {
            db: db(&pool),
            id: dl.into(),
            json: false,
        }),
        &mut out,
        Confirm::NoTerminal,
    )
    .await
    .unwrap();
    let t = text(&out);
    assert_printable("dead-letters show", &t, true);
    for needle in [
        format!("topic / key   t{ESCAPED} / o{ESCAPED}"),
        format!("error         e{ESCAPED}"),
        format!("natural id    n{ESCAPED}"),
        format!("parse error   p{ESCAPED}"),
        format!("qstash msg    m{ESCAPED}"),
        format!("qstash dlq id d{ESCAPED}"),
        format!("response      line one\\n\\tline two {ESCAPED}"),
        // serde_json escapes C0 controls in JSON strings itself; C1 and bidi controls are the CLI's to escape.
        "\"note\": \"\\u001b[31mred\\r\\u{202e}rev\\u{9b}c1\"".to_owned(),
        "\"X-Note\":\"\\u001b[31mred\\r\\u{202e}rev\\u{9b}c1\"".to_owned(),
        format!("{{\"x\": \"{ESCAPED}\"}}"),
    ] {
        assert!(t.contains(&needle), "show lacks {needle:?}:\n{t}");
    }

    // outbox dead-letters redrive --topic … --yes: the selection, each redriven event, and the empty list after.
    let filter = FilterArgs {
        topic: Some(topic.clone()),
        ..FilterArgs::default()
    };
    let mut out = Vec::new();
    run(
        DeadLettersCommand::Redrive(RedriveArgs {
            db: db(&pool),
            id: None,
            filter: filter.clone(),
            out_of_order: false,
            yes: true,
            json: false,
        }),
        &mut out,
        Confirm::NoTerminal,
    )
    .await
    .unwrap();
    let t = text(&out);
    assert_printable("dead-letters redrive", &t, false);
    for needle in [
        format!("1 unhandled dead letter(s) match topic=t{ESCAPED}"),
        format!("redriven: event #{head} (t{ESCAPED}/o{ESCAPED})"),
    ] {
        assert!(t.contains(&needle), "redrive lacks {needle:?}:\n{t}");
    }
    let mut out = Vec::new();
    run(list(filter), &mut out, Confirm::NoTerminal)
        .await
        .unwrap();
    let t = text(&out);
    assert_printable("dead-letters list (empty)", &t, false);
    assert!(
        t.contains(&format!(
            "no unhandled dead letters matching topic=t{ESCAPED}"
        )),
        "{t}"
    );
}
