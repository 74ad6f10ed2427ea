//! "Check the plans your prepared statements get": the claim statements must use their partial indexes even
//! under a generic plan (what a prepared statement switches to after five executions), on a table with a
//! large pending backlog and history.

use outbox::db::Statements;
use outbox::internals::claim::ClaimStatements;
use sqlx::PgPool;

fn plan_nodes(plan: &serde_json::Value, out: &mut Vec<(String, Option<String>)>) {
    if let Some(obj) = plan.as_object() {
        if let Some(t) = obj.get("Node Type").and_then(|v| v.as_str()) {
            // The index a node reads, or for a scan without one the relation it reads.
            out.push((
                t.to_owned(),
                obj.get("Index Name")
                    .or_else(|| obj.get("Relation Name"))
                    .and_then(|v| v.as_str())
                    .map(str::to_owned),
            ));
        }
        for v in obj.values() {
            plan_nodes(v, out);
        }
    } else if let Some(arr) = plan.as_array() {
        for v in arr {
            plan_nodes(v, out);
        }
    }
}

async fn generic_plan(pool: &PgPool, sql: &str, args: &str) -> Vec<(String, Option<String>)> {
    let mut conn = pool.acquire().await.unwrap();
    sqlx::query("SET plan_cache_mode = force_generic_plan")
        .execute(&mut *conn)
        .await
        .unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "PREPARE claim(float8) AS {sql}"
    )))
    .execute(&mut *conn)
    .await
    .unwrap();
    let plan: serde_json::Value = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "EXPLAIN (FORMAT JSON) EXECUTE claim({args})"
    )))
    .fetch_one(&mut *conn)
    .await
    .unwrap();
    sqlx::query("DEALLOCATE claim")
        .execute(&mut *conn)
        .await
        .unwrap();
    let mut nodes = Vec::new();
    plan_nodes(&plan, &mut nodes);
    // The outbox is partitioned: a plan names each partition's index; name the outbox's index it belongs to.
    let parents: std::collections::HashMap<String, String> = sqlx::query_as(
        "SELECT c.relname::text, p.relname::text FROM pg_inherits i \
         JOIN pg_class c ON c.oid = i.inhrelid JOIN pg_class p ON p.oid = i.inhparent WHERE c.relkind = 'i'",
    )
    .fetch_all(&mut *conn)
    .await
    .unwrap()
    .into_iter()
    .collect();
    for (_, idx) in &mut nodes {
        if let Some(parent) = idx.as_ref().and_then(|i| parents.get(i)) {
            *idx = Some(parent.clone());
        }
    }
    nodes
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn claims_use_their_partial_indexes_under_a_generic_plan(pool: PgPool) {
    // A range partition made ahead (it takes the first 10,000 events), DEFAULT the rest.
    let db = outbox::db::Db::new(pool.clone(), Statements::Prepared);
    let made = outbox::internals::partitions::maintain(
        &db,
        outbox::internals::partitions::PartitionSettings::new(
            std::time::Duration::from_secs(3600),
            std::time::Duration::from_secs(10),
        ),
    )
    .await;
    assert_eq!((made.created, made.error), (1, None));
    // 40k pending unordered rows, 40k rows of history, 2k ordered keys with 5 events each.
    sqlx::query(
        "INSERT INTO outbox (topic, partition_key, payload, dispatched_at) \
         SELECT 'audit', 'k' || (g % 100), '{}'::jsonb, CASE WHEN g % 2 = 0 THEN now() END \
         FROM generate_series(1, 80000) g",
    )
    .execute(&pool)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO outbox (topic, partition_key, seq, payload) \
         SELECT 'orders', 'c' || k, s, '{}'::jsonb FROM generate_series(1, 2000) k, generate_series(1, 5) s",
    )
    .execute(&pool)
    .await
    .unwrap();
    sqlx::query("INSERT INTO outbox_keys (topic, partition_key, done_seq) SELECT 'orders', 'c' || k, 0 FROM generate_series(1, 2000) k")
        .execute(&pool)
        .await
        .unwrap();
    sqlx::query("ANALYZE outbox").execute(&pool).await.unwrap();
    sqlx::query("ANALYZE outbox_keys")
        .execute(&pool)
        .await
        .unwrap();

    let claims = ClaimStatements::new(500, Statements::Prepared);
    let unordered = generic_plan(&pool, claims.unordered_sql(), "15").await;
    assert!(
        unordered
            .iter()
            .any(|(_, idx)| idx.as_deref() == Some("outbox_claim_idx")),
        "unordered claim does not use outbox_claim_idx: {unordered:?}"
    );
    assert!(unordered.iter().any(|(t, _)| t == "Limit"), "{unordered:?}");
    assert!(
        !unordered
            .iter()
            .any(|(t, _)| t == "Seq Scan" || t == "Sort"),
        "unordered claim scans or sorts: {unordered:?}"
    );

    let ordered = generic_plan(&pool, claims.ordered_sql(), "15").await;
    assert!(
        ordered
            .iter()
            .any(|(_, idx)| idx.as_deref() == Some("outbox_keys_ready_idx")),
        "ordered claim does not use outbox_keys_ready_idx: {ordered:?}"
    );
    assert!(
        ordered
            .iter()
            .any(|(_, idx)| idx.as_deref() == Some("outbox_key_seq_idx")),
        "ordered claim does not find heads by outbox_key_seq_idx: {ordered:?}"
    );
    assert!(
        !ordered.iter().any(|(t, _)| t == "Seq Scan"),
        "ordered claim scans a table: {ordered:?}"
    );
    // With delivery batches the ordered claim takes runs: the same indexes, no table scan.
    let runs = ClaimStatements::new(500, Statements::Prepared).with_delivery_batching(
        &outbox::config::DeliveryBatching {
            default_n: 1,
            topics: vec![("orders".into(), 3)],
            max_message_bytes: 1_000_000,
        },
    );
    assert_ne!(runs.ordered_sql(), claims.ordered_sql());
    let ordered = generic_plan(
        &pool,
        runs.ordered_sql(),
        "15, '{orders}'::text[], '{3}'::int[], 1",
    )
    .await;
    for idx in ["outbox_keys_ready_idx", "outbox_key_seq_idx"] {
        assert!(
            ordered.iter().any(|(_, i)| i.as_deref() == Some(idx)),
            "batched ordered claim does not use {idx}: {ordered:?}"
        );
    }
    assert!(
        !ordered.iter().any(|(t, _)| t == "Seq Scan"),
        "batched ordered claim scans a table: {ordered:?}"
    );
}

/// Under retention churn — events written, dispatched and delivered, then deleted by the relay's own
/// housekeeping, round after round, leaving dead tuples that no vacuum has removed (autovacuum is off on the test
/// server, the worst case) — the claims keep their index plans, with the statistics as the churn left them and
/// after an `ANALYZE` (what autovacuum runs). Dead index entries make the walk longer (`outbox-dev bench
/// sustained` measures by how much); they must never turn a claim into a table scan or a sort.
#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn claims_keep_their_plans_under_retention_churn(pool: PgPool) {
    use outbox::internals::housekeeping::{self, Retention};
    use std::time::Duration;
    let db = outbox::db::Db::new(pool.clone(), Statements::Prepared);
    let retention = Retention {
        outbox: Duration::from_secs(3600),
        processed: Duration::from_secs(3600),
        batch: 1000,
        time_budget: Duration::from_secs(120),
    };
    // Every event in DEFAULT; the empty first partition of a new database gone, as the relay's first
    // housekeeping pass leaves it.
    sqlx::query("DROP TABLE outbox_legacy")
        .execute(&pool)
        .await
        .unwrap();
    for round in 0..4i64 {
        sqlx::query(
            "INSERT INTO outbox (topic, partition_key, payload) \
             SELECT 'audit', 'k' || (g % 100), '{}'::jsonb FROM generate_series(1, 20000) g",
        )
        .execute(&pool)
        .await
        .unwrap();
        sqlx::query(
            "INSERT INTO outbox (topic, partition_key, seq, payload) \
             SELECT 'orders', 'c' || k, $1 * 5 + s, '{}'::jsonb FROM generate_series(1, 1000) k, generate_series(1, 5) s",
        )
        .bind(round)
        .execute(&pool)
        .await
        .unwrap();
        // Dispatched and delivered as the settle and the delivery callbacks record it, two hours ago.
        sqlx::query(
            "UPDATE outbox SET dispatched_at = now() - interval '2 hours', delivered_at = now() - interval '2 hours' \
             WHERE dispatched_at IS NULL",
        )
        .execute(&pool)
        .await
        .unwrap();
        sqlx::query(
            "INSERT INTO outbox_keys (topic, partition_key, done_seq) \
             SELECT 'orders', 'c' || k, ($1 + 1) * 5 FROM generate_series(1, 1000) k \
             ON CONFLICT (topic, partition_key, subscriber) DO UPDATE SET done_seq = excluded.done_seq",
        )
        .bind(round)
        .execute(&pool)
        .await
        .unwrap();
        // Row retention, as it runs on DEFAULT (where events land when no range partition is ready: the relay
        // lacks the privilege to make them, or a long transaction held its lock) and on the pre-partitioning table.
        let mut pruned = 0;
        loop {
            let n = housekeeping::prune_outbox_batch(&db, retention.outbox, retention.batch)
                .await
                .unwrap();
            pruned += n;
            if n == 0 {
                break;
            }
        }
        assert_eq!(pruned, 25_000, "round {round}");
    }
    // What is pending now: 5,000 unordered events, and the next event of each ordered key.
    sqlx::query(
        "INSERT INTO outbox (topic, partition_key, payload) \
         SELECT 'audit', 'k' || (g % 100), '{}'::jsonb FROM generate_series(1, 5000) g",
    )
    .execute(&pool)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO outbox (topic, partition_key, seq, payload) \
         SELECT 'orders', 'c' || k, 21, '{}'::jsonb FROM generate_series(1, 1000) k",
    )
    .execute(&pool)
    .await
    .unwrap();
    let dead: i64 = sqlx::query_scalar(
        "SELECT n_dead_tup FROM pg_stat_all_tables WHERE relid = 'outbox_default'::regclass",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert!(dead >= 50_000, "the churn left {dead} dead tuples");

    let claims = ClaimStatements::new(500, Statements::Prepared);
    for analyzed in [false, true] {
        if analyzed {
            sqlx::query("ANALYZE outbox, outbox_keys")
                .execute(&pool)
                .await
                .unwrap();
        }
        let unordered = generic_plan(&pool, claims.unordered_sql(), "15").await;
        assert!(
            unordered
                .iter()
                .any(|(_, idx)| idx.as_deref() == Some("outbox_claim_idx")),
            "analyzed {analyzed}: the unordered claim does not use outbox_claim_idx: {unordered:?}"
        );
        assert!(
            !unordered
                .iter()
                .any(|(t, _)| t == "Seq Scan" || t == "Sort"),
            "analyzed {analyzed}: the unordered claim scans or sorts: {unordered:?}"
        );
        let ordered = generic_plan(&pool, claims.ordered_sql(), "15").await;
        for idx in ["outbox_keys_ready_idx", "outbox_key_seq_idx"] {
            assert!(
                ordered.iter().any(|(_, i)| i.as_deref() == Some(idx)),
                "analyzed {analyzed}: the ordered claim does not use {idx}: {ordered:?}"
            );
        }
        assert!(
            !ordered.iter().any(|(t, _)| t == "Seq Scan"),
            "analyzed {analyzed}: the ordered claim scans a table: {ordered:?}"
        );
    }
}

/// The fair claim (`outbox::fairness`) at a million waiting rows of 10,000 tenants: the walk over the tenants, each
/// tenant's share and the fill are index scans of `outbox_fair_claim_idx` and `outbox_claim_idx` under a generic
/// plan, with no table scan and no sort of the backlog; run once, it claims a full batch spread over the tenants
/// it walked.
#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn the_fair_claim_stays_index_scans_at_a_million_waiting_rows_and_ten_thousand_tenants(
    pool: PgPool,
) {
    sqlx::query(
        "INSERT INTO outbox (topic, partition_key, payload, fairness_key) \
         SELECT 'audit', 'k' || (g % 1000), '{}'::jsonb, 't' || lpad((g % 10000)::text, 5, '0') \
         FROM generate_series(1, 1000000) g",
    )
    .execute(&pool)
    .await
    .unwrap();
    sqlx::query("ANALYZE outbox").execute(&pool).await.unwrap();
    let claims = ClaimStatements::new(500, Statements::Prepared).with_fair_claims(true);
    let plan = generic_plan(&pool, claims.unordered_sql(), "15, ''").await;
    for idx in ["outbox_fair_claim_idx", "outbox_claim_idx"] {
        assert!(
            plan.iter().any(|(_, i)| i.as_deref() == Some(idx)),
            "the fair claim does not use {idx}: {plan:?}"
        );
    }
    // No sort; the only tables read whole are the paused keys and the empty partition below the first id
    // (`outbox_legacy`, read whole by the update's id lookup at no cost); the million rows in `outbox_default` never.
    assert!(
        !plan.iter().any(|(t, rel)| t == "Sort"
            || (t == "Seq Scan"
                && !matches!(rel.as_deref(), Some("outbox_paused_keys" | "outbox_legacy")))),
        "the fair claim scans the outbox or sorts: {plan:?}"
    );
    let mut conn = pool.acquire().await.unwrap();
    let started = std::time::Instant::now();
    let claimed = claims.claim_unordered(&mut conn, 15.0).await.unwrap();
    eprintln!(
        "fair claim of 500 at 1M waiting rows, 10,000 tenants: {:?}",
        started.elapsed()
    );
    assert_eq!(claimed.len(), 500);
    let tenants: std::collections::BTreeSet<&str> =
        claimed.iter().map(|e| e.fairness_key.as_str()).collect();
    // 100 tenants walked (outbox::fairness::KEYS_PER_CLAIM), 5 rows each.
    assert_eq!(tenants.len(), 100, "{tenants:?}");
}
