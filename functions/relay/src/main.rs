//! The relay Lambda: run by an EventBridge schedule, drains the outbox to QStash until its deadline.
//! All logic lives in `outbox::relay`; this is wiring only.

use lambda_runtime::{Error, LambdaEvent, run, service_fn};
use outbox::relay::handler::{RelayState, handle};
use serde_json::Value;

#[tokio::main]
async fn main() -> Result<(), Error> {
    outbox::telemetry::init_from_env();
    // Built once per Lambda environment: config, secrets (one read), a lazily connecting pool, the QStash client.
    let state = RelayState::from_process_env()
        .await
        .inspect_err(|e| tracing::error!(error = %e, "relay failed to start"))?;
    let state = &state;
    run(service_fn(move |event: LambdaEvent<Value>| async move {
        handle(state, event).await
    }))
    .await
}
