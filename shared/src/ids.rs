//! The values that name an event as it crosses modules: its outbox id, its topic's name, its partition key, a
//! relay's lease on a key, and a dead letter's id. Plain newtypes over what the tables store (`bigint`, `text`): they bind and decode
//! directly in SQL (`sqlx::Type`, transparent), serialise as the bare value (`serde(transparent)`, so the wire
//! contract is unchanged), and print as the bare value (`Display`). They add no validation: the producer checks
//! topics and keys when an event is written (the `producer` module), and the contract parser checks what arrives.

use std::borrow::Borrow;
use std::fmt;

use serde::{Deserialize, Serialize};

/// Defines a newtype over a table's `bigint` id with the accessors every id shares.
macro_rules! int_newtype {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, sqlx::Type)]
        #[serde(transparent)]
        #[sqlx(transparent)]
        pub struct $name(pub i64);

        impl $name {
            /// The id as stored.
            pub const fn get(self) -> i64 {
                self.0
            }
        }

        impl From<i64> for $name {
            fn from(id: i64) -> Self {
                $name(id)
            }
        }

        impl From<$name> for i64 {
            fn from(id: $name) -> Self {
                id.0
            }
        }

        /// The decimal id, as an operator types it.
        impl std::str::FromStr for $name {
            type Err = std::num::ParseIntError;

            fn from_str(s: &str) -> Result<Self, Self::Err> {
                s.parse().map($name)
            }
        }

        impl PartialEq<i64> for $name {
            fn eq(&self, other: &i64) -> bool {
                self.0 == *other
            }
        }

        /// Prints the bare value, like `Display`: log fields written with `?` (a list of ids, a result holding
        /// ids) read as they did when the ids were plain integers.
        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::Debug::fmt(&self.0, f)
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::Display::fmt(&self.0, f)
            }
        }

    };
}

int_newtype!(
    /// An outbox event's id: the `outbox.id` the producer's insert returned. The consumer's dedupe key, the
    /// subject of delivery evidence and of dead letters. Positive for every stored event.
    OutboxId
);

int_newtype!(
    /// A dead letter's id: `dead_letters.id`, what an operator names to show, redrive or purge one (never an
    /// event's id: a dead letter names its event by [`OutboxId`]).
    DeadLetterId
);

/// Defines a newtype over `String` with the accessors both text values share.
macro_rules! text_newtype {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(
            Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Default, Serialize, Deserialize, sqlx::Type,
        )]
        #[serde(transparent)]
        #[sqlx(transparent)]
        pub struct $name(String);

        impl $name {
            /// Wraps a value as is (no validation: see the module docs).
            pub fn new(value: impl Into<String>) -> Self {
                $name(value.into())
            }

            /// The value.
            pub fn as_str(&self) -> &str {
                &self.0
            }

            /// The value, owned.
            pub fn into_string(self) -> String {
                self.0
            }
        }

        impl From<String> for $name {
            fn from(value: String) -> Self {
                $name(value)
            }
        }

        impl From<&str> for $name {
            fn from(value: &str) -> Self {
                $name(value.to_owned())
            }
        }

        impl From<$name> for String {
            fn from(value: $name) -> Self {
                value.0
            }
        }

        impl AsRef<str> for $name {
            fn as_ref(&self) -> &str {
                &self.0
            }
        }

        impl Borrow<str> for $name {
            fn borrow(&self) -> &str {
                &self.0
            }
        }

        impl std::ops::Deref for $name {
            type Target = str;
            fn deref(&self) -> &str {
                &self.0
            }
        }

        impl PartialEq<str> for $name {
            fn eq(&self, other: &str) -> bool {
                self.0 == other
            }
        }

        impl PartialEq<&str> for $name {
            fn eq(&self, other: &&str) -> bool {
                self.0 == *other
            }
        }

        /// The quoted value, as a `String`'s `Debug` (see [`OutboxId`]'s).
        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::Debug::fmt(&self.0, f)
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }
    };
}

text_newtype!(
    /// A topic's name, as stored in `outbox.topic` and carried in the envelope and the destination URL. Where it
    /// comes from: the producer's `Topic` (which adds the topic's ordering and validates the
    /// name when an event is written). Not to be confused with that `Topic`, which is the producer's declaration.
    TopicName
);

text_newtype!(
    /// An event's partition key, as the producer wrote it (`outbox.partition_key`, the envelope's `key`). Ordered
    /// topics keep the events of one key in order; the producer validates it when the event is written.
    PartitionKey
);

/// A relay's lease on an ordered key: the key, and the fencing token its claim drew from
/// `outbox_lease_token_seq`. Settling or releasing the key checks the token, so a relay whose lease expired (and
/// was taken over) changes nothing.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct KeyLease {
    /// The key's topic.
    pub topic: TopicName,
    /// The key.
    pub key: PartitionKey,
    /// The subscriber whose lane of the key it is (`''`: the default one). One claim's token covers the lanes of
    /// every subscriber it claimed, so the lane is part of the lease.
    pub subscriber: String,
    /// The fencing token of the claim.
    pub token: i64,
}

/// Whether `name` may name a subscriber (as stored, other than the default subscriber's `''`): 1 to 63 lower-case
/// letters, digits, `_`, `.` or `-`, starting with a letter or digit. It is the subscriber's consumer's
/// `CONSUMER_NAME`, and appears in flow-control keys and metric dimensions.
pub(crate) fn is_subscriber_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 63
        && name
            .bytes()
            .next()
            .is_some_and(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
        && name.bytes().all(|b| {
            b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'_' | b'.' | b'-')
        })
}

/// Longest topic name (it becomes part of the consumer URL path).
pub(crate) const MAX_TOPIC_CHARS: usize = 100;

/// Whether `name` may name a topic: 1–100 characters of `A-Z a-z 0-9 . _ -` (it becomes a URL path segment).
pub(crate) fn is_topic_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_TOPIC_CHARS
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn serialise_as_the_bare_value() {
        let json = serde_json::to_string(&(
            OutboxId(7),
            TopicName::from("orders"),
            PartitionKey::from("k-1"),
        ))
        .unwrap();
        assert_eq!(json, r#"[7,"orders","k-1"]"#);
        let back: (OutboxId, TopicName, PartitionKey) = serde_json::from_str(&json).unwrap();
        assert_eq!(back.0, OutboxId(7));
        assert_eq!(back.1, "orders");
        assert_eq!(back.2.as_str(), "k-1");
    }

    #[test]
    fn debug_reads_as_the_bare_value() {
        assert_eq!(format!("{:?}", vec![OutboxId(1), OutboxId(2)]), "[1, 2]");
        assert_eq!(format!("{:?}", TopicName::from("a\"b")), r#""a\"b""#);
    }

    #[test]
    fn display_is_the_bare_value() {
        assert_eq!(OutboxId(42).to_string(), "42");
        assert_eq!(TopicName::from("a.b").to_string(), "a.b");
        assert_eq!(PartitionKey::from("x y").to_string(), "x y");
    }
}
