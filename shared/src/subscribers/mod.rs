//! Fan-out: one event, several subscribers (decision record 0068). Where a newcomer finds how each subscriber
//! gets every event once, in its own order, with its own retries and dead letters.
//!
//! A topic has one or more named subscribers (`outbox_subscribers`), each the base URL of a consumer whose
//! `CONSUMER_NAME` is the subscriber's name. The subscriber named `''` (shown as `default`) is the relay's
//! `CONSUMER_URL` / `CONSUMER_NAME`: every topic has it unless it was removed, so a deployment that never adds a
//! subscriber works as before.
//!
//! | Rule | Why |
//! |---|---|
//! | The producer's one statement writes a **copy** of each event per subscriber of its topic (an outbox row each, sharing the event's sequence; `event_id` names the first copy) | Each copy has its own lease, attempts, delivery evidence, dead letter and redrive: isolation is the relay's existing per-row machinery, and the copies commit with the business write, so no subscriber can miss an event the others got |
//! | An ordered key's relay state (`outbox_keys`) is per (topic, key, subscriber): a *lane* | A's dead head blocks A's lane only; B's slow consumer holds back B's events only |
//! | The relay publishes each copy to its subscriber's URL, with the subscriber in the flow-control key | QStash's per-key parallelism is per subscriber too: B's retries never take A's slot |
//! | The consumer's dedupe rows are keyed by its `CONSUMER_NAME`, the subscriber's name; the relay reads a named copy's dedupe row in that namespace | Once-only per subscriber ([`crate::once`]); the applied sweep and failure callbacks find the right row |
//! | [`add`] takes effect for every enqueue statement that starts after it commits | Statements read the subscriber list with their snapshot; per key, the copies a new subscriber gets are a suffix of the key's events, so its lane starts where its first copy is |
//! | [`add`] with a start ([`Start`]) first waits until every transaction older than the subscriber is over, then [`replay_step`] copies the retained events from the start up to that point that have no copy for it, in event order, a chunk per transaction (copies and cursor together) | Exactly the events it would otherwise miss, each once; a crash resumes from the cursor |
//! | While a subscriber replays, its ordered lanes wait (`available_at = 'infinity'`, also for lanes producers open meanwhile); each lane then starts at its first replayed sequence | A key's live events never overtake its replayed history |
//! | [`remove`] marks the subscriber removed, waits for older transactions, then deletes its unfinished copies and lanes; dead-lettered copies and dead letters stay | Deliveries stop; nothing it failed on is lost from view |
//!
//! Replay reaches what the outbox still holds: events are kept `OUTBOX_RETENTION_HOURS` after they are done for
//! their subscriber (`docs/operations.md` gives the storage cost). A replay under way holds what it has still to
//! read, however old: row retention and partition drops skip those rows
//! ([`crate::relay::partitions::held_by_replay`]), so a replay interrupted and resumed later copies the same history
//! it would have copied in one go (an ordered lane never waits at a gap retention made meanwhile).

mod add;
mod destinations;
mod error;
mod names;
mod remove;
mod replay;
pub mod status;
mod stored;

pub use add::{Added, Ensured, Start, add, add_again, ensure};
pub use destinations::Destinations;
pub use error::SubscriberError;
pub use names::{DEFAULT, label, parse_name, record_default_consumer};
pub use remove::{Removed, remove};
pub use replay::{ReplayProgress, release_waiting_lanes, replay, replay_step};
pub use stored::{Replay, Subscriber, check_replay_parallelism, get, list, set_replay_parallelism};

#[cfg(test)]
mod tests {
    use super::names::check_url;
    use super::*;

    #[test]
    fn names() {
        assert_eq!(parse_name("default").unwrap(), "");
        assert_eq!(parse_name("billing-eu.v2").unwrap(), "billing-eu.v2");
        for bad in ["", "Billing", "-x", "a b", "a/b", &"x".repeat(64)] {
            assert!(parse_name(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn urls() {
        assert_eq!(
            check_url("b", "https://billing.example/").unwrap(),
            "https://billing.example"
        );
        assert!(check_url("b", "ftp://x").is_err());
        assert!(check_url("b", "billing").is_err());
        assert!(check_url("b", "https://x/?a=1").is_err());
        assert!(check_url("b", "http://127.0.0.1:9").is_ok());
        assert!(check_url("b", "http://localhost:8080").is_ok());
        assert!(check_url("b", "http://[::1]:8080").is_ok());
        let e = check_url("b", "http://billing.example.com")
            .unwrap_err()
            .to_string();
        assert!(e.contains("use https"), "{e}");
    }

    #[test]
    fn starts() {
        assert_eq!("now".parse::<Start>(), Ok(Start::Now));
        assert_eq!("42".parse::<Start>(), Ok(Start::FromId(42)));
        assert!(matches!(
            "2026-12-01T00:00:00Z".parse::<Start>(),
            Ok(Start::Since(_))
        ));
        assert!("0".parse::<Start>().is_err());
        assert!("yesterday".parse::<Start>().is_err());
    }
}
