//! [`DeadHeadPolicy`]: what happens to the later events of an ordered key whose head is dead.

/// What happens to the later events of an ordered key whose head is dead.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeadHeadPolicy {
    /// The key stops until an operator redrives or discards the head (default).
    Block,
    /// The head is recorded as a dead letter and the key moves on.
    Skip,
}

impl DeadHeadPolicy {
    /// The policy for `topic`: [`DeadHeadPolicy::Skip`] when it is one of `skip_topics`
    /// (`RELAY_SKIP_DEAD_HEAD_TOPICS`), else [`DeadHeadPolicy::Block`]. The relay and the callback function
    /// decide alike ([`crate::config::RelayConfig::dead_head_policy`], [`crate::config::ConsumerConfig::dead_head_policy`]).
    pub fn for_topic(skip_topics: &[String], topic: &str) -> Self {
        if skip_topics.iter().any(|t| t == topic) {
            DeadHeadPolicy::Skip
        } else {
            DeadHeadPolicy::Block
        }
    }
}
