//! Shared helpers for the integration tests: a recording HTTP sink and a small API client.
#![allow(dead_code)]

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use base64::Engine;
use qstash_dev::{Config, DevServer};
use sha2::Digest;

/// Generous wait for anything asynchronous (2 noisy cores).
pub const WAIT: Duration = Duration::from_secs(30);

/// One request the sink received.
#[derive(Clone, Debug)]
pub struct Received {
    pub at: Instant,
    pub method: String,
    /// Path and query, raw.
    pub target: String,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Received {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).expect("sink body is JSON")
    }
}

/// What the sink answers.
#[derive(Clone, Debug)]
pub struct Reply {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
    pub delay: Duration,
}

impl Reply {
    pub fn status(status: u16) -> Reply {
        Reply {
            status,
            headers: vec![],
            body: vec![],
            delay: Duration::ZERO,
        }
    }
    pub fn ok() -> Reply {
        Reply::status(200)
    }
    pub fn header(mut self, k: &str, v: &str) -> Reply {
        self.headers.push((k.into(), v.into()));
        self
    }
    pub fn body(mut self, b: &[u8]) -> Reply {
        self.body = b.to_vec();
        self
    }
    pub fn delay(mut self, d: Duration) -> Reply {
        self.delay = d;
        self
    }
}

type Behavior = Box<dyn Fn(&Received, usize) -> Reply + Send + Sync>;

pub struct SinkState {
    received: Mutex<Vec<Received>>,
    per_target: Mutex<HashMap<String, usize>>,
    behavior: Mutex<Arc<Behavior>>,
    in_flight: AtomicUsize,
    max_in_flight: AtomicUsize,
    notify: tokio::sync::Notify,
}

/// A recording HTTP endpoint. `behavior(request, n)` gets the 0-based count of earlier requests to the same
/// path (without query).
#[derive(Clone)]
pub struct Sink {
    pub base: String,
    pub state: Arc<SinkState>,
}

async fn sink_handler(State(st): State<Arc<SinkState>>, req: Request) -> Response {
    let (parts, body) = req.into_parts();
    let body = axum::body::to_bytes(body, usize::MAX)
        .await
        .unwrap_or_default();
    let rec = Received {
        at: Instant::now(),
        method: parts.method.to_string(),
        target: parts
            .uri
            .path_and_query()
            .map(|p| p.as_str().to_string())
            .unwrap_or_default(),
        headers: parts.headers,
        body,
    };
    let now = st.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
    st.max_in_flight.fetch_max(now, Ordering::SeqCst);
    let n = {
        let mut m = st.per_target.lock().unwrap();
        let c = m.entry(parts.uri.path().to_string()).or_default();
        let n = *c;
        *c += 1;
        n
    };
    let behavior = st.behavior.lock().unwrap().clone();
    let reply = behavior(&rec, n);
    if !reply.delay.is_zero() {
        tokio::time::sleep(reply.delay).await;
    }
    st.in_flight.fetch_sub(1, Ordering::SeqCst);
    st.received.lock().unwrap().push(rec);
    st.notify.notify_waiters();
    let mut resp = (StatusCode::from_u16(reply.status).unwrap(), reply.body).into_response();
    for (k, v) in reply.headers {
        resp.headers_mut().append(
            axum::http::HeaderName::from_bytes(k.as_bytes()).unwrap(),
            v.parse().unwrap(),
        );
    }
    resp
}

impl Sink {
    pub async fn start() -> Sink {
        Sink::with(|_, _| Reply::ok()).await
    }

    pub async fn with(f: impl Fn(&Received, usize) -> Reply + Send + Sync + 'static) -> Sink {
        let state = Arc::new(SinkState {
            received: Mutex::new(vec![]),
            per_target: Mutex::new(HashMap::new()),
            behavior: Mutex::new(Arc::new(Box::new(f))),
            in_flight: AtomicUsize::new(0),
            max_in_flight: AtomicUsize::new(0),
            notify: tokio::sync::Notify::new(),
        });
        let app = axum::Router::new()
            .fallback(sink_handler)
            .with_state(state.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr: SocketAddr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            axum::serve(listener, app).await.unwrap();
        });
        Sink {
            base: format!("http://{addr}"),
            state,
        }
    }

    pub fn set(&self, f: impl Fn(&Received, usize) -> Reply + Send + Sync + 'static) {
        *self.state.behavior.lock().unwrap() = Arc::new(Box::new(f));
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{}", self.base, path)
    }

    pub fn received(&self) -> Vec<Received> {
        self.state.received.lock().unwrap().clone()
    }

    /// Requests whose path (without query) is `path`.
    pub fn received_at(&self, path: &str) -> Vec<Received> {
        self.received()
            .into_iter()
            .filter(|r| r.target.split('?').next() == Some(path))
            .collect()
    }

    pub fn max_in_flight(&self) -> usize {
        self.state.max_in_flight.load(Ordering::SeqCst)
    }

    /// Waits until at least `n` requests arrived at `path` (panics after [`WAIT`]).
    pub async fn wait_for(&self, path: &str, n: usize) -> Vec<Received> {
        let deadline = tokio::time::Instant::now() + WAIT;
        loop {
            let notified = self.state.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let got = self.received_at(path);
            if got.len() >= n {
                return got;
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                panic!(
                    "sink: expected {n} requests at {path}, got {}: {:?}",
                    got.len(),
                    got.iter().map(|r| &r.target).collect::<Vec<_>>()
                );
            }
        }
    }
}

pub fn init_crypto() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

pub fn http() -> reqwest::Client {
    init_crypto();
    reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .build()
        .unwrap()
}

/// Starts a dev server with `time_scale` and the given tweaks.
pub async fn server(time_scale: f64, tweak: impl FnOnce(&mut Config)) -> DevServer {
    let mut cfg = Config::for_tests(time_scale);
    tweak(&mut cfg);
    DevServer::start(cfg).await.expect("dev server starts")
}

/// A tiny API client.
pub struct Api {
    pub base: String,
    pub token: String,
    pub client: reqwest::Client,
}

impl Api {
    pub fn new(s: &DevServer) -> Api {
        Api {
            base: s.url(),
            token: s.token().to_string(),
            client: http(),
        }
    }

    pub fn req(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        self.client
            .request(method, format!("{}{}", self.base, path))
            .bearer_auth(&self.token)
    }

    /// POST /v2/publish/{dest} with headers; returns (status, JSON body).
    pub async fn publish(
        &self,
        dest: &str,
        headers: &[(&str, &str)],
        body: impl Into<reqwest::Body>,
    ) -> (u16, serde_json::Value) {
        let mut r = self
            .req(reqwest::Method::POST, &format!("/v2/publish/{dest}"))
            .body(body);
        for (k, v) in headers {
            r = r.header(*k, *v);
        }
        let resp = r.send().await.expect("publish request");
        let status = resp.status().as_u16();
        let text = resp.text().await.unwrap();
        (
            status,
            serde_json::from_str(&text).unwrap_or(serde_json::Value::String(text)),
        )
    }

    /// Publishes and returns the message id (asserting 200).
    pub async fn publish_ok(
        &self,
        dest: &str,
        headers: &[(&str, &str)],
        body: impl Into<reqwest::Body>,
    ) -> String {
        let (status, v) = self.publish(dest, headers, body).await;
        assert_eq!(status, 200, "publish failed: {v}");
        v["messageId"].as_str().expect("messageId").to_string()
    }

    pub async fn call(&self, method: reqwest::Method, path: &str) -> (u16, serde_json::Value) {
        let resp = self.req(method, path).send().await.expect("request");
        let status = resp.status().as_u16();
        let text = resp.text().await.unwrap();
        (
            status,
            serde_json::from_str(&text).unwrap_or(serde_json::Value::String(text)),
        )
    }

    pub async fn call_json(
        &self,
        method: reqwest::Method,
        path: &str,
        body: serde_json::Value,
    ) -> (u16, serde_json::Value) {
        let resp = self
            .req(method, path)
            .header("content-type", "application/json")
            .body(body.to_string())
            .send()
            .await
            .expect("request");
        let status = resp.status().as_u16();
        let text = resp.text().await.unwrap();
        (
            status,
            serde_json::from_str(&text).unwrap_or(serde_json::Value::String(text)),
        )
    }
}

/// Decoded `Upstash-Signature`, verified with jsonwebtoken (an independent JWT implementation).
pub struct Verified {
    pub claims: serde_json::Value,
    /// The raw payload JSON text (to check key order and exact values).
    pub payload_text: String,
    pub header_text: String,
}

pub fn verify_signature(
    token: &str,
    key: &str,
    expect_sub: &str,
    body: &[u8],
    nbf_now: bool,
) -> Verified {
    use jsonwebtoken::{Algorithm, DecodingKey, Validation, decode};
    let mut v = Validation::new(Algorithm::HS256);
    v.validate_aud = false;
    v.leeway = 5;
    v.set_issuer(&["Upstash"]);
    v.set_required_spec_claims(&["exp", "iss", "sub"]);
    v.validate_nbf = nbf_now;
    let data = decode::<serde_json::Value>(
        token,
        &DecodingKey::from_secret(key.as_bytes()).expect("hmac key"),
        &v,
    )
    .unwrap_or_else(|e| panic!("signature does not verify: {e}"));
    let claims = data.claims;
    assert_eq!(
        claims["sub"], expect_sub,
        "sub must be the exact target URL"
    );
    let want_body = base64::engine::general_purpose::URL_SAFE.encode(sha2::Sha256::digest(body));
    assert!(want_body.ends_with('='));
    assert_eq!(
        claims["body"], want_body,
        "body claim = padded base64url(sha256(body))"
    );
    let mut parts = token.split('.');
    let dec = |s: &str| {
        String::from_utf8(
            base64::engine::general_purpose::URL_SAFE_NO_PAD
                .decode(s)
                .expect("unpadded base64url"),
        )
        .unwrap()
    };
    let header_text = dec(parts.next().unwrap());
    let payload_text = dec(parts.next().unwrap());
    Verified {
        claims,
        payload_text,
        header_text,
    }
}
