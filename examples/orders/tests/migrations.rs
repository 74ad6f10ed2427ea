//! The example's two migrations used to be the library's: one migrator, `migrations/` with three files. They moved
//! to `examples/orders/migrations/` with their versions and bytes, and each of the two migrators now ignores the
//! other's versions (`ignore_missing`). A database migrated before the split must migrate cleanly with either
//! migrator, and nothing may change in it (decision record 0010).

use std::path::PathBuf;
use std::time::{SystemTime, UNIX_EPOCH};

use outbox_testkit::repo_root;
use sqlx::PgPool;
use sqlx::migrate::Migrator;

/// A temp dir holding the three files as they were together in `migrations/`, removed on drop.
struct OldMigrations(PathBuf);

impl OldMigrations {
    fn new() -> OldMigrations {
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_nanos();
        let dir = std::env::temp_dir().join(format!(
            "outbox-old-migrations-{}-{nanos}",
            std::process::id()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let root = repo_root();
        for file in [
            "migrations/20261129000001_outbox.sql",
            "examples/orders/migrations/20261129000002_example_domain.sql",
            "examples/orders/migrations/20261129000003_example_orders.sql",
        ] {
            let from = root.join(file);
            std::fs::copy(&from, dir.join(from.file_name().unwrap()))
                .unwrap_or_else(|e| panic!("{file}: {e}"));
        }
        OldMigrations(dir)
    }

    /// The single migrator of before: the three files, `ignore_missing` off.
    async fn migrator(&self) -> Migrator {
        let m = Migrator::new(self.0.as_path()).await.unwrap();
        assert!(!m.ignore_missing);
        m
    }
}

impl Drop for OldMigrations {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// What a migration run could change: the applied migrations and the schema (tables, columns, indexes,
/// constraints, sequences).
async fn snapshot(pool: &PgPool) -> Vec<String> {
    let mut out: Vec<String> = sqlx::query_scalar(
        "SELECT format('migration %s %s %s %s', version, description, encode(checksum, 'hex'), success) \
         FROM _sqlx_migrations ORDER BY version",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    for sql in [
        "SELECT format('column %s.%s %s %s %s', table_name, column_name, data_type, is_nullable, column_default) \
         FROM information_schema.columns WHERE table_schema = current_schema() ORDER BY 1",
        "SELECT format('index %s', indexdef) FROM pg_indexes WHERE schemaname = current_schema() ORDER BY 1",
        "SELECT format('constraint %s %s', conname, pg_get_constraintdef(oid)) FROM pg_constraint \
         WHERE connamespace = current_schema()::regnamespace ORDER BY 1",
        "SELECT format('sequence %s', sequence_name) FROM information_schema.sequences \
         WHERE sequence_schema = current_schema() ORDER BY 1",
    ] {
        out.extend(
            sqlx::query_scalar::<_, String>(sql)
                .fetch_all(pool)
                .await
                .unwrap(),
        );
    }
    out
}

/// The versions a migrator holds, ascending.
fn versions_of(m: &Migrator) -> Vec<i64> {
    let mut v: Vec<i64> = m.iter().map(|m| m.version).collect();
    v.sort();
    v
}

/// The library's and the example's versions together, ascending.
fn both_versions() -> Vec<i64> {
    let mut v = versions_of(&outbox::MIGRATOR);
    v.extend(versions_of(&orders_example::MIGRATOR));
    v.sort();
    v.dedup();
    v
}

async fn versions(pool: &PgPool) -> Vec<i64> {
    sqlx::query_scalar("SELECT version FROM _sqlx_migrations ORDER BY version")
        .fetch_all(pool)
        .await
        .unwrap()
}

#[sqlx::test(migrations = false)]
async fn a_database_migrated_before_the_split_migrates_cleanly_with_either_migrator(pool: PgPool) {
    let old = OldMigrations::new();
    old.migrator().await.run(&pool).await.unwrap();
    assert_eq!(
        versions(&pool).await,
        [20261129000001, 20261129000002, 20261129000003]
    );
    // The library's migrator runs on it (it ignores the example's versions) and adds only the library's
    // migrations written since the split.
    outbox::MIGRATOR
        .run(&pool)
        .await
        .expect("the library's migrator on a database that has the example's versions too");
    assert_eq!(versions(&pool).await, both_versions());
    let before = snapshot(&pool).await;
    assert!(
        before.iter().any(|l| l.starts_with("column charges.")),
        "{before:?}"
    );
    outbox::MIGRATOR.run(&pool).await.unwrap();
    assert_eq!(snapshot(&pool).await, before, "outbox::MIGRATOR changed it");
    orders_example::MIGRATOR
        .run(&pool)
        .await
        .expect("the example's migrator on a database that has the library's version too");
    assert_eq!(
        snapshot(&pool).await,
        before,
        "orders_example::MIGRATOR changed it"
    );
    outbox_testkit::MIGRATOR.run(&pool).await.unwrap();
    assert_eq!(snapshot(&pool).await, before);
}

/// The other way round: a database migrated by the two migrators now holds what the single migrator of before
/// made (same versions and checksums) plus the library's later migrations, and running either migrator again
/// changes nothing.
#[sqlx::test(migrations = false)]
async fn the_two_migrators_make_what_the_single_one_made(pool: PgPool) {
    outbox::MIGRATOR.run(&pool).await.unwrap();
    assert_eq!(versions(&pool).await, versions_of(&outbox::MIGRATOR));
    let tables: Vec<String> = sqlx::query_scalar(
        "SELECT table_name::text FROM information_schema.tables WHERE table_schema = current_schema() \
         AND table_name NOT LIKE '\\_sqlx%' \
         AND NOT EXISTS (SELECT 1 FROM pg_class c WHERE c.relname = table_name AND c.relispartition) ORDER BY 1",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(
        tables,
        [
            "consumer_sequences",
            "dead_letters",
            "outbox",
            "outbox_accounting",
            "outbox_console_actions",
            "outbox_default_consumer",
            "outbox_keys",
            "outbox_paused_keys",
            "outbox_relay_outage",
            "outbox_sequences",
            "outbox_subscribers",
            "processed_messages"
        ],
        "the library's migrations hold the outbox's tables only"
    );
    orders_example::MIGRATOR.run(&pool).await.unwrap();
    let after = snapshot(&pool).await;
    assert_eq!(versions(&pool).await, both_versions());

    let old = OldMigrations::new().migrator().await;
    let applied: Vec<(i64, Vec<u8>)> = sqlx::query_as(
        "SELECT version, checksum FROM _sqlx_migrations WHERE version <= 20261129000003 ORDER BY version",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    let expected: Vec<(i64, Vec<u8>)> = old
        .iter()
        .map(|m| (m.version, m.checksum.to_vec()))
        .collect();
    assert_eq!(applied, expected, "same versions and checksums as before");
    // (A binary of before would refuse this database now: it holds library migrations written since. The versions
    // of before keep their bytes, so upgrading such a binary only adds migrations.)
    outbox::MIGRATOR.run(&pool).await.unwrap();
    orders_example::MIGRATOR.run(&pool).await.unwrap();
    assert_eq!(snapshot(&pool).await, after);
}
