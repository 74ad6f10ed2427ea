//! Where `outbox-dev dev`'s log lines go. Every component runs in this process (relay, consumer and callback
//! handlers, the QStash dev server, the demo producer) and logs through `tracing`: one subscriber sends all of it
//! to a file named at start, never to stdout, where the progress is. With `--verbose` the same lines also go to
//! stderr (coloured only when stderr is a terminal).
//!
//! The level is `info` unless `RUST_LOG` says otherwise (same directives and the same capped targets as the
//! functions: [`outbox::telemetry::filter_from`]); `LOG_FORMAT=json` writes JSON lines instead of text.

use std::fs::File;
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use anyhow::Context;
use tracing_subscriber::field::RecordFields;
use tracing_subscriber::fmt::FormatFields;
use tracing_subscriber::fmt::format::{DefaultFields, Writer};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{Layer, Registry};

/// The default log file: `<cargo target dir>/outbox-dev/dev-<UTC timestamp>-<pid>.log` when this binary runs from
/// a cargo target directory (as with `cargo run`), else the same name under the system's temp directory.
pub fn default_path() -> PathBuf {
    let dir = target_dir()
        .map(|t| t.join("outbox-dev"))
        .unwrap_or_else(|| std::env::temp_dir().join("outbox-dev"));
    dir.join(format!(
        "dev-{}-{}.log",
        chrono::Utc::now().format("%Y%m%dT%H%M%SZ"),
        std::process::id()
    ))
}

/// The cargo target directory this executable was built in (`CARGO_TARGET_DIR` when set): above the profile
/// directory (the one with cargo's `.fingerprint`) of `target/debug/outbox-dev` or `target/debug/deps/<test>`.
pub fn target_dir() -> Option<PathBuf> {
    if let Some(dir) = std::env::var_os("CARGO_TARGET_DIR").filter(|d| !d.is_empty()) {
        return Some(PathBuf::from(dir));
    }
    let exe = std::env::current_exe().ok()?;
    let profile = exe
        .ancestors()
        .skip(1)
        .take(2)
        .find(|d| d.join(".fingerprint").is_dir())?;
    profile.parent().map(Path::to_path_buf)
}

/// `path` relative to the working directory when it is below it (shorter to read and to paste).
pub fn display(path: &Path) -> String {
    let cwd = std::env::current_dir().ok();
    cwd.as_deref()
        .and_then(|c| path.strip_prefix(c).ok())
        .unwrap_or(path)
        .display()
        .to_string()
}

/// The default field formatter under another type: fmt layers keep a span's formatted fields in the span's
/// extensions keyed by the formatter's type, so two layers with the same one would each append the span's fields
/// to the same text (`outbox_id=5 outbox_id=5`).
#[derive(Default)]
struct StderrFields(DefaultFields);

impl<'writer> FormatFields<'writer> for StderrFields {
    fn format_fields<R: RecordFields>(
        &self,
        writer: Writer<'writer>,
        fields: R,
    ) -> std::fmt::Result {
        self.0.format_fields(writer, fields)
    }
}

fn filter() -> tracing_subscriber::EnvFilter {
    outbox::telemetry::filter_from(std::env::var("RUST_LOG").ok().as_deref(), None, "info")
}

/// Creates the log file (and its directory) and installs the process's subscriber: the file, stderr too when
/// `verbose`, and trace export when `otlp` (a base URL) or the standard `OTEL_*` variables ask for it
/// ([`outbox::telemetry::trace_layer`]). Returns where traces go (`None`: nowhere). When a subscriber was already
/// installed (a test process that runs `dev` twice) the file is created, and the lines go wherever that subscriber
/// sends them.
pub fn install(path: &Path, verbose: bool, otlp: Option<&str>) -> anyhow::Result<Option<String>> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)
            .with_context(|| format!("creating the log directory {}", dir.display()))?;
    }
    let file =
        File::create(path).with_context(|| format!("creating the log file {}", path.display()))?;
    let json = std::env::var("LOG_FORMAT").is_ok_and(|v| v.eq_ignore_ascii_case("json"));
    let to_file = tracing_subscriber::fmt::layer()
        .with_writer(Mutex::new(file))
        .with_ansi(false)
        .with_target(false);
    let to_file = if json {
        to_file
            .json()
            .flatten_event(true)
            .with_current_span(true)
            .with_span_list(false)
            .with_filter(filter())
            .boxed()
    } else {
        to_file.compact().with_filter(filter()).boxed()
    };
    let mut layers: Vec<Box<dyn Layer<Registry> + Send + Sync>> = vec![to_file];
    if verbose {
        layers.push(
            tracing_subscriber::fmt::layer()
                .fmt_fields(StderrFields::default())
                .with_writer(std::io::stderr)
                .with_ansi(std::io::stderr().is_terminal())
                .with_target(false)
                .compact()
                .with_filter(filter())
                .boxed(),
        );
    }
    let traces = outbox::telemetry::trace_layer::<Registry>(otlp);
    let to = traces.as_ref().map(|_| {
        otlp.map(str::to_owned)
            .or_else(|| std::env::var("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT").ok())
            .or_else(|| std::env::var("OTEL_EXPORTER_OTLP_ENDPOINT").ok())
            .unwrap_or_default()
    });
    layers.extend(traces);
    let _ = tracing_subscriber::registry().with(layers).try_init();
    Ok(to)
}
