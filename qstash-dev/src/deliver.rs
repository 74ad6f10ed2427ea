//! The delivery engine: the timer task that makes waiting messages due, and the worker pool that makes delivery
//! requests (with its HTTP client), fed by the job queue in `state`.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant, SystemTime};

use bytes::{Bytes, BytesMut};
use http::{HeaderMap, HeaderName, HeaderValue, Request, Uri};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

use crate::config::NonRetryableMode;
use crate::core::{Effects, Job, Outcome, RETRY_AFTER_MAX, now_ms};
use crate::draw::FaultKind;
use crate::duration::parse_retry_after;
use crate::sign;
use crate::state::{AttemptRec, Shared};

pub(crate) type HttpClient = Client<HttpConnector, Full<Bytes>>;

/// The HTTP client the workers share (clones share its connection pool).
pub(crate) fn new_client(cfg: &crate::Config) -> HttpClient {
    let mut conn = HttpConnector::new();
    conn.set_nodelay(true);
    conn.set_connect_timeout(Some(cfg.max_timeout.min(Duration::from_secs(30))));
    Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(30))
        .build(conn)
}

/// The timer task: fires due timers, then sleeps until the next deadline or until an earlier one is added.
pub(crate) async fn timer_loop(shared: Arc<Shared>) {
    loop {
        let mut fx = Effects::default();
        let next = {
            let mut core = shared.core();
            core.fire_timers(tokio::time::Instant::now(), &mut fx)
        };
        fx.wake_timer = false;
        shared.apply(fx);
        match next {
            Some(at) => {
                tokio::select! {
                    _ = tokio::time::sleep_until(at) => {}
                    _ = shared.timer_wake.notified() => {}
                }
            }
            None => shared.timer_wake.notified().await,
        }
    }
}

/// One worker: takes jobs forever.
pub(crate) async fn worker(shared: Arc<Shared>, client: HttpClient) {
    while let Some(job) = shared.jobs.pop().await {
        let (outcome, attempt) = attempt(&shared, &client, &job).await;
        if let Some(a) = attempt {
            shared.record_attempt(a);
        }
        if !job.duplicate {
            let dup = outcome.success()
                && shared.delivery_faults_active()
                && shared.draw_delivery(
                    FaultKind::DuplicateDelivery,
                    job.data.fault_id,
                    u64::from(job.retried),
                );
            shared.complete(&job, outcome, dup);
        }
        shared.jobs.finish();
        shared.idle_changed();
    }
}

fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(inner) = cur {
        s.push_str(": ");
        s.push_str(&inner.to_string());
        cur = inner.source();
    }
    s
}

/// Makes one attempt. Returns the outcome and the attempt record (none when skipped).
async fn attempt(shared: &Shared, client: &HttpClient, job: &Job) -> (Outcome, Option<AttemptRec>) {
    if job.cancel.load(Ordering::Relaxed) {
        return (
            Outcome {
                skipped: true,
                error: Some("cancelled".into()),
                ..Outcome::default()
            },
            None,
        );
    }
    let data = &job.data;
    // An injected loss: the message vanishes before its first attempt, as if the server had crashed with it
    // (finalized like a cancellation: no attempt, no callback, no DLQ entry).
    if job.retried == 0
        && !job.duplicate
        && data.is_destination()
        && shared.delivery_faults_active()
        && shared.draw_delivery(FaultKind::MessageLoss, data.fault_id, 0)
    {
        job.cancel.store(true, Ordering::Relaxed);
        shared.note_lost(&data.id);
        return (
            Outcome {
                skipped: true,
                error: Some("injected fault: message lost by the server".into()),
                ..Outcome::default()
            },
            None,
        );
    }
    let started = Instant::now();
    let at_unix_ms = now_ms();
    let iat = i64::try_from(at_unix_ms / 1000).unwrap_or(0);
    let key = shared.current_key();
    let signature = sign::sign(&key, &data.url, &data.body, iat, shared.cfg.nbf);

    let mut headers = HeaderMap::with_capacity(data.forward.len() + 8);
    for (k, v) in &data.forward {
        headers.append(k.clone(), v.clone());
    }
    if let Some(ct) = &data.content_type {
        headers.insert(http::header::CONTENT_TYPE, ct.clone());
    }
    headers.insert(
        http::header::USER_AGENT,
        HeaderValue::from_static("Upstash-QStash"),
    );
    let hv = |s: &str| HeaderValue::from_str(s).unwrap_or_else(|_| HeaderValue::from_static(""));
    headers.insert(HeaderName::from_static("upstash-message-id"), hv(&data.id));
    headers.insert(
        HeaderName::from_static("upstash-retried"),
        HeaderValue::from(job.retried),
    );
    headers.insert(HeaderName::from_static("upstash-signature"), hv(&signature));
    headers.insert(
        HeaderName::from_static("upstash-caller-ip"),
        hv(&data.caller_ip),
    );
    if let Some(region) = &shared.region_header {
        headers.insert(HeaderName::from_static("upstash-region"), region.clone());
    }
    let request_headers = headers.clone();

    let mut record = AttemptRec {
        seq: 0,
        data: job.data.clone(),
        at_unix_ms,
        offset: started.saturating_duration_since(shared.started),
        retried: job.retried,
        status: None,
        error: None,
        headers: request_headers,
        duration: Duration::ZERO,
        planned_delay: job.planned_delay,
        duplicate: job.duplicate,
    };

    let mut outcome = Outcome::default();
    let faulty = shared.delivery_faults_active();
    // Which try: the attempt number, and whether this is an injected duplicate of it (0114).
    let n = (u64::from(job.retried) << 1) | u64::from(job.duplicate);
    let (net_fault, lost_fault) = (
        faulty && shared.draw_delivery(FaultKind::DeliveryNetworkError, data.fault_id, n),
        faulty && shared.draw_delivery(FaultKind::DeliveryLostResponse, data.fault_id, n),
    );
    if net_fault {
        outcome.error = Some("injected fault: network error (request not sent)".into());
    } else {
        match send(shared, client, job, headers).await {
            Ok((status, resp_headers, body)) => {
                outcome.status = Some(status);
                outcome.retry_after = retry_after(&resp_headers);
                let nr = resp_headers
                    .get("upstash-nonretryable-error")
                    .and_then(|v| v.to_str().ok())
                    .is_some_and(|v| v.trim().eq_ignore_ascii_case("true"));
                let failed = !(200..300).contains(&status);
                outcome.non_retryable = failed
                    && nr
                    && match shared.cfg.non_retryable {
                        NonRetryableMode::Require489 => status == 489,
                        NonRetryableMode::HeaderAlone => true,
                    };
                outcome.headers = resp_headers;
                outcome.body = body;
                if lost_fault {
                    outcome.error = Some(format!(
                        "injected fault: response lost (destination answered {status})"
                    ));
                    outcome.retry_after = None;
                    outcome.non_retryable = false;
                }
            }
            Err(e) => outcome.error = Some(e),
        }
    }
    record.status = outcome.status;
    record.error = outcome.error.clone();
    record.duration = started.elapsed();
    (outcome, Some(record))
}

fn retry_after(h: &HeaderMap) -> Option<Duration> {
    let now = SystemTime::now();
    for name in [
        "retry-after",
        "x-ratelimit-reset",
        "x-ratelimit-reset-requests",
        "x-ratelimit-reset-tokens",
    ] {
        if let Some(v) = h.get(name).and_then(|v| v.to_str().ok())
            && let Some(d) = parse_retry_after(v, now)
            && d <= RETRY_AFTER_MAX
        {
            return Some(d);
        }
    }
    None
}

async fn send(
    shared: &Shared,
    client: &HttpClient,
    job: &Job,
    headers: HeaderMap,
) -> Result<(u16, HeaderMap, Bytes), String> {
    let data = &job.data;
    let uri: Uri = data
        .url
        .parse()
        .map_err(|e| format!("invalid destination URL {:?}: {e}", data.url))?;
    match uri.scheme_str() {
        Some("http") => {}
        Some("https") => {
            return Err(
                "https destinations are not supported by qstash-dev (plain http only)".into(),
            );
        }
        _ => return Err(format!("unsupported destination URL {:?}", data.url)),
    }
    let mut req = Request::builder()
        .method(data.method.clone())
        .uri(uri)
        .body(Full::new(data.body.clone()))
        .map_err(|e| format!("cannot build request: {e}"))?;
    *req.headers_mut() = headers;
    let timeout = data
        .timeout
        .map(|t| t.min(shared.cfg.max_timeout))
        .unwrap_or(shared.cfg.max_timeout);
    let cap = shared.cfg.max_response_body_bytes;
    let fut = async {
        let resp = client.request(req).await.map_err(|e| error_chain(&e))?;
        let (parts, mut body) = resp.into_parts();
        let mut buf = BytesMut::new();
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|e| format!("reading response body: {}", error_chain(&e)))?;
            if let Ok(chunk) = frame.into_data() {
                let room = cap.saturating_sub(buf.len());
                buf.extend_from_slice(&chunk[..chunk.len().min(room)]);
                if buf.len() >= cap {
                    break;
                }
            }
        }
        Ok::<_, String>((parts.status.as_u16(), parts.headers, buf.freeze()))
    };
    match tokio::time::timeout(timeout, fut).await {
        Ok(r) => r,
        Err(_) => Err(format!("timeout: no complete response within {timeout:?}")),
    }
}
