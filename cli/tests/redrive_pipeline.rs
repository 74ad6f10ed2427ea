//! Redrive end to end through the local pipeline (dev server, relay, consumer and callbacks): a poisoned head of
//! an ordered key dies and blocks its key; once the cause is fixed, `outbox dead-letters redrive <id>` delivers it
//! (within QStash's dedup window: the fresh deduplication id matters) and the events queued behind it follow in
//! order, each applied once. On a skip-policy topic the dead head is a middle event: refused without
//! `--out-of-order`, then applied after the later events of its key (unordered, not refused as late).

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use outbox::consumer::{Event, Handler, HandlerError, Registry, TopicRoute};
use outbox::producer::{NewEvent, Topic, enqueue_batch};
use outbox_cli::dead_letters::{Confirm, DeadLettersCommand, FilterArgs, RedriveArgs, run};
use outbox_testkit::db::url_of;
use outbox_testkit::stack::{LocalStack, StackOptions};
use outbox_testkit::text;
use serde_json::{Value, json};
use sqlx::PgPool;

use common::db;

const LEDGER: Topic = Topic::ordered("ledger");
const LEDGER_SKIP: Topic = Topic::ordered("ledger.skip");

/// Applies an event by writing an `audit_log` row (its id gives the order of application); refuses events marked
/// poison while `fail` is set.
struct Ledger {
    fail: Arc<AtomicBool>,
}

impl Handler<Value> for Ledger {
    async fn handle(
        &self,
        conn: &mut sqlx::PgConnection,
        event: &Event<Value>,
    ) -> Result<(), HandlerError> {
        if self.fail.load(Ordering::SeqCst) && event.payload["poison"] == json!(true) {
            return Err(HandlerError::permanent(
                "poisoned (until the fix is deployed)",
            ));
        }
        sqlx::query("INSERT INTO audit_log (outbox_id, actor, action) VALUES ($1, $2, $3)")
            .bind(event.meta.outbox_id)
            .bind(event.meta.key.clone().unwrap_or_default())
            .bind(&event.meta.topic)
            .execute(&mut *conn)
            .await?;
        Ok(())
    }
}

async fn wait_for(pool: &PgPool, what: &str, sql: &'static str, want: i64) {
    for _ in 0..600 {
        let n: i64 = sqlx::query_scalar(sql).fetch_one(pool).await.unwrap();
        if n == want {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let state: Vec<Value> = sqlx::query_scalar(
        "SELECT to_jsonb(x) FROM (SELECT 'outbox' AS t, to_jsonb(o) AS r FROM outbox o UNION ALL \
         SELECT 'dead', to_jsonb(d) - 'payload' - 'headers' FROM dead_letters d UNION ALL \
         SELECT 'key', to_jsonb(k) FROM outbox_keys k UNION ALL SELECT 'applied', to_jsonb(a) FROM audit_log a) x",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    panic!(
        "timed out waiting for {what}; state:\n{}",
        state
            .iter()
            .map(Value::to_string)
            .collect::<Vec<_>>()
            .join("\n")
    );
}

/// `audit_log` ids of the events applied, in application order.
async fn applied(pool: &PgPool, ids: &[i64]) -> Vec<i64> {
    sqlx::query_scalar("SELECT outbox_id FROM audit_log WHERE outbox_id = ANY($1) ORDER BY id")
        .bind(ids)
        .fetch_all(pool)
        .await
        .unwrap()
}

fn redrive(pool: &PgPool, id: i64, out_of_order: bool) -> DeadLettersCommand {
    DeadLettersCommand::Redrive(RedriveArgs {
        db: db(pool),
        id: Some(id.into()),
        filter: FilterArgs::default(),
        out_of_order,
        yes: false,
        json: false,
    })
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn redrive_through_the_pipeline(pool: PgPool) {
    let fail = Arc::new(AtomicBool::new(true));
    let mut opts = StackOptions::new(&url_of(&pool)).unwrap();
    opts.registry = Registry::new()
        .route(TopicRoute::new("ledger", Ledger { fail: fail.clone() }))
        .route(TopicRoute::new(
            "ledger.skip",
            Ledger { fail: fail.clone() },
        ));
    opts.relay.skip_topics = vec!["ledger.skip".into()];
    let stack = LocalStack::start(opts).await.unwrap();

    let mut tx = pool.begin().await.unwrap();
    let events = [
        NewEvent::new(&LEDGER, "acct-1", &json!({"n": 1, "poison": true})).unwrap(),
        NewEvent::new(&LEDGER, "acct-1", &json!({"n": 2})).unwrap(),
        NewEvent::new(&LEDGER, "acct-1", &json!({"n": 3})).unwrap(),
        NewEvent::new(&LEDGER_SKIP, "acct-2", &json!({"n": 1, "poison": true})).unwrap(),
        NewEvent::new(&LEDGER_SKIP, "acct-2", &json!({"n": 2})).unwrap(),
        NewEvent::new(&LEDGER_SKIP, "acct-2", &json!({"n": 3})).unwrap(),
    ];
    let ids: Vec<i64> = enqueue_batch(&mut tx, &events)
        .await
        .unwrap()
        .iter()
        .map(|e| e.id.get())
        .collect();
    tx.commit().await.unwrap();
    let (e, f) = (&ids[0..3], &ids[3..6]);

    // Both poisoned heads die; "ledger" blocks its key, "ledger.skip" skips past it.
    wait_for(
        &pool,
        "two dead letters",
        "SELECT count(*) FROM dead_letters",
        2,
    )
    .await;
    wait_for(
        &pool,
        "the skip topic's later events",
        "SELECT count(*) FROM audit_log WHERE action = 'ledger.skip'",
        2,
    )
    .await;
    assert_eq!(
        applied(&pool, e).await,
        Vec::<i64>::new(),
        "acct-1 is blocked behind its dead head"
    );
    assert_eq!(applied(&pool, f).await, vec![f[1], f[2]]);
    let dl = |outbox_id: i64| {
        let pool = pool.clone();
        async move {
            sqlx::query_scalar::<_, i64>("SELECT id FROM dead_letters WHERE outbox_id = $1")
                .bind(outbox_id)
                .fetch_one(&pool)
                .await
                .unwrap()
        }
    };
    let (dl_e, dl_f) = (dl(e[0]).await, dl(f[0]).await);

    // The fix is deployed; redrive the blocking head: it goes first, then the rest of its key, in order.
    fail.store(false, Ordering::SeqCst);
    let mut out = Vec::new();
    run(redrive(&pool, dl_e, false), &mut out, Confirm::NoTerminal)
        .await
        .unwrap();
    let t = text(&out);
    assert!(
        t.contains(&format!("deduplication id outbox-{}-r1", e[0])),
        "{t}"
    );
    assert!(t.contains("the key is unblocked"), "{t}");
    wait_for(
        &pool,
        "acct-1 to be applied",
        "SELECT count(*) FROM audit_log WHERE action = 'ledger'",
        3,
    )
    .await;
    assert_eq!(
        applied(&pool, e).await,
        e.to_vec(),
        "head first, then the rest in order, each once"
    );

    // The skipped head is a middle event: refused, then redriven out of order (applied after seq 2 and 3).
    let err = run(
        redrive(&pool, dl_f, false),
        &mut Vec::new(),
        Confirm::NoTerminal,
    )
    .await
    .unwrap_err();
    assert!(err.to_string().contains("--out-of-order"), "{err}");
    let mut out = Vec::new();
    run(redrive(&pool, dl_f, true), &mut out, Confirm::NoTerminal)
        .await
        .unwrap();
    assert!(text(&out).contains("OUT OF ORDER"), "{}", text(&out));
    wait_for(
        &pool,
        "the middle event",
        "SELECT count(*) FROM audit_log WHERE action = 'ledger.skip'",
        3,
    )
    .await;
    assert_eq!(applied(&pool, f).await, vec![f[1], f[2], f[0]]);

    assert!(stack.wait_quiet(Duration::from_secs(30)).await);
    let dead: i64 = sqlx::query_scalar("SELECT count(*) FROM dead_letters")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(
        dead, 2,
        "no new dead letter: the consumer did not refuse the out-of-order event as late"
    );
    let s = outbox::ops::status(&pool).await.unwrap();
    assert_eq!(s.blocked_keys.count, 0);
    assert_eq!(s.unresolved_dead_letters(), 0);
    assert_eq!(s.backlog.pending, 0);
    let processed: i64 = sqlx::query_scalar("SELECT count(*) FROM processed_messages")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(processed, 6, "each event applied exactly once");
    stack.stop().await;
}
