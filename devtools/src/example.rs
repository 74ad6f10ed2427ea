//! `outbox-dev example …`: the example application (`examples/orders`) the consumer function ships with and
//! `outbox-dev dev` runs. Its tables are not the operator CLI's business (`outbox migrate` applies the outbox's
//! only, decision record 0010); a database the consumer as shipped writes to needs them too.

use clap::{Args, Subcommand};
use outbox_cli::util::{DbArgs, migrate_with};

/// `outbox-dev example …`.
#[derive(Subcommand, Debug)]
pub enum ExampleCommand {
    /// Apply the outbox's migrations and the example application's (its orders, charges, shipments and audit
    /// tables: what the consumer function as shipped writes to), and show the schema version. Not needed once
    /// the consumer runs your own handlers: your migrations bring your tables.
    Migrate(ExampleMigrateArgs),
}

/// Arguments of `outbox-dev example migrate`.
#[derive(Args, Debug, Clone)]
pub struct ExampleMigrateArgs {
    #[command(flatten)]
    pub db: DbArgs,
}

/// Runs an `example` command.
pub async fn run(cmd: ExampleCommand) -> anyhow::Result<()> {
    match cmd {
        ExampleCommand::Migrate(args) => {
            migrate_with(
                &args.db,
                &[("the example application", &orders_example::MIGRATOR)],
            )
            .await
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sqlx::PgPool;

    async fn exists(pool: &PgPool, table: &str) -> bool {
        sqlx::query_scalar("SELECT to_regclass($1) IS NOT NULL")
            .bind(table)
            .fetch_one(pool)
            .await
            .unwrap()
    }

    #[sqlx::test(migrations = false)]
    async fn example_migrate_adds_the_outbox_tables_and_the_example_applications(pool: PgPool) {
        for table in ["public.outbox", "public.orders", "public.charges"] {
            assert!(!exists(&pool, table).await, "{table} before migrating");
        }
        let db = DbArgs {
            database_url: outbox_testkit::db::url_of(&pool),
        };
        run(ExampleCommand::Migrate(ExampleMigrateArgs {
            db: db.clone(),
        }))
        .await
        .unwrap();
        for table in [
            "public.outbox",
            "public.processed_messages",
            "public.orders",
            "public.charges",
            "public.shipments",
        ] {
            assert!(exists(&pool, table).await, "{table} after migrating");
        }
        // Twice is harmless (both migrators skip what is applied, and each other's versions).
        run(ExampleCommand::Migrate(ExampleMigrateArgs { db }))
            .await
            .unwrap();
    }
}
