//! The developer commands of `outbox-dev`, as a library (the whole-system tests run [`dev`] directly):
//!
//! * [`dev`]: the whole pipeline on one machine — the test kit's local stack (QStash-compatible dev server, relay,
//!   consumer and callback handlers) with the example application's demo producer, and live progress;
//! * [`bench`](mod@bench): the benchmarks (figures and one JSON line; never assertions);
//! * [`soak`]: the whole pipeline as separate processes under chaos (kills, terminated backends, Postgres
//!   restarts, a QStash outage), then an account of every event;
//! * [`events`]: the sample function-URL events in `events/`, re-signed with the dev key;
//! * [`example`]: the example application's migrations, for a database the consumer as shipped writes to.
//!
//! What operators run against a real database is the `outbox` CLI (`outbox-cli`); this is for developers of the
//! outbox and needs the dev server and the example (decision record 0010).

pub mod bench;
pub mod dev;
pub mod events;
pub mod example;
pub mod soak;
