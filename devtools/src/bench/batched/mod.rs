//! Scenario "Batched deliveries": the same pipelines with N = 1 and with larger N events per QStash message, side by
//! side in one run. N is passed to the relay exactly as a deployment sets it: the `RELAY_DELIVERY_BATCH` variable
//! of the relay process (or of the relay state built from the environment in this process).
//!
//! For each N, alternating within each round:
//! - ordered, end to end: events spread over many keys (1,000 in the full report), relay process → delivering dev
//!   server → the real consumer, which applies them and records the delivery evidence in its transaction;
//! - one hot key: a backlog of pending events (10,000 in the full report) on a single ordered key, drained the
//!   same way: the drain time;
//! - unordered, end to end: relay process → delivering dev server → consumer applied;
//! - commit → applied latency at a low steady rate (20 events/s, unordered), with the relay listening for the
//!   producer's `NOTIFY` hint ([`super::steady`]).
//!
//! Besides rates, every throughput point counts what batching saves: QStash messages per event (the dev server's
//! `accepted` counter) and consumer invocations per event (HTTP requests the consumer received, retries included).

mod chart;
mod cli;
mod markdown;
mod measure;
mod plan;
mod targets;

pub use chart::{SVG, plot};
pub use cli::{BatchedArgs, run_cli};
pub use markdown::markdown;
pub use measure::run;
pub use plan::{BatchedPlan, DELIVERY_BATCH_VAR, default_ns};
pub use targets::{print_targets, target_figure, targets};
