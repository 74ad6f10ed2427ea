//! `outbox-dev bench sustained --quick`: the whole sustained-load run at a few seconds per minute. Checks the
//! files it writes (one JSON line per minute, the summary, the report's section, plots and `figures.json` object)
//! and the accounting of every event — never a timing: the figures are the command's own output. And the
//! accounting itself, on hand-made rows: each kind of failure it exists to catch is counted.

use outbox_devtools::bench::sustained::{self, SustainedArgs, report, verdict};
use serde_json::Value;

fn has_drawn_data(svg: &str) -> bool {
    svg.split("<polyline").skip(1).any(|p| {
        p.split("points=\"")
            .nth(1)
            .is_some_and(|pts| pts.split(' ').count() >= 2)
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quick_sustained_run_accounts_for_every_event_and_writes_its_report() {
    let base = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into());
    let dir = std::env::temp_dir().join(format!("outbox-bench-sustained-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let out = dir.join("run");
    let docs = dir.join("docs");
    std::fs::create_dir_all(docs.join("benchmarks")).unwrap();
    // A report that exists already: its other sections and figures stay.
    std::fs::write(
        docs.join("benchmarks.md"),
        "# Benchmarks\n\nearlier sections\n",
    )
    .unwrap();
    std::fs::write(
        docs.join("benchmarks").join("figures.json"),
        r#"{"scenarios": {"kept": true}}"#,
    )
    .unwrap();
    let database = format!("outbox_sustained_test_{}", std::process::id());
    let mut args = SustainedArgs::parse(&["--quick"]).unwrap();
    args.db.database_url = base.clone();
    args.database = database.clone();
    args.out = out.clone();
    args.report = Some(docs.clone());
    args.worker_exe = Some(env!("CARGO_BIN_EXE_outbox-dev").into());
    let summary = sustained::run_and_judge(args).await.unwrap();

    // Every event: applied exactly once, nothing lost, in order, nothing left leased.
    let a = &summary["accounting"];
    assert_eq!(a["ok"], true, "{a}");
    let produced = a["produced"].as_u64().unwrap();
    // 4 minutes of 10 s at 200 events/s, paced: the producers cannot write more than that (on a loaded machine
    // they write less).
    assert!((1..=8_100).contains(&produced), "{a}");
    assert_eq!(a["applied_once"].as_u64().unwrap(), produced, "{a}");

    // One JSON line per minute, with the figures the report needs.
    let lines = std::fs::read_to_string(out.join("minutes.jsonl")).unwrap();
    let minutes: Vec<Value> = lines
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(minutes.len(), 4, "{lines}");
    for (i, m) in minutes.iter().enumerate() {
        assert_eq!(m["minute"], i as u64 + 1);
        for key in [
            "dispatched",
            "outbox_bytes",
            "produced",
            "applied",
            "relay_cpu_pct",
        ] {
            assert!(
                m[key].is_number(),
                "{key} missing from minute {}: {m}",
                i + 1
            );
        }
        assert!(m["outbox_bytes"].as_i64().unwrap() > 0, "{m}");
        let tables: Vec<&str> = m["tables"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t["table"].as_str().unwrap())
            .collect();
        for t in [
            "outbox",
            "processed_messages",
            "outbox_keys",
            "dead_letters",
        ] {
            assert!(tables.contains(&t), "{t} missing: {m}");
        }
    }
    // Events flowed, and the relays' claim metrics were read from their EMF lines.
    assert!(
        minutes.iter().any(|m| m["applied"].as_i64().unwrap() > 0),
        "{lines}"
    );
    assert!(
        minutes.iter().any(|m| m["claim_p99_ms"].is_number()),
        "{lines}"
    );
    assert!(
        minutes
            .iter()
            .any(|m| m["commit_to_applied_p99_ms"].is_number()),
        "{lines}"
    );
    let sum: u64 = minutes
        .iter()
        .map(|m| m["produced"].as_u64().unwrap())
        .sum();
    assert!(
        sum <= produced,
        "per-minute produced {sum} > total {produced}"
    );
    // Retention ran (1 minute of 10 s): the housekeeping deleted outbox rows during the run.
    let deleted: u64 = minutes
        .iter()
        .map(|m| m["outbox_deleted"].as_u64().unwrap())
        .sum();
    assert!(deleted > 0, "no outbox row deleted by retention: {lines}");

    let summary_file: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("sustained.json")).unwrap())
            .unwrap();
    assert_eq!(summary_file["accounting"], summary["accounting"]);
    assert!(!summary_file["targets"].as_array().unwrap().is_empty());

    // The report: figures.json gains `sustained` (the rest kept), plots with drawn data, one section.
    let figures: Value = serde_json::from_str(
        &std::fs::read_to_string(docs.join("benchmarks").join("figures.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(figures["scenarios"]["kept"], true);
    let per_minute = figures["sustained"]["per_minute"].as_array().unwrap();
    assert_eq!(per_minute.len(), 4);
    for m in per_minute {
        for key in [
            "minute",
            "dispatched",
            "outbox_bytes",
            "claim_p99_ms",
            "commit_to_applied_p99_ms",
        ] {
            assert!(m.get(key).is_some(), "{key} missing from {m}");
        }
    }
    for svg in report::files(&figures) {
        let text = std::fs::read_to_string(docs.join("benchmarks").join(&svg)).unwrap();
        assert!(has_drawn_data(&text), "{svg} has no drawn line");
    }
    let md = std::fs::read_to_string(docs.join("benchmarks.md")).unwrap();
    assert!(md.starts_with("# Benchmarks\n\nearlier sections"), "{md}");
    assert_eq!(md.matches(report::BEGIN).count(), 1, "{md}");
    assert!(md.contains("Quick mode"), "{md}");
    // Rewriting the section replaces it: still one.
    let again = report::with_section(&md, &report::section(&figures));
    assert_eq!(again.matches(report::BEGIN).count(), 1);
    assert_eq!(again, md);

    let admin = outbox_cli::util::connect(&base).await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "DROP DATABASE IF EXISTS {database} WITH (FORCE)"
    )))
    .execute(&admin)
    .await
    .unwrap();
    let _ = std::fs::remove_dir_all(&dir);
}

/// The accounting counts each failure it exists to catch: an event never applied (lost), one applied twice, an
/// application of an id nobody produced, a key applied out of order, a dead letter, a row left pending.
#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn the_accounting_counts_lost_doubled_unknown_reordered_dead_and_pending_events(
    pool: sqlx::PgPool,
) {
    outbox_devtools::soak::create_table(&pool).await.unwrap();
    let mut ids = Vec::new();
    for n in 0..6u64 {
        let mut tx = pool.begin().await.unwrap();
        let e = outbox::NewEvent::new(
            &outbox_devtools::soak::ORDERED,
            "k1",
            &outbox_devtools::soak::SoakPayload {
                n,
                ..Default::default()
            },
        )
        .unwrap();
        ids.push(outbox::enqueue(&mut tx, e).await.unwrap().id.get());
        tx.commit().await.unwrap();
    }
    // Everything dispatched and delivered but event 4 (left pending) and event 5 (dead-lettered); events 0..2
    // and 4 applied, 1 twice, 2 before 0 (out of order); event 3 never applied (lost); id 999999 applied though
    // never produced.
    sqlx::query(
        "UPDATE outbox SET dispatched_at = now(), delivered_at = now() WHERE id <> ALL($1)",
    )
    .bind(vec![ids[4], ids[5]])
    .execute(&pool)
    .await
    .unwrap();
    sqlx::query("UPDATE outbox SET dead_lettered_at = now() WHERE id = $1")
        .bind(ids[5])
        .execute(&pool)
        .await
        .unwrap();
    sqlx::query(
        "INSERT INTO dead_letters (source, natural_id, outbox_id, error) VALUES ('relay', 'test', $1, 'refused')",
    )
    .bind(ids[5])
    .execute(&pool)
    .await
    .unwrap();
    let apply = |id: i64, seq: i64| {
        sqlx::query(
            "INSERT INTO soak_applied (outbox_id, topic, partition_key, seq, n) VALUES ($1, 'soak_ordered', 'k1', $2, 0)",
        )
        .bind(id)
        .bind(seq)
    };
    for (id, seq) in [
        (ids[1], 2),
        (ids[1], 2),
        (ids[2], 3),
        (ids[0], 1),
        (999_999, 9),
        (ids[4], 10),
    ] {
        apply(id, seq).execute(&pool).await.unwrap();
    }
    let a = verdict::account(&pool, ids.clone(), true).await.unwrap();
    assert_eq!(a.produced, 6);
    assert_eq!(a.applied_once, 3, "{a:?}"); // 0, 2 and 4
    assert_eq!(a.applied_twice, 1, "{a:?}");
    assert_eq!(a.lost, 1, "{a:?}"); // 3; 5 is dead-lettered, not lost
    assert_eq!(a.dead_lettered, 1, "{a:?}");
    assert_eq!(a.applied_unknown, 1, "{a:?}");
    // seq 2, 2 (not rising), 3, 1 (falls): two violations.
    assert_eq!(a.order_violations, 2, "{a:?}");
    assert_eq!(a.left_leased, 1, "{a:?}");
    assert!(!a.ok);
    assert_eq!(a.problems.len(), 6, "{:?}", a.problems);
    // With every row's outcome recorded, a dispatched event without one is still counted.
    sqlx::query("UPDATE outbox SET dispatched_at = now(), delivered_at = NULL WHERE id = $1")
        .bind(ids[4])
        .execute(&pool)
        .await
        .unwrap();
    let a = verdict::account(&pool, ids, true).await.unwrap();
    assert_eq!(
        a.left_leased, 1,
        "a dispatched event without an outcome: {a:?}"
    );
}
