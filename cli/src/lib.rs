//! The operator CLI's library: the commands operators run against a real database (migrate, status, dead
//! letters, prune, relay, tenants, the web console). The binary `outbox` only parses arguments; the tests call this library directly.
//! The local pipeline and the benchmarks are developer commands: `outbox-dev` (package `outbox-devtools`).
//!
//! # Layout
//!
//! The modules from the bottom up: each uses only modules listed before it. The test `tests/layering.rs`
//! checks the code against this list with the workspace's checker (`outbox-layering`): no arrow against it, no
//! arrow from a file up to its `mod.rs`, no circle between files.
//!
//! - `util`: what every command shares: the database URL and pool, the schema, figures and times as text.
//! - `status`: `outbox status`: the operator figures as a table or JSON.
//! - `flow_control`: QStash's flow-control keys of one tenant, paused and resumed there.
//! - `tenants`: `outbox tenants list|pause|resume`: the backlog per fairness key, one tenant held and released.
//! - `dead_letters`: `outbox dead-letters list|show|redrive|purge`.
//! - `prune`: `outbox prune`: retention by hand.
//! - `relay_cmd`: `outbox relay`: the relay drained from a shell.
//! - `subscribers`: `outbox subscribers add|remove|list`.
//! - `console`: `outbox console`: the web console (its pages read the figures of `status` and act through the
//!   library's dead-letter and fairness operations).

pub mod console;
pub mod dead_letters;
pub mod flow_control;
pub mod prune;
pub mod relay_cmd;
pub mod status;
pub mod subscribers;
pub mod tenants;
pub mod util;
