//! Fan-out per subscriber and topic, for the operator console's subscribers page: every subscriber on record
//! ([`crate::subscribers::list`]: its URL, when it was added or removed, its replay's progress) with its figures
//! ([`crate::subscribers::status`]: backlog and lag, in flight, blocked lanes, dead letters).
//!
//! | Rule | Why |
//! |---|---|
//! | Topics with named subscribers only (and the default subscriber of each, also when removed) | A topic with only the default subscriber has no fan-out: its figures are the topic's (the topics page) |
//! | A removed subscriber is listed without figures | Its unfinished copies and lanes are gone; its dead letters stay, and the page links to them |
//! | The same two reads `outbox subscribers list` and `outbox status` make | The console never counts differently from the CLI |

use serde::Serialize;

use crate::db::Db;
use crate::subscribers::status::{self, SubscriberStatus};
use crate::subscribers::{self, Subscriber};

/// One subscriber of one topic.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SubscriberLine {
    /// As stored: topic, name (`''`: the default one), URL, added and removed, replay.
    pub subscriber: Subscriber,
    /// Its figures; `None` for a removed subscriber.
    pub figures: Option<SubscriberStatus>,
}

impl SubscriberLine {
    /// `removed`, `replaying` (its history is being copied; its ordered lanes wait) or `live`.
    pub fn state(&self) -> &'static str {
        if self.subscriber.removed_at.is_some() {
            "removed"
        } else if self.figures.as_ref().is_some_and(|f| f.replaying) {
            "replaying"
        } else {
            "live"
        }
    }
}

/// Every subscriber of the topics with named subscribers (only `topic`'s when given), by topic and name.
pub async fn subscribers(db: &Db, topic: Option<&str>) -> Result<Vec<SubscriberLine>, sqlx::Error> {
    let listed = subscribers::list(db).await?;
    let mut figures = {
        let mut conn = db.pool().acquire().await?;
        status::read(&mut conn, db.statements()).await?
    };
    Ok(listed
        .into_iter()
        .filter(|s| topic.is_none_or(|t| s.topic == t))
        .map(|s| {
            let found = figures
                .iter()
                .position(|f| f.topic == s.topic && f.subscriber == s.name)
                .filter(|_| s.removed_at.is_none())
                .map(|i| figures.swap_remove(i));
            SubscriberLine {
                subscriber: s,
                figures: found,
            }
        })
        .collect())
}
