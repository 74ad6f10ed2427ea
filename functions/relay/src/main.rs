//! The relay Lambda: run by an EventBridge schedule, drains the outbox to QStash until its deadline.
//! All logic lives in `outbox::relay`; this is wiring only.

// The release profile (what ships) computes the layout of `main`'s future with MIR inlining, which nests the relay's
// drain futures deeper than the default query depth allows ("queries overflow the depth limit!", release only:
// scripts/build-arm64).
#![recursion_limit = "256"]

// lambda_runtime turns a handler panic into an error response only when unwinding; cargo-lambda builds with
// panic = "abort" unless the root manifest's release profile says otherwise. Such a build must not ship.
#[cfg(not(panic = "unwind"))]
compile_error!(
    "relay must be built with panic = \"unwind\" (the root Cargo.toml's [profile.release])"
);

use lambda_runtime::{Error, LambdaEvent, run, service_fn};
use outbox::relay::{RelayState, handle};
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
