//! `outbox subscribers` against real Postgres, through the binary: a subscriber's own replay parallelism
//! (`--replay-parallelism`), refused before anything changes when it cannot be one.

mod common;

use sqlx::PgPool;

use common::outbox;

/// `replay_parallelism` of (topic, name), `None` when there is no such row.
async fn stored(pool: &PgPool, name: &str) -> Option<Option<i32>> {
    sqlx::query_scalar(
        "SELECT replay_parallelism FROM outbox_subscribers WHERE topic = 'orders' AND name = $1",
    )
    .bind(name)
    .fetch_optional(pool)
    .await
    .unwrap()
}

#[sqlx::test(migrator = "outbox::MIGRATOR")]
async fn a_subscribers_own_replay_parallelism_is_stored_and_a_bad_one_changes_nothing(
    pool: PgPool,
) {
    let run = |args: &[&str]| {
        let out = outbox(&pool, args).output().expect("running outbox");
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let add = [
        "subscribers",
        "add",
        "orders",
        "billing",
        "http://127.0.0.1:9",
    ];

    let (ok, err) = run(&[&add[..], &["--replay-parallelism", "0"]].concat());
    assert!(
        !ok && err.contains("replay parallelism 0 is outside 1 to 1000"),
        "{err}"
    );
    assert_eq!(stored(&pool, "billing").await, None, "nothing was added");

    let (ok, err) = run(&[
        "subscribers",
        "add",
        "orders",
        "default",
        "--replay-parallelism",
        "3",
    ]);
    assert!(!ok && err.contains("QSTASH_REPLAY_PARALLELISM"), "{err}");
    assert_eq!(stored(&pool, "").await, None);

    let (ok, err) = run(&[&add[..], &["--replay-parallelism", "7"]].concat());
    assert!(ok, "{err}");
    assert_eq!(stored(&pool, "billing").await, Some(Some(7)));

    // `replay` changes it for what is left of a replay (here: none under way).
    let (ok, err) = run(&[
        "subscribers",
        "replay",
        "orders",
        "billing",
        "--replay-parallelism",
        "9",
    ]);
    assert!(ok, "{err}");
    assert_eq!(stored(&pool, "billing").await, Some(Some(9)));
    let list = outbox(&pool, &["subscribers", "list"])
        .output()
        .expect("running outbox");
    let text = String::from_utf8_lossy(&list.stdout);
    assert!(
        text.lines()
            .any(|l| l.contains("billing") && l.contains("replay parallelism 9")),
        "{text}"
    );
}
