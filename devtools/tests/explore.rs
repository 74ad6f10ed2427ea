//! The schedule explorer (`outbox-dev soak --schedule random`, `outbox_devtools::soak::explore`) over the whole
//! pipeline: relays, one consumer per subscriber and the callback receiver as processes, the dev server with its
//! faults, a Postgres cluster of the explorer's own that it crashes, and the operator's actions. Each test runs
//! one schedule and fails on any violation the checker finds, printing the seed, the schedule and the histories
//! of the events involved.
//!
//! * CI: a short schedule of a fixed seed, and one of a seed drawn at the run (printed: rerun it with
//!   `outbox-dev soak --schedule random --seed S --minutes 1`).
//! * The kept schedules (`explore::kept::KEPT`, the table in `docs/reliability.md`): seeds that found a defect, or
//!   cover a combination on purpose. Each has its test below; the drawn schedules are checked to still hold what
//!   each covers (cheap: no processes).

use std::time::Duration;

use outbox_devtools::soak::SoakArgs;
use outbox_devtools::soak::explore::kept::{Covers, KEPT, Kept};
use outbox_devtools::soak::explore::schedule::Schedule;
use outbox_devtools::soak::explore::{self, ExploreReport};

/// The CI's fixed seed and length.
const CI_SEED: u64 = 4;
const CI_MINUTES: f64 = 1.0;

async fn run(seed: u64, minutes: f64) -> ExploreReport {
    let log_dir =
        std::env::temp_dir().join(format!("outbox-explore-test-{}-{seed}", std::process::id()));
    let mut args = SoakArgs::parse(&[
        "--schedule",
        "random",
        "--seed",
        &seed.to_string(),
        "--minutes",
        &minutes.to_string(),
        "--progress-secs",
        "30",
    ])
    .unwrap();
    args.log_dir = Some(log_dir.clone());
    args.worker_exe = Some(env!("CARGO_BIN_EXE_outbox-dev").into());
    let report = explore::run(args).await.unwrap();
    println!("{}", report.line());
    if report.ok {
        let _ = std::fs::remove_dir_all(&log_dir);
    } else {
        println!("worker logs in {}", log_dir.display());
    }
    report
}

fn assert_ok(r: &ExploreReport) {
    assert!(r.ok, "{}\n{}", r.details, r.line());
    assert!(r.drained, "{}", r.line());
    assert!(r.checked.figures.owed > 0, "{}", r.line());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_short_schedule_of_a_fixed_seed_keeps_every_guarantee() {
    assert_ok(&run(CI_SEED, CI_MINUTES).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_short_schedule_of_a_seed_drawn_now_keeps_every_guarantee() {
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64
        % 1_000_000;
    println!(
        "seed {seed}: rerun with `outbox-dev soak --schedule random --seed {seed} --minutes {CI_MINUTES}`"
    );
    assert_ok(&run(seed, CI_MINUTES).await);
}

/// Runs kept schedule `name`.
async fn kept(name: &str) {
    let k: &Kept = KEPT.iter().find(|k| k.name == name).unwrap();
    assert_ok(&run(k.seed, k.minutes).await);
}

#[test]
fn every_kept_schedule_still_draws_what_it_covers() {
    for k in KEPT {
        let s = Schedule::draw(k.seed, Duration::from_secs_f64(k.minutes * 60.0));
        for c in k.covers {
            assert!(
                c.drawn_in(&s),
                "kept schedule {} (seed {}) no longer draws {c:?}:\n{s}",
                k.name,
                k.seed
            );
        }
    }
    for c in [
        Covers::CrashDuringReplay,
        Covers::CrashDuringDrain,
        Covers::CrashDuringPartitionDrop,
    ] {
        assert!(
            KEPT.iter().any(|k| k.covers.contains(&c)),
            "no kept schedule covers {c:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "passes on main (2026-12-07); outside CI's run for its length (about 3 minutes): scripts/test devtools/tests/explore.rs --run-ignored only"]
async fn kept_replay_misses_a_long_producer_transaction() {
    kept("replay_misses_a_long_producer_transaction").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "passes on main (2026-12-07; its last defect, a withdrawn copy's open dead letter, fixed since); outside CI's run for its length (about 3 minutes): scripts/test devtools/tests/explore.rs --run-ignored only"]
async fn kept_re_added_subscriber_applies_twice() {
    kept("re_added_subscriber_applies_twice").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "passes on main (2026-12-07); outside CI's run for its length (about 3 minutes): scripts/test devtools/tests/explore.rs --run-ignored only"]
async fn kept_subscriber_added_during_traffic_dead_lettered() {
    kept("subscriber_added_during_traffic_dead_lettered").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "passes on main (2026-12-07); outside CI's run for its length (about 3 minutes): scripts/test devtools/tests/explore.rs --run-ignored only"]
async fn kept_replay_from_a_time_reaches_older_events() {
    kept("replay_from_a_time_reaches_older_events").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "passes on main (2026-12-07; its defect, an open \"no destination\" dead letter for an applied copy, fixed since by the applied sweep); outside CI's run for its length (about 3 minutes): scripts/test devtools/tests/explore.rs --run-ignored only"]
async fn kept_sweep_leaves_a_dead_letter_open() {
    kept("sweep_leaves_a_dead_letter_open").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kept_crashes_during_a_replay_a_drain_and_a_partition_drop() {
    kept("crashes_during_a_replay_a_drain_and_a_partition_drop").await;
}

#[test]
fn every_kept_schedule_has_its_test() {
    let this = include_str!("explore.rs");
    for k in KEPT {
        assert!(
            this.contains(&format!("async fn kept_{}()", k.name)),
            "kept schedule {} has no test `kept_{}` in devtools/tests/explore.rs",
            k.name,
            k.name
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "passes on main (2026-12-07; its defect, gaps a prune left in a resumed replay, fixed since); outside CI's run for its length (about 4 minutes): scripts/test devtools/tests/explore.rs --run-ignored only"]
async fn kept_replay_resumed_after_a_prune_waits_at_gaps() {
    kept("replay_resumed_after_a_prune_waits_at_gaps").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "passes on main (2026-12-07; its defect, replayed copies refused out of order, fixed since); outside CI's run for its length (about 4 minutes): scripts/test devtools/tests/explore.rs --run-ignored only"]
async fn kept_ordered_re_adds_refused_out_of_order() {
    kept("ordered_re_adds_refused_out_of_order").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "passes on main (2026-12-07; its defects, a re-add never recorded and a key waiting at an event already delivered, fixed since); outside CI's run for its length (about 8 minutes): scripts/test devtools/tests/explore.rs --run-ignored only"]
async fn kept_re_add_while_its_removal_waits_never_adds() {
    kept("re_add_while_its_removal_waits_never_adds").await;
}
