//! The QStash HTTP API (`/v2/...`).
//!
//! [`router()`] (`router.rs`) lists the routes; their handlers live in one file per section (`publish`,
//! `messages`, `dlq`, `queues`, `flow`, `keys`), reading requests with `request.rs` and answering with
//! `response.rs`. [`guarded`] puts routes behind the gate of `guard.rs` (Host/Origin check, token).
//! The server merges the inspection routes in before guarding them; this module uses neither the server nor
//! `inspect`.

mod dlq;
mod flow;
mod guard;
mod keys;
mod messages;
mod publish;
mod queues;
mod request;
mod response;
mod router;

pub(crate) use self::guard::guarded;
pub(crate) use self::router::router;
