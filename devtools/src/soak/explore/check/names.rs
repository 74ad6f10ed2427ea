//! The checker's small translations: a subscriber's or a topic's stored name to its index in the schedule's
//! tables, and an error to one short line for the reports.

use crate::soak::explore::schedule::{SUBSCRIBERS, TOPICS};

pub(super) fn sub_index(name: &str) -> Option<usize> {
    SUBSCRIBERS.iter().position(|s| *s == name)
}

pub(super) fn topic_index(name: &str) -> Option<usize> {
    TOPICS.iter().position(|t| t.name() == name)
}

pub(super) fn one_line(s: &str) -> String {
    outbox_cli::util::one_line(s, 160)
}
