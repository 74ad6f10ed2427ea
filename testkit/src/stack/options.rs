//! How to build the stack ([`StackOptions`]): the database and its migrations, the dev server's settings, the
//! relay's configuration and its simulated invocations, the consumer's handlers, the named subscribers beside it;
//! with defaults suited to a laptop.

use std::time::Duration;

use outbox::config::{ProcessEnv, RelayConfig, Vars};
use outbox::consumer::Registry;
use outbox::db::{DbConfig, Statements};
use sqlx::migrate::Migrator;

/// How to build the stack.
pub struct StackOptions {
    /// The database (must exist; [`StackOptions::migrators`] are applied).
    pub database_url: String,
    /// The migrations applied at start, in order: the library's, then the application's (by default the
    /// example application's).
    pub migrators: Vec<&'static Migrator>,
    /// Dev server settings (port 0 = any free port; a port that is taken falls back to any,
    /// [`crate::ports::on_port_or_any`]).
    pub dev: qstash_dev::Config,
    pub relay: RelayConfig,
    /// `Upstash-Retries` the relay asks for.
    pub qstash_retries: u32,
    /// Messages per `/v2/batch` request (`QSTASH_BATCH_SIZE`).
    pub qstash_batch_size: u32,
    /// Parallelism of a subscriber's replay (`QSTASH_REPLAY_PARALLELISM`).
    pub replay_parallelism: u32,
    /// Length of one simulated relay invocation.
    pub invocation: Duration,
    /// Consumer name (dedupe namespace).
    pub consumer_name: String,
    /// The consumer's topic handlers.
    pub registry: Registry,
    /// Print the EMF metric lines (one per consumer request, one per relay invocation; noisy on a terminal).
    pub consumer_metrics: bool,
    /// The statement mode of every component (`DB_PERSISTENT_STATEMENTS` from the environment, default named
    /// prepared statements): [`Statements::Unnamed`] behind PgBouncer in transaction mode or RDS Proxy.
    pub statements: Statements,
    /// Keep a copy of every request the consumer and the callback receiver get, with the status they answered
    /// ([`LocalStack::recorded_requests`]): tests replay real signed deliveries from it. Off by default (it
    /// keeps every body in memory).
    ///
    /// [`LocalStack::recorded_requests`]: crate::stack::LocalStack::recorded_requests
    pub record_requests: bool,
    /// Named subscribers served beside the default consumer, each by a consumer of its own (its name is its
    /// `CONSUMER_NAME`) on a port of its own, and made live for its topics at start ([`outbox::subscribers`]).
    pub subscribers: Vec<SubscriberOptions>,
    /// Give each named subscriber a key of its own ([`outbox::internals::subscriber_keys`], decision record 0028): the relay
    /// signs its messages with it, its consumer accepts only those, the callback receiver checks callbacks about
    /// its copies with it. On by default; the default consumer has none (the single-subscriber setup).
    pub subscriber_keys: bool,
}

/// A named subscriber of the local pipeline ([`StackOptions::subscribers`]).
pub struct SubscriberOptions {
    /// Its name.
    pub name: String,
    /// The topics it subscribes to.
    pub topics: Vec<String>,
    /// Its consumer's handlers.
    pub registry: Registry,
}

impl StackOptions {
    /// Defaults: dev server on a free port at real time, the example application's handlers and migrations, a
    /// relay with a short lease and poll interval suited to a laptop.
    pub fn new(database_url: &str) -> anyhow::Result<Self> {
        let empty: std::collections::HashMap<String, String> = std::collections::HashMap::new();
        let mut relay = RelayConfig::from_vars(&Vars::new(&empty), 3)?;
        relay.lease = Duration::from_secs(5);
        relay.poll_interval = Duration::from_millis(100);
        relay.deadline_margin = Duration::from_millis(500);
        relay.concurrency = 2;
        relay.evidence_timeout = Duration::from_secs(120);
        // A laptop-scale backoff: a failed publish is retried within seconds, not the production minutes.
        relay.backoff_base = Duration::from_millis(500);
        relay.backoff_cap = Duration::from_secs(10);
        // Likewise for a QStash outage (a stopped dev server): probe again within a second or two.
        relay.outage_probe_base = Duration::from_millis(200);
        relay.outage_probe_cap = Duration::from_secs(2);
        Ok(StackOptions {
            database_url: database_url.to_owned(),
            migrators: vec![&outbox::MIGRATOR, &orders_example::MIGRATOR],
            dev: qstash_dev::Config {
                port: 0,
                ..qstash_dev::Config::default()
            },
            statements: DbConfig::from_vars(&Vars::new(&ProcessEnv), "outbox-local")?.statements,
            relay,
            qstash_retries: 3,
            qstash_batch_size: 100,
            replay_parallelism: 4,
            invocation: Duration::from_secs(30),
            consumer_name: "consumer".into(),
            registry: orders_example::registry(),
            consumer_metrics: false,
            record_requests: false,
            subscribers: Vec::new(),
            subscriber_keys: true,
        })
    }
}
