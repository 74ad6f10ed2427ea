//! The consumer Lambda (function URL): `POST /events/{topic}` from QStash → `outbox::consumer::handle_event`:
//! verify the signature, read the delivery's events from the signed envelope, then apply them in one transaction
//! (the dedupe rows first, each event's sequence check and the topic's handler in a savepoint of its own) and
//! answer the status QStash acts on. All logic lives in `outbox::consumer`; this is wiring only.

// lambda_runtime turns a handler panic into an error response only when unwinding; cargo-lambda builds with
// panic = "abort" unless the root manifest's release profile says otherwise. Such a build must not ship.
#[cfg(not(panic = "unwind"))]
compile_error!(
    "consumer must be built with panic = \"unwind\" (the root Cargo.toml's [profile.release])"
);

use lambda_http::{Error, Request, run, service_fn};
use outbox::consumer::{ConsumerState, Registry, handle_event};

// -------------------------------------------------------------------------------------------------------------
// YOUR HANDLERS GO HERE. This is the one place where the deployed consumer learns its topics: replace the
// example application's registry with yours (a `Registry` routing each topic to a `Handler`: examples/minimal
// shows one), and `orders-example` with your crate in this package's Cargo.toml. Your tables are your own
// migrations, run on the same database next to `outbox::MIGRATOR` (decision record 0010).
// -------------------------------------------------------------------------------------------------------------
fn registry() -> Registry {
    orders_example::registry()
}

#[tokio::main]
async fn main() -> Result<(), Error> {
    outbox::telemetry::init_from_env();
    // Built once per Lambda environment: config, secrets (one read), a lazily connecting pool, the handlers.
    let state = ConsumerState::from_env(registry())
        .await
        .inspect_err(|e| tracing::error!(error = %e, "consumer failed to start"))?;
    let state = &state;
    run(service_fn(move |req: Request| async move {
        Ok::<_, Error>(handle_event(state, req).await)
    }))
    .await
}
