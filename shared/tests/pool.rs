//! The functions' pool (`DbConfig::pool`): a connection that died while idle (a Lambda environment frozen
//! between invocations, a NAT or server that dropped it) is noticed by the liveness ping and replaced, so the
//! next request does not fail on it.

use std::time::Duration;

use outbox::db::{DbConfig, PING_IF_IDLE_FOR};
use secrecy::SecretString;

fn database_url() -> String {
    std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".to_owned())
}

#[tokio::test]
async fn a_connection_killed_while_idle_is_replaced_before_use() {
    let url = database_url();
    let mut cfg = DbConfig::defaults("pool-test");
    cfg.max_connections = 1;
    let pool = cfg.pool(&SecretString::from(url.clone())).unwrap();
    let first: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&pool)
        .await
        .unwrap();

    // Kill the pooled connection from outside while it sits idle, and let it stay idle past the threshold.
    let admin = sqlx::PgPool::connect(&url).await.unwrap();
    let killed: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1)")
        .bind(first)
        .fetch_one(&admin)
        .await
        .unwrap();
    assert!(killed);
    tokio::time::sleep(PING_IF_IDLE_FOR + Duration::from_millis(300)).await;

    let second: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&pool)
        .await
        .expect("the dead idle connection is replaced, not handed out");
    assert_ne!(first, second, "a new backend serves the query");
    pool.close().await;
    admin.close().await;
}
