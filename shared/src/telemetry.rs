//! Logging setup shared by every binary: JSON lines through `tracing` (CloudWatch reads the top-level
//! `level`), level from `AWS_LAMBDA_LOG_LEVEL` or `RUST_LOG` (default `info`). Secrets are never logged: they
//! are [`secrecy::SecretString`] values whose `Debug` is redacted, and no code path formats them.

use tracing_subscriber::EnvFilter;

/// Output format of the log lines.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogFormat {
    /// One JSON object per line (Lambda, scripts).
    Json,
    /// Human-readable lines (local terminal).
    Pretty,
}

fn filter(default_level: &str) -> EnvFilter {
    let level = std::env::var("AWS_LAMBDA_LOG_LEVEL")
        .ok()
        .map(|l| l.to_ascii_lowercase())
        .unwrap_or_else(|| default_level.into());
    EnvFilter::try_from_env("RUST_LOG")
        .unwrap_or_else(|_| EnvFilter::new(format!("{level},sqlx=warn,hyper=warn,aws=warn")))
}

/// Installs the global subscriber writing to stdout. Safe to call twice (the second call is a no-op).
pub fn init(format: LogFormat) {
    init_with_default(format, "info");
}

/// Like [`init`], with another default level when neither `AWS_LAMBDA_LOG_LEVEL` nor `RUST_LOG` is set.
pub fn init_with_default(format: LogFormat, default_level: &str) {
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
