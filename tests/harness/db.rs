//! Database helpers for the whole-system tests.

use sqlx::PgPool;

/// A URL for the database behind `pool` (the per-test database `#[sqlx::test]` created), so components that
/// build their own pools (the local stack) can reach it.
pub fn url_of(pool: &PgPool) -> String {
    let o = pool.connect_options();
    let user = o.get_username();
    let host = o.get_host();
    let port = o.get_port();
    let db = o.get_database().unwrap_or("postgres");
    if host.starts_with('/') {
        format!("postgres://{user}@localhost:{port}/{db}?host={host}")
    } else {
        format!("postgres://{user}@{host}:{port}/{db}")
    }
}
