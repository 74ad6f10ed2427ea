//! [`Relay`] and one cycle, [`Relay::run_cycle`]: claim ([`super::claim`]), triage ([`super::triage`]), form
//! ([`super::forming`]), publish and settle (`pipeline.rs`: [`super::publish`], [`super::decide`],
//! [`super::settle`]), then the outage record ([`super::outage`]), in that order. The drain loop around it is
//! `drain.rs`.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering as AtomicOrdering};
use std::time::Duration;

use sqlx::PgPool;

use crate::config::{QstashConfig, RelayConfig};
use crate::db::Db;
use crate::qstash::{Message, PublishOutcome, QstashClient};
use crate::subscriber_keys::SubscriberKeys;
use crate::subscribers::Destinations;

use super::backoff::Backoff;
use super::claim::{ClaimStatements, ClaimedEvent};
use super::decide::Decider;
use super::error::{RelayError, db};
use super::forming::{Formed, Forming};
use super::outage;
use super::published::Published;
use super::settle::{self, SettleCounts, SettleItem};
use super::stop::{StopHandle, StopSignal};
use super::triage::{self, Triage};

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
    /// How long the claim took (both statements, after the connection was acquired); an empty claim counts too:
    /// it is the query that slows down when the outbox bloats.
    pub claim_latency: Duration,
    /// Transient publish failures caused by configuration (token, base URL).
    pub config_problems: u64,
    /// Publish requests QStash answered (any 2xx, or a verdict on the message).
    pub requests_ok: u64,
    /// Publish requests that failed at request level ([`crate::qstash::request_level_failure`]).
    pub requests_failed: u64,
    /// Every publish request failed at request level: QStash is out, the claim was released and the outage
    /// recorded; the drain stops publishing.
    pub outage: bool,
}

/// The relay: database handle, QStash client and settings, built once per process (cold start) and reused.
pub struct Relay {
    pub(super) stop: Arc<StopSignal>,
    pub(super) db: Db,
    pub(super) client: QstashClient,
    pub(super) cfg: RelayConfig,
    pub(super) qstash: QstashConfig,
    pub(super) claims: ClaimStatements,
    pub(super) probe_claims: ClaimStatements,
    pub(super) backoff: Backoff,
    pub(super) probe_backoff: outage::ProbeBackoff,
    /// This process has seen an outage recorded that it has not seen cleared: a successful cycle clears the row
    /// (without the hint, successful cycles skip that statement).
    pub(super) outage_hint: AtomicBool,
    /// The named subscribers' URLs, read when a claim holds copies for them ([`Relay::refresh_destinations`]).
    destinations: std::sync::Mutex<DestinationsCache>,
    /// `OUTBOX_SUBSCRIBERS` was applied by this process ([`Relay::declare_subscribers`]).
    pub(super) declared: tokio::sync::OnceCell<()>,
    /// Every subscriber's key (`SUBSCRIBER_SIGNING_KEYS`): each message is signed with its subscriber's.
    pub(super) subscriber_keys: SubscriberKeys,
}

/// The named subscribers' URLs as last read.
#[derive(Default)]
struct DestinationsCache {
    read_at: Option<std::time::Instant>,
    current: Arc<Destinations>,
}

/// How long the named subscribers' URLs are used before they are read again (a subscriber removed takes effect at
/// the relay within this long; a copy for a subscriber not in the cache reads them at once, unless they were read
/// after its claim began: [`Relay::refresh_destinations`]).
const DESTINATIONS_TTL: Duration = Duration::from_secs(5);

impl Relay {
    /// Builds a relay.
    pub(crate) fn new(
        db: Db,
        client: QstashClient,
        cfg: RelayConfig,
        qstash: QstashConfig,
    ) -> Self {
        let statements = db.statements();
        Relay {
            stop: Arc::new(StopSignal::default()),
            claims: ClaimStatements::new(cfg.batch_size, statements)
                .with_delivery_batching(&cfg.batching)
                .with_fair_claims(cfg.fairness.fair_claims),
            probe_claims: ClaimStatements::new(1, statements).with_delivery_batching(&cfg.batching),
            backoff: Backoff {
                base: cfg.backoff_base,
                cap: cfg.backoff_cap,
            },
            probe_backoff: outage::ProbeBackoff {
                base: cfg.outage_probe_base,
                cap: cfg.outage_probe_cap,
            },
            outage_hint: AtomicBool::new(false),
            destinations: std::sync::Mutex::new(DestinationsCache::default()),
            declared: tokio::sync::OnceCell::new(),
            subscriber_keys: SubscriberKeys::none(),
            db,
            client,
            cfg,
            qstash,
        }
    }

    /// With every subscriber's key ([`crate::subscriber_keys`]): each subscriber's messages carry its signature,
    /// and the reconciler checks what QStash's DLQ says about a copy as the failure callback does.
    pub(crate) fn with_subscriber_keys(mut self, keys: SubscriberKeys) -> Self {
        self.subscriber_keys = keys;
        self
    }

    /// A handle that asks running drains to stop after their current cycle (every claim is still settled).
    /// Used by the local pipeline's Ctrl-C; Lambda invocations simply end at their deadline.
    pub fn stop_handle(&self) -> StopHandle {
        StopHandle(self.stop.clone())
    }

    /// The pool.
    pub fn pool(&self) -> &PgPool {
        self.db.pool()
    }

    /// The database handle.
    pub fn db(&self) -> &Db {
        &self.db
    }

    /// The relay settings.
    pub fn config(&self) -> &RelayConfig {
        &self.cfg
    }

    /// One accounting pass ([`crate::accounting::run`]): marks in-flight events their dedupe rows show applied,
    /// then looks events in flight past the horizon up at QStash with this relay's client, within `budget`.
    pub async fn account(
        &self,
        budget: Duration,
    ) -> Result<crate::accounting::AccountingReport, RelayError> {
        let policy = |topic: &str| self.cfg.dead_head_policy(topic);
        let rec = crate::accounting::Reconciler {
            db: &self.db,
            client: &self.client,
            cfg: &self.cfg.accounting,
            processed_ttl: self.cfg.processed_ttl,
            policy: &policy,
        };
        crate::accounting::run(&rec, budget)
            .await
            .map_err(db("accounting"))
    }

    /// The claim statements (for plan inspection in tests and benchmarks).
    #[cfg_attr(not(feature = "internals"), allow(dead_code))] // `internals::RelaySteps`
    pub(crate) fn claim_statements(&self) -> &ClaimStatements {
        &self.claims
    }

    /// Step 1: claims unordered events and ordered key heads (each up to the batch size).
    #[cfg_attr(not(feature = "internals"), allow(dead_code))] // `internals::RelaySteps`
    pub(crate) async fn claim(&self) -> Result<Vec<ClaimedEvent>, RelayError> {
        self.claim_with(&self.claims).await
    }

    #[cfg_attr(not(feature = "internals"), allow(dead_code))] // `internals::RelaySteps`
    pub(super) async fn claim_with(
        &self,
        claims: &ClaimStatements,
    ) -> Result<Vec<ClaimedEvent>, RelayError> {
        Ok(self.claim_timed(claims).await?.0)
    }

    /// The claim, and how long its statements took (not counting the wait for a connection).
    pub(super) async fn claim_timed(
        &self,
        claims: &ClaimStatements,
    ) -> Result<(Vec<ClaimedEvent>, Duration), RelayError> {
        let mut conn = self.pool().acquire().await.map_err(db("acquire"))?;
        let started = std::time::Instant::now();
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
        Ok((events, started.elapsed()))
    }

    /// The QStash message for one claimed event (a message of one event; [`Relay::messages_for`] forms the
    /// messages of a claim).
    #[cfg_attr(not(feature = "internals"), allow(dead_code))] // `internals::RelaySteps`
    pub(crate) fn message_for(&self, ev: &ClaimedEvent) -> Message {
        self.forming().message_of(&[ev])
    }

    /// The settings message forming reads.
    pub(super) fn forming(&self) -> Forming<'_> {
        Forming {
            cfg: &self.cfg,
            qstash: &self.qstash,
            destinations: self.cached_destinations().current.clone(),
            keys: &self.subscriber_keys,
        }
    }

    /// Records the default subscriber's dedupe namespace (its `CONSUMER_NAME`, refused when a live named subscriber
    /// has that name: [`crate::subscribers::record_default_consumer`]) and makes the subscribers of
    /// `OUTBOX_SUBSCRIBERS` live (from now on; a URL that changed is updated), once per process: the first
    /// invocation does it, a failed attempt is tried again by the next one.
    pub async fn declare_subscribers(&self) -> Result<(), RelayError> {
        self.declared
            .get_or_try_init(|| async {
                // The default subscriber's dedupe namespace, so that no named subscriber takes it.
                let name = &self.cfg.accounting.consumer_name;
                crate::subscribers::record_default_consumer(&self.db, name)
                    .await
                    .map_err(RelayError::DefaultConsumer)?;
                for d in &self.cfg.subscribers {
                    let outcome = crate::subscribers::ensure(&self.db, &d.topic, &d.name, &d.url)
                        .await
                        .map_err(|source| RelayError::Subscriber {
                            topic: d.topic.clone(),
                            name: d.name.clone(),
                            source,
                        })?;
                    if outcome != crate::subscribers::Ensured::Unchanged {
                        tracing::info!(topic = %d.topic, subscriber = %d.name, url = %d.url, ?outcome,
                            "OUTBOX_SUBSCRIBERS applied");
                    }
                }
                Ok::<(), RelayError>(())
            })
            .await?;
        Ok(())
    }

    fn cached_destinations(&self) -> std::sync::MutexGuard<'_, DestinationsCache> {
        self.destinations
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Reads the named subscribers' URLs when `events` hold a copy for one and the cached ones are older than
    /// 5 s, or do not know its subscriber and were read before `claimed_at` (when the claim that returned `events`
    /// began). A copy is written only for a subscriber that is live then, before it can be claimed: a cache read
    /// before the claim may be older than the subscriber, and must not decide that it is gone; one read after the
    /// claim began that does not know it means the subscriber was removed. A claim of the default subscriber's
    /// copies only never reads them.
    pub async fn refresh_destinations(
        &self,
        events: &[ClaimedEvent],
        claimed_at: std::time::Instant,
    ) -> Result<(), RelayError> {
        if events.iter().all(|e| e.subscriber.is_empty()) {
            return Ok(());
        }
        let (read_at, current) = {
            let c = self.cached_destinations();
            (c.read_at, c.current.clone())
        };
        let fresh = read_at.is_some_and(|t| t.elapsed() < DESTINATIONS_TTL);
        let read_since_claim = read_at.is_some_and(|t| t >= claimed_at);
        let missing = events
            .iter()
            .any(|e| !e.subscriber.is_empty() && current.url(&e.topic, &e.subscriber).is_none());
        if fresh && (read_since_claim || !missing) {
            return Ok(());
        }
        let read_at = std::time::Instant::now();
        let loaded = Destinations::load(&self.db)
            .await
            .map_err(db("read subscribers"))?;
        let mut c = self.cached_destinations();
        // Another cycle may have stored a newer read meanwhile.
        if c.read_at.is_none_or(|t| t < read_at) {
            c.read_at = Some(read_at);
            c.current = Arc::new(loaded);
        }
        Ok(())
    }

    /// Groups claimed events into QStash messages (decision record 0014; [`forming`] says how), each with the
    /// indexes (into `events`) of the events it carries. An ordered key's events that do not fit its one message
    /// (size limit, a gap) are in [`Formed::left_over`]: a key never has two messages in flight, so they wait for
    /// the next claim.
    pub(crate) fn messages_for(&self, events: &[ClaimedEvent]) -> Formed {
        self.forming().messages_for(events)
    }

    /// The settings the settle's input is decided with.
    pub(super) fn decider(&self) -> Decider<'_> {
        Decider {
            cfg: &self.cfg,
            backoff: self.backoff,
        }
    }

    /// Decides what to record for each published event from its outcome (pure: no I/O; the table is in
    /// `relay/decide.rs`).
    #[cfg_attr(not(feature = "internals"), allow(dead_code))] // `internals::RelaySteps`
    pub(crate) fn decide(
        &self,
        events: &[ClaimedEvent],
        outcomes: &[PublishOutcome],
    ) -> Vec<SettleItem> {
        self.decider().decide(events, outcomes)
    }

    /// Step 3: settles `items` in one fenced statement (a cycle settles in pieces: `pipeline.rs`).
    pub(crate) async fn settle(&self, items: &[SettleItem]) -> Result<SettleCounts, RelayError> {
        let mut conn = self.pool().acquire().await.map_err(db("acquire"))?;
        settle::settle(
            &mut conn,
            items,
            self.cfg.evidence_timeout,
            self.db.statements(),
        )
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

    pub(super) async fn run_cycle_with(
        &self,
        claims: &ClaimStatements,
        probe: bool,
    ) -> Result<CycleReport, RelayError> {
        let claimed_at = std::time::Instant::now();
        let (events, claim_latency) = self.claim_timed(claims).await?;
        if events.is_empty() {
            return Ok(CycleReport {
                claim_latency,
                ..CycleReport::default()
            });
        }
        let claimed = events.len() as u64;
        let unordered = events.iter().filter(|e| e.seq.is_none()).count() as u64;
        // Copies for a subscriber that is not live (removed while they were claimed, or written by hand) are
        // dead-lettered, never sent anywhere else; "not live" as read after the claim began.
        self.refresh_destinations(&events, claimed_at).await?;
        let forming = self.forming();
        let (events, orphans): (Vec<ClaimedEvent>, Vec<ClaimedEvent>) = events
            .into_iter()
            .partition(|e| forming.destination(e).is_some());
        let mut triage = triage::triage(events, self.cfg.max_attempts as i32);
        triage.orphans = orphans;
        // Each request settled as soon as QStash answers it, in pieces (decision record 0018).
        let (published, settled) = self.publish_and_settle(&triage).await?;
        // An outage (every publish request failed at request level) is recorded, a probe's failure advancing the
        // probe backoff; a request answered after this process saw an outage clears it.
        if published.is_outage() {
            let error = published
                .first_request_error()
                .unwrap_or_else(|| "publish request failed".into());
            let mut conn = self.pool().acquire().await.map_err(db("acquire"))?;
            let state = outage::record_failure(
                &mut conn,
                &error,
                probe,
                self.probe_backoff,
                self.db.statements(),
            )
            .await
            .map_err(db("record outage"))?;
            self.outage_hint.store(true, AtomicOrdering::Relaxed);
            tracing::warn!(error = %error, released = settled.released, probe, failures = state.failures,
                next_probe_in_secs = state.until_probe().as_secs_f64(),
                "QStash unavailable as a whole: claim released without spending attempts; publishing paused until the next probe");
        } else if published.requests_ok > 0
            && self.outage_hint.swap(false, AtomicOrdering::Relaxed)
            && let Some(lasted) = outage::clear(&self.db).await.map_err(db("clear outage"))?
        {
            tracing::info!(
                outage_secs = lasted.as_secs_f64(),
                "QStash answers again: outage over"
            );
        }
        Ok(CycleReport {
            claim_latency,
            ..CycleReport::of(
                claimed,
                unordered,
                &triage,
                published,
                settled,
                claims.batch_size(),
            )
        })
    }
}

impl CycleReport {
    /// The report of a cycle that claimed `claimed` events (`unordered` of them unordered) with a claim of
    /// `batch_size` per kind.
    fn of(
        claimed: u64,
        unordered: u64,
        triage: &Triage,
        published: Published,
        settled: SettleCounts,
        batch_size: u32,
    ) -> Self {
        let batch = u64::from(batch_size);
        let config_problems = published
            .events
            .iter()
            .filter(|e| {
                matches!(
                    e.outcome,
                    PublishOutcome::Transient {
                        config_problem: true,
                        ..
                    }
                )
            })
            .count() as u64;
        CycleReport {
            claimed,
            fenced: claimed.saturating_sub(settled.total()),
            settled,
            // Ordered claims are counted in keys: a key's run may hold several events.
            full: unordered >= batch || triage.ordered_runs as u64 >= batch,
            config_problems,
            requests_ok: published.requests_ok,
            requests_failed: published.requests_failed,
            outage: published.is_outage(),
            publish_latencies: published.latencies,
            claim_latency: Duration::ZERO,
        }
    }
}
