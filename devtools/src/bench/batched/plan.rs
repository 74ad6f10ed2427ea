//! What a batched-deliveries run measures ([`BatchedPlan`]): the N values compared and the sizes of each scenario,
//! and how N reaches the relay (its `RELAY_DELIVERY_BATCH` variable).

/// The relay variable N is passed in.
pub const DELIVERY_BATCH_VAR: &str = "RELAY_DELIVERY_BATCH";

/// The N values measured when none are given: 1 (one event per message, the behaviour before batching) and the
/// default (`outbox::config::DEFAULT_DELIVERY_BATCH`).
pub fn default_ns() -> Vec<u32> {
    let mut ns = vec![1, outbox::config::DEFAULT_DELIVERY_BATCH];
    ns.dedup();
    ns
}

/// Sizes of one batched-deliveries run.
#[derive(Debug, Clone)]
pub struct BatchedPlan {
    /// Events per message to compare (`RELAY_DELIVERY_BATCH`), ascending; the first (smallest) is the baseline.
    pub ns: Vec<u32>,
    /// Rounds per throughput point (medians are reported).
    pub rounds: usize,
    pub ordered_keys: u64,
    pub ordered_per_key: u64,
    pub hot_key_events: u64,
    /// Rounds of the hot-key drain (one is 10,000 delivery round trips at N = 1 in the full report).
    pub hot_key_rounds: usize,
    pub unordered_events: u64,
    pub latency_rate: u32,
    pub latency_secs: f64,
}

impl BatchedPlan {
    /// The sizes of the full report (`quick`: a smoke run of a few seconds per N).
    pub fn new(ns: &[u32], quick: bool, rounds: usize) -> BatchedPlan {
        let mut ns = ns.to_vec();
        ns.sort_unstable();
        ns.dedup();
        if quick {
            BatchedPlan {
                ns,
                rounds,
                ordered_keys: 100,
                ordered_per_key: 5,
                hot_key_events: 200,
                hot_key_rounds: 1,
                unordered_events: 1_000,
                latency_rate: 20,
                latency_secs: 3.0,
            }
        } else {
            BatchedPlan {
                ns,
                rounds,
                ordered_keys: 1_000,
                ordered_per_key: 20,
                hot_key_events: 10_000,
                hot_key_rounds: 1,
                unordered_events: 20_000,
                latency_rate: 20,
                latency_secs: 20.0,
            }
        }
    }
}

pub(super) fn env(n: u32) -> Vec<(&'static str, String)> {
    vec![(DELIVERY_BATCH_VAR, n.to_string())]
}
