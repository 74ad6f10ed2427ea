//! Guarantee 1 in transit — **no event is lost between the outbox and QStash** — and the relay side of
//! per-key order.
//!
//! One cycle is three short steps, never a lock held across the network (pitfall P6):
//!
//! 1. **Claim** ([`claim`]) in one committed statement per kind of topic: due rows (unordered) or key heads
//!    (ordered, see [`crate::ordering`]) get a lease with a fencing token, and their attempt is counted.
//! 2. **Publish** outside any transaction, through `/v2/batch`: `Upstash-Deduplication-Id: outbox-<id>`, the
//!    event's identity in the signed envelope ([`crate::contract`]), per-key flow control, retries and the failure callback from
//!    config; ordered heads also carry the delivery callback that frees their key.
//! 3. **Settle** ([`settle`]) in one statement, fenced on the lease token: dispatched, retry with full-jitter
//!    backoff ([`backoff`]), or dead letter. A relay whose lease was taken over changes nothing.
//!
//! Nothing is lost when a relay dies anywhere in between: an unsettled lease simply expires and the row is
//! claimed again; a publish whose response was lost is retried with the same deduplication id (QStash returns
//! the first message id inside its 10-minute window; after it, the consumer's dedupe absorbs the duplicate).
//! [`Relay::drain`] repeats cycles until the invocation's deadline; the retry budget ends in `dead_letters`.

pub mod backoff;
pub mod claim;
pub mod handler;
pub mod housekeeping;
pub mod settle;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering as AtomicOrdering};
use std::time::{Duration, Instant};

use serde::Serialize;
use sqlx::PgPool;
use tokio::sync::Notify;

use crate::config::{DeadHeadPolicy, EvidenceMode, QstashConfig, RelayConfig};
use crate::contract;
use crate::qstash::{
    FlowControl, Message, PublishOptions, PublishOutcome, QstashClient, flow_control_key,
};
use backoff::Backoff;
use claim::{ClaimStatements, ClaimedEvent};
use settle::{SettleCounts, SettleItem, Settlement};

/// A relay failure that ends an invocation.
#[derive(Debug, thiserror::Error)]
pub enum RelayError {
    /// A database statement failed.
    #[error("database error during {step}")]
    Database {
        /// Which step.
        step: &'static str,
        /// The cause.
        #[source]
        source: sqlx::Error,
    },
}

fn db(step: &'static str) -> impl FnOnce(sqlx::Error) -> RelayError {
    move |source| RelayError::Database { step, source }
}

/// What one cycle did.
#[derive(Debug, Clone, Default)]
pub struct CycleReport {
    /// Events claimed.
    pub claimed: u64,
    /// Rows changed by the settle.
    pub settled: SettleCounts,
    /// Claimed rows the settle did not change: another relay took the lease over (fencing).
    pub fenced: u64,
    /// A claim came back full: more is probably waiting.
    pub full: bool,
    /// Duration of each `/v2/batch` request.
    pub publish_latencies: Vec<Duration>,
    /// Transient publish failures caused by configuration (token, base URL).
    pub config_problems: u64,
}

/// What one invocation's drain did.
#[derive(Debug, Clone, Default, Serialize)]
pub struct DrainSummary {
    /// Cycles run.
    pub cycles: u64,
    /// Events claimed.
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
    /// Median `/v2/batch` latency, ms.
    pub publish_p50_ms: f64,
    /// 99th percentile `/v2/batch` latency, ms.
    pub publish_p99_ms: f64,
    /// Why the drain stopped.
    pub stopped: &'static str,
}

/// The relay: pool, QStash client and settings, built once per process (cold start) and reused.
pub struct Relay {
    stop: Arc<StopSignal>,
    pool: PgPool,
    client: QstashClient,
    cfg: RelayConfig,
    qstash: QstashConfig,
    claims: ClaimStatements,
    persistent: bool,
    backoff: Backoff,
}

impl Relay {
    /// Builds a relay.
    pub fn new(
        pool: PgPool,
        client: QstashClient,
        cfg: RelayConfig,
        qstash: QstashConfig,
        persistent: bool,
    ) -> Self {
        Relay {
            stop: Arc::new(StopSignal::default()),
            claims: ClaimStatements::new(cfg.batch_size, persistent),
            backoff: Backoff {
                base: cfg.backoff_base,
                cap: cfg.backoff_cap,
            },
            pool,
            client,
            cfg,
            qstash,
            persistent,
        }
    }

    /// A handle that asks running drains to stop after their current cycle (every claim is still settled).
    /// Used by the local pipeline's Ctrl-C; Lambda invocations simply end at their deadline.
    pub fn stop_handle(&self) -> StopHandle {
        StopHandle(self.stop.clone())
    }

    /// The pool.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The relay settings.
    pub fn config(&self) -> &RelayConfig {
        &self.cfg
    }

    /// The claim statements (for plan inspection in tests and benchmarks).
    pub fn claim_statements(&self) -> &ClaimStatements {
        &self.claims
    }

    /// Step 1: claims unordered events and ordered key heads (each up to the batch size).
    pub async fn claim(&self) -> Result<Vec<ClaimedEvent>, RelayError> {
        let mut conn = self.pool.acquire().await.map_err(db("acquire"))?;
        let lease = self.cfg.lease.as_secs_f64();
        let mut events = self
            .claims
            .claim_unordered(&mut conn, lease)
            .await
            .map_err(db("claim"))?;
        let ordered = self
            .claims
            .claim_ordered(&mut conn, lease)
            .await
            .map_err(db("claim ordered keys"))?;
        events.extend(ordered);
        Ok(events)
    }

    /// The QStash message for a claimed event (the relay half of [`crate::contract`]): everything that decides a
    /// write is in the signed envelope body and the signed destination URL; `x-outbox-id` and `traceparent` are
    /// informational header copies.
    pub fn message_for(&self, ev: &ClaimedEvent) -> Message {
        let id = ev.id.to_string();
        let mut headers: Vec<(&str, &str)> = Vec::with_capacity(2);
        if let Some(tp) = &ev.headers.traceparent {
            headers.push((contract::TRACEPARENT, tp));
        }
        if let Some(c) = &ev.headers.correlation_id {
            headers.push((contract::CORRELATION_ID, c));
        }
        let cb = &self.qstash.callback_url;
        let ordered = ev.seq.is_some();
        let by_consumer = ordered && self.cfg.ordered_evidence == EvidenceMode::Consumer;
        let evidence = ordered.then_some(if by_consumer {
            contract::Evidence::Consumer
        } else {
            contract::Evidence::Callback
        });
        let body = contract::write_envelope(
            &ev.topic,
            evidence,
            &[contract::WireEvent {
                id: ev.id,
                key: &ev.partition_key,
                seq: ev.seq,
                created_at: ev.created_at,
                schema_version: ev.headers.schema_version,
                headers: &headers,
                payload: &ev.payload,
            }],
        );
        let mut forward: Vec<(crate::qstash::HeaderName, String)> = Vec::with_capacity(2);
        forward.push((contract::OUTBOX_ID.into(), id));
        if let Some(tp) = &ev.headers.traceparent {
            forward.push((contract::TRACEPARENT.into(), tp.clone()));
        }
        let callback = ordered && !by_consumer;
        Message {
            destination: contract::destination(&self.qstash.consumer_url, &ev.topic),
            body,
            options: PublishOptions {
                content_type: Some("application/json".into()),
                deduplication_id: Some(contract::dedup_id(ev.id, ev.redrive_count)),
                retries: Some(self.qstash.retries),
                timeout: self.qstash.delivery_timeout,
                failure_callback: Some(format!("{cb}{}", contract::FAILURE_PATH)),
                callback: callback.then(|| format!("{cb}{}", contract::DELIVERED_PATH)),
                forward,
                flow_control: Some(FlowControl {
                    key: flow_control_key(&format!("{}.{}", ev.topic, ev.partition_key)),
                    parallelism: Some(self.qstash.flow_parallelism),
                    rate: self.qstash.flow_rate,
                    period: self.qstash.flow_rate.map(|_| self.qstash.flow_period),
                }),
                label: Some(ev.topic.clone()),
                ..Default::default()
            },
        }
    }

    /// Step 2: publishes events through `/v2/batch` (requests of `QSTASH_BATCH_SIZE` run concurrently). Returns
    /// one outcome per event, in order, and the latency of each request.
    pub async fn publish(&self, events: &[ClaimedEvent]) -> (Vec<PublishOutcome>, Vec<Duration>) {
        let messages: Vec<Message> = events.iter().map(|e| self.message_for(e)).collect();
        let chunk = self.qstash.batch_size.max(1) as usize;
        let requests = messages.chunks(chunk).map(|c| async move {
            let t = Instant::now();
            let mut out = self.client.batch(c).await;
            // A permanent refusal of a whole multi-message request (e.g. 413: the batch is too large) says nothing
            // about each message: ask again one by one so only the culprits are dead-lettered.
            if c.len() > 1
                && out
                    .first()
                    .is_some_and(|o| matches!(o, PublishOutcome::Permanent { .. }))
                && all_equal(&out)
            {
                out = futures::future::join_all(c.iter().map(|m| self.client.publish(m))).await;
            }
            (out, t.elapsed())
        });
        let results = futures::future::join_all(requests).await;
        let mut outcomes = Vec::with_capacity(events.len());
        let mut latencies = Vec::with_capacity(results.len());
        for (o, l) in results {
            outcomes.extend(o);
            latencies.push(l);
        }
        (outcomes, latencies)
    }

    /// Decides what to record for each event (pure: no I/O).
    pub fn decide(&self, events: &[ClaimedEvent], outcomes: &[PublishOutcome]) -> Vec<SettleItem> {
        let mut rng = rand::rng();
        let max = self.cfg.max_attempts as i32;
        events
            .iter()
            .zip(outcomes)
            .map(|(ev, outcome)| {
                let skip_key = self.cfg.dead_head_policy(&ev.topic) == DeadHeadPolicy::Skip;
                let settlement = match outcome {
                    PublishOutcome::Accepted { message_id, .. } => Settlement::Dispatched {
                        message_id: message_id.clone(),
                    },
                    PublishOutcome::Permanent { status, error } => Settlement::Dead {
                        error: format!("QStash refused the message (HTTP {status}): {error}"),
                        status: Some(*status),
                        skip_key,
                    },
                    PublishOutcome::Transient {
                        error,
                        retry_after,
                        status,
                        ..
                    } => {
                        if ev.attempts >= max {
                            Settlement::Dead {
                                error: format!(
                                    "retry budget of {max} attempts exhausted; last error: {error}"
                                ),
                                status: *status,
                                skip_key,
                            }
                        } else {
                            Settlement::Retry {
                                delay: self.backoff.next_delay(
                                    ev.attempts.max(0) as u32,
                                    *retry_after,
                                    &mut rng,
                                ),
                                error: format!("attempt {}: {error}", ev.attempts),
                            }
                        }
                    }
                };
                SettleItem {
                    id: ev.id,
                    lease_token: ev.lease_token,
                    settlement,
                }
            })
            .collect()
    }

    /// Step 3: settles in one fenced statement.
    pub async fn settle(&self, items: &[SettleItem]) -> Result<SettleCounts, RelayError> {
        let mut conn = self.pool.acquire().await.map_err(db("acquire"))?;
        settle::settle(&mut conn, items, self.cfg.evidence_timeout, self.persistent)
            .await
            .map_err(db("settle"))
    }

    /// One full cycle: claim, publish, settle. Events whose budget was already used up by earlier claims (the
    /// relay died mid-attempt) are dead-lettered without another publish.
    #[tracing::instrument(name = "relay.cycle", skip_all)]
    pub async fn run_cycle(&self) -> Result<CycleReport, RelayError> {
        let events = self.claim().await?;
        if events.is_empty() {
            return Ok(CycleReport::default());
        }
        let max = self.cfg.max_attempts as i32;
        let (exhausted, to_publish): (Vec<ClaimedEvent>, Vec<ClaimedEvent>) =
            events.iter().cloned().partition(|e| e.attempts > max);
        let (outcomes, latencies) = self.publish(&to_publish).await;
        let mut items = self.decide(&to_publish, &outcomes);
        for ev in &exhausted {
            let skip_key = self.cfg.dead_head_policy(&ev.topic) == DeadHeadPolicy::Skip;
            items.push(SettleItem {
                id: ev.id,
                lease_token: ev.lease_token,
                settlement: Settlement::Dead {
                    error: format!(
                        "retry budget of {max} attempts exhausted (attempt {} was claimed but never settled: the relay \
                         stopped mid-attempt); last error: {}",
                        ev.attempts - 1,
                        ev.last_error.as_deref().unwrap_or("none")
                    ),
                    status: None,
                    skip_key,
                },
            });
        }
        for (item, ev) in items.iter().zip(to_publish.iter().chain(exhausted.iter())) {
            if let Settlement::Dead { error, .. } = &item.settlement {
                tracing::warn!(outbox_id = ev.id, topic = %ev.topic, key = %ev.partition_key, attempt = ev.attempts,
                    error = %error, "dead-lettering event");
            }
        }
        let settled = self.settle(&items).await?;
        let claimed = events.len() as u64;
        let batch = u64::from(self.cfg.batch_size);
        let unordered = events.iter().filter(|e| e.seq.is_none()).count() as u64;
        Ok(CycleReport {
            claimed,
            fenced: claimed.saturating_sub(settled.total()),
            settled,
            full: unordered >= batch || claimed - unordered >= batch,
            publish_latencies: latencies,
            config_problems: outcomes
                .iter()
                .filter(|o| {
                    matches!(
                        o,
                        PublishOutcome::Transient {
                            config_problem: true,
                            ..
                        }
                    )
                })
                .count() as u64,
        })
    }

    /// Runs cycles (`RELAY_CONCURRENCY` at once) until `deadline`: again at once while claims come back full,
    /// otherwise after the poll interval (or a `NOTIFY`, when enabled). Never claims with less time left than
    /// the lease, so every claim can be settled before the invocation ends.
    pub async fn drain(&self, deadline: Instant) -> Result<DrainSummary, RelayError> {
        self.drain_with(deadline, false).await
    }

    /// [`Relay::drain`], optionally stopping early once nothing is pending or awaiting delivery evidence (the
    /// CLI's `outbox relay --until-empty` and the benchmarks).
    pub async fn drain_with(
        &self,
        deadline: Instant,
        stop_when_empty: bool,
    ) -> Result<DrainSummary, RelayError> {
        let wake = Arc::new(Notify::new());
        let stop = Arc::new(Notify::new());
        let totals = Totals::default();
        let latencies = std::sync::Mutex::new(Vec::<Duration>::new());
        let last_error: std::sync::Mutex<Option<RelayError>> = std::sync::Mutex::new(None);

        let worker = |n: u32| {
            let wake = wake.clone();
            let totals = &totals;
            let latencies = &latencies;
            let last_error = &last_error;
            async move {
                let mut consecutive_errors = 0u32;
                // Stagger workers a little so their claims do not collide on the same index pages.
                if n > 0 {
                    tokio::time::sleep(Duration::from_millis(5 * u64::from(n))).await;
                }
                loop {
                    let left = deadline.saturating_duration_since(Instant::now());
                    if left < self.cfg.lease || self.stop.requested() {
                        break;
                    }
                    match self.run_cycle().await {
                        Ok(r) => {
                            consecutive_errors = 0;
                            totals.add(&r);
                            if let Ok(mut l) = latencies.lock() {
                                l.extend(r.publish_latencies.iter().copied());
                            }
                            if r.full {
                                continue;
                            }
                            if stop_when_empty
                                && r.claimed == 0
                                && self.is_empty().await.unwrap_or(false)
                            {
                                break;
                            }
                        }
                        Err(e) => {
                            totals.errors.fetch_add(1, AtomicOrdering::Relaxed);
                            consecutive_errors += 1;
                            tracing::error!(error = %e, cause = ?std::error::Error::source(&e), "relay cycle failed");
                            if consecutive_errors >= 3 {
                                if let Ok(mut slot) = last_error.lock() {
                                    *slot = Some(e);
                                }
                                break;
                            }
                        }
                    }
                    let left = deadline
                        .saturating_duration_since(Instant::now())
                        .saturating_sub(self.cfg.lease);
                    let nap = self.cfg.poll_interval.min(left);
                    if nap.is_zero() {
                        break;
                    }
                    tokio::select! {
                        _ = tokio::time::sleep(nap) => {}
                        _ = wake.notified() => {}
                        _ = self.stop.notify.notified() => {}
                    }
                }
            }
        };
        let workers = futures::future::join_all((0..self.cfg.concurrency.max(1)).map(worker));
        if self.cfg.listen_notify {
            let listener = self.listen(wake.clone(), stop.clone());
            tokio::pin!(listener);
            tokio::select! {
                _ = workers => {}
                _ = &mut listener => {}
            }
            stop.notify_waiters();
        } else {
            workers.await;
        }
        if let Ok(mut slot) = last_error.lock()
            && let Some(e) = slot.take()
        {
            return Err(e);
        }
        let mut lat = latencies.into_inner().unwrap_or_default();
        lat.sort();
        let pct = |p: f64| -> f64 {
            if lat.is_empty() {
                return 0.0;
            }
            let i = ((lat.len() - 1) as f64 * p).round() as usize;
            lat[i].as_secs_f64() * 1000.0
        };
        Ok(DrainSummary {
            cycles: totals.cycles.load(AtomicOrdering::Relaxed),
            claimed: totals.claimed.load(AtomicOrdering::Relaxed),
            dispatched: totals.dispatched.load(AtomicOrdering::Relaxed),
            retried: totals.retried.load(AtomicOrdering::Relaxed),
            dead_lettered: totals.dead.load(AtomicOrdering::Relaxed),
            fenced: totals.fenced.load(AtomicOrdering::Relaxed),
            errors: totals.errors.load(AtomicOrdering::Relaxed),
            config_problems: totals.config_problems.load(AtomicOrdering::Relaxed),
            publish_p50_ms: pct(0.5),
            publish_p99_ms: pct(0.99),
            stopped: if stop_when_empty && Instant::now() < deadline {
                "empty"
            } else {
                "deadline"
            },
        })
    }

    /// True when no event is pending and no ordered head awaits delivery evidence.
    pub async fn is_empty(&self) -> Result<bool, RelayError> {
        let busy: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM outbox WHERE dispatched_at IS NULL AND dead_lettered_at IS NULL) \
                 OR EXISTS (SELECT 1 FROM outbox_keys WHERE inflight_id IS NOT NULL)",
        )
        .persistent(self.persistent)
        .fetch_one(&self.pool)
        .await
        .map_err(db("emptiness check"))?;
        Ok(!busy)
    }

    /// Wakes idle workers on `NOTIFY outbox_new` (optional; see the README on poolers and the commit lock).
    /// Returns only if listening fails, after which the workers fall back to polling.
    async fn listen(&self, wake: Arc<Notify>, stop: Arc<Notify>) {
        let mut listener = match sqlx::postgres::PgListener::connect_with(&self.pool).await {
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

#[derive(Default)]
struct StopSignal {
    flag: std::sync::atomic::AtomicBool,
    notify: Notify,
}

impl StopSignal {
    fn requested(&self) -> bool {
        self.flag.load(AtomicOrdering::SeqCst)
    }
}

/// Asks a [`Relay`]'s drains to stop after their current cycle.
#[derive(Clone)]
pub struct StopHandle(Arc<StopSignal>);

impl StopHandle {
    /// Requests the stop (idempotent).
    pub fn stop(&self) {
        self.0.flag.store(true, AtomicOrdering::SeqCst);
        self.0.notify.notify_waiters();
    }

    /// Whether a stop was requested.
    pub fn is_stopped(&self) -> bool {
        self.0.requested()
    }
}

fn all_equal(v: &[PublishOutcome]) -> bool {
    v.windows(2).all(|w| w[0] == w[1])
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
    }
}

impl From<RelayError> for lambda_runtime::Diagnostic {
    fn from(e: RelayError) -> Self {
        let mut message = e.to_string();
        let mut source = std::error::Error::source(&e);
        while let Some(s) = source {
            message.push_str(": ");
            message.push_str(&s.to_string());
            source = s.source();
        }
        lambda_runtime::Diagnostic {
            error_type: "RelayError".into(),
            error_message: message,
        }
    }
}
