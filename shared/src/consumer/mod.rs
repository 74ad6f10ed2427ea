//! The consumer runtime: `POST /events/{topic}` from QStash → cap the body → verify the signature → route to the
//! topic's handler → decode the typed payloads → apply the delivery's events (one, or a batch of up to 1000,
//! decision record 0027) in one transaction, each in a savepoint (`batch.rs`, the steps of [`crate::once`]) → map the
//! outcome to the HTTP status QStash acts on. For a batch, the status is the message's (`batch.rs` has the
//! table) and the body lists each event's outcome ([`EventResult`]). What decides a write (outbox id, key, sequence, evidence, schema version) is
//! read from the signed envelope only ([`crate::contract`]).
//!
//! | outcome | status | QStash then |
//! |---|---|---|
//! | applied ([`Outcome::Processed`]) | 200 `{"status":"processed"}` (+ `events`, as every answer about known events) | done |
//! | already applied ([`Outcome::Duplicate`]) | 200 `{"status":"duplicate"}` | done |
//! | missing / bad signature ([`Outcome::Unauthorized`]) | 401 `{"error":…}` — nothing read or written; logged at DEBUG (a WARN summary at most once a minute), counted in `RejectedSignatures` | retries |
//! | body over `MAX_BODY_BYTES` ([`Outcome::TooLarge`]) | 413 — before verification | retries (a redeploy with a higher cap can fix it) |
//! | altered request ([`Outcome::Tampered`]): a header copy disagrees with the signed envelope, or a legacy delivery's `x-outbox-id` names another event | 401 — nothing written | retries (a genuine delivery never has this) |
//! | permanent ([`Outcome::Permanent`]): malformed envelope or payload, unknown topic or path, a named subscriber's copy at a consumer of another `CONSUMER_NAME`, unsupported schema version, failed validation, event older than one applied for its key, a legacy delivery that cannot be verified | 489 + `Upstash-NonRetryable-Error: true` | DLQ at once, failure callback |
//! | transient ([`Outcome::Transient`]): database down, handler said so; a legacy delivery whose event is not dispatched yet, or (ordered) whose predecessor this consumer has not applied and its key has not moved past (`Retry-After: 60`; a run of several events is dispatched at once, so "dispatched" alone does not mean its predecessor was delivered) | 503 (+ `Retry-After` when known) | retries with backoff |
//!
//! The handler functions ([`handle_event`], [`crate::callbacks::handle_callback`]) are plain async functions of
//! `(&State, lambda_http::Request)`: the Lambda binaries, the tests and a local HTTP adapter call them the same
//! way. Decision records 0020–0023 explain the choices.
//!
//! | file | what |
//! |---|---|
//! | `http.rs` | [`handle_event`]: the steps above |
//! | `outcome.rs` | [`Outcome`] → status and body (the handler, the batch and the delivery checks all produce one) |
//! | `batch.rs` | the events of one delivery in one transaction, a savepoint each; per-event [`EventResult`] → the message's [`Outcome`] |
//! | `delivery.rs` | what a delivery says about its event: the signed envelope, or a delivery in the previous format checked against its outbox row |
//! | `registry.rs` | the typed handlers: [`Registry`], [`TopicRoute`], [`Handler`] |
//!
//! The state and HTTP helpers both receivers share are in [`crate::receiver`].

mod batch;
mod delivery;
mod http;
mod outcome;
mod registry;
mod state;

// Shared by both receivers, so they live in `crate::receiver`; re-exported where they used to be.
pub use http::handle_event;
pub use outcome::Outcome;
pub use registry::{Event, EventMeta, Handler, HandlerError, Registry, TopicRoute};
pub use state::ConsumerState;
