//! A relay wired to the QStash-compatible dev server and a [`Sink`] standing in for the consumer and the callback
//! function: what the relay tests of the library (`shared/tests/relay*.rs`) start from.
//!
//! [`relay_config`] is their common relay settings, which a test changes field by field
//! (`RelayConfig { max_attempts: 3, ..relay_config() }`); [`qstash_config`] and [`relay_to`] build a relay for any
//! QStash URL and token (a dev server stopped and started again, a wrong token); [`RelayEnv`] holds a running dev
//! server, the sink and the pool, and builds relays against them.

use std::time::Duration;

use outbox::config::{
    AccountingConfig, DeliveryBatching, EvidenceMode, OutcomeSource, QstashConfig, RelayConfig,
};
use outbox::db::{Db, Statements};
use outbox::internals::RelaySteps;
use outbox::internals::qstash::QstashClient;
use outbox::relay::Relay;
use qstash_dev::{Config as DevConfig, DevServer};
use secrecy::SecretString;
use sqlx::PgPool;

use crate::sink::Sink;

/// The relay settings of the relay tests: claims of 50, 1 s leases, 20 ms polls, no deadline margin, two cycles
/// in flight, 12 attempts with 30 s..1 h backoff (a retried row waits: tests make it due by hand,
/// [`RelayEnv::make_due`]), ordered evidence by delivery callback within 30 s, outage probes every 200..800 ms,
/// unordered outcomes from dedupe rows (no callbacks on unordered messages: the tests count messages) and one
/// event per message (the tests count messages and deliveries per event; batches change `batching`).
pub fn relay_config() -> RelayConfig {
    RelayConfig {
        batch_size: 50,
        lease: Duration::from_secs(1),
        max_attempts: 12,
        backoff_base: Duration::from_secs(30),
        backoff_cap: Duration::from_secs(3600),
        poll_interval: Duration::from_millis(20),
        deadline_margin: Duration::ZERO,
        concurrency: 2,
        skip_topics: vec![],
        subscribers: vec![],
        evidence_timeout: Duration::from_secs(30),
        retention: Duration::from_secs(86_400),
        processed_ttl: Duration::from_secs(7 * 86_400),
        housekeeping_batch: 1000,
        listen_notify: false,
        ordered_evidence: EvidenceMode::Callback,
        outage_probe_base: Duration::from_millis(200),
        outage_probe_cap: Duration::from_millis(800),
        accounting: AccountingConfig {
            unordered: Some(OutcomeSource::DedupeRow),
            ..Default::default()
        },
        batching: DeliveryBatching {
            default_n: 1,
            ..Default::default()
        },
        fairness: Default::default(),
    }
}

/// QStash settings for the (dev) server at `url`, delivering to `sink` (events and both callbacks): `retries`
/// QStash-level retries, `publish_timeout` per publish call, 25 messages per `/v2/batch` request, flow-control
/// parallelism 1 per key.
pub fn qstash_config(
    url: &str,
    sink: &Sink,
    retries: u32,
    publish_timeout: Duration,
) -> QstashConfig {
    QstashConfig {
        base_url: url.to_owned(),
        retries,
        publish_timeout,
        batch_size: 25,
        delivery_timeout: None,
        flow_parallelism: 1,
        replay_parallelism: 4,
        flow_rate: None,
        flow_period: Duration::from_secs(1),
        consumer_url: sink.url.clone(),
        callback_url: sink.url.clone(),
    }
}

/// A relay over `pool` (named statements) publishing to `qstash.base_url` with `token`, its HTTP client timing
/// out after `qstash.publish_timeout`.
pub fn relay_to(pool: &PgPool, token: &str, cfg: RelayConfig, qstash: QstashConfig) -> Relay {
    let client = QstashClient::new(
        &qstash.base_url,
        SecretString::from(token.to_owned()),
        qstash.publish_timeout,
    )
    .expect("QStash client");
    Relay::new(
        Db::new(pool.clone(), Statements::Prepared),
        client,
        cfg,
        qstash,
    )
}

/// A running dev server, a sink it delivers to, and the test's pool.
pub struct RelayEnv {
    pub dev: DevServer,
    pub sink: Sink,
    pub pool: PgPool,
}

impl RelayEnv {
    /// Starts the dev server with `dev` and the sink on `pool`.
    pub async fn start(pool: PgPool, dev: DevConfig) -> RelayEnv {
        let dev = DevServer::start(dev).await.expect("dev server starts");
        let sink = Sink::start(pool.clone()).await;
        RelayEnv { dev, sink, pool }
    }

    /// [`qstash_config`] for this dev server and sink: `retries` QStash retries, 2 s per publish.
    pub fn qstash(&self, retries: u32) -> QstashConfig {
        qstash_config(&self.dev.url(), &self.sink, retries, Duration::from_secs(2))
    }

    /// A relay with `cfg` and `qstash`, publishing to this dev server with its token.
    pub fn relay_with_qstash(&self, cfg: RelayConfig, qstash: QstashConfig) -> Relay {
        relay_to(&self.pool, self.dev.token(), cfg, qstash)
    }

    /// A relay with `cfg` and 5 QStash retries.
    pub fn relay_with(&self, cfg: RelayConfig) -> Relay {
        self.relay_with_qstash(cfg, self.qstash(5))
    }

    /// A relay with [`relay_config`] and 5 QStash retries.
    pub fn relay(&self) -> Relay {
        self.relay_with(relay_config())
    }

    /// Makes every waiting row and key due now (skips backoff and leases without waiting).
    pub async fn make_due(&self) {
        sqlx::query(
            "UPDATE outbox SET available_at = now() - interval '1 ms' \
             WHERE dispatched_at IS NULL AND dead_lettered_at IS NULL",
        )
        .execute(&self.pool)
        .await
        .expect("making rows due");
        sqlx::query("UPDATE outbox_keys SET available_at = now() - interval '1 ms'")
            .execute(&self.pool)
            .await
            .expect("making keys due");
    }
}
