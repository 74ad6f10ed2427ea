//! The run's fixed layout, the same for every seed: its topics, subscribers, partition keys and relay processes,
//! who is subscribed to what at the start, and a subscriber's label as the CLI shows it.

use outbox::Topic;

/// The explorer's topics: an ordered one whose dead heads block their lane, an ordered one whose dead heads are
/// skipped (`RELAY_SKIP_DEAD_HEAD_TOPICS`), two unordered ones.
pub static TOPICS: [Topic; 4] = [
    Topic::ordered("x.ordered"),
    Topic::ordered("x.ordered.skip"),
    Topic::unordered("x.unordered"),
    Topic::unordered("x.unordered.2"),
];

/// Index in [`TOPICS`] of the ordered topic whose dead heads are skipped.
pub const SKIP_DEAD_HEADS: usize = 1;

/// The subscribers (stored names): the default one (`""`, the relays' `CONSUMER_URL`) and three named ones. Each
/// has a consumer process of its own for the whole run, subscribed or not.
pub const SUBSCRIBERS: [&str; 4] = ["", "s1", "s2", "s3"];

/// Partition keys per topic.
pub const KEYS: u32 = 12;

/// Who is subscribed to what at the start (`[topic][subscriber]`): the default subscriber everywhere, `s1` on
/// every topic, `s2` on the first ordered and the first unordered topic, `s3` nowhere.
pub const INITIAL: [[bool; 4]; 4] = [
    [true, true, true, false],
    [true, true, false, false],
    [true, true, true, false],
    [true, true, false, false],
];

/// The label of subscriber `i` as the CLI shows it.
pub fn label(sub: usize) -> &'static str {
    match SUBSCRIBERS[sub] {
        "" => "default",
        s => s,
    }
}

/// Relay processes of a run.
pub const RELAYS: usize = 2;
