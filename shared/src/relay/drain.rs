//! The drain loop: [`Relay::drain`] runs cycles (`RELAY_CONCURRENCY` workers) until the invocation's deadline,
//! sums what they did into a [`DrainSummary`], and stops early when asked ([`StopHandle`]) or, for the CLI, when
//! nothing is left. Optionally woken by `NOTIFY outbox_new` instead of polling. During a QStash outage it waits
//! for the shared probe when that probe comes before the deadline (decision record 0012).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering as AtomicOrdering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::Serialize;
use tokio::sync::Notify;

use super::cycle::{CycleReport, Relay};
use super::error::{RelayError, db};
use super::outage::{self, OutageState};

/// What one invocation's drain did.
#[derive(Debug, Clone, Default, Serialize)]
pub struct DrainSummary {
    pub cycles: u64,
    pub claimed: u64,
    /// Accepted by QStash.
    pub dispatched: u64,
    /// Scheduled for another attempt.
    pub retried: u64,
    /// Dead-lettered by the relay.
    pub dead_lettered: u64,
    /// Settles that found the lease taken over.
    pub fenced: u64,
    /// Cycles that failed with a database error.
    pub errors: u64,
    /// Transient publish failures caused by configuration.
    pub config_problems: u64,
    /// Claimed events given back without spending an attempt (their request failed at request level).
    pub released: u64,
    /// An outage of QStash is recorded at the end of the drain (decision record 0012): `QStashOutage` in EMF.
    pub qstash_outage: bool,
    /// How long that outage has lasted, seconds (`OutageSeconds`; 0 without one).
    pub outage_secs: f64,
    /// Median `/v2/batch` latency, ms.
    pub publish_p50_ms: f64,
    /// 99th percentile `/v2/batch` latency, ms.
    pub publish_p99_ms: f64,
    /// Median claim latency (both claim statements, empty claims included), ms: it grows when dead tuples or a
    /// pinned xmin horizon make the claim walk more of the outbox.
    pub claim_p50_ms: f64,
    /// 99th percentile claim latency, ms.
    pub claim_p99_ms: f64,
    /// Why the drain stopped.
    pub stopped: &'static str,
}

/// When a drain ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Until {
    /// At its deadline (an invocation of the Lambda).
    Deadline,
    /// At its deadline, or earlier once nothing is pending or awaiting delivery evidence (`outbox relay
    /// --until-empty`, the benchmarks).
    Empty,
}

impl Relay {
    /// Runs cycles (`RELAY_CONCURRENCY` at once) until `deadline`: again at once while claims come back full,
    /// otherwise after the poll interval (or a `NOTIFY`, when enabled). Never claims with less time left than
    /// the lease, so every claim can be settled before the invocation ends. During a recorded QStash outage it
    /// claims nothing until the next probe is due — waiting for it within this invocation when it comes at least
    /// a lease before `deadline`, returning at once otherwise — then probes (one relay only) and drains only if
    /// the probe got through; a cycle that finds QStash out stops every worker, and the drain goes back to
    /// waiting for the probe while the deadline allows (decision record 0012).
    pub async fn drain(&self, deadline: Instant) -> Result<DrainSummary, RelayError> {
        self.drain_with(deadline, Until::Deadline).await
    }

    /// [`Relay::drain`], ending as [`Until`] says.
    pub async fn drain_with(
        &self,
        deadline: Instant,
        until: Until,
    ) -> Result<DrainSummary, RelayError> {
        let st = DrainState::new(deadline, until);
        // Rounds: the outage gate, then the workers until the deadline (or empty, or stopped). A round whose cycle
        // found QStash out goes back to the gate, which waits for the next probe while the deadline allows.
        let mut gate_empty = false;
        loop {
            if deadline.saturating_duration_since(Instant::now()) < self.cfg.lease
                || self.stop.requested()
            {
                break;
            }
            match self.outage_gate(&st).await? {
                Gate::Drain => st.out.store(false, AtomicOrdering::Relaxed),
                Gate::Closed => {
                    st.out.store(true, AtomicOrdering::Relaxed);
                    break;
                }
                Gate::Empty => {
                    gate_empty = true;
                    break;
                }
            }
            // One round: the workers until they all stop, with the `NOTIFY` listener when enabled (inline: each
            // nested `async fn` deepens the drain's future, which callers lay out).
            let workers = futures::future::join_all(
                (0..self.cfg.concurrency.max(1)).map(|n| self.worker(&st, n)),
            );
            if self.cfg.listen_notify {
                let stop = Arc::new(Notify::new());
                let listener = self.listen(st.wake.clone(), stop.clone());
                tokio::pin!(listener);
                tokio::select! {
                    _ = workers => {}
                    _ = &mut listener => {}
                }
                stop.notify_waiters();
            } else {
                workers.await;
            }
            if let Ok(mut slot) = st.last_error.lock()
                && let Some(e) = slot.take()
            {
                return Err(e);
            }
            if !st.out.load(AtomicOrdering::Relaxed) {
                break;
            }
        }
        let state = outage::load(&self.db).await.map_err(db("read outage"))?;
        Ok(st.summary(&state, gate_empty))
    }

    /// One worker: cycles until the deadline (less a lease), a stop, an outage, three database errors in a row, or
    /// (with [`Until::Empty`]) nothing left; after a cycle that was not full it naps for the poll interval.
    async fn worker(&self, st: &DrainState, n: u32) {
        let mut consecutive_errors = 0u32;
        // Stagger workers a little so their claims do not collide on the same index pages.
        if n > 0 {
            tokio::time::sleep(Duration::from_millis(5 * u64::from(n))).await;
        }
        loop {
            let left = st.deadline.saturating_duration_since(Instant::now());
            if left < self.cfg.lease
                || self.stop.requested()
                || st.out.load(AtomicOrdering::Relaxed)
            {
                break;
            }
            match self.run_cycle().await {
                Ok(r) => {
                    consecutive_errors = 0;
                    match self.after_cycle(st, &r) {
                        Next::Again => continue,
                        Next::Stop => break,
                        Next::AskEmpty if self.is_empty().await.unwrap_or(false) => {
                            st.empty.store(true, AtomicOrdering::Relaxed);
                            break;
                        }
                        Next::AskEmpty | Next::Nap => {}
                    }
                }
                Err(e) => {
                    st.totals.errors.fetch_add(1, AtomicOrdering::Relaxed);
                    consecutive_errors += 1;
                    tracing::error!(error = %e, cause = ?std::error::Error::source(&e), "relay cycle failed");
                    if consecutive_errors >= 3 {
                        if let Ok(mut slot) = st.last_error.lock() {
                            *slot = Some(e);
                        }
                        break;
                    }
                }
            }
            let left = st
                .deadline
                .saturating_duration_since(Instant::now())
                .saturating_sub(self.cfg.lease);
            let nap = self.cfg.poll_interval.min(left);
            if nap.is_zero() {
                break;
            }
            tokio::select! {
                _ = tokio::time::sleep(nap) => {}
                _ = st.wake.notified() => {}
                _ = self.stop.notify.notified() => {}
            }
        }
    }

    /// What a worker does after a successful cycle (the caller asks whether anything is left: an `async fn` of
    /// its own here would deepen every drain's future).
    fn after_cycle(&self, st: &DrainState, r: &CycleReport) -> Next {
        st.record(r);
        if r.outage {
            st.out.store(true, AtomicOrdering::Relaxed);
            return Next::Stop;
        }
        if r.full {
            return Next::Again;
        }
        if st.until == Until::Deadline || r.claimed > 0 {
            return Next::Nap;
        }
        if st.empty.load(AtomicOrdering::Relaxed) {
            return Next::Stop;
        }
        // Whether anything is left is asked at most once per poll interval, by whichever idle worker comes first:
        // the question scans the outbox, and every idle worker asking at every poll cost the database more than
        // the drain itself.
        if st.emptiness_check_due(self.cfg.poll_interval.as_millis() as u64) {
            Next::AskEmpty
        } else {
            Next::Nap
        }
    }

    /// Before any claim, and again after a cycle found QStash out. No outage recorded: [`Gate::Drain`]. An outage
    /// whose probe is due: take it (one relay wins), publish the probe's small claim, and drain only if QStash
    /// answered; with nothing to probe with, the outage is cleared and the next ordinary cycle finds out. An
    /// outage whose next probe is not due yet: if the probe comes at least one lease before `deadline` (so the
    /// claim after it can still be settled), wait for it — re-reading the outage row every poll interval, so
    /// another relay's successful probe ends the wait, interrupted by the [`StopHandle`] — and take it then; a
    /// relay that loses the probe, or whose probe fails, waits again while time allows. Otherwise
    /// [`Gate::Closed`]: publish nothing this invocation. With [`Until::Empty`] (the CLI) a wait ends as
    /// [`Gate::Empty`] once nothing is pending or awaiting evidence.
    async fn outage_gate(&self, st: &DrainState) -> Result<Gate, RelayError> {
        let (deadline, until) = (st.deadline, st.until);
        let mut announced = false;
        loop {
            let state = outage::load(&self.db).await.map_err(db("read outage"))?;
            if !state.active() {
                return Ok(Gate::Drain);
            }
            self.outage_hint.store(true, AtomicOrdering::Relaxed);
            // The probe's claim, like every claim, needs a whole lease before the deadline: only the time before
            // that can be spent waiting.
            let left = deadline.saturating_duration_since(Instant::now());
            let usable = left.saturating_sub(self.cfg.lease);
            let why = if self.stop.requested() {
                Some("stop requested")
            } else if left < self.cfg.lease || state.until_probe() > usable {
                Some("the next probe does not fit before this invocation's deadline")
            } else {
                None
            };
            if let Some(why) = why {
                log_waiting(&state, why);
                return Ok(Gate::Closed);
            }
            if until == Until::Empty && self.is_empty().await? {
                return Ok(Gate::Empty);
            }
            if state.waiting() {
                if !announced {
                    announced = true;
                    tracing::info!(
                        outage_secs = state.duration().as_secs_f64(),
                        failures = state.failures,
                        next_probe_in_secs = state.until_probe().as_secs_f64(),
                        "QStash outage: waiting for the next probe within this invocation"
                    );
                }
                self.nap(state.until_probe().min(self.cfg.poll_interval))
                    .await;
                continue;
            }
            if !outage::take_probe(&self.db, self.cfg.lease)
                .await
                .map_err(db("take outage probe"))?
            {
                // Another relay is probing: its success clears the row, its failure moves the next probe.
                self.nap(self.cfg.poll_interval.min(usable)).await;
                continue;
            }
            tracing::info!(failures = state.failures, "probing QStash after an outage");
            let r = self.run_probe_cycle().await?;
            st.record(&r);
            if r.outage {
                // The probe failed and the backoff moved the next one: wait again if the deadline allows.
                continue;
            }
            if r.requests_ok == 0
                && let Some(lasted) = outage::clear(&self.db).await.map_err(db("clear outage"))?
            {
                self.outage_hint.store(false, AtomicOrdering::Relaxed);
                tracing::info!(
                    outage_secs = lasted.as_secs_f64(),
                    "nothing to probe QStash with: outage cleared; the next publish tells"
                );
            }
            return Ok(Gate::Drain);
        }
    }

    /// Sleeps for `d`, or until a stop is requested ([`StopHandle::stop`]).
    async fn nap(&self, d: Duration) {
        let stopped = self.stop.notify.notified();
        tokio::pin!(stopped);
        // Registered before the flag is read: a stop between the two still wakes this nap.
        stopped.as_mut().enable();
        if self.stop.requested() || d.is_zero() {
            return;
        }
        tokio::select! {
            _ = tokio::time::sleep(d) => {}
            _ = stopped => {}
        }
    }

    /// True when no event is pending and no ordered head awaits delivery evidence.
    pub async fn is_empty(&self) -> Result<bool, RelayError> {
        // The keys first: while ordered messages await evidence that answers at once, whereas the pending scan
        // walks every row version the drain left behind in the pending index.
        let sql = crate::schema::q(
            "SELECT EXISTS (SELECT 1 FROM {schema}.outbox_keys WHERE inflight_id IS NOT NULL) \
             OR EXISTS (SELECT 1 FROM {schema}.outbox WHERE dispatched_at IS NULL AND dead_lettered_at IS NULL)",
        );
        let busy: bool = self
            .db
            .run(async |c| self.db.query_scalar(sql).fetch_one(c).await)
            .await
            .map_err(db("emptiness check"))?;
        Ok(!busy)
    }

    /// Wakes idle workers on `NOTIFY outbox_new` (optional; `docs/configuration.md` says why it is off by default: poolers and the commit lock).
    /// Returns only if listening fails, after which the workers fall back to polling.
    async fn listen(&self, wake: Arc<Notify>, stop: Arc<Notify>) {
        let mut listener = match sqlx::postgres::PgListener::connect_with(self.db.pool()).await {
            Ok(l) => l,
            Err(e) => {
                tracing::warn!(error = %e, "LISTEN unavailable; polling only");
                return std::future::pending().await;
            }
        };
        if let Err(e) = listener.listen(crate::producer::NOTIFY_CHANNEL).await {
            tracing::warn!(error = %e, "LISTEN failed; polling only");
            return std::future::pending().await;
        }
        loop {
            tokio::select! {
                n = listener.recv() => match n {
                    Ok(_) => wake.notify_waiters(),
                    Err(e) => {
                        tracing::warn!(error = %e, "LISTEN connection lost; polling only");
                        return std::future::pending().await;
                    }
                },
                _ = stop.notified() => return,
            }
        }
    }
}

/// What the outage gate decided.
enum Gate {
    /// No outage (any more): claim and publish.
    Drain,
    /// An outage whose next probe cannot be taken before the deadline (or a stop was requested): publish nothing.
    Closed,
    /// Waiting during an outage, the CLI's drain found nothing left to do.
    Empty,
}

/// What a worker does next.
enum Next {
    /// Claim again at once: the claim came back full.
    Again,
    /// Nap for the poll interval (or until a `NOTIFY`), then claim.
    Nap,
    /// Ask whether anything is left: stop if not, else nap.
    AskEmpty,
    /// Stop this worker.
    Stop,
}

/// What the workers (and the outage gate) of one drain share.
struct DrainState {
    deadline: Instant,
    until: Until,
    /// Notified on `NOTIFY outbox_new`.
    wake: Arc<Notify>,
    totals: Totals,
    latencies: Mutex<Vec<Duration>>,
    claim_latencies: Mutex<Vec<Duration>>,
    /// The error that stopped a worker (three failed cycles in a row).
    last_error: Mutex<Option<RelayError>>,
    /// A cycle found QStash out: every worker stops.
    out: AtomicBool,
    /// The CLI's drain found nothing left.
    empty: AtomicBool,
    started: Instant,
    /// Milliseconds after `started` of the last emptiness check (0: none yet).
    last_emptiness_check: AtomicU64,
}

impl DrainState {
    fn new(deadline: Instant, until: Until) -> Self {
        DrainState {
            deadline,
            until,
            wake: Arc::new(Notify::new()),
            totals: Totals::default(),
            latencies: Mutex::new(Vec::new()),
            claim_latencies: Mutex::new(Vec::new()),
            last_error: Mutex::new(None),
            out: AtomicBool::new(false),
            empty: AtomicBool::new(false),
            started: Instant::now(),
            last_emptiness_check: AtomicU64::new(0),
        }
    }

    /// Adds a cycle's figures.
    fn record(&self, r: &CycleReport) {
        self.totals.add(r);
        if let Ok(mut l) = self.latencies.lock() {
            l.extend(r.publish_latencies.iter().copied());
        }
        if let Ok(mut l) = self.claim_latencies.lock() {
            l.push(r.claim_latency);
        }
    }

    /// True for the one caller that may ask whether anything is left now (at most once per `poll_ms`).
    fn emptiness_check_due(&self, poll_ms: u64) -> bool {
        let now = self.started.elapsed().as_millis() as u64;
        let last = self.last_emptiness_check.load(AtomicOrdering::Relaxed);
        (last == 0 || now >= last + poll_ms)
            && self
                .last_emptiness_check
                .compare_exchange(
                    last,
                    now.max(1),
                    AtomicOrdering::Relaxed,
                    AtomicOrdering::Relaxed,
                )
                .is_ok()
    }

    /// The drain's summary, with the outage row as read at its end.
    fn summary(self, state: &OutageState, gate_empty: bool) -> DrainSummary {
        let publish = sorted(self.latencies.into_inner().unwrap_or_default());
        let claim = sorted(self.claim_latencies.into_inner().unwrap_or_default());
        let t = &self.totals;
        let out = self.out.load(AtomicOrdering::Relaxed);
        DrainSummary {
            cycles: t.cycles.load(AtomicOrdering::Relaxed),
            claimed: t.claimed.load(AtomicOrdering::Relaxed),
            dispatched: t.dispatched.load(AtomicOrdering::Relaxed),
            retried: t.retried.load(AtomicOrdering::Relaxed),
            dead_lettered: t.dead.load(AtomicOrdering::Relaxed),
            fenced: t.fenced.load(AtomicOrdering::Relaxed),
            errors: t.errors.load(AtomicOrdering::Relaxed),
            config_problems: t.config_problems.load(AtomicOrdering::Relaxed),
            released: t.released.load(AtomicOrdering::Relaxed),
            qstash_outage: state.active(),
            outage_secs: state.duration().as_secs_f64(),
            publish_p50_ms: percentile_ms(&publish, 0.5),
            publish_p99_ms: percentile_ms(&publish, 0.99),
            claim_p50_ms: percentile_ms(&claim, 0.5),
            claim_p99_ms: percentile_ms(&claim, 0.99),
            stopped: if out {
                "outage"
            } else if gate_empty || (self.until == Until::Empty && Instant::now() < self.deadline) {
                "empty"
            } else {
                "deadline"
            },
        }
    }
}

fn sorted(mut v: Vec<Duration>) -> Vec<Duration> {
    v.sort();
    v
}

/// The nearest-rank percentile `p` of sorted durations, in ms (0 when there are none).
fn percentile_ms(sorted: &[Duration], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i].as_secs_f64() * 1000.0
}

#[derive(Default)]
struct Totals {
    cycles: AtomicU64,
    claimed: AtomicU64,
    dispatched: AtomicU64,
    retried: AtomicU64,
    dead: AtomicU64,
    fenced: AtomicU64,
    errors: AtomicU64,
    config_problems: AtomicU64,
    released: AtomicU64,
}

impl Totals {
    fn add(&self, r: &CycleReport) {
        if r.claimed > 0 {
            self.cycles.fetch_add(1, AtomicOrdering::Relaxed);
        }
        self.claimed.fetch_add(r.claimed, AtomicOrdering::Relaxed);
        self.dispatched
            .fetch_add(r.settled.dispatched, AtomicOrdering::Relaxed);
        self.retried
            .fetch_add(r.settled.retried, AtomicOrdering::Relaxed);
        self.dead.fetch_add(r.settled.dead, AtomicOrdering::Relaxed);
        self.fenced.fetch_add(r.fenced, AtomicOrdering::Relaxed);
        self.config_problems
            .fetch_add(r.config_problems, AtomicOrdering::Relaxed);
        self.released
            .fetch_add(r.settled.released, AtomicOrdering::Relaxed);
    }
}

fn log_waiting(state: &OutageState, why: &str) {
    tracing::warn!(
        outage_secs = state.duration().as_secs_f64(),
        failures = state.failures,
        next_probe_in_secs = state.until_probe().as_secs_f64(),
        last_error = state.last_error.as_deref().unwrap_or(""),
        "QStash outage: publishing nothing this invocation ({why})"
    );
}
