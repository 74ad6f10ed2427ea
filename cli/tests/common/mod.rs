//! What the CLI's tests share: the commands' database arguments and the `outbox` binary, both for the
//! `#[sqlx::test]` database of a test. (Each test binary uses a part of it.)
#![allow(dead_code)]

use outbox_cli::util::DbArgs;
use outbox_testkit::db::url_of;
use sqlx::PgPool;

/// The commands' database arguments for the database behind `pool`.
pub fn db(pool: &PgPool) -> DbArgs {
    DbArgs {
        database_url: url_of(pool),
    }
}

/// The `outbox` binary with `args` against the database behind `pool` (`DATABASE_URL`): no terminal on stdin,
/// and no `OUTBOX_SCHEMA` or `RUST_LOG` from the test's own environment.
pub fn outbox(pool: &PgPool, args: &[&str]) -> std::process::Command {
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_outbox"));
    cmd.args(args)
        .env("DATABASE_URL", url_of(pool))
        .env_remove("OUTBOX_SCHEMA")
        .env_remove("RUST_LOG")
        .stdin(std::process::Stdio::null());
    cmd
}
