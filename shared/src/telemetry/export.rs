//! Trace export by OTLP over HTTP/protobuf (decision record 0074), on only when the standard `OTEL_*` variables
//! ask for it ([`ExportSettings::from_env`]); nothing is set up otherwise.
//!
//! Finished spans wait in a bounded buffer ([`BoundedProcessor`], `OTEL_BSP_MAX_QUEUE_SIZE`, default 2048): a
//! span that finds it full is dropped and counted, never queued. [`flush`] sends the buffer in requests of
//! `OTEL_BSP_MAX_EXPORT_BATCH_SIZE` (default 512) within a bound (`OUTBOX_TRACE_FLUSH_TIMEOUT_MS`, default 500
//! ms): what is not sent by then is dropped and counted, and a collector that is down, slow or refusing costs an
//! invocation at most that bound. Each Lambda handler flushes before it returns; a background task also flushes
//! whenever a batch's worth is waiting (a relay invocation runs for minutes). One export runs at a time, so the
//! spans held are at most the buffer plus one batch in flight.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use opentelemetry::Context;
use opentelemetry_otlp::{Protocol, WithExportConfig, WithHttpConfig};
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::trace::{SdkTracerProvider, Span, SpanData, SpanExporter, SpanProcessor};

/// Why export could not be set up (it then stays off; the function still runs).
#[derive(Debug, thiserror::Error)]
pub(crate) enum ExportError {
    #[error("building the HTTP client for trace export: {0}")]
    Client(#[from] reqwest::Error),
    #[error("building the OTLP exporter: {0}")]
    Exporter(#[from] opentelemetry_otlp::ExporterBuildError),
}

/// What export is set up with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ExportSettings {
    /// The traces URL when given in code (`outbox-dev dev --otlp URL`); `None`: the OTLP variables'.
    pub(crate) endpoint: Option<String>,
    /// The bound on one flush.
    pub(crate) flush_timeout: Duration,
    /// Spans held at most between flushes.
    pub(crate) max_queue: usize,
    /// Spans per export request.
    pub(crate) max_batch: usize,
    /// `service.name` when `OTEL_SERVICE_NAME` does not say.
    pub(crate) service_name: String,
}

/// Default bound on one flush.
pub(crate) const DEFAULT_FLUSH_TIMEOUT: Duration = Duration::from_millis(500);

impl ExportSettings {
    /// Export is on when `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` or `OTEL_EXPORTER_OTLP_ENDPOINT` is set, unless
    /// `OTEL_SDK_DISABLED=true` or `OTEL_TRACES_EXPORTER` names anything but `otlp`.
    pub(crate) fn from_env(get: impl Fn(&str) -> Option<String>) -> Option<ExportSettings> {
        let set = |k: &str| get(k).filter(|v| !v.trim().is_empty());
        if set("OTEL_SDK_DISABLED").is_some_and(|v| v.trim().eq_ignore_ascii_case("true")) {
            return None;
        }
        if set("OTEL_TRACES_EXPORTER").is_some_and(|v| !v.trim().eq_ignore_ascii_case("otlp")) {
            return None;
        }
        if set("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT").is_none()
            && set("OTEL_EXPORTER_OTLP_ENDPOINT").is_none()
        {
            return None;
        }
        Some(Self::with_endpoint(None, get))
    }

    /// Settings for an endpoint given in code (the base URL; `/v1/traces` is appended), the rest from `get`.
    pub(crate) fn with_endpoint(
        base_url: Option<&str>,
        get: impl Fn(&str) -> Option<String>,
    ) -> ExportSettings {
        let num = |k: &str, default: u64| {
            get(k)
                .and_then(|v| v.trim().parse::<u64>().ok())
                .filter(|n| *n > 0)
                .unwrap_or(default)
        };
        let max_queue = num("OTEL_BSP_MAX_QUEUE_SIZE", 2048) as usize;
        ExportSettings {
            endpoint: base_url.map(|u| format!("{}/v1/traces", u.trim_end_matches('/'))),
            flush_timeout: Duration::from_millis(num(
                "OUTBOX_TRACE_FLUSH_TIMEOUT_MS",
                DEFAULT_FLUSH_TIMEOUT.as_millis() as u64,
            )),
            max_queue,
            max_batch: (num("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", 512) as usize).min(max_queue),
            service_name: get("AWS_LAMBDA_FUNCTION_NAME")
                .or_else(|| {
                    std::env::current_exe()
                        .ok()?
                        .file_stem()
                        .map(|s| s.to_string_lossy().into_owned())
                })
                .unwrap_or_else(|| "outbox".into()),
        }
    }
}

/// Counters of what export did, for the invocation summary, the benchmarks and the tests.
#[derive(Debug, Default)]
pub(crate) struct ExportCounters {
    pub(crate) exported: AtomicU64,
    /// Dropped because the buffer was full.
    pub(crate) dropped_full: AtomicU64,
    /// Dropped because an export failed or did not finish within the bound.
    pub(crate) dropped_failed: AtomicU64,
    pub(crate) failed_flushes: AtomicU64,
}

/// A copy of [`ExportCounters`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ExportStats {
    pub exported: u64,
    pub dropped_full: u64,
    pub dropped_failed: u64,
    pub failed_flushes: u64,
    /// Spans waiting now.
    pub buffered: u64,
}

#[derive(Debug)]
struct Buffer {
    spans: Mutex<Vec<SpanData>>,
    max_queue: usize,
    max_batch: usize,
    counters: ExportCounters,
    wake: tokio::sync::Notify,
}

impl Buffer {
    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<SpanData>> {
        self.spans.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The span processor: finished, sampled spans into the bounded buffer, or dropped and counted.
#[derive(Debug, Clone)]
struct BoundedProcessor(Arc<Buffer>);

impl SpanProcessor for BoundedProcessor {
    fn on_start(&self, _span: &mut Span, _cx: &Context) {}

    fn on_end(&self, span: SpanData) {
        if !span.span_context.is_sampled() {
            return;
        }
        let waiting = {
            let mut q = self.0.lock();
            if q.len() >= self.0.max_queue {
                drop(q);
                self.0.counters.dropped_full.fetch_add(1, Ordering::Relaxed);
                return;
            }
            q.push(span);
            q.len()
        };
        if waiting >= self.0.max_batch {
            self.0.wake.notify_one();
        }
    }

    fn force_flush(&self) -> OTelSdkResult {
        Ok(())
    }

    fn shutdown_with_timeout(&self, _timeout: Duration) -> OTelSdkResult {
        Ok(())
    }
}

/// The process's export: the buffer, the exporter, and one export at a time.
#[derive(Debug)]
pub(crate) struct Export {
    buffer: Arc<Buffer>,
    exporter: opentelemetry_otlp::SpanExporter,
    one_at_a_time: tokio::sync::Mutex<()>,
    flush_timeout: Duration,
}

static EXPORT: OnceLock<Arc<Export>> = OnceLock::new();

/// Sets up export with `settings` and makes its tracer provider the global one. Returns the provider (for the
/// `tracing` bridge). A second call keeps the first export.
pub(crate) fn install(settings: &ExportSettings) -> Result<SdkTracerProvider, ExportError> {
    let (provider, export) = build(settings)?;
    if EXPORT.set(export.clone()).is_ok() {
        opentelemetry::global::set_tracer_provider(provider.clone());
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(background(export));
        }
    }
    Ok(provider)
}

/// A provider exporting through its own bounded buffer, and that export.
fn build(settings: &ExportSettings) -> Result<(SdkTracerProvider, Arc<Export>), ExportError> {
    crate::tls::install_crypto_provider();
    let client = reqwest::Client::builder()
        .timeout(settings.flush_timeout)
        .connect_timeout(settings.flush_timeout)
        .build()?;
    let mut builder = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_http_client(client)
        .with_protocol(Protocol::HttpBinary)
        .with_timeout(settings.flush_timeout)
        .with_retry_policy(opentelemetry_otlp::RetryPolicy::disabled());
    if let Some(url) = &settings.endpoint {
        builder = builder.with_endpoint(url.clone());
    }
    let mut exporter = builder.build()?;
    let mut resource = opentelemetry_sdk::Resource::builder();
    if std::env::var_os("OTEL_SERVICE_NAME").is_none() {
        resource = resource.with_service_name(settings.service_name.clone());
    }
    let resource = resource.build();
    exporter.set_resource(&resource);
    let buffer = Arc::new(Buffer {
        spans: Mutex::new(Vec::new()),
        max_queue: settings.max_queue,
        max_batch: settings.max_batch,
        counters: ExportCounters::default(),
        wake: tokio::sync::Notify::new(),
    });
    let provider = SdkTracerProvider::builder()
        .with_span_processor(BoundedProcessor(buffer.clone()))
        .with_resource(resource)
        .build();
    let export = Arc::new(Export {
        buffer,
        exporter,
        one_at_a_time: tokio::sync::Mutex::new(()),
        flush_timeout: settings.flush_timeout,
    });
    Ok((provider, export))
}

/// An export of its own, not the process's (the benchmarks' fault checks): a collector at `base_url`, spans
/// made on demand.
#[cfg_attr(not(feature = "internals"), allow(dead_code))]
pub struct TraceRig {
    provider: SdkTracerProvider,
    export: Arc<Export>,
}

#[cfg_attr(not(feature = "internals"), allow(dead_code))]
impl TraceRig {
    /// Export to `base_url` (`/v1/traces` appended) with this flush bound and buffer size.
    pub fn new(
        base_url: &str,
        flush_timeout: Duration,
        max_queue: usize,
    ) -> Result<TraceRig, String> {
        let mut settings = ExportSettings::with_endpoint(Some(base_url), |_| None);
        settings.flush_timeout = flush_timeout;
        settings.max_queue = max_queue;
        settings.max_batch = settings.max_batch.min(max_queue);
        let (provider, export) = build(&settings).map_err(|e| e.to_string())?;
        Ok(TraceRig { provider, export })
    }

    /// Makes and ends `n` spans with a link and a few attributes each (like a consumer's `process`).
    pub fn record(&self, n: usize) {
        use opentelemetry::KeyValue;
        use opentelemetry::trace::{Span as _, Tracer as _, TracerProvider as _};
        let tracer = self.provider.tracer("outbox-bench");
        for i in 0..n {
            let mut span = tracer.start("process bench");
            span.set_attribute(KeyValue::new("messaging.message.id", i as i64));
            span.set_attribute(KeyValue::new("messaging.destination.name", "bench"));
            span.end();
        }
    }

    /// One flush, as a handler's: within the bound.
    pub async fn flush(&self) {
        self.export.flush().await;
    }

    pub fn stats(&self) -> ExportStats {
        self.export.stats()
    }
}

/// Flushes whenever a batch's worth is waiting.
async fn background(export: Arc<Export>) {
    loop {
        export.buffer.wake.notified().await;
        export.flush().await;
    }
}

/// Whether export is on in this process.
pub(crate) fn enabled() -> bool {
    EXPORT.get().is_some()
}

/// Sends the waiting spans within the flush bound; nothing when export is off. Never fails: a collector that is
/// down, slow or refusing costs at most the bound, and the spans not sent are dropped and counted.
pub async fn flush() {
    if let Some(export) = EXPORT.get() {
        export.flush().await;
    }
}

/// What export did so far (zeros when it is off).
pub fn stats() -> ExportStats {
    EXPORT.get().map(|e| e.stats()).unwrap_or_default()
}

impl Export {
    async fn flush(&self) {
        let start = Instant::now();
        let bound = self.flush_timeout;
        let c = &self.buffer.counters;
        if self.buffer.lock().is_empty() {
            return; // nothing of ours waits (a concurrent flush took it)
        }
        let Ok(_one) = tokio::time::timeout(bound, self.one_at_a_time.lock()).await else {
            return; // another flush holds the exporter for its own bound; the spans wait (bounded)
        };
        loop {
            let batch: Vec<SpanData> = {
                let mut q = self.buffer.lock();
                let n = q.len().min(self.buffer.max_batch);
                q.drain(..n).collect()
            };
            if batch.is_empty() {
                return;
            }
            let n = batch.len() as u64;
            let left = bound.saturating_sub(start.elapsed());
            let why = match tokio::time::timeout(left, self.exporter.export(batch)).await {
                Ok(Ok(())) => {
                    c.exported.fetch_add(n, Ordering::Relaxed);
                    continue;
                }
                Ok(Err(e)) => e.to_string(),
                Err(_) => format!("no answer within {} ms", bound.as_millis()),
            };
            c.dropped_failed.fetch_add(n, Ordering::Relaxed);
            c.failed_flushes.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(target: "outbox::telemetry", dropped = n, error = %why,
                "trace export failed: spans dropped");
            return;
        }
    }

    fn stats(&self) -> ExportStats {
        let c = &self.buffer.counters;
        ExportStats {
            exported: c.exported.load(Ordering::Relaxed),
            dropped_full: c.dropped_full.load(Ordering::Relaxed),
            dropped_failed: c.dropped_failed.load(Ordering::Relaxed),
            failed_flushes: c.failed_flushes.load(Ordering::Relaxed),
            buffered: self.buffer.lock().len() as u64,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn settings(vars: &[(&str, &str)]) -> Option<ExportSettings> {
        let map: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        ExportSettings::from_env(|k| map.get(k).cloned())
    }

    #[test]
    fn export_is_on_only_when_the_otel_variables_say_so() {
        assert_eq!(settings(&[]), None);
        let on = settings(&[("OTEL_EXPORTER_OTLP_ENDPOINT", "http://localhost:4318")]).unwrap();
        assert_eq!(on.flush_timeout, DEFAULT_FLUSH_TIMEOUT);
        assert_eq!((on.max_queue, on.max_batch), (2048, 512));
        assert!(
            settings(&[("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://c/v1/traces")]).is_some()
        );
        for off in [
            ("OTEL_SDK_DISABLED", "true"),
            ("OTEL_TRACES_EXPORTER", "none"),
        ] {
            assert_eq!(
                settings(&[("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c"), off]),
                None
            );
        }
        let tuned = settings(&[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c"),
            ("OTEL_BSP_MAX_QUEUE_SIZE", "100"),
            ("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "1000"),
            ("OUTBOX_TRACE_FLUSH_TIMEOUT_MS", "250"),
        ])
        .unwrap();
        assert_eq!((tuned.max_queue, tuned.max_batch), (100, 100));
        assert_eq!(tuned.flush_timeout, Duration::from_millis(250));
        let given = ExportSettings::with_endpoint(Some("http://127.0.0.1:4318/"), |_| None);
        assert_eq!(
            given.endpoint.as_deref(),
            Some("http://127.0.0.1:4318/v1/traces")
        );
    }
}
