//! The operator: runs the schedule's actions one at a time through the library calls the CLI makes
//! (`outbox::subscribers::{add, replay, replay_step, remove}`, `outbox::dead_letters::{redrive_matching, purge}`,
//! `outbox prune`'s own function, the relay's partition maintenance) — every second bulk redrive or purge through
//! the web console's pages instead (`console.rs`) — retries an action that failed because
//! Postgres was away, finishes what an older transaction held up (a replay whose end was not fixed, a removal
//! whose copies were not deleted) as an operator would by running the command again, and records each action
//! with what it selected.
//!
//! | Rule | Why |
//! |---|---|
//! | One action at a time | The before/after snapshots of an action's selection see only that action's changes (nothing else redrives, purges or deletes rows: the relays' own retention is long) |
//! | Before an action, the explorer reads what it must not touch (other subscribers' unfinished copies, pending and dead rows, dead letters outside the filter) with SQL of its own; after it, checks they are as they were | "No operator action touched a row outside its selection", judged without the library's filter code |
//! | A replay's must-deliver set is read before every call of it: the retained events written at or after `--from` | Replay reaches only retained events (an event pruned before the replay copied it is not owed) |
//! | A removal records the events with an unfinished copy for the subscriber just before it | What may still be applied after the removal: nothing else may |

mod dead_letters;
mod dispatch;
mod maintenance;
mod reads;
mod state;
mod subscribers;

pub use state::Operator;
