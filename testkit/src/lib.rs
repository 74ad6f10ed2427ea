//! The workspace's one test kit: everything the tests of the library, the CLI, the dev server and the whole
//! system share, defined once.
//!
//! * [`stack`]: the local pipeline — the dev server in process, the relay through its Lambda handler, the
//!   consumer and callback handlers served through `outbox::local` — that `outbox-dev dev` and the whole-system
//!   tests run;
//! * [`receiving`]: QStash-like tokens signed independently of `outbox::internals::receiver`, function-URL requests,
//!   the envelope [`receiving::Delivery`] builder, receiver and consumer states on a fixed clock;
//! * [`sink`]: a stand-in consumer and callback endpoint that records what the dev server delivers;
//! * [`relaying`]: a relay wired to the dev server and a sink, with the relay tests' settings;
//! * [`db`]: URLs of `#[sqlx::test]` databases and hand-built outbox states;
//! * [`given_up`]: which events may end as unexpected dead letters, by the dev server's own DLQ;
//! * [`moto`]: a local AWS Secrets Manager;
//! * [`otlp`]: an OTLP/HTTP trace receiver decoding the real protocol, and a collector that is slow, refusing or
//!   down;
//! * [`pg_local`]: a throwaway Postgres cluster for when none is running (`outbox-dev dev`);
//! * [`ports`]: ports bound once — no "find a free port, then bind it" anywhere;
//! * [`sam`]: `template.yaml` as CloudFormation, its alarms and dashboard; [`previous_relay`]: what the relay of
//!   the previous wire format left behind;
//! * [`MIGRATOR`]: the library's and the example application's migrations, for tests that need both;
//! * small helpers: [`repo_root`], [`percentile`], [`median`], [`text`], [`test_path`], and
//!   [`skip_or_fail_under_ci`] for a test whose external tool is missing.
//!
//! A dev-dependency only of the production crates (`outbox`, the functions, `outbox-cli`, `qstash-dev`): it is
//! never part of what ships (decision record 0010).

// The receivers' handler futures nest deeply (respond → process → the batch's transaction → each event's
// handler), and serving them through `outbox::local` adds more: computing their layout needs more than the default
// query depth.
#![recursion_limit = "256"]

use std::sync::LazyLock;

use sqlx::migrate::Migrator;

pub mod db;
pub mod dev_api;
pub mod given_up;
pub mod lambda_event;
pub mod moto;
pub mod otlp;
pub mod pg_local;
pub mod pgbouncer;
pub mod ports;
pub mod previous_relay;
pub mod receiving;
pub mod relaying;
mod repo;
pub mod sam;
pub mod sink;
pub mod stack;

pub use repo::repo_root;

/// Both migration sets, `outbox::MIGRATOR` and `orders_example::MIGRATOR`, as one migrator: for tests whose
/// database needs the example application's tables too (`#[sqlx::test(migrator = "outbox_testkit::MIGRATOR")]`).
/// What a database migrated by the two in turn ends up with.
pub static MIGRATOR: LazyLock<Migrator> = LazyLock::new(|| {
    let mut m = Migrator::with_migrations(
        outbox::MIGRATOR
            .iter()
            .chain(orders_example::MIGRATOR.iter())
            .cloned()
            .collect(),
    );
    m.set_ignore_missing(true);
    m
});

/// Percentile by nearest rank (`p` in 0..=1) on a sorted copy of `v`; 0 for an empty slice.
pub fn percentile(v: &[f64], p: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    let i = ((s.len() - 1) as f64 * p).round() as usize;
    s[i.min(s.len() - 1)]
}

/// The median of `v` ([`percentile`] 0.5).
pub fn median(v: &[f64]) -> f64 {
    percentile(v, 0.5)
}

/// The name libtest knows a test function by, to run it alone in a child process (`current_exe()` with the name
/// and `--exact`): `name` under the module path of the caller (`module_path!()`) without the crate's name. A
/// test file compiled as a module of a package's one test binary (`tests/it.rs`) names its tests `file::test`.
pub fn test_path(module_path: &str, name: &str) -> String {
    match module_path.split_once("::") {
        Some((_, module)) => format!("{module}::{name}"),
        None => name.to_owned(),
    }
}

/// Output a command wrote, as text.
pub fn text(buf: &[u8]) -> String {
    String::from_utf8_lossy(buf).into_owned()
}

/// Whether the `CI` variable (set to `true` by CI services) says this is a CI run: set, and not empty, `0` or
/// `false`.
pub fn is_ci(value: Option<&str>) -> bool {
    value.is_some_and(|v| {
        let v = v.trim();
        !v.is_empty() && v != "0" && !v.eq_ignore_ascii_case("false")
    })
}

/// A test cannot run because an external tool (`tool`) is missing: under CI ([`is_ci`] of `CI`) that fails the
/// test (panics) — a CI run must never pass without running it; elsewhere it prints a loud SKIPPED line naming
/// how to install the tool (`install`) and what went untested (`untested`), and the caller returns.
pub fn skip_or_fail_under_ci(tool: &str, install: &str, untested: &str) {
    let message = format!("{tool} is not installed ({install}); {untested}");
    if is_ci(std::env::var("CI").ok().as_deref()) {
        panic!("{message}. CI is set: a missing test tool fails the run instead of skipping");
    }
    eprintln!("\n\n!!!!! SKIPPED: {message} !!!!!\n\n");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ci_is_any_value_but_empty_zero_or_false() {
        assert!(is_ci(Some("true")) && is_ci(Some("1")) && is_ci(Some("TRUE")));
        assert!(!is_ci(None) && !is_ci(Some("")) && !is_ci(Some("0")) && !is_ci(Some("false")));
    }

    #[test]
    fn percentile_is_nearest_rank_on_a_sorted_copy() {
        assert_eq!(percentile(&[], 0.5), 0.0);
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(percentile(&[5.0, 1.0, 4.0, 2.0, 3.0], 0.99), 5.0);
        assert_eq!(percentile(&[5.0, 1.0, 4.0, 2.0, 3.0], 0.0), 1.0);
        assert!(repo_root().join("Cargo.lock").exists());
    }

    #[test]
    fn test_path_drops_the_crate_name() {
        assert_eq!(test_path("it::relay", "a_test"), "relay::a_test");
        assert_eq!(test_path("it::a::b", "t"), "a::b::t");
        assert_eq!(test_path("schema", "t"), "t");
    }
}
