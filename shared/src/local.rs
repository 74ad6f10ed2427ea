//! Serving a Lambda HTTP handler on a local port, exactly as a function URL would call it (feature `local`):
//! each HTTP request is turned into the function-URL event JSON (API Gateway v2 payload: `rawPath`,
//! `rawQueryString`, lower-case `headers`, `requestContext`, `body` as text or base64) and parsed by
//! `lambda_http`'s own deserializer — the same code path as in Lambda — before the handler runs. Used by the local
//! pipeline (`outbox-dev dev`) and the whole-system tests.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use axum::body::{Body as AxumBody, to_bytes};
use axum::http::{HeaderMap, Method, StatusCode, Uri};
use axum::response::Response as AxumResponse;
use base64::Engine;
use lambda_http::{Body, Request, Response};
use serde_json::{Map, Value, json};

/// Largest request body the adapter accepts (function URLs accept 6 MB).
pub(crate) const MAX_REQUEST_BYTES: usize = 6 * 1024 * 1024;

static REQUEST_IDS: AtomicU64 = AtomicU64::new(1);

fn is_text(content_type: Option<&str>) -> bool {
    let Some(ct) = content_type else { return true };
    let ct = ct.to_ascii_lowercase();
    ct.starts_with("text/")
        || ct.starts_with("application/json")
        || ct.contains("+json")
        || ct.starts_with("application/xml")
        || ct.starts_with("application/x-www-form-urlencoded")
}

/// The function-URL event for an HTTP request (what AWS would send to the function).
pub fn function_url_event(
    method: &Method,
    uri: &Uri,
    headers: &HeaderMap,
    body: &[u8],
    source_ip: &str,
) -> Value {
    let mut hs = Map::new();
    for (name, value) in headers {
        let v = String::from_utf8_lossy(value.as_bytes()).into_owned();
        match hs.get_mut(name.as_str()) {
            Some(Value::String(existing)) => {
                existing.push(',');
                existing.push_str(&v);
            }
            _ => {
                hs.insert(name.as_str().to_owned(), Value::String(v));
            }
        }
    }
    let host = headers
        .get("host")
        .and_then(|h| h.to_str().ok())
        .unwrap_or("localhost")
        .to_owned();
    let content_type = headers.get("content-type").and_then(|h| h.to_str().ok());
    let (body_value, b64) = match (is_text(content_type), std::str::from_utf8(body)) {
        (_, _) if body.is_empty() => (Value::Null, false),
        (true, Ok(text)) => (Value::String(text.to_owned()), false),
        _ => (
            Value::String(base64::engine::general_purpose::STANDARD.encode(body)),
            true,
        ),
    };
    let now = chrono::Utc::now();
    let id = REQUEST_IDS.fetch_add(1, Ordering::Relaxed);
    json!({
        "version": "2.0",
        "routeKey": "$default",
        "rawPath": uri.path(),
        "rawQueryString": uri.query().unwrap_or(""),
        "headers": hs,
        "requestContext": {
            "accountId": "anonymous",
            "apiId": "local",
            "domainName": host,
            "domainPrefix": host.split('.').next().unwrap_or("local"),
            "http": {
                "method": method.as_str(),
                "path": uri.path(),
                "protocol": "HTTP/1.1",
                "sourceIp": source_ip,
                "userAgent": headers.get("user-agent").and_then(|h| h.to_str().ok()).unwrap_or(""),
            },
            "requestId": format!("local-{id}"),
            "routeKey": "$default",
            "stage": "$default",
            "time": now.format("%d/%b/%Y:%H:%M:%S %z").to_string(),
            "timeEpoch": now.timestamp_millis(),
        },
        "body": body_value,
        "isBase64Encoded": b64,
    })
}

/// Why an HTTP request could not become the Lambda request a function URL would have produced.
#[derive(Debug, thiserror::Error)]
pub enum AdapterError {
    /// `lambda_http` refused the event.
    #[error("could not build the Lambda event: {0}")]
    Refused(String),
    /// `lambda_http` panicked on the event (it does on some header values a client can send, such as a
    /// list-valued `X-Forwarded-Proto`); the request is answered 400 instead of taking the listener down.
    #[error("could not build the Lambda event: lambda_http cannot represent this request ({0})")]
    Panicked(String),
}

/// The request `lambda_http` gives a handler for this HTTP request in a function-URL Lambda: the event JSON of
/// [`function_url_event`], parsed by `lambda_http::request::from_str`.
pub fn lambda_request(
    method: &Method,
    uri: &Uri,
    headers: &HeaderMap,
    body: &[u8],
    source_ip: &str,
) -> Result<Request, AdapterError> {
    let event = function_url_event(method, uri, headers, body, source_ip).to_string();
    match std::panic::catch_unwind(|| lambda_http::request::from_str(&event)) {
        Ok(Ok(request)) => Ok(request),
        Ok(Err(e)) => Err(AdapterError::Refused(e.to_string())),
        Err(panic) => {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| (*s).to_owned())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "panic".into());
            Err(AdapterError::Panicked(what))
        }
    }
}

/// Converts the handler's response to an HTTP response (status, headers, body bytes).
pub(crate) fn into_http(resp: Response<Body>) -> AxumResponse {
    let (parts, body) = resp.into_parts();
    let bytes: Vec<u8> = match body {
        Body::Empty => Vec::new(),
        Body::Text(t) => t.into_bytes(),
        Body::Binary(b) => b,
        _ => Vec::new(),
    };
    let mut out = AxumResponse::new(AxumBody::from(bytes));
    *out.status_mut() = parts.status;
    *out.headers_mut() = parts.headers;
    out
}

/// Serves `handler` on `listener` until `shutdown` resolves. Every request goes through the function-URL event
/// JSON and `lambda_http::request::from_str`.
pub async fn serve<H, Fut>(
    listener: tokio::net::TcpListener,
    handler: H,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()>
where
    H: Fn(Request) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Response<Body>> + Send + 'static,
{
    let handler = Arc::new(handler);
    let app = axum::Router::new().fallback(
        move |axum::extract::ConnectInfo(peer): axum::extract::ConnectInfo<SocketAddr>,
              req: axum::extract::Request| {
            let handler = handler.clone();
            async move {
                let (parts, body) = req.into_parts();
                let bytes = match to_bytes(body, MAX_REQUEST_BYTES).await {
                    Ok(b) => b,
                    Err(_) => {
                        let mut r = AxumResponse::new(AxumBody::from(
                            "{\"error\":\"request body too large or unreadable\"}",
                        ));
                        *r.status_mut() = StatusCode::PAYLOAD_TOO_LARGE;
                        return r;
                    }
                };
                match lambda_request(
                    &parts.method,
                    &parts.uri,
                    &parts.headers,
                    &bytes,
                    &peer.ip().to_string(),
                ) {
                    Ok(request) => into_http(handler(request).await),
                    Err(e) => {
                        let body = serde_json::json!({ "error": e.to_string() }).to_string();
                        let mut r = AxumResponse::new(AxumBody::from(body));
                        *r.status_mut() = StatusCode::BAD_REQUEST;
                        r
                    }
                }
            }
        },
    );
    axum::serve(
        listener,
        app.into_make_service_with_connect_info::<SocketAddr>(),
    )
    .with_graceful_shutdown(shutdown)
    .await
}

#[cfg(test)]
mod tests {
    use super::*;
    use lambda_http::RequestExt;

    #[test]
    fn event_round_trips_through_lambda_http() {
        let mut headers = HeaderMap::new();
        headers.insert("host", "127.0.0.1:9000".parse().unwrap());
        headers.insert("content-type", "application/json".parse().unwrap());
        headers.insert("Upstash-Signature", "tok".parse().unwrap());
        let uri: Uri = "/events/invoices?x=1&y=a%20b".parse().unwrap();
        let body = br#"{"a": 1}"#;
        let ev = function_url_event(&Method::POST, &uri, &headers, body, "127.0.0.1");
        let req = lambda_http::request::from_str(&ev.to_string()).unwrap();
        assert_eq!(req.body().as_ref(), body);
        assert_eq!(req.raw_http_path(), "/events/invoices");
        assert_eq!(req.uri().query(), Some("x=1&y=a%20b"));
        assert_eq!(req.headers().get("upstash-signature").unwrap(), "tok");
        assert_eq!(req.uri().host(), Some("127.0.0.1"));

        // Non-UTF-8 bytes travel base64-encoded and come back byte for byte.
        headers.insert("content-type", "application/octet-stream".parse().unwrap());
        let raw = [0xffu8, 0x00, 0x10, 0xfe];
        let ev = function_url_event(&Method::POST, &uri, &headers, &raw, "127.0.0.1");
        assert_eq!(ev["isBase64Encoded"], true);
        let req = lambda_http::request::from_str(&ev.to_string()).unwrap();
        assert_eq!(req.body().as_ref(), raw);
    }

    /// Found by the `function_url` fuzz target: `lambda_http` panics on a list-valued `X-Forwarded-Proto`. The
    /// adapter turns that into an error (answered 400), not a panic.
    #[test]
    fn a_request_lambda_http_panics_on_is_an_error() {
        let mut headers = HeaderMap::new();
        headers.insert("host", "a.example".parse().unwrap());
        headers.append("x-forwarded-proto", "https, http".parse().unwrap());
        headers.append("x-forwarded-proto", "http".parse().unwrap());
        let uri: Uri = "/events/orders?contract=2".parse().unwrap();
        let r = lambda_request(&Method::POST, &uri, &headers, b"{}", "127.0.0.1");
        assert!(matches!(r, Err(AdapterError::Panicked(_))), "{r:?}");
    }
}
