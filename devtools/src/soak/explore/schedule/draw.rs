//! The draw ([`Schedule::draw`]): from the seed alone, traffic phases up to 85 % of the length, faults and
//! operator actions as Poisson arrivals over all of it, the actions drawn over a model of who is subscribed to
//! what, some of them with a Postgres crash in the middle.

use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::layout::{INITIAL, KEYS, RELAYS, SUBSCRIBERS, TOPICS};
use super::op::{DevFault, From, Op, ReplayMode, Selection, Target};
use super::timeline::{Schedule, Step};

/// The share of the length with traffic.
const TRAFFIC_SHARE: f64 = 0.85;
/// Mean seconds between two faults.
const FAULT_EVERY: f64 = 3.0;
/// Mean seconds between two operator actions.
const ACTION_EVERY: f64 = 4.0;

/// The draw's model of the run: who is subscribed, whose replay waits for a resume.
struct Model {
    subscribed: [[bool; 4]; 4],
    interrupted: Vec<(usize, usize)>,
}

impl Schedule {
    /// The schedule of `seed` over `length`.
    pub fn draw(seed: u64, length: Duration) -> Schedule {
        let mut rng = StdRng::seed_from_u64(seed ^ 0x5c4e_d01e);
        let total = length.as_secs_f64();
        let mut steps = Vec::new();
        let at = |t: f64, op: Op, steps: &mut Vec<Step>| {
            steps.push(Step {
                at: Duration::from_secs_f64(t.clamp(0.0, total)),
                op,
            })
        };

        // Traffic phases: quiet, steady, bursts.
        let traffic_end = total * TRAFFIC_SHARE;
        let mut t = 0.0;
        while t < traffic_end {
            let roll = rng.random_range(0..100u32);
            let (rate, len) = match roll {
                0..15 => (rng.random_range(0.0..3.0), rng.random_range(3.0..10.0)),
                15..75 => (rng.random_range(10.0..40.0), rng.random_range(5.0..20.0)),
                _ => (rng.random_range(60.0..120.0), rng.random_range(2.0..6.0)),
            };
            let op = Op::Traffic {
                rate,
                poison: rng.random_range(0.0..0.04),
                delayed: rng.random_range(0.0..0.05),
            };
            at(t, op, &mut steps);
            t += len;
        }
        at(
            traffic_end,
            Op::Traffic {
                rate: 0.0,
                poison: 0.0,
                delayed: 0.0,
            },
            &mut steps,
        );

        // Faults.
        let mut t = rng.random_range(1.0..2.0 * FAULT_EVERY);
        while t < total {
            let op = draw_fault(&mut rng);
            // Sometimes a redrive while messages are being lost: a dead letter of a lost message, redriven, is
            // lost again.
            if let Op::Dev {
                fault: DevFault::LoseMessages,
                secs,
            } = op
                && rng.random_bool(0.5)
            {
                let redrive = Op::Redrive(Selection {
                    topic: Some(rng.random_range(0..TOPICS.len())),
                    subscriber: None,
                    key: None,
                    poison: false,
                });
                at(t + rng.random_range(0.0..secs), redrive, &mut steps);
            }
            at(t, op, &mut steps);
            t += exponential(&mut rng, FAULT_EVERY);
        }

        // Operator actions, over the model.
        let mut model = Model {
            subscribed: INITIAL,
            interrupted: Vec::new(),
        };
        let mut t = rng.random_range(2.0..2.0 * ACTION_EVERY);
        while t < total - 2.0 {
            let mut ops = draw_action(&mut rng, &mut model);
            // Sometimes a Postgres crash in the middle of the action: its replay, its partition drop, …
            if rng.random_bool(0.04) {
                let dt: f64 = rng.random_range(0.1..1.5);
                let down_secs = rng.random_range(0.5..4.0);
                match ops.first_mut() {
                    Some((_, op)) => {
                        *op = Op::CrashDuring {
                            action: Box::new(op.clone()),
                            after_ms: ((dt - 0.1) / 1.4 * 150.0) as u32,
                            down_secs,
                        }
                    }
                    None => ops.push((dt, Op::PgCrash { down_secs })),
                }
            }
            for (dt, op) in ops {
                at(t + dt, op, &mut steps);
            }
            t += exponential(&mut rng, ACTION_EVERY);
        }
        steps.sort_by_key(|a| a.at);
        Schedule {
            seed,
            length,
            steps,
        }
    }
}

fn exponential(rng: &mut StdRng, mean: f64) -> f64 {
    -mean * (1.0 - rng.random::<f64>()).ln()
}

fn draw_target(rng: &mut StdRng) -> Target {
    match rng.random_range(0..9u32) {
        0..4 => Target::Relay(rng.random_range(0..RELAYS)),
        4..8 => Target::Consumer(rng.random_range(0..SUBSCRIBERS.len())),
        _ => Target::Callback,
    }
}

fn draw_fault(rng: &mut StdRng) -> Op {
    match rng.random_range(0..20u32) {
        0..6 => Op::Kill(draw_target(rng)),
        6 | 7 => Op::Down {
            target: if rng.random_bool(0.6) {
                Target::Consumer(rng.random_range(0..SUBSCRIBERS.len()))
            } else {
                Target::Callback
            },
            secs: rng.random_range(2.0..15.0),
        },
        8 => Op::Slow {
            sub: rng.random_range(0..SUBSCRIBERS.len()),
            secs: rng.random_range(3.0..15.0),
            ms: rng.random_range(20..300),
        },
        9..13 => Op::Dev {
            fault: match rng.random_range(0..4u32) {
                0 => DevFault::Outage,
                1 => DevFault::LoseMessages,
                2 => DevFault::DropPublishResponses,
                _ => DevFault::LoseDeliveryResponses,
            },
            secs: rng.random_range(2.0..12.0),
        },
        13..16 => Op::Backends {
            relays: rng.random_bool(0.5),
        },
        16..19 => Op::LongTransaction {
            secs: rng.random_range(2.0..20.0),
            topic: rng.random_range(0..TOPICS.len()),
        },
        _ => Op::PgCrash {
            down_secs: rng.random_range(0.5..4.0),
        },
    }
}

fn draw_selection(rng: &mut StdRng) -> Selection {
    loop {
        let s = Selection {
            topic: rng
                .random_bool(0.5)
                .then(|| rng.random_range(0..TOPICS.len())),
            subscriber: rng
                .random_bool(0.5)
                .then(|| rng.random_range(0..SUBSCRIBERS.len())),
            key: rng.random_bool(0.2).then(|| rng.random_range(0..KEYS)),
            poison: rng.random_bool(0.4),
        };
        if s.topic.is_some() || s.subscriber.is_some() || s.key.is_some() || s.poison {
            return s;
        }
    }
}

/// One operator action (and what follows it closely), with offsets from its time, applied to the model.
fn draw_action(rng: &mut StdRng, m: &mut Model) -> Vec<(f64, Op)> {
    let roll = rng.random_range(0..22u32);
    match roll {
        // Add a subscriber that is not on a topic.
        0..5 => {
            let free: Vec<(usize, usize)> = pairs(|t, s| s > 0 && !m.subscribed[t][s]);
            let Some(&(topic, sub)) = pick(rng, &free) else {
                return Vec::new();
            };
            m.subscribed[topic][sub] = true;
            let from = match rng.random_range(0..3u32) {
                0 => From::Now,
                _ => From::Back {
                    secs: rng.random_range(5..60),
                },
            };
            let replay = if from != From::Now && rng.random_bool(0.3) {
                m.interrupted.push((topic, sub));
                ReplayMode::Interrupted {
                    chunks: rng.random_range(1..4),
                }
            } else {
                ReplayMode::Whole
            };
            vec![(
                0.0,
                Op::Add {
                    topic,
                    sub,
                    from,
                    replay,
                },
            )]
        }
        // Remove a named subscriber (the default one stays); often add it again from before the removal.
        5..9 => {
            let on: Vec<(usize, usize)> = pairs(|t, s| s > 0 && m.subscribed[t][s]);
            let Some(&(topic, sub)) = pick(rng, &on) else {
                return Vec::new();
            };
            m.subscribed[topic][sub] = false;
            m.interrupted.retain(|p| *p != (topic, sub));
            let mut ops = vec![(0.0, Op::Remove { topic, sub })];
            if rng.random_bool(0.5) {
                m.subscribed[topic][sub] = true;
                let from = if rng.random_bool(0.75) {
                    From::BeforeRemoval {
                        secs: rng.random_range(1..20),
                    }
                } else {
                    From::Now
                };
                ops.push((
                    rng.random_range(0.5..6.0),
                    Op::Add {
                        topic,
                        sub,
                        from,
                        replay: ReplayMode::Whole,
                    },
                ));
            }
            ops
        }
        9 | 10 => match m.interrupted.is_empty() {
            true => Vec::new(),
            false => {
                let (topic, sub) = m
                    .interrupted
                    .remove(rng.random_range(0..m.interrupted.len()));
                vec![(0.0, Op::Resume { topic, sub })]
            }
        },
        11 | 12 => {
            let mut ops = vec![(0.0, Op::Cure)];
            if rng.random_bool(0.7) {
                ops.push((rng.random_range(0.2..3.0), Op::Redrive(draw_selection(rng))));
            }
            ops
        }
        13..16 => vec![(0.0, Op::Redrive(draw_selection(rng)))],
        16 | 17 => vec![(
            0.0,
            Op::Purge {
                selection: draw_selection(rng),
                handled_only: rng.random_bool(0.5),
            },
        )],
        18 | 19 => vec![(
            0.0,
            Op::Prune {
                retention_secs: rng.random_range(10..90),
            },
        )],
        _ => vec![(
            0.0,
            Op::Partitions {
                retention_secs: rng.random_range(10..90),
            },
        )],
    }
}

fn pairs(keep: impl Fn(usize, usize) -> bool) -> Vec<(usize, usize)> {
    (0..TOPICS.len())
        .flat_map(|t| (0..SUBSCRIBERS.len()).map(move |s| (t, s)))
        .filter(|&(t, s)| keep(t, s))
        .collect()
}

fn pick<'a, T>(rng: &mut StdRng, v: &'a [T]) -> Option<&'a T> {
    (!v.is_empty()).then(|| &v[rng.random_range(0..v.len())])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_same_seed_draws_the_same_schedule_and_another_seed_another() {
        let a = Schedule::draw(42, Duration::from_secs(120)).to_string();
        assert_eq!(a, Schedule::draw(42, Duration::from_secs(120)).to_string());
        assert_ne!(a, Schedule::draw(43, Duration::from_secs(120)).to_string());
    }

    #[test]
    fn a_schedule_mixes_traffic_faults_and_actions_within_its_length() {
        let s = Schedule::draw(7, Duration::from_secs(180));
        assert!(s.steps.windows(2).all(|w| w[0].at <= w[1].at));
        assert!(s.steps.iter().all(|st| st.at <= s.length));
        let counts = s.counts();
        for kind in ["traffic", "add", "remove", "postgres crash"] {
            assert!(counts.contains_key(kind), "{kind} missing: {counts:?}");
        }
        assert!(s.steps.iter().filter(|st| st.op.is_action()).count() > 20);
    }
}
