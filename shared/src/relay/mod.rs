//! Guarantee 1 in transit — **no event is lost between the outbox and QStash** — and the relay side of
//! per-key order.
//!
//! One cycle is three short steps, never a lock held across the network (publishing inside the claim's
//! transaction would keep row locks and an old snapshot open for a network round trip, and leave the transaction
//! idle when the Lambda times out):
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
//!
//! A cycle whose every publish request failed at request level (QStash down, unreachable, refusing the token
//! or URL, rate-limiting the account) is an outage, not each event's failure: the claim is given back without
//! spending an attempt and the relays wait for a shared probe ([`outage`], decision record 0012).
//!
//! *Lease*, *fencing token* and *dead letter* are defined in the repository's `docs/glossary.md`.

pub mod backoff;
pub mod claim;
mod drain;
pub mod handler;
pub mod housekeeping;
pub mod outage;
pub mod settle;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering as AtomicOrdering};
use std::time::{Duration, Instant};

use sqlx::PgPool;

use crate::config::{DeadHeadPolicy, EvidenceMode, QstashConfig, RelayConfig};
use crate::contract;
use crate::qstash::{
    FlowControl, Message, PublishOptions, PublishOutcome, QstashClient, flow_control_key,
    request_level_failure,
};
use backoff::Backoff;
use claim::{ClaimStatements, ClaimedEvent};
use drain::StopSignal;
pub use drain::{DrainSummary, StopHandle};
use settle::{SettleCounts, SettleItem, Settlement};

/// A relay failure that ends an invocation.
#[derive(Debug, thiserror::Error)]
pub enum RelayError {
    /// A database statement failed.
    #[error("database error during {step}")]
    Database {
        /// Which step.
        step: &'static str,
        #[source]
        source: sqlx::Error,
    },
    /// The invocation cannot hold one lease plus the deadline margin, so it would claim nothing: refused rather
    /// than reported as an empty success ([`RelayConfig::check_invocation_budget`]).
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
}

fn db(step: &'static str) -> impl FnOnce(sqlx::Error) -> RelayError {
    move |source| RelayError::Database { step, source }
}

/// What one cycle did.
#[derive(Debug, Clone, Default)]
pub struct CycleReport {
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
    /// Publish requests QStash answered (any 2xx, or a verdict on the message).
    pub requests_ok: u64,
    /// Publish requests that failed at request level ([`request_level_failure`]).
    pub requests_failed: u64,
    /// Every publish request failed at request level: QStash is out, the claim was released and the outage
    /// recorded; the drain stops publishing.
    pub outage: bool,
}

/// What [`Relay::publish_classified`] found.
#[derive(Debug, Clone, Default)]
pub struct Published {
    /// One outcome per event, in order.
    pub outcomes: Vec<PublishOutcome>,
    /// Per event: its request failed at request level, so the outcome says nothing about the event.
    pub request_level: Vec<bool>,
    /// Requests answered.
    pub requests_ok: u64,
    /// Requests failed at request level.
    pub requests_failed: u64,
    /// Duration of each `/v2/batch` request.
    pub latencies: Vec<Duration>,
}

impl Published {
    /// Every request failed at request level (and there was at least one): an outage.
    pub fn is_outage(&self) -> bool {
        self.requests_failed > 0 && self.requests_ok == 0
    }

    /// The first request-level error, for the outage record.
    pub fn first_request_error(&self) -> Option<String> {
        self.outcomes
            .iter()
            .zip(&self.request_level)
            .find(|(_, rl)| **rl)
            .map(|(o, _)| match o {
                PublishOutcome::Transient { error, .. } => error.clone(),
                other => format!("{other:?}"),
            })
    }
}

/// The relay: pool, QStash client and settings, built once per process (cold start) and reused.
pub struct Relay {
    stop: Arc<StopSignal>,
    pool: PgPool,
    client: QstashClient,
    cfg: RelayConfig,
    qstash: QstashConfig,
    claims: ClaimStatements,
    probe_claims: ClaimStatements,
    persistent: bool,
    backoff: Backoff,
    probe_backoff: outage::ProbeBackoff,
    /// This process has seen an outage recorded that it has not seen cleared: a successful cycle clears the row
    /// (without the hint, successful cycles skip that statement).
    outage_hint: AtomicBool,
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
            probe_claims: ClaimStatements::new(1, persistent),
            backoff: Backoff {
                base: cfg.backoff_base,
                cap: cfg.backoff_cap,
            },
            probe_backoff: outage::ProbeBackoff {
                base: cfg.outage_probe_base,
                cap: cfg.outage_probe_cap,
            },
            outage_hint: AtomicBool::new(false),
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
        self.claim_with(&self.claims).await
    }

    async fn claim_with(&self, claims: &ClaimStatements) -> Result<Vec<ClaimedEvent>, RelayError> {
        let mut conn = self.pool.acquire().await.map_err(db("acquire"))?;
        let lease = self.cfg.lease.as_secs_f64();
        let mut events = claims
            .claim_unordered(&mut conn, lease)
            .await
            .map_err(db("claim"))?;
        let ordered = claims
            .claim_ordered(&mut conn, lease)
            .await
            .map_err(db("claim ordered keys"))?;
        events.extend(ordered);
        Ok(events)
    }

    /// The QStash message for a claimed event (the relay half of [`crate::contract`]): everything that decides a
    /// write is in the signed envelope body and the signed destination URL; `x-outbox-id` and `traceparent` are
    /// informational header copies. The application's own headers travel in the envelope only (decision record
    /// 0026).
    pub fn message_for(&self, ev: &ClaimedEvent) -> Message {
        let id = ev.id.to_string();
        let mut headers: Vec<(&str, &str)> = Vec::with_capacity(2 + ev.headers.user.len());
        if let Some(tp) = &ev.headers.traceparent {
            headers.push((contract::TRACEPARENT, tp));
        }
        if let Some(c) = &ev.headers.correlation_id {
            headers.push((contract::CORRELATION_ID, c));
        }
        // The producer refused reserved names; a row written by hand could still hold one, and it must not
        // shadow the pipeline's own entries in the envelope.
        headers.extend(
            ev.headers
                .user
                .iter()
                .filter(|(name, _)| !crate::headers::is_reserved(name))
                .map(|(n, v)| (n.as_str(), v.as_str())),
        );
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
        let p = self.publish_classified(events).await;
        (p.outcomes, p.latencies)
    }

    /// [`Relay::publish`], also telling which events' requests failed at request level and how many requests
    /// were answered or failed that way (the outage decision).
    pub async fn publish_classified(&self, events: &[ClaimedEvent]) -> Published {
        let messages: Vec<Message> = events.iter().map(|e| self.message_for(e)).collect();
        let chunk = self.qstash.batch_size.max(1) as usize;
        let requests = messages.chunks(chunk).map(|c| async move {
            let t = Instant::now();
            let resp = self.client.batch_classified(c).await;
            let out = resp.outcomes;
            // A permanent refusal of a whole multi-message request (e.g. 413: the batch is too large) says nothing
            // about each message: ask again one by one so only the culprits are dead-lettered.
            if c.len() > 1
                && out
                    .first()
                    .is_some_and(|o| matches!(o, PublishOutcome::Permanent { .. }))
                && all_equal(&out)
            {
                let out: Vec<PublishOutcome> =
                    futures::future::join_all(c.iter().map(|m| self.client.publish(m))).await;
                // Each single publish is a request of its own: its failure is request-level or the message's.
                let rl: Vec<bool> = out.iter().map(request_level_failure).collect();
                let failed = rl.iter().filter(|r| **r).count() as u64;
                return (out, rl, rl_len_ok(c.len(), failed), failed, t.elapsed());
            }
            let failed = u64::from(resp.request_failed);
            let rl = vec![resp.request_failed; out.len()];
            (out, rl, 1 - failed, failed, t.elapsed())
        });
        let results = futures::future::join_all(requests).await;
        let mut p = Published {
            outcomes: Vec::with_capacity(events.len()),
            request_level: Vec::with_capacity(events.len()),
            latencies: Vec::with_capacity(results.len()),
            ..Published::default()
        };
        for (o, rl, ok, failed, l) in results {
            p.requests_ok += ok;
            p.requests_failed += failed;
            p.outcomes.extend(o);
            p.request_level.extend(rl);
            p.latencies.push(l);
        }
        p
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
    /// relay died mid-attempt) are dead-lettered without another publish. Events whose publish request failed at
    /// request level are released without spending their attempt; when that was every request, the outage is
    /// recorded ([`CycleReport::outage`]). Does not look at a recorded outage: [`Relay::drain`] does.
    #[tracing::instrument(name = "relay.cycle", skip_all)]
    pub async fn run_cycle(&self) -> Result<CycleReport, RelayError> {
        self.run_cycle_with(&self.claims, false).await
    }

    /// One cycle with the probe's claim of one event per kind of topic; an outage counts as a failed probe.
    pub async fn run_probe_cycle(&self) -> Result<CycleReport, RelayError> {
        self.run_cycle_with(&self.probe_claims, true).await
    }

    async fn run_cycle_with(
        &self,
        claims: &ClaimStatements,
        probe: bool,
    ) -> Result<CycleReport, RelayError> {
        let events = self.claim_with(claims).await?;
        if events.is_empty() {
            return Ok(CycleReport::default());
        }
        let max = self.cfg.max_attempts as i32;
        let (exhausted, to_publish): (Vec<ClaimedEvent>, Vec<ClaimedEvent>) =
            events.iter().cloned().partition(|e| e.attempts > max);
        let published = self.publish_classified(&to_publish).await;
        let outcomes = &published.outcomes;
        let mut items = self.decide(&to_publish, outcomes);
        // Request-level failures say nothing about the events: give them back, attempt unspent. In a mixed cycle
        // (some requests answered) this is all that happens to them; when no request was answered it is an outage.
        for (item, rl) in items.iter_mut().zip(&published.request_level) {
            if *rl {
                item.settlement = Settlement::Release;
            }
        }
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
        let outage = published.is_outage();
        if outage {
            let error = published
                .first_request_error()
                .unwrap_or_else(|| "publish request failed".into());
            let mut conn = self.pool.acquire().await.map_err(db("acquire"))?;
            let state = outage::record_failure(
                &mut conn,
                &error,
                probe,
                self.probe_backoff,
                self.persistent,
            )
            .await
            .map_err(db("record outage"))?;
            self.outage_hint.store(true, AtomicOrdering::Relaxed);
            tracing::warn!(error = %error, released = settled.released, probe, failures = state.failures,
                next_probe_in_secs = state.until_probe().as_secs_f64(),
                "QStash unavailable as a whole: claim released without spending attempts; publishing paused until the next probe");
        } else if published.requests_ok > 0
            && self.outage_hint.swap(false, AtomicOrdering::Relaxed)
            && let Some(lasted) = outage::clear(&self.pool, self.persistent)
                .await
                .map_err(db("clear outage"))?
        {
            tracing::info!(
                outage_secs = lasted.as_secs_f64(),
                "QStash answers again: outage over"
            );
        }
        let claimed = events.len() as u64;
        let batch = u64::from(claims.batch_size());
        let unordered = events.iter().filter(|e| e.seq.is_none()).count() as u64;
        Ok(CycleReport {
            claimed,
            fenced: claimed.saturating_sub(settled.total()),
            settled,
            full: unordered >= batch || claimed - unordered >= batch,
            publish_latencies: published.latencies.clone(),
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
            requests_ok: published.requests_ok,
            requests_failed: published.requests_failed,
            outage,
        })
    }
}

fn rl_len_ok(requests: usize, failed: u64) -> u64 {
    (requests as u64).saturating_sub(failed)
}

fn all_equal(v: &[PublishOutcome]) -> bool {
    v.windows(2).all(|w| w[0] == w[1])
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
