//! The stack's start ([`LocalStack::start`]): migrations applied unless already recorded, the dev server, the
//! consumer, the callback receiver and each named subscriber on ports of their own, the relay running simulated
//! invocations through its Lambda handler.

use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use anyhow::Context;
use outbox::ReceiverState;
use outbox::config::{ConsumerConfig, QstashConfig, Vars};
use outbox::consumer::ConsumerState;
use outbox::db::{Db, DbConfig, Statements};
use outbox::internals::RelaySteps;
use outbox::internals::qstash::QstashClient;
use outbox::internals::receiver::{KeyRing, SigningKeys};
use outbox::internals::subscriber_keys::{OwnKey, SubscriberKeys};
use outbox::relay::Relay;
use outbox::relay::{RelayState, handle};
use qstash_dev::DevServer;
use secrecy::SecretString;
use sqlx::PgPool;
use sqlx::migrate::Migrator;
use tokio::sync::{Mutex, watch};

use super::listeners::{listen, serve_callbacks, serve_consumer};
use super::options::StackOptions;
use super::recording::Recorder;
use super::running::{LocalStack, LocalSubscriber};

/// The local pipeline's key for subscriber `name` ([`StackOptions::subscriber_keys`]).
fn local_subscriber_key(nonce: &str, name: &str) -> String {
    format!("local-{name}-{nonce}")
}

/// Whether every migration of `migrator` is recorded as applied in `table`. Unnamed statements in one
/// transaction: behind PgBouncer in transaction mode, sqlx's unnamed statement (parse, then bind in a second
/// round trip) only stays on one server connection inside a transaction.
async fn all_applied(pool: &PgPool, table: &str, migrator: &Migrator) -> anyhow::Result<bool> {
    let mut tx = pool
        .begin()
        .await
        .context("reaching Postgres (is it running and DATABASE_URL right?)")?;
    let exists: Option<String> = Statements::Unnamed
        .query_scalar("SELECT to_regclass($1)::text")
        .bind(table)
        .fetch_one(&mut *tx)
        .await?;
    if exists.is_none() {
        return Ok(false);
    }
    let versions: Vec<i64> = migrator.iter().map(|m| m.version).collect();
    let applied: i64 = Statements::Unnamed
        .query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT count(DISTINCT version) FROM {table} WHERE success AND version = ANY($1)"
        )))
        .bind(&versions)
        .fetch_one(&mut *tx)
        .await?;
    tx.commit().await?;
    Ok(applied == versions.len() as i64)
}

fn pool_for(url: &str, name: &str, max: u32, async_commit: bool) -> anyhow::Result<PgPool> {
    let mut cfg = DbConfig::defaults(name);
    cfg.max_connections = max;
    cfg.async_commit = async_commit;
    Ok(cfg.pool(&SecretString::from(url.to_owned()))?)
}

impl LocalStack {
    /// Applies migrations and starts every component.
    pub async fn start(opts: StackOptions) -> anyhow::Result<LocalStack> {
        outbox::install_crypto_provider();
        let pool = pool_for(&opts.database_url, "outbox-local", 8, false)?;
        for migrator in &opts.migrators {
            // The library's own migrations go into the process's outbox schema (OUTBOX_SCHEMA); the
            // application's run where its connection puts them.
            let library = std::ptr::eq(*migrator, &outbox::MIGRATOR);
            let table = if library {
                outbox::schema::current().table("_sqlx_migrations")
            } else {
                "_sqlx_migrations".to_owned()
            };
            // Nothing to apply, nothing to run: the migrator takes a session-level advisory lock and prepares
            // named statements, neither of which works through PgBouncer in transaction mode (a database the
            // stack reaches through one was migrated directly beforehand).
            if all_applied(&pool, &table, migrator).await? {
                continue;
            }
            let applied = if library {
                outbox::migrate(&pool, outbox::schema::current()).await
            } else {
                migrator.run(&pool).await
            };
            applied
                .context("applying migrations (is Postgres reachable and DATABASE_URL right?)")?;
        }
        let dev = crate::ports::on_port_or_any(opts.dev.port, |port| {
            let cfg = qstash_dev::Config {
                port,
                ..opts.dev.clone()
            };
            async move {
                DevServer::start(cfg)
                    .await
                    .context("starting the QStash dev server")
            }
        })
        .await?;
        let keys = dev.signing_keys();
        let (shutdown, _) = watch::channel(false);

        let (consumer_listener, consumer_url) = listen().await?;
        let (callback_listener, callback_url) = listen().await?;
        let base_config = ConsumerConfig::from_vars(&Vars::new(&std::collections::HashMap::<
            String,
            String,
        >::new()))?;
        let receiver_config = |public: &str| ConsumerConfig {
            name: opts.consumer_name.clone(),
            public_base_url: Some(public.to_owned()),
            skip_topics: opts.relay.skip_topics.clone(),
            ..base_config.clone()
        };
        let ring = || {
            KeyRing::fixed(SigningKeys::new(
                keys.current.clone(),
                Some(keys.next.clone()),
            ))
        };
        let consumer = Arc::new(ConsumerState::new(
            ReceiverState::new(
                receiver_config(&consumer_url),
                Db::new(
                    pool_for(&opts.database_url, "outbox-local-consumer", 16, false)?,
                    opts.statements,
                ),
                ring(),
            )
            .with_metrics(opts.consumer_metrics),
            opts.registry,
        ));
        // Each named subscriber's key: random per stack; the relay and the callback receiver hold them all.
        let nonce = format!("{:032x}", rand::random::<u128>());
        let subscriber_keys = if opts.subscriber_keys {
            opts.subscribers
                .iter()
                .fold(SubscriberKeys::none(), |keys, s| {
                    keys.with(&s.name, &[local_subscriber_key(&nonce, &s.name).as_str()])
                })
        } else {
            SubscriberKeys::none()
        };
        let callbacks = Arc::new(
            ReceiverState::new(
                receiver_config(&callback_url),
                Db::new(
                    pool_for(&opts.database_url, "outbox-local-callbacks", 8, true)?,
                    opts.statements,
                ),
                ring(),
            )
            .with_metrics(opts.consumer_metrics)
            .with_subscriber_keys(subscriber_keys.clone()),
        );
        let recorder: Option<Recorder> = opts.record_requests.then(Default::default);
        let callbacks_down = Arc::new(AtomicBool::new(false));
        let mut servers = vec![
            serve_consumer(
                consumer_listener,
                consumer,
                recorder.clone(),
                None,
                shutdown.subscribe(),
            ),
            serve_callbacks(
                callback_listener,
                callbacks,
                recorder.clone(),
                callbacks_down.clone(),
                shutdown.subscribe(),
            ),
        ];

        let mut subscribers = Vec::with_capacity(opts.subscribers.len());
        let admin = Db::new(pool.clone(), opts.statements);
        for sub in opts.subscribers {
            let (listener, url) = listen().await?;
            let mut receiver = ReceiverState::new(
                ConsumerConfig {
                    name: sub.name.clone(),
                    ..receiver_config(&url)
                },
                Db::new(
                    pool_for(&opts.database_url, "outbox-local-subscriber", 4, false)?,
                    opts.statements,
                ),
                ring(),
            )
            .with_metrics(opts.consumer_metrics);
            if opts.subscriber_keys {
                let key = local_subscriber_key(&nonce, &sub.name);
                receiver = receiver.with_own_key(OwnKey::new(SecretString::from(key), None)?);
            }
            let state = Arc::new(ConsumerState::new(receiver, sub.registry));
            let down = Arc::new(AtomicBool::new(false));
            servers.push(serve_consumer(
                listener,
                state,
                recorder.clone(),
                Some(down.clone()),
                shutdown.subscribe(),
            ));
            for topic in &sub.topics {
                outbox::subscribers::ensure(&admin, topic, &sub.name, &url)
                    .await
                    .with_context(|| format!("making {} a subscriber of {topic}", sub.name))?;
            }
            subscribers.push(LocalSubscriber {
                name: sub.name,
                url,
                down,
            });
        }

        let qstash = QstashConfig {
            base_url: dev.url(),
            retries: opts.qstash_retries,
            publish_timeout: Duration::from_secs(3),
            batch_size: opts.qstash_batch_size,
            delivery_timeout: None,
            flow_parallelism: 10,
            replay_parallelism: opts.replay_parallelism,
            flow_rate: None,
            flow_period: Duration::from_secs(1),
            consumer_url: consumer_url.clone(),
            callback_url: callback_url.clone(),
        };
        let client = QstashClient::new(
            &dev.url(),
            SecretString::from(dev.token().to_owned()),
            qstash.publish_timeout,
        )?;
        let relay_pool = pool_for(
            &opts.database_url,
            "outbox-local-relay",
            opts.relay.concurrency + 1,
            true,
        )?;
        let relay = Relay::new(
            Db::new(relay_pool, opts.statements),
            client,
            opts.relay,
            qstash,
        )
        .with_subscriber_keys(subscriber_keys.clone());
        let relay_stop = relay.stop_handle();
        let relay_state =
            Arc::new(RelayState::new(relay, "relay").with_metrics(opts.consumer_metrics));
        let last_summary = Arc::new(std::sync::Mutex::new(None));
        let relay_task = {
            let state = relay_state.clone();
            let stop = relay_stop.clone();
            let last = last_summary.clone();
            let invocation = opts.invocation;
            tokio::spawn(async move {
                let mut n = 0u64;
                while !stop.is_stopped() {
                    n += 1;
                    let event = crate::lambda_event::scheduled(n, "outbox.local", invocation);
                    match handle(&state, event).await {
                        Ok(s) => {
                            // A QStash outage whose next probe does not fit in the invocation ends it at
                            // once: pause like the schedule would.
                            let outage = s.drain.stopped == "outage";
                            if let Ok(mut l) = last.lock() {
                                *l = Some(s);
                            }
                            if outage {
                                let pause = state.relay.config().outage_probe_base;
                                tokio::time::sleep(pause).await;
                            }
                        }
                        Err(e) => {
                            tracing::error!(error = %e, "relay invocation failed; retrying in 1 s");
                            tokio::time::sleep(Duration::from_secs(1)).await;
                        }
                    }
                }
            })
        };
        Ok(LocalStack {
            pool,
            dev,
            consumer_url,
            callback_url,
            relay_state,
            relay_stop,
            relay_task: Mutex::new(Some(relay_task)),
            last_summary,
            shutdown,
            servers,
            recorded: recorder,
            callbacks_down,
            subscribers,
        })
    }
}
