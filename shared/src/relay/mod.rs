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
//! *Lease*, *fencing token* and *dead letter* are defined in the repository's `docs/glossary.md`.

pub mod backoff;
pub mod claim;
mod drain;
pub mod handler;
pub mod housekeeping;
pub mod settle;

use std::sync::Arc;
use std::time::{Duration, Instant};

use sqlx::PgPool;

use crate::config::{DeadHeadPolicy, EvidenceMode, QstashConfig, RelayConfig};
use crate::contract;
use crate::qstash::{
    FlowControl, Message, PublishOptions, PublishOutcome, QstashClient, flow_control_key,
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
