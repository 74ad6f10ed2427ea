//! Per-subscriber trust for callbacks received at the endpoint ([`crate::subscriber_keys`]): QStash's signing keys
//! are per account, so whoever runs one subscriber's consumer can sign a callback. When subscribers have keys, a
//! callback about a copy is believed only when the original URL carries the copy's subscriber's signature over the
//! original body, and the copies it names are that subscriber's. What the relay's reconciler reads from QStash's
//! DLQ itself (with its token, over TLS) needs no such check.

use crate::contract;
use crate::ids::OutboxId;
use crate::receiver::ReceiverState;
use crate::subscriber_keys::signature_of_query;

use super::outcome::CallbackOutcome;
use super::parse::CallbackBody;

/// The check above for a callback naming the copies `ids`; `Ok` when no subscriber has a key (nothing to check).
pub(super) async fn check_subscriber(
    state: &ReceiverState,
    callback: &CallbackBody,
    ids: &[OutboxId],
) -> Result<(), CallbackOutcome> {
    let keys = &state.subscriber_keys;
    if keys.is_empty() {
        return Ok(());
    }
    let body = callback.source_body.as_deref().unwrap_or_default();
    // The subscriber the signed envelope names (none: the default one, and every message of the previous format).
    let subscriber = contract::parse_envelope(body)
        .ok()
        .and_then(|env| env.subscriber)
        .unwrap_or_default();
    let query = callback
        .url
        .as_deref()
        .and_then(|u| u.split('#').next())
        .and_then(|u| u.split_once('?'))
        .map(|(_, q)| q);
    let sig = signature_of_query(query).map_err(CallbackOutcome::Tampered)?;
    if let Err(problem) = keys.check(&subscriber, body, sig) {
        return Err(CallbackOutcome::Tampered(format!(
            "callback about a message of subscriber {:?}, which has a key: {problem} (a callback forged with \
             QStash's keys, or a message published before the relay had the key: QStash's DLQ keeps it, and the \
             relay's reconciler records it from there)",
            crate::subscriber_keys::display_name(&subscriber)
        )));
    }
    if ids.is_empty() {
        return Ok(());
    }
    let q = state
        .db
        .query_scalar(crate::schema::q(
            "SELECT id FROM {schema}.outbox WHERE id = ANY ($1::bigint[]) AND subscriber <> $2 LIMIT 1",
        ))
        .bind(ids)
        .bind(&subscriber);
    let other: Option<OutboxId> = match state.db.run(async |c| q.fetch_optional(c).await).await {
        Ok(o) => o,
        Err(e) => {
            return Err(CallbackOutcome::Database(format!(
                "could not read the copies' subscribers: {e}"
            )));
        }
    };
    match other {
        None => Ok(()),
        Some(id) => Err(CallbackOutcome::Tampered(format!(
            "callback signed for subscriber {:?} names outbox row {id}, a copy of another subscriber: refused",
            crate::subscriber_keys::display_name(&subscriber)
        ))),
    }
}
