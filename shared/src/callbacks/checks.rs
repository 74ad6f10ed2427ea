//! What both callbacks check and keep alike: the `x-outbox-id` copy against the signed body, and how much of a
//! response body is kept.

use lambda_http::Request;

use crate::contract;
use crate::ids::OutboxId;

/// Longest response body kept in a dead letter or an attempt description.
pub const MAX_RESPONSE_BODY_CHARS: usize = 65_536;
/// How much of the response body goes into a failed attempt's description.
pub const ATTEMPT_BODY_CHARS: usize = 500;

/// Refuses a callback request whose `x-outbox-id` header (relays before the signed contract forwarded one)
/// disagrees with the outbox id of its signed body. When the signed body names no event (a garbage or truncated
/// failure callback) the header is ignored, never used: the callback is still stored, unlinked.
pub(super) fn check_id_copy(req: &Request, signed: Option<OutboxId>) -> Result<(), String> {
    check_ids_copy(req, &signed.into_iter().collect::<Vec<_>>())
}

/// [`check_id_copy`] for a message of several events: the copy is their ids joined by `,` (decision record 0027).
pub(super) fn check_ids_copy(req: &Request, signed: &[OutboxId]) -> Result<(), String> {
    let Some(copy) = req.headers().get(contract::OUTBOX_ID) else {
        return Ok(());
    };
    if signed.is_empty() {
        return Ok(());
    }
    let copy = copy.to_str().unwrap_or("(not visible ASCII)").trim();
    let signed = contract::id_copy(signed.iter().copied());
    if signed == copy {
        Ok(())
    } else {
        Err(format!(
            "header x-outbox-id is {:?} but the signed callback body names event(s) {signed}: the request was \
             altered after QStash signed it",
            copy.chars().take(40).collect::<String>(),
        ))
    }
}
