//! Log lines: JSON through `tracing` (CloudWatch reads the top-level `level`), level from `AWS_LAMBDA_LOG_LEVEL`
//! or `RUST_LOG` (default `info`); with trace export on, the same lines plus the bridge from `tracing` spans to
//! OpenTelemetry ([`trace_layer`]).

use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer, layer::SubscriberExt};

use super::export::{ExportSettings, install};

/// Output format of the log lines.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogFormat {
    /// One JSON object per line (Lambda, scripts).
    Json,
    /// Human-readable lines (local terminal).
    Pretty,
}

/// Targets that would write request contents at some level, capped below it whatever `RUST_LOG` says.
/// `lambda_runtime` logs every raw invocation event at TRACE (`raw JSON event received from Lambda`): for the
/// receivers that is the whole function-URL request, its `Upstash-Signature` token and its body.
pub(crate) const CAPPED_TARGETS: [&str; 1] = ["lambda_runtime::layers::api_response=debug"];

fn filter(default_level: &str) -> EnvFilter {
    filter_from(
        std::env::var("RUST_LOG").ok().as_deref(),
        std::env::var("AWS_LAMBDA_LOG_LEVEL").ok().as_deref(),
        default_level,
    )
}

/// The log filter: `rust_log` directives (`RUST_LOG`), else `lambda_level` (`AWS_LAMBDA_LOG_LEVEL`), else
/// `default_level`; then [`CAPPED_TARGETS`], which no directive can lift (a directive naming a capped target is
/// dropped).
pub fn filter_from(
    rust_log: Option<&str>,
    lambda_level: Option<&str>,
    default_level: &str,
) -> EnvFilter {
    let capped = |d: &str| {
        CAPPED_TARGETS.iter().any(|c| {
            let target = c.split('=').next().unwrap_or(c);
            let named = d.split(['=', '[']).next().unwrap_or(d).trim();
            !named.is_empty() && named.starts_with(target)
        })
    };
    let base = match rust_log.map(str::trim).filter(|s| !s.is_empty()) {
        Some(spec) => spec
            .split(',')
            .filter(|d| !capped(d))
            .collect::<Vec<_>>()
            .join(","),
        None => {
            let level = lambda_level
                .map(|l| l.to_ascii_lowercase())
                .unwrap_or_else(|| default_level.into());
            format!("{level},sqlx=warn,hyper=warn,aws=warn")
        }
    };
    let spec = std::iter::once(base.as_str())
        .chain(CAPPED_TARGETS)
        .filter(|s| !s.is_empty())
        .collect::<Vec<_>>()
        .join(",");
    EnvFilter::try_new(&spec).unwrap_or_else(|_| {
        EnvFilter::new(format!(
            "{default_level},sqlx=warn,hyper=warn,aws=warn,{}",
            CAPPED_TARGETS.join(",")
        ))
    })
}

/// Installs the global subscriber writing to stdout. Safe to call twice (the second call is a no-op).
pub fn init(format: LogFormat) {
    init_with_default(format, "info");
}

/// Like [`init`], with another default level when neither `AWS_LAMBDA_LOG_LEVEL` nor `RUST_LOG` is set. With
/// trace export on (the `OTEL_*` variables), the same log lines go through a registry that also carries
/// [`trace_layer`]; without, the subscriber is the one it always was.
pub(crate) fn init_with_default(format: LogFormat, default_level: &str) {
    if let Some(traces) = trace_layer(None) {
        let logs = tracing_subscriber::fmt::layer().with_target(false);
        let logs = match format {
            LogFormat::Json => logs
                .json()
                .flatten_event(true)
                .with_current_span(true)
                .with_span_list(false)
                .boxed(),
            LogFormat::Pretty => logs.compact().boxed(),
        };
        let _ = tracing_subscriber::registry()
            .with(filter(default_level))
            .with(logs)
            .with(traces)
            .try_init();
        return;
    }
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter(default_level))
        .with_target(false);
    let _ = match format {
        LogFormat::Json => builder
            .json()
            .flatten_event(true)
            .with_current_span(true)
            .with_span_list(false)
            .try_init(),
        LogFormat::Pretty => builder.compact().try_init(),
    };
}

/// Targets whose `tracing` spans are not bridged to OpenTelemetry: the pipeline's own (its messaging spans are
/// made directly, [`super::spans`]) and the Lambda runtime's. An application's spans are: the producer's caller
/// becomes the parent of its `create` spans, and a handler's spans are children of the consumer's `process`.
const NOT_BRIDGED: [&str; 4] = ["outbox", "lambda_runtime", "lambda_http", "qstash_dev"];

fn bridged(target: &str) -> bool {
    !NOT_BRIDGED.iter().any(|c| {
        target
            .strip_prefix(c)
            .is_some_and(|rest| rest.is_empty() || rest.starts_with("::"))
    })
}

/// Sets up trace export and returns the layer that bridges an application's `tracing` spans to it, when
/// `endpoint` (an OTLP/HTTP base URL, `/v1/traces` appended) is given or the `OTEL_*` variables turn export on;
/// `None` otherwise, or when export could not be set up (said on stderr: no subscriber is installed yet).
/// For a subscriber of one's own (`outbox-dev dev`); [`init`] and [`init_from_env`] add it themselves.
pub fn trace_layer<S>(endpoint: Option<&str>) -> Option<Box<dyn Layer<S> + Send + Sync>>
where
    S: tracing::Subscriber + for<'a> LookupSpan<'a> + Send + Sync,
{
    let get = |k: &str| std::env::var(k).ok();
    let settings = match endpoint {
        Some(url) => ExportSettings::with_endpoint(Some(url), get),
        None => ExportSettings::from_env(get)?,
    };
    match install(&settings) {
        Ok(provider) => {
            use opentelemetry::trace::TracerProvider as _;
            let layer = tracing_opentelemetry::layer()
                .with_tracer(provider.tracer("outbox"))
                .with_filter(tracing_subscriber::filter::filter_fn(|m| {
                    bridged(m.target())
                }));
            Some(layer.boxed())
        }
        Err(e) => {
            eprintln!("trace export is off: {e}");
            None
        }
    }
}

/// JSON unless `LOG_FORMAT=pretty` (Lambda always gets JSON).
pub fn init_from_env() {
    let pretty = std::env::var("LOG_FORMAT")
        .map(|v| v.eq_ignore_ascii_case("pretty"))
        .unwrap_or(false);
    init(if pretty {
        LogFormat::Pretty
    } else {
        LogFormat::Json
    });
}

/// An error and its causes, `outer: inner: innermost`: for a summary field or a stored error text, where a log
/// line's structured `cause` field is not available.
pub(crate) fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn the_pipelines_own_spans_are_not_bridged() {
        for t in [
            "outbox",
            "outbox::relay",
            "lambda_runtime::layers",
            "qstash_dev::api",
        ] {
            assert!(!bridged(t), "{t}");
        }
        for t in [
            "outbox_devtools::dev",
            "orders_example",
            "app::checkout",
            "outboxes",
        ] {
            assert!(bridged(t), "{t}");
        }
    }
    use std::sync::{Arc, Mutex};

    #[derive(Clone, Default)]
    struct Capture(Arc<Mutex<Vec<u8>>>);
    impl Write for Capture {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    /// The runtime's raw-event line carries the signature token and the body; no setting lets it through.
    #[test]
    fn no_log_level_writes_the_runtimes_raw_event() {
        for (rust_log, lambda_level) in [
            (Some("trace"), None),
            (Some("trace,lambda_runtime=trace"), None),
            (
                Some("trace,lambda_runtime::layers::api_response=trace"),
                None,
            ),
            (
                Some("trace,lambda_runtime::layers::api_response[x]=trace"),
                None,
            ),
            (Some("trace,lambda_runtime::layers=trace"), None),
            (None, Some("TRACE")),
        ] {
            let out = Capture::default();
            let writer = out.clone();
            let subscriber = tracing_subscriber::fmt()
                .with_env_filter(filter_from(rust_log, lambda_level, "info"))
                .with_writer(move || writer.clone())
                .finish();
            tracing::subscriber::with_default(subscriber, || {
                tracing::trace!(target: "lambda_runtime::layers::api_response",
                    body = "{\"headers\":{\"upstash-signature\":\"eyJ.secret.token\"}}",
                    "raw JSON event received from Lambda");
                tracing::trace!(target: "outbox::relay", "our own trace line");
            });
            let text = String::from_utf8(out.0.lock().unwrap().clone()).unwrap();
            assert!(
                !text.contains("eyJ.secret.token"),
                "{rust_log:?}/{lambda_level:?}: {text}"
            );
            assert!(
                text.contains("our own trace line"),
                "{rust_log:?}/{lambda_level:?}: trace is on"
            );
        }
    }
}
