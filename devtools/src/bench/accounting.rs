//! `outbox-dev bench accounting`: what knowing every unordered event's outcome costs (decision record 0015).
//!
//! The relay learns that an in-flight unordered event was applied from the consumer's dedupe row
//! ([`outbox::internals::accounting::sweep_applied`]: a page scan of the in-flight index, a primary-key probe
//! per event and
//! the delivery-evidence update of the applied ones). Measured here on `--events` dispatched events whose dedupe
//! rows exist, beside a same-run baseline: the relay's own dispatch settle of the same number of rows (one
//! `UPDATE … WHERE id = ANY(…)` per 2,000 ids), which every event pays already. The alternative, delivery
//! callbacks, costs no relay work but one QStash message (billed) and one callback invocation per message:
//! `1 / RELAY_DELIVERY_BATCH` per event, printed for N = 1 and 50.

use std::time::{Duration, Instant};

use clap::Args;
use outbox::db::{Db, Statements};
use outbox_testkit::median;
use serde_json::json;

use super::support::ScratchDb;
use outbox_cli::util::DbArgs;

/// Arguments of `outbox-dev bench accounting`.
#[derive(Args, Debug)]
pub struct AccountingArgs {
    /// Dispatched events per round.
    #[arg(long, default_value_t = 100_000)]
    pub events: u64,
    /// Rounds (medians are printed).
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    #[command(flatten)]
    pub db: DbArgs,
}

const SEED_SQL: &str = "INSERT INTO outbox (topic, partition_key, payload, dispatched_at, qstash_message_id) \
    SELECT 'bench', 'k' || (g % 1000), jsonb_build_object('i', g, 'pad', repeat('x', 176)), \
           now() - interval '5 minutes', 'msg_' || g \
    FROM generate_series(1, $1::bigint) g";

const DEDUPE_SQL: &str = "INSERT INTO processed_messages (consumer, message_id) \
    SELECT 'consumer', id::text FROM outbox";

/// One round: fresh rows, then the baseline settle-shaped update and the sweep, each timed.
async fn round(db: &ScratchDb, events: u64) -> anyhow::Result<(f64, f64, u64)> {
    sqlx::query("TRUNCATE outbox, processed_messages")
        .execute(&db.pool)
        .await?;
    sqlx::query(SEED_SQL)
        .bind(events as i64)
        .execute(&db.pool)
        .await?;
    sqlx::query(DEDUPE_SQL).execute(&db.pool).await?;
    sqlx::query("VACUUM ANALYZE outbox")
        .execute(&db.pool)
        .await?;
    sqlx::query("VACUUM ANALYZE processed_messages")
        .execute(&db.pool)
        .await?;
    // Baseline: what the dispatch settle already writes per event (pages of 2,000 ids).
    let ids: Vec<i64> = sqlx::query_scalar("SELECT id FROM outbox ORDER BY id")
        .fetch_all(&db.pool)
        .await?;
    let t = Instant::now();
    for page in ids.chunks(2000) {
        sqlx::query(
            "UPDATE outbox SET dispatched_at = dispatched_at, lease_token = NULL, locked_until = NULL \
             WHERE id = ANY ($1::bigint[])",
        )
        .bind(page)
        .execute(&db.pool)
        .await?;
    }
    let settle = t.elapsed().as_secs_f64();
    sqlx::query("VACUUM ANALYZE outbox")
        .execute(&db.pool)
        .await?;
    let t = Instant::now();
    let marked = outbox::internals::accounting::sweep_applied(
        &Db::new(db.pool.clone(), Statements::Prepared),
        "consumer",
        Duration::from_secs(30),
        Duration::from_secs(3600),
    )
    .await?;
    let sweep = t.elapsed().as_secs_f64();
    Ok((settle, sweep, marked))
}

/// Runs the benchmark: a table and one `BENCH_JSON` line.
pub async fn run(args: AccountingArgs) -> anyhow::Result<()> {
    let db = ScratchDb::create(&args.db.database_url, "outbox_bench_accounting").await?;
    let mut settles = Vec::new();
    let mut sweeps = Vec::new();
    for r in 1..=args.rounds.max(1) {
        let (settle, sweep, marked) = round(&db, args.events).await?;
        if marked != args.events {
            anyhow::bail!(
                "the sweep marked {marked} of {} applied events",
                args.events
            );
        }
        println!(
            "round {r}: settle-shaped update {:.2} µs/event, applied sweep {:.2} µs/event ({} events)",
            settle * 1e6 / args.events as f64,
            sweep * 1e6 / args.events as f64,
            args.events
        );
        settles.push(settle * 1e6 / args.events as f64);
        sweeps.push(sweep * 1e6 / args.events as f64);
    }
    db.drop_now().await?;
    let (settle, sweep) = (median(&settles), median(&sweeps));
    println!(
        "\nOutcome of an unordered event, per event (median of {} rounds, {} events each):",
        args.rounds.max(1),
        args.events
    );
    println!(
        "  dedupe-row sweep (relay, in bulk)   {sweep:.2} µs of database time, 0 QStash messages"
    );
    println!(
        "  baseline: the dispatch settle       {settle:.2} µs (the sweep costs {:.2}× it)",
        sweep / settle
    );
    println!(
        "  delivery callbacks                  0 µs of relay time; 1 QStash message + 1 callback invocation per \
         message = 1 per event at RELAY_DELIVERY_BATCH=1, 0.02 at 50"
    );
    println!(
        "BENCH_JSON {}",
        json!({
            "bench": "accounting",
            "events": args.events,
            "rounds": args.rounds.max(1),
            "sweep_us_per_event": sweep,
            "settle_us_per_event": settle,
            "sweep_over_settle": sweep / settle,
            "sweep_rounds_us": sweeps,
            "settle_rounds_us": settles,
            "callback_messages_per_event": {"n1": 1.0, "n50": 0.02},
        })
    );
    Ok(())
}
