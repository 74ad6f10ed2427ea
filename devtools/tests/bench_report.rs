//! `outbox-dev bench report --quick` writes the whole report: the Markdown, one SVG plot per figure (real SVG
//! with drawn data, from the plotting crate), a figures JSON holding every scenario, and the figures block of a
//! README beside it. Only the files and their shape are checked: never a timing (performance is for the
//! benchmark's own output, not for assertions). And the repository's README.md quotes exactly what the committed
//! `docs/benchmarks/figures.json` gives.

use std::path::Path;
use std::process::Command;

use outbox_devtools::bench::report::readme::{self, BEGIN, END};
use outbox_devtools::bench::report::{SCENARIOS, files};

/// The relay and the dev server run as the `outbox` and `qstash-dev` binaries next to `outbox-dev`. A workspace
/// test run builds them (their own packages' tests use them); `cargo test -p outbox-devtools` alone does not, so
/// they are built here when missing.
pub(crate) fn build_siblings() {
    let dir = Path::new(env!("CARGO_BIN_EXE_outbox-dev"))
        .parent()
        .expect("binary directory");
    let exe = std::env::consts::EXE_SUFFIX;
    if ["outbox", "qstash-dev"]
        .iter()
        .all(|b| dir.join(format!("{b}{exe}")).is_file())
    {
        return;
    }
    let status = Command::new(env!("CARGO"))
        .args(["build", "-p", "outbox-cli", "-p", "qstash-dev"])
        .status()
        .expect("running cargo build");
    assert!(
        status.success(),
        "building the outbox and qstash-dev binaries"
    );
}

fn has_drawn_data(svg: &str) -> bool {
    // A polyline or path whose point list has at least two points (plotters draws series as polylines).
    svg.split("<polyline")
        .skip(1)
        .chain(svg.split("<path").skip(1))
        .any(|el| {
            let el = &el[..el.find('>').unwrap_or(el.len())];
            let data = el
                .split_once(" points=\"")
                .or_else(|| el.split_once(" d=\""))
                .map(|(_, rest)| &rest[..rest.find('"').unwrap_or(0)])
                .unwrap_or("");
            data.split([' ', 'L', 'M'])
                .filter(|p| !p.trim().is_empty())
                .count()
                >= 2
        })
}

#[test]
fn quick_report_writes_markdown_svg_plots_and_every_scenario_in_json() {
    build_siblings();
    let out = std::env::temp_dir().join(format!("outbox-bench-report-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    std::fs::create_dir_all(&out).unwrap();
    let page = out.join("README.md");
    std::fs::write(&page, format!("before {BEGIN}stale figures{END} after\n")).unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_outbox-dev"))
        .args([
            "bench",
            "report",
            "--quick",
            "--xmin-events",
            "2000",
            "--delivery-batch",
            "1,4",
            "--readme",
        ])
        .arg(&page)
        .arg("--out")
        .arg(&out)
        .output()
        .expect("running outbox-dev bench report");
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success(),
        "bench report failed: {}\n{stdout}\n{}",
        o.status,
        String::from_utf8_lossy(&o.stderr)
    );
    for f in files(&out) {
        assert!(f.is_file(), "{} was not written", f.display());
        let text = std::fs::read_to_string(&f).unwrap();
        if f.extension().is_some_and(|e| e == "svg") {
            assert!(text.contains("<svg"), "{} is not SVG", f.display());
            assert!(has_drawn_data(&text), "{} has no drawn series", f.display());
        }
    }
    let md = std::fs::read_to_string(out.join("benchmarks.md")).unwrap();
    for svg in files(&out)
        .iter()
        .filter(|f| f.extension().is_some_and(|e| e == "svg"))
    {
        let name = svg.file_name().unwrap().to_string_lossy();
        assert!(
            md.contains(&format!("(benchmarks/{name})")),
            "benchmarks.md does not show {name}"
        );
    }
    for setting in ["synchronous_commit", "fsync", "shared_buffers"] {
        assert!(
            md.contains(setting),
            "benchmarks.md does not state {setting}"
        );
    }
    let json: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(out.join("benchmarks/figures.json")).unwrap(),
    )
    .unwrap();
    for s in SCENARIOS {
        let v = &json["scenarios"][s];
        assert!(
            v.is_object() && !v.as_object().unwrap().is_empty(),
            "figures.json lacks {s}: {json}"
        );
    }
    let phases: Vec<&str> = json["scenarios"]["xmin_pin"]["phases"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|p| p["phase"].as_str())
        .collect();
    assert_eq!(phases, ["baseline", "pinned", "released"]);
    // Batched deliveries: every scenario measured for every N given, with what each event cost in QStash
    // messages and consumer requests (counted, not timed: a message carries at least one event and reaches the
    // consumer at least once).
    let batched = &json["scenarios"]["batched_deliveries"];
    assert_eq!(
        batched["delivery_batch"],
        serde_json::json!([1, 4]),
        "{batched}"
    );
    for scenario in ["ordered", "hot_key", "unordered", "latency"] {
        let points = batched[scenario]["points"].as_array().unwrap();
        let ns: Vec<u64> = points.iter().filter_map(|p| p["n"].as_u64()).collect();
        assert_eq!(ns, [1, 4], "{scenario}: {batched}");
        for p in points {
            let messages = p["qstash_messages_per_event"].as_f64().unwrap();
            let requests = p["consumer_requests_per_event"].as_f64().unwrap();
            assert!(messages > 0.0 && messages <= 1.0, "{scenario}: {p}");
            assert!(requests >= messages, "{scenario}: {p}");
        }
    }
    // Every ordered point stands beside the SQL-only ordered protocol at the same N, measured in the same rounds.
    for p in batched["ordered"]["points"].as_array().unwrap() {
        let rounds = p["events_per_sec"].as_array().unwrap().len();
        assert_eq!(
            p["sql_only_events_per_sec"].as_array().map(Vec::len),
            Some(rounds),
            "{p}"
        );
        assert!(p["relay_vs_sql_only"].as_f64().is_some(), "{p}");
    }
    assert!(json["machine"]["cpus"].as_u64().unwrap_or(0) >= 1);
    // The README's block was rewritten from these figures, and nothing else on the page changed.
    assert_eq!(
        std::fs::read_to_string(&page).unwrap(),
        format!(
            "before {BEGIN}{}{END} after\n",
            readme::block(&json).unwrap()
        )
    );
    // The figures went to stdout too.
    assert!(stdout.contains("BENCH_JSON "), "{stdout}");
    let _ = std::fs::remove_dir_all(&out);
    assert!(!Path::new(&out).exists());
}

/// README.md quotes benchmark figures only inside its generated block, and the block is what the committed
/// `docs/benchmarks/figures.json` gives: a report run rewrites both, and so does `outbox-dev bench readme`.
#[test]
fn readme_quotes_the_committed_figures() {
    let root = outbox_testkit::repo_root();
    let figures: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(root.join("docs/benchmarks/figures.json")).unwrap(),
    )
    .unwrap();
    let page = std::fs::read_to_string(root.join("README.md")).unwrap();
    let want = readme::with_block(&page, &readme::block(&figures).unwrap())
        .unwrap()
        .expect("README.md has a figures block");
    assert!(
        want == page,
        "README.md's figures block is not what docs/benchmarks/figures.json gives; rewrite it with \
         `cargo run -p outbox-devtools -- bench readme`. Expected block: {}",
        readme::block(&figures).unwrap()
    );
}
