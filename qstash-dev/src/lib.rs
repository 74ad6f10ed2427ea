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

mod api;
mod config;
mod core;
mod deliver;
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
