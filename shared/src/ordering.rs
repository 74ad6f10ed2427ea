//! Guarantee 3 — **per-key order where promised.**
//!
//! For a topic declared [`crate::Topic::ordered`], a consumer applies the events of one partition key in commit
//! order, even with several relays, retries, backoff and QStash's own retries. The contract has three parts:
//!
//! 1. **Producer: sequence = commit order.** Each ordered event takes the next number of its key from
//!    `outbox_sequences` with `INSERT … ON CONFLICT DO UPDATE` (in [`crate::producer`]'s statement). That row
//!    lock is held until the producer's transaction ends, so a second producer on the same key waits: the key's
//!    numbers are handed out in commit order, with no gaps (a rollback returns its numbers). Identity order
//!    would not do: T1 takes id 10, T2 takes id 11, T2 commits first.
//! 2. **Relay: one event per key in flight, gated on delivery evidence.** See `relay` (claim of key heads).
//! 3. **Consumer: sequence check.** See `once`.
