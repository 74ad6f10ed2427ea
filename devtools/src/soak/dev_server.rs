//! The QStash dev server as a soak runs it: its clock and its faults.

use std::time::Duration;

/// The dev server's clock: QStash's retry delays ×0.05.
pub(crate) const TIME_SCALE: f64 = 0.05;

/// The dev server's configuration for a soak (seeded; QStash's clock at [`TIME_SCALE`]) and the faults it runs
/// with: 10 % of publishes fail, 5 % lose their response, 10 % of deliveries come twice, 5 % fail in the network.
pub(crate) fn dev_server_config(seed: u64) -> (qstash_dev::Config, qstash_dev::Faults) {
    let faults = qstash_dev::Faults {
        publish_5xx_rate: 0.10,
        publish_drop_response_rate: 0.05,
        duplicate_delivery_rate: 0.10,
        delivery_network_error_rate: 0.05,
        ..Default::default()
    };
    let cfg = qstash_dev::Config {
        port: 0,
        seed,
        time_scale: TIME_SCALE,
        waitlist_order: qstash_dev::WaitlistOrder::Shuffled,
        // Shorter than the relays' evidence timeout (20 s below): when an ordered head's delivery callback is
        // lost, the relay republishes it after that timeout with the same deduplication id, and within the
        // window QStash would swallow the republish — the key would wait out the whole window (10 min).
        dedup_window: Duration::from_secs(10),
        faults: faults.clone(),
        ..qstash_dev::Config::default()
    };
    (cfg, faults)
}
