//! The workers' environment (the functions' variables, laptop-scale relay settings), and the longest drain it
//! allows.

use std::time::Duration;

use anyhow::Context;

use super::supervisor::{Spawner, default_env};

/// The workers' environment: the functions' variables for database `url`, the dev server, the default consumer
/// and the callback receiver, the dead heads of the topics `skip_dead_heads` skipped, and laptop-scale relay
/// settings (unless the caller's environment sets them).
pub(crate) fn worker_env(
    url: &str,
    dev: &qstash_dev::DevServer,
    consumer_url: &str,
    callback_url: &str,
    skip_dead_heads: &[&str],
) -> Vec<(String, String)> {
    let keys = dev.signing_keys();
    let mut env: Vec<(String, String)> = vec![
        ("DATABASE_URL".into(), url.to_owned()),
        ("QSTASH_URL".into(), dev.url()),
        ("QSTASH_TOKEN".into(), dev.token().to_owned()),
        ("QSTASH_CURRENT_SIGNING_KEY".into(), keys.current.clone()),
        ("QSTASH_NEXT_SIGNING_KEY".into(), keys.next.clone()),
        // The dev server's public keys and token: the workers (the functions' own setup) refuse them without it.
        ("OUTBOX_ALLOW_DEV_KEYS".into(), "true".into()),
        ("CONSUMER_URL".into(), consumer_url.to_owned()),
        ("CALLBACK_URL".into(), callback_url.to_owned()),
        ("CONSUMER_NAME".into(), "soak".into()),
        (
            "RELAY_SKIP_DEAD_HEAD_TOPICS".into(),
            skip_dead_heads.join(","),
        ),
    ];
    // Laptop-scale relay settings (like the local stack's), unless the environment sets them.
    for (k, v) in [
        ("RELAY_LEASE_SECS", "5"),
        ("RELAY_POLL_INTERVAL_MS", "100"),
        ("RELAY_DEADLINE_MARGIN_MS", "500"),
        ("RELAY_CONCURRENCY", "2"),
        // Short, so that a delivery callback lost with a killed callback receiver costs seconds, not the
        // production default (QStash's retry horizon + 1 h): the relay republishes the head, the consumer dedupes.
        ("RELAY_EVIDENCE_TIMEOUT_SECS", "20"),
        // Short for the same reason: an event whose failure callback never arrived (the callback receiver was
        // killed through all of the callback's retries) is looked up at QStash after this, not after the
        // production horizon (hours), so it ends as a dead letter within the drain. At least
        // RELAY_APPLIED_GRACE_SECS (30), so the applied sweep comes first.
        ("RELAY_RECONCILE_AFTER_SECS", "30"),
        ("RELAY_BACKOFF_BASE_SECS", "0.5"),
        ("RELAY_BACKOFF_CAP_SECS", "10"),
        ("RELAY_OUTAGE_PROBE_BASE_MS", "200"),
        ("RELAY_OUTAGE_PROBE_CAP_SECS", "2"),
        ("QSTASH_RETRIES", "3"),
        ("RUST_LOG", "warn"),
    ] {
        default_env(&mut env, k, v);
    }
    env
}

/// The longest the drain can legitimately take once the chaos is off, from the workers' settings: a message's
/// retries then its failure callback's (each QStash's retry delays at the dev server's scale), or, when that
/// callback never reached a receiver, the reconciler's horizon plus one relay invocation and its accounting
/// pass; and a minute for the rest (backoff, the applied sweep, the last delivery). The soak waits at least this
/// long, whatever `--drain-timeout-secs` says.
pub(crate) fn drain_bound(spawner: &Spawner, time_scale: f64) -> anyhow::Result<Duration> {
    let var = |name: &str| -> anyhow::Result<u64> {
        let v = spawner
            .env
            .iter()
            .find(|(k, _)| k == name)
            .with_context(|| format!("{name} is not set for the workers"))?;
        v.1.parse()
            .with_context(|| format!("{name}={:?} is not a whole number", v.1))
    };
    let retries = u32::try_from(var("QSTASH_RETRIES")?)?;
    let qstash = outbox::config::qstash_retry_horizon(retries).mul_f64(2.0 * time_scale);
    let reconciler =
        Duration::from_secs(var("RELAY_RECONCILE_AFTER_SECS")? + spawner.relay_invocation_secs)
            + outbox::internals::handler::ACCOUNTING_BUDGET;
    Ok(qstash.max(reconciler) + Duration::from_secs(60))
}
