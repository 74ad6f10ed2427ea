//! The consumer Lambda (function URL): `POST /events/{topic}` from QStash → verify → the example domain's
//! handler inside `handle_once`. All logic lives in `outbox::consumer`; this is wiring only.

use lambda_http::{Error, Request, run, service_fn};
use outbox::consumer::{ConsumerState, handle_event};

#[tokio::main]
async fn main() -> Result<(), Error> {
    outbox::telemetry::init_from_env();
    // Built once per Lambda environment: config, secrets (one read), a lazily connecting pool, the handlers.
    let state = ConsumerState::from_env(outbox::example::registry())
        .await
        .inspect_err(|e| tracing::error!(error = %e, "consumer failed to start"))?;
    let state = &state;
    run(service_fn(move |req: Request| async move {
        Ok::<_, Error>(handle_event(state, req).await)
    }))
    .await
}
