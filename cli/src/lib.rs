//! The operator CLI's library: the local pipeline (a [`stack::LocalStack`] of the dev server, the consumer and
//! callback handlers on local listeners, and the relay), the commands, and the benchmarks. The binary `outbox`
//! only parses arguments; the whole-system tests use this library directly.

pub mod bench;
pub mod dead_letters;
pub mod dev;
pub mod prune;
pub mod relay_cmd;
pub mod stack;
pub mod status;
pub mod util;
