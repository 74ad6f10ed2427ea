//! The operator's state between actions: the follow-ups left to finish, the replays interrupted on purpose, a
//! crash to cause in the middle of the next replay, the console once a bulk action has started it; and the history
//! every action is recorded in.

use std::collections::BTreeSet;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, Utc};
use outbox::db::{Db, Statements};
use sqlx::PgPool;

use crate::soak::explore::console::ConsoleDriver;
use crate::soak::explore::faults::Crasher;
use crate::soak::explore::history::{History, Outcome, Record};
use crate::soak::explore::retry::retry;

/// Something to finish later, as the operator would run the command again.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum FollowUp {
    /// The replay's end could not be fixed (older transactions): `subscribers replay`.
    Replay(usize, usize),
    /// The removal's copies were not deleted (older transactions): `subscribers remove` again.
    Remove(usize, usize),
    /// The addition could not finish the subscriber's earlier removal (older transactions) and recorded nothing:
    /// `subscribers add` again, with the same start.
    Add(usize, usize, Option<DateTime<Utc>>),
}

/// The operator's state.
pub struct Operator {
    pub db: PgPool,
    pub(super) odb: Db,
    pub(super) url: String,
    /// Base URL of each subscriber's consumer (index 0, the default one, unused).
    pub(super) urls: Vec<String>,
    pub history: Arc<Mutex<History>>,
    pub(super) next_n: Arc<AtomicU64>,
    pub(super) follow_ups: BTreeSet<FollowUp>,
    /// Replays stopped on purpose, waiting for their resume.
    pub(super) interrupted: BTreeSet<(usize, usize)>,
    /// Crashes Postgres in the middle of an action ([`Op::CrashDuring`]).
    ///
    /// [`Op::CrashDuring`]: crate::soak::explore::schedule::Op::CrashDuring
    pub(super) crasher: Arc<Crasher>,
    /// A crash to cause after the first chunk of the next replay: (step, what, down).
    pub(super) crash_mid_replay: Option<(usize, String, Duration)>,
    /// The console bulk actions go through, once one has ([`Operator::via_console`]).
    pub(super) console: Option<ConsoleDriver>,
    /// Bulk actions drawn so far: every second one goes through the console.
    pub(super) bulk_actions: u64,
}

impl Operator {
    pub fn new(
        db: PgPool,
        url: String,
        urls: Vec<String>,
        history: Arc<Mutex<History>>,
        next_n: Arc<AtomicU64>,
        crasher: Arc<Crasher>,
    ) -> Operator {
        Operator {
            odb: Db::new(db.clone(), Statements::Prepared),
            db,
            url,
            urls,
            history,
            next_n,
            follow_ups: BTreeSet::new(),
            interrupted: BTreeSet::new(),
            crasher,
            crash_mid_replay: None,
            console: None,
            bulk_actions: 0,
        }
    }

    /// Whether this bulk action goes through the console (every second one, so that a seed decides it): the
    /// console started on first use. `Err`: it could not be started (Postgres away for the whole retry window).
    pub(super) async fn via_console(&mut self) -> Result<bool, String> {
        self.bulk_actions += 1;
        if self.bulk_actions % 2 == 1 {
            return Ok(false);
        }
        if self.console.is_none() {
            let (url, history) = (self.url.clone(), self.history.clone());
            let driver = retry(|| ConsoleDriver::start(&url, history.clone()))
                .await
                .map_err(|e| format!("starting the console: {e:#}"))?;
            self.console = Some(driver);
        }
        Ok(true)
    }

    pub(super) fn history(&self) -> std::sync::MutexGuard<'_, History> {
        self.history.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(super) fn record(
        &self,
        step: Option<usize>,
        what: String,
        kind: String,
        start: DateTime<Utc>,
        outcome: Outcome,
    ) {
        self.history().records.push(Record {
            step,
            what,
            kind,
            start,
            end: Utc::now(),
            outcome,
        });
    }
}
