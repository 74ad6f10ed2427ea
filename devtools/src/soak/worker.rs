//! The soak's worker processes (`outbox-dev soak-worker …`, hidden): each runs the same library code a Lambda
//! runs, configured from the environment exactly like the Lambda, so a SIGKILL kills what production would lose.
//!
//! * `relay`: the `outbox relay` loop (simulated invocations through the relay Lambda's handler);
//! * `consumer --port P`: the consumer handler with the soak's registry ([`super::registry`]; the explorer's
//!   topics and subscriber when `SOAK_TOPICS` is set), served through [`outbox::local::serve`] (the function-URL
//!   event path);
//! * `callback --port P`: the failure/delivery callback handler, likewise.

use std::sync::Arc;

use anyhow::Context;
use clap::Subcommand;
use outbox::consumer::{ConsumerState, handle_event};
use outbox::internals::callbacks::handle_callback;
use outbox::internals::receiver::{Receiver, ReceiverState};
use outbox_cli::relay_cmd::{self, RelayArgs};

/// One worker process of the soak.
#[derive(Subcommand, Debug)]
pub enum SoakWorker {
    /// The relay loop of `outbox relay` (configuration from the environment).
    Relay(RelayArgs),
    /// The consumer handler (the soak's topics) on 127.0.0.1:PORT.
    Consumer {
        #[arg(long)]
        port: u16,
    },
    /// The failure and delivery callback handler on 127.0.0.1:PORT.
    Callback {
        #[arg(long)]
        port: u16,
    },
}

/// Runs one worker until it is killed.
pub async fn run(worker: SoakWorker) -> anyhow::Result<()> {
    match worker {
        SoakWorker::Relay(args) => relay_cmd::run(args).await,
        SoakWorker::Consumer { port } => {
            outbox::telemetry::init_from_env();
            // No per-request metric line: thousands of them would only fill the worker's log.
            let receiver = ReceiverState::from_env(Receiver::Consumer)
                .await
                .context("consumer configuration")?
                .with_metrics(false);
            let state = Arc::new(ConsumerState::new(receiver, consumer_registry()));
            let listener = bind(port).await?;
            outbox::local::serve(
                listener,
                move |req| {
                    let state = state.clone();
                    async move { handle_event(&state, req).await }
                },
                std::future::pending(),
            )
            .await
            .context("serving the consumer")
        }
        SoakWorker::Callback { port } => {
            outbox::telemetry::init_from_env();
            let state = Arc::new(
                ReceiverState::from_env(Receiver::Callbacks)
                    .await
                    .context("callback configuration")?
                    .with_metrics(false),
            );
            let listener = bind(port).await?;
            outbox::local::serve(
                listener,
                move |req| {
                    let state = state.clone();
                    async move { handle_callback(&state, req).await }
                },
                std::future::pending(),
            )
            .await
            .context("serving the callbacks")
        }
    }
}

/// The consumer's topics and handler: the soak's, or, when the explorer set `SOAK_TOPICS` (comma-separated), those
/// topics with a handler that records its applications as subscriber `SOAK_SUBSCRIBER`'s and reads `soak_control`.
fn consumer_registry() -> outbox::consumer::Registry {
    match std::env::var("SOAK_TOPICS") {
        Ok(topics) => {
            let apply = super::Apply {
                subscriber: std::env::var("SOAK_SUBSCRIBER").unwrap_or_default(),
                controlled: true,
            };
            super::app::registry_for(topics.split(',').filter(|t| !t.is_empty()), &apply)
        }
        Err(_) => super::registry(),
    }
}

/// Listens on the receiver's port, which the supervisor holds for the whole run (`SO_REUSEPORT` beside its socket,
/// `outbox_testkit::ports::ReservedPort`), retrying for a few seconds: the killed predecessor's socket may linger.
async fn bind(port: u16) -> anyhow::Result<tokio::net::TcpListener> {
    let mut tries = 0;
    loop {
        match outbox_testkit::ports::ReservedPort::listen(port) {
            Ok(l) => return Ok(l),
            Err(e) if tries < 50 => {
                tracing::warn!(error = %e, port, "port busy; retrying");
                tries += 1;
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            }
            Err(e) => return Err(e).with_context(|| format!("binding 127.0.0.1:{port}")),
        }
    }
}
