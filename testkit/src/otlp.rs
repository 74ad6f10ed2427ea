//! An OTLP/HTTP trace receiver for tests: a real HTTP server on a loopback port that decodes the real protocol
//! (`POST /v1/traces`, `application/x-protobuf`, `ExportTraceServiceRequest` through `opentelemetry-proto`'s
//! prost types) and keeps every span it was sent. It can also play a collector that is slow or refusing
//! ([`Behaviour`]), for the fault checks; a dead one is a port nobody listens on ([`dead_endpoint`]).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::{AnyValue, KeyValue, any_value};
use prost::Message;

/// How the receiver answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Behaviour {
    /// Keeps the spans and answers 200.
    Accept,
    /// Answers this status and keeps nothing.
    Refuse(u16),
    /// Waits this long before answering 200 (keeping the spans).
    Slow(Duration),
}

/// One span as received: ids in lower-case hex.
#[derive(Debug, Clone)]
pub struct ReceivedSpan {
    pub service: String,
    pub trace_id: String,
    pub span_id: String,
    /// Empty for a root span.
    pub parent_span_id: String,
    pub name: String,
    /// OTLP's `SpanKind` number (1 internal, 2 server, 3 client, 4 producer, 5 consumer).
    pub kind: i32,
    pub attributes: BTreeMap<String, String>,
    pub links: Vec<ReceivedLink>,
    /// OTLP's status code (0 unset, 1 ok, 2 error).
    pub status: i32,
}

/// One link of a span.
#[derive(Debug, Clone)]
pub struct ReceivedLink {
    pub trace_id: String,
    pub span_id: String,
    pub attributes: BTreeMap<String, String>,
}

impl ReceivedSpan {
    /// An attribute's value as text.
    pub fn attr(&self, key: &str) -> Option<&str> {
        self.attributes.get(key).map(String::as_str)
    }

    /// Whether this span links to `other`.
    pub fn links_to(&self, other: &ReceivedSpan) -> bool {
        self.links
            .iter()
            .any(|l| l.trace_id == other.trace_id && l.span_id == other.span_id)
    }

    /// Whether this span is `other`'s child.
    pub fn is_child_of(&self, other: &ReceivedSpan) -> bool {
        self.trace_id == other.trace_id && self.parent_span_id == other.span_id
    }
}

#[derive(Clone)]
struct Inner {
    spans: Arc<Mutex<Vec<ReceivedSpan>>>,
    requests: Arc<Mutex<u64>>,
    behaviour: Arc<Mutex<Behaviour>>,
}

/// The running receiver (stopped when dropped).
pub struct OtlpReceiver {
    /// The base URL (`OTEL_EXPORTER_OTLP_ENDPOINT`; the exporter appends `/v1/traces`).
    pub url: String,
    inner: Inner,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for OtlpReceiver {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A base URL where nothing listens (a collector that is down): a port bound, then closed.
pub fn dead_endpoint() -> String {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .unwrap_or(9);
    format!("http://127.0.0.1:{port}")
}

impl OtlpReceiver {
    /// Starts a receiver on a free loopback port.
    pub async fn start(behaviour: Behaviour) -> anyhow::Result<OtlpReceiver> {
        let inner = Inner {
            spans: Arc::default(),
            requests: Arc::default(),
            behaviour: Arc::new(Mutex::new(behaviour)),
        };
        let app = Router::new()
            .route("/v1/traces", post(traces))
            .with_state(inner.clone());
        let listener = tokio::net::TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], 0))).await?;
        let addr = listener.local_addr()?;
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Ok(OtlpReceiver {
            url: format!("http://{addr}"),
            inner,
            task,
        })
    }

    /// Every span received so far.
    pub fn spans(&self) -> Vec<ReceivedSpan> {
        self.inner.spans.lock().unwrap().clone()
    }

    /// Export requests received so far (answered or not).
    pub fn requests(&self) -> u64 {
        *self.inner.requests.lock().unwrap()
    }

    /// Changes how it answers from now on.
    pub fn set_behaviour(&self, b: Behaviour) {
        *self.inner.behaviour.lock().unwrap() = b;
    }

    /// Waits until `done` holds for the spans received, or `timeout`; returns the spans then.
    pub async fn wait_for(
        &self,
        timeout: Duration,
        done: impl Fn(&[ReceivedSpan]) -> bool,
    ) -> Vec<ReceivedSpan> {
        let until = tokio::time::Instant::now() + timeout;
        loop {
            let spans = self.spans();
            if done(&spans) || tokio::time::Instant::now() >= until {
                return spans;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

async fn traces(
    State(inner): State<Inner>,
    headers: HeaderMap,
    body: Bytes,
) -> (StatusCode, Bytes) {
    *inner.requests.lock().unwrap() += 1;
    let behaviour = *inner.behaviour.lock().unwrap();
    if let Behaviour::Refuse(code) = behaviour {
        return (
            StatusCode::from_u16(code).unwrap_or(StatusCode::SERVICE_UNAVAILABLE),
            Bytes::new(),
        );
    }
    if let Behaviour::Slow(d) = behaviour {
        tokio::time::sleep(d).await;
    }
    let protobuf = headers
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/x-protobuf"));
    if !protobuf {
        return (StatusCode::UNSUPPORTED_MEDIA_TYPE, Bytes::new());
    }
    let Ok(req) = ExportTraceServiceRequest::decode(body) else {
        return (StatusCode::BAD_REQUEST, Bytes::new());
    };
    let mut out = Vec::new();
    for rs in req.resource_spans {
        let service = rs
            .resource
            .as_ref()
            .and_then(|r| r.attributes.iter().find(|kv| kv.key == "service.name"))
            .map(|kv| text(kv.value.as_ref()))
            .unwrap_or_default();
        for ss in rs.scope_spans {
            for s in ss.spans {
                out.push(ReceivedSpan {
                    service: service.clone(),
                    trace_id: hex(&s.trace_id),
                    span_id: hex(&s.span_id),
                    parent_span_id: hex(&s.parent_span_id),
                    name: s.name,
                    kind: s.kind,
                    attributes: attributes(&s.attributes),
                    links: s
                        .links
                        .iter()
                        .map(|l| ReceivedLink {
                            trace_id: hex(&l.trace_id),
                            span_id: hex(&l.span_id),
                            attributes: attributes(&l.attributes),
                        })
                        .collect(),
                    status: s.status.map(|st| st.code).unwrap_or(0),
                });
            }
        }
    }
    inner.spans.lock().unwrap().extend(out);
    let answer = ExportTraceServiceResponse::default().encode_to_vec();
    (StatusCode::OK, Bytes::from(answer))
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn attributes(kvs: &[KeyValue]) -> BTreeMap<String, String> {
    kvs.iter()
        .map(|kv| (kv.key.clone(), text(kv.value.as_ref())))
        .collect()
}

fn text(v: Option<&AnyValue>) -> String {
    match v.and_then(|v| v.value.as_ref()) {
        Some(any_value::Value::StringValue(s)) => s.clone(),
        Some(any_value::Value::IntValue(i)) => i.to_string(),
        Some(any_value::Value::BoolValue(b)) => b.to_string(),
        Some(any_value::Value::DoubleValue(d)) => d.to_string(),
        Some(other) => format!("{other:?}"),
        None => String::new(),
    }
}
