//! What every part of `bench fanout` runs on: its topics and subscribers, the consumers (the default subscriber
//! first, then the named ones), the tables emptied between runs, and a relay in this process.

use std::time::Duration;

use outbox::Topic;
use outbox::db::{Db, Statements};
use outbox::subscribers::{self, Start};

use crate::bench::endpoints;
use crate::bench::support::{DevServerProcess, Knobs, ScratchDb, in_process_relay};

pub(super) const ORDERED: Topic = Topic::ordered("bench_ordered");
pub(super) const UNORDERED: Topic = Topic::unordered("bench");
/// The live subscriber's topic in the replay scenario (the bench consumers handle `bench`).
pub(super) const LIVE: Topic = UNORDERED;
/// The named subscribers (the default one is `consumer`).
pub(super) const NAMED: [&str; 2] = ["billing", "search"];
pub(super) const REPLAYED: &str = "ledger";
/// Events per QStash message.
pub(super) const DELIVERY_BATCH: u32 = 50;

/// The consumers: the default one first, then the named ones.
pub(super) struct Rig {
    pub(super) callback_url: String,
    pub(super) consumers: Vec<(String, String)>,
    /// Takes the first named subscriber ([`NAMED`]`[0]`, "B") down: it answers 503 while true.
    pub(super) b_down: std::sync::Arc<std::sync::atomic::AtomicBool>,
    pub(super) stop: tokio::sync::watch::Sender<bool>,
}

impl Rig {
    /// The relay's variables for these consumers: the default one's URL, the callback receiver, consumer
    /// evidence, [`DELIVERY_BATCH`] events per message.
    pub(super) fn relay_env(&self) -> Vec<(&'static str, String)> {
        vec![
            ("CONSUMER_URL", self.consumers[0].1.clone()),
            ("CALLBACK_URL", self.callback_url.clone()),
            ("QSTASH_RETRIES", "3".into()),
            ("RELAY_ORDERED_EVIDENCE", "consumer".into()),
            ("RELAY_DELIVERY_BATCH", DELIVERY_BATCH.to_string()),
        ]
    }
}

pub(super) async fn rig(db: &ScratchDb) -> anyhow::Result<Rig> {
    let (stop, rx) = tokio::sync::watch::channel(false);
    let defaults = endpoints::ordered_endpoints(&db.url).await?;
    let (callback_url, stop_default) = (defaults.callback_url, defaults.stop);
    let mut consumers = vec![("consumer".to_owned(), defaults.consumer_url)];
    let b_down = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    for (i, name) in NAMED.iter().chain([&REPLAYED]).enumerate() {
        let (url, _) = if i == 0 {
            endpoints::switchable_consumer_endpoint(&db.url, name, rx.clone(), b_down.clone())
                .await?
        } else {
            endpoints::consumer_endpoint(&db.url, name, rx.clone()).await?
        };
        consumers.push(((*name).to_owned(), url));
    }
    // One switch for all.
    let mut rx2 = rx.clone();
    tokio::spawn(async move {
        let _ = rx2.wait_for(|s| *s).await;
        let _ = stop_default.send(true);
    });
    Ok(Rig {
        callback_url,
        consumers,
        b_down,
        stop,
    })
}

/// Empties every table the drains use, and makes the first `subs - 1` named subscribers live for both topics.
pub(super) async fn reset(db: &ScratchDb, rig: &Rig, subs: usize) -> anyhow::Result<()> {
    db.empty_pipeline_tables().await?;
    let h = Db::new(db.pool.clone(), Statements::Prepared);
    for (name, url) in rig.consumers.iter().skip(1).take(subs - 1) {
        for topic in [ORDERED.name(), UNORDERED.name()] {
            subscribers::add(
                &h,
                topic,
                name,
                Some(url),
                Start::Now,
                Duration::from_secs(30),
            )
            .await?;
        }
    }
    Ok(())
}

/// A relay in this process (the rig's settings, dedupe-row outcomes for unordered events, and `extra`), draining
/// until its stop handle is used: the handle and the drain's task.
pub(super) async fn running_relay(
    db: &ScratchDb,
    dev: &DevServerProcess,
    rig: &Rig,
    knobs: Knobs,
    extra: &[(&'static str, String)],
) -> anyhow::Result<(
    outbox::relay::StopHandle,
    tokio::task::JoinHandle<Result<outbox::relay::DrainSummary, outbox::relay::RelayError>>,
)> {
    let mut env = rig.relay_env();
    env.push(("RELAY_UNORDERED_EVIDENCE", "dedupe".into()));
    env.extend(extra.iter().cloned());
    let relay = std::sync::Arc::new(in_process_relay(&db.url, &dev.url, knobs, &env).await?);
    let stop = relay.stop_handle();
    let draining = tokio::spawn(async move {
        relay
            .drain_with(
                tokio::time::Instant::now().into_std() + Duration::from_secs(3_600),
                outbox::relay::Until::Deadline,
            )
            .await
    });
    Ok((stop, draining))
}
