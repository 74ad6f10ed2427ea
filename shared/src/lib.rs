//! Transactional outbox on Postgres, relayed to Upstash QStash.
//!
//! The guarantees, each in one named module:
//!
//! | guarantee | module |
//! |---|---|
//! | **No event lost** at write time (event ⇔ committed business transaction) | [`producer`] |
//! | **No event lost** in transit (lease, fencing, retries, dead letters) | [`relay`] |
//! | **No side effect applied twice** (dedupe row + work in one transaction) | [`once`] |
//! | **Every subscriber gets every event, once, in its own order** (fan-out: a copy per subscriber written with the event; its own lanes, retries and dead letters; a dedupe namespace per subscriber) | [`subscribers`] |
//! | **Per-key order** (sequence under a lock, one event per key in flight, delivery evidence) | `ordering` |
//! | **Nothing fails silently** (one queryable dead-letter table) | [`dead_letters`] |
//! | **Every event accounted for** (pending, in flight, applied or dead letter; a reconciler for lost callbacks) | [`accounting`] |
//!
//! `ordering` is below the API: the producer and the relay keep it; an application sees it as a topic's
//! [`TopicOrdering`].
//!
//! # The public API
//!
//! What an application, the three Lambda functions and the operator CLI use, and nothing else (listed in
//! `shared/public-api.txt`, which a test compares with the code; decision record 0073):
//!
//! - writing events: [`enqueue`], [`Producer`], [`NewEvent`], [`Topic`] (re-exported here from [`producer`]),
//!   with user headers ([`headers`]) and typed ids ([`ids`]);
//! - applying them: [`consumer`] (typed handlers per topic, the consumer function's HTTP handler) and [`once`];
//!   the failure-callback function's handler is [`handle_callback`]; both functions build a [`ReceiverState`];
//! - relaying them: [`relay`] ([`relay::RelayState`] and [`relay::handle`] for the Lambda function, retention
//!   and partitions as `outbox prune` runs them);
//! - operating it: [`ops`] (the figures behind `outbox status` and the console), [`dead_letters`] (list, show,
//!   redrive, purge), [`subscribers`] (add, remove, replay), [`accounting`];
//! - plumbing: [`config`], [`db`], [`schema`], [`telemetry`], [`MIGRATOR`] and [`migrate`].
//!
//! The wire contract, the signature check, the QStash client, callbacks' parsing, secrets, per-subscriber keys,
//! metrics and the database health readings are internal; the workspace's benchmarks and tests reach them and the
//! relay's single steps through `internals` (feature `internals`, never enabled by the functions or the CLI).
//!
//! The terms used throughout (head, dead head, middle event, delivery evidence, lease, fencing token, flapping,
//! dead letter, redrive, dedupe row, signed contract) are defined in the repository's `docs/glossary.md`.
//!
//! Cargo features, all off by default: `local` (a local HTTP server in front of the Lambda handlers, for the local
//! pipeline and tests), `testing` (a QStash-compatible token signer and the dev signing keys, for fixtures and
//! tests) and `internals` (the seam above); the Lambda binaries enable none of them.
//!
//! # Layout
//!
//! The modules from the bottom up: each uses only modules listed before it, so no two modules know each other.
//! The test `tests/layering.rs` checks the code under `src/` against this list with the workspace's checker
//! (`outbox-layering`, drawing the import graph from every `use` and path, re-exports and globs followed): no
//! arrow against the list, no arrow from a file up to its `mod.rs` or to this root (a `mod.rs` only declares and
//! re-exports), no circle between files.
//!
//! - `tls`: [`install_crypto_provider`]: one TLS stack (rustls with ring) for sqlx, reqwest and the AWS SDK.
//! - `ids`: the newtypes of the values that cross modules: outbox id, topic name, partition key, key lease.
//! - `schema`: the schema the outbox's tables live in, and schema-qualified SQL.
//! - `config`: typed configuration from environment variables.
//! - `db`: the Lambda-sized Postgres pool and its connections.
//! - `secrets`: the database URL, QStash token and signing keys, from Secrets Manager or the environment.
//! - `telemetry`: logging setup, trace export by OTLP (on when the `OTEL_*` variables say so) and the messaging
//!   spans of the producer, the relay and the consumer.
//! - `metrics`: CloudWatch EMF metrics.
//! - `headers`: user headers and their rules, and [`InvalidEvent`] (why an event is refused).
//! - `contract`: the signed wire contract between relay, QStash and the receivers.
//! - `subscriber_keys`: per-subscriber keys: the relay's signature a subscriber's consumer and the failure callback
//!   check.
//! - `ordering`: per-key order: sequences, heads, delivery evidence.
//! - `producer`: [`enqueue`] and [`Producer`]: writing events in the caller's transaction.
//! - `fairness`: fairness between tenants: the fair claim, pausing one tenant.
//! - `subscribers`: fan-out: a topic's subscribers, adding one with its history replayed, removing one.
//! - `once`: the dedupe row that applies a side effect once.
//! - `qstash`: the QStash client.
//! - `dead_letters`: recording, listing, redriving and purging dead letters.
//! - `receiver`: the signature check, and what both receiver functions share.
//! - `callbacks`: QStash failure and delivery callbacks.
//! - `consumer`: typed handlers per topic and the consumer function's HTTP handler.
//! - `accounting`: every event accounted for, and the reconciler for lost callbacks.
//! - `health`: the database's own state as it bears on the outbox tables: the xmin horizon and bloat.
//! - `relay`: the outbox to QStash, with its housekeeping.
//! - `ops`: the operator figures of `outbox status`.
//! - `internals`: the seam for the workspace's benchmarks and tests (feature `internals`; not the API).
//! - `local`: a local HTTP server in front of the Lambda handlers (feature `local`).

pub mod accounting;
pub(crate) mod callbacks;
pub mod config;
pub mod consumer;
pub(crate) mod contract;
pub mod db;
pub mod dead_letters;
pub mod fairness;
pub mod headers;
pub(crate) mod health;
pub mod ids;
#[cfg(feature = "internals")]
pub mod internals;
#[cfg(feature = "local")]
pub mod local;
pub(crate) mod metrics;
pub mod once;
pub mod ops;
pub(crate) mod ordering;
pub mod producer;
pub(crate) mod qstash;
pub(crate) mod receiver;
pub mod relay;
pub mod schema;
pub(crate) mod secrets;
pub(crate) mod subscriber_keys;
pub mod subscribers;
pub mod telemetry;
mod tls;

pub use callbacks::handle_callback;
pub use headers::InvalidEvent;
pub use health::DatabaseHealth;
pub use ids::{DeadLetterId, KeyLease, OutboxId};
pub use producer::{
    EnqueueError, EnqueuedEvent, NewEvent, Producer, Topic, TopicOrdering, enqueue, enqueue_batch,
};
pub use receiver::{Receiver, ReceiverState};
pub use tls::install_crypto_provider;

/// The embedded schema migrations of the outbox's own tables (what the relay and the receivers expect). Run by
/// the CLI (`outbox migrate`) and the tests.
///
/// An application keeps its own tables in its own migrator on the same database (and so the same
/// `_sqlx_migrations` table): `ignore_missing` is set so that versions applied by the application's migrator
/// are not an error here, and the application's migrator needs it too (decision record 0010).
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate::Migrator {
    ignore_missing: true,
    ..sqlx::migrate!("../migrations")
};

/// Applies [`MIGRATOR`] in `schema`: creates the schema if needed, then runs the migrations on a connection of
/// its own whose `search_path` is only that schema, so the plain SQL files (which name no schema, and stay
/// copyable into a team's own migration tool) create their tables there, and sqlx's `_sqlx_migrations`
/// bookkeeping goes there too: an application's own sqlx migrations in `public` never see the outbox's versions.
/// The connection is closed afterwards rather than returned to `pool`, so no pooled connection keeps the changed
/// `search_path`. For `public` this is what `MIGRATOR.run(pool)` always did.
pub async fn migrate(
    pool: &sqlx::PgPool,
    schema: &schema::Schema,
) -> Result<(), sqlx::migrate::MigrateError> {
    use std::borrow::Cow;
    let migrator = sqlx::migrate::Migrator {
        migrations: MIGRATOR.migrations.clone(),
        ignore_missing: MIGRATOR.ignore_missing,
        locking: MIGRATOR.locking,
        no_tx: MIGRATOR.no_tx,
        table_name: Cow::Owned(schema.table("_sqlx_migrations")),
        create_schemas: Cow::Borrowed(&[]),
    };
    let mut conn = pool.acquire().await?.detach();
    // Only when missing: CREATE SCHEMA needs the CREATE privilege on the database even with IF NOT EXISTS, which
    // a role that owns an existing schema (or uses public) may not have.
    let exists: bool =
        sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = $1)")
            .bind(schema.name())
            .fetch_one(&mut conn)
            .await?;
    if !exists {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "CREATE SCHEMA IF NOT EXISTS {}",
            schema.quoted()
        )))
        .execute(&mut conn)
        .await?;
    }
    sqlx::query("SELECT set_config('search_path', $1, false)")
        .bind(schema.quoted())
        .execute(&mut conn)
        .await?;
    let result = migrator.run(&mut conn).await;
    let _ = sqlx::Connection::close(conn).await;
    result
}
