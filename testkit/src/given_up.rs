//! Which events may end as *unexpected* dead letters (dead letters of events that are not the workload's poison),
//! by the dev server's own records: the messages it moved to its DLQ ([`qstash_dev::Handle::dlq_entries`], the
//! same as `GET /__dev/dlq`), never the library's tables. The whole-system tests and the soak bound their
//! unexpected dead letters with it:
//!
//! * when no fault of the run can exhaust QStash's retries ([`can_exhaust_retries`]), there are none;
//! * otherwise the set of events with an unexpected dead letter equals [`explained_dead_letters`]: exactly the
//!   events QStash gave up on because every delivery attempt of their message failed (transport errors, injected
//!   network faults, lost responses, 5xx answers) and the consumer did not apply them.
//!
//! Sets of outbox ids are compared, never row counts (an event may carry several dead letters).
//!
//! Which events of a message QStash gave up on die follows the failure callback's documented rules (decision
//! record 0027), read from the DLQ entry alone: one event → that event; several events with the consumer's
//! per-event verdicts in its last response → the ones it answered `failed` or `retry`; several events without a
//! readable verdict → every one of an unordered topic, the first not applied of an ordered key. A message whose
//! last answer QStash received was a 4xx (489: the consumer refused it; 401: it rejected the signature) was not
//! given up on because of a fault: its events explain nothing (poison events die that way, and nothing else may).

use std::collections::BTreeSet;

use qstash_dev::{AttemptKind, DlqEntryInfo, Faults};
use serde_json::Value;

/// One destination message in the dev server's DLQ, as its record there says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GivenUp {
    /// QStash's message id.
    pub message_id: String,
    /// The message's outbox ids, in envelope order (empty when the body is not an envelope).
    pub events: Vec<i64>,
    /// Its events carry a per-key sequence (an ordered topic).
    pub ordered: bool,
    /// The status of the last response, if one arrived (a lost response keeps the consumer's real status).
    pub last_status: Option<u16>,
    /// The last attempt's transport error (network error, timeout, injected fault), if any.
    pub last_error: Option<String>,
    /// The consumer's per-event verdicts in its last response (`events: [{id, outcome}]`), when readable.
    pub verdicts: Option<Vec<(i64, String)>>,
}

impl GivenUp {
    /// Reads a DLQ entry; `None` for anything but a destination message (callbacks die elsewhere).
    pub fn from_dlq(entry: &DlqEntryInfo) -> Option<GivenUp> {
        if entry.kind != AttemptKind::Destination {
            return None;
        }
        let envelope: Option<Value> = serde_json::from_slice(&entry.body).ok();
        let list = envelope
            .as_ref()
            .and_then(|e| e.get("events"))
            .and_then(Value::as_array);
        let events: Vec<i64> = list
            .into_iter()
            .flatten()
            .filter_map(|e| e.get("id").and_then(Value::as_i64))
            .collect();
        let ordered = list
            .into_iter()
            .flatten()
            .any(|e| e.get("seq").is_some_and(|s| !s.is_null()));
        let verdicts = serde_json::from_slice::<Value>(&entry.response_body)
            .ok()
            .and_then(|b| {
                let v: Vec<(i64, String)> = b
                    .get("events")?
                    .as_array()?
                    .iter()
                    .filter_map(|e| {
                        Some((
                            e.get("id")?.as_i64()?,
                            e.get("outcome")?.as_str()?.to_owned(),
                        ))
                    })
                    .collect();
                (!v.is_empty()).then_some(v)
            });
        Some(GivenUp {
            message_id: entry.message_id.clone(),
            events,
            ordered,
            last_status: entry.response_status,
            last_error: entry.error.clone(),
            verdicts,
        })
    }

    /// QStash received a 4xx as the last answer: the consumer refused the message (or rejected it), no fault did.
    pub fn refused_by_the_consumer(&self) -> bool {
        self.last_error.is_none() && self.last_status.is_some_and(|s| (400..500).contains(&s))
    }

    /// The events of this message that die of it (see the module doc), before poison and applied events are set
    /// apart; `applied` says whether the consumer applied an event.
    fn dying(&self, applied: &dyn Fn(i64) -> bool) -> Vec<i64> {
        if self.refused_by_the_consumer() {
            return Vec::new();
        }
        match (&self.verdicts, self.events.as_slice()) {
            (_, [one]) => vec![*one],
            (Some(verdicts), _) => self
                .events
                .iter()
                .copied()
                .filter(|id| {
                    verdicts
                        .iter()
                        .any(|(v, outcome)| v == id && (outcome == "failed" || outcome == "retry"))
                })
                .collect(),
            (None, events) if self.ordered => events
                .iter()
                .copied()
                .find(|id| !applied(*id))
                .into_iter()
                .collect(),
            (None, events) => events.to_vec(),
        }
    }
}

/// The destination messages in the dev server's DLQ.
pub fn given_up(dlq: &[DlqEntryInfo]) -> Vec<GivenUp> {
    dlq.iter().filter_map(GivenUp::from_dlq).collect()
}

/// Whether `faults` can make QStash give up on a message the consumer would have taken: a delivery attempt that
/// fails in the network or loses its response. (Publish faults make the relay retry, never QStash.)
pub fn can_exhaust_retries(faults: &Faults) -> bool {
    faults.delivery_network_error_rate > 0.0 || faults.delivery_lost_response_rate > 0.0
}

/// The events that may, and must, have an unexpected dead letter: of the messages QStash gave up on
/// ([`given_up`]), the events that die of it (module doc), less those the consumer applied (`applied`: the
/// consumer's own record; a lost response hides it from QStash) and the workload's poison events (`poison`).
pub fn explained_dead_letters(
    given_up: &[GivenUp],
    applied: impl Fn(i64) -> bool,
    poison: impl Fn(i64) -> bool,
) -> BTreeSet<i64> {
    given_up
        .iter()
        .flat_map(|m| m.dying(&applied))
        .filter(|id| !applied(*id) && !poison(*id))
        .collect()
}

/// Checks the bound: with no fault that can exhaust QStash's retries (`exhaustible` false) no unexpected dead
/// letter at all; otherwise exactly the `explained` events. `Err` names the events on either side.
pub fn check_unexpected_dead_letters(
    unexpected: &BTreeSet<i64>,
    explained: &BTreeSet<i64>,
    exhaustible: bool,
) -> Result<(), String> {
    if !exhaustible {
        return if unexpected.is_empty() {
            Ok(())
        } else {
            Err(format!(
                "no fault of this run can exhaust QStash's retries, yet events {unexpected:?} have unexpected \
                 dead letters"
            ))
        };
    }
    let unexplained: Vec<&i64> = unexpected.difference(explained).collect();
    let missing: Vec<&i64> = explained.difference(unexpected).collect();
    if unexplained.is_empty() && missing.is_empty() {
        return Ok(());
    }
    Err(format!(
        "unexpected dead letters {unexpected:?} differ from the events QStash gave up on after faults \
         {explained:?}: dead letters no fault explains {unexplained:?}; given up on without a dead letter \
         {missing:?}"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(body: &str, status: Option<u16>, response: &str, error: Option<&str>) -> DlqEntryInfo {
        DlqEntryInfo {
            dlq_id: "1-0".into(),
            message_id: "msg_1".into(),
            kind: AttemptKind::Destination,
            url: "http://127.0.0.1:1/events/t?contract=2".into(),
            method: "POST".into(),
            body: body.as_bytes().to_vec(),
            retried: 3,
            max_retries: 3,
            response_status: status,
            response_body: response.as_bytes().to_vec(),
            error: error.map(str::to_owned),
            created_at_unix_ms: 0,
            queue_name: None,
            flow_control_key: None,
            labels: Vec::new(),
        }
    }

    const UNORDERED: &str = r#"{"contract":2,"topic":"t","events":[{"id":1,"key":"a","payload":{}},{"id":2,"key":"b","payload":{}},{"id":3,"key":"c","payload":{}}]}"#;
    const ORDERED: &str = r#"{"contract":2,"topic":"t","events":[{"id":1,"key":"a","seq":1,"payload":{}},{"id":2,"key":"a","seq":2,"payload":{}},{"id":3,"key":"a","seq":3,"payload":{}}]}"#;
    const ONE: &str = r#"{"contract":2,"topic":"t","events":[{"id":7,"key":"a","payload":{}}]}"#;

    fn explained(e: DlqEntryInfo, applied: &[i64], poison: &[i64]) -> Vec<i64> {
        explained_dead_letters(
            &given_up(&[e]),
            |id| applied.contains(&id),
            |id| poison.contains(&id),
        )
        .into_iter()
        .collect()
    }

    #[test]
    fn every_unapplied_event_of_an_unordered_message_without_a_verdict_dies() {
        let e = entry(UNORDERED, None, "", Some("injected fault: network error"));
        assert_eq!(explained(e.clone(), &[], &[]), vec![1, 2, 3]);
        assert_eq!(explained(e, &[2], &[3]), vec![1]);
    }

    #[test]
    fn only_the_first_unapplied_event_of_an_ordered_message_without_a_verdict_dies() {
        let e = entry(ORDERED, Some(503), "<html>busy</html>", None);
        assert_eq!(explained(e.clone(), &[], &[]), vec![1]);
        assert_eq!(explained(e.clone(), &[1], &[]), vec![2]);
        assert_eq!(explained(e, &[1], &[2]), Vec::<i64>::new(), "a poison head");
    }

    #[test]
    fn with_a_verdict_the_events_answered_failed_or_retry_die() {
        let verdict = r#"{"error":"event 2: db","events":[{"id":1,"outcome":"processed"},{"id":2,"outcome":"retry","error":"db"},{"id":3,"outcome":"not_attempted"}]}"#;
        let e = entry(UNORDERED, Some(503), verdict, None);
        assert_eq!(explained(e, &[1], &[]), vec![2]);
    }

    #[test]
    fn a_single_event_dies_unless_applied() {
        let e = entry(ONE, Some(200), "{}", Some("injected fault: response lost"));
        assert_eq!(explained(e.clone(), &[], &[]), vec![7]);
        assert_eq!(explained(e, &[7], &[]), Vec::<i64>::new());
    }

    #[test]
    fn a_message_the_consumer_refused_explains_nothing() {
        for status in [489, 401] {
            let e = entry(ONE, Some(status), r#"{"error":"no"}"#, None);
            assert_eq!(explained(e, &[], &[]), Vec::<i64>::new(), "{status}");
        }
        // A refusal whose response was lost is retried like any failure.
        let e = entry(
            ONE,
            Some(489),
            r#"{"error":"no"}"#,
            Some("injected fault: response lost"),
        );
        assert_eq!(explained(e, &[], &[]), vec![7]);
    }

    #[test]
    fn the_bound_fails_on_either_side_and_without_exhausting_faults_on_any() {
        let s = |v: &[i64]| v.iter().copied().collect::<BTreeSet<i64>>();
        assert!(check_unexpected_dead_letters(&s(&[1, 2]), &s(&[1, 2]), true).is_ok());
        assert!(check_unexpected_dead_letters(&s(&[1, 2, 5]), &s(&[1, 2]), true).is_err());
        assert!(check_unexpected_dead_letters(&s(&[1]), &s(&[1, 2]), true).is_err());
        assert!(check_unexpected_dead_letters(&s(&[]), &s(&[]), false).is_ok());
        assert!(check_unexpected_dead_letters(&s(&[1]), &s(&[1]), false).is_err());
    }
}
