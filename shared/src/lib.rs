//! Transactional outbox on Postgres, relayed to Upstash QStash.
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("../migrations");
