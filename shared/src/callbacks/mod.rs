//! The callback function (`functions/failure-callback`): QStash calls it
//!
//! * at `{CALLBACK_URL}/failure` once it gives up on a message (retries exhausted, or the consumer answered 489):
//!   the body describes the message; it becomes a row in `dead_letters` ([`crate::dead_letters`]), linked to the
//!   outbox event named in the signed body ([`source_event`]) — **guarantee 4, nothing fails silently**;
//! * at `{CALLBACK_URL}/delivered` after every delivery attempt of an ordered event (`Upstash-Callback`): a 2xx
//!   status is the delivery evidence that lets the relay publish the key's next event
//!   ([`crate::ordering::record_delivery`]); another status is noted on the event
//!   ([`crate::ordering::record_failed_attempt`]).
//!
//! Both are signed like any delivery (`sub` = the callback URL) and verified first. Any other path is 404.
//!
//! The body is parsed leniently ([`parse_callback`]): `body`/`sourceBody` are standard base64 (missing padding
//! and the URL-safe alphabet tolerated), `header`/`sourceHeader` are maps of string arrays **or** strings,
//! `notBefore`/`createdAt`/`status`/`retried`/`maxRetries` are numbers **or** numeric strings, and any field may
//! be missing.
//!
//! | case | status |
//! |---|---|
//! | failure callback recorded (or already recorded: idempotent on `dlqId`) | 200 |
//! | failure callback of a batched message: applied events delivered, one dead letter per failed event (`<dlqId>/<outbox id>`), unordered leftovers due again ([`crate::dead_letters::record_qstash_batch_failure`], decision record 0027) | 200 |
//! | delivery callback of a batched message: evidence for all its events in one statement ([`crate::ordering::record_delivery_batch`]) | 200 |
//! | failure callback whose body cannot be parsed | 200 — stored raw with the parse error, never dropped |
//! | delivery evidence / failed attempt recorded (or the event is unknown) | 200 |
//! | delivery callback whose body cannot be parsed, or without status / an outbox id in its signed body | 489 + `Upstash-NonRetryable-Error` (safe: the relay republishes the head after `RELAY_EVIDENCE_TIMEOUT_SECS`) |
//! | bad or missing signature | 401 |
//! | a subscriber with a key, and the original URL lacks its signature over the original body, or the callback names another subscriber's copies ([`crate::subscriber_keys`]) | 401 (QStash keeps the message in its DLQ; the reconciler records it from there) |
//! | an `x-outbox-id` header that disagrees with the signed body (the request was altered) | 401 |
//! | body over `CALLBACK_MAX_BODY_BYTES` | 413 |
//! | unknown path | 404 |
//! | database error | 503 (QStash retries the callback) |
//!
//! | file | what |
//! |---|---|
//! | `mod.rs` | [`handle_callback`]: size cap, signature, route; the `x-outbox-id` copy check both kinds share |
//! | `parse.rs` | reading the body: [`parse_callback`], [`source_event`], [`source_events`] |
//! | `failure.rs` | `/failure` → dead letters ([`failure_from_callback`]; [`FailureRecorder`], shared with the reconciler) |
//! | `delivered.rs` | `/delivered` → delivery evidence or a failed attempt ([`attempt_description`]) |
//! | `trust.rs` | per-subscriber trust: a callback about a subscriber's copy is believed only with its signature ([`crate::subscriber_keys`]) |
//! | `outcome.rs` | how a request ended → status, body, log line and EMF record (the table above, one variant a row) |

mod checks;
mod delivered;
mod failure;
mod outcome;
mod parse;
mod trust;

use http::Method;
use lambda_http::{Body, Request, Response};
use tracing::field::Empty;

use crate::contract;
use crate::receiver::ReceiverState;
use crate::receiver::http::{request_path, respond};
use crate::receiver::verify_request;

use checks::{check_id_copy, check_ids_copy};
use delivered::delivered;
use failure::failure;
pub(crate) use failure::{FailureRecorder, record_failure};

pub(crate) use outcome::CallbackOutcome;

pub(crate) use checks::{ATTEMPT_BODY_CHARS, MAX_RESPONSE_BODY_CHARS};

#[cfg_attr(not(feature = "internals"), allow(unused_imports))] // for `crate::internals`
pub use parse::{CallbackBody, ParsedCallback, SourceEvent};
#[cfg_attr(not(feature = "internals"), allow(unused_imports))] // for `crate::internals`
pub use parse::{parse_callback, source_event, source_header};

/// Which callback a path is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CallbackKind {
    /// `/failure`.
    Failure,
    /// `/delivered`.
    Delivered,
}

/// The callback kind of a path (a prefix in front is allowed), `None` for any other path.
pub(crate) fn callback_kind(path: &str) -> Option<CallbackKind> {
    let path = path.trim_end_matches('/');
    if path.ends_with(contract::FAILURE_PATH) {
        Some(CallbackKind::Failure)
    } else if path.ends_with(contract::DELIVERED_PATH) {
        Some(CallbackKind::Delivered)
    } else {
        None
    }
}

/// The callback function: `POST /failure` and `POST /delivered` from QStash. Never fails: every error is an
/// HTTP status (see the module table). Logs one line and prints one EMF record per request.
pub async fn handle_callback(state: &ReceiverState, req: Request) -> Response<Body> {
    let span = tracing::info_span!(
        "callback",
        kind = Empty,
        outbox_id = Empty,
        topic = Empty,
        key = Empty,
        message_id = Empty,
        dlq_id = Empty,
        consumer_status = Empty,
        retried = Empty,
    );
    respond(span, state.emit_metrics, process(state, &req)).await
}

async fn process(state: &ReceiverState, req: &Request) -> CallbackOutcome {
    let span = tracing::Span::current();
    let raw: &[u8] = req.body().as_ref();
    if raw.len() > state.config.callback_max_body_bytes {
        return CallbackOutcome::TooLarge {
            size: raw.len(),
            max: state.config.callback_max_body_bytes,
        };
    }
    if let Err(e) =
        verify_request(&state.keys, req, state.url_source(), state.verify_options()).await
    {
        return CallbackOutcome::Unauthorized(e);
    }
    let path = request_path(req);
    let kind = match (req.method(), callback_kind(path)) {
        (&Method::POST, Some(kind)) => kind,
        _ => {
            return CallbackOutcome::NotFound(format!(
                "no route for {} {:?}: callbacks are POST /failure and POST /delivered",
                req.method(),
                path.chars().take(200).collect::<String>()
            ));
        }
    };
    span.record("kind", format!("{kind:?}").to_ascii_lowercase());
    match kind {
        CallbackKind::Failure => failure(state, req, raw).await,
        CallbackKind::Delivered => delivered(state, req, raw).await,
    }
}
