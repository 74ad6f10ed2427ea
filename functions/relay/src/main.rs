//! The relay Lambda: run by an EventBridge schedule, drains the outbox to QStash until its deadline.
//! All logic lives in `outbox::relay`; this binary only wires configuration, clients and the handler.

use lambda_runtime::{LambdaEvent, service_fn};
use outbox::relay::handler::{RelayState, handle};
use serde_json::Value;

#[tokio::main]
async fn main() -> Result<(), lambda_runtime::Error> {
    outbox::telemetry::init_from_env();
    // Secrets, pool (lazy: no connection yet) and the QStash client are built once per cold start.
    let state = match RelayState::from_process_env().await {
        Ok(s) => s,
        Err(e) => {
            tracing::error!(error = %e, "relay cannot start");
            return Err(e.into());
        }
    };
    let state = &state;
    lambda_runtime::run(service_fn(move |event: LambdaEvent<Value>| async move {
        handle(state, event).await
    }))
    .await
}
