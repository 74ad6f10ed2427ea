//! `outbox-dev bench cost`'s counts, checked against a small run whose counts are known independently: the seed's
//! configuration publishes one message and gets one delivery callback per event; the handlers' own invocation
//! counts match the dev server's own delivery counters (destination and callback attempts); every subscriber
//! applied every event (its dedupe rows); and the model's per-million figures are the raw counts scaled, with no
//! price in them. Never a timing. And the README's cost block is what the committed figures give.

use outbox_devtools::bench::cost::plan::Plan;
use outbox_devtools::bench::cost::{measure_run, report};
use serde_json::Value;

fn n(v: &Value) -> u64 {
    v.as_u64().unwrap_or_else(|| panic!("not a count: {v}"))
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-6 * b.abs().max(1.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_cost_counts_match_the_dev_server_and_the_handlers() {
    crate::bench_report::build_siblings();
    let base = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into());
    let plan = Plan::new(true, 40);
    let events = plan.events();
    let only = ["seed-unordered".to_owned(), "fanout3-ordered".to_owned()];
    let run = measure_run(&base, &plan, &only, "quick")
        .await
        .expect("bench cost --quick");
    let runs = run["runs"].as_array().unwrap();
    let rows = run["model"]["rows"].as_array().unwrap();
    assert_eq!(runs.len(), 2, "{run}");
    for (r, row) in runs.iter().zip(rows) {
        let q = &r["qstash"];
        let subs = n(&r["subscribers"]);
        assert_eq!(n(&r["events"]), events);
        // The handlers' invocations are the dev server's deliveries: to the consumers, to the callback receiver.
        assert_eq!(
            n(&r["consumer"]["invocations"]),
            n(&q["attempts"]) - n(&q["callback_attempts"]),
            "{r}"
        );
        assert_eq!(
            n(&r["callbacks"]["invocations"]),
            n(&q["callback_attempts"]),
            "{r}"
        );
        // Every message and every callback message was delivered (a delivery that failed under load was retried).
        assert_eq!(
            n(&q["delivered"]),
            n(&q["accepted"]) + n(&q["callbacks_created"]),
            "{r}"
        );
        assert_eq!(
            n(&q["attempts"]),
            n(&q["delivered"]) + n(&q["retries"]),
            "{r}"
        );
        // Each subscriber gets its own messages, at least one per 50 events (the default batch), at most one per event.
        assert!(n(&q["accepted"]) <= events * subs, "{r}");
        assert!(n(&q["accepted"]) * 50 >= events * subs, "{r}");
        assert!(n(&q["publish_bytes"]) > 0, "{r}");
        assert!(
            !r["relay"]["durations_ms"].as_array().unwrap().is_empty(),
            "{r}"
        );
        // The model's counts are the raw ones per million events, the prices kept out.
        let pm = &row["per_million_events"];
        let scale = events as f64 / 1e6;
        let raw = |v: &Value| v.as_f64().unwrap() * scale;
        assert!(close(
            raw(&pm["qstash_messages"]),
            (n(&q["accepted"]) + n(&q["callbacks_created"])) as f64
        ));
        assert!(close(
            raw(&pm["qstash_callbacks"]),
            n(&q["callbacks_created"]) as f64
        ));
        assert!(close(
            raw(&pm["consumer_invocations"]),
            n(&r["consumer"]["invocations"]) as f64
        ));
        assert!(close(
            raw(&pm["callback_invocations"]),
            n(&r["callbacks"]["invocations"]) as f64
        ));
        assert!(r["postgres"]["wal_bytes"].as_f64().unwrap() > 0.0, "{r}");
        assert!(r["postgres"]["cpu_secs"].as_f64().is_some(), "{r}");
    }
    // The seed's configuration: one QStash message and one delivery callback per event, each one invocation.
    let by_name = |name: &str| runs.iter().find(|r| r["scenario"] == name).unwrap();
    let seed = by_name("seed-unordered");
    assert_eq!(n(&seed["qstash"]["accepted"]), events, "{seed}");
    // QStash calls the callback after every delivery attempt: a delivery retried under load adds one.
    let retries = n(&seed["qstash"]["retries"]);
    assert_eq!(
        n(&seed["qstash"]["callbacks_created"]),
        events + retries,
        "{seed}"
    );
    assert_eq!(
        n(&seed["consumer"]["invocations"]),
        events + retries,
        "{seed}"
    );
    assert_eq!(
        n(&seed["callbacks"]["invocations"]),
        events + retries,
        "{seed}"
    );
    // Fan-out: three subscribers, each its own copies.
    let fanout = by_name("fanout3-ordered");
    assert_eq!(n(&fanout["subscribers"]), 3);
    assert!(n(&fanout["qstash"]["accepted"]) >= 3, "{fanout}");
    // The section and the README block come from these figures.
    let figures = serde_json::json!({ report::KEY: run });
    let md = report::section(&figures);
    if retries == 0 {
        assert!(md.contains("| the seed: one message per event, a delivery callback each | unordered | 1 | 2000000 (1000000 + 1000000) | 2000000 |"), "{md}");
    }
    assert!(
        report::readme_block(&figures).is_err(),
        "no defaults-unordered row in this run"
    );
}

/// README.md's cost block is what the committed `docs/benchmarks/figures.json` gives.
#[test]
fn the_readme_quotes_the_committed_cost_figures() {
    let root = outbox_testkit::repo_root();
    let figures: Value = serde_json::from_str(
        &std::fs::read_to_string(root.join("docs/benchmarks/figures.json")).unwrap(),
    )
    .unwrap();
    let page = std::fs::read_to_string(root.join("README.md")).unwrap();
    let block = report::readme_block(&figures).expect("a cost run in figures.json");
    assert!(
        page.contains(&format!(
            "{}{block}{}",
            report::README_BEGIN,
            report::README_END
        )),
        "README.md's cost block is not what docs/benchmarks/figures.json gives; rewrite it with \
         `cargo run -p outbox-devtools -- bench readme`. Expected: {block}"
    );
}
