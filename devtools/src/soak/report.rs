//! What a soak ended with ([`SoakReport`]), its one summary line, and how dead-letter reasons are grouped
//! ([`reason_of`]).

use serde::Serialize;

/// A dead-letter reason and how many events ended with it.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct Reason {
    /// Whether these are the soak's poison events.
    pub poison: bool,
    /// The dead letters' error, normalised ([`reason_of`]): alike failures count together.
    pub reason: String,
    /// Distinct events.
    pub count: i64,
}

/// At most this many characters of one reason ([`reason_of`]).
pub const REASON_CHARS: usize = 50;
/// At most this many reasons in the summary line ([`SoakReport::line`]; the JSON keeps them all).
pub const LINE_REASONS: usize = 2;

/// What a soak ended with.
#[derive(Debug, Clone, Default, Serialize)]
pub struct SoakReport {
    /// Events in the outbox (committed by the producers).
    pub enqueued: i64,
    /// Poison events among them.
    pub poison: i64,
    /// Events the consumer applied exactly once.
    pub applied_once: i64,
    /// Events dead-lettered (and not applied), poison ones.
    pub dead_lettered_poison: i64,
    /// Events dead-lettered (and not applied) that were not poison.
    pub dead_lettered_other: i64,
    /// Their outbox ids: the unexpected dead letters.
    pub unexpected_dead_letters: Vec<i64>,
    /// The events the dev server's DLQ says QStash gave up on after faults, not applied and not poison
    /// (`outbox_testkit::given_up`): the unexpected dead letters must be exactly these.
    pub explained_dead_letters: Vec<i64>,
    /// Something in the run can exhaust QStash's retries (delivery faults, killed receivers, terminated
    /// backends); without it no unexpected dead letter is allowed at all.
    pub retries_exhaustible: bool,
    /// The dead letters' reasons.
    pub dead_letter_reasons: Vec<Reason>,
    /// Events applied more than once (must be 0).
    pub applied_twice: i64,
    /// Poison events applied (must be 0).
    pub poison_applied: i64,
    /// Events neither applied nor dead-lettered (must be 0).
    pub lost: i64,
    /// Ordered-topic applications whose sequence is not above the key's previous one (must be 0).
    pub order_violations: i64,
    /// Outbox rows and keys still leased, or events still pending, at the end (must be 0).
    pub left_leased: i64,
    pub relay_kills: u64,
    pub consumer_kills: u64,
    pub callback_kills: u64,
    /// Postgres backends terminated (relay, consumer and callback connections).
    pub backend_kills: u64,
    /// Worker processes started again (after a kill, or after exiting by themselves).
    pub restarts: u64,
    /// Workers that exited without being killed (restarted too).
    pub worker_exits: u64,
    pub pg_restarts: u64,
    pub outage_secs: u64,
    /// The pipeline drained before the timeout.
    pub drained: bool,
    pub seconds: f64,
    pub seed: u64,
    /// Every must-be-zero figure is zero and the unexpected dead letters are within their bound
    /// ([`SoakReport::dead_letter_bound`]).
    pub ok: bool,
}

impl SoakReport {
    /// The unexpected dead letters against their bound: none when nothing could exhaust QStash's retries, else
    /// exactly the events the dev server's DLQ explains. `Err` names the events on either side.
    pub fn dead_letter_bound(&self) -> Result<(), String> {
        outbox_testkit::given_up::check_unexpected_dead_letters(
            &self.unexpected_dead_letters.iter().copied().collect(),
            &self.explained_dead_letters.iter().copied().collect(),
            self.retries_exhaustible,
        )
    }

    /// Sets [`SoakReport::ok`]: drained, every must-be-zero figure zero, the dead letters within their bound.
    pub fn judge(&mut self) {
        self.ok = self.drained
            && self.applied_twice == 0
            && self.lost == 0
            && self.order_violations == 0
            && self.left_leased == 0
            && self.poison_applied == 0
            && self.dead_letter_bound().is_ok();
    }

    /// The one summary line: short whatever the dead letters say (the non-poison reasons only, at most
    /// [`LINE_REASONS`] of them, each normalised and capped by [`reason_of`]).
    pub fn line(&self) -> String {
        let other: Vec<&Reason> = self
            .dead_letter_reasons
            .iter()
            .filter(|r| !r.poison)
            .collect();
        let mut reasons: Vec<String> = other
            .iter()
            .take(LINE_REASONS)
            .map(|r| format!("{}× \"{}\"", r.count, r.reason))
            .collect();
        if other.len() > LINE_REASONS {
            reasons.push(format!("+{} more", other.len() - LINE_REASONS));
        }
        let explained = if self.dead_lettered_other > 0 || !self.explained_dead_letters.is_empty() {
            format!(", DLQ explains {}", self.explained_dead_letters.len())
        } else {
            String::new()
        };
        format!(
            "soak {}: enqueued {}, applied once {}, dead-lettered {} (poison {}, other {}{explained}{}{}), applied \
             twice {}, lost {}, order violations {}, left leased {}, poison applied {}, relay kills {}, consumer \
             kills {}, callback kills {}, backend kills {}, restarts {}, worker exits {}, pg restarts {}, outage {} \
             s, drained {}, {:.0} s, seed {}",
            if self.ok { "OK" } else { "FAILED" },
            self.enqueued,
            self.applied_once,
            self.dead_lettered_poison + self.dead_lettered_other,
            self.dead_lettered_poison,
            self.dead_lettered_other,
            if reasons.is_empty() { "" } else { ": " },
            reasons.join("; "),
            self.applied_twice,
            self.lost,
            self.order_violations,
            self.left_leased,
            self.poison_applied,
            self.relay_kills,
            self.consumer_kills,
            self.callback_kills,
            self.backend_kills,
            self.restarts,
            self.worker_exits,
            self.pg_restarts,
            self.outage_secs,
            self.drained,
            self.seconds,
            self.seed,
        )
    }
}

/// A dead letter's reason as the soak groups it: its `error` (for an event of a batch, the message's status and
/// the consumer's words about that event), plus what the consumer said about this event in its response
/// (`events[]` entry with its outbox id; the top-level `error` of a response without that list) when the error
/// does not say it already; then normalised — cut before any JSON (`{` or `[`), runs of digits as `N`, the
/// library's fixed wording shortened (`last status N: soak poison event`), one printable line of at most
/// [`REASON_CHARS`] characters — so that alike failures count together and the summary stays short whatever the
/// reasons say.
pub fn reason_of(error: &str, response_body: Option<&str>, outbox_id: i64) -> String {
    let said: Option<String> = response_body
        .and_then(|b| serde_json::from_str::<serde_json::Value>(b).ok())
        .and_then(|v| match v.get("events").and_then(|e| e.as_array()) {
            Some(list) => list
                .iter()
                .find(|e| e.get("id").and_then(|i| i.as_i64()) == Some(outbox_id))
                .and_then(|e| e.get("error"))
                .and_then(|e| e.as_str())
                .map(str::to_owned),
            None => v.get("error").and_then(|e| e.as_str()).map(str::to_owned),
        });
    let mut text = error.to_owned();
    if let Some(said) = said.filter(|s| !s.trim().is_empty() && !error.contains(s.as_str())) {
        text.push_str(CONSUMER_SAID);
        text.push_str(&said);
    }
    if let Some(json) = text.find(['{', '[']) {
        text.truncate(json);
    }
    let text = crate::dev::dead_letters::generalise(text.trim_end_matches([' ', ':', ';', ',']))
        // The library's wording, shortened: the words that tell failures apart fit in the cap.
        .replace("QStash gave up after N attempt(s); ", "")
        .replace(CONSUMER_SAID, ": ")
        .replace("; the consumer said about this event: ", ": ");
    outbox_cli::util::one_line(&text, REASON_CHARS)
}

const CONSUMER_SAID: &str = "; the consumer said: ";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reason_is_the_events_own_words_without_ids_or_json() {
        // The soak's own case: a batch member's error, and the consumer's whole response in response_body.
        let body = r#"{"error":"event 10400: soak poison event","events":[{"id":10398,"outcome":"processed"},{"id":10400,"outcome":"failed","error":"soak poison event"}],"status":"partial"}"#;
        let batch_error = "QStash gave up after 1 attempt(s); last status 489; the consumer said about this event: \
                           soak poison event";
        assert_eq!(
            reason_of(batch_error, Some(body), 10400),
            "last status N: soak poison event"
        );
        // One event per message: the error has no consumer words; its own verdict is added.
        let single = r#"{"error":"database error: pool timed out","events":[{"id":7,"outcome":"retry","error":"database error: pool timed out"}]}"#;
        assert_eq!(
            reason_of(
                "QStash gave up after 4 attempt(s); last status 503",
                Some(single),
                7
            ),
            "last status N: database error: pool timed out"
        );
        assert_eq!(
            reason_of(
                "QStash gave up after 4 attempt(s); no response (network errors or timeouts)",
                Some(""),
                7
            ),
            "no response (network errors or timeouts)"
        );
        // Another event's verdict is never taken; JSON in an error is cut.
        assert_eq!(
            reason_of("last status 503", Some(single), 8),
            "last status N"
        );
        assert_eq!(reason_of("boom: {\"a\":[1,2,3]}", None, 1), "boom");
    }

    #[test]
    fn the_summary_line_stays_short_whatever_the_reasons_say() {
        let long = "x".repeat(10_000);
        // A full run's magnitudes (20,000 events, a thousand kills, an hour), fifty different long reasons.
        let mut report = SoakReport {
            enqueued: 20_000,
            applied_once: 19_000,
            dead_lettered_poison: 400,
            dead_lettered_other: 600,
            explained_dead_letters: vec![1; 600],
            relay_kills: 1_000,
            consumer_kills: 1_000,
            callback_kills: 1_000,
            backend_kills: 10_000,
            restarts: 3_000,
            seconds: 3_600.0,
            seed: 12_345,
            ..SoakReport::default()
        };
        report.dead_letter_reasons = (0..50i64)
            .map(|i| Reason {
                poison: i % 2 == 0,
                reason: reason_of(&format!("{long} {i} {{\"events\":[]}}"), Some(&long), i),
                count: 100 - i,
            })
            .collect();
        let line = report.line();
        assert!(
            line.chars().count() < 500,
            "{} chars: {line}",
            line.chars().count()
        );
        assert!(line.contains("+23 more"), "{line}");
        assert!(!line.contains('\n'));
    }
}
