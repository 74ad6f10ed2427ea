//! What `bench cost` runs: the configurations (the seed's, the deployment's defaults, fan-out to 3 subscribers, the
//! defaults with delivery callbacks; each ordered and unordered) and the sizes of a run, full and `--quick`.

use std::time::Duration;

use super::prices::template_default;

/// One configuration of the pipeline, run at a steady rate.
#[derive(Clone, Debug)]
pub struct Scenario {
    /// Short name (`--only`, the JSON).
    pub name: String,
    /// What the table calls it.
    pub label: &'static str,
    pub ordered: bool,
    /// Subscribers of the topic (the default one and `subscribers - 1` named ones).
    pub subscribers: usize,
    /// The relay's variables that make this configuration (on top of the template's defaults).
    pub env: Vec<(&'static str, String)>,
}

/// The deployment's defaults for batching and evidence: `template.yaml`'s parameters (50 events per message,
/// evidence from the consumer's transaction, outcomes from the dedupe rows: no delivery callbacks).
fn template_env() -> Vec<(&'static str, String)> {
    [
        ("RELAY_DELIVERY_BATCH", "RelayDeliveryBatch"),
        ("RELAY_ORDERED_EVIDENCE", "RelayOrderedEvidence"),
        ("RELAY_UNORDERED_EVIDENCE", "RelayUnorderedEvidence"),
    ]
    .into_iter()
    .filter_map(|(var, param)| template_default(param).map(|v| (var, v)))
    .collect()
}

/// The configurations, in the order the table shows them.
pub fn scenarios() -> Vec<Scenario> {
    let seed = vec![
        ("RELAY_DELIVERY_BATCH", "1".to_owned()),
        ("RELAY_ORDERED_EVIDENCE", "callback".to_owned()),
        ("RELAY_UNORDERED_EVIDENCE", "callback".to_owned()),
    ];
    let defaults = template_env();
    let mut callbacks = defaults.clone();
    callbacks.retain(|(k, _)| !k.ends_with("_EVIDENCE"));
    callbacks.extend([
        ("RELAY_ORDERED_EVIDENCE", "callback".to_owned()),
        ("RELAY_UNORDERED_EVIDENCE", "callback".to_owned()),
    ]);
    let mut out = Vec::new();
    for ordered in [true, false] {
        let kind = if ordered { "ordered" } else { "unordered" };
        for (base, label, subscribers, env) in [
            (
                "seed",
                "the seed: one message per event, a delivery callback each",
                1,
                &seed,
            ),
            ("defaults", "the defaults (template.yaml)", 1, &defaults),
            ("fanout3", "the defaults, 3 subscribers", 3, &defaults),
            (
                "callbacks",
                "the defaults with delivery callbacks (a consumer on its own database)",
                1,
                &callbacks,
            ),
        ] {
            out.push(Scenario {
                name: format!("{base}-{kind}"),
                label,
                ordered,
                subscribers,
                env: env.clone(),
            });
        }
    }
    out
}

/// The sizes of a run.
#[derive(Clone, Debug)]
pub struct Plan {
    /// Events per second the producer commits (one event per transaction).
    pub rate: u32,
    /// How long it produces, within the relay's first invocation.
    pub produce: Duration,
    /// Keys the events are spread over.
    pub keys: u64,
    /// The relay invocation's time to its deadline (the function's timeout); `None`: the template's default.
    pub invocation: Option<Duration>,
    /// Relay variables that make a short invocation possible (`--quick`).
    pub relay_env: Vec<(&'static str, String)>,
}

impl Plan {
    pub fn new(quick: bool, rate: u32) -> Plan {
        if quick {
            Plan {
                rate,
                produce: Duration::from_secs(1),
                keys: 10,
                invocation: Some(Duration::from_secs(6)),
                // A 6 s invocation with a 2 s lease and a 0.5 s margin claims for 3.5 s.
                relay_env: vec![
                    ("RELAY_LEASE_SECS", "2".to_owned()),
                    ("RELAY_DEADLINE_MARGIN_MS", "500".to_owned()),
                ],
            }
        } else {
            Plan {
                rate,
                produce: Duration::from_secs(50),
                keys: 100,
                invocation: None,
                relay_env: Vec::new(),
            }
        }
    }

    /// Events one scenario produces.
    pub fn events(&self) -> u64 {
        (f64::from(self.rate) * self.produce.as_secs_f64()).round() as u64
    }
}
