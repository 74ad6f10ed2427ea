//! The callback Lambda (function URL): QStash failure callbacks (`POST /failure` → dead letter) and delivery
//! callbacks of ordered topics (`POST /delivered` → delivery evidence). All logic lives in `outbox::callbacks`;
//! this is wiring only.

// lambda_runtime turns a handler panic into an error response only when unwinding; cargo-lambda builds with
// panic = "abort" unless the root manifest's release profile says otherwise. Such a build must not ship.
#[cfg(not(panic = "unwind"))]
compile_error!(
    "failure-callback must be built with panic = \"unwind\" (the root Cargo.toml's [profile.release])"
);

use lambda_http::{Error, Request, run, service_fn};
use outbox::handle_callback;
use outbox::{Receiver, ReceiverState};

#[tokio::main]
async fn main() -> Result<(), Error> {
    outbox::telemetry::init_from_env();
    // Built once per Lambda environment: config, secrets (one read), a lazily connecting pool.
    let state = ReceiverState::from_env(Receiver::Callbacks)
        .await
        .inspect_err(|e| tracing::error!(error = %e, "failure-callback failed to start"))?;
    let state = &state;
    run(service_fn(move |req: Request| async move {
        Ok::<_, Error>(handle_callback(state, req).await)
    }))
    .await
}
