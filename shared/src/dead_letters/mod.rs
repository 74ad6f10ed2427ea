//! Guarantee 4 — **nothing fails silently.** Every event ends dispatched and consumed, or as a row in
//! `dead_letters` with its payload, the error and the attempt count: one table, one query, one CLI command, and
//! an alarm on every arrival (the relay's EMF metric `DeadLettered`).
//!
//! Two sources write here: the relay (retry budget exhausted, or a permanent publish error; written inside the
//! relay's settle statement) and QStash (it gave up delivering and called the failure callback; written by
//! [`record_qstash_failure`]). Both are idempotent on `(source, natural_id)`.
//!
//! The operator side (`outbox dead-letters …`): [`list`] (filters, paging by id cursor), [`get`] and
//! [`event_state`] (show), [`redrive`] / [`redrive_matching`] (back through the outbox with the same id and a fresh
//! QStash dedup id; ordered heads unblock their key, middle events only with [`RedriveOptions::out_of_order`] —
//! decision record 0060) and [`purge`] (never touches the outbox; keeps dead letters of blocking heads — 0061).
//!
//! | file | concern |
//! |---|---|
//! | `record.rs` | a QStash failure callback becomes a dead letter ([`record_qstash_failure`]); a batched message's, one per failed event ([`record_qstash_batch_failure`]) |
//! | `query.rs` | [`list`], [`get`], [`event_state`], [`count_unhandled`], [`event_headers_of`] |
//! | `redrive.rs` | [`redrive`] one dead letter, in named steps |
//! | `redrive_bulk.rs` | [`redrive_matching`]: every unhandled dead letter a filter matches |
//! | `purge.rs` | [`purge`], [`count_purge`], in a [`PurgeScope`] |
//! | `groups.rs` | [`error_groups`] (by normalised error, for the console), [`max_id`] |
//!
//! This file holds what they share: [`Source`] and the [`Filter`] every operator command takes. *Dead letter*,
//! *redrive* and *middle event* are defined in the repository's `docs/glossary.md`.

mod filter;
mod groups;
mod purge;
pub(crate) mod query;
mod record;
mod redrive;
mod redrive_bulk;

pub(crate) use filter::like_escaped;
use filter::{FILTER_SQL, UNHANDLED_SQL, bind_filter};
pub use filter::{Filter, Source};
pub use groups::{ErrorGroup, error_groups, max_id};
pub use purge::{PurgeCounts, PurgeError, PurgeScope, count_purge, purge};
pub(crate) use query::event_headers_of;
pub use query::{
    DeadLetter, DeadLetterSummary, EventState, ListQuery, Listing, Page, count_unhandled,
    event_state, get, list,
};
pub(crate) use record::{
    BatchFailureRecorded, BatchMember, applied_ids, record_qstash_batch_failure,
};
pub use record::{FailureRecorded, QstashFailure, record_qstash_failure};
pub use redrive::{RedriveError, RedriveOptions, RedriveOrder, Redriven, redrive};
pub use redrive_bulk::{BulkOutcome, BulkReport, redrive_matching};
