//! A stand-in consumer and callback endpoint for relay tests: records every delivery the dev server makes and
//! answers with a configurable policy; the callback routes record delivery evidence and QStash failures
//! through the library's real SQL (`outbox::internals::ordering`, `outbox::dead_letters`). Signature verification is
//! not done here (the whole-system tests in `tests/` use the real receivers).
//!
//! Like the real receivers it reads an event's identity from signed data only: a delivery's from its envelope
//! body (decision record 0025), a callback's from the envelope in its `sourceBody`. The parsing here is its own
//! (plain `serde_json`), not `outbox::internals::contract`'s.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use outbox::OutboxId;
use outbox::db::Statements;
use serde_json::Value;
use sqlx::PgPool;

/// One delivery the sink saw (identity from its envelope; -1 / empty when the body is not one).
#[derive(Debug, Clone)]
pub struct Seen {
    pub outbox_id: i64,
    pub topic: String,
    pub key: String,
    pub seq: Option<i64>,
    pub status: u16,
    pub retried: u32,
    pub at: Instant,
    pub body: Bytes,
    pub headers: HashMap<String, String>,
}

/// How the sink answers deliveries.
pub type Policy = Arc<dyn Fn(&Seen) -> u16 + Send + Sync>;

#[derive(Clone)]
struct Inner {
    pool: PgPool,
    seen: Arc<Mutex<Vec<Seen>>>,
    policy: Arc<Mutex<Policy>>,
    in_flight: Arc<Mutex<HashMap<String, u32>>>,
    max_in_flight_per_key: Arc<Mutex<u32>>,
    callbacks: Arc<Mutex<Vec<(String, serde_json::Value)>>>,
}

/// The running sink.
pub struct Sink {
    pub url: String,
    inner: Inner,
    _task: tokio::task::JoinHandle<()>,
}

impl Sink {
    pub async fn start(pool: PgPool) -> Sink {
        let inner = Inner {
            pool,
            seen: Arc::default(),
            policy: Arc::new(Mutex::new(Arc::new(|_: &Seen| 200))),
            in_flight: Arc::default(),
            max_in_flight_per_key: Arc::default(),
            callbacks: Arc::default(),
        };
        let app = Router::new()
            .route("/events/{topic}", post(event))
            .route("/delivered", post(delivered))
            .route("/failure", post(failure))
            .with_state(inner.clone());
        let listener = tokio::net::TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], 0)))
            .await
            .unwrap();
        let addr = listener.local_addr().unwrap();
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Sink {
            url: format!("http://{addr}"),
            inner,
            _task: task,
        }
    }

    pub fn set_policy(&self, p: impl Fn(&Seen) -> u16 + Send + Sync + 'static) {
        *self.inner.policy.lock().unwrap() = Arc::new(p);
    }

    pub fn seen(&self) -> Vec<Seen> {
        self.inner.seen.lock().unwrap().clone()
    }

    pub fn accepted(&self) -> Vec<Seen> {
        self.seen()
            .into_iter()
            .filter(|s| (200..300).contains(&s.status))
            .collect()
    }

    pub fn max_in_flight_per_key(&self) -> u32 {
        *self.inner.max_in_flight_per_key.lock().unwrap()
    }

    pub fn callbacks(&self) -> Vec<(String, serde_json::Value)> {
        self.inner.callbacks.lock().unwrap().clone()
    }
}

fn header(h: &HeaderMap, name: &str) -> Option<String> {
    h.get(name).and_then(|v| v.to_str().ok()).map(str::to_owned)
}

/// The single event of a contract-2 envelope.
fn envelope_event(body: &[u8]) -> Option<Value> {
    let v: Value = serde_json::from_slice(body).ok()?;
    if v.get("contract")?.as_u64()? != 2 {
        return None;
    }
    match v.get("events")?.as_array()?.as_slice() {
        [e] => Some(e.clone()),
        _ => None,
    }
}

/// The outbox id a callback body is about: the envelope in its `sourceBody` (the relay sends nothing else).
fn callback_outbox_id(v: &Value) -> Option<OutboxId> {
    let url = v.get("url")?.as_str()?;
    if !url.contains("contract=2") {
        return None;
    }
    let source = STANDARD.decode(v.get("sourceBody")?.as_str()?).ok()?;
    envelope_event(&source)?
        .get("id")?
        .as_i64()
        .map(OutboxId::from)
}

async fn event(
    State(s): State<Inner>,
    Path(topic): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> StatusCode {
    let event = envelope_event(&body);
    let field = |name: &str| event.as_ref().and_then(|e| e.get(name)).cloned();
    let key = field("key")
        .and_then(|k| k.as_str().map(str::to_owned))
        .unwrap_or_default();
    let flight_key = format!("{topic}/{key}");
    {
        let mut f = s.in_flight.lock().unwrap();
        let n = f.entry(flight_key.clone()).or_default();
        *n += 1;
        let mut m = s.max_in_flight_per_key.lock().unwrap();
        *m = (*m).max(*n);
    }
    // Give concurrent deliveries of the same key a chance to overlap (they must not exist for ordered keys).
    tokio::time::sleep(std::time::Duration::from_millis(2)).await;
    let mut seen = Seen {
        outbox_id: field("id").and_then(|v| v.as_i64()).unwrap_or(-1),
        topic,
        key,
        seq: field("seq").and_then(|v| v.as_i64()),
        status: 0,
        retried: header(&headers, "upstash-retried")
            .and_then(|v| v.parse().ok())
            .unwrap_or(0),
        at: Instant::now(),
        body,
        headers: headers
            .iter()
            .filter_map(|(k, v)| {
                v.to_str()
                    .ok()
                    .map(|v| (k.as_str().to_owned(), v.to_owned()))
            })
            .collect(),
    };
    let policy = s.policy.lock().unwrap().clone();
    seen.status = policy(&seen);
    let status = seen.status;
    s.seen.lock().unwrap().push(seen);
    if let Some(n) = s.in_flight.lock().unwrap().get_mut(&flight_key) {
        *n -= 1;
    }
    StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
}

async fn delivered(State(s): State<Inner>, body: Bytes) -> StatusCode {
    let Ok(v) = serde_json::from_slice::<serde_json::Value>(&body) else {
        return StatusCode::BAD_REQUEST;
    };
    s.callbacks
        .lock()
        .unwrap()
        .push(("delivered".into(), v.clone()));
    let Some(id) = callback_outbox_id(&v) else {
        return StatusCode::BAD_REQUEST;
    };
    let status = v.get("status").and_then(|s| s.as_u64()).unwrap_or(0);
    let mut conn = s.pool.acquire().await.unwrap();
    if (200..300).contains(&status) {
        outbox::internals::ordering::record_delivery(&mut conn, id, Statements::Prepared)
            .await
            .unwrap();
    } else {
        outbox::internals::ordering::record_failed_attempt(
            &mut conn,
            id,
            &format!("delivery attempt returned {status}"),
            Statements::Prepared,
        )
        .await
        .unwrap();
    }
    StatusCode::OK
}

async fn failure(State(s): State<Inner>, body: Bytes) -> StatusCode {
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
    s.callbacks
        .lock()
        .unwrap()
        .push(("failure".into(), v.clone()));
    let f = outbox::dead_letters::QstashFailure {
        dlq_id: v.get("dlqId").and_then(|x| x.as_str()).map(str::to_owned),
        outbox_id: callback_outbox_id(&v),
        source_message_id: v
            .get("sourceMessageId")
            .and_then(|x| x.as_str())
            .map(str::to_owned),
        status: v.get("status").and_then(|x| x.as_i64()).map(|x| x as i32),
        attempts: v
            .get("retried")
            .and_then(|x| x.as_i64())
            .map(|x| x as i32 + 1),
        raw_callback: Some(body.to_vec()),
        ..Default::default()
    };
    let mut conn = s.pool.acquire().await.unwrap();
    outbox::dead_letters::record_qstash_failure(
        &mut conn,
        &f,
        |_| outbox::config::DeadHeadPolicy::Block,
        // The sink keeps no dedupe rows; no dead letter of its is ever "applied".
        "consumer",
        Statements::Prepared,
    )
    .await
    .unwrap();
    StatusCode::OK
}
