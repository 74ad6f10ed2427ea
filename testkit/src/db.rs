//! Test databases: the URL of a `#[sqlx::test]` database (for components that build their own pools) and
//! hand-built outbox states (events, dead letters, ordered keys) for the operator commands' tests.

use sqlx::PgPool;

/// A URL for the per-test database behind `pool`, optionally with a password (local Postgres trusts loopback, so
/// any password works — the observability test uses one to check it never reaches a log line).
pub fn url_with_password(pool: &PgPool, password: Option<&str>) -> String {
    let o = pool.connect_options();
    let user = o.get_username();
    let host = o.get_host();
    let port = o.get_port();
    let db = o.get_database().unwrap_or("postgres");
    let auth = match password {
        Some(p) => format!("{user}:{p}"),
        None => user.to_owned(),
    };
    if host.starts_with('/') {
        format!("postgres://{auth}@localhost:{port}/{db}?host={host}")
    } else {
        format!("postgres://{auth}@{host}:{port}/{db}")
    }
}

/// A URL for the database behind `pool` (the per-test database `#[sqlx::test]` created), so components that
/// build their own pools (the local stack, the commands) can reach it: [`url_with_password`] without a password.
pub fn url_of(pool: &PgPool) -> String {
    url_with_password(pool, None)
}

/// Inserts an outbox row; `set` is extra `column = value` assignments applied right after (SQL, trusted test
/// input). Returns its id.
pub async fn event(pool: &PgPool, topic: &str, key: &str, seq: Option<i64>, set: &str) -> i64 {
    let id: i64 = sqlx::query_scalar(
        "INSERT INTO outbox (topic, partition_key, seq, payload, headers) \
         VALUES ($1, $2, $3, jsonb_build_object('n', $2::text), '{\"traceparent\":\"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01\"}') \
         RETURNING id",
    )
    .bind(topic)
    .bind(key)
    .bind(seq)
    .fetch_one(pool)
    .await
    .unwrap();
    if !set.is_empty() {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "UPDATE outbox SET {set} WHERE id = $1"
        )))
        .bind(id)
        .execute(pool)
        .await
        .unwrap();
    }
    id
}

/// Inserts a dead letter for an event (topic, key, seq and payload copied from the row when it exists);
/// `set` as in [`event`]. Returns its id.
pub async fn dead_letter(pool: &PgPool, source: &str, outbox_id: Option<i64>, set: &str) -> i64 {
    let natural: String = format!("nat-{}", rand_suffix());
    let id: i64 = sqlx::query_scalar(
        "INSERT INTO dead_letters (source, natural_id, outbox_id, topic, partition_key, seq, payload, headers, error, \
                                   status, attempts) \
         SELECT $1, $2, $3, o.topic, o.partition_key, o.seq, o.payload, o.headers, 'boom', 489, 1 \
         FROM (SELECT 1) one LEFT JOIN outbox o ON o.id = $3 RETURNING id",
    )
    .bind(source)
    .bind(natural)
    .bind(outbox_id)
    .fetch_one(pool)
    .await
    .unwrap();
    if !set.is_empty() {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "UPDATE dead_letters SET {set} WHERE id = $1"
        )))
        .bind(id)
        .execute(pool)
        .await
        .unwrap();
    }
    id
}

fn rand_suffix() -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    format!(
        "{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

/// An ordered key's producer and relay rows.
pub async fn key_state(
    pool: &PgPool,
    topic: &str,
    key: &str,
    last_seq: i64,
    done_seq: i64,
    set: &str,
) {
    sqlx::query(
        "INSERT INTO outbox_sequences (topic, partition_key, last_seq) VALUES ($1, $2, $3)",
    )
    .bind(topic)
    .bind(key)
    .bind(last_seq)
    .execute(pool)
    .await
    .unwrap();
    sqlx::query("INSERT INTO outbox_keys (topic, partition_key, done_seq) VALUES ($1, $2, $3)")
        .bind(topic)
        .bind(key)
        .bind(done_seq)
        .execute(pool)
        .await
        .unwrap();
    if !set.is_empty() {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "UPDATE outbox_keys SET {set} WHERE topic = $1 AND partition_key = $2"
        )))
        .bind(topic)
        .bind(key)
        .execute(pool)
        .await
        .unwrap();
    }
}

/// `base_url` with its database name replaced (a scratch or local database on the same server).
pub fn with_database(base_url: &str, name: &str) -> String {
    match url::Url::parse(base_url) {
        Ok(mut u) => {
            u.set_path(&format!("/{name}"));
            u.to_string()
        }
        Err(_) => format!("{base_url}/{name}"),
    }
}

/// The library's migrations whose version `keep` accepts: a database as an earlier release left it (the upgrade
/// tests migrate with `|v| v < VERSION`, fill it, then run [`outbox::MIGRATOR`]).
pub fn library_migrations(keep: impl Fn(i64) -> bool) -> sqlx::migrate::Migrator {
    sqlx::migrate::Migrator {
        migrations: std::borrow::Cow::Owned(
            outbox::MIGRATOR
                .migrations
                .iter()
                .filter(|m| keep(m.version))
                .cloned()
                .collect(),
        ),
        ..sqlx::migrate::Migrator::DEFAULT
    }
}

/// Writes `events` in one committed producer transaction; their outbox ids, in order.
pub async fn enqueue_committed(pool: &PgPool, events: &[outbox::NewEvent]) -> Vec<i64> {
    let mut tx = pool.begin().await.expect("begin");
    let out = outbox::producer::enqueue_batch(&mut tx, events)
        .await
        .expect("enqueue");
    tx.commit().await.expect("commit");
    out.into_iter().map(|e| e.id.get()).collect()
}
