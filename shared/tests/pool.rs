//! The functions' pool (`DbConfig::pool`): a connection that died while idle (a Lambda environment frozen
//! between invocations, a NAT or server that dropped it) is noticed by the liveness ping and replaced, so the
//! next request does not fail on it. And the database handle (`Db`): its statement mode decides whether
//! statements are named, and whether a statement that would run in autocommit gets a transaction of its own.

use std::time::Duration;

use outbox::db::{Db, DbConfig, PING_IF_IDLE_FOR, Statements};
use secrecy::SecretString;
use sqlx::postgres::PgPoolOptions;

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

/// A handle on a pool of one connection (session state such as prepared statements and temporary tables stays
/// visible from one statement to the next).
async fn one_connection(statements: Statements) -> Db {
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .connect(&database_url())
        .await
        .unwrap();
    Db::new(pool, statements)
}

#[tokio::test]
async fn prepared_mode_names_its_statements_and_unnamed_mode_does_not() {
    for (statements, named) in [(Statements::Prepared, true), (Statements::Unnamed, false)] {
        let db = one_connection(statements).await;
        let sql = "SELECT 41 + $1::int4 AS handle_test";
        let n: i32 = db
            .run(async |c| db.query_scalar(sql).bind(1).fetch_one(c).await)
            .await
            .unwrap();
        assert_eq!(n, 42);
        let kept: i64 =
            sqlx::query_scalar("SELECT count(*) FROM pg_prepared_statements WHERE statement = $1")
                .bind(sql)
                .fetch_one(db.pool())
                .await
                .unwrap();
        assert_eq!(
            kept > 0,
            named,
            "{statements:?}: named statement kept = {kept}"
        );
        db.pool().close().await;
    }
}

#[tokio::test]
async fn unnamed_mode_runs_autocommit_work_in_a_transaction_of_its_own() {
    for (statements, own_transaction) in
        [(Statements::Prepared, false), (Statements::Unnamed, true)]
    {
        let db = one_connection(statements).await;
        // `SET LOCAL` lasts to the end of the transaction: the next statement sees it only inside one.
        let name: String = db
            .run(async |c| {
                sqlx::raw_sql("SET LOCAL application_name = 'inside'")
                    .execute(&mut *c)
                    .await?;
                db.query_scalar("SELECT current_setting('application_name')")
                    .fetch_one(c)
                    .await
            })
            .await
            .unwrap();
        assert_eq!(name == "inside", own_transaction, "{statements:?}: {name}");

        // Work that fails after a write: rolled back with its transaction, kept in autocommit.
        sqlx::raw_sql("CREATE TEMP TABLE handle_test (n int)")
            .execute(db.pool())
            .await
            .unwrap();
        let failed = db
            .run(async |c| {
                db.statements()
                    .execute(c, db.query("INSERT INTO handle_test VALUES (1)"))
                    .await?;
                Err::<(), _>(sqlx::Error::RowNotFound)
            })
            .await;
        assert!(failed.is_err());
        let n = db
            .execute(db.query("UPDATE handle_test SET n = n + 1"))
            .await
            .unwrap();
        assert_eq!(n == 0, own_transaction, "{statements:?}: {n} rows kept");
        db.pool().close().await;
    }
}
