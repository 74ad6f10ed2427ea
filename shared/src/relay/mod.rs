//! Guarantee 1 in transit — **no event is lost between the outbox and QStash** — and the relay side of
//! per-key order.
//!
//! One cycle is three short steps, never a lock held across the network (publishing inside the claim's
//! transaction would keep row locks and an old snapshot open for a network round trip, and leave the transaction
//! idle when the Lambda times out):
//!
//! 1. **Claim** ([`claim`]) in one committed statement per kind of topic: due rows (unordered) or key heads
//!    (ordered, see [`crate::ordering`]) get a lease with a fencing token, and their attempt is counted. The
//!    claim is triaged ([`triage`]): events whose budget claims that never settled used up are dead-lettered
//!    without a publish, and an ordered run shares its head's fate.
//! 2. **Publish** ([`publish`]) outside any transaction, through `/v2/batch`. Claimed events are formed into
//!    messages ([`forming`], decision record 0014): up to `RELAY_DELIVERY_BATCH` events per message (per topic:
//!    `RELAY_DELIVERY_BATCH_TOPICS`) under `QSTASH_MAX_MESSAGE_BYTES` — an ordered key's claimed run in sequence
//!    order, or an unordered topic's events in id order; with `RELAY_DELIVERY_BATCH=1`, one event per message as
//!    before batching. Each message carries its events' identity in the signed envelope ([`crate::contract`]), a
//!    deduplication id derived from its composition (`outbox-<id>` for one event), flow control (per key;
//!    per topic for an unordered message of several events), retries and the failure callback from config;
//!    ordered messages also carry the delivery callback that frees their key. A permanent refusal of a message
//!    of several events is retried one event per message in the same cycle. Each event gets one
//!    [`PublishedEvent`].
//! 3. **Settle** ([`settle`]), fenced on the lease token: every event of a message gets the message's outcome —
//!    dispatched, retry with full-jitter backoff ([`backoff`]), or dead letter (an ordered run's followers go back
//!    to pending behind their dead head); `decide.rs` has the table. A relay whose lease was taken over changes
//!    nothing. Steps 2 and 3 run as a pipeline (`pipeline.rs`, decision record 0018): each `/v2/batch` request is
//!    settled as soon as QStash answers it, in statements of whole messages of at most 500 rows, while the
//!    cycle's other requests are still out — so a delivered run's evidence never waits for the rest of its
//!    claim.
//!
//! Nothing is lost when a relay dies anywhere in between: an unsettled lease simply expires and the row is
//! claimed again; a publish whose response was lost is retried with the same deduplication id (QStash returns
//! the first message id inside its 10-minute window; after it, the consumer's dedupe absorbs the duplicate).
//! [`Relay::drain`] repeats cycles until the invocation's deadline; the retry budget ends in `dead_letters`.
//!
//! A cycle whose every publish request failed at request level (QStash down, unreachable, refusing the token
//! or URL, rate-limiting the account) is an outage, not each event's failure: the claim is given back without
//! spending an attempt and the relays wait for a shared probe ([`outage`], decision record 0012).
//!
//! | file | what |
//! |---|---|
//! | `mod.rs` | declarations and re-exports only |
//! | `cycle.rs` | [`Relay`] and one cycle, [`Relay::run_cycle`]: the steps above in order |
//! | `error.rs` | [`RelayError`] |
//! | `claim.rs` | step 1's statements and [`claim::ClaimedEvent`] |
//! | `triage.rs` | which claimed events are published, dead-lettered at once or held back (pure) |
//! | `forming.rs` | claimed events → QStash messages (pure) |
//! | `publish.rs` | step 2: `/v2/batch` requests, the fallbacks |
//! | `published.rs` | what step 2 answers: one [`PublishedEvent`] per event |
//! | `decide.rs` | each event's [`settle::Settlement`] from its triage and publish (pure) |
//! | `settle.rs` | step 3's statement |
//! | `pipeline.rs` | steps 2 and 3 per request: each answered request settled at once, in pieces |
//! | `backoff.rs` | the retry delay |
//! | `outage.rs` | the shared outage row and its probe |
//! | `drain.rs` | [`Relay::drain`]: cycles until the deadline, the outage gate |
//! | `stop.rs` | [`StopHandle`]: stop the drains after their cycle |
//! | `housekeeping.rs`, `handler.rs` | retention and pruning; the Lambda handler |
//!
//! *Lease*, *fencing token* and *dead letter* are defined in the repository's `docs/glossary.md`.

mod backoff;
pub(crate) mod claim;
mod cycle;
mod decide;
mod drain;
mod error;
pub(crate) mod forming;
pub(crate) mod handler;
pub(crate) mod housekeeping;
pub(crate) mod outage;
pub(crate) mod partitions;
pub(crate) mod pipeline;
mod publish;
pub(crate) mod published;
pub(crate) mod settle;
mod stop;
mod triage;

pub use cycle::{CycleReport, Relay};
pub use drain::{DrainSummary, Until};
pub use error::RelayError;
pub use handler::{InvocationSummary, RelayState, StartupError, handle};
pub use housekeeping::{
    HousekeepingReport, Retention, prune_consumer_sequences_batch, prune_dead_events_batch,
    prune_dead_letters_batch, prune_outbox_batch, prune_processed_batch, release_idle_keys,
};
pub use partitions::{PartitionReport, PartitionSettings, maintain};
pub use stop::StopHandle;
