//! The sizes of each part of `bench fanout`, full and `--quick`.

pub(super) struct Plan {
    pub(super) keys: u64,
    pub(super) per_key: u64,
    pub(super) unordered: u64,
    pub(super) replay_keys: u64,
    pub(super) replay_per_key: u64,
    pub(super) live_rate: u64,
    pub(super) baseline_secs: f64,
    pub(super) outage_rate: u64,
    pub(super) outage_keys: u64,
    pub(super) outage_before_secs: f64,
    pub(super) outage_down_secs: f64,
    pub(super) outage_after_secs: f64,
    pub(super) producer_events: u64,
}

impl Plan {
    pub(super) fn new(quick: bool) -> Plan {
        if quick {
            Plan {
                keys: 50,
                per_key: 4,
                unordered: 500,
                replay_keys: 50,
                replay_per_key: 20,
                live_rate: 50,
                baseline_secs: 2.0,
                outage_rate: 50,
                outage_keys: 20,
                outage_before_secs: 2.0,
                outage_down_secs: 5.0,
                outage_after_secs: 2.0,
                producer_events: 400,
            }
        } else {
            Plan {
                keys: 1_000,
                per_key: 20,
                unordered: 20_000,
                replay_keys: 1_000,
                replay_per_key: 100,
                live_rate: 100,
                baseline_secs: 10.0,
                outage_rate: 100,
                outage_keys: 100,
                outage_before_secs: 10.0,
                outage_down_secs: 60.0,
                outage_after_secs: 5.0,
                producer_events: 8_000,
            }
        }
    }
}
