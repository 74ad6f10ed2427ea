//! What a delivery says about its event, read from signed data only: the envelope of a current delivery
//! ([`current_delivery`]), or, for a delivery in the previous wire format, the outbox row its unsigned
//! `x-outbox-id` names, checked against the signed body ([`legacy_delivery`]). Header copies that disagree with
//! the signed values are an altered request ([`Outcome::Tampered`]).

use std::time::Duration;

use chrono::{DateTime, Utc};
use lambda_http::Request;
use sqlx::Row;
use sqlx::postgres::PgRow;

use super::outcome::Outcome;
use super::registry::{DEFAULT_SCHEMA_VERSION, EventMeta};
use crate::config::LegacyDeliveries;
use crate::contract::{self, legacy};
use crate::ids::{OutboxId, PartitionKey, TopicName};
use crate::receiver::ReceiverState;
use crate::subscriber_keys::{SignatureProblem, signature_of_query};

fn header<'r>(req: &'r Request, name: &'static str) -> Result<Option<&'r str>, String> {
    match req.headers().get(name) {
        None => Ok(None),
        Some(v) => v
            .to_str()
            .map(|s| Some(s.trim()).filter(|s| !s.is_empty()))
            .map_err(|_| format!("header {name} is not visible ASCII")),
    }
}

/// What a delivery says about its event: from signed data only (or, for a delivery in the previous format,
/// checked against the outbox row).
pub(super) struct Delivery<'b> {
    pub(super) meta: EventMeta,
    /// The payload bytes the handler decodes.
    pub(super) payload: &'b [u8],
    /// Record the delivery evidence of this ordered event in the applying transaction (and on a duplicate).
    pub(super) record_evidence: bool,
    /// The relay sent this copy again on purpose (the envelope's `resent`; tracing only).
    pub(super) resent: bool,
}

/// QStash's own informational headers (never used to decide a write).
fn qstash_info(req: &Request) -> (Option<String>, u32) {
    let message_id = header(req, "upstash-message-id")
        .ok()
        .flatten()
        .map(str::to_owned);
    let retried = header(req, "upstash-retried")
        .ok()
        .flatten()
        .and_then(|r| r.parse().ok())
        .unwrap_or(0);
    (message_id, retried)
}

/// A header copy that disagrees with the signed value: the request was altered after QStash signed it.
fn check_copy(
    req: &Request,
    name: &'static str,
    signed: Option<&str>,
    same: impl Fn(&str, &str) -> bool,
) -> Result<(), Outcome> {
    let Some(copy) = header(req, name).map_err(Outcome::Tampered)? else {
        return Ok(());
    };
    match signed {
        Some(s) if same(copy, s) => Ok(()),
        _ => Err(Outcome::Tampered(format!(
            "header {name} is {:?} but the signed delivery says {:?}: the request was altered after QStash \
             signed it",
            copy.chars().take(100).collect::<String>(),
            signed.map(|s| s.chars().take(100).collect::<String>())
        ))),
    }
}

/// Per-subscriber trust ([`crate::subscriber_keys`]): a consumer with its own subscriber key accepts a delivery
/// only with the relay's signature made with it (the destination's `sig`, covered by QStash's `sub`). None is
/// permanent: the message can never gain one (give the relay the key, then redrive). One that this consumer's keys
/// did not make is an altered or forged request: a delivery meant for another subscriber, or signed by someone
/// holding QStash's keys but not this subscriber's.
pub(super) fn check_own_key(receiver: &ReceiverState, req: &Request) -> Result<(), Outcome> {
    let Some(key) = &receiver.own_key else {
        return Ok(());
    };
    let sig = signature_of_query(req.uri().query()).map_err(Outcome::Tampered)?;
    match key.check(req.body().as_ref(), sig) {
        Ok(()) => Ok(()),
        Err(SignatureProblem::Missing) => Err(Outcome::Permanent(
            "this consumer accepts only deliveries signed with its subscriber key (SUBSCRIBER_CURRENT_SIGNING_KEY is set), \
             and this one carries no subscriber signature: give the relay this subscriber's key in \
             SUBSCRIBER_SIGNING_KEYS, then redrive the dead letter"
                .into(),
        )),
        Err(SignatureProblem::Mismatch) => Err(Outcome::Tampered(
            "the delivery's subscriber signature was not made with this consumer's SUBSCRIBER_CURRENT_SIGNING_KEY (or \
             SUBSCRIBER_NEXT_SIGNING_KEY): a delivery meant for another subscriber, a forged one, or a relay holding \
             another key for this subscriber"
                .into(),
        )),
    }
}

/// A current (contract 2) delivery: everything from the signed envelope, one [`Delivery`] per event in envelope
/// order (a batch holds several, decision record 0027); header copies must agree with it. The `x-outbox-id` copy of
/// a batch is its ids joined by `,`; the per-event copies of the previous format (key, sequence, schema version)
/// have no single value in a batch, so a batch that carries one is refused.
pub(super) fn current_delivery<'b>(
    req: &'b Request,
    topic: &str,
    consumer_name: &str,
) -> Result<Vec<Delivery<'b>>, Outcome> {
    let env = contract::parse_envelope(req.body().as_ref()).map_err(Outcome::Permanent)?;
    check_addressee(&env, topic, consumer_name)?;
    check_current_copies(req, topic, &env)?;
    let (message_id, retried) = qstash_info(req);
    let consumer_evidence = env.evidence == Some(contract::Evidence::Consumer);
    Ok(env
        .events
        .iter()
        .map(|ev| Delivery {
            meta: event_meta(ev, topic, message_id.as_deref(), retried),
            payload: ev.payload.get().as_bytes(),
            record_evidence: ev.seq.is_some() && consumer_evidence,
            resent: ev.resent,
        })
        .collect())
}

/// The envelope is for this URL's topic, and (a named subscriber's copy) for this consumer's `CONSUMER_NAME`.
fn check_addressee(
    env: &contract::Envelope<'_>,
    topic: &str,
    consumer_name: &str,
) -> Result<(), Outcome> {
    if env.topic != topic {
        return Err(Outcome::Permanent(format!(
            "the envelope's topic {:?} differs from the URL's topic {topic:?}",
            env.topic.chars().take(100).collect::<String>()
        )));
    }
    // A named subscriber's copy applied under another name would be deduped in that subscriber's namespace: the
    // relay would never find its dedupe row, and the two subscribers' once-only checks would mix.
    if let Some(s) = env.subscriber.as_deref()
        && s != consumer_name
    {
        return Err(Outcome::Permanent(format!(
            "this delivery is subscriber {:?}'s copy, but this consumer's CONSUMER_NAME is {consumer_name:?}: \
             deploy it with CONSUMER_NAME={:?}, or point the subscriber at its own consumer (`outbox subscribers \
             list`), then redrive its dead letters",
            s.chars().take(100).collect::<String>(),
            s.chars().take(100).collect::<String>(),
        )));
    }
    Ok(())
}

/// The header copies of a current delivery agree with its signed envelope.
fn check_current_copies(
    req: &Request,
    topic: &str,
    env: &contract::Envelope<'_>,
) -> Result<(), Outcome> {
    let single = match env.events.as_slice() {
        [ev] => Some(ev),
        _ => None,
    };
    let evidence = env.evidence.map(contract::Evidence::as_str);
    let eq = |a: &str, b: &str| a == b;
    let ids = contract::id_copy(env.events.iter().map(|e| e.id));
    check_copy(req, legacy::OUTBOX_ID, Some(&ids), eq)?;
    check_copy(req, legacy::OUTBOX_TOPIC, Some(topic), eq)?;
    check_copy(
        req,
        legacy::OUTBOX_KEY,
        single.map(|e| e.key.as_str()),
        |copy, key| contract::decode_key(copy).as_deref() == Some(key),
    )?;
    check_copy(
        req,
        legacy::OUTBOX_SEQ,
        single.and_then(|e| e.seq).map(|s| s.to_string()).as_deref(),
        eq,
    )?;
    check_copy(req, legacy::OUTBOX_EVIDENCE, evidence, eq)?;
    check_copy(
        req,
        legacy::SCHEMA_VERSION,
        single
            .map(|e| {
                e.schema_version
                    .unwrap_or(DEFAULT_SCHEMA_VERSION)
                    .to_string()
            })
            .as_deref(),
        eq,
    )?;
    Ok(())
}

/// What the envelope says about one of its events, with QStash's message id and retry count.
fn event_meta(
    ev: &contract::EnvelopeEvent<'_>,
    topic: &str,
    message_id: Option<&str>,
    retried: u32,
) -> EventMeta {
    EventMeta {
        event_id: ev.event.unwrap_or(ev.id),
        outbox_id: ev.id,
        topic: TopicName::from(topic),
        key: Some(ev.key.clone()),
        seq: ev.seq,
        schema_version: ev.schema_version.unwrap_or(DEFAULT_SCHEMA_VERSION),
        created_at: ev.created_at,
        traceparent: ev.headers.get(contract::TRACEPARENT).cloned(),
        correlation_id: ev.headers.get(contract::CORRELATION_ID).cloned(),
        fairness_key: ev.headers.get(contract::FAIRNESS_KEY).cloned(),
        headers: crate::headers::user_headers_of(&ev.headers),
        message_id: message_id.map(str::to_owned),
        retried,
    }
}

/// The outbox row a legacy delivery names, checked against its body (`$2`), and whether the event may be applied
/// now: `predecessor_finished` is true for an unordered event, and for an ordered one whose predecessor
/// (`seq - 1`) this consumer (`$3`) has applied (`consumer_sequences`; sequence 1 has none) or whose key has
/// moved past that predecessor (`outbox_keys.done_seq`: delivered, or skipped by the dead-head policy). Only the
/// default subscriber's first copy of an event can be named: a relay of the previous format wrote no other, so an
/// id naming a named subscriber's copy (or a replayed one) is not a genuine legacy delivery.
const LEGACY_ROW_SQL: &str = "SELECT o.topic, o.partition_key, o.seq, o.headers, o.created_at, \
        o.payload = $2::jsonb AS same_payload, o.dispatched_at IS NOT NULL AS dispatched, \
        (o.seq IS NULL \
         OR coalesce((SELECT c.last_seq FROM {schema}.consumer_sequences c \
                      WHERE c.consumer = $3 AND c.topic = o.topic AND c.partition_key = o.partition_key), 0) \
            >= o.seq - 1 \
         OR EXISTS (SELECT 1 FROM {schema}.outbox_keys k \
                    WHERE k.topic = o.topic AND k.partition_key = o.partition_key \
                      AND k.subscriber = o.subscriber AND k.done_seq >= o.seq - 1)) \
            AS predecessor_finished \
     FROM {schema}.outbox o WHERE o.id = $1 AND o.subscriber = '' AND o.event_id IS NULL";

/// A delivery in the previous format (no `contract` in its URL; published before the upgrade, QStash may still
/// hold it for days). Its identity is in unsigned headers, so it is applied only when the outbox row named by
/// `x-outbox-id` has the delivery's (signed) topic and payload and is marked dispatched, and, for an ordered event,
/// once its predecessor is finished (applied by this consumer, or its key moved past it); key, sequence and
/// metadata then come from the row, never from the headers. Ordered events record their evidence here (the row is in this database).
// Steps without an `.await` are functions of their own; the query stays here: each nested `async fn` deepens the
// handler future that callers of `handle_event` lay out, which is close to the compiler's default query depth.
pub(super) async fn legacy_delivery<'b>(
    receiver: &ReceiverState,
    req: &'b Request,
    topic: &str,
) -> Result<Delivery<'b>, Outcome> {
    if receiver.own_key.is_some() {
        return Err(Outcome::Permanent(
            "delivery in the previous wire format, which carries no subscriber signature, refused: this consumer \
             accepts only deliveries signed with its subscriber key (SUBSCRIBER_CURRENT_SIGNING_KEY); redrive the dead letter \
             to have it published again in the current format"
                .into(),
        ));
    }
    let outbox_id = legacy_outbox_id(receiver, req)?;
    let body = req.body().as_ref();
    if serde_json::from_slice::<serde::de::IgnoredAny>(body).is_err() {
        return Err(Outcome::Permanent(
            "delivery in the previous wire format whose body is not JSON: it cannot be an outbox payload".into(),
        ));
    }
    let q = receiver
        .db
        .query(crate::schema::q(LEGACY_ROW_SQL))
        .bind(outbox_id)
        .bind(std::str::from_utf8(body).unwrap_or_default())
        .bind(receiver.config.name.as_str());
    let row = receiver
        .db
        .run(async |c| q.fetch_optional(c).await)
        .await
        .map_err(legacy_query_error)?;
    let row = LegacyRow::read(row, outbox_id)?;
    row.check(outbox_id, topic)?;
    let LegacyRow {
        key,
        seq,
        headers,
        created_at,
        ..
    } = row;
    let schema_version = headers.schema_version.unwrap_or(DEFAULT_SCHEMA_VERSION);
    check_legacy_copies(req, topic, &key, seq, schema_version)?;
    tracing::info!(
        outbox_id = outbox_id.get(),
        "delivery in the previous wire format verified against the outbox row"
    );
    let (message_id, retried) = qstash_info(req);
    Ok(Delivery {
        meta: EventMeta {
            // A relay before fan-out wrote the default subscriber's only copy: the event itself.
            event_id: outbox_id,
            outbox_id,
            topic: TopicName::from(topic),
            key: Some(PartitionKey::from(key)),
            seq,
            schema_version,
            created_at: Some(created_at),
            traceparent: headers.traceparent,
            correlation_id: headers.correlation_id,
            // The previous relay knew no fairness keys.
            fairness_key: None,
            // The previous relay published no user headers (its producers could not set any).
            headers: Default::default(),
            message_id,
            retried,
        },
        payload: body,
        record_evidence: seq.is_some(),
        resent: false,
    })
}

/// A legacy delivery's header copies must agree with the outbox row's values.
fn check_legacy_copies(
    req: &Request,
    topic: &str,
    key: &str,
    seq: Option<i64>,
    schema_version: u32,
) -> Result<(), Outcome> {
    let eq = |a: &str, b: &str| a == b;
    check_copy(req, legacy::OUTBOX_TOPIC, Some(topic), eq)?;
    check_copy(req, legacy::OUTBOX_KEY, Some(key), |copy, key| {
        contract::decode_key(copy).as_deref() == Some(key)
    })?;
    check_copy(
        req,
        legacy::OUTBOX_SEQ,
        seq.map(|s| s.to_string()).as_deref(),
        eq,
    )?;
    check_copy(
        req,
        legacy::SCHEMA_VERSION,
        Some(&schema_version.to_string()),
        eq,
    )
}

/// The outbox id a legacy delivery's `x-outbox-id` names (unless `LEGACY_DELIVERIES=refuse`).
fn legacy_outbox_id(receiver: &ReceiverState, req: &Request) -> Result<OutboxId, Outcome> {
    if receiver.config.legacy_deliveries == LegacyDeliveries::Refuse {
        return Err(Outcome::Permanent(
            "delivery in the previous wire format (no contract version in its URL, identity in unsigned headers) \
             refused: LEGACY_DELIVERIES=refuse"
                .into(),
        ));
    }
    let id_text = header(req, legacy::OUTBOX_ID)
        .map_err(Outcome::Permanent)?
        .ok_or_else(|| {
            Outcome::Permanent(
                "delivery without a contract version in its URL and without x-outbox-id: not an outbox event"
                    .into(),
            )
        })?;
    id_text
        .parse::<i64>()
        .ok()
        .filter(|id| *id > 0)
        .map(OutboxId)
        .ok_or_else(|| {
            Outcome::Permanent(format!(
                "x-outbox-id {:?} is not a positive integer",
                id_text.chars().take(40).collect::<String>()
            ))
        })
}

/// A database error while verifying a legacy delivery: transient.
fn legacy_db_error(e: sqlx::Error) -> Outcome {
    Outcome::Transient {
        message: format!("database error while verifying a legacy delivery: {e}"),
        retry_after: None,
    }
}

/// The query of the outbox row failed: a body Postgres refuses as `jsonb`, or no outbox table here, is permanent;
/// anything else transient.
fn legacy_query_error(e: sqlx::Error) -> Outcome {
    match e.as_database_error().and_then(|d| d.code()) {
        Some(code) if code.starts_with("22") => Outcome::Permanent(format!(
            "delivery in the previous wire format whose body Postgres refuses as jsonb ({e}): it cannot be an \
             outbox payload"
        )),
        Some(code) if code == "42P01" => Outcome::Permanent(
            "a delivery in the previous wire format can only be verified against the outbox table, which is not \
             in this consumer's database"
                .into(),
        ),
        _ => legacy_db_error(e),
    }
}

/// The outbox row a legacy delivery names ([`LEGACY_ROW_SQL`]).
struct LegacyRow {
    topic: String,
    same_payload: bool,
    dispatched: bool,
    predecessor_finished: bool,
    key: String,
    seq: Option<i64>,
    headers: crate::producer::EventHeaders,
    created_at: DateTime<Utc>,
}

impl LegacyRow {
    /// The row as read; no row is a permanent refusal.
    fn read(row: Option<PgRow>, outbox_id: OutboxId) -> Result<LegacyRow, Outcome> {
        let Some(row) = row else {
            return Err(Outcome::Permanent(format!(
                "delivery in the previous wire format names outbox id {outbox_id}, which is not in the outbox as an \
                 event of the default subscriber (pruned, a copy made by fan-out, or the header was altered): \
                 refused"
            )));
        };
        let headers: Option<sqlx::types::Json<crate::producer::EventHeaders>> =
            row.try_get("headers").ok();
        Ok(LegacyRow {
            topic: row.try_get("topic").map_err(legacy_db_error)?,
            same_payload: row.try_get("same_payload").map_err(legacy_db_error)?,
            dispatched: row.try_get("dispatched").map_err(legacy_db_error)?,
            predecessor_finished: row
                .try_get("predecessor_finished")
                .map_err(legacy_db_error)?,
            key: row.try_get("partition_key").map_err(legacy_db_error)?,
            seq: row.try_get("seq").map_err(legacy_db_error)?,
            headers: headers.map(|h| h.0).unwrap_or_default(),
            created_at: row.try_get("created_at").map_err(legacy_db_error)?,
        })
    }

    /// Whether the delivery may be applied now as the row's event (the checks of [`legacy_delivery`]).
    fn check(&self, outbox_id: OutboxId, topic: &str) -> Result<(), Outcome> {
        if self.topic != topic || !self.same_payload {
            return Err(Outcome::Tampered(format!(
                "x-outbox-id {outbox_id} names an event whose topic or payload differs from this signed delivery: \
                 the header was altered after QStash signed it"
            )));
        }
        // The previous relay marked an event dispatched once QStash accepted it, and published an ordered key's
        // next event only after its predecessor was delivered. An event not yet dispatched therefore has no genuine
        // old-format delivery in flight (or its relay died between publish and settle): a forged id naming another
        // event with the same topic and payload would apply it out of turn. Retry later instead of deciding now.
        if !self.dispatched {
            return Err(Outcome::Transient {
                message: format!(
                    "delivery in the previous wire format for outbox id {outbox_id}, which the outbox does not show \
                     as dispatched yet: retry later"
                ),
                retry_after: Some(Duration::from_secs(60)),
            });
        }
        // "Dispatched" no longer implies "its predecessor was delivered": the relay dispatches an ordered key's run
        // of several events at once (decision record 0014). A replay naming a later member of a run, whose payload
        // equals the head's, would apply it before its predecessor. So an ordered event is applied here only once
        // its predecessor is finished: applied by this consumer, or its key moved past it (see `LEGACY_ROW_SQL`).
        // Answered transient, like an undispatched event: a genuine old-format delivery never waits on its
        // predecessor (the previous relay published a key's next event only after the one before was delivered),
        // so this is a replay, or a race that resolves itself once the predecessor is applied. Retrying costs
        // nothing and never applies out of order; a permanent answer would turn such a race into a dead letter.
        if !self.predecessor_finished {
            return Err(Outcome::Transient {
                message: format!(
                    "delivery in the previous wire format for outbox id {outbox_id} (sequence {}), whose \
                     predecessor this consumer has not applied yet: retry later",
                    self.seq.unwrap_or_default()
                ),
                retry_after: Some(Duration::from_secs(60)),
            });
        }
        Ok(())
    }
}
