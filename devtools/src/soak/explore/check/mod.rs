//! The checker: the run's history ([`History`]: what the producers wrote and when, each subscription period,
//! every action) against what the run left behind ([`World`]: what each subscriber's consumer applied, with the
//! time and the copy; the outbox's copies, the dead letters and the lanes; the dev server's DLQ and lost
//! messages). It never asks the library what should have happened.
//!
//! | Per (event, subscriber) | Allowed at the end |
//! |---|---|
//! | *owed*: written after the subscriber was added and it was never removed after; or retained and at or after the `--from` of a finished replay of its current subscription | applied exactly once; or exactly one open dead letter with a cause; or its copy pending behind a dead head of its lane, or its dead letter purged by an operator |
//! | *may*: written while the subscriber was being added or removed, or during a subscription that was later removed, or covered by a replay that did not finish, or written up to 2 s before a replay's `--from` | applied at most once; when applied after a removal, it had a copy in flight at a removal (or was written during one), or its dead-lettered copy was redriven first, or a later subscription owes it |
//! | *not owed*: the subscriber was not on the topic while it was written, and no replay of it reached back to it (`--from` after it) | never applied |
//!
//! And for every run: per key of an ordered topic, each subscriber applies rising sequences; a dead letter has a
//! cause (the event is poison for that subscriber; QStash gave up on its message after faults, by the dev
//! server's DLQ; its message was lost by the dev server; or "no destination" while the subscriber was not on the
//! topic); poison is applied only after it was cured; no operator action changed a row outside its selection;
//! the pipeline drained.
//!
//! [`History`]: crate::soak::explore::history::History

mod names;
mod owed;
mod report;
mod verdict;
mod world;

pub use report::report;
pub use verdict::{Checked, Figures, Violation, check};
pub use world::{Applied, CopyRow, DeadRow, Lane, World};
