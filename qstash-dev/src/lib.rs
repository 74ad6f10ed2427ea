//! A QStash-compatible development server.
//!
//! It implements the documented QStash HTTP API (publish, enqueue, batch, messages, DLQ, queues, flow
//! control, signing keys) on loopback and delivers messages like QStash does: signed with an HS256
//! `Upstash-Signature`, retried with QStash's backoff, through queues and flow-control keys, with callbacks,
//! failure callbacks and a DLQ. Tests drive it through [`DevServer`] and [`Handle`] (or the `/__dev/` HTTP
//! API), including deterministic fault injection ([`Faults`]).
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use qstash_dev::{Config, DevServer, WaitlistOrder};
//! let server = DevServer::start(Config {
//!     port: 0,
//!     time_scale: 0.001,
//!     waitlist_order: WaitlistOrder::Shuffled,
//!     seed: 7,
//!     ..Default::default()
//! })
//! .await?;
//! println!("QSTASH_URL={} QSTASH_TOKEN={}", server.url(), server.token());
//! let h = server.handle();
//! h.wait_idle(std::time::Duration::from_secs(10)).await?;
//! server.shutdown().await;
//! # Ok(()) }
//! ```
//!
//! # Layout
//!
//! The modules from the top down; each may use only the modules its entry names, so `server` wires modules that
//! do not know each other. The test `tests/layering.rs` checks this with the workspace's checker
//! (`outbox-layering`), which draws the arrows between files from the code: this list names exactly the modules
//! declared here, every arrow between modules is one the list allows, no file uses what its `mod.rs` (or
//! `lib.rs`) itself defines (a `mod.rs` declares its files and re-exports from them), and no files use each
//! other in a circle.
//!
//! - `server`: [`DevServer`] and [`Handle`]: binds the listener, runs the accept loop, spawns the timer task and
//!   the workers, and serves both routers behind the gate. Uses `api`, `inspect`, `deliver`, `state`, `config`,
//!   `types`.
//! - `api`: the QStash API (`/v2/...`, a file per section: publish, messages, DLQ, queues, flow control, keys)
//!   and the gate every route sits behind (Host/Origin check, token). Uses `state`, `view`, `core`, `options`,
//!   `host`, `duration`, `error`, `draw`.
//! - `inspect`: the `/__dev/` inspection and control API. Uses `state`, `view`, `config`, `types`, `error`.
//! - `deliver`: the delivery engine: the timer task, the worker pool with its HTTP client, one signed attempt.
//!   Uses `state`, `core`, `config`, `duration`, `sign`, `draw`.
//! - `state`: `Shared`, what the tasks and handlers share (the core behind its mutex, the job queue, the attempt
//!   log, faults, signing keys), and the per-connection `ConnCtx`. Uses `core`, `config`, `sign`, `types`,
//!   `draw`.
//! - `view`: QStash's JSON view of a message. Uses `core`.
//! - `core`: the message state machine (publish, dedup and ids, timers, queues, flow control, outcomes and
//!   retries, callbacks, DLQ, headers); no I/O, never awaits. Uses `options`, `expr`, `config`, `types`,
//!   `draw`.
//! - `options`: publish options from `Upstash-*` headers and query parameters. Uses `duration`, `expr`, `error`.
//! - `types`: the public views ([`Stats`], [`DeliveryAttempt`], [`DlqEntryInfo`]). Uses `config`.
//! - `config`: [`Config`] and [`Faults`]. Uses `sign`.
//! - `sign`, `expr`, `duration`, `host`, `error`, `draw`: signing, Retry-Delay expressions, durations, the Host
//!   check (0113), [`ApiError`] and the reproducible fault draws (0114). They use no other module.

mod api;
mod config;
mod core;
mod deliver;
mod draw;
mod duration;
mod error;
pub mod expr;
mod host;
mod inspect;
mod options;
mod server;
pub mod sign;
mod state;
mod types;
mod view;

pub use config::{
    Config, DEV_CURRENT_SIGNING_KEY, DEV_NEXT_SIGNING_KEY, DEV_TOKEN, Faults, NbfMode,
    NonRetryableMode, TimestampFormat, WaitlistOrder,
};
pub use duration::{parse_compound, parse_go_duration, parse_retry_after};
pub use error::ApiError;
pub use server::{DevServer, Handle, StartError};
pub use state::{SigningKeys, WaitIdleTimeout};
pub use types::{AttemptKind, DeliveryAttempt, DlqEntryInfo, Stats};
