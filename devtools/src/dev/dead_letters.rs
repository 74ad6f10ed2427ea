//! The dead letters as `outbox-dev dev` shows them: each one says who gave up and which party answered the status
//! it names, and they are counted by cause so that the demo's poison orders (expected) stand apart from anything
//! else (a bug to look at).

use std::collections::BTreeMap;

use outbox::db::{Db, Statements};
use outbox_cli::util::{one_line, printable};
use serde::Serialize;
use serde_json::Value;
use sqlx::PgPool;

/// One dead letter, as read for the console.
#[derive(Debug, Clone)]
pub struct DeadLetter {
    pub id: i64,
    /// `relay` (publishing gave up) or `qstash` (delivery gave up).
    pub source: String,
    pub topic: Option<String>,
    /// Partition key.
    pub key: Option<String>,
    /// The relay's or the failure callback's description.
    pub error: String,
    /// qstash: the consumer's last answer as QStash reports it; relay: QStash's answer to the publish.
    pub status: Option<i32>,
    /// The body of that answer.
    pub response_body: Option<String>,
    pub attempts: Option<i32>,
    /// The event was one of the demo's poison orders.
    pub demo_poison: bool,
}

impl DeadLetter {
    /// What the party that answered said: the `error` of a JSON answer (the consumer's), else the body, else the
    /// dead letter's description.
    fn reason(&self) -> String {
        let body = self
            .response_body
            .as_deref()
            .filter(|b| !b.trim().is_empty());
        match body {
            Some(b) => serde_json::from_str::<Value>(b)
                .ok()
                .and_then(|v| v["error"].as_str().map(str::to_owned))
                .unwrap_or_else(|| b.to_owned()),
            None => self.error.clone(),
        }
    }

    /// Who gave up, and the status with the party that answered it: `consumer refused it with
    /// consumer_status=489`, `QStash gave up retrying, last consumer_status=503`, `relay gave up publishing,
    /// qstash_status=400`.
    pub fn who(&self) -> String {
        match (self.source.as_str(), self.status) {
            ("qstash", Some(489)) => "consumer refused it with consumer_status=489".into(),
            ("qstash", Some(s)) => format!("QStash gave up retrying, last consumer_status={s}"),
            ("qstash", None) => "QStash gave up, no consumer status reported".into(),
            (_, Some(s)) => format!("relay gave up publishing, qstash_status={s}"),
            (_, None) => "relay gave up publishing".into(),
        }
    }

    /// [`Self::who`] in short, for the live table: `consumer_status=489`, `consumer_status=503, retries
    /// exhausted`, `relay, qstash_status=400`.
    pub fn who_short(&self) -> String {
        match (self.source.as_str(), self.status) {
            ("qstash", Some(489)) => "consumer_status=489".into(),
            ("qstash", Some(s)) => format!("consumer_status={s}, retries exhausted"),
            ("qstash", None) => "QStash gave up".into(),
            (_, Some(s)) => format!("relay, qstash_status={s}"),
            (_, None) => "relay gave up".into(),
        }
    }

    /// The cause this dead letter is counted under: [`Self::who`] and the answer with its numbers generalised
    /// (`order order-N: amount_cents is -N; …`), so that alike failures count together.
    pub fn cause(&self) -> String {
        format!(
            "{}: \"{}\"",
            self.who(),
            one_line(&generalise(&self.reason()), 120)
        )
    }

    /// [`Self::line`] in short, for the live table: `#12 orders/order-300 consumer_status=489: <its answer>`.
    pub fn line_short(&self) -> String {
        format!(
            "#{} {}/{} {}: {}",
            self.id,
            printable(self.topic.as_deref().unwrap_or("?")),
            printable(self.key.as_deref().unwrap_or("?")),
            self.who_short(),
            one_line(&self.reason(), 200)
        )
    }

    /// `#12 orders/order-300: consumer refused it with consumer_status=489 after 1 attempt: <its answer>`.
    pub fn line(&self, max_reason: usize) -> String {
        let attempts = match self.attempts {
            Some(1) => " after 1 attempt".to_owned(),
            Some(n) => format!(" after {n} attempts"),
            None => String::new(),
        };
        format!(
            "#{} {}/{}: {}{attempts}: {}",
            self.id,
            printable(self.topic.as_deref().unwrap_or("?")),
            printable(self.key.as_deref().unwrap_or("?")),
            self.who(),
            one_line(&self.reason(), max_reason)
        )
    }
}

/// Runs of digits become `N`: ids, amounts and counts differ between alike failures.
pub(crate) fn generalise(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut in_digits = false;
    for c in s.chars() {
        if c.is_ascii_digit() {
            if !in_digits {
                out.push('N');
            }
            in_digits = true;
        } else {
            out.push(c);
            in_digits = false;
        }
    }
    out
}

/// Dead letters counted under one cause.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct CauseCount {
    /// See [`DeadLetter::cause`].
    pub cause: String,
    /// These are the demo's poison orders (expected).
    pub demo_poison: bool,
    pub count: u64,
    /// The cause in short, for the live table.
    #[serde(skip)]
    pub short: String,
}

/// Every dead letter seen so far, counted by cause.
#[derive(Debug, Default)]
pub struct Tally {
    last_id: i64,
    by_cause: BTreeMap<(bool, String), (u64, String)>,
    total: u64,
    poison: u64,
}

impl Tally {
    /// Reads the dead letters recorded since the last call, counts them and returns them in order.
    pub async fn update(&mut self, pool: &PgPool) -> anyhow::Result<Vec<DeadLetter>> {
        let mut new = Vec::new();
        // Unnamed, in a transaction of its own: safe behind PgBouncer in transaction mode.
        let db = Db::new(pool.clone(), Statements::Unnamed);
        loop {
            type Row = (
                i64,
                String,
                Option<String>,
                Option<String>,
                String,
                Option<i32>,
                Option<String>,
                Option<i32>,
                Option<Value>,
            );
            let q = db
                .query_as(outbox::schema::q(
                    "SELECT id, source, topic, partition_key, error, status, response_body, attempts, payload \
                     FROM {schema}.dead_letters WHERE id > $1 ORDER BY id LIMIT 500",
                ))
                .bind(self.last_id);
            let rows: Vec<Row> = db.run(async |c| q.fetch_all(c).await).await?;
            let done = rows.len() < 500;
            for (id, source, topic, key, error, status, response_body, attempts, payload) in rows {
                let d = DeadLetter {
                    id,
                    demo_poison: topic.as_deref() == Some(orders_example::ORDERS.name())
                        && payload
                            .as_ref()
                            .is_some_and(orders_example::demo::is_poison),
                    source,
                    topic,
                    key,
                    error,
                    status,
                    response_body,
                    attempts,
                };
                self.last_id = id;
                self.total += 1;
                self.poison += u64::from(d.demo_poison);
                let short = format!(
                    "{}: \"{}\"",
                    d.who_short(),
                    one_line(&generalise(&d.reason()), 120)
                );
                self.by_cause
                    .entry((d.demo_poison, d.cause()))
                    .or_insert((0, short))
                    .0 += 1;
                new.push(d);
            }
            if done {
                return Ok(new);
            }
        }
    }

    /// Dead letters seen.
    pub fn total(&self) -> u64 {
        self.total
    }

    /// Of which the demo's poison orders.
    pub fn poison(&self) -> u64 {
        self.poison
    }

    /// The causes, most frequent first.
    pub fn causes(&self) -> Vec<CauseCount> {
        let mut v: Vec<CauseCount> = self
            .by_cause
            .iter()
            .map(|((demo_poison, cause), (count, short))| CauseCount {
                cause: cause.clone(),
                demo_poison: *demo_poison,
                count: *count,
                short: short.clone(),
            })
            .collect();
        v.sort_by(|a, b| b.count.cmp(&a.count).then_with(|| a.cause.cmp(&b.cause)));
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dead(source: &str, status: Option<i32>, body: Option<&str>, error: &str) -> DeadLetter {
        DeadLetter {
            id: 7,
            source: source.into(),
            topic: Some("orders".into()),
            key: Some("order-25".into()),
            error: error.into(),
            status,
            response_body: body.map(str::to_owned),
            attempts: Some(1),
            demo_poison: false,
        }
    }

    #[test]
    fn each_status_names_the_party_that_answered_it() {
        let refused = dead(
            "qstash",
            Some(489),
            Some(
                r#"{"error":"order order-25: amount_cents is -19322; a charge cannot be negative"}"#,
            ),
            "QStash gave up after 1 attempt(s); last status 489",
        );
        assert_eq!(
            refused.line(200),
            "#7 orders/order-25: consumer refused it with consumer_status=489 after 1 attempt: order order-25: \
             amount_cents is -19322; a charge cannot be negative"
        );
        assert_eq!(
            refused.cause(),
            "consumer refused it with consumer_status=489: \"order order-N: amount_cents is -N; a charge cannot \
             be negative\""
        );
        let exhausted = dead("qstash", Some(503), Some("busy"), "x");
        assert!(
            exhausted
                .cause()
                .starts_with("QStash gave up retrying, last consumer_status=503: \"busy")
        );
        let publish = dead(
            "relay",
            Some(400),
            Some("QStash refused the message (HTTP 400): bad url"),
            "QStash refused the message (HTTP 400): bad url",
        );
        assert!(
            publish
                .cause()
                .starts_with("relay gave up publishing, qstash_status=400: \"QStash refused"),
            "{}",
            publish.cause()
        );
    }

    #[test]
    fn stored_text_cannot_reach_the_terminal_raw() {
        let d = dead(
            "qstash",
            Some(489),
            Some("{\"error\":\"\\u001b[2Jboom\"}"),
            "x",
        );
        assert!(!d.line(200).contains('\u{1b}'), "{}", d.line(200));
        assert!(!d.cause().contains('\u{1b}'));
    }
}
