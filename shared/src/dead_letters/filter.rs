//! What dead letters are selected by: their [`Source`] and a [`Filter`], and the SQL that applies one.

use crate::ids::{DeadLetterId, PartitionKey, TopicName};
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

/// Where a dead letter came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Source {
    /// The relay gave up publishing (retry budget exhausted, or QStash refused the message).
    Relay,
    /// QStash gave up delivering (failure callback).
    Qstash,
}

impl Source {
    /// The value stored in `dead_letters.source`.
    pub fn as_str(self) -> &'static str {
        match self {
            Source::Relay => "relay",
            Source::Qstash => "qstash",
        }
    }
}

impl std::str::FromStr for Source {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "relay" => Ok(Source::Relay),
            "qstash" => Ok(Source::Qstash),
            other => Err(format!(
                "unknown dead-letter source {other:?}: expected relay or qstash"
            )),
        }
    }
}

/// Which dead letters an operation applies to. Every set field must match; an empty filter matches everything
/// (bulk redrive and purge refuse an empty filter).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct Filter {
    pub topic: Option<TopicName>,
    pub source: Option<Source>,
    /// Partition key.
    pub key: Option<PartitionKey>,
    /// Recorded at or after.
    pub since: Option<DateTime<Utc>>,
    /// Recorded before.
    pub until: Option<DateTime<Utc>>,
    /// The error contains this text (case-insensitive).
    pub error: Option<String>,
    /// The normalised error (`error_group`: runs of digits as `N`, the first 200 characters) is exactly this.
    pub error_group: Option<String>,
    /// Only dead letters with an id up to this one: a bulk action confirmed on a count touches only what was
    /// counted, not what was recorded after. Not a selection of its own ([`Filter::is_empty`] ignores it).
    pub max_id: Option<DeadLetterId>,
    /// Only this subscriber's (`''`: the default one; see `crate::subscribers`).
    pub subscriber: Option<String>,
}

impl Filter {
    /// True when no field is set.
    pub fn is_empty(&self) -> bool {
        self.topic.is_none()
            && self.source.is_none()
            && self.key.is_none()
            && self.since.is_none()
            && self.until.is_none()
            && self.error.is_none()
            && self.error_group.is_none()
            && self.subscriber.is_none()
    }
}

/// The filter as SQL over `dead_letters d`, parameters `$1..$8` (the error text as a `LIKE` pattern: `%`, `_`
/// and `\` in it match themselves).
pub(super) const FILTER_SQL: &str = "($1::text IS NULL OR d.topic = $1) AND ($2::text IS NULL OR d.source = $2) \
     AND ($3::text IS NULL OR d.partition_key = $3) AND ($4::timestamptz IS NULL OR d.created_at >= $4) \
     AND ($5::timestamptz IS NULL OR d.created_at < $5) AND ($6::text IS NULL OR d.error ILIKE $6) \
     AND ($7::text IS NULL OR d.error_group = $7) AND ($8::bigint IS NULL OR d.id <= $8) \
     AND ($9::text IS NULL OR d.subscriber = $9)";

/// Not redriven and not resolved: still needs an operator.
pub(super) const UNHANDLED_SQL: &str = "d.redriven_at IS NULL AND d.resolved_at IS NULL";

pub(super) fn bind_filter<'q>(
    q: sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments>,
    f: &'q Filter,
) -> sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments> {
    q.bind(f.topic.as_deref())
        .bind(f.source.map(Source::as_str))
        .bind(f.key.as_deref())
        .bind(f.since)
        .bind(f.until)
        .bind(f.error.as_deref().map(|e| format!("%{}%", like_escaped(e))))
        .bind(f.error_group.as_deref())
        .bind(f.max_id)
        .bind(f.subscriber.as_deref())
}

/// `text` for a `LIKE` pattern, with `%`, `_` and `\` matching themselves (the default escape character).
pub(crate) fn like_escaped(text: &str) -> String {
    let mut p = String::with_capacity(text.len());
    for c in text.chars() {
        if matches!(c, '%' | '_' | '\\') {
            p.push('\\');
        }
        p.push(c);
    }
    p
}
