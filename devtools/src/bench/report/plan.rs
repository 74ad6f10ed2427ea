//! The sizes of one report run, full and `--quick`, from its arguments.

use super::args::ReportArgs;
use crate::bench::batched::BatchedPlan;
use crate::bench::support::Knobs;

/// Sizes of one report run.
pub(super) struct Plan {
    pub(super) quick: bool,
    pub(super) rounds: usize,
    pub(super) unordered_events: u64,
    pub(super) batches: Vec<u32>,
    pub(super) concurrencies: Vec<u32>,
    pub(super) base: Knobs,
    /// (keys, events per key).
    pub(super) ordered: Vec<(u64, u64)>,
    pub(super) consumer_secs: f64,
    pub(super) steady_rate: u32,
    pub(super) steady_secs: f64,
    pub(super) xmin_events: u64,
    pub(super) batched: BatchedPlan,
}

impl Plan {
    pub(super) fn from(args: &ReportArgs) -> Plan {
        let base = Knobs {
            batch: 500,
            concurrency: 8,
            qstash_batch: 250,
        };
        if args.quick {
            Plan {
                quick: true,
                rounds: args.rounds.unwrap_or(1),
                unordered_events: 5_000,
                batches: vec![100, 500],
                concurrencies: vec![2, 8],
                base,
                ordered: vec![(10, 10), (100, 4)],
                consumer_secs: 1.0,
                steady_rate: 50,
                steady_secs: 3.0,
                xmin_events: args.xmin_events.unwrap_or(10_000),
                batched: BatchedPlan::new(&args.delivery_batch, true, args.rounds.unwrap_or(1)),
            }
        } else {
            Plan {
                quick: false,
                rounds: args.rounds.unwrap_or(3),
                unordered_events: 50_000,
                batches: vec![50, 100, 250, 500, 1000],
                concurrencies: vec![1, 2, 4, 8, 16],
                base,
                ordered: vec![(10, 50), (100, 20), (1000, 10)],
                consumer_secs: 3.0,
                steady_rate: 200,
                steady_secs: 20.0,
                xmin_events: args.xmin_events.unwrap_or(100_000),
                batched: BatchedPlan::new(&args.delivery_batch, false, args.rounds.unwrap_or(3)),
            }
        }
    }
}
