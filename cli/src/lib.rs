//! The operator CLI's library: the commands operators run against a real database (migrate, status, dead
//! letters, prune, relay, the web console). The binary `outbox` only parses arguments; the tests call this library directly.
//! The local pipeline and the benchmarks are developer commands: `outbox-dev` (package `outbox-devtools`).

pub mod console;
pub mod dead_letters;
pub mod prune;
pub mod relay_cmd;
pub mod status;
pub mod subscribers;
pub mod util;
