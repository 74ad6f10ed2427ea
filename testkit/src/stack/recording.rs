//! The requests the local receivers got, kept when asked for ([`RecordedRequest`]): each copied as it arrived,
//! before its handler consumes it, with the status the receiver answered.

use std::sync::Arc;

/// Which local receiver got a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Receiver {
    /// The consumer (`{consumer_url}/events/{topic}`).
    Consumer,
    /// The callback receiver (`{callback_url}/failure`, `/delivered`).
    Callbacks,
}

/// A request a local receiver got, as it arrived, and the status it answered ([`StackOptions::record_requests`]).
///
/// [`StackOptions::record_requests`]: crate::stack::StackOptions::record_requests
#[derive(Debug, Clone)]
pub struct RecordedRequest {
    pub receiver: Receiver,
    /// HTTP method.
    pub method: String,
    /// Path and query as requested (e.g. `/events/orders?contract=2`).
    pub path_and_query: String,
    /// Request headers (lower-case names), in order.
    pub headers: Vec<(String, String)>,
    /// The body, byte for byte.
    pub body: Vec<u8>,
    /// The status the receiver answered.
    pub status: u16,
}

impl RecordedRequest {
    /// A request header by (case-insensitive) name.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

pub(super) type Recorder = Arc<std::sync::Mutex<Vec<RecordedRequest>>>;

/// Copies what [`RecordedRequest`] keeps of a request (before the handler consumes it).
fn snapshot(receiver: Receiver, req: &lambda_http::Request) -> RecordedRequest {
    RecordedRequest {
        receiver,
        method: req.method().to_string(),
        path_and_query: req
            .uri()
            .path_and_query()
            .map_or_else(|| req.uri().path().to_owned(), |p| p.as_str().to_owned()),
        headers: req
            .headers()
            .iter()
            .map(|(k, v)| {
                (
                    k.as_str().to_owned(),
                    String::from_utf8_lossy(v.as_bytes()).into_owned(),
                )
            })
            .collect(),
        body: req.body().as_ref().to_vec(),
        status: 0,
    }
}

/// Runs `handle`, recording the request and its status when `recorder` is set.
pub(super) async fn recorded<F>(
    recorder: Option<&Recorder>,
    receiver: Receiver,
    req: lambda_http::Request,
    handle: impl FnOnce(lambda_http::Request) -> F,
) -> lambda_http::Response<lambda_http::Body>
where
    F: std::future::Future<Output = lambda_http::Response<lambda_http::Body>>,
{
    let Some(recorder) = recorder else {
        return handle(req).await;
    };
    let mut copy = snapshot(receiver, &req);
    let response = handle(req).await;
    copy.status = response.status().as_u16();
    if let Ok(mut r) = recorder.lock() {
        r.push(copy);
    }
    response
}
